//! The design wgfence replaces: one iptables chain per peer, jumped to from a source-address
//! chain, the whole ruleset applied with `iptables-restore` on every state push. Rendered from
//! the same desired state wgfence enforces, so both run on the same input.
//!
//! Only the IPv4 half is rendered (iptables; the old design also ran ip6tables-restore): the
//! baseline's apply cost is, if anything, understated.

use std::{
    fmt::Write as _,
    io::Write as _,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use ipnet::IpNet;
use wgfence::{
    policy::{PortRange, Protocol},
    state::DesiredState,
};

use crate::net::Netns;

/// The two iptables backends Debian ships.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Nft,
    Legacy,
}

impl Backend {
    pub fn restore_binary(self) -> &'static str {
        match self {
            Backend::Nft => "iptables-nft-restore",
            Backend::Legacy => "iptables-legacy-restore",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Nft => "iptables-nft",
            Backend::Legacy => "iptables-legacy",
        }
    }
}

/// The ruleset for packets arriving on `interface`: per peer a chain of ACCEPTs ending in DROP
/// (or a plain ACCEPT for an unrestricted peer), unknown sources dropped.
pub fn render(desired: &DesiredState, interface: &str) -> String {
    let mut out = String::with_capacity(desired.peers.len() * 200);
    out.push_str("*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n");
    out.push_str(":WGF-PEERS - [0:0]\n");
    for i in 0..desired.peers.len() {
        let _ = writeln!(out, ":WGF-{i:06} - [0:0]");
    }
    let _ = writeln!(out, "-A INPUT -i {interface} -j WGF-PEERS");
    let _ = writeln!(out, "-A FORWARD -i {interface} -j WGF-PEERS");
    for (i, peer) in desired.peers.iter().enumerate() {
        let Some(addr) = peer.address else { continue };
        if peer.rules.is_none() {
            let _ = writeln!(out, "-A WGF-PEERS -s {addr}/32 -j ACCEPT");
        } else {
            let _ = writeln!(out, "-A WGF-PEERS -s {addr}/32 -j WGF-{i:06}");
        }
    }
    out.push_str("-A WGF-PEERS -j DROP\n");
    for (i, peer) in desired.peers.iter().enumerate() {
        // A peer allowed nothing has an empty chain: it returns to the final DROP.
        let (Some(rules), Some(_)) = (&peer.rules, peer.address) else {
            continue;
        };
        let chain = format!("WGF-{i:06}");
        for rule in rules.iter() {
            let IpNet::V4(cidr) = rule.cidr else { continue };
            match rule.protocol {
                Protocol::Any => {
                    let _ = writeln!(out, "-A {chain} -d {cidr} -j ACCEPT");
                }
                Protocol::Icmp => {
                    let _ = writeln!(out, "-A {chain} -d {cidr} -p icmp -j ACCEPT");
                }
                Protocol::Tcp | Protocol::Udp => {
                    let p = if rule.protocol == Protocol::Tcp {
                        "tcp"
                    } else {
                        "udp"
                    };
                    let ports = if rule.ports().is_empty() {
                        vec![PortRange::ALL]
                    } else {
                        rule.ports().to_vec()
                    };
                    for r in ports {
                        let _ = writeln!(
                            out,
                            "-A {chain} -d {cidr} -p {p} -m {p} --dport {}:{} -j ACCEPT",
                            r.lo, r.hi
                        );
                    }
                }
            }
        }
        let _ = writeln!(out, "-A {chain} -j DROP");
    }
    out.push_str("COMMIT\n");
    out
}

/// Applies `ruleset` in `ns` with the backend's `iptables-restore` and times it.
pub fn restore(ns: &Netns, backend: Backend, ruleset: &str) -> Duration {
    restore_within(ns, backend, ruleset, Duration::from_secs(3600))
        .unwrap_or_else(|| panic!("{} took over an hour", backend.restore_binary()))
}

/// Like [`restore`], giving up after `limit` (`None`: it took longer).
pub fn restore_within(
    ns: &Netns,
    backend: Backend,
    ruleset: &str,
    limit: Duration,
) -> Option<Duration> {
    let start = Instant::now();
    let mut child = Command::new("timeout")
        .arg(limit.as_secs().to_string())
        .args(["ip", "netns", "exec", ns.name(), backend.restore_binary()])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", backend.restore_binary()));
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(ruleset.as_bytes())
            .expect("writing the ruleset");
    }
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("{}: {e}", backend.restore_binary()));
    if out.status.code() == Some(124) {
        return None;
    }
    assert!(
        out.status.success(),
        "{} failed: {}",
        backend.restore_binary(),
        String::from_utf8_lossy(&out.stderr)
    );
    Some(start.elapsed())
}

/// Removes the ruleset (flushes the filter table and deletes the chains).
pub fn flush(ns: &Netns, backend: Backend) {
    let empty =
        "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n";
    restore(ns, backend, empty);
}
