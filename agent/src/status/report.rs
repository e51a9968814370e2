//! The reader behind `wgfence status`: what is attached and pinned for an interface, what the
//! datapath counted, and what the agent last wrote in its snapshot ([`super::snapshot`]). A
//! [`Report`] is printed as JSON (`--json`) or renders itself as text ([`fmt::Display`]).

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
    path::{Path, PathBuf},
};

use serde::Serialize;
use wgfence_common::{Counter, PeerEntry, LAYOUT_VERSION, UNRESTRICTED};

use super::snapshot::AgentStatus;
use crate::dataplane::{pin_dir, tc, Dataplane, HookKind, Maps};

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
    /// The ingress program is attached: its tcx link is pinned, or its tc filter is in place
    /// (`attached` in the JSON schema, which predates the egress link).
    #[serde(rename = "attached")]
    pub ingress_attached: bool,
    /// The hook the programs run on: "tcx" or "tc" (a clsact qdisc with direct-action
    /// filters); absent when not attached.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hook: Option<String>,
    /// On the tc hook: the priority and handle of the agent's filters (both directions).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tc_priority: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tc_handle: Option<String>,
    /// The ingress link (`linkId` in the JSON schema), when pinned.
    #[serde(rename = "linkId", skip_serializing_if = "Option::is_none")]
    pub ingress_link_id: Option<u32>,
    /// The ingress program (`programId` in the JSON schema): the pinned link's, or the tc
    /// filter's.
    #[serde(rename = "programId", skip_serializing_if = "Option::is_none")]
    pub ingress_program_id: Option<u32>,
    /// The egress link (reply flows), when pinned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub egress_link_id: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub egress_program_id: Option<u32>,
    pub peers: PeerCounts,
    /// Policies the peer entries reference: compiled policies, each under its policy id and
    /// shared by every peer whose rules compile the same.
    pub policies: usize,
    /// The policies' trie entries.
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
    fn of(entry: &PeerEntry) -> Option<Self> {
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

/// Peer names by address, from `state`, else from the running agent's state file (read as
/// every state file is, [`crate::input`], at most `max_bytes`); empty when neither can be read
/// (names are a convenience: reports and events carry addresses anyway).
pub fn peer_names(
    state: Option<&Path>,
    agent: Option<&AgentStatus>,
    max_bytes: u64,
) -> BTreeMap<IpAddr, String> {
    state
        .map(Path::to_path_buf)
        .or_else(|| agent.map(|a| a.state_file.clone()))
        .filter(|p| !p.as_os_str().is_empty())
        .and_then(|p| crate::input::read(&p, max_bytes).ok())
        .and_then(|bytes| String::from_utf8(bytes).ok())
        .and_then(|text| crate::state::parse(&text).ok())
        .map(|desired| {
            desired
                .peers
                .iter()
                .flat_map(|p| p.addrs().map(move |a| (a, p.name.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

/// Collects the report. `state` (else the agent's state file, at most `max_state_bytes`) names
/// the peers.
pub fn report(
    bpffs: &Path,
    interface: &str,
    state: Option<&Path>,
    max_state_bytes: u64,
) -> Result<Report, ReportError> {
    let (dir, running) = pinned_layout(bpffs, interface)?;
    let variant = Dataplane::running_variant(bpffs, interface)?;
    let maps = Dataplane::open_maps(bpffs, interface)?;
    let hooks = Hooks::read(bpffs, interface)?;
    let agent = AgentStatus::read(interface).ok();
    let names = peer_names(state, agent.as_ref(), max_state_bytes);
    let peers = PeerTable::read(&maps, &names)?;
    let counters = maps.counters()?;
    let by_reason = |pass: bool| -> BTreeMap<String, u64> {
        Counter::ALL
            .iter()
            .filter(|c| c.is_pass() == pass)
            .map(|c| (c.name().to_owned(), counters.get(*c)))
            .collect()
    };
    let tc = hooks.hook == Some(HookKind::Tc);
    Ok(Report {
        schema_version: REPORT_SCHEMA_VERSION,
        interface: interface.to_owned(),
        layout_version: running.unwrap_or(LAYOUT_VERSION),
        program_variant: variant.map(|v| v.name),
        pin_dir: dir,
        ingress_attached: hooks.ingress_link.is_some() || hooks.tc_ingress.is_some(),
        hook: hooks.hook.map(|h| h.name().to_owned()),
        tc_priority: tc.then_some(tc::TC_PRIORITY),
        tc_handle: tc.then(|| format!("{:#x}", tc::TC_HANDLE)),
        ingress_link_id: hooks.ingress_link.map(|l| l.0),
        ingress_program_id: hooks.ingress_link.map(|l| l.1).or(hooks.tc_ingress),
        egress_link_id: hooks.egress_link.map(|l| l.0),
        egress_program_id: hooks.egress_link.map(|l| l.1).or(hooks.tc_egress),
        peers: peers.counts,
        policies: peers.policies,
        policy_entries: {
            let mut n = 0;
            maps.each_policy_entry(|_, _, _| n += 1)?;
            n
        },
        packets: [
            ("pass".to_owned(), counters.passed()),
            ("drop".to_owned(), counters.dropped()),
        ]
        .into(),
        passed: by_reason(true),
        dropped: by_reason(false),
        agent,
        peer_counters: peers.rows,
    })
}

/// The pin directory and the map layout the attached programs run (not the one this binary
/// was built for): an error when nothing is pinned, or when the layout is another.
fn pinned_layout(bpffs: &Path, interface: &str) -> Result<(PathBuf, Option<u32>), ReportError> {
    let dir = pin_dir(bpffs, interface);
    if !dir.exists() {
        return Err(ReportError::NotAttached {
            interface: interface.to_owned(),
            dir,
        });
    }
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
    Ok((dir, running))
}

/// Where the programs run: the pinned tcx links (link id, program id), else the tc filters'
/// programs on the interface.
struct Hooks {
    hook: Option<HookKind>,
    ingress_link: Option<(u32, u32)>,
    egress_link: Option<(u32, u32)>,
    tc_ingress: Option<u32>,
    tc_egress: Option<u32>,
}

impl Hooks {
    fn read(bpffs: &Path, interface: &str) -> Result<Self, ReportError> {
        let ingress_link = Dataplane::ingress_link_info(bpffs, interface)?;
        let egress_link = Dataplane::egress_link_info(bpffs, interface)?;
        // No tcx link pinned: the programs may run as tc filters (looked up on the interface).
        let filters = match ingress_link {
            Some(_) => None,
            None => Dataplane::tc_filters(interface)?,
        };
        let hook = match (ingress_link, filters) {
            (Some(_), _) => Some(HookKind::Tcx),
            (None, Some(_)) => Some(HookKind::Tc),
            (None, None) => None,
        };
        let (tc_ingress, tc_egress) = filters.unwrap_or_default();
        Ok(Self {
            hook,
            ingress_link,
            egress_link,
            tc_ingress,
            tc_egress,
        })
    }
}

/// The peer entries by counter slot, with their counters.
struct PeerTable {
    counts: PeerCounts,
    /// Distinct policy ids the entries reference ([`Report::policies`]).
    policies: usize,
    rows: Vec<PeerReport>,
}

impl PeerTable {
    fn read(maps: &Maps, names: &BTreeMap<IpAddr, String>) -> Result<Self, ReportError> {
        let mut counts = PeerCounts::default();
        let mut by_slot: BTreeMap<u32, (Vec<IpAddr>, PeerEntry)> = BTreeMap::new();
        for (addr, entry) in &maps.peers()? {
            match addr {
                IpAddr::V4(_) => counts.ipv4_entries += 1,
                IpAddr::V6(_) => counts.ipv6_entries += 1,
            }
            by_slot
                .entry(entry.slot)
                .or_insert((Vec::new(), *entry))
                .0
                .push(*addr);
        }
        for (_, entry) in by_slot.values() {
            if entry.policy == UNRESTRICTED {
                counts.unrestricted += 1;
            } else {
                counts.restricted += 1;
            }
        }
        let policies: BTreeSet<u32> = by_slot
            .values()
            .map(|(_, e)| e.policy)
            .filter(|p| *p != UNRESTRICTED)
            .collect();
        let mut rows = Vec::with_capacity(by_slot.len());
        for (slot, (addresses, entry)) in by_slot {
            let c = maps.peer_counters(slot)?;
            rows.push(PeerReport {
                peer: addresses.iter().find_map(|a| names.get(a).cloned()),
                addresses,
                slot,
                policy: entry.policy,
                pass_packets: c.pass_packets,
                pass_bytes: c.pass_bytes,
                drop_packets: c.drop_packets,
                drop_bytes: c.drop_bytes,
                mode: if entry.audit() { "audit" } else { "enforce" },
                would_drop_packets: c.audit_packets,
                would_drop_bytes: c.audit_bytes,
                window: WindowReport::of(&entry),
            });
        }
        rows.sort_by(|a, b| a.peer.cmp(&b.peer).then(a.addresses.cmp(&b.addresses)));
        Ok(Self {
            counts,
            policies: policies.len(),
            rows,
        })
    }
}

/// The text of `wgfence status`: one `label  value` line per fact, then the peer table.
impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "interface        {}", self.interface)?;
        self.fmt_datapath(f)?;
        self.fmt_agent(f)?;
        writeln!(
            f,
            "peers            {} IPv4 + {} IPv6 entries; {} restricted, {} unrestricted",
            self.peers.ipv4_entries,
            self.peers.ipv6_entries,
            self.peers.restricted,
            self.peers.unrestricted
        )?;
        writeln!(
            f,
            "policies         {} distinct, {} trie entries",
            self.policies, self.policy_entries
        )?;
        let by_reason = |m: &BTreeMap<String, u64>| {
            m.iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        writeln!(f, "passed           {}", by_reason(&self.passed))?;
        writeln!(f, "dropped          {}", by_reason(&self.dropped))?;
        self.fmt_peers(f)
    }
}

impl Report {
    /// The datapath, hook, link and filter lines.
    fn fmt_datapath(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "datapath         {} (layout v{}{}, pins in {})",
            if self.ingress_attached {
                "attached"
            } else {
                "NOT attached (no pinned link, no filter)"
            },
            self.layout_version,
            self.program_variant
                .map(|v| format!(", {v} programs"))
                .unwrap_or_default(),
            self.pin_dir.display()
        )?;
        match (&self.hook, self.tc_priority, &self.tc_handle) {
            (Some(hook), Some(prio), Some(handle)) => writeln!(
                f,
                "hook             {hook} (clsact, direct-action filters at priority {prio}, handle {handle})"
            )?,
            (Some(hook), _, _) => writeln!(f, "hook             {hook}")?,
            (None, _, _) => {}
        }
        match (self.ingress_link_id, self.ingress_program_id) {
            (Some(link), Some(prog)) => writeln!(
                f,
                "link             id {link}, program id {prog} (bpftool link show id {link})"
            )?,
            (None, Some(prog)) => writeln!(
                f,
                "ingress filter   program id {prog} (bpftool prog show id {prog})"
            )?,
            _ => {}
        }
        match (self.egress_link_id, self.egress_program_id) {
            (Some(link), Some(prog)) => writeln!(
                f,
                "egress link      id {link}, program id {prog} (reply flows)"
            ),
            (None, Some(prog)) => writeln!(f, "egress filter    program id {prog} (reply flows)"),
            _ if self.ingress_attached => writeln!(
                f,
                "egress link      NOT pinned: replies to network-started flows do not pass"
            ),
            _ => Ok(()),
        }
    }

    /// The agent's snapshot: ready or not, its state file, its last reconcile.
    fn fmt_agent(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(a) = &self.agent else {
            return writeln!(
                f,
                "agent            no status snapshot (agent not running here?)"
            );
        };
        let last = &a.last_reconcile;
        writeln!(
            f,
            "agent            pid {}, {}{}",
            a.pid,
            if a.ready { "ready" } else { "NOT ready" },
            if a.reason.is_empty() {
                String::new()
            } else {
                format!(": {}", a.reason)
            }
        )?;
        if a.state_file.as_os_str().is_empty() {
            writeln!(f, "source           {}", a.source)?;
        } else {
            writeln!(f, "state file       {}", a.state_file.display())?;
        }
        if last.ok {
            writeln!(
                f,
                "last reconcile   ok, {} ops ({} map writes, {} WireGuard peer updates) in {:.1} ms",
                last.ops, last.map_writes, last.wireguard_peer_updates, last.duration_ms
            )
        } else {
            writeln!(
                f,
                "last reconcile   FAILED: {}",
                last.error.as_deref().unwrap_or("unknown error")
            )
        }
    }

    /// The table of peers and their counters (none without peer entries).
    fn fmt_peers(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.peer_counters.is_empty() {
            return Ok(());
        }
        writeln!(f)?;
        writeln!(
            f,
            "{:<24} {:<32} {:>7} {:>12} {:>12}  {:<7} {:>12}  WINDOW",
            "PEER", "ADDRESSES", "POLICY", "PASSED", "DROPPED", "MODE", "WOULD-DROP"
        )?;
        for p in &self.peer_counters {
            writeln!(f, "{p}")?;
        }
        Ok(())
    }
}

/// One row of the status table.
impl fmt::Display for PeerReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let addrs = self
            .addresses
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let policy = if self.policy == 0 {
            "-".to_owned()
        } else {
            self.policy.to_string()
        };
        let would_drop = if self.mode == "audit" {
            self.would_drop_packets.to_string()
        } else {
            "-".to_owned()
        };
        let window = self.window.as_ref().map_or("-".to_owned(), |w| w.text());
        write!(
            f,
            "{:<24} {:<32} {:>7} {:>12} {:>12}  {:<7} {:>12}  {}",
            self.peer.as_deref().unwrap_or("?"),
            addrs,
            policy,
            self.pass_packets,
            self.drop_packets,
            self.mode,
            would_drop,
            window
        )
    }
}
