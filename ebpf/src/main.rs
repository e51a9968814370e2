//! The wgfence datapath: a tcx classifier on the ingress of a WireGuard interface, i.e. on
//! packets that peers sent, after WireGuard decrypted them, and one on its egress (packets to
//! peers) that records the flows the network starts toward restricted peers.
//!
//! It only looks things up. The agent compiles every policy into maps per address family: a
//! hash map from peer address to policy id, and per policy an LPM trie keyed by destination
//! (found by policy id in an array of maps) whose value already holds every (protocol, port
//! range) allowed for the longest matching prefix. A lookup walks the peer's own policy alone,
//! so its cost does not grow with the number of policies.
//! A packet passes if its source is an unrestricted peer, or a restricted peer's trie entry for
//! its destination has an entry matching its protocol and destination port. Everything else is
//! dropped: unknown sources, malformed headers, too long IPv6 header chains (fail closed).
//!
//! Replies: a packet a restricted peer's policy denies still passes when it answers a flow the
//! network started toward that peer ([`flow`]). Only [`wgfence_egress`] creates flows, so a peer
//! cannot open one from its side; a revoked peer's flows stop counting with its source lookup.
//!
//! The family-specific parsing lives in [`v4`] and [`v6`]; both return `Result<Pass, Drop>`,
//! and [`wgfence_ingress`] turns that into counters, a rate-limited drop event ([`events`]) and
//! a tc verdict in one place.
#![no_std]
#![no_main]
// `atomic_xadd`: the BPF target has no compare-and-swap, so `AtomicU64::fetch_add` does not exist
// there, but an atomic add (BPF_XADD) does. The eBPF crate is built with build-std anyway.
#![feature(core_intrinsics)]
#![allow(internal_features)]

mod events;
mod flow;
mod v4;
mod v6;

use core::{
    intrinsics::{atomic_xadd, AtomicOrdering},
    mem::size_of,
};

use aya_ebpf::{
    btf_maps::{Array, ArrayOfMaps, HashMap, LpmTrie, PerCpuArray, RingBuf},
    macros::{btf_map, classifier},
    programs::TcContext,
};
use aya_log_ebpf::debug;
use wgfence_common::{
    Config, Counter, DropEvent, EventBucket, FlowKeyV4, FlowKeyV6, FlowValue, PeerCounters,
    PeerEntry, PeerKeyV4, PeerKeyV6, PolicyKeyV4, PolicyKeyV6, PolicyValue, RuleCounters, RuleSeen,
    COUNTERS_LEN, EVENTS_BYTES, MAX_ALLOWS, MAX_FLOWS, MAX_PEERS, MAX_POLICIES, MAX_POLICY_ENTRIES,
    MAX_RULES, NO_RULES, NO_SLOT, PEER_WINDOWED, PROTO_TCP, PROTO_UDP,
};

/// tcx: let the next program (or the stack) decide; passing is never final, so wgfence composes
/// with other tcx programs on the same interface.
const TCX_NEXT: i32 = -1;
/// tcx: drop the packet.
const TCX_DROP: i32 = 2;

#[btf_map(name = "wgf4_peers_v4")]
static PEERS_V4: HashMap<PeerKeyV4, PeerEntry, { MAX_PEERS as usize }> = HashMap::new();

#[btf_map(name = "wgf4_peers_v6")]
static PEERS_V6: HashMap<PeerKeyV6, PeerEntry, { MAX_PEERS as usize }> = HashMap::new();

/// One policy's IPv4 trie (the agent creates one per policy).
type TrieV4 = LpmTrie<PolicyKeyV4, PolicyValue, { MAX_POLICY_ENTRIES as usize }>;
/// One policy's IPv6 trie.
type TrieV6 = LpmTrie<PolicyKeyV6, PolicyValue, { MAX_POLICY_ENTRIES as usize }>;

/// Policy id -> that policy's IPv4 trie. An array, so the lookup is an index the verifier
/// inlines; the agent hands out the lowest free ids, and an id past the end (the empty policy's)
/// finds nothing, which denies.
#[btf_map(name = "wgf4_policy_v4")]
static POLICY_V4: ArrayOfMaps<TrieV4, { MAX_POLICIES as usize }> = ArrayOfMaps::new();

/// Policy id -> that policy's IPv6 trie.
#[btf_map(name = "wgf4_policy_v6")]
static POLICY_V6: ArrayOfMaps<TrieV6, { MAX_POLICIES as usize }> = ArrayOfMaps::new();

#[btf_map(name = "wgf4_stats")]
static STATS: PerCpuArray<u64, { COUNTERS_LEN as usize }> = PerCpuArray::new();

#[btf_map(name = "wgf4_peer_stats")]
static PEER_STATS: PerCpuArray<PeerCounters, { MAX_PEERS as usize }> = PerCpuArray::new();

#[btf_map(name = "wgf4_flows_v4")]
static FLOWS_V4: HashMap<FlowKeyV4, FlowValue, { MAX_FLOWS as usize }> = HashMap::new();

#[btf_map(name = "wgf4_flows_v6")]
static FLOWS_V6: HashMap<FlowKeyV6, FlowValue, { MAX_FLOWS as usize }> = HashMap::new();

#[btf_map(name = "wgf4_flow_made")]
static FLOW_MADE: Array<u64, { MAX_PEERS as usize }> = Array::new();

#[btf_map(name = "wgf4_flow_freed")]
static FLOW_FREED: Array<u64, { MAX_PEERS as usize }> = Array::new();

#[btf_map(name = "wgf4_config")]
static CONFIG: Array<Config, 1> = Array::new();

#[btf_map(name = "wgf4_events")]
static EVENTS: RingBuf<DropEvent, { EVENTS_BYTES as usize }> = RingBuf::new();

#[btf_map(name = "wgf4_ev_bucket")]
static EVENT_BUCKET: PerCpuArray<EventBucket, 1> = PerCpuArray::new();

#[btf_map(name = "wgf4_rule_stats")]
static RULE_STATS: PerCpuArray<RuleCounters, { MAX_RULES as usize }> = PerCpuArray::new();

/// Written by the agent only; part of the object so that it is created, checked and pinned
/// with the others.
#[btf_map(name = "wgf4_rule_seen")]
static RULE_SEEN: Array<RuleSeen, { MAX_RULES as usize }> = Array::new();

/// Where the IP header starts in the two program variants: on WireGuard and TUN devices (no
/// link layer), and behind an Ethernet header (veth; `BPF_PROG_TEST_RUN` with a frame).
const L3_NONE: usize = 0;
const ETH_HLEN: usize = 14;
const ETH_P_ARP: u16 = 0x0806;

/// Reads a `T` at `offset` of the packet: directly from the packet's linear part when it is
/// there (no helper call), else with `bpf_skb_load_bytes`, which also reads paged data. Both
/// fail only when the packet is shorter than `offset + size_of::<T>()`, so the verdict never
/// depends on how the kernel laid the packet out.
#[inline(always)]
pub(crate) fn load<T: Copy>(ctx: &TcContext, offset: usize) -> Option<T> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + offset + size_of::<T>() <= end {
        // SAFETY: the bounds check above keeps the read inside the packet's linear data; the
        // verifier checks it again.
        Some(unsafe { core::ptr::read_unaligned((start + offset) as *const T) })
    } else {
        ctx.load(offset).ok()
    }
}

/// On an Ethernet-framed device, ARP must pass or the device stops working; it carries no
/// peer traffic. Only the Ethernet variant has this check: WireGuard devices have no link layer.
#[inline(always)]
fn is_arp<const L3: usize>(ctx: &TcContext) -> bool {
    L3 == ETH_HLEN
        && load::<[u8; 2]>(ctx, L3 - 2).is_some_and(|t| u16::from_be_bytes(t) == ETH_P_ARP)
}

/// Bytes read at the IP header before the version is known.
pub(crate) const HEAD_LEN: usize = 20;

/// The first [`HEAD_LEN`] bytes at `L3`, read in place: a reference into the packet's linear
/// data, never a copy, so a path reads only the header bytes it uses. When the linear part is
/// shorter (a paged skb), they are pulled into it first (`bpf_skb_pull_data`); `None` only
/// when the packet itself is shorter. So, as with [`load`], the verdict never depends on how
/// the kernel laid the packet out.
///
/// The pointers are read again after the rare pull, on both paths (volatile reads, which the
/// compiler cannot reuse), so that the verifier follows one path from here on, not one for a
/// pulled packet and one for a linear one.
#[inline(always)]
fn head<const L3: usize>(ctx: &TcContext) -> Option<&[u8; HEAD_LEN]> {
    if ctx.data() + L3 + HEAD_LEN > ctx.data_end() {
        // A failure leaves the skb as it was: the check below then finds it too short.
        let _ = ctx.pull_data((L3 + HEAD_LEN) as u32);
    }
    // SAFETY: reads of two context fields every tc program may read.
    let (start, end) = unsafe {
        let skb = ctx.skb.skb;
        (
            core::ptr::read_volatile(&(*skb).data) as usize,
            core::ptr::read_volatile(&(*skb).data_end) as usize,
        )
    };
    if start + L3 + HEAD_LEN > end {
        return None;
    }
    // SAFETY: the bounds check above keeps the header inside the packet's linear data (the
    // verifier checks it again), which nothing this program does moves or frees; `[u8; N]`
    // has no alignment to violate.
    Some(unsafe { &*((start + L3) as *const [u8; HEAD_LEN]) })
}

/// The packet passes; `slot` is the peer's counter slot, `rule` the index of the rule counter
/// a policy pass credits (else [`NO_RULES`]).
pub(crate) struct Pass {
    pub(crate) why: Counter,
    pub(crate) slot: u32,
    pub(crate) rule: u32,
}

impl Pass {
    pub(crate) const fn new(why: Counter, slot: u32) -> Self {
        Self {
            why,
            slot,
            rule: NO_RULES,
        }
    }
}

/// The packet is dropped; `slot` is the peer's counter slot when the source is a known peer,
/// else [`NO_SLOT`]. (A plain `u32`, not an `Option`: the payload of a `None` is left
/// uninitialized on the stack, and reading it, even to discard it, fails the verifier of
/// Linux 5.10.)
pub(crate) struct Drop {
    pub(crate) why: Counter,
    pub(crate) slot: u32,
}

impl Drop {
    /// A packet that is no known peer's.
    pub(crate) const fn unknown(why: Counter) -> Self {
        Self { why, slot: NO_SLOT }
    }

    pub(crate) const fn peer(why: Counter, slot: u32) -> Self {
        Self { why, slot }
    }
}

/// Packets from peers on a WireGuard or TUN device (the IP header at offset 0).
#[classifier]
pub fn wgfence_ingress(ctx: TcContext) -> i32 {
    ingress::<L3_NONE>(&ctx)
}

/// Packets from peers on an Ethernet-framed device (the IP header at offset 14).
#[classifier]
pub fn wgfence_eth_in(ctx: TcContext) -> i32 {
    ingress::<ETH_HLEN>(&ctx)
}

/// Packets to peers on a WireGuard or TUN device.
#[classifier]
pub fn wgfence_egress(ctx: TcContext) -> i32 {
    egress::<L3_NONE>(&ctx)
}

/// Packets to peers on an Ethernet-framed device.
#[classifier]
pub fn wgfence_eth_eg(ctx: TcContext) -> i32 {
    egress::<ETH_HLEN>(&ctx)
}

/// The ingress verdict; `L3` is where the IP header starts, a constant of each variant, so
/// every header read below has a constant or bounded offset and reads the packet directly.
#[inline(always)]
fn ingress<const L3: usize>(ctx: &TcContext) -> i32 {
    if is_arp::<L3>(ctx) {
        count(Counter::PassArp);
        return TCX_NEXT;
    }
    // The first 20 bytes: all of an IPv4 header without options, the first half of an IPv6
    // header. Every IP packet is at least that long.
    let head = head::<L3>(ctx);
    let outcome = match head {
        Some(head) if head[0] >> 4 == 4 => v4::classify(ctx, L3, head),
        Some(head) if head[0] >> 4 == 6 => v6::classify(ctx, L3, head),
        Some(_) => Err(Drop::unknown(Counter::DropNotIp)),
        None => Err(Drop::unknown(Counter::DropMalformed)),
    };
    let bytes = u64::from(ctx.len());
    // One drop-event site for drops and audited would-drops: one inlined copy of the event
    // code, as before audit mode.
    let (why, slot, verdict) = match outcome {
        Ok(Pass { why, slot, rule }) if why != Counter::PassAudit => {
            count(why);
            count_peer(slot, true, bytes);
            if rule != NO_RULES {
                count_rule(rule, bytes);
            }
            return TCX_NEXT;
        }
        Ok(Pass { slot, .. }) => {
            // Only audited peers get here: a would-drop, counted and reported, that passes.
            count(Counter::PassAudit);
            count_audit(slot, bytes);
            (Counter::PassAudit, slot, TCX_NEXT)
        }
        Err(Drop { why, slot }) => {
            count(why);
            if slot != NO_SLOT {
                count_peer(slot, false, bytes);
            }
            // Compiled in, but switched off at load time (AYA_LOG_LEVEL = 0) unless the agent
            // runs with datapath logging enabled; the verifier then removes this branch.
            debug!(ctx, "drop: reason {}", why as u32);
            (why, slot, TCX_DROP)
        }
    };
    events::report(ctx, L3, head, why, slot);
    verdict
}

/// Packets to peers: never dropped here; a packet toward a restricted peer that starts or
/// continues a flow is recorded, so the peer's replies pass its policy.
#[inline(always)]
fn egress<const L3: usize>(ctx: &TcContext) -> i32 {
    // A copy: the agent may rewrite the entry while this packet runs.
    let Some(config) = config().copied() else {
        return TCX_NEXT;
    };
    if !config.replies() {
        return TCX_NEXT;
    }
    // A packet the interface itself delivered (a peer sending to its own or another peer's
    // address through the node) was not started by the network: it records no flow, or any
    // peer could fill the tables and make replies for itself.
    // SAFETY: reads of two context fields every tc program may read.
    if unsafe { (*ctx.skb.skb).ingress_ifindex == (*ctx.skb.skb).ifindex } {
        return TCX_NEXT;
    }
    if is_arp::<L3>(ctx) {
        return TCX_NEXT;
    }
    match head::<L3>(ctx) {
        Some(head) if head[0] >> 4 == 4 => v4::record(ctx, L3, head, &config),
        Some(head) if head[0] >> 4 == 6 => v6::record(ctx, L3, head, &config),
        _ => {}
    }
    TCX_NEXT
}

/// The agent's settings; `None` only if the map lookup fails (it never does for index 0).
#[inline(always)]
pub(crate) fn config() -> Option<&'static Config> {
    CONFIG.get(0)
}

/// CLOCK_MONOTONIC in nanoseconds.
#[inline(always)]
pub(crate) fn now_ns() -> u64 {
    // SAFETY: a helper without arguments or side effects.
    unsafe { aya_ebpf::helpers::bpf_ktime_get_ns() }
}

/// CLOCK_BOOTTIME in nanoseconds: the clock of peer windows (setting the wall clock does not
/// move it).
#[inline(always)]
pub(crate) fn boot_ns() -> u64 {
    // SAFETY: a helper without arguments or side effects.
    unsafe { aya_ebpf::helpers::bpf_ktime_get_boot_ns() }
}

/// Before anything else of a known peer: outside its window ([`PEER_WINDOWED`]) the packet is
/// dropped, whatever the policy says. Peers without a window read no clock.
#[inline(always)]
pub(crate) fn in_window(peer: &PeerEntry) -> Result<(), Drop> {
    if peer.flags & PEER_WINDOWED != 0 && !peer.in_window(boot_ns()) {
        return Err(Drop::peer(Counter::DropExpired, peer.slot));
    }
    Ok(())
}

/// The final verdict of a restricted peer: an audited peer's (`audited`, read from its entry
/// before the verdict, so the entry need not outlive it) policy denial passes as a would-drop;
/// every other verdict stands (malformed packets stay dropped).
#[inline(always)]
pub(crate) fn audit(verdict: Result<Pass, Drop>, audited: bool) -> Result<Pass, Drop> {
    match verdict {
        Err(Drop {
            why: Counter::DropPolicy,
            slot,
        }) if audited => Ok(Pass::new(Counter::PassAudit, slot)),
        verdict => verdict,
    }
}

/// A restricted peer's verdict: the trie value for (policy, destination), if any, must hold an
/// entry matching the protocol and destination port. The first entry that matches is credited
/// (its rule counter is `rules` + its rule index, unless `rules` is [`NO_RULES`]).
#[inline(always)]
pub(crate) fn decide(
    value: Option<&PolicyValue>,
    peer: &PeerEntry,
    protocol: u8,
    port: Option<u16>,
) -> Result<Pass, Drop> {
    let Some(value) = value else {
        return Err(Drop::peer(Counter::DropPolicy, peer.slot));
    };
    let count = value.count as usize;
    for i in 0..MAX_ALLOWS {
        if i >= count {
            break;
        }
        let allow = &value.allows[i];
        if allow.matches(protocol, port) {
            let rule = if peer.rules == NO_RULES {
                NO_RULES
            } else {
                peer.rules.wrapping_add(u32::from(allow.rule))
            };
            return Ok(Pass {
                why: Counter::PassPolicy,
                slot: peer.slot,
                rule,
            });
        }
    }
    Err(Drop::peer(Counter::DropPolicy, peer.slot))
}

/// Pass for an unrestricted peer.
#[inline(always)]
pub(crate) const fn unrestricted(slot: u32) -> Pass {
    Pass::new(Counter::PassUnrestricted, slot)
}

/// Whether the protocol carries a destination port the policy can match.
#[inline(always)]
pub(crate) const fn has_ports(protocol: u8) -> bool {
    protocol == PROTO_TCP || protocol == PROTO_UDP
}

/// A packet's transport ports, by value and always initialized: [`Ports::NONE`] (zeros, not
/// `known`) for a packet without them. Not an `Option<(u16, u16)>`: a `None` leaves the payload's
/// stack slot unwritten, and LLVM reloads that slot on the reply path before it tests the
/// discriminant, which the verifiers of Linux 5.10 and 6.1 reject (`invalid read from stack`).
#[derive(Clone, Copy)]
pub(crate) struct Ports {
    pub(crate) known: bool,
    pub(crate) src: u16,
    pub(crate) dst: u16,
}

impl Ports {
    pub(crate) const NONE: Self = Self {
        known: false,
        src: 0,
        dst: 0,
    };
}

/// The type of the ICMP header at `offset`, as the port an allow entry's range matches; `None`
/// when the header's first two bytes (type and code) are not there. Read as two bytes: a
/// one-byte bounds check is one the verifier does not take (see `flow::tcp_flags`).
///
/// Into an initialized buffer: with `load`'s `Option<[u8; 2]>` the compiler may read the
/// payload register of the `None` path, which the helper call clobbered (the verifier refuses).
#[inline(always)]
pub(crate) fn icmp_type(ctx: &TcContext, offset: usize) -> Option<u16> {
    let mut header = [0u8; 2];
    let start = ctx.data();
    let read = if start + offset + 2 <= ctx.data_end() {
        // SAFETY: the bounds check above keeps the read inside the packet's linear data.
        header = unsafe { core::ptr::read_unaligned((start + offset) as *const [u8; 2]) };
        true
    } else {
        // SAFETY: the helper writes at most 2 bytes into `header`, which holds 2.
        unsafe {
            aya_ebpf::helpers::bpf_skb_load_bytes(
                ctx.skb.skb as *const core::ffi::c_void,
                offset as u32,
                header.as_mut_ptr() as *mut core::ffi::c_void,
                2,
            ) == 0
        }
    };
    if read {
        Some(u16::from(header[0]))
    } else {
        None
    }
}

/// The ports of the TCP or UDP header at `offset`; a truncated header is malformed.
#[inline(always)]
pub(crate) fn ports(ctx: &TcContext, offset: usize, slot: u32) -> Result<Ports, Drop> {
    let ports: [u8; 4] = load(ctx, offset).ok_or(Drop::peer(Counter::DropMalformed, slot))?;
    Ok(Ports {
        known: true,
        src: u16::from_be_bytes([ports[0], ports[1]]),
        dst: u16::from_be_bytes([ports[2], ports[3]]),
    })
}

#[inline(always)]
pub(crate) fn count(counter: Counter) {
    if let Some(value) = STATS.get_ptr_mut(counter as u32) {
        // SAFETY: a per-CPU array element, written only by this CPU.
        unsafe { *value += 1 };
    }
}

/// The flows `slot` holds by its quota: recorded by the datapath minus deleted by the agent;
/// `None` when a lookup fails (a slot out of range, which the agent never writes).
///
/// Never below the flows the slot's entries hold: the datapath counts a flow as it records
/// it, the agent counts one only after deleting it, and a start recounts from the tables,
/// never below them (`Maps::recount_flow_quota`). `freed` is read before `made` (volatile
/// reads, kept in that order), so a deletion the agent counts meanwhile cannot make a slot
/// with a live flow look empty. What is left is the instant between a flow's insertion and
/// its count, where the slot looks one flow short.
#[inline(always)]
fn live_flows(slot: u32) -> Option<u64> {
    let freed = FLOW_FREED.get_ptr(slot)?;
    let made = FLOW_MADE.get_ptr(slot)?;
    // SAFETY: preallocated array elements; aligned 8-byte words, written whole (an atomic add
    // by the datapath, a map update by the agent).
    let (freed, made) = unsafe {
        let freed = core::ptr::read_volatile(freed);
        (freed, core::ptr::read_volatile(made))
    };
    Some(made.saturating_sub(freed))
}

/// Whether `slot` may record one more flow: its [`live_flows`] are below the quota. A failed
/// lookup refuses.
#[inline(always)]
pub(crate) fn under_quota(slot: u32, config: &Config) -> bool {
    live_flows(slot).is_some_and(|live| live < u64::from(config.flows_per_peer))
}

/// Whether `slot` may hold a live reply flow. A denied packet of a peer that holds none skips
/// the flow lookup (a hash of a 16- or 40-byte key), so a flood of denied datagrams from a
/// peer the network never started a flow toward costs what a denied TCP SYN does. Sound by
/// [`live_flows`]: a reply in the instant between its flow's insertion and count (it cannot
/// arrive before the packet that starts the flow has left) is dropped, never passed. A failed
/// lookup looks the flow up, as before.
#[inline(always)]
pub(crate) fn holds_flows(slot: u32) -> bool {
    live_flows(slot).is_none_or(|live| live > 0)
}

/// Counts a flow recorded for `slot` against its quota.
#[inline(always)]
pub(crate) fn count_made(slot: u32) {
    if let Some(made) = FLOW_MADE.get_ptr_mut(slot) {
        // SAFETY: a preallocated array element, updated only with atomic adds.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(made, 1) };
    }
}

#[inline(always)]
fn count_peer(slot: u32, pass: bool, bytes: u64) {
    let Some(counters) = PEER_STATS.get_ptr_mut(slot) else {
        return;
    };
    // SAFETY: a per-CPU array element, written only by this CPU (tc programs run with
    // migration disabled): plain adds, no shared cache line.
    unsafe {
        if pass {
            (*counters).pass_packets += 1;
            (*counters).pass_bytes += bytes;
        } else {
            (*counters).drop_packets += 1;
            (*counters).drop_bytes += bytes;
        }
    }
}

/// An audited peer's would-drop.
#[inline(always)]
fn count_audit(slot: u32, bytes: u64) {
    let Some(counters) = PEER_STATS.get_ptr_mut(slot) else {
        return;
    };
    // SAFETY: as in `count_peer`.
    unsafe {
        (*counters).audit_packets += 1;
        (*counters).audit_bytes += bytes;
    }
}

/// A policy pass credited to rule counter `rule`.
#[inline(always)]
fn count_rule(rule: u32, bytes: u64) {
    let Some(counters) = RULE_STATS.get_ptr_mut(rule) else {
        return;
    };
    // SAFETY: a per-CPU array element, written only by this CPU, as in `count_peer`. No clock
    // is read here (it would cost more than the rest of an allowed packet): the agent notes
    // when each counter moved ([`wgfence_common::RuleSeen`]).
    unsafe {
        (*counters).packets += 1;
        (*counters).bytes += bytes;
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
