//! A full plan sets aside settled peers and is still the plan of every peer.

use super::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(crate::proptest_cases(300)))]

    /// A full plan leaves out the peers the kernel has as asked, and is still the plan of
    /// every peer, op for op (or the same error): against a kernel that converged, one a
    /// state behind, and either changed behind the agent's back.
    #[test]
    fn a_full_plan_without_settled_peers_is_the_plan_of_every_peer(
        states in prop::collection::vec(prop::collection::vec(gen_peer(), 0..7), 1..5),
        drifts in prop::collection::vec(prop::collection::vec(gen_drift(), 1..5), 5),
    ) {
        let mut kernel = Kernel(Actual::default().with_slot_limit(SLOTS));
        let mut old = DesiredState::default();
        for (gens, changes) in states.iter().zip(&drifts) {
            let (_, new) = build(gens);
            for actual in [kernel.actual(), drift(&kernel.0, changes)] {
                let every = plan_every_peer(&new, Scope::Full, &actual);
                prop_assert_eq!(plan(&new, &actual), every);
            }
            let planned = plan(&new, &kernel.actual());
            if over_capacity(&kernel, &new, &planned) {
                continue;
            }
            apply_checked(&mut kernel, &old, &new);
            for actual in [kernel.actual(), drift(&kernel.0, changes)] {
                let every = plan_every_peer(&new, Scope::Full, &actual);
                prop_assert_eq!(plan(&new, &actual), every);
            }
            old = new;
        }
    }
}

/// Rules that compile to nothing share the empty policy's id with `"egress": []`. A full
/// plan after the second peer's WireGuard endpoint was changed by hand (so that it is
/// planned, and the first may be set aside) is the plan of every peer.
#[test]
fn a_set_aside_peer_keeps_its_rule_block_in_the_others_entries() {
    let s = one(json!([
        { "name": "a", "publicKey": key(1), "address": "10.8.0.2",
          "egress": [{ "cidr": "10.0.0.0/8", "except": ["10.0.0.0/9", "10.128.0.0/9"] }] },
        { "name": "b", "publicKey": key(2), "address": "10.8.0.3", "egress": [] },
    ]));
    assert!(s.peers[0].policy.as_ref().is_some_and(|p| p.is_empty()));
    let mut kernel = Kernel::default();
    converge(&mut kernel, &DesiredState::default(), &s);
    let (maps, mut wg) = (kernel.0.maps.clone(), kernel.0.wg.clone());
    if let Some(b) = wg.peers.get_mut(&WgKey([2; 32])) {
        b.endpoint = Some(SocketAddr::from(([198, 51, 100, 9], 51820)));
    }
    let drifted = Actual::new(maps, wg);
    let every = plan_every_peer(&s, Scope::Full, &drifted);
    assert_eq!(plan(&s, &drifted), every);
}
