//! Generated states for the benchmarks: N peers with a realistic policy mix — a third
//! unrestricted, the rest with 2–16 rules over tcp/udp/icmp, IPv4 and IPv6, drawn from a pool
//! of policies that peers share. Deterministic for a seed.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use serde_json::{json, Value};
use wgfence::state::WgKey;

/// A small deterministic generator (xorshift64*): the same seed gives the same state, run to
/// run and machine to machine, without a dependency.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Shuffles in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

/// Tunnel address of generated peer `i` (10.64.0.0/10: room for 4M peers).
pub fn peer_v4(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 64, 0, 2)) + i as u32)
}

/// IPv6 tunnel address of generated peer `i`.
pub fn peer_v6(i: usize) -> Ipv6Addr {
    Ipv6Addr::from(u128::from(Ipv6Addr::new(0xfd00, 0x40, 0, 0, 0, 0, 0, 2)) + i as u128)
}

/// A public key for generated peer `i` (any 32 bytes are a valid X25519 public key).
pub fn peer_key(i: usize) -> WgKey {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&(i as u64 + 1).to_le_bytes());
    key[8..16].copy_from_slice(&0x7767_6665_6e63_6521u64.to_le_bytes());
    WgKey(key)
}

fn rule(rng: &mut Rng) -> Value {
    let v6 = rng.below(4) == 0;
    let dst = destination(rng, v6);
    let len = if v6 {
        [16, 32, 48, 64][rng.below(4) as usize]
    } else {
        [8, 12, 16, 24, 32][rng.below(5) as usize]
    };
    let cidr = IpNet::new(dst, len)
        .map(|n| n.trunc().to_string())
        .unwrap_or_default();
    match rng.below(10) {
        0 => json!({ "cidr": cidr, "protocol": "icmp" }),
        1 => json!({ "cidr": cidr, "protocol": "any" }),
        2..=5 => {
            let ports: Vec<Value> = (0..1 + rng.below(3))
                .map(|_| {
                    let p = 1 + rng.below(9000);
                    if rng.below(3) == 0 {
                        json!(format!("{p}-{}", p + rng.below(100)))
                    } else {
                        json!(p)
                    }
                })
                .collect();
            json!({ "cidr": cidr, "protocol": "tcp", "ports": ports })
        }
        _ => {
            let port = [53, 123, 443, 500, 4500, 5353][rng.below(6) as usize];
            json!({ "cidr": cidr, "protocol": "udp", "ports": [port] })
        }
    }
}

/// A pool of policies peers draw from: one per ~100 peers (at least 8).
pub fn policy_pool(n: usize, rng: &mut Rng) -> Vec<Value> {
    (0..(n / 100).max(8))
        .map(|_| Value::Array((0..2 + rng.below(15)).map(|_| rule(rng)).collect()))
        .collect()
}

/// Peer `i` of a generated state: a third unrestricted, the rest with a policy of the pool;
/// every other peer has an IPv6 address too.
pub fn peer(i: usize, pool: &[Value], rng: &mut Rng) -> Value {
    let mut p = json!({
        "name": format!("peer-{i:06}"),
        "publicKey": peer_key(i).to_base64(),
        "address": peer_v4(i).to_string(),
    });
    if i.is_multiple_of(2) {
        p["addressV6"] = json!(peer_v6(i).to_string());
    }
    if !i.is_multiple_of(3) {
        p["egress"] = pool[rng.below(pool.len() as u64) as usize].clone();
    }
    p
}

/// A generated state of `n` peers in which every restricted peer has a policy of its own (2
/// to 16 rules drawn afresh): the policy mix that costs the agent the most memory.
pub fn state_own_policies(n: usize, seed: u64) -> Value {
    let mut rng = Rng::new(seed);
    let peers: Vec<Value> = (0..n)
        .map(|i| {
            let own = [Value::Array(
                (0..2 + rng.below(15)).map(|_| rule(&mut rng)).collect(),
            )];
            peer(i, &own, &mut rng)
        })
        .collect();
    json!({ "version": 1, "peers": peers })
}

/// A generated state of `n` peers, as JSON.
pub fn state(n: usize, seed: u64) -> Value {
    let mut rng = Rng::new(seed);
    let pool = policy_pool(n, &mut rng);
    let peers: Vec<Value> = (0..n).map(|i| peer(i, &pool, &mut rng)).collect();
    json!({ "version": 1, "peers": peers })
}

/// The same state with peers, and the rules of every peer, in another order.
pub fn shuffled(state: &Value, seed: u64) -> Value {
    let mut rng = Rng::new(seed);
    let mut state = state.clone();
    if let Some(peers) = state["peers"].as_array_mut() {
        rng.shuffle(peers);
        for p in peers.iter_mut() {
            // `p["egress"]` would insert `"egress": null` into an unrestricted peer.
            if let Some(rules) = p.get_mut("egress").and_then(Value::as_array_mut) {
                rng.shuffle(rules);
            }
        }
    }
    state
}

/// An address a peer's packet could go to, for picking allowed and denied test packets.
pub fn destination(rng: &mut Rng, v6: bool) -> IpAddr {
    if v6 {
        IpAddr::V6(Ipv6Addr::new(
            0xfd00 | rng.below(256) as u16,
            rng.below(65536) as u16,
            0,
            0,
            0,
            0,
            0,
            1,
        ))
    } else {
        IpAddr::V4(Ipv4Addr::from(
            (10u32 << 24) | (rng.next_u64() as u32 & 0x00ff_ffff),
        ))
    }
}
