//! What a host's network holds, in the terms weft plans in: links,
//! addresses, routes, rules, one nftables table and the WireGuard peers per
//! namespace. The same types describe the desired state (translated from the
//! controller's objects) and the observed one (read from the host), so that
//! planning is a comparison of two values.
//!
//! Ownership: what is weft's on a host is decided here, once, for every
//! implementation of the host (Linux and the fake one): see [`owns_link`],
//! [`owns_route`], [`owns_rule`].

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use ipnet::IpNet;
pub use weft_types::WgKey;
pub use weft_types::net::Family;
pub use weft_types::policy::Protocol;

/// A network namespace: "" for the agent's own (the host's), else a name
/// under /run/netns.
pub type Ns = String;

/// The routing table weft owns in the host's namespace.
pub const HOST_TABLE: u32 = weft_proto::HOST_TABLE;
/// The rule priority weft owns in the host's namespace.
pub const HOST_RULE_PRIORITY: u32 = weft_proto::HOST_RULE_PRIORITY;
/// The nftables table (family inet: both IP families) weft owns in each
/// namespace.
pub const NFT_TABLE: &str = "weft";
/// weft's table as "family name", as observed tables are named.
pub const OWN_TABLE: &str = "inet weft";
/// weft's table of earlier versions (IPv4 only), as "family name": removed
/// by the batch that writes its successor.
pub const LEGACY_TABLE: &str = "ip weft";
/// Names of weft's links and namespaces start with this.
pub const PREFIX: &str = "weft";

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LinkKind {
    /// Over the underlay of `local`'s family (`remote` is of it too).
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
    /// A veth pair, seen from its outer end: the other end, `peer`, lives
    /// in namespace `peer_ns`. (Observed veth ends are [`LinkKind::VethEnd`]:
    /// the kernel does not name an end's peer.)
    Veth {
        peer: String,
        peer_ns: Ns,
    },
    /// One end of a veth pair, as observed; or the inner end, as desired.
    VethEnd,
    Wireguard {
        listen_port: u16,
    },
    /// A kind weft does not make (observed only): always replaced.
    Other(String),
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Link {
    pub ns: Ns,
    pub name: String,
    pub kind: LinkKind,
    /// 0: whatever it has (a bridge's MTU is its ports').
    pub mtu: u32,
    pub up: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Address {
    pub ns: Ns,
    pub link: String,
    pub cidr: IpNet,
    /// Added without the kernel's prefix route (IFA_F_NOPREFIXROUTE).
    /// Part of its identity: one added with the other setting is removed
    /// and added again.
    pub no_prefix_route: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Route {
    pub ns: Ns,
    pub table: u32,
    pub dst: IpNet,
    /// Of the destination's family.
    pub gateway: Option<IpAddr>,
    pub dev: Option<String>,
}

impl Route {
    /// What the kernel keys a route by (weft sets no metric or TOS).
    pub fn key(&self) -> (Ns, u32, IpNet) {
        (self.ns.clone(), self.table, self.dst)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rule {
    pub ns: Ns,
    /// The kernel keeps rules per family; `from` and `to`, when set, are
    /// of this one.
    pub family: Family,
    pub priority: u32,
    pub table: u32,
    pub from: Option<IpNet>,
    pub to: Option<IpNet>,
    pub iif: Option<String>,
}

/// One rule of 1:1 prefix NAT in a peering's namespace: toward the tunnel
/// the local view becomes the real CIDR, from the tunnel the reverse.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NatRule {
    /// Both of one family and one length.
    pub local: IpNet,
    pub real: IpNet,
    pub tunnel: String,
}

/// A host of the site exported to a peer: what comes in through `tunnel`
/// for `external` goes to `host`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Export {
    pub external: Ipv4Addr,
    pub host: Ipv4Addr,
    pub tunnel: String,
}

/// Source NAT of host-originated traffic into the overlay, for one
/// family: `except` is of `address`'s.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostSnat {
    pub link: String,
    pub address: IpAddr,
    pub except: Vec<IpNet>,
}

/// The content of weft's nftables table in one namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TableSpec {
    /// Clamp the MSS of forwarded TCP SYNs to the route's MTU (in every
    /// peering's namespace, remapped or not).
    pub mss_clamp: bool,
    /// Prefix NAT.
    pub nat: Vec<NatRule>,
    /// Exported hosts (destination NAT from the tunnel).
    pub exports: Vec<Export>,
    /// At most one per family.
    pub snat: Vec<HostSnat>,
    /// Named counters per peer site over traffic to and from its CIDRs.
    pub accounting: BTreeMap<String, Vec<IpNet>>,
    /// What a peering's namespace forwards from its tunnel.
    pub filter: Option<TunnelFilter>,
}

/// Forward from `tunnel` only to `allowed` (either family: a family with
/// nothing allowed is dropped whole); count and drop the rest. With
/// `policy`, only what one of its rules allows, besides replies to
/// connections this side opened; the rest is counted apart and dropped.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TunnelFilter {
    pub tunnel: String,
    pub allowed: Vec<IpNet>,
    pub policy: Option<Vec<PolicyRule>>,
    /// On a transit site: destinations forwarded onward to another peer,
    /// by the site they lead to; allowed like `allowed` and counted per
    /// site.
    pub transit: Vec<(String, Vec<IpNet>)>,
}

/// One rule of an export policy: destination `cidr` (as the peer
/// addressed it), `protocol` (None: any), destination `ports` (inclusive;
/// tcp and udp only).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PolicyRule {
    /// Either family; `Icmp` is ICMPv6 for an IPv6 one.
    pub cidr: IpNet,
    pub protocol: Option<Protocol>,
    pub ports: Option<(u16, u16)>,
}

impl TableSpec {
    pub fn is_empty(&self) -> bool {
        !self.mss_clamp
            && self.nat.is_empty()
            && self.exports.is_empty()
            && self.snat.is_empty()
            && self.accounting.is_empty()
            && self.filter.is_none()
    }

    /// A content hash: equal specs, equal versions.
    pub fn version(&self) -> u64 {
        use sha2::Digest;
        let d = sha2::Sha256::digest(format!("{self:?}").as_bytes());
        u64::from_be_bytes(d[..8].try_into().expect("32 bytes"))
    }
}

#[derive(Clone, Debug)]
pub struct WgPeer {
    pub public_key: WgKey,
    pub endpoint: Option<SocketAddr>,
    pub allowed_ips: Vec<IpNet>,
    pub keepalive: u16,
    /// The endpoint is to be hole-punched (`pb::WireguardPeer::punch`):
    /// how a new endpoint is first tried, not state a device keeps, so
    /// peers that differ only in it are equal (kernel WireGuard cannot
    /// report it).
    pub punch: bool,
    /// A direct address tried beside `endpoint`, a relay
    /// (`pb::WireguardPeer::direct`).
    pub direct: Option<SocketAddr>,
}

impl WgPeer {
    /// What a device keeps of the peer (all but `punch`).
    fn kept(&self) -> (WgKey, Option<SocketAddr>, &[IpNet], u16, Option<SocketAddr>) {
        (
            self.public_key,
            self.endpoint,
            &self.allowed_ips,
            self.keepalive,
            self.direct,
        )
    }

    /// As kernel WireGuard takes it: the relay only, no direct address
    /// beside it (it cannot try two; a controller renders none for a
    /// gateway that does not say it can).
    pub fn without_beside(&self) -> WgPeer {
        WgPeer {
            direct: None,
            ..self.clone()
        }
    }
}

impl PartialEq for WgPeer {
    fn eq(&self, o: &WgPeer) -> bool {
        self.kept() == o.kept()
    }
}

impl Eq for WgPeer {}

impl PartialOrd for WgPeer {
    fn partial_cmp(&self, o: &WgPeer) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

impl Ord for WgPeer {
    fn cmp(&self, o: &WgPeer) -> std::cmp::Ordering {
        self.kept().cmp(&o.kept())
    }
}

impl std::hash::Hash for WgPeer {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.kept().hash(h);
    }
}

/// A host's network, as weft sees it: everything in it is weft's.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct State {
    /// weft's namespaces (not the host's own "").
    pub namespaces: BTreeSet<Ns>,
    /// Namespaces ("" included) with forwarding on, per family.
    pub forwarding: BTreeSet<(Ns, Family)>,
    pub links: BTreeMap<(Ns, String), Link>,
    pub addresses: BTreeSet<Address>,
    pub routes: BTreeMap<(Ns, u32, IpNet), Route>,
    pub rules: BTreeSet<Rule>,
    /// weft's table per namespace, by version; observed as None when it is
    /// there but not known to be what weft wrote.
    pub tables: BTreeMap<Ns, Option<u64>>,
    /// Other tables of weft's name (e.g. `weft_acct` of earlier versions),
    /// by namespace: always removed.
    pub stray_tables: BTreeSet<(Ns, String)>,
    /// WireGuard peers by (namespace, link), by public key.
    pub peers: BTreeMap<(Ns, String), BTreeMap<WgKey, WgPeer>>,
}

impl State {
    /// Takes `from`'s objects in namespaces `scopes` in place of this
    /// state's own there (the other namespaces keep what they hold).
    pub fn replace_within(&mut self, from: &State, scopes: &BTreeSet<Ns>) {
        let inside = |ns: &Ns| scopes.contains(ns);
        set_within(&mut self.namespaces, &from.namespaces, |n| inside(n));
        set_within(&mut self.forwarding, &from.forwarding, |(n, _)| inside(n));
        set_within(&mut self.addresses, &from.addresses, |a| inside(&a.ns));
        set_within(&mut self.rules, &from.rules, |r| inside(&r.ns));
        set_within(&mut self.stray_tables, &from.stray_tables, |(n, _)| inside(n));
        map_within(&mut self.links, &from.links, |(n, _)| inside(n));
        map_within(&mut self.routes, &from.routes, |(n, _, _)| inside(n));
        map_within(&mut self.tables, &from.tables, |n| inside(n));
        map_within(&mut self.peers, &from.peers, |(n, _)| inside(n));
    }
}

/// `mine`'s items that `inside` picks, replaced by `from`'s.
fn set_within<T: Ord + Clone>(mine: &mut BTreeSet<T>, from: &BTreeSet<T>, inside: impl Fn(&T) -> bool) {
    mine.retain(|x| !inside(x));
    mine.extend(from.iter().filter(|x| inside(x)).cloned());
}

/// `mine`'s entries whose key `inside` picks, replaced by `from`'s.
fn map_within<K: Ord + Clone, V: Clone>(mine: &mut BTreeMap<K, V>, from: &BTreeMap<K, V>, inside: impl Fn(&K) -> bool) {
    mine.retain(|k, _| !inside(k));
    mine.extend(
        from.iter()
            .filter(|(k, _)| inside(k))
            .map(|(k, v)| (k.clone(), v.clone())),
    );
}

/// The desired state with what planning needs beside it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Desired {
    pub state: State,
    /// The table specs behind `state.tables`' versions.
    pub specs: BTreeMap<Ns, TableSpec>,
    /// The controller's object each item came from, for error reports.
    pub origins: Origins,
}

/// Object ids by the item they produced.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Origins {
    pub namespaces: BTreeMap<Ns, String>,
    pub links: BTreeMap<(Ns, String), String>,
    pub addresses: BTreeMap<Address, String>,
    pub routes: BTreeMap<(Ns, u32, IpNet), String>,
    pub rules: BTreeMap<Rule, String>,
    pub tables: BTreeMap<Ns, Vec<String>>,
    pub peers: BTreeMap<(Ns, String, WgKey), String>,
}

/// What a namespace holds, as read from the host: everything, weft's or
/// not. [`owned`] keeps weft's.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RawNs {
    pub links: Vec<Link>,
    pub addresses: Vec<Address>,
    pub routes: Vec<RawRoute>,
    pub rules: Vec<Rule>,
    /// The families forwarded.
    pub forwarding: BTreeSet<Family>,
    /// weft's nftables tables: `inet weft` (with weft's version when the
    /// firewall knows the table is unchanged since weft wrote it), and
    /// tables of family ip of weft's name (`ip weft` of earlier versions
    /// among them), by "family name".
    pub tables: BTreeMap<String, Option<u64>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawRoute {
    pub route: Route,
    /// Added by the kernel for an address (protocol "kernel").
    pub kernel: bool,
    /// Not a unicast route (local, broadcast, ...).
    pub special: bool,
}

/// Whether a link is weft's: by name.
pub fn owns_link(name: &str) -> bool {
    name.starts_with(PREFIX)
}

/// Whether a route is weft's: in the host's namespace, those in weft's
/// table; in weft's own namespaces, every unicast route the kernel did not
/// add itself, in any table but `local`.
pub fn owns_route(r: &RawRoute) -> bool {
    if r.route.ns.is_empty() {
        return r.route.table == HOST_TABLE;
    }
    !r.kernel && !r.special && r.route.table != 255
}

/// Whether a rule is weft's: in the host's namespace, those at weft's
/// priority; in weft's own namespaces, all but the kernel's three defaults.
pub fn owns_rule(r: &Rule) -> bool {
    if r.ns.is_empty() {
        return r.priority == HOST_RULE_PRIORITY;
    }
    let default = r.from.is_none()
        && r.to.is_none()
        && r.iif.is_none()
        && matches!(
            (r.family, r.priority, r.table),
            (_, 0, 255) | (_, 32766, 254) | (Family::V4, 32767, 253)
        );
    !default
}

/// weft's part of what namespace `ns` holds, added to `into`.
pub fn owned(ns: &Ns, raw: RawNs, into: &mut State) {
    for l in raw.links {
        if owns_link(&l.name) {
            into.links.insert((ns.clone(), l.name.clone()), l);
        }
    }
    for a in raw.addresses {
        if owns_link(&a.link) {
            into.addresses.insert(a);
        }
    }
    for r in raw.routes {
        if owns_route(&r) {
            into.routes.insert(r.route.key(), r.route);
        }
    }
    for r in raw.rules {
        if owns_rule(&r) {
            into.rules.insert(r);
        }
    }
    for f in raw.forwarding {
        into.forwarding.insert((ns.clone(), f));
    }
    for (name, version) in raw.tables {
        // Of family inet only weft's own table is weft's (weft never made
        // another: an operator's `inet weft…` table is theirs); of family
        // ip, every `weft…` table (earlier versions' among them).
        if name == OWN_TABLE {
            into.tables.insert(ns.clone(), version);
        } else if let Some(("ip", table)) = name.split_once(' ')
            && table.starts_with(PREFIX)
        {
            into.stray_tables.insert((ns.clone(), name));
        }
    }
}
