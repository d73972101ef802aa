//! A relay for one tunnel between two gateways that cannot reach each
//! other: their WireGuard datagrams, still encrypted, in through one UDP
//! port and out through the other.
//!
//! Side a's gateway sends to the relay's port a and receives from it; side
//! b's the same with port b. Each side's address is learned, not
//! configured (behind NAT it is unknown beforehand), and only once the
//! other side vouched for it: a WireGuard handshake message arriving on a
//! side's port, addressed to one of the other side's gateways (its mac1
//! verifies with that gateway's public key, checked by boringtun's own
//! code) and from one of the side's allowed addresses, makes its source a
//! *candidate* with the message's sender index; handshakes go on to the
//! other side's learned address, or to its candidates while it has none.
//! The candidate is learned when the other side sends a message whose
//! receiver index is that sender index (its handshake response, or data
//! on the session): the other gateway answers only a handshake it could
//! decrypt and that is not a replay, so a forged or replayed handshake
//! never takes a side's place, and data goes only to learned addresses.
//! Anything else is counted and dropped: data from an address not learned,
//! data for a side not learned yet, bytes over the rate limit, runts. A
//! side that moves (its NAT's mapping changed) is learned again through
//! its next handshake.
//!
//! Fast, because a relay is worth only as much as its throughput: one
//! thread per direction; receives and sends in batches through quinn-udp
//! (recvmmsg and UDP GRO in, UDP GSO out: a batch of equal datagrams of a
//! flow crosses the kernel as one buffer each way); 7 MiB socket buffers;
//! buffers allocated once, no allocation per datagram.

use std::io::IoSliceMut;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use weft_wg_device::conn::{canonical, dual_batch_socket, mapped, send_datagrams, wait};

use defguard_boringtun::noise::rate_limiter::RateLimiter;
use quinn_udp::{RecvMeta, UdpSocketState};

mod learn;

use self::learn::{Answer, INITIATION, Learning, Refused, message};

/// One side of a relayed tunnel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Side {
    /// The relay's UDP port this side's gateway sends to.
    pub port: u16,
    /// The public keys of the other side's gateways: this side's
    /// handshakes are addressed to them.
    pub to_keys: Vec<[u8; 32]>,
    /// Addresses this side may send from (its NAT's outside addresses,
    /// or its global IPv6 ones); empty: any.
    pub from_ips: Vec<IpAddr>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spec {
    pub a: Side,
    pub b: Side,
    /// Each direction's limit.
    pub bytes_per_second: u64,
}

/// What a relay did, per direction (0: a to b, 1: b to a) where it has one.
#[derive(Debug, Default)]
pub struct Counters {
    pub packets: [AtomicU64; 2],
    pub bytes: [AtomicU64; 2],
    /// From an address not learned (and not an acceptable handshake).
    pub unknown_source: AtomicU64,
    /// For a side whose address is not learned yet.
    pub no_peer: AtomicU64,
    pub rate_limited: AtomicU64,
    /// Sends the kernel refused (or that found no room in time).
    pub send_failed: AtomicU64,
    /// Addresses learned (a side's first, or a move).
    pub learned: AtomicU64,
    /// Handshakes from addresses not learned over a side's budget.
    pub handshakes_limited: AtomicU64,
    /// Initiations another address sent first (replays): dropped.
    pub replayed: AtomicU64,
    /// Handshake responses to an index that two addresses' initiations
    /// carried (one guessed it): nothing learned.
    pub ambiguous: AtomicU64,
}

/// A running relay; both threads end when it is dropped.
pub struct Relay {
    stop: Arc<AtomicBool>,
    pub counters: Arc<Counters>,
    threads: Vec<JoinHandle<()>>,
    ends: Arc<[End; 2]>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay").field("counters", &self.counters).finish()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A side's socket and what was learned of it.
struct End {
    socket: UdpSocket,
    state: UdpSocketState,
    /// The socket takes both families (where the host has IPv6).
    dual: bool,
    /// Where the side's gateway is, once learned.
    at: Mutex<Option<SocketAddr>>,
    /// The side's recent initiations, and its budget for handshakes from
    /// addresses not learned.
    learning: Mutex<Learning>,
    /// How many candidates wait (read for every datagram; the list only
    /// when some do).
    waiting: AtomicUsize,
    /// The relay's address the side's gateway sends to (replies leave
    /// from it, on a host with several), per family; 0, None: not seen
    /// yet.
    local: AtomicU32,
    local6: Mutex<Option<Ipv6Addr>>,
    /// mac1 checkers for the keys its handshakes are addressed to.
    checkers: Vec<RateLimiter>,
    from_ips: Vec<IpAddr>,
}

/// A receive slot: a datagram up to 64 KiB, or a GRO batch of them.
const SLOT: usize = 1 << 16;

/// How often a waiting thread looks at the stop flag (ms).
const TICK_MS: u16 = 200;

fn end(side: &Side) -> std::io::Result<End> {
    let (socket, state, dual) = dual_batch_socket(side.port)?;
    let checkers = side
        .to_keys
        .iter()
        .map(|k| RateLimiter::new(&defguard_boringtun::x25519::PublicKey::from(*k), u64::MAX))
        .collect();
    Ok(End {
        socket,
        state,
        dual,
        at: Mutex::new(None),
        learning: Mutex::new(Learning::new()),
        waiting: AtomicUsize::new(0),
        local: AtomicU32::new(0),
        local6: Mutex::new(None),
        checkers,
        from_ips: side.from_ips.clone(),
    })
}

/// Starts relaying between `spec.a.port` and `spec.b.port` (bound on every
/// address of the namespace it runs in).
pub fn start(spec: &Spec) -> std::io::Result<Relay> {
    start_with(spec, [None, None])
}

impl Relay {
    /// Where each side's gateway was learned to be (a to b, b to a).
    pub fn learned(&self) -> [Option<SocketAddr>; 2] {
        [*self.ends[0].at.lock().unwrap(), *self.ends[1].at.lock().unwrap()]
    }
}

/// [`start`], each side's gateway already known at `learned` (the same
/// session's, before a change of it restarted the relay) where the side
/// may send from there: its tunnel goes on without waiting for a
/// handshake.
pub fn start_with(spec: &Spec, learned: [Option<SocketAddr>; 2]) -> std::io::Result<Relay> {
    let ends = Arc::new([end(&spec.a)?, end(&spec.b)?]);
    for (e, at) in ends.iter().zip(learned) {
        *e.at.lock().unwrap() = at.map(canonical).filter(|a| e.may_send_from(a.ip()));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(Counters::default());
    let mut threads = Vec::new();
    for from in 0..2 {
        let (ends, stop, counters) = (ends.clone(), stop.clone(), counters.clone());
        let rate = spec.bytes_per_second;
        threads.push(
            std::thread::Builder::new()
                .name(format!("weft-relay-{}", [spec.a.port, spec.b.port][from]))
                .spawn(move || forward(&ends, from, &stop, &counters, rate))?,
        );
    }
    Ok(Relay {
        stop,
        counters,
        threads,
        ends,
    })
}

/// A token bucket of bytes: `rate` a second, bursts of an eighth of it.
struct Bucket {
    rate: u64,
    tokens: u64,
    at: Instant,
}

impl Bucket {
    fn take(&mut self, n: u64) -> bool {
        let now = Instant::now();
        let add = (now - self.at).as_secs_f64() * self.rate as f64;
        if add >= 1.0 {
            self.tokens = (self.tokens + add as u64).min((self.rate / 8).max(65_536));
            self.at = now;
        }
        if self.tokens >= n {
            self.tokens -= n;
            true
        } else {
            false
        }
    }
}

/// Receives on `ends[from]` and sends what passes out of the other end to
/// the other side, until `stop`.
fn forward(ends: &[End; 2], from: usize, stop: &AtomicBool, c: &Counters, rate: u64) {
    let (src, dst) = (&ends[from], &ends[1 - from]);
    let batch = quinn_udp::BATCH_SIZE;
    let mut storage = vec![0u8; batch * SLOT];
    let mut meta = vec![RecvMeta::default(); batch];
    let mut bucket = Bucket {
        rate,
        tokens: (rate / 8).max(65_536),
        at: Instant::now(),
    };
    // Single datagrams of a batch that go to the same place with the same
    // size, copied together to leave in one segmented send (without GRO,
    // as on a veth, each arrives alone: one send each would cost a system
    // call per datagram).
    let mut out = Coalesced {
        buf: vec![0u8; MAX_SEND],
        len: 0,
        stride: 0,
        to: None,
    };
    // The last receive emptied the socket's queue: wait for more before the
    // next (a receive now would only say WouldBlock: a wasted system call
    // per wake-up when datagrams come one at a time).
    let mut drained = false;
    let mut bufs: Vec<IoSliceMut> = storage.chunks_mut(SLOT).map(IoSliceMut::new).collect();
    while !stop.load(Ordering::Relaxed) {
        if drained {
            wait(&src.socket, nix::poll::PollFlags::POLLIN, TICK_MS);
        }
        let n = {
            match src.state.recv((&src.socket).into(), &mut bufs, &mut meta) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    drained = true;
                    continue;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "relay receive");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            }
        };
        drained = n < batch;
        // Senders as weft names them (IPv4 as IPv4, on a socket for both).
        for m in &mut meta[..n] {
            m.addr = canonical(m.addr);
        }
        // Where each side is, as of this batch (learned addresses change
        // rarely; a datagram that vouches for one updates it).
        let mut src_at = *src.at.lock().unwrap();
        let mut dst_at = *dst.at.lock().unwrap();
        for (m, buf) in meta.iter().take(n).zip(bufs.iter()) {
            let data = &buf[..m.len.min(SLOT)];
            let stride = m.stride.clamp(1, data.len().max(1));
            let count = data.len().div_ceil(stride) as u64;
            let Some((kind, sender, receiver)) = message(&data[..stride.min(data.len())]) else {
                c.unknown_source.fetch_add(count, Ordering::Relaxed);
                continue;
            };
            let learned = src_at == Some(m.addr);
            if !learned {
                // Only a handshake may come from an address not learned:
                // an initiation (a candidate, or the side moved) or a
                // response to the other side's initiation.
                let taken = match kind {
                    1 | 2 => src.admits(m.addr, data),
                    _ => Err(Refused::Unknown),
                };
                match taken {
                    Ok(()) => {}
                    Err(Refused::Unknown) => {
                        c.unknown_source.fetch_add(count, Ordering::Relaxed);
                        continue;
                    }
                    Err(Refused::OverBudget) => {
                        c.handshakes_limited.fetch_add(count, Ordering::Relaxed);
                        continue;
                    }
                }
            } else {
                match m.dst_ip.map(|ip| ip.to_canonical()) {
                    Some(IpAddr::V4(ip)) => src.local.store(u32::from(ip), Ordering::Relaxed),
                    Some(IpAddr::V6(ip)) if *src.local6.lock().unwrap() != Some(ip) => {
                        *src.local6.lock().unwrap() = Some(ip);
                    }
                    _ => {}
                }
            }
            if kind == 1 && !src.initiated(m.addr, sender, data, learned, dst_at.is_none()) {
                c.replayed.fetch_add(count, Ordering::Relaxed);
                continue;
            }
            // Only the other side's handshake response vouches for an
            // address: a cookie reply answers any initiation whose mac1
            // verifies (public keys suffice), and data carries indexes an
            // onlooker may know.
            if kind == 2 && dst.waiting.load(Ordering::Relaxed) > 0 {
                match dst.answered(receiver) {
                    Answer::Learned(a) => {
                        c.learned.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(side = 1 - from, at = %a, "relay: a side's gateway learned");
                        let first = dst_at.is_none();
                        dst_at = Some(a);
                        src_at = *src.at.lock().unwrap();
                        // This side's initiations that found the other
                        // side unknown go there now.
                        if first {
                            out.flush(dst, c, from);
                            for init in src.take_pending() {
                                relay(
                                    dst,
                                    a,
                                    &init[..],
                                    INITIATION,
                                    &c.packets[from],
                                    &c.bytes[from],
                                    &c.send_failed,
                                );
                            }
                        }
                    }
                    Answer::Ambiguous => {
                        c.ambiguous.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            side = 1 - from,
                            "relay: a handshake response answered an initiation sent from two addresses (a replay): neither learned"
                        );
                    }
                    Answer::Nothing => {}
                }
            }
            if !bucket.take(data.len() as u64) {
                c.rate_limited.fetch_add(count, Ordering::Relaxed);
                continue;
            }
            match (kind, dst_at) {
                (_, Some(to)) if data.len() == stride => {
                    if !out.fits(to, stride, dst) {
                        out.flush(dst, c, from);
                    }
                    out.push(to, data);
                }
                (_, Some(to)) => {
                    out.flush(dst, c, from);
                    relay(dst, to, data, stride, &c.packets[from], &c.bytes[from], &c.send_failed);
                }
                // A handshake for a side not learned goes to its candidates
                // (one of them is the gateway; the others cannot use it).
                (1, None) => {
                    out.flush(dst, c, from);
                    let targets = dst.handshake_targets();
                    if targets.is_empty() {
                        c.no_peer.fetch_add(count, Ordering::Relaxed);
                    }
                    for to in targets {
                        relay(dst, to, data, stride, &c.packets[from], &c.bytes[from], &c.send_failed);
                    }
                }
                (_, None) => {
                    c.no_peer.fetch_add(count, Ordering::Relaxed);
                }
            }
        }
        out.flush(dst, c, from);
    }
}

/// The most one segmented send carries (a UDP datagram's payload limit).
const MAX_SEND: usize = 65_507;

/// Datagrams of one size for one address, back to back, not sent yet.
struct Coalesced {
    buf: Vec<u8>,
    len: usize,
    stride: usize,
    to: Option<SocketAddr>,
}

impl Coalesced {
    /// Whether one more datagram of `stride` bytes for `to` joins these.
    fn fits(&self, to: SocketAddr, stride: usize, end: &End) -> bool {
        self.len == 0
            || (self.to == Some(to)
                && self.stride == stride
                && self.len + stride <= MAX_SEND
                && self.len / stride < end.state.max_gso_segments())
    }

    fn push(&mut self, to: SocketAddr, data: &[u8]) {
        if self.len == 0 {
            self.to = Some(to);
            self.stride = data.len();
        }
        self.buf[self.len..self.len + data.len()].copy_from_slice(data);
        self.len += data.len();
    }

    fn flush(&mut self, end: &End, c: &Counters, from: usize) {
        if let (Some(to), true) = (self.to, self.len > 0) {
            relay(
                end,
                to,
                &self.buf[..self.len],
                self.stride,
                &c.packets[from],
                &c.bytes[from],
                &c.send_failed,
            );
        }
        self.len = 0;
        self.to = None;
    }
}

/// Sends `data` (datagrams of `stride` bytes) to `to` from `end`, as many
/// per call as its socket may segment, counting what went and what not.
fn relay(
    end: &End,
    to: SocketAddr,
    data: &[u8],
    stride: usize,
    packets: &AtomicU64,
    bytes: &AtomicU64,
    failed: &AtomicU64,
) {
    let local = match to.ip() {
        IpAddr::V4(_) => match end.local.load(Ordering::Relaxed) {
            0 => None,
            ip => Some(IpAddr::V4(Ipv4Addr::from(ip))),
        },
        IpAddr::V6(_) => end.local6.lock().unwrap().map(IpAddr::V6),
    };
    let per_send = stride * end.state.max_gso_segments().max(1);
    for chunk in data.chunks(per_send) {
        let k = chunk.len().div_ceil(stride) as u64;
        if send(end, to, local, chunk, stride) {
            packets.fetch_add(k, Ordering::Relaxed);
            bytes.fetch_add(chunk.len() as u64, Ordering::Relaxed);
        } else {
            failed.fetch_add(k, Ordering::Relaxed);
        }
    }
}

/// [`send_datagrams`] from `end`'s socket.
fn send(end: &End, to: SocketAddr, local: Option<IpAddr>, chunk: &[u8], stride: usize) -> bool {
    send_datagrams(&end.socket, &end.state, mapped(to, end.dual), local, chunk, stride)
}

#[cfg(test)]
mod tests;
