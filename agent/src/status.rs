//! The agent's status snapshot: a small JSON file under `/run/wgfence/` that `wgfence status`
//! reads to say whether the agent is ready and how its last reconcile went. Peer names are not
//! in it (it is rewritten on every reconcile and must stay O(1)); `status` maps counter slots
//! to names from the state file itself.

use std::{
    collections::{BTreeMap, BTreeSet},
    io,
    net::IpAddr,
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

use serde::{Deserialize, Serialize};

use crate::{daemon::Summary, reconcile::Outcome};

/// Directory of the status snapshots.
pub const STATUS_DIR: &str = "/run/wgfence";

pub fn status_path(interface: &str) -> PathBuf {
    Path::new(STATUS_DIR).join(format!("{interface}.status.json"))
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LastReconcile {
    /// Unix seconds.
    pub at: u64,
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub ops: usize,
    pub map_writes: u64,
    pub wireguard_peer_updates: u64,
    pub duration_ms: f64,
}

impl LastReconcile {
    pub fn ok(outcome: &Outcome) -> Self {
        Self {
            at: now(),
            ok: true,
            error: None,
            ops: outcome.ops,
            map_writes: outcome.map_writes,
            wireguard_peer_updates: outcome.wg_peer_updates,
            duration_ms: outcome.duration.as_secs_f64() * 1e3,
        }
    }

    pub fn failed(error: &str) -> Self {
        Self {
            at: now(),
            ok: false,
            error: Some(error.to_owned()),
            ..Self::default()
        }
    }
}

/// What the running agent says about itself.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentStatus {
    pub pid: u32,
    pub interface: String,
    pub state_file: PathBuf,
    pub ready: bool,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    pub peers: usize,
    pub restricted_peers: usize,
    pub last_reconcile: LastReconcile,
}

impl AgentStatus {
    pub fn read(interface: &str) -> io::Result<Self> {
        let text = std::fs::read_to_string(status_path(interface))?;
        serde_json::from_str(&text).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

/// Writes the snapshot atomically (temporary file, then rename).
pub struct StatusFile {
    path: PathBuf,
    status: AgentStatus,
    warned: bool,
}

impl StatusFile {
    pub fn new(interface: &str, state_file: &Path) -> Self {
        Self {
            path: status_path(interface),
            status: AgentStatus {
                pid: std::process::id(),
                interface: interface.to_owned(),
                state_file: state_file.to_owned(),
                ..AgentStatus::default()
            },
            warned: false,
        }
    }

    /// A state was applied: ready.
    pub(crate) fn applied(&mut self, last: LastReconcile, summary: &Summary) {
        self.status.ready = true;
        self.status.reason.clear();
        self.status.peers = summary.peers;
        self.status.restricted_peers = summary.restricted;
        self.status.last_reconcile = last;
        self.write();
    }

    /// Applying failed: not ready, with the failure as the last reconcile.
    pub(crate) fn failed(&mut self, last: LastReconcile, reason: &str) {
        self.status.last_reconcile = last;
        self.not_ready(reason);
    }

    /// Not ready (state missing or rejected, agent stopping); the last reconcile and the counts
    /// of the state that is enforced stay as they were.
    pub(crate) fn not_ready(&mut self, reason: &str) {
        self.status.ready = false;
        reason.clone_into(&mut self.status.reason);
        self.write();
    }

    fn write(&mut self) {
        if let Err(e) = self.try_write(&self.status) {
            if !self.warned {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot write the status snapshot");
                self.warned = true;
            }
        }
    }

    fn try_write(&self, status: &AgentStatus) -> io::Result<()> {
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let json = serde_json::to_vec_pretty(status).map_err(io::Error::other)?;
        let tmp = self.path.with_extension("json.tmp");
        std::fs::write(&tmp, json)?;
        std::fs::rename(&tmp, &self.path)
    }
}

/// Schema version of `wgfence status --json`.
pub const REPORT_SCHEMA_VERSION: u32 = 1;

/// `wgfence status --json`: what is attached and pinned for an interface, what the datapath
/// counted, and what the agent last said. Field names are stable within a schema version.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub schema_version: u32,
    pub interface: String,
    pub layout_version: u32,
    /// The program variant the ingress link runs: `l3` (WireGuard/TUN) or `ethernet`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub program_variant: Option<&'static str>,
    pub pin_dir: PathBuf,
    /// The ingress program is attached: its tcx link is pinned, or its tc filter is in place.
    pub attached: bool,
    /// The hook the programs run on: "tcx" or "tc" (a clsact qdisc with direct-action
    /// filters); absent when not attached.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hook: Option<String>,
    /// On the tc hook: the priority and handle of the agent's filters (both directions).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tc_priority: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tc_handle: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub link_id: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub program_id: Option<u32>,
    /// The egress link (reply flows), when pinned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub egress_link_id: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub egress_program_id: Option<u32>,
    pub peers: PeerCounts,
    /// Distinct policies referenced by peer entries.
    pub policies: usize,
    pub policy_entries: usize,
    /// Packets by verdict.
    pub packets: BTreeMap<String, u64>,
    /// Passed packets by reason.
    pub passed: BTreeMap<String, u64>,
    /// Dropped packets by reason.
    pub dropped: BTreeMap<String, u64>,
    /// What the running agent last wrote, if it runs (or ran) on this machine.
    pub agent: Option<AgentStatus>,
    pub peer_counters: Vec<PeerReport>,
}

#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PeerCounts {
    pub ipv4_entries: usize,
    pub ipv6_entries: usize,
    pub restricted: usize,
    pub unrestricted: usize,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PeerReport {
    /// From the state file; `None` if the address is in no peer of it.
    pub peer: Option<String>,
    pub addresses: Vec<IpAddr>,
    pub slot: u32,
    /// 0: unrestricted.
    pub policy: u32,
    pub pass_packets: u64,
    pub pass_bytes: u64,
    pub drop_packets: u64,
    pub drop_bytes: u64,
    /// `"enforce"` or `"audit"`, as the entry has it.
    pub mode: &'static str,
    /// An audited peer's would-drops: packets its policy denies, passed.
    pub would_drop_packets: u64,
    pub would_drop_bytes: u64,
    /// The window the entry holds, in wall-clock time (RFC 3339, UTC); `None`: no window.
    pub window: Option<WindowReport>,
}

/// A peer's access window as the datapath holds it.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WindowReport {
    pub not_before: Option<String>,
    pub expires: Option<String>,
    /// Whether the datapath drops the peer's packets now (outside the window).
    pub closed: bool,
}

impl WindowReport {
    fn of(entry: &wgfence_common::PeerEntry) -> Option<Self> {
        if entry.flags & wgfence_common::PEER_WINDOWED == 0 {
            return None;
        }
        let offset = crate::clock::wall_minus_boot_ns();
        let wall = |ns: u64| {
            let secs = crate::clock::to_wall_secs(ns, offset);
            crate::state::format_time(u64::try_from(secs).unwrap_or_default())
        };
        Some(Self {
            not_before: (entry.not_before_ns != 0).then(|| wall(entry.not_before_ns)),
            expires: (entry.expires_ns != u64::MAX).then(|| wall(entry.expires_ns)),
            closed: !entry.in_window(crate::clock::now_ns(libc::CLOCK_BOOTTIME)),
        })
    }

    /// `from..until` for the status table.
    pub fn text(&self) -> String {
        let closed = if self.closed { " (closed)" } else { "" };
        format!(
            "{}..{}{closed}",
            self.not_before.as_deref().unwrap_or(""),
            self.expires.as_deref().unwrap_or("")
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("nothing is pinned for {interface} under {dir}: the datapath is not attached (is the agent running? is --bpffs right?)")]
    NotAttached { interface: String, dir: PathBuf },
    #[error(
        "the datapath attached to {interface} runs map layout {running}; this wgfence reads \
         layout {this}. {hint}"
    )]
    OtherLayout {
        interface: String,
        running: u32,
        this: u32,
        hint: &'static str,
    },
    #[error(transparent)]
    Dataplane(#[from] crate::dataplane::DataplaneError),
}

/// Peer names by address, from `state`, else from the running agent's state file; empty when
/// neither can be read (names are a convenience: reports and events carry addresses anyway).
pub fn peer_names(state: Option<&Path>, agent: Option<&AgentStatus>) -> BTreeMap<IpAddr, String> {
    state
        .map(Path::to_path_buf)
        .or_else(|| agent.map(|a| a.state_file.clone()))
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|text| crate::state::parse(&text).ok())
        .map(|desired| {
            desired
                .peers
                .iter()
                .flat_map(|p| p.addrs().map(move |a| (a, p.name.clone())))
                .collect()
        })
        .unwrap_or_default()
}

/// Collects the report. `state` (else the agent's state file) names the peers.
pub fn report(bpffs: &Path, interface: &str, state: Option<&Path>) -> Result<Report, ReportError> {
    use crate::dataplane::{pin_dir, Dataplane};
    use wgfence_common::{Counter, LAYOUT_VERSION, UNRESTRICTED};

    let dir = pin_dir(bpffs, interface);
    if !dir.exists() {
        return Err(ReportError::NotAttached {
            interface: interface.to_owned(),
            dir,
        });
    }
    // The layout the attached programs run, not the one this binary was built for.
    let running = Dataplane::running_layout(bpffs, interface)?;
    if let Some(layout) = running.filter(|l| *l != LAYOUT_VERSION) {
        return Err(ReportError::OtherLayout {
            interface: interface.to_owned(),
            running: layout,
            this: LAYOUT_VERSION,
            hint: if layout < LAYOUT_VERSION {
                "An agent of this version upgrades it when it starts (`wgfence run`)."
            } else {
                "Use the `wgfence` of the agent that runs it."
            },
        });
    }
    let variant = Dataplane::running_variant(bpffs, interface)?;
    let maps = Dataplane::open_maps(bpffs, interface)?;
    let link = Dataplane::link_info(bpffs, interface)?;
    let egress = Dataplane::egress_link_info(bpffs, interface)?;
    // No tcx link pinned: the programs may run as tc filters (looked up on the interface).
    let filters = match link {
        Some(_) => None,
        None => Dataplane::tc_filters(interface)?,
    };
    let hook = match (link, filters) {
        (Some(_), _) => Some(crate::dataplane::HookKind::Tcx),
        (None, Some(_)) => Some(crate::dataplane::HookKind::Tc),
        (None, None) => None,
    };
    let tc = hook == Some(crate::dataplane::HookKind::Tc);
    let (tc_ingress, tc_egress) = filters.unwrap_or_default();
    let agent = AgentStatus::read(interface).ok();

    let entries = maps.peers()?;
    let mut peers = PeerCounts::default();
    let mut by_slot: BTreeMap<u32, (Vec<IpAddr>, u32)> = BTreeMap::new();
    let mut entry_of: BTreeMap<u32, wgfence_common::PeerEntry> = BTreeMap::new();
    for (addr, entry) in &entries {
        match addr {
            IpAddr::V4(_) => peers.ipv4_entries += 1,
            IpAddr::V6(_) => peers.ipv6_entries += 1,
        }
        entry_of.entry(entry.slot).or_insert(*entry);
        let slot = by_slot
            .entry(entry.slot)
            .or_insert((Vec::new(), entry.policy));
        slot.0.push(*addr);
    }
    for (_, policy) in by_slot.values() {
        if *policy == UNRESTRICTED {
            peers.unrestricted += 1;
        } else {
            peers.restricted += 1;
        }
    }
    let policy_entries = maps.policies()?;
    let policies: BTreeSet<u32> = by_slot
        .values()
        .map(|(_, p)| *p)
        .filter(|p| *p != UNRESTRICTED)
        .collect();

    let names = peer_names(state, agent.as_ref());

    let mut peer_counters = Vec::with_capacity(by_slot.len());
    for (slot, (addresses, policy)) in by_slot {
        let c = maps.peer_counters(slot)?;
        peer_counters.push(PeerReport {
            peer: addresses.iter().find_map(|a| names.get(a).cloned()),
            addresses,
            slot,
            policy,
            pass_packets: c.pass_packets,
            pass_bytes: c.pass_bytes,
            drop_packets: c.drop_packets,
            drop_bytes: c.drop_bytes,
            mode: if entry_of.get(&slot).is_some_and(|e| e.audit()) {
                "audit"
            } else {
                "enforce"
            },
            would_drop_packets: c.audit_packets,
            would_drop_bytes: c.audit_bytes,
            window: entry_of.get(&slot).and_then(WindowReport::of),
        });
    }
    peer_counters.sort_by(|a, b| a.peer.cmp(&b.peer).then(a.addresses.cmp(&b.addresses)));

    let counters = maps.counters()?;
    let by_reason = |pass: bool| -> BTreeMap<String, u64> {
        Counter::ALL
            .iter()
            .filter(|c| c.is_pass() == pass)
            .map(|c| (c.name().to_owned(), counters.get(*c)))
            .collect()
    };
    Ok(Report {
        schema_version: REPORT_SCHEMA_VERSION,
        interface: interface.to_owned(),
        layout_version: running.unwrap_or(LAYOUT_VERSION),
        program_variant: variant.map(|v| v.name),
        pin_dir: dir,
        attached: link.is_some() || tc_ingress.is_some(),
        hook: hook.map(|h| h.name().to_owned()),
        tc_priority: tc.then_some(crate::dataplane::tc::TC_PRIORITY),
        tc_handle: tc.then(|| format!("{:#x}", crate::dataplane::tc::TC_HANDLE)),
        link_id: link.map(|l| l.0),
        program_id: link.map(|l| l.1).or(tc_ingress),
        egress_link_id: egress.map(|l| l.0),
        egress_program_id: egress.map(|l| l.1).or(tc_egress),
        peers,
        policies: policies.len(),
        policy_entries: policy_entries.len(),
        packets: [
            ("pass".to_owned(), counters.passed()),
            ("drop".to_owned(), counters.dropped()),
        ]
        .into(),
        passed: by_reason(true),
        dropped: by_reason(false),
        agent,
        peer_counters,
    })
}

/// One rule of a policy the datapath counts: its counter, its policy id and its text.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct RuleRow {
    pub counter: u32,
    pub policy: u32,
    pub rule: String,
}

/// The counted rules of `desired`'s peers, by the entries the kernel holds for their
/// addresses (`entry`): each policy's rules, in canonical order, from its entries' counter
/// base. One row per counter (peers that share a policy share its rows).
pub fn rule_rows(
    desired: &crate::state::DesiredState,
    entry: impl Fn(IpAddr) -> Option<wgfence_common::PeerEntry>,
) -> Vec<RuleRow> {
    let mut rows = BTreeMap::new();
    for peer in &desired.peers {
        let Some(rules) = &peer.rules else {
            continue;
        };
        let Some(e) = peer
            .addrs()
            .filter_map(&entry)
            .find(|e| e.rules != wgfence_common::NO_RULES)
        else {
            continue;
        };
        for (i, rule) in (0u32..).zip(rules.iter()) {
            let counter = e.rules.saturating_add(i);
            rows.entry(counter).or_insert_with(|| RuleRow {
                counter,
                policy: e.policy,
                rule: crate::state::rule_text(rule),
            });
        }
    }
    rows.into_values().collect()
}
