//! The `wgfence run` binary as a test drives it: started in the gateway's node namespace
//! (network namespace only, as a hostNetwork pod), fed through its state file, observed through
//! its metrics endpoint.

use std::{
    fs,
    io::{Read as _, Write as _},
    net::TcpStream,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant, SystemTime},
};

use crate::{
    container::{self, Podman},
    net::{unique, Netns},
    topology::Gateway,
};

/// Where the agent serves `/metrics`, `/healthz` and `/readyz` (in the gateway's node namespace).
pub const METRICS: &str = "127.0.0.1:9586";

/// `BIN run --interface IF --no-metrics --state STATE` in the gateway's node namespace: an
/// agent run the tests expect to be refused (a second agent, a rollback, a failpoint).
pub fn run_command(bin: &Path, gw: &Gateway, state: &Path) -> Command {
    let mut command = gw.node.command(bin);
    command
        .args([
            "run",
            "--interface",
            gw.interface(),
            "--no-metrics",
            "--state",
        ])
        .arg(state);
    command
}

/// The agent binary: `WGFENCE_BIN`, else `wgfence` in the target directory of the running
/// executable (`target/<profile>/` for a binary, `target/<profile>/deps/` for a test); `cargo
/// xtask test` and `cargo xtask demo` build it first.
pub fn binary() -> PathBuf {
    if let Some(bin) = std::env::var_os("WGFENCE_BIN") {
        return bin.into();
    }
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().unwrap_or_else(|| Path::new("."));
    let candidates = [dir.join("wgfence"), dir.join("..").join("wgfence")];
    candidates
        .iter()
        .find(|bin| bin.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "no wgfence binary next to {}: build it with `cargo build -p wgfence` \
                 (cargo xtask test does) or set WGFENCE_BIN",
                exe.display()
            )
        })
}

/// `GET path` from namespace `ns` to `addr`: (status, body); `None` if no answer came (not
/// connected within 5 s, closed or reset, nothing within 5 s).
pub fn http_get(ns: &Netns, addr: &str, path: &str) -> Option<(u16, String)> {
    let addr: std::net::SocketAddr = addr.parse().unwrap_or_else(|e| panic!("{addr}: {e}"));
    ns.enter(|| {
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).ok()?;
        let status = response.split_whitespace().nth(1)?.parse().ok()?;
        let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
        Some((status, body))
    })
}

/// How the state file is laid out and updated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// A plain file, replaced by writing a temporary file and renaming it.
    Plain,
    /// A Kubernetes Secret/ConfigMap volume: `state.json -> ..data/state.json`, `..data` a
    /// symlink to a timestamped directory that is swapped atomically on update.
    Kubernetes,
    /// A plain file, overwritten in place (as `echo > file` or an editor without rename does).
    InPlace,
    /// `state.json` a symlink into another directory (`elsewhere/state.json`, absolute), whose
    /// target is replaced by writing a temporary file there and renaming it.
    LinkElsewhere,
    /// `--state current/state.json` where `current` is a symlink to a release directory,
    /// swapped to a new one on update; old releases stay (as a deploy tool keeps them).
    ParentLink,
}

/// The layout-2 agent (commit b4200bd): `WGFENCE_V2_BIN`, else where `cargo xtask v2-agent`
/// (and `cargo xtask test`) builds it.
pub fn v2_binary() -> PathBuf {
    old_binary(2, "b4200bd")
}

/// The layout-3 agent (commit f530f25), which the upgrade tests start from:
/// `WGFENCE_V3_BIN`, else where `cargo xtask v3-agent` (and `cargo xtask test`) builds it.
pub fn v3_binary() -> PathBuf {
    old_binary(3, "f530f25")
}

fn old_binary(layout: u32, commit: &str) -> PathBuf {
    if let Some(bin) = std::env::var_os(format!("WGFENCE_V{layout}_BIN")) {
        return bin.into();
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let bin = root.join(format!(
        "target/v{layout}-agent/{commit}/src/target/debug/wgfence"
    ));
    assert!(
        bin.is_file(),
        "no layout-{layout} agent at {}: build it with `cargo xtask v{layout}-agent` (cargo \
         xtask test does) or set WGFENCE_V{layout}_BIN",
        bin.display()
    );
    bin
}

pub struct Agent {
    child: Option<Child>,
    /// The binary `start` and `restart` run.
    pub binary: PathBuf,
    pub dir: PathBuf,
    pub state: PathBuf,
    pub log: PathBuf,
    pub interface: String,
    node: String,
    /// `--metrics-addr`.
    metrics: String,
    layout: Layout,
    generation: AtomicU32,
    /// A command the agent is started through (its arguments follow), if any.
    wrapper: Vec<String>,
    /// The container the agent runs in, if it runs from its image.
    pub container: Option<Podman>,
    /// The source's arguments in place of `--state STATE` (`--source kubernetes ...`).
    source_args: Vec<String>,
}

impl Agent {
    /// Writes the state and starts `wgfence run` on the gateway's interface.
    pub fn start(gw: &Gateway, layout: Layout, state: &str, extra: &[&str]) -> Self {
        Self::start_with(binary(), gw, layout, state, extra, METRICS, &[])
    }

    /// [`Agent::start`] with another `wgfence` binary (e.g. [`v3_binary`]).
    pub fn start_binary(
        bin: PathBuf,
        gw: &Gateway,
        layout: Layout,
        state: &str,
        extra: &[&str],
    ) -> Self {
        Self::start_with(bin, gw, layout, state, extra, METRICS, &[])
    }

    /// As [`Agent::start`], serving its HTTP endpoint on `metrics` (an address of the node
    /// namespace) instead of [`METRICS`].
    pub fn start_with_metrics(
        gw: &Gateway,
        layout: Layout,
        state: &str,
        extra: &[&str],
        metrics: &str,
    ) -> Self {
        Self::start_with(binary(), gw, layout, state, extra, metrics, &[])
    }

    /// [`Agent::start`] through `wrapper` (e.g. `unshare ...`): the agent binary and its
    /// arguments are appended to it.
    pub fn start_wrapped(
        gw: &Gateway,
        layout: Layout,
        state: &str,
        extra: &[&str],
        wrapper: &[&str],
    ) -> Self {
        Self::start_with(binary(), gw, layout, state, extra, METRICS, wrapper)
    }

    /// [`Agent::start`] from the container `image`, run by podman as the DaemonSet runs it
    /// ([`crate::container`]): the state directory (Kubernetes layout) is its volume.
    pub fn start_container(gw: &Gateway, image: &str, state: &str, extra: &[&str]) -> Self {
        let mut agent = Self::prepare(PathBuf::from(image), gw, Layout::Kubernetes, METRICS, &[]);
        agent.container = Some(Podman::new(image));
        agent.write_state(state);
        agent.spawn(gw, extra);
        agent
    }

    /// `wgfence run --source kubernetes --secret SECRET --kubeconfig KUBECONFIG` on the
    /// gateway's interface (the API server in the node namespace: [`crate::kube`]).
    pub fn start_kubernetes(gw: &Gateway, kubeconfig: &Path, secret: &str, extra: &[&str]) -> Self {
        let mut agent = Self::prepare(binary(), gw, Layout::Plain, METRICS, &[]);
        agent.source_args = vec![
            "--source".into(),
            "kubernetes".into(),
            "--secret".into(),
            secret.into(),
            "--kubeconfig".into(),
            kubeconfig.to_string_lossy().into_owned(),
        ];
        agent.spawn(gw, extra);
        agent
    }

    fn start_with(
        bin: PathBuf,
        gw: &Gateway,
        layout: Layout,
        state: &str,
        extra: &[&str],
        metrics: &str,
        wrapper: &[&str],
    ) -> Self {
        let mut agent = Self::prepare(bin, gw, layout, metrics, wrapper);
        agent.write_state(state);
        agent.spawn(gw, extra);
        agent
    }

    /// The agent's directory and state path (with the layout's links), not yet started.
    fn prepare(
        bin: PathBuf,
        gw: &Gateway,
        layout: Layout,
        metrics: &str,
        wrapper: &[&str],
    ) -> Self {
        let dir = std::env::temp_dir().join(unique("wgfence-agent-"));
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let state_path = match layout {
            Layout::ParentLink => dir.join("current").join("state.json"),
            _ => dir.join("state.json"),
        };
        let agent = Self {
            child: None,
            binary: bin,
            state: state_path,
            log: dir.join("agent.log"),
            dir,
            interface: gw.interface().to_owned(),
            node: gw.node.name().to_owned(),
            metrics: metrics.to_owned(),
            layout,
            generation: AtomicU32::new(0),
            wrapper: wrapper.iter().map(|s| (*s).to_owned()).collect(),
            container: None,
            source_args: Vec::new(),
        };
        match layout {
            Layout::Kubernetes => symlink("..data/state.json", &agent.state).expect("symlink"),
            Layout::LinkElsewhere => {
                let elsewhere = agent.dir.join("elsewhere");
                fs::create_dir(&elsewhere).unwrap();
                symlink(elsewhere.join("state.json"), &agent.state).expect("symlink");
            }
            Layout::Plain | Layout::InPlace | Layout::ParentLink => {}
        }
        agent
    }

    fn spawn(&mut self, gw: &Gateway, extra: &[&str]) {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap_or_else(|e| panic!("{}: {e}", self.log.display()));
        let log2 = log.try_clone().unwrap();
        let mut state = self.state.to_string_lossy().into_owned();
        let mut command = match (&self.container, self.wrapper.split_first()) {
            (Some(podman), _) => {
                state = container::STATE_FILE.to_owned();
                podman.run_command(&gw.node, &gw.bpffs, &self.dir)
            }
            (None, Some((program, args))) => {
                let mut command = gw.node.command(program);
                command.args(args).arg(&self.binary);
                command
            }
            (None, None) => gw.node.command(&self.binary),
        };
        command
            .args([
                "--log",
                "wgfence=debug",
                "run",
                "--interface",
                &self.interface,
            ])
            .args(if self.source_args.is_empty() {
                vec!["--state".to_owned(), state]
            } else {
                self.source_args.clone()
            })
            .args(["--metrics-addr", &self.metrics])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        let child = crate::spawn(&mut command).expect("starting wgfence");
        self.child = Some(child);
    }

    /// Starts the agent again (after `kill` or `stop`) with the same state file.
    pub fn restart(&mut self, gw: &Gateway, extra: &[&str]) {
        assert!(self.child.is_none(), "the agent still runs");
        self.spawn(gw, extra);
    }

    /// Moves the state, while the agent is stopped, to another path: `linked/state.json`, a
    /// symlink into another directory (`elsewhere/state.json`, absolute), laid out and updated
    /// from now on as [`Layout::LinkElsewhere`]. The next [`Agent::restart`] runs on it.
    pub fn relink_elsewhere(&mut self) {
        assert!(self.child.is_none(), "the agent still runs");
        let elsewhere = self.dir.join("elsewhere");
        fs::create_dir_all(&elsewhere).unwrap_or_else(|e| panic!("{}: {e}", elsewhere.display()));
        let linked = self.dir.join("linked");
        fs::create_dir_all(&linked).unwrap_or_else(|e| panic!("{}: {e}", linked.display()));
        let state = linked.join("state.json");
        let _ = fs::remove_file(&state);
        symlink(elsewhere.join("state.json"), &state).expect("symlink");
        self.state = state;
        self.layout = Layout::LinkElsewhere;
    }

    /// Replaces the state file the way its layout is updated in production. Returns when the
    /// new state became visible at the path: just before the rename that publishes it (or,
    /// written in place, when the write began), so a latency is the agent's, not the writer's.
    pub fn write_state(&self, state: &str) -> SystemTime {
        let n = self.generation.fetch_add(1, Ordering::Relaxed);
        match self.layout {
            Layout::Plain => {
                let tmp = self.dir.join(format!(".state.json.{n}"));
                fs::write(&tmp, state).unwrap();
                let at = SystemTime::now();
                fs::rename(&tmp, &self.state).unwrap();
                at
            }
            Layout::InPlace => {
                let at = SystemTime::now();
                fs::write(&self.state, state).unwrap();
                at
            }
            Layout::LinkElsewhere => {
                let elsewhere = self.dir.join("elsewhere");
                let tmp = elsewhere.join(format!(".state.json.{n}"));
                fs::write(&tmp, state).unwrap();
                let at = SystemTime::now();
                fs::rename(&tmp, elsewhere.join("state.json")).unwrap();
                at
            }
            Layout::ParentLink => {
                let release = format!("release.{n}");
                fs::create_dir(self.dir.join(&release)).unwrap();
                fs::write(self.dir.join(&release).join("state.json"), state).unwrap();
                let tmp = self.dir.join("current.tmp");
                symlink(&release, &tmp).unwrap();
                let at = SystemTime::now();
                fs::rename(&tmp, self.dir.join("current")).unwrap();
                at
            }
            Layout::Kubernetes => {
                // What kubelet's AtomicWriter does.
                let data = format!("..2026_11_30_00_00_00.{n}");
                let data_dir = self.dir.join(&data);
                fs::create_dir(&data_dir).unwrap();
                fs::write(data_dir.join("state.json"), state).unwrap();
                let tmp = self.dir.join("..data_tmp");
                let _ = fs::remove_file(&tmp);
                symlink(&data, &tmp).unwrap();
                let old = fs::read_link(self.dir.join("..data")).ok();
                let at = SystemTime::now();
                fs::rename(&tmp, self.dir.join("..data")).unwrap();
                if let Some(old) = old {
                    let _ = fs::remove_dir_all(self.dir.join(old));
                }
                at
            }
        }
    }

    /// Overwrites the state file in place (as `echo > file` or an editor without rename does).
    pub fn write_state_in_place(&self, state: &str) {
        assert!(matches!(self.layout, Layout::Plain | Layout::InPlace));
        let mut f = fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&self.state)
            .unwrap();
        f.write_all(state.as_bytes()).unwrap();
    }

    /// `GET path` on the agent's HTTP endpoint: (status, body).
    pub fn get(&self, gw: &Gateway, path: &str) -> Option<(u16, String)> {
        http_get(&gw.node, &self.metrics, path)
    }

    /// The value of one series, e.g. `wgfence_bpf_map_writes_total` or
    /// `wgfence_dropped_packets_total{reason="policy_denied"}`.
    pub fn metric(&self, gw: &Gateway, series: &str) -> f64 {
        let (_, body) = self
            .get(gw, "/metrics")
            .unwrap_or_else(|| panic!("no metrics from the agent; log:\n{}", self.log_text()));
        body.lines()
            .find_map(|line| {
                let (name, value) = line.rsplit_once(' ')?;
                (name == series).then(|| value.parse().ok())?
            })
            .unwrap_or_else(|| panic!("no series {series} in:\n{body}"))
    }

    /// Waits until `/readyz` answers 200.
    pub fn wait_ready(&self, gw: &Gateway) {
        self.wait_readyz(gw, 200);
    }

    pub fn wait_readyz(&self, gw: &Gateway, status: u16) {
        self.wait_readyz_for(gw, status, Duration::from_secs(15));
    }

    /// Waits up to `timeout` until `/readyz` answers `status`.
    pub fn wait_readyz_for(&self, gw: &Gateway, status: u16, timeout: Duration) {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if self.get(gw, "/readyz").map(|(s, _)| s) == Some(status) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("/readyz never answered {status}; log:\n{}", self.log_text());
    }

    /// Waits until the agent has finished `n` more reconciles than `before` (from
    /// `reconciles()`).
    pub fn wait_reconciles(&self, gw: &Gateway, before: f64, n: f64) {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(15) {
            if self.reconciles(gw) >= before + n {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("no reconcile happened; log:\n{}", self.log_text());
    }

    /// Waits (up to two minutes: a large state takes a while to read) until the agent has
    /// rejected a state, and checks that its log gives `reason`.
    pub fn wait_rejected(&self, gw: &Gateway, reason: &str) {
        let rejected = || self.metric(gw, "wgfence_state_rejected_total") >= 1.0;
        assert!(
            crate::net::wait_for(Duration::from_secs(120), rejected).is_some(),
            "the state was not rejected; log:\n{}",
            self.log_text()
        );
        let log = self.log_text();
        assert!(log.contains(reason), "no {reason:?} in the log:\n{log}");
    }

    pub fn reconciles(&self, gw: &Gateway) -> f64 {
        self.metric(gw, "wgfence_reconcile_duration_seconds_count")
    }

    /// The agent's log so far (it exists from the start: a log that cannot be read fails the
    /// test, rather than reading as one without the lines a test looks for).
    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log)
            .unwrap_or_else(|e| panic!("reading the agent's log {}: {e}", self.log.display()))
    }

    /// The agent's process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL: the agent gets no chance to clean up (nor should it need one).
    pub fn kill(&mut self) {
        if let Some(podman) = &self.container {
            // Killing `podman run` would leave the container running.
            podman.remove();
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and wait.
    pub fn stop(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        child.wait().ok()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            // Not `log_text`: a panic here, while a failed test unwinds, would abort.
            let log =
                fs::read_to_string(&self.log).unwrap_or_else(|e| format!("(unreadable: {e})"));
            eprintln!("--- wgfence log ({}) ---\n{log}", self.node);
        }
        let status = wgfence::status::status_path(&self.interface);
        // The snapshot, and its temporary file if the agent was killed mid-write.
        let _ = fs::remove_file(status.with_extension("json.tmp"));
        let _ = fs::remove_file(status);
        let _ = fs::remove_dir_all(&self.dir);
    }
}
