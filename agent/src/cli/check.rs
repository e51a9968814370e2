//! `wgfence check`: validates a state file.

use std::{fmt, path::PathBuf, process::ExitCode};

use anyhow::Result;
use wgfence::state::{self, DesiredState};

use super::{read_state, StateArgs};

#[derive(Debug, clap::Args)]
pub struct Check {
    #[arg(long, short)]
    state: PathBuf,
    #[command(flatten)]
    read: StateArgs,
}

impl Check {
    pub fn execute(self) -> Result<ExitCode> {
        match state::parse(&read_state(&self.state, self.read)?) {
            Ok(desired) => {
                print!("{}", Valid::new(&self.state, &desired));
                Ok(ExitCode::SUCCESS)
            }
            Err(e) => {
                eprintln!("{}: {e}", self.state.display());
                Ok(ExitCode::FAILURE)
            }
        }
    }
}

/// What `check` says of a valid state: its peers, restricted peers and policies (compiled,
/// shared by the peers whose rules compile the same), its policy tests, and the notes.
struct Valid<'a> {
    path: &'a std::path::Path,
    desired: &'a DesiredState,
}

impl<'a> Valid<'a> {
    fn new(path: &'a std::path::Path, desired: &'a DesiredState) -> Self {
        Self { path, desired }
    }
}

impl fmt::Display for Valid<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let desired = self.desired;
        writeln!(
            f,
            "{}: valid: {} peers ({} restricted), {} distinct policies",
            self.path.display(),
            desired.peers.len(),
            desired.restricted_peers(),
            state::distinct_policies(desired).len()
        )?;
        if !desired.tests.is_empty() {
            let n: usize = desired
                .tests
                .iter()
                .map(|t| t.accept.len() + t.deny.len())
                .sum();
            writeln!(
                f,
                "policy tests: {} tests, {n} assertions, all pass",
                desired.tests.len()
            )?;
        }
        write!(f, "{}", Notes(desired))
    }
}

/// The notes (not errors) on a valid state that `check` and `plan` print: the peers that may
/// send nothing.
pub struct Notes<'a>(pub &'a DesiredState);

impl fmt::Display for Notes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.allowed_nothing(f)?;
        self.expired(f)
    }
}

impl Notes<'_> {
    /// The peers whose `egress` is `[]`: they may send nothing. Older versions read
    /// `"egress": []` as unrestricted, so a file written for them says otherwise.
    fn allowed_nothing(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 20;
        let names = self.0.peers_allowed_nothing();
        if names.is_empty() {
            return Ok(());
        }
        let n = names.len();
        let mut list = names[..n.min(SHOWN)].join(", ");
        if n > SHOWN {
            list.push_str(&format!(" and {} more", n - SHOWN));
        }
        writeln!(
            f,
            "note: {n} peer{} with \"egress\": [] may send nothing ({}): {list}",
            if n == 1 { "" } else { "s" },
            if self.0.replies {
                "only replies"
            } else {
                "replies are off"
            }
        )
    }

    /// The peers whose window is already over: the state is valid, but they may send nothing.
    fn expired(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let now = wgfence::clock::unix_secs();
        for peer in self.0.peers.iter().filter(|p| p.window().is_past(now)) {
            writeln!(
                f,
                "note: peer {:?}: its window is already over (expires {}): it may send nothing",
                peer.name,
                peer.window()
                    .expires
                    .map(state::format_time)
                    .unwrap_or_default()
            )?;
        }
        Ok(())
    }
}
