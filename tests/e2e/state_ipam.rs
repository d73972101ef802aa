//! IPAM persisted through store transactions, on both backends: concurrent
//! writers (controller replicas sharing etcd) never hand out overlapping
//! blocks, peer views avoid everything in use and are released with the
//! peering.

use std::sync::Arc;

use ipnet::Ipv4Net;
use weft_controller::domain::Site;
use weft_controller::error::Error;
use weft_controller::ipam::{CidrKind, overlaps};
use weft_controller::state::State;
use weft_controller::store::Store;
use weft_controller::store::embedded::EmbeddedStore;
use weft_controller::store::etcd::EtcdStore;
use weft_tests::Etcd;

fn n(s: &str) -> Ipv4Net {
    s.parse().unwrap()
}

fn site() -> Site {
    Site {
        ipv6: None,
        id: "site-a".into(),
        pod_cidrs: vec![n("10.1.0.0/20")],
        external_cidr: n("10.70.0.0/16"),
        internal_cidr: n("10.80.0.0/16"),
        reserved_cidrs: vec![n("192.168.0.0/24")],
        remap_pools: vec![n("10.0.0.0/8"), n("172.16.0.0/12")],
        node_prefix_len: 26,
        overlay_mtu: None,
        tunnel_mtu: None,
        wireguard_ports: Default::default(),
        peer_cidr_auto_accept: vec![],
        peer_public_cidrs: vec![],
        controller_ips: vec![],
        underlay_overlap: Default::default(),
        default_export: Default::default(),
        relay_ports: None,
        relay_tls_port: None,
    }
}

/// Handles on one store, and what keeps the store alive.
type Replicas = (Vec<Arc<dyn Store>>, Box<dyn std::any::Any>);

/// Two handles on the same data: two connections for etcd (like two
/// replicas), two clones for the embedded store (one process owns the file).
async fn replicas() -> Vec<Replicas> {
    let dir = tempfile::tempdir().unwrap();
    let e = EmbeddedStore::open(&dir.path().join("s.redb")).unwrap();
    let mut out: Vec<Replicas> = vec![(vec![Arc::new(e.clone()), Arc::new(e)], Box::new(dir))];
    if let Some(etcd) = Etcd::start() {
        let a = EtcdStore::connect(&[etcd.endpoint()], None).await.unwrap();
        let b = EtcdStore::connect(&[etcd.endpoint()], None).await.unwrap();
        out.push((vec![Arc::new(a), Arc::new(b)], Box::new(etcd)));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_replicas_never_hand_out_overlapping_subnets() {
    for (stores, _guard) in replicas().await {
        let backend = stores[0].backend();
        let states: Vec<State> = stores.into_iter().map(|s| State::new(s, "site-a")).collect();
        states[0].init_site(&site()).await.unwrap();
        let mut tasks = Vec::new();
        for (r, st) in states.iter().enumerate() {
            for i in 0..12 {
                let st = st.clone();
                tasks.push(tokio::spawn(async move {
                    st.create_node(&format!("r{r}-n{i}"), None).await
                }));
            }
        }
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        let (nodes, _) = states[1].list_nodes().await.unwrap();
        assert_eq!(nodes.len(), 24, "{backend}");
        for (i, a) in nodes.iter().enumerate() {
            let a_subnet = a.subnet.expect("an IPv4 subnet");
            assert!(n("10.1.0.0/20").contains(&a_subnet));
            for b in &nodes[i + 1..] {
                assert!(
                    !overlaps(&a_subnet, &b.subnet.expect("an IPv4 subnet")),
                    "{backend}: {} and {} overlap",
                    a.name,
                    b.name
                );
            }
        }
        // a concurrent duplicate name is created exactly once
        let (x, y) = tokio::join!(states[0].create_node("dup", None), states[1].create_node("dup", None));
        assert!(x.is_ok() != y.is_ok(), "{backend}: exactly one create wins");
        assert!(matches!(x.err().or(y.err()), Some(Error::AlreadyExists(_))));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_views_avoid_everything_in_use_and_are_released() {
    for (stores, _guard) in replicas().await {
        let backend = stores[0].backend();
        let st = State::new(stores[0].clone(), "site-a");
        st.init_site(&site()).await.unwrap();
        weft_tests::step(&format!("{backend}: a peer on our own cidrs is remapped"));
        // peer b uses our pod CIDR and external CIDR: both remapped
        let b = st
            .upsert_peering(
                "site-b",
                &[
                    (CidrKind::Workload, n("10.1.0.0/20")),
                    (CidrKind::External, n("10.70.0.0/16")),
                ],
            )
            .await
            .unwrap();
        assert_eq!(b.views[0].local, n("10.0.0.0/20"), "{backend}");
        assert_eq!(
            b.views[1].local,
            n("10.2.0.0/16"),
            "{backend}: skips 10.1/16 (pod) and 10.0/16 (b's view)"
        );
        weft_tests::step(&format!("{backend}: a second peer on the same cidrs is kept apart"));
        // peer c has the same real CIDRs: kept apart from b's views
        let c = st
            .upsert_peering(
                "site-c",
                &[
                    (CidrKind::Workload, n("10.1.0.0/20")),
                    (CidrKind::External, n("10.70.0.0/16")),
                ],
            )
            .await
            .unwrap();
        assert_eq!(c.views[0].local, n("10.0.16.0/20"), "{backend}");
        assert_eq!(c.views[1].local, n("10.3.0.0/16"), "{backend}");
        // a free CIDR is used as is
        let d = st
            .upsert_peering("site-d", &[(CidrKind::Workload, n("10.50.0.0/16"))])
            .await
            .unwrap();
        assert!(!d.views[0].remapped(), "{backend}");
        // re-upserting is stable: the peering's own views do not block it
        let b2 = st
            .upsert_peering(
                "site-b",
                &[
                    (CidrKind::Workload, n("10.1.0.0/20")),
                    (CidrKind::External, n("10.70.0.0/16")),
                ],
            )
            .await
            .unwrap();
        assert_eq!(b2.views, b.views, "{backend}");
        // a peer cannot claim our own id
        assert!(matches!(
            st.upsert_peering("site-a", &[(CidrKind::Workload, n("10.9.0.0/16"))])
                .await,
            Err(Error::InvalidArgument(_))
        ));

        let (allocs, pools, _) = st.allocations().await.unwrap();
        assert_eq!(allocs.len(), 5, "{backend}");
        let remap = pools.iter().find(|p| p.pool == n("10.0.0.0/8").into()).unwrap();
        assert_eq!(
            remap.allocated,
            2 * 4096 + 2 * 65536,
            "{backend}: only remapped views use the pool"
        );

        weft_tests::step(&format!("{backend}: a deleted peering releases its views"));
        // deleting b releases its views: a newcomer gets them
        st.delete_peering("site-b").await.unwrap();
        let e = st
            .upsert_peering("site-e", &[(CidrKind::Workload, n("10.1.0.0/20"))])
            .await
            .unwrap();
        assert_eq!(e.views[0].local, n("10.0.0.0/20"), "{backend}");
        assert!(matches!(st.delete_peering("site-b").await, Err(Error::NotFound(_))));

        weft_tests::step(&format!("{backend}: a site change colliding with a view is refused"));
        // a site change that would collide with a view is refused
        let mut changed = site();
        changed.reserved_cidrs.push(n("10.50.0.0/24"));
        let err = st.init_site(&changed).await.unwrap_err();
        assert!(
            matches!(err, Error::FailedPrecondition(ref m) if m.contains("site-d")),
            "{err}"
        );
        // one that strands nothing is accepted
        let mut grown = site();
        grown.pod_cidrs.push(n("10.9.0.0/16"));
        st.init_site(&grown).await.unwrap();
        assert_eq!(st.site().await.unwrap().0, grown);
        // Nor may the site drop its IPv4 pods while peerings have IPv4
        // views (an IPv6-only site routes no IPv4).
        let mut v6_only = grown.clone();
        v6_only.pod_cidrs.clear();
        let err = st.init_site(&v6_only).await.unwrap_err();
        assert!(
            matches!(err, Error::FailedPrecondition(ref m) if m.contains("has IPv4 views") && m.contains("site-d")),
            "{err}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_remap_pools_are_resource_exhausted() {
    let dir = tempfile::tempdir().unwrap();
    let st = State::new(
        Arc::new(EmbeddedStore::open(&dir.path().join("s.redb")).unwrap()),
        "site-a",
    );
    let mut s = site();
    s.remap_pools = vec![n("172.16.0.0/15")];
    st.init_site(&s).await.unwrap();
    st.upsert_peering("p1", &[(CidrKind::Workload, n("10.1.0.0/16"))])
        .await
        .unwrap();
    st.upsert_peering("p2", &[(CidrKind::Workload, n("10.1.0.0/16"))])
        .await
        .unwrap();
    let err = st
        .upsert_peering("p3", &[(CidrKind::Workload, n("10.1.0.0/16"))])
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::ResourceExhausted(ref m) if m.contains("172.16.0.0/15")),
        "{err}"
    );
    let status: tonic::Status = err.into();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert_eq!(st.list_peerings().await.unwrap().0.len(), 2, "nothing half-written");
}

/// A peer's CIDR that covers a host's underlay address is never used as
/// the local view as it is: a policy rule for it would pull the site's own
/// VXLAN and controller traffic into the peering. It is remapped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_view_never_covers_a_hosts_underlay_address() {
    use weft_controller::domain::AgentRole;
    use weft_controller::pki::Issued;
    for (stores, _guard) in replicas().await {
        let backend = stores[0].backend();
        let st = State::new(stores[0].clone(), "site-a");
        st.init_site(&site()).await.unwrap();
        let (token, _) = st
            .create_token(AgentRole::Node, Some("n1"), std::time::Duration::from_secs(60), 1)
            .await
            .unwrap();
        st.register(&token, "n1", None, Some("10.50.3.7".parse().unwrap()), |_, _| {
            Ok(Issued {
                cert_pem: String::new(),
                serial: "01".into(),
                not_after_ms: u64::MAX,
                ca: String::new(),
            })
        })
        .await
        .unwrap();
        let p = st
            .upsert_peering("site-b", &[(CidrKind::Workload, n("10.50.0.0/16"))])
            .await
            .unwrap();
        let ip: std::net::Ipv4Addr = "10.50.3.7".parse().unwrap();
        assert!(p.views[0].remapped(), "{backend}: {:?}", p.views);
        assert!(!p.views[0].local.contains(&ip), "{backend}: {:?}", p.views);
    }
}

/// A running IPv4 site adds IPv6: its nodes keep their IPv4 subnets and get
/// a /64 each, the generated remap pool is recorded and kept on the next
/// start, concurrent replicas never hand out the same /64, and IPv6 the
/// nodes use cannot be dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_site_adds_ipv6_and_its_nodes_get_a_64_each() {
    use ipnet::Ipv6Net;
    use weft_controller::domain::Ipv6Networks;
    let n6 = |s: &str| s.parse::<Ipv6Net>().unwrap();
    for (stores, _guard) in replicas().await {
        let backend = stores[0].backend();
        let states: Vec<State> = stores.into_iter().map(|s| State::new(s, "site-a")).collect();
        states[0].init_site(&site()).await.unwrap();
        for i in 0..3 {
            states[0].create_node(&format!("old-{i}"), None).await.unwrap();
        }
        let before: Vec<Ipv4Net> = states[0]
            .list_nodes()
            .await
            .unwrap()
            .0
            .iter()
            .map(|n| n.subnet.expect("an IPv4 subnet"))
            .collect();
        let dual = Site {
            ipv6: Some(Ipv6Networks {
                pod_cidrs: vec![n6("fd00:1:0:100::/56")],
                ..Default::default()
            }),
            ..site()
        };
        let stored = states[0].init_site(&dual).await.unwrap();
        let pool = stored.ipv6.as_ref().unwrap().remap_pools.clone();
        assert_eq!(pool.len(), 1, "{backend}: a generated pool");
        assert_eq!(pool[0].prefix_len(), 40);
        assert!(
            n6("fd00::/8").contains(&pool[0]),
            "{backend}: {} is not unique local",
            pool[0]
        );
        // The next start with the same configuration keeps it.
        let again = states[1].init_site(&dual).await.unwrap();
        assert_eq!(again.ipv6.unwrap().remap_pools, pool, "{backend}");
        assert_eq!(states[1].site().await.unwrap().0.ipv6.unwrap().remap_pools, pool);

        // New nodes on both replicas at once.
        let mut tasks = Vec::new();
        for (r, st) in states.iter().enumerate() {
            for i in 0..6 {
                let st = st.clone();
                tasks.push(tokio::spawn(
                    async move { st.create_node(&format!("r{r}-{i}"), None).await },
                ));
            }
        }
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        let (nodes, _) = states[1].list_nodes().await.unwrap();
        assert_eq!(nodes.len(), 15, "{backend}");
        let kept: Vec<Ipv4Net> = nodes
            .iter()
            .filter(|n| n.name.starts_with("old-"))
            .map(|n| n.subnet.expect("an IPv4 subnet"))
            .collect();
        assert_eq!(kept, before, "{backend}: IPv4 subnets kept");
        let v6: Vec<Ipv6Net> = nodes.iter().map(|n| n.subnet_v6.unwrap()).collect();
        for (i, a) in v6.iter().enumerate() {
            assert_eq!(a.prefix_len(), 64);
            assert!(n6("fd00:1:0:100::/56").contains(a), "{backend}: {a}");
            for b in &v6[i + 1..] {
                assert_ne!(a, b, "{backend}: a /64 handed out twice");
            }
        }
        // IPAM's allocations show both families, and the IPv6 pod CIDR's
        // usage: 15 of its 256 /64s.
        let (allocs, pools, _) = states[0].allocations().await.unwrap();
        let pod6: ipnet::IpNet = n6("fd00:1:0:100::/56").into();
        let from_pod6 = allocs.iter().filter(|a| a.pool == Some(pod6)).count();
        assert_eq!(from_pod6, 15, "{backend}: {allocs:?}");
        let usage = pools
            .iter()
            .find(|p| p.pool == pod6)
            .expect("the IPv6 pod CIDR's usage");
        assert_eq!((usage.allocated >> 64, usage.total >> 64), (15, 256), "{backend}");
        assert!(
            pools.iter().any(|p| p.pool == pool[0].into()),
            "{backend}: the generated pool"
        );
        // Dropping IPv6 its nodes use is refused, naming a node.
        let e = states[0].init_site(&site()).await.unwrap_err();
        assert!(e.to_string().contains("IPv6 subnet"), "{backend}: {e}");
        assert!(
            states[0].site().await.unwrap().0.ipv6.is_some(),
            "{backend}: nothing changed"
        );
    }
}

/// An IPv6-only site: a node gets a /64 and no IPv4 subnet, a name goes by
/// its IPv6 address alone (an IPv4 one is refused); adding IPv4 pods is
/// refused while such a name lacks an IPv4 address, and once it is given
/// one, taken: the node gets an IPv4 subnet and keeps its /64.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipv6_only_site_adds_ipv4_once_its_names_have_it() {
    use weft_controller::domain::Ipv6Networks;
    let dir = tempfile::tempdir().unwrap();
    let st = State::new(
        Arc::new(EmbeddedStore::open(&dir.path().join("s.redb")).unwrap()),
        "site-a",
    );
    let v6_only = Site {
        pod_cidrs: vec![],
        ipv6: Some(Ipv6Networks {
            pod_cidrs: vec!["fd00:1::/48".parse().unwrap()],
            ..Default::default()
        }),
        ..site()
    };
    st.init_site(&v6_only).await.unwrap();
    let node = st.create_node("n1", None).await.unwrap();
    assert_eq!(node.subnet, None);
    let v6 = node.subnet_v6.expect("a /64");
    let wl = std::net::Ipv6Addr::from(u128::from(v6.network()) + 0x10);
    let err = st
        .create_name("web", Some("10.1.0.10".parse().unwrap()), None, false)
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument(ref m) if m.contains("IPv6-only")),
        "{err}"
    );
    let rec = st.create_name("web", None, Some(wl), false).await.unwrap();
    assert_eq!((rec.address, rec.address_v6), (None, Some(wl)));

    let dual = Site {
        pod_cidrs: site().pod_cidrs,
        ..v6_only.clone()
    };
    let err = st.init_site(&dual).await.unwrap_err();
    assert!(
        matches!(err, Error::FailedPrecondition(ref m) if m.contains("\"web\"") && m.contains("no IPv4 address")),
        "{err}"
    );
    st.delete_name("web").await.unwrap();
    st.init_site(&dual).await.unwrap();
    let (nodes, _) = st.list_nodes().await.unwrap();
    let subnet = nodes[0].subnet.expect("an IPv4 subnet once the site has IPv4 pods");
    assert!(dual.pod_cidrs.iter().any(|p| p.contains(&subnet)), "{subnet}");
    assert_eq!(nodes[0].subnet_v6, Some(v6), "the /64 is kept");
}
