//! The legacy TC hook (a clsact qdisc with direct-action cls_bpf filters), forced with
//! `--attach tc` on this kernel, which has tcx too: what kernels before 6.6 get. The promises
//! are those of tcx: enforcement (replies included), a restart under traffic that loses no
//! packet and passes no denied one, foreign filters left alone at start, restart and detach,
//! a detach that leaves exactly what was there before, the repairs, and `status` naming the
//! hook.

use std::{
    io::{BufRead as _, BufReader},
    process::{Child, Stdio},
    sync::{Arc, Mutex},
    thread,
    time::Duration,
};

use serde_json::{json, Value};
use wgfence::dataplane::{tc, AttachOptions, Attachment, Dataplane, HookKind, HookMode};
use wgfence_common::UNRESTRICTED;
use wgfence_tests::{
    agent::{binary, Agent, Layout},
    net::wait_for,
    probe::{check_all, Expect, Kind, Reach},
    state,
    topology::Gateway,
};

const TC: &[&str] = &["--attach", "tc"];

/// `tc` in the node's namespace; its standard output.
fn tc_out(gw: &Gateway, args: &[&str]) -> String {
    let out = gw.node.exec(&[&["tc"], args].concat());
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The node interface's qdiscs and both filter chains, as `tc` shows them: what "exactly what
/// was there" is compared on. Program ids change with every load; the names stay.
fn tc_snapshot(gw: &Gateway) -> String {
    let dev = gw.interface();
    let mut text = tc_out(gw, &["qdisc", "show", "dev", dev]);
    for dir in ["ingress", "egress"] {
        text += &format!("-- {dir}\n");
        text += &tc_out(gw, &["filter", "show", "dev", dev, dir]);
    }
    text.lines()
        .map(|l| {
            l.split_whitespace()
                .filter(|w| !w.starts_with("id") && !w.starts_with("tag"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A classic BPF program that matches every packet, without actions: the packet goes on.
/// (This kernel has no cls_matchall; cls_bpf is what every kernel wgfence runs on has.)
const PASS_ALL: &str = "1,6 0 0 4294967295";

/// `tc filter ACTION dev IF SPEC... [LAST]` in the node's namespace (LAST: one argument with
/// spaces).
fn tc_filter(gw: &Gateway, action: &str, spec: &str, last: Option<&str>) {
    let mut args = vec!["tc", "filter", action, "dev", gw.interface()];
    args.extend(spec.split_whitespace());
    args.extend(last);
    gw.node.exec(&args);
}

/// A foreign filter on both hooks, passing everything, at priority 100.
fn add_foreign_filters(gw: &Gateway) {
    gw.node
        .exec(&["tc", "qdisc", "add", "dev", gw.interface(), "clsact"]);
    for dir in ["ingress", "egress"] {
        let spec = format!("{dir} prio 100 handle 0x5 bpf bytecode");
        tc_filter(gw, "add", &spec, Some(PASS_ALL));
    }
}

#[track_caller]
fn assert_foreign_filters(gw: &Gateway, when: &str) {
    for dir in ["ingress", "egress"] {
        let shown = tc_out(gw, &["filter", "show", "dev", gw.interface(), dir]);
        assert!(
            shown.contains("pref 100 bpf") && shown.contains("handle 0x5"),
            "{when}: the foreign {dir} filter is gone:\n{shown}"
        );
    }
}

/// The agent's filters: first in both chains (priority 1), handle 0x77670001, direct-action,
/// running the datapath's programs.
#[track_caller]
fn assert_our_filters_first(gw: &Gateway, when: &str) {
    for (dir, program) in [("ingress", "wgfence_ingress"), ("egress", "wgfence_egress")] {
        let shown = tc_out(gw, &["filter", "show", "dev", gw.interface(), dir]);
        let first = shown
            .lines()
            .find(|l| l.contains("handle"))
            .unwrap_or_default();
        assert!(
            first.contains("pref 1 bpf")
                && first.contains("handle 0x77670001")
                && first.contains(program)
                && first.contains("direct-action"),
            "{when}: {dir} does not start with wgfence's filter:\n{shown}"
        );
    }
}

/// Waits until the agent's ingress filter is (back) in place, then checks both.
#[track_caller]
fn wait_our_filters(gw: &Gateway, agent: &Agent, timeout: Duration, when: &str) {
    let dev = gw.interface();
    assert!(
        wait_for(timeout, || tc_out(
            gw,
            &["filter", "show", "dev", dev, "ingress"]
        )
        .contains("handle 0x77670001"))
        .is_some(),
        "{when}: no filter of wgfence's came back:\n{}",
        agent.log_text()
    );
    assert_our_filters_first(gw, when);
}

fn icmp_to_node() -> Value {
    json!([{ "cidr": "10.8.0.1/32", "protocol": "icmp" }])
}

/// `ping -i 0.01` from peer 0 to `dst`, in the background.
fn ping_stream(gw: &Gateway, dst: &str, count: u32) -> Child {
    gw.peers[0]
        .ns
        .command("ping")
        .args(["-i", "0.01", "-W", "1", "-c", &count.to_string(), dst])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("ping")
}

/// (transmitted, received) of a finished ping.
fn finish(ping: Child) -> (u32, u32) {
    let out = ping.wait_with_output().expect("ping");
    let text = String::from_utf8_lossy(&out.stdout);
    let summary = text
        .lines()
        .find(|l| l.contains("packets transmitted"))
        .unwrap_or_else(|| panic!("no ping summary:\n{text}"));
    let n: Vec<u32> = summary
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .collect();
    (
        n.first().copied().unwrap_or(0),
        n.get(1).copied().unwrap_or(0),
    )
}

/// `tc monitor` in the node's namespace: every filter and qdisc change, as it happens.
struct TcMonitor {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl TcMonitor {
    fn start(gw: &Gateway) -> Self {
        let mut child = gw
            .node
            .command("tc")
            .arg("monitor")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("tc monitor");
        let lines = Arc::new(Mutex::new(Vec::new()));
        if let Some(out) = child.stdout.take() {
            let lines = Arc::clone(&lines);
            thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    if let Ok(mut l) = lines.lock() {
                        l.push(line);
                    }
                }
            });
        }
        // Subscribed before anything happens.
        thread::sleep(Duration::from_millis(300));
        Self { child, lines }
    }

    fn stop(mut self) -> Vec<String> {
        thread::sleep(Duration::from_millis(300));
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.lines.lock().map(|l| l.clone()).unwrap_or_default()
    }
}

fn detach(gw: &Gateway) {
    let out = gw
        .node
        .command(binary())
        .args(["detach", "--interface", gw.interface()])
        .output()
        .expect("wgfence detach");
    assert!(
        out.status.success(),
        "detach failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn status_json(gw: &Gateway) -> Value {
    let out = gw
        .node
        .command(binary())
        .args(["status", "--json", "--interface", gw.interface()])
        .output()
        .expect("wgfence status");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("status --json")
}

#[test]
fn on_the_tc_hook_the_datapath_enforces_like_on_tcx() {
    // Peer 0: restricted. Peer 1: unrestricted. Peer 2: known to WireGuard, not to the maps.
    let gw = Gateway::new(3);
    let options = AttachOptions::new(gw.interface())
        .bpffs(&gw.bpffs)
        .hook(HookMode::Tc);
    let mut dp = gw
        .node
        .enter(|| Dataplane::attach(&options))
        .unwrap_or_else(|e| panic!("{}", wgfence::error_chain(&e)));
    assert_eq!(dp.hook(), HookKind::Tc);
    assert_eq!(dp.ingress_attachment(), Attachment::Created);
    assert_our_filters_first(&gw, "attached");
    // Nothing on the tcx hook: the tc filters do the work.
    assert_eq!(
        Dataplane::ingress_link_info(&gw.bpffs, gw.interface()).unwrap(),
        None
    );
    assert!(gw.node.enter(|| dp.programs_attached()).unwrap_or(false));
    let maps = dp.maps_mut();
    for addr in gw.peers[1].addrs() {
        maps.upsert_peer(
            addr,
            wgfence_common::PeerEntry {
                policy: UNRESTRICTED,
                slot: 1,
                owner: 2,
                ..wgfence_common::PeerEntry::default()
            },
        )
        .unwrap();
    }
    drop(dp);
    let (o, u) = (&gw.peers[1].ns, &gw.peers[2].ns);
    let case = Expect::new;
    use Kind::{Ping, Tcp};
    use Reach::{Blocked, Reached};
    check_all(&[
        case("unknown", u, Tcp(443), "10.1.2.3", Blocked),
        case("unknown", u, Ping, "192.0.2.1", Blocked),
        case("unknown", u, Tcp(22), "fd00:1::1", Blocked),
        case("open", o, Tcp(80), "10.2.3.4", Reached),
        case("open", o, Ping, "fd00:1::1", Reached),
    ]);
    // The dataplane dropped: the filters stay (like pinned links).
    assert_our_filters_first(&gw, "after the loader exited");

    // The agent on the same filters: restricted peer, replies through the egress filter,
    // status naming the hook.
    let s = state(vec![
        gw.peer_json(
            0,
            Some(json!([
                { "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443] },
                { "cidr": "192.0.2.0/24", "protocol": "icmp" },
            ])),
        ),
        gw.peer_json(1, None),
    ]);
    let agent = Agent::start(&gw, Layout::Plain, &s, TC);
    agent.wait_ready(&gw);
    let (r, node) = (&gw.peers[0].ns, &gw.node);
    check_all(&[
        case("restricted", r, Tcp(443), "10.2.3.4", Reached),
        case("restricted", r, Tcp(80), "10.2.3.4", Blocked),
        case("restricted", r, Ping, "192.0.2.1", Reached),
        case("restricted", r, Ping, "10.2.3.4", Blocked),
        case("restricted", r, Tcp(443), "fd00:1::1", Blocked),
        case("open", o, Tcp(80), "10.2.3.4", Reached),
        case("unknown", u, Tcp(443), "10.1.2.3", Blocked),
        // Network-started flows toward the restricted peer: its replies pass.
        case("node", node, Tcp(22), "10.8.0.2", Reached),
        case("node", node, Ping, "fd00:8::2", Reached),
    ]);
    assert!(agent.log_text().contains("hook=tc"), "{}", agent.log_text());

    let status = status_json(&gw);
    assert_eq!(status["hook"], "tc", "{status}");
    assert_eq!(status["tcPriority"], 1, "{status}");
    assert_eq!(status["tcHandle"], "0x77670001", "{status}");
    assert_eq!(status["attached"], true, "{status}");
    assert!(status["programId"].as_u64().is_some(), "{status}");
    assert!(status["egressProgramId"].as_u64().is_some(), "{status}");
    let text = gw
        .node
        .command(binary())
        .args(["status", "--interface", gw.interface()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains(
            "hook             tc (clsact, direct-action filters at priority 1, handle 0x77670001)"
        ),
        "{text}"
    );
}

#[test]
fn a_restart_on_the_tc_hook_loses_nothing_and_leaves_foreign_filters() {
    let gw = Gateway::new(1);
    add_foreign_filters(&gw);
    let before = tc_snapshot(&gw);
    let s = state(vec![gw.peer_json(0, Some(icmp_to_node()))]);
    let mut agent = Agent::start(&gw, Layout::Plain, &s, TC);
    agent.wait_ready(&gw);
    assert_foreign_filters(&gw, "after start");
    assert_our_filters_first(&gw, "after start");

    // Allowed and denied pings every 10 ms across SIGKILL and restart, with every filter
    // change the kernel makes recorded.
    let monitor = TcMonitor::start(&gw);
    let allowed = ping_stream(&gw, "10.8.0.1", 400);
    let denied = ping_stream(&gw, "10.2.3.4", 400);
    thread::sleep(Duration::from_millis(1000));
    agent.kill();
    thread::sleep(Duration::from_millis(500));
    agent.restart(&gw, TC);
    agent.wait_ready(&gw);
    let (sent, received) = finish(allowed);
    let (denied_sent, denied_received) = finish(denied);
    let changes = monitor.stop();
    assert_eq!(
        received, sent,
        "packets were lost across SIGKILL and restart"
    );
    assert_eq!(
        denied_received, 0,
        "{denied_received} of {denied_sent} denied packets passed across the restart"
    );
    assert!(
        agent.log_text().contains("attachment=Replaced"),
        "the restarted agent did not take over its filters:\n{}",
        agent.log_text()
    );
    // The program was swapped in place: no filter was deleted at any moment, so there was no
    // instant without enforcement.
    let deleted: Vec<&String> = changes
        .iter()
        .filter(|l| l.starts_with("deleted"))
        .collect();
    assert!(
        deleted.is_empty(),
        "the restart deleted filters (a gap without enforcement): {deleted:?}\n{changes:?}"
    );
    assert!(
        changes.iter().any(|l| l.contains("handle 0x77670001")),
        "the restart did not replace the program of its filter: {changes:?}"
    );
    assert_foreign_filters(&gw, "after restart");
    assert_our_filters_first(&gw, "after restart");

    // Detach (while the agent runs): exactly what was there before.
    detach(&gw);
    assert!(agent.stop().is_some());
    assert_foreign_filters(&gw, "after detach");
    assert_eq!(
        tc_snapshot(&gw),
        before,
        "detach did not leave exactly what was there"
    );
}

#[test]
fn detach_on_the_tc_hook_removes_exactly_what_the_agent_added() {
    let gw = Gateway::new(1);
    // No qdisc before: the agent adds clsact, and detach removes it again.
    let before = tc_snapshot(&gw);
    assert!(!before.contains("clsact"), "{before}");
    let s = state(vec![gw.peer_json(0, Some(icmp_to_node()))]);
    let mut agent = Agent::start(&gw, Layout::Plain, &s, TC);
    agent.wait_ready(&gw);
    assert_our_filters_first(&gw, "after start");
    assert!(agent.stop().is_some());
    // Stopped: still enforcing, the filters stay.
    assert_our_filters_first(&gw, "after the agent stopped");
    detach(&gw);
    assert_eq!(tc_snapshot(&gw), before, "detach left something behind");

    // A clsact qdisc the administrator added, empty: it stays after detach.
    gw.node
        .exec(&["tc", "qdisc", "add", "dev", gw.interface(), "clsact"]);
    let before = tc_snapshot(&gw);
    agent.restart(&gw, TC);
    agent.wait_ready(&gw);
    assert_our_filters_first(&gw, "on the administrator's qdisc");
    detach(&gw);
    assert!(agent.stop().is_some());
    assert_eq!(
        tc_snapshot(&gw),
        before,
        "detach removed the administrator's qdisc"
    );

    // A foreign filter at the agent's own place: the agent refuses and changes nothing.
    tc_filter(
        &gw,
        "add",
        "ingress prio 1 handle 0x77670001 bpf bytecode",
        Some(PASS_ALL),
    );
    let before = tc_snapshot(&gw);
    // Bounded: an agent that wrongly starts would otherwise run on.
    let out = gw
        .node
        .command("timeout")
        .arg("10")
        .arg(binary())
        .args(["run", "--no-metrics", "--attach", "tc", "--interface"])
        .arg(gw.interface())
        .arg("--state")
        .arg(&agent.state)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("holds a filter that is not wgfence's"),
        "{stderr}"
    );
    assert_eq!(
        tc_snapshot(&gw),
        before,
        "a refused start changed the qdisc"
    );
}

#[test]
fn a_recreated_interface_and_removed_pins_are_repaired_on_the_tc_hook() {
    let mut gw = Gateway::new(1);
    let s = state(vec![gw.peer_json(0, Some(icmp_to_node()))]);
    let agent = Agent::start(&gw, Layout::Plain, &s, TC);
    agent.wait_ready(&gw);
    use Kind::{Ping, Tcp};
    use Reach::{Blocked, Reached};

    // The agent's ingress filter deleted by hand: put back within a second or so.
    tc_filter(&gw, "del", "ingress prio 1 handle 0x77670001 bpf", None);
    wait_our_filters(
        &gw,
        &agent,
        Duration::from_secs(5),
        "after the filter was deleted by hand",
    );

    // The pin directory removed by hand: restored, enforcement never stops.
    let dir = wgfence::dataplane::pin_dir(&gw.bpffs, gw.interface());
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        wait_for(Duration::from_secs(5), || dir
            .join(wgfence_common::map_names::PEERS_V4)
            .exists())
        .is_some(),
        "the pins were not restored"
    );
    assert!(
        dir.join(tc::QDISC_MARKER).is_dir(),
        "qdisc mark not restored"
    );
    check_all(&[
        Expect::new("restricted", &gw.peers[0].ns, Ping, "10.8.0.1", Reached),
        Expect::new("restricted", &gw.peers[0].ns, Tcp(22), "10.8.0.1", Blocked),
    ]);

    // The interface deleted and created again: a new qdisc and new filters.
    gw.recreate_interface();
    wait_our_filters(
        &gw,
        &agent,
        Duration::from_secs(10),
        "after the interface was recreated",
    );
    assert!(
        wait_for(Duration::from_secs(10), || gw.wg_peers().len() == 1).is_some(),
        "the peer was not added back"
    );
    gw.new_session(0);
    let r = &gw.peers[0].ns;
    check_all(&[
        Expect::new("restricted", r, Ping, "10.8.0.1", Reached),
        Expect::new("restricted", r, Tcp(22), "10.8.0.1", Blocked),
    ]);

    let mut agent = agent;
    assert!(agent.stop().is_some());

    // A detach from another network namespace cannot reach the filters: it says so (the
    // filters keep enforcing there), rather than claiming the datapath is gone.
    let out = std::process::Command::new(binary())
        .args(["detach", "--interface", gw.interface()])
        .output()
        .expect("wgfence detach");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("its filters still run there"), "{stderr}");
    assert_our_filters_first(&gw, "after a detach from another namespace");
}

#[test]
fn switching_between_tc_and_tcx_hands_over_without_leaving_the_old_hook_behind() {
    let gw = Gateway::new(1);
    add_foreign_filters(&gw);
    let s = state(vec![gw.peer_json(0, Some(icmp_to_node()))]);
    let mut agent = Agent::start(&gw, Layout::Plain, &s, TC);
    agent.wait_ready(&gw);
    assert_our_filters_first(&gw, "on tc");
    let ours = |dir: &str| {
        tc_out(&gw, &["filter", "show", "dev", gw.interface(), dir]).contains("0x77670001")
    };
    let link = || Dataplane::ingress_link_info(&gw.bpffs, gw.interface()).unwrap();
    assert_eq!(link(), None);
    let enforced = |when: &str| {
        let r = &gw.peers[0].ns;
        check_all(&[
            Expect::new(when, r, Kind::Ping, "10.8.0.1", Reach::Reached),
            Expect::new(when, r, Kind::Tcp(22), "10.8.0.1", Reach::Blocked),
        ]);
    };
    enforced("on tc");

    // To tcx: the link is attached, then the agent's filters go; the foreign ones stay.
    agent.kill();
    agent.restart(&gw, &["--attach", "tcx"]);
    agent.wait_ready(&gw);
    assert!(link().is_some(), "no tcx link after --attach tcx");
    assert!(
        !ours("ingress") && !ours("egress"),
        "tc filters left behind"
    );
    assert_foreign_filters(&gw, "after the switch to tcx");
    assert_eq!(status_json(&gw)["hook"], "tcx");
    enforced("on tcx");

    // And back: the filters are added, then the links' pins go (and the links with them).
    agent.kill();
    agent.restart(&gw, TC);
    agent.wait_ready(&gw);
    assert_our_filters_first(&gw, "back on tc");
    assert_eq!(link(), None, "the tcx link pin is left behind");
    assert_foreign_filters(&gw, "back on tc");
    assert_eq!(status_json(&gw)["hook"], "tc");
    enforced("back on tc");
}
