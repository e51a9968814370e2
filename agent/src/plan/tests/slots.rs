//! Step 5: counter slots at a full map.

use super::*;

/// Review of issue 11, finding 3: "revoke r + add n" with every counter slot in use gives
/// n the slot r's deletion frees, never the slot of a peer that stays (which would wipe
/// its counters and share its flow quota); with no slot freed, the plan fails.
#[test]
fn a_full_map_reuses_only_the_slots_the_lead_frees() {
    // "a" (slot 0) stays; "r" (slot 1) goes; "n" comes.
    let before = one(json!([
        { "name": "a", "publicKey": key(1), "address": "10.8.0.2" },
        { "name": "r", "publicKey": key(2), "address": "10.8.0.3" },
    ]));
    let after = one(json!([
        { "name": "a", "publicKey": key(1), "address": "10.8.0.2" },
        { "name": "n", "publicKey": key(3), "address": "10.8.0.4" },
    ]));
    for incremental in [false, true] {
        let mut kernel = Kernel(Actual::default().with_slot_limit(2));
        converge(&mut kernel, &DesiredState::default(), &before);
        let slot = |k: &Kernel, n: u8| kernel_entry(k, IpAddr::from([10, 8, 0, n])).slot;
        let (a, r) = (slot(&kernel, 2), slot(&kernel, 3));
        let p = plan_either(incremental, &before, &after, &kernel).unwrap();
        for op in &p.ops {
            kernel.apply(op);
            assert_safe_midway(&kernel, &before, &after);
        }
        assert_converged(&kernel, &after);
        assert_eq!(slot(&kernel, 2), a, "incremental {incremental}");
        assert_eq!(
            slot(&kernel, 4),
            r,
            "incremental {incremental}: n did not get r's slot: {:#?}",
            p.ops
        );
        assert!(
            !p.ops.contains(&Op::ResetPeerCounters { slot: a }),
            "incremental {incremental}: a's counters are reset: {:#?}",
            p.ops
        );
    }
    // Adding n without revoking anyone: no slot is free, so no plan.
    let mut kernel = Kernel(Actual::default().with_slot_limit(2));
    converge(&mut kernel, &DesiredState::default(), &before);
    let more = one(json!([
        { "name": "a", "publicKey": key(1), "address": "10.8.0.2" },
        { "name": "n", "publicKey": key(3), "address": "10.8.0.4" },
        { "name": "r", "publicKey": key(2), "address": "10.8.0.3" },
    ]));
    for planned in [
        plan_update(&before, &more, &kernel.actual()),
        plan(&more, &kernel.actual()),
    ] {
        assert_eq!(planned.map_err(|u| u.error), Err(PlanError::SlotsExhausted));
    }
}

/// The fuzzer's fuzz/corpus/plan/slots-exhausted-at-a-full-map: four peers at four slots,
/// after two states that moved addresses between keys. Peer-0 (key 4) keeps its entry
/// fd00:8::8 in slot 0 and takes over 10.8.0.2 (slot 1, key 1's). It used to keep slot 1,
/// leaving slot 0 to nobody until its puts ran, so the fourth peer found no slot.
#[test]
fn a_full_map_keeps_the_slot_of_the_entries_that_stay() {
    let states = [
        json!([{ "name": "peer-3", "publicKey": key(1), "address": "10.8.0.5" }]),
        json!([
            { "name": "peer-2", "publicKey": key(4), "address": "10.8.0.5", "addressV6": "fd00:8::8",
              "egress": [{ "cidr": "fd00:1::/103", "protocol": "tcp", "ports": ["444-446", "442-443", 444] }] },
            { "name": "peer-3", "publicKey": key(1), "address": "10.8.0.2", "persistentKeepalive": 0 },
        ]),
        json!([
            { "name": "peer-3", "publicKey": key(7), "address": "10.8.0.3" },
            { "name": "peer-0", "publicKey": key(4), "address": "10.8.0.2", "addressV6": "fd00:8::8",
              "egress": [{ "cidr": "0.0.0.0/0", "protocol": "any" }], "persistentKeepalive": 0 },
            { "name": "peer-1", "publicKey": key(1), "address": "10.8.0.4", "addressV6": "fd00:8::3",
              "egress": [], "endpoint": "198.51.100.1:51820", "persistentKeepalive": 50 },
            { "name": "peer-2", "publicKey": key(3), "address": "10.8.0.5", "addressV6": "fd00:8::7",
              "egress": [{ "cidr": "fd00:3::/126", "protocol": "icmp" }], "endpoint": "198.51.100.1:51820",
              "presharedKey": key(102) },
        ]),
    ];
    for incremental in [false, true] {
        let mut kernel = Kernel(Actual::default().with_slot_limit(4));
        let mut old = DesiredState::default();
        for peers in &states {
            let new = one(peers.clone());
            let p = plan_either(incremental, &old, &new, &kernel)
                .unwrap_or_else(|e| panic!("incremental {incremental}: {e}"));
            apply_plan_checked(&mut kernel, &old, &new, &p);
            assert_converged(&kernel, &new);
            old = new;
        }
    }
}

/// Two peers' entries share a slot (changed behind the agent's back) at a full map: neither
/// can keep it while the other uses it, so the lead deletes both entries, which frees the
/// slot, and the plan converges with one slot each.
#[test]
fn a_shared_slot_at_a_full_map_rotates_through_the_lead() {
    let s = one(json!([
        { "name": "a", "publicKey": key(1), "address": "10.8.0.2" },
        { "name": "b", "publicKey": key(2), "address": "10.8.0.3" },
    ]));
    let mut kernel = Kernel(Actual::default().with_slot_limit(2));
    converge(&mut kernel, &DesiredState::default(), &s);
    let mut maps = kernel.0.maps().clone();
    for entry in maps.peers.values_mut() {
        entry.slot = 0;
    }
    kernel.0 = Actual::new(maps, kernel.0.wg().clone()).with_slot_limit(2);
    let p = plan(&s, &kernel.actual()).unwrap();
    for op in &p.ops {
        kernel.apply(op);
    }
    assert_converged(&kernel, &s);
    assert!(plan(&s, &kernel.actual()).is_ok_and(|p| p.is_empty()));
}
