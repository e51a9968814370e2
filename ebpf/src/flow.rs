//! Reply flows. [`crate::wgfence_egress`] records a flow when the network sends a restricted
//! peer a packet that may start one; [`crate::wgfence_ingress`] lets a packet the peer's policy
//! denies pass when it answers a flow that is still live, and refreshes it.
//!
//! A flow is keyed as the peer's reply looks (peer address and port first), so the ingress
//! lookup needs no swapping. Only the egress program creates entries: a peer cannot make one
//! from its side. Idle timeouts are the agent's ([`Config`]), checked against the entry's
//! timestamp at lookup; the agent deletes expired flows. A flow starts unanswered
//! ([`FLOW_UNANSWERED`], the short [`Config::unanswered_timeout_ns`]) and opens when the peer
//! answers on it, so what the network sends a silent peer holds its quota only briefly.
//! Nothing is evicted: a flow counts
//! against its peer's quota ([`Config::flows_per_peer`]) until the agent deletes it, and a full
//! quota or a full table refuses new flows (which only stops replies).
//!
//! A flow belongs to the [`PeerEntry::owner`] that held the address when it was recorded; for
//! any other owner it is absent.

use aya_ebpf::{bindings::BPF_NOEXIST, btf_maps::HashMap, programs::TcContext};
use wgfence_common::{
    Config, Counter, FlowValue, PeerEntry, FLOW_CLOSING, FLOW_OPEN, FLOW_UNANSWERED, MAX_FLOWS,
    PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP,
};

use crate::{count, count_made, load, now_ns, under_quota, Drop, Pass, Ports};

pub(crate) type Flows<K> = HashMap<K, FlowValue, { MAX_FLOWS as usize }>;

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;
/// Offset of the flags byte in a TCP header.
const TCP_FLAGS_OFFSET: usize = 13;

/// The flags of the TCP header at `l4`. Read as the two bytes that end with them: the compiler
/// turns a one-byte bounds check (`p + 1 <= end`) into `p < end`, which the verifier does not
/// take as a bound; both reads end at the same byte, so the same packets have flags.
#[inline(always)]
fn tcp_flags(ctx: &TcContext, l4: usize) -> Option<u8> {
    load::<[u8; 2]>(ctx, l4 + TCP_FLAGS_OFFSET - 1).map(|b| b[1])
}

/// A TCP segment that opens a connection: SYN without ACK (a SYN-ACK answers one).
#[inline(always)]
const fn tcp_opens(flags: u8) -> bool {
    flags & (TCP_SYN | TCP_ACK) == TCP_SYN
}

/// A TCP segment that closes a connection: FIN or RST.
#[inline(always)]
const fn tcp_closes(flags: u8) -> bool {
    flags & (TCP_FIN | TCP_RST) != 0
}

/// The idle timeout of a flow of `protocol` in `state`.
#[inline(always)]
fn timeout(config: &Config, protocol: u8, state: u32) -> u64 {
    config.timeout_ns(protocol, state)
}

/// What the egress program saw of a packet toward a restricted peer.
pub(crate) struct ToPeer {
    pub(crate) protocol: u8,
    /// The packet may start a flow: a TCP SYN without ACK, a UDP datagram, an ICMP echo
    /// request.
    pub(crate) start: bool,
    /// A TCP FIN or RST.
    pub(crate) close: bool,
}

/// Egress: refreshes the live flow of a packet toward a restricted peer, or records a new one
/// when the packet may start one. An expired flow, or one recorded for another owner of the
/// address, counts as absent. `reply_allowed` (asked only before recording) says whether the
/// peer's policy already allows the reply: then no flow is needed and none is recorded, so the
/// answers to the peer's own allowed traffic never fill the table.
#[inline(always)]
pub(crate) fn on_egress<K>(
    flows: &Flows<K>,
    key: &K,
    packet: &ToPeer,
    peer: &PeerEntry,
    config: &Config,
    reply_allowed: impl FnOnce() -> bool,
) {
    let now = now_ns();
    let starts = packet.start && !packet.close;
    if let Some(flow) = flows.get_ptr_mut(key) {
        // SAFETY: `flow` points into the map's element for `key`; racing writers store whole
        // aligned words, and a torn timestamp only shifts an idle timeout.
        let (last_seen, state, owner, slot) = unsafe {
            (
                (*flow).last_seen_ns,
                (*flow).state,
                (*flow).owner,
                (*flow).slot,
            )
        };
        let live = owner == peer.owner
            && now.saturating_sub(last_seen) <= timeout(config, packet.protocol, state);
        if live {
            // SAFETY: as above.
            // A new connection on a closing flow's ports waits for the peer's answer again;
            // otherwise the network's packets (a retransmitted SYN too) answer nothing.
            unsafe {
                (*flow).last_seen_ns = now;
                if packet.close {
                    (*flow).state = FLOW_CLOSING;
                } else if packet.start && state == FLOW_CLOSING {
                    (*flow).state = FLOW_UNANSWERED;
                }
            }
            return;
        }
        if !starts || reply_allowed() {
            return;
        }
        if slot != peer.slot {
            // Another slot's dead flow: it counts against that slot until the agent deletes it.
            count(Counter::FlowRefused);
            return;
        }
        // The slot's own dead flow: taken over in place, its quota unchanged. The owner goes
        // first, so the entry never looks live for the old owner.
        // SAFETY: as above.
        unsafe {
            (*flow).owner = peer.owner;
            (*flow).state = FLOW_UNANSWERED;
            (*flow).last_seen_ns = now;
        }
        count(Counter::FlowRecorded);
        return;
    }
    if !starts || reply_allowed() {
        return;
    }
    if !under_quota(peer.slot, config) {
        count(Counter::FlowRefused);
        return;
    }
    let flow = FlowValue {
        last_seen_ns: now,
        owner: peer.owner,
        state: FLOW_UNANSWERED,
        slot: peer.slot,
    };
    // Never replaces an entry (a racing CPU's): a full table refuses.
    if flows.insert(key, flow, u64::from(BPF_NOEXIST)).is_ok() {
        count_made(peer.slot);
        count(Counter::FlowRecorded);
    } else {
        count(Counter::FlowRefused);
    }
}

/// What a peer's packet on a flow does to it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Seen {
    /// A packet of the flow: the peer answers, the flow is open.
    Answer,
    /// A TCP FIN or RST: the flow is closing.
    Close,
    /// An ICMP error about the flow (conntrack's RELATED): it passes, but answers nothing.
    Related,
}

/// Ingress: the peer's packet `key`, which its policy denies, passes if it answers a live flow
/// of the address's current owner.
#[inline(always)]
pub(crate) fn reply<K>(
    flows: &Flows<K>,
    key: &K,
    protocol: u8,
    seen: Seen,
    config: &Config,
    peer: &PeerEntry,
) -> Result<Pass, Drop> {
    let slot = peer.slot;
    let Some(flow) = flows.get_ptr_mut(key) else {
        return Err(Drop::peer(Counter::DropPolicy, slot));
    };
    let now = now_ns();
    // SAFETY: as in `on_egress`.
    let (last_seen, state, owner) = unsafe { ((*flow).last_seen_ns, (*flow).state, (*flow).owner) };
    // Recorded for another holder of this address: not this peer's flow.
    if owner != peer.owner || now.saturating_sub(last_seen) > timeout(config, protocol, state) {
        return Err(Drop::peer(Counter::DropPolicy, slot));
    }
    // SAFETY: as in `on_egress`.
    unsafe {
        (*flow).last_seen_ns = now;
        match seen {
            Seen::Close => (*flow).state = FLOW_CLOSING,
            Seen::Answer if state == FLOW_UNANSWERED => (*flow).state = FLOW_OPEN,
            Seen::Answer | Seen::Related => {}
        }
    }
    Ok(Pass::new(Counter::PassReply, slot))
}

/// The ICMP numbers of one address family.
pub(crate) struct Icmp {
    pub(crate) protocol: u8,
    pub(crate) echo_request: u8,
    pub(crate) echo_reply: u8,
    /// Bit `t` set: type `t` is an error that quotes the packet it is about.
    pub(crate) errors: u32,
}

pub(crate) const ICMP_V4: Icmp = Icmp {
    protocol: PROTO_ICMP,
    echo_request: 8,
    echo_reply: 0,
    // Destination unreachable, time exceeded, parameter problem.
    errors: 1 << 3 | 1 << 11 | 1 << 12,
};

pub(crate) const ICMP_V6: Icmp = Icmp {
    protocol: PROTO_ICMPV6,
    echo_request: 128,
    echo_reply: 129,
    // Destination unreachable, packet too big, time exceeded, parameter problem.
    errors: 1 << 1 | 1 << 2 | 1 << 3 | 1 << 4,
};

/// Bytes of an ICMP error before the packet it quotes (both families).
pub(crate) const ICMP_ERROR_LEN: usize = 8;

/// The flow of a packet from the remote toward the peer whose transport header is at `l4`:
/// (peer port, remote port), the echo identifier for an echo request; `None` when no flow can
/// have it. Reads at most the 8 bytes an ICMP error quotes.
#[inline(always)]
pub(crate) fn toward_peer(
    ctx: &TcContext,
    l4: usize,
    protocol: u8,
    icmp: &Icmp,
) -> Option<(u16, u16)> {
    let h = load::<[u8; 6]>(ctx, l4)?;
    match protocol {
        PROTO_TCP | PROTO_UDP => Some((
            u16::from_be_bytes([h[2], h[3]]),
            u16::from_be_bytes([h[0], h[1]]),
        )),
        p if p == icmp.protocol && h[0] == icmp.echo_request => {
            Some((u16::from_be_bytes([h[4], h[5]]), 0))
        }
        _ => None,
    }
}

/// Egress: what a packet toward the peer does to its flow.
#[inline(always)]
pub(crate) fn effect(ctx: &TcContext, l4: usize, protocol: u8) -> Option<ToPeer> {
    let (start, close) = if protocol == PROTO_TCP {
        let flags = tcp_flags(ctx, l4)?;
        (tcp_opens(flags), tcp_closes(flags))
    } else {
        (true, false)
    };
    Some(ToPeer {
        protocol,
        start,
        close,
    })
}

/// How a peer's packet that its policy denied could answer a flow.
pub(crate) enum Answer {
    /// A reply on the flow (peer port, remote port): [`Seen::Answer`], or [`Seen::Close`] for
    /// a TCP FIN or RST.
    Flow {
        peer_port: u16,
        remote_port: u16,
        close: Seen,
    },
    /// An ICMP error: the packet it quotes, at `l4 + ICMP_ERROR_LEN`, names the flow.
    Error,
}

/// Ingress: reads what a peer's packet (transport header at `l4`, `ports` as the policy check
/// read them) could answer.
#[inline(always)]
pub(crate) fn answer(
    ctx: &TcContext,
    l4: usize,
    protocol: u8,
    ports: Ports,
    icmp: &Icmp,
) -> Option<Answer> {
    match protocol {
        PROTO_TCP if ports.known => {
            let flags = tcp_flags(ctx, l4)?;
            // A segment that opens a connection (SYN without ACK) answers none: the peer's
            // side of a connection the network opened starts with its SYN-ACK. So a flood of
            // the peer's own SYNs to denied places (a scan) costs no flow lookup.
            if tcp_opens(flags) {
                return None;
            }
            Some(Answer::Flow {
                peer_port: ports.src,
                remote_port: ports.dst,
                close: if tcp_closes(flags) {
                    Seen::Close
                } else {
                    Seen::Answer
                },
            })
        }
        PROTO_UDP if ports.known => Some(Answer::Flow {
            peer_port: ports.src,
            remote_port: ports.dst,
            close: Seen::Answer,
        }),
        p if p == icmp.protocol => {
            let h = load::<[u8; 6]>(ctx, l4)?;
            if h[0] == icmp.echo_reply {
                Some(Answer::Flow {
                    peer_port: u16::from_be_bytes([h[4], h[5]]),
                    remote_port: 0,
                    close: Seen::Answer,
                })
            } else if h[0] < 32 && icmp.errors >> h[0] & 1 == 1 {
                Some(Answer::Error)
            } else {
                None
            }
        }
        _ => None,
    }
}
