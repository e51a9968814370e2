//! What the scenarios measure on: the agent's reconciler in the benchmark's own process, on a
//! wireguard-go device ([`Node`]) or on the maps alone ([`MapsOnly`], beyond wireguard-go's
//! 65,536 peers); a veth pair between two namespaces ([`Veth`]) with ping streams over it; the
//! memory of a process.

use std::{
    net::IpAddr,
    process::Stdio,
    thread,
    time::{Duration, Instant},
};

use serde_json::Value;

use wgfence::{
    dataplane::{AttachOptions, Dataplane},
    plan::{plan, plan_changes, Actual, Op},
    reconcile::{Outcome, Reconciler},
    source::StateFile,
    state::{Changes, DesiredState, Pipeline},
    sweeper::{Sweeper, FLOW_SWEEP},
    testing::apply_map_op,
    wg::WireGuard as WgDevice,
};

use crate::net::{unique, Netns, WireGuard};

/// wireguard-go's device.MaxPeers.
pub const WIREGUARD_GO_MAX_PEERS: usize = 1 << 16;

/// The maps alone, attached to a veth in a namespace of their own: the reconciler's planning
/// and map writes without a WireGuard device (for N beyond wireguard-go's limit). WireGuard
/// operations are applied to the model of the kernel only.
pub struct MapsOnly {
    pub dataplane: Dataplane,
    pub actual: Actual,
    /// The maps match the pipeline's previous state (as the reconciler's `tracking`).
    pub tracking: bool,
    pub ns: Netns,
    /// Deletes flows off the apply path, as the daemon's reconciler hands them to it.
    sweeper: Sweeper,
}

/// The flow sweeper the daemon runs beside its reconciler (daemon.rs), on map handles of its
/// own: a revocation's flows are forgotten off the apply path.
fn sweeper(interface: &str) -> Sweeper {
    let maps = Dataplane::open_maps(
        std::path::Path::new(wgfence::dataplane::DEFAULT_BPFFS),
        interface,
    )
    .unwrap_or_else(|e| panic!("{}", wgfence::error_chain(&e)));
    Sweeper::spawn(maps, FLOW_SWEEP, |_| {}).expect("starting the flow sweeper")
}

// Not `Default`: it builds a namespace and attaches the datapath.
#[allow(clippy::new_without_default)]
impl MapsOnly {
    pub fn new() -> Self {
        let ns = Netns::new("wgfb-maps-");
        let name = unique("wgm");
        ns.ip(&[
            "link", "add", &name, "type", "veth", "peer", "name", "peer0",
        ]);
        let options = AttachOptions::new(name.clone());
        let dataplane = ns
            .enter(|| Dataplane::attach(&options))
            .unwrap_or_else(|e| panic!("{}", wgfence::error_chain(&e)));
        Self {
            sweeper: sweeper(&name),
            dataplane,
            actual: Actual::default(),
            tracking: false,
            ns,
        }
    }

    /// What `Reconciler::reconcile_changes` does, but for the WireGuard device: once the maps
    /// match the previous state, only the pipeline's changed peers are planned.
    pub fn reconcile_changes(&mut self, desired: &DesiredState, changes: &Changes) -> Outcome {
        let start = Instant::now();
        let plan = if self.tracking {
            plan_changes(
                desired,
                wgfence::plan::Changes::of(changes, desired),
                &self.actual,
            )
        } else {
            plan(desired, &self.actual)
        }
        .unwrap();
        let plan_duration = start.elapsed();
        let writes = self.dataplane.maps().writes();
        for op in &plan.ops {
            match op {
                Op::ForgetFlows { addrs } => self.sweeper.forget(addrs.iter().copied().collect()),
                Op::ForgetAllFlows => self.sweeper.forget_all(),
                _ => apply_map_op(self.dataplane.maps_mut(), op)
                    .unwrap_or_else(|e| panic!("{}", wgfence::error_chain(&e))),
            }
            self.actual.apply(op);
        }
        self.tracking = true;
        Outcome {
            ops: plan.ops.len(),
            map_writes: self.dataplane.maps().writes() - writes,
            wg_peer_updates: 0,
            duration: start.elapsed(),
            plan_duration,
            wg_duration: Duration::ZERO,
        }
    }
}

impl Drop for MapsOnly {
    fn drop(&mut self) {
        let _ = self.dataplane.detach_now();
        let _ = self.ns.name();
    }
}

pub enum Target {
    Device(Box<Node>),
    Maps(Box<MapsOnly>),
}

/// One push, as the agent's daemon makes it (daemon.rs): the file's fingerprint, one pass in
/// pieces (an unchanged file stops there), the state pipeline on the open file, then the
/// planner with the pipeline's change set and the apply.
pub struct Pushed {
    /// Open, `Pipeline::fingerprint` and `Pipeline::update_from`: reading the file, the only
    /// O(N) work of a push.
    pub parse: Duration,
    /// Peers whose fields the pipeline read (`Pipeline::peers_read`).
    pub read: usize,
    /// Plan + apply.
    pub outcome: Outcome,
}

impl Target {
    pub fn push(&mut self, pipeline: &mut Pipeline, text: &str) -> Pushed {
        let max_peers = match self {
            Target::Device(node) => node.reconciler.wireguard().max_peers(),
            Target::Maps(_) => None,
        };
        // As the daemon reads it: from a file just written (in the page cache), opened, its
        // identity taken in one pass (to skip an unchanged file), then updated from.
        let path = std::env::temp_dir().join(format!("wgfence-bench-{}.json", std::process::id()));
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let t = Instant::now();
        let file = StateFile::new(&path, false, wgfence::input::DEFAULT_MAX_STATE_BYTES)
            .open()
            .expect("the state file just written");
        let fingerprint = pipeline.fingerprint(&file).expect("reading the state file");
        std::hint::black_box(fingerprint.id());
        let changes = pipeline
            .update_from(&file, fingerprint, max_peers)
            .expect("reading the state file")
            .unwrap();
        let parse = t.elapsed();
        drop(file);
        let _ = std::fs::remove_file(&path);
        let read = pipeline.peers_read();
        let outcome = match self {
            Target::Device(node) => node
                .reconciler
                .reconcile_changes(pipeline.state(), &changes)
                .unwrap_or_else(|e| panic!("{}", wgfence::error_chain(&e))),
            Target::Maps(maps) => maps.reconcile_changes(pipeline.state(), &changes),
        };
        drop(changes);
        Pushed {
            parse,
            read,
            outcome,
        }
    }

    pub fn interface(&self) -> String {
        match self {
            Target::Device(node) => node.interface(),
            Target::Maps(maps) => maps.dataplane.interface().to_owned(),
        }
    }

    pub fn with_wireguard(&self) -> bool {
        matches!(self, Target::Device(_))
    }
}

pub struct Node {
    pub reconciler: Reconciler,
    pub _wg: WireGuard,
    pub _ns: Netns,
}

// Not `Default`: it builds a namespace, a wireguard-go device and attaches the datapath.
#[allow(clippy::new_without_default)]
impl Node {
    pub fn new() -> Self {
        let ns = Netns::new("wgfb-node-");
        let wg = WireGuard::start(&ns, &unique("wgb"), 51820);
        let options = AttachOptions::new(wg.name.clone());
        let dataplane = ns
            .enter(|| Dataplane::attach(&options))
            .unwrap_or_else(|e| {
                // Maps pinned before the failure would outlive the run.
                let _ = Dataplane::detach(
                    std::path::Path::new(wgfence::dataplane::DEFAULT_BPFFS),
                    &wg.name,
                );
                panic!("{}", wgfence::error_chain(&e))
            });
        let device = WgDevice::open(&wg.name).unwrap();
        let reconciler = Reconciler::new(dataplane, device)
            .unwrap()
            .with_sweeper(sweeper(&wg.name));
        Self {
            reconciler,
            _wg: wg,
            _ns: ns,
        }
    }

    pub fn reconcile(&mut self, desired: DesiredState) -> Outcome {
        self.reconciler
            .reconcile(desired)
            .unwrap_or_else(|e| panic!("{}", wgfence::error_chain(&e)))
    }

    pub fn interface(&self) -> String {
        self.reconciler.dataplane().interface().to_owned()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.reconciler.dataplane_mut().detach_now();
    }
}

pub struct Veth {
    pub src: Netns,
    pub dst: Netns,
}

pub const DST_ADDR: &str = "198.19.0.2";

impl Veth {
    pub fn new(sources: &[IpAddr]) -> Self {
        let src = Netns::new("wgfb-src-");
        let dst = Netns::new("wgfb-dst-");
        src.ip(&[
            "link",
            "add",
            "vs",
            "type",
            "veth",
            "peer",
            "name",
            "vd",
            "netns",
            dst.name(),
        ]);
        src.ip(&["addr", "add", "198.19.0.1/24", "dev", "vs"]);
        for a in sources {
            src.ip(&["addr", "add", &format!("{a}/32"), "dev", "vs"]);
        }
        src.ip(&["link", "set", "vs", "up"]);
        dst.ip(&["addr", "add", &format!("{DST_ADDR}/24"), "dev", "vd"]);
        dst.ip(&["link", "set", "vd", "up"]);
        dst.ip(&["route", "add", "10.64.0.0/10", "dev", "vd"]);
        Self { src, dst }
    }

    /// Received packets per second of 64-byte UDP from `source`, over `secs` seconds.
    pub fn udp_pps(&self, source: IpAddr, secs: u64) -> f64 {
        let mut server = self
            .dst
            .command("iperf3")
            .args(["-s", "-1", "-p", "5201"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("iperf3");
        thread::sleep(Duration::from_millis(300));
        let out = self
            .src
            .command("iperf3")
            .args([
                "-c", DST_ADDR, "-p", "5201", "-u", "-l", "64", "-b", "0", "-J",
            ])
            .args(["-t", &secs.to_string(), "-B", &source.to_string()])
            .output()
            .expect("iperf3");
        let _ = server.kill();
        let _ = server.wait();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        let sum = &v["end"]["sum"];
        let sent = sum["packets"].as_f64().unwrap_or(0.0);
        let lost = sum["lost_packets"].as_f64().unwrap_or(0.0);
        let seconds = sum["seconds"].as_f64().unwrap_or(secs as f64);
        if sent == 0.0 {
            eprintln!(
                "iperf3 from {source} produced no result: {}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
        (sent - lost).max(0.0) / seconds.max(1e-9)
    }
}

/// `ping -i` from `sources` to the destination, in the background: (transmitted, received).
pub fn ping_streams(
    ns: &Netns,
    sources: &[IpAddr],
    interval: &str,
    secs: u64,
) -> Vec<std::process::Child> {
    sources
        .iter()
        .map(|s| {
            // A count, not a deadline: `-w` would count the echo in flight at the deadline as
            // lost.
            let count = (secs as f64 / interval.parse::<f64>().unwrap_or(1.0)) as u64;
            ns.command("ping")
                .args(["-q", "-i", interval, "-W", "1", "-c", &count.to_string()])
                .args(["-I", &s.to_string(), DST_ADDR])
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .expect("ping")
        })
        .collect()
}

pub fn ping_totals(children: Vec<std::process::Child>) -> (u64, u64) {
    let mut totals = (0, 0);
    for child in children {
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        if std::env::var_os("WGFENCE_BENCH_DEBUG").is_some() {
            eprintln!("{text}");
        }
        if let Some(line) = text.lines().find(|l| l.contains("packets transmitted")) {
            let nums: Vec<u64> = line
                .split(|c: char| !c.is_ascii_digit())
                .filter_map(|x| x.parse().ok())
                .collect();
            totals.0 += nums.first().copied().unwrap_or(0);
            totals.1 += nums.get(1).copied().unwrap_or(0);
        }
    }
    totals
}

pub fn rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS:")
}

/// A `/proc/PID/status` figure in KiB (`VmRSS:`, `VmHWM:` the peak since the last reset).
pub fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}
