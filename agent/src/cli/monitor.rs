//! `wgfence monitor`: the datapath's drop events, one a line.

use std::{io::Write as _, path::PathBuf, process::ExitCode, time::Duration};

use anyhow::Result;
use wgfence::monitor::Watch;

use super::{StateArgs, Target};

#[derive(Debug, clap::Args)]
pub struct Monitor {
    #[command(flatten)]
    pub target: Target,
    /// Only events from this peer (by name, from the state file).
    #[arg(long, short)]
    peer: Option<String>,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
    /// State file to name peers by (default: the running agent's).
    #[arg(long, short)]
    state: Option<PathBuf>,
    #[command(flatten)]
    state_args: StateArgs,
    /// Exit after this many events.
    #[arg(long, value_name = "N")]
    count: Option<u64>,
}

impl Monitor {
    pub fn execute(self) -> Result<ExitCode> {
        let Target { interface, bpffs } = &self.target;
        // A peer is found by its name in the state file: a file given that cannot be read or
        // is not valid is named as such, not reported as a peer it lacks.
        if let (Some(_), Some(path)) = (&self.peer, &self.state) {
            super::parse_state(path, self.state_args)?;
        }
        let mut watch = Watch::open(
            bpffs,
            interface,
            self.state.as_deref(),
            self.state_args.max_state_bytes,
            self.peer.as_deref(),
        )?;
        // On stderr, so stdout stays one event per line; scripts can wait for it.
        eprintln!("monitoring drop events on {interface}; Ctrl-C stops");
        let mut seen = 0u64;
        let stdout = std::io::stdout();
        loop {
            let views = watch.next(Duration::from_secs(1))?;
            let mut out = stdout.lock();
            for view in &views {
                if self.json {
                    writeln!(out, "{}", serde_json::to_string(view)?)?;
                } else {
                    writeln!(out, "{}", view.line())?;
                }
                seen += 1;
                if self.count.is_some_and(|n| seen >= n) {
                    out.flush()?;
                    return Ok(ExitCode::SUCCESS);
                }
            }
            out.flush()?;
        }
    }
}
