//! `cargo xtask fuzz <target> [--seconds N]`: runs one of the cargo-fuzz targets in fuzz/
//! (`state`: the state parser; `pipeline`: the incremental state pipeline; `plan`: the planner),
//! installing cargo-fuzz first if it is missing. `cargo xtask test` runs every target for a
//! short budget.
//!
//! cargo-fuzz passes nightly-only flags (`-Zsanitizer=address`, sancov passes) to rustc. The
//! machines have a stable rustc, whose rust-std ships the ASan runtime, so the build runs with
//! `RUSTC_BOOTSTRAP=1`; `--no-sanitizer` builds without ASan if a toolchain lacks it.
//!
//! New inputs go to target/fuzz/corpus/<target>, seeded from the committed fuzz/corpus/<target>
//! (which stays as committed); crashes go to fuzz/artifacts/<target>/, and libFuzzer prints
//! the command that replays one.

use std::{path::Path, process::Command};

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::util;

/// The fuzz targets (fuzz/fuzz_targets/<name>.rs).
pub const TARGETS: [&str; 3] = ["state", "pipeline", "plan"];

/// cargo-fuzz, installed with `cargo install --locked` when missing.
const CARGO_FUZZ: &str = "cargo-fuzz";
/// The version verified here with the machine's toolchain (pinned: a later release may need a
/// newer rustc, and CI must build what was tested).
const CARGO_FUZZ_VERSION: &str = "0.13.2";

#[derive(Args)]
pub struct Options {
    /// The target: state (parse, validate, compile, canonical round trip) or plan (sequences
    /// of states planned fully and incrementally against the model of the kernel).
    #[arg(value_parser = clap::builder::PossibleValuesParser::new(TARGETS))]
    pub target: String,
    /// How long to fuzz.
    #[arg(long, default_value_t = 60)]
    pub seconds: u64,
    /// Build without AddressSanitizer (`cargo fuzz -s none`).
    #[arg(long)]
    pub no_sanitizer: bool,
}

pub fn run(options: &Options) -> Result<()> {
    ensure_cargo_fuzz()?;
    let root = util::workspace_root()?;
    fuzz(
        &root,
        &options.target,
        options.seconds,
        !options.no_sanitizer,
    )
}

/// Installs cargo-fuzz unless `cargo fuzz` already runs.
pub fn ensure_cargo_fuzz() -> Result<()> {
    let version = util::query(Command::new(util::cargo()).args(["fuzz", "--version"]));
    if let Some(version) = version {
        eprintln!("ok: {}", version.trim());
        return Ok(());
    }
    eprintln!("installing: {CARGO_FUZZ}");
    util::run(Command::new(util::cargo()).args([
        "install",
        "--locked",
        CARGO_FUZZ,
        "--version",
        CARGO_FUZZ_VERSION,
    ]))
    .context("installing cargo-fuzz")?;
    if util::query(Command::new(util::cargo()).args(["fuzz", "--version"])).is_none() {
        bail!("installed {CARGO_FUZZ} but `cargo fuzz --version` does not run");
    }
    Ok(())
}

/// Runs `target` for `seconds` on one core.
pub fn fuzz(root: &Path, target: &str, seconds: u64, sanitizer: bool) -> Result<()> {
    if !TARGETS.contains(&target) {
        bail!(
            "no fuzz target {target:?} (targets: {})",
            TARGETS.join(", ")
        );
    }
    let fuzz_dir = root.join("fuzz");
    let corpus = util::target_dir(root)
        .join("fuzz")
        .join("corpus")
        .join(target);
    std::fs::create_dir_all(&corpus)
        .with_context(|| format!("cannot create {}", corpus.display()))?;
    let mut cmd = util::cargo_command(&fuzz_dir);
    cmd.env("RUSTC_BOOTSTRAP", "1")
        // The default build: optimised, with debug assertions and overflow checks.
        .args(["fuzz", "run"]);
    if !sanitizer {
        cmd.args(["--sanitizer", "none"]);
    }
    cmd.arg(target)
        .arg(&corpus)
        .arg(Path::new("corpus").join(target))
        .arg("--")
        .arg(format!("-max_total_time={seconds}"))
        .arg("-print_final_stats=1");
    if target == "state" {
        cmd.arg("-dict=state.dict").arg("-max_len=4096");
    }
    util::run(&mut cmd).with_context(|| format!("fuzz target {target} failed"))
}
