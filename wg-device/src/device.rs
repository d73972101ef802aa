//! A running device: its state shared by its threads, the threads
//! (one per direction, or one for both), and what its owner calls.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Instant, SystemTime};

use defguard_boringtun::noise::rate_limiter::RateLimiter;
use defguard_boringtun::noise::{Tunn, TunnResult};
use defguard_boringtun::x25519::{PublicKey, StaticSecret};
use ipnet::IpNet;

use crate::conn::UdpBind;
use crate::peers::{Beside, Peer, Peers, first_index};
use crate::receive::In;
use crate::send::{self, Out};
use crate::shared::{Shared, wait};
use crate::tun::KernelTun;
use crate::{Bind, Config, Counters, EAGER_FOR, HANDSHAKE_RATE_LIMIT, Offloads, PRIME_FOR, PeerStats, Tun};

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

impl Device {
    /// Opens the tun `config.name` and the UDP socket on
    /// `config.listen_port` in the caller's network namespace and starts
    /// the device.
    pub fn start(config: &Config) -> std::io::Result<Device> {
        let tun = KernelTun::create(&config.name, config.offload)?;
        let bind = UdpBind::bind(config.listen_port)?;
        Device::new(config, Box::new(tun), Box::new(bind))
    }

    /// Starts the device on `tun` and `bind` (`config.name` and
    /// `config.listen_port` only name it).
    pub fn new(config: &Config, tun: Box<dyn Tun>, bind: Box<dyn Bind>) -> std::io::Result<Device> {
        let tun_offloads = tun.offloads();
        let (gso, gro) = if config.offload {
            (bind.max_gso_segments().max(1), bind.gro_segments().max(1))
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
            on_death: config.on_death.clone(),
            punch_ttl: config.punch_ttl,
            vnet_hdr: tun_offloads.vnet_hdr,
            tun,
            bind,
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
            &[("io", both)]
        } else {
            &[("out", outbound), ("in", inbound)]
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
                        // anew (`Config::on_death`) and reports it.
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
                            if let Some(f) = &s.on_death {
                                (f.0)();
                            }
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
        self.put_peer(public_key, endpoint, allowed, keepalive, false, None);
    }

    /// [`Device::set_peer`] for a peer reached through a relay at
    /// `endpoint` while a direct path to `direct` is tried beside it (both
    /// sides behind NAT or a firewall that a hole punch may open): once
    /// its session is up, a keepalive of it goes to `direct` every
    /// [`crate::DIRECT_EVERY`] (with [`Config::punch_ttl`] for the first
    /// [`PRIME_FOR`]); once the peer is heard from there, it is sent
    /// there, and stays there while it is heard from (the relay's path
    /// stays ready: silent for [`crate::DIRECT_STALE`], the peer may roam
    /// back).
    /// Traffic flows through the relay meanwhile: nothing waits for the
    /// punch, and the move loses nothing.
    pub fn set_peer_beside(
        &self,
        public_key: [u8; 32],
        endpoint: SocketAddr,
        direct: SocketAddr,
        allowed: Vec<IpNet>,
        keepalive: u16,
    ) {
        self.put_peer(public_key, Some(endpoint), allowed, keepalive, false, Some(direct));
    }

    /// [`Device::set_peer`] for an endpoint that is to be hole-punched
    /// (both sides behind NAT): a new endpoint's handshakes go with
    /// [`Config::punch_ttl`] first (see there).
    pub fn set_peer_punched(
        &self,
        public_key: [u8; 32],
        endpoint: Option<SocketAddr>,
        allowed: Vec<IpNet>,
        keepalive: u16,
    ) {
        self.put_peer(public_key, endpoint, allowed, keepalive, true, None);
    }

    fn put_peer(
        &self,
        public_key: [u8; 32],
        endpoint: Option<SocketAddr>,
        allowed: Vec<IpNet>,
        keepalive: u16,
        punch: bool,
        direct: Option<SocketAddr>,
    ) {
        let mut peers = self.shared.peers.write().unwrap_or_else(|e| e.into_inner());
        // Where it already is (configured so, or roamed there: a NAT's
        // mapping the controller learned after the tunnel did, or the
        // direct path tried beside a relay, now configured as the
        // endpoint) keeps the session, unprimed.
        if let Some(p) = peers.by_key.get(&public_key)
            && p.keepalive == keepalive
            && (endpoint.is_none() || endpoint == p.configured() || endpoint == p.endpoint())
        {
            *p.allowed.write().unwrap_or_else(|e| e.into_inner()) = allowed;
            let was = p.configured();
            // What it is configured with now: a later change is measured
            // from it (a relay taken again after the direct path it moved
            // to died is a new endpoint, not the one of long ago).
            if endpoint.is_some() {
                *p.configured.lock().unwrap_or_else(|e| e.into_inner()) = endpoint;
            }
            let mut b = p.beside();
            // The direct path tried beside a relay, now configured as the
            // endpoint (this side let the relay go), stays preferred over
            // that relay while it is heard from: a packet the other side
            // still sends through the relay (its own relay not let go yet,
            // a new session of its) does not move this side back there.
            let now_the_endpoint = direct.is_none() && endpoint.is_some() && b.direct == endpoint;
            if now_the_endpoint {
                if b.left.is_none() {
                    b.left = was.filter(|c| Some(*c) != endpoint);
                }
            } else if b.direct != direct {
                *b = Beside::new(direct);
            }
            drop(b);
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
            configured: Mutex::new(endpoint),
            tunn: Mutex::new(tunn),
            endpoint: Mutex::new(endpoint),
            allowed: RwLock::new(allowed),
            eager: Mutex::new(endpoint.map(|_| {
                let now = Instant::now();
                (now + EAGER_FOR, now)
            })),
            priming: Mutex::new(
                (punch && endpoint.is_some() && self.shared.punch_ttl > 0).then(|| Instant::now() + PRIME_FOR),
            ),
            beside: Mutex::new(Beside::new(direct)),
        });
        peers.by_index.insert(index, peer.clone());
        peers.by_key.insert(public_key, peer.clone());
        peers.reroute();
        drop(peers);
        if let Some(to) = endpoint {
            let mut buf = [0u8; 256];
            if let TunnResult::WriteToNetwork(p) = peer.tunn().format_handshake_initiation(&mut buf, false) {
                let n = p.len();
                send::to_peer(&self.shared, &peer, to, &buf[..n]);
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

/// The `out` thread.
fn outbound(s: &Shared) {
    let mut out = Out::new(s);
    while !s.stop.load(Ordering::Relaxed) {
        if !out.step(s) {
            wait(s, true, false);
        }
    }
}

/// The `in` thread.
fn inbound(s: &Shared) {
    let mut inb = In::new(s);
    while !s.stop.load(Ordering::Relaxed) {
        inb.tick(s);
        if !inb.step(s) {
            wait(s, false, true);
        }
    }
}

/// Both directions on one thread (`Config::single_thread`).
fn both(s: &Shared) {
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
