//! Where each rule of a parsed state stands in its file (`peers[3].egress[1]`).
//!
//! The parser makes a peer's rules a canonical set (sorted, deduplicated, shared by peers with
//! equal sets), so positions are not kept there: they are recovered here by reading the file's
//! JSON again and parsing each raw rule alone, with the parser itself, into the canonical rule
//! it is equal to. Two raw rules equal after parsing are both named: the compiler merged them.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::{parse, DesiredState};
use crate::policy::Rule;

/// A rule's place in the state file.
pub type Location = String;

/// For each peer (by name): its index in the file, and for each of its canonical rules the
/// places of the raw rules that parse to it.
#[derive(Debug, Clone, Default)]
pub struct SourceMap {
    peers: BTreeMap<String, (usize, Vec<Vec<Location>>)>,
}

/// A key for parsing a lone rule; any valid one does.
const PROBE_KEY: &str = "AQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

/// The canonical rule a raw rule parses to, alone in a state of one peer.
fn parse_rule(raw: &Value) -> Option<Rule> {
    let text = json!({ "version": 1, "peers": [{ "name": "p", "publicKey": PROBE_KEY,
        "address": "192.0.2.1", "egress": [raw] }] })
    .to_string();
    let state = parse(&text).ok()?;
    let peer = state.peers.into_iter().next()?;
    peer.rules?.first().cloned()
}

impl SourceMap {
    /// The places of `state`'s rules in `text`, the file it was parsed from.
    pub fn new(text: &str, state: &DesiredState) -> Self {
        let mut map = SourceMap::default();
        let Ok(root) = serde_json::from_str::<Value>(text) else {
            return map;
        };
        let Some(peers) = root.get("peers").and_then(Value::as_array) else {
            return map;
        };
        let by_name: BTreeMap<&str, &crate::state::PeerSpec> =
            state.peers.iter().map(|p| (p.name.as_str(), p)).collect();
        for (i, raw) in peers.iter().enumerate() {
            let Some(name) = raw.get("name").and_then(Value::as_str) else {
                continue;
            };
            let Some(spec) = by_name.get(name) else {
                continue;
            };
            let rules = spec.rules.as_deref().map(Vec::as_slice).unwrap_or_default();
            let mut places = vec![Vec::new(); rules.len()];
            let raw_rules = raw.get("egress").and_then(Value::as_array);
            for (j, raw_rule) in raw_rules.into_iter().flatten().enumerate() {
                let Some(rule) = parse_rule(raw_rule) else {
                    continue;
                };
                if let Some(k) = rules.iter().position(|r| *r == rule) {
                    places[k].push(format!("peers[{i}].egress[{j}]"));
                }
            }
            map.peers.insert(name.to_owned(), (i, places));
        }
        map
    }

    /// The place of a peer in the file: `peers[3]`.
    pub fn peer(&self, name: &str) -> Option<String> {
        self.peers.get(name).map(|(i, _)| format!("peers[{i}]"))
    }

    /// The places of the raw rules that parse to the peer's canonical rule `rule`.
    pub fn rule(&self, name: &str, rule: usize) -> &[Location] {
        self.peers
            .get(name)
            .and_then(|(_, rules)| rules.get(rule))
            .map(Vec::as_slice)
            .unwrap_or_default()
    }

    /// The places of several canonical rules of a peer, in file order.
    pub fn rules(&self, name: &str, rules: &[usize]) -> Vec<Location> {
        let mut places: Vec<Location> = rules
            .iter()
            .flat_map(|k| self.rule(name, *k).iter().cloned())
            .collect();
        places.sort_by_key(|p| position(p));
        places.dedup();
        places
    }
}

/// (peer, rule) indexes of a place, for sorting in file order.
fn position(place: &str) -> (usize, usize) {
    let numbers: Vec<usize> = place
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .collect();
    (
        numbers.first().copied().unwrap_or_default(),
        numbers.get(1).copied().unwrap_or_default(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_every_raw_rule_a_canonical_rule_came_from() {
        let text = r#"{"version": 1, "peers": [
          {"name": "zed", "publicKey": "AgAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=", "address": "10.8.0.3"},
          {"name": "alice", "publicKey": "AQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=", "address": "10.8.0.2",
           "egress": [{"cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443]},
                      {"cidr": "0.0.0.0/0", "protocol": "icmp"},
                      {"protocol": "tcp", "ports": [443], "cidr": "10.0.0.0/8"}]}]}"#;
        let state = parse(text).unwrap();
        let map = SourceMap::new(text, &state);
        assert_eq!(map.peer("alice").as_deref(), Some("peers[1]"));
        let alice = state
            .peers
            .iter()
            .find(|p| p.name == "alice")
            .and_then(|p| p.rules.clone())
            .unwrap();
        let tcp = alice
            .iter()
            .position(|r| r.protocol == crate::policy::Protocol::Tcp)
            .unwrap();
        assert_eq!(
            map.rule("alice", tcp),
            ["peers[1].egress[0]", "peers[1].egress[2]"]
        );
    }
}
