//! Export policy: what a peer may reach of this site, as stored (the
//! checks and the rendering are the `export` module's).

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// A peering's policy as set by the admin: its rules checked (`R`, as
/// stored), or as an admin sent them, before they are checked against the
/// site (`ExportPolicy<&[pb::ExportRule]>`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "mode", content = "rules")]
pub enum ExportPolicy<R = Vec<ExportRule>> {
    /// Everything: the site's workload and external CIDRs, exported hosts.
    All,
    /// Only what a rule allows; no rules: nothing.
    Rules(R),
}

/// The site's default for peerings without a policy of their own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DefaultExport {
    #[default]
    All,
    None,
}

/// An export rule's protocol, as the API, the store and the agent take it.
pub use weft_types::policy::Protocol;

/// The peer may reach `cidr` (IPv4 or IPv6), with `protocol` (None: any;
/// icmp is ICMPv6 for an IPv6 `cidr`), on `ports` (inclusive; None: any;
/// tcp and udp only).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ExportRule {
    pub cidr: IpNet,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<Protocol>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<(u16, u16)>,
    /// On a transit site: the site whose view (this site's) `cidr` lies
    /// in. The rule holds only while that site is reached through this
    /// one and its view still holds `cidr`: a block later given to
    /// another site is not allowed by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub via: Option<String>,
}

impl std::fmt::Display for ExportRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.cidr)?;
        if let Some(p) = self.protocol {
            write!(f, " {}", p.as_str())?;
        }
        match self.ports {
            Some((a, b)) if a == b => write!(f, " port {a}")?,
            Some((a, b)) => write!(f, " ports {a}-{b}")?,
            None => {}
        }
        match &self.via {
            Some(site) => write!(f, " (site {site}, in transit)"),
            None => Ok(()),
        }
    }
}
