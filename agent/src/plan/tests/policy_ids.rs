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
    maps.policies.insert(UNRESTRICTED, Arc::new(content));
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

/// The view of the kernel holds the accepted state's own copy of each policy the kernel holds
/// as compiled (memory: a policy per peer is held once), and a later write to that id copies
/// it first: the accepted state's policy never changes under it.
#[test]
fn the_view_shares_the_states_policies_and_copies_on_write() {
    let s = one(json!([
        { "name": "a", "publicKey": key(1), "address": "10.8.0.2",
          "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443] },
                     { "cidr": "192.168.1.0/24" }] },
        { "name": "b", "publicKey": key(2), "address": "10.8.0.3",
          "egress": [{ "cidr": "172.16.0.0/12", "protocol": "udp", "ports": [53] }] },
    ]));
    let mut kernel = Kernel::default();
    converge(&mut kernel, &DesiredState::default(), &s);
    // As after a restart: every policy the view holds is a copy read back from the kernel.
    let mut actual = Actual::new(kernel.0.maps().clone(), kernel.0.wg().clone());
    let before = actual.maps().clone();
    let desired: Vec<&Arc<crate::policy::CompiledPolicy>> =
        s.peers.iter().filter_map(|p| p.policy.as_ref()).collect();
    assert_eq!(desired.len(), 2);
    let copies = actual.share(desired.iter().copied());
    assert_eq!(copies.len(), 2, "each read-back copy is handed back");
    assert_eq!(actual.maps(), &before, "sharing changes where, not what");
    for (peer, policy) in s.peers.iter().zip(&desired) {
        let id = kernel_entry(&kernel, peer.addrs().next().unwrap()).policy;
        let held = &actual.maps().policies[&id];
        assert!(Arc::ptr_eq(held, policy), "{}: not shared", peer.name);
    }
    assert!(plan(&s, &actual).map(|p| p.is_empty()).unwrap_or(false));

    // A write to a shared id (as a plan replacing that policy's entries makes) leaves the
    // state's copy as compiled.
    let id = kernel_entry(&kernel, IpAddr::from([10, 8, 0, 2])).policy;
    // A delete of an entry the policy does not have changes nothing, so copies nothing.
    actual.apply(&Op::DeletePolicyEntry {
        policy: id,
        prefix: "10.99.0.0/16".parse().unwrap(),
    });
    assert!(Arc::ptr_eq(&actual.maps().policies[&id], desired[0]));
    let compiled = desired[0].as_ref().clone();
    actual.apply(&Op::DeletePolicyEntry {
        policy: id,
        prefix: "10.0.0.0/8".parse().unwrap(),
    });
    assert_eq!(
        **desired[0], compiled,
        "the state's policy changed under the view"
    );
    assert_ne!(actual.maps().policies[&id].len(), compiled.len());
}
