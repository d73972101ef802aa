//! Dual stack between real controller processes on loopback: two sites on
//! the same IPv4 CIDR and the same IPv6 ULA prefix each remap the other in
//! both families; an IPv4-only site peered with a dual-stack one keeps its
//! IPv4 views, and both sides say why IPv6 is not negotiated.

use std::process::Command;

use std::time::Duration;

use serde_json::Value;
use weft_tests::netns::{self, require_root};
use weft_tests::sites;
use weft_tests::{Controller, ControllerSpec, bin, run, stdout, weftctl_json};

/// Whether workload host `from` gets an answer to one ping of `to`, of
/// either family.
fn ping(s: &sites::TwoSites, from: &str, to: &str) -> bool {
    let family = if to.contains(':') { "-6" } else { "-4" };
    netns::exec(&s.ns[from], &["ping", family, "-c", "1", "-W", "1", to])
        .status
        .success()
}

/// A TCP service on port 5300 of both families in each workload host of
/// `hosts`: it answers with where it saw the caller ("from ADDRESS").
fn serve_echo(s: &mut sites::TwoSites, hosts: &[&str]) {
    let echo_py = "import socket\ns=socket.create_server(('::',5300),family=socket.AF_INET6,dualstack_ipv6=True,reuse_port=True)\nwhile True:\n    c,a=s.accept()\n    c.sendall(('from '+a[0].removeprefix('::ffff:')).encode())\n    c.close()";
    for wl in hosts {
        s.lab.spawn(
            &s.ns[wl],
            std::path::Path::new("/usr/bin/env"),
            &["python3", "-c", echo_py],
            &s.dir.path().join(format!("echo-{wl}.log")),
        );
    }
    for wl in hosts {
        weft_tests::eventually(&format!("the echo service in {wl}"), Duration::from_secs(10), || {
            weft_tests::stdout(&netns::exec(&s.ns[wl], &["ss", "-ltn"]))
                .contains(":5300")
                .then_some(())
        });
    }
}

/// What the echo service at `to` told workload host `from` (within 3 s),
/// or why not.
fn ask_echo(s: &sites::TwoSites, from: &str, to: &str) -> Result<String, String> {
    let ask =
        format!("import socket\ns=socket.create_connection(('{to}',5300),timeout=3)\nprint(s.recv(100).decode())");
    let o = netns::exec(&s.ns[from], &["python3", "-c", &ask]);
    match o.status.success() {
        true => Ok(weft_tests::stdout(&o).trim().to_string()),
        false => Err(String::from_utf8_lossy(&o.stderr).to_string()),
    }
}

/// Every workload of one site with every workload of the other, from a
/// list of (host, real address, address the other site sees): (from,
/// where the other site sees it, to, where `from` reaches it).
fn across(w: &[(&'static str, String, String)]) -> Vec<(&'static str, String, &'static str, String)> {
    let mut out = Vec::new();
    for (from, _, from_seen) in w {
        for (to, _, to_seen) in w.iter().filter(|x| x.0.as_bytes()[1] != from.as_bytes()[1]) {
            out.push((*from, from_seen.clone(), *to, to_seen.clone()));
        }
    }
    out
}

fn site(dir: &std::path::Path, id: &str, pods: &str) -> Controller {
    ControllerSpec::new(id)
        .data_dir(&dir.join(id))
        .flags(&["--pod-cidr", pods])
        .start()
}

fn peer(a: &Controller, b: &Controller) {
    let token = weftctl_json(&b.target(), &["peering", "token", "--ttl", "10m"])["token"]
        .as_str()
        .unwrap()
        .to_string();
    weftctl_json(&a.target(), &["peering", "create", "--token", &token]);
}

/// The `ipv6` check `weftctl diagnose` makes of the peering with `peer`.
fn ipv6_check(target: &str, peer: &str) -> Value {
    let report = weft_tests::weftctl_diagnose(target, &[]);
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == "ipv6" && c["subject"] == format!("peering/{peer}"))
        .unwrap_or_else(|| panic!("no ipv6 check of peering/{peer}: {report:#}"))
        .clone()
}

/// Site `c`'s peering with `peer`, as `weftctl peerings` shows it.
fn peering(c: &Controller, peer: &str) -> Value {
    weftctl_json(&c.target(), &["peerings"])["peerings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["site_id"] == peer)
        .unwrap_or_else(|| panic!("no peering with {peer}"))
        .clone()
}

/// The (real, local) CIDRs of `p`'s workload views.
fn workload_views(p: &Value) -> Vec<(String, String)> {
    p["views"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["kind"] == "workload")
        .map(|v| {
            (
                v["real_cidr"].as_str().unwrap().to_string(),
                v["local_cidr"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The remap pools of site `c`, IPv6 ones only.
fn ipv6_pools(c: &Controller) -> Vec<ipnet::Ipv6Net> {
    weftctl_json(&c.target(), &["site"])["remap_pools"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p.as_str().unwrap().parse().ok())
        .collect()
}

#[test]
fn same_cidrs_in_both_families_are_remapped_and_an_ipv4_site_says_why_not() {
    let dir = tempfile::Builder::new().prefix("weft-dual").tempdir().unwrap();
    let a = site(dir.path(), "site-a", "10.1.0.0/16,fd00:1::/48");
    let b = site(dir.path(), "site-b", "10.1.0.0/16,fd00:1::/48");
    let c = site(dir.path(), "site-c", "10.1.0.0/16");

    weft_tests::step("two dual-stack sites on the same CIDRs remap each other in both families");
    peer(&a, &b);
    for (x, y) in [(&a, "site-b"), (&b, "site-a")] {
        let p = peering(x, y);
        assert_eq!(p["ipv6"], "negotiated", "{p:#}");
        let views = workload_views(&p);
        assert_eq!(views.len(), 2, "{views:?}");
        let (real4, local4) = &views[0];
        assert_eq!(real4, "10.1.0.0/16");
        assert_ne!(local4, "10.1.0.0/16", "the IPv4 view is remapped");
        let (real6, local6) = &views[1];
        assert_eq!(real6, "fd00:1::/48");
        let local6: ipnet::Ipv6Net = local6.parse().unwrap();
        assert_eq!(local6.prefix_len(), 48, "the length is kept");
        let pools = ipv6_pools(x);
        assert!(
            pools.iter().any(|p| p.contains(&local6)),
            "{local6} is not in {pools:?}"
        );
    }
    let text = stdout(&run(Command::new(bin("weftctl")).args([
        "--controller",
        &a.target(),
        "peerings",
    ])));
    assert!(
        text.contains("fd00:1::/48") && text.contains("site-b: IPv6 negotiated"),
        "{text}"
    );

    weft_tests::step("an IPv4-only site keeps its IPv4 views; both sides say why IPv6 is not negotiated");
    peer(&a, &c);
    let ac = peering(&a, "site-c");
    assert_eq!(workload_views(&ac).len(), 1, "{ac:#}");
    assert_eq!(workload_views(&ac)[0].0, "10.1.0.0/16");
    let why = ac["ipv6"].as_str().unwrap();
    assert!(why.starts_with("not negotiated: site-c offered no IPv6 CIDRs"), "{why}");
    let ca = peering(&c, "site-a");
    assert_eq!(workload_views(&ca).len(), 1, "{ca:#}");
    let why = ca["ipv6"].as_str().unwrap();
    assert!(
        why.contains("site-a offers IPv6 CIDRs, but this site has none"),
        "{why}"
    );
    // The peering itself is whole: negotiated, its IPv4 view in place.
    assert_ne!(ac["state"], "pending", "{ac:#}");
}

/// What `weftctl` says, failing, when run against `target` with `args`.
fn refusal(target: &str, args: &[&str]) -> String {
    let o = run(Command::new(bin("weftctl")).args(["--controller", target]).args(args));
    assert!(!o.status.success(), "{args:?} succeeded: {}", stdout(&o));
    String::from_utf8_lossy(&o.stderr).to_string()
}

/// An IPv6-only site (IPv6 pod CIDRs, no IPv4 ones): its nodes get a /64
/// and no IPv4 subnet; it offers peers no IPv4 and refuses IPv4 it could
/// not use. A dual-stack peer on the same ULA takes its IPv6 CIDRs,
/// remapped, and both sides say why IPv4 is not negotiated; an IPv4-only
/// site cannot peer with it, told that they share no family.
#[test]
fn an_ipv6_only_site_peers_by_ipv6_and_both_sides_say_why_not_ipv4() {
    let dir = tempfile::Builder::new().prefix("weft-dual").tempdir().unwrap();
    let a = site(dir.path(), "v6c-a", "10.1.0.0/16,fd00:1::/48");
    let b = site(dir.path(), "v6c-b", "fd00:1::/48");
    let c = site(dir.path(), "v6c-c", "10.1.0.0/16");

    weft_tests::step("its nodes get a /64 and no IPv4 subnet; IPv4 it cannot use is refused");
    let n = weftctl_json(&b.target(), &["node", "add", "n1"]);
    assert_eq!(n["subnet"], "", "{n:#}");
    let v6: ipnet::Ipv6Net = n["subnet_v6"].as_str().unwrap().parse().unwrap();
    assert!(v6.prefix_len() == 64 && "fd00:1::/48".parse::<ipnet::Ipv6Net>().unwrap().contains(&v6));
    let said = refusal(&b.target(), &["node", "add", "n2", "--subnet", "10.1.0.0/24"]);
    assert!(
        said.contains("no IPv4 pod CIDRs") && said.contains("drop --subnet"),
        "{said}"
    );
    let said = refusal(&b.target(), &["name", "add", "web", "10.1.0.10"]);
    assert!(said.contains("IPv6-only"), "{said}");

    weft_tests::step("a dual-stack peer takes its IPv6, remapped; both say why IPv4 is not negotiated");
    peer(&a, &b);
    let ab = peering(&a, "v6c-b");
    assert_eq!(ab["ipv6"], "negotiated", "{ab:#}");
    let why = ab["ipv4"].as_str().unwrap();
    assert!(why.starts_with("not negotiated: v6c-b offered no IPv4 CIDRs"), "{ab:#}");
    let views: Vec<Value> = ab["views"].as_array().unwrap().clone();
    assert_eq!(views.len(), 1, "one view, of the IPv6 pods: {ab:#}");
    assert_eq!(views[0]["real_cidr"], "fd00:1::/48");
    assert_ne!(views[0]["local_cidr"], "fd00:1::/48", "remapped");
    let ba = peering(&b, "v6c-a");
    assert_eq!(ba["ipv6"], "negotiated", "{ba:#}");
    let why = ba["ipv4"].as_str().unwrap();
    assert!(why.contains("this site has no IPv4 pod CIDRs"), "{ba:#}");
    assert!(
        ba["views"]
            .as_array()
            .unwrap()
            .iter()
            .all(|v| v["real_cidr"].as_str().unwrap().contains(':')),
        "an IPv4 view on an IPv6-only site: {ba:#}"
    );
    let report = weft_tests::weftctl_diagnose(&b.target(), &[]);
    let check = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == "ipv4" && c["subject"] == "peering/v6c-a")
        .unwrap_or_else(|| panic!("no ipv4 check: {report:#}"))
        .clone();
    assert_eq!(check["result"], "WARN", "{check:#}");
    assert!(
        check["detail"].as_str().unwrap().contains("no IPv4 pod CIDRs"),
        "{check:#}"
    );

    weft_tests::step("an IPv6-only site whose only CIDRs a peer refuses is refused whole");
    let d = site(dir.path(), "v6c-d", "2001:db8:5::/48");
    let token = weftctl_json(&d.target(), &["peering", "token", "--ttl", "10m"])["token"]
        .as_str()
        .unwrap()
        .to_string();
    let said = refusal(&a.target(), &["peering", "create", "--token", &token]);
    assert!(said.contains("nothing of site \"v6c-d\" can be routed"), "{said}");
    assert!(
        weftctl_json(&a.target(), &["peerings"])["peerings"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["site_id"] != "v6c-d"),
        "a half-written peering"
    );

    weft_tests::step("an IPv4-only site and an IPv6-only one share no family: refused, saying so");
    let token = weftctl_json(&b.target(), &["peering", "token", "--ttl", "10m"])["token"]
        .as_str()
        .unwrap()
        .to_string();
    let said = refusal(&c.target(), &["peering", "create", "--token", &token]);
    assert!(said.contains("share no address family"), "{said}");
    assert!(
        weftctl_json(&c.target(), &["peerings"])["peerings"]
            .as_array()
            .unwrap()
            .is_empty()
    );
}

/// An IPv6-only site adds an IPv4 pod CIDR (a restart with it) while
/// peered with a dual-stack site: its node gets an IPv4 subnet, it plans
/// its IPv4 views of the peer's CIDRs recorded at negotiation, and the
/// peer holds its new IPv4 CIDRs for review until `peering accept`; the
/// IPv6 views stay as they were throughout.
#[test]
fn an_ipv6_only_site_adds_ipv4_and_its_peer_takes_it_on_review() {
    let dir = tempfile::Builder::new().prefix("weft-dual").tempdir().unwrap();
    let a = site(dir.path(), "v4up-a", "10.1.0.0/16,fd00:1::/48");
    let mut c = site(dir.path(), "v4up-c", "fd00:1::/48");
    let n = weftctl_json(&c.target(), &["node", "add", "n1"]);
    assert_eq!(n["subnet"], "", "{n:#}");
    peer(&a, &c);
    let ac = peering(&a, "v4up-c");
    assert_eq!(workload_views(&ac).len(), 1, "only IPv6: {ac:#}");

    weft_tests::step("site c restarts with an IPv4 pod CIDR; its node gets an IPv4 subnet");
    c.stop();
    c.set_flag("--pod-cidr", "10.1.0.0/16,fd00:1::/48");
    c.restart_stopped();
    let n1 = weftctl_json(&c.target(), &["node", "get", "n1"]);
    let subnet: ipnet::Ipv4Net = n1["subnet"].as_str().unwrap().parse().unwrap();
    assert!(
        "10.1.0.0/16".parse::<ipnet::Ipv4Net>().unwrap().contains(&subnet),
        "{n1:#}"
    );
    assert_eq!(n1["subnet_v6"], n["subnet_v6"], "the /64 is kept");

    weft_tests::step("site a holds c's IPv4 CIDRs for review; site c plans a's");
    let held = weft_tests::eventually("site a holding c's IPv4 CIDRs", Duration::from_secs(20), || {
        let p = peering(&a, "v4up-c");
        (!p["pending"].is_null()).then_some(p)
    });
    assert_eq!(
        held["pending"]["workload_cidrs"],
        serde_json::json!(["10.1.0.0/16"]),
        "{held:#}"
    );
    let why = held["ipv4"].as_str().unwrap();
    assert!(why.contains("held for review"), "{why}");
    assert_eq!(workload_views(&held), workload_views(&ac), "the IPv6 view stays");
    let ca = weft_tests::eventually("site c planning a's IPv4", Duration::from_secs(20), || {
        let p = peering(&c, "v4up-a");
        (p["ipv4"] == "negotiated").then_some(p)
    });
    assert!(
        workload_views(&ca)
            .iter()
            .any(|(real, local)| real == "10.1.0.0/16" && local != "10.1.0.0/16"),
        "{ca:#}"
    );

    weft_tests::step("an admin of site a accepts them");
    let accepted = weftctl_json(&a.target(), &["peering", "accept", "v4up-c"]);
    assert_eq!(accepted["ipv4"], "negotiated", "{accepted:#}");
    let now = peering(&a, "v4up-c");
    assert!(now["pending"].is_null(), "{now:#}");
    let views = workload_views(&now);
    assert_eq!(views.len(), 2, "{now:#}");
    assert_eq!(views[0].0, "10.1.0.0/16");
    assert_ne!(views[0].1, "10.1.0.0/16", "the same CIDR is remapped");
    assert_eq!(views[1], workload_views(&ac)[0], "the IPv6 view is kept");
}

/// A running IPv4 site adds an IPv6 pod CIDR (a restart with it) while
/// peered with a dual-stack site: the peering stays as it was (the same
/// record, the same IPv4 views), the dual-stack side holds the new IPv6
/// CIDRs for review and says so, and `peering accept` routes them.
#[test]
fn a_running_ipv4_site_adds_ipv6_and_its_peer_takes_it_on_review() {
    let dir = tempfile::Builder::new().prefix("weft-dual").tempdir().unwrap();
    let a = site(dir.path(), "up-a", "10.1.0.0/16,fd00:1::/48");
    let mut c = site(dir.path(), "up-c", "10.1.0.0/16");
    peer(&a, &c);
    let (ac, ca) = (peering(&a, "up-c"), peering(&c, "up-a"));
    assert_eq!(workload_views(&ac).len(), 1, "{ac:#}");

    weft_tests::step("site c restarts with an IPv6 pod CIDR");
    c.stop();
    c.set_flag("--pod-cidr", "10.1.0.0/16,fd00:1::/48");
    c.restart_stopped();
    let held = weft_tests::eventually("site a holding c's IPv6 CIDRs", Duration::from_secs(20), || {
        let p = peering(&a, "up-c");
        (!p["pending_v6"].is_null()).then_some(p)
    });
    assert_eq!(
        held["pending_v6"]["workload_cidrs"],
        serde_json::json!(["fd00:1::/48"]),
        "{held:#}"
    );
    let why = held["ipv6"].as_str().unwrap();
    assert!(
        why.contains("held for review") && why.contains("weftctl peering accept up-c"),
        "{why}"
    );
    let check = ipv6_check(&a.target(), "up-c");
    assert_eq!(check["result"], "WARN", "{check:#}");
    // Nothing else of the peering moved: the same record, the same IPv4
    // views, on both sides.
    for (before, now) in [(&ac, &held), (&ca, &peering(&c, "up-a"))] {
        assert_eq!(now["created_at"], before["created_at"], "{now:#}");
        assert_eq!(workload_views(now)[0], workload_views(before)[0], "{now:#}");
        assert_ne!(now["state"], "pending", "{now:#}");
    }
    // Site c had recorded a's IPv6 CIDRs when it was made: it takes them
    // now that it has IPv6 itself.
    weft_tests::eventually("site c planning a's IPv6", Duration::from_secs(20), || {
        (peering(&c, "up-a")["ipv6"] == "negotiated").then_some(())
    });

    weft_tests::step("an admin of site a accepts them");
    let accepted = weftctl_json(&a.target(), &["peering", "accept", "up-c"]);
    assert_eq!(accepted["ipv6"], "negotiated", "{accepted:#}");
    let now = peering(&a, "up-c");
    assert!(now["pending_v6"].is_null(), "{now:#}");
    let views = workload_views(&now);
    assert_eq!(views.len(), 2, "{now:#}");
    assert_eq!(views[0], workload_views(&ac)[0], "the IPv4 view is kept");
    assert_eq!(views[1].0, "fd00:1::/48");
    assert_ne!(views[1].1, "fd00:1::/48", "the same ULA is remapped");
    assert_eq!(ipv6_check(&a.target(), "up-c")["result"], "PASS");
    // Nothing is left to accept.
    let o = run(Command::new(bin("weftctl")).args(["--controller", &a.target(), "peering", "accept", "up-c"]));
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && said.contains("no change to accept"), "{said}");
}

/// A peer changes both families' CIDRs; its IPv6 change cannot be routed
/// here (a /32 over this site's own ULA /48 needs a remapped /32, and the
/// IPv6 remap pool is a /40). `peering accept` takes the IPv4 change all
/// the same and keeps the IPv6 one held; the next accept says why.
#[test]
fn an_ipv6_change_that_cannot_be_routed_does_not_hold_back_the_ipv4_one() {
    let dir = tempfile::Builder::new().prefix("weft-dual").tempdir().unwrap();
    let a = site(dir.path(), "hx-a", "10.1.0.0/16,fd00:1::/48");
    // (The same ULA on both: b's view of a's is remapped, so b may take
    // a /32 around it.)
    let mut b = site(dir.path(), "hx-b", "10.2.0.0/16,fd00:1::/48");
    peer(&a, &b);
    b.stop();
    b.set_flag("--pod-cidr", "10.3.0.0/16,fd00:1::/32");
    b.restart_stopped();
    let held = weft_tests::eventually("site a holding both changes", Duration::from_secs(20), || {
        let p = peering(&a, "hx-b");
        (!p["pending"].is_null() && !p["pending_v6"].is_null()).then_some(p)
    });
    assert_eq!(
        held["pending_v6"]["workload_cidrs"],
        serde_json::json!(["fd00:1::/32"]),
        "{held:#}"
    );

    let accepted = weftctl_json(&a.target(), &["peering", "accept", "hx-b"]);
    let now = peering(&a, "hx-b");
    assert!(now["pending"].is_null(), "the IPv4 change is taken: {now:#}");
    assert_eq!(workload_views(&now)[0].0, "10.3.0.0/16", "{accepted:#}");
    assert!(!now["pending_v6"].is_null(), "the IPv6 one stays held: {now:#}");
    // What was agreed before stays routed.
    assert!(
        workload_views(&now).iter().any(|(real, _)| real == "fd00:1::/48"),
        "{now:#}"
    );
    let o = run(Command::new(bin("weftctl")).args(["--controller", &a.target(), "peering", "accept", "hx-b"]));
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && said.contains("FAILED_PRECONDITION")
            && said.contains("IPv6 CIDRs hx-b announced cannot be routed"),
        "{said}"
    );
}

/// Two sites on the same IPv4 CIDR and the same IPv6 ULA prefix, each a
/// controller, a gateway and two nodes in namespaces, peered: every
/// workload reaches every workload of the other site over both families,
/// by ICMP and TCP, through the remapped views (prefix NAT of both
/// families in the peering namespaces), and the far end sees the caller
/// at its own view of it.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn workloads_reach_each_other_over_both_families_through_remapped_views() {
    if !require_root() {
        return;
    }
    let opts = sites::Opts {
        ipv6: (Some("fd00:1::/48"), Some("fd00:1::/48")),
        ..Default::default()
    };
    // (Site ids of their own: a peering's namespace is named by both ids,
    // and other tests' labs run beside this one.)
    let mut s = sites::up_with("wds", ("ds-a", "10.1.0.0/16"), ("ds-b", "10.1.0.0/16"), opts);
    let v4 = s.workloads.clone();
    let v6 = s.workloads_v6();
    eprintln!("IPv4 workloads (host, real, seen from the other site): {v4:?}\nIPv6: {v6:?}");
    // The views are remapped in both families (the same CIDRs on both
    // sides): the address a workload is reached at is not its own.
    for (wl, real, seen) in v4.iter().chain(&v6) {
        assert_ne!(real, seen, "{wl} is reached at its own address: no remapping");
    }
    let hosts: Vec<&str> = v4.iter().map(|w| w.0).collect();
    serve_echo(&mut s, &hosts);
    for (from, from_seen, to, to_seen) in across(&v4).into_iter().chain(across(&v6)) {
        let to_seen = to_seen.as_str();
        let reached = weft_tests::try_eventually(Duration::from_secs(20), || ping(&s, from, to_seen).then_some(()));
        if reached.is_none() {
            let mut diag = String::new();
            for (host, cmd) in [
                ("gwa", "ip -6 rule; ip -6 route show table all; ip -6 addr"),
                ("na", "ip -6 rule; ip -6 route show table all; ip -6 addr"),
            ] {
                diag.push_str(&format!(
                    "--- {host}: {cmd}\n{}\n",
                    weft_tests::stdout(&netns::exec(&s.ns[host], &["sh", "-c", cmd]))
                ));
            }
            let o = netns::exec(
                &s.ns_a,
                &[
                    "sh",
                    "-c",
                    "ip -6 rule; ip -6 route show table all; ip -6 addr; nft list ruleset; wg show all 2>/dev/null",
                ],
            );
            diag.push_str(&format!("--- {}\n{}\n", s.ns_a, weft_tests::stdout(&o)));
            for p in [s.gateways.0, s.gateways.1] {
                diag.push_str(&s.lab.proc(p).log_text());
            }
            panic!("{from} cannot reach {to} at {to_seen}:\n{diag}");
        }
        let said = ask_echo(&s, from, to_seen);
        assert_eq!(
            said,
            Ok(format!("from {from_seen}")),
            "TCP {from} → {to} at {to_seen}: the far end saw the caller elsewhere"
        );
    }

    weft_tests::step("a name resolves to both an A and an AAAA record, each in its view");
    // Site b publishes wb with both its addresses; wa asks its node's
    // responder (10.1.0.1: the first address of na's /24) and gets site
    // a's view of each.
    let wb = |v: &[(&'static str, String, String)]| v.iter().find(|w| w.0 == "wb").cloned().unwrap();
    let (wb4, wb6) = (wb(&v4), wb(&v6));
    let o = weft_tests::run(std::process::Command::new(bin("weftctl")).args([
        "--controller",
        &s.tb,
        "name",
        "add",
        "web",
        &wb4.1,
        "--address-v6",
        &wb6.1,
    ]));
    assert!(o.status.success(), "{o:?}");
    let dig = |t: &str| -> Vec<String> {
        let o = netns::exec(
            &s.ns["wa"],
            &[
                "dig",
                "@10.1.0.1",
                "web.ds-b.weft.internal",
                t,
                "+short",
                "+time=1",
                "+tries=1",
            ],
        );
        weft_tests::stdout(&o).lines().map(str::to_string).collect()
    };
    let (a, aaaa) = weft_tests::eventually("web resolving in both families", Duration::from_secs(20), || {
        let (a, aaaa) = (dig("A"), dig("AAAA"));
        (!a.is_empty() && !aaaa.is_empty()).then_some((a, aaaa))
    });
    assert_eq!((a, aaaa), (vec![wb4.2.clone()], vec![wb6.2.clone()]));
    // And the AAAA answer is where wb is reached.
    assert!(
        ping(&s, "wa", &wb6.2),
        "wa cannot reach wb at its AAAA answer {}",
        wb6.2
    );

    weft_tests::step("translate and test network take IPv6");
    let t = weftctl_json(&s.ta, &["translate", "ds-b", &wb6.1]);
    assert_eq!(
        (&t["local_address"], &t["kind"], &t["remapped"]),
        (
            &Value::from(wb6.2.clone()),
            &Value::from("workload"),
            &Value::from(true)
        ),
        "{t:#}"
    );
    let back = weftctl_json(&s.ta, &["translate", &format!("[{}]", wb6.2)]);
    assert_eq!(
        (&back["site"], &back["real_address"]),
        (&Value::from("ds-b"), &Value::from(wb6.1.clone())),
        "{back:#}"
    );
    // From wa's namespace, to wb by both its addresses as site b uses them:
    // ICMP and TCP (its echo service) through site a's views.
    let to = format!("ds-b=[{}],ds-b={}", wb6.1, wb4.1);
    let from = format!("/run/netns/{}", s.ns["wa"]);
    let o = weft_tests::run(std::process::Command::new(bin("weftctl")).args([
        "--controller",
        &s.ta,
        "--output",
        "json",
        "test",
        "network",
        "--from",
        &from,
        "--to",
        &to,
        "--tcp-port",
        "5300",
    ]));
    let got: Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
    assert!(
        o.status.success(),
        "test network failed: {got:#} {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let reached: Vec<(&str, bool)> = got["pairs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["local_address"].as_str().unwrap(),
                p["ok"] == true && p["tcp_ms"].is_number(),
            )
        })
        .collect();
    assert_eq!(reached, [(wb6.2.as_str(), true), (wb4.2.as_str(), true)], "{got:#}");

    let c = ipv6_check(&s.ta, "ds-b");
    assert_eq!(c["result"], "PASS", "{c:#}");
    assert!(
        c["detail"].as_str().unwrap().contains("workload fd00:1::/48 as fd"),
        "{c:#}"
    );

    weft_tests::step("a node counts its traffic to the peer per family");
    let na = s.scrape("na");
    for family in ["ipv4", "ipv6"] {
        for dir in ["tx", "rx"] {
            let l = [("peer_site", "ds-b"), ("direction", dir), ("family", family)];
            let bytes = sites::metric(&na, "weft_node_peer_bytes_total", &l);
            assert!(
                bytes.is_some_and(|b| b > 0.0),
                "na's {family} {dir} bytes to ds-b: {bytes:?}"
            );
        }
    }

    weft_tests::step("what the agents made of both families reads back as they made it");
    // The agents resync every second here: an IPv6 object that read back
    // otherwise than it was made (a route, rule, address or table) would
    // be repaired on every one.
    let repairs =
        |host: &str| sites::metric(&s.scrape(host), "weft_agent_drift_repairs_total", &[]).expect("the drift metric");
    let hosts = ["gwa", "gwb", "na", "nb"];
    let before: Vec<f64> = hosts.iter().map(|h| repairs(h)).collect();
    std::thread::sleep(Duration::from_secs(4));
    let after: Vec<f64> = hosts.iter().map(|h| repairs(h)).collect();
    assert_eq!(before, after, "drift repaired on an unchanged host ({hosts:?})");
}

/// An export policy of both families, at site b for site a (two
/// dual-stack sites on the same CIDRs): a may reach what its rules allow,
/// IPv6 as IPv4, by destination prefix, protocol and port as a addressed
/// them through its views; the rest is dropped and counted; b's own
/// connections to a are unaffected.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn an_export_policy_limits_ipv6_as_it_limits_ipv4() {
    if !require_root() {
        return;
    }
    let opts = sites::Opts {
        ipv6: (Some("fd00:1::/48"), Some("fd00:1::/48")),
        ..Default::default()
    };
    let mut s = sites::up_with("wdp", ("dp-a", "10.1.0.0/16"), ("dp-b", "10.1.0.0/16"), opts);
    let v4 = s.workloads.clone();
    let v6 = s.workloads_v6();
    serve_echo(&mut s, &["wb", "wb2"]);
    let at = |v: &[(&'static str, String, String)], wl: &str| v.iter().find(|w| w.0 == wl).cloned().unwrap();
    let (wb4, wb6, wb2_6) = (at(&v4, "wb"), at(&v6, "wb"), at(&v6, "wb2"));
    // Before any policy, a reaches both over IPv6.
    for to in [&wb6.2, &wb2_6.2] {
        weft_tests::eventually(&format!("wa reaching {to}"), Duration::from_secs(20), || {
            ping(&s, "wa", to).then_some(())
        });
    }

    weft_tests::step("site b lets a reach wb's /64 on TCP 5300 and wb's /24 by ICMP, nothing else");
    let wb_64: ipnet::Ipv6Net = format!("{}/64", wb6.1).parse::<ipnet::Ipv6Net>().unwrap().trunc();
    let wb_24: ipnet::Ipv4Net = format!("{}/24", wb4.1).parse::<ipnet::Ipv4Net>().unwrap().trunc();
    let o = run(Command::new(bin("weftctl")).args([
        "--controller",
        &s.tb,
        "peering",
        "policy",
        "set",
        "dp-a",
        "--allow",
        &format!("{wb_64},tcp,5300"),
        "--allow",
        &format!("{wb_24},icmp"),
    ]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // The peer is told both families' prefixes, and keeps IPv6.
    let told = weft_tests::eventually("site a told of b's exports", Duration::from_secs(20), || {
        let p = weftctl_json(&s.ta, &["peerings"])["peerings"][0].clone();
        p["peer_exports"].is_array().then_some(p)
    });
    assert_eq!(
        told["peer_exports"],
        serde_json::json!([wb_24.to_string(), wb_64.to_string()]),
        "{told:#}"
    );
    assert_eq!(told["ipv6"], "negotiated", "{told:#}");
    weft_tests::eventually("the policy in force at b's gateway", Duration::from_secs(20), || {
        (!ping(&s, "wa", &wb6.2)).then_some(())
    });
    // Allowed: TCP 5300 to wb over IPv6 (the service sees a's view of wa),
    // ICMP to wb over IPv4.
    let wa6 = at(&v6, "wa");
    assert_eq!(ask_echo(&s, "wa", &wb6.2), Ok(format!("from {}", wa6.2)));
    assert!(ping(&s, "wa", &wb4.2), "ICMP to wb over IPv4 is allowed");
    // Refused: ICMPv6 to wb, anything to wb2 over IPv6, TCP to wb over IPv4.
    assert!(!ping(&s, "wa", &wb6.2), "ICMPv6 to wb is not allowed");
    assert!(ask_echo(&s, "wa", &wb2_6.2).is_err(), "wb2's /64 is not allowed");
    assert!(ask_echo(&s, "wa", &wb4.2).is_err(), "TCP over IPv4 is not allowed");
    // b's own connections to a, both families, are not a's to police.
    let wa4 = at(&v4, "wa");
    for to in [&wa4.2, &wa6.2] {
        assert!(ping(&s, "wb", to), "wb cannot reach wa at {to}");
    }
    let refused = weft_tests::stdout(&netns::exec(
        &weft_controller::render::peering_namespace("dp-b", "dp-a"),
        &["nft", "list", "counter", "inet", "weft", "refused"],
    ));
    assert!(
        !refused.contains("packets 0 "),
        "nothing counted as refused:\n{refused}"
    );
}

/// A dual-stack site peered with an IPv4-only one, in namespaces: the
/// IPv4 workloads reach each other both ways; the dual-stack side says
/// why IPv6 is not negotiated, and its tunnel filter drops IPv6 whole.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn an_ipv4_only_peer_gets_ipv4_and_ipv6_stays_off_saying_why() {
    if !require_root() {
        return;
    }
    let opts = sites::Opts {
        ipv6: (Some("fd00:1::/48"), None),
        ..Default::default()
    };
    let s = sites::up_with("wdm", ("dm-a", "10.1.0.0/16"), ("dm-b", "10.2.0.0/16"), opts);
    for (from, to) in [("wa", &s.wb_from_a), ("wb", &s.wa_from_b)] {
        weft_tests::eventually(&format!("{from} pinging {to}"), Duration::from_secs(20), || {
            netns::exec(&s.ns[from], &["ping", "-c", "1", "-W", "1", to])
                .status
                .success()
                .then_some(())
        });
    }
    let p = weftctl_json(&s.ta, &["peerings"])["peerings"][0].clone();
    assert_eq!(p["site_id"], "dm-b");
    let why = p["ipv6"].as_str().unwrap();
    assert!(why.starts_with("not negotiated: dm-b offered no IPv6 CIDRs"), "{p:#}");
    // So do diagnose, and translating an IPv6 address toward it.
    let c = ipv6_check(&s.ta, "dm-b");
    assert_eq!(c["result"], "WARN", "{c:#}");
    assert!(
        c["detail"].as_str().unwrap().contains("dm-b offered no IPv6 CIDRs"),
        "{c:#}"
    );
    let o = weft_tests::run(std::process::Command::new(bin("weftctl")).args([
        "--controller",
        &s.ta,
        "translate",
        "dm-b",
        "fd00:1::10",
    ]));
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && said.contains("carries no IPv6: dm-b offered no IPv6 CIDRs"),
        "{said}"
    );
    let chain = weft_tests::stdout(&netns::exec(
        &s.ns_a,
        &["nft", "list", "chain", "inet", "weft", "from_tunnel"],
    ));
    assert!(chain.contains("meta nfproto ipv6") && chain.contains("drop"), "{chain}");
    let routes = weft_tests::stdout(&netns::exec(
        &s.ns["gwa"],
        &["ip", "-6", "route", "show", "table", "7765"],
    ));
    assert!(
        !routes.contains("weft-v"),
        "an IPv6 route into a peering without IPv6:\n{routes}"
    );
}

/// An IPv6-only underlay: every host of two dual-stack sites, controllers
/// included, is on the WAN by IPv6 alone, with no IPv4 address there. The
/// controllers listen, federate and serve their agents over IPv6; the
/// overlay (VXLAN or Geneve) and the WireGuard tunnel run over IPv6 and
/// carry workloads of both families, remapped. Site a sets a tunnel MTU
/// of 1440, which fits a 1500-byte IPv4 underlay but not an IPv6 one
/// (WireGuard takes 80 bytes there, not 60): the path-MTU check, over
/// ICMPv6, says so.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn an_ipv6_underlay_carries_ipv4_and_ipv6_workloads() {
    if !require_root() {
        return;
    }
    let opts = sites::Opts {
        ipv6: (Some("fd00:1::/48"), Some("fd00:1::/48")),
        underlay_v6: true,
        site_a_tunnel: Some(1440),
        ..Default::default()
    };
    let s = sites::up_with("wdu", ("du-a", "10.1.0.0/16"), ("du-b", "10.1.0.0/16"), opts);
    // Between the hosts there is IPv6 only: no host has an IPv4 address
    // or route on the WAN (so the peering above was negotiated, and the
    // agents enrolled, over IPv6).
    for h in ["ctla", "gwa", "na", "na2", "ctlb", "gwb", "nb", "nb2"] {
        let v4 = weft_tests::stdout(&netns::exec(&s.ns[h], &["ip", "-4", "addr", "show", "dev", "eth0"]));
        assert!(v4.trim().is_empty(), "{h} has IPv4 on the WAN:\n{v4}");
        let v6 = weft_tests::stdout(&netns::exec(&s.ns[h], &["ip", "-6", "addr", "show", "dev", "eth0"]));
        assert!(v6.contains("fd00:78::"), "{h} has no IPv6 WAN address:\n{v6}");
    }
    // The controllers federate at their IPv6 addresses.
    let peerings = weftctl_json(&s.tb, &["peerings"]);
    assert_eq!(
        peerings["peerings"][0]["remote_endpoints"],
        serde_json::json!(["[fd00:78::1]:7443"]),
        "{peerings:#}"
    );
    // The overlay and the tunnel are IPv6's.
    let overlay = weft_tests::stdout(&netns::exec(&s.ns["na"], &["ip", "-d", "link", "show", "weft-vx0"]));
    assert!(
        overlay.contains("fd00:78::10"),
        "na's overlay does not run to gwa's IPv6 address:\n{overlay}"
    );
    let gateways = weftctl_json(&s.tb, &["gateways"]);
    assert_eq!(
        gateways["gateways"][0]["endpoint"], "[fd00:78::20]:51820",
        "{gateways:#}"
    );
    let v4 = s.workloads.clone();
    let v6 = s.workloads_v6();
    for (from, _, to, to_seen) in across(&v4).into_iter().chain(across(&v6)) {
        weft_tests::eventually(
            &format!("{from} reaching {to} at {to_seen} over the IPv6 underlay"),
            Duration::from_secs(20),
            || ping(&s, from, &to_seen).then_some(()),
        );
    }

    weft_tests::step("the path-MTU check goes over ICMPv6 and counts IPv6's overhead");
    let (c, code) = weft_tests::eventually("a path-MTU verdict", Duration::from_secs(30), || {
        let o = run(Command::new(bin("weftctl")).args([
            "--controller",
            &s.tb,
            "diagnose",
            "--settle",
            "100ms",
            "--output",
            "json",
        ]));
        let d: Value = serde_json::from_slice(&o.stdout).ok()?;
        let c = d["checks"]
            .as_array()?
            .iter()
            .find(|c| c["check"] == "mtu" && c["subject"] == "peering/du-a")?
            .clone();
        (c["result"] != "WARN").then_some((c, o.status.code()))
    });
    assert_eq!((c["result"].as_str(), code), (Some("FAIL"), Some(1)), "{c:#}");
    let detail = c["detail"].as_str().unwrap();
    assert!(
        detail.contains("1440") && detail.contains("1520") && detail.contains("fd00:78::10") && detail.contains("1500"),
        "{detail}"
    );
    assert!(c["hint"].as_str().unwrap().contains("--tunnel-mtu to 1420"), "{c:#}");
}

/// An IPv6-only site's data plane: site b has only IPv6 pods; its node
/// keeps a workload bridge (`--workload-bridge`), which takes the first
/// address of the node's /64 and a link-local one (without which the
/// kernel never resolves a workload for forwarded traffic), nothing of
/// IPv4. Site a is dual-stack on
/// the same ULA. Their workloads reach each other over IPv6 through
/// remapped views, the far end sees the caller in its own view, names
/// resolve to AAAA records in each site's view (site b's named by IPv6
/// alone), and nothing of IPv4 is routed or allowed into site b's tunnel.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn an_ipv6_only_site_carries_its_workloads_through_remapped_views() {
    if !require_root() {
        return;
    }
    let dir = tempfile::Builder::new().prefix("weft-v6only").tempdir().unwrap();
    let (site_a, site_b) = ("v6o-a", "v6o-b");
    let mut lab = weft_tests::netns::Lab::new("wv6o");
    lab.lan();
    let mut ns = std::collections::HashMap::new();
    for (h, ip) in [
        ("ctla", "192.168.78.1"),
        ("gwa", "192.168.78.10"),
        ("na", "192.168.78.11"),
        ("ctlb", "192.168.78.2"),
        ("gwb", "192.168.78.20"),
        ("nb", "192.168.78.21"),
    ] {
        let n = lab.host(h);
        lab.plug(&n, &format!("{ip}/24"));
        ns.insert(h, (n, ip));
    }
    for wl in ["wa", "wb"] {
        let n = lab.host(wl);
        ns.insert(wl, (n, ""));
    }
    lab.adopt(&weft_controller::render::peering_namespace(site_a, site_b));
    lab.adopt(&weft_controller::render::peering_namespace(site_b, site_a));
    let spec = |site: &str, pods: &[&str], ctl: &str, gw: &str, node: &str, bridge: bool| {
        let mut c = ControllerSpec::new(site).data_dir(&dir.path().join(site));
        for p in pods {
            c = c.pod(p);
        }
        let mut n = weft_tests::lab::AgentSpec::gateway(node, &ns[node].0, ns[node].1);
        n.kind = "node";
        if bridge {
            n.flags = vec!["--workload-bridge".into(), "weft-br0".into()];
        }
        weft_tests::lab::SiteSpec {
            controller: c,
            ctl: ns[ctl].0.clone(),
            ctl_ip: ns[ctl].1.to_string(),
            agents: vec![weft_tests::lab::AgentSpec::gateway("gw", &ns[gw].0, ns[gw].1), n],
            dir: dir.path().to_path_buf(),
            prefix: site.to_string(),
            resync: "1s".into(),
            agent_metrics: false,
        }
    };
    let ta = lab
        .site(&spec(
            site_a,
            &["10.1.0.0/16", "fd00:1::/48"],
            "ctla",
            "gwa",
            "na",
            false,
        ))
        .target;
    let tb = lab
        .site(&spec(site_b, &["fd00:1::/48"], "ctlb", "gwb", "nb", true))
        .target;

    weft_tests::step("site b's node has a /64 and no IPv4 subnet; its bridge takes the /64's first address");
    let node = |t: &str, name: &str| -> Value {
        weft_tests::eventually(&format!("node {name}"), Duration::from_secs(20), || {
            weftctl_json(t, &["nodes"])["nodes"]
                .as_array()?
                .iter()
                .find(|n| n["name"] == name)
                .cloned()
        })
    };
    let nb = node(&tb, "nb");
    assert_eq!(nb["subnet"], "", "{nb:#}");
    let nb64: ipnet::Ipv6Net = nb["subnet_v6"].as_str().unwrap().parse().unwrap();
    let na64: ipnet::Ipv6Net = node(&ta, "na")["subnet_v6"].as_str().unwrap().parse().unwrap();
    let first = |n: ipnet::Ipv6Net, host: u128| std::net::Ipv6Addr::from(u128::from(n.network()) + host);
    let bridge = weft_tests::eventually("nb's workload bridge with its address", Duration::from_secs(20), || {
        let o = stdout(&netns::exec(&ns["nb"].0, &["ip", "addr", "show", "dev", "weft-br0"]));
        (o.contains(&format!("{}/64", first(nb64, 1))) && o.contains("fe80::1/64")).then_some(o)
    });
    assert!(
        !bridge.contains("inet "),
        "an IPv4 address on an IPv6-only node's bridge:\n{bridge}"
    );

    // wa behind na on a veth, wb on nb's bridge: each at ::10 of its
    // node's /64, by its node's ::1.
    let sh = |h: &str, cmd: &str| netns::must(netns::exec(&ns[h].0, &["sh", "-c", cmd]), cmd);
    sh(
        "na",
        &format!(
            "ip link add wl0 type veth peer name eth0 netns {} && ip addr add {}/64 dev wl0 nodad && ip link set wl0 up \
             && sysctl -qw net.ipv6.conf.all.forwarding=1",
            ns["wa"].0,
            first(na64, 1)
        ),
    );
    sh(
        "nb",
        &format!(
            "ip link add wl0 type veth peer name eth0 netns {} && ip link set wl0 master weft-br0 up \
             && sysctl -qw net.ipv6.conf.all.forwarding=1",
            ns["wb"].0
        ),
    );
    for (wl, net) in [("wa", na64), ("wb", nb64)] {
        sh(
            wl,
            &format!(
                "ip addr add {}/64 dev eth0 nodad && ip link set eth0 up && ip -6 route add default via {}",
                first(net, 0x10),
                first(net, 1)
            ),
        );
    }

    weft_tests::step("peered: IPv6 only, remapped, and IPv4 said not negotiated on both sides");
    let token = weftctl_json(&tb, &["peering", "token", "--ttl", "10m"])["token"]
        .as_str()
        .unwrap()
        .to_string();
    weftctl_json(&ta, &["peering", "create", "--token", &token]);
    let (ab, ba) = weft_tests::eventually("both sides' peerings", Duration::from_secs(20), || {
        let p = |t: &str, peer: &str| -> Option<Value> {
            weftctl_json(t, &["peerings"])["peerings"]
                .as_array()?
                .iter()
                .find(|p| p["site_id"] == peer)
                .cloned()
        };
        Some((p(&ta, site_b)?, p(&tb, site_a)?))
    });
    assert!(ab["ipv4"].as_str().unwrap().contains("offered no IPv4 CIDRs"), "{ab:#}");
    assert!(
        ba["ipv4"].as_str().unwrap().contains("this site has no IPv4 pod CIDRs"),
        "{ba:#}"
    );
    let view = |target: &str, peer: &str| -> (ipnet::Ipv6Net, ipnet::Ipv6Net) {
        let (real, local) = weft_tests::peer_view_where(target, peer, "workload", |c| c.contains(':'));
        (real.parse().unwrap(), local.parse().unwrap())
    };
    let ((b_real, b_at_a), (a_real, a_at_b)) = (view(&ta, site_b), view(&tb, site_a));
    assert_ne!(b_real, b_at_a, "the same ULA on both sides is remapped");
    let (wa, wb) = (first(na64, 0x10), first(nb64, 0x10));
    let wb_from_a = weft_controller::ipam::translate(wb, b_real, b_at_a).unwrap();
    let wa_from_b = weft_controller::ipam::translate(wa, a_real, a_at_b).unwrap();

    weft_tests::step("the workloads reach each other over IPv6, each seen in the other's view");
    for (from, to) in [("wa", wb_from_a), ("wb", wa_from_b)] {
        let reached = weft_tests::try_eventually(Duration::from_secs(30), || {
            netns::exec(&ns[from].0, &["ping", "-6", "-c", "1", "-W", "1", &to.to_string()])
                .status
                .success()
                .then_some(())
        });
        if reached.is_none() {
            let mut diag = String::new();
            for h in ["na", "nb", "gwb", "gwa"] {
                diag.push_str(&format!(
                    "--- {h}\n{}\n",
                    stdout(&netns::exec(
                        &ns[h].0,
                        &["sh", "-c", "ip -6 addr; ip -6 rule; ip -6 route show table all"]
                    ))
                ));
            }
            for (a, b) in [(site_a, site_b), (site_b, site_a)] {
                let pns = weft_controller::render::peering_namespace(a, b);
                diag.push_str(&format!(
                    "--- {a}'s peering namespace\n{}\n",
                    stdout(&netns::exec(
                        &pns,
                        &[
                            "sh",
                            "-c",
                            "ip -6 rule; ip -6 route show table all; nft list chain inet weft from_tunnel"
                        ]
                    ))
                ));
            }
            for (h, cmd) in [
                (
                    "nb",
                    format!(
                        "ping -6 -c1 -W1 {wb}; ip -6 neigh; bridge link; ip -d link show weft-br0; nft list ruleset; sysctl net.bridge.bridge-nf-call-ip6tables"
                    ),
                ),
                ("wb", "ip -6 addr; ip -6 route".to_string()),
                ("na", format!("ping -6 -c1 -W1 {wa}; nft list ruleset")),
            ] {
                diag.push_str(&format!("--- {h}: {cmd}\n{}\n", {
                    let o = netns::exec(&ns[h].0, &["sh", "-c", &cmd]);
                    format!("{}{}", stdout(&o), String::from_utf8_lossy(&o.stderr))
                }));
            }
            for t in [&ta, &tb] {
                diag.push_str(&format!("--- peerings at {t}\n{:#}\n", weftctl_json(t, &["peerings"])));
            }
            panic!("{from} cannot reach {to}:\n{diag}");
        }
    }
    let echo_py = "import socket\ns=socket.create_server(('::',5300),family=socket.AF_INET6)\nwhile True:\n    c,a=s.accept()\n    c.sendall(('from '+a[0]).encode())\n    c.close()";
    lab.spawn(
        &ns["wb"].0,
        std::path::Path::new("/usr/bin/env"),
        &["python3", "-c", echo_py],
        &dir.path().join("echo-wb.log"),
    );
    let ask = format!(
        "import socket\ns=socket.create_connection(('{wb_from_a}',5300),timeout=3)\nprint(s.recv(100).decode())"
    );
    let said = weft_tests::eventually("wb's echo service answering wa", Duration::from_secs(20), || {
        let o = netns::exec(&ns["wa"].0, &["python3", "-c", &ask]);
        o.status.success().then(|| stdout(&o).trim().to_string())
    });
    assert_eq!(
        said,
        format!("from {wa_from_b}"),
        "wb saw wa elsewhere than in its view"
    );

    // weftctl translate goes through the IPv6 view of an IPv6-only peering.
    let t = weftctl_json(&ta, &["translate", site_b, &wb.to_string()]);
    assert_eq!(t["local_address"], wb_from_a.to_string(), "{t:#}");

    weft_tests::step("names: an IPv6-only workload's AAAA at site a, a dual-stack name's AAAA at site b");
    // Site b names wb by its IPv6 address alone (it has no other); site
    // a names wa in both families (its IPv4 address is not routed to b).
    weftctl_json(&tb, &["name", "add", "api", &wb.to_string()]);
    let na_v4: ipnet::Ipv4Net = node(&ta, "na")["subnet"].as_str().unwrap().parse().unwrap();
    let (na_dns, wa_v4) = (na_v4.hosts().next().unwrap(), na_v4.hosts().nth(9).unwrap());
    weftctl_json(
        &ta,
        &[
            "name",
            "add",
            "web",
            &wa_v4.to_string(),
            "--address-v6",
            &wa.to_string(),
        ],
    );
    let learned = weft_tests::eventually("site a learning api", Duration::from_secs(20), || {
        weftctl_json(&ta, &["names"])["learned"]
            .as_array()?
            .iter()
            .find(|n| n["name"] == "api")
            .cloned()
    });
    assert_eq!(
        (&learned["local_address"], &learned["local_address_v6"]),
        (&Value::from(""), &Value::from(wb_from_a.to_string())),
        "{learned:#}"
    );
    // Each node's responder: na's on its IPv4 subnet's first address
    // (given to wl0 here), nb's on its /64's (an IPv6-only node's).
    sh("na", &format!("ip addr add {na_dns}/24 dev wl0"));
    let dig = |host: &str, server: &str, name: &str, t: &str| -> Vec<String> {
        let o = netns::exec(
            &ns[host].0,
            &["dig", &format!("@{server}"), name, t, "+short", "+time=1", "+tries=1"],
        );
        stdout(&o).lines().map(str::to_string).collect()
    };
    let nb_dns = first(nb64, 1).to_string();
    for (host, server, name, want) in [
        ("na", na_dns.to_string(), "api.v6o-b.weft.internal", wb_from_a),
        ("wb", nb_dns.clone(), "web.v6o-a.weft.internal", wa_from_b),
    ] {
        let got = weft_tests::eventually(&format!("{name} from {host}"), Duration::from_secs(20), || {
            let got = dig(host, &server, name, "AAAA");
            (!got.is_empty()).then_some(got)
        });
        assert_eq!(got, [want.to_string()], "{name} asked of {server}");
        // No A record: one site has no IPv4 to reach it by.
        assert!(dig(host, &server, name, "A").is_empty(), "{name} has an A record");
    }
    // An export policy of IPv6 rules alone toward the IPv6-only site still
    // tells it wa's name: it goes by the IPv6 address there.
    weftctl_json(
        &ta,
        &[
            "peering",
            "policy",
            "set",
            site_b,
            "--allow",
            &format!("{na64},tcp,5300"),
        ],
    );
    let learned_web = || -> Option<Value> {
        weftctl_json(&tb, &["names"])["learned"]
            .as_array()?
            .iter()
            .find(|n| n["name"] == "web")
            .cloned()
    };
    let exports = weft_tests::eventually("site b told of a's policy", Duration::from_secs(20), || {
        let p = weftctl_json(&tb, &["peerings"])["peerings"][0]["peer_exports"].clone();
        (!p.is_null()).then_some(p)
    });
    assert_eq!(
        exports,
        serde_json::json!([na64.to_string()]),
        "the policy's IPv6 prefix"
    );
    let web = learned_web().expect("web is still learned under an IPv6-only policy");
    assert_eq!(web["local_address_v6"], wa_from_b.to_string(), "{web:#}");

    weft_tests::step("nothing of IPv4 is routed or allowed into site b's tunnel");
    let ns_b = weft_controller::render::peering_namespace(site_b, site_a);
    let chain = stdout(&netns::exec(
        &ns_b,
        &["nft", "list", "chain", "inet", "weft", "from_tunnel"],
    ));
    assert!(
        chain.contains("meta nfproto ipv4") && chain.contains("drop"),
        "site b's tunnel lets IPv4 in:\n{chain}"
    );
    let routes = stdout(&netns::exec(
        &ns["gwb"].0,
        &["ip", "-4", "route", "show", "table", "all"],
    ));
    assert!(!routes.contains("10.1."), "an IPv4 route to site a on gwb:\n{routes}");
}
