//! What a plan must guarantee, checked against [`Actual`] used as the model of the kernel
//! ([`Actual::apply`]). The planner's property tests and its fuzzer apply plans operation by
//! operation and check these after each operation and at the end; each check returns what is
//! wrong instead of panicking, so callers decide how to fail.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use wgfence_common::UNRESTRICTED;

use wgfence_common::PeerEntry;

use super::{Actual, ActualMaps, Op, EMPTY_POLICY};
use crate::{
    policy::CompiledPolicy,
    state::{DesiredState, PeerSpec, WgKey},
};

fn policy_of(peer: &PeerSpec) -> Option<CompiledPolicy> {
    peer.policy.as_deref().cloned()
}

/// The WireGuard peer that routes `addr` (its allowed IPs hold the host prefix).
fn holder(actual: &Actual, addr: IpAddr) -> Option<WgKey> {
    let host = IpNet::from(addr);
    actual
        .wg()
        .peers
        .iter()
        .find(|(_, p)| p.allowed_ips.contains(&host))
        .map(|(k, _)| *k)
}

/// The content of a restricted policy id as the datapath sees it: its trie entries, or none
/// under [`EMPTY_POLICY`] (`"egress": []`). `None` for any other id without entries: a policy
/// whose entries are not written, never mistaken for the empty policy.
fn content(actual: &Actual, id: u32) -> Option<CompiledPolicy> {
    maps_content(actual.maps(), id)
}

fn maps_content(maps: &ActualMaps, id: u32) -> Option<CompiledPolicy> {
    match maps.policies.get(&id) {
        Some(content) => Some(CompiledPolicy::clone(content)),
        None if id == EMPTY_POLICY => Some(CompiledPolicy::default()),
        None => None,
    }
}

/// What an entry with policy `id` enforces: `None` unrestricted, `Some(content)` restricted;
/// an error for an id whose entries are missing.
fn enforced(actual: &Actual, addr: IpAddr, id: u32) -> Result<Option<CompiledPolicy>, String> {
    if id == UNRESTRICTED {
        return Ok(None);
    }
    content(actual, id)
        .map(Some)
        .ok_or_else(|| format!("{addr} points at policy {id}, which has no entries"))
}

/// No counter slot is shared by two peers, at any moment: every address using a slot belongs
/// to one peer (by name or by key, in the old state or the new). A shared slot would mix two
/// peers' counters and let one use up the other's flow quota.
fn check_slots(actual: &Actual, old: &DesiredState, new: &DesiredState) -> Result<(), String> {
    let mut by_slot: BTreeMap<u32, BTreeSet<IpAddr>> = BTreeMap::new();
    for (addr, entry) in &actual.maps().peers {
        by_slot.entry(entry.slot).or_default().insert(*addr);
    }
    let mut groups: BTreeMap<String, BTreeSet<IpAddr>> = BTreeMap::new();
    for peer in old.peers.iter().chain(&new.peers) {
        for id in [
            format!("name {}", peer.name),
            format!("key {}", peer.public_key),
        ] {
            groups.entry(id).or_default().extend(peer.addrs());
        }
    }
    for (slot, addrs) in by_slot {
        if addrs.len() > 1 && !groups.values().any(|g| addrs.is_subset(g)) {
            return Err(format!(
                "slot {slot} shared by addresses of two peers: {addrs:?}"
            ));
        }
    }
    Ok(())
}

/// What `op` claims about the kernel before it runs: a WireGuard change creates a peer exactly
/// when the device does not have it yet.
pub fn check_op(actual: &Actual, op: &Op) -> Result<(), String> {
    if let Op::WgPeer(c) = op {
        if c.create == actual.wg().peers.contains_key(&c.key) {
            return Err(format!(
                "create is {} for a peer the device {}: {c:?}",
                c.create,
                if c.create { "has" } else { "lacks" }
            ));
        }
    }
    Ok(())
}

/// The kernel enforces exactly `desired`: the maps do ([`check_maps_converged`]), every
/// address is routed to its peer, and the device has exactly the desired peers, with their
/// endpoints, preshared keys and keepalives.
pub fn check_converged(actual: &Actual, desired: &DesiredState) -> Result<(), String> {
    check_maps_converged(actual.maps(), desired)?;
    for peer in &desired.peers {
        for addr in peer.addrs() {
            if holder(actual, addr) != Some(peer.public_key) {
                return Err(format!("{addr} is not routed to {}", peer.name));
            }
        }
        let Some(wg) = actual.wg().peers.get(&peer.public_key) else {
            return Err(format!("{} is not a WireGuard peer", peer.name));
        };
        if peer.endpoint.is_some() && wg.endpoint != peer.endpoint {
            return Err(format!("{}: endpoint {:?}", peer.name, wg.endpoint));
        }
        if wg.preshared_key.as_deref().copied() != peer.preshared_key()
            || wg.persistent_keepalive != peer.persistent_keepalive
        {
            return Err(format!("{}: preshared key or keepalive differ", peer.name));
        }
    }
    let keys: BTreeSet<WgKey> = desired.peers.iter().map(|p| p.public_key).collect();
    let wg_keys: BTreeSet<WgKey> = actual.wg().peers.keys().copied().collect();
    if wg_keys != keys {
        return Err(format!("WireGuard peers {wg_keys:?}, wanted {keys:?}"));
    }
    Ok(())
}

/// The maps enforce exactly `desired` (the one convergence check of the planner's tests, the
/// fuzzer, the integration tests and the benchmarks): every address has an entry and nothing
/// else has one, a peer's addresses share one policy id and one counter slot of their own, each
/// policy id holds exactly its peer's compiled rules (`"egress": []`: the empty policy, without
/// entries), no policy entry is leaked, and no two addresses share an owner.
pub fn check_maps_converged(maps: &ActualMaps, desired: &DesiredState) -> Result<(), String> {
    let mut addrs = BTreeSet::new();
    let mut slots = BTreeMap::new();
    for peer in &desired.peers {
        let mut first: Option<PeerEntry> = None;
        for addr in peer.addrs() {
            addrs.insert(addr);
            let Some(entry) = maps.peers.get(&addr).copied() else {
                return Err(format!("{} has no entry for {addr}", peer.name));
            };
            let first = *first.get_or_insert(entry);
            if entry.slot != first.slot || entry.policy != first.policy {
                return Err(format!("{}'s addresses disagree", peer.name));
            }
            match policy_of(peer) {
                None if entry.policy != UNRESTRICTED => {
                    return Err(format!("{}: {addr} is restricted", peer.name))
                }
                // An empty policy (`"egress": []`) is a restricted id without trie entries.
                Some(_) if entry.policy == UNRESTRICTED => {
                    return Err(format!("{}: {addr} is unrestricted", peer.name))
                }
                Some(p) if maps_content(maps, entry.policy).as_ref() != Some(&p) => {
                    return Err(format!(
                        "{}: {addr}'s policy {} does not hold its rules",
                        peer.name, entry.policy
                    ))
                }
                _ => {}
            }
        }
        if let Some(entry) = first {
            if let Some(other) = slots.insert(entry.slot, &peer.name) {
                return Err(format!(
                    "slot {} shared by {other} and {}",
                    entry.slot, peer.name
                ));
            }
        }
    }
    let present: BTreeSet<IpAddr> = maps.peers.keys().copied().collect();
    if present != addrs {
        return Err(format!(
            "address entries: {} left over (e.g. {:?}), {} missing (e.g. {:?})",
            present.difference(&addrs).count(),
            present.difference(&addrs).take(5).collect::<Vec<_>>(),
            addrs.difference(&present).count(),
            addrs.difference(&present).take(5).collect::<Vec<_>>()
        ));
    }
    // No leaked policy entries: only referenced ids have entries (a referenced id without
    // entries is the empty policy, checked above).
    let referenced: BTreeSet<u32> = maps
        .peers
        .values()
        .map(|e| e.policy)
        .filter(|p| *p != UNRESTRICTED)
        .collect();
    let policies: BTreeSet<u32> = maps.policies.keys().copied().collect();
    if !policies.is_subset(&referenced) {
        return Err(format!(
            "policy ids no peer references (leaked): {:?}",
            policies.difference(&referenced).collect::<Vec<_>>()
        ));
    }
    // One owner per address: a flow recorded for one address's holder counts for no other.
    let mut owners = BTreeMap::new();
    for (addr, entry) in &maps.peers {
        if let Some(other) = owners.insert(entry.owner, addr) {
            return Err(format!(
                "owner {} shared by {other} and {addr}",
                entry.owner
            ));
        }
    }
    Ok(())
}

/// The revocations lead the plan: every address entry that leaves the state is deleted, and
/// then every WireGuard peer that leaves it with its addresses is removed, before the plan's
/// first write that is not a deletion. A put can fail (a full map, a full trie), and deleting
/// only ever takes access away, so nothing a failed put stops may hold a revocation back.
/// The same holds for an address handed to another WireGuard peer (a key rotation, a
/// takeover): its entry is deleted in the lead and the old peer removed, so the old key is cut
/// off even when every put fails. And the lead deletes the trie entries nothing references
/// once it ran (nor will): at a full trie, the puts need their room.
pub fn check_revocations_lead(
    before: &Actual,
    desired: &DesiredState,
    ops: &[Op],
) -> Result<(), String> {
    let lead = super::lead(ops);
    check_leaving_revoked_in_lead(before, desired, lead, ops)?;
    check_moving_deleted_in_lead(before, desired, lead, ops)?;
    check_lead_frees_the_trie(before, lead, ops)?;
    check_revoke_order(lead, ops)
}

/// The address entries and the WireGuard peers that leave the state go in the lead.
fn check_leaving_revoked_in_lead(
    before: &Actual,
    desired: &DesiredState,
    lead: &[Op],
    ops: &[Op],
) -> Result<(), String> {
    let addrs: BTreeSet<IpAddr> = desired.peers.iter().flat_map(PeerSpec::addrs).collect();
    let keys: BTreeSet<WgKey> = desired.peers.iter().map(|p| p.public_key).collect();
    for addr in before.maps().peers.keys().filter(|a| !addrs.contains(a)) {
        if !lead.contains(&Op::DeletePeerEntry { addr: *addr }) {
            return Err(format!(
                "{addr} leaves the state but is not deleted before the first put: {ops:?}"
            ));
        }
    }
    for key in before.wg().peers.keys() {
        if keys.contains(key) {
            continue;
        }
        if !lead.contains(&Op::RemoveWgPeer { key: *key }) {
            return Err(format!(
                "WireGuard peer {key} leaves the state but is not removed before the first put: \
                 {ops:?}"
            ));
        }
    }
    Ok(())
}

/// The entry of an address handed to another WireGuard peer goes in the lead.
fn check_moving_deleted_in_lead(
    before: &Actual,
    desired: &DesiredState,
    lead: &[Op],
    ops: &[Op],
) -> Result<(), String> {
    for peer in &desired.peers {
        for addr in peer.addrs() {
            let moves = holder(before, addr).is_some_and(|k| k != peer.public_key);
            if moves
                && before.maps().peers.contains_key(&addr)
                && !lead.contains(&Op::DeletePeerEntry { addr })
            {
                return Err(format!(
                    "{addr} moves to {} but its entry is not deleted before the first put: \
                     {ops:?}",
                    peer.name
                ));
            }
        }
    }
    Ok(())
}

/// The lead deletes the trie entries nothing references once it ran, nor will.
fn check_lead_frees_the_trie(before: &Actual, lead: &[Op], ops: &[Op]) -> Result<(), String> {
    let mut after_lead = before.clone();
    for op in lead {
        after_lead.apply(op);
    }
    let used: BTreeSet<u32> = after_lead
        .maps()
        .peers
        .values()
        .map(|e| e.policy)
        .chain(ops.iter().filter_map(|op| match op {
            Op::PutPeerEntry { entry, .. } => Some(entry.policy),
            _ => None,
        }))
        .collect();
    if let Some(id) = after_lead
        .maps()
        .policies
        .keys()
        .find(|id| !used.contains(id))
    {
        return Err(format!(
            "policy {id} is referenced by nothing after the lead, but its entries are not \
             deleted there: {ops:?}"
        ));
    }
    Ok(())
}

/// The design's revoke order within the lead.
fn check_revoke_order(lead: &[Op], ops: &[Op]) -> Result<(), String> {
    // The design's revoke order: the address entries, then the WireGuard peers.
    if let Some(first_wg) = lead
        .iter()
        .position(|op| matches!(op, Op::RemoveWgPeer { .. }))
    {
        if lead[first_wg..]
            .iter()
            .any(|op| matches!(op, Op::DeletePeerEntry { .. }))
        {
            return Err(format!(
                "a WireGuard peer is removed before the address entries are deleted: {ops:?}"
            ));
        }
    }
    Ok(())
}

/// What must hold after every single operation of the transition `old` -> `new`: fail closed
/// (no entry points at a half-written policy), no escalation (an address runs a policy of the
/// peer WireGuard routes it to), no interruption (a peer unchanged between the states keeps
/// its entries and routes).
pub fn check_safe_midway(
    actual: &Actual,
    old: &DesiredState,
    new: &DesiredState,
) -> Result<(), String> {
    let by_key = |s: &DesiredState| -> BTreeMap<WgKey, Option<CompiledPolicy>> {
        s.peers
            .iter()
            .map(|p| (p.public_key, policy_of(p)))
            .collect()
    };
    let (old_keys, new_keys) = (by_key(old), by_key(new));
    for (addr, entry) in &actual.maps().peers {
        // The persisted high-water mark covers every owner written: a restart never hands one
        // out again.
        if entry.owner > actual.maps().owner_high {
            return Err(format!(
                "{addr}: owner {} above the persisted high-water mark {}",
                entry.owner,
                actual.maps().owner_high
            ));
        }
        let content = enforced(actual, *addr, entry.policy)?;
        let complete = old
            .peers
            .iter()
            .chain(&new.peers)
            .any(|p| policy_of(p) == content);
        if !complete {
            return Err(format!(
                "{addr} points at incomplete policy {}",
                entry.policy
            ));
        }
        if let Some(holder) = holder(actual, *addr) {
            let own = [old_keys.get(&holder), new_keys.get(&holder)];
            if !own.iter().flatten().any(|p| **p == content) {
                return Err(format!(
                    "{addr}: holder {holder} runs a policy that is not its own"
                ));
            }
        }
    }
    for peer in &new.peers {
        let Some(before) = old.peers.iter().find(|p| p.name == peer.name) else {
            continue;
        };
        if before.public_key != peer.public_key || policy_of(before) != policy_of(peer) {
            continue;
        }
        for addr in peer.addrs().filter(|a| before.addrs().any(|b| b == *a)) {
            let Some(entry) = actual.maps().peers.get(&addr) else {
                return Err(format!("{}: {addr} interrupted", peer.name));
            };
            let content = enforced(actual, addr, entry.policy)?;
            if content != policy_of(peer) {
                return Err(format!("{}: {addr} runs another policy", peer.name));
            }
            if holder(actual, addr) != Some(peer.public_key) {
                return Err(format!("{}: {addr} is routed elsewhere", peer.name));
            }
        }
    }
    check_slots(actual, old, new)
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use serde_json::json;
    use wgfence_common::PeerEntry;

    use super::*;
    use crate::{
        plan::{plan, Actual},
        state::parse,
    };

    fn state(peers: serde_json::Value) -> DesiredState {
        parse(&json!({ "version": 1, "peers": peers }).to_string()).unwrap()
    }

    /// Review of issue 11, finding 5: a peer entry written before its own policy's entries
    /// points at an id without entries. That is an incomplete policy, also while another peer
    /// has `"egress": []` (the empty policy is one id, not any id without entries).
    #[test]
    fn an_entry_before_its_policy_is_incomplete_even_next_to_an_empty_policy() {
        let key = |n: u8| WgKey([n; 32]).to_base64();
        let old = state(json!([
            { "name": "a", "publicKey": key(1), "address": "10.8.0.2", "egress": [] },
        ]));
        let new = state(json!([
            { "name": "a", "publicKey": key(1), "address": "10.8.0.2", "egress": [] },
            { "name": "b", "publicKey": key(2), "address": "10.8.0.3",
              "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp" }] },
        ]));
        let mut kernel = Actual::default();
        for op in plan(&old, &kernel).map(|p| p.ops).unwrap() {
            kernel.apply(&op);
        }
        assert_eq!(check_converged(&kernel, &old), Ok(()));
        // b's entry, written before b's policy (an id the tries have nothing for).
        let used: BTreeSet<u32> = kernel.maps().peers.values().map(|e| e.policy).collect();
        let fresh = (1..).find(|id| !used.contains(id)).unwrap_or(1);
        kernel.apply(&Op::PutPeerEntry {
            peer: "b".into(),
            addr: IpAddr::from([10, 8, 0, 3]),
            entry: PeerEntry {
                policy: fresh,
                slot: 1,
                owner: 1,
                ..PeerEntry::default()
            },
        });
        kernel.apply(&Op::RaiseOwnerHigh { owner: 10 });
        assert!(
            check_safe_midway(&kernel, &old, &new).is_err(),
            "b's entry points at policy {fresh}, which has no entries yet, and passed"
        );
    }
}
