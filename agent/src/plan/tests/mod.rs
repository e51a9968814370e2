//! The planner's tests, one file per part of the planner they test, on a model of the kernel
//! ([`Kernel`]: [`Actual::apply`] with every index checked after each operation) and the
//! invariants of [`super::invariants`].

mod convergence;
mod entries;
mod index;
mod policy_gc;
mod policy_ids;
mod revocations;
mod scope;
mod settings;
mod settled;
mod slots;
mod unplanned;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use ipnet::IpNet;
use proptest::prelude::*;
use serde_json::{json, Value};
use wgfence_common::{Config, PeerEntry, NO_RULES, UNRESTRICTED};

use super::{
    actual::*,
    device::*,
    index::*,
    invariants,
    op::*,
    planner::{Changes, Scope},
    rule_space,
    scope::*,
    settings::*,
    unplanned::*,
    ActualMaps, EMPTY_POLICY,
};
use crate::state::{parse, DesiredState, WgKey};

/// The kernel, modelled by [`Actual::apply`].
#[derive(Debug, Clone, Default)]
struct Kernel(Actual);

impl Kernel {
    fn actual(&self) -> Actual {
        self.0.clone()
    }

    fn apply(&mut self, op: &Op) {
        if let Err(e) = invariants::check_op(&self.0, op) {
            panic!("{e}");
        }
        self.0.apply(op);
        // The free-slot index, kept current op by op, is the complement of the used
        // slots below the high mark: what a scan over every used slot would find.
        let index = &self.0.index;
        let free: BTreeSet<u32> = (0..index.slot_high)
            .filter(|s| !index.slot_refs.contains_key(s))
            .collect();
        assert_eq!(index.free_slots, free, "after {op}");
        // The rule-block index counts the entries as they are.
        let mut rule_refs = BTreeMap::new();
        for e in self.0.maps.peers.values().filter(|e| e.rules != NO_RULES) {
            *rule_refs.entry((e.policy, e.rules)).or_insert(0usize) += 1;
        }
        assert_eq!(index.rule_refs, rule_refs, "after {op}");
        // ... and each block's length as the trie entries have it.
        for (id, content) in &self.0.maps.policies {
            assert_eq!(index.rule_len(*id), content.counted_rules(), "after {op}");
        }
        assert!(
            index
                .rule_lens
                .keys()
                .all(|id| self.0.maps.policies.contains_key(id)),
            "after {op}"
        );
        let mut blocks = BTreeMap::new();
        for (id, base) in rule_refs.keys() {
            blocks.entry(*id).or_insert(*base);
        }
        let blocks: Vec<(u32, u32)> = blocks
            .iter()
            .map(|(id, base)| {
                let len = self
                    .0
                    .maps
                    .policies
                    .get(id)
                    .map_or(0, |p| p.counted_rules());
                (*base, len.max(1))
            })
            .collect();
        assert_eq!(index.rule_blocks_in_use(), blocks, "after {op}");
        // ... and the free ranges are what those blocks leave.
        let mut space = rule_space::RuleSpace::default();
        for (base, len) in &blocks {
            space.add(*base, *len);
        }
        assert!(index.rule_space == space, "after {op}");
        // A kernel read back (built in one go) has the indexes kept op by op.
        let read = Actual::new(self.0.maps.clone(), self.0.wg.clone());
        assert_eq!(read.index.slot_refs, index.slot_refs, "after {op}");
        // (Held by tags or by keys: the same holders.)
        let holders = |a: &Actual| -> Vec<(IpNet, Option<WgKey>)> {
            let ips: Vec<IpNet> = match &a.index.holders {
                Holders::Tags(tags) => tags.iter().map(|(ip, _)| ip).collect(),
                Holders::Keys(keys) => keys.iter().map(|(ip, _)| ip).collect(),
            };
            ips.into_iter().map(|ip| (ip, a.holder_of(&ip))).collect()
        };
        assert_eq!(holders(&read), holders(&self.0), "after {op}");
        assert_eq!(read.index.rule_refs, index.rule_refs, "after {op}");
        assert!(read.index.rule_space == index.rule_space, "after {op}");
        let free: BTreeSet<u32> = (0..read.index.slot_high)
            .filter(|s| !index.slot_refs.contains_key(s))
            .collect();
        assert_eq!(read.index.free_slots, free, "after {op}");
        // The free-id index gives the lowest id no trie or peer entry uses.
        let used: BTreeSet<u32> = self
            .0
            .maps
            .policies
            .keys()
            .chain(index.policy_refs.keys())
            .copied()
            .collect();
        let lowest = (1..EMPTY_POLICY).find(|id| !used.contains(id));
        assert_eq!(
            index.free_ids.lowest(&BTreeSet::new(), EMPTY_POLICY - 1),
            lowest,
            "after {op}"
        );
        assert!(index.slot_refs.keys().all(|s| *s < index.slot_high));
    }
}

/// The kernel enforces exactly `desired`.
#[track_caller]
fn assert_converged(kernel: &Kernel, desired: &DesiredState) {
    if let Err(e) = invariants::check_converged(&kernel.0, desired) {
        panic!("{e}");
    }
}

/// Invariants that must hold after every single operation of the transition old -> new.
#[track_caller]
fn assert_safe_midway(kernel: &Kernel, old: &DesiredState, new: &DesiredState) {
    if let Err(e) = invariants::check_safe_midway(&kernel.0, old, new) {
        panic!("{e}");
    }
}

fn key(n: u8) -> String {
    WgKey([n; 32]).to_base64()
}

/// Generated peer `n`'s key: keys 2k and 2k+1 share their first 8 bytes, the tag the
/// holders index keeps ([`key_tag`]), so that the property tests plan with shared tags as
/// well as with a tag per key.
fn gen_key(n: u8) -> String {
    let mut key = [n; 32];
    key[..8].fill(n / 2);
    WgKey(key).to_base64()
}

const RULE_SETS: [&str; 5] = [
    r#"[]"#,
    r#"[{"cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443]}]"#,
    r#"[{"cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443]}, {"cidr": "0.0.0.0/0", "protocol": "icmp"}]"#,
    r#"[{"cidr": "fd00::/8", "protocol": "udp", "ports": ["5000-5010"]}, {"cidr": "10.1.0.0/16"}]"#,
    r#"[{"cidr": "192.0.2.0/24", "protocol": "udp"}]"#,
];

#[derive(Debug, Clone)]
struct Gen {
    name: u8,
    key: u8,
    v4: Option<u8>,
    v6: Option<u8>,
    rules: Option<usize>,
    endpoint: Option<u8>,
    psk: Option<u8>,
    keepalive: bool,
}

fn gen_peer() -> impl Strategy<Value = Gen> {
    (
        0u8..6,
        0u8..8,
        proptest::option::of(2u8..9),
        proptest::option::of(2u8..9),
        proptest::option::of(0usize..RULE_SETS.len()),
        proptest::option::of(1u8..3),
        proptest::option::of(1u8..3),
        any::<bool>(),
    )
        .prop_map(|(name, key, v4, v6, rules, endpoint, psk, keepalive)| Gen {
            name,
            key,
            v4: v4.or(if v6.is_none() { Some(name + 2) } else { None }),
            v6,
            rules,
            endpoint,
            psk,
            keepalive,
        })
}

/// A valid state from generated peers (conflicting ones are dropped), in the given order.
fn build(gens: &[Gen]) -> (String, DesiredState) {
    let mut seen = BTreeSet::new();
    let mut peers: Vec<Value> = Vec::new();
    for g in gens {
        let ids = [
            format!("n{}", g.name),
            format!("k{}", g.key),
            format!("a{:?}", g.v4),
            format!("b{:?}", g.v6),
        ];
        let clash = ids
            .iter()
            .filter(|id| !id.ends_with("None"))
            .any(|id| seen.contains(id));
        if clash {
            continue;
        }
        seen.extend(ids.into_iter().filter(|id| !id.ends_with("None")));
        let mut p = json!({ "name": format!("peer-{}", g.name), "publicKey": gen_key(g.key + 1) });
        if let Some(a) = g.v4 {
            p["address"] = json!(format!("10.8.0.{a}"));
        }
        if let Some(b) = g.v6 {
            p["addressV6"] = json!(format!("fd00:8::{b}"));
        }
        if let Some(r) = g.rules {
            p["egress"] = serde_json::from_str(RULE_SETS[r]).unwrap();
        }
        if let Some(e) = g.endpoint {
            p["endpoint"] = json!(format!("198.51.100.{e}:51820"));
        }
        if let Some(k) = g.psk {
            p["presharedKey"] = json!(key(100 + k));
        }
        if g.keepalive {
            p["persistentKeepalive"] = json!(25);
        }
        peers.push(p);
    }
    let text = json!({ "version": 1, "peers": peers }).to_string();
    let state = parse(&text).unwrap_or_else(|e| panic!("generated state invalid: {e}\n{text}"));
    (text, state)
}

/// Counter slots of the kernel the property tests plan for: fewer than their peers, so
/// that they plan at a full map too.
const SLOTS: u32 = 4;

/// Whether `new` needs more counter slots than a kernel of [`SLOTS`] has: then planning it
/// must fail, with a lead of deletions only that revokes what leaves the state.
fn over_capacity(kernel: &Kernel, new: &DesiredState, planned: &Result<Plan, Unplanned>) -> bool {
    let over = new.peers.len() > SLOTS as usize;
    assert_eq!(
        over,
        matches!(
            planned,
            Err(Unplanned {
                error: PlanError::SlotsExhausted,
                ..
            })
        ),
        "{} peers at {SLOTS} slots planned {planned:?}",
        new.peers.len()
    );
    if let Err(Unplanned { lead, .. }) = planned {
        assert_eq!(
            lead.lead(),
            lead.ops.as_slice(),
            "not only deletions: {lead:?}"
        );
        if let Err(e) = invariants::check_revocations_lead(&kernel.0, new, &lead.ops) {
            panic!("the lead of a failed plan: {e}");
        }
    }
    over
}

fn apply_checked(kernel: &mut Kernel, old: &DesiredState, new: &DesiredState) -> Plan {
    let plan = plan(new, &kernel.actual()).unwrap();
    apply_plan_checked(kernel, old, new, &plan);
    plan
}

/// Applies `plan` (old -> new) with its lead and every midway invariant checked.
#[track_caller]
fn apply_plan_checked(kernel: &mut Kernel, old: &DesiredState, new: &DesiredState, plan: &Plan) {
    if let Err(e) = invariants::check_revocations_lead(&kernel.0, new, &plan.ops) {
        panic!("{e}");
    }
    for op in &plan.ops {
        kernel.apply(op);
        assert_safe_midway(kernel, old, new);
    }
}

fn one(peers: Value) -> DesiredState {
    parse(&json!({ "version": 1, "peers": peers }).to_string()).unwrap()
}

/// A full plan, or one that looks only at what differs from `previous`.
fn plan_either(
    incremental: bool,
    previous: &DesiredState,
    desired: &DesiredState,
    kernel: &Kernel,
) -> Result<Plan, Unplanned> {
    if incremental {
        plan_update(previous, desired, &kernel.0)
    } else {
        plan(desired, &kernel.0)
    }
}

fn converge(kernel: &mut Kernel, old: &DesiredState, new: &DesiredState) -> Plan {
    let plan = apply_checked(kernel, old, new);
    assert_converged(kernel, new);
    plan
}

fn kernel_entry(kernel: &Kernel, addr: IpAddr) -> PeerEntry {
    kernel
        .0
        .maps()
        .peers
        .get(&addr)
        .copied()
        .unwrap_or_else(|| panic!("no entry for {addr}"))
}

/// The owner of each address's entry.
fn owners(kernel: &Kernel) -> BTreeMap<IpAddr, u64> {
    kernel
        .0
        .maps()
        .peers
        .iter()
        .map(|(a, e)| (*a, e.owner))
        .collect()
}

/// A change made to the kernel behind the agent's back (the [`drift`] kinds).
fn gen_drift() -> impl Strategy<Value = (u8, usize, u8)> {
    (0u8..11, any::<usize>(), any::<u8>())
}

/// `actual` with `(kind, which, value)` done to it, read back as the agent would.
fn drift(actual: &Actual, changes: &[(u8, usize, u8)]) -> Actual {
    let (mut maps, mut wg) = (actual.maps.clone(), actual.wg.clone());
    for &(kind, which, value) in changes {
        let addr = maps
            .peers
            .keys()
            .nth(which % maps.peers.len().max(1))
            .copied();
        let key = wg.peers.keys().nth(which % wg.peers.len().max(1)).copied();
        let entry = addr.and_then(|a| maps.peers.get_mut(&a));
        let peer = key.and_then(|k| wg.peers.get_mut(&k));
        match (kind, entry, peer) {
            (0, Some(_), _) => {
                addr.map(|a| maps.peers.remove(&a));
            }
            (1, Some(e), _) => e.slot = u32::from(value) % SLOTS,
            (2, Some(e), _) => e.owner = u64::from(value),
            (3, Some(e), _) => {
                e.policy = [UNRESTRICTED, EMPTY_POLICY, 1, 2][usize::from(value % 4)]
            }
            (4, Some(e), _) => e.rules = [NO_RULES, 0, 1][usize::from(value % 3)],
            (5, _, Some(_)) => {
                key.map(|k| wg.peers.remove(&k));
            }
            (6, _, Some(p)) => {
                p.allowed_ips
                    .insert(IpNet::from(IpAddr::from([10, 8, 0, value % 10])));
            }
            (7, _, Some(p)) => {
                p.endpoint = Some(SocketAddr::from(([198, 51, 100, value % 3], 51820)));
            }
            // A policy's trie entry deleted; a policy's content copied under another id
            // (two ids of one content, or entries under an id that takes none); the
            // owner high-water mark moved.
            (8, _, _) => {
                let n = maps.policies.len().max(1);
                if let Some(policy) = maps.policies.values_mut().nth(which % n) {
                    let k = usize::from(value) % policy.entries().len().max(1);
                    let prefix = policy.entries().nth(k).map(|(p, _)| p);
                    prefix.map(|p| Arc::make_mut(policy).remove_entry(&p));
                }
            }
            (9, _, _) => {
                let n = maps.policies.len().max(1);
                let content = maps.policies.values().nth(which % n).cloned();
                let id = [UNRESTRICTED, EMPTY_POLICY, 1, 2, 3][usize::from(value % 5)];
                content.map(|c| maps.policies.insert(id, c));
            }
            (10, _, _) => maps.owner_high = u64::from(value),
            _ => {}
        }
    }
    Actual::new(maps, wg).with_slot_limit(SLOTS)
}

/// Applies `ops` to a kernel whose policy tries hold at most `capacity` entries in all, as
/// the agent would: stops at the first put the trie refuses (ENOSPC). Whether all ran.
fn apply_at_capacity(kernel: &mut Kernel, ops: &[Op], capacity: usize) -> bool {
    for op in ops {
        if let Op::PutPolicyEntry { policy, prefix, .. } = op {
            let policies = &kernel.0.maps().policies;
            let total: usize = policies.values().map(|p| p.entries().len()).sum();
            let exists = policies
                .get(policy)
                .is_some_and(|p| p.entries().any(|(q, _)| q == *prefix));
            if !exists && total >= capacity {
                return false;
            }
        }
        kernel.apply(op);
    }
    true
}
