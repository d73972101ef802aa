//! The planner against the fake host (no root needed): drift is repaired,
//! what is weft's but undesired goes, what is not weft's is never touched,
//! and a plan carried out leaves nothing to do.

use std::collections::BTreeSet;

use weft_dataplane::DataPlane;
use weft_dataplane::desired::Object;
use weft_dataplane::fake::{Fake, FakeHost, FakeNs};
use weft_dataplane::model::*;
use weft_dataplane::plan::Op;
use weft_proto::v1 as pb;
use weft_proto::v1::desired_object::Kind;

const KEY: &str = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
const KEY2: &str = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";
const NS: &str = "weft-p-a";

fn obj(id: &str, kind: Kind) -> pb::DesiredObject {
    pb::DesiredObject {
        id: id.into(),
        kind: Some(kind),
    }
}

fn vxlan(remote: &str) -> pb::DesiredObject {
    obj(
        "self/link",
        Kind::Link(pb::Link {
            name: "weft-vx0".into(),
            namespace: String::new(),
            mtu: 1450,
            kind: Some(pb::link::Kind::Vxlan(pb::Vxlan {
                vni: 7,
                local: "192.168.1.1".into(),
                remote: remote.into(),
                port: 4789,
            })),
        }),
    )
}

fn address(id: &str, ns: &str, link: &str, cidr: &str) -> pb::DesiredObject {
    obj(
        id,
        Kind::Address(pb::Address {
            link: link.into(),
            namespace: ns.into(),
            cidr: cidr.into(),
            no_prefix_route: false,
        }),
    )
}

fn route(id: &str, ns: &str, table: u32, dst: &str, dev: &str) -> pb::DesiredObject {
    obj(
        id,
        Kind::Route(pb::Route {
            namespace: ns.into(),
            table,
            destination: dst.into(),
            gateway: String::new(),
            device: dev.into(),
            peer_site: String::new(),
        }),
    )
}

fn rule(id: &str, ns: &str, to: &str) -> pb::DesiredObject {
    obj(
        id,
        Kind::Rule(pb::Rule {
            namespace: ns.into(),
            priority: HOST_RULE_PRIORITY,
            from: String::new(),
            to: to.into(),
            table: HOST_TABLE,
            iif: String::new(),
            ipv6: false,
        }),
    )
}

/// A node: the overlay link, its address, a route and a rule toward a
/// peer, source NAT into the overlay.
fn node(remote: &str) -> Vec<pb::DesiredObject> {
    vec![
        vxlan(remote),
        address("self/address", "", "weft-vx0", "10.80.0.1/16"),
        route("peer/b/route", "", HOST_TABLE, "10.90.0.0/16", "weft-vx0"),
        rule("peer/b/rule", "", "10.90.0.0/16"),
        obj(
            "self/snat",
            Kind::HostSnat(pb::HostSnat {
                link: "weft-vx0".into(),
                address: "10.70.0.1".into(),
                except: vec!["10.1.0.0/16".into()],
            }),
        ),
    ]
}

/// A gateway's peering: its namespace, veth pair, WireGuard link and peer,
/// routes and NAT inside.
fn peering(port: u32, peer_key: &str) -> Vec<pb::DesiredObject> {
    vec![
        obj("peer/b/ns", Kind::Namespace(pb::Namespace { name: NS.into() })),
        obj(
            "peer/b/veth",
            Kind::Link(pb::Link {
                name: "weft-va".into(),
                namespace: String::new(),
                mtu: 1420,
                kind: Some(pb::link::Kind::Veth(pb::Veth {
                    peer_name: "weft-ia".into(),
                    peer_namespace: NS.into(),
                })),
            }),
        ),
        address("peer/b/veth/outer", "", "weft-va", "169.254.0.1/30"),
        address("peer/b/veth/inner", NS, "weft-ia", "169.254.0.2/30"),
        obj(
            "peer/b/wg",
            Kind::Link(pb::Link {
                name: "weft-wa".into(),
                namespace: NS.into(),
                mtu: 1420,
                kind: Some(pb::link::Kind::Wireguard(pb::Wireguard {
                    listen_port: port,
                    address: "169.254.100.1/30".into(),
                    peer_address: "169.254.100.2".into(),
                    peer_site: "b".into(),
                    reflectors: vec![],
                })),
            }),
        ),
        route("peer/b/ns/route", NS, 0, "10.1.0.0/16", "weft-ia"),
        route("peer/b/ns/tunnel", NS, 1, "0.0.0.0/0", "weft-wa"),
        obj(
            "peer/b/wgpeer",
            Kind::WireguardPeer(pb::WireguardPeer {
                link: "weft-wa".into(),
                namespace: NS.into(),
                public_key: peer_key.into(),
                endpoint: "192.168.2.1:51820".into(),
                allowed_ips: vec!["0.0.0.0/0".into()],
                persistent_keepalive: 25,
                punch: false,
                direct: String::new(),
                tls_port: 0,
            }),
        ),
        obj(
            "peer/b/nat",
            Kind::NatMap(pb::NatMap {
                namespace: NS.into(),
                real_cidr: "10.1.0.0/16".into(),
                local_cidr: "10.90.0.0/16".into(),
                tunnel: "weft-wa".into(),
            }),
        ),
    ]
}

/// What is on the host that is not weft's: never to be touched.
fn foreign(h: &mut FakeHost) {
    let host = h.ns.get_mut("").unwrap();
    host.links.insert(
        "eth0".into(),
        Link {
            ns: String::new(),
            name: "eth0".into(),
            kind: LinkKind::Other("veth".into()),
            mtu: 1500,
            up: true,
        },
    );
    host.addresses.insert(Address {
        ns: String::new(),
        link: "eth0".into(),
        cidr: "192.168.1.1/24".parse().unwrap(),
        no_prefix_route: false,
    });
    for (table, dst) in [(254, "0.0.0.0/0"), (254, "10.90.0.0/16"), (100, "10.1.0.0/16")] {
        let dst: ipnet::IpNet = dst.parse().unwrap();
        host.routes.insert(
            (table, dst),
            RawRoute {
                route: Route {
                    ns: String::new(),
                    table,
                    dst,
                    gateway: Some("192.168.1.254".parse().unwrap()),
                    dev: Some("eth0".into()),
                },
                kernel: false,
                special: false,
            },
        );
    }
    for (priority, table) in [(0, 255), (100, 100), (32766, 254), (32767, 253)] {
        host.rules.insert(Rule {
            ns: String::new(),
            family: Family::V4,
            priority,
            table,
            from: None,
            to: None,
            iif: None,
        });
    }
    host.tables.insert("filter".into(), None);
    h.ns.insert("other".into(), FakeNs::default());
    h.ns.insert("weft-lab-host".into(), FakeNs::default());
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().build().unwrap()
}

/// `objects` decoded, as the agent's door decodes them (each must).
fn decoded(objects: &[pb::DesiredObject]) -> Vec<(String, Object)> {
    objects
        .iter()
        .map(|o| {
            let d = weft_dataplane::desired::decode(o).unwrap_or_else(|e| panic!("{}: {e}", o.id));
            (o.id.clone(), d)
        })
        .collect()
}

/// The namespaces `objects` name.
fn namespaces_of(objects: &[pb::DesiredObject]) -> BTreeSet<Ns> {
    weft_dataplane::namespaces_of(decoded(objects).iter().map(|(_, o)| o))
}

/// Reconciles plane `p` to `objects`, decoded.
async fn reconcile_on(
    p: &mut DataPlane<Fake, Fake, Fake>,
    objects: &[pb::DesiredObject],
    claimed: &BTreeSet<Ns>,
    scopes: Option<&BTreeSet<Ns>>,
) -> weft_dataplane::Outcome {
    let d = decoded(objects);
    p.reconcile(d.iter().map(|(id, o)| (id.as_str(), o)), claimed, scopes)
        .await
}

fn plane(f: &Fake, node: bool) -> DataPlane<Fake, Fake, Fake> {
    DataPlane {
        net: f.clone(),
        fw: f.clone(),
        wg: f.clone(),
        node,
        underlay: None,
        believed: None,
    }
}

/// Reconciles the fake host to `objects`; the errors.
fn reconcile(f: &Fake, objects: &[pb::DesiredObject], claimed: &BTreeSet<Ns>) -> Vec<(String, String)> {
    let out = rt().block_on(reconcile_on(&mut plane(f, false), objects, claimed, None));
    assert!(out.failed.is_none(), "{:?}", out.failed);
    out.errors
}

/// What the fake host holds of weft's now, and what `objects` want of it.
fn observe_and_want(
    f: &Fake,
    objects: &[pb::DesiredObject],
    claimed: &BTreeSet<Ns>,
) -> (weft_dataplane::host::Observation, Desired) {
    let mut claimed = claimed.clone();
    claimed.extend(namespaces_of(objects));
    let mut p = plane(f, false);
    let seen = rt()
        .block_on(weft_dataplane::host::observe(
            &mut p.net, &mut p.fw, &mut p.wg, &claimed, None,
        ))
        .unwrap();
    let facts = weft_dataplane::desired::Facts::from_raw(&seen.host, None);
    let d = decoded(objects);
    let (want, bad) = weft_dataplane::desired::translate(d.iter().map(|(id, o)| (id.as_str(), o)), &facts, false);
    assert!(bad.is_empty(), "{bad:?}");
    (seen, want)
}

/// The plan the fake host would get for `objects` now, without running it.
fn plan_now(f: &Fake, objects: &[pb::DesiredObject], claimed: &BTreeSet<Ns>) -> Vec<Op> {
    let (seen, want) = observe_and_want(f, objects, claimed);
    weft_dataplane::plan::plan(&want, &seen.state, &seen.scopes)
}

/// Whether the host holds exactly `objects` (weft's part of it): every
/// desired link there, up, with its MTU; addresses, routes, rules, peers,
/// tables and namespaces equal.
fn holds(f: &Fake, objects: &[pb::DesiredObject], claimed: &BTreeSet<Ns>) -> Result<(), String> {
    let (seen, want) = observe_and_want(f, objects, claimed);
    let (d, o) = (&want.state, &seen.state);
    for (k, l) in &d.links {
        let Some(x) = o.links.get(k) else {
            return Err(format!("link {k:?} missing"));
        };
        if !x.up || (l.mtu != 0 && l.mtu != x.mtu) {
            return Err(format!("link {k:?} is {x:?}, not {l:?}"));
        }
    }
    if d.links.len() != o.links.len() {
        return Err(format!("links {:?} vs {:?}", d.links.keys(), o.links.keys()));
    }
    let eq = |what: &str, a: String, b: String| {
        if a == b {
            Ok(())
        } else {
            Err(format!("{what}: want {a}, have {b}"))
        }
    };
    eq("addresses", format!("{:?}", d.addresses), format!("{:?}", o.addresses))?;
    eq("routes", format!("{:?}", d.routes), format!("{:?}", o.routes))?;
    eq("rules", format!("{:?}", d.rules), format!("{:?}", o.rules))?;
    eq("peers", format!("{:?}", d.peers), format!("{:?}", o.peers))?;
    eq("tables", format!("{:?}", d.tables), format!("{:?}", o.tables))?;
    eq(
        "namespaces",
        format!("{:?}", d.namespaces),
        format!("{:?}", o.namespaces),
    )?;
    Ok(())
}

fn all() -> Vec<pb::DesiredObject> {
    let mut v = node("192.168.1.2");
    v.extend(peering(51820, KEY));
    v
}

fn fresh() -> Fake {
    let mut h = FakeHost::default();
    foreign(&mut h);
    Fake::new(h)
}

/// A peering that goes: its WireGuard link is removed on its own before
/// its namespace (which something else may still hold).
#[test]
fn a_namespace_that_goes_loses_its_wireguard_link_first() {
    let f = fresh();
    let want = all();
    assert_eq!(reconcile(&f, &want, &BTreeSet::new()), vec![]);
    let claimed = namespaces_of(&want);
    let ops = plan_now(&f, &node("192.168.1.2"), &claimed);
    let del_wg = ops
        .iter()
        .position(|o| matches!(o, Op::DelWireguard { ns, name } if ns == NS && name == "weft-wa"));
    let del_ns = ops.iter().position(|o| *o == Op::DeleteNamespace(NS.into()));
    assert!(matches!((del_wg, del_ns), (Some(w), Some(n)) if w < n), "{ops:#?}");
}

#[test]
fn a_hand_changed_vxlan_remote_is_repaired() {
    let f = fresh();
    let want = all();
    assert_eq!(reconcile(&f, &want, &BTreeSet::new()), vec![]);
    {
        let mut h = f.host();
        let l = h.ns.get_mut("").unwrap().links.get_mut("weft-vx0").unwrap();
        l.kind = LinkKind::Vxlan {
            vni: 7,
            local: "192.168.1.1".parse().unwrap(),
            remote: "192.168.1.99".parse().unwrap(),
            port: 4789,
        };
    }
    let ops = plan_now(&f, &want, &BTreeSet::new());
    assert!(ops.contains(&Op::DelLink {
        ns: String::new(),
        name: "weft-vx0".into()
    }));
    assert!(
        ops.iter()
            .any(|o| matches!(o, Op::AddLink(l) if l.name == "weft-vx0" && matches!(l.kind, LinkKind::Vxlan { remote, .. } if remote.to_string() == "192.168.1.2")))
    );
    reconcile(&f, &want, &BTreeSet::new());
    assert_eq!(plan_now(&f, &want, &BTreeSet::new()), vec![]);
}

#[test]
fn link_replacement_re_adds_its_unchanged_addresses_and_routes() {
    let f = fresh();
    let before = all();
    reconcile(&f, &before, &BTreeSet::new());
    // The controller moves the overlay to another gateway: only the link
    // object changes; its address and the route through it do not.
    let mut after = all();
    after[0] = vxlan("192.168.1.3");
    let ops = plan_now(&f, &after, &BTreeSet::new());
    let pos = |want: &dyn Fn(&Op) -> bool| ops.iter().position(want).unwrap_or_else(|| panic!("{ops:#?}"));
    let del = pos(&|o| matches!(o, Op::DelLink { name, .. } if name == "weft-vx0"));
    let add = pos(&|o| matches!(o, Op::AddLink(l) if l.name == "weft-vx0"));
    let addr = pos(&|o| matches!(o, Op::AddAddress(a) if a.link == "weft-vx0"));
    let route = pos(&|o| matches!(o, Op::SetRoute(r) if r.dev.as_deref() == Some("weft-vx0")));
    assert!(del < add && add < addr && addr < route, "{ops:#?}");
    assert_eq!(reconcile(&f, &after, &BTreeSet::new()), vec![]);
    assert_eq!(plan_now(&f, &after, &BTreeSet::new()), vec![]);
}

/// An address applied in its old form (with the kernel's prefix route) is
/// removed and added anew without it; the kernel drops the routes through
/// a link that loses its last address, so the routes through it are set
/// again in the same plan, after the address.
#[test]
fn an_address_changed_to_no_prefix_route_sets_the_routes_through_its_link_again() {
    let f = fresh();
    let before = all();
    reconcile(&f, &before, &BTreeSet::new());
    let mut after = all();
    let i = after.iter().position(|o| o.id == "self/address").unwrap();
    if let Some(Kind::Address(a)) = &mut after[i].kind {
        a.no_prefix_route = true;
    }
    let ops = plan_now(&f, &after, &BTreeSet::new());
    let pos = |want: &dyn Fn(&Op) -> bool| ops.iter().position(want).unwrap_or_else(|| panic!("{ops:#?}"));
    let del = pos(&|o| matches!(o, Op::DelAddress(a) if a.link == "weft-vx0" && !a.no_prefix_route));
    let add = pos(&|o| matches!(o, Op::AddAddress(a) if a.link == "weft-vx0" && a.no_prefix_route));
    let route = pos(&|o| matches!(o, Op::SetRoute(r) if r.dev.as_deref() == Some("weft-vx0")));
    assert!(del < add && add < route, "{ops:#?}");
    assert!(
        !ops.iter().any(|o| matches!(o, Op::DelLink { .. } | Op::AddLink(_))),
        "the link itself stays: {ops:#?}"
    );
    assert_eq!(reconcile(&f, &after, &BTreeSet::new()), vec![]);
    assert_eq!(plan_now(&f, &after, &BTreeSet::new()), vec![]);
}

#[test]
fn a_stray_route_in_wefts_table_and_a_stray_rule_at_its_priority_are_removed() {
    let f = fresh();
    let want = all();
    reconcile(&f, &want, &BTreeSet::new());
    let stray_route = Route {
        ns: String::new(),
        table: HOST_TABLE,
        dst: "10.99.0.0/16".parse().unwrap(),
        gateway: None,
        dev: Some("weft-vx0".into()),
    };
    let stray_rule = Rule {
        ns: String::new(),
        family: Family::V4,
        priority: HOST_RULE_PRIORITY,
        table: HOST_TABLE,
        from: None,
        to: Some("10.99.0.0/16".parse().unwrap()),
        iif: None,
    };
    {
        let mut h = f.host();
        let host = h.ns.get_mut("").unwrap();
        host.routes.insert(
            (HOST_TABLE, stray_route.dst),
            RawRoute {
                route: stray_route.clone(),
                kernel: false,
                special: false,
            },
        );
        host.rules.insert(stray_rule.clone());
    }
    let ops = plan_now(&f, &want, &BTreeSet::new());
    assert_eq!(ops, vec![Op::DelRule(stray_rule), Op::DelRoute(stray_route)]);
    reconcile(&f, &want, &BTreeSet::new());
    assert_eq!(plan_now(&f, &want, &BTreeSet::new()), vec![]);
}

#[test]
fn host_objects_that_are_not_wefts_are_never_touched() {
    let f = fresh();
    let untouched = |f: &Fake| {
        let h = f.host();
        let host = &h.ns[""];
        (
            host.links.get("eth0").cloned(),
            host.addresses
                .iter()
                .filter(|a| a.link == "eth0")
                .cloned()
                .collect::<Vec<_>>(),
            host.routes
                .values()
                .filter(|r| r.route.table != HOST_TABLE)
                .cloned()
                .collect::<Vec<_>>(),
            host.rules
                .iter()
                .filter(|r| r.priority != HOST_RULE_PRIORITY)
                .cloned()
                .collect::<Vec<_>>(),
            host.tables.get("filter").cloned(),
            h.ns.contains_key("other"),
            h.ns.contains_key("weft-lab-host"),
        )
    };
    let before = untouched(&f);
    // Everything, then nothing at all: weft removes all of its own.
    reconcile(&f, &all(), &BTreeSet::new());
    let claimed: BTreeSet<Ns> = [NS.to_string()].into();
    reconcile(&f, &[], &claimed);
    assert_eq!(untouched(&f), before);
    let h = f.host();
    assert!(!h.ns.contains_key(NS));
    assert!(
        h.ns[""].links.keys().all(|l| !l.starts_with("weft")),
        "{:?}",
        h.ns[""].links
    );
    assert!(!h.ns[""].tables.contains_key(NFT_TABLE));
    // A weft-named namespace weft did not make (a lab's host, say) stays.
    assert!(h.ns.contains_key("weft-lab-host"));
}

#[test]
fn a_changed_peer_key_and_a_deleted_interface_are_repaired() {
    let f = fresh();
    reconcile(&f, &all(), &BTreeSet::new());
    let mut want = node("192.168.1.2");
    want.extend(peering(51820, KEY2));
    let ops = plan_now(&f, &want, &BTreeSet::new());
    assert!(
        ops.iter()
            .any(|o| matches!(o, Op::RemovePeer { public_key, .. } if public_key.to_string() == KEY))
    );
    assert!(
        ops.iter()
            .any(|o| matches!(o, Op::SetPeer { peer, .. } if peer.public_key.to_string() == KEY2))
    );
    reconcile(&f, &want, &BTreeSet::new());
    // The WireGuard interface deleted by hand: a new device, its peer and
    // probe address again.
    f.host()
        .carry_out(&Op::DelLink {
            ns: NS.into(),
            name: "weft-wa".into(),
        })
        .unwrap();
    let ops = plan_now(&f, &want, &BTreeSet::new());
    assert!(
        ops.iter()
            .any(|o| matches!(o, Op::AddWireguard(l) if l.name == "weft-wa")),
        "{ops:#?}"
    );
    assert!(ops.iter().any(|o| matches!(o, Op::SetPeer { .. })));
    assert!(
        ops.iter()
            .any(|o| matches!(o, Op::AddAddress(a) if a.link == "weft-wa"))
    );
    reconcile(&f, &want, &BTreeSet::new());
    assert_eq!(plan_now(&f, &want, &BTreeSet::new()), vec![]);
}

#[test]
fn a_table_edited_by_hand_is_rewritten_and_an_old_accounting_table_removed() {
    let f = fresh();
    reconcile(&f, &all(), &BTreeSet::new());
    {
        let mut h = f.host();
        let host = h.ns.get_mut("").unwrap();
        host.tables.insert(OWN_TABLE.into(), None);
        host.tables.insert("ip weft_acct".into(), None);
        // The table of versions before dual stack, and an operator's
        // inet table that happens to start with weft's prefix.
        host.tables.insert(LEGACY_TABLE.into(), None);
        host.tables.insert("inet weftlabcut".into(), None);
    }
    let ops = plan_now(&f, &all(), &BTreeSet::new());
    assert!(ops.contains(&Op::DelTable {
        ns: String::new(),
        name: "ip weft_acct".into()
    }));
    assert!(
        ops.iter()
            .any(|o| matches!(o, Op::SetTable { ns, .. } if ns.is_empty()))
    );
    // `ip weft` goes with the write of its successor (one transaction),
    // not on its own before it; the operator's table is not weft's.
    assert!(
        !ops.iter()
            .any(|o| matches!(o, Op::DelTable { name, .. } if name == LEGACY_TABLE || name.contains("weftlabcut"))),
        "{ops:?}"
    );
    reconcile(&f, &all(), &BTreeSet::new());
    assert_eq!(plan_now(&f, &all(), &BTreeSet::new()), vec![]);
    let h = f.host();
    assert!(!h.ns[""].tables.contains_key(LEGACY_TABLE));
    assert!(h.ns[""].tables.contains_key("inet weftlabcut"));
}

/// Random desired states and hand edits: the plan always converges.
#[path = "plan/props.rs"]
mod props;
