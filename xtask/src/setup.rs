//! `cargo xtask setup`: installs what building, running and testing wgfence need, and only what
//! is missing, so a second run on a ready machine changes nothing and takes seconds. See
//! docs/toolchain.md for why each piece is needed and why it is installed this way.
//!
//! 1. Debian packages: WireGuard (userspace), bpftool, network tools, and — unless a rustup
//!    nightly with `rust-src` can build the eBPF crate — Debian's `rustc-web` with its library
//!    source, which agent/build.rs uses to build `core` for bpfel-unknown-none.
//! 2. bpf-linker 0.13.0, built against the libLLVM 22 that rustup toolchains ship.
//! 3. The BPF filesystem at /sys/fs/bpf, where the agent pins its maps and link.

use std::{env, fs, path::Path, process::Command, time::Instant};

use anyhow::{bail, Context, Result};

use crate::{linker, util};

/// Packages every machine needs: wireguard-go and wg for the interface, bpftool for `dump` and
/// debugging, ip/ping/iperf3/nc for the integration tests, demo and benchmarks.
const PACKAGES: &[&str] = &[
    "wireguard-go",
    "wireguard-tools",
    "bpftool",
    "iproute2",
    "iputils-ping",
    "iperf3",
    "netcat-openbsd",
];
/// Debian's rustc 1.96 and its library source: builds `core` for the BPF target.
const COMPILER_PACKAGES: &[&str] = &["rustc-web", "rust-web-src"];
/// Inside a rustc sysroot: the library source `-Z build-std=core` needs.
const SYSROOT_CORE_SRC: &str = "lib/rustlib/src/rust/library/core";

pub const BPFFS: &str = "/sys/fs/bpf";

/// Whether a missing bpffs is an error or only worth a warning.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Bpffs {
    /// Needed now: mount it, or fail if that is not possible (not root).
    Require,
    /// Mount it if possible; if not (not root), warn: building does not need it.
    IfRoot,
}

pub fn run(bpffs: Bpffs) -> Result<()> {
    let start = Instant::now();
    packages().context("setup: Debian packages")?;
    linker::ensure().context("setup: bpf-linker")?;
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
    if util::find_in_path("dpkg-query").is_none() {
        bail!(
            "dpkg-query not found: setup installs Debian packages and supports Debian-family \
             systems only; install the equivalents of {} yourself",
            wanted.join(" ")
        );
    }
    let missing = missing_packages(&wanted);
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
    fs::create_dir_all(BPFFS).with_context(|| format!("cannot create {BPFFS}"))?;
    util::run(Command::new("mount").args(["-t", "bpf", "bpf", BPFFS]))?;
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
