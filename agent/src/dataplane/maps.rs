//! Typed access to the datapath's maps: peers by address, policy entries by (policy id,
//! prefix) in each policy's own trie ([`super::tries`]), counters. Every update and delete is counted, so the agent can report exactly how
//! many kernel writes a reconcile cost.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::AsFd as _,
    path::Path,
};

use aya::{
    maps::{Array, HashMap, IterableMap, Map, MapData, MapError, PerCpuArray, PerCpuValues},
    Ebpf,
};
use ipnet::IpNet;
use wgfence_common::{
    map_names, Config, Counter, FlowKeyV4, FlowKeyV6, FlowValue, PeerCounters, PeerEntry,
    PeerKeyV4, PeerKeyV6, PolicyValue, RuleCounters, RuleSeen, COUNTERS_LEN, MAX_PEERS,
};

use super::{
    error::{map_err, syscall_err, DataplaneError, Result},
    layout, sys,
    tries::{Tries, V4, V6},
};

/// One policy trie entry as stored in the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyEntry {
    pub policy: u32,
    pub prefix: IpNet,
    pub value: PolicyValue,
}

/// One entry of the reply flow tables: a flow the network started toward a restricted peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flow {
    /// The peer's tunnel address.
    pub peer: IpAddr,
    /// The address that started the flow.
    pub remote: IpAddr,
    pub protocol: u8,
    /// The peer's port (ICMP echo: the identifier).
    pub peer_port: u16,
    /// The remote's port (ICMP echo: 0).
    pub remote_port: u16,
    pub value: FlowValue,
}

/// Packet counters summed over all CPUs, indexed by [`Counter`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters([u64; COUNTERS_LEN as usize]);

impl Counters {
    pub fn get(&self, counter: Counter) -> u64 {
        self.0[counter as usize]
    }

    pub fn passed(&self) -> u64 {
        Counter::ALL
            .iter()
            .filter(|c| c.is_pass())
            .map(|c| self.get(*c))
            .sum()
    }

    pub fn dropped(&self) -> u64 {
        Counter::ALL
            .iter()
            .filter(|c| !c.is_pass())
            .map(|c| self.get(*c))
            .sum()
    }
}

/// The datapath's maps, opened from a loaded object or from their pins.
pub struct Maps {
    peers_v4: HashMap<MapData, PeerKeyV4, PeerEntry>,
    peers_v6: HashMap<MapData, PeerKeyV6, PeerEntry>,
    policy_v4: Tries<V4>,
    policy_v6: Tries<V6>,
    stats: PerCpuArray<MapData, u64>,
    peer_stats: PerCpuArray<MapData, PeerCounters>,
    flows_v4: HashMap<MapData, FlowKeyV4, FlowValue>,
    flows_v6: HashMap<MapData, FlowKeyV6, FlowValue>,
    flow_made: Array<MapData, u64>,
    flow_freed: Array<MapData, u64>,
    config: Array<MapData, Config>,
    /// Held, never used here: the programs are loaded against these maps' file descriptors,
    /// which must stay open until then (`wgfence monitor` opens the ring buffer's pin).
    _events: MapData,
    _event_bucket: MapData,
    rule_stats: PerCpuArray<MapData, RuleCounters>,
    rule_seen: Array<MapData, RuleSeen>,
    writes: u64,
}

/// Every (key, value) of a hash or array map: batched reads ([`sys::lookup_batch`]) where the
/// kernel has them for the map, else `iter`'s two calls per entry.
fn entries<K, V, M, I>(map: &M, name: &'static str, iter: impl FnOnce() -> I) -> Result<Vec<(K, V)>>
where
    K: aya::Pod,
    V: aya::Pod,
    M: IterableMap<K, V>,
    I: Iterator<Item = std::result::Result<(K, V), MapError>>,
{
    match sys::lookup_batch::<K, V>(map.map().fd().as_fd())
        .map_err(syscall_err(name, "bpf_map_lookup_batch"))?
    {
        Some(all) => Ok(all),
        None => iter()
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(map_err(name)),
    }
}

/// `Ok(false)` for a delete of a key that is not there: deleting what is already gone is not
/// an error.
pub(super) fn removed(map: &'static str, result: Result<(), MapError>) -> Result<bool> {
    match result {
        Ok(()) => Ok(true),
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {
            Ok(false)
        }
        Err(MapError::KeyNotFound | MapError::ElementNotFound) => Ok(false),
        Err(source) => Err(DataplaneError::Map { map, source }),
    }
}

/// Takes one map out of `source`, checks its layout and converts it to its typed form.
fn typed<T>(name: &'static str, data: MapData) -> Result<T>
where
    T: TryFrom<Map, Error = MapError>,
{
    let info = data.info().map_err(map_err(name))?;
    layout::check(name, &info)?;
    let map = Map::from_map_data(data).map_err(map_err(name))?;
    T::try_from(map).map_err(map_err(name))
}

impl Maps {
    /// Takes the maps out of a loaded object, checking each one's layout. The policy tries
    /// are pinned under `pin_dir`, or held by this value without one.
    pub(crate) fn from_ebpf(ebpf: &mut Ebpf, pin_dir: Option<&Path>) -> Result<Self> {
        Self::open(pin_dir, |name| {
            ebpf.take_map(name)
                .map(|map| match map {
                    Map::HashMap(d)
                    | Map::ArrayOfMaps(d)
                    | Map::PerCpuArray(d)
                    | Map::Array(d)
                    | Map::RingBuf(d) => Ok(d),
                    _ => Err(DataplaneError::MissingMap(name)),
                })
                .unwrap_or(Err(DataplaneError::MissingMap(name)))
        })
    }

    /// Opens the maps pinned in `dir`, checking each one's layout.
    pub(crate) fn from_pins(dir: &Path) -> Result<Self> {
        Self::open(Some(dir), |name| {
            MapData::from_pin(dir.join(name)).map_err(map_err(name))
        })
    }

    fn open(
        pin_dir: Option<&Path>,
        mut data: impl FnMut(&'static str) -> Result<MapData>,
    ) -> Result<Self> {
        // Maps the agent never reads or writes (the ring buffer, the rate limiter's state) are
        // still checked: an adopted pin of another layout must fail the load.
        let unused = |name: &'static str, map: MapData| -> Result<MapData> {
            layout::check(name, &map.info().map_err(map_err(name))?)?;
            Ok(map)
        };
        Ok(Self {
            _events: unused(map_names::EVENTS, data(map_names::EVENTS)?)?,
            _event_bucket: unused(map_names::EVENT_BUCKET, data(map_names::EVENT_BUCKET)?)?,
            peers_v4: typed(map_names::PEERS_V4, data(map_names::PEERS_V4)?)?,
            peers_v6: typed(map_names::PEERS_V6, data(map_names::PEERS_V6)?)?,
            policy_v4: Tries::new(data(map_names::POLICY_V4)?, pin_dir)?,
            policy_v6: Tries::new(data(map_names::POLICY_V6)?, pin_dir)?,
            stats: typed(map_names::STATS, data(map_names::STATS)?)?,
            peer_stats: typed(map_names::PEER_STATS, data(map_names::PEER_STATS)?)?,
            flows_v4: typed(map_names::FLOWS_V4, data(map_names::FLOWS_V4)?)?,
            flows_v6: typed(map_names::FLOWS_V6, data(map_names::FLOWS_V6)?)?,
            flow_made: typed(map_names::FLOW_MADE, data(map_names::FLOW_MADE)?)?,
            flow_freed: typed(map_names::FLOW_FREED, data(map_names::FLOW_FREED)?)?,
            config: typed(map_names::CONFIG, data(map_names::CONFIG)?)?,
            rule_stats: typed(map_names::RULE_STATS, data(map_names::RULE_STATS)?)?,
            rule_seen: typed(map_names::RULE_SEEN, data(map_names::RULE_SEEN)?)?,
            writes: 0,
        })
    }

    /// Map updates and deletes issued through this handle.
    pub fn writes(&self) -> u64 {
        self.writes
    }

    /// Inserts or replaces the entry of one peer address. Switching a peer to another policy is
    /// this one update: the next packet sees the new policy. New policy tries go into their
    /// arrays first ([`Self::flush_policies`]), so the entry never names a policy the datapath
    /// cannot find.
    pub fn upsert_peer(&mut self, addr: IpAddr, entry: PeerEntry) -> Result<()> {
        self.flush_policies()?;
        self.writes += 1;
        match addr {
            IpAddr::V4(a) => self
                .peers_v4
                .insert(PeerKeyV4 { addr: a.octets() }, entry, 0)
                .map_err(map_err(map_names::PEERS_V4)),
            IpAddr::V6(a) => self
                .peers_v6
                .insert(PeerKeyV6 { addr: a.octets() }, entry, 0)
                .map_err(map_err(map_names::PEERS_V6)),
        }
    }

    /// Deletes the entry of one peer address; `false` if there was none.
    pub fn remove_peer(&mut self, addr: IpAddr) -> Result<bool> {
        self.writes += 1;
        match addr {
            IpAddr::V4(a) => removed(
                map_names::PEERS_V4,
                self.peers_v4.remove(&PeerKeyV4 { addr: a.octets() }),
            ),
            IpAddr::V6(a) => removed(
                map_names::PEERS_V6,
                self.peers_v6.remove(&PeerKeyV6 { addr: a.octets() }),
            ),
        }
    }

    /// The entry of one peer address, if any.
    pub fn peer(&self, addr: IpAddr) -> Result<Option<PeerEntry>> {
        let found = match addr {
            IpAddr::V4(a) => self.peers_v4.get(&PeerKeyV4 { addr: a.octets() }, 0),
            IpAddr::V6(a) => self.peers_v6.get(&PeerKeyV6 { addr: a.octets() }, 0),
        };
        match found {
            Ok(entry) => Ok(Some(entry)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(source) => Err(DataplaneError::Map {
                map: if addr.is_ipv4() {
                    map_names::PEERS_V4
                } else {
                    map_names::PEERS_V6
                },
                source,
            }),
        }
    }

    /// All peer entries, sorted by address.
    pub fn peers(&self) -> Result<Vec<(IpAddr, PeerEntry)>> {
        let mut peers = self.peers_unsorted()?;
        peers.sort_unstable_by_key(|(addr, _)| *addr);
        Ok(peers)
    }

    /// All peer entries, in the tables' order (batched reads: see [`entries`]).
    fn peers_unsorted(&self) -> Result<Vec<(IpAddr, PeerEntry)>> {
        let v4 = entries(&self.peers_v4, map_names::PEERS_V4, || self.peers_v4.iter())?;
        let v6 = entries(&self.peers_v6, map_names::PEERS_V6, || self.peers_v6.iter())?;
        let mut peers = Vec::with_capacity(v4.len() + v6.len());
        peers.extend(
            v4.into_iter()
                .map(|(key, entry)| (IpAddr::V4(Ipv4Addr::from(key.addr)), entry)),
        );
        peers.extend(
            v6.into_iter()
                .map(|(key, entry)| (IpAddr::V6(Ipv6Addr::from(key.addr)), entry)),
        );
        Ok(peers)
    }

    /// Inserts or replaces the entry of (policy, prefix) in the policy's trie. Host bits of
    /// `prefix` are cleared: the kernel would keep them in the key and `policies()` would not
    /// round-trip. A policy whose slot holds no trie gets a new one (with spares for the next
    /// ids), which goes into the array of maps at the next [`Self::flush_policies`].
    pub fn upsert_policy(&mut self, policy: u32, prefix: IpNet, value: &PolicyValue) -> Result<()> {
        self.writes += 1;
        match prefix {
            IpNet::V4(_) => self.policy_v4.upsert(policy, prefix, value)?,
            IpNet::V6(_) => self.policy_v6.upsert(policy, prefix, value)?,
        };
        Ok(())
    }

    /// Deletes the entry of (policy, prefix); `false` if there was none. A trie left without
    /// entries stays, empty, for the next policy of that id.
    pub fn remove_policy(&mut self, policy: u32, prefix: IpNet) -> Result<bool> {
        self.writes += 1;
        match prefix {
            IpNet::V4(_) => self.policy_v4.remove(policy, prefix),
            IpNet::V6(_) => self.policy_v6.remove(policy, prefix),
        }
    }

    /// Makes the policy tries' pin directories where they are missing; the directories that
    /// were (the pins of the tries the datapath holds went with them: the agent reads those
    /// again once it has written them again).
    pub(crate) fn restore_tries_dirs(&mut self) -> Result<Vec<&'static str>> {
        let mut lost = Vec::new();
        if self.policy_v4.restore_dir()? {
            lost.push(map_names::TRIES_V4);
        }
        if self.policy_v6.restore_dir()? {
            lost.push(map_names::TRIES_V6);
        }
        Ok(lost)
    }

    /// Puts the new policy tries into their arrays of maps: one batch per family, since each
    /// update of an array of maps waits for an RCU grace period (see [`super::tries`]); one
    /// write per slot. Every peer write does this first; an apply does it at its end.
    pub fn flush_policies(&mut self) -> Result<()> {
        self.writes += self.policy_v4.flush()?;
        self.writes += self.policy_v6.flush()?;
        Ok(())
    }

    /// All policy trie entries, sorted by (policy, prefix).
    pub fn policies(&self) -> Result<Vec<PolicyEntry>> {
        let mut entries = Vec::new();
        self.each_policy_entry(|policy, prefix, value| {
            entries.push(PolicyEntry {
                policy,
                prefix,
                value: *value,
            });
        })?;
        entries.sort_unstable_by_key(|e| (e.policy, e.prefix));
        Ok(entries)
    }

    /// Every policy trie entry, in the tries' own order, handed to `each` as it is read: no
    /// list of whole map values (260 bytes an entry, most of them unused: about 80 MiB for
    /// the 291,000 entries of a policy per peer at 60k peers).
    pub fn each_policy_entry(&self, mut each: impl FnMut(u32, IpNet, &PolicyValue)) -> Result<()> {
        self.policy_v4.each(&mut each)?;
        self.policy_v6.each(&mut each)
    }

    /// Frees the empty policy tries of the ids neither in `in_use` (every policy id a peer
    /// entry or a trie entry uses) nor among the spares the planner fills next, at most
    /// `budget` per address family ([`Tries::reclaim`]); each slot given back counts as a map
    /// write. The number freed.
    pub fn reclaim_policy_tries(&mut self, in_use: &BTreeSet<u32>, budget: usize) -> Result<u64> {
        let n = self.policy_v4.reclaim(in_use, budget)? + self.policy_v6.reclaim(in_use, budget)?;
        self.writes += n;
        Ok(n)
    }

    /// Packet counters summed over all CPUs.
    pub fn counters(&self) -> Result<Counters> {
        let mut counters = Counters::default();
        for (index, total) in counters.0.iter_mut().enumerate() {
            let index = index as u32;
            let per_cpu = self
                .stats
                .get(&index, 0)
                .map_err(map_err(map_names::STATS))?;
            *total = per_cpu.iter().sum();
        }
        Ok(counters)
    }

    /// Counters of one peer slot, summed over all CPUs.
    pub fn peer_counters(&self, slot: u32) -> Result<PeerCounters> {
        let per_cpu = self
            .peer_stats
            .get(&slot, 0)
            .map_err(map_err(map_names::PEER_STATS))?;
        Ok(sum_peer_counters(per_cpu.iter()))
    }

    /// The datapath's settings as the kernel has them (all zero before the agent writes them).
    pub fn config(&self) -> Result<Config> {
        self.config.get(&0, 0).map_err(map_err(map_names::CONFIG))
    }

    /// Replaces the datapath's settings; the next packet sees them.
    pub fn set_config(&mut self, config: &Config) -> Result<()> {
        self.writes += 1;
        self.config
            .set(0, config, 0)
            .map_err(map_err(map_names::CONFIG))
    }

    /// Every recorded reply flow, sorted by (peer, remote, protocol, ports). Expired flows are
    /// included until the agent's sweep deletes them: the datapath checks the timeout at lookup.
    pub fn flows(&self) -> Result<Vec<Flow>> {
        let mut flows = self.flows_unsorted()?;
        flows.sort_unstable_by_key(|f| (f.peer, f.remote, f.protocol, f.peer_port, f.remote_port));
        Ok(flows)
    }

    /// Deletes the reply flows `forget` selects (one pass over each table) and counts each
    /// deleted flow as freed for its slot ([`map_names::FLOW_FREED`]), which gives the slot's
    /// quota back; returns how many went. Flows the datapath adds meanwhile are not affected.
    pub fn remove_flows(&mut self, forget: impl Fn(&Flow) -> bool) -> Result<u64> {
        let mut flows = self.flows_unsorted()?;
        flows.retain(|f| forget(f));
        self.remove_flow_list(&flows)
    }

    /// The value of the flow with `flow`'s key (its value is ignored), if the table has one:
    /// one lookup, for `wgfence explain`.
    pub fn flow(&self, flow: &Flow) -> Result<Option<FlowValue>> {
        let found = match flow_key(flow) {
            Some(FlowKey::V4(key)) => self.flows_v4.get(&key, 0),
            Some(FlowKey::V6(key)) => self.flows_v6.get(&key, 0),
            None => return Ok(None),
        };
        match found {
            Ok(value) => Ok(Some(value)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {
                Ok(None)
            }
            Err(source) => Err(DataplaneError::Map {
                map: if flow.peer.is_ipv4() {
                    map_names::FLOWS_V4
                } else {
                    map_names::FLOWS_V6
                },
                source,
            }),
        }
    }

    /// Every recorded reply flow, in the tables' order (what [`Maps::flows`] sorts).
    pub fn flows_unsorted(&self) -> Result<Vec<Flow>> {
        let v4 = entries(&self.flows_v4, map_names::FLOWS_V4, || self.flows_v4.iter())?;
        let v6 = entries(&self.flows_v6, map_names::FLOWS_V6, || self.flows_v6.iter())?;
        let mut flows = Vec::with_capacity(v4.len() + v6.len());
        flows.extend(v4.iter().map(|(key, value)| flow_v4(key, *value)));
        flows.extend(v6.iter().map(|(key, value)| flow_v6(key, *value)));
        Ok(flows)
    }

    /// Deletes these flows (by key) and counts each one deleted as freed for its slot; one
    /// already gone was deleted by another handle (a test) and counted there. Returns how many
    /// went. The agent is the only writer of `freed`, one at a time: a count read and written
    /// back by two writers at once would lose one's flows.
    ///
    /// A flow is counted after it is deleted: if the agent stops in between, the slot's quota
    /// stays short by those flows (fewer replies, never more) until the next start recounts it
    /// ([`Maps::recount_flow_quota`], run by [`super::Dataplane::attach`]).
    pub fn remove_flow_list(&mut self, flows: &[Flow]) -> Result<u64> {
        let mut freed: BTreeMap<u32, u64> = BTreeMap::new();
        for flow in flows {
            self.writes += 1;
            let gone = match flow_key(flow) {
                Some(FlowKey::V4(key)) => removed(map_names::FLOWS_V4, self.flows_v4.remove(&key))?,
                Some(FlowKey::V6(key)) => removed(map_names::FLOWS_V6, self.flows_v6.remove(&key))?,
                None => false,
            };
            if gone {
                *freed.entry(flow.value.slot).or_default() += 1;
            }
        }
        let mut count = 0;
        for (slot, n) in freed {
            let total = self
                .flow_freed
                .get(&slot, 0)
                .map_err(map_err(map_names::FLOW_FREED))?;
            self.writes += 1;
            self.flow_freed
                .set(slot, total.wrapping_add(n), 0)
                .map_err(map_err(map_names::FLOW_FREED))?;
            count += n;
        }
        Ok(count)
    }

    /// Flows recorded for `slot` by the datapath, and deleted by the agent: the slot holds
    /// `made - freed` flows.
    #[cfg(any(test, feature = "testing"))]
    pub fn flow_quota(&self, slot: u32) -> Result<(u64, u64)> {
        let made = self
            .flow_made
            .get(&slot, 0)
            .map_err(map_err(map_names::FLOW_MADE))?;
        let freed = self
            .flow_freed
            .get(&slot, 0)
            .map_err(map_err(map_names::FLOW_FREED))?;
        Ok((made, freed))
    }

    /// Sets each slot's freed count so that `made - freed` is the number of flows its tables
    /// hold now: what an agent stopped between deleting flows and counting them, or an
    /// upgrade that counted a flow twice, left off. For the slots of peer entries and of
    /// flows. Each slot's `made` is read before the tables are counted, so a flow the
    /// datapath adds meanwhile can only make the slot look fuller (fewer replies, never
    /// more); a slot with more flows than `made` says is left alone. Returns the slots changed.
    pub fn recount_flow_quota(&mut self) -> Result<Vec<u32>> {
        // Both arrays whole, in a few batched reads, `made` before the tables are counted.
        let made = self.slot_counts(true)?;
        let mut live: BTreeMap<u32, u64> = BTreeMap::new();
        for flow in self.flows_unsorted()? {
            *live.entry(flow.value.slot).or_default() += 1;
        }
        let mut slots: Vec<u32> = self
            .peers_unsorted()?
            .into_iter()
            .map(|(_, entry)| entry.slot)
            .chain(live.keys().copied())
            .collect();
        slots.sort_unstable();
        slots.dedup();
        let freed_now = self.slot_counts(false)?;
        let mut changed = Vec::new();
        for slot in slots {
            let Some(made) = made.get(slot as usize).copied() else {
                continue;
            };
            let live = live.get(&slot).copied().unwrap_or_default();
            let Some(freed) = made.checked_sub(live) else {
                continue;
            };
            let was = freed_now.get(slot as usize).copied().unwrap_or_default();
            if was != freed {
                self.writes += 1;
                self.flow_freed
                    .set(slot, freed, 0)
                    .map_err(map_err(map_names::FLOW_FREED))?;
                changed.push(slot);
            }
        }
        Ok(changed)
    }

    /// Every slot's `made` (or `freed`) count, indexed by slot.
    fn slot_counts(&self, made: bool) -> Result<Vec<u64>> {
        let (map, name) = if made {
            (&self.flow_made, map_names::FLOW_MADE)
        } else {
            (&self.flow_freed, map_names::FLOW_FREED)
        };
        let mut counts = vec![0; MAX_PEERS as usize];
        let iter = || {
            map.iter()
                .zip(0u32..)
                .map(|(count, slot)| count.map(|count| (slot, count)))
        };
        for (slot, count) in entries(map, name, iter)? {
            if let Some(c) = counts.get_mut(slot as usize) {
                *c = count;
            }
        }
        Ok(counts)
    }

    /// Inserts a reply flow as the egress program would (for tests and benchmarks), counting
    /// it against its slot's quota. Flows of mixed address families are an error.
    pub fn insert_flow(&mut self, flow: &Flow) -> Result<()> {
        self.writes += 2;
        let slot = flow.value.slot;
        let made = self
            .flow_made
            .get(&slot, 0)
            .map_err(map_err(map_names::FLOW_MADE))?;
        self.flow_made
            .set(slot, made.wrapping_add(1), 0)
            .map_err(map_err(map_names::FLOW_MADE))?;
        match flow_key(flow) {
            Some(FlowKey::V4(key)) => self
                .flows_v4
                .insert(key, flow.value, 0)
                .map_err(map_err(map_names::FLOWS_V4)),
            Some(FlowKey::V6(key)) => self
                .flows_v6
                .insert(key, flow.value, 0)
                .map_err(map_err(map_names::FLOWS_V6)),
            None => Err(DataplaneError::MixedFamilies {
                peer: flow.peer,
                remote: flow.remote,
            }),
        }
    }

    /// Zeroes one peer slot's counters on every CPU (one write), e.g. before the slot is given
    /// to a new peer.
    pub fn reset_peer_counters(&mut self, slot: u32) -> Result<()> {
        self.writes += 1;
        let zeros = per_cpu(PeerCounters::default()).map_err(map_err(map_names::PEER_STATS))?;
        self.peer_stats
            .set(slot, zeros, 0)
            .map_err(map_err(map_names::PEER_STATS))
    }
}

impl Maps {
    /// Zeroes the rule counters `base..base + len` on every CPU, and when they were seen.
    pub fn reset_rule_counters(&mut self, base: u32, len: u32) -> Result<()> {
        for index in base..base.saturating_add(len).min(wgfence_common::MAX_RULES) {
            self.writes += 1;
            let zeros = per_cpu(RuleCounters::default()).map_err(map_err(map_names::RULE_STATS))?;
            self.rule_stats
                .set(index, zeros, 0)
                .map_err(map_err(map_names::RULE_STATS))?;
            self.rule_seen
                .set(index, RuleSeen::default(), 0)
                .map_err(map_err(map_names::RULE_SEEN))?;
        }
        Ok(())
    }

    /// When rule counter `index` was last seen to move (see [`RuleSeen`]).
    pub fn rule_seen(&self, index: u32) -> Result<RuleSeen> {
        self.rule_seen
            .get(&index, 0)
            .map_err(map_err(map_names::RULE_SEEN))
    }

    /// Notes, for each of `indexes` whose total moved since the last look, that it was hit by
    /// `now_boot_ns`. Returns how many moved.
    pub fn observe_rule_hits(
        &mut self,
        indexes: impl IntoIterator<Item = u32>,
        now_boot_ns: u64,
    ) -> Result<usize> {
        let mut moved = 0;
        for index in indexes {
            let packets = self.rule_counters(index)?.packets;
            let seen = self.rule_seen(index)?;
            if packets != seen.packets {
                let last_hit_ns = if packets > seen.packets {
                    now_boot_ns
                } else {
                    seen.last_hit_ns
                };
                self.writes += 1;
                self.rule_seen
                    .set(
                        index,
                        RuleSeen {
                            packets,
                            last_hit_ns,
                        },
                        0,
                    )
                    .map_err(map_err(map_names::RULE_SEEN))?;
                moved += 1;
            }
        }
        Ok(moved)
    }

    /// One rule counter summed over the CPUs.
    pub fn rule_counters(&self, index: u32) -> Result<RuleCounters> {
        let per_cpu = self
            .rule_stats
            .get(&index, 0)
            .map_err(map_err(map_names::RULE_STATS))?;
        Ok(per_cpu
            .iter()
            .fold(RuleCounters::default(), |sum, c| RuleCounters {
                packets: sum.packets.wrapping_add(c.packets),
                bytes: sum.bytes.wrapping_add(c.bytes),
            }))
    }

    /// When rule counter `index` was last hit, on the boot clock, as far as the agent's looks
    /// tell: hits since the last look count as `now_boot_ns`; `None`: never hit.
    pub fn rule_last_hit(&self, index: u32, now_boot_ns: u64) -> Result<Option<u64>> {
        let packets = self.rule_counters(index)?.packets;
        let seen = self.rule_seen(index)?;
        Ok(if packets > seen.packets {
            Some(now_boot_ns)
        } else if packets == 0 {
            None
        } else {
            Some(seen.last_hit_ns)
        })
    }
}

/// The sum of one slot's per-CPU counters.
pub(crate) fn sum_peer_counters<'a>(
    per_cpu: impl IntoIterator<Item = &'a PeerCounters>,
) -> PeerCounters {
    per_cpu
        .into_iter()
        .fold(PeerCounters::default(), |sum, c| PeerCounters {
            pass_packets: sum.pass_packets.wrapping_add(c.pass_packets),
            pass_bytes: sum.pass_bytes.wrapping_add(c.pass_bytes),
            drop_packets: sum.drop_packets.wrapping_add(c.drop_packets),
            drop_bytes: sum.drop_bytes.wrapping_add(c.drop_bytes),
            audit_packets: sum.audit_packets.wrapping_add(c.audit_packets),
            audit_bytes: sum.audit_bytes.wrapping_add(c.audit_bytes),
        })
}

/// A per-CPU value holding `first` on CPU 0 and zeros on every other possible CPU: what a
/// per-CPU counter must be set to so that its sum is `first`.
pub(crate) fn per_cpu<T: aya::Pod + Default>(
    first: T,
) -> std::result::Result<PerCpuValues<T>, MapError> {
    let syscall_err = |io_error| {
        MapError::SyscallError(aya::sys::SyscallError {
            call: "nr_cpus",
            io_error,
        })
    };
    let cpus = aya::util::nr_cpus().map_err(|(_, e)| syscall_err(e))?;
    let mut values: Vec<T> = std::iter::repeat_with(T::default).take(cpus).collect();
    if let Some(slot) = values.first_mut() {
        *slot = first;
    }
    PerCpuValues::try_from(values).map_err(syscall_err)
}

enum FlowKey {
    V4(FlowKeyV4),
    V6(FlowKeyV6),
}

/// A flow's key in its table; `None` for mixed address families.
fn flow_key(flow: &Flow) -> Option<FlowKey> {
    match (flow.peer, flow.remote) {
        (IpAddr::V4(peer), IpAddr::V4(remote)) => Some(FlowKey::V4(FlowKeyV4 {
            peer: peer.octets(),
            remote: remote.octets(),
            peer_port: flow.peer_port,
            remote_port: flow.remote_port,
            protocol: flow.protocol,
            _pad: [0; 3],
        })),
        (IpAddr::V6(peer), IpAddr::V6(remote)) => Some(FlowKey::V6(FlowKeyV6 {
            peer: peer.octets(),
            remote: remote.octets(),
            peer_port: flow.peer_port,
            remote_port: flow.remote_port,
            protocol: flow.protocol,
            _pad: [0; 3],
        })),
        _ => None,
    }
}

fn flow_v4(key: &FlowKeyV4, value: FlowValue) -> Flow {
    Flow {
        peer: IpAddr::V4(key.peer.into()),
        remote: IpAddr::V4(key.remote.into()),
        protocol: key.protocol,
        peer_port: key.peer_port,
        remote_port: key.remote_port,
        value,
    }
}

fn flow_v6(key: &FlowKeyV6, value: FlowValue) -> Flow {
    Flow {
        peer: IpAddr::V6(key.peer.into()),
        remote: IpAddr::V6(key.remote.into()),
        protocol: key.protocol,
        peer_port: key.peer_port,
        remote_port: key.remote_port,
        value,
    }
}
