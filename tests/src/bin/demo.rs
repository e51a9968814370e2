//! `cargo xtask demo`: a WireGuard gateway with three peers in network namespaces, the real
//! `wgfence` agent enforcing a state file on it, real traffic, a live policy change and a live
//! revocation. Everything it creates is removed when it ends (also on failure).

use std::{
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;
use wgfence_tests::{
    agent::{binary, Agent, Layout},
    demo::{alice_rules, alice_rules_changed, state, table, CHANGED_PROBES, FIRST_PROBES},
    probe::{probe, Kind, Reach},
    topology::Gateway,
};

fn section(title: &str) {
    println!(
        "\n== {title} {}",
        "=".repeat(70usize.saturating_sub(title.len()))
    );
}

fn show(cmd: &[&str]) {
    println!("$ {}", cmd.join(" "));
    match Command::new(cmd[0]).args(&cmd[1..]).output() {
        Ok(out) => {
            print!("{}", String::from_utf8_lossy(&out.stdout));
            print!("{}", String::from_utf8_lossy(&out.stderr));
        }
        Err(e) => println!("(cannot run {}: {e})", cmd[0]),
    }
}

/// Every policy's IPv4 trie pinned under `dir` (`<policy id>` each), dumped with bpftool and
/// condensed to one line per entry (each value holds 32 allow slots, mostly empty; the full
/// dump is `cargo xtask dump`), from the key and value bytes, which bpftool prints with or
/// without BTF. The empty tries (spares for the next policy ids) are counted, not dumped.
fn policy_entries(dir: &str) {
    let mut ids: Vec<u32> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    ids.sort_unstable();
    let mut empty = Vec::new();
    for id in ids {
        let path = format!("{dir}/{id}");
        let out = Command::new("bpftool")
            .args(["-j", "map", "dump", "pinned", &path])
            .output();
        let entries: Vec<Value> = out
            .ok()
            .and_then(|o| serde_json::from_slice(&o.stdout).ok())
            .unwrap_or_default();
        if entries.is_empty() {
            empty.push(id);
            continue;
        }
        println!("$ bpftool -j map dump pinned {path}   (condensed: one line per entry)");
        let bytes = |v: &Value| -> Vec<u8> {
            v.as_array()
                .into_iter()
                .flatten()
                .filter_map(|b| u8::from_str_radix(b.as_str()?.trim_start_matches("0x"), 16).ok())
                .collect()
        };
        let u16_at = |b: &[u8], i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        for e in entries {
            let (key, value) = (bytes(&e["key"]), bytes(&e["value"]));
            if key.len() < 8 || value.len() < 4 {
                continue;
            }
            let prefix_len = u32::from_le_bytes([key[0], key[1], key[2], key[3]]);
            let count = u32::from_le_bytes([value[0], value[1], value[2], value[3]]) as usize;
            let allows: Vec<String> = value[4..]
                .chunks_exact(8)
                .take(count)
                .map(|a| {
                    format!(
                        "proto {} ports {}-{} rule {}",
                        a[0],
                        u16_at(a, 2),
                        u16_at(a, 4),
                        u16_at(a, 6)
                    )
                })
                .collect();
            println!(
                "  {}.{}.{}.{}/{prefix_len}  [{}]",
                key[4],
                key[5],
                key[6],
                key[7],
                allows.join(", ")
            );
        }
    }
    if !empty.is_empty() {
        println!(
            "({} empty tries not shown, ids {}: spares that the next policies fill in place)",
            empty.len(),
            id_ranges(&empty)
        );
    }
}

/// Sorted ids as ranges: `1, 3-64`.
fn id_ranges(ids: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut run: Option<(u32, u32)> = None;
    for &id in ids {
        run = match run {
            Some((lo, hi)) if hi + 1 == id => Some((lo, id)),
            Some(done) => {
                out.push(range(done));
                Some((id, id))
            }
            None => Some((id, id)),
        };
    }
    out.extend(run.map(range));
    out.join(", ")
}

fn range((lo, hi): (u32, u32)) -> String {
    if lo == hi {
        lo.to_string()
    } else {
        format!("{lo}-{hi}")
    }
}

fn main() {
    println!("wgfence demo: a WireGuard gateway (wireguard-go) with three peers, each in its own");
    println!("network namespace; the node runs `wgfence run` on its WireGuard interface.");
    println!("agent binary: {}", binary().display());

    section("building the sandbox");
    let gw = Gateway::new(3);
    println!(
        "node namespace {} with WireGuard interface {}; peers alice, bob, carol have sessions",
        gw.node.name(),
        gw.interface()
    );
    let s1 = state(&gw, alice_rules(), true);
    let agent = Agent::start(&gw, Layout::Kubernetes, &s1, &[]);
    agent.wait_ready(&gw);
    println!(
        "state file {} (a Kubernetes-style volume):",
        agent.state.display()
    );
    match serde_json::from_str::<Value>(&s1).and_then(|v| serde_json::to_string_pretty(&v)) {
        Ok(pretty) => println!("{pretty}"),
        Err(_) => println!("{s1}"),
    }

    section("traffic from each peer");
    use Kind::{Ping, Tcp, Udp};
    use Reach::{Blocked as D, Reached as A};
    table(&gw, &FIRST_PROBES);

    section("replies: the node reaches alice, alice cannot reach the node");
    println!("alice's rules do not allow the node (10.8.0.1); what the node starts still gets its");
    println!("replies (the egress program records the flow, the ingress program lets its answers");
    println!("through), while alice's own attempts are dropped:");
    for (from, ns, kind, dst, expect) in [
        ("node", &gw.node, Tcp(22), "10.8.0.2", A),
        ("node", &gw.node, Udp(161), "10.8.0.2", A),
        ("node", &gw.node, Ping, "fd00:8::2", A),
        ("alice", &gw.peers[0].ns, Tcp(22), "10.8.0.1", D),
        ("alice", &gw.peers[0].ns, Ping, "fd00:8::1", D),
    ] {
        let got = probe(ns, kind, dst.parse().unwrap());
        let word = |r: Reach| if r == A { "answered" } else { "dropped" };
        println!(
            "  {from:<6} {:<9} -> {dst:<10} {:<9} (expected {})",
            kind.to_string(),
            word(got),
            word(expect)
        );
        assert_eq!(got, expect, "{from} {kind} -> {dst}");
    }
    let dir = gw.bpffs.join("wgfence").join(gw.interface());
    show(&[
        "bpftool",
        "map",
        "dump",
        "pinned",
        &format!("{}/wgf4_flows_v4", dir.display()),
    ]);

    section("why was it dropped: wgfence monitor");
    let wgfence = binary().to_string_lossy().into_owned();
    println!("$ wgfence monitor --interface {} --count 3", gw.interface());
    let mut monitor = Command::new(&wgfence)
        .args(["monitor", "--interface", gw.interface(), "--count", "3"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("wgfence monitor");
    std::thread::sleep(Duration::from_millis(300));
    for (i, kind, dst) in [
        (0, Tcp(80), "10.2.3.4"),
        (2, Tcp(443), "10.1.2.3"),
        (0, Ping, "10.2.3.4"),
    ] {
        let _ = probe(&gw.peers[i].ns, kind, dst.parse().unwrap());
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline && matches!(monitor.try_wait(), Ok(None)) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = monitor.kill();
    match monitor.wait_with_output() {
        Ok(out) => print!("{}", String::from_utf8_lossy(&out.stdout)),
        Err(e) => println!("(monitor failed: {e})"),
    }

    section("wgfence status");
    let status = wgfence;
    show(&[&status, "status", "--interface", gw.interface()]);

    section("the maps, as bpftool shows them");
    let dir = gw.bpffs.join("wgfence").join(gw.interface());
    let dir = dir.to_string_lossy().into_owned();
    show(&["ls", "-l", &dir]);
    show(&[
        "bpftool",
        "map",
        "dump",
        "pinned",
        &format!("{dir}/wgf4_peers_v4"),
    ]);
    show(&[
        "bpftool",
        "map",
        "dump",
        "pinned",
        &format!("{dir}/wgf4_tries_v4/1"),
    ]);
    policy_entries(&format!("{dir}/wgf4_tries_v4"));
    show(&[
        "bpftool",
        "link",
        "show",
        "pinned",
        &format!("{dir}/link_ingress"),
    ]);

    section("wg show");
    show(&["wg", "show", gw.interface()]);

    section("live policy change: alice may now reach tcp/80");
    let writes = agent.metric(&gw, "wgfence_bpf_map_writes_total");
    let before = agent.reconciles(&gw);
    let alice_more = alice_rules_changed();
    agent.write_state(&state(&gw, alice_more.clone(), true));
    agent.wait_reconciles(&gw, before, 1.0);
    println!(
        "applied with {} map writes (the new policy's entries, into a trie already in place; one switch per address; the old entries' deletion)",
        agent.metric(&gw, "wgfence_bpf_map_writes_total") - writes
    );
    table(&gw, &CHANGED_PROBES);

    section("live revocation: carol is removed from the state file");
    // Carol probes back to back (an answered probe returns in about a millisecond); the
    // revocation lies between her last answered probe and the first unanswered one.
    let carol = &gw.peers[2].ns;
    let dst = "10.1.2.3".parse().unwrap();
    let start = Instant::now();
    agent.write_state(&state(&gw, alice_more, false));
    let mut last_answered = None;
    let first_dropped = loop {
        let sent = start.elapsed();
        if probe(carol, Udp(53), dst) == Reach::Blocked {
            break sent;
        }
        last_answered = Some(sent);
        assert!(
            sent < Duration::from_secs(5),
            "carol was not revoked within 5 s"
        );
    };
    println!(
        "carol's last answered probe was sent {} ms after the state file changed; the first \
         dropped one {} ms after",
        last_answered.map_or(0, |t| t.as_millis()),
        first_dropped.as_millis()
    );
    show(&["wg", "show", gw.interface(), "peers"]);
    table(
        &gw,
        &[
            ("carol", 2, Udp(53), "10.1.2.3", D),
            ("alice", 0, Tcp(443), "10.2.3.4", A),
        ],
    );

    section("metrics (excerpt)");
    if let Some((_, body)) = agent.get(&gw, "/metrics") {
        for line in body.lines().filter(|l| {
            l.starts_with("wgfence_")
                && !l.contains("_bucket")
                && !l.starts_with("wgfence_reconcile_duration")
        }) {
            println!("  {line}");
        }
    }

    section("done");
    drop(agent);
    drop(gw);
    println!("The sandbox is removed (namespaces, wireguard-go, pins).");
    println!();
    println!("To enforce a state file on a real WireGuard interface (as root, bpffs mounted):");
    println!("  wgfence check --state /etc/wgfence/state.json");
    println!("  wgfence plan  --interface wg0 --state /etc/wgfence/state.json");
    println!("  wgfence run   --interface wg0 --state /etc/wgfence/state.json");
    println!("or `cargo xtask run -- run --interface wg0 --state /etc/wgfence/state.json`;");
    println!(
        "`wgfence status --interface wg0` shows what is enforced, `wgfence detach` removes it."
    );
}
