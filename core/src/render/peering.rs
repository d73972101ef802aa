//! A gateway's part for one peering: its namespace, tunnel, veth, routes
//! both ways, the peer's gateways as WireGuard peers, exports, the tunnel
//! filter, the NAT of remapped views, and (on a relay site's active
//! gateway) the relayed tunnels.

use super::ids::{PeeringIds, peering_ids, tunnel_rule};
use super::*;
use ipnet::Ipv4Net;

fn route(namespace: &str, table: u32, destination: String, gateway: String, device: &str) -> Kind {
    Kind::Route(pb::Route {
        namespace: namespace.into(),
        table,
        destination,
        gateway,
        device: device.into(),
        peer_site: String::new(),
    })
}

/// Gateway `g`'s part for the peering with `site_id`: its namespace, and
/// once the peer is known the tunnel, the veth to it, the routing both
/// ways, the peer's gateways and the NAT of remapped views.
pub(super) fn peering(m: &Model, g: &Gateway, site_id: &str, base: &str) -> Objects {
    let mut out = Objects::new();
    let Some(p) = m.peerings.get(site_id).filter(|_| m.renders_peering(site_id)) else {
        return Objects::new();
    };
    let ns = peering_namespace(m.site.as_ref().map_or("", |s| s.id.as_str()), site_id);
    out.extend([obj(
        format!("{base}netns"),
        Kind::Namespace(pb::Namespace { name: ns.clone() }),
    )]);
    if let Some(r) = &p.remote {
        let ids = peering_ids(site_id, ns.clone(), p.listen_port);
        out.extend(tunnel_and_veth(base, site_id, p, r, &ids));
        out.extend(view_routes(base, p, &ids));
        out.extend(routes_back(m, base, &ids));
        let through: Vec<Ipv4Net> = crate::transit::rendered(&m.peerings, p)
            .map(|(_, t)| t.view.real)
            .collect();
        let mut through: Vec<String> = through.iter().map(|c| c.to_string()).collect();
        through.extend(super::ipv6::allowed_ips(m, p));
        // Its IPv4 CIDRs only where IPv4 is negotiated (not when either
        // site is IPv6-only).
        let v4 = !p.views.is_empty();
        let own = g.discovered.get(&p.listen_port);
        let tunnel = Tunnel {
            relay: p.relay_via.as_ref(),
            own_endpoint: g.endpoint.is_some(),
            own_families: crate::peer::Families::of(
                g.endpoint
                    .map(|e| e.ip())
                    .into_iter()
                    .chain(g.underlay_ip)
                    .chain(own.iter().flat_map(|d| d.candidates.iter().map(|c| c.address.ip()))),
            ),
            // (and it can try a punch beside a relay: weft's device)
            own_punchable: g.punches_beside
                && matches!(
                    crate::peer::gateway_behaviour(g),
                    Some(crate::nat::Behaviour::EndpointIndependent | crate::nat::Behaviour::None)
                ),
        };
        out.extend(wireguard_peers(base, r, v4, tunnel, &through, &ids));
        out.extend(super::ipv6::peering(m, p, base, &ids));
        out.extend(exports(m, base, &ids));
        out.extend(tunnel_filter(m, g, p, base, &ids));
        out.extend(transit_spoke(m, p, base, &ids));
        out.extend(transit_hub(m, p, base, &ids));
    }
    for (v, id) in p.views.iter().zip(view_ids(&p.views)).filter(|(v, _)| v.remapped()) {
        let tunnel = format!("weft-w{}", peer_link_tag(site_id));
        out.extend([obj(format!("{base}{id}/nat"), nat_map(&ns, v.real, v.local, &tunnel))]);
    }
    out
}

/// On a relay site's active gateway: the relayed tunnels between peer
/// `site_id` and the peers after it (each pair under its first site's
/// part; the index re-renders both parts on a change to either).
pub(super) fn relay_sessions(m: &Model, site_id: &str, base: &str) -> Objects {
    let Some(p) = m.peerings.get(site_id).filter(|_| m.renders_peering(site_id)) else {
        return Objects::new();
    };
    let mut out = Objects::new();
    for s in crate::relay::sessions(&m.peerings, &p.site_id, crate::relay::SESSION_BYTES_PER_SECOND) {
        let Some(b) = s.b.as_ref() else { continue };
        if !m.renders_peering(&b.site) {
            continue;
        }
        out.extend([obj(format!("{base}relay/{}", b.site), Kind::RelaySession(s.clone()))]);
    }
    out
}

/// The WireGuard link (with the probe's address pair) and the veth pair
/// between the gateway and the peering's namespace.
fn tunnel_and_veth(base: &str, site_id: &str, p: &Peering, r: &RemoteSite, ids: &PeeringIds) -> Objects {
    let mut out = Objects::new();
    let (here, there) = tunnel_addresses(r.tunnel_role);
    out.extend([obj(
        format!("{base}wg"),
        Kind::Link(pb::Link {
            name: ids.link.clone(),
            namespace: ids.ns.clone(),
            mtu: r.mtu,
            kind: Some(pb::link::Kind::Wireguard(pb::Wireguard {
                listen_port: u32::from(p.listen_port),
                address: format!("{here}/30"),
                peer_address: there.to_string(),
                peer_site: site_id.to_string(),
                // The peer's controllers echo where this tunnel's socket
                // is seen from outside (endpoint discovery).
                reflectors: r.endpoints.iter().take(crate::nat::MAX_CANDIDATES).cloned().collect(),
            })),
        }),
    )]);
    out.extend([
        obj(
            format!("{base}veth"),
            Kind::Link(pb::Link {
                name: ids.outer.clone(),
                namespace: String::new(),
                mtu: r.mtu,
                kind: Some(pb::link::Kind::Veth(pb::Veth {
                    peer_name: ids.inner.clone(),
                    peer_namespace: ids.ns.clone(),
                })),
            }),
        ),
        obj(
            format!("{base}veth/outer"),
            Kind::Address(pb::Address {
                link: ids.outer.clone(),
                namespace: String::new(),
                cidr: format!("{}/30", ids.outer_ip),
                no_prefix_route: true,
            }),
        ),
        // The namespace's end, in weft's table: the gateway host's main
        // table gets no route into the peering.
        obj(
            format!("{base}veth/route"),
            route("", TABLE, format!("{}/32", ids.inner_ip), String::new(), &ids.outer),
        ),
        obj(
            format!("{base}veth/inner"),
            Kind::Address(pb::Address {
                link: ids.inner.clone(),
                namespace: ids.ns.clone(),
                cidr: format!("{}/30", ids.inner_ip),
                no_prefix_route: false,
            }),
        ),
    ]);
    out
}

/// The peer's local views: routed from the gateway into the peering's
/// namespace (table 7765, selected by weft's rule), and from there into
/// the tunnel (table 1, selected by the arriving interface, so a peer CIDR
/// equal to our own still goes the right way).
fn view_routes(base: &str, p: &Peering, ids: &PeeringIds) -> Objects {
    let mut out = Objects::new();
    for (v, id) in p.views.iter().zip(view_ids(&p.views)) {
        out.extend([
            obj(
                format!("{base}{id}/via"),
                route("", TABLE, v.local.to_string(), ids.inner_ip.to_string(), &ids.outer),
            ),
            obj(format!("{base}{id}/rule"), host_rule(v.local)),
            // Peering namespace: what comes from the gateway goes into
            // the tunnel (table 1, chosen by the arriving interface, so
            // a peer CIDR equal to our own still goes the right way).
            obj(
                format!("{base}{id}/tunnel"),
                route(&ids.ns, NS_TUNNEL_TABLE, v.real.to_string(), String::new(), &ids.link),
            ),
        ]);
    }
    out.extend([obj(format!("{base}tunnel-rule"), tunnel_rule(ids, false))]);
    out
}

/// This site's own networks, from the peering's namespace back to the
/// gateway.
fn routes_back(m: &Model, base: &str, ids: &PeeringIds) -> Objects {
    let mut out = Objects::new();
    if let Some(site) = &m.site {
        let own: Vec<String> = site.exportable().map(|c| c.to_string()).collect();
        for (i, c) in own.into_iter().enumerate() {
            out.extend([obj(
                format!("{base}back/{i}"),
                route(&ids.ns, 0, c, ids.outer_ip.to_string(), &ids.inner),
            )]);
        }
    }
    out
}

/// What the peering's namespace forwards from the tunnel: this site's
/// workload and external CIDRs (the peer's traffic and the replies to the
/// nodes' own traffic) and the exported hosts (after their DNAT); nothing
/// else, so a peer never reaches the gateway host or the overlay. Within
/// that, the peering's export policy ([`crate::export`]); its IPv6 rules
/// only for a gateway whose agent takes them (an earlier one refuses the
/// whole filter), so elsewhere IPv6 is refused, not let through.
fn tunnel_filter(m: &Model, g: &Gateway, p: &Peering, base: &str, ids: &PeeringIds) -> Objects {
    let Some(site) = &m.site else { return Objects::new() };
    let mut allowed: Vec<String> = site.exportable().map(|c| c.to_string()).collect();
    allowed.extend(
        m.names
            .values()
            .filter(|n| n.external.is_some())
            .filter_map(|n| n.address.map(|a| format!("{a}/32"))),
    );
    allowed.extend(super::ipv6::filter_allowed(m, p));
    let onward = crate::transit::onward(m.peerings.values().map(|q| &**q), p);
    // Forwarded and counted per site, in both families.
    let mut transit: Vec<pb::TransitPrefixes> = onward
        .iter()
        .map(|(site, cidrs)| pb::TransitPrefixes {
            site: site.clone(),
            cidrs: cidrs.iter().map(|c| c.to_string()).collect(),
        })
        .collect();
    if g.enforces_export_v6 {
        for (site, cidrs) in crate::transit::onward_v6(m.peerings.values().map(|q| &**q), p) {
            let v6 = cidrs.iter().map(|c| c.to_string());
            let t = match transit.iter().position(|t| t.site == site) {
                Some(i) => &mut transit[i],
                // (as many sites as an agent takes, IPv4's first)
                None if transit.len() < crate::transit::MAX_ROUTES => {
                    transit.push(pb::TransitPrefixes { site, cidrs: vec![] });
                    transit.last_mut().expect("just pushed")
                }
                None => continue,
            };
            // Within what every agent takes per site (IPv4's first).
            let room = crate::transit::MAX_FILTER_PREFIXES.saturating_sub(t.cidrs.len());
            t.cidrs.extend(v6.take(room));
        }
        transit.retain(|t| !t.cidrs.is_empty());
    }
    // Rules naming a site reached through this one hold while it is.
    let policy = crate::export::effective(site, p).map(|r| {
        let mut rules = crate::export::live(r, &onward);
        rules.retain(|r| g.enforces_export_v6 || r.cidr.addr().is_ipv4());
        rules
    });
    Objects::from([obj(
        format!("{base}filter"),
        Kind::TunnelFilter(pb::TunnelFilter {
            namespace: ids.ns.clone(),
            tunnel: ids.link.clone(),
            allowed,
            policed: policy.is_some(),
            exports: policy.unwrap_or_default().iter().map(crate::export::rule_pb).collect(),
            transit,
        }),
    )])
}

/// On a spoke: the sites it reaches through this peer (transit), as the
/// peer's own views are: routed from the gateway into the peering's
/// namespace and from there into the tunnel, with this site's view mapped
/// to the peer's (1:1 NAT) when they differ. Nodes route them to the
/// gateway like any view (`node_shared`).
fn transit_spoke(m: &Model, p: &Peering, base: &str, ids: &PeeringIds) -> Objects {
    let mut out = Objects::new();
    for (i, t) in crate::transit::rendered(&m.peerings, p) {
        let id = format!("{base}transit/{}/{i}", t.site);
        let v = &t.view;
        out.extend([
            obj(
                format!("{id}/via"),
                route("", TABLE, v.local.to_string(), ids.inner_ip.to_string(), &ids.outer),
            ),
            obj(format!("{id}/rule"), host_rule(v.local)),
            obj(
                format!("{id}/tunnel"),
                route(&ids.ns, NS_TUNNEL_TABLE, v.real.to_string(), String::new(), &ids.link),
            ),
        ]);
        if v.remapped() {
            out.extend([obj(format!("{id}/nat"), nat_map(&ids.ns, v.real, v.local, &ids.link))]);
        }
    }
    out
}

/// On a hub: what comes out of this peer's tunnel for another transit
/// peer goes back to the gateway, whose routes take it into that peer's
/// namespace (its own NAT maps it to that peer's real CIDR). The tunnel
/// filter allows and counts it (`tunnel_filter`).
fn transit_hub(m: &Model, p: &Peering, base: &str, ids: &PeeringIds) -> Objects {
    let mut out = Objects::new();
    for (site, cidrs) in crate::transit::onward(m.peerings.values().map(|q| &**q), p) {
        for (i, c) in cidrs.iter().enumerate() {
            out.extend([obj(
                format!("{base}onward/{site}/{i}"),
                route(&ids.ns, 0, c.to_string(), ids.outer_ip.to_string(), &ids.inner),
            )]);
        }
    }
    out
}

/// This site's exported hosts, as the peer reaches them: what comes out of
/// the tunnel for an export's external address goes to the host (DNAT in
/// the peering's namespace), routed back to the gateway, whose own routes
/// reach the host's LAN.
fn exports(m: &Model, base: &str, ids: &PeeringIds) -> Objects {
    let mut out = Objects::new();
    for n in m.names.values() {
        let (Some(external), Some(host)) = (n.external, n.address) else {
            continue;
        };
        out.extend([
            obj(
                format!("{base}export/{}", n.name),
                Kind::ExportMap(pb::ExportMap {
                    namespace: ids.ns.clone(),
                    tunnel: ids.link.clone(),
                    external_address: external.to_string(),
                    host_address: host.to_string(),
                }),
            ),
            obj(
                format!("{base}export/{}/route", n.name),
                route(&ids.ns, 0, format!("{host}/32"), ids.outer_ip.to_string(), &ids.inner),
            ),
        ]);
    }
    out
}

/// How the rendered gateway reaches the peer's: through a relay, and
/// whether it has an endpoint of its own.
#[derive(Clone, Copy)]
struct Tunnel<'a> {
    relay: Option<&'a crate::domain::RelayVia>,
    own_endpoint: bool,
    /// The families of its own addresses (see `peer::Families`).
    own_families: crate::peer::Families,
    /// Its NAT keeps one outside port per socket (or it has none): a hole
    /// punch from it can work.
    own_punchable: bool,
}

/// The peer's gateways as WireGuard peers: the active one with the peer's
/// CIDRs, standbys without (their sessions ready for a failover).
fn wireguard_peers(
    base: &str,
    r: &RemoteSite,
    v4: bool,
    tunnel: Tunnel<'_>,
    through: &[String],
    ids: &PeeringIds,
) -> Objects {
    let Tunnel {
        relay,
        own_endpoint,
        own_punchable,
        own_families,
    } = tunnel;
    let mut out = Objects::new();
    let (_, there) = tunnel_addresses(r.tunnel_role);
    // Inside the tunnel both ends use their own addresses: the peer's
    // real CIDRs, its views of the sites reached through it, and its IPv6
    // CIDRs once negotiated (`through`).
    let mut allowed: Vec<String> = Vec::new();
    if v4 {
        allowed.extend(r.workload_cidrs.iter().map(|c| c.to_string()));
        allowed.extend(r.external_cidr.map(|c| c.to_string()));
    }
    allowed.extend(through.iter().cloned());
    allowed.push(format!("{there}/32"));
    // Only the active gateway gets the peer's CIDRs; standbys are
    // peers without allowed IPs, their sessions ready for a
    // failover. (A peer that flags none: all, as before.)
    let none_flagged = !r.gateways.iter().any(|g| g.active);
    for g in r.gateways.iter().filter(|g| g.public_key.is_some()) {
        let allowed = if g.active || none_flagged {
            allowed.clone()
        } else {
            vec![]
        };
        // Without a direct path (none, or a hole punch that did not come
        // up), the active gateway is reached through the chosen relay.
        let via_relay = relay.filter(|_| g.active || none_flagged).map(|r| r.endpoint);
        let direct = crate::peer::dial_address_for(g, own_families);
        // A reflexive address and no endpoint of ours (neither side
        // reachable unasked): both NATs must open before either lets the
        // other in.
        let punch = via_relay.is_none() && direct.is_some() && g.endpoint.is_none() && !own_endpoint;
        // Through a relay where a hole punch could work (neither side
        // reachable unasked, both NATs keeping their ports): the punch is
        // tried beside the relay, and the tunnel moves to it once it
        // answers (`pb::WireguardPeer::direct`).
        let beside = via_relay
            .and(direct)
            .filter(|_| g.endpoint.is_none() && !own_endpoint && own_punchable);
        // Where UDP is blocked, the tunnel may go over TLS to the relay
        // (a relayed tunnel's relay, or a relay site's own gateway).
        let tls_port = match (via_relay, relay) {
            (Some(_), Some(r)) => r.tls_port,
            _ if g.endpoint.is_some() && (g.active || none_flagged) => r.relay_tls_port,
            _ => 0,
        };
        out.extend([obj(
            format!("{base}wgpeer/{}", g.name),
            Kind::WireguardPeer(pb::WireguardPeer {
                link: ids.link.clone(),
                namespace: ids.ns.clone(),
                public_key: g.public_key.map(|k| k.to_string()).unwrap_or_default(),
                endpoint: via_relay.or(direct).map(|e| e.to_string()).unwrap_or_default(),
                allowed_ips: allowed,
                persistent_keepalive: 25,
                punch,
                tls_port: u32::from(tls_port),
                direct: beside.map(|d| d.to_string()).unwrap_or_default(),
            }),
        )]);
    }
    out
}
