//! The kernel side: load the embedded datapath, attach its two programs with tcx to the
//! WireGuard interface (ingress: enforcement; egress: reply flows), pin its maps and links under
//! `<bpffs>/wgfence/<interface>/`, adopt them on the next start, and give typed access to the
//! maps.
//!
//! Restart safety: a second [`Dataplane::attach`] reuses the pinned maps (after checking their
//! layout) and replaces each program through its pinned link with `bpf_link_update`, so there
//! is no instant without a program or without the maps' contents.
//!
//! While it runs, the agent holds the links and every map open itself, and an exclusive lock on
//! its pin directory (one agent per interface, see [`lock`]), so [`Dataplane::check`] can repair
//! what happens behind its back: a WireGuard interface deleted and created again (the old tcx
//! links died with the old device: attach new ones), one link detached (that hook only gets a
//! new link; the other is never touched), the interface renamed and a new one created under
//! its name (the new device gets new links; the renamed one keeps the agent's old links, and
//! its enforcement, until it goes; a new link is always in place before an old one is let go),
//! and pins, the pin directory, `<bpffs>/wgfence`
//! or the whole bpffs removed (create the directory again, lock it, pin everything again from
//! the agent's own descriptors). Only `wgfence detach` releases enforcement: it renames the
//! directory to its marker (`detaching-<interface>-<pid>`), where the agent finds the very
//! directory it locked, lets go of its links and does not re-attach; `detach` returns once the
//! links are gone.
//!
//! Where each part lives: `attach.rs` (claim the interface, load or adopt, switch, tidy),
//! `load.rs` (the object loaded, or the running programs adopted), `links.rs` (restart: the
//! programs replaced through their pinned links), `upgrade.rs` (the maps of an older layout
//! carried over), `check.rs` (the repairs of [`Dataplane::check`]), `detach.rs`, `pins.rs`
//! (the pin directory on bpffs), `inspect.rs` (a datapath read without attaching to it), and
//! `maps.rs` (typed access to the maps).

mod attach;
mod check;
mod detach;
mod error;
pub mod hook;
mod iface;
mod inspect;
mod layout;
mod links;
mod load;
mod lock;
mod maps;
mod pins;
mod sys;
pub mod tc;
mod test_run;
pub mod tick;
mod trie_btf;
mod tries;
mod upgrade;

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use aya::{
    maps::MapData,
    programs::{SchedClassifier, TcAttachType},
    Ebpf,
};
use wgfence_common::Variant;

use check::Retired;
pub use error::{DataplaneError, Result};
pub use hook::{HookKind, HookMode};
use load::classifier;
use lock::{Acquired, PinDirLock};
pub use maps::{Counters, Flow, Maps, PolicyEntry};
use sys::HeldLink;
pub use test_run::{test_run, TestProgram, TestRun};
#[cfg(any(test, feature = "testing"))]
pub use test_run::{ETH_HLEN, MIN_TEST_INPUT};
pub use upgrade::UpgradeReport;

/// The datapath object, built from `ebpf/` by `build.rs`.
pub(crate) static OBJECT: &[u8] = aya::include_bytes_aligned!(env!("WGFENCE_BPF_OBJECT"));

/// Where the build left the benchmark's floor programs (`ebpf/src/floor.rs`): a path, read
/// by `cargo xtask bench` on the machine that built it. The agent never loads them.
#[cfg(any(test, feature = "testing"))]
pub const FLOOR_OBJECT_PATH: &str = env!("WGFENCE_FLOOR_OBJECT");

/// Where bpffs is normally mounted.
pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf";
/// File name of the pinned ingress tcx link inside an interface's pin directory.
pub const LINK_PIN_INGRESS: &str = "link_ingress";
/// File name of the pinned egress tcx link inside an interface's pin directory.
pub const LINK_PIN_EGRESS: &str = "link_egress";

/// What the agent pins in an interface's pin directory on the tcx hook, as the docs list it:
/// every map, the two directories of policy tries (a pin per policy in each), the tombstones
/// that stop an agent of layouts 1 to 3 (placed at every start), the two links, and the two
/// programs (`prog_<direction>_<identity>`, with `<identity>` standing
/// for the hash [`program_identity`] makes). The legacy tc hook pins no link; an upgrade in
/// progress adds its marker for a while. The docs test compares the lists in README.md and
/// docs/operations.md with this one.
#[cfg(any(test, feature = "testing"))]
pub fn pins() -> Vec<String> {
    let mut pins: Vec<String> = wgfence_common::map_names::ALL
        .iter()
        .chain(&[
            wgfence_common::map_names::TRIES_V4,
            wgfence_common::map_names::TRIES_V6,
        ])
        .chain(&upgrade::TOMBSTONE_PINS)
        .map(|n| (*n).to_owned())
        .collect();
    for hook in hooks(&wgfence_common::VARIANT_ETHERNET) {
        pins.push(hook.link_pin.to_owned());
        pins.push(format!(
            "{}{}_<identity>",
            load::PROGRAM_PIN_PREFIX,
            hook.direction
        ));
    }
    pins
}

/// One program of the datapath and where it hooks in.
struct Hook {
    program: &'static str,
    attach_type: TcAttachType,
    /// The same, as `enum bpf_attach_type`.
    bpf_attach_type: u32,
    link_pin: &'static str,
    direction: &'static str,
}

/// The programs of `variant` and their hooks. Egress first: on a first start, flows are
/// recorded before the ingress side judges replies.
const fn hooks(variant: &Variant) -> [Hook; 2] {
    [
        Hook {
            program: variant.egress,
            attach_type: TcAttachType::Egress,
            bpf_attach_type: sys::BPF_TCX_EGRESS,
            link_pin: LINK_PIN_EGRESS,
            direction: "egress",
        },
        Hook {
            program: variant.ingress,
            attach_type: TcAttachType::Ingress,
            bpf_attach_type: sys::BPF_TCX_INGRESS,
            link_pin: LINK_PIN_INGRESS,
            direction: "ingress",
        },
    ]
}

/// aya-log's global log level: 0 switches datapath logging off.
const AYA_LOG_LEVEL: &str = "AYA_LOG_LEVEL";
/// aya-log's `Level::Debug`.
const LOG_LEVEL_DEBUG: u8 = 4;
/// statfs(2) magic of a BPF filesystem.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
/// How long `wgfence detach` waits, by default, for a running agent to let go of its links.
pub const DETACH_TIMEOUT: Duration = Duration::from_secs(10);

/// The pin directory of one interface: `<bpffs>/wgfence/<interface>`.
pub fn pin_dir(bpffs: &Path, interface: &str) -> PathBuf {
    bpffs.join("wgfence").join(interface)
}

/// Refuses at once, naming the holder, when another agent holds the lock of `interface`'s pin
/// directory: a check before `wgfence run` binds its ports, so that a second agent on the same
/// interface is told of the first rather than of a port in use. Reads `/proc/locks` only and
/// takes no lock (an agent starting at the same instant must not find it taken); a holder in
/// another pid namespace is not visible here, and is found by the lock that counts, the one
/// [`Dataplane::attach`] takes.
pub fn refuse_if_locked(bpffs: &Path, interface: &str) -> Result<()> {
    let dir = pin_dir(bpffs, interface);
    match lock::holder_of(&dir) {
        Some(pid) => Err(DataplaneError::Locked {
            path: dir,
            holder: Some(pid),
        }),
        None => Ok(()),
    }
}

#[derive(Debug, Clone)]
pub struct AttachOptions {
    pub interface: String,
    pub bpffs: PathBuf,
    /// Compile the datapath's debug log statements in (they cost a ring buffer write per drop).
    pub datapath_debug: bool,
    /// Which hook to attach with (`--attach`).
    pub hook: HookMode,
}

impl AttachOptions {
    pub fn new(interface: impl Into<String>) -> Self {
        Self {
            interface: interface.into(),
            bpffs: PathBuf::from(DEFAULT_BPFFS),
            datapath_debug: false,
            hook: HookMode::Auto,
        }
    }

    pub fn hook(mut self, hook: HookMode) -> Self {
        self.hook = hook;
        self
    }

    pub fn bpffs(mut self, bpffs: impl Into<PathBuf>) -> Self {
        self.bpffs = bpffs.into();
        self
    }

    /// The aya-log level the datapath is loaded with: debug with `datapath_debug`, else off.
    fn log_level(&self) -> u8 {
        if self.datapath_debug {
            LOG_LEVEL_DEBUG
        } else {
            0
        }
    }
}

/// How the program came to be on the interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attachment {
    /// No pinned ingress link existed: the program was attached and the link pinned.
    Created,
    /// A pinned ingress link existed and now runs this program (atomic replacement).
    Replaced,
}

/// What [`Dataplane::check`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Check {
    /// Attached to the interface as it is now, every pin in place.
    Intact,
    /// Something was repaired.
    Repaired {
        repairs: Vec<Repair>,
        /// A program was attached again: to a new device (the interface was recreated or
        /// renamed away: its WireGuard peers are gone too), or to a hook of the same device
        /// that lost its link or filter. The caller reads the kernel again.
        reattached: bool,
    },
    /// The programs are attached and enforcing (the agent holds the links and maps), but pins
    /// are missing and could not be restored (e.g. bpffs is not mounted, or another process
    /// locked a new pin directory): the next start would not adopt them. Checked again every
    /// time.
    Unpinned {
        /// What was repaired before the failure.
        repairs: Vec<Repair>,
        error: String,
    },
    /// The interface does not exist (now): nothing to attach to until it comes back.
    InterfaceGone,
    /// `wgfence detach` renamed the pin directory to its marker: the agent let go of the links
    /// and the lock, the programs are detached, and nothing is re-attached until the agent
    /// starts again.
    Detached,
}

/// One repair [`Dataplane::check`] made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Repair {
    /// The pin directory (or `<bpffs>/wgfence`, or the whole bpffs) was gone or replaced, and
    /// not by `wgfence detach`: created again (0700) and locked again.
    PinDir,
    /// A map's pin was missing: pinned again from the agent's descriptor.
    MapPin(&'static str),
    /// A link's pin was missing: pinned again from the agent's descriptor.
    LinkPin(&'static str),
    /// A program's pin (tcx: what the next start takes over) was missing: pinned again from
    /// the agent's descriptor.
    ProgramPin(&'static str),
    /// The interface was recreated: new links attached.
    Reattached { ifindex: u32 },
    /// A directory of policy tries was gone while the datapath held tries: made again; the
    /// tries (which the datapath keeps using) are written again by a resync, since the agent
    /// reaches a trie only through its pin.
    PolicyTries(&'static str),
}

impl Repair {
    /// Every kind, as [`Repair::kind`] names them (for metric labels).
    pub const KINDS: [&'static str; 6] = [
        "pin_dir",
        "map_pin",
        "link_pin",
        "program_pin",
        "reattach",
        "policy_tries",
    ];

    /// The kind of repair, for a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Repair::PinDir => "pin_dir",
            Repair::MapPin(_) => "map_pin",
            Repair::LinkPin(_) => "link_pin",
            Repair::ProgramPin(_) => "program_pin",
            Repair::Reattached { .. } => "reattach",
            Repair::PolicyTries(_) => "policy_tries",
        }
    }
}

impl std::fmt::Display for Repair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Repair::PinDir => write!(f, "created the pin directory again"),
            Repair::MapPin(name) => write!(f, "pinned map {name} again"),
            Repair::LinkPin(name) => write!(f, "pinned the link {name} again"),
            Repair::ProgramPin(name) => write!(f, "pinned the program {name} again"),
            Repair::Reattached { ifindex } => {
                write!(f, "attached to the recreated interface (index {ifindex})")
            }
            Repair::PolicyTries(name) => write!(
                f,
                "made {name} again; its policies' tries are written again by a resync"
            ),
        }
    }
}

/// The attached datapath of one interface and its maps.
pub struct Dataplane {
    interface: String,
    bpffs: PathBuf,
    pin_dir: PathBuf,
    maps: Maps,
    /// What the attach did on the ingress hook.
    ingress_attachment: Attachment,
    /// The loaded object; kept so the datapath's log ring buffer stays readable and the
    /// programs can be attached again.
    ebpf: Ebpf,
    /// The programs adopted from the running datapath instead of loading the object's (see
    /// [`adopt_programs`]), by program name; empty when the object's were loaded.
    adopted: Vec<(&'static str, SchedClassifier)>,
    /// The tcx links, one per [`hooks`] entry, held open: pins removed by hand do not detach
    /// the programs while the agent runs, and can be pinned again from here. `None` on the tc
    /// hook (a filter has no link: it stays until deleted).
    links: Vec<Option<HeldLink>>,
    /// Links on a device this agent attached to before, which is no longer the one named
    /// `interface` but still runs the programs through them (renamed while its peers stay
    /// connected): held, so it stays enforced until it goes, and never pinned.
    retired: Vec<Retired>,
    /// The hook the programs run on.
    hook: HookKind,
    /// The agent added the clsact qdisc (tc hook): marked in the pin directory for `detach`.
    added_qdisc: bool,
    /// What identifies the programs (part of their pin names, see `load::program_identity`).
    identity: String,
    /// The exclusive lock on the pin directory; `None` once detached.
    lock: Option<PinDirLock>,
    /// `wgfence detach` took the pin directory: the links are let go and never attached again.
    detached: bool,
    /// The last check could not restore the pins, for this reason (logged once per reason).
    unpinned: Option<String>,
    /// The interface index the links were made for.
    ifindex: u32,
    /// The program variant loaded for that interface (where the IP header starts).
    variant: Variant,
    /// The maps, opened a second time to pin them again if their pins are removed.
    map_pins: Vec<(&'static str, MapData)>,
    /// What this attach carried over from a datapath of an older layout, if it upgraded one.
    upgraded: Option<UpgradeReport>,
}

impl Dataplane {
    pub fn interface(&self) -> &str {
        &self.interface
    }

    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// What the attach did on the ingress hook.
    pub fn ingress_attachment(&self) -> Attachment {
        self.ingress_attachment
    }

    /// The hook the programs run on.
    pub fn hook(&self) -> HookKind {
        self.hook
    }

    /// What this attach carried over from a datapath of an older layout, if it upgraded one.
    pub fn upgraded(&self) -> Option<&UpgradeReport> {
        self.upgraded.as_ref()
    }

    /// The program variant this dataplane loaded for its interface.
    pub fn variant(&self) -> Variant {
        self.variant
    }

    pub fn maps(&self) -> &Maps {
        &self.maps
    }

    pub fn maps_mut(&mut self) -> &mut Maps {
        &mut self.maps
    }

    /// The loaded object, e.g. for `aya_log::EbpfLogger::init`.
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }
}

fn program_err(program: &'static str) -> impl Fn(aya::programs::ProgramError) -> DataplaneError {
    move |source| DataplaneError::Program { program, source }
}
