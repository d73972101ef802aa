//! The network to the tun: datagrams received in batches, checked and
//! decrypted, consecutive TCP segments joined again, written to the tun;
//! and, on the same thread, the protocol's timers.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use defguard_boringtun::noise::errors::WireGuardError;
use defguard_boringtun::noise::handshake::parse_handshake_anon;
use defguard_boringtun::noise::{Packet, TunnResult};
use quinn_udp::RecvMeta;

use crate::packet::Coalescer;
use crate::peers::Peer;
use crate::send::send;
use crate::shared::{Shared, injected_panic, wait_writable};
use crate::{DISCOVERY_MAGIC, MAX_DATAGRAM, SLOT, TICK_MS, TIMER_EVERY};

/// The network to the tun: receive in batches, decrypt, join, write; and
/// the protocol's timers.
pub(crate) struct In {
    storage: Vec<u8>,
    meta: Vec<RecvMeta>,
    plain: Vec<u8>,
    reply: Vec<u8>,
    coalescer: Coalescer,
    timers_at: Instant,
    limiter_at: Instant,
}

impl In {
    pub(crate) fn new(s: &Shared) -> In {
        let slots = quinn_udp::BATCH_SIZE;
        In {
            storage: vec![0u8; slots * SLOT],
            meta: vec![RecvMeta::default(); slots],
            plain: vec![0u8; MAX_DATAGRAM],
            reply: vec![0u8; MAX_DATAGRAM],
            coalescer: Coalescer::new(s.vnet_hdr),
            timers_at: Instant::now(),
            limiter_at: Instant::now(),
        }
    }

    /// The protocol's timers, when due.
    pub(crate) fn tick(&mut self, s: &Shared) {
        if self.timers_at.elapsed() >= TIMER_EVERY {
            self.timers_at = Instant::now();
            injected_panic(s);
            crate::timers::run(s, &mut self.reply);
            if self.limiter_at.elapsed() >= Duration::from_secs(1) {
                self.limiter_at = Instant::now();
                s.limiter.reset_count();
            }
        }
    }

    /// One batch from the socket, to the tun; false when it had nothing.
    pub(crate) fn step(&mut self, s: &Shared) -> bool {
        let mut bufs: Vec<std::io::IoSliceMut> = self.storage.chunks_mut(SLOT).map(std::io::IoSliceMut::new).collect();
        let n = match s.bind.recv(&mut bufs, &mut self.meta) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(e) => {
                tracing::debug!(error = %e, "udp receive");
                std::thread::sleep(Duration::from_millis(10));
                return false;
            }
        };
        let mut write = |p: &[u8]| {
            let mut r = s.tun.write(p);
            if matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock) {
                wait_writable(&*s.tun, TICK_MS);
                r = s.tun.write(p);
            }
            if let Err(e) = r {
                tracing::debug!(error = %e, "tun write");
                s.counters.rx_write_failed.fetch_add(1, Ordering::Relaxed);
            }
        };
        for (m, buf) in self.meta.iter().zip(bufs.iter()).take(n) {
            let stride = m.stride.max(1);
            for d in buf[..m.len].chunks(stride) {
                receive(
                    s,
                    d,
                    m.addr,
                    &mut self.plain,
                    &mut self.reply,
                    &mut self.coalescer,
                    &mut write,
                );
            }
        }
        self.coalescer.flush(&mut write);
        true
    }
}

/// One datagram from `from`.
fn receive(
    s: &Shared,
    d: &[u8],
    from: SocketAddr,
    plain: &mut [u8],
    reply: &mut [u8],
    coalescer: &mut Coalescer,
    write: &mut impl FnMut(&[u8]),
) {
    let c = &s.counters;
    let count = |x: &AtomicU64| {
        x.fetch_add(1, Ordering::Relaxed);
    };
    if d.starts_with(DISCOVERY_MAGIC) {
        // an endpoint-discovery answer: the gateway's raw socket reads its
        // copy; not WireGuard's, and not refused either
        return;
    }
    let packet = match s.limiter.verify_packet(Some(from.ip()), d, reply) {
        Ok(p) => p,
        Err(TunnResult::WriteToNetwork(cookie)) => {
            let n = cookie.len();
            send(s, from, &reply[..n], n);
            return;
        }
        Err(_) => return count(&c.rx_invalid),
    };
    let peer = {
        let peers = s.peers();
        match packet {
            Packet::HandshakeInit(h) => parse_handshake_anon(&s.secret, &s.public, &h)
                .ok()
                .and_then(|half| peers.by_key.get(&half.peer_static_public).cloned()),
            Packet::HandshakeResponse(p) => peers.by_index.get(&(p.receiver_idx >> 8)).cloned(),
            Packet::PacketCookieReply(p) => peers.by_index.get(&(p.receiver_idx >> 8)).cloned(),
            Packet::PacketData(p) => peers.by_index.get(&(p.receiver_idx >> 8)).cloned(),
        }
    };
    let Some(peer) = peer else {
        return count(&c.rx_unknown_peer);
    };
    // the message's type: 1, 2 handshake, 3 cookie reply, 4 data
    let kind = d[0];
    let mut t = peer.tunn();
    let result = t.decapsulate(Some(from.ip()), d, plain);
    // Heard from the peer (a cookie reply proves nothing): its NAT is
    // open, so what goes to it leaves at the full TTL from now, before the
    // other thread can use a session this message just made.
    let heard = match &result {
        TunnResult::WriteToNetwork(p) => p.first() != Some(&3),
        TunnResult::Done => kind == 4,
        TunnResult::Err(_) => false,
        _ => true,
    };
    if heard {
        peer.heard();
    }
    let authentic = match result {
        TunnResult::WriteToNetwork(p) => {
            // a handshake answered (or a session's first keepalive); then
            // what waited for the session
            let n = p.len();
            let cookie = p.first() == Some(&3);
            send(s, from, &plain[..n], n);
            while let TunnResult::WriteToNetwork(p) = t.decapsulate(None, &[], reply) {
                let n = p.len();
                send(s, from, &reply[..n], n);
            }
            drop(t);
            // a cookie asked for proves nothing of the sender
            !cookie
        }
        TunnResult::WriteToTunnelV4(p, src) => {
            let n = p.len();
            drop(t);
            deliver(s, &peer, &plain[..n], IpAddr::V4(src), coalescer, write)
        }
        TunnResult::WriteToTunnelV6(p, src) => {
            let n = p.len();
            drop(t);
            deliver(s, &peer, &plain[..n], IpAddr::V6(src), coalescer, write)
        }
        // a keepalive; a cookie reply (which anyone who saw our mac1 can
        // forge) says nothing of where the peer is, as kernel WireGuard
        TunnResult::Done => kind == 4,
        TunnResult::Err(e) => {
            count(match e {
                WireGuardError::InvalidAeadTag | WireGuardError::InvalidMac => &c.rx_unauthenticated,
                WireGuardError::DuplicateCounter | WireGuardError::InvalidCounter => &c.rx_replayed,
                WireGuardError::WrongIndex | WireGuardError::NoCurrentSession => &c.rx_unknown_peer,
                _ => &c.rx_invalid,
            });
            false
        }
    };
    // Roaming: the peer is where its last authenticated data or handshake
    // came from.
    if authentic {
        peer.authenticated_from(from);
    }
}

/// A decrypted packet from `peer` to the tun, if its source is one the peer
/// may send from: the peer the device would send to that address, by the
/// most specific of all peers' allowed IPs (as kernel WireGuard: a peer
/// allowed 10.0.0.0/8 may not speak for 10.1.0.0/16 when another peer is
/// allowed that).
fn deliver(
    s: &Shared,
    peer: &Arc<Peer>,
    p: &[u8],
    src: IpAddr,
    coalescer: &mut Coalescer,
    write: &mut impl FnMut(&[u8]),
) -> bool {
    if !s.peers().route(src).is_some_and(|owner| Arc::ptr_eq(&owner, peer)) {
        s.counters.rx_bad_source.fetch_add(1, Ordering::Relaxed);
        return false;
    }
    coalescer.push(p, write);
    true
}
