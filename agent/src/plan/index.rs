//! The indexes [`Actual`] keeps beside the maps and the device, derived from them and kept
//! current op by op: references per policy id, counter slot and rule block, the free slots,
//! policy ids by content (content addressing), and the WireGuard holder of each allowed IP.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use wgfence_common::{PeerEntry, NO_RULES, UNRESTRICTED};

use super::{
    device::{ActualWg, WgPeer},
    free_ids::FreeIds,
    rule_space,
};
use crate::{
    actual_maps::ActualMaps,
    policy::{CompiledPolicy, NOTHING},
    state::WgKey,
};

/// Derived from `maps` and `wg`; kept current by [`Actual::apply`].
#[derive(Debug, Clone, Default)]
pub(super) struct Index {
    /// Peer entries per policy id.
    pub(super) policy_refs: BTreeMap<u32, usize>,
    /// Peer entries per counter slot.
    pub(super) slot_refs: BTreeMap<u32, usize>,
    /// The slots below `slot_high` that no entry uses: with `slot_high`, the complement of
    /// `slot_refs`, kept so that a new peer's slot costs O(log N), not a copy of every used one.
    pub(super) free_slots: BTreeSet<u32>,
    /// One past the highest slot an entry has used.
    pub(super) slot_high: u32,
    /// The policy ids that are free: neither a trie entry nor a peer entry uses them.
    pub(super) free_ids: FreeIds,
    /// Peer entries per (policy id, rule counter base), for entries that count their rules:
    /// a policy's block is its lowest base ([`rule_blocks`]).
    pub(super) rule_refs: BTreeMap<(u32, u32), usize>,
    /// The rules each policy's trie entries count for ([`CompiledPolicy::counted_rules`]),
    /// where that is not 0: how long its block is, found without a pass over its entries.
    /// Set again after each write to the policy's entries, from the view's content (a pass
    /// as long as the content hash taken then): one number a policy, where a count per
    /// (policy, end) was 8.7 MiB of the agent's memory with a policy per peer at 60k.
    pub(super) rule_lens: BTreeMap<u32, u32>,
    /// The rule counters the blocks of `rule_refs` and `rule_lens` use, kept current with
    /// them: a new block is placed in O(log positions), not after a pass over every policy.
    pub(super) rule_space: rule_space::RuleSpace,
    /// Policy ids by their (complete or partial) content; an id that peer entries point at
    /// and the tries have no entry for holds [`NOTHING`] (`"egress": []`).
    ///
    /// Keyed by a hash of the content, ids in increasing order, the content itself compared
    /// with the maps' on lookup ([`Actual::ids_of`]): no second copy of every policy.
    pub(super) by_content: HashMap<u64, smallvec::SmallVec<[u32; 2]>>,
    /// The WireGuard peer each allowed IP is routed to ([`Holders`]).
    pub(super) holders: Holders,
    /// The highest owner handed out: the kernel's high-water mark, or a higher entry's owner.
    pub(super) owner_high: u64,
}

/// The WireGuard peer each allowed IP is routed to, in a map per family (an `IpNet` takes 18
/// bytes for either). While no two of the device's keys share their first 8 bytes (random
/// keys never do), a holder is kept as those 8 bytes ([`key_tag`]): 13 bytes an IPv4 address
/// and 25 an IPv6 one, where an `IpNet` and the whole key made 50 (4.5 MiB at 60,000 peers
/// with both families). Once two keys share them (keys chosen to), as the whole key. Either
/// way an answer looks at one key, never at a run of keys an author of the state file could
/// make long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Holders {
    Tags(ByFamily<u64>),
    Keys(ByFamily<WgKey>),
}

impl Default for Holders {
    fn default() -> Self {
        Holders::Tags(ByFamily::default())
    }
}

impl Holders {
    pub(super) fn contains_key(&self, ip: &IpNet) -> bool {
        match self {
            Holders::Tags(tags) => tags.get(ip).is_some(),
            Holders::Keys(keys) => keys.get(ip).is_some(),
        }
    }

    /// Records `key` as the holder of `ip`.
    pub(super) fn insert(&mut self, ip: IpNet, key: &WgKey) {
        match self {
            Holders::Tags(tags) => tags.insert(ip, key_tag(key)),
            Holders::Keys(keys) => keys.insert(ip, *key),
        }
    }

    /// Forgets `ip` if `key` holds it.
    pub(super) fn remove_if(&mut self, ip: &IpNet, key: &WgKey) {
        match self {
            Holders::Tags(tags) => tags.remove_if(ip, key_tag(key)),
            Holders::Keys(keys) => keys.remove_if(ip, *key),
        }
    }
}

/// A map from allowed IPs, one per family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ByFamily<V> {
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
    pub(super) fn from_sorted(pairs: impl Iterator<Item = (IpNet, V)>) -> Self {
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

    pub(super) fn get(&self, ip: &IpNet) -> Option<V> {
        match ip {
            IpNet::V4(net) => self.v4.get(net).copied(),
            IpNet::V6(net) => self.v6.get(net).copied(),
        }
    }

    pub(super) fn insert(&mut self, ip: IpNet, value: V) {
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
    pub(super) fn remove_if(&mut self, ip: &IpNet, value: V) {
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

    pub(super) fn iter(&self) -> impl Iterator<Item = (IpNet, V)> + '_ {
        let v4 = self.v4.iter().map(|(net, v)| (IpNet::V4(*net), *v));
        let v6 = self.v6.iter().map(|(net, v)| (IpNet::V6(*net), *v));
        v4.chain(v6)
    }
}

/// What [`Index::holders`] records of a key: its first 8 bytes, in the keys' order.
pub(super) fn key_tag(key: &WgKey) -> u64 {
    let mut tag = [0; 8];
    tag.copy_from_slice(&key.0[..8]);
    u64::from_be_bytes(tag)
}

/// The device's peers whose key has `tag`: a run of its keys (a tag is a prefix).
pub(super) fn tagged(wg: &ActualWg, tag: u64) -> impl Iterator<Item = (&WgKey, &WgPeer)> {
    let (mut low, mut high) = ([0; 32], [0xff; 32]);
    low[..8].copy_from_slice(&tag.to_be_bytes());
    high[..8].copy_from_slice(&tag.to_be_bytes());
    wg.peers.range(WgKey(low)..=WgKey(high))
}

/// The key of a policy's content in [`Index::by_content`].
pub(super) fn content_hash(content: &CompiledPolicy) -> u64 {
    use std::hash::{Hash as _, Hasher as _};
    let mut hasher = std::hash::DefaultHasher::new();
    content.hash(&mut hasher);
    hasher.finish()
}

impl Index {
    /// Notes that `id` holds `content`.
    pub(super) fn index_content(&mut self, content: &CompiledPolicy, id: u32) {
        let ids = self.by_content.entry(content_hash(content)).or_default();
        if let Err(at) = ids.binary_search(&id) {
            ids.insert(at, id);
        }
    }

    pub(super) fn rule_up(&mut self, entry: &PeerEntry) {
        if entry.rules != NO_RULES {
            let before = self.rule_block(entry.policy);
            count_up(&mut self.rule_refs, (entry.policy, entry.rules));
            self.rule_block_moved(entry.policy, before);
        }
    }

    pub(super) fn rule_down(&mut self, entry: &PeerEntry) {
        let key = (entry.policy, entry.rules);
        if self.rule_refs.contains_key(&key) {
            let before = self.rule_block(entry.policy);
            count_down(&mut self.rule_refs, key);
            self.rule_block_moved(entry.policy, before);
        }
    }

    /// Notes that policy `id`'s trie entries now count for `len` rules
    /// ([`CompiledPolicy::counted_rules`] of its content after a write).
    pub(super) fn set_rule_len(&mut self, id: u32, len: u32) {
        if self.rule_len(id) == len {
            return;
        }
        let before = self.rule_block(id);
        if len == 0 {
            self.rule_lens.remove(&id);
        } else {
            self.rule_lens.insert(id, len);
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
    pub(super) fn rule_len(&self, id: u32) -> u32 {
        self.rule_lens.get(&id).copied().unwrap_or(0)
    }

    /// The rule counter block the entries of policy `id` carry (their lowest base), if any.
    pub(super) fn rule_base(&self, id: u32) -> Option<u32> {
        self.rule_refs
            .range((id, 0)..=(id, u32::MAX))
            .next()
            .map(|((_, base), _)| *base)
    }

    /// Every block in use, as (base, length): each policy's lowest base, as long as its
    /// entries' counted rules (at least 1). O(#policies log #policies), for a kernel just read.
    pub(super) fn rule_blocks_in_use(&self) -> Vec<(u32, u32)> {
        let mut blocks = Vec::new();
        let mut last = None;
        for &(id, base) in self.rule_refs.keys() {
            if last != Some(id) {
                last = Some(id);
                blocks.push((base, self.rule_len(id).max(1)));
            }
        }
        blocks
    }

    pub(super) fn slot_up(&mut self, slot: u32) {
        count_up(&mut self.slot_refs, slot);
        if slot >= self.slot_high {
            self.free_slots.extend(self.slot_high..slot);
            self.slot_high = slot.saturating_add(1);
        } else {
            self.free_slots.remove(&slot);
        }
    }

    pub(super) fn slot_down(&mut self, slot: u32) {
        count_down(&mut self.slot_refs, slot);
        if !self.slot_refs.contains_key(&slot) && slot < self.slot_high {
            self.free_slots.insert(slot);
        }
    }
}

pub(super) fn count_up<K: Ord>(map: &mut BTreeMap<K, usize>, key: K) {
    *map.entry(key).or_insert(0) += 1;
}

pub(super) fn count_down<K: Ord>(map: &mut BTreeMap<K, usize>, key: K) {
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
pub(super) fn content_of<'a>(
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
