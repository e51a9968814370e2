//! wgfence: per-peer egress policy for WireGuard gateways, enforced by a tcx eBPF program.
//!
//! Data flows one way: [`source`] watches the state file, [`state`] validates it into a
//! canonical desired state, [`policy`] compiles rule sets into trie entries, [`plan`] diffs
//! desired against actual (pure), [`reconcile`] applies the plan through [`dataplane`] (BPF
//! maps) and [`wg`] (WireGuard peers), and [`daemon`] runs the loop with [`metrics`] and
//! [`status`] alongside.

pub mod daemon;
pub mod dataplane;
pub mod metrics;
pub mod plan;
pub mod policy;
pub mod reconcile;
pub mod source;
pub mod state;
pub mod status;
pub mod wg;
