//! The kernel read as the agent reads it when it starts, without attaching or changing
//! anything ([`read_pinned`]: `wgfence verify` compares a state with it), and what `run` would
//! change now ([`preview`]: `wgfence plan`), planned as its first reconcile plans (the whole
//! state compared, without the peers whose window is over, then the settings entry).

use std::{fmt, path::Path};

use wgfence_common::Config;

use super::{read_maps, settings_ops, ReconcileError};
use crate::{
    dataplane::{pin_dir, Dataplane},
    plan::{plan, Actual, ActualMaps, Plan, Unplanned},
    settings::{online_cpus, DatapathSettings},
    state::DesiredState,
    wg::WireGuard,
};

/// The plan `run` would apply now.
#[derive(Debug)]
pub struct Preview {
    pub interface: String,
    /// Something is pinned for the interface; if not, the plan is against empty maps.
    pub pinned: bool,
    /// The plan, or what of it `run` would apply (its lead) when the whole cannot be.
    pub planned: Result<Plan, Unplanned>,
}

/// The pinned maps and the WireGuard device of `interface` as the planner sees them, with the
/// kernel's settings entry; an error when nothing is pinned.
pub fn read_pinned(bpffs: &Path, interface: &str) -> Result<(Actual, Config), ReconcileError> {
    let maps = Dataplane::open_maps(bpffs, interface)?;
    let config = maps.config()?;
    let maps = read_maps(&maps)?;
    let wg = WireGuard::open(interface)?.read()?;
    Ok((Actual::new(maps, wg), config))
}

/// Reads the pinned maps (if any) and the WireGuard device of `interface` and plans `desired`
/// with `settings` against them.
pub fn preview(
    bpffs: &Path,
    interface: &str,
    desired: &DesiredState,
    settings: &DatapathSettings,
) -> Result<Preview, ReconcileError> {
    let pinned = pin_dir(bpffs, interface).exists();
    let (actual, kernel) = if pinned {
        let (actual, config) = read_pinned(bpffs, interface)?;
        (actual, Some(config))
    } else {
        let wg = WireGuard::open(interface)?.read()?;
        (Actual::new(ActualMaps::default(), wg), None)
    };
    let desired = desired.unexpired(crate::clock::unix_secs());
    let ops = settings_ops(settings, desired.replies, online_cpus(), kernel.as_ref());
    let planned = plan(&desired, &actual).map(|plan| plan.with_settings(ops));
    Ok(Preview {
        interface: interface.to_owned(),
        pinned,
        planned,
    })
}

/// One operation a line; a plan that can be made ends with its count of writes and changes,
/// one that cannot lists only its lead (the error is the caller's to report).
impl fmt::Display for Preview {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.pinned {
            writeln!(
                f,
                "note: nothing is pinned for {}; planning against empty maps",
                self.interface
            )?;
        }
        let ops = match &self.planned {
            Ok(plan) => &plan.ops,
            Err(unplanned) => &unplanned.lead.ops,
        };
        for op in ops {
            writeln!(f, "{op}")?;
        }
        if let Ok(plan) = &self.planned {
            writeln!(
                f,
                "{} map writes, {} WireGuard peer changes",
                plan.map_writes(),
                plan.wg_changes()
            )?;
        }
        Ok(())
    }
}
