//! Churn under traffic: pings keep flowing while peers are added, revoked and re-policied.

use std::{
    net::IpAddr,
    thread,
    time::{Duration, Instant},
};

use serde_json::{json, Value};
use wgfence::{
    dataplane::{AttachOptions, Dataplane},
    reconcile::Reconciler,
    wg::WireGuard as WgDevice,
};

use super::{
    baseline::{self, Backend},
    gen::{self, Rng},
    parse_value, progress,
    report::{f, verdict, Report},
    sandbox::{ping_streams, ping_totals, Veth},
    Config,
};
use crate::net::{unique, WireGuard};

pub fn run(report: &mut Report, config: &Config) {
    let streams = 20;
    let others = 1_000;
    let secs: u64 = if config.quick { 10 } else { 30 };
    let rate = 50.0;
    progress("churn under traffic");
    let mut rng = Rng::new(5);
    let pool = gen::policy_pool(others, &mut rng);
    // The streaming peers: half unrestricted, half allowed ICMP to the destination.
    let stream_peer = |i: usize| {
        let mut p = json!({ "name": format!("stream-{i:02}"), "publicKey": gen::peer_key(1_000_000 + i).to_base64(),
            "address": gen::peer_v4(500_000 + i).to_string() });
        if i % 2 == 1 {
            p["egress"] = json!([{ "cidr": "198.19.0.0/24", "protocol": "icmp" }, { "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443] }]);
        }
        p
    };
    let sources: Vec<IpAddr> = (0..streams)
        .map(|i| IpAddr::V4(gen::peer_v4(500_000 + i)))
        .collect();
    let mut base: Vec<Value> = (0..streams).map(stream_peer).collect();
    base.extend((0..others).map(|i| gen::peer(i, &pool, &mut rng)));
    let mut rows = Vec::new();
    let mut record = Vec::new();

    // wgfence: the datapath on the veth, the reconciler's WireGuard peers on a wireguard-go
    // device in the same namespace (the agent's full apply path).
    {
        let veth = Veth::new(&sources);
        let wg = WireGuard::start(&veth.dst, &unique("wgc"), 51820);
        let options = AttachOptions::new("vd");
        let dataplane = veth.dst.enter(|| Dataplane::attach(&options)).unwrap();
        let device = WgDevice::open(&wg.name).unwrap();
        let mut reconciler = Reconciler::new(dataplane, device).unwrap();
        let mut peers = base.clone();
        let (_, desired) = parse_value(&json!({ "version": 1, "peers": peers }));
        reconciler.reconcile(desired).unwrap();
        let pings = ping_streams(&veth.src, &sources, "0.005", secs);
        let (done, writes) =
            drive_churn(secs, rate, &mut rng, &pool, &mut peers, streams, |state| {
                let (_, desired) = parse_value(state);
                let o = reconciler.reconcile(desired).unwrap();
                o.map_writes
            });
        let (tx, rx) = ping_totals(pings);
        rows.push(vec![
            "wgfence".into(),
            done.to_string(),
            f(done as f64 / secs as f64, 0),
            writes.to_string(),
            tx.to_string(),
            (tx - rx).to_string(),
        ]);
        record.push(json!({ "design": "wgfence", "changes": done, "map_writes": writes, "transmitted": tx, "lost": tx - rx }));
        drop(reconciler);
        let _ = Dataplane::detach(
            std::path::Path::new(wgfence::dataplane::DEFAULT_BPFFS),
            "vd",
        );
        drop(wg);
    }

    // The baseline: re-render and restore the whole ruleset on each change.
    for backend in [Backend::Nft, Backend::Legacy] {
        let veth = Veth::new(&sources);
        let mut peers = base.clone();
        let (_, desired) = parse_value(&json!({ "version": 1, "peers": peers }));
        baseline::restore(&veth.dst, backend, &baseline::render(&desired, "vd"));
        let pings = ping_streams(&veth.src, &sources, "0.005", secs);
        let (done, _) = drive_churn(secs, rate, &mut rng, &pool, &mut peers, streams, |state| {
            let (_, desired) = parse_value(state);
            baseline::restore(&veth.dst, backend, &baseline::render(&desired, "vd"));
            0
        });
        let (tx, rx) = ping_totals(pings);
        baseline::flush(&veth.dst, backend);
        rows.push(vec![
            format!("{} restore per change", backend.name()),
            done.to_string(),
            f(done as f64 / secs as f64, 0),
            "—".into(),
            tx.to_string(),
            (tx - rx).to_string(),
        ]);
        record.push(json!({ "design": backend.name(), "changes": done, "transmitted": tx, "lost": tx - rx }));
    }

    report.section(
        "Churn under traffic",
        &format!(
            "{streams} peers stream ICMP echo at 200 pps each (half restricted, half not) across \
             a veth pair for {secs} s, while {others} other peers are added, revoked and \
             re-policied, paced at {rate:.0} state changes per second (or as fast as the design \
             manages). wgfence runs its full apply path (BPF maps on the veth, WireGuard peers \
             on a wireguard-go device); the baseline restores its re-rendered ruleset per change. \
             Lost = echo requests without a reply. Command: `{}`.",
            config.command
        ),
    );
    report.table(
        &[
            "design",
            "changes",
            "changes/s",
            "map writes",
            "echo requests",
            "lost",
        ],
        &rows,
    );
    let lost = record
        .first()
        .and_then(|r| r["lost"].as_u64())
        .unwrap_or(u64::MAX);
    report.paragraph(&format!(
        "Goal zero lost for wgfence: {} ({lost} lost).",
        verdict(lost == 0)
    ));
    report.record("churn", json!(record));
}

/// Changes churn peers (index ≥ `fixed`) at `rate` per second for `secs`; `apply` gets each new
/// state. Returns (changes made, sum of what `apply` returned).
fn drive_churn(
    secs: u64,
    rate: f64,
    rng: &mut Rng,
    pool: &[Value],
    peers: &mut Vec<Value>,
    fixed: usize,
    mut apply: impl FnMut(&Value) -> u64,
) -> (u64, u64) {
    let start = Instant::now();
    let period = Duration::from_secs_f64(1.0 / rate);
    let (mut done, mut total) = (0u64, 0u64);
    let mut parked: Vec<Value> = Vec::new();
    while start.elapsed() < Duration::from_secs(secs) {
        let churners = peers.len() - fixed;
        match rng.below(3) {
            0 if !parked.is_empty() => peers.push(parked.remove(0)),
            1 if churners > 1 => {
                let i = fixed + rng.below(churners as u64) as usize;
                parked.push(peers.remove(i));
            }
            _ if churners > 0 => {
                let i = fixed + rng.below(churners as u64) as usize;
                peers[i]["egress"] = pool[rng.below(pool.len() as u64) as usize].clone();
            }
            _ => {}
        }
        total += apply(&json!({ "version": 1, "peers": peers }));
        done += 1;
        let next = period * done as u32;
        if let Some(wait) = next.checked_sub(start.elapsed()) {
            thread::sleep(wait);
        }
    }
    (done, total)
}
