//! Rolling out a restriction (issue 16), with real WireGuard traffic in namespaces: audit mode
//! lets a peer's denied packets pass and counts each as a would-drop, reported by
//! `wgfence monitor`; switching the peer to enforce drops them from the next reconcile; unknown
//! sources are dropped in every mode.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{IpAddr, TcpListener, TcpStream, UdpSocket},
    process::{Child, Command, Stdio},
    sync::mpsc,
    thread,
    time::Duration,
};

use serde_json::{json, Value};
use wgfence::dataplane::Dataplane;
use wgfence_common::Counter;
use wgfence_tests::{
    agent::{binary, Agent, Layout},
    net::{wait_for, Netns},
    packet::{send_raw, Packet, UDP},
    probe::{probe, Kind, Reach},
    state,
    topology::Gateway,
};

/// Peer 0 may reach 10.2.3.4 on tcp/80 only: tcp/22 and every UDP port are denied.
fn rules() -> Value {
    json!([{ "cidr": "10.2.3.4/32", "protocol": "tcp", "ports": [80] }])
}

fn peer0(gw: &Gateway, mode: &str) -> Value {
    let mut p = gw.peer_json(0, Some(rules()));
    p["mode"] = mode.into();
    p
}

/// Peer 0's entry's would-drops (per-CPU counters summed), and the node-wide audit counter.
fn would_drops(gw: &Gateway) -> (u64, u64) {
    let maps = Dataplane::open_maps(&gw.bpffs, gw.interface()).unwrap_or_else(|e| panic!("{e}"));
    let entry = maps
        .peer(IpAddr::V4(gw.peers[0].v4))
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("peer 0 has no entry"));
    let peer = maps
        .peer_counters(entry.slot)
        .unwrap_or_else(|e| panic!("{e}"))
        .audit_packets;
    let total = maps.counters().unwrap_or_else(|e| panic!("{e}"));
    (peer, total.get(Counter::PassAudit))
}

fn unknown_source_drops(gw: &Gateway) -> u64 {
    Dataplane::open_maps(&gw.bpffs, gw.interface())
        .and_then(|m| m.counters())
        .map(|c| c.get(Counter::DropUnknownSource))
        .unwrap_or_else(|e| panic!("{e}"))
}

/// `wgfence monitor --json`, its events on a channel.
struct Monitor {
    child: Child,
    events: mpsc::Receiver<Value>,
}

impl Monitor {
    fn start(gw: &Gateway, state: &std::path::Path) -> Self {
        let mut child = Command::new(binary())
            .args([
                "monitor",
                "--interface",
                gw.interface(),
                "--json",
                "--state",
            ])
            .arg(state)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("wgfence monitor: {e}"));
        let stdout = child.stdout.take().unwrap_or_else(|| panic!("no stdout"));
        let mut stderr = child.stderr.take().unwrap_or_else(|| panic!("no stderr"));
        // It says so on stderr once it listens.
        let mut seen = String::new();
        let mut byte = [0u8; 1];
        while !seen.contains("monitoring") {
            match stderr.read(&mut byte) {
                Ok(1) => seen.push(char::from(byte[0])),
                _ => panic!("wgfence monitor stopped: {seen}"),
            }
        }
        // Keep reading stderr, so the monitor never writes to a closed pipe.
        thread::spawn(move || {
            let mut rest = String::new();
            let _ = stderr.read_to_string(&mut rest);
            if !rest.is_empty() {
                eprintln!("wgfence monitor: {rest}");
            }
        });
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let event = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line}: {e}"));
                if tx.send(event).is_err() {
                    break;
                }
            }
        });
        Self { child, events: rx }
    }

    /// Events that arrive within `wait`.
    fn drain(&self, wait: Duration) -> Vec<Value> {
        let mut all = Vec::new();
        while let Ok(event) = self.events.recv_timeout(wait) {
            all.push(event);
        }
        all
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `n` UDP datagrams from peer 0 to 10.2.3.4:9 (denied by its rules); returns how many
/// arrived at a socket on the node.
fn denied_udp(gw: &Gateway, n: u64) -> u64 {
    let listener = gw
        .node
        .enter(|| UdpSocket::bind("10.2.3.4:9"))
        .unwrap_or_else(|e| panic!("bind 10.2.3.4:9: {e}"));
    listener
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap_or_else(|e| panic!("{e}"));
    let sender = gw.peers[0]
        .ns
        .enter(|| UdpSocket::bind("0.0.0.0:0"))
        .unwrap_or_else(|e| panic!("{e}"));
    for _ in 0..n {
        sender
            .send_to(b"would-drop", "10.2.3.4:9")
            .unwrap_or_else(|e| panic!("{e}"));
        thread::sleep(Duration::from_millis(2));
    }
    let mut arrived = 0;
    let mut buf = [0u8; 64];
    while listener.recv(&mut buf).is_ok() {
        arrived += 1;
    }
    arrived
}

/// A packet from 10.8.0.99, an address WireGuard routes to peer 0 but no peer of the state
/// has: the datapath must drop it as unknown_source in every mode.
fn unknown_source_is_dropped(gw: &Gateway) {
    let before = unknown_source_drops(gw);
    let packet = Packet::new("10.8.0.99", "10.2.3.4", UDP, 9).ip();
    gw.peers[0]
        .ns
        .enter(|| send_raw(&packet))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        wait_for(Duration::from_secs(3), || unknown_source_drops(gw) > before).is_some(),
        "the packet from an unknown source was not dropped as unknown_source"
    );
}

/// A TCP connection from peer 0 to 10.2.3.4:22 that carries one request and its answer.
fn connect_22(ns: &Netns) -> Result<String, String> {
    ns.enter(|| {
        let addr = "10.2.3.4:22".parse().map_err(|e| format!("{e}"))?;
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(800))
            .map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_millis(800)))
            .map_err(|e| e.to_string())?;
        s.write_all(b"hello\n").map_err(|e| e.to_string())?;
        let mut answer = String::new();
        BufReader::new(s)
            .read_line(&mut answer)
            .map_err(|e| e.to_string())?;
        Ok(answer)
    })
}

#[test]
fn an_audited_peer_passes_and_counts_would_drops_until_it_is_enforced() {
    let gw = Gateway::new(1);
    let s = state(vec![peer0(&gw, "audit")]);
    let agent = Agent::start(&gw, Layout::Plain, &s, &["--peer-metrics"]);
    agent.wait_ready(&gw);
    // 10.8.0.99 reaches the datapath through WireGuard as peer 0's, but no peer has it.
    let key = gw.peers[0].wg.keys.public.clone();
    gw.wg.set_peer(
        &key,
        &["allowed-ips", "10.8.0.2/32,fd00:8::2/128,10.8.0.99/32"],
    );
    unknown_source_is_dropped(&gw);

    // A server on tcp/22, which peer 0's rules deny.
    let server = gw
        .node
        .enter(|| TcpListener::bind("10.2.3.4:22"))
        .unwrap_or_else(|e| panic!("bind 10.2.3.4:22: {e}"));
    thread::spawn(move || {
        for conn in server.incoming().map_while(Result::ok) {
            let mut reader = BufReader::new(&conn);
            let mut line = String::new();
            if reader.read_line(&mut line).is_ok() {
                let _ = (&conn).write_all(b"ssh-ok\n");
            }
        }
    });

    let monitor = Monitor::start(&gw, &agent.state);
    assert_eq!(
        connect_22(&gw.peers[0].ns).as_deref(),
        Ok("ssh-ok\n"),
        "the audited peer could not connect to tcp/22"
    );
    let events = monitor.drain(Duration::from_millis(1500));
    let audit: Vec<&Value> = events.iter().filter(|e| e["kind"] == "audit").collect();
    let c = Dataplane::open_maps(&gw.bpffs, gw.interface())
        .and_then(|m| m.counters())
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        !audit.is_empty(),
        "no AUDIT event: {events:?}; events sent {}, rate-limited {}, ring full {}, audit {}",
        c.get(Counter::EventSent),
        c.get(Counter::EventRateLimited),
        c.get(Counter::EventRingFull),
        c.get(Counter::PassAudit)
    );
    for e in &audit {
        assert_eq!(e["peer"], "peer0", "{e}");
        assert_eq!(e["reason"], "audit", "{e}");
        assert!(
            e["policy"].as_u64().is_some_and(|p| p > 0),
            "no rule set: {e}"
        );
        assert_eq!(e["dst"], "10.2.3.4", "{e}");
    }
    assert!(
        audit
            .iter()
            .any(|e| e["protocol"] == "tcp" && e["dstPort"] == 22),
        "{audit:?}"
    );

    // Exactly one would-drop per denied packet sent (and each one arrived).
    let (peer_before, total_before) = would_drops(&gw);
    let arrived = denied_udp(&gw, 200);
    let (peer_after, total_after) = would_drops(&gw);
    assert_eq!(arrived, 200, "audit mode dropped denied datagrams");
    assert_eq!(peer_after - peer_before, 200, "peer 0's would-drops");
    assert_eq!(total_after - total_before, 200, "the node's audit counter");
    // The same in `wgfence status` and /metrics.
    let out = Command::new(binary())
        .args(["status", "--interface", gw.interface(), "--json"])
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}"));
    let p0 = report["peerCounters"]
        .as_array()
        .and_then(|a| a.iter().find(|p| p["peer"] == "peer0"))
        .unwrap_or_else(|| panic!("no peer0 in {report:#}"));
    assert_eq!(p0["mode"], "audit", "{p0}");
    assert_eq!(p0["wouldDropPackets"].as_u64(), Some(peer_after), "{p0}");
    let metric = agent.metric(&gw, "wgfence_peer_would_drop_packets_total{peer=\"peer0\"}");
    assert_eq!(metric as u64, peer_after, "/metrics would-drops");
    unknown_source_is_dropped(&gw);

    // Enforce: within one reconcile the connection fails and the datagrams are dropped.
    let _ = monitor.drain(Duration::from_millis(500));
    let before = agent.reconciles(&gw);
    agent.write_state(&state(vec![peer0(&gw, "enforce")]));
    agent.wait_reconciles(&gw, before, 1.0);
    assert!(
        connect_22(&gw.peers[0].ns).is_err(),
        "tcp/22 still connects after the switch to enforce"
    );
    let (peer_before, _) = would_drops(&gw);
    assert_eq!(
        denied_udp(&gw, 50),
        0,
        "enforce let denied datagrams through"
    );
    assert_eq!(
        would_drops(&gw).0,
        peer_before,
        "would-drops counted in enforce mode"
    );
    assert_eq!(
        probe(
            &gw.peers[0].ns,
            Kind::Tcp(80),
            wgfence_tests::ip("10.2.3.4")
        ),
        Reach::Reached,
        "the allowed port stopped working"
    );
    let events = monitor.drain(Duration::from_millis(1000));
    let audits = events.iter().filter(|e| e["kind"] != "drop").count();
    assert_eq!(
        audits,
        0,
        "audit events in enforce mode, of {}",
        events.len()
    );
    assert!(
        events
            .iter()
            .any(|e| e["reason"] == "policy_denied" && e["peer"] == "peer0"),
        "no drop event for the denied packets"
    );
    unknown_source_is_dropped(&gw);
}
