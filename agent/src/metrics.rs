//! Prometheus metrics (OpenMetrics text at `/metrics`), `/healthz` and `/readyz`.
//!
//! The agent's own counters are kept in a `prometheus-client` registry; the datapath's packet
//! counters are read from the pinned maps on each scrape, so they count what the kernel counted
//! across agent restarts. Per-peer series only with `--peer-metrics`: at 100k peers they would
//! swamp a Prometheus server (`wgfence status` always has them).

use std::{
    convert::Infallible,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, RwLock,
    },
};

use http_body_util::Full;
use hyper::{body::Bytes, server::conn::http1, service::service_fn, Method, Request, Response};
use hyper_util::rt::TokioIo;
use prometheus_client::{
    collector::Collector,
    encoding::{text::encode, DescriptorEncoder, EncodeMetric},
    metrics::{
        counter::{ConstCounter, Counter},
        gauge::Gauge,
        histogram::{exponential_buckets, Histogram},
        MetricType,
    },
    registry::Registry,
};
use tokio::net::TcpListener;
use wgfence_common::Counter as DatapathCounter;

use crate::dataplane::Dataplane;

/// Whether the agent enforces the current state file, and if not, why.
#[derive(Debug, Default)]
pub struct Health {
    ready: AtomicBool,
    reason: Mutex<String>,
}

impl Health {
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Release);
        if let Ok(mut reason) = self.reason.lock() {
            reason.clear();
        }
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

/// The agent's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub peers: Gauge,
    pub policies: Gauge,
    pub ready: Gauge,
    pub state_rejected: Counter,
    pub bpf_map_writes: Counter,
    pub wireguard_peer_updates: Counter,
    pub reconcile_errors: Counter,
    pub reply_flows_freed: Counter,
    pub reconcile_duration: Histogram,
    pub slot_names: SlotNames,
}

impl Metrics {
    /// `peer_metrics`: also export per-peer series.
    pub fn new(bpffs: PathBuf, interface: String, peer_metrics: bool) -> Self {
        let mut registry = Registry::default();
        let peers = Gauge::default();
        let policies = Gauge::default();
        let ready = Gauge::default();
        let state_rejected = Counter::default();
        let bpf_map_writes = Counter::default();
        let wireguard_peer_updates = Counter::default();
        let reconcile_errors = Counter::default();
        let reply_flows_freed = Counter::default();
        // 100 µs .. ~1.6 s
        let reconcile_duration = Histogram::new(exponential_buckets(0.0001, 2.0, 15));
        registry.register("wgfence_peers", "Peers in the applied state", peers.clone());
        registry.register(
            "wgfence_policies",
            "Distinct policies (rule sets) in the applied state",
            policies.clone(),
        );
        registry.register(
            "wgfence_ready",
            "1 when the current state file is valid and applied",
            ready.clone(),
        );
        registry.register(
            "wgfence_state_rejected",
            "State files rejected by validation (the last good state stays applied)",
            state_rejected.clone(),
        );
        registry.register(
            "wgfence_bpf_map_writes",
            "BPF map updates and deletes issued by the agent",
            bpf_map_writes.clone(),
        );
        registry.register(
            "wgfence_wireguard_peer_updates",
            "Per-peer WireGuard changes (create, update, remove) applied",
            wireguard_peer_updates.clone(),
        );
        registry.register(
            "wgfence_reconcile_errors",
            "Reconciles that failed in the kernel (retried)",
            reconcile_errors.clone(),
        );
        registry.register(
            "wgfence_reply_flows_freed",
            "Reply flows the agent deleted: expired, or their address got a new holder",
            reply_flows_freed.clone(),
        );
        registry.register(
            "wgfence_reconcile_duration_seconds",
            "Time to plan and apply one state",
            reconcile_duration.clone(),
        );
        let slot_names: SlotNames = Arc::default();
        registry.register_collector(Box::new(DatapathCollector {
            bpffs,
            interface,
            slot_names: peer_metrics.then(|| Arc::clone(&slot_names)),
        }));
        Self {
            registry,
            peers,
            policies,
            ready,
            state_rejected,
            bpf_map_writes,
            wireguard_peer_updates,
            reconcile_errors,
            reply_flows_freed,
            reconcile_duration,
            slot_names,
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

/// Reads the datapath's counters from the pinned maps at scrape time.
#[derive(Debug)]
struct DatapathCollector {
    bpffs: PathBuf,
    interface: String,
    slot_names: Option<SlotNames>,
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
        let verdicts = [("pass", counters.passed()), ("drop", counters.dropped())];
        counter_family(
            &mut encoder,
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
            &mut encoder,
            "wgfence_dropped_packets",
            "Packets from peers dropped, by reason",
            by_reason(false),
        )?;
        counter_family(
            &mut encoder,
            "wgfence_passed_packets",
            "Packets from peers passed, by reason",
            by_reason(true),
        )?;
        counter_family(
            &mut encoder,
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
            &mut encoder,
            "wgfence_reply_flows_recorded",
            "Flows the network started toward restricted peers, recorded so replies pass",
            std::iter::once((
                Vec::<(&str, &str)>::new(),
                counters.get(DatapathCounter::FlowRecorded),
            )),
        )?;
        counter_family(
            &mut encoder,
            "wgfence_reply_flows_refused",
            "Flows toward restricted peers not recorded: the peer's quota (--flows-per-peer) or the flow table was full",
            std::iter::once((
                Vec::<(&str, &str)>::new(),
                counters.get(DatapathCounter::FlowRefused),
            )),
        )?;

        let Some(names) = &self.slot_names else {
            return Ok(());
        };
        let Ok(names) = names.read() else {
            return Ok(());
        };
        let mut family = encoder.encode_descriptor(
            "wgfence_peer_packets",
            "Packets per peer, by verdict",
            None,
            MetricType::Counter,
        )?;
        for (slot, name) in names.iter() {
            if let Ok(c) = maps.peer_counters(*slot) {
                for (verdict, value) in [("pass", c.pass_packets), ("drop", c.drop_packets)] {
                    let labels = [("peer", name.as_str()), ("verdict", verdict)];
                    ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        Ok(())
    }
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

/// Serves `/metrics`, `/healthz` and `/readyz` until the task is dropped.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, health: Arc<Health>) {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving /metrics, /healthz, /readyz");
    }
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(conn) => conn,
            Err(e) => {
                tracing::warn!(error = %e, "accepting a metrics connection");
                continue;
            }
        };
        let metrics = Arc::clone(&metrics);
        let health = Arc::clone(&health);
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<hyper::body::Incoming>| {
                let response = respond(&req, &metrics, &health);
                async move { Ok::<_, Infallible>(response) }
            });
            if let Err(e) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(error = %e, "metrics connection");
            }
        });
    }
}

fn respond<B>(req: &Request<B>, metrics: &Metrics, health: &Health) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") => (
            200,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.encode(),
        ),
        (&Method::GET, "/healthz") => (200, "text/plain", "ok\n".to_owned()),
        (&Method::GET, "/readyz") if health.is_ready() => (200, "text/plain", "ready\n".to_owned()),
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
