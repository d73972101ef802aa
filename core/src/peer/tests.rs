use weft_proto::v1 as pb;

#[test]
fn a_tunnel_with_a_direct_path_asks_no_relay() {
    use crate::relay::tests::{KEY_B, peering};
    let mut p = peering("b", false, &[], KEY_B);
    assert!(super::wants_relay(&p, &[]));
    assert_eq!(super::tunnel_path(&p, &[], false, false), "waiting");
    p.relay_via = Some(crate::domain::RelayVia {
        site: "r".into(),
        endpoint: "192.0.2.5:51920".parse().unwrap(),
        tls_port: 0,
    });
    assert_eq!(super::tunnel_path(&p, &[], true, false), "relayed via r");
    p.remote.as_mut().unwrap().gateways[0].endpoint = Some("192.0.2.9:51820".parse().unwrap());
    assert!(!super::wants_relay(&p, &[]));
    assert_eq!(
        super::tunnel_path(&p, &[], true, false),
        "direct",
        "a direct path wins over a recorded relay"
    );
}

#[test]
fn a_peers_controller_endpoints_are_checked_before_they_are_dialled() {
    use super::controller_endpoint;
    for good in ["192.0.2.7:7443", "ctl.site-b.example:7443", "[2001:db8::1]:7443"] {
        assert_eq!(controller_endpoint(good, false), Ok(()), "{good}");
    }
    for bad in [
        "127.0.0.1:2379",
        "[::1]:7443",
        "0.0.0.0:7443",
        "169.254.169.254:80",
        "224.0.0.1:7443",
        "localhost:7443",
        "192.0.2.7",
        "192.0.2.7:0",
        "a b:7443",
        "ctl:7443\nx",
    ] {
        assert!(controller_endpoint(bad, false).is_err(), "{bad}");
    }
    assert_eq!(controller_endpoint("127.0.0.1:7443", true), Ok(()), "a lab on one host");
    assert!(controller_endpoint("169.254.169.254:80", true).is_err());
}

#[test]
fn a_peers_readiness_names_a_gateway_or_none() {
    use super::readiness;
    let r = |name: &str| {
        readiness(&pb::PeerReadiness {
            routes_applied: true,
            active_gateway: name.into(),
        })
    };
    assert_eq!(r("gw-2").map(|x| x.active_gateway), Ok("gw-2".to_string()));
    assert_eq!(r("").map(|x| x.active_gateway), Ok(String::new()), "none yet");
    for bad in ["GW", "gw/../x", "a b", &"g".repeat(64)] {
        let e = r(bad).unwrap_err();
        assert!(e.starts_with("readiness.active_gateway"), "{bad}: {e}");
    }
}

#[test]
fn the_lower_configured_tunnel_mtu_wins_and_none_means_derive() {
    use super::agreed_mtu;
    assert_eq!(agreed_mtu(0, 0), 0);
    assert_eq!(agreed_mtu(1380, 0), 1380);
    assert_eq!(agreed_mtu(0, 1400), 1400);
    assert_eq!(agreed_mtu(1400, 1300), 1300);
    assert_eq!(agreed_mtu(500, 0), 1280, "never below IPv6's minimum");
}

fn params(site: &str, workload: &[&str], gateway_endpoint: &str, endpoints: &[&str]) -> pb::NetworkParams {
    pb::NetworkParams {
        site_id: site.into(),
        workload_cidrs: workload.iter().map(|c| c.to_string()).collect(),
        external_cidr: String::new(),
        gateways: vec![pb::GatewayInfo {
            name: "gw".into(),
            endpoint: gateway_endpoint.into(),
            public_key: String::new(),
            active: true,
            ..Default::default()
        }],
        mtu: 0,
        endpoints: endpoints.iter().map(|e| e.to_string()).collect(),
        names: vec![],
        ..Default::default()
    }
}

fn refused(p: &pb::NetworkParams, own: &pb::NetworkParams) -> String {
    super::remote_site("pem", "fp", p, own).expect_err("refused")
}

#[test]
fn bad_ipv6_fields_cost_the_peer_its_ipv6_only() {
    let own = params("site-a", &["10.1.0.0/16"], "", &["192.0.2.1:7443"]);
    let mut p = params("site-b", &["10.2.0.0/16"], "198.51.100.7:51820", &["198.51.100.2:7443"]);
    p.workload_cidrs_v6 = vec!["FD00:2::/48".into()];
    p.external_cidr_v6 = "fd00:72::/64".into();
    let r = super::remote_site("pem", "fp", &p, &own).unwrap();
    assert_eq!(r.workload_cidrs_v6, vec!["fd00:2::/48".parse().unwrap()]);
    assert_eq!(r.external_cidr_v6, Some("fd00:72::/64".parse().unwrap()));
    assert_eq!(r.ipv6_invalid, None);
    for (bad, says) in [
        (
            vec!["fd00:2::1/48"],
            "workload_cidrs_v6[0]: \"fd00:2::1/48\" has host bits set",
        ),
        (vec!["10.9.0.0/16"], "workload_cidrs_v6[0]: 10.9.0.0/16 is IPv4"),
        (vec!["fd00:2::/48"; 40], "workload_cidrs_v6: 40 listed"),
    ] {
        p.workload_cidrs_v6 = bad.iter().map(|c| c.to_string()).collect();
        let r = super::remote_site("pem", "fp", &p, &own).unwrap();
        assert_eq!(r.workload_cidrs, vec!["10.2.0.0/16".parse().unwrap()], "IPv4 stands");
        assert!(r.workload_cidrs_v6.is_empty());
        let why = r.ipv6_invalid.unwrap();
        assert!(why.starts_with(says), "{why}");
    }
}

#[test]
fn a_well_formed_peer_is_recorded_with_what_both_sides_agree_on() {
    use crate::domain::TunnelRole;
    let own = params("site-a", &["10.1.0.0/16"], "", &["192.0.2.1:7443"]);
    let mut p = params("site-b", &["10.2.0.0/16"], "198.51.100.7:51820", &["198.51.100.2:7443"]);
    p.mtu = 1400;
    p.external_cidr = "10.72.0.0/16".into();
    let r = super::remote_site("pem", "fp", &p, &own).unwrap();
    assert_eq!(r.workload_cidrs, vec!["10.2.0.0/16".parse().unwrap()]);
    assert_eq!(r.external_cidr, Some("10.72.0.0/16".parse().unwrap()));
    assert_eq!(r.gateways[0].endpoint, Some("198.51.100.7:51820".parse().unwrap()));
    assert_eq!((r.mtu, r.ca_fingerprint.as_str()), (1400, "fp"));
    // Only the peer's gateway is reachable: it serves, this site dials.
    assert_eq!(r.tunnel_role, TunnelRole::Client);
}

#[test]
fn each_bad_field_of_a_peer_is_named() {
    let own = params("site-a", &["10.1.0.0/16"], "", &["192.0.2.1:7443"]);
    let good = params("site-b", &["10.2.0.0/16"], "", &["198.51.100.2:7443"]);
    type Spoil = Box<dyn Fn(&mut pb::NetworkParams)>;
    let cases: Vec<(Spoil, &str)> = vec![
        (
            Box::new(|p| p.workload_cidrs = vec!["10.2.0.1/16".into()]),
            "workload_cidrs[0]",
        ),
        (Box::new(|p| p.external_cidr = "300.0.0.0/8".into()), "external_cidr"),
        (
            Box::new(|p| p.gateways[0].endpoint = "198.51.100.7".into()),
            "gateways[0].endpoint",
        ),
        (
            Box::new(|p| p.gateways[0].public_key = "AAAA".into()),
            "gateways[0].public_key",
        ),
        (Box::new(|p| p.gateways[0].name = "GW!".into()), "gateways[0].name"),
        (Box::new(|p| p.gateways = vec![p.gateways[0].clone(); 17]), "at most 16"),
        (Box::new(|p| p.mtu = 200), "mtu: 200 is out of range"),
        (
            Box::new(|p| p.endpoints = vec!["127.0.0.1:7443".into()]),
            "endpoints[0]",
        ),
        (
            Box::new(|p| p.endpoints = vec!["198.51.100.2:7443".into(); 17]),
            "at most 16 controller endpoints",
        ),
        (
            Box::new(|p| {
                p.names = vec![pb::PublishedName {
                    name: "db".into(),
                    kind: pb::NameKind::Workload as i32,
                    address: "10.9.0.1".into(),
                    address_v6: String::new(),
                }]
            }),
            "names[0]",
        ),
    ];
    for (spoil, says) in cases {
        let mut p = good.clone();
        spoil(&mut p);
        let m = refused(&p, &own);
        assert!(m.contains(says), "expected {says:?} in {m:?}");
    }
    assert!(super::remote_site("pem", "fp", &good, &own).is_ok());
}

#[test]
fn loopback_controllers_only_between_sites_both_on_loopback() {
    let peer = params("site-b", &["10.2.0.0/16"], "", &["127.0.0.1:7444"]);
    let lab = params("site-a", &["10.1.0.0/16"], "", &["127.0.0.1:7443"]);
    assert!(super::remote_site("pem", "fp", &peer, &lab).is_ok());
    let real = params("site-a", &["10.1.0.0/16"], "", &["192.0.2.1:7443"]);
    assert!(refused(&peer, &real).contains("endpoints[0]"));
}

#[test]
fn a_peer_is_dialled_at_its_endpoint_or_where_its_nat_lets_both_sides_in() {
    use super::{dial_address, path};
    let reflexive = crate::nat::Candidate {
        address: "198.51.100.1:51820".parse().unwrap(),
        kind: crate::nat::CandidateKind::Reflexive,
    };
    let mut g = crate::domain::RemoteGateway {
        name: "gw".into(),
        endpoint: None,
        public_key: None,
        active: true,
        candidates: vec![reflexive],
        nat: Some(crate::nat::Behaviour::EndpointIndependent),
    };
    assert_eq!(dial_address(&g), Some("198.51.100.1:51820".parse().unwrap()));
    assert_eq!(
        path(false, Some(&g), Some(crate::nat::Behaviour::EndpointIndependent)),
        "hole-punched"
    );
    assert_eq!(
        path(false, Some(&g), Some(crate::nat::Behaviour::EndpointDependent)),
        "waiting"
    );
    g.nat = Some(crate::nat::Behaviour::EndpointDependent);
    assert_eq!(dial_address(&g), None);
    assert_eq!(
        path(false, Some(&g), Some(crate::nat::Behaviour::EndpointIndependent)),
        "waiting"
    );
    assert_eq!(path(true, Some(&g), None), "direct");
    g.endpoint = Some("203.0.113.9:51820".parse().unwrap());
    assert_eq!(dial_address(&g), Some("203.0.113.9:51820".parse().unwrap()));
    assert_eq!(path(false, Some(&g), None), "direct");
    assert_eq!(path(false, None, None), "waiting");
}

#[test]
fn a_relay_tls_port_is_taken_from_a_relay_only_and_must_be_a_port() {
    let own = params("site-a", &["10.1.0.0/16"], "", &["192.0.2.1:7443"]);
    let mut p = params("site-b", &["10.2.0.0/16"], "198.51.100.7:51820", &["198.51.100.2:7443"]);
    p.relay_tls_port = 443;
    // A site that does not relay offers nothing over TLS.
    assert_eq!(super::remote_site("pem", "fp", &p, &own).unwrap().relay_tls_port, 0);
    p.relay = true;
    assert_eq!(super::remote_site("pem", "fp", &p, &own).unwrap().relay_tls_port, 443);
    p.relay_tls_port = 70_000;
    assert!(refused(&p, &own).contains("relay_tls_port: 70000 is not a TCP port"));
}

#[test]
fn both_sides_punch_in_the_same_family() {
    use super::{Families, dial_address_for};
    use crate::nat::{Behaviour, Candidate, CandidateKind};
    let c = |a: &str| Candidate {
        address: a.parse().unwrap(),
        kind: CandidateKind::Reflexive,
    };
    let gw = |cands: Vec<Candidate>| crate::domain::RemoteGateway {
        name: "gw".into(),
        endpoint: None,
        public_key: None,
        active: true,
        candidates: cands,
        nat: Some(Behaviour::EndpointIndependent),
    };
    let dual = gw(vec![c("[2001:db8::20]:51820"), c("198.51.100.1:51820")]);
    let v6 = gw(vec![c("[2001:db8::30]:51820")]);
    let (both, only6) = (Families::BOTH, Families { v4: false, v6: true });
    // Both dual stack: IPv4 on both sides, whatever the order listed.
    assert_eq!(
        dial_address_for(&dual, both),
        Some("198.51.100.1:51820".parse().unwrap())
    );
    // A dual-stack side and an IPv6-only one: IPv6 on both.
    assert_eq!(
        dial_address_for(&v6, both),
        Some("[2001:db8::30]:51820".parse().unwrap())
    );
    assert_eq!(
        dial_address_for(&dual, only6),
        Some("[2001:db8::20]:51820".parse().unwrap())
    );
    // An IPv4-only side never dials IPv6.
    assert_eq!(dial_address_for(&v6, Families { v4: true, v6: false }), None);
    assert_eq!(Families::of(Vec::new()), Families::BOTH);
    assert_eq!(
        Families::of(["192.0.2.1".parse().unwrap()]),
        Families { v4: true, v6: false }
    );
}
