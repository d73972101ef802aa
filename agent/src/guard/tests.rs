use super::*;
use crate::apply::{Applier, Objects, Scope};
use crate::desired::Held;
use weft_proto::v1 as pb;
use weft_proto::v1::desired_object::Kind;

impl Guard {
    /// Decodes `o` as the agent's door does, then checks it: what the
    /// guard makes of a controller's object.
    fn check_raw(&self, o: &pb::DesiredObject, links: &Links) -> R {
        let d = weft_dataplane::desired::decode(o)?;
        self.check(&d, links)
    }
}

/// The links `objects` make, decoded.
fn links_of(objects: &[pb::DesiredObject]) -> Links {
    let d: Vec<Object> = objects
        .iter()
        .map(|o| weft_dataplane::desired::decode(o).unwrap())
        .collect();
    links(d.iter())
}

fn obj(kind: Kind) -> pb::DesiredObject {
    pb::DesiredObject {
        id: "x".into(),
        kind: Some(kind),
    }
}

fn guard() -> Guard {
    Guard::new(
        Some("192.168.78.11".parse().unwrap()),
        &["https://192.168.78.1:7443".into()],
    )
}

fn rule(priority: u32, table: u32, to: &str) -> Kind {
    Kind::Rule(pb::Rule {
        namespace: String::new(),
        priority,
        from: String::new(),
        to: to.into(),
        table,
        iif: String::new(),
        ipv6: false,
    })
}

fn route(ns: &str, table: u32, dst: &str, dev: &str) -> Kind {
    Kind::Route(pb::Route {
        namespace: ns.into(),
        table,
        destination: dst.into(),
        gateway: String::new(),
        device: dev.into(),
        peer_site: String::new(),
    })
}

#[test]
fn what_weft_renders_passes() {
    let g = guard();
    for k in [
        rule(7765, 7765, "10.1.0.0/16"),
        route("", 7765, "10.0.0.0/16", "weft-vx0"),
        route("weft-p-0123456789ab", 0, "10.1.0.0/16", "weft-iabc"),
        route("weft-p-0123456789ab", 1, "0.0.0.0/0", "weft-wabc"),
        Kind::Namespace(pb::Namespace {
            name: "weft-p-0123456789ab".into(),
        }),
        Kind::HostSnat(pb::HostSnat {
            link: "weft-vx0".into(),
            address: "10.70.0.3".into(),
            except: vec!["10.1.0.0/16".into()],
        }),
        Kind::WireguardPeer(pb::WireguardPeer {
            link: "weft-wabc".into(),
            namespace: "weft-p-0123456789ab".into(),
            public_key: "hT7XTB7qgr4m+5V8gqhnNtjvNrqSqPFiCjPsXl1Oc0Q=".into(),
            endpoint: "192.0.2.1:51821".into(),
            allowed_ips: vec!["10.1.0.0/16".into()],
            persistent_keepalive: 25,
            punch: false,
            direct: String::new(),
            tls_port: 0,
        }),
    ] {
        assert_eq!(g.check_raw(&obj(k.clone()), &Links::new()), Ok(()), "{k:?}");
    }
}

#[test]
fn what_reaches_past_weft_is_refused() {
    let g = guard();
    let refused = [
        (route("", 254, "10.9.0.0/16", "weft-vx0"), "table 254"),
        (route("", 255, "10.9.0.0/16", "weft-vx0"), "table 255"),
        (route("", 7765, "10.9.0.0/16", "eth0"), "\"eth0\""),
        (rule(0, 7765, "10.9.0.0/16"), "priority 0"),
        (rule(7765, 254, "10.9.0.0/16"), "table 254"),
        (rule(7765, 7765, ""), "every destination"),
        (rule(7765, 7765, "0.0.0.0/1"), "/8 or narrower"),
        (rule(7765, 7765, "192.168.78.0/24"), "192.168.78.11"),
        (rule(7765, 7765, "192.168.78.1/32"), "192.168.78.1"),
        (route("", 7765, "192.168.78.0/24", "weft-vx0"), "192.168.78.11"),
        (
            Kind::Address(pb::Address {
                link: "eth0".into(),
                namespace: String::new(),
                cidr: "192.168.78.11/24".into(),
                no_prefix_route: false,
            }),
            "\"eth0\"",
        ),
        (
            Kind::Namespace(pb::Namespace {
                name: "../../proc/1/ns/net".into(),
            }),
            "namespaces",
        ),
        (Kind::Namespace(pb::Namespace { name: "other".into() }), "namespaces"),
        (
            Kind::HostSnat(pb::HostSnat {
                link: "eth0".into(),
                address: "10.70.0.3".into(),
                except: vec![],
            }),
            "\"eth0\"",
        ),
        (
            Kind::WireguardPeer(pb::WireguardPeer {
                link: "weft-wabc".into(),
                namespace: String::new(),
                public_key: "hT7XTB7qgr4m+5V8gqhnNtjvNrqSqPFiCjPsXl1Oc0Q=".into(),
                endpoint: "192.0.2.1:51820\nlisten_port=1".into(),
                allowed_ips: vec![],
                persistent_keepalive: 0,
                punch: false,
                direct: String::new(),
                tls_port: 0,
            }),
            "endpoint",
        ),
        (
            Kind::WireguardPeer(pb::WireguardPeer {
                link: "weft-wabc".into(),
                namespace: String::new(),
                public_key: "AAAA\npublic_key=00".into(),
                endpoint: String::new(),
                allowed_ips: vec![],
                persistent_keepalive: 0,
                punch: false,
                direct: String::new(),
                tls_port: 0,
            }),
            "public key",
        ),
        (
            Kind::Link(pb::Link {
                name: "eth0".into(),
                namespace: String::new(),
                mtu: 1500,
                kind: Some(pb::link::Kind::Bridge(pb::Bridge {})),
            }),
            "\"eth0\"",
        ),
        (
            Kind::NatMap(pb::NatMap {
                namespace: String::new(),
                real_cidr: "10.1.0.0/16".into(),
                local_cidr: "10.9.0.0/16".into(),
                tunnel: "weft-wabc".into(),
            }),
            "host's namespace",
        ),
    ];
    for (k, needle) in refused {
        let e = g
            .check_raw(&obj(k.clone()), &Links::new())
            .expect_err(&format!("{k:?}"));
        assert!(e.contains(needle), "{k:?}: {e}");
    }
}

fn address(link: &str, ns: &str, cidr: &str) -> Kind {
    Kind::Address(pb::Address {
        link: link.into(),
        namespace: ns.into(),
        cidr: cidr.into(),
        no_prefix_route: false,
    })
}

fn link(name: &str, ns: &str, kind: pb::link::Kind) -> pb::DesiredObject {
    obj(Kind::Link(pb::Link {
        name: name.into(),
        namespace: ns.into(),
        mtu: 0,
        kind: Some(kind),
    }))
}

/// A host on 192.168.78.0/24 (eth0) with a second LAN on eth1, a
/// default gateway and a resolver beyond it.
fn host_guard() -> Guard {
    let mut g = guard();
    g.set_host(HostNets {
        connected: vec![
            ("192.168.78.11/24".parse().unwrap(), "eth0".into()),
            ("172.20.5.7/24".parse().unwrap(), "eth1".into()),
            ("127.0.0.1/8".parse().unwrap(), "lo".into()),
            ("2001:db8:78::11/64".parse().unwrap(), "eth0".into()),
            ("fe80::1234/64".parse().unwrap(), "eth0".into()),
        ],
        reached: [
            ("192.168.78.254", "a gateway of the host's main table"),
            ("fe80::1", "a gateway of the host's main table"),
            ("10.53.0.2", "a resolver of the host (/etc/resolv.conf)"),
        ]
        .map(|(a, w)| (a.parse().unwrap(), w.to_string()))
        .to_vec(),
    });
    g
}

fn weft_links() -> Links {
    links_of(&[
        link(
            "weft-vx0",
            "",
            pb::link::Kind::Vxlan(pb::Vxlan {
                vni: 1,
                local: "192.168.78.11".into(),
                remote: "192.168.78.10".into(),
                port: 4789,
            }),
        ),
        link(
            "weft-vabc",
            "",
            pb::link::Kind::Veth(pb::Veth {
                peer_name: "weft-iabc".into(),
                peer_namespace: "weft-p-0123456789ab".into(),
            }),
        ),
        link("weft-br", "", pb::link::Kind::Bridge(pb::Bridge {})),
    ])
}

#[test]
fn addresses_fit_their_links_role_and_routes_keep_off_the_hosts_networks() {
    let g = host_guard();
    let l = weft_links();
    for k in [
        address("weft-vx0", "", "10.80.0.3/16"),
        address("weft-vx0", "", "10.80.0.3/32"),
        address("weft-vabc", "", "169.254.0.5/30"),
        address("weft-iabc", "weft-p-0123456789ab", "169.254.0.6/30"),
        address("weft-br", "", "10.1.3.1/24"),
        route("", 7765, "10.2.0.0/16", "weft-vx0"),
        rule(7765, 7765, "10.2.0.0/16"),
    ] {
        assert_eq!(g.check_raw(&obj(k.clone()), &l), Ok(()), "{k:?}");
    }
    let refused = [
        (address("weft-vx0", "", "0.0.0.1/1"), "/8 or narrower"),
        (address("weft-vx0", "", "192.168.78.1/32"), "a controller"),
        (
            address("weft-vx0", "", "192.168.78.254/32"),
            "a gateway of the host's main table",
        ),
        (address("weft-vx0", "", "10.53.0.2/32"), "a resolver"),
        (address("weft-vx0", "", "172.20.5.7/32"), "an address of this host"),
        (
            address("weft-vx0", "", "172.20.9.1/16"),
            "172.20.5.7, an address of this host",
        ),
        (address("weft-vx0", "", "172.20.5.200/25"), "the network of eth1"),
        (address("weft-vx0", "", "10.53.9.1/16"), "10.53.0.2"),
        (address("weft-vabc", "", "10.9.0.1/30"), "link-local /30"),
        (address("weft-vabc", "", "169.254.0.5/16"), "link-local /30"),
        (address("weft-other", "", "10.9.0.1/32"), "does not make"),
        (route("", 7765, "172.20.0.0/16", "weft-vx0"), "172.20.5.7"),
        (route("", 7765, "172.20.5.128/25", "weft-vx0"), "the network of eth1"),
        (route("", 7765, "10.53.0.0/16", "weft-vx0"), "a resolver"),
        (route("", 7765, "127.0.0.0/8", "weft-vx0"), "127.0.0.1"),
        (rule(7765, 7765, "192.168.0.0/16"), "192.168.78."),
        (rule(7765, 7765, "10.53.0.0/16"), "a resolver"),
    ];
    for (k, needle) in refused {
        let e = g.check_raw(&obj(k.clone()), &l).expect_err(&format!("{k:?}"));
        assert!(e.contains(needle), "{k:?}: {e}");
    }
    // A tunnel's own address is a link-local /30 too.
    let wg = |address: &str| {
        Kind::Link(pb::Link {
            name: "weft-wabc".into(),
            namespace: "weft-p-0123456789ab".into(),
            mtu: 1420,
            kind: Some(pb::link::Kind::Wireguard(pb::Wireguard {
                listen_port: 51821,
                address: address.into(),
                peer_address: "169.254.255.254".into(),
                peer_site: "b".into(),
                reflectors: vec![],
            })),
        })
    };
    assert_eq!(g.check_raw(&obj(wg("169.254.255.253/30")), &l), Ok(()));
    let e = g.check_raw(&obj(wg("192.168.78.1/1")), &l).unwrap_err();
    assert!(e.contains("link-local /30"), "{e}");
}

#[test]
fn in_the_hosts_namespace_no_address_takes_a_neighbour_the_metadata_service_or_the_hosts_ipv6() {
    let g = host_guard();
    let l = weft_links();
    let rule6 = |to: &str, ipv6| {
        Kind::Rule(pb::Rule {
            namespace: String::new(),
            priority: 7765,
            from: String::new(),
            to: to.into(),
            table: 7765,
            iif: String::new(),
            ipv6,
        })
    };
    let via = |dst: &str, gateway: &str, dev: &str| {
        Kind::Route(pb::Route {
            namespace: String::new(),
            table: 7765,
            destination: dst.into(),
            gateway: gateway.into(),
            device: dev.into(),
            peer_site: String::new(),
        })
    };
    let refused = [
        // A LAN neighbour's address, as a /32 or as a veth's /30.
        (address("weft-vx0", "", "192.168.78.77/32"), "the network of eth0"),
        (address("weft-vabc", "", "169.254.169.253/30"), "metadata"),
        (route("", 7765, "169.254.169.254/32", "weft-vx0"), "metadata"),
        // The host's own IPv6: its network, its address, special space.
        (address("weft-vx0", "", "2001:db8:78::77/128"), "the network of eth0"),
        (route("", 7765, "2001:db8:78::/48", "weft-vx0"), "2001:db8:78::11"),
        (
            route("", 7765, "2001:db8:78:0:8000::/65", "weft-vx0"),
            "the network of eth0",
        ),
        (route("", 7765, "fe80::/10", "weft-vx0"), "link-local"),
        (route("", 7765, "ff02::/16", "weft-vx0"), "multicast"),
        (rule6("fd00::/8", true), "/32 or narrower"),
        (rule6("2001:db8:78::11/128", true), "2001:db8:78::11"),
        (address("weft-vx0", "", "fd00::1/16"), "/32 or narrower"),
        // Families kept apart.
        (rule6("fd00:1::/48", false), "a rule for IPv4"),
        (rule6("10.9.0.0/16", true), "a rule for IPv6"),
        (via("fd00:1::/48", "10.80.0.1", "weft-vx0"), "another family"),
        (via("fd00:1::/48", "fe80::a50:1", ""), "names no device"),
        // Link-local only as weft's fe80::/64, on weft's links.
        (address("weft-vx0", "", "fe80:1::1/64"), "link-local"),
        (address("eth0", "", "fe80::2/64"), "\"eth0\""),
        (address("weft-nope", "", "fe80::2/64"), "does not make"),
    ];
    for (k, needle) in refused {
        let e = g.check_raw(&obj(k.clone()), &l).expect_err(&format!("{k:?}"));
        assert!(e.contains(needle), "{k:?}: {e}");
    }
    // What weft renders for IPv6 passes: a link-local next hop on
    // its links, a site's ULA routed and ruled.
    for k in [
        address("weft-vx0", "", "fe80::a50:3/64"),
        address("weft-vabc", "", "fe80::1/64"),
        address("weft-iabc", "weft-p-0123456789ab", "fe80::2/64"),
        via("fd00:1::/48", "fe80::a50:1", "weft-vx0"),
        rule6("fd00:1::/48", true),
        route("weft-p-0123456789ab", 1, "fd00:1::/48", "weft-wabc"),
    ] {
        assert_eq!(g.check_raw(&obj(k.clone()), &l), Ok(()), "{k:?}");
    }
    // Weft's own namespaces are weft's.
    assert_eq!(
        g.check_raw(&obj(address("weft-iabc", "weft-p-0123456789ab", "169.254.0.6/30")), &l),
        Ok(())
    );
    // Host networks never read: nothing goes into the host's
    // namespace; a later read opens it.
    let mut g = guard();
    g.host_unread("netlink: permission denied".into());
    let e = g
        .check_raw(&obj(route("", 7765, "10.2.0.0/16", "weft-vx0")), &l)
        .unwrap_err();
    assert!(e.contains("could not be read"), "{e}");
    let e = g
        .check_raw(&obj(address("weft-vx0", "", "10.80.0.3/32")), &l)
        .unwrap_err();
    assert!(e.contains("could not be read"), "{e}");
    assert_eq!(
        g.check_raw(&obj(route("weft-p-0123456789ab", 0, "10.1.0.0/16", "weft-iabc")), &l),
        Ok(())
    );
    g.set_host(host_guard().host);
    assert_eq!(
        g.check_raw(&obj(route("", 7765, "10.2.0.0/16", "weft-vx0")), &l),
        Ok(())
    );
    // A failed read after a good one keeps what was read.
    g.host_unread("again".into());
    assert_eq!(
        g.check_raw(&obj(route("", 7765, "10.2.0.0/16", "weft-vx0")), &l),
        Ok(())
    );
}

#[test]
fn resolvers_are_read_from_resolv_conf() {
    let r = HostNets::resolvers("# x\nnameserver 10.53.0.2\nsearch lan\nnameserver fd00::53\nnameserver bogus\n");
    let got: Vec<String> = r.iter().map(|(a, _)| a.to_string()).collect();
    assert_eq!(got, ["10.53.0.2", "fd00::53"]);
}

/// An applier that records what reached it.
#[derive(Default)]
struct Recorder {
    upserts: Vec<String>,
    deletes: Vec<String>,
    held: Vec<String>,
}

#[async_trait::async_trait]
impl Applier for Recorder {
    async fn apply(&mut self, applied: &Objects, desired: &Objects, _: Scope) -> Vec<pb::ObjectError> {
        let (changed, gone) = crate::apply::diff(applied, desired);
        self.held = applied.keys().cloned().collect();
        self.upserts.extend(changed.iter().map(|o| o.id().to_string()));
        self.deletes.extend(gone);
        vec![]
    }
}

#[tokio::test]
async fn refused_objects_are_reported_and_never_reach_the_host() {
    let mut a = Guarded::new(Recorder::default(), guard());
    let good = pb::DesiredObject {
        id: "good".into(),
        kind: Some(rule(7765, 7765, "10.1.0.0/16")),
    };
    let bad = pb::DesiredObject {
        id: "bad".into(),
        kind: Some(rule(0, 254, "0.0.0.0/0")),
    };
    let both: Objects = [
        ("good".to_string(), Held::from(good.clone())),
        ("bad".to_string(), Held::from(bad.clone())),
    ]
    .into();
    let errors = a.apply(&Objects::new(), &both, Scope::Changed).await;
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].id, "bad");
    assert!(
        errors[0].message.starts_with("refused by the agent"),
        "{}",
        errors[0].message
    );
    assert_eq!(a.inner.upserts, ["good"]);
    // Deleting the refused object (held since) touches nothing; the
    // inner applier never sees it as held either.
    a.apply(&both, &Objects::new(), Scope::Changed).await;
    assert_eq!(a.inner.deletes, ["good"]);
    assert_eq!(a.inner.held, ["good"]);
}

/// The planner itself behind the guard, on a fake host: whatever reaches
/// it is planned and carried out there.
struct Planner(weft_dataplane::DataPlane<Fake, Fake, Fake>);

use weft_dataplane::fake::{Fake, FakeHost};

#[async_trait::async_trait]
impl Applier for Planner {
    async fn apply(&mut self, applied: &Objects, desired: &Objects, _: Scope) -> Vec<pb::ObjectError> {
        let claimed = weft_dataplane::namespaces_of(applied.values().filter_map(Held::object));
        let objects = desired.iter().filter_map(|(id, o)| Some((id.as_str(), o.object()?)));
        let out = self.0.reconcile(objects, &claimed, None).await;
        out.errors
            .into_iter()
            .map(|(id, message)| pb::ObjectError { id, message })
            .collect()
    }
}

#[tokio::test]
async fn what_the_guard_refuses_or_cannot_decode_never_reaches_the_planner() {
    let host = Fake::new(FakeHost::default());
    let plane = weft_dataplane::DataPlane {
        net: host.clone(),
        fw: host.clone(),
        wg: host.clone(),
        node: false,
        underlay: None,
        believed: None,
    };
    let mut a = Guarded::new(Planner(plane), guard());
    let held = |id: &str, kind: Kind| {
        (
            id.to_string(),
            Held::from(pb::DesiredObject {
                id: id.into(),
                kind: Some(kind),
            }),
        )
    };
    let desired: Objects = [
        // Weft's rule for a peer's CIDR: planned and made.
        held("good", rule(7765, 7765, "10.1.0.0/16")),
        // A rule that would pull this host's controller into the fabric:
        // it decodes, and the guard refuses it.
        held("covers-controller", rule(7765, 7765, "192.168.78.0/24")),
        // A rule in the main table: the guard refuses it.
        held("main-table", rule(0, 254, "10.9.0.0/16")),
        // Not even a CIDR: refused at the door.
        held("garbage", rule(7765, 7765, "10.1.0.0/16\nlink set")),
    ]
    .into();
    let errors = a.apply(&Objects::new(), &desired, Scope::Changed).await;
    let mut refused: Vec<&str> = errors.iter().map(|e| e.id.as_str()).collect();
    refused.sort();
    assert_eq!(refused, ["covers-controller", "garbage", "main-table"], "{errors:?}");
    assert!(errors.iter().all(|e| e.message.starts_with("refused by the agent: ")));
    // What does not decode is said to be malformed; the rest reaches too far.
    for e in &errors {
        assert_eq!(e.message.contains(": malformed: "), e.id == "garbage", "{e:?}");
    }
    let h = host.host();
    let rules: Vec<String> = h.ns[""]
        .rules
        .iter()
        .map(|r| r.to.map(|t| t.to_string()).unwrap_or_default())
        .collect();
    assert_eq!(rules, ["10.1.0.0/16"], "only the good rule reached the host");
}
