//! Step 6: creating and updating WireGuard peers, per peer: new peers, endpoints, keys,
//! keepalives, and allowed IPs added without ever clearing a live peer's list.

use ipnet::IpNet;

use super::{
    device::WgPeer,
    op::{Op, WgPeerChange},
    planner::Planner,
};
use crate::state::PeerSpec;

impl<'a> Planner<'a> {
    /// Step 6: per-peer WireGuard changes only.
    pub(super) fn wg_changes(&self) -> Vec<Op> {
        self.touched
            .iter()
            .filter_map(|peer| wg_change(peer, self.actual.wg.peers.get(&peer.public_key)))
            .map(Op::WgPeer)
            .collect()
    }
}

/// The change that makes WireGuard's peer `have` (if the device has it) what `peer` asks.
pub(super) fn wg_change(peer: &PeerSpec, have: Option<&WgPeer>) -> Option<WgPeerChange> {
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
