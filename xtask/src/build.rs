//! `cargo xtask build` and `cargo xtask run`: set up, build the agent (whose build script builds
//! and embeds the eBPF object), run it as root.

use std::{ffi::OsString, os::unix::process::CommandExt, path::PathBuf, process::Command};

use anyhow::{bail, Context, Result};

use crate::{setup, util};

/// The eBPF object agent/build.rs builds (always in release mode, whatever the agent's profile).
const EBPF_OBJECT: &str = "target/bpf/bpfel-unknown-none/release/wgfence";

pub struct Artifacts {
    pub agent: PathBuf,
    pub ebpf: PathBuf,
}

/// Sets up what is missing, then builds the agent; returns the paths of what was built.
pub fn build(debug: bool) -> Result<Artifacts> {
    setup::run(setup::Bpffs::IfRoot)?;
    let root = util::workspace_root()?;
    let mut cmd = util::cargo_command(&root);
    cmd.args(["build", "--package", "wgfence"]);
    if !debug {
        cmd.arg("--release");
    }
    util::run(&mut cmd).context("building the agent failed")?;

    let profile = if debug { "debug" } else { "release" };
    let artifacts = Artifacts {
        agent: util::target_dir(&root).join(profile).join("wgfence"),
        ebpf: root.join(EBPF_OBJECT),
    };
    for path in [&artifacts.agent, &artifacts.ebpf] {
        if !path.is_file() {
            bail!("the build succeeded but {} does not exist", path.display());
        }
    }
    Ok(artifacts)
}

/// `cargo xtask build`: builds and prints where the results are.
pub fn run_build(debug: bool) -> Result<()> {
    let artifacts = build(debug)?;
    println!("agent: {}", artifacts.agent.display());
    println!("eBPF:  {}", artifacts.ebpf.display());
    Ok(())
}

/// `cargo xtask run`: builds, then replaces this process with the agent, as root (through
/// `sudo -E` when not root).
pub fn run_agent(args: Vec<OsString>) -> Result<()> {
    let agent = build(false)?.agent;
    let mut cmd = if util::is_root() {
        Command::new(&agent)
    } else if let Some(sudo) = util::find_in_path("sudo") {
        let mut cmd = Command::new(sudo);
        cmd.arg("-E").arg(&agent);
        cmd
    } else {
        bail!(
            "the agent needs root (it loads BPF programs) and sudo is not installed: \
             run as root: {} ...",
            agent.display()
        );
    };
    cmd.args(args);
    let line = util::display(&cmd);
    eprintln!("+ {line}");
    // Only returns if the exec failed.
    let err = cmd.exec();
    Err(err).with_context(|| format!("cannot run `{line}`"))
}

/// Builds the agent and one of the sandbox binaries of `wgfence-tests` (the demo, the
/// benchmarks) in release mode, as root after setup; returns the release directory.
pub fn build_sandbox_tool(tool: &str) -> Result<PathBuf> {
    if !util::is_root() {
        bail!("{tool} needs root (network namespaces, BPF, wireguard-go): run it as root");
    }
    setup::run(setup::Bpffs::Require)?;
    let root = util::workspace_root()?;
    // Two builds: in one, the tool's `testing` feature of the agent's library would be built
    // into the agent binary too, and the sandbox runs the agent as it ships.
    util::run(util::cargo_command(&root).args([
        "build",
        "--release",
        "--package",
        "wgfence",
        "--bin",
        "wgfence",
    ]))
    .context("building the agent failed")?;
    util::run(util::cargo_command(&root).args([
        "build",
        "--release",
        "--package",
        "wgfence-tests",
        "--bin",
        tool,
    ]))
    .with_context(|| format!("building {tool} failed"))?;
    Ok(util::target_dir(&root).join("release"))
}
