//! What a plan must guarantee, checked against [`Actual`] used as the model of the kernel
//! ([`Actual::apply`]). The planner's property tests and its fuzzer apply plans operation by
//! operation and check these after each operation and at the end; each check returns what is
//! wrong instead of panicking, so callers decide how to fail.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use wgfence_common::UNRESTRICTED;

use super::{Actual, Op};
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

/// The complete content of a policy id as the datapath would see it.
fn content(actual: &Actual, id: u32) -> CompiledPolicy {
    actual.maps().policies.get(&id).cloned().unwrap_or_default()
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

/// The kernel enforces exactly `desired`: every address points at its peer's policy and is
/// routed to its peer, nothing else is in the maps or the device, no policy entry is leaked,
/// and each peer has one counter slot of its own.
pub fn check_converged(actual: &Actual, desired: &DesiredState) -> Result<(), String> {
    let maps = actual.maps();
    let mut addrs = BTreeSet::new();
    for peer in &desired.peers {
        for addr in peer.addrs() {
            addrs.insert(addr);
            let Some(entry) = maps.peers.get(&addr).copied() else {
                return Err(format!("{} has no entry for {addr}", peer.name));
            };
            match policy_of(peer) {
                None if entry.policy != UNRESTRICTED => {
                    return Err(format!("{}: {addr} is restricted", peer.name))
                }
                // An empty policy (`"egress": []`) is a restricted id without trie entries.
                Some(_) if entry.policy == UNRESTRICTED => {
                    return Err(format!("{}: {addr} is unrestricted", peer.name))
                }
                Some(p) if content(actual, entry.policy) != p => {
                    return Err(format!("{}: {addr} has another policy", peer.name))
                }
                _ => {}
            }
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
        if wg.preshared_key != peer.preshared_key
            || wg.persistent_keepalive != peer.persistent_keepalive
        {
            return Err(format!("{}: preshared key or keepalive differ", peer.name));
        }
    }
    let present: BTreeSet<IpAddr> = maps.peers.keys().copied().collect();
    if present != addrs {
        return Err(format!("address entries {present:?}, wanted {addrs:?}"));
    }
    let keys: BTreeSet<WgKey> = desired.peers.iter().map(|p| p.public_key).collect();
    let wg_keys: BTreeSet<WgKey> = actual.wg().peers.keys().copied().collect();
    if wg_keys != keys {
        return Err(format!("WireGuard peers {wg_keys:?}, wanted {keys:?}"));
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
            "policy ids {policies:?} in the tries, {referenced:?} referenced"
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
    // One slot per peer.
    let mut slots = BTreeMap::new();
    for peer in &desired.peers {
        for addr in peer.addrs() {
            let slot = maps.peers.get(&addr).map(|e| e.slot);
            if let Some(other) = slot.and_then(|slot| slots.insert(slot, &peer.name)) {
                if other != &peer.name {
                    return Err(format!("slot {slot:?} shared by {other} and {}", peer.name));
                }
            }
        }
    }
    Ok(())
}

/// The revocations lead the plan: every address entry that leaves the state is deleted, and
/// then every WireGuard peer that leaves it with its addresses is removed, before the plan's
/// first write that is not a deletion. A put can fail (a full map, a full trie), and deleting
/// only ever takes access away, so nothing a failed put stops may hold a revocation back.
/// (A WireGuard peer whose address another peer takes over leaves after the handover, as
/// before; its address entries are not revoked, they change holder.)
pub fn check_revocations_lead(
    before: &Actual,
    desired: &DesiredState,
    ops: &[Op],
) -> Result<(), String> {
    let addrs: BTreeSet<IpAddr> = desired.peers.iter().flat_map(PeerSpec::addrs).collect();
    let keys: BTreeSet<WgKey> = desired.peers.iter().map(|p| p.public_key).collect();
    let is_deletion = |op: &Op| {
        matches!(
            op,
            Op::DeletePeerEntry { .. } | Op::RemoveWgPeer { .. } | Op::DeletePolicyEntry { .. }
        )
    };
    let lead = &ops[..ops
        .iter()
        .position(|op| !is_deletion(op))
        .unwrap_or(ops.len())];
    for addr in before.maps().peers.keys().filter(|a| !addrs.contains(a)) {
        if !lead.contains(&Op::DeletePeerEntry { addr: *addr }) {
            return Err(format!(
                "{addr} leaves the state but is not deleted before the first put: {ops:?}"
            ));
        }
    }
    for (key, peer) in &before.wg().peers {
        let handed_over = peer.allowed_ips.iter().any(|ip| addrs.contains(&ip.addr()));
        if keys.contains(key) || handed_over {
            continue;
        }
        if !lead.contains(&Op::RemoveWgPeer { key: *key }) {
            return Err(format!(
                "WireGuard peer {key} leaves the state but is not removed before the first put: \
                 {ops:?}"
            ));
        }
    }
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
        let content = (entry.policy != UNRESTRICTED).then(|| content(actual, entry.policy));
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
            let content = (entry.policy != UNRESTRICTED).then(|| content(actual, entry.policy));
            if content != policy_of(peer) {
                return Err(format!("{}: {addr} runs another policy", peer.name));
            }
            if holder(actual, addr) != Some(peer.public_key) {
                return Err(format!("{}: {addr} is routed elsewhere", peer.name));
            }
        }
    }
    Ok(())
}
