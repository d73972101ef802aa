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
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use defguard_boringtun::noise::rate_limiter::RateLimiter;
use quinn_udp::{RecvMeta, Transmit, UdpSocketState};

mod learn;

use self::learn::{Answer, INITIATION, Learning, Refused, message};

/// One side of a relayed tunnel.
#[derive(Clone, Debug)]
pub struct Side {
    /// The relay's UDP port this side's gateway sends to.
    pub port: u16,
    /// The public keys of the other side's gateways: this side's
    /// handshakes are addressed to them.
    pub to_keys: Vec<[u8; 32]>,
    /// Addresses this side may send from (its NAT's outside addresses);
    /// empty: any.
    pub from_ips: Vec<Ipv4Addr>,
}

#[derive(Clone, Debug)]
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
    /// Where the side's gateway is, once learned.
    at: Mutex<Option<SocketAddr>>,
    /// The side's recent initiations, and its budget for handshakes from
    /// addresses not learned.
    learning: Mutex<Learning>,
    /// How many candidates wait (read for every datagram; the list only
    /// when some do).
    waiting: AtomicUsize,
    /// The relay's IPv4 address the side's gateway sends to (replies leave
    /// from it, on a host with several); 0: not seen yet.
    local: AtomicU32,
    /// mac1 checkers for the keys its handshakes are addressed to.
    checkers: Vec<RateLimiter>,
    from_ips: Vec<Ipv4Addr>,
}

/// A receive slot: a datagram up to 64 KiB, or a GRO batch of them.
const SLOT: usize = 1 << 16;

/// Socket buffers (as the WireGuard devices' own, see `offload`).
const SOCKET_BUFFER: usize = 7 << 20;
/// How often a waiting thread looks at the stop flag (ms).
const TICK_MS: u16 = 200;
/// How long a send waits for room in a full socket buffer (ms), twice,
/// before the datagrams are dropped.
const ROOM_MS: u16 = 20;

/// Waits until `socket` is ready for `events` or `ms` pass.
fn wait(socket: &UdpSocket, events: nix::poll::PollFlags, ms: u16) {
    use std::os::fd::AsFd;
    let mut fds = [nix::poll::PollFd::new(socket.as_fd(), events)];
    let _ = nix::poll::poll(&mut fds, ms);
}

/// A UDP socket on `port` (all IPv4 addresses) for datagrams in batches:
/// non-blocking (waited on with poll: quinn-udp's recvmmsg on a blocking
/// socket would wait for a whole batch), 7 MiB buffers, quinn-udp's state
/// (GSO, GRO), fragments allowed. Shared with the userspace WireGuard
/// device.
pub(crate) fn batch_socket(port: u16) -> std::io::Result<(UdpSocket, UdpSocketState)> {
    tuned(UdpSocket::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)))?)
}

/// `socket` set up for batches, as [`batch_socket`] says.
pub(crate) fn tuned(socket: UdpSocket) -> std::io::Result<(UdpSocket, UdpSocketState)> {
    use nix::sys::socket::{setsockopt, sockopt};
    socket.set_nonblocking(true)?;
    // FORCE: past the host's rmem_max (the agent has CAP_NET_ADMIN); the
    // plain option as the fallback.
    if setsockopt(&socket, sockopt::RcvBufForce, &SOCKET_BUFFER).is_err() {
        let _ = setsockopt(&socket, sockopt::RcvBuf, &SOCKET_BUFFER);
    }
    if setsockopt(&socket, sockopt::SndBufForce, &SOCKET_BUFFER).is_err() {
        let _ = setsockopt(&socket, sockopt::SndBuf, &SOCKET_BUFFER);
    }
    let state = UdpSocketState::new((&socket).into())?;
    // quinn-udp forbids fragmentation (QUIC sizes its own packets); these
    // datagrams were not sized for the path (a relayed gateway's, or
    // WireGuard's over an underlay of smaller MTU): one larger than the
    // path leaves in fragments, as kernel WireGuard's do.
    allow_fragments(&socket)?;
    Ok((socket, state))
}

fn end(side: &Side) -> std::io::Result<End> {
    let (socket, state) = batch_socket(side.port)?;
    let checkers = side
        .to_keys
        .iter()
        .map(|k| RateLimiter::new(&defguard_boringtun::x25519::PublicKey::from(*k), u64::MAX))
        .collect();
    Ok(End {
        socket,
        state,
        at: Mutex::new(None),
        learning: Mutex::new(Learning::new()),
        waiting: AtomicUsize::new(0),
        local: AtomicU32::new(0),
        checkers,
        from_ips: side.from_ips.clone(),
    })
}

/// `IP_MTU_DISCOVER` = `IP_PMTUDISC_DONT` on `socket` (and IPv6's
/// counterparts on an IPv6 socket), which neither nix nor socket2 wraps.
fn allow_fragments(socket: &UdpSocket) -> std::io::Result<()> {
    set_int(socket, libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_DONT)?;
    // An IPv6 socket (for both families): IPv6's too (the sender
    // fragments there).
    if socket.local_addr()?.is_ipv6() {
        set_int(
            socket,
            libc::IPPROTO_IPV6,
            libc::IPV6_MTU_DISCOVER,
            libc::IPV6_PMTUDISC_DONT,
        )?;
        set_int(socket, libc::IPPROTO_IPV6, libc::IPV6_DONTFRAG, 0)?;
    }
    Ok(())
}

#[allow(unsafe_code)]
fn set_int(socket: &UdpSocket, level: libc::c_int, name: libc::c_int, value: libc::c_int) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid open socket of ours, and a pointer to an int that
    // lives for the call, with its size.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Starts relaying between `spec.a.port` and `spec.b.port` (bound on every
/// address of the namespace it runs in).
pub fn start(spec: &Spec) -> std::io::Result<Relay> {
    let ends = Arc::new([end(&spec.a)?, end(&spec.b)?]);
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
            } else if let Some(IpAddr::V4(ip)) = m.dst_ip {
                src.local.store(u32::from(ip), Ordering::Relaxed);
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
    let local = match end.local.load(Ordering::Relaxed) {
        0 => None,
        ip => Some(IpAddr::V4(Ipv4Addr::from(ip))),
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
    send_datagrams(&end.socket, &end.state, to, local, chunk, stride)
}

/// Sends `chunk` (datagrams of `stride` bytes, the last maybe shorter, no
/// more than `state` may segment) to `to` from `socket` (from address
/// `local` when known), in one call when it can segment them, waiting a
/// little for room when its buffer is full; a segmented send the kernel
/// refuses (a datagram over the path's MTU) goes again one datagram at a
/// time. Shared with the userspace WireGuard device.
pub(crate) fn send_datagrams(
    socket: &UdpSocket,
    state: &UdpSocketState,
    to: SocketAddr,
    local: Option<IpAddr>,
    chunk: &[u8],
    stride: usize,
) -> bool {
    let one = |contents: &[u8], segment: Option<usize>| {
        let t = Transmit {
            destination: to,
            ecn: None,
            contents,
            segment_size: segment,
            src_ip: local,
        };
        for _ in 0..3 {
            match state.try_send(socket.into(), &t) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    wait(socket, nix::poll::PollFlags::POLLOUT, ROOM_MS);
                }
                Err(e) => return Err(e),
            }
        }
        Err(std::io::ErrorKind::WouldBlock.into())
    };
    if chunk.len() <= stride {
        return one(chunk, None).is_ok();
    }
    match one(chunk, Some(stride)) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
        Err(e) => {
            tracing::debug!(error = %e, "relay: a segmented send refused, sending one by one");
            chunk.chunks(stride).all(|d| one(d, None).is_ok())
        }
    }
}

#[cfg(test)]
mod tests {
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
    fn relay_for(pa: [u8; 32], pb: [u8; 32], a_from: Vec<Ipv4Addr>) -> ((u16, u16), Relay) {
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

    fn two(a_from: Vec<Ipv4Addr>) -> Two {
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
        via.0.send_to(data, at(via.1)).unwrap();
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
                s.send_to(reply, at(port)).unwrap();
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
        } = two(vec![Ipv4Addr::LOCALHOST]);
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
}
