//! On loopback: two boringtun tunnel ends that reach each other only
//! through the relay, as two gateways behind NAT would.

use std::net::UdpSocket;
use std::time::Duration;

use defguard_boringtun::noise::{Tunn, TunnResult};
use defguard_boringtun::x25519::{PublicKey, StaticSecret};

use super::*;

fn keypair(seed: u8) -> (StaticSecret, [u8; 32]) {
    let secret = StaticSecret::from([seed; 32]);
    let public = PublicKey::from(&secret).to_bytes();
    (secret, public)
}

fn socket() -> UdpSocket {
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    s
}

fn free_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn recv(s: &UdpSocket) -> Option<Vec<u8>> {
    let mut buf = [0u8; 2048];
    s.recv(&mut buf).ok().map(|n| buf[..n].to_vec())
}

/// A relay between two free ports; a's gateway only from `a_from`
/// (empty: anywhere), b's from anywhere.
fn relay_for(pa: [u8; 32], pb: [u8; 32], a_from: Vec<IpAddr>) -> ((u16, u16), Relay) {
    loop {
        let spec = Spec {
            a: Side {
                port: free_port(),
                to_keys: vec![pb],
                from_ips: a_from.clone(),
            },
            b: Side {
                port: free_port(),
                to_keys: vec![pa],
                from_ips: vec![],
            },
            bytes_per_second: 1 << 30,
        };
        if let Ok(r) = start(&spec) {
            return ((spec.a.port, spec.b.port), r);
        }
    }
}

/// A relay, gateways a and b (sockets and tunnel ends, each the
/// other's peer, with their public keys), and a third socket for a
/// stranger; a's gateway only from `a_from` (empty: anywhere).
struct Two {
    ports: (u16, u16),
    relay: Relay,
    ga: UdpSocket,
    gb: UdpSocket,
    x: UdpSocket,
    ta: Tunn,
    tb: Tunn,
    pa: [u8; 32],
    pb: [u8; 32],
}

fn two(a_from: Vec<IpAddr>) -> Two {
    let (sa, pa) = keypair(1);
    let (sb, pb) = keypair(2);
    let (ports, relay) = relay_for(pa, pb, a_from);
    Two {
        ports,
        relay,
        ga: socket(),
        gb: socket(),
        x: socket(),
        ta: Tunn::new(sa, PublicKey::from(pb), None, None, 0x1234, None),
        tb: Tunn::new(sb, PublicKey::from(pa), None, None, 0x5678, None),
        pa,
        pb,
    }
}

fn at(p: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, p))
}

/// The relay's port `p` as socket `s` reaches it: on the loopback
/// address of `s`'s family.
fn via(s: &UdpSocket, p: u16) -> SocketAddr {
    SocketAddr::new(s.local_addr().unwrap().ip(), p)
}

fn initiation(t: &mut Tunn) -> Vec<u8> {
    let mut buf = [0u8; 256];
    let TunnResult::WriteToNetwork(init) = t.format_handshake_initiation(&mut buf, true) else {
        panic!("no initiation")
    };
    init.to_vec()
}

const PACKET: [u8; 20] = [0x45, 0, 0, 20, 0, 0, 0, 0, 64, 17, 0, 0, 10, 0, 0, 2, 10, 0, 0, 1];

/// `from` sends a packet on its session; `to` must get it, decrypted
/// (past keepalives of the handshakes before it).
fn data_reaches(from: &mut Tunn, via: (&UdpSocket, u16), to: (&mut Tunn, &UdpSocket)) {
    let (mut buf, mut out) = ([0u8; 2048], [0u8; 2048]);
    let TunnResult::WriteToNetwork(data) = from.encapsulate(&PACKET, &mut buf) else {
        panic!("no session")
    };
    via.0.send_to(data, self::via(via.0, via.1)).unwrap();
    loop {
        let got = recv(to.1).expect("data relayed");
        match to.0.decapsulate(None, &got, &mut out) {
            TunnResult::WriteToTunnelV4(p, _) if p == PACKET => return,
            TunnResult::Done => continue,
            TunnResult::Err(e) => panic!("{e:?}"),
            _ => panic!("not the packet sent"),
        }
    }
}

/// Answers every handshake message `s` gets with what `t` makes of it,
/// sent back through `port`, until `s` is quiet; the last data packet.
fn answer_all(t: &mut Tunn, s: &UdpSocket, port: u16) {
    let mut out = [0u8; 2048];
    s.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    while let Some(got) = recv(s) {
        let mut r = t.decapsulate(None, &got, &mut out);
        while let TunnResult::WriteToNetwork(reply) = r {
            s.send_to(reply, via(s, port)).unwrap();
            r = t.decapsulate(None, &[], &mut out);
        }
    }
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
}

#[test]
fn two_gateways_are_learned_in_one_handshake_round_and_talk_through_the_relay() {
    let Two {
        ports,
        relay,
        ga,
        gb,
        x: stranger,
        mut ta,
        mut tb,
        ..
    } = two(vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]);
    let mut out = [0u8; 2048];

    // A stranger's datagram, and a handshake for another key: dropped,
    // nothing learned.
    stranger.send_to(&[4u8; 100], at(ports.0)).unwrap();
    let mut other = Tunn::new(
        StaticSecret::from([3; 32]),
        PublicKey::from([9u8; 32]),
        None,
        None,
        3,
        None,
    );
    stranger.send_to(&initiation(&mut other), at(ports.0)).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(relay.counters.learned.load(Ordering::Relaxed), 0);
    assert!(relay.counters.unknown_source.load(Ordering::Relaxed) >= 2);

    // a initiates first, while b is unknown: kept, not lost.
    ga.send_to(&initiation(&mut ta), at(ports.0)).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(relay.counters.no_peer.load(Ordering::Relaxed), 1);
    // b initiates: relayed to a's candidate; a answers, which makes b
    // learned, and a's kept initiation goes to b, whose answer makes a
    // learned: both in one round.
    gb.send_to(&initiation(&mut tb), at(ports.1)).unwrap();
    let got = recv(&ga).expect("b's initiation relayed to a");
    let TunnResult::WriteToNetwork(resp) = ta.decapsulate(None, &got, &mut out) else {
        panic!("not a response")
    };
    ga.send_to(resp, at(ports.0)).unwrap();
    answer_all(&mut tb, &gb, ports.1);
    answer_all(&mut ta, &ga, ports.0);
    assert_eq!(relay.counters.learned.load(Ordering::Relaxed), 2);

    // Data both ways, encrypted end to end: the relay only forwards.
    data_reaches(&mut tb, (&gb, ports.1), (&mut ta, &ga));
    data_reaches(&mut ta, (&ga, ports.0), (&mut tb, &gb));
    // A stranger cannot take a's place with data; runts are dropped,
    // not a crash; the stranger got nothing.
    let mut buf = [0u8; 2048];
    let TunnResult::WriteToNetwork(data) = ta.encapsulate(&PACKET, &mut buf) else {
        panic!()
    };
    stranger.send_to(data, at(ports.0)).unwrap();
    stranger.send_to(&[], at(ports.0)).unwrap();
    stranger.send_to(&[1], at(ports.1)).unwrap();
    data_reaches(&mut tb, (&gb, ports.1), (&mut ta, &ga));
    stranger.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    assert!(recv(&stranger).is_none(), "a stranger got something");
    assert_eq!(relay.counters.learned.load(Ordering::Relaxed), 2);
}

#[test]
fn forged_initiations_answered_by_cookies_and_replays_from_another_port_take_nothing() {
    // Side a from anywhere: the forger passes the address check.
    let Two {
        ports,
        relay,
        ga,
        gb,
        x,
        mut ta,
        mut tb,
        pa,
        pb,
    } = two(vec![]);
    let mut out = [0u8; 2048];

    // Learn both sides.
    ga.send_to(&initiation(&mut ta), at(ports.0)).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    gb.send_to(&initiation(&mut tb), at(ports.1)).unwrap();
    answer_all(&mut ta, &ga, ports.0);
    answer_all(&mut tb, &gb, ports.1);
    answer_all(&mut ta, &ga, ports.0);
    assert_eq!(relay.counters.learned.load(Ordering::Relaxed), 2);
    data_reaches(&mut ta, (&ga, ports.0), (&mut tb, &gb));

    // X forges initiations for b's key (mac1 needs only the public
    // key), with a's next indexes; b, under load, answers each with a
    // cookie reply that carries X's index back.
    let limiter = std::sync::Arc::new(RateLimiter::new(&PublicKey::from(pb), 0));
    let mut busy_b = Tunn::new(keypair(2).0, PublicKey::from(pa), None, None, 0x9abc, Some(limiter));
    let forger = StaticSecret::from([7; 32]);
    for i in 0..30u32 {
        let mut f = Tunn::new(forger.clone(), PublicKey::from(pb), None, None, 0x1234 + i, None);
        x.send_to(&initiation(&mut f), at(ports.0)).unwrap();
    }
    x.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    gb.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    let mut cookies = 0;
    while let Some(got) = recv(&gb) {
        let src = Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
        if let TunnResult::WriteToNetwork(cookie) = busy_b.decapsulate(src, &got, &mut out) {
            gb.send_to(cookie, at(ports.1)).unwrap();
            cookies += 1;
        }
    }
    assert!(cookies > 0, "b answered no forged initiation with a cookie");
    assert!(
        relay.counters.handshakes_limited.load(Ordering::Relaxed) > 0,
        "30 handshakes at once were all taken"
    );
    // A's replayed initiation, from another port (X behind a's NAT),
    // once the budget the flood spent is back.
    std::thread::sleep(Duration::from_millis(1100));
    let replayed = initiation(&mut ta);
    ga.send_to(&replayed, at(ports.0)).unwrap();
    x.send_to(&replayed, at(ports.0)).unwrap();
    answer_all(&mut tb, &gb, ports.1);
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        relay.counters.replayed.load(Ordering::Relaxed) >= 1,
        "the replay was taken"
    );
    assert_eq!(
        relay.counters.learned.load(Ordering::Relaxed),
        2,
        "a cookie reply or a replay made X a side"
    );
    // b's data still goes to a, none to X.
    answer_all(&mut ta, &ga, ports.0);
    data_reaches(&mut tb, (&gb, ports.1), (&mut ta, &ga));
    while let Some(got) = recv(&x) {
        assert_ne!(got.first(), Some(&4), "X got b's data");
    }
}

#[test]
fn a_replay_after_the_original_is_dropped_and_a_guessed_index_sent_first_moves_nothing() {
    let Two {
        ports,
        relay,
        ga,
        gb,
        x,
        mut ta,
        mut tb,
        pb,
        ..
    } = two(vec![]);
    // a's initiation, and X's copy of it from another port right after
    // (a host on a's LAN that sees its frames): dropped.
    let first = initiation(&mut ta);
    ga.send_to(&first, at(ports.0)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    x.send_to(&first, at(ports.0)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(relay.counters.replayed.load(Ordering::Relaxed), 1);
    // b initiates; a's response makes b learned, a's kept initiation
    // goes to b, b's answer makes a learned.
    gb.send_to(&initiation(&mut tb), at(ports.1)).unwrap();
    answer_all(&mut ta, &ga, ports.0);
    answer_all(&mut tb, &gb, ports.1);
    answer_all(&mut ta, &ga, ports.0);
    assert_eq!(relay.counters.learned.load(Ordering::Relaxed), 2);
    data_reaches(&mut tb, (&gb, ports.1), (&mut ta, &ga));

    // X guessed a's next index (indexes count up) and sends an
    // initiation of its own with it first; b answers a's, and the
    // relay cannot tell whose: a stays where it was learned.
    let next = initiation(&mut ta);
    let mut forger = Tunn::new(
        StaticSecret::from([7; 32]),
        PublicKey::from(pb),
        None,
        None,
        0x1234,
        None,
    );
    let forged = loop {
        let f = initiation(&mut forger);
        if f[4..8] == next[4..8] {
            break f;
        }
    };
    x.send_to(&forged, at(ports.0)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    ga.send_to(&next, at(ports.0)).unwrap();
    answer_all(&mut tb, &gb, ports.1);
    answer_all(&mut ta, &ga, ports.0);
    assert_eq!(relay.counters.ambiguous.load(Ordering::Relaxed), 1);
    assert_eq!(relay.counters.learned.load(Ordering::Relaxed), 2);
    data_reaches(&mut tb, (&gb, ports.1), (&mut ta, &ga));
    x.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    while let Some(got) = recv(&x) {
        assert_ne!(got.first(), Some(&4), "X got b's data");
    }
}

#[test]
fn the_rate_limit_holds_a_burst_to_an_eighth_of_a_second() {
    let mut b = Bucket {
        rate: 800_000,
        tokens: 100_000,
        at: Instant::now(),
    };
    let passed = (0..200).filter(|_| b.take(1_000)).count();
    assert!((100..=102).contains(&passed), "{passed}");
}

#[test]
fn a_session_started_again_keeps_where_its_sides_were_learned() {
    let Two {
        ports,
        relay,
        ga,
        gb,
        mut ta,
        mut tb,
        pa,
        pb,
        ..
    } = two(vec![]);
    let mut out = [0u8; 2048];
    ga.send_to(&initiation(&mut ta), at(ports.0)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    gb.send_to(&initiation(&mut tb), at(ports.1)).unwrap();
    let got = recv(&ga).expect("b's initiation relayed to a");
    let TunnResult::WriteToNetwork(resp) = ta.decapsulate(None, &got, &mut out) else {
        panic!("not a response")
    };
    ga.send_to(resp, at(ports.0)).unwrap();
    answer_all(&mut tb, &gb, ports.1);
    answer_all(&mut ta, &ga, ports.0);
    let learned = relay.learned();
    assert_eq!(
        learned,
        [Some(ga.local_addr().unwrap()), Some(gb.local_addr().unwrap())]
    );
    // The session changes (a's NAT address now known): the relay starts
    // again on the same ports, the sides still known; data flows at once,
    // with no handshake.
    drop(relay);
    let spec = |a_from: Vec<IpAddr>| Spec {
        a: Side {
            port: ports.0,
            to_keys: vec![pb],
            from_ips: a_from,
        },
        b: Side {
            port: ports.1,
            to_keys: vec![pa],
            from_ips: vec![],
        },
        bytes_per_second: 1 << 30,
    };
    let again = super::start_with(&spec(vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]), learned).unwrap();
    data_reaches(&mut ta, (&ga, ports.0), (&mut tb, &gb));
    data_reaches(&mut tb, (&gb, ports.1), (&mut ta, &ga));
    assert_eq!(
        again.counters.learned.load(Ordering::Relaxed),
        0,
        "nothing learned anew"
    );
    // A side no longer allowed at its address is forgotten (loopback is
    // always allowed: a side handed on by the gateway's TLS port).
    drop(again);
    let outside: SocketAddr = "192.0.2.9:40000".parse().unwrap();
    let known = [Some(outside), learned[1]];
    let narrowed = super::start_with(&spec(vec![IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7))]), known).unwrap();
    assert_eq!(narrowed.learned(), [None, learned[1]]);
    drop(narrowed);
    let kept = super::start_with(&spec(vec![IpAddr::V4(Ipv4Addr::new(192, 0, 2, 9))]), known).unwrap();
    assert_eq!(kept.learned(), known);
}

#[test]
fn a_relay_carries_a_tunnel_between_an_ipv4_side_and_an_ipv6_side() {
    let Ok(gb) = UdpSocket::bind("[::1]:0") else {
        println!("NOT RUN: no IPv6 loopback here");
        return;
    };
    gb.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let Two {
        ports,
        relay,
        ga,
        mut ta,
        mut tb,
        ..
    } = two(vec![]);
    let mut out = [0u8; 2048];
    // a over IPv4, b over IPv6, each to its own port of the relay.
    ga.send_to(&initiation(&mut ta), via(&ga, ports.0)).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    gb.send_to(&initiation(&mut tb), via(&gb, ports.1)).unwrap();
    let got = recv(&ga).expect("b's initiation relayed to a, over IPv4");
    let TunnResult::WriteToNetwork(resp) = ta.decapsulate(None, &got, &mut out) else {
        panic!("not a response")
    };
    ga.send_to(resp, via(&ga, ports.0)).unwrap();
    answer_all(&mut tb, &gb, ports.1);
    answer_all(&mut ta, &ga, ports.0);
    assert_eq!(relay.counters.learned.load(Ordering::Relaxed), 2);
    let learned = relay.learned();
    assert_eq!(
        learned,
        [Some(ga.local_addr().unwrap()), Some(gb.local_addr().unwrap())]
    );
    data_reaches(&mut tb, (&gb, ports.1), (&mut ta, &ga));
    data_reaches(&mut ta, (&ga, ports.0), (&mut tb, &gb));
}

#[test]
fn a_side_is_admitted_only_from_its_addresses_in_either_family() {
    let e = |from: Vec<IpAddr>| {
        end(&Side {
            port: 0,
            to_keys: vec![[7; 32]],
            from_ips: from,
        })
        .unwrap()
    };
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    let v6 = e(vec![ip("2001:db8::7"), ip("198.51.100.7")]);
    assert!(v6.may_send_from(ip("2001:db8::7")));
    assert!(v6.may_send_from(ip("198.51.100.7")));
    assert!(
        v6.may_send_from(ip("::ffff:198.51.100.7")),
        "IPv4 as a socket for both sees it"
    );
    assert!(!v6.may_send_from(ip("2001:db8::8")));
    assert!(!v6.may_send_from(ip("198.51.100.8")));
    // Loopback: handed on by the gateway's TLS port.
    assert!(v6.may_send_from(ip("127.0.0.1")));
    assert!(e(vec![]).may_send_from(ip("2001:db8::9")), "none known: any");
}
