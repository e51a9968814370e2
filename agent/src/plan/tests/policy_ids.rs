//! Step 4 and content addressing: policy ids found by content, the empty policy, UNRESTRICTED.

use super::*;

/// Issue 11 item 7: `"egress": []` allows nothing. Its compiled form is a restricted policy
/// id without a trie entry (never UNRESTRICTED), found again by its (empty) content like
/// any policy: shared by every such peer, and an equal state plans nothing.
#[test]
fn an_empty_egress_is_a_restricted_policy_without_entries() {
    let open = |n: u8| json!({ "name": format!("p{n}"), "publicKey": key(n), "address": format!("10.8.0.{n}") });
    let closed = |n: u8| {
        let mut p = open(n);
        p["egress"] = json!([]);
        p
    };
    let nothing = one(json!([closed(2), closed(3), open(4)]));
    let mut kernel = Kernel::default();
    let add = converge(&mut kernel, &DesiredState::default(), &nothing);
    assert!(
        !add.ops
            .iter()
            .any(|op| matches!(op, Op::PutPolicyEntry { .. })),
        "{:#?}",
        add.ops
    );
    let entry = |k: &Kernel, n: u8| kernel_entry(k, IpAddr::from([10, 8, 0, n]));
    let id = entry(&kernel, 2).policy;
    assert_ne!(id, UNRESTRICTED);
    assert_eq!(
        entry(&kernel, 3).policy,
        id,
        "equal empty rule sets share one id"
    );
    assert_eq!(entry(&kernel, 4).policy, UNRESTRICTED);
    assert!(plan(&nothing, &kernel.actual())
        .map(|p| p.is_empty())
        .unwrap_or(false));

    // Omitting egress and "egress": [] are different states, both ways, also incrementally.
    let swapped = one(json!([open(2), closed(3), closed(4)]));
    let update = plan_update(&nothing, &swapped, &kernel.actual()).unwrap();
    assert_eq!(update, plan(&swapped, &kernel.actual()).unwrap());
    assert_eq!(update.ops.len(), 2, "two switches: {:#?}", update.ops);
    for op in &update.ops {
        kernel.apply(op);
        assert_safe_midway(&kernel, &nothing, &swapped);
    }
    assert_converged(&kernel, &swapped);
    assert_eq!(entry(&kernel, 2).policy, UNRESTRICTED);
    assert_eq!(
        entry(&kernel, 4).policy,
        id,
        "the empty policy keeps its id"
    );

    // A restart reads the maps back: the id without entries is still the empty policy.
    let read = Actual::new(kernel.0.maps().clone(), kernel.0.wg().clone());
    assert!(plan(&swapped, &read).map(|p| p.is_empty()).unwrap_or(false));
}

/// Trie entries written by hand under UNRESTRICTED, equal to a restricted peer's policy:
/// the peer must not be given UNRESTRICTED (the datapath lets everything through for it,
/// without looking at those entries), and the entries are deleted.
#[test]
fn a_policy_under_the_unrestricted_id_is_never_reused() {
    let s = one(json!([
        { "name": "a", "publicKey": key(1), "address": "10.8.0.2",
          "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443] }] },
    ]));
    let content = s.peers[0].policy.as_deref().cloned().unwrap_or_default();
    let mut maps = ActualMaps::default();
    maps.policies.insert(UNRESTRICTED, content);
    let mut kernel = Kernel(Actual::new(maps, ActualWg::default()));
    let planned = plan(&s, &kernel.actual()).unwrap();
    for op in &planned.ops {
        kernel.apply(op);
    }
    let a = kernel
        .0
        .maps
        .peers
        .get(&IpAddr::from([10, 8, 0, 2]))
        .copied();
    assert!(
        a.is_some_and(|e| e.policy != UNRESTRICTED),
        "peer a entry {a:?}, plan {planned:?}"
    );
    assert!(!kernel.0.maps.policies.contains_key(&UNRESTRICTED));
    assert_converged(&kernel, &s);
}

#[test]
fn peers_with_equal_rules_share_policy_entries() {
    let rules = json!([{ "cidr": "10.0.0.0/8", "protocol": "tcp" }]);
    let s = one(json!([
        { "name": "a", "publicKey": key(1), "address": "10.8.0.2", "egress": rules },
        { "name": "b", "publicKey": key(2), "address": "10.8.0.3", "egress": rules },
    ]));
    let p = plan(&s, &Actual::default()).unwrap();
    let policy_puts = p
        .ops
        .iter()
        .filter(|o| matches!(o, Op::PutPolicyEntry { .. }))
        .count();
    assert_eq!(policy_puts, 1);
    assert!(Arc::ptr_eq(
        s.peers[0].policy.as_ref().unwrap_or(&Arc::default()),
        s.peers[1].policy.as_ref().unwrap_or(&Arc::default())
    ));
}
