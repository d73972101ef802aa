//! The controller's UDP reflector for endpoint discovery
//! (`weft_common::discovery`): on the gRPC listener's address and port, it
//! answers each well-formed probe with the address and port the probe came
//! from. Gateways of this site and of peered sites probe it from their
//! tunnels' ports to learn their NAT mappings.
//!
//! An answer is smaller than its probe and goes only to the probe's
//! source, from the address the probe was sent to: the reflector cannot be
//! used to amplify traffic toward anyone. Probes carry no credentials and
//! their sources can be forged, so the answers are budgeted (see
//! [`Budgets`]) in a way that a flood from forged sources cannot take the
//! answers of the gateways the controller knows: theirs are limited per
//! address only. What it ignores (malformed datagrams, probes over the
//! limits) is counted.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use weft_common::discovery;

/// Answers a second to sources the controller does not know as a
/// gateway's (a new gateway's first probes, before its address is
/// recorded), over all of them.
pub const ANSWERS_PER_SECOND: u32 = 2000;

pub static ANSWERED: AtomicU64 = AtomicU64::new(0);
pub static IGNORED: AtomicU64 = AtomicU64::new(0);
pub static LIMITED: AtomicU64 = AtomicU64::new(0);

/// Answers a second per source address, known or not; the rest of a
/// source's probes in that second are dropped. One address can be a NAT
/// with several gateways behind it, each probing from every tunnel every
/// 5 s (100 peerings: 20 probes a second per gateway and reflector).
pub const ANSWERS_PER_SOURCE: u32 = 200;
/// Answers a second per source prefix (/24 for IPv4, /56 for IPv6) of
/// sources the controller does not know: forged sources from one network
/// cannot take the budget of every other network.
pub const ANSWERS_PER_PREFIX: u32 = 400;
/// Sources and prefixes tracked in a second, at most. Entries are made
/// only for answered probes, so the unknown ones stay under
/// [`ANSWERS_PER_SECOND`]; beyond, a prefix shares one more prefix budget
/// with every other untracked one.
const SOURCES: usize = 10_000;
const PREFIXES: usize = 4_096;

/// What the reflector may answer in the current second.
///
/// The addresses the controller knows as its gateways' and its peers'
/// gateways' (their underlay addresses, endpoints and the candidates their
/// discovery found, from the site's state) are limited per address only,
/// and are answered whatever else arrives. Every other source is limited
/// per address, per prefix, and all of them together: their budget is the
/// one a flood from forged sources can take.
pub struct Budgets {
    window: Instant,
    known: Arc<HashSet<IpAddr>>,
    per_source: HashMap<IpAddr, u32>,
    per_prefix: HashMap<IpAddr, u32>,
    /// The untracked prefixes' shared budget (the table full).
    overflow: u32,
    unknown: u32,
}

impl Budgets {
    pub fn new(now: Instant) -> Budgets {
        Budgets {
            window: now,
            known: Arc::default(),
            per_source: HashMap::new(),
            per_prefix: HashMap::new(),
            overflow: 0,
            unknown: 0,
        }
    }

    /// The addresses of the gateways the controller knows (IPv4-mapped
    /// IPv6 addresses are taken as IPv4).
    pub fn set_known(&mut self, known: Arc<HashSet<IpAddr>>) {
        self.known = known;
    }

    /// Whether a probe from `from` at `now` is answered (and counted).
    pub fn admit(&mut self, from: IpAddr, now: Instant) -> bool {
        let from = from.to_canonical();
        if now.saturating_duration_since(self.window) >= Duration::from_secs(1) {
            self.window = now;
            self.per_source.clear();
            self.per_prefix.clear();
            self.overflow = 0;
            self.unknown = 0;
        }
        let mine = self.per_source.get(&from).copied().unwrap_or(0);
        if mine >= ANSWERS_PER_SOURCE {
            return false;
        }
        if !self.known.contains(&from) {
            if self.unknown >= ANSWERS_PER_SECOND {
                return false;
            }
            let p = prefix(from);
            let tracked = self.per_prefix.len() < PREFIXES || self.per_prefix.contains_key(&p);
            let used = if tracked {
                self.per_prefix.get(&p).copied().unwrap_or(0)
            } else {
                self.overflow
            };
            if used >= ANSWERS_PER_PREFIX {
                return false;
            }
            if tracked {
                self.per_prefix.insert(p, used + 1);
            } else {
                self.overflow += 1;
            }
            self.unknown += 1;
        }
        if self.per_source.len() < SOURCES || self.per_source.contains_key(&from) {
            self.per_source.insert(from, mine + 1);
        }
        true
    }
}

/// The prefix a source's address is budgeted in: its /24 (IPv4) or /56
/// (IPv6), the smallest networks commonly handed to one customer.
pub fn prefix(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V4(v4) => IpAddr::V4(Ipv4Addr::from(u32::from(v4) & 0xffff_ff00)),
        IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !((1u128 << 72) - 1))),
    }
}

/// The addresses gateways probe from, as this controller knows them from
/// its site's state: its own gateways' underlay addresses, endpoints and
/// discovered candidates, and its peers' gateways' endpoints and
/// candidates.
pub fn known(model: &crate::render::Model) -> HashSet<IpAddr> {
    let mut out = HashSet::new();
    for g in model.gateways.values() {
        out.extend(g.endpoint.map(|e| e.ip()));
        out.extend(g.underlay_ip);
        for d in g.discovered.values() {
            out.extend(d.candidates.iter().map(|c| c.address.ip()));
        }
    }
    for p in model.peerings.values() {
        for g in p.remote.iter().flat_map(|r| &r.gateways) {
            out.extend(g.endpoint.map(|e| e.ip()));
            out.extend(g.candidates.iter().map(|c| c.address.ip()));
        }
    }
    out.into_iter().map(|ip| ip.to_canonical()).collect()
}

/// How often the reflector asks for the known addresses again.
const REFRESH: Duration = Duration::from_secs(1);

/// The running reflector; its thread ends when dropped.
pub struct Reflector {
    stop: Arc<AtomicBool>,
}

impl Drop for Reflector {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The known gateways' addresses, when they changed since the last call
/// (called about once a second, on the reflector's thread).
pub type Known = Box<dyn FnMut() -> Option<Arc<HashSet<IpAddr>>> + Send>;

/// Binds UDP `addr` and answers probes on a thread of its own; None
/// (logged) when the port cannot be bound: discovery through this
/// controller is then off, and nothing else is affected.
pub fn start(addr: SocketAddr, known: Known) -> Option<Reflector> {
    let bound = UdpSocket::bind(addr).and_then(|s| {
        // quinn-udp makes it non-blocking, and it must stay so: an answer
        // to a forged source that no neighbour answers for waits in the
        // kernel for address resolution, holding the socket's send buffer,
        // and a blocking send would then stop the reflector for everyone.
        // The thread waits for probes in poll(2) instead (with a timeout
        // to look at `stop`), never spinning on WouldBlock.
        let state = quinn_udp::UdpSocketState::new((&s).into())?;
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
        .spawn(move || serve(&socket, &state, &s, known));
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no endpoint discovery reflector");
        return None;
    }
    tracing::info!(%addr, "endpoint discovery reflector on UDP");
    Some(Reflector { stop })
}

/// Answers probes until `stop`: each from the address it was sent to (a
/// host with several addresses must answer from the one the gateway's NAT
/// expects), within the budgets.
fn serve(socket: &UdpSocket, state: &quinn_udp::UdpSocketState, stop: &AtomicBool, mut known: Known) {
    let mut buf = [0u8; 1500];
    let mut meta = [quinn_udp::RecvMeta::default()];
    let mut budgets = Budgets::new(Instant::now());
    let mut refreshed: Option<Instant> = None;
    while !stop.load(Ordering::Relaxed) {
        if refreshed.is_none_or(|at| at.elapsed() >= REFRESH) {
            if let Some(k) = known() {
                budgets.set_known(k);
            }
            refreshed = Some(Instant::now());
        }
        let n = {
            let mut bufs = [std::io::IoSliceMut::new(&mut buf)];
            match state.recv(socket.into(), &mut bufs, &mut meta) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let mut fds = [nix::poll::PollFd::new(socket.as_fd(), nix::poll::PollFlags::POLLIN)];
                    let _ = nix::poll::poll(&mut fds, 200u16);
                    continue;
                }
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
        let Some(nonce) = discovery::parse_probe(&buf[..m.len.min(buf.len())]) else {
            IGNORED.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        if !budgets.admit(from.ip(), Instant::now()) {
            LIMITED.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let answer = discovery::answer(&nonce, from);
        let t = quinn_udp::Transmit {
            destination: m.addr,
            ecn: None,
            contents: &answer,
            segment_size: None,
            src_ip: m.dst_ip,
        };
        // Never waits: with the send buffer full, the answer is dropped.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// Probes from each of `sources` in turn, `rounds` times; how many of
    /// `who`'s were answered.
    fn flood(b: &mut Budgets, now: Instant, sources: &[IpAddr], rounds: usize, who: IpAddr) -> u32 {
        let mut theirs = 0;
        for _ in 0..rounds {
            for s in sources {
                b.admit(*s, now);
            }
            theirs += u32::from(b.admit(who, now));
        }
        theirs
    }

    #[test]
    fn a_forged_flood_cannot_take_a_known_gateways_answers() {
        let now = Instant::now();
        let mut b = Budgets::new(now);
        let gw = ip("203.0.113.30");
        b.set_known(Arc::new([gw].into_iter().collect()));
        // Forged sources from everywhere, far over every budget.
        let forged: Vec<IpAddr> = (0..64u32)
            .map(|i| IpAddr::V4(Ipv4Addr::from(0x0a00_0001 + (i << 8))))
            .collect();
        assert_eq!(
            flood(&mut b, now, &forged, 100, gw),
            100,
            "the gateway is answered every time"
        );
        assert_eq!(b.unknown, ANSWERS_PER_SECOND, "the others' budget is all taken");
        // Still limited per address: forging the gateway's own address
        // gets no more than its share.
        let answered = (0..1000).filter(|_| b.admit(gw, now)).count();
        assert_eq!(answered as u32, ANSWERS_PER_SOURCE - 100);
        // A new second, a new budget.
        let later = now + Duration::from_secs(1);
        assert!(b.admit(ip("10.9.9.9"), later));
    }

    #[test]
    fn forged_sources_in_one_network_take_only_that_networks_budget() {
        let now = Instant::now();
        let mut b = Budgets::new(now);
        let forged: Vec<IpAddr> = (1..=50u8).map(|i| IpAddr::V4(Ipv4Addr::new(198, 51, 100, i))).collect();
        let elsewhere = ip("192.0.2.7");
        assert_eq!(
            flood(&mut b, now, &forged, 20, elsewhere),
            20,
            "another network is answered"
        );
        // Another address of the flooded /24 is not.
        assert!(!b.admit(ip("198.51.100.200"), now));
        assert_eq!(b.per_prefix[&ip("198.51.100.0")], ANSWERS_PER_PREFIX);
        // One source alone: its own limit first.
        let mut b = Budgets::new(now);
        let answered = (0..1000).filter(|_| b.admit(ip("192.0.2.1"), now)).count();
        assert_eq!(answered as u32, ANSWERS_PER_SOURCE);
    }

    #[test]
    fn the_tables_stay_bounded() {
        let now = Instant::now();
        let mut b = Budgets::new(now);
        // Every probe from another /24: the global budget ends it.
        let mut answered = 0u32;
        for i in 0..100_000u32 {
            answered += u32::from(b.admit(IpAddr::V4(Ipv4Addr::from(0x0b00_0000 + (i << 8))), now));
        }
        assert_eq!(answered, ANSWERS_PER_SECOND);
        assert!(b.per_prefix.len() <= PREFIXES && b.per_source.len() <= SOURCES);
    }

    #[test]
    fn prefixes_are_a_customers_network() {
        assert_eq!(prefix(ip("198.51.100.77")), ip("198.51.100.0"));
        assert_eq!(prefix(ip("::ffff:198.51.100.77")), ip("198.51.100.0"));
        assert_eq!(prefix(ip("2001:db8:1234:56ff:1::1")), ip("2001:db8:1234:5600::"));
    }
}
