//! Steps 5 and 7's address entries: each touched peer's entries (policy, counter slot, owner,
//! rule counter block, window), the owner high-water mark persisted first, and their writes:
//! in step 5, or in step 7 for an address that moves, once WireGuard routes it to its holder.

use std::{collections::BTreeMap, net::IpAddr};

use ipnet::IpNet;
use wgfence_common::{PeerEntry, NO_RULES, UNRESTRICTED};

use super::{
    actual::Actual, op::Op, planner::Planner, policy_ids::PolicyIds, rule_space,
    unplanned::PlanError, EMPTY_POLICY,
};
use crate::{
    policy::CompiledPolicy,
    state::{PeerSpec, WgKey},
};

/// An address entry the plan writes: the peer's name and key, and the entry.
type Wanted<'a> = BTreeMap<IpAddr, (&'a str, WgKey, PeerEntry)>;

/// The map entry of one of `peer`'s addresses: its policy, counter slot and owner, audit mode
/// for an audited restricted peer, and its window on the boot clock.
pub(super) fn peer_entry(
    peer: &PeerSpec,
    (policy, rules): (u32, u32),
    slot: u32,
    owner: u64,
    wall_minus_boot_ns: i128,
) -> PeerEntry {
    let mut entry = PeerEntry {
        policy,
        slot,
        owner,
        rules,
        ..PeerEntry::default()
    };
    if peer.mode == crate::state::Mode::Audit && policy != UNRESTRICTED {
        entry.flags |= wgfence_common::PEER_AUDIT;
    }
    if peer.window().is_some() {
        entry.flags |= wgfence_common::PEER_WINDOWED;
        let boot = |secs| crate::clock::to_boot_ns(secs, wall_minus_boot_ns);
        entry.not_before_ns = peer.window().not_before.map_or(0, boot);
        entry.expires_ns = peer.window().expires.map_or(u64::MAX, boot);
    }
    entry
}

/// The length of the rule counter block of a policy with `rules` rules: as many as its trie
/// entries count for ([`CompiledPolicy::counted_rules`], at least 1), which is what the index
/// reads back from the kernel. Not the number of rules: a later rule that compiles to no
/// entry counts nothing, and a block placed longer than the index sees it would leave its tail
/// free for a later placement (a restart at a full counter space wrote blocks and entries for
/// an unchanged state). `None` for a policy without rules.
pub(super) fn rule_block_len(policy: &CompiledPolicy, rules: usize) -> Option<u32> {
    (rules > 0).then(|| policy.counted_rules().max(1))
}

/// The rule counter block of each policy the touched peers use: its rules, in canonical order,
/// count at `base..base + rules` of the rule counters. A policy keeps the block its entries
/// carry (so the counts survive restarts, adopted from the pinned entries); a policy without
/// one gets the first free range, zeroed first. Counters are observability, not enforcement:
/// when no range is free the policy is simply not counted ([`NO_RULES`]).
fn rule_blocks(
    touched: &[&PeerSpec],
    id_of: impl Fn(&CompiledPolicy) -> Option<u32>,
    counted: &BTreeMap<u32, u32>,
    actual: &Actual,
    ops: &mut Vec<Op>,
) -> BTreeMap<u32, u32> {
    let index = &actual.index;
    // The ids a full plan's set-aside peers count rules under: their blocks go into the
    // touched peers' entries of those ids too, as when every peer is planned.
    let mut want: BTreeMap<u32, u32> = counted.clone();
    for peer in touched {
        if let (Some(policy), Some(rules)) = (peer.policy.as_deref(), &peer.rules) {
            if let (Some(id), Some(len)) = (id_of(policy), rule_block_len(policy, rules.len())) {
                want.insert(id, len);
            }
        }
    }
    // The ranges in use: a kept block is as long as its policy has counted rules (the
    // highest rule index its entries carry, plus one), whether or not its peers are touched:
    // a full plan and one of the changes alone place a new block alike, at the lowest free
    // range (the index keeps the free ranges current).
    let mut placing = rule_space::Placing::new(&index.rule_space);
    let mut blocks = BTreeMap::new();
    for (id, len) in &want {
        if let Some(base) = index.rule_base(*id) {
            blocks.insert(*id, base);
            continue;
        }
        if let Some(base) = placing.place(*len) {
            ops.push(Op::ResetRuleCounters { base, len: *len });
            blocks.insert(*id, base);
        }
    }
    blocks
}

impl<'a> Planner<'a> {
    /// Each touched peer's address entries, and the owner high-water mark persisted before
    /// any entry carries a new owner.
    pub(super) fn entries(
        &self,
        ids: &PolicyIds<'a>,
        slots: &[u32],
        ops: &mut Vec<Op>,
    ) -> Result<Wanted<'a>, PlanError> {
        let (maps, index) = (&self.actual.maps, &self.actual.index);
        let rule_bases = rule_blocks(
            &self.touched,
            |p| ids.get(p),
            &self.counted,
            self.actual,
            ops,
        );
        let mut owner_high = index.owner_high;
        let mut wanted = Wanted::new();
        for (peer, &slot) in self.touched.iter().zip(slots) {
            // Every touched peer's policy has an id; were one missing, nothing would pass.
            let policy = peer
                .policy
                .as_deref()
                .map_or(UNRESTRICTED, |p| ids.get(p).unwrap_or(EMPTY_POLICY));
            for addr in peer.addrs() {
                // An address keeps its owner while its WireGuard holder and its slot stay; any
                // other change gets a new owner, so the entry write ends the old holder's
                // flows. An entry the lead deletes is written again with a new owner.
                let kept = maps.peers.get(&addr).filter(|e| {
                    e.slot == slot
                        && !self.lead_deleted.contains(&addr)
                        && self.actual.routes(&IpNet::from(addr), &peer.public_key)
                });
                let owner = match kept {
                    Some(entry) => entry.owner,
                    None => {
                        owner_high = owner_high
                            .checked_add(1)
                            .ok_or(PlanError::OwnersExhausted)?;
                        owner_high
                    }
                };
                let rules = rule_bases.get(&policy).copied().unwrap_or(NO_RULES);
                let entry = peer_entry(peer, (policy, rules), slot, owner, maps.wall_minus_boot_ns);
                wanted.insert(addr, (&peer.name, peer.public_key, entry));
            }
        }
        if owner_high > index.owner_high {
            ops.push(Op::RaiseOwnerHigh { owner: owner_high });
        }
        Ok(wanted)
    }

    /// Step 5's writes into `ops`, and step 7's (the entries of moving addresses, written after
    /// WireGuard moved them), with the change of each policy id's references over the plan.
    pub(super) fn entry_writes(
        &self,
        wanted: &Wanted<'a>,
        ops: &mut Vec<Op>,
    ) -> (Vec<Op>, BTreeMap<u32, i64>) {
        let peers = &self.actual.maps.peers;
        let mut moved = Vec::new();
        let mut delta: BTreeMap<u32, i64> = BTreeMap::new();
        for (addr, (name, _, entry)) in wanted {
            let current = peers
                .get(addr)
                .filter(|_| !self.lead_deleted.contains(addr));
            if current == Some(entry) {
                continue;
            }
            if let Some(current) = peers.get(addr) {
                *delta.entry(current.policy).or_default() -= 1;
            }
            *delta.entry(entry.policy).or_default() += 1;
            let put = Op::PutPeerEntry {
                peer: (*name).to_owned(),
                addr: *addr,
                entry: *entry,
            };
            // An address WireGuard still routes to another peer must not carry the new
            // holder's policy, or its new owner, before it moves. (With the new owner in place
            // early, the old holder's traffic could record flows the new holder would then
            // answer.)
            if self.moves(addr) {
                moved.push(put);
            } else {
                ops.push(put);
            }
        }
        for addr in self.lead_deleted.iter().filter(|a| !wanted.contains_key(a)) {
            if let Some(current) = peers.get(addr) {
                *delta.entry(current.policy).or_default() -= 1;
            }
        }
        (moved, delta)
    }
}
