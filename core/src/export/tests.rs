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
