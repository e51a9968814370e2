use std::{
    io,
    path::{Path, PathBuf},
};

use aya::maps::MapError;

/// Errors of the dataplane: loading, attaching, pinning and map access.
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error("interface {interface}")]
    Interface {
        interface: String,
        #[source]
        source: io::Error,
    },
    #[error(
        "interface {interface} has link type {link_type}, which wgfence does not know \
         (expected a WireGuard/TUN device or an Ethernet-like device)"
    )]
    UnsupportedLinkType { interface: String, link_type: u16 },
    #[error(
        "interface {interface} was recreated with another link type; restart the agent to \
         load a program for it"
    )]
    InterfaceChanged { interface: String },
    #[error(
        "pin directory {path} is owned by uid {uid} (not root, not this agent) or is not a \
         directory; remove it (`wgfence detach`) and start again"
    )]
    UnsafePinDir { path: PathBuf, uid: u32 },
    #[error(
        "{path} is locked by another wgfence agent ({}): one agent per interface; this one \
         changed nothing (stop the other first)",
        super::lock::describe_holder(*.holder)
    )]
    Locked { path: PathBuf, holder: Option<u32> },
    #[error(
        "detaching {interface}: after {}s the links {links:?} are still held{}: the programs \
         may still be attached; run `wgfence detach` again to wait longer",
        waited.as_secs(),
        .holder.as_ref().map_or_else(
            || " by another process (see `bpftool link show`)".to_owned(),
            |h| format!(" by the agent ({h}), which lets go when it next checks its pins")
        )
    )]
    DetachTimeout {
        interface: String,
        waited: std::time::Duration,
        links: Vec<u32>,
        /// The agent that still holds the detach marker's lock, if one does.
        holder: Option<String>,
    },
    #[error("{path} is not a mounted BPF filesystem (mount it with `mount -t bpf bpf {path}`)")]
    NotBpffs { path: PathBuf },
    #[error("{path}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("loading the eBPF object")]
    Load(#[from] aya::EbpfError),
    #[error("program {program}")]
    Program {
        program: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("the eBPF object has no map named {0}")]
    MissingMap(&'static str),
    #[error("link {0} is missing: the agent holds no link for that direction")]
    MissingLink(&'static str),
    #[error("map {map}")]
    Map {
        map: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error(
        "pinned map {map} has {found}, this agent expects {expected}; \
         remove it with `wgfence detach` (this drops enforcement until the next start)"
    )]
    LayoutMismatch {
        map: &'static str,
        expected: String,
        found: String,
    },
    #[error(
        "the datapath pinned for this interface runs map layout {running}, newer than this \
         agent's ({this}): refusing to downgrade it. Run the newer agent, or remove the \
         datapath with that version's `wgfence detach` first (this drops enforcement until \
         the next start)"
    )]
    NewerLayout { running: u32, this: u32 },
    #[error(
        "the datapath runs map layout {layout} and its agent still runs (pid {pids:?} holds \
         the link): stop it first, then start this agent, which upgrades the datapath \
         without a gap"
    )]
    OldAgentRunning { layout: u32, pids: Vec<u32> },
    #[error("pinning {path}")]
    Pin {
        path: PathBuf,
        #[source]
        source: aya::pin::PinError,
    },
    #[error("pinned link {path}")]
    Link {
        path: PathBuf,
        #[source]
        source: aya::programs::links::LinkError,
    },
    #[error("{field} out of range: {value}")]
    OutOfRange { field: &'static str, value: u64 },
    #[error("a flow from {peer} to {remote} mixes address families")]
    MixedFamilies {
        peer: std::net::IpAddr,
        remote: std::net::IpAddr,
    },
    #[error("clsact qdisc or filters of {interface}")]
    Qdisc {
        interface: String,
        #[source]
        source: io::Error,
    },
    #[error(
        "{interface} {direction}: priority {priority} handle {handle:#x} holds a filter that is \
         not wgfence's ({found}); wgfence needs that place first in the chain and changed \
         nothing (remove that filter, or move it to another priority)"
    )]
    ForeignFilter {
        interface: String,
        direction: &'static str,
        priority: u16,
        handle: u32,
        found: String,
    },
    #[error(
        "this kernel lacks what the datapath needs: {}; wgfence needs Linux 5.8 or later \
         (see \"Supported kernels\" in docs/operations.md) and changed nothing",
        missing.join(", ")
    )]
    KernelTooOld { missing: Vec<&'static str> },
    #[error(
        "--attach tcx: this kernel has no tcx (it came in Linux 6.6); use --attach tc or auto"
    )]
    NoTcx,
    #[error(
        "{} runs a datapath of map layout {layout}, which this agent (layout 4) does not \
         upgrade directly: run {} on it once, which upgrades {layout} -> {} without a gap, \
         then this one; nothing was changed",
        pin_dir.display(),
        if *layout == 1 {
            "a layout-2 agent (wgfence at commit b4200bd), then a layout-3 agent (commit f530f25)"
        } else {
            "a layout-3 agent (wgfence at commit f530f25)"
        },
        layout + 1
    )]
    UpgradeThroughOlder { pin_dir: PathBuf, layout: u32 },
    #[error("BPF_PROG_TEST_RUN")]
    TestRun(#[source] io::Error),
    #[error(
        "the kernel's tick counter moved {ticks} in {elapsed:?}: no tick rate Linux is built with"
    )]
    TickRate {
        ticks: u32,
        elapsed: std::time::Duration,
    },
}

pub type Result<T, E = DataplaneError> = std::result::Result<T, E>;

/// For `map_err`: an error of the map `map`.
pub(crate) fn map_err(map: &'static str) -> impl Fn(MapError) -> DataplaneError {
    move |source| DataplaneError::Map { map, source }
}

/// For `map_err`: a failed `bpf(2)` call `call` on the map `map` that the agent made itself.
pub(crate) fn syscall_err(
    map: &'static str,
    call: &'static str,
) -> impl Fn(io::Error) -> DataplaneError {
    move |io_error| DataplaneError::Map {
        map,
        source: MapError::SyscallError(aya::sys::SyscallError { call, io_error }),
    }
}

/// For `map_err`: an I/O error at `path`.
pub(crate) fn io_err(path: &Path) -> impl Fn(io::Error) -> DataplaneError + '_ {
    move |source| DataplaneError::Io {
        path: path.to_owned(),
        source,
    }
}
