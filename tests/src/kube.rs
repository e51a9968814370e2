//! A real Kubernetes API server for a test: etcd and kube-apiserver v1.20.2 (built from
//! Debian's source package by `cargo xtask kube-apiserver`, at [`KUBE_APISERVER`]), started in the
//! gateway's node namespace, where the agent runs as a hostNetwork pod would. Each test has its
//! own namespace, so the fixed loopback ports never collide between tests run in parallel; each
//! has its own temporary directory with its own PKI (made with openssl), token file and etcd
//! data. Both processes are killed and the directory removed in `Drop`, also when the test
//! fails.
//!
//! Two users (a static token file): `admin` (system:masters), what the test writes with, and
//! the agent's service account `system:serviceaccount:wgfence:wgfence`, which gets only what
//! the test (or the deploy overlay's Role) grants it.

use std::{
    fs,
    future::Future,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant, SystemTime},
};

use k8s_openapi::{
    api::{
        core::v1::{Namespace, Secret},
        rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject},
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
    ByteString,
};
use kube::{
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
    Api, Client, Config,
};

use crate::net::{unique, Netns};

/// Where `cargo xtask kube-apiserver` installs the API server (xtask/k8s/install-kube-apiserver.sh).
pub const KUBE_APISERVER: &str = "/opt/k8s-test/bin/kube-apiserver";
/// The API server's address inside the node namespace.
pub const API: &str = "127.0.0.1:6443";
/// The same server, as the agent's kubeconfig names it.
pub const AGENT_API: &str = "127.0.0.2:6443";
const ADMIN_TOKEN: &str = "wgft-admin-token";
const AGENT_TOKEN: &str = "wgft-agent-token";
/// The agent's identity: the DaemonSet's service account.
pub const AGENT_NAMESPACE: &str = "wgfence";
pub const AGENT_ACCOUNT: &str = "wgfence";

/// Who talks to the API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum User {
    Admin,
    Agent,
}

pub struct ApiServer {
    ns: String,
    pub dir: PathBuf,
    etcd: Option<Child>,
    apiserver: Option<Child>,
}

/// A command run in network namespace `ns` (as [`Netns::command`]).
fn command_in(ns: &str, program: &str) -> Command {
    use std::os::{fd::AsRawFd as _, unix::process::CommandExt as _};
    let path = format!("/var/run/netns/{ns}");
    let file = fs::File::open(&path).unwrap_or_else(|e| panic!("opening {path}: {e}"));
    let mut cmd = Command::new(program);
    // SAFETY: setns is async-signal-safe; `file` is moved into the closure and stays open.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    cmd
}

/// Runs `f` on a thread that has entered network namespace `ns` (as [`Netns::enter`]).
fn enter<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    use std::os::fd::AsRawFd as _;
    let path = format!("/var/run/netns/{ns}");
    std::thread::scope(|s| {
        s.spawn(|| {
            let file = fs::File::open(&path).unwrap_or_else(|e| panic!("opening {path}: {e}"));
            // SAFETY: setns on this thread only, with a namespace fd we hold open.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    })
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("openssl (needed for the test PKI): {e}"));
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl ApiServer {
    /// Starts etcd and kube-apiserver in `node` and waits until the API server is ready.
    pub fn start(node: &Netns) -> Self {
        assert!(
            Path::new(KUBE_APISERVER).is_file(),
            "no kube-apiserver at {KUBE_APISERVER}: `cargo xtask kube-apiserver` (and `cargo xtask test`) builds it (about 4 \
             minutes, once; xtask/k8s/install-kube-apiserver.sh)"
        );
        let dir = std::env::temp_dir().join(unique("wgfence-kube-"));
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let mut server = Self {
            ns: node.name().to_owned(),
            dir,
            etcd: None,
            apiserver: None,
        };
        server.pki();
        server.start_etcd();
        server.start_apiserver();
        server
    }

    fn pki(&self) {
        let d = &self.dir;
        openssl(
            d,
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                "ca.key",
                "-out",
                "ca.crt",
                "-days",
                "2",
                "-subj",
                "/CN=wgft-ca",
            ],
        );
        openssl(
            d,
            &[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                "server.key",
                "-out",
                "server.csr",
                "-subj",
                "/CN=kube-apiserver",
            ],
        );
        fs::write(
            d.join("san.cnf"),
            "subjectAltName=IP:127.0.0.1,IP:127.0.0.2,DNS:localhost\n",
        )
        .unwrap_or_else(|e| panic!("san.cnf: {e}"));
        openssl(
            d,
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                "server.crt",
                "-days",
                "2",
                "-extfile",
                "san.cnf",
            ],
        );
        openssl(d, &["genrsa", "-out", "sa.key", "2048"]);
        openssl(d, &["rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub"]);
        fs::write(
            d.join("tokens.csv"),
            format!(
                "{ADMIN_TOKEN},admin,admin-uid,\"system:masters\"\n\
                 {AGENT_TOKEN},system:serviceaccount:{AGENT_NAMESPACE}:{AGENT_ACCOUNT},agent-uid,\
                 \"system:serviceaccounts,system:serviceaccounts:{AGENT_NAMESPACE}\"\n"
            ),
        )
        .unwrap_or_else(|e| panic!("tokens.csv: {e}"));
        for user in [User::Admin, User::Agent] {
            fs::write(self.kubeconfig(user), self.kubeconfig_text(user))
                .unwrap_or_else(|e| panic!("kubeconfig: {e}"));
        }
    }

    fn kubeconfig_text(&self, user: User) -> String {
        let ca = fs::read(self.dir.join("ca.crt")).unwrap_or_else(|e| panic!("ca.crt: {e}"));
        // The agent reaches the server at an address of its own, so a test can cut the
        // agent's path alone ([`ApiServer::cut_agent`]).
        let (token, addr) = match user {
            User::Admin => (ADMIN_TOKEN, API),
            User::Agent => (AGENT_TOKEN, AGENT_API),
        };
        serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{ "name": "t", "cluster": {
                "server": format!("https://{addr}"),
                "certificate-authority-data": base64(&ca),
            }}],
            "users": [{ "name": "u", "user": { "token": token } }],
            "contexts": [{ "name": "t", "context": { "cluster": "t", "user": "u" } }],
            "current-context": "t",
        })
        .to_string()
    }

    /// The kubeconfig file of `user` (JSON, which is YAML).
    pub fn kubeconfig(&self, user: User) -> PathBuf {
        self.dir.join(match user {
            User::Admin => "admin.kubeconfig",
            User::Agent => "agent.kubeconfig",
        })
    }

    fn log(&self, name: &str) -> fs::File {
        fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    fn start_etcd(&mut self) {
        let data = self.dir.join("etcd-data");
        let log = self.log("etcd.log");
        let log2 = log.try_clone().unwrap();
        let child = command_in(&self.ns, "etcd")
            .args(["--name", "t", "--data-dir"])
            .arg(&data)
            .args([
                "--listen-client-urls=http://127.0.0.1:2379",
                "--advertise-client-urls=http://127.0.0.1:2379",
                "--listen-peer-urls=http://127.0.0.1:2380",
                "--initial-advertise-peer-urls=http://127.0.0.1:2380",
                "--initial-cluster=t=http://127.0.0.1:2380",
            ])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .unwrap_or_else(|e| panic!("starting etcd (Debian's etcd-server): {e}"));
        self.etcd = Some(child);
    }

    /// Starts the API server (on the same etcd) and waits until `/readyz` answers.
    pub fn start_apiserver(&mut self) {
        assert!(self.apiserver.is_none(), "the API server runs");
        let d = &self.dir;
        let p = |f: &str| d.join(f).to_string_lossy().into_owned();
        let log = self.log("kube-apiserver.log");
        let log2 = log.try_clone().unwrap();
        let child = command_in(&self.ns, KUBE_APISERVER)
            .args([
                "--etcd-servers=http://127.0.0.1:2379",
                // Loopback only (the namespace's): 127.0.0.1 for the test, 127.0.0.2 for the
                // agent.
                "--bind-address=0.0.0.0",
                "--advertise-address=127.0.0.1",
                "--secure-port=6443",
                "--insecure-port=0",
                &format!("--tls-cert-file={}", p("server.crt")),
                &format!("--tls-private-key-file={}", p("server.key")),
                &format!("--token-auth-file={}", p("tokens.csv")),
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc",
                &format!("--service-account-key-file={}", p("sa.pub")),
                &format!("--service-account-signing-key-file={}", p("sa.key")),
                "--service-cluster-ip-range=10.96.0.0/24",
                "--endpoint-reconciler-type=none",
                &format!("--cert-dir={}", p("certs")),
            ])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {KUBE_APISERVER}: {e}"));
        self.apiserver = Some(child);
        self.wait_ready(Duration::from_secs(60));
    }

    /// Polls `/readyz` (as admin) until it answers 200; the time it took.
    pub fn wait_ready(&self, timeout: Duration) -> Duration {
        let start = Instant::now();
        while start.elapsed() < timeout {
            let ok = command_in(&self.ns, "curl")
                .args(["-fsS", "-o", "/dev/null", "--max-time", "1", "--cacert"])
                .arg(self.dir.join("ca.crt"))
                .args([
                    "-H",
                    &format!("Authorization: Bearer {ADMIN_TOKEN}"),
                    &format!("https://{API}/readyz"),
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return start.elapsed();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "the API server was not ready within {timeout:?}; its log:\n{}",
            self.log_tail("kube-apiserver.log")
        );
    }

    fn log_tail(&self, name: &str) -> String {
        let text = fs::read_to_string(self.dir.join(name)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Cuts (`true`) or restores the agent's path to the API server: every packet between
    /// 127.0.0.2:6443 and the agent dropped, silently, as a network partition does (no reset:
    /// the agent's connections stay open and learn nothing).
    pub fn cut_agent(&self, cut: bool) {
        let op = if cut { "-I" } else { "-D" };
        for rule in [
            ["-d", "127.0.0.2", "--dport", "6443"],
            ["-s", "127.0.0.2", "--sport", "6443"],
        ] {
            let out = command_in(&self.ns, "iptables")
                .args([op, "INPUT", "-p", "tcp"])
                .args(rule)
                .args(["-j", "DROP"])
                .output()
                .unwrap_or_else(|e| panic!("iptables: {e}"));
            assert!(
                out.status.success(),
                "iptables {op}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    /// SIGKILL to the API server (etcd keeps running, with everything written).
    pub fn kill_apiserver(&mut self) {
        if let Some(mut child) = self.apiserver.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Runs `f` with a client of `user`, on a thread in the node namespace (where the API
    /// server listens) with a runtime of its own.
    pub fn with<T: Send, F, Fut>(&self, user: User, f: F) -> T
    where
        F: FnOnce(Client) -> Fut + Send,
        Fut: Future<Output = T>,
    {
        let path = self.kubeconfig(user);
        enter(&self.ns, move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a tokio runtime");
            runtime.block_on(async move {
                let kubeconfig = Kubeconfig::read_from(&path).expect("reading the kubeconfig");
                let config =
                    Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                        .await
                        .expect("the kubeconfig");
                let client = Client::try_from(config).expect("a kube client");
                f(client).await
            })
        })
    }

    /// Creates namespace `name` (as admin).
    pub fn create_namespace(&self, name: &str) {
        let ns = Namespace {
            metadata: meta(name, None),
            ..Namespace::default()
        };
        self.with(User::Admin, |c| async move {
            Api::<Namespace>::all(c)
                .create(&PostParams::default(), &ns)
                .await
                .unwrap_or_else(|e| {
                    panic!(
                        "creating namespace {}: {e}",
                        ns.metadata.name.clone().unwrap_or_default()
                    )
                });
        });
    }

    /// `kubectl apply -k DIR` as admin, `DIR` relative to the repository (e.g. the deploy
    /// overlay). `--validate=false`: the manifests use fields newer than v1.20
    /// (`appArmorProfile`), which this API server drops.
    pub fn apply_kustomization(&self, dir: &str) {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(dir);
        let out = command_in(&self.ns, "kubectl")
            .arg("--kubeconfig")
            .arg(self.kubeconfig(User::Admin))
            .args(["apply", "--validate=false", "-k"])
            .arg(&path)
            .output()
            .unwrap_or_else(|e| panic!("kubectl (cargo xtask setup installs it): {e}"));
        assert!(
            out.status.success(),
            "kubectl apply -k {dir}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Grants the agent get/list/watch on the one Secret `namespace/name` (a Role with
    /// `resourceNames` and its RoleBinding), as the deploy overlay does.
    pub fn grant_agent(&self, namespace: &str, name: &str) {
        let role = Role {
            metadata: meta("wgfence-state", Some(namespace)),
            rules: Some(vec![PolicyRule {
                api_groups: Some(vec![String::new()]),
                resources: Some(vec!["secrets".into()]),
                resource_names: Some(vec![name.into()]),
                verbs: vec!["get".into(), "list".into(), "watch".into()],
                ..PolicyRule::default()
            }]),
        };
        let binding = RoleBinding {
            metadata: meta("wgfence-state", Some(namespace)),
            role_ref: RoleRef {
                api_group: "rbac.authorization.k8s.io".into(),
                kind: "Role".into(),
                name: "wgfence-state".into(),
            },
            subjects: Some(vec![Subject {
                kind: "ServiceAccount".into(),
                name: AGENT_ACCOUNT.into(),
                namespace: Some(AGENT_NAMESPACE.into()),
                ..Subject::default()
            }]),
        };
        let namespace = namespace.to_owned();
        self.with(User::Admin, |c| async move {
            Api::<Role>::namespaced(c.clone(), &namespace)
                .create(&PostParams::default(), &role)
                .await
                .unwrap_or_else(|e| panic!("creating the Role: {e}"));
            Api::<RoleBinding>::namespaced(c, &namespace)
                .create(&PostParams::default(), &binding)
                .await
                .unwrap_or_else(|e| panic!("creating the RoleBinding: {e}"));
        });
    }

    /// Creates Secret `namespace/name` with `state` under `state.json` (as admin); its
    /// resourceVersion.
    pub fn create_secret(&self, namespace: &str, name: &str, state: &str) -> String {
        let secret = secret(namespace, name, state);
        let namespace = namespace.to_owned();
        self.with(User::Admin, |c| async move {
            Api::<Secret>::namespaced(c, &namespace)
                .create(&PostParams::default(), &secret)
                .await
                .unwrap_or_else(|e| panic!("creating the Secret: {e}"))
                .metadata
                .resource_version
                .unwrap_or_default()
        })
    }

    /// Patches the Secret's `state.json` to `state` (a merge patch, as admin). Returns when
    /// the API server's response arrived, with that time and the new resourceVersion.
    pub fn patch_secret(&self, namespace: &str, name: &str, state: &str) -> (SystemTime, String) {
        self.patch_secret_data(
            namespace,
            name,
            serde_json::json!({ "state.json": b64(state) }),
        )
    }

    /// Merge-patches the Secret's `data` with `data` (values base64, `null` removes a key).
    pub fn patch_secret_data(
        &self,
        namespace: &str,
        name: &str,
        data: serde_json::Value,
    ) -> (SystemTime, String) {
        let patch = serde_json::json!({ "data": data });
        let (namespace, name) = (namespace.to_owned(), name.to_owned());
        self.with(User::Admin, |c| async move {
            let patched = Api::<Secret>::namespaced(c, &namespace)
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .unwrap_or_else(|e| panic!("patching the Secret: {e}"));
            (
                SystemTime::now(),
                patched.metadata.resource_version.unwrap_or_default(),
            )
        })
    }

    pub fn delete_secret(&self, namespace: &str, name: &str) {
        let (namespace, name) = (namespace.to_owned(), name.to_owned());
        self.with(User::Admin, |c| async move {
            Api::<Secret>::namespaced(c, &namespace)
                .delete(&name, &DeleteParams::default())
                .await
                .unwrap_or_else(|e| panic!("deleting the Secret: {e}"));
        });
    }

    /// The agent's `get` of Secret `namespace/name`: the HTTP status of a refusal, or 200.
    pub fn agent_get_secret(&self, namespace: &str, name: &str) -> u16 {
        let (namespace, name) = (namespace.to_owned(), name.to_owned());
        self.with(User::Agent, |c| async move {
            match Api::<Secret>::namespaced(c, &namespace).get(&name).await {
                Ok(_) => 200,
                Err(kube::Error::Api(status)) => status.code,
                Err(e) => panic!("the agent's get of {namespace}/{name}: {e}"),
            }
        })
    }

    /// The agent's `list` of every Secret in `namespace`: the HTTP status.
    pub fn agent_list_secrets(&self, namespace: &str) -> u16 {
        self.agent_list(namespace, ListParams::default())
    }

    /// The agent's `list` of Secret `namespace/name` by field selector (what its watcher
    /// sends): the HTTP status.
    pub fn agent_list_secret(&self, namespace: &str, name: &str) -> u16 {
        self.agent_list(
            namespace,
            ListParams::default().fields(&format!("metadata.name={name}")),
        )
    }

    fn agent_list(&self, namespace: &str, params: ListParams) -> u16 {
        let namespace = namespace.to_owned();
        self.with(User::Agent, |c| async move {
            match Api::<Secret>::namespaced(c, &namespace).list(&params).await {
                Ok(_) => 200,
                Err(kube::Error::Api(status)) => status.code,
                Err(e) => panic!("the agent's list in {namespace}: {e}"),
            }
        })
    }
}

fn meta(name: &str, namespace: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: namespace.map(str::to_owned),
        ..ObjectMeta::default()
    }
}

fn secret(namespace: &str, name: &str, state: &str) -> Secret {
    Secret {
        metadata: meta(name, Some(namespace)),
        data: Some(
            [(
                "state.json".to_owned(),
                ByteString(state.as_bytes().to_vec()),
            )]
            .into(),
        ),
        ..Secret::default()
    }
}

/// Standard base64 of `s` (a Secret's `data` values in a JSON patch).
pub fn b64(s: &str) -> String {
    base64(s.as_bytes())
}

fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        for child in [self.apiserver.take(), self.etcd.take()]
            .into_iter()
            .flatten()
        {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            eprintln!(
                "--- kube-apiserver log (tail) ---\n{}",
                self.log_tail("kube-apiserver.log")
            );
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_is_standard() {
        assert_eq!(super::b64(""), "");
        assert_eq!(super::b64("f"), "Zg==");
        assert_eq!(super::b64("fo"), "Zm8=");
        assert_eq!(super::b64("foo"), "Zm9v");
        assert_eq!(super::b64("foobar"), "Zm9vYmFy");
    }
}
