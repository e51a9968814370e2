//! The planner's entry points, by what a plan looks at: [`plan`] compares everything (start-up,
//! resync, after a failure); [`plan_update`] and [`plan_changes`] look only at the peers that
//! differ from a state the kernel matches, so a one-peer change costs the same at any number of
//! peers.

use super::{
    actual::Actual,
    op::Plan,
    planner::{Changes, Planner, Scope},
    unplanned::{PlanError, Unplanned},
};
use crate::state::{DesiredState, PeerSpec};

/// Plans the operations that make the kernel match `desired`, comparing everything; pure.
/// When no plan can be made, the error carries the plan's lead: see [`Unplanned`].
pub fn plan(desired: &DesiredState, actual: &Actual) -> Result<Plan, Unplanned> {
    plan_scope(desired, Scope::Full, actual)
}

/// Plans the same operations as [`plan`], given that the kernel matches `previous`: only the
/// peers that differ between the two states are looked at, so a one-peer change costs the same
/// at 100 peers as at 100,000 (but for one comparison of the two states).
pub fn plan_update(
    previous: &DesiredState,
    desired: &DesiredState,
    actual: &Actual,
) -> Result<Plan, Unplanned> {
    plan_scope(desired, Scope::Changes(diff(previous, desired)), actual)
}

/// Plans the same operations as [`plan_update`] from the changed peers alone (found without
/// comparing the two states, e.g. while parsing): a one-peer change costs the same at any
/// number of peers. `changes` must hold every peer that differs, and only those.
pub fn plan_changes<'a>(
    desired: &'a DesiredState,
    changes: Changes<'a>,
    actual: &Actual,
) -> Result<Plan, Unplanned> {
    plan_scope(desired, Scope::Changes(changes), actual)
}

/// Whether two versions of a peer ask the same of the kernel (the compiled policy follows from
/// the rules, so it is not compared again).
fn same_peer(a: &PeerSpec, b: &PeerSpec) -> bool {
    a.name == b.name
        && a.public_key == b.public_key
        && a.address == b.address
        && a.address_v6 == b.address_v6
        && a.endpoint == b.endpoint
        && a.preshared_key() == b.preshared_key()
        && a.persistent_keepalive == b.persistent_keepalive
        && a.rules == b.rules
        && a.mode == b.mode
        && a.window() == b.window()
}

/// Peers of `desired` that are new or changed since `previous`, and the versions of
/// `previous` that are gone or replaced. Both states are sorted by name.
fn diff<'a>(previous: &'a DesiredState, desired: &'a DesiredState) -> Changes<'a> {
    let (mut touched, mut gone) = (Vec::new(), Vec::new());
    for pair in crate::state::by_name(previous, desired) {
        match pair {
            (Some(old), Some(new)) if same_peer(old, new) => {}
            (old, new) => {
                gone.extend(old);
                touched.extend(new);
            }
        }
    }
    Changes { touched, gone }
}

fn plan_scope(
    desired: &DesiredState,
    scope: Scope<'_>,
    actual: &Actual,
) -> Result<Plan, Unplanned> {
    // A full plan (start-up, resync) plans nothing for the peers the kernel already has as
    // asked: after a restart that is nearly every peer. Should that plan fail, every peer is
    // planned, and that plan decides (its error, its lead, a full map's slot rotation).
    if matches!(scope, Scope::Full) {
        if let Ok(plan) = Planner::new(desired, Scope::Full, actual)
            .without_settled()
            .plan()
        {
            return Ok(plan);
        }
    }
    plan_every_peer(desired, scope, actual)
}

/// [`plan_scope`], with every peer of the scope planned.
pub(super) fn plan_every_peer(
    desired: &DesiredState,
    scope: Scope<'_>,
    actual: &Actual,
) -> Result<Plan, Unplanned> {
    let mut planner = Planner::new(desired, scope, actual);
    match planner.plan() {
        Err(PlanError::SlotsExhausted) if planner.rotate_stranded_slots() => planner.plan(),
        planned => planned,
    }
    .map_err(|error| Unplanned {
        error,
        lead: Plan {
            ops: planner.failure_lead(),
        },
    })
}
