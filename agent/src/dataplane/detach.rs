//! Detaching: `wgfence detach` renames the pin directory to its marker
//! (`detaching-<interface>-<pid>`), waits for the agent to let go of its links, then removes
//! what is left; an interrupted detach is finished by the next attach.

use std::{
    fs,
    io::ErrorKind,
    os::unix::fs::DirBuilderExt as _,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use wgfence_common::VARIANTS;

use super::{
    hooks, iface, lock, pin_dir,
    pins::{remove_dir_if_exists, unpin_all},
    sys, tc, Dataplane, DataplaneError, Result, DETACH_TIMEOUT,
};

impl Dataplane {
    /// Detaches this datapath as `wgfence detach` does, after letting go of its own links and
    /// lock (a detach waits until nothing holds them, so one issued while this process still
    /// held them would time out and leave its marker). For the tests and the benchmarks, which
    /// attach in-process.
    #[cfg(any(test, feature = "testing"))]
    pub fn detach_now(&mut self) -> Result<bool> {
        self.let_go();
        Self::detach(&self.bpffs, &self.interface)
    }

    /// Lets go of the links (the programs detach once nothing else holds them), then of the
    /// lock: in this order, because a `detach` that may not look links up by id takes the
    /// lock's release as the sign that the links are gone.
    pub(super) fn let_go(&mut self) {
        self.links.iter_mut().for_each(|l| *l = None);
        self.retired.clear();
        self.lock = None;
        self.detached = true;
    }

    /// Removes everything pinned for an interface: the links (which detaches the programs)
    /// and the maps, and waits up to [`DETACH_TIMEOUT`] until the links are really gone. What
    /// is already gone is not an error. Returns whether anything was removed.
    pub fn detach(bpffs: &Path, interface: &str) -> Result<bool> {
        Self::detach_within(bpffs, interface, DETACH_TIMEOUT)
    }

    /// [`Dataplane::detach`], waiting up to `timeout` for the links to be gone.
    ///
    /// The directory is first renamed to this detach's marker (atomically, inside bpffs). A
    /// running agent finds there the directory it locked, lets go of its links and its lock,
    /// and does not pin anything again; anything else that removes the directory looks like
    /// damage, which the agent repairs. The pins are removed, then this waits until no process
    /// holds the links (the programs are off the interface) and no agent holds the marker's
    /// lock, and only then removes the marker. Past `timeout` it fails, naming the holder, and
    /// leaves the marker for the agent to find (a later detach or start removes it).
    pub fn detach_within(bpffs: &Path, interface: &str, timeout: Duration) -> Result<bool> {
        let pinned = pin_dir(bpffs, interface);
        let own = pinned.with_file_name(detaching_name(interface, std::process::id()));
        let renamed = match fs::rename(&pinned, &own) {
            Ok(()) => true,
            Err(e) if e.kind() == ErrorKind::NotFound => false,
            Err(source) => {
                return Err(DataplaneError::Io {
                    path: pinned,
                    source,
                })
            }
        };
        // This detach's marker, and any an interrupted one left (its links still attached).
        let markers = detaching_dirs(bpffs, interface)?;
        let mut links = Vec::new();
        for marker in &markers {
            links.extend(unpin_all(marker)?);
        }
        wait_let_go(interface, &own, &markers, &links, timeout)?;
        let removed_filters = remove_tc_hook(interface, &markers)?;
        for marker in &markers {
            remove_marked_dir(marker)?;
        }
        // Leave <bpffs>/wgfence itself once no interface uses it.
        if let Some(parent) = own.parent() {
            let _ = fs::remove_dir(parent);
        }
        let detached = renamed || !markers.is_empty() || removed_filters;
        if detached {
            tracing::info!(interface, "datapath detached");
        }
        Ok(detached)
    }
}

/// One of the datapath's classifiers (a [`Variant`]'s `ingress` or `egress`).
/// Waits until no process holds `links` (the programs are off the interface) and no agent
/// holds the lock of one of `markers`; past `timeout`, an error naming the holder.
fn wait_let_go(
    interface: &str,
    own: &Path,
    markers: &[PathBuf],
    links: &[u32],
    timeout: Duration,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    // Whether this process may look links up by id (CAP_SYS_ADMIN). Without it (the
    // DaemonSet's capabilities), only the agent's lock tells that it let go: it closes its
    // links before its lock, so they are gone by then unless something else holds them.
    let mut see_links = true;
    loop {
        let mut held = Vec::new();
        for id in links.iter().filter(|_| see_links) {
            match sys::link_exists(*id) {
                Ok(true) => held.push(*id),
                Ok(false) => {}
                Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                    tracing::debug!("no CAP_SYS_ADMIN: waiting for the agent's lock only");
                    see_links = false;
                    held.clear();
                    break;
                }
                Err(source) => {
                    return Err(DataplaneError::Io {
                        path: own.to_owned(),
                        source,
                    })
                }
            }
        }
        let mut locked = None;
        for marker in markers {
            if lock::is_locked(marker)? {
                locked = Some(marker);
                break;
            }
        }
        if held.is_empty() && locked.is_none() {
            break;
        }
        if Instant::now() >= deadline {
            return Err(DataplaneError::DetachTimeout {
                interface: interface.to_owned(),
                waited: timeout,
                links: held,
                holder: locked.map(|marker| lock::describe_holder(lock::holder_of(marker))),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// The agent let go (its lock is free) and never attaches again: the filters of the tc hook
/// (which no descriptor holds) are deleted here, the agent's own only, and the clsact qdisc if
/// the agent added it and nothing else is on it. Whether filters were removed.
fn remove_tc_hook(interface: &str, markers: &[PathBuf]) -> Result<bool> {
    let added_qdisc = markers
        .iter()
        .any(|marker| marker.join(tc::QDISC_MARKER).is_dir());
    let mut removed_filters = false;
    match iface::index(interface) {
        Ok(ifindex) => {
            removed_filters = remove_tc_filters(interface, ifindex)?;
            if added_qdisc && tc::remove_clsact_if_empty(interface, ifindex)? {
                tracing::info!(interface, "removed the clsact qdisc wgfence had added");
            }
        }
        // Gone with the interface, or in another network namespace.
        Err(DataplaneError::Interface { source, .. })
            if source.raw_os_error() == Some(libc::ENODEV) =>
        {
            if markers.iter().any(|m| m.join(tc::HOOK_MARKER).is_dir()) {
                tracing::warn!(
                    interface,
                    "the programs ran on the tc hook and there is no {interface} in this \
                     network namespace: if it exists in another one, its filters still \
                     run there (with the last state); run `wgfence detach` in that \
                     namespace, or delete them with `tc filter del dev {interface} \
                     ingress prio 1` (and egress)"
                );
            }
        }
        Err(e) => return Err(e),
    }
    Ok(removed_filters)
}

/// The name a detach renames an interface's pin directory to: longer than any interface name
/// (15 characters) and without a dot (bpffs refuses dots), so it is never a pin directory.
fn detaching_name(interface: &str, pid: u32) -> String {
    format!("detaching-{interface}-{pid:010}")
}

/// Every `detaching-<interface>-*` directory under `<bpffs>/wgfence` (detach markers).
pub(super) fn detaching_dirs(bpffs: &Path, interface: &str) -> Result<Vec<PathBuf>> {
    let parent = bpffs.join("wgfence");
    let prefix = format!("detaching-{interface}-");
    let entries = match fs::read_dir(&parent) {
        Ok(entries) => entries,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(DataplaneError::Io {
                path: parent,
                source,
            })
        }
    };
    Ok(entries
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_prefix(&prefix))
                .is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(|e| e.path())
        .collect())
}

/// What [`remove_detaching`] found.
pub(super) struct Leftovers {
    /// One of them said the agent had added the clsact qdisc.
    pub(super) added_qdisc: bool,
}

/// Removes the detach markers an interrupted detach left (links first: the programs stop
/// before their maps go), except those an agent still holds locked: it lets go at its next
/// check, and the detach that renamed them waits for it.
pub(super) fn remove_detaching(bpffs: &Path, interface: &str) -> Result<Leftovers> {
    let markers = detaching_dirs(bpffs, interface)?;
    let mut added_qdisc = false;
    for marker in &markers {
        if lock::is_locked(marker)? {
            tracing::info!(
                marker = %marker.display(),
                "a detach marker is still locked by an agent that has not let go yet; left alone"
            );
            continue;
        }
        added_qdisc |= marker.join(tc::QDISC_MARKER).is_dir();
        unpin_all(marker)?;
        remove_marked_dir(marker)?;
    }
    Ok(Leftovers { added_qdisc })
}

/// Puts one of [`tc::MARKERS`] (an empty directory) in the pin directory.
pub(super) fn mark(pin_dir: &Path, name: &str) -> Result<()> {
    match fs::DirBuilder::new().mode(0o700).create(pin_dir.join(name)) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(()),
        Err(source) => Err(DataplaneError::Io {
            path: pin_dir.join(name),
            source,
        }),
    }
}

/// Removes the marks and then the directory itself.
fn remove_marked_dir(dir: &Path) -> Result<()> {
    for name in tc::MARKERS {
        remove_dir_if_exists(&dir.join(name))?;
    }
    remove_dir_if_exists(dir)
}

/// Deletes the agent's tc filters (both directions, either variant's programs); whether there
/// was any.
pub(super) fn remove_tc_filters(interface: &str, ifindex: u32) -> Result<bool> {
    let mut removed = false;
    for variant in &VARIANTS {
        for hook in &hooks(variant) {
            removed |= tc::remove_ours(interface, ifindex, hook.attach_type, hook.program)?;
        }
    }
    Ok(removed)
}
