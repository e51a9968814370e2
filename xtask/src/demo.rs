//! `cargo xtask demo`: set up, build the agent and the demo (release), run the demo as root.
//! The demo builds its own sandbox of network namespaces and removes it when it ends.

use anyhow::{bail, Context, Result};

use crate::{setup, util};

pub fn run() -> Result<()> {
    if !util::is_root() {
        bail!("the demo needs root (network namespaces, BPF, wireguard-go): run it as root");
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
        "wgfence-demo",
    ]))
    .context("building the agent and the demo failed")?;
    let release = util::target_dir(&root).join("release");
    util::run(
        std::process::Command::new(release.join("wgfence-demo"))
            .env("WGFENCE_BIN", release.join("wgfence")),
    )
    .context("the demo failed")
}
