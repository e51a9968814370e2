//! A plan that cannot be made whole (no counter slot, policy id or owner left) still gives its
//! lead, steps 1–3 ([`Unplanned`], made by `Planner::failure_lead`): revocations never wait
//! for room.

use wgfence_common::{MAX_PEERS, MAX_POLICIES};

use super::op::Plan;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("no free policy id is left (at most {MAX_POLICIES} distinct policies at once)")]
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
