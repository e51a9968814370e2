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
    let maps = Dataplane::open_maps(&gw.bpffs, gw.interface()).unwrap();
    let entry = maps
        .peer(IpAddr::V4(gw.peers[0].v4))
        .unwrap()
        .expect("peer 0 has no entry");
    let peer = maps.peer_counters(entry.slot).unwrap().audit_packets;
    let total = maps.counters().unwrap();
    (peer, total.get(Counter::PassAudit))
}

fn unknown_source_drops(gw: &Gateway) -> u64 {
    Dataplane::open_maps(&gw.bpffs, gw.interface())
        .and_then(|m| m.counters())
        .map(|c| c.get(Counter::DropUnknownSource))
        .unwrap()
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
            .expect("wgfence monitor");
        let stdout = child.stdout.take().expect("no stdout");
        let mut stderr = child.stderr.take().expect("no stderr");
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

/// The peer called `name` in `wgfence status --json`.
fn status_of(gw: &Gateway, name: &str) -> Value {
    let out = Command::new(binary())
        .args(["status", "--interface", gw.interface(), "--json"])
        .output()
        .unwrap();
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    report["peerCounters"]
        .as_array()
        .and_then(|a| a.iter().find(|p| p["peer"] == name))
        .cloned()
        .unwrap_or_else(|| panic!("no {name} in {report:#}"))
}

/// `n` UDP datagrams from peer 0 to 10.2.3.4:9 (denied by its rules); returns how many
/// arrived at a socket on the node.
fn denied_udp(gw: &Gateway, n: u64) -> u64 {
    let listener = gw
        .node
        .enter(|| UdpSocket::bind("10.2.3.4:9"))
        .expect("bind 10.2.3.4:9");
    listener
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let sender = gw.peers[0]
        .ns
        .enter(|| UdpSocket::bind("0.0.0.0:0"))
        .unwrap();
    for _ in 0..n {
        sender.send_to(b"would-drop", "10.2.3.4:9").unwrap();
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
    gw.peers[0].ns.enter(|| send_raw(&packet)).unwrap();
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
        .expect("bind 10.2.3.4:22");
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
        .unwrap();
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
    let p0 = status_of(&gw, "peer0");
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

/// Peer 0's rules for the counter tests. Canonical order (cidr, then protocol, then ports):
/// C = tcp 10.2.3.4:80 (index 0), A = udp 10.2.3.4:5000 (1), B = udp 10.9.1.1 (2).
fn counted_rules() -> Value {
    json!([
        { "cidr": "10.9.1.1/32", "protocol": "udp" },
        { "cidr": "10.2.3.4/32", "protocol": "udp", "ports": [5000] },
        { "cidr": "10.2.3.4/32", "protocol": "tcp", "ports": [80] },
    ])
}

const RULE_A: &str = "udp 10.2.3.4/32:5000";
const RULE_B: &str = "udp 10.9.1.1/32";
const RULE_C: &str = "tcp 10.2.3.4/32:80";

/// Every rule counter's packets, summed over CPUs, that is not 0: (index, packets).
fn nonzero_rule_counters(maps: &wgfence::dataplane::Maps) -> Vec<(u32, u64)> {
    (0..wgfence_common::MAX_RULES)
        .filter_map(|i| {
            let c = maps.rule_counters(i).unwrap();
            (c.packets > 0).then_some((i, c.packets))
        })
        .collect()
}

/// One rule counter as bpftool prints it (BTF field names), summed over the CPUs.
fn bpftool_rule_packets(gw: &Gateway, index: u32) -> u64 {
    let pin = gw
        .bpffs
        .join("wgfence")
        .join(gw.interface())
        .join(wgfence_common::map_names::RULE_STATS);
    let key: Vec<String> = index.to_le_bytes().iter().map(u8::to_string).collect();
    let mut args = vec!["bpftool", "-j", "map", "lookup", "pinned"];
    let pin = pin.to_string_lossy().into_owned();
    args.push(&pin);
    args.push("key");
    args.extend(key.iter().map(String::as_str));
    let out = wgfence_tests::net::run(&args);
    assert!(out.status.success(), "bpftool {args:?}: {out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"));
    v["formatted"]["values"]
        .as_array()
        .unwrap_or_else(|| panic!("no per-CPU values: {v}"))
        .iter()
        .map(|cpu| {
            cpu["value"]["packets"]
                .as_u64()
                .unwrap_or_else(|| panic!("no packets field: {cpu}"))
        })
        .sum()
}

/// `n` UDP datagrams from peer 0 to `dst`.
fn udp_from_peer0(gw: &Gateway, dst: &str, n: u32) {
    let sender = gw.peers[0]
        .ns
        .enter(|| UdpSocket::bind("0.0.0.0:0"))
        .unwrap();
    for _ in 0..n {
        sender.send_to(b"hit", dst).unwrap();
        thread::sleep(Duration::from_micros(300));
    }
}

#[test]
fn rule_counters_count_real_traffic_exactly_and_survive_a_sigkill() {
    let gw = Gateway::new(1);
    let s = state(vec![gw.peer_json(0, Some(counted_rules()))]);
    // A resync every second: the agent notes the counters that moved at each one.
    let args = ["--peer-metrics", "--resync", "1"];
    let mut agent = Agent::start(&gw, Layout::Plain, &s, &args);
    agent.wait_ready(&gw);
    let maps = Dataplane::open_maps(&gw.bpffs, gw.interface()).unwrap();
    let entry = maps
        .peer(IpAddr::V4(gw.peers[0].v4))
        .unwrap()
        .expect("no entry for peer 0");
    assert_ne!(entry.rules, wgfence_common::NO_RULES, "{entry:?}");
    let (c, a, b) = (entry.rules, entry.rules + 1, entry.rules + 2);

    udp_from_peer0(&gw, "10.2.3.4:5000", 1000);
    udp_from_peer0(&gw, "10.9.1.1:7000", 500);
    let settled = || nonzero_rule_counters(&maps) == vec![(a, 1000), (b, 500)];
    assert!(
        wait_for(Duration::from_secs(3), settled).is_some(),
        "rule counters: {:?} (A at {a}, B at {b})",
        nonzero_rule_counters(&maps)
    );
    let check = |agent: &Agent, when: &str| {
        assert_eq!(
            nonzero_rule_counters(&maps),
            vec![(a, 1000), (b, 500)],
            "{when}"
        );
        for (index, want) in [(a, 1000), (b, 500), (c, 0)] {
            assert_eq!(
                bpftool_rule_packets(&gw, index),
                want,
                "{when}: bpftool, counter {index}"
            );
        }
        let policy = entry.policy;
        for (rule, want) in [(RULE_A, 1000.0), (RULE_B, 500.0), (RULE_C, 0.0)] {
            let series = format!("wgfence_rule_hits_total{{policy=\"{policy}\",rule=\"{rule}\"}}");
            assert_eq!(agent.metric(&gw, &series), want, "{when}: {series}");
        }
    };
    check(&agent, "after the traffic");
    // Within a resync the agent has noted when A and B moved; C never did.
    let seen = |i: u32| maps.rule_seen(i).unwrap();
    assert!(
        wait_for(Duration::from_secs(5), || seen(a).packets == 1000
            && seen(b).packets == 500)
        .is_some(),
        "the agent did not note the hits: {:?} {:?}",
        seen(a),
        seen(b)
    );
    let (seen_a, seen_b) = (seen(a), seen(b));
    assert!(seen_a.last_hit_ns > 0 && seen_b.last_hit_ns > 0);
    assert_eq!(seen(c), wgfence_common::RuleSeen::default());

    unused_rules_are_c_alone(&gw);
    // A SIGKILL and a restart: the counters are adopted from the pins, unchanged.
    agent.kill();
    agent.restart(&gw, &args);
    agent.wait_ready(&gw);
    let after = Dataplane::open_maps(&gw.bpffs, gw.interface())
        .and_then(|m| m.peer(IpAddr::V4(gw.peers[0].v4)))
        .unwrap();
    assert_eq!(
        after.map(|e| (e.policy, e.rules)),
        Some((entry.policy, entry.rules))
    );
    check(&agent, "after a SIGKILL and a restart");
    thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        (seen(a), seen(b)),
        (seen_a, seen_b),
        "the last hits moved without a hit"
    );
    unused_rules_are_c_alone(&gw);
}

/// `status --rules`: C is never hit; since an hour ago, C alone is unused; since a minute from
/// now, all three are.
fn unused_rules_are_c_alone(gw: &Gateway) {
    // The one rule never hit.
    let out = Command::new(binary())
        .args(["status", "--interface", gw.interface(), "--rules", "--json"])
        .output()
        .unwrap();
    let unused: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"));
    let rules: Vec<&str> = unused
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["rule"].as_str())
        .collect();
    assert_eq!(rules, [RULE_C], "{unused:#}");
    // Not hit since an hour ago: C; since a minute from now: all three.
    let listed = |since: u64| -> usize {
        let since = wgfence::state::format_time(since);
        let out = Command::new(binary())
            .args([
                "status",
                "--interface",
                gw.interface(),
                "--rules",
                "--json",
                "--since",
            ])
            .arg(&since)
            .output()
            .unwrap();
        let v: Value =
            serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"));
        v.as_array().map_or(0, Vec::len)
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    assert_eq!(listed(now - 3600), 1);
    assert_eq!(listed(now + 60), 3);
}

#[test]
fn rule_counters_count_test_run_packets_exactly() {
    use wgfence::{
        dataplane::TestProgram,
        policy::{PortRange, Protocol, Rule},
    };
    use wgfence_common::{PeerEntry, PROTO_TCP};
    let mut program = TestProgram::load().unwrap();
    let base = 4000;
    let rules = [
        Rule::new(wgfence_tests::net("10.9.1.1/32"), Protocol::Udp, vec![]),
        Rule::new(
            wgfence_tests::net("10.2.3.4/32"),
            Protocol::Udp,
            vec![PortRange::single(5000)],
        ),
        Rule::new(
            wgfence_tests::net("10.2.3.4/32"),
            Protocol::Tcp,
            vec![PortRange::single(80)],
        ),
    ];
    let maps = program.maps_mut();
    wgfence_tests::install_policy(maps, 7, &rules);
    maps.upsert_peer(
        wgfence_tests::ip("10.8.0.2"),
        PeerEntry {
            policy: 7,
            slot: 3,
            owner: 1,
            rules: base,
            ..PeerEntry::default()
        },
    )
    .unwrap();
    let a = Packet::new("10.8.0.2", "10.2.3.4", UDP, 5000).frame();
    let b = Packet::new("10.8.0.2", "10.9.1.1", UDP, 7000).frame();
    let denied = Packet::new("10.8.0.2", "10.2.3.4", PROTO_TCP, 22).frame();
    for (frame, n, pass) in [(&a, 1000, true), (&b, 500, true), (&denied, 300, false)] {
        let run = program.run_repeat(frame, n).unwrap();
        assert_eq!(run.passed(), pass);
    }
    let nonzero = nonzero_rule_counters(program.maps());
    // Canonical order: C (tcp 10.2.3.4:80) 0, A (udp 10.2.3.4:5000) 1, B (udp 10.9.1.1) 2;
    // the denied packets count on no rule.
    assert_eq!(nonzero, vec![(base + 1, 1000), (base + 2, 500)]);
    let c = program.maps().rule_counters(base + 1).unwrap();
    assert_eq!(c.bytes, 1000 * a.len() as u64);
}

/// Sets the wall clock back by `secs` and puts it forward again when dropped, by the time that
/// passed meanwhile (measured on the monotonic clock), also when the test fails.
struct ClockSetBack {
    wall: std::time::SystemTime,
    since: std::time::Instant,
}

impl ClockSetBack {
    fn by(secs: u64) -> Self {
        let guard = Self {
            wall: std::time::SystemTime::now(),
            since: std::time::Instant::now(),
        };
        set_wall_clock(guard.wall - Duration::from_secs(secs));
        guard
    }
}

impl Drop for ClockSetBack {
    fn drop(&mut self) {
        set_wall_clock(self.wall + self.since.elapsed());
    }
}

fn set_wall_clock(t: std::time::SystemTime) {
    let d = t.duration_since(std::time::UNIX_EPOCH).unwrap();
    let ts = libc::timespec {
        tv_sec: d.as_secs() as libc::time_t,
        tv_nsec: libc::c_long::from(d.subsec_nanos() as i32),
    };
    // SAFETY: clock_settime reads the timespec it is given.
    let rc = unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) };
    assert_eq!(rc, 0, "clock_settime: {}", std::io::Error::last_os_error());
}

/// `ping -D` every 10 ms from `ns` to `dst`, `count` times: the wall-clock times (seconds
/// since the epoch) of the replies that came back.
fn timed_pings(ns: &Netns, dst: &str, count: u32) -> Child {
    ns.command("ping")
        .args([
            "-D",
            "-n",
            "-i",
            "0.01",
            "-W",
            "1",
            "-c",
            &count.to_string(),
            dst,
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ping")
}

fn reply_times(child: Child) -> Vec<f64> {
    let out = child.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("bytes from"))
        .filter_map(|l| l.strip_prefix('[')?.split_once(']')?.0.parse().ok())
        .collect()
}

#[test]
fn a_peer_expires_in_the_kernel_with_no_agent_running_and_a_clock_set_back_does_not_revive_it() {
    let gw = Gateway::new(2);
    let mut agent = Agent::start(
        &gw,
        Layout::Plain,
        &state(vec![gw.peer_json(0, None), gw.peer_json(1, None)]),
        &[],
    );
    agent.wait_ready(&gw);
    // The window is given once the agent runs, so a slow start (a loaded machine) cannot eat
    // it: it expires on a whole second, 4 to 5 s from now.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let expires = now.as_secs() + 5;
    let mut windowed = gw.peer_json(0, None);
    windowed["expires"] = wgfence::state::format_time(expires).into();
    let before = agent.reconciles(&gw);
    agent.write_state(&state(vec![windowed, gw.peer_json(1, None)]));
    agent.wait_reconciles(&gw, before, 1.0);
    // `status` shows the window.
    let p0 = status_of(&gw, "peer0");
    assert_eq!(
        p0["window"]["expires"],
        wgfence::state::format_time(expires),
        "{p0}"
    );
    assert_eq!(p0["window"]["closed"], false, "{p0}");
    // No agent from here on.
    agent.kill();

    let left = Duration::from_secs(expires).saturating_sub(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default(),
    );
    // 10 ms pings from before the end of the window to 1.5 s after it, from the windowed peer
    // and from a peer without a window.
    let count = ((left.as_secs_f64() + 1.5) * 100.0) as u32;
    let windowed = timed_pings(&gw.peers[0].ns, "10.1.2.3", count);
    let control = timed_pings(&gw.peers[1].ns, "10.1.2.3", count);
    let (windowed, control) = (reply_times(windowed), reply_times(control));
    let end = expires as f64;
    let last = windowed.iter().copied().fold(0.0, f64::max);
    eprintln!(
        "windowed peer: {} replies, the last {:.1} ms after expires; control: {} replies, the \
         last {:.1} ms after expires",
        windowed.len(),
        (last - end) * 1000.0,
        control.len(),
        (control.iter().copied().fold(0.0, f64::max) - end) * 1000.0
    );
    assert!(
        windowed.iter().any(|t| *t > end - 0.5),
        "the windowed peer's pings did not pass until shortly before expires"
    );
    // A reply is stamped when it arrives, a round trip after the request passed the datapath.
    assert!(
        last < end + 0.05,
        "a ping passed {:.1} ms after expires",
        (last - end) * 1000.0
    );
    assert!(
        control.iter().any(|t| *t > end + 1.0),
        "the peer without a window stopped too: the datapath is not what stopped the pings"
    );

    // The wall clock an hour back: the window lies on the boot clock, the peer stays cut off.
    let clock = ClockSetBack::by(3600);
    let pings = timed_pings(&gw.peers[0].ns, "10.1.2.3", 50);
    let control = timed_pings(&gw.peers[1].ns, "10.1.2.3", 50);
    let (after, control) = (reply_times(pings), reply_times(control));
    drop(clock);
    assert_eq!(
        after.len(),
        0,
        "pings passed with the clock set back an hour"
    );
    assert!(!control.is_empty(), "the control peer's pings stopped");
    let drops = Dataplane::open_maps(&gw.bpffs, gw.interface())
        .and_then(|m| m.counters())
        .map(|c| c.get(Counter::DropExpired))
        .unwrap();
    assert!(drops >= 50, "{drops} packets counted as expired");

    // A new agent revokes the expired peer from WireGuard as well.
    agent.restart(&gw, &[]);
    agent.wait_ready(&gw);
    let key = gw.peers[0].wg.keys.public.clone();
    assert!(
        !gw.wg_peers().contains(&key),
        "the expired peer is still a WireGuard peer"
    );
}
