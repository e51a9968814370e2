//! A long run of small pushes on a large state: the agent's work per push follows the change,
//! not the peer count, and does not grow with the number of pushes behind it (nothing piles up:
//! no previous states kept, no index that grows, no leak in the per-push path).

use std::time::Instant;

use serde_json::{json, Value};
use wgfence_tests::{
    agent::{Agent, Layout},
    bench::gen,
    ip,
    probe::{probe, Kind, Reach},
    topology::Gateway,
};

/// Peers in the state besides the gateway's real one.
const BACKGROUND: usize = 10_000;
const PUSHES: usize = 200;
/// The pushes compared: the first and the last this many.
const WINDOW: usize = 50;

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// 200 single-peer pushes in a row at 10,001 peers (wireguard-go holds them all): each one is
/// applied with a handful of map writes, and the agent's apply time for the last 50 is not
/// more than twice that of the first 50 (a trend, not a figure: it fails if the work per push
/// grows with the pushes before it). The real peer's traffic is enforced throughout.
#[test]
fn two_hundred_single_peer_pushes_at_10k_peers_cost_the_same_from_first_to_last() {
    let gw = Gateway::new(1);
    let mut rng = gen::Rng::new(14);
    let pool = gen::policy_pool(BACKGROUND, &mut rng);
    let mut peers: Vec<Value> = vec![gw.peer_json(
        0,
        Some(json!([{ "cidr": "10.1.2.3/32", "protocol": "icmp" }])),
    )];
    peers.extend((0..BACKGROUND).map(|i| gen::peer(i, &pool, &mut rng)));
    let mut state = json!({ "version": 1, "peers": peers });
    let agent = Agent::start(&gw, Layout::Kubernetes, &state.to_string(), &[]);
    agent.wait_readyz_for(&gw, 200, std::time::Duration::from_secs(180));

    let mut apply_ms = Vec::with_capacity(PUSHES);
    let mut seen_ms = Vec::with_capacity(PUSHES);
    for k in 0..PUSHES {
        // One background peer changes: its policy (map writes) or its endpoint (WireGuard).
        let i = 1 + (k * 37) % BACKGROUND;
        if k % 2 == 0 {
            state["peers"][i]["egress"] = pool[(k / 2) % pool.len()].clone();
        } else {
            state["peers"][i]["endpoint"] =
                json!(format!("198.51.100.{}:{}", k % 250 + 1, 40_000 + k));
        }
        let text = state.to_string();
        let count = agent.reconciles(&gw);
        let sum = agent.metric(&gw, "wgfence_reconcile_duration_seconds_sum");
        let writes = agent.metric(&gw, "wgfence_bpf_map_writes_total");
        let start = Instant::now();
        agent.write_state(&text);
        agent.wait_reconciles(&gw, count, 1.0);
        seen_ms.push(start.elapsed().as_secs_f64() * 1e3);
        assert_eq!(
            agent.reconciles(&gw),
            count + 1.0,
            "push {k}: not one reconcile"
        );
        apply_ms.push((agent.metric(&gw, "wgfence_reconcile_duration_seconds_sum") - sum) * 1e3);
        let written = agent.metric(&gw, "wgfence_bpf_map_writes_total") - writes;
        assert!(
            written <= 64.0,
            "push {k}: {written} map writes for one changed peer; log:\n{}",
            agent.log_text()
        );
    }
    // The real peer's rule held throughout: allowed ICMP passes, anything else not.
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Ping, ip("10.1.2.3")),
        Reach::Reached
    );
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Ping, ip("10.2.3.4")),
        Reach::Blocked
    );

    // Policy pushes (map writes) and endpoint pushes (a WireGuard update) cost differently:
    // each kind is compared with itself.
    for (kind, parity) in [("policy", 0), ("endpoint", 1)] {
        let of_kind = |window: &[f64], offset: usize| -> Vec<f64> {
            window
                .iter()
                .enumerate()
                .filter(|(j, _)| (offset + j) % 2 == parity)
                .map(|(_, v)| *v)
                .collect()
        };
        let first = median(&of_kind(&apply_ms[..WINDOW], 0));
        let last = median(&of_kind(&apply_ms[PUSHES - WINDOW..], PUSHES - WINDOW));
        let seen_first = median(&of_kind(&seen_ms[..WINDOW], 0));
        let seen_last = median(&of_kind(&seen_ms[PUSHES - WINDOW..], PUSHES - WINDOW));
        eprintln!(
            "{kind} pushes, apply (ms, median): first {WINDOW} pushes {first:.3}, last \
             {WINDOW} {last:.3}; file change to applied (ms, median, polled every 10 ms): \
             {seen_first:.1}, {seen_last:.1}"
        );
        assert!(
            last <= 2.0 * first,
            "{kind} pushes: the apply time grew with the pushes: median {first:.3} ms over the \
             first {WINDOW} pushes, {last:.3} ms over the last {WINDOW}"
        );
    }
}
