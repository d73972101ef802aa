//! A peer reached through a relay with a direct path tried beside it
//! (`Device::set_peer_beside`), on the in-memory network with a relay of
//! its own: the move to the direct path, a direct path that never answers,
//! and a peer that only punches.

use super::*;

/// A relay on `network` at `at` between `a` and `b`: what one sends it
/// goes on to the other, from the relay's address; how many it carried.
fn relay(network: &Arc<Network>, at: SocketAddr, a: SocketAddr, b: SocketAddr) -> Arc<AtomicUsize> {
    relay_counting(network, at, a, b).0
}

/// [`relay`], also counting what it carried from `b`.
fn relay_counting(
    network: &Arc<Network>,
    at: SocketAddr,
    a: SocketAddr,
    b: SocketAddr,
) -> (Arc<AtomicUsize>, Arc<AtomicUsize>) {
    use crate::Bind;
    let bind = network.bind(at, 1).unwrap();
    let carried = Arc::new(AtomicUsize::new(0));
    let from_b = Arc::new(AtomicUsize::new(0));
    let (net, n, nb) = (network.clone(), carried.clone(), from_b.clone());
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 2048];
        let mut meta = [quinn_udp::RecvMeta::default()];
        loop {
            let got = {
                let mut bufs = [std::io::IoSliceMut::new(&mut buf)];
                bind.recv(&mut bufs, &mut meta)
            };
            match got {
                Ok(1) => {
                    let to = if meta[0].addr == a { b } else { a };
                    n.fetch_add(1, Ordering::Relaxed);
                    if meta[0].addr == b {
                        nb.fetch_add(1, Ordering::Relaxed);
                    }
                    net.deliver(at, to, &buf[..meta[0].len]);
                }
                Ok(_) => {}
                // (ends with the test: its network is dropped)
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Arc::strong_count(&n) == 1 {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(_) => return,
            }
        }
    });
    (carried, from_b)
}

#[test]
fn a_relayed_peer_moves_to_the_direct_path_tried_beside_it_and_loses_nothing() {
    let network = Network::new();
    let plain = |c: &mut Config| c.offload = false;
    let a = end(&network, "a", "192.0.2.1:51820", 1, plain);
    let b = end(&network, "b", "192.0.2.2:51820", 2, plain);
    let r = addr("192.0.2.9:51920");
    let (relayed, from_b) = relay_counting(&network, r, a.addr, b.addr);
    b.device
        .set_peer_beside(a.public, r, a.addr, vec![net("10.0.1.0/24")], 0);
    a.device
        .set_peer_beside(b.public, r, b.addr, vec![net("10.0.2.0/24")], 0);
    // Through the relay at once.
    carried(&a, &b, &udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"first"));
    assert!(relayed.load(Ordering::Relaxed) > 0, "not through the relay");
    // Packets all the while: every one arrives, through the relay and
    // then directly.
    let mut sent = 0;
    let moved = eventually(WAIT, || {
        for _ in 0..10 {
            a.tun.send(&udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"stream")).unwrap();
            sent += 1;
        }
        std::thread::sleep(Duration::from_millis(20));
        let on = |e: &End, to: SocketAddr| e.device.peers()[0].endpoint == Some(to);
        (on(&a, b.addr) && on(&b, a.addr)).then_some(())
    });
    assert!(moved.is_some(), "never moved to the direct path");
    let got = b
        .tun
        .drain(Duration::from_millis(300))
        .iter()
        .filter(|p| p.ends_with(b"stream"))
        .count();
    assert_eq!(got, sent, "packets lost in the move");
    // Directly now: the relay carries nothing more.
    let before = relayed.load(Ordering::Relaxed);
    carried(&a, &b, &udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"direct"));
    carried(&b, &a, &udp4(ip("10.0.2.1"), ip("10.0.1.1"), b"back"));
    assert_eq!(relayed.load(Ordering::Relaxed), before, "still through the relay");
    // b starts over (a new session, through the relay): a stays direct,
    // and b comes back to it.
    b.device.remove_peer(&a.public);
    b.device
        .set_peer_beside(a.public, r, a.addr, vec![net("10.0.1.0/24")], 0);
    carried(&b, &a, &udp4(ip("10.0.2.1"), ip("10.0.1.1"), b"again"));
    assert_eq!(a.device.peers()[0].endpoint, Some(b.addr), "a left the direct path");
    let back = eventually(WAIT, || {
        a.tun.send(&udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"x")).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        (b.device.peers()[0].endpoint == Some(a.addr)).then_some(())
    });
    assert!(back.is_some(), "b did not come back to the direct path");
    // Configured on the direct path now (the relay let go): the same
    // session goes on, no handshake.
    std::thread::sleep(Duration::from_millis(1200));
    b.device
        .set_peer_punched(a.public, Some(a.addr), vec![net("10.0.1.0/24")], 0);
    carried(&a, &b, &udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"kept"));
    let last = b.device.peers()[0].last_handshake.unwrap();
    assert!(
        last.elapsed().unwrap() >= Duration::from_secs(1),
        "a new session: its handshake {last:?}"
    );
    // Only b let its relay go: a starts over through the relay alone (a
    // new session; its own relay not let go). b answers it there, but
    // stays on the direct path it still hears a on: what b sends goes
    // there, not through the relay, and a comes to it.
    let before = relayed.load(Ordering::Relaxed);
    a.device.remove_peer(&b.public);
    a.device.set_peer(b.public, Some(r), vec![net("10.0.2.0/24")], 0);
    carried(&a, &b, &udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"new session"));
    assert!(
        relayed.load(Ordering::Relaxed) > before,
        "a's new session did not come through the relay"
    );
    assert_eq!(b.device.peers()[0].endpoint, Some(a.addr), "b moved back to the relay");
    let b_before = from_b.load(Ordering::Relaxed);
    for _ in 0..5 {
        carried(&b, &a, &udp4(ip("10.0.2.1"), ip("10.0.1.1"), b"direct"));
    }
    assert_eq!(from_b.load(Ordering::Relaxed), b_before, "b sent through the relay");
    assert_eq!(
        a.device.peers()[0].endpoint,
        Some(b.addr),
        "a did not come to the direct path"
    );
}

#[test]
fn a_direct_path_that_never_answers_leaves_the_peer_on_its_relay() {
    let network = Network::new();
    let plain = |c: &mut Config| c.offload = false;
    let a = end(&network, "a", "192.0.2.1:51820", 1, plain);
    let b = end(&network, "b", "192.0.2.2:51820", 2, plain);
    let r = addr("192.0.2.9:51920");
    let relayed = relay(&network, r, a.addr, b.addr);
    // Each one's direct address is one nobody is at (UDP blocked between
    // the two sites).
    b.device
        .set_peer_beside(a.public, r, addr("192.0.2.71:51820"), vec![net("10.0.1.0/24")], 0);
    a.device
        .set_peer_beside(b.public, r, addr("192.0.2.72:51820"), vec![net("10.0.2.0/24")], 0);
    carried(&a, &b, &udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"first"));
    std::thread::sleep(Duration::from_millis(2500));
    carried(&b, &a, &udp4(ip("10.0.2.1"), ip("10.0.1.1"), b"still"));
    assert_eq!(a.device.peers()[0].endpoint, Some(r));
    assert_eq!(b.device.peers()[0].endpoint, Some(r));
    assert!(relayed.load(Ordering::Relaxed) > 2);
}

#[test]
fn a_peer_beside_a_relay_meets_one_that_only_punches() {
    // b dials a directly (kernel WireGuard cannot try a path beside a
    // relay); a's initiations go to b's address too, so the two meet
    // there although the relay never hears of b.
    let network = Network::new();
    let plain = |c: &mut Config| c.offload = false;
    let a = end(&network, "a", "192.0.2.1:51820", 1, plain);
    let b = end(&network, "b", "192.0.2.2:51820", 2, plain);
    let r = addr("192.0.2.9:51920");
    relay(&network, r, a.addr, b.addr);
    a.device
        .set_peer_beside(b.public, r, b.addr, vec![net("10.0.2.0/24")], 0);
    b.device
        .set_peer_punched(a.public, Some(a.addr), vec![net("10.0.1.0/24")], 0);
    carried(&a, &b, &udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"met"));
    carried(&b, &a, &udp4(ip("10.0.2.1"), ip("10.0.1.1"), b"back"));
    assert_eq!(a.device.peers()[0].endpoint, Some(b.addr));
}
