//! A tunnel filter's export policy and transit destinations, decoded.

use ipnet::IpNet;
use weft_proto::v1 as pb;

use super::{MAX_POLICY_RULES, MAX_TRANSIT_PREFIXES, MAX_TRANSIT_SITES, R, net};
use crate::model::{PolicyRule, Protocol};

/// A tunnel filter's transit destinations by site, checked: at most
/// [`MAX_TRANSIT_SITES`] sites of at most [`MAX_TRANSIT_PREFIXES`] CIDRs,
/// each site a name fit for an nft counter (`transit-<site>`: lowercase
/// letters, digits, '-' and '.', at most 63), listed once.
pub(super) fn transit_prefixes(f: &pb::TunnelFilter) -> R<Vec<(String, Vec<IpNet>)>> {
    if f.transit.len() > MAX_TRANSIT_SITES {
        return Err(format!(
            "a tunnel filter forwarding to {} sites, more than {MAX_TRANSIT_SITES}",
            f.transit.len()
        ));
    }
    let mut out: Vec<(String, Vec<IpNet>)> = Vec::with_capacity(f.transit.len());
    for t in &f.transit {
        let ok = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.';
        if t.site.is_empty() || t.site.len() > 63 || !t.site.chars().all(ok) {
            return Err(format!("transit site {:?} is not a site id", t.site));
        }
        if out.iter().any(|(s, _)| *s == t.site) {
            return Err(format!("transit site {:?} listed twice", t.site));
        }
        if t.cidrs.is_empty() || t.cidrs.len() > MAX_TRANSIT_PREFIXES {
            return Err(format!(
                "transit to {:?} with {} CIDRs; give 1 to {MAX_TRANSIT_PREFIXES}",
                t.site,
                t.cidrs.len()
            ));
        }
        let cidrs = t.cidrs.iter().map(|c| net(c, "transit")).collect::<R<_>>()?;
        out.push((t.site.clone(), cidrs));
    }
    Ok(out)
}

/// A tunnel filter's export policy: None when it has none (`policed`
/// unset), else its rules, each checked (a CIDR; a protocol and ports as
/// [`weft_types::policy`] checks them), at most [`MAX_POLICY_RULES`].
pub(super) fn policy_rules(f: &pb::TunnelFilter) -> R<Option<Vec<PolicyRule>>> {
    if !f.policed {
        if !f.exports.is_empty() {
            return Err("a tunnel filter with export rules but no policy".into());
        }
        return Ok(None);
    }
    if f.exports.len() > MAX_POLICY_RULES {
        return Err(format!(
            "a tunnel filter with {} export rules, more than {MAX_POLICY_RULES}",
            f.exports.len()
        ));
    }
    let mut out = Vec::with_capacity(f.exports.len());
    for r in &f.exports {
        let cidr = net(&r.cidr, "export rule")?;
        let protocol = Protocol::parse(&r.protocol).map_err(|e| format!("export rule for {cidr}: {e}"))?;
        let ports = weft_types::policy::ports(protocol, r.first_port, r.last_port)
            .map_err(|e| format!("export rule for {cidr}: {e}"))?;
        out.push(PolicyRule { cidr, protocol, ports });
    }
    Ok(Some(out))
}
