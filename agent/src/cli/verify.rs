//! `wgfence verify`: the drift of the kernel from a state file.

use std::{path::PathBuf, process::ExitCode};

use anyhow::{bail, Context as _, Result};
use wgfence::{reconcile::read_pinned, verify::Verification};

use super::{parse_state, print_json, state_path, StateArgs, Target};

#[derive(Debug, clap::Args)]
pub struct Verify {
    #[command(flatten)]
    pub target: Target,
    /// State file to compare with (default: the running agent's).
    #[arg(long, short)]
    state: Option<PathBuf>,
    #[command(flatten)]
    read: StateArgs,
    /// Machine-readable output: a JSON array of {entry, what}.
    #[arg(long)]
    json: bool,
}

impl Verify {
    pub fn execute(self) -> Result<ExitCode> {
        let Target { interface, bpffs } = &self.target;
        let Some(path) = state_path(interface, self.state.as_deref()) else {
            bail!("no state file: pass --state (no agent runs on {interface} here)");
        };
        let desired = parse_state(&path, self.read)?;
        let (actual, _) = read_pinned(bpffs, interface)
            .with_context(|| format!("reading the pinned maps and the peers of {interface}"))?;
        let verification = Verification::of(&desired, &actual, &path);
        if self.json {
            print_json(&verification.drift)?;
        } else {
            print!("{verification}");
        }
        Ok(if verification.drift.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        })
    }
}
