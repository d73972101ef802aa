//! From the controller's objects to the desired [`State`]: each object is
//! validated and translated, or refused with a message naming what is
//! wrong (it is then reported and the rest applies).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use ipnet::{IpNet, Ipv4Net};
use weft_proto::v1 as pb;
use weft_proto::v1::desired_object::Kind;

use crate::model::*;

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
    fn link_mtu(&self, l: &pb::Link) -> u32 {
        if l.mtu > 0 {
            return l.mtu;
        }
        let overlay = |remote: &str| if remote.contains(':') { 70 } else { 50 };
        let (hint, overhead) = match &l.kind {
            Some(pb::link::Kind::Vxlan(v)) => (v.local.parse().ok(), overlay(&v.remote)),
            Some(pb::link::Kind::Geneve(g)) => (None, overlay(&g.remote)),
            _ => (None, 80),
        };
        self.underlay_mtu(hint).saturating_sub(overhead).max(576)
    }
}

// weft-types' parsers, the ones the controller and the agent's guard
// use; their messages start with the text, so the field goes first.

fn v4(s: &str, what: &str) -> R<Ipv4Addr> {
    weft_types::net::addr_v4(s).map_err(|m| format!("{what} {m}"))
}

fn ip(s: &str, what: &str) -> R<IpAddr> {
    weft_types::net::addr(s).map_err(|m| format!("{what} {m}"))
}

/// A network of either family: host bits clear.
fn net(s: &str, what: &str) -> R<IpNet> {
    weft_types::net::cidr(s)
        .map(|c| c.net())
        .map_err(|m| format!("{what} {m}"))
}

/// An address on a link, with its prefix length (host bits kept).
fn addr_net(s: &str, what: &str) -> R<IpNet> {
    weft_types::net::iface(s).map_err(|m| format!("{what} {m}"))
}

fn opt_net(s: &str, what: &str) -> R<Option<IpNet>> {
    (!s.is_empty()).then(|| net(s, what)).transpose()
}

/// `b` (named `what`) of `a`'s family.
fn same_family(a: IpAddr, b: IpAddr, what: &str) -> R<()> {
    if Family::of(a) == Family::of(b) {
        Ok(())
    } else {
        Err(format!(
            "{what} {b} is {}, the destination {a} {}",
            Family::of(b),
            Family::of(a)
        ))
    }
}

fn opt(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_string())
}

fn port(p: u32, what: &str) -> R<u16> {
    u16::try_from(p).map_err(|_| format!("{what} {p} is not a UDP port"))
}

/// The desired state for `objects`, and an error per object that cannot be
/// translated. `node`: whether this host is a node (it counts its traffic
/// per peer site).
pub fn translate<'a>(
    objects: impl IntoIterator<Item = &'a pb::DesiredObject>,
    facts: &Facts,
    node: bool,
) -> (Desired, Vec<(String, String)>) {
    let mut d = Desired::default();
    let mut errors = Vec::new();
    let objects: Vec<&pb::DesiredObject> = objects.into_iter().collect();
    for o in &objects {
        if let Err(e) = add(&mut d, o, facts) {
            errors.push((o.id.clone(), e));
        }
    }
    // A node counts its traffic per peer, over the peers' views.
    if node {
        let views = peer_views(objects.iter().copied());
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

fn add(d: &mut Desired, o: &pb::DesiredObject, facts: &Facts) -> R<()> {
    let id = o.id.clone();
    let (s, origins) = (&mut d.state, &mut d.origins);
    match o.kind.as_ref().ok_or("the object is empty")? {
        Kind::Namespace(n) => {
            if n.name.is_empty() {
                return Err("a namespace with no name".into());
            }
            weft_types::name::namespace("namespace", &n.name)?;
            s.namespaces.insert(n.name.clone());
            // Every peering clamps the MSS of TCP through its tunnel.
            d.specs.entry(n.name.clone()).or_default().mss_clamp = true;
            // A peering's namespace and the gateway itself route between
            // the overlay and the tunnel (IPv6 as soon as anything of it
            // is routed there: below).
            s.forwarding.insert((n.name.clone(), Family::V4));
            s.forwarding.insert((String::new(), Family::V4));
            origins.namespaces.insert(n.name.clone(), id);
        }
        Kind::Link(l) => add_link(d, id, l, facts)?,
        Kind::Address(a) => {
            let a = Address {
                ns: a.namespace.clone(),
                link: a.link.clone(),
                cidr: addr_net(&a.cidr, "address")?,
                no_prefix_route: a.no_prefix_route,
            };
            origins.addresses.insert(a.clone(), id);
            s.addresses.insert(a);
        }
        Kind::Route(r) => {
            let r = Route {
                ns: r.namespace.clone(),
                table: if r.table == 0 { 254 } else { r.table },
                dst: net(&r.destination, "destination")?,
                gateway: (!r.gateway.is_empty()).then(|| ip(&r.gateway, "gateway")).transpose()?,
                dev: opt(&r.device),
            };
            if let Some(g) = r.gateway {
                same_family(r.dst.addr(), g, "gateway")?;
            }
            if r.gateway.is_none() && r.dev.is_none() {
                return Err("a route needs a gateway or a device".into());
            }

            origins.routes.insert(r.key(), id);
            s.routes.insert(r.key(), r);
        }
        Kind::Rule(r) => {
            let (from, to) = (opt_net(&r.from, "from")?, opt_net(&r.to, "to")?);
            let family = if r.ipv6 { Family::V6 } else { Family::V4 };
            if let Some(n) = from.iter().chain(to.iter()).find(|n| Family::of(n.addr()) != family) {
                return Err(format!("a rule for {family} names {n}"));
            }
            let r = Rule {
                ns: r.namespace.clone(),
                family,
                priority: r.priority,
                table: r.table,
                from,
                to,
                iif: opt(&r.iif),
            };
            origins.rules.insert(r.clone(), id);
            s.rules.insert(r);
        }
        Kind::NatMap(m) => {
            let rule = NatRule {
                local: net(&m.local_cidr, "local CIDR")?,
                real: net(&m.real_cidr, "real CIDR")?,
                tunnel: m.tunnel.clone(),
            };
            if rule.tunnel.is_empty()
                || rule.local.prefix_len() != rule.real.prefix_len()
                || rule.local.addr().is_ipv6() != rule.real.addr().is_ipv6()
            {
                return Err("a NAT map needs its tunnel and two CIDRs of one family and length".into());
            }
            d.specs.entry(m.namespace.clone()).or_default().nat.push(rule);
            origins.tables.entry(m.namespace.clone()).or_default().push(id);
        }
        Kind::HostSnat(h) => {
            let snat = HostSnat {
                link: h.link.clone(),
                address: ip(&h.address, "address")?,
                except: h.except.iter().map(|c| net(c, "except")).collect::<R<_>>()?,
            };
            for c in &snat.except {
                same_family(snat.address, c.addr(), "except")?;
            }
            let spec = d.specs.entry(String::new()).or_default();
            let family = Family::of(snat.address);
            if spec.snat.iter().any(|x| Family::of(x.address) == family) {
                return Err(format!("a second host SNAT for {family}"));
            }
            spec.snat.push(snat);
            spec.snat.sort();
            // Errors of the host's table are this object's.
            origins.tables.entry(String::new()).or_default().insert(0, id);
        }
        Kind::WireguardPeer(p) => add_peer(d, id, p)?,
        Kind::ExportMap(x) => {
            let export = Export {
                external: v4(&x.external_address, "external address")?,
                host: v4(&x.host_address, "host address")?,
                tunnel: x.tunnel.clone(),
            };
            if export.tunnel.is_empty() {
                return Err("an export map needs its tunnel".into());
            }
            d.specs.entry(x.namespace.clone()).or_default().exports.push(export);
            origins.tables.entry(x.namespace.clone()).or_default().push(id);
        }
        Kind::TunnelFilter(f) => {
            if f.tunnel.is_empty() || f.namespace.is_empty() {
                return Err("a tunnel filter needs its peering namespace and tunnel".into());
            }
            let filter = TunnelFilter {
                tunnel: f.tunnel.clone(),
                allowed: f.allowed.iter().map(|c| net(c, "allowed")).collect::<R<_>>()?,
                policy: policy_rules(f)?,
                transit: transit_prefixes(f)?,
            };
            d.specs.entry(f.namespace.clone()).or_default().filter = Some(filter);
            origins.tables.entry(f.namespace.clone()).or_default().push(id);
        }
        // The node agent's DNS responder answers these; nothing on the host.
        Kind::DnsRecord(_) => {}
        // The gateway agent runs these (its relay threads); no table, no link.
        Kind::RelaySession(_) => {}
        // The gateway agent holds its --lan-address itself (`lan`).
        Kind::LanAddress(_) => {}
    }
    Ok(())
}

/// Most sites a tunnel filter forwards onward to (transit).
pub const MAX_TRANSIT_SITES: usize = 64;
/// Most prefixes per such site.
pub const MAX_TRANSIT_PREFIXES: usize = 33;

/// A tunnel filter's transit destinations by site, checked: at most
/// [`MAX_TRANSIT_SITES`] sites of at most [`MAX_TRANSIT_PREFIXES`] CIDRs,
/// each site a name fit for an nft counter (`transit-<site>`: lowercase
/// letters, digits, '-' and '.', at most 63), listed once.
pub fn transit_prefixes(f: &pb::TunnelFilter) -> R<Vec<(String, Vec<IpNet>)>> {
    if f.transit.len() > MAX_TRANSIT_SITES {
        return Err(format!(
            "a tunnel filter forwarding to {} sites, more than {MAX_TRANSIT_SITES}",
            f.transit.len()
        ));
    }
    let mut out: Vec<(String, Vec<IpNet>)> = Vec::with_capacity(f.transit.len());
    for t in &f.transit {
        let ok = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.';
        if t.site.is_empty() || t.site.len() > 63 || !t.site.chars().all(ok) {
            return Err(format!("transit site {:?} is not a site id", t.site));
        }
        if out.iter().any(|(s, _)| *s == t.site) {
            return Err(format!("transit site {:?} listed twice", t.site));
        }
        if t.cidrs.is_empty() || t.cidrs.len() > MAX_TRANSIT_PREFIXES {
            return Err(format!(
                "transit to {:?} with {} CIDRs; give 1 to {MAX_TRANSIT_PREFIXES}",
                t.site,
                t.cidrs.len()
            ));
        }
        let cidrs = t.cidrs.iter().map(|c| net(c, "transit")).collect::<R<_>>()?;
        out.push((t.site.clone(), cidrs));
    }
    Ok(out)
}

/// Most rules a tunnel filter's policy may hold (each is an nft rule).
pub const MAX_POLICY_RULES: usize = 256;

/// A tunnel filter's export policy: None when it has none (`policed`
/// unset), else its rules, each checked (a CIDR, a known protocol, ports in
/// order and only with tcp or udp), at most [`MAX_POLICY_RULES`].
pub fn policy_rules(f: &pb::TunnelFilter) -> R<Option<Vec<PolicyRule>>> {
    if !f.policed {
        if !f.exports.is_empty() {
            return Err("a tunnel filter with export rules but no policy".into());
        }
        return Ok(None);
    }
    if f.exports.len() > MAX_POLICY_RULES {
        return Err(format!(
            "a tunnel filter with {} export rules, more than {MAX_POLICY_RULES}",
            f.exports.len()
        ));
    }
    let mut out = Vec::with_capacity(f.exports.len());
    for r in &f.exports {
        let cidr = net(&r.cidr, "export rule")?;
        let protocol = match r.protocol.as_str() {
            "" => None,
            "tcp" => Some(L4::Tcp),
            "udp" => Some(L4::Udp),
            "icmp" => Some(L4::Icmp),
            other => return Err(format!("export rule for {cidr}: unknown protocol {other:?}")),
        };
        let port = |field: &str, p: u32| {
            u16::try_from(p)
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| format!("export rule for {cidr}: {field} {p} is not a port"))
        };
        let ports = match (r.first_port, r.last_port) {
            (0, 0) => None,
            (a, b) => {
                let a = port("first_port", a)?;
                let b = if b == 0 { a } else { port("last_port", b)? };
                if b < a {
                    return Err(format!("export rule for {cidr}: last_port {b} is below first_port {a}"));
                }
                if !matches!(protocol, Some(L4::Tcp | L4::Udp)) {
                    return Err(format!("export rule for {cidr}: ports without tcp or udp"));
                }
                Some((a, b))
            }
        };
        out.push(PolicyRule { cidr, protocol, ports });
    }
    Ok(Some(out))
}

/// The CIDRs of peers as this site sees them, by peer site: the
/// destinations of the routes in the host's own namespace that name the
/// site they lead to (`peer_site`; inside a peering's namespace routes
/// lead to real CIDRs, not views).
pub fn peer_views<'a>(objects: impl IntoIterator<Item = &'a pb::DesiredObject>) -> BTreeMap<String, Vec<IpNet>> {
    let mut out: BTreeMap<String, Vec<IpNet>> = BTreeMap::new();
    for o in objects {
        if let Some(Kind::Route(r)) = &o.kind
            && r.namespace.is_empty()
            && !r.peer_site.is_empty()
            && let Ok(dst) = net(&r.destination, "destination")
        {
            let v = out.entry(r.peer_site.clone()).or_default();
            if !v.contains(&dst) {
                v.push(dst);
            }
        }
    }
    out
}

/// A link: VXLAN, Geneve, bridge, a veth pair (both ends) or a WireGuard
/// device (with the probe's address on it).
fn add_link(d: &mut Desired, id: String, l: &pb::Link, facts: &Facts) -> R<()> {
    let (s, origins) = (&mut d.state, &mut d.origins);
    let mtu = facts.link_mtu(l);
    let link = |kind, mtu| Link {
        ns: l.namespace.clone(),
        name: l.name.clone(),
        kind,
        mtu,
        up: true,
    };
    let kind = l.kind.as_ref().ok_or("the link has no kind")?;
    let mut put = |x: Link| {
        origins.links.insert((x.ns.clone(), x.name.clone()), id.clone());
        s.links.insert((x.ns.clone(), x.name.clone()), x);
    };
    match kind {
        pb::link::Kind::Vxlan(v) => {
            let (local, remote) = (ip(&v.local, "local")?, ip(&v.remote, "remote")?);
            same_family(local, remote, "remote")?;
            put(link(
                LinkKind::Vxlan {
                    vni: v.vni,
                    local,
                    remote,
                    port: port(v.port, "port")?,
                },
                mtu,
            ))
        }
        pb::link::Kind::Geneve(g) => put(link(
            LinkKind::Geneve {
                vni: g.vni,
                remote: ip(&g.remote, "remote")?,
                port: port(g.port, "port")?,
            },
            mtu,
        )),
        // Workloads attach their own ports; its MTU is theirs.
        pb::link::Kind::Bridge(_) => put(link(LinkKind::Bridge, l.mtu)),
        pb::link::Kind::Veth(v) => {
            if !l.namespace.is_empty() {
                return Err("a veth pair's outer end lives in the agent's namespace".into());
            }
            put(link(
                LinkKind::Veth {
                    peer: v.peer_name.clone(),
                    peer_ns: v.peer_namespace.clone(),
                },
                mtu,
            ));
            put(Link {
                ns: v.peer_namespace.clone(),
                name: v.peer_name.clone(),
                kind: LinkKind::VethEnd,
                mtu,
                up: true,
            });
        }
        pb::link::Kind::Wireguard(w) => {
            if l.namespace.is_empty() {
                return Err("a WireGuard link needs its peering namespace".into());
            }
            let listen_port = port(w.listen_port, "listen port")?;
            let probe = if w.address.is_empty() || w.peer_address.is_empty() {
                None
            } else {
                v4(&w.peer_address, "probe peer address")?;
                Some(addr_net(&w.address, "probe address")?)
            };
            put(link(LinkKind::Wireguard { listen_port }, mtu));
            // The probe's address on the tunnel (see probe.rs).
            if let Some(cidr) = probe {
                let a = Address {
                    ns: l.namespace.clone(),
                    link: l.name.clone(),
                    cidr,
                    no_prefix_route: false,
                };
                origins.addresses.insert(a.clone(), id);
                s.addresses.insert(a);
            }
        }
    }
    Ok(())
}

fn add_peer(d: &mut Desired, id: String, p: &pb::WireguardPeer) -> R<()> {
    let (s, origins) = (&mut d.state, &mut d.origins);
    let peer = WgPeer {
        public_key: WgKey::parse("public key", &p.public_key)?,
        endpoint: (!p.endpoint.is_empty())
            .then(|| weft_types::net::endpoint(&p.endpoint).map_err(|m| format!("endpoint {m}")))
            .transpose()?,
        // A set (as the kernel keeps it): sorted, each once.
        allowed_ips: {
            let mut v: Vec<IpNet> = p.allowed_ips.iter().map(|c| net(c, "allowed IP")).collect::<R<_>>()?;
            v.sort();
            v.dedup();
            v
        },
        keepalive: u16::try_from(p.persistent_keepalive).map_err(|_| "keepalive too long".to_string())?,
    };
    origins
        .peers
        .insert((p.namespace.clone(), p.link.clone(), peer.public_key), id);
    s.peers
        .entry((p.namespace.clone(), p.link.clone()))
        .or_default()
        .insert(peer.public_key, peer);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_view_is_counted_for_the_site_it_leads_to_also_through_transit() {
        let route = |id: &str, dst: &str, site: &str| pb::DesiredObject {
            id: id.into(),
            kind: Some(Kind::Route(pb::Route {
                namespace: String::new(),
                table: 7765,
                destination: dst.into(),
                gateway: "10.80.0.100".into(),
                device: "weft-vx0".into(),
                peer_site: site.into(),
            })),
        };
        let objects = [
            route("peer/b/workload/route", "10.2.0.0/16", "b"),
            route("peer/b/transit/c/0/route", "10.3.0.0/16", "c"),
            // The id says nothing: a route without its site is no view,
            route("peer/d/workload/route", "10.4.0.0/16", ""),
            // and one with it is, whatever its id.
            route("x", "10.5.0.0/16", "e"),
        ];
        let views = peer_views(objects.iter());
        assert_eq!(views["b"], vec!["10.2.0.0/16".parse::<IpNet>().unwrap()]);
        assert_eq!(views["c"], vec!["10.3.0.0/16".parse::<IpNet>().unwrap()]);
        assert_eq!(views["e"], vec!["10.5.0.0/16".parse::<IpNet>().unwrap()]);
        assert_eq!(views.len(), 3, "{views:?}");
    }
}
