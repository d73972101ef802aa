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
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

mod sockets;

use sockets::Sockets;

#[cfg(test)]
mod tests;
