//! The datapath maps' contents as the agent holds them ([`ActualMaps`]): read back from the
//! kernel, or compiled from a state by the planner's own operations. What the planner compares
//! with the desired state, and what the evaluator ([`crate::verdict`]) decides packets on.

use std::{collections::BTreeMap, net::IpAddr, sync::Arc};

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
        Self {
            peers: peers.into_iter().collect(),
            policies: grouped
                .into_iter()
                .map(|(id, entries)| (id, Arc::new(CompiledPolicy::from_entries(entries))))
                .collect(),
            owner_high: 0,
            wall_minus_boot_ns: 0,
        }
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
