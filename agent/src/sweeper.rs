//! The reply-flow sweeper: deletes flows off the apply path, on a thread of its own with its own
//! map handles, so no revocation waits behind a pass over the flow tables (up to 262,144 flows,
//! about half a second).
//!
//! It deletes, every [`FLOW_SWEEP`] and when asked (at resync), the flows that can no longer
//! pass a reply: expired ones, and those whose owner is not their address's entry's owner. It
//! also deletes what the reconciler hands it: the flows of addresses that left or moved, and
//! all flows when replies are switched off. It deletes in chunks of [`CHUNK`] and, between
//! chunks, waits while a state change is being loaded or applied ([`Sweeper::pause`]).
//!
//! Once it runs, it is the agent's only writer of `wgf4_flow_freed` (each count is read and
//! written back, so two writers would lose flows): the reconciler deletes no flow itself.

use std::{
    collections::{BTreeSet, HashMap},
    net::IpAddr,
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        mpsc, Arc,
    },
    thread,
    time::{Duration, Instant},
};

use crate::dataplane::{DataplaneError, Flow, Maps};

/// How often expired and orphaned reply flows are deleted, giving their peers' quota back.
pub const FLOW_SWEEP: Duration = Duration::from_secs(5);
/// Flows deleted between two looks at a pending state change (a few milliseconds of deletes).
pub const CHUNK: usize = 4096;
/// How often a paused sweeper looks whether the state change it yields to is done.
const PAUSE_POLL: Duration = Duration::from_millis(2);

/// What a pass deletes.
#[derive(Debug, Default)]
struct Work {
    /// Expired flows and flows whose owner is no longer their address's.
    sweep: bool,
    /// Every flow of these addresses.
    forget: BTreeSet<IpAddr>,
    /// Every flow.
    all: bool,
}

impl Work {
    fn merge(&mut self, other: Work) {
        self.sweep |= other.sweep;
        self.all |= other.all;
        self.forget.extend(other.forget);
    }

    fn is_empty(&self) -> bool {
        !self.sweep && !self.all && self.forget.is_empty()
    }
}

struct Shared {
    /// Flows deleted so far.
    freed: AtomicU64,
    /// Told how many flows each chunk deleted (the `wgfence_reply_flows_freed_total` metric).
    on_freed: Box<dyn Fn(u64) + Send + Sync>,
    /// State changes being loaded or applied: the sweeper waits between chunks while nonzero.
    busy: AtomicUsize,
    stop: AtomicBool,
}

/// The handle of the sweeper thread; dropping it stops the thread (between two chunks).
pub struct Sweeper {
    tx: Option<mpsc::Sender<Work>>,
    shared: Arc<Shared>,
    thread: Option<thread::JoinHandle<()>>,
}

/// While held, the sweeper deletes nothing (it finishes the chunk it is in).
pub struct Pause(Arc<Shared>);

impl Drop for Pause {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Sweeper {
    /// Starts the sweeper on `maps` (its own handles: the thread never shares them). Run
    /// [`Maps::recount_flow_quota`] before, while no other writer of `freed` runs.
    /// `on_freed` is told how many flows each chunk deleted.
    pub fn spawn(
        maps: Maps,
        interval: Duration,
        on_freed: impl Fn(u64) + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            freed: AtomicU64::new(0),
            on_freed: Box::new(on_freed),
            busy: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        });
        let (tx, rx) = mpsc::channel();
        let thread = thread::Builder::new().name("flow-sweeper".into()).spawn({
            let shared = Arc::clone(&shared);
            move || run(maps, &rx, &shared, interval)
        })?;
        Ok(Self {
            tx: Some(tx),
            shared,
            thread: Some(thread),
        })
    }

    fn send(&self, work: Work) {
        if let Some(tx) = &self.tx {
            // A stopped thread takes no more work: nothing to do then.
            let _ = tx.send(work);
        }
    }

    /// Asks for a sweep now (at resync).
    pub fn sweep(&self) {
        self.send(Work {
            sweep: true,
            ..Work::default()
        });
    }

    /// Deletes every flow of these addresses (they left the state or got a new holder).
    pub fn forget(&self, addrs: BTreeSet<IpAddr>) {
        if !addrs.is_empty() {
            self.send(Work {
                forget: addrs,
                ..Work::default()
            });
        }
    }

    /// Deletes every flow (replies were switched off).
    pub fn forget_all(&self) {
        self.send(Work {
            all: true,
            ..Work::default()
        });
    }

    /// Flows the sweeper deleted so far.
    pub fn freed(&self) -> u64 {
        self.shared.freed.load(Ordering::Acquire)
    }

    /// Holds the sweeper back while a state change is loaded and applied.
    pub fn pause(&self) -> Pause {
        self.shared.busy.fetch_add(1, Ordering::AcqRel);
        Pause(Arc::clone(&self.shared))
    }
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.tx = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn run(mut maps: Maps, rx: &mpsc::Receiver<Work>, shared: &Shared, interval: Duration) {
    let mut next_sweep = Instant::now() + interval;
    // Work a failed pass left, retried with the next.
    let mut work = Work::default();
    while !shared.stop.load(Ordering::Acquire) {
        match rx.recv_timeout(next_sweep.saturating_duration_since(Instant::now())) {
            Ok(more) => work.merge(more),
            Err(mpsc::RecvTimeoutError::Timeout) => work.sweep = true,
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
        while let Ok(more) = rx.try_recv() {
            work.merge(more);
        }
        if work.sweep {
            next_sweep = Instant::now() + interval;
        }
        if work.is_empty() {
            continue;
        }
        match pass(&mut maps, &work, shared) {
            Ok(freed) => {
                if freed > 0 {
                    tracing::debug!(freed, "deleted reply flows");
                }
                work = Work::default();
            }
            Err(e) => {
                // Left to the next pass: a flow that stays only holds its peer's quota.
                tracing::warn!(error = %crate::error_chain(&e), "deleting reply flows failed; will retry");
            }
        }
    }
}

/// One pass: lists the flows, then reads the entries (a flow whose owner is not its entry's
/// then is dead for good: owners are never reused), deletes the dead in chunks, yielding to
/// state changes between them. Returns how many went.
fn pass(maps: &mut Maps, work: &Work, shared: &Shared) -> Result<u64, DataplaneError> {
    let flows = maps.flows_unsorted()?;
    if flows.is_empty() {
        return Ok(0);
    }
    let owners: HashMap<IpAddr, u64> = if work.sweep {
        maps.peers()?
            .into_iter()
            .map(|(addr, entry)| (addr, entry.owner))
            .collect()
    } else {
        HashMap::new()
    };
    let config = maps.config()?;
    let now = crate::monitor::Clock::now().monotonic_ns();
    // Before the agent wrote its settings (fresh or just translated maps) the entry has no
    // timeouts yet: nothing is judged expired by them.
    let timeouts = config.tcp_timeout_ns != 0;
    let dead = |flow: &Flow| {
        let v = &flow.value;
        work.all
            || work.forget.contains(&flow.peer)
            || (work.sweep
                && (owners.get(&flow.peer) != Some(&v.owner)
                    || (timeouts
                        && now.saturating_sub(v.last_seen_ns)
                            > config.timeout_ns(flow.protocol, v.state))))
    };
    let dead: Vec<Flow> = flows.into_iter().filter(dead).collect();
    let mut freed = 0;
    for chunk in dead.chunks(CHUNK) {
        while shared.busy.load(Ordering::Acquire) > 0 && !shared.stop.load(Ordering::Acquire) {
            thread::sleep(PAUSE_POLL);
        }
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        let n = maps.remove_flow_list(chunk)?;
        shared.freed.fetch_add(n, Ordering::AcqRel);
        (shared.on_freed)(n);
        freed += n;
    }
    Ok(freed)
}
