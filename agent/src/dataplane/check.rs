//! Repairing what happens behind the agent's back ([`Dataplane::check`], every second): a
//! recreated or renamed interface, a detached link, pins or the pin directory removed; and
//! letting go only for the detach marker of the very directory this agent locked.

use std::{
    fs,
    io::{self, ErrorKind},
    path::PathBuf,
};

use super::{
    detach::{detaching_dirs, mark},
    hooks, iface,
    links::{attach_new, pin_over},
    load::{program_of, program_pin},
    pins::{ensure_bpffs, lock_pin_dir},
    sys, tc, upgrade, Check, Dataplane, DataplaneError, HeldLink, Hook, HookKind, PinDirLock,
    Repair, Result,
};

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
pub(super) struct Retired {
    ifindex: u32,
    hook: usize,
    _link: HeldLink,
}

impl Dataplane {
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
            Ok(_) => self.restore_pins(&mut repairs).err(),
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

    /// Pins again every map whose pin is missing, from the agent's own descriptors, then the
    /// tombstones that stop an older agent, and (tcx) the programs the next start takes over.
    fn restore_pins(&mut self, repairs: &mut Vec<Repair>) -> Result<()> {
        for (name, data) in &self.map_pins {
            let path = self.pin_dir.join(name);
            if path.exists() {
                continue;
            }
            data.pin(&path)
                .map_err(|source| DataplaneError::Pin { path, source })?;
            repairs.push(Repair::MapPin(name));
        }
        for name in upgrade::restore_tombstones(&self.pin_dir)? {
            repairs.push(Repair::MapPin(name));
        }
        for name in self.maps.restore_tries_dirs()? {
            repairs.push(Repair::PolicyTries(name));
        }
        if self.hook == HookKind::Tcx {
            for hook in hooks(&self.variant) {
                let path = program_pin(&self.pin_dir, &hook, &self.identity);
                if path.exists() {
                    continue;
                }
                program_of(&mut self.ebpf, &mut self.adopted, hook.program)?
                    .pin(&path)
                    .map_err(|source| DataplaneError::Pin { path, source })?;
                repairs.push(Repair::ProgramPin(hook.program));
            }
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
}
