//! Reading a datapath without attaching to it (for `status`, `dump` and the tests): its pinned
//! maps, links, tc filters, layout and variant.

use std::path::Path;

use aya::programs::links::{FdLink, PinnedLink};
use wgfence_common::{Variant, VARIANTS};

use super::{
    hooks, iface, pin_dir, tc, upgrade, Dataplane, DataplaneError, Maps, Result, LINK_PIN_EGRESS,
    LINK_PIN_INGRESS,
};

impl Dataplane {
    /// Opens the maps pinned for an interface without loading or attaching anything (for
    /// `status`, `dump` and tests).
    pub fn open_maps(bpffs: &Path, interface: &str) -> Result<Maps> {
        Maps::from_pins(&pin_dir(bpffs, interface))
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
    pub(super) fn pinned_link_info_at(path: &Path) -> Result<Option<(u32, u32)>> {
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
}
