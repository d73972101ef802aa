//! On a relay site's active gateway: the relayed tunnels its controller
//! renders (`RelaySession` objects), each run by `weft_dataplane::relay`
//! on two UDP ports of the gateway host; their counters go to the
//! metrics (`metrics::Relayed`).

use std::collections::BTreeMap;

use weft_dataplane::relay::{Relay, Side, Spec};
use weft_proto::v1 as pb;

/// The most relayed tunnels one gateway runs (two ports and two threads
/// each).
pub const MAX_SESSIONS: usize = 64;

/// A session's relay and what it was started from.
struct Running {
    object: pb::RelaySession,
    relay: Relay,
}

/// The relays running now, by object id.
#[derive(Default)]
pub struct Relays {
    running: BTreeMap<String, Running>,
}

/// Checks a relay session from the controller: ports from 1024 up and
/// distinct, each side's keys 32-byte WireGuard keys (at most 16), its
/// addresses IPv4 (at most 64), a nonzero limit.
pub fn check(r: &pb::RelaySession) -> Result<Spec, String> {
    let side = |name: &str, s: Option<&pb::RelaySide>| -> Result<Side, String> {
        let s = s.ok_or_else(|| format!("relay side {name} is missing"))?;
        weft_types::name::id(&format!("relay side {name}'s site"), &s.site)?;
        let port = u16::try_from(s.port)
            .ok()
            .filter(|p| *p >= 1024)
            .ok_or_else(|| format!("relay side {name}'s port {} is not from 1024 to 65535", s.port))?;
        if s.to_keys.is_empty() || s.to_keys.len() > 16 {
            return Err(format!(
                "relay side {name} lists {} keys; give 1 to 16 (the far side's gateways)",
                s.to_keys.len()
            ));
        }
        let to_keys = s
            .to_keys
            .iter()
            .map(|k| weft_types::WgKey::parse(&format!("relay side {name}'s key"), k).map(|k| *k.as_bytes()))
            .collect::<Result<Vec<_>, _>>()?;
        if s.from_ips.len() > 64 {
            return Err(format!(
                "relay side {name} lists {} addresses; at most 64",
                s.from_ips.len()
            ));
        }
        let from_ips = s
            .from_ips
            .iter()
            .map(|a| weft_types::net::addr_v4(a).map_err(|m| format!("relay side {name}'s address {m}")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Side {
            port,
            to_keys,
            from_ips,
        })
    };
    let a = side("a", r.a.as_ref())?;
    let b = side("b", r.b.as_ref())?;
    if a.port == b.port {
        return Err(format!("relay sides a and b share port {}", a.port));
    }
    if r.bytes_per_second == 0 {
        return Err("a relay limit of 0 bytes a second".into());
    }
    Ok(Spec {
        a,
        b,
        bytes_per_second: r.bytes_per_second,
    })
}

impl Relays {
    /// Runs exactly the sessions among `objects` (id, session): starts new
    /// and changed ones, stops the rest. Returns the ids that could not
    /// start, with why (a port taken, too many sessions).
    pub fn set(&mut self, objects: &[(String, pb::RelaySession)]) -> Vec<(String, String)> {
        let mut errors = Vec::new();
        self.running
            .retain(|id, r| objects.iter().any(|(i, o)| i == id && *o == r.object));
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
            let started = check(o).and_then(|spec| {
                weft_dataplane::relay::start(&spec)
                    .map_err(|e| format!("cannot relay on UDP ports {} and {}: {e}", spec.a.port, spec.b.port))
            });
            match started {
                Ok(relay) => {
                    tracing::info!(
                        id = %id,
                        a = %o.a.as_ref().map(|s| s.site.as_str()).unwrap_or(""),
                        b = %o.b.as_ref().map(|s| s.site.as_str()).unwrap_or(""),
                        "relaying a tunnel"
                    );
                    self.running.insert(
                        id.clone(),
                        Running {
                            object: o.clone(),
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

    fn seen(&self) -> crate::metrics::Relayed {
        self.running
            .values()
            .map(|r| {
                let site = |s: &Option<pb::RelaySide>| s.as_ref().map(|s| s.site.clone()).unwrap_or_default();
                (site(&r.object.a), site(&r.object.b), r.relay.counters.clone())
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "hT7XTB7qgr4m+5V8gqhnNtjvNrqSqPFiCjPsXl1Oc0Q=";

    fn session() -> pb::RelaySession {
        let side = |site: &str, port| pb::RelaySide {
            site: site.into(),
            port,
            to_keys: vec![KEY.into()],
            from_ips: vec!["198.51.100.7".into()],
        };
        pb::RelaySession {
            a: Some(side("site-a", 51920)),
            b: Some(side("site-b", 51921)),
            bytes_per_second: 1_000_000,
        }
    }

    #[test]
    fn a_relay_session_from_the_controller_is_checked_before_anything_binds() {
        let spec = check(&session()).unwrap();
        assert_eq!((spec.a.port, spec.b.port), (51920, 51921));
        assert_eq!(spec.a.from_ips, [std::net::Ipv4Addr::new(198, 51, 100, 7)]);
        type Spoil = fn(&mut pb::RelaySession);
        let bad: [(&str, Spoil); 7] = [
            ("port 53", |s| s.a.as_mut().unwrap().port = 53),
            ("port 70000", |s| s.b.as_mut().unwrap().port = 70_000),
            ("share port", |s| s.b.as_mut().unwrap().port = 51920),
            ("not a 32-byte", |s| s.a.as_mut().unwrap().to_keys = vec!["AAAA".into()]),
            ("lists 0 keys", |s| s.a.as_mut().unwrap().to_keys.clear()),
            ("is IPv6; this field takes an IPv4 address", |s| {
                s.b.as_mut().unwrap().from_ips = vec!["::1".into()]
            }),
            ("0 bytes", |s| s.bytes_per_second = 0),
        ];
        for (why, spoil) in bad {
            let mut s = session();
            spoil(&mut s);
            let e = check(&s).unwrap_err();
            assert!(e.contains(why), "{why}: {e}");
        }
        let mut s = session();
        s.a = None;
        assert!(check(&s).unwrap_err().contains("missing"));
    }
}
