//! `wgfence monitor` against the pinned ring buffer of a datapath attached to a veth (Ethernet
//! framed, so every drop reason can be sent, including what WireGuard itself would refuse):
//! each reason produces its event, names resolved from the state file, and a flood produces at
//! most the configured rate. The same harness sends a packet whose IP header is outside the
//! skb's linear data, which only raw frames can.

use std::{
    io::{BufRead as _, BufReader},
    process::{Child, Command, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use serde_json::Value;
use wgfence::{
    dataplane::{AttachOptions, Dataplane},
    policy::{PortRange, Protocol, Rule},
    settings::DatapathSettings,
};
use wgfence_common::{PeerEntry, UNRESTRICTED};
use wgfence_tests::{
    agent::binary,
    install_policy, ip, net as prefix,
    net::{unique, Netns},
    packet::{inject, inject_paged, Ext, Packet, TCP, UDP},
};

const RESTRICTED: &str = "10.8.0.2";
const RESTRICTED_V6: &str = "fd00:8::2";
const OPEN: &str = "10.8.0.3";

/// A namespace with a veth pair; the datapath on `attached`, frames sent from `sender`.
struct Bench {
    dataplane: Dataplane,
    attached: String,
    state: tempfile_path::Path,
    ns: Netns,
}

mod tempfile_path {
    /// A file removed on drop.
    pub struct Path(pub std::path::PathBuf);

    impl Drop for Path {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

const SENDER: &str = "sender0";

impl Bench {
    fn new(events_per_second: u32) -> Self {
        let ns = Netns::new("wgft-mon-");
        // No IPv6 on the links: their neighbour discovery would be dropped packets too.
        for key in ["all", "default"] {
            ns.exec(&[
                "sysctl",
                "-qw",
                &format!("net.ipv6.conf.{key}.disable_ipv6=1"),
            ]);
        }
        let attached = unique("wgv");
        ns.ip(&[
            "link", "add", &attached, "type", "veth", "peer", "name", SENDER,
        ]);
        ns.ip(&["link", "set", &attached, "up"]);
        ns.ip(&["link", "set", SENDER, "up"]);
        let options = AttachOptions::new(attached.clone());
        let mut dataplane = ns
            .enter(|| Dataplane::attach(&options))
            .unwrap_or_else(|e| panic!("{}", wgfence::error_chain(&e)));
        let maps = dataplane.maps_mut();
        install_policy(
            maps,
            1,
            &[Rule::new(
                prefix("10.0.0.0/8"),
                Protocol::Tcp,
                vec![PortRange::single(443)],
            )],
        );
        for (addr, policy, slot) in [
            (RESTRICTED, 1, 0),
            (RESTRICTED_V6, 1, 0),
            (OPEN, UNRESTRICTED, 1),
        ] {
            maps.upsert_peer(
                ip(addr),
                PeerEntry {
                    policy,
                    slot,
                    owner: u64::from(slot) + 1,
                    ..PeerEntry::default()
                },
            )
            .unwrap();
        }
        let settings = DatapathSettings {
            events_per_second,
            ..DatapathSettings::default()
        };
        maps.set_config(&settings.config(true, wgfence::settings::online_cpus()))
            .unwrap();
        let state =
            tempfile_path::Path(std::env::temp_dir().join(unique("wgfence-monitor-state-")));
        let key = |n: u8| wgfence::state::WgKey([n; 32]).to_base64();
        let text = serde_json::json!({ "version": 1, "peers": [
            { "name": "alice", "publicKey": key(1), "address": RESTRICTED, "addressV6": RESTRICTED_V6,
              "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443] }] },
            { "name": "bob", "publicKey": key(2), "address": OPEN },
        ]});
        std::fs::write(&state.0, text.to_string()).unwrap();
        Self {
            dataplane,
            attached,
            state,
            ns,
        }
    }

    /// `wgfence monitor --json` on the attached interface, its lines on a channel.
    fn monitor(&self, extra: &[&str]) -> (Running, mpsc::Receiver<Value>) {
        let state = self.state.0.display().to_string();
        let mut child = Command::new(binary())
            .args([
                "monitor",
                "--interface",
                &self.attached,
                "--json",
                "--state",
                &state,
            ])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("wgfence monitor");
        let stdout = child.stdout.take().expect("no stdout");
        let stderr = child.stderr.take().expect("no stderr");
        let child = Running(child);
        wait_until_monitoring(stderr);
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let event = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line}: {e}"));
                if tx.send(event).is_err() {
                    break;
                }
            }
        });
        (child, rx)
    }

    fn send(&self, frames: &[Vec<u8>]) {
        self.ns.enter(|| inject(SENDER, frames));
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        let _ = self.dataplane.detach_now();
    }
}

/// Waits for the monitor's "monitoring ..." line on stderr: from then on it sees every event.
fn wait_until_monitoring(stderr: std::process::ChildStderr) {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let mut lines = BufReader::new(stderr).lines();
        let first = lines.next().and_then(Result::ok).unwrap_or_default();
        let _ = tx.send(first);
        // Keep draining, so the monitor never blocks on a full pipe.
        for _ in lines {}
    });
    let line = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("wgfence monitor did not start within 10 s");
    assert!(
        line.starts_with("monitoring drop events"),
        "monitor: {line}"
    );
}

/// A running monitor, stopped on drop (also when a test fails).
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn stop(child: Running) {
    drop(child);
}

#[test]
fn every_drop_reason_produces_its_event() {
    let bench = Bench::new(1000);
    let (child, events) = bench.monitor(&[]);
    let mut not_ip = Packet::new("10.8.0.2", "10.1.2.3", TCP, 80).frame();
    not_ip[14] = 0x50; // IP version 5
    let mut chain = Packet::new(RESTRICTED_V6, "fd00:1::1", UDP, 53);
    for _ in 0..9 {
        chain = chain.ext(Ext::DestinationOptions);
    }
    let cases: Vec<(&str, Vec<u8>, Value)> = vec![
        (
            "policy_denied",
            Packet::new(RESTRICTED, "10.1.2.3", TCP, 22)
                .src_port(40001)
                .frame(),
            serde_json::json!({ "peer": "alice", "protocol": "tcp", "src": RESTRICTED,
                                "dst": "10.1.2.3", "srcPort": 40001, "dstPort": 22, "slot": 0 }),
        ),
        (
            "unknown_source",
            Packet::new("10.8.0.99", "10.1.2.3", UDP, 53).frame(),
            serde_json::json!({ "protocol": "udp", "src": "10.8.0.99", "dstPort": 53 }),
        ),
        (
            "malformed",
            Packet::new(RESTRICTED, "10.1.2.3", TCP, 443)
                .transport_len(2)
                .frame(),
            serde_json::json!({ "peer": "alice", "protocol": "tcp" }),
        ),
        (
            "not_ip",
            not_ip,
            serde_json::json!({ "protocol": "not-ip" }),
        ),
        (
            "header_chain",
            chain.frame(),
            serde_json::json!({ "peer": "alice", "src": RESTRICTED_V6, "dst": "fd00:1::1" }),
        ),
    ];
    for (reason, frame, fields) in &cases {
        bench.send(std::slice::from_ref(frame));
        let event = events
            .recv_timeout(Duration::from_secs(5))
            .unwrap_or_else(|_| panic!("no event for {reason}"));
        assert_eq!(event["reason"], *reason, "{event}");
        for (k, v) in fields.as_object().into_iter().flatten() {
            assert_eq!(&event[k], v, "{reason}: field {k} of {event}");
        }
        if *reason == "unknown_source" || *reason == "not_ip" {
            assert!(
                event.get("peer").is_none() && event.get("slot").is_none(),
                "{event}"
            );
        }
    }
    // Passed packets produce nothing.
    bench.send(&[
        Packet::new(RESTRICTED, "10.1.2.3", TCP, 443).frame(),
        Packet::new(OPEN, "10.1.2.3", UDP, 9).frame(),
    ]);
    assert!(events.recv_timeout(Duration::from_millis(500)).is_err());
    stop(child);
}

#[test]
fn peer_filter_shows_only_that_peer() {
    let bench = Bench::new(1000);
    let (child, events) = bench.monitor(&["--peer", "alice"]);
    bench.send(&[
        Packet::new("10.8.0.99", "10.1.2.3", UDP, 53).frame(),
        Packet::new(RESTRICTED, "10.1.2.3", TCP, 22).frame(),
    ]);
    let event = events
        .recv_timeout(Duration::from_secs(5))
        .expect("no event for alice");
    assert_eq!(event["peer"], "alice", "{event}");
    assert!(events.recv_timeout(Duration::from_millis(500)).is_err());
    stop(child);

    let out = Command::new(binary())
        .args(["monitor", "--interface", &bench.attached, "--peer", "carol"])
        .args(["--state", &bench.state.0.display().to_string()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no peer named \"carol\""), "{stderr}");

    // A state file that cannot be read is named as the fault, not as a peer it lacks.
    let missing = bench.state.0.with_extension("missing");
    let out = Command::new(binary())
        .args(["monitor", "--interface", &bench.attached, "--peer", "alice"])
        .args(["--state", &missing.display().to_string()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("reading the state file")
            && stderr.contains(&missing.display().to_string()),
        "{stderr}"
    );
    assert!(!stderr.contains("no peer named"), "{stderr}");
}

#[test]
fn a_flood_yields_at_most_the_configured_event_rate() {
    const RATE: u32 = 50;
    let bench = Bench::new(RATE);
    let (child, events) = bench.monitor(&[]);
    let frame = Packet::new(RESTRICTED, "10.1.2.3", TCP, 22).frame();
    let start = Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < Duration::from_secs(2) {
        bench.send(&vec![frame.clone(); 500]);
        sent += 500;
    }
    let elapsed = start.elapsed().as_secs_f64();
    thread::sleep(Duration::from_millis(500));
    let received = events.try_iter().count() as f64;
    stop(child);
    // The rate over the flood, plus each CPU's saved-up second (the burst).
    let bound = f64::from(RATE) * (elapsed + 1.0);
    assert!(
        received <= bound,
        "{received} events from {sent} drops in {elapsed:.1} s, bound {bound}"
    );
    assert!(received >= f64::from(RATE) * 0.5, "only {received} events");
    let counters = bench.dataplane.maps().counters().unwrap();
    let limited = counters.get(wgfence_common::Counter::EventRateLimited);
    assert!(limited > 0 && limited + counters.get(wgfence_common::Counter::EventSent) >= sent);
}

/// A packet whose IP header is not in the skb's linear data (only its Ethernet header is) gets
/// the verdict its header calls for: the datapath pulls the header into the linear data
/// instead of calling the packet malformed or misreading it.
#[test]
fn a_header_outside_the_linear_data_is_judged_like_any_other() {
    use wgfence_common::Counter;
    let bench = Bench::new(1000);
    for link in [bench.attached.as_str(), SENDER] {
        bench.ns.ip(&["link", "set", link, "mtu", "9000"]);
    }
    let paged = |dst_port| paged(&Packet::new(RESTRICTED, "10.1.2.3", TCP, dst_port));
    let count = |c| bench.dataplane.maps().counters().unwrap().get(c);
    let watched = [
        Counter::PassPolicy,
        Counter::DropPolicy,
        Counter::DropMalformed,
    ];
    let before: Vec<u64> = watched.iter().map(|&c| count(c)).collect();
    bench
        .ns
        .enter(|| inject_paged(SENDER, &[paged(443), paged(22)]));
    let deadline = Instant::now() + Duration::from_secs(5);
    let delta = loop {
        let delta: Vec<u64> = watched
            .iter()
            .zip(&before)
            .map(|(&c, b)| count(c) - b)
            .collect();
        if delta.iter().sum::<u64>() >= 2 || Instant::now() > deadline {
            break delta;
        }
        thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        delta,
        [1, 1, 0],
        "allowed to 443 passes, denied to 22 drops, neither is malformed \
         (pass_policy, drop_policy, drop_malformed)"
    );
}

/// The egress side of the same: a packet toward a restricted peer whose IP header is outside
/// the linear data still records its flow, so the peer's reply passes (a policy denial
/// otherwise: the policy allows only TCP 443).
#[test]
fn a_paged_packet_toward_a_peer_records_its_flow() {
    use wgfence_common::Counter;
    let bench = Bench::new(1000);
    for link in [bench.attached.as_str(), SENDER] {
        bench.ns.ip(&["link", "set", link, "mtu", "9000"]);
    }
    let count = |c| bench.dataplane.maps().counters().unwrap().get(c);
    let toward_peer = paged(&Packet::new("10.1.2.3", RESTRICTED, UDP, 40000).src_port(53));
    // Out of the attached interface: its egress program sees it.
    bench
        .ns
        .enter(|| inject_paged(&bench.attached, &[toward_peer]));
    let (replies, denied) = (count(Counter::PassReply), count(Counter::DropPolicy));
    let reply = Packet::new(RESTRICTED, "10.1.2.3", UDP, 53)
        .src_port(40000)
        .frame();
    let deadline = Instant::now() + Duration::from_secs(5);
    while count(Counter::PassReply) == replies && count(Counter::DropPolicy) == denied {
        assert!(Instant::now() < deadline, "the reply was never judged");
        bench.send(std::slice::from_ref(&reply));
        thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        (
            count(Counter::PassReply) - replies,
            count(Counter::DropPolicy) - denied
        ),
        (1, 0),
        "the reply to the paged packet's flow passes (pass_reply, drop_policy)"
    );
}

/// `packet` as a frame of 6,000 bytes (zeros after its headers), which [`inject_paged`] sends
/// with only its Ethernet header in the linear data.
fn paged(packet: &Packet) -> Vec<u8> {
    let mut frame = packet.frame();
    frame.resize(6000, 0);
    let ip_len = u16::try_from(frame.len() - 14).unwrap();
    frame[16..18].copy_from_slice(&ip_len.to_be_bytes());
    frame
}

/// The limiter refills from `jiffies`, so the agent must know how long a jiffy is: what it
/// measures is a rate Linux is built with, and the kernel's own `CONFIG_HZ` where the kernel
/// says it (`/proc/config.gz`, or `/boot/config-RELEASE`).
#[test]
fn the_agent_measures_the_kernel_tick_rate() {
    wgfence_tests::require_root();
    let hz = wgfence::dataplane::tick::measure_hz()
        .unwrap_or_else(|e| panic!("{}", wgfence::error_chain(&e)));
    assert!([100, 250, 300, 1000].contains(&hz), "{hz} Hz");
    let config = Command::new("sh")
        .args([
            "-c",
            "zcat /proc/config.gz 2>/dev/null || cat /boot/config-$(uname -r) 2>/dev/null",
        ])
        .output()
        .expect("running sh");
    let configured = String::from_utf8_lossy(&config.stdout)
        .lines()
        .find_map(|line| line.strip_prefix("CONFIG_HZ=")?.trim().parse::<u32>().ok());
    match configured {
        Some(configured) => assert_eq!(hz, configured, "measured against CONFIG_HZ"),
        None => eprintln!("the kernel's config is not readable here; measured {hz} Hz"),
    }
}
