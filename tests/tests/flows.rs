//! Reply flows of the loaded datapath, under `BPF_PROG_TEST_RUN`: the egress program records
//! what the network starts toward a restricted peer, the ingress program lets the peer's replies
//! through its policy, and nothing the peer sends can open a flow. Both programs share the
//! maps, as they do on an interface.

use std::{thread, time::Duration};

use wgfence::{
    dataplane::{Flow, TestProgram},
    policy::{PortRange, Protocol, Rule},
    settings::DatapathSettings,
};
use wgfence_common::{Counter, FlowValue, PeerEntry, MAX_FLOWS, UNRESTRICTED};

/// The restricted peer's entry owner (any value: the agent allocates them).
const OWNER: u64 = 40;
use wgfence_tests::{
    install_policy, ip, net,
    packet::{Packet, ICMP, ICMPV6, TCP, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN, UDP},
    require_root,
};

/// The restricted peer; its policy allows only TCP 443 to 10.0.0.0/8 and fd00:1::/32, and
/// UDP 53 to 10.0.0.0/8.
const PEER_V4: &str = "10.8.0.2";
const PEER_V6: &str = "fd00:8::2";
/// An unrestricted peer.
const OPEN_V4: &str = "10.8.0.3";
/// The node, which the policy does not allow.
const NODE_V4: &str = "192.168.77.1";
const NODE_V6: &str = "fd77::1";
const SLOT: u32 = 4;

fn program(settings: DatapathSettings, replies: bool) -> TestProgram {
    require_root();
    let mut program = TestProgram::load()
        .unwrap_or_else(|e| panic!("loading the datapath: {}", wgfence::error_chain(&e)));
    let maps = program.maps_mut();
    install_policy(
        maps,
        1,
        &[
            Rule::new(
                net("10.0.0.0/8"),
                Protocol::Tcp,
                vec![PortRange::single(443)],
            ),
            Rule::new(
                net("10.0.0.0/8"),
                Protocol::Udp,
                vec![PortRange::single(53)],
            ),
            Rule::new(
                net("fd00:1::/32"),
                Protocol::Tcp,
                vec![PortRange::single(443)],
            ),
        ],
    );
    for addr in [PEER_V4, PEER_V6] {
        maps.upsert_peer(
            ip(addr),
            PeerEntry {
                policy: 1,
                slot: SLOT,
                owner: OWNER,
                ..PeerEntry::default()
            },
        )
        .unwrap();
    }
    maps.upsert_peer(
        ip(OPEN_V4),
        PeerEntry {
            policy: UNRESTRICTED,
            slot: 5,
            owner: OWNER + 1,
            ..PeerEntry::default()
        },
    )
    .unwrap();
    maps.set_config(&settings.config(replies, 1)).unwrap();
    program
}

fn default_program() -> TestProgram {
    program(DatapathSettings::default(), true)
}

/// Sends `packet` toward the peer (egress).
#[track_caller]
fn to_peer(p: &mut TestProgram, packet: &Packet) {
    let run = p.run_egress(&packet.frame(), 1).expect("egress test run");
    assert!(
        run.passed(),
        "the egress program never drops: {}",
        run.retval
    );
}

/// Runs the peer's `packet` (ingress) and asserts which verdict counter it got.
#[track_caller]
fn from_peer(p: &mut TestProgram, packet: &Packet, expected: Counter) {
    let before = p.maps().counters().unwrap();
    let run = p.run(&packet.frame()).expect("ingress test run");
    let after = p.maps().counters().unwrap();
    let got: Vec<Counter> = Counter::ALL
        .into_iter()
        .filter(|c| after.get(*c) > before.get(*c))
        .collect();
    assert_eq!(got, vec![expected], "{packet:?}");
    assert_eq!(run.passed(), expected.is_pass());
}

fn recorded(p: &TestProgram) -> u64 {
    counted(p, Counter::FlowRecorded)
}

fn counted(p: &TestProgram, counter: Counter) -> u64 {
    p.maps().counters().map(|c| c.get(counter)).unwrap()
}

#[test]
fn replies_to_flows_the_network_started_pass_for_both_families() {
    for (peer, node, icmp, echo_reply) in
        [(PEER_V4, NODE_V4, ICMP, 0), (PEER_V6, NODE_V6, ICMPV6, 129)]
    {
        let mut p = default_program();
        // The peer's answers, before the network started anything: denied by its policy.
        let syn_ack = Packet::new(peer, node, TCP, 51000)
            .src_port(22)
            .tcp_flags(TCP_SYN | TCP_ACK);
        let udp_answer = Packet::new(peer, node, UDP, 52000).src_port(161);
        let echo_answer = Packet::new(peer, node, icmp, 0).icmp(echo_reply, 77);
        for answer in [&syn_ack, &udp_answer, &echo_answer] {
            from_peer(&mut p, answer, Counter::DropPolicy);
        }

        // The node opens SSH, queries SNMP and pings.
        to_peer(&mut p, &Packet::new(node, peer, TCP, 22).src_port(51000));
        to_peer(&mut p, &Packet::new(node, peer, UDP, 161).src_port(52000));
        to_peer(
            &mut p,
            &Packet::new(node, peer, icmp, 0).icmp(if icmp == ICMP { 8 } else { 128 }, 77),
        );
        assert_eq!(recorded(&p), 3);
        for answer in [&syn_ack, &udp_answer, &echo_answer] {
            from_peer(&mut p, answer, Counter::PassReply);
        }

        // Only the exact flow: another port, another echo id, a new connection from the peer.
        from_peer(
            &mut p,
            &Packet::new(peer, node, TCP, 51001)
                .src_port(22)
                .tcp_flags(TCP_ACK),
            Counter::DropPolicy,
        );
        from_peer(
            &mut p,
            &Packet::new(peer, node, UDP, 52000).src_port(162),
            Counter::DropPolicy,
        );
        from_peer(
            &mut p,
            &Packet::new(peer, node, icmp, 0).icmp(echo_reply, 78),
            Counter::DropPolicy,
        );
        // A SYN without ACK opens a connection, on the flow's very ports too: no answer.
        from_peer(
            &mut p,
            &Packet::new(peer, node, TCP, 51000)
                .src_port(22)
                .tcp_flags(TCP_SYN),
            Counter::DropPolicy,
        );
        // An echo request is not a reply, even with the flow's identifier.
        from_peer(
            &mut p,
            &Packet::new(peer, node, icmp, 0).icmp(if icmp == ICMP { 8 } else { 128 }, 77),
            Counter::DropPolicy,
        );
        // What the policy allows still passes as policy, not as a reply.
        let allowed = if peer == PEER_V4 {
            "10.1.2.3"
        } else {
            "fd00:1::3"
        };
        from_peer(
            &mut p,
            &Packet::new(peer, allowed, TCP, 443),
            Counter::PassPolicy,
        );
    }
}

#[test]
fn icmp_errors_about_a_flow_pass_as_related() {
    for (peer, node, icmp, unreachable) in
        [(PEER_V4, NODE_V4, ICMP, 3), (PEER_V6, NODE_V6, ICMPV6, 1)]
    {
        let mut p = default_program();
        // The node probes a closed UDP port; the peer answers port unreachable.
        let probe = Packet::new(node, peer, UDP, 33434).src_port(52000);
        let error = Packet::new(peer, node, icmp, 0)
            .icmp(unreachable, 0)
            .quoting(&probe);
        from_peer(&mut p, &error, Counter::DropPolicy);
        to_peer(&mut p, &probe);
        from_peer(&mut p, &error, Counter::PassReply);
        // An error quoting another flow, or sent to someone other than the quoted source, is
        // not related to anything.
        let other = Packet::new(node, peer, UDP, 33435).src_port(52000);
        from_peer(
            &mut p,
            &Packet::new(peer, node, icmp, 0)
                .icmp(unreachable, 0)
                .quoting(&other),
            Counter::DropPolicy,
        );
        let elsewhere = if peer == PEER_V4 {
            "192.168.77.9"
        } else {
            "fd77::9"
        };
        from_peer(
            &mut p,
            &Packet::new(peer, elsewhere, icmp, 0)
                .icmp(unreachable, 0)
                .quoting(&probe),
            Counter::DropPolicy,
        );
    }
}

#[test]
fn nothing_the_peer_sends_or_the_network_answers_opens_a_flow() {
    let mut p = default_program();
    // The peer tries to open SSH to the node: denied, and no flow.
    let syn = Packet::new(PEER_V4, NODE_V4, TCP, 22).src_port(50000);
    from_peer(&mut p, &syn, Counter::DropPolicy);
    // The node's SYN-ACK, RST or bare ACK toward the peer answers or continues something: none
    // of them starts a flow.
    for flags in [TCP_SYN | TCP_ACK, TCP_RST, TCP_ACK, TCP_FIN | TCP_ACK] {
        to_peer(
            &mut p,
            &Packet::new(NODE_V4, PEER_V4, TCP, 50000)
                .src_port(22)
                .tcp_flags(flags),
        );
    }
    // An ICMP echo reply toward the peer does not start one either.
    to_peer(&mut p, &Packet::new(NODE_V4, PEER_V4, ICMP, 0).icmp(0, 9));
    assert_eq!(recorded(&p), 0);
    from_peer(&mut p, &syn.clone().tcp_flags(TCP_ACK), Counter::DropPolicy);
    from_peer(
        &mut p,
        &Packet::new(PEER_V4, NODE_V4, ICMP, 0).icmp(8, 9),
        Counter::DropPolicy,
    );
    assert!(p.maps().flows().unwrap().is_empty());
}

#[test]
fn unrestricted_and_unknown_destinations_record_nothing() {
    let mut p = default_program();
    to_peer(&mut p, &Packet::new(NODE_V4, OPEN_V4, TCP, 22));
    to_peer(&mut p, &Packet::new(NODE_V4, "10.8.0.99", TCP, 22));
    to_peer(
        &mut p,
        &Packet::new(NODE_V4, PEER_V4, TCP, 22).fragment(10, false),
    );
    assert_eq!(recorded(&p), 0);
}

#[test]
fn with_replies_off_nothing_is_recorded_and_nothing_passes_as_a_reply() {
    let mut p = program(DatapathSettings::default(), false);
    to_peer(
        &mut p,
        &Packet::new(NODE_V4, PEER_V4, UDP, 161).src_port(52000),
    );
    assert_eq!(recorded(&p), 0);
    from_peer(
        &mut p,
        &Packet::new(PEER_V4, NODE_V4, UDP, 52000).src_port(161),
        Counter::DropPolicy,
    );

    // Switched off with flows already recorded: they stop counting at once.
    let mut p = default_program();
    to_peer(
        &mut p,
        &Packet::new(NODE_V4, PEER_V4, UDP, 161).src_port(52000),
    );
    let answer = Packet::new(PEER_V4, NODE_V4, UDP, 52000).src_port(161);
    from_peer(&mut p, &answer, Counter::PassReply);
    p.maps_mut()
        .set_config(&DatapathSettings::default().config(false, 1))
        .unwrap();
    from_peer(&mut p, &answer, Counter::DropPolicy);
}

#[test]
fn idle_flows_expire_and_closing_tcp_flows_expire_sooner() {
    let short = Duration::from_millis(200);
    let settings = DatapathSettings {
        udp_timeout: short,
        tcp_closing_timeout: short,
        ..DatapathSettings::default()
    };
    let mut p = program(settings, true);
    to_peer(
        &mut p,
        &Packet::new(NODE_V4, PEER_V4, UDP, 161).src_port(52000),
    );
    to_peer(
        &mut p,
        &Packet::new(NODE_V4, PEER_V4, TCP, 22).src_port(51000),
    );
    let udp = Packet::new(PEER_V4, NODE_V4, UDP, 52000).src_port(161);
    let tcp = Packet::new(PEER_V4, NODE_V4, TCP, 51000)
        .src_port(22)
        .tcp_flags(TCP_ACK);
    from_peer(&mut p, &udp, Counter::PassReply);
    // The peer closes its side: the flow now lives for the closing timeout only.
    from_peer(
        &mut p,
        &tcp.clone().tcp_flags(TCP_FIN | TCP_ACK),
        Counter::PassReply,
    );
    thread::sleep(short * 2);
    from_peer(&mut p, &udp, Counter::DropPolicy);
    from_peer(&mut p, &tcp, Counter::DropPolicy);
    // A new datagram from the network opens the flow again.
    to_peer(
        &mut p,
        &Packet::new(NODE_V4, PEER_V4, UDP, 161).src_port(52000),
    );
    from_peer(&mut p, &udp, Counter::PassReply);
}

/// A denied packet of a peer looks for the flow it answers only while the peer's slot holds
/// one (`made - freed`, the flow quota): the agent counts a flow it deletes only after the
/// deletion, so the flows that stay keep answering, in both families, and once the last one is
/// deleted nothing answers.
#[test]
fn the_flows_that_stay_answer_after_the_agent_deletes_others() {
    let mut p = default_program();
    let (made, freed) = p.maps().flow_quota(SLOT).unwrap();
    assert_eq!(made, freed, "a new program's slot holds no flow");
    let answer_v4 = |port| Packet::new(PEER_V4, NODE_V4, UDP, port).src_port(161);
    let answer_v6 = Packet::new(PEER_V6, NODE_V6, UDP, 52000).src_port(161);
    // Nothing recorded: no flow answers.
    from_peer(&mut p, &answer_v4(52000), Counter::DropPolicy);
    for port in [52000, 52001, 52002] {
        to_peer(
            &mut p,
            &Packet::new(NODE_V4, PEER_V4, UDP, 161).src_port(port),
        );
    }
    to_peer(
        &mut p,
        &Packet::new(NODE_V6, PEER_V6, UDP, 161).src_port(52000),
    );
    assert_eq!(p.maps().flow_quota(SLOT).unwrap(), (made + 4, freed));
    // The agent deletes two IPv4 flows and the IPv6 one, and counts them.
    let flows = p.maps().flows().unwrap();
    let gone: Vec<Flow> = flows
        .into_iter()
        .filter(|f| f.remote_port != 52002)
        .collect();
    assert_eq!(gone.len(), 3, "{gone:?}");
    assert_eq!(p.maps_mut().remove_flow_list(&gone).unwrap(), 3);
    assert_eq!(p.maps().flow_quota(SLOT).unwrap(), (made + 4, freed + 3));
    from_peer(&mut p, &answer_v4(52002), Counter::PassReply);
    from_peer(&mut p, &answer_v4(52000), Counter::DropPolicy);
    from_peer(&mut p, &answer_v6, Counter::DropPolicy);
    // The last one goes: the slot holds none, and its answer is judged by the policy alone.
    let last = p.maps().flows().unwrap();
    assert_eq!(p.maps_mut().remove_flow_list(&last).unwrap(), 1);
    from_peer(&mut p, &answer_v4(52002), Counter::DropPolicy);
    // Recorded again: it answers again, in both families.
    to_peer(
        &mut p,
        &Packet::new(NODE_V6, PEER_V6, UDP, 161).src_port(52000),
    );
    from_peer(&mut p, &answer_v6, Counter::PassReply);
}

/// Nothing is evicted: a full table keeps every flow it has and refuses new ones (which only
/// stops replies), so no peer can push another's flows out.
#[test]
fn a_full_flow_table_refuses_new_flows_and_keeps_the_old_ones() {
    let mut p = default_program();
    to_peer(
        &mut p,
        &Packet::new(NODE_V4, PEER_V4, UDP, 161).src_port(52000),
    );
    let first = Packet::new(PEER_V4, NODE_V4, UDP, 52000).src_port(161);
    from_peer(&mut p, &first, Counter::PassReply);
    // Fill the table with other flows (of another slot), from user space as the egress program
    // would, until it takes no more.
    let maps = p.maps_mut();
    let mut i = 0u32;
    let refused = loop {
        let flow = Flow {
            peer: ip("10.8.0.9"),
            remote: std::net::Ipv4Addr::from(0x0a63_0000 + i).into(),
            protocol: 17,
            peer_port: 1,
            remote_port: 1,
            value: FlowValue {
                last_seen_ns: u64::MAX / 2,
                slot: SLOT + 1,
                ..FlowValue::default()
            },
        };
        if let Err(e) = maps.insert_flow(&flow) {
            break e;
        }
        i += 1;
        assert!(i <= MAX_FLOWS, "the table took more than {MAX_FLOWS} flows");
    };
    assert_eq!(i, MAX_FLOWS - 1, "filled up to the limit, then: {refused}");
    // The first flow is still there and still passes replies.
    from_peer(&mut p, &first, Counter::PassReply);
    // A new flow finds no room: refused and counted, and its "reply" is judged by the policy.
    let (before, refused_before) = (recorded(&p), counted(&p, Counter::FlowRefused));
    to_peer(
        &mut p,
        &Packet::new(NODE_V4, PEER_V4, UDP, 161).src_port(53000),
    );
    assert_eq!(recorded(&p), before);
    assert_eq!(counted(&p, Counter::FlowRefused), refused_before + 1);
    from_peer(
        &mut p,
        &Packet::new(PEER_V4, NODE_V4, UDP, 53000).src_port(161),
        Counter::DropPolicy,
    );
}

/// Issue 11 item 3: however many flows the network starts toward one peer, it holds at most
/// its quota; another peer's flows still record and their replies pass.
#[test]
fn a_peer_holds_at_most_its_quota_of_flows_and_others_keep_theirs() {
    const QUOTA: u32 = 16;
    const OTHER: &str = "10.8.0.5";
    const OTHER_SLOT: u32 = SLOT + 2;
    let mut p = program(
        DatapathSettings {
            flows_per_peer: QUOTA,
            ..DatapathSettings::default()
        },
        true,
    );
    p.maps_mut()
        .upsert_peer(
            ip(OTHER),
            PeerEntry {
                policy: 1,
                slot: OTHER_SLOT,
                owner: OWNER + 2,
                ..PeerEntry::default()
            },
        )
        .unwrap();
    // A flood of new flows toward the peer, over both families (one quota for both).
    for port in 0..200u16 {
        to_peer(
            &mut p,
            &Packet::new(NODE_V4, PEER_V4, TCP, 22).src_port(10_000 + port),
        );
        to_peer(
            &mut p,
            &Packet::new(NODE_V6, PEER_V6, UDP, 161).src_port(10_000 + port),
        );
    }
    let flows = p.maps().flows().unwrap();
    assert_eq!(
        flows.len(),
        QUOTA as usize,
        "flows held by the flooded peer"
    );
    assert_eq!(recorded(&p), u64::from(QUOTA));
    assert_eq!(counted(&p, Counter::FlowRefused), 400 - u64::from(QUOTA));
    assert_eq!(p.maps().flow_quota(SLOT).unwrap(), (u64::from(QUOTA), 0));
    // The flows it got pass replies; one past the quota does not.
    from_peer(
        &mut p,
        &Packet::new(PEER_V4, NODE_V4, TCP, 10_000)
            .src_port(22)
            .tcp_flags(TCP_SYN | TCP_ACK),
        Counter::PassReply,
    );
    from_peer(
        &mut p,
        &Packet::new(PEER_V4, NODE_V4, TCP, 10_199)
            .src_port(22)
            .tcp_flags(TCP_SYN | TCP_ACK),
        Counter::DropPolicy,
    );
    // The other peer is untouched by the flood: its flow records and its reply passes.
    to_peer(
        &mut p,
        &Packet::new(NODE_V4, OTHER, UDP, 161).src_port(52000),
    );
    from_peer(
        &mut p,
        &Packet::new(OTHER, NODE_V4, UDP, 52000).src_port(161),
        Counter::PassReply,
    );
    // The agent deletes one of the flooded peer's flows: its quota has room for one more.
    let forgotten = p
        .maps_mut()
        .remove_flows(|f| f.peer == ip(PEER_V4) && f.remote_port == 10_000)
        .unwrap();
    assert_eq!(forgotten, 1);
    assert_eq!(p.maps().flow_quota(SLOT).unwrap(), (u64::from(QUOTA), 1));
    let before = recorded(&p);
    to_peer(
        &mut p,
        &Packet::new(NODE_V4, PEER_V4, TCP, 22).src_port(20_000),
    );
    to_peer(
        &mut p,
        &Packet::new(NODE_V4, PEER_V4, TCP, 22).src_port(20_001),
    );
    assert_eq!(recorded(&p), before + 1);
}

/// Issue 11 item 3: a packet the WireGuard interface itself delivered (a peer sending to its
/// own or another peer's address through the node) starts no flow.
#[test]
fn packets_that_came_in_on_the_interface_record_no_flow() {
    let mut p = default_program();
    for port in 0..100u16 {
        // To its own address, from another peer, and over IPv6.
        for packet in [
            Packet::new(PEER_V4, PEER_V4, TCP, 443).src_port(30_000 + port),
            Packet::new(OPEN_V4, PEER_V4, UDP, 53).src_port(30_000 + port),
            Packet::new(PEER_V6, PEER_V6, TCP, 443).src_port(30_000 + port),
        ] {
            let run = p
                .run_egress_hairpin(&packet.frame())
                .expect("egress test run");
            assert!(run.passed(), "the egress program never drops");
        }
    }
    assert_eq!(recorded(&p), 0);
    assert!(p.maps().flows().unwrap().is_empty());
    // The same packet from elsewhere (the node, another interface) does record.
    to_peer(
        &mut p,
        &Packet::new(NODE_V4, PEER_V4, TCP, 443).src_port(30_000),
    );
    assert_eq!(recorded(&p), 1);
}

#[test]
fn answers_to_what_the_policy_allows_record_no_flow() {
    let mut p = default_program();
    // The peer's DNS query to 10.1.2.3:53 is allowed; the answer toward the peer needs no flow
    // (and must not fill the table, or outlive a later change of the policy).
    from_peer(
        &mut p,
        &Packet::new(PEER_V4, "10.1.2.3", UDP, 53).src_port(5353),
        Counter::PassPolicy,
    );
    to_peer(
        &mut p,
        &Packet::new("10.1.2.3", PEER_V4, UDP, 5353).src_port(53),
    );
    assert_eq!(recorded(&p), 0);
    // The same server from another port is a flow the network starts.
    to_peer(
        &mut p,
        &Packet::new("10.1.2.3", PEER_V4, UDP, 5353).src_port(54),
    );
    assert_eq!(recorded(&p), 1);
}

/// Issue 11 item 4: a flow counts only for the entry owner that recorded it. A new owner of
/// the address (a new holder, same slot or not) gets no replies from the old holder's flows.
#[test]
fn a_flow_belongs_to_the_owner_that_recorded_it() {
    let mut p = default_program();
    let datagram = Packet::new(NODE_V4, PEER_V4, UDP, 161).src_port(52000);
    to_peer(&mut p, &datagram);
    let answer = Packet::new(PEER_V4, NODE_V4, UDP, 52000).src_port(161);
    from_peer(&mut p, &answer, Counter::PassReply);
    let give = |p: &mut TestProgram, slot: u32, owner: u64| {
        p.maps_mut()
            .upsert_peer(
                ip(PEER_V4),
                PeerEntry {
                    policy: 1,
                    slot,
                    owner,
                    ..PeerEntry::default()
                },
            )
            .unwrap();
    };
    // Same policy, same slot, new owner: the old flow is not the new owner's.
    give(&mut p, SLOT, OWNER + 10);
    from_peer(&mut p, &answer, Counter::DropPolicy);
    // The network's next datagram records it anew for the new owner (in place: same slot).
    let before = recorded(&p);
    to_peer(&mut p, &datagram);
    assert_eq!(recorded(&p), before + 1);
    from_peer(&mut p, &answer, Counter::PassReply);
    // Another slot: the dead flow counts against the old slot until the agent deletes it, so
    // it is not taken over; once deleted, the flow records for the new owner.
    give(&mut p, SLOT + 10, OWNER + 11);
    from_peer(&mut p, &answer, Counter::DropPolicy);
    to_peer(&mut p, &datagram);
    from_peer(&mut p, &answer, Counter::DropPolicy);
    let owner = OWNER + 11;
    let gone = p
        .maps_mut()
        .remove_flows(|f| f.value.owner != owner)
        .unwrap();
    assert_eq!(gone, 1);
    to_peer(&mut p, &datagram);
    from_peer(&mut p, &answer, Counter::PassReply);
}

#[test]
fn packets_that_cannot_start_a_flow_do_not_revive_an_expired_one() {
    let short = Duration::from_millis(200);
    let settings = DatapathSettings {
        tcp_closing_timeout: short,
        ..DatapathSettings::default()
    };
    let mut p = program(settings, true);
    to_peer(
        &mut p,
        &Packet::new(NODE_V4, PEER_V4, TCP, 22).src_port(51000),
    );
    let ack = Packet::new(PEER_V4, NODE_V4, TCP, 51000)
        .src_port(22)
        .tcp_flags(TCP_ACK);
    from_peer(&mut p, &ack.clone().tcp_flags(TCP_RST), Counter::PassReply);
    thread::sleep(short * 2);
    // The node's late ACK toward the peer does not bring the closed flow back.
    to_peer(
        &mut p,
        &Packet::new(NODE_V4, PEER_V4, TCP, 22)
            .src_port(51000)
            .tcp_flags(TCP_ACK),
    );
    from_peer(&mut p, &ack, Counter::DropPolicy);
}

#[test]
fn icmpv6_packet_too_big_about_a_flow_passes() {
    let mut p = default_program();
    let probe = Packet::new(NODE_V6, PEER_V6, TCP, 22).src_port(51000);
    to_peer(&mut p, &probe);
    let too_big = Packet::new(PEER_V6, NODE_V6, ICMPV6, 0)
        .icmp(2, 0)
        .quoting(&probe);
    from_peer(&mut p, &too_big, Counter::PassReply);
}

/// A flow the peer has not answered lives for the unanswered timeout only: SYNs (or datagrams)
/// toward a silent peer hold its quota briefly, not for the 6 h of an open TCP flow. An answer
/// from the peer moves it to its protocol's timeout; the network's retransmitted SYN does not,
/// and a new SYN on a flow that was closing makes it unanswered again.
#[test]
fn a_flow_the_peer_has_not_answered_expires_after_the_unanswered_timeout() {
    let short = Duration::from_millis(300);
    let settings = DatapathSettings {
        unanswered_timeout: short,
        tcp_closing_timeout: Duration::from_secs(60),
        ..DatapathSettings::default()
    };
    for (peer, node) in [(PEER_V4, NODE_V4), (PEER_V6, NODE_V6)] {
        let mut p = program(settings, true);
        let syn = |port: u16| Packet::new(node, peer, TCP, 22).src_port(port);
        let syn_ack = |port: u16| {
            Packet::new(peer, node, TCP, port)
                .src_port(22)
                .tcp_flags(TCP_SYN | TCP_ACK)
        };
        let ack = |port: u16| {
            Packet::new(peer, node, TCP, port)
                .src_port(22)
                .tcp_flags(TCP_ACK)
        };
        // 51000: never answered, the SYN sent twice. 51001: answered.
        // 51002: answered, closed by the peer, then a new SYN on the same ports.
        // 52000/52001: UDP, unanswered and answered.
        for port in [51000, 51000, 51001, 51002] {
            to_peer(&mut p, &syn(port));
        }
        for port in [52000, 52001] {
            to_peer(&mut p, &Packet::new(node, peer, UDP, 161).src_port(port));
        }
        from_peer(&mut p, &syn_ack(51001), Counter::PassReply);
        from_peer(&mut p, &syn_ack(51002), Counter::PassReply);
        from_peer(
            &mut p,
            &ack(51002).tcp_flags(TCP_RST | TCP_ACK),
            Counter::PassReply,
        );
        to_peer(&mut p, &syn(51002));
        let udp_answer = |port: u16| Packet::new(peer, node, UDP, port).src_port(161);
        from_peer(&mut p, &udp_answer(52001), Counter::PassReply);
        thread::sleep(short * 2);
        from_peer(&mut p, &syn_ack(51000), Counter::DropPolicy);
        from_peer(&mut p, &ack(51001), Counter::PassReply);
        from_peer(&mut p, &syn_ack(51002), Counter::DropPolicy);
        from_peer(&mut p, &udp_answer(52000), Counter::DropPolicy);
        from_peer(&mut p, &udp_answer(52001), Counter::PassReply);
    }
}

/// An ICMP error from the peer about a flow passes (conntrack's RELATED) but is no answer: the
/// flow stays unanswered, so a peer whose firewall rejects with ICMP does not keep every
/// flooded flow for the protocol's timeout.
#[test]
fn an_icmp_error_about_an_unanswered_flow_does_not_answer_it() {
    let short = Duration::from_millis(300);
    let settings = DatapathSettings {
        unanswered_timeout: short,
        ..DatapathSettings::default()
    };
    for (peer, node, icmp, unreachable) in
        [(PEER_V4, NODE_V4, ICMP, 3), (PEER_V6, NODE_V6, ICMPV6, 1)]
    {
        let mut p = program(settings, true);
        let syn = Packet::new(node, peer, TCP, 22).src_port(51000);
        to_peer(&mut p, &syn);
        let error = Packet::new(peer, node, icmp, 0)
            .icmp(unreachable, 3)
            .quoting(&syn);
        from_peer(&mut p, &error, Counter::PassReply);
        thread::sleep(short * 2);
        from_peer(
            &mut p,
            &Packet::new(peer, node, TCP, 51000)
                .src_port(22)
                .tcp_flags(TCP_SYN | TCP_ACK),
            Counter::DropPolicy,
        );
    }
}
