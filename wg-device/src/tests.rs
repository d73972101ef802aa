//! The device on in-memory doubles (`memory`): handshakes, both directions,
//! what the network corrupts, replays or forges, sources outside a peer's
//! allowed IPs, a peer that moves, TCP super-packets cut and joined again,
//! removed peers, and a thread that dies. No namespace, no tun, no root.
//! The same device on a real tun and socket: tests/e2e/wg_device.rs.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use defguard_boringtun::x25519::{PublicKey, StaticSecret};
use ipnet::IpNet;

use crate::memory::{self, Network, TunPeer, eventually};
use crate::packet::{GSO_TCPV4, VNET_HDR_LEN, VnetHdr, fold, sum};
use crate::{Config, Counters, Device, OnDeath};

/// Long enough for a loaded machine; the tests wait for events, never
/// for this long unless something is wrong.
const WAIT: Duration = Duration::from_secs(10);

struct End {
    device: Device,
    tun: TunPeer,
    addr: SocketAddr,
    public: [u8; 32],
}

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn key(seed: u8) -> ([u8; 32], [u8; 32]) {
    let secret = StaticSecret::from([seed; 32]);
    (secret.to_bytes(), PublicKey::from(&secret).to_bytes())
}

fn config(name: &str, private_key: [u8; 32], offload: bool) -> Config {
    Config {
        name: name.into(),
        listen_port: 51820,
        private_key,
        offload,
        rekey_after: None,
        single_thread: false,
        panic_dir: None,
        punch_ttl: 2,
        on_death: None,
    }
}

fn end(network: &Arc<Network>, name: &str, at: &str, seed: u8, tweak: impl FnOnce(&mut Config)) -> End {
    let (private, public) = key(seed);
    let mut c = config(name, private, true);
    tweak(&mut c);
    let (tun, peer) = memory::tun(c.offload).unwrap();
    let bind = network.bind(addr(at), 64).unwrap();
    End {
        device: Device::new(&c, Box::new(tun), Box::new(bind)).unwrap(),
        tun: peer,
        addr: addr(at),
        public,
    }
}

/// Two devices, each the other's peer: a at 192.0.2.1 with 10.0.1.0/24
/// behind it, b at 192.0.2.2 with 10.0.2.0/24. b learns where a is from
/// a's handshake: with both told at once, both would start one, and which
/// answer goes stale (counted as refused) would be a race.
fn pair(network: &Arc<Network>, offload: bool) -> (End, End) {
    let set = |c: &mut Config| c.offload = offload;
    let a = end(network, "a", "192.0.2.1:51820", 1, set);
    let b = end(network, "b", "192.0.2.2:51820", 2, set);
    b.device.set_peer(a.public, None, vec![net("10.0.1.0/24")], 0);
    a.device.set_peer(b.public, Some(b.addr), vec![net("10.0.2.0/24")], 0);
    (a, b)
}

/// An IPv4 UDP packet from `src` to `dst` carrying `payload`, checksums
/// right.
fn udp4(src: Ipv4Addr, dst: Ipv4Addr, payload: &[u8]) -> Vec<u8> {
    let mut p = vec![0u8; 28];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&((28 + payload.len()) as u16).to_be_bytes());
    p[8] = 64;
    p[9] = 17;
    p[12..16].copy_from_slice(&src.octets());
    p[16..20].copy_from_slice(&dst.octets());
    p[20..22].copy_from_slice(&4000u16.to_be_bytes());
    p[22..24].copy_from_slice(&5000u16.to_be_bytes());
    p[24..26].copy_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    p.extend_from_slice(payload);
    let c = !fold(sum(&p[..20], 0));
    p[10..12].copy_from_slice(&c.to_be_bytes());
    p
}

/// An IPv4 TCP packet from 10.0.1.1:1000 to 10.0.2.1:2000 with `payload`
/// at sequence `seq`, flags ACK (and PSH), checksums right.
fn tcp4(seq: u32, payload: &[u8]) -> Vec<u8> {
    let mut p = vec![0u8; 40];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&((40 + payload.len()) as u16).to_be_bytes());
    p[6] = 0x40;
    p[8] = 64;
    p[9] = 6;
    p[12..16].copy_from_slice(&[10, 0, 1, 1]);
    p[16..20].copy_from_slice(&[10, 0, 2, 1]);
    p[20..22].copy_from_slice(&1000u16.to_be_bytes());
    p[22..24].copy_from_slice(&2000u16.to_be_bytes());
    p[24..28].copy_from_slice(&seq.to_be_bytes());
    p[28..32].copy_from_slice(&7u32.to_be_bytes());
    p[32] = 5 << 4;
    p[33] = 0x18;
    p[34..36].copy_from_slice(&512u16.to_be_bytes());
    p.extend_from_slice(payload);
    let c = !fold(sum(&p[..20], 0));
    p[10..12].copy_from_slice(&c.to_be_bytes());
    let c = !fold(sum(&p[20..], tcp_pseudo(&p)));
    p[36..38].copy_from_slice(&c.to_be_bytes());
    p
}

/// The TCP pseudo-header's sum of IPv4 packet `p`.
fn tcp_pseudo(p: &[u8]) -> u64 {
    let mut ph = [0u8; 12];
    ph[..8].copy_from_slice(&p[12..20]);
    ph[9] = 6;
    ph[10..12].copy_from_slice(&((p.len() - 20) as u16).to_be_bytes());
    sum(&ph, 0)
}

fn valid_tcp4(p: &[u8]) -> bool {
    fold(sum(&p[..20], 0)) == 0xffff && fold(sum(&p[20..], tcp_pseudo(p))) == 0xffff
}

fn ip(s: &str) -> Ipv4Addr {
    s.parse().unwrap()
}

/// Sends `packet` into `from`'s tun until `to`'s tun delivers it (the
/// first ones wait for the handshake, as on a host).
fn carried(from: &End, to: &End, packet: &[u8]) {
    let got = eventually(WAIT, || {
        from.tun.send(packet).unwrap();
        to.tun.recv(Duration::from_millis(200)).filter(|p| p == packet)
    });
    assert!(
        got.is_some(),
        "{} never delivered the packet from {}",
        to.addr,
        from.addr
    );
    // what more came were copies sent before the session was up and
    // queued by the protocol: the same packet
    assert!(to.tun.drain(Duration::from_millis(100)).iter().all(|p| p == packet));
}

fn count(c: &std::sync::atomic::AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

fn rejected(c: &Counters) -> [u64; 5] {
    [
        count(&c.rx_invalid),
        count(&c.rx_unknown_peer),
        count(&c.rx_unauthenticated),
        count(&c.rx_replayed),
        count(&c.rx_bad_source),
    ]
}

#[test]
fn two_devices_shake_hands_and_carry_packets_both_ways() {
    let network = Network::new();
    let (a, b) = pair(&network, false);
    let out = udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"ping");
    let back = udp4(ip("10.0.2.1"), ip("10.0.1.1"), b"pong");
    carried(&a, &b, &out);
    carried(&b, &a, &back);
    for (d, peer) in [(&a, &b), (&b, &a)] {
        let stats = d.device.peers();
        assert_eq!(stats.len(), 1);
        assert_eq!(stats[0].public_key, peer.public);
        assert_eq!(stats[0].endpoint, Some(peer.addr));
        assert!(stats[0].last_handshake.is_some());
        assert!(stats[0].rx_bytes > 0 && stats[0].tx_bytes > 0);
        // Nothing refused on a clean network, but where both sides started
        // a handshake at once: the answer to the one a side gave up for
        // the other's is stale (boringtun: UnexpectedPacket), as with
        // kernel WireGuard.
        let [invalid, unknown, rest @ ..] = rejected(d.device.counters());
        assert!(
            invalid <= 1 && unknown <= 1 && rest == [0; 3],
            "{:?}",
            rejected(d.device.counters())
        );
    }
}

#[test]
fn what_the_network_corrupts_replays_or_forges_is_refused_and_counted() {
    let network = Network::new();
    let (a, b) = pair(&network, false);
    carried(&a, &b, &udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"first"));
    network.record();
    let packet = udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"recorded");
    carried(&a, &b, &packet);
    let data = network
        .recorded()
        .into_iter()
        .find(|d| d.from == a.addr && d.data[0] == 4 && d.data.len() > 32)
        .expect("a's data message to b");
    let c = b.device.counters();
    let before = rejected(c);
    let deliver = |bytes: &[u8]| assert!(network.deliver(a.addr, b.addr, bytes));
    // the same datagram again: a replay
    deliver(&data.data);
    // one bit flipped in the ciphertext, under a counter not seen yet (the
    // counter is checked first): fails authentication
    let mut corrupt = data.data.clone();
    corrupt[8..16].copy_from_slice(&1_000_000u64.to_le_bytes());
    *corrupt.last_mut().unwrap() ^= 1;
    deliver(&corrupt);
    // a session index b never gave out
    let mut foreign = data.data.clone();
    foreign[4..8].copy_from_slice(&0x00ab_cdefu32.to_le_bytes());
    deliver(&foreign);
    // no WireGuard message at all, and one cut short
    deliver(b"hello");
    deliver(&data.data[..20]);
    let want = [before[0] + 2, before[1] + 1, before[2] + 1, before[3] + 1, before[4]];
    assert!(
        eventually(WAIT, || (rejected(c) == want).then_some(())).is_some(),
        "counted {:?}, want {want:?} (invalid, unknown peer, unauthenticated, replayed, bad source)",
        rejected(c)
    );
    assert_eq!(b.device.counters().rx_rejected(), want.iter().sum::<u64>());
    assert!(
        b.tun.drain(Duration::from_millis(200)).is_empty(),
        "nothing refused reached the tun"
    );
    // and the tunnel still works
    carried(&a, &b, &udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"after"));
}

#[test]
fn endpoint_discovery_answers_are_neither_carried_nor_refused() {
    let network = Network::new();
    let (a, b) = pair(&network, false);
    carried(&a, &b, &udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"up"));
    let mut answer = crate::DISCOVERY_MAGIC.to_vec();
    answer.extend_from_slice(&[0; 24]);
    assert!(network.deliver(addr("198.51.100.9:3478"), b.addr, &answer));
    carried(&a, &b, &udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"after"));
    assert_eq!(rejected(b.device.counters()), [0; 5]);
}

#[test]
fn a_packet_from_outside_the_peers_allowed_ips_is_dropped() {
    let network = Network::new();
    let (a, b) = pair(&network, false);
    carried(&a, &b, &udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"up"));
    // a sends for a source b does not allow it (a's own tun takes anything
    // routed to b)
    a.tun.send(&udp4(ip("10.9.9.9"), ip("10.0.2.1"), b"spoofed")).unwrap();
    let c = b.device.counters();
    assert!(eventually(WAIT, || (count(&c.rx_bad_source) == 1).then_some(())).is_some());
    assert!(b.tun.drain(Duration::from_millis(200)).is_empty());
    // and to an address no peer is allowed: nothing leaves
    let before = count(&a.device.counters().tx_no_route);
    a.tun.send(&udp4(ip("10.0.1.1"), ip("10.7.0.1"), b"nowhere")).unwrap();
    assert!(
        eventually(WAIT, || (count(&a.device.counters().tx_no_route) == before + 1)
            .then_some(()))
        .is_some()
    );
}

#[test]
fn a_peer_behind_a_nat_whose_mapping_moves_is_followed() {
    let network = Network::new();
    let plain = |c: &mut Config| c.offload = false;
    let a = end(&network, "a", "10.10.0.2:51820", 1, plain);
    let b = end(&network, "b", "192.0.2.2:51820", 2, plain);
    network.nat(a.addr, addr("198.51.100.1:40000"));
    // a knows where b is; b does not know where a is (behind a NAT)
    a.device.set_peer(b.public, Some(b.addr), vec![net("10.0.2.0/24")], 0);
    b.device.set_peer(a.public, None, vec![net("10.0.1.0/24")], 0);
    carried(&a, &b, &udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"hi"));
    assert_eq!(b.device.peers()[0].endpoint, Some(addr("198.51.100.1:40000")));
    carried(&b, &a, &udp4(ip("10.0.2.1"), ip("10.0.1.1"), b"back"));
    // the NAT's mapping changes: b follows once a speaks from there
    network.nat(a.addr, addr("198.51.100.1:40123"));
    carried(&a, &b, &udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"moved"));
    assert_eq!(b.device.peers()[0].endpoint, Some(addr("198.51.100.1:40123")));
    carried(&b, &a, &udp4(ip("10.0.2.1"), ip("10.0.1.1"), b"back again"));
}

#[test]
fn a_tcp_super_packet_is_cut_sent_in_batches_and_joined_again() {
    let network = Network::new();
    let (a, b) = pair(&network, true);
    assert!(a.device.offloads().tso && a.device.offloads().udp_gso_segments > 1);
    let hdr = |h: VnetHdr, p: &[u8]| {
        let mut out = vec![0u8; VNET_HDR_LEN];
        h.write(&mut out);
        out.extend_from_slice(p);
        out
    };
    // the session first, with one plain packet
    let first = hdr(VnetHdr::default(), &tcp4(1, b"x"));
    let got = eventually(WAIT, || {
        a.tun.send(&first).unwrap();
        b.tun.recv(Duration::from_millis(200))
    });
    assert!(got.is_some(), "no session");
    b.tun.drain(Duration::from_millis(100));
    // 40,000 bytes in one TSO packet, as the kernel hands one over: cut
    // into 1,400-byte segments by the device
    let payload: Vec<u8> = (0..40_000u32).map(|i| (i * 7) as u8).collect();
    let mut big = tcp4(1000, &payload);
    let partial = fold(tcp_pseudo(&big));
    big[36..38].copy_from_slice(&partial.to_be_bytes());
    let tso = VnetHdr {
        flags: 1,
        gso_type: GSO_TCPV4,
        hdr_len: 40,
        gso_size: 1400,
        csum_start: 20,
        csum_offset: 16,
    };
    network.record();
    a.tun.send(&hdr(tso, &big)).unwrap();
    let mut joined = Vec::new();
    let mut packets = 0;
    while joined.len() < payload.len() {
        let Some(p) = b.tun.recv(WAIT) else { break };
        packets += 1;
        let h = VnetHdr::parse(&p).unwrap();
        let ip = &p[VNET_HDR_LEN..];
        if h.gso_type == GSO_TCPV4 {
            // a joined super-packet: its segments' size is kept
            assert_eq!(h.gso_size, 1400);
        } else {
            assert!(valid_tcp4(ip), "a single segment with a bad checksum");
        }
        let seq = u32::from_be_bytes(ip[24..28].try_into().unwrap());
        assert_eq!(seq as usize, 1000 + joined.len(), "segments in order");
        joined.extend_from_slice(&ip[40..]);
    }
    assert!(joined == payload, "the bytes arrived as sent");
    assert!(packets < 29, "{packets} packets for 29 segments: none joined");
    let datagrams = network.recorded().iter().filter(|d| d.from == a.addr).count();
    assert_eq!(datagrams, 29, "one datagram per segment");
    assert_eq!(rejected(b.device.counters()), [0; 5]);
}

#[test]
fn a_removed_peer_gets_nothing_more() {
    let network = Network::new();
    let (a, b) = pair(&network, false);
    carried(&a, &b, &udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"up"));
    a.device.remove_peer(&b.public);
    assert!(a.device.peers().is_empty());
    network.record();
    a.tun.send(&udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"gone")).unwrap();
    let c = a.device.counters();
    assert!(eventually(WAIT, || (count(&c.tx_no_route) == 1).then_some(())).is_some());
    assert!(network.recorded().is_empty(), "nothing was sent");
    // what b still sends on the old session is refused as from no peer
    b.tun.send(&udp4(ip("10.0.2.1"), ip("10.0.1.1"), b"late")).unwrap();
    assert!(eventually(WAIT, || (count(&c.rx_unknown_peer) >= 1).then_some(())).is_some());
    assert!(a.tun.drain(Duration::from_millis(200)).is_empty());
}

#[test]
fn a_device_whose_thread_panics_says_so_and_calls_its_owner() {
    let network = Network::new();
    let dir = std::env::temp_dir().join(format!("weft-wg-device-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let called = Arc::new(AtomicUsize::new(0));
    let seen = called.clone();
    let a = end(&network, "dies", "192.0.2.1:51820", 1, |c| {
        c.panic_dir = Some(dir.clone());
        c.on_death = Some(OnDeath(Arc::new(move || {
            seen.fetch_add(1, Ordering::Relaxed);
        })));
    });
    assert_eq!(a.device.died(), None);
    std::fs::write(dir.join("dies"), "").unwrap();
    let why = eventually(WAIT, || a.device.died());
    let _ = std::fs::remove_dir_all(&dir);
    assert!(why.unwrap().contains("injected"), "the reason is kept");
    assert_eq!(called.load(Ordering::Relaxed), 1);
    // dropping a dead device ends it cleanly
    drop(a);
}

#[test]
fn a_first_handshake_that_is_lost_is_sent_again_within_a_second_not_five() {
    let network = Network::new();
    let plain = |c: &mut Config| c.offload = false;
    let a = end(&network, "a", "192.0.2.1:51820", 1, plain);
    let (_, b_public) = key(2);
    // b is not on the network yet (a relay not yet told of the tunnel, a
    // NAT not yet open): a's first initiation is lost
    network.record();
    a.device
        .set_peer(b_public, Some(addr("192.0.2.2:51820")), vec![net("10.0.2.0/24")], 0);
    std::thread::sleep(Duration::from_millis(300));
    let b = end(&network, "b", "192.0.2.2:51820", 2, plain);
    b.device.set_peer(a.public, None, vec![net("10.0.1.0/24")], 0);
    let appeared = std::time::Instant::now();
    let packet = udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"late");
    carried(&a, &b, &packet);
    let took = appeared.elapsed();
    // the protocol alone retries 5 s after the first
    assert!(took < Duration::from_secs(4), "connected {took:?} after b appeared");
    let initiations = |from: SocketAddr| {
        network
            .recorded()
            .iter()
            .filter(|d| d.from == from && d.data[0] == 1)
            .count()
    };
    assert!(initiations(a.addr) >= 2, "a sent again");
    // with a session, no more eager handshakes
    let before = initiations(a.addr);
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(
        initiations(a.addr),
        before,
        "eager handshakes stop once a session is up"
    );
}

#[test]
fn a_punched_peers_first_handshakes_die_on_the_way_then_go_through_and_stop_once_heard() {
    let network = Network::new();
    // two routers between the gateways: the punch TTL (2) passes this
    // side's NAT and dies at the next
    network.hops(2);
    network.record();
    let plain = |c: &mut Config| c.offload = false;
    let a = end(&network, "a", "192.0.2.1:51820", 1, plain);
    let b = end(&network, "b", "192.0.2.2:51820", 2, plain);
    b.device.set_peer(a.public, None, vec![net("10.0.1.0/24")], 0);
    a.device
        .set_peer_punched(b.public, Some(b.addr), vec![net("10.0.2.0/24")], 0);
    carried(&a, &b, &udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"through"));
    let died = network.died();
    assert!(!died.is_empty(), "the first handshakes left with the punch TTL");
    assert!(
        died.iter().all(|d| d.from == a.addr && d.data[0] == 1),
        "only a's initiations"
    );
    assert_eq!(count(&a.device.counters().tx_primed), died.len() as u64);
    // once through, nothing more at the punch TTL, either way
    carried(&b, &a, &udp4(ip("10.0.2.1"), ip("10.0.1.1"), b"back"));
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(network.died().len(), died.len());

    // a peer set again with the same endpoint keeps its session; one that
    // speaks first (its side's NAT open) ends the priming at once
    let c = end(&network, "c", "192.0.2.3:51820", 3, plain);
    c.device
        .set_peer_punched(a.public, Some(a.addr), vec![net("10.0.1.0/24")], 0);
    a.device.set_peer(c.public, Some(c.addr), vec![net("10.0.3.0/24")], 0);
    carried(&a, &c, &udp4(ip("10.0.1.1"), ip("10.0.3.1"), b"to c"));
    let primed = count(&c.device.counters().tx_primed);
    carried(&c, &a, &udp4(ip("10.0.3.1"), ip("10.0.1.1"), b"from c"));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        count(&c.device.counters().tx_primed),
        primed,
        "c heard a: no more priming"
    );
}

#[test]
fn a_punched_peer_set_again_where_it_already_is_keeps_its_session_unprimed() {
    let network = Network::new();
    network.hops(2);
    let plain = |c: &mut Config| c.offload = false;
    let a = end(&network, "a", "192.0.2.1:51820", 1, plain);
    let b = end(&network, "b", "192.0.2.2:51820", 2, plain);
    // b learns a's address from a's handshake (roaming) ...
    b.device.set_peer(a.public, None, vec![net("10.0.1.0/24")], 0);
    a.device.set_peer(b.public, Some(b.addr), vec![net("10.0.2.0/24")], 0);
    carried(&a, &b, &udp4(ip("10.0.1.1"), ip("10.0.2.1"), b"up"));
    let handshake = b.device.peers()[0].last_handshake;
    // ... and is then told it by its controller, to be punched: nothing to
    // open, the session stays
    network.record();
    b.device
        .set_peer_punched(a.public, Some(a.addr), vec![net("10.0.1.0/24")], 0);
    carried(&b, &a, &udp4(ip("10.0.2.1"), ip("10.0.1.1"), b"still"));
    assert_eq!(count(&b.device.counters().tx_primed), 0);
    assert!(network.died().is_empty());
    // (the handshake's time is derived from its age: microseconds apart)
    let again = b.device.peers()[0].last_handshake.unwrap();
    let apart = again
        .duration_since(handshake.unwrap())
        .unwrap_or_else(|e| e.duration());
    assert!(apart < Duration::from_millis(50), "a new session: {apart:?} apart");
}

mod beside;
