//! `cargo xtask image [--run]`: builds the agent's container image without a container
//! registry, and with `--run` runs it as deploy/base/daemonset.yaml runs it on the demo's
//! sandbox and checks that it enforces the demo's probes (tests/src/bin/image.rs). Root.
//!
//! 1. Debian packages podman, runc and mmdebstrap, if missing.
//! 2. `cargo xtask build`: the release agent.
//! 3. The base image [`BASE_IMAGE`], made once from Debian's packages: mmdebstrap (minbase,
//!    merged /usr, no docs, man pages or locales, apt's caches cleaned as in debian:12-slim)
//!    from this machine's apt sources, then `podman import`. Later runs reuse it; `podman rmi
//!    localhost/wgfence-debian:12-slim` makes the next run build it anew.
//! 4. `podman build --target prebuilt` of the Containerfile: the runtime stage on that base,
//!    with the agent of step 2. The image it replaces is removed.
//! 5. With `--run`: builds `wgfence-image` and runs it (namespaces, wireguard-go, the
//!    container; it removes all of them when it ends, also on failure).
//!
//! Podman runs with a containers.conf of its own (target/image/containers.conf), which leaves
//! the machine's configuration alone; see [`containers_conf`] for what it sets and why.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};

use crate::{build, util};

#[derive(Args)]
pub struct Options {
    /// Also run the image as the DaemonSet runs it on the demo's sandbox (network namespaces,
    /// wireguard-go peers) and check that it enforces the demo's probes.
    #[arg(long)]
    pub run: bool,
}

/// podman, runc (see [`containers_conf`]) and mmdebstrap for the base image.
const PACKAGES: &[&str] = &["podman", "runc", "mmdebstrap"];
/// The base image made from Debian's packages (the Containerfile's `DEBIAN_IMAGE`).
const BASE_IMAGE: &str = "localhost/wgfence-debian:12-slim";
/// Debian 12: the release of the runtime stage and of CI.
const SUITE: &str = "bookworm";
/// The image, tagged with the workspace's version.
const IMAGE: &str = "localhost/wgfence";
/// What the agent containers of `wgfence-image` are labelled with (tests/src/container.rs
/// `LABEL`): containers a killed run could not remove are removed by the next.
const CONTAINER_LABEL: &str = "wgfence.test=agent";
/// The sandbox tool of `--run`.
const CHECK_TOOL: &str = "wgfence-image";
/// podman's default seccomp profile (containers-common).
const DEFAULT_SECCOMP: &str = "/usr/share/containers/seccomp.json";
/// The syscalls the agent makes that podman 4.3's profile allows only with CAP_SYS_ADMIN, and
/// the capability the moby-derived profiles (containerd's RuntimeDefault) allow each with.
const BPF_SYSCALLS: [(&str, &str); 2] = [("bpf", "CAP_BPF"), ("perf_event_open", "CAP_PERFMON")];
/// debian:12-slim's /etc/apt/apt.conf.d/docker-clean: no package caches, no downloaded .debs
/// left in an image layer.
const APT_CLEAN: &str = r#"DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
"#;

pub fn run(options: &Options) -> Result<()> {
    if !util::is_root() {
        bail!("image needs root (mmdebstrap, podman, and for --run namespaces and BPF): run it as root");
    }
    let start = Instant::now();
    let root = util::workspace_root()?;
    let dir = util::target_dir(&root).join("image");
    fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    crate::setup::ensure_packages(PACKAGES)?;
    let podman = Podman::configure(&dir)?;
    podman.remove_leftover_containers()?;
    let agent = build::build(false)?.agent;
    podman.ensure_base(&dir)?;
    let image = podman.build(&root, &dir, &agent)?;
    eprintln!(
        "image: {image}, {} (base {BASE_IMAGE}: {}), built in {:.1}s",
        podman.size(&image)?,
        podman.size(BASE_IMAGE)?,
        start.elapsed().as_secs_f64()
    );
    if options.run {
        check(&root, &podman, &image, &agent)?;
    }
    eprintln!("image: done in {:.1}s", start.elapsed().as_secs_f64());
    Ok(())
}

/// Builds `wgfence-image` and runs it against `image`; `agent` (the binary in the image) is
/// started directly too, for the side-by-side start-to-ready figure.
fn check(root: &Path, podman: &Podman, image: &str, agent: &Path) -> Result<()> {
    let release = util::target_dir(root).join("release");
    util::run(util::cargo_command(root).args([
        "build",
        "--release",
        "--package",
        "wgfence-tests",
        "--bin",
        CHECK_TOOL,
    ]))
    .with_context(|| format!("building {CHECK_TOOL} failed"))?;
    util::run(
        Command::new(release.join(CHECK_TOOL))
            .env("WGFENCE_IMAGE", image)
            .env("WGFENCE_BIN", agent)
            .env("CONTAINERS_CONF", &podman.conf),
    )
    .context("the image check failed")
}

struct Podman {
    /// The containers.conf every podman command of this task reads.
    conf: PathBuf,
}

impl Podman {
    /// Writes the seccomp profile and containers.conf into `dir`.
    fn configure(dir: &Path) -> Result<Self> {
        let default = fs::read_to_string(DEFAULT_SECCOMP)
            .with_context(|| format!("cannot read podman's seccomp profile {DEFAULT_SECCOMP}"))?;
        let seccomp = dir.join("seccomp.json");
        write(&seccomp, &seccomp_profile(&default)?)?;
        let conf = dir.join("containers.conf");
        write(&conf, &containers_conf(&seccomp))?;
        Ok(Self { conf })
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new("podman");
        cmd.env("CONTAINERS_CONF", &self.conf);
        cmd
    }

    /// Removes the agent containers a killed `--run` left behind.
    fn remove_leftover_containers(&self) -> Result<()> {
        let filter = format!("label={CONTAINER_LABEL}");
        let ids = util::query(
            self.command()
                .args(["ps", "--all", "--quiet", "--filter", &filter]),
        )
        .unwrap_or_default();
        let ids: Vec<&str> = ids.split_whitespace().collect();
        if ids.is_empty() {
            return Ok(());
        }
        eprintln!(
            "removing {} agent container(s) a previous run left",
            ids.len()
        );
        util::run(
            self.command()
                .args(["rm", "--force", "--time=0"])
                .args(&ids),
        )
    }

    fn image_id(&self, image: &str) -> Option<String> {
        util::query(
            self.command()
                .args(["image", "inspect", "--format", "{{.Id}}", image]),
        )
        .map(|id| id.trim().to_owned())
        .filter(|id| !id.is_empty())
    }

    /// The image's size as podman counts it (all layers, uncompressed), in MB.
    fn size(&self, image: &str) -> Result<String> {
        let bytes =
            util::query(
                self.command()
                    .args(["image", "inspect", "--format", "{{.Size}}", image]),
            )
            .and_then(|size| size.trim().parse::<f64>().ok())
            .with_context(|| format!("podman image inspect {image} gave no size"))?;
        Ok(format!("{:.1} MB", bytes / 1e6))
    }

    /// Makes [`BASE_IMAGE`] from Debian's packages unless it exists.
    fn ensure_base(&self, dir: &Path) -> Result<()> {
        if self.image_id(BASE_IMAGE).is_some() {
            eprintln!("ok: base image {BASE_IMAGE}");
            return Ok(());
        }
        let sources = apt_sources()?;
        let apt_clean = dir.join("apt-clean.conf");
        write(&apt_clean, APT_CLEAN)?;
        let tarball = Removed(dir.join("debian-12-slim.tar"));
        let start = Instant::now();
        eprintln!("making the base image {BASE_IMAGE} from Debian's packages ({SUITE})");
        util::run(
            Command::new("mmdebstrap")
                .args(["--variant=minbase", "--format=tar"])
                // Merged /usr without the usrmerge package (which pulls in perl).
                .arg("--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr")
                // What debian:12-slim leaves out; the rules stay in the image, so packages
                // installed later leave them out too.
                .args([
                    "--dpkgopt=path-exclude=/usr/share/man/*",
                    "--dpkgopt=path-exclude=/usr/share/info/*",
                    "--dpkgopt=path-exclude=/usr/share/locale/*",
                    "--dpkgopt=path-exclude=/usr/share/doc/*",
                    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
                ])
                .arg(format!(
                    "--customize-hook=upload {} /etc/apt/apt.conf.d/docker-clean",
                    apt_clean.display()
                ))
                // Made before the configuration above existed; apt-get clean keeps them now.
                .arg(r#"--customize-hook=rm -f "$1"/var/cache/apt/*.bin"#)
                .arg(SUITE)
                .arg(&tarball.0)
                .arg(&sources),
        )
        .context("mmdebstrap failed")?;
        util::run(
            self.command()
                .args(["import", "--change", r#"CMD ["/bin/bash"]"#])
                .arg(&tarball.0)
                .arg(BASE_IMAGE),
        )?;
        eprintln!(
            "ok: base image {BASE_IMAGE} made in {:.1}s",
            start.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// Builds the image from the Containerfile with `agent` as the prebuilt agent; removes the
    /// image the tag pointed to before. Returns the tag.
    fn build(&self, root: &Path, dir: &Path, agent: &Path) -> Result<String> {
        let image = format!("{IMAGE}:{}", env!("CARGO_PKG_VERSION"));
        let context = Removed(dir.join("agent"));
        let _ = fs::remove_dir_all(&context.0);
        fs::create_dir_all(&context.0)
            .with_context(|| format!("cannot create {}", context.0.display()))?;
        fs::copy(agent, context.0.join("wgfence"))
            .with_context(|| format!("cannot copy {}", agent.display()))?;
        let old = self.image_id(&image);
        util::run(
            self.command()
                .args(["build", "--pull=never", "--layers=false"])
                // The runtime stage's apt-get reaches the machine's Debian mirror.
                .arg("--network=host")
                .args(["--build-arg", &format!("DEBIAN_IMAGE={BASE_IMAGE}")])
                .args(["--target", "prebuilt"])
                .arg(format!("--build-context=agent={}", context.0.display()))
                .args(["--tag", &image, "--file"])
                .arg(root.join("Containerfile"))
                .arg(root),
        )
        .context("podman build failed")?;
        if let Some(old) = old.filter(|old| self.image_id(&image).as_ref() != Some(old)) {
            util::run(self.command().args(["rmi", &old]))
                .context("removing the image this build replaced")?;
        }
        Ok(image)
    }
}

/// podman's settings for this task:
/// - runtime runc: Debian 12's crun 1.8 refuses a host with hybrid cgroups ("cgroups in hybrid
///   mode not supported"); runc runs on hybrid and unified hosts.
/// - ulimits: podman as root asks the runtime for nofile and nproc limits above the hard limits
///   it runs under, which root without CAP_SYS_RESOURCE (as in a sandboxed CI) may not raise;
///   4096 of each is ample for the agent.
/// - seccomp: [`seccomp_profile`].
fn containers_conf(seccomp: &Path) -> String {
    format!(
        "[containers]\n\
         default_ulimits = [\"nofile=4096:4096\", \"nproc=4096:4096\"]\n\
         seccomp_profile = \"{}\"\n\
         \n\
         [engine]\n\
         runtime = \"runc\"\n",
        seccomp.display()
    )
}

/// podman's default seccomp profile as containerd's RuntimeDefault (the moby-derived profile
/// the DaemonSet runs under) treats the agent: `bpf` allowed with CAP_BPF and
/// `perf_event_open` with CAP_PERFMON. podman 4.3's profile (containers-common 0.50) allows
/// them only with CAP_SYS_ADMIN, and the agent then fails "attaching the datapath: ...
/// Operation not permitted". Nothing else changes.
fn seccomp_profile(default: &str) -> Result<String> {
    let mut profile: Value =
        serde_json::from_str(default).context("podman's seccomp profile is not JSON")?;
    let rules = profile
        .get_mut("syscalls")
        .and_then(Value::as_array_mut)
        .context("podman's seccomp profile has no `syscalls` list")?;
    for rule in rules.iter_mut() {
        let denied_without_sys_admin = rule["action"] == "SCMP_ACT_ERRNO"
            && rule["excludes"]["caps"] == json!(["CAP_SYS_ADMIN"]);
        if let (true, Some(names)) = (
            denied_without_sys_admin,
            rule.get_mut("names").and_then(Value::as_array_mut),
        ) {
            names.retain(|name| !BPF_SYSCALLS.iter().any(|(syscall, _)| name == syscall));
        }
    }
    for (syscall, cap) in BPF_SYSCALLS {
        let allow = json!({
            "names": [syscall],
            "action": "SCMP_ACT_ALLOW",
            "includes": { "caps": [cap] },
        });
        if !rules.contains(&allow) {
            rules.push(allow);
        }
    }
    serde_json::to_string_pretty(&profile).context("writing the seccomp profile")
}

/// This machine's apt sources (pasted into the base image's, which apt-get in the runtime stage
/// then uses); they must be Debian 12's.
fn apt_sources() -> Result<PathBuf> {
    let os = fs::read_to_string("/etc/os-release").context("cannot read /etc/os-release")?;
    let codename = os
        .lines()
        .find_map(|line| line.strip_prefix("VERSION_CODENAME="))
        .map(|name| name.trim_matches('"'))
        .unwrap_or_default();
    if codename != SUITE {
        bail!(
            "the base image is made from this machine's apt sources, which are for \
             {codename:?}, not Debian 12 ({SUITE}); build on Debian 12, or build from source \
             with a registry (Containerfile header)"
        );
    }
    [
        "/etc/apt/sources.list.d/debian.sources",
        "/etc/apt/sources.list",
    ]
    .into_iter()
    .map(PathBuf::from)
    .find(|path| path.is_file())
    .context("no Debian apt sources in /etc/apt (debian.sources or sources.list)")
}

fn write(path: &Path, contents: &str) -> Result<()> {
    fs::write(path, contents).with_context(|| format!("cannot write {}", path.display()))
}

/// A file or directory removed when this goes out of scope, also on failure.
struct Removed(PathBuf);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seccomp_allows_bpf_with_its_capabilities_and_changes_nothing_else() -> Result<()> {
        let default = r#"{"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [
            {"names": ["read"], "action": "SCMP_ACT_ALLOW"},
            {"names": ["bpf", "mount", "perf_event_open"], "action": "SCMP_ACT_ALLOW",
             "includes": {"caps": ["CAP_SYS_ADMIN"]}},
            {"names": ["bpf", "setns", "perf_event_open"], "action": "SCMP_ACT_ERRNO",
             "excludes": {"caps": ["CAP_SYS_ADMIN"]}, "errnoRet": 1}
        ]}"#;
        let profile: Value = serde_json::from_str(&seccomp_profile(default)?)?;
        let rules = profile["syscalls"].as_array().context("no syscalls")?;
        assert_eq!(profile["defaultAction"], "SCMP_ACT_ERRNO");
        assert_eq!(rules[0]["names"], json!(["read"]));
        // CAP_SYS_ADMIN still allows them; without it only setns stays denied.
        assert_eq!(
            rules[1]["names"],
            json!(["bpf", "mount", "perf_event_open"])
        );
        assert_eq!(rules[2]["names"], json!(["setns"]));
        assert_eq!(rules[3]["includes"]["caps"], json!(["CAP_BPF"]));
        assert_eq!(rules[4]["names"], json!(["perf_event_open"]));
        assert_eq!(rules[4]["includes"]["caps"], json!(["CAP_PERFMON"]));
        // Applied twice, nothing more changes.
        assert_eq!(
            seccomp_profile(&serde_json::to_string(&profile)?)?,
            seccomp_profile(default)?
        );
        Ok(())
    }
}
