//! The protocol's timers, run by the receiving thread every
//! `TIMER_EVERY`; and the eager handshakes to a new endpoint
//! (`EAGER_EVERY`).

use std::sync::Arc;
use std::time::Instant;

use defguard_boringtun::noise::{Tunn, TunnResult};

use crate::peers::Peer;
use crate::send::{direct_send, send, to_peer};
use crate::shared::Shared;
use crate::{DIRECT_EVERY, EAGER_EVERY};

/// The protocol's timers for every peer: handshakes to start or retry,
/// keepalives, sessions to end; a new endpoint's eager handshakes; and
/// the early rekey of tests.
pub(crate) fn run(s: &Shared, buf: &mut [u8]) {
    let peers: Vec<Arc<Peer>> = s.peers().by_key.values().cloned().collect();
    for peer in peers {
        let to = peer.endpoint();
        let mut t = peer.tunn();
        let out = |r: TunnResult<'_>| {
            if let (TunnResult::WriteToNetwork(p), Some(to)) = (r, to) {
                let n = p.len();
                Some((to, n))
            } else {
                None
            }
        };
        if let Some((to, n)) = out(t.update_timers(buf)) {
            to_peer(s, &peer, to, &buf[..n]);
        }
        if let Some(to) = to
            && let Some(n) = eager(&peer, &mut t, buf)
        {
            to_peer(s, &peer, to, &buf[..n]);
        }
        if let Some((direct, prime)) = beside_due(s, &peer, to, &t)
            && let TunnResult::WriteToNetwork(p) = t.encapsulate(&[], buf)
        {
            let n = p.len();
            direct_send(s, direct, &buf[..n], prime);
        }
        if let Some(after) = s.rekey_after
            && t.time_since_last_handshake().is_some_and(|d| d >= after)
            && let Some((to, n)) = out(t.format_handshake_initiation(buf, false))
        {
            send(s, to, &buf[..n], n);
        }
    }
}

/// Where a keepalive of `peer`'s session goes now beside its endpoint
/// `to` (a relay), and whether with the punch TTL: its direct address,
/// every [`DIRECT_EVERY`], while it has a session and is not there yet.
fn beside_due(
    s: &Shared,
    peer: &Peer,
    to: Option<std::net::SocketAddr>,
    t: &Tunn,
) -> Option<(std::net::SocketAddr, bool)> {
    t.time_since_last_handshake()?;
    let now = Instant::now();
    {
        let mut b = peer.beside();
        if b.direct.is_none() || b.next.is_some_and(|next| now < next) {
            return None;
        }
        b.next = Some(now + DIRECT_EVERY);
    }
    peer.beside_target(to, s.punch_ttl)
}

/// A new initiation if `peer` is in its eager period, has no session, and
/// its last initiation went [`EAGER_EVERY`] ago: its length in `buf`.
fn eager(peer: &Peer, t: &mut Tunn, buf: &mut [u8]) -> Option<usize> {
    let mut eager = peer.eager.lock().unwrap_or_else(|e| e.into_inner());
    let (until, last) = (*eager)?;
    let now = Instant::now();
    if now >= until || t.time_since_last_handshake().is_some() {
        *eager = None;
        return None;
    }
    if now.duration_since(last) < EAGER_EVERY {
        return None;
    }
    *eager = Some((until, now));
    match t.format_handshake_initiation(buf, true) {
        TunnResult::WriteToNetwork(p) => Some(p.len()),
        _ => None,
    }
}
