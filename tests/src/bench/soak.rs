//! Soak: thousands of reconciles of random changes at N=10k, in process and through the agent;
//! memory, open fds and the final maps against the last state.

use std::{
    thread,
    time::{Duration, Instant},
};

use serde_json::{json, Value};
use wgfence::{dataplane::Dataplane, state::DesiredState};

use super::{
    gen::{self, Rng},
    parse_value, progress,
    report::{f, verdict, Report},
    sandbox::{rss_kib, Node},
    Config,
};
use crate::{
    agent::{Agent, Layout},
    topology::Gateway,
};

fn fd_count(pid: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// One random change to a desired state, in place: a peer re-policied, revoked or (back)
/// added. `pool` holds compiled policies to draw from; `parked` the revoked peers.
fn mutate(
    desired: &mut DesiredState,
    pool: &[wgfence::state::PeerSpec],
    parked: &mut Vec<wgfence::state::PeerSpec>,
    rng: &mut Rng,
) {
    let n = desired.peers.len();
    match rng.below(3) {
        0 if !parked.is_empty() => {
            let p = parked.swap_remove(rng.below(parked.len() as u64) as usize);
            let at = desired
                .peers
                .binary_search_by(|q| q.name.cmp(&p.name))
                .unwrap_or_else(|at| at);
            desired.peers.insert(at, p);
        }
        1 if n > 1 => {
            parked.push(desired.peers.remove(rng.below(n as u64) as usize));
        }
        _ if n > 0 => {
            let donor = &pool[rng.below(pool.len() as u64) as usize];
            let i = rng.below(n as u64) as usize;
            desired.peers[i].rules = donor.rules.clone();
            desired.peers[i].policy = donor.policy.clone();
        }
        _ => {}
    }
}

pub fn run(report: &mut Report, config: &Config) {
    let n = 10_000;
    let cycles: usize = if config.quick { 1_000 } else { 10_000 };
    let agent_cycles: usize = if config.quick { 100 } else { 500 };
    let every = cycles / 10;
    progress(&format!("soak: {cycles} reconciles at N={n}"));
    let (_, start_state) = parse_value(&gen::state(n, 21));
    // Policies to switch peers to: the generated pool's, compiled by the parser.
    let (_, pool_state) = parse_value(&gen::state(2_000, 22));
    let pool: Vec<_> = pool_state
        .peers
        .into_iter()
        .filter(|p| p.policy.is_some())
        .collect();
    let mut rng = Rng::new(23);

    // The agent's reconciler, in this process, on a wireguard-go device: every cycle plans
    // and applies 1-5 random changes (no parsing: that is the agent phase's).
    let mut node = Node::new();
    let mut desired = start_state.clone();
    node.reconcile(desired.clone());
    let me = std::process::id().to_string();
    let mut samples = Vec::new();
    let (mut writes, mut wg_updates) = (0u64, 0u64);
    let mut parked = Vec::new();
    let t = Instant::now();
    for cycle in 1..=cycles {
        for _ in 0..1 + rng.below(5) {
            mutate(&mut desired, &pool, &mut parked, &mut rng);
        }
        let o = node.reconcile(desired.clone());
        writes += o.map_writes;
        wg_updates += o.wg_peer_updates;
        if cycle % every == 0 || cycle == 1 {
            samples.push((cycle, rss_kib(std::process::id()), fd_count(&me)));
        }
    }
    let elapsed = t.elapsed();
    let mismatch = crate::map_mismatch(node.reconciler.dataplane().maps(), &desired);
    let wg_peers = node
        .reconciler
        .wireguard()
        .read()
        .map(|w| w.peers.len())
        .unwrap_or(usize::MAX);
    let in_process = json!({ "cycles": cycles, "peers_at_end": desired.peers.len(), "seconds": elapsed.as_secs_f64(),
        "map_writes": writes, "wireguard_peer_updates": wg_updates,
        "samples": samples.iter().map(|(c, r, f)| json!({ "cycle": c, "rss_kib": r, "fds": f })).collect::<Vec<_>>(),
        "maps_match": mismatch.is_none(), "wireguard_peers": wg_peers });
    drop(node);

    // The real agent: the state file rewritten with one random change per cycle; its RSS and
    // open fds sampled.
    progress(&format!(
        "soak: {agent_cycles} state file changes through the agent"
    ));
    let gw = Gateway::new(1);
    let mut pool_rng = Rng::new(24);
    let json_pool = gen::policy_pool(n, &mut pool_rng);
    let mut state = gen::state(n, 21);
    let agent = Agent::start(
        &gw,
        Layout::Plain,
        &state.to_string(),
        &["--resync", "3600"],
    );
    agent.wait_readyz_for(&gw, 200, Duration::from_secs(300));
    let pid = agent.pid().unwrap_or(0);
    let pid_s = pid.to_string();
    let mut agent_samples = vec![(0, rss_kib(pid), fd_count(&pid_s))];
    let mut peers: Vec<Value> = state["peers"].as_array().cloned().unwrap_or_default();
    let t = Instant::now();
    for cycle in 1..=agent_cycles {
        let before = agent.reconciles(&gw);
        // A change that leaves the file as it was (a peer given the policy it had) would
        // cost the agent nothing and never reconcile: draw again.
        let previous = state.clone();
        while state == previous {
            drive_churn_once(&mut rng, &json_pool, &mut peers);
            state = json!({ "version": 1, "peers": peers });
        }
        agent.write_state(&state.to_string());
        agent.wait_reconciles(&gw, before, 1.0);
        if cycle % (agent_cycles / 10).max(1) == 0 {
            // Let the load finish (the agent hands freed memory back after an apply) and the
            // metrics connection that saw the reconcile close.
            thread::sleep(Duration::from_millis(300));
            agent_samples.push((cycle, rss_kib(pid), fd_count(&pid_s)));
        }
    }
    let agent_elapsed = t.elapsed();
    let (_, final_desired) = parse_value(&state);
    let agent_mismatch = Dataplane::open_maps(&gw.bpffs, gw.interface())
        .map_err(|e| e.to_string())
        .map(|m| crate::map_mismatch(&m, &final_desired));
    let agent_ok = matches!(agent_mismatch, Ok(None));
    let agent_wg = gw.wg_peers().len();
    drop(agent);
    drop(gw);

    let row = |(c, r, fds): &(usize, u64, usize)| {
        vec![c.to_string(), f(*r as f64 / 1024.0, 1), fds.to_string()]
    };
    report.section(
        "Soak",
        &format!(
            "N={n} generated peers on a wireguard-go device. First the agent's reconciler in the \
             benchmark's own process: {cycles} reconciles, each of 1-5 random changes (a peer \
             re-policied, revoked, or a revoked one added back), planned and applied to the maps \
             and the device ({:.0} s, {writes} map writes, {wg_updates} WireGuard peer changes); \
             the process's RSS and open fds sampled every {every} reconciles. Then the real \
             `wgfence run`: {agent_cycles} state file rewrites of one random change each, waiting \
             for each reconcile ({:.0} s); its RSS and fds sampled. At the end the pinned maps \
             are compared entry by entry with what the last state compiles to. Command: `{}`.",
            elapsed.as_secs_f64(),
            agent_elapsed.as_secs_f64(),
            config.command
        ),
    );
    report.paragraph("In process (the reconciler):");
    report.table(
        &["reconciles", "RSS (MiB)", "open fds"],
        &samples.iter().map(row).collect::<Vec<_>>(),
    );
    report.paragraph("The agent:");
    report.table(
        &["state changes", "RSS (MiB)", "open fds"],
        &agent_samples.iter().map(row).collect::<Vec<_>>(),
    );
    let fds_flat = samples.first().map(|s| s.2) == samples.last().map(|s| s.2)
        && agent_samples.get(1).map(|s| s.2) == agent_samples.last().map(|s| s.2);
    let rss_of = |s: Option<&(usize, u64, usize)>| s.map_or(0.0, |s| s.1 as f64 / 1024.0);
    report.paragraph(&format!(
        "Agent RSS after the first {} changes {:.1} MiB, at the end {:.1} MiB, highest sample \
         {:.1} MiB.",
        agent_samples.get(1).map_or(0, |s| s.0),
        rss_of(agent_samples.get(1)),
        rss_of(agent_samples.last()),
        agent_samples.iter().map(|s| s.1).max().unwrap_or(0) as f64 / 1024.0
    ));
    report.paragraph(&format!(
        "Maps equal to the last state: in process {} ({} peers; WireGuard {wg_peers} peers), \
         agent {} ({} peers; WireGuard {agent_wg} peers). Open fds flat: {}.",
        verdict(mismatch.is_none()),
        desired.peers.len(),
        verdict(agent_ok),
        final_desired.peers.len(),
        verdict(fds_flat),
    ));
    if let Some(m) = &mismatch {
        report.paragraph(&format!("In-process mismatch: {m}."));
    }
    if let Ok(Some(m)) | Err(m) = &agent_mismatch {
        report.paragraph(&format!("Agent mismatch: {m}."));
    }
    report.record(
        "soak",
        json!({ "in_process": in_process, "agent": { "changes": agent_cycles, "seconds": agent_elapsed.as_secs_f64(),
            "samples": agent_samples.iter().map(|(c, r, f)| json!({ "change": c, "rss_kib": r, "fds": f })).collect::<Vec<_>>(),
            "maps_match": agent_ok, "wireguard_peers": agent_wg } }),
    );
}

/// One change of `drive_churn`'s kind to a JSON peer list (every peer may change).
fn drive_churn_once(rng: &mut Rng, pool: &[Value], peers: &mut Vec<Value>) {
    let n = peers.len();
    match rng.below(2) {
        0 if n > 1 => {
            // Revoke one, add a new one in its place (keys and addresses never reused).
            let i = rng.below(n as u64) as usize;
            peers.remove(i);
            let fresh = 100_000 + rng.below(1_000_000) as usize;
            let mut p = gen::peer(fresh, pool, rng);
            p["name"] = json!(format!("soak-{fresh:07}"));
            if peers.iter().all(|q| q["publicKey"] != p["publicKey"]) {
                peers.push(p);
            }
        }
        _ if n > 0 => {
            let i = rng.below(n as u64) as usize;
            peers[i]["egress"] = pool[rng.below(pool.len() as u64) as usize].clone();
        }
        _ => {}
    }
}
