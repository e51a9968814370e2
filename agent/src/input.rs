//! The one way a state file is opened and read, by every command (`check`, `plan`, `verify`,
//! `explain`, `status`, `monitor`) and by the agent (its start-up read and every re-read,
//! trusted or `--allow-insecure-state`).
//!
//! A state file is a regular file of bounded size, and nothing else is read:
//!
//! - it is opened `O_NONBLOCK | O_CLOEXEC`, so opening a FIFO without a writer (or a device
//!   that would block) returns at once instead of hanging the agent's loop;
//! - the opened file is `fstat`ed, and anything but a regular file (a FIFO, a socket, a
//!   character or block device such as `/dev/zero`, a directory) is refused, naming the path
//!   and what it is, without a byte read;
//! - a file larger than the limit (`--max-state-bytes`, [`DEFAULT_MAX_STATE_BYTES`]) is
//!   refused before it is read, and a file that grows past it between the `fstat` and the read
//!   is refused too: at most `limit + 1` bytes are ever read.
//!
//! So a control plane that writes a runaway file (or an operator who points `--state` at the
//! wrong thing) costs the agent at most the limit in memory, and the last good state stays
//! applied.

use std::{
    fs::{File, Metadata},
    io::{self, Read as _},
    os::unix::fs::{FileTypeExt as _, OpenOptionsExt as _},
    path::{Path, PathBuf},
};

/// The bytes a state file may take per peer by default, with headroom. A peer with every
/// field at a realistic length (a 64-character name, both addresses, an IPv6 endpoint, a
/// pre-shared key, a keepalive, a mode and a window) and eight rules with ports, types and
/// excepted prefixes takes about 1.4 KiB pretty-printed with two-space indentation (about 1 KiB
/// compact); the benchmarks' mix averages 450 bytes (a 59 MiB file at 131,072 peers).
pub const MAX_STATE_BYTES_PER_PEER: u64 = 2048;

/// The default `--max-state-bytes`: the maps' capacity ([`wgfence_common::MAX_PEERS`],
/// 131,072 peers) at [`MAX_STATE_BYTES_PER_PEER`]: 256 MiB (268,435,456 bytes).
pub const DEFAULT_MAX_STATE_BYTES: u64 =
    wgfence_common::MAX_PEERS as u64 * MAX_STATE_BYTES_PER_PEER;

/// Why a state file was not read.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    /// Opening, `fstat` or reading failed (a missing file is of kind `NotFound`).
    #[error("{path}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} is a {kind}, not a regular file: refused without reading it")]
    NotRegular { path: PathBuf, kind: &'static str },
    #[error(
        "{path} holds {size} bytes, more than the limit of {limit} (--max-state-bytes): \
         refused without reading it"
    )]
    TooLarge {
        path: PathBuf,
        size: u64,
        limit: u64,
    },
    #[error(
        "{path} grew past the limit of {limit} bytes (--max-state-bytes) while it was read: \
         refused"
    )]
    Grew { path: PathBuf, limit: u64 },
}

impl InputError {
    /// The I/O error behind it, if it is one (not a refusal).
    pub fn io(&self) -> Option<&io::Error> {
        match self {
            Self::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Opens `path` without blocking and checks what the descriptor is: a regular file of at most
/// `limit` bytes. Returns the file and its metadata (of the opened file, not of the path).
pub fn open(path: &Path, limit: u64) -> Result<(File, Metadata), InputError> {
    let io_err = |source| InputError::Io {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(io_err)?;
    let meta = file.metadata().map_err(io_err)?;
    let kind = meta.file_type();
    if !kind.is_file() {
        let kind = if kind.is_fifo() {
            "FIFO (named pipe)"
        } else if kind.is_char_device() {
            "character device"
        } else if kind.is_block_device() {
            "block device"
        } else if kind.is_socket() {
            "socket"
        } else if kind.is_dir() {
            "directory"
        } else {
            "special file"
        };
        return Err(InputError::NotRegular {
            path: path.to_owned(),
            kind,
        });
    }
    if meta.len() > limit {
        return Err(InputError::TooLarge {
            path: path.to_owned(),
            size: meta.len(),
            limit,
        });
    }
    Ok((file, meta))
}

/// Reads a file [`open`] returned: at most `limit` bytes, refused if more arrive (it grew
/// after the `fstat`).
pub fn read_opened(
    path: &Path,
    file: &File,
    meta: &Metadata,
    limit: u64,
) -> Result<Vec<u8>, InputError> {
    let expected = usize::try_from(meta.len().min(limit)).unwrap_or(0);
    let mut bytes = Vec::with_capacity(expected);
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|source| InputError::Io {
            path: path.to_owned(),
            source,
        })?;
    if u64::try_from(bytes.len()).unwrap_or(u64::MAX) > limit {
        return Err(InputError::Grew {
            path: path.to_owned(),
            limit,
        });
    }
    Ok(bytes)
}

/// Opens and reads the state file at `path` ([`open`], [`read_opened`]).
pub fn read(path: &Path, limit: u64) -> Result<Vec<u8>, InputError> {
    let (file, meta) = open(path, limit)?;
    read_opened(path, &file, &meta, limit)
}

#[cfg(test)]
mod tests {
    use std::{
        ffi::CString,
        io::Write as _,
        os::unix::ffi::OsStrExt as _,
        sync::mpsc,
        time::{Duration, Instant},
    };

    use super::*;
    use crate::trust::tests::Dir;

    /// `read(path, limit)` on a thread: its result within five seconds, or a panic naming the
    /// hang (the test must fail, not hang, where the read blocks).
    fn read_promptly(path: &Path, limit: u64) -> Result<Vec<u8>, InputError> {
        let (tx, rx) = mpsc::channel();
        let owned = path.to_owned();
        std::thread::spawn(move || {
            let _ = tx.send(read(&owned, limit));
        });
        let start = Instant::now();
        match rx.recv_timeout(Duration::from_secs(5)) {
            Ok(result) => result,
            Err(_) => panic!(
                "reading {} did not return within {:?}",
                path.display(),
                start.elapsed()
            ),
        }
    }

    fn mkfifo(path: &Path) {
        let c = CString::new(path.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo");
    }

    #[test]
    fn a_fifo_without_a_writer_is_refused_at_once() {
        let dir = Dir::new("fifo");
        let fifo = dir.0.join("state.json");
        mkfifo(&fifo);
        let e = read_promptly(&fifo, DEFAULT_MAX_STATE_BYTES).expect_err("a FIFO was read");
        assert!(
            matches!(e, InputError::NotRegular { kind, .. } if kind.starts_with("FIFO")),
            "{e}"
        );
        let text = e.to_string();
        assert!(text.contains(&fifo.display().to_string()), "{text}");
    }

    #[test]
    fn dev_zero_and_a_directory_are_refused() {
        let e = read_promptly(Path::new("/dev/zero"), DEFAULT_MAX_STATE_BYTES)
            .expect_err("/dev/zero was read");
        assert!(
            matches!(
                e,
                InputError::NotRegular {
                    kind: "character device",
                    ..
                }
            ),
            "{e}"
        );
        let dir = Dir::new("dir");
        let e = read_promptly(&dir.0, DEFAULT_MAX_STATE_BYTES).expect_err("a directory was read");
        assert!(
            matches!(
                e,
                InputError::NotRegular {
                    kind: "directory",
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn a_file_over_the_limit_is_refused_and_one_at_it_is_read() {
        let dir = Dir::new("big");
        let path = dir.0.join("state.json");
        std::fs::write(&path, vec![b' '; 1001]).unwrap();
        let e = read_promptly(&path, 1000).expect_err("a file over the limit was read");
        assert!(
            matches!(
                e,
                InputError::TooLarge {
                    size: 1001,
                    limit: 1000,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("--max-state-bytes"), "{e}");
        assert_eq!(read_promptly(&path, 1001).map(|b| b.len()).ok(), Some(1001));
    }

    /// Opened (and `fstat`ed) at 100 bytes, then grown to 10,000 before the read: the read
    /// stops one byte past the limit and refuses the file.
    #[test]
    fn a_file_that_grows_past_the_limit_during_the_read_is_refused() {
        let dir = Dir::new("grows");
        let path = dir.0.join("state.json");
        std::fs::write(&path, vec![b' '; 100]).unwrap();
        let (file, meta) = open(&path, 1000).expect("open");
        let mut writer = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        writer.write_all(&vec![b' '; 9_900]).unwrap();
        let e = read_opened(&path, &file, &meta, 1000).expect_err("the grown file was read");
        assert!(matches!(e, InputError::Grew { limit: 1000, .. }), "{e}");
    }

    #[test]
    fn a_missing_file_is_an_io_error_of_kind_not_found() {
        let dir = Dir::new("missing");
        let e = read(&dir.0.join("nothing.json"), 10).expect_err("read");
        assert_eq!(e.io().map(io::Error::kind), Some(io::ErrorKind::NotFound));
    }

    #[test]
    fn the_default_limit_is_the_capacity_at_two_kib_a_peer() {
        assert_eq!(DEFAULT_MAX_STATE_BYTES, 268_435_456);
    }
}
