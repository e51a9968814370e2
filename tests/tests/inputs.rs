//! Bad inputs (issue 27): a state path that is not a regular file (a FIFO, a device), a state
//! file larger than `--max-state-bytes`, and an agent restarted onto a changed, symlinked state
//! path while the machine is loaded. None may hang the agent, exhaust its memory or cost it
//! the last good state.

use std::{
    ffi::CString,
    fs,
    os::unix::ffi::OsStrExt as _,
    path::Path,
    process::{Command, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use serde_json::{json, Value};
use wgfence_tests::{
    agent::{binary, Agent, Layout},
    ip,
    net::wait_for,
    probe::{probe, Kind, Reach},
    state,
    topology::Gateway,
    CpuLoad,
};

fn web_only() -> Value {
    json!([
        { "cidr": "10.2.3.4/32", "protocol": "tcp", "ports": [80] },
        { "cidr": "10.8.0.1/32", "protocol": "icmp" },
    ])
}

fn mkfifo(path: &Path) {
    let c = CString::new(path.as_os_str().as_bytes()).expect("path");
    // SAFETY: a valid NUL-terminated path.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o644) };
    assert_eq!(rc, 0, "mkfifo: {}", std::io::Error::last_os_error());
}

/// `wgfence ARGS`: its exit status and stderr, or a panic if it has not exited within ten
/// seconds (it is killed then).
fn wgfence_promptly(args: &[&str]) -> (std::process::ExitStatus, String) {
    let child = Command::new(binary())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("wgfence");
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(10)) {
        Ok(out) => {
            let out = out.expect("wgfence");
            (
                out.status,
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
        Err(_) => {
            // SAFETY: kill(2) on our own child's pid, which has not been reaped.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            panic!("wgfence {args:?} did not return within 10 s");
        }
    }
}

/// `check` on a FIFO without a writer, on /dev/zero and on a file over `--max-state-bytes`:
/// each returns at once, non-zero, saying what the path is (no root needed).
#[test]
fn check_refuses_a_fifo_a_device_and_an_oversized_file_at_once() {
    let dir = std::env::temp_dir().join(wgfence_tests::net::unique("wgfence-inputs-"));
    fs::create_dir_all(&dir).expect("temporary directory");
    let fifo = dir.join("fifo.json");
    mkfifo(&fifo);
    let fifo_arg = fifo.to_string_lossy().into_owned();
    let (status, stderr) = wgfence_promptly(&["check", "--state", &fifo_arg]);
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "{fifo_arg} is a FIFO (named pipe), not a regular file"
        )),
        "{stderr}"
    );

    let (status, stderr) = wgfence_promptly(&["check", "--state", "/dev/zero"]);
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("/dev/zero is a character device, not a regular file"),
        "{stderr}"
    );

    // A valid state, padded past the limit: refused before it is read, never validated.
    let big = dir.join("big.json");
    let mut text = state(vec![]);
    text.push_str(&" ".repeat(2000));
    fs::write(&big, &text).expect("write");
    let big_arg = big.to_string_lossy().into_owned();
    let (status, stderr) =
        wgfence_promptly(&["check", "--state", &big_arg, "--max-state-bytes", "1000"]);
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("more than the limit of 1000 (--max-state-bytes)"),
        "{stderr}"
    );
    let (status, stderr) = wgfence_promptly(&["check", "--state", &big_arg]);
    assert!(status.success(), "within the default limit: {stderr}");
    let _ = fs::remove_dir_all(&dir);
}

/// A running agent whose state file is replaced by one over `--max-state-bytes` (a valid
/// state that would open peer 0 up, padded), then by a FIFO: each is refused without being
/// read, the last good state stays enforced with no map write, `/readyz` says why and the
/// rejection is counted; a good state afterwards applies as usual.
#[test]
fn an_oversized_or_fifo_state_keeps_the_last_good_state() {
    const LIMIT: usize = 64 * 1024;
    let gw = Gateway::new(1);
    let good = state(vec![gw.peer_json(0, Some(web_only()))]);
    let limit = LIMIT.to_string();
    let agent = Agent::start(&gw, Layout::Plain, &good, &["--max-state-bytes", &limit]);
    agent.wait_ready(&gw);
    let enforced = |when: &str| {
        assert_eq!(
            probe(&gw.peers[0].ns, Kind::Tcp(80), ip("10.2.3.4")),
            Reach::Reached,
            "{when}: allowed traffic did not arrive"
        );
        assert_eq!(
            probe(&gw.peers[0].ns, Kind::Tcp(22), ip("10.2.3.4")),
            Reach::Blocked,
            "{when}: denied traffic arrived; log:\n{}",
            agent.log_text()
        );
    };
    enforced("before");
    let writes = agent.metric(&gw, "wgfence_bpf_map_writes_total");
    let rejected = agent.metric(&gw, "wgfence_state_rejected_total");

    let mut open = state(vec![gw.peer_json(0, None)]);
    open.push_str(&" ".repeat(LIMIT));
    agent.write_state(&open);
    agent.wait_readyz_for(&gw, 503, Duration::from_secs(5));
    let (_, body) = agent.get(&gw, "/readyz").expect("GET /readyz");
    assert!(
        body.contains(&format!(
            "more than the limit of {LIMIT} (--max-state-bytes)"
        )),
        "{body}"
    );
    assert!(agent.metric(&gw, "wgfence_state_rejected_total") > rejected);
    enforced("with the oversized state file");
    assert_eq!(agent.metric(&gw, "wgfence_bpf_map_writes_total"), writes);

    // A FIFO renamed over the state file: the agent's loop does not block on it.
    let fifo = agent.dir.join("fifo.tmp");
    mkfifo(&fifo);
    fs::rename(&fifo, &agent.state).expect("rename");
    let named = wait_for(Duration::from_secs(5), || {
        agent
            .get(&gw, "/readyz")
            .is_some_and(|(s, body)| s == 503 && body.contains("FIFO"))
    });
    assert!(
        named.is_some(),
        "/readyz did not name the FIFO; log:\n{}",
        agent.log_text()
    );
    enforced("with a FIFO for a state file");
    assert_eq!(agent.metric(&gw, "wgfence_bpf_map_writes_total"), writes);

    let open = state(vec![gw.peer_json(0, None)]);
    agent.write_state(&open);
    agent.wait_ready(&gw);
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Tcp(22), ip("10.2.3.4")),
        Reach::Reached,
        "the good state after the refused ones was not applied"
    );
}

/// Issue 27 item 2: an agent stopped (SIGTERM) and started again onto another `--state`, a
/// symlink into another directory, on a machine whose CPUs are all busy: the state there
/// (which brings back a peer the old agent had revoked) is enforced, and a change written
/// while the new agent starts is not lost. Several rounds, each landing the change at another
/// moment of the start-up.
#[test]
fn a_restart_onto_a_changed_symlinked_path_under_cpu_load_converges() {
    let gw = Gateway::new(2);
    let restricted = gw.peer_json(0, Some(web_only()));
    let s_both = state(vec![restricted.clone(), gw.peer_json(1, None)]);
    let s_one = state(vec![restricted.clone()]);
    let mut agent = Agent::start(&gw, Layout::Plain, &s_both, &[]);
    agent.wait_ready(&gw);
    assert_eq!(
        probe(&gw.peers[1].ns, Kind::Tcp(22), ip("10.2.3.4")),
        Reach::Reached
    );
    agent.write_state(&s_one);
    let revoked = wait_for(Duration::from_secs(5), || {
        gw.wg_peers() == [gw.peers[0].wg.keys.public.clone()]
    });
    assert!(revoked.is_some(), "log:\n{}", agent.log_text());

    let _load = CpuLoad::start(2);
    assert!(agent.stop().is_some_and(|s| s.success()));
    agent.relink_elsewhere();
    agent.write_state(&s_both);
    let started = Instant::now();
    agent.restart(&gw, &[]);
    let back = wait_for(Duration::from_secs(15), || {
        probe(&gw.peers[1].ns, Kind::Tcp(22), ip("10.2.3.4")) == Reach::Reached
    });
    eprintln!("peer 1 back {:?} after the restart", started.elapsed());
    assert!(
        back.is_some(),
        "the restarted agent did not bring peer 1 back within 15 s; log:\n{}",
        agent.log_text()
    );
    agent.wait_ready(&gw);

    // A change landing while the agent starts: revoke peer 1, then bring it back, each
    // written at another moment of a start-up.
    for (round, delay_ms) in [0u64, 50, 150, 300, 600].into_iter().enumerate() {
        assert!(agent.stop().is_some_and(|s| s.success()));
        let (before, after) = if round % 2 == 0 {
            (&s_both, &s_one)
        } else {
            (&s_one, &s_both)
        };
        agent.write_state(before);
        let started = Instant::now();
        agent.restart(&gw, &[]);
        thread::sleep(Duration::from_millis(delay_ms));
        agent.write_state(after);
        let want: Vec<String> = if round % 2 == 0 {
            vec![gw.peers[0].wg.keys.public.clone()]
        } else {
            let mut keys: Vec<String> = gw.peers.iter().map(|p| p.wg.keys.public.clone()).collect();
            keys.sort();
            keys
        };
        let converged = wait_for(Duration::from_secs(15), || gw.wg_peers() == want);
        eprintln!(
            "round {round}: change written {delay_ms} ms into the start-up; converged after {:?}",
            started.elapsed()
        );
        assert!(
            converged.is_some(),
            "round {round}: the change written {delay_ms} ms into the start-up was not \
             applied within 15 s; log:\n{}",
            agent.log_text()
        );
        agent.wait_ready(&gw);
        if round % 2 == 1 {
            peer_1_back(&gw, &agent, &format!("round {round}"));
        }
    }

    // Not the restart's doing: revoked and brought back by two pushes to a running agent,
    // the peer is back as soon.
    agent.write_state(&s_one);
    let revoked = wait_for(Duration::from_secs(5), || {
        gw.wg_peers() == [gw.peers[0].wg.keys.public.clone()]
    });
    assert!(revoked.is_some(), "log:\n{}", agent.log_text());
    agent.write_state(&s_both);
    peer_1_back(&gw, &agent, "brought back by a push");
}

/// Peer 1's traffic passes again within five seconds: the node sent it a handshake when it
/// created its WireGuard peer, so the session the node forgot at the revocation is replaced
/// at once (the peer itself would start one only after 15 s without an answer).
fn peer_1_back(gw: &Gateway, agent: &Agent, when: &str) {
    let back = wait_for(Duration::from_secs(5), || {
        probe(&gw.peers[1].ns, Kind::Tcp(22), ip("10.2.3.4")) == Reach::Reached
    });
    eprintln!("{when}: peer 1 back after {back:?}");
    assert!(
        back.is_some(),
        "{when}: peer 1 was not back within 5 s; log:\n{}",
        agent.log_text()
    );
}
