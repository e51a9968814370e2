//! The benchmark harness behind `cargo xtask bench`: one module per scenario, named for what
//! it measures, and what they share (generated states, the iptables baseline, the in-process
//! reconciler and the veth pair they measure on, the report). Timings are measured side by
//! side in one run and reported as ratios; the machines are shared and noisy, so no figure here
//! is a test assertion.
//!
//! The scenarios run in [`SCENARIOS`]' order; the report puts their sections in
//! [`report::SECTIONS`]' order, numbered from 1, whichever of them ran (`--only`).

pub mod apply;
pub mod baseline;
pub mod churn;
pub mod gen;
pub mod parse;
pub mod per_packet;
pub mod replies;
pub mod report;
pub mod restart;
pub mod revocation;
pub mod revocation_api;
pub mod sandbox;
pub mod soak;
pub mod throughput;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use wgfence::state::{parse, DesiredState};

use report::Report;

/// Every scenario, by the name `--only` takes, in the order they run. The apply scenario runs
/// before the revocation scenario, which compares with the restore times it measured.
pub const SCENARIOS: [(&str, Scenario); 10] = [
    ("per_packet", per_packet::run),
    ("parse", parse::run),
    ("apply", apply::run),
    ("throughput", throughput::run),
    ("churn", churn::run),
    ("revocation", revocation::run),
    ("revocation_api", revocation_api::run),
    ("restart", restart::run),
    ("replies", replies::run),
    ("soak", soak::run),
];

pub type Scenario = fn(&mut Report, &Config);

pub struct Config {
    pub quick: bool,
    pub command: String,
    /// `--sizes N[,N]`: only these of each scenario's sizes (to rerun one size).
    pub sizes: Option<Vec<usize>>,
}

impl Config {
    pub fn sizes(&self, full: &[usize], quick: &[usize]) -> Vec<usize> {
        let all = if self.quick { quick } else { full };
        all.iter()
            .copied()
            .filter(|n| self.sizes.as_ref().is_none_or(|only| only.contains(n)))
            .collect()
    }
}

pub fn now() -> f64 {
    unix_secs(SystemTime::now())
}

/// `t` in seconds since the epoch, as `ping -D` prints its timestamps.
pub fn unix_secs(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default()
}

pub fn parse_value(state: &Value) -> (String, DesiredState) {
    let text = state.to_string();
    let desired = parse(&text).expect("generated state invalid");
    (text, desired)
}

/// The sizes issue 14 judges: up to 60k with wireguard-go (it holds at most 65,536 peers),
/// then the maps alone, up to their capacity.
pub const ISSUE_SIZES: [usize; 5] = [1_000, 10_000, 60_000, 100_000, MAX_SLOTS];

/// Peers the maps hold (counter slots, and entries per family).
pub const MAX_SLOTS: usize = wgfence_common::MAX_PEERS as usize;

/// The nft restore time of the generated state at N, measured by the apply scenario in this run, for
/// the scenarios that compare with it.
pub static RESTORES: std::sync::Mutex<std::collections::BTreeMap<usize, Duration>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

pub fn remember_restore(n: usize, t: Duration) {
    if let Ok(mut r) = RESTORES.lock() {
        r.insert(n, t);
    }
}

pub fn restore_of(n: usize) -> Option<Duration> {
    RESTORES.lock().ok().and_then(|r| r.get(&n).copied())
}

/// The issue's goals, met or missed, as the scenarios judged them: summed up at the end
/// ([`goals`]).
static GOALS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

pub fn goal(line: &str) {
    if let Ok(mut g) = GOALS.lock() {
        g.push(line.to_owned());
    }
}

pub fn progress(what: &str) {
    eprintln!("bench: {what}");
}

/// The goals [`goal`] recorded, in the order the scenarios judged them.
pub fn goals() -> Vec<String> {
    GOALS.lock().map(|g| g.clone()).unwrap_or_default()
}

/// The `q`-quantile (0..=1) of `samples`, nearest rank.
pub fn quantile(samples: &[Duration], q: f64) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

pub fn median(samples: &[Duration]) -> Duration {
    quantile(samples, 0.5)
}

/// Milliseconds, for reports.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Microseconds, for reports.
pub fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The policy tries pinned in `pin_dir` (map layout 4: one per policy and address family) and
/// the memory the kernel charges for them together, in bytes (each trie's `memlock`, read from
/// its descriptor's fdinfo as bpftool does, without starting bpftool once per trie).
pub fn policy_tries_memory(pin_dir: &std::path::Path) -> (usize, u64) {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    let mut tries = 0;
    let mut bytes = 0;
    for dir in [
        wgfence_common::map_names::TRIES_V4,
        wgfence_common::map_names::TRIES_V6,
    ] {
        let Ok(entries) = std::fs::read_dir(pin_dir.join(dir)) else {
            continue;
        };
        for entry in entries.filter_map(|e| e.ok()) {
            let Ok(map) = aya::maps::MapData::from_pin(entry.path()) else {
                continue;
            };
            let fd = map.fd().as_fd().as_raw_fd();
            let memlock = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))
                .ok()
                .and_then(|info| {
                    info.lines()
                        .find_map(|l| l.strip_prefix("memlock:"))
                        .and_then(|v| v.trim().parse::<u64>().ok())
                });
            if let Some(memlock) = memlock {
                tries += 1;
                bytes += memlock;
            }
        }
    }
    (tries, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_use_the_nearest_rank() {
        let s: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(median(&s), Duration::from_millis(50));
        assert_eq!(quantile(&s, 0.99), Duration::from_millis(99));
        assert_eq!(quantile(&s, 1.0), Duration::from_millis(100));
        assert_eq!(quantile(&[], 0.5), Duration::ZERO);
    }
}
