//! The replies scenario of `cargo xtask bench`: what reply flows and drop events cost the datapath, per
//! packet under `BPF_PROG_TEST_RUN`, and the event rate a flood of denied packets produces.

use std::time::{Duration, Instant};

use serde_json::json;
use wgfence::{
    dataplane::TestProgram,
    plan::{plan, Actual},
    settings::{online_cpus, DatapathSettings},
    state::DesiredState,
    testing::apply_map_op,
};
use wgfence_common::{Counter, Variant, PROTO_ICMP, PROTO_TCP, PROTO_UDP, VARIANT_ETHERNET};

use super::{
    gen, median, parse_value, progress,
    report::{f, Report},
    Config,
};
use crate::packet::{Packet, TCP, TCP_ACK, TCP_SYN, UDP};

/// The address the network's packets come from: one no generated policy allows UDP to.
const NODE: &str = "192.0.2.250";
const REPEAT: u32 = 1_000_000;

/// `variant` loaded with private maps holding `desired`, written as the reconciler writes them.
pub fn loaded_variant(desired: &DesiredState, variant: Variant) -> TestProgram {
    let mut program = TestProgram::load_variant(variant).unwrap();
    for op in plan(desired, &Actual::default()).unwrap().ops {
        apply_map_op(program.maps_mut(), &op).unwrap_or_else(|e| panic!("{op}: {e}"));
    }
    program
}

fn loaded(desired: &DesiredState) -> TestProgram {
    loaded_variant(desired, VARIANT_ETHERNET)
}

/// The datapath's settings as the agent writes them: reply flows on or off, drop events at
/// `events_per_second` node-wide (0: off).
pub fn configure(program: &mut TestProgram, replies: bool, events_per_second: u32) {
    let settings = DatapathSettings {
        events_per_second,
        ..DatapathSettings::default()
    };
    program
        .maps_mut()
        .set_config(&settings.config(replies, online_cpus()))
        .unwrap();
}

/// One row: a packet run through one program with the datapath configured so.
struct Case<'a> {
    label: &'static str,
    key: &'static str,
    egress: bool,
    frame: &'a [u8],
    passes: bool,
    replies: bool,
    events: u32,
}

impl<'a> Case<'a> {
    const fn new(
        label: &'static str,
        key: &'static str,
        egress: bool,
        frame: &'a [u8],
        passes: bool,
        replies: bool,
        events: u32,
    ) -> Self {
        Self {
            label,
            key,
            egress,
            frame,
            passes,
            replies,
            events,
        }
    }
}

/// Rounds of every case.
const ROUNDS: usize = 5;

/// The kernel's average over one run of `REPEAT`, asserting the verdict.
fn once(program: &mut TestProgram, egress: bool, frame: &[u8], passes: bool) -> Duration {
    let run = if egress {
        program.run_egress(frame, REPEAT)
    } else {
        program.run_repeat(frame, REPEAT)
    }
    .unwrap();
    assert_eq!(run.passed(), passes, "unexpected verdict");
    Duration::from_nanos(u64::from(run.duration_ns))
}

fn measure(report: &mut Report, command: &str, desired: &DesiredState) {
    let restricted = desired
        .peers
        .iter()
        .rev()
        .find(|p| {
            p.address.is_some()
                && p.policy.as_ref().is_some_and(|c| {
                    !c.permits(
                        NODE.parse().unwrap_or_else(|_| unreachable!()),
                        PROTO_UDP,
                        Some(40000),
                    )
                })
        })
        .unwrap_or_else(|| panic!("no restricted peer that denies UDP to {NODE}"));
    let open = desired
        .peers
        .iter()
        .rev()
        .find(|p| p.policy.is_none() && p.address.is_some())
        .expect("no unrestricted peer");
    let peer = restricted
        .address
        .map(|a| a.to_string())
        .unwrap_or_default();
    let open = open.address.map(|a| a.to_string()).unwrap_or_default();

    let to_peer_udp = Packet::new(NODE, &peer, UDP, 161).src_port(40000).frame();
    let to_peer_syn = Packet::new(NODE, &peer, TCP, 22)
        .src_port(40001)
        .tcp_flags(TCP_SYN)
        .frame();
    let to_peer_ack = Packet::new(NODE, &peer, TCP, 22)
        .src_port(40001)
        .tcp_flags(TCP_ACK)
        .frame();
    let to_open = Packet::new(NODE, &open, UDP, 161).frame();
    let reply = Packet::new(&peer, NODE, UDP, 40000).src_port(161).frame();
    let denied = Packet::new(&peer, NODE, UDP, 9).src_port(161).frame();
    // Allowed: the policy's first IPv4 entry, with its first allow's protocol and port.
    let allowed = restricted
        .policy
        .as_ref()
        .and_then(|c| {
            c.entries()
                .find(|(n, _)| n.addr().is_ipv4())
                .map(|(n, a)| (n.addr(), a[0]))
        })
        .map(|(dst, allow)| {
            let protocol = match allow.protocol {
                PROTO_TCP | PROTO_UDP | PROTO_ICMP => allow.protocol,
                _ => TCP,
            };
            Packet::new(&peer, &dst.to_string(), protocol, allow.port_lo).frame()
        })
        .expect("no IPv4 entry in the restricted peer's policy");

    // The egress UDP row records the flow the reply rows answer.
    let cases: [Case<'_>; 12] = [
        Case::new(
            "egress, replies off (the switch only)",
            "egress_off",
            true,
            &to_peer_udp,
            true,
            false,
            0,
        ),
        Case::new(
            "egress, to an unrestricted peer",
            "egress_unrestricted",
            true,
            &to_open,
            true,
            true,
            0,
        ),
        Case::new(
            "egress, UDP to a restricted peer (records, then refreshes, the flow)",
            "egress_refresh_udp",
            true,
            &to_peer_udp,
            true,
            true,
            0,
        ),
        Case::new(
            "egress, TCP SYN to a restricted peer (records, then refreshes, the flow)",
            "egress_record",
            true,
            &to_peer_syn,
            true,
            true,
            0,
        ),
        Case::new(
            "egress, TCP ACK of that flow (refreshes it)",
            "egress_refresh_tcp",
            true,
            &to_peer_ack,
            true,
            true,
            0,
        ),
        Case::new(
            "ingress, allowed, replies and events off",
            "ingress_allowed",
            false,
            &allowed,
            true,
            false,
            0,
        ),
        Case::new(
            "ingress, allowed, replies and events on",
            "ingress_allowed_on",
            false,
            &allowed,
            true,
            true,
            1000,
        ),
        Case::new(
            "ingress, denied, replies and events off",
            "ingress_denied",
            false,
            &denied,
            false,
            false,
            0,
        ),
        Case::new(
            "ingress, denied (no flow), replies on",
            "ingress_denied_replies",
            false,
            &denied,
            false,
            true,
            0,
        ),
        Case::new(
            "ingress, denied, replies and drop events on (rate-limited)",
            "ingress_denied_events",
            false,
            &denied,
            false,
            true,
            1000,
        ),
        Case::new(
            "ingress, the peer's reply on the UDP flow",
            "ingress_reply",
            false,
            &reply,
            true,
            true,
            0,
        ),
        Case::new(
            "ingress, the peer's reply, drop events on",
            "ingress_reply_events",
            false,
            &reply,
            true,
            true,
            1000,
        ),
    ];
    let mut program = loaded(desired);
    // Every case once per round, ROUNDS rounds: drift on this shared machine hits all alike.
    let mut samples = vec![Vec::new(); cases.len()];
    for _ in 0..ROUNDS {
        for (i, c) in cases.iter().enumerate() {
            configure(&mut program, c.replies, c.events);
            samples[i].push(once(&mut program, c.egress, c.frame, c.passes));
        }
    }
    let mut rows = Vec::new();
    let mut results = serde_json::Map::new();
    for (c, runs) in cases.iter().zip(&samples) {
        let ns = median(runs).as_nanos() as f64;
        rows.push(vec![c.label.to_owned(), f(ns, 0)]);
        results.insert(c.key.into(), json!(ns));
    }

    // A flood: denied packets for 3 s, events at 1,000/s node-wide.
    configure(&mut program, true, 1000);
    let before = program.maps().counters().unwrap();
    let start = Instant::now();
    let mut flooded = 0u64;
    while start.elapsed() < Duration::from_secs(3) {
        program.run_repeat(&denied, 100_000).unwrap();
        flooded += 100_000;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let after = program.maps().counters().unwrap();
    let delta = |c: Counter| after.get(c) - before.get(c);
    let admitted = delta(Counter::EventSent) + delta(Counter::EventRingFull);
    let cpus = online_cpus();
    results.insert(
        "flood".into(),
        json!({ "packets": flooded, "seconds": elapsed, "admitted": admitted,
                "rate_limited": delta(Counter::EventRateLimited), "cpus": cpus }),
    );

    report.section(
        "Reply flows and drop events",
        &format!(
            "ns per packet under `BPF_PROG_TEST_RUN` (repeat {REPEAT}; the median of {ROUNDS} \
             rounds, each running every row once in turn, so drift hits all rows alike), with the \
             maps of the 10,000-peer state; packets between a restricted peer and {NODE}, which \
             its policy does not allow. Egress is the program on packets toward peers; the \
             ingress rows compare with the per-packet section (same harness overhead). Command: `{command}`."
        ),
    );
    report.table(&["packet", "ns"], &rows);
    report.paragraph(&format!(
        "Allowed traffic never reaches the flow table or the event code: both run only after \
         the policy denies a packet (compare the two allowed rows). A flood of {flooded} denied \
         packets in {elapsed:.1} s admitted {admitted} drop events ({:.0}/s; the ring buffer had \
         no reader, so events past its size counted as ring_full); {} were rate-limited. The \
         configured 1,000/s node-wide gives each of the {cpus} CPUs an equal share and at most \
         one saved-up second, so the node never exceeds {:.0} events in {elapsed:.1} s; the \
         flooding thread ran on whichever CPU the scheduler gave it, so it used more than one \
         CPU's share.",
        admitted as f64 / elapsed,
        delta(Counter::EventRateLimited),
        1000.0 * (elapsed + 1.0),
    ));
    report.record("replies_and_events", serde_json::Value::Object(results));
}

pub fn run(report: &mut Report, config: &Config) {
    progress("reply flows and drop events");
    let (_, desired) = parse_value(&gen::state(10_000, 1));
    measure(report, &config.command, &desired);
}
