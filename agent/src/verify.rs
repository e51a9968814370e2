//! Drift: where the kernel's maps and the WireGuard device differ from what a state compiles
//! to, entry by entry. `wgfence verify` prints it (and exits 1 on any); the agent exports its
//! size as `wgfence_drift_entries` after every resync's read, before the reconcile repairs it.
//!
//! Pure: a function of (desired, actual), like the planner. Policy ids are the kernel's own
//! (the agent allocates them), so a restricted peer's policy is compared by content: the trie
//! entries under the id its peer entry points at against the entries its rules compile to.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
    path::Path,
};

use ipnet::IpNet;
use serde::Serialize;
use wgfence_common::{Allow, UNRESTRICTED};

use crate::{
    explain::AllowText,
    plan::{Actual, ActualMaps, AllowedIps},
    policy::{CompiledPolicy, NOTHING},
    state::{DesiredState, PeerSpec},
};

/// One entry that differs.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Drift {
    /// What differs: `peer entry 10.8.0.2`, `policy 3 trie entry 10.2.3.4/32`,
    /// `WireGuard peer alice`.
    pub entry: String,
    /// How.
    pub what: String,
}

impl fmt::Display for Drift {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.entry, self.what)
    }
}

fn allows_text(allows: &[Allow]) -> String {
    let items: Vec<String> = allows.iter().map(|a| AllowText(*a).to_string()).collect();
    format!("[{}]", items.join(", "))
}

fn drift(entry: String, what: String) -> Drift {
    Drift { entry, what }
}

/// Every entry of `actual` that differs from what `desired` compiles to, sorted.
pub fn drift_of(desired: &DesiredState, actual: &Actual) -> Vec<Drift> {
    let mut out = Vec::new();
    peer_entry_drift(desired, actual.maps(), &mut out);
    orphan_policy_drift(actual.maps(), &mut out);
    wireguard_drift(desired, actual, &mut out);
    out.sort();
    out
}

/// The peer entries, and the policy each restricted one points at (compared once per id).
fn peer_entry_drift(desired: &DesiredState, maps: &ActualMaps, out: &mut Vec<Drift>) {
    let wanted: BTreeMap<IpAddr, &PeerSpec> = desired
        .peers
        .iter()
        .flat_map(|p| p.addrs().map(move |a| (a, p)))
        .collect();
    let mut checked: BTreeSet<u32> = BTreeSet::new();
    for (addr, peer) in &wanted {
        let entry = format!("peer entry {addr}");
        let Some(live) = maps.peers.get(addr) else {
            out.push(drift(
                entry,
                format!("missing (peer {} in the state file)", peer.name),
            ));
            continue;
        };
        match (&peer.policy, live.policy) {
            (None, UNRESTRICTED) => {}
            (None, id) => out.push(drift(
                entry,
                format!(
                    "points at policy {id}; the state file has peer {} unrestricted",
                    peer.name
                ),
            )),
            (Some(_), UNRESTRICTED) => out.push(drift(
                entry,
                format!("unrestricted; the state file restricts peer {}", peer.name),
            )),
            (Some(want), id) => {
                if checked.insert(id) {
                    let have = maps.policies.get(&id).map_or(&NOTHING, |p| &**p);
                    policy_drift(id, &peer.name, have, want, out);
                }
            }
        }
    }
    for (addr, live) in &maps.peers {
        if !wanted.contains_key(addr) {
            out.push(drift(
                format!("peer entry {addr}"),
                format!(
                    "not in the state file (policy {})",
                    if live.policy == UNRESTRICTED {
                        "0, unrestricted".to_owned()
                    } else {
                        live.policy.to_string()
                    }
                ),
            ));
        }
    }
}

/// The trie entries under ids no peer entry points at.
fn orphan_policy_drift(maps: &ActualMaps, out: &mut Vec<Drift>) {
    let referenced: BTreeSet<u32> = maps.peers.values().map(|e| e.policy).collect();
    for (id, policy) in &maps.policies {
        if referenced.contains(id) {
            continue;
        }
        for (prefix, allows) in policy.entries() {
            out.push(drift(
                format!("policy {id} trie entry {prefix}"),
                format!(
                    "{} under a policy id no peer entry uses",
                    allows_text(allows)
                ),
            ));
        }
    }
}

/// The WireGuard peers: present, and routed exactly the peer's addresses.
fn wireguard_drift(desired: &DesiredState, actual: &Actual, out: &mut Vec<Drift>) {
    let mut keys = BTreeSet::new();
    for peer in &desired.peers {
        keys.insert(peer.public_key);
        let entry = format!("WireGuard peer {}", peer.name);
        let want: AllowedIps = peer.addrs().map(IpNet::from).collect();
        match actual.wg().peers.get(&peer.public_key) {
            None => out.push(drift(
                entry,
                format!("missing (public key {})", peer.public_key.to_base64()),
            )),
            Some(have) if have.allowed_ips != want => {
                let list = |s: &AllowedIps| {
                    s.iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(",")
                };
                out.push(drift(
                    entry,
                    format!(
                        "allowed IPs {}; the state file gives {}",
                        list(&have.allowed_ips),
                        list(&want)
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    for (key, have) in &actual.wg().peers {
        if !keys.contains(key) {
            let ips: Vec<String> = have.allowed_ips.iter().map(ToString::to_string).collect();
            out.push(drift(
                format!("WireGuard peer {}", key.to_base64()),
                format!("not in the state file (allowed IPs {})", ips.join(",")),
            ));
        }
    }
}

/// The trie entries of live policy `id` (peer `name`'s) against what its rules compile to.
fn policy_drift(
    id: u32,
    name: &str,
    have: &CompiledPolicy,
    want: &CompiledPolicy,
    out: &mut Vec<Drift>,
) {
    let have: BTreeMap<IpNet, &[Allow]> = have.entries().collect();
    let want: BTreeMap<IpNet, &[Allow]> = want.entries().collect();
    let prefixes: BTreeSet<&IpNet> = have.keys().chain(want.keys()).collect();
    for prefix in prefixes {
        let entry = format!("policy {id} trie entry {prefix}");
        match (have.get(prefix), want.get(prefix)) {
            (Some(h), None) => out.push(drift(
                entry,
                format!(
                    "{} is not in the state file (peer {name}'s rules)",
                    allows_text(h)
                ),
            )),
            (None, Some(w)) => out.push(drift(
                entry,
                format!("missing: peer {name}'s rules compile to {}", allows_text(w)),
            )),
            (Some(h), Some(w)) if h != w => out.push(drift(
                entry,
                format!(
                    "{}; peer {name}'s rules compile to {}",
                    allows_text(h),
                    allows_text(w)
                ),
            )),
            _ => {}
        }
    }
}

/// `wgfence verify`'s answer: the drift of the kernel (the pinned maps and the WireGuard
/// device) from a state, with the sizes compared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verification {
    /// The state file compared with, as it is to be named.
    pub state_file: String,
    pub drift: Vec<Drift>,
    pub peer_entries: usize,
    pub trie_entries: usize,
    pub wireguard_peers: usize,
}

impl Verification {
    /// The drift of `actual` from `desired` (read from `state_file`). A peer whose window is
    /// over is revoked: its absence is no drift.
    pub fn of(desired: &DesiredState, actual: &Actual, state_file: &Path) -> Self {
        let desired = desired.unexpired(crate::clock::unix_secs());
        Self {
            state_file: state_file.display().to_string(),
            drift: drift_of(&desired, actual),
            peer_entries: actual.maps().peers.len(),
            trie_entries: actual.maps().policies.values().map(|p| p.len()).sum(),
            wireguard_peers: actual.wg().peers.len(),
        }
    }
}

impl fmt::Display for Verification {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.drift.is_empty() {
            return writeln!(
                f,
                "no drift: the {} peer entries, {} trie entries and {} WireGuard peers are what \
                 {} compiles to",
                self.peer_entries, self.trie_entries, self.wireguard_peers, self.state_file
            );
        }
        writeln!(
            f,
            "DRIFT: {} {} from {}:",
            self.drift.len(),
            if self.drift.len() == 1 {
                "entry differs"
            } else {
                "entries differ"
            },
            self.state_file
        )?;
        for d in &self.drift {
            writeln!(f, "  {d}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use wgfence_common::{PeerEntry, PROTO_TCP};

    use super::*;
    use crate::{
        explain::compiled_maps,
        plan::{ActualWg, WgPeer},
        state::parse,
    };

    const KEY: &str = "AQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
    const KEY2: &str = "AgAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

    fn state() -> DesiredState {
        let text = format!(
            r#"{{"version": 1, "peers": [
            {{"name": "alice", "publicKey": "{KEY}", "address": "10.8.0.2",
              "egress": [{{"cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443]}}]}},
            {{"name": "bob", "publicKey": "{KEY2}", "address": "10.8.0.3"}}]}}"#
        );
        parse(&text).unwrap()
    }

    fn wg(state: &DesiredState) -> ActualWg {
        ActualWg {
            peers: state
                .peers
                .iter()
                .map(|p| {
                    (
                        p.public_key,
                        WgPeer {
                            allowed_ips: p.addrs().map(IpNet::from).collect(),
                            ..WgPeer::default()
                        },
                    )
                })
                .collect(),
        }
    }

    fn net(s: &str) -> IpNet {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn what_a_state_compiles_to_has_no_drift() {
        let state = state();
        let maps = compiled_maps(&state).unwrap();
        assert_eq!(drift_of(&state, &Actual::new(maps, wg(&state))), vec![]);
    }

    #[test]
    fn names_each_entry_that_differs() {
        let state = state();
        let mut maps = compiled_maps(&state).unwrap();
        let alice: IpAddr = "10.8.0.2".parse().unwrap();
        let id = maps.peers.get(&alice).map(|e| e.policy).unwrap();
        // An allow entry added behind the agent's back, a stranger's peer entry, an orphan
        // policy and an extra allowed IP.
        if let Some(policy) = maps.policies.get_mut(&id) {
            std::sync::Arc::make_mut(policy)
                .insert_entry(net("10.2.3.4/32"), vec![Allow::new(PROTO_TCP, 22, 22)]);
        }
        maps.peers
            .insert("10.8.0.9".parse().unwrap(), PeerEntry::default());
        maps.policies.insert(
            77,
            std::sync::Arc::new(CompiledPolicy::from_entries([(
                net("0.0.0.0/0"),
                vec![Allow::new(0, 0, u16::MAX)],
            )])),
        );
        let mut wg = wg(&state);
        if let Some(p) = wg.peers.values_mut().next() {
            p.allowed_ips.insert(net("10.8.0.99/32"));
        }
        let d = drift_of(&state, &Actual::new(maps, wg));
        let entries: BTreeSet<&str> = d.iter().map(|d| d.entry.as_str()).collect();
        let added = format!("policy {id} trie entry 10.2.3.4/32");
        let want: BTreeSet<&str> = [
            "WireGuard peer alice",
            "peer entry 10.8.0.9",
            "policy 77 trie entry 0.0.0.0/0",
            added.as_str(),
        ]
        .into();
        assert_eq!(entries, want, "{d:#?}");
        assert!(
            d.iter()
                .any(|d| d.entry == added && d.what.contains("[tcp 22] is not in the state file")),
            "{d:#?}"
        );
    }
}
