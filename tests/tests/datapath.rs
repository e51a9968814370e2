//! The datapath on a real (userspace) WireGuard interface, with real traffic through the tunnel,
//! filled directly through the agent's dataplane API.

use std::{process::Stdio, thread, time::Duration};

use wgfence::{
    dataplane::Attachment,
    policy::{PortRange, Protocol, Rule},
};
use wgfence_common::{Counter, PeerEntry, UNRESTRICTED};
use wgfence_tests::{
    install_policy, ip, net,
    probe::{check_all, probe, Expect, Kind, Reach},
    topology::Gateway,
};

fn entry(policy: u32, slot: u32) -> PeerEntry {
    PeerEntry {
        policy,
        slot,
        owner: u64::from(slot) + 1,
        ..PeerEntry::default()
    }
}

#[test]
fn enforces_unknown_unrestricted_and_restricted_peers() {
    // Peer 0: restricted. Peer 1: unrestricted. Peer 2: known to WireGuard, not to the maps.
    let gw = Gateway::new(3);
    let mut dp = gw.attach();
    assert_eq!(dp.ingress_attachment(), Attachment::Created);
    let maps = dp.maps_mut();
    install_policy(
        maps,
        1,
        &[
            // A longer prefix nested in a shorter one keeps both prefixes' allowances.
            Rule::new(
                net("10.0.0.0/8"),
                Protocol::Tcp,
                vec![PortRange::single(443), PortRange::new(8000, 8100)],
            ),
            Rule::new(
                net("10.1.0.0/16"),
                Protocol::Udp,
                vec![PortRange::single(53)],
            ),
            Rule::new(net("192.0.2.0/24"), Protocol::Icmp, vec![]),
            Rule::new(
                net("fd00:1::/32"),
                Protocol::Tcp,
                vec![PortRange::single(22)],
            ),
            Rule::new(
                net("fd00:9::/32"),
                Protocol::Udp,
                vec![PortRange::new(5000, 5010)],
            ),
            Rule::new(net("2001:db8::/32"), Protocol::Icmp, vec![]),
        ],
    );
    for addr in gw.peers[0].addrs() {
        maps.upsert_peer(addr, entry(1, 0)).unwrap();
    }
    for addr in gw.peers[1].addrs() {
        maps.upsert_peer(addr, entry(UNRESTRICTED, 1)).unwrap();
    }

    let (r, o, u) = (&gw.peers[0].ns, &gw.peers[1].ns, &gw.peers[2].ns);
    let case = Expect::new;
    use Kind::{Ping, Tcp, Udp};
    use Reach::{Blocked, Reached};
    let cases = [
        // Unknown source: dropped whatever it sends.
        case("unknown", u, Tcp(443), "10.1.2.3", Blocked),
        case("unknown", u, Udp(53), "10.1.2.3", Blocked),
        case("unknown", u, Ping, "192.0.2.1", Blocked),
        case("unknown", u, Tcp(22), "fd00:1::1", Blocked),
        case("unknown", u, Ping, "2001:db8::1", Blocked),
        // Unrestricted: passes everything.
        case("open", o, Tcp(80), "10.2.3.4", Reached),
        case("open", o, Udp(9), "10.9.1.1", Reached),
        case("open", o, Ping, "10.2.3.4", Reached),
        case("open", o, Tcp(80), "fd00:9::1", Reached),
        case("open", o, Ping, "fd00:1::1", Reached),
        // Restricted, IPv4 TCP with a port range: lo, hi, hi + 1, below lo.
        case("restricted", r, Tcp(443), "10.2.3.4", Reached),
        case("restricted", r, Tcp(80), "10.2.3.4", Blocked),
        case("restricted", r, Tcp(8000), "10.2.3.4", Reached),
        case("restricted", r, Tcp(8100), "10.2.3.4", Reached),
        case("restricted", r, Tcp(8101), "10.2.3.4", Blocked),
        case("restricted", r, Tcp(7999), "10.2.3.4", Blocked),
        // Nested prefix: 10.1.0.0/16 has UDP 53 and, folded in from 10/8, TCP 443.
        case("restricted", r, Udp(53), "10.1.2.3", Reached),
        case("restricted", r, Tcp(443), "10.1.2.3", Reached),
        case("restricted", r, Udp(53), "10.2.3.4", Blocked),
        case("restricted", r, Udp(54), "10.1.2.3", Blocked),
        // ICMP only where a rule says so.
        case("restricted", r, Ping, "192.0.2.1", Reached),
        case("restricted", r, Ping, "10.2.3.4", Blocked),
        case("restricted", r, Tcp(443), "192.0.2.1", Blocked),
        // IPv6.
        case("restricted", r, Tcp(22), "fd00:1::1", Reached),
        case("restricted", r, Tcp(23), "fd00:1::1", Blocked),
        case("restricted", r, Udp(5000), "fd00:9::1", Reached),
        case("restricted", r, Udp(5010), "fd00:9::1", Reached),
        case("restricted", r, Udp(5011), "fd00:9::1", Blocked),
        case("restricted", r, Ping, "2001:db8::1", Reached),
        case("restricted", r, Ping, "fd00:1::1", Blocked),
        case("restricted", r, Tcp(22), "2001:db8::1", Blocked),
    ];
    check_all(&cases);

    // Every probe was counted under the reason that explains it (at least once: a probe is
    // one packet, retransmissions aside).
    let probes = |from: &str, expect| {
        cases
            .iter()
            .filter(|c| c.from == from && c.expect == expect)
            .count() as u64
    };
    let counters = dp.maps().counters().unwrap();
    let at_least = [
        (Counter::DropUnknownSource, probes("unknown", Blocked)),
        (Counter::PassUnrestricted, probes("open", Reached)),
        (Counter::PassPolicy, probes("restricted", Reached)),
        (Counter::DropPolicy, probes("restricted", Blocked)),
    ];
    for (counter, n) in at_least {
        assert!(
            counters.get(counter) >= n,
            "{counter:?} < {n}: {counters:?}"
        );
    }
    let restricted = dp.maps().peer_counters(0).unwrap();
    assert!(
        restricted.pass_packets >= probes("restricted", Reached)
            && restricted.drop_packets >= probes("restricted", Blocked),
        "{restricted:?}"
    );
}

/// tcp/`port` to 10.0.0.0/8.
fn web(port: u16) -> Vec<Rule> {
    vec![Rule::new(
        net("10.0.0.0/8"),
        Protocol::Tcp,
        vec![PortRange::single(port)],
    )]
}

/// Each policy entry as (policy id, its first allow's lowest port), read back from the tries.
fn policy_ports(dp: &wgfence::dataplane::Dataplane) -> Vec<(u32, u16)> {
    dp.maps()
        .policies()
        .unwrap()
        .iter()
        .map(|e| (e.policy, e.value.allows()[0].port_lo))
        .collect()
}

/// A trie made and pinned at `path` with bpftool, of the policy tries' IPv4 layout but no
/// agent's: one entry, 10.0.0.0/8 -> tcp `port`.
fn stranger_trie(path: &std::path::Path, port: u16) {
    wgfence_tests::net::run(&[
        "bpftool",
        "map",
        "create",
        &path.to_string_lossy(),
        "type",
        "lpm_trie",
        "key",
        "8",
        "value",
        "260",
        "entries",
        "16",
        "name",
        "stranger",
        "flags",
        "1",
    ]);
    let mut args: Vec<String> = ["bpftool", "map", "update", "pinned"]
        .map(str::to_owned)
        .to_vec();
    args.push(path.to_string_lossy().into_owned());
    args.extend(["key", "hex", "08", "00", "00", "00", "0a", "00", "00", "00"].map(str::to_owned));
    let mut value = vec![1u8, 0, 0, 0, 6, 0];
    value.extend(port.to_le_bytes());
    value.extend(port.to_le_bytes());
    value.resize(260, 0);
    args.extend(["value".to_owned(), "hex".to_owned()]);
    args.extend(value.iter().map(|b| format!("{b:02x}")));
    wgfence_tests::net::run(&args.iter().map(String::as_str).collect::<Vec<_>>());
}

/// Policy 1: tcp/443 to 10.0.0.0/8; policy 2: tcp/80 there; peer 0 (slot 0) on policy 1.
fn two_web_policies_peer_0_on_the_first(gw: &Gateway, dp: &mut wgfence::dataplane::Dataplane) {
    let maps = dp.maps_mut();
    install_policy(maps, 1, &web(443));
    install_policy(maps, 2, &web(80));
    for addr in gw.peers[0].addrs() {
        maps.upsert_peer(addr, entry(1, 0)).unwrap();
    }
}

/// More new policies than one batch of the array of maps takes (512 tries waiting, spares
/// included), written in one go as a cold load with a policy per peer writes them: the first
/// batch is published and pinned mid-way, before anything is flushed by hand; the rest with the
/// peer write that follows; every policy reads back from its pin and holds the peer it governs.
#[test]
fn more_new_policies_than_one_batch_are_each_published_and_enforced() {
    const POLICIES: u16 = 700;
    let gw = Gateway::new(1);
    let mut dp = gw.attach();
    let tries = dp.pin_dir().join(wgfence_common::map_names::TRIES_V4);
    let maps = dp.maps_mut();
    for id in 1..=POLICIES {
        let compiled = wgfence::policy::compile(&web(1000 + id)).expect("compiles");
        for (prefix, allows) in compiled.entries() {
            maps.upsert_policy(
                u32::from(id),
                prefix,
                &wgfence::policy::CompiledPolicy::value(allows),
            )
            .unwrap_or_else(|e| panic!("policy {id}: {e}"));
        }
    }
    assert!(
        tries.join("1").exists(),
        "the first batch was not published before the last policy was written"
    );
    assert!(
        !tries.join(POLICIES.to_string()).exists(),
        "the last batch was published before a flush"
    );

    // A peer write flushes first: the last policies are live before a peer can name them.
    let ns = &gw.peers[0].ns;
    let dst = ip("10.2.3.4");
    for (policy, allowed, denied) in [
        (1, 1001, 1000 + POLICIES),
        (POLICIES, 1000 + POLICIES, 1001),
    ] {
        for addr in gw.peers[0].addrs() {
            dp.maps_mut()
                .upsert_peer(addr, entry(u32::from(policy), 0))
                .unwrap();
        }
        assert_eq!(
            probe(ns, Kind::Tcp(allowed), dst),
            Reach::Reached,
            "policy {policy}"
        );
        assert_eq!(
            probe(ns, Kind::Tcp(denied), dst),
            Reach::Blocked,
            "policy {policy}"
        );
    }
    let read = policy_ports(&dp);
    let want: Vec<(u32, u16)> = (1..=POLICIES)
        .map(|id| (u32::from(id), 1000 + id))
        .collect();
    assert_eq!(read, want, "policies read back from their pins");
}

/// The empty tries of the policy ids nothing uses, beyond the 64 lowest free ids (the spares
/// the planner fills next), are freed: their slots handed to one shared empty trie, their pins
/// removed, the kernel frees them; every packet's verdict stays. A policy later written at
/// such an id gets a trie of its own.
#[test]
fn empty_tries_beyond_the_spares_are_freed() {
    let gw = Gateway::new(1);
    let mut dp = gw.attach();
    let tries = dp.pin_dir().join(wgfence_common::map_names::TRIES_V4);
    let pinned = || -> Vec<u32> {
        let mut ids: Vec<u32> = std::fs::read_dir(&tries)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        ids.sort_unstable();
        ids
    };
    let map_id = |id: u32| -> u64 {
        let out = wgfence_tests::net::run(&[
            "bpftool",
            "-j",
            "map",
            "show",
            "pinned",
            &tries.join(id.to_string()).to_string_lossy(),
        ]);
        let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        info["id"].as_u64().unwrap()
    };
    // Policies 1 and 200, the peer on 200: tries 1..=64 and 200..=263, the others spares.
    install_policy(dp.maps_mut(), 1, &web(443));
    install_policy(dp.maps_mut(), 200, &web(80));
    for addr in gw.peers[0].addrs() {
        dp.maps_mut().upsert_peer(addr, entry(200, 0)).unwrap();
    }
    assert_eq!(pinned().len(), 128);
    let ns = &gw.peers[0].ns;
    let dst = ip("10.2.3.4");
    assert_eq!(probe(ns, Kind::Tcp(80), dst), Reach::Reached);
    let freed: Vec<u64> = (200..=263).map(map_id).collect();
    // Pin 230 swapped for a trie of its own with an entry: not the trie its slot holds.
    let stranger = tries.join("stranger");
    stranger_trie(&stranger, 9999);
    std::fs::rename(&stranger, tries.join("230")).unwrap();
    let freed: Vec<u64> = freed.into_iter().chain([map_id(230)]).collect();

    // 2..=65 are the spares the planner fills next: 201..=263 go, the highest first, as
    // many as the budget allows a call; 230's slot too, its stale pin with it.
    let in_use = std::collections::BTreeSet::from([1, 200]);
    let writes = dp.maps().writes();
    assert_eq!(dp.maps_mut().reclaim_policy_tries(&in_use, 10).unwrap(), 10);
    assert_eq!(dp.maps().writes(), writes + 10, "a write a slot");
    assert_eq!(pinned().len(), 118);
    assert!(tries.join("201").exists() && !tries.join("263").exists());
    assert_eq!(
        dp.maps_mut().reclaim_policy_tries(&in_use, 1000).unwrap(),
        53
    );
    let mut want: Vec<u32> = (1..=64).collect();
    want.push(200);
    assert_eq!(pinned(), want);
    assert_eq!(probe(ns, Kind::Tcp(80), dst), Reach::Reached);

    // Policy 200 gone, its peer on policy 1: its emptied trie goes too.
    for addr in gw.peers[0].addrs() {
        dp.maps_mut().upsert_peer(addr, entry(1, 0)).unwrap();
    }
    assert!(dp.maps_mut().remove_policy(200, net("10.0.0.0/8")).unwrap());
    let in_use = std::collections::BTreeSet::from([1]);
    assert_eq!(
        dp.maps_mut().reclaim_policy_tries(&in_use, 1000).unwrap(),
        1
    );
    assert_eq!(pinned(), (1..=64).collect::<Vec<_>>());
    assert_eq!(
        dp.maps_mut().reclaim_policy_tries(&in_use, 1000).unwrap(),
        0
    );

    // The kernel frees a map after a grace period, off the call that dropped it.
    let alive = |id: &u64| {
        std::process::Command::new("bpftool")
            .args(["map", "show", "id", &id.to_string()])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while freed.iter().any(alive) && std::time::Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    let kept: Vec<&u64> = freed.iter().filter(|id| alive(id)).collect();
    assert!(
        kept.is_empty(),
        "tries freed but still in the kernel: {kept:?}"
    );
    assert_eq!(probe(ns, Kind::Tcp(443), dst), Reach::Reached);
    assert_eq!(probe(ns, Kind::Tcp(80), dst), Reach::Blocked);
    let read = policy_ports(&dp);
    assert_eq!(read, vec![(1, 443)]);

    // A policy written at an id given back gets a trie of its own, as in a fresh slot.
    install_policy(dp.maps_mut(), 200, &web(22));
    for addr in gw.peers[0].addrs() {
        dp.maps_mut().upsert_peer(addr, entry(200, 0)).unwrap();
    }
    assert_eq!(probe(ns, Kind::Tcp(22), dst), Reach::Reached);
    assert!(tries.join("200").exists());
}

#[test]
fn a_policy_switch_applies_to_the_next_packet() {
    let gw = Gateway::new(1);
    let mut dp = gw.attach();
    two_web_policies_peer_0_on_the_first(&gw, &mut dp);
    let ns = &gw.peers[0].ns;
    let dst = ip("10.2.3.4");
    assert_eq!(probe(ns, Kind::Tcp(443), dst), Reach::Reached);
    assert_eq!(probe(ns, Kind::Tcp(80), dst), Reach::Blocked);

    // One write per address switches the peer; the old policy's entries are still there.
    let writes = dp.maps().writes();
    dp.maps_mut()
        .upsert_peer(gw.peers[0].v4.into(), entry(2, 0))
        .unwrap();
    assert_eq!(dp.maps().writes(), writes + 1);
    assert_eq!(probe(ns, Kind::Tcp(80), dst), Reach::Reached);
    assert_eq!(probe(ns, Kind::Tcp(443), dst), Reach::Blocked);
}

#[test]
fn adopting_pinned_objects_keeps_traffic_flowing() {
    let gw = Gateway::new(1);
    let peer = &gw.peers[0];
    {
        let mut dp = gw.attach();
        for addr in peer.addrs() {
            dp.maps_mut()
                .upsert_peer(addr, entry(UNRESTRICTED, 0))
                .unwrap();
        }
        // The agent goes away: everything stays pinned and enforcing.
    }

    // 400 pings, 10 ms apart, across three reloads.
    let count = 400;
    let ping = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            peer.ns.name(),
            "ping",
            "-q",
            "-i",
            "0.01",
            "-W",
            "1",
        ])
        .args(["-c", &count.to_string(), "10.8.0.1"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("ping");
    let before = gw.attach().maps().peers().unwrap();
    for _ in 0..3 {
        thread::sleep(Duration::from_millis(700));
        let dp = gw.attach();
        assert_eq!(dp.ingress_attachment(), Attachment::Replaced);
        assert_eq!(dp.maps().peers().unwrap(), before);
    }
    let out = ping.wait_with_output().expect("ping");
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(
        summary.contains(&format!("{count} packets transmitted, {count} received")),
        "packets were lost across the reloads:\n{summary}"
    );
    // And the traffic went through the datapath, not around it.
    let maps = wgfence::dataplane::Dataplane::open_maps(&gw.bpffs, gw.interface()).unwrap();
    let counters = maps.counters().unwrap();
    assert!(
        counters.get(Counter::PassUnrestricted) >= count,
        "{counters:?}"
    );
}

/// A restart of the same agent takes over the programs the links run instead of loading and
/// verifying them again. A map pin replaced while no agent ran (those programs would enforce a
/// map nothing writes any more) makes it load its own, on the new map.
#[test]
fn a_restart_takes_over_the_running_programs_only_on_the_same_maps() {
    use wgfence::dataplane::{pin_dir, Dataplane};
    use wgfence_common::map_names;

    let gw = Gateway::new(1);
    let programs = || {
        let id = |info: Option<(u32, u32)>| info.map(|(_, program)| program);
        (
            id(Dataplane::egress_link_info(&gw.bpffs, gw.interface()).unwrap()),
            id(Dataplane::ingress_link_info(&gw.bpffs, gw.interface()).unwrap()),
        )
    };
    drop(gw.attach());
    let first = programs();
    assert!(first.0.is_some() && first.1.is_some(), "{first:?}");
    drop(gw.attach());
    assert_eq!(programs(), first, "the restart loaded the programs again");

    let stats = pin_dir(&gw.bpffs, gw.interface()).join(map_names::STATS);
    std::fs::remove_file(&stats).unwrap();
    drop(gw.attach());
    let again = programs();
    assert!(
        again.0 != first.0 && again.1 != first.1,
        "the programs on the removed map were taken over: {first:?} {again:?}"
    );
    let map = aya::maps::MapInfo::from_pin(&stats).unwrap().id();
    // The ingress program counts every verdict in it.
    if let Some(id) = again.1 {
        let info = aya::programs::loaded_programs()
            .filter_map(Result::ok)
            .find(|p| p.id() == id)
            .unwrap_or_else(|| panic!("program {id} not loaded"));
        let maps = info.map_ids().unwrap();
        assert!(
            maps.is_some_and(|maps| maps.contains(&map)),
            "program {id} does not use the pinned {}",
            map_names::STATS
        );
    }
}

/// A device recreated under the same name and index is a new device: the held links died with
/// the old one, so the check must attach again (an index comparison alone would say intact).
#[test]
fn a_device_recreated_with_the_same_index_is_attached_again() {
    use wgfence::dataplane::{AttachOptions, Check, Dataplane, DEFAULT_BPFFS};
    use wgfence_tests::net::{unique, Netns};

    /// Removes the pins, also when the test fails.
    struct Pins(String);
    impl Drop for Pins {
        fn drop(&mut self) {
            let _ = Dataplane::detach(std::path::Path::new(DEFAULT_BPFFS), &self.0);
        }
    }

    let ns = Netns::new("wgft-idx-");
    let name = unique("wgi");
    let create = |index: Option<&str>| {
        let mut args = vec!["link", "add", name.as_str()];
        if let Some(index) = index {
            args.extend(["index", index]);
        }
        args.extend(["type", "veth", "peer", "name", "other0"]);
        ns.ip(&args);
        ns.ip(&["link", "set", &name, "up"]);
    };
    create(None);
    let index = String::from_utf8_lossy(
        &ns.exec(&["cat", &format!("/sys/class/net/{name}/ifindex")])
            .stdout,
    )
    .trim()
    .to_owned();
    let options = AttachOptions::new(name.clone());
    // Before `dp`, so it drops after it: the detach waits until nothing holds the links.
    let _pins = Pins(name.clone());
    let mut dp = ns
        .enter(|| Dataplane::attach(&options))
        .unwrap_or_else(|e| panic!("{}", wgfence::error_chain(&e)));
    let intact = ns.enter(|| dp.check());
    assert!(matches!(intact, Ok(Check::Intact)), "{intact:?}");

    ns.ip(&["link", "del", &name]);
    create(Some(&index));
    let on_device = |dp: &mut Dataplane| {
        ns.enter(|| dp.programs_attached())
            .unwrap_or_else(|e| panic!("{}", wgfence::error_chain(&e)))
    };
    assert!(!on_device(&mut dp), "the new device has no program yet");
    let repaired = ns.enter(|| dp.check());
    assert!(
        matches!(
            repaired,
            Ok(Check::Repaired {
                reattached: true,
                ..
            })
        ),
        "{repaired:?}"
    );
    assert!(on_device(&mut dp), "both programs run on the new device");
}

/// A detach interrupted after renaming the pin directory away (its links still pinned, so
/// still attached) is finished by the next detach.
#[test]
fn an_interrupted_detach_is_finished_by_the_next() {
    use wgfence::dataplane::{pin_dir, AttachOptions, Dataplane, DEFAULT_BPFFS};
    use wgfence_tests::net::{unique, Netns};

    let bpffs = std::path::Path::new(DEFAULT_BPFFS);
    let ns = Netns::new("wgft-det-");
    let name = unique("wgd");
    ns.ip(&[
        "link", "add", &name, "type", "veth", "peer", "name", "other0",
    ]);
    let options = AttachOptions::new(name.clone());
    let dp = ns
        .enter(|| Dataplane::attach(&options))
        .unwrap_or_else(|e| panic!("{}", wgfence::error_chain(&e)));
    drop(dp);
    // What a detach killed right after its rename leaves behind.
    let pinned = pin_dir(bpffs, &name);
    let interrupted = pinned.with_file_name(format!("detaching-{name}-0000000001"));
    std::fs::rename(&pinned, &interrupted).unwrap();
    let detached = Dataplane::detach(bpffs, &name).unwrap();
    let left = interrupted.exists();
    if left {
        let _ = std::fs::remove_dir_all(&interrupted);
    }
    assert!(detached, "the leftover counts as something detached");
    assert!(!left, "{} is still there", interrupted.display());
}

/// `wgfence detach` while a holder of the pin directory's lock does not let go (here this test
/// process, whose dataplane is not checked): detach removes the pins, waits for the links,
/// gives up after `--timeout` with a non-zero exit naming the holder, and leaves its marker.
/// Once the holder looks (and lets go), the next detach finishes.
#[test]
fn a_detach_that_cannot_release_the_links_fails_naming_the_holder() {
    use std::process::Command;

    use wgfence::dataplane::{pin_dir, AttachOptions, Check, Dataplane, DEFAULT_BPFFS};
    use wgfence_tests::{
        agent::binary,
        net::{unique, Netns},
    };

    let bpffs = std::path::Path::new(DEFAULT_BPFFS);
    let ns = Netns::new("wgft-dto-");
    let name = unique("wgt");
    ns.ip(&[
        "link", "add", &name, "type", "veth", "peer", "name", "other0",
    ]);
    struct Pins(String);
    impl Drop for Pins {
        fn drop(&mut self) {
            let _ = Dataplane::detach(std::path::Path::new(DEFAULT_BPFFS), &self.0);
        }
    }
    let options = AttachOptions::new(name.clone());
    // Before `dp`, so it drops after it: the detach waits until nothing holds the links.
    let _pins = Pins(name.clone());
    let mut dp = ns
        .enter(|| Dataplane::attach(&options))
        .unwrap_or_else(|e| panic!("{}", wgfence::error_chain(&e)));
    let (link, _) = Dataplane::ingress_link_info(bpffs, &name)
        .ok()
        .flatten()
        .expect("no pinned link");

    let detach = || {
        Command::new(binary())
            .args(["detach", "--interface", &name, "--timeout", "1"])
            .output()
            .expect("wgfence detach")
    };
    let out = detach();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "detach succeeded: {out:?}");
    assert!(
        stderr.contains(&format!("links [{link}")) || stderr.contains(&format!(", {link}]")),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("pid {}", std::process::id())),
        "the holder is not named: {stderr}"
    );
    assert!(!pin_dir(bpffs, &name).exists());
    let markers = std::fs::read_dir(bpffs.join("wgfence"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .starts_with(&format!("detaching-{name}-"))
                })
                .count()
        })
        .unwrap_or(0);
    assert_eq!(markers, 1, "the marker is not left for the holder");

    // The holder looks, finds its directory under the marker and lets go.
    let checked = ns.enter(|| dp.check());
    assert!(matches!(checked, Ok(Check::Detached)), "{checked:?}");
    let out = detach();
    assert!(out.status.success(), "{out:?}");
    let link_show = Command::new("bpftool")
        .args(["link", "show", "id", &link.to_string()])
        .output()
        .expect("bpftool");
    assert!(!link_show.status.success(), "link {link} still exists");
}

/// A flow quota that does not match the tables (here: one flow counted as made twice, as an
/// agent killed between deleting flows and counting them, or an upgrade resumed with the old
/// double count, leaves it) is recounted when the datapath is attached again: `made - freed`
/// is the number of flows the slot holds, so the slot gets its full quota back.
#[test]
fn a_flow_quota_off_from_the_tables_is_recounted_at_the_next_attach() {
    use wgfence::dataplane::{AttachOptions, Dataplane, Flow};
    use wgfence_common::FlowValue;

    // In this order, so they drop in the reverse: the datapath, its pins, the namespace.
    let (ns, name, _pins, mut dp) = attached_to_a_veth("wgft-quota-", "wgq");
    let options = AttachOptions::new(name.clone());
    let slot = 7;
    let flow = |port| Flow {
        peer: wgfence_tests::ip("10.8.0.2"),
        remote: wgfence_tests::ip("10.1.2.3"),
        protocol: 17,
        peer_port: port,
        remote_port: 4000,
        value: FlowValue {
            slot,
            owner: 1,
            ..FlowValue::default()
        },
    };
    let maps = dp.maps_mut();
    for f in [flow(5000), flow(5001), flow(5001)] {
        maps.insert_flow(&f)
            .unwrap_or_else(|e| panic!("{}", wgfence::error_chain(&e)));
    }
    assert_eq!(
        maps.flow_quota(slot).ok(),
        Some((3, 0)),
        "the test's own setup"
    );
    drop(dp);

    let dp = ns
        .enter(|| Dataplane::attach(&options))
        .unwrap_or_else(|e| panic!("{}", wgfence::error_chain(&e)));
    let (made, freed) = dp
        .maps()
        .flow_quota(slot)
        .unwrap_or_else(|e| panic!("{}", wgfence::error_chain(&e)));
    assert_eq!(
        made.saturating_sub(freed),
        2,
        "slot {slot}: {made} made - {freed} freed for 2 flows"
    );
}

/// The code's list of pins, which the docs test holds the docs to, is what an attach pins.
#[test]
fn an_attach_pins_exactly_what_the_docs_list() {
    use wgfence::dataplane::{pin_dir, pins, DEFAULT_BPFFS};

    let (_ns, name, _pins, dp) = attached_to_a_veth("wgft-pins-", "wgp");
    let listing: Vec<String> =
        std::fs::read_dir(pin_dir(std::path::Path::new(DEFAULT_BPFFS), &name))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
    let pinned = wgfence_tests::pin_names(&listing.join("\n"));
    assert_eq!(listing.len(), pinned.len(), "{listing:?}");
    let expected: std::collections::BTreeSet<String> = pins().into_iter().collect();
    assert_eq!(pinned, expected);
    drop(dp);
}

/// Detaches the datapath of an interface when dropped, after the datapath itself.
struct Detach(String);

impl Drop for Detach {
    fn drop(&mut self) {
        let _ = wgfence::dataplane::Dataplane::detach(
            std::path::Path::new(wgfence::dataplane::DEFAULT_BPFFS),
            &self.0,
        );
    }
}

/// A veth (named `link` and a unique suffix) in a namespace of its own, with the datapath
/// attached to it. Bind the four in this order, so that they drop in the reverse one: the
/// datapath, then its pins (a detach waits until nothing holds the links), then the namespace.
fn attached_to_a_veth(
    ns_prefix: &str,
    link: &str,
) -> (net::Netns, String, Detach, wgfence::dataplane::Dataplane) {
    let ns = net::Netns::new(ns_prefix);
    let name = net::unique(link);
    ns.ip(&[
        "link", "add", &name, "type", "veth", "peer", "name", "other0",
    ]);
    let options = wgfence::dataplane::AttachOptions::new(name.clone());
    let detach = Detach(name.clone());
    let dp = ns
        .enter(|| wgfence::dataplane::Dataplane::attach(&options))
        .unwrap_or_else(|e| panic!("{}", wgfence::error_chain(&e)));
    (ns, name, detach, dp)
}

/// Map layout 4: each policy's entries are a trie of its own, pinned by its id and found by the
/// datapath through the array of maps. A trie whose pin is removed by hand keeps enforcing and
/// reads as empty until the policy is written again, which replaces it for the next packet; a
/// pin swapped for another map is never taken for the policy; a policy's last entry leaves an
/// empty trie that the next policy of that id fills in place. bpftool prints a trie's fields
/// (its BTF).
#[test]
fn each_policy_is_a_trie_of_its_own_found_through_its_pin() {
    let gw = Gateway::new(1);
    let mut dp = gw.attach();
    let tries = dp.pin_dir().join(wgfence_common::map_names::TRIES_V4);
    two_web_policies_peer_0_on_the_first(&gw, &mut dp);
    let ns = &gw.peers[0].ns;
    let dst = ip("10.2.3.4");
    assert_eq!(probe(ns, Kind::Tcp(443), dst), Reach::Reached);
    assert_eq!(probe(ns, Kind::Tcp(80), dst), Reach::Blocked);

    // bpftool names the fields of a trie's key and value.
    let out = wgfence_tests::net::run(&[
        "bpftool",
        "-j",
        "map",
        "dump",
        "pinned",
        &tries.join("1").to_string_lossy(),
    ]);
    let dump: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("bpftool -j map dump: {e}: {out:?}"));
    let formatted = &dump[0]["formatted"];
    assert_eq!(formatted["key"]["prefix_len"], 8, "{dump:#}");
    assert_eq!(
        formatted["key"]["data"]["addr"],
        serde_json::json!([10, 0, 0, 0]),
        "{dump:#}"
    );
    assert_eq!(formatted["value"]["allows"][0]["port_lo"], 443, "{dump:#}");

    // A trie's pin removed by hand: the datapath keeps the trie; the agent cannot read it.
    std::fs::remove_file(tries.join("1")).unwrap();
    assert_eq!(probe(ns, Kind::Tcp(443), dst), Reach::Reached);
    let read = policy_ports;
    assert_eq!(
        read(&dp),
        vec![(2, 80)],
        "the unpinned trie read as entries"
    );
    // Written again (other contents): a new trie replaces it for the next packet.
    install_policy(dp.maps_mut(), 1, &web(22));
    assert_eq!(probe(ns, Kind::Tcp(22), dst), Reach::Reached);
    assert_eq!(probe(ns, Kind::Tcp(443), dst), Reach::Blocked);
    assert!(tries.join("1").exists(), "the new trie is not pinned");
    assert_eq!(read(&dp), vec![(1, 22), (2, 80)]);

    // A pin swapped for another map of the same layout is not policy 2's trie.
    let other = tries.join("other");
    // It holds an entry: 10.0.0.0/8 -> tcp 9999.
    stranger_trie(&other, 9999);
    std::fs::rename(&other, tries.join("2")).unwrap();
    assert_eq!(
        read(&dp),
        vec![(1, 22)],
        "a swapped pin was read as policy 2"
    );
    for addr in gw.peers[0].addrs() {
        dp.maps_mut().upsert_peer(addr, entry(2, 0)).unwrap();
    }
    assert_eq!(probe(ns, Kind::Tcp(80), dst), Reach::Reached);

    // Policy 1's last entry goes: its trie stays, empty and pinned, for the next policy of
    // that id (an empty trie matches nothing); writing one fills it in place, without an
    // update of the array of maps.
    let writes = dp.maps().writes();
    assert!(dp.maps_mut().remove_policy(1, net("10.0.0.0/8")).unwrap());
    assert_eq!(dp.maps().writes(), writes + 1, "the entry alone");
    assert!(
        tries.join("1").exists(),
        "an empty policy's trie was unpinned"
    );
    // Deleting what is already gone is not an error.
    assert!(!dp.maps_mut().remove_policy(1, net("10.0.0.0/8")).unwrap());
    let writes = dp.maps().writes();
    install_policy(dp.maps_mut(), 1, &web(443));
    assert_eq!(dp.maps().writes(), writes + 1, "the entry alone");
    for addr in gw.peers[0].addrs() {
        dp.maps_mut().upsert_peer(addr, entry(1, 0)).unwrap();
    }
    assert_eq!(probe(ns, Kind::Tcp(443), dst), Reach::Reached);
    assert_eq!(probe(ns, Kind::Tcp(80), dst), Reach::Blocked);
}
