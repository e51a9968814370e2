//! `wgfence run`: the loop from the state's source to the kernel.
//!
//! The source is a [`Watch`] to wait on and a [`Reader`] to read from: the state file, or one
//! Secret through the Kubernetes API ([`crate::source::kubernetes`]). The loop knows no more
//! of it than the label readiness and status name it by; "the state file" below is whichever
//! it is.
//!
//! Start-up adopts what is pinned (maps keep enforcing, the program is replaced through the
//! pinned link) and reads the kernel's state; nothing is removed until a valid state has been
//! loaded. Then every change of the state file's directory, every resync tick and every retry
//! after a kernel error runs one load: read, validate, plan, apply. A state that fails
//! validation is rejected whole and the last good one stays applied. SIGTERM stops the loop and
//! leaves the datapath attached and enforcing.

use std::{
    io,
    net::SocketAddr,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use tokio::{
    signal::unix::{signal, SignalKind},
    sync::watch,
    time::Instant,
};

use crate::{
    dataplane::{AttachOptions, Check, Dataplane, DataplaneError, Repair},
    metrics::{self, Endpoints, Health, Metrics},
    reconcile::{ReconcileError, Reconciler},
    source::{
        kubernetes::{self, KubeError, SecretRef},
        ReadError, Reader, Snapshot, SourceError, StateFile, StateSource, Watch,
    },
    state::{Changes, Fingerprint, Pipeline, Rejection},
    status::{
        rules::rule_rows,
        snapshot::{LastReconcile, StatusFile, Summary},
    },
    sweeper::{Sweeper, FLOW_SWEEP},
    trust::{self, TrustError},
    wg::{WgError, WireGuard},
};

/// Longest wait before retrying after a kernel error.
const MAX_RETRY: Duration = Duration::from_secs(30);
/// Peers added, changed and removed by one push beyond which the freed memory is handed back
/// to the system after the apply.
const LARGE_CHANGE: usize = 1024;
/// Allocations from this size up are served by mmap, and unmapped when freed.
const MMAP_THRESHOLD: libc::c_int = 256 * 1024;
/// How often the attachment and the pins are checked (a name lookup and a few `stat`s).
const DATAPLANE_CHECK: Duration = Duration::from_secs(1);

#[derive(Debug, Clone)]
pub struct RunOptions {
    pub interface: String,
    /// Where the state comes from.
    pub source: SourceOptions,
    pub bpffs: PathBuf,
    pub metrics_addr: Option<SocketAddr>,
    /// Also serve the probes (`/healthz`, `/readyz`) here, on a listener of their own.
    pub health_addr: Option<SocketAddr>,
    pub resync: Duration,
    pub peer_metrics: bool,
    pub datapath_debug: bool,
    /// Which hook to attach with (`--attach`).
    pub hook: crate::dataplane::HookMode,
    /// Reply flow timeouts and the drop event rate.
    pub settings: crate::settings::DatapathSettings,
    /// Read a state file that users other than root can change (see [`crate::trust`]).
    pub allow_insecure_state: bool,
    /// The largest state file read (`--max-state-bytes`, see [`crate::input`]).
    pub max_state_bytes: u64,
}

/// `--source`: a state file, or one Secret watched through the Kubernetes API.
#[derive(Debug, Clone)]
pub enum SourceOptions {
    File(PathBuf),
    Kubernetes(SecretRef),
}

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("attaching the datapath")]
    Dataplane(#[from] DataplaneError),
    #[error(transparent)]
    WireGuard(#[from] WgError),
    #[error("reading the kernel's state")]
    Reconcile(#[from] ReconcileError),
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("the Kubernetes source")]
    Kubernetes(#[from] KubeError),
    #[error("state file {path}")]
    Untrusted {
        path: PathBuf,
        #[source]
        source: TrustError,
    },
    #[error("metrics or health address {addr}")]
    MetricsBind {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("starting the metrics server")]
    MetricsServer(#[source] io::Error),
    #[error("starting the runtime")]
    Runtime(#[from] io::Error),
    #[error("the reconcile task failed")]
    Task(#[from] tokio::task::JoinError),
}

/// Runs the agent until SIGTERM or SIGINT.
pub fn run(options: RunOptions) -> Result<(), DaemonError> {
    // Every push reads the file into buffers as large as the file (its bytes, its peers'
    // fields), freed right after. Served by mmap they go back to the system when freed; glibc
    // would otherwise raise its mmap threshold after the first such free and keep them in the
    // heap, resident. Fixed, at 256 KiB, the threshold no longer moves.
    // SAFETY: mallopt only changes the allocator's tuning; called before any thread starts.
    unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(run_async(options))
}

/// The synchronous part: owns the reconciler and decides what a load does. It runs on the
/// blocking pool, so a large apply never stalls the metrics server or signal handling.
struct Core {
    reconciler: Reconciler,
    /// The file, or the Secret's latest version: the daemon knows no more of its source.
    reader: Reader,
    /// Why the last read found no state (the Secret lacks its key), so that an unchanged
    /// object is counted as rejected once.
    unreadable: Option<String>,
    /// Reads each new state file, keeping the last accepted state and what decides the next.
    pipeline: Pipeline,
    /// Hash of the state file's bytes that are applied now; an identical read costs nothing.
    applied: Option<u128>,
    /// Hash of the last rejected state, so an unchanged bad file is not re-parsed per event.
    rejected: Option<u128>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    peer_metrics: bool,
    status: StatusFile,
    map_writes_seen: u64,
    flows_freed_seen: u64,
    wg_updates_seen: u64,
    /// The last dataplane check found the interface gone, the pins detached or an error.
    dataplane_fault: bool,
    /// The state file as read and parsed at start-up, for the first load.
    prepared: Option<Prepared>,
}

/// The state file read and parsed while the datapath was being attached (start-up, on a
/// thread of its own): the first load takes its result if the file still hashes alike.
struct Prepared {
    hash: u128,
    result: Result<Changes, Rejection>,
}

/// Reads and parses the state file into a new pipeline, on a thread: the parse is the largest
/// part of a restart at scale after the verifier's, and does not need the kernel. WireGuard's
/// capacity is checked by the first load. Any read problem is left to the first load too.
fn prepare(state_file: StateFile) -> Option<std::thread::JoinHandle<(Pipeline, Option<Prepared>)>> {
    let parse = move || {
        let mut pipeline = Pipeline::new();
        let prepared = state_file.read().ok().map(|bytes| {
            let bytes = bytes.as_slice();
            let read = pipeline.fingerprint(bytes).and_then(|fingerprint| {
                let hash = fingerprint.id();
                let result = pipeline.update_from(bytes, fingerprint, None)?;
                Ok(Prepared { hash, result })
            });
            match read {
                Ok(prepared) => prepared,
                Err(never) => match never {},
            }
        });
        (pipeline, prepared)
    };
    // No thread to spare: the first load reads the file itself.
    std::thread::Builder::new()
        .name("wgfence-parse".into())
        .spawn(parse)
        .ok()
}

/// Counts of the accepted state, kept by the pipeline: no pass over the peers.
fn summary(pipeline: &Pipeline) -> Summary {
    Summary {
        peers: pipeline.state().peers.len(),
        restricted_peers: pipeline.restricted_peers(),
        rule_sets: pipeline.rule_sets(),
    }
}

/// What a load asks of the loop.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    Idle,
    Retry,
}

impl Core {
    fn load(&mut self, force: bool) -> Next {
        // A state change goes first: the flow sweeper waits until it is applied.
        let _pause = self.reconciler.pause_flow_work();
        if self.dataplane_fault {
            // Nothing is applied while the datapath is not attached as it should be: WireGuard
            // peers added to a device without the program would pass unfiltered, and ready
            // would say otherwise. The datapath check resyncs once it is repaired.
            tracing::debug!("datapath fault: the state is applied once the datapath is back");
            return Next::Idle;
        }
        let file = match self.open_state() {
            Ok(file) => file,
            Err(next) => return next,
        };
        // Present again (a Secret re-created, a file back).
        self.metrics.source_object_missing.set(0);
        self.unreadable = None;
        // The one pass over the file before it is known to be new: an unchanged file costs no
        // more, and a new one is then read only where it changed.
        let fingerprint = match self.pipeline.fingerprint(&file) {
            Ok(fingerprint) => fingerprint,
            Err(e) => return read_failed(&e),
        };
        let mut hash = fingerprint.id();
        if !force && (self.applied == Some(hash) || self.rejected == Some(hash)) {
            if self.applied == Some(hash) {
                // The same bytes at a new resourceVersion: that one is applied now.
                self.applied_from(file.origin());
            }
            return Next::Idle;
        }
        let origin = file.origin().map(str::to_owned);
        let result = match self.changes_of(&file, fingerprint, &mut hash) {
            Ok(result) => result,
            Err(next) => return next,
        };
        // Pieces read at different times may be of different writes (a file rewritten in
        // place): whatever they made is a valid state, applied or rejected as any other, but
        // not taken for the file's, which is read again at once.
        let torn = file.written_since_open();
        drop(file);
        let changes = match result {
            Ok(changes) => changes,
            Err(_) if torn => return read_failed(&std::io::Error::other("written while read")),
            Err(rejection) => {
                let (errors, failed_tests) = self.rejection_text(rejection);
                self.reject(&errors, &failed_tests, hash, origin.as_deref());
                return Next::Idle;
            }
        };
        self.rejected = None;
        let mut next = self.apply(&changes, hash);
        if self.applied == Some(hash) {
            self.applied_from(origin.as_deref());
        }
        if torn {
            self.applied = None;
            next = read_failed(&std::io::Error::other("written while read"));
        }
        let large = changes.touched.len() + changes.gone.len() > LARGE_CHANGE;
        if large {
            // Freeing many peers and handing the memory back, off the path of the next push.
            crate::drop_later_and_trim(changes);
        }
        next
    }

    /// What the pipeline makes of a new file: the start-up parse's result if it is of these
    /// bytes, else the file read where it changed; both held to WireGuard's capacity. `hash`
    /// becomes the pipeline's identity of the file when a refusal starts the pipeline over.
    fn changes_of(
        &mut self,
        file: &Snapshot,
        fingerprint: Fingerprint,
        hash: &mut u128,
    ) -> Result<Result<Changes, Rejection>, Next> {
        let capacity = self.reconciler.wireguard().max_peers();
        match self.prepared.take().filter(|p| p.hash == *hash) {
            Some(prepared) => {
                let result = self.within_capacity(prepared.result, capacity);
                if matches!(result, Err(Rejection::TooMany { .. })) {
                    // Refused with a new pipeline: its identity of the same bytes.
                    match self.pipeline.fingerprint(file) {
                        Ok(fingerprint) => *hash = fingerprint.id(),
                        Err(e) => return Err(read_failed(&e)),
                    }
                }
                Ok(result)
            }
            None => match self.pipeline.update_from(file, fingerprint, capacity) {
                Ok(result) => Ok(result),
                Err(e) => Err(read_failed(&e)),
            },
        }
    }

    /// A rejection as the log gives it, with the failing policy tests it names: those are
    /// named in /readyz, not only in the log.
    fn rejection_text(&self, rejection: Rejection) -> (String, Vec<String>) {
        match rejection {
            Rejection::Invalid(errors) => {
                let failed_tests = crate::state::assertions::failed(&errors);
                (errors.to_string(), failed_tests)
            }
            // Refused here, whole, rather than halfway through the WireGuard update.
            Rejection::TooMany { peers, max } => (
                format!(
                    "state rejected: {peers} peers, but {} is run by a userspace WireGuard \
                     (wireguard-go), which holds at most {max}",
                    self.reconciler.dataplane().interface()
                ),
                Vec::new(),
            ),
            e @ Rejection::NotUtf8(_) => (e.to_string(), Vec::new()),
        }
    }

    /// The start-up parse's result, held to WireGuard's capacity (`max`): parsed without it,
    /// a state with more peers is refused now, and the pipeline that accepted it starts over.
    fn within_capacity(
        &mut self,
        result: Result<Changes, Rejection>,
        max: Option<usize>,
    ) -> Result<Changes, Rejection> {
        let peers = self.pipeline.state().peers.len();
        match (result, max) {
            (Ok(_), Some(max)) if peers > max => {
                self.pipeline = Pipeline::new();
                Err(Rejection::TooMany { peers, max })
            }
            (result, _) => result,
        }
    }

    /// Readiness and status name what is applied: the source, and for a Secret the
    /// resourceVersion.
    fn applied_from(&mut self, origin: Option<&str>) {
        let what = match origin {
            Some(origin) => origin.to_owned(),
            None => self.reader.name(),
        };
        self.health.set_ready_from(&what);
        self.status.source(&what);
    }

    /// The state, open to be read; if it cannot be, what the loop does next (the reason
    /// is logged and, unless the file is being replaced, said by the readiness).
    fn open_state(&mut self) -> Result<Snapshot, Next> {
        match self.reader.open() {
            Ok(file) => Ok(file),
            Err(ReadError::NotListed(why)) => {
                // Nothing applied, nothing pruned: what is pinned keeps enforcing.
                tracing::debug!("{why}");
                self.not_ready(&why);
                Err(Next::Idle)
            }
            Err(ReadError::ObjectMissing(why)) => {
                tracing::warn!("{why}");
                self.metrics.source_object_missing.set(1);
                self.not_ready(&why);
                self.applied = None;
                Err(Next::Idle)
            }
            Err(ReadError::NoKey(why)) => {
                if self.unreadable.as_deref() != Some(why.as_str()) {
                    tracing::error!("{why}: state rejected; the last good state stays applied");
                    self.metrics.state_rejected.inc();
                    self.unreadable = Some(why.clone());
                }
                self.not_ready(&format!("state rejected: {why}"));
                self.applied = None;
                Err(Next::Idle)
            }
            Err(e @ ReadError::Replaced(_)) => {
                tracing::warn!(error = %e, "reading the state file again");
                Err(Next::Retry)
            }
            Err(e @ ReadError::Untrusted(_)) => {
                let why = crate::error_chain(&e);
                tracing::error!("{why}; keeping what is enforced");
                self.not_ready(&why);
                self.applied = None;
                Err(Next::Idle)
            }
            Err(e @ ReadError::Refused(_)) => {
                // Not a regular file, or over --max-state-bytes: rejected like an invalid
                // state, without a byte read.
                let why = e.to_string();
                tracing::error!("{why}\nthe last good state stays applied");
                self.metrics.state_rejected.inc();
                self.not_ready(&why);
                self.applied = None;
                self.rejected = None;
                Err(Next::Idle)
            }
            Err(e) => {
                let why = e.to_string();
                tracing::warn!(source = %self.reader.name(), "{why}; keeping what is enforced");
                if matches!(e, ReadError::Missing) {
                    self.metrics.source_object_missing.set(1);
                }
                self.not_ready(&why);
                self.applied = None;
                Err(Next::Idle)
            }
        }
    }

    /// The state file (its bytes hash to `hash`) was rejected with `errors`, naming the
    /// policy tests that failed: the last good state stays applied.
    fn reject(&mut self, errors: &str, failed_tests: &[String], hash: u128, origin: Option<&str>) {
        tracing::error!(
            source = %self.reader.name(),
            "{errors}\nthe last good state stays applied"
        );
        self.metrics.state_rejected.inc();
        // A Secret's version is named: which write was refused.
        if failed_tests.is_empty() {
            let of = origin.map(|o| format!("{o}; ")).unwrap_or_default();
            self.not_ready(&format!(
                "state file rejected by validation ({of}see the agent's log)"
            ));
        } else {
            let of = origin.map(|o| format!(" ({o})")).unwrap_or_default();
            self.not_ready(&format!(
                "state file rejected{of}: policy test failed: {}",
                failed_tests.join("; ")
            ));
        }
        self.rejected = Some(hash);
        self.applied = None;
        // Rejecting walks the whole file as a value tree: hand the freed memory back.
        crate::trim_heap();
    }

    fn apply(&mut self, changes: &Changes, hash: u128) -> Next {
        let summary = summary(&self.pipeline);
        match self
            .reconciler
            .reconcile_changes(self.pipeline.state(), changes)
        {
            Ok(outcome) => {
                self.account(Some(outcome.duration));
                self.metrics.peers.set(summary.peers as i64);
                self.metrics.rule_sets.set(summary.rule_sets as i64);
                self.metrics.ready.set(1);
                self.health.set_ready();
                self.applied = Some(hash);
                if self.peer_metrics {
                    self.update_slot_names();
                }
                if outcome.ops > 0 {
                    tracing::info!(
                        peers = summary.peers,
                        restricted = summary.restricted_peers,
                        rule_sets = summary.rule_sets,
                        ops = outcome.ops,
                        map_writes = outcome.map_writes,
                        wireguard_peer_updates = outcome.wg_peer_updates,
                        duration_ms = outcome.duration.as_secs_f64() * 1e3,
                        "state applied"
                    );
                } else {
                    tracing::debug!(
                        peers = summary.peers,
                        plan_ms = outcome.plan_duration.as_secs_f64() * 1e3,
                        "state unchanged"
                    );
                }
                let last = LastReconcile::ok(
                    outcome.ops,
                    outcome.map_writes,
                    outcome.wg_peer_updates,
                    outcome.duration,
                );
                self.status.applied(last, &summary);
                Next::Idle
            }
            Err(ReconcileError::Closed) => Next::Idle,
            Err(e) => {
                self.account(None);
                self.metrics.reconcile_errors.inc();
                let why = format!("applying the state failed: {}", crate::error_chain(&e));
                tracing::error!("{why}; will retry");
                self.metrics.ready.set(0);
                self.health.set_not_ready(why.clone());
                self.status.failed(LastReconcile::failed(&why), &why);
                self.applied = None;
                Next::Retry
            }
        }
    }

    /// Not enforcing the current state file: `/readyz`, the metric and the status snapshot
    /// all say so, with the reason.
    fn not_ready(&mut self, why: &str) {
        self.health.set_not_ready(why);
        self.metrics.ready.set(0);
        self.status.not_ready(why);
    }

    /// Adds what the reconciler wrote since the last call to the counters.
    fn account(&mut self, duration: Option<Duration>) {
        let writes = self.reconciler.map_writes();
        let updates = self.reconciler.wg_peer_updates();
        self.metrics
            .bpf_map_writes
            .inc_by(writes - self.map_writes_seen);
        self.metrics
            .wireguard_peer_updates
            .inc_by(updates - self.wg_updates_seen);
        self.map_writes_seen = writes;
        self.wg_updates_seen = updates;
        let freed = self.reconciler.flows_freed();
        self.metrics
            .reply_flows_freed
            .inc_by(freed - self.flows_freed_seen);
        self.flows_freed_seen = freed;
        if let Some(d) = duration {
            self.metrics.reconcile_duration.observe(d.as_secs_f64());
        }
    }

    /// Peer names by counter slot, for per-peer series (O(peers): only with --peer-metrics).
    fn update_slot_names(&self) {
        let desired = self.pipeline.state();
        let peers = &self.reconciler.actual().maps().peers;
        let names: Vec<(u32, String)> = desired
            .peers
            .iter()
            .filter_map(|p| {
                let slot = p.addrs().find_map(|a| peers.get(&a).map(|e| e.slot))?;
                Some((slot, p.name.to_string()))
            })
            .collect();
        if let Ok(mut slots) = self.metrics.slot_names.write() {
            *slots = names;
        }
        let rules = rule_rows(desired, |a| peers.get(&a).copied());
        if let Ok(mut rows) = self.metrics.rule_names.write() {
            *rows = rules;
        }
    }

    /// Checks the attachment and the pins, repairing what it can (see [`Dataplane::check`]).
    fn check_dataplane(&mut self) -> Next {
        let check = self.reconciler.dataplane_mut().check();
        match check {
            Ok(Check::Intact) => {
                if self.dataplane_fault {
                    // It was gone and is back as it was: read the kernel and apply again.
                    self.dataplane_fault = false;
                    return self.resync();
                }
                Next::Idle
            }
            Ok(Check::Repaired {
                reattached,
                repairs,
            }) => {
                self.metrics.count_repairs(&repairs);
                let was_faulted = std::mem::replace(&mut self.dataplane_fault, false);
                let tries_lost = repairs.iter().any(|r| matches!(r, Repair::PolicyTries(_)));
                if reattached || was_faulted || tries_lost {
                    // A new device has none of the old one's WireGuard peers; after a fault,
                    // loads were held back and the agent said it was not ready; policy tries
                    // without their pins read as empty until they are written again.
                    self.resync()
                } else {
                    Next::Idle
                }
            }
            Ok(Check::Unpinned { repairs, .. }) => {
                // Logged by the check. The programs are attached and enforcing from the
                // agent's descriptors: state changes (revocations) keep being applied.
                self.metrics.count_repairs(&repairs);
                self.metrics.datapath_repair_failures.inc();
                let reattached = repairs
                    .iter()
                    .any(|r| matches!(r, Repair::Reattached { .. }));
                let was_faulted = std::mem::replace(&mut self.dataplane_fault, false);
                if reattached || was_faulted {
                    self.resync()
                } else {
                    Next::Idle
                }
            }
            Ok(Check::InterfaceGone) => {
                if !self.dataplane_fault {
                    tracing::warn!(
                        interface = %self.reconciler.dataplane().interface(),
                        "the interface is gone; the program is attached again when it comes back"
                    );
                    self.dataplane_fault = true;
                    self.not_ready("the WireGuard interface is gone");
                    self.applied = None;
                }
                Next::Idle
            }
            Ok(Check::Detached) => {
                if !self.dataplane_fault {
                    self.dataplane_fault = true;
                    self.not_ready(
                        "detached by `wgfence detach`; restart the agent to attach again",
                    );
                    self.applied = None;
                }
                Next::Idle
            }
            Err(e) => {
                tracing::error!(error = %crate::error_chain(&e), "checking the datapath's attachment failed; will retry");
                self.metrics.reconcile_errors.inc();
                self.dataplane_fault = true;
                self.not_ready(&format!("datapath: {}", crate::error_chain(&e)));
                Next::Idle
            }
        }
    }

    /// Notes which rule counters moved since the last look (their last hit: now): the
    /// datapath reads no clock per packet. At every resync, so a last hit is known to within
    /// `--resync`; hits since the last look read as "now" in `status --rules`.
    fn observe_rule_hits(&mut self) {
        // The pipeline's accepted state, while the kernel matches it (the reconciler keeps no
        // copy of a state applied as changes).
        if self.applied.is_none() {
            return;
        }
        let desired = self.pipeline.state();
        let peers = &self.reconciler.actual().maps().peers;
        let rows = rule_rows(desired, |a| peers.get(&a).copied());
        let now = crate::clock::now_ns(libc::CLOCK_BOOTTIME);
        let maps = self.reconciler.dataplane_mut().maps_mut();
        if let Err(e) = maps.observe_rule_hits(rows.iter().filter_map(|r| r.counter), now) {
            tracing::warn!(error = %crate::error_chain(&e), "noting the rule hits failed");
        }
    }

    fn resync(&mut self) -> Next {
        self.observe_rule_hits();
        let _pause = self.reconciler.pause_flow_work();
        if let Err(e) = self.reconciler.refresh() {
            if !matches!(e, ReconcileError::Closed) {
                tracing::error!(error = %crate::error_chain(&e), "resync: reading the kernel failed; will retry");
                self.metrics.reconcile_errors.inc();
                return Next::Retry;
            }
            return Next::Idle;
        }
        // Against the last accepted state (the pipeline keeps it), before the load repairs.
        if self.applied.is_some() {
            // Without the peers whose window is over: revoked, not drift.
            let state = self.pipeline.state().unexpired(crate::clock::unix_secs());
            let drift = crate::verify::drift_of(&state, self.reconciler.actual());
            if !drift.is_empty() {
                tracing::warn!(
                    entries = drift.len(),
                    first = %drift[0],
                    "resync: the kernel differs from the applied state; repairing"
                );
            }
            self.metrics.drift_entries.set(drift.len() as i64);
        }
        let next = self.load(true);
        if matches!(next, Next::Idle) && !self.dataplane_fault {
            self.reclaim_policy_tries();
        }
        next
    }

    /// After a resync that left the kernel as the state wants it: frees the empty policy
    /// tries that a state with fewer policies than before left past its ids. A failure
    /// changes nothing that enforces: the next resync tries again.
    fn reclaim_policy_tries(&mut self) {
        let start = std::time::Instant::now();
        match self.reconciler.reclaim_policy_tries() {
            Ok(0) | Err(ReconcileError::Closed) => {}
            Ok(tries) => tracing::info!(
                tries,
                duration_ms = start.elapsed().as_secs_f64() * 1e3,
                "freed empty policy tries of ids no policy uses"
            ),
            Err(e) => tracing::warn!(
                error = %crate::error_chain(&e),
                "freeing empty policy tries failed; the next resync tries again"
            ),
        }
        self.account(None);
    }
}

async fn run_async(options: RunOptions) -> Result<(), DaemonError> {
    tracing::debug!(interface = %options.interface, "starting");
    let metrics = Arc::new(Metrics::new(
        options.bpffs.clone(),
        options.interface.clone(),
        options.peer_metrics,
    ));
    // Before anything else: an agent that would take its policy from a file others can write
    // does not start at all.
    check_trusted(&options)?;
    let health = Arc::new(Health::default());
    health.set_not_ready("no valid state loaded yet");
    // Bind before touching the kernel: a second agent started by mistake on the same node
    // fails here, before it could replace the running one's program. One on the same
    // interface is told which agent runs there, not only that the port is taken.
    crate::dataplane::refuse_if_locked(&options.bpffs, &options.interface)?;
    let listeners = bind(&options).await?;
    // The file is parsed while the datapath attaches; a Secret is read once the watch has
    // listed it (the first load).
    let parsing = match &options.source {
        SourceOptions::File(path) => prepare(StateFile::new(
            path,
            !options.allow_insecure_state,
            options.max_state_bytes,
        )),
        SourceOptions::Kubernetes(_) => None,
    };
    let reconciler = adopt(&options, &metrics)?;
    let (pipeline, prepared) = match parsing {
        Some(parsing) => parsing
            .join()
            .map_err(|_| io::Error::other("the thread parsing the state file panicked"))?,
        None => (Pipeline::new(), None),
    };
    let closed = reconciler.shutdown_handle();
    serve(listeners, &metrics, &health)?;
    let (source, reader, state_path) = watch_source(&options, &metrics).await?;
    let shutdown = shutdown_on_signal(Arc::clone(&closed))?;
    let mut status = StatusFile::new(&options.interface, &state_path);
    status.source(&reader.name());
    let core = Core {
        reconciler,
        reader,
        unreadable: None,
        pipeline,
        applied: None,
        rejected: None,
        metrics,
        health,
        peer_metrics: options.peer_metrics,
        status,
        map_writes_seen: 0,
        flows_freed_seen: 0,
        wg_updates_seen: 0,
        dataplane_fault: false,
        prepared,
    };
    let mut core = Some(core);
    follow(&mut core, source, shutdown, &closed, options.resync).await?;
    if let Some(core) = core.as_mut() {
        core.not_ready("agent stopped (the datapath stays attached and enforcing)");
    }
    tracing::info!(
        "stopping; the datapath stays attached and keeps enforcing the last applied state \
         (`wgfence detach` removes it)"
    );
    Ok(())
}

/// Refuses a state file others can write (unless `--allow-insecure-state`).
fn check_trusted(options: &RunOptions) -> Result<(), DaemonError> {
    if let (SourceOptions::File(path), false) = (&options.source, options.allow_insecure_state) {
        trust::check_state_path(path).map_err(|source| DaemonError::Untrusted {
            path: path.clone(),
            source,
        })?;
    }
    Ok(())
}

/// Serves the metrics and health endpoints on the bound listeners.
fn serve(
    listeners: Vec<(std::net::TcpListener, Endpoints)>,
    metrics: &Arc<Metrics>,
    health: &Arc<Health>,
) -> Result<(), DaemonError> {
    for (listener, endpoints) in listeners {
        // Each on its own thread: nothing a client of one endpoint does can delay this loop
        // or the other endpoint.
        metrics::spawn(listener, endpoints, Arc::clone(metrics), Arc::clone(health))
            .map_err(DaemonError::MetricsServer)?;
    }
    Ok(())
}

/// Starts watching the state's source: the state file, or the Secret through the Kubernetes
/// API; with its reader and the state file's path (empty for a Secret).
async fn watch_source(
    options: &RunOptions,
    metrics: &Metrics,
) -> Result<(Watch, Reader, PathBuf), DaemonError> {
    Ok(match &options.source {
        SourceOptions::File(path) => (
            Watch::File(StateSource::watch(path)?),
            Reader::File(StateFile::new(
                path,
                !options.allow_insecure_state,
                options.max_state_bytes,
            )),
            path.clone(),
        ),
        SourceOptions::Kubernetes(secret) => {
            let errors = metrics.source_errors.clone();
            let (watch, latest) = kubernetes::start(secret.clone(), move || {
                errors.inc();
            })
            .await?;
            (
                Watch::Kubernetes(watch),
                Reader::Kubernetes(latest),
                PathBuf::new(),
            )
        }
    })
}

/// Binds the metrics and health listeners asked for.
async fn bind(
    options: &RunOptions,
) -> Result<Vec<(std::net::TcpListener, Endpoints)>, DaemonError> {
    let mut listeners = Vec::new();
    for (addr, endpoints) in [
        (options.metrics_addr, Endpoints::All),
        (options.health_addr, Endpoints::Probes),
    ] {
        if let Some(addr) = addr {
            // Tokio's bind sets SO_REUSEADDR: a restart binds again despite connections of
            // the previous agent in TIME_WAIT.
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .and_then(|listener| listener.into_std())
                .map_err(|source| DaemonError::MetricsBind { addr, source })?;
            listeners.push((listener, endpoints));
        }
    }
    Ok(listeners)
}

/// Attaches the datapath (adopting what is pinned) and reads the kernel into a reconciler,
/// with the flow sweeper running.
fn adopt(options: &RunOptions, metrics: &Metrics) -> Result<Reconciler, DaemonError> {
    let attach = AttachOptions {
        interface: options.interface.clone(),
        bpffs: options.bpffs.clone(),
        datapath_debug: options.datapath_debug,
        hook: options.hook,
    };
    // Adoption: the WireGuard device is read while the datapath is loaded and attached (the
    // verifier's time does not depend on the peers; the device's read does). The maps are read
    // after the attach, which may translate them.
    let interface = options.interface.clone();
    let device = std::thread::Builder::new()
        .name("wgfence-adopt".into())
        .spawn(move || -> Result<_, WgError> {
            let wg = WireGuard::open(&interface)?;
            let device = wg.read()?;
            Ok((wg, device))
        })?;
    let attached = Dataplane::attach(&attach);
    // A datapath that cannot attach is the error to report, as before the read was parallel.
    let mut dataplane = match attached {
        Ok(dataplane) => dataplane,
        Err(e) => {
            let _ = device.join();
            return Err(e.into());
        }
    };
    if options.datapath_debug {
        spawn_datapath_logger(&mut dataplane);
    }
    // The maps are read while the device's read still runs.
    let reconciler = Reconciler::adopt_reading(dataplane, || -> Result<_, DaemonError> {
        let read = device
            .join()
            .map_err(|_| io::Error::other("the thread reading the WireGuard device panicked"))?;
        let (wg, device) = read?;
        Ok((wg, device))
    })?
    .with_settings(options.settings);
    let backend = reconciler.wireguard().backend_name();
    // Attaching recounted every slot's quota from its flows and the reconciler collected the
    // dead ones (nothing else deletes any yet): from here on the sweeper, with map handles of
    // its own, is the one writer of the freed counts.
    let sweeper_maps = Dataplane::open_maps(&options.bpffs, &options.interface)?;
    let freed_metric = metrics.reply_flows_freed.clone();
    let sweeper = Sweeper::spawn(sweeper_maps, FLOW_SWEEP, move |n| {
        freed_metric.inc_by(n);
    })?;
    let reconciler = reconciler.with_sweeper(sweeper);
    let adopted = reconciler.actual();
    tracing::info!(
        interface = %options.interface,
        wireguard_backend = backend,
        peer_entries = adopted.maps().peers.len(),
        policies = adopted.maps().policies.len(),
        wireguard_peers = adopted.wg().peers.len(),
        "kernel state read; nothing is removed before a valid state is loaded"
    );
    Ok(reconciler)
}

/// The state file could not be read whole once open, or was written while it was read (a
/// file rewritten in place): read it again, keeping what is enforced.
fn read_failed(e: &std::io::Error) -> Next {
    tracing::warn!(error = %e, "the state file changed while it was read; reading it again");
    Next::Retry
}

/// The loop: loads on every change of the state file, resyncs every `resync`, checks the
/// datapath every [`DATAPLANE_CHECK`], retries with backoff, until `shutdown` or `closed`.
async fn follow(
    core: &mut Option<Core>,
    mut source: Watch,
    mut stop: watch::Receiver<bool>,
    closed: &AtomicBool,
    resync: Duration,
) -> Result<(), DaemonError> {
    let mut next = step(core, |c| c.load(false)).await?;
    let mut retry_delay = Duration::from_secs(1);
    let mut resync = tokio::time::interval_at(Instant::now() + resync, resync);
    let mut check = tokio::time::interval_at(Instant::now() + DATAPLANE_CHECK, DATAPLANE_CHECK);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // When the pending retry is due: set once, when a load asks for it, and kept until it runs,
    // so that other events (the datapath check every second) never push it back.
    let mut retry_at: Option<Instant> = None;
    loop {
        retry_at = match next {
            Next::Retry => retry_at.or_else(|| Some(Instant::now() + retry_delay)),
            Next::Idle => None,
        };
        tokio::select! {
            _ = stop.changed() => break,
            () = source.changed() => {
                next = step(core, |c| c.load(false)).await?;
            }
            _ = resync.tick() => {
                next = step(core, Core::resync).await?;
            }
            _ = check.tick() => {
                let checked = step(core, Core::check_dataplane).await?;
                // A pending retry stays pending.
                if checked == Next::Retry {
                    next = Next::Retry;
                }
            }
            () = sleep_until(retry_at) => {
                retry_at = None;
                next = step(core, |c| c.load(true)).await?;
                retry_delay = (retry_delay * 2).min(MAX_RETRY);
            }
        }
        if next == Next::Idle {
            retry_delay = Duration::from_secs(1);
        }
        if closed.load(Ordering::Acquire) {
            break;
        }
    }
    Ok(())
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Runs `f` on the blocking pool with the core moved in and back out.
async fn step(
    core: &mut Option<Core>,
    f: impl FnOnce(&mut Core) -> Next + Send + 'static,
) -> Result<Next, DaemonError> {
    let Some(mut c) = core.take() else {
        return Ok(Next::Idle);
    };
    let (c, next) = tokio::task::spawn_blocking(move || {
        let next = f(&mut c);
        (c, next)
    })
    .await?;
    *core = Some(c);
    Ok(next)
}

/// SIGTERM and SIGINT set the shutdown flag at once (an apply in progress stops at its next
/// operation) and wake the loop.
fn shutdown_on_signal(closed: Arc<AtomicBool>) -> Result<watch::Receiver<bool>, DaemonError> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(signal = name, "shutting down");
        closed.store(true, Ordering::Release);
        let _ = tx.send(true);
    });
    Ok(rx)
}

/// Forwards the datapath's aya-log records to the agent's log.
fn spawn_datapath_logger(dataplane: &mut Dataplane) {
    let _ = tracing_log::LogTracer::init();
    match aya_log::EbpfLogger::init(dataplane.ebpf_mut()) {
        Ok(logger) => {
            // SAFETY: the logger owns its ring buffer's fd, which stays open and the same for
            // the logger's whole life; the AsyncFd owns the logger.
            let registered = unsafe {
                tokio::io::unix::AsyncFd::register_with_interest(
                    logger,
                    tokio::io::Interest::READABLE,
                )
            };
            match registered {
                Ok(mut fd) => {
                    tokio::spawn(async move {
                        loop {
                            let Ok(mut guard) = fd.readable_mut().await else {
                                break;
                            };
                            guard.get_inner_mut().flush();
                            guard.clear_ready();
                        }
                    });
                }
                Err(e) => tracing::warn!(error = %e, "datapath log reader"),
            }
        }
        Err(e) => tracing::warn!(error = %e, "datapath logging unavailable"),
    }
}
