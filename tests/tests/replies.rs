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

    // A full flow table still takes the node's new flows: fill it behind the agent's back.
    let mut maps = Dataplane::open_maps(&gw.bpffs, gw.interface())
        .unwrap_or_else(|e| panic!("{}", wgfence::error_chain(&e)));
    for i in 0..MAX_FLOWS {
        maps.insert_flow(&Flow {
            peer: gw.peers[0].v4.into(),
            remote: std::net::Ipv4Addr::from(0x0a63_0000 + i).into(),
            protocol: 17,
            peer_port: 1,
            remote_port: 1,
            value: FlowValue::default(),
        })
        .unwrap_or_else(|e| panic!("{e}"));
    }
    check_all(&from_node(Reached));

    // A peer that leaves takes its flows with it: a later holder of the address starts afresh.
    let flows_of = |addr: std::net::IpAddr| {
        Dataplane::open_maps(&gw.bpffs, gw.interface())
            .and_then(|m| m.flows())
            .unwrap_or_else(|e| panic!("{e}"))
            .into_iter()
            .filter(|f| f.peer == addr)
            .count()
    };
    assert!(flows_of(gw.peers[0].v4.into()) > 0);
    let without = json!({ "version": 1, "peers": [gw.peer_json(1, None)] }).to_string();
    let before = agent.reconciles(&gw);
    agent.write_state(&without);
    agent.wait_reconciles(&gw, before, 1.0);
    assert_eq!(flows_of(gw.peers[0].v4.into()), 0);
    assert_eq!(flows_of(gw.peers[0].v6.into()), 0);
    let before = agent.reconciles(&gw);
    agent.write_state(&state(&gw, None));
    agent.wait_reconciles(&gw, before, 1.0);
    check_all(&from_node(Reached));

    // "replies": false stops them at once, recorded flows included.
    let before = agent.reconciles(&gw);
    agent.write_state(&state(&gw, Some(false)));
    agent.wait_reconciles(&gw, before, 1.0);
    check_all(&from_node(Blocked));
    assert_eq!(
        flows_of(gw.peers[0].v4.into()),
        0,
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
    const PORT: u16 = 7000;
    let peer = &gw.peers[0];
    thread::scope(|s| {
        let server = s.spawn(|| {
            peer.ns.enter(|| {
                let socket = UdpSocket::bind(("0.0.0.0", PORT)).unwrap_or_else(|e| panic!("{e}"));
                let _ = socket.set_read_timeout(Some(Duration::from_secs(5)));
                let mut buf = [0u8; 16];
                let (_, from) = socket
                    .recv_from(&mut buf)
                    .unwrap_or_else(|e| panic!("peer: {e}"));
                let _ = socket.send_to(b"now", from);
                thread::sleep(delay);
                let _ = socket.send_to(b"later", from);
            })
        });
        thread::sleep(Duration::from_millis(200));
        let got = gw.node.enter(|| {
            let socket = UdpSocket::bind("0.0.0.0:0").unwrap_or_else(|e| panic!("{e}"));
            let _ = socket.set_read_timeout(Some(Duration::from_millis(200)));
            socket
                .send_to(b"hello", (peer.v4, PORT))
                .unwrap_or_else(|e| panic!("node: {e}"));
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
        .unwrap_or_else(|e| panic!("wgfence monitor: {e}"));
    let stderr = monitor.stderr.take().unwrap_or_else(|| panic!("no stderr"));
    let mut first = String::new();
    let mut reader = BufReader::new(stderr);
    let _ = reader.read_line(&mut first);
    assert!(
        first.starts_with("monitoring drop events"),
        "monitor: {first}"
    );
    let unrestricted = wgfence_tests::probe::probe(
        &gw.peers[1].ns,
        Kind::Tcp(22),
        "10.8.0.1".parse().unwrap_or_else(|e| panic!("{e}")),
    );
    assert_eq!(unrestricted, Reach::Reached);
    let denied = wgfence_tests::probe::probe(
        &gw.peers[0].ns,
        Kind::Tcp(22),
        "10.8.0.1".parse().unwrap_or_else(|e| panic!("{e}")),
    );
    assert_eq!(denied, Reach::Blocked);
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline && matches!(monitor.try_wait(), Ok(None)) {
        thread::sleep(Duration::from_millis(20));
    }
    let _ = monitor.kill();
    let stdout = monitor.stdout.take().unwrap_or_else(|| panic!("no stdout"));
    let lines: Vec<String> = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .collect();
    let _ = monitor.wait();
    assert_eq!(lines.len(), 1, "{lines:?}");
    let event: serde_json::Value =
        serde_json::from_str(&lines[0]).unwrap_or_else(|e| panic!("{e}"));
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
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{e}"));
        let out = gw
            .node
            .command(wgfence_tests::agent::binary())
            .args(["plan", "--interface", gw.interface(), "--state"])
            .arg(&path)
            .output()
            .unwrap_or_else(|e| panic!("wgfence plan: {e}"));
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
