//! The `wgfence` command line: one file per subcommand, each with its options and what it
//! does; the library does the work and each report renders itself.

mod check;
mod detach;
mod explain;
mod monitor;
mod plan;
mod run;
mod status;
mod verify;

use std::{
    path::{Path, PathBuf},
    process::ExitCode,
    time::Duration,
};

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand, ValueEnum};
use wgfence::{
    dataplane::DEFAULT_BPFFS,
    input::{self, DEFAULT_MAX_STATE_BYTES},
    settings::DatapathSettings,
    state::{self, DesiredState},
    status::AgentStatus,
};

/// Per-peer egress policy for WireGuard gateways, enforced in the kernel by a tcx eBPF program.
///
/// The agent keeps each peer's allowed destinations in BPF maps attached to the WireGuard
/// interface and changes only the entries and WireGuard peers that differ from the state file.
/// Its programs, maps and links stay pinned (and enforcing) when the agent stops.
#[derive(Debug, Parser)]
#[command(name = "wgfence", version, propagate_version = true)]
pub struct Cli {
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true, env = "WGFENCE_LOG_FORMAT")]
    pub log_format: LogFormat,
    /// Log filter (tracing's EnvFilter syntax, e.g. `info`, `wgfence=debug`).
    #[arg(long, default_value = "info", global = true, env = "WGFENCE_LOG")]
    pub log: String,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Attach to the interface (adopting what is pinned) and enforce the state file, following
    /// its changes, until SIGTERM. The datapath stays attached when the agent stops.
    Run(run::Run),
    /// Validate a state file; exits non-zero and lists every error found.
    Check(check::Check),
    /// Print what `run` would change right now; changes nothing.
    Plan(plan::Plan),
    /// Programs, links, peers and counters of an interface.
    Status(status::Status),
    /// Stream the datapath's drop events (peer, reason, protocol, addresses, ports) while the
    /// agent runs, like `cilium monitor --type drop`. Events are rate-limited in the kernel.
    Monitor(monitor::Monitor),
    /// Why a packet from a peer passes or is dropped. The verdict is the live program's own:
    /// the attached datapath object run on a synthetic packet under BPF_PROG_TEST_RUN against
    /// the pinned peer, policy, flow and settings maps (nothing live moves: no counter, drop
    /// event or flow timestamp). With the reason: the peer entry, the policy id, the matching
    /// trie prefix, the allow entry that matched (or those that did not) and the state-file
    /// rules each came from, whether a reply flow lets it pass, and whether the state file's
    /// entries decide the same.
    Explain(explain::Explain),
    /// Compare every pinned map entry and the WireGuard peers' allowed IPs with what the state
    /// file compiles to; exit 1 naming each entry that differs (drift: a change behind the
    /// agent's back, which its next resync repairs).
    Verify(verify::Verify),
    /// Remove the programs, links and pinned maps of an interface. Peers lose their policy:
    /// traffic is no longer filtered. Works while an agent runs: the agent lets go of its links
    /// within a second, and detach returns once they are gone (the programs are off the
    /// interface), or fails naming who still holds them.
    Detach(detach::Detach),
}

impl Command {
    pub fn execute(self) -> Result<ExitCode> {
        match self {
            Self::Run(c) => c.execute(),
            Self::Check(c) => c.execute(),
            Self::Plan(c) => c.execute(),
            Self::Status(c) => c.execute(),
            Self::Monitor(c) => c.execute(),
            Self::Explain(c) => c.execute(),
            Self::Verify(c) => c.execute(),
            Self::Detach(c) => c.execute(),
        }
    }
}

/// The interface a command acts on, and where its pins live.
#[derive(Debug, clap::Args)]
pub struct Target {
    /// The WireGuard interface (must exist; its key and port are yours to manage).
    #[arg(long, short)]
    pub interface: String,
    /// Where bpffs is mounted; pins go to <bpffs>/wgfence/<interface>/.
    #[arg(long, default_value = DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
}

/// Reply flows (replies to what the network starts toward a restricted peer pass its policy,
/// while the state's "replies" is true) and drop events for `wgfence monitor`.
#[derive(Debug, clap::Args)]
pub struct DatapathArgs {
    /// Seconds an open TCP flow toward a peer lives without packets.
    #[arg(long, value_name = "SECS", default_value_t = DEFAULTS.tcp_timeout.as_secs(), value_parser = secs())]
    flow_timeout_tcp: u64,
    /// Seconds a TCP flow lives without packets after a FIN or an RST.
    #[arg(long, value_name = "SECS", default_value_t = DEFAULTS.tcp_closing_timeout.as_secs(), value_parser = secs())]
    flow_timeout_tcp_closing: u64,
    /// Seconds a UDP flow toward a peer lives without packets.
    #[arg(long, value_name = "SECS", default_value_t = DEFAULTS.udp_timeout.as_secs(), value_parser = secs())]
    flow_timeout_udp: u64,
    /// Seconds an ICMP echo flow toward a peer lives without packets.
    #[arg(long, value_name = "SECS", default_value_t = DEFAULTS.icmp_timeout.as_secs(), value_parser = secs())]
    flow_timeout_icmp: u64,
    /// Seconds a flow toward a peer lives without packets while the peer has not answered on
    /// it (an unanswered SYN, say), when shorter than its protocol's timeout: a flood toward a
    /// silent peer holds its flow quota only this long.
    #[arg(long, value_name = "SECS", default_value_t = DEFAULTS.unanswered_timeout.as_secs(), value_parser = secs())]
    flow_timeout_unanswered: u64,
    /// Drop events per second for `wgfence monitor`, node-wide (rate-limited in the kernel);
    /// 0 switches them off.
    #[arg(long, value_name = "N", default_value_t = DEFAULTS.events_per_second)]
    drop_events_per_second: u32,
    /// Reply flows one peer may hold at once (IPv4 and IPv6 together). Past it, the network's
    /// new flows toward that peer get no reply passing until old ones expire; no peer can take
    /// another's room. 0 records no flows.
    #[arg(long, value_name = "N", default_value_t = DEFAULTS.flows_per_peer)]
    flows_per_peer: u32,
}

const DEFAULTS: DatapathSettings = DatapathSettings::DEFAULT;

/// A timeout in whole seconds, at least 1.
fn secs() -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(1..)
}

impl DatapathArgs {
    pub fn settings(&self) -> DatapathSettings {
        DatapathSettings {
            tcp_timeout: Duration::from_secs(self.flow_timeout_tcp),
            tcp_closing_timeout: Duration::from_secs(self.flow_timeout_tcp_closing),
            udp_timeout: Duration::from_secs(self.flow_timeout_udp),
            icmp_timeout: Duration::from_secs(self.flow_timeout_icmp),
            unanswered_timeout: Duration::from_secs(self.flow_timeout_unanswered),
            events_per_second: self.drop_events_per_second,
            flows_per_peer: self.flows_per_peer,
        }
    }
}

/// How a command reads a state file (every command that reads one takes these).
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct StateArgs {
    /// The largest state file read, in bytes: a larger one (or one that grows past it while
    /// it is read) is refused before it is read, and `run` keeps the last good state. The
    /// default is the maps' 131,072 peers at 2 KiB each.
    #[arg(long, value_name = "BYTES", default_value_t = DEFAULT_MAX_STATE_BYTES,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_state_bytes: u64,
}

/// Reads the state file at `path` as text: a regular file (opened without blocking, see
/// [`wgfence::input`]) of at most `args.max_state_bytes`.
fn read_state(path: &Path, args: StateArgs) -> Result<String> {
    let bytes = input::read(path, args.max_state_bytes)
        .with_context(|| format!("reading the state file {}", path.display()))?;
    String::from_utf8(bytes).with_context(|| format!("{}: not UTF-8", path.display()))
}

/// Reads and validates the state file at `path`; its errors are named after it.
fn parse_state(path: &Path, args: StateArgs) -> Result<DesiredState> {
    state::parse(&read_state(path, args)?).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// The state file a command compares with: `--state`, else the running agent's.
fn state_path(interface: &str, state: Option<&Path>) -> Option<PathBuf> {
    state
        .map(Path::to_path_buf)
        .or_else(|| AgentStatus::read(interface).ok().map(|a| a.state_file))
        // An agent on the Kubernetes source has no state file.
        .filter(|p| !p.as_os_str().is_empty())
}

/// `value` as indented JSON on stdout.
fn print_json(value: &impl serde::Serialize) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn run_takes_a_file_or_a_secret_never_both() {
        let parse = |args: &[&str]| {
            let mut all = vec!["wgfence", "run", "--interface", "wg0"];
            all.extend_from_slice(args);
            Cli::try_parse_from(&all)
        };
        assert!(parse(&["--state", "s.json"]).is_ok());
        assert!(parse(&["--source", "kubernetes", "--secret", "ns/state"]).is_ok());
        assert!(parse(&["--source", "kubernetes", "--secret", "ns/s", "--key", "k"]).is_ok());
        // Each source needs its own argument, and takes no other's.
        assert!(parse(&[]).is_err());
        assert!(parse(&["--source", "kubernetes"]).is_err());
        assert!(parse(&["--state", "s.json", "--secret", "ns/state"]).is_err());
        assert!(parse(&["--state", "s.json", "--kubeconfig", "k"]).is_err());
    }

    #[test]
    fn every_interface_command_takes_the_same_target_options() {
        for cmd in [
            "run", "plan", "status", "monitor", "detach", "explain", "verify",
        ] {
            let mut args = vec!["wgfence", cmd, "--interface", "wg0", "--bpffs", "/tmp/x"];
            if cmd == "run" || cmd == "plan" {
                args.extend(["--state", "s.json"]);
            }
            if cmd == "explain" {
                args.extend(["--from", "10.8.0.2", "--to", "10.0.0.1", "--port", "443"]);
            }
            let cli = Cli::try_parse_from(&args).unwrap_or_else(|e| panic!("{cmd}: {e}"));
            let target = match cli.command {
                Command::Run(c) => c.target,
                Command::Plan(c) => c.target,
                Command::Status(c) => c.target,
                Command::Monitor(c) => c.target,
                Command::Detach(c) => c.target,
                Command::Explain(c) => c.target,
                Command::Verify(c) => c.target,
                Command::Check(_) => unreachable!(),
            };
            assert_eq!(
                (target.interface.as_str(), target.bpffs.as_path()),
                ("wg0", Path::new("/tmp/x"))
            );
        }
    }
}
