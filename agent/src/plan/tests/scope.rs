//! Incremental plans look only at what changed.

use super::*;

#[test]
fn an_incremental_plan_touches_only_the_changed_peer() {
    let peers: Vec<Value> = (0..200u8)
        .map(|i| {
            json!({ "name": format!("p{i:03}"), "publicKey": key(i), "address": format!("10.8.{}.{}", i / 100, i % 100 + 2),
                    "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [u16::from(i % 4) + 1] }] })
        })
        .collect();
    let before = one(Value::Array(peers.clone()));
    let mut kernel = Kernel::default();
    converge(&mut kernel, &DesiredState::default(), &before);
    let mut changed = peers;
    changed[7]["egress"] = json!([{ "cidr": "10.0.0.0/8", "protocol": "udp" }]);
    let after = one(Value::Array(changed));
    let update = plan_update(&before, &after, &kernel.actual()).unwrap();
    // The new policy's entry, its rule counters zeroed, and one switch; the old policy is
    // still used by 49 peers.
    assert_eq!(update.ops.len(), 3, "{:#?}", update.ops);
    assert_eq!(update, plan(&after, &kernel.actual()).unwrap());
    // The same from the change set alone, without comparing the states.
    let changes = Changes {
        touched: vec![&after.peers[7]],
        gone: vec![&before.peers[7]],
    };
    assert_eq!(
        Ok(update),
        plan_changes(&after, changes, &kernel.actual()).map_err(|u| u.error)
    );
}
