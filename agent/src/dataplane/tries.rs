//! The policy tries of map layout 4. Each policy has an LPM trie per address family it has
//! entries for, keyed by destination alone; the datapath finds it by policy id in the family's
//! array of maps (`wgf4_policy_v4`, `wgf4_policy_v6`), so a packet walks its peer's policy
//! alone, however many other policies there are.
//!
//! User space reaches a trie only through a descriptor: the array of maps gives its id, and
//! opening a map by id needs CAP_SYS_ADMIN, which the DaemonSet does not grant. So the agent
//! pins each trie at `<pin dir>/wgf4_tries_v4/<policy id>` (`wgf4_tries_v6` for IPv6) and
//! opens it by its pin to read or edit it. The array of maps decides what is live: a pin
//! counts only while it is the very trie the array of maps holds under its id (the ids are
//! compared), so a pin left behind by an agent killed between two steps is never taken for a
//! live policy, and a live trie whose pin is gone is one the agent cannot read: it reads as no
//! entries (the planner then writes the policy again under a new id and switches its peers),
//! and stays in its slot until that id is handed out again.
//!
//! A policy's new trie is filled by descriptor, then put into the array of maps with the other
//! new ones in one batch ([`Tries::flush`]), then pinned. The batch matters: each update of a
//! map of maps waits for an RCU grace period in the kernel (so that no program still runs
//! with the inner map it replaced), about 10 ms, and a batch waits once, where a cold load of
//! 40,000 policies updated one by one would wait 40,000 times. The maps flush before every
//! peer entry they write, which is the only way a peer comes to use a policy, and at the end of
//! an apply; and when 512 new tries wait, to bound the descriptors held. A trie a peer already
//! uses that misses some of its entries for a moment (drift being repaired, say) only denies
//! more than the policy: an entry's allows include those of every broader entry of its policy
//! (the compiler folds them in), so a packet's longest match among fewer entries allows at most
//! what its longest match among all would. A pin that fails (bpffs unmounted) holds nothing
//! back: the trie enforces, and is held by descriptor until the datapath check pins it.
//!
//! A slot, once it holds a trie, keeps it: a policy's last entry going leaves an empty trie
//! (which matches nothing, as no trie does) for the next policy the planner gives that id, and
//! each new trie comes with empty spares for the ids after it. The planner hands out the
//! lowest free ids, so a policy change or a new policy fills a trie already in place: no
//! update of the array, no wait. A state with fewer policies than an earlier one would leave
//! the rest empty for good, so each resync frees the empty tries of the ids nothing uses
//! beyond the 64 lowest free ones ([`Tries::reclaim`]): one shared empty trie, never pinned,
//! takes their slots, in one batch.
//!
//! Without a pin directory (the private object of `wgfence test-run`) the tries are held by
//! descriptor instead of pinned.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    io::ErrorKind,
    net::{Ipv4Addr, Ipv6Addr},
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd, OwnedFd},
    os::unix::fs::DirBuilderExt as _,
    path::{Path, PathBuf},
};

use aya::maps::{lpm_trie::Key, IterableMap, LpmTrie, Map, MapData, MapError};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use wgfence_common::{map_names, PolicyKeyV4, PolicyKeyV6, PolicyValue, MAX_POLICIES};

use super::{
    error::{io_err, map_err, syscall_err, DataplaneError, Result},
    layout, sys, trie_btf,
};

/// What differs between the IPv4 and the IPv6 tries.
pub(crate) trait Family {
    /// The key's data: the destination.
    type Data: aya::Pod;
    /// The array of maps (policy id -> trie).
    const OUTER: &'static str;
    /// Every trie's name.
    const TRIE: &'static str;
    /// The tries' pin directory, under the pin directory.
    const DIR: &'static str;
    /// The key's type in [`trie_btf::build`]'s BTF.
    const BTF_KEY: u32;
    /// The key of `prefix` (host bits cleared); `None` for the other family's.
    fn key(prefix: IpNet) -> Option<Key<Self::Data>>;
    /// The prefix of a key read from a trie.
    fn prefix(key: &Key<Self::Data>) -> Result<IpNet>;
}

pub(crate) struct V4;
pub(crate) struct V6;

impl Family for V4 {
    type Data = PolicyKeyV4;
    const OUTER: &'static str = map_names::POLICY_V4;
    const TRIE: &'static str = map_names::TRIE_V4;
    const DIR: &'static str = map_names::TRIES_V4;
    const BTF_KEY: u32 = trie_btf::KEY_V4;

    fn key(prefix: IpNet) -> Option<Key<PolicyKeyV4>> {
        let IpNet::V4(net) = prefix.trunc() else {
            return None;
        };
        let addr = net.network().octets();
        Some(Key::new(u32::from(net.prefix_len()), PolicyKeyV4 { addr }))
    }

    fn prefix(key: &Key<PolicyKeyV4>) -> Result<IpNet> {
        let len = u8::try_from(key.prefix_len()).map_err(|_| out_of_range(key.prefix_len()))?;
        Ipv4Net::new(Ipv4Addr::from(key.data().addr), len)
            .map(IpNet::V4)
            .map_err(|_| out_of_range(key.prefix_len()))
    }
}

impl Family for V6 {
    type Data = PolicyKeyV6;
    const OUTER: &'static str = map_names::POLICY_V6;
    const TRIE: &'static str = map_names::TRIE_V6;
    const DIR: &'static str = map_names::TRIES_V6;
    const BTF_KEY: u32 = trie_btf::KEY_V6;

    fn key(prefix: IpNet) -> Option<Key<PolicyKeyV6>> {
        let IpNet::V6(net) = prefix.trunc() else {
            return None;
        };
        let addr = net.network().octets();
        Some(Key::new(u32::from(net.prefix_len()), PolicyKeyV6 { addr }))
    }

    fn prefix(key: &Key<PolicyKeyV6>) -> Result<IpNet> {
        let len = u8::try_from(key.prefix_len()).map_err(|_| out_of_range(key.prefix_len()))?;
        Ipv6Net::new(Ipv6Addr::from(key.data().addr), len)
            .map(IpNet::V6)
            .map_err(|_| out_of_range(key.prefix_len()))
    }
}

fn out_of_range(prefix_len: u32) -> DataplaneError {
    DataplaneError::OutOfRange {
        field: "policy trie prefix length",
        value: u64::from(prefix_len),
    }
}

type Trie<F> = LpmTrie<MapData, <F as Family>::Data, PolicyValue>;

/// Where the live tries are kept.
enum Store<F: Family> {
    /// Pinned in this directory, by policy id.
    Pinned(PathBuf),
    /// Held by descriptor (no pin directory).
    Held(BTreeMap<u32, Trie<F>>),
}

/// New tries are put into the array of maps at the latest when this many wait (each holds a
/// descriptor until then).
const FLUSH_AT: usize = 512;
/// Empty tries made with each new one, for the ids after it (see [`Tries::upsert`]).
const SPARE: u32 = 64;
/// Slots [`Tries::reclaim`] gives back a call where the kernel has no batch update for an
/// array of maps: each update then waits for a grace period, and the agent's loop with it.
const ONE_BY_ONE: usize = 16;

/// One address family's policy tries.
pub(crate) struct Tries<F: Family> {
    /// The array of maps (aya 0.14 has no batch update and no id-only lookup for it: the
    /// agent makes those calls itself, [`sys`]).
    outer: MapData,
    store: Store<F>,
    /// The live pinned trie edited last (policy id, map id, trie), kept open while the same
    /// policy is edited.
    last: Option<(u32, u32, Trie<F>)>,
    /// New tries, by policy id: in the array of maps from the next [`Tries::flush`].
    new: BTreeMap<u32, Trie<F>>,
    /// Tries in the array whose pin failed (no bpffs): held by descriptor until one works.
    unpinned: BTreeMap<u32, Trie<F>>,
    /// The tries' BTF ([`super::trie_btf`]), loaded with the first new trie; `Some(None)` if
    /// the kernel refused it (the tries go without).
    btf: Option<Option<OwnedFd>>,
}

/// Whether a failed `BPF_OBJ_GET` says there is no pin.
fn no_pin(e: &MapError) -> bool {
    matches!(e, MapError::SyscallError(e) if e.io_error.kind() == ErrorKind::NotFound)
}

impl<F: Family> Tries<F> {
    /// The tries of the array of maps `outer` (layout checked), pinned under `pin_dir` if given.
    pub(crate) fn new(outer: MapData, pin_dir: Option<&Path>) -> Result<Self> {
        layout::check(F::OUTER, &outer.info().map_err(map_err(F::OUTER))?)?;
        let store = match pin_dir {
            Some(dir) => Store::Pinned(dir.join(F::DIR)),
            None => Store::Held(BTreeMap::new()),
        };
        Ok(Self {
            outer,
            store,
            last: None,
            new: BTreeMap::new(),
            unpinned: BTreeMap::new(),
            btf: None,
        })
    }

    /// `policy`'s pinned trie, if it is the one the array of maps holds (`live`: its id there).
    fn open_pinned(dir: &Path, policy: u32, live: u32) -> Result<Option<Trie<F>>> {
        let path = dir.join(policy.to_string());
        let data = match MapData::from_pin(&path) {
            Ok(data) => data,
            Err(e) if no_pin(&e) => return Ok(None),
            Err(source) => {
                return Err(DataplaneError::Map {
                    map: F::TRIE,
                    source,
                })
            }
        };
        if data.info().map_err(map_err(F::TRIE))?.id() != live {
            return Ok(None);
        }
        LpmTrie::try_from(Map::LpmTrie(data))
            .map(Some)
            .map_err(map_err(F::TRIE))
    }

    /// Runs `f` on `policy`'s trie: a new one not yet in the array, else the live one; `None`
    /// if it has none this agent can reach.
    fn with_trie<R>(
        &mut self,
        policy: u32,
        f: impl FnOnce(&mut Trie<F>) -> Result<R>,
    ) -> Result<Option<R>> {
        if let Some(trie) = self.new.get_mut(&policy) {
            return f(trie).map(Some);
        }
        if let Some(trie) = self.unpinned.get_mut(&policy) {
            return f(trie).map(Some);
        }
        match &mut self.store {
            Store::Held(held) => held.get_mut(&policy).map(f).transpose(),
            Store::Pinned(dir) => {
                // What the array of maps holds decides, also for the trie opened last (which a
                // hand edit of the array may have replaced): one lookup per write.
                let Some(live) = sys_live_id::<F>(self.outer.fd().as_fd(), policy)? else {
                    self.last = None;
                    return Ok(None);
                };
                if self
                    .last
                    .as_ref()
                    .is_none_or(|(id, map, _)| (*id, *map) != (policy, live))
                {
                    self.last = None;
                    let Some(trie) = Self::open_pinned(dir, policy, live)? else {
                        return Ok(None);
                    };
                    self.last = Some((policy, live, trie));
                }
                match &mut self.last {
                    Some((_, _, trie)) => f(trie).map(Some),
                    None => Ok(None),
                }
            }
        }
    }

    /// Inserts or replaces `policy`'s entry for `prefix` (a prefix of this family), in the
    /// trie its slot holds (an empty one left by an earlier policy of that id, or a spare,
    /// included). A policy whose slot holds none it can reach gets a new trie, with empty
    /// spares for the next ids, which go into the array of maps at the next [`Self::flush`]
    /// (`Ok(true)`).
    pub(crate) fn upsert(
        &mut self,
        policy: u32,
        prefix: IpNet,
        value: &PolicyValue,
    ) -> Result<bool> {
        let key = F::key(prefix).ok_or(DataplaneError::OutOfRange {
            field: "policy trie address family",
            value: u64::from(prefix.prefix_len()),
        })?;
        let insert = |trie: &mut Trie<F>| trie.insert(&key, value, 0).map_err(map_err(F::TRIE));
        if self.with_trie(policy, insert)?.is_some() {
            return Ok(false);
        }
        if self.new.len() + SPARE as usize >= FLUSH_AT {
            self.flush()?;
        }
        let mut trie = create::<F>(self.btf())?;
        trie.insert(&key, value, 0).map_err(map_err(F::TRIE))?;
        self.new.insert(policy, trie);
        // Empty tries for the ids after it whose slots hold none, in the same batch: the
        // planner hands out the lowest free ids, so the next new policies fill these in place
        // without an update of the array (and its wait).
        for spare in policy.saturating_add(1)..policy.saturating_add(SPARE).min(MAX_POLICIES) {
            if self.new.contains_key(&spare)
                || sys_live_id::<F>(self.outer.fd().as_fd(), spare)?.is_some()
            {
                continue;
            }
            let trie = create::<F>(self.btf())?;
            self.new.insert(spare, trie);
        }
        Ok(true)
    }

    /// The tries' BTF, loaded with the first new trie; `None` if the kernel refused it.
    fn btf(&mut self) -> Option<BorrowedFd<'_>> {
        self.btf
            .get_or_insert_with(|| match sys::load_btf(&trie_btf::build()) {
                Ok(fd) => Some(fd),
                Err(error) => {
                    tracing::warn!(
                        %error,
                        "the kernel refused the policy tries' BTF: bpftool prints their entries \
                         as bytes"
                    );
                    None
                }
            })
            .as_ref()
            .map(|fd| fd.as_fd())
    }

    /// Deletes `policy`'s entry for `prefix`; `false` if there was none. A trie left without
    /// entries stays in its slot, pinned, for the next policy the planner gives that id: an
    /// empty trie matches nothing, as no trie does.
    pub(crate) fn remove(&mut self, policy: u32, prefix: IpNet) -> Result<bool> {
        let Some(key) = F::key(prefix) else {
            return Ok(false);
        };
        let removed = self.with_trie(policy, |trie| {
            super::maps::removed(F::TRIE, trie.remove(&key))
        })?;
        Ok(removed.unwrap_or(false))
    }

    /// Puts the new tries into the array of maps in one `BPF_MAP_UPDATE_BATCH`: an update of a
    /// map of maps waits for an RCU grace period (the kernel makes sure no program still runs
    /// with the old inner map), about 10 ms, once per call: 50 updates one by one took 9 ms
    /// each on Linux 6.18, in one batch 7 ms together. Then pins them (a pin that fails leaves a trie held by descriptor until
    /// [`Self::restore_dir`] pins it). Every write of a peer entry flushes first, so no peer
    /// names a trie the array does not hold. The number of slots written.
    pub(crate) fn flush(&mut self) -> Result<u64> {
        if self.new.is_empty() {
            return Ok(0);
        }
        let mut keys = Vec::with_capacity(self.new.len());
        let mut fds = Vec::with_capacity(self.new.len());
        for (policy, trie) in &self.new {
            keys.push(*policy);
            fds.push(trie.map().fd().as_fd().as_raw_fd() as u32);
        }
        let updated = sys::update_batch(self.outer.fd().as_fd(), &keys, &fds, usize::MAX)
            .map_err(syscall_err(F::OUTER, "bpf_map_update_batch"));
        // On an error every new trie stays for the next flush (an update done twice is one).
        if !updated?.batched {
            tracing::debug!(
                tries = keys.len(),
                map = F::OUTER,
                "this kernel has no batch update for an array of maps: the new tries went in \
                 one by one, a grace period each"
            );
        }
        let mut failed = None;
        for (policy, trie) in std::mem::take(&mut self.new) {
            match &mut self.store {
                Store::Held(held) => {
                    held.insert(policy, trie);
                }
                Store::Pinned(dir) => {
                    if let Err(e) = pin::<F>(dir, policy, &trie) {
                        failed.get_or_insert(e);
                        self.unpinned.insert(policy, trie);
                    }
                }
            }
        }
        if let Some(e) = failed {
            tracing::warn!(
                error = %crate::error_chain(&e),
                unpinned = self.unpinned.len(),
                "could not pin policy tries: they enforce, and are held until they can be \
                 pinned"
            );
        }
        Ok(keys.len() as u64)
    }

    /// Makes the tries' pin directory if it is missing (a fresh attach, or removed by hand),
    /// and pins the tries published while nothing could be pinned. `Ok(true)` if it was
    /// missing: the pins of any tries the datapath holds went with it, so the agent cannot
    /// read them until it writes them again.
    pub(crate) fn restore_dir(&mut self) -> Result<bool> {
        let Store::Pinned(dir) = &self.store else {
            return Ok(false);
        };
        let missing = match fs::DirBuilder::new().mode(0o700).create(dir) {
            Ok(()) => true,
            Err(e) if e.kind() == ErrorKind::AlreadyExists => false,
            Err(e) => return Err(io_err(dir)(e)),
        };
        // Tries published while nothing could be pinned: pinned now.
        let held = std::mem::take(&mut self.unpinned);
        let mut failed = None;
        for (policy, trie) in held {
            if let Err(e) = pin::<F>(dir, policy, &trie) {
                failed.get_or_insert(e);
                self.unpinned.insert(policy, trie);
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        if missing {
            self.last = None;
        }
        Ok(missing)
    }

    /// Frees the empty tries of the policy ids that are neither in `in_use` (every id a peer
    /// entry or a trie entry uses) nor among the [`SPARE`] lowest ids outside it: the planner
    /// hands out the lowest free ids, so those are the spares it fills next, and a state with
    /// fewer policies than an earlier one leaves the rest empty for good. At most `budget` a
    /// call, the highest ids first. One new empty trie, unpinned, takes all their slots in
    /// one batch (the kernel has no batch delete for an array of maps, and each call that
    /// changes a map of maps waits for an RCU grace period; without a batch update either,
    /// [`ONE_BY_ONE`] a call), and their pins go: the kernel frees each with its last
    /// reference, so the slots given back cost one trie among them. An empty trie matches
    /// nothing, as the shared one does, so no packet's verdict changes;
    /// a policy later given such an id gets a trie of its own, as in a fresh slot (the shared
    /// one has no pin, so it is never taken for the policy's). A slot whose pin names another
    /// trie (a pin swapped by hand, or left by an interrupted agent) is given back too, and
    /// the pin removed: no peer uses the id, and this agent could not read what the slot
    /// holds. The number of slots given back.
    pub(crate) fn reclaim(&mut self, in_use: &BTreeSet<u32>, budget: usize) -> Result<u64> {
        self.flush()?;
        let spares: Vec<u32> = (1..MAX_POLICIES)
            .filter(|id| !in_use.contains(id))
            .take(SPARE as usize)
            .collect();
        let free = |id: &u32| !in_use.contains(id) && spares.binary_search(id).is_err();
        let mut empty = Vec::new();
        match &self.store {
            Store::Held(held) => {
                for (policy, trie) in held.iter().rev().filter(|(id, _)| free(id)) {
                    if empty.len() >= budget {
                        break;
                    }
                    if trie_is_empty::<F>(trie)? {
                        empty.push(*policy);
                    }
                }
            }
            Store::Pinned(dir) => {
                for (policy, live) in self.live_where(free)?.into_iter().rev() {
                    if empty.len() >= budget {
                        break;
                    }
                    let give_back = match self.unpinned.get(&policy) {
                        Some(trie) => trie_is_empty::<F>(trie)?,
                        None => match Self::open_pinned(dir, policy, live)? {
                            Some(trie) => trie_is_empty::<F>(&trie)?,
                            // The pin names another trie than the slot's (swapped, or left by
                            // an interrupted agent): what the slot holds, no peer uses and this
                            // agent cannot read; the pin goes with it.
                            None => true,
                        },
                    };
                    if give_back {
                        empty.push(policy);
                    }
                }
            }
        }
        if empty.is_empty() {
            return Ok(0);
        }
        // One new empty trie takes all their slots, in one batch: the kernel has no batch
        // delete for an array of maps, and a delete waits for a grace period each.
        let shared = create::<F>(self.btf())?;
        let fds = vec![shared.map().fd().as_fd().as_raw_fd() as u32; empty.len()];
        let updated = sys::update_batch(self.outer.fd().as_fd(), &empty, &fds, ONE_BY_ONE)
            .map_err(syscall_err(F::OUTER, "bpf_map_update_batch"))?;
        empty.truncate(updated.count);
        if self
            .last
            .as_ref()
            .is_some_and(|(id, _, _)| empty.contains(id))
        {
            self.last = None;
        }
        for policy in &empty {
            match &mut self.store {
                Store::Held(held) => {
                    held.remove(policy);
                }
                Store::Pinned(dir) => {
                    self.unpinned.remove(policy);
                    let path = dir.join(policy.to_string());
                    match fs::remove_file(&path) {
                        Ok(()) => {}
                        Err(e) if e.kind() == ErrorKind::NotFound => {}
                        Err(e) => return Err(io_err(&path)(e)),
                    }
                }
            }
        }
        Ok(empty.len() as u64)
    }

    /// Every entry of every live trie this agent can reach, handed to `each` as it is read:
    /// policy by policy, each in its trie's own order. New tries not yet flushed are not
    /// live: the maps flush before they are read for a plan.
    pub(crate) fn each(&self, each: &mut impl FnMut(u32, IpNet, &PolicyValue)) -> Result<()> {
        let mut read = |policy: u32, trie: &Trie<F>| -> Result<()> {
            for item in trie.iter() {
                let (key, value) = item.map_err(map_err(F::TRIE))?;
                each(policy, F::prefix(&key)?, &value);
            }
            Ok(())
        };
        match &self.store {
            Store::Held(held) => {
                for (policy, trie) in held {
                    read(*policy, trie)?;
                }
            }
            Store::Pinned(dir) => {
                for (policy, live) in self.live()? {
                    if let Some(trie) = self.unpinned.get(&policy) {
                        read(policy, trie)?;
                    } else if let Some(trie) = Self::open_pinned(dir, policy, live)? {
                        read(policy, &trie)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// (policy id, inner map id) of every trie the array of maps holds that has a pin (or is
    /// held by this agent): the pins name the candidates, the array says which are live.
    fn live(&self) -> Result<Vec<(u32, u32)>> {
        self.live_where(|_| true)
    }

    /// [`Self::live`] of the policy ids `wanted` takes (the array is asked about those alone).
    fn live_where(&self, wanted: impl Fn(&u32) -> bool) -> Result<Vec<(u32, u32)>> {
        let Store::Pinned(dir) = &self.store else {
            return Ok(Vec::new());
        };
        let mut ids: Vec<u32> = match fs::read_dir(dir) {
            Ok(entries) => entries
                .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect(),
            Err(e) if e.kind() == ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(io_err(dir)(e)),
        };
        ids.extend(self.unpinned.keys());
        ids.retain(|id| wanted(id));
        ids.sort_unstable();
        ids.dedup();
        let mut all = Vec::with_capacity(ids.len());
        for policy in ids {
            if let Some(id) = sys_live_id::<F>(self.outer.fd().as_fd(), policy)? {
                all.push((policy, id));
            }
        }
        Ok(all)
    }
}

/// Whether `trie` holds no entry.
fn trie_is_empty<F: Family>(trie: &Trie<F>) -> Result<bool> {
    match trie.keys().next() {
        None => Ok(true),
        Some(Ok(_)) => Ok(false),
        Some(Err(e)) => Err(map_err(F::TRIE)(e)),
    }
}

/// Pins `trie` as `dir/<policy>` (the directory made if missing, private like the pin
/// directory it is in; a stale pin of the same id replaced).
fn pin<F: Family>(dir: &Path, policy: u32, trie: &Trie<F>) -> Result<()> {
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_err(dir)(e)),
    }
    let path = dir.join(policy.to_string());
    match fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(&path)(e)),
    }
    trie.map().pin(&path).map_err(|error| DataplaneError::Map {
        map: F::TRIE,
        source: MapError::PinError {
            name: Some(F::TRIE.to_owned()),
            error,
        },
    })
}

fn sys_live_id<F: Family>(outer: BorrowedFd<'_>, policy: u32) -> Result<Option<u32>> {
    sys::inner_map_id(outer, policy).map_err(syscall_err(F::OUTER, "bpf_map_lookup_elem"))
}

/// A new, empty trie of the inner layout the array of maps wants, described by `btf` if given.
fn create<F: Family>(btf: Option<BorrowedFd<'_>>) -> Result<Trie<F>> {
    let layout = layout::inner_trie::<F::Data>();
    let btf = btf.map(|fd| (fd, F::BTF_KEY, trie_btf::VALUE));
    let fd = sys::create_map(&layout, F::TRIE, btf).map_err(|io_error| DataplaneError::Map {
        map: F::TRIE,
        source: MapError::CreateError {
            name: F::TRIE.to_owned(),
            io_error,
        },
    })?;
    let data = MapData::from_fd(fd).map_err(map_err(F::TRIE))?;
    LpmTrie::try_from(Map::LpmTrie(data)).map_err(map_err(F::TRIE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_the_destination_prefix() {
        let key = V4::key("10.1.2.3/16".parse().unwrap()).unwrap();
        assert_eq!(key.prefix_len(), 16);
        assert_eq!(key.data().addr, [10, 1, 0, 0]);
        assert_eq!(V4::prefix(&key).ok(), "10.1.0.0/16".parse().ok());
        assert!(V4::key("fd00::/8".parse().unwrap()).is_none());

        let key = V6::key("fd00::/8".parse().unwrap()).unwrap();
        assert_eq!(key.prefix_len(), 8);
        assert_eq!(V6::prefix(&key).ok(), "fd00::/8".parse().ok());
    }

    #[test]
    fn impossible_prefix_lengths_are_rejected() {
        assert!(V4::prefix(&Key::new(33, PolicyKeyV4 { addr: [0; 4] })).is_err());
        assert!(V6::prefix(&Key::new(129, PolicyKeyV6 { addr: [0; 16] })).is_err());
    }
}
