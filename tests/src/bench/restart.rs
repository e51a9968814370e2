//! The agent restarted under traffic with N pinned peers (SIGKILL, then ready again), and its
//! memory: at start, after the restart, and steady and peak over single-peer pushes.

use std::{
    process::Stdio,
    thread,
    time::{Duration, Instant},
};

use serde_json::{json, Value};

use super::{
    gen::{self, Rng},
    goal, progress,
    report::{f, verdict, Report},
    sandbox::{ping_totals, rss_kib, status_kib},
    Config,
};
use crate::{
    agent::{Agent, Layout},
    topology::Gateway,
};

/// The time of day, in seconds, of an agent log line (`2026-12-01T04:27:05.694931Z ...`).
fn log_seconds(line: &str) -> Option<f64> {
    let time = line.split_whitespace().next()?.split('T').nth(1)?;
    let time = time.trim_end_matches('Z');
    let mut parts = time.split(':');
    let h: f64 = parts.next()?.parse().ok()?;
    let m: f64 = parts.next()?.parse().ok()?;
    let s: f64 = parts.next()?.parse().ok()?;
    Some(h * 3600.0 + m * 60.0 + s)
}

/// Steady and peak RSS (KiB) over `pushes` single-peer changes pushed to a running agent, each
/// applied before the next: the peak (VmHWM) is reset first (`clear_refs` 5), so it is the
/// pushes' own; steady is the RSS after the last.
fn rss_over_pushes(agent: &Agent, gw: &Gateway, state: &mut Value, pushes: usize) -> (u64, u64) {
    let Some(pid) = agent.pid() else {
        return (0, 0);
    };
    let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
    let mut rng = Rng::new(8);
    let pool = gen::policy_pool(1_000, &mut rng);
    for _ in 0..pushes {
        let before = agent.reconciles(gw);
        if let Some(peers) = state["peers"].as_array_mut() {
            let i = rng.below(peers.len().saturating_sub(1).max(1) as u64) as usize;
            peers[i]["egress"] = pool[rng.below(pool.len() as u64) as usize].clone();
        }
        agent.write_state(&state.to_string());
        agent.wait_reconciles(gw, before, 1.0);
    }
    thread::sleep(Duration::from_millis(500));
    (rss_kib(pid), status_kib(pid, "VmHWM:"))
}

/// Which policies the generated peers have.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mix {
    /// A pool of N/100 policies that restricted peers share (what most gateways have).
    Shared,
    /// A policy of its own for every restricted peer.
    OwnPolicy,
}

impl Mix {
    fn label(self) -> &'static str {
        match self {
            Mix::Shared => "shared (N/100)",
            Mix::OwnPolicy => "one per peer",
        }
    }

    fn state(self, n: usize) -> Value {
        match self {
            Mix::Shared => gen::state(n, 6),
            Mix::OwnPolicy => gen::state_own_policies(n, 6),
        }
    }
}

pub fn run(report: &mut Report, config: &Config) {
    // wireguard-go holds at most 65,536 peers: 60k is the largest N it can run.
    let sizes = config.sizes(&[1_000, 10_000, 60_000], &[10_000]);
    let pushes = if config.quick { 5 } else { 20 };
    let mut rows = Vec::new();
    let mut records = Vec::new();
    let mut reclaimed = None;
    // Every size with shared policies, and the largest again with a policy per peer.
    let mut runs: Vec<(usize, Mix)> = sizes.iter().map(|&n| (n, Mix::Shared)).collect();
    if let Some(&largest) = sizes.last() {
        runs.push((largest, Mix::OwnPolicy));
    }
    for (n, mix) in runs {
        progress(&format!(
            "agent restart and memory, N={n}, policies {}",
            mix.label()
        ));
        let gw = Gateway::new(1);
        let mut state = mix.state(n);
        if let Some(peers) = state["peers"].as_array_mut() {
            peers.push(gw.peer_json(0, None));
        }
        let text = state.to_string();
        let start = Instant::now();
        let mut agent = Agent::start(&gw, Layout::Plain, &text, &["--resync", "3600"]);
        agent.wait_readyz_for(&gw, 200, Duration::from_secs(300));
        let first_ready = start.elapsed();
        let rss_first = agent.pid().map_or(0, rss_kib);

        let ping = gw.peers[0]
            .ns
            .command("ping")
            .args(["-q", "-i", "0.01", "-W", "1", "-c", "700", "10.8.0.1"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("ping");
        thread::sleep(Duration::from_secs(1));
        agent.kill();
        let t = Instant::now();
        agent.restart(&gw, &["--resync", "3600"]);
        agent.wait_ready(&gw);
        let ready_after = t.elapsed();
        // Where the restart's time goes, from the agent's own log (its last start).
        let log = agent.log_text();
        let restart_log = log
            .rfind("starting interface")
            .and_then(|at| log[..at].rfind('\n').map(|nl| &log[nl + 1..]))
            .unwrap_or("");
        for line in restart_log.lines().take(12) {
            progress(&format!("  restart at N={n}: {line}"));
        }
        // From the agent's start to the datapath attached (the programs loaded and verified,
        // the device read and the file parsed meanwhile), and from there to the first load
        // done.
        let at = |what: &str| {
            restart_log
                .lines()
                .find(|l| l.contains(what))
                .and_then(log_seconds)
        };
        let attach_s = at("starting interface")
            .zip(at("datapath attached"))
            .map(|(a, b)| b - a);
        let load_s = at("datapath attached")
            .zip(at("state unchanged").or(at("state applied")))
            .map(|(a, b)| b - a);
        let rss_restart = agent.pid().map_or(0, rss_kib);
        let writes = agent.metric(&gw, "wgfence_bpf_map_writes_total");
        let (tx, rx) = ping_totals(vec![ping]);
        let (steady, peak) = rss_over_pushes(&agent, &gw, &mut state, pushes);
        let anon = agent.pid().map_or(0, |pid| status_kib(pid, "RssAnon:"));
        let (tries, tries_bytes) =
            super::policy_tries_memory(&wgfence::dataplane::pin_dir(&gw.bpffs, gw.interface()));
        let file_kib = text.len() as u64 / 1024;
        rows.push(vec![
            n.to_string(),
            mix.label().to_owned(),
            f(first_ready.as_secs_f64(), 1),
            f(ready_after.as_secs_f64(), 2),
            writes.to_string(),
            tx.to_string(),
            (tx - rx).to_string(),
            f(rss_first as f64 / 1024.0, 0),
            f(rss_restart as f64 / 1024.0, 0),
            f(steady as f64 / 1024.0, 0),
            f(anon as f64 / 1024.0, 0),
            f(peak as f64 / 1024.0, 0),
            f(file_kib as f64 / 1024.0, 1),
            tries.to_string(),
            f(tries_bytes as f64 / 1048576.0, 1),
        ]);
        records.push(json!({ "peers": n, "own_policies": mix == Mix::OwnPolicy, "first_ready_s": first_ready.as_secs_f64(), "restart_ready_s": ready_after.as_secs_f64(),
            "restart_map_writes": writes, "transmitted": tx, "lost": tx - rx, "rss_mib": rss_first as f64 / 1024.0,
            "rss_after_restart_mib": rss_restart as f64 / 1024.0,
              "rss_steady_mib": steady as f64 / 1024.0, "rss_steady_anon_mib": anon as f64 / 1024.0, "rss_peak_mib": peak as f64 / 1024.0,
            "state_file_mib": file_kib as f64 / 1024.0, "attach_s": attach_s,
            "after_attach_s": load_s, "policy_tries": tries,
            "policy_tries_mib": tries_bytes as f64 / 1048576.0 }));
        if mix == Mix::OwnPolicy {
            reclaimed = Some(reclaim_after_shrink(&mut agent, &gw, n, tries, tries_bytes));
        }
        drop(agent);
        drop(gw);
    }
    report.section(
        "Agent restart under traffic, and agent memory",
        &format!(
            "The real `wgfence run` with N generated peers plus one real peer (wireguard-go; \
             60k rather than 100k: wireguard-go holds at most 65,536 peers), \
             which pings the node every 10 ms while the agent is SIGKILLed and restarted; then \
             {pushes} single-peer pushes, each applied before the next, with the RSS after them \
             (steady; of it, RssAnon: the heap and stacks, not the binary's pages) and its \
             peak during them (VmHWM, reset first). Restricted peers share a pool of N/100 \
             policies, and at the largest N also have a policy each. 100k and 131,072 peers need \
             a WireGuard device that holds them: not measured. \
             \"first start\" includes adding every peer to wireguard-go; \"ready after restart\" \
             is from the restart to `/readyz` answering 200 (adopting the pins, reading maps and \
             device, parsing, planning: nothing to write). RSS is the agent's resident memory \
             once ready. \"policy tries\": the tries pinned once the pushes are applied (one \
             per policy and address family it has entries for) and the memory the kernel \
             charges for them together (each trie's `memlock`). Command: `{}`.",
            config.command
        ),
    );
    report.table(
        &[
            "peers",
            "policies",
            "first start to ready (s)",
            "ready after restart (s)",
            "map writes after restart",
            "echo requests",
            "lost",
            "RSS (MiB)",
            "RSS after restart (MiB)",
            "steady RSS over pushes (MiB)",
            "of it anonymous (MiB)",
            "peak RSS over pushes (MiB)",
            "state file (MiB)",
            "policy tries",
            "their kernel memory (MiB)",
        ],
        &rows,
    );
    let at_mix = |n: usize, own: bool, k: &str| {
        records
            .iter()
            .find(|r| r["peers"] == n && r["own_policies"] == own)
            .and_then(|r| r[k].as_f64())
    };
    let at = |n: usize, k: &str| at_mix(n, false, k);
    if let Some(ready) = at(60_000, "restart_ready_s") {
        let secs = |n: usize, k: &str| at(n, k).map_or("n/a".to_owned(), |s| format!("{s:.2} s"));
        let line = format!(
            "ready after restart ≤ 1 s at 60k: {} ({ready:.2} s). From the agent's log: \
             loading and verifying the datapath's programs (the WireGuard device read and the \
             state file parsed meanwhile, on threads of their own) took {} at 1k and {} at 60k; \
             then reading the maps, waiting for the parse if it took longer, and a full plan \
             that finds nothing to write took {} at 60k.",
            verdict(ready <= 1.0),
            secs(1_000, "attach_s"),
            secs(60_000, "attach_s"),
            secs(60_000, "after_attach_s"),
        );
        report.paragraph(&format!("Goal {line}"));
        goal(&line);
    }
    if let (Some(steady), Some(peak), Some(file)) = (
        at(60_000, "rss_steady_mib"),
        at(60_000, "rss_peak_mib"),
        at(60_000, "state_file_mib"),
    ) {
        let line = format!(
            "agent RSS at 60k, steady ≤ 48 MiB and peak ≤ steady + 2× the state file over \
             {pushes} pushes: {} (steady {steady:.0} MiB: {}; peak {peak:.0} MiB against \
             {:.0}: {}; file {file:.1} MiB). Per peer the agent keeps the accepted state's \
             record (the pipeline's, with its indexes and the file's layout) and its view of \
             the kernel (the peer map's entries, the WireGuard peers and which peer each \
             address is routed to). Rare fields are boxed, names held inline, and the indexes \
             hold a key as a 64-bit fingerprint or its first 8 bytes; the process itself is \
             about the RSS at 1k.",
            verdict(steady <= 48.0 && peak <= steady + 2.0 * file),
            verdict(steady <= 48.0),
            steady + 2.0 * file,
            verdict(peak <= steady + 2.0 * file),
        );
        report.paragraph(&format!("Goal {line}"));
        goal(&line);
    }
    if let (Some(steady), Some(shared)) = (
        at_mix(60_000, true, "rss_steady_mib"),
        at(60_000, "rss_steady_mib"),
    ) {
        // Restricted peers: two in three; shared policies: one per 100 peers.
        let extra_policies = (60_000.0 * 2.0 / 3.0 - 600.0_f64).max(1.0);
        let line = format!(
            "agent RSS at 60k with a policy per restricted peer, steady ≤ 48 MiB: {} (steady \
             {steady:.0} MiB, {:.1} KiB more per extra policy than with shared ones). The \
             agent keeps each distinct policy's rules and its compiled entries once, in the \
             accepted state; its view of the kernel refers to the same compiled entries.",
            verdict(steady <= 48.0),
            (steady - shared) * 1024.0 / extra_policies,
        );
        report.paragraph(&format!("Goal {line}"));
        goal(&line);
    }
    if let Some(r) = &reclaimed {
        report.paragraph(&r.text());
    }
    let lost: u64 = records
        .iter()
        .map(|r| r["lost"].as_u64().unwrap_or(0))
        .sum();
    report.paragraph(&format!("Goal 0 lost: {}.", verdict(lost == 0)));
    report.record("restart", json!(records));
    if let Some(r) = reclaimed {
        report.record("reclaim", r.record());
    }
}

/// What freeing the tries a smaller state left empty took ([`reclaim_after_shrink`]).
struct Reclaimed {
    peers: usize,
    resync_s: u64,
    tries_before: usize,
    mib_before: f64,
    tries_after: usize,
    mib_after: f64,
    /// From the push to the last trie freed.
    seconds: f64,
    /// Each resync's reclaim, from the agent's log: (tries, ms).
    calls: Vec<(u64, f64)>,
}

impl Reclaimed {
    fn text(&self) -> String {
        let longest = self.calls.iter().map(|c| c.1).fold(0.0, f64::max);
        format!(
            "Freeing what a smaller state leaves empty: at {} peers with a policy per \
             restricted peer, the state of the shared pool pushed (the agent restarted with \
             `--resync {}`): the policy tries went from {} ({:.1} MiB) to {} ({:.1} MiB) in \
             {:.0} s, over {} resyncs that freed {} tries, each reclaim at most {:.0} ms (the \
             agent's log, `freed empty policy tries`; at most 4,096 per address family a \
             resync: one batch of the array of maps, one grace period).",
            self.peers,
            self.resync_s,
            self.tries_before,
            self.mib_before,
            self.tries_after,
            self.mib_after,
            self.seconds,
            self.calls.len(),
            self.calls.iter().map(|c| c.0).sum::<u64>(),
            longest,
        )
    }

    fn record(&self) -> Value {
        json!({ "peers": self.peers, "resync_s": self.resync_s,
            "tries_before": self.tries_before, "tries_mib_before": self.mib_before,
            "tries_after": self.tries_after, "tries_mib_after": self.mib_after,
            "seconds": self.seconds, "calls": self.calls })
    }
}

/// The agent, restarted with a short resync, is pushed the state of the shared pool in place
/// of a policy per peer; waits until the resyncs have freed the empty tries (or 10 minutes).
fn reclaim_after_shrink(
    agent: &mut Agent,
    gw: &Gateway,
    n: usize,
    tries_before: usize,
    bytes_before: u64,
) -> Reclaimed {
    const RESYNC_S: u64 = 5;
    progress(&format!("freeing the tries a smaller state left, N={n}"));
    agent.kill();
    agent.restart(gw, &["--resync", &RESYNC_S.to_string()]);
    agent.wait_readyz_for(gw, 200, Duration::from_secs(300));
    let mut state = Mix::Shared.state(n);
    if let Some(peers) = state["peers"].as_array_mut() {
        peers.push(gw.peer_json(0, None));
    }
    let pin_dir = wgfence::dataplane::pin_dir(&gw.bpffs, gw.interface());
    let count = || super::policy_tries_memory(&pin_dir);
    let start = Instant::now();
    agent.write_state(&state.to_string());
    // Done when two resyncs in a row free nothing more.
    let mut last = count();
    let mut done_at = start.elapsed();
    while start.elapsed() < Duration::from_secs(600) {
        thread::sleep(Duration::from_secs(1));
        let now = count();
        if now.0 != last.0 {
            done_at = start.elapsed();
            last = now;
        } else if now.0 < tries_before
            && start.elapsed() - done_at > Duration::from_secs(2 * RESYNC_S + 1)
        {
            break;
        }
    }
    let calls = agent
        .log_text()
        .lines()
        .filter(|l| l.contains("freed empty policy tries"))
        .filter_map(|l| {
            let field = |name: &str| -> Option<f64> {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix(name))
                    .and_then(|v| v.parse().ok())
            };
            Some((field("tries=")? as u64, field("duration_ms=")?))
        })
        .collect();
    Reclaimed {
        peers: n,
        resync_s: RESYNC_S,
        tries_before,
        mib_before: bytes_before as f64 / 1048576.0,
        tries_after: last.0,
        mib_after: last.1 as f64 / 1048576.0,
        seconds: done_at.as_secs_f64(),
        calls,
    }
}
