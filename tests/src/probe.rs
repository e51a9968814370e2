//! Real traffic from a peer's namespace, and whether it arrived at the node.
//!
//! A probe needs no listener: a TCP SYN that arrives is answered (accepted or reset), a UDP
//! datagram that arrives is answered by an ICMP port unreachable, and a ping by an echo reply.
//! A packet the datapath drops gets no answer at all: the probe times out.

use std::{
    fmt,
    io::ErrorKind,
    net::{IpAddr, SocketAddr, TcpStream, UdpSocket},
    thread,
    time::Duration,
};

use crate::net::Netns;

const TIMEOUT: Duration = Duration::from_millis(800);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    Reached,
    Blocked,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Tcp(u16),
    Udp(u16),
    Ping,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Kind::Tcp(port) => write!(f, "tcp/{port}"),
            Kind::Udp(port) => write!(f, "udp/{port}"),
            Kind::Ping => write!(f, "ping"),
        }
    }
}

/// Sends one probe from `ns` to `dst` and reports whether it arrived.
pub fn probe(ns: &Netns, kind: Kind, dst: IpAddr) -> Reach {
    match kind {
        Kind::Tcp(port) => ns.enter(|| tcp(SocketAddr::new(dst, port))),
        Kind::Udp(port) => ns.enter(|| udp(SocketAddr::new(dst, port))),
        Kind::Ping => {
            let out = ns.try_exec(&["ping", "-c", "1", "-W", "1", &dst.to_string()]);
            if out.status.success() {
                Reach::Reached
            } else {
                Reach::Blocked
            }
        }
    }
}

fn tcp(dst: SocketAddr) -> Reach {
    match TcpStream::connect_timeout(&dst, TIMEOUT) {
        Ok(_) => Reach::Reached,
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => Reach::Reached,
        Err(e) if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock) => Reach::Blocked,
        Err(e) => panic!("tcp probe to {dst}: {e}"),
    }
}

fn udp(dst: SocketAddr) -> Reach {
    let any: SocketAddr = match dst {
        SocketAddr::V4(_) => "0.0.0.0:0",
        SocketAddr::V6(_) => "[::]:0",
    }
    .parse()
    .unwrap();
    let socket = UdpSocket::bind(any).expect("udp bind");
    socket
        .connect(dst)
        .unwrap_or_else(|e| panic!("udp connect {dst}: {e}"));
    socket.set_read_timeout(Some(TIMEOUT)).unwrap();
    socket
        .send(b"wgfence probe")
        .unwrap_or_else(|e| panic!("udp send to {dst}: {e}"));
    let mut buf = [0u8; 64];
    match socket.recv(&mut buf) {
        Ok(_) => Reach::Reached,
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => Reach::Reached,
        Err(e) if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock) => Reach::Blocked,
        Err(e) => panic!("udp probe to {dst}: {e}"),
    }
}

/// One expectation: from `from` (a label), `kind` to `dst` should be `expect`.
#[derive(Debug, Clone)]
pub struct Expect<'a> {
    pub from: &'a str,
    pub ns: &'a Netns,
    pub kind: Kind,
    pub dst: IpAddr,
    pub expect: Reach,
}

impl<'a> Expect<'a> {
    pub fn new(from: &'a str, ns: &'a Netns, kind: Kind, dst: &str, expect: Reach) -> Self {
        Self {
            from,
            ns,
            kind,
            dst: dst.parse().unwrap_or_else(|e| panic!("{dst}: {e}")),
            expect,
        }
    }
}

/// Runs every probe in parallel; the results in the order of `cases`.
pub fn run_all(cases: &[Expect<'_>]) -> Vec<Reach> {
    thread::scope(|s| {
        let handles: Vec<_> = cases
            .iter()
            .map(|c| s.spawn(move || probe(c.ns, c.kind, c.dst)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

/// Runs every probe in parallel and fails with the whole table of mismatches.
#[track_caller]
pub fn check_all(cases: &[Expect<'_>]) {
    let results = run_all(cases);
    let mismatches: Vec<String> = cases
        .iter()
        .zip(&results)
        .filter(|(c, got)| c.expect != **got)
        .map(|(c, got)| {
            format!(
                "  {} {} -> {}: expected {:?}, got {:?}",
                c.from, c.kind, c.dst, c.expect, got
            )
        })
        .collect();
    assert!(
        mismatches.is_empty(),
        "{} of {} probes disagree:\n{}",
        mismatches.len(),
        cases.len(),
        mismatches.join("\n")
    );
}
