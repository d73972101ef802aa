//! The controller's UDP reflector for endpoint discovery
//! (`weft_common::discovery`): on the gRPC listener's address and port, it
//! answers each well-formed probe with the address and port the probe came
//! from. Gateways of this site and of peered sites probe it from their
//! tunnels' ports to learn their NAT mappings.
//!
//! An answer is smaller than its probe, goes only to the probe's source,
//! from the address the probe was sent to, and at most
//! [`ANSWERS_PER_SECOND`] go out a second, [`ANSWERS_PER_SOURCE`] to one
//! source: the reflector cannot be used to amplify traffic toward anyone.
//! What it ignores (malformed datagrams, probes over the limits) is
//! counted.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use weft_common::discovery;

/// Answers a second, over all sources (every gateway probes each reflector
/// a few times a minute).
pub const ANSWERS_PER_SECOND: u32 = 2000;

pub static ANSWERED: AtomicU64 = AtomicU64::new(0);
pub static IGNORED: AtomicU64 = AtomicU64::new(0);
pub static LIMITED: AtomicU64 = AtomicU64::new(0);

/// Answers a second per source address; the rest of a source's probes in
/// that second are dropped (a flood from a few sources cannot take the
/// budget of everyone else). One address can be a NAT with several
/// gateways behind it, each probing from every tunnel every 5 s (100
/// peerings: 20 probes a second per gateway and reflector).
pub const ANSWERS_PER_SOURCE: u32 = 200;
/// Sources tracked in a second, at most (beyond: only the global limit).
const SOURCES: usize = 10_000;

/// The running reflector; its thread ends when dropped.
pub struct Reflector {
    stop: Arc<AtomicBool>,
}

impl Drop for Reflector {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Binds UDP `addr` and answers probes on a thread of its own; None
/// (logged) when the port cannot be bound: discovery through this
/// controller is then off, and nothing else is affected.
pub fn start(addr: SocketAddr) -> Option<Reflector> {
    let bound = UdpSocket::bind(addr).and_then(|s| {
        let state = quinn_udp::UdpSocketState::new((&s).into())?;
        // quinn-udp made it non-blocking: blocking again, with a timeout
        // to look at `stop`, or the thread spins on WouldBlock (a core's
        // worth of a 2-core machine on every controller).
        s.set_nonblocking(false)?;
        s.set_read_timeout(Some(Duration::from_millis(200)))?;
        Ok((s, state))
    });
    let (socket, state) = match bound {
        Ok(x) => x,
        Err(e) => {
            tracing::warn!(%addr, error = %e, "no endpoint discovery reflector: cannot bind UDP");
            return None;
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let spawned = std::thread::Builder::new()
        .name("weft-reflector".into())
        .spawn(move || serve(&socket, &state, &s));
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no endpoint discovery reflector");
        return None;
    }
    tracing::info!(%addr, "endpoint discovery reflector on UDP");
    Some(Reflector { stop })
}

/// Answers probes until `stop`: each from the address it was sent to (a
/// host with several addresses must answer from the one the gateway's NAT
/// expects), within the limits.
fn serve(socket: &UdpSocket, state: &quinn_udp::UdpSocketState, stop: &AtomicBool) {
    let mut buf = [0u8; 1500];
    let mut meta = [quinn_udp::RecvMeta::default()];
    let mut window = Instant::now();
    let mut answered_in_window = 0u32;
    let mut per_source: HashMap<IpAddr, u32> = HashMap::new();
    while !stop.load(Ordering::Relaxed) {
        let n = {
            let mut bufs = [std::io::IoSliceMut::new(&mut buf)];
            match state.recv(socket.into(), &mut bufs, &mut meta) {
                Ok(n) => n,
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
                Err(e) => {
                    tracing::debug!(error = %e, "reflector receive");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            }
        };
        if n == 0 {
            continue;
        }
        let m = meta[0];
        // A dual-stack socket sees IPv4 senders as IPv4-mapped IPv6.
        let from = SocketAddr::new(m.addr.ip().to_canonical(), m.addr.port());
        let (Some(nonce), SocketAddr::V4(from4)) = (discovery::parse_probe(&buf[..m.len.min(buf.len())]), from) else {
            IGNORED.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        if window.elapsed() >= Duration::from_secs(1) {
            window = Instant::now();
            answered_in_window = 0;
            per_source.clear();
        }
        let mine = per_source.get(&from.ip()).copied().unwrap_or(0);
        if answered_in_window >= ANSWERS_PER_SECOND || mine >= ANSWERS_PER_SOURCE {
            LIMITED.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        answered_in_window += 1;
        if per_source.len() < SOURCES || per_source.contains_key(&from.ip()) {
            per_source.insert(from.ip(), mine + 1);
        }
        let answer = discovery::answer(&nonce, from4);
        let t = quinn_udp::Transmit {
            destination: m.addr,
            ecn: None,
            contents: &answer,
            segment_size: None,
            src_ip: m.dst_ip,
        };
        if state.try_send(socket.into(), &t).is_ok() {
            ANSWERED.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The reflector's counters into the controller's metrics.
pub fn series(f: &mut weft_common::obs::Families) {
    for (what, n) in [
        ("answered", &ANSWERED),
        ("ignored", &IGNORED),
        ("rate_limited", &LIMITED),
    ] {
        f.counter(
            "weft_controller_discovery_datagrams",
            "Endpoint discovery datagrams at this controller's reflector: answered probes, ignored datagrams (not a probe), probes over the rate limit",
            &[("result", what)],
            n.load(Ordering::Relaxed),
        );
    }
}
