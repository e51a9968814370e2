//! IPv4: source lookup, then (for a restricted peer) protocol, port and the policy trie, and
//! the reply check when the policy denies. Also the egress side: flows toward restricted peers.

use aya_ebpf::{btf_maps::lpm_trie::Key, programs::TcContext};
use wgfence_common::{
    Counter, DropEvent, FlowKeyV4, PeerEntry, PeerKeyV4, PolicyKeyV4, PolicyValue, EVENT_PORTS,
    PROTO_ICMP, PROTO_TCP, PROTO_UDP, UNRESTRICTED,
};

use crate::{
    audit, config, decide,
    flow::{self, Answer, ICMP_ERROR_LEN, ICMP_V4},
    has_ports, holds_flows, in_window, load, ports, unrestricted, Drop, Pass, Ports, FLOWS_V4,
    HEAD_LEN, PEERS_V4, POLICY_V4,
};

const MIN_HEADER_LEN: usize = HEAD_LEN;
/// Fragment offset bits of the flags/fragment-offset field.
const FRAGMENT_OFFSET_MASK: u16 = 0x1fff;

#[inline(always)]
fn header_len(ip: &[u8; HEAD_LEN]) -> usize {
    usize::from(ip[0] & 0x0f) * 4
}

#[inline(always)]
fn first_fragment(ip: &[u8; HEAD_LEN]) -> bool {
    u16::from_be_bytes([ip[6], ip[7]]) & FRAGMENT_OFFSET_MASK == 0
}

#[inline(always)]
fn addr(ip: &[u8; HEAD_LEN], at: usize) -> [u8; 4] {
    [ip[at], ip[at + 1], ip[at + 2], ip[at + 3]]
}

#[inline(always)]
pub(crate) fn classify(ctx: &TcContext, l3: usize, ip: &[u8; HEAD_LEN]) -> Result<Pass, Drop> {
    let src = PeerKeyV4 { addr: addr(ip, 12) };
    // SAFETY: the value is copied out at once; no reference outlives the lookup.
    let Some(peer) = (unsafe { PEERS_V4.get(&src) }).copied() else {
        return Err(Drop::unknown(Counter::DropUnknownSource));
    };
    in_window(&peer)?;
    if peer.policy == UNRESTRICTED {
        return Ok(unrestricted(peer.slot));
    }

    // Options are skipped via IHL; an IHL below the minimum is a malformed header.
    let header_len = header_len(ip);
    if header_len < MIN_HEADER_LEN {
        return Err(Drop::peer(Counter::DropMalformed, peer.slot));
    }
    let protocol = ip[9];
    let l4 = l3 + header_len;
    // A non-first fragment carries no transport header: its port is unknown.
    let first = first_fragment(ip);
    let ports = if first && has_ports(protocol) {
        ports(ctx, l4, peer.slot)?
    } else {
        Ports::NONE
    };

    let audited = peer.audit();
    // ICMP is matched by its type where TCP/UDP are by their destination port (first fragment
    // only; an unread type matches only entries for every type).
    let port = if ports.known {
        Some(ports.dst)
    } else if first && protocol == PROTO_ICMP {
        crate::icmp_type(ctx, l4)
    } else {
        None
    };
    let verdict = match decide(
        policy_entry(peer.policy, addr(ip, 16)),
        &peer,
        protocol,
        port,
    ) {
        Err(Drop {
            why: Counter::DropPolicy,
            ..
        }) if first => reply(ctx, l4, ip, protocol, ports, &peer),
        verdict => verdict,
    };
    audit(verdict, audited)
}

/// The entry of `policy`'s trie for destination `addr`, if the policy has one that covers it.
#[inline(always)]
fn policy_entry(policy: u32, addr: [u8; 4]) -> Option<&'static PolicyValue> {
    let value = POLICY_V4.get_value_ptr_mut(policy, &Key::new(32, PolicyKeyV4 { addr }))?;
    // SAFETY: a trie's values live until an RCU grace period after their removal, which this
    // program's run is inside of; the value is only read.
    Some(unsafe { &*value })
}

/// A denied packet of a restricted peer: does it answer a flow the network started?
#[inline(always)]
fn reply(
    ctx: &TcContext,
    l4: usize,
    ip: &[u8; HEAD_LEN],
    protocol: u8,
    ports: Ports,
    peer: &PeerEntry,
) -> Result<Pass, Drop> {
    let denied = Err(Drop::peer(Counter::DropPolicy, peer.slot));
    // A copy: the agent may rewrite the entry while this packet runs.
    let Some(config) = config().copied() else {
        return denied;
    };
    // A peer that holds no flow answers none: no flow lookup.
    if !config.replies() || !holds_flows(peer.slot) {
        return denied;
    }
    let (peer_port, remote_port, close) = match flow::answer(ctx, l4, protocol, ports, &ICMP_V4) {
        Some(Answer::Flow {
            peer_port,
            remote_port,
            close,
        }) => (peer_port, remote_port, close),
        Some(Answer::Error) => return related(ctx, l4 + ICMP_ERROR_LEN, ip, &config, peer),
        None => return denied,
    };
    on_flow(ip, peer_port, remote_port, protocol, close, &config, peer)
}

/// The peer's packet (`ip`) as a reply on the flow (ports, protocol) it names.
#[inline(always)]
fn on_flow(
    ip: &[u8; HEAD_LEN],
    peer_port: u16,
    remote_port: u16,
    protocol: u8,
    close: flow::Seen,
    config: &wgfence_common::Config,
    peer: &PeerEntry,
) -> Result<Pass, Drop> {
    let key = FlowKeyV4 {
        peer: addr(ip, 12),
        remote: addr(ip, 16),
        peer_port,
        remote_port,
        protocol,
        _pad: [0; 3],
    };
    flow::reply(&FLOWS_V4, &key, protocol, close, config, peer)
}

/// An ICMP error from the peer about a packet of a flow the network started (conntrack's
/// RELATED): the quoted packet went from the error's destination to the peer.
#[inline(always)]
fn related(
    ctx: &TcContext,
    quoted: usize,
    ip: &[u8; HEAD_LEN],
    config: &wgfence_common::Config,
    peer: &PeerEntry,
) -> Result<Pass, Drop> {
    let denied = Err(Drop::peer(Counter::DropPolicy, peer.slot));
    let Some(inner) = load::<[u8; HEAD_LEN]>(ctx, quoted) else {
        return denied;
    };
    // The quoted packet must be the error's own direction reversed: from the remote the error
    // goes to, to the peer that sends it.
    if inner[0] >> 4 != 4 || addr(&inner, 12) != addr(ip, 16) || addr(&inner, 16) != addr(ip, 12) {
        return denied;
    }
    let header_len = header_len(&inner);
    if header_len < MIN_HEADER_LEN || !first_fragment(&inner) {
        return denied;
    }
    let protocol = inner[9];
    let Some((peer_port, remote_port)) =
        flow::toward_peer(ctx, quoted + header_len, protocol, &ICMP_V4)
    else {
        return denied;
    };
    on_flow(
        ip,
        peer_port,
        remote_port,
        protocol,
        flow::Seen::Related,
        config,
        peer,
    )
}

/// Egress: records or refreshes the flow of a packet toward a restricted peer.
#[inline(always)]
pub(crate) fn record(
    ctx: &TcContext,
    l3: usize,
    ip: &[u8; HEAD_LEN],
    config: &wgfence_common::Config,
) {
    let dst = PeerKeyV4 { addr: addr(ip, 16) };
    // SAFETY: the value is copied out at once; no reference outlives the lookup.
    let Some(peer) = (unsafe { PEERS_V4.get(&dst) }).copied() else {
        return;
    };
    let header_len = header_len(ip);
    if peer.policy == UNRESTRICTED || header_len < MIN_HEADER_LEN || !first_fragment(ip) {
        return;
    }
    let protocol = ip[9];
    let l4 = l3 + header_len;
    let Some((peer_port, remote_port)) = flow::toward_peer(ctx, l4, protocol, &ICMP_V4) else {
        return;
    };
    let Some(packet) = flow::effect(ctx, l4, protocol) else {
        return;
    };
    let key = FlowKeyV4 {
        peer: dst.addr,
        remote: addr(ip, 12),
        peer_port,
        remote_port,
        protocol,
        _pad: [0; 3],
    };
    // The peer's reply: to the remote, its port (none for an echo reply).
    let reply_allowed = || {
        let port = (protocol != PROTO_ICMP).then_some(remote_port);
        decide(policy_entry(peer.policy, key.remote), &peer, protocol, port).is_ok()
    };
    flow::on_egress(&FLOWS_V4, &key, &packet, &peer, config, reply_allowed);
}

/// Fills a drop event's addresses, protocol and (when the header is at hand) ports.
#[inline(always)]
pub(crate) fn describe(ctx: &TcContext, l3: usize, ip: &[u8; HEAD_LEN], event: &mut DropEvent) {
    event.family = 4;
    event.protocol = ip[9];
    event.src[..4].copy_from_slice(&ip[12..16]);
    event.dst[..4].copy_from_slice(&ip[16..20]);
    let header_len = header_len(ip);
    if header_len >= MIN_HEADER_LEN && first_fragment(ip) && has_ports(ip[9]) {
        if let Some(p) = load::<[u8; 4]>(ctx, l3 + header_len) {
            event.src_port = u16::from_be_bytes([p[0], p[1]]);
            event.dst_port = u16::from_be_bytes([p[2], p[3]]);
            event.flags |= EVENT_PORTS;
        }
    }
}
