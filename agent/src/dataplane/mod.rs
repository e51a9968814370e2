//! The kernel side: load the embedded datapath, attach its two programs with tcx to the
//! WireGuard interface (ingress: enforcement; egress: reply flows), pin its maps and links under
//! `<bpffs>/wgfence/<interface>/`, adopt them on the next start, and give typed access to the
//! maps.
//!
//! Restart safety: a second [`Dataplane::attach`] reuses the pinned maps (after checking their
//! layout) and replaces each program through its pinned link with `bpf_link_update`, so there
//! is no instant without a program or without the maps' contents.
//!
//! While it runs, the agent holds the links and every map open itself, so [`Dataplane::check`]
//! can repair what happens behind its back: a WireGuard interface deleted and created again
//! (the old tcx links died with the old device: attach new ones) and pins removed by hand
//! (pin again what is missing). A pin directory removed whole is `wgfence detach` (or an
//! operator doing the same by hand): the agent lets go of the links and does not re-attach.

mod error;
mod iface;
mod layout;
mod maps;
mod test_run;
mod upgrade;

use std::{
    fs,
    io::{self, ErrorKind},
    os::unix::fs::DirBuilderExt as _,
    path::{Path, PathBuf},
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
use wgfence_common::{map_names, EGRESS_PROGRAM, INGRESS_PROGRAM, L3_OFFSET_GLOBAL};

pub use error::{DataplaneError, Result};
pub use maps::{Counters, Flow, Maps, PolicyEntry};
pub use test_run::{TestProgram, TestRun};
pub use upgrade::UpgradeReport;

/// The datapath object, built from `ebpf/` by `build.rs`.
pub(crate) static OBJECT: &[u8] = aya::include_bytes_aligned!(env!("WGFENCE_BPF_OBJECT"));

/// Where bpffs is normally mounted.
pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf";
/// File name of the pinned ingress tcx link inside an interface's pin directory.
pub const LINK_PIN: &str = "link_ingress";
/// File name of the pinned egress tcx link inside an interface's pin directory.
pub const LINK_PIN_EGRESS: &str = "link_egress";

/// One program of the datapath and where it hooks in.
struct Hook {
    program: &'static str,
    attach_type: TcAttachType,
    link_pin: &'static str,
}

/// Egress first: on a first start, flows are recorded before the ingress side judges replies.
const HOOKS: [Hook; 2] = [
    Hook {
        program: EGRESS_PROGRAM,
        attach_type: TcAttachType::Egress,
        link_pin: LINK_PIN_EGRESS,
    },
    Hook {
        program: INGRESS_PROGRAM,
        attach_type: TcAttachType::Ingress,
        link_pin: LINK_PIN,
    },
];
/// aya-log's global log level: 0 switches datapath logging off.
const AYA_LOG_LEVEL: &str = "AYA_LOG_LEVEL";
/// aya-log's `Level::Debug`.
const LOG_LEVEL_DEBUG: u8 = 4;
/// statfs(2) magic of a BPF filesystem.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

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
}

impl AttachOptions {
    pub fn new(interface: impl Into<String>) -> Self {
        Self {
            interface: interface.into(),
            bpffs: PathBuf::from(DEFAULT_BPFFS),
            datapath_debug: false,
        }
    }

    pub fn bpffs(mut self, bpffs: impl Into<PathBuf>) -> Self {
        self.bpffs = bpffs.into();
        self
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
    /// Something was repaired; the strings say what, for the log.
    Repaired {
        repairs: Vec<String>,
        /// The programs were attached to a new device (the interface was recreated): its
        /// WireGuard peers are gone too, so the caller must read the kernel again.
        reattached: bool,
    },
    /// The interface does not exist (now): nothing to attach to until it comes back.
    InterfaceGone,
    /// The pin directory was removed (`wgfence detach`): the agent let go of the links, the
    /// programs are detached, and nothing is re-attached until the agent starts again.
    Detached,
}

/// The attached datapath of one interface and its maps.
pub struct Dataplane {
    interface: String,
    pin_dir: PathBuf,
    maps: Maps,
    attachment: Attachment,
    /// The loaded object; kept so the datapath's log ring buffer stays readable and the
    /// programs can be attached again.
    ebpf: Ebpf,
    /// The tcx links, one per [`HOOKS`] entry, held open: pins removed by hand do not detach
    /// the programs while the agent runs, and can be pinned again from here.
    links: Vec<Option<FdLink>>,
    /// The pin directory was removed: the links are let go and never attached again.
    detached: bool,
    /// The interface index the links were made for.
    ifindex: u32,
    /// Where the IP header starts on that interface: a load-time constant of the programs.
    l3_offset: u32,
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
        let l3_offset = iface::l3_offset(interface)?;
        ensure_bpffs(&options.bpffs)?;
        // An interrupted detach left its links attached under another name: finish it first,
        // or its program would stay in the chain beside ours.
        remove_detaching(&options.bpffs, interface)?;
        let pin_dir = pin_dir(&options.bpffs, interface);
        create_private_dir(&pin_dir)?;
        let ifindex = iface::index(interface)?;
        // Links that run an older layout's programs: fill the new maps from the old ones
        // before the switch (see `upgrade`). Decided before the loader creates anything.
        let mut upgrade = upgrade::Upgrade::prepare(&pin_dir)?;

        let pins: Vec<(&'static str, PathBuf)> = map_names::ALL
            .iter()
            .map(|name| (*name, pin_dir.join(name)))
            .collect();
        let log_level: u8 = if options.datapath_debug {
            LOG_LEVEL_DEBUG
        } else {
            0
        };
        let mut loader = EbpfLoader::new();
        loader
            .override_global(L3_OFFSET_GLOBAL, &l3_offset, true)
            .override_global(AYA_LOG_LEVEL, &log_level, false);
        for (name, path) in &pins {
            // Reuses the pinned map if there is one, else creates and pins it.
            loader.map_pin_path(name, path.as_path());
        }
        let mut ebpf = loader.load(OBJECT)?;
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

        // Both programs are verified before either is switched: the two link updates follow
        // each other without a verifier run between them.
        for hook in &HOOKS {
            let program = classifier(&mut ebpf, hook.program)?;
            program.load().map_err(program_err(hook.program))?;
        }
        if let Some(upgrade) = upgrade.as_mut() {
            upgrade.fill(&pin_dir)?;
        }

        let mut attachment = Attachment::Created;
        let mut links = Vec::with_capacity(HOOKS.len());
        let switch = std::time::Instant::now();
        for hook in &HOOKS {
            let program = classifier(&mut ebpf, hook.program)?;
            let link_path = pin_dir.join(hook.link_pin);
            let (attached, link) = attach_or_replace(program, hook, interface, &link_path)?;
            if hook.program == INGRESS_PROGRAM {
                attachment = attached;
            }
            links.push(Some(link));
        }
        let switch = switch.elapsed();
        // The new programs enforce the full translated state from here on: what is left (late
        // flows, counter increments, the old pins) is no reason to stop the agent.
        let upgraded = upgrade.and_then(|upgrade| match upgrade.finish(&pin_dir, switch) {
            Ok(report) => Some(report),
            Err(e) => {
                tracing::error!(
                    pin_dir = %pin_dir.display(),
                    error = %crate::error_chain(&e),
                    "the programs run layout 2 with the translated state, but finishing the \
                     upgrade failed: flows recorded during the switch may be lost, the old \
                     pins are removed at the next start"
                );
                None
            }
        });
        // Pins of the old layout nothing runs any more, and the tombstone that makes an agent
        // of the old layout stop before it attaches. A failure here costs no enforcement.
        if let Err(e) = upgrade::tidy(&pin_dir) {
            tracing::error!(
                pin_dir = %pin_dir.display(),
                error = %crate::error_chain(&e),
                "could not tidy the pins of layout 1 or place the tombstone: an agent of \
                 layout 1 started now could replace the programs"
            );
        }
        tracing::info!(
            interface,
            pin_dir = %pin_dir.display(),
            l3_offset,
            ?attachment,
            layout = wgfence_common::LAYOUT_VERSION,
            "datapath attached"
        );
        Ok(Self {
            upgraded,
            interface: interface.to_owned(),
            pin_dir,
            maps,
            attachment,
            ebpf,
            links,
            detached: false,
            ifindex,
            l3_offset,
            map_pins,
        })
    }

    /// Checks that the programs are attached to the interface as it exists now and that every
    /// pin is in place, repairing what is not: a recreated interface gets new links (first in
    /// its tcx chains), a missing map or link pin is pinned again from the agent's own fds.
    /// Cheap (a name lookup and a few `stat`s): the daemon runs it every second.
    pub fn check(&mut self) -> Result<Check> {
        if self.detached {
            return Ok(Check::Detached);
        }
        let gone = match fs::symlink_metadata(&self.pin_dir) {
            Ok(_) => false,
            Err(e) if e.kind() == ErrorKind::NotFound => true,
            // Not an answer (EACCES, EIO, ...): an error to retry, never a reason to let go.
            Err(source) => {
                return Err(DataplaneError::Io {
                    path: self.pin_dir.clone(),
                    source,
                })
            }
        };
        if gone {
            // `wgfence detach` renames the directory away before it removes anything, so a
            // missing directory is an operator's decision, never a half-done detach.
            self.links.iter_mut().for_each(|l| *l = None);
            self.detached = true;
            tracing::warn!(
                interface = %self.interface,
                pin_dir = %self.pin_dir.display(),
                "the pin directory was removed (wgfence detach?): the programs are detached \
                 and stay so until the agent starts again"
            );
            return Ok(Check::Detached);
        }
        let ifindex = match iface::index(&self.interface) {
            Ok(index) => index,
            Err(DataplaneError::Interface { source, .. })
                if source.raw_os_error() == Some(libc::ENODEV) =>
            {
                return Ok(Check::InterfaceGone)
            }
            Err(e) => return Err(e),
        };
        let mut repairs = Vec::new();
        for (name, data) in &self.map_pins {
            let path = self.pin_dir.join(name);
            if !path.exists() {
                data.pin(&path).map_err(|source| DataplaneError::Pin {
                    path: path.clone(),
                    source,
                })?;
                repairs.push(format!("pinned {} again", path.display()));
            }
        }
        // A new index means a new device; so does the same index with our programs missing
        // from its hooks (recreated with `index N`, or the index reused).
        let reattached = ifindex != self.ifindex || !self.programs_attached()?;
        if reattached {
            let l3_offset = iface::l3_offset(&self.interface)?;
            if l3_offset != self.l3_offset {
                return Err(DataplaneError::InterfaceChanged {
                    interface: self.interface.clone(),
                });
            }
        }
        for (i, hook) in HOOKS.iter().enumerate() {
            let link_path = self.pin_dir.join(hook.link_pin);
            let slot = self
                .links
                .get_mut(i)
                .ok_or(DataplaneError::MissingMap(hook.link_pin))?;
            if reattached {
                // The old link died with its device: a new one, and the old pin replaced.
                remove_if_exists(&link_path)?;
                *slot = None;
                let program = classifier(&mut self.ebpf, hook.program)?;
                *slot = Some(attach_new(program, hook, &self.interface, &link_path)?);
            } else if !link_path.exists() {
                // The link is alive (this agent holds it): pin it again. Should that fail, the
                // link is gone with its fd, and a new one is attached (tcx takes a program once
                // per hook, so not before).
                let pinned = match slot.take() {
                    Some(link) => link.pin(&link_path).map(FdLink::from).map_err(|e| {
                        tracing::warn!(
                            link = %link_path.display(),
                            error = %crate::error_chain(&e),
                            "pinning the link again failed; attaching a new one"
                        );
                    }),
                    None => Err(()),
                };
                let link = match pinned {
                    Ok(link) => link,
                    Err(()) => {
                        let program = classifier(&mut self.ebpf, hook.program)?;
                        attach_new(program, hook, &self.interface, &link_path)?
                    }
                };
                *slot = Some(link);
                repairs.push(format!("pinned the link again at {}", link_path.display()));
            }
        }
        if reattached {
            self.ifindex = ifindex;
            repairs.push(format!(
                "attached to the recreated interface {} (index {ifindex})",
                self.interface
            ));
        }
        Ok(if repairs.is_empty() {
            Check::Intact
        } else {
            tracing::warn!(interface = %self.interface, ?repairs, "datapath repaired");
            Check::Repaired {
                repairs,
                reattached,
            }
        })
    }

    /// Whether the device's tcx hooks run this dataplane's programs, ingress and egress (two
    /// queries). Must run in the interface's network namespace.
    pub fn programs_attached(&mut self) -> Result<bool> {
        for hook in &HOOKS {
            let program = classifier(&mut self.ebpf, hook.program)?;
            let id = program.info().map_err(program_err(hook.program))?.id();
            let (_, attached) = SchedClassifier::query_tcx(&self.interface, hook.attach_type)
                .map_err(program_err(hook.program))?;
            if !attached.iter().any(|p| p.id() == id) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Opens the maps pinned for an interface without loading or attaching anything (for
    /// `status`, `dump` and tests).
    pub fn open_maps(bpffs: &Path, interface: &str) -> Result<Maps> {
        Maps::from_pins(&pin_dir(bpffs, interface))
    }

    /// Removes everything pinned for an interface: the link (which detaches the program) and
    /// the maps. What is already gone is not an error. Returns whether anything was removed.
    ///
    /// The directory is first renamed away (atomically, inside bpffs): a running agent sees it
    /// gone as a whole, lets go of its links and does not pin anything again, where removing
    /// the pins one by one would look like pins lost by accident, which it repairs.
    pub fn detach(bpffs: &Path, interface: &str) -> Result<bool> {
        let pinned = pin_dir(bpffs, interface);
        let dir = pinned.with_file_name(detaching_name(interface, std::process::id()));
        let renamed = match fs::rename(&pinned, &dir) {
            Ok(()) => true,
            Err(e) if e.kind() == ErrorKind::NotFound => false,
            Err(source) => {
                return Err(DataplaneError::Io {
                    path: pinned,
                    source,
                })
            }
        };
        // This detach's directory, and any an interrupted one left (its links still attached).
        let leftovers = remove_detaching(bpffs, interface)?;
        // Leave <bpffs>/wgfence itself once no interface uses it.
        if let Some(parent) = dir.parent() {
            let _ = fs::remove_dir(parent);
        }
        if renamed || leftovers {
            tracing::info!(interface, "datapath detached");
        }
        Ok(renamed || leftovers)
    }

    /// The pinned link of an interface, if any: (link id, program id).
    pub fn link_info(bpffs: &Path, interface: &str) -> Result<Option<(u32, u32)>> {
        Self::pinned_link_info(bpffs, interface, LINK_PIN)
    }

    /// The pinned egress link of an interface, if any: (link id, program id). Without it,
    /// replies to network-started flows do not pass (enforcement is the ingress link's).
    pub fn egress_link_info(bpffs: &Path, interface: &str) -> Result<Option<(u32, u32)>> {
        Self::pinned_link_info(bpffs, interface, LINK_PIN_EGRESS)
    }

    fn pinned_link_info(bpffs: &Path, interface: &str, pin: &str) -> Result<Option<(u32, u32)>> {
        let path = pin_dir(bpffs, interface).join(pin);
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

    pub fn interface(&self) -> &str {
        &self.interface
    }

    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    pub fn attachment(&self) -> Attachment {
        self.attachment
    }

    /// What this attach carried over from a datapath of an older layout, if it upgraded one.
    pub fn upgraded(&self) -> Option<&UpgradeReport> {
        self.upgraded.as_ref()
    }

    /// The map layout the datapath pinned for an interface runs, from what its ingress link's
    /// program uses (not from which pins exist); `None` when no link is pinned or it runs a
    /// program that is not wgfence's.
    pub fn running_layout(bpffs: &Path, interface: &str) -> Result<Option<u32>> {
        upgrade::running_layout(&pin_dir(bpffs, interface))
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

/// One of the datapath's classifiers ([`INGRESS_PROGRAM`], [`EGRESS_PROGRAM`]).
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

/// Replaces the program behind the pinned link if it is still attached; otherwise (no pin, or
/// a pin whose interface went away) attaches anew and pins the new link. Returns the link, held
/// open by the caller.
fn attach_or_replace(
    program: &mut SchedClassifier,
    hook: &Hook,
    interface: &str,
    link_path: &Path,
) -> Result<(Attachment, FdLink)> {
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
                let link = FdLink::try_from(link).map_err(link_err)?;
                return Ok((Attachment::Replaced, link));
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
) -> Result<FdLink> {
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
    let pinned = link.pin(link_path).map_err(|source| DataplaneError::Pin {
        path: link_path.to_owned(),
        source,
    })?;
    Ok(FdLink::from(pinned))
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

/// Removes every `detaching-<interface>-*` directory under `<bpffs>/wgfence`, links first (the
/// programs stop before their maps go); whether there was any.
fn remove_detaching(bpffs: &Path, interface: &str) -> Result<bool> {
    let parent = bpffs.join("wgfence");
    let prefix = format!("detaching-{interface}-");
    let entries = match fs::read_dir(&parent) {
        Ok(entries) => entries,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(false),
        Err(source) => {
            return Err(DataplaneError::Io {
                path: parent,
                source,
            })
        }
    };
    let dirs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_prefix(&prefix))
                .is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(|e| e.path())
        .collect();
    for dir in &dirs {
        let entries = match fs::read_dir(dir) {
            Ok(entries) => entries,
            // Another detach finished it meanwhile.
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(source) => {
                return Err(DataplaneError::Io {
                    path: dir.clone(),
                    source,
                })
            }
        };
        let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort_by_key(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            [LINK_PIN, LINK_PIN_EGRESS]
                .iter()
                .position(|link| *link == name)
                .unwrap_or(usize::MAX)
        });
        for path in paths {
            remove_if_exists(&path)?;
        }
        match fs::remove_dir(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(source) => {
                return Err(DataplaneError::Io {
                    path: dir.clone(),
                    source,
                })
            }
        }
    }
    Ok(!dirs.is_empty())
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
