//! Policy tests in the state file: `"tests": [{"peer": "alice", "accept": ["10.2.3.4:443/tcp",
//! "192.0.2.1/icmp"], "deny": ["10.2.3.4:22/tcp", "[fd00::1]:53/udp"]}]`. The state's parsers
//! read the field with the rest of the file ([`parse_tests`]) and the canonical state file
//! writes it (`to_json`). Each assertion is a packet from the peer's address (of the
//! destination's family) decided by the same evaluator `wgfence explain` gives its reason with
//! (`crate::verdict`), on the entries the peer's rules compile to ([`decide`]). A state whose
//! tests fail is rejected whole, every failing assertion named ([`failures`]): `check`, `plan`
//! and every apply of `run` parse through [`crate::state::parse`], which runs them; [`failed`]
//! picks those out of a rejection.
//!
//! Assertion syntax: `ADDR[:PORT]/PROTO`, where ADDR is an IPv4 address or an IPv6 address
//! (in brackets when a port follows), PORT is required for `tcp` and `udp` and not allowed
//! otherwise, and PROTO is `tcp`, `udp`, `icmp` (ICMPv6 toward an IPv6 address; `icmp:TYPE`
//! for another type than echo request) or an IP protocol number. Replies are not considered:
//! an assertion is a packet the peer starts.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv6Addr},
};

use serde_json::Value;
use wgfence_common::{Config, PeerEntry, PROTO_ICMP, PROTO_TCP, PROTO_UDP, UNRESTRICTED};

use super::{source_map::SourceMap, DesiredState, FieldError, PeerSpec, StateError};
use crate::{
    actual_maps::ActualMaps,
    policy::sources as sources_of,
    verdict::{evaluate, AllowText, Explanation, NoFlows, Probe, View},
};

/// One packet a test expects to pass or to be dropped.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Assertion {
    /// As written in the state file (the canonical form keeps it).
    pub text: String,
    pub dst: IpAddr,
    pub protocol: u8,
    pub port: u16,
    pub icmp_type: Option<u8>,
}

/// One entry of `tests`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PolicyTest {
    pub peer: String,
    pub accept: Vec<Assertion>,
    pub deny: Vec<Assertion>,
}

/// Parses one assertion.
pub fn parse_assertion(text: &str) -> Result<Assertion, String> {
    let bad = |why: &str| {
        format!(
            "{text:?}: {why} (write ADDR[:PORT]/PROTO, e.g. 10.2.3.4:443/tcp, [fd00::1]:53/udp, \
             192.0.2.1/icmp)"
        )
    };
    let (target, proto) = text.rsplit_once('/').ok_or_else(|| bad("no /PROTO"))?;
    let (dst, port): (IpAddr, Option<&str>) = if let Some(rest) = target.strip_prefix('[') {
        let (addr, after) = rest.split_once(']').ok_or_else(|| bad("no closing ]"))?;
        let addr: Ipv6Addr = addr.parse().map_err(|_| bad("not an IPv6 address"))?;
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':').ok_or_else(|| bad("junk after ]"))?),
        };
        (IpAddr::V6(addr), port)
    } else if let Ok(addr) = target.parse::<IpAddr>() {
        (addr, None)
    } else {
        let (addr, port) = target
            .rsplit_once(':')
            .ok_or_else(|| bad("not an address"))?;
        let addr: std::net::Ipv4Addr = addr
            .parse()
            .map_err(|_| bad("not an address (an IPv6 address with a port goes in brackets)"))?;
        (IpAddr::V4(addr), Some(port))
    };
    let (name, icmp_type) = match proto.split_once(':') {
        Some((name, t)) => (
            name,
            Some(
                t.parse::<u8>()
                    .map_err(|_| bad("not an ICMP type (0-255)"))?,
            ),
        ),
        None => (proto, None),
    };
    let protocol = match name {
        "tcp" => PROTO_TCP,
        "udp" => PROTO_UDP,
        "icmp" => PROTO_ICMP,
        n => n
            .parse::<u8>()
            .map_err(|_| bad("PROTO is tcp, udp, icmp or a protocol number"))?,
    };
    if icmp_type.is_some() && protocol != PROTO_ICMP {
        return Err(bad("a :TYPE only goes with icmp"));
    }
    let ports = protocol == PROTO_TCP || protocol == PROTO_UDP;
    let port = match (port, ports) {
        (Some(p), true) => p
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| bad("not a port (1-65535)"))?,
        (None, true) => return Err(bad("tcp and udp need a :PORT")),
        (Some(_), false) => return Err(bad("only tcp and udp take a :PORT")),
        (None, false) => 0,
    };
    Ok(Assertion {
        text: text.to_owned(),
        dst,
        protocol,
        port,
        icmp_type,
    })
}

/// Parses `tests` (the value of the top-level field); errors as (field, message).
pub fn parse_tests(raw: &Value) -> Result<Vec<PolicyTest>, Vec<(String, String)>> {
    let mut errors = Vec::new();
    let Value::Array(list) = raw else {
        return Err(vec![(
            "tests".into(),
            "must be an array of {peer, accept, deny}".into(),
        )]);
    };
    let mut tests = Vec::with_capacity(list.len());
    for (i, raw) in list.iter().enumerate() {
        let at = format!("tests[{i}]");
        let Value::Object(obj) = raw else {
            errors.push((at, "must be an object with peer, accept and deny".into()));
            continue;
        };
        for key in obj.keys() {
            if !matches!(key.as_str(), "peer" | "accept" | "deny") {
                errors.push((format!("{at}.{key}"), "unknown field".into()));
            }
        }
        let peer = match obj.get("peer") {
            Some(Value::String(p)) if !p.is_empty() => p.clone(),
            _ => {
                errors.push((format!("{at}.peer"), "must be a peer's name".into()));
                String::new()
            }
        };
        let mut list_of = |field: &str| -> Vec<Assertion> {
            match obj.get(field) {
                None => Vec::new(),
                Some(Value::Array(items)) => items
                    .iter()
                    .enumerate()
                    .filter_map(|(j, item)| {
                        let parsed = match item {
                            Value::String(s) => parse_assertion(s),
                            _ => Err("must be a string like 10.2.3.4:443/tcp".into()),
                        };
                        parsed
                            .map_err(|e| errors.push((format!("{at}.{field}[{j}]"), e)))
                            .ok()
                    })
                    .collect(),
                Some(_) => {
                    errors.push((format!("{at}.{field}"), "must be an array".into()));
                    Vec::new()
                }
            }
        };
        let accept = list_of("accept");
        let deny = list_of("deny");
        if obj.get("accept").is_none() && obj.get("deny").is_none() {
            errors.push((at.clone(), "has neither accept nor deny".into()));
        }
        tests.push(PolicyTest { peer, accept, deny });
    }
    if errors.is_empty() {
        Ok(tests)
    } else {
        Err(errors)
    }
}

/// A test as the canonical state file writes it.
#[cfg(any(test, feature = "testing"))]
pub fn to_json(test: &PolicyTest) -> Value {
    let texts = |a: &[Assertion]| a.iter().map(|a| Value::from(a.text.clone())).collect();
    let mut obj = serde_json::Map::new();
    obj.insert("peer".into(), test.peer.clone().into());
    if !test.accept.is_empty() {
        obj.insert("accept".into(), Value::Array(texts(&test.accept)));
    }
    if !test.deny.is_empty() {
        obj.insert("deny".into(), Value::Array(texts(&test.deny)));
    }
    Value::Object(obj)
}

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
            .as_ref()
            .map(|p| BTreeMap::from([(id, std::sync::Arc::clone(p))]))
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

/// The failing assertions in a rejection, one line each (for `/readyz`).
pub fn failed(error: &StateError) -> Vec<String> {
    error
        .errors
        .iter()
        .filter(|e| e.location.starts_with("tests[") && e.field.contains('['))
        .map(|e| format!("{} {}: {}", e.location, e.field, e.message))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::parse;

    #[test]
    fn assertions_parse_in_every_form() {
        let a = parse_assertion("10.2.3.4:443/tcp").unwrap();
        assert_eq!((a.protocol, a.port), (PROTO_TCP, 443));
        let a = parse_assertion("[fd00::1]:53/udp").unwrap();
        assert_eq!((a.dst.is_ipv6(), a.port), (true, 53));
        let a = parse_assertion("fd00::1/icmp").unwrap();
        assert_eq!((a.protocol, a.icmp_type), (PROTO_ICMP, None));
        let a = parse_assertion("192.0.2.1/icmp:0").unwrap();
        assert_eq!(a.icmp_type, Some(0));
        assert_eq!(parse_assertion("192.0.2.1/47").map(|a| a.protocol), Ok(47));
        for bad in [
            "10.2.3.4/tcp",
            "10.2.3.4:0/tcp",
            "10.2.3.4:22/icmp",
            "fd00::1:53/udp",
            "10.2.3.4:22",
            "10.2.3.4:22/sctp",
            "10.2.3.4:22/tcp:3",
        ] {
            assert!(parse_assertion(bad).is_err(), "{bad} parsed");
        }
    }

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
