//! Floor programs for `cargo xtask bench` (never loaded by the agent): the least any filter
//! with wgfence's maps can do per packet, run on the same raw IP packets (offset 0, as the L3
//! variant reads them) under `BPF_PROG_TEST_RUN`, so the bench can report wgfence's paths as
//! ratios to them:
//! - [`floor_empty`]: nothing, the harness's own cost;
//! - [`floor_lookup`]: the source address looked up in a hash map with the key and value sizes
//!   of `wgf4_peers_v4`;
//! - [`floor_lpm`]: that lookup, then the destination in one LPM trie that all policies share,
//!   keyed by (policy id, destination): the floor of map layout 3, measured beside layout 4's;
//! - [`floor_mim`]: that lookup, then the destination in a trie of the peer's policy alone,
//!   found by policy id in an array of maps: the floor of map layout 4 (`wgf4_policy_v4`).
//!
//! Packets are read directly (no helper); a short packet is dropped.
#![no_std]
#![no_main]

use core::mem::size_of;

use aya_ebpf::{
    btf_maps::{lpm_trie::Key, ArrayOfMaps, HashMap, LpmTrie},
    macros::{btf_map, classifier},
    programs::TcContext,
};
use wgfence_common::{
    PeerEntry, PeerKeyV4, PolicyKeyV4, PolicyValue, SharedPolicyKeyV4, MAX_PEERS, MAX_POLICIES,
    MAX_POLICY_ENTRIES,
};

const TCX_NEXT: i32 = -1;
const TCX_DROP: i32 = 2;

#[btf_map(name = "floor_peers")]
static PEERS: HashMap<PeerKeyV4, PeerEntry, { MAX_PEERS as usize }> = HashMap::new();

#[btf_map(name = "floor_policy")]
static POLICY: LpmTrie<SharedPolicyKeyV4, PolicyValue, { MAX_POLICY_ENTRIES as usize }> =
    LpmTrie::new();

/// One policy's trie: destination prefixes only, no policy id in the key.
pub type PolicyTrieV4 = LpmTrie<PolicyKeyV4, PolicyValue, { MAX_POLICY_ENTRIES as usize }>;

/// Policy id -> that policy's trie.
#[btf_map(name = "floor_pol_of")]
static POLICY_OF: ArrayOfMaps<PolicyTrieV4, { MAX_POLICIES as usize }> = ArrayOfMaps::new();

/// The first 20 bytes of the packet (an IPv4 header without options).
#[inline(always)]
fn head(ctx: &TcContext) -> Option<[u8; 20]> {
    let start = ctx.data();
    if start + size_of::<[u8; 20]>() > ctx.data_end() {
        return None;
    }
    // SAFETY: bounds-checked above (and by the verifier).
    Some(unsafe { core::ptr::read_unaligned(start as *const [u8; 20]) })
}

#[inline(always)]
fn addr(ip: &[u8; 20], at: usize) -> [u8; 4] {
    [ip[at], ip[at + 1], ip[at + 2], ip[at + 3]]
}

/// The peer entry of the packet's source address, copied out.
#[inline(always)]
fn source_peer(ip: &[u8; 20]) -> Option<PeerEntry> {
    // SAFETY: the value is copied out at once.
    unsafe { PEERS.get(&PeerKeyV4 { addr: addr(ip, 12) }) }.copied()
}

#[classifier]
pub fn floor_empty(_ctx: TcContext) -> i32 {
    TCX_NEXT
}

#[classifier]
pub fn floor_lookup(ctx: TcContext) -> i32 {
    let Some(ip) = head(&ctx) else {
        return TCX_DROP;
    };
    // SAFETY: the value is not kept past the lookup.
    match unsafe {
        PEERS.get(&PeerKeyV4 {
            addr: addr(&ip, 12),
        })
    } {
        Some(_) => TCX_NEXT,
        None => TCX_DROP,
    }
}

#[classifier]
pub fn floor_lpm(ctx: TcContext) -> i32 {
    let Some((ip, peer)) = head(&ctx).and_then(|ip| Some((ip, source_peer(&ip)?))) else {
        return TCX_DROP;
    };
    let key = Key::new(
        32 + 32,
        SharedPolicyKeyV4 {
            policy: peer.policy,
            addr: addr(&ip, 16),
        },
    );
    match POLICY.get(&key) {
        Some(_) => TCX_NEXT,
        None => TCX_DROP,
    }
}

#[classifier]
pub fn floor_mim(ctx: TcContext) -> i32 {
    let Some((ip, peer)) = head(&ctx).and_then(|ip| Some((ip, source_peer(&ip)?))) else {
        return TCX_DROP;
    };
    let key = Key::new(
        32,
        PolicyKeyV4 {
            addr: addr(&ip, 16),
        },
    );
    match POLICY_OF.get_value_ptr_mut(peer.policy, &key) {
        Some(_) => TCX_NEXT,
        None => TCX_DROP,
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
