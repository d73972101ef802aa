//! The Linux applier's part in tunnels over TLS (`tls_relay`,
//! `fallback`): a relay gateway's TLS port, and the moves of this
//! gateway's tunnels between UDP and TLS.

use std::collections::HashMap;

use weft_dataplane::desired::{LinkSpec, Object};
use weft_proto::v1 as pb;

use super::Linux;
use crate::apply::Objects;
use crate::desired::Held;

impl Linux {
    /// A relay site's active gateway: its TLS port runs, and admits the
    /// relayed tunnels' sides (from their allowed addresses) and this
    /// gateway's own tunnels.
    pub(super) fn tls_front(&mut self, fin: &Objects) -> Vec<pb::ObjectError> {
        let wanted = fin.iter().find_map(|(id, o)| match o.object()? {
            Object::RelayTls { port, shift } => Some((id, *port, *shift)),
            _ => None,
        });
        let Some((id, port, shift)) = wanted else {
            self.front = None;
            *crate::metrics::get().tls_front.lock().unwrap() = None;
            return Vec::new();
        };
        if self.front.as_ref().is_none_or(|f| f.port != port) {
            self.front = None;
            match crate::tls_relay::Front::start(port) {
                Ok(f) => {
                    *crate::metrics::get().tls_front.lock().unwrap() = Some(f.counters.clone());
                    self.front = Some(f);
                }
                Err(message) => {
                    tracing::warn!(object = %id, error = %message, "not applied");
                    return vec![pb::ObjectError {
                        id: id.clone(),
                        message,
                    }];
                }
            }
        }
        // Only ports weft runs something on now: relayed sides that
        // started, tunnels whose device is there.
        let tunnels = fin.values().filter_map(Held::object).filter_map(|o| match o {
            Object::Link(l) => match &l.kind {
                LinkSpec::Wireguard(w) if self.plane.wg.has(&l.name) => Some(w.listen_port),
                _ => None,
            },
            _ => None,
        });
        let admit = crate::tls_relay::admitted(self.relays.running(), tunnels, shift);
        if let Some(f) = &self.front {
            f.admit(admit);
        }
        Vec::new()
    }

    /// One look at the tunnels that may go over TLS (see `fallback`);
    /// true when one moved.
    pub(super) fn step_tls_paths(&mut self) -> bool {
        if !self.paths.any() {
            return false;
        }
        let (wg, discovery) = (&mut self.plane.wg, &self.discovery);
        let now = std::time::Instant::now();
        // A link's handshake read once per step (kernel WireGuard: a
        // netlink dump in the link's namespace).
        let mut handshakes: HashMap<String, Option<u64>> = HashMap::new();
        self.paths
            .step(now, crate::fallback::unix_now(), |link| crate::fallback::Seen {
                last_handshake_unix: *handshakes
                    .entry(link.to_string())
                    .or_insert_with(|| wg.stats(link).last_handshake_unix),
                discovery: discovery.is_some(),
                answered: discovery.as_ref().and_then(|d| d.answered(link)),
                silent: discovery.as_ref().and_then(|d| d.silent(link)),
            })
    }
}
