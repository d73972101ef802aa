//! weft's userspace WireGuard device: boringtun's protocol (its `noise`
//! state machine: handshakes, sessions, timers, cookies; no crypto here)
//! with weft's own I/O, in batches, using the kernel's offloads:
//!
//! - **out** (one thread): the tun hands over TCP super-packets of up to
//!   64 KiB (TSO, with the virtio-net header); each is cut into the
//!   segments the wire carries (`packet::segment`), encrypted one after
//!   another into one buffer, and sent to the peer in one system call with
//!   UDP GSO (`UDP_SEGMENT`), up to 64 datagrams per call;
//! - **in** (another thread): UDP GRO hands over runs of datagrams from one
//!   sender in one receive, many runs per `recvmmsg`; each is decrypted,
//!   and consecutive TCP segments of one flow are joined again
//!   (`packet::Coalescer`) so the kernel takes one packet per run instead
//!   of one per segment. The same thread runs the protocol's timers.
//!
//! Two threads, one per direction: on 2 cores level with or faster than
//! one thread for both (median 1.01× and 1.07× in two benches,
//! docs/benchmarks.md); each direction keeps its packets in order, since
//! one thread does all of it. A peer's session state is behind a mutex
//! that each thread takes once per batch.
//!
//! Every offload is asked for at start and dropped if the kernel refuses
//! it (`Offloads`, shown by `diagnose` and the metrics): without them the
//! device moves a packet per system call, as boringtun's own did.
//!
//! What arrives from the network is checked before use, as by kernel
//! WireGuard: the message's MACs (and, under load, its cookie) before any
//! work, its session and counter (replays are refused) and its tag when
//! decrypted, and its inner source against the peer's allowed IPs. What is
//! refused is counted ([`Counters::rx_rejected`]) and goes no further.
//!
//! Its I/O is two traits, as wireguard-go's `tun.Device` and `conn.Bind`:
//! [`Tun`] (the interface's packets) and [`Bind`] (the UDP socket). On a
//! host they are [`tun::KernelTun`] and [`conn::UdpBind`]
//! ([`Device::start`]); in tests, [`memory`]'s doubles run the same device
//! with no namespace and no privilege.
//!
//! The crate is plain threads and system calls: no async runtime, no
//! netlink, nothing of weft's. Moving the interface into a namespace and
//! restarting a dead device are the data plane's (`weft-dataplane`'s
//! `userspace` module).

pub mod conn;
mod device;
pub mod memory;
pub mod packet;
mod peers;
mod receive;
mod send;
mod shared;
mod timers;
pub mod tun;

pub use device::Device;
pub use peers::route_bench;

use std::io::IoSliceMut;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use quinn_udp::RecvMeta;

use self::packet::MAX_PACKET;

/// How often a waiting thread looks at the stop flag, and the timers run.
const TICK_MS: u16 = 100;
const TIMER_EVERY: Duration = Duration::from_millis(250);
/// A peer given a new endpoint is sent a handshake every [`EAGER_EVERY`]
/// until a session is up, for its first [`EAGER_FOR`], instead of the
/// protocol's every 5 s: a first initiation is often lost (a relay not yet
/// told of the tunnel, a NAT not yet open), and 5 s of silence then is a
/// tunnel that looks dead to the workloads. After that, the protocol's
/// own pace.
const EAGER_EVERY: Duration = Duration::from_secs(1);
const EAGER_FOR: Duration = Duration::from_secs(15);
/// How long a hole-punched peer's handshakes leave with
/// [`Config::punch_ttl`] at most: longer than the two sides take to learn
/// each other's address (the controllers tell both at about once), short
/// against the time a punch is given before a relay takes the tunnel.
const PRIME_FOR: Duration = Duration::from_secs(2);
/// A peer reached through a relay with a direct path tried beside it
/// ([`Device::set_peer_beside`]): how often a keepalive of its session
/// goes to the direct address while the peer is not there, and how long
/// after the direct address was last heard from the peer may roam away
/// from it again (the direct path died; till then, authenticated packets
/// from elsewhere, a relay's, do not move it).
const DIRECT_EVERY: Duration = Duration::from_secs(1);
const DIRECT_STALE: Duration = Duration::from_secs(5);
/// Handshake messages per second the device answers before it asks for
/// cookies (boringtun's device's figure).
const HANDSHAKE_RATE_LIMIT: u64 = 100;
/// A UDP GSO send: the datagrams of one call, at most 64 KiB in all.
const MAX_SEND: usize = 65_000;
/// The largest datagram the device sends: a full packet plus WireGuard's
/// header, tag and padding.
const MAX_DATAGRAM: usize = MAX_PACKET + 64;
/// A receive slot: a datagram, or a GRO run of them.
const SLOT: usize = 1 << 16;
/// What weft's endpoint discovery's datagrams start with (weft_common's
/// `discovery::MAGIC`): answers to the gateway's probes arrive at the
/// device's port too, and are neither WireGuard's nor refused.
pub const DISCOVERY_MAGIC: &[u8] = b"WEFTDSC1";

/// The interface's side of a device: packets to and from the host's
/// stack. Non-blocking; its descriptor is polled for reading and writing.
pub trait Tun: AsFd + Send + Sync {
    /// What it runs with.
    fn offloads(&self) -> TunOffloads;
    /// One packet (with the virtio-net header, if `offloads().vnet_hdr`);
    /// `WouldBlock` when none waits.
    fn read(&self, buf: &mut [u8]) -> std::io::Result<usize>;
    /// One packet, as [`Tun::read`] gives them.
    fn write(&self, buf: &[u8]) -> std::io::Result<usize>;
}

/// The network's side of a device: datagrams to and from peers.
/// Non-blocking; its descriptor is polled for reading.
pub trait Bind: AsFd + Send + Sync {
    /// Datagrams into `bufs`, one buffer per sender's run (`meta[i].stride`
    /// apart when several), senders' addresses as weft names them (IPv4
    /// as IPv4); `WouldBlock` when none waits.
    fn recv(&self, bufs: &mut [IoSliceMut<'_>], meta: &mut [RecvMeta]) -> std::io::Result<usize>;
    /// Sends `data`, datagrams of `stride` bytes (the last may be
    /// shorter), to `to`; false when they were not all taken.
    fn send(&self, to: SocketAddr, data: &[u8], stride: usize) -> bool;
    /// Datagrams one [`Bind::send`] may carry now (1: no GSO).
    fn max_gso_segments(&self) -> usize;
    /// Datagrams one receive may join (1: no GRO).
    fn gro_segments(&self) -> usize;
    /// Sends one datagram with IP TTL (IPv6: hop limit) `ttl`.
    fn send_ttl(&self, to: SocketAddr, data: &[u8], ttl: u8) -> bool;
}

/// Which offloads a tun runs with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TunOffloads {
    /// The virtio-net header is on every packet (needed for any of the
    /// others, and to write joined packets).
    pub vnet_hdr: bool,
    pub tso: bool,
    pub uso: bool,
}

/// The kernel offloads a device runs with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Offloads {
    /// The tun hands over TCP super-packets (TSO4/6, with checksum
    /// offload).
    pub tso: bool,
    /// The same for UDP (USO4/6, Linux 6.2+).
    pub uso: bool,
    /// Datagrams per UDP send (1: no GSO).
    pub udp_gso_segments: usize,
    /// Datagrams per UDP receive slot (1: no GRO).
    pub udp_gro_segments: usize,
}

impl Offloads {
    /// The offloads in use, by name ("tso", "uso", "gso", "gro").
    pub fn names(&self) -> Vec<&'static str> {
        [
            (self.tso, "tso"),
            (self.uso, "uso"),
            (self.udp_gso_segments > 1, "gso"),
            (self.udp_gro_segments > 1, "gro"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect()
    }
}

/// What a device was started with.
#[derive(Clone, Debug)]
pub struct Config {
    pub name: String,
    pub listen_port: u16,
    pub private_key: [u8; 32],
    /// Ask the kernel for offloads (off: a packet per system call).
    pub offload: bool,
    /// Start a new handshake once a session is this old, besides the
    /// protocol's own timers (2 min): for tests of rekeying.
    pub rekey_after: Option<Duration>,
    /// Both directions on one thread instead of one each (level or slower
    /// on 2 cores, docs/benchmarks.md; kept for that comparison).
    pub single_thread: bool,
    /// The TTL (IPv6: hop limit) of the handshakes a hole-punched peer
    /// ([`Device::set_peer_punched`]) is sent first, for [`PRIME_FOR`] or
    /// until it is heard: enough to pass this side's NAT (opening its
    /// mapping), too little to reach the peer's, so that neither NAT sees
    /// the other's first datagram before its own went out. A NAT without a
    /// firewall delivers such an early datagram to itself and keeps a
    /// conntrack entry for it, and then maps this side's port elsewhere.
    /// 0: every handshake at the full TTL.
    pub punch_ttl: u8,
    /// For tests of recovery: a directory where a file named after the
    /// device makes its receiving thread panic once (the file is removed
    /// first). None (always, but in tests): nothing is looked at.
    pub panic_dir: Option<std::path::PathBuf>,
    /// Called when the device dies (a thread panicked), so its owner can
    /// make it anew at once instead of at its next look.
    pub on_death: Option<OnDeath>,
}

/// What a device calls when it dies.
#[derive(Clone)]
pub struct OnDeath(pub Arc<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for OnDeath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnDeath")
    }
}

/// What the device refused or could not do, by cause.
#[derive(Default, Debug)]
pub struct Counters {
    /// Datagrams that are no WireGuard message, or whose MAC is wrong.
    pub rx_invalid: AtomicU64,
    /// Messages for no peer of this device (unknown key or index).
    pub rx_unknown_peer: AtomicU64,
    /// Data that failed authentication (a corrupted or forged datagram).
    pub rx_unauthenticated: AtomicU64,
    /// Data whose counter was seen already or is too old (a replay).
    pub rx_replayed: AtomicU64,
    /// Decrypted packets from an address outside the peer's allowed IPs.
    pub rx_bad_source: AtomicU64,
    /// Packets from the tun to an address no peer is allowed, or to a peer
    /// without an endpoint.
    pub tx_no_route: AtomicU64,
    /// Packets from the tun the device could not read (malformed offload).
    pub tx_malformed: AtomicU64,
    /// Datagrams the socket did not take.
    pub tx_send_failed: AtomicU64,
    /// Handshakes sent with the punch TTL ([`Config::punch_ttl`]): they
    /// open this side's NAT and go no further.
    pub tx_primed: AtomicU64,
    /// Decrypted packets the tun did not take.
    pub rx_write_failed: AtomicU64,
}

impl Counters {
    /// Everything refused on the way in.
    pub fn rx_rejected(&self) -> u64 {
        [
            &self.rx_invalid,
            &self.rx_unknown_peer,
            &self.rx_unauthenticated,
            &self.rx_replayed,
            &self.rx_bad_source,
        ]
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .sum()
    }
}

/// One peer as the device reports it.
#[derive(Clone, Debug, Default)]
pub struct PeerStats {
    pub public_key: [u8; 32],
    pub endpoint: Option<SocketAddr>,
    pub last_handshake: Option<SystemTime>,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
}

#[cfg(test)]
mod tests;
