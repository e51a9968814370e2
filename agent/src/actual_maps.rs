//! The datapath maps' contents as the agent holds them ([`ActualMaps`]): read back from the
//! kernel, or compiled from a state by the planner's own operations. What the planner compares
//! with the desired state, and what the evaluator ([`crate::verdict`]) decides packets on.

use std::{collections::BTreeMap, net::IpAddr, ops::Range, sync::Arc};

use ipnet::IpNet;
use wgfence_common::{Allow, PeerEntry};

use crate::policy::CompiledPolicy;

/// The datapath maps as read back from the kernel.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ActualMaps {
    pub peers: BTreeMap<IpAddr, PeerEntry>,
    /// Trie entries grouped by policy id. Shared: the agent's view holds the accepted state's
    /// own copy of a policy the kernel holds as compiled ([`crate::plan::Actual::share`]), so
    /// a policy per peer is held once, not twice; a write to a shared one copies it first.
    pub policies: BTreeMap<u32, Arc<CompiledPolicy>>,
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
        let policies = grouped
            .into_iter()
            .map(|(id, entries)| (id, CompiledPolicy::from_entries(entries)));
        Self::from_policies(peers, policies)
    }

    /// The maps from their peer entries and their policies by id.
    pub fn from_policies(
        peers: impl IntoIterator<Item = (IpAddr, PeerEntry)>,
        policies: impl IntoIterator<Item = (u32, CompiledPolicy)>,
    ) -> Self {
        Self {
            peers: peers.into_iter().collect(),
            policies: policies
                .into_iter()
                .map(|(id, policy)| (id, Arc::new(policy)))
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

/// Trie entries as a read of the kernel's tries hands them over (in the tries' own order),
/// gathered into policies: one array of allows and one of (policy, prefix, where its allows
/// are), so no map value and no heap block an entry is held on the way.
#[derive(Debug, Default)]
pub struct TrieEntries {
    allows: Vec<Allow>,
    entries: Vec<(u32, IpNet, Range<usize>)>,
}

impl TrieEntries {
    pub fn push(&mut self, policy: u32, prefix: IpNet, allows: &[Allow]) {
        let start = self.allows.len();
        self.allows.extend_from_slice(allows);
        self.entries
            .push((policy, prefix, start..self.allows.len()));
    }

    /// The policies by id, in order. A trie holds one entry a (policy, prefix).
    pub fn into_policies(mut self) -> Vec<(u32, CompiledPolicy)> {
        self.entries
            .sort_unstable_by_key(|(policy, prefix, _)| (*policy, *prefix));
        self.entries
            .chunk_by(|a, b| a.0 == b.0)
            .filter_map(|run| {
                let id = run.first()?.0;
                let entries = run
                    .iter()
                    .map(|(_, prefix, at)| (*prefix, &self.allows[at.clone()]));
                Some((id, CompiledPolicy::from_sorted_entries(entries)))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use wgfence_common::PROTO_TCP;

    use super::*;

    /// Entries read in the tries' order (not sorted, policies interleaved, both families) make
    /// the policies that grouping them one by one makes.
    #[test]
    fn trie_entries_read_in_any_order_make_the_same_policies() {
        let net = |s: &str| -> IpNet { s.parse().unwrap() };
        let allow = |lo| vec![Allow::new(PROTO_TCP, lo, lo + 1)];
        let read = [
            (7, net("10.2.0.0/16"), allow(2)),
            (3, net("fd00::/8"), vec![]),
            (7, net("10.0.0.0/8"), allow(1)),
            (3, net("10.1.0.0/16"), [allow(5), allow(6)].concat()),
            (7, net("10.2.3.0/24"), allow(3)),
            (3, net("0.0.0.0/0"), allow(4)),
        ];
        let mut entries = TrieEntries::default();
        for (policy, prefix, allows) in &read {
            entries.push(*policy, *prefix, allows);
        }
        let streamed = ActualMaps::from_policies([], entries.into_policies());
        assert_eq!(streamed, ActualMaps::from_entries([], read));
        assert_eq!(streamed.policies[&7].len(), 3);
    }
}
