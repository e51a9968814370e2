//! A WireGuard gateway in a box: a "node" namespace with a wireguard-go interface (where the
//! datapath attaches) and destinations on its loopback, and peers, each in its own
//! namespace with its own wireguard-go interface, reaching the node over a veth underlay.
//!
//! ```text
//!   peer i (ns)                                   node (ns)
//!   wgp…  10.8.0.(i+2)/32  fd00:8::(i+2)/128       wgn…  10.8.0.1/24  fd00:8::1/64   <- tcx ingress
//!   eth0  198.18.i.2/24  ── veth ──  u<i> 198.18.i.1/24
//!                                                  lo    10.1.2.3 10.2.3.4 10.9.1.1 192.0.2.1
//!                                                        fd00:1::1 fd00:9::1 2001:db8::1
//! ```

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::PathBuf,
    time::Duration,
};

use wgfence::dataplane::{AttachOptions, Dataplane, DEFAULT_BPFFS};

use crate::net::{wait_for, Netns, WireGuard};

const WG_PORT: u16 = 51820;

/// Addresses on the node's loopback interface (this kernel has no dummy driver): what peers' traffic is destined to.
pub const DESTINATIONS: [&str; 7] = [
    "10.1.2.3",
    "10.2.3.4",
    "10.9.1.1",
    "192.0.2.1",
    "fd00:1::1",
    "fd00:9::1",
    "2001:db8::1",
];

/// Tunnel routes on every peer: everything the tests send goes through WireGuard.
const PEER_ROUTES: [&str; 4] = ["10.0.0.0/8", "192.0.2.0/24", "fd00::/8", "2001:db8::/32"];

pub struct Peer {
    // Field order is drop order: the process, then the namespace.
    pub wg: WireGuard,
    pub ns: Netns,
    pub v4: Ipv4Addr,
    pub v6: Ipv6Addr,
}

impl Peer {
    pub fn addrs(&self) -> [IpAddr; 2] {
        [IpAddr::V4(self.v4), IpAddr::V6(self.v6)]
    }
}

pub struct Gateway {
    pub peers: Vec<Peer>,
    pub wg: WireGuard,
    pub node: Netns,
    pub bpffs: PathBuf,
}

impl Gateway {
    /// Builds the node and `n` peers, all with established WireGuard sessions.
    pub fn new(n: usize) -> Self {
        crate::require_root();
        assert!(n < 250, "peer addresses are 10.8.0.(i+2)");
        let node = Netns::new("wgft-node-");
        let wg = WireGuard::start(&node, &crate::net::unique("wgn"), WG_PORT);
        node.ip(&["addr", "add", "10.8.0.1/24", "dev", &wg.name]);
        node.ip(&[
            "-6",
            "addr",
            "add",
            "fd00:8::1/64",
            "dev",
            &wg.name,
            "nodad",
        ]);
        for dst in DESTINATIONS {
            let (family, len) = if dst.contains(':') {
                ("-6", "128")
            } else {
                ("-4", "32")
            };
            let addr = format!("{dst}/{len}");
            let mut args = vec![family, "addr", "add", &addr, "dev", "lo"];
            if family == "-6" {
                args.push("nodad");
            }
            node.ip(&args);
        }
        // Port-unreachable errors are how probes see that a packet arrived: no rate limit.
        node.exec(&["sysctl", "-qw", "net.ipv4.icmp_ratelimit=0"]);
        node.exec(&["sysctl", "-qw", "net.ipv6.icmp.ratelimit=0"]);

        let mut gateway = Self {
            peers: Vec::with_capacity(n),
            wg,
            node,
            bpffs: PathBuf::from(DEFAULT_BPFFS),
        };
        for i in 0..n {
            let peer = gateway.add_peer(i);
            gateway.peers.push(peer);
        }
        for i in 0..n {
            gateway.handshake(i);
        }
        gateway
    }

    fn add_peer(&self, i: usize) -> Peer {
        let ns = Netns::new("wgft-peer-");
        let underlay = format!("u{i}");
        self.node.ip(&[
            "link",
            "add",
            &underlay,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            ns.name(),
        ]);
        let node_addr = format!("198.18.{i}.1");
        let peer_addr = format!("198.18.{i}.2");
        self.node
            .ip(&["addr", "add", &format!("{node_addr}/24"), "dev", &underlay]);
        self.node.ip(&["link", "set", &underlay, "up"]);
        ns.ip(&["addr", "add", &format!("{peer_addr}/24"), "dev", "eth0"]);
        ns.ip(&["link", "set", "eth0", "up"]);

        let wg = WireGuard::start(&ns, &crate::net::unique("wgp"), WG_PORT);
        let host = u8::try_from(i + 2).unwrap_or(u8::MAX);
        let v4 = Ipv4Addr::new(10, 8, 0, host);
        let v6 = Ipv6Addr::new(0xfd00, 8, 0, 0, 0, 0, 0, u16::from(host));
        ns.ip(&["addr", "add", &format!("{v4}/32"), "dev", &wg.name]);
        ns.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{v6}/128"),
            "dev",
            &wg.name,
            "nodad",
        ]);
        for route in PEER_ROUTES {
            ns.ip(&["route", "add", route, "dev", &wg.name]);
        }
        wg.set_peer(
            &self.wg.keys.public,
            &[
                "allowed-ips",
                "0.0.0.0/0,::/0",
                "endpoint",
                &format!("{node_addr}:{WG_PORT}"),
            ],
        );
        self.wg.set_peer(
            &wg.keys.public,
            &[
                "allowed-ips",
                &format!("{v4}/32,{v6}/128"),
                "endpoint",
                &format!("{peer_addr}:{WG_PORT}"),
            ],
        );
        Peer { wg, ns, v4, v6 }
    }

    /// Deletes the node's WireGuard interface and creates it again (same name, key, port and
    /// addresses; no peers, a new interface index), as a reboot of wireguard-go or a
    /// `wg-quick down; wg-quick up` does.
    pub fn recreate_interface(&mut self) {
        self.wg.recreate(&self.node, WG_PORT);
        self.node
            .ip(&["addr", "add", "10.8.0.1/24", "dev", &self.wg.name]);
        self.node.ip(&[
            "-6",
            "addr",
            "add",
            "fd00:8::1/64",
            "dev",
            &self.wg.name,
            "nodad",
        ]);
    }

    /// Makes peer `i` forget its session with the node and start a new one (after the node's
    /// interface was recreated, the peer would otherwise wait for its rekey timeout).
    pub fn new_session(&self, i: usize) {
        let peer = &self.peers[i];
        let node_key = self.wg.keys.public.clone();
        peer.wg.set_peer(&node_key, &["remove"]);
        peer.wg.set_peer(
            &node_key,
            &[
                "allowed-ips",
                "0.0.0.0/0,::/0",
                "endpoint",
                &format!("198.18.{i}.1:{WG_PORT}"),
            ],
        );
        for route in PEER_ROUTES {
            let _ = peer
                .ns
                .try_exec(&["ip", "route", "replace", route, "dev", &peer.wg.name]);
        }
        self.handshake(i);
    }

    /// Makes peer `i` start its WireGuard session and waits until the node has seen it.
    pub fn handshake(&self, i: usize) {
        let peer = &self.peers[i];
        let key = peer.wg.keys.public.clone();
        let done = || {
            self.wg
                .latest_handshakes()
                .iter()
                .any(|(k, t)| *k == key && *t > 0)
        };
        let mut attempts = 0;
        while !done() && attempts < 5 {
            // Any packet into the tunnel starts the handshake; whether it passes does not matter.
            let _ = peer
                .ns
                .try_exec(&["ping", "-c", "1", "-W", "1", "10.8.0.1"]);
            let _ = wait_for(Duration::from_secs(2), done);
            attempts += 1;
        }
        assert!(done(), "peer {i} never completed a WireGuard handshake");
    }

    /// Peer `i` as a state file entry (name `peer<i>`), with `egress` rules if given.
    pub fn peer_json(&self, i: usize, egress: Option<serde_json::Value>) -> serde_json::Value {
        let peer = &self.peers[i];
        let mut p = serde_json::json!({
            "name": format!("peer{i}"),
            "publicKey": peer.wg.keys.public,
            "address": peer.v4.to_string(),
            "addressV6": peer.v6.to_string(),
            "endpoint": format!("198.18.{i}.2:{WG_PORT}"),
        });
        if let Some(egress) = egress {
            p["egress"] = egress;
        }
        p
    }

    /// The public keys of the node's WireGuard peers, from `wg show`.
    pub fn wg_peers(&self) -> Vec<String> {
        let out = crate::net::run(&["wg", "show", self.interface(), "peers"]);
        let mut keys: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect();
        keys.sort();
        keys
    }

    pub fn interface(&self) -> &str {
        &self.wg.name
    }

    /// Attaches (or adopts) the datapath on the node's WireGuard interface.
    pub fn attach(&self) -> Dataplane {
        let options = AttachOptions::new(self.interface()).bpffs(&self.bpffs);
        self.node
            .enter(|| Dataplane::attach(&options))
            .unwrap_or_else(|e| panic!("attaching to {}: {e}", self.interface()))
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        // The pins outlive the namespaces; remove them first. The fields drop after this.
        if let Err(e) = Dataplane::detach(&self.bpffs, &self.wg.name) {
            eprintln!("cleanup: detaching {}: {e}", self.wg.name);
        }
    }
}
