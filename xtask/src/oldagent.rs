//! The agents of older map layouts that the upgrade tests start from: the `wgfence` binary of
//! the last commit of each layout ([`V2`], [`V3`]), built once with that commit's own
//! Cargo.lock into `target/v<layout>-agent/<commit>/` and reused from there.
//!
//! The source is exported with `git archive` rather than checked out as a `git worktree`: a
//! worktree registers itself in `.git`, and `cargo clean` (which removes `target/`) would leave
//! that registration dangling and the next `git worktree add` failing.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

use crate::util;

/// The agent of one older map layout.
#[derive(Debug, Clone, Copy)]
pub struct OldAgent {
    /// The map layout its datapath uses.
    pub layout: u32,
    /// The last commit of that layout.
    pub commit: &'static str,
    /// Tells the integration tests where the binary is.
    pub env: &'static str,
}

/// Map layout 2: main before map layout 3.
pub const V2: OldAgent = OldAgent {
    layout: 2,
    commit: "b4200bddea2718d7843106dcde37f0813c678a49",
    env: "WGFENCE_V2_BIN",
};

/// Map layout 3: main before map layout 4.
pub const V3: OldAgent = OldAgent {
    layout: 3,
    commit: "f530f25c0f429fd07d60005b4e338f7ff2b20df4",
    env: "WGFENCE_V3_BIN",
};

/// Every older agent the upgrade tests use.
pub const ALL: [OldAgent; 2] = [V2, V3];

impl OldAgent {
    /// Where the binary is once built: `target/v<layout>-agent/<commit>/src/target/debug/wgfence`.
    pub fn binary(&self, root: &Path) -> PathBuf {
        self.source_dir(root)
            .join("target")
            .join("debug")
            .join("wgfence")
    }

    fn source_dir(&self, root: &Path) -> PathBuf {
        util::target_dir(root)
            .join(format!("v{}-agent", self.layout))
            .join(&self.commit[..7])
            .join("src")
    }

    /// Exports the commit's tree (once) and builds its agent (cargo makes a rebuild a no-op).
    pub fn build(&self, root: &Path) -> Result<PathBuf> {
        build(self, root)
    }
}

fn build(agent: &OldAgent, root: &Path) -> Result<PathBuf> {
    let (layout, commit) = (agent.layout, agent.commit);
    let src = agent.source_dir(root);
    if !src.join("Cargo.lock").is_file() {
        let object = format!("{commit}^{{commit}}");
        let known = Command::new("git")
            .current_dir(root)
            .args(["cat-file", "-e", &object])
            .status()
            .context("running git")?;
        if !known.success() {
            bail!(
                "commit {commit} (the layout-{layout} agent an upgrade test starts from) is not \
                 in this clone: fetch the full history (`git fetch --unshallow`, or a CI checkout \
                 with fetch-depth 0)"
            );
        }
        let parent = src.parent().context("source dir has no parent")?;
        let tmp = parent.join("src.tmp");
        let tar = parent.join("src.tar");
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        util::run(
            Command::new("git")
                .current_dir(root)
                .args(["archive", "--format=tar", "-o"])
                .arg(&tar)
                .arg(commit),
        )?;
        util::run(Command::new("tar").arg("-xf").arg(&tar).arg("-C").arg(&tmp))?;
        fs::remove_file(&tar).with_context(|| format!("removing {}", tar.display()))?;
        let _ = fs::remove_dir_all(&src);
        fs::rename(&tmp, &src).with_context(|| format!("renaming to {}", src.display()))?;
    }
    let mut cmd = Command::new(util::cargo());
    cmd.current_dir(&src)
        // Its own target directory (src/target), never the workspace's.
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET_DIR")
        .args([
            "build",
            "--locked",
            "--package",
            "wgfence",
            "--bin",
            "wgfence",
        ]);
    util::run(&mut cmd).with_context(|| format!("building the layout-{layout} agent"))?;
    let bin = agent.binary(root);
    if !bin.is_file() {
        bail!("the build succeeded but {} does not exist", bin.display());
    }
    Ok(bin)
}

/// `cargo xtask v2-agent` / `v3-agent`: builds it and prints where it is.
pub fn run(agent: OldAgent) -> Result<()> {
    let root = util::workspace_root()?;
    let bin = agent.build(&root)?;
    println!("{}", bin.display());
    Ok(())
}
