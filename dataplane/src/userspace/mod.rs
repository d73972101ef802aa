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
//! refused is counted (`Stats::rx_rejected`) and goes no further.

mod devices;
mod io;
pub mod packet;
pub mod tun;

pub(crate) use devices::move_into;
pub use devices::{Devices, Options, Running};

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use defguard_boringtun::noise::rate_limiter::RateLimiter;
use defguard_boringtun::noise::{Tunn, TunnResult};
use defguard_boringtun::x25519::{PublicKey, StaticSecret};
use ip_network::IpNetwork;
use ip_network_table::IpNetworkTable;
use ipnet::IpNet;
use quinn_udp::UdpSocketState;

use self::packet::MAX_PACKET;
use self::tun::Tun;

/// How often a waiting thread looks at the stop flag, and the timers run.
const TICK_MS: u16 = 100;
const TIMER_EVERY: Duration = Duration::from_millis(250);
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
/// What endpoint discovery's datagrams start with (weft_common's
/// `discovery::MAGIC`): answers to the gateway's probes arrive at the
/// device's port too.
pub const DISCOVERY_MAGIC: &[u8] = b"WEFTDSC1";

pub use crate::host::Offloads;

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
    /// See [`Options::panic_dir`].
    pub panic_dir: Option<std::path::PathBuf>,
}

/// A peer of a device.
struct Peer {
    index: u32,
    keepalive: u16,
    /// The endpoint it was configured with (the current one may have
    /// roamed since).
    configured: Option<SocketAddr>,
    tunn: Mutex<Tunn>,
    endpoint: Mutex<Option<SocketAddr>>,
    allowed: RwLock<Vec<IpNet>>,
}

impl Peer {
    fn endpoint(&self) -> Option<SocketAddr> {
        *self.endpoint.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn tunn(&self) -> std::sync::MutexGuard<'_, Tunn> {
        self.tunn.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct Peers {
    by_key: HashMap<[u8; 32], Arc<Peer>>,
    by_index: HashMap<u32, Arc<Peer>>,
    /// Every peer's allowed IPs, longest prefix first: one lookup per
    /// packet whatever their number (a transit hub gives a spoke
    /// thousands).
    routes: IpNetworkTable<Arc<Peer>>,
    next_index: u32,
}

/// Signalled when a device dies (a thread panicked): the agent repairs at
/// once instead of at its next resync.
pub fn deaths() -> &'static tokio::sync::Notify {
    static DEATHS: std::sync::OnceLock<tokio::sync::Notify> = std::sync::OnceLock::new();
    DEATHS.get_or_init(tokio::sync::Notify::new)
}

/// The fault-injection hook the end-to-end tests use to kill a device
/// thread: with [`Options::panic_dir`] set, a file there named after a
/// device makes that device's receiving thread panic once (the file is
/// removed first). Unset (always, but in tests), nothing is looked at.
fn injected_panic(s: &Shared) {
    if let Some(dir) = &s.panic_dir {
        let file = dir.join(&s.name);
        if std::fs::remove_file(&file).is_ok() {
            panic!("injected by {} (a test)", file.display());
        }
    }
}

/// A random first peer index (24 bits; boringtun counts handshakes in
/// the low 8).
fn first_index() -> u32 {
    let mut b = [0u8; 4];
    if getrandom::getrandom(&mut b).is_err() {
        // No entropy at all: the process id, as before.
        return 1 + (std::process::id() & 0xffff) * 7;
    }
    u32::from_le_bytes(b)
}

impl Default for Peers {
    fn default() -> Self {
        Peers {
            by_key: HashMap::new(),
            by_index: HashMap::new(),
            routes: IpNetworkTable::new(),
            next_index: 0,
        }
    }
}

impl Peers {
    /// The peer whose allowed IPs hold `dst` most narrowly.
    fn route(&self, dst: IpAddr) -> Option<Arc<Peer>> {
        self.routes.longest_match(dst).map(|(_, p)| p.clone())
    }

    /// The routes again from every peer's allowed IPs (after a change): a
    /// network two peers list goes to one of them, as kernel WireGuard
    /// gives it to the peer that set it last.
    fn reroute(&mut self) {
        let mut routes = IpNetworkTable::new();
        for p in self.by_key.values() {
            for n in p.allowed.read().unwrap_or_else(|e| e.into_inner()).iter() {
                if let Ok(net) = IpNetwork::new_truncate(n.addr(), n.prefix_len()) {
                    routes.insert(net, p.clone());
                }
            }
        }
        self.routes = routes;
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

struct Shared {
    stop: AtomicBool,
    /// Why a thread of the device ended by panicking (the other is then
    /// stopped too): the device is dead and must be made anew.
    died: Mutex<Option<String>>,
    /// The device's interface name.
    name: String,
    /// See [`Options::panic_dir`].
    panic_dir: Option<std::path::PathBuf>,
    tun: Tun,
    socket: UdpSocket,
    udp: UdpSocketState,
    /// The socket takes both families (IPv4 peers as IPv4-mapped IPv6).
    dual: bool,
    secret: StaticSecret,
    public: PublicKey,
    limiter: Arc<RateLimiter>,
    /// The peers' state machines' own limiter, never under load: the
    /// device's has checked (and counted) each message before it reaches
    /// one. Sharing the device's would count it twice, and a peer's state
    /// machine could then answer a valid handshake with a cookie.
    unlimited: Arc<RateLimiter>,
    peers: RwLock<Peers>,
    counters: Counters,
    offloads: Offloads,
    rekey_after: Option<Duration>,
}

impl Shared {
    fn peers(&self) -> std::sync::RwLockReadGuard<'_, Peers> {
        self.peers.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Datagrams per UDP send now: quinn-udp drops to 1 when the kernel
    /// refuses a segmented send (EIO, EINVAL).
    fn gso_segments(&self) -> usize {
        if self.offloads.udp_gso_segments > 1 {
            self.udp.max_gso_segments().max(1)
        } else {
            1
        }
    }
}

/// A running device: its tun in the caller's namespace (to be moved), its
/// UDP socket bound there, two threads. Dropping it stops the threads and
/// closes the tun, which removes the interface.
pub struct Device {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Drop for Device {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
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

impl Device {
    /// Opens the tun `config.name` and the UDP socket on
    /// `config.listen_port` in the caller's network namespace and starts
    /// the device.
    pub fn start(config: &Config) -> std::io::Result<Device> {
        let tun = Tun::create(&config.name, config.offload)?;
        let tun_offloads = tun.offloads;
        let (socket, udp, dual) = crate::udp::dual_batch_socket(config.listen_port)?;
        let (gso, gro) = if config.offload {
            (udp.max_gso_segments().max(1), udp.gro_segments().max(1))
        } else {
            (1, 1)
        };
        let secret = StaticSecret::from(config.private_key);
        let public = PublicKey::from(&secret);
        let limiter = Arc::new(RateLimiter::new(&public, HANDSHAKE_RATE_LIMIT));
        let unlimited = Arc::new(RateLimiter::new(&public, u64::MAX));
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            died: Mutex::new(None),
            name: config.name.clone(),
            panic_dir: config.panic_dir.clone(),
            tun,
            socket,
            udp,
            dual,
            secret,
            public,
            limiter,
            unlimited,
            peers: RwLock::new(Peers {
                // Random: a peer's handshakes count up from its index, and
                // a relay between two gateways resolves an index two
                // senders used by learning neither (so a guessed one
                // would keep a tunnel through a relay from forming).
                next_index: first_index(),
                ..Default::default()
            }),
            counters: Counters::default(),
            offloads: Offloads {
                tso: tun_offloads.tso,
                uso: tun_offloads.uso,
                udp_gso_segments: gso,
                udp_gro_segments: gro,
            },
            rekey_after: config.rekey_after,
        });
        let mut threads = Vec::new();
        type Loop = (&'static str, fn(&Shared));
        let loops: &[Loop] = if config.single_thread {
            &[("io", io::both)]
        } else {
            &[("out", io::outbound), ("in", io::inbound)]
        };
        for &(name, f) in loops {
            let s = shared.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("wg-{name}-{}", config.name))
                    .spawn(move || {
                        // A panic (a bug) must not leave the tunnel dead
                        // and silent: the device is marked dead, its
                        // other thread stopped, and the agent makes it
                        // anew (`Devices::reap`) and reports it.
                        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&s)));
                        if let Err(p) = run {
                            let why = p
                                .downcast_ref::<&str>()
                                .map(|m| m.to_string())
                                .or_else(|| p.downcast_ref::<String>().cloned())
                                .unwrap_or_else(|| "a panic".into());
                            tracing::error!(
                                device = %s.name,
                                thread = name,
                                "a WireGuard device thread panicked: {why}; the device is stopped and made anew"
                            );
                            *s.died.lock().unwrap_or_else(|e| e.into_inner()) =
                                Some(format!("its {name} thread panicked: {why}"));
                            s.stop.store(true, Ordering::Relaxed);
                            deaths().notify_one();
                        }
                    })?,
            );
        }
        Ok(Device { shared, threads })
    }

    /// Why the device died (a thread panicked), if it did.
    pub fn died(&self) -> Option<String> {
        self.shared.died.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The offloads in use now (GSO can be dropped at run time).
    pub fn offloads(&self) -> Offloads {
        Offloads {
            udp_gso_segments: self.shared.gso_segments(),
            ..self.shared.offloads
        }
    }

    pub fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    /// Adds peer `public_key` or changes it: new allowed IPs keep its
    /// session; a new keepalive or a newly configured endpoint start a
    /// new one, with a handshake at once to that endpoint, as kernel
    /// WireGuard's peer removed and added again does on its first packet:
    /// a relay learns a side only from its handshake, and a hole punch
    /// must not wait for the protocol's 5 s retry of a handshake lost
    /// while the NATs were still closed.
    pub fn set_peer(&self, public_key: [u8; 32], endpoint: Option<SocketAddr>, allowed: Vec<IpNet>, keepalive: u16) {
        let mut peers = self.shared.peers.write().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = peers.by_key.get(&public_key)
            && p.keepalive == keepalive
            && (endpoint.is_none() || endpoint == p.configured)
        {
            *p.allowed.write().unwrap_or_else(|e| e.into_inner()) = allowed;
            peers.reroute();
            return;
        }
        if let Some(old) = peers.by_key.remove(&public_key) {
            peers.by_index.remove(&old.index);
        }
        let index = loop {
            let i = peers.next_index & 0x00ff_ffff;
            peers.next_index = peers.next_index.wrapping_add(1);
            if i != 0 && !peers.by_index.contains_key(&i) {
                break i;
            }
        };
        let tunn = Tunn::new(
            self.shared.secret.clone(),
            PublicKey::from(public_key),
            None,
            (keepalive > 0).then_some(keepalive),
            index,
            Some(self.shared.unlimited.clone()),
        );
        let peer = Arc::new(Peer {
            index,
            keepalive,
            configured: endpoint,
            tunn: Mutex::new(tunn),
            endpoint: Mutex::new(endpoint),
            allowed: RwLock::new(allowed),
        });
        peers.by_index.insert(index, peer.clone());
        peers.by_key.insert(public_key, peer.clone());
        peers.reroute();
        drop(peers);
        if let Some(to) = endpoint {
            let mut buf = [0u8; 256];
            if let TunnResult::WriteToNetwork(p) = peer.tunn().format_handshake_initiation(&mut buf, false) {
                let n = p.len();
                io::send(&self.shared, to, &buf[..n], n);
            }
        }
    }

    pub fn remove_peer(&self, public_key: &[u8; 32]) {
        let mut peers = self.shared.peers.write().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = peers.by_key.remove(public_key) {
            peers.by_index.remove(&old.index);
            peers.reroute();
        }
    }

    pub fn peers(&self) -> Vec<PeerStats> {
        let now = SystemTime::now();
        self.shared
            .peers()
            .by_key
            .iter()
            .map(|(k, p)| {
                let (since, tx, rx, _, _) = p.tunn().stats();
                PeerStats {
                    public_key: *k,
                    endpoint: p.endpoint(),
                    last_handshake: since.and_then(|d| now.checked_sub(d)),
                    rx_bytes: rx as u64,
                    tx_bytes: tx as u64,
                }
            })
            .collect()
    }
}

/// The per-packet cost of finding a packet's peer, measured by the
/// `route_bench` example (docs/benchmarks.md): the route table against the
/// scan of every network it replaced.
#[doc(hidden)]
pub mod route_bench {
    use super::*;

    /// The lookup the table replaced: every network of every peer.
    pub(super) fn linear(peers: &Peers, dst: IpAddr) -> Option<u32> {
        let mut best: Option<(u8, u32)> = None;
        for p in peers.by_key.values() {
            for n in p.allowed.read().unwrap_or_else(|e| e.into_inner()).iter() {
                if n.contains(&dst) && best.is_none_or(|(l, _)| n.prefix_len() > l) {
                    best = Some((n.prefix_len(), p.index));
                }
            }
        }
        best.map(|(_, i)| i)
    }

    /// `sites` peers (as a transit hub's spoke has), each with 33 networks
    /// of its own (a /16 and 31 /24s inside 10.0.0.0/8, and an IPv6 /48).
    pub(super) fn peers(sites: u32) -> Peers {
        let mut peers = Peers::default();
        for i in 0..sites {
            let key = [i as u8 + 1; 32];
            let mut allowed = vec![IpNet::new(IpAddr::from([10, i as u8, 0, 0]), 16).unwrap()];
            for j in 0..31u8 {
                allowed.push(IpNet::new(IpAddr::from([10, (i as u8).wrapping_add(1), j, 0]), 24).unwrap());
            }
            allowed.push(IpNet::new(IpAddr::from([0xfd00, i as u16, 0, 0, 0, 0, 0, 0]), 48).unwrap());
            let peer = Arc::new(Peer {
                index: i + 1,
                keepalive: 0,
                configured: None,
                tunn: Mutex::new(Tunn::new(
                    StaticSecret::from([9; 32]),
                    PublicKey::from(key),
                    None,
                    None,
                    i + 1,
                    None,
                )),
                endpoint: Mutex::new(None),
                allowed: RwLock::new(allowed),
            });
            peers.by_index.insert(i + 1, peer.clone());
            peers.by_key.insert(key, peer);
        }
        peers.reroute();
        peers
    }

    /// Addresses across the peers' space, both families, inside and
    /// outside every network.
    pub(super) fn addresses() -> Vec<IpAddr> {
        let mut out = Vec::new();
        let mut x: u32 = 0x1234_5678;
        for _ in 0..4096 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            out.push(IpAddr::from(((x & 0x00ff_ffff) | 0x0a00_0000).to_be_bytes()));
            out.push(IpAddr::from([0xfd00, (x >> 16) as u16 & 0x7f, x as u16, 0, 0, 0, 0, 1]));
        }
        out.push(IpAddr::from([192, 0, 2, 1]));
        out
    }

    /// For one network, one site's (33) and 64 sites' (2,112, as a
    /// transit hub may give a spoke): (networks, ns per lookup with the
    /// table, with the scan), each over `rounds` passes of 8,193
    /// addresses.
    pub fn run(rounds: u32) -> Vec<(usize, f64, f64)> {
        let addrs = addresses();
        let per = |t: std::time::Instant| t.elapsed().as_nanos() as f64 / (f64::from(rounds) * addrs.len() as f64);
        [(1, true), (1, false), (64, false)]
            .into_iter()
            .map(|(sites, one)| {
                let mut peers = peers(sites);
                if one {
                    for p in peers.by_key.values() {
                        p.allowed.write().unwrap_or_else(|e| e.into_inner()).truncate(1);
                    }
                    peers.reroute();
                }
                let networks = peers
                    .by_key
                    .values()
                    .map(|p| p.allowed.read().unwrap_or_else(|e| e.into_inner()).len())
                    .sum();
                let t = std::time::Instant::now();
                for _ in 0..rounds {
                    for a in &addrs {
                        std::hint::black_box(peers.route(std::hint::black_box(*a)));
                    }
                }
                let table = per(t);
                let t = std::time::Instant::now();
                for _ in 0..rounds {
                    for a in &addrs {
                        std::hint::black_box(linear(&peers, std::hint::black_box(*a)));
                    }
                }
                (networks, table, per(t))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::route_bench::{addresses, linear, peers};

    #[test]
    fn the_route_table_finds_the_peer_a_scan_of_every_network_finds() {
        for sites in [1, 64] {
            let peers = peers(sites);
            for a in addresses() {
                assert_eq!(
                    peers.route(a).map(|p| p.index),
                    linear(&peers, a),
                    "{a} with {sites} peers"
                );
            }
        }
        // The most specific network wins across peers, and a removed
        // peer's networks go with it.
        let mut peers = peers(2);
        let inside = std::net::IpAddr::from([10, 1, 5, 9]);
        assert_eq!(
            peers.route(inside).map(|p| p.index),
            Some(1),
            "peer 1's /24 over peer 2's /16"
        );
        let old = peers.by_key.remove(&[1u8; 32]).unwrap();
        peers.by_index.remove(&old.index);
        peers.reroute();
        assert_eq!(peers.route(inside).map(|p| p.index), Some(2));
    }
}
