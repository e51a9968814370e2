//! Header parsing of the loaded datapath, on crafted packets run with `BPF_PROG_TEST_RUN`:
//! every verdict is checked together with the counter that explains it.

use wgfence::{
    dataplane::TestProgram,
    policy::{PortRange, Protocol, Rule},
};
use wgfence_common::{Counter, PeerEntry, UNRESTRICTED};
use wgfence_tests::{
    install_policy, ip, net,
    packet::{Ext, Packet, ICMP, ICMPV6, TCP, UDP},
    require_root,
};

const RESTRICTED_V4: &str = "10.8.0.2";
const RESTRICTED_V6: &str = "fd00:8::2";
const OPEN_V4: &str = "10.8.0.3";
const OPEN_V6: &str = "fd00:8::3";
const RESTRICTED_SLOT: u32 = 5;
const POLICY: u32 = 1;

fn program() -> TestProgram {
    require_root();
    let mut program = TestProgram::load()
        .unwrap_or_else(|e| panic!("loading the datapath: {}", wgfence::error_chain(&e)));
    let maps = program.maps_mut();
    let rules = [
        Rule::new(
            net("10.0.0.0/8"),
            Protocol::Tcp,
            vec![PortRange::single(443), PortRange::new(8000, 8100)],
        ),
        Rule::new(net("10.9.0.0/16"), Protocol::Udp, vec![]),
        Rule::new(net("0.0.0.0/0"), Protocol::Icmp, vec![]),
        Rule::new(
            net("fd00:1::/32"),
            Protocol::Tcp,
            vec![PortRange::single(22)],
        ),
        Rule::new(net("fd00:9::/32"), Protocol::Udp, vec![]),
        Rule::new(net("::/0"), Protocol::Icmp, vec![]),
        Rule::new(net("fd00:a::/32"), Protocol::Any, vec![]),
    ];
    install_policy(maps, POLICY, &rules);
    let restricted = PeerEntry {
        policy: POLICY,
        slot: RESTRICTED_SLOT,
        owner: 1,
        ..PeerEntry::default()
    };
    let open = PeerEntry {
        policy: UNRESTRICTED,
        slot: 6,
        owner: 2,
        ..PeerEntry::default()
    };
    for (addr, entry) in [
        (RESTRICTED_V4, restricted),
        (RESTRICTED_V6, restricted),
        (OPEN_V4, open),
        (OPEN_V6, open),
    ] {
        maps.upsert_peer(ip(addr), entry)
            .unwrap_or_else(|e| panic!("{addr}: {e}"));
    }
    program
}

/// Runs `frame` and asserts the verdict and that exactly `counter` counted it.
#[track_caller]
fn expect(program: &mut TestProgram, frame: &[u8], counter: Counter) {
    let before = program.maps().counters().unwrap();
    let run = program
        .run(frame)
        .unwrap_or_else(|e| panic!("test run of {} bytes: {e}", frame.len()));
    let after = program.maps().counters().unwrap();
    assert_eq!(
        run.passed(),
        counter.is_pass(),
        "expected {counter:?}, program returned {}",
        run.retval
    );
    for c in Counter::ALL {
        let delta = after.get(c) - before.get(c);
        let want = u64::from(c == counter);
        assert_eq!(
            delta, want,
            "counter {c:?} moved by {delta}, expected {counter:?}"
        );
    }
}

#[test]
fn unknown_sources_are_dropped() {
    let mut p = program();
    expect(
        &mut p,
        &Packet::new("10.8.0.99", "10.0.0.1", TCP, 443).frame(),
        Counter::DropUnknownSource,
    );
    expect(
        &mut p,
        &Packet::new("fd00:8::99", "fd00:1::1", TCP, 22).frame(),
        Counter::DropUnknownSource,
    );
}

#[test]
fn unrestricted_peers_pass_everything() {
    let mut p = program();
    expect(
        &mut p,
        &Packet::new(OPEN_V4, "192.0.2.1", TCP, 25).frame(),
        Counter::PassUnrestricted,
    );
    expect(
        &mut p,
        &Packet::new(OPEN_V6, "2001:db8::1", UDP, 9).frame(),
        Counter::PassUnrestricted,
    );
    // Even a chain longer than the walk: an unrestricted peer's packets are not parsed.
    let mut long = Packet::new(OPEN_V6, "2001:db8::1", TCP, 80);
    for _ in 0..12 {
        long = long.ext(Ext::DestinationOptions);
    }
    expect(&mut p, &long.frame(), Counter::PassUnrestricted);
}

#[test]
fn port_range_boundaries() {
    let mut p = program();
    for (port, counter) in [
        (443, Counter::PassPolicy),
        (442, Counter::DropPolicy),
        (444, Counter::DropPolicy),
        (7999, Counter::DropPolicy),
        (8000, Counter::PassPolicy),
        (8100, Counter::PassPolicy),
        (8101, Counter::DropPolicy),
    ] {
        expect(
            &mut p,
            &Packet::new(RESTRICTED_V4, "10.2.3.4", TCP, port).frame(),
            counter,
        );
    }
    // Right port, wrong protocol; right port, destination outside the prefix.
    expect(
        &mut p,
        &Packet::new(RESTRICTED_V4, "10.2.3.4", UDP, 443).frame(),
        Counter::DropPolicy,
    );
    expect(
        &mut p,
        &Packet::new(RESTRICTED_V4, "192.0.2.1", TCP, 443).frame(),
        Counter::DropPolicy,
    );
    // ICMP is allowed everywhere, per family.
    expect(
        &mut p,
        &Packet::new(RESTRICTED_V4, "192.0.2.1", ICMP, 0).frame(),
        Counter::PassPolicy,
    );
    expect(
        &mut p,
        &Packet::new(RESTRICTED_V6, "2001:db8::1", ICMPV6, 0).frame(),
        Counter::PassPolicy,
    );
}

#[test]
fn ipv4_options_are_skipped() {
    let mut p = program();
    for words in [1, 3, 10] {
        let allowed = Packet::new(RESTRICTED_V4, "10.2.3.4", TCP, 443).options(words);
        expect(&mut p, &allowed.frame(), Counter::PassPolicy);
        let denied = Packet::new(RESTRICTED_V4, "10.2.3.4", TCP, 80).options(words);
        expect(&mut p, &denied.frame(), Counter::DropPolicy);
    }
}

#[test]
fn malformed_ipv4_headers_are_dropped() {
    let mut p = program();
    // IHL below the minimum.
    let mut frame = Packet::new(RESTRICTED_V4, "10.2.3.4", TCP, 443).frame();
    frame[14] = 0x44;
    expect(&mut p, &frame, Counter::DropMalformed);
    // Transport header cut short: the port cannot be read.
    let short = Packet::new(RESTRICTED_V4, "10.2.3.4", TCP, 443).transport_len(3);
    expect(&mut p, &short.frame(), Counter::DropMalformed);
    // IP header cut short. The kernel refuses an IPv4 frame with a short header under
    // BPF_PROG_TEST_RUN, so the frame claims another ethertype; the datapath does not read it.
    let mut frame = Packet::new(RESTRICTED_V4, "10.2.3.4", TCP, 443).frame();
    frame[12..14].copy_from_slice(&0x88b5u16.to_be_bytes());
    for len in [15, 20, 14 + 19] {
        expect(&mut p, &frame[..len], Counter::DropMalformed);
    }
    // Neither IPv4 nor IPv6.
    let mut frame = Packet::new(RESTRICTED_V4, "10.2.3.4", TCP, 443).frame();
    frame[14] = 0x55;
    expect(&mut p, &frame, Counter::DropNotIp);
}

#[test]
fn ipv4_fragments() {
    let mut p = program();
    // The first fragment carries the port.
    let first = Packet::new(RESTRICTED_V4, "10.2.3.4", TCP, 443).fragment(0, true);
    expect(&mut p, &first.frame(), Counter::PassPolicy);
    // A later fragment has no port: a port rule cannot match it ...
    let later = Packet::new(RESTRICTED_V4, "10.2.3.4", TCP, 443).fragment(185, false);
    expect(&mut p, &later.frame(), Counter::DropPolicy);
    // ... a port-less rule can.
    let later = Packet::new(RESTRICTED_V4, "10.9.1.1", UDP, 53).fragment(185, true);
    expect(&mut p, &later.frame(), Counter::PassPolicy);
}

#[test]
fn ipv6_extension_headers_are_walked() {
    let mut p = program();
    let chain = [
        Ext::HopByHop,
        Ext::DestinationOptions,
        Ext::Routing,
        Ext::Authentication,
    ];
    let mut allowed = Packet::new(RESTRICTED_V6, "fd00:1::1", TCP, 22);
    let mut denied = Packet::new(RESTRICTED_V6, "fd00:1::1", TCP, 23);
    for ext in chain {
        allowed = allowed.ext(ext);
        denied = denied.ext(ext);
    }
    expect(&mut p, &allowed.frame(), Counter::PassPolicy);
    expect(&mut p, &denied.frame(), Counter::DropPolicy);
}

#[test]
fn ipv6_header_chain_longer_than_the_walk_fails_closed() {
    let mut p = program();
    let bound = wgfence_common::MAX_IPV6_EXT_HEADERS;
    let mut at_bound = Packet::new(RESTRICTED_V6, "fd00:1::1", TCP, 22);
    for _ in 0..bound {
        at_bound = at_bound.ext(Ext::DestinationOptions);
    }
    expect(&mut p, &at_bound.frame(), Counter::PassPolicy);
    let over = at_bound.ext(Ext::DestinationOptions);
    expect(&mut p, &over.frame(), Counter::DropHeaderChain);
}

#[test]
fn ipv6_fragments() {
    let mut p = program();
    let first = Packet::new(RESTRICTED_V6, "fd00:1::1", TCP, 22).ext(Ext::Fragment {
        offset: 0,
        more: true,
    });
    expect(&mut p, &first.frame(), Counter::PassPolicy);
    let later = Packet::new(RESTRICTED_V6, "fd00:1::1", TCP, 22).ext(Ext::Fragment {
        offset: 100,
        more: false,
    });
    expect(&mut p, &later.frame(), Counter::DropPolicy);
    // Issue 11 item 8: a later fragment's next header is the sender's word (it need not be the
    // first fragment's), so it matches only rules for every protocol: not the all-ports UDP
    // rule of fd00:9::/32, not the ICMPv6 rule every destination has.
    let later_portless = Packet::new(RESTRICTED_V6, "fd00:9::1", UDP, 53).ext(Ext::Fragment {
        offset: 100,
        more: true,
    });
    expect(&mut p, &later_portless.frame(), Counter::DropPolicy);
    let later_claims_icmp = Packet::new(RESTRICTED_V6, "fd00:1::1", ICMPV6, 0).ext(Ext::Fragment {
        offset: 100,
        more: false,
    });
    expect(&mut p, &later_claims_icmp.frame(), Counter::DropPolicy);
    // A rule for every protocol takes later fragments, whatever they claim.
    for protocol in [TCP, UDP, ICMPV6, 59] {
        let later = Packet::new(RESTRICTED_V6, "fd00:a::1", protocol, 443).ext(Ext::Fragment {
            offset: 100,
            more: true,
        });
        expect(&mut p, &later.frame(), Counter::PassPolicy);
    }
    // The first fragment still names its protocol and port.
    let first_udp = Packet::new(RESTRICTED_V6, "fd00:9::1", UDP, 53).ext(Ext::Fragment {
        offset: 0,
        more: true,
    });
    expect(&mut p, &first_udp.frame(), Counter::PassPolicy);
}

#[test]
fn malformed_ipv6_headers_are_dropped() {
    let mut p = program();
    // An extension header that runs past the end of the packet.
    let frame = Packet::new(RESTRICTED_V6, "fd00:1::1", TCP, 22)
        .ext(Ext::HopByHop)
        .transport_len(0)
        .frame();
    let cut = &frame[..14 + 40 + 1];
    expect(&mut p, cut, Counter::DropMalformed);
    let short = Packet::new(RESTRICTED_V6, "fd00:1::1", TCP, 22).transport_len(2);
    expect(&mut p, &short.frame(), Counter::DropMalformed);
}

#[test]
fn arp_passes_on_ethernet_framed_devices() {
    let mut p = program();
    let mut frame = vec![0xff; 6];
    frame.extend([0x02, 0, 0, 0, 0, 1, 0x08, 0x06]);
    frame.extend([0, 1, 8, 0, 6, 4, 0, 1]); // ARP request header
    frame.extend([0u8; 20]);
    expect(&mut p, &frame, Counter::PassArp);
}

#[test]
fn per_peer_counters_count_packets_and_bytes() {
    let mut p = program();
    let pass = Packet::new(RESTRICTED_V4, "10.2.3.4", TCP, 443).frame();
    let drop = Packet::new(RESTRICTED_V6, "fd00:1::1", TCP, 80).frame();
    for _ in 0..3 {
        expect(&mut p, &pass, Counter::PassPolicy);
    }
    expect(&mut p, &drop, Counter::DropPolicy);
    let c = p.maps().peer_counters(RESTRICTED_SLOT).unwrap();
    assert_eq!(c.pass_packets, 3);
    assert_eq!(c.pass_bytes, 3 * pass.len() as u64);
    assert_eq!(c.drop_packets, 1);
    assert_eq!(c.drop_bytes, drop.len() as u64);
}

#[test]
fn per_peer_counters_are_summed_over_cpus_and_reset_on_every_cpu() {
    if wgfence::settings::online_cpus() < 2 {
        eprintln!("skipped: needs two CPUs");
        return;
    }
    let mut p = program();
    let pass = Packet::new(RESTRICTED_V4, "10.2.3.4", TCP, 443).frame();
    // One peer's packets on two CPUs: each CPU counts in its own copy.
    for (cpu, n) in [(0, 2u64), (1, 3)] {
        wgfence_tests::pin_to_cpu(cpu);
        for _ in 0..n {
            expect(&mut p, &pass, Counter::PassPolicy);
        }
    }
    let c = p.maps().peer_counters(RESTRICTED_SLOT).unwrap();
    assert_eq!(c.pass_packets, 5);
    assert_eq!(c.pass_bytes, 5 * pass.len() as u64);
    // A slot given to a new peer starts from zero on every CPU.
    p.maps_mut().reset_peer_counters(RESTRICTED_SLOT).unwrap();
    let c = p.maps().peer_counters(RESTRICTED_SLOT).unwrap();
    assert_eq!(c, wgfence_common::PeerCounters::default());
    wgfence_tests::pin_to_cpu(1);
    expect(&mut p, &pass, Counter::PassPolicy);
    let c = p.maps().peer_counters(RESTRICTED_SLOT).unwrap();
    assert_eq!((c.pass_packets, c.pass_bytes), (1, pass.len() as u64));
}

#[test]
fn the_l3_variant_has_no_arp_check() {
    // On a device without a link layer, bytes 12-13 are the middle of the IPv4 header (here
    // the first half of the source address, 8.6.x.x): an unknown source, never ARP.
    require_root();
    let mut p =
        TestProgram::load_variant(wgfence_common::VARIANT_L3).expect("loading the L3 variant");
    let ip = Packet::new("8.6.0.1", "10.2.3.4", TCP, 443).ip();
    assert_eq!(&ip[12..14], &[8, 6]);
    expect(&mut p, &ip, Counter::DropUnknownSource);
}
