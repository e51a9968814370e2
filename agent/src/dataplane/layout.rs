//! The layout each pinned map must have. aya reuses a pinned map without comparing it to the
//! object's definition, so the loader checks every map (adopted or new) against this table
//! before the program is attached.

use std::mem::size_of;

use aya::maps::{MapInfo, MapType};
use wgfence_common::{
    map_names, Config, EventBucket, FlowKeyV4, FlowKeyV6, FlowValue, PeerCounters, PeerEntry,
    PeerKeyV4, PeerKeyV6, PolicyKeyV4, PolicyKeyV6, PolicyValue, RuleCounters, RuleSeen,
    COUNTERS_LEN, EVENTS_BYTES, MAX_FLOWS, MAX_PEERS, MAX_POLICY_ENTRIES, MAX_RULES,
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
    let layout = |map_type, key_size, value_size, max_entries, flags| Layout {
        map_type,
        key_size,
        value_size,
        max_entries,
        flags,
    };
    Some(match name {
        map_names::PEERS_V4 => layout(
            MapType::Hash,
            size_of::<PeerKeyV4>(),
            size_of::<PeerEntry>(),
            MAX_PEERS,
            0,
        ),
        map_names::PEERS_V6 => layout(
            MapType::Hash,
            size_of::<PeerKeyV6>(),
            size_of::<PeerEntry>(),
            MAX_PEERS,
            0,
        ),
        map_names::POLICY_V4 => layout(
            MapType::LpmTrie,
            LPM_PREFIX_LEN + size_of::<PolicyKeyV4>(),
            size_of::<PolicyValue>(),
            MAX_POLICY_ENTRIES,
            NO_PREALLOC,
        ),
        map_names::POLICY_V6 => layout(
            MapType::LpmTrie,
            LPM_PREFIX_LEN + size_of::<PolicyKeyV6>(),
            size_of::<PolicyValue>(),
            MAX_POLICY_ENTRIES,
            NO_PREALLOC,
        ),
        map_names::STATS => layout(
            MapType::PerCpuArray,
            size_of::<u32>(),
            size_of::<u64>(),
            COUNTERS_LEN,
            0,
        ),
        map_names::PEER_STATS => layout(
            MapType::PerCpuArray,
            size_of::<u32>(),
            size_of::<PeerCounters>(),
            MAX_PEERS,
            0,
        ),
        map_names::FLOWS_V4 => layout(
            MapType::Hash,
            size_of::<FlowKeyV4>(),
            size_of::<FlowValue>(),
            MAX_FLOWS,
            0,
        ),
        map_names::FLOWS_V6 => layout(
            MapType::Hash,
            size_of::<FlowKeyV6>(),
            size_of::<FlowValue>(),
            MAX_FLOWS,
            0,
        ),
        map_names::FLOW_MADE | map_names::FLOW_FREED => layout(
            MapType::Array,
            size_of::<u32>(),
            size_of::<u64>(),
            MAX_PEERS,
            0,
        ),
        map_names::CONFIG => layout(MapType::Array, size_of::<u32>(), size_of::<Config>(), 1, 0),
        map_names::EVENTS => layout(MapType::RingBuf, 0, 0, EVENTS_BYTES, 0),
        map_names::EVENT_BUCKET => layout(
            MapType::PerCpuArray,
            size_of::<u32>(),
            size_of::<EventBucket>(),
            1,
            0,
        ),
        map_names::RULE_STATS => layout(
            MapType::PerCpuArray,
            size_of::<u32>(),
            size_of::<RuleCounters>(),
            MAX_RULES,
            0,
        ),
        map_names::RULE_SEEN => layout(
            MapType::Array,
            size_of::<u32>(),
            size_of::<RuleSeen>(),
            MAX_RULES,
            0,
        ),
        _ => return None,
    })
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
    use super::*;

    #[test]
    fn every_map_has_a_layout() {
        for name in map_names::ALL {
            assert!(expected(name).is_some(), "{name} has no expected layout");
        }
        assert!(expected("wgf1_peers_v4").is_none());
        assert!(expected("wgf2_peers_v4").is_none());
    }

    #[test]
    fn lpm_keys_are_prefix_length_plus_data() {
        let v4 = expected(map_names::POLICY_V4).map(|l| l.key_size);
        let v6 = expected(map_names::POLICY_V6).map(|l| l.key_size);
        assert_eq!(v4, Some(12));
        assert_eq!(v6, Some(24));
    }
}
