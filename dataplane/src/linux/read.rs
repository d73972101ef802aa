//! Reading a namespace over netlink: links, addresses, routes and rules of
//! both families, and forwarding, decoded into the model's terms.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use futures::TryStreamExt;
use ipnet::IpNet;
use rtnetlink::packet_route::address::AddressAttribute;
use rtnetlink::packet_route::link::{InfoData, InfoGeneve, InfoKind, InfoVxlan, LinkAttribute, LinkFlags, LinkInfo};
use rtnetlink::packet_route::route::{RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteType};
use rtnetlink::packet_route::rule::{RuleAttribute, RuleMessage};
use rtnetlink::{Handle, RouteMessageBuilder};

use crate::host::R;
use crate::model::*;

/// The forwarding sysctl of a family in the calling thread's namespace.
pub(super) fn forwarding_path(f: Family) -> &'static str {
    match f {
        Family::V4 => "/proc/sys/net/ipv4/ip_forward",
        Family::V6 => "/proc/sys/net/ipv6/conf/all/forwarding",
    }
}

fn family_of(f: rtnetlink::packet_route::AddressFamily) -> Option<Family> {
    match f {
        rtnetlink::packet_route::AddressFamily::Inet => Some(Family::V4),
        rtnetlink::packet_route::AddressFamily::Inet6 => Some(Family::V6),
        _ => None,
    }
}

fn route_ip(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(a) => Some(IpAddr::V4(*a)),
        RouteAddress::Inet6(a) => Some(IpAddr::V6(*a)),
        _ => None,
    }
}

fn link_kind(attrs: &[LinkAttribute]) -> LinkKind {
    let infos = attrs.iter().find_map(|a| match a {
        LinkAttribute::LinkInfo(i) => Some(i),
        _ => None,
    });
    let Some(infos) = infos else {
        return LinkKind::Other(String::new());
    };
    let kind = infos.iter().find_map(|i| match i {
        LinkInfo::Kind(k) => Some(k),
        _ => None,
    });
    let data = infos.iter().find_map(|i| match i {
        LinkInfo::Data(d) => Some(d),
        _ => None,
    });
    match (kind, data) {
        (Some(InfoKind::Vxlan), Some(InfoData::Vxlan(v))) => {
            let unset = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
            let (mut vni, mut local, mut remote, mut port) = (0, unset, unset, 0);
            for x in v {
                match x {
                    InfoVxlan::Id(i) => vni = *i,
                    InfoVxlan::Local(a) => local = IpAddr::V4(*a),
                    InfoVxlan::Local6(a) => local = IpAddr::V6(*a),
                    InfoVxlan::Group(a) => remote = IpAddr::V4(*a),
                    InfoVxlan::Group6(a) => remote = IpAddr::V6(*a),
                    InfoVxlan::Port(p) => port = *p,
                    _ => {}
                }
            }
            LinkKind::Vxlan {
                vni,
                local,
                remote,
                port,
            }
        }
        (Some(InfoKind::Geneve), Some(InfoData::Geneve(g))) => {
            let (mut vni, mut remote, mut port) = (0, IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0);
            for x in g {
                match x {
                    InfoGeneve::Id(i) => vni = *i,
                    InfoGeneve::Remote(a) => remote = IpAddr::V4(*a),
                    InfoGeneve::Remote6(a) => remote = IpAddr::V6(*a),
                    InfoGeneve::Port(p) => port = *p,
                    _ => {}
                }
            }
            LinkKind::Geneve { vni, remote, port }
        }
        (Some(InfoKind::Bridge), _) => LinkKind::Bridge,
        (Some(InfoKind::Veth), _) => LinkKind::VethEnd,
        (Some(k), _) => LinkKind::Other(k.to_string()),
        (None, _) => LinkKind::Other(String::new()),
    }
}

fn route_of(ns: &Ns, m: &RouteMessage, names: &BTreeMap<u32, String>) -> Option<RawRoute> {
    let family = family_of(m.header.address_family)?;
    let mut table = u32::from(m.header.table);
    let mut dst = match family {
        Family::V4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        Family::V6 => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
    };
    let (mut gateway, mut dev) = (None, None);
    for a in &m.attributes {
        match a {
            RouteAttribute::Table(t) => table = *t,
            RouteAttribute::Destination(d) => dst = route_ip(d)?,
            RouteAttribute::Gateway(g) => gateway = route_ip(g),
            RouteAttribute::Oif(i) => dev = names.get(i).cloned(),
            _ => {}
        }
    }
    Some(RawRoute {
        route: Route {
            ns: ns.clone(),
            table,
            dst: IpNet::new(dst, m.header.destination_prefix_length).ok()?,
            gateway,
            dev,
        },
        kernel: m.header.protocol == RouteProtocol::Kernel,
        special: m.header.kind != RouteType::Unicast,
    })
}

pub(super) fn rule_of(ns: &Ns, m: &RuleMessage) -> Option<Rule> {
    let family = family_of(m.header.family)?;
    let mut r = Rule {
        ns: ns.clone(),
        family,
        priority: 0,
        table: u32::from(m.header.table),
        from: None,
        to: None,
        iif: None,
    };
    for a in &m.attributes {
        match a {
            RuleAttribute::Priority(p) => r.priority = *p,
            RuleAttribute::Table(t) => r.table = *t,
            RuleAttribute::Destination(d) => r.to = IpNet::new(*d, m.header.dst_len).ok(),
            RuleAttribute::Source(s) => r.from = IpNet::new(*s, m.header.src_len).ok(),
            RuleAttribute::Iifname(i) => r.iif = Some(i.clone()),
            _ => {}
        }
    }
    Some(r)
}

/// Everything the namespace of `h` holds, of both families.
pub(super) async fn read_ns(h: &Handle, ns: &Ns) -> R<RawNs> {
    let e = |what: &str, e: rtnetlink::Error| format!("cannot list {what}: {e}");
    let mut raw = RawNs::default();
    let mut names = BTreeMap::new();
    let mut links = h.link().get().execute();
    while let Some(l) = links.try_next().await.map_err(|x| e("links", x))? {
        let name = l.attributes.iter().find_map(|a| match a {
            LinkAttribute::IfName(n) => Some(n.clone()),
            _ => None,
        });
        let Some(name) = name else { continue };
        names.insert(l.header.index, name.clone());
        raw.links.push(Link {
            ns: ns.clone(),
            name,
            kind: link_kind(&l.attributes),
            mtu: l
                .attributes
                .iter()
                .find_map(|a| match a {
                    LinkAttribute::Mtu(m) => Some(*m),
                    _ => None,
                })
                .unwrap_or(0),
            up: l.header.flags.contains(LinkFlags::Up),
        });
    }
    let mut addrs = h.address().get().execute();
    while let Some(a) = addrs.try_next().await.map_err(|x| e("addresses", x))? {
        let ip = a.attributes.iter().find_map(|x| match x {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        });
        let no_prefix_route = a.attributes.iter().any(|x| {
            matches!(x, AddressAttribute::Flags(f) if f.contains(rtnetlink::packet_route::address::AddressFlags::Noprefixroute))
        });
        if let (Some(ip), Some(link)) = (ip, names.get(&a.header.index))
            && let Ok(cidr) = IpNet::new(ip, a.header.prefix_len)
        {
            raw.addresses.push(Address {
                ns: ns.clone(),
                link: link.clone(),
                cidr,
                no_prefix_route,
            });
        }
    }
    // A host without IPv6 (booted with ipv6.disable=1) has no IPv6 routes
    // or rules to read, and refuses to be asked for them: IPv4 only then.
    let ipv6 = std::path::Path::new("/proc/sys/net/ipv6").exists();
    let mut filters = vec![RouteMessageBuilder::<Ipv4Addr>::new().build()];
    let mut versions = vec![rtnetlink::IpVersion::V4];
    if ipv6 {
        filters.push(RouteMessageBuilder::<std::net::Ipv6Addr>::new().build());
        versions.push(rtnetlink::IpVersion::V6);
    }
    for filter in filters {
        let mut routes = h.route().get(filter).execute();
        while let Some(m) = routes.try_next().await.map_err(|x| e("routes", x))? {
            raw.routes.extend(route_of(ns, &m, &names));
        }
    }
    for version in versions {
        let mut rules = h.rule().get(version).execute();
        while let Some(m) = rules.try_next().await.map_err(|x| e("rules", x))? {
            raw.rules.extend(rule_of(ns, &m));
        }
    }
    for f in [Family::V4, Family::V6] {
        if std::fs::read_to_string(forwarding_path(f)).is_ok_and(|s| s.trim() == "1") {
            raw.forwarding.insert(f);
        }
    }
    Ok(raw)
}
