//! Hostile peers: packets crafted inside a peer's namespace (raw sockets, any source address,
//! fragments, long IPv6 header chains) and sent through its real WireGuard session to the
//! gateway, where the agent enforces the state. Each test says which layer drops what, and
//! proves it on the wire (a listener on the node) and in the datapath's counters.

use std::{
    net::{Ipv4Addr, UdpSocket},
    process::Stdio,
    thread,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use serde_json::{json, Value};
use wgfence::dataplane::{Counters, Dataplane};
use wgfence_common::Counter;
use wgfence_tests::{
    agent::{Agent, Layout},
    net::{run, wait_for, Netns},
    packet::{send_raw, udp4_fragments, Ext, Packet, TCP, UDP},
    state,
    topology::Gateway,
};

/// Peer 0's rules: tcp/80 and udp/5000 on 10.2.3.4 (port rules), any udp to 10.9.1.1 (a rule
/// without ports), ping to the node, tcp/22 on fd00:1::1.
fn rules() -> Value {
    json!([
        { "cidr": "10.2.3.4/32", "protocol": "tcp", "ports": [80] },
        { "cidr": "10.2.3.4/32", "protocol": "udp", "ports": [5000] },
        { "cidr": "10.9.1.1/32", "protocol": "udp" },
        { "cidr": "10.8.0.1/32", "protocol": "icmp" },
        { "cidr": "fd00:1::1/128", "protocol": "tcp", "ports": [22] },
    ])
}

/// Two peers: 0 restricted by `rules()`, 1 unrestricted, the agent running and ready.
fn setup() -> (Gateway, Agent, String) {
    let gw = Gateway::new(2);
    let s = state(vec![gw.peer_json(0, Some(rules())), gw.peer_json(1, None)]);
    let agent = Agent::start(&gw, Layout::Plain, &s, &[]);
    agent.wait_ready(&gw);
    (gw, agent, s)
}

fn counters(gw: &Gateway) -> Counters {
    Dataplane::open_maps(&gw.bpffs, gw.interface())
        .and_then(|m| m.counters())
        .expect("reading the counters")
}

/// How much each counter grew since `before`: polled until it equals `want` (packets through
/// wireguard-go take a moment, longer on a loaded machine) or 3 s have passed; an expected
/// "nothing" is given half a second to be contradicted.
fn delta(gw: &Gateway, before: &Counters, want: &[(Counter, u64)]) -> Vec<(Counter, u64)> {
    let read = || {
        let now = counters(gw);
        Counter::ALL
            .iter()
            .map(|c| (*c, now.get(*c) - before.get(*c)))
            .filter(|(_, n)| *n > 0)
            .collect::<Vec<_>>()
    };
    if want.is_empty() {
        thread::sleep(Duration::from_millis(500));
        return read();
    }
    let mut got = read();
    let _ = wait_for(Duration::from_secs(3), || {
        got = read();
        got == want
    });
    got
}

/// A UDP socket on the node, bound to one of its destinations.
fn listen(gw: &Gateway, addr: &str) -> UdpSocket {
    let socket = gw
        .node
        .enter(|| UdpSocket::bind(addr))
        .unwrap_or_else(|e| panic!("binding {addr} on the node: {e}"));
    socket
        .set_read_timeout(Some(Duration::from_millis(1500)))
        .unwrap();
    socket
}

/// Whether a datagram arrived (within the timeout); its length if so.
fn received(socket: &UdpSocket) -> Option<usize> {
    let mut buf = [0u8; 2048];
    socket.recv(&mut buf).ok()
}

fn send(ns: &Netns, packets: &[Vec<u8>]) {
    for p in packets {
        ns.enter(|| send_raw(p))
            .unwrap_or_else(|e| panic!("sending a raw packet from {}: {e}", ns.name()));
    }
}

fn udp(src: &str, dst: &str, port: u16) -> Vec<u8> {
    Packet::new(src, dst, UDP, port).ip()
}

/// A peer sending with another peer's address, or an address nobody has: WireGuard's
/// cryptokey routing drops it on receipt (the source is not among the sending peer's allowed
/// IPs), before the tcx hook, so the datapath never sees it and it never arrives. An address
/// WireGuard does route to the peer but the state does not give it is the datapath's to drop
/// (unknown_source).
#[test]
fn spoofed_sources_never_reach_the_node() {
    let (gw, _agent, _) = setup();
    let target = listen(&gw, "10.9.1.1:7000");
    let restricted = &gw.peers[0].ns;
    let open = &gw.peers[1].ns;

    // Control: the unrestricted peer with its own address gets through, seen by the datapath.
    let before = counters(&gw);
    send(open, &[udp("10.8.0.3", "10.9.1.1", 7000)]);
    assert_eq!(
        received(&target),
        Some(0),
        "the control datagram did not arrive"
    );
    assert_eq!(
        delta(&gw, &before, &[(Counter::PassUnrestricted, 1)]),
        vec![(Counter::PassUnrestricted, 1)]
    );

    // The restricted peer posing as the unrestricted one to escape its policy (udp/9999 on
    // 10.2.3.4 is not in its rules); the unrestricted one posing as the restricted one; both
    // with a foreign address.
    let denied = listen(&gw, "10.2.3.4:9999");
    let cases: [(&Netns, &str, &str, u16, &UdpSocket); 4] = [
        (restricted, "10.8.0.3", "10.2.3.4", 9999, &denied),
        (open, "10.8.0.2", "10.9.1.1", 7000, &target),
        (restricted, "192.168.77.1", "10.9.1.1", 7000, &target),
        (open, "10.8.0.200", "10.9.1.1", 7000, &target),
    ];
    for (ns, src, dst, port, socket) in cases {
        let before = counters(&gw);
        send(ns, &[udp(src, dst, port)]);
        assert_eq!(
            received(socket),
            None,
            "a datagram from {} with source {src} arrived",
            ns.name()
        );
        assert_eq!(
            delta(&gw, &before, &[]),
            vec![],
            "source {src} from {}: the datapath saw it, WireGuard should have dropped it",
            ns.name()
        );
    }

    // An allowed IP WireGuard has for peer 1 but the state does not (drift, or an address the
    // peer gave up: allowed IPs are only ever added): WireGuard delivers it, the datapath drops
    // it as unknown_source.
    let key = gw.peers[1].wg.keys.public.clone();
    gw.wg.set_peer(
        &key,
        &["allowed-ips", "10.8.0.3/32,fd00:8::3/128,10.8.0.99/32"],
    );
    let before = counters(&gw);
    send(open, &[udp("10.8.0.99", "10.9.1.1", 7000)]);
    assert_eq!(received(&target), None, "10.8.0.99 reached the node");
    assert_eq!(
        delta(&gw, &before, &[(Counter::DropUnknownSource, 1)]),
        vec![(Counter::DropUnknownSource, 1)]
    );
}

/// IPv4 fragments, per the documented semantics: the first fragment carries the ports and is
/// judged like an unfragmented packet; a later fragment has no ports, so only a rule without
/// ports can pass it. A datagram fragmented inside the tunnel therefore arrives whole only
/// where a port-less rule allows it, and a fragment sent alone to a denied port never passes.
#[test]
fn fragments_cannot_reach_a_denied_port() {
    let (gw, _agent, _) = setup();
    let ns = &gw.peers[0].ns;
    let src = Ipv4Addr::new(10, 8, 0, 2);
    let payload = [0x5au8; 16];
    let frags = |dst: [u8; 4], port: u16, id: u16| {
        udp4_fragments(src, Ipv4Addr::from(dst), port, id, &payload, 16)
    };

    // A port-less rule: both fragments pass, the node reassembles the datagram.
    let open = listen(&gw, "10.9.1.1:7000");
    let before = counters(&gw);
    send(ns, &frags([10, 9, 1, 1], 7000, 0x1001));
    assert_eq!(received(&open), Some(payload.len()), "reassembled datagram");
    assert_eq!(
        delta(&gw, &before, &[(Counter::PassPolicy, 2)]),
        vec![(Counter::PassPolicy, 2)]
    );

    // A denied port: the first fragment is denied, the later one too (port rule); nothing
    // arrives.
    let denied = listen(&gw, "10.2.3.4:5353");
    let before = counters(&gw);
    send(ns, &frags([10, 2, 3, 4], 5353, 0x1002));
    assert_eq!(received(&denied), None, "fragments reached a denied port");
    assert_eq!(
        delta(&gw, &before, &[(Counter::DropPolicy, 2)]),
        vec![(Counter::DropPolicy, 2)]
    );

    // Smuggling: a later fragment alone, or the first fragment of an allowed port followed
    // by later fragments meant to complete another datagram: every later fragment to a
    // port-restricted destination is dropped, so no datagram completes.
    let allowed = listen(&gw, "10.2.3.4:5000");
    let before = counters(&gw);
    let mut parts = frags([10, 2, 3, 4], 5000, 0x1003);
    send(ns, &parts.split_off(1));
    send(ns, &frags([10, 2, 3, 4], 5000, 0x1004));
    assert_eq!(received(&allowed), None, "a fragmented datagram completed");
    assert_eq!(received(&denied), None);
    assert_eq!(
        delta(
            &gw,
            &before,
            &[(Counter::PassPolicy, 1), (Counter::DropPolicy, 2)]
        ),
        vec![(Counter::PassPolicy, 1), (Counter::DropPolicy, 2)]
    );

    // The same port unfragmented: allowed (the rule works; fragmentation is what it denies).
    send(ns, &[udp("10.8.0.2", "10.2.3.4", 5000)]);
    assert_eq!(received(&allowed), Some(0));
}

/// An IPv6 extension header chain longer than the datapath walks (8 headers): dropped for a
/// restricted peer (fail closed: its transport header was never found), passed for an
/// unrestricted one (nothing to decide). At the bound, the chain is walked and the rules apply.
#[test]
fn an_overlong_ipv6_header_chain_fails_closed_for_restricted_peers() {
    let (gw, _agent, _) = setup();
    let bound = wgfence_common::MAX_IPV6_EXT_HEADERS;
    let chain = |src: &str, port: u16, n: usize| {
        let mut p = Packet::new(src, "fd00:1::1", TCP, port);
        for _ in 0..n {
            p = p.ext(Ext::DestinationOptions);
        }
        p.ip()
    };
    let restricted = &gw.peers[0].ns;
    let cases = [
        (
            restricted,
            chain("fd00:8::2", 22, bound),
            Counter::PassPolicy,
        ),
        (
            restricted,
            chain("fd00:8::2", 23, bound),
            Counter::DropPolicy,
        ),
        (
            restricted,
            chain("fd00:8::2", 22, bound + 1),
            Counter::DropHeaderChain,
        ),
        (
            restricted,
            chain("fd00:8::2", 22, 40),
            Counter::DropHeaderChain,
        ),
        (
            &gw.peers[1].ns,
            chain("fd00:8::3", 22, bound + 1),
            Counter::PassUnrestricted,
        ),
    ];
    for (ns, packet, counter) in cases {
        let before = counters(&gw);
        send(ns, &[packet]);
        assert_eq!(
            delta(&gw, &before, &[(counter, 1)]),
            vec![(counter, 1)],
            "expected {counter:?}"
        );
    }
}

/// A revocation while the peer's WireGuard session stays up: the peer gives up its address
/// (allowed IPs are only ever added, so WireGuard keeps routing it) and keeps sending from it;
/// the datapath drops it within a second of the state change.
#[test]
fn packets_after_a_revocation_are_dropped_while_the_session_is_up() {
    let (gw, agent, _) = setup();
    let ns = &gw.peers[0].ns;
    let ping = ns
        .command("ping")
        .args(["-D", "-n", "-i", "0.01", "-c", "300", "-W", "1", "10.8.0.1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("ping");
    thread::sleep(Duration::from_millis(1000));
    let mut moved = gw.peer_json(0, Some(rules()));
    moved["address"] = json!("10.8.0.102");
    let t0 = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default();
    let before = counters(&gw);
    agent.write_state(&state(vec![moved, gw.peer_json(1, None)]));
    let out = ping.wait_with_output().expect("ping");
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text
        .lines()
        .filter(|l| l.contains("bytes from"))
        .filter_map(|l| l.strip_prefix('[')?.split(']').next()?.parse::<f64>().ok())
        .fold(None, |m: Option<f64>, t| Some(m.map_or(t, |m| m.max(t))))
        .unwrap_or_else(|| panic!("no reply at all:\n{text}"));
    let latency = last - t0;
    eprintln!("last reply {:.0} ms after the state change", latency * 1e3);
    assert!(
        latency < 1.0,
        "still answered {latency:.3} s after the revocation"
    );
    // WireGuard still routes the old address to the peer and the session is up: the drops
    // are the datapath's.
    let dropped =
        counters(&gw).get(Counter::DropUnknownSource) - before.get(Counter::DropUnknownSource);
    assert!(dropped > 10, "only {dropped} unknown_source drops");
    let out = run(&["wg", "show", gw.interface(), "allowed-ips"]);
    let key = gw.peers[0].wg.keys.public.clone();
    let line = String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.starts_with(&key))
        .map(str::to_owned)
        .expect("peer 0 left WireGuard");
    assert!(line.contains("10.8.0.2/32"), "{line}");
    assert!(
        gw.wg
            .latest_handshakes()
            .iter()
            .any(|(k, t)| *k == key && *t > 0),
        "no session"
    );
}
