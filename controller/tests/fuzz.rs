//! Property ("fuzz") targets for everything that parses or computes from
//! untrusted or generated input: enrollment and peering tokens, CIDRs, the
//! controller configuration, IPAM's view planning, and the desired-state
//! renderer. Each target must never panic and must keep its invariants.
//!
//! CI runs each with proptest's default 256 cases. A longer run:
//!   PROPTEST_CASES=100000 cargo test --release -p weft-controller --test fuzz
//! (cargo-fuzz needs a nightly toolchain, which this project does not use;
//! proptest shrinks a failure to a minimal input and records it under
//! proptest-regressions/ so it is replayed from then on.)

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use ipnet::Ipv4Net;
use proptest::prelude::*;
use weft_controller::config::{ControllerArgs, FileConfig, parse_cidr, resolve};
use weft_controller::domain::{Gateway, Node, Peering, PeeringState, Site, SubnetSource};
use weft_controller::federation::PeeringToken;
use weft_controller::ipam::{self, CidrKind};
use weft_controller::render::{self, Model, Part};
use weft_controller::state::ParsedToken;

/// Strings that look like what users paste: mostly near-valid.
fn tokenish() -> impl Strategy<Value = String> {
    prop_oneof![
        ".*",
        "weft1\\.[0-9a-fA-F]{0,14}\\.[0-9a-fA-F]{0,34}",
        "weft1(\\.[0-9a-f]{12}){1,3}\\.?",
        "weftp1\\.[A-Za-z0-9_=+/-]{0,200}",
    ]
}

fn cidrish() -> impl Strategy<Value = String> {
    prop_oneof![
        ".{0,24}",
        "[0-9]{1,4}(\\.[0-9]{1,4}){0,4}(/[0-9]{0,3})?",
        "[0-9a-f:]{0,20}/[0-9]{1,3}",
        " ?[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}/[0-9]{1,2} ?",
    ]
}

fn net(max_len: u8) -> impl Strategy<Value = Ipv4Net> {
    (any::<u32>(), 0..=max_len).prop_map(|(a, l)| Ipv4Net::new(Ipv4Addr::from(a), l).unwrap().trunc())
}

proptest! {
    #[test]
    fn property_enrollment_tokens_parse_or_are_refused_with_the_format(text in tokenish()) {
        match ParsedToken::parse(&text) {
            Ok(t) => {
                prop_assert_eq!(t.id.len(), 12);
                prop_assert_eq!(t.secret.len(), 32);
                prop_assert_eq!(format!("weft1.{}.{}", t.id, t.secret), text.trim());
            }
            Err(e) => prop_assert!(e.to_string().contains("weft1.<id>.<secret>"), "{}", e),
        }
    }

    #[test]
    fn property_peering_tokens_round_trip_and_garbage_is_refused(
        text in tokenish(),
        site in "[a-z][a-z0-9-]{0,20}",
        endpoints in proptest::collection::vec("[a-z0-9.]{1,20}:[0-9]{1,5}", 1..4),
        fp in "[0-9a-f]{64}",
        exp in any::<u64>(),
        flip in any::<(usize, u8)>(),
    ) {
        if let Err(e) = PeeringToken::decode(&text) {
            prop_assert!(e.to_string().contains("weftctl peering token"), "{}", e);
        }
        let t = PeeringToken { site, endpoints, fp, id: "0123456789ab".into(), secret: "s".repeat(32), exp };
        let enc = t.encode();
        prop_assert_eq!(PeeringToken::decode(&enc).unwrap(), t);
        // One byte changed: decoded to something else or refused, never a panic.
        let mut bytes = enc.into_bytes();
        let i = flip.0 % bytes.len();
        bytes[i] ^= flip.1.max(1);
        if let Ok(s) = String::from_utf8(bytes) {
            let _ = PeeringToken::decode(&s);
        }
    }

    #[test]
    fn property_cidrs_parse_only_in_canonical_ipv4_form(text in cidrish(), n in net(32)) {
        if let Ok(c) = parse_cidr(&text) {
            prop_assert_eq!(c.network(), c.addr(), "host bits accepted: {}", text);
            prop_assert_eq!(c.to_string(), text.trim());
        }
        prop_assert_eq!(parse_cidr(&n.to_string()), Ok(n));
    }

    #[test]
    fn property_any_configuration_is_accepted_or_refused_field_by_field(
        site_id in prop::option::of("[a-zA-Z0-9._/-]{0,70}"),
        pods in prop::option::of(proptest::collection::vec(cidrish(), 0..3)),
        external in prop::option::of(cidrish()),
        internal in prop::option::of(cidrish()),
        pools in prop::option::of(proptest::collection::vec(cidrish(), 0..3)),
        node_len in prop::option::of(any::<u8>()),
        listen in prop::option::of(".{0,30}"),
        ttl in prop::option::of("[0-9]{0,6}(ms|s|m|h|d|x)?"),
        mtu in prop::option::of(any::<u32>()),
    ) {
        let file = FileConfig {
            site_id,
            pod_cidrs: pods,
            external_cidr: external,
            internal_cidr: internal,
            remap_pools: pools,
            node_prefix_len: node_len,
            listen,
            agent_cert_ttl: ttl.clone(),
            agent_ttl: ttl,
            tunnel_mtu: mtu,
            wireguard_ports: Default::default(),
            data_dir: Some("/nonexistent/weft-fuzz".into()),
            ..FileConfig::default()
        };
        match resolve(&ControllerArgs::default(), file) {
            Ok(c) => {
                // What was accepted is coherent.
                prop_assert!(!c.site.pod_cidrs.is_empty());
                for p in &c.site.pod_cidrs {
                    prop_assert!(!ipam::overlaps(p, &c.site.internal_cidr));
                    prop_assert!(p.prefix_len() <= c.site.node_prefix_len);
                }
            }
            Err(e) => {
                prop_assert!(!e.0.is_empty());
                for f in &e.0 {
                    prop_assert!(!f.field.is_empty() && !f.message.is_empty(), "{:?}", f);
                }
            }
        }
    }

    #[test]
    fn any_toml_text_is_read_or_refused(text in ".{0,200}") {
        let _ = toml::from_str::<FileConfig>(&text);
    }

    #[test]
    fn planned_views_never_collide_and_translate_back(
        peer in proptest::collection::vec(net(30), 1..4),
        in_use in proptest::collection::vec(net(28), 0..6),
        addr in any::<u32>(),
    ) {
        let kinds = [CidrKind::Workload, CidrKind::External, CidrKind::Workload, CidrKind::External];
        let peer: Vec<(CidrKind, Ipv4Net)> = peer.into_iter().zip(kinds).map(|(n, k)| (k, n)).collect();
        let pools = ["10.0.0.0/8", "172.16.0.0/12"].map(|p| p.parse::<Ipv4Net>().unwrap());
        match ipam::plan_views(&peer, &in_use, &pools, &["0.0.0.0/0".parse().unwrap()]) {
            Ok(views) => {
                prop_assert_eq!(views.len(), peer.len());
                for (i, v) in views.iter().enumerate() {
                    prop_assert_eq!(v.real.prefix_len(), v.local.prefix_len());
                    if v.remapped() {
                        prop_assert!(in_use.iter().all(|u| !ipam::overlaps(u, &v.local)), "{:?} in use", v);
                        prop_assert!(v.pool.is_some_and(|p| p.contains(&v.local)));
                    }
                    for w in &views[i + 1..] {
                        prop_assert!(!ipam::overlaps(&v.local, &w.local), "{:?} and {:?}", v, w);
                    }
                    let a = Ipv4Addr::from(u32::from(v.real.network()) | (addr & u32::from(v.real.hostmask())));
                    let there = ipam::translate(a, v.real, v.local).unwrap();
                    prop_assert_eq!(ipam::translate(there, v.local, v.real), Some(a));
                }
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }

    #[test]
    fn the_renderer_handles_any_model(
        nodes in 0usize..10,
        gateways in 1usize..3,
        peers in proptest::collection::vec((net(24), prop::option::of(net(24)), any::<bool>()), 0..4),
        geneve in any::<u16>(),
        mtu in prop::option::of(1280u32..9000),
        drop_node in any::<usize>(),
    ) {
        let n = |s: &str| s.parse::<Ipv4Net>().unwrap();
        let site = Site {
            ipv6: None,
            id: "a".into(),
            pod_cidrs: vec![n("10.1.0.0/16")],
            external_cidr: n("10.70.0.0/16"),
            internal_cidr: n("10.80.0.0/16"),
            reserved_cidrs: vec![],
            remap_pools: vec![n("10.0.0.0/8"), n("172.16.0.0/12")],
            node_prefix_len: 24,
            overlay_mtu: mtu,
            tunnel_mtu: mtu,
            wireguard_ports: Default::default(),
            peer_cidr_auto_accept: vec![],
            peer_public_cidrs: vec![],
            controller_ips: vec![],
            underlay_overlap: Default::default(),
        default_export: Default::default(),
            relay_ports: None,
            relay_tls_port: None,
        };
        let mut m = Model { revision: 1, site: Some(Arc::new(site.clone())), ..Default::default() };
        let mut taken: Vec<Ipv4Net> = vec![];
        let mut ips: Vec<Ipv4Addr> = vec![];
        for i in 0..nodes {
            let (subnet, _) = ipam::allocate_node_subnet(&site.pod_cidrs, 24, &taken).unwrap();
            taken.push(subnet);
            let ip = ipam::allocate_internal_ip(site.internal_cidr, &ips).unwrap();
            ips.push(ip);
            m.nodes.insert(format!("n{i}"), Arc::new(Node {
                subnet_v6: None,
                name: format!("n{i}"), subnet: Some(subnet), source: SubnetSource::Allocated, created_at_ms: 0, certs: vec![],
                internal_ip: Some(ip), underlay_ip: Some(IpAddr::V4(Ipv4Addr::new(192, 168, 1, i as u8))),
                geneve: geneve & (1 << i) != 0, identity_conflict: None, enrolled_at_ms: 0,
            }));
        }
        for i in 0..gateways {
            let ip = ipam::allocate_internal_ip(site.internal_cidr, &ips).unwrap();
            ips.push(ip);
            m.gateways.insert(format!("gw{i}"), Arc::new(Gateway {
                name: format!("gw{i}"), endpoint: Some(format!("192.168.2.{i}:51820").parse().unwrap()), public_key: None,
                created_at_ms: 0, certs: vec![], internal_ip: Some(ip),
                underlay_ip: Some(IpAddr::V4(Ipv4Addr::new(192, 168, 2, i as u8))), geneve: geneve & (1 << (10 + i)) != 0,
                identity_conflict: None, enrolled_at_ms: 0, pending_public_key: None, key_from_enrollment: false,
                discovered: Default::default(),
                enforces_export: false,
                enforces_export_v6: false,
                punches_beside: false,
            }));
            m.live_gateways.insert(format!("gw{i}"));
        }
        m.active_gateway = Some("gw0".into());
        let mut in_use = site.own_blocks();
        for (i, (work, ext, connected)) in peers.into_iter().enumerate() {
            let mut want = vec![(CidrKind::Workload, work)];
            if let Some(e) = ext.filter(|e| !ipam::overlaps(e, &work)) {
                want.push((CidrKind::External, e));
            }
            let Ok(views) = ipam::plan_views(&want, &in_use, &site.remap_pools, &site.peer_public_cidrs) else { continue };
            in_use.extend(views.iter().map(|v| v.local));
            m.peerings.insert(format!("p{i}"), Arc::new(Peering {
                site_id: format!("p{i}"),
                state: if connected { PeeringState::Connected } else { PeeringState::Negotiated },
                views, created_at_ms: 0, last_error: None, remote: None,
                listen_port: 51820 + i as u16,
                pending: None,
                joined_with: None,
                joined_at_ms: 0,
                relay_ports: Default::default(),
                relay_via: None,
                export: None,
                transit: false,
                transit_views: vec![],
                transit_views_v6: vec![],
                views_v6: vec![],
                ipv6_refused: None,
                pending_v6: None,
            }));
        }
        for name in m.nodes.keys() {
            let objs = render::node(&m, name);
            prop_assert_eq!(&objs, &render::node(&m, name), "rendering is deterministic");
            for (id, o) in &objs {
                prop_assert_eq!(id, &o.id);
            }
        }
        for g in m.gateways.keys() {
            let full = render::gateway(&m, g);
            prop_assert!(render::diff(&full, &full).0.is_empty() && render::diff(&full, &full).1.is_empty());
            // A node leaves: re-rendering its part equals rendering anew,
            // and the diff turns the old state into the new.
            let mut m2 = m.clone();
            let gone = m2.nodes.keys().nth(drop_node % nodes.max(1)).cloned();
            if let Some(gone) = gone {
                m2.nodes.remove(&gone);
                let mut part = full.clone();
                render::rerender_part(&mut part, &m2, g, &Part::Node(gone));
                let fresh = render::gateway(&m2, g);
                prop_assert_eq!(&part, &fresh);
                let (ups, dels) = render::diff(&full, &fresh);
                let mut applied = full.clone();
                for id in &dels { applied.remove(id); }
                for o in ups { applied.insert(o.id.clone(), o); }
                prop_assert_eq!(applied, fresh);
            }
        }
    }
}

/// Found by `cidrs_parse_only_in_canonical_ipv4_form`: leading zeros were
/// accepted, and read as decimal where other tools read octal.
#[test]
fn leading_zeros_in_a_cidr_are_refused() {
    let e = parse_cidr("10.010.0.0/16").unwrap_err();
    assert!(e.contains("write 10.10.0.0/16"), "{e}");
    assert!(parse_cidr("0.0.00.0/0").is_err());
}
