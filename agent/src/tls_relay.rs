//! Tunnels over TLS on TCP, for gateways whose UDP is blocked (networks
//! that let only TCP out, such as many corporate ones).
//!
//! A relay site's active gateway runs a [`Front`] on one TCP port (443
//! passes most firewalls). A gateway whose UDP to that host does not work
//! runs a [`Carrier`] per tunnel instead: a UDP socket on 127.0.0.1 that
//! its WireGuard device takes as the peer's endpoint, and one TLS
//! connection to the front. The connection starts with [`HELLO`] and the
//! UDP port it stands for on the relay host (a relayed tunnel's side, or
//! one of the relay gateway's own tunnels, as peers reach it); the front
//! checks it against what it admits ([`Admit`]), answers one byte, and
//! from then on hands every datagram to that port from a socket on
//! 127.0.0.1 (the same one for the same port and address across
//! reconnections: the relay learned it), and what comes back the other
//! way. Both directions of the connection are byte streams of frames: a
//! datagram's length (2 bytes, big-endian), then the datagram. A
//! connection that carries nothing for a minute, or whose peer stops
//! acknowledging for 30 s, ends; the carrier connects again with backoff.
//!
//! What rides inside stays WireGuard end to end: the relay sees only
//! ciphertext, and the WireGuard sessions authenticate both ends. TLS only
//! carries the datagrams through firewalls, so it authenticates nothing:
//! the front's certificate is made at start, and the carrier takes any
//! (a man in the middle sees what a UDP path would show him: ciphertext).
//!
//! Against TCP-over-TCP collapse: one connection per tunnel, never one
//! per inner flow; and nothing is queued beyond the sockets' buffers (1
//! MiB on the loopback sockets) and one write. A datagram that finds the
//! connection's send buffer full waits in its UDP socket's buffer, and
//! past that is dropped, as a congested UDP path would drop it, so the
//! inner TCP backs off instead of its lost packets being retransmitted
//! twice.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use tokio::net::TcpStream;

mod carrier;
mod front;
mod pump;

pub use carrier::Carrier;
pub use front::{Admit, Front, Target, admitted};

/// What a connection sends first: this, then the UDP port (2 bytes). The
/// front answers one byte: [`ADMITTED`], or [`REFUSED`] and it closes.
pub const HELLO: &[u8; 8] = b"WEFTTLS1";
pub const ADMITTED: u8 = 0;
pub const REFUSED: u8 = 1;
/// The TLS application protocol both ends name.
const ALPN: &[u8] = b"weft-tunnel/1";
/// The name a carrier asks for (the front's certificate carries it).
const SERVER_NAME: &str = "weft-relay";
/// How long a connection may take to say what it is.
const HANDSHAKE: Duration = Duration::from_secs(5);
/// Connections a front serves at once (each a tunnel's side), and from
/// one address (a NAT's many gateways, or one gateway's tunnels).
const MAX_CONNECTIONS: usize = 512;
const MAX_PER_SOURCE: usize = 32;
/// A connection that carries nothing for this long is dead (WireGuard's
/// keepalives cross every 25 s); TCP gives up on unacknowledged data after
/// [`TCP_TIMEOUT`].
const IDLE: Duration = Duration::from_secs(60);
const TCP_TIMEOUT: Duration = Duration::from_secs(30);
/// A pump's read buffer and the most it writes at once.
const CHUNK: usize = 256 * 1024;
/// The loopback sockets' buffers: room for bursts, small enough that a
/// congested connection drops rather than queues for long.
const UDP_BUFFER: usize = 1 << 20;
/// Datagrams (or GRO batches) one receive takes.
const RECV_BATCH: usize = 8;
/// The most loopback sockets a front keeps for (port, address) pairs.
const MAX_SOCKETS: usize = 1024;

/// What a front or a carrier did.
#[derive(Debug, Default)]
pub struct Counters {
    /// Datagrams and bytes into the connection, and out of it.
    pub sent: [AtomicU64; 2],
    pub received: [AtomicU64; 2],
    /// Connections made (a carrier) or admitted (a front).
    pub connections: AtomicU64,
    /// Connections refused (a front: over the limits, no TLS, no hello in
    /// time, a port not admitted) or that failed or were refused (a
    /// carrier).
    pub refused: AtomicU64,
    /// Datagrams from the connection not handed on (no destination yet, or
    /// the loopback send failed).
    pub dropped: AtomicU64,
}

/// A TCP connection's settings at both ends: no Nagle (frames are batched
/// already), and dead peers found: keepalives, and a bound on
/// unacknowledged data.
fn tune(stream: &TcpStream) {
    let _ = stream.set_nodelay(true);
    let s = socket2::SockRef::from(stream);
    let ka = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(10))
        .with_interval(Duration::from_secs(5))
        .with_retries(3);
    let _ = s.set_tcp_keepalive(&ka);
    let _ = s.set_tcp_user_timeout(Some(TCP_TIMEOUT));
}

#[cfg(test)]
mod tests;
