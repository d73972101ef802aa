//! A carrier and a front on loopback, as a gateway and a relay gateway
//! would run them, with plain UDP sockets as the WireGuard devices.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::UdpSocket;

use super::{Admit, Carrier, Front, Target};

async fn udp() -> UdpSocket {
    UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap()
}

async fn recv(s: &UdpSocket) -> Option<(Vec<u8>, SocketAddr)> {
    let mut b = vec![0u8; 65_536];
    match tokio::time::timeout(Duration::from_secs(5), s.recv_from(&mut b)).await {
        Ok(Ok((n, from))) => Some((b[..n].to_vec(), from)),
        _ => None,
    }
}

/// Port `port` handed on to `to`, from `from` only (empty: any).
fn admit(port: u16, to: u16, from: &[&str]) -> Admit {
    let mut a = Admit::default();
    let t = Target {
        to,
        from: from.iter().map(|s| s.parse().unwrap()).collect(),
    };
    a.ports.insert(port, t);
    a
}

fn port(s: &UdpSocket) -> u16 {
    s.local_addr().unwrap().port()
}

/// Sends until one arrives (the carrier connects in the background).
async fn until_through(from: &UdpSocket, to: SocketAddr, at: &UdpSocket, what: &[u8]) -> SocketAddr {
    for _ in 0..50 {
        from.send_to(what, to).await.unwrap();
        let mut b = vec![0u8; 2048];
        if let Ok(Ok((n, src))) = tokio::time::timeout(Duration::from_millis(100), at.recv_from(&mut b)).await {
            assert_eq!(&b[..n], what);
            return src;
        }
    }
    panic!("nothing came through");
}

#[tokio::test]
async fn datagrams_cross_both_ways_and_keep_their_boundaries() {
    let front = Front::start(0).unwrap();
    let relay_port = udp().await; // the relay's side port, or WireGuard's
    front.admit(admit(port(&relay_port), port(&relay_port), &[]));
    let wg = udp().await;
    let carrier = Carrier::start(
        (Ipv4Addr::LOCALHOST, front.bound).into(),
        port(&relay_port),
        Some(wg.local_addr().unwrap()),
    )
    .unwrap();
    let handed_from = until_through(&wg, carrier.local, &relay_port, b"first").await;
    assert!(handed_from.ip().is_loopback());
    // Sizes from 1 byte to a 65,000-byte datagram, in order.
    for n in [1usize, 148, 1420, 9000, 65_000] {
        let d: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
        wg.send_to(&d, carrier.local).await.unwrap();
        let (got, _) = recv(&relay_port).await.expect("carried");
        assert_eq!(got, d);
    }
    // Back: to the WireGuard socket.
    relay_port.send_to(b"answer", handed_from).await.unwrap();
    let (got, from) = recv(&wg).await.expect("answered");
    assert_eq!((got.as_slice(), from), (&b"answer"[..], carrier.local));
    assert!(carrier.up.load(Ordering::Relaxed));
    assert_eq!(front.counters.connections.load(Ordering::Relaxed), 1);
    // Another local program sending to the carrier is not carried.
    let other = udp().await;
    other.send_to(b"not wireguard", carrier.local).await.unwrap();
    wg.send_to(b"after", carrier.local).await.unwrap();
    assert_eq!(recv(&relay_port).await.unwrap().0, b"after");
}

#[tokio::test]
async fn the_gateways_own_tunnels_are_named_by_their_outside_port() {
    let front = Front::start(0).unwrap();
    let tunnel = udp().await;
    // A port forward 1000 ports up: peers name the outside port.
    let outside = port(&tunnel) - 1000;
    front.admit(admit(outside, port(&tunnel), &[]));
    let wg = udp().await;
    let carrier = Carrier::start(
        (Ipv4Addr::LOCALHOST, front.bound).into(),
        outside,
        Some(wg.local_addr().unwrap()),
    )
    .unwrap();
    until_through(&wg, carrier.local, &tunnel, b"to the tunnel's own port").await;
}

#[tokio::test]
async fn a_port_not_admitted_or_another_address_is_refused_and_the_carrier_knows() {
    let front = Front::start(0).unwrap();
    let target = udp().await;
    // Admitted only from an address this connection does not come from.
    front.admit(admit(port(&target), port(&target), &["192.0.2.7"]));
    let wg = udp().await;
    let carrier = Carrier::start(
        (Ipv4Addr::LOCALHOST, front.bound).into(),
        port(&target),
        Some(wg.local_addr().unwrap()),
    )
    .unwrap();
    for _ in 0..10 {
        wg.send_to(b"x", carrier.local).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut b = [0u8; 16];
    assert!(
        tokio::time::timeout(Duration::from_millis(300), target.recv_from(&mut b))
            .await
            .is_err(),
        "nothing handed on"
    );
    assert!(front.counters.refused.load(Ordering::Relaxed) >= 1);
    assert_eq!(front.counters.connections.load(Ordering::Relaxed), 0);
    assert!(!carrier.up.load(Ordering::Relaxed), "a refused carrier is not up");
    assert!(carrier.counters.refused.load(Ordering::Relaxed) >= 1);
    assert_eq!(carrier.counters.connections.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn a_connection_that_speaks_no_tls_is_dropped_and_one_address_gets_a_share() {
    let front = Front::start(0).unwrap();
    // Plain bytes, no TLS.
    let mut s = tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, front.bound))
        .await
        .unwrap();
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    let mut b = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(7), tokio::io::AsyncReadExt::read(&mut s, &mut b)).await;
    assert!(matches!(read, Ok(Ok(_)) | Ok(Err(_))), "the front closes it");
    assert!(front.counters.refused.load(Ordering::Relaxed) >= 1);
    // Connections that say nothing: one address holds at most its share.
    let before = front.counters.refused.load(Ordering::Relaxed);
    let mut held = Vec::new();
    for _ in 0..super::MAX_PER_SOURCE + 4 {
        held.push(
            tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, front.bound))
                .await
                .unwrap(),
        );
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(front.counters.refused.load(Ordering::Relaxed) >= before + 4);
}

#[tokio::test]
async fn a_reconnection_keeps_the_relays_view_and_a_withdrawn_port_ends_it() {
    let front = Front::start(0).unwrap();
    let target = udp().await;
    front.admit(admit(port(&target), port(&target), &[]));
    let wg = udp().await;
    let to = (Ipv4Addr::LOCALHOST, front.bound).into();
    let first = Carrier::start(to, port(&target), Some(wg.local_addr().unwrap())).unwrap();
    let seen = until_through(&wg, first.local, &target, b"one").await;
    // The same gateway connects again (its carrier made anew): the relay
    // sees the same address, so it need not learn the side again.
    let second = Carrier::start(to, port(&target), Some(wg.local_addr().unwrap())).unwrap();
    let again = until_through(&wg, second.local, &target, b"two").await;
    assert_eq!(seen, again);
    for _ in 0..40 {
        if !first.up.load(Ordering::Relaxed) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!first.up.load(Ordering::Relaxed), "the older connection ended");
    drop(first);
    front.admit(Admit::default());
    for _ in 0..40 {
        if !second.up.load(Ordering::Relaxed) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the connection outlived its port");
}

#[test]
fn a_relay_gateway_admits_its_running_sides_from_their_addresses_and_its_tunnels_as_peers_name_them() {
    use weft_dataplane::desired::decode::RelaySession;
    use weft_dataplane::relay::{Side, Spec};
    let side = |port, from: &[&str]| Side {
        port,
        to_keys: vec![],
        from_ips: from.iter().map(|s| s.parse().unwrap()).collect(),
    };
    let session = RelaySession {
        spec: Spec {
            a: side(51920, &["198.51.100.7"]),
            b: side(51921, &[]),
            bytes_per_second: 1,
        },
        sites: ("a".into(), "b".into()),
    };
    // Tunnels on 51820 and 51821, reached 1000 ports lower; one whose
    // named port would be out of range is left out.
    let a = super::admitted([&session].into_iter(), [51820, 51821, 10].into_iter(), -1000);
    let x: std::net::IpAddr = "203.0.113.1".parse().unwrap();
    let p: std::net::IpAddr = "198.51.100.7".parse().unwrap();
    assert_eq!(a.admits(51920, p), Some(51920));
    assert_eq!(a.admits(51920, x), None, "a side only from its addresses");
    assert_eq!(a.admits(51921, x), Some(51921));
    assert_eq!(a.admits(50820, x), Some(51820));
    assert_eq!(a.admits(50821, x), Some(51821));
    assert_eq!(a.admits(51820, x), None, "named as peers reach it");
    assert_eq!(a.ports.len(), 4);
}
