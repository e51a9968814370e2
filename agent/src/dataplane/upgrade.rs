//! Upgrading a running datapath of map layout 2 (`wgf2_*`) to this agent's layout 3 (`wgf3_*`)
//! without losing a packet, and refusing a rollback without a blackhole.
//!
//! What runs is decided by what is attached, not by which pins exist: the pinned tcx link's
//! program, or (legacy TC hook) the program of the agent's clsact filter -> the program's maps
//! -> their names. Only without CAP_SYS_ADMIN (the DaemonSet's case), where the kernel shows no
//! program or map by id, do the peer map pins decide. A datapath whose ingress hook runs
//! layout-2 programs is upgraded in this order ("fill first, then switch"):
//!
//! 1. the v3 maps are created and pinned (by the loader) and both v3 programs loaded;
//! 2. [`Upgrade::fill`] translates the v2 maps into them: peer entries keep their policy, slot
//!    and owner and get no flags, no window and no rule counters (the agent's first apply
//!    writes those); policy entries are copied with every allow credited to rule 0 (the
//!    agent's first apply replaces them with its own compiled, attributed policies through the
//!    usual write-then-switch); packet, per-peer and flow quota counters carried over; owners
//!    one per address, as the planner gives them (a v2 owner two addresses share is replaced by
//!    new ones above the high-water mark), live flows copied with their address's owner; the
//!    config verbatim but for the high-water mark;
//! 3. the switch marker (`wgf3_switch`, the ids of the v3 programs) is pinned, then each hook
//!    gets its v3 program, egress then ingress: one `bpf_link_update` per pinned tcx link, or
//!    one in-place `tc filter replace` per clsact filter (both atomic per packet);
//! 4. [`Upgrade::finish`] copies again what the v2 programs recorded between the fill and the
//!    switch (flows, counter increments), places the tombstones, removes the other v2 pins and
//!    then the marker.
//!
//! An upgrade killed at any step is finished by the next start, also without CAP_SYS_ADMIN:
//! before the switch the hooks run v2 (the upgrade starts again), between the two program
//! switches the egress hook runs a program the marker names (the upgrade resumes with the v3
//! maps it filled), after the switch a hook runs a program the marker names or the tombstone is
//! in place (no upgrade: [`tidy`] finishes step 4). Every start recounts the flow quota from
//! the tables.
//!
//! The tombstones are one-entry arrays pinned as `wgf2_peers_v4` and `wgf1_peers_v4`. An agent
//! of layout 2 sees the v3 programs attached and refuses a newer layout; without CAP_SYS_ADMIN
//! it adopts the pinned `wgf2_peers_v4`, checks its layout before it attaches anything and stops
//! with "pinned map wgf2_peers_v4 has type Array ...". A layout-1 agent stops the same way at
//! `wgf1_peers_v4`. The v3 programs keep enforcing meanwhile; the other pins such a refused
//! agent created are removed by [`tidy`] at the next start.
//!
//! Layout 1 is not upgraded directly: a datapath that still runs it is refused before anything
//! changes, with the advice to run a layout-2 agent (v0.2, commit b4200bd) once first, which
//! upgrades 1 -> 2 without loss; this agent then upgrades 2 -> 3. Two hops each tested under
//! traffic, rather than a chained translation no release ever ran.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    io::ErrorKind,
    net::IpAddr,
    path::Path,
    time::{Duration, Instant},
};

use aya::{
    maps::{
        lpm_trie::Key, Array, HashMap, LpmTrie, Map, MapData, MapError, MapInfo, PerCpuArray,
        PerCpuValues,
    },
    programs::{
        links::{FdLink, PinnedLink},
        loaded_programs,
        tc::TcAttachType,
    },
};
use wgfence_common::{map_names, LAYOUT_VERSION};

use super::{
    error::{DataplaneError, Result},
    tc,
};

/// The map layout 2, as main left it at commit b4200bd: the only layout this agent upgrades
/// from. Private copies, so that a change to the current layout can never change how the old
/// one is read.
pub(crate) mod v2 {
    use bytemuck::{Pod, Zeroable};

    pub const LAYOUT: u32 = 2;
    pub const PEERS_V4: &str = "wgf2_peers_v4";
    pub const PEERS_V6: &str = "wgf2_peers_v6";
    pub const POLICY_V4: &str = "wgf2_policy_v4";
    pub const POLICY_V6: &str = "wgf2_policy_v6";
    pub const STATS: &str = "wgf2_stats";
    pub const PEER_STATS: &str = "wgf2_peer_stats";
    pub const FLOWS_V4: &str = "wgf2_flows_v4";
    pub const FLOWS_V6: &str = "wgf2_flows_v6";
    pub const FLOW_MADE: &str = "wgf2_flow_made";
    pub const FLOW_FREED: &str = "wgf2_flow_freed";
    pub const CONFIG: &str = "wgf2_config";
    /// The maps an upgrade reads: all pinned, unless an upgrade removed some.
    pub const UPGRADED: [&str; 11] = [
        PEERS_V4, PEERS_V6, POLICY_V4, POLICY_V6, STATS, PEER_STATS, FLOWS_V4, FLOWS_V6, FLOW_MADE,
        FLOW_FREED, CONFIG,
    ];
    #[cfg(test)]
    pub const ALL: [&str; 13] = [
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
        "wgf2_events",
        "wgf2_ev_bucket",
    ];
    pub const MAX_ALLOWS: usize = 32;
    pub const COUNTERS_LEN: u32 = 16;

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Pod, Zeroable)]
    pub struct PeerKeyV4 {
        pub addr: [u8; 4],
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Pod, Zeroable)]
    pub struct PeerKeyV6 {
        pub addr: [u8; 16],
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct PeerEntry {
        pub policy: u32,
        pub slot: u32,
        pub owner: u64,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct PolicyKeyV4 {
        pub policy: u32,
        pub addr: [u8; 4],
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct PolicyKeyV6 {
        pub policy: u32,
        pub addr: [u8; 16],
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct Allow {
        pub protocol: u8,
        pub _pad: u8,
        pub port_lo: u16,
        pub port_hi: u16,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
    pub struct PolicyValue {
        pub count: u32,
        pub allows: [Allow; MAX_ALLOWS],
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Pod, Zeroable)]
    pub struct FlowKeyV4 {
        pub peer: [u8; 4],
        pub remote: [u8; 4],
        pub peer_port: u16,
        pub remote_port: u16,
        pub protocol: u8,
        pub _pad: [u8; 3],
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Pod, Zeroable)]
    pub struct FlowKeyV6 {
        pub peer: [u8; 16],
        pub remote: [u8; 16],
        pub peer_port: u16,
        pub remote_port: u16,
        pub protocol: u8,
        pub _pad: [u8; 3],
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct FlowValue {
        pub last_seen_ns: u64,
        pub owner: u64,
        pub state: u32,
        pub slot: u32,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct Config {
        pub flags: u32,
        pub flows_per_peer: u32,
        pub tcp_timeout_ns: u64,
        pub tcp_closing_timeout_ns: u64,
        pub udp_timeout_ns: u64,
        pub icmp_timeout_ns: u64,
        pub unanswered_timeout_ns: u64,
        pub event_interval_ns: u64,
        pub event_burst_ns: u64,
        pub owner_high: u64,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct PeerCounters {
        pub pass_packets: u64,
        pub pass_bytes: u64,
        pub drop_packets: u64,
        pub drop_bytes: u64,
    }

    // SAFETY: #[repr(C)], integers and arrays of integers only, no padding (the `Pod` derives
    // check it).
    unsafe impl aya::Pod for PeerKeyV4 {}
    unsafe impl aya::Pod for PeerKeyV6 {}
    unsafe impl aya::Pod for PeerEntry {}
    unsafe impl aya::Pod for PolicyKeyV4 {}
    unsafe impl aya::Pod for PolicyKeyV6 {}
    unsafe impl aya::Pod for PolicyValue {}
    unsafe impl aya::Pod for FlowKeyV4 {}
    unsafe impl aya::Pod for FlowKeyV6 {}
    unsafe impl aya::Pod for FlowValue {}
    unsafe impl aya::Pod for Config {}
    unsafe impl aya::Pod for PeerCounters {}
}

/// Layout 1 (`wgf1_*`): never upgraded directly (see the module doc); its peer map pin holds a
/// tombstone once a newer layout runs.
pub(crate) mod v1 {
    pub const LAYOUT: u32 = 1;
    pub const PEERS_V4: &str = "wgf1_peers_v4";
    /// Its peer entry: `{ policy: u32, slot: u32 }`.
    pub const PEER_ENTRY_SIZE: usize = 8;
}

/// The pins older agents read first among the peer maps, where the tombstones go: each makes
/// that layout's agent stop before it attaches anything.
pub const TOMBSTONE_PINS: [&str; 2] = [v2::PEERS_V4, v1::PEERS_V4];
/// Kernel name of the tombstones (`bpftool map show` prints it).
const TOMBSTONE_NAME: &str = "wgf3_tombstone";
/// A pin name for a tombstone before it is renamed into place (bpffs refuses dots).
const TOMBSTONE_TMP: &str = "tombstone_new";
/// The switch marker: a two-entry array of the layout-3 program ids (egress, ingress) an
/// upgrade pins before its switch and removes once layout 2 is tidied away. Without
/// CAP_SYS_ADMIN the kernel shows which program a hook runs (its id) but not that program's
/// maps: a hook running one of these ids runs layout 3, whatever layout-2 pins an interrupted
/// upgrade left.
const SWITCH_PIN: &str = "wgf3_switch";
/// A pin name for the switch marker before it is renamed into place.
const SWITCH_TMP: &str = "switch_new";
/// The markers of the layout 1 -> 2 upgrade, removed if an interrupted one left them.
const OLD_LEFTOVERS: [&str; 1] = ["wgf2_switch"];
/// `BPF_MAP_TYPE_ARRAY`.
const MAP_TYPE_ARRAY: u32 = 2;
/// `BPF_NOEXIST`: insert only if the key is absent.
const NOEXIST: u64 = 1;

/// Debug builds only (the integration tests run them): `WGFENCE_FAILPOINT=<name>` aborts the
/// process at the point called `name`, as a SIGKILL there would, so the tests can start from
/// exactly what an interrupted upgrade leaves. Release builds have no failpoints.
pub(crate) fn failpoint(name: &str) {
    if cfg!(debug_assertions) && std::env::var("WGFENCE_FAILPOINT").is_ok_and(|v| v == name) {
        std::process::abort();
    }
}

fn map_err(map: &'static str) -> impl Fn(MapError) -> DataplaneError {
    move |source| DataplaneError::Map { map, source }
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> DataplaneError + '_ {
    move |source| DataplaneError::Io {
        path: path.to_owned(),
        source,
    }
}

/// The layout a map name carries: `wgf<N>_...` -> N.
pub(crate) fn name_layout(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("wgf")?;
    let (digits, _) = rest.split_once('_')?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// What one hook runs: the layout of its program's maps and those maps by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Running {
    /// The pinned tcx link; `None` for a clsact filter.
    pub link_id: Option<u32>,
    pub program_id: u32,
    /// `None`: the program uses no `wgf<N>_` map, or maps of several layouts (not ours).
    pub layout: Option<u32>,
    pub maps: BTreeMap<String, u32>,
    /// The program's name as the kernel has it; `None` when it cannot be looked up.
    pub program: Option<String>,
}

/// What the link pinned at `link_path` runs; `None` if nothing is pinned there.
pub(crate) fn running(link_path: &Path) -> Result<Option<Running>> {
    let link_err = |source| DataplaneError::Link {
        path: link_path.to_owned(),
        source,
    };
    let pinned = match PinnedLink::from_pin(link_path) {
        Ok(pinned) => pinned,
        Err(aya::programs::links::LinkError::SyscallError(e))
            if e.io_error.kind() == ErrorKind::NotFound =>
        {
            return Ok(None)
        }
        Err(e) => return Err(link_err(e)),
    };
    let link = FdLink::from(pinned);
    let info = link.info().map_err(link_err)?;
    let pin_dir = link_path.parent().unwrap_or(link_path);
    running_program(pin_dir, Some(info.id()), info.program_id()).map(Some)
}

/// What one hook of the datapath pinned in `pin_dir` runs: its pinned tcx link's program, else
/// the program of the agent's clsact filter `program` on `ifindex` (legacy TC hook).
pub(crate) fn running_on(
    pin_dir: &Path,
    link_pin: &str,
    ifindex: u32,
    attach_type: TcAttachType,
    program: &str,
) -> Result<Option<Running>> {
    if let Some(running) = running(&pin_dir.join(link_pin))? {
        return Ok(Some(running));
    }
    let place = tc::place(ifindex, attach_type, program).map_err(|source| DataplaneError::Io {
        path: pin_dir.to_owned(),
        source,
    })?;
    match place {
        tc::Place::Ours {
            program_id: Some(id),
        } => running_program(pin_dir, None, id).map(Some),
        _ => Ok(None),
    }
}

/// What program `program_id` (attached through `link_id`, if a link) uses.
fn running_program(pin_dir: &Path, link_id: Option<u32>, program_id: u32) -> Result<Running> {
    let program_err = |source| DataplaneError::Program {
        program: "the attached program",
        source,
    };
    // aya 0.14 has no "program info by id": walk the loaded programs (a few dozen on a node).
    // The attached program is always among them, unless the kernel does not let us see them:
    // walking programs, and opening a program or map by id, need CAP_SYS_ADMIN, which the
    // DaemonSet does not give (CAP_BPF, CAP_PERFMON, CAP_NET_ADMIN). Then the pins tell.
    let Some(info) = loaded_programs()
        .filter_map(|p| p.ok())
        .find(|p| p.id() == program_id)
    else {
        let layout = layout_by_pins(pin_dir, program_id);
        tracing::debug!(
            pin_dir = %pin_dir.display(),
            program_id,
            ?layout,
            "the attached program cannot be looked up (no CAP_SYS_ADMIN): layout read from the \
             pins"
        );
        return Ok(Running {
            link_id,
            program_id,
            layout,
            maps: BTreeMap::new(),
            program: None,
        });
    };
    let mut maps = BTreeMap::new();
    for id in info.map_ids().map_err(program_err)?.unwrap_or_default() {
        // A map freed meanwhile is not one of the program's any more.
        let Ok(map) = MapInfo::from_id(id) else {
            continue;
        };
        if let Some(name) = map.name_as_str() {
            maps.insert(name.to_owned(), id);
        }
    }
    let layouts: BTreeSet<u32> = maps.keys().filter_map(|n| name_layout(n)).collect();
    let layout = match layouts.len() {
        1 => layouts.first().copied(),
        _ => None,
    };
    Ok(Running {
        link_id,
        program_id,
        layout,
        maps,
        program: info.name_as_str().map(str::to_owned),
    })
}

/// Whether the pin at `path` is a hash map with the given key and value sizes (a peer map of
/// some layout, not a tombstone).
fn is_peer_map(path: &Path, key_size: usize, value_size: usize) -> bool {
    MapInfo::from_pin(path).is_ok_and(|info| {
        info.map_type().is_ok_and(|t| t == aya::maps::MapType::Hash)
            && info.key_size() as usize == key_size
            && info.value_size() as usize == value_size
    })
}

/// The layout of the datapath pinned in `pin_dir`, from its pins, for when the attached
/// program (`program_id`) cannot be looked up:
/// - a program the switch marker names is layout 3 (an upgrade switched it, and was
///   interrupted before it tidied layout 2 away);
/// - a complete set of layout-2 map pins, its peer map under its own name, means layout 2
///   (after an upgrade that name holds a tombstone, an array, and a refused layout-2 agent
///   cannot replace it; an incomplete set is what an upgrade interrupted while it removed them
///   leaves, once layout 3 runs);
/// - a layout-1 peer map under its own name, and no newer one, means layout 1;
/// - else a pinned layout-3 peer map means layout 3.
fn layout_by_pins(pin_dir: &Path, program_id: u32) -> Option<u32> {
    use std::mem::size_of;
    if switched_to(pin_dir).contains(&program_id) {
        return Some(LAYOUT_VERSION);
    }
    let v3_peers = MapInfo::from_pin(pin_dir.join(map_names::PEERS_V4)).ok();
    let v2_peers = is_peer_map(
        &pin_dir.join(v2::PEERS_V4),
        size_of::<v2::PeerKeyV4>(),
        size_of::<v2::PeerEntry>(),
    );
    let v2_complete = v2::UPGRADED.iter().all(|name| pin_dir.join(name).exists());
    if v2_peers && (v2_complete || v3_peers.is_none()) {
        return Some(v2::LAYOUT);
    }
    if v3_peers.is_none()
        && !v2_peers
        && is_peer_map(
            &pin_dir.join(v1::PEERS_V4),
            size_of::<v2::PeerKeyV4>(),
            v1::PEER_ENTRY_SIZE,
        )
    {
        return Some(v1::LAYOUT);
    }
    v3_peers.map(|_| LAYOUT_VERSION)
}

/// The program ids the switch marker in `pin_dir` names (none without a marker).
fn switched_to(pin_dir: &Path) -> Vec<u32> {
    let Ok(data) = MapData::from_pin(pin_dir.join(SWITCH_PIN)) else {
        return Vec::new();
    };
    let Ok(array) = Map::from_map_data(data).and_then(Array::<MapData, u32>::try_from) else {
        return Vec::new();
    };
    array.iter().filter_map(|id| id.ok()).collect()
}

/// Pins the switch marker naming `program_ids` (replacing any in one rename).
fn mark_switch(pin_dir: &Path, program_ids: &[u32]) -> Result<()> {
    pin_u32_array(pin_dir, SWITCH_PIN, SWITCH_PIN, SWITCH_TMP, program_ids)
}

/// A new array of `values` named `name` in the kernel, pinned at `pin` in `pin_dir` by way of
/// `tmp` (one rename replaces whatever was pinned at `pin`).
fn pin_u32_array(
    pin_dir: &Path,
    name: &'static str,
    pin: &str,
    tmp: &str,
    values: &[u32],
) -> Result<()> {
    let tmp = pin_dir.join(tmp);
    remove_pin(&tmp)?;
    let len = u32::try_from(values.len()).unwrap_or(u32::MAX);
    let obj = aya_obj::Map::new_from_params(MAP_TYPE_ARRAY, 4, 4, len, 0);
    let data = MapData::create(obj, name, None).map_err(map_err(name))?;
    data.pin(&tmp).map_err(|source| DataplaneError::Pin {
        path: tmp.clone(),
        source,
    })?;
    let mut array: Array<MapData, u32> = Map::from_map_data(data)
        .and_then(Array::try_from)
        .map_err(map_err(name))?;
    for (index, value) in (0u32..).zip(values) {
        array.set(index, value, 0).map_err(map_err(name))?;
    }
    let dst = pin_dir.join(pin);
    fs::rename(&tmp, &dst).map_err(io_err(&dst))
}

/// The layout the datapath pinned in `pin_dir` runs, by its ingress link; `None` when no link
/// is pinned or its program is not a wgfence one.
pub(crate) fn running_layout(pin_dir: &Path) -> Result<Option<u32>> {
    Ok(running(&pin_dir.join(super::LINK_PIN_INGRESS))?.and_then(|r| r.layout))
}

/// Processes other than this one that hold the hook's BPF link (a tcx link) or its program
/// (a clsact filter) open: a running agent holds both. Read from /proc (`anon_inode:bpf_link`
/// or `anon_inode:bpf-prog` fds, `link_id` or `prog_id` in their fdinfo); processes that
/// vanish or cannot be read meanwhile are skipped.
fn holders(running: &Running) -> Vec<u32> {
    let (kind, wanted) = match running.link_id {
        Some(id) => ("anon_inode:bpf_link", format!("link_id:\t{id}")),
        None => (
            "anon_inode:bpf-prog",
            format!("prog_id:\t{}", running.program_id),
        ),
    };
    let me = std::process::id();
    let Ok(procs) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids = Vec::new();
    for entry in procs.filter_map(|e| e.ok()) {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(fds) = fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        let holds = fds.filter_map(|fd| fd.ok()).any(|fd| {
            let is_kind = fs::read_link(fd.path()).is_ok_and(|target| target.as_os_str() == kind);
            is_kind
                && fs::read_to_string(entry.path().join("fdinfo").join(fd.file_name()))
                    .is_ok_and(|info| info.lines().any(|l| l.trim_end() == wanted))
        });
        if holds {
            pids.push(pid);
        }
    }
    pids
}

/// Pins in `pin_dir` whose names carry `layout`.
fn pins_of_layout(pin_dir: &Path, layout: u32) -> Result<Vec<String>> {
    let entries = match fs::read_dir(pin_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(pin_dir)(e)),
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
        .filter(|name| name_layout(name) == Some(layout))
        .collect();
    names.sort();
    Ok(names)
}

fn remove_pin(path: &Path) -> Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io_err(path)(e)),
    }
}

/// The v2 maps an upgrade reads, opened from the ids the running v2 programs use.
struct V2Maps {
    peers_v4: HashMap<MapData, v2::PeerKeyV4, v2::PeerEntry>,
    peers_v6: HashMap<MapData, v2::PeerKeyV6, v2::PeerEntry>,
    policy_v4: LpmTrie<MapData, v2::PolicyKeyV4, v2::PolicyValue>,
    policy_v6: LpmTrie<MapData, v2::PolicyKeyV6, v2::PolicyValue>,
    stats: PerCpuArray<MapData, u64>,
    peer_stats: PerCpuArray<MapData, v2::PeerCounters>,
    flows_v4: HashMap<MapData, v2::FlowKeyV4, v2::FlowValue>,
    flows_v6: HashMap<MapData, v2::FlowKeyV6, v2::FlowValue>,
    flow_made: Array<MapData, u64>,
    flow_freed: Array<MapData, u64>,
    config: Array<MapData, v2::Config>,
}

/// Opens a map by the id a running program uses, else (a map no program references) by its
/// pin. aya checks key and value sizes against the types.
fn typed_old<T: TryFrom<Map, Error = MapError>>(
    name: &'static str,
    ids: &BTreeMap<String, u32>,
    pin_dir: &Path,
) -> Result<T> {
    let data = match ids.get(name) {
        Some(id) => MapData::from_id(*id),
        None => MapData::from_pin(pin_dir.join(name)),
    }
    .map_err(map_err(name))?;
    let map = Map::from_map_data(data).map_err(map_err(name))?;
    T::try_from(map).map_err(map_err(name))
}

impl V2Maps {
    fn open(ids: &BTreeMap<String, u32>, pin_dir: &Path) -> Result<Self> {
        Ok(Self {
            peers_v4: typed_old(v2::PEERS_V4, ids, pin_dir)?,
            peers_v6: typed_old(v2::PEERS_V6, ids, pin_dir)?,
            policy_v4: typed_old(v2::POLICY_V4, ids, pin_dir)?,
            policy_v6: typed_old(v2::POLICY_V6, ids, pin_dir)?,
            stats: typed_old(v2::STATS, ids, pin_dir)?,
            peer_stats: typed_old(v2::PEER_STATS, ids, pin_dir)?,
            flows_v4: typed_old(v2::FLOWS_V4, ids, pin_dir)?,
            flows_v6: typed_old(v2::FLOWS_V6, ids, pin_dir)?,
            flow_made: typed_old(v2::FLOW_MADE, ids, pin_dir)?,
            flow_freed: typed_old(v2::FLOW_FREED, ids, pin_dir)?,
            config: typed_old(v2::CONFIG, ids, pin_dir)?,
        })
    }

    fn config(&self) -> Result<v2::Config> {
        self.config.get(&0, 0).map_err(map_err(v2::CONFIG))
    }

    /// Every peer entry: (address, entry).
    fn peers(&self) -> Result<Vec<(IpAddr, v2::PeerEntry)>> {
        let mut peers = Vec::new();
        for item in self.peers_v4.iter() {
            let (key, entry) = item.map_err(map_err(v2::PEERS_V4))?;
            peers.push((IpAddr::from(key.addr), entry));
        }
        for item in self.peers_v6.iter() {
            let (key, entry) = item.map_err(map_err(v2::PEERS_V6))?;
            peers.push((IpAddr::from(key.addr), entry));
        }
        Ok(peers)
    }

    /// The per-CPU packet counters; the indexes layout 3 has (it kept layout 2's meanings and
    /// added after them).
    fn stats(&self) -> Result<Vec<Vec<u64>>> {
        (0..v2::COUNTERS_LEN.min(wgfence_common::COUNTERS_LEN))
            .map(|i| {
                self.stats
                    .get(&i, 0)
                    .map(|values| values.to_vec())
                    .map_err(map_err(v2::STATS))
            })
            .collect()
    }

    /// Each slot's per-CPU counters.
    fn peer_stats(&self, slots: &BTreeSet<u32>) -> Result<BTreeMap<u32, Vec<v2::PeerCounters>>> {
        slots
            .iter()
            .map(|slot| {
                self.peer_stats
                    .get(slot, 0)
                    .map(|c| (*slot, c.to_vec()))
                    .map_err(map_err(v2::PEER_STATS))
            })
            .collect()
    }

    /// Each slot's (made, freed) flow quota counts.
    fn quota(&self, slots: &BTreeSet<u32>) -> Result<BTreeMap<u32, (u64, u64)>> {
        slots
            .iter()
            .map(|slot| {
                let made = self
                    .flow_made
                    .get(slot, 0)
                    .map_err(map_err(v2::FLOW_MADE))?;
                let freed = self
                    .flow_freed
                    .get(slot, 0)
                    .map_err(map_err(v2::FLOW_FREED))?;
                Ok((*slot, (made, freed)))
            })
            .collect()
    }

    fn flows(&self) -> Result<Vec<(FlowKey, wgfence_common::FlowValue)>> {
        let value = |v: v2::FlowValue| wgfence_common::FlowValue {
            last_seen_ns: v.last_seen_ns,
            owner: v.owner,
            state: v.state,
            slot: v.slot,
        };
        let mut flows = Vec::new();
        for item in self.flows_v4.iter() {
            let (k, v) = item.map_err(map_err(v2::FLOWS_V4))?;
            let key = wgfence_common::FlowKeyV4 {
                peer: k.peer,
                remote: k.remote,
                peer_port: k.peer_port,
                remote_port: k.remote_port,
                protocol: k.protocol,
                _pad: [0; 3],
            };
            flows.push((FlowKey::V4(key), value(v)));
        }
        for item in self.flows_v6.iter() {
            let (k, v) = item.map_err(map_err(v2::FLOWS_V6))?;
            let key = wgfence_common::FlowKeyV6 {
                peer: k.peer,
                remote: k.remote,
                peer_port: k.peer_port,
                remote_port: k.remote_port,
                protocol: k.protocol,
                _pad: [0; 3],
            };
            flows.push((FlowKey::V6(key), value(v)));
        }
        Ok(flows)
    }
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum FlowKey {
    V4(wgfence_common::FlowKeyV4),
    V6(wgfence_common::FlowKeyV6),
}

/// The v3 maps an upgrade writes, opened from their pins (the loader just created them).
struct V3Maps {
    peers_v4: HashMap<MapData, wgfence_common::PeerKeyV4, wgfence_common::PeerEntry>,
    peers_v6: HashMap<MapData, wgfence_common::PeerKeyV6, wgfence_common::PeerEntry>,
    policy_v4: LpmTrie<MapData, wgfence_common::PolicyKeyV4, wgfence_common::PolicyValue>,
    policy_v6: LpmTrie<MapData, wgfence_common::PolicyKeyV6, wgfence_common::PolicyValue>,
    stats: PerCpuArray<MapData, u64>,
    peer_stats: PerCpuArray<MapData, wgfence_common::PeerCounters>,
    flows_v4: HashMap<MapData, wgfence_common::FlowKeyV4, wgfence_common::FlowValue>,
    flows_v6: HashMap<MapData, wgfence_common::FlowKeyV6, wgfence_common::FlowValue>,
    flow_made: Array<MapData, u64>,
    flow_freed: Array<MapData, u64>,
    config: Array<MapData, wgfence_common::Config>,
}

impl V3Maps {
    fn open(pin_dir: &Path) -> Result<Self> {
        fn typed<T: TryFrom<Map, Error = MapError>>(name: &'static str, dir: &Path) -> Result<T> {
            let data = MapData::from_pin(dir.join(name)).map_err(map_err(name))?;
            let info = data.info().map_err(map_err(name))?;
            super::layout::check(name, &info)?;
            let map = Map::from_map_data(data).map_err(map_err(name))?;
            T::try_from(map).map_err(map_err(name))
        }
        Ok(Self {
            peers_v4: typed(map_names::PEERS_V4, pin_dir)?,
            peers_v6: typed(map_names::PEERS_V6, pin_dir)?,
            policy_v4: typed(map_names::POLICY_V4, pin_dir)?,
            policy_v6: typed(map_names::POLICY_V6, pin_dir)?,
            stats: typed(map_names::STATS, pin_dir)?,
            peer_stats: typed(map_names::PEER_STATS, pin_dir)?,
            flows_v4: typed(map_names::FLOWS_V4, pin_dir)?,
            flows_v6: typed(map_names::FLOWS_V6, pin_dir)?,
            flow_made: typed(map_names::FLOW_MADE, pin_dir)?,
            flow_freed: typed(map_names::FLOW_FREED, pin_dir)?,
            config: typed(map_names::CONFIG, pin_dir)?,
        })
    }

    fn upsert_peer(&mut self, addr: IpAddr, entry: wgfence_common::PeerEntry) -> Result<()> {
        match addr {
            IpAddr::V4(a) => self
                .peers_v4
                .insert(wgfence_common::PeerKeyV4 { addr: a.octets() }, entry, 0)
                .map_err(map_err(map_names::PEERS_V4)),
            IpAddr::V6(a) => self
                .peers_v6
                .insert(wgfence_common::PeerKeyV6 { addr: a.octets() }, entry, 0)
                .map_err(map_err(map_names::PEERS_V6)),
        }
    }

    /// Every peer entry the v3 maps hold (a resumed upgrade's first fill wrote them).
    fn peers(&self) -> Result<BTreeMap<IpAddr, wgfence_common::PeerEntry>> {
        let mut peers = BTreeMap::new();
        for item in self.peers_v4.iter() {
            let (key, entry) = item.map_err(map_err(map_names::PEERS_V4))?;
            peers.insert(IpAddr::from(key.addr), entry);
        }
        for item in self.peers_v6.iter() {
            let (key, entry) = item.map_err(map_err(map_names::PEERS_V6))?;
            peers.insert(IpAddr::from(key.addr), entry);
        }
        Ok(peers)
    }

    fn remove_peer(&mut self, addr: IpAddr) -> Result<()> {
        match addr {
            IpAddr::V4(a) => self
                .peers_v4
                .remove(&wgfence_common::PeerKeyV4 { addr: a.octets() })
                .map_err(map_err(map_names::PEERS_V4)),
            IpAddr::V6(a) => self
                .peers_v6
                .remove(&wgfence_common::PeerKeyV6 { addr: a.octets() })
                .map_err(map_err(map_names::PEERS_V6)),
        }
    }

    /// Copies the v2 flows into the v3 tables. `late`: after the switch, only flows the v3
    /// tables do not have (the v3 programs may have recorded or refreshed them meanwhile); a
    /// v3 flow older than its v2 copy gets the v2 timestamp. Returns how many were copied.
    fn copy_flows(
        &mut self,
        flows: &[(FlowKey, wgfence_common::FlowValue)],
        late: bool,
    ) -> Result<u64> {
        let mut copied = 0;
        for (key, value) in flows {
            let inserted = match key {
                FlowKey::V4(k) => {
                    insert_flow(&mut self.flows_v4, map_names::FLOWS_V4, *k, *value, late)?
                }
                FlowKey::V6(k) => {
                    insert_flow(&mut self.flows_v6, map_names::FLOWS_V6, *k, *value, late)?
                }
            };
            copied += u64::from(inserted);
        }
        Ok(copied)
    }
}

fn policy_value(v: &v2::PolicyValue) -> wgfence_common::PolicyValue {
    wgfence_common::PolicyValue {
        count: v.count,
        allows: v
            .allows
            .map(|a| wgfence_common::Allow::new(a.protocol, a.port_lo, a.port_hi)),
    }
}

fn peer_counters(c: &v2::PeerCounters) -> wgfence_common::PeerCounters {
    wgfence_common::PeerCounters {
        pass_packets: c.pass_packets,
        pass_bytes: c.pass_bytes,
        drop_packets: c.drop_packets,
        drop_bytes: c.drop_bytes,
        ..wgfence_common::PeerCounters::default()
    }
}

fn per_cpu_values<T: aya::Pod>(map: &'static str, values: Vec<T>) -> Result<PerCpuValues<T>> {
    PerCpuValues::try_from(values).map_err(|e| DataplaneError::Map {
        map,
        source: MapError::IoError(e),
    })
}

/// What an upgrade carried over, for the log and the tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UpgradeReport {
    pub from_layout: u32,
    pub peer_entries: usize,
    /// Distinct owners of the peer entries carried over.
    pub owners: u64,
    pub policy_entries: usize,
    pub flows: u64,
    /// Flows the v2 programs recorded between the fill and the switch, copied after it.
    pub flows_late: u64,
    /// From the first program switch to the last.
    pub switch: Duration,
    /// From the first read of the v2 maps to the removal of their pins.
    pub total: Duration,
}

/// An upgrade from layout 2 in progress: found by [`Upgrade::prepare`] before the v3 maps
/// are loaded, [`Upgrade::fill`]ed before the switch, [`Upgrade::finish`]ed after it.
pub(crate) struct Upgrade {
    v2: V2Maps,
    /// The v3 maps were created by this start: counters are carried. `false` after an
    /// upgrade interrupted between its two program switches, whose fill already carried them.
    fresh: bool,
    started: Instant,
    /// The v2 counters as the fill read them: the switch adds what the v2 programs counted
    /// after that.
    stats: Vec<Vec<u64>>,
    peer_stats: BTreeMap<u32, Vec<v2::PeerCounters>>,
    /// Each peer entry's owner: (in layout 2, in layout 3).
    owners: BTreeMap<IpAddr, (u64, u64)>,
    report: UpgradeReport,
}

impl Upgrade {
    /// Looks at what the hooks run (`ingress`, `egress`). Layout 2 on ingress: an upgrade,
    /// whose v2 maps are opened here; stale v3 pins of an upgrade interrupted before its switch
    /// are removed (no program uses them), so the loader creates the v3 maps empty. A layout
    /// newer than this agent's, or layout 1, is refused before anything is touched. Anything
    /// else: no upgrade.
    pub(crate) fn prepare(
        pin_dir: &Path,
        ingress: Option<Running>,
        egress: Option<Running>,
    ) -> Result<Option<Self>> {
        for r in [&ingress, &egress].into_iter().flatten() {
            match r.layout {
                Some(layout) if layout > LAYOUT_VERSION => {
                    return Err(DataplaneError::NewerLayout {
                        running: layout,
                        this: LAYOUT_VERSION,
                    })
                }
                Some(v1::LAYOUT) => {
                    return Err(DataplaneError::UpgradeThroughLayout2 {
                        pin_dir: pin_dir.to_owned(),
                    })
                }
                _ => {}
            }
        }
        let Some(ingress) = ingress.filter(|r| r.layout == Some(v2::LAYOUT)) else {
            return Ok(None);
        };
        let egress_v3 = egress
            .as_ref()
            .is_some_and(|r| r.layout == Some(LAYOUT_VERSION));
        let mut ids = ingress.maps.clone();
        if let Some(egress) = egress.filter(|r| r.layout == Some(v2::LAYOUT)) {
            for (name, id) in egress.maps {
                ids.entry(name).or_insert(id);
            }
        }
        // The layout-2 agent must be stopped first (a DaemonSet rollout with maxSurge 0 does):
        // running, it would find its programs replaced and attach them again.
        let pids = holders(&ingress);
        if !pids.is_empty() {
            return Err(DataplaneError::OldAgentRunning {
                layout: v2::LAYOUT,
                pids,
            });
        }
        let started = Instant::now();
        let v2 = V2Maps::open(&ids, pin_dir)?;
        if !egress_v3 {
            for name in pins_of_layout(pin_dir, LAYOUT_VERSION)? {
                remove_pin(&pin_dir.join(&name))?;
            }
        }
        tracing::info!(
            pin_dir = %pin_dir.display(),
            from = v2::LAYOUT,
            to = LAYOUT_VERSION,
            ingress_program = ingress.program_id,
            resumed = egress_v3,
            "the datapath runs map layout 2: upgrading it (fill the new maps, then switch the \
             programs)"
        );
        Ok(Some(Self {
            v2,
            fresh: !egress_v3,
            started,
            stats: Vec::new(),
            peer_stats: BTreeMap::new(),
            owners: BTreeMap::new(),
            report: UpgradeReport {
                from_layout: v2::LAYOUT,
                ..UpgradeReport::default()
            },
        }))
    }

    /// Translates the v2 maps into the (loaded, not yet attached) v3 maps pinned in `pin_dir`.
    /// The v2 programs keep enforcing meanwhile; an error leaves them so.
    pub(crate) fn fill(&mut self, pin_dir: &Path) -> Result<()> {
        let mut v3 = V3Maps::open(pin_dir)?;
        let config = self.v2.config()?;
        let peers = self.v2.peers()?;

        // Owners: one per address, as the planner gives them (a flow counts only for the entry
        // of its own address). A v2 owner no other address holds is kept; a shared one (a 1 -> 2
        // upgrade before commit ba35d1d gave a peer's addresses one owner per slot) is replaced
        // by a new one above the high-water mark, and its flows follow their address. A resumed
        // upgrade keeps what its first fill wrote for the same slot.
        let existing = v3.peers()?;
        let mut high = config.owner_high;
        if !self.fresh {
            if let Ok(v3_config) = v3.config.get(&0, 0) {
                high = high.max(v3_config.owner_high);
            }
        }
        let (owners, high) = owners_per_address(&peers, &existing, high);
        self.owners = owners;
        fill_config(&mut v3, &config, high)?;
        let keep = self.fill_policies(&mut v3)?;
        self.fill_peers(&mut v3, &peers, &existing, &keep)?;
        let slots: BTreeSet<u32> = peers.iter().map(|(_, e)| e.slot).collect();
        if self.fresh {
            self.fill_counters(&mut v3, &slots)?;
        }

        // Flows last, closest to the switch.
        let flows = self.reowned(self.v2.flows()?);
        v3.copy_flows(&flows, false)?;
        self.report.flows = flows.len() as u64;
        Ok(())
    }

    /// Policy tries, every allow credited to rule 0; entries of no v2 policy go (a resumed
    /// upgrade only, after the peers). The IPv4 and IPv6 keys to keep.
    fn fill_policies(&mut self, v3: &mut V3Maps) -> Result<(TrieKeys, TrieKeys)> {
        let keep_v4 = copy_trie(
            (&self.v2.policy_v4, v2::POLICY_V4),
            (&mut v3.policy_v4, map_names::POLICY_V4),
            |k| wgfence_common::PolicyKeyV4 {
                policy: k.policy,
                addr: k.addr,
            },
        )?;
        let keep_v6 = copy_trie(
            (&self.v2.policy_v6, v2::POLICY_V6),
            (&mut v3.policy_v6, map_names::POLICY_V6),
            |k| wgfence_common::PolicyKeyV6 {
                policy: k.policy,
                addr: k.addr,
            },
        )?;
        self.report.policy_entries = keep_v4.len() + keep_v6.len();
        Ok((keep_v4, keep_v6))
    }

    /// Peer entries, after the policies they reference; entries of no v2 peer go, then the
    /// trie entries of no v2 policy.
    fn fill_peers(
        &mut self,
        v3: &mut V3Maps,
        peers: &[(IpAddr, v2::PeerEntry)],
        existing: &BTreeMap<IpAddr, wgfence_common::PeerEntry>,
        (keep_v4, keep_v6): &(TrieKeys, TrieKeys),
    ) -> Result<()> {
        for (addr, entry) in peers {
            let owner = self
                .owners
                .get(addr)
                .map_or(entry.owner, |(_, owner)| *owner);
            v3.upsert_peer(
                *addr,
                wgfence_common::PeerEntry {
                    policy: entry.policy,
                    slot: entry.slot,
                    owner,
                    ..wgfence_common::PeerEntry::default()
                },
            )?;
        }
        let wanted: BTreeSet<IpAddr> = peers.iter().map(|(a, _)| *a).collect();
        for addr in existing.keys() {
            if !wanted.contains(addr) {
                v3.remove_peer(*addr)?;
            }
        }
        remove_other_entries(&mut v3.policy_v4, map_names::POLICY_V4, keep_v4)?;
        remove_other_entries(&mut v3.policy_v6, map_names::POLICY_V6, keep_v6)?;
        self.report.peer_entries = peers.len();
        self.report.owners = self
            .owners
            .values()
            .map(|(_, owner)| *owner)
            .collect::<BTreeSet<_>>()
            .len() as u64;
        Ok(())
    }

    /// Counters: the v2 values now; what the v2 programs count until the switch is added
    /// after it. Both layouts count per CPU: each CPU's copy goes to the same CPU's.
    fn fill_counters(&mut self, v3: &mut V3Maps, slots: &BTreeSet<u32>) -> Result<()> {
        self.stats = self.v2.stats()?;
        for (index, values) in (0u32..).zip(&self.stats) {
            let values = per_cpu_values(map_names::STATS, values.clone())?;
            v3.stats
                .set(index, values, 0)
                .map_err(map_err(map_names::STATS))?;
        }
        self.peer_stats = self.v2.peer_stats(slots)?;
        for (slot, per_cpu) in &self.peer_stats {
            let values = per_cpu_values(
                map_names::PEER_STATS,
                per_cpu.iter().map(peer_counters).collect(),
            )?;
            v3.peer_stats
                .set(*slot, values, 0)
                .map_err(map_err(map_names::PEER_STATS))?;
        }
        // The flow quota as it stands (the attach recounts it from the tables anyway).
        for (slot, (made, freed)) in self.v2.quota(slots)? {
            v3.flow_made
                .set(slot, made, 0)
                .map_err(map_err(map_names::FLOW_MADE))?;
            v3.flow_freed
                .set(slot, freed, 0)
                .map_err(map_err(map_names::FLOW_FREED))?;
        }
        Ok(())
    }

    /// The v2 flows with the layout-3 owner of their address: a flow the v2 tables credit to
    /// its address's v2 owner goes to that address's v3 owner; any other (a stale flow of an
    /// address's previous holder) keeps its owner, which no v3 entry holds.
    fn reowned(
        &self,
        mut flows: Vec<(FlowKey, wgfence_common::FlowValue)>,
    ) -> Vec<(FlowKey, wgfence_common::FlowValue)> {
        for (key, value) in &mut flows {
            let peer = match key {
                FlowKey::V4(k) => IpAddr::from(k.peer),
                FlowKey::V6(k) => IpAddr::from(k.peer),
            };
            if let Some((old, new)) = self.owners.get(&peer) {
                if value.owner == *old {
                    value.owner = *new;
                }
            }
        }
        flows
    }

    /// Pins the switch marker naming the loaded layout-3 programs: from here on, a hook that
    /// runs one of them runs layout 3, also for an agent that cannot look programs up.
    pub(crate) fn mark_switch(&self, pin_dir: &Path, program_ids: &[u32]) -> Result<()> {
        mark_switch(pin_dir, program_ids)
    }

    /// After both hooks run the v3 programs: copies what the v2 programs recorded since the
    /// fill, adds what they counted since, removes the v2 pins and leaves the tombstones.
    /// `switch` is how long the program switches took.
    pub(crate) fn finish(mut self, pin_dir: &Path, switch: Duration) -> Result<UpgradeReport> {
        let mut v3 = V3Maps::open(pin_dir)?;
        let flows = self.reowned(self.v2.flows()?);
        self.report.flows_late = v3.copy_flows(&flows, true)?;
        if self.fresh {
            // Racing the v3 programs' own increments between one read and one write per
            // counter: at worst a handful of packets go uncounted, never miscounted as
            // another verdict.
            let stats = self.v2.stats()?;
            for ((index, now), before) in (0u32..).zip(&stats).zip(&self.stats) {
                if now == before {
                    continue;
                }
                let current = v3.stats.get(&index, 0).map_err(map_err(map_names::STATS))?;
                let values: Vec<u64> = current
                    .iter()
                    .zip(now.iter().zip(before))
                    .map(|(c, (n, b))| c.saturating_add(n.saturating_sub(*b)))
                    .collect();
                v3.stats
                    .set(index, per_cpu_values(map_names::STATS, values)?, 0)
                    .map_err(map_err(map_names::STATS))?;
            }
            let slots: BTreeSet<u32> = self.peer_stats.keys().copied().collect();
            for (slot, now) in self.v2.peer_stats(&slots)? {
                let Some(before) = self.peer_stats.get(&slot) else {
                    continue;
                };
                if now == *before {
                    continue;
                }
                let current = v3
                    .peer_stats
                    .get(&slot, 0)
                    .map_err(map_err(map_names::PEER_STATS))?;
                let add = |c: u64, n: u64, b: u64| c.saturating_add(n.saturating_sub(b));
                let values: Vec<wgfence_common::PeerCounters> = current
                    .iter()
                    .zip(now.iter().zip(before))
                    .map(|(c, (n, b))| wgfence_common::PeerCounters {
                        pass_packets: add(c.pass_packets, n.pass_packets, b.pass_packets),
                        pass_bytes: add(c.pass_bytes, n.pass_bytes, b.pass_bytes),
                        drop_packets: add(c.drop_packets, n.drop_packets, b.drop_packets),
                        drop_bytes: add(c.drop_bytes, n.drop_bytes, b.drop_bytes),
                        ..*c
                    })
                    .collect();
                v3.peer_stats
                    .set(slot, per_cpu_values(map_names::PEER_STATS, values)?, 0)
                    .map_err(map_err(map_names::PEER_STATS))?;
            }
        }
        // The v2 maps go with their pins (and this agent's fds, dropped with `self`), the
        // tombstones first.
        retire_old_layouts(pin_dir)?;
        self.report.switch = switch;
        self.report.total = self.started.elapsed();
        let r = &self.report;
        tracing::info!(
            pin_dir = %pin_dir.display(),
            from = r.from_layout,
            to = LAYOUT_VERSION,
            peer_entries = r.peer_entries,
            owners = r.owners,
            policy_entries = r.policy_entries,
            flows = r.flows,
            flows_late = r.flows_late,
            switch_us = r.switch.as_micros() as u64,
            total_ms = r.total.as_millis() as u64,
            "upgraded the datapath from map layout 2 to 3; the layout-2 maps are removed"
        );
        Ok(self.report)
    }
}

/// The trie entries to keep, by policy id and key bytes.
type TrieKeys = BTreeSet<(u32, Vec<u8>)>;

/// The config first (nothing runs on these maps yet), verbatim but for the high-water mark
/// (`high`), which covers every owner written after it.
fn fill_config(v3: &mut V3Maps, config: &v2::Config, high: u64) -> Result<()> {
    let v3_config = wgfence_common::Config {
        flags: config.flags,
        flows_per_peer: config.flows_per_peer,
        tcp_timeout_ns: config.tcp_timeout_ns,
        tcp_closing_timeout_ns: config.tcp_closing_timeout_ns,
        udp_timeout_ns: config.udp_timeout_ns,
        icmp_timeout_ns: config.icmp_timeout_ns,
        unanswered_timeout_ns: config.unanswered_timeout_ns,
        event_interval_ns: config.event_interval_ns,
        event_burst_ns: config.event_burst_ns,
        owner_high: high,
    };
    v3.config
        .set(0, v3_config, 0)
        .map_err(map_err(map_names::CONFIG))
}

/// Each v2 peer entry's owner in layout 3, one per address: kept if the v3 maps already hold
/// the address with the same slot (`existing`, a resumed upgrade), else the v2 owner if no
/// other address holds it, else a new one above `high`. Returns (address -> (v2 owner, v3
/// owner), the new high-water mark).
fn owners_per_address(
    peers: &[(IpAddr, v2::PeerEntry)],
    existing: &BTreeMap<IpAddr, wgfence_common::PeerEntry>,
    mut high: u64,
) -> (BTreeMap<IpAddr, (u64, u64)>, u64) {
    let mut holders: BTreeMap<u64, usize> = BTreeMap::new();
    for (_, entry) in peers {
        *holders.entry(entry.owner).or_default() += 1;
    }
    let mut owners = BTreeMap::new();
    for (addr, entry) in peers {
        let owner = match existing.get(addr) {
            Some(have) if have.owner != 0 && have.slot == entry.slot => have.owner,
            _ if entry.owner != 0 && holders.get(&entry.owner) == Some(&1) => entry.owner,
            _ => {
                high += 1;
                high
            }
        };
        owners.insert(*addr, (entry.owner, owner));
    }
    (owners, high)
}

/// Copies a layout-2 policy trie into its layout-3 twin, entry for entry; returns the keys
/// written (prefix length and key bytes).
fn copy_trie<A: aya::Pod, B: aya::Pod + bytemuck::Pod>(
    (from, from_name): (&LpmTrie<MapData, A, v2::PolicyValue>, &'static str),
    (to, to_name): (
        &mut LpmTrie<MapData, B, wgfence_common::PolicyValue>,
        &'static str,
    ),
    convert: impl Fn(&A) -> B,
) -> Result<BTreeSet<(u32, Vec<u8>)>> {
    let mut written = BTreeSet::new();
    for item in from.iter() {
        let (key, value) = item.map_err(map_err(from_name))?;
        let data = convert(&key.data());
        to.insert(&Key::new(key.prefix_len(), data), policy_value(&value), 0)
            .map_err(map_err(to_name))?;
        written.insert((key.prefix_len(), bytemuck::bytes_of(&data).to_vec()));
    }
    Ok(written)
}

/// Removes the entries of a layout-3 trie that are not in `keep`.
fn remove_other_entries<B: aya::Pod + bytemuck::Pod>(
    trie: &mut LpmTrie<MapData, B, wgfence_common::PolicyValue>,
    name: &'static str,
    keep: &BTreeSet<(u32, Vec<u8>)>,
) -> Result<()> {
    let other: Vec<Key<B>> = trie
        .keys()
        .filter_map(|k| k.ok())
        .filter(|k| !keep.contains(&(k.prefix_len(), bytemuck::bytes_of(&k.data()).to_vec())))
        .collect();
    for key in other {
        trie.remove(&key).map_err(map_err(name))?;
    }
    Ok(())
}

fn insert_flow<K: aya::Pod>(
    map: &mut HashMap<MapData, K, wgfence_common::FlowValue>,
    name: &'static str,
    key: K,
    value: wgfence_common::FlowValue,
    late: bool,
) -> Result<bool> {
    if !late {
        // Counted only if new: a resumed upgrade finds the flows its first fill copied.
        return match map.insert(key, value, NOEXIST) {
            Ok(()) => Ok(true),
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {
                map.insert(key, value, 0).map_err(map_err(name))?;
                Ok(false)
            }
            Err(e) => Err(map_err(name)(e)),
        };
    }
    match map.get(&key, 0) {
        Ok(have) => {
            // The v2 programs have it: the v1 programs' view wins if they saw it later.
            if have.owner == value.owner && have.last_seen_ns < value.last_seen_ns {
                let newer = wgfence_common::FlowValue {
                    last_seen_ns: value.last_seen_ns,
                    state: value.state,
                    ..have
                };
                map.insert(key, newer, 0).map_err(map_err(name))?;
            }
            Ok(false)
        }
        Err(MapError::KeyNotFound) => match map.insert(key, value, NOEXIST) {
            Ok(()) => Ok(true),
            // Recorded by the v2 programs meanwhile: theirs stands.
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {
                Ok(false)
            }
            Err(e) => Err(map_err(name)(e)),
        },
        Err(e) => Err(map_err(name)(e)),
    }
}

/// Pins a tombstone at `pin` (replacing whatever is there in one rename): a one-entry array
/// holding this agent's layout version, which an agent of an older layout refuses.
fn place_tombstone(pin_dir: &Path, pin: &str) -> Result<()> {
    pin_u32_array(
        pin_dir,
        TOMBSTONE_NAME,
        pin,
        TOMBSTONE_TMP,
        &[LAYOUT_VERSION],
    )
}

/// Places each tombstone whose pin is missing (removed under a running agent); the names of
/// those placed. One that is there is left as it is: [`tidy`] checks what it is at each start.
pub(crate) fn restore_tombstones(pin_dir: &Path) -> Result<Vec<&'static str>> {
    let mut placed = Vec::new();
    for pin in TOMBSTONE_PINS {
        if !pin_dir.join(pin).exists() {
            place_tombstone(pin_dir, pin)?;
            placed.push(pin);
        }
    }
    Ok(placed)
}

/// Whether the pin at `path` is a tombstone (this agent's, or the one a layout-2 agent placed
/// at layout 1's peer map: an array either way, which no older agent accepts).
fn is_tombstone(path: &Path) -> bool {
    MapInfo::from_pin(path).is_ok_and(|info| {
        info.name_as_str()
            .is_some_and(|name| name.ends_with("_tombstone"))
            && info
                .map_type()
                .is_ok_and(|t| t == aya::maps::MapType::Array)
    })
}

/// After the programs are attached (they run this agent's layout): removes the pins of
/// layouts 1 and 2 that remain (maps a refused older agent created, or an upgrade interrupted
/// after its switch left) and makes sure the tombstones are in place. Returns the names of the
/// pins removed.
pub(crate) fn tidy(pin_dir: &Path) -> Result<Vec<String>> {
    let removed = retire_old_layouts(pin_dir)?;
    if !removed.is_empty() {
        tracing::warn!(
            pin_dir = %pin_dir.display(),
            ?removed,
            "removed map pins of older layouts that the running datapath does not use (left \
             by an older agent that was refused, or by an interrupted upgrade)"
        );
    }
    Ok(removed)
}

/// Once layout 3 runs: the tombstones first (from then on the pins say layout 3 even without
/// the switch marker), then every other pin of layouts 1 and 2, then the switch markers. Each
/// step is idempotent, so an interrupted run is finished by the next one (at the next start's
/// [`tidy`]). Returns the names of the old pins removed.
fn retire_old_layouts(pin_dir: &Path) -> Result<Vec<String>> {
    for pin in TOMBSTONE_PINS {
        if !is_tombstone(&pin_dir.join(pin)) {
            place_tombstone(pin_dir, pin)?;
        }
    }
    let mut removed = Vec::new();
    for layout in [v2::LAYOUT, v1::LAYOUT] {
        for name in pins_of_layout(pin_dir, layout)? {
            if !TOMBSTONE_PINS.contains(&name.as_str())
                && !OLD_LEFTOVERS.contains(&name.as_str())
                && remove_pin(&pin_dir.join(&name))?
            {
                removed.push(name);
                failpoint("upgrade-unpinning");
            }
        }
    }
    for leftover in [TOMBSTONE_TMP, SWITCH_TMP, SWITCH_PIN]
        .into_iter()
        .chain(OLD_LEFTOVERS)
    {
        remove_pin(&pin_dir.join(leftover))?;
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_names_give_their_layout() {
        assert_eq!(name_layout("wgf1_peers_v4"), Some(1));
        assert_eq!(name_layout("wgf2_flow_made"), Some(2));
        assert_eq!(name_layout("wgf12_x"), Some(12));
        assert_eq!(name_layout("wgf_x"), None);
        assert_eq!(name_layout("wgfx_x"), None);
        assert_eq!(name_layout("link_ingress"), None);
        assert_eq!(name_layout(".rodata"), None);
        for name in v2::ALL {
            assert_eq!(name_layout(name), Some(2), "{name}");
        }
        for name in map_names::ALL {
            assert_eq!(name_layout(name), Some(LAYOUT_VERSION), "{name}");
        }
        assert_eq!(name_layout(TOMBSTONE_NAME), Some(LAYOUT_VERSION));
        assert_eq!(name_layout(SWITCH_PIN), Some(LAYOUT_VERSION));
        assert_eq!(name_layout(v1::PEERS_V4), Some(v1::LAYOUT));
    }

    #[test]
    fn v2_types_keep_their_v2_sizes() {
        use core::mem::size_of;
        assert_eq!(size_of::<v2::PeerKeyV4>(), 4);
        assert_eq!(size_of::<v2::PeerKeyV6>(), 16);
        assert_eq!(size_of::<v2::PeerEntry>(), 16);
        assert_eq!(size_of::<v2::PolicyKeyV4>(), 8);
        assert_eq!(size_of::<v2::PolicyKeyV6>(), 20);
        assert_eq!(size_of::<v2::PolicyValue>(), 4 + 6 * v2::MAX_ALLOWS);
        assert_eq!(size_of::<v2::PeerCounters>(), 32);
        assert_eq!(size_of::<v2::FlowKeyV4>(), 16);
        assert_eq!(size_of::<v2::FlowKeyV6>(), 40);
        assert_eq!(size_of::<v2::FlowValue>(), 24);
        assert_eq!(size_of::<v2::Config>(), 72);
    }

    #[test]
    fn policy_values_keep_their_allows_credited_to_rule_0() {
        let mut v = v2::PolicyValue {
            count: 2,
            allows: [v2::Allow::default(); v2::MAX_ALLOWS],
        };
        v.allows[0] = v2::Allow {
            protocol: 6,
            _pad: 0,
            port_lo: 443,
            port_hi: 443,
        };
        v.allows[1] = v2::Allow {
            protocol: 0,
            _pad: 0,
            port_lo: 0,
            port_hi: u16::MAX,
        };
        let w = policy_value(&v);
        assert_eq!(w.count, 2);
        assert_eq!(w.allows[0], wgfence_common::Allow::new(6, 443, 443));
        assert_eq!(w.allows[1], wgfence_common::Allow::new(0, 0, u16::MAX));
        assert!(w.allows.iter().all(|a| a.rule == 0));
    }

    #[test]
    fn owners_become_one_per_address() {
        let a = |s: &str| s.parse::<IpAddr>().unwrap_or(IpAddr::from([0, 0, 0, 0]));
        let entry = |slot, owner| v2::PeerEntry {
            policy: 1,
            slot,
            owner,
        };
        // alice's two addresses share owner 7 (a 1 -> 2 upgrade before ba35d1d); bob's is his.
        let peers = [
            (a("10.8.0.2"), entry(0, 7)),
            (a("fd00:8::2"), entry(0, 7)),
            (a("10.8.0.3"), entry(1, 9)),
        ];
        let (owners, high) = owners_per_address(&peers, &BTreeMap::new(), 9);
        assert_eq!(owners[&a("10.8.0.3")], (9, 9), "a sole owner is kept");
        assert_eq!(owners[&a("10.8.0.2")], (7, 10));
        assert_eq!(owners[&a("fd00:8::2")], (7, 11));
        assert_eq!(high, 11);

        // Resumed: what the first fill wrote for the same slot stays; another slot's does not.
        let existing = BTreeMap::from([
            (
                a("10.8.0.2"),
                wgfence_common::PeerEntry {
                    slot: 0,
                    owner: 10,
                    ..wgfence_common::PeerEntry::default()
                },
            ),
            (
                a("fd00:8::2"),
                wgfence_common::PeerEntry {
                    slot: 5,
                    owner: 11,
                    ..wgfence_common::PeerEntry::default()
                },
            ),
        ]);
        let (owners, high) = owners_per_address(&peers, &existing, 11);
        assert_eq!(owners[&a("10.8.0.2")], (7, 10));
        assert_eq!(owners[&a("fd00:8::2")], (7, 12));
        assert_eq!(high, 12);
        let distinct: BTreeSet<u64> = owners.values().map(|(_, o)| *o).collect();
        assert_eq!(distinct.len(), owners.len());
    }
}
