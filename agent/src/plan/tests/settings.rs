//! The settings entry follows the lead.

use super::*;

/// The settings entry is part of the plan, right after the lead: written only when it
/// differs (never for the owner high-water mark alone); replies switched off forget every
/// flow.
#[test]
fn settings_follow_the_lead_and_replies_off_forgets_every_flow() {
    let settings = crate::settings::DatapathSettings::default();
    let on = settings.config(true, 2);
    let off = settings.config(false, 2);
    let kernel = Config {
        owner_high: 7,
        ..on
    };
    assert!(plan_settings(&on, Some(&kernel)).is_empty());
    assert_eq!(
        plan_settings(&off, Some(&kernel)),
        [
            Op::PutSettings {
                config: Config {
                    owner_high: 7,
                    ..off
                },
                replies_before: Some(true),
            },
            Op::ForgetAllFlows
        ]
    );
    assert_eq!(plan_settings(&on, None).len(), 1);
    let revoke = Plan {
        ops: vec![Op::DeletePeerEntry {
            addr: IpAddr::from([10, 8, 0, 2]),
        }],
    };
    let with = revoke.with_settings(plan_settings(&off, Some(&kernel)));
    assert!(matches!(
        with.ops.as_slice(),
        [
            Op::DeletePeerEntry { .. },
            Op::PutSettings { .. },
            Op::ForgetAllFlows
        ]
    ));
    assert_eq!((with.map_writes(), with.wg_changes()), (2, 0));
}
