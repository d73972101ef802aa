use super::*;
use crate::domain::RemoteSite;

fn n(s: &str) -> Ipv4Net {
    s.parse().unwrap()
}
fn a(s: &str) -> Ipv4Addr {
    s.parse().unwrap()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn site() -> Site {
    crate::domain::test_site("site-a", "10.200.0.0/13")
}

fn peering(state: PeeringState) -> Peering {
    Peering {
        site_id: "site-b".into(),
        state,
        views: vec![
            View {
                kind: CidrKind::Workload,
                real: n("10.1.0.0/16"),
                local: n("10.200.0.0/16"),
                pool: Some(n("10.200.0.0/13")),
            },
            View {
                kind: CidrKind::External,
                real: n("10.70.0.0/16"),
                local: n("10.201.0.0/16"),
                pool: Some(n("10.200.0.0/13")),
            },
        ],
        created_at_ms: 0,
        last_error: None,
        remote: Some(RemoteSite {
            external_cidr: Some(n("10.70.0.0/16")),
            mtu: 0,
            names: vec![
                RemoteName {
                    name: "web".into(),
                    kind: NameKind::Workload,
                    address: Some(a("10.1.0.10")),
                    address_v6: None,
                },
                RemoteName {
                    name: "db".into(),
                    kind: NameKind::ExportedHost,
                    address: Some(a("10.70.255.254")),
                    address_v6: None,
                },
            ],
            ..crate::domain::test_remote("10.1.0.0/16")
        }),
        ..crate::domain::test_peering("")
    }
}

#[test]
fn labels_are_dns_labels() {
    for good in ["db", "web-1", "a", &"x".repeat(63)] {
        assert!(check_label("name", good).is_ok(), "{good}");
    }
    for bad in ["", "-db", "db-", "Db", "web.site", "a_b", &"x".repeat(64), "dé"] {
        let e = check_label("name", bad).unwrap_err();
        assert!(e.starts_with("name"), "{e}");
    }
}

#[test]
fn translation_goes_both_ways_and_keeps_host_bits() {
    let p = peering(PeeringState::Negotiated);
    let t = to_local(&[&p], "site-b", ip("10.1.0.10")).unwrap();
    assert_eq!(t.local, ip("10.200.0.10"));
    assert_eq!(t.kind, CidrKind::Workload);
    assert!(t.remapped());
    let back = to_peer(&[&p], t.local).unwrap();
    assert_eq!((back.site.as_str(), back.real), ("site-b", ip("10.1.0.10")));
    let ext = to_local(&[&p], "site-b", ip("10.70.255.254")).unwrap();
    assert_eq!((ext.local, ext.kind), (ip("10.201.255.254"), CidrKind::External));
}

fn with_ipv6() -> Peering {
    let mut p = peering(PeeringState::Negotiated);
    p.views_v6 = vec![View {
        kind: CidrKind::Workload,
        real: "fd00:1::/48".parse().unwrap(),
        local: "fd37:fec3:9300::/48".parse().unwrap(),
        pool: Some("fd37:fec3:9300::/40".parse().unwrap()),
    }];
    p
}

#[test]
fn ipv6_translates_through_the_ipv6_views_keeping_host_bits() {
    let p = with_ipv6();
    let t = to_local(&[&p], "site-b", ip("fd00:1:0:2::10")).unwrap();
    assert_eq!(t.local, ip("fd37:fec3:9300:2::10"));
    assert_eq!(t.local_cidr, "fd37:fec3:9300::/48".parse::<IpNet>().unwrap());
    let back = to_peer(&[&p], t.local).unwrap();
    assert_eq!((back.site.as_str(), back.real), ("site-b", ip("fd00:1:0:2::10")));
    // An IPv4 address never matches an IPv6 view, nor the reverse.
    assert!(to_peer(&[&p], ip("fd00:1::10")).is_err());
    let e = to_local(&[&p], "site-b", ip("fd00:9::1")).unwrap_err();
    let e4 = to_local(&[&peering(PeeringState::Negotiated)], "site-b", ip("fd00:1::1")).unwrap_err();
    assert!(
        matches!(&e4, Untranslatable::Precondition(m) if m.contains("site-b offered no IPv6 CIDRs")),
        "{e4:?}"
    );
    assert!(
        matches!(&e, Untranslatable::NotFound(m) if m.contains("IPv6 CIDRs (workload fd00:1::/48)")),
        "{e:?}"
    );
    // A peering that carries no IPv6 says why.
    let mut off = with_ipv6();
    off.views_v6.clear();
    off.ipv6_refused = Some("site-b offered no IPv6 CIDRs".into());
    let e = to_local(&[&off], "site-b", ip("fd00:1::10")).unwrap_err();
    assert!(
        matches!(&e, Untranslatable::Precondition(m) if m.contains("carries no IPv6: site-b offered")),
        "{e:?}"
    );
    assert!(to_peer(&[&off], ip("fd37:fec3:9300::10")).is_err());
}

#[test]
fn untranslatable_addresses_say_why() {
    let p = peering(PeeringState::Negotiated);
    assert!(
        matches!(to_local(&[&p], "site-c", ip("10.1.0.10")), Err(Untranslatable::NotFound(m)) if m.contains("no peering"))
    );
    assert!(
        matches!(to_local(&[&p], "site-b", ip("10.9.0.1")), Err(Untranslatable::NotFound(m)) if m.contains("none of"))
    );
    assert!(matches!(
        to_peer(&[&p], ip("10.1.0.10")),
        Err(Untranslatable::NotFound(_))
    ));
    let pending = peering(PeeringState::Pending);
    assert!(matches!(
        to_local(&[&pending], "site-b", ip("10.1.0.10")),
        Err(Untranslatable::Precondition(_))
    ));
    let mut held = peering(PeeringState::Negotiated);
    held.pending = Some(crate::domain::PendingCidrs {
        workload_cidrs: vec![n("10.9.0.0/16")],
        external_cidr: None,
        received_at_ms: 0,
    });
    assert!(matches!(
        to_local(&[&held], "site-b", ip("10.9.0.1")),
        Err(Untranslatable::Precondition(m)) if m.contains("peering accept")
    ));
}

#[test]
fn learned_names_resolve_to_the_local_view() {
    let p = peering(PeeringState::Negotiated);
    let got: Vec<(String, Ipv4Addr)> = learned(&p)
        .into_iter()
        .map(|l| (l.name.name.clone(), l.local.unwrap()))
        .collect();
    assert_eq!(
        got,
        [("web".into(), a("10.200.0.10")), ("db".into(), a("10.201.255.254"))]
    );
}

#[test]
fn exported_addresses_stay_off_weft_links_and_workloads() {
    let s = site();
    let p = peering(PeeringState::Negotiated);
    let ok = |x: &str| check_own_address(&s, &[&p], NameKind::ExportedHost, a(x));
    assert!(ok("192.168.1.10").is_ok());
    for (bad, says) in [
        ("10.1.0.10", "pod CIDR"),
        ("10.80.0.3", "internal CIDR"),
        ("10.70.0.3", "external CIDR"),
        ("169.254.0.2", "169.254"),
        ("127.0.0.1", "unicast"),
        ("10.200.0.7", "view of site-b"),
    ] {
        let e = ok(bad).unwrap_err();
        assert!(e.contains(says), "{bad}: {e}");
    }
    assert!(check_own_address(&s, &[], NameKind::Workload, a("10.1.0.10")).is_ok());
    assert!(
        check_own_address(&s, &[], NameKind::Workload, a("192.168.1.10"))
            .unwrap_err()
            .contains("--export")
    );
}

#[test]
fn exports_take_the_top_of_the_external_cidr_and_the_ipam_skips_their_twins() {
    let s = site();
    let x = allocate_external(&s, &[]).unwrap();
    assert_eq!(x, a("10.70.255.254"));
    assert_eq!(allocate_external(&s, &[x]).unwrap(), a("10.70.255.253"));
    assert_eq!(internal_twin(&s, x), Some(a("10.80.255.254")));
    let mut tiny = site();
    tiny.external_cidr = n("10.70.0.0/30");
    assert!(
        allocate_external(&tiny, &[a("10.70.0.1"), a("10.70.0.2")])
            .unwrap_err()
            .contains("no free address")
    );
}

#[test]
fn a_peer_names_only_its_own_addresses_and_not_too_many() {
    let w = [n("10.1.0.0/16")];
    let e = Some(n("10.70.0.0/16"));
    let w6: [Ipv6Net; 1] = ["fd00:1::/48".parse().unwrap()];
    let one6 = |name: &str, k: Option<NameKind>, addr: &str, v6: &str| {
        vec![(name.to_string(), k, addr.to_string(), v6.to_string())]
    };
    let one = |name: &str, k: Option<NameKind>, addr: &str| one6(name, k, addr, "");
    assert!(check_remote(&one("web", Some(NameKind::Workload), "10.1.0.10"), &w, e, &w6).is_ok());
    // An IPv6 address in its IPv6 workload CIDRs is kept; one outside
    // them is left out, the name and its IPv4 address kept.
    let kept = check_remote(
        &one6("web", Some(NameKind::Workload), "10.1.0.10", "fd00:1::10"),
        &w,
        e,
        &w6,
    )
    .unwrap();
    assert_eq!(kept[0].address_v6, Some("fd00:1::10".parse().unwrap()));
    let out = check_remote(
        &one6("web", Some(NameKind::Workload), "10.1.0.10", "fd00:2::10"),
        &w,
        e,
        &w6,
    )
    .unwrap();
    assert_eq!((out[0].address, out[0].address_v6), (Some(a("10.1.0.10")), None));
    // An IPv6-only site's workload: its IPv6 address alone, which must
    // be its own; without IPv4 CIDRs only.
    let v6_only = check_remote(&one6("api", Some(NameKind::Workload), "", "fd00:1::20"), &[], None, &w6).unwrap();
    assert_eq!(
        (v6_only[0].address, v6_only[0].address_v6),
        (None, Some("fd00:1::20".parse().unwrap()))
    );
    for (names, w, field) in [
        (
            one6("api", Some(NameKind::Workload), "", "fd00:2::20"),
            &[][..],
            "names[0].address_v6",
        ),
        (one6("api", Some(NameKind::Workload), "", ""), &[][..], "names[0]"),
        (
            one6("api", Some(NameKind::ExportedHost), "", "fd00:1::20"),
            &[][..],
            "names[0].address",
        ),
        (
            one6("api", Some(NameKind::Workload), "", "fd00:1::20"),
            &w[..],
            "names[0].address",
        ),
    ] {
        let e = check_remote(&names, w, None, &w6).unwrap_err();
        assert!(e.starts_with(field), "{names:?}: {e}");
    }
    for (names, field) in [
        (one("web", Some(NameKind::Workload), "10.2.0.10"), "names[0].address"),
        (one("db", Some(NameKind::ExportedHost), "10.1.0.10"), "names[0].address"),
        (one("Web", Some(NameKind::Workload), "10.1.0.10"), "names[0].name"),
        (one("web", None, "10.1.0.10"), "names[0].kind"),
        (one("web", Some(NameKind::Workload), "x"), "names[0].address"),
        (
            one6("web", Some(NameKind::Workload), "10.1.0.10", "10.1.0.10"),
            "names[0].address_v6",
        ),
        (
            one6("web", Some(NameKind::Workload), "10.1.0.10", "fd00:1::/64"),
            "names[0].address_v6",
        ),
        (
            one6("db", Some(NameKind::ExportedHost), "10.70.0.9", "fd00:1::9"),
            "names[0].address_v6",
        ),
    ] {
        let m = check_remote(&names, &w, e, &w6).unwrap_err();
        assert!(m.starts_with(field), "{m}");
    }
    let mut twice = one("web", Some(NameKind::Workload), "10.1.0.10");
    twice.extend(one("web", Some(NameKind::Workload), "10.1.0.11"));
    assert!(check_remote(&twice, &w, e, &w6).unwrap_err().contains("twice"));
    let many: Vec<_> = (0..10_000)
        .map(|i| {
            (
                format!("n{i}"),
                Some(NameKind::Workload),
                "10.1.0.1".to_string(),
                String::new(),
            )
        })
        .collect();
    assert!(
        check_remote(&many, &w, e, &w6)
            .unwrap_err()
            .starts_with("names: 10000 listed")
    );
}
