//! One plan in the making ([`Planner`]): its scope, what its steps share, and [`Planner::plan`],
//! which runs the steps in the order the module's documentation gives. Each step is a method
//! in the file named for it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use super::{
    actual::Actual,
    op::Plan,
    scope::{Changes, Scope},
    unplanned::PlanError,
};
use crate::state::{DesiredState, PeerSpec, WgKey};

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
}
