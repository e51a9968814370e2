//! The rules the datapath counts, one row per counter: the daemon names its rule-hit series
//! by them and notes their last hits, and `wgfence status --rules` lists those not hit
//! ([`UnusedRules`]).

use std::{collections::BTreeMap, fmt, net::IpAddr, path::Path};

use serde::Serialize;
use wgfence_common::{PeerEntry, RuleCounters, NO_RULES};

use super::report::ReportError;
use crate::{
    clock,
    dataplane::Dataplane,
    state::{self, DesiredState},
};

/// One rule of a policy the datapath counts: its counter, its policy id and its text.
/// `counter` is `None` for a rule past the last one with a trie entry of its own: no packet
/// can count for it, and the index its position gives may be the next block's.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct RuleRow {
    pub counter: Option<u32>,
    pub policy: u32,
    pub rule: String,
}

/// The counted rules of `desired`'s peers, by the entries the kernel holds for their
/// addresses (`entry`): each policy's rules, in canonical order, from its entries' counter
/// base. One row per rule of a counted policy (peers that share a policy share its rows), in
/// counter order; the rules past the policy's counted ones
/// ([`CompiledPolicy::counted_rules`](crate::policy::CompiledPolicy::counted_rules)) have no
/// counter.
pub fn rule_rows(
    desired: &DesiredState,
    entry: impl Fn(IpAddr) -> Option<PeerEntry>,
) -> Vec<RuleRow> {
    let mut rows = BTreeMap::new();
    for peer in &desired.peers {
        let (Some(rules), Some(policy)) = (&peer.rules, &peer.policy) else {
            continue;
        };
        let Some(e) = peer
            .addrs()
            .filter_map(&entry)
            .find(|e| e.rules != NO_RULES)
        else {
            continue;
        };
        let counted = policy.counted_rules();
        for (i, rule) in (0u32..).zip(rules.iter()) {
            rows.entry((e.rules, i)).or_insert_with(|| RuleRow {
                counter: (i < counted).then(|| e.rules.saturating_add(i)),
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
    /// The rule's index in the rule counters; `None` (null) for a rule no packet can count
    /// for (past the last rule with a trie entry of its own).
    pub counter: Option<u32>,
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
        // A rule without a counter is never hit.
        let (c, last) = match row.counter {
            Some(counter) => (
                maps.rule_counters(counter)?,
                maps.rule_last_hit(counter, now)?
                    .map(|ns| u64::try_from(clock::to_wall_secs(ns, offset)).unwrap_or_default()),
            ),
            None => (RuleCounters::default(), None),
        };
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A state of one restricted peer at 10.8.0.2 with `egress`.
    fn one_peer(egress: &str) -> DesiredState {
        state::parse(&format!(
            r#"{{"version": 1, "peers": [{{"name": "a",
                "publicKey": "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
                "address": "10.8.0.2", "egress": {egress}}}]}}"#
        ))
        .unwrap()
    }

    fn entry(base: u32) -> impl Fn(IpAddr) -> Option<PeerEntry> {
        move |_| {
            Some(PeerEntry {
                policy: 7,
                rules: base,
                ..PeerEntry::default()
            })
        }
    }

    #[test]
    fn each_counted_rule_has_its_own_counter_from_the_block_base() {
        let s = one_peer(
            r#"[{"cidr": "10.2.3.4/32", "protocol": "tcp", "ports": [80]},
                {"cidr": "10.9.0.0/16", "protocol": "udp"}]"#,
        );
        let rows = rule_rows(&s, entry(40));
        let counters: Vec<_> = rows.iter().map(|r| r.counter).collect();
        assert_eq!(counters, [Some(40), Some(41)]);
        assert!(rows.iter().all(|r| r.policy == 7));
    }

    /// A last rule that everything before it covers compiles to no trie entry: its position
    /// would be the first counter of the next policy's block, which must not be read as its.
    #[test]
    fn a_trailing_rule_without_an_entry_has_no_counter() {
        let s = one_peer(
            r#"[{"cidr": "10.0.0.0/8"},
                {"cidr": "10.2.0.0/16", "protocol": "tcp", "ports": [80]}]"#,
        );
        let policy = s.peers[0].policy.as_deref().unwrap();
        let rules = s.peers[0].rules.as_ref().unwrap();
        assert_eq!(rules.len(), 2);
        let counted = policy.counted_rules();
        assert!(counted < 2, "the covered rule has an entry of its own");
        let rows = rule_rows(&s, entry(40));
        assert_eq!(rows.len(), 2, "every rule is listed");
        for (i, row) in (0u32..).zip(&rows) {
            let want = (i < counted).then_some(40 + i);
            assert_eq!(row.counter, want, "{}", row.rule);
        }
    }

    /// Rules that differ only in what they carve out are distinct rules: their labels (the
    /// metric's `rule`, the rows of `status --rules`) differ too.
    #[test]
    fn rules_that_differ_only_in_except_are_named_apart() {
        let s = one_peer(
            r#"[{"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]},
                {"cidr": "10.0.0.0/8", "except": ["10.2.0.0/16", "10.3.0.0/16"]}]"#,
        );
        let rows = rule_rows(&s, entry(40));
        let names: Vec<&str> = rows.iter().map(|r| r.rule.as_str()).collect();
        assert_eq!(
            names,
            [
                "any 10.0.0.0/8 except 10.1.0.0/16",
                "any 10.0.0.0/8 except 10.2.0.0/16,10.3.0.0/16"
            ]
        );
    }
}
