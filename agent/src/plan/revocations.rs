//! Steps 1 and 2, the revocations that lead every plan: the address entries no peer has any
//! more or that move to another WireGuard peer, then the WireGuard peers that leave. They only
//! take access away, so nothing that can fail for want of room comes before them.

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    net::IpAddr,
};

use ipnet::IpNet;

use super::{op::Op, planner::Planner};
use crate::state::WgKey;

impl<'a> Planner<'a> {
    /// Whether WireGuard routes `addr` to another peer than the one that gets it.
    pub(super) fn moves(&self, addr: &IpAddr) -> bool {
        let ip = IpNet::from(*addr);
        self.want_key.get(addr).is_some_and(|key| {
            self.actual.index.holders.contains_key(&ip) && !self.actual.routes(&ip, key)
        })
    }

    /// Step 1's address entries: addresses no peer has any more, and addresses WireGuard still
    /// routes to another peer than the one that gets them (they move: the old holder must not
    /// run with the new holder's entry).
    pub(super) fn lead_deletions(&self) -> BTreeSet<IpAddr> {
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

    /// Steps 1 and 2: the address entries the lead deletes, then the WireGuard peers that
    /// leave; with the change of each policy id's references they make.
    pub(super) fn revocations(&self) -> (Vec<Op>, BTreeMap<u32, i64>) {
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
}
