//! `cargo xtask test`: what CI runs. Set up, check formatting, lint, run the unit tests, then the
//! privileged integration tests (root: network namespaces, BPF, wireguard-go).

use std::{ffi::OsString, time::Instant};

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::{setup, util};

#[derive(Args)]
pub struct Options {
    /// Skip `cargo fmt --check` and `cargo clippy`.
    #[arg(long)]
    pub no_lint: bool,
    /// Skip the privileged integration tests (lint and unit tests need no root).
    #[arg(long)]
    pub unit: bool,
    /// Arguments for the integration test binaries, e.g. a test name filter.
    #[arg(last = true, value_name = "TEST_ARGS")]
    pub test_args: Vec<OsString>,
}

pub fn run(options: Options) -> Result<()> {
    if options.unit && !options.test_args.is_empty() {
        bail!("arguments after `--` go to the integration tests, which --unit skips");
    }
    if !options.unit && !util::is_root() {
        bail!(
            "the integration tests need root (network namespaces, BPF, wireguard-go): run as \
             root, or pass --unit for lint and unit tests only"
        );
    }
    let root = util::workspace_root()?;
    let start = Instant::now();

    step("setup", || {
        setup::run(if options.unit {
            setup::Bpffs::IfRoot
        } else {
            setup::Bpffs::Require
        })
    })?;
    if !options.no_lint {
        step("fmt", || {
            util::run(util::cargo_command(&root).args(["fmt", "--all", "--", "--check"]))
        })?;
        step("clippy", || {
            util::run(util::cargo_command(&root).args([
                "clippy",
                "--workspace",
                "--exclude",
                "wgfence-ebpf",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ]))
        })?;
    }
    step("unit tests", || {
        util::run(util::cargo_command(&root).args([
            "test",
            "--workspace",
            "--exclude",
            "wgfence-ebpf",
            "--exclude",
            "wgfence-tests",
        ]))
    })?;
    if !options.unit {
        // The end-to-end tests run the agent binary, which `cargo test` does not build for
        // another package's tests.
        step("build the agent", || {
            util::run(util::cargo_command(&root).args([
                "build",
                "--package",
                "wgfence",
                "--bin",
                "wgfence",
            ]))
        })?;
        step("integration tests", || {
            let mut cmd = util::cargo_command(&root);
            cmd.env("RUST_BACKTRACE", "1")
                .args(["test", "--package", "wgfence-tests"]);
            if !options.test_args.is_empty() {
                cmd.arg("--").args(&options.test_args);
            }
            util::run(&mut cmd)
        })?;
    }
    eprintln!(
        "test: all steps passed in {:.1}s",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Runs one step, announcing it and naming it if it fails.
fn step(name: &str, f: impl FnOnce() -> Result<()>) -> Result<()> {
    eprintln!("==> {name}");
    let start = Instant::now();
    f().with_context(|| format!("step `{name}` failed"))?;
    eprintln!("==> {name}: ok ({:.1}s)", start.elapsed().as_secs_f64());
    Ok(())
}
