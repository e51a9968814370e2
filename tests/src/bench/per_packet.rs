//! The per-packet scenario of `cargo xtask bench`: wgfence's per-packet paths beside floor programs the bench
//! loads itself (`ebpf/src/floor.rs`: an empty classifier, one hash lookup with the key and
//! value sizes of `wgf4_peers_v4`, that lookup plus a trie of the peer's policy alone behind an
//! array of maps, as map layout 4 has them, and that lookup plus one LPM trie all policies share,
//! as layout 3 had it), with the same entries in their maps, on the same raw IPv4 packets,
//! under `BPF_PROG_TEST_RUN`, in one run: reported as ratios. Then one peer's packets on two
//! CPUs at once against two peers' packets.

use std::{
    collections::BTreeMap,
    net::IpAddr,
    os::fd::{AsFd as _, BorrowedFd},
    time::Duration,
};

use aya::{
    maps::{lpm_trie::Key, ArrayOfMaps, HashMap, LpmTrie, MapData},
    programs::SchedClassifier,
    Ebpf, EbpfLoader,
};
use ipnet::IpNet;
use serde_json::json;
use wgfence::{
    dataplane::{test_run, PolicyEntry, TestProgram, FLOOR_OBJECT_PATH},
    policy::CompiledPolicy,
    settings::online_cpus,
    state::DesiredState,
};
use wgfence_common::{
    PeerEntry, PeerKeyV4, PolicyKeyV4, PolicyValue, SharedPolicyKeyV4, MAX_POLICY_ENTRIES,
    PROTO_ICMP, PROTO_TCP, PROTO_UDP, VARIANT_L3,
};

use super::{
    gen::{self, Rng},
    median, parse_value, progress,
    replies::{configure, loaded_variant},
    report::{f, verdict, Report},
    Config,
};
use crate::packet::{Packet, ICMP, TCP, UDP};

/// Runs per measurement, as the kernel averages them.
pub const REPEAT: u32 = 1_000_000;
/// Every case once per round, this many rounds; the median is reported (drift on a shared
/// machine hits every case alike).
const ROUNDS: usize = 5;

const EMPTY: &str = "floor_empty";
const LOOKUP: &str = "floor_lookup";
const LPM: &str = "floor_lpm";
const MIM: &str = "floor_mim";

/// The floor programs, loaded, with maps holding what wgfence's IPv4 maps hold.
pub struct Floor {
    ebpf: Ebpf,
}

impl Floor {
    /// Loads the floor object built beside the datapath and copies `program`'s IPv4 peer
    /// entries and IPv4 policy trie entries into its maps.
    pub fn load(program: &TestProgram) -> Self {
        let mut ebpf = EbpfLoader::new()
            .load_file(FLOOR_OBJECT_PATH)
            .unwrap_or_else(|e| panic!("loading {FLOOR_OBJECT_PATH}: {e}"));
        let maps = program.maps();
        {
            let map = ebpf.map_mut("floor_peers").expect("no floor_peers");
            let mut peers: HashMap<_, PeerKeyV4, PeerEntry> =
                HashMap::try_from(map).expect("floor_peers");
            for (addr, entry) in maps.peers().unwrap() {
                if let IpAddr::V4(a) = addr {
                    peers
                        .insert(PeerKeyV4 { addr: a.octets() }, entry, 0)
                        .expect("floor_peers");
                }
            }
        }
        {
            let map = ebpf.map_mut("floor_policy").expect("no floor_policy");
            let mut policy: LpmTrie<_, SharedPolicyKeyV4, PolicyValue> =
                LpmTrie::try_from(map).expect("floor_policy");
            for e in maps.policies().unwrap() {
                if let IpNet::V4(n) = e.prefix {
                    let key = Key::new(
                        32 + u32::from(n.prefix_len()),
                        SharedPolicyKeyV4 {
                            policy: e.policy,
                            addr: n.network().octets(),
                        },
                    );
                    policy.insert(&key, e.value, 0).expect("floor_policy");
                }
            }
        }
        fill_per_policy_tries(&mut ebpf, &maps.policies().unwrap());
        for name in [EMPTY, LOOKUP, LPM, MIM] {
            let program: &mut SchedClassifier = ebpf
                .program_mut(name)
                .unwrap_or_else(|| panic!("no {name}"))
                .try_into()
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            program.load().unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        Self { ebpf }
    }

    fn fd(&self, name: &str) -> BorrowedFd<'_> {
        let program: &SchedClassifier = self
            .ebpf
            .program(name)
            .unwrap_or_else(|| panic!("no {name}"))
            .try_into()
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        program
            .fd()
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .as_fd()
    }
}

/// `BPF_F_NO_PREALLOC`, which the kernel requires of LPM tries.
const BPF_F_NO_PREALLOC: u32 = 1;

/// The floor of a layout with one trie per distinct policy: each policy's IPv4 entries in a
/// trie of its own (keyed by destination alone), published in `floor_pol_of` under its id.
fn fill_per_policy_tries(ebpf: &mut Ebpf, entries: &[PolicyEntry]) {
    let mut tries: BTreeMap<u32, LpmTrie<MapData, PolicyKeyV4, PolicyValue>> = BTreeMap::new();
    for e in entries {
        let IpNet::V4(n) = e.prefix else { continue };
        let trie = tries.entry(e.policy).or_insert_with(|| {
            LpmTrie::create(MAX_POLICY_ENTRIES, BPF_F_NO_PREALLOC).expect("creating a policy trie")
        });
        let key = Key::new(
            u32::from(n.prefix_len()),
            PolicyKeyV4 {
                addr: n.network().octets(),
            },
        );
        trie.insert(&key, e.value, 0).expect("a policy trie");
    }
    let map = ebpf.map_mut("floor_pol_of").expect("no floor_pol_of");
    let mut outer: ArrayOfMaps<_, LpmTrie<MapData, PolicyKeyV4, PolicyValue>> =
        ArrayOfMaps::try_from(map).expect("floor_pol_of");
    for (policy, trie) in tries {
        // The outer map holds the trie from here on; this process's descriptor closes.
        outer.set(policy, &trie, 0).expect("floor_pol_of");
    }
}

/// The kernel's average ns per run of `repeat` runs of `input`.
fn time(fd: BorrowedFd<'_>, input: &[u8], repeat: u32, passes: Option<bool>, what: &str) -> f64 {
    let run = test_run(fd, input, repeat, None).unwrap_or_else(|e| panic!("{what}: {e}"));
    if let Some(passes) = passes {
        assert_eq!(run.passed(), passes, "{what}: unexpected verdict");
    }
    f64::from(run.duration_ns)
}

#[derive(Clone, Copy)]
enum Prog {
    Floor(&'static str),
    Wgfence { replies: bool, events: u32 },
}

struct Case {
    label: &'static str,
    key: &'static str,
    prog: Prog,
    input: Vec<u8>,
    passes: Option<bool>,
    /// For wgfence's paths: the floor case it is compared with, and the goal (the most the
    /// ratio may be).
    against: Option<(usize, f64)>,
}

/// The test packets of this scenario as raw IPv4 packets (what the L3 variant reads on a
/// WireGuard device): unknown source, unrestricted, restricted allowed, restricted denied.
pub struct Packets {
    pub unknown: Vec<u8>,
    pub unrestricted: Vec<u8>,
    pub allowed: Vec<u8>,
    /// A TCP SYN the policy denies.
    pub denied: Vec<u8>,
    /// A UDP datagram the policy denies. Its peer holds no reply flow, so it looks for none.
    pub denied_udp: Vec<u8>,
    /// A UDP datagram another restricted peer's policy denies; that peer holds a live reply
    /// flow (toward [`FLOW_REMOTE`], which the datagram does not answer), so with replies on
    /// it looks for a flow it answers and finds none.
    pub denied_udp_flow: Vec<u8>,
    /// The source of `denied_udp_flow`: the peer the bench gives the flow.
    pub flow_holder: IpAddr,
    /// A packet of another unrestricted peer (another counter slot).
    pub other_unrestricted: Vec<u8>,
}

fn cases(p: &Packets) -> Vec<Case> {
    let floor = |label, key, name, input: &Vec<u8>| Case {
        label,
        key,
        prog: Prog::Floor(name),
        input: input.clone(),
        passes: None,
        against: None,
    };
    let wg = |label, key, replies, events, input: &Vec<u8>, passes, against| Case {
        label,
        key,
        prog: Prog::Wgfence { replies, events },
        input: input.clone(),
        passes: Some(passes),
        against: Some(against),
    };
    vec![
        floor("floor: empty classifier", "floor_empty", EMPTY, &p.unknown),
        floor(
            "floor: one hash lookup, hit",
            "floor_lookup_hit",
            LOOKUP,
            &p.unrestricted,
        ),
        floor(
            "floor: one hash lookup, miss",
            "floor_lookup_miss",
            LOOKUP,
            &p.unknown,
        ),
        floor(
            "floor: lookup + LPM, allowed packet",
            "floor_lpm_allowed",
            LPM,
            &p.allowed,
        ),
        floor(
            "floor: lookup + LPM, denied packet",
            "floor_lpm_denied",
            LPM,
            &p.denied,
        ),
        floor(
            "floor: lookup + LPM, the flow holder's denied UDP",
            "floor_lpm_denied_udp_flow",
            LPM,
            &p.denied_udp_flow,
        ),
        floor(
            "floor: lookup + the policy's own trie (map in map), allowed packet",
            "floor_mim_allowed",
            MIM,
            &p.allowed,
        ),
        floor(
            "floor: lookup + the policy's own trie (map in map), denied packet",
            "floor_mim_denied",
            MIM,
            &p.denied,
        ),
        floor(
            "floor: lookup + the policy's own trie (map in map), the flow holder's denied UDP",
            "floor_mim_denied_udp_flow",
            MIM,
            &p.denied_udp_flow,
        ),
        wg(
            "unrestricted peer (pass)",
            "unrestricted",
            true,
            1000,
            &p.unrestricted,
            true,
            (1, 1.15),
        ),
        wg(
            "restricted, allowed (replies and events on)",
            "allowed",
            true,
            1000,
            &p.allowed,
            true,
            (6, 1.25),
        ),
        wg(
            "restricted, denied TCP SYN (replies and events off)",
            "denied_off",
            false,
            0,
            &p.denied,
            false,
            (7, 1.25),
        ),
        wg(
            "restricted, denied TCP SYN (replies and events on)",
            "denied_on",
            true,
            1000,
            &p.denied,
            false,
            (7, 1.5),
        ),
        wg(
            "restricted, denied UDP, its peer holding no flow (replies and events on)",
            "denied_udp_on",
            true,
            1000,
            &p.denied_udp,
            false,
            (7, 1.5),
        ),
        wg(
            "restricted, denied UDP, its peer holding a flow (replies and events on)",
            "denied_udp_flow_on",
            true,
            1000,
            &p.denied_udp_flow,
            false,
            (8, 1.5),
        ),
        wg(
            "unknown source (events off)",
            "unknown_off",
            true,
            0,
            &p.unknown,
            false,
            (2, 1.15),
        ),
        wg(
            "unknown source (events on)",
            "unknown_on",
            true,
            1000,
            &p.unknown,
            false,
            (2, 1.4),
        ),
    ]
}

/// Medians of every case for one state: (ns per case).
fn measure(program: &mut TestProgram, floor: &Floor, cases: &[Case]) -> Vec<f64> {
    let mut samples = vec![Vec::new(); cases.len()];
    for _ in 0..ROUNDS {
        for (i, c) in cases.iter().enumerate() {
            let ns = match c.prog {
                Prog::Floor(name) => time(floor.fd(name), &c.input, REPEAT, c.passes, c.label),
                Prog::Wgfence { replies, events } => {
                    configure(program, replies, events);
                    let fd = program.ingress_fd().unwrap();
                    time(fd, &c.input, REPEAT, c.passes, c.label)
                }
            };
            samples[i].push(Duration::from_nanos(ns as u64));
        }
    }
    samples
        .iter()
        .map(|s| median(s).as_nanos() as f64)
        .collect()
}

/// ns per packet on each CPU while CPU 0 runs `a` and CPU 1 runs `b` at the same time (the
/// mean of the two), or CPU 0 alone when `b` is `None`.
fn concurrent(fd: BorrowedFd<'_>, a: &[u8], b: Option<&[u8]>) -> f64 {
    std::thread::scope(|s| {
        let first = s.spawn(move || {
            crate::pin_to_cpu(0);
            time(fd, a, REPEAT, Some(true), "CPU 0")
        });
        let second = b.map(|b| {
            s.spawn(move || {
                crate::pin_to_cpu(1);
                time(fd, b, REPEAT, Some(true), "CPU 1")
            })
        });
        let x = first.join().expect("CPU 0 thread");
        match second {
            Some(t) => (x + t.join().expect("CPU 1 thread")) / 2.0,
            None => x,
        }
    })
}

/// Measures each state; writes the section's tables and goals.
fn compare(report: &mut Report, command: &str, states: &[(usize, DesiredState, Packets)]) {
    let mut results = Vec::new();
    let mut per_n: Vec<(usize, Vec<Case>, Vec<f64>)> = Vec::new();
    let mut scaling = None;
    for (n, desired, packets) in states {
        eprintln!("bench: per-packet cost beside the floor, N={n}");
        let mut program = loaded_variant(desired, VARIANT_L3);
        give_a_flow(&mut program, packets.flow_holder);
        let floor = Floor::load(&program);
        let cases = cases(packets);
        let ns = measure(&mut program, &floor, &cases);
        let mut entry = json!({ "peers": n });
        for (c, ns) in cases.iter().zip(&ns) {
            entry[c.key] = json!(ns);
        }
        results.push(entry);
        if online_cpus() >= 2 {
            // The largest state's program, as the agent configures it.
            configure(&mut program, true, 1000);
            let fd = program.ingress_fd().unwrap();
            let mut alone = Vec::new();
            let mut same = Vec::new();
            let mut two = Vec::new();
            for _ in 0..ROUNDS {
                let d = |x: f64| Duration::from_nanos(x as u64);
                alone.push(d(concurrent(fd, &packets.unrestricted, None)));
                same.push(d(concurrent(
                    fd,
                    &packets.unrestricted,
                    Some(&packets.unrestricted),
                )));
                two.push(d(concurrent(
                    fd,
                    &packets.unrestricted,
                    Some(&packets.other_unrestricted),
                )));
            }
            let m = |s: &[Duration]| median(s).as_nanos() as f64;
            scaling = Some((*n, m(&alone), m(&same), m(&two)));
        }
        per_n.push((*n, cases, ns));
    }

    report.section(
        "Per-packet cost beside the floor",
        &format!(
            "ns per packet under `BPF_PROG_TEST_RUN` (repeat {REPEAT}; the median of {ROUNDS} \
             rounds, each running every row once in turn), the L3 variant (the program a \
             WireGuard device gets) on raw IPv4 packets, with N generated peers in the maps. \
             Beside it, in the same run, on the same packets, the floor programs this bench \
             loads itself (`ebpf/src/floor.rs`, never loaded by the agent): an empty \
             classifier; one hash lookup with the key and value sizes and the entries of \
             `wgf4_peers_v4`; that lookup plus one lookup in a trie that holds only the \
             peer's own policy's IPv4 entries, found by policy id in an array of maps (map \
             layout 4, what the datapath has); that lookup plus one LPM lookup in a trie that \
             all policies share, keyed by (policy id, destination) (layout 3, for comparison). \
             Each wgfence path is divided by the floor that does its essential work on the \
             same packet (a hit or a miss) in the datapath's layout. A denied TCP SYN answers no flow, so it skips the reply \
             lookup; so does a denied UDP datagram of a peer that holds no reply flow (its \
             slot's flow quota is empty). A denied UDP datagram of a peer holding a flow (the \
             bench records one, toward another remote, for another restricted peer, the last \
             but one whose policy denies a sampled UDP datagram) looks for the flow it \
             answers and finds none: a third lookup, beside the floor's two (its floor row \
             runs that peer's own datagram). Every figure \
             includes the harness's own per-run cost (the empty classifier's row), which the \
             ratios do not subtract. Packets from the last peer of each kind; events on means \
             the agent's default 1,000/s node-wide, so a steady stream of drops is rate-limited. \
             Command: `{command}`."
        ),
    );
    let mut flat = Vec::new();
    for (n, cases, ns) in &per_n {
        let mut rows = Vec::new();
        for (c, x) in cases.iter().zip(ns) {
            let (floor_ns, ratio, goal) = match c.against {
                Some((i, goal)) => {
                    let floor = ns[i];
                    (f(floor, 0), format!("{:.2}×", x / floor), {
                        let met = x / floor <= goal;
                        format!("≤ {goal}×: {}", verdict(met))
                    })
                }
                None => ("".into(), "".into(), "".into()),
            };
            rows.push(vec![c.label.to_owned(), f(*x, 0), floor_ns, ratio, goal]);
        }
        report.paragraph(&format!("N = {n}:"));
        report.table(
            &["path", "ns", "its floor (ns)", "wgfence / floor", "goal"],
            &rows,
        );
        flat.push((*n, ns.clone()));
    }
    if let (Some((n0, first)), Some((n1, last))) = (flat.first(), flat.last()) {
        if n0 != n1 {
            let mut rows = Vec::new();
            if let Some((_, cases, _)) = per_n.first() {
                for (i, c) in cases.iter().enumerate() {
                    let r = last[i] / first[i];
                    let goal = if c.against.is_some() {
                        format!("≤ 1.2×: {}", verdict(r <= 1.2))
                    } else {
                        String::new()
                    };
                    rows.push(vec![c.label.to_owned(), format!("{r:.2}×"), goal]);
                }
            }
            report.paragraph(&format!("Flat in N: ns at N = {n1} / ns at N = {n0}."));
            report.table(&["path", "ratio", "goal"], &rows);
        }
    }
    let mut record = json!({ "by_peers": results });
    if let Some((n, alone, same, two)) = scaling {
        report.paragraph(&format!(
            "One peer on two CPUs (N = {n}, the unrestricted packet; a thread pinned to each \
             CPU, both running at once, the mean of the two): ns per packet on one CPU alone, \
             with one peer's packets on both CPUs, with two peers' packets (two counter slots)."
        ));
        report.table(
            &[
                "one CPU alone (ns)",
                "one peer, two CPUs (ns)",
                "two peers, two CPUs (ns)",
                "one peer / two peers",
            ],
            &[vec![
                f(alone, 0),
                f(same, 0),
                f(two, 0),
                format!("{:.2}×", same / two),
            ]],
        );
        report.paragraph(&format!(
            "Goal: one peer's packets on two CPUs scale like two peers' (≤ 1.1×): {}.",
            verdict(same / two <= 1.1)
        ));
        record["two_cpus"] =
            json!({ "peers": n, "alone": alone, "one_peer": same, "two_peers": two });
    }
    report.record("per_packet", record);
}

/// The remote of the one reply flow the bench records (TEST-NET-2: no generated destination).
const FLOW_REMOTE: [u8; 4] = [198, 51, 100, 1];

/// Records a live UDP flow toward `holder` from [`FLOW_REMOTE`], as the egress program would,
/// so that its slot holds a flow: its denied packets then look for the flow they answer.
fn give_a_flow(program: &mut TestProgram, holder: IpAddr) {
    let entry = program
        .maps()
        .peer(holder)
        .expect("reading the peer map")
        .unwrap_or_else(|| panic!("{holder} has no peer entry"));
    program
        .maps_mut()
        .insert_flow(&wgfence::dataplane::Flow {
            peer: holder,
            remote: IpAddr::from(FLOW_REMOTE),
            protocol: PROTO_UDP,
            peer_port: 7,
            remote_port: 9,
            value: wgfence_common::FlowValue {
                last_seen_ns: u64::MAX / 2,
                owner: entry.owner,
                state: wgfence_common::FLOW_OPEN,
                slot: entry.slot,
            },
        })
        .expect("recording a flow");
}

/// The raw IP packet of an Ethernet frame built by [`crate::packet::Packet::frame`].
pub fn ip(frame: Vec<u8>) -> Vec<u8> {
    frame.get(14..).map(<[u8]>::to_vec).unwrap_or_default()
}

pub fn run(report: &mut Report, config: &Config) {
    // The smallest state, and every peer slot and peer map entry in use.
    let states: Vec<_> = [100, wgfence_common::MAX_PEERS as usize]
        .into_iter()
        .map(|n| {
            progress(&format!("per-packet cost: generating N={n}"));
            let (_, desired) = parse_value(&gen::state(n, 1));
            let frames = test_packets(&desired);
            let frame = |label: &str| {
                frames
                    .iter()
                    .find(|(l, _, _)| *l == label)
                    .map(|(_, frame, _)| ip(frame.clone()))
                    .unwrap()
            };
            let other = desired
                .peers
                .iter()
                .filter(|p| p.policy.is_none())
                .filter_map(|p| p.address)
                .next()
                .map(|a| Packet::new(&a.to_string(), "192.0.2.1", TCP, 80).ip())
                .expect("no unrestricted peer");
            let (flow_holder, denied_udp_flow) = flow_holder(&desired);
            let packets = Packets {
                unknown: frame("unknown"),
                unrestricted: frame("unrestricted"),
                allowed: frame("allowed"),
                denied: frame("denied"),
                denied_udp: frame("denied_udp"),
                denied_udp_flow,
                flow_holder,
                other_unrestricted: other,
            };
            (n, desired, packets)
        })
        .collect();
    compare(report, &config.command, &states);
}

/// An unrestricted packet, an allowed and a denied one for the last peers of each kind.
fn test_packets(desired: &DesiredState) -> Vec<(&'static str, Vec<u8>, bool)> {
    let unrestricted = desired
        .peers
        .iter()
        .rev()
        .find(|p| p.policy.is_none())
        .expect("no unrestricted peer");
    let restricted = restricted_v4(desired)
        .next()
        .expect("no restricted peer with IPv4 rules");
    let policy: &CompiledPolicy = restricted.policy.as_deref().unwrap();
    let src = restricted
        .address
        .expect("generated peers have IPv4 addresses")
        .to_string();
    // Allowed: the first IPv4 entry's network, with its first allow's protocol and port.
    let (net, allows) = policy.entries().find(|(n, _)| n.addr().is_ipv4()).unwrap();
    let allow = allows[0];
    let (proto, port) = match allow.protocol {
        PROTO_TCP => (TCP, allow.port_lo),
        PROTO_UDP => (UDP, allow.port_lo),
        PROTO_ICMP => (ICMP, 0),
        _ => (TCP, 80),
    };
    let dst = net.addr().to_string();
    assert!(policy.permits(net.addr(), proto, (proto != ICMP).then_some(port)));
    let allowed = Packet::new(&src, &dst, proto, port).frame();
    // Denied: a destination and port the policy does not allow.
    let mut rng = Rng::new(7);
    let denied = (0..10_000)
        .map(|_| gen::destination(&mut rng, false))
        .find(|d| !policy.permits(*d, PROTO_TCP, Some(1)))
        .map(|d| Packet::new(&src, &d.to_string(), TCP, 1).frame())
        .expect("no denied destination found");
    let denied_udp = udp_denied(&mut rng, policy, &src).expect("no denied UDP destination found");
    let open_src = unrestricted.address.unwrap().to_string();
    vec![
        // The cheapest verdict (one hash lookup that misses): the floor of the harness.
        (
            "unknown",
            Packet::new("192.0.2.99", "192.0.2.1", TCP, 80).frame(),
            false,
        ),
        (
            "unrestricted",
            Packet::new(&open_src, "192.0.2.1", TCP, 80).frame(),
            true,
        ),
        ("allowed", allowed, true),
        ("denied", denied, false),
        ("denied_udp", denied_udp, false),
    ]
}

/// Restricted peers with IPv4 rules, from the last.
fn restricted_v4(desired: &DesiredState) -> impl Iterator<Item = &wgfence::state::PeerSpec> {
    desired.peers.iter().rev().filter(|p| {
        p.policy
            .as_ref()
            .is_some_and(|c| c.entries().any(|(n, _)| n.addr().is_ipv4()))
    })
}

/// The peer the bench gives a reply flow, and a UDP datagram its policy denies: the last
/// restricted peer but one whose policy denies one of the sampled destinations (the raw IP
/// packet, as the other packets).
fn flow_holder(desired: &DesiredState) -> (IpAddr, Vec<u8>) {
    let mut rng = Rng::new(7);
    restricted_v4(desired)
        .skip(1)
        .find_map(|p| {
            let addr = IpAddr::V4(p.address?);
            let packet = udp_denied(&mut rng, p.policy.as_deref()?, &addr.to_string())?;
            Some((addr, ip(packet)))
        })
        .expect("no other restricted peer denies a UDP datagram")
}

/// A UDP datagram from `src` to port 1 of a destination `policy` denies (never the bench's
/// flow remote).
fn udp_denied(rng: &mut Rng, policy: &CompiledPolicy, src: &str) -> Option<Vec<u8>> {
    (0..10_000)
        .map(|_| gen::destination(rng, false))
        .find(|d| *d != IpAddr::from(FLOW_REMOTE) && !policy.permits(*d, PROTO_UDP, Some(1)))
        .map(|d| Packet::new(src, &d.to_string(), UDP, 1).frame())
}
