//! Network namespaces, veth underlays and wireguard-go interfaces for the integration tests.
//!
//! Every name is unique on the machine (process id and a counter): the wireguard-go UAPI socket
//! directory is shared by all namespaces, and tests run in parallel. Everything is removed in
//! `Drop`, so also when a test fails.

use std::{
    fs,
    io::Write as _,
    os::{fd::AsRawFd as _, unix::net::UnixStream},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    thread,
    time::{Duration, Instant},
};

static NEXT_ID: AtomicU32 = AtomicU32::new(0);

/// A short name unique on this machine for the life of the test process.
pub fn unique(prefix: &str) -> String {
    let n = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}{:05}{n:03}", std::process::id() % 100_000)
}

/// Runs a command, panicking with its output when it fails.
#[track_caller]
pub fn run(args: &[&str]) -> Output {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Like [`run`], with stdin fed from `input`.
#[track_caller]
pub fn run_with_input(args: &[&str], input: &str) -> Output {
    let mut child = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {args:?}: {e}"));
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(input.as_bytes())
            .unwrap_or_else(|e| panic!("writing to {args:?}: {e}"));
    }
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("waiting for {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A network namespace, deleted on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    pub fn new(prefix: &str) -> Self {
        let name = unique(prefix);
        run(&["ip", "netns", "add", &name]);
        let ns = Self { name };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `ip netns exec <ns> args...`, panicking on failure.
    #[track_caller]
    pub fn exec(&self, args: &[&str]) -> Output {
        let mut full = vec!["ip", "netns", "exec", &self.name];
        full.extend_from_slice(args);
        run(&full)
    }

    /// `ip netns exec <ns> args...` without checking the exit status.
    pub fn try_exec(&self, args: &[&str]) -> Output {
        Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {args:?} in {}: {e}", self.name))
    }

    /// `ip -n <ns> args...`.
    #[track_caller]
    pub fn ip(&self, args: &[&str]) -> Output {
        let mut full = vec!["ip", "-n", &self.name];
        full.extend_from_slice(args);
        run(&full)
    }

    /// A command that runs in this namespace (network only: it sees the host's mounts, bpffs
    /// included, like a DaemonSet pod with hostNetwork sees its node's).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        use std::os::unix::process::CommandExt as _;
        let path = format!("/var/run/netns/{}", self.name);
        let file = fs::File::open(&path).unwrap_or_else(|e| panic!("opening {path}: {e}"));
        let mut cmd = Command::new(program);
        // SAFETY: setns is async-signal-safe; `file` is moved into the closure and stays open.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        cmd
    }

    /// Runs `f` on a thread that has entered this namespace: sockets it opens and interfaces it
    /// looks up are this namespace's.
    pub fn enter<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/var/run/netns/{}", self.name);
        thread::scope(|s| {
            s.spawn(|| {
                let file = fs::File::open(&path).unwrap_or_else(|e| panic!("opening {path}: {e}"));
                // SAFETY: setns on this thread only, with a namespace fd we hold open.
                let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
                f()
            })
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// A WireGuard key pair from `wg genkey` / `wg pubkey`.
#[derive(Debug, Clone)]
pub struct KeyPair {
    pub private: String,
    pub public: String,
}

impl KeyPair {
    pub fn generate() -> Self {
        let private = stdout(&run(&["wg", "genkey"]));
        let public = stdout(&run_with_input(&["wg", "pubkey"], &private));
        Self { private, public }
    }
}

const UAPI_DIR: &str = "/var/run/wireguard";

/// A wireguard-go interface in a namespace; the process is killed and its socket removed on
/// drop (which also removes the TUN device).
#[derive(Debug)]
pub struct WireGuard {
    pub name: String,
    pub keys: KeyPair,
    child: Child,
    /// wireguard-go's standard error.
    log: TempFile,
}

impl WireGuard {
    /// Starts wireguard-go in `ns` and gives the interface a private key and listen port.
    pub fn start(ns: &Netns, name: &str, listen_port: u16) -> Self {
        Self::start_with_keys(ns, name, listen_port, KeyPair::generate())
    }

    /// Kills wireguard-go (its TUN device goes with it) and starts it again: the same name,
    /// key and port, no peers, no addresses, a new interface index.
    pub fn recreate(&mut self, ns: &Netns, listen_port: u16) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_file(self.socket());
        let gone = wait_for(Duration::from_secs(10), || {
            !ns.try_exec(&["ip", "link", "show", &self.name])
                .status
                .success()
        });
        assert!(gone.is_some(), "{} did not go away", self.name);
        let mut new = Self::start_with_keys(ns, &self.name, listen_port, self.keys.clone());
        // Keep the new process; the old (dead) one drops with `new`, which must not remove the
        // socket the new process just made.
        std::mem::swap(&mut self.child, &mut new.child);
        std::mem::swap(&mut self.log, &mut new.log);
        new.name = unique("gone");
    }

    fn start_with_keys(ns: &Netns, name: &str, listen_port: u16, keys: KeyPair) -> Self {
        let log = TempFile::new("");
        let stderr =
            fs::File::create(&log.0).unwrap_or_else(|e| panic!("{}: {e}", log.0.display()));
        let child = Command::new("ip")
            .args(["netns", "exec", ns.name(), "wireguard-go", "-f", name])
            // wireguard-go refuses to run on Linux without this (the kernel module is absent).
            .env("WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("cannot start wireguard-go (is it installed?)");
        let mut wg = Self {
            name: name.to_owned(),
            keys,
            child,
            log,
        };
        // Wait until the socket accepts a connection, with our own connect. `wg` must not be the
        // first to try: the socket file exists from bind(), and a `wg` that connects before
        // wireguard-go listens gets ECONNREFUSED, takes the socket for a dead daemon's and
        // unlinks it. wireguard-go then listens on a socket nobody can reach, and every later
        // `wg` falls back to the kernel backend ("Protocol not supported"). Seen in CI.
        let listening = wait_for(Duration::from_secs(10), || {
            if let Ok(Some(status)) = wg.child.try_wait() {
                panic!("wireguard-go for {name} exited ({status}): {}", wg.log());
            }
            UnixStream::connect(wg.socket()).is_ok()
        });
        if listening.is_none() {
            panic!(
                "wireguard-go did not listen on {} within 10 s: {}",
                wg.socket().display(),
                wg.log()
            );
        }
        let key_file = TempFile::new(&wg.keys.private);
        let port = listen_port.to_string();
        run(&[
            "wg",
            "set",
            name,
            "private-key",
            key_file.path_str(),
            "listen-port",
            &port,
        ]);
        ns.ip(&["link", "set", name, "up"]);
        wg
    }

    /// What wireguard-go printed, for a failure message.
    fn log(&self) -> String {
        fs::read_to_string(&self.log.0).unwrap_or_default()
    }

    pub fn socket(&self) -> PathBuf {
        Path::new(UAPI_DIR).join(format!("{}.sock", self.name))
    }

    /// `wg set <if> peer <key> args...`.
    pub fn set_peer(&self, public_key: &str, args: &[&str]) {
        let mut full = vec!["wg", "set", &self.name, "peer", public_key];
        full.extend_from_slice(args);
        run(&full);
    }

    /// Seconds since the epoch of each peer's latest handshake (0: none yet).
    pub fn latest_handshakes(&self) -> Vec<(String, u64)> {
        let out = run(&["wg", "show", &self.name, "latest-handshakes"]);
        stdout(&out)
            .lines()
            .filter_map(|line| {
                let mut parts = line.split_whitespace();
                Some((parts.next()?.to_owned(), parts.next()?.parse().ok()?))
            })
            .collect()
    }
}

impl Drop for WireGuard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_file(self.socket());
    }
}

/// A file in the temp directory, removed on drop (e.g. a private key for `wg set`).
#[derive(Debug)]
struct TempFile(PathBuf);

impl TempFile {
    fn new(contents: &str) -> Self {
        let path = std::env::temp_dir().join(unique("wgfence-test-"));
        fs::write(&path, contents).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Self(path)
    }

    fn path_str(&self) -> &str {
        self.0.to_str().unwrap_or_default()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// Polls `cond` every 10 ms until it holds or `timeout` passes.
pub fn wait_for(timeout: Duration, mut cond: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if cond() {
            return Some(start.elapsed());
        }
        thread::sleep(Duration::from_millis(10));
    }
    None
}
