//! wgfence: per-peer egress policy for WireGuard gateways, enforced by a tcx eBPF program.
//!
//! Data flows one way: [`source`] watches the state file, [`state`] validates it into a
//! canonical desired state, [`policy`] compiles rule sets into trie entries, [`plan`] diffs
//! desired against actual (pure), [`reconcile`] applies the plan through [`dataplane`] (BPF
//! maps) and [`wg`] (WireGuard peers), and [`daemon`] runs the loop with [`metrics`] and
//! [`status`] alongside. [`settings`] are the datapath's own (reply flows, drop events), and
//! [`monitor`] streams its drop events.

mod actual_maps;
pub mod clock;
pub mod daemon;
pub mod dataplane;
pub mod explain;
pub mod input;
pub mod metrics;
pub mod monitor;
pub mod plan;
pub mod policy;
pub mod reconcile;
pub mod settings;
pub mod source;
pub mod state;
pub mod status;
pub mod sweeper;
#[cfg(feature = "testing")]
pub mod testing;
pub mod trust;
mod verdict;
pub mod verify;
pub mod wg;

/// An error and its sources, `outer: inner: innermost`, for logs and the command line. The
/// error types here keep their sources out of their own message (`source()` returns them);
/// some of aya's repeat theirs, so a cause already in the text is not added again.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Frees `value` on a thread of its own, so that what is proportional to the number of peers
/// (a previous state, the peers a push removed) is not freed between a file change and the
/// kernel write. If the thread cannot be started, it is freed here.
pub fn drop_later<T: Send + 'static>(value: T) {
    free_later(Box::new(value), false);
}

/// [`drop_later`], then the free heap handed back to the system (`malloc_trim`) on the same
/// thread, once `value` is gone: for what is proportional to the number of peers, so that a
/// peak does not stay resident. (A trim on the caller's thread would run before the free.)
pub(crate) fn drop_later_and_trim<T: Send + 'static>(value: T) {
    free_later(Box::new(value), true);
}

type Garbage = (Box<dyn Send>, bool);

fn free_later(value: Box<dyn Send>, trim: bool) {
    static FREER: std::sync::OnceLock<Option<std::sync::mpsc::Sender<Garbage>>> =
        std::sync::OnceLock::new();
    let freer = FREER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Garbage>();
        std::thread::Builder::new()
            .name("wgfence-free".into())
            .spawn(move || {
                for (value, trim) in rx {
                    drop(value);
                    if trim {
                        trim_heap();
                    }
                }
            })
            .ok()
            .map(|_| tx)
    });
    let garbage = (value, trim);
    let back = match freer {
        // Only fails if the thread is gone: then the value comes back and is freed here.
        Some(tx) => tx.send(garbage).err().map(|e| e.0),
        None => Some(garbage),
    };
    if let Some((value, trim)) = back {
        drop(value);
        if trim {
            trim_heap();
        }
    }
}

/// Hands free heap memory back to the system, so a peak does not stay resident.
pub(crate) fn trim_heap() {
    // SAFETY: malloc_trim only releases free heap memory.
    unsafe { libc::malloc_trim(0) };
}

/// Cases for a slow property test: `full` in the long suite (`cargo xtask test --full` sets
/// `WGFENCE_FULL_SUITE`), a fifth of it (at least 16) in the suite CI runs, where the fuzz
/// targets of fuzz/ search the same properties, optimised, in the same run.
#[cfg(test)]
pub(crate) fn proptest_cases(full: u32) -> u32 {
    if std::env::var_os("WGFENCE_FULL_SUITE").is_some() {
        full
    } else {
        (full / 5).max(16)
    }
}

#[cfg(test)]
mod tests {
    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] Middle);

    #[derive(Debug, thiserror::Error)]
    #[error("middle: {0}")]
    struct Middle(#[source] std::io::Error);

    #[test]
    fn an_error_chain_names_each_cause_once() {
        let e = Outer(Middle(std::io::Error::other("disk on fire")));
        assert_eq!(super::error_chain(&e), "outer: middle: disk on fire");
    }
}
