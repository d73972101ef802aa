//! On a relay site's active gateway: the relayed tunnels its controller
//! renders (`RelaySession` objects, checked when the agent decoded them:
//! ports from 1024 up and distinct, WireGuard keys, IPv4 addresses, a
//! nonzero limit), each run by `weft_dataplane::relay` on two UDP ports of
//! the gateway host; their counters go to the metrics
//! (`metrics::Relayed`).

use std::collections::BTreeMap;

use weft_dataplane::desired::decode::RelaySession;
use weft_dataplane::relay::Relay;

/// The most relayed tunnels one gateway runs (two ports and two threads
/// each).
pub const MAX_SESSIONS: usize = 64;

/// A session's relay and what it was started from.
struct Running {
    session: RelaySession,
    relay: Relay,
}

/// The relays running now, by object id.
#[derive(Default)]
pub struct Relays {
    running: BTreeMap<String, Running>,
}

impl Relays {
    /// Runs exactly the sessions among `objects` (id, session): starts new
    /// and changed ones, stops the rest. Returns the ids that could not
    /// start, with why (a port taken, too many sessions).
    pub fn set(&mut self, objects: &[(String, RelaySession)]) -> Vec<(String, String)> {
        let mut errors = Vec::new();
        // A session that changed on the same ports (a side's NAT address
        // or keys) keeps where its sides were learned: its tunnel need not
        // wait for a handshake.
        let mut learned = BTreeMap::new();
        self.running.retain(|id, r| {
            let same = objects.iter().any(|(i, o)| i == id && *o == r.session);
            let ports = |s: &RelaySession| (s.spec.a.port, s.spec.b.port);
            if !same && objects.iter().any(|(i, o)| i == id && ports(o) == ports(&r.session)) {
                learned.insert(id.clone(), r.relay.learned());
            }
            same
        });
        for (id, o) in objects {
            if self.running.contains_key(id) {
                continue;
            }
            if self.running.len() >= MAX_SESSIONS {
                errors.push((
                    id.clone(),
                    format!("this gateway runs {MAX_SESSIONS} relayed tunnels already"),
                ));
                continue;
            }
            let spec = &o.spec;
            let known = learned.get(id).copied().unwrap_or_default();
            let started = weft_dataplane::relay::start_with(spec, known)
                .map_err(|e| format!("cannot relay on UDP ports {} and {}: {e}", spec.a.port, spec.b.port));
            match started {
                Ok(relay) => {
                    tracing::info!(id = %id, a = %o.sites.0, b = %o.sites.1, "relaying a tunnel");
                    self.running.insert(
                        id.clone(),
                        Running {
                            session: o.clone(),
                            relay,
                        },
                    );
                }
                Err(e) => errors.push((id.clone(), e)),
            }
        }
        *crate::metrics::get().relays.lock().unwrap() = self.seen();
        errors
    }

    /// The sessions running now.
    pub fn running(&self) -> impl Iterator<Item = &RelaySession> {
        self.running.values().map(|r| &r.session)
    }

    fn seen(&self) -> crate::metrics::Relayed {
        self.running
            .values()
            .map(|r| {
                let (a, b) = r.session.sites.clone();
                (a, b, r.relay.counters.clone())
            })
            .collect()
    }
}
