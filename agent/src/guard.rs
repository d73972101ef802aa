//! The agent's guard: what a controller may ask of this host, checked
//! before anything touches the kernel. The agent runs as root, so a
//! compromised controller (or store, or a tampered state file) must not
//! reach past weft's own objects:
//!
//! - links are weft's (`weft…`, at most 15 bytes), and so is every link an
//!   address, route, rule, SNAT or WireGuard peer names;
//! - namespaces are weft's: `weft-…` names of letters, digits and '-'
//!   (no path: the agent opens them under /run/netns);
//! - in the host's own namespace, routes live only in weft's table
//!   ([`weft_proto::HOST_TABLE`]) and rules only at weft's priority
//!   ([`weft_proto::HOST_RULE_PRIORITY`]) pointing at that table, for a
//!   destination of /8 or narrower; no rule or route there covers this
//!   host's underlay address or its controllers' (that would pull the
//!   agent's own control traffic into the fabric); weft's peering
//!   namespaces are weft's whole;
//! - what the host reaches outside the fabric stays outside it. The agent
//!   reads its own namespace before each apply ([`HostNets`]): the
//!   networks of links that are not weft's, the gateways of its main table
//!   and its resolvers. No route in weft's table overlaps one of those
//!   networks, and no route or rule there covers one of those addresses,
//!   the underlay or a controller;
//! - an address fits its link's role: a link-local /30 (169.254.0.0/16) on
//!   a veth or WireGuard link; on an overlay link or workload bridge a /32
//!   (/128), or a network whose prefix route passes the checks a route in
//!   the host's namespace passes (/8 or narrower for IPv4, /32 for IPv6,
//!   over nothing the host reaches outside the fabric). On any of weft's
//!   links, an IPv6 link-local address in fe80::/64 (the overlay's next
//!   hops: scoped to that link, it takes nothing over). Never one of the
//!   protected addresses above, which would turn it local and cut the host
//!   off from it; never on a link that the desired state does not make;
//! - in the host's namespace no route or rule names IPv6 special-use
//!   space (link-local, multicast, loopback...), and a route through an
//!   IPv6 link-local next hop names its (weft's) device;
//! - addresses, CIDRs, endpoints and keys parse as what they are, so no
//!   field can smuggle text into a configuration channel (WireGuard's UAPI
//!   is line-based).
//!
//! A refused object is reported as an object error and never applied; the
//! rest still applies. Deleting an object that was refused touches nothing
//! outside weft's own: a route refused because the host's networks changed
//! under it is withdrawn from weft's table, since weft no longer wants it.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use weft_proto::v1 as pb;
use weft_proto::v1::desired_object::Kind;

use crate::apply::HostNets;

mod guarded;
pub use guarded::Guarded;

/// What this host must keep reaching outside the fabric.
#[derive(Clone, Debug, Default)]
pub struct Guard {
    /// Given at start: the underlay address and the controllers', each
    /// with what it is.
    protected: Vec<(IpAddr, String)>,
    /// Read off the host before each apply.
    host: HostNets,
    /// Set while the host's networks were never read (the first read
    /// failed): nothing goes into the host's namespace until they are,
    /// since nothing could be checked against them.
    unread: Option<String>,
}

/// What role a link has, from the object that makes it: it bounds the
/// addresses the link may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkRole {
    /// A veth end or a WireGuard link: a link-local /30.
    PointToPoint,
    /// VXLAN or Geneve, or a workload bridge.
    Network,
}

/// The links the desired state makes, by (namespace, name).
pub type Links = HashMap<(String, String), LinkRole>;

/// The links `objects` make (a veth makes both its ends).
pub fn links<'a>(objects: impl IntoIterator<Item = &'a pb::DesiredObject>) -> Links {
    let mut out = Links::new();
    for o in objects {
        let Some(Kind::Link(l)) = &o.kind else { continue };
        let role = match &l.kind {
            Some(pb::link::Kind::Veth(v)) => {
                out.insert((v.peer_namespace.clone(), v.peer_name.clone()), LinkRole::PointToPoint);
                LinkRole::PointToPoint
            }
            Some(pb::link::Kind::Wireguard(_)) => LinkRole::PointToPoint,
            Some(pb::link::Kind::Vxlan(_) | pb::link::Kind::Geneve(_) | pb::link::Kind::Bridge(_)) => LinkRole::Network,
            None => continue,
        };
        out.insert((l.namespace.clone(), l.name.clone()), role);
    }
    out
}

/// Where clouds serve instance metadata (and credentials): never weft's.
const METADATA: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);

/// 169.254.0.0/16: where weft's veths and tunnel probes take their /30s.
const LINK_LOCAL: Ipv4Net = match Ipv4Net::new(Ipv4Addr::new(169, 254, 0, 0), 16) {
    Ok(n) => n,
    Err(_) => panic!("169.254.0.0/16"),
};

/// fe80::/64: the IPv6 link-local addresses weft's links take.
const LINK_LOCAL_V6: Ipv6Net = match Ipv6Net::new(Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0), 64) {
    Ok(n) => n,
    Err(_) => panic!("fe80::/64"),
};

/// An IPv6 link-local address on a link of weft's: fe80::/64 itself.
fn link_local_v6(net: IpNet) -> bool {
    matches!(net, IpNet::V6(n) if n.prefix_len() == 64 && LINK_LOCAL_V6.contains(&n.addr()))
}

fn point_to_point(what: &str, net: IpNet) -> R {
    match net {
        IpNet::V4(n) if n.prefix_len() == 30 && LINK_LOCAL.contains(&n) => Ok(()),
        n if link_local_v6(n) => Ok(()),
        _ => Err(format!(
            "{what} {net} is not a link-local /30 (in 169.254.0.0/16) or an IPv6 link-local /64 (in fe80::/64), which is all a veth or WireGuard link of weft's takes"
        )),
    }
}

/// The widest network weft routes or rules in the host's namespace.
fn widest(net: IpNet) -> u8 {
    match net {
        IpNet::V4(_) => 8,
        IpNet::V6(_) => 32,
    }
}

type R = Result<(), String>;

use weft_types::name::{link as link_name, namespace};
use weft_types::net;
use weft_types::net::Family;

/// `parsed`, its error put after field `what` (weft-types' messages start
/// with the text they were given).
fn field<T>(what: &str, parsed: Result<T, String>) -> Result<T, String> {
    parsed.map_err(|m| format!("{what} {m}"))
}

fn opt_link(what: &str, name: &str) -> R {
    if name.is_empty() { Ok(()) } else { link_name(what, name) }
}

impl Guard {
    /// A guard for a host whose underlay address is `underlay` and whose
    /// controllers are `controllers` (URLs; those naming an address are
    /// protected).
    pub fn new(underlay: Option<IpAddr>, controllers: &[String]) -> Guard {
        let mut protected: Vec<(IpAddr, String)> = underlay
            .into_iter()
            .map(|a| (a, "this host's underlay address".to_string()))
            .collect();
        for c in controllers {
            let rest = c.split_once("://").map_or(c.as_str(), |(_, r)| r);
            let host = rest.split('/').next().unwrap_or_default();
            let addr = if let Ok(a) = host.parse::<SocketAddr>() {
                Some(a.ip())
            } else if let Ok(a) = host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
                Some(a)
            } else if let Some((h, _)) = host.rsplit_once(':')
                && let Ok(a) = h.parse::<IpAddr>()
            {
                Some(a)
            } else {
                None
            };
            protected.extend(addr.map(|a| (a, format!("a controller of this agent ({c})"))));
        }
        protected.push((
            IpAddr::V4(METADATA),
            "the link-local metadata service address (clouds serve instance data there)".to_string(),
        ));
        Guard {
            protected,
            host: HostNets::default(),
            unread: None,
        }
    }

    /// Takes the host's networking as last read.
    pub fn set_host(&mut self, host: HostNets) {
        self.host = host;
        self.unread = None;
    }

    /// The host's networking could not be read (`why`): what was last read
    /// stays; if nothing was, the host's namespace stays closed.
    pub fn host_unread(&mut self, why: String) {
        tracing::warn!(error = %why, "cannot read the host's networks; the guard keeps what it last read");
        if self.host == HostNets::default() {
            self.unread = Some(why);
        }
    }

    /// Refuses anything in the host's namespace while its networks are
    /// unknown, and IPv6 special-use space there (link-local, multicast,
    /// loopback...: never a site's; weft's own IPv4 links take IPv4
    /// link-local /30s, routed in its table).
    fn host_namespace(&self, what: &str, net: IpNet) -> R {
        if let Some(why) = &self.unread {
            return Err(format!(
                "{what} {net} in the host's namespace, whose networks could not be read ({why}); \
                 it waits until they can be checked"
            ));
        }
        if let Some(kind) = net::special_use(net).filter(|_| net.addr().is_ipv6()) {
            return Err(format!(
                "{what} {net} in the host's namespace is in {kind} space, which no site's network is in"
            ));
        }
        Ok(())
    }

    /// Every address this host reaches outside the fabric, with what it is.
    fn reached(&self) -> impl Iterator<Item = (IpAddr, std::borrow::Cow<'_, str>)> {
        use std::borrow::Cow;
        let own = self
            .host
            .connected
            .iter()
            .map(|(n, link)| (n.addr(), Cow::Owned(format!("an address of this host (on {link})"))));
        self.protected
            .iter()
            .map(|(a, what)| (*a, Cow::Borrowed(what.as_str())))
            .chain(
                self.host
                    .reached
                    .iter()
                    .map(|(a, what)| (*a, Cow::Borrowed(what.as_str()))),
            )
            .chain(own)
    }

    /// What of the host's own a destination in its namespace would take
    /// into weft's table, if anything: the protected addresses it covers
    /// and the host's networks it overlaps.
    fn takes_over(&self, dst: IpNet) -> R {
        if let Some((ip, what)) = self.reached().find(|(ip, _)| dst.contains(ip)) {
            return Err(format!(
                "covers {ip}, {what}, which this host reaches outside the fabric"
            ));
        }
        if let Some((n, link)) = self
            .host
            .connected
            .iter()
            .find(|(n, _)| n.trunc().contains(&dst.network()) || dst.contains(&n.network()))
        {
            return Err(format!(
                "overlaps {}, the network of {link}, which this host is attached to outside the fabric",
                n.trunc()
            ));
        }
        Ok(())
    }

    /// Ok when `o` stays within what weft owns, given the links the desired
    /// state makes; else why not.
    pub fn check(&self, o: &pb::DesiredObject, links: &Links) -> R {
        match &o.kind {
            None => Err("the object has no kind".into()),
            Some(Kind::Namespace(n)) if n.name.is_empty() => Err("a namespace without a name".into()),
            Some(Kind::Namespace(n)) => namespace("namespace", &n.name),
            Some(Kind::Link(l)) => self.link(l),
            Some(Kind::Address(a)) => self.address(a, links),
            Some(Kind::Route(r)) => {
                namespace("namespace", &r.namespace)?;
                if r.namespace.is_empty() && r.table != weft_proto::HOST_TABLE {
                    return Err(format!(
                        "a route in table {} of the host's namespace; weft routes only in its table {}",
                        r.table,
                        weft_proto::HOST_TABLE
                    ));
                }
                let dst = field("route destination", net::cidr(&r.destination))?.net();
                if !r.peer_site.is_empty() {
                    weft_types::name::id("route's peer site", &r.peer_site)?;
                    if !r.namespace.is_empty() {
                        return Err(format!(
                            "a route to peer {}'s view inside namespace {}; views are routed in the host's namespace",
                            r.peer_site, r.namespace
                        ));
                    }
                }
                if r.namespace.is_empty() {
                    self.host_namespace("a route for", dst)?;
                    self.takes_over(dst).map_err(|why| format!("a route for {dst} {why}"))?;
                }
                if !r.gateway.is_empty() {
                    let g = field("route gateway", net::addr(&r.gateway))?;
                    if Family::of(g) != Family::of(dst.addr()) {
                        return Err(format!("a route for {dst} through {g}, of another family"));
                    }
                    if let IpAddr::V6(v6) = g
                        && v6.is_unicast_link_local()
                        && r.device.is_empty()
                    {
                        return Err(format!(
                            "a route for {dst} through link-local {g} names no device; it is reached only on one of weft's links"
                        ));
                    }
                }
                opt_link("route device", &r.device)
            }
            Some(Kind::Rule(r)) => self.rule(r),
            Some(Kind::NatMap(n)) => {
                if n.namespace.is_empty() {
                    return Err("prefix NAT in the host's namespace; weft maps only in its peering namespaces".into());
                }
                namespace("namespace", &n.namespace)?;
                field("real CIDR", net::cidr(&n.real_cidr))?;
                field("local CIDR", net::cidr(&n.local_cidr))?;
                link_name("tunnel", &n.tunnel)
            }
            Some(Kind::WireguardPeer(p)) => {
                link_name("WireGuard link", &p.link)?;
                namespace("namespace", &p.namespace)?;
                weft_types::WgKey::parse("public key", &p.public_key)?;
                if !p.endpoint.is_empty() {
                    field("endpoint", net::endpoint(&p.endpoint))?;
                }
                for a in &p.allowed_ips {
                    field("allowed IP", net::cidr(a))?;
                }
                if p.persistent_keepalive > 65535 {
                    return Err(format!("keepalive {} is over 65535 s", p.persistent_keepalive));
                }
                Ok(())
            }
            Some(Kind::DnsRecord(r)) => crate::dns::check_record(r).map(|_| ()),
            Some(Kind::RelaySession(r)) => crate::relay::check(r).map(|_| ()),
            // Nothing in it: the address is the agent's own --lan-address.
            Some(Kind::LanAddress(_)) => Ok(()),
            Some(Kind::TunnelFilter(f)) => {
                if f.namespace.is_empty() {
                    return Err(
                        "a tunnel filter in the host's namespace; weft filters only in its peering namespaces".into(),
                    );
                }
                namespace("namespace", &f.namespace)?;
                link_name("tunnel", &f.tunnel)?;
                for a in &f.allowed {
                    field("allowed destination", net::cidr(a))?;
                }
                weft_dataplane::desired::transit_prefixes(f)?;
                weft_dataplane::desired::policy_rules(f).map(|_| ())
            }
            Some(Kind::ExportMap(x)) => {
                if x.namespace.is_empty() {
                    return Err(
                        "an export in the host's namespace; weft maps exports only in its peering namespaces".into(),
                    );
                }
                namespace("namespace", &x.namespace)?;
                link_name("tunnel", &x.tunnel)?;
                field("export's external address", net::addr_v4(&x.external_address))?;
                let host = field("exported host", net::addr_v4(&x.host_address))?;
                if host.is_unspecified()
                    || host.is_loopback()
                    || host.is_multicast()
                    || host.is_broadcast()
                    || host.is_link_local()
                {
                    return Err(format!(
                        "exported host {host} is not a unicast address on the site's LAN"
                    ));
                }
                let own = self.protected.iter().map(|(a, what)| (*a, what.as_str())).chain(
                    self.host
                        .connected
                        .iter()
                        .map(|(n, _)| (n.addr(), "an address of this host")),
                );
                if let Some((_, what)) = own.into_iter().find(|(a, _)| *a == IpAddr::V4(host)) {
                    return Err(format!(
                        "exported host {host} is {what}: peers would reach this host through the tunnel"
                    ));
                }
                Ok(())
            }
            Some(Kind::HostSnat(s)) => {
                link_name("SNAT on link", &s.link)?;
                field("SNAT address", net::addr(&s.address))?;
                for c in &s.except {
                    field("SNAT exception", net::cidr(c))?;
                }
                Ok(())
            }
        }
    }

    fn link(&self, l: &pb::Link) -> R {
        link_name("link", &l.name)?;
        namespace("namespace", &l.namespace)?;
        if l.mtu != 0 && !(576..=9000).contains(&l.mtu) {
            return Err(format!("MTU {} is out of range (576 to 9000)", l.mtu));
        }
        match &l.kind {
            None => Err(format!("link {} has no kind", l.name)),
            Some(pb::link::Kind::Vxlan(v)) => {
                field("VXLAN local", net::addr(&v.local))?;
                field("VXLAN remote", net::addr(&v.remote)).map(|_| ())
            }
            Some(pb::link::Kind::Geneve(g)) => field("Geneve remote", net::addr(&g.remote)).map(|_| ()),
            Some(pb::link::Kind::Wireguard(w)) => {
                if !(1..=65535).contains(&w.listen_port) {
                    return Err(format!("listen port {} is not 1 to 65535", w.listen_port));
                }
                let a = field("tunnel address", net::iface(&w.address))?;
                point_to_point("tunnel address", a)?;
                field("tunnel peer address", net::addr(&w.peer_address)).map(|_| ())
            }
            Some(pb::link::Kind::Veth(v)) => {
                link_name("veth peer", &v.peer_name)?;
                namespace("veth peer namespace", &v.peer_namespace)
            }
            Some(pb::link::Kind::Bridge(_)) => Ok(()),
        }
    }

    fn address(&self, a: &pb::Address, links: &Links) -> R {
        link_name("address on link", &a.link)?;
        namespace("namespace", &a.namespace)?;
        let net = field("address", net::iface(&a.cidr))?;
        let role = links.get(&(a.namespace.clone(), a.link.clone()));
        if role.is_none() {
            return Err(format!(
                "address {net} on {}, a link that weft's desired state does not make",
                a.link
            ));
        }
        // Scoped to its link, one of weft's: it takes nothing over.
        if link_local_v6(net) {
            return Ok(());
        }
        if let Some((_, what)) = self.reached().find(|(ip, _)| *ip == net.addr()) {
            return Err(format!(
                "address {net} is {what}: made local on {}, the host would no longer reach it",
                a.link
            ));
        }
        match role {
            None => unreachable!("checked above"),
            Some(LinkRole::PointToPoint) => point_to_point("address", net)?,
            Some(LinkRole::Network) if net.prefix_len() == net.max_prefix_len() => {}
            Some(LinkRole::Network) if a.namespace.is_empty() && net.prefix_len() < widest(net) => {
                return Err(format!(
                    "address {net} routes {} in the host's namespace; weft's links take /{} or narrower, or a single address",
                    net.trunc(),
                    widest(net)
                ));
            }
            Some(LinkRole::Network) => {}
        }
        // Weft's own namespaces are weft's whole.
        if !a.namespace.is_empty() {
            return Ok(());
        }
        self.host_namespace("address", net)?;
        // In the host's namespace an address makes its network local
        // there (a /32 its one address): that network passes what a route
        // of weft's would, so a LAN neighbour's address or a network the
        // host reaches cannot be taken over.
        self.takes_over(net.trunc())
            .map_err(|why| format!("address {net} on {}: its network {} {why}", a.link, net.trunc()))
    }

    fn rule(&self, r: &pb::Rule) -> R {
        namespace("namespace", &r.namespace)?;
        let family = if r.ipv6 { Family::V6 } else { Family::V4 };
        let of_family = |what: &str, n: IpNet| {
            if Family::of(n.addr()) == family {
                Ok(n)
            } else {
                Err(format!("a rule for {family} with {what} {n}"))
            }
        };
        if !r.from.is_empty() {
            of_family("source", field("rule source", net::cidr(&r.from))?.net())?;
        }
        let to = match r.to.as_str() {
            "" => None,
            t => Some(of_family(
                "destination",
                field("rule destination", net::cidr(t))?.net(),
            )?),
        };
        opt_link("rule input interface", &r.iif)?;
        if !r.namespace.is_empty() {
            return Ok(()); // weft's own namespace
        }
        if let Some(to) = to {
            self.host_namespace("a rule for", to)?;
        }
        if r.priority != weft_proto::HOST_RULE_PRIORITY || r.table != weft_proto::HOST_TABLE {
            return Err(format!(
                "a rule at priority {} to table {} in the host's namespace; weft's rules are at priority {} to table {}",
                r.priority,
                r.table,
                weft_proto::HOST_RULE_PRIORITY,
                weft_proto::HOST_TABLE
            ));
        }
        let Some(to) = to else {
            return Err("a rule for every destination in the host's namespace; weft's rules name one CIDR".into());
        };
        if to.prefix_len() < widest(to) {
            return Err(format!(
                "a rule for {to} in the host's namespace; weft's rules are /{} or narrower",
                widest(to)
            ));
        }
        if let Some((ip, what)) = self.reached().find(|(ip, _)| to.contains(ip)) {
            return Err(format!(
                "a rule for {to} covers {ip}, {what}, which this host reaches outside the fabric"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::{Applier, Objects, Scope};

    fn obj(kind: Kind) -> pb::DesiredObject {
        pb::DesiredObject {
            id: "x".into(),
            kind: Some(kind),
        }
    }

    fn guard() -> Guard {
        Guard::new(
            Some("192.168.78.11".parse().unwrap()),
            &["https://192.168.78.1:7443".into()],
        )
    }

    fn rule(priority: u32, table: u32, to: &str) -> Kind {
        Kind::Rule(pb::Rule {
            namespace: String::new(),
            priority,
            from: String::new(),
            to: to.into(),
            table,
            iif: String::new(),
            ipv6: false,
        })
    }

    fn route(ns: &str, table: u32, dst: &str, dev: &str) -> Kind {
        Kind::Route(pb::Route {
            namespace: ns.into(),
            table,
            destination: dst.into(),
            gateway: String::new(),
            device: dev.into(),
            peer_site: String::new(),
        })
    }

    #[test]
    fn what_weft_renders_passes() {
        let g = guard();
        for k in [
            rule(7765, 7765, "10.1.0.0/16"),
            route("", 7765, "10.0.0.0/16", "weft-vx0"),
            route("weft-p-0123456789ab", 0, "10.1.0.0/16", "weft-iabc"),
            route("weft-p-0123456789ab", 1, "0.0.0.0/0", "weft-wabc"),
            Kind::Namespace(pb::Namespace {
                name: "weft-p-0123456789ab".into(),
            }),
            Kind::HostSnat(pb::HostSnat {
                link: "weft-vx0".into(),
                address: "10.70.0.3".into(),
                except: vec!["10.1.0.0/16".into()],
            }),
            Kind::WireguardPeer(pb::WireguardPeer {
                link: "weft-wabc".into(),
                namespace: "weft-p-0123456789ab".into(),
                public_key: "hT7XTB7qgr4m+5V8gqhnNtjvNrqSqPFiCjPsXl1Oc0Q=".into(),
                endpoint: "192.0.2.1:51821".into(),
                allowed_ips: vec!["10.1.0.0/16".into()],
                persistent_keepalive: 25,
            }),
        ] {
            assert_eq!(g.check(&obj(k.clone()), &Links::new()), Ok(()), "{k:?}");
        }
    }

    #[test]
    fn what_reaches_past_weft_is_refused() {
        let g = guard();
        let refused = [
            (route("", 254, "10.9.0.0/16", "weft-vx0"), "table 254"),
            (route("", 255, "10.9.0.0/16", "weft-vx0"), "table 255"),
            (route("", 7765, "10.9.0.0/16", "eth0"), "\"eth0\""),
            (rule(0, 7765, "10.9.0.0/16"), "priority 0"),
            (rule(7765, 254, "10.9.0.0/16"), "table 254"),
            (rule(7765, 7765, ""), "every destination"),
            (rule(7765, 7765, "0.0.0.0/1"), "/8 or narrower"),
            (rule(7765, 7765, "192.168.78.0/24"), "192.168.78.11"),
            (rule(7765, 7765, "192.168.78.1/32"), "192.168.78.1"),
            (route("", 7765, "192.168.78.0/24", "weft-vx0"), "192.168.78.11"),
            (
                Kind::Address(pb::Address {
                    link: "eth0".into(),
                    namespace: String::new(),
                    cidr: "192.168.78.11/24".into(),
                    no_prefix_route: false,
                }),
                "\"eth0\"",
            ),
            (
                Kind::Namespace(pb::Namespace {
                    name: "../../proc/1/ns/net".into(),
                }),
                "namespaces",
            ),
            (Kind::Namespace(pb::Namespace { name: "other".into() }), "namespaces"),
            (
                Kind::HostSnat(pb::HostSnat {
                    link: "eth0".into(),
                    address: "10.70.0.3".into(),
                    except: vec![],
                }),
                "\"eth0\"",
            ),
            (
                Kind::WireguardPeer(pb::WireguardPeer {
                    link: "weft-wabc".into(),
                    namespace: String::new(),
                    public_key: "hT7XTB7qgr4m+5V8gqhnNtjvNrqSqPFiCjPsXl1Oc0Q=".into(),
                    endpoint: "192.0.2.1:51820\nlisten_port=1".into(),
                    allowed_ips: vec![],
                    persistent_keepalive: 0,
                }),
                "endpoint",
            ),
            (
                Kind::WireguardPeer(pb::WireguardPeer {
                    link: "weft-wabc".into(),
                    namespace: String::new(),
                    public_key: "AAAA\npublic_key=00".into(),
                    endpoint: String::new(),
                    allowed_ips: vec![],
                    persistent_keepalive: 0,
                }),
                "public key",
            ),
            (
                Kind::Link(pb::Link {
                    name: "eth0".into(),
                    namespace: String::new(),
                    mtu: 1500,
                    kind: Some(pb::link::Kind::Bridge(pb::Bridge {})),
                }),
                "\"eth0\"",
            ),
            (
                Kind::NatMap(pb::NatMap {
                    namespace: String::new(),
                    real_cidr: "10.1.0.0/16".into(),
                    local_cidr: "10.9.0.0/16".into(),
                    tunnel: "weft-wabc".into(),
                }),
                "host's namespace",
            ),
        ];
        for (k, needle) in refused {
            let e = g.check(&obj(k.clone()), &Links::new()).expect_err(&format!("{k:?}"));
            assert!(e.contains(needle), "{k:?}: {e}");
        }
    }

    fn address(link: &str, ns: &str, cidr: &str) -> Kind {
        Kind::Address(pb::Address {
            link: link.into(),
            namespace: ns.into(),
            cidr: cidr.into(),
            no_prefix_route: false,
        })
    }

    fn link(name: &str, ns: &str, kind: pb::link::Kind) -> pb::DesiredObject {
        obj(Kind::Link(pb::Link {
            name: name.into(),
            namespace: ns.into(),
            mtu: 0,
            kind: Some(kind),
        }))
    }

    /// A host on 192.168.78.0/24 (eth0) with a second LAN on eth1, a
    /// default gateway and a resolver beyond it.
    fn host_guard() -> Guard {
        let mut g = guard();
        g.set_host(HostNets {
            connected: vec![
                ("192.168.78.11/24".parse().unwrap(), "eth0".into()),
                ("172.20.5.7/24".parse().unwrap(), "eth1".into()),
                ("127.0.0.1/8".parse().unwrap(), "lo".into()),
                ("2001:db8:78::11/64".parse().unwrap(), "eth0".into()),
                ("fe80::1234/64".parse().unwrap(), "eth0".into()),
            ],
            reached: [
                ("192.168.78.254", "a gateway of the host's main table"),
                ("fe80::1", "a gateway of the host's main table"),
                ("10.53.0.2", "a resolver of the host (/etc/resolv.conf)"),
            ]
            .map(|(a, w)| (a.parse().unwrap(), w.to_string()))
            .to_vec(),
        });
        g
    }

    fn weft_links() -> Links {
        links(&[
            link(
                "weft-vx0",
                "",
                pb::link::Kind::Vxlan(pb::Vxlan {
                    vni: 1,
                    local: "192.168.78.11".into(),
                    remote: "192.168.78.10".into(),
                    port: 4789,
                }),
            ),
            link(
                "weft-vabc",
                "",
                pb::link::Kind::Veth(pb::Veth {
                    peer_name: "weft-iabc".into(),
                    peer_namespace: "weft-p-0123456789ab".into(),
                }),
            ),
            link("weft-br", "", pb::link::Kind::Bridge(pb::Bridge {})),
        ])
    }

    #[test]
    fn addresses_fit_their_links_role_and_routes_keep_off_the_hosts_networks() {
        let g = host_guard();
        let l = weft_links();
        for k in [
            address("weft-vx0", "", "10.80.0.3/16"),
            address("weft-vx0", "", "10.80.0.3/32"),
            address("weft-vabc", "", "169.254.0.5/30"),
            address("weft-iabc", "weft-p-0123456789ab", "169.254.0.6/30"),
            address("weft-br", "", "10.1.3.1/24"),
            route("", 7765, "10.2.0.0/16", "weft-vx0"),
            rule(7765, 7765, "10.2.0.0/16"),
        ] {
            assert_eq!(g.check(&obj(k.clone()), &l), Ok(()), "{k:?}");
        }
        let refused = [
            (address("weft-vx0", "", "0.0.0.1/1"), "/8 or narrower"),
            (address("weft-vx0", "", "192.168.78.1/32"), "a controller"),
            (
                address("weft-vx0", "", "192.168.78.254/32"),
                "a gateway of the host's main table",
            ),
            (address("weft-vx0", "", "10.53.0.2/32"), "a resolver"),
            (address("weft-vx0", "", "172.20.5.7/32"), "an address of this host"),
            (
                address("weft-vx0", "", "172.20.9.1/16"),
                "172.20.5.7, an address of this host",
            ),
            (address("weft-vx0", "", "172.20.5.200/25"), "the network of eth1"),
            (address("weft-vx0", "", "10.53.9.1/16"), "10.53.0.2"),
            (address("weft-vabc", "", "10.9.0.1/30"), "link-local /30"),
            (address("weft-vabc", "", "169.254.0.5/16"), "link-local /30"),
            (address("weft-other", "", "10.9.0.1/32"), "does not make"),
            (route("", 7765, "172.20.0.0/16", "weft-vx0"), "172.20.5.7"),
            (route("", 7765, "172.20.5.128/25", "weft-vx0"), "the network of eth1"),
            (route("", 7765, "10.53.0.0/16", "weft-vx0"), "a resolver"),
            (route("", 7765, "127.0.0.0/8", "weft-vx0"), "127.0.0.1"),
            (rule(7765, 7765, "192.168.0.0/16"), "192.168.78."),
            (rule(7765, 7765, "10.53.0.0/16"), "a resolver"),
        ];
        for (k, needle) in refused {
            let e = g.check(&obj(k.clone()), &l).expect_err(&format!("{k:?}"));
            assert!(e.contains(needle), "{k:?}: {e}");
        }
        // A tunnel's own address is a link-local /30 too.
        let wg = |address: &str| {
            Kind::Link(pb::Link {
                name: "weft-wabc".into(),
                namespace: "weft-p-0123456789ab".into(),
                mtu: 1420,
                kind: Some(pb::link::Kind::Wireguard(pb::Wireguard {
                    listen_port: 51821,
                    address: address.into(),
                    peer_address: "169.254.255.254".into(),
                    peer_site: "b".into(),
                    reflectors: vec![],
                })),
            })
        };
        assert_eq!(g.check(&obj(wg("169.254.255.253/30")), &l), Ok(()));
        let e = g.check(&obj(wg("192.168.78.1/1")), &l).unwrap_err();
        assert!(e.contains("link-local /30"), "{e}");
    }

    #[test]
    fn in_the_hosts_namespace_no_address_takes_a_neighbour_the_metadata_service_or_the_hosts_ipv6() {
        let g = host_guard();
        let l = weft_links();
        let rule6 = |to: &str, ipv6| {
            Kind::Rule(pb::Rule {
                namespace: String::new(),
                priority: 7765,
                from: String::new(),
                to: to.into(),
                table: 7765,
                iif: String::new(),
                ipv6,
            })
        };
        let via = |dst: &str, gateway: &str, dev: &str| {
            Kind::Route(pb::Route {
                namespace: String::new(),
                table: 7765,
                destination: dst.into(),
                gateway: gateway.into(),
                device: dev.into(),
                peer_site: String::new(),
            })
        };
        let refused = [
            // A LAN neighbour's address, as a /32 or as a veth's /30.
            (address("weft-vx0", "", "192.168.78.77/32"), "the network of eth0"),
            (address("weft-vabc", "", "169.254.169.253/30"), "metadata"),
            (route("", 7765, "169.254.169.254/32", "weft-vx0"), "metadata"),
            // The host's own IPv6: its network, its address, special space.
            (address("weft-vx0", "", "2001:db8:78::77/128"), "the network of eth0"),
            (route("", 7765, "2001:db8:78::/48", "weft-vx0"), "2001:db8:78::11"),
            (
                route("", 7765, "2001:db8:78:0:8000::/65", "weft-vx0"),
                "the network of eth0",
            ),
            (route("", 7765, "fe80::/10", "weft-vx0"), "link-local"),
            (route("", 7765, "ff02::/16", "weft-vx0"), "multicast"),
            (rule6("fd00::/8", true), "/32 or narrower"),
            (rule6("2001:db8:78::11/128", true), "2001:db8:78::11"),
            (address("weft-vx0", "", "fd00::1/16"), "/32 or narrower"),
            // Families kept apart.
            (rule6("fd00:1::/48", false), "a rule for IPv4"),
            (rule6("10.9.0.0/16", true), "a rule for IPv6"),
            (via("fd00:1::/48", "10.80.0.1", "weft-vx0"), "another family"),
            (via("fd00:1::/48", "fe80::a50:1", ""), "names no device"),
            // Link-local only as weft's fe80::/64, on weft's links.
            (address("weft-vx0", "", "fe80:1::1/64"), "link-local"),
            (address("eth0", "", "fe80::2/64"), "\"eth0\""),
            (address("weft-nope", "", "fe80::2/64"), "does not make"),
        ];
        for (k, needle) in refused {
            let e = g.check(&obj(k.clone()), &l).expect_err(&format!("{k:?}"));
            assert!(e.contains(needle), "{k:?}: {e}");
        }
        // What weft renders for IPv6 passes: a link-local next hop on
        // its links, a site's ULA routed and ruled.
        for k in [
            address("weft-vx0", "", "fe80::a50:3/64"),
            address("weft-vabc", "", "fe80::1/64"),
            address("weft-iabc", "weft-p-0123456789ab", "fe80::2/64"),
            via("fd00:1::/48", "fe80::a50:1", "weft-vx0"),
            rule6("fd00:1::/48", true),
            route("weft-p-0123456789ab", 1, "fd00:1::/48", "weft-wabc"),
        ] {
            assert_eq!(g.check(&obj(k.clone()), &l), Ok(()), "{k:?}");
        }
        // Weft's own namespaces are weft's.
        assert_eq!(
            g.check(&obj(address("weft-iabc", "weft-p-0123456789ab", "169.254.0.6/30")), &l),
            Ok(())
        );
        // Host networks never read: nothing goes into the host's
        // namespace; a later read opens it.
        let mut g = guard();
        g.host_unread("netlink: permission denied".into());
        let e = g
            .check(&obj(route("", 7765, "10.2.0.0/16", "weft-vx0")), &l)
            .unwrap_err();
        assert!(e.contains("could not be read"), "{e}");
        let e = g.check(&obj(address("weft-vx0", "", "10.80.0.3/32")), &l).unwrap_err();
        assert!(e.contains("could not be read"), "{e}");
        assert_eq!(
            g.check(&obj(route("weft-p-0123456789ab", 0, "10.1.0.0/16", "weft-iabc")), &l),
            Ok(())
        );
        g.set_host(host_guard().host);
        assert_eq!(g.check(&obj(route("", 7765, "10.2.0.0/16", "weft-vx0")), &l), Ok(()));
        // A failed read after a good one keeps what was read.
        g.host_unread("again".into());
        assert_eq!(g.check(&obj(route("", 7765, "10.2.0.0/16", "weft-vx0")), &l), Ok(()));
    }

    #[test]
    fn resolvers_are_read_from_resolv_conf() {
        let r = HostNets::resolvers("# x\nnameserver 10.53.0.2\nsearch lan\nnameserver fd00::53\nnameserver bogus\n");
        let got: Vec<String> = r.iter().map(|(a, _)| a.to_string()).collect();
        assert_eq!(got, ["10.53.0.2", "fd00::53"]);
    }

    /// An applier that records what reached it.
    #[derive(Default)]
    struct Recorder {
        upserts: Vec<String>,
        deletes: Vec<String>,
        held: Vec<String>,
    }

    #[async_trait::async_trait]
    impl Applier for Recorder {
        async fn apply(&mut self, applied: &Objects, desired: &Objects, _: Scope) -> Vec<pb::ObjectError> {
            let (changed, gone) = crate::apply::diff(applied, desired);
            self.held = applied.keys().cloned().collect();
            self.upserts.extend(changed.iter().map(|o| o.id.clone()));
            self.deletes.extend(gone);
            vec![]
        }
    }

    #[tokio::test]
    async fn refused_objects_are_reported_and_never_reach_the_host() {
        let mut a = Guarded::new(Recorder::default(), guard());
        let good = pb::DesiredObject {
            id: "good".into(),
            kind: Some(rule(7765, 7765, "10.1.0.0/16")),
        };
        let bad = pb::DesiredObject {
            id: "bad".into(),
            kind: Some(rule(0, 254, "0.0.0.0/0")),
        };
        let both: Objects = [("good".to_string(), good.clone()), ("bad".to_string(), bad.clone())].into();
        let errors = a.apply(&Objects::new(), &both, Scope::Changed).await;
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].id, "bad");
        assert!(
            errors[0].message.starts_with("refused by the agent"),
            "{}",
            errors[0].message
        );
        assert_eq!(a.inner.upserts, ["good"]);
        // Deleting the refused object (held since) touches nothing; the
        // inner applier never sees it as held either.
        a.apply(&both, &Objects::new(), Scope::Changed).await;
        assert_eq!(a.inner.deletes, ["good"]);
        assert_eq!(a.inner.held, ["good"]);
    }
}
