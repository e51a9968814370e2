//! `--source kubernetes`: the state from one Secret, watched through the API server.
//!
//! A mounted Secret changes only when kubelet re-projects it (its sync period plus its cache
//! TTL: a minute or more); the API says so at once. The agent lists and watches exactly one
//! object (`metadata.name=NAME` in its namespace, which is all its RBAC grants) with kube's
//! watcher: list, then watch from the list's resourceVersion; a watch that ends resumes from
//! the last version seen; a 410 Gone (the version compacted away, as after a long outage)
//! lists again. Errors are retried after at most [`MAX_BACKOFF`], so a change made while the
//! API server was away applies within a second of it being back.
//!
//! What the daemon sees is the [`Latest`] object, shared with this watch task:
//!
//! - nothing before the first complete list: the daemon applies nothing and prunes nothing
//!   (what is pinned keeps enforcing), and says why it is not ready;
//! - after it, the Secret's `KEY` bytes with their resourceVersion, which only moves forward:
//!   an object older than the one held (a re-list answered from a lagging cache) is ignored;
//! - or "missing": the Secret was deleted (or a re-list no longer has it). The last good state
//!   stays enforced (never "allow everything", never "drop everything" without a state that
//!   says so) and the daemon reports `source_object_missing`.

use std::{
    fmt,
    path::PathBuf,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::Secret;
use kube::{
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{
        utils::Backoff,
        watcher::{self, Event},
        WatchStreamExt as _,
    },
    Api, Client, Config, ResourceExt as _,
};
use tokio::sync::Notify;

/// Longest wait before the watch tries again after an error (connection refused, the API
/// server starting, a broken stream): the bound on how late a change made during an outage is
/// seen once the API server is back.
pub const MAX_BACKOFF: Duration = Duration::from_millis(400);
/// First wait after an error.
const MIN_BACKOFF: Duration = Duration::from_millis(50);
/// The server ends each watch after this long, and the watcher gives up on one silent for
/// this plus 5 s: how long a network cut that drops packets silently goes unnoticed.
const WATCH_TIMEOUT_SECS: u32 = 30;
/// At most one warning about the watch's errors this often.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// Which Secret, which key of it, and how to reach the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretRef {
    pub namespace: String,
    pub name: String,
    /// The key of the Secret's `data` that holds the state file.
    pub key: String,
    /// A kubeconfig file; `None`: the pod's service account (in-cluster configuration).
    pub kubeconfig: Option<PathBuf>,
}

impl SecretRef {
    /// `NAMESPACE/NAME`.
    pub fn parse(secret: &str, key: &str, kubeconfig: Option<PathBuf>) -> Result<Self, KubeError> {
        let valid = |s: &str| {
            !s.is_empty()
                && s.len() <= 253
                && s.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        };
        match secret.split_once('/') {
            Some((namespace, name)) if valid(namespace) && valid(name) => Ok(Self {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                key: key.to_owned(),
                kubeconfig,
            }),
            _ => Err(KubeError::SecretName(secret.to_owned())),
        }
    }
}

impl fmt::Display for SecretRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "secret {}/{} key {}",
            self.namespace, self.name, self.key
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    #[error("--secret {0:?}: expected NAMESPACE/NAME (lower-case DNS names)")]
    SecretName(String),
    #[error("reading the kubeconfig {path}")]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("the in-cluster configuration (service account token, KUBERNETES_SERVICE_HOST)")]
    InCluster(#[source] kube::config::InClusterError),
    #[error("the Kubernetes client")]
    Client(#[source] kube::Error),
}

/// The Secret's state as last seen.
#[derive(Debug, Clone)]
pub struct Object {
    /// The value of the key; `None` if the Secret has no such key.
    pub bytes: Option<Arc<[u8]>>,
    pub resource_version: String,
}

/// What the watch knows of the Secret.
#[derive(Debug, Clone, Default)]
enum Known {
    /// No complete list yet: nothing may be applied, nor anything pruned.
    #[default]
    NotListed,
    Present(Object),
    /// Deleted, or absent from the last complete list; the last version seen, if any.
    Missing {
        last: Option<String>,
    },
}

#[derive(Debug, Default)]
struct Shared {
    known: Known,
    /// The last error of the watch, cleared by the next event (for the readiness while no list
    /// has completed: "connection refused" says more than "waiting").
    error: Option<String>,
}

/// The latest object, read by the daemon's loads.
#[derive(Debug, Clone)]
pub struct Latest {
    secret: Arc<SecretRef>,
    shared: Arc<Mutex<Shared>>,
}

/// What a load finds.
#[derive(Debug)]
pub enum Read {
    /// The Secret at this version, with its key's bytes.
    Object { bytes: Arc<[u8]>, origin: String },
    /// The Secret has no such key: an invalid state, rejected whole.
    NoKey { origin: String },
    /// No complete list yet (the reason: the last error, if any).
    NotListed { why: String },
    /// The Secret is gone.
    Missing { why: String },
}

impl Latest {
    pub fn secret(&self) -> &SecretRef {
        &self.secret
    }

    pub fn read(&self) -> Read {
        let shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        let s = &self.secret;
        match &shared.known {
            Known::NotListed => Read::NotListed {
                why: match &shared.error {
                    Some(e) => format!(
                        "no complete list of {s} yet (the API server: {e}); what is pinned \
                         stays enforced"
                    ),
                    None => {
                        format!("no complete list of {s} yet; what is pinned stays enforced")
                    }
                },
            },
            Known::Missing { last } => Read::Missing {
                why: format!(
                    "source_object_missing: {s} is not in the API{}; the last good state stays \
                     enforced",
                    last.as_ref()
                        .map(|v| format!(" (deleted after resourceVersion {v})"))
                        .unwrap_or_default()
                ),
            },
            Known::Present(object) => {
                let origin = format!("{s} resourceVersion {}", object.resource_version);
                match &object.bytes {
                    Some(bytes) => Read::Object {
                        bytes: Arc::clone(bytes),
                        origin,
                    },
                    None => Read::NoKey { origin },
                }
            }
        }
    }
}

/// Wakes the daemon when [`Latest`] changes.
pub struct Watch {
    wake: Arc<Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl Watch {
    /// Until the next change. Cancel-safe: a change while nobody waits is kept as a permit.
    pub async fn changed(&mut self) {
        self.wake.notified().await;
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Builds the client and starts the watch on the current tokio runtime. `on_error` is called
/// for every error of the watch (the metric).
pub async fn start(
    secret: SecretRef,
    on_error: impl Fn() + Send + 'static,
) -> Result<(Watch, Latest), KubeError> {
    let config = match &secret.kubeconfig {
        Some(path) => {
            let kubeconfig =
                Kubeconfig::read_from(path).map_err(|source| KubeError::Kubeconfig {
                    path: path.clone(),
                    source,
                })?;
            Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .map_err(|source| KubeError::Kubeconfig {
                    path: path.clone(),
                    source,
                })?
        }
        None => Config::incluster().map_err(KubeError::InCluster)?,
    };
    let client = Client::try_from(config).map_err(KubeError::Client)?;
    let api: Api<Secret> = Api::namespaced(client, &secret.namespace);
    let latest = Latest {
        secret: Arc::new(secret),
        shared: Arc::default(),
    };
    let wake = Arc::new(Notify::new());
    let task = tokio::spawn(follow(api, latest.clone(), Arc::clone(&wake), on_error));
    Ok((Watch { wake, task }, latest))
}

/// The watch task: applies the watcher's events to `latest`, waking the daemon on a change.
async fn follow(api: Api<Secret>, latest: Latest, wake: Arc<Notify>, on_error: impl Fn()) {
    let config = watcher::Config::default()
        .fields(&format!("metadata.name={}", latest.secret.name))
        .timeout(WATCH_TIMEOUT_SECS);
    let mut events = watcher::watcher(api, config)
        .backoff(Quick::default())
        .boxed();
    // The object of a list in progress: a list replaces what is known only once complete.
    let mut listing: Option<Option<Secret>> = None;
    // Errors since the last event: one warning a minute at most (a retry every 400 ms would
    // log 9,000 lines an hour), the rest debug; the next event says how many there were.
    let mut failing = 0u64;
    let mut warned: Option<tokio::time::Instant> = None;
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event,
            Err(e) => {
                let why = crate::error_chain(&e);
                if warned.is_none_or(|at| at.elapsed() >= WARN_EVERY) {
                    warned = Some(tokio::time::Instant::now());
                    tracing::warn!(secret = %latest.secret, error = %why, "watching the Secret; retrying every 400 ms at most");
                } else {
                    tracing::debug!(secret = %latest.secret, error = %why, "watching the Secret; retrying");
                }
                failing += 1;
                on_error();
                let mut shared = latest.shared.lock().unwrap_or_else(PoisonError::into_inner);
                if shared.error.is_none() && matches!(shared.known, Known::NotListed) {
                    shared.error = Some(why);
                    drop(shared);
                    wake.notify_one();
                } else {
                    shared.error = Some(why);
                }
                continue;
            }
        };
        if failing > 0 {
            tracing::info!(secret = %latest.secret, errors = failing, "watching the Secret again");
            failing = 0;
        }
        let update = match event {
            Event::Init => {
                listing = Some(None);
                None
            }
            Event::InitApply(secret) => {
                if let Some(listed) = listing.as_mut() {
                    *listed = Some(secret);
                }
                None
            }
            Event::InitDone => match listing.take() {
                Some(Some(secret)) => Some(Some(secret)),
                Some(None) => Some(None),
                None => None,
            },
            Event::Apply(secret) => Some(Some(secret)),
            Event::Delete(_) => Some(None),
        };
        if let Some(update) = update {
            if latest.update(update) {
                wake.notify_one();
            }
        }
    }
}

impl Latest {
    /// Takes the Secret as listed or watched (`None`: gone). Whether anything changed.
    fn update(&self, secret: Option<Secret>) -> bool {
        let mut shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        shared.error = None;
        let next = match secret {
            Some(secret) if secret.name_any() == self.secret.name => {
                let resource_version = secret.resource_version().unwrap_or_default();
                if let Known::Present(held) = &shared.known {
                    if older(&resource_version, &held.resource_version) {
                        tracing::warn!(
                            secret = %self.secret,
                            seen = %resource_version,
                            held = %held.resource_version,
                            "ignoring an older version of the Secret than the one held"
                        );
                        return false;
                    }
                    if held.resource_version == resource_version {
                        return false;
                    }
                }
                let bytes = secret
                    .data
                    .as_ref()
                    .and_then(|data| data.get(&self.secret.key))
                    .map(|value| Arc::from(value.0.as_slice()));
                tracing::debug!(secret = %self.secret, %resource_version, "Secret changed");
                Known::Present(Object {
                    bytes,
                    resource_version,
                })
            }
            // Not ours (the field selector makes that impossible): ignored.
            Some(_) => return false,
            None => {
                let last = match &shared.known {
                    Known::Present(held) => Some(held.resource_version.clone()),
                    Known::Missing { last } => last.clone(),
                    Known::NotListed => None,
                };
                if matches!(shared.known, Known::Missing { .. }) {
                    return false;
                }
                tracing::warn!(secret = %self.secret, "the Secret is gone; the last good state stays enforced");
                Known::Missing { last }
            }
        };
        shared.known = next;
        true
    }
}

/// Whether resourceVersion `a` is older than `b`. They are etcd revisions (decimal integers)
/// on every API server; the API calls them opaque, so anything else is never "older".
fn older(a: &str, b: &str) -> bool {
    matches!((a.parse::<u64>(), b.parse::<u64>()), (Ok(a), Ok(b)) if a < b)
}

/// The watch's backoff: [`MIN_BACKOFF`] doubling up to [`MAX_BACKOFF`], reset by an event.
/// Kept short (kube's default climbs to 30 s): there is one watcher per node on one object,
/// and a revocation made during an outage must apply as soon as the API server is back.
#[derive(Debug)]
struct Quick {
    next: Duration,
}

impl Default for Quick {
    fn default() -> Self {
        Self { next: MIN_BACKOFF }
    }
}

impl Iterator for Quick {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let now = self.next;
        self.next = (self.next * 2).min(MAX_BACKOFF);
        Some(now)
    }
}

impl Backoff for Quick {
    fn reset(&mut self) {
        self.next = MIN_BACKOFF;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::{apimachinery::pkg::apis::meta::v1::ObjectMeta, ByteString};

    use super::*;

    fn secret(name: &str, rv: &str, data: Option<&str>) -> Secret {
        Secret {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                resource_version: Some(rv.to_owned()),
                ..ObjectMeta::default()
            },
            data: data.map(|d| {
                BTreeMap::from([("state.json".to_owned(), ByteString(d.as_bytes().to_vec()))])
            }),
            ..Secret::default()
        }
    }

    fn latest() -> Latest {
        Latest {
            secret: Arc::new(SecretRef {
                namespace: "ns".into(),
                name: "s".into(),
                key: "state.json".into(),
                kubeconfig: None,
            }),
            shared: Arc::default(),
        }
    }

    fn origin(latest: &Latest) -> String {
        match latest.read() {
            Read::Object { origin, .. } | Read::NoKey { origin } => origin,
            Read::NotListed { why } | Read::Missing { why } => why,
        }
    }

    #[test]
    fn nothing_is_read_before_the_first_complete_list() {
        let l = latest();
        assert!(matches!(l.read(), Read::NotListed { .. }));
        assert!(l.update(Some(secret("s", "5", Some("{}")))));
        assert!(matches!(l.read(), Read::Object { .. }));
        assert_eq!(origin(&l), "secret ns/s key state.json resourceVersion 5");
    }

    #[test]
    fn an_older_version_is_never_taken() {
        let l = latest();
        assert!(l.update(Some(secret("s", "10", Some("new")))));
        assert!(!l.update(Some(secret("s", "9", Some("old")))));
        assert!(!l.update(Some(secret("s", "10", Some("new")))));
        match l.read() {
            Read::Object { bytes, .. } => assert_eq!(&*bytes, b"new"),
            other => panic!("{other:?}"),
        }
        assert!(l.update(Some(secret("s", "11", None))));
        assert!(matches!(l.read(), Read::NoKey { .. }));
    }

    #[test]
    fn a_deleted_secret_is_missing_and_names_its_last_version() {
        let l = latest();
        assert!(l.update(Some(secret("s", "7", Some("{}")))));
        assert!(l.update(None));
        assert!(!l.update(None));
        match l.read() {
            Read::Missing { why } => {
                assert!(why.starts_with("source_object_missing"), "{why}");
                assert!(why.contains("resourceVersion 7"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        // Created again: a newer version.
        assert!(l.update(Some(secret("s", "12", Some("{}")))));
        assert!(matches!(l.read(), Read::Object { .. }));
    }

    #[test]
    fn secret_names_are_checked() {
        assert!(SecretRef::parse("wgfence/state", "state.json", None).is_ok());
        for bad in ["state", "/state", "ns/", "NS/state", "a/b/c"] {
            assert!(SecretRef::parse(bad, "k", None).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_backoff_stays_short() {
        let mut b = Quick::default();
        let waits: Vec<_> = (&mut b).take(6).collect();
        assert_eq!(waits[0], MIN_BACKOFF);
        assert!(waits.iter().all(|w| *w <= MAX_BACKOFF));
        b.reset();
        assert_eq!(b.next(), Some(MIN_BACKOFF));
    }
}
