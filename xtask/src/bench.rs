//! `cargo xtask bench [--quick]`: set up, build the agent and the benchmark harness (release),
//! run every scenario side by side with the iptables baseline, write docs/benchmarks.md and
//! target/bench/results.json. Root: it builds network namespaces and loads BPF programs.

use anyhow::{bail, Context, Result};

use crate::{setup, util};

pub fn run(quick: bool, only: Option<String>) -> Result<()> {
    if !util::is_root() {
        bail!("the benchmarks need root (network namespaces, BPF, wireguard-go): run as root");
    }
    setup::run(setup::Bpffs::Require)?;
    let root = util::workspace_root()?;
    util::run(util::cargo_command(&root).args([
        "build",
        "--release",
        "--package",
        "wgfence",
        "--bin",
        "wgfence",
        "--package",
        "wgfence-tests",
        "--bin",
        "wgfence-bench",
    ]))
    .context("building the agent and the benchmarks failed")?;
    let release = util::target_dir(&root).join("release");
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
    util::run(&mut cmd).context("the benchmarks failed")
}
