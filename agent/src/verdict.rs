//! The datapath's verdict, modelled: one evaluator ([`evaluate`]) of what the programs decide
//! for a packet on compiled map entries (the kernel's, read back from the pins, or those a
//! state file compiles to), with the reason — the peer entry, the policy id, the matching trie
//! prefix, the allow entry that matched or those that did not — and whether a reply flow lets
//! a denied packet pass. `wgfence explain` ([`crate::explain`]) and the state's policy tests
//! ([`crate::state::assertions`]) both ask it; it knows nothing of states or plans.

use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ipnet::IpNet;
use serde::Serialize;
use wgfence_common::{
    Allow, Config, Counter, FlowValue, PeerEntry, PROTO_ANY, PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP,
    PROTO_UDP, PROTO_UNKNOWN, UNRESTRICTED,
};

use crate::{actual_maps::ActualMaps, policy::CompiledPolicy};

/// ICMP echo reply types: a peer's echo reply can answer a flow (the network's echo request).
const ICMP_ECHO_REPLY: u8 = 0;
const ICMPV6_ECHO_REPLY: u8 = 129;

/// A packet from a peer, as `explain` and the policy tests describe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probe {
    pub src: IpAddr,
    pub dst: IpAddr,
    /// IP protocol number (ICMP means ICMPv6 toward an IPv6 destination: see [`Probe::new`]).
    pub protocol: u8,
    /// TCP/UDP source port (the peer's).
    pub src_port: u16,
    /// TCP/UDP destination port.
    pub dst_port: u16,
    /// ICMP type and code.
    pub icmp_type: u8,
    pub icmp_code: u8,
    /// ICMP echo identifier.
    pub icmp_id: u16,
    /// A non-first fragment: no transport header (and, for IPv6, no protocol the datapath
    /// trusts).
    pub later_fragment: bool,
}

/// Source port of a probe whose caller gives none: an ephemeral one, as a client's.
pub const DEFAULT_SRC_PORT: u16 = 40_000;

impl Probe {
    /// A first (or only) fragment of `protocol` (ICMP is taken to mean ICMPv6 for IPv6: a
    /// rule's `icmp` does). TCP/UDP go to `port`; ICMP is an echo request unless its type is
    /// changed.
    pub fn new(src: IpAddr, dst: IpAddr, protocol: u8, port: u16) -> Self {
        let protocol = match (protocol, dst) {
            (PROTO_ICMP | PROTO_ICMPV6, IpAddr::V4(_)) => PROTO_ICMP,
            (PROTO_ICMP | PROTO_ICMPV6, IpAddr::V6(_)) => PROTO_ICMPV6,
            (p, _) => p,
        };
        let icmp_type = if protocol == PROTO_ICMPV6 { 128 } else { 8 };
        Self {
            src,
            dst,
            protocol,
            src_port: DEFAULT_SRC_PORT,
            dst_port: port,
            icmp_type,
            icmp_code: 0,
            icmp_id: DEFAULT_SRC_PORT,
            later_fragment: false,
        }
    }

    fn is_icmp(&self) -> bool {
        self.protocol == PROTO_ICMP || self.protocol == PROTO_ICMPV6
    }

    /// What the datapath reads of this packet.
    pub fn seen(&self) -> Seen {
        if self.later_fragment {
            return Seen {
                src: self.src,
                dst: self.dst,
                protocol: if self.src.is_ipv6() {
                    PROTO_UNKNOWN
                } else {
                    self.protocol
                },
                port: None,
                answer: None,
            };
        }
        let ports = self.protocol == PROTO_TCP || self.protocol == PROTO_UDP;
        // The datapath matches an ICMP packet's type where it matches a port.
        let icmp = match self.dst {
            IpAddr::V4(_) => self.protocol == PROTO_ICMP,
            IpAddr::V6(_) => self.protocol == PROTO_ICMPV6,
        };
        let echo_reply = (self.protocol == PROTO_ICMP && self.icmp_type == ICMP_ECHO_REPLY)
            || (self.protocol == PROTO_ICMPV6 && self.icmp_type == ICMPV6_ECHO_REPLY);
        let answer = if ports {
            Some((self.src_port, self.dst_port))
        } else if echo_reply {
            Some((self.icmp_id, 0))
        } else {
            None
        };
        Seen {
            src: self.src,
            dst: self.dst,
            protocol: self.protocol,
            port: if ports {
                Some(self.dst_port)
            } else if icmp {
                Some(u16::from(self.icmp_type))
            } else {
                None
            },
            answer: answer.map(|(peer_port, remote_port)| ReplyKey {
                peer: self.src,
                remote: self.dst,
                protocol: self.protocol,
                peer_port,
                remote_port,
            }),
        }
    }

    /// The packet as the datapath's `variant` receives it under `BPF_PROG_TEST_RUN`: behind an
    /// Ethernet header when `l3_offset` is 14, else raw IP, padded where the kernel would refuse
    /// a short input (it reads every test input as an Ethernet frame first).
    pub fn frame(&self, l3_offset: u32) -> Vec<u8> {
        let payload = self.transport();
        let mut frame = Vec::with_capacity(14 + 48 + payload.len());
        if l3_offset == 14 {
            frame.extend_from_slice(&[0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2]);
            let ethertype: u16 = if self.src.is_ipv4() { 0x0800 } else { 0x86dd };
            frame.extend_from_slice(&ethertype.to_be_bytes());
        }
        match (self.src, self.dst) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => self.ipv4(&mut frame, src, dst, &payload),
            (src, dst) => self.ipv6(&mut frame, v6(src), v6(dst), &payload),
        }
        let min = match frame.get(12..14) {
            Some([0x08, 0x00]) => 14 + 20,
            Some([0x86, 0xdd]) => 14 + 40,
            _ => 14,
        };
        if frame.len() < min {
            frame.resize(min, 0);
        }
        frame
    }

    /// The transport header (or, for a later fragment, 8 bytes of payload).
    fn transport(&self) -> Vec<u8> {
        if self.later_fragment {
            return vec![0xab; 8];
        }
        let mut t = Vec::with_capacity(20);
        match self.protocol {
            PROTO_TCP => {
                t.extend_from_slice(&self.src_port.to_be_bytes());
                t.extend_from_slice(&self.dst_port.to_be_bytes());
                t.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0]);
                // Data offset 5 words; ACK.
                t.extend_from_slice(&[0x50, 0x10, 0xff, 0xff, 0, 0, 0, 0]);
            }
            PROTO_UDP => {
                t.extend_from_slice(&self.src_port.to_be_bytes());
                t.extend_from_slice(&self.dst_port.to_be_bytes());
                t.extend_from_slice(&[0, 8, 0, 0]);
            }
            _ if self.is_icmp() => {
                t.extend_from_slice(&[self.icmp_type, self.icmp_code, 0, 0]);
                t.extend_from_slice(&self.icmp_id.to_be_bytes());
                t.extend_from_slice(&[0, 1]);
            }
            _ => t.extend_from_slice(&[0; 8]),
        }
        t
    }

    fn ipv4(&self, frame: &mut Vec<u8>, src: Ipv4Addr, dst: Ipv4Addr, payload: &[u8]) {
        let total = (20 + payload.len()) as u16;
        // A later fragment: offset 185 (1480 bytes), more fragments follow.
        let fragment: u16 = if self.later_fragment { 0x2000 | 185 } else { 0 };
        frame.extend_from_slice(&[0x45, 0]);
        frame.extend_from_slice(&total.to_be_bytes());
        frame.extend_from_slice(&[0x12, 0x34]);
        frame.extend_from_slice(&fragment.to_be_bytes());
        frame.extend_from_slice(&[64, self.protocol, 0, 0]);
        frame.extend_from_slice(&src.octets());
        frame.extend_from_slice(&dst.octets());
        frame.extend_from_slice(payload);
    }

    fn ipv6(&self, frame: &mut Vec<u8>, src: Ipv6Addr, dst: Ipv6Addr, payload: &[u8]) {
        const FRAGMENT: u8 = 44;
        let extension = if self.later_fragment { 8 } else { 0 };
        let len = (extension + payload.len()) as u16;
        let next = if self.later_fragment {
            FRAGMENT
        } else {
            self.protocol
        };
        frame.extend_from_slice(&[0x60, 0, 0, 0]);
        frame.extend_from_slice(&len.to_be_bytes());
        frame.extend_from_slice(&[next, 64]);
        frame.extend_from_slice(&src.octets());
        frame.extend_from_slice(&dst.octets());
        if self.later_fragment {
            // Offset 185 (in 8-byte units), more fragments follow.
            let offset: u16 = (185 << 3) | 1;
            frame.extend_from_slice(&[self.protocol, 0]);
            frame.extend_from_slice(&offset.to_be_bytes());
            frame.extend_from_slice(&[0, 0, 0x12, 0x34]);
        }
        frame.extend_from_slice(payload);
    }
}

fn v6(addr: IpAddr) -> Ipv6Addr {
    match addr {
        IpAddr::V6(a) => a,
        IpAddr::V4(a) => a.to_ipv6_mapped(),
    }
}

/// The flow a peer's packet would answer, keyed as the flow tables key it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ReplyKey {
    pub peer: IpAddr,
    pub remote: IpAddr,
    pub protocol: u8,
    pub peer_port: u16,
    pub remote_port: u16,
}

/// What the datapath reads of a peer's packet: its addresses, the protocol and destination
/// port it matches allow entries with, and the flow it could answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    pub src: IpAddr,
    pub dst: IpAddr,
    /// [`PROTO_UNKNOWN`] for a later IPv6 fragment.
    pub protocol: u8,
    /// The destination port (TCP/UDP) or the ICMP type; `None` when unknown (another
    /// protocol, or a later fragment).
    pub port: Option<u16>,
    /// The flow this packet answers if the policy denies it (a first fragment of TCP, UDP or
    /// an ICMP echo reply); `None`: no reply check can pass it.
    pub answer: Option<ReplyKey>,
}

/// The reply check of a packet the policy denies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum Reply {
    /// Not asked: the policy decided (or the peer is unrestricted, or unknown).
    NotAsked,
    /// Replies are off in the datapath's settings.
    Off,
    /// The packet cannot answer a flow (a later fragment, an ICMP type that is no reply).
    NotAReply,
    /// No flow with this packet's key.
    NoFlow { key: ReplyKey },
    /// A flow, recorded for another holder of the address.
    OtherOwner { key: ReplyKey },
    /// A flow, idle longer than its timeout.
    Expired { key: ReplyKey, idle_ns: u64 },
    /// A live flow: the packet passes as a reply.
    Live { key: ReplyKey, idle_ns: u64 },
}

/// The flows the reply check looks up.
pub trait Flows {
    fn flow(&self, key: &ReplyKey) -> Option<FlowValue>;
}

/// No flow at all (the differential corpus, the policy tests).
pub struct NoFlows;

impl Flows for NoFlows {
    fn flow(&self, _: &ReplyKey) -> Option<FlowValue> {
        None
    }
}

impl<F: Fn(&ReplyKey) -> Option<FlowValue>> Flows for F {
    fn flow(&self, key: &ReplyKey) -> Option<FlowValue> {
        self(key)
    }
}

/// Where the evaluator reads: compiled entries, the datapath's settings and the clock the
/// flow timestamps are in.
pub struct View<'a, F: Flows> {
    pub maps: &'a ActualMaps,
    pub config: Config,
    pub flows: F,
    /// `CLOCK_MONOTONIC` now, in nanoseconds.
    pub now_ns: u64,
    /// `CLOCK_BOOTTIME` now, in nanoseconds: the clock of peer windows. `None`: windows are
    /// not looked at (what the rules allow, whenever the peer may send).
    pub boot_ns: Option<u64>,
}

/// The verdict on one packet and its reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Explanation {
    /// The counter the datapath counts the packet in (its verdict and reason).
    #[serde(serialize_with = "counter_name")]
    pub verdict: Counter,
    /// The peer entry of the source address.
    pub peer: Option<PeerView>,
    /// The longest trie prefix of the peer's policy that contains the destination.
    #[serde(serialize_with = "display_opt")]
    pub prefix: Option<IpNet>,
    /// That prefix's allow entries, in the order the datapath scans them.
    #[serde(serialize_with = "allow_list")]
    pub allows: Vec<Allow>,
    /// The first allow entry that matched, if any.
    #[serde(serialize_with = "allow_opt")]
    pub matched: Option<Allow>,
    pub reply: Reply,
}

/// A peer entry as `explain` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PeerView {
    pub addr: IpAddr,
    /// 0: unrestricted.
    pub policy: u32,
    pub slot: u32,
    pub owner: u64,
}

fn display_opt<S: serde::Serializer, T: fmt::Display>(
    v: &Option<T>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => s.serialize_some(&v.to_string()),
        None => s.serialize_none(),
    }
}

fn counter_name<S: serde::Serializer>(c: &Counter, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(c.name())
}

fn allow_list<S: serde::Serializer>(a: &[Allow], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(a.iter().map(|a| AllowText(*a).to_string()))
}

fn allow_opt<S: serde::Serializer>(a: &Option<Allow>, s: S) -> Result<S::Ok, S::Error> {
    match a {
        Some(a) => s.serialize_some(&AllowText(*a).to_string()),
        None => s.serialize_none(),
    }
}

impl Explanation {
    pub fn passed(&self) -> bool {
        self.verdict.is_pass()
    }
}

/// An allow entry as `explain` prints it: `tcp 443`, `udp 8000-8100`, `icmp`, `any`.
pub struct AllowText(pub Allow);

impl fmt::Display for AllowText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let a = self.0;
        match a.protocol {
            PROTO_ANY => f.write_str("any")?,
            PROTO_TCP => f.write_str("tcp")?,
            PROTO_UDP => f.write_str("udp")?,
            PROTO_ICMP => f.write_str("icmp")?,
            PROTO_ICMPV6 => f.write_str("icmpv6")?,
            p => write!(f, "protocol {p}")?,
        }
        if !a.all_ports() {
            let what = if a.protocol == PROTO_ICMP || a.protocol == PROTO_ICMPV6 {
                " type"
            } else {
                ""
            };
            if a.port_lo == a.port_hi {
                write!(f, "{what} {}", a.port_lo)?;
            } else {
                write!(f, "{what} {}-{}", a.port_lo, a.port_hi)?;
            }
        }
        Ok(())
    }
}

/// The datapath's verdict on `seen`, from compiled entries: the source's peer entry; for a
/// restricted peer the longest prefix of its policy containing the destination and the first
/// of that prefix's allow entries that matches the protocol and port; for a denied packet the
/// reply check. Header faults (malformed, header chain) are the packet's, not the entries':
/// the caller decides those before (see the differential test's model).
pub fn evaluate<F: Flows>(view: &View<'_, F>, seen: &Seen) -> Explanation {
    let mut e = Explanation {
        verdict: Counter::DropUnknownSource,
        peer: None,
        prefix: None,
        allows: Vec::new(),
        matched: None,
        reply: Reply::NotAsked,
    };
    let Some(entry) = view.maps.peers.get(&seen.src) else {
        return e;
    };
    e.peer = Some(peer_view(seen.src, entry));
    // Outside its window a peer sends nothing, before any other check (as the datapath).
    if let Some(boot_ns) = view.boot_ns {
        if !entry.in_window(boot_ns) {
            e.verdict = Counter::DropExpired;
            return e;
        }
    }
    if entry.policy == UNRESTRICTED {
        e.verdict = Counter::PassUnrestricted;
        return e;
    }
    if let Some((prefix, allows)) = view
        .maps
        .policies
        .get(&entry.policy)
        .and_then(|policy| longest_match(policy, seen.dst))
    {
        e.prefix = Some(prefix);
        e.allows = allows.to_vec();
        e.matched = allows
            .iter()
            .find(|a| a.matches(seen.protocol, seen.port))
            .copied();
    }
    if e.matched.is_some() {
        e.verdict = Counter::PassPolicy;
        return e;
    }
    e.verdict = Counter::DropPolicy;
    e.reply = reply(view, seen, entry);
    if matches!(e.reply, Reply::Live { .. }) {
        e.verdict = Counter::PassReply;
    } else if entry.audit() {
        // An audited peer's denial passes as a would-drop.
        e.verdict = Counter::PassAudit;
    }
    e
}

fn peer_view(addr: IpAddr, entry: &PeerEntry) -> PeerView {
    PeerView {
        addr,
        policy: entry.policy,
        slot: entry.slot,
        owner: entry.owner,
    }
}

/// The LPM trie's answer: the longest prefix containing `dst`.
pub fn longest_match(policy: &CompiledPolicy, dst: IpAddr) -> Option<(IpNet, &[Allow])> {
    policy
        .entries()
        .filter(|(prefix, _)| prefix.contains(&dst))
        .max_by_key(|(prefix, _)| prefix.prefix_len())
}

fn reply<F: Flows>(view: &View<'_, F>, seen: &Seen, entry: &PeerEntry) -> Reply {
    if !view.config.replies() {
        return Reply::Off;
    }
    let Some(key) = seen.answer else {
        return Reply::NotAReply;
    };
    let Some(flow) = view.flows.flow(&key) else {
        return Reply::NoFlow { key };
    };
    if flow.owner != entry.owner {
        return Reply::OtherOwner { key };
    }
    let idle_ns = view.now_ns.saturating_sub(flow.last_seen_ns);
    if idle_ns > view.config.timeout_ns(key.protocol, flow.state) {
        Reply::Expired { key, idle_ns }
    } else {
        Reply::Live { key, idle_ns }
    }
}

/// Compiled entries with each peer's policy as a content, for comparing two sets of entries
/// whose policy ids differ.
pub fn policy_of<'a>(maps: &'a ActualMaps, entry: &PeerEntry) -> Option<&'a CompiledPolicy> {
    maps.policies.get(&entry.policy).map(|p| &**p)
}
