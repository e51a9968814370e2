//! Who may change the state file. The state file is the policy: whoever can write it (or
//! replace it, or a directory or symlink on its way) decides what every peer may reach. The
//! agent runs as root and so would read a file anyone put there; it refuses to, unless told to.
//!
//! The path is resolved one component at a time, following symlinks the way the kernel does,
//! and every object on the way must be owned by root or by the agent's own user:
//!
//! - a directory must not be writable by group or others, unless it has the sticky bit (like
//!   `/tmp`, or the tmpfs root of a Kubernetes Secret or ConfigMap volume, mode 1777): in a
//!   sticky directory only an entry's owner can rename or remove it, and every entry the path
//!   goes through is checked to be root's or the agent's;
//! - a symlink's own mode means nothing; its owner and its directory are what count;
//! - the file must not be writable by group or others.
//!
//! A Kubernetes volume (`state.json -> ..data/state.json`, `..data -> ..2026_…`, files 0644
//! in 0755 directories, all root's, in a 1777 mount point) passes as it is.

use std::{
    collections::VecDeque,
    ffi::OsString,
    fs,
    io::{self, ErrorKind},
    os::unix::fs::MetadataExt as _,
    path::{Component, Path, PathBuf},
};

use crate::input::{self, InputError};

/// Symlinks followed before giving up (the kernel's limit is 40 too).
pub(crate) const MAX_SYMLINKS: usize = 40;

const S_ISVTX: u32 = 0o1000;
const GROUP_OTHER_WRITE: u32 = 0o022;

#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error(
        "{path} (mode {mode:04o}) is writable by {who}: anyone who can write it can change the \
         policy; make it 0{fixed:03o} (`chmod {fixed:o} {path}`), or pass --allow-insecure-state"
    )]
    Writable {
        path: PathBuf,
        mode: u32,
        who: &'static str,
        fixed: u32,
    },
    #[error(
        "{path} is owned by uid {uid}, neither root nor this agent's user: that user can change \
         the policy; `chown root {path}`, or pass --allow-insecure-state"
    )]
    Owner { path: PathBuf, uid: u32 },
    #[error("{path}: more than {MAX_SYMLINKS} symlinks")]
    SymlinkLoop { path: PathBuf },
    #[error("{path} changed while it was being checked; not read")]
    Changed { path: PathBuf },
    /// Not a regular file, too large, or not opened at all ([`crate::input`]).
    #[error(transparent)]
    Input(#[from] InputError),
    #[error("{path}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Checks that only root (or the agent's own user) can change what `path` resolves to. A path
/// that does not exist (yet) is fine as far as it goes: what exists of it is checked.
pub fn check_state_path(path: &Path) -> Result<(), TrustError> {
    check_path(path).map(drop)
}

/// Opens the state file the check approved, and no other: the file is opened first (as
/// [`input::open`] opens it: without blocking, a regular file of at most `limit` bytes), the
/// path checked, and the opened file must be the one the check reached (device and inode), so
/// a file swapped in between (in a sticky directory, say) is never read. A missing file is an
/// [`InputError::Io`] of kind `NotFound`.
pub fn open_trusted(path: &Path, limit: u64) -> Result<(fs::File, fs::Metadata), TrustError> {
    let (file, opened) = input::open(path, limit)?;
    if check_path(path)? != Some((opened.dev(), opened.ino())) {
        return Err(TrustError::Changed {
            path: path.to_owned(),
        });
    }
    Ok((file, opened))
}

/// Reads the state file the check approved, and no other ([`open_trusted`]), at most `limit`
/// bytes ([`input::read_opened`]).
pub fn read_trusted(path: &Path, limit: u64) -> Result<Vec<u8>, TrustError> {
    let (file, opened) = open_trusted(path, limit)?;
    Ok(input::read_opened(path, &file, &opened, limit)?)
}

/// The check; `Some((device, inode))` of the file the path reaches, `None` if it reaches none.
fn check_path(path: &Path) -> Result<Option<(u64, u64)>, TrustError> {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let absolute = if path.is_absolute() {
        path.to_owned()
    } else {
        std::env::current_dir()
            .map_err(|source| TrustError::Io {
                path: path.to_owned(),
                source,
            })?
            .join(path)
    };
    let mut queue: VecDeque<OsString> = VecDeque::new();
    let mut current = PathBuf::from("/");
    push_front(&mut queue, &absolute, &mut current);
    check_dir(&current, euid)?;
    let mut links = 0;
    while let Some(name) = queue.pop_front() {
        if name == ".." {
            current.pop();
            check_dir(&current, euid)?;
            continue;
        }
        let next = current.join(&name);
        let meta = match fs::symlink_metadata(&next) {
            Ok(meta) => meta,
            // Nothing there (yet): nothing anyone could have put there that we would read.
            Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::NotADirectory) => {
                return Ok(None)
            }
            Err(source) => return Err(TrustError::Io { path: next, source }),
        };
        check_owner(&next, &meta, euid)?;
        if meta.file_type().is_symlink() {
            links += 1;
            if links > MAX_SYMLINKS {
                return Err(TrustError::SymlinkLoop { path: absolute });
            }
            let target = fs::read_link(&next).map_err(|source| TrustError::Io {
                path: next.clone(),
                source,
            })?;
            if target.is_absolute() {
                check_dir(Path::new("/"), euid)?;
            }
            push_front(&mut queue, &target, &mut current);
        } else if meta.is_dir() {
            check_dir_meta(&next, &meta)?;
            current = next;
        } else {
            let mode = meta.mode() & 0o7777;
            if mode & GROUP_OTHER_WRITE != 0 {
                return Err(TrustError::Writable {
                    who: who(mode),
                    path: next,
                    mode,
                    fixed: mode & !GROUP_OTHER_WRITE & 0o777,
                });
            }
            // A file in the middle of the path ends it (the read fails with ENOTDIR).
            return Ok(queue.is_empty().then_some((meta.dev(), meta.ino())));
        }
    }
    Ok(None)
}

/// Puts `path`'s components in front of the queue; an absolute path restarts at `/`.
pub(crate) fn push_front(queue: &mut VecDeque<OsString>, path: &Path, current: &mut PathBuf) {
    let mut names = Vec::new();
    for component in path.components() {
        match component {
            Component::RootDir => {
                *current = PathBuf::from("/");
                names.clear();
            }
            Component::Prefix(_) | Component::CurDir => {}
            Component::ParentDir => names.push(OsString::from("..")),
            Component::Normal(name) => names.push(name.to_owned()),
        }
    }
    for name in names.into_iter().rev() {
        queue.push_front(name);
    }
}

fn check_dir(dir: &Path, euid: u32) -> Result<(), TrustError> {
    let meta = fs::metadata(dir).map_err(|source| TrustError::Io {
        path: dir.to_owned(),
        source,
    })?;
    check_owner(dir, &meta, euid)?;
    check_dir_meta(dir, &meta)
}

fn check_dir_meta(dir: &Path, meta: &fs::Metadata) -> Result<(), TrustError> {
    let mode = meta.mode() & 0o7777;
    if mode & GROUP_OTHER_WRITE != 0 && mode & S_ISVTX == 0 {
        return Err(TrustError::Writable {
            who: who(mode),
            path: dir.to_owned(),
            mode,
            fixed: mode & !GROUP_OTHER_WRITE & 0o777,
        });
    }
    Ok(())
}

fn check_owner(path: &Path, meta: &fs::Metadata, euid: u32) -> Result<(), TrustError> {
    let uid = meta.uid();
    if uid != 0 && uid != euid {
        return Err(TrustError::Owner {
            path: path.to_owned(),
            uid,
        });
    }
    Ok(())
}

fn who(mode: u32) -> &'static str {
    match (mode & 0o020 != 0, mode & 0o002 != 0) {
        (true, true) => "its group and all users",
        (true, false) => "its group",
        _ => "all users",
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::os::unix::fs::{symlink, PermissionsExt as _};

    use super::*;

    /// A fresh directory (0755) under the temporary directory, removed with everything in it
    /// when dropped.
    pub(crate) struct Dir(pub(crate) PathBuf);

    impl Dir {
        pub(crate) fn new(name: &str) -> Self {
            let path = std::env::temp_dir().join(format!(
                "wgfence-trust-{name}-{}-{:?}",
                std::process::id(),
                std::time::SystemTime::now()
            ));
            fs::create_dir(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
            Self(path)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn chmod(path: &Path, mode: u32) {
        fs::set_permissions(path, fs::Permissions::from_mode(mode))
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }

    fn write(path: &Path, mode: u32) {
        fs::write(path, "{}").unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        chmod(path, mode);
    }

    #[test]
    fn a_private_file_passes_and_a_writable_one_is_named_with_its_mode() {
        let d = Dir::new("file");
        let file = d.0.join("state.json");
        write(&file, 0o644);
        assert!(check_state_path(&file).is_ok());
        chmod(&file, 0o666);
        let e = check_state_path(&file).expect_err("0666 passed");
        let text = e.to_string();
        assert!(
            text.contains(&file.display().to_string()) && text.contains("mode 0666"),
            "{text}"
        );
        assert!(text.contains("its group and all users"), "{text}");
    }

    #[test]
    fn a_group_writable_directory_is_refused_unless_sticky() {
        let d = Dir::new("dir");
        let file = d.0.join("state.json");
        write(&file, 0o644);
        chmod(&d.0, 0o775);
        assert!(matches!(
            check_state_path(&file),
            Err(TrustError::Writable { ref path, mode: 0o775, .. }) if *path == d.0
        ));
        chmod(&d.0, 0o1777);
        assert!(check_state_path(&file).is_ok());
    }

    /// What the kubelet makes of a Secret or ConfigMap volume.
    #[test]
    fn a_kubernetes_volume_passes_and_its_symlink_targets_are_checked() {
        let d = Dir::new("kube");
        chmod(&d.0, 0o1777);
        let data = d.0.join("..2026_11_30_00_00_00.1");
        fs::create_dir(&data).unwrap();
        chmod(&data, 0o755);
        write(&data.join("state.json"), 0o644);
        symlink("..2026_11_30_00_00_00.1", d.0.join("..data")).unwrap();
        let state = d.0.join("state.json");
        symlink("..data/state.json", &state).unwrap();
        assert!(check_state_path(&state).is_ok());

        chmod(&data.join("state.json"), 0o646);
        assert!(matches!(
            check_state_path(&state),
            Err(TrustError::Writable { mode: 0o646, .. })
        ));
        chmod(&data.join("state.json"), 0o644);
        chmod(&data, 0o757);
        assert!(matches!(
            check_state_path(&state),
            Err(TrustError::Writable { ref path, .. }) if *path == data
        ));
    }

    #[test]
    fn read_trusted_reads_only_a_checked_file() {
        let dir = Dir::new("read");
        let file = dir.0.join("state.json");
        write(&file, 0o644);
        let limit = input::DEFAULT_MAX_STATE_BYTES;
        assert!(read_trusted(&file, limit).is_ok_and(|b| !b.is_empty()));
        assert!(matches!(
            read_trusted(&file, 1),
            Err(TrustError::Input(InputError::TooLarge { .. }))
        ));
        chmod(&file, 0o666);
        assert!(matches!(
            read_trusted(&file, limit),
            Err(TrustError::Writable { .. })
        ));
        let missing = dir.0.join("missing.json");
        assert!(matches!(
            read_trusted(&missing, limit),
            Err(TrustError::Input(e)) if e.io().is_some_and(|e| e.kind() == ErrorKind::NotFound)
        ));
    }

    #[test]
    fn a_missing_file_in_a_safe_directory_passes() {
        let d = Dir::new("missing");
        assert!(check_state_path(&d.0.join("nothing-here.json")).is_ok());
        assert!(check_state_path(&d.0.join("no-dir/state.json")).is_ok());
    }

    #[test]
    fn a_symlink_loop_is_an_error_not_a_hang() {
        let d = Dir::new("loop");
        let a = d.0.join("a");
        symlink("b", &a).unwrap();
        symlink("a", d.0.join("b")).unwrap();
        assert!(matches!(
            check_state_path(&a),
            Err(TrustError::SymlinkLoop { .. })
        ));
    }

    #[test]
    fn a_file_of_another_user_is_refused() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return; // chown needs root
        }
        let d = Dir::new("owner");
        let file = d.0.join("state.json");
        write(&file, 0o644);
        std::os::unix::fs::chown(&file, Some(65534), None).unwrap();
        assert!(matches!(
            check_state_path(&file),
            Err(TrustError::Owner { uid: 65534, .. })
        ));
    }
}
