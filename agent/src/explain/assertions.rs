//! Running the state file's policy tests ([`crate::state::policy_test`], which has their
//! syntax): each assertion is a packet from the peer's address (of the destination's family)
//! decided by the same evaluator `wgfence explain` gives its reason with, on the entries the
//! peer's rules compile to. A state whose tests fail is rejected whole, every failing assertion
//! named: `check`, `plan` and every apply of `run` parse through [`crate::state::parse`], which
//! runs them.

use std::collections::BTreeMap;

use wgfence_common::{Config, PeerEntry, UNRESTRICTED};

use super::{evaluate, source::SourceMap, AllowText, Explanation, NoFlows, Probe, View};
#[cfg(any(test, feature = "testing"))]
pub use crate::state::policy_test::to_json;
pub use crate::state::policy_test::{failed, parse_assertion, parse_tests, Assertion, PolicyTest};
use crate::{
    plan::ActualMaps,
    policy::sources as sources_of,
    state::{DesiredState, FieldError, PeerSpec},
};

/// The evaluator's answer for `assertion` sent by `peer`: the entries its rules compile to,
/// alone (policy id 1; 0 for an unrestricted peer), no flows. `Err`: the peer has no address
/// of the destination's family.
pub fn decide(peer: &PeerSpec, assertion: &Assertion) -> Result<(Probe, Explanation), String> {
    let Some(src) = peer
        .addrs()
        .find(|a| a.is_ipv4() == assertion.dst.is_ipv4())
    else {
        return Err(format!(
            "peer {:?} has no IPv{} address to send {} from",
            peer.name,
            if assertion.dst.is_ipv4() { 4 } else { 6 },
            assertion.text
        ));
    };
    let id = if peer.policy.is_some() {
        1
    } else {
        UNRESTRICTED
    };
    let maps = ActualMaps {
        peers: BTreeMap::from([(
            src,
            // Neither audit mode nor a window: a policy test asks what the rules allow.
            PeerEntry {
                policy: id,
                slot: 0,
                owner: 1,
                ..PeerEntry::default()
            },
        )]),
        policies: peer
            .policy
            .as_deref()
            .map(|p| BTreeMap::from([(id, p.clone())]))
            .unwrap_or_default(),
        owner_high: 1,
        ..ActualMaps::default()
    };
    let mut probe = Probe::new(src, assertion.dst, assertion.protocol, assertion.port);
    if let Some(t) = assertion.icmp_type {
        probe.icmp_type = t;
    }
    let view = View {
        maps: &maps,
        config: Config::default(),
        flows: NoFlows,
        now_ns: 0,
        boot_ns: None,
    };
    let e = evaluate(&view, &probe.seen());
    Ok((probe, e))
}

/// Every failing assertion of `state`'s tests, as validation errors naming the test, the
/// assertion and why (the entry that matched and the rules it came from, or the entries that
/// did not). `text` is the file the state was parsed from (for the rules' places).
pub fn failures(state: &DesiredState, text: &str) -> Vec<FieldError> {
    let mut errors = Vec::new();
    let mut sources: Option<SourceMap> = None;
    for (i, test) in state.tests.iter().enumerate() {
        let location = format!("tests[{i}] (peer {:?})", test.peer);
        let Some(peer) = state.peers.iter().find(|p| p.name == test.peer) else {
            errors.push(FieldError {
                location,
                field: "peer".into(),
                message: format!("no peer named {:?} in the state", test.peer),
            });
            continue;
        };
        for (field, list, want_pass) in
            [("accept", &test.accept, true), ("deny", &test.deny, false)]
        {
            for (j, assertion) in list.iter().enumerate() {
                let field = format!("{field}[{j}]");
                let (_, e) = match decide(peer, assertion) {
                    Ok(decided) => decided,
                    Err(message) => {
                        errors.push(FieldError {
                            location: location.clone(),
                            field,
                            message,
                        });
                        continue;
                    }
                };
                if e.passed() == want_pass {
                    continue;
                }
                let sources = sources.get_or_insert_with(|| SourceMap::new(text, state));
                errors.push(FieldError {
                    location: location.clone(),
                    field,
                    message: format!(
                        "{} {}: {}",
                        assertion.text,
                        if e.passed() {
                            "passes, expected dropped"
                        } else {
                            "is dropped, expected to pass"
                        },
                        reason(peer, assertion, &e, sources)
                    ),
                });
            }
        }
    }
    errors
}

/// Why the evaluator decided as it did, with the rules' places.
fn reason(peer: &PeerSpec, a: &Assertion, e: &Explanation, sources: &SourceMap) -> String {
    let rules = peer.rules.as_deref().map(Vec::as_slice).unwrap_or_default();
    let from = |allow: &wgfence_common::Allow| {
        let places = sources.rules(&peer.name, &sources_of(rules, a.dst, allow));
        if places.is_empty() {
            String::new()
        } else {
            format!(" from {}", places.join(", "))
        }
    };
    match (e.peer, e.prefix, e.matched) {
        (Some(p), _, _) if p.policy == UNRESTRICTED => {
            "the peer is unrestricted (no egress)".to_owned()
        }
        (_, Some(prefix), Some(m)) => {
            format!("trie entry {prefix} allows {}{}", AllowText(m), from(&m))
        }
        (_, Some(prefix), None) => format!(
            "trie entry {prefix} has no match among [{}]",
            e.allows
                .iter()
                .map(|x| AllowText(*x).to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        _ => "no rule covers the destination".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::parse;

    const KEY: &str = "AQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

    fn text(tests: &str) -> String {
        format!(
            r#"{{"version": 1, "peers": [
            {{"name": "alice", "publicKey": "{KEY}", "address": "10.8.0.2",
              "egress": [{{"cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443]}},
                         {{"cidr": "192.0.2.0/24", "protocol": "icmp"}}]}}],
            "tests": {tests}}}"#
        )
    }

    #[test]
    fn a_state_whose_tests_pass_is_accepted_and_keeps_them() {
        let t = text(
            r#"[{"peer": "alice", "accept": ["10.2.3.4:443/tcp", "192.0.2.1/icmp"],
                 "deny": ["10.2.3.4:22/tcp", "192.0.3.1/icmp"]}]"#,
        );
        let state = parse(&t).unwrap();
        assert_eq!(state.tests.len(), 1);
        let again = parse(&state.to_canonical_json()).unwrap();
        assert_eq!(again, state);
    }

    #[test]
    fn every_failing_assertion_is_named_with_its_reason() {
        let t = text(
            r#"[{"peer": "alice", "accept": ["10.2.3.4:22/tcp", "10.2.3.4:443/tcp"],
                 "deny": ["10.2.3.4:443/tcp", "[fd00::1]:53/udp"]},
                {"peer": "bob", "deny": ["10.2.3.4:443/tcp"]}]"#,
        );
        let e = parse(&t).expect_err("accepted");
        let lines: Vec<String> = e.errors.iter().map(ToString::to_string).collect();
        assert_eq!(lines.len(), 4, "{lines:#?}");
        assert!(
            lines[0].contains("accept[0]") && lines[0].contains("has no match among [tcp 443]")
        );
        assert!(
            lines[1].contains("deny[0]")
                && lines[1].contains("allows tcp 443 from peers[0].egress[0]"),
            "{lines:#?}"
        );
        assert!(lines[2].contains("deny[1]") && lines[2].contains("no IPv6 address"));
        assert!(lines[3].contains("no peer named \"bob\""));
        assert_eq!(failed(&e).len(), 3);
    }

    #[test]
    fn malformed_tests_are_validation_errors() {
        for tests in [
            r#"{}"#,
            r#"[{"peer": "alice"}]"#,
            r#"[{"peer": "alice", "accept": ["10.2.3.4/tcp"]}]"#,
            r#"[{"peer": "alice", "accept": [], "extra": 1}]"#,
        ] {
            assert!(parse(&text(tests)).is_err(), "{tests} accepted");
        }
    }
}
