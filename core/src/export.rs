//! Export policy: what a peer may reach of this site, per peering.
//!
//! The exporting site decides; nothing the peer sends widens it. A policy
//! is enforced at this site's gateway, in the peering's namespace (the
//! tunnel filter, rendered with its rules), and applies to every packet
//! the peer sends, open connections included; replies to connections this
//! site opened always pass. Without a policy of its own a peering follows
//! the site's default (`--default-export all|none`).

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use weft_proto::v1 as pb;

pub use crate::domain::{DefaultExport, ExportPolicy, ExportRule, Protocol};
use crate::domain::{Peering, Site, parse_cidr};

/// Most rules one policy holds (each is an nft rule on the gateway).
pub const MAX_RULES: usize = 256;

/// The policy in force for `p`: None for everything, Some(rules) for only
/// what they allow.
pub fn effective<'a>(site: &Site, p: &'a Peering) -> Option<&'a [ExportRule]> {
    in_force(site, p.export.as_ref())
}

/// [`effective`] of a policy as set (None: none of its own).
fn in_force<'a>(site: &Site, export: Option<&'a ExportPolicy>) -> Option<&'a [ExportRule]> {
    match (export, site.default_export) {
        (Some(ExportPolicy::All), _) | (None, DefaultExport::All) => None,
        (Some(ExportPolicy::Rules(r)), _) => Some(r),
        (None, DefaultExport::None) => Some(&[]),
    }
}

/// What a policy may name of `site` itself: its workload and external
/// CIDRs of both families.
pub fn own(site: &Site) -> Vec<IpNet> {
    let mut v: Vec<IpNet> = site.exportable().map(IpNet::V4).collect();
    if let Some(v6) = &site.ipv6 {
        v.extend(v6.pod_cidrs.iter().chain(&v6.external_cidr).map(|c| IpNet::V6(*c)));
    }
    v
}

/// Whether IPv4 view `view` holds `cidr`.
fn holds(view: &Ipv4Net, cidr: &IpNet) -> bool {
    matches!(cidr, IpNet::V4(c) if view.contains(c))
}

/// The rules of a request, checked against `site`: each a prefix of its
/// workload or external CIDRs of either family (or of `onward`: on a
/// transit site, its IPv4 views of the sites the peer reaches through
/// it), a known protocol, ports only with tcp or udp and in order, at
/// most [`MAX_RULES`]. Errors name the field.
pub fn parse_rules(
    site: &Site,
    onward: &[(String, Vec<Ipv4Net>)],
    rules: &[pb::ExportRule],
) -> Result<Vec<ExportRule>, String> {
    if rules.len() > MAX_RULES {
        return Err(format!(
            "rules: {} rules, more than the {MAX_RULES} a policy may hold; allow wider prefixes instead",
            rules.len()
        ));
    }
    let own = own(site);
    let mut out = Vec::with_capacity(rules.len());
    for (i, r) in rules.iter().enumerate() {
        let field = |f: &str| format!("rules[{i}].{f}");
        let cidr = weft_types::net::cidr(&r.cidr)
            .map_err(|e| format!("{}: {e}", field("cidr")))?
            .net();
        let via = onward
            .iter()
            .find(|(_, views)| views.iter().any(|v| holds(v, &cidr)))
            .map(|(s, _)| s.clone());
        if via.is_none() && !own.iter().any(|c| c.contains(&cidr)) {
            return Err(format!(
                "{}: {cidr} is not within this site's workload or external CIDRs ({}); a policy exports only \
                 this site's own networks (and, with transit, its views of the sites reached through it)",
                field("cidr"),
                own.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(", "),
            ));
        }
        let protocol = Protocol::parse(&r.protocol).map_err(|e| format!("{}: {e}", field("protocol")))?;
        let ports = weft_types::policy::ports(protocol, r.first_port, r.last_port)
            .map_err(|e| format!("{}: {}", field(e.field), e.message))?;
        out.push(ExportRule {
            cidr,
            protocol,
            ports,
            via,
        });
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// The rules of `rules` that hold now: this site's own, and those naming
/// a site reached through it (transit) while `onward` still has that site
/// with a view holding the rule's prefix.
pub fn live(rules: &[ExportRule], onward: &[(String, Vec<Ipv4Net>)]) -> Vec<ExportRule> {
    rules
        .iter()
        .filter(|r| match &r.via {
            None => true,
            Some(site) => onward
                .iter()
                .any(|(s, views)| s == site && views.iter().any(|v| holds(v, &r.cidr))),
        })
        .cloned()
        .collect()
}

/// The prefixes `rules` reach, without one inside another.
pub fn prefixes(rules: &[ExportRule]) -> Vec<IpNet> {
    let all: Vec<IpNet> = rules.iter().map(|r| r.cidr).collect();
    IpNet::aggregate(&all)
}

/// What `params` (this site's, for the peering `p` with the receiving
/// site; None while it is being negotiated) says of this site's export
/// policy: the prefixes the peer may reach when limited (IPv4's in
/// `exports`, IPv6's in `exports_v6`), and only the names within them (a
/// name's IPv6 address too).
///
/// On a transit site, prefixes of its views of the sites reached through
/// it (`onward`) are told as well.
pub fn fill(site: &Site, p: Option<&Peering>, onward: &[(String, Vec<Ipv4Net>)], params: &mut pb::NetworkParams) {
    let Some(rules) = in_force(site, p.and_then(|p| p.export.as_ref())) else {
        return;
    };
    // (Rules outside the site's CIDRs cannot be stored; a peer refuses
    // parameters that name them, so never send one.)
    let own = own(site);
    let reach: Vec<IpNet> = prefixes(&live(rules, onward))
        .into_iter()
        .filter(|c| own.iter().any(|o| o.contains(c)) || onward.iter().flat_map(|(_, v)| v).any(|v| holds(v, c)))
        .collect();
    let reached = |a: std::net::IpAddr| reach.iter().any(|c| c.contains(&a));
    params.exports_limited = true;
    params.exports = reach
        .iter()
        .filter(|c| c.addr().is_ipv4())
        .map(|c| c.to_string())
        .collect();
    params.exports_v6 = reach
        .iter()
        .filter(|c| c.addr().is_ipv6())
        .map(|c| c.to_string())
        .collect();
    // A name goes by its IPv4 address; by its IPv6 one when it has none
    // (a workload of an IPv6-only site), or when the peering carries no
    // IPv4 (the peer sent no IPv4 CIDRs: it reaches the name by IPv6
    // alone).
    let v4 = !p
        .and_then(|p| p.remote.as_ref())
        .is_some_and(|r| r.workload_cidrs.is_empty());
    params.names.retain(|n| match n.address.as_str() {
        a if !a.is_empty() && v4 => a.parse::<std::net::Ipv4Addr>().is_ok_and(|a| reached(a.into())),
        _ => n
            .address_v6
            .parse::<std::net::Ipv6Addr>()
            .is_ok_and(|a| reached(a.into())),
    });
    for n in &mut params.names {
        if n.address_v6
            .parse::<std::net::Ipv6Addr>()
            .is_ok_and(|a| !reached(a.into()))
        {
            n.address_v6.clear();
        }
    }
}

/// What a peer's parameters say it exports to this site: None for all,
/// else the prefixes, each within its `workload` or `external` CIDRs or a
/// CIDR it offers for transit, at most [`MAX_RULES`]. Errors name the
/// field. (Its IPv6 prefixes: [`check_exported_v6`].)
pub fn check_exported(
    p: &pb::NetworkParams,
    workload: &[Ipv4Net],
    external: Option<Ipv4Net>,
    transit: &[crate::domain::TransitRoute],
) -> Result<Option<Vec<Ipv4Net>>, String> {
    let offered: Vec<Ipv4Net> = transit.iter().flat_map(crate::transit::cidrs).map(|(_, c)| c).collect();
    if !p.exports_limited {
        if !p.exports.is_empty() {
            return Err("exports: listed without exports_limited".into());
        }
        return Ok(None);
    }
    if p.exports.len() > MAX_RULES {
        return Err(format!(
            "exports: {} listed; a site exports at most {MAX_RULES} prefixes",
            p.exports.len()
        ));
    }
    let mut out = Vec::with_capacity(p.exports.len());
    for (i, e) in p.exports.iter().enumerate() {
        let c = parse_cidr(e).map_err(|m| format!("exports[{i}]: {m}"))?;
        if !workload
            .iter()
            .chain(external.iter())
            .chain(&offered)
            .any(|own| own.contains(&c))
        {
            return Err(format!("exports[{i}]: {c} is not within the CIDRs the site announced"));
        }
        out.push(c);
    }
    Ok(Some(Ipv4Net::aggregate(&out)))
}

/// The IPv6 prefixes a peer's parameters say it exports to this site
/// (with `exports_limited`), each within its IPv6 `workload` or
/// `external` CIDRs; counted with its IPv4 ones against [`MAX_RULES`].
/// Errors name the field (and cost the peering its IPv6 only).
pub fn check_exported_v6(
    p: &pb::NetworkParams,
    workload: &[Ipv6Net],
    external: Option<Ipv6Net>,
) -> Result<Vec<Ipv6Net>, String> {
    if !p.exports_limited {
        if !p.exports_v6.is_empty() {
            return Err("exports_v6: listed without exports_limited".into());
        }
        return Ok(vec![]);
    }
    if p.exports.len() + p.exports_v6.len() > MAX_RULES {
        return Err(format!(
            "exports_v6: {} listed with {} IPv4 ones; a site exports at most {MAX_RULES} prefixes",
            p.exports_v6.len(),
            p.exports.len()
        ));
    }
    let mut out = Vec::with_capacity(p.exports_v6.len());
    for (i, e) in p.exports_v6.iter().enumerate() {
        let c = weft_types::net::cidr(e)
            .map_err(|m| format!("exports_v6[{i}]: {m}"))?
            .v6()
            .ok_or_else(|| format!("exports_v6[{i}]: {e} is IPv4; IPv4 prefixes go in exports"))?;
        if !workload.iter().chain(external.iter()).any(|own| own.contains(&c)) {
            return Err(format!(
                "exports_v6[{i}]: {c} is not within the IPv6 CIDRs the site announced"
            ));
        }
        out.push(c);
    }
    Ok(Ipv6Net::aggregate(&out))
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
mod tests;
