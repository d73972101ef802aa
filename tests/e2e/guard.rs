//! The agent's guard with the real node agent in a network namespace: a
//! desired state that reaches past what weft owns (a route in table main,
//! a rule at priority 0, an address on eth0 that the controller then
//! deletes, a namespace path with "..", SNAT on eth0; on a link of weft's,
//! an address whose prefix route covers half the Internet and addresses
//! that are the controller's or a LAN router's; a route over a LAN the host
//! is attached to, a rule over its resolver) is refused, reported, and
//! leaves the host exactly as it was. The hostile state comes the way a
//! tampered state file or a compromised controller would hand it over: as
//! the agent's stored desired state, applied at start, then reconciled
//! against the controller. Needs root: run under CI=true.

use std::time::Duration;

use weft_agent::desired::StateFile;
use weft_proto::v1 as pb;
use weft_proto::v1::desired_object::Kind;
use weft_tests::netns::{self, Lab};
use weft_tests::{ControllerSpec, bin, eventually, weftctl_json};

fn obj(id: &str, kind: Kind) -> pb::DesiredObject {
    pb::DesiredObject {
        id: id.into(),
        kind: Some(kind),
    }
}

/// Everything of the host's networking a test can read.
fn host_state(lab: &Lab, ns: &str) -> String {
    [
        // IPv4: the link-local IPv6 address goes tentative → valid on its own.
        vec!["ip", "-4", "-d", "addr"],
        vec!["ip", "-4", "rule"],
        vec!["ip", "-4", "route", "show", "table", "all"],
        vec!["ip", "-d", "link"],
        vec!["nft", "list", "ruleset"],
    ]
    .iter()
    .map(|cmd| weft_tests::stdout(&netns::must(lab.exec(ns, cmd), "read the host")))
    .collect::<Vec<_>>()
    .join("\n")
}

/// A site's controller (on etcd when `etcd`) and one node with the real
/// node agent, each in its own namespace; the agent enrolled and watching.
struct Site {
    lab: Lab,
    dir: tempfile::TempDir,
    ctl: String,
    node: String,
    agent: usize,
    target: String,
    state: std::path::PathBuf,
}

fn site(tag: &str, etcd: bool) -> Site {
    let dir = tempfile::Builder::new().prefix("weft-guard").tempdir().unwrap();
    let mut lab = Lab::new(tag);
    lab.lan();
    let (ctl, node) = (lab.host("ctl"), lab.host("node"));
    lab.plug(&ctl, "192.168.78.1/24");
    lab.plug(&node, "192.168.78.11/24");
    netns::must(
        lab.exec(&node, &["ip", "route", "add", "default", "via", "192.168.78.1"]),
        "default route",
    );
    let mut spec = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("site"))
        .log(&dir.path().join("controller.log"))
        .pod("10.1.0.0/16")
        .listen("192.168.78.1:7443");
    if etcd {
        lab.spawn_etcd(&ctl, &dir.path().join("etcd"))
            .expect("etcd is installed");
        spec = spec.etcd("http://127.0.0.1:2379");
    }
    let target = lab.controller(&ctl, spec);
    let state = dir.path().join("n1");
    let mut args = weft_tests::enrolling_agent_args(
        &target,
        "node",
        "n1",
        "https://192.168.78.1:7443",
        "192.168.78.11",
        &state,
        "1s",
    );
    args.extend(["--subnet".to_string(), "10.1.0.0/24".to_string()]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let agent = lab.spawn(&node, &bin("weft-node-agent"), &refs, &dir.path().join("agent.log"));
    eventually("the node enrolled and watching", Duration::from_secs(20), || {
        lab.proc(agent).log_text().contains("watching").then_some(())
    });
    Site {
        lab,
        dir,
        ctl,
        node,
        agent,
        target,
        state,
    }
}

#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn a_hostile_desired_state_is_refused_and_the_host_is_untouched() {
    if !netns::require_root() {
        return;
    }
    let Site {
        mut lab,
        dir: _dir,
        node,
        agent,
        state,
        ..
    } = site("guard", false);
    weft_tests::step("a second LAN outside the fabric");
    // A second LAN the host is attached to outside the fabric, with a
    // router on it.
    for cmd in [
        &["ip", "link", "add", "lan2", "type", "veth", "peer", "name", "lan2p"][..],
        &["ip", "link", "set", "lan2p", "up"],
        &["ip", "addr", "add", "172.20.5.7/24", "dev", "lan2"],
        &["ip", "addr", "add", "2001:db8:5::7/64", "dev", "lan2", "nodad"],
        &["ip", "link", "set", "lan2", "up"],
        // An IPv6 network on that LAN that no address of the host names
        // (as router advertisements route one on-link beside a DHCPv6 /128).
        &["ip", "-6", "route", "add", "2001:db8:6::/64", "dev", "lan2"],
        &["ip", "route", "add", "10.66.0.0/16", "via", "172.20.5.1"],
    ] {
        netns::must(lab.exec(&node, cmd), "the second LAN");
    }
    std::thread::sleep(Duration::from_secs(1));
    lab.proc(agent).stop();
    let before = host_state(&lab, &node);

    weft_tests::step("the stored state turned hostile");
    // The stored state gains what a compromised controller would send.
    let file = StateFile::new(&state);
    let mut desired = file.load().unwrap().unwrap_or_default();
    let hostile = [
        obj(
            "hostile/route-main",
            // (Through eth0 too it would be refused when decoded, for the
            // device; the table is the guard's to refuse.)
            Kind::Route(pb::Route {
                namespace: String::new(),
                table: 254,
                destination: "10.99.0.0/16".into(),
                gateway: "192.168.78.1".into(),
                device: String::new(),
                peer_site: String::new(),
            }),
        ),
        obj(
            "hostile/rule-0",
            Kind::Rule(pb::Rule {
                namespace: String::new(),
                priority: 0,
                from: String::new(),
                to: "10.99.0.0/16".into(),
                table: 7765,
                iif: String::new(),
                ipv6: false,
            }),
        ),
        // Held as if applied: the controller's snapshot, which lacks it,
        // then asks the agent to delete it, i.e. to delete eth0's address.
        obj(
            "hostile/eth0-address",
            Kind::Address(pb::Address {
                link: "eth0".into(),
                namespace: String::new(),
                cidr: "192.168.78.11/24".into(),
                no_prefix_route: false,
            }),
        ),
        obj(
            "hostile/netns",
            Kind::Namespace(pb::Namespace {
                name: "weft-x/../../proc/1/ns/net".into(),
            }),
        ),
        obj(
            "hostile/snat",
            Kind::HostSnat(pb::HostSnat {
                link: "eth0".into(),
                address: "10.70.0.9".into(),
                except: vec![],
            }),
        ),
    ];
    weft_tests::step("a weft link and what must not go on it");
    // A link of weft's (allowed), and what must not go on it or through it:
    // an address whose prefix route covers half the Internet, the
    // controller's and a LAN router's addresses (made local, the host
    // would lose them), a route over the second LAN, and a rule over the
    // host's resolver (the one the agent reads in /etc/resolv.conf).
    let evil_addr = |id: &str, cidr: &str| {
        obj(
            id,
            Kind::Address(pb::Address {
                link: "weft-evil".into(),
                namespace: String::new(),
                cidr: cidr.into(),
                no_prefix_route: false,
            }),
        )
    };
    let mut hostile = hostile.to_vec();
    let mut expected = vec![
        ("hostile/route-main", "table 254"),
        ("hostile/rule-0", "priority 0"),
        ("hostile/eth0-address", "\"eth0\""),
        ("hostile/netns", "namespaces"),
        ("hostile/snat", "\"eth0\""),
        ("hostile/address-half", "/8 or narrower"),
        ("hostile/address-controller", "a controller"),
        ("hostile/address-router", "a gateway of the host's table main"),
        ("hostile/route-lan2", "the network of lan2"),
        ("hostile/address-neighbour", "the network of lan2"),
        ("hostile/address-ipv6", "the network of lan2"),
        ("hostile/route-link-local", "link-local"),
        ("hostile/route-on-link-v6", "the network of lan2"),
    ];
    hostile.extend([
        obj(
            "hostile/link",
            Kind::Link(pb::Link {
                name: "weft-evil".into(),
                namespace: String::new(),
                mtu: 0,
                kind: Some(pb::link::Kind::Bridge(pb::Bridge {})),
            }),
        ),
        evil_addr("hostile/address-half", "0.0.0.1/1"),
        evil_addr("hostile/address-controller", "192.168.78.1/32"),
        evil_addr("hostile/address-router", "172.20.5.1/32"),
        // A LAN neighbour's address, made local, would cut the host off
        // from it, in either family; the host's link-local space is never
        // weft's.
        evil_addr("hostile/address-neighbour", "172.20.5.77/32"),
        evil_addr("hostile/address-ipv6", "2001:db8:5::77/128"),
        obj(
            "hostile/route-on-link-v6",
            Kind::Route(pb::Route {
                namespace: String::new(),
                table: 7765,
                destination: "2001:db8:6:0:8000::/65".into(),
                gateway: String::new(),
                device: "weft-evil".into(),
                peer_site: String::new(),
            }),
        ),
        obj(
            "hostile/route-link-local",
            Kind::Route(pb::Route {
                namespace: String::new(),
                table: 7765,
                destination: "fe80::/10".into(),
                gateway: String::new(),
                device: "weft-evil".into(),
                peer_site: String::new(),
            }),
        ),
        obj(
            "hostile/route-lan2",
            Kind::Route(pb::Route {
                namespace: String::new(),
                table: 7765,
                destination: "172.20.5.128/25".into(),
                gateway: String::new(),
                device: "weft-evil".into(),
                peer_site: String::new(),
            }),
        ),
    ]);
    let resolver = std::fs::read_to_string("/etc/resolv.conf")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix("nameserver"))
        .find_map(|a| a.trim().parse::<std::net::Ipv4Addr>().ok());
    if let Some(r) = resolver {
        hostile.push(obj(
            "hostile/rule-resolver",
            Kind::Rule(pb::Rule {
                namespace: String::new(),
                priority: 7765,
                from: String::new(),
                to: format!("{r}/32"),
                table: 7765,
                iif: String::new(),
                ipv6: false,
            }),
        ));
        expected.push(("hostile/rule-resolver", "a resolver of the host"));
    } else {
        println!("NOT RUN: the rule over the host's resolver (no IPv4 nameserver in /etc/resolv.conf)");
    }
    for o in &hostile {
        desired
            .objects
            .insert(o.id.clone(), weft_agent::desired::Held::from(o.clone()));
    }
    file.save(&desired).unwrap();

    lab.respawn(agent);
    let log = eventually("every hostile object refused", Duration::from_secs(20), || {
        let log = lab.proc(agent).log_text();
        expected
            .iter()
            .all(|(id, _)| {
                log.lines()
                    .any(|l| l.contains("refused a desired object") && l.contains(id))
            })
            .then_some(log)
    });
    for (id, why) in &expected {
        let line = log.lines().find(|l| l.contains("refused") && l.contains(id)).unwrap();
        assert!(line.contains(why), "{id}: {line}");
    }
    weft_tests::step("reconciled against the controller");
    // Reconciled against the controller (whose snapshot deletes them all)
    // and through a few resyncs: the host is as it was.
    eventually("the agent watching again", Duration::from_secs(20), || {
        (lab.proc(agent).log_text().matches("watching").count() >= 1).then_some(())
    });
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(host_state(&lab, &node), before, "the host changed");
    let stored = file.load().unwrap().unwrap_or_default();
    assert!(
        stored.objects.keys().all(|k| !k.starts_with("hostile/")),
        "the controller's snapshot should have replaced them: {:?}",
        stored.objects.keys().collect::<Vec<_>>()
    );
    weft_tests::step("no foreign namespace opened");
    // A namespace outside weft's was never opened or made.
    let netns_list = weft_tests::stdout(&weft_tests::run(
        std::process::Command::new("ip").args(["netns", "list"]),
    ));
    assert!(!netns_list.contains("proc"), "{netns_list}");
}

/// A compromised store: a peering record written straight into etcd whose
/// local view covers the node's own underlay address. The controller
/// renders the node a rule for it (it trusts its store); the node's guard
/// refuses it, reports the refusal (the admin sees it on the node), and the
/// host keeps its own routing (and so its controller connection).
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn a_compromised_store_cannot_route_a_hosts_own_traffic() {
    if !netns::require_root() || weft_tests::require_tool("etcd").is_none() {
        return;
    }
    let mut s = site("guardst", true);
    weft_tests::step("a dry-run gateway");
    // The node's part of the desired state needs an active gateway: a
    // dry-run one (it changes nothing on its host).
    let gw_ns = s.lab.host("gw");
    s.lab.plug(&gw_ns, "192.168.78.10/24");
    let mut args = weft_tests::enrolling_agent_args(
        &s.target,
        "gateway",
        "gw",
        "https://192.168.78.1:7443",
        "192.168.78.10",
        &s.dir.path().join("gw"),
        "1s",
    );
    args.extend(["--endpoint", "192.168.78.10:51820", "--dry-run"].map(String::from));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let gw = s
        .lab
        .spawn(&gw_ns, &bin("weft-gateway-agent"), &refs, &s.dir.path().join("gw.log"));
    eventually("the gateway watching", Duration::from_secs(20), || {
        s.lab.proc(gw).log_text().contains("watching").then_some(())
    });
    std::thread::sleep(Duration::from_secs(2));
    let before = host_state(&s.lab, &s.node);

    let record = serde_json::json!({
        "site_id": "evil",
        "state": "negotiated",
        "views": [{"kind": "workload", "real": "10.9.0.0/16", "local": "192.168.78.0/24", "pool": null}],
        "created_at_ms": 0,
        "listen_port": 51821,
    });
    netns::must(
        s.lab.exec(
            &s.ctl,
            &[
                "etcdctl",
                "--endpoints",
                "http://127.0.0.1:2379",
                "put",
                "/weft/sites/site-a/peerings/evil",
                &record.to_string(),
            ],
        ),
        "etcdctl put",
    );
    weft_tests::step("the refusal reaches the admin");
    // The refusal reaches the admin as the node's object error.
    let errors = eventually("the node reports the refusal", Duration::from_secs(20), || {
        let nodes = weftctl_json(&s.target, &["nodes"]);
        let errs = nodes["nodes"][0]["status"]["errors"].clone();
        errs.as_array()
            .is_some_and(|e| {
                e.iter()
                    .any(|e| e.as_str().unwrap_or("").contains("refused by the agent"))
            })
            .then_some(errs)
    });
    assert!(errors.to_string().contains("192.168.78.11"), "{errors}");
    std::thread::sleep(Duration::from_secs(2));
    weft_tests::step("the host's state unchanged");
    // Rules, routes, links and the NAT table as they were; weft's own
    // accounting table may count the new peer (it only counts).
    // (The counters and their chains live in weft's one table, `inet weft`:
    // every line of them goes, and the bare closing braces with them.)
    let without_accounting = |text: &str| {
        text.lines()
            .filter(|l| {
                let t = l.trim();
                !(t == "}"
                    || ["counter", "acct_", "packets", "priority -200"]
                        .iter()
                        .any(|w| t.contains(w)))
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(
        without_accounting(&host_state(&s.lab, &s.node)),
        without_accounting(&before),
        "the node's host changed"
    );
    weft_tests::step("still connected");
    // Still connected and reporting.
    let n = weftctl_json(&s.target, &["nodes"]);
    assert_eq!(n["nodes"][0]["status"]["ready"], true, "{n}");
}
