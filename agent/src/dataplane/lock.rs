//! One agent per interface: `wgfence run` holds an exclusive `flock` on its pin directory
//! (`<bpffs>/wgfence/<interface>`, opened `O_DIRECTORY`) for its whole life. flock works on
//! bpffs, and containers that share the host's bpffs share the lock. A second agent fails to
//! take it before it touches the kernel, and says which process holds it (from `/proc/locks`).
//!
//! Who respects the lock: `run` takes it. `plan`, `status` and `monitor` only read and do not.
//! `detach` must work while an agent runs, so it never takes the agent's lock: it renames the
//! directory away (the agent sees its locked directory under the detach marker and lets go,
//! dropping its links and the lock), and waits until the agent has.

use std::{
    fs::{File, Metadata},
    io::{self, ErrorKind},
    os::{
        fd::AsRawFd as _,
        unix::fs::{MetadataExt as _, OpenOptionsExt as _},
    },
    path::Path,
};

use super::{DataplaneError, Result};

/// The exclusive lock on one pin directory, held until dropped (closing the descriptor
/// releases it).
#[derive(Debug)]
pub(crate) struct PinDirLock {
    _dir: File,
    dev: u64,
    ino: u64,
}

/// What [`PinDirLock::try_acquire`] found.
#[derive(Debug)]
pub(crate) enum Acquired {
    Locked(PinDirLock),
    /// The directory was replaced or moved between the open and the lock (a concurrent
    /// `wgfence detach`): the caller creates it again and retries.
    Moved,
}

impl PinDirLock {
    /// Opens `dir` and locks it without waiting: [`DataplaneError::Locked`], naming the holder,
    /// if another process holds it.
    pub(crate) fn try_acquire(dir: &Path) -> Result<Acquired> {
        let io_err = |source| DataplaneError::Io {
            path: dir.to_owned(),
            source,
        };
        let file = open_dir(dir).map_err(io_err)?;
        if !try_flock(&file).map_err(io_err)? {
            let meta = file.metadata().map_err(io_err)?;
            return Err(DataplaneError::Locked {
                path: dir.to_owned(),
                holder: holder(meta.dev(), meta.ino()),
            });
        }
        let meta = file.metadata().map_err(io_err)?;
        let lock = Self {
            _dir: file,
            dev: meta.dev(),
            ino: meta.ino(),
        };
        match std::fs::symlink_metadata(dir) {
            Ok(now) if lock.is(&now) => Ok(Acquired::Locked(lock)),
            Ok(_) => Ok(Acquired::Moved),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(Acquired::Moved),
            Err(source) => Err(io_err(source)),
        }
    }

    /// Whether `meta` is the locked directory (the same inode, wherever it is now).
    pub(crate) fn is(&self, meta: &Metadata) -> bool {
        meta.dev() == self.dev && meta.ino() == self.ino
    }
}

/// Whether some process holds the lock of `dir` (an agent that has not let go of it yet).
/// A directory that is gone is not locked.
pub(crate) fn is_locked(dir: &Path) -> Result<bool> {
    let io_err = |source| DataplaneError::Io {
        path: dir.to_owned(),
        source,
    };
    let file = match open_dir(dir) {
        Ok(file) => file,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(false),
        Err(source) => return Err(io_err(source)),
    };
    // Taken for an instant if free; closing the file releases it.
    Ok(!try_flock(&file).map_err(io_err)?)
}

/// The pid holding the lock of `dir`, if it is locked and the holder is visible from here.
pub(crate) fn holder_of(dir: &Path) -> Option<u32> {
    let meta = std::fs::symlink_metadata(dir).ok()?;
    holder(meta.dev(), meta.ino())
}

fn open_dir(dir: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(dir)
}

/// `flock(LOCK_EX | LOCK_NB)`: whether the lock was taken.
fn try_flock(file: &File) -> io::Result<bool> {
    // SAFETY: flock on a descriptor this function borrows for the call.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

/// The pid of the process holding a lock on the inode, from `/proc/locks`; `None` when no
/// holder is visible (another pid namespace hides it).
fn holder(dev: u64, ino: u64) -> Option<u32> {
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    find_holder(&locks, libc::major(dev), libc::minor(dev), ino)
}

/// Parses `/proc/locks` (`1: FLOCK  ADVISORY  WRITE 1234 00:1d:5678 0 EOF`; the device as
/// hex major:minor, the inode in decimal; `->` marks a waiter, not a holder).
fn find_holder(locks: &str, major: u32, minor: u32, ino: u64) -> Option<u32> {
    locks.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.get(1) == Some(&"->") || fields.get(1) != Some(&"FLOCK") {
            return None;
        }
        let pid: u32 = fields.get(4)?.parse().ok()?;
        let mut id = fields.get(5)?.split(':');
        let maj = u32::from_str_radix(id.next()?, 16).ok()?;
        let min = u32::from_str_radix(id.next()?, 16).ok()?;
        let inode: u64 = id.next()?.parse().ok()?;
        (maj == major && min == minor && inode == ino && pid != 0).then_some(pid)
    })
}

/// "pid 1234", or "pid unknown" when the holder is not visible from here.
pub(crate) fn describe_holder(holder: Option<u32>) -> String {
    holder.map_or_else(|| "pid unknown".to_owned(), |pid| format!("pid {pid}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_locks_lines_name_the_holder_of_that_inode_only() {
        let locks = "\
1: POSIX  ADVISORY  WRITE 77 00:1d:42 0 EOF
2: FLOCK  ADVISORY  WRITE 4321 00:1d:99 0 EOF
3: FLOCK  ADVISORY  WRITE 1234 00:1d:42 0 EOF
3: -> FLOCK  ADVISORY  WRITE 999 00:1d:42 0 EOF
4: FLOCK  ADVISORY  WRITE 0 fd:01:42 0 EOF
";
        assert_eq!(find_holder(locks, 0, 0x1d, 42), Some(1234));
        assert_eq!(find_holder(locks, 0, 0x1d, 99), Some(4321));
        assert_eq!(find_holder(locks, 0, 0x1d, 7), None);
        // A holder in another pid namespace shows as 0: unknown, not pid 0.
        assert_eq!(find_holder(locks, 0xfd, 1, 42), None);
    }

    #[test]
    fn a_second_lock_on_a_directory_is_refused_naming_this_process() {
        let dir = std::env::temp_dir().join(format!("wgfence-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let first = PinDirLock::try_acquire(&dir).unwrap();
        assert!(matches!(first, Acquired::Locked(_)));
        assert!(is_locked(&dir).unwrap());
        match PinDirLock::try_acquire(&dir) {
            Err(DataplaneError::Locked { holder, .. }) => {
                assert_eq!(holder, Some(std::process::id()));
            }
            other => panic!("a second lock was not refused: {other:?}"),
        }
        drop(first);
        assert!(!is_locked(&dir).unwrap());
        let again = PinDirLock::try_acquire(&dir);
        assert!(matches!(again, Ok(Acquired::Locked(_))), "{again:?}");
        drop(again);
        let _ = std::fs::remove_dir(&dir);
    }
}
