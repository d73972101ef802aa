use std::time::{Duration, Instant};

use weft_dataplane::desired::Object;
use weft_dataplane::model::WgPeer;
use weft_types::WgKey;

use super::{GRACE, GRACE_ANSWERED, GRACE_SILENT, Paths, STALE, Seen, stay, unix_now};

fn peer_on(link: &str, endpoint: &str, tls: Option<u16>) -> Object {
    Object::WireguardPeer {
        ns: "weftp-x".into(),
        link: link.into(),
        peer: WgPeer {
            public_key: WgKey::from_bytes([7; 32]),
            endpoint: Some(endpoint.parse().unwrap()),
            allowed_ips: vec![],
            keepalive: 25,
            punch: false,
            direct: None,
        },
        tls_port: tls,
    }
}

fn peer(endpoint: &str, tls: Option<u16>) -> Object {
    peer_on("weft-wx", endpoint, tls)
}

/// The endpoint the data plane is given for the one peer.
fn endpoint(paths: &mut Paths, o: &Object) -> std::net::SocketAddr {
    let out = paths.rewrite([("p", o)].into_iter());
    match out[0].1.as_ref() {
        Object::WireguardPeer { peer, .. } => peer.endpoint.unwrap(),
        _ => unreachable!(),
    }
}

fn seen(hs: Option<u64>, answered: Option<Instant>) -> impl FnMut(&str) -> Seen {
    move |_| Seen {
        last_handshake_unix: hs,
        discovery: true,
        answered,
        silent: None,
    }
}

#[test]
fn stays_grow_with_failed_tries_and_are_bounded() {
    assert_eq!(stay(0), Duration::from_secs(10));
    assert_eq!(stay(1), Duration::from_secs(20));
    assert_eq!(stay(3), Duration::from_secs(80));
    assert_eq!(stay(40), Duration::from_secs(600));
}

#[tokio::test]
async fn a_peer_without_a_tls_port_is_left_alone() {
    let mut paths = Paths::default();
    let o = peer("192.0.2.5:51920", None);
    assert_eq!(endpoint(&mut paths, &o), "192.0.2.5:51920".parse().unwrap());
    assert!(!paths.any());
}

#[tokio::test]
async fn silent_udp_goes_over_tls_and_comes_back_when_udp_gets_out() {
    let mut paths = Paths::default();
    let o = peer("192.0.2.5:51920", Some(443));
    assert_eq!(
        endpoint(&mut paths, &o),
        "192.0.2.5:51920".parse().unwrap(),
        "UDP first"
    );
    let t0 = Instant::now();
    let u0 = unix_now();

    // Within the grace: still UDP.
    assert!(!paths.step(t0 + GRACE / 2, u0, seen(None, None)));
    // No handshake after it: TLS, through a carrier on loopback.
    assert!(paths.step(t0 + GRACE, u0 + 3, seen(None, None)));
    let e = endpoint(&mut paths, &o);
    assert!(e.ip().is_loopback(), "{e}");
    assert!(paths.over_tls("weft-wx"));

    // Discovery still unanswered: stays on TLS however long.
    let t1 = t0 + GRACE;
    assert!(!paths.step(t1 + Duration::from_secs(100), u0 + 103, seen(None, None)));
    // An answer from before the move tells nothing.
    assert!(!paths.step(t1 + Duration::from_secs(101), u0 + 104, seen(None, Some(t0))));
    // A fresh answer from outside the site: back on UDP.
    let t2 = t1 + Duration::from_secs(102);
    assert!(paths.step(t2, u0 + 105, seen(None, Some(t2))));
    assert_eq!(endpoint(&mut paths, &o), "192.0.2.5:51920".parse().unwrap());

    // UDP gets out but the handshake finds no answer: TLS again after the
    // longer grace, and the next try waits twice as long.
    assert!(!paths.step(t2 + GRACE, u0 + 108, seen(Some(u0), Some(t2 + GRACE))));
    let t3 = t2 + GRACE_ANSWERED;
    assert!(paths.step(t3, u0 + 115, seen(Some(u0), Some(t3))));
    assert!(endpoint(&mut paths, &o).ip().is_loopback());
    let a = t3 + Duration::from_secs(15);
    assert!(!paths.step(a, u0 + 130, seen(Some(u0), Some(a))), "not before 20 s");
    let b = t3 + stay(1);
    assert!(paths.step(b, u0 + 135, seen(Some(u0), Some(b))));
}

#[tokio::test]
async fn a_handshake_over_udp_keeps_it_until_it_goes_stale() {
    let mut paths = Paths::default();
    let o = peer("192.0.2.5:51920", Some(443));
    endpoint(&mut paths, &o);
    let t0 = Instant::now();
    let u0 = unix_now();
    assert!(!paths.step(t0 + Duration::from_secs(60), u0 + 60, seen(Some(u0 + 1), None)));
    // Renewed every two minutes while it works; silent past STALE: TLS.
    let late = u0 + 1 + STALE.as_secs() + 1;
    assert!(paths.step(t0 + Duration::from_secs(200), late, seen(Some(u0 + 1), None)));
    assert!(endpoint(&mut paths, &o).ip().is_loopback());
}

#[tokio::test]
async fn without_discovery_udp_is_tried_again_on_a_timer() {
    let mut paths = Paths::default();
    let o = peer("192.0.2.5:51920", Some(443));
    endpoint(&mut paths, &o);
    let t0 = Instant::now();
    let u0 = unix_now();
    let off = |_: &str| Seen {
        discovery: false,
        ..Seen::default()
    };
    assert!(paths.step(t0 + GRACE, u0 + 3, off));
    assert!(!paths.step(t0 + GRACE + stay(0) / 2, u0 + 8, off));
    assert!(
        paths.step(t0 + GRACE + stay(0), u0 + 13, off),
        "back to UDP on the timer"
    );
}

#[tokio::test]
async fn another_relay_starts_on_udp_again_and_gone_peers_are_forgotten() {
    let mut paths = Paths::default();
    let o = peer("192.0.2.5:51920", Some(443));
    endpoint(&mut paths, &o);
    let t0 = Instant::now();
    assert!(paths.step(t0 + GRACE, unix_now() + 3, seen(None, None)));
    assert!(endpoint(&mut paths, &o).ip().is_loopback());
    let moved = peer("198.51.100.9:51920", Some(443));
    assert_eq!(endpoint(&mut paths, &moved), "198.51.100.9:51920".parse().unwrap());
    paths.rewrite(std::iter::empty());
    assert!(!paths.any());
}

#[tokio::test]
async fn unanswered_probes_shorten_the_grace_and_a_blocked_front_starts_new_tunnels_on_tls() {
    let mut paths = Paths::default();
    let o = peer("192.0.2.5:51920", Some(443));
    endpoint(&mut paths, &o);
    let t0 = Instant::now();
    let u0 = unix_now();
    let silent = |t: Instant| {
        move |_: &str| Seen {
            discovery: true,
            silent: Some(t),
            ..Seen::default()
        }
    };
    // A round that went unanswered before the tunnel started tells nothing.
    assert!(!paths.step(
        t0 + Duration::from_millis(1500),
        u0,
        silent(t0 - Duration::from_secs(1))
    ));
    // One after it: TLS after a second.
    let t1 = t0 + Duration::from_millis(800);
    assert!(!paths.step(t1, u0, silent(t1)));
    assert!(paths.step(t0 + GRACE_SILENT, u0 + 1, silent(t1)));
    assert!(endpoint(&mut paths, &o).ip().is_loopback());

    // Another tunnel to the same relay host (a relayed one, its port
    // there): over TLS from the start.
    let relayed = peer_on("weft-wy", "192.0.2.5:51930", Some(443));
    let both = paths.rewrite([("p", &o), ("r", &relayed)].into_iter());
    match both[1].1.as_ref() {
        Object::WireguardPeer { peer, .. } => assert!(peer.endpoint.unwrap().ip().is_loopback()),
        _ => unreachable!(),
    }
    // Another host: UDP first.
    let other = peer("198.51.100.9:51920", Some(443));
    let mut p2 = Paths::default();
    p2.rewrite([("p", &o)].into_iter());
    assert_eq!(endpoint(&mut p2, &other), "198.51.100.9:51920".parse().unwrap());
}
