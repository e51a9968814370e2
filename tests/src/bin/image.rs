//! `cargo xtask image --run`: the agent's container image (`WGFENCE_IMAGE`), run by podman the
//! way deploy/base/daemonset.yaml runs it (tests/src/container.rs), enforces the demo's policy
//! on a sandboxed gateway: real wireguard-go peers send real packets, the allowed ones arrive,
//! the denied ones are dropped; a state change through the volume's `..data` swap is applied;
//! `wgfence status` works in the container. Also measures start to ready (`/readyz` on the
//! health port) of the container and, side by side, of the same binary started directly.
//! Root; everything it creates is removed when it ends, also on failure.

use std::{
    process::ExitStatus,
    time::{Duration, Instant},
};

use wgfence::dataplane::Dataplane;
use wgfence_tests::{
    agent::{http_get, Agent, Layout},
    container::CAPABILITIES,
    demo::{alice_rules, alice_rules_changed, state, table, CHANGED_PROBES, FIRST_PROBES},
    net::wait_for,
    probe::{Kind, Reach},
    topology::Gateway,
};

/// The DaemonSet's `--health-addr`, on the node's loopback.
const HEALTH: &str = "127.0.0.1:9587";
/// Rounds of the start-to-ready measurement (each: binary, then container).
const ROUNDS: usize = 3;
/// CAP_NET_ADMIN (12), CAP_PERFMON (38), CAP_BPF (39): the effective set the agent must have.
const CAP_MASK: u64 = (1 << 12) | (1 << 38) | (1 << 39);

fn main() {
    let image = std::env::var("WGFENCE_IMAGE")
        .expect("WGFENCE_IMAGE names no image: run `cargo xtask image --run`");
    println!("image {image}: the demo's gateway, peers alice, bob and carol (wireguard-go)");
    let gw = Gateway::new(3);
    let first = state(&gw, alice_rules(), true);
    let extra = ["--health-addr", HEALTH];

    let (mut binary, mut container) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        binary.push(start_to_ready(&gw, || {
            Agent::start(&gw, Layout::Kubernetes, &first, &extra)
        }));
        container.push(start_to_ready(&gw, || {
            Agent::start_container(&gw, &image, &first, &extra)
        }));
    }
    println!(
        "start to ready (/readyz 200 on {HEALTH}), median of {ROUNDS}, fresh attach each: \
         container {} ms, the same binary started directly {} ms",
        median_ms(&mut container),
        median_ms(&mut binary)
    );

    let mut agent = Agent::start_container(&gw, &image, &first, &extra);
    wait_ready(&gw, &agent);
    let podman = agent
        .container
        .as_ref()
        .expect("start_container made no container");
    let caps = capabilities(&podman.exec(&["cat", "/proc/1/status"]).stdout);
    println!(
        "container {}: the agent's effective capabilities {caps:#018x} ({})",
        podman.name,
        CAPABILITIES.join(", ")
    );
    assert_eq!(caps, CAP_MASK, "the agent runs with other capabilities");

    println!("\nthe demo's probes, the agent in its container:");
    table(&gw, &FIRST_PROBES);

    println!("\nalice may now reach tcp/80 (the state volume's ..data swapped):");
    let before = agent.reconciles(&gw);
    agent.write_state(&state(&gw, alice_rules_changed(), true));
    agent.wait_reconciles(&gw, before, 1.0);
    table(&gw, &CHANGED_PROBES);

    let status = podman.exec(&["wgfence", "status", "--interface", gw.interface()]);
    println!(
        "\n$ podman exec {} wgfence status --interface {}\n{}{}",
        podman.name,
        gw.interface(),
        String::from_utf8_lossy(&status.stdout),
        String::from_utf8_lossy(&status.stderr)
    );
    assert!(
        status.status.success(),
        "wgfence status failed in the container"
    );

    let stopped = agent.stop();
    println!("podman stop (SIGTERM): {}", describe(stopped));
    assert!(
        stopped.is_some_and(|s| s.success()),
        "the agent did not exit cleanly on SIGTERM; log:\n{}",
        agent.log_text()
    );
    println!("the container is gone; its datapath stays pinned and enforcing:");
    table(
        &gw,
        &[
            ("alice", 0, Kind::Tcp(80), "10.2.3.4", Reach::Reached),
            ("alice", 0, Kind::Tcp(8101), "10.2.3.4", Reach::Blocked),
        ],
    );
    drop(agent);
    drop(gw);
    println!("image check passed; the sandbox is removed (container, namespaces, pins)");
}

/// Starts an agent with `start`, waits until it is ready, removes it and its datapath; returns
/// how long it took from the start to the first `/readyz` 200.
fn start_to_ready(gw: &Gateway, start: impl FnOnce() -> Agent) -> Duration {
    let begin = Instant::now();
    let agent = start();
    wait_ready(gw, &agent);
    let took = begin.elapsed();
    drop(agent);
    Dataplane::detach(&gw.bpffs, gw.interface())
        .unwrap_or_else(|e| panic!("detaching {}: {e}", gw.interface()));
    took
}

/// Waits up to 30 s until `/readyz` on the health port answers 200.
fn wait_ready(gw: &Gateway, agent: &Agent) {
    let ready = || http_get(&gw.node, HEALTH, "/readyz").is_some_and(|(s, _)| s == 200);
    assert!(
        wait_for(Duration::from_secs(30), ready).is_some(),
        "/readyz on {HEALTH} never answered 200; log:\n{}",
        agent.log_text()
    );
}

fn median_ms(samples: &mut [Duration]) -> u128 {
    samples.sort();
    samples.get(samples.len() / 2).map_or(0, |d| d.as_millis())
}

/// The `CapEff:` mask of a /proc/PID/status.
fn capabilities(status: &[u8]) -> u64 {
    String::from_utf8_lossy(status)
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .unwrap_or_else(|| panic!("no CapEff in {}", String::from_utf8_lossy(status)))
}

fn describe(status: Option<ExitStatus>) -> String {
    status.map_or_else(|| "no exit status".to_owned(), |s| s.to_string())
}
