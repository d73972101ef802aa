//! From the agent's decoded objects ([`decode::Object`]) to the desired
//! [`State`] the planner compares with the host. Decoding (the agent's
//! door) parsed and bounded every field; here the objects are put
//! together, sized by the host's [`Facts`], and an object that conflicts
//! with another (a second host SNAT of a family) is refused with a message
//! naming why (it is then reported and the rest applies).

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::{IpNet, Ipv4Net};

use crate::model::*;

pub mod decode;
pub use decode::{LinkObject, LinkSpec, Object, decode};

type R<T> = Result<T, String>;

/// What the translation needs to know of the host: the MTU of the
/// underlay, which sizes links rendered without one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Facts {
    /// The MTU of the interface holding each address of the host.
    pub address_mtu: BTreeMap<IpAddr, u32>,
    /// The MTU of the default route's interface (IPv4's, else IPv6's).
    pub default_mtu: Option<u32>,
    /// This host's underlay address, if configured.
    pub underlay: Option<IpAddr>,
}

impl Facts {
    /// Reads them from what the host's namespace holds.
    pub fn from_raw(raw: &RawNs, underlay: Option<IpAddr>) -> Facts {
        let mtu_of = |name: &str| raw.links.iter().find(|l| l.name == name).map(|l| l.mtu);
        Facts {
            address_mtu: raw
                .addresses
                .iter()
                .filter_map(|a| mtu_of(&a.link).map(|m| (a.cidr.addr(), m)))
                .collect(),
            default_mtu: [IpNet::V4(Ipv4Net::default()), IpNet::V6(ipnet::Ipv6Net::default())]
                .iter()
                .find_map(|default| {
                    raw.routes
                        .iter()
                        .filter(|r| r.route.dst == *default && r.route.table == 254)
                        .find_map(|r| r.route.dev.as_deref().and_then(mtu_of))
                }),
            underlay,
        }
    }

    /// The underlay's MTU: of the interface holding `hint` or the underlay
    /// address, else of the default route's interface, else 1500.
    pub fn underlay_mtu(&self, hint: Option<IpAddr>) -> u32 {
        [hint, self.underlay]
            .into_iter()
            .flatten()
            .find_map(|ip| self.address_mtu.get(&ip).copied())
            .or(self.default_mtu)
            .unwrap_or(1500)
    }

    /// The MTU link `l` gets: as rendered, or (rendered 0) derived from the
    /// underlay: VXLAN and Geneve carry 50 bytes of headers over IPv4
    /// (outer IPv4, UDP, their own, inner Ethernet), 70 over IPv6;
    /// WireGuard up to 80 (outer IPv6, UDP, its own), and the peering's
    /// veth matches the WireGuard interface behind it.
    fn link_mtu(&self, l: &LinkObject) -> u32 {
        if l.mtu > 0 {
            return l.mtu;
        }
        let overlay = |remote: IpAddr| if remote.is_ipv6() { 70 } else { 50 };
        let (hint, overhead) = match &l.kind {
            LinkSpec::Vxlan { local, remote, .. } => (Some(*local), overlay(*remote)),
            LinkSpec::Geneve { remote, .. } => (None, overlay(*remote)),
            _ => (None, 80),
        };
        self.underlay_mtu(hint).saturating_sub(overhead).max(576)
    }
}

/// The desired state for `objects` (id, decoded object), and an error per
/// object that conflicts with another. `node`: whether this host is a node
/// (it counts its traffic per peer site).
pub fn translate<'a>(
    objects: impl IntoIterator<Item = (&'a str, &'a Object)>,
    facts: &Facts,
    node: bool,
) -> (Desired, Vec<(String, String)>) {
    let mut d = Desired::default();
    let mut errors = Vec::new();
    let objects: Vec<(&str, &Object)> = objects.into_iter().collect();
    for (id, o) in &objects {
        if let Err(e) = add(&mut d, id, o, facts) {
            errors.push((id.to_string(), e));
        }
    }
    // A node counts its traffic per peer, over the peers' views.
    if node {
        let views = peer_views(objects.iter().map(|(_, o)| *o));
        if !views.is_empty() {
            d.specs.entry(String::new()).or_default().accounting = views;
        }
    }
    // Where weft forwards IPv4 (a gateway and its peerings' namespaces; a
    // node's workloads are its operator's), it forwards IPv6 too once it
    // routes any there.
    let routes_v6: std::collections::BTreeSet<&Ns> = d
        .state
        .routes
        .values()
        .filter(|r| r.dst.addr().is_ipv6())
        .map(|r| &r.ns)
        .collect();
    let v6: Vec<(Ns, Family)> = d
        .state
        .forwarding
        .iter()
        .filter(|(ns, f)| *f == Family::V4 && routes_v6.contains(ns))
        .map(|(ns, _)| (ns.clone(), Family::V6))
        .collect();
    d.state.forwarding.extend(v6);
    for (ns, spec) in &d.specs {
        if !spec.is_empty() {
            d.state.tables.insert(ns.clone(), Some(spec.version()));
        }
    }
    d.specs.retain(|_, s| !s.is_empty());
    (d, errors)
}

fn add(d: &mut Desired, id: &str, o: &Object, facts: &Facts) -> R<()> {
    let id = id.to_string();
    let (s, origins) = (&mut d.state, &mut d.origins);
    match o {
        Object::Namespace(name) => {
            s.namespaces.insert(name.clone());
            // Every peering clamps the MSS of TCP through its tunnel.
            d.specs.entry(name.clone()).or_default().mss_clamp = true;
            // A peering's namespace and the gateway itself route between
            // the overlay and the tunnel (IPv6 as soon as anything of it
            // is routed there: below).
            s.forwarding.insert((name.clone(), Family::V4));
            s.forwarding.insert((String::new(), Family::V4));
            origins.namespaces.insert(name.clone(), id);
        }
        Object::Link(l) => add_link(d, id, l, facts),
        Object::Address(a) => {
            origins.addresses.insert(a.clone(), id);
            s.addresses.insert(a.clone());
        }
        Object::Route(r) => {
            origins.routes.insert(r.route.key(), id);
            s.routes.insert(r.route.key(), r.route.clone());
        }
        Object::Rule(r) => {
            origins.rules.insert(r.clone(), id);
            s.rules.insert(r.clone());
        }
        Object::NatMap { ns, rule } => {
            d.specs.entry(ns.clone()).or_default().nat.push(rule.clone());
            origins.tables.entry(ns.clone()).or_default().push(id);
        }
        Object::HostSnat(snat) => {
            let spec = d.specs.entry(String::new()).or_default();
            let family = Family::of(snat.address);
            if spec.snat.iter().any(|x| Family::of(x.address) == family) {
                return Err(format!("a second host SNAT for {family}"));
            }
            spec.snat.push(snat.clone());
            spec.snat.sort();
            // Errors of the host's table are this object's.
            origins.tables.entry(String::new()).or_default().insert(0, id);
        }
        Object::WireguardPeer { ns, link, peer, .. } => {
            origins.peers.insert((ns.clone(), link.clone(), peer.public_key), id);
            s.peers
                .entry((ns.clone(), link.clone()))
                .or_default()
                .insert(peer.public_key, peer.clone());
        }
        Object::ExportMap { ns, export } => {
            d.specs.entry(ns.clone()).or_default().exports.push(export.clone());
            origins.tables.entry(ns.clone()).or_default().push(id);
        }
        Object::TunnelFilter { ns, filter } => {
            d.specs.entry(ns.clone()).or_default().filter = Some(filter.clone());
            origins.tables.entry(ns.clone()).or_default().push(id);
        }
        // The node agent's DNS responder answers these; nothing on the host.
        Object::DnsRecord(_) => {}
        // The gateway agent runs these (its relay threads); no table, no link.
        Object::RelaySession(_) => {}
        // The gateway agent holds its --lan-address itself (`lan`).
        Object::LanAddress | Object::RelayTls { .. } => {}
    }
    Ok(())
}

/// The CIDRs of peers as this site sees them, by peer site: the
/// destinations of the routes in the host's own namespace that name the
/// site they lead to (`peer_site`; inside a peering's namespace routes
/// lead to real CIDRs, not views).
pub fn peer_views<'a>(objects: impl IntoIterator<Item = &'a Object>) -> BTreeMap<String, Vec<IpNet>> {
    let mut out: BTreeMap<String, Vec<IpNet>> = BTreeMap::new();
    for o in objects {
        if let Object::Route(r) = o
            && r.route.ns.is_empty()
            && let Some(site) = &r.peer_site
        {
            let v = out.entry(site.clone()).or_default();
            if !v.contains(&r.route.dst) {
                v.push(r.route.dst);
            }
        }
    }
    out
}

/// A link: VXLAN, Geneve, bridge, a veth pair (both ends) or a WireGuard
/// device (with the probe's address on it).
fn add_link(d: &mut Desired, id: String, l: &LinkObject, facts: &Facts) {
    let (s, origins) = (&mut d.state, &mut d.origins);
    let mtu = facts.link_mtu(l);
    let link = |kind, mtu| Link {
        ns: l.ns.clone(),
        name: l.name.clone(),
        kind,
        mtu,
        up: true,
    };
    let mut put = |x: Link| {
        origins.links.insert((x.ns.clone(), x.name.clone()), id.clone());
        s.links.insert((x.ns.clone(), x.name.clone()), x);
    };
    match &l.kind {
        LinkSpec::Vxlan {
            vni,
            local,
            remote,
            port,
        } => put(link(
            LinkKind::Vxlan {
                vni: *vni,
                local: *local,
                remote: *remote,
                port: *port,
            },
            mtu,
        )),
        LinkSpec::Geneve { vni, remote, port } => put(link(
            LinkKind::Geneve {
                vni: *vni,
                remote: *remote,
                port: *port,
            },
            mtu,
        )),
        // Workloads attach their own ports; its MTU is theirs.
        LinkSpec::Bridge => put(link(LinkKind::Bridge, l.mtu)),
        LinkSpec::Veth { peer, peer_ns } => {
            put(link(
                LinkKind::Veth {
                    peer: peer.clone(),
                    peer_ns: peer_ns.clone(),
                },
                mtu,
            ));
            put(Link {
                ns: peer_ns.clone(),
                name: peer.clone(),
                kind: LinkKind::VethEnd,
                mtu,
                up: true,
            });
        }
        LinkSpec::Wireguard(w) => {
            put(link(
                LinkKind::Wireguard {
                    listen_port: w.listen_port,
                },
                mtu,
            ));
            // The probe's address on the tunnel (see the agent's probe.rs).
            let a = Address {
                ns: l.ns.clone(),
                link: l.name.clone(),
                cidr: w.probe.0,
                no_prefix_route: false,
            };
            origins.addresses.insert(a.clone(), id);
            s.addresses.insert(a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_proto::v1 as pb;
    use weft_proto::v1::desired_object::Kind;

    #[test]
    fn a_view_is_counted_for_the_site_it_leads_to_also_through_transit() {
        let route = |dst: &str, site: &str| {
            decode(&pb::DesiredObject {
                id: "x".into(),
                kind: Some(Kind::Route(pb::Route {
                    namespace: String::new(),
                    table: 7765,
                    destination: dst.into(),
                    gateway: "10.80.0.100".into(),
                    device: "weft-vx0".into(),
                    peer_site: site.into(),
                })),
            })
            .unwrap()
        };
        // The id says nothing (peer/d/… without its site is no view, and
        // one with it is, whatever its id): only the route's site counts.
        let objects = [
            route("10.2.0.0/16", "b"),
            route("10.3.0.0/16", "c"),
            route("10.4.0.0/16", ""),
            route("10.5.0.0/16", "e"),
        ];
        let views = peer_views(objects.iter());
        assert_eq!(views["b"], vec!["10.2.0.0/16".parse::<IpNet>().unwrap()]);
        assert_eq!(views["c"], vec!["10.3.0.0/16".parse::<IpNet>().unwrap()]);
        assert_eq!(views["e"], vec!["10.5.0.0/16".parse::<IpNet>().unwrap()]);
        assert_eq!(views.len(), 3, "{views:?}");
    }
}
