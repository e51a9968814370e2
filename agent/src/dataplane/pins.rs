//! The pin directory on bpffs: bpffs mounted, the directory created private and locked (one
//! agent per interface), and its pins removed.

use std::{
    fs,
    io::{self, ErrorKind},
    os::unix::fs::DirBuilderExt as _,
    path::{Path, PathBuf},
};

use aya::programs::links::{FdLink, PinnedLink};

use super::{
    tc, Acquired, DataplaneError, PinDirLock, Result, BPF_FS_MAGIC, LINK_PIN_EGRESS,
    LINK_PIN_INGRESS,
};

pub(super) fn ensure_bpffs(path: &Path) -> Result<()> {
    use std::os::unix::ffi::OsStrExt as _;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        DataplaneError::NotBpffs {
            path: path.to_owned(),
        }
    })?;
    // SAFETY: statfs writes into the zeroed struct; c_path is NUL-terminated.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c_path.as_ptr(), &mut stat) } != 0 {
        return Err(DataplaneError::Io {
            path: path.to_owned(),
            source: io::Error::last_os_error(),
        });
    }
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between libcs
    if stat.f_type as i64 != BPF_FS_MAGIC {
        return Err(DataplaneError::NotBpffs {
            path: path.to_owned(),
        });
    }
    Ok(())
}

/// Creates the pin directory (and its parents) readable by root only, and tightens
/// `<bpffs>/wgfence` and the interface's directory to 0700 if they were adopted with a looser
/// mode: whoever can open a pin can change the policy (the pins are the maps), and whoever can
/// write to the directories can replace them before the next start adopts them. A directory
/// owned by another user is refused: that user could have put anything in it.
fn create_private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| DataplaneError::Io {
            path: dir.to_owned(),
            source,
        })?;
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    for d in [dir.parent(), Some(dir)].into_iter().flatten() {
        let io_err = |source| DataplaneError::Io {
            path: d.to_owned(),
            source,
        };
        let meta = fs::symlink_metadata(d).map_err(io_err)?;
        if !meta.is_dir() || (meta.uid() != 0 && meta.uid() != euid) {
            return Err(DataplaneError::UnsafePinDir {
                path: d.to_owned(),
                uid: meta.uid(),
            });
        }
        let mode = meta.mode() & 0o7777;
        if mode & 0o077 != 0 {
            fs::set_permissions(d, fs::Permissions::from_mode(0o700)).map_err(io_err)?;
            tracing::warn!(
                path = %d.display(),
                mode = format!("{mode:04o}"),
                "pin directory was accessible to other users; tightened to 0700"
            );
        }
    }
    Ok(())
}

/// Creates the pin directory (see [`create_private_dir`]) and takes its lock: another agent's
/// lock is [`DataplaneError::Locked`].
pub(super) fn lock_pin_dir(dir: &Path) -> Result<PinDirLock> {
    // A concurrent detach may rename the directory between the open and the lock: again.
    for _ in 0..5 {
        create_private_dir(dir)?;
        if let Acquired::Locked(lock) = PinDirLock::try_acquire(dir)? {
            return Ok(lock);
        }
    }
    Err(DataplaneError::Io {
        path: dir.to_owned(),
        source: io::Error::other("the directory was moved away five times while locking it"),
    })
}

/// Removes every pin in `dir`, links first; the ids of the links that were pinned there.
pub(super) fn unpin_all(dir: &Path) -> Result<Vec<u32>> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        // Another detach finished it meanwhile.
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(DataplaneError::Io {
                path: dir.to_owned(),
                source,
            })
        }
    };
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    let link_index = |p: &PathBuf| {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        [LINK_PIN_INGRESS, LINK_PIN_EGRESS]
            .iter()
            .position(|link| *link == name)
    };
    paths.sort_by_key(|p| link_index(p).unwrap_or(usize::MAX));
    let mut links = Vec::new();
    for path in paths {
        if tc::MARKERS.contains(
            &path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default(),
        ) {
            // Read and removed by the caller once the filters are gone.
            continue;
        }
        if link_index(&path).is_some() {
            // Read before the pin goes, to wait for the link itself afterwards.
            if let Ok(info) = PinnedLink::from_pin(&path)
                .map(FdLink::from)
                .and_then(|l| l.info())
            {
                links.push(info.id());
            }
        }
        remove_if_exists(&path)?;
    }
    Ok(links)
}

pub(super) fn remove_dir_if_exists(dir: &Path) -> Result<()> {
    match fs::remove_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(source) => Err(DataplaneError::Io {
            path: dir.to_owned(),
            source,
        }),
    }
}

/// Removes the pin at `path`, or the directory of pins there (the policy tries').
pub(super) fn remove_if_exists(path: &Path) -> Result<()> {
    let removed = match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => fs::remove_dir_all(path),
        _ => fs::remove_file(path),
    };
    match removed {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(source) => Err(DataplaneError::Io {
            path: path.to_owned(),
            source,
        }),
    }
}
