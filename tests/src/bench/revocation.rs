//! Revocation latency, through the real agent and wireguard-go: from the state file's write
//! to the revoked peer's packets dropped.

use std::{process::Stdio, thread, time::Duration};

use serde_json::{json, Value};

use super::{
    gen::{self},
    goal, ms, progress, quantile,
    report::{f, verdict, Report},
    restore_of, unix_secs, Config,
};
use crate::{
    agent::{Agent, Layout},
    topology::Gateway,
};

pub fn run(report: &mut Report, config: &Config) {
    // Real WireGuard sessions for the probe peers, on top of N generated background peers on
    // the same wireguard-go device (it holds at most 65,536: larger N need a kernel WireGuard).
    let sizes = config.sizes(&[1_000, 10_000, 60_000], &[1_000]);
    let probes = if config.quick { 10 } else { 40 };
    let mut rows = Vec::new();
    let mut records = Vec::new();
    let mut verdicts = Vec::new();
    for &n in &sizes {
        progress(&format!("revocation latency, {probes} probes over N={n}"));
        let (row, record, met) = revocations_at(n, probes);
        rows.push(row);
        records.push(record);
        verdicts.push(met);
    }
    report.section(
        "Revocation latency",
        &format!(
            "N generated background peers plus {probes} probe peers with real WireGuard sessions, \
             all on one wireguard-go device; the real `wgfence run` follows a Kubernetes-style \
             volume (`..data` symlink swap). Each probe in turn pings the node every 2 ms and is \
             then removed from the state file; latency = time of its last answered echo − time \
             of the swap (an upper bound by up to 2 ms). The old design restored the whole \
             ruleset per push: its iptables-nft-restore of the same background state (scenario \
             3, this run) is beside it. 100k and 131,072 peers need a WireGuard device that holds \
             them (this kernel has no WireGuard module; wireguard-go holds 65,536): not measured. \
             Command: `{}`.",
            config.command
        ),
    );
    report.table(
        &[
            "background peers",
            "revocations",
            "p50 (ms)",
            "p99 (ms)",
            "max (ms)",
            "goal p99 (ms)",
            "iptables-nft-restore of the state (ms)",
        ],
        &rows,
    );
    let line = format!(
        "revocation with real sessions, p99 ≤ 20 ms at 1k, ≤ 30 ms at 10k, ≤ 60 ms at 60k: {} \
         ({}). A revocation reads the whole file once, in 256 KiB pieces, hashing its blocks \
         (O(N)); the state pipeline then reads again, and parses, only the bytes of the peers \
         around the one removed, and the plan leads with the deletions.",
        verdict(!verdicts.is_empty() && verdicts.iter().all(|m| *m)),
        rows.iter()
            .map(|r| format!("p99 {} ms at {}", r[3], r[0]))
            .collect::<Vec<_>>()
            .join(", ")
    );
    report.paragraph(&format!("Goal {line}"));
    goal(&line);
    report.record("revocation", json!(records));
}

/// The goal's p99 at `n` background peers.
fn revocation_goal(n: usize) -> Duration {
    Duration::from_millis(match n {
        0..=1_000 => 20,
        1_001..=10_000 => 30,
        _ => 60,
    })
}

fn revocations_at(n: usize, probes: usize) -> (Vec<String>, Value, bool) {
    let gw = Gateway::new(probes);
    let background = gen::state(n, 2)["peers"].clone();
    let state = |upto: usize| {
        let mut peers = background.as_array().cloned().unwrap_or_default();
        peers.extend((upto..probes).map(|i| gw.peer_json(i, None)));
        json!({ "version": 1, "peers": peers }).to_string()
    };
    let agent = Agent::start(&gw, Layout::Kubernetes, &state(0), &["--resync", "3600"]);
    // The first start adds every background peer to wireguard-go.
    agent.wait_readyz_for(&gw, 200, Duration::from_secs(300));
    let mut latencies = Vec::new();
    for i in 0..probes {
        let next = state(i + 1);
        let ping = gw.peers[i]
            .ns
            .command("ping")
            .args(["-D", "-i", "0.002", "-W", "1", "-c", "250", "10.8.0.1"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("ping");
        thread::sleep(Duration::from_millis(150));
        // From the swap (the rename that publishes the new file), not from the start of
        // writing the file: at 60k peers the writer's own 27 MB would count otherwise.
        let t0 = unix_secs(agent.write_state(&next));
        let out = ping.wait_with_output().unwrap();
        let last = String::from_utf8_lossy(&out.stdout)
            .lines()
            .rev()
            .filter(|l| l.contains("bytes from"))
            .find_map(|l| l.strip_prefix('[')?.split(']').next()?.parse::<f64>().ok());
        if let Some(last) = last {
            latencies.push(Duration::from_secs_f64((last - t0).max(0.0)));
        }
    }
    drop(agent);
    drop(gw);
    let (p50, p99, max) = (
        quantile(&latencies, 0.5),
        quantile(&latencies, 0.99),
        quantile(&latencies, 1.0),
    );
    let goal = revocation_goal(n);
    let restore = restore_of(n);
    let row = vec![
        n.to_string(),
        latencies.len().to_string(),
        f(ms(p50), 0),
        f(ms(p99), 0),
        f(ms(max), 0),
        f(ms(goal), 0),
        restore.map_or("n/a (apply not run)".to_owned(), |t| f(ms(t), 0)),
    ];
    let record = json!({ "background": n, "count": latencies.len(), "p50_ms": ms(p50),
        "p99_ms": ms(p99), "max_ms": ms(max), "nft_restore_ms": restore.map(ms) });
    (row, record, !latencies.is_empty() && p99 <= goal)
}
