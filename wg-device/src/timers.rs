//! The protocol's timers, run by the receiving thread every
//! `TIMER_EVERY`.

use std::sync::Arc;

use defguard_boringtun::noise::TunnResult;

use crate::peers::Peer;
use crate::send::send;
use crate::shared::Shared;

/// The protocol's timers for every peer: handshakes to start or retry,
/// keepalives, sessions to end; and the early rekey of tests.
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
            send(s, to, &buf[..n], n);
        }
        if let Some(after) = s.rekey_after
            && t.time_since_last_handshake().is_some_and(|d| d >= after)
            && let Some((to, n)) = out(t.format_handshake_initiation(buf, false))
        {
            send(s, to, &buf[..n], n);
        }
    }
}
