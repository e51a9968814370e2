//! Reply flows. [`crate::wgfence_egress`] records a flow when the network sends a restricted
//! peer a packet that may start one; [`crate::wgfence_ingress`] lets a packet the peer's policy
//! denies pass when it answers a flow that is still live, and refreshes it.
//!
//! A flow is keyed as the peer's reply looks (peer address and port first), so the ingress
//! lookup needs no swapping. Only the egress program creates entries: a peer cannot make one
//! from its side. Idle timeouts are the agent's ([`Config`]), checked against the entry's
//! timestamp at lookup; the LRU map forgets the least recently used flows when it is full.

use aya_ebpf::btf_maps::LruHashMap;
use wgfence_common::{
    Config, Counter, FlowValue, FLOW_CLOSING, FLOW_OPEN, MAX_FLOWS, PROTO_TCP, PROTO_UDP,
};

use crate::{count, now_ns, Drop, Pass};

pub(crate) type Flows<K> = LruHashMap<K, FlowValue, { MAX_FLOWS as usize }>;

pub(crate) const TCP_FIN: u8 = 0x01;
pub(crate) const TCP_SYN: u8 = 0x02;
pub(crate) const TCP_RST: u8 = 0x04;
pub(crate) const TCP_ACK: u8 = 0x10;
/// Offset of the flags byte in a TCP header.
pub(crate) const TCP_FLAGS_OFFSET: usize = 13;

/// A TCP segment that opens a connection: SYN without ACK (a SYN-ACK answers one).
#[inline(always)]
pub(crate) const fn tcp_opens(flags: u8) -> bool {
    flags & (TCP_SYN | TCP_ACK) == TCP_SYN
}

/// A TCP segment that closes a connection: FIN or RST.
#[inline(always)]
pub(crate) const fn tcp_closes(flags: u8) -> bool {
    flags & (TCP_FIN | TCP_RST) != 0
}

/// The idle timeout of a flow of `protocol` in `state`.
#[inline(always)]
fn timeout(config: &Config, protocol: u8, state: u32) -> u64 {
    match protocol {
        PROTO_TCP if state == FLOW_CLOSING => config.tcp_closing_timeout_ns,
        PROTO_TCP => config.tcp_timeout_ns,
        PROTO_UDP => config.udp_timeout_ns,
        _ => config.other_timeout_ns,
    }
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
/// when the packet may start one. An expired flow, or one recorded for another holder of the
/// address, counts as absent. `reply_allowed` (asked only before recording) says whether the
/// peer's policy already allows the reply: then no flow is needed and none is recorded, so the
/// answers to the peer's own allowed traffic never fill the table.
#[inline(always)]
pub(crate) fn on_egress<K>(
    flows: &Flows<K>,
    key: &K,
    packet: &ToPeer,
    slot: u32,
    config: &Config,
    reply_allowed: impl FnOnce() -> bool,
) {
    let now = now_ns();
    if let Some(flow) = flows.get_ptr_mut(key) {
        // SAFETY: `flow` points into the map's element for `key`; racing writers store whole
        // aligned words, and a torn timestamp only shifts an idle timeout.
        let (last_seen, state, owner) =
            unsafe { ((*flow).last_seen_ns, (*flow).state, (*flow).slot) };
        let live = owner == slot
            && now.saturating_sub(last_seen) <= timeout(config, packet.protocol, state);
        if live {
            // SAFETY: as above.
            unsafe {
                (*flow).last_seen_ns = now;
                if packet.close {
                    (*flow).state = FLOW_CLOSING;
                } else if packet.start {
                    (*flow).state = FLOW_OPEN;
                }
            }
            return;
        }
    }
    if packet.start && !packet.close && !reply_allowed() {
        let flow = FlowValue {
            last_seen_ns: now,
            state: FLOW_OPEN,
            slot,
        };
        if flows.insert(key, flow, 0).is_ok() {
            count(Counter::FlowRecorded);
        }
    }
}

/// Ingress: the peer's packet `key`, which its policy denies, passes if it answers a live flow.
#[inline(always)]
pub(crate) fn reply<K>(
    flows: &Flows<K>,
    key: &K,
    protocol: u8,
    close: bool,
    config: &Config,
    slot: u32,
) -> Result<Pass, Drop> {
    let Some(flow) = flows.get_ptr_mut(key) else {
        return Err(Drop::peer(Counter::DropPolicy, slot));
    };
    let now = now_ns();
    // SAFETY: as in `on_egress`.
    let (last_seen, state, owner) = unsafe { ((*flow).last_seen_ns, (*flow).state, (*flow).slot) };
    // Recorded for another holder of this address: not this peer's flow.
    if owner != slot || now.saturating_sub(last_seen) > timeout(config, protocol, state) {
        return Err(Drop::peer(Counter::DropPolicy, slot));
    }
    // SAFETY: as in `on_egress`.
    unsafe {
        (*flow).last_seen_ns = now;
        if close {
            (*flow).state = FLOW_CLOSING;
        }
    }
    Ok(Pass {
        why: Counter::PassReply,
        slot,
    })
}
