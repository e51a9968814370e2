//! The planner: a pure function from (desired state, actual kernel state) to the ordered list of
//! operations that makes the kernel match, touching only what differs. No I/O.
//!
//! The order is what keeps every unchanged peer's traffic flowing and never grants a packet
//! more than its sender's policy, at any instant while the plan is applied:
//!
//! 1. delete the address entries no peer has any more — revocations take effect here, before
//!    any put: a put can fail (a full peer map, a full trie) and must never hold a revocation
//!    back, while a deletion only takes access away — and the entries of addresses that move to
//!    another WireGuard peer (a takeover, a key rotation), so the old holder never runs with the
//!    new holder's entry;
//!    the reply flows recorded for these addresses are forgotten right after (the flow
//!    sweeper deletes them, off the apply path);
//! 2. remove the WireGuard peers that leave the state, also those whose addresses another peer
//!    takes over (their entries went in step 1): a leaked key loses its session, and the
//!    address's inbound traffic, even when every put fails;
//! 3. delete the trie entries of policies nothing references after step 1 and no put of this
//!    plan will (a revoked peer's policy, leftovers of a failed put): nobody loses access, and at
//!    a full trie the puts need the room;
//! 4. write the trie entries of policies the kernel does not have yet (new ids, unreferenced);
//! 5. write peer address entries that are new or changed (a policy switch is one update); a new
//!    peer's counter slot is one no entry uses, or one whose entries step 1 deleted, never a
//!    slot a remaining peer uses;
//! 6. create and update WireGuard peers, per peer: new peers, endpoints, keys, keepalives,
//!    and allowed IPs added without ever clearing a live peer's list (adding an address to a
//!    peer moves it from whichever peer had it);
//! 7. write the entries of the addresses that moved in step 1, now that WireGuard routes them
//!    to their new holder;
//! 8. delete the trie entries of policies step 5's switches left unreferenced.
//!
//! The datapath's settings entry ([`plan_settings`]: the replies switch, the flow timeouts and
//! quota) goes right after the lead ([`Plan::with_settings`]), with the forgetting of every flow
//! when replies are switched off: `wgfence plan` shows what `wgfence run` does.
//!
//! A plan that cannot be made whole (no counter slot, policy id or owner left) still gives its
//! lead, steps 1–3 ([`Unplanned`]): revocations never wait for room.
//!
//! Policies are content-addressed: a policy whose content the kernel already has under some id
//! keeps that id, so an unchanged state — in any order — plans nothing. Changing a peer's
//! rules writes a new policy, switches the peer in one update, then deletes the old entries:
//! a packet sees the old policy or the new one, never a mix.
//!
//! Where each part lives (a file per step, named for what it does):
//!
//! - `plan/scope.rs`: the entry points, [`plan`] (everything) and [`plan_update`] /
//!   [`plan_changes`] (only the peers that changed);
//! - `plan/planner.rs`: one plan in the making (its scope: every peer, or the changes), the
//!   steps run in the order above, and the lead of a plan that failed;
//! - `plan/revocations.rs`: steps 1 and 2; `plan/policy_gc.rs`: steps 3 and 8;
//!   `plan/policy_ids.rs`: step 4 and content addressing; `plan/slots.rs` and
//!   `plan/entries.rs`: steps 5 and 7 (counter slots, then the address entries and their
//!   writes); `plan/wireguard.rs`: step 6;
//! - `plan/settled.rs`: a full plan sets aside the peers the kernel has as asked;
//! - `plan/settings.rs`: the settings entry; `plan/unplanned.rs`: a plan without room;
//! - `plan/op.rs`: the operations and the plan; `plan/actual.rs` (with the maps of
//!   `actual_maps.rs` and the device of `plan/device.rs`), `plan/index.rs`,
//!   `plan/free_ids.rs` and `plan/rule_space.rs`: the kernel as read, with the indexes that
//!   make a plan cost what changed; `plan/apply.rs`: what an operation does to it;
//! - `plan/invariants.rs` (test support) and `plan/tests/`: what a plan must guarantee, and
//!   the tests, a file per part.

mod actual;
mod apply;
mod device;
mod entries;
mod free_ids;
mod index;
#[cfg(any(test, feature = "testing"))]
pub mod invariants;
mod op;
mod planner;
mod policy_gc;
mod policy_ids;
mod revocations;
mod rule_space;
mod scope;
mod settings;
mod settled;
mod slots;
#[cfg(test)]
mod tests;
mod unplanned;
mod wireguard;

pub use actual::Actual;
pub use device::{ActualWg, AllowedIps, WgPeer};

pub use crate::actual_maps::ActualMaps;
pub use op::{lead, Op, Plan, WgPeerChange};
pub use planner::Changes;
pub use scope::{plan, plan_changes, plan_update};
pub use settings::plan_settings;
pub use unplanned::{PlanError, Unplanned};

/// The policy id of `"egress": []`: no trie entry, so every packet is denied. One id, the
/// same for every such peer and across restarts, so that a policy id without entries is the
/// empty policy only under this id; any other id without entries is a policy whose entries
/// are not written (yet), which the invariants tell apart.
pub const EMPTY_POLICY: u32 = u32::MAX;
