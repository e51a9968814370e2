//! `wgfence plan`: what `run` would change now.

use std::{path::PathBuf, process::ExitCode};

use anyhow::{bail, Result};
use wgfence::reconcile::preview;

use super::{check::Notes, parse_state, DatapathArgs, StateArgs, Target};

#[derive(Debug, clap::Args)]
pub struct Plan {
    #[command(flatten)]
    pub target: Target,
    /// The state file to compare with what is enforced.
    #[arg(long, short)]
    state: PathBuf,
    #[command(flatten)]
    read: StateArgs,
    /// `run`'s datapath settings, to compare with the kernel's settings entry.
    #[command(flatten)]
    datapath: DatapathArgs,
}

impl Plan {
    pub fn execute(self) -> Result<ExitCode> {
        let desired = parse_state(&self.state, self.read)?;
        print!("{}", Notes(&desired));
        let Target { interface, bpffs } = &self.target;
        let preview = preview(bpffs, interface, &desired, &self.datapath.settings())?;
        print!("{preview}");
        if let Err(unplanned) = &preview.planned {
            bail!(
                "the state cannot be applied whole: {}; `run` applies only the {} operations above",
                unplanned.error,
                unplanned.lead.ops.len()
            );
        }
        Ok(ExitCode::SUCCESS)
    }
}
