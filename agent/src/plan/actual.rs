//! The kernel as the planner sees it ([`Actual`]): the datapath maps and the WireGuard device
//! as read back ([`ActualMaps`], [`ActualWg`]), with the indexes that let a change be planned
//! in time proportional to the change ([`super::index`]).

use std::{collections::HashSet, net::IpAddr, sync::Arc};

use ipnet::IpNet;
use wgfence_common::{PeerEntry, MAX_PEERS, NO_RULES, UNRESTRICTED};

use super::{
    device::ActualWg,
    index::{
        content_hash, content_of, count_down, count_up, key_tag, tagged, ByFamily, Holders, Index,
    },
};
use crate::{
    actual_maps::ActualMaps,
    policy::{CompiledPolicy, NOTHING},
    state::WgKey,
};

/// Everything the planner compares with the desired state, with the indexes that let it plan
/// a change in time proportional to the change (not to the number of peers).
#[derive(Debug, Clone, Default)]
pub struct Actual {
    pub(super) maps: ActualMaps,
    pub(super) wg: ActualWg,
    pub(super) index: Index,
    /// Counter slots the maps hold (`None`: [`MAX_PEERS`]); smaller in the tests and the
    /// fuzzer, so that they reach a full map.
    slot_limit: Option<u32>,
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
        // O(#policies log #policies), rather than kept current entry by entry. The indexes
        // with an entry per peer are built from sorted runs (full B-tree nodes: about half the
        // memory of one insert at a time).
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
            let len = content.counted_rules();
            if len > 0 {
                index.rule_lens.insert(*id, len);
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
    pub(super) fn holder_of(&self, ip: &IpNet) -> Option<WgKey> {
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
    pub(super) fn routes_to_peer(&self, ip: &IpNet, key: &WgKey) -> bool {
        match &self.index.holders {
            Holders::Keys(keys) => keys.get(ip) == Some(*key),
            Holders::Tags(tags) => tags.get(ip) == Some(key_tag(key)),
        }
    }

    /// Holders kept as whole keys from now on: a key that shares its tag with another is
    /// about to join the device. Each tag is resolved while it still names one key.
    pub(super) fn hold_by_keys(&mut self) {
        if let Holders::Tags(tags) = &self.index.holders {
            let keys =
                ByFamily::from_sorted(tags.iter().filter_map(|(ip, tag)| {
                    tagged(&self.wg, tag).next().map(|(key, _)| (ip, *key))
                }));
            self.index.holders = Holders::Keys(keys);
        }
    }

    /// Whether WireGuard routes `ip` to `key`.
    pub(super) fn routes(&self, ip: &IpNet, key: &WgKey) -> bool {
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

    pub(super) fn unindex_content(&mut self, id: u32) {
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

    pub(super) fn index_content(&mut self, id: u32) {
        if let Some(content) = content_of(&self.maps, &self.index.policy_refs, id) {
            self.index.index_content(content, id);
        }
    }

    /// The ids whose content is `content`, in increasing order.
    pub(super) fn ids_of<'s>(
        &'s self,
        content: &'s CompiledPolicy,
    ) -> impl Iterator<Item = u32> + 's {
        self.index
            .by_content
            .get(&content_hash(content))
            .into_iter()
            .flatten()
            .copied()
            .filter(move |id| content_of(&self.maps, &self.index.policy_refs, *id) == Some(content))
    }

    /// Holds the accepted state's copy of each of `policies` wherever the kernel holds a policy
    /// of the same content, in place of a copy of its own (read back from the kernel, or
    /// built entry by entry as the plan wrote it): with a policy per peer, each is then held
    /// once. What the view holds is unchanged, only where. O(entries of `policies`). The
    /// copies it held instead are returned, for the caller to free where it frees the rest.
    #[must_use = "the copies replaced, to be freed (and the heap trimmed) off the apply path"]
    pub fn share<'a>(
        &mut self,
        policies: impl IntoIterator<Item = &'a Arc<CompiledPolicy>>,
    ) -> Vec<Arc<CompiledPolicy>> {
        let mut replaced = Vec::new();
        let mut seen: HashSet<*const CompiledPolicy> = HashSet::new();
        for policy in policies {
            if !seen.insert(Arc::as_ptr(policy)) {
                continue;
            }
            let ids: smallvec::SmallVec<[u32; 2]> = self.ids_of(policy).collect();
            for id in ids {
                if let Some(held) = self.maps.policies.get_mut(&id) {
                    if !Arc::ptr_eq(held, policy) {
                        replaced.push(std::mem::replace(held, Arc::clone(policy)));
                    }
                }
            }
        }
        replaced
    }

    /// Counts a peer entry's references; an id without trie entries holds [`NOTHING`] while
    /// referenced.
    pub(super) fn count_entry(&mut self, entry: PeerEntry, up: bool) {
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
    pub(super) fn sync_id(&mut self, id: u32) {
        if self.maps.policies.contains_key(&id) || self.index.policy_refs.contains_key(&id) {
            self.index.free_ids.take(id);
        } else {
            self.index.free_ids.give(id);
        }
    }
}
