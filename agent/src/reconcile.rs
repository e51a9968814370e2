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

use crate::{
    dataplane::{Dataplane, DataplaneError, Flow, Maps},
    plan::{
        plan, plan_changes, plan_update, Actual, ActualMaps, Op, Plan, PlanError, WgPeerChange,
    },
    policy::CompiledPolicy,
    settings::{online_cpus, DatapathSettings},
    state::{Changes, DesiredState, WgKey},
    sweeper::{Pause, Sweeper},
    wg::{WgError, WireGuard},
};

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

/// Reads the maps into the planner's form (O(entries)).
pub fn read_maps(maps: &Maps) -> Result<ActualMaps, DataplaneError> {
    let peers = maps.peers()?;
    let entries = maps
        .policies()?
        .into_iter()
        .map(|e| (e.policy, e.prefix, e.value.allows().to_vec()));
    Ok(ActualMaps::from_entries(peers, entries).with_owner_high(maps.config()?.owner_high))
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
        let mut r = Self {
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
        };
        r.refresh()?;
        Ok(r)
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
        self.check_open()?;
        self.applied = None;
        self.tracking = false;
        self.actual = Actual::new(read_maps(self.dataplane.maps())?, self.wg.read()?);
        self.kernel_config = Some(self.dataplane.maps().config()?);
        self.stale = false;
        self.collect_flows()?;
        Ok(())
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

    /// What `reconcile` would do now.
    pub fn plan(&mut self, desired: &DesiredState) -> Result<Plan, ReconcileError> {
        if self.stale {
            self.refresh()?;
        }
        Ok(match &self.applied {
            Some(previous) => plan_update(previous, desired, &self.actual)?,
            None => plan(desired, &self.actual)?,
        })
    }

    /// The state the kernel was last made to match, if it is known to.
    pub fn applied(&self) -> Option<&DesiredState> {
        self.applied.as_ref()
    }

    /// Makes the kernel match `desired`, changing only what differs.
    pub fn reconcile(&mut self, desired: DesiredState) -> Result<Outcome, ReconcileError> {
        let start = Instant::now();
        let plan = self.plan(&desired)?;
        self.tracking = false;
        let result = self.execute(&plan, &desired, start);
        self.applied = result.is_ok().then_some(desired);
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
        changes: &Changes,
    ) -> Result<Outcome, ReconcileError> {
        let start = Instant::now();
        if self.stale {
            self.refresh()?;
        }
        let plan = if self.tracking {
            let gone = changes.gone.iter().collect();
            plan_changes(desired, changes.touched_in(desired), gone, &self.actual)?
        } else {
            plan(desired, &self.actual)?
        };
        self.applied = None;
        let result = self.execute(&plan, desired, start);
        self.tracking = result.is_ok();
        result
    }

    /// Applies `plan`, made for `desired` at `start`.
    fn execute(
        &mut self,
        plan: &Plan,
        desired: &DesiredState,
        start: Instant,
    ) -> Result<Outcome, ReconcileError> {
        let plan_duration = start.elapsed();
        self.wg_time = Duration::ZERO;
        let writes_before = self.dataplane.maps().writes();
        let wg_before = self.wg.peer_updates();
        let moved = moved_addresses(plan, desired, &self.actual);
        let mut config_ops = 0;
        // The lead (revocations, moving addresses, room in a full map) before anything else:
        // the settings write and the flow work (replies off deletes every flow) can take long
        // or fail, and a revocation waits for neither.
        let lead = plan.lead();
        let applied = self.apply(lead).and_then(|()| {
            config_ops = usize::from(self.apply_config(desired)?);
            // Before and after the rest: the entries of moved addresses are written there.
            self.forget_flows(&moved)?;
            self.apply(&plan.ops[lead.len()..])
        });
        // The flows of the addresses the plan deleted go also when a later operation failed:
        // the revocations lead the plan, and what ran of it stays (the retry plans from there).
        let mut forget = moved;
        forget.extend(plan.ops.iter().filter_map(|op| match op {
            Op::DeletePeerEntry { addr } if !self.actual.maps().peers.contains_key(addr) => {
                Some(*addr)
            }
            _ => None,
        }));
        let result = match applied {
            Ok(()) => self.forget_flows(&forget),
            Err(e) => {
                if let Err(also) = self.forget_flows(&forget) {
                    tracing::warn!(error = %also, "forgetting the flows of revoked addresses failed");
                }
                Err(e)
            }
        };
        if result.is_err() {
            self.stale = true;
        }
        let outcome = Outcome {
            ops: plan.ops.len() + config_ops,
            map_writes: self.dataplane.maps().writes() - writes_before,
            wg_peer_updates: self.wg.peer_updates() - wg_before,
            duration: start.elapsed(),
            plan_duration,
            wg_duration: self.wg_time,
        };
        result.map(|()| outcome)
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

    /// Writes the datapath's settings entry if the kernel's differs (one map write); whether
    /// it did. Switching replies off forgets every recorded flow, so switching them on again
    /// starts afresh.
    fn apply_config(&mut self, desired: &DesiredState) -> Result<bool, ReconcileError> {
        let mut want = self.settings.config(desired.replies, self.cpus);
        // The planner's, never lowered here.
        want.owner_high = self.kernel_config.map_or(0, |c| c.owner_high);
        if self.kernel_config == Some(want) {
            return Ok(false);
        }
        self.check_open()?;
        self.dataplane.maps_mut().set_config(&want)?;
        let replies_were_on = self.kernel_config.is_some_and(|c| c.replies());
        self.kernel_config = Some(want);
        if replies_were_on && !want.replies() {
            match &self.sweeper {
                Some(sweeper) => sweeper.forget_all(),
                None => self.flows_freed += self.dataplane.maps_mut().remove_flows(|_| true)?,
            }
        }
        Ok(true)
    }

    fn apply(&mut self, ops: &[Op]) -> Result<(), ReconcileError> {
        let mut i = 0;
        while i < ops.len() {
            self.check_open()?;
            // Consecutive WireGuard changes go to the device in one update (still per peer).
            let run = ops[i..]
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
        Ok(())
    }
}

fn same_kind(a: &Op, b: &Op) -> bool {
    match (a, b) {
        (Op::WgPeer(_), Op::WgPeer(_)) => true,
        (Op::RemoveWgPeer { .. }, Op::RemoveWgPeer { .. }) => true,
        (Op::WgPeer(_) | Op::RemoveWgPeer { .. }, _)
        | (_, Op::WgPeer(_) | Op::RemoveWgPeer { .. }) => false,
        _ => true,
    }
}

/// Addresses the plan gives to another WireGuard peer than the one holding them now: their
/// reply flows were recorded for the old holder.
fn moved_addresses(plan: &Plan, desired: &DesiredState, actual: &Actual) -> BTreeSet<IpAddr> {
    plan.ops
        .iter()
        .filter_map(|op| match op {
            Op::PutPeerEntry { peer, addr, .. } => {
                let key = desired
                    .peers
                    .binary_search_by(|p| p.name.as_str().cmp(peer))
                    .ok()
                    .map(|i| desired.peers[i].public_key)?;
                actual
                    .holder(*addr)
                    .filter(|holder| *holder != key)
                    .map(|_| *addr)
            }
            _ => None,
        })
        .collect()
}

/// Applies one map operation of a plan (WireGuard operations are not map operations and are
/// skipped): for tools that fill maps without a WireGuard device, like the benchmarks.
pub fn apply_map_op(maps: &mut Maps, op: &Op) -> Result<(), DataplaneError> {
    match op {
        Op::PutPolicyEntry {
            policy,
            prefix,
            allows,
        } => maps.upsert_policy(*policy, *prefix, &CompiledPolicy::value(allows)),
        Op::ResetPeerCounters { slot } => maps.reset_peer_counters(*slot),
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
        Op::WgPeer(_) | Op::RemoveWgPeer { .. } => Ok(()),
    }
}
