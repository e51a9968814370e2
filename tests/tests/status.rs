//! What an operator reads at 3 a.m.: `wgfence status` and `wgfence status --json` against a
//! live agent with real traffic, `wgfence detach`, the metrics, and that docs/operations.md
//! and the alerts in deploy/ describe exactly what the agent exports.
//!
//! `status` runs in the host's network namespace, as `kubectl exec` into the hostNetwork pod
//! would: it reads only the pins in bpffs and the snapshot under /run/wgfence.

use std::{
    collections::BTreeSet,
    path::Path,
    process::{Command, Output},
};

use serde::Deserialize as _;
use serde_json::{json, Value};
use wgfence_tests::{
    agent::{binary, Agent, Layout},
    ip,
    probe::{probe, Kind, Reach},
    state,
    topology::Gateway,
};

fn web_only() -> Value {
    json!([{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443] }])
}

fn repo_file(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

/// `wgfence status --interface IF [args]`.
fn status(gw: &Gateway, args: &[&str]) -> Output {
    Command::new(binary())
        .args(["status", "--interface", gw.interface()])
        .args(args)
        .output()
        .expect("running wgfence status")
}

fn status_text(gw: &Gateway) -> String {
    let out = status(gw, &[]);
    assert!(
        out.status.success(),
        "wgfence status failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn status_json(gw: &Gateway) -> Value {
    let out = status(gw, &["--json"]);
    assert!(
        out.status.success(),
        "wgfence status --json failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "wgfence status --json is not JSON ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn peer<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["peerCounters"]
        .as_array()
        .and_then(|peers| peers.iter().find(|p| p["peer"] == name))
        .unwrap_or_else(|| panic!("no peer {name} in {report:#}"))
}

fn count(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("{v} is not a counter"))
}

/// Sends `n` probes and checks each was passed or dropped as expected.
fn traffic(gw: &Gateway, peer: usize, kind: Kind, dst: &str, expect: Reach, n: usize) {
    for _ in 0..n {
        assert_eq!(
            probe(&gw.peers[peer].ns, kind, ip(dst)),
            expect,
            "{kind} to {dst}"
        );
    }
}

#[test]
fn status_reports_the_datapath_the_agent_and_per_peer_counters() {
    let gw = Gateway::new(2);
    let s = state(vec![
        gw.peer_json(0, Some(web_only())),
        gw.peer_json(1, None),
    ]);
    let agent = Agent::start(&gw, Layout::Plain, &s, &[]);
    agent.wait_ready(&gw);

    let before = status_json(&gw);
    assert_eq!(before["schemaVersion"], 1);
    assert_eq!(before["interface"], gw.interface());
    assert_eq!(before["attached"], true);
    assert_eq!(before["layoutVersion"], wgfence_common::LAYOUT_VERSION);
    // wireguard-go's TUN device has no link layer: the L3 variant runs there.
    assert_eq!(before["programVariant"], "l3", "{before:#}");
    let pin_dir = gw.bpffs.join("wgfence").join(gw.interface());
    assert_eq!(before["pinDir"], pin_dir.to_string_lossy().as_ref());
    assert_eq!(
        before["peers"],
        json!({ "ipv4Entries": 2, "ipv6Entries": 2, "restricted": 1, "unrestricted": 1 })
    );
    assert_eq!(before["policies"], 1);
    assert_eq!(before["policyEntries"], 1);
    let a = &before["agent"];
    assert_eq!(a["ready"], true, "{before:#}");
    assert!(a["reason"].is_null(), "{before:#}");
    assert_eq!(a["interface"], gw.interface());
    assert_eq!(a["stateFile"], agent.state.to_string_lossy().as_ref());
    assert_eq!(
        (a["peers"].clone(), a["restrictedPeers"].clone()),
        (json!(2), json!(1))
    );
    assert!(count(&a["pid"]) > 0);
    let last = &a["lastReconcile"];
    assert_eq!(last["ok"], true, "{before:#}");
    assert!(last["error"].is_null());
    assert!(count(&last["at"]) > 1_700_000_000, "{last}");
    // The first apply of this state: both peers' entries and WireGuard peers... or, when the
    // resync already ran, nothing; either way the numbers are consistent: an operation is at
    // most one map write, and a policy whose slot held no trie adds the slots its new trie and
    // its spares take in the array of maps (65 at most).
    assert!(
        count(&last["mapWrites"]) <= count(&last["ops"]) + 65,
        "{last}"
    );

    // The link the report names is the pinned one, as bpftool sees it.
    let link_id = count(&before["linkId"]);
    // The egress link (reply flows) is reported too, and is another link.
    let egress_link_id = count(&before["egressLinkId"]);
    assert!(
        egress_link_id > 0 && egress_link_id != link_id,
        "{before:#}"
    );
    let program_id = count(&before["programId"]);
    let link = pin_dir.join("link_ingress");
    let out = Command::new("bpftool")
        .args(["-j", "link", "show", "pinned"])
        .arg(&link)
        .output()
        .expect("bpftool");
    let shown: Value = serde_json::from_slice(&out.stdout).expect("bpftool -j link show");
    assert_eq!(
        (count(&shown["id"]), count(&shown["prog_id"])),
        (link_id, program_id)
    );

    // Traffic: peer 0 is allowed tcp/443 into 10/8 and nothing else; peer 1 anything.
    traffic(&gw, 0, Kind::Tcp(443), "10.2.3.4", Reach::Reached, 3);
    traffic(&gw, 0, Kind::Tcp(80), "10.2.3.4", Reach::Blocked, 2);
    traffic(&gw, 0, Kind::Tcp(443), "fd00:1::1", Reach::Blocked, 1);
    traffic(&gw, 1, Kind::Udp(53), "10.1.2.3", Reach::Reached, 2);
    let after = status_json(&gw);

    let delta = |field: &str, peer_name: &str| {
        count(&peer(&after, peer_name)[field]) - count(&peer(&before, peer_name)[field])
    };
    // A TCP handshake that reaches the node is at least its SYN; a blocked one is at least
    // one SYN per probe (IPv4 and IPv6 addresses count in the same slot).
    assert!(delta("passPackets", "peer0") >= 3, "{after:#}");
    assert!(delta("dropPackets", "peer0") >= 3, "{after:#}");
    assert!(delta("passBytes", "peer0") >= 3 * 40, "{after:#}");
    assert!(delta("dropBytes", "peer0") >= 3 * 40, "{after:#}");
    assert!(delta("passPackets", "peer1") >= 2, "{after:#}");
    assert_eq!(delta("dropPackets", "peer1"), 0, "{after:#}");
    let p0 = peer(&after, "peer0");
    let addresses: BTreeSet<String> = p0["addresses"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(str::to_owned))
                .collect()
        })
        .expect("peer0 has addresses");
    let expected: BTreeSet<String> = gw.peers[0]
        .addrs()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(addresses, expected);
    assert_ne!(p0["policy"], 0, "peer0 is restricted");
    assert_eq!(peer(&after, "peer1")["policy"], 0, "peer1 is unrestricted");

    // By reason, and the totals by verdict.
    let reason =
        |section: &str, name: &str| count(&after[section][name]) - count(&before[section][name]);
    assert!(reason("dropped", "policy_denied") >= 3, "{after:#}");
    assert!(reason("passed", "policy") >= 3, "{after:#}");
    assert!(reason("passed", "unrestricted") >= 2, "{after:#}");
    for quiet in ["unknown_source", "malformed", "not_ip", "header_chain"] {
        assert_eq!(reason("dropped", quiet), 0, "{quiet}: {after:#}");
    }
    let total = |verdict: &str, section: &str| {
        let by_reason: u64 = after[section]
            .as_object()
            .map(|m| m.values().map(count).sum())
            .unwrap_or_else(|| panic!("no {section} object: {after:#}"));
        assert_eq!(count(&after["packets"][verdict]), by_reason, "{after:#}");
    };
    total("pass", "passed");
    total("drop", "dropped");

    // The human summary says the same.
    let text = status_text(&gw);
    let after = status_json(&gw);
    let expect_lines = [
        format!("interface        {}", gw.interface()),
        format!(
            "datapath         attached (layout v{}, l3 programs, pins in {})",
            wgfence_common::LAYOUT_VERSION,
            pin_dir.display()
        ),
        format!(
            "link             id {link_id}, program id {program_id} (bpftool link show id {link_id})"
        ),
        format!("state file       {}", agent.state.display()),
        "peers            2 IPv4 + 2 IPv6 entries; 1 restricted, 1 unrestricted".to_owned(),
        "policies         1 distinct, 1 trie entries".to_owned(),
    ];
    for line in &expect_lines {
        assert!(
            text.lines().any(|l| l == line),
            "no line {line:?} in:\n{text}"
        );
    }
    let agent_line = format!(
        "agent            pid {}, ready",
        count(&after["agent"]["pid"])
    );
    assert!(text.contains(&agent_line), "no {agent_line:?} in:\n{text}");
    assert!(text.contains("last reconcile   ok, "), "{text}");
    assert!(
        text.lines().any(|l| l.starts_with("dropped ")
            && l.contains(&format!(
                "policy_denied={}",
                count(&after["dropped"]["policy_denied"])
            ))),
        "{text}"
    );
    for (name, policy) in [("peer0", "1"), ("peer1", "-")] {
        let p = peer(&after, name);
        let addrs: Vec<&str> = p["addresses"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_else(|| panic!("{name} has no addresses: {after:#}"));
        let row: Vec<String> = text
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no row for {name} in:\n{text}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        let policy = if policy == "1" {
            p["policy"].to_string()
        } else {
            policy.to_owned()
        };
        assert_eq!(
            row,
            [
                name.to_owned(),
                addrs.join(","),
                policy,
                count(&p["passPackets"]).to_string(),
                count(&p["dropPackets"]).to_string(),
                // MODE, WOULD-DROP (only for audited peers), WINDOW: none here.
                "enforce".to_owned(),
                "-".to_owned(),
                "-".to_owned(),
            ],
            "{text}"
        );
    }

    // --state names peers from another file (e.g. the one about to be applied).
    let renamed = agent.dir.join("renamed.json");
    let mut other = gw.peer_json(0, Some(web_only()));
    other["name"] = json!("alice-renamed");
    std::fs::write(&renamed, state(vec![other]))
        .unwrap_or_else(|e| panic!("{}: {e}", renamed.display()));
    let out = status(&gw, &["--json", "--state", &renamed.to_string_lossy()]);
    let named: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(peer(&named, "alice-renamed")["slot"], p0["slot"]);
    let unnamed: Vec<&Value> = named["peerCounters"]
        .as_array()
        .map(|a| a.iter().filter(|p| p["peer"].is_null()).collect())
        .unwrap_or_else(|| panic!("no peerCounters: {named:#}"));
    assert_eq!(
        unnamed.len(),
        1,
        "peer1 is in no peer of that file: {named:#}"
    );
}

#[test]
fn detach_removes_everything_and_status_says_so() {
    let gw = Gateway::new(1);
    let s = state(vec![gw.peer_json(0, Some(web_only()))]);
    let mut agent = Agent::start(&gw, Layout::Plain, &s, &[]);
    agent.wait_ready(&gw);
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Tcp(80), ip("10.2.3.4")),
        Reach::Blocked
    );
    assert!(agent.stop().is_some_and(|s| s.success()));
    // Stopped, the agent still enforces: status still sees the datapath.
    assert_eq!(status_json(&gw)["attached"], true);

    let out = Command::new(binary())
        .args(["detach", "--interface", gw.interface()])
        .output()
        .expect("wgfence detach");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pin_dir = gw.bpffs.join("wgfence").join(gw.interface());
    assert_eq!(
        stdout.trim(),
        format!(
            "detached: removed the link and maps under {}",
            pin_dir.display()
        )
    );
    assert!(!pin_dir.exists());
    // Nothing filters any more.
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Tcp(80), ip("10.2.3.4")),
        Reach::Reached
    );

    for args in [&[][..], &["--json"][..]] {
        let out = status(&gw, args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "status {args:?} succeeded after detach"
        );
        assert!(out.stdout.is_empty(), "status {args:?} printed a report");
        assert_eq!(
            stderr.trim(),
            format!(
                "error: nothing is pinned for {} under {}: the datapath is not attached (is the \
                 agent running? is --bpffs right?)",
                gw.interface(),
                pin_dir.display()
            )
        );
    }
    // A second detach is harmless.
    let out = Command::new(binary())
        .args(["detach", "--interface", gw.interface()])
        .output()
        .expect("wgfence detach");
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("nothing was pinned for {}", gw.interface())
    );
}

/// `wgfence status` agrees with /readyz when a state is rejected: the snapshot is rewritten on
/// every change of readiness, not only after an apply.
#[test]
fn status_says_not_ready_when_the_state_is_rejected() {
    let gw = Gateway::new(1);
    let good = state(vec![gw.peer_json(0, None)]);
    let agent = Agent::start(&gw, Layout::Plain, &good, &[]);
    agent.wait_ready(&gw);
    agent.write_state("{\"version\": 1, \"peers\": [");
    agent.wait_readyz(&gw, 503);
    let report = status_json(&gw);
    assert_eq!(report["agent"]["ready"], false, "{report:#}");
    assert!(
        report["agent"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("rejected")),
        "{report:#}"
    );
    assert!(status_text(&gw).contains("NOT ready"));
}

/// Every metric the agent exports is in the metrics reference of docs/operations.md, every
/// field of `status --json` in its schema, and every metric an alert uses is exported.
#[test]
fn the_docs_and_the_alerts_match_what_the_agent_exports() {
    let gw = Gateway::new(1);
    let s = state(vec![gw.peer_json(0, None)]);
    let agent = Agent::start(&gw, Layout::Plain, &s, &["--peer-metrics"]);
    agent.wait_ready(&gw);
    assert_eq!(
        probe(&gw.peers[0].ns, Kind::Ping, ip("10.8.0.1")),
        Reach::Reached
    );
    let (code, body) = agent
        .get(&gw, "/metrics")
        .unwrap_or_else(|| panic!("no metrics; log:\n{}", agent.log_text()));
    assert_eq!(code, 200);
    let docs = repo_file("docs/operations.md");

    let mut samples = BTreeSet::new();
    for line in body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let name = line.split(['{', ' ']).next().unwrap_or_default();
        samples.insert(name.to_owned());
        if let Some(labels) = line.split_once('{').and_then(|(_, l)| l.split_once('}')) {
            for pair in labels.0.split(',') {
                let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                let value = value.trim_matches('"');
                // Reasons and verdicts are a closed set: each is documented.
                if key == "reason" || key == "verdict" {
                    assert!(
                        docs.contains(&format!("`{value}`")),
                        "docs/operations.md does not describe {key} `{value}`"
                    );
                }
            }
        }
    }
    assert!(samples.contains("wgfence_peer_packets_total"), "{body}");
    for name in &samples {
        let family = name
            .trim_end_matches("_bucket")
            .trim_end_matches("_count")
            .trim_end_matches("_sum");
        assert!(
            docs.contains(&format!("`{family}")),
            "docs/operations.md does not document {family}"
        );
    }

    // Every field of `status --json`, as a dotted path (`[]` for array elements).
    let report = status_json(&gw);
    let mut paths = BTreeSet::new();
    collect_paths(&report, "", &mut paths);
    for path in &paths {
        assert!(
            docs.contains(&format!("`{path}`")),
            "docs/operations.md does not document the status field `{path}`"
        );
    }

    // The alerts use only metrics the agent exports.
    let rules = repo_file("deploy/components/monitoring/prometheusrule.yaml");
    let rules = Value::deserialize(serde_norway::Deserializer::from_str(&rules))
        .expect("prometheusrule.yaml");
    let mut used = 0;
    for group in rules["spec"]["groups"].as_array().into_iter().flatten() {
        for rule in group["rules"].as_array().into_iter().flatten() {
            let expr = rule["expr"].as_str().expect("every rule has an expr");
            for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if word.starts_with("wgfence_") {
                    used += 1;
                    assert!(
                        samples.contains(word),
                        "alert {} uses {word}, which the agent does not export",
                        rule["alert"]
                    );
                }
            }
        }
    }
    assert!(used >= 4, "the alerts use {used} wgfence metrics");
}

/// Dotted paths of every field; maps keyed by data (reasons, verdicts) end the path.
fn collect_paths(v: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(map) => {
            for (key, value) in map {
                let path = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                out.insert(path.clone());
                if !["packets", "passed", "dropped"].contains(&path.as_str()) {
                    collect_paths(value, &path, out);
                }
            }
        }
        Value::Array(items) => {
            for item in items {
                collect_paths(item, &format!("{prefix}[]"), out);
            }
        }
        _ => {}
    }
}
