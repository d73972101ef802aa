//! The controller's records: what it stores and reasons about. Independent
//! of the wire format (prost types are converted at the gRPC edge) and of
//! the store (records are serialized as JSON values under their keys).
//! By job, besides the records here: `peering` (a peering and the peer's
//! parameters), `policy` (export policies as stored),
//! `names` (names published and learned), `ports` (UDP port ranges), `ipv6`
//! (a site's IPv6 networks) and `text` (checks of the CIDRs and names
//! people and peers type).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{SystemTime, UNIX_EPOCH};

use ipnet::{Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};
pub use weft_types::WgKey;

mod ipv6;
mod names;
mod peering;
mod policy;
mod ports;
mod text;

use ipv6::lenient;
pub use ipv6::{Ipv6Networks, NODE_PREFIX_LEN_V6, PendingV6};
pub use names::{NameKind, NameRecord, RemoteName};
pub use peering::{
    PeerReadiness, PeerToken, Peering, PeeringState, PendingCidrs, RelayGrant, RelayVia, RemoteGateway, RemoteSite,
    TransitRoute, TransitView, TunnelRole,
};
pub use policy::{DefaultExport, ExportPolicy, ExportRule, Protocol};
pub use ports::PortRange;
pub use text::{parse_cidr, shown, validate_name};

/// A site's validated network configuration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Site {
    pub id: String,
    pub pod_cidrs: Vec<Ipv4Net>,
    pub external_cidr: Ipv4Net,
    pub internal_cidr: Ipv4Net,
    pub reserved_cidrs: Vec<Ipv4Net>,
    pub remap_pools: Vec<Ipv4Net>,
    pub node_prefix_len: u8,
    /// MTU of the VXLAN overlay between nodes and gateways; None: each
    /// agent derives it from its underlay interface (its MTU − 50).
    #[serde(default)]
    pub overlay_mtu: Option<u32>,
    /// MTU of the WireGuard tunnels to peers, offered to each peer (the
    /// lower of the two sites' values is used); None: each gateway derives
    /// it from its underlay interface (its MTU − 80).
    #[serde(default)]
    pub tunnel_mtu: Option<u32>,
    /// The UDP ports this site's gateways listen on, one per peering.
    #[serde(default)]
    pub wireguard_ports: PortRange,
    /// This site relays peers' tunnels through its active gateway, on
    /// these UDP ports (two per relayed tunnel); None: it does not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relay_ports: Option<PortRange>,
    /// With `relay_ports`: the TCP port on which its active gateway also
    /// carries tunnels over TLS for peers whose UDP is blocked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relay_tls_port: Option<u16>,
    /// A peer's change of its CIDRs after negotiation is applied at once
    /// when every new CIDR lies within one of these blocks; otherwise it is
    /// held until an admin accepts it. Empty: every change is held.
    #[serde(default)]
    pub peer_cidr_auto_accept: Vec<Ipv4Net>,
    /// Public blocks a peer may announce CIDRs in (each such CIDR is routed
    /// only through a remapped view); outside them only private space.
    #[serde(default)]
    pub peer_public_cidrs: Vec<Ipv4Net>,
    /// Where this site's controllers are reached (the listen address when
    /// it names one, and the advertised ones): a local view must never
    /// cover them, or agents' and peers' control traffic would be routed
    /// into a peering.
    #[serde(default)]
    pub controller_ips: Vec<Ipv4Addr>,
    /// What to do with a peer CIDR that covers one of this site's hosts
    /// (a node's or gateway's underlay address, a controller's address).
    #[serde(default)]
    pub underlay_overlap: UnderlayOverlap,
    /// What peerings without an export policy of their own let the peer
    /// reach: everything (the default) or nothing.
    #[serde(default)]
    pub default_export: DefaultExport,
    /// The site's IPv6 networks; None: IPv4 only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv6: Option<Ipv6Networks>,
}

/// A peer CIDR over this site's own hosts: refused (the default: a peer
/// has no business announcing them), or routed through a remapped view
/// like any other overlap (for sites whose workload CIDRs really overlap
/// another's LAN).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnderlayOverlap {
    #[default]
    Refuse,
    Remap,
}

impl Site {
    /// The endpoint a peer dials for the peering whose tunnel listens on
    /// `listen_port`, at a gateway whose `--endpoint` is `gateway_endpoint`:
    /// the endpoint names where the first port of `wireguard_ports` is
    /// reached, and the k-th port of the range is reached k ports above it
    /// (a port forward of the whole range keeps working). None when the
    /// port would pass 65535.
    pub fn peering_endpoint(&self, gateway_endpoint: SocketAddr, listen_port: u16) -> Option<SocketAddr> {
        let mut ep = gateway_endpoint;
        let offset = listen_port.checked_sub(self.wireguard_ports.first)?;
        ep.set_port(ep.port().checked_add(offset)?);
        Some(ep)
    }

    /// Every block this site addresses itself, which a peer's local view
    /// must avoid.
    /// What the site may offer peers: its workload and external CIDRs
    /// (an export policy names prefixes of these).
    pub fn exportable(&self) -> impl Iterator<Item = Ipv4Net> + '_ {
        self.pod_cidrs.iter().copied().chain(self.offered_external())
    }

    /// The external CIDR as peers are told it: none from an IPv6-only site
    /// (no IPv4 pods), which offers them no IPv4 at all.
    pub fn offered_external(&self) -> Option<Ipv4Net> {
        (!self.pod_cidrs.is_empty()).then_some(self.external_cidr)
    }

    pub fn own_blocks(&self) -> Vec<Ipv4Net> {
        let mut v = self.pod_cidrs.clone();
        v.push(self.external_cidr);
        v.push(self.internal_cidr);
        v.extend(&self.reserved_cidrs);
        v.extend(self.controller_ips.iter().map(|a| Ipv4Net::from(*a)));
        v
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SubnetSource {
    Allocated,
    Declared,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    pub name: String,
    /// Its IPv4 workload subnet; none on a site without IPv4 pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subnet: Option<Ipv4Net>,
    /// Its IPv6 workload subnet (a /64), when the site has IPv6.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subnet_v6: Option<Ipv6Net>,
    pub source: SubnetSource,
    /// Milliseconds since the Unix epoch.
    pub created_at_ms: u64,
    /// Certificates issued to the agent under this name that have not
    /// expired yet (older ones are pruned).
    #[serde(default)]
    pub certs: Vec<CertRecord>,
    /// The node's overlay address, from the internal CIDR.
    #[serde(default)]
    pub internal_ip: Option<Ipv4Addr>,
    /// The host's underlay address, set at enrollment.
    #[serde(default)]
    pub underlay_ip: Option<IpAddr>,
    /// Its kernel can make Geneve links (as its agent last reported).
    #[serde(default)]
    pub geneve: bool,
    /// Set when two holders of this identity showed up (see
    /// [`IdentityConflict`]); cleared by enrolling again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity_conflict: Option<IdentityConflict>,
    /// When it was last enrolled with a token (0: before weft recorded
    /// it): certificates issued before are another generation's.
    #[serde(default)]
    pub enrolled_at_ms: u64,
}

/// A renewal came from a certificate older than the newest one issued
/// under the name, after the newest was in use: two hosts hold the
/// identity (a copied key and certificate). Every certificate of the
/// name was revoked; the admin must find out which host is the real one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentityConflict {
    pub at_ms: u64,
    /// The certificate that asked to renew, and the newest one.
    pub caller_serial: String,
    pub newest_serial: String,
}

impl std::fmt::Display for IdentityConflict {
    /// As the admin reads it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "at {}, a call came from certificate {} while {} was newer and in use: two hosts hold this \
             identity; every certificate of it was revoked",
            humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_millis(self.at_ms)),
            self.caller_serial,
            self.newest_serial
        )
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gateway {
    pub name: String,
    #[serde(default, deserialize_with = "lenient")]
    pub endpoint: Option<SocketAddr>,
    #[serde(default, deserialize_with = "lenient")]
    pub public_key: Option<WgKey>,
    pub created_at_ms: u64,
    #[serde(default)]
    pub certs: Vec<CertRecord>,
    #[serde(default)]
    pub internal_ip: Option<Ipv4Addr>,
    #[serde(default)]
    pub underlay_ip: Option<IpAddr>,
    /// Its kernel can make Geneve links (as its agent last reported).
    #[serde(default)]
    pub geneve: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity_conflict: Option<IdentityConflict>,
    /// When it was last enrolled with a token (0: before weft recorded
    /// it): certificates issued before are another generation's.
    #[serde(default)]
    pub enrolled_at_ms: u64,
    /// A new WireGuard key the gateway asked for while it had one: held
    /// until the admin accepts it (`weftctl gateway accept-key`), since a
    /// stolen certificate must not redirect the site's tunnels. Peers keep
    /// the current key meanwhile.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "lenient")]
    pub pending_public_key: Option<WgKey>,
    /// Enrolled (with a token) since its key was last set: the next key
    /// it sends is taken as is.
    #[serde(default)]
    pub key_from_enrollment: bool,
    /// What its endpoint discovery found, per peering's UDP port (as its
    /// agent last reported; written only when it changes).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub discovered: std::collections::BTreeMap<u16, crate::nat::Discovered>,
    /// Its agent enforces export policies (it said so when it last
    /// connected; an older agent ignores them).
    #[serde(default)]
    pub enforces_export: bool,
    /// And takes IPv6 prefixes in them.
    #[serde(default)]
    pub enforces_export_v6: bool,
    /// Its agent tries a hole punch beside a relay and says when the
    /// tunnel moved there (weft's userspace device; not kernel WireGuard,
    /// not an older agent).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub punches_beside: bool,
}

/// One certificate issued to an agent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CertRecord {
    /// Serial number, lower-case hex.
    pub serial: String,
    pub not_after_ms: u64,
    /// When it was issued (0: before weft recorded it).
    #[serde(default)]
    pub issued_at_ms: u64,
    /// A call came with it (see the renewal's conflict check).
    #[serde(default)]
    pub used: bool,
    /// The fingerprint of the site CA that signed it (empty: recorded
    /// before weft kept it, so by a CA older than any rotation).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub ca: String,
}

/// The latest expiry among `certs` that are still valid at `now_ms`.
pub fn live_until(certs: &[CertRecord], now_ms: u64) -> Option<u64> {
    certs.iter().map(|c| c.not_after_ms).filter(|t| *t > now_ms).max()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentRole {
    Node,
    Gateway,
}

impl AgentRole {
    pub fn as_str(self) -> &'static str {
        match self {
            AgentRole::Node => "node",
            AgentRole::Gateway => "gateway",
        }
    }
}

/// An enrollment token. Only a hash of its secret is stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Token {
    pub id: String,
    /// SHA-256 of the secret, hex.
    pub secret_sha256: String,
    pub role: AgentRole,
    pub name: Option<String>,
    pub expires_at_ms: u64,
    pub uses_left: u32,
    pub created_at_ms: u64,
}

/// A revoked certificate, kept until it would have expired anyway.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Revoked {
    pub serial: String,
    /// "node", "gateway" or "admin".
    pub role: String,
    pub name: String,
    pub not_after_ms: u64,
    /// Revoked because the admin removed the agent: an agent presenting it
    /// is told it was removed (and removes what it applied), where any
    /// other revocation leaves its data plane as it is.
    #[serde(default)]
    pub removed: bool,
    /// Revoked because a renewal replaced it: a call from it is a second
    /// holder's (its own holder moved on to the newer one).
    #[serde(default)]
    pub superseded: bool,
    /// When the certificate was issued (0: not recorded).
    #[serde(default)]
    pub issued_at_ms: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AllocationKind {
    NodeSubnet,
    PeerView,
}

/// One block held by IPAM (of either family), derived from the node and
/// peering records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    pub cidr: ipnet::IpNet,
    pub kind: AllocationKind,
    pub owner: String,
    pub pool: Option<ipnet::IpNet>,
}

/// How full one pool is, in addresses (an IPv6 pool's count far past u64).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolUsage {
    pub pool: ipnet::IpNet,
    pub kind: AllocationKind,
    pub total: u128,
    pub allocated: u128,
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A site for unit tests: pod 10.1.0.0/16, external 10.70.0.0/16,
/// internal 10.80.0.0/16, remapping from `pool`.
#[cfg(test)]
pub(crate) fn test_site(id: &str, pool: &str) -> Site {
    let n = |s: &str| s.parse::<Ipv4Net>().unwrap();
    Site {
        ipv6: None,
        id: id.into(),
        pod_cidrs: vec![n("10.1.0.0/16")],
        external_cidr: n("10.70.0.0/16"),
        internal_cidr: n("10.80.0.0/16"),
        reserved_cidrs: vec![],
        remap_pools: vec![n(pool)],
        node_prefix_len: 24,
        overlay_mtu: None,
        tunnel_mtu: None,
        wireguard_ports: Default::default(),
        peer_cidr_auto_accept: vec![],
        peer_public_cidrs: vec![],
        controller_ips: vec![],
        underlay_overlap: Default::default(),
        default_export: Default::default(),
        relay_ports: None,
        relay_tls_port: None,
    }
}

/// A negotiated peering with `site_id` for unit tests, without views.
#[cfg(test)]
pub(crate) fn test_peering(site_id: &str) -> Peering {
    Peering {
        site_id: site_id.into(),
        state: PeeringState::Negotiated,
        views: vec![],
        created_at_ms: 0,
        last_error: None,
        remote: None,
        listen_port: 51820,
        pending: None,
        joined_with: None,
        joined_at_ms: 0,
        relay_ports: Default::default(),
        relay_via: None,
        export: None,
        transit: false,
        transit_views: vec![],
        transit_views_v6: vec![],
        views_v6: vec![],
        ipv6_refused: None,
        pending_v6: None,
    }
}

/// A peer site for unit tests: `workload`, no gateways, nothing else.
#[cfg(test)]
pub(crate) fn test_remote(workload: &str) -> RemoteSite {
    RemoteSite {
        ca_pem: String::new(),
        ca_fingerprint: String::new(),
        workload_cidrs: vec![workload.parse().expect("a CIDR")],
        external_cidr: None,
        gateways: vec![],
        mtu: 1420,
        endpoints: vec![],
        tunnel_role: TunnelRole::Server,
        names: vec![],
        relay: false,
        relay_tls_port: 0,
        relay_for: vec![],
        relays: vec![],
        exported: None,
        exported_v6: vec![],
        transit: false,
        transit_v6: false,
        version: String::new(),
        trusts_ca: String::new(),
        transit_routes: vec![],
        readiness: None,
        workload_cidrs_v6: vec![],
        external_cidr_v6: None,
        ipv6_invalid: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peers_readiness_alone_is_told_apart_from_a_change() {
        let p = Peering {
            remote: Some(test_remote("10.2.0.0/16")),
            ..test_peering("b")
        };
        let mut ready = p.clone();
        ready.remote.as_mut().unwrap().readiness = Some(PeerReadiness {
            routes_applied: true,
            active_gateway: "gw".into(),
        });
        assert!(p.same_but_readiness(&ready) && ready.same_but_readiness(&p));
        assert!(!p.same_but_readiness(&p), "no change at all is not a readiness change");
        let mut moved = ready.clone();
        moved.listen_port = 51821;
        assert!(!ready.same_but_readiness(&moved), "a change besides");
        moved.remote.as_mut().unwrap().readiness = None;
        assert!(!ready.same_but_readiness(&moved));
    }

    #[test]
    fn port_ranges_parse_and_refuse_nonsense() {
        assert_eq!(PortRange::parse("51820-51919"), Ok(PortRange::default()));
        assert_eq!(PortRange::parse("4000").map(|r| r.count()), Ok(1));
        for bad in ["", "0-10", "10-5", "1-70000", "a-b", "51820-"] {
            assert!(PortRange::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_peering_is_advertised_at_its_offset_in_the_range() {
        let site = Site {
            ipv6: None,
            id: "a".into(),
            pod_cidrs: vec![],
            external_cidr: "10.255.0.0/24".parse().unwrap(),
            internal_cidr: "10.254.0.0/24".parse().unwrap(),
            reserved_cidrs: vec![],
            remap_pools: vec![],
            node_prefix_len: 24,
            overlay_mtu: None,
            tunnel_mtu: None,
            wireguard_ports: PortRange {
                first: 51820,
                last: 51829,
            },
            peer_cidr_auto_accept: vec![],
            peer_public_cidrs: vec![],
            controller_ips: vec![],
            underlay_overlap: UnderlayOverlap::Refuse,
            default_export: Default::default(),
            relay_ports: None,
            relay_tls_port: None,
        };
        // The first peering at the endpoint itself, the third two above,
        // also behind a forward whose outside ports differ.
        let ep = |e: &str, p| site.peering_endpoint(e.parse().unwrap(), p).map(|a| a.to_string());
        assert_eq!(ep("192.0.2.1:51820", 51820).as_deref(), Some("192.0.2.1:51820"));
        assert_eq!(ep("192.0.2.1:51820", 51822).as_deref(), Some("192.0.2.1:51822"));
        assert_eq!(ep("198.51.100.7:40000", 51822).as_deref(), Some("198.51.100.7:40002"));
        assert_eq!(ep("[2001:db8::1]:51820", 51821).as_deref(), Some("[2001:db8::1]:51821"));
        assert_eq!(ep("192.0.2.1:65535", 51821), None, "past 65535");
        assert_eq!(ep("192.0.2.1:51820", 51000), None, "below the range");
    }

    #[test]
    fn names() {
        for good in ["a", "node-1", "n1.dc2", "0"] {
            assert!(validate_name("node name", good).is_ok(), "{good}");
        }
        for bad in ["", "-a", "a-", "A", "a/b", "../x", "a b", &"x".repeat(64)] {
            assert!(validate_name("node name", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_old_record_with_a_value_that_no_longer_parses_still_reads() {
        let old = r#"{"name":"gw","endpoint":"gw.example:51820","public_key":"nope","created_at_ms":0,
            "pending_public_key":"AAAA"}"#;
        let g: Gateway = serde_json::from_str(old).unwrap();
        assert_eq!((g.endpoint, g.public_key, g.pending_public_key), (None, None, None));
        let key = WgKey::from_bytes([3; 32]);
        let good =
            format!(r#"{{"name":"gw","endpoint":"[2001:db8::1]:51820","public_key":"{key}","created_at_ms":0}}"#);
        let g: Gateway = serde_json::from_str(&good).unwrap();
        assert_eq!(g.endpoint, Some("[2001:db8::1]:51820".parse().unwrap()));
        assert_eq!(g.public_key, Some(key));
        // And it is written back as the same strings.
        let again = serde_json::to_value(&g).unwrap();
        assert_eq!(again["endpoint"], "[2001:db8::1]:51820");
        assert_eq!(again["public_key"], key.to_string());
    }
}
