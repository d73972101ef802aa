//! Relayed tunnels: when two peered sites have no direct path (both
//! gateways behind NAT that changes port per destination, or UDP blocked
//! between them), their tunnel goes, still encrypted, through the active
//! gateway of a third site that both are peered with and that relays
//! (`--relay` on its controller).
//!
//! Agreed without a new call, over the parameters peers already exchange:
//! - each end asks every relay site it is peered with to relay its tunnels
//!   to the peers it has no direct path to (`NetworkParams.relay_for`);
//! - a relay site gives each side of a pair a port when that side asked and
//!   the relay is peered with the far end, and answers each asking site
//!   (`NetworkParams.relays`): granted with an endpoint once both ends
//!   asked, pending, or refused (not peered with the far end: counted);
//! - each end takes, among the relays that granted it and whose tunnel from
//!   this site is up, the one with the smallest site id. Both ends see the
//!   same grants, so they pick the same relay; a relay that goes down is
//!   skipped by both at once.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use imbl::OrdMap;

use weft_proto::v1 as pb;

use crate::domain::{Peering, RelayGrant, RelayVia};

/// The most sites one site asks a relay to relay to.
pub const MAX_RELAY_REQUESTS: usize = 256;

/// Each relayed tunnel's limit per direction: 2.5 Gbit/s.
pub const SESSION_BYTES_PER_SECOND: u64 = 312_500_000;

/// A site's peerings, by peer site id.
pub type Peerings = OrdMap<String, Arc<Peering>>;

/// Checks what a peer asks this site to relay (`relay_for`): valid site
/// ids, not the asking site itself, no more than [`MAX_RELAY_REQUESTS`].
pub fn requests(asking: &str, list: &[String]) -> Result<Vec<String>, String> {
    if list.len() > MAX_RELAY_REQUESTS {
        return Err(format!(
            "relay_for: {} listed; a site asks for at most {MAX_RELAY_REQUESTS} relayed tunnels",
            list.len()
        ));
    }
    let mut out = BTreeSet::new();
    for (i, s) in list.iter().enumerate() {
        crate::domain::validate_name(&format!("relay_for[{i}]"), s)?;
        if s == asking {
            return Err(format!("relay_for[{i}]: a site cannot ask for a tunnel to itself"));
        }
        out.insert(s.clone());
    }
    Ok(out.into_iter().collect())
}

/// Checks a relay site's answers: valid site ids, and endpoints a gateway
/// can be sent to (see [`crate::nat::candidates`]; `own_hosts`: this
/// site's hosts, which a relay endpoint must not be).
pub fn grants(list: &[pb::RelayGrant], own_hosts: &[(std::net::IpAddr, String)]) -> Result<Vec<RelayGrant>, String> {
    if list.len() > MAX_RELAY_REQUESTS {
        return Err(format!(
            "relays: {} listed; a relay answers at most {MAX_RELAY_REQUESTS} requests",
            list.len()
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, g) in list.iter().enumerate() {
        crate::domain::validate_name(&format!("relays[{i}].peer_site"), &g.peer_site)?;
        let endpoint = match g.endpoint.as_str() {
            "" => None,
            e => {
                let c = pb::Candidate {
                    address: e.to_string(),
                    kind: "configured".into(),
                };
                let checked = crate::nat::candidates(&format!("relays[{i}].endpoint"), &[c], own_hosts)
                    .map_err(|m| m.replace(".endpoint[0].address", ".endpoint"))?;
                Some(checked[0].address)
            }
        };
        if g.refused.len() > 512 {
            return Err(format!("relays[{i}].refused: longer than 512 bytes"));
        }
        out.push(RelayGrant {
            peer_site: g.peer_site.clone(),
            endpoint,
            refused: g.refused.chars().filter(|c| !c.is_control()).collect(),
        });
    }
    Ok(out)
}

/// The relay peering `p`'s tunnel takes: among `peerings` (this site's,
/// by site id) that relay and granted this site an endpoint for `p`'s
/// site on one of their own gateways' addresses, and that are usable from
/// here (`usable(site, endpoint)`: e.g. its tunnel not known to be down),
/// the smallest site id.
pub fn choose(
    p: &Peering,
    peerings: &Peerings,
    mut usable: impl FnMut(&str, std::net::SocketAddr) -> bool,
) -> Option<RelayVia> {
    peerings
        .iter()
        .filter(|(site, _)| **site != p.site_id)
        .filter_map(|(site, r)| {
            let remote = r.remote.as_ref().filter(|x| x.relay)?;
            let g = remote.relays.iter().find(|g| g.peer_site == p.site_id)?;
            let endpoint = g.endpoint?;
            // Only on the relay's own gateway: a peer cannot point this
            // site's tunnels at another host.
            let own = remote
                .gateways
                .iter()
                .any(|gw| gw.endpoint.is_some_and(|e| e.ip() == endpoint.ip()));
            (own && usable(site, endpoint)).then(|| RelayVia {
                site: site.clone(),
                endpoint,
                tls_port: remote.relay_tls_port,
            })
        })
        .next()
}

/// What a relay site answers `asking`: one grant per site it asked for.
/// `relays`: this site relays; `endpoint_ip`: its active gateway's
/// address (None: it has no endpoint, so it cannot relay).
pub fn answer(
    asking: &Peering,
    peerings: &Peerings,
    relays: bool,
    endpoint_ip: Option<std::net::IpAddr>,
) -> Vec<pb::RelayGrant> {
    let Some(remote) = &asking.remote else { return vec![] };
    remote
        .relay_for
        .iter()
        .map(|far| {
            let refused = refusal(asking, far, peerings, relays, endpoint_ip.is_some());
            let endpoint = match (&refused, endpoint_ip) {
                (None, Some(ip)) => ports(asking, far, peerings)
                    .map(|(mine, _)| std::net::SocketAddr::new(ip, mine).to_string())
                    .unwrap_or_default(),
                _ => String::new(),
            };
            pb::RelayGrant {
                peer_site: far.clone(),
                endpoint,
                refused: refused.map(|r| r.message).unwrap_or_default(),
            }
        })
        .collect()
}

/// Why a relay site does not relay a tunnel: its metric's reason label,
/// and the words the asking site is told.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// "not_relaying" or "not_peered".
    pub reason: &'static str,
    pub message: String,
}

/// Why a relay site does not relay `asking`'s tunnel to `far` (None: it
/// does, or will once `far` asks too).
pub fn refusal(asking: &Peering, far: &str, peerings: &Peerings, relays: bool, has_endpoint: bool) -> Option<Refusal> {
    let refused = |reason, message: String| Some(Refusal { reason, message });
    if !relays {
        return refused(
            "not_relaying",
            "this site does not relay (its controller runs without --relay)".into(),
        );
    }
    if !has_endpoint {
        return refused(
            "not_relaying",
            "this site's active gateway has no --endpoint to relay at".into(),
        );
    }
    let gone = |p: &Peering| p.remote.is_none() || p.state == crate::domain::PeeringState::Deleting;
    if far == asking.site_id || gone(asking) || peerings.get(far).is_none_or(|p| gone(p)) {
        return refused(
            "not_peered",
            format!("this site is not peered with site {far:?}; a relay carries only tunnels between its own peers"),
        );
    }
    None
}

/// Both sides' ports of the relayed tunnel between `asking` and `far`, once
/// both asked and both got one.
pub fn ports(asking: &Peering, far: &str, peerings: &Peerings) -> Option<(u16, u16)> {
    let other = peerings.get(far)?;
    let asked_back = other
        .remote
        .as_ref()
        .is_some_and(|r| r.relay_for.contains(&asking.site_id));
    let mine = *asking.relay_ports.get(far)?;
    let theirs = *other.relay_ports.get(&asking.site_id)?;
    asked_back.then_some((mine, theirs))
}

/// The relay ports every peering should hold: for each site a peer asked
/// for and this site may relay to, the port it holds, or a free one from
/// `range`. Returns the new maps of the peerings that change, and the
/// (asking, far) pairs refused for want of a port.
#[allow(clippy::type_complexity)]
pub fn allocate(
    peerings: &Peerings,
    relays: bool,
    has_endpoint: bool,
    range: crate::domain::PortRange,
) -> (BTreeMap<String, BTreeMap<String, u16>>, Vec<(String, String)>) {
    // Only pairs whose both ends asked: one peer listing every other peer
    // of this site takes no port for a tunnel nobody else wants.
    let asked = |p: &Peering, far: &str| p.remote.as_ref().is_some_and(|r| r.relay_for.iter().any(|s| s == far));
    let want = |p: &Peering| -> BTreeSet<String> {
        p.remote
            .as_ref()
            .map(|r| {
                r.relay_for
                    .iter()
                    .filter(|far| refusal(p, far, peerings, relays, has_endpoint).is_none())
                    .filter(|far| peerings.get(far.as_str()).is_some_and(|q| asked(q, &p.site_id)))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut next: BTreeMap<String, BTreeMap<String, u16>> = BTreeMap::new();
    let mut used = BTreeSet::new();
    for (site, p) in peerings {
        let w = want(p);
        let mut kept = BTreeMap::new();
        for (far, port) in &p.relay_ports {
            // A port two peerings hold (written from a model that lagged)
            // stays with the first; the other gets a new one.
            if w.contains(far) && range.contains(*port) && used.insert(*port) {
                kept.insert(far.clone(), *port);
            }
        }
        next.insert(site.clone(), kept);
    }
    let mut exhausted = Vec::new();
    let mut free = (range.first..=range.last).filter(|p| !used.contains(p));
    for (site, p) in peerings {
        for far in want(p) {
            let held = next.get_mut(site).expect("every peering has an entry");
            if held.contains_key(&far) {
                continue;
            }
            match free.next() {
                Some(port) => {
                    held.insert(far, port);
                }
                None => exhausted.push((site.clone(), far)),
            }
        }
    }
    next.retain(|site, ports| peerings.get(site).is_some_and(|p| p.relay_ports != *ports));
    (next, exhausted)
}

/// The relay sessions this site's active gateway runs for the tunnels
/// between peer `a` and the peers after it: one per pair whose both sides
/// asked and hold a port, with each side's far-end keys and NAT addresses.
pub fn sessions(peerings: &Peerings, a: &str, bytes_per_second: u64) -> Vec<pb::RelaySession> {
    let mut out = Vec::new();
    let Some(pa) = peerings.get(a) else { return out };
    for far in pa.relay_ports.keys().filter(|f| a < f.as_str()) {
        let Some(pb_) = peerings.get(far) else { continue };
        let Some((port_a, port_b)) = ports(pa, far, peerings) else {
            continue;
        };
        let asked = pa.remote.as_ref().is_some_and(|r| r.relay_for.iter().any(|s| s == far));
        if !asked {
            continue;
        }
        let side = |site: &str, port: u16, me: &Peering, other: &Peering| pb::RelaySide {
            site: site.to_string(),
            port: u32::from(port),
            to_keys: other
                .remote
                .iter()
                .flat_map(|r| r.gateways.iter().filter_map(|g| g.public_key.map(|k| k.to_string())))
                .collect(),
            from_ips: from_ips(me),
        };
        out.push(pb::RelaySession {
            a: Some(side(a, port_a, pa, pb_)),
            b: Some(side(far, port_b, pb_, pa)),
            bytes_per_second,
        });
    }
    out
}

/// The addresses a peer's gateways send from as the outside sees them:
/// their endpoints and reflexive candidates (empty when none is known).
fn from_ips(p: &Peering) -> Vec<String> {
    let mut ips = BTreeSet::new();
    for g in p.remote.iter().flat_map(|r| r.gateways.iter()) {
        if let Some(e) = g.endpoint {
            ips.insert(e.ip().to_string());
        }
        for c in &g.candidates {
            if c.kind == crate::nat::CandidateKind::Reflexive {
                ips.insert(c.address.ip().to_string());
            }
        }
    }
    ips.into_iter().collect()
}

#[cfg(test)]
pub(crate) mod tests;
