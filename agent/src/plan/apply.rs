//! What an operation does to the kernel ([`Actual::apply`]): the agent's view of the kernel is
//! kept current with it between full reads, and the tests use it as the model of the kernel.

use std::{net::IpAddr, sync::Arc};

use ipnet::IpNet;
use wgfence_common::{Allow, PeerEntry};

use super::{
    actual::Actual,
    index::{key_tag, tagged},
    op::{Op, WgPeerChange},
};
use crate::state::WgKey;

impl Actual {
    /// What `op` does to the kernel. The agent keeps its view of the kernel current with this
    /// between full reads (which are O(peers)); the tests use it as the model of the kernel.
    pub fn apply(&mut self, op: &Op) {
        match op {
            Op::PutPolicyEntry {
                policy,
                prefix,
                allows,
            } => self.put_policy_entry(*policy, *prefix, allows),
            Op::ResetPeerCounters { .. }
            | Op::ResetRuleCounters { .. }
            | Op::PutSettings { .. }
            | Op::ForgetFlows { .. }
            | Op::ForgetAllFlows => {}
            Op::RaiseOwnerHigh { owner } => {
                self.maps.owner_high = self.maps.owner_high.max(*owner);
                self.index.owner_high = self.index.owner_high.max(*owner);
            }
            Op::PutPeerEntry { addr, entry, .. } => self.put_peer_entry(*addr, entry),
            Op::DeletePeerEntry { addr } => {
                if let Some(old) = self.maps.peers.remove(addr) {
                    self.count_entry(old, false);
                }
            }
            Op::WgPeer(change) => self.change_wg_peer(change),
            Op::RemoveWgPeer { key } => self.remove_wg_peer(key),
            Op::DeletePolicyEntry { policy, prefix } => self.delete_policy_entry(*policy, prefix),
        }
    }

    fn put_policy_entry(&mut self, policy: u32, prefix: IpNet, allows: &[Allow]) {
        self.unindex_content(policy);
        let content = self.maps.policies.entry(policy).or_default();
        Arc::make_mut(content).insert_entry(prefix, allows.to_vec());
        self.index.set_rule_len(policy, content.counted_rules());
        self.index_content(policy);
        self.sync_id(policy);
    }

    fn put_peer_entry(&mut self, addr: IpAddr, entry: &PeerEntry) {
        if let Some(old) = self.maps.peers.insert(addr, *entry) {
            self.count_entry(old, false);
        }
        self.count_entry(*entry, true);
        self.index.owner_high = self.index.owner_high.max(entry.owner);
    }

    fn change_wg_peer(&mut self, change: &WgPeerChange) {
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

    fn remove_wg_peer(&mut self, key: &WgKey) {
        if let Some(peer) = self.wg.peers.remove(key) {
            for ip in peer.allowed_ips {
                self.index.holders.remove_if(&ip, key);
            }
        }
    }

    fn delete_policy_entry(&mut self, policy: u32, prefix: &IpNet) {
        self.unindex_content(policy);
        // A shared policy is copied only when the entry is there to delete.
        if let Some(content) = self
            .maps
            .policies
            .get_mut(&policy)
            .filter(|c| c.has_entry(prefix))
        {
            Arc::make_mut(content).remove_entry(prefix);
            self.index.set_rule_len(policy, content.counted_rules());
            if content.is_empty() {
                self.maps.policies.remove(&policy);
            }
        }
        self.index_content(policy);
        self.sync_id(policy);
    }
}
