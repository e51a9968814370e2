//! One plan in the making ([`Planner`]): its scope ([`Scope`]: every peer, or the [`Changes`]),
//! what its steps share, [`Planner::plan`], which runs the steps in the order the module's
//! documentation gives, and [`Planner::failure_lead`], what applies of a plan that failed. Each
//! step is a method in the file named for it.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use super::{
    actual::Actual,
    op::{Op, Plan},
    unplanned::PlanError,
};
use crate::state::{DesiredState, PeerSpec, WgKey};

/// Which peers a plan looks at.
pub(super) enum Scope<'a> {
    /// Every desired peer, and everything in the kernel: start-up, resync, after a failure.
    Full,
    /// Only these peers, given the kernel matches the state before them.
    Changes(Changes<'a>),
}

/// What changed between a state the kernel matches and the desired one: the desired peers that
/// are new or changed, and the previous versions of the peers that are gone or replaced (a
/// changed peer is in both). What [`super::plan_changes`] looks at, and all it looks at.
#[derive(Debug, Clone, Default)]
pub struct Changes<'a> {
    pub touched: Vec<&'a PeerSpec>,
    pub gone: Vec<&'a PeerSpec>,
}

impl<'a> Changes<'a> {
    /// The state pipeline's change set as the planner takes it: the touched peers of
    /// `desired` (the state `changes` led to) and the previous versions of those gone.
    pub fn of(changes: &'a crate::state::Changes, desired: &'a DesiredState) -> Self {
        Self {
            touched: changes.touched_in(desired),
            gone: changes.gone.iter().collect(),
        }
    }
}

/// One plan in the making: its scope and what its steps (see the module's documentation)
/// share. Each step is one method, in the file named for the step.
pub(super) struct Planner<'a> {
    pub(super) desired: &'a DesiredState,
    pub(super) actual: &'a Actual,
    pub(super) full: bool,
    /// The desired peers the plan looks at: all of them, or those new or changed.
    pub(super) touched: Vec<&'a PeerSpec>,
    /// The previous versions of peers that are gone or changed (incremental plans only).
    pub(super) gone: Vec<&'a PeerSpec>,
    /// The WireGuard key each address of a touched peer goes to.
    pub(super) want_key: BTreeMap<IpAddr, WgKey>,
    /// The address entries the lead deletes (step 1).
    pub(super) lead_deleted: BTreeSet<IpAddr>,
    /// Existing policy ids whose rules some desired peer counts, with their number
    /// ([`Self::without_settled`]; empty otherwise).
    pub(super) counted: BTreeMap<u32, u32>,
}

impl<'a> Planner<'a> {
    pub(super) fn new(desired: &'a DesiredState, scope: Scope<'a>, actual: &'a Actual) -> Self {
        let full = matches!(scope, Scope::Full);
        let (touched, gone) = match scope {
            Scope::Full => (desired.peers.iter().collect(), Vec::new()),
            Scope::Changes(Changes { touched, gone }) => (touched, gone),
        };
        let want_key = touched
            .iter()
            .flat_map(|p| p.addrs().map(|a| (a, p.public_key)))
            .collect();
        let mut planner = Self {
            desired,
            actual,
            full,
            touched,
            gone,
            want_key,
            lead_deleted: BTreeSet::new(),
            counted: BTreeMap::new(),
        };
        planner.lead_deleted = planner.lead_deletions();
        planner
    }

    /// The whole plan, in the module's order.
    pub(super) fn plan(&self) -> Result<Plan, PlanError> {
        let mut ops = Vec::new();
        let ids = self.policy_ids(&mut ops)?;
        let slots = self.slots(&mut ops)?;
        let wanted = self.entries(&ids, &slots, &mut ops)?;
        let (mut lead, lead_delta) = self.revocations();
        let (moved, delta) = self.entry_writes(&wanted, &mut ops);
        ops.extend(self.wg_changes());
        ops.extend(moved);
        let (gc_lead, gc_last) = self.policy_gc(&delta, &lead_delta);
        lead.extend(gc_lead);
        lead.append(&mut ops);
        lead.extend(gc_last);
        Ok(Plan { ops: lead })
    }

    /// What applies of a plan that failed: its lead alone (steps 1–3), with every trie entry
    /// nothing references once the lead ran collected.
    pub(super) fn failure_lead(&self) -> Vec<Op> {
        let (mut lead, lead_delta) = self.revocations();
        let (gc, _) = self.policy_gc(&lead_delta, &lead_delta);
        lead.extend(gc);
        lead
    }
}
