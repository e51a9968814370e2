//! Steps 1 and 2: revocations lead every plan, before any put.

use super::*;

#[test]
fn add_then_revoke_follows_the_ordering_rules() {
    let mut kernel = Kernel::default();
    let empty = DesiredState::default();
    let alice = one(
        json!([{ "name": "alice", "publicKey": key(1), "address": "10.8.0.2",
        "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp" }] }]),
    );
    let add = converge(&mut kernel, &empty, &alice);
    let kinds: Vec<&str> = add
        .ops
        .iter()
        .map(|op| match op {
            Op::PutPolicyEntry { .. } => "policy",
            Op::ResetPeerCounters { .. } => "reset",
            Op::ResetRuleCounters { .. } => "rules",
            Op::RaiseOwnerHigh { .. } => "owners",
            Op::PutPeerEntry { .. } => "peer",
            Op::WgPeer(_) => "wg",
            _ => "other",
        })
        .collect();
    assert_eq!(kinds, ["policy", "reset", "rules", "owners", "peer", "wg"]);

    let revoke = converge(&mut kernel, &alice, &empty);
    let kinds: Vec<&str> = revoke
        .ops
        .iter()
        .map(|op| match op {
            Op::DeletePeerEntry { .. } => "peer",
            Op::ForgetFlows { .. } => "flows",
            Op::RemoveWgPeer { .. } => "wg",
            Op::DeletePolicyEntry { .. } => "policy",
            _ => "other",
        })
        .collect();
    assert_eq!(kinds, ["peer", "flows", "wg", "policy"]);
}

/// Issue 11 item 5: at capacity (a full peer map, a full trie) a put fails, so a
/// revocation must not wait behind one. "Revoke r + add n": r's address entries, then r's
/// WireGuard peer, go before every put, in a full plan and in an incremental one; a put
/// that fails after them leaves r revoked, and the retry does not delete r again.
#[test]
fn revoke_r_and_add_n_deletes_r_before_any_put() {
    let before = one(json!([
        { "name": "r", "publicKey": key(1), "address": "10.8.0.2", "addressV6": "fd00:8::2",
          "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp" }] },
        { "name": "u", "publicKey": key(2), "address": "10.8.0.3" },
    ]));
    let after = one(json!([
        { "name": "n", "publicKey": key(3), "address": "10.8.0.4",
          "egress": [{ "cidr": "192.0.2.0/24", "protocol": "udp" }] },
        { "name": "u", "publicKey": key(2), "address": "10.8.0.3" },
    ]));
    let mut kernel = Kernel::default();
    converge(&mut kernel, &DesiredState::default(), &before);
    let revocation = [
        Op::DeletePeerEntry {
            addr: IpAddr::from([10, 8, 0, 2]),
        },
        Op::DeletePeerEntry {
            addr: "fd00:8::2".parse().unwrap_or(IpAddr::from([0; 16])),
        },
        Op::ForgetFlows {
            addrs: vec![
                IpAddr::from([10, 8, 0, 2]),
                "fd00:8::2".parse().unwrap_or(IpAddr::from([0; 16])),
            ],
        },
        Op::RemoveWgPeer {
            key: WgKey([1; 32]),
        },
    ];
    let full = plan(&after, &kernel.actual()).unwrap();
    let update = plan_update(&before, &after, &kernel.actual()).unwrap();
    for (how, p) in [("full", &full), ("incremental", &update)] {
        assert!(
            p.ops.starts_with(&revocation),
            "{how}: r is not revoked before the first put: {:#?}",
            p.ops
        );
        if let Err(e) = invariants::check_revocations_lead(&kernel.0, &after, &p.ops) {
            panic!("{how}: {e}");
        }
    }

    // The first put fails (the map is full): what ran before it stays, and the retry, a
    // full plan from the kernel as it is, does not touch r again.
    let mut failed = kernel.clone();
    for op in &update.ops[..revocation.len()] {
        failed.apply(op);
        assert_safe_midway(&failed, &before, &after);
    }
    let retry = plan(&after, &failed.actual()).unwrap();
    assert!(
        !retry.ops.iter().any(|op| revocation.contains(op)),
        "the retry revokes r again: {:#?}",
        retry.ops
    );
    for op in &retry.ops {
        failed.apply(op);
        assert_safe_midway(&failed, &before, &after);
    }
    assert_converged(&failed, &after);
}

/// Review of issue 11, finding 1: "rotate alice K1 -> K2 (K1 leaked), same rules", pushed
/// with a put that fails (a new policy at a full trie). The old key's packets are dropped
/// from the first operation on, and its WireGuard peer is gone before the first put, so
/// nothing a failing put stops keeps the leaked key in.
#[test]
fn a_key_rotation_cuts_the_old_key_off_before_any_put() {
    let rules = json!([{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443] }]);
    let before = one(json!([
        { "name": "alice", "publicKey": key(1), "address": "10.8.0.2", "egress": rules },
        { "name": "carol", "publicKey": key(3), "address": "10.8.0.3" },
    ]));
    let after = one(json!([
        { "name": "alice", "publicKey": key(2), "address": "10.8.0.2", "egress": rules },
        { "name": "carol", "publicKey": key(3), "address": "10.8.0.3" },
        { "name": "dave", "publicKey": key(4), "address": "10.8.0.4",
          "egress": [{ "cidr": "192.0.2.0/24", "protocol": "udp" }] },
    ]));
    let old_key = WgKey([1; 32]);
    let alice = IpAddr::from([10, 8, 0, 2]);
    for incremental in [false, true] {
        let mut kernel = Kernel::default();
        converge(&mut kernel, &DesiredState::default(), &before);
        let p = plan_either(incremental, &before, &after, &kernel).unwrap();
        if let Err(e) = invariants::check_revocations_lead(&kernel.0, &after, &p.ops) {
            panic!("incremental {incremental}: {e}");
        }
        // Every put fails: only the lead runs.
        let lead = lead(&p.ops);
        for (i, op) in lead.iter().enumerate() {
            kernel.apply(op);
            let held = kernel.0.holder(alice) == Some(old_key);
            assert!(
                !(held && kernel.0.maps().peers.contains_key(&alice)),
                "incremental {incremental}: after op {i} ({op}) the old key still passes: \
                 {:#?}",
                p.ops
            );
        }
        assert!(
            !kernel.0.wg().peers.contains_key(&old_key),
            "incremental {incremental}: the old key is still a WireGuard peer when the first \
             put runs: {:#?}",
            p.ops
        );
    }
}

/// The old address leaves the state, so it goes first, like any revocation (at a full map,
/// the new entry could not be written before it); the new one is written before
/// WireGuard routes it.
#[test]
fn an_address_change_deletes_the_old_entry_then_adds_the_new() {
    let mut kernel = Kernel::default();
    let old = one(json!([{ "name": "a", "publicKey": key(1), "address": "10.8.0.2" }]));
    let new = one(json!([{ "name": "a", "publicKey": key(1), "address": "10.8.0.3" }]));
    converge(&mut kernel, &DesiredState::default(), &old);
    let change = converge(&mut kernel, &old, &new);
    assert!(
        matches!(
            change.ops.as_slice(),
            [Op::DeletePeerEntry { .. }, Op::ForgetFlows { .. }, Op::RaiseOwnerHigh { .. }, Op::PutPeerEntry { .. }, Op::WgPeer(c)] if !c.create && c.add_allowed_ips.len() == 1
        ),
        "{:#?}",
        change.ops
    );
    // WireGuard keeps the old allowed IP (there is no atomic removal of one); the map has no
    // entry for it, so packets from it are dropped. A later state plans nothing for it.
    assert!(plan(&new, &kernel.actual())
        .map(|p| p.is_empty())
        .unwrap_or(false));
}
