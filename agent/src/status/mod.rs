//! The agent's status, in two roles that share only the snapshot's format: the daemon writes
//! its snapshot ([`snapshot::StatusFile`]) and `wgfence status` reads it, with the pins and
//! counters, into a [`report::Report`]. [`rules`] names the counted rules, for both.
//!
//! Nothing here reads a type of the daemon: the daemon hands the snapshot writer what it
//! needs ([`snapshot::Summary`], [`snapshot::LastReconcile`]).

pub mod report;
pub mod rules;
pub mod snapshot;

pub use snapshot::{status_path, AgentStatus, STATUS_DIR};
