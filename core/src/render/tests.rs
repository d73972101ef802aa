use super::*;
use crate::domain::{PeeringState, SubnetSource};
use crate::ipam::{CidrKind, View};

fn n(s: &str) -> ipnet::Ipv4Net {
    s.parse().unwrap()
}

pub(crate) fn model() -> Model {
    let site = crate::domain::test_site("a", "10.0.0.0/8");
    let node = |name: &str, i: u8| Node {
        subnet_v6: None,
        name: name.into(),
        subnet: Some(n(&format!("10.1.{i}.0/24"))),
        source: SubnetSource::Allocated,
        created_at_ms: 0,
        certs: vec![],
        internal_ip: Some(Ipv4Addr::new(10, 80, 0, i)),
        underlay_ip: Some(IpAddr::V4(Ipv4Addr::new(192, 168, 1, i))),
        geneve: false,
        identity_conflict: None,
        enrolled_at_ms: 0,
    };
    let gw = Gateway {
        name: "gw1".into(),
        endpoint: None,
        public_key: None,
        created_at_ms: 0,
        certs: vec![],
        internal_ip: Some(Ipv4Addr::new(10, 80, 0, 100)),
        underlay_ip: Some(IpAddr::V4(Ipv4Addr::new(192, 168, 1, 100))),
        geneve: false,
        identity_conflict: None,
        enrolled_at_ms: 0,
        pending_public_key: None,
        key_from_enrollment: false,
        discovered: Default::default(),
        enforces_export: false,
        enforces_export_v6: false,
    };
    let peering = Peering {
        site_id: "b".into(),
        state: PeeringState::Negotiated,
        views: vec![
            View {
                kind: CidrKind::Workload,
                real: n("10.1.0.0/16"),
                local: n("10.0.0.0/16"),
                pool: Some(n("10.0.0.0/8")),
            },
            View {
                kind: CidrKind::External,
                real: n("10.99.0.0/16"),
                local: n("10.99.0.0/16"),
                pool: None,
            },
        ],
        created_at_ms: 0,
        ..crate::domain::test_peering("")
    };
    let mut m = Model {
        revision: 7,
        site: Some(Arc::new(site)),
        ..Default::default()
    };
    m.nodes.insert("n1".into(), Arc::new(node("n1", 1)));
    m.nodes.insert("n2".into(), Arc::new(node("n2", 2)));
    m.gateways.insert("gw1".into(), Arc::new(gw));
    m.peerings.insert("b".into(), Arc::new(peering));
    m
}

#[test]
fn node_gets_overlay_to_the_gateway_and_routes_to_peer_views() {
    let objs = node(&model(), "n1");
    let ids: Vec<&str> = objs.keys().map(String::as_str).collect();
    assert_eq!(
        ids,
        [
            "peer/b/external/route",
            "peer/b/external/rule",
            "peer/b/workload/route",
            "peer/b/workload/rule",
            "self/addr",
            "self/host-snat",
            "self/link",
            "self/route/internal",
            "self/rule/internal"
        ]
    );
    // The overlay address comes without a prefix route in the host's
    // main table; its network is routed in weft's table instead.
    let Some(Kind::Address(a)) = &objs["self/addr"].kind else {
        panic!()
    };
    assert!(a.no_prefix_route);
    let Some(Kind::Route(r)) = &objs["self/route/internal"].kind else {
        panic!()
    };
    assert_eq!(
        (r.destination.as_str(), r.device.as_str(), r.table),
        ("10.80.0.0/16", NODE_LINK, TABLE)
    );
    let Some(Kind::Link(l)) = &objs["self/link"].kind else {
        panic!()
    };
    let Some(pb::link::Kind::Vxlan(v)) = &l.kind else {
        panic!()
    };
    assert_eq!(
        (v.vni, v.local.as_str(), v.remote.as_str()),
        (0x50_0001 & 0xff_ffff, "192.168.1.1", "192.168.1.100")
    );
    let Some(Kind::Route(r)) = &objs["peer/b/workload/route"].kind else {
        panic!()
    };
    assert_eq!(
        (r.destination.as_str(), r.gateway.as_str(), r.table),
        ("10.0.0.0/16", "10.80.0.100", TABLE)
    );
}

/// A node's state is its own part and the shared part, apart: the
/// shared part is the same for every node, and nothing of it is a
/// node's own.
#[test]
fn a_nodes_state_is_its_own_part_and_the_shared_part() {
    let mut m = model();
    let mut n2 = (*m.nodes["n1"]).clone();
    n2.name = "n2".into();
    n2.internal_ip = Some(Ipv4Addr::new(10, 80, 0, 2));
    m.nodes.insert("n2".into(), Arc::new(n2));
    let shared = node_shared(&m);
    assert!(!shared.is_empty());
    assert!(shared.keys().all(|id| id.starts_with("peer/")));
    for name in ["n1", "n2"] {
        let own = node_own(&m, name).unwrap();
        assert!(own.keys().all(|id| id.starts_with("self/")));
        let mut both = own.clone();
        both.extend(shared.clone());
        assert_eq!(both, node(&m, name));
    }
    assert_ne!(node_own(&m, "n1"), node_own(&m, "n2"));
    // A node that gets nothing gets nothing shared either.
    assert_eq!(node_own(&m, "nobody"), None);
    assert!(node(&m, "nobody").is_empty());
    m.gateways.clear();
    assert_eq!(node_own(&m, "n1"), None);
    assert!(node_shared(&m).is_empty());
}

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
        ca_pem: String::new(),
        ca_fingerprint: String::new(),
        workload_cidrs: vec![n("10.1.0.0/16")],
        external_cidr: Some(n("10.99.0.0/16")),
        gateways: vec![],
        mtu: 0,
        endpoints: vec![],
        tunnel_role: crate::domain::TunnelRole::Server,
        names: vec![],
        relay: false,
        relay_for: vec![],
        relays: vec![],
        exported: None,
        exported_v6: vec![],
        transit: false,
        transit_routes: vec![],
        readiness: None,
        workload_cidrs_v6: vec![],
        external_cidr_v6: None,
        ipv6_invalid: None,
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
fn only_the_active_gateway_holds_the_lan_address() {
    let mut m = model();
    let mut standby = (*m.gateways["gw1"]).clone();
    standby.name = "gw2".into();
    m.gateways.insert("gw2".into(), Arc::new(standby));
    m.active_gateway = Some("gw1".into());
    assert!(gateway(&m, "gw1").contains_key("self/lan-address"));
    assert!(!gateway(&m, "gw2").contains_key("self/lan-address"));
    m.active_gateway = Some("gw2".into());
    assert!(!gateway(&m, "gw1").contains_key("self/lan-address"));
    assert!(gateway(&m, "gw2").contains_key("self/lan-address"));
}

#[test]
fn gateway_gets_a_tunnel_per_node_and_nat_for_remapped_views_only() {
    let m = model();
    let objs = gateway(&m, "gw1");
    assert!(objs.contains_key("node/n1/link") && objs.contains_key("node/n2/route"));
    assert!(objs.contains_key("peer/b/workload/nat"));
    assert!(
        !objs.contains_key("peer/b/external/nat"),
        "an unmapped view needs no NAT"
    );
    let Some(Kind::Link(l)) = &objs["node/n2/link"].kind else {
        panic!()
    };
    assert!(l.name.len() <= 15 && l.name.starts_with("weft"));
    // nodes without a gateway get nothing yet
    let mut m2 = m.clone();
    m2.gateways.clear();
    assert!(node(&m2, "n1").is_empty());
}

#[test]
fn each_tunnel_end_gets_its_half_of_the_probe_pair() {
    use crate::domain::{RemoteGateway, RemoteSite, TunnelRole};
    let mut m = model();
    let mut p = (*m.peerings["b"]).clone();
    p.remote = Some(RemoteSite {
        ca_pem: String::new(),
        ca_fingerprint: String::new(),
        workload_cidrs: vec![n("10.1.0.0/16")],
        external_cidr: Some(n("10.99.0.0/16")),
        gateways: vec![RemoteGateway {
            name: "gw".into(),
            endpoint: Some("192.0.2.1:51820".parse().unwrap()),
            public_key: Some(crate::domain::WgKey::from_bytes([1; 32])),
            active: true,
            candidates: vec![],
            nat: None,
        }],
        mtu: 1420,
        endpoints: vec![],
        tunnel_role: TunnelRole::Client,
        relay: false,
        relay_for: vec![],
        relays: vec![],
        exported: None,
        exported_v6: vec![],
        transit: false,
        transit_routes: vec![],
        names: vec![],
        readiness: None,
        workload_cidrs_v6: vec![],
        external_cidr_v6: None,
        ipv6_invalid: None,
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
        ca_pem: String::new(),
        ca_fingerprint: String::new(),
        workload_cidrs: vec![view.real],
        external_cidr: None,
        gateways: vec![],
        mtu: 0,
        endpoints: vec![],
        tunnel_role: TunnelRole::Client,
        relay: false,
        relay_for: vec![],
        relays: vec![],
        exported: None,
        exported_v6: vec![],
        transit: false,
        transit_routes: vec![],
        readiness: None,
        names: vec![RemoteName {
            name: "web".into(),
            kind: NameKind::Workload,
            address: Some(real(10)),
            address_v6: None,
        }],
        workload_cidrs_v6: vec![],
        external_cidr_v6: None,
        ipv6_invalid: None,
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

#[test]
fn geneve_only_where_both_ends_have_it() {
    let mut m = model();
    let mut n1 = (*m.nodes["n1"]).clone();
    n1.geneve = true;
    m.nodes.insert("n1".into(), Arc::new(n1));
    let link = |objs: &Objects, id: &str| match &objs[id].kind {
        Some(Kind::Link(l)) => l.kind.clone().unwrap(),
        _ => panic!("{id} is not a link"),
    };
    // The gateway's kernel lacks it: VXLAN at both ends.
    assert!(matches!(link(&node(&m, "n1"), "self/link"), pb::link::Kind::Vxlan(_)));
    let mut g = (*m.gateways["gw1"]).clone();
    g.geneve = true;
    m.gateways.insert("gw1".into(), Arc::new(g));
    let gw = gateway(&m, "gw1");
    let pb::link::Kind::Geneve(a) = link(&node(&m, "n1"), "self/link") else {
        panic!("node end")
    };
    let pb::link::Kind::Geneve(b) = link(&gw, "node/n1/link") else {
        panic!("gateway end")
    };
    assert_eq!((a.vni, a.port), (b.vni, GENEVE_PORT));
    // n2's kernel lacks it.
    assert!(matches!(link(&node(&m, "n2"), "self/link"), pb::link::Kind::Vxlan(_)));
    assert!(matches!(link(&gw, "node/n2/link"), pb::link::Kind::Vxlan(_)));
}

#[test]
fn partial_rerender_equals_full_render() {
    let mut m = model();
    let mut objs = gateway(&m, "gw1");
    let mut n3 = (*m.nodes["n2"]).clone();
    n3.name = "n3".into();
    n3.internal_ip = Some(Ipv4Addr::new(10, 80, 0, 3));
    m.nodes.insert("n3".into(), Arc::new(n3));
    m.nodes.remove("n1");
    rerender_part(&mut objs, &m, "gw1", &Part::Node("n3".into()));
    rerender_part(&mut objs, &m, "gw1", &Part::Node("n1".into()));
    assert_eq!(objs, gateway(&m, "gw1"));
}

#[test]
fn diff_and_hash() {
    let m = model();
    let a = gateway(&m, "gw1");
    let mut m2 = m.clone();
    m2.nodes.remove("n2");
    let b = gateway(&m2, "gw1");
    let (up, del) = diff(&a, &b);
    assert!(up.is_empty());
    assert_eq!(
        del,
        [
            "node/n2/addr",
            "node/n2/external",
            "node/n2/link",
            "node/n2/overlay",
            "node/n2/route"
        ]
    );
    let (up, del) = diff(&b, &a);
    assert_eq!((up.len(), del.len()), (5, 0));
    assert_eq!(hash(&a["self/rule/0"]), hash(&a["self/rule/0"].clone()));
    assert_ne!(hash(&a["node/n1/link"]), hash(&a["node/n2/link"]));
}

/// Two records whose names hash alike (a birthday pair over the 36-bit
/// tag, as enrollment and Join would refuse): the older holds the
/// derived name and is rendered; the newer renders nothing, on either
/// side, until the older is gone.
#[test]
fn of_two_records_whose_names_hash_alike_only_the_older_is_rendered() {
    assert_eq!(gateway_link_name("n143693"), gateway_link_name("n492983"));
    let mut m = model();
    let mut late = (*m.nodes["n2"]).clone();
    late.name = "n492983".into();
    late.created_at_ms = 20;
    late.internal_ip = Some(Ipv4Addr::new(10, 80, 0, 9));
    let mut early = (*m.nodes["n1"]).clone();
    early.name = "n143693".into();
    early.created_at_ms = 10;
    // Inserted newest first: order of arrival does not matter.
    for n in [late, early] {
        let name = n.name.clone();
        m.nodes.insert(name.clone(), Arc::new(n));
        m.index_node(&name);
    }
    m.index_node("n1");
    m.index_peering("b");
    assert!(m.renders_node("n143693") && !m.renders_node("n492983") && m.renders_node("n1"));
    let gw = gateway(&m, "gw1");
    assert!(gw.keys().any(|k| k.starts_with("node/n143693/")));
    assert!(!gw.keys().any(|k| k.starts_with("node/n492983/")), "{:?}", gw.keys());
    assert!(node(&m, "n492983").is_empty());
    assert!(!node(&m, "n143693").is_empty());
    let c = m.collisions();
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].name, gateway_link_name("n143693"));
    assert_eq!(
        c[0].holders.iter().map(|h| h.record.as_str()).collect::<Vec<_>>(),
        ["node/n143693", "node/n492983"]
    );
    // The older one goes: the other takes the link.
    m.nodes.remove("n143693");
    assert_eq!(m.index_node("n143693"), ["n492983"]);
    assert!(m.renders_node("n492983") && m.collisions().is_empty());
    assert!(gateway(&m, "gw1").keys().any(|k| k.starts_with("node/n492983/")));

    // Peers: the same, and nodes stop routing to the newer one.
    assert_eq!(peer_link_tag("site-34359"), peer_link_tag("site-74386"));
    for (id, at) in [("site-74386", 9), ("site-34359", 5)] {
        let mut p = (*m.peerings["b"]).clone();
        p.site_id = id.into();
        p.created_at_ms = at;
        p.listen_port = 51830 + at as u16;
        m.peerings.insert(id.into(), Arc::new(p));
        m.index_peering(id);
    }
    assert!(m.renders_peering("site-34359") && !m.renders_peering("site-74386"));
    let gw = gateway(&m, "gw1");
    assert!(gw.keys().any(|k| k.starts_with("peer/site-34359/")));
    assert!(!gw.keys().any(|k| k.starts_with("peer/site-74386/")));
    let n = node(&m, "n1");
    assert!(n.keys().any(|k| k.starts_with("peer/site-34359/")));
    assert!(!n.keys().any(|k| k.starts_with("peer/site-74386/")));
    assert_eq!(m.collisions()[0].holders[1].record, "peer/site-74386");
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
