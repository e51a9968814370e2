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

mod error;
pub mod hook;
mod iface;
mod layout;
mod lock;
mod maps;
mod sys;
pub mod tc;
mod test_run;
mod upgrade;

use std::{
    fs,
    io::{self, ErrorKind},
    os::unix::fs::DirBuilderExt as _,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use aya::{
    maps::MapData,
    programs::{
        links::{FdLink, LinkOrder, PinnedLink},
        tc::{SchedClassifierLink, TcAttachOptions},
        SchedClassifier, TcAttachType,
    },
    Ebpf, EbpfLoader,
};
use wgfence_common::{map_names, Variant, VARIANTS};

pub use error::{DataplaneError, Result};
pub use hook::{HookKind, HookMode};
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
/// every map, the tombstones that stop an agent of layout 1 or 2 (placed at every start), the
/// two links, and the two programs (`prog_<direction>_<identity>`, with `<identity>` standing
/// for the hash [`program_identity`] makes). The legacy tc hook pins no link; an upgrade in
/// progress adds its marker for a while. The docs test compares the lists in README.md and
/// docs/operations.md with this one.
#[cfg(any(test, feature = "testing"))]
pub fn pins() -> Vec<String> {
    let mut pins: Vec<String> = map_names::ALL
        .iter()
        .chain(&upgrade::TOMBSTONE_PINS)
        .map(|n| (*n).to_owned())
        .collect();
    for hook in hooks(&wgfence_common::VARIANT_ETHERNET) {
        pins.push(hook.link_pin.to_owned());
        pins.push(format!("{PROGRAM_PIN_PREFIX}{}_<identity>", hook.direction));
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
    /// The interface was recreated: new links attached.
    Reattached { ifindex: u32 },
}

impl Repair {
    /// Every kind, as [`Repair::kind`] names them (for metric labels).
    pub const KINDS: [&'static str; 4] = ["pin_dir", "map_pin", "link_pin", "reattach"];

    /// The kind of repair, for a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Repair::PinDir => "pin_dir",
            Repair::MapPin(_) => "map_pin",
            Repair::LinkPin(_) => "link_pin",
            Repair::Reattached { .. } => "reattach",
        }
    }
}

impl std::fmt::Display for Repair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Repair::PinDir => write!(f, "created the pin directory again"),
            Repair::MapPin(name) => write!(f, "pinned map {name} again"),
            Repair::LinkPin(name) => write!(f, "pinned the link {name} again"),
            Repair::Reattached { ifindex } => {
                write!(f, "attached to the recreated interface (index {ifindex})")
            }
        }
    }
}

/// What an attach holds before anything in the kernel changes: the interface's device and the
/// hook chosen on it, and its pin directory, locked.
struct Claim {
    ifindex: u32,
    kind: HookKind,
    pin_dir: PathBuf,
    lock: PinDirLock,
    /// The agent's clsact qdisc is on the device (marked, or left by an interrupted detach).
    added_qdisc: bool,
}

/// Claims the interface for this agent: bpffs mounted, the hook chosen, the pin directory
/// locked (another agent on this interface is an error), and an interrupted detach finished.
fn claim(options: &AttachOptions, hooks: &[Hook; 2]) -> Result<Claim> {
    let interface = options.interface.as_str();
    ensure_bpffs(&options.bpffs)?;
    let (ifindex, kind) = choose_hook(interface, options.hook, hooks)?;
    let pin_dir = pin_dir(&options.bpffs, interface);
    // Before anything in the kernel changes: another agent on this interface is an error.
    let lock = lock_pin_dir(&pin_dir)?;
    // An interrupted detach left its links attached under another name: finish it first,
    // or its program would stay in the chain beside ours. Its filters (tc) are at the
    // agent's place: taken over below.
    let added_qdisc = remove_detaching(&options.bpffs, interface)?.added_qdisc
        || pin_dir.join(tc::QDISC_MARKER).is_dir();
    Ok(Claim {
        ifindex,
        kind,
        pin_dir,
        lock,
        added_qdisc,
    })
}

/// Where [`Dataplane::check`] found the pin directory this agent locked.
enum PinDirState {
    /// In place.
    Ours,
    /// Gone or replaced, not by a detach: created and locked again.
    Restored,
    /// Renamed to this detach marker by `wgfence detach`.
    Detaching(PathBuf),
}

/// One hook for [`Dataplane::check`] to repair: its index in [`hooks`], the device's index
/// now, whether the device is another than the links were made for, and whether the hook's
/// program is missing from it.
#[derive(Clone, Copy)]
struct LinkFix<'a> {
    i: usize,
    hook: &'a Hook,
    ifindex: u32,
    moved: bool,
    missing: bool,
}

/// A link the agent holds on a device that no longer has the interface's name.
struct Retired {
    ifindex: u32,
    hook: usize,
    _link: HeldLink,
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
    /// Loads the datapath and attaches it to the interface's ingress and egress, adopting
    /// whatever is pinned for it: pinned maps keep their contents, pinned links get the new
    /// programs.
    ///
    /// Must run in the interface's network namespace.
    pub fn attach(options: &AttachOptions) -> Result<Self> {
        let interface = options.interface.as_str();
        let started = Instant::now();
        let variant = iface::variant(interface)?;
        let hooks = hooks(&variant);
        let claim = claim(options, &hooks)?;
        let (ifindex, kind, pin_dir) = (claim.ifindex, claim.kind, claim.pin_dir);
        // Links that run an older layout's programs: fill the new maps from the old ones
        // before the switch (see `upgrade`). Decided before the loader creates anything.
        let mut upgrade = prepare_upgrade(&pin_dir, &hooks, ifindex)?;
        let log_level = options.log_level();
        let prelude = started.elapsed();
        let (mut ebpf, mut maps, map_pins, object) = load_object(&pin_dir, log_level, started)?;
        let maps_opened = started.elapsed();
        let identity = program_identity(log_level, &variant);
        let may_adopt = upgrade.is_none() && kind == HookKind::Tcx;
        let mut adopted =
            adopt_or_load(&pin_dir, &hooks, &identity, &map_pins, &mut ebpf, may_adopt)?;
        let verified = started.elapsed();
        if let Some(upgrade) = upgrade.as_mut() {
            fill_and_mark(upgrade, &pin_dir, &hooks, &mut ebpf, &mut adopted)?;
        }
        let added_qdisc = mark_hook(kind, interface, &pin_dir, claim.added_qdisc)?;
        let switch = Instant::now();
        let (ingress_attachment, links) = Switch {
            kind,
            hooks: &hooks,
            variant: &variant,
            interface,
            ifindex,
            pin_dir: &pin_dir,
            upgrading: upgrade.is_some(),
        }
        .run(&mut ebpf, &mut adopted)?;
        let switch = switch.elapsed();
        let switched = started.elapsed();
        if kind == HookKind::Tcx && adopted.is_empty() {
            keep_programs(&pin_dir, &hooks, &identity, &mut ebpf);
        }
        let upgraded = upgrade.and_then(|upgrade| finish_upgrade(upgrade, &pin_dir, switch));
        tidy_old_layouts(&pin_dir);
        // The programs run on the chosen hook now: what the agent left on the other one (a
        // switch of --attach) goes, after, so no packet meets neither.
        remove_other_hook(kind, &pin_dir, interface, ifindex)?;
        // The quota counts as the tables are now (nothing else reconciles them).
        let recount = recount_flow_quota(&mut maps, interface);
        let phases = Phases {
            prelude,
            object,
            maps_opened,
            verified,
            switched,
            recount,
            total: started.elapsed(),
        };
        phases.log(interface, !adopted.is_empty());
        log_attached(interface, &pin_dir, &variant, kind, ingress_attachment);
        Ok(Self {
            upgraded,
            interface: interface.to_owned(),
            bpffs: options.bpffs.clone(),
            pin_dir,
            maps,
            ingress_attachment,
            ebpf,
            adopted,
            links,
            retired: Vec::new(),
            hook: kind,
            added_qdisc,
            lock: Some(claim.lock),
            detached: false,
            unpinned: None,
            ifindex,
            variant,
            map_pins,
        })
    }

    /// Checks that the programs are attached to the interface as it exists now and that every
    /// pin is in place, repairing what is not: a recreated interface gets new links (first in
    /// its tcx chains); a missing pin directory (or `<bpffs>/wgfence`, or a fresh bpffs) is
    /// created and locked again, and a missing map or link pin is pinned again from the agent's
    /// own descriptors. Only the detach marker holding the very directory this agent locked
    /// lets go of the links. Cheap (a name lookup and a few `stat`s): the daemon runs it every
    /// second.
    pub fn check(&mut self) -> Result<Check> {
        if self.detached {
            return Ok(Check::Detached);
        }
        let mut repairs = Vec::new();
        let mut unpinned = match self.restore_pin_dir(&mut repairs) {
            Ok(PinDirState::Detaching(_)) => return Ok(Check::Detached),
            Ok(_) => self.restore_map_pins(&mut repairs).err(),
            Err(e) => Some(e),
        };
        let ifindex = match iface::index(&self.interface) {
            Ok(index) => index,
            Err(DataplaneError::Interface { source, .. })
                if source.raw_os_error() == Some(libc::ENODEV) =>
            {
                self.prune_retired();
                return Ok(Check::InterfaceGone);
            }
            Err(e) => return Err(e),
        };
        // A new index means a new device; so does the same index with our programs missing
        // from its hooks (recreated with `index N`, or the index reused). A hook whose program
        // is missing on an unchanged device lost its link (e.g. `bpftool link detach`): only
        // that hook is attached again.
        let moved = ifindex != self.ifindex;
        let missing = self.missing_hooks(ifindex)?;
        let reattached = missing.iter().any(|m| *m);
        // The device came back as another kind (L3 or Ethernet): this variant does not fit it.
        if reattached && iface::variant(&self.interface)? != self.variant {
            return Err(DataplaneError::InterfaceChanged {
                interface: self.interface.clone(),
            });
        }
        for (i, hook) in hooks(&self.variant).iter().enumerate() {
            let hook_missing = missing.get(i).copied().unwrap_or(true);
            if self.hook == HookKind::Tc {
                // A filter has no pin to repair.
                if hook_missing {
                    self.refilter(hook, ifindex)?;
                }
                continue;
            }
            let fix = LinkFix {
                i,
                hook,
                ifindex,
                moved,
                missing: hook_missing,
            };
            if let Err(e) = self.repair_link(&fix, unpinned.is_none(), &mut repairs)? {
                unpinned = Some(e);
            }
        }
        if reattached || moved {
            self.ifindex = ifindex;
        }
        if reattached {
            repairs.push(Repair::Reattached { ifindex });
        }
        self.prune_retired();
        Ok(self.checked(repairs, reattached, unpinned))
    }

    /// The pin directory: in place, created and locked again (with its markers) if it was
    /// removed, or taken by `wgfence detach` (then the links are let go).
    fn restore_pin_dir(&mut self, repairs: &mut Vec<Repair>) -> Result<PinDirState> {
        let state = self.check_pin_dir()?;
        match &state {
            PinDirState::Ours => {}
            PinDirState::Restored => {
                repairs.push(Repair::PinDir);
                let marks = [
                    (self.added_qdisc, tc::QDISC_MARKER),
                    (self.hook == HookKind::Tc, tc::HOOK_MARKER),
                ];
                let mut failed = None;
                for (_, name) in marks.iter().filter(|(set, _)| *set) {
                    if let Err(e) = mark(&self.pin_dir, name) {
                        failed = Some(e);
                    }
                }
                if let Some(e) = failed {
                    return Err(e);
                }
            }
            PinDirState::Detaching(marker) => {
                self.let_go();
                tracing::warn!(
                    interface = %self.interface,
                    marker = %marker.display(),
                    "wgfence detach took the pin directory: the programs are detached and stay \
                     so until the agent starts again"
                );
            }
        }
        Ok(state)
    }

    /// Pins again every map whose pin is missing, from the agent's own descriptors.
    fn restore_map_pins(&self, repairs: &mut Vec<Repair>) -> Result<()> {
        for (name, data) in &self.map_pins {
            let path = self.pin_dir.join(name);
            if path.exists() {
                continue;
            }
            data.pin(&path)
                .map_err(|source| DataplaneError::Pin { path, source })?;
            repairs.push(Repair::MapPin(name));
        }
        Ok(())
    }

    /// On the tc hook: a new device has no qdisc and no filters: both again.
    fn refilter(&mut self, hook: &Hook, ifindex: u32) -> Result<()> {
        if tc::ensure_clsact(&self.interface)? {
            self.added_qdisc = true;
            mark(&self.pin_dir, tc::QDISC_MARKER)?;
        }
        let program = program_of(&mut self.ebpf, &mut self.adopted, hook.program)?;
        tc::attach_or_replace(
            program,
            hook.program,
            &self.interface,
            ifindex,
            hook.attach_type,
        )?;
        Ok(())
    }

    /// One tcx hook: a new link if its program is missing from the device, the links of a
    /// device renamed away and back taken back, or the link pinned again if its pin is gone
    /// (when `pin` is set: the pin directory is in place). The outer error stops the check;
    /// the inner one is a pin that could not be restored.
    fn repair_link(
        &mut self,
        fix: &LinkFix<'_>,
        pin: bool,
        repairs: &mut Vec<Repair>,
    ) -> Result<std::result::Result<(), DataplaneError>> {
        let LinkFix {
            i,
            hook,
            ifindex,
            moved,
            missing,
        } = *fix;
        let link_path = self.pin_dir.join(hook.link_pin);
        if missing {
            // The new link first (pinned over the old pin), then the old one goes: no
            // instant without a link on any device that still runs the program.
            let program = program_of(&mut self.ebpf, &mut self.adopted, hook.program)?;
            let new = attach_new(program, hook, &self.interface, &link_path)?;
            let slot = self
                .links
                .get_mut(i)
                .ok_or(DataplaneError::MissingLink(hook.link_pin))?;
            if let Some(old) = slot.replace(new) {
                if moved {
                    // The old device may still exist under another name, its peers still
                    // connected: it keeps its link until it goes (see `prune_retired`).
                    self.retired.push(Retired {
                        ifindex: self.ifindex,
                        hook: i,
                        _link: old,
                    });
                }
            }
            return Ok(Ok(()));
        }
        let slot = self
            .links
            .get_mut(i)
            .ok_or(DataplaneError::MissingLink(hook.link_pin))?;
        if moved {
            // The programs run on the device now named `interface` through links held as
            // retired (it was renamed away and back): they become the pinned ones again.
            if let Some(at) = self
                .retired
                .iter()
                .position(|r| r.ifindex == ifindex && r.hook == i)
            {
                let back = self.retired.swap_remove(at)._link;
                pin_over(&back, &link_path)?;
                if let Some(old) = slot.replace(back) {
                    self.retired.push(Retired {
                        ifindex: self.ifindex,
                        hook: i,
                        _link: old,
                    });
                }
                repairs.push(Repair::LinkPin(hook.link_pin));
                return Ok(Ok(()));
            }
        }
        if pin && !link_path.exists() {
            // The link is alive (this agent holds it): pin it again. The descriptor stays
            // open whatever happens, so a failure detaches nothing.
            let pinned = match slot {
                Some(link) => link.pin(&link_path),
                None => Err(DataplaneError::MissingLink(hook.link_pin)),
            };
            match pinned {
                Ok(()) => repairs.push(Repair::LinkPin(hook.link_pin)),
                Err(e) => return Ok(Err(e)),
            }
        }
        Ok(Ok(()))
    }

    /// What a check found, logged: `repairs` made, and the pin that could not be restored.
    fn checked(
        &mut self,
        repairs: Vec<Repair>,
        reattached: bool,
        unpinned: Option<DataplaneError>,
    ) -> Check {
        let described = || repairs.iter().map(ToString::to_string).collect::<Vec<_>>();
        if let Some(error) = unpinned {
            let error = crate::error_chain(&error);
            if self.unpinned.as_ref() == Some(&error) && repairs.is_empty() {
                return Check::Unpinned { repairs, error };
            }
            self.unpinned = Some(error.clone());
            tracing::error!(
                interface = %self.interface,
                pin_dir = %self.pin_dir.display(),
                repairs = ?described(),
                %error,
                "pins are missing and could not be restored; the programs stay attached and \
                 enforcing from the agent's own descriptors, but a restart would not adopt them"
            );
            return Check::Unpinned { repairs, error };
        }
        if self.unpinned.take().is_some() {
            tracing::warn!(interface = %self.interface, "the pins are in place again");
        }
        if repairs.is_empty() {
            return Check::Intact;
        }
        if repairs.contains(&Repair::PinDir) {
            tracing::error!(
                interface = %self.interface,
                pin_dir = %self.pin_dir.display(),
                repairs = ?described(),
                "the pin directory was removed, but not by `wgfence detach`: created it again \
                 and pinned everything again from the agent's own descriptors (the programs \
                 never stopped)"
            );
        } else {
            tracing::warn!(interface = %self.interface, repairs = ?described(), "datapath repaired");
        }
        Check::Repaired {
            repairs,
            reattached,
        }
    }

    /// Where the pin directory this agent locked is now. Missing or replaced, and not under a
    /// detach marker, it is created and locked again.
    fn check_pin_dir(&mut self) -> Result<PinDirState> {
        let ours = |lock: &Option<PinDirLock>, meta: &fs::Metadata| {
            lock.as_ref().is_some_and(|lock| lock.is(meta))
        };
        match fs::symlink_metadata(&self.pin_dir) {
            Ok(meta) if ours(&self.lock, &meta) => return Ok(PinDirState::Ours),
            // Gone, or another directory (or anything else) in its place: a detach that
            // renamed ours away (a new agent may have made and locked a new one since), else
            // damage.
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            // Not an answer (EACCES, EIO, ...): an error to retry, never a reason to let go.
            Err(source) => {
                return Err(DataplaneError::Io {
                    path: self.pin_dir.clone(),
                    source,
                })
            }
        }
        for marker in detaching_dirs(&self.bpffs, &self.interface)? {
            match fs::symlink_metadata(&marker) {
                Ok(meta) if ours(&self.lock, &meta) => return Ok(PinDirState::Detaching(marker)),
                _ => {}
            }
        }
        // Never on a plain directory where bpffs used to be: pins need bpffs.
        ensure_bpffs(&self.bpffs)?;
        self.lock = Some(lock_pin_dir(&self.pin_dir)?);
        Ok(PinDirState::Restored)
    }

    /// Detaches this datapath as `wgfence detach` does, after letting go of its own links and
    /// lock (a detach waits until nothing holds them, so one issued while this process still
    /// held them would time out and leave its marker). For the tests and the benchmarks, which
    /// attach in-process.
    #[cfg(any(test, feature = "testing"))]
    pub fn detach_now(&mut self) -> Result<bool> {
        self.let_go();
        Self::detach(&self.bpffs, &self.interface)
    }

    /// Lets go of the links (the programs detach once nothing else holds them), then of the
    /// lock: in this order, because a `detach` that may not look links up by id takes the
    /// lock's release as the sign that the links are gone.
    fn let_go(&mut self) {
        self.links.iter_mut().for_each(|l| *l = None);
        self.retired.clear();
        self.lock = None;
        self.detached = true;
    }

    /// Whether the device's tcx hooks run this dataplane's programs, ingress and egress (two
    /// queries). Must run in the interface's network namespace.
    #[cfg(any(test, feature = "testing"))]
    pub fn programs_attached(&mut self) -> Result<bool> {
        let ifindex = iface::index(&self.interface)?;
        Ok(!self.missing_hooks(ifindex)?.contains(&true))
    }

    /// For each of the variant's [`hooks`], whether its program is missing from that hook of
    /// the device.
    fn missing_hooks(&mut self, ifindex: u32) -> Result<Vec<bool>> {
        let hooks = hooks(&self.variant);
        let mut missing = Vec::with_capacity(hooks.len());
        for hook in &hooks {
            let interface = self.interface.clone();
            let attached = self.runs(ifindex, hook).map_err(|source| match self.hook {
                HookKind::Tc => DataplaneError::Qdisc { interface, source },
                HookKind::Tcx => DataplaneError::Interface { interface, source },
            })?;
            missing.push(!attached);
        }
        Ok(missing)
    }

    /// Whether the hook's program runs on that hook of the device with this index (tcx, or the
    /// agent's filter place on tc).
    fn runs(&mut self, ifindex: u32, hook: &Hook) -> io::Result<bool> {
        let program = program_of(&mut self.ebpf, &mut self.adopted, hook.program)
            .map_err(io::Error::other)?;
        let id = program.info().map_err(io::Error::other)?.id();
        if self.hook == HookKind::Tc {
            let place = tc::place(ifindex, hook.attach_type, hook.program)?;
            return Ok(place
                == tc::Place::Ours {
                    program_id: Some(id),
                });
        }
        // Ids only: aya's query_tcx opens every program by id, which needs CAP_SYS_ADMIN.
        Ok(sys::tcx_program_ids(ifindex, hook.bpf_attach_type)?.contains(&id))
    }

    /// Lets go of the retired links whose device is gone or no longer runs the program
    /// through them (their link was detached); keeps them on any other answer.
    fn prune_retired(&mut self) {
        let retired = std::mem::take(&mut self.retired);
        for r in retired {
            let hooks = hooks(&self.variant);
            let Some(hook) = hooks.get(r.hook) else {
                continue;
            };
            match self.runs(r.ifindex, hook) {
                Ok(false) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {}
                Ok(true) | Err(_) => {
                    self.retired.push(r);
                    continue;
                }
            }
            tracing::info!(
                interface = %self.interface,
                ifindex = r.ifindex,
                hook = hook.link_pin,
                "the device this agent attached to before, under another name, is gone: \
                 released its link"
            );
        }
    }

    /// Opens the maps pinned for an interface without loading or attaching anything (for
    /// `status`, `dump` and tests).
    pub fn open_maps(bpffs: &Path, interface: &str) -> Result<Maps> {
        Maps::from_pins(&pin_dir(bpffs, interface))
    }

    /// Removes everything pinned for an interface: the links (which detaches the programs)
    /// and the maps, and waits up to [`DETACH_TIMEOUT`] until the links are really gone. What
    /// is already gone is not an error. Returns whether anything was removed.
    pub fn detach(bpffs: &Path, interface: &str) -> Result<bool> {
        Self::detach_within(bpffs, interface, DETACH_TIMEOUT)
    }

    /// [`Dataplane::detach`], waiting up to `timeout` for the links to be gone.
    ///
    /// The directory is first renamed to this detach's marker (atomically, inside bpffs). A
    /// running agent finds there the directory it locked, lets go of its links and its lock,
    /// and does not pin anything again; anything else that removes the directory looks like
    /// damage, which the agent repairs. The pins are removed, then this waits until no process
    /// holds the links (the programs are off the interface) and no agent holds the marker's
    /// lock, and only then removes the marker. Past `timeout` it fails, naming the holder, and
    /// leaves the marker for the agent to find (a later detach or start removes it).
    pub fn detach_within(bpffs: &Path, interface: &str, timeout: Duration) -> Result<bool> {
        let pinned = pin_dir(bpffs, interface);
        let own = pinned.with_file_name(detaching_name(interface, std::process::id()));
        let renamed = match fs::rename(&pinned, &own) {
            Ok(()) => true,
            Err(e) if e.kind() == ErrorKind::NotFound => false,
            Err(source) => {
                return Err(DataplaneError::Io {
                    path: pinned,
                    source,
                })
            }
        };
        // This detach's marker, and any an interrupted one left (its links still attached).
        let markers = detaching_dirs(bpffs, interface)?;
        let mut links = Vec::new();
        for marker in &markers {
            links.extend(unpin_all(marker)?);
        }
        wait_let_go(interface, &own, &markers, &links, timeout)?;
        let removed_filters = remove_tc_hook(interface, &markers)?;
        for marker in &markers {
            remove_marked_dir(marker)?;
        }
        // Leave <bpffs>/wgfence itself once no interface uses it.
        if let Some(parent) = own.parent() {
            let _ = fs::remove_dir(parent);
        }
        let detached = renamed || !markers.is_empty() || removed_filters;
        if detached {
            tracing::info!(interface, "datapath detached");
        }
        Ok(detached)
    }

    /// The pinned ingress link of an interface, if any: (link id, program id).
    pub fn ingress_link_info(bpffs: &Path, interface: &str) -> Result<Option<(u32, u32)>> {
        Self::pinned_link_info(bpffs, interface, LINK_PIN_INGRESS)
    }

    /// The pinned egress link of an interface, if any: (link id, program id). Without it,
    /// replies to network-started flows do not pass (enforcement is the ingress link's).
    pub fn egress_link_info(bpffs: &Path, interface: &str) -> Result<Option<(u32, u32)>> {
        Self::pinned_link_info(bpffs, interface, LINK_PIN_EGRESS)
    }

    fn pinned_link_info(bpffs: &Path, interface: &str, pin: &str) -> Result<Option<(u32, u32)>> {
        Self::pinned_link_info_at(&pin_dir(bpffs, interface).join(pin))
    }

    /// The link id and program id of the link pinned at `path`, if there is one.
    fn pinned_link_info_at(path: &Path) -> Result<Option<(u32, u32)>> {
        let path = path.to_owned();
        if !path.exists() {
            return Ok(None);
        }
        let link_err = |source| DataplaneError::Link {
            path: path.clone(),
            source,
        };
        let link = FdLink::from(PinnedLink::from_pin(&path).map_err(link_err)?);
        let info = link.info().map_err(link_err)?;
        Ok(Some((info.id(), info.program_id())))
    }

    /// The agent's tc filters on the interface, if it has any there (looked up in the calling
    /// thread's network namespace): the program ids of the ingress and egress filter. `None`
    /// when neither is there or the interface does not exist here.
    pub fn tc_filters(interface: &str) -> Result<Option<(Option<u32>, Option<u32>)>> {
        let Ok(ifindex) = iface::index(interface) else {
            return Ok(None);
        };
        let mut ids = [None, None];
        // Either variant's programs are the agent's.
        for variant in &VARIANTS {
            let [egress, ingress] = hooks(variant);
            for (id, hook) in ids.iter_mut().zip([&ingress, &egress]) {
                if id.is_some() {
                    continue;
                }
                let place =
                    tc::place(ifindex, hook.attach_type, hook.program).map_err(|source| {
                        DataplaneError::Qdisc {
                            interface: interface.to_owned(),
                            source,
                        }
                    })?;
                if let tc::Place::Ours { program_id } = place {
                    *id = Some(program_id.unwrap_or_default());
                }
            }
        }
        let [ingress, egress] = ids;
        Ok((ingress.is_some() || egress.is_some()).then_some((ingress, egress)))
    }

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

    /// The map layout the datapath pinned for an interface runs, from what its ingress link's
    /// program uses (not from which pins exist); `None` when no link is pinned or it runs a
    /// program that is not wgfence's.
    pub fn running_layout(bpffs: &Path, interface: &str) -> Result<Option<u32>> {
        upgrade::running_layout(&pin_dir(bpffs, interface))
    }

    /// The program variant the pinned ingress link runs, from its program's name; when the
    /// program cannot be looked up (no CAP_SYS_ADMIN), the variant the interface's type calls
    /// for (what an agent loads for it), if the interface is in this network namespace. `None`
    /// when no link is pinned or it runs a program of neither variant.
    pub fn running_variant(bpffs: &Path, interface: &str) -> Result<Option<Variant>> {
        let Some(running) = upgrade::running(&pin_dir(bpffs, interface).join(LINK_PIN_INGRESS))?
        else {
            return Ok(None);
        };
        Ok(match running.program {
            Some(name) => Variant::of_program(&name),
            None => iface::variant(interface).ok(),
        })
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

/// One of the datapath's classifiers (a [`Variant`]'s `ingress` or `egress`).
/// Waits until no process holds `links` (the programs are off the interface) and no agent
/// holds the lock of one of `markers`; past `timeout`, an error naming the holder.
fn wait_let_go(
    interface: &str,
    own: &Path,
    markers: &[PathBuf],
    links: &[u32],
    timeout: Duration,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    // Whether this process may look links up by id (CAP_SYS_ADMIN). Without it (the
    // DaemonSet's capabilities), only the agent's lock tells that it let go: it closes its
    // links before its lock, so they are gone by then unless something else holds them.
    let mut see_links = true;
    loop {
        let mut held = Vec::new();
        for id in links.iter().filter(|_| see_links) {
            match sys::link_exists(*id) {
                Ok(true) => held.push(*id),
                Ok(false) => {}
                Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                    tracing::debug!("no CAP_SYS_ADMIN: waiting for the agent's lock only");
                    see_links = false;
                    held.clear();
                    break;
                }
                Err(source) => {
                    return Err(DataplaneError::Io {
                        path: own.to_owned(),
                        source,
                    })
                }
            }
        }
        let mut locked = None;
        for marker in markers {
            if lock::is_locked(marker)? {
                locked = Some(marker);
                break;
            }
        }
        if held.is_empty() && locked.is_none() {
            break;
        }
        if Instant::now() >= deadline {
            return Err(DataplaneError::DetachTimeout {
                interface: interface.to_owned(),
                waited: timeout,
                links: held,
                holder: locked.map(|marker| lock::describe_holder(lock::holder_of(marker))),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// The agent let go (its lock is free) and never attaches again: the filters of the tc hook
/// (which no descriptor holds) are deleted here, the agent's own only, and the clsact qdisc if
/// the agent added it and nothing else is on it. Whether filters were removed.
fn remove_tc_hook(interface: &str, markers: &[PathBuf]) -> Result<bool> {
    let added_qdisc = markers
        .iter()
        .any(|marker| marker.join(tc::QDISC_MARKER).is_dir());
    let mut removed_filters = false;
    match iface::index(interface) {
        Ok(ifindex) => {
            removed_filters = remove_tc_filters(interface, ifindex)?;
            if added_qdisc && tc::remove_clsact_if_empty(interface, ifindex)? {
                tracing::info!(interface, "removed the clsact qdisc wgfence had added");
            }
        }
        // Gone with the interface, or in another network namespace.
        Err(DataplaneError::Interface { source, .. })
            if source.raw_os_error() == Some(libc::ENODEV) =>
        {
            if markers.iter().any(|m| m.join(tc::HOOK_MARKER).is_dir()) {
                tracing::warn!(
                    interface,
                    "the programs ran on the tc hook and there is no {interface} in this \
                     network namespace: if it exists in another one, its filters still \
                     run there (with the last state); run `wgfence detach` in that \
                     namespace, or delete them with `tc filter del dev {interface} \
                     ingress prio 1` (and egress)"
                );
            }
        }
        Err(e) => return Err(e),
    }
    Ok(removed_filters)
}

/// The upgrade of an older layout's datapath, if a hook runs one: each hook's pinned tcx link,
/// else the agent's clsact filter on it.
fn prepare_upgrade(
    pin_dir: &Path,
    hooks: &[Hook; 2],
    ifindex: u32,
) -> Result<Option<upgrade::Upgrade>> {
    let [egress_hook, ingress_hook] = hooks;
    let running = |hook: &Hook| {
        upgrade::running_on(
            pin_dir,
            hook.link_pin,
            ifindex,
            hook.attach_type,
            hook.program,
        )
    };
    upgrade::Upgrade::prepare(pin_dir, running(ingress_hook)?, running(egress_hook)?)
}

/// Fills the new maps from the old layout's, and marks the switch to the new programs.
fn fill_and_mark(
    upgrade: &mut upgrade::Upgrade,
    pin_dir: &Path,
    hooks: &[Hook; 2],
    ebpf: &mut Ebpf,
    adopted: &mut [(&'static str, SchedClassifier)],
) -> Result<()> {
    upgrade.fill(pin_dir)?;
    let mut ids = Vec::with_capacity(hooks.len());
    for hook in hooks {
        let program = program_of(ebpf, adopted, hook.program)?;
        ids.push(program.info().map_err(program_err(hook.program))?.id());
    }
    upgrade.mark_switch(pin_dir, &ids)
}

/// Pins the programs: what the next start may take over instead of loading the object again.
/// A failure costs that start the verifier's time, no enforcement.
fn keep_programs(pin_dir: &Path, hooks: &[Hook; 2], identity: &str, ebpf: &mut Ebpf) {
    if let Err(e) = pin_programs(pin_dir, hooks, identity, ebpf) {
        tracing::warn!(
            pin_dir = %pin_dir.display(),
            error = %crate::error_chain(&e),
            "could not pin the programs: the next start loads them again"
        );
    }
}

/// When each phase of an attach ended, from its start.
struct Phases {
    prelude: Duration,
    object: Duration,
    maps_opened: Duration,
    verified: Duration,
    switched: Duration,
    recount: Duration,
    total: Duration,
}

impl Phases {
    fn log(&self, interface: &str, programs_adopted: bool) {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        tracing::debug!(
            interface,
            prelude_ms = ms(self.prelude),
            object_ms = ms(self.object - self.prelude),
            maps_ms = ms(self.maps_opened - self.object),
            verify_ms = ms(self.verified - self.maps_opened),
            switch_ms = ms(self.switched - self.verified),
            programs_adopted,
            after_ms = ms(self.total - self.switched),
            recount_ms = ms(self.recount),
            "datapath attach phases"
        );
    }
}

/// The interface's index and the hook to attach to. Before anything changes: a kernel that
/// cannot run the datapath, a hook it lacks, or a foreign filter where the agent's must go is
/// an error.
fn choose_hook(interface: &str, mode: HookMode, hooks: &[Hook]) -> Result<(u32, HookKind)> {
    hook::check_kernel()?;
    let ifindex = iface::index(interface)?;
    let kind = hook::choose(mode, ifindex)?;
    if kind == HookKind::Tc {
        check_tc_places(interface, ifindex, hooks)?;
    }
    Ok((ifindex, kind))
}

fn log_attached(
    interface: &str,
    pin_dir: &Path,
    variant: &Variant,
    kind: HookKind,
    attachment: Attachment,
) {
    tracing::info!(
        interface,
        pin_dir = %pin_dir.display(),
        variant = variant.name,
        hook = %kind,
        tc_priority = (kind == HookKind::Tc).then_some(tc::TC_PRIORITY),
        tc_handle = (kind == HookKind::Tc).then(|| format!("{:#x}", tc::TC_HANDLE)),
        ?attachment,
        layout = wgfence_common::LAYOUT_VERSION,
        "datapath attached"
    );
}

/// On the tc hook: an error if a filter that is not the agent's holds its place (priority and
/// handle) on either direction.
fn check_tc_places(interface: &str, ifindex: u32, hooks: &[Hook]) -> Result<()> {
    for hook in hooks {
        let place = tc::place(ifindex, hook.attach_type, hook.program).map_err(|source| {
            DataplaneError::Qdisc {
                interface: interface.to_owned(),
                source,
            }
        })?;
        if let tc::Place::Foreign(filter) = place {
            return Err(DataplaneError::ForeignFilter {
                interface: interface.to_owned(),
                direction: hook.direction,
                priority: tc::TC_PRIORITY,
                handle: tc::TC_HANDLE,
                found: format!("{filter:?}"),
            });
        }
    }
    Ok(())
}

/// Loads the object with every map at its pin under `pin_dir` (the pinned map reused if there
/// is one, else created and pinned), checks the maps' layout, and opens the pins a second time.
/// With the time since `started` at which the object was loaded.
#[allow(clippy::type_complexity)]
fn load_object(
    pin_dir: &Path,
    log_level: u8,
    started: Instant,
) -> Result<(Ebpf, Maps, Vec<(&'static str, MapData)>, Duration)> {
    let pins: Vec<(&'static str, PathBuf)> = map_names::ALL
        .iter()
        .map(|name| (*name, pin_dir.join(name)))
        .collect();
    let mut loader = EbpfLoader::new();
    loader.override_global(AYA_LOG_LEVEL, &log_level, false);
    for (name, path) in &pins {
        loader.map_pin_path(name, path.as_path());
    }
    let mut ebpf = loader.load(OBJECT)?;
    let object = started.elapsed();
    // Before anything is attached: an adopted map of another layout is an error.
    let maps = Maps::from_ebpf(&mut ebpf)?;
    let map_pins = pins
        .iter()
        .map(|(name, path)| {
            MapData::from_pin(path)
                .map(|data| (*name, data))
                .map_err(|source| DataplaneError::Map { map: name, source })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((ebpf, maps, map_pins, object))
}

/// The running programs, if `may_adopt` and they are this very object's and use these very
/// maps: taken over as they are, without loading and verifying them again (see
/// [`adopt_programs`]); else none, and the object's are loaded.
fn adopt_or_load(
    pin_dir: &Path,
    hooks: &[Hook; 2],
    identity: &str,
    map_pins: &[(&'static str, MapData)],
    ebpf: &mut Ebpf,
    may_adopt: bool,
) -> Result<Vec<(&'static str, SchedClassifier)>> {
    let adopted = if may_adopt {
        adopt_programs(pin_dir, hooks, identity, map_pins)
    } else {
        Vec::new()
    };
    if adopted.is_empty() {
        load_programs(pin_dir, hooks, ebpf)?;
    }
    Ok(adopted)
}

/// Loads (verifies) the variant's two programs of the object, after removing the pins of the
/// programs they replace.
fn load_programs(pin_dir: &Path, hooks: &[Hook; 2], ebpf: &mut Ebpf) -> Result<()> {
    // Pins of programs about to be replaced: gone before the switch, so that none names a
    // program the links no longer run.
    remove_program_pins(pin_dir, hooks)?;
    // Both programs are verified before either is switched: the two link updates (or filter
    // replacements) follow each other without a verifier run between them. Only the variant's
    // two programs are loaded; the other variant's stay in the object.
    for hook in hooks {
        let program = classifier(ebpf, hook.program)?;
        program.load().map_err(program_err(hook.program))?;
    }
    Ok(())
}

/// Marks the hook in the pin directory (and the clsact qdisc, if the agent added it, which it
/// does here on the tc hook when there is none); whether the agent added the qdisc.
fn mark_hook(kind: HookKind, interface: &str, pin_dir: &Path, added_qdisc: bool) -> Result<bool> {
    let added_qdisc = (kind == HookKind::Tc && tc::ensure_clsact(interface)?) || added_qdisc;
    if added_qdisc {
        mark(pin_dir, tc::QDISC_MARKER)?;
    }
    if kind == HookKind::Tc {
        mark(pin_dir, tc::HOOK_MARKER)?;
    } else {
        remove_dir_if_exists(&pin_dir.join(tc::HOOK_MARKER))?;
    }
    Ok(added_qdisc)
}

/// The switch: each hook's program attached, or put in place of what runs there.
struct Switch<'a> {
    kind: HookKind,
    hooks: &'a [Hook],
    variant: &'a Variant,
    interface: &'a str,
    ifindex: u32,
    pin_dir: &'a Path,
    upgrading: bool,
}

impl Switch<'_> {
    /// What happened on the ingress hook, and the links (one per hook; `None` on tc).
    fn run(
        &self,
        ebpf: &mut Ebpf,
        adopted: &mut [(&'static str, SchedClassifier)],
    ) -> Result<(Attachment, Vec<Option<HeldLink>>)> {
        let mut attachment = Attachment::Created;
        let mut links = Vec::with_capacity(self.hooks.len());
        for hook in self.hooks {
            let program = program_of(ebpf, adopted, hook.program)?;
            let (attached, link) = match self.kind {
                HookKind::Tcx => {
                    let link_path = self.pin_dir.join(hook.link_pin);
                    let (attached, link) =
                        attach_or_replace(program, hook, self.interface, &link_path)?;
                    (attached, Some(link))
                }
                HookKind::Tc => {
                    let existed = tc::attach_or_replace(
                        program,
                        hook.program,
                        self.interface,
                        self.ifindex,
                        hook.attach_type,
                    )?;
                    let attached = if existed {
                        Attachment::Replaced
                    } else {
                        Attachment::Created
                    };
                    (attached, None)
                }
            };
            if hook.program == self.variant.ingress {
                attachment = attached;
            }
            links.push(link);
            if self.upgrading {
                upgrade::failpoint(&format!("upgrade-switched-{}", hook.link_pin));
            }
        }
        Ok((attachment, links))
    }
}

/// Finishes an upgrade whose switch took `switch`. The new programs enforce the full
/// translated state by now: what is left (late flows, counter increments, the old pins) is
/// logged, no reason to stop the agent.
fn finish_upgrade(
    upgrade: upgrade::Upgrade,
    pin_dir: &Path,
    switch: Duration,
) -> Option<UpgradeReport> {
    match upgrade.finish(pin_dir, switch) {
        Ok(report) => Some(report),
        Err(e) => {
            tracing::error!(
                pin_dir = %pin_dir.display(),
                error = %crate::error_chain(&e),
                "the programs run layout 3 with the translated state, but finishing the \
                 upgrade failed: flows recorded during the switch may be lost, the old \
                 pins are removed at the next start"
            );
            None
        }
    }
}

/// Removes the pins of the old layouts nothing runs any more, and places the tombstones that
/// make an agent of an old layout stop before it attaches. A failure costs no enforcement.
fn tidy_old_layouts(pin_dir: &Path) {
    if let Err(e) = upgrade::tidy(pin_dir) {
        tracing::error!(
            pin_dir = %pin_dir.display(),
            error = %crate::error_chain(&e),
            "could not tidy the pins of layouts 1 and 2 or place the tombstones: an agent \
             of an older layout started now could replace the programs"
        );
    }
}

/// Recounts the flow quota of every slot from the flows the tables hold (nothing else
/// reconciles them); a failure is logged, and repaired at the next start.
/// Recounts the flow quota of every slot from the flow tables (logging what did not match);
/// returns how long it took.
fn recount_flow_quota(maps: &mut Maps, interface: &str) -> Duration {
    let started = Instant::now();
    match maps.recount_flow_quota() {
        Ok(slots) if slots.is_empty() => {}
        Ok(slots) => tracing::warn!(
            interface,
            ?slots,
            "the flow quota of these slots did not match their flows: recounted"
        ),
        Err(e) => tracing::error!(
            interface,
            error = %crate::error_chain(&e),
            "could not recount the flow quota; it is recounted at the next start"
        ),
    }
    started.elapsed()
}

pub(crate) fn classifier<'a>(
    ebpf: &'a mut Ebpf,
    program: &'static str,
) -> Result<&'a mut SchedClassifier> {
    ebpf.program_mut(program)
        .ok_or(DataplaneError::Program {
            program,
            source: aya::programs::ProgramError::UnexpectedProgramType,
        })?
        .try_into()
        .map_err(program_err(program))
}

/// The program named `name`: the adopted one if the running programs were taken over, else
/// the object's.
fn program_of<'a>(
    ebpf: &'a mut Ebpf,
    adopted: &'a mut [(&'static str, SchedClassifier)],
    name: &'static str,
) -> Result<&'a mut SchedClassifier> {
    match adopted.iter_mut().find(|(n, _)| *n == name) {
        Some((_, program)) => Ok(program),
        None => classifier(ebpf, name),
    }
}

/// What identifies the programs an attach loads: the object, the log level compiled into it
/// and the variant. Part of the programs' pin names (`prog_<direction>_<identity>`): an agent
/// built from another object never takes over these programs.
fn program_identity(log_level: u8, variant: &Variant) -> String {
    use std::hash::{Hash, Hasher};
    // SipHash with fixed keys: the same on every start of the same binary (a toolchain that
    // hashes differently only costs one start the verifier's time).
    #[allow(deprecated)]
    let mut hasher = std::hash::SipHasher::new();
    OBJECT.hash(&mut hasher);
    log_level.hash(&mut hasher);
    variant.name.hash(&mut hasher);
    format!("{:016x}", hasher.finish())
}

/// The pin of the program of `hook` with this identity.
fn program_pin(pin_dir: &Path, hook: &Hook, identity: &str) -> PathBuf {
    pin_dir.join(format!("{PROGRAM_PIN_PREFIX}{}_{identity}", hook.direction))
}

/// Name prefix of the program pins in a pin directory.
const PROGRAM_PIN_PREFIX: &str = "prog_";

/// Takes over the programs the pinned links run, if they are exactly what this attach would
/// load: pinned under this binary's identity by an agent that loaded them, run by both pinned
/// links (the kernel's program ids), and using exactly the maps pinned now (their ids). Any
/// other answer, or any error, is an empty result: the caller loads and verifies the object's
/// programs, as a first start does.
fn adopt_programs(
    pin_dir: &Path,
    hooks: &[Hook; 2],
    identity: &str,
    map_pins: &[(&'static str, MapData)],
) -> Vec<(&'static str, SchedClassifier)> {
    // The pinned maps by their kernel names (truncated as the kernel keeps them).
    let mut pinned = Vec::with_capacity(map_pins.len());
    for (_, map) in map_pins {
        match map.info() {
            Ok(info) => pinned.push((info.name().to_vec(), info.id())),
            Err(_) => return Vec::new(),
        }
    }
    let mut adopted = Vec::with_capacity(hooks.len());
    for hook in hooks {
        let pin = program_pin(pin_dir, hook, identity);
        let link = pin_dir.join(hook.link_pin);
        if !pin.exists() || !link.exists() {
            return Vec::new();
        }
        let Ok(program) = SchedClassifier::from_pin(&pin) else {
            return Vec::new();
        };
        let Ok(info) = program.info() else {
            return Vec::new();
        };
        let Ok(Some((_, linked))) = Dataplane::pinned_link_info_at(&link) else {
            return Vec::new();
        };
        let Ok(Some(uses)) = info.map_ids() else {
            return Vec::new();
        };
        if linked != info.id() {
            return Vec::new();
        }
        // The maps a program uses are fixed when it is loaded: each of its maps named like a
        // pinned one must be that very map (a map pin replaced since would leave the program
        // enforcing a map the agent no longer writes).
        let mut matched = 0;
        for id in uses {
            let Ok(map) = aya::maps::MapInfo::from_id(id) else {
                return Vec::new();
            };
            if let Some((_, pinned_id)) = pinned.iter().find(|(name, _)| name == map.name()) {
                if *pinned_id != id {
                    return Vec::new();
                }
                matched += 1;
            }
        }
        if matched == 0 {
            return Vec::new();
        }
        adopted.push((hook.program, program));
    }
    tracing::debug!(pin_dir = %pin_dir.display(), "took over the running programs");
    adopted
}

/// Pins the loaded programs under `identity`, for the next start to take over.
fn pin_programs(pin_dir: &Path, hooks: &[Hook; 2], identity: &str, ebpf: &mut Ebpf) -> Result<()> {
    for hook in hooks {
        let path = program_pin(pin_dir, hook, identity);
        remove_if_exists(&path)?;
        classifier(ebpf, hook.program)?
            .pin(&path)
            .map_err(|source| DataplaneError::Pin {
                path: path.clone(),
                source,
            })?;
    }
    Ok(())
}

/// Removes every program pin of `hooks` in `pin_dir`, whatever its identity.
fn remove_program_pins(pin_dir: &Path, hooks: &[Hook; 2]) -> Result<()> {
    let entries = match fs::read_dir(pin_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(DataplaneError::Io {
                path: pin_dir.to_owned(),
                source,
            })
        }
    };
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name();
        let name = name.to_str().unwrap_or_default();
        if hooks.iter().any(|hook| {
            name.strip_prefix(PROGRAM_PIN_PREFIX)
                .and_then(|rest| rest.strip_prefix(hook.direction))
                .is_some_and(|rest| rest.starts_with('_'))
        }) {
            remove_if_exists(&entry.path())?;
        }
    }
    Ok(())
}

/// Replaces the program behind the pinned link if it is still attached; otherwise (no pin, or
/// a pin whose interface went away) attaches anew and pins the new link. Returns the link, held
/// open by the caller.
fn attach_or_replace(
    program: &mut SchedClassifier,
    hook: &Hook,
    interface: &str,
    link_path: &Path,
) -> Result<(Attachment, HeldLink)> {
    let link_err = |source| DataplaneError::Link {
        path: link_path.to_owned(),
        source,
    };
    if link_path.exists() {
        let pinned = PinnedLink::from_pin(link_path).map_err(link_err)?;
        let link = SchedClassifierLink::try_from(FdLink::from(pinned)).map_err(link_err)?;
        match program.attach_to_link(link) {
            Ok(id) => {
                let link = program.take_link(id).map_err(program_err(hook.program))?;
                drop(FdLink::try_from(link).map_err(link_err)?);
                // The pin stays: a descriptor of the agent's own from it.
                return Ok((Attachment::Replaced, HeldLink::open(link_path)?));
            }
            Err(e) => {
                // ENOLINK: the interface the link was made for is gone (e.g. recreated).
                tracing::warn!(
                    interface,
                    link = %link_path.display(),
                    error = %crate::error_chain(&e),
                    "pinned link cannot take the program; attaching a new link"
                );
                remove_if_exists(link_path)?;
            }
        }
    }
    Ok((
        Attachment::Created,
        attach_new(program, hook, interface, link_path)?,
    ))
}

/// Attaches the loaded program with a new tcx link, first in the chain, and pins the link.
fn attach_new(
    program: &mut SchedClassifier,
    hook: &Hook,
    interface: &str,
    link_path: &Path,
) -> Result<HeldLink> {
    // First in the tcx chain: a program before ours could pass packets we must drop (ingress),
    // or drop packets before their flow is recorded (egress: harmless, but first is simplest).
    let id = program
        .attach_with_options(
            interface,
            hook.attach_type,
            TcAttachOptions::TcxOrder(LinkOrder::first()),
        )
        .map_err(program_err(hook.program))?;
    let link = program.take_link(id).map_err(program_err(hook.program))?;
    let link = FdLink::try_from(link).map_err(|source| DataplaneError::Link {
        path: link_path.to_owned(),
        source,
    })?;
    // Pinned beside the old pin, which it then replaces atomically: the old link (pinned,
    // possibly still running on a device) goes only once the new one is in place.
    let fresh = fresh_pin(link_path);
    remove_if_exists(&fresh)?;
    let pinned = link.pin(&fresh).map_err(|source| DataplaneError::Pin {
        path: fresh.clone(),
        source,
    })?;
    // Opened before aya's descriptor closes with `pinned`: the link never has only its pin.
    let held = HeldLink::open(&fresh)?;
    drop(pinned);
    rename_pin(&fresh, link_path)?;
    Ok(held)
}

/// Where a new link is pinned before it replaces the pin at `link_path` (no dot: bpffs
/// refuses them).
fn fresh_pin(link_path: &Path) -> PathBuf {
    let mut name = link_path.file_name().unwrap_or_default().to_owned();
    name.push("_new");
    link_path.with_file_name(name)
}

fn rename_pin(from: &Path, to: &Path) -> Result<()> {
    fs::rename(from, to).map_err(|source| DataplaneError::Io {
        path: to.to_owned(),
        source,
    })
}

/// Pins a held link at `link_path`, replacing whatever is pinned there in one step.
fn pin_over(link: &HeldLink, link_path: &Path) -> Result<()> {
    let fresh = fresh_pin(link_path);
    remove_if_exists(&fresh)?;
    link.pin(&fresh)?;
    rename_pin(&fresh, link_path)
}

fn ensure_bpffs(path: &Path) -> Result<()> {
    use std::os::unix::ffi::OsStrExt as _;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        DataplaneError::NotBpffs {
            path: path.to_owned(),
        }
    })?;
    // SAFETY: statfs writes into the zeroed struct; c_path is NUL-terminated.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c_path.as_ptr(), &mut stat) } != 0 {
        return Err(DataplaneError::Io {
            path: path.to_owned(),
            source: io::Error::last_os_error(),
        });
    }
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between libcs
    if stat.f_type as i64 != BPF_FS_MAGIC {
        return Err(DataplaneError::NotBpffs {
            path: path.to_owned(),
        });
    }
    Ok(())
}

/// Creates the pin directory (and its parents) readable by root only, and tightens
/// `<bpffs>/wgfence` and the interface's directory to 0700 if they were adopted with a looser
/// mode: whoever can open a pin can change the policy (the pins are the maps), and whoever can
/// write to the directories can replace them before the next start adopts them. A directory
/// owned by another user is refused: that user could have put anything in it.
fn create_private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| DataplaneError::Io {
            path: dir.to_owned(),
            source,
        })?;
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    for d in [dir.parent(), Some(dir)].into_iter().flatten() {
        let io_err = |source| DataplaneError::Io {
            path: d.to_owned(),
            source,
        };
        let meta = fs::symlink_metadata(d).map_err(io_err)?;
        if !meta.is_dir() || (meta.uid() != 0 && meta.uid() != euid) {
            return Err(DataplaneError::UnsafePinDir {
                path: d.to_owned(),
                uid: meta.uid(),
            });
        }
        let mode = meta.mode() & 0o7777;
        if mode & 0o077 != 0 {
            fs::set_permissions(d, fs::Permissions::from_mode(0o700)).map_err(io_err)?;
            tracing::warn!(
                path = %d.display(),
                mode = format!("{mode:04o}"),
                "pin directory was accessible to other users; tightened to 0700"
            );
        }
    }
    Ok(())
}

/// The name a detach renames an interface's pin directory to: longer than any interface name
/// (15 characters) and without a dot (bpffs refuses dots), so it is never a pin directory.
fn detaching_name(interface: &str, pid: u32) -> String {
    format!("detaching-{interface}-{pid:010}")
}

/// Creates the pin directory (see [`create_private_dir`]) and takes its lock: another agent's
/// lock is [`DataplaneError::Locked`].
fn lock_pin_dir(dir: &Path) -> Result<PinDirLock> {
    // A concurrent detach may rename the directory between the open and the lock: again.
    for _ in 0..5 {
        create_private_dir(dir)?;
        if let Acquired::Locked(lock) = PinDirLock::try_acquire(dir)? {
            return Ok(lock);
        }
    }
    Err(DataplaneError::Io {
        path: dir.to_owned(),
        source: io::Error::other("the directory was moved away five times while locking it"),
    })
}

/// Every `detaching-<interface>-*` directory under `<bpffs>/wgfence` (detach markers).
fn detaching_dirs(bpffs: &Path, interface: &str) -> Result<Vec<PathBuf>> {
    let parent = bpffs.join("wgfence");
    let prefix = format!("detaching-{interface}-");
    let entries = match fs::read_dir(&parent) {
        Ok(entries) => entries,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(DataplaneError::Io {
                path: parent,
                source,
            })
        }
    };
    Ok(entries
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_prefix(&prefix))
                .is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(|e| e.path())
        .collect())
}

/// What [`remove_detaching`] found.
struct Leftovers {
    /// One of them said the agent had added the clsact qdisc.
    added_qdisc: bool,
}

/// Removes the detach markers an interrupted detach left (links first: the programs stop
/// before their maps go), except those an agent still holds locked: it lets go at its next
/// check, and the detach that renamed them waits for it.
fn remove_detaching(bpffs: &Path, interface: &str) -> Result<Leftovers> {
    let markers = detaching_dirs(bpffs, interface)?;
    let mut added_qdisc = false;
    for marker in &markers {
        if lock::is_locked(marker)? {
            tracing::info!(
                marker = %marker.display(),
                "a detach marker is still locked by an agent that has not let go yet; left alone"
            );
            continue;
        }
        added_qdisc |= marker.join(tc::QDISC_MARKER).is_dir();
        unpin_all(marker)?;
        remove_marked_dir(marker)?;
    }
    Ok(Leftovers { added_qdisc })
}

/// Puts one of [`tc::MARKERS`] (an empty directory) in the pin directory.
fn mark(pin_dir: &Path, name: &str) -> Result<()> {
    match fs::DirBuilder::new().mode(0o700).create(pin_dir.join(name)) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(()),
        Err(source) => Err(DataplaneError::Io {
            path: pin_dir.join(name),
            source,
        }),
    }
}

/// Removes the marks and then the directory itself.
fn remove_marked_dir(dir: &Path) -> Result<()> {
    for name in tc::MARKERS {
        remove_dir_if_exists(&dir.join(name))?;
    }
    remove_dir_if_exists(dir)
}

/// Removes what the agent left on the hook it does not use now (after a switch of
/// `--attach`): the link pins (tcx; the links go with them, nothing else holds them) or its
/// own filters (tc). Never anything that is not the agent's.
fn remove_other_hook(kind: HookKind, pin_dir: &Path, interface: &str, ifindex: u32) -> Result<()> {
    match kind {
        HookKind::Tc => {
            for pin in [LINK_PIN_INGRESS, LINK_PIN_EGRESS] {
                remove_if_exists(&pin_dir.join(pin))?;
            }
        }
        HookKind::Tcx => {
            remove_tc_filters(interface, ifindex)?;
        }
    }
    Ok(())
}

/// Deletes the agent's tc filters (both directions, either variant's programs); whether there
/// was any.
fn remove_tc_filters(interface: &str, ifindex: u32) -> Result<bool> {
    let mut removed = false;
    for variant in &VARIANTS {
        for hook in &hooks(variant) {
            removed |= tc::remove_ours(interface, ifindex, hook.attach_type, hook.program)?;
        }
    }
    Ok(removed)
}

/// Removes every pin in `dir`, links first; the ids of the links that were pinned there.
fn unpin_all(dir: &Path) -> Result<Vec<u32>> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        // Another detach finished it meanwhile.
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(DataplaneError::Io {
                path: dir.to_owned(),
                source,
            })
        }
    };
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    let link_index = |p: &PathBuf| {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        [LINK_PIN_INGRESS, LINK_PIN_EGRESS]
            .iter()
            .position(|link| *link == name)
    };
    paths.sort_by_key(|p| link_index(p).unwrap_or(usize::MAX));
    let mut links = Vec::new();
    for path in paths {
        if tc::MARKERS.contains(
            &path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default(),
        ) {
            // Read and removed by the caller once the filters are gone.
            continue;
        }
        if link_index(&path).is_some() {
            // Read before the pin goes, to wait for the link itself afterwards.
            if let Ok(info) = PinnedLink::from_pin(&path)
                .map(FdLink::from)
                .and_then(|l| l.info())
            {
                links.push(info.id());
            }
        }
        remove_if_exists(&path)?;
    }
    Ok(links)
}

fn remove_dir_if_exists(dir: &Path) -> Result<()> {
    match fs::remove_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(source) => Err(DataplaneError::Io {
            path: dir.to_owned(),
            source,
        }),
    }
}

fn remove_if_exists(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(source) => Err(DataplaneError::Io {
            path: path.to_owned(),
            source,
        }),
    }
}
