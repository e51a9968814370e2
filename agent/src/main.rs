//! The `wgfence` command line.

use std::{
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    process::ExitCode,
    time::Duration,
};

use anyhow::{bail, Context as _, Result};
use clap::{Parser, Subcommand, ValueEnum};
use tracing_subscriber::{fmt, EnvFilter};
use wgfence::{
    daemon::{self, RunOptions},
    dataplane::{pin_dir, Dataplane, HookMode, DEFAULT_BPFFS, DETACH_TIMEOUT},
    monitor::{Clock, EventView, Monitor},
    plan::{plan, plan_settings, Actual, ActualMaps},
    reconcile::read_maps,
    settings::{online_cpus, DatapathSettings},
    state,
    status::{self, Report},
    wg::WireGuard,
};

/// Per-peer egress policy for WireGuard gateways, enforced in the kernel by a tcx eBPF program.
///
/// The agent keeps each peer's allowed destinations in BPF maps attached to the WireGuard
/// interface and changes only the entries and WireGuard peers that differ from the state file.
/// Its program, maps and link stay pinned (and enforcing) when the agent stops.
#[derive(Debug, Parser)]
#[command(name = "wgfence", version, propagate_version = true)]
struct Cli {
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true, env = "WGFENCE_LOG_FORMAT")]
    log_format: LogFormat,
    /// Log filter (tracing's EnvFilter syntax, e.g. `info`, `wgfence=debug`).
    #[arg(long, default_value = "info", global = true, env = "WGFENCE_LOG")]
    log: String,
    #[command(subcommand)]
    command: Command,
}

/// `--attach`.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum AttachHook {
    Auto,
    Tcx,
    Tc,
}

impl From<AttachHook> for HookMode {
    fn from(hook: AttachHook) -> Self {
        match hook {
            AttachHook::Auto => HookMode::Auto,
            AttachHook::Tcx => HookMode::Tcx,
            AttachHook::Tc => HookMode::Tc,
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Attach to the interface (adopting what is pinned) and enforce the state file, following
    /// its changes, until SIGTERM. The datapath stays attached when the agent stops.
    Run {
        #[command(flatten)]
        target: Target,
        /// The state file. Its directory is watched, so Kubernetes volume updates (a `..data`
        /// symlink swap), in-place edits and renames all apply within a second.
        #[arg(long, short)]
        state: PathBuf,
        /// Serve /metrics, /healthz and /readyz here (use 0.0.0.0:9586 to expose beyond the node).
        #[arg(long, default_value = "127.0.0.1:9586")]
        metrics_addr: SocketAddr,
        /// Don't serve metrics at all.
        #[arg(long, conflicts_with = "metrics_addr")]
        no_metrics: bool,
        /// Also serve /healthz and /readyz here, on a listener of their own with its own small
        /// connection limit, for the kubelet's probes: clients of the metrics port cannot
        /// starve them. The DaemonSet uses 127.0.0.1:9587 (pods cannot reach the node's
        /// loopback).
        #[arg(long)]
        health_addr: Option<SocketAddr>,
        /// Seconds between full resyncs, which re-read the kernel and repair drift (a map
        /// entry or WireGuard peer changed behind the agent's back).
        #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
        resync: u64,
        /// Export per-peer packet counters (a `peer` label per peer: costly at scale).
        #[arg(long)]
        peer_metrics: bool,
        /// Compile the datapath's debug log in and forward it to this log (costs a ring buffer
        /// write per dropped packet).
        #[arg(long)]
        datapath_debug: bool,
        #[command(flatten)]
        datapath: DatapathArgs,
        /// The hook: `tcx` (Linux 6.6+), `tc` (a clsact qdisc with direct-action filters at
        /// priority 1, handle 0x77670001; any supported kernel), or `auto`: tcx where the
        /// kernel has it, else tc.
        #[arg(long, value_enum, default_value_t = AttachHook::Auto)]
        attach: AttachHook,
        /// Read the state file even if users other than root can change it (it, a directory
        /// on its path or a symlink's target is group/world-writable or another user's). By
        /// default the agent refuses to start, and refuses such a file while it runs.
        #[arg(long)]
        allow_insecure_state: bool,
    },
    /// Validate a state file; exits non-zero and lists every error found.
    Check {
        #[arg(long, short)]
        state: PathBuf,
    },
    /// Print what `run` would change right now; changes nothing.
    Plan {
        #[command(flatten)]
        target: Target,
        /// The state file to compare with what is enforced.
        #[arg(long, short)]
        state: PathBuf,
        /// `run`'s datapath settings, to compare with the kernel's settings entry.
        #[command(flatten)]
        datapath: DatapathArgs,
    },
    /// Program, link, peers and counters of an interface.
    Status {
        #[command(flatten)]
        target: Target,
        /// Machine-readable output (schema in docs/operations.md).
        #[arg(long)]
        json: bool,
        /// State file to name peers by (default: the running agent's).
        #[arg(long, short)]
        state: Option<PathBuf>,
        /// List the rules of the applied policies with their hit counters instead: those with
        /// no hit since `--since` (default: none ever), to prune.
        #[arg(long)]
        rules: bool,
        /// With `--rules`: an RFC 3339 time in UTC; rules hit after it are left out.
        #[arg(long, requires = "rules")]
        since: Option<String>,
    },
    /// Stream the datapath's drop events (peer, reason, protocol, addresses, ports) while the
    /// agent runs, like `cilium monitor --type drop`. Events are rate-limited in the kernel.
    Monitor {
        #[command(flatten)]
        target: Target,
        /// Only events from this peer (by name, from the state file).
        #[arg(long, short)]
        peer: Option<String>,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
        /// State file to name peers by (default: the running agent's).
        #[arg(long, short)]
        state: Option<PathBuf>,
        /// Exit after this many events.
        #[arg(long, value_name = "N")]
        count: Option<u64>,
    },
    /// Why a packet from a peer passes or is dropped. The verdict is the live program's own:
    /// the attached datapath object run on a synthetic packet under BPF_PROG_TEST_RUN against
    /// the pinned peer, policy, flow and settings maps (nothing live moves: no counter, drop
    /// event or flow timestamp). With the reason: the peer entry, the policy id, the matching
    /// trie prefix, the allow entry that matched (or those that did not) and the state-file
    /// rules each came from, whether a reply flow lets it pass, and whether the state file's
    /// entries decide the same.
    Explain {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        request: ExplainRequest,
        /// State file to compare with and name rules by (default: the running agent's).
        #[arg(long, short)]
        state: Option<PathBuf>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Compare every pinned map entry and the WireGuard peers' allowed IPs with what the state
    /// file compiles to; exit 1 naming each entry that differs (drift: a change behind the
    /// agent's back, which its next resync repairs).
    Verify {
        #[command(flatten)]
        target: Target,
        /// State file to compare with (default: the running agent's).
        #[arg(long, short)]
        state: Option<PathBuf>,
        /// Machine-readable output: a JSON array of {entry, what}.
        #[arg(long)]
        json: bool,
    },
    /// Remove the program, link and pinned maps of an interface. Peers lose their policy:
    /// traffic is no longer filtered. Works while an agent runs: the agent lets go of its links
    /// within a second, and detach returns once they are gone (the programs are off the
    /// interface), or fails naming who still holds them.
    Detach {
        #[command(flatten)]
        target: Target,
        /// Seconds to wait for a running agent to let go of the links.
        #[arg(long, value_name = "SECS", default_value_t = DETACH_TIMEOUT.as_secs(), value_parser = secs())]
        timeout: u64,
    },
}

/// Reply flows (replies to what the network starts toward a restricted peer pass its policy,
/// while the state's "replies" is true) and drop events for `wgfence monitor`.
#[derive(Debug, clap::Args)]
struct DatapathArgs {
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
    fn settings(&self) -> DatapathSettings {
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

/// The interface a command acts on, and where its pins live.
#[derive(Debug, clap::Args)]
struct Target {
    /// The WireGuard interface (must exist; its key and port are yours to manage).
    #[arg(long, short)]
    interface: String,
    /// Where bpffs is mounted; pins go to <bpffs>/wgfence/<interface>/.
    #[arg(long, default_value = DEFAULT_BPFFS)]
    bpffs: PathBuf,
}

fn init_logging(format: LogFormat, filter: &str) -> Result<()> {
    let filter = EnvFilter::try_new(filter).with_context(|| format!("log filter {filter:?}"))?;
    let builder = fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    }
    .map_err(|e| anyhow::anyhow!("{e}"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = init_logging(cli.log_format, &cli.log) {
        eprintln!("error: {}", wgfence::error_chain(e.as_ref()));
        return ExitCode::from(2);
    }
    match dispatch(cli.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", wgfence::error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

fn dispatch(command: Command) -> Result<ExitCode> {
    match command {
        Command::Run {
            target: Target { interface, bpffs },
            state,
            metrics_addr,
            no_metrics,
            health_addr,
            resync,
            peer_metrics,
            datapath_debug,
            datapath,
            attach,
            allow_insecure_state,
        } => {
            daemon::run(RunOptions {
                interface: interface.clone(),
                state,
                bpffs,
                metrics_addr: (!no_metrics).then_some(metrics_addr),
                health_addr,
                resync: Duration::from_secs(resync),
                peer_metrics,
                datapath_debug,
                settings: datapath.settings(),
                hook: attach.into(),
                allow_insecure_state,
            })
            .with_context(|| format!("wgfence run on {interface}"))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Check { state } => check(&state),
        Command::Plan {
            target,
            state,
            datapath,
        } => plan_command(
            &target.interface,
            &state,
            &target.bpffs,
            &datapath.settings(),
        ),
        Command::Status {
            target: Target { interface, bpffs },
            json,
            state,
            rules: true,
            since,
        } => unused_rules(&bpffs, &interface, state.as_deref(), since.as_deref(), json),
        Command::Status {
            target: Target { interface, bpffs },
            json,
            state,
            ..
        } => {
            let report = status::report(&bpffs, &interface, state.as_deref())?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print_status(&report);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Monitor {
            target: Target { interface, bpffs },
            peer,
            json,
            state,
            count,
        } => monitor(
            &bpffs,
            &interface,
            peer.as_deref(),
            json,
            state.as_deref(),
            count,
        ),
        Command::Explain {
            target,
            request,
            state,
            json,
        } => explain_command(&target, &request, state.as_deref(), json),
        Command::Verify {
            target,
            state,
            json,
        } => verify_command(&target, state.as_deref(), json),
        Command::Detach {
            target: Target { interface, bpffs },
            timeout,
        } => {
            if Dataplane::detach_within(&bpffs, &interface, Duration::from_secs(timeout))
                .with_context(|| format!("detaching from {interface}"))?
            {
                println!(
                    "detached: removed the link and maps under {}",
                    pin_dir(&bpffs, &interface).display()
                );
            } else {
                println!("nothing was pinned for {interface}");
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn read_state(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

fn check(path: &Path) -> Result<ExitCode> {
    match state::parse(&read_state(path)?) {
        Ok(desired) => {
            println!(
                "{}: valid: {} peers ({} restricted), {} distinct policies",
                path.display(),
                desired.peers.len(),
                desired.restricted_peers(),
                state::distinct_policies(&desired).len()
            );
            if !desired.tests.is_empty() {
                let n: usize = desired
                    .tests
                    .iter()
                    .map(|t| t.accept.len() + t.deny.len())
                    .sum();
                println!(
                    "policy tests: {} tests, {n} assertions, all pass",
                    desired.tests.len()
                );
            }
            note_allowed_nothing(&desired);
            note_expired(&desired);
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("{}: {e}", path.display());
            Ok(ExitCode::FAILURE)
        }
    }
}

/// A note (not an error) naming the peers whose `egress` is `[]`: they may send nothing. Older
/// versions read `"egress": []` as unrestricted, so a file written for them says otherwise.
fn note_allowed_nothing(desired: &state::DesiredState) {
    const SHOWN: usize = 20;
    let names = desired.peers_allowed_nothing();
    if names.is_empty() {
        return;
    }
    let n = names.len();
    let mut list = names[..n.min(SHOWN)].join(", ");
    if n > SHOWN {
        list.push_str(&format!(" and {} more", n - SHOWN));
    }
    println!(
        "note: {n} peer{} with \"egress\": [] may send nothing ({}): {list}",
        if n == 1 { "" } else { "s" },
        if desired.replies {
            "only replies"
        } else {
            "replies are off"
        }
    );
}

/// A note (not an error) naming the peers whose window is already over: the state is valid,
/// but they may send nothing.
fn note_expired(desired: &state::DesiredState) {
    let now = wgfence::clock::unix_secs();
    for peer in desired.peers.iter().filter(|p| p.window.is_past(now)) {
        println!(
            "note: peer {:?}: its window is already over (expires {}): it may send nothing",
            peer.name,
            peer.window
                .expires
                .map(state::format_time)
                .unwrap_or_default()
        );
    }
}

/// Prints the plan `run` would apply now: the same planner, the same settings entry.
fn plan_command(
    interface: &str,
    state_path: &Path,
    bpffs: &Path,
    settings: &DatapathSettings,
) -> Result<ExitCode> {
    let desired = match state::parse(&read_state(state_path)?) {
        Ok(desired) => desired,
        Err(e) => bail!("{}: {e}", state_path.display()),
    };
    note_allowed_nothing(&desired);
    note_expired(&desired);
    let (maps, config) = if pin_dir(bpffs, interface).exists() {
        let pinned = Dataplane::open_maps(bpffs, interface)?;
        (read_maps(&pinned)?, Some(pinned.config()?))
    } else {
        println!("note: nothing is pinned for {interface}; planning against empty maps");
        (ActualMaps::default(), None)
    };
    let wg = WireGuard::open(interface)?.read()?;
    let want = settings.config(desired.replies, online_cpus());
    let plan = match plan(&desired, &Actual::new(maps, wg)) {
        Ok(plan) => plan.with_settings(plan_settings(&want, config.as_ref())),
        Err(unplanned) => {
            for op in &unplanned.lead.ops {
                println!("{op}");
            }
            bail!(
                "the state cannot be applied whole: {}; `run` applies only the {} operations above",
                unplanned.error,
                unplanned.lead.ops.len()
            );
        }
    };
    for op in &plan.ops {
        println!("{op}");
    }
    println!(
        "{} map writes, {} WireGuard peer changes",
        plan.map_writes(),
        plan.wg_changes()
    );
    Ok(ExitCode::SUCCESS)
}

fn print_status(r: &Report) {
    println!("interface        {}", r.interface);
    println!(
        "datapath         {} (layout v{}{}, pins in {})",
        if r.attached {
            "attached"
        } else {
            "NOT attached (no pinned link, no filter)"
        },
        r.layout_version,
        r.program_variant
            .map(|v| format!(", {v} programs"))
            .unwrap_or_default(),
        r.pin_dir.display()
    );
    match (&r.hook, r.tc_priority, &r.tc_handle) {
        (Some(hook), Some(prio), Some(handle)) => println!(
            "hook             {hook} (clsact, direct-action filters at priority {prio}, handle {handle})"
        ),
        (Some(hook), _, _) => println!("hook             {hook}"),
        (None, _, _) => {}
    }
    if let (Some(link), Some(prog)) = (r.link_id, r.program_id) {
        println!("link             id {link}, program id {prog} (bpftool link show id {link})");
    }
    if let (None, Some(prog)) = (r.link_id, r.program_id) {
        println!("ingress filter   program id {prog} (bpftool prog show id {prog})");
    }
    match (r.egress_link_id, r.egress_program_id) {
        (Some(link), Some(prog)) => {
            println!("egress link      id {link}, program id {prog} (reply flows)")
        }
        (None, Some(prog)) => println!("egress filter    program id {prog} (reply flows)"),
        _ if r.attached => {
            println!("egress link      NOT pinned: replies to network-started flows do not pass")
        }
        _ => {}
    }
    match &r.agent {
        Some(a) => {
            let last = &a.last_reconcile;
            println!(
                "agent            pid {}, {}{}",
                a.pid,
                if a.ready { "ready" } else { "NOT ready" },
                if a.reason.is_empty() {
                    String::new()
                } else {
                    format!(": {}", a.reason)
                }
            );
            println!("state file       {}", a.state_file.display());
            if last.ok {
                println!(
                    "last reconcile   ok, {} ops ({} map writes, {} WireGuard peer updates) in {:.1} ms",
                    last.ops, last.map_writes, last.wireguard_peer_updates, last.duration_ms
                );
            } else {
                println!(
                    "last reconcile   FAILED: {}",
                    last.error.as_deref().unwrap_or("unknown error")
                );
            }
        }
        None => println!("agent            no status snapshot (agent not running here?)"),
    }
    println!(
        "peers            {} IPv4 + {} IPv6 entries; {} restricted, {} unrestricted",
        r.peers.ipv4_entries, r.peers.ipv6_entries, r.peers.restricted, r.peers.unrestricted
    );
    println!(
        "policies         {} distinct, {} trie entries",
        r.policies, r.policy_entries
    );
    let fmt_map = |m: &std::collections::BTreeMap<String, u64>| {
        m.iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    println!("passed           {}", fmt_map(&r.passed));
    println!("dropped          {}", fmt_map(&r.dropped));
    if !r.peer_counters.is_empty() {
        println!();
        println!(
            "{:<24} {:<32} {:>7} {:>12} {:>12}  {:<7} {:>12}  WINDOW",
            "PEER", "ADDRESSES", "POLICY", "PASSED", "DROPPED", "MODE", "WOULD-DROP"
        );
        for p in &r.peer_counters {
            let addrs = p
                .addresses
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",");
            let policy = if p.policy == 0 {
                "-".to_owned()
            } else {
                p.policy.to_string()
            };
            let would_drop = if p.mode == "audit" {
                p.would_drop_packets.to_string()
            } else {
                "-".to_owned()
            };
            let window = p.window.as_ref().map_or("-".to_owned(), |w| w.text());
            println!(
                "{:<24} {:<32} {:>7} {:>12} {:>12}  {:<7} {:>12}  {}",
                p.peer.as_deref().unwrap_or("?"),
                addrs,
                policy,
                p.pass_packets,
                p.drop_packets,
                p.mode,
                would_drop,
                window
            );
        }
    }
}

/// `wgfence status --rules`: each counted rule with its hits and last hit, those hit after
/// `since` left out.
fn unused_rules(
    bpffs: &Path,
    interface: &str,
    state: Option<&Path>,
    since: Option<&str>,
    json: bool,
) -> Result<ExitCode> {
    let since = since
        .map(state::parse_time)
        .transpose()
        .map_err(|e| anyhow::anyhow!("--since: {e}"))?;
    let agent = status::AgentStatus::read(interface).ok();
    let path = state
        .map(Path::to_path_buf)
        .or_else(|| agent.map(|a| a.state_file))
        .context("no state file to read the rules from: pass --state (no agent runs here)")?;
    let desired = state::parse(&read_state(&path)?)
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let maps = Dataplane::open_maps(bpffs, interface)?;
    let rows = status::rule_rows(&desired, |a| maps.peer(a).ok().flatten());
    let offset = wgfence::clock::wall_minus_boot_ns();
    let now = wgfence::clock::now_ns(libc::CLOCK_BOOTTIME);
    let mut out = Vec::new();
    for row in rows {
        let c = maps.rule_counters(row.counter)?;
        let last = maps
            .rule_last_hit(row.counter, now)?
            .map(|ns| u64::try_from(wgfence::clock::to_wall_secs(ns, offset)).unwrap_or_default());
        // Hit after `since` (by default: hit at all): in use, not listed.
        let in_use = match (since, last) {
            (Some(since), Some(last)) => last >= since,
            (None, Some(_)) => true,
            (_, None) => false,
        };
        if in_use {
            continue;
        }
        out.push(serde_json::json!({
            "policy": row.policy,
            "rule": row.rule,
            "counter": row.counter,
            "packets": c.packets,
            "bytes": c.bytes,
            "lastHit": last.map(state::format_time),
        }));
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(ExitCode::SUCCESS);
    }
    let what = since.map_or("never hit".to_owned(), |t| {
        format!("not hit since {}", state::format_time(t))
    });
    println!(
        "{} rule{} {what}:",
        out.len(),
        if out.len() == 1 { "" } else { "s" }
    );
    println!(
        "{:>7}  {:<40} {:>12} {:>14}  LAST HIT",
        "POLICY", "RULE", "PACKETS", "BYTES"
    );
    for r in &out {
        println!(
            "{:>7}  {:<40} {:>12} {:>14}  {}",
            r["policy"],
            r["rule"].as_str().unwrap_or_default(),
            r["packets"],
            r["bytes"],
            r["lastHit"].as_str().unwrap_or("never")
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// What `explain` is asked about: one packet.
#[derive(Debug, clap::Args)]
struct ExplainRequest {
    /// The sending peer, by name (its address of the destination's family).
    #[arg(long, required_unless_present = "from", conflicts_with = "from")]
    peer: Option<String>,
    /// The sending address (any: an unknown source is dropped).
    #[arg(long)]
    from: Option<IpAddr>,
    /// The destination address.
    #[arg(long)]
    to: IpAddr,
    /// tcp, udp, icmp (ICMPv6 toward an IPv6 destination) or an IP protocol number.
    #[arg(long, default_value = "tcp")]
    proto: String,
    /// Destination port (tcp and udp; required for them).
    #[arg(long)]
    port: Option<u16>,
    /// Source port (tcp and udp), e.g. to ask whether a reply on a flow passes.
    #[arg(long, value_name = "PORT")]
    from_port: Option<u16>,
    /// ICMP type (default: echo request).
    #[arg(long, value_name = "TYPE")]
    icmp_type: Option<u8>,
    /// ICMP echo identifier (to ask whether an echo reply answers a flow).
    #[arg(long, value_name = "ID")]
    icmp_id: Option<u16>,
    /// A non-first fragment of the packet (no transport header).
    #[arg(long)]
    fragment: bool,
}

/// The protocol number of `--proto`.
fn protocol_number(proto: &str) -> Result<u8> {
    Ok(match proto {
        "tcp" => wgfence_common::PROTO_TCP,
        "udp" => wgfence_common::PROTO_UDP,
        "icmp" | "icmpv6" => wgfence_common::PROTO_ICMP,
        n => n
            .parse()
            .with_context(|| format!("--proto {n:?}: tcp, udp, icmp or a protocol number"))?,
    })
}

/// The state file `explain` and `verify` compare with: `--state`, else the running agent's.
fn state_path(interface: &str, state: Option<&Path>) -> Option<PathBuf> {
    state.map(Path::to_path_buf).or_else(|| {
        status::AgentStatus::read(interface)
            .ok()
            .map(|a| a.state_file)
    })
}

fn explain_command(
    target: &Target,
    request: &ExplainRequest,
    state: Option<&Path>,
    json: bool,
) -> Result<ExitCode> {
    use wgfence::explain::{kernel::KernelProbe, report, source::SourceMap, Probe};

    let path = state_path(&target.interface, state);
    let text = path.as_deref().map(read_state).transpose()?;
    let desired = match (&path, &text) {
        // Unchecked: a state whose policy tests fail is exactly one to ask why of.
        (Some(path), Some(text)) => match state::parse_unchecked(text) {
            Ok(desired) => Some(desired),
            Err(e) => bail!("{}: {e}", path.display()),
        },
        _ => None,
    };
    let src = match (&request.peer, request.from) {
        (_, Some(from)) => from,
        (Some(name), None) => {
            let Some(desired) = &desired else {
                bail!(
                    "--peer needs a state file to find {name:?} in (pass --state, or --from ADDR)"
                );
            };
            let Some(peer) = desired.peers.iter().find(|p| &p.name == name) else {
                bail!("no peer named {name:?} in the state file");
            };
            let Some(addr) = peer.addrs().find(|a| a.is_ipv4() == request.to.is_ipv4()) else {
                bail!(
                    "peer {name:?} has no IPv{} address to send to {} from",
                    if request.to.is_ipv4() { 4 } else { 6 },
                    request.to
                );
            };
            addr
        }
        (None, None) => bail!("--peer NAME or --from ADDR is required"),
    };
    if src.is_ipv4() != request.to.is_ipv4() {
        bail!(
            "--from {src} and --to {} are of different address families",
            request.to
        );
    }
    let protocol = protocol_number(&request.proto)?;
    let has_ports = protocol == wgfence_common::PROTO_TCP || protocol == wgfence_common::PROTO_UDP;
    let port = match request.port {
        Some(port) => port,
        None if has_ports => bail!("--port is required for --proto {}", request.proto),
        None => 0,
    };
    let mut probe = Probe::new(src, request.to, protocol, port);
    if let Some(p) = request.from_port {
        probe.src_port = p;
    }
    if let Some(t) = request.icmp_type {
        probe.icmp_type = t;
    }
    if let Some(id) = request.icmp_id {
        probe.icmp_id = id;
    }
    probe.later_fragment = request.fragment;

    let mut kernel = KernelProbe::open(&target.bpffs, &target.interface).with_context(|| {
        format!(
            "loading the datapath against the pins of {}",
            target.interface
        )
    })?;
    let live = read_maps(kernel.live())?;
    let config = kernel.live().config()?;
    let file = match (&path, &desired, &text) {
        (Some(path), Some(desired), Some(text)) => Some(report::StateFile {
            path: path.display().to_string(),
            state: desired,
            sources: SourceMap::new(text, desired),
        }),
        _ => None,
    };
    let report = report::explain(&mut kernel, &live, config, file.as_ref(), &probe)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.text());
    }
    Ok(ExitCode::SUCCESS)
}

fn verify_command(target: &Target, state: Option<&Path>, json: bool) -> Result<ExitCode> {
    let Some(path) = state_path(&target.interface, state) else {
        bail!(
            "no state file: pass --state (no agent runs on {} here)",
            target.interface
        );
    };
    let desired = match state::parse(&read_state(&path)?) {
        Ok(desired) => desired,
        Err(e) => bail!("{}: {e}", path.display()),
    };
    let pinned = Dataplane::open_maps(&target.bpffs, &target.interface)
        .with_context(|| format!("opening the pinned maps of {}", target.interface))?;
    let maps = read_maps(&pinned)?;
    let wg = WireGuard::open(&target.interface)?.read()?;
    let actual = Actual::new(maps, wg);
    // A peer whose window is over is revoked: its absence is no drift.
    let desired = desired.unexpired(wgfence::clock::unix_secs());
    let drift = wgfence::verify::drift_of(&desired, &actual);
    if json {
        println!("{}", serde_json::to_string_pretty(&drift)?);
    } else if drift.is_empty() {
        println!(
            "no drift: the {} peer entries, {} trie entries and {} WireGuard peers are what \
             {} compiles to",
            actual.maps().peers.len(),
            actual
                .maps()
                .policies
                .values()
                .map(|p| p.len())
                .sum::<usize>(),
            actual.wg().peers.len(),
            path.display()
        );
    } else {
        println!(
            "DRIFT: {} {} from {}:",
            drift.len(),
            if drift.len() == 1 {
                "entry differs"
            } else {
                "entries differ"
            },
            path.display()
        );
        for d in &drift {
            println!("  {d}");
        }
    }
    Ok(if drift.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// How often `monitor` re-reads the state file for peer names.
const NAMES_REFRESH: Duration = Duration::from_secs(2);

fn monitor(
    bpffs: &std::path::Path,
    interface: &str,
    peer: Option<&str>,
    json: bool,
    state: Option<&std::path::Path>,
    count: Option<u64>,
) -> Result<ExitCode> {
    use std::io::Write as _;

    let mut monitor = Monitor::open(bpffs, interface)?;
    // Audit events name the rule set the peer is audited against: its entry's policy id.
    let maps = wgfence::dataplane::Dataplane::open_maps(bpffs, interface).ok();
    let load_names =
        || status::peer_names(state, status::AgentStatus::read(interface).ok().as_ref());
    let mut names = load_names();
    if let Some(peer) = peer {
        if !names.values().any(|n| n == peer) {
            bail!("no peer named {peer:?} in the state file (pass --state if the agent is not running here)");
        }
    }
    // On stderr, so stdout stays one event per line; scripts can wait for it.
    eprintln!("monitoring drop events on {interface}; Ctrl-C stops");
    let mut names_at = std::time::Instant::now();
    let mut seen = 0u64;
    let mut events = Vec::new();
    let stdout = std::io::stdout();
    loop {
        events.clear();
        monitor.wait(Duration::from_secs(1), &mut events)?;
        if names_at.elapsed() >= NAMES_REFRESH {
            names = load_names();
            names_at = std::time::Instant::now();
        }
        let clock = Clock::now();
        let mut out = stdout.lock();
        for event in &events {
            let mut view = EventView::new(event, &names, &clock);
            if view.kind == "audit" {
                let policy = maps
                    .as_ref()
                    .zip(view.src)
                    .and_then(|(maps, src)| maps.peer(src).ok().flatten())
                    .map(|e| e.policy);
                view = view.with_policy(policy);
            }
            if peer.is_some() && view.peer.as_deref() != peer {
                continue;
            }
            if json {
                writeln!(out, "{}", serde_json::to_string(&view)?)?;
            } else {
                writeln!(out, "{}", view.line())?;
            }
            seen += 1;
            if count.is_some_and(|n| seen >= n) {
                out.flush()?;
                return Ok(ExitCode::SUCCESS);
            }
        }
        out.flush()?;
    }
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
                Command::Run { target, .. }
                | Command::Plan { target, .. }
                | Command::Status { target, .. }
                | Command::Monitor { target, .. }
                | Command::Detach { target, .. }
                | Command::Explain { target, .. }
                | Command::Verify { target, .. } => target,
                Command::Check { .. } => unreachable!(),
            };
            assert_eq!(
                (target.interface.as_str(), target.bpffs.as_path()),
                ("wg0", Path::new("/tmp/x"))
            );
        }
    }
}
