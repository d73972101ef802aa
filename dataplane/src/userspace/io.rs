//! The device's two threads: the tun to the network (`outbound`) and the
//! network to the tun (`inbound`, with the protocol's timers).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use defguard_boringtun::noise::errors::WireGuardError;
use defguard_boringtun::noise::handshake::parse_handshake_anon;
use defguard_boringtun::noise::{Packet, Tunn, TunnResult};
use quinn_udp::RecvMeta;

use super::packet::{self, Coalescer, MAX_PACKET, VNET_HDR_LEN, VnetHdr};
use super::{DISCOVERY_MAGIC, MAX_DATAGRAM, MAX_SEND, Peer, SLOT, Shared, TICK_MS, TIMER_EVERY};

/// Encrypted datagrams waiting to leave, one after another in one buffer,
/// in runs: a run is for one destination, its datagrams all of one size
/// but the last, which may be shorter, and leaves in one segmented send.
/// Filled while the peer's session is locked, sent after it is released
/// (a send can wait on a full socket buffer, and the other thread needs
/// the session meanwhile).
struct Batch {
    buf: Vec<u8>,
    len: usize,
    /// Runs complete, to be sent.
    closed: Vec<Run>,
    /// The run that the next datagram may join.
    open: Option<Run>,
}

#[derive(Clone, Copy)]
struct Run {
    start: usize,
    len: usize,
    stride: usize,
    count: usize,
    to: SocketAddr,
    /// The last datagram was shorter than the stride: nothing joins after.
    short: bool,
}

impl Batch {
    fn new() -> Batch {
        Batch {
            // a super-packet's datagrams (two runs) and the largest one more
            buf: vec![0; 2 * MAX_SEND + MAX_DATAGRAM],
            len: 0,
            closed: Vec::new(),
            open: None,
        }
    }

    /// Whether the largest datagram still fits.
    fn has_room(&self) -> bool {
        self.len + MAX_DATAGRAM <= self.buf.len()
    }

    /// Where the next datagram is written (see [`Batch::has_room`]).
    fn room(&mut self) -> &mut [u8] {
        &mut self.buf[self.len..]
    }

    /// Takes the `n` bytes just written at `room()` as a datagram to `to`.
    fn commit(&mut self, s: &Shared, n: usize, to: SocketAddr) {
        let start = self.len;
        self.len += n;
        if let Some(r) = &mut self.open
            && r.to == to
            && n <= r.stride
            && !r.short
            && r.count < s.gso_segments()
            && r.len + n <= MAX_SEND
        {
            r.len += n;
            r.count += 1;
            r.short = n < r.stride;
            return;
        }
        self.closed.extend(self.open.take());
        self.open = Some(Run {
            start,
            len: n,
            stride: n,
            count: 1,
            to,
            short: false,
        });
    }

    /// Sends the complete runs; the open one moves to the front.
    fn send_closed(&mut self, s: &Shared) {
        if self.closed.is_empty() {
            return;
        }
        for r in self.closed.drain(..) {
            send(s, r.to, &self.buf[r.start..r.start + r.len], r.stride);
        }
        match &mut self.open {
            Some(r) => {
                self.buf.copy_within(r.start..r.start + r.len, 0);
                r.start = 0;
                self.len = r.len;
            }
            None => self.len = 0,
        }
    }

    /// Sends everything.
    fn flush(&mut self, s: &Shared) {
        self.closed.extend(self.open.take());
        self.send_closed(s);
    }
}

/// Sends `data` (datagrams of `stride` bytes) to `to`, counting what the
/// socket refused.
pub(super) fn send(s: &Shared, to: SocketAddr, data: &[u8], stride: usize) {
    let to = crate::udp::mapped(to, s.dual);
    if !crate::relay::send_datagrams(&s.socket, &s.udp, to, None, data, stride) {
        s.counters
            .tx_send_failed
            .fetch_add(data.len().div_ceil(stride.max(1)) as u64, Ordering::Relaxed);
    }
}

/// Reads before a step yields (to the other direction, when one thread
/// runs both).
const READS_PER_STEP: usize = 16;

/// The tun to the network: read, cut, encrypt, send in batches.
pub(super) struct Out {
    hdr: usize,
    rd: Vec<u8>,
    plain: Vec<u8>,
    segs: Vec<(usize, usize)>,
    batch: Batch,
}

impl Out {
    pub(super) fn new(s: &Shared) -> Out {
        let hdr = if s.tun.offloads.vnet_hdr { VNET_HDR_LEN } else { 0 };
        Out {
            hdr,
            rd: vec![0u8; hdr + MAX_PACKET],
            plain: Vec::with_capacity(2 * MAX_PACKET),
            segs: Vec::new(),
            batch: Batch::new(),
        }
    }

    /// Reads what the tun has (up to [`READS_PER_STEP`] packets) and sends
    /// it; false when the tun had nothing (what was batched is sent).
    pub(super) fn step(&mut self, s: &Shared) -> bool {
        for _ in 0..READS_PER_STEP {
            match s.tun.read(&mut self.rd) {
                Ok(n) => self.packet(s, n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    self.batch.flush(s);
                    return false;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "tun read");
                    s.counters.tx_malformed.fetch_add(1, Ordering::Relaxed);
                    self.batch.flush(s);
                    std::thread::sleep(Duration::from_millis(10));
                    return false;
                }
            }
        }
        true
    }

    /// The packet of `n` bytes just read.
    fn packet(&mut self, s: &Shared, n: usize) {
        let (hdr, plain, segs) = (self.hdr, &mut self.plain, &mut self.segs);
        plain.clear();
        segs.clear();
        if hdr > 0 {
            let rd = &self.rd;
            let cut = VnetHdr::parse(&rd[..n])
                .ok_or(packet::Bad::Header)
                .and_then(|h| packet::segment(&h, &rd[hdr..n], plain, segs));
            if cut.is_err() {
                s.counters.tx_malformed.fetch_add(1, Ordering::Relaxed);
                return;
            }
        } else {
            plain.extend_from_slice(&self.rd[..n]);
            segs.push((0, n));
        }
        let Some(&(first, _)) = segs.first() else { return };
        let peer = Tunn::dst_address(&plain[first..]).and_then(|d| s.peers().route(d));
        let Some(peer) = peer else {
            s.counters.tx_no_route.fetch_add(segs.len() as u64, Ordering::Relaxed);
            return;
        };
        let to = peer.endpoint();
        let mut t = peer.tunn();
        for &(at, len) in segs.iter() {
            if !self.batch.has_room() {
                // (a super-packet cut very fine: send with the session
                // released, then go on)
                drop(t);
                self.batch.flush(s);
                t = peer.tunn();
            }
            match t.encapsulate(&plain[at..at + len], self.batch.room()) {
                TunnResult::WriteToNetwork(p) => {
                    let n = p.len();
                    match to {
                        Some(to) => self.batch.commit(s, n, to),
                        None => {
                            s.counters.tx_no_route.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                TunnResult::Err(e) => {
                    tracing::debug!(error = ?e, "encapsulate");
                    s.counters.tx_malformed.fetch_add(1, Ordering::Relaxed);
                }
                _ => {}
            }
        }
        drop(t);
        self.batch.send_closed(s);
    }
}

/// The network to the tun: receive in batches, decrypt, join, write; and
/// the protocol's timers.
pub(super) struct In {
    storage: Vec<u8>,
    meta: Vec<RecvMeta>,
    plain: Vec<u8>,
    reply: Vec<u8>,
    coalescer: Coalescer,
    timers_at: Instant,
    limiter_at: Instant,
}

impl In {
    pub(super) fn new(s: &Shared) -> In {
        let slots = quinn_udp::BATCH_SIZE;
        In {
            storage: vec![0u8; slots * SLOT],
            meta: vec![RecvMeta::default(); slots],
            plain: vec![0u8; MAX_DATAGRAM],
            reply: vec![0u8; MAX_DATAGRAM],
            coalescer: Coalescer::new(s.tun.offloads.vnet_hdr),
            timers_at: Instant::now(),
            limiter_at: Instant::now(),
        }
    }

    /// The protocol's timers, when due.
    pub(super) fn tick(&mut self, s: &Shared) {
        if self.timers_at.elapsed() >= TIMER_EVERY {
            self.timers_at = Instant::now();
            super::injected_panic(s);
            timers(s, &mut self.reply);
            if self.limiter_at.elapsed() >= Duration::from_secs(1) {
                self.limiter_at = Instant::now();
                s.limiter.reset_count();
            }
        }
    }

    /// One batch from the socket, to the tun; false when it had nothing.
    pub(super) fn step(&mut self, s: &Shared) -> bool {
        let mut bufs: Vec<std::io::IoSliceMut> = self.storage.chunks_mut(SLOT).map(std::io::IoSliceMut::new).collect();
        let n = match s.udp.recv((&s.socket).into(), &mut bufs, &mut self.meta) {
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
                s.tun.wait_writable(TICK_MS);
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
                    crate::udp::canonical(m.addr),
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

/// Waits until the tun (`tun`) or the socket (`udp`) has something, or
/// [`TICK_MS`] pass.
fn wait(s: &Shared, tun: bool, udp: bool) {
    use std::os::fd::AsFd;
    let mut fds = Vec::with_capacity(2);
    if tun {
        fds.push(nix::poll::PollFd::new(s.tun.as_fd(), nix::poll::PollFlags::POLLIN));
    }
    if udp {
        fds.push(nix::poll::PollFd::new(s.socket.as_fd(), nix::poll::PollFlags::POLLIN));
    }
    let _ = nix::poll::poll(&mut fds, TICK_MS);
}

/// The `out` thread.
pub(super) fn outbound(s: &Shared) {
    let mut out = Out::new(s);
    while !s.stop.load(Ordering::Relaxed) {
        if !out.step(s) {
            wait(s, true, false);
        }
    }
}

/// The `in` thread.
pub(super) fn inbound(s: &Shared) {
    let mut inb = In::new(s);
    while !s.stop.load(Ordering::Relaxed) {
        inb.tick(s);
        if !inb.step(s) {
            wait(s, false, true);
        }
    }
}

/// Both directions on one thread (`Config::single_thread`).
pub(super) fn both(s: &Shared) {
    let (mut out, mut inb) = (Out::new(s), In::new(s));
    while !s.stop.load(Ordering::Relaxed) {
        inb.tick(s);
        let sent = out.step(s);
        let received = inb.step(s);
        if !sent && !received {
            wait(s, true, true);
        }
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
        let mut at = peer.endpoint.lock().unwrap_or_else(|e| e.into_inner());
        if *at != Some(from) {
            *at = Some(from);
        }
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

/// The protocol's timers for every peer: handshakes to start or retry,
/// keepalives, sessions to end; and the early rekey of tests.
fn timers(s: &Shared, buf: &mut [u8]) {
    let peers: Vec<Arc<Peer>> = s.peers().by_key.values().cloned().collect();
    for peer in peers {
        let to = peer.endpoint();
        let mut t = peer.tunn();
        let out = |r: TunnResult<'_>| {
            if let (TunnResult::WriteToNetwork(p), Some(to)) = (r, to) {
                let n = p.len();
                Some((to, n))
            } else {
                None
            }
        };
        if let Some((to, n)) = out(t.update_timers(buf)) {
            send(s, to, &buf[..n], n);
        }
        if let Some(after) = s.rekey_after
            && t.time_since_last_handshake().is_some_and(|d| d >= after)
            && let Some((to, n)) = out(t.format_handshake_initiation(buf, false))
        {
            send(s, to, &buf[..n], n);
        }
    }
}
