//! Steps 5 and 7: owners of address entries, and the entries of addresses that move.

use super::*;

#[test]
fn key_rotation_gives_the_addresses_new_owners_and_keeps_policy_and_slot() {
    let mut kernel = Kernel::default();
    let old = one(
        json!([{ "name": "a", "publicKey": key(1), "address": "10.8.0.2", "addressV6": "fd00:8::2" }]),
    );
    let new = one(
        json!([{ "name": "a", "publicKey": key(2), "address": "10.8.0.2", "addressV6": "fd00:8::2" }]),
    );
    converge(&mut kernel, &DesiredState::default(), &old);
    let before = kernel.0.maps().peers.clone();
    let rotate = converge(&mut kernel, &old, &new);
    // The old key is cut off first (its entries, then its WireGuard peer); the entries
    // come back with new owners once WireGuard routes the addresses to the new key.
    assert!(
        matches!(
            rotate.ops.as_slice(),
            [
                Op::DeletePeerEntry { .. },
                Op::DeletePeerEntry { .. },
                Op::ForgetFlows { .. },
                Op::RemoveWgPeer { .. },
                Op::RaiseOwnerHigh { owner: 4 },
                Op::WgPeer(c),
                Op::PutPeerEntry { .. },
                Op::PutPeerEntry { .. },
            ] if c.create
        ),
        "{:#?}",
        rotate.ops
    );
    for (addr, entry) in &kernel.0.maps().peers {
        let old = before[addr];
        assert_eq!((entry.policy, entry.slot), (old.policy, old.slot));
        assert!(entry.owner > old.owner, "{addr}: {entry:?} after {old:?}");
    }
}

/// Issue 11 item 4: a new peer takes an address in the same push that removes its holder,
/// with equal rules. The plan used to hold only WireGuard operations, so the new peer's
/// packets passed as replies to the old peer's flows.
#[test]
fn a_new_holder_with_equal_rules_gets_a_new_owner() {
    let rules = json!([{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443] }]);
    let old = one(
        json!([{ "name": "old", "publicKey": key(1), "address": "10.8.0.2",
        "addressV6": "fd00:8::2", "egress": rules }]),
    );
    let new = one(
        json!([{ "name": "new", "publicKey": key(2), "address": "10.8.0.2",
        "addressV6": "fd00:8::2", "egress": rules }]),
    );
    for incremental in [true, false] {
        let mut kernel = Kernel::default();
        converge(&mut kernel, &DesiredState::default(), &old);
        let before = owners(&kernel);
        let take = if incremental {
            converge(&mut kernel, &old, &new)
        } else {
            let plan = plan(&new, &kernel.actual()).unwrap();
            for op in &plan.ops {
                kernel.apply(op);
            }
            assert_converged(&kernel, &new);
            plan
        };
        assert!(take.map_writes() > 0, "{:#?}", take.ops);
        let after = owners(&kernel);
        for (addr, owner) in &after {
            assert!(
                *owner > before[addr],
                "{addr} kept owner {owner} (incremental: {incremental})"
            );
        }
        // And once converged, nothing more: an unchanged state costs no write.
        assert!(plan(&new, &kernel.actual()).is_ok_and(|p| p.is_empty()));
    }
}

#[test]
fn owners_are_never_reused_after_a_restart() {
    let mut kernel = Kernel::default();
    let a = one(json!([{ "name": "a", "publicKey": key(1), "address": "10.8.0.2" }]));
    let b = one(json!([{ "name": "b", "publicKey": key(2), "address": "10.8.0.2" }]));
    converge(&mut kernel, &DesiredState::default(), &a);
    let first = owners(&kernel)[&IpAddr::from([10, 8, 0, 2])];
    converge(&mut kernel, &a, &DesiredState::default());
    assert!(kernel.0.maps().peers.is_empty());
    assert_eq!(kernel.0.maps().owner_high, first);
    // A restarted agent reads only the kernel: the high-water mark is all that is left.
    let restarted = Actual::new(kernel.0.maps().clone(), kernel.0.wg().clone());
    let plan = plan(&b, &restarted).unwrap();
    let owner = plan.ops.iter().find_map(|op| match op {
        Op::PutPeerEntry { entry, .. } => Some(entry.owner),
        _ => None,
    });
    assert_eq!(owner, Some(first + 1), "{:#?}", plan.ops);
    let raise = plan
        .ops
        .iter()
        .position(|op| matches!(op, Op::RaiseOwnerHigh { owner } if *owner == first + 1));
    let put = plan
        .ops
        .iter()
        .position(|op| matches!(op, Op::PutPeerEntry { .. }));
    assert!(raise < put && raise.is_some(), "{:#?}", plan.ops);
}

#[test]
fn an_address_taken_over_with_another_policy_is_written_after_wireguard_moves_it() {
    let mut kernel = Kernel::default();
    let old = one(json!([
        { "name": "a", "publicKey": key(1), "address": "10.8.0.2" },
    ]));
    let new = one(json!([
        { "name": "b", "publicKey": key(2), "address": "10.8.0.2",
          "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp" }] },
    ]));
    converge(&mut kernel, &DesiredState::default(), &old);
    let take = converge(&mut kernel, &old, &new);
    let pos = |f: &dyn Fn(&Op) -> bool| take.ops.iter().position(f).unwrap_or(usize::MAX);
    let delete = pos(&|o| matches!(o, Op::DeletePeerEntry { .. }));
    let wg = pos(&|o| matches!(o, Op::WgPeer(_)));
    let put = pos(&|o| matches!(o, Op::PutPeerEntry { .. }));
    assert!(delete < wg && wg < put, "{:#?}", take.ops);
}
