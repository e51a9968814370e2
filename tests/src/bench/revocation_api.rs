//! Revocation latency through the Kubernetes API (`--source kubernetes`): from the response to
//! the Secret's patch to the revoked peer's last packet through, with a real kube-apiserver
//! and etcd ([`crate::kube`]) and real WireGuard sessions.

use std::{process::Stdio, thread, time::Duration};

use serde_json::{json, Value};

use super::{
    gen, goal, ms, progress, quantile,
    report::{f, verdict, Report},
    unix_secs, Config,
};
use crate::{
    agent::Agent,
    kube::{ApiServer, User},
    topology::Gateway,
};

/// What the API server accepts in one Secret (the sum of its values).
const SECRET_MAX: usize = 1 << 20;
const GOAL: Duration = Duration::from_secs(1);

pub fn run(report: &mut Report, config: &Config) {
    let sizes = config.sizes(&[1_000, 10_000], &[1_000]);
    let probes = if config.quick { 10 } else { 40 };
    let mut rows = Vec::new();
    let mut records = Vec::new();
    let mut verdicts = Vec::new();
    for &n in &sizes {
        progress(&format!(
            "revocation latency through the API, {probes} probes over N={n}"
        ));
        let (row, record, met) = revocations_at(n, probes);
        rows.push(row);
        records.push(record);
        verdicts.push(met);
    }
    report.section(
        "Revocation latency through the Kubernetes API",
        &format!(
            "As [Revocation latency](#9-revocation-latency), with `wgfence run --source \
             kubernetes`: the state is one Secret on a real kube-apiserver v1.20.2 with etcd \
             (in the node's network namespace, over TLS, the agent authenticated as its service \
             account), each revocation a merge patch of the Secret's `state.json`. Latency = \
             time of the revoked probe's last answered echo (pings 2 ms apart) − time the \
             patch's response arrived, 0 when no echo was answered after it; the round trip of \
             the patch itself is beside it. A Secret holds at most 1 MiB: where the generated \
             state of the revocation scenario (rules, IPv6 addresses) is larger, the background \
             peers are minimal (a name, a key, an IPv4 address). With a mounted Secret the \
             kubelet's sync period and cache TTL (60–90 s by default) come before the file \
             source's figures. Command: `{}`.",
            config.command
        ),
    );
    report.table(
        &[
            "background peers",
            "background state",
            "revocations",
            "p50 (ms)",
            "p99 (ms)",
            "max (ms)",
            "patch round trip p50 (ms)",
            "goal p99 (ms)",
        ],
        &rows,
    );
    let line = format!(
        "revocation through the Kubernetes API, p99 ≤ 1 s at 1k and at 10k peers: {} ({}).",
        verdict(!verdicts.is_empty() && verdicts.iter().all(|m| *m)),
        rows.iter()
            .map(|r| format!("p99 {} ms at {}", r[4], r[0]))
            .collect::<Vec<_>>()
            .join(", ")
    );
    report.paragraph(&format!("Goal {line}"));
    goal(&line);
    report.record("revocation_api", json!(records));
}

/// The background peers: the generated state where it fits a Secret, else minimal peers.
fn background(n: usize) -> (Vec<Value>, &'static str) {
    let rich = gen::state(n, 2)["peers"].clone();
    if rich.to_string().len() < SECRET_MAX * 9 / 10 {
        return (rich.as_array().cloned().unwrap_or_default(), "generated");
    }
    let minimal = (0..n)
        .map(|i| {
            json!({
                "name": format!("b{i}"),
                "publicKey": gen::peer_key(i).to_base64(),
                "address": gen::peer_v4(i).to_string(),
            })
        })
        .collect();
    (minimal, "minimal")
}

fn revocations_at(n: usize, probes: usize) -> (Vec<String>, Value, bool) {
    let gw = Gateway::new(probes);
    let (background, kind) = background(n);
    let state = |upto: usize| {
        let mut peers = background.clone();
        peers.extend((upto..probes).map(|i| gw.peer_json(i, None)));
        json!({ "version": 1, "peers": peers }).to_string()
    };
    let first = state(0);
    let bytes = first.len();
    assert!(
        bytes <= SECRET_MAX,
        "{bytes} bytes of state do not fit a Secret"
    );
    let api = ApiServer::start(&gw.node);
    api.create_namespace("wgfence");
    api.grant_agent("wgfence", "state");
    api.create_secret("wgfence", "state", &first);
    let agent = Agent::start_kubernetes(
        &gw,
        &api.kubeconfig(User::Agent),
        "wgfence/state",
        &["--resync", "3600"],
    );
    agent.wait_readyz_for(&gw, 200, Duration::from_secs(300));
    let mut latencies = Vec::new();
    let mut round_trips = Vec::new();
    for i in 0..probes {
        let next = state(i + 1);
        let ping = gw.peers[i]
            .ns
            .command("ping")
            .args(["-D", "-i", "0.002", "-W", "1", "-c", "1000", "10.8.0.1"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("ping");
        thread::sleep(Duration::from_millis(150));
        let sent = std::time::SystemTime::now();
        let (at, _) = api.patch_secret("wgfence", "state", &next);
        round_trips.push(at.duration_since(sent).unwrap_or_default());
        let t0 = unix_secs(at);
        let out = ping.wait_with_output().expect("ping");
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
    drop(api);
    drop(gw);
    let (p50, p99, max) = (
        quantile(&latencies, 0.5),
        quantile(&latencies, 0.99),
        quantile(&latencies, 1.0),
    );
    let round_trip = quantile(&round_trips, 0.5);
    let row = vec![
        n.to_string(),
        format!(
            "{kind}, {:.2} MiB",
            bytes as f64 / f64::from(SECRET_MAX as u32)
        ),
        latencies.len().to_string(),
        f(ms(p50), 0),
        f(ms(p99), 0),
        f(ms(max), 0),
        f(ms(round_trip), 0),
        f(ms(GOAL), 0),
    ];
    let record = json!({ "background": n, "background_state": kind, "state_bytes": bytes,
        "count": latencies.len(), "p50_ms": ms(p50), "p99_ms": ms(p99), "max_ms": ms(max),
        "patch_round_trip_p50_ms": ms(round_trip) });
    (row, record, !latencies.is_empty() && p99 <= GOAL)
}
