//! `cargo xtask bench [--quick]`: set up, build the agent and the benchmark harness (release),
//! run every scenario side by side with the iptables baseline, write docs/benchmarks.md and
//! target/bench/results.json. Root: it builds network namespaces and loads BPF programs.

use anyhow::{Context, Result};

use crate::{build, util};

pub fn run(quick: bool, only: Option<String>, sizes: Option<String>) -> Result<()> {
    let release = build::build_sandbox_tool("wgfence-bench")?;
    let root = util::workspace_root()?;
    let mut cmd = std::process::Command::new(release.join("wgfence-bench"));
    cmd.current_dir(&root)
        .env("WGFENCE_BIN", release.join("wgfence"))
        .arg("--out")
        .arg(&root);
    if quick {
        cmd.arg("--quick");
    }
    if let Some(only) = only {
        cmd.args(["--only", &only]);
    }
    if let Some(sizes) = sizes {
        cmd.args(["--sizes", &sizes]);
    }
    util::run(&mut cmd).context("the benchmarks failed")
}
