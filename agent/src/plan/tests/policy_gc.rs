//! Steps 3 and 8: unreferenced trie entries are deleted, in the lead when a full trie needs the room.

use super::*;

#[test]
fn a_policy_change_writes_new_entries_switches_once_and_deletes_the_old() {
    let mut kernel = Kernel::default();
    let v1 = one(
        json!([{ "name": "a", "publicKey": key(1), "address": "10.8.0.2",
        "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443] }] }]),
    );
    let v2 = one(
        json!([{ "name": "a", "publicKey": key(1), "address": "10.8.0.2",
        "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [80] }] }]),
    );
    converge(&mut kernel, &DesiredState::default(), &v1);
    let change = converge(&mut kernel, &v1, &v2);
    assert!(
        matches!(
            change.ops.as_slice(),
            [
                Op::PutPolicyEntry { policy: 2, .. },
                // Policy 1 still holds rule counter 0 until the switch.
                Op::ResetRuleCounters { base: 1, len: 1 },
                Op::PutPeerEntry {
                    entry: PeerEntry {
                        policy: 2,
                        slot: 0,
                        rules: 1,
                        ..
                    },
                    ..
                },
                Op::DeletePolicyEntry { policy: 1, .. }
            ]
        ),
        "{:#?}",
        change.ops
    );
}

/// Review of issue 11, finding 2: at a full policy trie, "revoke z + add n with a new
/// policy" is a valid state (it needs no more entries than the trie holds), so it must
/// converge: z's policy entries, which nothing references once z's entry is deleted, go
/// in the lead, before n's policy is written; so do the leftovers of a failed put.
#[test]
fn a_full_trie_makes_room_before_the_puts() {
    let before = one(json!([
        { "name": "u", "publicKey": key(1), "address": "10.8.0.2" },
        { "name": "z", "publicKey": key(2), "address": "10.8.0.3",
          "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp" }, { "cidr": "10.1.0.0/16", "protocol": "udp" }] },
    ]));
    let after = one(json!([
        { "name": "n", "publicKey": key(3), "address": "10.8.0.4",
          "egress": [{ "cidr": "192.0.2.0/24", "protocol": "udp" }, { "cidr": "198.51.100.0/24", "protocol": "tcp" }] },
        { "name": "u", "publicKey": key(1), "address": "10.8.0.2" },
    ]));
    for incremental in [false, true] {
        let mut kernel = Kernel::default();
        converge(&mut kernel, &DesiredState::default(), &before);
        // The trie is full: it holds z's two entries and no more.
        let capacity = 2;
        let first = plan_either(incremental, &before, &after, &kernel).unwrap();
        let gc = lead(&first.ops)
            .iter()
            .filter(|op| matches!(op, Op::DeletePolicyEntry { .. }))
            .count();
        assert_eq!(
            gc, 2,
            "incremental {incremental}: z's policy entries are not deleted in the lead: \
             {:#?}",
            first.ops
        );
        // A retry is a full plan from the kernel as it is; a few must get there.
        let mut ops = first.ops;
        let mut converged = false;
        for _ in 0..3 {
            if apply_at_capacity(&mut kernel, &ops, capacity) {
                converged = true;
                break;
            }
            ops = plan(&after, &kernel.actual()).unwrap().ops;
        }
        assert!(converged, "incremental {incremental}: the trie stays full");
        assert_converged(&kernel, &after);
    }

    // The leftovers of a put that failed halfway (n's first entry, its id unreferenced)
    // go before the retry writes n's policy again.
    let mut kernel = Kernel::default();
    converge(&mut kernel, &DesiredState::default(), &before);
    let ops = plan(&after, &kernel.actual()).unwrap().ops;
    let first_put = ops
        .iter()
        .position(|op| matches!(op, Op::PutPolicyEntry { .. }))
        .unwrap_or(ops.len());
    for op in &ops[..=first_put.min(ops.len() - 1)] {
        kernel.apply(op);
    }
    let retry = plan(&after, &kernel.actual()).unwrap();
    assert!(
        lead(&retry.ops)
            .iter()
            .any(|op| matches!(op, Op::DeletePolicyEntry { .. })),
        "the leftover is not collected in the lead: {:#?}",
        retry.ops
    );
    assert!(apply_at_capacity(&mut kernel, &retry.ops, 2));
    assert_converged(&kernel, &after);
}

/// A rule that compiles to no entry (everything it allows an earlier rule allows) counts
/// nothing: its policy's rule counter block ends before it. Placed as long as the rules, the
/// block's tail was free again once written (the index reads a block's length from the
/// entries), and at a full counter space a later plan placed a policy in it: a restart with
/// 40,000 distinct policies at 60k peers wrote 7 blocks and 9 peer entries for an unchanged
/// state.
#[test]
fn a_rule_block_is_as_long_as_the_rules_its_entries_count() {
    let state = one(json!([
        { "name": "a", "publicKey": key(1), "address": "10.8.0.2",
          "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443] },
                     { "cidr": "10.1.0.0/16", "protocol": "tcp", "ports": [443] }] },
        { "name": "b", "publicKey": key(2), "address": "10.8.0.3",
          "egress": [{ "cidr": "192.0.2.0/24", "protocol": "udp" }] },
    ]));
    let mut kernel = Kernel::default();
    let plan = converge(&mut kernel, &DesiredState::default(), &state);
    let blocks: Vec<(u32, u32)> = plan
        .ops
        .iter()
        .filter_map(|op| match op {
            Op::ResetRuleCounters { base, len } => Some((*base, *len)),
            _ => None,
        })
        .collect();
    // a's second rule counts nothing: one counter each, back to back.
    assert_eq!(blocks, vec![(0, 1), (1, 1)], "{:#?}", plan.ops);
    let b: IpAddr = "10.8.0.3".parse().expect("an address");
    assert_eq!(kernel_entry(&kernel, b).rules, 1);
}
