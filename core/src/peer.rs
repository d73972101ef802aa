//! What a peer site sends, checked before anything is recorded: its
//! networks, gateways, controller endpoints, MTU and names, and what the
//! two sites agree on from both sides' parameters. The controller parses
//! the peer's CA certificate (TLS is not the core's) and records what
//! [`remote_site`] returns; an error is the message of an invalid argument,
//! naming the field.

use weft_proto::v1 as pb;

use crate::domain::{RemoteGateway, RemoteSite, TunnelRole, parse_cidr};

/// The tunnel MTU two sites agree on: the lower of the values each
/// configured (0 = "derive it from the gateway's underlay"), never below
/// 1280; 0 when neither configured one.
pub fn agreed_mtu(theirs: u32, ours: u32) -> u32 {
    match (theirs, ours) {
        (0, 0) => 0,
        (0, m) | (m, 0) => m.max(1280),
        (a, b) => a.min(b).max(1280),
    }
}

/// The most gateways a peer may list (an active/standby pair needs two).
pub const MAX_PEER_GATEWAYS: usize = 16;

/// A peer's gateway as it described it, checked field by field: a valid
/// name, an endpoint that is an address and a port from 1 to 65535 (or
/// none: the peer dials out) and that a gateway can be at (as a candidate:
/// not loopback, link-local, multicast…), a 32-byte base64 WireGuard key
/// (or none yet).
pub fn remote_gateway(i: usize, g: &pb::GatewayInfo) -> Result<RemoteGateway, String> {
    crate::domain::validate_name(&format!("gateways[{i}].name"), &g.name)?;
    let field = format!("gateways[{i}].endpoint");
    let endpoint = match g.endpoint.as_str() {
        "" => None,
        e => {
            let a = weft_types::net::endpoint(e).map_err(|m| format!("{field} {m}"))?;
            // Checked against this site's hosts where the peering is
            // planned, as candidates are.
            crate::nat::endpoint(&field, a, &[], false)?;
            Some(a)
        }
    };
    let public_key = match g.public_key.as_str() {
        "" => None,
        k => Some(weft_types::WgKey::parse(&format!("gateways[{i}].public_key"), k)?),
    };
    // Checked against this site's hosts where the peering is planned
    // (`nat::candidates` again, with them); here the shape.
    let candidates = crate::nat::both_families(
        &format!("gateways[{i}].candidates"),
        &g.candidates,
        &g.candidates_v6,
        &[],
    )?;
    let nat = crate::nat::Behaviour::parse(&g.nat).map_err(|m| format!("gateways[{i}].nat: {m}"))?;
    Ok(RemoteGateway {
        name: g.name.clone(),
        endpoint,
        public_key,
        active: g.active,
        candidates,
        nat,
    })
}

/// The most controller endpoints a peer may list.
pub const MAX_PEER_ENDPOINTS: usize = 16;

/// Checks a peer's controller endpoint before this controller ever dials
/// it: `host:port` (a DNS name or an address, port 1–65535), and not an
/// address on this host or no host at all (loopback, unspecified, link-local,
/// multicast), so a peer cannot point this controller at its own local
/// services; loopback is allowed where this site is itself served on
/// loopback (`lab`: every site on one host).
pub fn controller_endpoint(e: &str, lab: bool) -> Result<(), String> {
    let shown = crate::domain::shown(e);
    if let Ok(a) = e.parse::<std::net::SocketAddr>() {
        let ip = a.ip();
        let local = (ip.is_loopback() && !lab)
            || ip.is_unspecified()
            || ip.is_multicast()
            || matches!(ip, std::net::IpAddr::V4(v4) if v4.is_link_local() || v4.is_broadcast())
            || matches!(ip, std::net::IpAddr::V6(v6) if v6.is_unicast_link_local());
        if a.port() == 0 || local {
            return Err(format!(
                "{shown} is not an address another site's controller can serve on"
            ));
        }
        return Ok(());
    }
    let ok = e.rsplit_once(':').is_some_and(|(host, port)| {
        port.parse::<u16>().is_ok_and(|p| p != 0)
            && !host.is_empty()
            && host.len() <= 253
            && host != "localhost"
            && host
                .split('.')
                .all(|l| !l.is_empty() && l.len() <= 63 && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'))
    });
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{shown} is not host:port (a DNS name or an address, and a port from 1 to 65535)"
        ))
    }
}

/// Which side of the tunnel this site takes: the side with a reachable
/// gateway endpoint serves; when both have one, the smaller site id serves.
/// Both sides compute the same answer.
pub fn tunnel_role(own_id: &str, own_has_endpoint: bool, peer_id: &str, peer_has_endpoint: bool) -> TunnelRole {
    match (own_has_endpoint, peer_has_endpoint) {
        (true, false) => TunnelRole::Server,
        (false, true) => TunnelRole::Client,
        _ if own_id < peer_id => TunnelRole::Server,
        _ => TunnelRole::Client,
    }
}

/// A remote site's record from what it sent (`p`), beside this site's
/// own parameters (`own`), validated as a whole; `ca_pem` and
/// `ca_fingerprint` are its CA certificate, already parsed by the caller.
pub fn remote_site(
    ca_pem: &str,
    ca_fingerprint: &str,
    p: &pb::NetworkParams,
    own: &pb::NetworkParams,
) -> Result<RemoteSite, String> {
    let mut workload = Vec::new();
    for (i, c) in p.workload_cidrs.iter().enumerate() {
        workload.push(parse_cidr(c).map_err(|m| format!("workload_cidrs[{i}]: {m}"))?);
    }
    let external = match p.external_cidr.trim() {
        "" => None,
        c => Some(parse_cidr(c).map_err(|m| format!("external_cidr: {m}"))?),
    };
    // An IPv6-only site sends no IPv4 at all.
    if let (true, Some(e)) = (workload.is_empty(), external) {
        return Err(format!(
            "external_cidr: {e} is given without any IPv4 workload CIDR; a site without IPv4 pods sends none"
        ));
    }
    // IPv6 fields that do not parse cost the peering its IPv6 only.
    let (mut workload_v6, mut external_v6, mut ipv6_invalid) = match ipv6_cidrs(p) {
        Ok((w, e)) => (w, e, None),
        Err(m) => (vec![], None, Some(m)),
    };
    // So do IPv6 exports that do not hold.
    let exported_v6 = match crate::export::check_exported_v6(p, &workload_v6, external_v6) {
        Ok(x) => x,
        Err(m) => {
            (workload_v6, external_v6) = (vec![], None);
            ipv6_invalid = ipv6_invalid.or(Some(m));
            vec![]
        }
    };
    let gateways = p
        .gateways
        .iter()
        .enumerate()
        .map(|(i, g)| remote_gateway(i, g))
        .collect::<Result<Vec<_>, _>>()?;
    if gateways.len() > MAX_PEER_GATEWAYS {
        return Err(format!(
            "gateways: {} listed; a site has at most {MAX_PEER_GATEWAYS}",
            gateways.len()
        ));
    }
    if p.mtu != 0 && !(1280..=9000).contains(&p.mtu) {
        return Err(format!(
            "mtu: {} is out of range; a tunnel MTU is 1280 to 9000 (or 0: derived by each gateway)",
            p.mtu
        ));
    }
    if p.endpoints.len() > MAX_PEER_ENDPOINTS {
        return Err(format!(
            "endpoints: {} listed; a site lists at most {MAX_PEER_ENDPOINTS} controller endpoints",
            p.endpoints.len()
        ));
    }
    // Loopback only between sites that are both on one host (a lab).
    let lab = !own.endpoints.is_empty()
        && own
            .endpoints
            .iter()
            .all(|e| e.parse::<std::net::SocketAddr>().is_ok_and(|a| a.ip().is_loopback()));
    for (i, e) in p.endpoints.iter().enumerate() {
        controller_endpoint(e, lab).map_err(|m| format!("endpoints[{i}]: {m}"))?;
    }
    let names: Vec<_> = p
        .names
        .iter()
        .map(|n| {
            (
                n.name.clone(),
                crate::names::NameKind::from_pb(n.kind),
                n.address.clone(),
                n.address_v6.clone(),
            )
        })
        .collect();
    let names = crate::names::check_remote(&names, &workload, external, &workload_v6)?;
    let mut transit_routes = crate::transit::check_routes(p, &own.site_id, &workload, external)?;
    // Their IPv6 CIDRs, checked as the others: wrong ones cost the
    // peering its IPv6 only.
    let mut exported_v6 = exported_v6;
    if ipv6_invalid.is_none()
        && let Err(m) = crate::transit::check_routes_v6(p, &mut transit_routes, &workload_v6, external_v6)
    {
        for r in &mut transit_routes {
            (r.workload_cidrs_v6, r.external_cidr_v6) = (vec![], None);
        }
        (workload_v6, external_v6, exported_v6) = (vec![], None, vec![]);
        ipv6_invalid = Some(m);
    }
    let exported = crate::export::check_exported(p, &workload, external, &transit_routes)?;
    let has_endpoint = |ps: &pb::NetworkParams| ps.gateways.iter().any(|g| !g.endpoint.is_empty());
    Ok(RemoteSite {
        ca_pem: ca_pem.to_string(),
        ca_fingerprint: ca_fingerprint.to_string(),
        workload_cidrs: workload,
        external_cidr: external,
        workload_cidrs_v6: workload_v6,
        external_cidr_v6: external_v6,
        ipv6_invalid,
        gateways,
        mtu: agreed_mtu(p.mtu, own.mtu),
        endpoints: p.endpoints.clone(),
        tunnel_role: tunnel_role(&own.site_id, has_endpoint(own), &p.site_id, has_endpoint(p)),
        names,
        relay: p.relay,
        relay_tls_port: match p.relay_tls_port {
            _ if !p.relay => 0,
            0 => 0,
            n @ 1..=65535 => n as u16,
            n => return Err(format!("relay_tls_port: {n} is not a TCP port (1-65535)")),
        },
        relay_for: crate::relay::requests(&p.site_id, &p.relay_for)?,
        relays: crate::relay::grants(&p.relays, &[])?,
        exported,
        exported_v6,
        transit: p.transit,
        transit_v6: p.transit_v6,
        version: match p.version.as_str() {
            v if weft_types::version::plausible(v) => v.to_string(),
            v => {
                return Err(format!(
                    "version: {} is not a release (at most 32 printable characters)",
                    crate::domain::shown(v)
                ));
            }
        },
        trusts_ca: match p.trusted_ca.as_str() {
            f if f.is_empty()
                || (f.len() == 64 && f.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))) =>
            {
                f.to_string()
            }
            f => {
                return Err(format!(
                    "trusted_ca: {} is not a certificate fingerprint (64 lower-case hex digits)",
                    crate::domain::shown(f)
                ));
            }
        },
        transit_routes,
        readiness: p.readiness.as_ref().map(readiness).transpose()?,
    })
}

/// A peer's IPv6 CIDRs, each parsed as IPv6, at most
/// [`crate::ipam::MAX_PEER_CIDRS`] with the IPv4 ones. An error here, like
/// a refusal where views are planned, leaves IPv6 not negotiated and the
/// rest of the peering as it is.
fn ipv6_cidrs(p: &pb::NetworkParams) -> Result<(Vec<ipnet::Ipv6Net>, Option<ipnet::Ipv6Net>), String> {
    let count = p.workload_cidrs.len() + p.workload_cidrs_v6.len() + 2;
    if count > crate::ipam::MAX_PEER_CIDRS + 2 {
        return Err(format!(
            "workload_cidrs_v6: {} listed with {} IPv4 ones; a site lists at most {} workload CIDRs",
            p.workload_cidrs_v6.len(),
            p.workload_cidrs.len(),
            crate::ipam::MAX_PEER_CIDRS
        ));
    }
    let v6 = |field: &str, text: &str| -> Result<ipnet::Ipv6Net, String> {
        let c = weft_types::net::cidr(text).map_err(|m| format!("{field}: {m}"))?;
        c.v6()
            .ok_or_else(|| format!("{field}: {c} is IPv4; IPv4 CIDRs go in the IPv4 fields"))
    };
    let workload = p
        .workload_cidrs_v6
        .iter()
        .enumerate()
        .map(|(i, c)| v6(&format!("workload_cidrs_v6[{i}]"), c))
        .collect::<Result<Vec<_>, _>>()?;
    let external = match p.external_cidr_v6.trim() {
        "" => None,
        c => Some(v6("external_cidr_v6", c)?),
    };
    Ok((workload, external))
}

/// A peer's readiness as it told it: the gateway it names must be a name.
fn readiness(r: &pb::PeerReadiness) -> Result<crate::domain::PeerReadiness, String> {
    if !r.active_gateway.is_empty() {
        crate::domain::validate_name("readiness.active_gateway", &r.active_gateway)?;
    }
    Ok(crate::domain::PeerReadiness {
        routes_applied: r.routes_applied,
        active_gateway: r.active_gateway.clone(),
    })
}

/// The address families a gateway can reach peers by: those of its own
/// addresses (its endpoint, its candidates, its underlay address); both
/// when none is known yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Families {
    pub v4: bool,
    pub v6: bool,
}

impl Families {
    pub const BOTH: Families = Families { v4: true, v6: true };

    pub fn of(addrs: impl IntoIterator<Item = std::net::IpAddr>) -> Families {
        let mut f = Families { v4: false, v6: false };
        for a in addrs {
            match a.to_canonical() {
                std::net::IpAddr::V4(_) => f.v4 = true,
                std::net::IpAddr::V6(_) => f.v6 = true,
            }
        }
        if f.v4 || f.v6 { f } else { Families::BOTH }
    }

    /// Of a gateway as its site tells it (`GatewayInfo`).
    pub fn of_info(g: &pb::GatewayInfo) -> Families {
        let addrs = std::iter::once(g.endpoint.as_str())
            .chain(g.candidates.iter().chain(&g.candidates_v6).map(|c| c.address.as_str()))
            .filter_map(|a| a.parse::<std::net::SocketAddr>().ok())
            .map(|a| a.ip());
        Families::of(addrs)
    }
}

/// The address to send a peer gateway's tunnel traffic to: its configured
/// endpoint when it has one; else, when its NAT keeps one external port
/// for every destination (or it has none), where a reflector saw it, so
/// that both sides send at once and each NAT lets the other in (hole
/// punching). None: wait for it to dial (or for a relay). Of its
/// reflexive candidates, an IPv4 one where this side has IPv4, else an
/// IPv6 one where it has IPv6: both sides choose alike, so both punch in
/// the same family.
pub fn dial_address(g: &RemoteGateway) -> Option<std::net::SocketAddr> {
    dial_address_for(g, Families::BOTH)
}

/// [`dial_address`] from a gateway of families `own`.
pub fn dial_address_for(g: &RemoteGateway, own: Families) -> Option<std::net::SocketAddr> {
    if let Some(e) = g.endpoint {
        return Some(e);
    }
    let punchable = matches!(
        g.nat,
        Some(crate::nat::Behaviour::EndpointIndependent | crate::nat::Behaviour::None)
    );
    let reflexive = |v6: bool| {
        g.candidates
            .iter()
            .find(|c| c.kind == crate::nat::CandidateKind::Reflexive && c.address.is_ipv6() == v6)
            .map(|c| c.address)
    };
    let v4 = reflexive(false).filter(|_| own.v4);
    v4.or_else(|| reflexive(true).filter(|_| own.v6)).filter(|_| punchable)
}

/// The path a tunnel can take, from both sides' gateways: "direct" when one
/// side has a configured endpoint, "hole-punched" when neither has one but
/// one side can be dialled at a reflexive candidate, else "waiting".
pub fn path(
    own_has_endpoint: bool,
    peer_active: Option<&RemoteGateway>,
    own_nat: Option<crate::nat::Behaviour>,
) -> &'static str {
    path_from(own_has_endpoint, peer_active, own_nat, Families::BOTH)
}

/// [`path`] from a gateway of families `own`.
pub fn path_from(
    own_has_endpoint: bool,
    peer_active: Option<&RemoteGateway>,
    own_nat: Option<crate::nat::Behaviour>,
    own: Families,
) -> &'static str {
    let Some(g) = peer_active else { return "waiting" };
    if own_has_endpoint || g.endpoint.is_some() {
        return "direct";
    }
    let own_punchable = matches!(
        own_nat,
        Some(crate::nat::Behaviour::EndpointIndependent | crate::nat::Behaviour::None)
    );
    if dial_address_for(g, own).is_some() && own_punchable {
        "hole-punched"
    } else {
        "waiting"
    }
}

/// A gateway's NAT over all its peerings' sockets: the least permissive
/// behaviour any of them showed (one port per destination on any socket
/// means the NAT does that).
pub fn gateway_behaviour(g: &crate::domain::Gateway) -> Option<crate::nat::Behaviour> {
    use crate::nat::Behaviour::*;
    let seen: Vec<_> = g.discovered.values().filter_map(|d| d.nat).collect();
    [EndpointDependent, EndpointIndependent, None, Unknown]
        .into_iter()
        .find(|b| seen.contains(b))
}

/// The path peering `p`'s tunnel can take without a relay (see [`path`]),
/// from this site's gateways as the peer dials them and the peer's as
/// recorded.
pub fn direct_path(p: &crate::domain::Peering, local: &[pb::GatewayInfo]) -> &'static str {
    let own = local.iter().find(|g| g.active).or(local.first());
    let peer = p
        .remote
        .as_ref()
        .and_then(|r| r.gateways.iter().find(|g| g.active).or(r.gateways.first()));
    path_from(
        own.is_some_and(|g| !g.endpoint.is_empty()),
        peer,
        own.and_then(|g| crate::nat::Behaviour::parse(&g.nat).ok().flatten()),
        own.map_or(Families::BOTH, Families::of_info),
    )
}

/// Whether this site asks relays to carry peering `p`'s tunnel (see
/// `relay`): it is negotiated and no direct path exists.
pub fn wants_relay(p: &crate::domain::Peering, local: &[pb::GatewayInfo]) -> bool {
    p.state != crate::domain::PeeringState::Deleting && p.remote.is_some() && direct_path(p, local) == "waiting"
}

/// The path peering `p`'s tunnel takes: [`direct_path`], or "relayed via
/// SITE" while a relay was chosen (no direct path, or a hole punch not up
/// yet), unless the gateway says the tunnel moved to the punch tried
/// beside the relay (`on_direct`). A hole punch is claimed
/// only while the tunnel is up (`up`: as its gateway reports it): NAT
/// behaviour seen through one reflector alone can be mistaken, and then
/// the punch fails.
pub fn tunnel_path(p: &crate::domain::Peering, local: &[pb::GatewayInfo], up: bool, on_direct: bool) -> String {
    match (direct_path(p, local), &p.relay_via) {
        ("hole-punched", Some(_)) if up && on_direct => "hole-punched".into(),
        ("waiting" | "hole-punched", Some(r)) => format!("relayed via {}", r.site),
        ("hole-punched", _) if !up => "waiting".into(),
        (other, _) => other.into(),
    }
}

#[cfg(test)]
mod tests;
