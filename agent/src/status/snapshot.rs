//! The agent's status snapshot: a small JSON file under `/run/wgfence/` that the daemon
//! writes ([`StatusFile`]) and `wgfence status` reads ([`AgentStatus::read`]) to say whether
//! the agent is ready and how its last reconcile went. Peer names are not in it (it is
//! rewritten on every reconcile and must stay O(1)); `status` maps counter slots to names from
//! the state file itself.

use std::{
    io,
    path::{Path, PathBuf},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use serde::{Deserialize, Serialize};

/// Directory of the status snapshots.
pub const STATUS_DIR: &str = "/run/wgfence";

pub fn status_path(interface: &str) -> PathBuf {
    Path::new(STATUS_DIR).join(format!("{interface}.status.json"))
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LastReconcile {
    /// Unix seconds.
    pub at: u64,
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub ops: usize,
    pub map_writes: u64,
    pub wireguard_peer_updates: u64,
    pub duration_ms: f64,
}

impl LastReconcile {
    /// A reconcile that made `ops` operations (`map_writes` map writes and
    /// `wireguard_peer_updates` WireGuard peer updates) in `duration`.
    pub fn ok(
        ops: usize,
        map_writes: u64,
        wireguard_peer_updates: u64,
        duration: Duration,
    ) -> Self {
        Self {
            at: now(),
            ok: true,
            error: None,
            ops,
            map_writes,
            wireguard_peer_updates,
            duration_ms: duration.as_secs_f64() * 1e3,
        }
    }

    pub fn failed(error: &str) -> Self {
        Self {
            at: now(),
            ok: false,
            error: Some(error.to_owned()),
            ..Self::default()
        }
    }
}

/// Counts of the accepted state, for logs, metrics and the snapshot (the daemon takes them from
/// its pipeline: no pass over the peers).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Summary {
    pub peers: usize,
    pub restricted_peers: usize,
    /// Distinct rule sets: texts of `egress` (several may compile to one policy).
    pub rule_sets: usize,
}

/// What the running agent says about itself.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentStatus {
    pub pid: u32,
    pub interface: String,
    pub state_file: PathBuf,
    /// The state's source and what of it is applied: `file PATH`, or `secret NS/NAME key KEY`
    /// with ` resourceVersion RV` once a version is applied.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub source: String,
    pub ready: bool,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    pub peers: usize,
    pub restricted_peers: usize,
    pub last_reconcile: LastReconcile,
}

impl AgentStatus {
    pub fn read(interface: &str) -> io::Result<Self> {
        let text = std::fs::read_to_string(status_path(interface))?;
        serde_json::from_str(&text).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

/// Writes the snapshot atomically (temporary file, then rename).
pub struct StatusFile {
    path: PathBuf,
    status: AgentStatus,
    warned: bool,
}

impl StatusFile {
    pub fn new(interface: &str, state_file: &Path) -> Self {
        Self {
            path: status_path(interface),
            status: AgentStatus {
                pid: std::process::id(),
                interface: interface.to_owned(),
                state_file: state_file.to_owned(),
                ..AgentStatus::default()
            },
            warned: false,
        }
    }

    /// The source, and what of it is applied.
    pub fn source(&mut self, what: &str) {
        if self.status.source != what {
            what.clone_into(&mut self.status.source);
            self.write();
        }
    }

    /// A state was applied: ready.
    pub fn applied(&mut self, last: LastReconcile, summary: &Summary) {
        self.status.ready = true;
        self.status.reason.clear();
        self.status.peers = summary.peers;
        self.status.restricted_peers = summary.restricted_peers;
        self.status.last_reconcile = last;
        self.write();
    }

    /// Applying failed: not ready, with the failure as the last reconcile.
    pub fn failed(&mut self, last: LastReconcile, reason: &str) {
        self.status.last_reconcile = last;
        self.not_ready(reason);
    }

    /// Not ready (state missing or rejected, agent stopping); the last reconcile and the counts
    /// of the state that is enforced stay as they were.
    pub fn not_ready(&mut self, reason: &str) {
        self.status.ready = false;
        reason.clone_into(&mut self.status.reason);
        self.write();
    }

    fn write(&mut self) {
        if let Err(e) = self.try_write(&self.status) {
            if !self.warned {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot write the status snapshot");
                self.warned = true;
            }
        }
    }

    fn try_write(&self, status: &AgentStatus) -> io::Result<()> {
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let json = serde_json::to_vec_pretty(status).map_err(io::Error::other)?;
        let tmp = self.path.with_extension("json.tmp");
        std::fs::write(&tmp, json)?;
        std::fs::rename(&tmp, &self.path)
    }
}
