//! Prometheus metrics (OpenMetrics text at `/metrics`), `/healthz` and `/readyz`; the probes
//! also on a listener of their own (`--health-addr`, [`Endpoints::Probes`]).
//!
//! The agent's own counters are kept in a `prometheus-client` registry; the datapath's packet
//! counters are read from the pinned maps on each scrape, so they count what the kernel counted
//! across agent restarts. Per-peer series only with `--peer-metrics`: at 100k peers they would
//! swamp a Prometheus server (`wgfence status` always has them).

use std::{
    convert::Infallible,
    io,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, RwLock,
    },
    time::Duration,
};

use http_body_util::Full;
use hyper::{body::Bytes, server::conn::http1, service::service_fn, Method, Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::{
    collector::Collector,
    encoding::{text::encode, DescriptorEncoder, EncodeMetric},
    metrics::{
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::Gauge,
        histogram::{exponential_buckets, Histogram},
        MetricType,
    },
    registry::Registry,
};
use tokio::{net::TcpListener, sync::Semaphore};
use wgfence_common::{Counter as DatapathCounter, RuleCounters};

use crate::{
    dataplane::{Counters, Dataplane, Maps, Repair},
    status::rules::RuleRow,
};

/// The label set of `wgfence_datapath_repairs_total`: `what` was repaired.
pub type RepairLabels = [(&'static str, &'static str); 1];

/// Whether the agent enforces the current state file, and if not, why; if so, what it
/// applied (the source, and a Secret's resourceVersion).
#[derive(Debug, Default)]
pub struct Health {
    ready: AtomicBool,
    reason: Mutex<String>,
    applied: Mutex<String>,
}

impl Health {
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Release);
        if let Ok(mut reason) = self.reason.lock() {
            reason.clear();
        }
    }

    /// Ready, naming what is applied (`/readyz` says `ready: WHAT`).
    pub fn set_ready_from(&self, what: &str) {
        self.set_ready();
        if let Ok(mut applied) = self.applied.lock() {
            what.clone_into(&mut applied);
        }
    }

    /// What the last ready state was applied from, if it was named.
    pub fn applied(&self) -> String {
        self.applied.lock().map(|a| a.clone()).unwrap_or_default()
    }

    pub fn set_not_ready(&self, why: impl Into<String>) {
        self.ready.store(false, Ordering::Release);
        if let Ok(mut reason) = self.reason.lock() {
            *reason = why.into();
        }
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    pub fn reason(&self) -> String {
        self.reason.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

/// Peer names by counter slot, for per-peer series.
pub type SlotNames = Arc<RwLock<Vec<(u32, String)>>>;

/// The counted rules, for per-rule series (with `--peer-metrics`).
pub type RuleNames = Arc<RwLock<Vec<RuleRow>>>;

/// The agent's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub peers: Gauge,
    pub rule_sets: Gauge,
    pub ready: Gauge,
    pub drift_entries: Gauge,
    pub source_object_missing: Gauge,
    pub source_errors: Counter,
    pub state_rejected: Counter,
    pub bpf_map_writes: Counter,
    pub wireguard_peer_updates: Counter,
    pub reconcile_errors: Counter,
    pub reply_flows_freed: Counter,
    pub reconcile_duration: Histogram,
    pub datapath_repairs: Family<RepairLabels, Counter>,
    pub datapath_repair_failures: Counter,
    pub slot_names: SlotNames,
    pub rule_names: RuleNames,
}

/// A series of the agent's own: its name and help text, as `/metrics` shows them.
type Series = (&'static str, &'static str);

const PEERS: Series = ("wgfence_peers", "Peers in the applied state");
const RULE_SETS: Series = (
    "wgfence_rule_sets",
    "Distinct rule sets (egress lists) in the applied state",
);
const READY: Series = (
    "wgfence_ready",
    "1 when the current state file is valid and applied",
);
const DRIFT_ENTRIES: Series = (
    "wgfence_drift_entries",
    "Map entries and WireGuard peers that differed from the applied state at the \
     last resync's read, before it repaired them (what `wgfence verify` names)",
);
const SOURCE_OBJECT_MISSING: Series = (
    "wgfence_source_object_missing",
    "1 while the state's source is gone (the state file missing, the Secret deleted \
     from the API): the last good state stays enforced",
);
const SOURCE_ERRORS: Series = (
    "wgfence_source_errors",
    "Errors of the Kubernetes API watch (connection refused, a broken watch, 410 \
     Gone), each retried within 400 ms",
);
const STATE_REJECTED: Series = (
    "wgfence_state_rejected",
    "State files rejected by validation, or refused unread (not a regular file, over \
     --max-state-bytes); the last good state stays applied",
);
const BPF_MAP_WRITES: Series = (
    "wgfence_bpf_map_writes",
    "BPF map updates and deletes issued by the agent",
);
const WIREGUARD_PEER_UPDATES: Series = (
    "wgfence_wireguard_peer_updates",
    "Per-peer WireGuard changes (create, update, remove) applied",
);
const RECONCILE_ERRORS: Series = (
    "wgfence_reconcile_errors",
    "Reconciles that failed in the kernel (retried)",
);
const REPLY_FLOWS_FREED: Series = (
    "wgfence_reply_flows_freed",
    "Reply flows the agent deleted: expired, or their address got a new holder",
);
const DATAPATH_REPAIR_FAILURES: Series = (
    "wgfence_datapath_repair_failures",
    "Checks that found pins missing and could not restore them (the programs kept \
     enforcing from the agent's own descriptors)",
);

impl Metrics {
    /// `peer_metrics`: also export per-peer series.
    pub fn new(bpffs: PathBuf, interface: String, peer_metrics: bool) -> Self {
        let mut registry = Registry::default();
        let r = &mut registry;
        let reconcile_duration = reconcile_duration(r);
        let datapath_repairs = datapath_repairs(r);
        let slot_names: SlotNames = Arc::default();
        let rule_names: RuleNames = Arc::default();
        r.register_collector(Box::new(DatapathCollector {
            bpffs,
            interface,
            slot_names: peer_metrics.then(|| Arc::clone(&slot_names)),
            rule_names: peer_metrics.then(|| Arc::clone(&rule_names)),
        }));
        Self {
            peers: registered(r, PEERS),
            rule_sets: registered(r, RULE_SETS),
            ready: registered(r, READY),
            drift_entries: registered(r, DRIFT_ENTRIES),
            source_object_missing: registered(r, SOURCE_OBJECT_MISSING),
            source_errors: registered(r, SOURCE_ERRORS),
            state_rejected: registered(r, STATE_REJECTED),
            bpf_map_writes: registered(r, BPF_MAP_WRITES),
            wireguard_peer_updates: registered(r, WIREGUARD_PEER_UPDATES),
            reconcile_errors: registered(r, RECONCILE_ERRORS),
            reply_flows_freed: registered(r, REPLY_FLOWS_FREED),
            reconcile_duration,
            datapath_repairs,
            datapath_repair_failures: registered(r, DATAPATH_REPAIR_FAILURES),
            slot_names,
            rule_names,
            registry,
        }
    }

    /// Counts what a datapath check repaired.
    pub fn count_repairs(&self, repairs: &[Repair]) {
        for repair in repairs {
            self.datapath_repairs
                .get_or_create(&[("what", repair.kind())])
                .inc();
        }
    }

    /// The exposition text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(e) = encode(&mut out, &self.registry) {
            tracing::warn!(error = %e, "encoding metrics");
        }
        out
    }
}

/// The reconcile time histogram, registered: 100 µs .. ~1.6 s.
fn reconcile_duration(registry: &mut Registry) -> Histogram {
    let histogram = Histogram::new(exponential_buckets(0.0001, 2.0, 15));
    registry.register(
        "wgfence_reconcile_duration_seconds",
        "Time to plan and apply one state",
        histogram.clone(),
    );
    histogram
}

/// The repair counters by kind, registered, every kind from the start at 0: an alert can
/// compare against it.
fn datapath_repairs(registry: &mut Registry) -> Family<RepairLabels, Counter> {
    let datapath_repairs = Family::<RepairLabels, Counter>::default();
    for what in Repair::KINDS {
        let _ = datapath_repairs.get_or_create(&[("what", what)]);
    }
    registry.register(
        "wgfence_datapath_repairs",
        "Repairs made while enforcing, by what: pin_dir (the pin directory, <bpffs>/wgfence \
         or bpffs removed, not by wgfence detach), map_pin, link_pin, program_pin, reattach (the \
         interface was recreated)",
        datapath_repairs.clone(),
    );
    datapath_repairs
}

/// A new metric, registered under `name` with `help`.
fn registered<M>(registry: &mut Registry, (name, help): Series) -> M
where
    M: prometheus_client::registry::Metric + Clone + Default,
{
    let metric = M::default();
    registry.register(name, help, metric.clone());
    metric
}

/// Reads the datapath's counters from the pinned maps at scrape time.
#[derive(Debug)]
struct DatapathCollector {
    bpffs: PathBuf,
    interface: String,
    slot_names: Option<SlotNames>,
    rule_names: Option<RuleNames>,
}

impl Collector for DatapathCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let maps = match Dataplane::open_maps(&self.bpffs, &self.interface) {
            Ok(maps) => maps,
            Err(e) => {
                tracing::debug!(error = %crate::error_chain(&e), "datapath counters unavailable");
                return Ok(());
            }
        };
        let Ok(counters) = maps.counters() else {
            return Ok(());
        };
        encode_packets(&mut encoder, &counters)?;
        if let Some(rules) = self.rule_names.as_ref().and_then(|r| r.read().ok()) {
            encode_rule_hits(&mut encoder, &maps, &rules)?;
        }
        if let Some(names) = self.slot_names.as_ref().and_then(|n| n.read().ok()) {
            encode_peers(&mut encoder, &maps, &names)?;
        }
        Ok(())
    }
}

/// The packet counters: by verdict, by reason, drop events and reply flows.
fn encode_packets(
    encoder: &mut DescriptorEncoder,
    counters: &Counters,
) -> Result<(), std::fmt::Error> {
    let verdicts = [("pass", counters.passed()), ("drop", counters.dropped())];
    counter_family(
        encoder,
        "wgfence_packets",
        "Packets from peers, by verdict",
        verdicts.iter().map(|(v, n)| ([("verdict", *v)], *n)),
    )?;
    let by_reason = |pass: bool| {
        DatapathCounter::ALL
            .iter()
            .filter(move |c| c.is_pass() == pass)
            .map(|c| ([("reason", c.name())], counters.get(*c)))
    };
    counter_family(
        encoder,
        "wgfence_dropped_packets",
        "Packets from peers dropped, by reason",
        by_reason(false),
    )?;
    counter_family(
        encoder,
        "wgfence_passed_packets",
        "Packets from peers passed, by reason",
        by_reason(true),
    )?;
    counter_family(
            encoder,
            "wgfence_drop_events",
            "Drop events for `wgfence monitor`, by outcome (rate_limited and ring_full were not written)",
            [
                DatapathCounter::EventSent,
                DatapathCounter::EventRateLimited,
                DatapathCounter::EventRingFull,
            ]
            .into_iter()
            .map(|c| ([("outcome", c.name())], counters.get(c))),
        )?;
    counter_family(
        encoder,
        "wgfence_reply_flows_recorded",
        "Flows the network started toward restricted peers, recorded so replies pass",
        std::iter::once((
            Vec::<(&str, &str)>::new(),
            counters.get(DatapathCounter::FlowRecorded),
        )),
    )?;
    counter_family(
            encoder,
            "wgfence_reply_flows_refused",
            "Flows toward restricted peers not recorded: the peer's quota (--flows-per-peer) or the flow table was full",
            std::iter::once((
                Vec::<(&str, &str)>::new(),
                counters.get(DatapathCounter::FlowRefused),
            )),
        )?;
    Ok(())
}

/// Per rule of the applied policies: packets and bytes it passed.
fn encode_rule_hits(
    encoder: &mut DescriptorEncoder,
    maps: &Maps,
    rules: &[RuleRow],
) -> Result<(), std::fmt::Error> {
    let mut hits = Vec::with_capacity(rules.len());
    let mut bytes = Vec::with_capacity(rules.len());
    for row in rules.iter() {
        // A rule without a counter (no packet can count for it) is a series at 0.
        let counted = row
            .counter
            .map_or(Ok(RuleCounters::default()), |i| maps.rule_counters(i));
        if let Ok(c) = counted {
            let policy = row.policy.to_string();
            hits.push((
                [("policy", policy.clone()), ("rule", row.rule.clone())],
                c.packets,
            ));
            bytes.push(([("policy", policy), ("rule", row.rule.clone())], c.bytes));
        }
    }
    counter_family(
            encoder,
            "wgfence_rule_hits",
            "Packets a policy passed, per rule (the first rule in canonical order that allows the packet)",
            hits.into_iter(),
        )?;
    counter_family(
        encoder,
        "wgfence_rule_hit_bytes",
        "Bytes a policy passed, per rule",
        bytes.into_iter(),
    )?;
    Ok(())
}

/// Per peer (`--peer-metrics`): packets by verdict, and would-drops.
fn encode_peers(
    encoder: &mut DescriptorEncoder,
    maps: &Maps,
    names: &[(u32, String)],
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(
        "wgfence_peer_packets",
        "Packets per peer, by verdict",
        None,
        MetricType::Counter,
    )?;
    let mut would_drop = Vec::new();
    for (slot, name) in names.iter() {
        if let Ok(c) = maps.peer_counters(*slot) {
            for (verdict, value) in [("pass", c.pass_packets), ("drop", c.drop_packets)] {
                let labels = [("peer", name.as_str()), ("verdict", verdict)];
                ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
            }
            would_drop.push((name.as_str(), c.audit_packets));
        }
    }
    // Audit mode: the packets each peer's policy denied and let pass (0 for an enforced
    // peer, whose denials are drops).
    counter_family(
        encoder,
        "wgfence_peer_would_drop_packets",
        "Packets per peer that its policy denies and audit mode let pass",
        would_drop
            .into_iter()
            .map(|(peer, n)| ([("peer", peer)], n)),
    )?;
    Ok(())
}

/// One counter family: a descriptor, then one value per label set.
fn counter_family<L: prometheus_client::encoding::EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    values: impl Iterator<Item = (L, u64)>,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, value) in values {
        ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// Connections the metrics listener serves at once. More are closed (reset) as soon as they
/// are accepted: never queued, never holding a descriptor. A scraper needs a handful.
pub const MAX_CONNECTIONS: usize = 64;
/// A connection closes when it has not sent a whole request head within this time: before
/// its first request (a client that connects and sends nothing, or sends it a byte at a
/// time) and between requests on a kept-alive connection (an idle scraper connection).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// No connection lives longer, whatever it does (a client that never reads its response).
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);
/// Largest request head read into memory, per connection (hyper's smallest allowed buffer is
/// 8 KiB; the endpoints' requests are a few hundred bytes).
const MAX_BUF: usize = 16 * 1024;
/// Pause after a failed accept (out of descriptors, say) before trying again, not to spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// What one listener serves, and how many clients at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoints {
    /// `/metrics`, `/healthz` and `/readyz` (`--metrics-addr`), at most [`MAX_CONNECTIONS`].
    All,
    /// `/healthz` and `/readyz` only (`--health-addr`), for the kubelet's probes: a listener
    /// of its own, so clients of the metrics port can never take its connections, at most
    /// [`PROBE_CONNECTIONS`], each closed sooner.
    Probes,
}

/// Connections the probe listener serves at once (the kubelet opens one per probe).
pub const PROBE_CONNECTIONS: usize = 8;
/// The probe listener's [`HEADER_TIMEOUT`] and [`CONNECTION_LIFETIME`]: a probe sends its
/// request at once and reads a few bytes.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

impl Endpoints {
    fn max_connections(self) -> usize {
        match self {
            Self::All => MAX_CONNECTIONS,
            Self::Probes => PROBE_CONNECTIONS,
        }
    }

    fn timeouts(self) -> (Duration, Duration) {
        match self {
            Self::All => (HEADER_TIMEOUT, CONNECTION_LIFETIME),
            Self::Probes => (PROBE_TIMEOUT, PROBE_TIMEOUT),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::All => "metrics",
            Self::Probes => "health",
        }
    }
}

/// Serves `endpoints` on a thread of its own, with its own runtime: nothing the HTTP side
/// does (many or slow clients, scrapes that read the pinned maps) can delay the reconcile
/// loop, nor (one thread per listener) the other listener. The thread runs until the process
/// ends.
pub fn spawn(
    listener: std::net::TcpListener,
    endpoints: Endpoints,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
) -> io::Result<()> {
    listener.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name(endpoints.name().to_owned())
        .spawn(move || {
            runtime.block_on(async move {
                match TcpListener::from_std(listener) {
                    Ok(listener) => serve(listener, endpoints, metrics, health).await,
                    Err(e) => tracing::error!(error = %e, listener = endpoints.name(), "listener"),
                }
            });
        })
        .map(drop)
}

/// Accepts connections forever, at most [`Endpoints::max_connections`] at once.
pub async fn serve(
    listener: TcpListener,
    endpoints: Endpoints,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
) {
    let name = endpoints.name();
    if let Ok(addr) = listener.local_addr() {
        match endpoints {
            Endpoints::All => tracing::info!(%addr, "serving /metrics, /healthz, /readyz"),
            Endpoints::Probes => tracing::info!(%addr, "serving /healthz, /readyz"),
        }
    }
    let max = endpoints.max_connections();
    let (header_timeout, lifetime) = endpoints.timeouts();
    let slots = Arc::new(Semaphore::new(max));
    // Connections refused since the limit was reached, for one log line per episode.
    let mut refused: Option<u64> = None;
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(conn) => conn,
            Err(e) => {
                tracing::warn!(error = %e, listener = name, "accepting a connection");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            // Reset at once: no TIME_WAIT, nothing kept for it.
            let _ = stream.set_zero_linger();
            drop(stream);
            if refused.is_none() {
                tracing::warn!(
                    max,
                    listener = name,
                    "connection limit reached; closing new connections until some end (is \
                     the port reachable from peers or pods? see docs/security.md)"
                );
            }
            *refused.get_or_insert(0) += 1;
            continue;
        };
        if let Some(n) = refused.take() {
            tracing::info!(
                refused = n,
                listener = name,
                "below the connection limit again"
            );
        }
        let metrics = Arc::clone(&metrics);
        let health = Arc::clone(&health);
        tokio::spawn(async move {
            let _slot = slot;
            let service = service_fn(move |req: Request<hyper::body::Incoming>| {
                let response = respond(&req, endpoints, &metrics, &health);
                async move { Ok::<_, Infallible>(response) }
            });
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .max_buf_size(MAX_BUF)
                .serve_connection(TokioIo::new(stream), service);
            match tokio::time::timeout(lifetime, connection).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(error = %e, listener = name, "connection"),
                Err(_) => tracing::debug!(listener = name, "connection closed at its lifetime"),
            }
        });
    }
}

fn respond<B>(
    req: &Request<B>,
    endpoints: Endpoints,
    metrics: &Metrics,
    health: &Health,
) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") if endpoints == Endpoints::All => (
            200,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.encode(),
        ),
        (&Method::GET, "/healthz") => (200, "text/plain", "ok\n".to_owned()),
        (&Method::GET, "/readyz") if health.is_ready() => (
            200,
            "text/plain",
            match health.applied() {
                applied if applied.is_empty() => "ready\n".to_owned(),
                applied => format!("ready: {applied}\n"),
            },
        ),
        (&Method::GET, "/readyz") => (
            503,
            "text/plain",
            format!("not ready: {}\n", health.reason()),
        ),
        _ => (404, "text/plain", "not found\n".to_owned()),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or_default();
    if let Ok(value) = hyper::header::HeaderValue::from_str(content_type) {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, value);
    }
    response
}
