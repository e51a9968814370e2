//! What a plan is made of: one [`Op`] on the kernel (a map write, a WireGuard change, flow
//! work), how `wgfence plan` prints it, and the [`Plan`]: the ordered operations, with its
//! [`lead`] (the deletions that go before anything that can fail for want of room).

use std::{
    fmt,
    net::{IpAddr, SocketAddr},
};

use ipnet::IpNet;
use wgfence_common::{Allow, Config, PeerEntry, UNRESTRICTED};

use super::EMPTY_POLICY;
use crate::state::WgKey;

/// A change to one WireGuard peer; fields left `None` stay as they are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WgPeerChange {
    pub key: WgKey,
    pub peer: String,
    pub create: bool,
    pub endpoint: Option<SocketAddr>,
    /// `Some(None)`: remove the preshared key.
    pub preshared_key: Option<Option<WgKey>>,
    /// `Some(None)`: switch keepalive off.
    pub persistent_keepalive: Option<Option<u16>>,
    /// Addresses to add to the peer's allowed IPs (never a replacement of the list).
    pub add_allowed_ips: Vec<IpNet>,
}

/// One operation on the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    PutPolicyEntry {
        policy: u32,
        prefix: IpNet,
        allows: Vec<Allow>,
    },
    ResetPeerCounters {
        slot: u32,
    },
    /// Zeroes the rule counters `base..base + len` (a policy's new block), before any entry
    /// points at them.
    ResetRuleCounters {
        base: u32,
        len: u32,
    },
    /// Persists the owner high-water mark in the settings entry, before any entry with an
    /// owner up to `owner` is written: a restarted agent never hands out an owner again.
    RaiseOwnerHigh {
        owner: u64,
    },
    PutPeerEntry {
        peer: String,
        addr: IpAddr,
        entry: PeerEntry,
    },
    DeletePeerEntry {
        addr: IpAddr,
    },
    WgPeer(WgPeerChange),
    RemoveWgPeer {
        key: WgKey,
    },
    DeletePolicyEntry {
        policy: u32,
        prefix: IpNet,
    },
    /// Writes the datapath's settings entry (the replies switch, the flow timeouts and quota,
    /// the drop event rate); its owner high-water mark stays the kernel's. `replies_before`:
    /// the kernel's switch, if it has an entry.
    PutSettings {
        config: Config,
        replies_before: Option<bool>,
    },
    /// Deletes the reply flows recorded for these addresses (they left, or moved to another
    /// WireGuard peer): done off the apply path by the flow sweeper.
    ForgetFlows {
        addrs: Vec<IpAddr>,
    },
    /// Deletes every reply flow (replies were switched off, so switching them on again starts
    /// afresh): done off the apply path by the flow sweeper.
    ForgetAllFlows,
}

impl Op {
    /// Whether this is one BPF map write (the flow deletions are bulk work of their own).
    pub fn is_map_write(&self) -> bool {
        !self.is_wg() && !self.is_flow_work()
    }

    /// Whether this is a WireGuard change.
    pub fn is_wg(&self) -> bool {
        matches!(self, Op::WgPeer(_) | Op::RemoveWgPeer { .. })
    }

    /// Whether this deletes reply flows (the sweeper's work, off the apply path).
    pub fn is_flow_work(&self) -> bool {
        matches!(self, Op::ForgetFlows { .. } | Op::ForgetAllFlows)
    }

    /// Whether this only takes something away (an address entry, a WireGuard peer, a policy
    /// entry, reply flows): what a plan's lead is made of.
    pub fn is_deletion(&self) -> bool {
        matches!(
            self,
            Op::DeletePeerEntry { .. }
                | Op::RemoveWgPeer { .. }
                | Op::DeletePolicyEntry { .. }
                | Op::ForgetFlows { .. }
                | Op::ForgetAllFlows
        )
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::PutPolicyEntry {
                policy: id,
                prefix,
                allows,
            } => write!(
                f,
                "map: put policy {id} {prefix} ({} allow entries)",
                allows.len()
            ),
            Op::ResetPeerCounters { slot } => write!(f, "map: reset counters of slot {slot}"),
            Op::ResetRuleCounters { base, len } => {
                write!(f, "map: reset rule counters {base}..{}", base + len)
            }
            Op::RaiseOwnerHigh { owner } => {
                write!(f, "map: raise the owner high-water mark to {owner}")
            }
            Op::PutPeerEntry { peer, addr, entry } => write!(
                f,
                "map: put peer {addr} ({peer}) -> {}, slot {}, owner {}",
                policy_name(entry.policy),
                entry.slot,
                entry.owner
            ),
            Op::DeletePeerEntry { addr } => write!(f, "map: delete peer {addr}"),
            Op::WgPeer(change) => fmt_wg_change(f, change),
            Op::RemoveWgPeer { key } => write!(f, "wireguard: remove peer {key}"),
            Op::DeletePolicyEntry { policy: id, prefix } => {
                write!(f, "map: delete policy {id} {prefix}")
            }
            Op::PutSettings {
                config,
                replies_before,
            } => fmt_settings(f, config, *replies_before),
            Op::ForgetFlows { addrs } => {
                write!(f, "flows: forget the reply flows of")?;
                for addr in addrs {
                    write!(f, " {addr}")?;
                }
                Ok(())
            }
            Op::ForgetAllFlows => write!(f, "flows: forget every reply flow"),
        }
    }
}

/// How `wgfence plan` names a policy id.
fn policy_name(id: u32) -> String {
    match id {
        UNRESTRICTED => "unrestricted".to_owned(),
        EMPTY_POLICY => "nothing (\"egress\": [])".to_owned(),
        id => format!("policy {id}"),
    }
}

/// A WireGuard change as `wgfence plan` prints it: only what it changes.
fn fmt_wg_change(f: &mut fmt::Formatter<'_>, c: &WgPeerChange) -> fmt::Result {
    let verb = if c.create { "add" } else { "update" };
    write!(f, "wireguard: {verb} peer {} ({})", c.key, c.peer)?;
    if let Some(ep) = c.endpoint {
        write!(f, " endpoint {ep}")?;
    }
    match c.preshared_key {
        Some(Some(_)) => write!(f, " preshared-key (set)")?,
        Some(None) => write!(f, " preshared-key (removed)")?,
        None => {}
    }
    match c.persistent_keepalive {
        Some(Some(s)) => write!(f, " keepalive {s}s")?,
        Some(None) => write!(f, " keepalive off")?,
        None => {}
    }
    for ip in &c.add_allowed_ips {
        write!(f, " +allowed-ip {ip}")?;
    }
    Ok(())
}

/// The settings entry as `wgfence plan` prints it: the replies switch from what the kernel has
/// (`replies_before`), the flow timeouts in seconds and the flow quota.
fn fmt_settings(
    f: &mut fmt::Formatter<'_>,
    config: &Config,
    replies_before: Option<bool>,
) -> fmt::Result {
    let on_off = |b: bool| if b { "on" } else { "off" };
    write!(
        f,
        "settings: replies {} -> {}, flow timeouts tcp {}s (closing {}s) udp {}s \
         icmp {}s unanswered {}s, {} flows per peer",
        replies_before.map_or("unset", on_off),
        on_off(config.replies()),
        config.tcp_timeout_ns / 1_000_000_000,
        config.tcp_closing_timeout_ns / 1_000_000_000,
        config.udp_timeout_ns / 1_000_000_000,
        config.icmp_timeout_ns / 1_000_000_000,
        config.unanswered_timeout_ns / 1_000_000_000,
        config.flows_per_peer
    )
}

/// The ordered operations that take the kernel from `actual` to `desired`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub ops: Vec<Op>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    pub fn map_writes(&self) -> usize {
        self.ops.iter().filter(|o| o.is_map_write()).count()
    }

    pub fn wg_changes(&self) -> usize {
        self.ops.iter().filter(|o| o.is_wg()).count()
    }

    /// The plan's lead: its operations before the first that is not a deletion (the
    /// revocations, and the room a full map or trie needs). Nothing that can fail for want of
    /// room comes before them; apply them before anything else.
    pub fn lead(&self) -> &[Op] {
        lead(&self.ops)
    }
}

/// The lead of a list of operations (see [`Plan::lead`]).
pub fn lead(ops: &[Op]) -> &[Op] {
    &ops[..ops
        .iter()
        .position(|op| !op.is_deletion())
        .unwrap_or(ops.len())]
}
