//! End to end: the `wgfence run` binary, driven through its state file, enforcing on a
//! wireguard-go interface with real traffic; observed through packets, `wg show`, bpftool and
//! its metrics.

use std::{
    net::TcpStream,
    process::{Child, Stdio},
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use serde_json::{json, Value};
use wgfence_tests::{
    agent::{http_get, Agent, Layout},
    ip,
    net::{run, wait_for},
    probe::{check_all, probe, Expect, Kind, Reach},
    state,
    topology::Gateway,
};

/// `--health-addr` as the DaemonSet sets it, in the gateway's node namespace.
const HEALTH: &str = "127.0.0.1:9587";

fn web_and_ping() -> Value {
    json!([
        { "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443, "8000-8100"] },
        { "cidr": "192.0.2.0/24", "protocol": "icmp" },
    ])
}

/// `ping -D` from a peer's namespace, in the background.
fn ping_stream(gw: &Gateway, peer: usize, count: u32) -> Child {
    gw.peers[peer]
        .ns
        .command("ping")
        .args([
            "-D",
            "-i",
            "0.01",
            "-W",
            "1",
            "-c",
            &count.to_string(),
            "10.8.0.1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("ping")
}

struct PingResult {
    transmitted: u32,
    received: u32,
    /// Unix time of the last reply.
    last_reply: Option<f64>,
}

fn finish(ping: Child) -> PingResult {
    let out = ping.wait_with_output().expect("ping");
    let text = String::from_utf8_lossy(&out.stdout);
    let last_reply = text
        .lines()
        .rev()
        .filter(|l| l.contains("bytes from"))
        .find_map(|l| l.strip_prefix('[')?.split(']').next()?.parse().ok());
    let summary = text
        .lines()
        .find(|l| l.contains("packets transmitted"))
        .unwrap_or_else(|| panic!("no ping summary:\n{text}"));
    let numbers: Vec<u32> = summary
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .collect();
    PingResult {
        transmitted: numbers.first().copied().unwrap_or(0),
        received: numbers.get(1).copied().unwrap_or(0),
        last_reply,
    }
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default()
}

#[test]
fn enforces_the_state_file_and_follows_its_changes() {
    let gw = Gateway::new(2);
    let s1 = state(vec![
        gw.peer_json(0, Some(web_and_ping())),
        gw.peer_json(1, None),
    ]);
    let agent = Agent::start(&gw, Layout::Plain, &s1, &[]);
    agent.wait_ready(&gw);

    let (r, o) = (&gw.peers[0].ns, &gw.peers[1].ns);
    let case = Expect::new;
    use Kind::{Ping, Tcp};
    use Reach::{Blocked, Reached};
    check_all(&[
        case("restricted", r, Tcp(443), "10.2.3.4", Reached),
        case("restricted", r, Tcp(8100), "10.1.2.3", Reached),
        case("restricted", r, Tcp(8101), "10.1.2.3", Blocked),
        case("restricted", r, Tcp(80), "10.2.3.4", Blocked),
        case("restricted", r, Ping, "192.0.2.1", Reached),
        case("restricted", r, Ping, "10.2.3.4", Blocked),
        case("restricted", r, Tcp(443), "fd00:1::1", Blocked),
        case("open", o, Tcp(80), "10.2.3.4", Reached),
        case("open", o, Ping, "fd00:1::1", Reached),
    ]);
    let mut keys: Vec<String> = gw.peers.iter().map(|p| p.wg.keys.public.clone()).collect();
    keys.sort();
    assert_eq!(gw.wg_peers(), keys);

    // The same state with peers and rules in another order: no kernel write at all.
    let mut reversed = web_and_ping();
    if let Some(rules) = reversed.as_array_mut() {
        rules.reverse();
    }
    let s1_reordered = state(vec![gw.peer_json(1, None), gw.peer_json(0, Some(reversed))]);
    assert_ne!(s1, s1_reordered);
    let writes = agent.metric(&gw, "wgfence_bpf_map_writes_total");
    let updates = agent.metric(&gw, "wgfence_wireguard_peer_updates_total");
    let before = agent.reconciles(&gw);
    agent.write_state(&s1_reordered);
    agent.wait_reconciles(&gw, before, 1.0);
    assert_eq!(agent.metric(&gw, "wgfence_bpf_map_writes_total"), writes);
    assert_eq!(
        agent.metric(&gw, "wgfence_wireguard_peer_updates_total"),
        updates
    );

    // A policy change applies live.
    let s2 = state(vec![
        gw.peer_json(
            0,
            Some(json!([{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [80] }])),
        ),
        gw.peer_json(1, None),
    ]);
    let before = agent.reconciles(&gw);
    agent.write_state(&s2);
    agent.wait_reconciles(&gw, before, 1.0);
    check_all(&[
        case("restricted", r, Tcp(80), "10.2.3.4", Reached),
        case("restricted", r, Tcp(443), "10.2.3.4", Blocked),
        case("restricted", r, Ping, "192.0.2.1", Blocked),
    ]);
    // Six map writes at most: the new policy's entry (into a spare trie already in place),
    // its rule counters zeroed, the switch of both addresses, the old entry's deletion... and
    // nothing that grows with the other peers.
    let delta = agent.metric(&gw, "wgfence_bpf_map_writes_total") - writes;
    assert!(
        delta <= 6.0,
        "a one-peer policy change cost {delta} map writes"
    );

    // An editor writing the file in place is followed too.
    let before = agent.reconciles(&gw);
    agent.write_state_in_place(&s1);
    agent.wait_reconciles(&gw, before, 1.0);
    assert_eq!(probe(r, Tcp(443), ip("10.2.3.4")), Reached);
}

fn revocation(layout: Layout) {
    let gw = Gateway::new(2);
    let both = state(vec![gw.peer_json(0, None), gw.peer_json(1, None)]);
    let agent = Agent::start(&gw, layout, &both, &[]);
    agent.wait_ready(&gw);
    revoke_peer_1(&gw, &agent, &format!("{layout:?}"));
    drop(agent);
}

/// Revokes peer 1 of two while both ping the gateway: the revoked peer's last reply comes
/// less than a second after the state file changed, and peer 0 loses nothing.
fn revoke_peer_1(gw: &Gateway, agent: &Agent, what: &str) {
    let revoked = ping_stream(gw, 1, 300);
    let bystander = ping_stream(gw, 0, 300);
    thread::sleep(Duration::from_millis(1000));
    let t0 = now();
    agent.write_state(&state(vec![gw.peer_json(0, None)]));
    let revoked = finish(revoked);
    let bystander = finish(bystander);

    let last = revoked.last_reply.expect("no reply before the revocation");
    let latency = last - t0;
    eprintln!(
        "revocation ({what}): last reply {:.0} ms after the state file changed",
        latency * 1e3
    );
    assert!(
        latency < 1.0,
        "{what}: revoked peer still answered {latency:.3} s later; log:\n{}",
        agent.log_text()
    );
    assert!(revoked.received < revoked.transmitted);
    assert_eq!(
        bystander.received, bystander.transmitted,
        "the revocation interrupted another peer"
    );
    assert_eq!(gw.wg_peers(), vec![gw.peers[0].wg.keys.public.clone()]);
}

#[test]
fn a_revocation_takes_effect_within_a_second() {
    revocation(Layout::Plain);
}

#[test]
fn a_revocation_through_a_kubernetes_volume_swap_takes_effect_within_a_second() {
    revocation(Layout::Kubernetes);
}

#[test]
fn a_revocation_written_in_place_takes_effect_within_a_second() {
    revocation(Layout::InPlace);
}

/// `--state` is a symlink into another directory, and the file there is replaced: the agent
/// watches the directory the link points into, not only the link's.
#[test]
fn a_revocation_behind_a_symlink_into_another_directory_takes_effect_within_a_second() {
    revocation(Layout::LinkElsewhere);
}

/// `--state current/state.json` where `current` is a symlink swapped to another directory
/// (the old one stays): the agent sees every swap, not only the first. The first swap changes
/// nothing but the order of peers; the second revokes.
#[test]
fn a_revocation_by_swapping_a_parent_directory_link_takes_effect_within_a_second() {
    let gw = Gateway::new(2);
    let both = state(vec![gw.peer_json(0, None), gw.peer_json(1, None)]);
    let agent = Agent::start(&gw, Layout::ParentLink, &both, &[]);
    agent.wait_ready(&gw);
    let before = agent.reconciles(&gw);
    agent.write_state(&state(vec![gw.peer_json(1, None), gw.peer_json(0, None)]));
    agent.wait_reconciles(&gw, before, 1.0);
    revoke_peer_1(&gw, &agent, "ParentLink, second swap");
}

/// The agent's open file descriptors.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or_else(|e| panic!("/proc/{pid}/fd: {e}"))
}

fn set_nofile(pid: libc::pid_t, soft: u64, hard: u64) {
    let limit = libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: prlimit with a valid rlimit and no old-limit output.
    let rc = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, &limit, std::ptr::null_mut()) };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
}

/// Peers reach the node IP through the tunnel; nothing they do to the metrics port may delay
/// enforcement. 2,000 idle connections are held open against it while the agent runs with the
/// common container limit of 1,024 descriptors: the agent keeps a bounded number of them (the
/// rest are closed at once, not queued), still applies a revocation within a second, and
/// answers `/healthz` on a fresh connection once the idle ones have timed out (while the test
/// still holds its end of all 2,000).
#[test]
fn idle_connections_to_the_metrics_port_neither_delay_a_revocation_nor_exhaust_descriptors() {
    const HELD: usize = 2000;
    let gw = Gateway::new(2);
    let both = state(vec![gw.peer_json(0, None), gw.peer_json(1, None)]);
    let agent = Agent::start(&gw, Layout::Plain, &both, &[]);
    agent.wait_ready(&gw);
    let pid = agent.pid().expect("the agent is not running");
    set_nofile(pid as libc::pid_t, 1024, 1024);
    // This process holds the 2,000 client ends: raise its own soft limit to the hard one.
    let mut own = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into a valid rlimit.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut own) }, 0);
    if own.rlim_cur < own.rlim_max {
        set_nofile(0, own.rlim_max, own.rlim_max);
    }
    assert!(
        own.rlim_max > 2 * HELD as u64,
        "the test needs more than {} descriptors (hard limit {})",
        2 * HELD,
        own.rlim_max
    );
    let baseline = open_fds(pid);

    let addr: std::net::SocketAddr = wgfence_tests::agent::METRICS.parse().unwrap();
    let started = Instant::now();
    // Each attempt ends established (and is held) or reset by the agent, which closes what
    // is over its limit at once; none may hang in the kernel's queue.
    let (held, reset): (Vec<TcpStream>, usize) = gw.node.enter(|| {
        let mut held = Vec::new();
        let mut reset = 0;
        for _ in 0..HELD {
            // Connections the agent never accepts fill the kernel's queue, and connecting
            // then hangs: give up after twenty seconds. (A full queue drops a SYN, which is
            // sent again after a second: allow for that.)
            if started.elapsed() > Duration::from_secs(20) {
                break;
            }
            match TcpStream::connect_timeout(&addr, Duration::from_secs(4)) {
                Ok(stream) => held.push(stream),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => reset += 1,
                Err(e) => {
                    eprintln!("connecting: {e}");
                    break;
                }
            }
        }
        (held, reset)
    });
    eprintln!(
        "{HELD} connections: {} established and held, {reset} reset by the agent at once, \
         in {:.0} ms",
        held.len(),
        started.elapsed().as_secs_f64() * 1e3
    );
    let flooded = Instant::now();
    thread::sleep(Duration::from_millis(300));
    let fds = open_fds(pid);
    eprintln!("agent descriptors: {baseline} before, {fds} with the connections held");
    assert!(
        fds <= baseline + 64 + 8,
        "the agent holds {fds} descriptors ({baseline} before the connections)"
    );
    assert_eq!(
        held.len() + reset,
        HELD,
        "connecting hung: the agent stopped accepting"
    );

    // A fresh request while the cap is full is answered or closed at once, never queued.
    let asked = Instant::now();
    let fresh = agent.get(&gw, "/healthz");
    let waited = asked.elapsed();
    eprintln!("fresh /healthz while all are held: {fresh:?} after {waited:?}");
    assert!(
        waited < Duration::from_secs(1),
        "a fresh connection waited {waited:?} behind the idle ones"
    );

    revoke_peer_1(&gw, &agent, "2,000 idle metrics connections held");

    // The last idle connections the agent took were accepted by the end of the flood; they
    // close at the header timeout, and then a fresh connection is served.
    let deadline = flooded + wgfence::metrics::HEADER_TIMEOUT + Duration::from_secs(2);
    let answered = wait_for(deadline.saturating_duration_since(Instant::now()), || {
        agent.get(&gw, "/healthz").map(|(s, _)| s) == Some(200)
    });
    eprintln!(
        "/healthz answered on a fresh connection {:?} after the flood ended",
        flooded.elapsed()
    );
    assert!(
        answered.is_some(),
        "/healthz did not answer within the header timeout of the flood's end, with the idle \
         connections still held; log:\n{}",
        agent.log_text()
    );
    let fds = open_fds(pid);
    assert!(
        fds <= baseline + 64 + 8,
        "the agent holds {fds} descriptors ({baseline} before the connections)"
    );
    drop(held);
}

/// Binding the endpoint to an address of the node does not keep the peers away: they reach
/// it through the tunnel. The rule docs/operations.md gives (here in its iptables form,
/// `iptables -I INPUT -i wg0 -p tcp --dport 9586 -j DROP`) does, and the node itself (the
/// kubelet, Prometheus on the node network) still gets its answers.
#[test]
fn peers_reach_the_metrics_endpoint_through_the_tunnel_until_the_documented_rule_drops_them() {
    let gw = Gateway::new(1);
    // 10.2.3.4 stands for the node IP: an address of the node that peers route to.
    let addr = "10.2.3.4:9586";
    let s = state(vec![gw.peer_json(0, None)]);
    let agent = Agent::start_with_metrics(&gw, Layout::Plain, &s, &[], addr);
    agent.wait_ready(&gw);
    let peer = &gw.peers[0].ns;
    assert_eq!(
        http_get(peer, addr, "/healthz").map(|(s, _)| s),
        Some(200),
        "the peer did not reach the endpoint through the tunnel"
    );
    for iptables in ["iptables", "ip6tables"] {
        gw.node.exec(&[
            iptables,
            "-I",
            "INPUT",
            "-i",
            gw.interface(),
            "-p",
            "tcp",
            "--dport",
            "9586",
            "-j",
            "DROP",
        ]);
    }
    assert_eq!(
        http_get(peer, addr, "/healthz"),
        None,
        "the peer still reached the endpoint past the rule"
    );
    assert_eq!(agent.get(&gw, "/healthz").map(|(s, _)| s), Some(200));
}

#[test]
fn invalid_states_are_rejected_and_the_last_good_one_stays() {
    let gw = Gateway::new(2);
    let good = state(vec![
        gw.peer_json(0, Some(web_and_ping())),
        gw.peer_json(1, None),
    ]);
    let agent = Agent::start(&gw, Layout::Plain, &good, &[]);
    agent.wait_ready(&gw);
    let r = &gw.peers[0].ns;

    let mut duplicate = gw.peer_json(1, None);
    duplicate["address"] = json!(gw.peers[0].v4.to_string());
    let bad_states = [
        "{\"version\": 1, \"peers\": [".to_owned(),
        state(vec![gw.peer_json(0, Some(web_and_ping())), duplicate]),
    ];
    for (n, bad) in bad_states.iter().enumerate() {
        agent.write_state(bad);
        let rejected = || agent.metric(&gw, "wgfence_state_rejected_total") >= (n + 1) as f64;
        assert!(
            wait_for(Duration::from_secs(5), rejected).is_some(),
            "state {n} was not rejected"
        );
        agent.wait_readyz(&gw, 503);
        // Still enforcing the last good state, both ways.
        assert_eq!(probe(r, Kind::Tcp(443), ip("10.2.3.4")), Reach::Reached);
        assert_eq!(probe(r, Kind::Tcp(80), ip("10.2.3.4")), Reach::Blocked);
        assert_eq!(gw.wg_peers().len(), 2);
    }
    let log = agent.log_text();
    assert!(
        log.contains("addressV6") || log.contains("address"),
        "{log}"
    );
    assert!(
        log.contains("duplicate: 10.8.0.2 is also peers[0]'s address"),
        "{log}"
    );

    agent.write_state(&good);
    agent.wait_ready(&gw);
}

#[test]
fn a_killed_agent_restarts_without_losing_a_packet() {
    let gw = Gateway::new(1);
    let s = state(vec![gw.peer_json(
        0,
        Some(json!([{ "cidr": "10.8.0.1/32", "protocol": "icmp" }])),
    )]);
    let mut agent = Agent::start(&gw, Layout::Plain, &s, &[]);
    agent.wait_ready(&gw);

    let ping = ping_stream(&gw, 0, 400);
    thread::sleep(Duration::from_millis(1000));
    agent.kill();
    thread::sleep(Duration::from_millis(500));
    agent.restart(&gw, &[]);
    agent.wait_ready(&gw);
    let result = finish(ping);
    assert_eq!(
        result.received, result.transmitted,
        "packets were lost across SIGKILL and restart"
    );
    // The restarted agent adopted everything: the same state costs no write.
    assert_eq!(agent.metric(&gw, "wgfence_bpf_map_writes_total"), 0.0);
    assert_eq!(
        agent.metric(&gw, "wgfence_wireguard_peer_updates_total"),
        0.0
    );

    // SIGTERM leaves the datapath enforcing too.
    assert!(agent.stop().is_some_and(|s| s.success()));
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Ping, ip("10.8.0.1")),
        Reach::Reached
    );
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Tcp(22), ip("10.8.0.1")),
        Reach::Blocked
    );
}

#[test]
fn resync_repairs_drift() {
    let gw = Gateway::new(2);
    let s = state(vec![gw.peer_json(0, None), gw.peer_json(1, None)]);
    let agent = Agent::start(&gw, Layout::Plain, &s, &["--resync", "1"]);
    agent.wait_ready(&gw);
    let dst = ip("10.2.3.4");
    assert_eq!(probe(&gw.peers[1].ns, Kind::Tcp(80), dst), Reach::Reached);

    // Someone deletes peer 1's map entry with bpftool ...
    let map = gw
        .bpffs
        .join("wgfence")
        .join(gw.interface())
        .join(wgfence_common::map_names::PEERS_V4);
    let map = map.to_string_lossy();
    run(&[
        "bpftool", "map", "delete", "pinned", &map, "key", "10", "8", "0", "3",
    ]);
    assert_eq!(probe(&gw.peers[1].ns, Kind::Tcp(80), dst), Reach::Blocked);
    // ... and peer 0 from WireGuard.
    let key0 = gw.peers[0].wg.keys.public.clone();
    run(&["wg", "set", gw.interface(), "peer", &key0, "remove"]);
    assert!(!gw.wg_peers().contains(&key0));

    let repaired = || {
        gw.wg_peers().contains(&key0)
            && probe(&gw.peers[1].ns, Kind::Tcp(80), dst) == Reach::Reached
    };
    assert!(
        wait_for(Duration::from_secs(10), repaired).is_some(),
        "the resync did not repair the drift; log:\n{}",
        agent.log_text()
    );
}

/// A state with a policy per peer replaced by one with a single policy: the resync after it
/// frees the empty tries of every id but the one in use and the 64 lowest free ids (the
/// spares the planner fills next), then writes nothing more; the remaining peer's policy
/// holds throughout.
#[test]
fn the_tries_a_smaller_state_left_empty_are_freed_at_the_next_resync() {
    const OWN: usize = 199;
    let gw = Gateway::new(1);
    let ping_only = json!([{ "cidr": "10.1.2.3/32", "protocol": "icmp" }]);
    let synthetic = |i: usize, egress: Option<Value>| -> Value {
        let mut p = json!({
            "name": format!("own-{i:03}"),
            "publicKey": wgfence_tests::bench::gen::peer_key(i).to_base64(),
            "address": wgfence_tests::bench::gen::peer_v4(i).to_string(),
        });
        if let Some(egress) = egress {
            p["egress"] = egress;
        }
        p
    };
    let own = |i: usize| json!([{ "cidr": format!("10.{}.{}.0/24", 100 + i / 200, i % 200), "protocol": "tcp", "ports": [443] }]);
    let mut peers = vec![gw.peer_json(0, Some(ping_only.clone()))];
    peers.extend((0..OWN).map(|i| synthetic(i, Some(own(i)))));
    let agent = Agent::start(&gw, Layout::Plain, &state(peers), &["--resync", "1"]);
    agent.wait_readyz_for(&gw, 200, Duration::from_secs(60));
    let pin_dir = wgfence::dataplane::pin_dir(&gw.bpffs, gw.interface());
    let tries = pin_dir.join(wgfence_common::map_names::TRIES_V4);
    let pinned = || -> Vec<u32> {
        let mut ids: Vec<u32> = std::fs::read_dir(&tries)
            .map(|d| {
                d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        ids.sort_unstable();
        ids
    };
    assert!(pinned().len() > OWN, "{:?}", pinned());

    // Every other peer unrestricted: one policy left.
    let mut peers = vec![gw.peer_json(0, Some(ping_only))];
    peers.extend((0..OWN).map(|i| synthetic(i, None)));
    agent.write_state(&state(peers));
    let freed = wait_for(Duration::from_secs(15), || {
        agent.log_text().contains("freed empty policy tries")
    });
    assert!(
        freed.is_some(),
        "no tries freed; log:\n{}",
        agent.log_text()
    );
    // The policy id peer 0 uses, from its map entry.
    let out = run(&[
        "bpftool",
        "-j",
        "map",
        "lookup",
        "pinned",
        &pin_dir
            .join(wgfence_common::map_names::PEERS_V4)
            .to_string_lossy(),
        "key",
        "10",
        "8",
        "0",
        "2",
    ]);
    let entry: Value = serde_json::from_slice(&out.stdout).unwrap();
    let policy = entry["formatted"]["value"]["policy"]
        .as_u64()
        .unwrap_or_else(|| panic!("no policy in {entry}")) as u32;
    let mut want: Vec<u32> = (1..).filter(|id| *id != policy).take(64).collect();
    want.push(policy);
    want.sort_unstable();
    assert_eq!(pinned(), want, "policy {policy} in use");
    let ns = &gw.peers[0].ns;
    check_all(&[
        Expect::new("peer0", ns, Kind::Ping, "10.1.2.3", Reach::Reached),
        Expect::new("peer0", ns, Kind::Ping, "10.2.3.4", Reach::Blocked),
    ]);

    // Nothing more to free: the next resyncs write nothing.
    let writes = agent.metric(&gw, "wgfence_bpf_map_writes_total");
    let resyncs = agent.reconciles(&gw);
    thread::sleep(Duration::from_millis(2500));
    assert!(agent.reconciles(&gw) >= resyncs + 1.0, "no resync ran");
    assert_eq!(
        agent.metric(&gw, "wgfence_bpf_map_writes_total"),
        writes,
        "an unchanged state was written again; log:\n{}",
        agent.log_text()
    );
}

#[test]
fn churn_of_other_peers_does_not_interrupt_an_unchanged_peer() {
    let gw = Gateway::new(1);
    // Peers that exist only in the state (no WireGuard on the other side): the agent adds
    // them to the maps and to WireGuard, changes and removes them, while peer 0 streams.
    let synthetic = |i: usize, policy: usize| {
        let mut key = [0u8; 32];
        key[0] = 0x42;
        key[1] = i as u8;
        let mut p = json!({
            "name": format!("churn-{i:02}"),
            "publicKey": wgfence::state::WgKey(key).to_base64(),
            "address": format!("10.8.1.{}", i + 2),
        });
        if policy > 0 {
            p["egress"] = json!([{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [policy] }]);
        }
        p
    };
    let bystander = gw.peer_json(
        0,
        Some(json!([{ "cidr": "10.8.0.1/32", "protocol": "icmp" }])),
    );
    let initial = state(vec![bystander.clone()]);
    let agent = Agent::start(&gw, Layout::Kubernetes, &initial, &[]);
    agent.wait_ready(&gw);

    let ping = ping_stream(&gw, 0, 300);
    let before = agent.reconciles(&gw);
    let changes = 40;
    for round in 0..changes {
        // Each round: a different subset of the synthetic peers, with rotating policies.
        let mut peers = vec![bystander.clone()];
        peers.extend(
            (0..20)
                .filter(|i| (i + round) % 3 != 0)
                .map(|i| synthetic(i, (i + round) % 4)),
        );
        agent.write_state(&state(peers));
        thread::sleep(Duration::from_millis(60));
    }
    let result = finish(ping);
    assert_eq!(
        result.received, result.transmitted,
        "the unchanged peer lost packets while others churned"
    );
    // The churn was applied, not coalesced into nothing.
    assert!(agent.reconciles(&gw) - before >= (changes / 2) as f64);
    assert!(agent.metric(&gw, "wgfence_bpf_map_writes_total") > 0.0);
}

#[test]
fn a_state_beyond_wireguard_go_capacity_is_rejected_whole() {
    let gw = Gateway::new(1);
    let good = state(vec![gw.peer_json(0, None)]);
    let agent = Agent::start(&gw, Layout::Plain, &good, &[]);
    agent.wait_ready(&gw);

    // One peer more than wireguard-go holds: refused before any change, not halfway through.
    let mut big = wgfence_tests::bench::gen::state(wgfence::wg::WIREGUARD_GO_MAX_PEERS, 9);
    if let Some(peers) = big["peers"].as_array_mut() {
        peers.push(gw.peer_json(0, None));
    }
    let writes = agent.metric(&gw, "wgfence_bpf_map_writes_total");
    agent.write_state(&big.to_string());
    agent.wait_rejected(&gw, "wireguard-go), which holds at most 65536");
    assert_eq!(agent.metric(&gw, "wgfence_bpf_map_writes_total"), writes);
    assert_eq!(gw.wg_peers().len(), 1);
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Tcp(80), ip("10.2.3.4")),
        Reach::Reached
    );
}

/// The same at start-up, where the state file is parsed while the datapath is attached (before
/// WireGuard's capacity is known to the parse): refused whole, nothing added to WireGuard, and
/// the next good state is applied from scratch.
#[test]
fn a_state_beyond_wireguard_go_capacity_at_start_is_refused_and_the_next_good_one_applies() {
    let gw = Gateway::new(1);
    let mut big = wgfence_tests::bench::gen::state(wgfence::wg::WIREGUARD_GO_MAX_PEERS, 9);
    if let Some(peers) = big["peers"].as_array_mut() {
        peers.push(gw.peer_json(0, None));
    }
    let before = gw.wg_peers();
    let agent = Agent::start(&gw, Layout::Plain, &big.to_string(), &[]);
    // Serving (not ready) before the metrics are read.
    agent.wait_readyz_for(&gw, 503, Duration::from_secs(60));
    agent.wait_rejected(&gw, "wireguard-go), which holds at most 65536");
    assert_eq!(agent.metric(&gw, "wgfence_bpf_map_writes_total"), 0.0);
    assert_eq!(gw.wg_peers(), before, "WireGuard's peers changed");

    agent.write_state(&state(vec![gw.peer_json(0, None)]));
    agent.wait_ready(&gw);
    assert_eq!(gw.wg_peers().len(), 1);
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Tcp(80), ip("10.2.3.4")),
        Reach::Reached
    );
}

/// Runs `wgfence <args> --state <text>` in the node's namespace: (success, stdout, stderr).
fn cli(gw: &Gateway, agent: &Agent, args: &[&str], text: &str) -> (bool, String, String) {
    let path = agent.dir.join("cli.json");
    std::fs::write(&path, text).unwrap();
    let out = gw
        .node
        .command(wgfence_tests::agent::binary())
        .args(args)
        .arg("--state")
        .arg(&path)
        .output()
        .unwrap_or_else(|e| panic!("wgfence {args:?}: {e}"));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Issue 11 item 7, as Kubernetes NetworkPolicy: `"egress": []` allows nothing (the peer gets
/// only replies), while a peer without the key reaches everything; `check` and `plan` name the
/// peer allowed nothing; `null` for `egress` is rejected, and the last good state stays.
#[test]
fn an_empty_egress_reaches_nothing_and_no_egress_reaches_everything() {
    let gw = Gateway::new(2);
    let s = state(vec![
        gw.peer_json(0, Some(json!([]))),
        gw.peer_json(1, None),
    ]);
    let agent = Agent::start(&gw, Layout::Plain, &s, &[]);
    agent.wait_ready(&gw);
    let (closed, open) = (&gw.peers[0].ns, &gw.peers[1].ns);
    let mut cases = Vec::new();
    for dst in wgfence_tests::topology::DESTINATIONS
        .into_iter()
        .chain(["10.8.0.1", "fd00:8::1"])
    {
        for kind in [Kind::Tcp(443), Kind::Udp(53), Kind::Ping] {
            cases.push(Expect::new("egress []", closed, kind, dst, Reach::Blocked));
            cases.push(Expect::new("no egress", open, kind, dst, Reach::Reached));
        }
    }
    // Replies are on: what the node starts toward the closed peer is answered.
    for dst in ["10.8.0.2", "fd00:8::2"] {
        cases.push(Expect::new(
            "node",
            &gw.node,
            Kind::Ping,
            dst,
            Reach::Reached,
        ));
    }
    check_all(&cases);

    let (ok, out, err) = cli(&gw, &agent, &["check"], &s);
    assert!(ok, "{out}{err}");
    assert!(
        out.contains("note: 1 peer with \"egress\": [] may send nothing (only replies): peer0"),
        "{out}"
    );
    let (ok, out, err) = cli(&gw, &agent, &["plan", "--interface", gw.interface()], &s);
    assert!(ok, "{out}{err}");
    assert!(out.contains("peer0"), "{out}");
    assert!(
        out.contains("0 map writes, 0 WireGuard peer changes"),
        "{out}"
    );

    // null is no longer "unrestricted": rejected, naming the peer and the field.
    let mut null = gw.peer_json(0, None);
    null["egress"] = Value::Null;
    let bad = state(vec![null, gw.peer_json(1, None)]);
    let (ok, _, err) = cli(&gw, &agent, &["check"], &bad);
    assert!(!ok, "check accepted \"egress\": null");
    assert!(
        err.contains("peer \"peer0\" (peers[0]), field egress: null"),
        "{err}"
    );
    agent.write_state(&bad);
    let rejected = || agent.metric(&gw, "wgfence_state_rejected_total") >= 1.0;
    assert!(
        wait_for(Duration::from_secs(5), rejected).is_some(),
        "\"egress\": null was not rejected; log:\n{}",
        agent.log_text()
    );
    assert_eq!(
        probe(closed, Kind::Tcp(443), ip("10.2.3.4")),
        Reach::Blocked
    );
}

/// Any pod reaches the metrics port on the node IP. Clients that keep all its connection slots
/// busy (holding each connection until the agent closes it, then reconnecting at once) must
/// not make the kubelet's liveness probe fail (the kubelet would restart the agent, and
/// CrashLoopBackOff would leave state changes unapplied for minutes) nor delay a revocation.
/// The probe goes where the DaemonSet sends it: the separate health listener.
#[test]
fn clients_holding_the_metrics_port_neither_fail_the_liveness_probe_nor_delay_a_revocation() {
    /// More holders than the metrics port has slots: some always wait to take a freed one.
    const HOLDERS: usize = wgfence::metrics::MAX_CONNECTIONS + 32;
    let gw = Gateway::new(2);
    let both = state(vec![gw.peer_json(0, None), gw.peer_json(1, None)]);
    let agent = Agent::start(&gw, Layout::Plain, &both, &["--health-addr", HEALTH]);
    agent.wait_ready(&gw);
    let metrics: std::net::SocketAddr = wgfence_tests::agent::METRICS.parse().unwrap();
    let stop = AtomicBool::new(false);
    let (live, starved) = thread::scope(|s| {
        s.spawn(|| {
            // Threads inherit the namespace of the thread that starts them.
            gw.node.enter(|| {
                thread::scope(|holders| {
                    for _ in 0..HOLDERS {
                        holders.spawn(|| hold_connections(metrics, &stop));
                    }
                });
            });
        });
        thread::sleep(Duration::from_millis(500));
        // Probe as the kubelet does (a fresh connection, one request) for longer than one
        // header timeout, so the holders go through a round of freed and retaken slots.
        let until = Instant::now() + wgfence::metrics::HEADER_TIMEOUT + Duration::from_secs(2);
        let mut live = Vec::new();
        let mut starved = 0;
        while Instant::now() < until {
            live.push(http_get(&gw.node, HEALTH, "/healthz").map(|(s, _)| s));
            if http_get(&gw.node, wgfence_tests::agent::METRICS, "/healthz").is_none() {
                starved += 1;
            }
            thread::sleep(Duration::from_millis(200));
        }
        revoke_peer_1(&gw, &agent, "the metrics port's slots held busy");
        stop.store(true, Ordering::Relaxed);
        (live, starved)
    });
    eprintln!(
        "liveness probes: {live:?}; fresh requests to the metrics port unanswered: {starved}"
    );
    assert!(
        starved > 0,
        "the holders never filled the metrics port: the test proves nothing"
    );
    assert!(
        live.iter().all(|s| *s == Some(200)),
        "the liveness probe failed while clients held the metrics port: {live:?}"
    );
    // The readiness probe goes there too; the metrics stay on the metrics port only.
    assert_eq!(
        http_get(&gw.node, HEALTH, "/readyz").map(|(s, _)| s),
        Some(200)
    );
    assert_eq!(
        http_get(&gw.node, HEALTH, "/metrics").map(|(s, _)| s),
        Some(404)
    );
}

/// Connects to `addr` again and again, holding each connection (sending nothing) until the
/// agent closes it, until `stop`.
fn hold_connections(addr: std::net::SocketAddr, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
            thread::sleep(Duration::from_millis(5));
            continue;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
        let mut buf = [0u8; 256];
        loop {
            match std::io::Read::read(&mut stream, &mut buf) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                }
                Err(_) => break,
            }
        }
    }
}
