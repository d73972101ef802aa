//! Export policy: what a peer may reach of a site, set by that site and
//! enforced at its gateway, in the peering's namespace. Two sites on one
//! workload CIDR (views remapped), each workload with an address in two
//! /24s and services on two ports. Needs root: run under CI=true.

use std::time::{Duration, Instant};

use weft_tests::mesh::{ECHO_PORT, Mesh};
use weft_tests::{bin, eventually, netns, stderr, weftctl_json};

const POD: &str = "10.1.0.0/16";
/// The port the policy allows (a second `weft-echo serve` on site B).
const ALLOWED: u16 = 8080;
/// Site B's workload in the /24 the policy exports, and in another.
const NEAR: &str = "10.1.0.10";
const FAR: &str = "10.1.1.10";

/// `real`, an address of site `to`'s workload CIDR, as site `from`
/// addresses it (through its local view).
fn seen_from(mesh: &Mesh, from: usize, to: usize, real: &str) -> String {
    let p = mesh.peering(&mesh.sites[from], &mesh.sites[to].id).unwrap();
    let v = p["views"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["kind"] == "workload")
        .unwrap();
    let (r, l): (ipnet::Ipv4Net, ipnet::Ipv4Net) = (
        v["real_cidr"].as_str().unwrap().parse().unwrap(),
        v["local_cidr"].as_str().unwrap().parse().unwrap(),
    );
    weft_controller::ipam::translate(real.parse().unwrap(), r, l)
        .unwrap()
        .to_string()
}

/// Packets the export policy of `site`'s peering with `peer` refused (its
/// nft counter `refused` in the peering's namespace); None when that
/// namespace's table has no such counter (no policy).
fn refused(mesh: &mut Mesh, site: usize, peer: &str) -> Option<u64> {
    mesh.nft_counter(site, peer, "refused")
}

/// `weftctl peering policy ARGS` at site `site`: Ok(json) or Err(stderr).
fn policy(mesh: &Mesh, site: usize, args: &[&str]) -> Result<serde_json::Value, String> {
    let o = weft_tests::run(
        std::process::Command::new(bin("weftctl"))
            .args([
                "--controller",
                &mesh.sites[site].target,
                "--output",
                "json",
                "peering",
                "policy",
            ])
            .args(args),
    );
    if o.status.success() {
        Ok(serde_json::from_slice(&o.stdout).unwrap())
    } else {
        Err(stderr(&o))
    }
}

/// Whether site `from`'s workload gets an answer to one ping of `addr`.
fn pings(mesh: &Mesh, from: usize, addr: &str) -> bool {
    netns::exec(&mesh.sites[from].wl, &["ping", "-c", "1", "-W", "2", addr])
        .status
        .success()
}

/// Whether site `from` reaches `addr:port` and site `to` answers.
fn answers(mesh: &Mesh, from: usize, to: usize, addr: &str, port: u16) -> bool {
    matches!(mesh.ask_port(from, addr, port), Ok((site, _)) if site == mesh.sites[to].id)
}

/// Sets a policy at B for A and returns how long until B's gateway had it
/// in its peering's namespace (the refused counter's value changed from
/// `before`, i.e. the table was written anew).
fn set_and_time(mesh: &mut Mesh, args: &[&str], applied: impl Fn(&mut Mesh) -> bool) -> Duration {
    let t = Instant::now();
    policy(mesh, 1, args).unwrap();
    loop {
        if applied(mesh) {
            return t.elapsed();
        }
        if t.elapsed() > Duration::from_secs(30) {
            let g = mesh.sites[1].gateway;
            let log = mesh.lab.proc(g).log_text();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            panic!(
                "policy {args:?} not applied at B's gateway after 30 s; its chain:\n{}\ngateways: {}\nlog:\n{}",
                chain(mesh),
                weftctl_json(&mesh.sites[1].target, &["gateways"]),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A `weft-echo hold` from site `from`'s workload to `target` (a line
/// every 100 ms, each echo awaited at most 2 s), given a second to
/// connect; its process and the file that ends it.
fn hold_open(mesh: &mut Mesh, from: usize, target: &str, tag: &str) -> (usize, std::path::PathBuf) {
    let stop = mesh.dir.path().join(format!("{tag}.stop"));
    let log = mesh.dir.path().join(format!("{tag}.log"));
    let wl = mesh.sites[from].wl.clone();
    let until = stop.to_str().unwrap().to_string();
    let p = mesh.lab.spawn(
        &wl,
        &bin("weft-echo"),
        &["hold", target, "--until", &until, "--timeout", "2s"],
        &log,
    );
    std::thread::sleep(Duration::from_secs(1));
    (p, stop)
}

/// The `from_tunnel` chain of B's peering namespace, as nft lists it.
fn chain(mesh: &mut Mesh) -> String {
    let ns = weft_controller::render::peering_namespace("s2", "s1");
    let pid = mesh.gateway_pid(1);
    let o = netns::exec_beside(pid, &ns, &["nft", "list", "chain", "inet", "weft", "from_tunnel"]);
    assert!(o.status.success(), "nft in {ns}: {}", stderr(&o));
    weft_tests::stdout(&o)
}

#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn an_export_policy_limits_what_a_peer_reaches_and_changes_without_breaking_allowed_connections() {
    if !netns::require_root() {
        return;
    }
    weft_tests::step("two sites on one CIDR, peered; B serves two ports on two /24s");
    let mut mesh = Mesh::up_wide("pol", 2, POD);
    let wl = mesh.sites[1].wl.clone();
    let log = mesh.dir.path().join("s2-echo-8080.log");
    mesh.lab.spawn(
        &wl,
        &bin("weft-echo"),
        &["serve", "--port", &ALLOWED.to_string(), "--name", "s2"],
        &log,
    );
    mesh.peer(0, 1);
    let (a, b) = (0, 1);
    let (near, far) = (seen_from(&mesh, a, b, NEAR), seen_from(&mesh, a, b, FAR));
    eprintln!("A reaches B's {NEAR} at {near} and {FAR} at {far}");

    weft_tests::step("without a policy, A reaches everything of B");
    for (addr, port) in [(&near, ECHO_PORT), (&near, ALLOWED), (&far, ECHO_PORT), (&far, ALLOWED)] {
        eventually(&format!("A reaches {addr}:{port}"), Duration::from_secs(30), || {
            answers(&mesh, a, b, addr, port).then_some(())
        });
    }
    assert_eq!(refused(&mut mesh, b, "s1"), None, "no policy, no policy counter");
    // B publishes a name in each /24; A learns both.
    for (name, addr) in [("near", NEAR), ("far", FAR)] {
        weftctl_json(&mesh.sites[b].target, &["name", "add", name, addr]);
    }
    let learned = |m: &Mesh| -> Vec<String> {
        let mut n: Vec<String> = weftctl_json(&m.sites[a].target, &["names"])["learned"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|n| n["name"].as_str().map(String::from))
            .collect();
        n.sort();
        n
    };
    eventually("A learns B's two names", Duration::from_secs(10), || {
        (learned(&mesh) == ["far", "near"]).then_some(())
    });
    // A's node routes B's whole workload view.
    let view = mesh.view_of(a, b).unwrap();
    let node_routes = |m: &Mesh| {
        weft_tests::stdout(&netns::exec(
            &m.sites[a].node,
            &["ip", "route", "show", "table", "7765"],
        ))
    };
    assert!(node_routes(&mesh).contains(&view.to_string()), "{}", node_routes(&mesh));
    let shown = policy(&mesh, b, &["show", "s1"]).unwrap();
    assert_eq!(
        (shown["mode"].as_str(), shown["effective"].as_str()),
        (Some("site default"), Some("all")),
        "{shown}"
    );

    weft_tests::step("B exports one /24 and TCP 8080 to A");
    let took = set_and_time(&mut mesh, &["set", "s1", "--allow", "10.1.0.0/24,tcp,8080"], |m| {
        refused(m, b, "s1").is_some()
    });
    eprintln!("the policy was in B's gateway {} ms after the call", took.as_millis());
    assert!(took < Duration::from_secs(2), "the policy took {took:?} to apply");
    assert!(
        answers(&mesh, a, b, &near, ALLOWED),
        "A no longer reaches the allowed {near}:{ALLOWED}"
    );
    let before = refused(&mut mesh, b, "s1").unwrap();
    for (addr, port, what) in [
        (&near, ECHO_PORT, "another port"),
        (&far, ALLOWED, "another prefix"),
        (&far, ECHO_PORT, "another prefix and port"),
    ] {
        let r = mesh.ask_port(a, addr, port);
        assert!(r.is_err(), "A reached {addr}:{port} ({what}) against the policy: {r:?}");
    }
    assert!(
        !pings(&mesh, a, &near),
        "ICMP is not allowed, yet {near} answers a ping"
    );
    // (Each refused connection: its SYN and at least one retry.)
    let after = refused(&mut mesh, b, "s1").unwrap();
    assert!(
        after >= before + 3,
        "the policy counter moved by {} for three refused connections:\n{}",
        after - before,
        chain(&mut mesh)
    );
    eprintln!("refused by the policy: {} packets", after - before);
    // B's own traffic to A still gets its replies (B opened it).
    let a_from_b = seen_from(&mesh, b, a, NEAR);
    assert!(answers(&mesh, b, a, &a_from_b, ECHO_PORT), "B no longer reaches A");
    weft_tests::step("A is told what it may reach, and learns only the names within it");
    eventually("A is told what B exports", Duration::from_secs(10), || {
        let p = mesh.peering(&mesh.sites[a], "s2")?;
        (p["peer_exports"] == serde_json::json!(["10.1.0.0/24"])).then_some(())
    });
    eventually("A learns only the exported name", Duration::from_secs(10), || {
        (learned(&mesh) == ["near"]).then_some(())
    });
    // A still routes B's whole view: B's own connections from anywhere in
    // it get their replies.
    assert!(node_routes(&mesh).contains(&view.to_string()), "{}", node_routes(&mesh));
    let listed = weftctl_json(&mesh.sites[b].target, &["peerings"]);
    let p = &listed["peerings"][0];
    // B's gateway said its agent enforces export policies.
    assert_eq!(p["export"]["not_enforced_by"], serde_json::json!([]), "{p}");
    assert_eq!(p["export"]["effective"], "rules", "{p}");
    assert_eq!(p["export"]["rules"][0]["cidr"], "10.1.0.0/24", "{p}");

    weft_tests::step("policy changes keep an open, allowed connection");
    let (hold, stop) = hold_open(&mut mesh, a, &format!("{near}:{ALLOWED}"), "hold");
    // Wider: the other /24 on the same port too.
    let took = set_and_time(
        &mut mesh,
        &[
            "set",
            "s1",
            "--allow",
            "10.1.0.0/24,tcp,8080",
            "--allow",
            "10.1.1.0/24,tcp,8080",
        ],
        |m| chain(m).contains("10.1.1.0/24"),
    );
    eprintln!(
        "the wider policy was in B's gateway {} ms after the call",
        took.as_millis()
    );
    assert!(took < Duration::from_secs(2), "the wider policy took {took:?}");
    assert!(
        answers(&mesh, a, b, &far, ALLOWED),
        "the wider policy does not let A reach {far}:{ALLOWED}"
    );
    // Narrower again: ICMP added, the other /24 gone.
    let took = set_and_time(
        &mut mesh,
        &[
            "set",
            "s1",
            "--allow",
            "10.1.0.0/24,tcp,8080",
            "--allow",
            "10.1.0.0/24,icmp",
        ],
        |m| {
            let c = chain(m);
            !c.contains("10.1.1.0/24") && c.contains("icmp")
        },
    );
    assert!(took < Duration::from_secs(2), "the narrower policy took {took:?}");
    assert!(
        mesh.ask_port(a, &far, ALLOWED).is_err(),
        "A still reaches {far}:{ALLOWED}"
    );
    assert!(
        !pings(&mesh, a, &far),
        "ICMP is allowed to {near}'s /24 only, yet {far} answers a ping"
    );
    let ping = netns::exec(&mesh.sites[a].wl, &["ping", "-c", "1", "-W", "2", &near]);
    assert!(
        ping.status.success(),
        "ICMP allowed, but {near} does not answer: {}",
        weft_tests::stdout(&ping)
    );
    std::thread::sleep(Duration::from_millis(500));
    std::fs::write(&stop, "").unwrap();
    let st = mesh.lab.proc(hold).wait_exit(Duration::from_secs(10));
    let held = mesh.lab.proc(hold).log_text();
    assert!(
        st.is_some_and(|s| s.success()) && held.contains("HELD"),
        "the allowed connection broke across policy changes: {held}"
    );
    eprintln!("{}", held.trim());

    weft_tests::step("a policy that no longer allows an open connection ends it");
    let (cut, stop2) = hold_open(&mut mesh, a, &format!("{near}:{ALLOWED}"), "hold-cut");
    set_and_time(&mut mesh, &["set", "s1", "--none"], |m| !chain(m).contains("8080"));
    let st = mesh.lab.proc(cut).wait_exit(Duration::from_secs(15));
    let text = mesh.lab.proc(cut).log_text();
    assert!(
        st.is_some_and(|s| !s.success()) && text.contains("BROKEN"),
        "a connection the policy no longer allows went on: {text}"
    );
    let _ = std::fs::write(&stop2, "");
    assert!(
        answers(&mesh, b, a, &a_from_b, ECHO_PORT),
        "with --none, B no longer reaches A"
    );

    weft_tests::step("bad policies are refused, naming the field, and change nothing");
    let kept = policy(&mesh, b, &["show", "s1"]).unwrap();
    let many: Vec<String> = (1..=257).map(|p| format!("10.1.0.0/24,tcp,{p}")).collect();
    let mut too_many = vec!["set", "s1"];
    for m in &many {
        too_many.extend(["--allow", m.as_str()]);
    }
    // The controller's refusals (what only it can know: the site's CIDRs,
    // the number of rules), and weftctl's own, made before anything is
    // sent with the same checks (weft-types' policy), naming the field.
    for (args, says, controllers) in [
        (vec!["set", "s1", "--allow", "192.168.5.0/24"], "rules[0].cidr", true),
        (vec!["set", "s1", "--allow", "10.0.0.0/8,tcp,80"], "rules[0].cidr", true),
        (too_many, "rules:", true),
        (
            vec!["set", "s1", "--allow", "10.1.0.0/24,tcp,9000-8000"],
            "last_port: the range 9000-8000 ends before it starts",
            false,
        ),
        (
            vec!["set", "s1", "--allow", "10.1.0.0/24,tcp,70000"],
            "first_port: 70000 is not a port",
            false,
        ),
        (
            vec!["set", "s1", "--allow", "10.1.0.0/24,icmp,80"],
            "first_port: ports need protocol tcp or udp",
            false,
        ),
        (
            vec!["set", "s1", "--allow", "10.1.0.0/24,gre"],
            "protocol: \"gre\"",
            false,
        ),
    ] {
        let e = policy(&mesh, b, &args).unwrap_err();
        assert!(e.contains(says), "{args:?}: {e}");
        assert_eq!(e.contains("INVALID_ARGUMENT"), controllers, "{args:?}: {e}");
        assert_eq!(
            policy(&mesh, b, &["show", "s1"]).unwrap(),
            kept,
            "{args:?} changed the policy"
        );
    }
    // The controller makes the same checks itself, for a client that
    // sends a bad rule anyway (grpcurl, as a user types it).
    let grpcurl = weft_tests::require_tool("grpcurl").expect("grpcurl (deploy/setup.sh installs it)");
    let socket = mesh.sites[b].target.trim_start_matches("unix:").to_string();
    let o = weft_tests::run(std::process::Command::new(grpcurl).args([
        "-plaintext",
        "-unix",
        "-d",
        r#"{"site_id":"s1","mode":"EXPORT_MODE_RULES","rules":[{"cidr":"10.1.0.0/24","protocol":"tcp","first_port":9000,"last_port":8000}]}"#,
        &socket,
        "weft.v1.AdminService/SetExportPolicy",
    ]));
    let e = stderr(&o);
    assert!(
        !o.status.success() && e.contains("InvalidArgument") && e.contains("rules[0].last_port"),
        "{e}"
    );
    assert_eq!(
        policy(&mesh, b, &["show", "s1"]).unwrap(),
        kept,
        "a refused call changed the policy"
    );
    let e = policy(&mesh, b, &["set", "nobody", "--all"]).unwrap_err();
    assert!(e.contains("NOT_FOUND"), "{e}");

    weft_tests::step("a site started with --default-export none exports nothing until told");
    let c = mesh.add_site_with(&["--default-export", "none"]);
    mesh.peer(a, c);
    let c_near = seen_from(&mesh, a, c, NEAR);
    let a_from_c = seen_from(&mesh, c, a, NEAR);
    eventually("the third site reaches A", Duration::from_secs(30), || {
        answers(&mesh, c, a, &a_from_c, ECHO_PORT).then_some(())
    });
    assert!(
        mesh.ask_at(a, &c_near).is_err(),
        "A reached {c_near} of a site that exports nothing"
    );
    let shown = policy(&mesh, c, &["show", "s1"]).unwrap();
    assert_eq!(
        (
            shown["mode"].as_str(),
            shown["effective"].as_str(),
            shown["rules"].as_array().map(Vec::len)
        ),
        (Some("site default"), Some("rules"), Some(0)),
        "{shown}"
    );
    eventually(
        "A is told the third site exports nothing",
        Duration::from_secs(10),
        || {
            let p = mesh.peering(&mesh.sites[a], &mesh.sites[c].id)?;
            (p["peer_exports"] == serde_json::json!([])).then_some(())
        },
    );
    policy(&mesh, c, &["set", "s1", "--all"]).unwrap();
    eventually("--all on the third site", Duration::from_secs(10), || {
        answers(&mesh, a, c, &c_near, ECHO_PORT).then_some(())
    });

    weft_tests::step("the admin sees what the policy refused");
    // The gateway reads the counter every 30th probe (one a second).
    let n = eventually("B's admin sees the refused packets", Duration::from_secs(60), || {
        let p = weftctl_json(&mesh.sites[b].target, &["peerings"]);
        p["peerings"][0]["tunnel"]["dropped_by_policy"]
            .as_u64()
            .filter(|n| *n > 0)
    });
    eprintln!("weftctl peerings: {n} packets refused by the policy");
    policy(&mesh, b, &["set", "s1", "--all"]).unwrap();
    eventually("everything again", Duration::from_secs(10), || {
        answers(&mesh, a, b, &far, ECHO_PORT).then_some(())
    });
    assert!(node_routes(&mesh).contains(&view.to_string()), "{}", node_routes(&mesh));
    eventually("A learns both names again", Duration::from_secs(10), || {
        (learned(&mesh) == ["far", "near"]).then_some(())
    });
}
