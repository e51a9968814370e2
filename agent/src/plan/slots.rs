//! Step 5's counter slots: each touched peer keeps its slot, and a new peer gets one no entry
//! uses, or one whose every entry the lead deletes; never a slot a remaining peer uses. At a
//! full map, slots stranded by shared or abandoned entries are rotated through the lead.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use super::{index::count_up, op::Op, planner::Planner, unplanned::PlanError};

/// A peer's tunnel addresses (one or two), without an allocation.
type Addrs = smallvec::SmallVec<[IpAddr; 2]>;

impl<'a> Planner<'a> {
    /// Entries per counter slot that the lead deletes.
    fn deleted_per_slot(&self) -> BTreeMap<u32, usize> {
        let mut deleted = BTreeMap::new();
        for addr in &self.lead_deleted {
            if let Some(entry) = self.actual.maps.peers.get(addr) {
                count_up(&mut deleted, entry.slot);
            }
        }
        deleted
    }

    /// Whether `slot` has no user after the lead but `own` addresses of one peer: a peer keeps
    /// (or takes) only a slot no other peer's remaining entry uses, never shared for a moment.
    fn only(&self, deleted: &BTreeMap<u32, usize>, slot: u32, own: &[IpAddr]) -> bool {
        let users = self.actual.index.slot_refs.get(&slot).copied().unwrap_or(0);
        let own = own
            .iter()
            .filter(|a| !self.lead_deleted.contains(a))
            .filter(|a| {
                self.actual
                    .maps
                    .peers
                    .get(a)
                    .is_some_and(|e| e.slot == slot)
            })
            .count();
        own + deleted.get(&slot).copied().unwrap_or(0) >= users
    }

    /// The slot each touched peer keeps, if any: first the slot of its entries that stay, then
    /// of its entries the lead deletes, then of an address WireGuard still has for its key (an
    /// address change keeps the peer's counters). The entries that stay come first: a peer
    /// that took another slot would leave theirs to nobody until its puts ran, and a full map
    /// has no slot to spare for that.
    fn kept_slots(&self, deleted: &BTreeMap<u32, usize>) -> Vec<Option<u32>> {
        let maps = &self.actual.maps;
        let mut taken = BTreeSet::new();
        self.touched
            .iter()
            .map(|peer| {
                // Inline: a full plan passes here for every peer.
                let own: Addrs = peer.addrs().collect();
                let previous = self
                    .actual
                    .wg
                    .peers
                    .get(&peer.public_key)
                    .into_iter()
                    .flat_map(|p| p.allowed_ips.iter().map(|net| net.addr()));
                let (staying, leaving): (Addrs, Addrs) = own
                    .iter()
                    .copied()
                    .partition(|a| !self.lead_deleted.contains(a));
                let kept = staying
                    .into_iter()
                    .chain(leaving)
                    .chain(previous)
                    .filter_map(|a| maps.peers.get(&a).map(|e| e.slot))
                    .find(|s| !taken.contains(s) && self.only(deleted, *s, &own));
                if let Some(slot) = kept {
                    taken.insert(slot);
                }
                kept
            })
            .collect()
    }

    /// Counter slots, one per touched peer, kept across restarts via the entries (step 5). A
    /// new peer gets a slot no entry uses; failing that (a full map), a slot whose every entry
    /// the lead deletes and no peer keeps. Never a slot an entry that stays still uses: the
    /// reset would wipe that peer's counters, and the two would share a flow quota.
    pub(super) fn slots(&self, ops: &mut Vec<Op>) -> Result<Vec<u32>, PlanError> {
        let deleted = self.deleted_per_slot();
        let kept = self.kept_slots(&deleted);
        let index = &self.actual.index;
        let max = self.actual.slots().saturating_sub(1);
        // The slots this plan hands out, lowest first: the free ones below the high mark in
        // order, then those above it. A cursor each, so that a plan handing out N slots (a
        // cold load) costs O(N), not a scan past every slot it already handed out.
        let mut below = index.free_slots.iter().copied();
        let mut beyond = index.slot_high;
        let mut free = || {
            let slot = match below.next() {
                Some(slot) => slot,
                None => {
                    let slot = beyond;
                    beyond = beyond.checked_add(1)?;
                    slot
                }
            };
            (slot <= max).then_some(slot)
        };
        let taken: BTreeSet<u32> = kept.iter().flatten().copied().collect();
        let mut released: BTreeSet<u32> = deleted
            .keys()
            .copied()
            .filter(|slot| !taken.contains(slot) && self.only(&deleted, *slot, &[]))
            .collect();
        kept.into_iter()
            .map(|kept| match kept {
                Some(slot) => Ok(slot),
                None => {
                    let slot = free()
                        .or_else(|| released.pop_first())
                        .ok_or(PlanError::SlotsExhausted)?;
                    ops.push(Op::ResetPeerCounters { slot });
                    Ok(slot)
                }
            })
            .collect()
    }

    /// At a full map, slots that no touched peer can keep while entries that stay use them:
    /// shared by two peers' entries (a kernel changed behind the agent's back, or a plan
    /// stopped halfway), or left by a peer that has another slot. Their entries are rewritten
    /// with other slots anyway; deleting them in the lead frees the slots for the puts (they
    /// are written again later in the plan). Whether any was added to the lead.
    pub(super) fn rotate_stranded_slots(&mut self) -> bool {
        let deleted = self.deleted_per_slot();
        let kept: BTreeSet<u32> = self.kept_slots(&deleted).into_iter().flatten().collect();
        let stranded: Vec<IpAddr> = self
            .actual
            .maps
            .peers
            .iter()
            .filter(|(addr, entry)| {
                !kept.contains(&entry.slot)
                    && !self.lead_deleted.contains(addr)
                    && self.want_key.contains_key(addr)
            })
            .map(|(addr, _)| *addr)
            .collect();
        // Only slots every remaining user of which is rewritten: a slot an unchanged peer
        // uses stays with it.
        let mut users: BTreeMap<u32, usize> = BTreeMap::new();
        for addr in &stranded {
            if let Some(entry) = self.actual.maps.peers.get(addr) {
                count_up(&mut users, entry.slot);
            }
        }
        let rotate: Vec<IpAddr> = stranded
            .into_iter()
            .filter(|addr| {
                self.actual.maps.peers.get(addr).is_some_and(|e| {
                    let remaining = self
                        .actual
                        .index
                        .slot_refs
                        .get(&e.slot)
                        .copied()
                        .unwrap_or(0)
                        .saturating_sub(deleted.get(&e.slot).copied().unwrap_or(0));
                    users.get(&e.slot).copied().unwrap_or(0) >= remaining
                })
            })
            .collect();
        let any = !rotate.is_empty();
        self.lead_deleted.extend(rotate);
        any
    }
}
