//! `wgfence run`: the agent.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, time::Duration};

use anyhow::{Context as _, Result};
use clap::ValueEnum;
use wgfence::{
    daemon::{self, RunOptions, SourceOptions},
    dataplane::HookMode,
    source::kubernetes::SecretRef,
};

use super::{DatapathArgs, StateArgs, Target};

#[derive(Debug, clap::Args)]
pub struct Run {
    #[command(flatten)]
    pub target: Target,
    /// Where the state comes from: `file` (`--state`) or `kubernetes` (`--secret`, watched
    /// through the API server: a change applies within a second of the API write, where a
    /// mounted Secret changes only when kubelet re-projects it, 60-90 s later).
    #[arg(long, value_enum, default_value_t = SourceKind::File)]
    source: SourceKind,
    /// The state file. Its directory is watched, so Kubernetes volume updates (a `..data`
    /// symlink swap), in-place edits and renames all apply within a second.
    #[arg(long, short, required_unless_present = "secret", conflicts_with_all = ["secret", "kubeconfig"])]
    state: Option<PathBuf>,
    /// `--source kubernetes`: the Secret, as NAMESPACE/NAME. Only that object is listed and
    /// watched (the agent's RBAC may grant get, list and watch on it alone).
    #[arg(
        long,
        value_name = "NAMESPACE/NAME",
        required_if_eq("source", "kubernetes")
    )]
    secret: Option<String>,
    /// `--source kubernetes`: the Secret's key that holds the state.
    #[arg(long, default_value = "state.json")]
    key: String,
    /// `--source kubernetes`: a kubeconfig file, instead of the pod's service account.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    #[command(flatten)]
    read: StateArgs,
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
}

/// `--source`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum SourceKind {
    File,
    Kubernetes,
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

impl Run {
    pub fn execute(self) -> Result<ExitCode> {
        let interface = self.target.interface;
        let source = match (self.source, self.state, self.secret) {
            (SourceKind::File, Some(state), _) => SourceOptions::File(state),
            (SourceKind::Kubernetes, None, Some(secret)) => {
                SourceOptions::Kubernetes(SecretRef::parse(&secret, &self.key, self.kubeconfig)?)
            }
            (SourceKind::File, None, _) => anyhow::bail!("--source file needs --state"),
            (SourceKind::Kubernetes, Some(_), _) => {
                anyhow::bail!("--source kubernetes takes --secret, not --state")
            }
            (SourceKind::Kubernetes, None, None) => {
                anyhow::bail!("--source kubernetes needs --secret NAMESPACE/NAME")
            }
        };
        daemon::run(RunOptions {
            interface: interface.clone(),
            source,
            bpffs: self.target.bpffs,
            metrics_addr: (!self.no_metrics).then_some(self.metrics_addr),
            health_addr: self.health_addr,
            resync: Duration::from_secs(self.resync),
            peer_metrics: self.peer_metrics,
            datapath_debug: self.datapath_debug,
            settings: self.datapath.settings(),
            hook: self.attach.into(),
            allow_insecure_state: self.allow_insecure_state,
            max_state_bytes: self.read.max_state_bytes,
        })
        .with_context(|| format!("wgfence run on {interface}"))?;
        Ok(ExitCode::SUCCESS)
    }
}
