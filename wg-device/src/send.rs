//! The tun to the network: packets read from the tun (TCP super-packets
//! cut into segments first), encrypted into batches, and sent to each
//! peer's endpoint in segmented sends.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use defguard_boringtun::noise::{Tunn, TunnResult};

use crate::packet::{self, MAX_PACKET, VNET_HDR_LEN, VnetHdr};
use crate::peers::Peer;
use crate::shared::Shared;
use crate::{MAX_DATAGRAM, MAX_SEND};

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
pub(crate) fn send(s: &Shared, to: SocketAddr, data: &[u8], stride: usize) {
    if !s.bind.send(to, data, stride) {
        s.counters
            .tx_send_failed
            .fetch_add(data.len().div_ceil(stride.max(1)) as u64, Ordering::Relaxed);
    }
}

/// A handshake initiation `data` to `peer` at `to` goes to the direct
/// address tried beside its endpoint too (the first ones with the punch
/// TTL): the far side's NAT or firewall then lets the far side's
/// initiations in, and whichever copy arrives first is answered (the
/// other is a replay). Anything else goes only to `to`.
pub(crate) fn beside(s: &Shared, peer: &Peer, to: SocketAddr, data: &[u8]) {
    if data.first() != Some(&1) {
        return;
    }
    if let Some((direct, prime)) = peer.beside_target(Some(to), s.punch_ttl) {
        direct_send(s, direct, data, prime);
    }
}

/// Sends `data` to `to`, with the punch TTL when `prime` (counted).
pub(crate) fn direct_send(s: &Shared, to: SocketAddr, data: &[u8], prime: bool) {
    if !prime {
        send(s, to, data, data.len());
    } else if s.bind.send_ttl(to, data, s.punch_ttl) {
        s.counters.tx_primed.fetch_add(1, Ordering::Relaxed);
    } else {
        s.counters.tx_send_failed.fetch_add(1, Ordering::Relaxed);
    }
}

/// Sends datagram `data` to `peer` at `to`: with the punch TTL while the
/// peer is priming (counted), else as [`send`] does; a handshake
/// initiation beside too ([`beside`]).
pub(crate) fn to_peer(s: &Shared, peer: &Peer, to: SocketAddr, data: &[u8]) {
    beside(s, peer, to, data);
    if peer.priming() {
        if s.bind.send_ttl(to, data, s.punch_ttl) {
            s.counters.tx_primed.fetch_add(1, Ordering::Relaxed);
        } else {
            s.counters.tx_send_failed.fetch_add(1, Ordering::Relaxed);
        }
    } else {
        send(s, to, data, data.len());
    }
}

/// Reads before a step yields (to the other direction, when one thread
/// runs both).
const READS_PER_STEP: usize = 16;

/// The tun to the network: read, cut, encrypt, send in batches.
pub(crate) struct Out {
    hdr: usize,
    rd: Vec<u8>,
    plain: Vec<u8>,
    segs: Vec<(usize, usize)>,
    batch: Batch,
}

impl Out {
    pub(crate) fn new(s: &Shared) -> Out {
        let hdr = if s.vnet_hdr { VNET_HDR_LEN } else { 0 };
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
    pub(crate) fn step(&mut self, s: &Shared) -> bool {
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
        // (no session while priming: what leaves is a handshake)
        let priming = peer.priming();
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
                    if let Some(to) = to
                        && !priming
                    {
                        beside(s, &peer, to, p);
                    }
                    match to {
                        Some(to) if priming => to_peer(s, &peer, to, p),
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
