//! The agent's door: one controller object turned into one typed
//! [`Object`], every field parsed and bounded, or refused with a message
//! naming what is wrong. What the agent's guard checks is what the
//! planner, the DNS responder, the probes and the relays then read: no one
//! downstream reads the controller's message again.
//!
//! Decoding checks what holds on any host: names are weft's (links
//! `weft…`, namespaces `weft-…`), addresses and CIDRs parse and agree in
//! family, ports and counts are in range. What depends on the host it
//! lands on (its networks, its underlay, its controllers) is the guard's.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use weft_proto::v1 as pb;
use weft_proto::v1::desired_object::Kind;
use weft_types::name;

use crate::model::*;
use crate::relay::Spec;

mod filter;
mod services;
use filter::{policy_rules, transit_prefixes};
use services::{dns_record, relay_session};

type R<T> = Result<T, String>;

/// One desired object, decoded.
#[derive(Clone, Debug, PartialEq)]
pub enum Object {
    /// A peering's namespace (never "": the host's is not made).
    Namespace(Ns),
    Link(LinkObject),
    Address(Address),
    Route(RouteObject),
    Rule(Rule),
    /// Prefix NAT in a peering's namespace.
    NatMap {
        ns: Ns,
        rule: NatRule,
    },
    HostSnat(HostSnat),
    WireguardPeer {
        ns: Ns,
        link: String,
        peer: WgPeer,
        /// Where UDP to the endpoint is blocked, the TLS port at the
        /// endpoint's address that carries the tunnel instead (a relay
        /// site's gateway); the agent decides which is used.
        tls_port: Option<u16>,
    },
    /// An exported host, in a peering's namespace.
    ExportMap {
        ns: Ns,
        export: Export,
    },
    /// What a peering's namespace forwards from its tunnel.
    TunnelFilter {
        ns: Ns,
        filter: TunnelFilter,
    },
    /// A name the node agent's DNS responder serves.
    DnsRecord(DnsRecord),
    /// A tunnel this gateway relays between two sites.
    RelaySession(RelaySession),
    /// The gateway holds its `--lan-address` (it is the active one).
    LanAddress,
    /// A relay site's gateway carries tunnels over TLS on this TCP port;
    /// its own tunnels are named by their UDP port plus `shift`.
    RelayTls {
        port: u16,
        shift: i32,
    },
}

/// A link as the controller renders it.
#[derive(Clone, Debug, PartialEq)]
pub struct LinkObject {
    pub ns: Ns,
    pub name: String,
    /// 0: sized from the underlay (576 to 9000 otherwise).
    pub mtu: u32,
    pub kind: LinkSpec,
}

#[derive(Clone, Debug, PartialEq)]
pub enum LinkSpec {
    Vxlan {
        vni: u32,
        local: IpAddr,
        remote: IpAddr,
        port: u16,
    },
    Geneve {
        vni: u32,
        remote: IpAddr,
        port: u16,
    },
    Bridge,
    /// Outer end in the host's namespace; `peer` in `peer_ns`.
    Veth {
        peer: String,
        peer_ns: Ns,
    },
    Wireguard(WireguardLink),
}

/// A peering's WireGuard link, with what its health probe and endpoint
/// discovery need.
#[derive(Clone, Debug, PartialEq)]
pub struct WireguardLink {
    pub listen_port: u16,
    /// The health probe's pair: this end's tunnel address (with its
    /// prefix) and the far end's. Every tunnel has one: its health is
    /// what the gateway reports of it.
    pub probe: (IpNet, Ipv4Addr),
    /// The peer site the tunnel leads to ("" when not said).
    pub peer_site: String,
    /// The peer's reflectors (host:port, at most [`MAX_REFLECTORS`]);
    /// names are resolved by discovery, each round.
    pub reflectors: Vec<String>,
}

/// A route, and the peer site whose view it leads to (routes in the host's
/// namespace toward a peer say so).
#[derive(Clone, Debug, PartialEq)]
pub struct RouteObject {
    pub route: Route,
    pub peer_site: Option<String>,
}

/// `name.site` → addresses: an IPv4 one, an IPv6 one, or both.
#[derive(Clone, Debug, PartialEq)]
pub struct DnsRecord {
    pub name: String,
    pub site: String,
    pub v4: Option<Ipv4Addr>,
    pub v6: Option<Ipv6Addr>,
}

/// A relayed tunnel: the relay's spec, and the two sites (for logs and
/// metrics).
#[derive(Clone, Debug, PartialEq)]
pub struct RelaySession {
    pub spec: Spec,
    pub sites: (String, String),
}

/// Most reflectors a WireGuard link lists.
pub const MAX_REFLECTORS: usize = 8;
/// Most sites a tunnel filter forwards onward to (transit).
pub const MAX_TRANSIT_SITES: usize = 64;
/// Most prefixes per such site (both families together: a controller
/// that renders more leaves IPv6 ones out, since agents before IPv6
/// transit refuse a longer list, and with it the whole tunnel filter).
pub const MAX_TRANSIT_PREFIXES: usize = 33;
/// Most rules a tunnel filter's policy may hold (each is an nft rule).
pub const MAX_POLICY_RULES: usize = 256;

/// Decodes one object from the controller (or the agent's state file).
pub fn decode(o: &pb::DesiredObject) -> R<Object> {
    let kind = o.kind.as_ref().ok_or("the object has no kind")?;
    Ok(match kind {
        Kind::Namespace(n) => {
            if n.name.is_empty() {
                return Err("a namespace without a name".into());
            }
            name::namespace("namespace", &n.name)?;
            Object::Namespace(n.name.clone())
        }
        Kind::Link(l) => Object::Link(link(l)?),
        Kind::Address(a) => {
            name::link("address on link", &a.link)?;
            name::namespace("namespace", &a.namespace)?;
            Object::Address(Address {
                ns: a.namespace.clone(),
                link: a.link.clone(),
                cidr: addr_net(&a.cidr, "address")?,
                no_prefix_route: a.no_prefix_route,
            })
        }
        Kind::Route(r) => Object::Route(route(r)?),
        Kind::Rule(r) => Object::Rule(rule(r)?),
        Kind::NatMap(m) => {
            if m.namespace.is_empty() {
                return Err("prefix NAT in the host's namespace; weft maps only in its peering namespaces".into());
            }
            name::namespace("namespace", &m.namespace)?;
            name::link("tunnel", &m.tunnel)?;
            let rule = NatRule {
                local: net(&m.local_cidr, "local CIDR")?,
                real: net(&m.real_cidr, "real CIDR")?,
                tunnel: m.tunnel.clone(),
            };
            if rule.local.prefix_len() != rule.real.prefix_len()
                || Family::of(rule.local.addr()) != Family::of(rule.real.addr())
            {
                return Err(format!(
                    "a NAT map between {} and {}: the two CIDRs must be of one family and length",
                    rule.local, rule.real
                ));
            }
            Object::NatMap {
                ns: m.namespace.clone(),
                rule,
            }
        }
        Kind::HostSnat(h) => {
            name::link("SNAT on link", &h.link)?;
            let snat = HostSnat {
                link: h.link.clone(),
                address: ip(&h.address, "SNAT address")?,
                except: h.except.iter().map(|c| net(c, "SNAT exception")).collect::<R<_>>()?,
            };
            for c in &snat.except {
                same_family(snat.address, c.addr(), "SNAT exception")?;
            }
            Object::HostSnat(snat)
        }
        Kind::WireguardPeer(p) => wireguard_peer(p)?,
        Kind::ExportMap(x) => {
            if x.namespace.is_empty() {
                return Err(
                    "an export in the host's namespace; weft maps exports only in its peering namespaces".into(),
                );
            }
            name::namespace("namespace", &x.namespace)?;
            name::link("tunnel", &x.tunnel)?;
            let export = Export {
                external: v4(&x.external_address, "export's external address")?,
                host: v4(&x.host_address, "exported host")?,
                tunnel: x.tunnel.clone(),
            };
            let h = export.host;
            if h.is_unspecified() || h.is_loopback() || h.is_multicast() || h.is_broadcast() || h.is_link_local() {
                return Err(format!("exported host {h} is not a unicast address on the site's LAN"));
            }
            Object::ExportMap {
                ns: x.namespace.clone(),
                export,
            }
        }
        Kind::TunnelFilter(f) => {
            if f.namespace.is_empty() {
                return Err(
                    "a tunnel filter in the host's namespace; weft filters only in its peering namespaces".into(),
                );
            }
            name::namespace("namespace", &f.namespace)?;
            name::link("tunnel", &f.tunnel)?;
            Object::TunnelFilter {
                ns: f.namespace.clone(),
                filter: TunnelFilter {
                    tunnel: f.tunnel.clone(),
                    allowed: f
                        .allowed
                        .iter()
                        .map(|c| net(c, "allowed destination"))
                        .collect::<R<_>>()?,
                    policy: policy_rules(f)?,
                    transit: transit_prefixes(f)?,
                },
            }
        }
        Kind::DnsRecord(r) => Object::DnsRecord(dns_record(r)?),
        Kind::RelaySession(r) => Object::RelaySession(relay_session(r)?),
        Kind::LanAddress(_) => Object::LanAddress,
        Kind::RelayTls(t) => Object::RelayTls {
            port: tcp_port("TLS relay port", t.port)?,
            shift: match t.own_port_shift {
                s @ -65535..=65535 => s,
                s => return Err(format!("TLS relay port shift {s} is out of range (-65535 to 65535)")),
            },
        },
    })
}

fn link(l: &pb::Link) -> R<LinkObject> {
    name::link("link", &l.name)?;
    name::namespace("namespace", &l.namespace)?;
    if l.mtu != 0 && !(576..=9000).contains(&l.mtu) {
        return Err(format!("MTU {} is out of range (576 to 9000)", l.mtu));
    }
    let kind = match l.kind.as_ref().ok_or_else(|| format!("link {} has no kind", l.name))? {
        pb::link::Kind::Vxlan(v) => {
            let (local, remote) = (ip(&v.local, "VXLAN local")?, ip(&v.remote, "VXLAN remote")?);
            same_family(local, remote, "VXLAN remote")?;
            LinkSpec::Vxlan {
                vni: v.vni,
                local,
                remote,
                port: port(v.port, "VXLAN port")?,
            }
        }
        pb::link::Kind::Geneve(g) => LinkSpec::Geneve {
            vni: g.vni,
            remote: ip(&g.remote, "Geneve remote")?,
            port: port(g.port, "Geneve port")?,
        },
        pb::link::Kind::Bridge(_) => LinkSpec::Bridge,
        pb::link::Kind::Veth(v) => {
            if !l.namespace.is_empty() {
                return Err("a veth pair's outer end lives in the agent's namespace".into());
            }
            name::link("veth peer", &v.peer_name)?;
            name::namespace("veth peer namespace", &v.peer_namespace)?;
            LinkSpec::Veth {
                peer: v.peer_name.clone(),
                peer_ns: v.peer_namespace.clone(),
            }
        }
        pb::link::Kind::Wireguard(w) => {
            if l.namespace.is_empty() {
                return Err("a WireGuard link needs its peering namespace".into());
            }
            if !(1..=65535).contains(&w.listen_port) {
                return Err(format!("listen port {} is not 1 to 65535", w.listen_port));
            }
            let probe = (
                addr_net(&w.address, "tunnel address")?,
                v4(&w.peer_address, "tunnel peer address")?,
            );
            if !w.peer_site.is_empty() {
                name::id("tunnel's peer site", &w.peer_site)?;
            }
            if w.reflectors.len() > MAX_REFLECTORS {
                return Err(format!(
                    "a tunnel with {} reflectors; at most {MAX_REFLECTORS}",
                    w.reflectors.len()
                ));
            }
            for r in &w.reflectors {
                let ok = !r.is_empty()
                    && r.len() <= 255
                    && r.bytes().all(|b| b.is_ascii_alphanumeric() || b".-:[]_".contains(&b));
                if !ok {
                    return Err(format!("reflector {} is not a host:port", weft_types::shown(r)));
                }
            }
            LinkSpec::Wireguard(WireguardLink {
                listen_port: w.listen_port as u16,
                probe,
                peer_site: w.peer_site.clone(),
                reflectors: w.reflectors.clone(),
            })
        }
    };
    Ok(LinkObject {
        ns: l.namespace.clone(),
        name: l.name.clone(),
        mtu: l.mtu,
        kind,
    })
}

fn route(r: &pb::Route) -> R<RouteObject> {
    name::namespace("namespace", &r.namespace)?;
    let dst = net(&r.destination, "route destination")?;
    let gateway = (!r.gateway.is_empty())
        .then(|| ip(&r.gateway, "route gateway"))
        .transpose()?;
    if let Some(g) = gateway {
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
    if !r.device.is_empty() {
        name::link("route device", &r.device)?;
    }
    if gateway.is_none() && r.device.is_empty() {
        return Err(format!("a route for {dst} needs a gateway or a device"));
    }
    let peer_site = match r.peer_site.as_str() {
        "" => None,
        s => {
            name::id("route's peer site", s)?;
            if !r.namespace.is_empty() {
                return Err(format!(
                    "a route to peer {s}'s view inside namespace {}; views are routed in the host's namespace",
                    r.namespace
                ));
            }
            Some(s.to_string())
        }
    };
    Ok(RouteObject {
        route: Route {
            ns: r.namespace.clone(),
            table: if r.table == 0 { 254 } else { r.table },
            dst,
            gateway,
            dev: opt(&r.device),
        },
        peer_site,
    })
}

fn rule(r: &pb::Rule) -> R<Rule> {
    name::namespace("namespace", &r.namespace)?;
    if !r.iif.is_empty() {
        name::link("rule input interface", &r.iif)?;
    }
    let (from, to) = (opt_net(&r.from, "rule source")?, opt_net(&r.to, "rule destination")?);
    let family = if r.ipv6 { Family::V6 } else { Family::V4 };
    if let Some(n) = from.iter().chain(to.iter()).find(|n| Family::of(n.addr()) != family) {
        return Err(format!("a rule for {family} names {n}"));
    }
    Ok(Rule {
        ns: r.namespace.clone(),
        family,
        priority: r.priority,
        table: r.table,
        from,
        to,
        iif: opt(&r.iif),
    })
}

fn wireguard_peer(p: &pb::WireguardPeer) -> R<Object> {
    name::link("WireGuard link", &p.link)?;
    name::namespace("namespace", &p.namespace)?;
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
        keepalive: u16::try_from(p.persistent_keepalive)
            .map_err(|_| format!("keepalive {} is over 65535 s", p.persistent_keepalive))?,
        punch: p.punch && !p.endpoint.is_empty(),
        direct: match p.direct.as_str() {
            "" => None,
            _ if p.endpoint.is_empty() => return Err("a direct address beside no endpoint".into()),
            d => {
                let a = weft_types::net::endpoint(d).map_err(|m| format!("direct address {m}"))?;
                let ip = a.ip().to_canonical();
                let link_local = match ip {
                    IpAddr::V4(v4) => v4.is_link_local() || v4.is_broadcast(),
                    IpAddr::V6(v6) => v6.is_unicast_link_local(),
                };
                if ip.is_unspecified() || ip.is_multicast() || ip.is_loopback() || link_local || a.port() == 0 {
                    return Err(format!("direct address {a} is not a unicast address and port"));
                }
                Some(std::net::SocketAddr::new(ip, a.port()))
            }
        },
    };
    let tls_port = match p.tls_port {
        0 => None,
        _ if peer.endpoint.is_none() => return Err("a TLS port without an endpoint to carry the tunnel to".into()),
        n => Some(tcp_port("TLS port", n)?),
    };
    Ok(Object::WireguardPeer {
        ns: p.namespace.clone(),
        link: p.link.clone(),
        peer,
        tls_port,
    })
}

/// A TCP port a gateway listens on or dials: 1 to 65535.
fn tcp_port(what: &str, n: u32) -> R<u16> {
    u16::try_from(n)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("{what} {n} is not a TCP port (1 to 65535)"))
}

// weft-types' parsers, the ones the controller uses too; their messages
// start with the text, so the field goes first.

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
            "{what} {b} is {}, the other side {a} {}",
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

#[cfg(test)]
mod tests;
