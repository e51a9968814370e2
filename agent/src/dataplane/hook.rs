//! Which hook the datapath's programs run on, and whether this kernel can run them at all.
//!
//! - `tcx` (Linux 6.6+): a bpf_link per direction, first in the tcx chain, pinned in the pin
//!   directory; a restart swaps the program with `bpf_link_update`.
//! - `tc` (legacy, any kernel the datapath runs on): a direct-action `cls_bpf` filter per
//!   direction on a `clsact` qdisc, at a fixed priority and handle ([`super::tc`]).
//!
//! `--attach auto` (the default) takes tcx where the kernel has it and tc where it has not.
//! Both are probed, not read off the version string: tcx by a `BPF_PROG_QUERY` on the
//! interface's tcx hook (EINVAL where the attach type does not exist), the datapath's needs by
//! creating a map of each type it uses (aya's feature probes).

use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{is_map_supported, is_program_supported},
};

use super::{sys, DataplaneError, Result};

/// What the operator asked for (`--attach`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum HookMode {
    /// tcx where the kernel has it, else tc.
    #[default]
    Auto,
    Tcx,
    Tc,
}

/// The hook in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HookKind {
    Tcx,
    Tc,
}

impl HookKind {
    pub fn name(self) -> &'static str {
        match self {
            HookKind::Tcx => "tcx",
            HookKind::Tc => "tc",
        }
    }
}

impl std::fmt::Display for HookKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether the kernel has tcx: a query of the interface's tcx ingress hook. A kernel without
/// tcx does not know the attach type (EINVAL).
pub fn tcx_supported(ifindex: u32) -> Result<bool> {
    match sys::tcx_program_ids(ifindex, sys::BPF_TCX_INGRESS) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(source) => Err(DataplaneError::Interface {
            interface: format!("index {ifindex}"),
            source,
        }),
    }
}

/// The hook for `mode` on this kernel.
pub fn choose(mode: HookMode, ifindex: u32) -> Result<HookKind> {
    match mode {
        HookMode::Tc => Ok(HookKind::Tc),
        HookMode::Tcx if tcx_supported(ifindex)? => Ok(HookKind::Tcx),
        HookMode::Tcx => Err(DataplaneError::NoTcx),
        HookMode::Auto if tcx_supported(ifindex)? => Ok(HookKind::Tcx),
        HookMode::Auto => Ok(HookKind::Tc),
    }
}

/// What the datapath needs from the kernel, with the Linux version that brought it. The
/// newest of them sets the minimum (5.8, the ring buffer).
pub const REQUIREMENTS: [(&str, &str); 5] = [
    ("BPF ring buffer (drop events, datapath log)", "5.8"),
    ("LPM trie maps (policies)", "4.11"),
    ("per-CPU array maps (counters)", "4.6"),
    ("hash maps (peers, flows)", "3.19"),
    ("sched_cls programs (tc/tcx classifiers)", "4.1"),
];

/// Probes each requirement by creating a map (or loading a program) of its type: the names
/// of those this kernel lacks. Creates nothing that outlives the call.
pub fn missing_requirements() -> Vec<&'static str> {
    let [ringbuf, lpm, percpu, hash, sched_cls] = REQUIREMENTS.map(|(what, _)| what);
    let mut missing = Vec::new();
    for (what, map_type) in [
        (ringbuf, MapType::RingBuf),
        (lpm, MapType::LpmTrie),
        (percpu, MapType::PerCpuArray),
        (hash, MapType::Hash),
    ] {
        // A probe that fails for another reason (e.g. no CAP_BPF) is not a missing feature:
        // the load that follows says what is wrong.
        if matches!(is_map_supported(map_type), Ok(false)) {
            missing.push(what);
        }
    }
    if matches!(
        is_program_supported(ProgramType::SchedClassifier),
        Ok(false)
    ) {
        missing.push(sched_cls);
    }
    missing
}

/// [`missing_requirements`] as an error: a kernel below the minimum gets it before the agent
/// changes anything.
pub fn check_kernel() -> Result<()> {
    let missing = missing_requirements();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(DataplaneError::KernelTooOld { missing })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_kernel_has_everything_the_datapath_needs() {
        // The test machine runs 6.18: nothing may be reported missing (a probe that wrongly
        // reported a feature missing would refuse every start).
        if unsafe { libc::geteuid() } != 0 {
            return;
        }
        assert_eq!(missing_requirements(), Vec::<&str>::new());
    }
}
