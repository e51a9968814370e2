//! Attaching ([`Dataplane::attach`]): claim the interface (bpffs, the hook, the pin directory
//! locked, an interrupted detach finished), load or adopt the programs ([`super::load`]), fill
//! the maps of an older layout ([`super::upgrade`]), switch the hooks to the new programs
//! through their links ([`super::links`]), and tidy what the switch left behind.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use aya::{programs::SchedClassifier, Ebpf};
use wgfence_common::Variant;

use super::{
    detach::{mark, remove_detaching, remove_tc_filters},
    hook, hooks, iface,
    links::attach_or_replace,
    load::{adopt_or_load, keep_programs, load_object, program_identity, program_of},
    pin_dir,
    pins::{ensure_bpffs, lock_pin_dir, remove_dir_if_exists, remove_if_exists},
    program_err, tc, upgrade, AttachOptions, Attachment, Dataplane, DataplaneError, HeldLink, Hook,
    HookKind, HookMode, Maps, PinDirLock, Result, UpgradeReport, LINK_PIN_EGRESS, LINK_PIN_INGRESS,
};

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
            identity,
            lock: Some(claim.lock),
            detached: false,
            unpinned: None,
            ifindex,
            variant,
            map_pins,
        })
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
    pub(super) added_qdisc: bool,
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
                "the programs run layout 4 with the copied state, but finishing the \
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
