//! bpf-linker 0.13.0, which links the eBPF crate. Its default feature wants a system LLVM 23,
//! which Debian 12 lacks; the rustup toolchains ship libLLVM 22 as a shared library, so it is
//! built with feature `llvm-22` against that library (docs/toolchain.md).

use std::{
    fs,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

use crate::util;

const BPF_LINKER: &str = "bpf-linker";
const BPF_LINKER_VERSION: &str = "0.13.0";
/// The LLVM feature of bpf-linker that matches the rustup toolchains' libLLVM.
const BPF_LINKER_LLVM_FEATURE: &str = "llvm-22";
/// File names of rustup's shared LLVM 22: `libLLVM.so.22.1-rust-<rustc version>`.
const LIBLLVM_PREFIX: &str = "libLLVM.so.22.";

/// What running the first `bpf-linker` in PATH found.
enum Linker {
    Missing,
    Broken { path: PathBuf, error: String },
    Found { path: PathBuf, version: String },
}

/// Makes sure the first `bpf-linker` in PATH is version 0.13.0 and runs; builds it if not.
pub fn ensure() -> Result<()> {
    let reason = match find_linker() {
        Linker::Found { path, version } if version == BPF_LINKER_VERSION => {
            eprintln!("ok: {BPF_LINKER} {version} ({})", path.display());
            return Ok(());
        }
        Linker::Found { path, version } => format!("{} is version {version}", path.display()),
        Linker::Broken { path, error } => format!("{} does not run: {error}", path.display()),
        Linker::Missing => "not found in PATH".to_owned(),
    };
    eprintln!(
        "installing: {BPF_LINKER} {BPF_LINKER_VERSION} ({reason}); this takes about two minutes"
    );

    let libllvm = find_libllvm()?;
    let prefix = llvm_prefix(&libllvm)?;
    let root = util::cargo_home()?;
    util::run(
        Command::new(util::cargo())
            .args(["install", "--locked", "--force", "--root"])
            .arg(&root)
            .args([BPF_LINKER, "--version", BPF_LINKER_VERSION])
            .args([
                "--no-default-features",
                "--features",
                BPF_LINKER_LLVM_FEATURE,
            ])
            // llvm-sys finds LLVM here; the binary keeps the path as its rpath.
            .env("LLVM_PREFIX", &prefix)
            .env_remove("CARGO_TARGET_DIR"),
    )?;

    let installed = root.join("bin").join(BPF_LINKER);
    match find_linker() {
        Linker::Found { path, version } if version == BPF_LINKER_VERSION => {
            eprintln!("ok: {BPF_LINKER} {version} ({})", path.display());
            Ok(())
        }
        Linker::Found { path, version } => bail!(
            "installed {} but {} (version {version}) comes first in PATH: remove it or put {} \
             before it",
            installed.display(),
            path.display(),
            root.join("bin").display()
        ),
        Linker::Broken { path, error } => {
            bail!("{} does not run after installing: {error}", path.display())
        }
        Linker::Missing => bail!(
            "cargo install succeeded but {BPF_LINKER} is not in PATH (expected {})",
            installed.display()
        ),
    }
}

fn find_linker() -> Linker {
    let Some(path) = util::find_in_path(BPF_LINKER) else {
        return Linker::Missing;
    };
    // Without the library path cargo and rustup set for their children: the binary must find
    // libLLVM through its own rpath wherever it runs.
    let output = match Command::new(&path)
        .arg("--version")
        .env_remove("LD_LIBRARY_PATH")
        .output()
    {
        Ok(output) => output,
        Err(err) => {
            return Linker::Broken {
                path,
                error: err.to_string(),
            }
        }
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    match (output.status.success(), parse_version(&stdout)) {
        (true, Some(version)) => Linker::Found {
            path,
            version: version.to_owned(),
        },
        _ => {
            // E.g. "error while loading shared libraries: libLLVM.so...": its LLVM is gone.
            let stderr = String::from_utf8_lossy(&output.stderr);
            let error = stderr
                .lines()
                .chain(stdout.lines())
                .find(|line| !line.trim().is_empty())
                .unwrap_or("no version in its output")
                .trim()
                .to_owned();
            Linker::Broken {
                path,
                error: format!("{error} ({})", output.status),
            }
        }
    }
}

/// The version in `bpf-linker --version` output ("bpf-linker 0.13.0").
fn parse_version(stdout: &str) -> Option<&str> {
    let mut words = stdout.split_whitespace();
    (words.next() == Some(BPF_LINKER))
        .then(|| words.next())
        .flatten()
}

/// The shared libLLVM 22 of a rustup toolchain, preferring a stable toolchain.
fn find_libllvm() -> Result<PathBuf> {
    let toolchains = util::rustup_home()?.join("toolchains");
    let (toolchain, lib) = find_libllvm_in(&toolchains)?;
    eprintln!(
        "ok: libLLVM 22 from toolchain {toolchain} ({})",
        lib.display()
    );
    Ok(lib)
}

/// In rustup's toolchains directory: the toolchain name and its libLLVM 22.
fn find_libllvm_in(toolchains: &Path) -> Result<(String, PathBuf)> {
    let entries = fs::read_dir(toolchains).with_context(|| {
        format!(
            "cannot list rustup toolchains in {}: bpf-linker is built against a rustup \
             toolchain's libLLVM 22",
            toolchains.display()
        )
    })?;
    let mut found: Vec<(bool, String, PathBuf)> = Vec::new();
    for entry in entries.flatten() {
        // Linked toolchains (symlinks) duplicate or point outside rustup's own; skip them.
        if entry.file_type().map_or(true, |kind| !kind.is_dir()) {
            continue;
        }
        let toolchain = entry.file_name().to_string_lossy().into_owned();
        let Ok(libs) = fs::read_dir(entry.path().join("lib")) else {
            continue;
        };
        for lib in libs.flatten() {
            let name = lib.file_name().to_string_lossy().into_owned();
            if name.starts_with(LIBLLVM_PREFIX)
                && name.contains("-rust-")
                && lib.file_type().is_ok_and(|kind| kind.is_file())
            {
                found.push((
                    !toolchain.starts_with("stable"),
                    toolchain.clone(),
                    lib.path(),
                ));
            }
        }
    }
    found.sort();
    match found.into_iter().next() {
        Some((_, toolchain, lib)) => Ok((toolchain, lib)),
        None => bail!(
            "no shared libLLVM 22 ({LIBLLVM_PREFIX}*-rust-*) in any toolchain under {}: \
             bpf-linker {BPF_LINKER_VERSION} is built with feature {BPF_LINKER_LLVM_FEATURE} \
             against it; install a rustup toolchain whose LLVM is 22 (rustc 1.95 stable)",
            toolchains.display()
        ),
    }
}

/// A persistent LLVM_PREFIX whose lib/ links to `libllvm` as `libLLVM.so` (what llvm-sys links
/// against) and under its own name (what the binary loads, through its rpath). It must outlive
/// the build: bpf-linker finds libLLVM through it at every run.
fn llvm_prefix(libllvm: &Path) -> Result<PathBuf> {
    let prefix = util::data_home()?.join("wgfence").join("llvm");
    let lib_dir = prefix.join("lib");
    fs::create_dir_all(&lib_dir).with_context(|| format!("cannot create {}", lib_dir.display()))?;
    let file_name = libllvm
        .file_name()
        .with_context(|| format!("{} has no file name", libllvm.display()))?;
    for name in [Path::new("libLLVM.so"), Path::new(file_name)] {
        let link = lib_dir.join(name);
        if fs::read_link(&link).is_ok_and(|target| target == libllvm) {
            continue;
        }
        if fs::symlink_metadata(&link).is_ok() {
            fs::remove_file(&link).with_context(|| format!("cannot replace {}", link.display()))?;
        }
        symlink(libllvm, &link).with_context(|| format!("cannot create {}", link.display()))?;
    }
    eprintln!("ok: LLVM_PREFIX {}", prefix.display());
    Ok(prefix)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_version_line() {
        assert_eq!(parse_version("bpf-linker 0.13.0\n"), Some("0.13.0"));
        assert_eq!(parse_version("something 0.13.0\n"), None);
        assert_eq!(parse_version("bpf-linker"), None);
        assert_eq!(parse_version(""), None);
    }

    /// A fresh directory under the system's temporary directory.
    fn scratch(name: &str) -> std::io::Result<PathBuf> {
        let dir = std::env::temp_dir().join(format!("xtask-{}-{name}", std::process::id()));
        if dir.exists() {
            fs::remove_dir_all(&dir)?;
        }
        fs::create_dir_all(&dir)?;
        Ok(dir)
    }

    fn toolchain(root: &Path, name: &str, libs: &[&str]) -> std::io::Result<()> {
        let lib_dir = root.join(name).join("lib");
        fs::create_dir_all(&lib_dir)?;
        for lib in libs {
            fs::write(lib_dir.join(lib), b"")?;
        }
        Ok(())
    }

    #[test]
    fn prefers_stable_and_skips_linked_toolchains() -> Result<()> {
        let root = scratch("toolchains")?;
        toolchain(
            &root,
            "nightly-x86_64-unknown-linux-gnu",
            &["libLLVM.so.22.1-rust-1.97.0-nightly"],
        )?;
        toolchain(
            &root,
            "stable-x86_64-unknown-linux-gnu",
            &[
                "libLLVM-22-rust-1.95.0-stable.so",
                "libLLVM.so.22.1-rust-1.95.0-stable",
            ],
        )?;
        toolchain(&root, "old", &["libLLVM.so.21.1-rust-1.90.0-stable"])?;
        symlink(
            root.join("stable-x86_64-unknown-linux-gnu"),
            root.join("1.95.0-x86_64-unknown-linux-gnu"),
        )?;

        let (name, lib) = find_libllvm_in(&root)?;
        assert_eq!(name, "stable-x86_64-unknown-linux-gnu");
        assert_eq!(
            lib,
            root.join("stable-x86_64-unknown-linux-gnu/lib/libLLVM.so.22.1-rust-1.95.0-stable")
        );

        fs::remove_dir_all(root.join("stable-x86_64-unknown-linux-gnu"))?;
        let (name, _) = find_libllvm_in(&root)?;
        assert_eq!(name, "nightly-x86_64-unknown-linux-gnu");

        fs::remove_dir_all(root.join("nightly-x86_64-unknown-linux-gnu"))?;
        let err = find_libllvm_in(&root).err().map(|err| err.to_string());
        assert!(err.is_some_and(|err| err.contains("no shared libLLVM 22")));
        fs::remove_dir_all(&root)?;
        Ok(())
    }
}
