//! Upgrading a running datapath of map layout 3 (`wgf3_*`, one policy trie that all policies
//! share) to this agent's layout 4 (`wgf4_*`, a trie per policy) without losing a packet, and
//! refusing a rollback without a blackhole.
//!
//! What runs is decided by what is attached, not by which pins exist: the pinned tcx link's
//! program, or (legacy TC hook) the program of the agent's clsact filter -> the program's maps
//! -> their names. Only without CAP_SYS_ADMIN (the DaemonSet's case), where the kernel shows no
//! program or map by id, do the peer map pins decide. A datapath whose ingress hook runs
//! layout-3 programs is upgraded in this order ("fill first, then switch"):
//!
//! 1. the v4 maps are created and pinned (by the loader) and both v4 programs loaded;
//! 2. [`Upgrade::fill`] copies the v3 maps into them: each policy's entries of the shared v3
//!    trie into that policy's own trie, every one before any peer entry; peer
//!    entries, packet, per-peer and rule counters, the flow quota, live flows and the config as
//!    they are (layout 4 changed the policy maps alone);
//! 3. the switch marker (`wgf4_switch`, the ids of the v4 programs) is pinned, then each hook
//!    gets its v4 program, egress then ingress: one `bpf_link_update` per pinned tcx link, or
//!    one in-place `tc filter replace` per clsact filter (both atomic per packet);
//! 4. [`Upgrade::finish`] copies again what the v3 programs recorded between the fill and the
//!    switch (flows, counter increments), places the tombstones, removes the other v3 pins and
//!    then the marker.
//!
//! An upgrade killed at any step is finished by the next start, also without CAP_SYS_ADMIN:
//! before the switch the hooks run v3 (the upgrade starts again), between the two program
//! switches the egress hook runs a program the marker names (the upgrade resumes with the v4
//! maps it filled), after the switch a hook runs a program the marker names or the tombstone is
//! in place (no upgrade: [`tidy`] finishes step 4). Every start recounts the flow quota from
//! the tables.
//!
//! The tombstones are one-entry arrays pinned as `wgf3_peers_v4`, `wgf2_peers_v4` and
//! `wgf1_peers_v4`. An agent of layout 3 sees the v4 programs attached and refuses a newer
//! layout; without CAP_SYS_ADMIN it adopts the pinned `wgf3_peers_v4`, checks its layout before
//! it attaches anything and stops with "pinned map wgf3_peers_v4 has type Array ...". Agents of
//! layouts 2 and 1 stop the same way at theirs. The v4 programs keep enforcing meanwhile; the
//! other pins such a refused agent created are removed by [`tidy`] at the next start.
//!
//! Layouts 1 and 2 are not upgraded directly: a datapath that still runs one is refused before
//! anything changes, with the advice to run the next layout's agent on it once first (each
//! upgrades its predecessor without loss): a layout-2 agent (commit b4200bd) for layout 1, a
//! layout-3 agent (commit f530f25) for layout 2. One hop each, tested under traffic, rather
//! than chained translations no release ever ran.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    io::ErrorKind,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::Path,
    time::{Duration, Instant},
};

use aya::{
    maps::{Array, HashMap, LpmTrie, Map, MapData, MapError, MapInfo, PerCpuArray, PerCpuValues},
    programs::{
        links::{FdLink, PinnedLink},
        loaded_programs,
        tc::TcAttachType,
    },
};
use wgfence_common::{map_names, LAYOUT_VERSION};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use super::{
    error::{io_err, map_err, DataplaneError, Result},
    tc,
    tries::{Tries, V4, V6},
};

/// The map layout 3, as main left it at commit f530f25: the only layout this agent upgrades
/// from. Layout 4 changed the policy maps alone, so only their keys are private copies here;
/// every other map's types are layout 4's own, and the sizes test below pins them to layout
/// 3's. A layout that changes one of them copies it here first.
pub(crate) mod v3 {
    use bytemuck::{Pod, Zeroable};
    pub use wgfence_common::{
        Config, FlowKeyV4, FlowKeyV6, FlowValue, PeerCounters, PeerEntry, PeerKeyV4, PeerKeyV6,
        PolicyValue, RuleCounters, RuleSeen, COUNTERS_LEN, MAX_RULES,
    };

    pub const LAYOUT: u32 = 3;
    pub const PEERS_V4: &str = "wgf3_peers_v4";
    pub const PEERS_V6: &str = "wgf3_peers_v6";
    pub const POLICY_V4: &str = "wgf3_policy_v4";
    pub const POLICY_V6: &str = "wgf3_policy_v6";
    pub const STATS: &str = "wgf3_stats";
    pub const PEER_STATS: &str = "wgf3_peer_stats";
    pub const FLOWS_V4: &str = "wgf3_flows_v4";
    pub const FLOWS_V6: &str = "wgf3_flows_v6";
    pub const FLOW_MADE: &str = "wgf3_flow_made";
    pub const FLOW_FREED: &str = "wgf3_flow_freed";
    pub const CONFIG: &str = "wgf3_config";
    pub const RULE_STATS: &str = "wgf3_rule_stats";
    pub const RULE_SEEN: &str = "wgf3_rule_seen";
    /// The maps an upgrade reads: all pinned, unless an upgrade removed some.
    pub const UPGRADED: [&str; 13] = [
        PEERS_V4, PEERS_V6, POLICY_V4, POLICY_V6, STATS, PEER_STATS, FLOWS_V4, FLOWS_V6, FLOW_MADE,
        FLOW_FREED, CONFIG, RULE_STATS, RULE_SEEN,
    ];
    #[cfg(test)]
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
        "wgf3_events",
        "wgf3_ev_bucket",
        RULE_STATS,
        RULE_SEEN,
    ];
    /// Bits of the policy id at the front of every key of the shared trie.
    pub const POLICY_ID_BITS: u32 = 32;

    /// Key data of the shared IPv4 trie: its prefix length counts `policy`'s 32 bits too.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct PolicyKeyV4 {
        pub policy: u32,
        pub addr: [u8; 4],
    }

    /// Key data of the shared IPv6 trie.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct PolicyKeyV6 {
        pub policy: u32,
        pub addr: [u8; 16],
    }

    // SAFETY: #[repr(C)], integers and arrays of integers only, no padding (the `Pod` derives
    // check it).
    unsafe impl aya::Pod for PolicyKeyV4 {}
    unsafe impl aya::Pod for PolicyKeyV6 {}
}

/// Layout 2 (`wgf2_*`): never upgraded directly (see the module doc); its peer map pin holds a
/// tombstone once a newer layout runs.
pub(crate) mod v2 {
    pub const LAYOUT: u32 = 2;
    pub const PEERS_V4: &str = "wgf2_peers_v4";
    /// Its peer entry: `{ policy: u32, slot: u32, owner: u64 }`.
    pub const PEER_ENTRY_SIZE: usize = 16;
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
pub const TOMBSTONE_PINS: [&str; 3] = [v3::PEERS_V4, v2::PEERS_V4, v1::PEERS_V4];
/// Kernel name of the tombstones (`bpftool map show` prints it).
const TOMBSTONE_NAME: &str = "wgf4_tombstone";
/// A pin name for a tombstone before it is renamed into place (bpffs refuses dots).
const TOMBSTONE_TMP: &str = "tombstone_new";
/// The switch marker: a two-entry array of the layout-4 program ids (egress, ingress) an
/// upgrade pins before its switch and removes once layout 3 is tidied away. Without
/// CAP_SYS_ADMIN the kernel shows which program a hook runs (its id) but not that program's
/// maps: a hook running one of these ids runs layout 4, whatever layout-3 pins an interrupted
/// upgrade left.
const SWITCH_PIN: &str = "wgf4_switch";
/// A pin name for the switch marker before it is renamed into place.
const SWITCH_TMP: &str = "switch_new";
/// The markers of the layout 1 -> 2 and 2 -> 3 upgrades, removed if an interrupted one left
/// them.
const OLD_LEFTOVERS: [&str; 2] = ["wgf2_switch", "wgf3_switch"];
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
/// - a program the switch marker names is layout 4 (an upgrade switched it, and was
///   interrupted before it tidied layout 3 away);
/// - a complete set of layout-3 map pins, its peer map under its own name, means layout 3
///   (after an upgrade that name holds a tombstone, an array, and a refused layout-3 agent
///   cannot replace it; an incomplete set is what an upgrade interrupted while it removed them
///   leaves, once layout 4 runs);
/// - a layout-2 or layout-1 peer map under its own name, and no newer one, means that layout;
/// - else a pinned layout-4 peer map means layout 4.
fn layout_by_pins(pin_dir: &Path, program_id: u32) -> Option<u32> {
    use std::mem::size_of;
    if switched_to(pin_dir).contains(&program_id) {
        return Some(LAYOUT_VERSION);
    }
    let v4_peers = MapInfo::from_pin(pin_dir.join(map_names::PEERS_V4)).ok();
    let key_size = size_of::<v3::PeerKeyV4>();
    let v3_peers = is_peer_map(
        &pin_dir.join(v3::PEERS_V4),
        key_size,
        size_of::<v3::PeerEntry>(),
    );
    let v3_complete = v3::UPGRADED.iter().all(|name| pin_dir.join(name).exists());
    if v3_peers && (v3_complete || v4_peers.is_none()) {
        return Some(v3::LAYOUT);
    }
    if v4_peers.is_none() && !v3_peers {
        for (layout, pin, entry_size) in [
            (v2::LAYOUT, v2::PEERS_V4, v2::PEER_ENTRY_SIZE),
            (v1::LAYOUT, v1::PEERS_V4, v1::PEER_ENTRY_SIZE),
        ] {
            if is_peer_map(&pin_dir.join(pin), key_size, entry_size) {
                return Some(layout);
            }
        }
    }
    v4_peers.map(|_| LAYOUT_VERSION)
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

/// Removes the pin at `path`, or the directory of pins there (a layout's policy tries).
fn remove_pin(path: &Path) -> Result<bool> {
    let removed = match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => fs::remove_dir_all(path),
        _ => fs::remove_file(path),
    };
    match removed {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io_err(path)(e)),
    }
}

/// The v3 maps an upgrade reads, opened from the ids the running v3 programs use.
struct OldMaps {
    peers_v4: HashMap<MapData, v3::PeerKeyV4, v3::PeerEntry>,
    peers_v6: HashMap<MapData, v3::PeerKeyV6, v3::PeerEntry>,
    policy_v4: LpmTrie<MapData, v3::PolicyKeyV4, v3::PolicyValue>,
    policy_v6: LpmTrie<MapData, v3::PolicyKeyV6, v3::PolicyValue>,
    stats: PerCpuArray<MapData, u64>,
    peer_stats: PerCpuArray<MapData, v3::PeerCounters>,
    flows_v4: HashMap<MapData, v3::FlowKeyV4, v3::FlowValue>,
    flows_v6: HashMap<MapData, v3::FlowKeyV6, v3::FlowValue>,
    flow_made: Array<MapData, u64>,
    flow_freed: Array<MapData, u64>,
    config: Array<MapData, v3::Config>,
    rule_stats: PerCpuArray<MapData, v3::RuleCounters>,
    rule_seen: Array<MapData, v3::RuleSeen>,
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

impl OldMaps {
    fn open(ids: &BTreeMap<String, u32>, pin_dir: &Path) -> Result<Self> {
        Ok(Self {
            peers_v4: typed_old(v3::PEERS_V4, ids, pin_dir)?,
            peers_v6: typed_old(v3::PEERS_V6, ids, pin_dir)?,
            policy_v4: typed_old(v3::POLICY_V4, ids, pin_dir)?,
            policy_v6: typed_old(v3::POLICY_V6, ids, pin_dir)?,
            stats: typed_old(v3::STATS, ids, pin_dir)?,
            peer_stats: typed_old(v3::PEER_STATS, ids, pin_dir)?,
            flows_v4: typed_old(v3::FLOWS_V4, ids, pin_dir)?,
            flows_v6: typed_old(v3::FLOWS_V6, ids, pin_dir)?,
            flow_made: typed_old(v3::FLOW_MADE, ids, pin_dir)?,
            flow_freed: typed_old(v3::FLOW_FREED, ids, pin_dir)?,
            config: typed_old(v3::CONFIG, ids, pin_dir)?,
            rule_stats: typed_old(v3::RULE_STATS, ids, pin_dir)?,
            rule_seen: typed_old(v3::RULE_SEEN, ids, pin_dir)?,
        })
    }

    fn config(&self) -> Result<v3::Config> {
        self.config.get(&0, 0).map_err(map_err(v3::CONFIG))
    }

    /// Every peer entry: (address, entry).
    fn peers(&self) -> Result<Vec<(IpAddr, v3::PeerEntry)>> {
        let mut peers = Vec::new();
        for item in self.peers_v4.iter() {
            let (key, entry) = item.map_err(map_err(v3::PEERS_V4))?;
            peers.push((IpAddr::from(key.addr), entry));
        }
        for item in self.peers_v6.iter() {
            let (key, entry) = item.map_err(map_err(v3::PEERS_V6))?;
            peers.push((IpAddr::from(key.addr), entry));
        }
        Ok(peers)
    }

    /// Every entry of the shared policy tries: (policy id, destination prefix, value).
    fn policies(&self) -> Result<Vec<(u32, IpNet, v3::PolicyValue)>> {
        let prefix_len = |len: u32, max: u32| {
            len.checked_sub(v3::POLICY_ID_BITS)
                .filter(|len| *len <= max)
                .and_then(|len| u8::try_from(len).ok())
                .ok_or(DataplaneError::OutOfRange {
                    field: "layout-3 policy trie prefix length",
                    value: u64::from(len),
                })
        };
        let mut entries = Vec::new();
        for item in self.policy_v4.iter() {
            let (key, value) = item.map_err(map_err(v3::POLICY_V4))?;
            let len = prefix_len(key.prefix_len(), 32)?;
            let data = key.data();
            let net = Ipv4Net::new(Ipv4Addr::from(data.addr), len).map_err(|_| {
                DataplaneError::OutOfRange {
                    field: "layout-3 policy trie prefix length",
                    value: u64::from(len),
                }
            })?;
            entries.push((data.policy, IpNet::V4(net), value));
        }
        for item in self.policy_v6.iter() {
            let (key, value) = item.map_err(map_err(v3::POLICY_V6))?;
            let len = prefix_len(key.prefix_len(), 128)?;
            let data = key.data();
            let net = Ipv6Net::new(Ipv6Addr::from(data.addr), len).map_err(|_| {
                DataplaneError::OutOfRange {
                    field: "layout-3 policy trie prefix length",
                    value: u64::from(len),
                }
            })?;
            entries.push((data.policy, IpNet::V6(net), value));
        }
        Ok(entries)
    }

    /// Each slot's (made, freed) flow quota counts.
    fn quota(&self, slots: &BTreeSet<u32>) -> Result<BTreeMap<u32, (u64, u64)>> {
        slots
            .iter()
            .map(|slot| {
                let made = self
                    .flow_made
                    .get(slot, 0)
                    .map_err(map_err(v3::FLOW_MADE))?;
                let freed = self
                    .flow_freed
                    .get(slot, 0)
                    .map_err(map_err(v3::FLOW_FREED))?;
                Ok((*slot, (made, freed)))
            })
            .collect()
    }

    fn flows(&self) -> Result<Vec<(FlowKey, v3::FlowValue)>> {
        let mut flows = Vec::new();
        for item in self.flows_v4.iter() {
            let (k, v) = item.map_err(map_err(v3::FLOWS_V4))?;
            flows.push((FlowKey::V4(k), v));
        }
        for item in self.flows_v6.iter() {
            let (k, v) = item.map_err(map_err(v3::FLOWS_V6))?;
            flows.push((FlowKey::V6(k), v));
        }
        Ok(flows)
    }
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum FlowKey {
    V4(wgfence_common::FlowKeyV4),
    V6(wgfence_common::FlowKeyV6),
}

/// The v4 maps an upgrade writes, opened from their pins (the loader just created them).
struct NewMaps {
    peers_v4: HashMap<MapData, wgfence_common::PeerKeyV4, wgfence_common::PeerEntry>,
    peers_v6: HashMap<MapData, wgfence_common::PeerKeyV6, wgfence_common::PeerEntry>,
    policy_v4: Tries<V4>,
    policy_v6: Tries<V6>,
    stats: PerCpuArray<MapData, u64>,
    peer_stats: PerCpuArray<MapData, wgfence_common::PeerCounters>,
    flows_v4: HashMap<MapData, wgfence_common::FlowKeyV4, wgfence_common::FlowValue>,
    flows_v6: HashMap<MapData, wgfence_common::FlowKeyV6, wgfence_common::FlowValue>,
    flow_made: Array<MapData, u64>,
    flow_freed: Array<MapData, u64>,
    config: Array<MapData, wgfence_common::Config>,
    rule_stats: PerCpuArray<MapData, wgfence_common::RuleCounters>,
    rule_seen: Array<MapData, wgfence_common::RuleSeen>,
}

impl NewMaps {
    fn open(pin_dir: &Path) -> Result<Self> {
        fn data(name: &'static str, dir: &Path) -> Result<MapData> {
            MapData::from_pin(dir.join(name)).map_err(map_err(name))
        }
        fn typed<T: TryFrom<Map, Error = MapError>>(name: &'static str, dir: &Path) -> Result<T> {
            let data = data(name, dir)?;
            let info = data.info().map_err(map_err(name))?;
            super::layout::check(name, &info)?;
            let map = Map::from_map_data(data).map_err(map_err(name))?;
            T::try_from(map).map_err(map_err(name))
        }
        Ok(Self {
            peers_v4: typed(map_names::PEERS_V4, pin_dir)?,
            peers_v6: typed(map_names::PEERS_V6, pin_dir)?,
            policy_v4: Tries::new(data(map_names::POLICY_V4, pin_dir)?, Some(pin_dir))?,
            policy_v6: Tries::new(data(map_names::POLICY_V6, pin_dir)?, Some(pin_dir))?,
            stats: typed(map_names::STATS, pin_dir)?,
            peer_stats: typed(map_names::PEER_STATS, pin_dir)?,
            flows_v4: typed(map_names::FLOWS_V4, pin_dir)?,
            flows_v6: typed(map_names::FLOWS_V6, pin_dir)?,
            flow_made: typed(map_names::FLOW_MADE, pin_dir)?,
            flow_freed: typed(map_names::FLOW_FREED, pin_dir)?,
            config: typed(map_names::CONFIG, pin_dir)?,
            rule_stats: typed(map_names::RULE_STATS, pin_dir)?,
            rule_seen: typed(map_names::RULE_SEEN, pin_dir)?,
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

    /// The addresses of every peer entry the v4 maps hold (a resumed upgrade's first fill
    /// wrote them).
    fn peers(&self) -> Result<BTreeSet<IpAddr>> {
        let mut peers = BTreeSet::new();
        for key in self.peers_v4.keys() {
            let key = key.map_err(map_err(map_names::PEERS_V4))?;
            peers.insert(IpAddr::from(key.addr));
        }
        for key in self.peers_v6.keys() {
            let key = key.map_err(map_err(map_names::PEERS_V6))?;
            peers.insert(IpAddr::from(key.addr));
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

    fn upsert_policy(&mut self, policy: u32, prefix: IpNet, value: &v3::PolicyValue) -> Result<()> {
        match prefix {
            IpNet::V4(_) => self.policy_v4.upsert(policy, prefix, value).map(drop),
            IpNet::V6(_) => self.policy_v6.upsert(policy, prefix, value).map(drop),
        }
    }

    /// Copies the v3 flows into the v4 tables. `late`: after the switch, only flows the v4
    /// tables do not have (the v4 programs may have recorded or refreshed them meanwhile); a
    /// v4 flow older than its v3 copy gets the v3 timestamp. Returns how many were copied.
    fn copy_flows(&mut self, flows: &[(FlowKey, v3::FlowValue)], late: bool) -> Result<u64> {
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

/// A per-CPU counter value: what the old programs counted since the fill is added to it.
trait Counts: aya::Pod + Default + PartialEq {
    /// `self` plus (`now` - `before`), field by field.
    fn plus_since(self, now: &Self, before: &Self) -> Self;
}

fn plus(c: u64, now: u64, before: u64) -> u64 {
    c.saturating_add(now.saturating_sub(before))
}

impl Counts for u64 {
    fn plus_since(self, now: &Self, before: &Self) -> Self {
        plus(self, *now, *before)
    }
}

impl Counts for wgfence_common::PeerCounters {
    fn plus_since(self, n: &Self, b: &Self) -> Self {
        Self {
            pass_packets: plus(self.pass_packets, n.pass_packets, b.pass_packets),
            pass_bytes: plus(self.pass_bytes, n.pass_bytes, b.pass_bytes),
            drop_packets: plus(self.drop_packets, n.drop_packets, b.drop_packets),
            drop_bytes: plus(self.drop_bytes, n.drop_bytes, b.drop_bytes),
            audit_packets: plus(self.audit_packets, n.audit_packets, b.audit_packets),
            audit_bytes: plus(self.audit_bytes, n.audit_bytes, b.audit_bytes),
        }
    }
}

impl Counts for wgfence_common::RuleCounters {
    fn plus_since(self, n: &Self, b: &Self) -> Self {
        Self {
            packets: plus(self.packets, n.packets, b.packets),
            bytes: plus(self.bytes, n.bytes, b.bytes),
        }
    }
}

/// Per-CPU counters as the fill read them, by index (indexes whose every CPU read zero are
/// left out).
type Snapshot<T> = BTreeMap<u32, Vec<T>>;

/// Copies `indexes` of a per-CPU counter array, CPU by CPU (skipping all-zero ones, which
/// the new array already holds); returns what it read.
fn copy_counters<T: Counts>(
    from: &PerCpuArray<MapData, T>,
    (to, name): (&mut PerCpuArray<MapData, T>, &'static str),
    indexes: impl IntoIterator<Item = u32>,
) -> Result<Snapshot<T>> {
    let zero = T::default();
    let mut read = BTreeMap::new();
    for index in indexes {
        let values = from.get(&index, 0).map_err(map_err(name))?.to_vec();
        if values.iter().all(|v| *v == zero) {
            continue;
        }
        to.set(index, per_cpu_values(name, values.clone())?, 0)
            .map_err(map_err(name))?;
        read.insert(index, values);
    }
    Ok(read)
}

/// Adds to the new array what the old programs counted at `indexes` since `before` was read.
/// Racing the new programs' own increments between one read and one write per counter: at
/// worst a handful of packets go uncounted, never miscounted as another verdict.
fn add_counted_since<T: Counts>(
    from: &PerCpuArray<MapData, T>,
    (to, name): (&mut PerCpuArray<MapData, T>, &'static str),
    before: &Snapshot<T>,
    indexes: impl IntoIterator<Item = u32>,
) -> Result<()> {
    let zero = T::default();
    for index in indexes {
        let now = from.get(&index, 0).map_err(map_err(name))?.to_vec();
        let was = before.get(&index);
        let unchanged = match was {
            Some(was) => now == *was,
            None => now.iter().all(|v| *v == zero),
        };
        if unchanged {
            continue;
        }
        let current = to.get(&index, 0).map_err(map_err(name))?;
        let values: Vec<T> = current
            .iter()
            .zip(&now)
            .enumerate()
            .map(|(cpu, (c, n))| {
                let b = was.and_then(|w| w.get(cpu)).unwrap_or(&zero);
                c.plus_since(n, b)
            })
            .collect();
        to.set(index, per_cpu_values(name, values)?, 0)
            .map_err(map_err(name))?;
    }
    Ok(())
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
    /// Policies, each now a trie of its own (per address family it has entries for).
    pub policies: usize,
    pub flows: u64,
    /// Flows the v3 programs recorded between the fill and the switch, copied after it.
    pub flows_late: u64,
    /// From the first program switch to the last.
    pub switch: Duration,
    /// From the first read of the v3 maps to the removal of their pins.
    pub total: Duration,
}

/// The counters the fill read, which the finish compares with what the old programs counted
/// by then.
#[derive(Default)]
struct Counted {
    stats: Snapshot<u64>,
    peer_stats: Snapshot<wgfence_common::PeerCounters>,
    rule_stats: Snapshot<wgfence_common::RuleCounters>,
    /// The slots of the peer entries carried over.
    slots: BTreeSet<u32>,
}

/// An upgrade from layout 3 in progress: found by [`Upgrade::prepare`] before the v4 maps
/// are loaded, [`Upgrade::fill`]ed before the switch, [`Upgrade::finish`]ed after it.
pub(crate) struct Upgrade {
    old: OldMaps,
    /// The v4 maps were created by this start: counters are carried. `false` after an
    /// upgrade interrupted between its two program switches, whose fill already carried them.
    fresh: bool,
    started: Instant,
    counted: Counted,
    report: UpgradeReport,
}

impl Upgrade {
    /// Looks at what the hooks run (`ingress`, `egress`). Layout 3 on ingress: an upgrade,
    /// whose v3 maps are opened here; stale v4 pins of an upgrade interrupted before its switch
    /// are removed (no program uses them), so the loader creates the v4 maps empty. A layout
    /// newer than this agent's, or layout 1 or 2, is refused before anything is touched.
    /// Anything else: no upgrade.
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
                Some(layout) if layout < v3::LAYOUT => {
                    return Err(DataplaneError::UpgradeThroughOlder {
                        pin_dir: pin_dir.to_owned(),
                        layout,
                    })
                }
                _ => {}
            }
        }
        let Some(ingress) = ingress.filter(|r| r.layout == Some(v3::LAYOUT)) else {
            return Ok(None);
        };
        let egress_new = egress
            .as_ref()
            .is_some_and(|r| r.layout == Some(LAYOUT_VERSION));
        let mut ids = ingress.maps.clone();
        if let Some(egress) = egress.filter(|r| r.layout == Some(v3::LAYOUT)) {
            for (name, id) in egress.maps {
                ids.entry(name).or_insert(id);
            }
        }
        // The layout-3 agent must be stopped first (a DaemonSet rollout with maxSurge 0 does):
        // running, it would find its programs replaced and attach them again.
        let pids = holders(&ingress);
        if !pids.is_empty() {
            return Err(DataplaneError::OldAgentRunning {
                layout: v3::LAYOUT,
                pids,
            });
        }
        let started = Instant::now();
        let old = OldMaps::open(&ids, pin_dir)?;
        if !egress_new {
            for name in pins_of_layout(pin_dir, LAYOUT_VERSION)? {
                remove_pin(&pin_dir.join(&name))?;
            }
        }
        tracing::info!(
            pin_dir = %pin_dir.display(),
            from = v3::LAYOUT,
            to = LAYOUT_VERSION,
            ingress_program = ingress.program_id,
            resumed = egress_new,
            "the datapath runs map layout 3: upgrading it (fill the new maps, then switch the \
             programs)"
        );
        Ok(Some(Self {
            old,
            fresh: !egress_new,
            started,
            counted: Counted::default(),
            report: UpgradeReport {
                from_layout: v3::LAYOUT,
                ..UpgradeReport::default()
            },
        }))
    }

    /// Copies the v3 maps into the (loaded, not yet attached) v4 maps pinned in `pin_dir`.
    /// The v3 programs keep enforcing meanwhile; an error leaves them so.
    pub(crate) fn fill(&mut self, pin_dir: &Path) -> Result<()> {
        let mut new = NewMaps::open(pin_dir)?;
        // The config first (nothing runs on these maps yet), verbatim.
        new.config
            .set(0, self.old.config()?, 0)
            .map_err(map_err(map_names::CONFIG))?;
        self.fill_policies(&mut new)?;
        let peers = self.old.peers()?;
        self.fill_peers(&mut new, &peers)?;
        self.counted.slots = peers.iter().map(|(_, e)| e.slot).collect();
        if self.fresh {
            self.fill_counters(&mut new)?;
        }
        // Flows last, closest to the switch.
        let flows = self.old.flows()?;
        new.copy_flows(&flows, false)?;
        self.report.flows = flows.len() as u64;
        Ok(())
    }

    /// Each policy's entries into its own trie, before any peer entry; entries of no v3
    /// policy go (a resumed upgrade only).
    fn fill_policies(&mut self, new: &mut NewMaps) -> Result<()> {
        let entries = self.old.policies()?;
        for (policy, prefix, value) in &entries {
            new.upsert_policy(*policy, *prefix, value)?;
        }
        new.policy_v4.flush()?;
        new.policy_v6.flush()?;
        if !self.fresh {
            let keep: BTreeSet<(u32, IpNet)> = entries.iter().map(|(p, n, _)| (*p, *n)).collect();
            let mut other = Vec::new();
            let mut collect = |policy, prefix, _: &wgfence_common::PolicyValue| {
                if !keep.contains(&(policy, prefix)) {
                    other.push((policy, prefix));
                }
            };
            new.policy_v4.each(&mut collect)?;
            new.policy_v6.each(&mut collect)?;
            for (policy, prefix) in other {
                match prefix {
                    IpNet::V4(_) => new.policy_v4.remove(policy, prefix)?,
                    IpNet::V6(_) => new.policy_v6.remove(policy, prefix)?,
                };
            }
        }
        self.report.policy_entries = entries.len();
        self.report.policies = entries
            .iter()
            .map(|(p, _, _)| *p)
            .collect::<BTreeSet<_>>()
            .len();
        Ok(())
    }

    /// Peer entries as they are, after the policies they reference; entries of no v3 peer go
    /// (a resumed upgrade's, of a peer since removed: none, the v3 agent is stopped; kept for
    /// a state the first fill could not see).
    fn fill_peers(&mut self, new: &mut NewMaps, peers: &[(IpAddr, v3::PeerEntry)]) -> Result<()> {
        for (addr, entry) in peers {
            new.upsert_peer(*addr, *entry)?;
        }
        if !self.fresh {
            let wanted: BTreeSet<IpAddr> = peers.iter().map(|(a, _)| *a).collect();
            for addr in new.peers()? {
                if !wanted.contains(&addr) {
                    new.remove_peer(addr)?;
                }
            }
        }
        self.report.peer_entries = peers.len();
        self.report.owners = peers
            .iter()
            .map(|(_, e)| e.owner)
            .collect::<BTreeSet<_>>()
            .len() as u64;
        Ok(())
    }

    /// Counters: the v3 values now; what the v3 programs count until the switch is added
    /// after it. Both layouts count per CPU: each CPU's copy goes to the same CPU's.
    fn fill_counters(&mut self, new: &mut NewMaps) -> Result<()> {
        let old = &self.old;
        let c = &mut self.counted;
        c.stats = copy_counters(
            &old.stats,
            (&mut new.stats, map_names::STATS),
            0..v3::COUNTERS_LEN,
        )?;
        c.peer_stats = copy_counters(
            &old.peer_stats,
            (&mut new.peer_stats, map_names::PEER_STATS),
            c.slots.iter().copied(),
        )?;
        c.rule_stats = copy_counters(
            &old.rule_stats,
            (&mut new.rule_stats, map_names::RULE_STATS),
            0..v3::MAX_RULES,
        )?;
        // Written by the agent only: as it is.
        for item in old.rule_seen.iter().enumerate() {
            let (index, seen) = item;
            let seen = seen.map_err(map_err(v3::RULE_SEEN))?;
            if seen != v3::RuleSeen::default() {
                let index = u32::try_from(index).unwrap_or(u32::MAX);
                new.rule_seen
                    .set(index, seen, 0)
                    .map_err(map_err(map_names::RULE_SEEN))?;
            }
        }
        // The flow quota as it stands (the attach recounts it from the tables anyway).
        for (slot, (made, freed)) in old.quota(&c.slots)? {
            new.flow_made
                .set(slot, made, 0)
                .map_err(map_err(map_names::FLOW_MADE))?;
            new.flow_freed
                .set(slot, freed, 0)
                .map_err(map_err(map_names::FLOW_FREED))?;
        }
        Ok(())
    }

    /// Pins the switch marker naming the loaded layout-4 programs: from here on, a hook that
    /// runs one of them runs layout 4, also for an agent that cannot look programs up.
    pub(crate) fn mark_switch(&self, pin_dir: &Path, program_ids: &[u32]) -> Result<()> {
        mark_switch(pin_dir, program_ids)
    }

    /// After both hooks run the v4 programs: copies what the v3 programs recorded since the
    /// fill, adds what they counted since, removes the v3 pins and leaves the tombstones.
    /// `switch` is how long the program switches took.
    pub(crate) fn finish(mut self, pin_dir: &Path, switch: Duration) -> Result<UpgradeReport> {
        let mut new = NewMaps::open(pin_dir)?;
        self.report.flows_late = new.copy_flows(&self.old.flows()?, true)?;
        if self.fresh {
            let (old, c) = (&self.old, &self.counted);
            add_counted_since(
                &old.stats,
                (&mut new.stats, map_names::STATS),
                &c.stats,
                0..v3::COUNTERS_LEN,
            )?;
            add_counted_since(
                &old.peer_stats,
                (&mut new.peer_stats, map_names::PEER_STATS),
                &c.peer_stats,
                c.slots.iter().copied(),
            )?;
            add_counted_since(
                &old.rule_stats,
                (&mut new.rule_stats, map_names::RULE_STATS),
                &c.rule_stats,
                0..v3::MAX_RULES,
            )?;
        }
        // The v3 maps go with their pins (and this agent's fds, dropped with `self`), the
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
            policies = r.policies,
            flows = r.flows,
            flows_late = r.flows_late,
            switch_us = r.switch.as_micros() as u64,
            total_ms = r.total.as_millis() as u64,
            "upgraded the datapath from map layout 3 to 4; the layout-3 maps are removed"
        );
        Ok(self.report)
    }
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
            // The v4 programs have it: the v3 programs' view wins if they saw it later.
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
            // Recorded by the v4 programs meanwhile: theirs stands.
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

/// Whether the pin at `path` is a tombstone (this agent's, or one an older agent placed at an
/// older layout's peer map: an array either way, which no older agent accepts).
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
/// layouts 1 to 3 that remain (maps a refused older agent created, or an upgrade interrupted
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

/// Once layout 4 runs: the tombstones first (from then on the pins say layout 4 even without
/// the switch marker), then every other pin of layouts 1 to 3, then the switch markers. Each
/// step is idempotent, so an interrupted run is finished by the next one (at the next start's
/// [`tidy`]). Returns the names of the old pins removed.
fn retire_old_layouts(pin_dir: &Path) -> Result<Vec<String>> {
    for pin in TOMBSTONE_PINS {
        if !is_tombstone(&pin_dir.join(pin)) {
            place_tombstone(pin_dir, pin)?;
        }
    }
    let mut removed = Vec::new();
    for layout in [v3::LAYOUT, v2::LAYOUT, v1::LAYOUT] {
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
        for name in v3::ALL {
            assert_eq!(name_layout(name), Some(3), "{name}");
        }
        for name in map_names::ALL
            .into_iter()
            .chain([map_names::TRIE_V4, map_names::TRIE_V6])
            .chain([map_names::TRIES_V4, map_names::TRIES_V6])
        {
            assert_eq!(name_layout(name), Some(LAYOUT_VERSION), "{name}");
        }
        assert_eq!(name_layout(TOMBSTONE_NAME), Some(LAYOUT_VERSION));
        assert_eq!(name_layout(SWITCH_PIN), Some(LAYOUT_VERSION));
        assert_eq!(name_layout(v2::PEERS_V4), Some(v2::LAYOUT));
        assert_eq!(name_layout(v1::PEERS_V4), Some(v1::LAYOUT));
    }

    /// Layout 3's sizes, as commit f530f25 has them: the types this module shares with
    /// layout 4 must keep them.
    #[test]
    fn v3_types_keep_their_v3_sizes() {
        use core::mem::size_of;
        assert_eq!(size_of::<v3::PeerKeyV4>(), 4);
        assert_eq!(size_of::<v3::PeerKeyV6>(), 16);
        assert_eq!(size_of::<v3::PeerEntry>(), 40);
        assert_eq!(size_of::<v3::PolicyKeyV4>(), 8);
        assert_eq!(size_of::<v3::PolicyKeyV6>(), 20);
        assert_eq!(size_of::<v3::PolicyValue>(), 4 + 8 * 32);
        assert_eq!(size_of::<v3::PeerCounters>(), 48);
        assert_eq!(size_of::<v3::RuleCounters>(), 16);
        assert_eq!(size_of::<v3::RuleSeen>(), 16);
        assert_eq!(size_of::<v3::FlowKeyV4>(), 16);
        assert_eq!(size_of::<v3::FlowKeyV6>(), 40);
        assert_eq!(size_of::<v3::FlowValue>(), 24);
        assert_eq!(size_of::<v3::Config>(), 72);
        assert_eq!(v3::COUNTERS_LEN, 32);
        assert_eq!(v3::MAX_RULES, 65_536);
    }

    #[test]
    fn counters_add_what_was_counted_since() {
        let before = wgfence_common::PeerCounters {
            pass_packets: 5,
            drop_bytes: 100,
            ..Default::default()
        };
        let now = wgfence_common::PeerCounters {
            pass_packets: 7,
            drop_bytes: 160,
            audit_packets: 1,
            ..Default::default()
        };
        let current = wgfence_common::PeerCounters {
            pass_packets: 3,
            ..Default::default()
        };
        let sum = current.plus_since(&now, &before);
        assert_eq!(sum.pass_packets, 5);
        assert_eq!(sum.drop_bytes, 60);
        assert_eq!(sum.audit_packets, 1);
        // A counter that went backwards (a reset) adds nothing.
        assert_eq!(4u64.plus_since(&1, &3), 4);
    }
}
