//! IPv6: source lookup, then (for a restricted peer) a bounded walk of the extension headers to
//! the upper-layer protocol and port, the policy trie, and the reply check when the policy
//! denies. Also the egress side: flows toward restricted peers.

use aya_ebpf::{btf_maps::lpm_trie::Key, programs::TcContext};
use wgfence_common::{
    Counter, DropEvent, FlowKeyV6, PeerEntry, PeerKeyV6, PolicyKeyV6, PolicyValue, EVENT_PORTS,
    MAX_IPV6_EXT_HEADERS, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP, PROTO_UNKNOWN, UNRESTRICTED,
};

use crate::{
    audit, config, decide,
    flow::{self, Answer, ICMP_ERROR_LEN, ICMP_V6},
    has_ports, holds_flows, in_window, load, ports, unrestricted, Drop, Pass, Ports, FLOWS_V6,
    HEAD_LEN, PEERS_V6, POLICY_V6,
};

const HEADER_LEN: usize = 40;
const HOP_BY_HOP: u8 = 0;
const ROUTING: u8 = 43;
const FRAGMENT: u8 = 44;
const AUTHENTICATION: u8 = 51;
const DESTINATION_OPTIONS: u8 = 60;
/// The second half of the fixed header: the rest of the source and the destination.
const TAIL_LEN: usize = HEADER_LEN - HEAD_LEN;

#[inline(always)]
const fn is_extension_header(next: u8) -> bool {
    matches!(
        next,
        HOP_BY_HOP | ROUTING | FRAGMENT | AUTHENTICATION | DESTINATION_OPTIONS
    )
}

#[inline(always)]
pub(crate) fn classify(ctx: &TcContext, l3: usize, head: &[u8; HEAD_LEN]) -> Result<Pass, Drop> {
    // The second half of the header: the rest of the source and the destination.
    let tail: [u8; TAIL_LEN] =
        load(ctx, l3 + HEAD_LEN).ok_or(Drop::unknown(Counter::DropMalformed))?;
    let mut src = PeerKeyV6::default();
    src.addr[..12].copy_from_slice(&head[8..20]);
    src.addr[12..].copy_from_slice(&tail[..4]);
    // SAFETY: the value is copied out at once; no reference outlives the lookup.
    let Some(peer) = (unsafe { PEERS_V6.get(&src) }).copied() else {
        return Err(Drop::unknown(Counter::DropUnknownSource));
    };
    in_window(&peer)?;
    if peer.policy == UNRESTRICTED {
        return Ok(unrestricted(peer.slot));
    }
    let slot = peer.slot;
    let malformed = || Drop::peer(Counter::DropMalformed, slot);

    let mut next = head[6];
    let mut offset = l3 + HEADER_LEN;
    let mut first_fragment = true;
    for _ in 0..MAX_IPV6_EXT_HEADERS {
        if !is_extension_header(next) {
            break;
        }
        match next {
            FRAGMENT => {
                let fragment: [u8; 4] = load(ctx, offset).ok_or_else(malformed)?;
                next = fragment[0];
                offset += 8;
                if u16::from_be_bytes([fragment[2], fragment[3]]) >> 3 != 0 {
                    // A non-first fragment: what follows is payload, not headers.
                    first_fragment = false;
                    break;
                }
            }
            AUTHENTICATION => {
                let header: [u8; 2] = load(ctx, offset).ok_or_else(malformed)?;
                next = header[0];
                offset += (usize::from(header[1]) + 2) * 4;
            }
            _ => {
                let header: [u8; 2] = load(ctx, offset).ok_or_else(malformed)?;
                next = header[0];
                offset += (usize::from(header[1]) + 1) * 8;
            }
        }
    }
    if first_fragment && is_extension_header(next) {
        // More extension headers than the walk allows: fail closed.
        return Err(Drop::peer(Counter::DropHeaderChain, slot));
    }
    let ports = if first_fragment && has_ports(next) {
        ports(ctx, offset, slot)?
    } else {
        Ports::NONE
    };

    let mut dst = [0; 16];
    dst.copy_from_slice(&tail[4..20]);
    // A later fragment's next header is the sender's word (it need not be the first
    // fragment's): such a fragment matches only entries for every protocol.
    let protocol = if first_fragment { next } else { PROTO_UNKNOWN };
    let audited = peer.audit();
    // ICMPv6 is matched by its type where TCP/UDP are by their destination port (first
    // fragment only; an unread type matches only entries for every type).
    let port = if ports.known {
        Some(ports.dst)
    } else if first_fragment && next == PROTO_ICMPV6 {
        crate::icmp_type(ctx, offset)
    } else {
        None
    };
    let verdict = match decide(policy_entry(peer.policy, dst), &peer, protocol, port) {
        Err(Drop {
            why: Counter::DropPolicy,
            ..
        }) if first_fragment => reply(ctx, offset, &src, &dst, next, ports, &peer),
        verdict => verdict,
    };
    audit(verdict, audited)
}

/// The entry of `policy`'s trie for destination `addr`, if the policy has one that covers it.
#[inline(always)]
fn policy_entry(policy: u32, addr: [u8; 16]) -> Option<&'static PolicyValue> {
    let value = POLICY_V6.get_value_ptr_mut(policy, &Key::new(128, PolicyKeyV6 { addr }))?;
    // SAFETY: a trie's values live until an RCU grace period after their removal, which this
    // program's run is inside of; the value is only read.
    Some(unsafe { &*value })
}

/// A denied packet of a restricted peer: does it answer a flow the network started?
#[inline(always)]
fn reply(
    ctx: &TcContext,
    l4: usize,
    src: &PeerKeyV6,
    dst: &[u8; 16],
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
    let (peer_port, remote_port, close) = match flow::answer(ctx, l4, protocol, ports, &ICMP_V6) {
        Some(Answer::Flow {
            peer_port,
            remote_port,
            close,
        }) => (peer_port, remote_port, close),
        Some(Answer::Error) => {
            return related(ctx, l4 + ICMP_ERROR_LEN, src, dst, &config, peer);
        }
        None => return denied,
    };
    on_flow(
        src,
        dst,
        peer_port,
        remote_port,
        protocol,
        close,
        &config,
        peer,
    )
}

/// The peer's packet (from `src` to `dst`) as a reply on the flow (ports, protocol) it names.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn on_flow(
    src: &PeerKeyV6,
    dst: &[u8; 16],
    peer_port: u16,
    remote_port: u16,
    protocol: u8,
    close: flow::Seen,
    config: &wgfence_common::Config,
    peer: &PeerEntry,
) -> Result<Pass, Drop> {
    let key = FlowKeyV6 {
        peer: src.addr,
        remote: *dst,
        peer_port,
        remote_port,
        protocol,
        _pad: [0; 3],
    };
    flow::reply(&FLOWS_V6, &key, protocol, close, config, peer)
}

/// An ICMPv6 error from the peer about a packet of a flow the network started (conntrack's
/// RELATED): the quoted packet went from the error's destination to the peer. Only a quoted
/// packet whose upper-layer header follows its fixed header is matched, as on egress.
#[inline(always)]
fn related(
    ctx: &TcContext,
    quoted: usize,
    src: &PeerKeyV6,
    dst: &[u8; 16],
    config: &wgfence_common::Config,
    peer: &PeerEntry,
) -> Result<Pass, Drop> {
    let denied = Err(Drop::peer(Counter::DropPolicy, peer.slot));
    let Some(inner) = load::<[u8; HEADER_LEN]>(ctx, quoted) else {
        return denied;
    };
    if inner[0] >> 4 != 6 || inner[8..24] != dst[..] || inner[24..40] != src.addr[..] {
        return denied;
    }
    let protocol = inner[6];
    let Some((peer_port, remote_port)) =
        flow::toward_peer(ctx, quoted + HEADER_LEN, protocol, &ICMP_V6)
    else {
        return denied;
    };
    on_flow(
        src,
        dst,
        peer_port,
        remote_port,
        protocol,
        flow::Seen::Related,
        config,
        peer,
    )
}

/// Egress: records or refreshes the flow of a packet toward a restricted peer. Only packets
/// whose upper-layer header follows the fixed header are recorded (the egress side does not
/// walk extension headers; a peer's reply to such a flow is judged by its policy alone).
#[inline(always)]
pub(crate) fn record(
    ctx: &TcContext,
    l3: usize,
    head: &[u8; HEAD_LEN],
    config: &wgfence_common::Config,
) {
    let Some(tail) = load::<[u8; TAIL_LEN]>(ctx, l3 + HEAD_LEN) else {
        return;
    };
    let mut dst = PeerKeyV6::default();
    dst.addr.copy_from_slice(&tail[4..20]);
    // SAFETY: the value is copied out at once; no reference outlives the lookup.
    let Some(peer) = (unsafe { PEERS_V6.get(&dst) }).copied() else {
        return;
    };
    if peer.policy == UNRESTRICTED {
        return;
    }
    let protocol = head[6];
    let l4 = l3 + HEADER_LEN;
    let Some((peer_port, remote_port)) = flow::toward_peer(ctx, l4, protocol, &ICMP_V6) else {
        return;
    };
    let Some(packet) = flow::effect(ctx, l4, protocol) else {
        return;
    };
    let mut key = FlowKeyV6 {
        peer: dst.addr,
        remote: [0; 16],
        peer_port,
        remote_port,
        protocol,
        _pad: [0; 3],
    };
    key.remote[..12].copy_from_slice(&head[8..20]);
    key.remote[12..].copy_from_slice(&tail[..4]);
    // The peer's reply: to the remote, its port (none for an echo reply).
    let reply_allowed = || {
        let port = (protocol != PROTO_ICMPV6).then_some(remote_port);
        decide(policy_entry(peer.policy, key.remote), &peer, protocol, port).is_ok()
    };
    flow::on_egress(&FLOWS_V6, &key, &packet, &peer, config, reply_allowed);
}

/// Fills a drop event's addresses, protocol and (when the upper-layer header follows the fixed
/// header) ports.
#[inline(always)]
pub(crate) fn describe(ctx: &TcContext, l3: usize, head: &[u8; HEAD_LEN], event: &mut DropEvent) {
    event.family = 6;
    event.protocol = head[6];
    let Some(tail) = load::<[u8; TAIL_LEN]>(ctx, l3 + HEAD_LEN) else {
        return;
    };
    event.src[..12].copy_from_slice(&head[8..20]);
    event.src[12..].copy_from_slice(&tail[..4]);
    event.dst.copy_from_slice(&tail[4..20]);
    if has_ports(head[6]) {
        if let Some(p) = load::<[u8; 4]>(ctx, l3 + HEADER_LEN) {
            event.src_port = u16::from_be_bytes([p[0], p[1]]);
            event.dst_port = u16::from_be_bytes([p[2], p[3]]);
            event.flags |= EVENT_PORTS;
        }
    }
}
