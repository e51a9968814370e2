//! Helpers for wgfence's privileged integration tests. Every test builds its own network
//! namespaces, wireguard-go interfaces and bpffs pins with unique names, and removes them in
//! `Drop`, so they are removed when a test fails too.

pub mod agent;
pub mod bench;
pub mod net;
pub mod packet;
pub mod probe;
pub mod topology;

use wgfence::{
    dataplane::Maps,
    policy::{compile, CompiledPolicy, Rule},
};

/// An address literal of a test (panics on a typo).
pub fn ip(s: &str) -> std::net::IpAddr {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

/// A prefix literal of a test (panics on a typo).
pub fn net(s: &str) -> ipnet::IpNet {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

/// A state file of schema version 1 with these peers.
pub fn state(peers: Vec<serde_json::Value>) -> String {
    serde_json::json!({ "version": 1, "peers": peers }).to_string()
}

/// Fails the test with a clear message unless it runs as root (as CI does).
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "the privileged integration tests need root (run `cargo xtask test` as root)"
    );
}

/// Compiles `rules` and writes the policy's trie entries under `policy`.
pub fn install_policy(maps: &mut Maps, policy: u32, rules: &[Rule]) -> CompiledPolicy {
    let compiled = compile(rules).unwrap_or_else(|e| panic!("policy does not compile: {e}"));
    for (prefix, allows) in compiled.entries() {
        maps.upsert_policy(policy, prefix, &CompiledPolicy::value(allows))
            .unwrap_or_else(|e| panic!("writing policy entry {prefix}: {e}"));
    }
    compiled
}
