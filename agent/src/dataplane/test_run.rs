//! The datapath loaded but not attached, run on crafted packets with `BPF_PROG_TEST_RUN`:
//! for header-parsing tests, differential tests and per-packet cost measurements. aya 0.14 has
//! no wrapper for this command, so it is issued here with the generated `bpf_attr`.

use std::{
    io,
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd},
};

use aya::{Ebpf, EbpfLoader};
use aya_obj::generated::{bpf_attr, bpf_cmd};
use wgfence_common::{map_names, Variant};

use super::{
    classifier,
    error::{DataplaneError, Result},
    maps::Maps,
    program_err, OBJECT,
};

/// Length of the Ethernet header the Ethernet variant expects before the IP header.
#[cfg(any(test, feature = "testing"))]
pub const ETH_HLEN: usize = 14;
/// The least input `BPF_PROG_TEST_RUN` takes for a tc program (it parses the input as an
/// Ethernet header before the program runs; the program still sees every byte from the first).
#[cfg(any(test, feature = "testing"))]
pub const MIN_TEST_INPUT: usize = ETH_HLEN;

/// Index of the loopback device, on which `BPF_PROG_TEST_RUN` runs tc programs.
#[cfg(any(test, feature = "testing"))]
const LOOPBACK_IFINDEX: u32 = 1;
/// `struct __sk_buff` field indexes (u32 words): `ingress_ifindex`, `ifindex`.
const SKB_INGRESS_IFINDEX: usize = 9;
const SKB_IFINDEX: usize = 10;

/// How a loaded test program's drop-event limiter counts time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Events {
    /// As the live datapath's: with the kernel's measured tick length.
    AsLive,
    /// With the object's default tick length (1000 Hz): for events nobody reads.
    Private,
}

/// Outcome of one test run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TestRun {
    /// The program's return value (tcx: -1 next/pass, 2 drop).
    pub retval: i32,
    /// Average run time in nanoseconds, as measured by the kernel.
    pub duration_ns: u32,
}

impl TestRun {
    pub fn passed(&self) -> bool {
        self.retval == -1
    }
}

/// The datapath (one variant's two programs, sharing their maps) with private (unpinned) maps,
/// not attached anywhere.
pub struct TestProgram {
    ebpf: Ebpf,
    maps: Maps,
    variant: Variant,
}

impl TestProgram {
    /// Loads the Ethernet variant: its packets start with an Ethernet header.
    #[cfg(any(test, feature = "testing"))]
    pub fn load() -> Result<Self> {
        Self::load_variant(wgfence_common::VARIANT_ETHERNET)
    }

    /// Loads `variant`; the L3 variant runs on raw IP packets (at least [`MIN_TEST_INPUT`]
    /// bytes: the kernel's minimum).
    #[cfg(any(test, feature = "testing"))]
    pub fn load_variant(variant: Variant) -> Result<Self> {
        Self::load_with(
            EbpfLoader::new(),
            variant,
            &[variant.ingress, variant.egress],
            Events::AsLive,
        )
    }

    /// Loads the object with `loader` (datapath logging off), takes its maps and loads
    /// `programs` of `variant`.
    fn load_with(
        mut loader: EbpfLoader<'_>,
        variant: Variant,
        programs: &[&'static str],
        events: Events,
    ) -> Result<Self> {
        loader.override_global("AYA_LOG_LEVEL", &0u8, false);
        if events == Events::AsLive {
            loader.override_global(super::tick::JIFFY_NS_GLOBAL, super::tick::jiffy_ns(), true);
        }
        let mut ebpf = loader.load(OBJECT)?;
        let maps = Maps::from_ebpf(&mut ebpf, None)?;
        for program in programs {
            classifier(&mut ebpf, program)?
                .load()
                .map_err(program_err(program))?;
        }
        Ok(Self {
            ebpf,
            maps,
            variant,
        })
    }

    /// Loads `variant` with every map pinned in `pin_dir` (created there, or reused when
    /// already pinned), not attached: a stand-in for the live datapath that
    /// [`TestProgram::against_pins`] can probe.
    #[cfg(any(test, feature = "testing"))]
    pub fn load_pinned(variant: Variant, pin_dir: &std::path::Path) -> Result<Self> {
        std::fs::create_dir_all(pin_dir).map_err(|source| DataplaneError::Io {
            path: pin_dir.to_owned(),
            source,
        })?;
        let mut loader = EbpfLoader::new();
        let paths: Vec<_> = map_names::ALL
            .iter()
            .map(|name| (*name, pin_dir.join(name)))
            .collect();
        for (name, path) in &paths {
            loader.map_pin_path(name, path.as_path());
        }
        Self::load_with(
            loader,
            variant,
            &[variant.ingress, variant.egress],
            Events::AsLive,
        )
    }

    /// Loads `variant`'s ingress program against the peer, policy and settings maps pinned in
    /// `pin_dir` (reused, read only: the program never writes them), with private maps for
    /// everything it writes: counters, per-peer counters, drop events, their rate limiter and
    /// the flow tables. Running it decides a packet exactly as the live program would, and
    /// moves nothing live (`wgfence explain`). A map that is not pinned is an error, never
    /// created.
    pub fn against_pins(pin_dir: &std::path::Path, variant: Variant) -> Result<Self> {
        let mut loader = EbpfLoader::new();
        let shared = [
            map_names::PEERS_V4,
            map_names::PEERS_V6,
            map_names::POLICY_V4,
            map_names::POLICY_V6,
            map_names::CONFIG,
        ];
        let paths: Vec<_> = shared.iter().map(|name| pin_dir.join(name)).collect();
        for (name, path) in shared.iter().zip(&paths) {
            if !path.exists() {
                return Err(DataplaneError::Io {
                    path: path.clone(),
                    source: io::Error::new(io::ErrorKind::NotFound, "map not pinned"),
                });
            }
            loader.map_pin_path(name, path.as_path());
        }
        // Its drop events go to a private ring nobody reads: the object's default tick length
        // serves, and `wgfence explain` does not wait for the tick rate's measurement.
        Self::load_with(loader, variant, &[variant.ingress], Events::Private)
    }

    pub fn variant(&self) -> Variant {
        self.variant
    }

    pub fn maps(&self) -> &Maps {
        &self.maps
    }

    pub fn maps_mut(&mut self) -> &mut Maps {
        &mut self.maps
    }

    /// Runs the ingress program (packets from peers) once on `frame` (Ethernet header
    /// included for the Ethernet variant, raw IP for the L3 variant).
    pub fn run(&mut self, frame: &[u8]) -> Result<TestRun> {
        self.run_repeat(frame, 1)
    }

    /// Runs the ingress program `repeat` times on `frame`; the kernel reports the average
    /// duration.
    pub fn run_repeat(&mut self, frame: &[u8], repeat: u32) -> Result<TestRun> {
        self.run_program(self.variant.ingress, frame, repeat, None)
    }

    /// Runs the egress program (packets to peers) `repeat` times on `frame`.
    #[cfg(any(test, feature = "testing"))]
    pub fn run_egress(&mut self, frame: &[u8], repeat: u32) -> Result<TestRun> {
        self.run_program(self.variant.egress, frame, repeat, None)
    }

    /// Runs the egress program once on `frame` as a packet that came in on the interface the
    /// program runs on (`__sk_buff.ingress_ifindex == ifindex`, the loopback device under
    /// `BPF_PROG_TEST_RUN`): a peer's packet the node sent back into the tunnel.
    #[cfg(any(test, feature = "testing"))]
    pub fn run_egress_hairpin(&mut self, frame: &[u8]) -> Result<TestRun> {
        self.run_program(self.variant.egress, frame, 1, Some(LOOPBACK_IFINDEX))
    }

    fn run_program(
        &mut self,
        program: &'static str,
        frame: &[u8],
        repeat: u32,
        ingress_ifindex: Option<u32>,
    ) -> Result<TestRun> {
        let fd = classifier(&mut self.ebpf, program)?
            .fd()
            .map_err(program_err(program))?;
        test_run(fd.as_fd(), frame, repeat, ingress_ifindex)
    }

    /// The loaded ingress program, e.g. to run it from several threads at once with
    /// [`test_run`].
    #[cfg(any(test, feature = "testing"))]
    pub fn ingress_fd(&mut self) -> Result<BorrowedFd<'_>> {
        let program = self.variant.ingress;
        let fd = classifier(&mut self.ebpf, program)?
            .fd()
            .map_err(program_err(program))?;
        Ok(fd.as_fd())
    }
}

/// Runs the loaded tc program `prog` `repeat` times on `frame` with `BPF_PROG_TEST_RUN`, on the
/// calling thread's CPU; `ingress_ifindex` sets `__sk_buff.ingress_ifindex`.
pub fn test_run(
    prog: BorrowedFd<'_>,
    frame: &[u8],
    repeat: u32,
    ingress_ifindex: Option<u32>,
) -> Result<TestRun> {
    let prog_fd = prog.as_raw_fd();
    let data_size_in = u32::try_from(frame.len()).map_err(|_| DataplaneError::OutOfRange {
        field: "test packet length",
        value: frame.len() as u64,
    })?;

    // SAFETY: bpf_attr is a plain C union; all-zero is its documented initial state.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    attr.test.prog_fd = prog_fd as u32;
    attr.test.data_in = frame.as_ptr() as u64;
    attr.test.data_size_in = data_size_in;
    attr.test.repeat = repeat;
    // The start of a `struct __sk_buff`, up to and including `ifindex`: the kernel takes
    // `ingress_ifindex` from it, and an `ifindex` of 0 leaves the loopback device.
    let mut skb = [0u32; SKB_IFINDEX + 1];
    if let Some(index) = ingress_ifindex {
        skb[SKB_INGRESS_IFINDEX] = index;
        attr.test.ctx_in = skb.as_ptr() as u64;
        attr.test.ctx_size_in = std::mem::size_of_val(&skb) as u32;
    }
    // SAFETY: BPF_PROG_TEST_RUN reads `frame` (valid for data_size_in bytes) and `skb`
    // (valid for ctx_size_in bytes) and writes retval and duration into `attr`; no output
    // buffers are given.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            bpf_cmd::BPF_PROG_TEST_RUN as libc::c_long,
            &mut attr as *mut bpf_attr,
            std::mem::size_of::<bpf_attr>(),
        )
    };
    if rc < 0 {
        return Err(DataplaneError::TestRun(io::Error::last_os_error()));
    }
    // SAFETY: the kernel filled the `test` member.
    let (retval, duration_ns) = unsafe { (attr.test.retval as i32, attr.test.duration) };
    Ok(TestRun {
        retval,
        duration_ns,
    })
}
