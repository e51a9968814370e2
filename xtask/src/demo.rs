//! `cargo xtask demo`: set up, build the agent and the demo (release), run the demo as root.
//! The demo builds its own sandbox of network namespaces and removes it when it ends.

use anyhow::{Context, Result};

use crate::{build, util};

pub fn run() -> Result<()> {
    let release = build::build_sandbox_tool("wgfence-demo")?;
    util::run(
        std::process::Command::new(release.join("wgfence-demo"))
            .env("WGFENCE_BIN", release.join("wgfence")),
    )
    .context("the demo failed")
}
