//! The kernel's own verdict on a probe: the datapath object (the one the agent embeds and
//! attaches) loaded again, its ingress program run under `BPF_PROG_TEST_RUN` on the probe's
//! packet against the pinned peer, policy and settings maps, with private maps for everything
//! the program writes. The one flow the probe could answer is copied from the live table into
//! the private one first, so a reply decides as it would live, while the live counters, drop
//! events, their rate limiter and the flows' timestamps do not move.

use std::{net::IpAddr, path::Path};

use wgfence_common::{Counter, FlowValue, Variant};

use super::{Probe, ReplyKey};
use crate::dataplane::{pin_dir, Counters, Dataplane, DataplaneError, Flow, Maps, TestProgram};

/// What the kernel decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelVerdict {
    /// The counter the program counted the packet in (its verdict and reason).
    pub counter: Counter,
    /// The program's return value agreed with the counter (pass or drop).
    pub retval: i32,
}

impl KernelVerdict {
    pub fn passed(&self) -> bool {
        self.counter.is_pass()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("nothing is attached to {interface} (no pinned ingress link)")]
    NotAttached { interface: String },
    #[error(transparent)]
    Dataplane(#[from] DataplaneError),
    #[error(
        "the program returned {retval} and counted {moved:?}: not exactly one verdict counter"
    )]
    Verdict { retval: i32, moved: Vec<Counter> },
}

/// The live datapath's decision procedure, ready to run probes.
pub struct KernelProbe {
    program: TestProgram,
    /// The private counters after the last run (only runs move them).
    counters: Counters,
    /// The live maps, opened from their pins: only the flow tables are read.
    live: Maps,
}

impl KernelProbe {
    /// Loads the variant the interface's pinned link runs against the interface's pins.
    pub fn open(bpffs: &Path, interface: &str) -> Result<Self, KernelError> {
        let Some(variant) = Dataplane::running_variant(bpffs, interface)? else {
            return Err(KernelError::NotAttached {
                interface: interface.to_owned(),
            });
        };
        Self::from_pin_dir(&pin_dir(bpffs, interface), variant)
    }

    /// Loads `variant` against the maps pinned in `dir`.
    pub fn from_pin_dir(dir: &Path, variant: Variant) -> Result<Self, KernelError> {
        let program = TestProgram::against_pins(dir, variant)?;
        let counters = program.maps().counters()?;
        let live = Maps::from_pins(dir)?;
        Ok(Self {
            program,
            counters,
            live,
        })
    }

    /// The live maps (read only).
    pub fn live(&self) -> &Maps {
        &self.live
    }

    /// The live flow a probe could answer.
    pub fn live_flow(&self, key: &ReplyKey) -> Result<Option<FlowValue>, DataplaneError> {
        self.live.flow(&flow_of(key, FlowValue::default()))
    }

    /// Runs `probe` once and returns the kernel's verdict.
    pub fn run(&mut self, probe: &Probe) -> Result<KernelVerdict, KernelError> {
        let copied = match probe.seen().answer {
            Some(key) => match self.live_flow(&key)? {
                Some(value) => {
                    let flow = flow_of(&key, value);
                    self.program.maps_mut().insert_flow(&flow)?;
                    Some(flow)
                }
                None => None,
            },
            None => None,
        };
        let frame = probe.frame(self.program.variant().l3_offset);
        let before = self.counters;
        let run = self.program.run(&frame);
        let after = self.program.maps().counters();
        if let Some(flow) = copied {
            self.program.maps_mut().remove_flow_list(&[flow])?;
        }
        let after = after?;
        self.counters = after;
        let run = run?;
        let moved: Vec<Counter> = Counter::ALL
            .into_iter()
            .filter(|c| after.get(*c) != before.get(*c))
            .collect();
        match moved.as_slice() {
            [counter] if counter.is_pass() == run.passed() => Ok(KernelVerdict {
                counter: *counter,
                retval: run.retval,
            }),
            _ => Err(KernelError::Verdict {
                retval: run.retval,
                moved,
            }),
        }
    }
}

fn flow_of(key: &ReplyKey, value: FlowValue) -> Flow {
    Flow {
        peer: key.peer,
        remote: key.remote,
        protocol: key.protocol,
        peer_port: key.peer_port,
        remote_port: key.remote_port,
        value,
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock of `bpf_ktime_get_ns` and the flow timestamps.
pub fn monotonic_ns() -> u64 {
    crate::monitor::Clock::now().monotonic_ns()
}

/// An address of the probe's family; `None` if `addrs` has none.
pub fn of_family(addrs: impl IntoIterator<Item = IpAddr>, like: IpAddr) -> Option<IpAddr> {
    addrs.into_iter().find(|a| a.is_ipv4() == like.is_ipv4())
}
