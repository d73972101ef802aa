//! Desired state per agent: pure functions of the site model.
//!
//! The objects are the `weft.v1` desired-state messages themselves (they are
//! the contract with the agents), keyed by stable ids grouped by the record
//! they come from: `self/…` (the agent's own record and the site),
//! `node/<name>/…` (a node, on a gateway), `peer/<site>/…` (a peering). A
//! change to one record therefore re-renders only the ids under its prefix.
//!
//! Rendered: the overlay between nodes and the active gateway (VXLAN or
//! Geneve, addresses, routes to node subnets and to peers' local views, the
//! policy rules that select weft's table, source NAT of host traffic), and
//! on gateways each peering's namespace, veth pair, WireGuard link and
//! peers, routes and prefix NAT maps.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use imbl::OrdMap;
use sha2::Digest;
use weft_proto::v1 as pb;
use weft_proto::v1::desired_object::Kind;

use crate::domain::{Gateway, Node, Peering, RemoteSite, Site};

mod ids;
pub mod ipv6;
mod node;
mod peering;

pub use node::{node, node_own, node_shared};

pub use ids::veth_block_free;
use peering::{peering, relay_sessions};

/// weft's routing table and the priority of its policy rules.
pub const TABLE: u32 = weft_proto::HOST_TABLE;
pub const RULE_PRIORITY: u32 = weft_proto::HOST_RULE_PRIORITY;
pub const VXLAN_PORT: u32 = 4789;
pub const GENEVE_PORT: u32 = 6081;
/// Inside a peering namespace: the table of routes into the tunnel.
pub const NS_TUNNEL_TABLE: u32 = 1;
/// The node's end of the overlay.
pub const NODE_LINK: &str = "weft-vx0";

/// The site as the renderer sees it, at one store revision. Persistent maps
/// make a new version per change cheap.
#[derive(Clone, Debug, Default)]
pub struct Model {
    pub revision: i64,
    pub site: Option<Arc<Site>>,
    pub nodes: OrdMap<String, Arc<Node>>,
    pub gateways: OrdMap<String, Arc<Gateway>>,
    pub peerings: OrdMap<String, Arc<Peering>>,
    /// The gateway chosen active (recorded by the leading replica); None
    /// until one was chosen.
    pub active_gateway: Option<String>,
    /// Gateways whose liveness record exists (their agent is connected).
    pub live_gateways: std::collections::BTreeSet<String>,
    /// The names this site publishes (exported hosts are mapped on
    /// gateways).
    pub names: OrdMap<String, Arc<crate::names::NameRecord>>,
    /// Who holds each name derived from a record's name by hashing (a
    /// gateway's link to a node; a peering's links and namespace), oldest
    /// record first. Only the first holder is rendered: a later record
    /// whose name hashes alike would take the first one's link and its
    /// traffic. Enrollment and Join refuse such a newcomer; this catches
    /// one that got past them (two replicas racing, a restored backup).
    /// Kept by `index_node` and `index_peering`.
    pub holders: OrdMap<String, Vec<Holder>>,
}

/// A record holding a derived name: its creation time, then its key.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Holder {
    pub created_at_ms: u64,
    /// `node/NAME` or `peer/SITE`.
    pub record: String,
}

/// A derived name that more than one record holds: `holders[0]` is
/// rendered, the others are not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Collision {
    pub name: String,
    pub holders: Vec<Holder>,
}

impl Model {
    /// The derived names node `name` holds.
    fn node_names(name: &str) -> Vec<String> {
        vec![gateway_link_name(name)]
    }

    /// The derived names the peering with `site_id` holds.
    fn peering_names(&self, site_id: &str) -> Vec<String> {
        let mut out = vec![format!("weft-w{}", peer_link_tag(site_id))];
        if let Some(site) = &self.site {
            out.push(peering_namespace(&site.id, site_id));
        }
        out
    }

    fn hold(&mut self, names: Vec<String>, record: String, created_at_ms: Option<u64>) {
        for name in names {
            let mut list = self.holders.get(&name).cloned().unwrap_or_default();
            list.retain(|h| h.record != record);
            if let Some(created_at_ms) = created_at_ms {
                list.push(Holder {
                    created_at_ms,
                    record: record.clone(),
                });
                list.sort();
            }
            if list.is_empty() {
                self.holders.remove(&name);
            } else {
                self.holders.insert(name, list);
            }
        }
    }

    /// Brings `holders` up to date with node `name`'s record (present or
    /// gone). Returns the other nodes sharing its link: whether they are
    /// rendered may have changed.
    pub fn index_node(&mut self, name: &str) -> Vec<String> {
        let created = self.nodes.get(name).map(|n| n.created_at_ms);
        self.hold(Self::node_names(name), format!("node/{name}"), created);
        self.sharing(&Self::node_names(name), &format!("node/{name}"), "node/")
    }

    /// Brings `holders` up to date with the peering with `site_id`.
    /// Returns the other peerings sharing a name with it.
    pub fn index_peering(&mut self, site_id: &str) -> Vec<String> {
        let created = self.peerings.get(site_id).map(|p| p.created_at_ms);
        let names = self.peering_names(site_id);
        self.hold(names.clone(), format!("peer/{site_id}"), created);
        self.sharing(&names, &format!("peer/{site_id}"), "peer/")
    }

    fn sharing(&self, names: &[String], record: &str, prefix: &str) -> Vec<String> {
        let mut out: Vec<String> = names
            .iter()
            .filter_map(|n| self.holders.get(n))
            .flatten()
            .filter(|h| h.record != record)
            .filter_map(|h| h.record.strip_prefix(prefix).map(str::to_string))
            .collect();
        out.sort();
        out.dedup();
        out
    }

    fn first_holder(&self, names: &[String], record: &str) -> bool {
        names.iter().all(|n| {
            self.holders
                .get(n)
                .and_then(|l| l.first())
                .is_none_or(|h| h.record == record)
        })
    }

    /// Whether node `name` is rendered: it holds its gateway link first.
    pub fn renders_node(&self, name: &str) -> bool {
        self.first_holder(&Self::node_names(name), &format!("node/{name}"))
    }

    /// Whether the peering with `site_id` is rendered: it holds its links
    /// and namespace first.
    pub fn renders_peering(&self, site_id: &str) -> bool {
        self.first_holder(&self.peering_names(site_id), &format!("peer/{site_id}"))
    }

    /// Every derived name held by more than one record.
    pub fn collisions(&self) -> Vec<Collision> {
        self.holders
            .iter()
            .filter(|(_, l)| l.len() > 1)
            .map(|(name, l)| Collision {
                name: name.clone(),
                holders: l.clone(),
            })
            .collect()
    }
}

pub type Objects = BTreeMap<String, pb::DesiredObject>;

/// A part of a gateway's state that one record determines.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Part {
    Node(String),
    Peer(String),
}

impl Part {
    pub fn prefix(&self) -> String {
        match self {
            Part::Node(n) => format!("node/{n}/"),
            Part::Peer(p) => format!("peer/{p}/"),
        }
    }
}

fn short_hash(s: &str, hex_len: usize) -> String {
    let mut h = hex::encode(sha2::Sha256::digest(s.as_bytes()));
    h.truncate(hex_len);
    h
}

/// The VXLAN id of a node's tunnel: the low 24 bits of its overlay address
/// (unique within the internal CIDR, never 0 for a host address of a /8 or
/// smaller block).
pub fn vni(internal_ip: Ipv4Addr) -> u32 {
    u32::from(internal_ip) & 0x00ff_ffff
}

/// A node's "unknown source" address: its overlay address's host part in
/// the external CIDR (unique per node, stable). None if it does not fit.
pub fn external_address(site: &Site, internal_ip: Ipv4Addr) -> Option<Ipv4Addr> {
    let host = u32::from(internal_ip).checked_sub(u32::from(site.internal_cidr.network()))?;
    (u128::from(host) < crate::ipam::size(&site.external_cidr))
        .then(|| Ipv4Addr::from(u32::from(site.external_cidr.network()) + host))
}

/// The gateway's interface toward node `name` (15 bytes at most). Two
/// nodes whose names give one link name would share it: the second is
/// refused when it is created.
pub fn gateway_link_name(node: &str) -> String {
    format!("weft-n{}", short_hash(node, 9))
}

/// The tag in the names of a peering's links on a gateway (its WireGuard
/// link `weft-w…` and veth ends `weft-v…`, `weft-i…`): two peers whose
/// tags are equal would share links, so the second is refused.
pub fn peer_link_tag(site_id: &str) -> String {
    short_hash(site_id, 9)
}

/// The two ends of every tunnel, for its health probe: a fixed pair from
/// the last /30 of 169.254.0.0/16 (the veths take the blocks before it);
/// the server end takes the first. Returns (this end, the far end).
pub fn tunnel_addresses(role: crate::domain::TunnelRole) -> (Ipv4Addr, Ipv4Addr) {
    let (server, client) = (Ipv4Addr::new(169, 254, 255, 253), Ipv4Addr::new(169, 254, 255, 254));
    match role {
        crate::domain::TunnelRole::Server => (server, client),
        crate::domain::TunnelRole::Client => (client, server),
    }
}

/// The namespace of site `local`'s peering with site `peer`. Namespaces
/// share one /run/netns per host, so the name depends on both sites: two
/// gateways of different sites on one host (a lab, a shared hub host) do
/// not collide. 12 hex digits: 48 bits, no collision in practice among a
/// host's few peerings.
pub fn peering_namespace(local: &str, peer: &str) -> String {
    format!("weft-p-{}", short_hash(&format!("{local}/{peer}"), 12))
}

/// The rule in the host's namespace that sends traffic to `to` (of either
/// family) into weft's table.
fn host_rule(to: impl Into<ipnet::IpNet>) -> Kind {
    let to: ipnet::IpNet = to.into();
    Kind::Rule(pb::Rule {
        namespace: String::new(),
        priority: RULE_PRIORITY,
        from: String::new(),
        to: to.to_string(),
        table: TABLE,
        iif: String::new(),
        ipv6: matches!(to, ipnet::IpNet::V6(_)),
    })
}

/// The ids of a peering's views, in order: the first of each kind by its
/// kind alone ("workload"), the later ones numbered ("workload-1"), so a
/// peer with several workload CIDRs gets each routed.
fn view_ids<N>(views: &[crate::ipam::View<N>]) -> Vec<String> {
    let mut seen: std::collections::HashMap<crate::ipam::CidrKind, usize> = Default::default();
    views
        .iter()
        .map(|v| {
            let n = seen.entry(v.kind).or_default();
            *n += 1;
            match *n {
                1 => v.kind.to_string(),
                k => format!("{}-{}", v.kind, k - 1),
            }
        })
        .collect()
}

/// 1:1 prefix NAT in a peering's namespace between a peer's `real` CIDR
/// and this site's `local` view of it.
fn nat_map(ns: &str, real: impl ToString, local: impl ToString, tunnel: &str) -> Kind {
    Kind::NatMap(pb::NatMap {
        namespace: ns.into(),
        real_cidr: real.to_string(),
        local_cidr: local.to_string(),
        tunnel: tunnel.into(),
    })
}

fn obj(id: String, kind: Kind) -> (String, pb::DesiredObject) {
    (id.clone(), pb::DesiredObject { id, kind: Some(kind) })
}

/// One end of a node's overlay tunnel: Geneve when both ends' kernels have
/// it (as their agents reported), else VXLAN. Both ends decide alike, as
/// both are rendered from the same two records.
fn overlay(m: &Model, name: String, vni: u32, local: IpAddr, remote: IpAddr, geneve: bool) -> Kind {
    let kind = if geneve {
        pb::link::Kind::Geneve(pb::Geneve {
            vni,
            remote: remote.to_string(),
            port: GENEVE_PORT,
        })
    } else {
        pb::link::Kind::Vxlan(pb::Vxlan {
            vni,
            local: local.to_string(),
            remote: remote.to_string(),
            port: VXLAN_PORT,
        })
    };
    Kind::Link(pb::Link {
        name,
        namespace: String::new(),
        // 0: the agent derives it from its underlay interface.
        mtu: m.site.as_ref().and_then(|s| s.overlay_mtu).unwrap_or(0),
        kind: Some(kind),
    })
}

/// Whether a gateway can carry the site's traffic: it has an overlay and an
/// underlay address.
fn usable(g: &Gateway) -> bool {
    g.internal_ip.is_some() && g.underlay_ip.is_some()
}

/// The gateway nodes tunnel to and peers see: the one chosen active, or,
/// before any was chosen, the first usable one by name.
pub fn active_gateway(m: &Model) -> Option<&Arc<Gateway>> {
    m.active_gateway
        .as_ref()
        .and_then(|n| m.gateways.get(n))
        .filter(|g| usable(g))
        .or_else(|| m.gateways.values().find(|g| usable(g)))
}

/// The gateway that should be active now, if that differs from the one
/// recorded: the recorded one stays while it is live (a gateway coming
/// back does not take over); otherwise the first live usable one by name.
/// None: keep the record (also when no gateway is live at all).
pub fn next_active_gateway(m: &Model) -> Option<String> {
    let eligible = |n: &String| m.live_gateways.contains(n) && m.gateways.get(n).is_some_and(|g| usable(g));
    if m.active_gateway.as_ref().is_some_and(eligible) {
        return None;
    }
    m.gateways.keys().find(|n| eligible(n)).cloned()
}

/// The part of gateway `g`'s state that `part` determines.
pub fn gateway_part(m: &Model, g: &Gateway, part: &Part) -> Objects {
    match part {
        Part::Node(name) => node_tunnel(m, g, name, &part.prefix()),
        Part::Peer(site_id) => {
            let mut out = peering(m, g, site_id, &part.prefix());
            // The gateway the grants name (see `active_gateway`).
            if active_gateway(m).is_some_and(|a| a.name == g.name) {
                out.extend(relay_sessions(m, site_id, &part.prefix()));
            }
            out
        }
    }
}

/// A gateway's tunnel to node `name`: the overlay link, the gateway's
/// address on it, and the routes to the node, its host traffic's replies
/// and its subnet.
fn node_tunnel(m: &Model, g: &Gateway, name: &str, base: &str) -> Objects {
    let mut out = Objects::new();
    let Some(n) = m.nodes.get(name).filter(|_| m.renders_node(name)) else {
        return Objects::new();
    };
    let (Some(gw_ip), Some(gw_underlay), Some(ip), Some(underlay)) =
        (g.internal_ip, g.underlay_ip, n.internal_ip, n.underlay_ip)
    else {
        return Objects::new();
    };
    let link = gateway_link_name(name);
    out.extend([
        // The node's overlay address, reached through its tunnel.
        obj(
            format!("{base}overlay"),
            Kind::Route(pb::Route {
                namespace: String::new(),
                table: TABLE,
                destination: format!("{ip}/32"),
                gateway: String::new(),
                device: link.clone(),
                peer_site: String::new(),
            }),
        ),
        // Replies to the node's host traffic (its "unknown source"
        // address) go back through its tunnel.
        obj(
            format!("{base}external"),
            Kind::Route(pb::Route {
                namespace: String::new(),
                table: TABLE,
                destination: m
                    .site
                    .as_ref()
                    .and_then(|site| external_address(site, ip))
                    .map_or_else(|| format!("{ip}/32"), |e| format!("{e}/32")),
                gateway: ip.to_string(),
                device: link.clone(),
                peer_site: String::new(),
            }),
        ),
        obj(
            format!("{base}link"),
            overlay(m, link.clone(), vni(ip), gw_underlay, underlay, n.geneve && g.geneve),
        ),
        obj(
            format!("{base}addr"),
            Kind::Address(pb::Address {
                link: link.clone(),
                namespace: String::new(),
                cidr: format!("{gw_ip}/32"),
                no_prefix_route: false,
            }),
        ),
    ]);
    // Its IPv4 workloads (none on a site without IPv4 pods).
    if let Some(subnet) = n.subnet {
        out.extend([obj(
            format!("{base}route"),
            Kind::Route(pb::Route {
                namespace: String::new(),
                table: TABLE,
                destination: subnet.to_string(),
                gateway: ip.to_string(),
                device: link.clone(),
                peer_site: String::new(),
            }),
        )]);
    }
    out.extend(ipv6::node_tunnel(m, n, gw_ip, ip, &link, base));
    out
}

/// Gateway-wide objects: the rules that send pod traffic to weft's table.
fn gateway_self(m: &Model) -> Objects {
    let mut out = Objects::new();
    if let Some(site) = &m.site {
        for (id, cidr) in [
            ("self/rule/internal", site.internal_cidr),
            ("self/rule/external", site.external_cidr),
        ] {
            out.extend([obj(id.into(), host_rule(cidr))]);
        }
        for (i, pod) in site.pod_cidrs.iter().enumerate() {
            out.extend([obj(format!("self/rule/{i}"), host_rule(*pod))]);
        }
        out.extend(ipv6::gateway_self(site));
    }
    out
}

/// Everything gateway `name` must have.
pub fn gateway(m: &Model, name: &str) -> Objects {
    let Some(g) = m.gateways.get(name) else {
        return Objects::new();
    };
    let mut out = gateway_self(m);
    // The active gateway holds the site's LAN address (its agent's
    // --lan-address), so exported hosts' replies follow it.
    if active_gateway(m).is_some_and(|a| a.name == g.name) {
        out.extend([obj("self/lan-address".into(), Kind::LanAddress(pb::LanAddress {}))]);
        // A relay site's: tunnels over TLS for peers whose UDP is blocked.
        if let Some(site) = m.site.as_ref().filter(|s| s.relay_ports.is_some())
            && let Some(port) = site.relay_tls_port
        {
            let shift = g
                .endpoint
                .map_or(0, |e| i32::from(e.port()) - i32::from(site.wireguard_ports.first));
            out.extend([obj(
                "self/relay-tls".into(),
                Kind::RelayTls(pb::RelayTls {
                    port: u32::from(port),
                    own_port_shift: shift,
                }),
            )]);
        }
    }
    for n in m.nodes.keys() {
        out.extend(gateway_part(m, g, &Part::Node(n.clone())));
    }
    for p in m.peerings.keys() {
        out.extend(gateway_part(m, g, &Part::Peer(p.clone())));
    }
    out
}

/// Replaces the objects under `part`'s prefix in `objects` with a fresh
/// rendering of that part.
pub fn rerender_part(objects: &mut Objects, m: &Model, gateway_name: &str, part: &Part) {
    let prefix = part.prefix();
    let stale: Vec<String> = objects
        .range(prefix.clone()..)
        .take_while(|(k, _)| k.starts_with(&prefix))
        .map(|(k, _)| k.clone())
        .collect();
    for k in stale {
        objects.remove(&k);
    }
    if let Some(g) = m.gateways.get(gateway_name) {
        objects.extend(gateway_part(m, g, part));
    }
}

/// The content hash agents and controller compare: the first 8 bytes of
/// SHA-256 of the encoded object.
pub fn hash(o: &pb::DesiredObject) -> u64 {
    weft_proto::object_hash(o)
}

/// What turns `old` into `new`: (upserts, deletes).
pub fn diff(old: &Objects, new: &Objects) -> (Vec<pb::DesiredObject>, Vec<String>) {
    let upserts = new
        .iter()
        .filter(|(k, v)| old.get(*k) != Some(v))
        .map(|(_, v)| v.clone())
        .collect();
    let deletes = old.keys().filter(|k| !new.contains_key(*k)).cloned().collect();
    (upserts, deletes)
}

#[cfg(test)]
mod tests;
