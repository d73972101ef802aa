//! Export policy: what a peer may reach of this site, per peering.
//!
//! The exporting site decides; nothing the peer sends widens it. A policy
//! is enforced at this site's gateway, in the peering's namespace (the
//! tunnel filter, rendered with its rules), and applies to every packet
//! the peer sends, open connections included; replies to connections this
//! site opened always pass. Without a policy of its own a peering follows
//! the site's default (`--default-export all|none`).

use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};
use weft_proto::v1 as pb;

use crate::domain::{Peering, Site, parse_cidr};

/// Most rules one policy holds (each is an nft rule on the gateway).
pub const MAX_RULES: usize = 256;

/// A peering's policy as set by the admin.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "mode", content = "rules")]
pub enum ExportPolicy {
    /// Everything: the site's workload and external CIDRs, exported hosts.
    All,
    /// Only what a rule allows; no rules: nothing.
    Rules(Vec<ExportRule>),
}

/// The site's default for peerings without a policy of their own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DefaultExport {
    #[default]
    All,
    None,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    Tcp,
    Udp,
    Icmp,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Icmp => "icmp",
        }
    }
}

/// The peer may reach `cidr`, with `protocol` (None: any), on `ports`
/// (inclusive; None: any; tcp and udp only).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ExportRule {
    pub cidr: Ipv4Net,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<Protocol>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<(u16, u16)>,
}

impl std::fmt::Display for ExportRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.cidr)?;
        if let Some(p) = self.protocol {
            write!(f, " {}", p.as_str())?;
        }
        match self.ports {
            Some((a, b)) if a == b => write!(f, " port {a}"),
            Some((a, b)) => write!(f, " ports {a}-{b}"),
            None => Ok(()),
        }
    }
}

/// The policy in force for `p`: None for everything, Some(rules) for only
/// what they allow.
pub fn effective<'a>(site: &Site, p: &'a Peering) -> Option<&'a [ExportRule]> {
    match (&p.export, site.default_export) {
        (Some(ExportPolicy::All), _) | (None, DefaultExport::All) => None,
        (Some(ExportPolicy::Rules(r)), _) => Some(r),
        (None, DefaultExport::None) => Some(&[]),
    }
}

/// The rules of a request, checked against `site`: each a prefix of its
/// workload or external CIDRs, a known protocol, ports only with tcp or
/// udp and in order, at most [`MAX_RULES`]. Errors name the field.
pub fn parse_rules(site: &Site, rules: &[pb::ExportRule]) -> Result<Vec<ExportRule>, String> {
    if rules.len() > MAX_RULES {
        return Err(format!(
            "rules: {} rules, more than the {MAX_RULES} a policy may hold; allow wider prefixes instead",
            rules.len()
        ));
    }
    let mut out = Vec::with_capacity(rules.len());
    for (i, r) in rules.iter().enumerate() {
        let field = |f: &str| format!("rules[{i}].{f}");
        let cidr = parse_cidr(&r.cidr).map_err(|e| format!("{}: {e}", field("cidr")))?;
        let own: Vec<Ipv4Net> = site.pod_cidrs.iter().copied().chain([site.external_cidr]).collect();
        if !own.iter().any(|c| c.contains(&cidr)) {
            return Err(format!(
                "{}: {cidr} is not within this site's workload CIDRs ({}) or its external CIDR ({}); a policy \
                 exports only this site's own networks",
                field("cidr"),
                site.pod_cidrs
                    .iter()
                    .map(|c| c.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                site.external_cidr
            ));
        }
        let protocol = match r.protocol.trim().to_ascii_lowercase().as_str() {
            "" | "any" => None,
            "tcp" => Some(Protocol::Tcp),
            "udp" => Some(Protocol::Udp),
            "icmp" => Some(Protocol::Icmp),
            other => {
                return Err(format!(
                    "{}: {} is not a protocol a policy knows; give tcp, udp, icmp, or leave it empty for any",
                    field("protocol"),
                    crate::domain::shown(other)
                ));
            }
        };
        let ports = match (r.first_port, r.last_port) {
            (0, 0) => None,
            (0, _) => {
                return Err(format!(
                    "{}: a port range needs its first port (1 to 65535)",
                    field("first_port")
                ));
            }
            (a, 0) => Some((a, a)),
            (a, b) => Some((a, b)),
        };
        if let Some((a, b)) = ports {
            if !matches!(protocol, Some(Protocol::Tcp | Protocol::Udp)) {
                return Err(format!("{}: ports need protocol tcp or udp", field("first_port")));
            }
            if a > 65535 {
                return Err(format!("{}: {a} is not a port (1 to 65535)", field("first_port")));
            }
            if b > 65535 {
                return Err(format!("{}: {b} is not a port (1 to 65535)", field("last_port")));
            }
            if b < a {
                return Err(format!(
                    "{}: the range {a}-{b} ends before it starts; give the lower port first",
                    field("last_port")
                ));
            }
        }
        out.push(ExportRule {
            cidr,
            protocol,
            ports: ports.map(|(a, b)| (a as u16, b as u16)),
        });
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// A rule on the wire.
pub fn rule_pb(r: &ExportRule) -> pb::ExportRule {
    let (first_port, last_port) = r.ports.map_or((0, 0), |(a, b)| (u32::from(a), u32::from(b)));
    pb::ExportRule {
        cidr: r.cidr.to_string(),
        protocol: r.protocol.map(|p| p.as_str().to_string()).unwrap_or_default(),
        first_port,
        last_port,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(cidr: &str, protocol: &str, first_port: u32, last_port: u32) -> pb::ExportRule {
        pb::ExportRule {
            cidr: cidr.into(),
            protocol: protocol.into(),
            first_port,
            last_port,
        }
    }

    #[test]
    fn rules_are_this_sites_prefixes_with_sane_ports() {
        let site = crate::domain::test_site("b", "10.1.0.0/16");
        let ok = parse_rules(
            &site,
            &[
                rule("10.1.2.0/24", "tcp", 8080, 0),
                rule("10.1.0.0/16", "", 0, 0),
                rule("10.1.3.0/24", "UDP", 5000, 5010),
                rule("10.1.2.0/24", "tcp", 8080, 8080),
            ],
        )
        .unwrap();
        assert_eq!(ok.len(), 3, "duplicates collapse: {ok:?}");
        assert!(ok.iter().any(|r| r.to_string() == "10.1.2.0/24 tcp port 8080"));
        assert!(ok.iter().any(|r| r.to_string() == "10.1.3.0/24 udp ports 5000-5010"));
        // The external CIDR is this site's too.
        parse_rules(&site, &[rule(&site.external_cidr.to_string(), "icmp", 0, 0)]).unwrap();

        let refused = |r: pb::ExportRule, field: &str, says: &str| {
            let e = parse_rules(&site, &[rule("10.1.0.0/24", "", 0, 0), r]).unwrap_err();
            assert!(e.starts_with(&format!("rules[1].{field}:")), "{e}");
            assert!(e.contains(says), "{e}");
        };
        refused(rule("192.0.2.0/24", "", 0, 0), "cidr", "not within this site's");
        refused(rule("10.0.0.0/8", "", 0, 0), "cidr", "not within this site's");
        refused(rule("10.1.2.1/24", "", 0, 0), "cidr", "host bits");
        refused(rule("nonsense", "", 0, 0), "cidr", "not a CIDR");
        refused(rule("10.1.2.0/24", "sctp", 0, 0), "protocol", "tcp, udp, icmp");
        refused(
            rule("10.1.2.0/24", "tcp", 9000, 8000),
            "last_port",
            "ends before it starts",
        );
        refused(rule("10.1.2.0/24", "tcp", 0, 80), "first_port", "needs its first port");
        refused(rule("10.1.2.0/24", "tcp", 70000, 0), "first_port", "not a port");
        refused(rule("10.1.2.0/24", "tcp", 80, 70000), "last_port", "not a port");
        refused(rule("10.1.2.0/24", "icmp", 80, 0), "first_port", "tcp or udp");
        refused(rule("10.1.2.0/24", "", 80, 0), "first_port", "tcp or udp");

        let many: Vec<_> = (0..=MAX_RULES)
            .map(|i| rule("10.1.0.0/16", "tcp", i as u32 + 1, 0))
            .collect();
        let e = parse_rules(&site, &many).unwrap_err();
        assert!(e.starts_with("rules:") && e.contains("more than the 256"), "{e}");
    }

    #[test]
    fn a_peering_without_a_policy_follows_the_sites_default() {
        let mut site = crate::domain::test_site("b", "10.1.0.0/16");
        let mut p = crate::domain::test_peering("a");
        assert_eq!(effective(&site, &p), None);
        site.default_export = DefaultExport::None;
        assert_eq!(effective(&site, &p), Some(&[][..]));
        p.export = Some(ExportPolicy::All);
        assert_eq!(effective(&site, &p), None);
        let r = parse_rules(&site, &[rule("10.1.2.0/24", "tcp", 8080, 0)]).unwrap();
        p.export = Some(ExportPolicy::Rules(r.clone()));
        site.default_export = DefaultExport::All;
        assert_eq!(effective(&site, &p), Some(&r[..]));
    }
}
