//! `wgfence explain`'s answer: the kernel's verdict, the evaluator's reason on the live entries
//! with the state-file rules each entry came from, and whether the state file's own entries
//! decide the packet the same way.

use std::{fmt, fmt::Write as _, net::IpAddr};

use serde::Serialize;
use wgfence_common::{Allow, Config, Counter};

use super::{
    compiled_maps, evaluate,
    kernel::{monotonic_ns, KernelProbe, KernelVerdict},
    source::SourceMap,
    state_config, AllowText, Explanation, Probe, Reply, ReplyKey, View,
};
use crate::{
    plan::PlanError,
    policy::sources,
    reconcile::read_maps,
    state::{DesiredState, PeerSpec},
};

/// A state file, parsed, with the places of its rules.
pub struct StateFile<'a> {
    pub path: String,
    pub state: &'a DesiredState,
    pub sources: SourceMap,
}

/// An allow entry and the state-file rules it came from (none: no rule gives it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Sourced {
    pub allow: String,
    pub rules: Vec<String>,
}

/// The whole answer.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// `PASS` or `DROP`: the kernel's verdict.
    pub verdict: &'static str,
    /// The counter the kernel counted the packet in.
    pub reason: &'static str,
    pub packet: String,
    /// The packet's source address.
    pub from: IpAddr,
    /// The peer's name and place in the state file, if the state file has the source.
    pub peer: Option<String>,
    pub peer_place: Option<String>,
    /// The evaluator on the live entries.
    pub live: Explanation,
    /// The live allow entries of the matching prefix, each with its rules.
    pub allows: Vec<Sourced>,
    pub matched: Option<Sourced>,
    /// The evaluator disagrees with the kernel: a bug in wgfence (never expected).
    pub evaluator_disagrees: Option<String>,
    /// The state file's entries decide the same as the live ones (None: no state file).
    pub state_agrees: Option<bool>,
    /// How the live entries and the state file's differ for this packet.
    pub differences: Vec<String>,
    /// The state file's entries' answer.
    pub state: Option<Explanation>,
    pub state_file: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error(transparent)]
    Kernel(#[from] super::kernel::KernelError),
    #[error("reading the live maps")]
    Maps(#[from] crate::dataplane::DataplaneError),
    #[error("compiling the state file")]
    Plan(#[from] PlanError),
}

fn verdict_word(c: Counter) -> &'static str {
    if c.is_pass() {
        "PASS"
    } else {
        "DROP"
    }
}

/// The packet in one line: `10.8.0.2:40000 -> 10.1.2.3:443 tcp`.
pub fn describe(probe: &Probe) -> String {
    use wgfence_common::{PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP};
    let addr = |a: IpAddr, port: Option<u16>| match (a, port) {
        (IpAddr::V6(a), Some(p)) => format!("[{a}]:{p}"),
        (a, Some(p)) => format!("{a}:{p}"),
        (a, None) => a.to_string(),
    };
    let ports = probe.protocol == PROTO_TCP || probe.protocol == PROTO_UDP;
    let mut s = format!(
        "{} -> {} ",
        addr(probe.src, ports.then_some(probe.src_port)),
        addr(probe.dst, ports.then_some(probe.dst_port))
    );
    match probe.protocol {
        PROTO_TCP => s.push_str("tcp"),
        PROTO_UDP => s.push_str("udp"),
        PROTO_ICMP | PROTO_ICMPV6 => {
            let _ = write!(
                s,
                "{} type {} code {}",
                if probe.protocol == PROTO_ICMP {
                    "icmp"
                } else {
                    "icmpv6"
                },
                probe.icmp_type,
                probe.icmp_code
            );
        }
        p => {
            let _ = write!(s, "protocol {p}");
        }
    }
    if probe.later_fragment {
        s.push_str(", a later fragment");
    }
    s
}

/// The state-file rules of `peer` an allow entry came from, for destination `dst`.
fn sourced(file: Option<(&StateFile<'_>, &PeerSpec)>, dst: IpAddr, allow: &Allow) -> Sourced {
    let rules = match file {
        Some((file, peer)) => {
            let rules = peer.rules.as_deref().map(Vec::as_slice).unwrap_or_default();
            file.sources.rules(&peer.name, &sources(rules, dst, allow))
        }
        None => Vec::new(),
    };
    Sourced {
        allow: AllowText(*allow).to_string(),
        rules,
    }
}

fn allows_text(allows: &[Allow]) -> String {
    if allows.is_empty() {
        return "nothing".to_owned();
    }
    allows
        .iter()
        .map(|a| AllowText(*a).to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn entry_text(e: &Explanation) -> String {
    match (&e.peer, e.prefix) {
        (None, _) => "no peer entry for the source".to_owned(),
        (Some(p), _) if p.policy == wgfence_common::UNRESTRICTED => {
            "the peer is unrestricted".to_owned()
        }
        (Some(_), None) => "no trie entry for the destination".to_owned(),
        (Some(_), Some(prefix)) => format!("trie entry {prefix} [{}]", allows_text(&e.allows)),
    }
}

/// How two explanations of one packet (live entries, state file's) differ.
pub fn differences(live: &Explanation, state: &Explanation) -> Vec<String> {
    let mut d = Vec::new();
    let restricted = |e: &Explanation| e.peer.map(|p| p.policy != wgfence_common::UNRESTRICTED);
    if restricted(live) != restricted(state) {
        let what = |r: Option<bool>| match r {
            None => "no peer entry",
            Some(true) => "a restricted peer",
            Some(false) => "an unrestricted peer",
        };
        d.push(format!(
            "the live maps have {} for the source, the state file {}",
            what(restricted(live)),
            what(restricted(state))
        ));
    } else if live.prefix != state.prefix || live.allows != state.allows {
        d.push(format!(
            "the live maps have {}, the state file compiles to {}",
            entry_text(live),
            entry_text(state)
        ));
    }
    if live.verdict != state.verdict {
        d.push(format!(
            "the live entries give {} ({}), the state file's give {} ({})",
            verdict_word(live.verdict),
            live.verdict.name(),
            verdict_word(state.verdict),
            state.verdict.name()
        ));
    }
    d
}

/// Explains `probe`: the kernel's verdict through `kernel`, the evaluator's reason on the live
/// entries (read from the same pins), and the comparison with the state file's entries.
pub fn explain(
    kernel: &mut KernelProbe,
    file: Option<&StateFile<'_>>,
    probe: &Probe,
) -> Result<Report, ReportError> {
    let live = read_maps(kernel.live())?;
    let config = kernel.live().config()?;
    let verdict: KernelVerdict = kernel.run(probe)?;
    let now_ns = monotonic_ns();
    let boot_ns = crate::clock::now_ns(libc::CLOCK_BOOTTIME);
    let flows = |key: &ReplyKey| kernel.live_flow(key).ok().flatten();
    let seen = probe.seen();
    let view = |maps, config| View {
        maps,
        config,
        flows: &flows,
        now_ns,
        boot_ns: Some(boot_ns),
    };
    let by_live = evaluate(&view(&live, config), &seen);
    let mut report = Report::of_live(verdict, by_live, file, probe);
    if let Some(file) = file {
        let compiled = compiled_maps(file.state)?;
        // The state's reply switch, with the running agent's flow timeouts (the kernel's).
        let state_config = Config {
            flags: state_config(file.state).flags,
            ..config
        };
        let by_state = evaluate(&view(&compiled, state_config), &seen);
        report.differences = differences(&report.live, &by_state);
        report.state_agrees = Some(report.differences.is_empty());
        report.state = Some(by_state);
    }
    Ok(report)
}

impl Report {
    /// The kernel's `verdict` with the evaluator's reason on the live entries (`by_live`),
    /// the allow entries named by the state file's rules they came from, if it has the peer.
    fn of_live(
        verdict: KernelVerdict,
        by_live: Explanation,
        file: Option<&StateFile<'_>>,
        probe: &Probe,
    ) -> Self {
        let peer = file.and_then(|f| {
            f.state
                .peers
                .iter()
                .find(|p| p.addrs().any(|a| a == probe.src))
                .map(|p| (f, p))
        });
        let allows = by_live
            .allows
            .iter()
            .map(|a| sourced(peer, probe.dst, a))
            .collect();
        let matched = by_live.matched.map(|a| sourced(peer, probe.dst, &a));
        let evaluator_disagrees = (by_live.verdict != verdict.counter).then(|| {
            format!(
                "the evaluator on the live entries says {} ({}): a wgfence bug, please report it",
                verdict_word(by_live.verdict),
                by_live.verdict.name()
            )
        });
        Self {
            verdict: verdict_word(verdict.counter),
            reason: verdict.counter.name(),
            packet: describe(probe),
            from: probe.src,
            peer: peer.map(|(_, p)| p.name.to_string()),
            peer_place: peer.and_then(|(f, p)| f.sources.peer(&p.name)),
            live: by_live,
            allows,
            matched,
            evaluator_disagrees,
            state_agrees: None,
            differences: Vec::new(),
            state: None,
            state_file: file.map(|f| f.path.clone()),
        }
    }
}

/// The report as `explain` prints it.
impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let head = if self.state_agrees == Some(false) {
            " — differs from the state file"
        } else {
            ""
        };
        writeln!(f, "{} ({}){head}", self.verdict, self.reason)?;
        writeln!(f, "  packet     {}", self.packet)?;
        self.fmt_peer(f)?;
        let restricted = self
            .live
            .peer
            .is_some_and(|p| p.policy != wgfence_common::UNRESTRICTED);
        if restricted {
            self.fmt_policy(f)?;
            writeln!(f, "  reply      {}", reply_text(&self.live.reply))?;
        }
        if let Some(bug) = &self.evaluator_disagrees {
            writeln!(f, "  WARNING    {bug}")?;
        }
        self.fmt_state_file(f)
    }
}

impl Report {
    /// The peer entry of the source, or that it has none.
    fn fmt_peer(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(p) = &self.live.peer else {
            return writeln!(
                f,
                "  peer       none: no peer entry for {} (unknown source)",
                self.from
            );
        };
        writeln!(
            f,
            "  peer       {}{}: entry {} -> policy {}, slot {}, owner {}",
            self.peer.as_deref().unwrap_or("(not in the state file)"),
            self.peer_place
                .as_deref()
                .map(|p| format!(" ({p})"))
                .unwrap_or_default(),
            p.addr,
            if p.policy == wgfence_common::UNRESTRICTED {
                "0 (unrestricted)".to_owned()
            } else {
                p.policy.to_string()
            },
            p.slot,
            p.owner
        )
    }

    /// A restricted peer's policy: the prefix that matched, and the allow entry that did (or
    /// those that did not), with the rules they came from.
    fn fmt_policy(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.live.prefix {
            Some(prefix) => writeln!(f, "  prefix     {prefix}")?,
            None => writeln!(
                f,
                "  prefix     none: the policy has no trie entry for the destination"
            )?,
        }
        let rules = |r: &Sourced| {
            if r.rules.is_empty() {
                "no state-file rule".to_owned()
            } else {
                r.rules.join(", ")
            }
        };
        match &self.matched {
            Some(m) => writeln!(f, "  matched    {} <- {}", m.allow, rules(m))?,
            None if self.allows.is_empty() => {}
            None => {
                writeln!(f, "  no match   among:")?;
                for a in &self.allows {
                    writeln!(f, "               {} <- {}", a.allow, rules(a))?;
                }
            }
        }
        Ok(())
    }

    /// Whether the state file's entries decide the same.
    fn fmt_state_file(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.state_agrees, &self.state_file) {
            (Some(true), Some(path)) => writeln!(f, "  state file {path}: agrees"),
            (Some(false), Some(path)) => {
                writeln!(f, "  state file {path}: DIFFERS")?;
                for d in &self.differences {
                    writeln!(f, "               {d}")?;
                }
                Ok(())
            }
            _ => writeln!(
                f,
                "  state file none (pass --state to compare with what it compiles to)"
            ),
        }
    }
}

/// Whether a reply flow lets the packet pass, in words.
fn reply_text(reply: &Reply) -> String {
    match reply {
        Reply::NotAsked => "not needed: the policy allows it".to_owned(),
        Reply::Off => "replies are off".to_owned(),
        Reply::NotAReply => "this packet cannot answer a flow".to_owned(),
        Reply::NoFlow { .. } => "no flow the network started matches it".to_owned(),
        Reply::OtherOwner { .. } => {
            "a flow matches, recorded for another holder of the address".to_owned()
        }
        Reply::Expired { idle_ns, .. } => format!(
            "a flow matches, expired (idle {:.1}s)",
            *idle_ns as f64 / 1e9
        ),
        Reply::Live { idle_ns, .. } => format!(
            "a live flow the network started lets it pass (idle {:.1}s)",
            *idle_ns as f64 / 1e9
        ),
    }
}
