//! A site's IPv6 networks and a peering's IPv6 status, and how records
//! read values stored as text.

use ipnet::Ipv6Net;
use serde::{Deserialize, Serialize};

use super::Peering;

/// Reads an optional value stored as text through its one parser. A value
/// that no longer parses (written by an earlier version that checked less,
/// e.g. an endpoint naming a host) reads as none: one old record must not
/// stop the controller, and its agent or peer sends the value again.
pub(super) fn lenient<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: std::str::FromStr,
{
    let text: Option<String> = Option::deserialize(d)?;
    Ok(text.and_then(|t| t.parse().ok()))
}

/// Prefix length of each node's IPv6 workload subnet.
pub const NODE_PREFIX_LEN_V6: u8 = 64;

/// A site's IPv6 networks, each as its IPv4 counterpart in `Site`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ipv6Networks {
    /// Workload CIDRs, each a /32 to a /64: a node gets a /64 of one.
    pub pod_cidrs: Vec<Ipv6Net>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_cidr: Option<Ipv6Net>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reserved_cidrs: Vec<Ipv6Net>,
    /// Where remapped IPv6 views are taken from: as configured, else the
    /// unique local /40 the controller generated on its first start with
    /// IPv6 (RFC 4193's random global id) and recorded here.
    #[serde(default)]
    pub remap_pools: Vec<Ipv6Net>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peer_cidr_auto_accept: Vec<Ipv6Net>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peer_public_cidrs: Vec<Ipv6Net>,
    /// This site's controllers' IPv6 addresses (listen and advertised):
    /// no IPv6 view may cover them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub controller_ips: Vec<std::net::Ipv6Addr>,
}

impl Ipv6Networks {
    /// Every IPv6 block the site addresses itself.
    pub fn own_blocks(&self) -> Vec<Ipv6Net> {
        let mut v = self.pod_cidrs.clone();
        v.extend(self.external_cidr);
        v.extend(&self.reserved_cidrs);
        v
    }
}

/// A peer's IPv6 CIDRs announced after negotiation, held for review.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingV6 {
    pub workload_cidrs_v6: Vec<Ipv6Net>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_cidr_v6: Option<Ipv6Net>,
    pub received_at_ms: u64,
}

impl Peering {
    /// Whether this peering carries IPv4 views, and why not when one of
    /// the sites is IPv6-only (`site_has_v4`: this site has IPv4 pods);
    /// None when there is nothing to say (no record of the peer).
    pub fn ipv4_status(&self, site_has_v4: bool) -> Option<Result<(), String>> {
        if !self.views.is_empty() {
            return Some(Ok(()));
        }
        let r = self.remote.as_ref()?;
        Some(Err(if !site_has_v4 {
            "this site has no IPv4 pod CIDRs (it is IPv6-only)".to_string()
        } else if self.pending.is_some() {
            format!(
                "{}'s new IPv4 CIDRs are held for review (`weftctl peering accept {}`)",
                self.site_id, self.site_id
            )
        } else if r.workload_cidrs.is_empty() {
            format!("{} offered no IPv4 CIDRs (it is IPv6-only)", self.site_id)
        } else {
            "IPv4 views are not planned yet".to_string()
        }))
    }

    /// Whether this peering carries IPv6 views, and why not, with this
    /// site's IPv6 networks (`site_v6`); None when neither site has IPv6.
    pub fn ipv6_status(&self, site_v6: Option<&Ipv6Networks>) -> Option<Result<(), String>> {
        let offered = self
            .remote
            .as_ref()
            .is_some_and(|r| !r.workload_cidrs_v6.is_empty() || r.external_cidr_v6.is_some());
        if let Some(why) = &self.ipv6_refused {
            return Some(Err(why.clone()));
        }
        Some(match (site_v6.is_some(), offered) {
            (_, _) if !self.views_v6.is_empty() => Ok(()),
            (false, false) => return None,
            (false, true) => Err(format!(
                "{} offers IPv6 CIDRs, but this site has none (add an IPv6 pod CIDR to take them)",
                self.site_id
            )),
            (true, false) => Err(format!(
                "{} offered no IPv6 CIDRs (it has none, or runs a weft without IPv6)",
                self.site_id
            )),
            (true, true) => Err("IPv6 views are not planned yet".into()),
        })
    }
}
