//! Which way each tunnel that may fall back to TLS goes: over UDP, or
//! carried over TLS ([`crate::tls_relay`]) where UDP does not work.
//!
//! The controller renders a peer with a TLS port when its endpoint is a
//! relay site's gateway that takes TLS (a relayed tunnel's relay, or the
//! relay site itself); the gateway decides by itself which way to send,
//! from what it sees:
//! - a tunnel starts on UDP;
//! - UDP → TLS when no handshake came within [`UDP_GRACE`] of going on UDP
//!   (within [`UDP_GRACE_SILENT`] when a round of endpoint discovery's
//!   probes from the tunnel's port went wholly unanswered meanwhile: UDP
//!   does not go out), or the last one is older than [`STALE`] (WireGuard
//!   renews a live session's keys every two minutes);
//! - a new tunnel to a front that another tunnel of the gateway reaches
//!   only over TLS, with no answer to discovery since, starts on TLS;
//! - TLS → UDP once endpoint discovery's probes from the tunnel's port are
//!   answered again (UDP goes out) after [`stay`] on TLS: 10 s the first
//!   time, doubled for every try that found UDP still not answering the
//!   handshake, up to 10 minutes; a handshake over UDP resets it.
//!
//! The device's endpoint is the carrier's loopback address while on TLS;
//! going back to UDP sets the rendered endpoint again.

use std::borrow::Cow;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime};

use weft_dataplane::desired::Object;

use crate::tls_relay::Carrier;

/// How long a tunnel on UDP may go without a handshake before it goes
/// over TLS (a working path answers the first handshake in a round trip;
/// weft's device sends one a second while new).
pub const UDP_GRACE: Duration = Duration::from_secs(3);
/// The same when discovery's probes went unanswered meanwhile.
pub const UDP_GRACE_SILENT: Duration = Duration::from_secs(1);
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
    /// The front (the endpoint's address and the TLS port) and the UDP
    /// port carried to there (the endpoint's).
    front: SocketAddr,
    port: u16,
    carrier: Option<Carrier>,
    since: Instant,
    since_unix: u64,
    /// Returns to UDP that found no handshake.
    tries: u32,
    /// Going on UDP was a return from TLS.
    returning: bool,
}

impl Way {
    fn on_udp(&mut self, returning: bool, now: Instant, unix: u64) {
        self.carrier = None;
        self.since = now;
        self.since_unix = unix;
        self.returning = returning;
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
    /// When endpoint discovery last got an answer for its port, and when
    /// a round of its probes last went wholly unanswered.
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
        let mut seen = std::collections::HashSet::new();
        let out = objects
            .map(|(id, o)| {
                let Object::WireguardPeer {
                    ns,
                    link,
                    peer,
                    tls_port: Some(tls),
                } = o
                else {
                    return (id, Cow::Borrowed(o));
                };
                let Some(endpoint) = peer.endpoint else {
                    return (id, Cow::Borrowed(o));
                };
                let key = (link.clone(), *peer.public_key.as_bytes());
                seen.insert(key.clone());
                let front = SocketAddr::new(endpoint.ip(), *tls);
                // A front another tunnel reaches only over TLS: UDP to it
                // is not worth the grace.
                let blocked = !self.ways.contains_key(&key)
                    && self.ways.values().any(|w| w.front.ip() == front.ip() && w.carrier.is_some());
                let way = self.ways.entry(key).or_insert_with(|| Way {
                    front,
                    port: endpoint.port(),
                    carrier: None,
                    since: Instant::now(),
                    since_unix: unix_now(),
                    tries: 0,
                    returning: false,
                });
                if blocked {
                    match Carrier::start(front, endpoint.port()) {
                        Ok(c) => {
                            tracing::info!(%link, %front, port = endpoint.port(), "UDP to this relay is blocked: the tunnel starts over TLS");
                            way.carrier = Some(c);
                        }
                        Err(e) => tracing::warn!(%link, error = %e, "cannot carry the tunnel over TLS"),
                    }
                }
                if way.front != front || way.port != endpoint.port() {
                    // Another relay, or another port there: UDP first.
                    (way.front, way.port, way.tries) = (front, endpoint.port(), 0);
                    way.on_udp(false, Instant::now(), unix_now());
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
                        (id, Cow::Owned(o))
                    }
                    None => (id, Cow::Borrowed(o)),
                }
            })
            .collect();
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

    /// The links with a tunnel that may fall back.
    pub fn links(&self) -> Vec<String> {
        let mut l: Vec<String> = self.ways.keys().map(|(l, _)| l.clone()).collect();
        l.dedup();
        l
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
            match &way.carrier {
                None => {
                    if fresh {
                        way.tries = 0;
                        way.returning = false;
                    }
                    let stale = s
                        .last_handshake_unix
                        .is_some_and(|h| unix.saturating_sub(h) > STALE.as_secs());
                    let silent = s.silent.is_some_and(|t| t > way.since) && s.answered.is_none_or(|a| a <= way.since);
                    let grace = if silent { UDP_GRACE_SILENT } else { UDP_GRACE };
                    let waited = now.saturating_duration_since(way.since) >= grace;
                    if waited && (!fresh || stale) {
                        if way.returning {
                            way.tries += 1;
                        }
                        match Carrier::start(way.front, way.port) {
                            Ok(c) => {
                                tracing::warn!(
                                    %link, front = %way.front, port = way.port,
                                    "no handshake over UDP: the tunnel goes over TLS"
                                );
                                crate::metrics::get().tls_moves.inc();
                                way.carrier = Some(c);
                                way.since = now;
                                way.since_unix = unix;
                                changed = true;
                            }
                            Err(e) => tracing::warn!(%link, error = %e, "cannot carry the tunnel over TLS"),
                        }
                    }
                }
                Some(_) => {
                    let answered = s
                        .answered
                        .is_some_and(|a| a > way.since && now.saturating_duration_since(a) < ANSWERED_WITHIN);
                    if answered && now.saturating_duration_since(way.since) >= stay(way.tries) {
                        tracing::info!(%link, tries = way.tries, "UDP answers again: the tunnel tries UDP");
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
