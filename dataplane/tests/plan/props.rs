//! Property tests of the planner: from any desired state made of a few
//! choices, and after any hand edits of the host, one reconcile leaves
//! nothing to do, and what is not weft's is untouched.

use proptest::prelude::*;

use super::*;

/// A desired state from a few choices, always self-consistent (what an
/// object needs is desired with it).
fn desired_from(c: &Choice) -> Vec<pb::DesiredObject> {
    let mut v = Vec::new();
    if c.node {
        v.extend(node(if c.remote { "192.168.1.2" } else { "192.168.1.3" }));
        if !c.snat {
            v.retain(|o| !matches!(o.kind, Some(Kind::HostSnat(_))));
        }
        for d in &c.routes {
            v.push(route(
                &format!("peer/x{d}/route"),
                "",
                HOST_TABLE,
                &format!("10.{d}.0.0/16"),
                "weft-vx0",
            ));
            v.push(rule(&format!("peer/x{d}/rule"), "", &format!("10.{d}.0.0/16")));
        }
    }
    if c.peering {
        v.extend(peering(
            if c.port { 51820 } else { 51821 },
            if c.key { KEY } else { KEY2 },
        ));
        if !c.nat {
            v.retain(|o| !matches!(o.kind, Some(Kind::NatMap(_))));
        }
    }
    v
}

#[derive(Clone, Debug)]
struct Choice {
    node: bool,
    remote: bool,
    snat: bool,
    routes: Vec<u8>,
    peering: bool,
    port: bool,
    key: bool,
    nat: bool,
}

fn choice() -> impl Strategy<Value = Choice> {
    (
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        proptest::collection::vec(100u8..104, 0..3),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(node, remote, snat, routes, peering, port, key, nat)| Choice {
            node,
            remote,
            snat,
            routes,
            peering,
            port,
            key,
            nat,
        })
}

/// A hand edit of the host.
#[derive(Clone, Debug)]
enum Edit {
    DelLink(&'static str, &'static str),
    DelAddresses(&'static str),
    StrayRoute(u8),
    StrayRule(u8),
    HandEditedTable(&'static str),
    LinkDown(&'static str, &'static str),
    LinkMtu(&'static str, &'static str),
    DelNamespace,
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        prop::sample::select(vec![
            ("", "weft-vx0"),
            ("", "weft-va"),
            (NS, "weft-ia"),
            (NS, "weft-wa")
        ])
        .prop_map(|(ns, l)| Edit::DelLink(ns, l)),
        prop::sample::select(vec!["", NS]).prop_map(Edit::DelAddresses),
        (100u8..104).prop_map(Edit::StrayRoute),
        (100u8..104).prop_map(Edit::StrayRule),
        prop::sample::select(vec!["", NS]).prop_map(Edit::HandEditedTable),
        prop::sample::select(vec![("", "weft-vx0"), (NS, "weft-ia")]).prop_map(|(ns, l)| Edit::LinkDown(ns, l)),
        prop::sample::select(vec![("", "weft-va"), (NS, "weft-wa")]).prop_map(|(ns, l)| Edit::LinkMtu(ns, l)),
        Just(Edit::DelNamespace),
    ]
}

fn apply_edit(f: &Fake, e: &Edit) {
    let mut h = f.host();
    match e {
        Edit::DelLink(ns, l) => {
            let _ = h.carry_out(&Op::DelLink {
                ns: ns.to_string(),
                name: l.to_string(),
            });
        }
        Edit::DelAddresses(ns) => {
            if let Some(s) = h.ns.get_mut(*ns) {
                s.addresses.retain(|a| !a.link.starts_with("weft"));
            }
        }
        Edit::StrayRoute(d) => {
            let dst: ipnet::IpNet = format!("10.{d}.0.0/16").parse().unwrap();
            h.ns.get_mut("").unwrap().routes.insert(
                (HOST_TABLE, dst),
                RawRoute {
                    route: Route {
                        ns: String::new(),
                        table: HOST_TABLE,
                        dst,
                        gateway: Some("10.80.0.9".parse().unwrap()),
                        dev: None,
                    },
                    kernel: false,
                    special: false,
                },
            );
        }
        Edit::StrayRule(d) => {
            h.ns.get_mut("").unwrap().rules.insert(Rule {
                ns: String::new(),
                family: Family::V4,
                priority: HOST_RULE_PRIORITY,
                table: 9,
                from: Some(format!("10.{d}.0.0/16").parse().unwrap()),
                to: None,
                iif: None,
            });
        }
        Edit::HandEditedTable(ns) => {
            if let Some(s) = h.ns.get_mut(*ns) {
                s.tables.insert(OWN_TABLE.into(), None);
            }
        }
        Edit::LinkDown(ns, l) => {
            if let Some(link) = h.ns.get_mut(*ns).and_then(|s| s.links.get_mut(*l)) {
                link.up = false;
            }
        }
        Edit::LinkMtu(ns, l) => {
            if let Some(link) = h.ns.get_mut(*ns).and_then(|s| s.links.get_mut(*l)) {
                link.mtu = 1280;
            }
        }
        Edit::DelNamespace => {
            let _ = h.carry_out(&Op::DeleteNamespace(NS.into()));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// From any earlier state, edited by hand in any way, one reconcile
    /// reaches the desired state: observing again plans nothing, and what
    /// is not weft's is as it was.
    #[test]
    fn property_a_carried_out_plan_leaves_an_empty_plan(
        earlier in choice(),
        now in choice(),
        edits in proptest::collection::vec(edit(), 0..4),
    ) {
        let f = fresh();
        let foreign_before = {
            let h = f.host();
            (h.ns[""].links.get("eth0").cloned(), h.ns[""].rules.iter().filter(|r| r.priority != HOST_RULE_PRIORITY).cloned().collect::<Vec<_>>(), h.ns.contains_key("other"))
        };
        let first = desired_from(&earlier);
        prop_assert_eq!(reconcile(&f, &first, &BTreeSet::new()), vec![]);
        for e in &edits {
            apply_edit(&f, e);
        }
        let want = desired_from(&now);
        let claimed = namespaces_of(&first);
        prop_assert_eq!(reconcile(&f, &want, &claimed), vec![]);
        prop_assert_eq!(plan_now(&f, &want, &claimed), vec![]);
        prop_assert_eq!(holds(&f, &want, &claimed), Ok(()));
        let h = f.host();
        let foreign_after = (h.ns[""].links.get("eth0").cloned(), h.ns[""].rules.iter().filter(|r| r.priority != HOST_RULE_PRIORITY).cloned().collect::<Vec<_>>(), h.ns.contains_key("other"));
        prop_assert_eq!(foreign_after, foreign_before);
        prop_assert_eq!(h.ns.contains_key(NS), now.peering);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// A change planned from what the last reconcile left (not read from
    /// the host) takes the host from any state to any other exactly as a
    /// read would: a read then plans nothing, and the belief carries on
    /// through a second change.
    #[test]
    fn property_a_change_planned_from_the_belief_reaches_the_desired_state(
        earlier in choice(),
        now in choice(),
        later in choice(),
    ) {
        let f = fresh();
        let mut p = plane(&f, false);
        let first = desired_from(&earlier);
        let none = BTreeSet::new();
        let out = rt().block_on(reconcile_on(&mut p, &first, &none, None));
        prop_assert!(out.errors.is_empty() && out.failed.is_none(), "{:?}", out);
        prop_assert!(p.believed.is_some(), "a clean whole reconcile leaves a belief");
        let mut applied = first;
        for next in [desired_from(&now), desired_from(&later)] {
            // The namespaces of what changed, as the agent scopes a change.
            let old: std::collections::BTreeMap<&str, &pb::DesiredObject> =
                applied.iter().map(|o| (o.id.as_str(), o)).collect();
            let new: std::collections::BTreeMap<&str, &pb::DesiredObject> =
                next.iter().map(|o| (o.id.as_str(), o)).collect();
            let touched: Vec<pb::DesiredObject> = next
                .iter()
                .filter(|o| old.get(o.id.as_str()) != Some(o))
                .chain(applied.iter().filter(|o| !new.contains_key(o.id.as_str())))
                .cloned()
                .collect();
            let scopes = namespaces_of(&touched);
            let claimed = namespaces_of(&applied);
            let out = rt().block_on(reconcile_on(&mut p, &next, &claimed, Some(&scopes)));
            prop_assert!(out.errors.is_empty() && out.failed.is_none(), "{:?}", out);
            prop_assert_eq!(plan_now(&f, &next, &claimed), vec![]);
            prop_assert_eq!(holds(&f, &next, &claimed), Ok(()));
            prop_assert!(p.believed.is_some());
            applied = next;
        }
    }
}

/// A belief that is wrong (the host changed by hand since) makes a change
/// fail or leave drift that the next resync repairs: an error forgets the
/// belief, and a resync reads the host again.
#[test]
fn a_wrong_belief_is_forgotten_on_an_error_and_a_resync_reads_the_host() {
    let f = fresh();
    let mut p = plane(&f, false);
    let want = all();
    let none = BTreeSet::new();
    assert!(
        rt().block_on(reconcile_on(&mut p, &want, &none, None))
            .errors
            .is_empty()
    );
    assert!(p.believed.is_some());
    // By hand: the overlay link goes.
    let _ = f.host().carry_out(&Op::DelLink {
        ns: String::new(),
        name: "weft-vx0".into(),
    });
    // A change elsewhere plans from the belief (the link still "there").
    let claimed = namespaces_of(&want);
    let _ = rt().block_on(reconcile_on(&mut p, &want, &claimed, Some(&BTreeSet::new())));
    // The resync reads the host and repairs it.
    let out = rt().block_on(reconcile_on(&mut p, &want, &claimed, None));
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert_eq!(holds(&f, &want, &claimed), Ok(()));
    assert!(p.believed.is_some());
}
