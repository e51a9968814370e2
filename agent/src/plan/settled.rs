//! A full plan sets aside the peers the kernel already has exactly as the plan would leave
//! them: after a restart that is nearly every peer, so the plan is made in time proportional to
//! the peers that differ, and is still op for op the plan of every peer.

use std::collections::{BTreeMap, HashMap};

use ipnet::IpNet;
use wgfence_common::{NO_RULES, UNRESTRICTED};

use super::{
    entries::{peer_entry, rule_block_len},
    planner::Planner,
    wireguard::wg_change,
};
use crate::{policy::CompiledPolicy, state::PeerSpec};

impl<'a> Planner<'a> {
    /// The planner of a full plan, without the desired peers the kernel has exactly as the
    /// plan would leave them ([`Self::settled`]): the plan is the same, made in time
    /// proportional to the peers that differ (but for a lookup per peer).
    pub(super) fn without_settled(mut self) -> Self {
        // The policy id each policy would get (an existing one, or none yet), by address,
        // and the ids whose rules a touched peer counts (their blocks go into every entry of
        // the id, [`rule_blocks`]).
        let mut ids: HashMap<*const CompiledPolicy, Option<u32>> = HashMap::new();
        let mut counted: BTreeMap<u32, u32> = BTreeMap::new();
        for peer in &self.touched {
            if let (Some(policy), Some(rules)) = (peer.policy.as_deref(), &peer.rules) {
                let id = *ids
                    .entry(policy)
                    .or_insert_with(|| self.existing_id(policy));
                if let (Some(id), Some(len)) = (id, rule_block_len(policy, rules.len())) {
                    counted.insert(id, len);
                }
            }
        }
        let touched = std::mem::take(&mut self.touched);
        self.touched = touched
            .into_iter()
            .filter(|peer| !self.settled(peer, &ids, &counted))
            .collect();
        self.counted = counted;
        self
    }

    /// Whether the kernel has `peer` as a full plan leaves it, so that planning it adds
    /// nothing: each address's entry is the one [`Self::entries`] would want (the policy's
    /// existing id and rule block, the entry's own slot and owner), no other entry uses the
    /// slot, no address is deleted or moves in the lead, and WireGuard has the peer as asked.
    fn settled(
        &self,
        peer: &PeerSpec,
        ids: &HashMap<*const CompiledPolicy, Option<u32>>,
        counted: &BTreeMap<u32, u32>,
    ) -> bool {
        let (maps, index) = (&self.actual.maps, &self.actual.index);
        // A peer the device does not have is a WireGuard change.
        let Some(have) = self.actual.wg.peers.get(&peer.public_key) else {
            return false;
        };
        let policy = match peer.policy.as_deref() {
            None => UNRESTRICTED,
            Some(policy) => {
                let address: *const CompiledPolicy = policy;
                match ids.get(&address).copied().flatten() {
                    Some(id) => id,
                    None => return false,
                }
            }
        };
        let rules = if counted.contains_key(&policy) {
            match index.rule_base(policy) {
                Some(base) => base,
                None => return false,
            }
        } else {
            NO_RULES
        };
        let mut slot = None;
        let mut addrs = 0;
        for addr in peer.addrs() {
            addrs += 1;
            let Some(entry) = maps.peers.get(&addr) else {
                return false;
            };
            let same = *slot.get_or_insert(entry.slot) == entry.slot
                && !self.lead_deleted.contains(&addr)
                && self
                    .actual
                    .routes_to_peer(&IpNet::from(addr), &peer.public_key)
                && peer_entry(
                    peer,
                    (policy, rules),
                    entry.slot,
                    entry.owner,
                    maps.wall_minus_boot_ns,
                ) == *entry;
            if !same {
                return false;
            }
        }
        slot.is_some_and(|slot| index.slot_refs.get(&slot) == Some(&addrs))
            && wg_change(peer, Some(have)).is_none()
    }
}
