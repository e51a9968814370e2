//! Faults: the agent SIGKILLed in the middle of a large apply, a state larger than the maps,
//! the WireGuard interface deleted and created again, pins, the pin directory or the whole
//! bpffs removed by hand, a second agent on the same interface, the state file deleted, and a
//! state file others can write. Each ends in the kernel holding exactly what
//! the state says (or, where the agent must not act, exactly what it held before).

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    net::IpAddr,
    os::unix::fs::PermissionsExt as _,
    path::Path,
    process::Command,
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use ipnet::IpNet;
use serde_json::{json, Value};
use wgfence::dataplane::{pin_dir, Dataplane, LINK_PIN_EGRESS, LINK_PIN_INGRESS};
use wgfence_common::UNRESTRICTED;
use wgfence_tests::{
    agent::{binary, Agent, Layout},
    bench::gen::{self, Rng},
    ip,
    net::wait_for,
    probe::{probe, Kind, Reach},
    state,
    topology::Gateway,
};

fn web_only() -> Value {
    json!([
        { "cidr": "10.2.3.4/32", "protocol": "tcp", "ports": [80] },
        { "cidr": "10.8.0.1/32", "protocol": "icmp" },
    ])
}

/// Peer 0 restricted to tcp/80 on 10.2.3.4: one probe that must pass, one that must not.
#[track_caller]
fn assert_enforced(gw: &Gateway, when: &str) {
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Tcp(80), ip("10.2.3.4")),
        Reach::Reached,
        "{when}: allowed traffic did not arrive"
    );
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Tcp(22), ip("10.2.3.4")),
        Reach::Blocked,
        "{when}: denied traffic arrived"
    );
}

/// The kernel holds exactly `desired`: every address entry and no other, each peer's
/// addresses on one slot and on the compiled entries of its own rules, no policy entry that no
/// peer references, and WireGuard has exactly the desired peers with their addresses.
#[track_caller]
fn assert_converged(gw: &Gateway, desired_json: &str) {
    let desired = wgfence::state::parse(desired_json).expect("the test's own state is invalid");
    let maps = Dataplane::open_maps(&gw.bpffs, gw.interface()).expect("opening the pinned maps");
    if let Some(mismatch) = wgfence_tests::map_mismatch(&maps, &desired) {
        panic!("the maps do not hold the state: {mismatch}");
    }

    // WireGuard: exactly these peers, each with exactly its addresses.
    let out = wgfence_tests::net::run(&["wg", "show", gw.interface(), "allowed-ips"]);
    let have_wg: BTreeMap<String, BTreeSet<String>> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let mut parts = line.split_whitespace();
            let key = parts.next()?.to_owned();
            Some((key, parts.map(str::to_owned).collect()))
        })
        .collect();
    let want_wg: BTreeMap<String, BTreeSet<String>> = desired
        .peers
        .iter()
        .map(|p| {
            let nets = p
                .addrs()
                .map(|a| IpNet::from(a).to_string())
                .collect::<BTreeSet<_>>();
            (p.public_key.to_base64(), nets)
        })
        .collect();
    if have_wg != want_wg {
        let extra: Vec<_> = have_wg
            .keys()
            .filter(|k| !want_wg.contains_key(*k))
            .take(3)
            .collect();
        let differ: Vec<_> = want_wg
            .iter()
            .filter(|(k, v)| have_wg.get(*k) != Some(v))
            .take(3)
            .collect();
        panic!(
            "WireGuard peers differ: {} present, {} desired; extra e.g. {extra:?}; missing or \
             different e.g. {differ:?}",
            have_wg.len(),
            want_wg.len()
        );
    }
}

/// The seed of a randomised test: `WGFENCE_TEST_SEED`, else the clock; printed so a failure
/// can be replayed.
fn seed() -> u64 {
    let seed = std::env::var("WGFENCE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    eprintln!("seed {seed} (replay with WGFENCE_TEST_SEED={seed})");
    seed
}

/// Generated peers `from..to` (same index, same key and addresses in every generated state),
/// with policies drawn from `seed`'s pool, plus the gateway's real peer 0.
fn generated(gw: &Gateway, from: usize, to: usize, seed: u64) -> String {
    let mut s = gen::state(to, seed);
    if let Some(peers) = s["peers"].as_array_mut() {
        peers.drain(..from);
        peers.push(gw.peer_json(0, Some(web_only())));
    }
    s.to_string()
}

/// SIGKILL at a random instant of a 10,000-peer apply (policy switches, revocations, new
/// peers, WireGuard adds and removes), restart, and the kernel ends exactly at the state:
/// no leaked entry, no missing peer, for a few random kill points.
#[test]
fn sigkill_during_a_large_apply_converges_after_restart() {
    let seed = seed();
    let mut rng = Rng::new(seed);
    let gw = Gateway::new(1);
    // A: peers 0..10000 with one policy pool; B: 2,000 of them gone, 2,000 new, the rest
    // with policies of another pool.
    let a = generated(&gw, 0, 10_000, seed);
    let b = generated(&gw, 2_000, 12_000, seed.wrapping_add(1));
    let mut agent = Agent::start(&gw, Layout::Plain, &a, &[]);
    let t = Instant::now();
    agent.wait_readyz_for(&gw, 200, Duration::from_secs(120));
    let full_apply = t.elapsed();
    eprintln!("first apply of 10,001 peers: {full_apply:?}");
    assert_converged(&gw, &a);

    let mut current = &a;
    for round in 0..3 {
        let next = if std::ptr::eq(current, &a) { &b } else { &a };
        let before = agent.reconciles(&gw);
        agent.write_state(next);
        // Kill somewhere between the file change and the end of the apply it starts.
        let delay = Duration::from_millis(rng.below(full_apply.as_millis() as u64 + 100));
        thread::sleep(delay);
        let finished = agent.reconciles(&gw) > before;
        eprintln!("round {round}: SIGKILL {delay:?} after the change (apply finished: {finished})");
        agent.kill();
        agent.restart(&gw, &[]);
        agent.wait_readyz_for(&gw, 200, Duration::from_secs(120));
        assert_converged(&gw, next);
        current = next;
    }
    // The real peer kept its policy through all of it.
    assert_enforced(&gw, "after the kills");
}

/// A state with more peers than the maps hold is refused whole before any write: the map
/// write counter does not move and the maps keep what they had.
#[test]
fn a_state_beyond_the_maps_capacity_is_rejected_before_any_write() {
    let gw = Gateway::new(1);
    let good = state(vec![gw.peer_json(0, Some(web_only()))]);
    let agent = Agent::start(&gw, Layout::Plain, &good, &[]);
    agent.wait_ready(&gw);
    let writes = agent.metric(&gw, "wgfence_bpf_map_writes_total");
    let before = Dataplane::open_maps(&gw.bpffs, gw.interface())
        .and_then(|m| m.peers())
        .unwrap();

    // One more than the maps' MAX_PEERS (131,072), minimal peers, the real one among them.
    let max = wgfence_common::MAX_PEERS as usize;
    let mut peers: Vec<Value> = (0..max)
        .map(|i| {
            json!({
                "name": format!("p{i}"),
                "publicKey": gen::peer_key(i).to_base64(),
                "address": gen::peer_v4(i).to_string(),
            })
        })
        .collect();
    peers.push(gw.peer_json(0, Some(web_only())));
    agent.write_state(&state(peers));
    agent.wait_rejected(&gw, "131073 peers, the maps hold at most 131072");
    assert_eq!(agent.metric(&gw, "wgfence_bpf_map_writes_total"), writes);
    let after = Dataplane::open_maps(&gw.bpffs, gw.interface())
        .and_then(|m| m.peers())
        .unwrap();
    assert_eq!(after, before, "the maps changed");
    assert_eq!(gw.wg_peers().len(), 1);
    let (status, body) = agent.get(&gw, "/readyz").expect("GET /readyz");
    assert_eq!(status, 503, "{body}");
    assert_enforced(&gw, "after the rejection");
}

/// The WireGuard interface deleted and created again (new index, no peers): the running agent
/// attaches to the new device and puts the peers back; a stopped agent does the same when it
/// starts. Traffic proves the policy is enforced on the new device.
#[test]
fn a_recreated_interface_is_reattached_and_reconverged() {
    let mut gw = Gateway::new(1);
    let s = state(vec![gw.peer_json(0, Some(web_only()))]);
    let mut agent = Agent::start(&gw, Layout::Plain, &s, &[]);
    agent.wait_ready(&gw);
    assert_enforced(&gw, "before");
    let (link_before, _) = Dataplane::ingress_link_info(&gw.bpffs, gw.interface())
        .ok()
        .flatten()
        .expect("no pinned link");

    // While the agent runs.
    gw.recreate_interface();
    let key = gw.peers[0].wg.keys.public.clone();
    let back = wait_for(Duration::from_secs(15), || gw.wg_peers() == [key.clone()]);
    assert!(
        back.is_some(),
        "the agent did not put the peer back on the new device; log:\n{}",
        agent.log_text()
    );
    agent.wait_ready(&gw);
    assert!(agent
        .log_text()
        .contains("attached to the recreated interface"));
    let (link_after, _) = Dataplane::ingress_link_info(&gw.bpffs, gw.interface())
        .ok()
        .flatten()
        .expect("no pinned link after the recreation");
    assert_ne!(link_before, link_after, "the dead link is still pinned");
    gw.new_session(0);
    assert_enforced(
        &gw,
        "after the interface was recreated under a running agent",
    );
    assert_converged(&gw, &s);

    // While the agent is stopped: the next start finds a dead link pinned.
    assert!(agent.stop().is_some_and(|s| s.success()));
    gw.recreate_interface();
    agent.restart(&gw, &[]);
    agent.wait_ready(&gw);
    gw.new_session(0);
    assert_enforced(
        &gw,
        "after the interface was recreated under a stopped agent",
    );
    assert_converged(&gw, &s);
}

/// Pins removed by hand while the agent runs: the program stays attached (the agent holds the
/// link), and the agent pins them again within seconds, so `bpftool` and the next start's
/// adoption see them. `wgfence detach` is an operator's decision: when it returns, the agent
/// has let go and the programs are off the interface.
#[test]
fn pins_removed_by_hand_are_restored_and_a_detach_is_respected() {
    let gw = Gateway::new(1);
    let s = state(vec![gw.peer_json(0, Some(web_only()))]);
    let agent = Agent::start(&gw, Layout::Plain, &s, &[]);
    agent.wait_ready(&gw);
    let dir = gw.bpffs.join("wgfence").join(gw.interface());
    let removed = [
        dir.join("link_ingress"),
        dir.join(wgfence_common::map_names::PEERS_V4),
        dir.join(wgfence_common::map_names::POLICY_V4),
    ];
    for pin in &removed {
        fs::remove_file(pin).unwrap_or_else(|e| panic!("{}: {e}", pin.display()));
    }
    // Still enforcing at once: the program did not go with its link's pin.
    assert_enforced(&gw, "right after the pins were removed");
    let restored = wait_for(Duration::from_secs(5), || {
        removed.iter().all(|p| p.exists())
    });
    assert!(
        restored.is_some(),
        "the pins were not restored; log:\n{}",
        agent.log_text()
    );
    // The restored pins are the live objects: what the maps hold, and the link the program
    // runs on.
    assert_converged(&gw, &s);
    assert!(Dataplane::ingress_link_info(&gw.bpffs, gw.interface())
        .ok()
        .flatten()
        .is_some());
    assert_enforced(&gw, "after the pins were restored");
    assert_eq!(agent.get(&gw, "/readyz").map(|(s, _)| s), Some(200));

    // `wgfence detach` while the agent runs: enforcement stops at once and stays stopped.
    assert_detach_releases(&gw, &agent, &[]);
}

/// The state file deleted: the last applied state stays enforced, /readyz and `wgfence
/// status` say why the agent is not ready, and it recovers when the file returns.
#[test]
fn a_deleted_state_file_keeps_enforcing_and_recovers() {
    let gw = Gateway::new(1);
    let s = state(vec![gw.peer_json(0, Some(web_only()))]);
    let agent = Agent::start(&gw, Layout::Plain, &s, &[]);
    agent.wait_ready(&gw);
    let writes = agent.metric(&gw, "wgfence_bpf_map_writes_total");

    fs::remove_file(&agent.state).unwrap();
    agent.wait_readyz(&gw, 503);
    let (_, body) = agent.get(&gw, "/readyz").expect("GET /readyz");
    assert!(body.contains("state file missing"), "{body}");
    let out = Command::new(binary())
        .args(["status", "--interface", gw.interface(), "--json"])
        .output()
        .expect("wgfence status");
    let report: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("status --json: {e}: {out:?}"));
    assert_eq!(report["agent"]["ready"], false, "{report:#}");
    assert!(
        report["agent"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("state file missing")),
        "{report:#}"
    );
    assert_enforced(&gw, "with the state file gone");
    assert_converged(&gw, &s);
    assert_eq!(agent.metric(&gw, "wgfence_bpf_map_writes_total"), writes);

    agent.write_state(&s);
    agent.wait_ready(&gw);
    assert_eq!(agent.metric(&gw, "wgfence_bpf_map_writes_total"), writes);
    assert_enforced(&gw, "after the state file returned");
}

/// A state file others can write: the agent refuses to start (naming the path and the mode),
/// starts with --allow-insecure-state, and stops applying a file that becomes writable while
/// it runs.
#[test]
fn a_state_file_others_can_write_is_refused() {
    let gw = Gateway::new(1);
    let s = state(vec![gw.peer_json(0, Some(web_only()))]);
    let mut agent = Agent::start(&gw, Layout::Plain, &s, &[]);
    agent.wait_ready(&gw);
    assert!(agent.stop().is_some_and(|s| s.success()));

    fs::set_permissions(&agent.state, fs::Permissions::from_mode(0o666)).unwrap();
    let out = wgfence_tests::agent::run_command(&binary(), &gw, &agent.state)
        .output()
        .expect("wgfence run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "{} (mode 0666) is writable by its group and all users",
            agent.state.display()
        )),
        "{stderr}"
    );

    agent.restart(&gw, &["--allow-insecure-state"]);
    agent.wait_ready(&gw);
    assert!(agent.stop().is_some_and(|s| s.success()));

    // Secure at start, made writable while running: the next load is refused.
    fs::set_permissions(&agent.state, fs::Permissions::from_mode(0o644)).unwrap();
    agent.restart(&gw, &[]);
    agent.wait_ready(&gw);
    fs::set_permissions(&agent.state, fs::Permissions::from_mode(0o664)).unwrap();
    // A chmod is no directory event: touch the directory the way an update would.
    agent.write_state_in_place(&s);
    agent.wait_readyz(&gw, 503);
    let (_, body) = agent.get(&gw, "/readyz").expect("GET /readyz");
    assert!(body.contains("not trusted"), "{body}");
    assert_enforced(&gw, "with an untrusted state file");
}

/// A pin directory adopted with a looser mode (a hand-made one, or a bpffs mounted 1777) is
/// tightened to root only: whoever can open a pin can rewrite the policy.
#[test]
fn a_loose_pin_directory_is_tightened_to_root_only() {
    let gw = Gateway::new(1);
    let dir = gw.bpffs.join("wgfence").join(gw.interface());
    fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
    let s = state(vec![gw.peer_json(0, Some(web_only()))]);
    let agent = Agent::start(&gw, Layout::Plain, &s, &[]);
    agent.wait_ready(&gw);
    let mode = fs::metadata(&dir)
        .map(|m| m.permissions().mode() & 0o7777)
        .unwrap();
    assert_eq!(mode, 0o700, "{:o}", mode);
    assert!(agent.log_text().contains("tightened to 0700"));
    let parent = fs::metadata(gw.bpffs.join("wgfence"))
        .map(|m| m.permissions().mode() & 0o077)
        .unwrap();
    assert_eq!(parent, 0, "<bpffs>/wgfence is open to others");
    assert_enforced(&gw, "after adopting the directory");
}

/// Fills the pinned IPv4 peer map to its capacity (`MAX_PEERS`) with entries of addresses no
/// peer has (10.200.0.0/14), as a gateway at capacity is: the kernel refuses the next new
/// entry. WireGuard-go holds at most 65,536 peers, so a full map cannot be reached through
/// peers; the agent does not know these entries until its next full read.
fn fill_peer_map(gw: &Gateway) -> usize {
    let max = wgfence_common::MAX_PEERS as usize;
    let mut maps =
        Dataplane::open_maps(&gw.bpffs, gw.interface()).expect("opening the pinned maps");
    let present = maps
        .peers()
        .expect("reading peers")
        .iter()
        .filter(|(addr, _)| addr.is_ipv4())
        .count();
    let base = u32::from(std::net::Ipv4Addr::new(10, 200, 0, 0));
    let filler = |i: usize| IpAddr::from(std::net::Ipv4Addr::from(base + i as u32));
    for i in 0..max - present {
        let entry = wgfence_common::PeerEntry {
            policy: UNRESTRICTED,
            slot: (i % max) as u32,
            owner: 0,
            ..wgfence_common::PeerEntry::default()
        };
        maps.upsert_peer(filler(i), entry)
            .unwrap_or_else(|e| panic!("filling the peer map ({i} of {}): {e}", max - present));
    }
    let over = wgfence_common::PeerEntry {
        policy: UNRESTRICTED,
        slot: 0,
        owner: 0,
        ..wgfence_common::PeerEntry::default()
    };
    assert!(
        maps.upsert_peer(filler(max), over).is_err(),
        "the peer map took more than MAX_PEERS entries"
    );
    max - present
}

/// Writes `state` and asserts that peer `i` is cut off within a second: polls tcp/22 from it
/// (unrestricted: a reset answers while it may send) until a probe is dropped, and takes the
/// time that probe was sent.
#[track_caller]
fn assert_revoked_at_once(gw: &Gateway, agent: &Agent, i: usize, state: &str, push: &str) {
    let since = Instant::now();
    agent.write_state(state);
    let mut revoked = None;
    while revoked.is_none() && since.elapsed() < Duration::from_secs(3) {
        let sent = since.elapsed();
        if probe(&gw.peers[i].ns, Kind::Tcp(22), ip("10.2.3.4")) == Reach::Blocked {
            revoked = Some(sent);
        }
        thread::sleep(Duration::from_millis(20));
    }
    eprintln!("peer {i} revoked after {revoked:?} ({push})");
    assert!(
        revoked.is_some_and(|d| d < Duration::from_secs(1)),
        "peer {i} still reached the node {:?} after {push}; log:\n{}",
        since.elapsed(),
        agent.log_text()
    );
}

/// Issue 11 item 5: at a full peer map, "revoke r + add n" revokes r at once. The plan deletes
/// the addresses that leave before it writes any: the put of n would fail while r's entry
/// still took the room, and the revocation was retried behind it forever. Then a push whose
/// puts do not all fit (revoke n + add two): the put that fails leaves n revoked, and the
/// retry (which reads the kernel again and repairs the drift) converges.
#[test]
fn at_a_full_peer_map_revoke_r_and_add_n_revokes_r_at_once() {
    let gw = Gateway::new(2);
    let r = state(vec![gw.peer_json(0, None)]);
    let agent = Agent::start(&gw, Layout::Plain, &r, &["--resync", "3600"]);
    agent.wait_ready(&gw);
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Tcp(22), ip("10.2.3.4")),
        Reach::Reached,
        "r does not reach anything before its revocation"
    );
    let t = Instant::now();
    let filled = fill_peer_map(&gw);
    eprintln!(
        "filled the peer map with {filled} entries in {:?}",
        t.elapsed()
    );

    let errors = agent.metric(&gw, "wgfence_reconcile_errors_total");
    let reconciles = agent.reconciles(&gw);
    let n = state(vec![gw.peer_json(1, None)]);
    assert_revoked_at_once(
        &gw,
        &agent,
        0,
        &n,
        "\"revoke r + add n\" at a full peer map",
    );
    // The revocation made the room n needed: nothing failed, and n is in.
    agent.wait_reconciles(&gw, reconciles, 1.0);
    assert_eq!(
        agent.metric(&gw, "wgfence_reconcile_errors_total"),
        errors,
        "log:\n{}",
        agent.log_text()
    );
    gw.new_session(1);
    assert_eq!(
        probe(&gw.peers[1].ns, Kind::Tcp(22), ip("10.2.3.4")),
        Reach::Reached,
        "n does not reach the node"
    );
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Tcp(22), ip("10.2.3.4")),
        Reach::Blocked,
        "r came back"
    );

    // The map is full again (the fillers and n). Revoke n and add two peers: one put fails.
    let extra = |i: usize| {
        json!({ "name": format!("x{i}"), "publicKey": gen::peer_key(i).to_base64(),
                "address": gen::peer_v4(i).to_string() })
    };
    let two = state(vec![extra(0), extra(1)]);
    assert_revoked_at_once(&gw, &agent, 1, &two, "a push whose last put failed");
    let failed = wait_for(Duration::from_secs(5), || {
        agent.metric(&gw, "wgfence_reconcile_errors_total") > errors
    });
    assert!(
        failed.is_some(),
        "no put failed (the map was not full?); log:\n{}",
        agent.log_text()
    );
    // The retry reads the kernel again: n's entries are gone, the drift is repaired.
    agent.wait_readyz_for(&gw, 200, Duration::from_secs(30));
    let desired = wgfence::state::parse(&two).unwrap();
    let maps = Dataplane::open_maps(&gw.bpffs, gw.interface()).expect("opening the pinned maps");
    assert_eq!(wgfence_tests::map_mismatch(&maps, &desired), None);
    assert_eq!(
        probe(&gw.peers[1].ns, Kind::Tcp(22), ip("10.2.3.4")),
        Reach::Blocked,
        "n came back"
    );
}

/// Every pin of a complete datapath: the maps and both links.
fn all_pins(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    wgfence_common::map_names::ALL
        .iter()
        .chain(&[LINK_PIN_INGRESS, LINK_PIN_EGRESS])
        .map(|name| dir.join(name))
        .collect()
}

/// Denied traffic from peer 0 stays denied for `how_long`: probed back to back (a dropped
/// probe takes 0.8 s), so a gap of a second without the program is seen.
#[track_caller]
fn assert_denied_throughout(gw: &Gateway, how_long: Duration, when: &str) {
    let start = Instant::now();
    let mut probes = 0;
    while start.elapsed() < how_long {
        assert_eq!(
            probe(&gw.peers[0].ns, Kind::Tcp(22), ip("10.2.3.4")),
            Reach::Blocked,
            "{when}: denied traffic arrived {:?} in (probe {probes})",
            start.elapsed()
        );
        probes += 1;
    }
}

/// Waits until every pin is back (every one the docs list: the maps, the tombstones, the
/// links and the programs), and checks they are the live objects: the maps hold the state,
/// the link pin is the link the program runs on, the directory is root's only.
#[track_caller]
fn assert_pins_restored(gw: &Gateway, agent: &Agent, s: &str, link: (u32, u32)) {
    let dir = pin_dir(&gw.bpffs, gw.interface());
    let missing = || {
        let present: Vec<String> = fs::read_dir(&dir)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default();
        wgfence::dataplane::pins()
            .into_iter()
            .filter(|pin| match pin.strip_suffix("<identity>") {
                Some(prefix) => !present.iter().any(|p| p.starts_with(prefix)),
                None => !present.contains(pin),
            })
            .collect::<Vec<_>>()
    };
    let restored = wait_for(Duration::from_secs(5), || missing().is_empty());
    assert!(
        restored.is_some(),
        "the pins were not restored: missing {:?}; log:\n{}",
        missing(),
        agent.log_text()
    );
    let mode = fs::metadata(&dir)
        .map(|m| m.permissions().mode() & 0o7777)
        .unwrap();
    assert_eq!(mode, 0o700, "re-created pin directory mode {mode:o}");
    assert_eq!(
        Dataplane::ingress_link_info(&gw.bpffs, gw.interface()).unwrap(),
        Some(link),
        "the pinned link is not the one the agent held"
    );
    assert_converged(gw, s);
}

/// The agent answers `/healthz` and `/readyz` with 200.
#[track_caller]
fn assert_healthy(gw: &Gateway, agent: &Agent, when: &str) {
    for path in ["/healthz", "/readyz"] {
        let answer = agent.get(gw, path);
        assert_eq!(
            answer.as_ref().map(|(s, _)| *s),
            Some(200),
            "{when}: {path} answered {answer:?}"
        );
    }
}

/// Revokes peer 0's tcp/80 and checks the maps hold the new state within a second, and that
/// traffic shows it.
#[track_caller]
fn assert_revocation_applies(gw: &Gateway, agent: &Agent, when: &str) {
    let revoked = state(vec![gw.peer_json(
        0,
        Some(json!([{ "cidr": "10.8.0.1/32", "protocol": "icmp" }])),
    )]);
    let desired = wgfence::state::parse(&revoked).unwrap();
    agent.write_state(&revoked);
    let applied = wait_for(Duration::from_secs(1), || {
        Dataplane::open_maps(&gw.bpffs, gw.interface())
            .ok()
            .is_some_and(|m| wgfence_tests::map_mismatch(&m, &desired).is_none())
    });
    assert!(
        applied.is_some(),
        "{when}: the revocation was not applied within a second; log:\n{}",
        agent.log_text()
    );
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Tcp(80), ip("10.2.3.4")),
        Reach::Blocked,
        "{when}: revoked traffic arrived"
    );
    assert_converged(gw, &revoked);
}

fn repairs(gw: &Gateway, agent: &Agent) -> f64 {
    agent.metric(gw, "wgfence_datapath_repairs_total{what=\"pin_dir\"}")
}

/// Runs a command with only the capabilities the DaemonSet grants (no CAP_SYS_ADMIN).
const POD_CAPABILITIES: [&str; 6] = [
    "setpriv",
    "--bounding-set",
    "-all,+bpf,+net_admin,+perfmon",
    "--inh-caps",
    "-all",
    "--",
];

/// `wgfence detach` on a running agent (through `wrapper`, if any): when it returns, the
/// programs are off the interface (the agent let go of its links), and the agent stays
/// detached.
#[track_caller]
fn assert_detach_releases(gw: &Gateway, agent: &Agent, wrapper: &[&str]) {
    let (link, _) = Dataplane::ingress_link_info(&gw.bpffs, gw.interface())
        .ok()
        .flatten()
        .expect("no pinned link before the detach");
    let mut detach = match wrapper.split_first() {
        Some((program, args)) => {
            let mut command = Command::new(program);
            command.args(args).arg(binary());
            command
        }
        None => Command::new(binary()),
    };
    let out = detach
        .args(["detach", "--interface", gw.interface(), "--bpffs"])
        .arg(&gw.bpffs)
        .output()
        .expect("wgfence detach");
    assert!(out.status.success(), "{out:?}");
    // At once: detach returns only when the links are gone.
    let link_show = Command::new("bpftool")
        .args(["link", "show", "id", &link.to_string()])
        .output()
        .expect("bpftool");
    assert!(
        !link_show.status.success(),
        "link {link} still exists after detach returned: {link_show:?}"
    );
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Tcp(22), ip("10.2.3.4")),
        Reach::Reached,
        "still filtering right after detach returned"
    );
    agent.wait_readyz(gw, 503);
    let (_, body) = agent.get(gw, "/readyz").expect("GET /readyz");
    assert!(body.contains("detached"), "{body}");
    thread::sleep(Duration::from_secs(2));
    let dir = pin_dir(&gw.bpffs, gw.interface());
    assert!(!dir.exists(), "the agent pinned again after a detach");
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Tcp(22), ip("10.2.3.4")),
        Reach::Reached,
        "filtering again after detach"
    );
}

/// The pin directory removed by hand (`rm -rf`, a cleanup script) while the agent enforces is
/// damage, not a detach: the programs never stop, the directory and every pin come back as
/// the live objects, the agent stays healthy and ready, counts the repair, and keeps applying
/// state changes. `wgfence detach` still detaches. The agent and `detach` run with the
/// DaemonSet's capabilities only, as in a pod.
#[test]
fn a_removed_pin_directory_is_restored_and_enforcement_never_stops() {
    let gw = Gateway::new(1);
    let s = state(vec![gw.peer_json(0, Some(web_only()))]);
    let agent = Agent::start_wrapped(&gw, Layout::Plain, &s, &[], &POD_CAPABILITIES);
    agent.wait_ready(&gw);
    // A few datapath checks (one a second) pass with these capabilities.
    thread::sleep(Duration::from_millis(2500));
    assert_healthy(&gw, &agent, "with the DaemonSet's capabilities");
    let link = Dataplane::ingress_link_info(&gw.bpffs, gw.interface())
        .ok()
        .flatten()
        .expect("no pinned link");
    let dir = pin_dir(&gw.bpffs, gw.interface());

    fs::remove_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    assert_denied_throughout(
        &gw,
        Duration::from_secs(3),
        "with the pin directory removed",
    );
    assert_pins_restored(&gw, &agent, &s, link);
    assert_healthy(&gw, &agent, "after the pin directory was restored");
    assert_eq!(repairs(&gw, &agent), 1.0);
    assert!(agent.log_text().contains("ERROR"), "no error logged");
    assert_enforced(&gw, "after the pin directory was restored");
    assert_revocation_applies(&gw, &agent, "after the pin directory was restored");

    assert_detach_releases(&gw, &agent, &POD_CAPABILITIES);
}

/// A bpffs of the agent's own: the agent runs in a mount namespace of its own (private
/// propagation) where a fresh bpffs is mounted, so nothing outside sees it (namespaces other
/// tests create copy the host's mounts, not this one, and would keep an unmounted bpffs and its
/// pins alive), and /sys/fs/bpf, which other tests use, is never touched. The test reaches it
/// through `/proc/<agent>/root`.
struct PrivateBpffs {
    /// The mount point, as the agent sees it.
    path: std::path::PathBuf,
}

impl PrivateBpffs {
    fn new() -> Self {
        let path = std::env::temp_dir().join(wgfence_tests::net::unique("wgft-bpffs-"));
        fs::create_dir_all(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Self { path }
    }

    /// What to start the agent through: a new mount namespace with the bpffs mounted.
    fn wrapper(&self) -> Vec<String> {
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            &format!(
                "mount -t bpf bpf {} && exec \"$0\" \"$@\"",
                self.path.display()
            ),
        ]
        .map(str::to_owned)
        .to_vec()
    }

    /// The bpffs as the test sees it (through the agent's root).
    fn seen_from_outside(&self, agent: &Agent) -> std::path::PathBuf {
        let pid = agent.pid().expect("the agent is not running");
        std::path::Path::new(&format!("/proc/{pid}/root"))
            .join(self.path.strip_prefix("/").unwrap())
    }

    /// Runs `args` in the agent's mount namespace.
    fn in_agent_ns(agent: &Agent, args: &[&str]) {
        let pid = agent.pid().expect("the agent is not running").to_string();
        let mut full = vec!["nsenter", "--target", &pid, "--mount"];
        full.extend_from_slice(args);
        wgfence_tests::net::run(&full);
    }

    /// Unmounts the bpffs (lazily, as a host remount would leave it to whoever holds it).
    fn unmount(&self, agent: &Agent) {
        Self::in_agent_ns(agent, &["umount", "-l", &self.path.to_string_lossy()]);
    }

    /// Mounts a fresh, empty bpffs.
    fn mount(&self, agent: &Agent) {
        let path = self.path.to_string_lossy();
        Self::in_agent_ns(agent, &["mount", "-t", "bpf", "bpf", &path]);
    }
}

impl Drop for PrivateBpffs {
    fn drop(&mut self) {
        // The mount went with the agent's namespace.
        let _ = fs::remove_dir(&self.path);
    }
}

/// The whole `<bpffs>/wgfence` directory removed, and bpffs unmounted and a fresh one mounted
/// (a host remount): both are repaired like a removed pin directory, the repaired directory is
/// locked again (a second agent is refused), and `wgfence detach` still detaches. While no
/// bpffs is mounted, the programs keep enforcing, the failure is counted and a revocation
/// still applies.
#[test]
fn a_removed_wgfence_directory_and_a_remounted_bpffs_are_repaired() {
    let bpffs = PrivateBpffs::new();
    let mut gw = Gateway::new(1);
    let bpffs_arg = bpffs.path.to_string_lossy().into_owned();
    let wrapper = bpffs.wrapper();
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    let s = state(vec![gw.peer_json(0, Some(web_only()))]);
    let agent = Agent::start_wrapped(&gw, Layout::Plain, &s, &["--bpffs", &bpffs_arg], &wrapper);
    // The gateway's own cleanup finds nothing there once the agent's namespace is gone.
    gw.bpffs = bpffs.seen_from_outside(&agent);
    agent.wait_ready(&gw);
    let link = Dataplane::ingress_link_info(&gw.bpffs, gw.interface())
        .ok()
        .flatten()
        .expect("no pinned link");

    let wgfence_dir = gw.bpffs.join("wgfence");
    fs::remove_dir_all(&wgfence_dir).unwrap();
    assert_denied_throughout(&gw, Duration::from_secs(3), "with <bpffs>/wgfence removed");
    assert_pins_restored(&gw, &agent, &s, link);
    let parent_mode = fs::metadata(&wgfence_dir)
        .map(|m| m.permissions().mode() & 0o077)
        .unwrap();
    assert_eq!(parent_mode, 0, "<bpffs>/wgfence re-created open to others");
    assert_healthy(&gw, &agent, "after <bpffs>/wgfence was restored");
    assert_eq!(repairs(&gw, &agent), 1.0);

    // bpffs unmounted: nothing to pin to. The programs keep enforcing from the agent's
    // descriptors, the failure is counted, and state changes still apply.
    bpffs.unmount(&agent);
    assert_denied_throughout(&gw, Duration::from_secs(2), "with bpffs unmounted");
    let failed = wait_for(Duration::from_secs(5), || {
        agent.metric(&gw, "wgfence_datapath_repair_failures_total") >= 1.0
    });
    assert!(
        failed.is_some(),
        "no repair failure counted; log:\n{}",
        agent.log_text()
    );
    assert_healthy(&gw, &agent, "with bpffs unmounted");
    // The icmp rule revoked while nothing is pinned.
    let no_icmp = state(vec![gw.peer_json(
        0,
        Some(json!([{ "cidr": "10.2.3.4/32", "protocol": "tcp", "ports": [80] }])),
    )]);
    let writes = agent.metric(&gw, "wgfence_bpf_map_writes_total");
    agent.write_state(&no_icmp);
    // Scraped every 100 ms, not faster: with the pins gone each scrape logs a debug line into
    // agent.log, which is in the watched state directory, and back-to-back events would keep
    // the watcher's 50 ms debounce from ever ending.
    let start = Instant::now();
    let mut applied = None;
    while applied.is_none() && start.elapsed() < Duration::from_secs(1) {
        thread::sleep(Duration::from_millis(100));
        if agent.metric(&gw, "wgfence_bpf_map_writes_total") > writes {
            applied = Some(start.elapsed());
        }
    }
    assert!(
        applied.is_some(),
        "a revocation was not applied within a second with bpffs unmounted; log:\n{}",
        agent.log_text()
    );
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Ping, ip("10.8.0.1")),
        Reach::Blocked,
        "revoked icmp arrived with bpffs unmounted"
    );

    // A fresh, empty bpffs mounted again: everything is pinned there.
    bpffs.mount(&agent);
    assert_denied_throughout(&gw, Duration::from_secs(2), "on a fresh bpffs");
    assert_pins_restored(&gw, &agent, &no_icmp, link);
    assert_healthy(&gw, &agent, "after the pins were restored on a fresh bpffs");
    assert_eq!(repairs(&gw, &agent), 2.0);

    // The repaired directory is locked again.
    let pid = agent.pid().expect("the agent is not running");
    let seen = gw.bpffs.to_string_lossy().into_owned();
    let out = second_agent(&gw, &s, &["--bpffs", &seen]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains(&format!("pid {pid}")), "{stderr}");

    assert_revocation_applies(&gw, &agent, "on a fresh bpffs");
    assert_detach_releases(&gw, &agent, &[]);
}

/// Runs `wgfence run --no-metrics` on the gateway's interface with `state` (in a directory
/// of its own) and waits up to 5 s for it to exit; a second agent that keeps running fails the
/// test.
fn second_agent(gw: &Gateway, state: &str, extra: &[&str]) -> std::process::Output {
    second_agent_as(state, |path| {
        let mut command = wgfence_tests::agent::run_command(&binary(), gw, path);
        command.args(extra);
        command
    })
}

/// As [`second_agent`], with the command `command` makes for the state file's path.
fn second_agent_as(
    state: &str,
    command: impl FnOnce(&Path) -> std::process::Command,
) -> std::process::Output {
    let dir = std::env::temp_dir().join(wgfence_tests::net::unique("wgfence-second-"));
    fs::create_dir_all(&dir).unwrap();
    let path = dir.join("state.json");
    fs::write(&path, state).unwrap();
    let mut child = command(&path)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("wgfence run");
    let exited = wait_for(Duration::from_secs(5), || {
        child.try_wait().ok().flatten().is_some()
    });
    if exited.is_none() {
        let _ = child.kill();
    }
    let out = child.wait_with_output().expect("wgfence run");
    let _ = fs::remove_dir_all(&dir);
    assert!(
        exited.is_some(),
        "a second agent runs beside the first; its log:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A second `wgfence run` on an interface an agent already runs on exits non-zero at once,
/// names the running agent's pid, and changes nothing: the maps and links stay as they were,
/// the first agent keeps enforcing and keeps applying changes. Both without the metrics port
/// (that used to be the only guard) and, as an operator repeats the command, with the same
/// default port as the first, which is still in use.
#[test]
fn a_second_agent_on_the_same_interface_is_refused() {
    let gw = Gateway::new(1);
    let s = state(vec![gw.peer_json(0, Some(web_only()))]);
    let agent = Agent::start(&gw, Layout::Plain, &s, &[]);
    agent.wait_ready(&gw);
    let pid = agent.pid().expect("the agent is not running");
    let snapshot = || {
        let maps = Dataplane::open_maps(&gw.bpffs, gw.interface()).unwrap();
        (
            maps.peers()
                .unwrap()
                .into_iter()
                .collect::<BTreeMap<_, _>>(),
            maps.policies()
                .unwrap()
                .into_iter()
                .map(|e| ((e.policy, e.prefix), e.value.allows().to_vec()))
                .collect::<BTreeMap<_, _>>(),
            Dataplane::ingress_link_info(&gw.bpffs, gw.interface()).unwrap(),
            Dataplane::egress_link_info(&gw.bpffs, gw.interface()).unwrap(),
        )
    };
    let before = snapshot();

    // Another view of the world: peer 0 unrestricted.
    let other = state(vec![gw.peer_json(0, None)]);
    let t = Instant::now();
    let out = second_agent(&gw, &other, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("second agent exited after {:?}: {stderr}", t.elapsed());
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("pid {pid}")),
        "the message does not name the running agent (pid {pid}): {stderr}"
    );
    assert_eq!(snapshot(), before, "the second agent changed the datapath");

    // The same command as the first agent's, default metrics port and all.
    let out = second_agent_as(&other, |path| {
        let mut command = gw.node.command(binary());
        command
            .args(["run", "--interface", gw.interface(), "--state"])
            .arg(path);
        command
    });
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("locked by another wgfence agent (pid {pid})")),
        "with the first agent's metrics port, the message does not name it (pid {pid}): \
         {stderr}"
    );
    assert_eq!(snapshot(), before, "the second agent changed the datapath");
    assert_enforced(&gw, "after the second agent was refused");
    assert_healthy(&gw, &agent, "after the second agent was refused");
    assert_revocation_applies(&gw, &agent, "after the second agent was refused");
}

/// The pinned (link id, program id) of the ingress and of the egress link.
fn links(gw: &Gateway) -> ((u32, u32), (u32, u32)) {
    let get = |pin| {
        let info = if pin == LINK_PIN_INGRESS {
            Dataplane::ingress_link_info(&gw.bpffs, gw.interface())
        } else {
            Dataplane::egress_link_info(&gw.bpffs, gw.interface())
        };
        info.unwrap_or_else(|e| panic!("{pin}: {e}"))
            .unwrap_or_else(|| panic!("{pin} is not pinned"))
    };
    (get(LINK_PIN_INGRESS), get(LINK_PIN_EGRESS))
}

/// Whether program `prog` runs on `device`'s tcx hook, `direction` "ingress" or "egress" (a
/// query in the node's namespace; this bpftool predates tcx).
fn runs_on(gw: &Gateway, device: &str, direction: &str, prog: u32) -> bool {
    use aya::programs::{SchedClassifier, TcAttachType};
    let attach_type = if direction == "ingress" {
        TcAttachType::Ingress
    } else {
        TcAttachType::Egress
    };
    gw.node
        .enter(|| SchedClassifier::query_tcx(device, attach_type))
        .is_ok_and(|(_, programs)| programs.iter().any(|p| p.id() == prog))
}

/// `bpftool link detach` on `link` (link id, program id), then waits until the program runs on
/// that hook of the interface again and the hook's pin names the new link (the agent checks
/// once a second; it attaches the new link first and pins it over the old pin just after, so
/// the pin is the last thing to change).
#[track_caller]
fn detach_and_wait_back(gw: &Gateway, agent: &Agent, direction: &str, link: (u32, u32)) {
    let out = Command::new("bpftool")
        .args(["link", "detach", "id", &link.0.to_string()])
        .output()
        .expect("bpftool");
    assert!(out.status.success(), "{out:?}");
    let pinned = |gw: &Gateway| {
        let (ingress, egress) = links(gw);
        if direction == "ingress" {
            ingress
        } else {
            egress
        }
    };
    let back = wait_for(Duration::from_millis(1500), || {
        runs_on(gw, gw.interface(), direction, link.1) && pinned(gw).0 != link.0
    });
    assert!(
        back.is_some(),
        "the {direction} program did not come back; log:\n{}",
        agent.log_text()
    );
}

/// One of the two tcx links detached behind the agent's back (`bpftool link detach`), the
/// device unchanged: the agent attaches a new link for that hook only, before it lets go of
/// the dead one, and never touches the link that still works. Denied traffic never passes
/// while the egress link is missing (enforcement is the ingress link's), and each missing hook
/// is back within about a second (the agent checks once a second).
#[test]
fn a_link_detached_behind_the_agents_back_comes_back_alone() {
    let gw = Gateway::new(1);
    let s = state(vec![gw.peer_json(0, Some(web_only()))]);
    let agent = Agent::start(&gw, Layout::Plain, &s, &[]);
    agent.wait_ready(&gw);
    let (ingress, egress) = links(&gw);

    thread::scope(|scope| {
        let stream = scope.spawn(|| {
            assert_denied_throughout(&gw, Duration::from_secs(3), "egress link detached")
        });
        thread::sleep(Duration::from_millis(300));
        detach_and_wait_back(&gw, &agent, "egress", egress);
        if let Err(panic) = stream.join() {
            std::panic::resume_unwind(panic);
        }
    });
    let (ingress_now, egress_now) = links(&gw);
    assert_eq!(
        ingress_now,
        ingress,
        "the ingress link, which was never detached, was replaced; log:\n{}",
        agent.log_text()
    );
    assert_ne!(
        egress_now.0, egress.0,
        "the dead egress link is still pinned"
    );
    assert_eq!(egress_now.1, egress.1, "another egress program");
    assert_enforced(&gw, "after the egress link came back");

    // Now the ingress link: enforcement is gone until the agent's next check, then back.
    detach_and_wait_back(&gw, &agent, "ingress", ingress);
    let (ingress_now, egress_again) = links(&gw);
    assert_eq!(egress_again, egress_now, "the egress link was replaced");
    assert_ne!(
        ingress_now.0, ingress.0,
        "the dead ingress link is still pinned"
    );
    assert_enforced(&gw, "after the ingress link came back");
    assert_healthy(&gw, &agent, "after both links came back");
}

/// The WireGuard interface renamed (`ip link set wgX name wgY`) while its peers stay connected
/// through it, and a new device created under the agent's name: the agent attaches to the new
/// device and keeps enforcing on the renamed one (it holds its links until that device goes):
/// denied traffic through the renamed device never passes.
#[test]
fn a_renamed_interface_keeps_enforcing_beside_its_successor() {
    use wgfence_tests::net::{unique, WireGuard};

    /// The renamed device's UAPI socket, moved by the test: removed however it ends.
    struct Socket(std::path::PathBuf);
    impl Drop for Socket {
        fn drop(&mut self) {
            let _ = fs::remove_file(&self.0);
        }
    }

    let gw = Gateway::new(1);
    let s = state(vec![gw.peer_json(0, Some(web_only()))]);
    let agent = Agent::start(&gw, Layout::Plain, &s, &[]);
    agent.wait_ready(&gw);
    assert_enforced(&gw, "before the rename");
    let (ingress, egress) = links(&gw);

    let name = gw.interface().to_owned();
    let renamed = unique("wgr");
    // A device that is up cannot be renamed; its links and wireguard-go's peers survive this.
    gw.node.ip(&["link", "set", &name, "down"]);
    gw.node.ip(&["link", "set", &name, "name", &renamed]);
    gw.node.ip(&["link", "set", &renamed, "up"]);
    gw.node
        .ip(&["route", "replace", "10.8.0.0/24", "dev", &renamed]);
    let old_socket = gw.wg.socket();
    let socket = Socket(old_socket.with_file_name(format!("{renamed}.sock")));
    fs::rename(&old_socket, &socket.0).unwrap();
    let successor = WireGuard::start(&gw.node, &name, 51821);
    let attached = wait_for(Duration::from_secs(5), || {
        agent
            .log_text()
            .contains("attached to the recreated interface")
    });
    assert!(attached.is_some(), "log:\n{}", agent.log_text());
    assert!(
        runs_on(&gw, &successor.name, "ingress", ingress.1)
            && runs_on(&gw, &successor.name, "egress", egress.1),
        "the new device is not enforced"
    );
    assert!(
        runs_on(&gw, &renamed, "ingress", ingress.1),
        "the agent let go of the renamed device's ingress; log:\n{}",
        agent.log_text()
    );
    assert_denied_throughout(&gw, Duration::from_secs(3), "through the renamed device");
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Tcp(80), ip("10.2.3.4")),
        Reach::Reached,
        "allowed traffic through the renamed device did not arrive"
    );
    // Once the renamed device goes, the agent lets go of its links (wireguard-go, stopping,
    // takes the successor's socket and device with it: not the agent's business).
    gw.node.ip(&["link", "del", &renamed]);
    let released = wait_for(Duration::from_secs(5), || {
        agent.log_text().contains("released its link")
    });
    assert!(released.is_some(), "log:\n{}", agent.log_text());
    drop(successor);
}

/// `wgfence detach` immediately followed by a new agent (a rollout): the detach renames the
/// pin directory to its marker and the new agent creates and locks a new pin directory before
/// the running agent's next check. The running agent finds the directory it locked under the
/// detach marker and lets go (links and lock), whatever now exists at the pin path: it never
/// keeps its links beside the new agent's. (Done here by hand, in the order the race has: the
/// rename, then a new directory locked by someone else, within microseconds.)
#[test]
fn an_agent_lets_go_for_a_detach_even_if_a_new_agent_took_the_pin_path() {
    use std::os::fd::AsRawFd as _;

    let gw = Gateway::new(1);
    let s = state(vec![gw.peer_json(0, Some(web_only()))]);
    let agent = Agent::start(&gw, Layout::Plain, &s, &[]);
    agent.wait_ready(&gw);
    let (link, _) = Dataplane::ingress_link_info(&gw.bpffs, gw.interface())
        .ok()
        .flatten()
        .expect("no pinned link");
    let dir = pin_dir(&gw.bpffs, gw.interface());
    let marker = dir.with_file_name(format!(
        "detaching-{}-{:010}",
        gw.interface(),
        std::process::id()
    ));
    fs::rename(&dir, &marker).unwrap();
    fs::create_dir(&dir).unwrap();
    let newcomer = fs::File::open(&dir).unwrap();
    // SAFETY: flock on a descriptor this test holds.
    let locked = unsafe { libc::flock(newcomer.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    assert_eq!(locked, 0, "{}", std::io::Error::last_os_error());

    // The agent lets go of its lock on the marker (after its links): what `detach` waits for.
    let let_go = wait_for(Duration::from_secs(3), || {
        fs::File::open(&marker).is_ok_and(|f| {
            // SAFETY: flock on a descriptor this closure holds; closing it releases the lock.
            unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
        })
    });
    let log = agent.log_text();
    drop(newcomer);
    let _ = fs::remove_dir(&dir);
    // What `wgfence detach` does once the agent let go: the pins go, and with them the links.
    for name in all_pins(&marker) {
        let _ = fs::remove_file(name);
    }
    let _ = fs::remove_dir(&marker);
    assert!(
        let_go.is_some(),
        "the agent kept its links and lock beside the new pin directory; log:\n{log}"
    );
    let link_show = Command::new("bpftool")
        .args(["link", "show", "id", &link.to_string()])
        .output()
        .expect("bpftool");
    assert!(
        !link_show.status.success(),
        "link {link} still exists once its pins are gone: the agent holds it"
    );
    agent.wait_readyz(&gw, 503);
    let (_, body) = agent.get(&gw, "/readyz").expect("GET /readyz");
    assert!(body.contains("detached"), "{body}");
}
