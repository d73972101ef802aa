//! A device's peers: each one's protocol state (boringtun's `Tunn`), its
//! endpoint and allowed IPs, found by public key, by session index, and
//! by destination (one route table over every peer's allowed IPs).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use defguard_boringtun::noise::Tunn;
use ip_network::IpNetwork;
use ip_network_table::IpNetworkTable;
use ipnet::IpNet;

/// A peer of a device.
pub(crate) struct Peer {
    pub(crate) index: u32,
    pub(crate) keepalive: u16,
    /// The endpoint it was configured with (the current one may have
    /// roamed since).
    pub(crate) configured: Mutex<Option<SocketAddr>>,
    pub(crate) tunn: Mutex<Tunn>,
    pub(crate) endpoint: Mutex<Option<SocketAddr>>,
    pub(crate) allowed: RwLock<Vec<IpNet>>,
    /// While handshakes to a new endpoint are eager: until when, and when
    /// the last initiation went (`crate::EAGER_FOR`).
    pub(crate) eager: Mutex<Option<(Instant, Instant)>>,
    /// Until when its handshakes leave with the punch TTL (a hole-punched
    /// endpoint not heard from yet, `crate::PRIME_FOR`).
    pub(crate) priming: Mutex<Option<Instant>>,
    /// A direct path tried beside the endpoint (a relay), and how far.
    pub(crate) beside: Mutex<Beside>,
}

/// A direct address tried beside a peer's endpoint: the peer moves there
/// once it is heard from there, and stays while it is.
#[derive(Debug, Default)]
pub(crate) struct Beside {
    pub(crate) direct: Option<SocketAddr>,
    /// When an authenticated packet last came from it.
    pub(crate) heard: Option<Instant>,
    /// When the next keepalive goes to it.
    pub(crate) next: Option<Instant>,
    /// Until when those keepalives leave with the punch TTL.
    pub(crate) priming: Option<Instant>,
    /// The relay this side let go of, the direct path now its configured
    /// endpoint: while that path is heard from, packets from the relay do
    /// not move the peer back (other sources still do: a NAT that mapped
    /// the peer anew). None while the relay is the endpoint: then nothing
    /// else moves it off a fresh direct path.
    pub(crate) left: Option<SocketAddr>,
}

impl Beside {
    pub(crate) fn new(direct: Option<SocketAddr>) -> Beside {
        Beside {
            direct,
            ..Default::default()
        }
    }

    /// The direct address was heard from within [`crate::DIRECT_STALE`].
    pub(crate) fn fresh(&self, now: Instant) -> bool {
        self.heard
            .is_some_and(|at| now.duration_since(at) < crate::DIRECT_STALE)
    }
}

impl Peer {
    pub(crate) fn endpoint(&self) -> Option<SocketAddr> {
        *self.endpoint.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn configured(&self) -> Option<SocketAddr> {
        *self.configured.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn tunn(&self) -> std::sync::MutexGuard<'_, Tunn> {
        self.tunn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether what goes to it now leaves with the punch TTL.
    pub(crate) fn priming(&self) -> bool {
        let mut p = self.priming.lock().unwrap_or_else(|e| e.into_inner());
        if p.is_some_and(|until| Instant::now() >= until) {
            *p = None;
        }
        p.is_some()
    }

    /// It was heard from: its side's NAT is open, so ours may be reached.
    pub(crate) fn heard(&self) {
        *self.priming.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    pub(crate) fn beside(&self) -> std::sync::MutexGuard<'_, Beside> {
        self.beside.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where what goes to the endpoint `to` also goes, beside it: the
    /// direct address, while the peer is not there; and whether with the
    /// punch TTL (for [`crate::PRIME_FOR`] from the first, when
    /// `punch_ttl` is set).
    pub(crate) fn beside_target(&self, to: Option<SocketAddr>, punch_ttl: u8) -> Option<(SocketAddr, bool)> {
        let mut b = self.beside();
        let direct = b.direct.filter(|d| to != Some(*d))?;
        let now = Instant::now();
        if b.priming.is_none() && punch_ttl > 0 {
            b.priming = Some(now + crate::PRIME_FOR);
        }
        Some((direct, b.priming.is_some_and(|until| now < until)))
    }

    /// An authenticated packet came from `from`: the peer is there
    /// (roaming), unless it is on its direct path, heard from recently,
    /// and `from` is the relay (or, beside a relay, anywhere else): then it
    /// stays direct.
    pub(crate) fn authenticated_from(&self, from: SocketAddr) {
        let now = Instant::now();
        {
            let mut b = self.beside();
            if b.direct == Some(from) {
                b.heard = Some(now);
            } else if b.direct.is_some() && b.fresh(now) && b.left.is_none_or(|relay| relay == from) {
                return;
            }
        }
        let mut at = self.endpoint.lock().unwrap_or_else(|e| e.into_inner());
        if *at != Some(from) {
            *at = Some(from);
        }
    }
}

pub(crate) struct Peers {
    pub(crate) by_key: HashMap<[u8; 32], Arc<Peer>>,
    pub(crate) by_index: HashMap<u32, Arc<Peer>>,
    /// Every peer's allowed IPs, longest prefix first: one lookup per
    /// packet whatever their number (a transit hub gives a spoke
    /// thousands).
    pub(crate) routes: IpNetworkTable<Arc<Peer>>,
    pub(crate) next_index: u32,
}

/// A random first peer index (24 bits; boringtun counts handshakes in
/// the low 8).
pub(crate) fn first_index() -> u32 {
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
    pub(crate) fn route(&self, dst: IpAddr) -> Option<Arc<Peer>> {
        self.routes.longest_match(dst).map(|(_, p)| p.clone())
    }

    /// The routes again from every peer's allowed IPs (after a change): a
    /// network two peers list goes to one of them, as kernel WireGuard
    /// gives it to the peer that set it last.
    pub(crate) fn reroute(&mut self) {
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

/// The per-packet cost of finding a packet's peer, measured by the
/// `route_bench` example (docs/benchmarks.md): the route table against the
/// scan of every network it replaced.
#[doc(hidden)]
pub mod route_bench {
    use super::*;
    use defguard_boringtun::x25519::{PublicKey, StaticSecret};

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
                configured: Mutex::new(None),
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
                eager: Mutex::new(None),
                priming: Mutex::new(None),
                beside: Mutex::new(Beside::default()),
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
