//! `wgfence run --source kubernetes`: the state from one Secret, watched through a real
//! kube-apiserver (v1.20.2, with etcd, in the gateway's node namespace: [`wgfence_tests::kube`]),
//! the agent authenticated as the DaemonSet's service account and authorized by a Role on that
//! one Secret. Real WireGuard traffic decides every verdict.

use std::{
    process::Stdio,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use serde_json::json;
use wgfence_tests::{
    agent::Agent,
    ip,
    kube::{ApiServer, User},
    net::{wait_for, Netns},
    probe::{probe, Kind, Reach},
    state,
    topology::Gateway,
};

const NS: &str = "wgfence";
const SECRET: &str = "state";

/// Only ICMP to 10.1.2.3.
fn icmp_only() -> serde_json::Value {
    json!([{ "cidr": "10.1.2.3/32", "protocol": "icmp" }])
}

/// The API server in the gateway's node namespace, with the agent's Role on Secret
/// `wgfence/state`, created with `initial`.
fn api_with_secret(gw: &Gateway, initial: &str) -> (ApiServer, String) {
    let api = ApiServer::start(&gw.node);
    api.create_namespace(NS);
    api.grant_agent(NS, SECRET);
    let rv = api.create_secret(NS, SECRET, initial);
    (api, rv)
}

/// An API server holding `state` in the Secret, and an agent that has applied it (that
/// resourceVersion).
fn enforcing(gw: &Gateway, state: &str) -> (ApiServer, Agent, String) {
    let (api, rv) = api_with_secret(gw, state);
    let agent = start_agent(gw, &api);
    wait_applied(&agent, gw, &rv, Duration::from_secs(20));
    (api, agent, rv)
}

fn start_agent(gw: &Gateway, api: &ApiServer) -> Agent {
    Agent::start_kubernetes(
        gw,
        &api.kubeconfig(User::Agent),
        &format!("{NS}/{SECRET}"),
        &[],
    )
}

/// `/readyz`: (status, body); (0, "") while the agent does not answer (starting).
fn readyz(agent: &Agent, gw: &Gateway) -> (u16, String) {
    agent.get(gw, "/readyz").unwrap_or_default()
}

/// Waits until `/readyz` answers 200 naming resourceVersion `rv` of the Secret.
fn wait_applied(agent: &Agent, gw: &Gateway, rv: &str, timeout: Duration) -> Duration {
    let want = format!("ready: secret {NS}/{SECRET} key state.json resourceVersion {rv}");
    wait_for(timeout, || readyz(agent, gw).1.trim() == want).unwrap_or_else(|| {
        panic!(
            "resourceVersion {rv} was not applied within {timeout:?}: /readyz {:?}; log:\n{}",
            readyz(agent, gw),
            agent.log_text()
        )
    })
}

fn unix(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

/// Peer `i` pings the node every 2 ms for 1.5 s while `act` runs (it returns the instant of
/// the API write's response); the time from that response to the last echo answered, or
/// `None` if no echo was answered after it.
fn last_echo_after(gw: &Gateway, i: usize, act: impl FnOnce() -> SystemTime) -> Option<Duration> {
    let ping = gw.peers[i]
        .ns
        .command("ping")
        .args(["-D", "-i", "0.002", "-W", "1", "-c", "750", "10.8.0.1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("ping");
    std::thread::sleep(Duration::from_millis(150));
    let t0 = unix(act());
    let out = ping.wait_with_output().expect("ping");
    let text = String::from_utf8_lossy(&out.stdout);
    let answered: Vec<f64> = text
        .lines()
        .filter(|l| l.contains("bytes from"))
        .filter_map(|l| l.strip_prefix('[')?.split(']').next()?.parse::<f64>().ok())
        .collect();
    assert!(
        answered.iter().any(|t| *t < t0),
        "the peer's pings did not pass before the write:\n{text}"
    );
    let last = answered.iter().copied().fold(f64::MIN, f64::max);
    (last >= t0).then(|| Duration::from_secs_f64(last - t0))
}

/// A patch of the Secret that removes a peer stops that peer's real WireGuard traffic within
/// a second of the API write's response (from the response to its last echo through), the
/// other peer's traffic is untouched, and /readyz names the resourceVersion applied.
#[test]
fn a_secret_patch_that_removes_a_peer_stops_its_traffic_within_a_second() {
    let gw = Gateway::new(2);
    let both = state(vec![gw.peer_json(0, None), gw.peer_json(1, None)]);
    let (api, agent, _) = enforcing(&gw, &both);
    assert_eq!(
        probe(&gw.peers[1].ns, Kind::Ping, ip("10.1.2.3")),
        Reach::Reached
    );

    let only_first = state(vec![gw.peer_json(0, None)]);
    let mut new_rv = String::new();
    let mut request = Duration::ZERO;
    let latency = last_echo_after(&gw, 1, || {
        let sent = SystemTime::now();
        let (at, rv) = api.patch_secret(NS, SECRET, &only_first);
        request = at.duration_since(sent).unwrap_or_default();
        new_rv = rv;
        at
    });
    // `None`: no echo was answered after the response (the pings are 2 ms apart).
    eprintln!(
        "API write's response to the revoked peer's last echo: {latency:?} (the request took \
         {request:?})"
    );
    assert!(
        latency.is_none_or(|l| l <= Duration::from_secs(1)),
        "the revoked peer's traffic passed {latency:?} after the API write; log:\n{}",
        agent.log_text()
    );
    wait_applied(&agent, &gw, &new_rv, Duration::from_secs(1));
    assert_eq!(
        probe(&gw.peers[1].ns, Kind::Ping, ip("10.1.2.3")),
        Reach::Blocked
    );
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Ping, ip("10.1.2.3")),
        Reach::Reached
    );
    assert_eq!(agent.metric(&gw, "wgfence_peers"), 1.0);
}

/// A Secret whose state is invalid is rejected whole: the last good state stays enforced and
/// /readyz names the rejected version. A Secret without the key is rejected too. A valid
/// state afterwards applies.
#[test]
fn an_invalid_secret_is_rejected_whole_and_the_last_good_state_stays() {
    let gw = Gateway::new(2);
    let good = state(vec![
        gw.peer_json(0, Some(icmp_only())),
        gw.peer_json(1, None),
    ]);
    let (api, agent, _) = enforcing(&gw, &good);

    // Peer 1 removed and peer 0 opened up, with one invalid rule: nothing of it may apply.
    let mut bad = json!({ "version": 1, "peers": [gw.peer_json(0, None)] });
    bad["peers"][0]["egress"] = json!([{ "cidr": "10.1.2.3/8", "protocol": "tcp" }]);
    let (_, bad_rv) = api.patch_secret(NS, SECRET, &bad.to_string());
    agent.wait_rejected(&gw, "host bits set");
    let (status, body) = readyz(&agent, &gw);
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("rejected") && body.contains(&format!("resourceVersion {bad_rv}")),
        "/readyz does not name the rejected version: {body}"
    );
    // The last good state: peer 0 ICMP only, peer 1 unrestricted.
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Ping, ip("10.1.2.3")),
        Reach::Reached
    );
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Tcp(443), ip("10.1.2.3")),
        Reach::Blocked
    );
    assert_eq!(
        probe(&gw.peers[1].ns, Kind::Tcp(443), ip("10.2.3.4")),
        Reach::Reached
    );

    // The key removed: rejected as well, named.
    api.patch_secret_data(NS, SECRET, json!({ "state.json": null, "other": "e30=" }));
    assert!(
        wait_for(Duration::from_secs(5), || readyz(&agent, &gw)
            .1
            .contains("has no key \"state.json\""))
        .is_some(),
        "/readyz does not say the key is missing: {:?}",
        readyz(&agent, &gw)
    );
    assert_eq!(
        probe(&gw.peers[1].ns, Kind::Tcp(443), ip("10.2.3.4")),
        Reach::Reached
    );
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Tcp(443), ip("10.1.2.3")),
        Reach::Blocked
    );

    // Fixed: applies.
    let fixed = state(vec![gw.peer_json(0, Some(icmp_only()))]);
    let (_, rv) = api.patch_secret(NS, SECRET, &fixed);
    wait_applied(&agent, &gw, &rv, Duration::from_secs(1));
    assert_eq!(
        probe(&gw.peers[1].ns, Kind::Ping, ip("10.1.2.3")),
        Reach::Blocked
    );
}

/// The Secret deleted from the API: the last good state stays enforced (neither everything
/// allowed nor everything dropped), /readyz says `source_object_missing` and so does the
/// metric; the Secret created again applies.
#[test]
fn a_deleted_secret_keeps_the_last_good_state_and_says_so() {
    let gw = Gateway::new(2);
    let good = state(vec![
        gw.peer_json(0, Some(icmp_only())),
        gw.peer_json(1, None),
    ]);
    let (api, agent, _) = enforcing(&gw, &good);
    assert_eq!(agent.metric(&gw, "wgfence_source_object_missing"), 0.0);

    api.delete_secret(NS, SECRET);
    agent.wait_readyz_for(&gw, 503, Duration::from_secs(2));
    let (_, body) = readyz(&agent, &gw);
    assert!(
        body.contains("source_object_missing") && body.contains(&format!("{NS}/{SECRET}")),
        "{body}"
    );
    assert_eq!(agent.metric(&gw, "wgfence_source_object_missing"), 1.0);
    assert_eq!(agent.metric(&gw, "wgfence_peers"), 2.0);
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Ping, ip("10.1.2.3")),
        Reach::Reached
    );
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Tcp(443), ip("10.1.2.3")),
        Reach::Blocked
    );
    assert_eq!(
        probe(&gw.peers[1].ns, Kind::Tcp(443), ip("10.2.3.4")),
        Reach::Reached
    );

    // Back, without peer 1.
    let rv = api.create_secret(NS, SECRET, &state(vec![gw.peer_json(0, Some(icmp_only()))]));
    wait_applied(&agent, &gw, &rv, Duration::from_secs(1));
    assert_eq!(agent.metric(&gw, "wgfence_source_object_missing"), 0.0);
    assert_eq!(
        probe(&gw.peers[1].ns, Kind::Tcp(443), ip("10.2.3.4")),
        Reach::Blocked
    );
}

/// The API server killed and started again (same etcd) while the agent runs: enforcement never
/// stops, and a change written once the server is ready applies within a second.
#[test]
fn an_api_server_restart_loses_no_enforcement_and_the_next_change_applies_within_a_second() {
    let gw = Gateway::new(2);
    let good = state(vec![
        gw.peer_json(0, Some(icmp_only())),
        gw.peer_json(1, None),
    ]);
    let (mut api, agent, _) = enforcing(&gw, &good);
    let errors = agent.metric(&gw, "wgfence_source_errors_total");

    api.kill_apiserver();
    std::thread::sleep(Duration::from_millis(1500));
    // Enforcing while the API server is down, and still ready: the applied state is current
    // as far as anyone can know.
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Ping, ip("10.1.2.3")),
        Reach::Reached
    );
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Tcp(443), ip("10.1.2.3")),
        Reach::Blocked
    );
    assert_eq!(
        probe(&gw.peers[1].ns, Kind::Tcp(443), ip("10.2.3.4")),
        Reach::Reached
    );
    assert!(agent.metric(&gw, "wgfence_source_errors_total") > errors);

    api.start_apiserver();
    let revoked = state(vec![gw.peer_json(0, Some(icmp_only()))]);
    let (at, rv) = api.patch_secret(NS, SECRET, &revoked);
    let applied = wait_applied(&agent, &gw, &rv, Duration::from_secs(5));
    let since_write = SystemTime::now().duration_since(at).unwrap_or_default();
    eprintln!(
        "after the restart: applied within {since_write:?} of the write's response (polled \
         every 10 ms; {applied:?} of waiting)"
    );
    assert!(
        since_write <= Duration::from_secs(1),
        "the change applied {since_write:?} after the write; log:\n{}",
        agent.log_text()
    );
    // How the watch came back (a resumed watch, or a 410 Gone and a new list).
    for line in agent
        .log_text()
        .lines()
        .filter(|l| l.contains("watching the Secret"))
    {
        eprintln!("{line}");
    }
    assert_eq!(
        probe(&gw.peers[1].ns, Kind::Tcp(443), ip("10.2.3.4")),
        Reach::Blocked
    );
}

/// A watch resumed from a version the restarted API server no longer serves (writes to other
/// objects moved the store on while the agent saw none of them) ends in `410 Gone`: the agent
/// lists again and converges on the current version, with no gap in enforcement.
#[test]
fn a_410_gone_lists_again_and_converges() {
    let gw = Gateway::new(2);
    let good = state(vec![
        gw.peer_json(0, Some(icmp_only())),
        gw.peer_json(1, None),
    ]);
    let (mut api, agent, _) = enforcing(&gw, &good);
    // Writes the agent's watch (one object, by name) never sees.
    for i in 0..5 {
        api.create_secret(NS, &format!("unrelated-{i}"), "{}");
    }
    api.kill_apiserver();
    api.start_apiserver();
    let (_, rv) = api.patch_secret(NS, SECRET, &state(vec![gw.peer_json(0, Some(icmp_only()))]));
    wait_applied(&agent, &gw, &rv, Duration::from_secs(5));
    assert_eq!(
        probe(&gw.peers[1].ns, Kind::Tcp(443), ip("10.2.3.4")),
        Reach::Blocked
    );
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Ping, ip("10.1.2.3")),
        Reach::Reached
    );
    let log = agent.log_text();
    let gone: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("watching the Secret") && l.contains("too old resource version"))
        .collect();
    assert!(
        !gone.is_empty(),
        "no 410 Gone (`too old resource version`) in the agent's log (the test did not \
         provoke one):\n{log}"
    );
    eprintln!("{}", gone[0]);
}

/// The agent's path to the API server cut (packets dropped silently) while two changes are
/// written: the agent keeps enforcing what it has (it cannot know), and once the path is back
/// it converges on the last of them, never applying the first on top of it.
#[test]
fn a_network_cut_converges_on_the_last_write_without_a_gap() {
    let gw = Gateway::new(3);
    let all = state(vec![
        gw.peer_json(0, Some(icmp_only())),
        gw.peer_json(1, None),
        gw.peer_json(2, None),
    ]);
    let (api, agent, _) = enforcing(&gw, &all);

    api.cut_agent(true);
    let cut = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        api.patch_secret(
            NS,
            SECRET,
            &state(vec![
                gw.peer_json(0, Some(icmp_only())),
                gw.peer_json(2, None),
            ]),
        );
        let (_, last) = api.patch_secret(
            NS,
            SECRET,
            &state(vec![
                gw.peer_json(0, Some(icmp_only())),
                gw.peer_json(1, None),
            ]),
        );
        std::thread::sleep(Duration::from_secs(2));
        // Nothing reached the agent: the last state it had is enforced, and it still says so.
        assert_eq!(agent.metric(&gw, "wgfence_peers"), 3.0);
        assert_eq!(
            probe(&gw.peers[2].ns, Kind::Tcp(443), ip("10.2.3.4")),
            Reach::Reached
        );
        assert_eq!(
            probe(&gw.peers[0].ns, Kind::Tcp(443), ip("10.1.2.3")),
            Reach::Blocked
        );
        last
    }));
    api.cut_agent(false);
    let last = cut.unwrap_or_else(|e| std::panic::resume_unwind(e));
    let took = wait_applied(&agent, &gw, &last, Duration::from_secs(45));
    eprintln!("the path restored: the last write applied {took:?} later");
    assert_eq!(agent.metric(&gw, "wgfence_peers"), 2.0);
    assert_eq!(
        probe(&gw.peers[2].ns, Kind::Tcp(443), ip("10.2.3.4")),
        Reach::Blocked
    );
    assert_eq!(
        probe(&gw.peers[1].ns, Kind::Tcp(443), ip("10.2.3.4")),
        Reach::Reached
    );
    // The intermediate version (peer 2 kept, peer 1 revoked) was never applied after the last.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        probe(&gw.peers[1].ns, Kind::Tcp(443), ip("10.2.3.4")),
        Reach::Reached
    );
    for line in agent
        .log_text()
        .lines()
        .filter(|l| l.contains("watching the Secret"))
    {
        eprintln!("{line}");
    }
}

/// The agent restarted while the API server is unreachable: the pinned datapath keeps
/// enforcing the last applied state, nothing is pruned or written before the first complete
/// list, /readyz says why; once the API server is back the agent converges.
#[test]
fn an_agent_restarted_while_the_api_is_down_keeps_enforcing_what_is_pinned() {
    let gw = Gateway::new(2);
    let good = state(vec![
        gw.peer_json(0, Some(icmp_only())),
        gw.peer_json(1, None),
    ]);
    let (mut api, mut agent, rv) = enforcing(&gw, &good);
    agent.stop();
    api.kill_apiserver();

    agent.restart(&gw, &[]);
    // Serving, not ready, naming the Secret and why.
    assert!(
        wait_for(Duration::from_secs(10), || agent
            .get(&gw, "/readyz")
            .is_some_and(|(s, b)| s == 503 && b.contains("no complete list")))
        .is_some(),
        "/readyz: {:?}; log:\n{}",
        agent.get(&gw, "/readyz"),
        agent.log_text()
    );
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(agent.metric(&gw, "wgfence_bpf_map_writes_total"), 0.0);
    assert_eq!(
        agent.metric(&gw, "wgfence_wireguard_peer_updates_total"),
        0.0
    );
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Ping, ip("10.1.2.3")),
        Reach::Reached
    );
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Tcp(443), ip("10.1.2.3")),
        Reach::Blocked
    );
    assert_eq!(
        probe(&gw.peers[1].ns, Kind::Tcp(443), ip("10.2.3.4")),
        Reach::Reached
    );
    assert_eq!(gw.wg_peers().len(), 2);

    api.start_apiserver();
    wait_applied(&agent, &gw, &rv, Duration::from_secs(2));
    assert_eq!(
        probe(&gw.peers[1].ns, Kind::Tcp(443), ip("10.2.3.4")),
        Reach::Reached
    );
}

/// The agent's token, bound by the deploy overlay's own Role and RoleBinding (applied with
/// kubectl), reads its one Secret and nothing else: not another Secret of its namespace, not
/// a list of them, not a Secret of another namespace.
#[test]
fn the_agents_token_cannot_read_any_other_secret() {
    wgfence_tests::require_root();
    let node = Netns::new("wgft-kube-");
    let api = ApiServer::start(&node);
    api.apply_kustomization("deploy/overlays/kubernetes-api");
    let secret = "wgfence-state";
    api.create_secret(NS, secret, "{}");
    assert_eq!(api.agent_get_secret(NS, secret), 200);
    assert_eq!(api.agent_list_secret(NS, secret), 200);
    api.create_secret(NS, SECRET, "{}");
    api.create_secret(NS, "other", "{}");
    api.create_secret("default", SECRET, "{}");
    assert_eq!(api.agent_get_secret(NS, SECRET), 403);
    assert_eq!(api.agent_get_secret(NS, "other"), 403);
    assert_eq!(api.agent_get_secret("default", SECRET), 403);
    assert_eq!(api.agent_get_secret("kube-system", "any"), 403);
    assert_eq!(api.agent_list_secrets(NS), 403);
    assert_eq!(api.agent_list_secrets("default"), 403);
    assert_eq!(api.agent_list_secret(NS, "other"), 403);
    drop(api);
}
