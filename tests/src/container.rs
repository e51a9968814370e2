//! The agent in its container image, run by podman the way deploy/base/daemonset.yaml runs it:
//! in the node's network namespace (hostNetwork), as root with only CAP_BPF, CAP_PERFMON and
//! CAP_NET_ADMIN, no privilege escalation, a read-only root filesystem, the host's bpffs with
//! HostToContainer propagation, the state as a directory volume at /etc/wgfence (the
//! `..data` layout a Secret volume has) and a small tmpfs at /run/wgfence. [`crate::agent::Agent`]
//! drives it like the bare binary (`Agent::start_container`).
//!
//! One addition the DaemonSet does not have: the host's /run/wireguard, where wireguard-go (the
//! sandbox's WireGuard: this kernel has no module) keeps the UAPI sockets through which the
//! agent manages the interface's peers. Kernel WireGuard is managed over netlink and needs no
//! mount.

use std::{
    path::Path,
    process::{Command, Output},
};

use crate::net::{unique, Netns};

/// Where the DaemonSet mounts the state volume, and the state file the agent is given.
pub const STATE_DIR: &str = "/etc/wgfence";
pub const STATE_FILE: &str = "/etc/wgfence/state.json";
/// The label every agent container carries, so that a run interrupted before it could remove
/// its containers is cleaned up by the next (`cargo xtask image` removes them).
pub const LABEL: &str = "wgfence.test=agent";
/// The capabilities the DaemonSet adds (it drops all others).
pub const CAPABILITIES: [&str; 3] = ["CAP_BPF", "CAP_PERFMON", "CAP_NET_ADMIN"];

/// One agent container: `image` run under a name unique on this machine.
#[derive(Debug)]
pub struct Podman {
    pub image: String,
    pub name: String,
}

impl Podman {
    pub fn new(image: &str) -> Self {
        Self {
            image: image.to_owned(),
            name: unique("wgfence-agent-"),
        }
    }

    /// `podman run` of the image's entrypoint (`wgfence`) in `node`'s network namespace, with
    /// `bpffs` and the state directory `state_dir` mounted as the DaemonSet mounts them; the
    /// agent's arguments follow. Runs in the foreground: the container's output is the
    /// command's, and SIGTERM to it reaches the agent.
    pub fn run_command(&self, node: &Netns, bpffs: &Path, state_dir: &Path) -> Command {
        let mut command = Command::new("podman");
        command
            .args(["run", "--rm", "--pull=never", "--name", &self.name])
            .args(["--label", LABEL])
            .arg(format!("--network=ns:/run/netns/{}", node.name()))
            .args(["--cap-drop=all", "--cap-add", &CAPABILITIES.join(",")])
            .args(["--security-opt=no-new-privileges", "--read-only"])
            .arg(format!(
                "--volume={}:/sys/fs/bpf:rslave",
                bpffs.to_string_lossy()
            ))
            .arg(format!(
                "--volume={}:{STATE_DIR}:ro",
                state_dir.to_string_lossy()
            ))
            .arg("--tmpfs=/run/wgfence:size=1m")
            .arg("--volume=/run/wireguard:/run/wireguard")
            .arg(&self.image);
        command
    }

    /// `podman exec <container> args...` (the agent's image has `wgfence`, `wg`, `ip`).
    pub fn exec(&self, args: &[&str]) -> Output {
        Command::new("podman")
            .args(["exec", &self.name])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("podman exec {args:?}: {e}"))
    }

    /// Removes the container at once (SIGKILL), if it exists.
    pub fn remove(&self) {
        let _ = Command::new("podman")
            .args(["rm", "--force", "--time=0", "--ignore", &self.name])
            .output();
    }
}
