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
    /// An event was taken from the channel and its burst not yet reported: `changed` was
    /// cancelled during the debounce (the daemon's `select!` drops it whenever another branch
    /// wins), and the next call must report it rather than wait for another event.
    pending: bool,
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
            pending: false,
            _watcher: watcher,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits for the next change in the directory, then for the burst to end.
    ///
    /// Cancel-safe: dropped at any await point (as `select!` does when another branch wins),
    /// no change is lost; the next call picks up where this one stopped.
    pub async fn changed(&mut self) {
        if !self.pending {
            if self.events.recv().await.is_none() {
                // The watcher is gone; only resyncs will read the file.
                std::future::pending::<()>().await;
            }
            self.pending = true;
        }
        // Drain the burst: stop at the first quiet DEBOUNCE.
        while let Ok(Some(())) = tokio::time::timeout(DEBOUNCE, self.events.recv()).await {}
        self.pending = false;
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// The daemon's loop drops `changed()` whenever a timer fires first; a change whose first
    /// event was already taken must still be reported by the next call.
    #[tokio::test(flavor = "current_thread")]
    async fn a_change_survives_a_cancelled_wait() {
        let dir = std::env::temp_dir().join(format!("wgfence-source-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let path = dir.join("state.json");
        let mut source = StateSource::watch(&path).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(&path, "{}").unwrap_or_else(|e| panic!("{e}"));
        // Cancelled after the first event arrived, during the debounce.
        let _ = tokio::time::timeout(DEBOUNCE / 2 + Duration::from_millis(5), async {
            // Wait for the first event to be taken, then let the timeout cancel the debounce.
            source.changed().await;
        })
        .await;
        let reported = tokio::time::timeout(Duration::from_secs(2), source.changed()).await;
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            reported.is_ok(),
            "the change was lost with the cancelled wait"
        );
    }
}
