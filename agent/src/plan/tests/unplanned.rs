//! A plan without room still revokes.

use super::*;

/// A plan that fails for want of a slot still revokes: its lead (the revoked peer's entry,
/// its WireGuard peer, its policy) comes with the error, and applies.
#[test]
fn a_plan_without_room_still_revokes() {
    let rules = json!([{ "cidr": "10.0.0.0/8", "protocol": "tcp" }]);
    let before = one(json!([
        { "name": "a", "publicKey": key(1), "address": "10.8.0.2" },
        { "name": "r", "publicKey": key(2), "address": "10.8.0.3", "egress": rules },
    ]));
    // r goes, two come: three peers at two slots.
    let after = one(json!([
        { "name": "a", "publicKey": key(1), "address": "10.8.0.2" },
        { "name": "n", "publicKey": key(3), "address": "10.8.0.4" },
        { "name": "o", "publicKey": key(4), "address": "10.8.0.5" },
    ]));
    for incremental in [false, true] {
        let mut kernel = Kernel(Actual::default().with_slot_limit(2));
        converge(&mut kernel, &DesiredState::default(), &before);
        let planned = plan_either(incremental, &before, &after, &kernel);
        let Err(Unplanned { error, lead }) = planned else {
            panic!("incremental {incremental}: planned {planned:?}");
        };
        assert_eq!(error, PlanError::SlotsExhausted);
        for op in &lead.ops {
            kernel.apply(op);
            assert_safe_midway(&kernel, &before, &after);
        }
        let maps = kernel.0.maps();
        assert!(
            !maps.peers.contains_key(&IpAddr::from([10, 8, 0, 3])),
            "incremental {incremental}: r's entry stays: {lead:?}"
        );
        assert!(!kernel.0.wg().peers.contains_key(&WgKey([2; 32])));
        assert!(maps.policies.is_empty(), "r's policy stays: {lead:?}");
        assert!(maps.peers.contains_key(&IpAddr::from([10, 8, 0, 2])));
    }
}
