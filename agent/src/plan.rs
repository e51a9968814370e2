//! The planner: a pure function from (desired state, actual kernel state) to the ordered list of
//! operations that makes the kernel match, touching only what differs. No I/O.
//!
//! The order is what keeps every unchanged peer's traffic flowing and never grants a packet
//! more than its sender's policy, at any instant while the plan is applied:
//!
//! 1. delete the address entries no peer has any more — revocations take effect here, before
//!    any put: a put can fail (a full peer map, a full trie) and must never hold a revocation
//!    back, while a deletion only takes access away — and the entries of addresses that move to
//!    another WireGuard peer (a takeover, a key rotation), so the old holder never runs with the
//!    new holder's entry;
//!    the reply flows recorded for these addresses are forgotten right after (the flow
//!    sweeper deletes them, off the apply path);
//! 2. remove the WireGuard peers that leave the state, also those whose addresses another peer
//!    takes over (their entries went in step 1): a leaked key loses its session, and the
//!    address's inbound traffic, even when every put fails;
//! 3. delete the trie entries of policies nothing references after step 1 and no put of this
//!    plan will (a revoked peer's policy, leftovers of a failed put): nobody loses access, and at
//!    a full trie the puts need the room;
//! 4. write the trie entries of policies the kernel does not have yet (new ids, unreferenced);
//! 5. write peer address entries that are new or changed (a policy switch is one update); a new
//!    peer's counter slot is one no entry uses, or one whose entries step 1 deleted, never a
//!    slot a remaining peer uses;
//! 6. create and update WireGuard peers, per peer: new peers, endpoints, keys, keepalives,
//!    and allowed IPs added without ever clearing a live peer's list (adding an address to a
//!    peer moves it from whichever peer had it);
//! 7. write the entries of the addresses that moved in step 1, now that WireGuard routes them
//!    to their new holder;
//! 8. delete the trie entries of policies step 5's switches left unreferenced.
//!
//! The datapath's settings entry ([`plan_settings`]: the replies switch, the flow timeouts and
//! quota) goes right after the lead ([`Plan::with_settings`]), with the forgetting of every flow
//! when replies are switched off: `wgfence plan` shows what `wgfence run` does.
//!
//! A plan that cannot be made whole (no counter slot, policy id or owner left) still gives its
//! lead, steps 1–3 ([`Unplanned`]): revocations never wait for room.
//!
//! Policies are content-addressed: a policy whose content the kernel already has under some id
//! keeps that id, so an unchanged state — in any order — plans nothing. Changing a peer's
//! rules writes a new policy, switches the peer in one update, then deletes the old entries:
//! a packet sees the old policy or the new one, never a mix.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    fmt,
    net::{IpAddr, SocketAddr},
};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use wgfence_common::{Allow, Config, PeerEntry, MAX_PEERS, NO_RULES, UNRESTRICTED};

use crate::{
    policy::{CompiledPolicy, NOTHING},
    state::{DesiredState, PeerSpec, WgKey},
};

#[cfg(any(test, feature = "testing"))]
pub mod invariants;
mod rule_space;

/// The policy id of `"egress": []`: no trie entry, so every packet is denied. One id, the
/// same for every such peer and across restarts, so that a policy id without entries is the
/// empty policy only under this id; any other id without entries is a policy whose entries
/// are not written (yet), which the invariants tell apart.
pub const EMPTY_POLICY: u32 = u32::MAX;

/// The datapath maps as read back from the kernel.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ActualMaps {
    pub peers: BTreeMap<IpAddr, PeerEntry>,
    /// Trie entries grouped by policy id.
    pub policies: BTreeMap<u32, CompiledPolicy>,
    /// The owner high-water mark the kernel's settings entry holds ([`Config::owner_high`]).
    ///
    /// [`Config::owner_high`]: wgfence_common::Config::owner_high
    pub owner_high: u64,
    /// Wall clock minus boot clock in nanoseconds ([`crate::clock`]): how peer windows, given
    /// in wall-clock time, become the boot-clock bounds of their entries.
    pub wall_minus_boot_ns: i128,
}

impl ActualMaps {
    /// Groups trie entries read from the kernel by policy id.
    pub fn from_entries(
        peers: impl IntoIterator<Item = (IpAddr, PeerEntry)>,
        entries: impl IntoIterator<Item = (u32, IpNet, Vec<Allow>)>,
    ) -> Self {
        let mut grouped: BTreeMap<u32, Vec<(IpNet, Vec<Allow>)>> = BTreeMap::new();
        for (policy, prefix, allows) in entries {
            grouped.entry(policy).or_default().push((prefix, allows));
        }
        Self {
            peers: peers.into_iter().collect(),
            policies: grouped
                .into_iter()
                .map(|(id, entries)| (id, CompiledPolicy::from_entries(entries)))
                .collect(),
            owner_high: 0,
            wall_minus_boot_ns: 0,
        }
    }

    /// The same, with the owner high-water mark of the kernel's settings entry.
    pub fn with_owner_high(mut self, owner_high: u64) -> Self {
        self.owner_high = owner_high;
        self
    }

    /// The same, with the offset that converts peer windows to the boot clock.
    pub fn with_wall_minus_boot(mut self, ns: i128) -> Self {
        self.wall_minus_boot_ns = ns;
        self
    }
}

/// A WireGuard peer's allowed IPs: a set, sorted. Held inline for the one or two a wgfence
/// peer has (a peer's tunnel addresses), where a `BTreeSet` would allocate a 224-byte node
/// per peer: at 60,000 peers that was a quarter of the agent's view of the kernel.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct AllowedIps(smallvec::SmallVec<[IpNet; 2]>);

impl AllowedIps {
    /// Adds `ip`; `false` if it was there.
    pub fn insert(&mut self, ip: IpNet) -> bool {
        match self.0.binary_search(&ip) {
            Ok(_) => false,
            Err(at) => {
                self.0.insert(at, ip);
                true
            }
        }
    }

    /// Removes `ip`; `false` if it was not there.
    pub fn remove(&mut self, ip: &IpNet) -> bool {
        match self.0.binary_search(ip) {
            Ok(at) => {
                self.0.remove(at);
                true
            }
            Err(_) => false,
        }
    }

    pub fn contains(&self, ip: &IpNet) -> bool {
        self.0.binary_search(ip).is_ok()
    }

    /// In order.
    pub fn iter(&self) -> std::slice::Iter<'_, IpNet> {
        self.0.iter()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for AllowedIps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.0.iter()).finish()
    }
}

impl Extend<IpNet> for AllowedIps {
    fn extend<I: IntoIterator<Item = IpNet>>(&mut self, ips: I) {
        for ip in ips {
            self.insert(ip);
        }
    }
}

impl FromIterator<IpNet> for AllowedIps {
    fn from_iter<I: IntoIterator<Item = IpNet>>(ips: I) -> Self {
        let mut set = Self::default();
        set.extend(ips);
        set
    }
}

impl IntoIterator for AllowedIps {
    type Item = IpNet;
    type IntoIter = smallvec::IntoIter<[IpNet; 2]>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl<'a> IntoIterator for &'a AllowedIps {
    type Item = &'a IpNet;
    type IntoIter = std::slice::Iter<'a, IpNet>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

/// One WireGuard peer as the device reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WgPeer {
    pub allowed_ips: AllowedIps,
    pub endpoint: Option<SocketAddr>,
    /// Boxed: few peers have one ([`PeerSpec::preshared_key`]).
    pub preshared_key: Option<Box<WgKey>>,
    pub persistent_keepalive: Option<u16>,
}

/// The WireGuard device's peers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ActualWg {
    pub peers: BTreeMap<WgKey, WgPeer>,
}

/// Everything the planner compares with the desired state, with the indexes that let it plan
/// a change in time proportional to the change (not to the number of peers).
#[derive(Debug, Clone, Default)]
pub struct Actual {
    maps: ActualMaps,
    wg: ActualWg,
    index: Index,
    /// Counter slots the maps hold (`None`: [`MAX_PEERS`]); smaller in the tests and the
    /// fuzzer, so that they reach a full map.
    slot_limit: Option<u32>,
}

/// Derived from `maps` and `wg`; kept current by [`Actual::apply`].
#[derive(Debug, Clone, Default)]
struct Index {
    /// Peer entries per policy id.
    policy_refs: BTreeMap<u32, usize>,
    /// Peer entries per counter slot.
    slot_refs: BTreeMap<u32, usize>,
    /// The slots below `slot_high` that no entry uses: with `slot_high`, the complement of
    /// `slot_refs`, kept so that a new peer's slot costs O(log N), not a copy of every used one.
    free_slots: BTreeSet<u32>,
    /// One past the highest slot an entry has used.
    slot_high: u32,
    /// The policy ids that are free: neither a trie entry nor a peer entry uses them.
    free_ids: FreeIds,
    /// Peer entries per (policy id, rule counter base), for entries that count their rules:
    /// a policy's block is its lowest base ([`rule_blocks`]).
    rule_refs: BTreeMap<(u32, u32), usize>,
    /// Trie entries per (policy id, the rules the entry counts for): a policy's block is as
    /// long as its highest ([`CompiledPolicy::counted_rules`]), found without a pass over
    /// its entries.
    rule_ends: BTreeMap<(u32, u32), usize>,
    /// The rule counters the blocks of `rule_refs` and `rule_ends` use, kept current with
    /// them: a new block is placed in O(log positions), not after a pass over every policy.
    rule_space: rule_space::RuleSpace,
    /// Policy ids by their (complete or partial) content; an id that peer entries point at
    /// and the tries have no entry for holds [`NOTHING`] (`"egress": []`).
    ///
    /// Keyed by a hash of the content, ids in increasing order, the content itself compared
    /// with the maps' on lookup ([`Actual::ids_of`]): no second copy of every policy.
    by_content: HashMap<u64, smallvec::SmallVec<[u32; 2]>>,
    /// The WireGuard peer each allowed IP is routed to ([`Holders`]).
    holders: Holders,
    /// The highest owner handed out: the kernel's high-water mark, or a higher entry's owner.
    owner_high: u64,
}

/// The WireGuard peer each allowed IP is routed to, in a map per family (an `IpNet` takes 18
/// bytes for either). While no two of the device's keys share their first 8 bytes (random
/// keys never do), a holder is kept as those 8 bytes ([`key_tag`]): 13 bytes an IPv4 address
/// and 25 an IPv6 one, where an `IpNet` and the whole key made 50 (4.5 MiB at 60,000 peers
/// with both families). Once two keys share them (keys chosen to), as the whole key. Either
/// way an answer looks at one key, never at a run of keys an author of the state file could
/// make long.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Holders {
    Tags(ByFamily<u64>),
    Keys(ByFamily<WgKey>),
}

impl Default for Holders {
    fn default() -> Self {
        Holders::Tags(ByFamily::default())
    }
}

impl Holders {
    fn contains_key(&self, ip: &IpNet) -> bool {
        match self {
            Holders::Tags(tags) => tags.get(ip).is_some(),
            Holders::Keys(keys) => keys.get(ip).is_some(),
        }
    }

    /// Records `key` as the holder of `ip`.
    fn insert(&mut self, ip: IpNet, key: &WgKey) {
        match self {
            Holders::Tags(tags) => tags.insert(ip, key_tag(key)),
            Holders::Keys(keys) => keys.insert(ip, *key),
        }
    }

    /// Forgets `ip` if `key` holds it.
    fn remove_if(&mut self, ip: &IpNet, key: &WgKey) {
        match self {
            Holders::Tags(tags) => tags.remove_if(ip, key_tag(key)),
            Holders::Keys(keys) => keys.remove_if(ip, *key),
        }
    }
}

/// A map from allowed IPs, one per family.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ByFamily<V> {
    v4: BTreeMap<Ipv4Net, V>,
    v6: BTreeMap<Ipv6Net, V>,
}

impl<V> Default for ByFamily<V> {
    fn default() -> Self {
        Self {
            v4: BTreeMap::new(),
            v6: BTreeMap::new(),
        }
    }
}

impl<V: Copy + PartialEq> ByFamily<V> {
    /// From pairs in the IPs' order (full B-tree nodes); of an IP listed twice, the later.
    fn from_sorted(pairs: impl Iterator<Item = (IpNet, V)>) -> Self {
        let (mut v4, mut v6) = (Vec::new(), Vec::new());
        for (ip, value) in pairs {
            match ip {
                IpNet::V4(net) => v4.push((net, value)),
                IpNet::V6(net) => v6.push((net, value)),
            }
        }
        Self {
            v4: v4.into_iter().collect(),
            v6: v6.into_iter().collect(),
        }
    }

    fn get(&self, ip: &IpNet) -> Option<V> {
        match ip {
            IpNet::V4(net) => self.v4.get(net).copied(),
            IpNet::V6(net) => self.v6.get(net).copied(),
        }
    }

    fn insert(&mut self, ip: IpNet, value: V) {
        match ip {
            IpNet::V4(net) => {
                self.v4.insert(net, value);
            }
            IpNet::V6(net) => {
                self.v6.insert(net, value);
            }
        }
    }

    /// Removes `ip` if it maps to `value`.
    fn remove_if(&mut self, ip: &IpNet, value: V) {
        if self.get(ip) == Some(value) {
            match ip {
                IpNet::V4(net) => {
                    self.v4.remove(net);
                }
                IpNet::V6(net) => {
                    self.v6.remove(net);
                }
            }
        }
    }

    fn iter(&self) -> impl Iterator<Item = (IpNet, V)> + '_ {
        let v4 = self.v4.iter().map(|(net, v)| (IpNet::V4(*net), *v));
        let v6 = self.v6.iter().map(|(net, v)| (IpNet::V6(*net), *v));
        v4.chain(v6)
    }
}

/// What [`Index::holders`] records of a key: its first 8 bytes, in the keys' order.
fn key_tag(key: &WgKey) -> u64 {
    let mut tag = [0; 8];
    tag.copy_from_slice(&key.0[..8]);
    u64::from_be_bytes(tag)
}

/// The device's peers whose key has `tag`: a run of its keys (a tag is a prefix).
fn tagged(wg: &ActualWg, tag: u64) -> impl Iterator<Item = (&WgKey, &WgPeer)> {
    let (mut low, mut high) = ([0; 32], [0xff; 32]);
    low[..8].copy_from_slice(&tag.to_be_bytes());
    high[..8].copy_from_slice(&tag.to_be_bytes());
    wg.peers.range(WgKey(low)..=WgKey(high))
}

/// The key of a policy's content in [`Index::by_content`].
fn content_hash(content: &CompiledPolicy) -> u64 {
    use std::hash::{Hash as _, Hasher as _};
    let mut hasher = std::hash::DefaultHasher::new();
    content.hash(&mut hasher);
    hasher.finish()
}

impl Index {
    /// Notes that `id` holds `content`.
    fn index_content(&mut self, content: &CompiledPolicy, id: u32) {
        let ids = self.by_content.entry(content_hash(content)).or_default();
        if let Err(at) = ids.binary_search(&id) {
            ids.insert(at, id);
        }
    }

    fn rule_up(&mut self, entry: &PeerEntry) {
        if entry.rules != NO_RULES {
            let before = self.rule_block(entry.policy);
            count_up(&mut self.rule_refs, (entry.policy, entry.rules));
            self.rule_block_moved(entry.policy, before);
        }
    }

    fn rule_down(&mut self, entry: &PeerEntry) {
        let key = (entry.policy, entry.rules);
        if self.rule_refs.contains_key(&key) {
            let before = self.rule_block(entry.policy);
            count_down(&mut self.rule_refs, key);
            self.rule_block_moved(entry.policy, before);
        }
    }

    /// Notes that policy `id` has one trie entry more (`up`) or less with `allows`.
    fn count_rule_end(&mut self, id: u32, allows: &[Allow], up: bool) {
        let end = crate::policy::counted_rules(allows);
        if end == 0 {
            return;
        }
        let before = self.rule_block(id);
        if up {
            count_up(&mut self.rule_ends, (id, end));
        } else {
            count_down(&mut self.rule_ends, (id, end));
        }
        self.rule_block_moved(id, before);
    }

    /// Policy `id`'s rule counter block, as (base, length), if its entries carry one: their
    /// lowest base, as long as its trie entries' counted rules (at least 1).
    fn rule_block(&self, id: u32) -> Option<(u32, u32)> {
        let base = self.rule_base(id)?;
        Some((base, self.rule_len(id).max(1)))
    }

    /// Keeps `rule_space` current after policy `id`'s block was `before`.
    fn rule_block_moved(&mut self, id: u32, before: Option<(u32, u32)>) {
        let after = self.rule_block(id);
        if after != before {
            if let Some((base, len)) = before {
                self.rule_space.remove(base, len);
            }
            if let Some((base, len)) = after {
                self.rule_space.add(base, len);
            }
        }
    }

    /// The length of policy `id`'s rule counter block: the rules its trie entries count for.
    fn rule_len(&self, id: u32) -> u32 {
        self.rule_ends
            .range((id, 0)..=(id, u32::MAX))
            .next_back()
            .map_or(0, |((_, end), _)| *end)
    }

    /// The rule counter block the entries of policy `id` carry (their lowest base), if any.
    fn rule_base(&self, id: u32) -> Option<u32> {
        self.rule_refs
            .range((id, 0)..=(id, u32::MAX))
            .next()
            .map(|((_, base), _)| *base)
    }

    /// Every block in use, as (base, length): each policy's lowest base, as long as its
    /// entries' counted rules (at least 1). One merged pass over both indexes, O(#policies),
    /// for a kernel just read.
    fn rule_blocks_in_use(&self) -> Vec<(u32, u32)> {
        let mut ends = self.rule_ends.keys().peekable();
        let mut blocks = Vec::new();
        let mut last = None;
        for &(id, base) in self.rule_refs.keys() {
            if last == Some(id) {
                continue;
            }
            last = Some(id);
            let mut len = 0;
            while let Some(&&(end_id, end)) = ends.peek() {
                if end_id > id {
                    break;
                }
                if end_id == id {
                    len = end;
                }
                ends.next();
            }
            blocks.push((base, len.max(1)));
        }
        blocks
    }

    fn slot_up(&mut self, slot: u32) {
        count_up(&mut self.slot_refs, slot);
        if slot >= self.slot_high {
            self.free_slots.extend(self.slot_high..slot);
            self.slot_high = slot.saturating_add(1);
        } else {
            self.free_slots.remove(&slot);
        }
    }

    fn slot_down(&mut self, slot: u32) {
        count_down(&mut self.slot_refs, slot);
        if !self.slot_refs.contains_key(&slot) && slot < self.slot_high {
            self.free_slots.insert(slot);
        }
    }
}

fn count_up<K: Ord>(map: &mut BTreeMap<K, usize>, key: K) {
    *map.entry(key).or_insert(0) += 1;
}

fn count_down<K: Ord>(map: &mut BTreeMap<K, usize>, key: K) {
    if let Some(n) = map.get_mut(&key) {
        *n -= 1;
        if *n == 0 {
            map.remove(&key);
        }
    }
}

/// What the datapath sees under policy `id`: its trie entries, or [`NOTHING`] for an id that
/// peer entries point at without any trie entry; `None` for UNRESTRICTED (the datapath never
/// looks its entries up: trie entries written under it by hand are no policy a restricted
/// peer may be given) and unused ids.
fn content_of<'a>(
    maps: &'a ActualMaps,
    policy_refs: &BTreeMap<u32, usize>,
    id: u32,
) -> Option<&'a CompiledPolicy> {
    if id == UNRESTRICTED {
        return None;
    }
    match maps.policies.get(&id) {
        Some(content) => Some(content),
        None if policy_refs.contains_key(&id) => Some(&NOTHING),
        None => None,
    }
}

impl PartialEq for Actual {
    fn eq(&self, other: &Self) -> bool {
        self.maps == other.maps && self.wg == other.wg
    }
}

impl Eq for Actual {}

impl Actual {
    /// The kernel's state as read (O(entries) to index).
    pub fn new(maps: ActualMaps, wg: ActualWg) -> Self {
        let mut index = Index {
            owner_high: maps.owner_high,
            ..Index::default()
        };
        // The rule blocks' indexes are counted first and their free ranges noted once, in
        // O(#policies), rather than kept current entry by entry. The indexes with an entry
        // per peer are built from sorted runs (full B-tree nodes: about half the memory of
        // one insert at a time).
        let mut slots: Vec<u32> = Vec::with_capacity(maps.peers.len());
        for entry in maps.peers.values() {
            count_up(&mut index.policy_refs, entry.policy);
            if entry.rules != NO_RULES {
                count_up(&mut index.rule_refs, (entry.policy, entry.rules));
            }
            slots.push(entry.slot);
            index.owner_high = index.owner_high.max(entry.owner);
        }
        slots.sort_unstable();
        index.slot_refs = slots
            .chunk_by(|a, b| a == b)
            .filter_map(|run| run.first().map(|slot| (*slot, run.len())))
            .collect();
        index.slot_high = slots.last().map_or(0, |s| s.saturating_add(1));
        index.free_slots = (0..index.slot_high)
            .filter(|s| !index.slot_refs.contains_key(s))
            .collect();
        drop(slots);
        for (id, content) in &maps.policies {
            index.index_content(content, *id);
            for (_, allows) in content.entries() {
                let end = crate::policy::counted_rules(allows);
                if end > 0 {
                    count_up(&mut index.rule_ends, (*id, end));
                }
            }
        }
        for (base, len) in index.rule_blocks_in_use() {
            index.rule_space.add(base, len);
        }
        let empty: Vec<u32> = index
            .policy_refs
            .keys()
            .copied()
            .filter(|id| *id != UNRESTRICTED && !maps.policies.contains_key(id))
            .collect();
        for id in empty {
            index.index_content(&NOTHING, id);
        }
        // An allowed IP two peers list (a device changed behind the agent's back) is the later
        // key's, as one insert at a time had it (a stable sort keeps the order).
        // Keys in order: keys of one tag are next to each other.
        let tags: Vec<u64> = wg.peers.keys().map(key_tag).collect();
        let shared_tags = tags.windows(2).any(|w| w[0] == w[1]);
        drop(tags);
        let mut holders: Vec<(IpNet, &WgKey)> = wg
            .peers
            .iter()
            .flat_map(|(key, peer)| peer.allowed_ips.iter().map(move |ip| (*ip, key)))
            .collect();
        holders.sort_by_key(|(ip, _)| *ip);
        let pairs = holders.iter();
        index.holders = if !shared_tags {
            Holders::Tags(ByFamily::from_sorted(
                pairs.map(|(ip, key)| (*ip, key_tag(key))),
            ))
        } else {
            Holders::Keys(ByFamily::from_sorted(pairs.map(|(ip, key)| (*ip, **key))))
        };
        drop(holders);
        for id in maps.policies.keys().chain(index.policy_refs.keys()) {
            index.free_ids.take(*id);
        }
        Self {
            maps,
            wg,
            index,
            slot_limit: None,
        }
    }

    /// The same, with only `slots` counter slots (`0..slots`), as if the maps held that many
    /// peers: the tests and the fuzzer plan at a full map with a handful of peers.
    #[cfg(any(test, feature = "testing"))]
    pub fn with_slot_limit(mut self, slots: u32) -> Self {
        self.slot_limit = Some(slots.min(MAX_PEERS));
        self
    }

    /// Counter slots the planner may hand out: `0..slots()`.
    pub fn slots(&self) -> u32 {
        self.slot_limit.unwrap_or(MAX_PEERS)
    }

    /// The WireGuard peer an address is routed to, if any.
    pub fn holder(&self, addr: IpAddr) -> Option<WgKey> {
        self.holder_of(&IpNet::from(addr))
    }

    /// The WireGuard peer `ip` is routed to. Of a tag, the device's one key that has it.
    fn holder_of(&self, ip: &IpNet) -> Option<WgKey> {
        match &self.index.holders {
            Holders::Keys(keys) => keys.get(ip),
            Holders::Tags(tags) => {
                let tag = tags.get(ip)?;
                tagged(&self.wg, tag).next().map(|(key, _)| *key)
            }
        }
    }

    /// Whether WireGuard routes `ip` to `key`, a peer the device has (of a tag, the device's
    /// one key that has it).
    fn routes_to_peer(&self, ip: &IpNet, key: &WgKey) -> bool {
        match &self.index.holders {
            Holders::Keys(keys) => keys.get(ip) == Some(*key),
            Holders::Tags(tags) => tags.get(ip) == Some(key_tag(key)),
        }
    }

    /// Holders kept as whole keys from now on: a key that shares its tag with another is
    /// about to join the device. Each tag is resolved while it still names one key.
    fn hold_by_keys(&mut self) {
        if let Holders::Tags(tags) = &self.index.holders {
            let keys =
                ByFamily::from_sorted(tags.iter().filter_map(|(ip, tag)| {
                    tagged(&self.wg, tag).next().map(|(key, _)| (ip, *key))
                }));
            self.index.holders = Holders::Keys(keys);
        }
    }

    /// Whether WireGuard routes `ip` to `key`.
    fn routes(&self, ip: &IpNet, key: &WgKey) -> bool {
        self.routes_to_peer(ip, key) && self.wg.peers.contains_key(key)
    }

    pub fn maps(&self) -> &ActualMaps {
        &self.maps
    }

    /// The highest owner ever handed out, as far as the kernel shows.
    pub fn owner_high(&self) -> u64 {
        self.index.owner_high
    }

    pub fn wg(&self) -> &ActualWg {
        &self.wg
    }

    fn unindex_content(&mut self, id: u32) {
        if let Some(content) = content_of(&self.maps, &self.index.policy_refs, id) {
            let hash = content_hash(content);
            if let Some(ids) = self.index.by_content.get_mut(&hash) {
                ids.retain(|i| *i != id);
                if ids.is_empty() {
                    self.index.by_content.remove(&hash);
                }
            }
        }
    }

    fn index_content(&mut self, id: u32) {
        if let Some(content) = content_of(&self.maps, &self.index.policy_refs, id) {
            self.index.index_content(content, id);
        }
    }

    /// The ids whose content is `content`, in increasing order.
    fn ids_of<'s>(&'s self, content: &'s CompiledPolicy) -> impl Iterator<Item = u32> + 's {
        self.index
            .by_content
            .get(&content_hash(content))
            .into_iter()
            .flatten()
            .copied()
            .filter(move |id| content_of(&self.maps, &self.index.policy_refs, *id) == Some(content))
    }

    /// Counts a peer entry's references; an id without trie entries holds [`NOTHING`] while
    /// referenced.
    fn count_entry(&mut self, entry: PeerEntry, up: bool) {
        let without_entries =
            entry.policy != UNRESTRICTED && !self.maps.policies.contains_key(&entry.policy);
        if without_entries {
            self.unindex_content(entry.policy);
        }
        if up {
            count_up(&mut self.index.policy_refs, entry.policy);
            self.index.rule_up(&entry);
            self.index.slot_up(entry.slot);
        } else {
            count_down(&mut self.index.policy_refs, entry.policy);
            self.index.rule_down(&entry);
            self.index.slot_down(entry.slot);
        }
        if without_entries {
            self.index_content(entry.policy);
        }
        self.sync_id(entry.policy);
    }

    /// Marks `id` used or free in the index, as the trie and peer entries have it now.
    fn sync_id(&mut self, id: u32) {
        if self.maps.policies.contains_key(&id) || self.index.policy_refs.contains_key(&id) {
            self.index.free_ids.take(id);
        } else {
            self.index.free_ids.give(id);
        }
    }

    /// What `op` does to the kernel. The agent keeps its view of the kernel current with this
    /// between full reads (which are O(peers)); the tests use it as the model of the kernel.
    pub fn apply(&mut self, op: &Op) {
        match op {
            Op::PutPolicyEntry {
                policy,
                prefix,
                allows,
            } => {
                self.unindex_content(*policy);
                let replaced = self
                    .maps
                    .policies
                    .entry(*policy)
                    .or_default()
                    .insert_entry(*prefix, allows.clone());
                if let Some(old) = replaced {
                    self.index.count_rule_end(*policy, &old, false);
                }
                self.index.count_rule_end(*policy, allows, true);
                self.index_content(*policy);
                self.sync_id(*policy);
            }
            Op::ResetPeerCounters { .. }
            | Op::ResetRuleCounters { .. }
            | Op::PutSettings { .. }
            | Op::ForgetFlows { .. }
            | Op::ForgetAllFlows => {}
            Op::RaiseOwnerHigh { owner } => {
                self.maps.owner_high = self.maps.owner_high.max(*owner);
                self.index.owner_high = self.index.owner_high.max(*owner);
            }
            Op::PutPeerEntry { addr, entry, .. } => {
                if let Some(old) = self.maps.peers.insert(*addr, *entry) {
                    self.count_entry(old, false);
                }
                self.count_entry(*entry, true);
                self.index.owner_high = self.index.owner_high.max(entry.owner);
            }
            Op::DeletePeerEntry { addr } => {
                if let Some(old) = self.maps.peers.remove(addr) {
                    self.count_entry(old, false);
                }
            }
            Op::WgPeer(change) => {
                if !self.wg.peers.contains_key(&change.key)
                    && tagged(&self.wg, key_tag(&change.key)).next().is_some()
                {
                    self.hold_by_keys();
                }
                // An allowed IP has one holder: adding it to one peer takes it from the other.
                for ip in &change.add_allowed_ips {
                    let previous = self.holder_of(ip);
                    self.index.holders.insert(*ip, &change.key);
                    if let Some(previous) = previous.filter(|p| *p != change.key) {
                        if let Some(other) = self.wg.peers.get_mut(&previous) {
                            other.allowed_ips.remove(ip);
                        }
                    }
                }
                let peer = self.wg.peers.entry(change.key).or_default();
                if let Some(endpoint) = change.endpoint {
                    peer.endpoint = Some(endpoint);
                }
                if let Some(psk) = change.preshared_key {
                    peer.preshared_key = psk.map(Box::new);
                }
                if let Some(keepalive) = change.persistent_keepalive {
                    peer.persistent_keepalive = keepalive;
                }
                peer.allowed_ips
                    .extend(change.add_allowed_ips.iter().copied());
            }
            Op::RemoveWgPeer { key } => {
                if let Some(peer) = self.wg.peers.remove(key) {
                    for ip in peer.allowed_ips {
                        self.index.holders.remove_if(&ip, key);
                    }
                }
            }
            Op::DeletePolicyEntry { policy, prefix } => {
                self.unindex_content(*policy);
                if let Some(content) = self.maps.policies.get_mut(policy) {
                    if let Some(old) = content.remove_entry(prefix) {
                        self.index.count_rule_end(*policy, &old, false);
                    }
                    if content.is_empty() {
                        self.maps.policies.remove(policy);
                    }
                }
                self.index_content(*policy);
                self.sync_id(*policy);
            }
        }
    }
}

/// A change to one WireGuard peer; fields left `None` stay as they are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WgPeerChange {
    pub key: WgKey,
    pub peer: String,
    pub create: bool,
    pub endpoint: Option<SocketAddr>,
    /// `Some(None)`: remove the preshared key.
    pub preshared_key: Option<Option<WgKey>>,
    /// `Some(None)`: switch keepalive off.
    pub persistent_keepalive: Option<Option<u16>>,
    /// Addresses to add to the peer's allowed IPs (never a replacement of the list).
    pub add_allowed_ips: Vec<IpNet>,
}

/// One operation on the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    PutPolicyEntry {
        policy: u32,
        prefix: IpNet,
        allows: Vec<Allow>,
    },
    ResetPeerCounters {
        slot: u32,
    },
    /// Zeroes the rule counters `base..base + len` (a policy's new block), before any entry
    /// points at them.
    ResetRuleCounters {
        base: u32,
        len: u32,
    },
    /// Persists the owner high-water mark in the settings entry, before any entry with an
    /// owner up to `owner` is written: a restarted agent never hands out an owner again.
    RaiseOwnerHigh {
        owner: u64,
    },
    PutPeerEntry {
        peer: String,
        addr: IpAddr,
        entry: PeerEntry,
    },
    DeletePeerEntry {
        addr: IpAddr,
    },
    WgPeer(WgPeerChange),
    RemoveWgPeer {
        key: WgKey,
    },
    DeletePolicyEntry {
        policy: u32,
        prefix: IpNet,
    },
    /// Writes the datapath's settings entry (the replies switch, the flow timeouts and quota,
    /// the drop event rate); its owner high-water mark stays the kernel's. `replies_before`:
    /// the kernel's switch, if it has an entry.
    PutSettings {
        config: Config,
        replies_before: Option<bool>,
    },
    /// Deletes the reply flows recorded for these addresses (they left, or moved to another
    /// WireGuard peer): done off the apply path by the flow sweeper.
    ForgetFlows {
        addrs: Vec<IpAddr>,
    },
    /// Deletes every reply flow (replies were switched off, so switching them on again starts
    /// afresh): done off the apply path by the flow sweeper.
    ForgetAllFlows,
}

impl Op {
    /// Whether this is one BPF map write (the flow deletions are bulk work of their own).
    pub fn is_map_write(&self) -> bool {
        !self.is_wg() && !self.is_flow_work()
    }

    /// Whether this is a WireGuard change.
    pub fn is_wg(&self) -> bool {
        matches!(self, Op::WgPeer(_) | Op::RemoveWgPeer { .. })
    }

    /// Whether this deletes reply flows (the sweeper's work, off the apply path).
    pub fn is_flow_work(&self) -> bool {
        matches!(self, Op::ForgetFlows { .. } | Op::ForgetAllFlows)
    }

    /// Whether this only takes something away (an address entry, a WireGuard peer, a policy
    /// entry, reply flows): what a plan's lead is made of.
    pub fn is_deletion(&self) -> bool {
        matches!(
            self,
            Op::DeletePeerEntry { .. }
                | Op::RemoveWgPeer { .. }
                | Op::DeletePolicyEntry { .. }
                | Op::ForgetFlows { .. }
                | Op::ForgetAllFlows
        )
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let policy = |id: u32| match id {
            UNRESTRICTED => "unrestricted".to_owned(),
            EMPTY_POLICY => "nothing (\"egress\": [])".to_owned(),
            id => format!("policy {id}"),
        };
        match self {
            Op::PutPolicyEntry {
                policy: id,
                prefix,
                allows,
            } => write!(
                f,
                "map: put policy {id} {prefix} ({} allow entries)",
                allows.len()
            ),
            Op::ResetPeerCounters { slot } => write!(f, "map: reset counters of slot {slot}"),
            Op::ResetRuleCounters { base, len } => {
                write!(f, "map: reset rule counters {base}..{}", base + len)
            }
            Op::RaiseOwnerHigh { owner } => {
                write!(f, "map: raise the owner high-water mark to {owner}")
            }
            Op::PutPeerEntry { peer, addr, entry } => write!(
                f,
                "map: put peer {addr} ({peer}) -> {}, slot {}, owner {}",
                policy(entry.policy),
                entry.slot,
                entry.owner
            ),
            Op::DeletePeerEntry { addr } => write!(f, "map: delete peer {addr}"),
            Op::WgPeer(c) => {
                let verb = if c.create { "add" } else { "update" };
                write!(f, "wireguard: {verb} peer {} ({})", c.key, c.peer)?;
                if let Some(ep) = c.endpoint {
                    write!(f, " endpoint {ep}")?;
                }
                match c.preshared_key {
                    Some(Some(_)) => write!(f, " preshared-key (set)")?,
                    Some(None) => write!(f, " preshared-key (removed)")?,
                    None => {}
                }
                match c.persistent_keepalive {
                    Some(Some(s)) => write!(f, " keepalive {s}s")?,
                    Some(None) => write!(f, " keepalive off")?,
                    None => {}
                }
                for ip in &c.add_allowed_ips {
                    write!(f, " +allowed-ip {ip}")?;
                }
                Ok(())
            }
            Op::RemoveWgPeer { key } => write!(f, "wireguard: remove peer {key}"),
            Op::DeletePolicyEntry { policy: id, prefix } => {
                write!(f, "map: delete policy {id} {prefix}")
            }
            Op::PutSettings {
                config,
                replies_before,
            } => {
                let on_off = |b: bool| if b { "on" } else { "off" };
                write!(
                    f,
                    "settings: replies {} -> {}, flow timeouts tcp {}s (closing {}s) udp {}s \
                     icmp {}s unanswered {}s, {} flows per peer",
                    replies_before.map_or("unset", on_off),
                    on_off(config.replies()),
                    config.tcp_timeout_ns / 1_000_000_000,
                    config.tcp_closing_timeout_ns / 1_000_000_000,
                    config.udp_timeout_ns / 1_000_000_000,
                    config.icmp_timeout_ns / 1_000_000_000,
                    config.unanswered_timeout_ns / 1_000_000_000,
                    config.flows_per_peer
                )
            }
            Op::ForgetFlows { addrs } => {
                write!(f, "flows: forget the reply flows of")?;
                for addr in addrs {
                    write!(f, " {addr}")?;
                }
                Ok(())
            }
            Op::ForgetAllFlows => write!(f, "flows: forget every reply flow"),
        }
    }
}

/// The ordered operations that take the kernel from `actual` to `desired`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub ops: Vec<Op>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    pub fn map_writes(&self) -> usize {
        self.ops.iter().filter(|o| o.is_map_write()).count()
    }

    pub fn wg_changes(&self) -> usize {
        self.ops.iter().filter(|o| o.is_wg()).count()
    }

    /// Puts `ops` (the settings: [`plan_settings`]) right after the lead: a revocation waits
    /// for no settings write and no flow work.
    pub fn with_settings(mut self, ops: Vec<Op>) -> Self {
        let at = self.lead().len();
        self.ops.splice(at..at, ops);
        self
    }

    /// The plan's lead: its operations before the first that is not a deletion (the
    /// revocations, and the room a full map or trie needs). Nothing that can fail for want of
    /// room comes before them; apply them before anything else.
    pub fn lead(&self) -> &[Op] {
        lead(&self.ops)
    }
}

/// The settings entry: written when `want` differs from the kernel's entry `have` (but for the
/// owner high-water mark, which is the planner's and stays the kernel's). Switching replies
/// off forgets every recorded flow.
pub fn plan_settings(want: &Config, have: Option<&Config>) -> Vec<Op> {
    let want = Config {
        owner_high: have.map_or(0, |c| c.owner_high),
        ..*want
    };
    if have == Some(&want) {
        return Vec::new();
    }
    let replies_before = have.map(Config::replies);
    let mut ops = vec![Op::PutSettings {
        config: want,
        replies_before,
    }];
    if replies_before == Some(true) && !want.replies() {
        ops.push(Op::ForgetAllFlows);
    }
    ops
}

/// The lead of a list of operations (see [`Plan::lead`]).
pub fn lead(ops: &[Op]) -> &[Op] {
    &ops[..ops
        .iter()
        .position(|op| !op.is_deletion())
        .unwrap_or(ops.len())]
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("no free policy id is left")]
    PolicyIdsExhausted,
    #[error("no free per-peer counter slot is left (at most {MAX_PEERS})")]
    SlotsExhausted,
    #[error("no entry owner is left (64-bit counter exhausted)")]
    OwnersExhausted,
}

/// The policy ids `1..EMPTY_POLICY` that nothing uses, as ranges, kept current as ids are
/// used and freed: the lowest free id costs O(log #ranges), not a copy of every used id.
#[derive(Debug, Clone, Default)]
struct FreeIds {
    /// Free ranges below `high`, `start -> end` (exclusive), disjoint and not adjacent.
    below: BTreeMap<u32, u32>,
    /// One past the highest id ever used (at least 1): every id from here on is free.
    high: u32,
}

impl FreeIds {
    fn in_range(id: u32) -> bool {
        id != UNRESTRICTED && id != EMPTY_POLICY
    }

    /// `id` is used now.
    fn take(&mut self, id: u32) {
        if !Self::in_range(id) {
            return;
        }
        let high = self.high.max(1);
        if id >= high {
            if id > high {
                // Joined to a free range that ends at the old high mark.
                let start = match self.below.range(..high).next_back() {
                    Some((&start, &end)) if end == high => start,
                    _ => high,
                };
                self.below.insert(start, id);
            }
            self.high = id + 1;
            return;
        }
        let Some((&start, &end)) = self.below.range(..=id).next_back() else {
            return;
        };
        if id >= end {
            return;
        }
        self.below.remove(&start);
        if start < id {
            self.below.insert(start, id);
        }
        if id + 1 < end {
            self.below.insert(id + 1, end);
        }
    }

    /// `id` is used no more.
    fn give(&mut self, id: u32) {
        if !Self::in_range(id) || id >= self.high {
            return;
        }
        let mut start = id;
        let mut end = id + 1;
        if let Some((&s, &e)) = self.below.range(..=id).next_back() {
            if e > id {
                return;
            }
            if e == id {
                self.below.remove(&s);
                start = s;
            }
        }
        if let Some(e) = self.below.remove(&end) {
            end = e;
        }
        self.below.insert(start, end);
    }

    /// The free ids, lowest first (then every id from the high mark on).
    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.below
            .iter()
            .flat_map(|(start, end)| *start..*end)
            .chain(self.high.max(1)..=u32::MAX)
    }

    /// The lowest free id that `taken` does not hold, up to `max`.
    #[cfg(test)]
    fn lowest(&self, taken: &BTreeSet<u32>, max: u32) -> Option<u32> {
        self.iter()
            .find(|id| !taken.contains(id))
            .filter(|id| *id <= max)
    }
}

/// Which peers a plan looks at.
enum Scope<'a> {
    /// Every desired peer, and everything in the kernel: start-up, resync, after a failure.
    Full,
    /// Only these peers, given the kernel matches the state before them.
    Changes(Changes<'a>),
}

/// What changed between a state the kernel matches and the desired one: the desired peers that
/// are new or changed, and the previous versions of the peers that are gone or replaced (a
/// changed peer is in both). What [`plan_changes`] looks at, and all it looks at.
#[derive(Debug, Clone, Default)]
pub struct Changes<'a> {
    pub touched: Vec<&'a PeerSpec>,
    pub gone: Vec<&'a PeerSpec>,
}

impl<'a> Changes<'a> {
    /// The state pipeline's change set as the planner takes it: the touched peers of
    /// `desired` (the state `changes` led to) and the previous versions of those gone.
    pub fn of(changes: &'a crate::state::Changes, desired: &'a DesiredState) -> Self {
        Self {
            touched: changes.touched_in(desired),
            gone: changes.gone.iter().collect(),
        }
    }
}

/// Plans the operations that make the kernel match `desired`, comparing everything; pure.
/// When no plan can be made, the error carries the plan's lead: see [`Unplanned`].
pub fn plan(desired: &DesiredState, actual: &Actual) -> Result<Plan, Unplanned> {
    plan_scope(desired, Scope::Full, actual)
}

/// Plans the same operations as [`plan`], given that the kernel matches `previous`: only the
/// peers that differ between the two states are looked at, so a one-peer change costs the same
/// at 100 peers as at 100,000 (but for one comparison of the two states).
pub fn plan_update(
    previous: &DesiredState,
    desired: &DesiredState,
    actual: &Actual,
) -> Result<Plan, Unplanned> {
    plan_scope(desired, Scope::Changes(diff(previous, desired)), actual)
}

/// Plans the same operations as [`plan_update`] from the changed peers alone (found without
/// comparing the two states, e.g. while parsing): a one-peer change costs the same at any
/// number of peers. `changes` must hold every peer that differs, and only those.
pub fn plan_changes<'a>(
    desired: &'a DesiredState,
    changes: Changes<'a>,
    actual: &Actual,
) -> Result<Plan, Unplanned> {
    plan_scope(desired, Scope::Changes(changes), actual)
}

/// Whether two versions of a peer ask the same of the kernel (the compiled policy follows from
/// the rules, so it is not compared again).
fn same_peer(a: &PeerSpec, b: &PeerSpec) -> bool {
    a.name == b.name
        && a.public_key == b.public_key
        && a.address == b.address
        && a.address_v6 == b.address_v6
        && a.endpoint == b.endpoint
        && a.preshared_key() == b.preshared_key()
        && a.persistent_keepalive == b.persistent_keepalive
        && a.rules == b.rules
        && a.mode == b.mode
        && a.window() == b.window()
}

/// The map entry of one of `peer`'s addresses: its policy, counter slot and owner, audit mode
/// for an audited restricted peer, and its window on the boot clock.
fn peer_entry(
    peer: &PeerSpec,
    (policy, rules): (u32, u32),
    slot: u32,
    owner: u64,
    wall_minus_boot_ns: i128,
) -> PeerEntry {
    let mut entry = PeerEntry {
        policy,
        slot,
        owner,
        rules,
        ..PeerEntry::default()
    };
    if peer.mode == crate::state::Mode::Audit && policy != UNRESTRICTED {
        entry.flags |= wgfence_common::PEER_AUDIT;
    }
    if peer.window().is_some() {
        entry.flags |= wgfence_common::PEER_WINDOWED;
        let boot = |secs| crate::clock::to_boot_ns(secs, wall_minus_boot_ns);
        entry.not_before_ns = peer.window().not_before.map_or(0, boot);
        entry.expires_ns = peer.window().expires.map_or(u64::MAX, boot);
    }
    entry
}

/// The rule counter block of each policy the touched peers use: its rules, in canonical order,
/// count at `base..base + rules` of the rule counters. A policy keeps the block its entries
/// carry (so the counts survive restarts, adopted from the pinned entries); a policy without
/// one gets the first free range, zeroed first. Counters are observability, not enforcement:
/// when no range is free the policy is simply not counted ([`NO_RULES`]).
fn rule_blocks(
    touched: &[&PeerSpec],
    id_of: impl Fn(&CompiledPolicy) -> Option<u32>,
    counted: &BTreeMap<u32, u32>,
    actual: &Actual,
    ops: &mut Vec<Op>,
) -> BTreeMap<u32, u32> {
    let index = &actual.index;
    // The ids a full plan's set-aside peers count rules under: their blocks go into the
    // touched peers' entries of those ids too, as when every peer is planned.
    let mut want: BTreeMap<u32, u32> = counted.clone();
    for peer in touched {
        if let (Some(policy), Some(rules)) = (peer.policy.as_deref(), &peer.rules) {
            if let (Some(id), Ok(len)) = (id_of(policy), u32::try_from(rules.len())) {
                if len > 0 {
                    want.insert(id, len);
                }
            }
        }
    }
    // The ranges in use: a kept block is as long as its policy has counted rules (the
    // highest rule index its entries carry, plus one), whether or not its peers are touched:
    // a full plan and one of the changes alone place a new block alike, at the lowest free
    // range (the index keeps the free ranges current).
    let mut placing = rule_space::Placing::new(&index.rule_space);
    let mut blocks = BTreeMap::new();
    for (id, len) in &want {
        if let Some(base) = index.rule_base(*id) {
            blocks.insert(*id, base);
            continue;
        }
        if let Some(base) = placing.place(*len) {
            ops.push(Op::ResetRuleCounters { base, len: *len });
            blocks.insert(*id, base);
        }
    }
    blocks
}

/// Peers of `desired` that are new or changed since `previous`, and the versions of
/// `previous` that are gone or replaced. Both states are sorted by name.
fn diff<'a>(previous: &'a DesiredState, desired: &'a DesiredState) -> Changes<'a> {
    let (mut touched, mut gone) = (Vec::new(), Vec::new());
    for pair in crate::state::by_name(previous, desired) {
        match pair {
            (Some(old), Some(new)) if same_peer(old, new) => {}
            (old, new) => {
                gone.extend(old);
                touched.extend(new);
            }
        }
    }
    Changes { touched, gone }
}

/// A plan that could not be made (no slot, policy id or owner is left), with its lead: the
/// revocations, the removals of leaving WireGuard peers and the trie entries nothing references
/// once they ran. They take access away only and need no room, so they apply even when the
/// rest cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{error}")]
pub struct Unplanned {
    pub error: PlanError,
    pub lead: Plan,
}

fn plan_scope(
    desired: &DesiredState,
    scope: Scope<'_>,
    actual: &Actual,
) -> Result<Plan, Unplanned> {
    // A full plan (start-up, resync) plans nothing for the peers the kernel already has as
    // asked: after a restart that is nearly every peer. Should that plan fail, every peer is
    // planned, and that plan decides (its error, its lead, a full map's slot rotation).
    if matches!(scope, Scope::Full) {
        if let Ok(plan) = Planner::new(desired, Scope::Full, actual)
            .without_settled()
            .plan()
        {
            return Ok(plan);
        }
    }
    plan_every_peer(desired, scope, actual)
}

/// [`plan_scope`], with every peer of the scope planned.
fn plan_every_peer(
    desired: &DesiredState,
    scope: Scope<'_>,
    actual: &Actual,
) -> Result<Plan, Unplanned> {
    let mut planner = Planner::new(desired, scope, actual);
    match planner.plan() {
        Err(PlanError::SlotsExhausted) if planner.rotate_stranded_slots() => planner.plan(),
        planned => planned,
    }
    .map_err(|error| Unplanned {
        error,
        lead: Plan {
            ops: planner.failure_lead(),
        },
    })
}

/// The policy id of each touched peer's policy. Peers with equal rules share one compiled
/// policy, so an id is found by the policy's address (a hash lookup per peer); its content is
/// compared only for an allocation not seen yet.
#[derive(Default)]
struct PolicyIds<'a> {
    by_address: HashMap<*const CompiledPolicy, u32>,
    by_content: BTreeMap<&'a CompiledPolicy, u32>,
}

impl<'a> PolicyIds<'a> {
    /// Whether `policy` has an id already (then it is known by its address too).
    fn known(&mut self, policy: &'a CompiledPolicy) -> bool {
        let address: *const CompiledPolicy = policy;
        if self.by_address.contains_key(&address) {
            return true;
        }
        match self.by_content.get(policy).copied() {
            Some(id) => {
                self.by_address.insert(address, id);
                true
            }
            None => false,
        }
    }

    fn insert(&mut self, policy: &'a CompiledPolicy, id: u32) {
        self.by_address.insert(policy, id);
        self.by_content.insert(policy, id);
    }

    fn get(&self, policy: &CompiledPolicy) -> Option<u32> {
        let address: *const CompiledPolicy = policy;
        self.by_address.get(&address).copied()
    }
}

/// A peer's tunnel addresses (one or two), without an allocation.
type Addrs = smallvec::SmallVec<[IpAddr; 2]>;

/// An address entry the plan writes: the peer's name and key, and the entry.
type Wanted<'a> = BTreeMap<IpAddr, (&'a str, WgKey, PeerEntry)>;

/// One plan in the making: its scope and what its steps (see the module's documentation)
/// share. Each step is one method.
struct Planner<'a> {
    desired: &'a DesiredState,
    actual: &'a Actual,
    full: bool,
    /// The desired peers the plan looks at: all of them, or those new or changed.
    touched: Vec<&'a PeerSpec>,
    /// The previous versions of peers that are gone or changed (incremental plans only).
    gone: Vec<&'a PeerSpec>,
    /// The WireGuard key each address of a touched peer goes to.
    want_key: BTreeMap<IpAddr, WgKey>,
    /// The address entries the lead deletes (step 1).
    lead_deleted: BTreeSet<IpAddr>,
    /// Existing policy ids whose rules some desired peer counts, with their number
    /// ([`Self::without_settled`]; empty otherwise).
    counted: BTreeMap<u32, u32>,
}

impl<'a> Planner<'a> {
    fn new(desired: &'a DesiredState, scope: Scope<'a>, actual: &'a Actual) -> Self {
        let full = matches!(scope, Scope::Full);
        let (touched, gone) = match scope {
            Scope::Full => (desired.peers.iter().collect(), Vec::new()),
            Scope::Changes(Changes { touched, gone }) => (touched, gone),
        };
        let want_key = touched
            .iter()
            .flat_map(|p| p.addrs().map(|a| (a, p.public_key)))
            .collect();
        let mut planner = Self {
            desired,
            actual,
            full,
            touched,
            gone,
            want_key,
            lead_deleted: BTreeSet::new(),
            counted: BTreeMap::new(),
        };
        planner.lead_deleted = planner.lead_deletions();
        planner
    }

    /// The planner of a full plan, without the desired peers the kernel has exactly as the
    /// plan would leave them ([`Self::settled`]): the plan is the same, made in time
    /// proportional to the peers that differ (but for a lookup per peer).
    fn without_settled(mut self) -> Self {
        // The policy id each policy would get (an existing one, or none yet), by address,
        // and the ids whose rules a touched peer counts (their blocks go into every entry of
        // the id, [`rule_blocks`]).
        let mut ids: HashMap<*const CompiledPolicy, Option<u32>> = HashMap::new();
        let mut counted: BTreeMap<u32, u32> = BTreeMap::new();
        for peer in &self.touched {
            if let (Some(policy), Some(rules)) = (peer.policy.as_deref(), &peer.rules) {
                let id = *ids
                    .entry(policy)
                    .or_insert_with(|| self.existing_id(policy));
                if let (Some(id), Ok(len @ 1..)) = (id, u32::try_from(rules.len())) {
                    counted.insert(id, len);
                }
            }
        }
        let touched = std::mem::take(&mut self.touched);
        self.touched = touched
            .into_iter()
            .filter(|peer| !self.settled(peer, &ids, &counted))
            .collect();
        self.counted = counted;
        self
    }

    /// The id a policy gets if the kernel has its content already: the empty policy's, or
    /// the lowest id with that content (never UNRESTRICTED, see [`content_of`]).
    fn existing_id(&self, policy: &CompiledPolicy) -> Option<u32> {
        if policy.is_empty() {
            Some(EMPTY_POLICY)
        } else {
            self.actual.ids_of(policy).find(|id| *id != EMPTY_POLICY)
        }
    }

    /// Whether the kernel has `peer` as a full plan leaves it, so that planning it adds
    /// nothing: each address's entry is the one [`Self::entries`] would want (the policy's
    /// existing id and rule block, the entry's own slot and owner), no other entry uses the
    /// slot, no address is deleted or moves in the lead, and WireGuard has the peer as asked.
    fn settled(
        &self,
        peer: &PeerSpec,
        ids: &HashMap<*const CompiledPolicy, Option<u32>>,
        counted: &BTreeMap<u32, u32>,
    ) -> bool {
        let (maps, index) = (&self.actual.maps, &self.actual.index);
        // A peer the device does not have is a WireGuard change.
        let Some(have) = self.actual.wg.peers.get(&peer.public_key) else {
            return false;
        };
        let policy = match peer.policy.as_deref() {
            None => UNRESTRICTED,
            Some(policy) => {
                let address: *const CompiledPolicy = policy;
                match ids.get(&address).copied().flatten() {
                    Some(id) => id,
                    None => return false,
                }
            }
        };
        let rules = if counted.contains_key(&policy) {
            match index.rule_base(policy) {
                Some(base) => base,
                None => return false,
            }
        } else {
            NO_RULES
        };
        let mut slot = None;
        let mut addrs = 0;
        for addr in peer.addrs() {
            addrs += 1;
            let Some(entry) = maps.peers.get(&addr) else {
                return false;
            };
            let same = *slot.get_or_insert(entry.slot) == entry.slot
                && !self.lead_deleted.contains(&addr)
                && self
                    .actual
                    .routes_to_peer(&IpNet::from(addr), &peer.public_key)
                && peer_entry(
                    peer,
                    (policy, rules),
                    entry.slot,
                    entry.owner,
                    maps.wall_minus_boot_ns,
                ) == *entry;
            if !same {
                return false;
            }
        }
        slot.is_some_and(|slot| index.slot_refs.get(&slot) == Some(&addrs))
            && wg_change(peer, Some(have)).is_none()
    }

    /// Whether WireGuard routes `addr` to another peer than the one that gets it.
    fn moves(&self, addr: &IpAddr) -> bool {
        let ip = IpNet::from(*addr);
        self.want_key.get(addr).is_some_and(|key| {
            self.actual.index.holders.contains_key(&ip) && !self.actual.routes(&ip, key)
        })
    }

    /// Step 1's address entries: addresses no peer has any more, and addresses WireGuard still
    /// routes to another peer than the one that gets them (they move: the old holder must not
    /// run with the new holder's entry).
    fn lead_deletions(&self) -> BTreeSet<IpAddr> {
        let peers = &self.actual.maps.peers;
        if self.full {
            peers
                .keys()
                .filter(|a| !self.want_key.contains_key(a) || self.moves(a))
                .copied()
                .collect()
        } else {
            self.gone
                .iter()
                .flat_map(|p| p.addrs())
                .filter(|a| !self.want_key.contains_key(a))
                .chain(self.want_key.keys().copied().filter(|a| self.moves(a)))
                .filter(|a| peers.contains_key(a))
                .collect()
        }
    }

    /// The whole plan, in the module's order.
    fn plan(&self) -> Result<Plan, PlanError> {
        let mut ops = Vec::new();
        let ids = self.policy_ids(&mut ops)?;
        let slots = self.slots(&mut ops)?;
        let wanted = self.entries(&ids, &slots, &mut ops)?;
        let (mut lead, lead_delta) = self.revocations();
        let (moved, delta) = self.entry_writes(&wanted, &mut ops);
        ops.extend(self.wg_changes());
        ops.extend(moved);
        let (gc_lead, gc_last) = self.policy_gc(&delta, &lead_delta);
        lead.extend(gc_lead);
        lead.append(&mut ops);
        lead.extend(gc_last);
        Ok(Plan { ops: lead })
    }

    /// What applies of a plan that failed: its lead alone (steps 1–3), with every trie entry
    /// nothing references once the lead ran collected.
    fn failure_lead(&self) -> Vec<Op> {
        let (mut lead, lead_delta) = self.revocations();
        let (gc, _) = self.policy_gc(&lead_delta, &lead_delta);
        lead.extend(gc);
        lead
    }

    /// Policy ids: keep the id of content the kernel already has; new content gets a new id,
    /// whose trie entries are written (step 4). `"egress": []` always has the one id
    /// [`EMPTY_POLICY`], without entries.
    fn policy_ids(&self, ops: &mut Vec<Op>) -> Result<PolicyIds<'a>, PlanError> {
        let index = &self.actual.index;
        // The ids this plan hands out, lowest free first: a cursor, so that a plan writing P
        // new policies (a cold load) costs O(P).
        let mut free_ids = index.free_ids.iter();
        let mut new_id = || free_ids.next().filter(|id| *id < EMPTY_POLICY);
        let mut ids = PolicyIds::default();
        for policy in self.touched.iter().filter_map(|p| p.policy.as_deref()) {
            if ids.known(policy) {
                continue;
            }
            let id = match self.existing_id(policy) {
                Some(id) => id,
                None => {
                    let id = new_id().ok_or(PlanError::PolicyIdsExhausted)?;
                    for (prefix, allows) in policy.entries() {
                        ops.push(Op::PutPolicyEntry {
                            policy: id,
                            prefix,
                            allows: allows.to_vec(),
                        });
                    }
                    id
                }
            };
            ids.insert(policy, id);
        }
        Ok(ids)
    }

    /// Entries per counter slot that the lead deletes.
    fn deleted_per_slot(&self) -> BTreeMap<u32, usize> {
        let mut deleted = BTreeMap::new();
        for addr in &self.lead_deleted {
            if let Some(entry) = self.actual.maps.peers.get(addr) {
                count_up(&mut deleted, entry.slot);
            }
        }
        deleted
    }

    /// Whether `slot` has no user after the lead but `own` addresses of one peer: a peer keeps
    /// (or takes) only a slot no other peer's remaining entry uses, never shared for a moment.
    fn only(&self, deleted: &BTreeMap<u32, usize>, slot: u32, own: &[IpAddr]) -> bool {
        let users = self.actual.index.slot_refs.get(&slot).copied().unwrap_or(0);
        let own = own
            .iter()
            .filter(|a| !self.lead_deleted.contains(a))
            .filter(|a| {
                self.actual
                    .maps
                    .peers
                    .get(a)
                    .is_some_and(|e| e.slot == slot)
            })
            .count();
        own + deleted.get(&slot).copied().unwrap_or(0) >= users
    }

    /// The slot each touched peer keeps, if any: first the slot of its entries that stay, then
    /// of its entries the lead deletes, then of an address WireGuard still has for its key (an
    /// address change keeps the peer's counters). The entries that stay come first: a peer
    /// that took another slot would leave theirs to nobody until its puts ran, and a full map
    /// has no slot to spare for that.
    fn kept_slots(&self, deleted: &BTreeMap<u32, usize>) -> Vec<Option<u32>> {
        let maps = &self.actual.maps;
        let mut taken = BTreeSet::new();
        self.touched
            .iter()
            .map(|peer| {
                // Inline: a full plan passes here for every peer.
                let own: Addrs = peer.addrs().collect();
                let previous = self
                    .actual
                    .wg
                    .peers
                    .get(&peer.public_key)
                    .into_iter()
                    .flat_map(|p| p.allowed_ips.iter().map(|net| net.addr()));
                let (staying, leaving): (Addrs, Addrs) = own
                    .iter()
                    .copied()
                    .partition(|a| !self.lead_deleted.contains(a));
                let kept = staying
                    .into_iter()
                    .chain(leaving)
                    .chain(previous)
                    .filter_map(|a| maps.peers.get(&a).map(|e| e.slot))
                    .find(|s| !taken.contains(s) && self.only(deleted, *s, &own));
                if let Some(slot) = kept {
                    taken.insert(slot);
                }
                kept
            })
            .collect()
    }

    /// Counter slots, one per touched peer, kept across restarts via the entries (step 5). A
    /// new peer gets a slot no entry uses; failing that (a full map), a slot whose every entry
    /// the lead deletes and no peer keeps. Never a slot an entry that stays still uses: the
    /// reset would wipe that peer's counters, and the two would share a flow quota.
    fn slots(&self, ops: &mut Vec<Op>) -> Result<Vec<u32>, PlanError> {
        let deleted = self.deleted_per_slot();
        let kept = self.kept_slots(&deleted);
        let index = &self.actual.index;
        let max = self.actual.slots().saturating_sub(1);
        // The slots this plan hands out, lowest first: the free ones below the high mark in
        // order, then those above it. A cursor each, so that a plan handing out N slots (a
        // cold load) costs O(N), not a scan past every slot it already handed out.
        let mut below = index.free_slots.iter().copied();
        let mut beyond = index.slot_high;
        let mut free = || {
            let slot = match below.next() {
                Some(slot) => slot,
                None => {
                    let slot = beyond;
                    beyond = beyond.checked_add(1)?;
                    slot
                }
            };
            (slot <= max).then_some(slot)
        };
        let taken: BTreeSet<u32> = kept.iter().flatten().copied().collect();
        let mut released: BTreeSet<u32> = deleted
            .keys()
            .copied()
            .filter(|slot| !taken.contains(slot) && self.only(&deleted, *slot, &[]))
            .collect();
        kept.into_iter()
            .map(|kept| match kept {
                Some(slot) => Ok(slot),
                None => {
                    let slot = free()
                        .or_else(|| released.pop_first())
                        .ok_or(PlanError::SlotsExhausted)?;
                    ops.push(Op::ResetPeerCounters { slot });
                    Ok(slot)
                }
            })
            .collect()
    }

    /// At a full map, slots that no touched peer can keep while entries that stay use them:
    /// shared by two peers' entries (a kernel changed behind the agent's back, or a plan
    /// stopped halfway), or left by a peer that has another slot. Their entries are rewritten
    /// with other slots anyway; deleting them in the lead frees the slots for the puts (they
    /// are written again later in the plan). Whether any was added to the lead.
    fn rotate_stranded_slots(&mut self) -> bool {
        let deleted = self.deleted_per_slot();
        let kept: BTreeSet<u32> = self.kept_slots(&deleted).into_iter().flatten().collect();
        let stranded: Vec<IpAddr> = self
            .actual
            .maps
            .peers
            .iter()
            .filter(|(addr, entry)| {
                !kept.contains(&entry.slot)
                    && !self.lead_deleted.contains(addr)
                    && self.want_key.contains_key(addr)
            })
            .map(|(addr, _)| *addr)
            .collect();
        // Only slots every remaining user of which is rewritten: a slot an unchanged peer
        // uses stays with it.
        let mut users: BTreeMap<u32, usize> = BTreeMap::new();
        for addr in &stranded {
            if let Some(entry) = self.actual.maps.peers.get(addr) {
                count_up(&mut users, entry.slot);
            }
        }
        let rotate: Vec<IpAddr> = stranded
            .into_iter()
            .filter(|addr| {
                self.actual.maps.peers.get(addr).is_some_and(|e| {
                    let remaining = self
                        .actual
                        .index
                        .slot_refs
                        .get(&e.slot)
                        .copied()
                        .unwrap_or(0)
                        .saturating_sub(deleted.get(&e.slot).copied().unwrap_or(0));
                    users.get(&e.slot).copied().unwrap_or(0) >= remaining
                })
            })
            .collect();
        let any = !rotate.is_empty();
        self.lead_deleted.extend(rotate);
        any
    }

    /// Each touched peer's address entries, and the owner high-water mark persisted before
    /// any entry carries a new owner.
    fn entries(
        &self,
        ids: &PolicyIds<'a>,
        slots: &[u32],
        ops: &mut Vec<Op>,
    ) -> Result<Wanted<'a>, PlanError> {
        let (maps, index) = (&self.actual.maps, &self.actual.index);
        let rule_bases = rule_blocks(
            &self.touched,
            |p| ids.get(p),
            &self.counted,
            self.actual,
            ops,
        );
        let mut owner_high = index.owner_high;
        let mut wanted = Wanted::new();
        for (peer, &slot) in self.touched.iter().zip(slots) {
            // Every touched peer's policy has an id; were one missing, nothing would pass.
            let policy = peer
                .policy
                .as_deref()
                .map_or(UNRESTRICTED, |p| ids.get(p).unwrap_or(EMPTY_POLICY));
            for addr in peer.addrs() {
                // An address keeps its owner while its WireGuard holder and its slot stay; any
                // other change gets a new owner, so the entry write ends the old holder's
                // flows. An entry the lead deletes is written again with a new owner.
                let kept = maps.peers.get(&addr).filter(|e| {
                    e.slot == slot
                        && !self.lead_deleted.contains(&addr)
                        && self.actual.routes(&IpNet::from(addr), &peer.public_key)
                });
                let owner = match kept {
                    Some(entry) => entry.owner,
                    None => {
                        owner_high = owner_high
                            .checked_add(1)
                            .ok_or(PlanError::OwnersExhausted)?;
                        owner_high
                    }
                };
                let rules = rule_bases.get(&policy).copied().unwrap_or(NO_RULES);
                let entry = peer_entry(peer, (policy, rules), slot, owner, maps.wall_minus_boot_ns);
                wanted.insert(addr, (&peer.name, peer.public_key, entry));
            }
        }
        if owner_high > index.owner_high {
            ops.push(Op::RaiseOwnerHigh { owner: owner_high });
        }
        Ok(wanted)
    }

    /// Step 5's writes into `ops`, and step 7's (the entries of moving addresses, written after
    /// WireGuard moved them), with the change of each policy id's references over the plan.
    fn entry_writes(
        &self,
        wanted: &Wanted<'a>,
        ops: &mut Vec<Op>,
    ) -> (Vec<Op>, BTreeMap<u32, i64>) {
        let peers = &self.actual.maps.peers;
        let mut moved = Vec::new();
        let mut delta: BTreeMap<u32, i64> = BTreeMap::new();
        for (addr, (name, _, entry)) in wanted {
            let current = peers
                .get(addr)
                .filter(|_| !self.lead_deleted.contains(addr));
            if current == Some(entry) {
                continue;
            }
            if let Some(current) = peers.get(addr) {
                *delta.entry(current.policy).or_default() -= 1;
            }
            *delta.entry(entry.policy).or_default() += 1;
            let put = Op::PutPeerEntry {
                peer: (*name).to_owned(),
                addr: *addr,
                entry: *entry,
            };
            // An address WireGuard still routes to another peer must not carry the new
            // holder's policy, or its new owner, before it moves. (With the new owner in place
            // early, the old holder's traffic could record flows the new holder would then
            // answer.)
            if self.moves(addr) {
                moved.push(put);
            } else {
                ops.push(put);
            }
        }
        for addr in self.lead_deleted.iter().filter(|a| !wanted.contains_key(a)) {
            if let Some(current) = peers.get(addr) {
                *delta.entry(current.policy).or_default() -= 1;
            }
        }
        (moved, delta)
    }

    /// Steps 1 and 2: the address entries the lead deletes, then the WireGuard peers that
    /// leave; with the change of each policy id's references they make.
    fn revocations(&self) -> (Vec<Op>, BTreeMap<u32, i64>) {
        let mut lead_delta: BTreeMap<u32, i64> = BTreeMap::new();
        let mut lead = Vec::new();
        let mut forget = Vec::new();
        for addr in &self.lead_deleted {
            if let Some(current) = self.actual.maps.peers.get(addr) {
                *lead_delta.entry(current.policy).or_default() -= 1;
                lead.push(Op::DeletePeerEntry { addr: *addr });
                forget.push(*addr);
            }
        }
        // Their flows were recorded for the old holder (or for nobody, from now on).
        if !forget.is_empty() {
            lead.push(Op::ForgetFlows { addrs: forget });
        }
        // A leaving peer goes with the revocations, after the address entries, also when
        // another peer takes over its addresses: those entries are deleted in the lead, and the
        // old key (a leaked one, in a rotation) must not keep a session, or the address's
        // inbound traffic, while the puts before the handover fail.
        lead.extend(
            self.leaving_keys()
                .into_iter()
                .map(|key| Op::RemoveWgPeer { key }),
        );
        (lead, lead_delta)
    }

    /// The WireGuard peers that leave the state.
    fn leaving_keys(&self) -> BTreeSet<WgKey> {
        let wg = &self.actual.wg.peers;
        if self.full {
            // Hashed: 32-byte keys compare slowly, and a full plan has every peer's.
            let desired: HashSet<WgKey> = self.desired.peers.iter().map(|p| p.public_key).collect();
            wg.keys()
                .filter(|key| !desired.contains(key))
                .copied()
                .collect()
        } else {
            // A gone version's key stays only if a changed peer has it (unchanged peers had
            // their keys in the previous state too, where keys are unique).
            let kept: BTreeSet<WgKey> = self.touched.iter().map(|p| p.public_key).collect();
            self.gone
                .iter()
                .map(|p| p.public_key)
                .filter(|k| !kept.contains(k) && wg.contains_key(k))
                .collect()
        }
    }

    /// Step 6: per-peer WireGuard changes only.
    fn wg_changes(&self) -> Vec<Op> {
        self.touched
            .iter()
            .filter_map(|peer| wg_change(peer, self.actual.wg.peers.get(&peer.public_key)))
            .map(Op::WgPeer)
            .collect()
    }

    /// Steps 3 and 8: the trie entries of policies no peer entry references after the plan.
    /// Those nothing references once the lead ran (a revoked peer's, or a failed put's
    /// leftovers, which a full plan also collects) go in the lead: deleting them takes access
    /// from nobody, and at a full trie the puts need their room. Those the plan's switches
    /// unreference go last.
    /// `delta`: the change of each policy id's references over the plan (a full plan looks at
    /// every id, an incremental one only at those).
    fn policy_gc(
        &self,
        delta: &BTreeMap<u32, i64>,
        lead_delta: &BTreeMap<u32, i64>,
    ) -> (Vec<Op>, Vec<Op>) {
        let (maps, index) = (&self.actual.maps, &self.actual.index);
        let candidates: BTreeSet<u32> = if self.full {
            maps.policies.keys().copied().collect()
        } else {
            delta.keys().copied().collect()
        };
        let (mut lead, mut last) = (Vec::new(), Vec::new());
        for id in candidates {
            let now = index.policy_refs.get(&id).copied().unwrap_or(0) as i64;
            let after_lead = now + lead_delta.get(&id).copied().unwrap_or(0);
            let after = now + delta.get(&id).copied().unwrap_or(0);
            // The empty policy and UNRESTRICTED never have entries: any there (drift) are
            // deleted at once.
            let never = id == EMPTY_POLICY || id == UNRESTRICTED;
            if !never && after > 0 {
                continue;
            }
            let to = if never || after_lead <= 0 {
                &mut lead
            } else {
                &mut last
            };
            if let Some(content) = maps.policies.get(&id) {
                for (prefix, _) in content.entries() {
                    to.push(Op::DeletePolicyEntry { policy: id, prefix });
                }
            }
        }
        (lead, last)
    }
}

/// The change that makes WireGuard's peer `have` (if the device has it) what `peer` asks.
fn wg_change(peer: &PeerSpec, have: Option<&WgPeer>) -> Option<WgPeerChange> {
    let want_ips: smallvec::SmallVec<[IpNet; 2]> = peer.addrs().map(IpNet::from).collect();
    let Some(have) = have else {
        return Some(WgPeerChange {
            key: peer.public_key,
            peer: peer.name.to_string(),
            create: true,
            endpoint: peer.endpoint,
            preshared_key: peer.preshared_key().map(Some),
            persistent_keepalive: peer.persistent_keepalive.map(Some),
            add_allowed_ips: want_ips.into_vec(),
        });
    };
    let keepalive_now = have.persistent_keepalive.filter(|s| *s != 0);
    let endpoint = peer.endpoint.filter(|e| have.endpoint != Some(*e));
    let want_psk = peer.preshared_key();
    let preshared_key = (have.preshared_key.as_deref() != want_psk.as_ref()).then_some(want_psk);
    let persistent_keepalive =
        (keepalive_now != peer.persistent_keepalive).then_some(peer.persistent_keepalive);
    let missing = |ip: &IpNet| !have.allowed_ips.contains(ip);
    let unchanged = endpoint.is_none()
        && preshared_key.is_none()
        && persistent_keepalive.is_none()
        && !want_ips.iter().any(missing);
    // Most peers of a full plan are unchanged: nothing is allocated for them.
    (!unchanged).then(|| WgPeerChange {
        key: peer.public_key,
        peer: peer.name.to_string(),
        create: false,
        endpoint,
        preshared_key,
        persistent_keepalive,
        add_allowed_ips: want_ips.into_iter().filter(missing).collect(),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use proptest::prelude::*;
    use serde_json::{json, Value};

    use super::*;
    use crate::state::parse;

    /// The kernel, modelled by [`Actual::apply`].
    #[derive(Debug, Clone, Default)]
    struct Kernel(Actual);

    impl Kernel {
        fn actual(&self) -> Actual {
            self.0.clone()
        }

        fn apply(&mut self, op: &Op) {
            if let Err(e) = invariants::check_op(&self.0, op) {
                panic!("{e}");
            }
            self.0.apply(op);
            // The free-slot index, kept current op by op, is the complement of the used
            // slots below the high mark: what a scan over every used slot would find.
            let index = &self.0.index;
            let free: BTreeSet<u32> = (0..index.slot_high)
                .filter(|s| !index.slot_refs.contains_key(s))
                .collect();
            assert_eq!(index.free_slots, free, "after {op}");
            // The rule-block index counts the entries as they are.
            let mut rule_refs = BTreeMap::new();
            for e in self.0.maps.peers.values().filter(|e| e.rules != NO_RULES) {
                *rule_refs.entry((e.policy, e.rules)).or_insert(0usize) += 1;
            }
            assert_eq!(index.rule_refs, rule_refs, "after {op}");
            // ... and each block's length as the trie entries have it.
            for (id, content) in &self.0.maps.policies {
                assert_eq!(index.rule_len(*id), content.counted_rules(), "after {op}");
            }
            assert!(
                index
                    .rule_ends
                    .keys()
                    .all(|(id, _)| self.0.maps.policies.contains_key(id)),
                "after {op}"
            );
            let mut blocks = BTreeMap::new();
            for (id, base) in rule_refs.keys() {
                blocks.entry(*id).or_insert(*base);
            }
            let blocks: Vec<(u32, u32)> = blocks
                .iter()
                .map(|(id, base)| {
                    let len = self
                        .0
                        .maps
                        .policies
                        .get(id)
                        .map_or(0, |p| p.counted_rules());
                    (*base, len.max(1))
                })
                .collect();
            assert_eq!(index.rule_blocks_in_use(), blocks, "after {op}");
            // ... and the free ranges are what those blocks leave.
            let mut space = rule_space::RuleSpace::default();
            for (base, len) in &blocks {
                space.add(*base, *len);
            }
            assert!(index.rule_space == space, "after {op}");
            // A kernel read back (built in one go) has the indexes kept op by op.
            let read = Actual::new(self.0.maps.clone(), self.0.wg.clone());
            assert_eq!(read.index.slot_refs, index.slot_refs, "after {op}");
            // (Held by tags or by keys: the same holders.)
            let holders = |a: &Actual| -> Vec<(IpNet, Option<WgKey>)> {
                let ips: Vec<IpNet> = match &a.index.holders {
                    Holders::Tags(tags) => tags.iter().map(|(ip, _)| ip).collect(),
                    Holders::Keys(keys) => keys.iter().map(|(ip, _)| ip).collect(),
                };
                ips.into_iter().map(|ip| (ip, a.holder_of(&ip))).collect()
            };
            assert_eq!(holders(&read), holders(&self.0), "after {op}");
            assert_eq!(read.index.rule_refs, index.rule_refs, "after {op}");
            assert!(read.index.rule_space == index.rule_space, "after {op}");
            let free: BTreeSet<u32> = (0..read.index.slot_high)
                .filter(|s| !index.slot_refs.contains_key(s))
                .collect();
            assert_eq!(read.index.free_slots, free, "after {op}");
            // The free-id index gives the lowest id no trie or peer entry uses.
            let used: BTreeSet<u32> = self
                .0
                .maps
                .policies
                .keys()
                .chain(index.policy_refs.keys())
                .copied()
                .collect();
            let lowest = (1..EMPTY_POLICY).find(|id| !used.contains(id));
            assert_eq!(
                index.free_ids.lowest(&BTreeSet::new(), EMPTY_POLICY - 1),
                lowest,
                "after {op}"
            );
            assert!(index.slot_refs.keys().all(|s| *s < index.slot_high));
        }
    }

    /// The kernel enforces exactly `desired`.
    #[track_caller]
    fn assert_converged(kernel: &Kernel, desired: &DesiredState) {
        if let Err(e) = invariants::check_converged(&kernel.0, desired) {
            panic!("{e}");
        }
    }

    /// Invariants that must hold after every single operation of the transition old -> new.
    #[track_caller]
    fn assert_safe_midway(kernel: &Kernel, old: &DesiredState, new: &DesiredState) {
        if let Err(e) = invariants::check_safe_midway(&kernel.0, old, new) {
            panic!("{e}");
        }
    }

    fn key(n: u8) -> String {
        WgKey([n; 32]).to_base64()
    }

    /// Generated peer `n`'s key: keys 2k and 2k+1 share their first 8 bytes, the tag the
    /// holders index keeps ([`key_tag`]), so that the property tests plan with shared tags as
    /// well as with a tag per key.
    fn gen_key(n: u8) -> String {
        let mut key = [n; 32];
        key[..8].fill(n / 2);
        WgKey(key).to_base64()
    }

    const RULE_SETS: [&str; 5] = [
        r#"[]"#,
        r#"[{"cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443]}]"#,
        r#"[{"cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443]}, {"cidr": "0.0.0.0/0", "protocol": "icmp"}]"#,
        r#"[{"cidr": "fd00::/8", "protocol": "udp", "ports": ["5000-5010"]}, {"cidr": "10.1.0.0/16"}]"#,
        r#"[{"cidr": "192.0.2.0/24", "protocol": "udp"}]"#,
    ];

    #[derive(Debug, Clone)]
    struct Gen {
        name: u8,
        key: u8,
        v4: Option<u8>,
        v6: Option<u8>,
        rules: Option<usize>,
        endpoint: Option<u8>,
        psk: Option<u8>,
        keepalive: bool,
    }

    fn gen_peer() -> impl Strategy<Value = Gen> {
        (
            0u8..6,
            0u8..8,
            proptest::option::of(2u8..9),
            proptest::option::of(2u8..9),
            proptest::option::of(0usize..RULE_SETS.len()),
            proptest::option::of(1u8..3),
            proptest::option::of(1u8..3),
            any::<bool>(),
        )
            .prop_map(|(name, key, v4, v6, rules, endpoint, psk, keepalive)| Gen {
                name,
                key,
                v4: v4.or(if v6.is_none() { Some(name + 2) } else { None }),
                v6,
                rules,
                endpoint,
                psk,
                keepalive,
            })
    }

    /// A valid state from generated peers (conflicting ones are dropped), in the given order.
    fn build(gens: &[Gen]) -> (String, DesiredState) {
        let mut seen = BTreeSet::new();
        let mut peers: Vec<Value> = Vec::new();
        for g in gens {
            let ids = [
                format!("n{}", g.name),
                format!("k{}", g.key),
                format!("a{:?}", g.v4),
                format!("b{:?}", g.v6),
            ];
            let clash = ids
                .iter()
                .filter(|id| !id.ends_with("None"))
                .any(|id| seen.contains(id));
            if clash {
                continue;
            }
            seen.extend(ids.into_iter().filter(|id| !id.ends_with("None")));
            let mut p =
                json!({ "name": format!("peer-{}", g.name), "publicKey": gen_key(g.key + 1) });
            if let Some(a) = g.v4 {
                p["address"] = json!(format!("10.8.0.{a}"));
            }
            if let Some(b) = g.v6 {
                p["addressV6"] = json!(format!("fd00:8::{b}"));
            }
            if let Some(r) = g.rules {
                p["egress"] = serde_json::from_str(RULE_SETS[r]).unwrap();
            }
            if let Some(e) = g.endpoint {
                p["endpoint"] = json!(format!("198.51.100.{e}:51820"));
            }
            if let Some(k) = g.psk {
                p["presharedKey"] = json!(key(100 + k));
            }
            if g.keepalive {
                p["persistentKeepalive"] = json!(25);
            }
            peers.push(p);
        }
        let text = json!({ "version": 1, "peers": peers }).to_string();
        let state = parse(&text).unwrap_or_else(|e| panic!("generated state invalid: {e}\n{text}"));
        (text, state)
    }

    /// Counter slots of the kernel the property tests plan for: fewer than their peers, so
    /// that they plan at a full map too.
    const SLOTS: u32 = 4;

    /// Whether `new` needs more counter slots than a kernel of [`SLOTS`] has: then planning it
    /// must fail, with a lead of deletions only that revokes what leaves the state.
    fn over_capacity(
        kernel: &Kernel,
        new: &DesiredState,
        planned: &Result<Plan, Unplanned>,
    ) -> bool {
        let over = new.peers.len() > SLOTS as usize;
        assert_eq!(
            over,
            matches!(
                planned,
                Err(Unplanned {
                    error: PlanError::SlotsExhausted,
                    ..
                })
            ),
            "{} peers at {SLOTS} slots planned {planned:?}",
            new.peers.len()
        );
        if let Err(Unplanned { lead, .. }) = planned {
            assert_eq!(
                lead.lead(),
                lead.ops.as_slice(),
                "not only deletions: {lead:?}"
            );
            if let Err(e) = invariants::check_revocations_lead(&kernel.0, new, &lead.ops) {
                panic!("the lead of a failed plan: {e}");
            }
        }
        over
    }

    fn apply_checked(kernel: &mut Kernel, old: &DesiredState, new: &DesiredState) -> Plan {
        let plan = plan(new, &kernel.actual()).unwrap();
        apply_plan_checked(kernel, old, new, &plan);
        plan
    }

    /// Applies `plan` (old -> new) with its lead and every midway invariant checked.
    #[track_caller]
    fn apply_plan_checked(
        kernel: &mut Kernel,
        old: &DesiredState,
        new: &DesiredState,
        plan: &Plan,
    ) {
        if let Err(e) = invariants::check_revocations_lead(&kernel.0, new, &plan.ops) {
            panic!("{e}");
        }
        for op in &plan.ops {
            kernel.apply(op);
            assert_safe_midway(kernel, old, new);
        }
    }

    proptest! {
        /// The free-id index, over any sequence of ids used and freed, gives what a scan of
        /// the used ids would: the lowest free id not taken by the plan, within the bound.
        #[test]
        fn free_ids_give_the_lowest_unused_id(
            steps in proptest::collection::vec((any::<bool>(), 0u32..40), 0..80),
            taken in proptest::collection::btree_set(1u32..45, 0..6),
            max in 1u32..50,
        ) {
            let mut free = FreeIds::default();
            let mut used = BTreeSet::new();
            for (take, id) in steps {
                if take {
                    free.take(id);
                    used.insert(id);
                } else {
                    free.give(id);
                    used.remove(&id);
                }
                let mut ranges = free.below.iter().peekable();
                while let Some((start, end)) = ranges.next() {
                    prop_assert!(start < end && *end <= free.high);
                    if let Some((next, _)) = ranges.peek() {
                        prop_assert!(end < *next, "ranges overlap or touch");
                    }
                }
            }
            let naive = (1..=max).find(|id| !used.contains(id) && !taken.contains(id));
            prop_assert_eq!(free.lowest(&taken, max), naive);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(crate::proptest_cases(300)))]

        #[test]
        fn plans_converge_safely_and_an_equal_state_plans_nothing(
            states in prop::collection::vec(prop::collection::vec(gen_peer(), 0..7), 1..6),
        ) {
            let mut kernel = Kernel(Actual::default().with_slot_limit(SLOTS));
            let mut old = DesiredState::default();
            for gens in &states {
                let (_, new) = build(gens);
                if over_capacity(&kernel, &new, &plan(&new, &kernel.actual())) {
                    continue;
                }
                apply_checked(&mut kernel, &old, &new);
                assert_converged(&kernel, &new);
                // The same state, peers in reverse order: nothing to do.
                let mut reversed = gens.clone();
                reversed.reverse();
                let (_, again) = build(&reversed);
                if again == new {
                    let replan = plan(&again, &kernel.actual()).unwrap();
                    prop_assert!(replan.is_empty(), "reordered state planned {:?}", replan.ops);
                }
                old = new;
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(crate::proptest_cases(300)))]

        /// The same, planning only what differs from the previous state (what the agent does
        /// between resyncs): it must end where a full plan ends, just as safely.
        #[test]
        fn incremental_plans_converge_like_full_ones(
            states in prop::collection::vec(prop::collection::vec(gen_peer(), 0..7), 1..6),
        ) {
            let mut kernel = Kernel(Actual::default().with_slot_limit(SLOTS));
            let mut old = DesiredState::default();
            for gens in &states {
                let (_, new) = build(gens);
                let update = plan_update(&old, &new, &kernel.actual());
                if over_capacity(&kernel, &new, &update) {
                    continue;
                }
                let update = update.unwrap();
                apply_plan_checked(&mut kernel, &old, &new, &update);
                assert_converged(&kernel, &new);
                let full = plan(&new, &kernel.actual()).unwrap();
                prop_assert!(full.is_empty(), "a full plan after the incremental one: {:?}", full.ops);
                prop_assert!(plan_update(&new, &new, &kernel.actual()).map(|p| p.is_empty()).unwrap_or(false));
                old = new;
            }
        }
    }

    #[test]
    fn an_incremental_plan_touches_only_the_changed_peer() {
        let peers: Vec<Value> = (0..200u8)
            .map(|i| {
                json!({ "name": format!("p{i:03}"), "publicKey": key(i), "address": format!("10.8.{}.{}", i / 100, i % 100 + 2),
                        "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [u16::from(i % 4) + 1] }] })
            })
            .collect();
        let before = one(Value::Array(peers.clone()));
        let mut kernel = Kernel::default();
        converge(&mut kernel, &DesiredState::default(), &before);
        let mut changed = peers;
        changed[7]["egress"] = json!([{ "cidr": "10.0.0.0/8", "protocol": "udp" }]);
        let after = one(Value::Array(changed));
        let update = plan_update(&before, &after, &kernel.actual()).unwrap();
        // The new policy's entry, its rule counters zeroed, and one switch; the old policy is
        // still used by 49 peers.
        assert_eq!(update.ops.len(), 3, "{:#?}", update.ops);
        assert_eq!(update, plan(&after, &kernel.actual()).unwrap());
        // The same from the change set alone, without comparing the states.
        let changes = Changes {
            touched: vec![&after.peers[7]],
            gone: vec![&before.peers[7]],
        };
        assert_eq!(
            Ok(update),
            plan_changes(&after, changes, &kernel.actual()).map_err(|u| u.error)
        );
    }

    fn one(peers: Value) -> DesiredState {
        parse(&json!({ "version": 1, "peers": peers }).to_string()).unwrap()
    }

    /// A full plan, or one that looks only at what differs from `previous`.
    fn plan_either(
        incremental: bool,
        previous: &DesiredState,
        desired: &DesiredState,
        kernel: &Kernel,
    ) -> Result<Plan, Unplanned> {
        if incremental {
            plan_update(previous, desired, &kernel.0)
        } else {
            plan(desired, &kernel.0)
        }
    }

    fn converge(kernel: &mut Kernel, old: &DesiredState, new: &DesiredState) -> Plan {
        let plan = apply_checked(kernel, old, new);
        assert_converged(kernel, new);
        plan
    }

    #[test]
    fn add_then_revoke_follows_the_ordering_rules() {
        let mut kernel = Kernel::default();
        let empty = DesiredState::default();
        let alice = one(
            json!([{ "name": "alice", "publicKey": key(1), "address": "10.8.0.2",
            "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp" }] }]),
        );
        let add = converge(&mut kernel, &empty, &alice);
        let kinds: Vec<&str> = add
            .ops
            .iter()
            .map(|op| match op {
                Op::PutPolicyEntry { .. } => "policy",
                Op::ResetPeerCounters { .. } => "reset",
                Op::ResetRuleCounters { .. } => "rules",
                Op::RaiseOwnerHigh { .. } => "owners",
                Op::PutPeerEntry { .. } => "peer",
                Op::WgPeer(_) => "wg",
                _ => "other",
            })
            .collect();
        assert_eq!(kinds, ["policy", "reset", "rules", "owners", "peer", "wg"]);

        let revoke = converge(&mut kernel, &alice, &empty);
        let kinds: Vec<&str> = revoke
            .ops
            .iter()
            .map(|op| match op {
                Op::DeletePeerEntry { .. } => "peer",
                Op::ForgetFlows { .. } => "flows",
                Op::RemoveWgPeer { .. } => "wg",
                Op::DeletePolicyEntry { .. } => "policy",
                _ => "other",
            })
            .collect();
        assert_eq!(kinds, ["peer", "flows", "wg", "policy"]);
    }

    /// Issue 11 item 5: at capacity (a full peer map, a full trie) a put fails, so a
    /// revocation must not wait behind one. "Revoke r + add n": r's address entries, then r's
    /// WireGuard peer, go before every put, in a full plan and in an incremental one; a put
    /// that fails after them leaves r revoked, and the retry does not delete r again.
    #[test]
    fn revoke_r_and_add_n_deletes_r_before_any_put() {
        let before = one(json!([
            { "name": "r", "publicKey": key(1), "address": "10.8.0.2", "addressV6": "fd00:8::2",
              "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp" }] },
            { "name": "u", "publicKey": key(2), "address": "10.8.0.3" },
        ]));
        let after = one(json!([
            { "name": "n", "publicKey": key(3), "address": "10.8.0.4",
              "egress": [{ "cidr": "192.0.2.0/24", "protocol": "udp" }] },
            { "name": "u", "publicKey": key(2), "address": "10.8.0.3" },
        ]));
        let mut kernel = Kernel::default();
        converge(&mut kernel, &DesiredState::default(), &before);
        let revocation = [
            Op::DeletePeerEntry {
                addr: IpAddr::from([10, 8, 0, 2]),
            },
            Op::DeletePeerEntry {
                addr: "fd00:8::2".parse().unwrap_or(IpAddr::from([0; 16])),
            },
            Op::ForgetFlows {
                addrs: vec![
                    IpAddr::from([10, 8, 0, 2]),
                    "fd00:8::2".parse().unwrap_or(IpAddr::from([0; 16])),
                ],
            },
            Op::RemoveWgPeer {
                key: WgKey([1; 32]),
            },
        ];
        let full = plan(&after, &kernel.actual()).unwrap();
        let update = plan_update(&before, &after, &kernel.actual()).unwrap();
        for (how, p) in [("full", &full), ("incremental", &update)] {
            assert!(
                p.ops.starts_with(&revocation),
                "{how}: r is not revoked before the first put: {:#?}",
                p.ops
            );
            if let Err(e) = invariants::check_revocations_lead(&kernel.0, &after, &p.ops) {
                panic!("{how}: {e}");
            }
        }

        // The first put fails (the map is full): what ran before it stays, and the retry, a
        // full plan from the kernel as it is, does not touch r again.
        let mut failed = kernel.clone();
        for op in &update.ops[..revocation.len()] {
            failed.apply(op);
            assert_safe_midway(&failed, &before, &after);
        }
        let retry = plan(&after, &failed.actual()).unwrap();
        assert!(
            !retry.ops.iter().any(|op| revocation.contains(op)),
            "the retry revokes r again: {:#?}",
            retry.ops
        );
        for op in &retry.ops {
            failed.apply(op);
            assert_safe_midway(&failed, &before, &after);
        }
        assert_converged(&failed, &after);
    }

    /// Issue 11 item 7: `"egress": []` allows nothing. Its compiled form is a restricted policy
    /// id without a trie entry (never UNRESTRICTED), found again by its (empty) content like
    /// any policy: shared by every such peer, and an equal state plans nothing.
    #[test]
    fn an_empty_egress_is_a_restricted_policy_without_entries() {
        let open = |n: u8| json!({ "name": format!("p{n}"), "publicKey": key(n), "address": format!("10.8.0.{n}") });
        let closed = |n: u8| {
            let mut p = open(n);
            p["egress"] = json!([]);
            p
        };
        let nothing = one(json!([closed(2), closed(3), open(4)]));
        let mut kernel = Kernel::default();
        let add = converge(&mut kernel, &DesiredState::default(), &nothing);
        assert!(
            !add.ops
                .iter()
                .any(|op| matches!(op, Op::PutPolicyEntry { .. })),
            "{:#?}",
            add.ops
        );
        let entry = |k: &Kernel, n: u8| kernel_entry(k, IpAddr::from([10, 8, 0, n]));
        let id = entry(&kernel, 2).policy;
        assert_ne!(id, UNRESTRICTED);
        assert_eq!(
            entry(&kernel, 3).policy,
            id,
            "equal empty rule sets share one id"
        );
        assert_eq!(entry(&kernel, 4).policy, UNRESTRICTED);
        assert!(plan(&nothing, &kernel.actual())
            .map(|p| p.is_empty())
            .unwrap_or(false));

        // Omitting egress and "egress": [] are different states, both ways, also incrementally.
        let swapped = one(json!([open(2), closed(3), closed(4)]));
        let update = plan_update(&nothing, &swapped, &kernel.actual()).unwrap();
        assert_eq!(update, plan(&swapped, &kernel.actual()).unwrap());
        assert_eq!(update.ops.len(), 2, "two switches: {:#?}", update.ops);
        for op in &update.ops {
            kernel.apply(op);
            assert_safe_midway(&kernel, &nothing, &swapped);
        }
        assert_converged(&kernel, &swapped);
        assert_eq!(entry(&kernel, 2).policy, UNRESTRICTED);
        assert_eq!(
            entry(&kernel, 4).policy,
            id,
            "the empty policy keeps its id"
        );

        // A restart reads the maps back: the id without entries is still the empty policy.
        let read = Actual::new(kernel.0.maps().clone(), kernel.0.wg().clone());
        assert!(plan(&swapped, &read).map(|p| p.is_empty()).unwrap_or(false));
    }

    fn kernel_entry(kernel: &Kernel, addr: IpAddr) -> PeerEntry {
        kernel
            .0
            .maps()
            .peers
            .get(&addr)
            .copied()
            .unwrap_or_else(|| panic!("no entry for {addr}"))
    }

    #[test]
    fn a_policy_change_writes_new_entries_switches_once_and_deletes_the_old() {
        let mut kernel = Kernel::default();
        let v1 = one(
            json!([{ "name": "a", "publicKey": key(1), "address": "10.8.0.2",
            "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443] }] }]),
        );
        let v2 = one(
            json!([{ "name": "a", "publicKey": key(1), "address": "10.8.0.2",
            "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [80] }] }]),
        );
        converge(&mut kernel, &DesiredState::default(), &v1);
        let change = converge(&mut kernel, &v1, &v2);
        assert!(
            matches!(
                change.ops.as_slice(),
                [
                    Op::PutPolicyEntry { policy: 2, .. },
                    // Policy 1 still holds rule counter 0 until the switch.
                    Op::ResetRuleCounters { base: 1, len: 1 },
                    Op::PutPeerEntry {
                        entry: PeerEntry {
                            policy: 2,
                            slot: 0,
                            rules: 1,
                            ..
                        },
                        ..
                    },
                    Op::DeletePolicyEntry { policy: 1, .. }
                ]
            ),
            "{:#?}",
            change.ops
        );
    }

    /// The owner of each address's entry.
    fn owners(kernel: &Kernel) -> BTreeMap<IpAddr, u64> {
        kernel
            .0
            .maps()
            .peers
            .iter()
            .map(|(a, e)| (*a, e.owner))
            .collect()
    }

    #[test]
    fn key_rotation_gives_the_addresses_new_owners_and_keeps_policy_and_slot() {
        let mut kernel = Kernel::default();
        let old = one(
            json!([{ "name": "a", "publicKey": key(1), "address": "10.8.0.2", "addressV6": "fd00:8::2" }]),
        );
        let new = one(
            json!([{ "name": "a", "publicKey": key(2), "address": "10.8.0.2", "addressV6": "fd00:8::2" }]),
        );
        converge(&mut kernel, &DesiredState::default(), &old);
        let before = kernel.0.maps().peers.clone();
        let rotate = converge(&mut kernel, &old, &new);
        // The old key is cut off first (its entries, then its WireGuard peer); the entries
        // come back with new owners once WireGuard routes the addresses to the new key.
        assert!(
            matches!(
                rotate.ops.as_slice(),
                [
                    Op::DeletePeerEntry { .. },
                    Op::DeletePeerEntry { .. },
                    Op::ForgetFlows { .. },
                    Op::RemoveWgPeer { .. },
                    Op::RaiseOwnerHigh { owner: 4 },
                    Op::WgPeer(c),
                    Op::PutPeerEntry { .. },
                    Op::PutPeerEntry { .. },
                ] if c.create
            ),
            "{:#?}",
            rotate.ops
        );
        for (addr, entry) in &kernel.0.maps().peers {
            let old = before[addr];
            assert_eq!((entry.policy, entry.slot), (old.policy, old.slot));
            assert!(entry.owner > old.owner, "{addr}: {entry:?} after {old:?}");
        }
    }

    /// Issue 11 item 4: a new peer takes an address in the same push that removes its holder,
    /// with equal rules. The plan used to hold only WireGuard operations, so the new peer's
    /// packets passed as replies to the old peer's flows.
    #[test]
    fn a_new_holder_with_equal_rules_gets_a_new_owner() {
        let rules = json!([{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443] }]);
        let old = one(
            json!([{ "name": "old", "publicKey": key(1), "address": "10.8.0.2",
            "addressV6": "fd00:8::2", "egress": rules }]),
        );
        let new = one(
            json!([{ "name": "new", "publicKey": key(2), "address": "10.8.0.2",
            "addressV6": "fd00:8::2", "egress": rules }]),
        );
        for incremental in [true, false] {
            let mut kernel = Kernel::default();
            converge(&mut kernel, &DesiredState::default(), &old);
            let before = owners(&kernel);
            let take = if incremental {
                converge(&mut kernel, &old, &new)
            } else {
                let plan = plan(&new, &kernel.actual()).unwrap();
                for op in &plan.ops {
                    kernel.apply(op);
                }
                assert_converged(&kernel, &new);
                plan
            };
            assert!(take.map_writes() > 0, "{:#?}", take.ops);
            let after = owners(&kernel);
            for (addr, owner) in &after {
                assert!(
                    *owner > before[addr],
                    "{addr} kept owner {owner} (incremental: {incremental})"
                );
            }
            // And once converged, nothing more: an unchanged state costs no write.
            assert!(plan(&new, &kernel.actual()).is_ok_and(|p| p.is_empty()));
        }
    }

    #[test]
    fn owners_are_never_reused_after_a_restart() {
        let mut kernel = Kernel::default();
        let a = one(json!([{ "name": "a", "publicKey": key(1), "address": "10.8.0.2" }]));
        let b = one(json!([{ "name": "b", "publicKey": key(2), "address": "10.8.0.2" }]));
        converge(&mut kernel, &DesiredState::default(), &a);
        let first = owners(&kernel)[&IpAddr::from([10, 8, 0, 2])];
        converge(&mut kernel, &a, &DesiredState::default());
        assert!(kernel.0.maps().peers.is_empty());
        assert_eq!(kernel.0.maps().owner_high, first);
        // A restarted agent reads only the kernel: the high-water mark is all that is left.
        let restarted = Actual::new(kernel.0.maps().clone(), kernel.0.wg().clone());
        let plan = plan(&b, &restarted).unwrap();
        let owner = plan.ops.iter().find_map(|op| match op {
            Op::PutPeerEntry { entry, .. } => Some(entry.owner),
            _ => None,
        });
        assert_eq!(owner, Some(first + 1), "{:#?}", plan.ops);
        let raise = plan
            .ops
            .iter()
            .position(|op| matches!(op, Op::RaiseOwnerHigh { owner } if *owner == first + 1));
        let put = plan
            .ops
            .iter()
            .position(|op| matches!(op, Op::PutPeerEntry { .. }));
        assert!(raise < put && raise.is_some(), "{:#?}", plan.ops);
    }

    /// The old address leaves the state, so it goes first, like any revocation (at a full map,
    /// the new entry could not be written before it); the new one is written before
    /// WireGuard routes it.
    #[test]
    fn an_address_change_deletes_the_old_entry_then_adds_the_new() {
        let mut kernel = Kernel::default();
        let old = one(json!([{ "name": "a", "publicKey": key(1), "address": "10.8.0.2" }]));
        let new = one(json!([{ "name": "a", "publicKey": key(1), "address": "10.8.0.3" }]));
        converge(&mut kernel, &DesiredState::default(), &old);
        let change = converge(&mut kernel, &old, &new);
        assert!(
            matches!(
                change.ops.as_slice(),
                [Op::DeletePeerEntry { .. }, Op::ForgetFlows { .. }, Op::RaiseOwnerHigh { .. }, Op::PutPeerEntry { .. }, Op::WgPeer(c)] if !c.create && c.add_allowed_ips.len() == 1
            ),
            "{:#?}",
            change.ops
        );
        // WireGuard keeps the old allowed IP (there is no atomic removal of one); the map has no
        // entry for it, so packets from it are dropped. A later state plans nothing for it.
        assert!(plan(&new, &kernel.actual())
            .map(|p| p.is_empty())
            .unwrap_or(false));
    }

    #[test]
    fn an_address_taken_over_with_another_policy_is_written_after_wireguard_moves_it() {
        let mut kernel = Kernel::default();
        let old = one(json!([
            { "name": "a", "publicKey": key(1), "address": "10.8.0.2" },
        ]));
        let new = one(json!([
            { "name": "b", "publicKey": key(2), "address": "10.8.0.2",
              "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp" }] },
        ]));
        converge(&mut kernel, &DesiredState::default(), &old);
        let take = converge(&mut kernel, &old, &new);
        let pos = |f: &dyn Fn(&Op) -> bool| take.ops.iter().position(f).unwrap_or(usize::MAX);
        let delete = pos(&|o| matches!(o, Op::DeletePeerEntry { .. }));
        let wg = pos(&|o| matches!(o, Op::WgPeer(_)));
        let put = pos(&|o| matches!(o, Op::PutPeerEntry { .. }));
        assert!(delete < wg && wg < put, "{:#?}", take.ops);
    }

    /// Trie entries written by hand under UNRESTRICTED, equal to a restricted peer's policy:
    /// the peer must not be given UNRESTRICTED (the datapath lets everything through for it,
    /// without looking at those entries), and the entries are deleted.
    #[test]
    fn a_policy_under_the_unrestricted_id_is_never_reused() {
        let s = one(json!([
            { "name": "a", "publicKey": key(1), "address": "10.8.0.2",
              "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443] }] },
        ]));
        let content = s.peers[0].policy.as_deref().cloned().unwrap_or_default();
        let mut maps = ActualMaps::default();
        maps.policies.insert(UNRESTRICTED, content);
        let mut kernel = Kernel(Actual::new(maps, ActualWg::default()));
        let planned = plan(&s, &kernel.actual()).unwrap();
        for op in &planned.ops {
            kernel.apply(op);
        }
        let a = kernel
            .0
            .maps
            .peers
            .get(&IpAddr::from([10, 8, 0, 2]))
            .copied();
        assert!(
            a.is_some_and(|e| e.policy != UNRESTRICTED),
            "peer a entry {a:?}, plan {planned:?}"
        );
        assert!(!kernel.0.maps.policies.contains_key(&UNRESTRICTED));
        assert_converged(&kernel, &s);
    }

    /// Rules that compile to nothing share the empty policy's id with `"egress": []`. A full
    /// plan after the second peer's WireGuard endpoint was changed by hand (so that it is
    /// planned, and the first may be set aside) is the plan of every peer.
    #[test]
    fn a_set_aside_peer_keeps_its_rule_block_in_the_others_entries() {
        let s = one(json!([
            { "name": "a", "publicKey": key(1), "address": "10.8.0.2",
              "egress": [{ "cidr": "10.0.0.0/8", "except": ["10.0.0.0/9", "10.128.0.0/9"] }] },
            { "name": "b", "publicKey": key(2), "address": "10.8.0.3", "egress": [] },
        ]));
        assert!(s.peers[0].policy.as_ref().is_some_and(|p| p.is_empty()));
        let mut kernel = Kernel::default();
        converge(&mut kernel, &DesiredState::default(), &s);
        let (maps, mut wg) = (kernel.0.maps.clone(), kernel.0.wg.clone());
        if let Some(b) = wg.peers.get_mut(&WgKey([2; 32])) {
            b.endpoint = Some(SocketAddr::from(([198, 51, 100, 9], 51820)));
        }
        let drifted = Actual::new(maps, wg);
        let every = plan_every_peer(&s, Scope::Full, &drifted);
        assert_eq!(plan(&s, &drifted), every);
    }

    /// A change made to the kernel behind the agent's back (the [`drift`] kinds).
    fn gen_drift() -> impl Strategy<Value = (u8, usize, u8)> {
        (0u8..11, any::<usize>(), any::<u8>())
    }

    /// `actual` with `(kind, which, value)` done to it, read back as the agent would.
    fn drift(actual: &Actual, changes: &[(u8, usize, u8)]) -> Actual {
        let (mut maps, mut wg) = (actual.maps.clone(), actual.wg.clone());
        for &(kind, which, value) in changes {
            let addr = maps
                .peers
                .keys()
                .nth(which % maps.peers.len().max(1))
                .copied();
            let key = wg.peers.keys().nth(which % wg.peers.len().max(1)).copied();
            let entry = addr.and_then(|a| maps.peers.get_mut(&a));
            let peer = key.and_then(|k| wg.peers.get_mut(&k));
            match (kind, entry, peer) {
                (0, Some(_), _) => {
                    addr.map(|a| maps.peers.remove(&a));
                }
                (1, Some(e), _) => e.slot = u32::from(value) % SLOTS,
                (2, Some(e), _) => e.owner = u64::from(value),
                (3, Some(e), _) => {
                    e.policy = [UNRESTRICTED, EMPTY_POLICY, 1, 2][usize::from(value % 4)]
                }
                (4, Some(e), _) => e.rules = [NO_RULES, 0, 1][usize::from(value % 3)],
                (5, _, Some(_)) => {
                    key.map(|k| wg.peers.remove(&k));
                }
                (6, _, Some(p)) => {
                    p.allowed_ips
                        .insert(IpNet::from(IpAddr::from([10, 8, 0, value % 10])));
                }
                (7, _, Some(p)) => {
                    p.endpoint = Some(SocketAddr::from(([198, 51, 100, value % 3], 51820)));
                }
                // A policy's trie entry deleted; a policy's content copied under another id
                // (two ids of one content, or entries under an id that takes none); the
                // owner high-water mark moved.
                (8, _, _) => {
                    let n = maps.policies.len().max(1);
                    if let Some(policy) = maps.policies.values_mut().nth(which % n) {
                        let k = usize::from(value) % policy.entries().len().max(1);
                        let prefix = policy.entries().nth(k).map(|(p, _)| p);
                        prefix.map(|p| policy.remove_entry(&p));
                    }
                }
                (9, _, _) => {
                    let n = maps.policies.len().max(1);
                    let content = maps.policies.values().nth(which % n).cloned();
                    let id = [UNRESTRICTED, EMPTY_POLICY, 1, 2, 3][usize::from(value % 5)];
                    content.map(|c| maps.policies.insert(id, c));
                }
                (10, _, _) => maps.owner_high = u64::from(value),
                _ => {}
            }
        }
        Actual::new(maps, wg).with_slot_limit(SLOTS)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(crate::proptest_cases(300)))]

        /// A full plan leaves out the peers the kernel has as asked, and is still the plan of
        /// every peer, op for op (or the same error): against a kernel that converged, one a
        /// state behind, and either changed behind the agent's back.
        #[test]
        fn a_full_plan_without_settled_peers_is_the_plan_of_every_peer(
            states in prop::collection::vec(prop::collection::vec(gen_peer(), 0..7), 1..5),
            drifts in prop::collection::vec(prop::collection::vec(gen_drift(), 1..5), 5),
        ) {
            let mut kernel = Kernel(Actual::default().with_slot_limit(SLOTS));
            let mut old = DesiredState::default();
            for (gens, changes) in states.iter().zip(&drifts) {
                let (_, new) = build(gens);
                for actual in [kernel.actual(), drift(&kernel.0, changes)] {
                    let every = plan_every_peer(&new, Scope::Full, &actual);
                    prop_assert_eq!(plan(&new, &actual), every);
                }
                let planned = plan(&new, &kernel.actual());
                if over_capacity(&kernel, &new, &planned) {
                    continue;
                }
                apply_checked(&mut kernel, &old, &new);
                for actual in [kernel.actual(), drift(&kernel.0, changes)] {
                    let every = plan_every_peer(&new, Scope::Full, &actual);
                    prop_assert_eq!(plan(&new, &actual), every);
                }
                old = new;
            }
        }
    }

    #[test]
    fn drift_is_repaired() {
        let mut kernel = Kernel::default();
        let s = one(json!([
            { "name": "a", "publicKey": key(1), "address": "10.8.0.2",
              "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp" }, { "cidr": "10.1.0.0/16", "protocol": "udp" }] },
            { "name": "b", "publicKey": key(2), "address": "10.8.0.3" },
        ]));
        converge(&mut kernel, &DesiredState::default(), &s);
        // An entry deleted by hand, a policy entry deleted by hand, a WireGuard peer removed.
        let maps = &mut kernel.0.maps;
        maps.peers.remove(&IpAddr::from([10, 8, 0, 3]));
        if let Some(policy) = maps.policies.values_mut().next() {
            let prefix = policy.entries().next().map(|(p, _)| p);
            if let Some(prefix) = prefix {
                policy.remove_entry(&prefix);
            }
        }
        kernel.0.wg.peers.remove(&WgKey([2; 32]));
        kernel.0 = Actual::new(kernel.0.maps.clone(), kernel.0.wg.clone());
        // The kernel is already broken, so the midway invariants cannot hold; apply plainly.
        let repair = plan(&s, &kernel.actual()).unwrap();
        for op in &repair.ops {
            kernel.apply(op);
        }
        assert_converged(&kernel, &s);
        assert!(plan(&s, &kernel.actual())
            .map(|p| p.is_empty())
            .unwrap_or(false));
    }

    #[test]
    fn peers_with_equal_rules_share_policy_entries() {
        let rules = json!([{ "cidr": "10.0.0.0/8", "protocol": "tcp" }]);
        let s = one(json!([
            { "name": "a", "publicKey": key(1), "address": "10.8.0.2", "egress": rules },
            { "name": "b", "publicKey": key(2), "address": "10.8.0.3", "egress": rules },
        ]));
        let p = plan(&s, &Actual::default()).unwrap();
        let policy_puts = p
            .ops
            .iter()
            .filter(|o| matches!(o, Op::PutPolicyEntry { .. }))
            .count();
        assert_eq!(policy_puts, 1);
        assert!(Arc::ptr_eq(
            s.peers[0].policy.as_ref().unwrap_or(&Arc::default()),
            s.peers[1].policy.as_ref().unwrap_or(&Arc::default())
        ));
    }

    /// Review of issue 11, finding 1: "rotate alice K1 -> K2 (K1 leaked), same rules", pushed
    /// with a put that fails (a new policy at a full trie). The old key's packets are dropped
    /// from the first operation on, and its WireGuard peer is gone before the first put, so
    /// nothing a failing put stops keeps the leaked key in.
    #[test]
    fn a_key_rotation_cuts_the_old_key_off_before_any_put() {
        let rules = json!([{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443] }]);
        let before = one(json!([
            { "name": "alice", "publicKey": key(1), "address": "10.8.0.2", "egress": rules },
            { "name": "carol", "publicKey": key(3), "address": "10.8.0.3" },
        ]));
        let after = one(json!([
            { "name": "alice", "publicKey": key(2), "address": "10.8.0.2", "egress": rules },
            { "name": "carol", "publicKey": key(3), "address": "10.8.0.3" },
            { "name": "dave", "publicKey": key(4), "address": "10.8.0.4",
              "egress": [{ "cidr": "192.0.2.0/24", "protocol": "udp" }] },
        ]));
        let old_key = WgKey([1; 32]);
        let alice = IpAddr::from([10, 8, 0, 2]);
        for incremental in [false, true] {
            let mut kernel = Kernel::default();
            converge(&mut kernel, &DesiredState::default(), &before);
            let p = plan_either(incremental, &before, &after, &kernel).unwrap();
            if let Err(e) = invariants::check_revocations_lead(&kernel.0, &after, &p.ops) {
                panic!("incremental {incremental}: {e}");
            }
            // Every put fails: only the lead runs.
            let lead = lead(&p.ops);
            for (i, op) in lead.iter().enumerate() {
                kernel.apply(op);
                let held = kernel.0.holder(alice) == Some(old_key);
                assert!(
                    !(held && kernel.0.maps().peers.contains_key(&alice)),
                    "incremental {incremental}: after op {i} ({op}) the old key still passes: \
                     {:#?}",
                    p.ops
                );
            }
            assert!(
                !kernel.0.wg().peers.contains_key(&old_key),
                "incremental {incremental}: the old key is still a WireGuard peer when the first \
                 put runs: {:#?}",
                p.ops
            );
        }
    }

    /// Applies `ops` to a kernel whose policy tries hold at most `capacity` entries in all, as
    /// the agent would: stops at the first put the trie refuses (ENOSPC). Whether all ran.
    fn apply_at_capacity(kernel: &mut Kernel, ops: &[Op], capacity: usize) -> bool {
        for op in ops {
            if let Op::PutPolicyEntry { policy, prefix, .. } = op {
                let policies = &kernel.0.maps().policies;
                let total: usize = policies.values().map(|p| p.entries().len()).sum();
                let exists = policies
                    .get(policy)
                    .is_some_and(|p| p.entries().any(|(q, _)| q == *prefix));
                if !exists && total >= capacity {
                    return false;
                }
            }
            kernel.apply(op);
        }
        true
    }

    /// Review of issue 11, finding 2: at a full policy trie, "revoke z + add n with a new
    /// policy" is a valid state (it needs no more entries than the trie holds), so it must
    /// converge: z's policy entries, which nothing references once z's entry is deleted, go
    /// in the lead, before n's policy is written; so do the leftovers of a failed put.
    #[test]
    fn a_full_trie_makes_room_before_the_puts() {
        let before = one(json!([
            { "name": "u", "publicKey": key(1), "address": "10.8.0.2" },
            { "name": "z", "publicKey": key(2), "address": "10.8.0.3",
              "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp" }, { "cidr": "10.1.0.0/16", "protocol": "udp" }] },
        ]));
        let after = one(json!([
            { "name": "n", "publicKey": key(3), "address": "10.8.0.4",
              "egress": [{ "cidr": "192.0.2.0/24", "protocol": "udp" }, { "cidr": "198.51.100.0/24", "protocol": "tcp" }] },
            { "name": "u", "publicKey": key(1), "address": "10.8.0.2" },
        ]));
        for incremental in [false, true] {
            let mut kernel = Kernel::default();
            converge(&mut kernel, &DesiredState::default(), &before);
            // The trie is full: it holds z's two entries and no more.
            let capacity = 2;
            let first = plan_either(incremental, &before, &after, &kernel).unwrap();
            let gc = lead(&first.ops)
                .iter()
                .filter(|op| matches!(op, Op::DeletePolicyEntry { .. }))
                .count();
            assert_eq!(
                gc, 2,
                "incremental {incremental}: z's policy entries are not deleted in the lead: \
                 {:#?}",
                first.ops
            );
            // A retry is a full plan from the kernel as it is; a few must get there.
            let mut ops = first.ops;
            let mut converged = false;
            for _ in 0..3 {
                if apply_at_capacity(&mut kernel, &ops, capacity) {
                    converged = true;
                    break;
                }
                ops = plan(&after, &kernel.actual()).unwrap().ops;
            }
            assert!(converged, "incremental {incremental}: the trie stays full");
            assert_converged(&kernel, &after);
        }

        // The leftovers of a put that failed halfway (n's first entry, its id unreferenced)
        // go before the retry writes n's policy again.
        let mut kernel = Kernel::default();
        converge(&mut kernel, &DesiredState::default(), &before);
        let ops = plan(&after, &kernel.actual()).unwrap().ops;
        let first_put = ops
            .iter()
            .position(|op| matches!(op, Op::PutPolicyEntry { .. }))
            .unwrap_or(ops.len());
        for op in &ops[..=first_put.min(ops.len() - 1)] {
            kernel.apply(op);
        }
        let retry = plan(&after, &kernel.actual()).unwrap();
        assert!(
            lead(&retry.ops)
                .iter()
                .any(|op| matches!(op, Op::DeletePolicyEntry { .. })),
            "the leftover is not collected in the lead: {:#?}",
            retry.ops
        );
        assert!(apply_at_capacity(&mut kernel, &retry.ops, 2));
        assert_converged(&kernel, &after);
    }

    /// Review of issue 11, finding 3: "revoke r + add n" with every counter slot in use gives
    /// n the slot r's deletion frees, never the slot of a peer that stays (which would wipe
    /// its counters and share its flow quota); with no slot freed, the plan fails.
    #[test]
    fn a_full_map_reuses_only_the_slots_the_lead_frees() {
        // "a" (slot 0) stays; "r" (slot 1) goes; "n" comes.
        let before = one(json!([
            { "name": "a", "publicKey": key(1), "address": "10.8.0.2" },
            { "name": "r", "publicKey": key(2), "address": "10.8.0.3" },
        ]));
        let after = one(json!([
            { "name": "a", "publicKey": key(1), "address": "10.8.0.2" },
            { "name": "n", "publicKey": key(3), "address": "10.8.0.4" },
        ]));
        for incremental in [false, true] {
            let mut kernel = Kernel(Actual::default().with_slot_limit(2));
            converge(&mut kernel, &DesiredState::default(), &before);
            let slot = |k: &Kernel, n: u8| kernel_entry(k, IpAddr::from([10, 8, 0, n])).slot;
            let (a, r) = (slot(&kernel, 2), slot(&kernel, 3));
            let p = plan_either(incremental, &before, &after, &kernel).unwrap();
            for op in &p.ops {
                kernel.apply(op);
                assert_safe_midway(&kernel, &before, &after);
            }
            assert_converged(&kernel, &after);
            assert_eq!(slot(&kernel, 2), a, "incremental {incremental}");
            assert_eq!(
                slot(&kernel, 4),
                r,
                "incremental {incremental}: n did not get r's slot: {:#?}",
                p.ops
            );
            assert!(
                !p.ops.contains(&Op::ResetPeerCounters { slot: a }),
                "incremental {incremental}: a's counters are reset: {:#?}",
                p.ops
            );
        }
        // Adding n without revoking anyone: no slot is free, so no plan.
        let mut kernel = Kernel(Actual::default().with_slot_limit(2));
        converge(&mut kernel, &DesiredState::default(), &before);
        let more = one(json!([
            { "name": "a", "publicKey": key(1), "address": "10.8.0.2" },
            { "name": "n", "publicKey": key(3), "address": "10.8.0.4" },
            { "name": "r", "publicKey": key(2), "address": "10.8.0.3" },
        ]));
        for planned in [
            plan_update(&before, &more, &kernel.actual()),
            plan(&more, &kernel.actual()),
        ] {
            assert_eq!(planned.map_err(|u| u.error), Err(PlanError::SlotsExhausted));
        }
    }

    /// The fuzzer's fuzz/corpus/plan/slots-exhausted-at-a-full-map: four peers at four slots,
    /// after two states that moved addresses between keys. Peer-0 (key 4) keeps its entry
    /// fd00:8::8 in slot 0 and takes over 10.8.0.2 (slot 1, key 1's). It used to keep slot 1,
    /// leaving slot 0 to nobody until its puts ran, so the fourth peer found no slot.
    #[test]
    fn a_full_map_keeps_the_slot_of_the_entries_that_stay() {
        let states = [
            json!([{ "name": "peer-3", "publicKey": key(1), "address": "10.8.0.5" }]),
            json!([
                { "name": "peer-2", "publicKey": key(4), "address": "10.8.0.5", "addressV6": "fd00:8::8",
                  "egress": [{ "cidr": "fd00:1::/103", "protocol": "tcp", "ports": ["444-446", "442-443", 444] }] },
                { "name": "peer-3", "publicKey": key(1), "address": "10.8.0.2", "persistentKeepalive": 0 },
            ]),
            json!([
                { "name": "peer-3", "publicKey": key(7), "address": "10.8.0.3" },
                { "name": "peer-0", "publicKey": key(4), "address": "10.8.0.2", "addressV6": "fd00:8::8",
                  "egress": [{ "cidr": "0.0.0.0/0", "protocol": "any" }], "persistentKeepalive": 0 },
                { "name": "peer-1", "publicKey": key(1), "address": "10.8.0.4", "addressV6": "fd00:8::3",
                  "egress": [], "endpoint": "198.51.100.1:51820", "persistentKeepalive": 50 },
                { "name": "peer-2", "publicKey": key(3), "address": "10.8.0.5", "addressV6": "fd00:8::7",
                  "egress": [{ "cidr": "fd00:3::/126", "protocol": "icmp" }], "endpoint": "198.51.100.1:51820",
                  "presharedKey": key(102) },
            ]),
        ];
        for incremental in [false, true] {
            let mut kernel = Kernel(Actual::default().with_slot_limit(4));
            let mut old = DesiredState::default();
            for peers in &states {
                let new = one(peers.clone());
                let p = plan_either(incremental, &old, &new, &kernel)
                    .unwrap_or_else(|e| panic!("incremental {incremental}: {e}"));
                apply_plan_checked(&mut kernel, &old, &new, &p);
                assert_converged(&kernel, &new);
                old = new;
            }
        }
    }

    /// A plan that fails for want of a slot still revokes: its lead (the revoked peer's entry,
    /// its WireGuard peer, its policy) comes with the error, and applies.
    #[test]
    fn a_plan_without_room_still_revokes() {
        let rules = json!([{ "cidr": "10.0.0.0/8", "protocol": "tcp" }]);
        let before = one(json!([
            { "name": "a", "publicKey": key(1), "address": "10.8.0.2" },
            { "name": "r", "publicKey": key(2), "address": "10.8.0.3", "egress": rules },
        ]));
        // r goes, two come: three peers at two slots.
        let after = one(json!([
            { "name": "a", "publicKey": key(1), "address": "10.8.0.2" },
            { "name": "n", "publicKey": key(3), "address": "10.8.0.4" },
            { "name": "o", "publicKey": key(4), "address": "10.8.0.5" },
        ]));
        for incremental in [false, true] {
            let mut kernel = Kernel(Actual::default().with_slot_limit(2));
            converge(&mut kernel, &DesiredState::default(), &before);
            let planned = plan_either(incremental, &before, &after, &kernel);
            let Err(Unplanned { error, lead }) = planned else {
                panic!("incremental {incremental}: planned {planned:?}");
            };
            assert_eq!(error, PlanError::SlotsExhausted);
            for op in &lead.ops {
                kernel.apply(op);
                assert_safe_midway(&kernel, &before, &after);
            }
            let maps = kernel.0.maps();
            assert!(
                !maps.peers.contains_key(&IpAddr::from([10, 8, 0, 3])),
                "incremental {incremental}: r's entry stays: {lead:?}"
            );
            assert!(!kernel.0.wg().peers.contains_key(&WgKey([2; 32])));
            assert!(maps.policies.is_empty(), "r's policy stays: {lead:?}");
            assert!(maps.peers.contains_key(&IpAddr::from([10, 8, 0, 2])));
        }
    }

    /// Two peers' entries share a slot (changed behind the agent's back) at a full map: neither
    /// can keep it while the other uses it, so the lead deletes both entries, which frees the
    /// slot, and the plan converges with one slot each.
    #[test]
    fn a_shared_slot_at_a_full_map_rotates_through_the_lead() {
        let s = one(json!([
            { "name": "a", "publicKey": key(1), "address": "10.8.0.2" },
            { "name": "b", "publicKey": key(2), "address": "10.8.0.3" },
        ]));
        let mut kernel = Kernel(Actual::default().with_slot_limit(2));
        converge(&mut kernel, &DesiredState::default(), &s);
        let mut maps = kernel.0.maps().clone();
        for entry in maps.peers.values_mut() {
            entry.slot = 0;
        }
        kernel.0 = Actual::new(maps, kernel.0.wg().clone()).with_slot_limit(2);
        let p = plan(&s, &kernel.actual()).unwrap();
        for op in &p.ops {
            kernel.apply(op);
        }
        assert_converged(&kernel, &s);
        assert!(plan(&s, &kernel.actual()).is_ok_and(|p| p.is_empty()));
    }

    /// The settings entry is part of the plan, right after the lead: written only when it
    /// differs (never for the owner high-water mark alone); replies switched off forget every
    /// flow.
    #[test]
    fn settings_follow_the_lead_and_replies_off_forgets_every_flow() {
        let settings = crate::settings::DatapathSettings::default();
        let on = settings.config(true, 2);
        let off = settings.config(false, 2);
        let kernel = Config {
            owner_high: 7,
            ..on
        };
        assert!(plan_settings(&on, Some(&kernel)).is_empty());
        assert_eq!(
            plan_settings(&off, Some(&kernel)),
            [
                Op::PutSettings {
                    config: Config {
                        owner_high: 7,
                        ..off
                    },
                    replies_before: Some(true),
                },
                Op::ForgetAllFlows
            ]
        );
        assert_eq!(plan_settings(&on, None).len(), 1);
        let revoke = Plan {
            ops: vec![Op::DeletePeerEntry {
                addr: IpAddr::from([10, 8, 0, 2]),
            }],
        };
        let with = revoke.with_settings(plan_settings(&off, Some(&kernel)));
        assert!(matches!(
            with.ops.as_slice(),
            [
                Op::DeletePeerEntry { .. },
                Op::PutSettings { .. },
                Op::ForgetAllFlows
            ]
        ));
        assert_eq!((with.map_writes(), with.wg_changes()), (2, 0));
    }

    /// Holders are kept by tag only while no two of the device's keys share one; keys made to
    /// share their first 8 bytes make the index hold whole keys (read back, or joining), and
    /// every address keeps its holder.
    #[test]
    fn keys_that_share_their_first_bytes_are_held_whole() {
        let one = WgKey([1; 32]);
        let mut two = WgKey([1; 32]);
        two.0[31] = 2;
        let ip = |text: &str| -> IpNet { text.parse().unwrap() };
        let device = |keys: &[WgKey]| ActualWg {
            peers: keys
                .iter()
                .zip(["10.8.0.1/32", "10.8.0.2/32"])
                .map(|(key, net)| {
                    let mut peer = WgPeer::default();
                    peer.allowed_ips.insert(ip(net));
                    (*key, peer)
                })
                .collect(),
        };
        let single = Actual::new(ActualMaps::default(), device(&[one]));
        assert!(matches!(single.index.holders, Holders::Tags(_)));
        let read = Actual::new(ActualMaps::default(), device(&[one, two]));
        assert!(matches!(read.index.holders, Holders::Keys(_)));
        let mut joined = single.clone();
        joined.apply(&Op::WgPeer(WgPeerChange {
            key: two,
            peer: "two".into(),
            create: true,
            endpoint: None,
            preshared_key: None,
            persistent_keepalive: None,
            add_allowed_ips: vec![ip("10.8.0.2/32")],
        }));
        assert!(matches!(joined.index.holders, Holders::Keys(_)));
        for actual in [&read, &joined] {
            assert_eq!(actual.holder("10.8.0.1".parse().unwrap()), Some(one));
            assert_eq!(actual.holder("10.8.0.2".parse().unwrap()), Some(two));
            assert!(actual.routes(&ip("10.8.0.2/32"), &two));
            assert!(!actual.routes(&ip("10.8.0.2/32"), &one));
        }
    }
}
