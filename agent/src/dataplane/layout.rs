//! The layout each pinned map must have. aya reuses a pinned map without comparing it to the
//! object's definition, so the loader checks every map (adopted or new) against this table
//! before the program is attached.

use std::mem::size_of;

use aya::maps::{MapInfo, MapType};
use wgfence_common::{
    map_names, Config, EventBucket, FlowKeyV4, FlowKeyV6, FlowValue, PeerCounters, PeerEntry,
    PeerKeyV4, PeerKeyV6, PolicyValue, RuleCounters, RuleSeen, COUNTERS_LEN, EVENTS_BYTES,
    MAX_FLOWS, MAX_PEERS, MAX_POLICIES, MAX_POLICY_ENTRIES, MAX_RULES,
};

use super::error::{DataplaneError, Result};

/// `BPF_F_NO_PREALLOC`: required by LPM tries.
const NO_PREALLOC: u32 = 1;
/// Size of the prefix length that heads every LPM trie key.
const LPM_PREFIX_LEN: usize = size_of::<u32>();

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Layout {
    pub map_type: MapType,
    pub key_size: usize,
    pub value_size: usize,
    pub max_entries: u32,
    pub flags: u32,
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "type {:?}, key {} B, value {} B, {} entries, flags {:#x}",
            self.map_type, self.key_size, self.value_size, self.max_entries, self.flags
        )
    }
}

pub(crate) fn expected(name: &str) -> Option<Layout> {
    Some(match name {
        map_names::PEERS_V4 => Layout::of::<PeerKeyV4, PeerEntry>(MapType::Hash, MAX_PEERS),
        map_names::PEERS_V6 => Layout::of::<PeerKeyV6, PeerEntry>(MapType::Hash, MAX_PEERS),
        // User space sees an inner map's id (and writes its descriptor).
        map_names::POLICY_V4 | map_names::POLICY_V6 => {
            Layout::of::<u32, u32>(MapType::ArrayOfMaps, MAX_POLICIES)
        }
        map_names::STATS => Layout::of::<u32, u64>(MapType::PerCpuArray, COUNTERS_LEN),
        map_names::PEER_STATS => Layout::of::<u32, PeerCounters>(MapType::PerCpuArray, MAX_PEERS),
        map_names::FLOWS_V4 => Layout::of::<FlowKeyV4, FlowValue>(MapType::Hash, MAX_FLOWS),
        map_names::FLOWS_V6 => Layout::of::<FlowKeyV6, FlowValue>(MapType::Hash, MAX_FLOWS),
        map_names::FLOW_MADE | map_names::FLOW_FREED => {
            Layout::of::<u32, u64>(MapType::Array, MAX_PEERS)
        }
        map_names::CONFIG => Layout::of::<u32, Config>(MapType::Array, 1),
        map_names::EVENTS => Layout {
            map_type: MapType::RingBuf,
            key_size: 0,
            value_size: 0,
            max_entries: EVENTS_BYTES,
            flags: 0,
        },
        map_names::EVENT_BUCKET => Layout::of::<u32, EventBucket>(MapType::PerCpuArray, 1),
        map_names::RULE_STATS => Layout::of::<u32, RuleCounters>(MapType::PerCpuArray, MAX_RULES),
        map_names::RULE_SEEN => Layout::of::<u32, RuleSeen>(MapType::Array, MAX_RULES),
        _ => return None,
    })
}

/// The layout of every policy trie with key data `K` (the inner maps of the policy maps).
pub(crate) fn inner_trie<K>() -> Layout {
    Layout::trie::<K>()
}

impl Layout {
    /// A map of `map_type` with keys `K`, values `V` and `max_entries`, without flags.
    fn of<K, V>(map_type: MapType, max_entries: u32) -> Self {
        Self {
            map_type,
            key_size: size_of::<K>(),
            value_size: size_of::<V>(),
            max_entries,
            flags: 0,
        }
    }

    /// A policy trie with keys `K` (after the prefix length).
    fn trie<K>() -> Self {
        Self {
            map_type: MapType::LpmTrie,
            key_size: LPM_PREFIX_LEN + size_of::<K>(),
            value_size: size_of::<PolicyValue>(),
            max_entries: MAX_POLICY_ENTRIES,
            flags: NO_PREALLOC,
        }
    }
}

/// Compares a live map with the layout this agent was built for.
pub(crate) fn check(name: &'static str, info: &MapInfo) -> Result<()> {
    let expected = expected(name).ok_or(DataplaneError::MissingMap(name))?;
    let map_type = info
        .map_type()
        .map_err(|source| DataplaneError::Map { map: name, source })?;
    let found = Layout {
        map_type,
        key_size: info.key_size() as usize,
        value_size: info.value_size() as usize,
        max_entries: info.max_entries(),
        flags: info.map_flags(),
    };
    if found == expected {
        Ok(())
    } else {
        Err(DataplaneError::LayoutMismatch {
            map: name,
            expected: expected.to_string(),
            found: found.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use wgfence_common::{PolicyKeyV4, PolicyKeyV6};

    use super::*;

    #[test]
    fn every_map_has_a_layout() {
        for name in map_names::ALL {
            assert!(expected(name).is_some(), "{name} has no expected layout");
        }
        assert!(expected("wgf1_peers_v4").is_none());
        assert!(expected("wgf2_peers_v4").is_none());
        assert!(expected("wgf3_peers_v4").is_none());
    }

    #[test]
    fn lpm_keys_are_prefix_length_plus_data() {
        assert_eq!(inner_trie::<PolicyKeyV4>().key_size, 8);
        assert_eq!(inner_trie::<PolicyKeyV6>().key_size, 20);
    }
}
