//! A plan that cannot be made whole (no counter slot, policy id or owner left) still gives its
//! lead, steps 1–3 ([`Unplanned`]): revocations never wait for room.

use wgfence_common::MAX_PEERS;

use super::{
    op::{Op, Plan},
    planner::Planner,
};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("no free policy id is left")]
    PolicyIdsExhausted,
    #[error("no free per-peer counter slot is left (at most {MAX_PEERS})")]
    SlotsExhausted,
    #[error("no entry owner is left (64-bit counter exhausted)")]
    OwnersExhausted,
}

/// A plan that could not be made (no slot, policy id or owner is left), with its lead: the
/// revocations, the removals of leaving WireGuard peers and the trie entries nothing references
/// once they ran. They take access away only and need no room, so they apply even when the
/// rest cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{error}")]
pub struct Unplanned {
    pub error: PlanError,
    pub lead: Plan,
}

impl<'a> Planner<'a> {
    /// What applies of a plan that failed: its lead alone (steps 1–3), with every trie entry
    /// nothing references once the lead ran collected.
    pub(super) fn failure_lead(&self) -> Vec<Op> {
        let (mut lead, lead_delta) = self.revocations();
        let (gc, _) = self.policy_gc(&lead_delta, &lead_delta);
        lead.extend(gc);
        lead
    }
}
