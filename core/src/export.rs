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
        let protocol = match r.protocol.trim().to_ascii_lowercase().as_str() {
            "" | "any" => None,
            "tcp" => Some(Protocol::Tcp),
            "udp" => Some(Protocol::Udp),
            "icmp" | "icmpv6" => Some(Protocol::Icmp),
            other => {
                return Err(format!(
                    "{}: {} is not a protocol a policy knows; give tcp, udp, icmp (ICMPv6 for an IPv6 prefix), \
                     or leave it empty for any",
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
            &[],
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
        parse_rules(&site, &[], &[rule(&site.external_cidr.to_string(), "icmp", 0, 0)]).unwrap();

        let refused = |r: pb::ExportRule, field: &str, says: &str| {
            let e = parse_rules(&site, &[], &[rule("10.1.0.0/24", "", 0, 0), r]).unwrap_err();
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
        let e = parse_rules(&site, &[], &many).unwrap_err();
        assert!(e.starts_with("rules:") && e.contains("more than the 256"), "{e}");
    }

    /// The peer is told the prefixes its policy lets it reach, and only
    /// the names within them; a peer's list is checked before use.
    #[test]
    fn the_peer_is_told_what_it_may_reach_and_a_peers_list_is_checked() {
        let site = crate::domain::test_site("b", "10.1.0.0/16");
        let mut p = crate::domain::test_peering("a");
        let name = |n: &str, a: &str| pb::PublishedName {
            name: n.into(),
            kind: 0,
            address: a.into(),
            address_v6: String::new(),
        };
        let params = || pb::NetworkParams {
            names: vec![name("near", "10.1.0.10"), name("far", "10.1.1.10")],
            ..Default::default()
        };
        let mut all = params();
        fill(&site, Some(&p), &[], &mut all);
        assert!(!all.exports_limited && all.exports.is_empty() && all.names.len() == 2);
        p.export = Some(ExportPolicy::Rules(
            parse_rules(
                &site,
                &[],
                &[
                    rule("10.1.0.0/24", "tcp", 8080, 0),
                    rule("10.1.0.0/25", "", 0, 0),
                    rule("10.70.0.0/24", "", 0, 0),
                ],
            )
            .unwrap(),
        ));
        let mut some = params();
        fill(&site, Some(&p), &[], &mut some);
        assert!(some.exports_limited);
        assert_eq!(
            some.exports,
            ["10.1.0.0/24", "10.70.0.0/24"],
            "one prefix inside another is one"
        );
        assert_eq!(some.names, [name("near", "10.1.0.10")]);
        // Negotiating, under a site that exports nothing by default.
        let mut none_site = site.clone();
        none_site.default_export = DefaultExport::None;
        let mut nothing = params();
        fill(&none_site, None, &[], &mut nothing);
        assert!(nothing.exports_limited && nothing.exports.is_empty() && nothing.names.is_empty());

        // What a peer says.
        let w: Vec<Ipv4Net> = vec!["10.1.0.0/16".parse().unwrap()];
        let ext = Some("10.70.0.0/16".parse().unwrap());
        assert_eq!(check_exported(&all, &w, ext, &[]), Ok(None));
        assert_eq!(
            check_exported(&some, &w, ext, &[]),
            Ok(Some(vec![
                "10.1.0.0/24".parse().unwrap(),
                "10.70.0.0/24".parse().unwrap()
            ]))
        );
        let bad = |f: &dyn Fn(&mut pb::NetworkParams), says: &str| {
            let mut q = some.clone();
            f(&mut q);
            let e = check_exported(&q, &w, ext, &[]).unwrap_err();
            assert!(e.contains(says), "{e}");
        };
        bad(
            &|q| q.exports.push("192.0.2.0/24".into()),
            "exports[2]: 192.0.2.0/24 is not within",
        );
        bad(&|q| q.exports.push("10.1.0.1/24".into()), "exports[2]: ");
        bad(&|q| q.exports_limited = false, "without exports_limited");
        bad(
            &|q| q.exports = vec!["10.1.0.0/24".into(); MAX_RULES + 1],
            "at most 256",
        );
    }

    /// IPv6 prefixes of the site's own IPv6 networks are rules too; the
    /// peer is told them apart from the IPv4 ones, and names lose an IPv6
    /// address the policy does not reach; a peer's IPv6 list is checked.
    #[test]
    fn ipv6_rules_are_the_sites_ipv6_prefixes_told_apart() {
        let mut site = crate::domain::test_site("b", "10.1.0.0/16");
        let v6 = |pods: &[&str]| crate::domain::Ipv6Networks {
            pod_cidrs: pods.iter().map(|c| c.parse().unwrap()).collect(),
            ..Default::default()
        };
        let v6rule = rule("fd00:1:0:2::/64", "icmpv6", 0, 0);
        let e = parse_rules(&site, &[], std::slice::from_ref(&v6rule)).unwrap_err();
        assert!(e.starts_with("rules[0].cidr: fd00:1:0:2::/64 is not within"), "{e}");
        site.ipv6 = Some(v6(&["fd00:1::/48"]));
        let rules = parse_rules(&site, &[], &[v6rule, rule("10.1.0.0/24", "tcp", 80, 0)]).unwrap();
        assert!(
            rules.iter().any(|r| r.to_string() == "fd00:1:0:2::/64 icmp"),
            "{rules:?}"
        );
        let e = parse_rules(&site, &[], &[rule("fd00:2::/64", "", 0, 0)]).unwrap_err();
        assert!(e.contains("fd00:1::/48"), "the site's IPv6 CIDRs are listed: {e}");
        let e = parse_rules(&site, &[], &[rule("fd00:1::1/64", "", 0, 0)]).unwrap_err();
        assert!(e.contains("host bits"), "{e}");

        let mut p = crate::domain::test_peering("a");
        p.export = Some(ExportPolicy::Rules(rules));
        let mut params = pb::NetworkParams {
            names: vec![pb::PublishedName {
                name: "web".into(),
                kind: 0,
                address: "10.1.0.10".into(),
                address_v6: "fd00:1:0:9::10".into(),
            }],
            ..Default::default()
        };
        fill(&site, Some(&p), &[], &mut params);
        assert_eq!(
            (params.exports.clone(), params.exports_v6.clone()),
            (vec!["10.1.0.0/24".to_string()], vec!["fd00:1:0:2::/64".to_string()])
        );
        assert_eq!(params.names.len(), 1);
        assert_eq!(params.names[0].address_v6, "", "its IPv6 address is not exported");

        // What a peer says of its IPv6 exports.
        let w6: Vec<Ipv6Net> = vec!["fd00:1::/48".parse().unwrap()];
        assert_eq!(
            check_exported_v6(&params, &w6, None),
            Ok(vec!["fd00:1:0:2::/64".parse().unwrap()])
        );
        let bad = |f: &dyn Fn(&mut pb::NetworkParams), says: &str| {
            let mut q = params.clone();
            f(&mut q);
            let e = check_exported_v6(&q, &w6, None).unwrap_err();
            assert!(e.contains(says), "{e}");
        };
        bad(
            &|q| q.exports_v6.push("fd00:9::/64".into()),
            "exports_v6[1]: fd00:9::/64 is not within",
        );
        bad(
            &|q| q.exports_v6.push("10.1.0.0/24".into()),
            "exports_v6[1]: 10.1.0.0/24 is IPv4",
        );
        bad(&|q| q.exports_limited = false, "without exports_limited");
        bad(&|q| q.exports = vec!["10.1.0.0/24".into(); MAX_RULES], "at most 256");
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
        let r = parse_rules(&site, &[], &[rule("10.1.2.0/24", "tcp", 8080, 0)]).unwrap();
        p.export = Some(ExportPolicy::Rules(r.clone()));
        site.default_export = DefaultExport::All;
        assert_eq!(effective(&site, &p), Some(&r[..]));
    }
}
