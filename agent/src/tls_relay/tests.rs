//! A carrier and a front on loopback, as a gateway and a relay gateway
//! would run them, with plain UDP sockets as the WireGuard devices.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::UdpSocket;

use super::{Admit, Carrier, Front};

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

fn admit(port: u16, from: &[&str]) -> Admit {
    let mut a = Admit::default();
    a.ports.insert(port, from.iter().map(|s| s.parse().unwrap()).collect());
    a
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
    front.admit(admit(relay_port.local_addr().unwrap().port(), &[]));
    let carrier = Carrier::start(
        (Ipv4Addr::LOCALHOST, front.bound).into(),
        relay_port.local_addr().unwrap().port(),
    )
    .unwrap();
    let wg = udp().await;
    let handed_from = until_through(&wg, carrier.local, &relay_port, b"first").await;
    assert!(handed_from.ip().is_loopback());
    // Sizes from 1 byte to a 65,535-byte datagram, in order.
    for n in [1usize, 148, 1420, 9000, 65_000] {
        let d: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
        wg.send_to(&d, carrier.local).await.unwrap();
        let (got, _) = recv(&relay_port).await.expect("carried");
        assert_eq!(got, d);
    }
    // Back: to the address the WireGuard device sent from.
    relay_port.send_to(b"answer", handed_from).await.unwrap();
    let (got, from) = recv(&wg).await.expect("answered");
    assert_eq!((got.as_slice(), from), (&b"answer"[..], carrier.local));
    assert!(carrier.up.load(Ordering::Relaxed));
    assert_eq!(front.counters.connections.load(Ordering::Relaxed), 1);
}

#[tokio::test]
async fn a_port_not_admitted_or_another_address_is_refused() {
    let front = Front::start(0).unwrap();
    let target = udp().await;
    let port = target.local_addr().unwrap().port();
    // Admitted only from an address this connection does not come from.
    front.admit(admit(port, &["192.0.2.7"]));
    let carrier = Carrier::start((Ipv4Addr::LOCALHOST, front.bound).into(), port).unwrap();
    let wg = udp().await;
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
}

#[tokio::test]
async fn a_connection_that_says_nothing_or_speaks_no_tls_is_dropped() {
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
}

#[tokio::test]
async fn a_port_withdrawn_ends_its_connection() {
    let front = Front::start(0).unwrap();
    let target = udp().await;
    let port = target.local_addr().unwrap().port();
    front.admit(admit(port, &[]));
    let carrier = Carrier::start((Ipv4Addr::LOCALHOST, front.bound).into(), port).unwrap();
    let wg = udp().await;
    until_through(&wg, carrier.local, &target, b"on").await;
    front.admit(Admit::default());
    for _ in 0..40 {
        if !carrier.up.load(Ordering::Relaxed) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the connection outlived its port");
}
