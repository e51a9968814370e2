//! The policy tries of map layout 4. Each policy has an LPM trie per address family it has
//! entries for, keyed by destination alone; the datapath finds it by policy id in the family's
//! hash of maps (`wgf4_policy_v4`, `wgf4_policy_v6`), so a packet walks its peer's policy
//! alone, however many other policies there are.
//!
//! User space reaches a trie only through a descriptor: the hash of maps gives its id, and
//! opening a map by id needs CAP_SYS_ADMIN, which the DaemonSet does not grant. So the agent
//! pins each trie at `<pin dir>/wgf4_tries_v4/<policy id>` (`wgf4_tries_v6` for IPv6) and
//! opens it by its pin to read or edit it. The hash of maps decides what is live: a pin
//! counts only while it is the very trie the hash of maps holds under its id (the ids are
//! compared), so a pin left behind by an agent killed between two steps is never taken for a
//! live policy, and a live trie whose pin is gone is one the agent cannot read: it reads as no
//! entries, and the next write of that policy replaces it.
//!
//! A policy's new trie is complete before anything can find it: [`Tries::upsert`] of a policy
//! without a live trie creates one and stages it, and [`Tries::publish`] inserts it in the hash
//! of maps, one atomic update that also replaces a trie the agent could not read, then pins
//! it. A pin that fails (bpffs unmounted) holds nothing back: the trie enforces, and is held
//! by descriptor until the datapath check pins it. The maps publish every staged trie before
//! they write a peer entry, which is the only way a peer comes to use a policy. A trie whose
//! last entry is removed leaves the hash of maps, then its pin goes.
//!
//! Without a pin directory (the private object of `wgfence test-run`) the tries are held by
//! descriptor instead of pinned.

use std::{
    collections::BTreeMap,
    fs,
    io::ErrorKind,
    net::{Ipv4Addr, Ipv6Addr},
    os::fd::{AsFd as _, BorrowedFd, OwnedFd},
    os::unix::fs::DirBuilderExt as _,
    path::{Path, PathBuf},
};

use aya::maps::{lpm_trie::Key, HashOfMaps, IterableMap, LpmTrie, Map, MapData, MapError};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use wgfence_common::{map_names, PolicyKeyV4, PolicyKeyV6, PolicyValue};

use super::{
    error::{DataplaneError, Result},
    layout, sys, trie_btf,
};

/// What differs between the IPv4 and the IPv6 tries.
pub(crate) trait Family {
    /// The key's data: the destination.
    type Data: aya::Pod;
    /// The hash of maps (policy id -> trie).
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

/// One address family's policy tries.
pub(crate) struct Tries<F: Family> {
    outer: HashOfMaps<MapData, u32, Trie<F>>,
    /// A second descriptor of the hash of maps, for reading inner map ids.
    outer_fd: OwnedFd,
    store: Store<F>,
    /// New tries, complete only once the plan's entries for them are written: not yet
    /// findable.
    staged: BTreeMap<u32, Trie<F>>,
    /// The live pinned trie edited last, kept open while the same policy is edited.
    last: Option<(u32, Trie<F>)>,
    /// Published tries whose pin failed (no bpffs): held by descriptor until one works.
    unpinned: BTreeMap<u32, Trie<F>>,
    /// The tries' BTF ([`super::trie_btf`]), loaded with the first new trie; `Some(None)` if
    /// the kernel refused it (the tries go without).
    btf: Option<Option<OwnedFd>>,
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

/// Whether a failed `BPF_OBJ_GET` says there is no pin.
fn no_pin(e: &MapError) -> bool {
    matches!(e, MapError::SyscallError(e) if e.io_error.kind() == ErrorKind::NotFound)
}

impl<F: Family> Tries<F> {
    /// The tries of the hash of maps `outer` (layout checked), pinned under `pin_dir` if given.
    pub(crate) fn new(outer: MapData, pin_dir: Option<&Path>) -> Result<Self> {
        layout::check(F::OUTER, &outer.info().map_err(map_err(F::OUTER))?)?;
        let outer_fd = outer
            .fd()
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| DataplaneError::Io {
                path: PathBuf::from(F::OUTER),
                source: e,
            })?;
        let outer = HashOfMaps::try_from(Map::HashOfMaps(outer)).map_err(map_err(F::OUTER))?;
        let store = match pin_dir {
            Some(dir) => Store::Pinned(dir.join(F::DIR)),
            None => Store::Held(BTreeMap::new()),
        };
        Ok(Self {
            outer,
            outer_fd,
            store,
            staged: BTreeMap::new(),
            last: None,
            unpinned: BTreeMap::new(),
            btf: None,
        })
    }

    /// `policy`'s pinned trie, if it is the one the hash of maps holds (`live`: its id there).
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

    /// Runs `f` on `policy`'s live trie (staged or published); `None` if it has none this
    /// agent can reach.
    fn with_trie<R>(
        &mut self,
        policy: u32,
        f: impl FnOnce(&mut Trie<F>) -> Result<R>,
    ) -> Result<Option<R>> {
        if let Some(trie) = self.staged.get_mut(&policy) {
            return f(trie).map(Some);
        }
        if let Some(trie) = self.unpinned.get_mut(&policy) {
            return f(trie).map(Some);
        }
        match &mut self.store {
            Store::Held(held) => held.get_mut(&policy).map(f).transpose(),
            Store::Pinned(dir) => {
                if self.last.as_ref().is_none_or(|(id, _)| *id != policy) {
                    self.last = None;
                    let Some(live) = sys_live_id::<F>(&self.outer_fd, policy)? else {
                        return Ok(None);
                    };
                    let Some(trie) = Self::open_pinned(dir, policy, live)? else {
                        return Ok(None);
                    };
                    self.last = Some((policy, trie));
                }
                match &mut self.last {
                    Some((_, trie)) => f(trie).map(Some),
                    None => Ok(None),
                }
            }
        }
    }

    /// Inserts or replaces `policy`'s entry for `prefix` (a prefix of this family). A policy
    /// without a live trie gets a new one, staged until [`Self::publish`].
    pub(crate) fn upsert(&mut self, policy: u32, prefix: IpNet, value: &PolicyValue) -> Result<()> {
        let key = F::key(prefix).ok_or(DataplaneError::OutOfRange {
            field: "policy trie address family",
            value: u64::from(prefix.prefix_len()),
        })?;
        let insert = |trie: &mut Trie<F>| trie.insert(&key, value, 0).map_err(map_err(F::TRIE));
        if self.with_trie(policy, insert)?.is_some() {
            return Ok(());
        }
        let btf = self
            .btf
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
            });
        let mut trie = create::<F>(btf.as_ref().map(|fd| fd.as_fd()))?;
        trie.insert(&key, value, 0).map_err(map_err(F::TRIE))?;
        self.staged.insert(policy, trie);
        Ok(())
    }

    /// Deletes `policy`'s entry for `prefix`; `false` if there was none. The trie of a policy
    /// left without entries is taken out of the hash of maps and unpinned (`true` in the
    /// second place: two more writes).
    pub(crate) fn remove(&mut self, policy: u32, prefix: IpNet) -> Result<(bool, bool)> {
        let Some(key) = F::key(prefix) else {
            return Ok((false, false));
        };
        let removed = self.with_trie(policy, |trie| {
            let removed = super::maps::removed(F::TRIE, trie.remove(&key))?;
            let empty = trie.keys().next().is_none();
            Ok((removed, empty))
        })?;
        let Some((removed, empty)) = removed else {
            return Ok((false, false));
        };
        if !empty {
            return Ok((removed, false));
        }
        if self.staged.remove(&policy).is_some() {
            return Ok((removed, false));
        }
        self.drop_trie(policy)?;
        Ok((removed, true))
    }

    /// Takes `policy`'s trie out of the hash of maps, then removes its pin.
    fn drop_trie(&mut self, policy: u32) -> Result<()> {
        super::maps::removed(F::OUTER, self.outer.remove(&policy))?;
        self.last = None;
        self.unpinned.remove(&policy);
        match &mut self.store {
            Store::Held(held) => {
                held.remove(&policy);
            }
            Store::Pinned(dir) => {
                let path = dir.join(policy.to_string());
                match fs::remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(io_err(&path)(e)),
                }
            }
        }
        Ok(())
    }

    /// Makes the tries' pin directory if it is missing (a fresh attach, or removed by hand).
    /// `Ok(true)` if it was missing while the hash of maps held a trie: those tries' pins are
    /// gone, so the agent cannot read them until it writes them again.
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
        if !missing {
            return Ok(false);
        }
        self.last = None;
        // Tries this agent holds no descriptor of lost their pins with the directory.
        let live = self.live()?;
        Ok(live.len() > self.unpinned.len())
    }

    /// Makes every staged trie findable: inserted in the hash of maps (replacing whatever it
    /// held under the id), then pinned (a stale pin of the same id replaced). A pin that
    /// fails (bpffs unmounted) does not hold the policy back: the trie is held by descriptor
    /// until [`Self::restore_dir`] pins it. The number of tries published.
    pub(crate) fn publish(&mut self) -> Result<u64> {
        let mut published = 0;
        let mut unpinned = None;
        while let Some((policy, trie)) = self.staged.pop_first() {
            self.last = None;
            self.outer
                .insert(policy, &trie, 0)
                .map_err(map_err(F::OUTER))?;
            published += 1;
            match &mut self.store {
                Store::Held(held) => {
                    held.insert(policy, trie);
                }
                Store::Pinned(dir) => {
                    if let Err(e) = pin::<F>(dir, policy, &trie) {
                        unpinned.get_or_insert(e);
                        self.unpinned.insert(policy, trie);
                    }
                }
            }
        }
        if let Some(e) = unpinned {
            tracing::warn!(
                error = %crate::error_chain(&e),
                unpinned = self.unpinned.len(),
                "could not pin policy tries: they enforce, and are held until they can be \
                 pinned"
            );
        }
        Ok(published)
    }

    /// Every entry of every live trie this agent can reach, handed to `each` as it is read:
    /// policy by policy, each in its trie's own order.
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

    /// (policy id, inner map id) of every trie in the hash of maps.
    fn live(&self) -> Result<Vec<(u32, u32)>> {
        let syscall_err = |io_error| DataplaneError::Map {
            map: F::OUTER,
            source: MapError::SyscallError(aya::sys::SyscallError {
                call: "bpf_map_lookup_batch",
                io_error,
            }),
        };
        if let Some(all) =
            sys::lookup_batch::<u32, u32>(self.outer_fd.as_fd()).map_err(syscall_err)?
        {
            return Ok(all);
        }
        let mut all = Vec::new();
        for policy in self.outer.keys() {
            let policy = policy.map_err(map_err(F::OUTER))?;
            if let Some(id) = sys_live_id::<F>(&self.outer_fd, policy)? {
                all.push((policy, id));
            }
        }
        Ok(all)
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

fn sys_live_id<F: Family>(outer: &OwnedFd, policy: u32) -> Result<Option<u32>> {
    sys::inner_map_id(outer.as_fd(), policy).map_err(|io_error| DataplaneError::Map {
        map: F::OUTER,
        source: MapError::SyscallError(aya::sys::SyscallError {
            call: "bpf_map_lookup_elem",
            io_error,
        }),
    })
}

/// A new, empty trie of the inner layout the hash of maps wants, described by `btf` if given.
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
