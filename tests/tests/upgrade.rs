//! Map layout upgrade: a datapath of layout 3, made and run by that version's own agent (the
//! binary of commit f530f25), is upgraded to layout 4 by this agent under 10 ms packet streams
//! without losing an allowed packet or passing a denied one, on tcx and on the legacy TC hook;
//! a rollback to the layout-3 agent (or the layout-2 one) is refused before it attaches
//! anything, and enforcement goes on unchanged. A layout-2 datapath is refused with the way
//! through a layout-3 agent, and keeps enforcing.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    net::{IpAddr, UdpSocket},
    process::{Child, Command, Output, Stdio},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use serde_json::{json, Value};
use wgfence::dataplane::Dataplane;
use wgfence_tests::{
    agent::{binary, v2_binary, v3_binary, Agent, Layout},
    bench::gen,
    map_mismatch,
    net::Netns,
    probe::{probe, Kind, Reach},
    topology::Gateway,
};

/// Generated peers beside the gateway's real ones.
const GENERATED: usize = 10_000;

/// Peer 0: tcp/80 to 10.2.3.4 and ICMP to the node's tunnel address, nothing else.
fn restricted() -> Value {
    json!([
        { "cidr": "10.2.3.4/32", "protocol": "tcp", "ports": [80] },
        { "cidr": "10.8.0.1/32", "protocol": "icmp" },
    ])
}

/// A `ping` every 10 ms from `ns` to `dst` (`-I src` when given), `count` times.
fn ping_stream(ns: &Netns, dst: &str, src: Option<&str>, count: u32) -> Child {
    let count = count.to_string();
    let mut args = vec!["-n", "-q", "-i", "0.01", "-W", "1", "-c", &count];
    if let Some(src) = src {
        args.extend(["-I", src]);
    }
    args.push(dst);
    ns.command("ping")
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ping")
}

/// (transmitted, received) from ping's summary line.
fn ping_counts(name: &str, child: Child) -> (u64, u64) {
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains("packets transmitted"))
        .unwrap_or_else(|| panic!("{name}: no summary in {out:?}"));
    let number = |what: &str| -> u64 {
        line.split(',')
            .find(|part| part.contains(what))
            .and_then(|part| part.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{name}: no {what:?} in {line:?}"))
    };
    (number("transmitted"), number("received"))
}

/// Denied UDP datagrams from peer 0 to 10.2.3.4:9 every 10 ms, counted where they would
/// arrive: a socket on the node. Stops when `stop` is set; returns (sent, arrived).
struct DeniedUdp {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    arrived: Arc<AtomicU64>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl DeniedUdp {
    fn start(gw: &Gateway) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let arrived = Arc::new(AtomicU64::new(0));
        let listener = gw.node.enter(|| UdpSocket::bind("10.2.3.4:9"));
        let listener = listener.expect("bind 10.2.3.4:9 on the node");
        listener
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let sender = gw.peers[0].ns.enter(|| UdpSocket::bind("0.0.0.0:0"));
        let sender = sender.expect("bind on peer 0");
        let (s1, a1, s2, n2) = (stop.clone(), arrived.clone(), stop.clone(), sent.clone());
        let threads = vec![
            thread::spawn(move || {
                let mut buf = [0u8; 64];
                while !s1.load(Ordering::Relaxed) {
                    if listener.recv(&mut buf).is_ok() {
                        a1.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }),
            thread::spawn(move || {
                while !s2.load(Ordering::Relaxed) {
                    if sender.send_to(b"denied", "10.2.3.4:9").is_ok() {
                        n2.fetch_add(1, Ordering::Relaxed);
                    }
                    thread::sleep(Duration::from_millis(10));
                }
            }),
        ];
        Self {
            stop,
            sent,
            arrived,
            threads,
        }
    }

    fn finish(self) -> (u64, u64) {
        // Let the last datagrams arrive if they were going to.
        thread::sleep(Duration::from_millis(300));
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
        (
            self.sent.load(Ordering::Relaxed),
            self.arrived.load(Ordering::Relaxed),
        )
    }
}

/// Every stream of the test: allowed ones must lose nothing, denied ones pass nothing.
struct Streams {
    allowed: Vec<(&'static str, Child)>,
    denied_ping: Child,
    denied_udp: DeniedUdp,
}

impl Streams {
    fn start(gw: &Gateway, count: u32) -> Self {
        Self {
            allowed: vec![
                (
                    "peer 0 (restricted) -> node, ICMP allowed",
                    ping_stream(&gw.peers[0].ns, "10.8.0.1", None, count),
                ),
                (
                    "peer 1 (unrestricted) -> 10.1.2.3",
                    ping_stream(&gw.peers[1].ns, "10.1.2.3", None, count),
                ),
                (
                    "node -> peer 0, replies pass as a flow",
                    ping_stream(&gw.node, "10.8.0.2", Some("10.1.2.3"), count),
                ),
            ],
            denied_ping: ping_stream(&gw.peers[0].ns, "10.2.3.4", None, count),
            denied_udp: DeniedUdp::start(gw),
        }
    }

    /// Waits for the streams and checks them; returns a line of counts for the log.
    #[track_caller]
    fn check(self, when: &str) -> String {
        let mut report = Vec::new();
        for (name, child) in self.allowed {
            let (sent, received) = ping_counts(name, child);
            assert!(sent > 0, "{when}: {name}: nothing sent");
            assert_eq!(
                received,
                sent,
                "{when}: {name}: {} of {sent} allowed packets lost",
                sent - received
            );
            report.push(format!("{name}: {received}/{sent}"));
        }
        let (sent, received) = ping_counts("denied ping", self.denied_ping);
        assert_eq!(
            received, 0,
            "{when}: peer 0 -> 10.2.3.4 ICMP is denied, {received} of {sent} passed"
        );
        report.push(format!("denied ping: {received}/{sent} passed"));
        let (sent, arrived) = self.denied_udp.finish();
        assert!(sent > 0);
        assert_eq!(
            arrived, 0,
            "{when}: peer 0 -> 10.2.3.4 udp/9 is denied, {arrived} of {sent} arrived"
        );
        report.push(format!("denied udp: {arrived}/{sent} arrived"));
        report.join("; ")
    }
}

/// `wgfence status --json` with `bin`.
fn status_json(bin: &std::path::Path, gw: &Gateway) -> Value {
    let out = Command::new(bin)
        .args(["status", "--interface", gw.interface(), "--json"])
        .output()
        .expect("wgfence status");
    assert!(out.status.success(), "status failed: {out:?}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("status --json: {e}: {out:?}"))
}

/// Per-peer counters by the peer's IPv4 address.
fn peer_counters(report: &Value) -> BTreeMap<String, Value> {
    report["peerCounters"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| {
            let v4 = p["addresses"]
                .as_array()?
                .iter()
                .filter_map(Value::as_str)
                .find(|a| !a.contains(':'))?
                .to_owned();
            Some((v4, p.clone()))
        })
        .collect()
}

/// The names of the pins of the interface's pin directory.
fn pins(gw: &Gateway) -> BTreeSet<String> {
    let dir = gw.bpffs.join("wgfence").join(gw.interface());
    fs::read_dir(&dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Pins of layouts 1 to 3.
fn old_pins(gw: &Gateway) -> Vec<String> {
    pins(gw)
        .into_iter()
        .filter(|p| ["wgf1_", "wgf2_", "wgf3_"].iter().any(|l| p.starts_with(l)))
        .collect()
}

/// What an upgraded datapath keeps of the older layouts: their tombstones.
const TOMBSTONES: [&str; 3] = ["wgf1_peers_v4", "wgf2_peers_v4", "wgf3_peers_v4"];

/// `bin` with only the capabilities the DaemonSet gives the agent (CAP_BPF, CAP_PERFMON,
/// CAP_NET_ADMIN; no CAP_SYS_ADMIN, so no looking up programs or maps by id): a script in
/// `dir` that drops the rest and runs it.
fn with_daemonset_caps(dir: &std::path::Path, bin: &std::path::Path) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt as _;
    let name = bin.file_name().map(|n| n.to_string_lossy().into_owned());
    let script = dir.join(format!(
        "{}-daemonset-caps-{}",
        name.unwrap_or_default(),
        fs::read_dir(dir).map(|d| d.count()).unwrap_or_default()
    ));
    let text = format!(
        "#!/bin/sh\nexec setpriv --bounding-set=-all,+bpf,+perfmon,+net_admin {} \"$@\"\n",
        bin.display()
    );
    fs::write(&script, text).unwrap_or_else(|e| panic!("{}: {e}", script.display()));
    fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
    script
}

/// Runs `wgfence run` with `bin` on the gateway; it must exit by itself within 20 s (it is
/// killed and the test fails otherwise).
fn run_refused(bin: &std::path::Path, gw: &Gateway, state: &std::path::Path) -> Output {
    run_to_exit(bin, gw, state, &[])
}

/// [`run_refused`] with environment variables (e.g. `WGFENCE_FAILPOINT`).
fn run_to_exit(
    bin: &std::path::Path,
    gw: &Gateway,
    state: &std::path::Path,
    env: &[(&str, &str)],
) -> Output {
    let mut command = wgfence_tests::agent::run_command(bin, gw, state);
    command
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = wgfence_tests::spawn(&mut command)
        .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
    let start = Instant::now();
    while child.try_wait().ok().flatten().is_none() {
        if start.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let out = child.wait_with_output();
            panic!(
                "{} was not refused: it still ran after 20 s: {out:?}",
                bin.display()
            );
        }
        thread::sleep(Duration::from_millis(20));
    }
    child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("{}: {e}", bin.display()))
}

#[test]
fn a_layout_3_datapath_is_upgraded_under_traffic_and_a_rollback_is_refused() {
    let v1 = v3_binary();
    let gw = Gateway::new(3);
    // 10,000 generated peers (WireGuard peers without sessions, policies from a pool) beside
    // the three real ones: the fill has real work to do, and an agent that attached empty maps
    // would need a long first apply.
    let mut generated = gen::state(GENERATED, 11);
    let Some(peers) = generated["peers"].as_array_mut() else {
        panic!("generated state without peers");
    };
    peers.extend([
        gw.peer_json(0, Some(restricted())),
        gw.peer_json(1, None),
        gw.peer_json(2, None),
    ]);
    let s = generated.to_string();
    let desired = wgfence::state::parse(&s).unwrap();

    // The layout-3 datapath, made by the layout-3 agent.
    // Both versions run with the DaemonSet's capabilities, as they would on a node.
    let scripts = std::env::temp_dir().join(wgfence_tests::net::unique("wgfence-caps-"));
    fs::create_dir_all(&scripts).unwrap();
    let v1_caps = with_daemonset_caps(&scripts, &v1);
    let v2 = with_daemonset_caps(&scripts, &binary());
    let mut agent = Agent::start_binary(v1_caps.clone(), &gw, Layout::Plain, &s, &[]);
    agent.wait_readyz_for(&gw, 200, Duration::from_secs(120));
    let layout = Dataplane::running_layout(&gw.bpffs, gw.interface()).unwrap();
    assert_eq!(
        layout,
        Some(3),
        "the layout-3 agent did not attach layout 3"
    );
    // This version's `status` names the layout the attached programs run.
    let out = Command::new(binary())
        .args(["status", "--interface", gw.interface()])
        .output()
        .expect("wgfence status");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("runs map layout 3"),
        "status on a layout-3 datapath: {out:?}"
    );

    // A flow the network started toward peer 0 under layout 3: node 10.1.2.3:4000 -> peer 0
    // port 5000. Peer 0's answers to it pass only as replies (its policy denies them).
    let node_sock = gw.node.enter(|| UdpSocket::bind("10.1.2.3:4000")).unwrap();
    node_sock
        .set_read_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    let peer_sock = gw.peers[0]
        .ns
        .enter(|| UdpSocket::bind("10.8.0.2:5000"))
        .unwrap();
    let stranger = gw.peers[0]
        .ns
        .enter(|| UdpSocket::bind("10.8.0.2:5001"))
        .unwrap();
    let reply_arrives = |from: &UdpSocket| -> bool {
        from.send_to(b"reply", "10.1.2.3:4000").unwrap();
        let mut buf = [0u8; 16];
        node_sock.recv(&mut buf).is_ok()
    };
    node_sock.send_to(b"start", "10.8.0.2:5000").unwrap();
    thread::sleep(Duration::from_millis(200));
    assert!(
        reply_arrives(&peer_sock),
        "layout 3: the reply to the flow did not pass"
    );
    assert!(
        !reply_arrives(&stranger),
        "layout 3: a packet of no flow passed"
    );

    // Peer 2 sends only now, under layout 3: its counters must come through unchanged.
    let out = gw.peers[2]
        .ns
        .try_exec(&["ping", "-n", "-q", "-i", "0.002", "-c", "500", "10.1.2.3"]);
    assert!(out.status.success(), "{out:?}");

    // Not while the layout-3 agent still runs: it would attach its programs again. (It locks
    // the pin directory as this agent does, so the lock refuses first, naming it.)
    let out = run_refused(&v2, &gw, &agent.state);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!(
        "started next to the layout-3 agent: {:?}\n{stderr}",
        out.status
    );
    let pid = agent.pid().expect("the layout-3 agent runs");
    assert!(
        !out.status.success()
            && (stderr.contains(&format!("pid [{pid}] holds the link"))
                || stderr.contains(&format!("locked by another wgfence agent (pid {pid})"))),
        "started next to the running layout-3 agent: {out:?}"
    );
    assert_eq!(
        Dataplane::running_layout(&gw.bpffs, gw.interface()).unwrap(),
        Some(3)
    );

    // 10 ms streams across the upgrade.
    let streams = Streams::start(&gw, 800);
    thread::sleep(Duration::from_secs(1));
    let v1_status = status_json(&v1, &gw);
    let stopped = agent.stop();
    assert!(
        stopped.is_some_and(|s| s.success()),
        "the layout-3 agent did not stop cleanly"
    );
    let v1_final = status_json(&v1, &gw);
    assert!(v1_final["packets"]["pass"].as_u64() >= v1_status["packets"]["pass"].as_u64());
    let (link_v1, prog_v1) = Dataplane::ingress_link_info(&gw.bpffs, gw.interface())
        .ok()
        .flatten()
        .expect("no pinned link under layout 3");

    agent.binary = v2.clone();
    let t = Instant::now();
    agent.restart(&gw, &[]);
    agent.wait_readyz_for(&gw, 200, Duration::from_secs(120));
    let ready = t.elapsed();
    // Right after the upgrade, before the streams have added much: the counters are the
    // layout-3 ones plus.
    let v2_status = status_json(&binary(), &gw);
    let report = streams.check("across the upgrade");
    eprintln!("upgrade (start to ready in {ready:?}): {report}");

    let log = agent.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("upgraded the datapath from map layout 3 to 4"))
        .unwrap_or_else(|| panic!("no upgrade line in the log:\n{log}"));
    eprintln!("{line}");
    assert!(line.contains("switch_us="), "{line}");

    // The programs were replaced through the same links; the layout-3 maps are gone but for
    // the tombstones.
    let (link_v2, prog_v2) = Dataplane::ingress_link_info(&gw.bpffs, gw.interface())
        .ok()
        .flatten()
        .expect("no pinned link after the upgrade");
    assert_eq!(
        link_v2, link_v1,
        "the upgrade made a new link instead of updating the pinned one"
    );
    assert_ne!(prog_v2, prog_v1);
    assert_eq!(
        Dataplane::running_layout(&gw.bpffs, gw.interface()).unwrap(),
        Some(4)
    );
    assert_eq!(old_pins(&gw), TOMBSTONES, "pins: {:?}", pins(&gw));
    assert_eq!(v2_status["layoutVersion"], 4, "{v2_status:#}");
    let text = Command::new(binary())
        .args(["status", "--interface", gw.interface()])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&text.stdout).contains("(layout v4,"),
        "{text:?}"
    );

    // The layout-4 maps hold the state: every peer, each policy in a trie of its own, and the
    // owners layout 3 gave (one per address, as the planner allocates them: a flow counts only
    // for the entry of its own address). That they are layout 3's own, not new ones, shows in
    // the flow below: recorded under layout 3, it still belongs to its entry.
    let maps = Dataplane::open_maps(&gw.bpffs, gw.interface()).unwrap();
    assert_eq!(map_mismatch(&maps, &desired), None);
    let peers = maps.peers().unwrap();
    let mut owners: BTreeSet<u64> = BTreeSet::new();
    for (_, entry) in &peers {
        assert_ne!(entry.owner, 0, "{peers:?}");
        owners.insert(entry.owner);
        assert_eq!(
            (entry.flags, entry.expires_ns),
            (0, u64::MAX),
            "an entry got audit mode or a window the state does not give: {entry:?}"
        );
    }
    assert_eq!(
        owners.len(),
        peers.len(),
        "owners are not one per address: {peers:?}"
    );

    // The flow came over, owned by peer 0's entry and counted against its quota; its reply
    // still passes, a packet of no flow still does not.
    let entry0 = peers
        .iter()
        .find(|(a, _)| *a == IpAddr::from([10, 8, 0, 2]))
        .map(|(_, e)| *e)
        .unwrap_or_else(|| panic!("no entry for peer 0: {peers:?}"));
    let flows = maps.flows().unwrap();
    let udp = flows
        .iter()
        .find(|f| f.protocol == 17 && f.peer_port == 5000 && f.remote_port == 4000)
        .unwrap_or_else(|| panic!("the UDP flow was not carried over: {flows:?}"));
    assert_eq!(udp.value.owner, entry0.owner);
    assert_eq!(udp.value.slot, entry0.slot);
    let (made, freed) = maps.flow_quota(entry0.slot).unwrap();
    assert!(made > freed, "flow_made {made}, flow_freed {freed}");
    assert!(
        reply_arrives(&peer_sock),
        "layout 4: the reply to the carried flow did not pass"
    );
    assert!(
        !reply_arrives(&stranger),
        "layout 4: a packet of no flow passed"
    );

    // Counters carried: peer 2 sent nothing since, so its counters are exactly layout 3's;
    // the totals are at least layout 3's final ones.
    let c1 = peer_counters(&v1_final);
    let c2 = peer_counters(&v2_status);
    for field in ["passPackets", "passBytes", "dropPackets", "dropBytes"] {
        assert_eq!(
            c2["10.8.0.4"][field], c1["10.8.0.4"][field],
            "peer 2's {field} was not carried over"
        );
    }
    assert!(c1["10.8.0.4"]["passPackets"].as_u64() >= Some(500));
    for (key, what) in [("packets", "pass"), ("dropped", "policy_denied")] {
        let (before, after) = (v1_final[key][what].as_u64(), v2_status[key][what].as_u64());
        assert!(
            after >= before && before > Some(0),
            "{key}.{what}: {before:?} under layout 3, {after:?} after the upgrade"
        );
    }
    for (addr, v1c) in &c1 {
        assert!(
            c2[addr]["passPackets"].as_u64() >= v1c["passPackets"].as_u64(),
            "{addr}: {} -> {}",
            v1c,
            c2[addr]
        );
    }

    // Rollback: the layout-3 agent is refused before it attaches anything, naming the map,
    // and the layout-4 datapath keeps enforcing throughout.
    assert!(agent.stop().is_some_and(|s| s.success()));
    let streams = Streams::start(&gw, 300);
    thread::sleep(Duration::from_millis(500));
    let out = run_refused(&v1_caps, &gw, &agent.state);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!(
        "layout-3 agent on the layout-4 datapath: {:?}\n{stderr}",
        out.status
    );
    assert!(
        !out.status.success(),
        "the layout-3 agent ran on a layout-4 datapath"
    );
    assert!(
        stderr.contains("wgf3_peers_v4"),
        "the refusal does not name the map: {stderr}"
    );
    let report = streams.check("during the refused rollback");
    eprintln!("rollback: {report}");
    assert_eq!(
        Dataplane::ingress_link_info(&gw.bpffs, gw.interface())
            .ok()
            .flatten(),
        Some((link_v2, prog_v2)),
        "the refused agent changed the link"
    );
    assert!(
        reply_arrives(&peer_sock),
        "after the rollback: the flow's reply did not pass"
    );
    // What the refused agent left (maps it created before it checked) ...
    let junk = old_pins(&gw);
    assert!(junk.len() > 3, "the refused agent left no pins? {junk:?}");

    // ... goes at the next start of this version.
    agent.restart(&gw, &[]);
    agent.wait_readyz_for(&gw, 200, Duration::from_secs(120));
    assert_eq!(old_pins(&gw), TOMBSTONES, "pins: {:?}", pins(&gw));
    assert!(agent
        .log_text()
        .contains("removed map pins of older layouts"));
    assert_eq!(
        Dataplane::ingress_link_info(&gw.bpffs, gw.interface())
            .ok()
            .flatten()
            .map(|l| l.0),
        Some(link_v2)
    );

    // `wgfence detach` removes the tombstone and such leftovers too.
    assert!(agent.stop().is_some_and(|s| s.success()));
    let out = run_refused(&v1_caps, &gw, &agent.state);
    assert!(!out.status.success());
    assert!(old_pins(&gw).len() > 3);
    // The layout-2 agent is refused the same way, at its own tombstone.
    let v2_caps = with_daemonset_caps(&scripts, &v2_binary());
    let out = run_refused(&v2_caps, &gw, &agent.state);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("wgf2_peers_v4"),
        "the layout-2 agent on a layout-4 datapath: {out:?}"
    );
    let out = Command::new(binary())
        .args(["detach", "--interface", gw.interface()])
        .output()
        .expect("wgfence detach");
    assert!(out.status.success(), "{out:?}");
    let dir = gw.bpffs.join("wgfence").join(gw.interface());
    assert!(!dir.exists(), "detach left {:?}", pins(&gw));
    let _ = fs::remove_dir_all(&scripts);
}

/// An upgrade interrupted before its switch left `wgf4_*` pins that nothing runs (here one
/// planted by hand, holding an entry layout 3 never had), and the state file is invalid when
/// the new agent starts: the upgrade still fills from the layout-3 maps alone, and the agent
/// keeps enforcing exactly that (not ready, nothing applied).
#[test]
fn an_upgrade_ignores_stale_new_maps_and_keeps_enforcing_without_a_valid_state() {
    let gw = Gateway::new(1);
    let s = serde_json::json!({ "version": 1, "peers": [gw.peer_json(0, Some(restricted()))] })
        .to_string();
    let desired = wgfence::state::parse(&s).unwrap();
    let mut agent = Agent::start_binary(v3_binary(), &gw, Layout::Plain, &s, &[]);
    agent.wait_ready(&gw);
    assert!(agent.stop().is_some_and(|s| s.success()));

    let dir = gw.bpffs.join("wgfence").join(gw.interface());
    let stale = dir.join("wgf4_peers_v4");
    let stale = stale.to_string_lossy();
    let bpftool = |args: &[&str]| {
        let out = wgfence_tests::net::run(&[&["bpftool"][..], args].concat());
        assert!(out.status.success(), "bpftool {args:?}: {out:?}");
    };
    bpftool(&[
        "map",
        "create",
        &stale,
        "type",
        "hash",
        "key",
        "4",
        "value",
        "40",
        "entries",
        "131072",
        "name",
        "wgf4_peers_v4",
    ]);
    // 10.99.0.1: unrestricted, slot 7, owner 99, no flags, no rules, no window.
    let mut value: Vec<String> = [0u8, 0, 0, 0, 7, 0, 0, 0, 99, 0, 0, 0, 0, 0, 0, 0]
        .iter()
        .chain(&[0, 0, 0, 0, 255, 255, 255, 255])
        .chain(&[0; 8])
        .chain(&[255; 8])
        .map(u8::to_string)
        .collect();
    let mut args: Vec<String> = [
        "map", "update", "pinned", &stale, "key", "10", "99", "0", "1",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    args.push("value".into());
    args.append(&mut value);
    bpftool(&args.iter().map(String::as_str).collect::<Vec<_>>());

    agent.write_state("{ not json");
    agent.binary = with_daemonset_caps(&agent.dir, &binary());
    agent.restart(&gw, &[]);
    agent.wait_readyz(&gw, 503);
    let log = agent.log_text();
    assert!(
        log.contains("upgraded the datapath from map layout 3 to 4"),
        "{log}"
    );
    let maps = Dataplane::open_maps(&gw.bpffs, gw.interface()).unwrap();
    let peers = maps.peers().unwrap();
    assert!(
        peers
            .iter()
            .all(|(a, _)| *a != IpAddr::from([10, 99, 0, 1])),
        "the stale entry survived: {peers:?}"
    );
    // Exactly the layout-3 state, copied (no valid state to apply: the agent rewrites
    // nothing): the policy's entries are what the state compiles to, in a trie of their own.
    let mut want: Vec<_> = desired.peers[0]
        .policy
        .as_deref()
        .map(|p| p.entries().map(|(n, a)| (n, a.to_vec())).collect())
        .expect("peer 0 has egress rules");
    let mut have: Vec<_> = maps
        .policies()
        .unwrap()
        .into_iter()
        .map(|e| (e.prefix, e.value.allows().to_vec()))
        .collect();
    want.sort();
    have.sort();
    assert_eq!(have, want);
    assert_eq!(peers.len(), 2, "{peers:?}");
    assert_eq!(old_pins(&gw), TOMBSTONES, "pins: {:?}", pins(&gw));
    for (kind, dst, expect) in [
        (Kind::Tcp(80), "10.2.3.4", Reach::Reached),
        (Kind::Tcp(22), "10.2.3.4", Reach::Blocked),
    ] {
        let dst: IpAddr = dst.parse().unwrap();
        assert_eq!(probe(&gw.peers[0].ns, kind, dst), expect, "{kind} to {dst}");
    }
}

/// Where an upgrade is interrupted (debug builds abort at these failpoints, as a SIGKILL there
/// would).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Interrupted {
    /// The egress link runs layout 4, the ingress link still layout 3.
    BetweenLinks,
    /// Both links run layout 4; every layout-3 pin is still there.
    AfterSwitch,
    /// Both links run layout 4 and some of the layout-3 pins are removed.
    WhileUnpinning,
}

/// A layout-3 datapath (made by the layout-3 agent, with a reply flow recorded toward peer 0),
/// an upgrade interrupted at `at`, and this agent started again (with the DaemonSet's
/// capabilities, or as root with `root`): it starts, enforces layout 4, tidies layout 3 away
/// (only the tombstones are left), finishes an upgrade the interruption left half done instead
/// of redoing a finished one, and the flow quota of peer 0's slot counts exactly the flows
/// its table holds (`made - freed` = live).
fn interrupted_upgrade_resumes(at: Interrupted, root: bool) {
    let v1 = v3_binary();
    let gw = Gateway::new(1);
    let s = wgfence_tests::state(vec![gw.peer_json(0, Some(restricted()))]);
    let scripts = std::env::temp_dir().join(wgfence_tests::net::unique("wgfence-caps-"));
    fs::create_dir_all(&scripts).unwrap();
    let v1_caps = with_daemonset_caps(&scripts, &v1);
    let v2_caps = with_daemonset_caps(&scripts, &binary());
    let mut agent = Agent::start_binary(v1_caps, &gw, Layout::Plain, &s, &[]);
    agent.wait_readyz_for(&gw, 200, Duration::from_secs(60));
    // A flow the network starts toward peer 0, recorded by the layout-3 egress program.
    let node_sock = gw.node.enter(|| UdpSocket::bind("10.1.2.3:4000")).unwrap();
    node_sock.send_to(b"start", "10.8.0.2:5000").unwrap();
    assert!(agent.stop().is_some_and(|s| s.success()));

    let failpoint = match at {
        Interrupted::BetweenLinks => "upgrade-switched-link_egress",
        Interrupted::AfterSwitch => "upgrade-switched-link_ingress",
        Interrupted::WhileUnpinning => "upgrade-unpinning",
    };
    let out = run_to_exit(
        &v2_caps,
        &gw,
        &agent.state,
        &[("WGFENCE_FAILPOINT", failpoint)],
    );
    assert!(
        !out.status.success(),
        "the failpoint did not stop it: {out:?}"
    );
    eprintln!("interrupted {at:?}: {:?}", pins(&gw));

    agent.binary = if root { binary() } else { v2_caps };
    agent.restart(&gw, &[]);
    agent.wait_readyz_for(&gw, 200, Duration::from_secs(30));
    let log = agent.log_text();
    let upgraded = log.contains("map layout 3: upgrading it");
    if at == Interrupted::BetweenLinks {
        assert!(
            upgraded,
            "the half-done upgrade was not finished; log:\n{log}"
        );
    } else {
        assert!(
            !upgraded,
            "a finished switch was upgraded again; log:\n{log}"
        );
    }
    assert_eq!(
        Dataplane::running_layout(&gw.bpffs, gw.interface()).unwrap(),
        Some(4)
    );
    let left = pins(&gw);
    assert_eq!(
        old_pins(&gw),
        TOMBSTONES,
        "layout 3 not tidied (only the tombstones stay): {left:?}"
    );
    assert!(
        left.iter().all(|p| p.starts_with("wgf4_")
            || p.starts_with("link_")
            || p.starts_with("prog_")
            || TOMBSTONES.contains(&p.as_str())),
        "leftovers: {left:?}"
    );
    assert_eq!(
        probe(
            &gw.peers[0].ns,
            Kind::Tcp(80),
            wgfence_tests::ip("10.2.3.4")
        ),
        Reach::Reached,
        "allowed traffic did not arrive"
    );
    assert_eq!(
        probe(
            &gw.peers[0].ns,
            Kind::Tcp(22),
            wgfence_tests::ip("10.2.3.4")
        ),
        Reach::Blocked,
        "denied traffic arrived"
    );

    let maps = Dataplane::open_maps(&gw.bpffs, gw.interface()).unwrap();
    let peer0 = IpAddr::V4(gw.peers[0].v4);
    let slot = maps
        .peers()
        .unwrap()
        .into_iter()
        .find(|(addr, _)| *addr == peer0)
        .map(|(_, e)| e.slot)
        .expect("peer 0 has no entry");
    let live = maps
        .flows()
        .unwrap()
        .iter()
        .filter(|f| f.value.slot == slot)
        .count() as u64;
    let (made, freed) = maps.flow_quota(slot).unwrap();
    assert!(live >= 1, "the layout-3 flow was not carried");
    assert_eq!(
        made.wrapping_sub(freed),
        live,
        "the quota of slot {slot} counts {made} made - {freed} freed for {live} flows"
    );
    assert_eq!(
        (made, freed),
        (live, 0),
        "no flow was deleted: the carried flows must be counted once each"
    );
    drop(agent);
    let _ = fs::remove_dir_all(&scripts);
}

#[test]
fn an_upgrade_interrupted_between_its_link_updates_is_finished() {
    interrupted_upgrade_resumes(Interrupted::BetweenLinks, false);
}

#[test]
fn an_upgrade_interrupted_between_its_link_updates_is_finished_as_root() {
    interrupted_upgrade_resumes(Interrupted::BetweenLinks, true);
}

#[test]
fn an_upgrade_interrupted_after_its_switch_is_tidied_not_redone() {
    interrupted_upgrade_resumes(Interrupted::AfterSwitch, false);
}

#[test]
fn an_upgrade_interrupted_while_unpinning_layout_3_starts_and_tidies() {
    interrupted_upgrade_resumes(Interrupted::WhileUnpinning, false);
}

/// A datapath that still runs layout 2 is not upgraded directly: this agent refuses before it
/// changes anything, saying to go through a layout-3 agent, and the layout-2 programs keep
/// enforcing; the layout-3 agent then upgrades 2 -> 3 and this one 3 -> 4, each without a gap.
#[test]
fn a_layout_2_datapath_is_refused_and_goes_through_layout_3() {
    let gw = Gateway::new(2);
    let s = wgfence_tests::state(vec![
        gw.peer_json(0, Some(restricted())),
        gw.peer_json(1, None),
    ]);
    let mut agent = Agent::start_binary(v2_binary(), &gw, Layout::Plain, &s, &[]);
    agent.wait_readyz_for(&gw, 200, Duration::from_secs(60));
    assert!(agent.stop().is_some_and(|s| s.success()));
    let scripts = std::env::temp_dir().join(wgfence_tests::net::unique("wgfence-caps-"));
    fs::create_dir_all(&scripts).unwrap();
    for (what, bin) in [
        ("as root", binary()),
        (
            "with the DaemonSet's capabilities",
            with_daemonset_caps(&scripts, &binary()),
        ),
    ] {
        let streams = Streams::start(&gw, 200);
        thread::sleep(Duration::from_millis(300));
        let out = run_refused(&bin, &gw, &agent.state);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && stderr.contains("runs a datapath of map layout 2")
                && stderr.contains("layout-3 agent"),
            "{what}: {out:?}"
        );
        eprintln!("refused {what}: {}", streams.check("while refused"));
        assert_eq!(
            Dataplane::running_layout(&gw.bpffs, gw.interface()).unwrap(),
            Some(2),
            "{what}"
        );
        assert!(
            pins(&gw).iter().all(|p| !p.starts_with("wgf4_")),
            "{what}: the refused agent pinned layout-4 maps: {:?}",
            pins(&gw)
        );
    }
    // The way through: the layout-3 agent once, then this one.
    for (bin, to) in [(v3_binary(), 3), (binary(), 4)] {
        let streams = Streams::start(&gw, 400);
        thread::sleep(Duration::from_millis(500));
        agent.binary = bin;
        agent.restart(&gw, &[]);
        agent.wait_readyz_for(&gw, 200, Duration::from_secs(60));
        assert!(agent.stop().is_some_and(|s| s.success()));
        eprintln!(
            "upgrade to layout {to}: {}",
            streams.check("across the upgrade")
        );
        assert_eq!(
            Dataplane::running_layout(&gw.bpffs, gw.interface()).unwrap(),
            Some(to)
        );
    }
    assert_eq!(old_pins(&gw), TOMBSTONES, "pins: {:?}", pins(&gw));
    let _ = fs::remove_dir_all(&scripts);
}

/// On the legacy TC hook (clsact filters, no links): the layout-3 filters are replaced in
/// place by the layout-4 programs, with the state carried, and not a packet lost or passed
/// wrongly.
#[test]
fn a_layout_3_datapath_on_the_legacy_tc_hook_is_upgraded_in_place() {
    let gw = Gateway::new(3);
    let s = wgfence_tests::state(vec![
        gw.peer_json(0, Some(restricted())),
        gw.peer_json(1, None),
        gw.peer_json(2, None),
    ]);
    let desired = wgfence::state::parse(&s).unwrap();
    let tc = ["--attach", "tc"];
    let mut agent = Agent::start_binary(v3_binary(), &gw, Layout::Plain, &s, &tc);
    agent.wait_readyz_for(&gw, 200, Duration::from_secs(60));
    let streams = Streams::start(&gw, 600);
    thread::sleep(Duration::from_secs(1));
    assert!(agent.stop().is_some_and(|s| s.success()));
    agent.binary = binary();
    agent.restart(&gw, &tc);
    agent.wait_readyz_for(&gw, 200, Duration::from_secs(60));
    let report = streams.check("across the upgrade on the TC hook");
    eprintln!("upgrade on tc: {report}");
    let log = agent.log_text();
    assert!(
        log.contains("upgraded the datapath from map layout 3 to 4"),
        "{log}"
    );
    let after = status_json(&binary(), &gw);
    assert_eq!(after["layoutVersion"], 4, "{after:#}");
    assert_eq!(old_pins(&gw), TOMBSTONES, "pins: {:?}", pins(&gw));
    assert!(
        pins(&gw).iter().all(|p| !p.starts_with("link_")),
        "a tcx link appeared: {:?}",
        pins(&gw)
    );
    let maps = Dataplane::open_maps(&gw.bpffs, gw.interface()).unwrap();
    assert_eq!(map_mismatch(&maps, &desired), None);
    // The rollback is refused here too.
    assert!(agent.stop().is_some_and(|s| s.success()));
    let out = run_refused(&v3_binary(), &gw, &agent.state);
    assert!(!out.status.success(), "{out:?}");
}
