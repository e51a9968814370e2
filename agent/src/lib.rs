//! wgfence: per-peer egress policy for WireGuard gateways, enforced by a tcx eBPF program.
//!
//! - [`policy`] compiles a peer's rules into canonical trie entries;
//! - [`dataplane`] loads, attaches, pins and adopts the datapath and gives typed map access.

pub mod dataplane;
pub mod plan;
pub mod policy;
pub mod state;
