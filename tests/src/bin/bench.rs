//! `cargo xtask bench [--quick] [--only NAME[,NAME]] [--sizes N[,N]]`: measures wgfence side by
//! side with the per-peer iptables chain design it replaces, in one run, and writes
//! docs/benchmarks.md and target/bench/results.json. Root; builds its own namespaces and
//! removes them. The scenarios are the modules of `wgfence_tests::bench`, one per file.

use std::{path::PathBuf, process::Command, time::Instant};

use clap::{CommandFactory as _, Parser};

use serde_json::json;
use wgfence_tests::bench::{self, report::Report, Config, SCENARIOS};

/// Measures wgfence side by side with the per-peer iptables design it replaces (root; run
/// through `cargo xtask bench`, which builds it and the agent).
#[derive(Parser)]
#[command(name = "wgfence-bench")]
struct Args {
    /// A reduced set (smaller N, shorter runs) for a quick look.
    #[arg(long)]
    quick: bool,
    /// The workspace to write the report into (docs/benchmarks.md, target/bench/).
    #[arg(long, default_value = ".")]
    out: PathBuf,
    /// Only these scenarios (comma-separated); the report then goes to target/bench/partial.md.
    #[arg(long, value_delimiter = ',')]
    only: Option<Vec<String>>,
    /// Only these of each scenario's sizes (comma-separated peer counts); the report then goes
    /// to target/bench/partial.md.
    #[arg(long, value_delimiter = ',')]
    sizes: Option<Vec<usize>>,
}

fn main() {
    // An unknown argument or `--help` ends here, before any namespace or map exists.
    let args = Args::parse();
    let names: Vec<&str> = SCENARIOS.iter().map(|(n, _)| *n).collect();
    for name in args.only.iter().flatten() {
        if !names.contains(&name.as_str()) {
            Args::command()
                .error(
                    clap::error::ErrorKind::InvalidValue,
                    format!(
                        "--only {name}: no such scenario (the scenarios: {})",
                        names.join(", ")
                    ),
                )
                .exit();
        }
    }
    let out_dir = args.out;
    let only = args.only;
    let config = Config {
        quick: args.quick,
        sizes: args.sizes.clone(),
        command: format!(
            "cargo xtask bench{}{}{}",
            if args.quick { " --quick" } else { "" },
            only.as_ref()
                .map(|o| format!(" --only {}", o.join(",")))
                .unwrap_or_default(),
            args.sizes
                .map(|s| {
                    let s: Vec<String> = s.iter().map(ToString::to_string).collect();
                    format!(" --sizes {}", s.join(","))
                })
                .unwrap_or_default()
        ),
    };
    wgfence_tests::require_root();
    let started = Instant::now();
    let mut report = Report::new(
        "wgfence benchmarks",
        &format!(
            "Produced by `{}` on {} (kernel {}, {} CPUs), {}. Every figure below comes from that \
             one run; wgfence and the baseline (one iptables chain per peer, the whole ruleset \
             applied with `iptables-restore`, rendered from the same state) were measured side \
             by side. The machine is shared and noisy: compare ratios, not absolute numbers. \
             Goals are the issue's targets, reported, not asserted.",
            config.command,
            machine(),
            kernel(),
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            date()
        ),
    );
    let mut json = serde_json::Map::new();
    json.insert("command".into(), json!(config.command));

    // `--only NAME[,NAME]` runs some scenarios (while working on one); the report then holds
    // only those and is written to target/bench/ instead of docs/.
    for (name, scenario) in SCENARIOS {
        if only.as_ref().is_none_or(|o| o.iter().any(|x| x == name)) {
            scenario(&mut report, &config);
        }
    }

    let goals = bench::goals();
    if !goals.is_empty() {
        report.appendix(
            "Issue 14: every goal of this run",
            "Each goal as the scenario above judged it, with its figure and the reason.",
        );
        for line in goals {
            report.paragraph(&format!("- {line}"));
        }
    }
    report.end(&format!(
        "Total run time: {:.0} s.",
        started.elapsed().as_secs_f64()
    ));
    let md_path = if only.is_some() || config.sizes.is_some() {
        out_dir.join("target/bench/partial.md")
    } else {
        out_dir.join("docs/benchmarks.md")
    };
    let json_path = out_dir.join("target/bench/results.json");
    if let Some(dir) = json_path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    if let Some(dir) = md_path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    std::fs::write(&md_path, report.markdown()).unwrap();
    let results = serde_json::to_string_pretty(&report.json()).expect("the results as JSON");
    std::fs::write(&json_path, results).unwrap();
    println!("wrote {} and {}", md_path.display(), json_path.display());
}

fn machine() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

fn kernel() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

fn date() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}
