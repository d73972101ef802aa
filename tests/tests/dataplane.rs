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

/// Two sites, each a controller and a gateway in namespaces on one WAN. Once
/// the controllers peer, each gateway builds the peering's namespace and a
/// userspace WireGuard device in it (its UDP socket on the gateway's
/// underlay) with the other gateway as peer, and the tunnel handshakes.
#[test]
fn gateways_of_peered_sites_bring_up_wireguard() {
    if !require_root() {
        return;
    }
    let dir = tempfile::Builder::new().prefix("weft-dp").tempdir().unwrap();
    let mut lab = Lab::new("wg");
    lab.lan();
    let hosts: Vec<(String, &str)> = [
        ("ctla", "192.168.78.1/24"),
        ("ctlb", "192.168.78.2/24"),
        ("gwa", "192.168.78.10/24"),
        ("gwb", "192.168.78.20/24"),
    ]
    .iter()
    .map(|(n, ip)| (lab.host(n), *ip))
    .collect();
    for (ns, ip) in &hosts {
        lab.plug(ns, ip);
    }
    // The gateways create these; the lab deletes them at the end whatever happens.
    lab.adopt(&weft_controller::render::peering_namespace("site-b"));
    lab.adopt(&weft_controller::render::peering_namespace("site-a"));
    let (ctla, ctlb, gwa, gwb) = (
        hosts[0].0.clone(),
        hosts[1].0.clone(),
        hosts[2].0.clone(),
        hosts[3].0.clone(),
    );

    let controller = |lab: &mut Lab, ns: &str, site: &str, pod: &str, ip: &str| {
        let data = dir.path().join(site);
        lab.spawn(
            ns,
            &bin("weft-controller"),
            &[
                "--site-id",
                site,
                "--pod-cidr",
                pod,
                "--data-dir",
                data.to_str().unwrap(),
                "--listen",
                &format!("{ip}:7443"),
            ],
            &dir.path().join(format!("{site}.log")),
        );
        let sock = data.join("admin.sock");
        eventually("a controller", Duration::from_secs(20), || {
            std::os::unix::net::UnixStream::connect(&sock).ok()
        });
        format!("unix:{}", sock.display())
    };
    let ta = controller(&mut lab, &ctla, "site-a", "10.1.0.0/16", "192.168.78.1");
    let tb = controller(&mut lab, &ctlb, "site-b", "10.2.0.0/16", "192.168.78.2");

    let gateway = |lab: &mut Lab, target: &str, ctl_ip: &str, ns: &str, ip: &str, name: &str| {
        let t = weftctl_json(target, &["token", "create", "--role", "gateway", "--name", "gw"]);
        let state = dir.path().join(name);
        let args: Vec<String> = [
            "--controller",
            &format!("https://{ctl_ip}:7443"),
            "--name",
            "gw",
            "--underlay-ip",
            ip,
            "--endpoint",
            &format!("{ip}:51820"),
            "--token",
            t["token"].as_str().unwrap(),
            "--ca-fingerprint",
            t["ca_fingerprint"].as_str().unwrap(),
            "--state-dir",
            state.to_str().unwrap(),
            "--resync-interval",
            "1s",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        lab.spawn(
            ns,
            &bin("weft-gateway-agent"),
            &refs,
            &dir.path().join(format!("{name}.log")),
        )
    };
    let pa = gateway(&mut lab, &ta, "192.168.78.1", &gwa, "192.168.78.10", "gwa");
    let pb = gateway(&mut lab, &tb, "192.168.78.2", &gwb, "192.168.78.20", "gwb");
    // Each gateway's key must be known before the sites peer.
    for t in [&ta, &tb] {
        eventually("the gateway's key", Duration::from_secs(20), || {
            let g = weftctl_json(t, &["gateways"]);
            g["gateways"][0]["public_key"]
                .as_str()
                .is_some_and(|k| !k.is_empty())
                .then_some(())
        });
    }
    let token = weftctl_json(&tb, &["peering", "token"])["token"]
        .as_str()
        .unwrap()
        .to_string();
    let o = weft_tests::run(std::process::Command::new(bin("weftctl")).args([
        "--controller",
        &ta,
        "peering",
        "create",
        "--token",
        &token,
    ]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // Each gateway: the peering namespace with the WireGuard interface in it.
    let ns_a = weft_controller::render::peering_namespace("site-b");
    let mut link_a = None;
    for _ in 0..200 {
        let o = stdout(
            &std::process::Command::new("ip")
                .args(["-n", &ns_a, "-br", "link"])
                .output()
                .unwrap(),
        );
        link_a = o.lines().find(|l| l.starts_with("weft-w")).map(|l| {
            l.split_whitespace()
                .next()
                .unwrap()
                .trim_end_matches("@NONE")
                .to_string()
        });
        if link_a.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let link_a = link_a.unwrap_or_else(|| {
        panic!(
            "no WireGuard interface on site-a's gateway; its log:\n{}",
            lab.proc(pa).log_text()
        )
    });
    let ns_b = weft_controller::render::peering_namespace("site-a");
    eventually("site-b's WireGuard interface", Duration::from_secs(20), || {
        let o = stdout(
            &std::process::Command::new("ip")
                .args(["-n", &ns_b, "-br", "link"])
                .output()
                .unwrap(),
        );
        o.contains("weft-w").then_some(())
    });
    // The UDP socket stayed on the gateway's underlay.
    let socks = stdout(&lab.exec(&gwa, &["ss", "-uln"]));
    assert!(socks.contains(":51820"), "{socks}");

    // Traffic into the tunnel starts the handshake; both gateways see it.
    let run_in = |ns: &str, args: &[&str]| {
        std::process::Command::new("ip")
            .args(["netns", "exec", ns])
            .args(args)
            .output()
            .unwrap()
    };
    assert!(
        run_in(&ns_a, &["ip", "addr", "add", "10.1.255.254/32", "dev", &link_a])
            .status
            .success()
    );
    assert!(
        run_in(&ns_a, &["ip", "route", "add", "10.2.0.0/16", "dev", &link_a])
            .status
            .success()
    );
    let _ = run_in(&ns_a, &["ping", "-c", "2", "-W", "1", "10.2.0.1"]);
    for p in [pa, pb] {
        eventually("the tunnel handshake", Duration::from_secs(20), || {
            lab.proc(p).log_text().contains("tunnel up").then_some(())
        });
    }
}
