//! Reading the state file, which every push and every revocation pays once: the typed pass
//! on a valid file, and the value-tree walk that names every error of a bad one.

use std::time::Instant;

use serde_json::json;
use wgfence::state::{parse, parse_value_tree};

use super::{
    gen::{self},
    median, ms, progress,
    report::{f, Report},
    us, Config,
};

pub fn run(report: &mut Report, config: &Config) {
    let sizes = config.sizes(&[1_000, 10_000, 100_000], &[1_000, 10_000]);
    let rounds = 5;
    let mut rows = Vec::new();
    let mut records = Vec::new();
    for &n in &sizes {
        progress(&format!("parse, N={n}"));
        let state = gen::state(n, 2);
        let mut valid = Vec::new();
        let mut tree = Vec::new();
        for round in 0..rounds {
            let text = gen::shuffled(&state, 10 + round).to_string();
            let t = Instant::now();
            let parsed = parse(&text);
            valid.push(t.elapsed());
            // The value-tree walk alone: how every file was parsed before the typed pass.
            let t = Instant::now();
            let walked = parse_value_tree(&text);
            tree.push(t.elapsed());
            match (parsed, walked) {
                (Ok(a), Ok(b)) if a == b => {}
                (Ok(_), Ok(_)) => panic!("the typed pass and the value-tree walk disagree"),
                (Err(e), _) | (_, Err(e)) => panic!("generated state invalid: {e}"),
            }
        }
        // One bad field in the last peer: the whole file is rejected with every error named.
        let mut bad = state.clone();
        if let Some(last) = bad["peers"].as_array_mut().and_then(|p| p.last_mut()) {
            last["address"] = json!("10.64.0.2/32");
        }
        let bad = bad.to_string();
        let mut invalid = Vec::new();
        for _ in 0..rounds {
            let t = Instant::now();
            let parsed = parse(&bad);
            invalid.push(t.elapsed());
            if parsed.is_ok() {
                panic!("a state with a bad address was accepted");
            }
        }
        let text_len = state.to_string().len();
        let per_peer = us(median(&valid)) / n as f64;
        rows.push(vec![
            n.to_string(),
            f(text_len as f64 / 1048576.0, 1),
            f(ms(median(&valid)), 1),
            f(per_peer, 2),
            f(ms(median(&tree)), 1),
            f(ms(median(&invalid)), 1),
        ]);
        records.push(
            json!({ "peers": n, "bytes": text_len, "valid_ms": ms(median(&valid)),
            "valid_us_per_peer": per_peer, "value_tree_ms": ms(median(&tree)),
            "invalid_ms": ms(median(&invalid)) }),
        );
    }
    report.section(
        "Parsing the state file",
        &format!(
            "Reading and validating the whole state file, which every push and every revocation \
             pays once: generated states (the policy mix of the apply scenario), peers and rules \
             shuffled, median of {rounds} rounds. A valid file is deserialized into typed, \
             borrowed structs; a file with an error (here one bad address in the last peer) is \
             walked a second time as a value tree to name every error. The value-tree walk \
             alone is how every file was parsed before the typed pass. Command: `{}`.",
            config.command
        ),
    );
    report.table(
        &[
            "peers",
            "file (MiB)",
            "valid: parse (ms)",
            "per peer (µs)",
            "value-tree walk alone (ms)",
            "invalid: parse + every error (ms)",
        ],
        &rows,
    );
    report.record("parse", json!(records));
}
