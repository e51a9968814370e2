//! IPv4: source lookup, then (for a restricted peer) protocol, port and the policy trie.

use aya_ebpf::{btf_maps::lpm_trie::Key, programs::TcContext};
use wgfence_common::{Counter, PeerKeyV4, PolicyKeyV4, POLICY_ID_BITS, UNRESTRICTED};

use crate::{decide, dst_port, has_ports, unrestricted, Drop, Pass, HEAD_LEN, PEERS_V4, POLICY_V4};

const MIN_HEADER_LEN: usize = HEAD_LEN;
/// Fragment offset bits of the flags/fragment-offset field.
const FRAGMENT_OFFSET_MASK: u16 = 0x1fff;

#[inline(always)]
pub(crate) fn classify(ctx: &TcContext, l3: usize, ip: &[u8; HEAD_LEN]) -> Result<Pass, Drop> {
    let src = PeerKeyV4 {
        addr: [ip[12], ip[13], ip[14], ip[15]],
    };
    // SAFETY: the value is copied out at once; no reference outlives the lookup.
    let Some(peer) = (unsafe { PEERS_V4.get(&src) }).copied() else {
        return Err(Drop::new(Counter::DropUnknownSource, None));
    };
    if peer.policy == UNRESTRICTED {
        return Ok(unrestricted(peer.slot));
    }

    // Options are skipped via IHL; an IHL below the minimum is a malformed header.
    let header_len = usize::from(ip[0] & 0x0f) * 4;
    if header_len < MIN_HEADER_LEN {
        return Err(Drop::peer(Counter::DropMalformed, peer.slot));
    }
    let protocol = ip[9];
    let fragment_offset = u16::from_be_bytes([ip[6], ip[7]]) & FRAGMENT_OFFSET_MASK;
    // A non-first fragment carries no transport header: its port is unknown.
    let port = if fragment_offset == 0 && has_ports(protocol) {
        Some(dst_port(ctx, l3 + header_len, peer.slot)?)
    } else {
        None
    };

    let key = Key::new(
        POLICY_ID_BITS + 32,
        PolicyKeyV4 {
            policy: peer.policy,
            addr: [ip[16], ip[17], ip[18], ip[19]],
        },
    );
    decide(POLICY_V4.get(&key), peer.slot, protocol, port)
}
