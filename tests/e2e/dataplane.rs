//! The data plane on a real kernel, in network namespaces: a controller, a
//! gateway and two nodes on a LAN; the agents (not in dry-run) build the
//! VXLAN overlay with rtnetlink, and traffic crosses it.

use std::time::Duration;

use weft_tests::lab::{AgentSpec, SiteSpec};
use weft_tests::netns::{self, Lab, must, require_root};
use weft_tests::sites::{self, TwoSites};
use weft_tests::{ControllerSpec, bin, eventually, stdout, weftctl_json};

/// A controller, a gateway and two nodes (n1 with a workload bridge) on a
/// LAN, the agents enrolled and their overlay links up.
struct Overlay {
    dir: tempfile::TempDir,
    lab: Lab,
    target: String,
    gw: String,
    n1: String,
    n2: String,
    gw_agent: usize,
    n1_agent: usize,
    /// Whether this kernel makes Geneve links (found out the way the agents do).
    geneve: bool,
}

fn overlay(tag: &str) -> Overlay {
    require_root();
    let dir = tempfile::Builder::new().prefix("weft-dp").tempdir().unwrap();
    let mut lab = Lab::new(tag);
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
    let gateway = AgentSpec::gateway("gw", &gw, "192.168.77.10");
    let mut node1 = AgentSpec::gateway("n1", &n1, "192.168.77.11");
    node1.kind = "node";
    node1.flags = vec!["--workload-bridge".into(), "weft-br0".into()];
    let mut node2 = AgentSpec::gateway("n2", &n2, "192.168.77.12");
    node2.kind = "node";
    let site = lab.site(&SiteSpec {
        controller: ControllerSpec::new("site-a")
            .data_dir(&dir.path().join("ctl"))
            .pod("10.1.0.0/16"),
        ctl: ctl.clone(),
        ctl_ip: "192.168.77.1".into(),
        agents: vec![gateway, node1, node2],
        dir: dir.path().to_path_buf(),
        prefix: String::new(),
        resync: "1s".into(),
        agent_metrics: false,
    });
    let (target, gw_agent, n1_agent) = (site.target, site.agents[0], site.agents[1]);

    // The agents report whether their kernel has Geneve (found out here the
    // same way: a Geneve link in a scratch namespace); the overlay is
    // Geneve where both ends have it, VXLAN otherwise.
    let scratch = lab.host("scratch");
    let geneve = lab
        .exec(
            &scratch,
            &[
                "ip",
                "link",
                "add",
                "g0",
                "type",
                "geneve",
                "id",
                "1",
                "remote",
                "192.0.2.1",
            ],
        )
        .status
        .success();
    let encap = if geneve { "geneve id" } else { "vxlan id" };
    for ns in [&n1, &n2] {
        eventually("the node's overlay link", Duration::from_secs(20), || {
            let o = stdout(&lab.exec(ns, &["ip", "-d", "addr", "show", "weft-vx0"]));
            (o.contains(encap) && o.contains("remote 192.168.77.10") && o.contains("inet 10.80.")).then_some(())
        });
    }
    Overlay {
        dir,
        lab,
        target,
        gw,
        n1,
        n2,
        gw_agent,
        n1_agent,
        geneve,
    }
}

#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn overlay_between_nodes_and_the_gateway_in_namespaces() {
    let o = overlay("dpo");
    assert_eq!(
        weft_agent::linux::kernel_has_geneve(),
        o.geneve,
        "the agents' Geneve detection"
    );
    let mut o = o;
    let (target, gw, n1, n2, geneve) = (o.target.clone(), o.gw.clone(), o.n1.clone(), o.n2.clone(), o.geneve);
    let (target, gw, n1, n2) = (&target, &gw, &n1, &n2);
    let lab = &mut o.lab;
    for n in weftctl_json(target, &["nodes"])["nodes"].as_array().unwrap() {
        assert_eq!(n["geneve"], geneve, "{n}");
    }
    assert_eq!(weftctl_json(target, &["gateways"])["gateways"][0]["geneve"], geneve);
    weft_tests::step("the gateway: a tunnel per node, routes, rules");
    // The gateway: one tunnel per node, routes to both node subnets in table 7765, and its rules.
    let gw_routes = eventually("the gateway's routes", Duration::from_secs(20), || {
        let o = stdout(&lab.exec(gw, &["ip", "route", "show", "table", "7765"]));
        (o.contains("10.1.0.0/24") && o.contains("10.1.1.0/24")).then_some(o)
    });
    assert_eq!(
        gw_routes.lines().filter(|l| l.contains("/24")).count(),
        2,
        "one route per node subnet:\n{gw_routes}"
    );
    let rules = stdout(&lab.exec(gw, &["ip", "rule"]));
    assert!(
        rules.contains("7765:") && rules.contains("to 10.1.0.0/16 lookup 7765"),
        "{rules}"
    );
    let links = stdout(&lab.exec(gw, &["ip", "-br", "link"]));
    assert_eq!(links.lines().filter(|l| l.starts_with("weft-n")).count(), 2, "{links}");

    weft_tests::step("no prefix route in the main tables");
    // The node's overlay address has no prefix route in the host's main
    // table; the overlay's network is in weft's table, selected by a rule.
    for ns in [n1, n2] {
        let main = stdout(&lab.exec(ns, &["ip", "route", "show", "table", "main"]));
        assert!(!main.contains("weft-vx0"), "{ns}'s main table:\n{main}");
        let addr = stdout(&lab.exec(ns, &["ip", "-4", "addr", "show", "weft-vx0"]));
        assert!(addr.contains("noprefixroute"), "{addr}");
        let weft = stdout(&lab.exec(ns, &["ip", "route", "show", "table", "7765"]));
        assert!(weft.contains("10.80.0.0/16 dev weft-vx0"), "{weft}");
        assert!(stdout(&lab.exec(ns, &["ip", "rule"])).contains("to 10.80.0.0/16 lookup 7765"));
    }
    weft_tests::step("nodes reach the gateway over the overlay");
    // Traffic crosses the overlay: each node pings the gateway's overlay address.
    let gw_ip = weftctl_json(target, &["gateways"])["gateways"][0]["internal_ip"]
        .as_str()
        .unwrap()
        .to_string();
    for ns in [n1, n2] {
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

    // n1 manages a bridge on its subnet's first address; a workload
    // attached to it reaches the gateway over the overlay, and back.
    let n1_subnet: ipnet::Ipv4Net = weftctl_json(target, &["nodes"])["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == "n1")
        .unwrap()["subnet"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let first = n1_subnet.hosts().next().unwrap();
    eventually("n1's workload bridge", Duration::from_secs(20), || {
        let o = stdout(&lab.exec(n1, &["ip", "-d", "addr", "show", "weft-br0"]));
        (o.contains("bridge") && o.contains(&format!("inet {first}/{}", n1_subnet.prefix_len()))).then_some(())
    });
    let w1 = lab.host("w1");
    let w1_ip = format!("{}/{}", n1_subnet.hosts().nth(9).unwrap(), n1_subnet.prefix_len());
    for cmd in [
        format!("ip link add w1p type veth peer name eth0 netns {w1}"),
        "ip link set w1p master weft-br0 up".to_string(),
        "sysctl -qw net.ipv4.ip_forward=1".to_string(),
    ] {
        must(lab.exec(n1, &["sh", "-c", &cmd]), &cmd);
    }
    for cmd in [
        format!("ip addr add {w1_ip} dev eth0"),
        "ip link set eth0 up".to_string(),
        format!("ip route add default via {first}"),
    ] {
        must(lab.exec(&w1, &["sh", "-c", &cmd]), &cmd);
    }
    eventually(
        "the workload on n1's bridge reaching the gateway",
        Duration::from_secs(10),
        || {
            lab.exec(&w1, &["ping", "-c", "1", "-W", "1", &gw_ip])
                .status
                .success()
                .then_some(())
        },
    );

    // The agents report the state applied, without errors.
    let nodes = weftctl_json(target, &["nodes"]);
    for n in nodes["nodes"].as_array().unwrap() {
        assert_eq!(n["status"]["ready"], true, "{n}");
        assert!(n["status"]["errors"].as_array().unwrap().is_empty(), "{n}");
    }
}

#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn a_route_and_a_rule_deleted_by_hand_on_the_gateway_come_back() {
    let mut o = overlay("dpd");
    eventually("the gateway's routes", Duration::from_secs(20), || {
        let o = stdout(&o.lab.exec(&o.gw, &["ip", "route", "show", "table", "7765"]));
        (o.contains("10.1.0.0/24") && o.contains("10.1.1.0/24")).then_some(())
    });
    must(
        o.lab
            .exec(&o.gw, &["ip", "route", "del", "10.1.0.0/24", "table", "7765"]),
        "delete the route",
    );
    must(
        o.lab
            .exec(&o.gw, &["ip", "rule", "del", "priority", "7765", "to", "10.1.0.0/16"]),
        "delete the rule",
    );
    let repaired = (0..100).any(|_| {
        let routes = stdout(&o.lab.exec(&o.gw, &["ip", "route", "show", "table", "7765"]));
        let rules = stdout(&o.lab.exec(&o.gw, &["ip", "rule"]));
        let ok = routes.contains("10.1.0.0/24") && rules.contains("to 10.1.0.0/16 lookup 7765");
        if !ok {
            std::thread::sleep(Duration::from_millis(100));
        }
        ok
    });
    assert!(
        repaired,
        "not repaired within 10 s; gateway log:\n{}",
        o.lab.proc(o.gw_agent).log_text()
    );
}

#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn removing_a_node_withdraws_its_tunnel_and_route_from_the_gateway() {
    let o = overlay("dpr");
    eventually("the gateway's routes", Duration::from_secs(20), || {
        let o = stdout(&o.lab.exec(&o.gw, &["ip", "route", "show", "table", "7765"]));
        (o.contains("10.1.0.0/24") && o.contains("10.1.1.0/24")).then_some(())
    });
    weftctl_json(&o.target, &["node", "remove", "n2"]);
    eventually("n2's tunnel gone from the gateway", Duration::from_secs(20), || {
        let links = stdout(&o.lab.exec(&o.gw, &["ip", "-br", "link"]));
        let routes = stdout(&o.lab.exec(&o.gw, &["ip", "route", "show", "table", "7765"]));
        (links.lines().filter(|l| l.starts_with("weft-n")).count() == 1 && !routes.contains("10.1.1.0/24"))
            .then_some(())
    });
}

#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn teardown_removes_what_weft_made_the_workload_bridge_included() {
    let mut o = overlay("dpt");
    eventually("n1's workload bridge", Duration::from_secs(20), || {
        stdout(&o.lab.exec(&o.n1, &["ip", "-br", "link", "show", "weft-br0"]))
            .contains("weft-br0")
            .then_some(())
    });
    o.lab.proc(o.n1_agent).stop();
    let out = std::process::Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", o.n1))
        .arg(bin("weft-node-agent"))
        .args(["--teardown", "--state-dir", o.dir.path().join("n1").to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let links = stdout(&o.lab.exec(&o.n1, &["ip", "-br", "link"]));
    assert!(!links.contains("weft-"), "left after teardown on n1:\n{links}");
}

/// Two sites up (see `weft_tests::sites`), then the scenarios.
/// MTUs the links must end up with: (site a VXLAN, site b VXLAN, tunnel).
struct Expect {
    vxlan_a: u32,
    vxlan_b: u32,
    tunnel: u32,
}

fn link_mtu(lab: &Lab, ns: &str, link_prefix: &str) -> u32 {
    let out = stdout(&lab.exec(ns, &["ip", "-o", "link"]));
    let line = out
        .lines()
        .find(|l| l.split_whitespace().nth(1).is_some_and(|n| n.starts_with(link_prefix)))
        .unwrap_or_else(|| panic!("no {link_prefix}* link in {ns}:\n{out}"));
    let mut words = line.split_whitespace();
    words.find(|w| *w == "mtu");
    words.next().unwrap().parse().unwrap()
}

fn cross_site(tag: &str, a: (&str, &str), b: (&str, &str), opts: sites::Opts, expect: Expect) {
    let TwoSites {
        mut lab,
        dir,
        ns,
        ta,
        tb,
        gateways: (pa, pb),
        agents,
        site_a,
        site_b,
        ns_a,
        wb_from_a,
        wa_from_b,
        workloads,
        gateway_a2: _,
        etcd_a: _,
        etcd_b: _,
        nat_a: _,
        nat_b: _,
        underlay_v6: _,
        peered_at: _,
    } = sites::up_with(tag, a, b, opts);
    let (site_a, site_b) = (site_a.as_str(), site_b.as_str());
    weft_tests::step("workload to workload, both ways");
    // Workload to workload, both ways, ICMP and TCP.
    let ping = |from: &str, to: &str| {
        netns::exec(&ns[from], &["ping", "-c", "1", "-W", "1", to])
            .status
            .success()
    };
    let reached = (0..30).any(|_| {
        ping("wa", &wb_from_a) || {
            std::thread::sleep(Duration::from_millis(500));
            false
        }
    });
    if !reached {
        let mut diag = String::new();
        for cmd in ["ip rule", "ip route show table all", "nft list ruleset", "ip -br addr"] {
            let o = netns::exec(&ns_a, &["sh", "-c", cmd]);
            diag.push_str(&format!(
                "--- {cmd}\n{}{}\n",
                stdout(&o),
                String::from_utf8_lossy(&o.stderr)
            ));
        }
        for p in [pa, pb] {
            diag.push_str(&lab.proc(p).log_text());
        }
        panic!("wa cannot reach wb ({wb_from_a}) across the sites:\n{diag}");
    }
    assert!(ping("wb", &wa_from_b), "wb cannot reach wa ({wa_from_b})");
    // weft's addresses in the hosts' own namespaces come without prefix
    // routes: the main tables route nothing into weft's links (the
    // overlay's network and the peering veths are in weft's table).
    for (host, h) in ns.iter().filter(|(h, _)| h.starts_with("gw") || h.starts_with('n')) {
        let main = stdout(&netns::exec(h, &["ip", "route", "show", "table", "main"]));
        // (A node's workload bridge keeps its prefix route: it is how the
        // host reaches its workloads.)
        assert!(
            !main
                .lines()
                .any(|l| l.contains("dev weft-") && !l.contains("dev weft-br0")),
            "{host}'s main table routes into weft's links:\n{main}"
        );
        let weft = stdout(&netns::exec(h, &["ip", "-4", "addr", "show"]));
        for line in weft.lines().filter(|l| l.contains("inet ") && l.contains(" weft-v")) {
            assert!(line.contains("noprefixroute"), "{host}: {line}");
        }
    }
    weft_tests::step("every workload reaches every workload");
    // Every workload reaches every workload of the other site (two nodes
    // per site, each node its own overlay tunnel to the gateway), by ICMP
    // and by TCP, and the far end sees the caller at its own view of it.
    let echo_py = "import socket\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\ns.bind(('0.0.0.0',5300))\ns.listen(16)\nwhile True:\n    c,a=s.accept()\n    c.sendall(('from '+a[0]).encode())\n    c.close()";
    for (host, _, _) in &workloads {
        lab.spawn(
            &ns[host],
            std::path::Path::new("/usr/bin/env"),
            &["python3", "-c", echo_py],
            &dir.path().join(format!("echo-{host}.log")),
        );
    }
    std::thread::sleep(Duration::from_millis(500));
    for (from, from_real, from_seen) in &workloads {
        for (to, _, to_seen) in workloads.iter().filter(|w| w.0.as_bytes()[1] != from.as_bytes()[1]) {
            eventually(
                &format!("{from} pinging {to} at {to_seen}"),
                Duration::from_secs(10),
                || ping(from, to_seen).then_some(()),
            );
            let client = format!(
                "import socket\ns=socket.create_connection(('{to_seen}',5300),timeout=3)\nprint(s.recv(100).decode())"
            );
            let o = lab.exec(&ns[from], &["python3", "-c", &client]);
            assert!(
                o.status.success(),
                "TCP {from} → {to} ({to_seen}): {}",
                String::from_utf8_lossy(&o.stderr)
            );
            // The far end sees the caller's address in the far site's view.
            assert_eq!(
                stdout(&o).trim(),
                format!("from {from_seen}"),
                "TCP {from} ({from_real}) → {to}"
            );
        }
    }
    let server_py = "import socket\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\ns.bind(('0.0.0.0',5201))\ns.listen(1)\nc,_=s.accept()\nd=c.recv(100).decode()\nprint(d,'mss',c.getsockopt(socket.IPPROTO_TCP,socket.TCP_MAXSEG),flush=True)";
    let server = lab.spawn(
        &ns["wb"],
        std::path::Path::new("/usr/bin/env"),
        &["python3", "-c", server_py],
        &dir.path().join("tcp.log"),
    );
    std::thread::sleep(Duration::from_millis(500));
    let client_py = format!(
        "import socket\ns=socket.create_connection(('{wb_from_a}',5201),timeout=3)\ns.sendall(b'across')\ns.close()"
    );
    let o = netns::exec(&ns["wa"], &["python3", "-c", &client_py]);
    assert!(
        o.status.success(),
        "TCP across the sites failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    // The server's whole line ("across mss N"), once written.
    let (got, mss) = eventually("the TCP payload", Duration::from_secs(5), || {
        let t = lab.proc(server).log_text();
        let line = t.lines().find(|l| l.starts_with("across mss "))?.to_string();
        let mss: u32 = line.rsplit(' ').next()?.parse().ok()?;
        t.ends_with('\n').then_some((line, mss))
    });
    weft_tests::step("the gateways clamp the MSS");
    // Both workloads sit at MTU 1500 (MSS 1460); the gateways clamp the SYN
    // to the tunnel's route MTU (e.g. 1420 → MSS 1380, less TCP options).
    assert!(
        mss <= expect.tunnel - 40,
        "the MSS across the tunnel was not clamped: {got}"
    );
    weft_tests::step("MTUs derived and agreed");
    // MTUs: derived from each host's underlay (VXLAN: − 50, WireGuard and
    // the peering veth: − 80) unless configured; a configured tunnel MTU
    // is agreed with the peer (the lower wins).
    for (host, want) in [
        ("na", expect.vxlan_a),
        ("na2", expect.vxlan_a),
        ("nb", expect.vxlan_b),
        ("nb2", expect.vxlan_b),
    ] {
        assert_eq!(link_mtu(&lab, &ns[host], "weft-vx0"), want, "VXLAN MTU on {host}");
    }
    assert_eq!(link_mtu(&lab, &ns["gwa"], "weft-n"), expect.vxlan_a, "VXLAN MTU on gwa");
    assert_eq!(link_mtu(&lab, &ns["gwb"], "weft-n"), expect.vxlan_b, "VXLAN MTU on gwb");
    let ns_b = weft_controller::render::peering_namespace(site_b, site_a);
    for (pns, gw) in [(&ns_a, "gwa"), (&ns_b, "gwb")] {
        assert_eq!(link_mtu(&lab, pns, "weft-w"), expect.tunnel, "WireGuard MTU in {pns}");
        assert_eq!(
            link_mtu(&lab, pns, "weft-i"),
            expect.tunnel,
            "peering veth MTU in {pns}"
        );
        assert_eq!(
            link_mtu(&lab, &ns[gw], "weft-v"),
            expect.tunnel,
            "peering veth MTU on {gw}"
        );
    }
    weft_tests::step("tunnel health on both sides");
    // Health: each gateway probes its tunnel; both controllers show the
    // peering connected, with an RTT, a handshake and bytes both ways.
    let tunnel = |target: &str, peer: &str| -> serde_json::Value {
        let all = weftctl_json(target, &["peerings"]);
        all["peerings"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["site_id"] == peer))
            .unwrap_or_else(|| panic!("no peering with {peer}: {all}"))
            .clone()
    };
    for (target, peer) in [(&ta, site_b), (&tb, site_a)] {
        // (The report at the moment the tunnel came up may predate the
        // counters of the traffic that follows; the next one has them.)
        let p = eventually("the peering connected, with traffic", Duration::from_secs(20), || {
            let p = tunnel(target, peer);
            (p["state"] == "connected" && p["tunnel"]["rx_bytes"].as_u64() > Some(0)).then_some(p)
        });
        let t = &p["tunnel"];
        assert_eq!(t["up"], true, "{p}");
        assert!(t["rtt_ms"].as_f64().unwrap() > 0.0, "no RTT: {p}");
        assert!(
            t["rx_bytes"].as_u64().unwrap() > 0 && t["tx_bytes"].as_u64().unwrap() > 0,
            "{p}"
        );
        assert!(!t["last_handshake"].as_str().unwrap().is_empty(), "no handshake: {p}");
        let table = stdout(&weft_tests::run(std::process::Command::new(bin("weftctl")).args([
            "--controller",
            target,
            "peerings",
        ])));
        assert!(
            table.contains("connected") && table.contains("ms") && table.contains("s ago"),
            "{table}"
        );
    }
    weft_tests::step("a WAN outage is reported");
    // The WAN between the gateways fails: site a's gateway reports the
    // tunnel down within the probe interval × misses (1 s × 3), the peering
    // stops being connected, and both recover by themselves.
    let cut = std::time::Instant::now();
    must(lab.exec(&ns["gwb"], &["ip", "link", "set", "eth0", "down"]), "WAN down");
    let p = eventually("the tunnel reported down", Duration::from_secs(10), || {
        let p = tunnel(&ta, site_b);
        (p["tunnel"]["up"] == false).then_some(p)
    });
    let detected = cut.elapsed();
    assert_eq!(p["state"], "connecting", "{p}");
    assert!(
        p["waiting_for"].to_string().contains("probe through the tunnel"),
        "what it waits for: {p}"
    );
    assert!(detected < Duration::from_secs(6), "down detected after {detected:?}");
    assert!(
        lab.proc(pa).log_text().contains("tunnel down"),
        "{}",
        lab.proc(pa).log_text()
    );
    must(lab.exec(&ns["gwb"], &["ip", "link", "set", "eth0", "up"]), "WAN up");
    eventually("the tunnel up again", Duration::from_secs(20), || {
        (tunnel(&ta, site_b)["state"] == "connected").then_some(())
    });
    eventually("wa reaching wb again", Duration::from_secs(20), || {
        ping("wa", &wb_from_a).then_some(())
    });
    eprintln!("tunnel down detected after {detected:?}");

    weft_tests::step("scenario c: host traffic to a remote workload");
    // Scenario c: a node's host reaches a remote workload (its traffic
    // leaves with the node's "unknown source" address from the external CIDR).
    let host_ping = || ping("na", &wb_from_a);
    let reached = (0..10).any(|_| {
        host_ping() || {
            std::thread::sleep(Duration::from_millis(300));
            false
        }
    });
    if !reached {
        let o = netns::exec(&ns["na"], &["nft", "list", "ruleset"]);
        panic!(
            "node na's host cannot reach wb ({wb_from_a}); its nft ruleset:\n{}",
            stdout(&o)
        );
    }

    weft_tests::step("scenario e: the controller killed under a TCP stream");
    // Scenario e: the controller dies (SIGKILL) and comes back while a TCP
    // stream runs across the sites; the data plane does not depend on it.
    let stream_server = "import socket\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\ns.bind(('0.0.0.0',5202))\ns.listen(1)\nc,_=s.accept()\nn=0\nwhile True:\n    d=c.recv(4096)\n    if not d: break\n    n+=len(d)\nprint('received',n,flush=True)";
    let srv = lab.spawn(
        &ns["wb"],
        std::path::Path::new("/usr/bin/env"),
        &["python3", "-c", stream_server],
        &dir.path().join("stream.log"),
    );
    std::thread::sleep(Duration::from_millis(500));
    let stream_client = format!(
        "import socket,time\ns=socket.create_connection(('{wb_from_a}',5202),timeout=5)\nfor i in range(60):\n    s.sendall(b'x'*1000)\n    time.sleep(0.1)\ns.close()\nprint('sent',60000,flush=True)"
    );
    let cli = lab.spawn(
        &ns["wa"],
        std::path::Path::new("/usr/bin/env"),
        &["python3", "-c", &stream_client],
        &dir.path().join("client.log"),
    );
    std::thread::sleep(Duration::from_secs(1));
    lab.ctl(0).kill();
    std::thread::sleep(Duration::from_secs(2));
    lab.ctl(0).restart_stopped();
    let st = lab
        .proc(cli)
        .wait_exit(Duration::from_secs(20))
        .expect("the TCP client finished");
    assert!(st.success(), "the stream broke: {}", lab.proc(cli).log_text());
    eventually("all bytes across", Duration::from_secs(10), || {
        lab.proc(srv).log_text().contains("received 60000").then_some(())
    });
    eventually("the controller back", Duration::from_secs(20), || {
        std::os::unix::net::UnixStream::connect(dir.path().join(site_a).join("admin.sock")).ok()
    });

    weft_tests::step("scenario d: the peering deleted");
    // Scenario d: deleting the peering removes every peering object on both
    // gateways, and traffic stops.
    let d = weftctl_json(&ta, &["peering", "delete", site_b]);
    assert_eq!(d["remote_notified"], true);
    eventually("both peering namespaces gone", Duration::from_secs(20), || {
        let gone = |n: &str| !std::path::Path::new(&format!("/run/netns/{n}")).exists();
        (gone(&ns_a) && gone(&ns_b)).then_some(())
    });
    for gw in ["gwa", "gwb"] {
        let links = stdout(&lab.exec(&ns[gw], &["ip", "-br", "link"]));
        assert!(
            !links.contains("weft-v") && !links.contains("weft-w"),
            "{gw} kept peering links:\n{links}"
        );
        let routes = stdout(&lab.exec(&ns[gw], &["ip", "route", "show", "table", "7765"]));
        assert!(
            !routes.contains("169.254."),
            "{gw} kept routes into the peering:\n{routes}"
        );
    }
    assert!(
        !ping("wa", &wb_from_a),
        "traffic still crosses after the peering was deleted"
    );

    // `--teardown` (agents stopped): every host is as it was before weft.
    sites::teardown_hosts(&mut lab, &ns, &agents, &[&ns_a, &ns_b]);
}

/// Scenario a: disjoint workload CIDRs; 1500-byte underlays, every MTU
/// derived.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn workloads_reach_each_other_across_sites_with_disjoint_cidrs() {
    if require_root() {
        let expect = Expect {
            vxlan_a: 1450,
            vxlan_b: 1450,
            tunnel: 1420,
        };
        cross_site(
            "wga",
            ("site-a", "10.1.0.0/16"),
            ("site-b", "10.2.0.0/16"),
            sites::Opts::default(),
            expect,
        );
    }
}

/// Scenario b: both sites on the same workload CIDR; each reaches the other
/// through its remapped local view (prefix NAT in the peering namespaces),
/// even between two workloads with the very same address; with unequal
/// underlay MTUs and a configured tunnel MTU.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn workloads_reach_each_other_across_sites_with_the_same_cidr() {
    if require_root() {
        // Also: site d's underlay carries only 1400 bytes, so its overlay
        // is derived smaller, and site c configures a tunnel MTU both
        // gateways must use.
        let opts = sites::Opts {
            site_b_underlay: Some(1400),
            site_a_tunnel: Some(1320),
            ..Default::default()
        };
        let expect = Expect {
            vxlan_a: 1450,
            vxlan_b: 1350,
            tunnel: 1320,
        };
        cross_site(
            "wgb",
            ("site-c", "10.200.0.0/16"),
            ("site-d", "10.200.0.0/16"),
            opts,
            expect,
        );
    }
}

fn signal(pid: u32, sig: &str) {
    let st = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success(), "kill {sig} {pid}");
}

/// Lets a stopped process go on when dropped (before the lab ends it).
struct Resume(u32);

impl Drop for Resume {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-CONT", &self.0.to_string()])
            .status();
    }
}

/// A hostile peer: site b's gateway is replaced by a plain wireguard-go
/// holding b's own key, which routes into the tunnel whatever it likes.
/// Through the tunnel it reaches site a's workloads (what the peering is
/// for) and nothing else: not the gateway host's addresses (the peering
/// veth's outer end, its overlay address), whatever listens there; and
/// site a's gateway counts what it dropped.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn a_peer_reaches_only_the_sites_workloads_through_its_tunnel() {
    if !require_root() || weft_tests::require_tool("wireguard-go").is_none() {
        return;
    }
    let mut s = sites::up("wgf", ("wgf-a", "10.1.0.0/16"), ("wgf-b", "10.2.0.0/16"));
    sites::until_wa_reaches_wb(&s);
    let (gwb_ns, ns_a) = (s.ns["gwb"].clone(), s.ns_a.clone());
    weft_tests::step("listeners on the gateway host and a workload");
    // Something listening on every address of a's gateway host, and on wa.
    // (UDP: what arrives is logged, no reply needed.)
    let listener = "import socket\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\ns.bind(('0.0.0.0',7777))\nwhile True:\n    d,a=s.recvfrom(100)\n    print('from',a[0],d.decode(),flush=True)";
    let env = std::path::Path::new("/usr/bin/env");
    let on_gw = s.lab.spawn(
        &s.ns["gwa"],
        env,
        &["python3", "-c", listener],
        &s.dir.path().join("listen-gwa.log"),
    );
    let on_wa = s.lab.spawn(
        &s.ns["wa"],
        env,
        &["python3", "-c", listener],
        &s.dir.path().join("listen-wa.log"),
    );
    // a's gateway host's own addresses on weft's links: the peering veth's
    // outer end (169.254.x.1) and its overlay address toward the nodes.
    let addrs: serde_json::Value =
        serde_json::from_str(&stdout(&s.lab.exec(&s.ns["gwa"], &["ip", "-j", "-4", "addr"]))).unwrap();
    let on_link = |prefix: &str| -> String {
        addrs
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["ifname"].as_str().is_some_and(|n| n.starts_with(prefix)))
            .and_then(|l| l["addr_info"][0]["local"].as_str())
            .unwrap_or_else(|| panic!("no address on {prefix}…: {addrs}"))
            .to_string()
    };
    let (veth_outer, overlay) = (on_link("weft-v"), on_link("weft-n"));
    let wa = s.workloads.iter().find(|w| w.0 == "wa").unwrap().1.clone();

    weft_tests::step("site b's gateway turns hostile");
    // Site b's gateway turns hostile: its agent dies (its userspace tunnel
    // with it) and wireguard-go takes its key and dials a's gateway.
    let b_state = &s.agents.iter().find(|a| a.1 == "gwb").unwrap().3;
    let key_file = b_state.join("wireguard.key");
    let peering = weftctl_json(&s.tb, &["peerings"])["peerings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["site_id"] == s.site_a.as_str())
        .cloned()
        .unwrap();
    let a_gw = peering["remote_gateways"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["active"] == true && g["endpoint"] != "")
        .cloned()
        .unwrap_or_else(|| panic!("a's gateway has no endpoint: {peering}"));
    let b_port = weftctl_json(&s.ta, &["peerings"])["peerings"][0]["remote_gateways"][0]["endpoint"]
        .as_str()
        .and_then(|e| e.rsplit_once(':'))
        .map(|(_, p)| p.to_string())
        .expect("b's gateway's endpoint");
    // b's controller holds still (so a keeps b's gateway as b last
    // announced it, as a lying peer would have it), then b's gateway dies.
    let ctl_b_pid = s.lab.ctl(1).pid();
    signal(ctl_b_pid, "-STOP");
    let _resume = Resume(ctl_b_pid);
    let gwb = s.gateways.1;
    s.lab.proc(gwb).child.as_mut().unwrap().kill().unwrap();
    s.lab
        .proc(gwb)
        .wait_exit(Duration::from_secs(5))
        .expect("b's gateway agent ended");
    let evil_src = "10.2.255.250";
    let routes: String = [&wa, &veth_outer, &overlay]
        .iter()
        .map(|t| format!("ip route add {t}/32 dev weft-evil src {evil_src} table 4242\n"))
        .collect();
    // Its UAPI socket goes under a /run of its own (a mount namespace).
    // The lab ends the shell with SIGKILL, which runs no trap: wireguard-go
    // dies with its parent (--pdeathsig), so no test leaves it behind.
    // its routes win over weft's rules on that host, and b's own peering
    // veth goes (its outer end has the very address a's has).
    let script = format!(
        "set -e\nmount -t tmpfs weft-evil /run\nsetpriv --pdeathsig KILL wireguard-go -f weft-evil & WG=$!\ntrap 'kill $WG' EXIT TERM\n\
         for i in $(seq 100); do [ -S /run/wireguard/weft-evil.sock ] && break; sleep 0.1; done\n\
         wg set weft-evil private-key {} listen-port {} peer {} endpoint {} allowed-ips 0.0.0.0/0 persistent-keepalive 1\n\
         ip addr add {evil_src}/32 dev weft-evil\nip link set weft-evil up\n\
         for l in $(ip -o link show | sed -n 's/^[0-9]*: \\(weft-v[0-9a-f]*\\)@.*/\\1/p'); do ip link del $l; done\n\
         {routes}ip rule add from {evil_src} lookup 4242 priority 100\necho ready\nwait $WG\n",
        key_file.display(),
        // Where a's gateway sends to: b's gateway's port.
        b_port,
        a_gw["public_key"].as_str().unwrap(),
        a_gw["endpoint"].as_str().unwrap(),
    );
    let evil = s.lab.spawn(
        &s.ns["gwb"],
        std::path::Path::new("/usr/bin/unshare"),
        &["--mount", "--propagation", "private", "sh", "-c", &script],
        &s.dir.path().join("evil.log"),
    );
    eventually("the hostile tunnel set up", Duration::from_secs(20), || {
        s.lab.proc(evil).log_text().contains("ready").then_some(())
    });
    let send = |lab: &weft_tests::netns::Lab, to: &str, what: &str| {
        let py = format!(
            "import socket\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\ns.bind(('{evil_src}',0))\ns.sendto(b'{what}',('{to}',7777))"
        );
        must(lab.exec(&gwb_ns, &["python3", "-c", &py]), "a datagram into the tunnel");
    };
    weft_tests::step("workloads still reached through the hostile tunnel");
    // The peering's purpose still works through the hostile tunnel: the
    // check below is not vacuous.
    // (wireguard-go's handshake timestamps run 27 s behind boringtun's, so
    // a takes the hostile peer's handshake only once the real gateway's
    // last one is that far in the past.)
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let mut n = 0;
    let reached = loop {
        n += 1;
        send(&s.lab, &wa, &format!("probe{n}"));
        std::thread::sleep(Duration::from_millis(500));
        if s.lab.proc(on_wa).log_text().contains("from 10.2.255.250") {
            break true;
        }
        if std::time::Instant::now() > deadline {
            break false;
        }
    };
    assert!(
        reached,
        "the hostile peer never reached wa ({wa}) through the tunnel:\n{}\n{}\n{}",
        s.lab.proc(evil).log_text(),
        weftctl_json(&s.ta, &["peerings"]),
        stdout(
            &s.lab
                .exec(&ns_a, &["sh", "-c", "ip -br addr; ip route; nft list ruleset"])
        )
    );
    let dropped = |lab: &weft_tests::netns::Lab| -> u64 {
        let o = lab.exec(&ns_a, &["nft", "-j", "list", "counter", "inet", "weft", "dropped"]);
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap_or_default();
        v["nftables"]
            .as_array()
            .into_iter()
            .flatten()
            .find_map(|x| x["counter"]["packets"].as_u64())
            .unwrap_or(0)
    };
    let before = dropped(&s.lab);
    for target in [&veth_outer, &overlay] {
        for _ in 0..3 {
            send(&s.lab, target, "intruder");
        }
    }
    weft_tests::step("the overlay's UDP ports from the tunnel");
    // And the overlay's UDP ports (VXLAN, Geneve), which the gateway host
    // serves on all its addresses.
    let udp = format!(
        "import socket\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\ns.bind(('{evil_src}',0))\nfor p in (4789,6081):\n    s.sendto(b'x'*64,('{veth_outer}',p))"
    );
    must(
        s.lab.exec(&gwb_ns, &["python3", "-c", &udp]),
        "UDP to the overlay ports",
    );
    // Anything that got through would have arrived by now.
    std::thread::sleep(Duration::from_millis(500));
    let heard = s.lab.proc(on_gw).log_text();
    assert!(!heard.contains("intruder"), "a's gateway host heard the peer: {heard}");
    // Three datagrams and two overlay packets for the veth's outer end;
    // the overlay address has no route in the peering's namespace at all.
    let counted = std::time::Instant::now();
    let after = loop {
        let n = dropped(&s.lab);
        if n >= before + 5 {
            break n;
        }
        assert!(
            counted.elapsed() < Duration::from_secs(5),
            "a's gateway counted {} drops from the tunnel, not 5:\n{}\n{}",
            n - before,
            stdout(&s.lab.exec(&ns_a, &["nft", "list", "ruleset"])),
            s.lab.proc(on_gw).log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!("dropped from the tunnel: {} packets", after - before);
    weft_tests::step("the admin sees the drops");
    // The admin sees it: the gateway reports the drops with the tunnel.
    // (The gateway reads the counter every 30th probe.)
    let shown = eventually("a's admin sees the drops", Duration::from_secs(60), || {
        let all = weftctl_json(&s.ta, &["peerings"]);
        let n = all["peerings"][0]["tunnel"]["dropped_from_tunnel"].as_u64()?;
        (n >= after).then_some(n)
    });
    let table = stdout(&weft_tests::run(std::process::Command::new(bin("weftctl")).args([
        "--controller",
        &s.ta,
        "peerings",
    ])));
    assert!(
        table.contains("packets from the tunnel dropped"),
        "{shown} drops, but the table does not say so:\n{table}"
    );
}
