//! Which way each tunnel that may fall back to TLS goes: over UDP, or
//! carried over TLS ([`crate::tls_relay`]) where UDP does not work.
//!
//! The controller renders a peer with a TLS port when its endpoint is a
//! relay site's gateway that takes TLS (a relayed tunnel's relay, or the
//! relay site itself); the gateway decides by itself which way to send,
//! from what it sees of the tunnel (its last handshake) and of its own
//! endpoint discovery (probes from the tunnel's port to the controllers'
//! reflectors):
//! - a tunnel starts on UDP; one to a front that another tunnel of the
//!   gateway already reaches only over TLS starts on TLS;
//! - UDP → TLS when no handshake came since the tunnel went on UDP, or the
//!   last is older than [`STALE`] (WireGuard renews a live session's keys
//!   every two minutes), after a grace: [`GRACE_SILENT`] when a round of
//!   discovery went wholly unanswered meanwhile (UDP does not get out),
//!   [`GRACE_ANSWERED`] when a reflector outside the site answered (UDP
//!   gets out: more likely the peer is down, or UDP is blocked toward that
//!   host only), [`GRACE`] without either;
//! - TLS → UDP when a reflector outside the site answers again after
//!   [`stay`] on TLS (10 s the first time, doubled for every try that found
//!   UDP still not answering the handshake, up to 10 minutes; a handshake
//!   over UDP resets it), handshake over TLS or not (a peer that is down
//!   answers neither way), or after [`stay`] alone where discovery does
//!   not run.
//!
//! The device's endpoint is the carrier's loopback address while on TLS;
//! going back to UDP sets the rendered endpoint again.

use std::borrow::Cow;
use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant, SystemTime};

use weft_dataplane::desired::{LinkSpec, Object};

use crate::tls_relay::Carrier;

/// How long a tunnel on UDP may go without a handshake before it goes
/// over TLS, by what discovery shows meanwhile (a working path answers the
/// first handshake in a round trip; weft's device sends one a second while
/// new).
pub const GRACE: Duration = Duration::from_secs(3);
pub const GRACE_SILENT: Duration = Duration::from_secs(1);
pub const GRACE_ANSWERED: Duration = Duration::from_secs(10);
/// A last handshake this old: UDP stopped working.
pub const STALE: Duration = Duration::from_secs(180);
/// Discovery answered within this: UDP goes out.
const ANSWERED_WITHIN: Duration = Duration::from_secs(10);

/// How long a tunnel stays on TLS before UDP is tried again, after
/// `tries` tries that failed.
pub fn stay(tries: u32) -> Duration {
    Duration::from_secs(10u64 << tries.min(6)).min(Duration::from_secs(600))
}

/// One peer's way.
struct Way {
    /// The front (the endpoint's address and the TLS port), the UDP port
    /// carried to there (the endpoint's), and the WireGuard socket the
    /// carrier serves (127.0.0.1 and the link's port).
    front: SocketAddr,
    port: u16,
    wg: Option<SocketAddr>,
    carrier: Option<Carrier>,
    since: Instant,
    since_unix: u64,
    /// Returns to UDP that found no handshake.
    tries: u32,
    /// Going on UDP was a return from TLS.
    returning: bool,
    /// A move to TLS was said at warn (later ones at info).
    told: bool,
}

impl Way {
    fn on_udp(&mut self, returning: bool, now: Instant, unix: u64) {
        self.carrier = None;
        self.since = now;
        self.since_unix = unix;
        self.returning = returning;
    }

    fn on_tls(&mut self, link: &str, why: &str, now: Instant, unix: u64) -> bool {
        match Carrier::start(self.front, self.port, self.wg) {
            Ok(c) => {
                if self.told {
                    tracing::info!(%link, front = %self.front, port = self.port, "{why}: the tunnel goes over TLS");
                } else {
                    tracing::warn!(%link, front = %self.front, port = self.port, "{why}: the tunnel goes over TLS");
                    self.told = true;
                }
                crate::metrics::get().tls_moves.inc();
                self.carrier = Some(c);
                self.since = now;
                self.since_unix = unix;
                true
            }
            Err(e) => {
                tracing::debug!(%link, error = %e, "cannot carry the tunnel over TLS");
                false
            }
        }
    }
}

/// Seconds since the epoch, as WireGuard gives its handshakes' times.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What a step sees of one tunnel.
#[derive(Clone, Copy, Debug, Default)]
pub struct Seen {
    /// Its newest handshake (unix seconds).
    pub last_handshake_unix: Option<u64>,
    /// Endpoint discovery runs for it.
    pub discovery: bool,
    /// When a reflector outside the site last answered its probes, and
    /// when a round of its probes last went wholly unanswered.
    pub answered: Option<Instant>,
    pub silent: Option<Instant>,
}

/// The tunnels that may fall back to TLS, by link and peer key.
#[derive(Default)]
pub struct Paths {
    ways: HashMap<(String, [u8; 32]), Way>,
}

impl Paths {
    /// The objects the data plane is to hold: `objects` with the endpoint
    /// of every peer carried over TLS replaced by its carrier's address.
    /// Forgets (and stops the carriers of) peers not among them.
    pub fn rewrite<'a>(
        &mut self,
        objects: impl Iterator<Item = (&'a str, &'a Object)>,
    ) -> Vec<(&'a str, Cow<'a, Object>)> {
        let objects: Vec<(&str, &Object)> = objects.collect();
        // Each WireGuard link's socket, which its carriers serve.
        let ports: HashMap<&str, u16> = objects
            .iter()
            .filter_map(|(_, o)| match o {
                Object::Link(l) => match &l.kind {
                    LinkSpec::Wireguard(w) => Some((l.name.as_str(), w.listen_port)),
                    _ => None,
                },
                _ => None,
            })
            .collect();
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::with_capacity(objects.len());
        for (id, o) in objects {
            let Object::WireguardPeer {
                ns,
                link,
                peer,
                tls_port: Some(tls),
            } = o
            else {
                out.push((id, Cow::Borrowed(o)));
                continue;
            };
            let Some(endpoint) = peer.endpoint else {
                out.push((id, Cow::Borrowed(o)));
                continue;
            };
            let key = (link.clone(), *peer.public_key.as_bytes());
            seen.insert(key.clone());
            let front = SocketAddr::new(endpoint.ip(), *tls);
            let wg = ports
                .get(link.as_str())
                .map(|p| SocketAddr::from((Ipv4Addr::LOCALHOST, *p)));
            // A front another tunnel reaches only over TLS: UDP to it is
            // not worth the grace.
            let blocked = !self.ways.contains_key(&key)
                && self
                    .ways
                    .values()
                    .any(|w| w.front.ip() == front.ip() && w.carrier.is_some());
            let (now, unix) = (Instant::now(), unix_now());
            let way = self.ways.entry(key).or_insert_with(|| Way {
                front,
                port: endpoint.port(),
                wg,
                carrier: None,
                since: now,
                since_unix: unix,
                tries: 0,
                returning: false,
                told: false,
            });
            if way.front != front || way.port != endpoint.port() || way.wg != wg {
                // Another relay, or another port there: UDP first.
                (way.front, way.port, way.wg, way.tries) = (front, endpoint.port(), wg, 0);
                way.on_udp(false, now, unix);
            }
            if blocked {
                way.on_tls(link, "UDP to this relay is blocked", now, unix);
            }
            match &way.carrier {
                Some(c) => {
                    let mut p = peer.clone();
                    p.endpoint = Some(c.local);
                    let o = Object::WireguardPeer {
                        ns: ns.clone(),
                        link: link.clone(),
                        peer: p,
                        tls_port: Some(*tls),
                    };
                    out.push((id, Cow::Owned(o)));
                }
                None => out.push((id, Cow::Borrowed(o))),
            }
        }
        self.ways.retain(|k, _| seen.contains(k));
        crate::metrics::get()
            .over_tls
            .set(self.ways.values().filter(|w| w.carrier.is_some()).count() as i64);
        out
    }

    /// Whether any tunnel may fall back (a step has work).
    pub fn any(&self) -> bool {
        !self.ways.is_empty()
    }

    /// Whether link `link` is carried over TLS now.
    pub fn over_tls(&self, link: &str) -> bool {
        self.ways.iter().any(|((l, _), w)| l == link && w.carrier.is_some())
    }

    /// Looks at every tunnel once (`seen(link)`) at `now` (`unix`: the
    /// same in seconds since the epoch); true when one changed its way
    /// (the data plane is to be applied again).
    pub fn step(&mut self, now: Instant, unix: u64, mut seen: impl FnMut(&str) -> Seen) -> bool {
        let mut changed = false;
        for ((link, _), way) in self.ways.iter_mut() {
            let s = seen(link);
            let fresh = s.last_handshake_unix.is_some_and(|h| h >= way.since_unix);
            let waited = now.saturating_duration_since(way.since);
            let answered = s.answered.is_some_and(|a| a > way.since);
            let answering = s
                .answered
                .is_some_and(|a| a > way.since && now.saturating_duration_since(a) < ANSWERED_WITHIN);
            match &way.carrier {
                None => {
                    if fresh {
                        way.tries = 0;
                        way.returning = false;
                    }
                    let stale = s
                        .last_handshake_unix
                        .is_some_and(|h| unix.saturating_sub(h) > STALE.as_secs());
                    let silent = s.silent.is_some_and(|t| t > way.since) && !answered;
                    let grace = match (silent, answered) {
                        (true, _) => GRACE_SILENT,
                        (false, true) => GRACE_ANSWERED,
                        (false, false) => GRACE,
                    };
                    if waited >= grace && (!fresh || stale) {
                        if way.returning {
                            way.tries += 1;
                        }
                        changed |= way.on_tls(link, "no handshake over UDP", now, unix);
                    }
                }
                Some(_) => {
                    let back = waited >= stay(way.tries) && (answering || !s.discovery);
                    if back {
                        tracing::info!(%link, tries = way.tries, "UDP gets out again: the tunnel tries UDP");
                        way.on_udp(true, now, unix);
                        changed = true;
                    }
                }
            }
        }
        changed
    }
}

#[cfg(test)]
mod tests;
