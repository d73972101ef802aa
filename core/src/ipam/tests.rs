use super::*;
use proptest::prelude::*;

fn n(s: &str) -> Ipv4Net {
    s.parse().unwrap()
}

#[test]
fn first_free_skips_used_and_aligns() {
    let pool = n("10.0.0.0/16");
    assert_eq!(first_free(pool, 24, &[]), Some(n("10.0.0.0/24")));
    assert_eq!(first_free(pool, 24, &[n("10.0.0.0/24")]), Some(n("10.0.1.0/24")));
    // a small block in the way pushes to the next aligned /24
    assert_eq!(first_free(pool, 24, &[n("10.0.0.128/25")]), Some(n("10.0.1.0/24")));
    // gaps are reused
    assert_eq!(
        first_free(pool, 24, &[n("10.0.0.0/24"), n("10.0.2.0/24")]),
        Some(n("10.0.1.0/24"))
    );
    assert_eq!(first_free(pool, 16, &[n("10.0.255.255/32")]), None);
    assert_eq!(first_free(pool, 8, &[]), None, "larger than the pool");
    assert_eq!(
        first_free(n("10.0.0.0/8"), 30, &[n("10.0.0.0/9")]),
        Some(n("10.128.0.0/30"))
    );
}

#[test]
fn node_subnets_fill_pods_in_order_then_exhaust() {
    let pods = [n("10.1.0.0/23"), n("10.9.0.0/24")];
    let mut taken = vec![];
    for want in ["10.1.0.0/24", "10.1.1.0/24", "10.9.0.0/24"] {
        let (s, _) = allocate_node_subnet(&pods, 24, &taken).unwrap();
        assert_eq!(s, n(want));
        taken.push(s);
    }
    let err = allocate_node_subnet(&pods, 24, &taken).unwrap_err();
    assert!(
        matches!(err, IpamError::Exhausted(ref m) if m.contains("10.1.0.0/23") && m.contains("/24")),
        "{err}"
    );
}

#[test]
fn declared_subnet_must_fit_a_pod_and_not_overlap() {
    let pods = [n("10.1.0.0/16")];
    let taken = vec![("a".to_string(), n("10.1.0.0/24"))];
    assert_eq!(check_declared_subnet(n("10.1.5.0/26"), &pods, &taken).unwrap(), pods[0]);
    assert!(matches!(
        check_declared_subnet(n("10.2.0.0/24"), &pods, &taken),
        Err(IpamError::Invalid(_))
    ));
    let e = check_declared_subnet(n("10.1.0.0/23"), &pods, &taken).unwrap_err();
    assert!(matches!(e, IpamError::Conflict(ref m) if m.contains("\"a\"")), "{e}");
}

#[test]
fn views_keep_real_when_free_and_remap_on_conflict() {
    let in_use = [
        n("10.1.0.0/16"),
        n("10.70.0.0/16"),
        n("10.80.0.0/16"),
        n("192.168.1.0/24"),
    ];
    let pools = [n("10.0.0.0/8"), n("172.16.0.0/12")];
    let v = plan_views(&[(CidrKind::Workload, n("10.2.0.0/16"))], &in_use, &pools, &[]).unwrap();
    assert_eq!(v[0].local, n("10.2.0.0/16"));
    assert!(!v[0].remapped());
    let v = plan_views(
        &[
            (CidrKind::Workload, n("10.1.0.0/16")),
            (CidrKind::External, n("10.70.0.0/16")),
        ],
        &in_use,
        &pools,
        &[],
    )
    .unwrap();
    assert_eq!(v[0].local, n("10.0.0.0/16"));
    assert_eq!(v[1].local, n("10.2.0.0/16"));
    assert_eq!(v[0].pool, Some(pools[0]));
    // a peer CIDR kept as real is never handed out as another's remap
    let v = plan_views(
        &[
            (CidrKind::Workload, n("10.1.0.0/16")),
            (CidrKind::Workload, n("10.0.0.0/16")),
        ],
        &in_use,
        &pools,
        &[],
    )
    .unwrap();
    assert_eq!(v[1].local, n("10.0.0.0/16"));
    assert_eq!(v[0].local, n("10.2.0.0/16"));
}

#[test]
fn views_reject_self_overlap_and_report_exhaustion() {
    let e = plan_views(
        &[
            (CidrKind::Workload, n("10.1.0.0/16")),
            (CidrKind::External, n("10.1.5.0/24")),
        ],
        &[],
        &[],
        &[],
    )
    .unwrap_err();
    assert!(matches!(e, IpamError::Invalid(_)));
    let e = plan_views(
        &[(CidrKind::Workload, n("10.0.0.0/8"))],
        &[n("10.0.0.0/8")],
        &[n("172.16.0.0/12")],
        &[],
    )
    .unwrap_err();
    assert!(matches!(e, IpamError::Exhausted(ref m) if m.contains("/8")), "{e}");
}

#[test]
fn public_peer_cidrs_are_refused_or_only_remapped() {
    let pools = [n("10.0.0.0/8")];
    for public in [
        "8.0.0.0/8",
        "1.1.1.0/24",
        "100.128.0.0/16",
        "172.32.0.0/16",
        "192.0.2.0/24",
    ] {
        let e = plan_views(&[(CidrKind::Workload, n(public))], &[], &pools, &[]).unwrap_err();
        assert!(
            matches!(e, IpamError::Invalid(ref m) if m.contains("not private") && m.contains(public)),
            "{e}"
        );
    }
    // RFC 1918 and RFC 6598 keep their real address when free.
    for private in ["10.7.0.0/16", "172.20.0.0/16", "192.168.4.0/24", "100.64.0.0/16"] {
        let v = plan_views(&[(CidrKind::Workload, n(private))], &[], &pools, &[]).unwrap();
        assert!(!v[0].remapped(), "{private}");
    }
    // Allowed: taken, but only through a remapped view.
    let v = plan_views(
        &[(CidrKind::External, n("1.1.1.0/24"))],
        &[],
        &pools,
        &[n("1.1.0.0/16")],
    )
    .unwrap();
    assert!(v[0].remapped());
    assert_eq!(v[0].local, n("10.0.0.0/24"));
    // A block only partly allowed is refused.
    assert!(plan_views(&[(CidrKind::External, n("1.0.0.0/8"))], &[], &pools, &[n("1.1.0.0/16")]).is_err());
}

#[test]
fn internal_ips_skip_network_broadcast_and_taken() {
    let net = n("10.80.0.0/30");
    let a = allocate_internal_ip(net, &[]).unwrap();
    assert_eq!(a, Ipv4Addr::new(10, 80, 0, 1));
    let b = allocate_internal_ip(net, &[a]).unwrap();
    assert_eq!(b, Ipv4Addr::new(10, 80, 0, 2));
    assert!(matches!(
        allocate_internal_ip(net, &[a, b]),
        Err(IpamError::Exhausted(_))
    ));
}

#[test]
fn translate_keeps_host_bits() {
    let a = Ipv4Addr::new(10, 1, 7, 9);
    assert_eq!(
        translate(a, n("10.1.0.0/16"), n("10.200.0.0/16")),
        Some(Ipv4Addr::new(10, 200, 7, 9))
    );
    assert_eq!(translate(a, n("10.1.0.0/16"), n("10.200.0.0/24")), None);
    assert_eq!(translate(a, n("10.2.0.0/16"), n("10.200.0.0/16")), None);
}

fn arb_net(min_len: u8) -> impl Strategy<Value = Ipv4Net> {
    (any::<u32>(), min_len..=30u8).prop_map(|(a, l)| Ipv4Net::new(Ipv4Addr::from(a), l).unwrap().trunc())
}

proptest! {
    #[test]
    fn property_node_allocations_never_overlap_and_stay_in_pods(
        pods in proptest::collection::vec(arb_net(14), 1..3),
        declared in proptest::collection::vec(arb_net(16), 0..6),
        len in 20u8..=28,
        count in 1usize..40,
    ) {
        let pods = ipnet::Ipv4Net::aggregate(&pods);
        let pods: Vec<Ipv4Net> = pods.into_iter().filter(|p| p.prefix_len() <= len).collect();
        prop_assume!(!pods.is_empty());
        let mut taken: Vec<(String, Ipv4Net)> = vec![];
        for (i, d) in declared.into_iter().enumerate() {
            if check_declared_subnet(d, &pods, &taken).is_ok() {
                taken.push((format!("d{i}"), d));
            }
        }
        for i in 0..count {
            let nets: Vec<Ipv4Net> = taken.iter().map(|t| t.1).collect();
            match allocate_node_subnet(&pods, len, &nets) {
                Ok((s, pod)) => {
                    prop_assert!(pod.contains(&s));
                    prop_assert_eq!(s.prefix_len(), len);
                    taken.push((format!("n{i}"), s));
                }
                Err(IpamError::Exhausted(_)) => {
                    let total: u128 = pods.iter().map(size).sum();
                    // exhaustion only when no aligned block is free anywhere
                    for p in &pods { prop_assert!(first_free(*p, len, &nets).is_none()); }
                    prop_assert!(used_in(&pods[0], &nets) <= total);
                    break;
                }
                Err(e) => prop_assert!(false, "unexpected {e}"),
            }
        }
        for (i, (_, a)) in taken.iter().enumerate() {
            for (_, b) in &taken[i + 1..] {
                prop_assert!(!overlaps(a, b), "{a} overlaps {b}");
            }
        }
    }

    #[test]
    fn property_views_never_collide_and_are_deterministic(
        in_use in proptest::collection::vec(arb_net(8), 0..8),
        peer in proptest::collection::vec(arb_net(12), 1..4),
        pools in proptest::collection::vec(arb_net(6), 0..3),
    ) {
        let kinds: Vec<(CidrKind, Ipv4Net)> = peer.iter().map(|p| (CidrKind::Workload, *p)).collect();
        // Every public block allowed: public CIDRs are then remapped.
        let anywhere = [n("0.0.0.0/0")];
        let first_try = plan_views(&kinds, &in_use, &pools, &anywhere);
        prop_assert_eq!(&first_try, &plan_views(&kinds, &in_use, &pools, &anywhere));
        if let Ok(views) = first_try {
            for (i, v) in views.iter().enumerate() {
                prop_assert_eq!(v.local.prefix_len(), v.real.prefix_len());
                if v.remapped() {
                    prop_assert!(!in_use.iter().any(|u| overlaps(u, &v.local)), "{} collides", v.local);
                    prop_assert!(v.pool.unwrap().contains(&v.local));
                } else {
                    prop_assert!(!in_use.iter().any(|u| overlaps(u, &v.real)));
                    prop_assert!(is_private(&v.real), "{} kept its public address", v.real);
                }
                for w in &views[i + 1..] {
                    prop_assert!(!overlaps(&v.local, &w.local), "{} and {}", v.local, w.local);
                }
            }
        }
    }

    #[test]
    fn property_translation_round_trips(net in arb_net(8), to in arb_net(8), host in any::<u32>()) {
        let to = Ipv4Net::new(to.network(), net.prefix_len()).unwrap().trunc();
        let addr = Ipv4Addr::from(u32::from(net.network()) | (host & u32::from(net.hostmask())));
        let there = translate(addr, net, to).unwrap();
        prop_assert!(to.contains(&there));
        prop_assert_eq!(translate(there, to, net), Some(addr));
    }

    #[test]
    fn property_first_free_is_lowest(pool in arb_net(16), used in proptest::collection::vec(arb_net(18), 0..6), len in 18u8..=26) {
        if let Some(b) = first_free(pool, len, &used) {
            prop_assert!(pool.contains(&b));
            prop_assert!(!used.iter().any(|u| overlaps(u, &b)));
            // no lower free aligned block exists
            let step = 1u32 << (32 - len);
            let mut a = u32::from(pool.network());
            while a < u32::from(b.network()) {
                let c = Ipv4Net::new(Ipv4Addr::from(a), len).unwrap();
                prop_assert!(used.iter().any(|u| overlaps(u, &c)), "{c} was free");
                a += step;
            }
        }
    }
}

#[test]
fn a_remapped_view_keeps_a_block_the_site_already_uses_for_it_when_free() {
    let pools = [n("10.200.0.0/13")];
    let peer = [(CidrKind::Workload, n("10.1.0.0/16"))];
    let in_use = [n("10.1.0.0/16"), n("10.200.0.0/16")];
    let kept = View {
        kind: CidrKind::Workload,
        real: n("10.203.0.0/16"),
        local: n("10.203.0.0/16"),
        pool: None,
    };
    let v = plan_views_keeping(&peer, &in_use, &pools, &[], std::slice::from_ref(&kept), false).unwrap();
    assert_eq!((v[0].local, v[0].pool), (n("10.203.0.0/16"), Some(pools[0])));
    // Taken meanwhile, or of another length or kind: the pool's next.
    let taken = [n("10.1.0.0/16"), n("10.200.0.0/16"), n("10.203.0.0/16")];
    let v = plan_views_keeping(&peer, &taken, &pools, &[], std::slice::from_ref(&kept), false).unwrap();
    assert_eq!(v[0].local, n("10.201.0.0/16"));
    let other = View {
        kind: CidrKind::External,
        ..kept
    };
    let v = plan_views_keeping(&peer, &in_use, &pools, &[], &[other], false).unwrap();
    assert_eq!(v[0].local, n("10.201.0.0/16"));
    // A CIDR free here still takes the block in use for its site: the
    // site's workloads keep addressing it as they did.
    let free = [(CidrKind::Workload, n("10.5.0.0/16"))];
    let v = plan_views_keeping(&free, &in_use, &pools, &[], std::slice::from_ref(&kept), false).unwrap();
    assert_eq!((v[0].local, v[0].pool), (n("10.203.0.0/16"), Some(pools[0])));
    assert_eq!(
        plan_views_keeping(&free, &in_use, &pools, &[], &[], false).unwrap()[0].local,
        n("10.5.0.0/16")
    );
    // What a transit peer offers is never routed at its real value.
    let v = plan_views_keeping(&free, &in_use, &pools, &[], &[], true).unwrap();
    assert_eq!((v[0].local, v[0].pool), (n("10.201.0.0/16"), Some(pools[0])));
}
