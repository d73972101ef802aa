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
//!   is line-based): the agent's door decodes every object before the
//!   guard sees it ([`weft_dataplane::desired::decode`]: names, families,
//!   ranges, counts), and an object that does not decode is refused here
//!   like one that reaches too far.
//!
//! A refused object is reported as an object error and never applied; the
//! rest still applies. Deleting an object that was refused touches nothing
//! outside weft's own: a route refused because the host's networks changed
//! under it is withdrawn from weft's table, since weft no longer wants it.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use weft_dataplane::desired::{LinkObject, LinkSpec, Object};
use weft_dataplane::model::{Address, Export, Route, Rule};

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
pub fn links<'a>(objects: impl IntoIterator<Item = &'a Object>) -> Links {
    let mut out = Links::new();
    for o in objects {
        let Object::Link(l) = o else { continue };
        let role = match &l.kind {
            LinkSpec::Veth { peer, peer_ns } => {
                out.insert((peer_ns.clone(), peer.clone()), LinkRole::PointToPoint);
                LinkRole::PointToPoint
            }
            LinkSpec::Wireguard(_) => LinkRole::PointToPoint,
            LinkSpec::Vxlan { .. } | LinkSpec::Geneve { .. } | LinkSpec::Bridge => LinkRole::Network,
        };
        out.insert((l.ns.clone(), l.name.clone()), role);
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

use weft_types::net;

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

    /// Ok when `o` stays within what weft owns on this host, given the
    /// links the desired state makes; else why not. (What holds on any
    /// host, decoding checked.)
    pub fn check(&self, o: &Object, links: &Links) -> R {
        match o {
            Object::Link(l) => self.link(l),
            Object::Address(a) => self.address(a, links),
            Object::Route(r) => self.route(&r.route),
            Object::Rule(r) => self.rule(r),
            Object::ExportMap { export, .. } => self.export(export),
            // Weft's own namespaces, links and tables, bounded by decoding;
            // DNS records, relays and the LAN address touch no route.
            Object::Namespace(_)
            | Object::NatMap { .. }
            | Object::HostSnat(_)
            | Object::WireguardPeer { .. }
            | Object::TunnelFilter { .. }
            | Object::DnsRecord(_)
            | Object::RelaySession(_)
            | Object::LanAddress
            | Object::RelayTls { .. } => Ok(()),
        }
    }

    fn route(&self, r: &Route) -> R {
        if !r.ns.is_empty() {
            return Ok(()); // weft's own namespace
        }
        if r.table != weft_proto::HOST_TABLE {
            return Err(format!(
                "a route in table {} of the host's namespace; weft routes only in its table {}",
                r.table,
                weft_proto::HOST_TABLE
            ));
        }
        self.host_namespace("a route for", r.dst)?;
        self.takes_over(r.dst)
            .map_err(|why| format!("a route for {} {why}", r.dst))
    }

    /// An exported host is on the site's LAN, never this host itself.
    fn export(&self, x: &Export) -> R {
        let host = x.host;
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

    /// A WireGuard link's probe address is a link-local /30.
    fn link(&self, l: &LinkObject) -> R {
        match &l.kind {
            LinkSpec::Wireguard(w) => point_to_point("tunnel address", w.probe.0),
            _ => Ok(()),
        }
    }

    fn address(&self, a: &Address, links: &Links) -> R {
        let net = a.cidr;
        let role = links.get(&(a.ns.clone(), a.link.clone()));
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
            Some(LinkRole::Network) if a.ns.is_empty() && net.prefix_len() < widest(net) => {
                return Err(format!(
                    "address {net} routes {} in the host's namespace; weft's links take /{} or narrower, or a single address",
                    net.trunc(),
                    widest(net)
                ));
            }
            Some(LinkRole::Network) => {}
        }
        // Weft's own namespaces are weft's whole.
        if !a.ns.is_empty() {
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

    fn rule(&self, r: &Rule) -> R {
        let to = r.to;
        if !r.ns.is_empty() {
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
mod tests;
