//! `cargo xtask test`: what CI runs. Set up, check formatting, lint, run the unit tests, then the
//! privileged integration tests (root: network namespaces, BPF, wireguard-go), then `image
//! --run` (the container image built and run as the DaemonSet runs it), then `vm-test`:
//! the conformance subset on Debian's 5.10, 6.1 and 6.12 kernels under qemu.

use std::{
    cell::Cell,
    ffi::OsString,
    io::{BufRead as _, BufReader},
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::{fuzz, image, oldagent, setup, util, vm};

/// Seconds each fuzz target runs in `cargo xtask test` (CI has 2 cores and 90 minutes).
const FUZZ_SECONDS: u64 = 25;

#[derive(Args)]
pub struct Options {
    /// Skip `cargo fmt --check` and `cargo clippy`.
    #[arg(long)]
    pub no_lint: bool,
    /// Skip the privileged integration tests (lint and unit tests need no root).
    #[arg(long)]
    pub unit: bool,
    /// Skip the short fuzzing run of every cargo-fuzz target.
    #[arg(long)]
    pub no_fuzz: bool,
    /// Skip `image --run` (the container image built and run as the DaemonSet runs it).
    #[arg(long)]
    pub no_image: bool,
    /// Skip `vm-test` (Debian's 5.10, 6.1 and 6.12 kernels under qemu, 5 to 7 minutes each).
    #[arg(long)]
    pub no_vm: bool,
    /// Seconds each fuzz target runs.
    #[arg(long, default_value_t = FUZZ_SECONDS)]
    pub fuzz_seconds: u64,
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
    let totals = Totals::default();

    step("setup", || {
        setup::run(if options.unit {
            setup::Bpffs::IfRoot
        } else {
            setup::Bpffs::Require
        })
    })?;
    if !options.no_lint {
        step("fmt", || {
            util::run(util::cargo_command(&root).args(["fmt", "--all", "--", "--check"]))?;
            // fuzz/ is a workspace of its own, which `--all` does not reach.
            util::run(util::cargo_command(&root).args([
                "fmt",
                "--manifest-path",
                "fuzz/Cargo.toml",
                "--all",
                "--",
                "--check",
            ]))
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
    if !options.no_fuzz {
        step("cargo-fuzz", fuzz::ensure_cargo_fuzz)?;
    }
    step("unit tests", || {
        totals.run(util::cargo_command(&root).args([
            "test",
            "--workspace",
            "--exclude",
            "wgfence-ebpf",
            "--exclude",
            "wgfence-tests",
        ]))
    })?;
    if !options.no_fuzz {
        // A short run of each target from the committed corpus: a regression in the parser or
        // the planner that the corpus reaches fails here.
        for target in fuzz::TARGETS {
            step(&format!("fuzz {target}"), || {
                fuzz::fuzz(&root, target, options.fuzz_seconds, true)
            })?;
        }
    }
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
        // The upgrade tests start from a datapath of an older map layout, made by that
        // version's own agent.
        let old = std::cell::RefCell::new(Vec::new());
        for agent in oldagent::ALL {
            step(
                &format!("build the layout-{} agent (upgrade tests)", agent.layout),
                || {
                    old.borrow_mut().push((agent.env, agent.build(&root)?));
                    Ok(())
                },
            )?;
        }
        step("integration tests", || {
            let mut cmd = util::cargo_command(&root);
            for (env, bin) in old.borrow().iter() {
                cmd.env(env, bin);
            }
            cmd.env("RUST_BACKTRACE", "1")
                .args(["test", "--package", "wgfence-tests"]);
            if !options.test_args.is_empty() {
                cmd.arg("--").args(&options.test_args);
            }
            totals.run(&mut cmd)
        })?;
    }
    if !options.unit && !options.no_image {
        step("image --run", || image::run(&image::Options { run: true }))?;
    }
    if !options.unit && !options.no_vm {
        // Last: every kernel of the matrix (they fit CI's budget with wide room, see README).
        step("vm-test (5.10, 6.1, 6.12)", || vm::run(vm::Options::all()))?;
    }
    eprintln!(
        "test: all steps passed in {:.1}s",
        start.elapsed().as_secs_f64()
    );
    // One closing line for every test binary together.
    println!(
        "tests: {} passed, {} failed, {} skipped",
        totals.passed.get(),
        totals.failed.get(),
        totals.ignored.get()
    );
    Ok(())
}

/// Test counts summed over the `test result:` lines of every test binary.
#[derive(Default)]
struct Totals {
    passed: Cell<u64>,
    failed: Cell<u64>,
    ignored: Cell<u64>,
}

impl Totals {
    /// Runs `cargo test ...`, passing its output through and counting its results.
    fn run(&self, cmd: &mut Command) -> Result<()> {
        let line = util::display(cmd);
        eprintln!("+ {line}");
        let mut child = cmd
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot run `{line}`"))?;
        if let Some(stdout) = child.stdout.take() {
            for text in BufReader::new(stdout).lines() {
                let text = text.context("reading test output")?;
                println!("{text}");
                self.add(&text);
            }
        }
        let status = child
            .wait()
            .with_context(|| format!("waiting for `{line}`"))?;
        util::check(status, &line)
    }

    /// Adds a line like `test result: ok. 34 passed; 0 failed; 2 ignored; ...`.
    fn add(&self, line: &str) {
        let Some(rest) = line.strip_prefix("test result: ") else {
            return;
        };
        for part in rest.split(';') {
            let mut words = part.split_whitespace().rev();
            let (Some(what), Some(n)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(n) = n.parse::<u64>() else { continue };
            let counter = match what {
                "passed" => &self.passed,
                "failed" => &self.failed,
                "ignored" => &self.ignored,
                _ => continue,
            };
            counter.set(counter.get() + n);
        }
    }
}

/// Runs one step, announcing it and naming it if it fails.
fn step(name: &str, f: impl FnOnce() -> Result<()>) -> Result<()> {
    eprintln!("==> {name}");
    let start = Instant::now();
    f().with_context(|| format!("step `{name}` failed"))?;
    eprintln!("==> {name}: ok ({:.1}s)", start.elapsed().as_secs_f64());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Totals;

    #[test]
    fn totals_sum_cargo_test_result_lines() {
        let t = Totals::default();
        t.add("test result: ok. 34 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out; finished in 1.32s");
        t.add("test result: FAILED. 3 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out");
        t.add("running 3 tests");
        assert_eq!(
            (t.passed.get(), t.failed.get(), t.ignored.get()),
            (37, 1, 2)
        );
    }
}
