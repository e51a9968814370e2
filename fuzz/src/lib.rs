//! The properties the fuzz targets check, as functions that return what is wrong, so a crash
//! found by the fuzzer can be replayed as a plain unit test.

use std::collections::BTreeSet;

use arbitrary::Arbitrary;
use serde_json::{json, Value};
use wgfence::{
    plan::{invariants, lead, plan, plan_update, Actual, Op, PlanError, Unplanned},
    state::{parse, parse_unchecked, parse_value_tree, DesiredState, WgKey},
};

/// `text` as a state file: the typed pass and the value-tree walk decide alike; a valid state
/// writes back to canonical JSON that parses to the same state and the same text, and plans
/// from an empty kernel to exactly itself.
pub fn check_state(text: &str) -> Result<(), String> {
    // The two passes validate; the policy tests run after either (`parse`).
    let parsed = parse_unchecked(text);
    let walked = parse_value_tree(text);
    if parsed != walked {
        return Err(format!(
            "the typed pass and the value-tree walk disagree:\n typed: {parsed:?}\n walk: {walked:?}"
        ));
    }
    let checked = parse(text);
    match (&parsed, &checked) {
        (Ok(state), Ok(again)) if state == again => {}
        (Ok(state), Err(e)) if !state.tests.is_empty() && !e.errors.is_empty() => {
            // Rejected by its own tests: every error is a test's.
            if let Some(other) = e.errors.iter().find(|e| !e.location.starts_with("tests[")) {
                return Err(format!("a policy test failure that names no test: {other}"));
            }
            return Ok(());
        }
        (Err(_), Err(_)) => {}
        _ => {
            return Err(format!(
                "the policy tests changed more than the verdict:\n unchecked: {parsed:?}\n checked: {checked:?}"
            ))
        }
    }
    let state = match parsed {
        Ok(state) => state,
        Err(e) => {
            if e.errors.is_empty() {
                return Err("rejected without an error".into());
            }
            let _ = e.to_string();
            return Ok(());
        }
    };
    let canonical = state.to_canonical_json();
    let again =
        parse(&canonical).map_err(|e| format!("canonical JSON rejected: {e}\n{canonical}"))?;
    if again != state {
        return Err(format!(
            "canonical JSON parses to another state:\n{canonical}\n{state:?}\n{again:?}"
        ));
    }
    let twice = again.to_canonical_json();
    if twice != canonical {
        return Err(format!(
            "canonical JSON is not stable:\n{canonical}\n{twice}"
        ));
    }
    converge(
        &mut Actual::default(),
        &DesiredState::default(),
        &state,
        Mode::Full,
    )
}

#[derive(Clone, Copy)]
enum Mode {
    Full,
    Since,
    /// A full plan from a kernel where a failed plan's lead ran: it matches no state (the
    /// revoked peers are already cut off), so the midway checks against `old` do not apply.
    AfterFailure,
}

/// Plans `new` against `kernel` (known to match `old`), applies it to the model operation by
/// operation with the invariants checked after each one, then checks convergence and that
/// nothing is left to do.
fn converge(
    kernel: &mut Actual,
    old: &DesiredState,
    new: &DesiredState,
    mode: Mode,
) -> Result<(), String> {
    let ops = match mode {
        Mode::Full | Mode::AfterFailure => plan(new, kernel),
        Mode::Since => plan_update(old, new, kernel),
    }
    .map_err(|e| format!("planning failed: {e}"))?
    .ops;
    invariants::check_revocations_lead(kernel, new, &ops)?;
    for op in &ops {
        invariants::check_op(kernel, op).map_err(|e| format!("{op}: {e}"))?;
        kernel.apply(op);
        if !matches!(mode, Mode::AfterFailure) {
            invariants::check_safe_midway(kernel, old, new)
                .map_err(|e| format!("after {op}: {e}"))?;
        }
    }
    invariants::check_converged(kernel, new)?;
    for (what, again) in [
        ("full", plan(new, kernel)),
        ("incremental", plan_update(new, new, kernel)),
    ] {
        match again {
            Ok(p) if p.is_empty() => {}
            Ok(p) => return Err(format!("a {what} plan after converging: {:?}", p.ops)),
            Err(e) => return Err(format!("a {what} plan after converging failed: {e}")),
        }
    }
    Ok(())
}

/// Applies the lead of a plan that failed: deletions only, every revocation among them, each
/// operation safe.
fn apply_lead(
    kernel: &mut Actual,
    old: &DesiredState,
    new: &DesiredState,
    ops: &[Op],
) -> Result<(), String> {
    if lead(ops).len() != ops.len() {
        return Err(format!("not only deletions: {ops:?}"));
    }
    invariants::check_revocations_lead(kernel, new, ops)?;
    for op in ops {
        invariants::check_op(kernel, op).map_err(|e| format!("{op}: {e}"))?;
        kernel.apply(op);
        invariants::check_safe_midway(kernel, old, new).map_err(|e| format!("after {op}: {e}"))?;
    }
    Ok(())
}

/// A sequence of states for the planner, from small spaces so that peers collide, addresses
/// move, and policies are shared, nested and changed.
#[derive(Debug, Clone, Arbitrary)]
pub struct Scenario {
    pub states: Vec<Vec<GenPeer>>,
}

#[derive(Debug, Clone, Arbitrary)]
pub struct GenPeer {
    pub name: u8,
    pub key: u8,
    pub v4: Option<u8>,
    pub v6: Option<u8>,
    /// `None`: no `egress` (unrestricted); `Some(empty)`: `"egress": []`, allowed nothing.
    pub rules: Option<Vec<GenRule>>,
    pub endpoint: Option<u8>,
    pub psk: Option<u8>,
    pub keepalive: Option<u8>,
}

#[derive(Debug, Clone, Arbitrary)]
pub struct GenRule {
    pub v6: bool,
    pub net: u8,
    pub len: u8,
    pub protocol: u8,
    /// Port ranges of a tcp/udp rule, ICMP type ranges (`types`) of an icmp rule.
    pub ports: Vec<(u8, u8)>,
    /// A prefix carved out of the cidr (`except`): this many bits longer, at its start.
    pub hole: Option<u8>,
}

const MAX_STATES: usize = 6;
const MAX_PEERS: usize = 8;
/// Counter slots of the modelled kernel: fewer than a scenario's six distinct names, so that
/// plans meet a full peer map (fuzz/corpus/plan/slots-exhausted-at-a-full-map is a state that
/// fits and once failed there).
const SLOTS: u32 = 4;
const MAX_RULES: usize = 4;
/// Port range starts near the edges and near each other (overlapping and adjacent ranges).
const PORTS: [u16; 8] = [1, 2, 22, 442, 443, 444, 65534, 65535];

fn key(n: u8) -> String {
    WgKey([n; 32]).to_base64()
}

impl GenRule {
    fn to_json(&self) -> Value {
        let cidr = if self.v6 {
            let len = self.len % 129;
            let addr = std::net::Ipv6Addr::new(0xfd00, u16::from(self.net % 4), 0, 0, 0, 0, 0, 1);
            ipnet::Ipv6Net::new(addr, len)
                .map(|n| n.trunc().to_string())
                .unwrap_or_default()
        } else {
            let len = self.len % 33;
            let addr = std::net::Ipv4Addr::new(10, self.net % 4, self.net / 4 % 4, 1);
            ipnet::Ipv4Net::new(addr, len)
                .map(|n| n.trunc().to_string())
                .unwrap_or_default()
        };
        let protocol = ["any", "tcp", "udp", "icmp"][usize::from(self.protocol % 4)];
        let mut rule = json!({ "cidr": cidr, "protocol": protocol });
        if matches!(protocol, "tcp" | "udp") && !self.ports.is_empty() {
            let ports: Vec<Value> = self
                .ports
                .iter()
                .take(3)
                .map(|&(a, b)| {
                    let lo = PORTS[usize::from(a % 8)];
                    let hi = lo.saturating_add(u16::from(b % 4));
                    if lo == hi {
                        json!(lo)
                    } else {
                        json!(format!("{lo}-{hi}"))
                    }
                })
                .collect();
            rule["ports"] = Value::Array(ports);
        }
        if protocol == "icmp" && !self.ports.is_empty() {
            let types: Vec<Value> = self
                .ports
                .iter()
                .take(2)
                .map(|&(a, b)| match b % 3 {
                    0 => json!(["echo-request", "echo-reply", "time-exceeded"][usize::from(a % 3)]),
                    1 => json!(a),
                    _ => json!(format!("{}-{}", a % 16, a % 16 + b % 8)),
                })
                .collect();
            rule["types"] = Value::Array(types);
        }
        if let (Some(extra), Ok(net)) = (self.hole, cidr.parse::<ipnet::IpNet>()) {
            let len = net.prefix_len().saturating_add(extra % 8 + 1);
            if let Ok(mut holes) = net.subnets(len.min(net.max_prefix_len())) {
                if let Some(hole) = holes.nth(usize::from(extra / 8 % 2)) {
                    if hole.prefix_len() > net.prefix_len() {
                        rule["except"] = json!([hole.to_string()]);
                    }
                }
            }
        }
        rule
    }
}

/// The state file of `peers` (peers that clash with an earlier one on name, key or address
/// are left out), in the given order, rules reversed if asked.
fn state_json(peers: &[GenPeer], reverse_rules: bool) -> String {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for g in peers.iter().take(MAX_PEERS) {
        let v4 = g.v4.map(|a| a % 8 + 2);
        let v6 = g.v6.map(|b| b % 8 + 2);
        let v4 = if v4.is_none() && v6.is_none() {
            Some(g.name % 6 + 2)
        } else {
            v4
        };
        let ids: Vec<String> = [
            Some(format!("n{}", g.name % 6)),
            Some(format!("k{}", g.key % 8)),
            v4.map(|a| format!("a{a}")),
            v6.map(|b| format!("b{b}")),
        ]
        .into_iter()
        .flatten()
        .collect();
        if ids.iter().any(|id| seen.contains(id)) {
            continue;
        }
        seen.extend(ids);
        let mut p =
            json!({ "name": format!("peer-{}", g.name % 6), "publicKey": key(g.key % 8 + 1) });
        if let Some(a) = v4 {
            p["address"] = json!(format!("10.8.0.{a}"));
        }
        if let Some(b) = v6 {
            p["addressV6"] = json!(format!("fd00:8::{b}"));
        }
        if let Some(rules) = &g.rules {
            let mut rules: Vec<Value> =
                rules.iter().take(MAX_RULES).map(GenRule::to_json).collect();
            if reverse_rules {
                rules.reverse();
            }
            p["egress"] = Value::Array(rules);
        }
        if let Some(e) = g.endpoint {
            p["endpoint"] = json!(format!("198.51.100.{}:51820", e % 3 + 1));
        }
        if let Some(k) = g.psk {
            p["presharedKey"] = json!(key(100 + k % 3));
        }
        if let Some(k) = g.keepalive {
            p["persistentKeepalive"] = json!(k % 3 * 25);
        }
        out.push(p);
    }
    json!({ "version": 1, "peers": out }).to_string()
}

/// Each state of the scenario in turn, planned in full on one model of the kernel and
/// incrementally on another: every invariant holds after every operation, both converge to
/// the same kernel, and the same state in another order plans nothing.
pub fn check_plans(scenario: &Scenario) -> Result<(), String> {
    let mut full = Actual::default().with_slot_limit(SLOTS);
    let mut incremental = Actual::default().with_slot_limit(SLOTS);
    let mut old = DesiredState::default();
    // After a failed plan the kernel matches no state: the next plan compares everything.
    let mut stale = false;
    for gens in scenario.states.iter().take(MAX_STATES) {
        let text = state_json(gens, false);
        // A generated state the schema rejects (e.g. too many allows) is skipped, as the agent
        // keeps the last good state.
        let Ok(new) = parse(&text) else { continue };
        // More peers than counter slots: both plans must fail, and only their leads apply
        // (deletions that revoke what leaves the state, safely), to the same kernel. (No slot
        // is ever shared to make room.) The agent then reads the kernel and plans in full.
        if new.peers.len() > SLOTS as usize {
            let planned = [plan(&new, &full), plan_update(&old, &new, &incremental)];
            for ((how, kernel), planned) in [("full", &mut full), ("incremental", &mut incremental)]
                .into_iter()
                .zip(planned)
            {
                let Err(Unplanned {
                    error: PlanError::SlotsExhausted,
                    lead,
                }) = planned
                else {
                    return Err(format!(
                        "{how}: {} peers at {SLOTS} slots planned {planned:?}\n{text}",
                        new.peers.len()
                    ));
                };
                apply_lead(kernel, &old, &new, &lead.ops)
                    .map_err(|e| format!("{how}, the lead of a failed plan: {e}\n{text}"))?;
            }
            if incremental != full {
                return Err(format!(
                    "the leads of failed plans left different kernels\n{text}"
                ));
            }
            stale = true;
            continue;
        }
        let (full_mode, incremental_mode) = if std::mem::take(&mut stale) {
            (Mode::AfterFailure, Mode::AfterFailure)
        } else {
            (Mode::Full, Mode::Since)
        };
        converge(&mut full, &old, &new, full_mode).map_err(|e| format!("full: {e}\n{text}"))?;
        converge(&mut incremental, &old, &new, incremental_mode)
            .map_err(|e| format!("incremental: {e}\n{text}"))?;
        // Planning only what differs from the previous state must do what a full plan does.
        if incremental != full {
            return Err(format!(
                "incremental and full plans left different kernels\n{text}"
            ));
        }
        let mut reversed: Vec<GenPeer> = gens.iter().take(MAX_PEERS).cloned().collect();
        reversed.reverse();
        let reordered = state_json(&reversed, true);
        if let Ok(again) = parse(&reordered) {
            if again == new {
                match plan(&again, &full) {
                    Ok(p) if p.is_empty() => {}
                    other => {
                        return Err(format!("a reordered state planned {other:?}\n{reordered}"))
                    }
                }
            }
        }
        old = new;
    }
    Ok(())
}

#[cfg(test)]
mod replay {
    /// The committed state corpus (seeds for `except`, `types` and `tests` among them) passes
    /// the state target's checks without the fuzzer.
    #[test]
    fn the_committed_state_corpus_passes() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/state");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap_or_else(|e| panic!("{e}")).path();
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            if let Ok(text) = std::str::from_utf8(&bytes) {
                if let Err(e) = super::check_state(text) {
                    panic!("{}: {e}", path.display());
                }
                n += 1;
            }
        }
        assert!(n > 0, "no corpus in {}", dir.display());
    }
}
