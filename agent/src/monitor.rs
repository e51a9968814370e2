//! `wgfence monitor`: the datapath's drop events, read from the pinned ring buffer while the
//! agent runs, with peer names resolved.
//!
//! The datapath rate-limits events in the kernel (`--drop-events-per-second` of `run`), so a
//! flood of dropped packets costs the datapath at most that many ring buffer writes, whether
//! anyone reads or not. A BPF ring buffer has one read position: two monitors on one interface
//! share the events between them. A monitor starts with the events after it opened the ring:
//! what piled up while nobody read is skipped.

use std::{
    collections::BTreeMap,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
    time::{Duration, Instant, SystemTime},
};

use aya::maps::{Map, MapData, MapError, RingBuf};
use serde::Serialize;
use wgfence_common::{
    map_names, Counter, DropEvent, EVENT_PORTS, NO_SLOT, PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP,
    PROTO_UDP,
};

use crate::{
    dataplane::{pin_dir, Dataplane, Maps},
    status::{report::peer_names, AgentStatus},
};

#[derive(Debug, thiserror::Error)]
pub enum MonitorError {
    #[error(
        "no drop event ring buffer is pinned at {path}: is the agent (this version) running on \
         the interface? is --bpffs right?"
    )]
    NotAttached { path: PathBuf },
    #[error("ring buffer {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: MapError,
    },
    #[error("waiting for drop events")]
    Poll(#[source] io::Error),
    #[error(
        "no peer named {0:?} in the state file (pass --state if the agent is not running here)"
    )]
    UnknownPeer(String),
}

/// The pinned drop event ring buffer of one interface.
pub struct Monitor {
    ring: RingBuf<MapData>,
}

impl Monitor {
    pub fn open(bpffs: &Path, interface: &str) -> Result<Self, MonitorError> {
        let path = pin_dir(bpffs, interface).join(map_names::EVENTS);
        if !path.exists() {
            return Err(MonitorError::NotAttached { path });
        }
        let open_err = |source| MonitorError::Open {
            path: path.clone(),
            source,
        };
        let data = MapData::from_pin(&path).map_err(open_err)?;
        let mut ring = RingBuf::try_from(Map::RingBuf(data)).map_err(open_err)?;
        // Events from before the monitor started (nobody was reading) are not news.
        while ring.next().is_some() {}
        Ok(Self { ring })
    }

    /// Waits up to `timeout` for events and appends every event available to `out`.
    pub fn wait(
        &mut self,
        timeout: Duration,
        out: &mut Vec<DropEvent>,
    ) -> Result<(), MonitorError> {
        self.drain(out);
        if !out.is_empty() {
            return Ok(());
        }
        let mut pollfd = libc::pollfd {
            fd: self.ring.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let millis = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd for the duration of the call.
        if unsafe { libc::poll(&mut pollfd, 1, millis) } < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(MonitorError::Poll(e));
            }
        }
        self.drain(out);
        Ok(())
    }

    fn drain(&mut self, out: &mut Vec<DropEvent>) {
        while let Some(item) = self.ring.next() {
            // Records are written whole by the datapath; a shorter one is not an event.
            if let Some(bytes) = item.get(..std::mem::size_of::<DropEvent>()) {
                out.push(bytemuck::pod_read_unaligned(bytes));
            }
        }
    }
}

/// How often a [`Watch`] reads the state file again for peer names.
pub const NAMES_REFRESH: Duration = Duration::from_secs(2);

/// The drop events of an interface as `wgfence monitor` shows them: peers named by the state
/// file (read again every [`NAMES_REFRESH`]), audit events with the policy id of their peer's
/// entry, those of one peer only if asked.
pub struct Watch {
    monitor: Monitor,
    /// The pinned maps, for an audit event's policy id (none: not named).
    maps: Option<Maps>,
    interface: String,
    state: Option<PathBuf>,
    /// The largest state file read for names (`--max-state-bytes`).
    max_state_bytes: u64,
    names: BTreeMap<IpAddr, String>,
    names_at: Instant,
    peer: Option<String>,
    events: Vec<DropEvent>,
}

impl Watch {
    /// Opens the ring buffer of `interface`. `state` (else the running agent's state file,
    /// either read only up to `max_state_bytes`) names the peers; `peer`: only this peer's
    /// events, which must be in it.
    pub fn open(
        bpffs: &Path,
        interface: &str,
        state: Option<&Path>,
        max_state_bytes: u64,
        peer: Option<&str>,
    ) -> Result<Self, MonitorError> {
        let monitor = Monitor::open(bpffs, interface)?;
        let mut watch = Self {
            monitor,
            maps: Dataplane::open_maps(bpffs, interface).ok(),
            interface: interface.to_owned(),
            state: state.map(Path::to_path_buf),
            max_state_bytes,
            names: BTreeMap::new(),
            names_at: Instant::now(),
            peer: peer.map(str::to_owned),
            events: Vec::new(),
        };
        watch.load_names();
        if let Some(peer) = peer {
            if !watch.names.values().any(|n| n == peer) {
                return Err(MonitorError::UnknownPeer(peer.to_owned()));
            }
        }
        Ok(watch)
    }

    fn load_names(&mut self) {
        let agent = AgentStatus::read(&self.interface).ok();
        self.names = peer_names(self.state.as_deref(), agent.as_ref(), self.max_state_bytes);
        self.names_at = Instant::now();
    }

    /// Waits up to `timeout` for events; the views of those asked for, in order.
    pub fn next(&mut self, timeout: Duration) -> Result<Vec<EventView>, MonitorError> {
        self.events.clear();
        self.monitor.wait(timeout, &mut self.events)?;
        if self.names_at.elapsed() >= NAMES_REFRESH {
            self.load_names();
        }
        let clock = Clock::now();
        let mut views = Vec::with_capacity(self.events.len());
        for event in &self.events {
            let mut view = EventView::new(event, &self.names, &clock);
            if view.kind == "audit" {
                let policy = self
                    .maps
                    .as_ref()
                    .zip(view.src)
                    .and_then(|(maps, src)| maps.peer(src).ok().flatten())
                    .map(|e| e.policy);
                view = view.with_policy(policy);
            }
            if self.peer.is_none() || view.peer == self.peer {
                views.push(view);
            }
        }
        Ok(views)
    }
}

/// A drop event as `wgfence monitor` prints it (`--json`: one object per line).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EventView {
    /// RFC 3339, from the kernel's monotonic timestamp.
    pub time: String,
    /// The drop reason, as in the `reason` label of `wgfence_dropped_packets_total`.
    pub reason: &'static str,
    /// The source peer's name, when the state file names its address.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
    /// The source peer's counter slot; absent for unknown sources.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slot: Option<u32>,
    pub protocol: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub src: Option<IpAddr>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dst: Option<IpAddr>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub src_port: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dst_port: Option<u16>,
    pub len: u32,
    /// `"drop"`, or `"audit"`: an audited peer's packet its policy denies, which passed (a
    /// would-drop).
    pub kind: &'static str,
    /// An audit event's policy: the policy id the peer's entry points at (`wgfence status`
    /// lists it per peer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<u32>,
}

/// Converts the kernel's CLOCK_MONOTONIC timestamps to wall-clock time.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    wall: SystemTime,
    monotonic_ns: u64,
}

impl Clock {
    pub fn now() -> Self {
        // SAFETY: clock_gettime writes into the zeroed timespec.
        let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        let monotonic_ns = u64::try_from(ts.tv_sec)
            .unwrap_or(0)
            .saturating_mul(1_000_000_000)
            .saturating_add(u64::try_from(ts.tv_nsec).unwrap_or(0));
        Self {
            wall: SystemTime::now(),
            monotonic_ns,
        }
    }

    /// CLOCK_MONOTONIC at [`Clock::now`], in the kernel's `bpf_ktime_get_ns` time.
    pub fn monotonic_ns(&self) -> u64 {
        self.monotonic_ns
    }

    pub fn wall(&self, monotonic_ns: u64) -> SystemTime {
        let ago = Duration::from_nanos(self.monotonic_ns.saturating_sub(monotonic_ns));
        self.wall.checked_sub(ago).unwrap_or(self.wall)
    }
}

fn protocol_name(family: u8, protocol: u8) -> String {
    match protocol {
        PROTO_TCP => "tcp".into(),
        PROTO_UDP => "udp".into(),
        PROTO_ICMP if family == 4 => "icmp".into(),
        PROTO_ICMPV6 if family == 6 => "icmpv6".into(),
        other => format!("ip-proto-{other}"),
    }
}

impl EventView {
    pub fn new(event: &DropEvent, names: &BTreeMap<IpAddr, String>, clock: &Clock) -> Self {
        let (src, dst) = match event.family {
            4 => {
                let v4 = |a: &[u8; 16]| IpAddr::V4(Ipv4Addr::new(a[0], a[1], a[2], a[3]));
                (Some(v4(&event.src)), Some(v4(&event.dst)))
            }
            6 => (
                Some(IpAddr::V6(Ipv6Addr::from(event.src))),
                Some(IpAddr::V6(Ipv6Addr::from(event.dst))),
            ),
            _ => (None, None),
        };
        let ports = event.flags & EVENT_PORTS != 0;
        let slot = (event.slot != NO_SLOT).then_some(event.slot);
        let time = humantime::format_rfc3339_millis(clock.wall(event.timestamp_ns)).to_string();
        Self {
            time,
            reason: Counter::from_index(event.reason).map_or("unknown", Counter::name),
            // Only a known peer is named: an unknown source's address names nobody.
            peer: slot.and(src).and_then(|a| names.get(&a).cloned()),
            slot,
            protocol: if event.family == 0 {
                "not-ip".into()
            } else {
                protocol_name(event.family, event.protocol)
            },
            src,
            dst,
            src_port: ports.then_some(event.src_port),
            dst_port: ports.then_some(event.dst_port),
            len: event.len,
            kind: if event.reason == Counter::PassAudit as u32 {
                "audit"
            } else {
                "drop"
            },
            policy: None,
        }
    }

    /// The same, naming the policy (its id) an audit event's peer is audited against.
    pub fn with_policy(mut self, policy: Option<u32>) -> Self {
        self.policy = policy;
        self
    }

    /// One line, like `cilium monitor --type drop`.
    pub fn line(&self) -> String {
        let endpoint = |addr: Option<IpAddr>, port: Option<u16>| match (addr, port) {
            (Some(IpAddr::V6(a)), Some(p)) => format!("[{a}]:{p}"),
            (Some(a), Some(p)) => format!("{a}:{p}"),
            (Some(a), None) => a.to_string(),
            (None, _) => "?".into(),
        };
        let peer = match (&self.peer, self.slot) {
            (Some(name), _) => name.clone(),
            (None, Some(slot)) => format!("slot {slot}"),
            (None, None) => "not a peer".into(),
        };
        if self.kind == "audit" {
            let policy = self.policy.map_or(String::new(), |p| {
                format!(" (would drop: denied by policy {p})")
            });
            return format!(
                "{} AUDIT from {} {} {} -> {} len {}{}",
                self.time,
                peer,
                self.protocol,
                endpoint(self.src, self.src_port),
                endpoint(self.dst, self.dst_port),
                self.len,
                policy
            );
        }
        format!(
            "{} drop ({}) from {} {} {} -> {} len {}",
            self.time,
            self.reason,
            peer,
            self.protocol,
            endpoint(self.src, self.src_port),
            endpoint(self.dst, self.dst_port),
            self.len
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(family: u8, protocol: u8) -> DropEvent {
        let mut e = DropEvent {
            timestamp_ns: 1_000,
            reason: Counter::DropPolicy as u32,
            slot: 3,
            len: 60,
            family,
            protocol,
            src_port: 40000,
            dst_port: 22,
            flags: EVENT_PORTS,
            ..DropEvent::default()
        };
        if family == 4 {
            e.src[..4].copy_from_slice(&[10, 8, 0, 2]);
            e.dst[..4].copy_from_slice(&[10, 0, 0, 5]);
        } else {
            e.src = "fd00:8::2".parse::<Ipv6Addr>().map(|a| a.octets()).unwrap();
            e.dst = "fd00::5".parse::<Ipv6Addr>().map(|a| a.octets()).unwrap();
        }
        e
    }

    #[test]
    fn events_name_the_peer_reason_and_endpoints() {
        let names = BTreeMap::from([(IpAddr::from([10, 8, 0, 2]), "alice".to_owned())]);
        let clock = Clock::now();
        let v = EventView::new(&event(4, PROTO_TCP), &names, &clock);
        assert_eq!(v.reason, "policy_denied");
        assert_eq!(v.peer.as_deref(), Some("alice"));
        assert!(
            v.line().contains(
                "drop (policy_denied) from alice tcp 10.8.0.2:40000 -> 10.0.0.5:22 len 60"
            ),
            "{}",
            v.line()
        );

        let mut icmp = event(6, PROTO_ICMPV6);
        icmp.flags = 0;
        let v = EventView::new(&icmp, &names, &clock);
        assert_eq!((v.src_port, v.dst_port), (None, None));
        assert!(
            v.line().contains("from slot 3 icmpv6 fd00:8::2 -> fd00::5"),
            "{}",
            v.line()
        );

        let mut unknown = event(4, PROTO_UDP);
        unknown.slot = NO_SLOT;
        unknown.reason = Counter::DropUnknownSource as u32;
        let v = EventView::new(&unknown, &names, &clock);
        assert_eq!(v.slot, None);
        assert_eq!(v.peer, None, "an unknown source is nobody's");
        assert!(
            v.line()
                .contains("drop (unknown_source) from not a peer udp"),
            "{}",
            v.line()
        );
        let json = serde_json::to_value(&v).unwrap();
        assert_eq!(json["reason"], "unknown_source");
        assert_eq!(json["dstPort"], 22);
    }
}
