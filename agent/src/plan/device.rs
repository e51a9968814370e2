//! The WireGuard device as read back: its peers ([`ActualWg`]), each with its allowed IPs,
//! endpoint, preshared key and keepalive.

use std::{collections::BTreeMap, fmt, net::SocketAddr};

use ipnet::IpNet;

use crate::state::WgKey;

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
    /// Boxed: few peers have one ([`crate::state::PeerSpec::preshared_key`]).
    pub preshared_key: Option<Box<WgKey>>,
    pub persistent_keepalive: Option<u16>,
}

/// The WireGuard device's peers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ActualWg {
    pub peers: BTreeMap<WgKey, WgPeer>,
}
