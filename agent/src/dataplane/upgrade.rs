//! Upgrading a running datapath of map layout 1 (`wgf1_*`) to this agent's layout 2 (`wgf2_*`)
//! without losing a packet, and refusing a rollback without a blackhole.
//!
//! What runs is decided by what the pinned links run, not by which pins exist: link ->
//! program -> the program's maps -> their names. Only without CAP_SYS_ADMIN (the DaemonSet's
//! case), where the kernel shows no program or map by id, do the peer map pins decide. A datapath whose ingress link runs layout-1
//! programs is upgraded in this order ("fill first, then switch"):
//!
//! 1. the v2 maps are created and pinned (by the loader) and both v2 programs loaded;
//! 2. [`Upgrade::fill`] translates the v1 maps into them: peer entries get owners (one per
//!    address, as the planner gives them), policy tries are copied verbatim, packet and per-peer
//!    counters carried over, live flows translated to the owner of their peer's entry and
//!    counted in `wgf2_flow_made`, the config carried with the new fields at their defaults;
//! 3. the switch marker (`wgf2_switch`, the ids of the v2 programs) is pinned, then each
//!    pinned link gets its v2 program with one `bpf_link_update`, egress then ingress;
//! 4. [`Upgrade::finish`] copies again what the v1 programs recorded between the fill and the
//!    switch (flows, counter increments), places the tombstone, removes the other v1 pins and
//!    then the marker.
//!
//! An upgrade killed at any step is finished by the next start, also without CAP_SYS_ADMIN:
//! before the switch the links run v1 (the upgrade starts again), between the two link updates
//! the egress link runs a program the marker names (the upgrade resumes with the v2 maps it
//! filled), after the switch a link runs a program the marker names or the tombstone is in
//! place (no upgrade: [`tidy`] finishes step 4). A flow the first fill copied is not counted
//! again when the upgrade resumes, and every start recounts the flow quota from the tables.
//!
//! The tombstone is a one-entry array pinned as `wgf1_peers_v4`. A layout-1 agent adopts any
//! pinned `wgf1_*` object and checks its layout before it attaches anything, so it stops with
//! "pinned map wgf1_peers_v4 has type Array ..." while the v2 programs keep enforcing. The
//! other `wgf1_*` maps that refused agent created are removed by [`tidy`] at the next start.

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
    },
};
use wgfence_common::{map_names, LAYOUT_VERSION};

use super::{
    error::{DataplaneError, Result},
    maps::per_cpu,
};

/// The map layout 1, as main left it at commit 02c7ddc: the only layout this agent upgrades
/// from. Private copies, so that a change to the current layout can never change how the old
/// one is read.
pub(crate) mod v1 {
    use bytemuck::{Pod, Zeroable};

    pub const LAYOUT: u32 = 1;
    pub const PEERS_V4: &str = "wgf1_peers_v4";
    pub const PEERS_V6: &str = "wgf1_peers_v6";
    pub const POLICY_V4: &str = "wgf1_policy_v4";
    pub const POLICY_V6: &str = "wgf1_policy_v6";
    pub const STATS: &str = "wgf1_stats";
    pub const PEER_STATS: &str = "wgf1_peer_stats";
    pub const FLOWS_V4: &str = "wgf1_flows_v4";
    pub const FLOWS_V6: &str = "wgf1_flows_v6";
    pub const CONFIG: &str = "wgf1_config";
    /// The maps an upgrade reads: all pinned, unless an upgrade removed some.
    pub const UPGRADED: [&str; 9] = [
        PEERS_V4, PEERS_V6, POLICY_V4, POLICY_V6, STATS, PEER_STATS, FLOWS_V4, FLOWS_V6, CONFIG,
    ];
    #[cfg(test)]
    pub const ALL: [&str; 11] = [
        PEERS_V4,
        PEERS_V6,
        POLICY_V4,
        POLICY_V6,
        STATS,
        PEER_STATS,
        FLOWS_V4,
        FLOWS_V6,
        CONFIG,
        "wgf1_events",
        "wgf1_ev_bucket",
    ];
    pub const MAX_ALLOWS: usize = 32;
    pub const COUNTERS_LEN: u32 = 16;
    pub const FLOW_CLOSING: u32 = 1;
    pub const PROTO_TCP: u8 = 6;
    pub const PROTO_UDP: u8 = 17;

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
        pub state: u32,
        pub slot: u32,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct Config {
        pub flags: u32,
        pub _pad: u32,
        pub tcp_timeout_ns: u64,
        pub tcp_closing_timeout_ns: u64,
        pub udp_timeout_ns: u64,
        pub other_timeout_ns: u64,
        pub event_interval_ns: u64,
        pub event_burst_ns: u64,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct PeerCounters {
        pub pass_packets: u64,
        pub pass_bytes: u64,
        pub drop_packets: u64,
        pub drop_bytes: u64,
    }

    impl Config {
        /// The idle timeout of a flow of `protocol` in `state`, as the v1 datapath reads it.
        pub fn timeout(&self, protocol: u8, state: u32) -> u64 {
            match protocol {
                PROTO_TCP if state == FLOW_CLOSING => self.tcp_closing_timeout_ns,
                PROTO_TCP => self.tcp_timeout_ns,
                PROTO_UDP => self.udp_timeout_ns,
                _ => self.other_timeout_ns,
            }
        }
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

/// The pin a layout-1 agent reads first among the peer maps, where the tombstone goes.
pub const TOMBSTONE_PIN: &str = v1::PEERS_V4;
/// Kernel name of the tombstone map (`bpftool map show` prints it).
const TOMBSTONE_NAME: &str = "wgf2_tombstone";
/// A pin name for the tombstone before it is renamed into place (bpffs refuses dots).
const TOMBSTONE_TMP: &str = "tombstone_new";
/// The switch marker: a two-entry array of the layout-2 program ids (egress, ingress) an
/// upgrade pins before its switch and removes once layout 1 is tidied away. Without
/// CAP_SYS_ADMIN the kernel shows which program a pinned link runs (its id) but not that
/// program's maps: a link running one of these ids runs layout 2, whatever layout-1 pins an
/// interrupted upgrade left.
const SWITCH_PIN: &str = "wgf2_switch";
/// A pin name for the switch marker before it is renamed into place.
const SWITCH_TMP: &str = "switch_new";
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

/// What one pinned link runs: the layout of its program's maps and those maps by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Running {
    pub link_id: u32,
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
    let (link_id, program_id) = (info.id(), info.program_id());
    let program_err = |source| DataplaneError::Program {
        program: "the pinned link's program",
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
        let pin_dir = link_path.parent().unwrap_or(link_path);
        let layout = layout_by_pins(pin_dir, program_id);
        tracing::debug!(
            link = %link_path.display(),
            program_id,
            ?layout,
            "the link's program cannot be looked up (no CAP_SYS_ADMIN): layout read from the pins"
        );
        return Ok(Some(Running {
            link_id,
            program_id,
            layout,
            maps: BTreeMap::new(),
            program: None,
        }));
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
    Ok(Some(Running {
        link_id,
        program_id,
        layout,
        maps,
        program: info.name_as_str().map(str::to_owned),
    }))
}

/// The layout of the datapath pinned in `pin_dir`, from its pins, for when the link's program
/// (`program_id`) cannot be looked up:
/// - a program the switch marker names is layout 2 (an upgrade switched it, and was
///   interrupted before it tidied layout 1 away);
/// - a complete set of layout-1 map pins, its peer map under its own name, means layout 1
///   (after an upgrade that name holds the tombstone, an array, and a refused layout-1 agent
///   cannot replace it; an incomplete set is what an upgrade interrupted while it removed them
///   leaves, once layout 2 runs);
/// - else a pinned layout-2 peer map means layout 2.
fn layout_by_pins(pin_dir: &Path, program_id: u32) -> Option<u32> {
    if switched_to(pin_dir).contains(&program_id) {
        return Some(LAYOUT_VERSION);
    }
    let v1_peers = MapInfo::from_pin(pin_dir.join(v1::PEERS_V4))
        .ok()
        .filter(|info| {
            info.map_type().is_ok_and(|t| t == aya::maps::MapType::Hash)
                && info.key_size() as usize == std::mem::size_of::<v1::PeerKeyV4>()
                && info.value_size() as usize == std::mem::size_of::<v1::PeerEntry>()
        });
    let v2_peers = MapInfo::from_pin(pin_dir.join(map_names::PEERS_V4)).ok();
    let v1_complete = v1::UPGRADED.iter().all(|name| pin_dir.join(name).exists());
    if v1_peers.is_some() && (v1_complete || v2_peers.is_none()) {
        return Some(v1::LAYOUT);
    }
    v2_peers.map(|_| LAYOUT_VERSION)
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
    Ok(running(&pin_dir.join(super::LINK_PIN))?.and_then(|r| r.layout))
}

/// Processes other than this one that hold the BPF link `link_id` open: a running agent
/// holds its links. Read from /proc (`anon_inode:bpf_link` fds, `link_id` in their fdinfo);
/// processes that vanish or cannot be read meanwhile are skipped.
fn link_holders(link_id: u32) -> Vec<u32> {
    let me = std::process::id();
    let Ok(procs) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let wanted = format!("link_id:\t{link_id}");
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
            let is_link = fs::read_link(fd.path())
                .is_ok_and(|target| target.as_os_str() == "anon_inode:bpf_link");
            is_link
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

/// The v1 maps an upgrade reads, opened from the ids the running v1 programs use.
struct V1Maps {
    peers_v4: HashMap<MapData, v1::PeerKeyV4, v1::PeerEntry>,
    peers_v6: HashMap<MapData, v1::PeerKeyV6, v1::PeerEntry>,
    policy_v4: LpmTrie<MapData, v1::PolicyKeyV4, v1::PolicyValue>,
    policy_v6: LpmTrie<MapData, v1::PolicyKeyV6, v1::PolicyValue>,
    stats: PerCpuArray<MapData, u64>,
    peer_stats: Array<MapData, v1::PeerCounters>,
    flows_v4: HashMap<MapData, v1::FlowKeyV4, v1::FlowValue>,
    flows_v6: HashMap<MapData, v1::FlowKeyV6, v1::FlowValue>,
    config: Array<MapData, v1::Config>,
}

impl V1Maps {
    /// Opens each map by the id a running v1 program uses, else (a map neither program
    /// references) by its pin. aya checks key and value sizes against the v1 types.
    fn open(ids: &BTreeMap<String, u32>, pin_dir: &Path) -> Result<Self> {
        fn typed<T: TryFrom<Map, Error = MapError>>(
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
        Ok(Self {
            peers_v4: typed(v1::PEERS_V4, ids, pin_dir)?,
            peers_v6: typed(v1::PEERS_V6, ids, pin_dir)?,
            policy_v4: typed(v1::POLICY_V4, ids, pin_dir)?,
            policy_v6: typed(v1::POLICY_V6, ids, pin_dir)?,
            stats: typed(v1::STATS, ids, pin_dir)?,
            peer_stats: typed(v1::PEER_STATS, ids, pin_dir)?,
            flows_v4: typed(v1::FLOWS_V4, ids, pin_dir)?,
            flows_v6: typed(v1::FLOWS_V6, ids, pin_dir)?,
            config: typed(v1::CONFIG, ids, pin_dir)?,
        })
    }

    fn config(&self) -> Result<v1::Config> {
        self.config.get(&0, 0).map_err(map_err(v1::CONFIG))
    }

    /// Every peer entry: (address, entry).
    fn peers(&self) -> Result<Vec<(IpAddr, v1::PeerEntry)>> {
        let mut peers = Vec::new();
        for item in self.peers_v4.iter() {
            let (key, entry) = item.map_err(map_err(v1::PEERS_V4))?;
            peers.push((IpAddr::from(key.addr), entry));
        }
        for item in self.peers_v6.iter() {
            let (key, entry) = item.map_err(map_err(v1::PEERS_V6))?;
            peers.push((IpAddr::from(key.addr), entry));
        }
        Ok(peers)
    }

    /// The per-CPU packet counters; the indexes layout 2 has (it kept layout 1's meanings and
    /// added after them).
    fn stats(&self) -> Result<Vec<Vec<u64>>> {
        (0..v1::COUNTERS_LEN.min(wgfence_common::COUNTERS_LEN))
            .map(|i| {
                self.stats
                    .get(&i, 0)
                    .map(|values| values.to_vec())
                    .map_err(map_err(v1::STATS))
            })
            .collect()
    }

    fn peer_stats(&self, slots: &BTreeSet<u32>) -> Result<BTreeMap<u32, v1::PeerCounters>> {
        slots
            .iter()
            .map(|slot| {
                self.peer_stats
                    .get(slot, 0)
                    .map(|c| (*slot, c))
                    .map_err(map_err(v1::PEER_STATS))
            })
            .collect()
    }
}

/// The v2 maps an upgrade writes, opened from their pins (the loader just created them).
struct V2Maps {
    peers_v4: HashMap<MapData, wgfence_common::PeerKeyV4, wgfence_common::PeerEntry>,
    peers_v6: HashMap<MapData, wgfence_common::PeerKeyV6, wgfence_common::PeerEntry>,
    policy_v4: LpmTrie<MapData, wgfence_common::PolicyKeyV4, wgfence_common::PolicyValue>,
    policy_v6: LpmTrie<MapData, wgfence_common::PolicyKeyV6, wgfence_common::PolicyValue>,
    stats: PerCpuArray<MapData, u64>,
    peer_stats: PerCpuArray<MapData, wgfence_common::PeerCounters>,
    flows_v4: HashMap<MapData, wgfence_common::FlowKeyV4, wgfence_common::FlowValue>,
    flows_v6: HashMap<MapData, wgfence_common::FlowKeyV6, wgfence_common::FlowValue>,
    flow_made: Array<MapData, u64>,
    config: Array<MapData, wgfence_common::Config>,
}

impl V2Maps {
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

    fn peers(&self) -> Result<Vec<(IpAddr, wgfence_common::PeerEntry)>> {
        let mut peers = Vec::new();
        for item in self.peers_v4.iter() {
            let (key, entry) = item.map_err(map_err(map_names::PEERS_V4))?;
            peers.push((IpAddr::from(key.addr), entry));
        }
        for item in self.peers_v6.iter() {
            let (key, entry) = item.map_err(map_err(map_names::PEERS_V6))?;
            peers.push((IpAddr::from(key.addr), entry));
        }
        Ok(peers)
    }

    fn add_made(&mut self, slot: u32, n: u64) -> Result<()> {
        let made = self
            .flow_made
            .get(&slot, 0)
            .map_err(map_err(map_names::FLOW_MADE))?;
        self.flow_made
            .set(slot, made.saturating_add(n), 0)
            .map_err(map_err(map_names::FLOW_MADE))
    }
}

fn policy_value(v: &v1::PolicyValue) -> wgfence_common::PolicyValue {
    wgfence_common::PolicyValue {
        count: v.count,
        allows: v
            .allows
            .map(|a| wgfence_common::Allow::new(a.protocol, a.port_lo, a.port_hi)),
    }
}

fn peer_counters(c: &v1::PeerCounters) -> wgfence_common::PeerCounters {
    wgfence_common::PeerCounters {
        pass_packets: c.pass_packets,
        pass_bytes: c.pass_bytes,
        drop_packets: c.drop_packets,
        drop_bytes: c.drop_bytes,
    }
}

/// CLOCK_MONOTONIC in nanoseconds: the clock of `bpf_ktime_get_ns`, which flows are stamped
/// with.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u64::try_from(ts.tv_sec)
        .unwrap_or_default()
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::try_from(ts.tv_nsec).unwrap_or_default())
}

/// A v1 flow as the v2 tables key it, with what decides whether it carries over.
struct V1Flow {
    key: FlowKey,
    value: v1::FlowValue,
    peer: IpAddr,
    protocol: u8,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum FlowKey {
    V4(wgfence_common::FlowKeyV4),
    V6(wgfence_common::FlowKeyV6),
}

impl V1Maps {
    fn flows(&self) -> Result<Vec<V1Flow>> {
        let mut flows = Vec::new();
        for item in self.flows_v4.iter() {
            let (k, value) = item.map_err(map_err(v1::FLOWS_V4))?;
            flows.push(V1Flow {
                key: FlowKey::V4(wgfence_common::FlowKeyV4 {
                    peer: k.peer,
                    remote: k.remote,
                    peer_port: k.peer_port,
                    remote_port: k.remote_port,
                    protocol: k.protocol,
                    _pad: [0; 3],
                }),
                value,
                peer: IpAddr::from(k.peer),
                protocol: k.protocol,
            });
        }
        for item in self.flows_v6.iter() {
            let (k, value) = item.map_err(map_err(v1::FLOWS_V6))?;
            flows.push(V1Flow {
                key: FlowKey::V6(wgfence_common::FlowKeyV6 {
                    peer: k.peer,
                    remote: k.remote,
                    peer_port: k.peer_port,
                    remote_port: k.remote_port,
                    protocol: k.protocol,
                    _pad: [0; 3],
                }),
                value,
                peer: IpAddr::from(k.peer),
                protocol: k.protocol,
            });
        }
        Ok(flows)
    }
}

/// What an upgrade carried over, for the log and the tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UpgradeReport {
    pub from_layout: u32,
    pub peer_entries: usize,
    pub owners: u64,
    pub policy_entries: usize,
    pub flows: u64,
    /// Flows the v1 programs recorded between the fill and the switch, copied after it.
    pub flows_late: u64,
    /// v1 flows not carried: expired, or recorded for another holder of the address.
    pub flows_dropped: u64,
    /// From the first `bpf_link_update` to the last.
    pub switch: Duration,
    /// From the first read of the v1 maps to the removal of their pins.
    pub total: Duration,
}

/// An upgrade from layout 1 in progress: found by [`Upgrade::prepare`] before the v2 maps
/// are loaded, [`Upgrade::fill`]ed before the switch, [`Upgrade::finish`]ed after it.
pub(crate) struct Upgrade {
    v1: V1Maps,
    /// The v2 maps were created by this start: counters are carried. `false` after an
    /// upgrade interrupted between its two link updates, whose fill already carried them.
    fresh: bool,
    started: Instant,
    /// The v1 counters as the fill read them: the switch adds what the v1 programs counted
    /// after that.
    stats: Vec<Vec<u64>>,
    peer_stats: BTreeMap<u32, v1::PeerCounters>,
    /// Owner of each v1 peer entry's address.
    owners: BTreeMap<IpAddr, u64>,
    report: UpgradeReport,
}

impl Upgrade {
    /// Looks at what the pinned links run. Layout 1 on ingress: an upgrade, whose v1 maps are
    /// opened here; stale v2 pins of an upgrade interrupted before its switch are removed (no
    /// program uses them), so the loader creates the v2 maps empty. A layout newer than this
    /// agent's is refused before anything is touched. Anything else: no upgrade.
    pub(crate) fn prepare(pin_dir: &Path) -> Result<Option<Self>> {
        let ingress = running(&pin_dir.join(super::LINK_PIN))?;
        let egress = running(&pin_dir.join(super::LINK_PIN_EGRESS))?;
        for r in [&ingress, &egress].into_iter().flatten() {
            if let Some(layout) = r.layout.filter(|l| *l > LAYOUT_VERSION) {
                return Err(DataplaneError::NewerLayout {
                    running: layout,
                    this: LAYOUT_VERSION,
                });
            }
        }
        let Some(ingress) = ingress.filter(|r| r.layout == Some(v1::LAYOUT)) else {
            return Ok(None);
        };
        let egress_v2 = egress
            .as_ref()
            .is_some_and(|r| r.layout == Some(LAYOUT_VERSION));
        let mut ids = ingress.maps.clone();
        if let Some(egress) = egress.filter(|r| r.layout == Some(v1::LAYOUT)) {
            for (name, id) in egress.maps {
                ids.entry(name).or_insert(id);
            }
        }
        // The layout-1 agent must be stopped first (a DaemonSet rollout with maxSurge 0 does):
        // running, it would find its programs replaced and attach them again.
        let holders = link_holders(ingress.link_id);
        if !holders.is_empty() {
            return Err(DataplaneError::OldAgentRunning {
                layout: v1::LAYOUT,
                pids: holders,
            });
        }
        let started = Instant::now();
        let v1 = V1Maps::open(&ids, pin_dir)?;
        if !egress_v2 {
            for name in pins_of_layout(pin_dir, LAYOUT_VERSION)? {
                remove_pin(&pin_dir.join(&name))?;
            }
        }
        tracing::info!(
            pin_dir = %pin_dir.display(),
            from = v1::LAYOUT,
            to = LAYOUT_VERSION,
            ingress_program = ingress.program_id,
            resumed = egress_v2,
            "the pinned links run a datapath of map layout 1: upgrading it (fill the new maps, \
             then switch the programs)"
        );
        Ok(Some(Self {
            v1,
            fresh: !egress_v2,
            started,
            stats: Vec::new(),
            peer_stats: BTreeMap::new(),
            owners: BTreeMap::new(),
            report: UpgradeReport {
                from_layout: v1::LAYOUT,
                ..UpgradeReport::default()
            },
        }))
    }

    /// Translates the v1 maps into the (loaded, not yet attached) v2 maps pinned in `pin_dir`.
    /// The v1 programs keep enforcing meanwhile; an error leaves them so.
    pub(crate) fn fill(&mut self, pin_dir: &Path) -> Result<()> {
        let mut v2 = V2Maps::open(pin_dir)?;
        let config = self.v1.config()?;
        let peers = self.v1.peers()?;

        // Owners: one per address, as the planner allocates them (a flow counts only for the
        // entry of its own address), kept if the v2 maps already hold the address with the
        // same slot (a resumed upgrade), else new ones above the high-water mark.
        let old_config = v2.config.get(&0, 0).map_err(map_err(map_names::CONFIG))?;
        let mut high = old_config.owner_high;
        let existing: BTreeMap<IpAddr, wgfence_common::PeerEntry> =
            v2.peers()?.into_iter().collect();
        let slots: BTreeSet<u32> = peers.iter().map(|(_, e)| e.slot).collect();
        for (addr, entry) in &peers {
            let owner = match existing.get(addr) {
                Some(have) if have.owner != 0 && have.slot == entry.slot => have.owner,
                _ => {
                    high += 1;
                    high
                }
            };
            self.owners.insert(*addr, owner);
        }

        // The config first (nothing runs on these maps yet): timeouts decide which flows are
        // live, the high-water mark covers every owner written below.
        let v2_config = wgfence_common::Config {
            flags: config.flags,
            flows_per_peer: wgfence_common::DEFAULT_FLOWS_PER_PEER,
            tcp_timeout_ns: config.tcp_timeout_ns,
            tcp_closing_timeout_ns: config.tcp_closing_timeout_ns,
            udp_timeout_ns: config.udp_timeout_ns,
            other_timeout_ns: config.other_timeout_ns,
            // Layout 1 had no such state (its flows carry over open or closing); the agent
            // writes its own setting with its first apply.
            unanswered_timeout_ns: crate::settings::DatapathSettings::DEFAULT
                .config(false, 1)
                .unanswered_timeout_ns,
            event_interval_ns: config.event_interval_ns,
            event_burst_ns: config.event_burst_ns,
            owner_high: high,
        };
        v2.config
            .set(0, v2_config, 0)
            .map_err(map_err(map_names::CONFIG))?;

        // Policy tries, verbatim; entries of no v1 policy go (a resumed upgrade only).
        let keep_v4 = copy_trie(
            (&self.v1.policy_v4, v1::POLICY_V4),
            (&mut v2.policy_v4, map_names::POLICY_V4),
            |k| wgfence_common::PolicyKeyV4 {
                policy: k.policy,
                addr: k.addr,
            },
        )?;
        let keep_v6 = copy_trie(
            (&self.v1.policy_v6, v1::POLICY_V6),
            (&mut v2.policy_v6, map_names::POLICY_V6),
            |k| wgfence_common::PolicyKeyV6 {
                policy: k.policy,
                addr: k.addr,
            },
        )?;
        self.report.policy_entries = keep_v4.len() + keep_v6.len();

        // Peer entries, after the policies they reference; entries of no v1 peer go.
        for (addr, entry) in &peers {
            let owner = self.owners.get(addr).copied().unwrap_or_default();
            v2.upsert_peer(
                *addr,
                wgfence_common::PeerEntry {
                    policy: entry.policy,
                    slot: entry.slot,
                    owner,
                },
            )?;
        }
        let wanted: BTreeSet<IpAddr> = peers.iter().map(|(a, _)| *a).collect();
        for (addr, _) in v2.peers()? {
            if !wanted.contains(&addr) {
                let result = match addr {
                    IpAddr::V4(a) => v2
                        .peers_v4
                        .remove(&wgfence_common::PeerKeyV4 { addr: a.octets() }),
                    IpAddr::V6(a) => v2
                        .peers_v6
                        .remove(&wgfence_common::PeerKeyV6 { addr: a.octets() }),
                };
                result.map_err(map_err(if addr.is_ipv4() {
                    map_names::PEERS_V4
                } else {
                    map_names::PEERS_V6
                }))?;
            }
        }
        remove_other_entries(&mut v2.policy_v4, map_names::POLICY_V4, &keep_v4)?;
        remove_other_entries(&mut v2.policy_v6, map_names::POLICY_V6, &keep_v6)?;
        self.report.peer_entries = peers.len();
        self.report.owners = self.owners.len() as u64;

        // Counters: the v1 values now; what the v1 programs count until the switch is added
        // after it.
        if self.fresh {
            self.stats = self.v1.stats()?;
            for (index, values) in (0u32..).zip(&self.stats) {
                let values =
                    PerCpuValues::try_from(values.clone()).map_err(|e| DataplaneError::Map {
                        map: map_names::STATS,
                        source: MapError::IoError(e),
                    })?;
                v2.stats
                    .set(index, values, 0)
                    .map_err(map_err(map_names::STATS))?;
            }
            self.peer_stats = self.v1.peer_stats(&slots)?;
            // Layout 1 kept one shared copy per slot: it goes to CPU 0's copy (readers sum
            // over the CPUs).
            for (slot, c) in &self.peer_stats {
                let values = per_cpu(peer_counters(c)).map_err(map_err(map_names::PEER_STATS))?;
                v2.peer_stats
                    .set(*slot, values, 0)
                    .map_err(map_err(map_names::PEER_STATS))?;
            }
        }

        // Flows last, closest to the switch.
        let (carried, dropped) = self.copy_flows(&mut v2, &config, &peers, false)?;
        self.report.flows = carried;
        self.report.flows_dropped = dropped;
        Ok(())
    }

    /// Pins the switch marker naming the loaded layout-2 programs: from here on, a link that
    /// runs one of them runs layout 2, also for an agent that cannot look programs up.
    pub(crate) fn mark_switch(&self, pin_dir: &Path, program_ids: &[u32]) -> Result<()> {
        mark_switch(pin_dir, program_ids)
    }

    /// Copies the live v1 flows whose peer entry still has the slot they were recorded for
    /// into the v2 tables, owned by that entry's owner, and counts them in `flow_made`.
    /// `late`: after the switch, only flows the v2 tables do not have (the v2 programs may
    /// have recorded or refreshed them meanwhile); a v2 flow older than its v1 copy gets the
    /// v1 timestamp. Returns (copied, not carried).
    fn copy_flows(
        &self,
        v2: &mut V2Maps,
        config: &v1::Config,
        peers: &[(IpAddr, v1::PeerEntry)],
        late: bool,
    ) -> Result<(u64, u64)> {
        let slot_of: BTreeMap<IpAddr, u32> = peers.iter().map(|(a, e)| (*a, e.slot)).collect();
        let now = monotonic_ns();
        let mut made: BTreeMap<u32, u64> = BTreeMap::new();
        let (mut copied, mut dropped) = (0, 0);
        for flow in self.v1.flows()? {
            let v = flow.value;
            let live = now.saturating_sub(v.last_seen_ns) <= config.timeout(flow.protocol, v.state);
            let owner = (slot_of.get(&flow.peer) == Some(&v.slot))
                .then(|| self.owners.get(&flow.peer).copied())
                .flatten();
            let Some(owner) = owner.filter(|_| live) else {
                dropped += 1;
                continue;
            };
            let value = wgfence_common::FlowValue {
                last_seen_ns: v.last_seen_ns,
                owner,
                state: v.state,
                slot: v.slot,
            };
            let inserted = match flow.key {
                FlowKey::V4(k) => {
                    insert_flow(&mut v2.flows_v4, map_names::FLOWS_V4, k, value, late)?
                }
                FlowKey::V6(k) => {
                    insert_flow(&mut v2.flows_v6, map_names::FLOWS_V6, k, value, late)?
                }
            };
            if inserted {
                copied += 1;
                *made.entry(v.slot).or_default() += 1;
            }
        }
        for (slot, n) in made {
            v2.add_made(slot, n)?;
        }
        Ok((copied, dropped))
    }

    /// After both links run the v2 programs: copies what the v1 programs recorded since the
    /// fill, adds what they counted since, removes the v1 pins and leaves the tombstone.
    /// `switch` is how long the link updates took.
    pub(crate) fn finish(mut self, pin_dir: &Path, switch: Duration) -> Result<UpgradeReport> {
        let mut v2 = V2Maps::open(pin_dir)?;
        let config = self.v1.config()?;
        let peers = self.v1.peers()?;
        let (late, _) = self.copy_flows(&mut v2, &config, &peers, true)?;
        self.report.flows_late = late;
        if self.fresh {
            // Racing the v2 programs' own increments between one read and one write per
            // counter: at worst a handful of packets go uncounted, never miscounted as
            // another verdict.
            let stats = self.v1.stats()?;
            for ((index, now), before) in (0u32..).zip(&stats).zip(&self.stats) {
                if now == before {
                    continue;
                }
                let current = v2.stats.get(&index, 0).map_err(map_err(map_names::STATS))?;
                let values: Vec<u64> = current
                    .iter()
                    .zip(now.iter().zip(before))
                    .map(|(c, (n, b))| c.saturating_add(n.saturating_sub(*b)))
                    .collect();
                let values = PerCpuValues::try_from(values).map_err(|e| DataplaneError::Map {
                    map: map_names::STATS,
                    source: MapError::IoError(e),
                })?;
                v2.stats
                    .set(index, values, 0)
                    .map_err(map_err(map_names::STATS))?;
            }
            let slots: BTreeSet<u32> = self.peer_stats.keys().copied().collect();
            for (slot, now) in self.v1.peer_stats(&slots)? {
                let Some(before) = self.peer_stats.get(&slot) else {
                    continue;
                };
                if now == *before {
                    continue;
                }
                // The layout-2 programs count on every CPU by now: the late layout-1 counts go
                // onto CPU 0's copy, the other CPUs' copies are written back as read.
                let mut values = v2
                    .peer_stats
                    .get(&slot, 0)
                    .map_err(map_err(map_names::PEER_STATS))?
                    .to_vec();
                if let Some(c) = values.first_mut() {
                    *c = wgfence_common::PeerCounters {
                        pass_packets: c.pass_packets
                            + now.pass_packets.saturating_sub(before.pass_packets),
                        pass_bytes: c.pass_bytes + now.pass_bytes.saturating_sub(before.pass_bytes),
                        drop_packets: c.drop_packets
                            + now.drop_packets.saturating_sub(before.drop_packets),
                        drop_bytes: c.drop_bytes + now.drop_bytes.saturating_sub(before.drop_bytes),
                    };
                }
                let values = PerCpuValues::try_from(values).map_err(|e| DataplaneError::Map {
                    map: map_names::PEER_STATS,
                    source: MapError::IoError(e),
                })?;
                v2.peer_stats
                    .set(slot, values, 0)
                    .map_err(map_err(map_names::PEER_STATS))?;
            }
        }
        // The v1 maps go with their pins (and this agent's fds, dropped with `self`), the
        // tombstone first.
        retire_layout_1(pin_dir)?;
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
            flows_not_carried = r.flows_dropped,
            switch_us = r.switch.as_micros() as u64,
            total_ms = r.total.as_millis() as u64,
            "upgraded the datapath from map layout 1 to 2; the layout-1 maps are removed"
        );
        Ok(self.report)
    }
}

/// Copies a layout-1 policy trie into its layout-2 twin, entry for entry; returns the keys
/// written (prefix length and key bytes).
fn copy_trie<A: aya::Pod, B: aya::Pod + bytemuck::Pod>(
    (from, from_name): (&LpmTrie<MapData, A, v1::PolicyValue>, &'static str),
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

/// Removes the entries of a layout-2 trie that are not in `keep`.
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

/// Pins the tombstone at [`TOMBSTONE_PIN`] (replacing whatever is there in one rename): a
/// one-entry array holding this agent's layout version, which a layout-1 agent refuses.
fn place_tombstone(pin_dir: &Path) -> Result<()> {
    pin_u32_array(
        pin_dir,
        TOMBSTONE_NAME,
        TOMBSTONE_PIN,
        TOMBSTONE_TMP,
        &[LAYOUT_VERSION],
    )
}

/// Whether the pin at `path` is this agent's tombstone.
fn is_tombstone(path: &Path) -> bool {
    MapInfo::from_pin(path).is_ok_and(|info| {
        info.name_as_str() == Some(TOMBSTONE_NAME)
            && info
                .map_type()
                .is_ok_and(|t| t == aya::maps::MapType::Array)
    })
}

/// After the programs are attached (they run this agent's layout): removes the pins of
/// layout 1 that remain (maps a refused layout-1 agent created, or an upgrade interrupted
/// after its switch left) and makes sure the tombstone is in place. Returns the names of the
/// pins removed.
pub(crate) fn tidy(pin_dir: &Path) -> Result<Vec<String>> {
    let removed = retire_layout_1(pin_dir)?;
    if !removed.is_empty() {
        tracing::warn!(
            pin_dir = %pin_dir.display(),
            ?removed,
            "removed map pins of layout 1 that the running datapath does not use (left by a \
             layout-1 agent that was refused, or by an interrupted upgrade)"
        );
    }
    Ok(removed)
}

/// Once layout 2 runs: the tombstone first (from then on the pins say layout 2 even without
/// the switch marker), then every other layout-1 pin, then the switch marker. Each step is
/// idempotent, so an interrupted run is finished by the next one (at the next start's
/// [`tidy`]). Returns the names of the layout-1 pins removed.
fn retire_layout_1(pin_dir: &Path) -> Result<Vec<String>> {
    if !is_tombstone(&pin_dir.join(TOMBSTONE_PIN)) {
        place_tombstone(pin_dir)?;
    }
    let mut removed = Vec::new();
    for name in pins_of_layout(pin_dir, v1::LAYOUT)? {
        if name != TOMBSTONE_PIN && remove_pin(&pin_dir.join(&name))? {
            removed.push(name);
            failpoint("upgrade-unpinning");
        }
    }
    for leftover in [TOMBSTONE_TMP, SWITCH_TMP, SWITCH_PIN] {
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
        for name in v1::ALL {
            assert_eq!(name_layout(name), Some(1), "{name}");
        }
        for name in map_names::ALL {
            assert_eq!(name_layout(name), Some(LAYOUT_VERSION), "{name}");
        }
        assert_eq!(name_layout(TOMBSTONE_NAME), Some(LAYOUT_VERSION));
    }

    #[test]
    fn v1_types_keep_their_v1_sizes() {
        use core::mem::size_of;
        assert_eq!(size_of::<v1::PeerKeyV4>(), 4);
        assert_eq!(size_of::<v1::PeerKeyV6>(), 16);
        assert_eq!(size_of::<v1::PeerEntry>(), 8);
        assert_eq!(size_of::<v1::PolicyKeyV4>(), 8);
        assert_eq!(size_of::<v1::PolicyKeyV6>(), 20);
        assert_eq!(size_of::<v1::PolicyValue>(), 4 + 6 * v1::MAX_ALLOWS);
        assert_eq!(size_of::<v1::PeerCounters>(), 32);
        assert_eq!(size_of::<v1::FlowKeyV4>(), 16);
        assert_eq!(size_of::<v1::FlowKeyV6>(), 40);
        assert_eq!(size_of::<v1::FlowValue>(), 16);
        assert_eq!(size_of::<v1::Config>(), 56);
    }

    #[test]
    fn policy_values_are_copied_verbatim() {
        let mut v = v1::PolicyValue {
            count: 2,
            allows: [v1::Allow::default(); v1::MAX_ALLOWS],
        };
        v.allows[0] = v1::Allow {
            protocol: 6,
            _pad: 0,
            port_lo: 443,
            port_hi: 443,
        };
        v.allows[1] = v1::Allow {
            protocol: 0,
            _pad: 0,
            port_lo: 0,
            port_hi: u16::MAX,
        };
        let w = policy_value(&v);
        assert_eq!(bytemuck::bytes_of(&v), bytemuck::bytes_of(&w));
    }

    #[test]
    fn v1_flow_timeouts_follow_protocol_and_state() {
        let c = v1::Config {
            tcp_timeout_ns: 1,
            tcp_closing_timeout_ns: 2,
            udp_timeout_ns: 3,
            other_timeout_ns: 4,
            ..v1::Config::default()
        };
        assert_eq!(c.timeout(v1::PROTO_TCP, 0), 1);
        assert_eq!(c.timeout(v1::PROTO_TCP, v1::FLOW_CLOSING), 2);
        assert_eq!(c.timeout(v1::PROTO_UDP, 0), 3);
        assert_eq!(c.timeout(1, 0), 4);
    }
}
