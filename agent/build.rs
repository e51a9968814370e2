//! Builds the eBPF datapath (`ebpf/`) for `bpfel-unknown-none` and hands its path to the agent,
//! which embeds the object. The target is tier 3, so `core` is built from source
//! (`-Z build-std=core`); that needs a compiler whose library source is installed:
//!
//! - Debian's `rustc-web` with `rust-web-src` (`/usr/bin/rustc`, source under `/usr/lib/rustlib`)
//!   — what `cargo xtask setup` installs on machines without internet beyond the registries;
//! - otherwise a rustup `nightly` toolchain with the `rust-src` component.
//!
//! `WGFENCE_BPF_RUSTC` names another compiler explicitly. Like aya-build, but aya-build drives
//! `rustup run <toolchain> cargo`, which cannot express "Debian's rustc with bootstrap enabled".

use std::{
    env,
    ffi::OsString,
    path::{Path, PathBuf},
    process::Command,
};

const TARGET: &str = "bpfel-unknown-none";
const DEBIAN_RUSTC: &str = "/usr/bin/rustc";
const DEBIAN_LIBRARY_SRC: &str = "/usr/lib/rustlib/src/rust/library/core";

fn main() {
    if let Err(message) = build() {
        // A build script reports errors by failing; say exactly what is missing.
        eprintln!("error: building the eBPF datapath failed: {message}");
        std::process::exit(1);
    }
}

fn build() -> Result<(), String> {
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").ok_or("CARGO_MANIFEST_DIR unset")?);
    let root = manifest_dir
        .parent()
        .ok_or("agent/ has no parent directory")?
        .to_path_buf();
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").ok_or("OUT_DIR unset")?);
    for path in [
        "ebpf/src",
        "ebpf/Cargo.toml",
        "common/src",
        "common/Cargo.toml",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(path).display());
    }
    println!("cargo:rerun-if-env-changed=WGFENCE_BPF_RUSTC");

    // A separate target directory: the outer cargo holds the lock on the workspace's.
    let target_dir = root.join("target").join("bpf");
    let cargo = env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"));
    let mut cmd = Command::new(&cargo);
    cmd.current_dir(&root).args([
        "build",
        "--package",
        "wgfence-ebpf",
        "--release",
        "--target",
        TARGET,
        "-Z",
        "build-std=core",
        "--target-dir",
    ]);
    cmd.arg(&target_dir);
    // Nothing of the outer build's configuration applies to the BPF target.
    for var in [
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "CARGO_BUILD_RUSTFLAGS",
        "RUSTDOC",
    ] {
        cmd.env_remove(var);
    }
    // BTF for the maps (`bpftool map dump` prints field names) and for aya's relocations.
    cmd.env(
        "CARGO_ENCODED_RUSTFLAGS",
        "-Cdebuginfo=2\x1f-Clink-arg=--btf",
    );

    match toolchain()? {
        Toolchain::Rustc(rustc) => {
            // build-std needs nightly features; this compiler's own source is a stable release.
            cmd.env("RUSTC", rustc).env("RUSTC_BOOTSTRAP", "1");
        }
        Toolchain::RustupNightly => {
            cmd = rustup_nightly(cmd);
        }
    }

    let status = cmd
        .status()
        .map_err(|e| format!("cannot run {}: {e}", cargo.to_string_lossy()))?;
    if !status.success() {
        return Err(format!(
            "`cargo build --package wgfence-ebpf --target {TARGET}` failed ({status}); \
             run `cargo xtask setup` to install bpf-linker and the BPF toolchain"
        ));
    }
    let release = target_dir.join(TARGET).join("release");
    // The datapath, embedded in the agent.
    pass_on(&release, &out_dir, "wgfence", "WGFENCE_BPF_OBJECT")?;
    // The tick counter the agent runs to learn the kernel's tick rate: embedded too.
    pass_on(&release, &out_dir, "tick", "WGFENCE_TICK_OBJECT")?;
    // The bench's floor programs: only their path is passed on (nothing embeds them).
    pass_on(&release, &out_dir, "floor", "WGFENCE_FLOOR_OBJECT")?;
    Ok(())
}

/// Copies the BPF binary `bin` into `out_dir` and names the copy in the environment variable
/// `var` of the agent's build.
fn pass_on(release: &Path, out_dir: &Path, bin: &str, var: &str) -> Result<(), String> {
    let object = release.join(bin);
    let copy = out_dir.join(format!("{bin}.bpf.o"));
    std::fs::copy(&object, &copy).map_err(|e| format!("cannot copy {}: {e}", object.display()))?;
    println!("cargo:rustc-env={var}={}", copy.display());
    Ok(())
}

enum Toolchain {
    Rustc(PathBuf),
    RustupNightly,
}

fn toolchain() -> Result<Toolchain, String> {
    if let Some(rustc) = env::var_os("WGFENCE_BPF_RUSTC") {
        return Ok(Toolchain::Rustc(rustc.into()));
    }
    if Path::new(DEBIAN_RUSTC).exists() && Path::new(DEBIAN_LIBRARY_SRC).exists() {
        return Ok(Toolchain::Rustc(DEBIAN_RUSTC.into()));
    }
    let nightly_has_src = Command::new("rustup")
        .args(["run", "nightly", "rustc", "--print", "sysroot"])
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| {
            let sysroot = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            Path::new(&sysroot)
                .join("lib/rustlib/src/rust/library/core")
                .exists()
        })
        .unwrap_or(false);
    if nightly_has_src {
        return Ok(Toolchain::RustupNightly);
    }
    Err(format!(
        "no compiler with library source for {TARGET}: install Debian's rustc-web and \
         rust-web-src, or `rustup toolchain install nightly --component rust-src` \
         (`cargo xtask setup` does the former), or set WGFENCE_BPF_RUSTC"
    ))
}

/// The same command, run through `rustup run nightly`.
fn rustup_nightly(cmd: Command) -> Command {
    let mut wrapped = Command::new("rustup");
    wrapped.args(["run", "nightly", "cargo"]);
    wrapped.args(cmd.get_args());
    if let Some(dir) = cmd.get_current_dir() {
        wrapped.current_dir(dir);
    }
    for (key, value) in cmd.get_envs() {
        match value {
            Some(value) => wrapped.env(key, value),
            None => wrapped.env_remove(key),
        };
    }
    // rustup picks the toolchain's cargo; drop the outer one's path.
    wrapped.env_remove("CARGO");
    wrapped
}
