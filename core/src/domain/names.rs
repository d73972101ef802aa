//! Names as stored: those this site publishes, and those a peer published
//! (the checks and the resolving are the `names` module's).

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NameKind {
    /// An address in the site's pod CIDRs.
    Workload,
    /// A host outside them, reached through an external address.
    ExportedHost,
}

impl NameKind {
    pub fn to_pb(self) -> weft_proto::v1::NameKind {
        match self {
            NameKind::Workload => weft_proto::v1::NameKind::Workload,
            NameKind::ExportedHost => weft_proto::v1::NameKind::ExportedHost,
        }
    }

    /// None for an unknown or unset kind.
    pub fn from_pb(v: i32) -> Option<NameKind> {
        match weft_proto::v1::NameKind::try_from(v) {
            Ok(weft_proto::v1::NameKind::Workload) => Some(NameKind::Workload),
            Ok(weft_proto::v1::NameKind::ExportedHost) => Some(NameKind::ExportedHost),
            _ => None,
        }
    }
}

/// A name this site publishes (stored under `names/<name>`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NameRecord {
    pub name: String,
    pub kind: NameKind,
    /// The workload's address, or the exported host's own address (which
    /// never leaves the site); none for a workload of an IPv6-only site,
    /// named by its IPv6 address alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<Ipv4Addr>,
    /// Exported host: its address in the site's external CIDR.
    #[serde(default)]
    pub external: Option<Ipv4Addr>,
    /// A workload's IPv6 address (in the site's IPv6 pod CIDRs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address_v6: Option<std::net::Ipv6Addr>,
    pub created_at_ms: u64,
}

impl NameRecord {
    /// The IPv4 address peers are told: the workload's, or the external
    /// one; none for an IPv6-only workload.
    pub fn published(&self) -> Option<Ipv4Addr> {
        self.external.or(self.address)
    }
}

/// A name a peer published, as recorded with the peering.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteName {
    pub name: String,
    pub kind: NameKind,
    /// In the peer's workload CIDRs (workload) or external CIDR (exported);
    /// none for a workload of an IPv6-only site.
    #[serde(with = "v4_or_unspecified")]
    pub address: Option<Ipv4Addr>,
    /// A workload's IPv6 address, in the peer's IPv6 workload CIDRs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address_v6: Option<std::net::Ipv6Addr>,
}

/// [`RemoteName::address`] as stored: none is written as 0.0.0.0, so that
/// a controller replica of an earlier version, which requires the field,
/// still reads the peering that holds it (a dual-stack site peered with an
/// IPv6-only one); 0.0.0.0 is in no peer's view, so it learns nothing from
/// such a name.
mod v4_or_unspecified {
    use std::net::Ipv4Addr;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(a: &Option<Ipv4Addr>, s: S) -> Result<S::Ok, S::Error> {
        a.unwrap_or(Ipv4Addr::UNSPECIFIED).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Ipv4Addr>, D::Error> {
        Ok(Some(Ipv4Addr::deserialize(d)?).filter(|a| !a.is_unspecified()))
    }

    #[cfg(test)]
    mod tests {
        use crate::domain::{NameKind, RemoteName};

        #[test]
        fn a_name_without_ipv4_is_stored_as_an_earlier_version_reads_it() {
            let n = RemoteName {
                name: "api".into(),
                kind: NameKind::Workload,
                address: None,
                address_v6: Some("fd00:1::20".parse().unwrap()),
            };
            let text = serde_json::to_string(&n).unwrap();
            assert!(text.contains(r#""address":"0.0.0.0""#), "{text}");
            assert_eq!(serde_json::from_str::<RemoteName>(&text).unwrap(), n);
            let with: RemoteName =
                serde_json::from_str(r#"{"name":"web","kind":"workload","address":"10.1.0.10"}"#).unwrap();
            assert_eq!(with.address, Some("10.1.0.10".parse().unwrap()));
        }
    }
}
