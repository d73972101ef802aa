//! The data plane on a real kernel, in network namespaces: a controller, a
//! gateway and two nodes on a LAN; the agents (not in dry-run) build the
//! VXLAN overlay with rtnetlink, and traffic crosses it.

use std::time::Duration;

use weft_tests::netns::{Lab, require_root};
use weft_tests::{bin, eventually, weftctl_json};

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn overlay_between_nodes_and_the_gateway_in_namespaces() {
    if !require_root() {
        return;
    }
    let dir = tempfile::Builder::new().prefix("weft-dp").tempdir().unwrap();
    let mut lab = Lab::new("dp");
    lab.lan();
    let ctl = lab.host("ctl");
    let gw = lab.host("gw");
    let n1 = lab.host("n1");
    let n2 = lab.host("n2");
    for (ns, ip) in [
        (&ctl, "192.168.77.1/24"),
        (&gw, "192.168.77.10/24"),
        (&n1, "192.168.77.11/24"),
        (&n2, "192.168.77.12/24"),
    ] {
        lab.plug(ns, ip);
    }
    let data = dir.path().join("ctl");
    let sock = data.join("admin.sock");
    lab.spawn(
        &ctl,
        &bin("weft-controller"),
        &[
            "--site-id",
            "site-a",
            "--pod-cidr",
            "10.1.0.0/16",
            "--data-dir",
            data.to_str().unwrap(),
            "--listen",
            "192.168.77.1:7443",
        ],
        &dir.path().join("ctl.log"),
    );
    let target = format!("unix:{}", sock.display());
    eventually("the controller", Duration::from_secs(20), || {
        std::os::unix::net::UnixStream::connect(&sock).ok()
    });

    let mut agent = |kind: &str, name: &str, ns: &str, underlay: &str, extra: &[&str]| {
        let t = weftctl_json(&target, &["token", "create", "--role", kind, "--name", name]);
        let state = dir.path().join(name);
        let mut args = vec![
            "--controller",
            "https://192.168.77.1:7443",
            "--name",
            name,
            "--underlay-ip",
            underlay,
            "--token",
            t["token"].as_str().unwrap(),
            "--ca-fingerprint",
            t["ca_fingerprint"].as_str().unwrap(),
            "--state-dir",
            state.to_str().unwrap(),
            "--resync-interval",
            "1s",
        ];
        args.extend(extra);
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        lab.spawn(
            ns,
            &bin(&format!("weft-{kind}-agent")),
            &refs,
            &dir.path().join(format!("{name}.log")),
        )
    };
    agent(
        "gateway",
        "gw",
        &gw,
        "192.168.77.10",
        &["--endpoint", "192.168.77.10:51820"],
    );
    agent("node", "n1", &n1, "192.168.77.11", &[]);
    agent("node", "n2", &n2, "192.168.77.12", &[]);

    // The nodes get their VXLAN end toward the gateway, with its address.
    for ns in [&n1, &n2] {
        eventually("the node's overlay link", Duration::from_secs(20), || {
            let o = stdout(&lab.exec(ns, &["ip", "-d", "addr", "show", "weft-vx0"]));
            (o.contains("vxlan id") && o.contains("remote 192.168.77.10") && o.contains("inet 10.80.")).then_some(())
        });
    }
    // The gateway: one tunnel per node, routes to both node subnets in table 7765, and its rules.
    let gw_routes = eventually("the gateway's routes", Duration::from_secs(20), || {
        let o = stdout(&lab.exec(&gw, &["ip", "route", "show", "table", "7765"]));
        (o.contains("10.1.0.0/24") && o.contains("10.1.1.0/24")).then_some(o)
    });
    assert_eq!(
        gw_routes.lines().filter(|l| l.contains("/24")).count(),
        2,
        "one route per node subnet:\n{gw_routes}"
    );
    let rules = stdout(&lab.exec(&gw, &["ip", "rule"]));
    assert!(
        rules.contains("7765:") && rules.contains("to 10.1.0.0/16 lookup 7765"),
        "{rules}"
    );
    let links = stdout(&lab.exec(&gw, &["ip", "-br", "link"]));
    assert_eq!(links.lines().filter(|l| l.starts_with("weft-n")).count(), 2, "{links}");

    // Traffic crosses the overlay: each node pings the gateway's overlay address.
    let gw_ip = weftctl_json(&target, &["gateways"])["gateways"][0]["internal_ip"]
        .as_str()
        .unwrap()
        .to_string();
    for ns in [&n1, &n2] {
        let o = lab.exec(ns, &["ping", "-c", "3", "-i", "0.2", "-W", "1", &gw_ip]);
        if !o.status.success() {
            let mut diag = String::new();
            for h in [ns.as_str(), gw.as_str()] {
                for cmd in [
                    &["ip", "-d", "-s", "link"][..],
                    &["ip", "addr"],
                    &["ip", "neigh"],
                    &["ip", "route", "show", "table", "all"],
                    &["ip", "rule"],
                    &["bridge", "fdb", "show"],
                    &["sysctl", "net.ipv4.conf.all.rp_filter"],
                ] {
                    diag.push_str(&format!("--- {h}: {}\n{}\n", cmd.join(" "), stdout(&lab.exec(h, cmd))));
                }
            }
            panic!("ping from {ns} to {gw_ip} over VXLAN failed:\n{}\n{diag}", stdout(&o));
        }
    }

    // The agents report the state applied, without errors.
    let nodes = weftctl_json(&target, &["nodes"]);
    for n in nodes["nodes"].as_array().unwrap() {
        assert_eq!(n["status"]["ready"], true, "{n}");
        assert!(n["status"]["errors"].as_array().unwrap().is_empty(), "{n}");
    }

    // Drift: a route and a rule deleted by hand come back at the next resync.
    let o = lab.exec(&gw, &["ip", "route", "del", "10.1.0.0/24", "table", "7765"]);
    assert!(o.status.success());
    let o = lab.exec(&gw, &["ip", "rule", "del", "priority", "7765", "to", "10.1.0.0/16"]);
    assert!(o.status.success());
    let repaired = (0..100).any(|_| {
        let routes = stdout(&lab.exec(&gw, &["ip", "route", "show", "table", "7765"]));
        let rules = stdout(&lab.exec(&gw, &["ip", "rule"]));
        let ok = routes.contains("10.1.0.0/24") && rules.contains("to 10.1.0.0/16 lookup 7765");
        if !ok {
            std::thread::sleep(Duration::from_millis(100));
        }
        ok
    });
    assert!(
        repaired,
        "not repaired within 10 s; gateway log:\n{}",
        lab.proc(1).log_text()
    );

    // Removing a node withdraws its tunnel and route from the gateway.
    weftctl_json(&target, &["node", "remove", "n2"]);
    eventually("n2's tunnel gone from the gateway", Duration::from_secs(20), || {
        let links = stdout(&lab.exec(&gw, &["ip", "-br", "link"]));
        let routes = stdout(&lab.exec(&gw, &["ip", "route", "show", "table", "7765"]));
        (links.lines().filter(|l| l.starts_with("weft-n")).count() == 1 && !routes.contains("10.1.1.0/24"))
            .then_some(())
    });
}
