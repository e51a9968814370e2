//! `cargo xtask dump`: what the agent pinned for an interface, through bpftool — the maps with
//! their BTF field names, and the tcx links.

use std::{fs, io::ErrorKind, path::Path, process::Command};

use anyhow::{bail, Context, Result};

use crate::util;

/// Pinned map names start with this (agent/src/dataplane, common's map names).
const MAP_PREFIX: &str = "wgf";
/// The pinned tcx links (`wgfence::dataplane::LINK_PIN_INGRESS`, `LINK_PIN_EGRESS`) start with this.
const LINK_PREFIX: &str = "link_";
/// The drop event ring buffer: bpftool cannot dump a ring buffer, only show it.
const EVENTS_MAP: &str = "wgf4_events";

pub fn run(interface: &str, bpffs: &Path) -> Result<()> {
    let dir = bpffs.join("wgfence").join(interface);
    let entries = match fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == ErrorKind::NotFound => bail!(
            "nothing pinned for {interface} ({} does not exist); is the agent running?",
            dir.display()
        ),
        Err(err) if err.kind() == ErrorKind::PermissionDenied => {
            bail!(
                "cannot read {}: permission denied (run as root)",
                dir.display()
            )
        }
        Err(err) => return Err(err).with_context(|| format!("cannot read {}", dir.display())),
    };
    let mut names: Vec<String> = entries
        .map(|entry| entry.map(|entry| entry.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()
        .with_context(|| format!("cannot read {}", dir.display()))?;
    names.sort();
    if names.is_empty() {
        bail!(
            "nothing pinned for {interface} ({} is empty); is the agent running?",
            dir.display()
        );
    }
    let bpftool = util::find_program("bpftool")
        .context("bpftool not found: `cargo xtask setup` installs it (Debian package bpftool)")?;

    // A directory of policy tries (`wgf4_tries_v4/<policy id>`): each trie in turn. The agent
    // creates them without BTF, so bpftool prints their bytes (key: prefix length, u32 LE, then
    // the address; value: the `PolicyValue`).
    let mut expanded = Vec::new();
    for name in names {
        let path = dir.join(&name);
        if path.is_dir() {
            let mut ids: Vec<String> = fs::read_dir(&path)
                .with_context(|| format!("cannot read {}", path.display()))?
                .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
                .collect();
            ids.sort_by_key(|id| (id.len(), id.clone()));
            expanded.extend(ids.into_iter().map(|id| format!("{name}/{id}")));
        } else {
            expanded.push(name);
        }
    }
    let names = expanded;
    let mut failed = Vec::new();
    for name in &names {
        let path = dir.join(name);
        let args: &[&str] = if name == EVENTS_MAP {
            println!("=== map {name} (ring buffer: `wgfence monitor` reads it) ===");
            &["map", "show", "pinned"]
        } else if name.starts_with(MAP_PREFIX) {
            println!("=== map {name} ===");
            &["map", "dump", "pinned"]
        } else if name.starts_with(LINK_PREFIX) {
            println!("=== link {name} ===");
            &["link", "show", "pinned"]
        } else {
            println!("=== {name}: neither a wgfence map nor its link; skipped ===");
            continue;
        };
        let result = util::run(Command::new(&bpftool).args(args).arg(&path));
        if let Err(err) = result {
            eprintln!("error: {err:#}");
            failed.push(name.as_str());
        }
    }
    if !failed.is_empty() {
        bail!("bpftool failed for {}", failed.join(", "));
    }
    Ok(())
}
