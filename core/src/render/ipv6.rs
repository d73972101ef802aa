//! The IPv6 part of what agents get, beside the IPv4 part it mirrors: for
//! a site with IPv6 networks, and per peering for the IPv6 views both
//! sides negotiated.
//!
//! The overlay stays addressed in IPv4 (a node's internal address). IPv6
//! routes need IPv6 next hops, so every overlay link also takes an IPv6
//! link-local address derived from its end's internal IPv4 address
//! (`fe80::a50:3` for 10.80.0.3): unique on the link, known to both ends
//! without allocating anything. Each peering's veth takes `fe80::1` (the
//! gateway's end) and `fe80::2` (the namespace's). Link-local addresses
//! are scoped to their link, so the same pair on every veth is harmless.
//!
//! Ids: `…/v6/…` beside their IPv4 counterparts; views by index.

use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::Ipv6Net;

use super::ids::{PeeringIds, tunnel_rule};
use super::*;
use crate::ipam::View;

/// The IPv6 link-local address of an overlay end whose internal address
/// is `ip`.
pub fn link_local(ip: Ipv4Addr) -> Ipv6Addr {
    Ipv6Addr::from((0xfe80u128 << 112) | u128::from(u32::from(ip)))
}

/// The gateway's end of every peering's veth, and the namespace's.
const VETH_OUTER: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
const VETH_INNER: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 2);

/// A node's "unknown source" IPv6 address: its internal address's host
/// part in the site's IPv6 external CIDR. None without one, or if it does
/// not fit.
pub fn external_address(site: &Site, internal_ip: Ipv4Addr) -> Option<Ipv6Addr> {
    let ext = site.ipv6.as_ref()?.external_cidr?;
    let host = u32::from(internal_ip).checked_sub(u32::from(site.internal_cidr.network()))?;
    (u128::from(host) < crate::ipam::size(&ext)).then(|| Ipv6Addr::from(u128::from(ext.network()) + u128::from(host)))
}

/// The IPv6 views a peering carries: none unless both sides negotiated
/// them and this site has IPv6.
pub(super) fn views<'a>(m: &Model, p: &'a Peering) -> &'a [View<Ipv6Net>] {
    match m.site.as_ref().and_then(|s| s.ipv6.as_ref()) {
        Some(_) if p.ipv6_refused.is_none() => &p.views_v6,
        _ => &[],
    }
}

fn address(link: &str, namespace: &str, ip: Ipv6Addr) -> Kind {
    Kind::Address(pb::Address {
        link: link.into(),
        namespace: namespace.into(),
        cidr: format!("{ip}/64"),
        no_prefix_route: false,
    })
}

fn route(namespace: &str, table: u32, destination: String, gateway: Option<Ipv6Addr>, device: &str) -> Kind {
    Kind::Route(pb::Route {
        namespace: namespace.into(),
        table,
        destination,
        gateway: gateway.map(|g| g.to_string()).unwrap_or_default(),
        device: device.into(),
        peer_site: String::new(),
    })
}

/// A node's own IPv6 part: its link-local address on the overlay, and the
/// source NAT of its host's IPv6 traffic to its external address.
pub(super) fn node_own(site: &Site, ip: Ipv4Addr) -> Objects {
    let Some(v6) = &site.ipv6 else { return Objects::new() };
    let mut out = Objects::from([obj("self/v6/addr".into(), address(NODE_LINK, "", link_local(ip)))]);
    if let Some(ext) = external_address(site, ip) {
        out.extend([obj(
            "self/v6/host-snat".into(),
            Kind::HostSnat(pb::HostSnat {
                link: NODE_LINK.into(),
                address: ext.to_string(),
                except: v6.pod_cidrs.iter().map(|c| c.to_string()).collect(),
            }),
        )]);
    }
    out
}

/// On every node: the peer's IPv6 views, and those of the sites reached
/// through it (transit), through the active gateway.
pub(super) fn node_shared(m: &Model, p: &Peering, gw_ip: Ipv4Addr) -> Objects {
    let mut out = Objects::new();
    let to_gateway = |base: String, site: &str, local: Ipv6Net| {
        [
            obj(
                format!("{base}/route"),
                Kind::Route(pb::Route {
                    namespace: String::new(),
                    table: TABLE,
                    destination: local.to_string(),
                    gateway: link_local(gw_ip).to_string(),
                    device: NODE_LINK.into(),
                    peer_site: site.to_string(),
                }),
            ),
            obj(format!("{base}/rule"), host_rule(local)),
        ]
    };
    for (i, v) in views(m, p).iter().enumerate() {
        out.extend(to_gateway(format!("peer/{}/v6/{i}", p.site_id), &p.site_id, v.local));
    }
    if m.site.as_ref().is_some_and(|s| s.ipv6.is_some()) {
        for (i, t) in crate::transit::rendered_v6(&m.peerings, p) {
            let base = format!("peer/{}/transit/{}/v6/{i}", p.site_id, t.site);
            out.extend(to_gateway(base, &t.site, t.view.local));
        }
    }
    out
}

/// A gateway's IPv6 part of its tunnel to node `n`: its link-local
/// address on the link, the node's /64 and its host's external address.
pub(super) fn node_tunnel(m: &Model, n: &Node, gw_ip: Ipv4Addr, ip: Ipv4Addr, link: &str, base: &str) -> Objects {
    let Some(site) = m.site.as_ref().filter(|s| s.ipv6.is_some()) else {
        return Objects::new();
    };
    let node = link_local(ip);
    let mut out = Objects::from([obj(format!("{base}v6/addr"), address(link, "", link_local(gw_ip)))]);
    if let Some(subnet) = n.subnet_v6 {
        out.extend([obj(
            format!("{base}v6/route"),
            route("", TABLE, subnet.to_string(), Some(node), link),
        )]);
    }
    if let Some(ext) = external_address(site, ip) {
        out.extend([obj(
            format!("{base}v6/external"),
            route("", TABLE, format!("{ext}/128"), Some(node), link),
        )]);
    }
    out
}

/// The site's own IPv6 networks, which a gateway's rules send to weft's
/// table.
fn own(site: &Site) -> Vec<Ipv6Net> {
    site.ipv6
        .as_ref()
        .map(|v6| v6.pod_cidrs.iter().copied().chain(v6.external_cidr).collect())
        .unwrap_or_default()
}

/// Gateway-wide: the rules for the site's IPv6 networks.
pub(super) fn gateway_self(site: &Site) -> Objects {
    own(site)
        .into_iter()
        .enumerate()
        .map(|(i, c)| obj(format!("self/v6/rule/{i}"), host_rule(c)))
        .collect()
}

/// A peering's IPv6 part on a gateway: the veth's link-local pair, the
/// views routed into the namespace and on into the tunnel, this site's
/// networks routed back, and the NAT of remapped views.
pub(super) fn peering(m: &Model, p: &Peering, base: &str, ids: &PeeringIds) -> Objects {
    let (Some(site), views) = (m.site.as_ref(), views(m, p)) else {
        return Objects::new();
    };
    if views.is_empty() {
        return Objects::new();
    }
    let mut out = Objects::from([
        obj(format!("{base}v6/veth/outer"), address(&ids.outer, "", VETH_OUTER)),
        obj(format!("{base}v6/veth/inner"), address(&ids.inner, &ids.ns, VETH_INNER)),
        obj(format!("{base}v6/tunnel-rule"), tunnel_rule(ids, true)),
    ]);
    for (i, v) in views.iter().enumerate() {
        out.extend(into_tunnel(&format!("{base}v6/{i}"), v, ids));
    }
    // On a spoke: the sites reached through this peer, as its own views
    // are (see `transit_spoke`).
    for (i, t) in crate::transit::rendered_v6(&m.peerings, p) {
        out.extend(into_tunnel(&format!("{base}transit/{}/v6/{i}", t.site), &t.view, ids));
    }
    // On a hub: what comes out of this peer's tunnel for another transit
    // peer goes back to the gateway (see `transit_hub`).
    for (site, cidrs) in crate::transit::onward_v6(m.peerings.values().map(|q| &**q), p) {
        for (i, c) in cidrs.iter().enumerate() {
            out.extend([obj(
                format!("{base}v6/onward/{site}/{i}"),
                route(&ids.ns, 0, c.to_string(), Some(VETH_OUTER), &ids.inner),
            )]);
        }
    }
    for (i, c) in own(site).into_iter().enumerate() {
        out.extend([obj(
            format!("{base}v6/back/{i}"),
            route(&ids.ns, 0, c.to_string(), Some(VETH_OUTER), &ids.inner),
        )]);
    }
    out
}

/// An IPv6 view `v` (ids under `id`): routed from the gateway into the
/// peering's namespace and from there into the tunnel, with this site's
/// view mapped to the peer's address (1:1 NAT) when they differ.
fn into_tunnel(id: &str, v: &View<Ipv6Net>, ids: &PeeringIds) -> Objects {
    let mut out = Objects::from([
        obj(
            format!("{id}/via"),
            route("", TABLE, v.local.to_string(), Some(VETH_INNER), &ids.outer),
        ),
        obj(format!("{id}/rule"), host_rule(v.local)),
        obj(
            format!("{id}/tunnel"),
            route(&ids.ns, NS_TUNNEL_TABLE, v.real.to_string(), None, &ids.link),
        ),
    ]);
    if v.remapped() {
        out.extend([obj(format!("{id}/nat"), nat_map(&ids.ns, v.real, v.local, &ids.link))]);
    }
    out
}

/// What the peer's active gateway may send from, in IPv6: its real CIDRs
/// whose views were negotiated, and its views of the sites reached
/// through it.
pub(super) fn allowed_ips(m: &Model, p: &Peering) -> Vec<String> {
    let mut out: Vec<String> = views(m, p).iter().map(|v| v.real.to_string()).collect();
    if !out.is_empty() {
        out.extend(crate::transit::rendered_v6(&m.peerings, p).map(|(_, t)| t.view.real.to_string()));
    }
    out
}

/// What the peering's namespace forwards from the tunnel, in IPv6: this
/// site's IPv6 networks, once the peering carries IPv6 (otherwise no IPv6
/// passes at all).
pub(super) fn filter_allowed(m: &Model, p: &Peering) -> Vec<String> {
    match m.site.as_ref() {
        Some(site) if !views(m, p).is_empty() => own(site).iter().map(|c| c.to_string()).collect(),
        _ => vec![],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Ipv6Networks, RemoteGateway};
    use crate::ipam::CidrKind;

    fn net(s: &str) -> Ipv6Net {
        s.parse().unwrap()
    }

    /// The render tests' model, dual stack: site a and its nodes with
    /// IPv6, peer b's ULA remapped (the same as a's).
    fn model() -> Model {
        let mut m = super::super::tests::model();
        let mut site = (**m.site.as_ref().unwrap()).clone();
        site.ipv6 = Some(Ipv6Networks {
            pod_cidrs: vec![net("fd00:1::/48")],
            external_cidr: Some(net("fd00:70::/64")),
            remap_pools: vec![net("fd9a::/40")],
            ..Default::default()
        });
        m.site = Some(Arc::new(site));
        for (name, i) in [("n1", 1u16), ("n2", 2)] {
            let mut n = (*m.nodes[name]).clone();
            n.subnet_v6 = Some(net(&format!("fd00:1:0:{i}::/64")));
            m.nodes.insert(name.into(), Arc::new(n));
        }
        let mut p = (*m.peerings["b"]).clone();
        let mut r = crate::domain::test_remote("10.1.0.0/16");
        r.workload_cidrs_v6 = vec![net("fd00:1::/48")];
        r.names = vec![crate::domain::RemoteName {
            name: "web".into(),
            kind: crate::domain::NameKind::Workload,
            address: Some("10.1.0.10".parse().unwrap()),
            address_v6: Some("fd00:1::10".parse().unwrap()),
        }];
        r.gateways = vec![RemoteGateway {
            name: "gw".into(),
            endpoint: Some("192.0.2.1:51820".parse().unwrap()),
            public_key: Some(weft_types::WgKey::parse("key", "hT7XTB7qgr4m+5V8gqhnNtjvNrqSqPFiCjPsXl1Oc0Q=").unwrap()),
            active: true,
            candidates: vec![],
            nat: None,
        }];
        p.remote = Some(r);
        p.views_v6 = vec![View {
            kind: CidrKind::Workload,
            real: net("fd00:1::/48"),
            local: net("fd9a:0:100::/48"),
            pool: Some(net("fd9a::/40")),
        }];
        m.peerings.insert("b".into(), Arc::new(p));
        m
    }

    fn kind<'a>(objs: &'a Objects, id: &str) -> &'a Kind {
        objs.get(id)
            .and_then(|o| o.kind.as_ref())
            .unwrap_or_else(|| panic!("no {id} in {:?}", objs.keys().collect::<Vec<_>>()))
    }

    /// A node routes the peer's IPv6 view through the gateway's
    /// link-local address and rules it for IPv6; the gateway routes the
    /// node's /64 back, takes the view into the peering and maps it 1:1,
    /// lets the peer's real IPv6 CIDR through WireGuard and forwards to
    /// the site's IPv6 networks from the tunnel.
    #[test]
    fn a_negotiated_ipv6_view_is_routed_mapped_and_allowed_end_to_end() {
        let m = model();
        let n1 = node(&m, "n1");
        let Kind::Address(a) = kind(&n1, "self/v6/addr") else {
            panic!()
        };
        assert_eq!(a.cidr, "fe80::a50:1/64");
        let Kind::Route(r) = kind(&n1, "peer/b/v6/0/route") else {
            panic!()
        };
        assert_eq!(
            (r.destination.as_str(), r.gateway.as_str(), r.peer_site.as_str()),
            ("fd9a:0:100::/48", "fe80::a50:64", "b")
        );
        let Kind::Rule(r) = kind(&n1, "peer/b/v6/0/rule") else {
            panic!()
        };
        assert!(r.ipv6 && r.to == "fd9a:0:100::/48");
        let Kind::DnsRecord(d) = kind(&n1, "peer/b/name/web") else {
            panic!()
        };
        assert_eq!(
            (d.address.as_str(), d.address_v6.as_str()),
            ("10.0.0.10", "fd9a:0:100::10")
        );
        let Kind::HostSnat(h) = kind(&n1, "self/v6/host-snat") else {
            panic!()
        };
        assert_eq!(
            (h.address.as_str(), h.except.as_slice()),
            ("fd00:70::1", &["fd00:1::/48".to_string()][..])
        );

        let gw = gateway(&m, "gw1");
        let Kind::Route(r) = kind(&gw, "node/n1/v6/route") else {
            panic!()
        };
        assert_eq!(
            (r.destination.as_str(), r.gateway.as_str()),
            ("fd00:1:0:1::/64", "fe80::a50:1")
        );
        let Kind::Route(r) = kind(&gw, "peer/b/v6/0/via") else {
            panic!()
        };
        assert_eq!(
            (r.destination.as_str(), r.gateway.as_str()),
            ("fd9a:0:100::/48", "fe80::2")
        );
        let Kind::NatMap(x) = kind(&gw, "peer/b/v6/0/nat") else {
            panic!()
        };
        assert_eq!(
            (x.real_cidr.as_str(), x.local_cidr.as_str()),
            ("fd00:1::/48", "fd9a:0:100::/48")
        );
        let Kind::Rule(r) = kind(&gw, "peer/b/v6/tunnel-rule") else {
            panic!()
        };
        assert!(r.ipv6 && r.to.is_empty() && !r.iif.is_empty());
        let Kind::WireguardPeer(p) = kind(&gw, "peer/b/wgpeer/gw") else {
            panic!()
        };
        assert!(
            p.allowed_ips.contains(&"fd00:1::/48".to_string()),
            "{:?}",
            p.allowed_ips
        );
        let Kind::TunnelFilter(f) = kind(&gw, "peer/b/filter") else {
            panic!()
        };
        assert!(
            f.allowed.contains(&"fd00:1::/48".to_string()) && f.allowed.contains(&"fd00:70::/64".to_string()),
            "{:?}",
            f.allowed
        );
        assert!(gw.contains_key("self/v6/rule/0"));
    }

    /// IPv6 not negotiated (refused, or a held change): nothing of it is
    /// rendered for that peer, and its tunnel lets no IPv6 in; the site's
    /// own IPv6 (node addresses, /64 routes) stays.
    #[test]
    fn a_peering_without_ipv6_gets_none_of_it() {
        let mut m = model();
        let mut p = (*m.peerings["b"]).clone();
        p.ipv6_refused = Some("a change held".into());
        m.peerings.insert("b".into(), Arc::new(p));
        let (n1, gw) = (node(&m, "n1"), gateway(&m, "gw1"));
        assert!(
            n1.keys().chain(gw.keys()).all(|k| !k.starts_with("peer/b/v6")),
            "{:?}",
            gw.keys()
        );
        let Kind::WireguardPeer(p) = kind(&gw, "peer/b/wgpeer/gw") else {
            panic!()
        };
        assert!(p.allowed_ips.iter().all(|c| !c.contains(':')), "{:?}", p.allowed_ips);
        let Kind::TunnelFilter(f) = kind(&gw, "peer/b/filter") else {
            panic!()
        };
        assert!(f.allowed.iter().all(|c| !c.contains(':')), "{:?}", f.allowed);
        assert!(n1.contains_key("self/v6/addr") && gw.contains_key("node/n1/v6/route"));
        let Kind::DnsRecord(d) = kind(&n1, "peer/b/name/web") else {
            panic!()
        };
        assert!(d.address_v6.is_empty(), "an AAAA without IPv6: {d:?}");
    }

    #[test]
    fn an_overlay_ends_link_local_address_carries_its_internal_address() {
        assert_eq!(
            link_local(Ipv4Addr::new(10, 80, 0, 3)),
            "fe80::a50:3".parse::<Ipv6Addr>().unwrap()
        );
        assert!(link_local(Ipv4Addr::new(10, 80, 0, 3)).is_unicast_link_local());
    }
}
