//! The rules the datapath counts, one row per counter: the daemon names its rule-hit series
//! by them and notes their last hits, and `wgfence status --rules` lists those not hit
//! ([`UnusedRules`]).

use std::{collections::BTreeMap, fmt, net::IpAddr, path::Path};

use serde::Serialize;
use wgfence_common::{PeerEntry, NO_RULES};

use super::report::ReportError;
use crate::{
    clock,
    dataplane::Dataplane,
    state::{self, DesiredState},
};

/// One rule of a policy the datapath counts: its counter, its policy id and its text.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct RuleRow {
    pub counter: u32,
    pub policy: u32,
    pub rule: String,
}

/// The counted rules of `desired`'s peers, by the entries the kernel holds for their
/// addresses (`entry`): each policy's rules, in canonical order, from its entries' counter
/// base. One row per counter (peers that share a policy share its rows).
pub fn rule_rows(
    desired: &DesiredState,
    entry: impl Fn(IpAddr) -> Option<PeerEntry>,
) -> Vec<RuleRow> {
    let mut rows = BTreeMap::new();
    for peer in &desired.peers {
        let Some(rules) = &peer.rules else {
            continue;
        };
        let Some(e) = peer
            .addrs()
            .filter_map(&entry)
            .find(|e| e.rules != NO_RULES)
        else {
            continue;
        };
        for (i, rule) in (0u32..).zip(rules.iter()) {
            let counter = e.rules.saturating_add(i);
            rows.entry(counter).or_insert_with(|| RuleRow {
                counter,
                policy: e.policy,
                rule: state::rule_text(rule),
            });
        }
    }
    rows.into_values().collect()
}

/// A counted rule not hit (since a time): `wgfence status --rules`. The JSON fields are in
/// alphabetical order, as they always were.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UnusedRule {
    pub bytes: u64,
    pub counter: u32,
    /// RFC 3339, UTC; `None`: never hit.
    pub last_hit: Option<String>,
    pub packets: u64,
    /// The policy id.
    pub policy: u32,
    pub rule: String,
}

/// The counted rules of a state not hit after `since` (by default: not hit at all), to prune.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct UnusedRules {
    pub rules: Vec<UnusedRule>,
    /// Unix seconds.
    #[serde(skip)]
    pub since: Option<u64>,
}

/// Reads the counters and last hits of `desired`'s rules from the pinned maps, leaving out
/// those hit after `since` (Unix seconds; by default, those hit at all).
pub fn unused_rules(
    bpffs: &Path,
    interface: &str,
    desired: &DesiredState,
    since: Option<u64>,
) -> Result<UnusedRules, ReportError> {
    let maps = Dataplane::open_maps(bpffs, interface)?;
    let rows = rule_rows(desired, |a| maps.peer(a).ok().flatten());
    let offset = clock::wall_minus_boot_ns();
    let now = clock::now_ns(libc::CLOCK_BOOTTIME);
    let mut rules = Vec::new();
    for row in rows {
        let c = maps.rule_counters(row.counter)?;
        let last = maps
            .rule_last_hit(row.counter, now)?
            .map(|ns| u64::try_from(clock::to_wall_secs(ns, offset)).unwrap_or_default());
        // Hit after `since` (by default: hit at all): in use, not listed.
        let in_use = match (since, last) {
            (Some(since), Some(last)) => last >= since,
            (None, Some(_)) => true,
            (_, None) => false,
        };
        if !in_use {
            rules.push(UnusedRule {
                bytes: c.bytes,
                counter: row.counter,
                last_hit: last.map(state::format_time),
                packets: c.packets,
                policy: row.policy,
                rule: row.rule,
            });
        }
    }
    Ok(UnusedRules { rules, since })
}

impl fmt::Display for UnusedRules {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = self.since.map_or("never hit".to_owned(), |t| {
            format!("not hit since {}", state::format_time(t))
        });
        let n = self.rules.len();
        writeln!(f, "{n} rule{} {what}:", if n == 1 { "" } else { "s" })?;
        writeln!(
            f,
            "{:>7}  {:<40} {:>12} {:>14}  LAST HIT",
            "POLICY", "RULE", "PACKETS", "BYTES"
        )?;
        for r in &self.rules {
            writeln!(
                f,
                "{:>7}  {:<40} {:>12} {:>14}  {}",
                r.policy,
                r.rule,
                r.packets,
                r.bytes,
                r.last_hit.as_deref().unwrap_or("never")
            )?;
        }
        Ok(())
    }
}
