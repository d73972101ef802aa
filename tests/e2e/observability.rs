//! Observability on two real sites in network namespaces: Prometheus
//! metrics that move with traffic (controller, gateway, node), `weftctl
//! status`, `topology`, `diagnose` and `test network` — including the
//! failures they exist to find.

use std::time::Duration;

use weft_tests::netns::require_root;
use weft_tests::sites::{self, Opts, TwoSites, metric};
use weft_tests::{bin, eventually, stdout, weftctl_json};

/// weftctl run inside `host`'s namespace (test network probes from there).
fn weftctl_in(s: &TwoSites, host: &str, target: &str, args: &[&str]) -> std::process::Output {
    let ctl = bin("weftctl");
    let mut all = vec![ctl.to_str().unwrap(), "--controller", target];
    all.extend_from_slice(args);
    weft_tests::netns::exec(&s.ns[host], &all)
}

fn weftctl(target: &str, args: &[&str]) -> std::process::Output {
    weft_tests::run(
        std::process::Command::new(bin("weftctl"))
            .args(["--controller", target])
            .args(args),
    )
}

/// A sample that must exist.
fn must(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric(text, name, labels).unwrap_or_else(|| {
        let near: Vec<&str> = text.lines().filter(|l| l.starts_with(name)).collect();
        panic!("no {name} {labels:?}; samples of that name: {near:#?}")
    })
}

#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn metrics_status_topology_and_test_network_on_two_sites() {
    if !require_root() {
        return;
    }
    weft_tests::step("two sites on one CIDR");
    // Both sites on one CIDR, so the views are remapped; nothing repairs
    // drift, so a route deleted by hand stays deleted.
    let s = sites::up_with(
        "obs",
        ("obs-a", "10.200.0.0/16"),
        ("obs-b", "10.200.0.0/16"),
        Opts {
            no_drift_repair: true,
            ..Opts::default()
        },
    );
    let peer = [("peer_site", "obs-b")];
    eventually(
        "the tunnel up in the gateway's metrics",
        Duration::from_secs(30),
        || (metric(&s.scrape("gwa"), "weft_peering_up", &peer) == Some(1.0)).then_some(()),
    );

    weft_tests::step("traffic while scraping");
    // Traffic flows (5 s of 1000-byte pings, wa → wb) while we scrape twice.
    let (_, _, wb_view) = s.workloads.iter().find(|w| w.0 == "wb").unwrap().clone();
    let flow = {
        let ns = s.ns["wa"].clone();
        std::thread::spawn(move || {
            weft_tests::netns::exec(&ns, &["ping", "-q", "-i", "0.02", "-s", "1000", "-w", "5", &wb_view])
        })
    };
    std::thread::sleep(Duration::from_millis(1500));
    let before = [s.scrape("gwa"), s.scrape("na"), s.scrape("ctla")];
    std::thread::sleep(Duration::from_millis(2000));
    let after = [s.scrape("gwa"), s.scrape("na"), s.scrape("ctla")];
    let ping = flow.join().unwrap();
    assert!(ping.status.success(), "the traffic itself failed: {}", stdout(&ping));

    let grew = |i: usize, name: &str, labels: &[(&str, &str)]| {
        let (a, b) = (must(&before[i], name, labels), must(&after[i], name, labels));
        assert!(b > a, "{name} {labels:?} did not move while traffic flowed: {a} → {b}");
    };
    weft_tests::step("the gateway's tunnel metrics");
    // Gateway: the tunnel's counters and probes.
    for name in [
        "weft_peering_transmit_bytes_total",
        "weft_peering_receive_bytes_total",
        "weft_peering_transmit_packets_total",
        "weft_peering_receive_packets_total",
        "weft_peering_probes_total",
        "weft_peering_rtt_seconds_count",
    ] {
        grew(0, name, &peer);
    }
    assert_eq!(must(&after[0], "weft_peering_up", &peer), 1.0);
    assert!(must(&after[0], "weft_peering_handshake_age_seconds", &peer) < 180.0);
    assert!(must(&after[0], "weft_agent_applied_revision", &[]) > 0.0);
    weft_tests::step("the node's traffic counters");
    // Node: its traffic toward and from the peer's CIDRs.
    grew(
        1,
        "weft_node_peer_bytes_total",
        &[("peer_site", "obs-b"), ("direction", "tx"), ("family", "ipv4")],
    );
    grew(
        1,
        "weft_node_peer_bytes_total",
        &[("peer_site", "obs-b"), ("direction", "rx"), ("family", "ipv4")],
    );
    grew(
        1,
        "weft_node_peer_packets_total",
        &[("peer_site", "obs-b"), ("direction", "tx"), ("family", "ipv4")],
    );
    assert_eq!(must(&after[1], "weft_agent_controller_connected", &[]), 1.0);
    assert!(
        must(
            &after[1],
            "weft_agent_reconcile_duration_seconds_count",
            &[("trigger", "snapshot")]
        ) >= 1.0
    );
    assert!(must(&after[1], "weft_agent_certificate_expiry_timestamp_seconds", &[]) > 1.7e9);
    weft_tests::step("the controller's peering and own metrics");
    // Controller: the same peering as its gateway reports it, and its own state.
    let gw = [("peer_site", "obs-b"), ("gateway", "gw")];
    grew(2, "weft_peering_transmit_bytes_total", &gw);
    grew(2, "weft_peering_receive_bytes_total", &gw);
    assert_eq!(
        must(&after[2], "weft_controller_connected_agents", &[("role", "node")]),
        2.0
    );
    assert_eq!(
        must(&after[2], "weft_controller_connected_agents", &[("role", "gateway")]),
        1.0
    );
    assert_eq!(
        must(
            &after[2],
            "weft_controller_peering_state",
            &[("peer_site", "obs-b"), ("state", "connected")]
        ),
        1.0
    );
    assert!(
        must(
            &after[2],
            "weft_controller_store_operation_duration_seconds_count",
            &[("op", "txn")]
        ) > 0.0
    );
    // Site a's state is in the embedded store: its file, and the part of
    // it cached in the controller's memory (bounded at 8 MiB).
    let file = must(&after[2], "weft_controller_store_file_bytes", &[]);
    let cache = must(&after[2], "weft_controller_store_cache_bytes", &[]);
    assert!(
        file > 0.0 && cache > 0.0 && cache <= 8.0 * 1024.0 * 1024.0,
        "file {file}, cache {cache}"
    );
    let ipam: Vec<&str> = after[2].lines().filter(|l| l.starts_with("weft_ipam")).collect();
    assert!(
        must(
            &after[2],
            "weft_ipam_pool_allocated_addresses",
            &[("pool", "10.200.0.0/16")]
        ) >= 512.0,
        "{ipam:#?}"
    );
    assert_eq!(must(&after[2], "weft_controller_leader", &[]), 1.0);
    // No failover here: the histogram of its steps is there, at zero
    // (tests/e2e/failover.rs times the steps themselves).
    assert_eq!(
        must(
            &after[2],
            "weft_failover_step_seconds_count",
            &[("step", "first_packet")]
        ),
        0.0
    );
    assert!(
        after[2].contains("# TYPE weft_failover_step_seconds histogram"),
        "no failover step histogram: {:?}",
        after[2].lines().filter(|l| l.starts_with("# TYPE")).collect::<Vec<_>>()
    );
    // Present (its value is whatever is in flight at the scrape).
    must(&after[2], "weft_controller_stream_queue_depth", &[("role", "node")]);

    weft_tests::step("the dashboard plots only served series");
    // The Grafana dashboard plots only series that exist.
    let dashboard = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/grafana/weft-dashboard.json"
    ))
    .unwrap();
    let served: std::collections::BTreeSet<&str> = after
        .iter()
        .flat_map(|t| t.lines())
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    let used: std::collections::BTreeSet<String> = dashboard
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("weft_") && w.len() > 5 && !w.starts_with("weft_dashboard"))
        .map(String::from)
        .collect();
    assert!(used.len() > 15, "{used:?}");
    for name in &used {
        assert!(
            served.contains(name.as_str()),
            "the dashboard plots {name}, which no binary serves"
        );
    }

    // status: one screen with the site, the active gateway, both nodes, the peering up.
    let o = weftctl(&s.ta, &["status"]);
    assert!(o.status.success(), "{}", weft_tests::stderr(&o));
    let st = stdout(&o);
    for want in [
        "Site obs-a",
        "gw",
        "active",
        "Ready",
        "na2",
        "obs-b",
        "connected",
        "up",
        "→",
    ] {
        assert!(
            st.to_lowercase().contains(&want.to_lowercase()),
            "status lacks {want:?}:\n{st}"
        );
    }
    println!("weftctl status:\n{st}");

    // topology: DOT, and SVG through Graphviz.
    let dot = stdout(&weftctl(&s.ta, &["topology"]));
    for want in [
        "digraph weft",
        "gateway gw",
        "node na",
        "site obs-b",
        "WireGuard up",
        "RTT",
    ] {
        assert!(dot.contains(want), "topology lacks {want:?}:\n{dot}");
    }
    let o = weftctl(&s.ta, &["topology", "--format", "svg"]);
    assert!(o.status.success(), "{}", weft_tests::stderr(&o));
    assert!(stdout(&o).contains("<svg"), "not SVG");

    // diagnose: everything passes on a healthy pair, the path MTU included.
    let o = weftctl(&s.ta, &["diagnose", "--output", "json"]);
    let d: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let checks = d["checks"].as_array().unwrap();
    let fails: Vec<&serde_json::Value> = checks.iter().filter(|c| c["result"] == "FAIL").collect();
    assert!(
        fails.is_empty() && o.status.success(),
        "a healthy federation fails diagnose: {fails:#?}"
    );
    let mtu = checks
        .iter()
        .find(|c| c["check"] == "mtu" && c["subject"] == "peering/obs-b")
        .expect("an MTU check of the peering");
    assert_eq!(mtu["result"], "PASS", "{mtu}");
    for kind in ["clock", "tunnel", "certificate", "agent", "kernel"] {
        assert!(
            checks.iter().any(|c| c["check"] == kind),
            "no {kind} check: {checks:#?}"
        );
    }
    weft_tests::step("diagnose says which WireGuard and why");
    // This machine's kernel has no WireGuard: the gateway runs userspace
    // WireGuard, and diagnose says so and why (the VM lane shows the
    // kernel's, tests/e2e/vm.rs).
    let gw = checks
        .iter()
        .find(|c| c["check"] == "kernel" && c["subject"].as_str().unwrap_or_default().starts_with("gateway"))
        .expect("a kernel check of the gateway");
    let detail = gw["detail"].as_str().unwrap();
    assert_eq!(gw["result"], "WARN", "{gw}");
    assert!(
        detail.contains("WireGuard: userspace") && detail.contains("no wireguard module"),
        "{detail}"
    );
    assert!(gw["hint"].as_str().unwrap().contains("CONFIG_WIREGUARD"), "{gw}");
    weft_tests::step("two sites on two stores");
    // Both sites: a on the embedded store, b on etcd.
    for t in [&s.ta, &s.tb] {
        let g = weftctl_json(t, &["gateways"]);
        assert_eq!(g["gateways"][0]["wireguard"], "userspace", "{g}");
    }
    assert_eq!(
        metric(
            &s.scrape("gwa"),
            "weft_gateway_wireguard_info",
            &[("mode", "userspace")]
        ),
        Some(1.0)
    );

    // test network: from node na's host and its workload to both of site b's
    // workloads, by their own addresses, ICMP and TCP.
    let targets: Vec<String> = s
        .workloads
        .iter()
        .filter(|w| w.0.starts_with("wb"))
        .map(|w| format!("obs-b={}", w.1))
        .collect();
    let mut args = vec![
        "test",
        "network",
        "--from",
        "host",
        "--from",
        &s.ns["wa"],
        "--tcp-port",
        "7",
    ];
    for t in &targets {
        args.extend(["--to", t.as_str()]);
    }
    let o = weftctl_in(&s, "na", &s.ta, &args);
    let out = stdout(&o);
    assert!(
        o.status.success(),
        "test network fails on a working fabric:\n{out}{}",
        weft_tests::stderr(&o)
    );
    assert!(out.contains("4 of 4 pairs reachable"), "{out}");
    println!("weftctl test network:\n{out}");

    weft_tests::step("a route deleted by hand, found by diagnose");
    // Delete na's route to site b's workloads by hand (drift repair is off):
    // test network fails and names the pairs.
    let routes = stdout(&weft_tests::netns::exec(
        &s.ns["na"],
        &[
            "ip",
            "route",
            "show",
            "table",
            &weft_controller::render::TABLE.to_string(),
        ],
    ));
    let (_, _, wb_local) = s.workloads.iter().find(|w| w.0 == "wb").unwrap();
    let victim = routes
        .lines()
        .find(|l| {
            l.split_whitespace()
                .next()
                .and_then(|c| c.parse::<ipnet::Ipv4Net>().ok())
                .is_some_and(|n| n.contains(&wb_local.parse::<std::net::Ipv4Addr>().unwrap()))
        })
        .unwrap_or_else(|| panic!("no route to {wb_local} in weft's table on na:\n{routes}"))
        .split_whitespace()
        .next()
        .unwrap()
        .to_string();
    weft_tests::netns::must(
        weft_tests::netns::exec(
            &s.ns["na"],
            &[
                "ip",
                "route",
                "del",
                &victim,
                "table",
                &weft_controller::render::TABLE.to_string(),
            ],
        ),
        "delete the route",
    );
    let o = weftctl_in(&s, "na", &s.ta, &args);
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(1), "test network must fail:\n{out}");
    let first = &targets[0];
    let ip = first.split_once('=').unwrap().1;
    assert!(
        out.contains(&format!("FAIL host → obs-b {ip}")),
        "the failing pair is not named:\n{out}"
    );
    assert!(out.contains(&format!("FAIL {} → obs-b {ip}", s.ns["wa"])), "{out}");
    assert!(out.contains("0 of 4 pairs reachable"), "{out}");
    println!("weftctl test network after the route was removed:\n{out}");
}

#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn diagnose_finds_a_tunnel_mtu_set_too_high_on_one_side() {
    if !require_root() {
        return;
    }
    weft_tests::step("a tunnel MTU set on one side");
    // Site a sets --tunnel-mtu 1480 (the lower configured value of the two
    // sites wins, so both tunnels use it) on a 1500-byte underlay: full
    // tunnel packets need 1540 bytes. Traffic still passes, fragmented.
    let s = sites::up_with(
        "mtu",
        ("mtu-a", "10.1.0.0/16"),
        ("mtu-b", "10.2.0.0/16"),
        Opts {
            site_a_tunnel: Some(1480),
            ..Opts::default()
        },
    );
    for (target, peer) in [(&s.ta, "mtu-b"), (&s.tb, "mtu-a")] {
        let mtu = eventually("a path-MTU verdict", Duration::from_secs(30), || {
            let o = weftctl(target, &["diagnose", "--settle", "100ms", "--output", "json"]);
            let d: serde_json::Value = serde_json::from_slice(&o.stdout).ok()?;
            let c = d["checks"]
                .as_array()?
                .iter()
                .find(|c| c["check"] == "mtu" && c["subject"] == format!("peering/{peer}"))?
                .clone();
            (c["result"] != "WARN").then_some((c, o.status.code()))
        });
        let (c, code) = mtu;
        assert_eq!(c["result"], "FAIL", "{c}");
        assert_eq!(code, Some(1), "diagnose exits 1 on a failure");
        let detail = c["detail"].as_str().unwrap();
        assert!(
            detail.contains("1480") && detail.contains("1540") && detail.contains("1500"),
            "{detail}"
        );
        assert!(c["hint"].as_str().unwrap().contains("--tunnel-mtu to 1440"), "{c}");
    }
    // The table says the same to a person.
    let o = weftctl(&s.ta, &["diagnose", "--settle", "100ms"]);
    let out = stdout(&o);
    assert!(out.contains("FAIL") && out.contains("too high"), "{out}");
    println!("weftctl diagnose:\n{out}");
}
