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
pub const LAYOUT_VERSION: u32 = 4;

/// Map names. Each carries the layout version and fits the kernel's 15-character limit
/// (`BPF_OBJ_NAME_LEN` - 1), so `bpftool map show` prints them whole.
pub mod map_names {
    /// IPv4 peer address -> [`super::PeerEntry`].
    pub const PEERS_V4: &str = "wgf4_peers_v4";
    /// IPv6 peer address -> [`super::PeerEntry`].
    pub const PEERS_V6: &str = "wgf4_peers_v6";
    /// Array of maps: policy id -> that policy's IPv4 trie ([`TRIE_V4`]).
    pub const POLICY_V4: &str = "wgf4_policy_v4";
    /// Array of maps: policy id -> that policy's IPv6 trie ([`TRIE_V6`]).
    pub const POLICY_V6: &str = "wgf4_policy_v6";
    /// The name of every policy's IPv4 trie, an LPM trie: destination prefix
    /// ([`super::PolicyKeyV4`]) -> [`super::PolicyValue`]. Not a map of the programs: the agent
    /// creates one per policy and pins it under [`TRIES_V4`] by its policy id.
    pub const TRIE_V4: &str = "wgf4_trie_v4";
    /// The name of every policy's IPv6 trie; see [`TRIE_V4`].
    pub const TRIE_V6: &str = "wgf4_trie_v6";
    /// The pin directory of the IPv4 policy tries: `<pin dir>/wgf4_tries_v4/<policy id>`.
    pub const TRIES_V4: &str = "wgf4_tries_v4";
    /// The pin directory of the IPv6 policy tries; see [`TRIES_V4`].
    pub const TRIES_V6: &str = "wgf4_tries_v6";
    /// Per-CPU array of packet counters indexed by [`super::Counter`].
    pub const STATS: &str = "wgf4_stats";
    /// Per-CPU array of [`super::PeerCounters`] indexed by [`super::PeerEntry::slot`]: each CPU
    /// writes only its own copy; readers sum over the CPUs.
    pub const PEER_STATS: &str = "wgf4_peer_stats";

    /// Hash: IPv4 flow the network started toward a peer ([`super::FlowKeyV4`]) ->
    /// [`super::FlowValue`].
    pub const FLOWS_V4: &str = "wgf4_flows_v4";
    /// Hash: IPv6 flow the network started toward a peer ([`super::FlowKeyV6`]) ->
    /// [`super::FlowValue`].
    pub const FLOWS_V6: &str = "wgf4_flows_v6";
    /// Array of u64 indexed by [`super::PeerEntry::slot`]: flows the datapath recorded for
    /// the slot (atomic adds, datapath only).
    pub const FLOW_MADE: &str = "wgf4_flow_made";
    /// Array of u64 indexed by [`super::PeerEntry::slot`]: flows of the slot the agent deleted
    /// (agent only). A slot's live flows are `made - freed`.
    pub const FLOW_FREED: &str = "wgf4_flow_freed";
    /// Array of one [`super::Config`]: the settings the agent gives the datapath.
    pub const CONFIG: &str = "wgf4_config";
    /// Ring buffer of [`super::DropEvent`]s, read by `wgfence monitor`.
    pub const EVENTS: &str = "wgf4_events";
    /// Per-CPU array of one [`super::EventBucket`]: the drop event rate limiter.
    pub const EVENT_BUCKET: &str = "wgf4_ev_bucket";
    /// Per-CPU array of [`super::RuleCounters`]: a policy pass counts at the index
    /// [`super::PeerEntry::rules`] + [`super::Allow::rule`] of the entry that matched.
    pub const RULE_STATS: &str = "wgf4_rule_stats";
    /// Array of [`super::RuleSeen`] indexed like [`RULE_STATS`], written by the agent only.
    pub const RULE_SEEN: &str = "wgf4_rule_seen";

    /// Every map the agent pins, in a fixed order.
    pub const ALL: [&str; 15] = [
        PEERS_V4,
        PEERS_V6,
        POLICY_V4,
        POLICY_V6,
        STATS,
        PEER_STATS,
        FLOWS_V4,
        FLOWS_V6,
        FLOW_MADE,
        FLOW_FREED,
        CONFIG,
        EVENTS,
        EVENT_BUCKET,
        RULE_STATS,
        RULE_SEEN,
    ];
}

/// One build of the datapath's two programs for one kind of interface: where the IP header
/// starts is a compile-time constant of each variant, so every header read has a constant
/// (or bounded) offset and reads the packet directly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Variant {
    /// What `wgfence status` calls it.
    pub name: &'static str,
    /// The ingress classifier (packets from peers) in the object file.
    pub ingress: &'static str,
    /// The egress classifier (packets to peers) in the object file: it records the flows the
    /// network starts toward restricted peers, so their replies pass.
    pub egress: &'static str,
    /// Offset of the IP header in the packet data.
    pub l3_offset: u32,
}

/// For devices without a link layer (WireGuard, TUN): the IP header at offset 0, no ARP check.
pub const VARIANT_L3: Variant = Variant {
    name: "l3",
    ingress: "wgfence_ingress",
    egress: "wgfence_egress",
    l3_offset: 0,
};

/// For Ethernet-framed devices (veth): the IP header at offset 14; ARP passes.
pub const VARIANT_ETHERNET: Variant = Variant {
    name: "ethernet",
    ingress: "wgfence_eth_in",
    egress: "wgfence_eth_eg",
    l3_offset: 14,
};

/// Every variant; their program names are distinct within the kernel's 15 characters.
pub const VARIANTS: [Variant; 2] = [VARIANT_L3, VARIANT_ETHERNET];

impl Variant {
    /// The variant whose ingress or egress program is called `program` (a kernel program name).
    pub fn of_program(program: &str) -> Option<Variant> {
        VARIANTS
            .into_iter()
            .find(|v| v.ingress == program || v.egress == program)
    }
}

/// Peers per address family; also the number of per-peer counter slots.
pub const MAX_PEERS: u32 = 131_072;
/// Policy trie entries per address family, all policies together (the agent's ceiling; tries
/// are not preallocated, and each policy's trie is created with this as its own).
pub const MAX_POLICY_ENTRIES: u32 = 1_048_576;
/// Allow entries per trie value: the bound of the datapath's scan.
pub const MAX_ALLOWS: usize = 32;
/// Flows per address family in the reply flow tables (a plain hash: nothing is evicted; when
/// the table is full, new flows are refused until the agent sweeps expired ones).
pub const MAX_FLOWS: u32 = 131_072;
/// Default of [`Config::flows_per_peer`]: live flows one peer slot may hold in both tables.
pub const DEFAULT_FLOWS_PER_PEER: u32 = 1024;
/// Bytes of the drop event ring buffer (a power of two, a multiple of the page size).
pub const EVENTS_BYTES: u32 = 256 * 1024;
/// Rule counters ([`map_names::RULE_STATS`]): the blocks of every policy's rules together.
pub const MAX_RULES: u32 = 65_536;
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
/// Protocol the datapath matches a non-first IPv6 fragment with: its fragment header's
/// next-header field is the sender's word, not necessarily the first fragment's, so such a
/// fragment may only match [`PROTO_ANY`] entries. 255 is reserved by IANA; the policy compiler
/// never produces an [`Allow`] with it.
pub const PROTO_UNKNOWN: u8 = 255;

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

/// [`PeerEntry::flags`]: audit mode. A packet the peer's policy denies passes, counted as a
/// would-drop ([`Counter::PassAudit`], [`PeerCounters::audit_packets`]) and reported as an
/// event. Unknown sources, malformed packets and packets outside the window stay dropped.
pub const PEER_AUDIT: u32 = 1;
/// [`PeerEntry::flags`]: the peer's packets pass only from [`PeerEntry::not_before_ns`] until
/// before [`PeerEntry::expires_ns`] ([`Counter::DropExpired`] outside).
pub const PEER_WINDOWED: u32 = 2;
/// [`PeerEntry::rules`] of a peer whose policy passes are not counted per rule.
pub const NO_RULES: u32 = u32::MAX;

/// Value of both peer maps.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct PeerEntry {
    /// Policy id whose trie entries govern this peer, or [`UNRESTRICTED`].
    pub policy: u32,
    /// Index of this peer's [`PeerCounters`] in the per-peer counter array. A peer's IPv4 and
    /// IPv6 entries share one slot.
    pub slot: u32,
    /// The holder of this entry: allocated by the agent whenever the address gets a new
    /// WireGuard holder or a new slot, never reused (across restarts too, see
    /// [`Config::owner_high`]). A flow counts only for the entry whose owner recorded it.
    pub owner: u64,
    /// [`PEER_AUDIT`], [`PEER_WINDOWED`]; 0 for a peer that uses neither, which then costs
    /// the datapath nothing more than this one test.
    pub flags: u32,
    /// First index of the peer's policy's block of [`RuleCounters`] (the policy's rules in
    /// canonical order), or [`NO_RULES`].
    pub rules: u32,
    /// With [`PEER_WINDOWED`]: the window, in `bpf_ktime_get_boot_ns` time (CLOCK_BOOTTIME:
    /// monotonic, counts suspend, and setting the wall clock does not move it). The agent
    /// converts the state file's RFC 3339 times when it writes the entry.
    pub not_before_ns: u64,
    /// With [`PEER_WINDOWED`]: the first instant the peer's packets no longer pass.
    pub expires_ns: u64,
}

impl Default for PeerEntry {
    fn default() -> Self {
        Self {
            policy: 0,
            slot: 0,
            owner: 0,
            flags: 0,
            rules: NO_RULES,
            not_before_ns: 0,
            expires_ns: u64::MAX,
        }
    }
}

impl PeerEntry {
    /// Whether the window lets a packet through at `now_ns` (always, without [`PEER_WINDOWED`]).
    #[inline(always)]
    pub const fn in_window(&self, now_ns: u64) -> bool {
        self.flags & PEER_WINDOWED == 0
            || (self.not_before_ns <= now_ns && now_ns < self.expires_ns)
    }

    pub const fn audit(&self) -> bool {
        self.flags & PEER_AUDIT != 0
    }
}

/// Data part of an IPv4 policy trie key: the destination. Each policy has a trie of its own
/// (found by its id in [`map_names::POLICY_V4`]), so a lookup only ever walks the entries of the
/// peer's own policy, however many other policies there are.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable)]
pub struct PolicyKeyV4 {
    pub addr: [u8; 4],
}

/// Data part of an IPv6 policy trie key; see [`PolicyKeyV4`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable)]
pub struct PolicyKeyV6 {
    pub addr: [u8; 16],
}

/// Data part of a key of one IPv4 trie that all policies share, whose prefix length counts the
/// 32 bits of `policy` plus the destination's: map layout 3's policy trie, which the bench's
/// floor programs still measure beside layout 4's.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable)]
pub struct SharedPolicyKeyV4 {
    pub policy: u32,
    pub addr: [u8; 4],
}

/// Slots of [`map_names::POLICY_V4`] and [`map_names::POLICY_V6`], indexed by policy id: the
/// agent hands out ids below it (a policy per peer, twice, for a push that gives every peer a
/// new policy: the new ones are written before the old ones go).
pub const MAX_POLICIES: u32 = 2 * MAX_PEERS;

/// One allowed (protocol, destination port range). `protocol` is an IP protocol number or
/// [`PROTO_ANY`]. A packet whose destination port is unknown (not TCP/UDP, or a non-first
/// fragment) matches only entries that cover every port (`0..=65535`). `rule` is the index,
/// in canonical order, of the policy's rule this entry came from: the datapath scans the
/// entries in order and credits the first that matches ([`PeerEntry::rules`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable)]
pub struct Allow {
    pub protocol: u8,
    pub _pad: u8,
    pub port_lo: u16,
    pub port_hi: u16,
    pub rule: u16,
}

impl Allow {
    pub const fn new(protocol: u8, port_lo: u16, port_hi: u16) -> Self {
        Self::of_rule(0, protocol, port_lo, port_hi)
    }

    /// An entry credited to the policy's rule `rule` (canonical order).
    pub const fn of_rule(rule: u16, protocol: u8, port_lo: u16, port_hi: u16) -> Self {
        Self {
            protocol,
            _pad: 0,
            port_lo,
            port_hi,
            rule,
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

/// A flow the network started toward a restricted peer, keyed as the peer's reply looks: the
/// peer's address and port first. Only the egress program (packets to peers) creates entries,
/// so a peer cannot make one from its side. For ICMP echo, `peer_port` is the echo identifier
/// and `remote_port` is 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable)]
pub struct FlowKeyV4 {
    pub peer: [u8; 4],
    pub remote: [u8; 4],
    pub peer_port: u16,
    pub remote_port: u16,
    pub protocol: u8,
    pub _pad: [u8; 3],
}

/// IPv6 form of [`FlowKeyV4`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable)]
pub struct FlowKeyV6 {
    pub peer: [u8; 16],
    pub remote: [u8; 16],
    pub peer_port: u16,
    pub remote_port: u16,
    pub protocol: u8,
    pub _pad: [u8; 3],
}

/// [`FlowValue::state`]: the flow is open and the peer has answered on it.
pub const FLOW_OPEN: u32 = 0;
/// [`FlowValue::state`]: a TCP flow saw a FIN or an RST; it times out after the closing timeout.
pub const FLOW_CLOSING: u32 = 1;
/// [`FlowValue::state`]: the network started the flow and the peer has not answered on it yet
/// (an ICMP error is no answer); it times out after [`Config::unanswered_timeout_ns`], so
/// packets toward a silent peer hold its quota only briefly.
pub const FLOW_UNANSWERED: u32 = 2;

/// Value of the flow tables: when the flow last carried a packet (either way), in
/// `bpf_ktime_get_ns` time (CLOCK_MONOTONIC), the [`PeerEntry::owner`] of the address when the
/// flow was recorded (a reply passes only while the entry still has that owner, so a flow never
/// carries over to a new holder of the address), its state, and the slot whose quota it counts
/// against.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct FlowValue {
    pub last_seen_ns: u64,
    pub owner: u64,
    pub state: u32,
    pub slot: u32,
}

/// [`Config::flags`]: replies to flows the network started pass restricted peers' policies.
pub const CONFIG_REPLIES: u32 = 1;

/// The agent's settings for the datapath, the single entry of [`map_names::CONFIG`]. All zero
/// (the state before the agent writes it) means: no reply passing, no drop events.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct Config {
    pub flags: u32,
    /// Live flows one peer slot may hold (both families): the datapath records no new flow for
    /// a slot whose `made - freed` has reached it. 0 records nothing.
    pub flows_per_peer: u32,
    /// Idle timeout of an open TCP flow.
    pub tcp_timeout_ns: u64,
    /// Idle timeout of a TCP flow after a FIN or RST.
    pub tcp_closing_timeout_ns: u64,
    pub udp_timeout_ns: u64,
    /// Idle timeout of an ICMP echo flow (the timeout of any protocol but TCP and UDP; only
    /// an ICMP echo starts a flow of another protocol).
    pub icmp_timeout_ns: u64,
    /// Idle timeout of a flow the peer has not answered yet ([`FLOW_UNANSWERED`]), any
    /// protocol, when shorter than the protocol's.
    pub unanswered_timeout_ns: u64,
    /// Drop events: nanoseconds of credit one event costs on one CPU; 0 disables events.
    pub event_interval_ns: u64,
    /// Drop events: the most credit one CPU can save up (the burst).
    pub event_burst_ns: u64,
    /// The highest [`PeerEntry::owner`] the agent ever handed out on this interface (the
    /// datapath does not read it). Raised before an entry with a higher owner is written, so
    /// a restarted agent never reuses an owner.
    pub owner_high: u64,
}

impl Config {
    pub const fn replies(&self) -> bool {
        self.flags & CONFIG_REPLIES != 0
    }

    /// The idle timeout of a flow of `protocol` in `state` ([`FlowValue::state`]).
    #[inline(always)]
    pub const fn timeout_ns(&self, protocol: u8, state: u32) -> u64 {
        let timeout = match protocol {
            PROTO_TCP if state == FLOW_CLOSING => self.tcp_closing_timeout_ns,
            PROTO_TCP => self.tcp_timeout_ns,
            PROTO_UDP => self.udp_timeout_ns,
            _ => self.icmp_timeout_ns,
        };
        if state == FLOW_UNANSWERED && self.unanswered_timeout_ns < timeout {
            self.unanswered_timeout_ns
        } else {
            timeout
        }
    }
}

/// Per-CPU state of the drop event rate limiter: a token bucket counted in nanoseconds of
/// credit, refilled from `jiffies` (no clock read for a refused event).
///
/// Earlier agents of the same layout (3) kept the CLOCK_MONOTONIC time of the last refill in
/// the second field, named `last_ns`: a map such an agent pinned still shows that name in
/// `bpftool map dump` (its BTF is the creator's), and the first refill after the program is
/// replaced reads the old value as a far-away jiffy count, which grants one burst at most.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct EventBucket {
    pub credit_ns: u64,
    /// `jiffies` at the last refill.
    pub last_jiffies: u64,
}

/// [`DropEvent::flags`]: `src_port` and `dst_port` hold the packet's ports.
pub const EVENT_PORTS: u8 = 1;

/// [`DropEvent::slot`] when the source is not a known peer.
pub const NO_SLOT: u32 = u32::MAX;

/// One dropped packet, as `wgfence monitor` receives it. Addresses are network byte order;
/// an IPv4 address fills the first 4 bytes. Ports are 0 when the packet has none (or the
/// datapath did not read them: non-first fragments, IPv6 extension headers, truncated
/// headers); [`EVENT_PORTS`] in `flags` tells.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct DropEvent {
    /// `bpf_ktime_get_ns` when the packet was dropped.
    pub timestamp_ns: u64,
    /// The [`Counter`] that explains the drop.
    pub reason: u32,
    /// The source peer's counter slot, or [`NO_SLOT`].
    pub slot: u32,
    /// Packet length in bytes.
    pub len: u32,
    /// 4 or 6; 0 when the packet is not IP.
    pub family: u8,
    /// IPv4: the protocol; IPv6: the first next header (an extension header's number if the
    /// packet has one).
    pub protocol: u8,
    pub src_port: u16,
    pub dst_port: u16,
    /// [`EVENT_PORTS`] when the ports were read.
    pub flags: u8,
    pub _pad: [u8; 5],
    pub src: [u8; 16],
    pub dst: [u8; 16],
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
    /// Passed: a restricted peer's policy denies the packet, but it replies to a flow the
    /// network started toward the peer.
    PassReply = 8,
    /// Not a verdict: a drop event the rate limiter held back.
    EventRateLimited = 9,
    /// Not a verdict: a drop event lost because the ring buffer was full (nobody reading).
    EventRingFull = 10,
    /// Not a verdict: a drop event written to the ring buffer.
    EventSent = 11,
    /// Not a verdict: a flow toward a restricted peer recorded by the egress program.
    FlowRecorded = 12,
    /// Not a verdict: a flow the egress program did not record because the peer's quota
    /// ([`Config::flows_per_peer`]) or the flow table was full.
    FlowRefused = 13,
    /// Dropped: the peer's packet is outside its window ([`PEER_WINDOWED`]).
    DropExpired = 14,
    /// Passed: an audited peer's ([`PEER_AUDIT`]) policy denies the packet: a would-drop.
    PassAudit = 15,
}

/// Length of the counter array; leaves room for new counters without a layout change.
pub const COUNTERS_LEN: u32 = 32;

impl Counter {
    /// Every verdict counter: each packet the ingress program sees counts in exactly one.
    pub const ALL: [Counter; 11] = [
        Counter::PassUnrestricted,
        Counter::PassPolicy,
        Counter::PassReply,
        Counter::PassArp,
        Counter::PassAudit,
        Counter::DropUnknownSource,
        Counter::DropExpired,
        Counter::DropPolicy,
        Counter::DropMalformed,
        Counter::DropNotIp,
        Counter::DropHeaderChain,
    ];

    /// Counters that are not verdicts: drop events and recorded flows.
    pub const OTHER: [Counter; 5] = [
        Counter::EventSent,
        Counter::EventRateLimited,
        Counter::EventRingFull,
        Counter::FlowRecorded,
        Counter::FlowRefused,
    ];

    pub const fn is_pass(self) -> bool {
        matches!(
            self,
            Counter::PassUnrestricted
                | Counter::PassPolicy
                | Counter::PassReply
                | Counter::PassArp
                | Counter::PassAudit
        )
    }

    /// The counter at `index` of the counter array, if any.
    pub const fn from_index(index: u32) -> Option<Self> {
        Some(match index {
            0 => Counter::PassUnrestricted,
            1 => Counter::PassPolicy,
            2 => Counter::DropUnknownSource,
            3 => Counter::DropPolicy,
            4 => Counter::DropMalformed,
            5 => Counter::DropNotIp,
            6 => Counter::DropHeaderChain,
            7 => Counter::PassArp,
            8 => Counter::PassReply,
            9 => Counter::EventRateLimited,
            10 => Counter::EventRingFull,
            11 => Counter::EventSent,
            12 => Counter::FlowRecorded,
            13 => Counter::FlowRefused,
            14 => Counter::DropExpired,
            15 => Counter::PassAudit,
            _ => return None,
        })
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
            Counter::PassReply => "reply",
            Counter::EventRateLimited => "rate_limited",
            Counter::EventRingFull => "ring_full",
            Counter::EventSent => "sent",
            Counter::FlowRecorded => "flow_recorded",
            Counter::FlowRefused => "flow_refused",
            Counter::DropExpired => "expired",
            Counter::PassAudit => "audit",
        }
    }
}

/// Per-peer counters, one copy per CPU ([`map_names::PEER_STATS`] is a per-CPU array): a packet
/// writes only its own CPU's copy, with plain adds, so packets of one peer on several CPUs
/// never write a shared cache line. The price is memory: 48 B per slot per CPU (6 MiB per CPU
/// for 131,072 slots). Readers sum the copies.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct PeerCounters {
    pub pass_packets: u64,
    pub pass_bytes: u64,
    pub drop_packets: u64,
    pub drop_bytes: u64,
    /// Would-drops of an audited peer ([`PEER_AUDIT`]): denied by its policy, passed.
    pub audit_packets: u64,
    pub audit_bytes: u64,
}

/// Per-rule counters, one copy per CPU ([`map_names::RULE_STATS`]): policy passes credited to
/// the rule (see [`Allow::rule`]). 16 B per rule per CPU (1 MiB per CPU for [`MAX_RULES`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct RuleCounters {
    pub packets: u64,
    pub bytes: u64,
}

/// When a rule counter last moved, as the agent saw it ([`map_names::RULE_SEEN`], written by
/// the agent only): the datapath reads no clock per packet. `packets` is the counter's total
/// (summed over the CPUs) when the agent last looked, `last_hit_ns` the CLOCK_BOOTTIME time of
/// the first look that found it higher than the look before (0: never). A total above
/// `packets` means hits since that look.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct RuleSeen {
    pub packets: u64,
    pub last_hit_ns: u64,
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
    unsafe impl aya::Pod for SharedPolicyKeyV4 {}
    unsafe impl aya::Pod for PolicyValue {}
    unsafe impl aya::Pod for PeerCounters {}
    unsafe impl aya::Pod for RuleCounters {}
    unsafe impl aya::Pod for RuleSeen {}
    unsafe impl aya::Pod for FlowKeyV4 {}
    unsafe impl aya::Pod for FlowKeyV6 {}
    unsafe impl aya::Pod for FlowValue {}
    unsafe impl aya::Pod for Config {}
    unsafe impl aya::Pod for EventBucket {}
    unsafe impl aya::Pod for DropEvent {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_names_fit_the_kernel_limit_and_carry_the_layout_version() {
        let tries = [
            map_names::TRIE_V4,
            map_names::TRIE_V6,
            map_names::TRIES_V4,
            map_names::TRIES_V6,
        ];
        for name in map_names::ALL.into_iter().chain(tries) {
            assert!(name.len() <= 15, "{name} is longer than 15 characters");
            assert!(
                name.starts_with("wgf4_"),
                "{name} does not carry layout version 4"
            );
        }
        assert_eq!(LAYOUT_VERSION, 4);
    }

    #[test]
    fn program_names_fit_the_kernel_limit_and_name_one_variant() {
        for v in VARIANTS {
            for program in [v.ingress, v.egress] {
                assert!(
                    program.len() <= 15,
                    "{program} is longer than 15 characters"
                );
                assert_eq!(Variant::of_program(program), Some(v));
            }
        }
        assert_eq!(VARIANT_L3.l3_offset, 0);
        assert_eq!(VARIANT_ETHERNET.l3_offset, 14);
    }

    #[test]
    fn sizes_are_stable() {
        assert_eq!(core::mem::size_of::<PeerKeyV4>(), 4);
        assert_eq!(core::mem::size_of::<PeerKeyV6>(), 16);
        assert_eq!(core::mem::size_of::<PeerEntry>(), 40);
        assert_eq!(core::mem::size_of::<PolicyKeyV4>(), 4);
        assert_eq!(core::mem::size_of::<PolicyKeyV6>(), 16);
        assert_eq!(core::mem::size_of::<Allow>(), 8);
        assert_eq!(core::mem::size_of::<PolicyValue>(), 4 + 8 * MAX_ALLOWS);
        assert_eq!(core::mem::size_of::<PeerCounters>(), 48);
        assert_eq!(core::mem::size_of::<RuleCounters>(), 16);
        assert_eq!(core::mem::size_of::<RuleSeen>(), 16);
        assert_eq!(core::mem::size_of::<FlowKeyV4>(), 16);
        assert_eq!(core::mem::size_of::<FlowKeyV6>(), 40);
        assert_eq!(core::mem::size_of::<FlowValue>(), 24);
        assert_eq!(core::mem::size_of::<Config>(), 72);
        assert_eq!(core::mem::size_of::<DropEvent>(), 64);
    }

    #[test]
    fn an_unanswered_flow_times_out_at_the_shorter_of_its_two_timeouts() {
        let c = Config {
            tcp_timeout_ns: 100,
            tcp_closing_timeout_ns: 10,
            udp_timeout_ns: 60,
            icmp_timeout_ns: 30,
            unanswered_timeout_ns: 40,
            ..Config::default()
        };
        assert_eq!(c.timeout_ns(PROTO_TCP, FLOW_UNANSWERED), 40);
        assert_eq!(c.timeout_ns(PROTO_TCP, FLOW_OPEN), 100);
        assert_eq!(c.timeout_ns(PROTO_TCP, FLOW_CLOSING), 10);
        assert_eq!(c.timeout_ns(PROTO_UDP, FLOW_UNANSWERED), 40);
        assert_eq!(c.timeout_ns(PROTO_UDP, FLOW_OPEN), 60);
        assert_eq!(c.timeout_ns(PROTO_ICMP, FLOW_UNANSWERED), 30);
    }

    #[test]
    fn counters_fit_the_array_and_round_trip_their_index() {
        for c in Counter::ALL.iter().chain(Counter::OTHER.iter()) {
            assert!((*c as u32) < COUNTERS_LEN);
            assert_eq!(Counter::from_index(*c as u32), Some(*c));
        }
        assert_eq!(Counter::from_index(COUNTERS_LEN), None);
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

    #[test]
    fn only_a_windowed_entry_checks_its_window() {
        let mut e = PeerEntry {
            not_before_ns: 100,
            expires_ns: 200,
            ..PeerEntry::default()
        };
        assert!(e.in_window(0) && e.in_window(300));
        e.flags = PEER_WINDOWED;
        assert!(!e.in_window(99));
        assert!(e.in_window(100));
        assert!(e.in_window(199));
        assert!(!e.in_window(200));
        assert!(PeerEntry::default().in_window(u64::MAX - 1));
    }

    #[test]
    fn the_unknown_protocol_matches_only_any() {
        assert!(Allow::new(PROTO_ANY, 0, u16::MAX).matches(PROTO_UNKNOWN, None));
        for p in [PROTO_TCP, PROTO_UDP, PROTO_ICMP, PROTO_ICMPV6, 44, 59] {
            assert!(!Allow::new(p, 0, u16::MAX).matches(PROTO_UNKNOWN, None));
        }
    }
}
