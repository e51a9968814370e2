//! Developer entry points for wgfence, run as `cargo xtask <command>` (an alias in
//! .cargo/config.toml). Every command prints the commands it runs.

mod bench;
mod build;
mod demo;
mod dump;
mod fuzz;
mod image;
mod linker;
mod oldagent;
mod setup;
mod test;
mod util;
mod vm;

use std::{ffi::OsString, path::PathBuf, process::ExitCode};

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "Developer entry points for wgfence"
)]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what is missing: Debian packages, bpf-linker, bpffs (idempotent).
    Setup,
    /// Set up, then build the agent with its embedded eBPF object.
    Build {
        /// Build the agent in the debug profile (the eBPF object is always optimised).
        #[arg(long)]
        debug: bool,
    },
    /// Build, then run the agent as root with the given arguments: `run -- run --interface wg0 ...`.
    Run {
        #[arg(
            trailing_var_arg = true,
            allow_hyphen_values = true,
            value_name = "AGENT_ARGS"
        )]
        args: Vec<OsString>,
    },
    /// Set up, check formatting, lint, run the unit tests, then the privileged integration tests,
    /// then `image --run`, then `vm-test` on every kernel.
    Test(test::Options),
    /// Set up, build, and show wgfence at work on a sandboxed gateway with three peers: allowed
    /// and denied traffic, a live policy change, a live revocation (root; removes what it made).
    Demo,
    /// Set up, build, and measure wgfence side by side with the per-peer iptables design it
    /// replaces; writes docs/benchmarks.md and target/bench/results.json (root).
    Bench {
        /// A reduced set (smaller N, shorter runs) for a quick look.
        #[arg(long)]
        quick: bool,
        /// Only these scenarios (comma-separated: per_packet, parse, apply, throughput, churn,
        /// revocation, restart, replies, soak); the report then goes to target/bench/partial.md.
        #[arg(long)]
        only: Option<String>,
        /// Only these of each scenario's sizes (comma-separated peer counts, e.g. 131072); the
        /// report then goes to target/bench/partial.md.
        #[arg(long)]
        sizes: Option<String>,
    },
    /// Run a cargo-fuzz target (installs cargo-fuzz if missing): `fuzz state --seconds 600`.
    Fuzz(fuzz::Options),
    /// Build (once, about 4 minutes) the kube-apiserver the Kubernetes source's integration
    /// tests start, and install Debian's etcd beside it (root).
    KubeApiserver,
    /// Build the layout-2 agent (commit b4200bd) that the upgrade tests start from, and print
    /// its path.
    V2Agent,
    /// Build the layout-3 agent (commit f530f25) that the upgrade tests start from, and print
    /// its path.
    V3Agent,
    /// Boot Debian's 5.10, 6.1 and 6.12 kernels under qemu (TCG) and run the conformance subset
    /// inside each (kernel WireGuard, enforcement, policy change, revocation, restart, status,
    /// monitor, detach); prints the table of docs/operations.md "Supported kernels".
    VmTest(vm::Options),
    /// Build the container image offline (base from Debian's packages, the agent from `build`);
    /// `--run` also runs it as the DaemonSet does on the demo's sandbox (root).
    Image(image::Options),
    /// Show what the agent pinned for an interface: its maps' contents and its tcx link.
    Dump {
        /// The WireGuard interface.
        #[arg(long, short)]
        interface: String,
        /// Where the BPF filesystem is mounted.
        #[arg(long, default_value = setup::BPFFS)]
        bpffs: PathBuf,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    util::add_cargo_bin_to_path()?;
    match cli.command {
        Task::Setup => setup::run(setup::Bpffs::Require),
        Task::Build { debug } => build::run_build(debug),
        Task::Run { args } => build::run_agent(args),
        Task::Test(options) => test::run(options),
        Task::Demo => demo::run(),
        Task::Bench { quick, only, sizes } => bench::run(quick, only, sizes),
        Task::Fuzz(options) => fuzz::run(&options),
        Task::KubeApiserver => setup::kube_apiserver(),
        Task::V2Agent => oldagent::run(oldagent::V2),
        Task::V3Agent => oldagent::run(oldagent::V3),
        Task::VmTest(options) => vm::run(options),
        Task::Dump { interface, bpffs } => dump::run(&interface, &bpffs),
        Task::Image(options) => image::run(&options),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Task, clap::Error> {
        Cli::try_parse_from(std::iter::once("cargo xtask").chain(args.iter().copied()))
            .map(|cli| cli.command)
    }

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn run_passes_everything_after_the_separator_to_the_agent() -> Result<(), clap::Error> {
        for args in [
            &["run", "--", "run", "--interface", "wg0"][..],
            &["run", "run", "--interface", "wg0"][..],
        ] {
            let Task::Run { args } = parse(args)? else {
                panic!("not parsed as `run`");
            };
            assert_eq!(args, ["run", "--interface", "wg0"]);
        }
        Ok(())
    }

    #[test]
    fn test_passes_arguments_after_the_separator() -> Result<(), clap::Error> {
        let Task::Test(options) = parse(&["test", "--no-lint", "--", "--exact", "revoke"])? else {
            panic!("not parsed as `test`");
        };
        assert!(options.no_lint && !options.unit);
        assert_eq!(options.test_args, ["--exact", "revoke"]);
        assert!(parse(&["test", "revoke"]).is_err());
        Ok(())
    }

    #[test]
    fn fuzz_takes_a_known_target_and_a_budget() -> Result<(), clap::Error> {
        let Task::Fuzz(options) = parse(&["fuzz", "plan", "--seconds", "30"])? else {
            panic!("not parsed as `fuzz`");
        };
        assert_eq!((options.target.as_str(), options.seconds), ("plan", 30));
        assert!(!options.no_sanitizer);
        assert!(parse(&["fuzz", "nothing"]).is_err());
        Ok(())
    }
}
