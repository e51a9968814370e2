//! The state file, watched through every directory its path resolves through.
//!
//! Kubernetes updates a Secret or ConfigMap volume by writing a new timestamped directory and
//! swapping the `..data` symlink; editors write in place or write a temporary file and rename
//! it; `--state` may be a symlink into another directory, or go through a symlinked directory
//! (`/etc/wg/current/state.json`) that a deploy tool swaps. Watching the file itself misses the
//! swap and the rename (the watch follows the old inode), and watching only the directory of
//! `--state` misses every change behind a symlink.
//!
//! So the path is resolved the way the kernel (and [`crate::trust`]) resolves it, one
//! component at a time, following symlinks, and every directory in which a component is looked
//! up is watched, for the names looked up in it: the link's directory for a symlink, the
//! target's directory for the file, each ancestor for the next component. An event about one
//! of those names (or about a watched directory itself) means "read the file again"; anything
//! else in those directories (other files in `/tmp`, our own reads of the file) is ignored.
//! Before every read the path is resolved again and the watches follow: a swapped link moves
//! the watch to its new target before the file is read, so no later change is missed.
//!
//! There is no debounce: a revocation must reach the kernel as fast as it can. The first event
//! is reported at once (a kubelet `..data` swap, a rename over the file and a write closed
//! in place are each complete when their event arrives); events that arrive while the daemon
//! applies a change are coalesced into one more read. Only a write the writer has not closed
//! yet (the file is still being written: `IN_MODIFY` without `IN_CLOSE_WRITE`, or a regular
//! file just created) waits for its close, or for [`SETTLE`] without another event, so the
//! agent does not read half a file and reject it. A read that finds the same bytes as last
//! time costs nothing more.
//!
//! [`StateFile`] is the read itself: a regular file of at most `--max-state-bytes`, opened
//! without blocking ([`crate::input`]), checked by [`crate::trust`] unless the operator allowed
//! an insecure state file.
//!
//! The file is one of two sources ([`Watch`] and [`Reader`]): the other is one Secret watched
//! through the Kubernetes API ([`kubernetes`]). The daemon waits on a [`Watch`] and reads a
//! [`Snapshot`] (state bytes and a label naming where they came from) or a [`ReadError`]
//! (missing, not listed yet, unreadable) from a [`Reader`]; everything after the read (the
//! pipeline, the plan, the apply, readiness and metrics) is the same for both.

pub mod kubernetes;

use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    ffi::OsString,
    os::unix::fs::{FileExt as _, MetadataExt as _},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::Duration,
};

use notify::{
    event::{AccessKind, AccessMode, CreateKind, ModifyKind},
    EventKind, RecommendedWatcher, RecursiveMode, Watcher as _,
};
use tokio::sync::Notify;

use crate::{
    input::{self, InputError},
    state::StateBytes,
    trust::{self, TrustError},
};

/// How long a write that was not closed (the writer may still be writing) waits for another
/// event before the file is read anyway.
pub const SETTLE: Duration = Duration::from_millis(50);

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("the current directory, to resolve the state file's relative path")]
    CurrentDir(#[source] std::io::Error),
    #[error("watching {dir}")]
    Watch {
        dir: PathBuf,
        #[source]
        source: notify::Error,
    },
}

/// The directories a resolution of the path looked names up in: each with its identity
/// (device, inode) and the names that matter there.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Lookups {
    dirs: BTreeMap<PathBuf, Dir>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Dir {
    id: Option<(u64, u64)>,
    names: BTreeSet<OsString>,
}

impl Lookups {
    /// Resolves `path` as the kernel does (see [`crate::trust`]), recording each lookup.
    /// Stops where the path stops resolving (a missing component, a file in the middle, a
    /// symlink loop): the directory where it stopped is watched for the missing name.
    fn resolve(path: &Path) -> Self {
        let mut lookups = Self::default();
        let mut queue: VecDeque<OsString> = VecDeque::new();
        let mut current = PathBuf::from("/");
        trust::push_front(&mut queue, path, &mut current);
        let mut links = 0;
        while let Some(name) = queue.pop_front() {
            if name == ".." {
                // `..` of a directory changes only when the directory moves: a watched
                // directory's own events cover that.
                lookups.add(&current, None);
                current.pop();
                continue;
            }
            lookups.add(&current, Some(name.clone()));
            let next = current.join(&name);
            let Ok(meta) = std::fs::symlink_metadata(&next) else {
                break;
            };
            if meta.file_type().is_symlink() {
                links += 1;
                let Ok(target) = std::fs::read_link(&next) else {
                    break;
                };
                if links > trust::MAX_SYMLINKS {
                    break;
                }
                trust::push_front(&mut queue, &target, &mut current);
            } else if meta.is_dir() {
                current = next;
            } else {
                break;
            }
        }
        lookups
    }

    fn add(&mut self, dir: &Path, name: Option<OsString>) {
        let entry = self.dirs.entry(dir.to_owned()).or_insert_with(|| Dir {
            id: std::fs::metadata(dir).ok().map(|m| (m.dev(), m.ino())),
            names: BTreeSet::new(),
        });
        entry.names.extend(name);
    }

    /// Whether `event` may change what the path resolves to or what the file holds, and if so
    /// how soon the file may be read.
    fn concerns(&self, event: &notify::Event) -> Option<Urgency> {
        let urgency = match event.kind {
            // Opening, reading and closing a file unchanged (the agent's own reads do that).
            EventKind::Access(AccessKind::Close(AccessMode::Write)) => Urgency::Now,
            EventKind::Access(_) => return None,
            // Written, and maybe not finished: its close (or a quiet SETTLE) says when.
            EventKind::Modify(ModifyKind::Data(_)) => Urgency::Settle,
            // A regular file created is written next; a symlink is complete at once.
            EventKind::Create(CreateKind::File) => match event.paths.first() {
                Some(p) if std::fs::symlink_metadata(p).is_ok_and(|m| !m.is_symlink()) => {
                    Urgency::Settle
                }
                _ => Urgency::Now,
            },
            _ => Urgency::Now,
        };
        if event.paths.is_empty() || event.need_rescan() {
            return Some(Urgency::Now);
        }
        let concerned = event.paths.iter().any(|p| {
            self.dirs.contains_key(p)
                || match (p.parent(), p.file_name()) {
                    (Some(dir), Some(name)) => {
                        self.dirs.get(dir).is_some_and(|d| d.names.contains(name))
                    }
                    _ => true,
                }
        });
        concerned.then_some(urgency)
    }

    /// Both sets' directories and names: what to listen for while the watches move.
    fn union(&self, other: &Self) -> Self {
        let mut both = self.clone();
        for (path, dir) in &other.dirs {
            let entry = both.dirs.entry(path.clone()).or_default();
            entry.names.extend(dir.names.iter().cloned());
        }
        both
    }
}

/// How soon a change may be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Urgency {
    /// The change is complete: read now.
    Now,
    /// A write that may go on: read at its close, or after [`SETTLE`] without another event.
    Settle,
}

/// What the watcher's callback has seen since the last report, and the wake-up for
/// [`StateSource::changed`]. Flags, not a queue: any number of events is one read.
#[derive(Default)]
struct Signal {
    now: AtomicBool,
    settle: AtomicBool,
    wake: Notify,
}

impl Signal {
    fn raise(&self, urgency: Urgency) {
        match urgency {
            Urgency::Now => self.now.store(true, Ordering::Release),
            Urgency::Settle => self.settle.store(true, Ordering::Release),
        }
        // Stores a permit when nobody waits, so a raise just before the wait is not lost.
        self.wake.notify_one();
    }
}

pub struct StateSource {
    path: PathBuf,
    signal: Arc<Signal>,
    /// A write that was not closed was seen and not yet reported: `changed` was cancelled
    /// while waiting for it to settle (the daemon's `select!` drops it whenever another branch
    /// wins), and the next call goes on waiting rather than forget it.
    settling: bool,
    /// What is watched now.
    watched: Lookups,
    /// What the watcher's callback listens for (`watched`, or more while the watches move).
    filter: Arc<Mutex<Lookups>>,
    watcher: RecommendedWatcher,
}

impl StateSource {
    /// Starts watching every directory `path` resolves through.
    pub fn watch(path: &Path) -> Result<Self, SourceError> {
        let path = absolute(path)?;
        let signal = Arc::new(Signal::default());
        let raised = Arc::clone(&signal);
        let filter = Arc::new(Mutex::new(Lookups::default()));
        let listening = Arc::clone(&filter);
        let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            let urgency = match &event {
                Ok(event) => listening
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .concerns(event),
                Err(e) => {
                    // The next read tells what is there.
                    tracing::warn!(error = %crate::error_chain(e), "state file watch");
                    Some(Urgency::Now)
                }
            };
            if let Some(urgency) = urgency {
                raised.raise(urgency);
            }
        })
        .map_err(|source| SourceError::Watch {
            dir: path.clone(),
            source,
        })?;
        let mut source = Self {
            path,
            signal,
            settling: false,
            watched: Lookups::default(),
            filter,
            watcher,
        };
        source.rearm()?;
        Ok(source)
    }

    /// The directories watched now.
    #[cfg(test)]
    pub fn watched_dirs(&self) -> impl Iterator<Item = &Path> {
        self.watched.dirs.keys().map(PathBuf::as_path)
    }

    /// Waits for the next change on the path, then moves the watches to where the path
    /// resolves now. The file is read after this returns, so a change after the move is seen
    /// by the new watches, and one before it by the read. A complete change is reported at
    /// once; everything seen since the last report is one report.
    ///
    /// Cancel-safe: dropped at any await point (as `select!` does when another branch wins),
    /// no change is lost; the next call picks up where this one stopped.
    pub async fn changed(&mut self) {
        loop {
            if self.signal.now.swap(false, Ordering::AcqRel) {
                self.signal.settle.store(false, Ordering::Release);
                break;
            }
            if self.signal.settle.swap(false, Ordering::AcqRel) {
                self.settling = true;
            }
            if self.settling {
                // A write in progress: its close, or SETTLE of quiet.
                if tokio::time::timeout(SETTLE, self.signal.wake.notified())
                    .await
                    .is_err()
                {
                    break;
                }
            } else {
                self.signal.wake.notified().await;
            }
        }
        self.settling = false;
        if let Err(e) = self.rearm() {
            // The periodic resync still reads the file.
            tracing::warn!(error = %crate::error_chain(&e), "following the state file's path");
        }
    }

    /// Resolves the path again and moves the watches to the directories it goes through now.
    fn rearm(&mut self) -> Result<(), SourceError> {
        let next = Lookups::resolve(&self.path);
        // Listen for both while the watches move, so nothing in between is dropped.
        *self.filter.lock().unwrap_or_else(PoisonError::into_inner) = self.watched.union(&next);
        for (dir, old) in &self.watched.dirs {
            if next.dirs.get(dir).is_none_or(|new| new.id != old.id) {
                // Gone already if the directory was removed: nothing to undo then.
                let _ = self.watcher.unwatch(dir);
            }
        }
        // Every directory is watched again, also those watched already (that only adds to
        // the same watch): notify forgets a watch when its directory is renamed or removed in
        // a watched parent, and one moved away and back within a burst looks unchanged here.
        let mut result = Ok(());
        let mut watched = Lookups::default();
        for (dir, new) in &next.dirs {
            match self.watcher.watch(dir, RecursiveMode::NonRecursive) {
                Ok(()) => {
                    watched.dirs.insert(dir.clone(), new.clone());
                }
                // Removed since it was resolved: its parent's watch reports that.
                Err(e) if matches!(e.kind, notify::ErrorKind::PathNotFound) => {}
                Err(source) => {
                    if result.is_ok() {
                        result = Err(SourceError::Watch {
                            dir: dir.clone(),
                            source,
                        });
                    }
                }
            }
        }
        if watched != self.watched {
            tracing::debug!(
                path = %self.path.display(),
                dirs = ?watched.dirs.keys().collect::<Vec<_>>(),
                "watching the state file's path"
            );
        }
        self.filter
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone_from(&watched);
        self.watched = watched;
        result
    }
}

fn absolute(path: &Path) -> Result<PathBuf, SourceError> {
    if path.is_absolute() {
        Ok(path.to_owned())
    } else {
        Ok(std::env::current_dir()
            .map_err(SourceError::CurrentDir)?
            .join(path))
    }
}

/// The state file, read the one way the agent reads it: a regular file of at most
/// `max_bytes` ([`crate::input`]), checked by [`crate::trust`] (only root may change what the
/// path leads to) unless the operator allowed an insecure file.
#[derive(Debug, Clone)]
pub struct StateFile {
    path: PathBuf,
    trusted_only: bool,
    max_bytes: u64,
}

/// Why the state file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("state file missing")]
    Missing,
    #[error("state file unreadable: {0}")]
    Unreadable(std::io::Error),
    #[error("state file not trusted")]
    Untrusted(#[source] TrustError),
    /// Not a regular file, or larger than `--max-state-bytes`: a verdict on the file, like a
    /// rejected state (the last good state stays applied).
    #[error("state file refused: {0}")]
    Refused(InputError),
    /// Replaced between the open and the check (a volume update in progress): not a verdict
    /// on the file; read it again.
    #[error(transparent)]
    Replaced(TrustError),
    /// The Secret is gone from the API (deleted): `source_object_missing`.
    #[error("{0}")]
    ObjectMissing(String),
    /// No complete list of the Secret yet (the API server unreachable, say).
    #[error("{0}")]
    NotListed(String),
    /// The Secret has no such key: an invalid state.
    #[error("{0}")]
    NoKey(String),
}

impl StateFile {
    /// `trusted_only`: read the file only if [`crate::trust`] approves its path; `max_bytes`:
    /// `--max-state-bytes`.
    pub fn new(path: &Path, trusted_only: bool, max_bytes: u64) -> Self {
        Self {
            path: path.to_owned(),
            trusted_only,
            max_bytes,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's bytes.
    pub fn read(&self) -> Result<Vec<u8>, ReadError> {
        if !self.trusted_only {
            return input::read(&self.path, self.max_bytes).map_err(input_error);
        }
        trust::read_trusted(&self.path, self.max_bytes).map_err(trust_error)
    }

    /// Opens the file to be read in pieces ([`OpenState`]), checked as [`Self::read`] checks.
    /// The pieces are read up to the length the file had when it was opened (at most
    /// `max_bytes`): a file that grows meanwhile is read again on its change's event.
    pub fn open(&self) -> Result<OpenState, ReadError> {
        let (file, opened) = if self.trusted_only {
            trust::open_trusted(&self.path, self.max_bytes).map_err(trust_error)?
        } else {
            input::open(&self.path, self.max_bytes).map_err(input_error)?
        };
        let len = usize::try_from(opened.len()).map_err(|e| io_error(std::io::Error::other(e)))?;
        Ok(OpenState {
            file,
            len,
            version: version(&opened),
        })
    }
}

fn io_error(e: std::io::Error) -> ReadError {
    if e.kind() == std::io::ErrorKind::NotFound {
        ReadError::Missing
    } else {
        ReadError::Unreadable(e)
    }
}

fn input_error(e: InputError) -> ReadError {
    match e {
        InputError::Io { source, .. } => io_error(source),
        e => ReadError::Refused(e),
    }
}

fn trust_error(e: TrustError) -> ReadError {
    match e {
        TrustError::Io { source, .. } => io_error(source),
        TrustError::Input(e) => input_error(e),
        e @ TrustError::Changed { .. } => ReadError::Replaced(e),
        e => ReadError::Untrusted(e),
    }
}

/// How much of the file a read in pieces holds at once: small enough to stay in the CPU's
/// cache (and to cost no page faults of a buffer the size of the file), large enough that the
/// reads are few.
const PIECE: usize = 256 * 1024;

/// The state file, open, read in pieces by the pipeline: its length is the one it had when it
/// was opened (a file that changes while it is read is read again on the change's event; one
/// that shrinks fails the read).
#[derive(Debug)]
pub struct OpenState {
    file: std::fs::File,
    len: usize,
    /// Length, modification and change times when it was opened.
    version: (u64, i64, i64, i64, i64),
}

fn version(meta: &std::fs::Metadata) -> (u64, i64, i64, i64, i64) {
    (
        meta.len(),
        meta.mtime(),
        meta.mtime_nsec(),
        meta.ctime(),
        meta.ctime_nsec(),
    )
}

impl OpenState {
    /// Whether the file was written since it was opened, as far as its length and times tell
    /// (so its pieces, read at different times, may be of different writes): then what was read
    /// of it is not taken for the file, and it is read again. An error reading its metadata
    /// counts as written. A write these miss (the same length, within the clock's tick) still
    /// has its event, which reads the file again.
    pub fn written_since_open(&self) -> bool {
        self.file
            .metadata()
            .map_or(true, |meta| version(&meta) != self.version)
    }
}

impl StateBytes for OpenState {
    type Error = std::io::Error;

    fn len(&self) -> usize {
        self.len
    }

    fn each_piece(&self, f: &mut dyn FnMut(&[u8])) -> std::io::Result<()> {
        let mut piece = vec![0; PIECE.min(self.len)];
        let mut at = 0;
        while at < self.len {
            let n = PIECE.min(self.len - at);
            self.read_at(at, &mut piece[..n])?;
            f(&piece[..n]);
            at += n;
        }
        Ok(())
    }

    fn read_at(&self, offset: usize, buf: &mut [u8]) -> std::io::Result<()> {
        self.file.read_exact_at(buf, offset as u64)
    }

    fn all(&self) -> std::io::Result<std::borrow::Cow<'_, [u8]>> {
        let mut bytes = vec![0; self.len];
        self.read_at(0, &mut bytes)?;
        Ok(std::borrow::Cow::Owned(bytes))
    }
}

/// What the daemon waits on: the next change of its source.
pub enum Watch {
    File(StateSource),
    Kubernetes(kubernetes::Watch),
}

impl Watch {
    /// Until the source may have changed. Cancel-safe (see [`StateSource::changed`]).
    pub async fn changed(&mut self) {
        match self {
            Self::File(source) => source.changed().await,
            Self::Kubernetes(watch) => watch.changed().await,
        }
    }
}

/// What the daemon reads a state from.
#[derive(Debug, Clone)]
pub enum Reader {
    File(StateFile),
    Kubernetes(kubernetes::Latest),
}

impl Reader {
    /// The source, as readiness, status and logs name it (`file /etc/wgfence/state.json`,
    /// `secret wgfence/state key state.json`).
    pub fn name(&self) -> String {
        match self {
            Self::File(file) => format!("file {}", file.path().display()),
            Self::Kubernetes(latest) => latest.secret().to_string(),
        }
    }

    /// The state as it is now, open to be read in pieces.
    pub fn open(&self) -> Result<Snapshot, ReadError> {
        match self {
            Self::File(file) => file.open().map(Snapshot::File),
            Self::Kubernetes(latest) => match latest.read() {
                kubernetes::Read::Object { bytes, origin } => {
                    Ok(Snapshot::Object { bytes, origin })
                }
                kubernetes::Read::NoKey { origin } => Err(ReadError::NoKey(format!(
                    "{origin}: the Secret has no key {:?}",
                    latest.secret().key
                ))),
                kubernetes::Read::NotListed { why } => Err(ReadError::NotListed(why)),
                kubernetes::Read::Missing { why } => Err(ReadError::ObjectMissing(why)),
            },
        }
    }
}

/// A state as read: its bytes, and what they are (the file, or a Secret at a resourceVersion).
#[derive(Debug)]
pub enum Snapshot {
    File(OpenState),
    Object {
        bytes: std::sync::Arc<[u8]>,
        /// `secret NS/NAME key KEY resourceVersion RV`.
        origin: String,
    },
}

impl Snapshot {
    /// See [`OpenState::written_since_open`]; an object read from the API never changes.
    pub fn written_since_open(&self) -> bool {
        match self {
            Self::File(file) => file.written_since_open(),
            Self::Object { .. } => false,
        }
    }

    /// The resourceVersion of an object from the API.
    pub fn origin(&self) -> Option<&str> {
        match self {
            Self::File(_) => None,
            Self::Object { origin, .. } => Some(origin),
        }
    }
}

impl StateBytes for Snapshot {
    type Error = std::io::Error;

    fn len(&self) -> usize {
        match self {
            Self::File(file) => file.len(),
            Self::Object { bytes, .. } => bytes.len(),
        }
    }

    fn each_piece(&self, f: &mut dyn FnMut(&[u8])) -> std::io::Result<()> {
        match self {
            Self::File(file) => file.each_piece(f),
            Self::Object { bytes, .. } => {
                f(bytes);
                Ok(())
            }
        }
    }

    fn read_at(&self, offset: usize, buf: &mut [u8]) -> std::io::Result<()> {
        match self {
            Self::File(file) => file.read_at(offset, buf),
            Self::Object { bytes, .. } => {
                let piece = offset
                    .checked_add(buf.len())
                    .and_then(|end| bytes.get(offset..end))
                    .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::UnexpectedEof))?;
                buf.copy_from_slice(piece);
                Ok(())
            }
        }
    }

    fn all(&self) -> std::io::Result<std::borrow::Cow<'_, [u8]>> {
        match self {
            Self::File(file) => file.all(),
            Self::Object { bytes, .. } => Ok(std::borrow::Cow::Borrowed(bytes)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{fs, os::unix::fs::symlink, time::Duration};

    use super::*;

    use crate::trust::tests::Dir as TempDir;

    #[track_caller]
    fn ok<T, E: std::fmt::Display>(r: Result<T, E>) -> T {
        match r {
            Ok(v) => v,
            Err(e) => panic!("{e}"),
        }
    }

    /// Replaces `path` by writing a temporary file next to it and renaming it over.
    fn replace(path: &Path, text: &str) {
        let tmp = path.with_extension("tmp");
        ok(fs::write(&tmp, text));
        ok(fs::rename(&tmp, path));
    }

    /// Points the symlink `link` at `target` atomically (a temporary link renamed over).
    fn swap(link: &Path, target: &Path) {
        let mut tmp = link.as_os_str().to_owned();
        tmp.push(".tmp-link");
        let tmp = PathBuf::from(tmp);
        ok(symlink(target, &tmp));
        ok(fs::rename(&tmp, link));
    }

    /// A file written in place while it is open is told apart from one left alone, and a
    /// read in pieces past its new end fails rather than returning fewer bytes.
    #[test]
    fn a_file_written_while_it_is_open_is_told_apart() {
        let dir = TempDir::new("torn");
        let path = dir.0.join("state.json");
        ok(fs::write(&path, "{\"version\": 1, \"peers\": []}"));
        let file = StateFile::new(&path, false, input::DEFAULT_MAX_STATE_BYTES);
        let opened = ok(file.open());
        assert!(!opened.written_since_open());
        let mut all = Vec::new();
        ok(opened.each_piece(&mut |piece| all.extend_from_slice(piece)));
        assert_eq!(all, ok(fs::read(&path)));
        // Rewritten in place, shorter.
        ok(fs::write(&path, "{}"));
        assert!(opened.written_since_open());
        assert!(opened.read_at(0, &mut vec![0; opened.len()]).is_err());
    }

    /// Both ways the daemon reads (checked by trust, and `--allow-insecure-state`), at start-up
    /// (`read`) and on every change (`open`), refuse a FIFO without a writer at once and a file
    /// over the limit, as `Refused`: what the daemon reports like a rejected state.
    #[test]
    fn every_read_refuses_a_fifo_and_an_oversized_file() {
        let dir = TempDir::new("refused");
        let fifo = dir.0.join("fifo.json");
        let c = std::ffi::CString::new(fifo.to_string_lossy().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        let big = dir.0.join("big.json");
        ok(fs::write(&big, vec![b' '; 101]));
        // On a thread: a read that blocks fails the test instead of hanging it.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut wrong = Vec::new();
            for trusted in [true, false] {
                for path in [&fifo, &big] {
                    let file = StateFile::new(path, trusted, 100);
                    if !matches!(file.read(), Err(ReadError::Refused(_))) {
                        wrong.push(format!("read {} (trusted: {trusted})", path.display()));
                    }
                    if !matches!(file.open(), Err(ReadError::Refused(_))) {
                        wrong.push(format!("open {} (trusted: {trusted})", path.display()));
                    }
                }
                if StateFile::new(&big, trusted, 101).read().is_err() {
                    wrong.push(format!("a file at the limit (trusted: {trusted})"));
                }
            }
            let _ = tx.send(wrong);
        });
        let wrong = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("a read blocked for 5 s");
        assert!(wrong.is_empty(), "not refused as they should be: {wrong:?}");
        drop(dir);
    }

    /// A directory with a `state.json` of `{}`, watched.
    fn watched(name: &str) -> (TempDir, PathBuf, StateSource) {
        let dir = TempDir::new(name);
        let path = dir.0.join("state.json");
        ok(fs::write(&path, "{}"));
        let source = ok(StateSource::watch(&path));
        (dir, path, source)
    }

    /// `change` is reported within a second.
    async fn reported(source: &mut StateSource, what: &str, change: impl FnOnce()) {
        // Let earlier events settle: a quiet period with nothing pending.
        loop {
            let quiet = tokio::time::timeout(SETTLE * 4, source.changed())
                .await
                .is_err();
            if quiet && !source.settling {
                break;
            }
        }
        change();
        let seen = tokio::time::timeout(Duration::from_secs(1), source.changed()).await;
        assert!(seen.is_ok(), "{what}: not reported within a second");
    }

    /// A write the writer has not closed is read once it settles; the daemon's loop drops
    /// `changed()` whenever a timer fires first, and a write whose event was already taken
    /// must still be reported by the next call.
    #[tokio::test(flavor = "current_thread")]
    async fn an_unclosed_write_survives_a_cancelled_wait() {
        use std::io::Write as _;
        let (_dir, path, mut source) = watched("cancel");
        let mut file = ok(fs::OpenOptions::new().append(true).open(&path));
        ok(file.write_all(b" "));
        // Cancelled after the event arrived, while waiting for the write to settle.
        let _ = tokio::time::timeout(SETTLE / 2, source.changed()).await;
        assert!(source.settling, "the unclosed write was not seen");
        let reported = tokio::time::timeout(Duration::from_secs(2), source.changed()).await;
        assert!(
            reported.is_ok(),
            "the change was lost with the cancelled wait"
        );
        drop(file);
    }

    /// No debounce: a file rewritten every 10 ms, without a pause, is reported again and again
    /// (a quiet period before each read would never come).
    #[tokio::test(flavor = "current_thread")]
    async fn a_stream_of_changes_is_reported_without_a_quiet_period() {
        let (_dir, path, mut source) = watched("stream");
        let writer_path = path.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let writer = std::thread::spawn(move || {
            let mut n = 0u64;
            while !stopped.load(Ordering::Acquire) {
                replace(&writer_path, &format!("{{\"n\":{n}}}"));
                n += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        let mut reports = 0;
        let seen = tokio::time::timeout(Duration::from_secs(2), async {
            while reports < 5 {
                source.changed().await;
                reports += 1;
            }
        })
        .await;
        stop.store(true, Ordering::Release);
        let _ = writer.join();
        assert!(
            seen.is_ok(),
            "{reports} of 5 reports while the file kept changing"
        );
    }

    /// Changes made while nobody waits (the daemon applying the previous one) are one report.
    #[tokio::test(flavor = "current_thread")]
    async fn changes_during_an_apply_are_one_report() {
        let (_dir, path, mut source) = watched("coalesce");
        for n in 0..5 {
            replace(&path, &format!("{{\"n\":{n}}}"));
        }
        ok(fs::write(&path, "{\"n\":5}"));
        // Let the watcher deliver them all.
        std::thread::sleep(Duration::from_millis(200));
        let first = tokio::time::timeout(Duration::from_secs(1), source.changed()).await;
        assert!(first.is_ok(), "the changes were not reported");
        let second = tokio::time::timeout(SETTLE * 4, source.changed()).await;
        assert!(second.is_err(), "one burst was reported twice");
    }

    /// `change` is not reported (within 300 ms).
    async fn not_reported(what: &str, change: impl FnOnce(&Path)) {
        let dir = TempDir::new("quiet");
        let path = dir.0.join("state.json");
        ok(fs::write(&path, "{}"));
        let mut source = ok(StateSource::watch(&path));
        change(&path);
        let r = tokio::time::timeout(Duration::from_millis(300), source.changed()).await;
        assert!(r.is_err(), "{what} was reported as a change");
    }

    /// The agent reads the file after every change; its own read must not count as one, or
    /// it reads the file again after every read, forever.
    #[tokio::test(flavor = "current_thread")]
    async fn reading_the_file_is_not_a_change() {
        not_reported("a read", |path| {
            let _ = ok(trust::read_trusted(path, input::DEFAULT_MAX_STATE_BYTES));
            let _ = ok(fs::read(path));
        })
        .await;
    }

    /// Other files in the watched directories (`/tmp` and the state's own) are not changes.
    #[tokio::test(flavor = "current_thread")]
    async fn other_files_are_not_changes() {
        not_reported("another file", |path| {
            ok(fs::write(path.with_file_name("other.json"), "{}"))
        })
        .await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn in_place_rename_and_kubernetes_swap_are_reported() {
        let (_dir, path, mut source) = watched("plain");
        reported(&mut source, "written in place", || {
            ok(fs::write(&path, "{\"a\":1}"))
        })
        .await;
        reported(&mut source, "renamed over", || replace(&path, "{\"a\":2}")).await;

        let kube = TempDir::new("kube");
        for n in 0..3 {
            let data = kube.0.join(format!("..2026_{n}"));
            ok(fs::create_dir(&data));
            ok(fs::write(data.join("state.json"), "{}"));
        }
        ok(symlink("..2026_0", kube.0.join("..data")));
        let path = kube.0.join("state.json");
        ok(symlink("..data/state.json", &path));
        let mut source = ok(StateSource::watch(&path));
        for n in 1..3 {
            reported(&mut source, "..data swapped", || {
                swap(&kube.0.join("..data"), Path::new(&format!("..2026_{n}")));
                ok(fs::remove_dir_all(kube.0.join(format!("..2026_{}", n - 1))));
            })
            .await;
        }
    }

    /// `--state` links into another directory: the file replaced there is seen, and after the
    /// link is pointed at a third directory, changes there are seen (and the old one is no
    /// longer watched).
    #[tokio::test(flavor = "current_thread")]
    async fn a_link_into_another_directory_is_followed_and_rearmed() {
        let dir = TempDir::new("link");
        let (a, b) = (dir.0.join("a"), dir.0.join("b"));
        ok(fs::create_dir(&a));
        ok(fs::create_dir(&b));
        ok(fs::write(a.join("state.json"), "{}"));
        ok(fs::write(b.join("state.json"), "{}"));
        let path = dir.0.join("state.json");
        ok(symlink(a.join("state.json"), &path));
        let mut source = ok(StateSource::watch(&path));
        reported(&mut source, "target replaced", || {
            replace(&a.join("state.json"), "{\"a\":1}")
        })
        .await;
        reported(&mut source, "link pointed elsewhere", || {
            swap(&path, &b.join("state.json"))
        })
        .await;
        assert!(source.watched_dirs().any(|d| d == b));
        assert!(!source.watched_dirs().any(|d| d == a));
        reported(&mut source, "new target replaced", || {
            replace(&b.join("state.json"), "{\"b\":1}")
        })
        .await;
        reported(&mut source, "new target written in place", || {
            ok(fs::write(b.join("state.json"), "{\"b\":2}"))
        })
        .await;
    }

    /// `--state current/state.json`, `current` a symlink swapped to another directory: the
    /// swap is seen, and changes in the new directory afterwards too.
    #[tokio::test(flavor = "current_thread")]
    async fn a_swapped_parent_link_is_followed_and_rearmed() {
        let dir = TempDir::new("parent");
        for n in 0..2 {
            let release = dir.0.join(format!("release.{n}"));
            ok(fs::create_dir(&release));
            ok(fs::write(release.join("state.json"), "{}"));
        }
        let current = dir.0.join("current");
        ok(symlink("release.0", &current));
        let path = current.join("state.json");
        let mut source = ok(StateSource::watch(&path));
        reported(&mut source, "parent link swapped", || {
            swap(&current, Path::new("release.1"))
        })
        .await;
        reported(&mut source, "file replaced in the new directory", || {
            replace(&dir.0.join("release.1").join("state.json"), "{\"n\":1}")
        })
        .await;
    }

    /// A state directory that does not exist yet is watched for from its parent.
    #[tokio::test(flavor = "current_thread")]
    async fn a_directory_created_later_is_followed() {
        let dir = TempDir::new("later");
        let path = dir.0.join("conf").join("state.json");
        let mut source = ok(StateSource::watch(&path));
        reported(&mut source, "directory created", || {
            ok(fs::create_dir(dir.0.join("conf")))
        })
        .await;
        reported(&mut source, "file created in it", || {
            ok(fs::write(&path, "{}"))
        })
        .await;
    }

    /// A watched directory moved away and back within one burst: notify dropped its watch,
    /// and the path resolves as before; the watch is made again all the same.
    #[tokio::test(flavor = "current_thread")]
    async fn a_directory_moved_away_and_back_is_watched_again() {
        let dir = TempDir::new("moved");
        let conf = dir.0.join("conf");
        ok(fs::create_dir(&conf));
        let path = conf.join("state.json");
        ok(fs::write(&path, "{}"));
        let mut source = ok(StateSource::watch(&path));
        reported(&mut source, "directory moved away and back", || {
            ok(fs::rename(&conf, dir.0.join("conf.old")));
            ok(fs::rename(dir.0.join("conf.old"), &conf));
        })
        .await;
        reported(&mut source, "file written afterwards", || {
            ok(fs::write(&path, "{\"a\":1}"))
        })
        .await;
    }
}
