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
        punches_beside: false,
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
fn a_relay_sites_active_gateway_takes_tls_and_names_its_tunnels_as_peers_reach_them() {
    let mut m = model();
    let mut standby = (*m.gateways["gw1"]).clone();
    standby.name = "gw2".into();
    m.gateways.insert("gw2".into(), Arc::new(standby));
    m.active_gateway = Some("gw1".into());
    let mut gw = (*m.gateways["gw1"]).clone();
    // Its --wireguard-ports forwarded from 40000 up.
    gw.endpoint = Some("192.0.2.9:40000".parse().unwrap());
    m.gateways.insert("gw1".into(), Arc::new(gw));
    let tls = |m: &Model, g: &str| match gateway(m, g).get("self/relay-tls").map(|o| o.kind.clone()) {
        Some(Some(Kind::RelayTls(t))) => Some((t.port, t.own_port_shift)),
        _ => None,
    };
    assert_eq!(tls(&m, "gw1"), None, "not a relay site");
    let mut site = (*m.site.clone().unwrap()).clone();
    site.relay_ports = Some(crate::domain::PortRange {
        first: 51920,
        last: 51999,
    });
    site.relay_tls_port = Some(443);
    let first = i32::from(site.wireguard_ports.first);
    m.site = Some(Arc::new(site));
    assert_eq!(tls(&m, "gw1"), Some((443, 40000 - first)));
    assert_eq!(tls(&m, "gw2"), None, "a standby takes nothing");
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

mod peers;
