//! End to end with wireguard-go and the `wgfence run` binary: what the network starts toward a
//! restricted peer gets its replies back (the old design's ESTABLISHED,RELATED accept), while
//! the peer still cannot start anything its policy does not allow.

use std::{
    net::UdpSocket,
    thread,
    time::{Duration, Instant},
};

use serde_json::json;
use wgfence::{
    dataplane::{Dataplane, Flow},
    settings::DatapathSettings,
};
use wgfence_common::{FlowValue, MAX_FLOWS};
use wgfence_tests::{
    agent::{Agent, Layout},
    packet::{send_raw, Packet, TCP},
    probe::{check_all, Expect, Kind, Reach},
    topology::Gateway,
};

/// A policy that does not allow the node (10.8.0.1, fd00:8::1).
fn web_only() -> serde_json::Value {
    json!([{ "cidr": "10.1.0.0/16", "protocol": "tcp", "ports": [443] }])
}

fn state(gw: &Gateway, replies: Option<bool>) -> String {
    let mut s = json!({
        "version": 1,
        "peers": [gw.peer_json(0, Some(web_only())), gw.peer_json(1, None)],
    });
    if let Some(replies) = replies {
        s["replies"] = json!(replies);
    }
    s.to_string()
}

#[test]
fn the_network_reaches_a_restricted_peer_that_cannot_reach_it() {
    let gw = Gateway::new(2);
    let agent = Agent::start(&gw, Layout::Plain, &state(&gw, None), &[]);
    agent.wait_ready(&gw);
    let (node, peer) = (&gw.node, &gw.peers[0].ns);
    let case = Expect::new;
    use Kind::{Ping, Tcp, Udp};
    use Reach::{Blocked, Reached};
    // The node's SSH gets the peer's RST, its UDP probe the peer's port unreachable (an ICMP
    // error, related to the flow), its ping the echo reply.
    let from_node = |expect| {
        let mut cases = Vec::new();
        for dst in ["10.8.0.2", "fd00:8::2"] {
            for kind in [Tcp(22), Udp(33434), Ping] {
                cases.push(case("node", node, kind, dst, expect));
            }
        }
        cases
    };
    let mut cases = from_node(Reached);
    for dst in ["10.8.0.1", "fd00:8::1"] {
        for kind in [Tcp(22), Udp(9), Ping] {
            cases.push(case("restricted peer", peer, kind, dst, Blocked));
        }
    }
    check_all(&cases);
    let replies = agent.metric(&gw, "wgfence_passed_packets_total{reason=\"reply\"}");
    assert!(replies >= 6.0, "{replies} replies counted");
    assert!(agent.metric(&gw, "wgfence_reply_flows_recorded_total") >= 6.0);

    // Flows of no owner fill the table behind the agent's back: new flows are refused (nothing
    // is evicted), until the agent's sweep collects them, within seconds.
    let mut maps = Dataplane::open_maps(&gw.bpffs, gw.interface())
        .unwrap_or_else(|e| panic!("{}", wgfence::error_chain(&e)));
    let mut filled = 0u64;
    for i in 0..MAX_FLOWS {
        let flow = Flow {
            peer: gw.peers[0].v4.into(),
            remote: std::net::Ipv4Addr::from(0x0a63_0000 + i).into(),
            protocol: 17,
            peer_port: 1,
            remote_port: 1,
            value: FlowValue {
                last_seen_ns: u64::MAX / 2,
                owner: u64::MAX,
                slot: 200,
                ..FlowValue::default()
            },
        };
        if maps.insert_flow(&flow).is_err() {
            break;
        }
        filled += 1;
    }
    assert!(filled > u64::from(MAX_FLOWS) / 2, "{filled} filler flows");
    let deadline = Instant::now() + Duration::from_secs(15);
    while maps.flows().map(|f| f.len()).unwrap_or(usize::MAX) > 100 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(200));
    }
    assert!(agent.metric(&gw, "wgfence_reply_flows_freed_total") >= filled as f64);
    check_all(&from_node(Reached));
    // A peer that leaves takes its flows with it: a later holder of the address starts afresh.
    let flows_of = |addr: std::net::IpAddr| flows_toward(&gw, addr).len();
    assert!(flows_of(gw.peers[0].v4.into()) > 0);
    let without = json!({ "version": 1, "peers": [gw.peer_json(1, None)] }).to_string();
    let before = agent.reconciles(&gw);
    agent.write_state(&without);
    agent.wait_reconciles(&gw, before, 1.0);
    // The entries went with the push (so the flows count for nobody); the sweeper deletes the
    // flows themselves right after it.
    let forgotten = wgfence_tests::net::wait_for(Duration::from_secs(2), || {
        flows_of(gw.peers[0].v4.into()) == 0 && flows_of(gw.peers[0].v6.into()) == 0
    });
    assert!(
        forgotten.is_some(),
        "flows left toward the peer that left: {} IPv4, {} IPv6",
        flows_of(gw.peers[0].v4.into()),
        flows_of(gw.peers[0].v6.into())
    );
    let before = agent.reconciles(&gw);
    agent.write_state(&state(&gw, None));
    agent.wait_reconciles(&gw, before, 1.0);
    check_all(&from_node(Reached));

    // "replies": false stops them at once, recorded flows included.
    let before = agent.reconciles(&gw);
    agent.write_state(&state(&gw, Some(false)));
    agent.wait_reconciles(&gw, before, 1.0);
    check_all(&from_node(Blocked));
    assert!(
        wgfence_tests::net::wait_for(Duration::from_secs(2), || flows_of(gw.peers[0].v4.into())
            == 0)
        .is_some(),
        "switching replies off forgets the flows"
    );
    // The unrestricted peer is not affected either way.
    check_all(&[
        case("node", node, Tcp(22), "10.8.0.3", Reached),
        case("node", node, Ping, "fd00:8::3", Reached),
    ]);
}

/// The node sends one datagram to the restricted peer, which answers at once and again after
/// `delay`, on the same flow. Which answers arrive at the node?
fn answers(gw: &Gateway, delay: Duration) -> (bool, bool) {
    answers_of(gw, 0, delay)
}

/// [`answers`] of peer `i`.
fn answers_of(gw: &Gateway, i: usize, delay: Duration) -> (bool, bool) {
    const PORT: u16 = 7000;
    let peer = &gw.peers[i];
    thread::scope(|s| {
        let server = s.spawn(|| {
            peer.ns.enter(|| {
                let socket = UdpSocket::bind(("0.0.0.0", PORT)).unwrap();
                let _ = socket.set_read_timeout(Some(Duration::from_secs(5)));
                let mut buf = [0u8; 16];
                let (_, from) = socket.recv_from(&mut buf).expect("peer");
                let _ = socket.send_to(b"now", from);
                thread::sleep(delay);
                let _ = socket.send_to(b"later", from);
            })
        });
        thread::sleep(Duration::from_millis(200));
        let got = gw.node.enter(|| {
            let socket = UdpSocket::bind("0.0.0.0:0").unwrap();
            let _ = socket.set_read_timeout(Some(Duration::from_millis(200)));
            socket.send_to(b"hello", (peer.v4, PORT)).expect("node");
            let deadline = Instant::now() + delay + Duration::from_millis(1500);
            let (mut now, mut later) = (false, false);
            let mut buf = [0u8; 16];
            while Instant::now() < deadline && !later {
                if let Ok(n) = socket.recv(&mut buf) {
                    match &buf[..n] {
                        b"now" => now = true,
                        b"later" => later = true,
                        _ => {}
                    }
                }
            }
            (now, later)
        });
        server
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e));
        got
    })
}

#[test]
fn a_flow_idle_past_its_timeout_stops_passing() {
    let gw = Gateway::new(2);
    let timeout = Duration::from_secs(1);
    assert!(timeout < DatapathSettings::default().udp_timeout);
    let agent = Agent::start(
        &gw,
        Layout::Plain,
        &state(&gw, None),
        &["--flow-timeout-udp", "1"],
    );
    agent.wait_ready(&gw);
    assert_eq!(
        answers(&gw, timeout / 4),
        (true, true),
        "within the timeout"
    );
    assert_eq!(
        answers(&gw, timeout * 5 / 2),
        (true, false),
        "idle past the timeout"
    );
}

#[test]
fn monitor_names_the_running_agents_peers() {
    use std::io::{BufRead as _, BufReader};
    let gw = Gateway::new(2);
    let agent = Agent::start(&gw, Layout::Plain, &state(&gw, None), &[]);
    agent.wait_ready(&gw);
    // No --state: the names come from the running agent's state file.
    let mut monitor = std::process::Command::new(wgfence_tests::agent::binary())
        .args([
            "monitor",
            "--interface",
            gw.interface(),
            "--json",
            "--count",
            "1",
        ])
        .args(["--peer", "peer0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("wgfence monitor");
    let stderr = monitor.stderr.take().expect("no stderr");
    let mut first = String::new();
    let mut reader = BufReader::new(stderr);
    let _ = reader.read_line(&mut first);
    assert!(
        first.starts_with("monitoring drop events"),
        "monitor: {first}"
    );
    let unrestricted =
        wgfence_tests::probe::probe(&gw.peers[1].ns, Kind::Tcp(22), "10.8.0.1".parse().unwrap());
    assert_eq!(unrestricted, Reach::Reached);
    let denied =
        wgfence_tests::probe::probe(&gw.peers[0].ns, Kind::Tcp(22), "10.8.0.1".parse().unwrap());
    assert_eq!(denied, Reach::Blocked);
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline && matches!(monitor.try_wait(), Ok(None)) {
        thread::sleep(Duration::from_millis(20));
    }
    let _ = monitor.kill();
    let stdout = monitor.stdout.take().expect("no stdout");
    let lines: Vec<String> = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .collect();
    let _ = monitor.wait();
    assert_eq!(lines.len(), 1, "{lines:?}");
    let event: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
    assert_eq!(event["peer"], "peer0", "{event}");
    assert_eq!(event["reason"], "policy_denied", "{event}");
    assert_eq!(
        (event["dst"].as_str(), event["dstPort"].as_u64()),
        (Some("10.8.0.1"), Some(22))
    );
    assert!(agent.metric(&gw, "wgfence_drop_events_total{outcome=\"sent\"}") >= 1.0);
}

#[test]
fn plan_shows_the_replies_switch_it_would_write() {
    let gw = Gateway::new(2);
    let agent = Agent::start(&gw, Layout::Plain, &state(&gw, None), &[]);
    agent.wait_ready(&gw);
    let plan = |text: &str| {
        let path = agent.dir.join("plan.json");
        std::fs::write(&path, text).unwrap();
        let out = gw
            .node
            .command(wgfence_tests::agent::binary())
            .args(["plan", "--interface", gw.interface(), "--state"])
            .arg(&path)
            .output()
            .expect("wgfence plan");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let same = plan(&state(&gw, None));
    assert!(
        same.contains("0 map writes, 0 WireGuard peer changes"),
        "{same}"
    );
    let off = plan(&state(&gw, Some(false)));
    assert!(off.contains("settings: replies on -> off"), "{off}");
    assert!(
        off.contains("1 map writes, 0 WireGuard peer changes"),
        "{off}"
    );
}

/// The flows recorded toward `addr`.
fn open_maps(gw: &Gateway) -> wgfence::dataplane::Maps {
    Dataplane::open_maps(&gw.bpffs, gw.interface())
        .unwrap_or_else(|e| panic!("{}", wgfence::error_chain(&e)))
}

/// The address entry of `addr` as the kernel holds it.
fn entry_of(gw: &Gateway, addr: std::net::IpAddr) -> wgfence_common::PeerEntry {
    open_maps(gw)
        .peers()
        .unwrap()
        .into_iter()
        .find_map(|(a, e)| (a == addr).then_some(e))
        .unwrap_or_else(|| panic!("no entry for {addr}"))
}

fn flows_toward(gw: &Gateway, addr: std::net::IpAddr) -> Vec<Flow> {
    Dataplane::open_maps(&gw.bpffs, gw.interface())
        .and_then(|m| m.flows())
        .unwrap()
        .into_iter()
        .filter(|f| f.peer == addr)
        .collect()
}

/// Issue 11 item 3, end to end: a restricted peer cannot fill the reply flow tables, neither
/// by sending through the node to its own address (a ClusterIP-like DNAT on the node turns its
/// allowed `10.99.0.5:443` into its own tunnel address) or to another peer's (the node forwards
/// both back into the tunnel), nor by being flooded; another peer's flows keep working.
#[test]
fn no_peer_fills_the_flow_tables_and_a_flood_leaves_others_their_flows() {
    const QUOTA: u64 = 64;
    const FLOOD: u16 = 2000;
    let gw = Gateway::new(2);
    let (a, b) = (&gw.peers[0], &gw.peers[1]);
    // The node routes between peers, as a gateway does, and maps a service address to peer A
    // (checksums are not the point here: the flood's are zero).
    gw.node.exec(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
    gw.node
        .exec(&["sysctl", "-qw", "net.netfilter.nf_conntrack_checksum=0"]);
    let a_addr = a.v4.to_string();
    gw.node.exec(&[
        "iptables",
        "-t",
        "nat",
        "-A",
        "PREROUTING",
        "-d",
        "10.99.0.5",
        "-p",
        "tcp",
        "--dport",
        "443",
        "-j",
        "DNAT",
        "--to-destination",
        &a_addr,
    ]);
    let state = json!({
        "version": 1,
        "peers": [
            gw.peer_json(0, Some(json!([
                { "cidr": "10.99.0.0/24", "protocol": "tcp", "ports": [443] },
                { "cidr": "10.8.0.3/32", "protocol": "tcp", "ports": [443] },
            ]))),
            gw.peer_json(1, Some(web_only())),
        ],
    })
    .to_string();
    let quota = QUOTA.to_string();
    let agent = Agent::start(&gw, Layout::Plain, &state, &["--flows-per-peer", &quota]);
    agent.wait_ready(&gw);

    // Peer A sends thousands of SYNs (its policy allows them) from distinct ports to the
    // service, which the node sends back to A itself, and to B's port 443. None is a flow the
    // network started, so none is recorded (before the fix each was, against A's or B's quota).
    a.ns.enter(|| {
        for port in 0..FLOOD {
            for dst in ["10.99.0.5", &b.v4.to_string()] {
                let syn = Packet::new(&a_addr, dst, TCP, 443).src_port(20_000 + port);
                send_raw(&syn.ip()).expect("peer A");
            }
        }
    });
    thread::sleep(Duration::from_millis(500));
    let own = flows_toward(&gw, a.v4.into()).len();
    let other = flows_toward(&gw, b.v4.into()).len();
    assert_eq!(
        (own, other),
        (0, 0),
        "the hairpin flood recorded flows toward A and B"
    );
    assert_eq!(agent.metric(&gw, "wgfence_reply_flows_recorded_total"), 0.0);
    // The SYNs did go around: the node forwarded them into the tunnel (to A and B).
    let forwarded = gw.node.exec(&[
        "iptables",
        "-t",
        "nat",
        "-L",
        "PREROUTING",
        "-v",
        "-x",
        "-n",
    ]);
    let forwarded = String::from_utf8_lossy(&forwarded.stdout).into_owned();
    assert!(
        forwarded.lines().any(|l| l.contains("DNAT")
            && l.split_whitespace()
                .next()
                .is_some_and(|n| n.parse::<u32>().is_ok_and(|n| n > 0))),
        "the service DNAT saw no packet:\n{forwarded}"
    );

    // The node starts a UDP flow toward B; while B's answer is pending, the node floods A with
    // new TCP flows far past A's quota.
    let (now, later) = thread::scope(|s| {
        let b_answers = s.spawn(|| answers_of(&gw, 1, Duration::from_secs(3)));
        thread::sleep(Duration::from_millis(700));
        gw.node.enter(|| {
            for port in 0..FLOOD {
                let syn =
                    Packet::new("10.8.0.1", &a.v4.to_string(), TCP, 22).src_port(20_000 + port);
                send_raw(&syn.ip()).expect("node");
            }
        });
        b_answers
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
    });
    let held = flows_toward(&gw, a.v4.into()).len() as u64;
    assert_eq!(held, QUOTA, "flows held by the flooded peer A");
    let refused = agent.metric(&gw, "wgfence_reply_flows_refused_total");
    assert!(
        refused >= f64::from(FLOOD) - QUOTA as f64 - 1.0,
        "{refused} refused"
    );
    // B's flow was recorded before the flood and still passes its answer after it.
    assert!(
        now && later,
        "B's answers: now {now}, after the flood {later}"
    );
    // And the node still starts new flows toward B.
    check_all(&[
        Expect::new("node", &gw.node, Kind::Tcp(22), "10.8.0.3", Reach::Reached),
        Expect::new("node", &gw.node, Kind::Ping, "fd00:8::3", Reach::Reached),
    ]);
}

/// Issue 11 item 4: at start, before anything new is allocated, the agent deletes the flows
/// whose owner is not their address's (left by an earlier holder) and the expired ones, and
/// gives their slot's quota back; while it runs, its sweep does the same within seconds.
#[test]
fn the_agent_collects_flows_that_lost_their_owner_or_expired() {
    let gw = Gateway::new(2);
    let mut agent = Agent::start(&gw, Layout::Plain, &state(&gw, None), &[]);
    agent.wait_ready(&gw);
    let addr: std::net::IpAddr = gw.peers[0].v4.into();
    let maps = || open_maps(&gw);
    let entry = entry_of(&gw, addr);
    agent.stop();
    let flow = |remote: u32, owner: u64, last_seen_ns: u64| Flow {
        peer: addr,
        remote: std::net::Ipv4Addr::from(remote).into(),
        protocol: 17,
        peer_port: 1,
        remote_port: 1,
        value: FlowValue {
            last_seen_ns,
            owner,
            slot: entry.slot,
            ..FlowValue::default()
        },
    };
    let live = u64::MAX / 2;
    let mut m = maps();
    let (made, freed) = m.flow_quota(entry.slot).unwrap();
    for f in [
        flow(0x0a63_0001, entry.owner + 1000, live),
        flow(0x0a63_0002, entry.owner, 0),
        flow(0x0a63_0003, entry.owner, live),
    ] {
        m.insert_flow(&f).unwrap();
    }
    agent.restart(&gw, &[]);
    agent.wait_ready(&gw);
    let kept: Vec<u32> = flows_toward(&gw, addr)
        .iter()
        .filter_map(|f| match f.remote {
            std::net::IpAddr::V4(r) => Some(u32::from(r)),
            std::net::IpAddr::V6(_) => None,
        })
        .collect();
    assert_eq!(
        kept,
        [0x0a63_0003],
        "only the live flow of the current owner stays"
    );
    assert_eq!(
        maps().flow_quota(entry.slot).unwrap(),
        (made + 3, freed + 2)
    );

    // While it runs: a flow of another owner goes within a sweep.
    maps()
        .insert_flow(&flow(0x0a63_0004, entry.owner + 1001, live))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(12);
    while flows_toward(&gw, addr).len() > 1 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        flows_toward(&gw, addr).len(),
        1,
        "the sweep left the orphan"
    );
    assert!(agent.metric(&gw, "wgfence_reply_flows_freed_total") >= 1.0);
}

/// Review of issue 11, finding 4: a push that revokes a peer and switches replies off must
/// revoke first. Switching replies off deletes every recorded flow (up to 262,144, a long
/// loop of map deletes): the revocation may neither wait behind it nor fail because of it.
/// Observed through the stayer's quota: the flows it deletes are counted into `freed` after
/// they are gone, so at the instant the revoked entry disappears `freed` must be unchanged.
#[test]
fn a_revocation_does_not_wait_behind_switching_replies_off() {
    let gw = Gateway::new(2);
    let agent = Agent::start(&gw, Layout::Plain, &state(&gw, None), &[]);
    agent.wait_ready(&gw);
    let maps = || open_maps(&gw);
    let (revoked, stayer): (std::net::IpAddr, std::net::IpAddr) =
        (gw.peers[0].v4.into(), gw.peers[1].v4.into());
    let entry = entry_of(&gw, stayer);
    // Live flows of the stayer's current owner: no sweep touches them, only replies off.
    let mut m = maps();
    let n = 60_000u32;
    for i in 0..n {
        let flow = Flow {
            peer: stayer,
            remote: std::net::Ipv4Addr::from(0x0a64_0000 + i).into(),
            protocol: 17,
            peer_port: 1,
            remote_port: 1,
            value: FlowValue {
                last_seen_ns: u64::MAX / 2,
                owner: entry.owner,
                slot: entry.slot,
                ..FlowValue::default()
            },
        };
        m.insert_flow(&flow).unwrap();
    }
    let (_, freed) = m.flow_quota(entry.slot).unwrap();
    agent.write_state(
        &json!({ "version": 1, "replies": false, "peers": [gw.peer_json(1, None)] }).to_string(),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let revoked_at = loop {
        let present = m.peers().unwrap().iter().any(|(a, _)| *a == revoked);
        if !present {
            break m.flow_quota(entry.slot).unwrap().1;
        }
        assert!(Instant::now() < deadline, "{revoked} was never revoked");
        thread::sleep(Duration::from_micros(200));
    };
    assert_eq!(
        revoked_at - freed,
        0,
        "the revocation waited until the agent had deleted the flows of replies off"
    );
    // And the flows go after it.
    let deadline = Instant::now() + Duration::from_secs(15);
    while !flows_toward(&gw, stayer).is_empty() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(100));
    }
    assert!(
        flows_toward(&gw, stayer).is_empty(),
        "replies off kept flows"
    );
    assert_eq!(
        maps().flow_quota(entry.slot).unwrap().1,
        freed + u64::from(n)
    );
}

/// Review of issue 11, finding 6: an agent stopped between deleting flows and counting them
/// leaves the slot's quota short (made - freed above the flows it holds). The next start
/// recounts every slot: after flows are deleted behind a killed agent's back (uncounted, as
/// such a stop leaves them), the restarted agent gives the slot its whole quota back.
#[test]
fn a_restart_recounts_the_flow_quota() {
    let gw = Gateway::new(2);
    let mut agent = Agent::start(&gw, Layout::Plain, &state(&gw, None), &[]);
    agent.wait_ready(&gw);
    let maps = || open_maps(&gw);
    let addr: std::net::IpAddr = gw.peers[1].v4.into();
    let entry = entry_of(&gw, addr);
    let remote = |i: u8| std::net::Ipv4Addr::new(10, 101, 0, i);
    let mut m = maps();
    for i in 1..=5 {
        m.insert_flow(&Flow {
            peer: addr,
            remote: remote(i).into(),
            protocol: 17,
            peer_port: 7,
            remote_port: 9,
            value: FlowValue {
                last_seen_ns: u64::MAX / 2,
                owner: entry.owner,
                slot: entry.slot,
                ..FlowValue::default()
            },
        })
        .unwrap();
    }
    agent.kill();
    // Three of them deleted with nobody counting them.
    let map = gw
        .bpffs
        .join("wgfence")
        .join(gw.interface())
        .join(wgfence_common::map_names::FLOWS_V4);
    let map = map.to_string_lossy().into_owned();
    let std::net::IpAddr::V4(peer) = addr else {
        panic!("{addr} is not IPv4")
    };
    for i in 1..=3u8 {
        // FlowKeyV4: peer, remote (network order), peer port, remote port (host order, LE),
        // protocol, padding.
        let mut key: Vec<String> = peer.octets().iter().map(u8::to_string).collect();
        key.extend(remote(i).octets().iter().map(u8::to_string));
        key.extend(["7", "0", "9", "0", "17", "0", "0", "0"].map(String::from));
        let status = std::process::Command::new("bpftool")
            .args(["map", "delete", "pinned", &map, "key"])
            .args(&key)
            .status()
            .expect("bpftool");
        assert!(status.success(), "bpftool map delete {key:?}");
    }
    let held = |m: &wgfence::dataplane::Maps| {
        m.flows()
            .unwrap()
            .iter()
            .filter(|f| f.value.slot == entry.slot)
            .count() as u64
    };
    let (made, freed) = m.flow_quota(entry.slot).unwrap();
    assert_eq!(
        made - freed,
        held(&m) + 3,
        "the quota is short by the three"
    );
    agent.restart(&gw, &[]);
    agent.wait_ready(&gw);
    let (made, freed) = m.flow_quota(entry.slot).unwrap();
    assert_eq!(
        made - freed,
        held(&m),
        "the restarted agent left the slot's quota short"
    );
}

/// Review of issue 11, finding 6: the periodic flow sweep (a pass over tables of up to
/// 262,144 flows) runs off the apply path, deleting in chunks and yielding to a state change:
/// a revocation pushed while a sweep is under way is applied before the sweep ends. The
/// stayer's flows all expire at once, a few seconds after they are written; the sweep that
/// finds them counts each chunk into the slot's `freed` as it goes.
#[test]
fn a_revocation_does_not_wait_behind_a_flow_sweep() {
    let gw = Gateway::new(2);
    let agent = Agent::start(&gw, Layout::Plain, &state(&gw, None), &[]);
    agent.wait_ready(&gw);
    let maps = || open_maps(&gw);
    let revoked: std::net::IpAddr = gw.peers[0].v4.into();
    let mut m = maps();
    let entry = entry_of(&gw, std::net::IpAddr::from(gw.peers[1].v4));
    let timeout = m.config().unwrap().timeout_ns(17, 0);
    // Expired 6 s from now: after the fill, and then found by the next sweep (every 5 s).
    let last_seen =
        (wgfence::monitor::Clock::now().monotonic_ns() + 6_000_000_000).saturating_sub(timeout);
    let mut filled = 0u64;
    let remote = |v6: bool, i: u32| -> std::net::IpAddr {
        if v6 {
            std::net::Ipv6Addr::from((0xfd66_u128 << 112) | u128::from(i)).into()
        } else {
            std::net::Ipv4Addr::from(0x0a66_0000 + i).into()
        }
    };
    for (peer, v6) in [
        (std::net::IpAddr::from(gw.peers[1].v4), false),
        (std::net::IpAddr::from(gw.peers[1].v6), true),
    ] {
        for i in 0..MAX_FLOWS {
            let flow = Flow {
                peer,
                remote: remote(v6, i),
                protocol: 17,
                peer_port: 1,
                remote_port: 1,
                value: FlowValue {
                    last_seen_ns: last_seen,
                    owner: entry.owner,
                    slot: entry.slot,
                    ..FlowValue::default()
                },
            };
            if m.insert_flow(&flow).is_err() {
                break;
            }
            filled += 1;
        }
    }
    assert!(filled > u64::from(MAX_FLOWS), "{filled} flows");
    let freed = || m.flow_quota(entry.slot).unwrap().1;
    let base = freed();
    // Wait for the sweep to start deleting them.
    let deadline = Instant::now() + Duration::from_secs(20);
    while freed() == base {
        assert!(
            Instant::now() < deadline,
            "no sweep deleted the expired flows"
        );
        thread::sleep(Duration::from_micros(500));
    }
    agent.write_state(&json!({ "version": 1, "peers": [gw.peer_json(1, None)] }).to_string());
    let deadline = Instant::now() + Duration::from_secs(10);
    let at_revocation = loop {
        let present = m.peers().unwrap().iter().any(|(a, _)| *a == revoked);
        if !present {
            break freed();
        }
        assert!(Instant::now() < deadline, "{revoked} was never revoked");
        thread::sleep(Duration::from_micros(200));
    };
    eprintln!(
        "at the revocation, {} of {filled} flows were deleted",
        at_revocation - base
    );
    assert!(
        at_revocation < base + filled,
        "the revocation waited until the sweep had deleted all {filled} flows"
    );
    // The sweep finishes after it.
    let deadline = Instant::now() + Duration::from_secs(20);
    while freed() < base + filled && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(freed(), base + filled, "the sweep did not finish");
}

/// A SYN flood from the network toward a silent restricted peer (review finding: each
/// unanswered SYN held a flow for the 6 h TCP timeout) holds the peer's quota only for the
/// unanswered timeout: the agent's sweep then gives it back, while the flow the peer did answer
/// stays, and the network starts new flows toward the peer again.
#[test]
fn a_syn_flood_toward_a_silent_peer_holds_its_quota_only_briefly() {
    const QUOTA: usize = 64;
    let gw = Gateway::new(2);
    let a = &gw.peers[0];
    let quota = QUOTA.to_string();
    let agent = Agent::start(
        &gw,
        Layout::Plain,
        &state(&gw, None),
        &["--flows-per-peer", &quota, "--flow-timeout-unanswered", "1"],
    );
    agent.wait_ready(&gw);
    // A flow the peer answers (UDP, 60 s).
    assert_eq!(answers_of(&gw, 0, Duration::from_millis(100)), (true, true));
    // The peer says nothing to TCP 22: no RST, no ICMP.
    a.ns.exec(&[
        "iptables", "-I", "INPUT", "-p", "tcp", "--dport", "22", "-j", "DROP",
    ]);
    let flood = |from: u16, n: u16| {
        gw.node.enter(|| {
            for port in from..from + n {
                let syn = Packet::new("10.8.0.1", &a.v4.to_string(), TCP, 22).src_port(port);
                send_raw(&syn.ip()).expect("node");
            }
        });
        thread::sleep(Duration::from_millis(300));
    };
    flood(20_000, 2000);
    assert_eq!(
        flows_toward(&gw, a.v4.into()).len(),
        QUOTA,
        "the flood did not fill the quota"
    );
    let slot = Dataplane::open_maps(&gw.bpffs, gw.interface())
        .and_then(|m| m.peers())
        .unwrap()
        .into_iter()
        .find_map(|(addr, e)| (addr == std::net::IpAddr::from(a.v4)).then_some(e.slot))
        .unwrap_or_else(|| panic!("no entry for {}", a.v4));

    // The unanswered timeout (1 s) and one sweep (every 5 s) later, only the answered flow
    // is left, and the quota counts only it.
    let started = Instant::now();
    let deadline = started + Duration::from_secs(12);
    while flows_toward(&gw, a.v4.into()).len() > 1 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(200));
    }
    let left = flows_toward(&gw, a.v4.into());
    eprintln!(
        "{} flows left toward the silent peer {:?} after the flood",
        left.len(),
        started.elapsed()
    );
    assert_eq!(
        left.iter().map(|f| f.protocol).collect::<Vec<_>>(),
        [17],
        "the flood's flows were not collected, or the answered one was"
    );
    let (made, freed) = Dataplane::open_maps(&gw.bpffs, gw.interface())
        .and_then(|m| m.flow_quota(slot))
        .unwrap();
    assert_eq!(
        made - freed,
        1,
        "live flows on the quota: made {made}, freed {freed}"
    );
    // The quota is free again for what the network starts next.
    flood(30_000, 100);
    assert_eq!(flows_toward(&gw, a.v4.into()).len(), QUOTA);
}
