//! Restart safety: each program goes in through its pinned tcx link with `bpf_link_update`,
//! so there is no instant without a program; a hook without a live link (no pin, or a pin
//! whose interface went away) gets a new one, first in the chain, pinned under a fresh name
//! that then replaces the old pin in one step.

use std::{
    fs,
    path::{Path, PathBuf},
};

use aya::{
    programs::links::{FdLink, LinkOrder, PinnedLink},
    programs::tc::{SchedClassifierLink, TcAttachOptions},
    programs::SchedClassifier,
};

use super::{
    pins::remove_if_exists, program_err, Attachment, DataplaneError, HeldLink, Hook, Result,
};

/// Replaces the program behind the pinned link if it is still attached; otherwise (no pin, or
/// a pin whose interface went away) attaches anew and pins the new link. Returns the link, held
/// open by the caller.
pub(super) fn attach_or_replace(
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
pub(super) fn attach_new(
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
pub(super) fn pin_over(link: &HeldLink, link_path: &Path) -> Result<()> {
    let fresh = fresh_pin(link_path);
    remove_if_exists(&fresh)?;
    link.pin(&fresh)?;
    rename_pin(&fresh, link_path)
}
