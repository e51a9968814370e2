//! The layout-1 agent that the upgrade test starts from: the `wgfence` binary of commit
//! [`COMMIT`] (main before map layout 2), built once with that commit's own Cargo.lock into
//! `target/v1-agent/<commit>/` and reused from there.
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

/// The last commit of map layout 1.
pub const COMMIT: &str = "02c7ddc00e80408588b4545a1aa52dcc268f577f";
/// Tells the integration tests where the binary is.
pub const ENV: &str = "WGFENCE_V1_BIN";

/// Where the binary is once built: `target/v1-agent/<commit>/src/target/debug/wgfence`.
pub fn binary(root: &Path) -> PathBuf {
    source_dir(root)
        .join("target")
        .join("debug")
        .join("wgfence")
}

fn source_dir(root: &Path) -> PathBuf {
    util::target_dir(root)
        .join("v1-agent")
        .join(&COMMIT[..7])
        .join("src")
}

/// Exports the commit's tree (once) and builds its agent (cargo makes a rebuild a no-op).
pub fn build(root: &Path) -> Result<PathBuf> {
    let src = source_dir(root);
    if !src.join("Cargo.lock").is_file() {
        let commit = format!("{COMMIT}^{{commit}}");
        let known = Command::new("git")
            .current_dir(root)
            .args(["cat-file", "-e", &commit])
            .status()
            .context("running git")?;
        if !known.success() {
            bail!(
                "commit {COMMIT} (the layout-1 agent the upgrade test starts from) is not in \
                 this clone: fetch the full history (`git fetch --unshallow`, or a CI checkout \
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
                .arg(COMMIT),
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
    util::run(&mut cmd).context("building the layout-1 agent")?;
    let bin = binary(root);
    if !bin.is_file() {
        bail!("the build succeeded but {} does not exist", bin.display());
    }
    Ok(bin)
}

/// `cargo xtask v1-agent`: builds it and prints where it is.
pub fn run() -> Result<()> {
    let root = util::workspace_root()?;
    let bin = build(&root)?;
    println!("{}", bin.display());
    Ok(())
}
