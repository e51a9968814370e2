//! The demo's gateway, state and probes (`cargo xtask demo`), shared with the image check
//! (`cargo xtask image --run`), which runs the same probes against the agent in its container.

use serde_json::{json, Value};

use crate::{
    probe::{run_all, Expect, Kind, Reach},
    topology::Gateway,
};

/// Alice's first rules: HTTPS and 8000-8100 into 10.0.0.0/8, ICMP to 192.0.2.0/24.
pub fn alice_rules() -> Value {
    json!([
        { "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443, "8000-8100"] },
        { "cidr": "192.0.2.0/24", "protocol": "icmp" },
    ])
}

/// The demo's first probes, of the state with [`alice_rules`] and carol.
pub const FIRST_PROBES: [(&str, usize, Kind, &str, Reach); 12] = {
    use Kind::{Ping, Tcp, Udp};
    use Reach::{Blocked as D, Reached as A};
    [
        ("alice", 0, Tcp(443), "10.2.3.4", A),
        ("alice", 0, Tcp(8100), "10.2.3.4", A),
        ("alice", 0, Tcp(8101), "10.2.3.4", D),
        ("alice", 0, Tcp(80), "10.2.3.4", D),
        ("alice", 0, Ping, "192.0.2.1", A),
        ("alice", 0, Ping, "10.2.3.4", D),
        ("bob", 1, Tcp(80), "10.2.3.4", A),
        ("bob", 1, Udp(53), "fd00:9::1", A),
        ("carol", 2, Udp(53), "10.1.2.3", A),
        ("carol", 2, Udp(53), "10.2.3.4", D),
        ("carol", 2, Tcp(22), "fd00:1::1", A),
        ("carol", 2, Tcp(443), "10.1.2.3", D),
    ]
};

/// Alice's rules after the demo's live change: [`alice_rules`] and tcp/80 into 10.0.0.0/8.
pub fn alice_rules_changed() -> Value {
    let mut rules = alice_rules();
    if let Some(list) = rules.as_array_mut() {
        list.push(json!({ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [80] }));
    }
    rules
}

/// The probes after the live change: alice now reaches tcp/80, bob still does.
pub const CHANGED_PROBES: [(&str, usize, Kind, &str, Reach); 2] = [
    ("alice", 0, Kind::Tcp(80), "10.2.3.4", Reach::Reached),
    ("bob", 1, Kind::Tcp(80), "10.2.3.4", Reach::Reached),
];

/// The demo's state: alice with `alice` rules, bob unrestricted, carol (if `with_carol`) with
/// DNS to 10.1.0.0/16 and SSH to fd00:1::/32, and policy tests that pin down every rule
/// (removing any one makes a test fail; `tests/tests/explain.rs` checks exactly that).
pub fn state(gw: &Gateway, alice: Value, with_carol: bool) -> String {
    state_of(|i, egress| gw.peer_json(i, egress), alice, with_carol)
}

/// [`state`] with `peer(i, egress)` giving peer `i`'s entry (names peer0..2 become alice, bob,
/// carol): the tests build it without a gateway.
pub fn state_of(
    peer: impl Fn(usize, Option<Value>) -> Value,
    alice: Value,
    with_carol: bool,
) -> String {
    // Alice's tcp/80 is denied at first and allowed after the live change: a test pins
    // either, so the changed state's extra rule is covered too.
    let web = "10.2.3.4:80/tcp";
    let (web_accept, web_deny) = if alice == alice_rules_changed() {
        (Some(web), None)
    } else {
        (None, Some(web))
    };
    let mut peers = vec![peer(0, Some(alice)), peer(1, None)];
    let alice_accept: Vec<&str> = ["10.2.3.4:443/tcp", "10.1.2.3:8080/tcp", "192.0.2.1/icmp"]
        .into_iter()
        .chain(web_accept)
        .collect();
    let alice_deny: Vec<&str> = ["10.2.3.4:22/tcp", "10.9.1.1/icmp", "[fd00:1::1]:443/tcp"]
        .into_iter()
        .chain(web_deny)
        .collect();
    let mut tests = vec![
        json!({ "peer": "alice", "accept": alice_accept, "deny": alice_deny }),
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

/// Sends each probe `(peer name, peer index, kind, destination, expected)`, prints a table of
/// what came through, and panics unless every probe matched what the policy says.
pub fn table(gw: &Gateway, cases: &[(&str, usize, Kind, &str, Reach)]) {
    let expects: Vec<Expect<'_>> = cases
        .iter()
        .map(|(name, i, kind, dst, expect)| {
            Expect::new(name, &gw.peers[*i].ns, *kind, dst, *expect)
        })
        .collect();
    let results = run_all(&expects);
    println!(
        "  {:<7} {:<9} {:<14} {:<9} expected",
        "peer", "probe", "destination", "result"
    );
    for (case, got) in expects.iter().zip(&results) {
        let word = |r: Reach| {
            if r == Reach::Reached {
                "allowed"
            } else {
                "denied"
            }
        };
        let mark = if *got == case.expect {
            "ok"
        } else {
            "MISMATCH"
        };
        println!(
            "  {:<7} {:<9} {:<14} {:<9} {:<8} {mark}",
            case.from,
            case.kind.to_string(),
            case.dst.to_string(),
            word(*got),
            word(case.expect)
        );
    }
    let mismatches = expects
        .iter()
        .zip(&results)
        .filter(|(c, got)| c.expect != **got)
        .count();
    assert_eq!(
        mismatches, 0,
        "{mismatches} probes did not match the policy"
    );
}
