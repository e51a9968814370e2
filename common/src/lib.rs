//! Types shared by the wgfence datapath (the eBPF program) and the agent.
//!
//! Everything here is `#[repr(C)]`, `Pod` and free of padding, so the same bytes mean the same
//! thing on both sides of the map. The layout is versioned by [`LAYOUT_VERSION`], which is part
//! of every map name: a new agent never reuses a pinned map whose layout it does not know.
//!
//! The datapath is deliberately dumb: it looks up the packet's source in the peer maps and, for a
//! restricted peer, the destination in that peer's policy trie, then scans a short, canonical list
//! of [`Allow`] entries. All policy logic (folding prefixes, merging port ranges, content ids)
//! lives in the agent's compiler.
#![no_std]

use bytemuck::{Pod, Zeroable};

/// Version of the map layout below. Bumped on any change to a key, a value or a map's meaning.
pub const LAYOUT_VERSION: u32 = 1;

/// Map names. Each carries the layout version and fits the kernel's 15-character limit
/// (`BPF_OBJ_NAME_LEN` - 1), so `bpftool map show` prints them whole.
pub mod map_names {
    /// IPv4 peer address -> [`super::PeerEntry`].
    pub const PEERS_V4: &str = "wgf1_peers_v4";
    /// IPv6 peer address -> [`super::PeerEntry`].
    pub const PEERS_V6: &str = "wgf1_peers_v6";
    /// LPM trie: (policy id, IPv4 destination prefix) -> [`super::PolicyValue`].
    pub const POLICY_V4: &str = "wgf1_policy_v4";
    /// LPM trie: (policy id, IPv6 destination prefix) -> [`super::PolicyValue`].
    pub const POLICY_V6: &str = "wgf1_policy_v6";
    /// Per-CPU array of packet counters indexed by [`super::Counter`].
    pub const STATS: &str = "wgf1_stats";
    /// Array of [`super::PeerCounters`] indexed by [`super::PeerEntry::slot`].
    pub const PEER_STATS: &str = "wgf1_peer_stats";

    /// Every map the agent pins, in a fixed order.
    pub const ALL: [&str; 6] = [PEERS_V4, PEERS_V6, POLICY_V4, POLICY_V6, STATS, PEER_STATS];
}

/// Name of the ingress classifier in the object file.
pub const INGRESS_PROGRAM: &str = "wgfence_ingress";

/// Name of the load-time constant that tells the program where the IP header starts: 0 on a
/// WireGuard or TUN device (no link-layer header), 14 behind an Ethernet header (veth,
/// `BPF_PROG_TEST_RUN`).
pub const L3_OFFSET_GLOBAL: &str = "WGFENCE_L3_OFFSET";

/// Peers per address family; also the number of per-peer counter slots.
pub const MAX_PEERS: u32 = 131_072;
/// Policy trie entries per address family (tries are not preallocated: this is a ceiling).
pub const MAX_POLICY_ENTRIES: u32 = 1_048_576;
/// Allow entries per trie value: the bound of the datapath's scan.
pub const MAX_ALLOWS: usize = 32;
/// IPv6 extension headers the datapath walks before it gives up (and fails closed).
pub const MAX_IPV6_EXT_HEADERS: usize = 8;

/// [`PeerEntry::policy`] of a peer without egress rules: everything it sends passes.
pub const UNRESTRICTED: u32 = 0;

/// [`Allow::protocol`] that matches every IP protocol.
pub const PROTO_ANY: u8 = 0;
pub const PROTO_ICMP: u8 = 1;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_ICMPV6: u8 = 58;

/// Key of the IPv4 peer map: the peer's tunnel address, network byte order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable)]
pub struct PeerKeyV4 {
    pub addr: [u8; 4],
}

/// Key of the IPv6 peer map: the peer's tunnel address, network byte order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable)]
pub struct PeerKeyV6 {
    pub addr: [u8; 16],
}

/// Value of both peer maps.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct PeerEntry {
    /// Policy id whose trie entries govern this peer, or [`UNRESTRICTED`].
    pub policy: u32,
    /// Index of this peer's [`PeerCounters`] in the per-peer counter array. A peer's IPv4 and
    /// IPv6 entries share one slot.
    pub slot: u32,
}

/// Data part of an IPv4 policy trie key. The trie key's prefix length counts the 32 bits of
/// `policy` plus the destination prefix length, so a lookup only ever matches entries of the
/// peer's own policy.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable)]
pub struct PolicyKeyV4 {
    pub policy: u32,
    pub addr: [u8; 4],
}

/// Data part of an IPv6 policy trie key; see [`PolicyKeyV4`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable)]
pub struct PolicyKeyV6 {
    pub policy: u32,
    pub addr: [u8; 16],
}

/// Bits of the policy id at the front of every policy trie key.
pub const POLICY_ID_BITS: u32 = 32;

/// One allowed (protocol, destination port range). `protocol` is an IP protocol number or
/// [`PROTO_ANY`]. A packet whose destination port is unknown (not TCP/UDP, or a non-first
/// fragment) matches only entries that cover every port (`0..=65535`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable)]
pub struct Allow {
    pub protocol: u8,
    pub _pad: u8,
    pub port_lo: u16,
    pub port_hi: u16,
}

impl Allow {
    pub const fn new(protocol: u8, port_lo: u16, port_hi: u16) -> Self {
        Self {
            protocol,
            _pad: 0,
            port_lo,
            port_hi,
        }
    }

    /// Whether this entry covers every port, i.e. can match a packet whose port is unknown.
    #[inline(always)]
    pub const fn all_ports(&self) -> bool {
        self.port_lo == 0 && self.port_hi == u16::MAX
    }

    /// The datapath's match: the protocol matches and the port is in range; an unknown port
    /// (`None`) only matches an entry that covers every port.
    #[inline(always)]
    pub fn matches(&self, protocol: u8, port: Option<u16>) -> bool {
        if self.protocol != PROTO_ANY && self.protocol != protocol {
            return false;
        }
        match port {
            Some(port) => self.port_lo <= port && port <= self.port_hi,
            None => self.all_ports(),
        }
    }
}

/// Value of both policy tries: the allow entries of the longest matching prefix, with every
/// less specific prefix's entries already folded in by the agent. Entries past `count` are zero.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct PolicyValue {
    pub count: u32,
    pub allows: [Allow; MAX_ALLOWS],
}

impl Default for PolicyValue {
    fn default() -> Self {
        Self::zeroed()
    }
}

impl PolicyValue {
    /// The valid entries.
    pub fn allows(&self) -> &[Allow] {
        let n = (self.count as usize).min(MAX_ALLOWS);
        &self.allows[..n]
    }
}

/// Indexes of the per-CPU packet counter array ([`map_names::STATS`]).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Counter {
    /// Passed: the source is an unrestricted peer.
    PassUnrestricted = 0,
    /// Passed: a restricted peer's policy allows the packet.
    PassPolicy = 1,
    /// Dropped: the source address is not a known peer address (fail closed).
    DropUnknownSource = 2,
    /// Dropped: a restricted peer's policy does not allow the packet.
    DropPolicy = 3,
    /// Dropped: a header is truncated or inconsistent.
    DropMalformed = 4,
    /// Dropped: neither IPv4 nor IPv6.
    DropNotIp = 5,
    /// Dropped: a restricted peer's IPv6 extension header chain is longer than the datapath walks.
    DropHeaderChain = 6,
    /// Passed: an ARP frame on an Ethernet-framed device (veth in tests and benchmarks). A
    /// WireGuard device has no link layer, so this never counts there.
    PassArp = 7,
}

/// Length of the counter array; leaves room for new counters without a layout change.
pub const COUNTERS_LEN: u32 = 16;

impl Counter {
    pub const ALL: [Counter; 8] = [
        Counter::PassUnrestricted,
        Counter::PassPolicy,
        Counter::PassArp,
        Counter::DropUnknownSource,
        Counter::DropPolicy,
        Counter::DropMalformed,
        Counter::DropNotIp,
        Counter::DropHeaderChain,
    ];

    pub const fn is_pass(self) -> bool {
        matches!(
            self,
            Counter::PassUnrestricted | Counter::PassPolicy | Counter::PassArp
        )
    }

    /// Stable name, used as the `verdict` or `reason` label in metrics and in `status`.
    pub const fn name(self) -> &'static str {
        match self {
            Counter::PassUnrestricted => "unrestricted",
            Counter::PassPolicy => "policy",
            Counter::DropUnknownSource => "unknown_source",
            Counter::DropPolicy => "policy_denied",
            Counter::DropMalformed => "malformed",
            Counter::DropNotIp => "not_ip",
            Counter::DropHeaderChain => "header_chain",
            Counter::PassArp => "arp",
        }
    }
}

/// Per-peer counters, updated with atomic adds (one shared array rather than a per-CPU one:
/// per-CPU values for 131,072 peers would cost 4 MiB per CPU).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct PeerCounters {
    pub pass_packets: u64,
    pub pass_bytes: u64,
    pub drop_packets: u64,
    pub drop_bytes: u64,
}

#[cfg(feature = "user")]
mod user {
    use super::*;

    // SAFETY: every type is #[repr(C)], made only of integers and arrays of integers, without
    // padding (checked by the `Pod` derives above).
    unsafe impl aya::Pod for PeerKeyV4 {}
    unsafe impl aya::Pod for PeerKeyV6 {}
    unsafe impl aya::Pod for PeerEntry {}
    unsafe impl aya::Pod for PolicyKeyV4 {}
    unsafe impl aya::Pod for PolicyKeyV6 {}
    unsafe impl aya::Pod for PolicyValue {}
    unsafe impl aya::Pod for PeerCounters {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_names_fit_the_kernel_limit_and_carry_the_layout_version() {
        for name in map_names::ALL {
            assert!(name.len() <= 15, "{name} is longer than 15 characters");
            assert!(
                name.starts_with("wgf1_"),
                "{name} does not carry layout version 1"
            );
        }
        assert_eq!(LAYOUT_VERSION, 1);
    }

    #[test]
    fn sizes_are_stable() {
        assert_eq!(core::mem::size_of::<PeerKeyV4>(), 4);
        assert_eq!(core::mem::size_of::<PeerKeyV6>(), 16);
        assert_eq!(core::mem::size_of::<PeerEntry>(), 8);
        assert_eq!(core::mem::size_of::<PolicyKeyV4>(), 8);
        assert_eq!(core::mem::size_of::<PolicyKeyV6>(), 20);
        assert_eq!(core::mem::size_of::<Allow>(), 6);
        assert_eq!(core::mem::size_of::<PolicyValue>(), 4 + 6 * MAX_ALLOWS);
        assert_eq!(core::mem::size_of::<PeerCounters>(), 32);
    }

    #[test]
    fn allow_matches_protocol_and_port_range_inclusive() {
        let a = Allow::new(PROTO_TCP, 8000, 8100);
        assert!(!a.matches(PROTO_TCP, Some(7999)));
        assert!(a.matches(PROTO_TCP, Some(8000)));
        assert!(a.matches(PROTO_TCP, Some(8100)));
        assert!(!a.matches(PROTO_TCP, Some(8101)));
        assert!(!a.matches(PROTO_UDP, Some(8000)));
        // A non-first fragment has no port: only an all-ports entry can match it.
        assert!(!a.matches(PROTO_TCP, None));
        assert!(Allow::new(PROTO_TCP, 0, u16::MAX).matches(PROTO_TCP, None));
        assert!(Allow::new(PROTO_ANY, 0, u16::MAX).matches(PROTO_UDP, Some(53)));
        assert!(Allow::new(PROTO_ICMP, 0, u16::MAX).matches(PROTO_ICMP, None));
    }
}
