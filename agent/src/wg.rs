//! The WireGuard side: read a device's peers and apply per-peer changes, through the kernel's
//! netlink interface or a userspace implementation's UAPI socket (wireguard-go), whichever
//! runs the interface.
//!
//! Updates to a userspace implementation go over one UAPI stream that stays open (connected at
//! the first update, connected again if the implementation closed it), not a connection per
//! update. The kernel's netlink interface is still reached through wireguard-control, which
//! opens a socket per update.
//!
//! wgfence manages the peers of an interface that already exists: its private key and listen
//! port are the operator's. It never sends `replace_peers`, never replaces a live peer's allowed
//! IPs, and never creates an interface (wireguard-control's userspace backend would start
//! wireguard-go for a missing socket; that is refused here).

use std::{
    fmt::Write as _,
    io::{self, BufRead, BufReader, Write as _},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::Duration,
};

use ipnet::IpNet;
use wireguard_control::{Backend, Device, DeviceUpdate, InterfaceName, Key, PeerConfigBuilder};

use crate::{
    plan::{ActualWg, AllowedIps, WgPeer, WgPeerChange},
    state::WgKey,
};

/// wireguard-go's `device.MaxPeers`.
pub const WIREGUARD_GO_MAX_PEERS: usize = 1 << 16;

/// How long an update waits for the userspace implementation's answer.
const UAPI_TIMEOUT: Duration = Duration::from_secs(30);

/// The most peers one update creates and sends a handshake initiation to at once
/// ([`kicked`]); an update creating more (a first start on an empty device) sends none.
pub const MAX_HANDSHAKE_KICKS: usize = 256;

/// The keepalive interval switched on (and off again in the same update) to make the device
/// send a created peer a handshake initiation at once.
const KICK_KEEPALIVE: u16 = 25;

/// Where userspace implementations put their UAPI sockets.
const UAPI_DIRS: [&str; 2] = ["/var/run/wireguard", "/run/wireguard"];

#[derive(Debug, thiserror::Error)]
pub enum WgError {
    #[error("{interface:?} is not a valid interface name")]
    InvalidName { interface: String },
    #[error("WireGuard interface {interface} ({backend})")]
    Io {
        interface: String,
        backend: &'static str,
        #[source]
        source: io::Error,
    },
    #[error(
        "WireGuard interface {interface} has no UAPI socket any more; wgfence does not create interfaces"
    )]
    Gone { interface: String },
    #[error("WireGuard interface {interface} reports an allowed IP with an invalid prefix length")]
    InvalidAllowedIp { interface: String },
    #[error("WireGuard interface {interface} refused the update (UAPI errno {errno})")]
    Refused { interface: String, errno: i64 },
}

/// A WireGuard interface and the backend that drives it.
#[derive(Debug)]
pub struct WireGuard {
    interface: String,
    name: InterfaceName,
    backend: Backend,
    /// Per-peer changes applied (creates, updates, removals).
    peer_updates: u64,
    /// The open UAPI stream of a userspace implementation, once an update connected it.
    uapi: Option<BufReader<UnixStream>>,
}

impl WireGuard {
    /// Opens an interface: userspace if a UAPI socket exists for it, else the kernel.
    pub fn open(interface: &str) -> Result<Self, WgError> {
        let name: InterfaceName = interface.parse().map_err(|_| WgError::InvalidName {
            interface: interface.to_owned(),
        })?;
        let backend = if uapi_socket(interface).is_some() {
            Backend::Userspace
        } else {
            Backend::Kernel
        };
        Ok(Self {
            interface: interface.to_owned(),
            name,
            backend,
            peer_updates: 0,
            uapi: None,
        })
    }

    pub fn backend_name(&self) -> &'static str {
        match self.backend {
            Backend::Userspace => "userspace",
            _ => "kernel",
        }
    }

    /// How many peers the device can hold, where that is less than the maps: wireguard-go's
    /// `MaxPeers` is 65,536 (the kernel's limit is far above the maps').
    pub fn max_peers(&self) -> Option<usize> {
        (self.backend == Backend::Userspace).then_some(WIREGUARD_GO_MAX_PEERS)
    }

    pub fn peer_updates(&self) -> u64 {
        self.peer_updates
    }

    fn io_err(&self, source: io::Error) -> WgError {
        WgError::Io {
            interface: self.interface.clone(),
            backend: self.backend_name(),
            source,
        }
    }

    fn ensure_present(&self) -> Result<(), WgError> {
        if self.backend == Backend::Userspace && uapi_socket(&self.interface).is_none() {
            return Err(WgError::Gone {
                interface: self.interface.clone(),
            });
        }
        Ok(())
    }

    /// Reads every peer of the device (O(peers): at start-up and on resync, not per change).
    pub fn read(&self) -> Result<ActualWg, WgError> {
        self.ensure_present()?;
        let device = Device::get(&self.name, self.backend).map_err(|e| self.io_err(e))?;
        // Gathered, then built in one go from the sorted list: full B-tree nodes, about half
        // the memory of one insert at a time in the device's order.
        let mut peers = Vec::with_capacity(device.peers.len());
        for info in device.peers {
            let config = info.config;
            let mut allowed_ips = AllowedIps::default();
            for ip in &config.allowed_ips {
                let net =
                    IpNet::new(ip.address, ip.cidr).map_err(|_| WgError::InvalidAllowedIp {
                        interface: self.interface.clone(),
                    })?;
                allowed_ips.insert(net);
            }
            let zero = Key::zero();
            peers.push((
                WgKey(config.public_key.0),
                WgPeer {
                    allowed_ips,
                    endpoint: config.endpoint,
                    preshared_key: config
                        .preshared_key
                        .filter(|k| *k != zero)
                        .map(|k| Box::new(WgKey(k.0))),
                    persistent_keepalive: config.persistent_keepalive_interval.filter(|s| *s != 0),
                },
            ));
        }
        Ok(ActualWg {
            peers: peers.into_iter().collect(),
        })
    }

    /// Applies per-peer creates and updates in one device update (never `replace_peers`).
    /// Created peers with an endpoint and no keepalive are sent a handshake initiation in the
    /// same update ([`kicked`]).
    pub fn apply_changes(&mut self, changes: &[&WgPeerChange]) -> Result<(), WgError> {
        if changes.is_empty() {
            return Ok(());
        }
        self.ensure_present()?;
        let kicked = kicked(changes);
        if self.backend == Backend::Userspace {
            let mut request = String::from("set=1\n");
            for change in changes {
                uapi_change(&mut request, change);
            }
            for key in &kicked {
                uapi_kick(&mut request, key);
            }
            self.uapi_set(request)?;
        } else {
            let mut peers: Vec<PeerConfigBuilder> = changes.iter().map(|c| builder(c)).collect();
            for key in &kicked {
                // Per peer, in order: on (the kernel sends a keepalive, so a handshake), off.
                peers.push(
                    PeerConfigBuilder::new(&Key(key.0))
                        .set_persistent_keepalive_interval(KICK_KEEPALIVE),
                );
                peers.push(PeerConfigBuilder::new(&Key(key.0)).unset_persistent_keepalive());
            }
            DeviceUpdate::new()
                .add_peers(&peers)
                .apply(&self.name, self.backend)
                .map_err(|e| self.io_err(e))?;
        }
        self.peer_updates += changes.len() as u64;
        Ok(())
    }

    /// Removes peers by key in one device update. Removing a peer that is not there is not an
    /// error (WireGuard ignores it).
    pub fn remove_peers(&mut self, keys: &[WgKey]) -> Result<(), WgError> {
        if keys.is_empty() {
            return Ok(());
        }
        self.ensure_present()?;
        if self.backend == Backend::Userspace {
            let mut request = String::from("set=1\n");
            for key in keys {
                let _ = writeln!(request, "public_key={}\nremove=true", hex(&key.0));
            }
            self.uapi_set(request)?;
        } else {
            let mut update = DeviceUpdate::new();
            for key in keys {
                update = update.remove_peer_by_key(&Key(key.0));
            }
            update
                .apply(&self.name, self.backend)
                .map_err(|e| self.io_err(e))?;
        }
        self.peer_updates += keys.len() as u64;
        Ok(())
    }

    /// Sends one `set` operation (`request` without its closing blank line) over the open UAPI
    /// stream, connecting it first if needed. A stream the implementation closed (it restarted,
    /// say) is connected again once and the operation sent again: a `set` of per-peer changes
    /// does the same when repeated.
    fn uapi_set(&mut self, mut request: String) -> Result<(), WgError> {
        request.push('\n');
        let first = match self.uapi.take() {
            Some(stream) => self.uapi_exchange(stream, &request),
            None => Err(io::Error::from(io::ErrorKind::NotConnected)),
        };
        let answer = match first {
            Ok(answer) => answer,
            Err(_) => {
                let stream = self.uapi_connect().map_err(|e| self.io_err(e))?;
                self.uapi_exchange(stream, &request)
                    .map_err(|e| self.io_err(e))?
            }
        };
        match answer {
            0 => Ok(()),
            errno => Err(WgError::Refused {
                interface: self.interface.clone(),
                errno,
            }),
        }
    }

    fn uapi_connect(&self) -> io::Result<BufReader<UnixStream>> {
        let path: PathBuf = uapi_socket(&self.interface).ok_or(io::ErrorKind::NotFound)?;
        let stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(UAPI_TIMEOUT))?;
        stream.set_write_timeout(Some(UAPI_TIMEOUT))?;
        Ok(BufReader::new(stream))
    }

    /// Writes `request` and reads the answer (`errno=N` and a blank line); keeps the stream
    /// open for the next update when the exchange completed.
    fn uapi_exchange(
        &mut self,
        mut stream: BufReader<UnixStream>,
        request: &str,
    ) -> io::Result<i64> {
        stream.get_mut().write_all(request.as_bytes())?;
        let mut errno = None;
        loop {
            let mut line = String::new();
            if stream.read_line(&mut line)? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some(value) = line.strip_prefix("errno=") {
                errno = value.parse().ok();
            }
        }
        let errno = errno.ok_or(io::ErrorKind::InvalidData)?;
        self.uapi = Some(stream);
        Ok(errno)
    }
}

fn hex(bytes: &[u8; 32]) -> String {
    let mut s = String::with_capacity(64);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// The created peers an update sends a handshake initiation to at once: those with an
/// endpoint and no keepalive (a keepalive the state sets already makes WireGuard send one), if
/// the update creates at most [`MAX_HANDSHAKE_KICKS`] of them.
///
/// Why: a peer revoked earlier and now brought back (by a push, or by an agent restarted onto
/// another state) may still hold the session the device forgot when it was removed. Its
/// packets go into that session, which the device no longer knows and drops, and the peer
/// starts a new handshake only when it has had no answer for 15 s (WireGuard's keepalive plus
/// rekey timeouts): its traffic came back up to 15 s after the agent had applied it. A
/// handshake initiation from the device replaces the stale session at once. A first start on
/// an empty device, creating thousands of peers, sends none (a handshake storm, and retries for
/// 90 s toward every peer that is offline).
fn kicked(changes: &[&WgPeerChange]) -> Vec<WgKey> {
    let keys: Vec<WgKey> = changes
        .iter()
        .filter(|c| c.create && c.endpoint.is_some())
        .filter(|c| c.persistent_keepalive.flatten().is_none_or(|s| s == 0))
        .map(|c| c.key)
        .collect();
    if keys.len() > MAX_HANDSHAKE_KICKS {
        return Vec::new();
    }
    keys
}

/// Switches `key`'s keepalive on and off again: switched on, the implementation sends a
/// keepalive at once, and without a session that is a handshake initiation.
fn uapi_kick(request: &mut String, key: &WgKey) {
    let key = hex(&key.0);
    let _ = writeln!(
        request,
        "public_key={key}\npersistent_keepalive_interval={KICK_KEEPALIVE}\n\
         public_key={key}\npersistent_keepalive_interval=0"
    );
}

/// One peer's change in the UAPI's `set` syntax (the keys of wireguard-go's IPC protocol).
fn uapi_change(request: &mut String, change: &WgPeerChange) {
    let _ = writeln!(request, "public_key={}", hex(&change.key.0));
    match change.preshared_key {
        Some(Some(psk)) => {
            let _ = writeln!(request, "preshared_key={}", hex(&psk.0));
        }
        Some(None) => {
            let _ = writeln!(request, "preshared_key={}", hex(&[0; 32]));
        }
        None => {}
    }
    if let Some(endpoint) = change.endpoint {
        let _ = writeln!(request, "endpoint={endpoint}");
    }
    if let Some(secs) = change.persistent_keepalive {
        let _ = writeln!(
            request,
            "persistent_keepalive_interval={}",
            secs.unwrap_or(0)
        );
    }
    for ip in &change.add_allowed_ips {
        let _ = writeln!(request, "allowed_ip={}/{}", ip.addr(), ip.prefix_len());
    }
}

fn builder(change: &WgPeerChange) -> PeerConfigBuilder {
    let mut b = PeerConfigBuilder::new(&Key(change.key.0));
    if let Some(endpoint) = change.endpoint {
        b = b.set_endpoint(endpoint);
    }
    match change.preshared_key {
        Some(Some(psk)) => b = b.set_preshared_key(Key(psk.0)),
        Some(None) => b = b.unset_preshared_key(),
        None => {}
    }
    match change.persistent_keepalive {
        Some(Some(secs)) => b = b.set_persistent_keepalive_interval(secs),
        Some(None) => b = b.unset_persistent_keepalive(),
        None => {}
    }
    for ip in &change.add_allowed_ips {
        b = b.add_allowed_ip(ip.addr(), ip.prefix_len());
    }
    b
}

fn uapi_socket(interface: &str) -> Option<std::path::PathBuf> {
    UAPI_DIRS
        .iter()
        .map(|dir| Path::new(dir).join(format!("{interface}.sock")))
        .find(|p| p.exists())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn created(n: u8, keepalive: Option<u16>, endpoint: bool) -> WgPeerChange {
        WgPeerChange {
            key: WgKey([n; 32]),
            peer: format!("p{n}"),
            create: true,
            endpoint: endpoint.then(|| "198.51.100.7:51820".parse().unwrap()),
            preshared_key: None,
            persistent_keepalive: keepalive.map(Some),
            add_allowed_ips: vec![],
        }
    }

    /// A created peer with an endpoint and no keepalive is kicked: keepalive on, then off, in
    /// the same request; not one without an endpoint, one whose own keepalive already makes
    /// WireGuard send one, an update of a peer the device has, or any peer of an update that
    /// creates more than the bound.
    #[test]
    fn created_peers_with_an_endpoint_are_sent_a_handshake() {
        let plain = created(1, None, true);
        let keepalive = created(2, Some(25), true);
        let no_endpoint = created(3, None, false);
        let mut update = created(4, None, true);
        update.create = false;
        let keys = kicked(&[&plain, &keepalive, &no_endpoint, &update]);
        assert_eq!(keys, vec![WgKey([1; 32])]);
        let mut request = String::new();
        uapi_kick(&mut request, &keys[0]);
        let key = "01".repeat(32);
        assert_eq!(
            request,
            format!(
                "public_key={key}\npersistent_keepalive_interval=25\n\
                 public_key={key}\npersistent_keepalive_interval=0\n"
            )
        );
        let many: Vec<WgPeerChange> = (0..=MAX_HANDSHAKE_KICKS)
            .map(|n| {
                let mut c = created(0, None, true);
                c.key = WgKey([(n % 251) as u8; 32]);
                c
            })
            .collect();
        assert!(kicked(&many.iter().collect::<Vec<_>>()).is_empty());
    }

    /// The UAPI text of a change: what wireguard-control's userspace backend sent for it.
    #[test]
    fn a_change_in_the_uapi_syntax() {
        let change = WgPeerChange {
            key: WgKey([1; 32]),
            peer: "a".into(),
            create: false,
            endpoint: "[fd00::1]:51820".parse().ok(),
            preshared_key: Some(None),
            persistent_keepalive: Some(None),
            add_allowed_ips: vec!["10.8.0.2/32".parse().unwrap()],
        };
        let mut request = String::new();
        uapi_change(&mut request, &change);
        let key = "01".repeat(32);
        let zero = "00".repeat(32);
        assert_eq!(
            request,
            format!(
                "public_key={key}\npreshared_key={zero}\nendpoint=[fd00::1]:51820\n\
                 persistent_keepalive_interval=0\nallowed_ip=10.8.0.2/32\n"
            )
        );
    }
}
