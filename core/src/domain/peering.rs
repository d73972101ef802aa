//! A peering and what it holds: the peer's parameters as negotiated
//! (`RemoteSite`), its gateways, views, transit, relays and readiness, and
//! the one-time tokens that start one.

use std::net::SocketAddr;

use ipnet::{Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};

use super::*;
use crate::ipam::View;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PeeringState {
    Pending,
    Negotiated,
    /// Shown, never stored: negotiated, not yet carrying traffic end to
    /// end (see the controller's `Hub::peering_status`).
    Connecting,
    /// Shown, never stored: carrying traffic end to end.
    Connected,
    Deleting,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Peering {
    pub site_id: String,
    pub state: PeeringState,
    pub views: Vec<View>,
    pub created_at_ms: u64,
    #[serde(default)]
    pub last_error: Option<String>,
    /// What the peer told us at negotiation (absent for records made
    /// without federation, e.g. in tests of IPAM).
    #[serde(default)]
    pub remote: Option<RemoteSite>,
    /// The UDP port this site's gateway listens on for this peering's tunnel.
    #[serde(default)]
    pub listen_port: u16,
    /// CIDRs the peer announced after negotiation that this site does not
    /// route yet: held until an admin accepts them (or applied at once when
    /// within the site's `peer_cidr_auto_accept` bounds).
    #[serde(default)]
    pub pending: Option<PendingCidrs>,
    /// On the site that issued the peering token: that token, kept until
    /// the peer shows it holds its side too (its subscription answers). A
    /// peering removed before then gives it back, so a peer that gave up
    /// waiting for its Join's answer can still retry with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub joined_with: Option<PeerToken>,
    /// When the peer last joined (ms since the epoch; 0: at creation). It
    /// records its side just after, so its "no such peering" is not
    /// believed for a few seconds after this.
    #[serde(default)]
    pub joined_at_ms: u64,
    /// On a site that relays: the relay's UDP port for this peer's side of
    /// each relayed tunnel, by the site at the tunnel's far end.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub relay_ports: std::collections::BTreeMap<String, u16>,
    /// This peering's tunnel goes through a relay site (chosen by the
    /// leading replica while no direct path exists).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relay_via: Option<RelayVia>,
    /// What the peer may reach of this site; None: the site's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub export: Option<ExportPolicy>,
    /// This site agrees to transit on this peering (see the `transit` module).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub transit: bool,
    /// This site's local views of the sites it reaches through the peer:
    /// planned from the peer's `transit_routes` while both ends agree.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub transit_views: Vec<TransitView>,
    /// The same in IPv6: planned from the IPv6 CIDRs of the peer's
    /// `transit_routes` while the peering carries IPv6.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub transit_views_v6: Vec<TransitView<Ipv6Net>>,
    /// This site's local views of the peer's IPv6 CIDRs (empty: IPv6 not
    /// negotiated; see [`Peering::ipv6_status`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub views_v6: Vec<View<Ipv6Net>>,
    /// Why the peer's IPv6 CIDRs could not be taken (refused, exhausted,
    /// a change held), when that is why IPv6 is not negotiated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv6_refused: Option<String>,
    /// IPv6 CIDRs the peer announced after negotiation (a change, or IPv6
    /// added later) that this site holds for review, as `pending` holds
    /// IPv4's; `views_v6` keeps routing what was agreed before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_v6: Option<PendingV6>,
}

/// A site reached through a transit peer, as that peer offered it: its
/// CIDRs in the peer's local views.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransitRoute {
    pub site: String,
    pub workload_cidrs: Vec<Ipv4Net>,
    pub external_cidr: Option<Ipv4Net>,
    /// Its IPv6 CIDRs in the peer's views (empty: none offered).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workload_cidrs_v6: Vec<Ipv6Net>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_cidr_v6: Option<Ipv6Net>,
}

/// This site's view of one CIDR of `site`, reached through a transit peer:
/// `view.real` is the transit peer's view of it (the address inside the
/// tunnel), `view.local` this site's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(bound = "N: crate::ipam::Prefix")]
pub struct TransitView<N: crate::ipam::Prefix = Ipv4Net> {
    pub site: String,
    pub view: View<N>,
}

/// The relay a tunnel takes: the relay site, and where this site's gateway
/// sends (the relay site's active gateway, the port for this side).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayVia {
    pub site: String,
    pub endpoint: SocketAddr,
    /// The relay's TLS port at the endpoint's address (0: none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tls_port: u16,
}

fn is_zero(p: &u16) -> bool {
    *p == 0
}

/// A relay site's answer to this site's request to relay the tunnel to
/// `peer_site` (checked: an endpoint as a gateway endpoint is).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayGrant {
    pub peer_site: String,
    #[serde(default, deserialize_with = "lenient")]
    pub endpoint: Option<SocketAddr>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub refused: String,
}

/// A peer's announced change of its CIDRs, held for review.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingCidrs {
    pub workload_cidrs: Vec<Ipv4Net>,
    pub external_cidr: Option<Ipv4Net>,
    pub received_at_ms: u64,
}

/// A peer site as it described itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteSite {
    pub ca_pem: String,
    pub ca_fingerprint: String,
    pub workload_cidrs: Vec<Ipv4Net>,
    pub external_cidr: Option<Ipv4Net>,
    /// Its IPv6 workload CIDRs, and external CIDR (none from a site
    /// without IPv6, or of an earlier version).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workload_cidrs_v6: Vec<Ipv6Net>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_cidr_v6: Option<Ipv6Net>,
    /// What was wrong with the IPv6 fields it sent, when something was
    /// (they are then left out; IPv6 is not negotiated, the rest stands).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv6_invalid: Option<String>,
    pub gateways: Vec<RemoteGateway>,
    pub mtu: u32,
    pub endpoints: Vec<String>,
    /// This site's side of the tunnel.
    pub tunnel_role: TunnelRole,
    /// The names it publishes (checked: its own addresses, at most 1000).
    #[serde(default)]
    pub names: Vec<RemoteName>,
    /// It relays peers' tunnels.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub relay: bool,
    /// With `relay`: the TCP port on which its active gateway carries
    /// tunnels over TLS (see `NetworkParams.relay_tls_port`); 0: none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub relay_tls_port: u16,
    /// On a site that relays: the sites it asks this site to relay its
    /// tunnels to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub relay_for: Vec<String>,
    /// On a site that asked it: its answers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub relays: Vec<RelayGrant>,
    /// What its export policy lets this site reach of its CIDRs, when it
    /// limits it (None: all). Shown, not used to route: the whole view
    /// stays routed for the replies to its own connections.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exported: Option<Vec<Ipv4Net>>,
    /// With `exported`: the IPv6 prefixes it lets this site reach (its
    /// IPv6 parameters taken). A field of its own, so that a replica of an
    /// earlier version still reads the record.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exported_v6: Vec<ipnet::Ipv6Net>,
    /// It agrees to transit on this peering.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub transit: bool,
    /// It takes transit routes of IPv6 CIDRs only (`NetworkParams.transit_v6`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub transit_v6: bool,
    /// The release of its controller, as it said (empty: one before
    /// 0.1.0, which does not say).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub version: String,
    /// The fingerprint of this site's signing CA as the peer trusts it
    /// (empty: a peer of an earlier version, which does not say). A
    /// rotation of this site's CA is finished only once every peer trusts
    /// the new one.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub trusts_ca: String,
    /// The sites it offers to reach through it (checked: see
    /// `transit::check_routes`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub transit_routes: Vec<TransitRoute>,
    /// How its side of the peering stands (None: a peer of an earlier
    /// version, which does not say). Not routed on: only what users see.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readiness: Option<PeerReadiness>,
}

/// A peer's word on its side of the peering (see `NetworkParams.readiness`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerReadiness {
    /// Its agents applied the peering's routes as it stands there.
    pub routes_applied: bool,
    /// This site's gateway its gateways send the tunnel to (checked: a
    /// name); empty: none yet.
    #[serde(default)]
    pub active_gateway: String,
}

impl Peering {
    /// The same peering but for what the peer says of its readiness, which
    /// changes nothing that is rendered.
    pub fn same_but_readiness(&self, other: &Peering) -> bool {
        let strip = |p: &Peering| {
            let mut p = p.clone();
            if let Some(r) = p.remote.as_mut() {
                r.readiness = None;
            }
            p
        };
        self.remote.as_ref().map(|r| &r.readiness) != other.remote.as_ref().map(|r| &r.readiness)
            && strip(self) == strip(other)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteGateway {
    pub name: String,
    #[serde(default, deserialize_with = "lenient")]
    pub endpoint: Option<SocketAddr>,
    #[serde(default, deserialize_with = "lenient")]
    pub public_key: Option<WgKey>,
    /// Carries the peer's traffic now (false: a standby).
    #[serde(default)]
    pub active: bool,
    /// Where else its tunnel socket for this peering may be reached
    /// (configured and reflexive; checked, see `nat::candidates`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub candidates: Vec<crate::nat::Candidate>,
    /// Its NAT as its endpoint discovery observed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nat: Option<crate::nat::Behaviour>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TunnelRole {
    /// Waits for the peer to dial.
    Server,
    /// Dials the peer.
    Client,
}

/// A one-time peering token's record (only a hash of the secret).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerToken {
    pub id: String,
    pub secret_sha256: String,
    pub expires_at_ms: u64,
    pub created_at_ms: u64,
    /// Only this site may redeem it (None: any site holding it).
    #[serde(default)]
    pub for_site: Option<String>,
}
