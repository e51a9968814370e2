//! Every plan converges, safely at each operation: property tests over generated states, full
//! and incremental, and drift repaired.

use super::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(crate::proptest_cases(300)))]

    #[test]
    fn plans_converge_safely_and_an_equal_state_plans_nothing(
        states in prop::collection::vec(prop::collection::vec(gen_peer(), 0..7), 1..6),
    ) {
        let mut kernel = Kernel(Actual::default().with_slot_limit(SLOTS));
        let mut old = DesiredState::default();
        for gens in &states {
            let (_, new) = build(gens);
            if over_capacity(&kernel, &new, &plan(&new, &kernel.actual())) {
                continue;
            }
            apply_checked(&mut kernel, &old, &new);
            assert_converged(&kernel, &new);
            // The same state, peers in reverse order: nothing to do.
            let mut reversed = gens.clone();
            reversed.reverse();
            let (_, again) = build(&reversed);
            if again == new {
                let replan = plan(&again, &kernel.actual()).unwrap();
                prop_assert!(replan.is_empty(), "reordered state planned {:?}", replan.ops);
            }
            old = new;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(crate::proptest_cases(300)))]

    /// The same, planning only what differs from the previous state (what the agent does
    /// between resyncs): it must end where a full plan ends, just as safely.
    #[test]
    fn incremental_plans_converge_like_full_ones(
        states in prop::collection::vec(prop::collection::vec(gen_peer(), 0..7), 1..6),
    ) {
        let mut kernel = Kernel(Actual::default().with_slot_limit(SLOTS));
        let mut old = DesiredState::default();
        for gens in &states {
            let (_, new) = build(gens);
            let update = plan_update(&old, &new, &kernel.actual());
            if over_capacity(&kernel, &new, &update) {
                continue;
            }
            let update = update.unwrap();
            apply_plan_checked(&mut kernel, &old, &new, &update);
            assert_converged(&kernel, &new);
            let full = plan(&new, &kernel.actual()).unwrap();
            prop_assert!(full.is_empty(), "a full plan after the incremental one: {:?}", full.ops);
            prop_assert!(plan_update(&new, &new, &kernel.actual()).map(|p| p.is_empty()).unwrap_or(false));
            old = new;
        }
    }
}

#[test]
fn drift_is_repaired() {
    let mut kernel = Kernel::default();
    let s = one(json!([
        { "name": "a", "publicKey": key(1), "address": "10.8.0.2",
          "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp" }, { "cidr": "10.1.0.0/16", "protocol": "udp" }] },
        { "name": "b", "publicKey": key(2), "address": "10.8.0.3" },
    ]));
    converge(&mut kernel, &DesiredState::default(), &s);
    // An entry deleted by hand, a policy entry deleted by hand, a WireGuard peer removed.
    let maps = &mut kernel.0.maps;
    maps.peers.remove(&IpAddr::from([10, 8, 0, 3]));
    if let Some(policy) = maps.policies.values_mut().next() {
        let prefix = policy.entries().next().map(|(p, _)| p);
        if let Some(prefix) = prefix {
            Arc::make_mut(policy).remove_entry(&prefix);
        }
    }
    kernel.0.wg.peers.remove(&WgKey([2; 32]));
    kernel.0 = Actual::new(kernel.0.maps.clone(), kernel.0.wg.clone());
    // The kernel is already broken, so the midway invariants cannot hold; apply plainly.
    let repair = plan(&s, &kernel.actual()).unwrap();
    for op in &repair.ops {
        kernel.apply(op);
    }
    assert_converged(&kernel, &s);
    assert!(plan(&s, &kernel.actual())
        .map(|p| p.is_empty())
        .unwrap_or(false));
}
