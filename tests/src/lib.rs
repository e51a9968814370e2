//! Helpers for wgfence's privileged integration tests. Every test builds its own network
//! namespaces, wireguard-go interfaces and bpffs pins with unique names, and removes them in
//! `Drop`, so they are removed when a test fails too.

pub mod agent;
pub mod bench;
pub mod container;
pub mod demo;
pub mod kube;
pub mod net;
pub mod packet;
pub mod probe;
pub mod topology;

use wgfence::{
    dataplane::Maps,
    policy::{compile, CompiledPolicy, Rule},
};

/// Busy loops on every CPU (and more), for as long as it lives: a machine as loaded as a CI
/// runner shared with other builds. Each loop is a `sh` child of the test, killed (by its pid)
/// and reaped when this is dropped, also when the test fails.
pub struct CpuLoad(Vec<std::process::Child>);

impl CpuLoad {
    /// `per_cpu` busy loops per online CPU.
    pub fn start(per_cpu: usize) -> Self {
        let cpus = std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get);
        let children = (0..cpus * per_cpu)
            .map(|_| {
                std::process::Command::new("sh")
                    .args(["-c", "while :; do :; done"])
                    .stdin(std::process::Stdio::null())
                    .spawn()
                    .expect("starting a busy loop")
            })
            .collect();
        Self(children)
    }
}

impl Drop for CpuLoad {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// An address literal of a test (panics on a typo).
/// Spawns `command`, retrying while the kernel answers ETXTBSY: an executable a test has just
/// written can still be open for writing in a child another test thread forked meanwhile (until
/// that child execs), and exec refuses a file open for writing.
pub fn spawn(command: &mut std::process::Command) -> std::io::Result<std::process::Child> {
    let mut tries = 0;
    loop {
        match command.spawn() {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && tries < 100 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

pub fn ip(s: &str) -> std::net::IpAddr {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

/// A prefix literal of a test (panics on a typo).
pub fn net(s: &str) -> ipnet::IpNet {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

/// A state file of schema version 1 with these peers.
pub fn state(peers: Vec<serde_json::Value>) -> String {
    serde_json::json!({ "version": 1, "peers": peers }).to_string()
}

/// Fails the test with a clear message unless it runs as root (as CI does).
/// Pins the calling thread to `cpu` (`BPF_PROG_TEST_RUN` runs the program on the caller's CPU).
pub fn pin_to_cpu(cpu: usize) {
    // SAFETY: cpu_set_t is plain data; CPU_SET writes a bit inside it; sched_setaffinity reads
    // it for the calling thread (pid 0).
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    assert_eq!(
        rc,
        0,
        "sched_setaffinity({cpu}): {}",
        std::io::Error::last_os_error()
    );
}

pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "the privileged integration tests need root (run `cargo xtask test` as root)"
    );
}

/// Compiles `rules` and writes the policy's trie entries under `policy`.
pub fn install_policy(maps: &mut Maps, policy: u32, rules: &[Rule]) -> CompiledPolicy {
    let compiled = compile(rules).expect("policy does not compile");
    for (prefix, allows) in compiled.entries() {
        maps.upsert_policy(policy, prefix, &CompiledPolicy::value(allows))
            .unwrap_or_else(|e| panic!("writing policy entry {prefix}: {e}"));
    }
    maps.flush_policies()
        .unwrap_or_else(|e| panic!("publishing policy {policy}: {e}"));
    compiled
}

/// What differs between the maps and what `desired` compiles to, if anything: the planner's
/// own convergence check ([`wgfence::plan::invariants::check_maps_converged`]) on the maps as
/// read back.
pub fn map_mismatch(maps: &Maps, desired: &wgfence::state::DesiredState) -> Option<String> {
    match wgfence::reconcile::read_maps(maps) {
        Ok(actual) => wgfence::plan::invariants::check_maps_converged(&actual, desired).err(),
        Err(e) => Some(format!("reading the maps: {e}")),
    }
}

/// The pin names `text` mentions (a doc's list, or a directory listing): map names
/// (`wgf<layout>_...`), links (`link_...`) and programs (`prog_<direction>_<identity>`, where
/// the 16 hex digits of a real identity read as `<identity>`), as [`wgfence::dataplane::pins`]
/// names them.
pub fn pin_names(text: &str) -> std::collections::BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || "_<>".contains(c)))
        .filter(|w| {
            w.starts_with("link_")
                || w.starts_with("prog_")
                || (w.starts_with("wgf") && w.as_bytes().get(4) == Some(&b'_'))
        })
        .map(
            |w| match w.strip_prefix("prog_").and_then(|p| p.split_once('_')) {
                Some((direction, id))
                    if id.len() == 16 && id.bytes().all(|b| b.is_ascii_hexdigit()) =>
                {
                    format!("prog_{direction}_<identity>")
                }
                _ => w.to_owned(),
            },
        )
        .collect()
}
