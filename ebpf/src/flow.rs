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

/// Egress: a packet toward a restricted peer. `start`: the packet may start a flow (a TCP SYN
/// without ACK, a UDP datagram, an ICMP echo request); `close`: a TCP FIN or RST. A packet
/// that cannot start a flow only refreshes one that exists.
#[inline(always)]
pub(crate) fn on_egress<K>(flows: &Flows<K>, key: &K, start: bool, close: bool) {
    let now = now_ns();
    if let Some(flow) = flows.get_ptr_mut(key) {
        // SAFETY: `flow` points into the map's element for `key`; racing writers store whole
        // aligned words, and a torn timestamp only shifts an idle timeout.
        unsafe {
            (*flow).last_seen_ns = now;
            if close {
                (*flow).state = FLOW_CLOSING;
            } else if start {
                (*flow).state = FLOW_OPEN;
            }
        }
        return;
    }
    if start && !close {
        let flow = FlowValue {
            last_seen_ns: now,
            state: FLOW_OPEN,
            _pad: 0,
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
    let (last_seen, state) = unsafe { ((*flow).last_seen_ns, (*flow).state) };
    let timeout = match protocol {
        PROTO_TCP if state == FLOW_CLOSING => config.tcp_closing_timeout_ns,
        PROTO_TCP => config.tcp_timeout_ns,
        PROTO_UDP => config.udp_timeout_ns,
        _ => config.other_timeout_ns,
    };
    if now.saturating_sub(last_seen) > timeout {
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
