//! The controller's UDP reflector for endpoint discovery
//! (`weft_common::discovery`): on the gRPC listener's address and port, it
//! answers each well-formed probe with the address and port the probe came
//! from. Gateways of this site and of peered sites probe it from their
//! tunnels' ports to learn their NAT mappings.
//!
//! An answer is smaller than its probe, goes only to the probe's source,
//! and at most [`ANSWERS_PER_SECOND`] go out a second: the reflector cannot
//! be used to amplify traffic toward anyone. What it ignores (malformed
//! datagrams, probes over the limit) is counted.

use std::net::{SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use weft_common::discovery;

/// Answers a second, over all sources (every gateway probes each reflector
/// a few times a minute).
pub const ANSWERS_PER_SECOND: u32 = 2000;

pub static ANSWERED: AtomicU64 = AtomicU64::new(0);
pub static IGNORED: AtomicU64 = AtomicU64::new(0);
pub static LIMITED: AtomicU64 = AtomicU64::new(0);

/// Binds UDP `addr` and answers probes until the task is aborted; None
/// (logged) when the port cannot be bound: discovery through this
/// controller is then off, and nothing else is affected.
pub fn start(addr: SocketAddr) -> Option<tokio::task::JoinHandle<()>> {
    let socket = match std::net::UdpSocket::bind(addr).and_then(|s| {
        s.set_nonblocking(true)?;
        tokio::net::UdpSocket::from_std(s)
    }) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(%addr, error = %e, "no endpoint discovery reflector: cannot bind UDP");
            return None;
        }
    };
    tracing::info!(%addr, "endpoint discovery reflector on UDP");
    Some(tokio::spawn(serve(socket)))
}

async fn serve(socket: tokio::net::UdpSocket) {
    let mut buf = [0u8; 1500];
    let mut window = Instant::now();
    let mut answered_in_window = 0u32;
    loop {
        let (n, from) = match socket.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(error = %e, "reflector receive");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let (Some(nonce), SocketAddr::V4(from)) = (discovery::parse_probe(&buf[..n]), from) else {
            IGNORED.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        if window.elapsed() >= Duration::from_secs(1) {
            window = Instant::now();
            answered_in_window = 0;
        }
        if answered_in_window >= ANSWERS_PER_SECOND {
            LIMITED.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        answered_in_window += 1;
        let answer = discovery::answer(&nonce, SocketAddrV4::new(*from.ip(), from.port()));
        if socket.send_to(&answer, from).await.is_ok() {
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
