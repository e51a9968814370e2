//! The demo's state file (`cargo xtask demo`): alice restricted, bob unrestricted, carol
//! restricted, with policy tests that pin down every rule (removing any one makes a test
//! fail; `tests/tests/explain.rs` checks exactly that).

use serde_json::{json, Value};

/// The demo's state: `peer(i, egress)` gives peer `i`'s entry (names peer0..2 become alice,
/// bob, carol), `alice` alice's rules; carol (and her tests) only `with_carol`.
pub fn state(
    peer: impl Fn(usize, Option<Value>) -> Value,
    alice: Value,
    with_carol: bool,
) -> String {
    let mut peers = vec![peer(0, Some(alice)), peer(1, None)];
    let mut tests = vec![
        json!({ "peer": "alice",
                "accept": ["10.2.3.4:443/tcp", "10.1.2.3:8080/tcp", "192.0.2.1/icmp"],
                "deny": ["10.2.3.4:22/tcp", "10.9.1.1/icmp", "[fd00:1::1]:443/tcp"] }),
        json!({ "peer": "bob", "accept": ["10.2.3.4:22/tcp", "[2001:db8::1]:53/udp"] }),
    ];
    if with_carol {
        peers.push(peer(
            2,
            Some(json!([
                { "cidr": "10.1.0.0/16", "protocol": "udp", "ports": [53] },
                { "cidr": "fd00:1::/32", "protocol": "tcp", "ports": [22] },
            ])),
        ));
        tests.push(json!({ "peer": "carol",
            "accept": ["10.1.2.3:53/udp", "[fd00:1::1]:22/tcp"],
            "deny": ["10.2.3.4:53/udp", "[fd00:9::1]:22/tcp", "10.1.2.3:22/tcp"] }));
    }
    // Names that read better than peer0..2.
    let mut text = json!({ "version": 1, "peers": peers, "tests": tests }).to_string();
    for (from, to) in [("peer0", "alice"), ("peer1", "bob"), ("peer2", "carol")] {
        text = text.replace(&format!("\"{from}\""), &format!("\"{to}\""));
    }
    text
}

/// The demo's first rules for alice.
pub fn alice_rules() -> Value {
    json!([
        { "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443, "8000-8100"] },
        { "cidr": "192.0.2.0/24", "protocol": "icmp" },
    ])
}
