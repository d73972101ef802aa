use super::*;
use crate::domain::{PeeringState, PortRange, RemoteGateway, RemoteSite};

const KEY_A: &str = "hT7XTB7qgr4m+5V8gqhnNtjvNrqSqPFiCjPsXl1Oc0Q=";
pub(crate) const KEY_B: &str = "YJ9BkYwQ0ezGXyBwJ4cJ5e3xk1y8b7s6tXh2oVw8RkA=";

pub(crate) fn peering(site: &str, relay: bool, relay_for: &[&str], key: &str) -> Peering {
    Peering {
        site_id: site.into(),
        state: PeeringState::Negotiated,
        views: vec![],
        created_at_ms: 0,
        last_error: None,
        remote: Some(RemoteSite {
            workload_cidrs: vec![],
            gateways: vec![RemoteGateway {
                name: "gw".into(),
                endpoint: None,
                public_key: Some(key.parse().unwrap()),
                active: true,
                candidates: vec![crate::nat::Candidate {
                    address: "198.51.100.7:40001".parse().unwrap(),
                    kind: crate::nat::CandidateKind::Reflexive,
                }],
                nat: Some(crate::nat::Behaviour::EndpointDependent),
            }],
            mtu: 0,
            relay,
            relay_for: relay_for.iter().map(|s| s.to_string()).collect(),
            ..crate::domain::test_remote("10.1.0.0/16")
        }),
        ..crate::domain::test_peering("")
    }
}

fn map(ps: Vec<Peering>) -> Peerings {
    ps.into_iter().map(|p| (p.site_id.clone(), Arc::new(p))).collect()
}

const RANGE: PortRange = PortRange {
    first: 51920,
    last: 51923,
};

/// The relay site's view: a and b ask for each other, c asks for d,
/// which this site is not peered with.
fn relay_view() -> Peerings {
    map(vec![
        peering("a", false, &["b"], KEY_A),
        peering("b", false, &["a"], KEY_B),
        peering("c", false, &["d"], KEY_A),
    ])
}

fn allocated(ps: &Peerings) -> Peerings {
    let (changes, _) = allocate(ps, true, true, RANGE);
    let mut out = ps.clone();
    for (site, ports) in changes {
        let mut p = (*out[&site]).clone();
        p.relay_ports = ports;
        out.insert(site, Arc::new(p));
    }
    out
}

#[test]
fn a_relay_gives_ports_only_to_pairs_of_its_own_peers_and_answers_each_side() {
    let ps = allocated(&relay_view());
    assert_eq!(ps["a"].relay_ports.len(), 1);
    assert_eq!(ps["b"].relay_ports.len(), 1);
    assert!(ps["c"].relay_ports.is_empty(), "d is not a peer of the relay");
    let ip = Some("192.0.2.50".parse().unwrap());
    let to_a = answer(&ps["a"], &ps, true, ip);
    assert_eq!(to_a[0].peer_site, "b");
    assert_eq!(to_a[0].endpoint, format!("192.0.2.50:{}", ps["a"].relay_ports["b"]));
    let to_c = answer(&ps["c"], &ps, true, ip);
    assert_eq!(to_c[0].endpoint, "");
    assert!(to_c[0].refused.contains("not peered with site \"d\""), "{:?}", to_c[0]);
    // Not relaying, or no endpoint: refused, with why.
    assert!(answer(&ps["a"], &ps, false, ip)[0].refused.contains("--relay"));
    assert!(answer(&ps["a"], &ps, true, None)[0].refused.contains("--endpoint"));
    // Allocation is stable: nothing changes the second time.
    assert!(allocate(&ps, true, true, RANGE).0.is_empty());
}

#[test]
fn a_pair_is_pending_until_both_ask_and_a_full_range_refuses_the_rest() {
    let ps = allocated(&map(vec![
        peering("a", false, &["b"], KEY_A),
        peering("b", false, &[], KEY_B),
    ]));
    let g = answer(&ps["a"], &ps, true, Some("192.0.2.50".parse().unwrap()));
    assert_eq!((g[0].endpoint.as_str(), g[0].refused.as_str()), ("", ""), "pending");
    assert!(sessions(&ps, "a", 1).is_empty());
    // Three pairs want six ports; four are free.
    let many = map(vec![
        peering("a", false, &["b", "c", "d"], KEY_A),
        peering("b", false, &["a"], KEY_B),
        peering("c", false, &["a"], KEY_B),
        peering("d", false, &["a"], KEY_B),
    ]);
    let (changes, exhausted) = allocate(&many, true, true, RANGE);
    let given: usize = changes.values().map(|m| m.len()).sum();
    assert_eq!(given, 4);
    assert_eq!(exhausted.len(), 2);
}

#[test]
fn a_port_two_peerings_hold_stays_with_one() {
    let ps = allocated(&relay_view());
    let mut b = (*ps["b"]).clone();
    b.relay_ports.insert("a".into(), ps["a"].relay_ports["b"]);
    let mut ps = ps.clone();
    ps.insert("b".into(), Arc::new(b));
    let (changes, _) = allocate(&ps, true, true, RANGE);
    assert_ne!(changes["b"]["a"], ps["a"].relay_ports["b"]);
    assert!(!changes.contains_key("a"), "the first holder keeps its port");
}

#[test]
fn a_session_carries_each_sides_far_keys_and_nat_addresses() {
    let ps = allocated(&relay_view());
    let s = sessions(&ps, "a", 7);
    assert_eq!(s.len(), 1);
    let (a, b) = (s[0].a.as_ref().unwrap(), s[0].b.as_ref().unwrap());
    assert_eq!((a.site.as_str(), b.site.as_str()), ("a", "b"));
    assert_eq!(a.to_keys, [KEY_B]);
    assert_eq!(b.to_keys, [KEY_A]);
    assert_eq!(a.from_ips, ["198.51.100.7"]);
    assert_ne!(a.port, b.port);
    assert_eq!(s[0].bytes_per_second, 7);
    // Rendered once, under the first site.
    assert!(sessions(&ps, "b", 7).is_empty());
}

#[test]
fn both_ends_take_the_smallest_relay_whose_tunnel_is_up() {
    let grant = |far: &str, port: u16| RelayGrant {
        peer_site: far.into(),
        endpoint: Some(format!("192.0.2.5{port}:5192{port}").parse().unwrap()),
        refused: String::new(),
    };
    let relay = |site: &str, n: u16, granted: RelayGrant| {
        let mut r = peering(site, true, &[], KEY_A);
        let remote = r.remote.as_mut().unwrap();
        remote.gateways[0].endpoint = Some(format!("192.0.2.5{n}:51820").parse().unwrap());
        remote.relays = vec![granted];
        r
    };
    let r1 = relay("r1", 1, grant("b", 1));
    let r2 = relay("r2", 2, grant("b", 2));
    // A grant on another host than the relay's own gateway: never taken.
    let r00 = relay("r00", 3, grant("b", 9));
    let mut r0 = peering("r0", true, &[], KEY_A);
    r0.remote.as_mut().unwrap().relays = vec![RelayGrant {
        peer_site: "b".into(),
        endpoint: None,
        refused: "not peered".into(),
    }];
    let ps = map(vec![peering("b", false, &[], KEY_B), r00, r0, r1, r2]);
    let via = choose(&ps["b"], &ps, |_, _| true).unwrap();
    assert_eq!(
        (via.site.as_str(), via.endpoint.to_string().as_str()),
        ("r1", "192.0.2.51:51921")
    );
    let via = choose(&ps["b"], &ps, |r, _| r != "r1").unwrap();
    assert_eq!(via.site, "r2");
    assert_eq!(choose(&ps["b"], &ps, |_, _| false), None);
}

#[test]
fn hostile_requests_and_grants_are_refused_naming_the_field() {
    assert!(requests("a", &["b".into(), "c".into()]).is_ok());
    assert!(requests("a", &["a".into()]).unwrap_err().contains("relay_for[0]"));
    assert!(requests("a", &["B C".into()]).unwrap_err().contains("relay_for[0]"));
    let many: Vec<String> = (0..300).map(|i| format!("s{i}")).collect();
    assert!(requests("a", &many).unwrap_err().contains("at most 256"));
    let g = |e: &str| pb::RelayGrant {
        peer_site: "b".into(),
        endpoint: e.into(),
        refused: String::new(),
    };
    assert!(grants(&[g("192.0.2.50:51920")], &[]).is_ok());
    for bad in [
        "127.0.0.1:51920",
        "224.0.0.1:51920",
        "192.0.2.50:0",
        "nonsense",
        "169.254.1.1:5",
    ] {
        let e = grants(&[g(bad)], &[]).unwrap_err();
        assert!(e.contains("relays[0].endpoint"), "{bad}: {e}");
    }
    let own = [("192.0.2.50".parse().unwrap(), "gateway gw".to_string())];
    assert!(
        grants(&[g("192.0.2.50:51920")], &own)
            .unwrap_err()
            .contains("gateway gw")
    );
}
