//! What a peering renders: views routed whole whatever a peer exports,
//! export policies, transit, the tunnel's probe pair and the peers' names.

use super::*;

/// A peer that exports only part of its CIDRs to this site is still
/// routed whole, on nodes and gateways: its workloads outside what it
/// exports may open connections to this site, and the replies must go
/// back (its gateway refuses what it does not export).
#[test]
fn a_peer_that_exports_a_part_is_still_routed_whole() {
    let mut m = model();
    let before = (node(&m, "n1"), gateway(&m, "gw1"));
    let mut p = (*m.peerings["b"]).clone();
    p.remote = Some(crate::domain::RemoteSite {
        external_cidr: Some(n("10.99.0.0/16")),
        mtu: 0,
        ..crate::domain::test_remote("10.1.0.0/16")
    });
    m.peerings.insert("b".into(), Arc::new(p.clone()));
    let all = (node(&m, "n1"), gateway(&m, "gw1"));
    p.remote.as_mut().unwrap().exported = Some(vec![n("10.1.2.0/24")]);
    m.peerings.insert("b".into(), Arc::new(p));
    assert_eq!((node(&m, "n1"), gateway(&m, "gw1")), all);
    assert_eq!(
        before.0, all.0,
        "a node's state does not depend on the peer's parameters"
    );
}

/// An export policy's IPv6 rules go only to a gateway whose agent takes
/// them: an earlier one would refuse the whole filter, leaving the
/// peering's namespace without it. Without them its policy refuses all
/// IPv6 (its last rule drops what none allowed).
#[test]
fn ipv6_export_rules_reach_only_a_gateway_that_takes_them() {
    use crate::export::{ExportPolicy, ExportRule};
    let mut m = model();
    let mut p = (*m.peerings["b"]).clone();
    p.remote = Some(crate::domain::test_remote("10.1.0.0/16"));
    let rule = |c: &str| ExportRule {
        cidr: c.parse().unwrap(),
        protocol: None,
        ports: None,
        via: None,
    };
    p.export = Some(ExportPolicy::Rules(vec![rule("10.0.1.0/24"), rule("fd00:1:0:2::/64")]));
    m.peerings.insert("b".into(), Arc::new(p));
    let exports = |m: &Model| -> (bool, Vec<String>) {
        gateway(m, "gw1")
            .values()
            .find_map(|o| match &o.kind {
                Some(Kind::TunnelFilter(f)) => Some((f.policed, f.exports.iter().map(|r| r.cidr.clone()).collect())),
                _ => None,
            })
            .expect("a tunnel filter")
    };
    assert_eq!(exports(&m), (true, vec!["10.0.1.0/24".to_string()]));
    let mut g = (*m.gateways["gw1"]).clone();
    g.enforces_export_v6 = true;
    m.gateways.insert("gw1".into(), Arc::new(g));
    assert_eq!(
        exports(&m),
        (true, vec!["10.0.1.0/24".to_string(), "fd00:1:0:2::/64".to_string()])
    );
}

/// A spoke routes the sites it reaches through a transit peer into
/// that peering (mapped to the peer's views, allowed from its active
/// gateway); a hub forwards between its transit peers; a direct
/// peering with the same site takes over the same addresses.
#[test]
fn transit_renders_on_spoke_and_hub_and_yields_to_a_direct_peering() {
    use crate::domain::{RemoteGateway, RemoteSite, TransitView};
    let remote = |transit: bool| RemoteSite {
        gateways: vec![RemoteGateway {
            name: "g".into(),
            endpoint: Some("192.168.1.9:51820".parse().unwrap()),
            public_key: Some("YJ9BkYwQ0ezGXyBwJ4cJ5e3xk1y8b7s6tXh2oVw8RkA=".parse().unwrap()),
            active: true,
            candidates: vec![],
            nat: None,
        }],
        transit,
        ..crate::domain::test_remote("10.1.0.0/16")
    };
    let mut m = model();
    let mut b = (*m.peerings["b"]).clone();
    b.remote = Some(remote(true));
    b.transit = true;
    // C's workload as B sees it (10.3/16), as this site sees it (10.4/16).
    b.transit_views = vec![TransitView {
        site: "c".into(),
        view: View {
            kind: CidrKind::Workload,
            real: n("10.3.0.0/16"),
            local: n("10.4.0.0/16"),
            pool: Some(n("10.0.0.0/8")),
        },
    }];
    m.peerings.insert("b".into(), Arc::new(b.clone()));
    let gw = gateway(&m, "gw1");
    let Some(Kind::NatMap(nat)) = &gw["peer/b/transit/c/0/nat"].kind else {
        panic!("no transit NAT: {:?}", gw.keys().collect::<Vec<_>>())
    };
    assert_eq!(
        (nat.real_cidr.as_str(), nat.local_cidr.as_str()),
        ("10.3.0.0/16", "10.4.0.0/16")
    );
    for id in ["via", "rule", "tunnel"] {
        assert!(gw.contains_key(&format!("peer/b/transit/c/0/{id}")), "{id}");
    }
    let Some(Kind::WireguardPeer(wg)) = &gw["peer/b/wgpeer/g"].kind else {
        panic!()
    };
    assert!(
        wg.allowed_ips.contains(&"10.3.0.0/16".to_string()),
        "{:?}",
        wg.allowed_ips
    );
    let Some(Kind::Route(r)) = &node(&m, "n1")["peer/b/transit/c/0/route"].kind else {
        panic!("the node routes the transit view")
    };
    assert_eq!(r.destination, "10.4.0.0/16");
    // The peer does not agree: nothing of it.
    let mut off = b.clone();
    off.remote = Some(remote(false));
    m.peerings.insert("b".into(), Arc::new(off));
    assert!(!gateway(&m, "gw1").keys().any(|k| k.contains("transit")));
    // This site as the hub of b and c: each one's traffic for the
    // other goes back out of its namespace, allowed and counted.
    m.peerings.insert("b".into(), Arc::new(b.clone()));
    let mut c = crate::domain::test_peering("c");
    c.views = vec![View {
        kind: CidrKind::Workload,
        real: n("10.1.0.0/16"),
        local: n("10.4.0.0/16"),
        pool: Some(n("10.0.0.0/8")),
    }];
    c.remote = Some(remote(true));
    c.transit = true;
    c.listen_port = 51821;
    m.peerings.insert("c".into(), Arc::new(c));
    let gw = gateway(&m, "gw1");
    let Some(Kind::TunnelFilter(f)) = &gw["peer/b/filter"].kind else {
        panic!()
    };
    assert_eq!(f.transit.len(), 1);
    assert_eq!(
        (f.transit[0].site.as_str(), f.transit[0].cidrs.clone()),
        ("c", vec!["10.4.0.0/16".to_string()])
    );
    let Some(Kind::Route(back)) = &gw["peer/b/onward/c/0"].kind else {
        panic!()
    };
    assert_eq!((back.destination.as_str(), back.table), ("10.4.0.0/16", 0));
    assert!(gw.contains_key("peer/c/onward/b/0"));
    // ...and c is now a direct peer: b's transit path to it yields.
    assert!(!gw.keys().any(|k| k.starts_with("peer/b/transit/")), "{:?}", gw.keys());
    assert!(!node(&m, "n1").keys().any(|k| k.contains("/transit/")));
}

#[test]
fn each_tunnel_end_gets_its_half_of_the_probe_pair() {
    use crate::domain::{RemoteGateway, RemoteSite, TunnelRole};
    let mut m = model();
    let mut p = (*m.peerings["b"]).clone();
    p.remote = Some(RemoteSite {
        external_cidr: Some(n("10.99.0.0/16")),
        gateways: vec![RemoteGateway {
            name: "gw".into(),
            endpoint: Some("192.0.2.1:51820".parse().unwrap()),
            public_key: Some(crate::domain::WgKey::from_bytes([1; 32])),
            active: true,
            candidates: vec![],
            nat: None,
        }],
        tunnel_role: TunnelRole::Client,
        ..crate::domain::test_remote("10.1.0.0/16")
    });
    m.peerings.insert("b".into(), Arc::new(p));
    let objs = gateway(&m, "gw1");
    let Some(Kind::Link(l)) = &objs["peer/b/wg"].kind else {
        panic!()
    };
    let Some(pb::link::Kind::Wireguard(w)) = &l.kind else {
        panic!()
    };
    assert_eq!(
        (w.address.as_str(), w.peer_address.as_str()),
        ("169.254.255.254/30", "169.254.255.253")
    );
    assert_eq!(w.peer_site, "b");
    let Some(Kind::WireguardPeer(wp)) = &objs["peer/b/wgpeer/gw"].kind else {
        panic!()
    };
    assert!(
        wp.allowed_ips.contains(&"169.254.255.253/32".to_string()),
        "{:?}",
        wp.allowed_ips
    );
    // The veth /30s never take the probe pair's block, and the ports of
    // one range get distinct blocks.
    let mut seen = std::collections::HashSet::new();
    for port in [51820, 16382, 16383, 32765, u16::MAX].into_iter().chain(51821..=51919) {
        let mut m2 = m.clone();
        let mut p = (*m2.peerings["b"]).clone();
        p.listen_port = port;
        m2.peerings.insert("b".into(), Arc::new(p));
        let Some(Kind::Address(a)) = &gateway(&m2, "gw1")["peer/b/veth/outer"].kind else {
            panic!()
        };
        assert!(!a.cidr.starts_with("169.254.255.25"), "{}", a.cidr);
        if port >= 51820 {
            assert!(seen.insert(a.cidr.clone()), "{port}: {} twice", a.cidr);
        }
    }
    assert_eq!(
        tunnel_addresses(TunnelRole::Server).1,
        tunnel_addresses(TunnelRole::Client).0
    );
}

#[test]
fn peers_names_reach_nodes_in_the_local_view_and_exports_reach_gateways() {
    use crate::domain::{RemoteSite, TunnelRole};
    use crate::names::{NameKind, NameRecord, RemoteName};
    let mut m = model();
    let mut p = (*m.peerings["b"]).clone();
    let view = p
        .views
        .iter()
        .find(|v| v.kind == crate::ipam::CidrKind::Workload)
        .unwrap()
        .clone();
    let real = |host: u32| std::net::Ipv4Addr::from(u32::from(view.real.network()) + host);
    p.remote = Some(RemoteSite {
        workload_cidrs: vec![view.real],
        mtu: 0,
        tunnel_role: TunnelRole::Client,
        names: vec![RemoteName {
            name: "web".into(),
            kind: NameKind::Workload,
            address: Some(real(10)),
            address_v6: None,
        }],
        ..crate::domain::test_remote("10.1.0.0/16")
    });
    m.peerings.insert("b".into(), Arc::new(p));
    let Some(Kind::DnsRecord(r)) = &node(&m, "n1")["peer/b/name/web"].kind else {
        panic!("no record")
    };
    let local = std::net::Ipv4Addr::from(u32::from(view.local.network()) + 10);
    assert_eq!(
        (r.site.as_str(), r.name.as_str(), r.address.clone()),
        ("b", "web", local.to_string())
    );
    // Gateways do not resolve names; nodes do not map exports.
    assert!(!gateway(&m, "gw1").keys().any(|k| k.contains("/name/")));
    m.names.insert(
        "db".into(),
        Arc::new(NameRecord {
            name: "db".into(),
            kind: NameKind::ExportedHost,
            address: Some("192.168.7.5".parse().unwrap()),
            external: Some("10.70.255.254".parse().unwrap()),
            address_v6: None,
            created_at_ms: 0,
        }),
    );
    let gw = gateway(&m, "gw1");
    let Some(Kind::ExportMap(x)) = &gw["peer/b/export/db"].kind else {
        panic!("no export map")
    };
    assert_eq!(
        (x.external_address.as_str(), x.host_address.as_str()),
        ("10.70.255.254", "192.168.7.5")
    );
    let Some(Kind::Route(back)) = &gw["peer/b/export/db/route"].kind else {
        panic!("no route")
    };
    assert_eq!(
        (back.namespace.as_str(), back.destination.as_str()),
        (x.namespace.as_str(), "192.168.7.5/32")
    );
    assert!(!node(&m, "n1").keys().any(|k| k.contains("/export/")));
    // The peering gone, its names go with it.
    m.peerings.remove("b");
    assert!(!node(&m, "n1").keys().any(|k| k.contains("/name/")));
}

/// A peer with two workload CIDRs gets both routed, on nodes and on
/// the gateway (each view its own ids).
#[test]
fn every_workload_view_of_a_peer_is_routed() {
    let mut m = model();
    let mut p = (*m.peerings["b"]).clone();
    p.remote = Some(crate::domain::test_remote("10.1.0.0/16"));
    p.views.push(View {
        kind: CidrKind::Workload,
        real: n("10.2.0.0/16"),
        local: n("10.2.0.0/16"),
        pool: None,
    });
    m.peerings.insert("b".into(), Arc::new(p));
    let dsts = |objs: Objects, ns: &str| -> Vec<String> {
        objs.values()
            .filter_map(|o| match &o.kind {
                Some(Kind::Route(r)) if r.namespace.starts_with(ns) => Some(r.destination.clone()),
                _ => None,
            })
            .collect()
    };
    let on_node = dsts(node(&m, "n1"), "");
    let on_gateway = dsts(gateway(&m, "gw1"), "");
    let in_peering = dsts(gateway(&m, "gw1"), "weft-p-");
    for want in ["10.0.0.0/16", "10.2.0.0/16"] {
        assert!(on_node.iter().any(|d| d == want), "{want} on the node: {on_node:?}");
        assert!(
            on_gateway.iter().any(|d| d == want),
            "{want} on the gateway: {on_gateway:?}"
        );
    }
    for want in ["10.1.0.0/16", "10.2.0.0/16"] {
        assert!(
            in_peering.iter().any(|d| d == want),
            "{want} into the tunnel: {in_peering:?}"
        );
    }
    assert!(gateway(&m, "gw1").contains_key("peer/b/workload/nat"));
    assert!(gateway(&m, "gw1").contains_key("peer/b/workload-1/via"));
}

#[test]
fn a_peer_reached_at_its_reflexive_address_from_behind_nat_is_hole_punched() {
    use crate::domain::{RelayVia, RemoteGateway, RemoteSite};
    use crate::nat::{Behaviour, Candidate, CandidateKind};
    let punch = |own_endpoint: bool, peer_endpoint: bool, relayed: bool| {
        let mut m = model();
        let mut gw = (*m.gateways["gw1"]).clone();
        if own_endpoint {
            gw.endpoint = Some("192.0.2.9:51820".parse().unwrap());
        }
        // Its own NAT keeps its ports (a punch from it can work), and it
        // tries one beside a relay.
        gw.punches_beside = true;
        let port = m.peerings["b"].listen_port;
        gw.discovered.insert(
            port,
            crate::nat::Discovered {
                candidates: vec![],
                nat: Some(Behaviour::EndpointIndependent),
            },
        );
        m.gateways.insert("gw1".into(), Arc::new(gw));
        let mut p = (*m.peerings["b"]).clone();
        p.remote = Some(RemoteSite {
            gateways: vec![RemoteGateway {
                name: "gw".into(),
                endpoint: peer_endpoint.then(|| "192.0.2.1:51820".parse().unwrap()),
                public_key: Some(crate::domain::WgKey::from_bytes([1; 32])),
                active: true,
                candidates: vec![Candidate {
                    address: "198.51.100.7:51820".parse().unwrap(),
                    kind: CandidateKind::Reflexive,
                }],
                nat: Some(Behaviour::EndpointIndependent),
            }],
            ..crate::domain::test_remote("10.1.0.0/16")
        });
        p.relay_via = relayed.then(|| RelayVia {
            site: "r".into(),
            endpoint: "203.0.113.5:51920".parse().unwrap(),
            tls_port: 0,
        });
        m.peerings.insert("b".into(), Arc::new(p));
        let Some(Kind::WireguardPeer(wp)) = &gateway(&m, "gw1")["peer/b/wgpeer/gw"].kind else {
            panic!()
        };
        (wp.endpoint.clone(), wp.punch, wp.direct.clone())
    };
    let none = String::new;
    // neither side reachable unasked: punched, at the reflexive address
    assert_eq!(punch(false, false, false), ("198.51.100.7:51820".into(), true, none()));
    // through a relay: to the relay, the punch tried beside it
    assert_eq!(
        punch(false, false, true),
        ("203.0.113.5:51920".into(), false, "198.51.100.7:51820".into())
    );
    // to an endpoint, or from a gateway with one: neither
    assert_eq!(punch(false, true, false), ("192.0.2.1:51820".into(), false, none()));
    assert_eq!(punch(true, false, false), ("198.51.100.7:51820".into(), false, none()));
}

#[test]
fn a_relay_that_takes_tls_is_offered_to_the_tunnels_that_reach_it() {
    use crate::domain::{RelayVia, RemoteGateway, RemoteSite};
    // (the peer relays with a TLS port, its gateway has an endpoint,
    // relayed through a relay with a TLS port) -> the peer's TLS port
    let tls = |peer_tls: u16, peer_endpoint: bool, relay_tls: Option<u16>| {
        let mut m = model();
        let mut p = (*m.peerings["b"]).clone();
        p.remote = Some(RemoteSite {
            gateways: vec![RemoteGateway {
                name: "gw".into(),
                endpoint: peer_endpoint.then(|| "192.0.2.1:51820".parse().unwrap()),
                public_key: Some(crate::domain::WgKey::from_bytes([1; 32])),
                active: true,
                candidates: vec![],
                nat: None,
            }],
            relay: peer_tls > 0,
            relay_tls_port: peer_tls,
            ..crate::domain::test_remote("10.1.0.0/16")
        });
        p.relay_via = relay_tls.map(|tls_port| RelayVia {
            site: "r".into(),
            endpoint: "203.0.113.5:51920".parse().unwrap(),
            tls_port,
        });
        m.peerings.insert("b".into(), Arc::new(p));
        let Some(Kind::WireguardPeer(wp)) = &gateway(&m, "gw1")["peer/b/wgpeer/gw"].kind else {
            panic!()
        };
        (wp.endpoint.clone(), wp.tls_port)
    };
    // the relay site itself, at its gateway's endpoint
    assert_eq!(tls(443, true, None), ("192.0.2.1:51820".into(), 443));
    // a site that offers none, or a peer without an endpoint: UDP only
    assert_eq!(tls(0, true, None), ("192.0.2.1:51820".into(), 0));
    assert_eq!(tls(443, false, None), (String::new(), 0));
    // relayed: the relay's port, at the relay's address
    assert_eq!(tls(0, false, Some(443)), ("203.0.113.5:51920".into(), 443));
    assert_eq!(tls(0, false, Some(0)), ("203.0.113.5:51920".into(), 0));
}
