//! IPv6: source lookup, then (for a restricted peer) a bounded walk of the extension headers to
//! the upper-layer protocol and port, and the policy trie.

use aya_ebpf::{btf_maps::lpm_trie::Key, programs::TcContext};
use wgfence_common::{
    Counter, PeerKeyV6, PolicyKeyV6, MAX_IPV6_EXT_HEADERS, POLICY_ID_BITS, UNRESTRICTED,
};

use crate::{decide, dst_port, has_ports, unrestricted, Drop, Pass, HEAD_LEN, PEERS_V6, POLICY_V6};

const HEADER_LEN: usize = 40;
const HOP_BY_HOP: u8 = 0;
const ROUTING: u8 = 43;
const FRAGMENT: u8 = 44;
const AUTHENTICATION: u8 = 51;
const DESTINATION_OPTIONS: u8 = 60;

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
    let tail: [u8; HEADER_LEN - HEAD_LEN] = ctx
        .load(l3 + HEAD_LEN)
        .map_err(|_| Drop::new(Counter::DropMalformed, None))?;
    let mut src = PeerKeyV6::default();
    src.addr[..12].copy_from_slice(&head[8..20]);
    src.addr[12..].copy_from_slice(&tail[..4]);
    // SAFETY: the value is copied out at once; no reference outlives the lookup.
    let Some(peer) = (unsafe { PEERS_V6.get(&src) }).copied() else {
        return Err(Drop::new(Counter::DropUnknownSource, None));
    };
    if peer.policy == UNRESTRICTED {
        return Ok(unrestricted(peer.slot));
    }
    let slot = peer.slot;
    let malformed = |_| Drop::peer(Counter::DropMalformed, slot);

    let mut next = head[6];
    let mut offset = l3 + HEADER_LEN;
    let mut first_fragment = true;
    for _ in 0..MAX_IPV6_EXT_HEADERS {
        if !is_extension_header(next) {
            break;
        }
        match next {
            FRAGMENT => {
                let fragment: [u8; 4] = ctx.load(offset).map_err(malformed)?;
                next = fragment[0];
                offset += 8;
                if u16::from_be_bytes([fragment[2], fragment[3]]) >> 3 != 0 {
                    // A non-first fragment: what follows is payload, not headers.
                    first_fragment = false;
                    break;
                }
            }
            AUTHENTICATION => {
                let header: [u8; 2] = ctx.load(offset).map_err(malformed)?;
                next = header[0];
                offset += (usize::from(header[1]) + 2) * 4;
            }
            _ => {
                let header: [u8; 2] = ctx.load(offset).map_err(malformed)?;
                next = header[0];
                offset += (usize::from(header[1]) + 1) * 8;
            }
        }
    }
    if first_fragment && is_extension_header(next) {
        // More extension headers than the walk allows: fail closed.
        return Err(Drop::peer(Counter::DropHeaderChain, slot));
    }
    let port = if first_fragment && has_ports(next) {
        Some(dst_port(ctx, offset, slot)?)
    } else {
        None
    };

    let mut dst = PolicyKeyV6 {
        policy: peer.policy,
        addr: [0; 16],
    };
    dst.addr.copy_from_slice(&tail[4..20]);
    let key = Key::new(POLICY_ID_BITS + 128, dst);
    decide(POLICY_V6.get(&key), slot, next, port)
}
