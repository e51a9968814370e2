//! Applies plans to the kernel: BPF map writes through the dataplane, peer changes through the
//! WireGuard adapter, in the planner's order.
//!
//! The reconciler keeps its view of the kernel ([`Actual`]) current by applying each operation
//! to it as it succeeds, so a change costs what it changes and not a full read of the maps and
//! the device. A full read happens at start-up, on every resync (which repairs drift made
//! behind the agent's back), and after any failed operation.
//!
//! Reply flows: an address's flows are forgotten when it leaves or gets a new WireGuard holder,
//! and [`Reconciler::collect_flows`] deletes flows that expired or whose owner is no longer
//! their address's, giving their quota back: at start, here; once the agent runs, by the
//! [`Sweeper`] (periodically, on every resync, and what the reconciler hands it), off the
//! apply path.
//!
//! A failure stops the plan where it is. Every prefix of a plan is safe to stop at (no entry
//! points at an incomplete policy, no address gets a policy its holder does not own), and the
//! next attempt reads the kernel and plans again from there. Nothing is rolled back: the
//! revocations lead every plan, so a put that fails (a full map) stops only what follows it,
//! and the retry, planned from the kernel as it is, does not delete them again.

use std::{
    collections::BTreeSet,
    net::IpAddr,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

mod preview;

pub use crate::drop_later;
use crate::{
    dataplane::{Dataplane, DataplaneError, Flow, Maps},
    plan::{
        plan, plan_changes, plan_settings, plan_update, Actual, ActualMaps, ActualWg, Op, Plan,
        PlanError, Unplanned, WgPeerChange, EMPTY_POLICY,
    },
    policy::CompiledPolicy,
    settings::{online_cpus, DatapathSettings},
    state::{self, DesiredState, PeerSpec, WgKey},
    sweeper::{Pause, Sweeper},
    wg::{WgError, WireGuard},
};
pub use preview::{preview, read_pinned, Preview};
use wgfence_common::{Config, UNRESTRICTED};

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error(transparent)]
    Dataplane(#[from] DataplaneError),
    #[error(transparent)]
    WireGuard(#[from] WgError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("the agent is shutting down; nothing more is applied")]
    Closed,
}

/// What one reconcile did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    pub ops: usize,
    pub map_writes: u64,
    pub wg_peer_updates: u64,
    /// Planning and applying, in total.
    pub duration: Duration,
    /// Of that, planning.
    pub plan_duration: Duration,
    /// Of that, the WireGuard device updates.
    pub wg_duration: Duration,
}

/// The settings entry's operations: `settings` for a state with `replies`, against the
/// kernel's entry (`None`: none yet).
fn settings_ops(
    settings: &DatapathSettings,
    replies: bool,
    cpus: u32,
    kernel: Option<&Config>,
) -> Vec<Op> {
    plan_settings(&settings.config(replies, cpus), kernel)
}

/// Empty policy tries freed per address family and call of
/// [`Reconciler::reclaim_policy_tries`] (each resync): one batch of the array of maps, so one
/// RCU grace period, and a pin to open and check and one to remove each; 4096 take the agent
/// tens of milliseconds.
pub const RECLAIM_BUDGET: usize = 4096;

/// Reads the maps into the planner's form (O(entries)). The trie entries are read into one
/// array of allows and one of (policy, prefix, where its allows are), which each policy's
/// flat form is then built from: no map value and no heap block per entry is held on the way.
pub fn read_maps(maps: &Maps) -> Result<ActualMaps, DataplaneError> {
    let peers = maps.peers()?;
    let mut read = crate::actual_maps::TrieEntries::default();
    maps.each_policy_entry(|policy, prefix, value| read.push(policy, prefix, value.allows()))?;
    Ok(ActualMaps::from_policies(peers, read.into_policies())
        .with_owner_high(maps.config()?.owner_high)
        .with_wall_minus_boot(crate::clock::wall_minus_boot_ns()))
}

pub struct Reconciler {
    dataplane: Dataplane,
    wg: WireGuard,
    actual: Actual,
    /// The state the kernel was last made to match: the next plan only looks at what differs
    /// from it. `None` after a failure or a resync: the next plan compares everything.
    applied: Option<DesiredState>,
    /// The kernel matches the state the pipeline accepted last ([`Self::reconcile_changes`]).
    tracking: bool,
    /// The cached view may differ from the kernel (after a failure): read before planning.
    stale: bool,
    /// Time spent in WireGuard updates by the current apply.
    wg_time: Duration,
    settings: DatapathSettings,
    cpus: u32,
    /// The datapath's settings entry as the kernel has it (read with the maps).
    kernel_config: Option<wgfence_common::Config>,
    /// Reply flows deleted so far by this reconciler itself.
    flows_freed: u64,
    /// Once set, every flow deletion goes to it (the one writer of the freed counts).
    sweeper: Option<Sweeper>,
    closed: Arc<AtomicBool>,
}

impl Reconciler {
    /// Takes over an attached dataplane and a WireGuard interface and reads their state. Nothing
    /// is changed until [`Reconciler::reconcile`] is given a valid desired state.
    pub fn new(dataplane: Dataplane, wg: WireGuard) -> Result<Self, ReconcileError> {
        Self::adopt(dataplane, wg, None)
    }

    /// The same, with the WireGuard device's peers already read (`device`; read while the
    /// datapath was being attached, at start-up): only the maps are read here.
    pub fn adopt(
        dataplane: Dataplane,
        wg: WireGuard,
        device: Option<ActualWg>,
    ) -> Result<Self, ReconcileError> {
        let mut r = Self::unread(dataplane, wg);
        r.read_kernel(device)?;
        Ok(r)
    }

    /// The same, with the WireGuard side still being read (on another thread, at start-up):
    /// the maps are read first, meanwhile, then `device` is waited for.
    pub fn adopt_reading<E: From<ReconcileError>>(
        dataplane: Dataplane,
        device: impl FnOnce() -> Result<(WireGuard, ActualWg), E>,
    ) -> Result<Self, E> {
        let t = Instant::now();
        let maps = read_maps(dataplane.maps()).map_err(ReconcileError::from)?;
        let maps_read = t.elapsed();
        let (wg, device) = device()?;
        let mut r = Self::unread(dataplane, wg);
        r.take_kernel(t, maps, maps_read, device)?;
        Ok(r)
    }

    /// A reconciler that has read nothing yet.
    fn unread(dataplane: Dataplane, wg: WireGuard) -> Self {
        Self {
            dataplane,
            wg,
            actual: Actual::default(),
            applied: None,
            tracking: false,
            stale: true,
            wg_time: Duration::ZERO,
            settings: DatapathSettings::default(),
            cpus: online_cpus(),
            kernel_config: None,
            flows_freed: 0,
            sweeper: None,
            closed: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Hands every later flow deletion to `sweeper`, which deletes off the apply path; from
    /// here on the reconciler deletes no flow itself.
    pub fn with_sweeper(mut self, sweeper: Sweeper) -> Self {
        self.sweeper = Some(sweeper);
        self
    }

    /// Holds the sweeper back (between its chunks) while a state change is loaded and applied.
    pub fn pause_flow_work(&self) -> Option<Pause> {
        self.sweeper.as_ref().map(Sweeper::pause)
    }

    /// Uses these datapath settings from the next reconcile on (default:
    /// [`DatapathSettings::default`]).
    pub fn with_settings(mut self, settings: DatapathSettings) -> Self {
        self.settings = settings;
        self
    }

    /// A flag that, once set, makes every later operation fail with [`ReconcileError::Closed`].
    pub fn shutdown_handle(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.closed)
    }

    pub fn actual(&self) -> &Actual {
        &self.actual
    }

    pub fn dataplane(&self) -> &Dataplane {
        &self.dataplane
    }

    pub fn dataplane_mut(&mut self) -> &mut Dataplane {
        &mut self.dataplane
    }

    pub fn wireguard(&self) -> &WireGuard {
        &self.wg
    }

    fn check_open(&self) -> Result<(), ReconcileError> {
        if self.closed.load(Ordering::Acquire) {
            Err(ReconcileError::Closed)
        } else {
            Ok(())
        }
    }

    /// Reads the maps and the WireGuard device again (resync: what changed behind the agent's
    /// back shows up in the next plan), then collects the flows that are no longer their
    /// address's (at start, before anything new is allocated; later, by the sweeper).
    pub fn refresh(&mut self) -> Result<(), ReconcileError> {
        self.read_kernel(None)
    }

    /// [`Reconciler::refresh`], with the device's peers read already if given.
    fn read_kernel(&mut self, device: Option<ActualWg>) -> Result<(), ReconcileError> {
        self.check_open()?;
        drop_later(self.applied.take());
        self.tracking = false;
        let t = Instant::now();
        let maps = read_maps(self.dataplane.maps())?;
        let maps_read = t.elapsed();
        let wg = match device {
            Some(device) => device,
            None => self.wg.read()?,
        };
        self.take_kernel(t, maps, maps_read, wg)
    }

    /// Takes the kernel's state read since `t` (the maps in `maps_read`, then the device) as
    /// the actual state.
    fn take_kernel(
        &mut self,
        t: Instant,
        maps: ActualMaps,
        maps_read: Duration,
        wg: ActualWg,
    ) -> Result<(), ReconcileError> {
        let wg_read = t.elapsed() - maps_read;
        // The previous view is as large as the kernel's state: its memory goes back.
        crate::drop_later_and_trim(std::mem::replace(&mut self.actual, Actual::new(maps, wg)));
        let indexed = t.elapsed() - maps_read - wg_read;
        self.kernel_config = Some(self.dataplane.maps().config()?);
        self.stale = false;
        self.collect_flows()?;
        tracing::debug!(
            maps_ms = maps_read.as_secs_f64() * 1e3,
            wireguard_ms = wg_read.as_secs_f64() * 1e3,
            index_ms = indexed.as_secs_f64() * 1e3,
            total_ms = t.elapsed().as_secs_f64() * 1e3,
            "read the kernel's state"
        );
        Ok(())
    }

    /// Frees the empty policy tries of the ids no peer and no trie entry uses, beyond the
    /// spares the planner fills next: what a state with many policies leaves behind when one
    /// with fewer replaces it ([`Maps::reclaim_policy_tries`]), at most [`RECLAIM_BUDGET`] per
    /// address family a call. Only when the view of the kernel is current. The number freed.
    pub fn reclaim_policy_tries(&mut self) -> Result<u64, ReconcileError> {
        self.check_open()?;
        if self.stale {
            return Ok(0);
        }
        let maps = self.actual.maps();
        let in_use: BTreeSet<u32> = maps
            .peers
            .values()
            .map(|entry| entry.policy)
            .chain(maps.policies.keys().copied())
            .filter(|id| *id != UNRESTRICTED && *id != EMPTY_POLICY)
            .collect();
        Ok(self
            .dataplane
            .maps_mut()
            .reclaim_policy_tries(&in_use, RECLAIM_BUDGET)?)
    }

    /// Deletes the reply flows that can no longer pass a reply: expired ones, and those whose
    /// owner is not (or no longer) the owner of their address's entry. Each counts as freed
    /// for its slot, which gives the slot's quota back. Returns how many went; costs one pass
    /// over the flow tables and one write per deleted flow (none when nothing is dead).
    ///
    /// With a sweeper, it only asks the sweeper for a pass, and returns 0.
    pub fn collect_flows(&mut self) -> Result<u64, ReconcileError> {
        self.check_open()?;
        if let Some(sweeper) = &self.sweeper {
            sweeper.sweep();
            return Ok(0);
        }
        if self.stale {
            return Ok(0);
        }
        let now = crate::monitor::Clock::now().monotonic_ns();
        let config = self.kernel_config.unwrap_or_default();
        // Before this agent wrote its settings (fresh or just translated maps) the entry has no
        // timeouts yet: nothing is judged expired by them.
        let timeouts = config.tcp_timeout_ns != 0;
        let peers = &self.actual.maps().peers;
        let dead = |flow: &Flow| {
            let v = &flow.value;
            peers.get(&flow.peer).is_none_or(|e| e.owner != v.owner)
                || (timeouts
                    && now.saturating_sub(v.last_seen_ns)
                        > config.timeout_ns(flow.protocol, v.state))
        };
        let freed = self.dataplane.maps_mut().remove_flows(dead)?;
        self.flows_freed += freed;
        if freed > 0 {
            tracing::debug!(freed, "collected expired and orphaned reply flows");
        }
        Ok(freed)
    }

    /// Flows this reconciler deleted itself so far (collected or forgotten; not the
    /// sweeper's).
    pub fn flows_freed(&self) -> u64 {
        self.flows_freed
    }

    /// What `reconcile` would do now: the plan, with the settings entry after its lead, or why
    /// there is none with the plan's lead.
    /// `changes`: the pipeline's, since the state it accepted before (see
    /// [`Self::reconcile_changes`]).
    fn plan(
        &mut self,
        desired: &DesiredState,
        changes: Option<&state::Changes>,
    ) -> Result<Result<Plan, Unplanned>, ReconcileError> {
        if self.stale {
            self.refresh()?;
        }
        let planned = match (changes, &self.applied) {
            (Some(changes), _) if self.tracking => plan_changes(
                desired,
                crate::plan::Changes::of(changes, desired),
                &self.actual,
            ),
            (None, Some(previous)) => plan_update(previous, desired, &self.actual),
            _ => plan(desired, &self.actual),
        };
        let settings = settings_ops(
            &self.settings,
            desired.replies,
            self.cpus,
            self.kernel_config.as_ref(),
        );
        Ok(planned.map(|plan| plan.with_settings(settings)))
    }

    /// The state the kernel was last made to match, if it is known to.
    pub fn applied(&self) -> Option<&DesiredState> {
        self.applied.as_ref()
    }

    /// Makes the kernel match `desired`, changing only what differs.
    pub fn reconcile(&mut self, desired: DesiredState) -> Result<Outcome, ReconcileError> {
        let start = Instant::now();
        // Peers whose window is over are revoked (the datapath already drops their packets).
        let desired = desired.without_expired(crate::clock::unix_secs());
        let plan = match self.plan(&desired, None)? {
            Ok(plan) => plan,
            Err(unplanned) => return Err(self.apply_lead_only(unplanned)),
        };
        self.tracking = false;
        let result = self.execute(&plan, start);
        if result.is_err() {
            drop_later(self.applied.take());
        } else {
            self.share_policies(desired.peers.iter(), true);
            // The previous state is freed off the apply path (milliseconds at 100,000 peers).
            drop_later(self.applied.replace(desired));
        }
        result
    }

    /// Makes the kernel match `desired`, the state [`crate::state::Pipeline`] accepted, given
    /// its `changes` since the state it accepted before: while the kernel is known to match
    /// that one (the last call succeeded, no resync since), only the changed peers are
    /// planned, so a push costs what changed. Otherwise everything is compared. Keeps no copy
    /// of the state: the pipeline has it.
    pub fn reconcile_changes(
        &mut self,
        desired: &DesiredState,
        changes: &state::Changes,
    ) -> Result<Outcome, ReconcileError> {
        // A peer whose window is over is revoked, which a plan of the changes alone would not
        // do (the peer need not have changed): the whole state is compared without it, for as
        // long as the state file keeps it.
        let now = crate::clock::unix_secs();
        // The pipeline says when the first window ends: no pass over the peers before then.
        let may_expire = changes
            .earliest_expiry
            .is_none_or(|first| first.is_some_and(|end| end <= now));
        if may_expire {
            if let std::borrow::Cow::Owned(unexpired) = desired.unexpired(now) {
                return self.reconcile(unexpired);
            }
        }
        let start = Instant::now();
        let plan = match self.plan(desired, Some(changes))? {
            Ok(plan) => plan,
            Err(unplanned) => return Err(self.apply_lead_only(unplanned)),
        };
        drop_later(self.applied.take());
        // A full plan (the kernel read again, or a resync) may have left the view holding
        // copies of every policy; a plan of the changes, only of the changed peers'.
        let full = !self.tracking;
        let result = self.execute(&plan, start);
        if result.is_ok() {
            if full {
                self.share_policies(desired.peers.iter(), true);
            } else {
                self.share_policies(changes.touched_in(desired), false);
            }
        }
        self.tracking = result.is_ok();
        result
    }

    /// After a successful apply: the view refers to `peers`' compiled policies (the accepted
    /// state's) wherever the kernel holds them ([`Actual::share`]). The copies it held are
    /// freed off the apply path; after a full plan (`full`: one copy a policy, read back from
    /// the kernel) with a heap trim, after a plan of changes (the few the plan wrote) without.
    fn share_policies<'a>(&mut self, peers: impl IntoIterator<Item = &'a PeerSpec>, full: bool) {
        let copies = self
            .actual
            .share(peers.into_iter().filter_map(|p| p.policy.as_ref()));
        match (copies.is_empty(), full) {
            (true, _) => {}
            (false, true) => crate::drop_later_and_trim(copies),
            (false, false) => drop_later(copies),
        }
    }

    /// Applies `plan`, made from `start` on.
    fn execute(&mut self, plan: &Plan, start: Instant) -> Result<Outcome, ReconcileError> {
        let plan_duration = start.elapsed();
        self.wg_time = Duration::ZERO;
        let writes_before = self.dataplane.maps().writes();
        let wg_before = self.wg.peer_updates();
        // In the plan's order: the lead (revocations and the forgetting of their flows, room
        // in a full map), the settings (and their flow work), then the rest. A failure stops
        // where it is; what ran stays, and the retry plans from the kernel as it is.
        let result = self.apply(&plan.ops);
        if result.is_err() {
            self.stale = true;
        }
        let outcome = Outcome {
            ops: plan.ops.len(),
            map_writes: self.dataplane.maps().writes() - writes_before,
            wg_peer_updates: self.wg.peer_updates() - wg_before,
            duration: start.elapsed(),
            plan_duration,
            wg_duration: self.wg_time,
        };
        result.map(|()| outcome)
    }

    /// A state that cannot be planned (a full map) still gets its lead: revocations never wait
    /// for room (the flows of the deleted addresses are forgotten there too). The kernel is
    /// read again before the next plan.
    fn apply_lead_only(&mut self, unplanned: Unplanned) -> ReconcileError {
        let Unplanned { error, lead } = unplanned;
        let applied = self.apply(&lead.ops);
        self.stale = true;
        self.tracking = false;
        drop_later(self.applied.take());
        if let Err(e) = applied {
            return e;
        }
        if !lead.ops.is_empty() {
            tracing::warn!(
                ops = lead.ops.len(),
                "the state cannot be applied whole ({error}); its revocations were"
            );
        }
        ReconcileError::Plan(error)
    }

    /// Map writes issued through this reconciler so far.
    pub fn map_writes(&self) -> u64 {
        self.dataplane.maps().writes()
    }

    pub fn wg_peer_updates(&self) -> u64 {
        self.wg.peer_updates()
    }

    /// Deletes the reply flows recorded for these peer addresses.
    fn forget_flows(&mut self, addrs: &BTreeSet<IpAddr>) -> Result<(), ReconcileError> {
        if addrs.is_empty() {
            return Ok(());
        }
        self.check_open()?;
        if let Some(sweeper) = &self.sweeper {
            sweeper.forget(addrs.clone());
            return Ok(());
        }
        let removed = self
            .dataplane
            .maps_mut()
            .remove_flows(|flow| addrs.contains(&flow.peer))?;
        self.flows_freed += removed;
        if removed > 0 {
            tracing::debug!(
                removed,
                addresses = addrs.len(),
                "forgot the reply flows of addresses that went or moved"
            );
        }
        Ok(())
    }

    /// Writes the settings entry (its owner high-water mark stays the kernel's).
    fn put_settings(&mut self, config: &Config) -> Result<(), ReconcileError> {
        let config = Config {
            owner_high: self.kernel_config.map_or(0, |c| c.owner_high),
            ..*config
        };
        self.dataplane.maps_mut().set_config(&config)?;
        self.kernel_config = Some(config);
        Ok(())
    }

    /// Deletes every reply flow (replies were switched off).
    fn forget_all_flows(&mut self) -> Result<(), ReconcileError> {
        match &self.sweeper {
            Some(sweeper) => sweeper.forget_all(),
            None => self.flows_freed += self.dataplane.maps_mut().remove_flows(|_| true)?,
        }
        Ok(())
    }

    fn apply(&mut self, ops: &[Op]) -> Result<(), ReconcileError> {
        let mut i = 0;
        while i < ops.len() {
            self.check_open()?;
            // Consecutive WireGuard changes go to the device in one update (still per peer).
            let run = 1 + ops[i + 1..]
                .iter()
                .take_while(|op| same_kind(op, &ops[i]))
                .count();
            let batch = &ops[i..i + run];
            match &ops[i] {
                Op::WgPeer(_) => {
                    let changes: Vec<&WgPeerChange> = batch
                        .iter()
                        .filter_map(|op| match op {
                            Op::WgPeer(c) => Some(c),
                            _ => None,
                        })
                        .collect();
                    let t = Instant::now();
                    let result = self.wg.apply_changes(&changes);
                    self.wg_time += t.elapsed();
                    result?;
                }
                Op::PutSettings { config, .. } => self.put_settings(config)?,
                Op::ForgetFlows { addrs } => {
                    self.forget_flows(&addrs.iter().copied().collect())?;
                }
                Op::ForgetAllFlows => self.forget_all_flows()?,
                Op::RemoveWgPeer { .. } => {
                    let keys: Vec<WgKey> = batch
                        .iter()
                        .filter_map(|op| match op {
                            Op::RemoveWgPeer { key } => Some(*key),
                            _ => None,
                        })
                        .collect();
                    let t = Instant::now();
                    let result = self.wg.remove_peers(&keys);
                    self.wg_time += t.elapsed();
                    result?;
                }
                _ => {
                    for op in batch {
                        self.check_open()?;
                        apply_map_op(self.dataplane.maps_mut(), op)?;
                        if let (Op::RaiseOwnerHigh { owner }, Some(config)) =
                            (op, self.kernel_config.as_mut())
                        {
                            config.owner_high = config.owner_high.max(*owner);
                        }
                        self.actual.apply(op);
                    }
                    i += run;
                    continue;
                }
            }
            for op in batch {
                self.actual.apply(op);
            }
            i += run;
        }
        // New policy tries go into their arrays before the first peer entry that names them;
        // any left (a plan that ends with policy writes) go now, so the kernel holds what
        // `actual` says.
        self.dataplane.maps_mut().flush_policies()?;
        Ok(())
    }
}

/// Whether two operations go to the kernel in one batch: consecutive WireGuard changes in one
/// device update, consecutive map writes one by one; the settings and the flow work alone.
fn same_kind(a: &Op, b: &Op) -> bool {
    let alone = |op: &Op| matches!(op, Op::PutSettings { .. }) || op.is_flow_work();
    match (a, b) {
        _ if alone(a) || alone(b) => false,
        (Op::WgPeer(_), Op::WgPeer(_)) => true,
        (Op::RemoveWgPeer { .. }, Op::RemoveWgPeer { .. }) => true,
        _ => a.is_map_write() && b.is_map_write(),
    }
}

/// Applies one map operation of a plan (WireGuard operations are not map operations and are
/// skipped; flows are deleted here and now). The tests and the benchmarks, which fill maps
/// without a WireGuard device, reach it through [`crate::testing::apply_map_op`].
pub(crate) fn apply_map_op(maps: &mut Maps, op: &Op) -> Result<(), DataplaneError> {
    match op {
        Op::PutPolicyEntry {
            policy,
            prefix,
            allows,
        } => maps.upsert_policy(*policy, *prefix, &CompiledPolicy::value(allows)),
        Op::ResetPeerCounters { slot } => maps.reset_peer_counters(*slot),
        Op::ResetRuleCounters { base, len } => maps.reset_rule_counters(*base, *len),
        Op::RaiseOwnerHigh { owner } => {
            let config = maps.config()?;
            if config.owner_high >= *owner {
                return Ok(());
            }
            maps.set_config(&wgfence_common::Config {
                owner_high: *owner,
                ..config
            })
        }
        Op::PutPeerEntry { addr, entry, .. } => maps.upsert_peer(*addr, *entry),
        // Deleting what is already gone is not an error.
        Op::DeletePeerEntry { addr } => maps.remove_peer(*addr).map(drop),
        Op::DeletePolicyEntry { policy, prefix } => maps.remove_policy(*policy, *prefix).map(drop),
        Op::PutSettings { config, .. } => {
            let owner_high = maps.config()?.owner_high;
            maps.set_config(&Config {
                owner_high,
                ..*config
            })
        }
        Op::ForgetFlows { addrs } => maps
            .remove_flows(|flow| addrs.contains(&flow.peer))
            .map(drop),
        Op::ForgetAllFlows => maps.remove_flows(|_| true).map(drop),
        Op::WgPeer(_) | Op::RemoveWgPeer { .. } => Ok(()),
    }
}
