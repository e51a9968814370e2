//! Why a packet passes or is dropped: `wgfence explain` on the one evaluator of the datapath's
//! verdict (`crate::verdict`, re-exported here) over compiled map entries (the kernel's, read
//! back from the pins, or those a state file compiles to: [`compiled_maps`]), with the reason —
//! the peer entry, the policy id, the matching trie prefix, the allow entry that matched or
//! those that did not, the state-file rules each came from ([`source`]) — and whether a reply
//! flow lets a denied packet pass.
//!
//! The same evaluator answers `wgfence explain` (beside the kernel's own verdict, see
//! [`kernel`]) and the policy tests of a state file ([`assertions`], which the state's parse
//! runs); the differential test checks it against the loaded program on the whole generated
//! corpus.

pub mod kernel;
pub mod report;

/// The state's policy tests, run on the evaluator (see [`crate::state::assertions`]).
pub use crate::state::assertions;
/// Where each rule of a parsed state stands in its file (see [`crate::state::source_map`]).
pub use crate::state::source_map as source;

use std::{collections::BTreeMap, net::IpAddr};

use wgfence_common::Config;

pub use crate::verdict::*;
use crate::{
    plan::{plan, Actual, ActualMaps, PlanError},
    state::DesiredState,
};

/// The entries `state` compiles to, with the policy ids and slots a fresh agent would give
/// them: the planner's own operations applied to an empty model of the kernel.
pub fn compiled_maps(state: &DesiredState) -> Result<ActualMaps, PlanError> {
    let mut model = Actual::default();
    for op in &plan(state, &model).map_err(|u| u.error)?.ops {
        model.apply(op);
    }
    Ok(model.maps().clone())
}

/// The datapath settings a state implies for the evaluator (replies on or off).
pub fn state_config(state: &DesiredState) -> Config {
    Config {
        flags: if state.replies {
            wgfence_common::CONFIG_REPLIES
        } else {
            0
        },
        ..Config::default()
    }
}

/// Peers by address and name, from a state.
pub fn peers_by_addr(state: &DesiredState) -> BTreeMap<IpAddr, &crate::state::PeerSpec> {
    state
        .peers
        .iter()
        .flat_map(|p| p.addrs().map(move |a| (a, p)))
        .collect()
}

#[cfg(test)]
mod tests {
    use wgfence_common::{Allow, Counter, FlowValue, PROTO_ANY, PROTO_ICMP, PROTO_TCP, PROTO_UDP};

    use super::*;
    use crate::state::parse;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    const KEY: &str = "AQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
    const KEY2: &str = "AgAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

    fn state() -> DesiredState {
        let text = format!(
            r#"{{"version": 1, "peers": [
            {{"name": "alice", "publicKey": "{KEY}", "address": "10.8.0.2", "addressV6": "fd00:8::2",
              "egress": [{{"cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443, "8000-8100"]}},
                         {{"cidr": "10.1.0.0/16", "protocol": "udp", "ports": [53]}},
                         {{"cidr": "0.0.0.0/0", "protocol": "icmp"}}]}},
            {{"name": "bob", "publicKey": "{KEY2}", "address": "10.8.0.3"}}]}}"#
        );
        parse(&text).unwrap()
    }

    fn explain(maps: &ActualMaps, probe: Probe) -> Explanation {
        let view = View {
            maps,
            config: Config::default(),
            flows: NoFlows,
            now_ns: 0,
            boot_ns: None,
        };
        evaluate(&view, &probe.seen())
    }

    #[test]
    fn names_the_prefix_and_the_entry_that_matched_or_those_that_did_not() {
        let state = state();
        let maps = compiled_maps(&state).unwrap();
        let e = explain(
            &maps,
            Probe::new(ip("10.8.0.2"), ip("10.1.2.3"), PROTO_UDP, 53),
        );
        assert_eq!(e.verdict, Counter::PassPolicy);
        assert_eq!(e.prefix, Some("10.1.0.0/16".parse().unwrap()));
        // Credited to its rule: the third in canonical order (icmp 0.0.0.0/0, tcp 10/8, udp).
        assert_eq!(
            e.matched,
            Some(Allow {
                rule: 2,
                ..Allow::new(PROTO_UDP, 53, 53)
            })
        );
        let e = explain(
            &maps,
            Probe::new(ip("10.8.0.2"), ip("10.1.2.3"), PROTO_TCP, 22),
        );
        assert_eq!(e.verdict, Counter::DropPolicy);
        assert_eq!(e.matched, None);
        assert_eq!(e.allows.len(), 4, "{:?}", e.allows);
        // Unrestricted, unknown, and no entry at all (IPv6 has no rule).
        let e = explain(&maps, Probe::new(ip("10.8.0.3"), ip("1.1.1.1"), 6, 1));
        assert_eq!(e.verdict, Counter::PassUnrestricted);
        let e = explain(&maps, Probe::new(ip("10.8.0.9"), ip("1.1.1.1"), 6, 1));
        assert_eq!((e.verdict, e.peer), (Counter::DropUnknownSource, None));
        let e = explain(&maps, Probe::new(ip("fd00:8::2"), ip("fd00::1"), 6, 443));
        assert_eq!((e.verdict, e.prefix), (Counter::DropPolicy, None));
    }

    #[test]
    fn a_later_fragment_matches_only_entries_without_ports() {
        let maps = compiled_maps(&state()).unwrap();
        let mut probe = Probe::new(ip("10.8.0.2"), ip("10.1.2.3"), PROTO_ICMP, 0);
        probe.later_fragment = true;
        assert_eq!(explain(&maps, probe).verdict, Counter::PassPolicy);
        let mut probe = Probe::new(ip("10.8.0.2"), ip("10.1.2.3"), PROTO_TCP, 443);
        probe.later_fragment = true;
        let e = explain(&maps, probe);
        assert_eq!((e.verdict, e.reply), (Counter::DropPolicy, Reply::Off));
    }

    #[test]
    fn a_denied_packet_passes_on_a_live_flow_of_its_owner_only() {
        let maps = compiled_maps(&state()).unwrap();
        let owner = maps.peers.get(&ip("10.8.0.2")).map(|e| e.owner).unwrap();
        let config = Config {
            flags: wgfence_common::CONFIG_REPLIES,
            tcp_timeout_ns: 100,
            unanswered_timeout_ns: 100,
            ..Config::default()
        };
        let probe = Probe::new(ip("10.8.0.2"), ip("192.0.2.1"), PROTO_TCP, 5000);
        let outcome = |owner: u64, last_seen_ns: u64| {
            let flows = move |key: &ReplyKey| {
                (key.peer_port == DEFAULT_SRC_PORT && key.remote_port == 5000).then_some(
                    FlowValue {
                        last_seen_ns,
                        owner,
                        state: wgfence_common::FLOW_OPEN,
                        slot: 0,
                    },
                )
            };
            let view = View {
                maps: &maps,
                config,
                flows,
                now_ns: 150,
                boot_ns: None,
            };
            let e = evaluate(&view, &probe.seen());
            (e.verdict, e.reply)
        };
        assert!(matches!(
            outcome(owner, 100),
            (Counter::PassReply, Reply::Live { idle_ns: 50, .. })
        ));
        assert!(matches!(
            outcome(owner, 10),
            (Counter::DropPolicy, Reply::Expired { .. })
        ));
        assert!(matches!(
            outcome(owner + 1, 100),
            (Counter::DropPolicy, Reply::OtherOwner { .. })
        ));
    }

    #[test]
    fn allow_text() {
        assert_eq!(
            AllowText(Allow::new(PROTO_TCP, 443, 443)).to_string(),
            "tcp 443"
        );
        assert_eq!(
            AllowText(Allow::new(PROTO_UDP, 1, 2)).to_string(),
            "udp 1-2"
        );
        assert_eq!(
            AllowText(Allow::new(PROTO_ANY, 0, u16::MAX)).to_string(),
            "any"
        );
    }
}
