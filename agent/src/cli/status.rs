//! `wgfence status`: what is attached and counted for an interface; with `--rules`, the rules
//! not hit.

use std::{path::PathBuf, process::ExitCode};

use anyhow::{Context as _, Result};
use wgfence::{
    state,
    status::{report, rules},
};

use super::{parse_state, print_json, state_path, StateArgs, Target};

#[derive(Debug, clap::Args)]
pub struct Status {
    #[command(flatten)]
    pub target: Target,
    /// Machine-readable output (schema in docs/operations.md).
    #[arg(long)]
    json: bool,
    /// State file to name peers by (default: the running agent's).
    #[arg(long, short)]
    state: Option<PathBuf>,
    #[command(flatten)]
    read: StateArgs,
    /// List the rules of the applied policies with their hit counters instead: those with
    /// no hit since `--since` (default: none ever), to prune.
    #[arg(long)]
    rules: bool,
    /// With `--rules`: an RFC 3339 time in UTC; rules hit after it are left out.
    #[arg(long, requires = "rules")]
    since: Option<String>,
}

impl Status {
    pub fn execute(self) -> Result<ExitCode> {
        if self.rules {
            return self.unused_rules();
        }
        let Target { interface, bpffs } = &self.target;
        let report = report::report(
            bpffs,
            interface,
            self.state.as_deref(),
            self.read.max_state_bytes,
        )?;
        if self.json {
            print_json(&report)?;
        } else {
            print!("{report}");
        }
        Ok(ExitCode::SUCCESS)
    }

    /// `--rules`: each counted rule with its hits and last hit, those hit after `--since` left
    /// out.
    fn unused_rules(&self) -> Result<ExitCode> {
        let since = self
            .since
            .as_deref()
            .map(state::parse_time)
            .transpose()
            .map_err(|e| anyhow::anyhow!("--since: {e}"))?;
        let Target { interface, bpffs } = &self.target;
        let path = state_path(interface, self.state.as_deref())
            .context("no state file to read the rules from: pass --state (no agent runs here)")?;
        let desired = parse_state(&path, self.read)?;
        let unused = rules::unused_rules(bpffs, interface, &desired, since)?;
        if self.json {
            print_json(&unused)?;
        } else {
            print!("{unused}");
        }
        Ok(ExitCode::SUCCESS)
    }
}
