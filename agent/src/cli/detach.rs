//! `wgfence detach`: removes the datapath of an interface.

use std::{process::ExitCode, time::Duration};

use anyhow::{Context as _, Result};
use wgfence::dataplane::{pin_dir, Dataplane, DETACH_TIMEOUT};

use super::{secs, Target};

#[derive(Debug, clap::Args)]
pub struct Detach {
    #[command(flatten)]
    pub target: Target,
    /// Seconds to wait for a running agent to let go of the links.
    #[arg(long, value_name = "SECS", default_value_t = DETACH_TIMEOUT.as_secs(), value_parser = secs())]
    timeout: u64,
}

impl Detach {
    pub fn execute(self) -> Result<ExitCode> {
        let Target { interface, bpffs } = &self.target;
        if Dataplane::detach_within(bpffs, interface, Duration::from_secs(self.timeout))
            .with_context(|| format!("detaching from {interface}"))?
        {
            println!(
                "detached: removed the link and maps under {}",
                pin_dir(bpffs, interface).display()
            );
        } else {
            println!("nothing was pinned for {interface}");
        }
        Ok(ExitCode::SUCCESS)
    }
}
