//! IPv4: source lookup, then (for a restricted peer) protocol, port and the policy trie, and
//! the reply check when the policy denies. Also the egress side: flows toward restricted peers.

use aya_ebpf::{btf_maps::lpm_trie::Key, programs::TcContext};
use wgfence_common::{
    Counter, DropEvent, FlowKeyV4, PeerKeyV4, PolicyKeyV4, EVENT_PORTS, POLICY_ID_BITS, PROTO_ICMP,
    PROTO_TCP, PROTO_UDP, UNRESTRICTED,
};

use crate::{
    config, decide,
    flow::{self, tcp_closes, tcp_opens, ToPeer, TCP_FLAGS_OFFSET},
    has_ports, ports, unrestricted, Drop, Pass, FLOWS_V4, HEAD_LEN, PEERS_V4, POLICY_V4,
};

const MIN_HEADER_LEN: usize = HEAD_LEN;
/// Fragment offset bits of the flags/fragment-offset field.
const FRAGMENT_OFFSET_MASK: u16 = 0x1fff;
const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_DEST_UNREACHABLE: u8 = 3;
const ICMP_ECHO_REQUEST: u8 = 8;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETER_PROBLEM: u8 = 12;
/// Bytes of an ICMP error before the packet it quotes.
const ICMP_ERROR_LEN: usize = 8;

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
        return Err(Drop::new(Counter::DropUnknownSource, None));
    };
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
        Some(ports(ctx, l4, peer.slot)?)
    } else {
        None
    };

    let key = Key::new(
        POLICY_ID_BITS + 32,
        PolicyKeyV4 {
            policy: peer.policy,
            addr: addr(ip, 16),
        },
    );
    match decide(POLICY_V4.get(&key), peer.slot, protocol, ports.map(|p| p.1)) {
        Err(Drop {
            why: Counter::DropPolicy,
            ..
        }) if first => reply(ctx, l4, ip, protocol, ports, peer.slot),
        verdict => verdict,
    }
}

/// A denied packet of a restricted peer: does it answer a flow the network started?
#[inline(always)]
fn reply(
    ctx: &TcContext,
    l4: usize,
    ip: &[u8; HEAD_LEN],
    protocol: u8,
    ports: Option<(u16, u16)>,
    slot: u32,
) -> Result<Pass, Drop> {
    let denied = Err(Drop::peer(Counter::DropPolicy, slot));
    // A copy: the agent may rewrite the entry while this packet runs.
    let Some(config) = config().copied() else {
        return denied;
    };
    if !config.replies() {
        return denied;
    }
    let (peer_port, remote_port, close) = match (protocol, ports) {
        (PROTO_TCP, Some((src, dst))) => {
            let Ok(flags) = ctx.load::<u8>(l4 + TCP_FLAGS_OFFSET) else {
                return denied;
            };
            (src, dst, tcp_closes(flags))
        }
        (PROTO_UDP, Some((src, dst))) => (src, dst, false),
        (PROTO_ICMP, _) => match ctx.load::<[u8; 6]>(l4) {
            Ok(icmp) if icmp[0] == ICMP_ECHO_REPLY => {
                (u16::from_be_bytes([icmp[4], icmp[5]]), 0, false)
            }
            Ok(icmp)
                if matches!(
                    icmp[0],
                    ICMP_DEST_UNREACHABLE | ICMP_TIME_EXCEEDED | ICMP_PARAMETER_PROBLEM
                ) =>
            {
                return related(ctx, l4 + ICMP_ERROR_LEN, ip, &config, slot);
            }
            _ => return denied,
        },
        _ => return denied,
    };
    let key = FlowKeyV4 {
        peer: addr(ip, 12),
        remote: addr(ip, 16),
        peer_port,
        remote_port,
        protocol,
        _pad: [0; 3],
    };
    flow::reply(&FLOWS_V4, &key, protocol, close, &config, slot)
}

/// An ICMP error from the peer about a packet of a flow the network started (conntrack's
/// RELATED): the quoted packet went from the error's destination to the peer.
#[inline(always)]
fn related(
    ctx: &TcContext,
    quoted: usize,
    ip: &[u8; HEAD_LEN],
    config: &wgfence_common::Config,
    slot: u32,
) -> Result<Pass, Drop> {
    let denied = Err(Drop::peer(Counter::DropPolicy, slot));
    let Ok(inner) = ctx.load::<[u8; HEAD_LEN]>(quoted) else {
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
    let Ok(l4) = ctx.load::<[u8; 6]>(quoted + header_len) else {
        return denied;
    };
    let (peer_port, remote_port) = match protocol {
        PROTO_TCP | PROTO_UDP => (
            u16::from_be_bytes([l4[2], l4[3]]),
            u16::from_be_bytes([l4[0], l4[1]]),
        ),
        PROTO_ICMP if l4[0] == ICMP_ECHO_REQUEST => (u16::from_be_bytes([l4[4], l4[5]]), 0),
        _ => return denied,
    };
    let key = FlowKeyV4 {
        peer: addr(ip, 12),
        remote: addr(ip, 16),
        peer_port,
        remote_port,
        protocol,
        _pad: [0; 3],
    };
    flow::reply(&FLOWS_V4, &key, protocol, false, config, slot)
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
    let (peer_port, remote_port, start, close) = match protocol {
        PROTO_TCP => {
            let Ok(tcp) = ctx.load::<[u8; TCP_FLAGS_OFFSET + 1]>(l4) else {
                return;
            };
            let flags = tcp[TCP_FLAGS_OFFSET];
            (
                u16::from_be_bytes([tcp[2], tcp[3]]),
                u16::from_be_bytes([tcp[0], tcp[1]]),
                tcp_opens(flags),
                tcp_closes(flags),
            )
        }
        PROTO_UDP => {
            let Ok(udp) = ctx.load::<[u8; 4]>(l4) else {
                return;
            };
            (
                u16::from_be_bytes([udp[2], udp[3]]),
                u16::from_be_bytes([udp[0], udp[1]]),
                true,
                false,
            )
        }
        PROTO_ICMP => match ctx.load::<[u8; 6]>(l4) {
            Ok(icmp) if icmp[0] == ICMP_ECHO_REQUEST => {
                (u16::from_be_bytes([icmp[4], icmp[5]]), 0, true, false)
            }
            _ => return,
        },
        _ => return,
    };
    let key = FlowKeyV4 {
        peer: dst.addr,
        remote: addr(ip, 12),
        peer_port,
        remote_port,
        protocol,
        _pad: [0; 3],
    };
    let packet = ToPeer {
        protocol,
        start,
        close,
    };
    // The peer's reply: to the remote, its port (none for an echo reply).
    let reply_allowed = || {
        let policy_key = Key::new(
            POLICY_ID_BITS + 32,
            PolicyKeyV4 {
                policy: peer.policy,
                addr: key.remote,
            },
        );
        let port = (protocol != PROTO_ICMP).then_some(remote_port);
        decide(POLICY_V4.get(&policy_key), peer.slot, protocol, port).is_ok()
    };
    flow::on_egress(&FLOWS_V4, &key, &packet, peer.slot, config, reply_allowed);
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
        if let Ok(p) = ctx.load::<[u8; 4]>(l3 + header_len) {
            event.src_port = u16::from_be_bytes([p[0], p[1]]);
            event.dst_port = u16::from_be_bytes([p[2], p[3]]);
            event.flags |= EVENT_PORTS;
        }
    }
}
