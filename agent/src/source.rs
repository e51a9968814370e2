//! The state file, watched through its directory.
//!
//! Kubernetes updates a Secret or ConfigMap volume by writing a new timestamped directory and
//! swapping the `..data` symlink; editors write in place or write a temporary file and rename
//! it. Watching the file itself misses the swap and the rename (the watch follows the old
//! inode), so the directory is watched and any event in it means "read the file again". A
//! burst of events (a swap is several) is debounced into one read, and a read that finds the
//! same bytes as last time costs nothing more.

use std::{
    io,
    path::{Path, PathBuf},
    time::Duration,
};

use notify::{RecommendedWatcher, RecursiveMode, Watcher as _};
use tokio::sync::mpsc;

/// How long a burst of events may last before the file is read.
pub const DEBOUNCE: Duration = Duration::from_millis(50);

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("state file {path} has no parent directory to watch")]
    NoDirectory { path: PathBuf },
    #[error("watching {dir}")]
    Watch {
        dir: PathBuf,
        #[source]
        source: notify::Error,
    },
}

pub struct StateSource {
    path: PathBuf,
    events: mpsc::UnboundedReceiver<()>,
    _watcher: RecommendedWatcher,
}

impl StateSource {
    /// Starts watching the directory of `path`.
    pub fn watch(path: &Path) -> Result<Self, SourceError> {
        let dir = path
            .parent()
            .map(|d| {
                if d.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    d
                }
            })
            .ok_or_else(|| SourceError::NoDirectory {
                path: path.to_owned(),
            })?
            .to_owned();
        let (tx, events) = mpsc::unbounded_channel();
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                if let Err(e) = &event {
                    tracing::warn!(error = %crate::error_chain(e), "state directory watch");
                }
                // Errors too: the next read tells what is there.
                let _ = tx.send(());
            })
            .map_err(|source| SourceError::Watch {
                dir: dir.clone(),
                source,
            })?;
        watcher
            .watch(&dir, RecursiveMode::NonRecursive)
            .map_err(|source| SourceError::Watch {
                dir: dir.clone(),
                source,
            })?;
        Ok(Self {
            path: path.to_owned(),
            events,
            _watcher: watcher,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits for the next change in the directory, then for the burst to end.
    pub async fn changed(&mut self) {
        if self.events.recv().await.is_none() {
            // The watcher is gone; only resyncs will read the file.
            std::future::pending::<()>().await;
        }
        // Drain the burst: stop at the first quiet DEBOUNCE.
        while let Ok(Some(())) = tokio::time::timeout(DEBOUNCE, self.events.recv()).await {}
    }

    /// The file's contents; `None` if it does not exist (or its symlink dangles).
    pub fn read(&self) -> io::Result<Option<Vec<u8>>> {
        match std::fs::read(&self.path) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
}
