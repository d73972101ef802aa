//! IPv6 through the same arithmetic as IPv4: node /64s, views, remap and
//! host-bit preservation, as properties.

use std::net::Ipv6Addr;

use ipnet::Ipv6Net;
use proptest::prelude::*;

use super::*;

fn n(s: &str) -> Ipv6Net {
    s.parse().unwrap()
}

#[test]
fn a_node_gets_a_64_from_a_56_until_it_is_full() {
    let pods = [n("fd00:1:0:100::/56")];
    let mut taken: Vec<Ipv6Net> = vec![];
    for i in 0..256u32 {
        let (s, pod) = allocate_node_subnet(&pods, 64, &taken).unwrap();
        assert_eq!(pod, pods[0]);
        assert_eq!(s, n(&format!("fd00:1:0:1{i:02x}::/64")));
        taken.push(s);
    }
    let e = allocate_node_subnet(&pods, 64, &taken).unwrap_err();
    assert!(matches!(e, IpamError::Exhausted(_)), "{e}");
    assert!(e.to_string().contains("/64"), "{e}");
}

#[test]
fn a_colliding_ula_is_remapped_keeping_its_length_and_host_bits() {
    let own = n("fd00:1::/48");
    let pool = n("fd9a:2b3c:4d5e::/40");
    let views = plan_views(&[(CidrKind::Workload, own)], &[own], &[pool], &[]).unwrap();
    assert_eq!(views[0].local, n("fd9a:2b3c:4d00::/48"));
    assert_eq!(views[0].pool, Some(pool));
    let a: Ipv6Addr = "fd00:1::a:10".parse().unwrap();
    let there = translate(a, views[0].real, views[0].local).unwrap();
    assert_eq!(there, "fd9a:2b3c:4d00::a:10".parse::<Ipv6Addr>().unwrap());
    assert_eq!(translate(there, views[0].local, views[0].real), Some(a));
    // A free ULA keeps its real value.
    let other = n("fd00:2::/48");
    let views = plan_views(&[(CidrKind::Workload, other)], &[own], &[pool], &[]).unwrap();
    assert!(!views[0].remapped());
}

#[test]
fn special_or_public_or_huge_ipv6_is_refused() {
    for (c, says) in [
        ("fe80::/64", "fe80::/10"),
        ("ff02::/64", "ff00::/8"),
        ("::1/128", "::/8"),
        ("fd00::/8", "larger than a /32"),
        ("2001:db8::/48", "not private address space"),
    ] {
        let e = plan_views(&[(CidrKind::Workload, n(c))], &[], &[n("fd9a::/40")], &[]).unwrap_err();
        assert!(e.to_string().contains(says), "{c}: {e}");
    }
    // A public block allowed is taken only through a remapped view.
    let public = n("2001:db8:5::/48");
    let v = plan_views(
        &[(CidrKind::External, public)],
        &[],
        &[n("fd9a::/40")],
        &[n("2001:db8::/32")],
    )
    .unwrap();
    assert!(v[0].remapped());
}

#[test]
fn a_generated_pool_is_a_unique_local_40_off_the_sites_own() {
    let p = ula_pool([0x12, 0x34, 0x56, 0x78], &[]).unwrap();
    assert_eq!(p, n("fd12:3456:7800::/40"));
    assert!(is_private(&p));
    assert_eq!(first_free(p, 48, &[]), Some(n("fd12:3456:7800::/48")));
    assert_eq!(ula_pool([0x12, 0x34, 0x56, 0x78], &[n("fd12:3456:7812::/48")]), None);
}

#[test]
fn a_whole_family_is_sized_and_searched_without_overflow() {
    let all = n("::/0");
    assert_eq!(size(&all), u128::MAX);
    assert_eq!(first_free(all, 0, &[]), Some(all));
    assert_eq!(first_free(all, 0, &[n("::1/128")]), None);
    assert_eq!(first_free(all, 1, &[n("::1/128")]), Some(n("8000::/1")));
    assert_eq!(first_free(all, 128, &[n("::/1"), n("8000::/1")]), None);
    assert_eq!(used_in(&all, &[all]), u128::MAX);
}

fn arb_net(min_len: u8, max_len: u8) -> impl Strategy<Value = Ipv6Net> {
    (any::<u128>(), min_len..=max_len).prop_map(|(a, l)| Ipv6Net::new(Ipv6Addr::from(a), l).unwrap().trunc())
}

/// ULA blocks: fd00::/8 with a random 40-bit global id and more.
fn arb_ula(min_len: u8, max_len: u8) -> impl Strategy<Value = Ipv6Net> {
    (any::<u128>(), min_len..=max_len).prop_map(|(a, l)| {
        let a = (a & !(0xffu128 << 120)) | (0xfdu128 << 120);
        Ipv6Net::new(Ipv6Addr::from(a), l).unwrap().trunc()
    })
}

proptest! {
    #[test]
    fn property_node_64s_never_overlap_and_stay_in_pods(
        pods in proptest::collection::vec(arb_ula(48, 60), 1..3),
        declared in proptest::collection::vec(arb_ula(56, 64), 0..6),
        count in 1usize..40,
    ) {
        let pods = Ipv6Net::aggregate(&pods);
        let mut taken: Vec<(String, Ipv6Net)> = vec![];
        for (i, d) in declared.into_iter().enumerate() {
            if check_declared_subnet(d, &pods, &taken).is_ok() {
                taken.push((format!("d{i}"), d));
            }
        }
        for i in 0..count {
            let nets: Vec<Ipv6Net> = taken.iter().map(|t| t.1).collect();
            match allocate_node_subnet(&pods, 64, &nets) {
                Ok((s, pod)) => {
                    prop_assert!(pod.contains(&s));
                    prop_assert_eq!(s.prefix_len(), 64);
                    taken.push((format!("n{i}"), s));
                }
                Err(IpamError::Exhausted(_)) => {
                    for p in &pods { prop_assert!(first_free(*p, 64, &nets).is_none()); }
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
    fn property_ipv6_views_never_collide_and_are_deterministic(
        in_use in proptest::collection::vec(arb_ula(40, 64), 0..8),
        peer in proptest::collection::vec(arb_ula(44, 64), 1..4),
        public in proptest::collection::vec(arb_net(32, 64), 0..2),
        pools in proptest::collection::vec(arb_ula(32, 44), 0..3),
    ) {
        let mut kinds: Vec<(CidrKind, Ipv6Net)> = peer.iter().map(|p| (CidrKind::Workload, *p)).collect();
        kinds.extend(public.iter().map(|p| (CidrKind::External, *p)));
        // Every public block allowed: public CIDRs are then remapped.
        let anywhere = [n("::/0")];
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
    fn property_ipv6_translation_keeps_host_bits(net in arb_net(0, 128), to in any::<u128>(), host in any::<u128>()) {
        let to = Ipv6Net::new(Ipv6Addr::from(to), net.prefix_len()).unwrap().trunc();
        let mask = u128::from(net.hostmask());
        let addr = Ipv6Addr::from(u128::from(net.network()) | (host & mask));
        let there = translate(addr, net, to).unwrap();
        prop_assert!(to.contains(&there));
        prop_assert_eq!(u128::from(there) & mask, host & mask, "the host bits are kept");
        prop_assert_eq!(translate(there, to, net), Some(addr));
    }

    #[test]
    fn property_ipv6_first_free_is_lowest(
        pool in arb_net(16, 100),
        used in proptest::collection::vec(arb_net(0, 128), 0..6),
        extra in 0u8..=10,
    ) {
        let len = (pool.prefix_len() + extra).min(128);
        // Used blocks near the pool, so that they matter.
        let used: Vec<Ipv6Net> = used
            .into_iter()
            .map(|u| {
                let l = u.prefix_len().max(pool.prefix_len());
                let a = u128::from(pool.network()) | (u128::from(u.network()) & u128::from(pool.hostmask()));
                Ipv6Net::new(Ipv6Addr::from(a), l).unwrap().trunc()
            })
            .collect();
        if let Some(b) = first_free(pool, len, &used) {
            prop_assert!(pool.contains(&b));
            prop_assert_eq!(b.prefix_len(), len);
            prop_assert!(!used.iter().any(|u| overlaps(u, &b)));
            let step = 1u128 << (128 - len);
            let mut a = u128::from(pool.network());
            while a < u128::from(b.network()) {
                let c = Ipv6Net::new(Ipv6Addr::from(a), len).unwrap();
                prop_assert!(used.iter().any(|u| overlaps(u, &c)), "{c} was free");
                a += step;
            }
        } else {
            // None free: every aligned block is covered.
            let step = 1u128 << (128 - len);
            let mut a = u128::from(pool.network());
            loop {
                let c = Ipv6Net::new(Ipv6Addr::from(a), len).unwrap();
                prop_assert!(used.iter().any(|u| overlaps(u, &c)), "{c} was free");
                match a.checked_add(step) {
                    Some(next) if next <= u128::from(pool.broadcast()) => a = next,
                    _ => break,
                }
            }
        }
    }
}
