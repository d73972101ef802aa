use super::*;

const KEY: &str = "hT7XTB7qgr4m+5V8gqhnNtjvNrqSqPFiCjPsXl1Oc0Q=";

fn obj(kind: Kind) -> pb::DesiredObject {
    pb::DesiredObject {
        id: "x".into(),
        kind: Some(kind),
    }
}

fn session() -> pb::RelaySession {
    let side = |site: &str, port| pb::RelaySide {
        site: site.into(),
        port,
        to_keys: vec![KEY.into()],
        from_ips: vec!["198.51.100.7".into()],
    };
    pb::RelaySession {
        a: Some(side("site-a", 51920)),
        b: Some(side("site-b", 51921)),
        bytes_per_second: 1_000_000,
    }
}

#[test]
fn a_relay_session_from_the_controller_is_checked_before_anything_binds() {
    let r = relay_session(&session()).unwrap();
    assert_eq!((r.spec.a.port, r.spec.b.port), (51920, 51921));
    assert_eq!(
        r.spec.a.from_ips,
        [std::net::IpAddr::V4(Ipv4Addr::new(198, 51, 100, 7))]
    );
    assert_eq!(r.sites, ("site-a".to_string(), "site-b".to_string()));
    type Spoil = fn(&mut pb::RelaySession);
    let bad: [(&str, Spoil); 10] = [
        ("port 53", |s| s.a.as_mut().unwrap().port = 53),
        ("port 70000", |s| s.b.as_mut().unwrap().port = 70_000),
        ("share port", |s| s.b.as_mut().unwrap().port = 51920),
        ("not a 32-byte", |s| s.a.as_mut().unwrap().to_keys = vec!["AAAA".into()]),
        ("lists 0 keys", |s| s.a.as_mut().unwrap().to_keys.clear()),
        ("::1 is not a unicast address", |s| {
            s.b.as_mut().unwrap().from_ips = vec!["::1".into()]
        }),
        ("ff02::1 is not a unicast address", |s| {
            s.b.as_mut().unwrap().from_ips = vec!["2001:db8::1".into(), "ff02::1".into()]
        }),
        ("is not an address", |s| {
            s.b.as_mut().unwrap().from_ips = vec!["x".into()]
        }),
        ("0 bytes", |s| s.bytes_per_second = 0),
        ("site", |s| s.a.as_mut().unwrap().site = "Site A".into()),
    ];
    for (why, spoil) in bad {
        let mut s = session();
        spoil(&mut s);
        let e = relay_session(&s).unwrap_err();
        assert!(e.contains(why), "{why}: {e}");
    }
    let mut s = session();
    s.a = None;
    assert!(relay_session(&s).unwrap_err().contains("missing"));
    // IPv6 sides, and IPv4-mapped ones as IPv4.
    let mut s = session();
    s.b.as_mut().unwrap().from_ips = vec!["2001:db8::7".into(), "::ffff:198.51.100.8".into()];
    let r = relay_session(&s).unwrap();
    assert_eq!(
        r.spec.b.from_ips,
        [
            "2001:db8::7".parse::<std::net::IpAddr>().unwrap(),
            "198.51.100.8".parse().unwrap()
        ]
    );
}

#[test]
fn a_dns_record_is_a_label_under_a_site_with_unicast_addresses() {
    let rec = |name: &str, site: &str, a: &str, v6: &str| {
        dns_record(&pb::DnsRecord {
            name: name.into(),
            site: site.into(),
            address: a.into(),
            address_v6: v6.into(),
        })
    };
    let r = rec("web", "site-b", "10.200.0.10", "fd9a:0:100::10").unwrap();
    assert_eq!(
        (r.v4, r.v6),
        (
            Some(Ipv4Addr::new(10, 200, 0, 10)),
            Some("fd9a:0:100::10".parse().unwrap())
        )
    );
    // An IPv6-only site's name: no IPv4 address.
    assert_eq!(rec("v6", "b.c", "", "fd9a:0:100::20").unwrap().v4, None);
    for (bad, why) in [
        (rec("Bad_Name", "site-b", "10.0.0.1", ""), "not a DNS label"),
        (rec("web", "site b", "10.0.0.1", ""), "not a site id"),
        (rec("lo", "site-b", "127.0.0.1", ""), "not a unicast address"),
        (rec("web", "site-b", "", ""), "DNS record address"),
        (
            rec("web", "site-b", "10.0.0.1", "ff02::1"),
            "not a unicast address of a site",
        ),
    ] {
        assert!(bad.as_ref().unwrap_err().contains(why), "{why}: {bad:?}");
    }
}

/// Every field that names something of the host is weft's, parses as what
/// it is and is in range; one bad field refuses the object, with the field
/// named.
#[test]
fn each_field_is_parsed_and_bounded_once_at_the_door() {
    let wg = |address: &str, peer: &str, port: u32, reflectors: Vec<String>| {
        obj(Kind::Link(pb::Link {
            name: "weft-wabc".into(),
            namespace: "weft-p-a".into(),
            mtu: 0,
            kind: Some(pb::link::Kind::Wireguard(pb::Wireguard {
                listen_port: port,
                address: address.into(),
                peer_address: peer.into(),
                peer_site: "site-b".into(),
                reflectors,
            })),
        }))
    };
    let Object::Link(l) = decode(&wg("169.254.255.253/30", "169.254.255.254", 51820, vec![])).unwrap() else {
        panic!()
    };
    let LinkSpec::Wireguard(w) = l.kind else { panic!() };
    assert_eq!(w.listen_port, 51820);
    assert_eq!(
        w.probe,
        ("169.254.255.253/30".parse().unwrap(), Ipv4Addr::new(169, 254, 255, 254))
    );
    let route = |ns: &str, dst: &str, gateway: &str, device: &str, site: &str| {
        obj(Kind::Route(pb::Route {
            namespace: ns.into(),
            table: 0,
            destination: dst.into(),
            gateway: gateway.into(),
            device: device.into(),
            peer_site: site.into(),
        }))
    };
    let Object::Route(r) = decode(&route("", "10.2.0.0/16", "10.80.0.1", "weft-vx0", "b")).unwrap() else {
        panic!()
    };
    assert_eq!(
        (r.route.table, r.peer_site.as_deref()),
        (254, Some("b")),
        "table 0 is main"
    );
    let bad = [
        (wg("169.254.255.253/30", "169.254.255.254", 0, vec![]), "listen port 0"),
        (wg("169.254.255.253/30", "", 51820, vec![]), "tunnel peer address"),
        (wg("", "", 51820, vec![]), "tunnel address"),
        (
            wg(
                "169.254.255.253/30",
                "169.254.255.254",
                51820,
                vec!["a:1\nprivate_key=x".into()],
            ),
            "reflector",
        ),
        (
            wg("169.254.255.253/30", "169.254.255.254", 51820, vec!["r:1".into(); 9]),
            "9 reflectors",
        ),
        (route("", "10.2.0.0/16", "fd00::1", "weft-vx0", ""), "of another family"),
        (route("", "fd00::/64", "fe80::1", "", ""), "names no device"),
        (route("", "10.2.0.0/16", "", "", ""), "needs a gateway or a device"),
        (route("", "10.2.0.0/16", "", "eth0", ""), "not one of weft's links"),
        (
            route("weft-p-a", "10.2.0.0/16", "", "weft-i0", "b"),
            "views are routed in the host's namespace",
        ),
        (
            route("../../proc", "10.2.0.0/16", "", "weft-i0", ""),
            "not one of weft's namespaces",
        ),
        (
            obj(Kind::NatMap(pb::NatMap {
                namespace: "weft-p-a".into(),
                local_cidr: "10.200.0.0/16".into(),
                real_cidr: "10.1.0.0/24".into(),
                tunnel: "weft-wabc".into(),
            })),
            "one family and length",
        ),
        (
            obj(Kind::WireguardPeer(pb::WireguardPeer {
                link: "weft-wabc".into(),
                namespace: "weft-p-a".into(),
                public_key: KEY.into(),
                endpoint: String::new(),
                allowed_ips: vec![],
                persistent_keepalive: 70_000,
                punch: false,
                direct: String::new(),
                tls_port: 0,
            })),
            "keepalive 70000",
        ),
        (
            obj(Kind::Link(pb::Link {
                name: "weft-vx0".into(),
                namespace: String::new(),
                mtu: 100,
                kind: Some(pb::link::Kind::Bridge(pb::Bridge {})),
            })),
            "MTU 100",
        ),
        (
            pb::DesiredObject {
                id: "x".into(),
                kind: None,
            },
            "no kind",
        ),
    ];
    for (o, why) in bad {
        let e = decode(&o).expect_err(why);
        assert!(e.contains(why), "{why}: {e}");
    }
}

#[test]
fn a_punched_peer_keeps_the_flag_only_with_an_endpoint_and_equals_the_same_peer_without() {
    let peer = |endpoint: &str, punch: bool| {
        let o = decode(&obj(Kind::WireguardPeer(pb::WireguardPeer {
            link: "weft-wabc".into(),
            namespace: "weft-p-a".into(),
            public_key: KEY.into(),
            endpoint: endpoint.into(),
            allowed_ips: vec!["10.1.0.0/16".into()],
            persistent_keepalive: 25,
            punch,
            tls_port: 0,
            direct: String::new(),
        })))
        .unwrap();
        let Object::WireguardPeer { peer, .. } = o else {
            panic!()
        };
        peer
    };
    let punched = peer("198.51.100.7:51820", true);
    assert!(punched.punch);
    assert!(!peer("", true).punch, "nothing to punch without an endpoint");
    // how an endpoint is first tried is no state to converge on: kernel
    // WireGuard reports no such thing
    assert_eq!(punched, peer("198.51.100.7:51820", false));
}

#[test]
fn a_tls_port_needs_an_endpoint_and_a_tcp_port() {
    let peer = |endpoint: &str, tls_port: u32| {
        decode(&obj(Kind::WireguardPeer(pb::WireguardPeer {
            link: "weft-wabc".into(),
            namespace: "weft-p-a".into(),
            public_key: KEY.into(),
            endpoint: endpoint.into(),
            allowed_ips: vec![],
            persistent_keepalive: 25,
            punch: false,
            direct: String::new(),
            tls_port,
        })))
    };
    let Ok(Object::WireguardPeer { tls_port, .. }) = peer("198.51.100.7:51920", 443) else {
        panic!()
    };
    assert_eq!(tls_port, Some(443));
    let Ok(Object::WireguardPeer { tls_port, .. }) = peer("198.51.100.7:51920", 0) else {
        panic!()
    };
    assert_eq!(tls_port, None, "0: UDP only");
    let e = peer("", 443).unwrap_err();
    assert!(e.contains("without an endpoint"), "{e}");
    let e = peer("198.51.100.7:51920", 70_000).unwrap_err();
    assert!(e.contains("70000 is not a TCP port"), "{e}");
    for port in [0, 65_536] {
        let e = decode(&obj(Kind::RelayTls(pb::RelayTls {
            port,
            own_port_shift: 0,
        })))
        .unwrap_err();
        assert!(e.contains("not a TCP port"), "{port}: {e}");
    }
    let e = decode(&obj(Kind::RelayTls(pb::RelayTls {
        port: 443,
        own_port_shift: 70_000,
    })))
    .unwrap_err();
    assert!(e.contains("out of range"), "{e}");
    assert_eq!(
        decode(&obj(Kind::RelayTls(pb::RelayTls {
            port: 443,
            own_port_shift: -11_820,
        })))
        .unwrap(),
        Object::RelayTls {
            port: 443,
            shift: -11_820
        }
    );
}

#[test]
fn a_direct_address_beside_a_relay_is_a_unicast_address_beside_an_endpoint() {
    let peer = |endpoint: &str, direct: &str| {
        decode(&obj(Kind::WireguardPeer(pb::WireguardPeer {
            link: "weft-wabc".into(),
            namespace: "weft-p-a".into(),
            public_key: KEY.into(),
            endpoint: endpoint.into(),
            allowed_ips: vec![],
            persistent_keepalive: 25,
            punch: false,
            direct: direct.into(),
            tls_port: 0,
        })))
    };
    let Ok(Object::WireguardPeer { peer: p, .. }) = peer("198.51.100.7:51920", "[::ffff:203.0.113.5]:51820") else {
        panic!()
    };
    assert_eq!(p.direct, Some("203.0.113.5:51820".parse().unwrap()), "IPv4 as IPv4");
    // Kernel WireGuard keeps the relay only.
    let k = p.without_beside();
    assert_eq!((k.endpoint, k.punch, k.direct), (p.endpoint, false, None));
    for (endpoint, direct, why) in [
        ("", "203.0.113.5:51820", "beside no endpoint"),
        ("198.51.100.7:51920", "127.0.0.1:51820", "not a unicast"),
        ("198.51.100.7:51920", "[ff02::1]:51820", "not a unicast"),
        ("198.51.100.7:51920", "203.0.113.5", "direct address"),
    ] {
        let e = peer(endpoint, direct).expect_err(why);
        assert!(e.contains(why), "{why}: {e}");
    }
}
