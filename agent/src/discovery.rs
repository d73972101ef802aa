//! Endpoint discovery for a gateway's tunnels: where the outside sees each
//! tunnel's UDP socket, and how the gateway's NAT maps it.
//!
//! The probe must leave from the tunnel's own address and port, since the
//! NAT's mapping belongs to that socket, but the WireGuard device owns the
//! socket (the kernel module's or weft's own), and weft cannot send
//! through it. So the probe is written on a raw UDP socket with the
//! tunnel's port as its source port: to the host's routing, to the NAT and
//! to the reflector it is a datagram of the tunnel's socket. The answer
//! comes back to that port; the WireGuard device drops it (not a WireGuard
//! message), and the raw socket gets a copy, which a socket filter in the
//! kernel narrows to discovery datagrams (nothing of the tunnels' traffic
//! reaches the agent). One raw socket per family and one thread serve
//! every tunnel.
//!
//! Over IPv6 (reflectors at IPv6 addresses, a gateway with a global
//! address) it is the same, without NAT: a reflector outside the site
//! sees the gateway at its own address, which is then the candidate its
//! peers dial, so that both ends send at once and each end's stateful
//! firewall lets the other's datagrams in as answers (hole punching, as
//! through NAT). The kernel fills in the UDP checksum, which IPv6
//! requires (`IPV6_CHECKSUM`, RFC 3542).
//!
//! Every [`EVERY`] a round probes each reflector of a tunnel (the peer's
//! controllers, given in the desired state, and this agent's own), takes
//! only answers to that tunnel's port from the reflector probed carrying
//! the nonce sent (anything else is counted as ignored), and keeps the
//! candidates (the underlay address and each address seen from outside)
//! and the NAT behaviour they show.
//!
//! A reflector that does not answer tells nothing about the NAT (its
//! answers may have been lost, or a flood of forged probes may have taken
//! its budget), so a round that some reflector left unanswered does not
//! replace a result every reflector answered: only a complete round that
//! disagrees does, or an answer that the kept result does not explain (a
//! new outside address: the NAT's mapping changed). See [`replaces`].

use std::collections::HashMap;
use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, SocketAddrV6, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, SockAddr, SockFilter, Socket, Type};
use weft_common::discovery::{self, Behaviour, Nonce};
use weft_proto::v1 as pb;

/// Between two rounds once one was answered.
pub const EVERY: Duration = Duration::from_secs(5);
/// Between two rounds while none was (a new tunnel: its peer waits for the
/// candidates).
const RETRY: Duration = Duration::from_secs(1);
/// How long a round waits for its answers.
const WAIT: Duration = Duration::from_millis(800);
/// The most reflectors a round probes.
const MAX_REFLECTORS: usize = 8;
/// The longest the thread sleeps between looks at its work.
const TICK: Duration = Duration::from_millis(100);

/// What to discover for one tunnel: its port, where to ask, the host's
/// underlay address (a candidate of its own).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub port: u16,
    pub reflectors: Vec<String>,
    /// How many of `reflectors`, first, are this site's own (often inside
    /// its firewall: their answers do not show that UDP gets out).
    pub own: usize,
    pub underlay: Option<IpAddr>,
}

/// What the latest round of a tunnel found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Found {
    pub candidates: Vec<pb::Candidate>,
    pub nat: String,
}

/// What is kept for a tunnel: the result, and how it was found.
#[derive(Clone, Debug, PartialEq)]
struct Kept {
    found: Found,
    /// Every reflector probed answered.
    complete: bool,
    /// How many did.
    answers: usize,
}

/// The tunnels, by link name, and what was found for each.
#[derive(Default)]
struct Shared {
    targets: HashMap<String, Target>,
    found: HashMap<String, Kept>,
    /// When each tunnel's probes were last answered by a reflector outside
    /// the site (UDP goes out), and when a round of them last ended with no
    /// answer at all.
    answered: HashMap<String, Instant>,
    silent: HashMap<String, Instant>,
}

/// Whether a round's result (`new`, from `answers` answers, `complete`
/// when every reflector probed answered) replaces the one `kept` for the
/// tunnel. Each change is a store write and a resync of every peer of the
/// site, and a result that loses its reflexive candidates or its NAT
/// behaviour moves the tunnels to a relay or stops them: a missing answer
/// alone must never do that.
///
/// - Nothing kept (the first round, or the target changed): the round's
///   result, whatever it is.
/// - A complete round: its result, when it differs.
/// - An incomplete round after a complete one: kept, unless an answer
///   shows a candidate the kept result does not have (the mapping
///   changed; answers cannot be forged off the path, see the module).
/// - An incomplete round after an incomplete one: the one with more
///   answers, or the newer one with as many; or, as above, one that shows
///   a new candidate.
fn replaces(kept: Option<&Kept>, new: &Found, complete: bool, answers: usize) -> bool {
    let Some(k) = kept else {
        return true;
    };
    if k.found == *new {
        return false;
    }
    let unexplained = new.candidates.iter().any(|c| !k.found.candidates.contains(c));
    complete || unexplained || (!k.complete && answers >= k.answers)
}

/// Discovery for every tunnel of the agent; its thread ends when dropped.
pub struct Discovery {
    stop: Arc<AtomicBool>,
    shared: Arc<Mutex<Shared>>,
}

impl Drop for Discovery {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl Discovery {
    /// Opens the raw socket and starts the thread; `changed` is called when
    /// what was found for a tunnel changes (so the agent reports it at
    /// once).
    pub fn start(changed: impl Fn() + Send + 'static) -> Result<Discovery, String> {
        let sock = Sockets::open()?;
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Mutex::new(Shared::default()));
        let (s, sh) = (stop.clone(), shared.clone());
        std::thread::Builder::new()
            .name("weft-discovery".into())
            .spawn(move || run(&sock, &sh, &s, &changed))
            .map_err(|e| format!("cannot start endpoint discovery: {e}"))?;
        Ok(Discovery { stop, shared })
    }

    /// Discovers for tunnel `link` (a changed target starts over).
    pub fn set(&self, link: &str, t: Target) {
        let mut sh = self.shared.lock().unwrap();
        if sh.targets.get(link) != Some(&t) {
            sh.targets.insert(link.to_string(), t);
            sh.found.remove(link);
        }
    }

    /// Keeps only the tunnels `keep` says to.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        let mut sh = self.shared.lock().unwrap();
        sh.targets.retain(|l, _| keep(l));
        sh.found.retain(|l, _| keep(l));
        sh.answered.retain(|l, _| keep(l));
        sh.silent.retain(|l, _| keep(l));
    }

    /// When a probe of `link`'s was last answered from outside the site.
    pub fn answered(&self, link: &str) -> Option<Instant> {
        self.shared.lock().unwrap().answered.get(link).copied()
    }

    /// When a round of `link`'s probes last went wholly unanswered.
    pub fn silent(&self, link: &str) -> Option<Instant> {
        self.shared.lock().unwrap().silent.get(link).copied()
    }

    /// What the latest round for `link` found (none before the first).
    pub fn found(&self, link: &str) -> Option<Found> {
        self.shared.lock().unwrap().found.get(link).map(|k| k.found.clone())
    }
}

/// A round in flight for one tunnel.
struct Round {
    target: Target,
    sent: Vec<(SocketAddr, Nonce)>,
    /// The reflectors probed that are not the site's own.
    theirs: Vec<SocketAddr>,
    answers: Vec<Option<SocketAddr>>,
    deadline: Instant,
}

/// The thread: starts each tunnel's rounds when due, reads answers, ends
/// rounds, until `stop`.
fn run(sock: &Sockets, shared: &Mutex<Shared>, stop: &AtomicBool, changed: &dyn Fn()) {
    let m = crate::metrics::get();
    let mut rounds: HashMap<String, Round> = HashMap::new();
    let mut due: HashMap<String, Instant> = HashMap::new();
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        let targets: Vec<(String, Target)> = {
            let sh = shared.lock().unwrap();
            sh.targets.iter().map(|(l, t)| (l.clone(), t.clone())).collect()
        };
        rounds.retain(|l, r| targets.iter().any(|(k, t)| k == l && *t == r.target));
        due.retain(|l, _| targets.iter().any(|(k, _)| k == l));
        for (link, t) in &targets {
            if rounds.contains_key(link) || due.get(link).is_some_and(|d| *d > now) {
                continue;
            }
            rounds.insert(link.clone(), begin(sock, t));
        }
        let next = rounds.values().map(|r| r.deadline).min().unwrap_or(now + TICK);
        // At least 1 ms: a read timeout under a microsecond is none at all.
        let wait = next
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(1), TICK);
        if let Some((from, port, payload)) = sock.receive(wait) {
            let taken = discovery::parse_answer(&payload).and_then(|(nonce, seen)| {
                let (link, r) = rounds.iter_mut().find(|(_, r)| r.target.port == port)?;
                let i = r.sent.iter().position(|(at, n)| *at == from && *n == nonce)?;
                r.answers[i].is_none().then(|| {
                    r.answers[i] = Some(seen);
                    (link.clone(), r.theirs.contains(&from))
                })
            });
            match taken {
                Some((link, outside)) => {
                    if outside {
                        shared.lock().unwrap().answered.insert(link, Instant::now());
                    }
                    m.discovery("answered")
                }
                None => {
                    tracing::debug!(%from, port, "endpoint discovery: an answer not probed for, ignored");
                    m.discovery("ignored");
                }
            }
        }
        let now = Instant::now();
        let ended: Vec<String> = rounds
            .iter()
            .filter(|(_, r)| r.deadline <= now || r.answers.iter().all(Option::is_some))
            .map(|(l, _)| l.clone())
            .collect();
        for link in ended {
            let r = rounds.remove(&link).unwrap();
            for _ in r.answers.iter().filter(|a| a.is_none()) {
                m.discovery("unanswered");
            }
            let new = found(&r);
            let answered = new.nat != Behaviour::Unknown.as_str();
            // Spread over a second, so that a gateway's tunnels do not all
            // probe at once (each reflector limits answers per source).
            let jitter = Duration::from_millis(u64::from(r.sent.first().map_or(0, |(_, n)| n[0])) * 4);
            due.insert(link.clone(), now + jitter + if answered { EVERY } else { RETRY });
            let complete = r.answers.iter().all(Option::is_some);
            let answers = r.answers.iter().flatten().count();
            if answers == 0 && !r.sent.is_empty() {
                shared.lock().unwrap().silent.insert(link.clone(), now);
            }
            let differs = {
                let mut sh = shared.lock().unwrap();
                // Only for the target the round was for.
                if sh.targets.get(&link) != Some(&r.target) {
                    false
                } else if replaces(sh.found.get(&link), &new, complete, answers) {
                    tracing::info!(%link, port = r.target.port, nat = %new.nat, candidates = ?new.candidates, complete, "endpoint discovery");
                    sh.found.insert(
                        link,
                        Kept {
                            found: new,
                            complete,
                            answers,
                        },
                    );
                    true
                } else {
                    if let Some(k) = sh.found.get_mut(&link) {
                        if k.found == new && complete {
                            // The same, now confirmed by every reflector.
                            k.complete = true;
                            k.answers = answers;
                        } else if k.found != new {
                            tracing::debug!(%link, answers, "endpoint discovery: an incomplete round, the last complete result kept");
                        }
                    }
                    false
                }
            };
            if differs {
                changed();
            }
        }
    }
}

/// The reflectors of `list` (host:port, names resolved) that a probe may
/// go to: unicast, IPv4 or IPv6 (not link-local), not on this host, at
/// most [`MAX_REFLECTORS`].
pub fn reflectors(list: &[String]) -> Vec<SocketAddr> {
    let mut out: Vec<SocketAddr> = Vec::new();
    for r in list {
        let Ok(addrs) = r.to_socket_addrs() else {
            tracing::debug!(reflector = %r, "endpoint discovery: cannot resolve");
            continue;
        };
        for a in addrs {
            let a = SocketAddr::new(a.ip().to_canonical(), a.port());
            let usable = match a.ip() {
                IpAddr::V4(ip) => !(ip.is_loopback() || ip.is_unspecified() || ip.is_multicast() || ip.is_broadcast()),
                IpAddr::V6(ip) => {
                    !(ip.is_loopback() || ip.is_unspecified() || ip.is_multicast() || ip.is_unicast_link_local())
                }
            } && a.port() != 0;
            if usable && !out.contains(&a) && out.len() < MAX_REFLECTORS {
                out.push(a);
            }
        }
    }
    out
}

/// Starts a round for `t`: a probe to each reflector from its port.
fn begin(sock: &Sockets, t: &Target) -> Round {
    // Each name resolved once: the site's own reflectors, then the peer's.
    let split = t.own.min(t.reflectors.len());
    let theirs = reflectors(&t.reflectors[split..]);
    let mut all = reflectors(&t.reflectors[..split]);
    for a in &theirs {
        if !all.contains(a) && all.len() < MAX_REFLECTORS {
            all.push(*a);
        }
    }
    let mut sent: Vec<(SocketAddr, Nonce)> = Vec::new();
    for r in all {
        let mut nonce = [0u8; 16];
        if ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut nonce).is_err() {
            continue;
        }
        let mut d = Vec::with_capacity(8 + discovery::PROBE_LEN);
        d.extend_from_slice(&t.port.to_be_bytes());
        d.extend_from_slice(&r.port().to_be_bytes());
        d.extend_from_slice(&((8 + discovery::PROBE_LEN) as u16).to_be_bytes());
        // No checksum over IPv4 (optional, and NATs keep it 0); over IPv6
        // the kernel fills it in.
        d.extend_from_slice(&[0, 0]);
        d.extend_from_slice(&discovery::probe(&nonce));
        match sock.send(&d, r.ip()) {
            Ok(_) => sent.push((r, nonce)),
            Err(e) => tracing::debug!(reflector = %r, error = %e, "endpoint discovery: probe not sent"),
        }
    }
    Round {
        target: t.clone(),
        answers: vec![None; sent.len()],
        theirs,
        sent,
        deadline: Instant::now() + WAIT,
    }
}

/// What a round found: the socket's own addresses (its underlay, and the
/// source address the host picks toward each reflector: a connected UDP
/// socket sends nothing, it only asks the routing) as local candidates,
/// each address a reflector outside saw as a reflexive one, and the NAT
/// behaviour they show.
fn found(r: &Round) -> Found {
    let port = r.target.port;
    let mut own: Vec<SocketAddr> = r
        .target
        .underlay
        .map(|ip| SocketAddr::new(ip, port))
        .into_iter()
        .collect();
    for (at, _) in &r.sent {
        let any = if at.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
        let src = std::net::UdpSocket::bind(any).and_then(|u| u.connect(at).and_then(|()| u.local_addr()));
        if let Ok(a) = src {
            let a = SocketAddr::new(a.ip(), port);
            if !own.contains(&a) {
                own.push(a);
            }
        }
    }
    let seen: Vec<SocketAddr> = r.answers.iter().flatten().copied().collect();
    // The NAT is IPv4's where an IPv4 reflector answered (one family's
    // mappings say nothing of the other's), else IPv6's.
    let v4 = seen.iter().any(SocketAddr::is_ipv4);
    let of_family =
        |list: &[SocketAddr]| -> Vec<SocketAddr> { list.iter().copied().filter(|a| a.is_ipv4() == v4).collect() };
    let nat = Behaviour::observed(&of_family(&seen), &of_family(&own));
    let mut candidates: Vec<pb::Candidate> = own
        .iter()
        .map(|a| pb::Candidate {
            address: a.to_string(),
            kind: "local".into(),
        })
        .collect();
    // Where reflectors outside the NAT saw the socket; and its own address
    // where a reflector of the peer's saw it there (no NAT on the way: a
    // public IPv4 address, or IPv6), since that is where the peer can
    // dial it. (A reflector of the site's own, on its LAN, sees the own
    // address too, but that shows nothing about the outside.)
    let by_theirs = r
        .sent
        .iter()
        .zip(&r.answers)
        .filter(|((at, _), _)| r.theirs.contains(at))
        .filter_map(|(_, a)| *a);
    let outside: Vec<SocketAddr> = seen
        .iter()
        .copied()
        .filter(|s| !own.contains(s))
        .chain(by_theirs)
        .collect();
    for s in &outside {
        let c = pb::Candidate {
            address: s.to_string(),
            kind: "reflexive".into(),
        };
        if !candidates.contains(&c) {
            candidates.push(c);
        }
    }
    candidates.truncate(MAX_REFLECTORS);
    Found {
        candidates,
        nat: nat.as_str().to_string(),
    }
}

/// The raw UDP sockets discovery sends and reads on: IPv4's, and IPv6's
/// where the host has IPv6.
struct Sockets {
    v4: Option<Socket>,
    v6: Option<Socket>,
}

impl Sockets {
    /// Both families' sockets; an error only when neither opens.
    fn open() -> Result<Sockets, String> {
        let v4 = raw_socket(Domain::IPV4);
        let v6 = raw_socket(Domain::IPV6);
        match (v4, v6) {
            (Err(e), Err(_)) => Err(e),
            (v4, v6) => {
                if let Err(e) = &v6 {
                    tracing::debug!(error = %e, "endpoint discovery over IPv4 only");
                }
                Ok(Sockets {
                    v4: v4.ok(),
                    v6: v6.ok(),
                })
            }
        }
    }

    /// Sends a UDP datagram `d` (its header first) to `to`.
    fn send(&self, d: &[u8], to: IpAddr) -> std::io::Result<usize> {
        let (sock, addr) = match to {
            IpAddr::V4(ip) => (&self.v4, SockAddr::from(SocketAddrV4::new(ip, 0))),
            IpAddr::V6(ip) => (&self.v6, SockAddr::from(SocketAddrV6::new(ip, 0, 0, 0))),
        };
        let Some(sock) = sock else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "no raw socket for this address family",
            ));
        };
        sock.send_to(d, &addr)
    }

    /// One discovery datagram within `wait`: its source, destination port
    /// and payload.
    fn receive(&self, wait: Duration) -> Option<(SocketAddr, u16, Vec<u8>)> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        use std::os::fd::AsFd;
        let socks: Vec<&Socket> = self.v4.iter().chain(&self.v6).collect();
        let mut fds: Vec<PollFd> = socks
            .iter()
            .map(|s| PollFd::new(s.as_fd(), PollFlags::POLLIN))
            .collect();
        let ms = u16::try_from(wait.as_millis()).unwrap_or(u16::MAX).max(1);
        if poll(&mut fds, PollTimeout::from(ms)).ok()? == 0 {
            return None;
        }
        let ready = fds
            .iter()
            .position(|f| f.revents().is_some_and(|r| r.contains(PollFlags::POLLIN)))?;
        let mut buf = [0u8; 256];
        let (n, from) = nix::sys::socket::recvfrom::<nix::sys::socket::SockaddrStorage>(
            std::os::fd::AsRawFd::as_raw_fd(socks[ready]),
            &mut buf,
        )
        .ok()?;
        let data = &buf[..n];
        let from = match from? {
            f if f.as_sockaddr_in().is_some() => SocketAddr::V4((*f.as_sockaddr_in()?).into()),
            f => SocketAddr::V6((*f.as_sockaddr_in6()?).into()),
        };
        match from {
            // IPv4's raw socket reads from the IP header on.
            SocketAddr::V4(_) => {
                let (from, port, payload) = udp_of(data)?;
                Some((SocketAddr::V4(from), port, payload.to_vec()))
            }
            // IPv6's from the UDP header on (the source comes apart).
            SocketAddr::V6(a) => {
                let (port, payload) = udp_payload(data)?;
                Some((
                    SocketAddr::V6(SocketAddrV6::new(*a.ip(), port.0, 0, 0)),
                    port.1,
                    payload.to_vec(),
                ))
            }
        }
    }
}

/// The source, destination port and payload of an IPv4/UDP packet (as a
/// raw socket reads it, from the IP header on).
fn udp_of(p: &[u8]) -> Option<(SocketAddrV4, u16, &[u8])> {
    let ihl = usize::from(p.first()? & 0x0f) * 4;
    if ihl < 20 || p.len() < ihl + 8 || p[0] >> 4 != 4 || p[9] != 17 {
        return None;
    }
    let src = Ipv4Addr::new(p[12], p[13], p[14], p[15]);
    let ((sport, dport), payload) = udp_payload(&p[ihl..])?;
    Some((SocketAddrV4::new(src, sport), dport, payload))
}

/// The ports (source, destination) and payload of a UDP datagram, from
/// its header on.
fn udp_payload(u: &[u8]) -> Option<((u16, u16), &[u8])> {
    if u.len() < 8 {
        return None;
    }
    let sport = u16::from_be_bytes([u[0], u[1]]);
    let dport = u16::from_be_bytes([u[2], u[3]]);
    Some(((sport, dport), &u[8..]))
}

/// Has the kernel compute the checksum at `offset` of what raw IPv6
/// socket `s` sends, and check it on what it reads (IPV6_CHECKSUM, RFC
/// 3542): IPv6 requires UDP's.
#[allow(unsafe_code)]
fn checksum_at(s: &Socket, offset: libc::c_int) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid socket descriptor, and a pointer to a c_int that
    // lives across the call with its exact size.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_IPV6,
            libc::IPV6_CHECKSUM,
            (&raw const offset).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A raw UDP socket of `family` that sees only discovery datagrams (their
/// payload starts with discovery's magic).
fn raw_socket(family: Domain) -> Result<Socket, String> {
    let v6 = family == Domain::IPV6;
    let sock = Socket::new(family, Type::RAW, Some(Protocol::UDP))
        .map_err(|e| format!("a raw UDP socket (needs CAP_NET_RAW): {e}"))?;
    let magic = u32::from_be_bytes(discovery::MAGIC[..4].try_into().unwrap());
    // Keep datagrams whose payload starts with "WEFT" (the first 4 bytes
    // of discovery's magic). IPv4's read from the IP header: x = its
    // length, the payload at x+8 (a fragment's offset makes x+8 land
    // elsewhere; discovery datagrams are never fragmented). IPv6's from
    // the UDP header: the payload at 8.
    let filter: &[SockFilter] = if v6 {
        &[
            SockFilter::new(0x20, 0, 0, 8),      // ld [8]
            SockFilter::new(0x15, 0, 1, magic),  // jeq magic, else drop
            SockFilter::new(0x06, 0, 0, 0xffff), // accept
            SockFilter::new(0x06, 0, 0, 0),      // drop
        ]
    } else {
        &[
            SockFilter::new(0xb1, 0, 0, 0),      // ldxb 4*([0]&0xf)
            SockFilter::new(0x40, 0, 0, 8),      // ld [x+8]
            SockFilter::new(0x15, 0, 1, magic),  // jeq magic, else drop
            SockFilter::new(0x06, 0, 0, 0xffff), // accept
            SockFilter::new(0x06, 0, 0, 0),      // drop
        ]
    };
    sock.attach_filter(filter)
        .map_err(|e| format!("cannot filter the raw socket: {e}"))?;
    if v6 {
        checksum_at(&sock, 6).map_err(|e| format!("cannot have the kernel checksum IPv6 UDP: {e}"))?;
    }
    // What arrived before the filter was attached.
    sock.set_nonblocking(true).map_err(|e| e.to_string())?;
    let mut buf = [0u8; 2048];
    while (&sock).read(&mut buf).is_ok() {}
    Ok(sock)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_userspace_device_knows_discoverys_datagrams() {
        // It lets discovery's answers pass to the raw socket uncounted.
        assert_eq!(
            weft_common::discovery::MAGIC.as_slice(),
            weft_dataplane::userspace::DISCOVERY_MAGIC
        );
    }

    #[test]
    fn reflectors_are_unicast_addresses_off_this_host() {
        let list: Vec<String> = [
            "127.0.0.1:7443",
            "198.51.100.2:7443",
            "224.0.0.1:7443",
            "198.51.100.2:7443",
            "0.0.0.0:1",
            "not an address",
            "[::1]:7443",
            "[fe80::1]:7443",
            "[ff02::1]:7443",
            "[2001:db8::2]:7443",
            "[::ffff:198.51.100.3]:7443",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let want: Vec<SocketAddr> = ["198.51.100.2:7443", "[2001:db8::2]:7443", "198.51.100.3:7443"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        assert_eq!(reflectors(&list), want);
    }

    fn round(underlay: &str, sent: &[(&str, Option<&str>)], theirs: &[&str]) -> Round {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        Round {
            target: Target {
                port: 51820,
                reflectors: vec![],
                own: 0,
                underlay: Some(underlay.parse().unwrap()),
            },
            sent: sent.iter().map(|(r, _)| (a(r), [0u8; 16])).collect(),
            theirs: theirs.iter().map(|r| a(r)).collect(),
            answers: sent.iter().map(|(_, s)| s.map(a)).collect(),
            deadline: Instant::now(),
        }
    }

    fn reflexive(f: &Found) -> Vec<&str> {
        f.candidates
            .iter()
            .filter(|c| c.kind == "reflexive")
            .map(|c| c.address.as_str())
            .collect()
    }

    #[test]
    fn a_gateway_without_nat_is_a_candidate_where_the_peers_reflector_saw_it() {
        // IPv6, no NAT: both reflectors see the own address; the peer's
        // makes it a candidate, and there is no NAT.
        let own = "[2001:db8:10::10]:51820";
        let r = round(
            "2001:db8:10::10",
            &[
                ("[2001:db8:78::1]:7443", Some(own)),
                ("[2001:db8:78::2]:7443", Some(own)),
            ],
            &["[2001:db8:78::2]:7443"],
        );
        let f = found(&r);
        assert_eq!(f.nat, "none");
        assert_eq!(reflexive(&f), vec![own]);
        // Only the site's own reflector answered: no candidate (it may be
        // on the LAN, inside the firewall).
        let r = round(
            "2001:db8:10::10",
            &[("[2001:db8:78::1]:7443", Some(own)), ("[2001:db8:78::2]:7443", None)],
            &["[2001:db8:78::2]:7443"],
        );
        assert!(reflexive(&found(&r)).is_empty());
        // Behind IPv4 NAT, as before: the mapped address, not the own one.
        let r = round(
            "192.168.10.10",
            &[
                ("198.51.100.1:7443", Some("198.51.100.30:40001")),
                ("198.51.100.2:7443", Some("198.51.100.30:40001")),
            ],
            &["198.51.100.2:7443"],
        );
        let f = found(&r);
        assert_eq!(f.nat, "endpoint-independent");
        assert_eq!(reflexive(&f), vec!["198.51.100.30:40001"]);
        // Dual stack: IPv4 behind NAT, IPv6 at its own address. The NAT
        // is IPv4's (the IPv6 address is no second mapping of it), and
        // both are candidates.
        let r = round(
            "192.168.10.10",
            &[
                ("198.51.100.1:7443", Some("198.51.100.30:40001")),
                ("[2001:db8:78::2]:7443", Some("[2001:db8:10::10]:51820")),
            ],
            &["[2001:db8:78::2]:7443"],
        );
        let f = found(&r);
        assert_eq!(f.nat, "endpoint-independent");
        assert_eq!(reflexive(&f), vec!["198.51.100.30:40001", "[2001:db8:10::10]:51820"]);
    }

    fn result(nat: &str, candidates: &[(&str, &str)]) -> Found {
        Found {
            candidates: candidates
                .iter()
                .map(|(a, k)| pb::Candidate {
                    address: a.to_string(),
                    kind: k.to_string(),
                })
                .collect(),
            nat: nat.into(),
        }
    }

    fn kept(found: &Found, complete: bool, answers: usize) -> Kept {
        Kept {
            found: found.clone(),
            complete,
            answers,
        }
    }

    #[test]
    fn an_incomplete_round_does_not_replace_a_complete_result() {
        let local = ("192.168.1.2:51820", "local");
        let good = result("endpoint-independent", &[local, ("198.51.100.30:51820", "reflexive")]);
        let nothing = result("unknown", &[local]);
        let one = result("endpoint-independent", &[local, ("198.51.100.30:51820", "reflexive")]);
        let k = kept(&good, true, 2);
        // No answer, however many rounds in a row: the result stays.
        for _ in 0..10 {
            assert!(!replaces(Some(&k), &nothing, false, 0));
        }
        // Some answers that agree with it: the same.
        assert!(!replaces(Some(&k), &one, false, 1));
        // Endpoint-dependent seen by two, one of them answering now.
        let dependent = result(
            "endpoint-dependent",
            &[
                local,
                ("198.51.100.30:40001", "reflexive"),
                ("198.51.100.30:40002", "reflexive"),
            ],
        );
        let half = result("endpoint-independent", &[local, ("198.51.100.30:40001", "reflexive")]);
        assert!(!replaces(Some(&kept(&dependent, true, 2)), &half, false, 1));
        // A complete round that disagrees replaces it, even with nothing.
        assert!(replaces(Some(&k), &nothing, true, 0));
        assert!(replaces(Some(&kept(&dependent, true, 2)), &half, true, 2));
        // An answer showing a new mapping replaces it, complete or not.
        let moved = result("endpoint-independent", &[local, ("198.51.100.99:51820", "reflexive")]);
        assert!(replaces(Some(&k), &moved, false, 1));
        // The same result never counts as a change.
        assert!(!replaces(Some(&k), &good, true, 2));
    }

    #[test]
    fn the_first_result_is_taken_and_incomplete_ones_give_way_to_more_answers() {
        let local = ("192.168.1.2:51820", "local");
        let nothing = result("unknown", &[local]);
        let one = result("endpoint-independent", &[local, ("198.51.100.30:51820", "reflexive")]);
        // Whatever the first round found, even nothing.
        assert!(replaces(None, &nothing, false, 0));
        assert!(replaces(None, &one, false, 1));
        // Incomplete after incomplete: more answers win, fewer do not.
        assert!(replaces(Some(&kept(&nothing, false, 0)), &one, false, 1));
        assert!(!replaces(Some(&kept(&one, false, 1)), &nothing, false, 0));
        // Unknown after a complete round that found nothing (UDP blocked)
        // stays unknown until a reflector answers.
        assert!(!replaces(Some(&kept(&nothing, true, 0)), &nothing, false, 0));
        assert!(replaces(Some(&kept(&nothing, true, 0)), &one, false, 1));
    }

    #[test]
    fn a_udp_packet_is_read_from_its_ip_header() {
        let mut p = vec![
            0x45, 0, 0, 36, 0, 0, 0, 0, 64, 17, 0, 0, 198, 51, 100, 2, 192, 168, 1, 2,
        ];
        p.extend_from_slice(&[0x1d, 0x13, 0xca, 0x6c, 0, 16, 0, 0]);
        p.extend_from_slice(b"WEFTDSC1");
        let (from, dport, payload) = udp_of(&p).unwrap();
        assert_eq!(from, "198.51.100.2:7443".parse().unwrap());
        assert_eq!(dport, 51820);
        assert_eq!(payload, b"WEFTDSC1");
        assert_eq!(udp_of(&p[..22]), None);
    }
}
