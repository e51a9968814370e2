//! The holders index.

use super::*;

/// Holders are kept by tag only while no two of the device's keys share one; keys made to
/// share their first 8 bytes make the index hold whole keys (read back, or joining), and
/// every address keeps its holder.
#[test]
fn keys_that_share_their_first_bytes_are_held_whole() {
    let one = WgKey([1; 32]);
    let mut two = WgKey([1; 32]);
    two.0[31] = 2;
    let ip = |text: &str| -> IpNet { text.parse().unwrap() };
    let device = |keys: &[WgKey]| ActualWg {
        peers: keys
            .iter()
            .zip(["10.8.0.1/32", "10.8.0.2/32"])
            .map(|(key, net)| {
                let mut peer = WgPeer::default();
                peer.allowed_ips.insert(ip(net));
                (*key, peer)
            })
            .collect(),
    };
    let single = Actual::new(ActualMaps::default(), device(&[one]));
    assert!(matches!(single.index.holders, Holders::Tags(_)));
    let read = Actual::new(ActualMaps::default(), device(&[one, two]));
    assert!(matches!(read.index.holders, Holders::Keys(_)));
    let mut joined = single.clone();
    joined.apply(&Op::WgPeer(WgPeerChange {
        key: two,
        peer: "two".into(),
        create: true,
        endpoint: None,
        preshared_key: None,
        persistent_keepalive: None,
        add_allowed_ips: vec![ip("10.8.0.2/32")],
    }));
    assert!(matches!(joined.index.holders, Holders::Keys(_)));
    for actual in [&read, &joined] {
        assert_eq!(actual.holder("10.8.0.1".parse().unwrap()), Some(one));
        assert_eq!(actual.holder("10.8.0.2".parse().unwrap()), Some(two));
        assert!(actual.routes(&ip("10.8.0.2/32"), &two));
        assert!(!actual.routes(&ip("10.8.0.2/32"), &one));
    }
}
