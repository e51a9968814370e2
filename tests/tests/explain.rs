//! `wgfence explain` against real traffic: on a gateway with a running agent, what `explain`
//! says of a packet is what happens to the real one (`nc`-like TCP/UDP probes and `ping` from
//! the peers' namespaces), for IPv4, IPv6, non-first fragments and an unknown source. And
//! `wgfence verify` with drift made behind the agent's back.

use serde_json::{json, Value};
use wgfence_tests::{
    agent::{binary, Agent, Layout},
    probe::{probe, Kind, Reach},
    state,
    topology::Gateway,
};

/// Runs `wgfence explain --json` in the node's namespace for the agent's interface.
fn explain(gw: &Gateway, agent: &Agent, args: &[&str]) -> Value {
    let state = agent.state.to_string_lossy().into_owned();
    let out = gw
        .node
        .command(binary())
        .args(["explain", "--interface", gw.interface(), "--json"])
        .args(["--state", &state])
        .args(args)
        .output()
        .expect("running explain");
    assert!(
        out.status.success(),
        "explain {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "explain {args:?}: not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn passes(report: &Value) -> bool {
    report["verdict"] == "PASS"
}

/// `ping -c 1` of `size` bytes (above the tunnel's MTU: fragmented in the tunnel) from `ns`,
/// optionally from source address `from`.
fn ping(ns: &wgfence_tests::net::Netns, dst: &str, size: u16, from: Option<&str>) -> Reach {
    let size = size.to_string();
    let mut args = vec!["ping", "-c", "1", "-W", "1", "-s", &size];
    if let Some(from) = from {
        args.extend(["-I", from]);
    }
    args.push(dst);
    if ns.try_exec(&args).status.success() {
        Reach::Reached
    } else {
        Reach::Blocked
    }
}

fn alice_rules() -> Value {
    json!([
        { "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443] },
        { "cidr": "192.0.2.0/24", "protocol": "icmp" },
        { "cidr": "fd00::/8", "protocol": "udp", "ports": [53] },
        { "cidr": "fd00:1::/32", "protocol": "icmp" },
        { "cidr": "fd00:9::/32", "protocol": "any" },
    ])
}

#[test]
fn explain_agrees_with_real_probes() {
    let gw = Gateway::new(2);
    let text = state(vec![
        gw.peer_json(0, Some(alice_rules())),
        gw.peer_json(1, None),
    ]);
    let agent = Agent::start(&gw, Layout::Plain, &text, &[]);
    agent.wait_ready(&gw);

    let cases: [(usize, Kind, &str, Reach); 12] = [
        (0, Kind::Tcp(443), "10.1.2.3", Reach::Reached),
        (0, Kind::Tcp(22), "10.1.2.3", Reach::Blocked),
        (0, Kind::Ping, "192.0.2.1", Reach::Reached),
        (0, Kind::Ping, "10.1.2.3", Reach::Blocked),
        (0, Kind::Udp(53), "10.2.3.4", Reach::Blocked),
        (0, Kind::Udp(53), "fd00:1::1", Reach::Reached),
        (0, Kind::Tcp(443), "fd00:1::1", Reach::Blocked),
        (0, Kind::Ping, "fd00:1::1", Reach::Reached),
        (0, Kind::Ping, "2001:db8::1", Reach::Blocked),
        (1, Kind::Tcp(22), "10.1.2.3", Reach::Reached),
        (1, Kind::Ping, "fd00:9::1", Reach::Reached),
        (1, Kind::Udp(9), "2001:db8::1", Reach::Reached),
    ];
    let mut table = Vec::new();
    for (peer, kind, dst, expect) in cases {
        let real = probe(&gw.peers[peer].ns, kind, dst.parse().unwrap());
        let name = format!("peer{peer}");
        let mut args = vec!["--peer", &name, "--to", dst];
        let port;
        match kind {
            Kind::Tcp(p) | Kind::Udp(p) => {
                port = p.to_string();
                args.extend([
                    "--proto",
                    if matches!(kind, Kind::Tcp(_)) {
                        "tcp"
                    } else {
                        "udp"
                    },
                    "--port",
                    &port,
                ]);
            }
            Kind::Ping => args.extend(["--proto", "icmp"]),
        }
        let report = explain(&gw, &agent, &args);
        assert_eq!(real, expect, "{name} {kind} -> {dst}: the probe itself");
        assert_eq!(
            passes(&report),
            real == Reach::Reached,
            "{name} {kind} -> {dst}: real {real:?}, explain says\n{report:#}"
        );
        assert_eq!(report["state_agrees"], true, "{report:#}");
        table.push(format!(
            "{name} {kind} -> {dst}: {real:?}, explain {} ({})",
            report["verdict"], report["reason"]
        ));
    }

    // Non-first fragments: a 2000-byte ping is fragmented in the tunnel (MTU 1420); it
    // arrives only if its first fragment and its later ones pass.
    let fragments: [(&str, Reach); 3] = [
        // IPv4: a later fragment keeps its protocol; the icmp rule has no ports: passes.
        ("192.0.2.1", Reach::Reached),
        // IPv6: a later fragment's protocol is unknown; only `any` passes it.
        ("fd00:1::1", Reach::Blocked),
        ("fd00:9::1", Reach::Reached),
    ];
    for (dst, expect) in fragments {
        let real = ping(&gw.peers[0].ns, dst, 2000, None);
        let first = explain(
            &gw,
            &agent,
            &["--peer", "peer0", "--to", dst, "--proto", "icmp"],
        );
        let later = explain(
            &gw,
            &agent,
            &[
                "--peer",
                "peer0",
                "--to",
                dst,
                "--proto",
                "icmp",
                "--fragment",
            ],
        );
        assert_eq!(real, expect, "2000-byte ping to {dst}: the probe itself");
        assert_eq!(
            passes(&first) && passes(&later),
            real == Reach::Reached,
            "2000-byte ping to {dst}: real {real:?}, explain first {first:#}, later {later:#}"
        );
        table.push(format!(
            "peer0 ping -s 2000 -> {dst}: {real:?}, explain first {} later {} ({})",
            first["verdict"], later["verdict"], later["reason"]
        ));
    }

    // An unknown source: an allowed IP WireGuard routes to peer 1 that the state does not
    // give it (WireGuard delivers it; the datapath drops it).
    let key = gw.peers[1].wg.keys.public.clone();
    gw.wg.set_peer(
        &key,
        &["allowed-ips", "10.8.0.3/32,fd00:8::3/128,10.8.0.99/32"],
    );
    gw.peers[1]
        .ns
        .ip(&["addr", "add", "10.8.0.99/32", "dev", &gw.peers[1].wg.name]);
    let real = ping(&gw.peers[1].ns, "10.9.1.1", 56, Some("10.8.0.99"));
    let report = explain(
        &gw,
        &agent,
        &["--from", "10.8.0.99", "--to", "10.9.1.1", "--proto", "icmp"],
    );
    assert_eq!(real, Reach::Blocked, "10.8.0.99 reached the node");
    assert_eq!(
        (report["verdict"].as_str(), report["reason"].as_str()),
        (Some("DROP"), Some("unknown_source")),
        "{report:#}"
    );
    // The control: the peer's own address gets through.
    assert_eq!(
        ping(&gw.peers[1].ns, "10.9.1.1", 56, None),
        Reach::Reached,
        "peer1's own ping"
    );
    table.push(format!(
        "10.8.0.99 (unknown) ping -> 10.9.1.1: {real:?}, explain {} ({})",
        report["verdict"], report["reason"]
    ));
    eprintln!("explain agrees with real probes:\n  {}", table.join("\n  "));
}

/// The reason names the rule: allows of different rules are never merged (each rule has its
/// hit counter), so a packet two rules allow names the one the datapath credits, the first in
/// canonical order; a packet only the second allows names that one.
#[test]
fn explain_names_the_rules_an_entry_came_from() {
    let gw = Gateway::new(1);
    let rules = json!([
        { "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": ["400-450"] },
        { "cidr": "10.1.0.0/16", "protocol": "tcp", "ports": [443, 500] },
        { "cidr": "192.0.2.0/24", "protocol": "icmp" },
    ]);
    let text = state(vec![gw.peer_json(0, Some(rules))]);
    let agent = Agent::start(&gw, Layout::Plain, &text, &[]);
    agent.wait_ready(&gw);
    let report = explain(
        &gw,
        &agent,
        &["--peer", "peer0", "--to", "10.1.2.3", "--port", "443"],
    );
    assert_eq!(report["verdict"], "PASS", "{report:#}");
    assert_eq!(report["live"]["prefix"], "10.1.0.0/16", "{report:#}");
    assert_eq!(
        report["matched"],
        json!({ "allow": "tcp 400-450", "rules": ["peers[0].egress[0]"] }),
        "{report:#}"
    );
    let second = explain(
        &gw,
        &agent,
        &["--peer", "peer0", "--to", "10.1.2.3", "--port", "500"],
    );
    assert_eq!(second["verdict"], "PASS", "{second:#}");
    assert_eq!(
        second["matched"],
        json!({ "allow": "tcp 500", "rules": ["peers[0].egress[1]"] }),
        "{second:#}"
    );
    let denied = explain(
        &gw,
        &agent,
        &["--peer", "peer0", "--to", "10.1.2.3", "--port", "22"],
    );
    assert_eq!(denied["verdict"], "DROP");
    assert_eq!(denied["reason"], "policy_denied");
    assert_eq!(denied["live"]["reply"]["outcome"], "no_flow", "{denied:#}");
}

/// `wgfence verify` in the node's namespace: (exit code, stdout).
fn verify(gw: &Gateway, agent: &Agent) -> (i32, String) {
    let state = agent.state.to_string_lossy().into_owned();
    let out = gw
        .node
        .command(binary())
        .args(["verify", "--interface", gw.interface(), "--state", &state])
        .output()
        .expect("running verify");
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn hex(bytes: &[u8]) -> Vec<String> {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Drift made behind the agent's back: an allow entry written with `bpftool map update` is
/// named by `verify` (exit 1), and `explain` says the packet it lets through passes and that
/// this differs from the state file. The agent's next resync counts it in
/// `wgfence_drift_entries` and repairs it: then both are clean.
#[test]
fn verify_and_explain_see_drift_until_the_resync_repairs_it() {
    let gw = Gateway::new(1);
    let rules = json!([{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443] }]);
    let text = state(vec![gw.peer_json(0, Some(rules))]);
    let agent = Agent::start(&gw, Layout::Plain, &text, &["--resync", "60"]);
    agent.wait_ready(&gw);
    let (code, out) = verify(&gw, &agent);
    assert_eq!(code, 0, "verify on a clean agent: {out}");
    let ssh = ["--peer", "peer0", "--to", "10.2.3.4", "--port", "22"];
    let explain_text = |args: &[&str]| {
        let out = gw
            .node
            .command(binary())
            .args(["explain", "--interface", gw.interface()])
            .args(["--state", &agent.state.to_string_lossy()])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    eprintln!(
        "$ wgfence explain {}\n{}",
        ssh.join(" "),
        explain_text(&ssh)
    );
    let before = explain(&gw, &agent, &ssh);
    assert_eq!(before["verdict"], "DROP", "{before:#}");
    let policy = before["live"]["peer"]["policy"]
        .as_u64()
        .unwrap_or_else(|| panic!("no policy id in {before:#}")) as u32;

    // The drift: policy `policy`'s trie gains 10.2.3.4/32 -> tcp 22 (an LPM key is the prefix
    // length, then the address; the value a count and 32 allow entries).
    let mut key = 32u32.to_le_bytes().to_vec();
    key.extend([10, 2, 3, 4]);
    let mut value = 1u32.to_le_bytes().to_vec();
    value.extend([6, 0]);
    value.extend(22u16.to_le_bytes());
    value.extend(22u16.to_le_bytes());
    value.extend(0u16.to_le_bytes()); // credited to rule 0
    value.resize(
        4 + std::mem::size_of::<wgfence_common::Allow>() * wgfence_common::MAX_ALLOWS,
        0,
    );
    let trie = wgfence::dataplane::pin_dir(&gw.bpffs, gw.interface())
        .join(wgfence_common::map_names::TRIES_V4)
        .join(policy.to_string());
    let mut args = vec![
        "bpftool".to_owned(),
        "map".to_owned(),
        "update".to_owned(),
        "pinned".to_owned(),
        trie.to_string_lossy().into_owned(),
        "key".to_owned(),
        "hex".to_owned(),
    ];
    args.extend(hex(&key));
    args.extend(["value".to_owned(), "hex".to_owned()]);
    args.extend(hex(&value));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    wgfence_tests::net::run(&args);

    let (code, out) = verify(&gw, &agent);
    eprintln!("$ wgfence verify (exit {code})\n{out}");
    assert_eq!(code, 1, "verify after the drift: {out}");
    assert!(
        out.contains(&format!("policy {policy} trie entry 10.2.3.4/32"))
            && out.contains("[tcp 22] is not in the state file"),
        "verify does not name the entry: {out}"
    );
    let drifted = explain(&gw, &agent, &ssh);
    assert_eq!(drifted["verdict"], "PASS", "{drifted:#}");
    assert_eq!(drifted["state_agrees"], false, "{drifted:#}");
    assert_eq!(drifted["matched"]["rules"], json!([]), "{drifted:#}");
    let text_out = explain_text(&ssh);
    assert!(
        text_out.starts_with("PASS (policy) — differs from the state file"),
        "{text_out}"
    );

    // The resync (every 60 s: the checks above must see the drift first, on a busy machine)
    // sees one entry of drift and repairs it.
    let repaired = wgfence_tests::net::wait_for(std::time::Duration::from_secs(90), || {
        agent.metric(&gw, "wgfence_drift_entries") == 1.0
    });
    assert!(
        repaired.is_some(),
        "the gauge never showed the drift; log:\n{}",
        agent.log_text()
    );
    // The gauge is set as the resync finds the drift; the repair is applied right after.
    let clean = wgfence_tests::net::wait_for(std::time::Duration::from_secs(5), || {
        verify(&gw, &agent).0 == 0
    });
    let (code, out) = verify(&gw, &agent);
    assert!(clean.is_some(), "verify after the resync: {out}");
    assert_eq!(code, 0, "verify after the resync: {out}");
    let after = explain(&gw, &agent, &ssh);
    assert_eq!(after["verdict"], "DROP", "{after:#}");
    assert_eq!(after["state_agrees"], true, "{after:#}");
    eprintln!(
        "$ wgfence explain {}\n{text_out}\nafter the resync: wgfence_drift_entries 1\n$ wgfence verify\n{out}\n$ wgfence explain {}\n{}",
        ssh.join(" "),
        ssh.join(" "),
        explain_text(&ssh)
    );
}

/// Every state with `egress` rules, minus one rule at a time: each must be rejected, by a
/// policy test (not by anything else).
fn every_removed_rule_fails_a_test(name: &str, text: &str) -> usize {
    let intact = wgfence::state::parse(text);
    assert!(intact.is_ok(), "{name} itself: {intact:?}");
    let root: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{name}: {e}"));
    let peers = root["peers"]
        .as_array()
        .cloned()
        .expect("the state has peers");
    let mut removed = 0;
    for (i, peer) in peers.iter().enumerate() {
        let rules = peer["egress"].as_array().cloned().unwrap_or_default();
        for (j, rule) in rules.iter().enumerate() {
            let mut mutant = root.clone();
            if let Some(egress) = mutant["peers"][i]["egress"].as_array_mut() {
                egress.remove(j);
            }
            let what = format!("{name} without peers[{i}].egress[{j}] {rule}");
            match wgfence::state::parse(&mutant.to_string()) {
                Ok(_) => panic!("{what}: every test still passes"),
                Err(e) => assert!(
                    !wgfence::state::assertions::failed(&e).is_empty(),
                    "{what}: rejected, but not by a test: {e}"
                ),
            }
            removed += 1;
        }
    }
    removed
}

/// The shipped states' tests pin down every rule: the demo's first state, its state after the
/// live change, and the example overlay's.
#[test]
fn the_shipped_states_tests_catch_every_removed_rule() {
    let key = |i: usize| {
        let mut k = [0u8; 32];
        k[0] = i as u8 + 1;
        wgfence::state::WgKey(k).to_base64()
    };
    let peer = |i: usize, egress: Option<Value>| {
        let mut p = json!({ "name": format!("peer{i}"), "publicKey": key(i),
            "address": format!("10.8.0.{}", i + 2), "addressV6": format!("fd00:8::{}", i + 2) });
        if let Some(egress) = egress {
            p["egress"] = egress;
        }
        p
    };
    let demo = wgfence_tests::demo::state_of(peer, wgfence_tests::demo::alice_rules(), true);
    let mut n = every_removed_rule_fails_a_test("the demo's state", &demo);
    let changed =
        wgfence_tests::demo::state_of(peer, wgfence_tests::demo::alice_rules_changed(), true);
    n += every_removed_rule_fails_a_test("the demo's state after its live change", &changed);
    let example = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/overlays/example/state.json"),
    )
    .expect("the example state");
    n += every_removed_rule_fails_a_test("deploy/overlays/example/state.json", &example);
    eprintln!("{n} single-rule deletions, each caught by a policy test");
}

/// A state whose policy test fails, swapped in through `..data` (a Kubernetes volume update)
/// while a peer probes: it would open tcp/22, but its own test says tcp/22 must be dropped, so
/// it is rejected whole. No probe result changes; `/readyz` answers 503 naming the assertion
/// and `wgfence_state_rejected_total` counts it.
#[test]
fn a_state_whose_test_fails_is_rejected_live() {
    use std::{
        sync::atomic::{AtomicBool, Ordering},
        thread,
        time::Duration,
    };

    let gw = Gateway::new(1);
    let peer = |rules: Value, tests: Value| {
        let mut state: Value =
            serde_json::from_str(&state(vec![gw.peer_json(0, Some(rules))])).unwrap();
        state["tests"] = tests;
        state.to_string()
    };
    let good = peer(
        json!([{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443] }]),
        json!([{ "peer": "peer0", "accept": ["10.1.2.3:443/tcp"], "deny": ["10.1.2.3:22/tcp"] }]),
    );
    let agent = Agent::start(&gw, Layout::Kubernetes, &good, &[]);
    agent.wait_ready(&gw);
    assert_eq!(agent.metric(&gw, "wgfence_state_rejected_total"), 0.0);

    let stop = AtomicBool::new(false);
    let cases = [
        (Kind::Tcp(443), Reach::Reached),
        (Kind::Tcp(22), Reach::Blocked),
    ];
    let ns = &gw.peers[0].ns;
    let (rounds, wrong) = thread::scope(|s| {
        let prober = s.spawn(|| {
            let mut rounds = 0;
            let mut wrong = Vec::new();
            while !stop.load(Ordering::Relaxed) || rounds < 3 {
                for (kind, want) in cases {
                    let got = probe(ns, kind, "10.1.2.3".parse().unwrap());
                    if got != want {
                        wrong.push(format!("round {rounds}: {kind} {got:?}"));
                    }
                }
                rounds += 1;
            }
            (rounds, wrong)
        });
        thread::sleep(Duration::from_millis(500));
        // Opens tcp/22, which the state's own test denies.
        let bad = peer(
            json!([{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [22, 443] }]),
            json!([{ "peer": "peer0", "accept": ["10.1.2.3:443/tcp"], "deny": ["10.1.2.3:22/tcp"] }]),
        );
        agent.write_state(&bad);
        agent.wait_rejected(&gw, "10.1.2.3:22/tcp passes, expected dropped");
        agent.wait_readyz(&gw, 503);
        thread::sleep(Duration::from_secs(2));
        stop.store(true, Ordering::Relaxed);
        prober
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
    });
    let (status, body) = agent.get(&gw, "/readyz").expect("GET /readyz");
    assert_eq!(status, 503);
    assert!(
        body.contains("policy test failed")
            && body.contains("tests[0] (peer \"peer0\") deny[0]")
            && body.contains("10.1.2.3:22/tcp passes, expected dropped"),
        "/readyz does not name the assertion: {body}"
    );
    assert_eq!(agent.metric(&gw, "wgfence_state_rejected_total"), 1.0);
    assert!(wrong.is_empty(), "probe results changed: {wrong:?}");
    eprintln!("{rounds} probe rounds, none changed; /readyz: {status} {body}");
}

/// `except` and ICMP `types` with real traffic: tcp/443 anywhere but 10.2.0.0/16, and only
/// echo requests (ping) of ICMP. What the network starts toward the peer is unaffected: its
/// echo replies (type 0) and its port unreachable errors (type 3) pass as replies. `explain`
/// agrees with each probe and names the entry.
#[test]
fn except_and_icmp_types_with_real_traffic() {
    let gw = Gateway::new(1);
    let rules = json!([
        { "cidr": "0.0.0.0/0", "except": ["10.2.0.0/16"], "protocol": "tcp", "ports": [443] },
        { "cidr": "0.0.0.0/0", "protocol": "icmp", "types": ["echo-request"] },
        { "cidr": "::/0", "protocol": "icmp", "types": ["echo-request"] },
    ]);
    let text = state(vec![gw.peer_json(0, Some(rules))]);
    let agent = Agent::start(&gw, Layout::Plain, &text, &[]);
    agent.wait_ready(&gw);
    let ns = &gw.peers[0].ns;
    let ip = |s: &str| -> std::net::IpAddr { s.parse().unwrap() };
    let cases: [(Kind, &str, Reach); 5] = [
        (Kind::Tcp(443), "10.1.2.3", Reach::Reached),
        (Kind::Tcp(443), "10.2.3.4", Reach::Blocked),
        (Kind::Tcp(443), "192.0.2.1", Reach::Reached),
        (Kind::Ping, "192.0.2.1", Reach::Reached),
        (Kind::Ping, "fd00:1::1", Reach::Reached),
    ];
    for (kind, dst, expect) in cases {
        let real = probe(ns, kind, ip(dst));
        let mut args = vec!["--peer", "peer0", "--to", dst];
        match kind {
            Kind::Tcp(_) => args.extend(["--port", "443"]),
            _ => args.extend(["--proto", "icmp"]),
        }
        let report = explain(&gw, &agent, &args);
        assert_eq!(real, expect, "{kind} -> {dst}");
        assert_eq!(
            passes(&report),
            real == Reach::Reached,
            "{kind} -> {dst}: {report:#}"
        );
    }
    // Another ICMP type from the peer: dropped (explain; ping sends only echo requests).
    let other = explain(
        &gw,
        &agent,
        &[
            "--peer",
            "peer0",
            "--to",
            "192.0.2.1",
            "--proto",
            "icmp",
            "--icmp-type",
            "13",
        ],
    );
    assert_eq!(other["verdict"], "DROP", "{other:#}");
    assert!(
        other["allows"]
            .as_array()
            .is_some_and(|a| a.iter().any(|a| a["allow"] == "icmp type 8")),
        "{other:#}"
    );
    // The network's ping to the peer and its UDP to a closed port of the peer: the peer's
    // echo reply and port unreachable pass as replies (both denied by its rules alone).
    let peer = gw.peers[0].v4.to_string();
    assert_eq!(
        probe(&gw.node, Kind::Ping, ip(&peer)),
        Reach::Reached,
        "ping to the peer"
    );
    assert_eq!(
        probe(&gw.node, Kind::Udp(9), ip(&peer)),
        Reach::Reached,
        "the peer's port unreachable"
    );
    let replies = agent.metric(&gw, "wgfence_passed_packets_total{reason=\"reply\"}");
    assert!(replies >= 2.0, "{replies} packets passed as replies");
}
