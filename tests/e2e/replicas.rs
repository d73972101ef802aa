//! Three controller replicas of one site on one etcd (real etcd, real
//! binaries): any replica serves agents and admin calls, exactly one leads
//! the singleton work, a replica holding another CA is refused, and when
//! the replica the agents watch is SIGKILLed they move to another one at
//! once and changes made after the kill still reach them. A replica whose
//! host goes silent (its process stopped; or, in namespaces, its link down)
//! is left within 3 s.

use std::process::Command;
use std::time::{Duration, Instant};

use weft_tests::{Controller, ControllerSpec, Etcd, Proc, bin, dry_run_agent as agent, eventually, weftctl_json};

const LEADING: &str = "leading the site's singleton work";

/// The controller (port) an agent's log says it watches last.
fn watching(p: &Proc) -> Option<u16> {
    p.log_text()
        .lines()
        .rev()
        .find(|l| l.contains("watching"))
        .and_then(|l| l.split("controller=https://127.0.0.1:").nth(1))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|p| p.parse().ok())
}

/// A gateway name whose first choice among `replicas` is the one on
/// `port` (names are tried in turn: gw, gw-1, gw-2, …).
fn sharing_first_choice(port: u16, replicas: &[&Controller]) -> String {
    (0..)
        .map(|k| if k == 0 { "gw".to_string() } else { format!("gw-{k}") })
        .find(|n| first_choice(n, replicas) == port)
        .unwrap()
}

/// The port of the replica agent `name` given `replicas` tries first
/// (its own order: see `controller_order`).
fn first_choice(name: &str, replicas: &[&Controller]) -> u16 {
    let urls: Vec<String> = replicas
        .iter()
        .map(|c| format!("https://127.0.0.1:{}", c.listen_port))
        .collect();
    replicas[weft_agent::config::controller_order(name, &urls)[0]].listen_port
}

#[test]
fn agents_move_to_a_live_replica_at_once_and_changes_still_reach_them() {
    weft_tests::step("three replicas on one etcd");
    let Some(etcd) = Etcd::start() else { return };
    let dir = tempfile::Builder::new().prefix("weft-replicas").tempdir().unwrap();
    let ep = etcd.endpoint();
    let flags = ["--pod-cidr", "10.1.0.0/16", "--etcd-endpoints", ep.as_str()];
    let a = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("a"))
        .flags(&flags)
        .start();
    // The replicas share the site CA: copied, as an operator would.
    for r in ["b", "c"] {
        let pki = dir.path().join(r).join("pki");
        std::fs::create_dir_all(&pki).unwrap();
        for f in ["ca.pem", "ca.key"] {
            std::fs::copy(a.pki(f), pki.join(f)).unwrap();
        }
    }
    let b = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("b"))
        .flags(&flags)
        .start();
    let c = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("c"))
        .flags(&flags)
        .start();

    weft_tests::step("a replica with a CA of its own is refused");
    // A replica with a CA of its own is refused, saying what to do.
    let out = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("d"))
        .flags(&flags)
        .refused();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("copy pki/ca.pem and pki/ca.key"),
        "{err}"
    );

    weft_tests::step("exactly one replica leads");
    // Exactly one replica leads.
    let leaders = |cs: &[&Controller]| cs.iter().filter(|c| c.log_text().contains(LEADING)).count();
    eventually("a leader", Duration::from_secs(10), || {
        (leaders(&[&a, &b, &c]) == 1).then_some(())
    });
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(leaders(&[&a, &b, &c]), 1, "more than one replica leads");

    weft_tests::step("any replica serves admin calls");
    // Any replica serves admin calls from the shared state.
    assert_eq!(weftctl_json(&c.target(), &["site"])["id"], "site-a");

    weft_tests::step("each agent watches its first choice of replica");
    let mut replicas = [a, b, c];
    let all: Vec<&Controller> = replicas.iter().collect();
    // A gateway whose first choice is the node's, so that both move.
    let n1_first = first_choice("n1", &all);
    let gw_name = sharing_first_choice(n1_first, &all);
    let gw = agent("gateway", &gw_name, "192.0.2.10", &all, &replicas[1], dir.path());
    let n1 = agent("node", "n1", "192.0.2.11", &all, &replicas[2], dir.path());
    for p in [&gw, &n1] {
        eventually("the agent watching its first choice", Duration::from_secs(20), || {
            (watching(p) == Some(n1_first)).then_some(())
        });
    }
    eventually("the gateway given n1's tunnel", Duration::from_secs(20), || {
        gw.log_text().contains("remote 192.0.2.11").then_some(())
    });

    let etcd_get = |args: &[&str]| -> String {
        let o = Command::new("etcdctl")
            .args(["--endpoints", &ep])
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "etcdctl {args:?}: {}", weft_tests::stderr(&o));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let writer = || -> Option<String> {
        let v = etcd_get(&["get", "--print-value-only", "/weft/sites/site-a/alive/node/n1"]);
        let rec: serde_json::Value = serde_json::from_str(v.trim()).ok()?;
        Some(rec["replica"].as_str()?.to_string())
    };
    let present = || -> Vec<String> {
        etcd_get(&["get", "--prefix", "--keys-only", "/weft/sites/site-a/replicas/"])
            .lines()
            .filter_map(|l| l.rsplit('/').next().filter(|id| !id.is_empty()).map(str::to_string))
            .collect()
    };
    // Written by the replica n1 enrolled through first, then by its first
    // choice once that one judged it came from a live replica (4 s).
    eventually("n1's liveness record written", Duration::from_secs(10), || {
        writer().map(|_| ())
    });
    std::thread::sleep(Duration::from_secs(6));
    let first_writer = writer().unwrap();

    weft_tests::step("their replica dies and both move at once");
    // The replica both watch dies; both move to another.
    let x = replicas.iter().position(|r| r.listen_port == n1_first).unwrap();
    let x_led = replicas[x].log_text().contains(LEADING);
    let killed = Instant::now();
    replicas[x].kill();
    for p in [&gw, &n1] {
        eventually("the agent watching another replica", Duration::from_secs(5), || {
            watching(p).filter(|port| *port != n1_first).map(|_| ())
        });
    }
    let moved = killed.elapsed();
    eprintln!("agents moved to another replica {moved:?} after the kill");
    assert!(moved < Duration::from_secs(5), "{moved:?}");
    let live: Vec<&Controller> = replicas
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != x)
        .map(|(_, r)| r)
        .collect();
    let (b, c) = (live[0], live[1]);

    weft_tests::step("a change after the kill reaches the agents");
    // A change made after the kill, through another replica, reaches them:
    // a second node enrolls, and the gateway is given a tunnel to it.
    let _n2 = agent("node", "n2", "192.0.2.12", &[b, c], b, dir.path());
    eventually("the gateway given n2's tunnel", Duration::from_secs(10), || {
        gw.log_text().contains("remote 192.0.2.12").then_some(())
    });
    // Both nodes ready (n2's first report may come a moment after the
    // gateway got its tunnel).
    eventually("every node ready", Duration::from_secs(10), || {
        let nodes = weftctl_json(&b.target(), &["nodes"]);
        let all = nodes["nodes"].as_array().unwrap();
        (all.len() == 2 && all.iter().all(|n| n["status"]["ready"] == true)).then_some(())
    });

    weft_tests::step("n1's liveness record outlives the dead replica's lease and moves to a survivor");
    // The record was on the dead replica's lease (a node TTL, 15 s). The
    // replica n1 moved to keeps it (renewing that lease) until it judged
    // the writer dead, then writes it on its own: it is never missing, and
    // once the dead lease would have ended it names a live replica.
    let watched = Instant::now();
    let mut last = None;
    while killed.elapsed() < Duration::from_secs(20) || watched.elapsed() < Duration::from_secs(2) {
        last = Some(writer().expect("n1's liveness record missing after its replica died"));
        std::thread::sleep(Duration::from_millis(200));
    }
    let live_ids = present();
    assert_eq!(live_ids.len(), 2, "two replicas present: {live_ids:?}");
    assert!(
        !live_ids.contains(&first_writer),
        "n1's record was not the dead replica's"
    );
    assert!(
        last.as_ref().is_some_and(|w| live_ids.contains(w)),
        "n1's record names {last:?}, not a live replica ({live_ids:?})"
    );
    assert!(
        [b, c]
            .iter()
            .any(|r| r.log_text().contains("adopted the liveness records")),
        "no survivor judged the dead replica's node as adopted"
    );

    weft_tests::step("another replica takes over the lead");
    // If the dead replica led, another takes over within the leader TTL.
    if x_led {
        eventually("a new leader", Duration::from_secs(10), || {
            (leaders(&[b, c]) == 1).then_some(())
        });
    }

    weft_tests::step("the replica returns and the node moves back to it");
    // Back: the node, which asks its first choice again every 1-3 s here
    // (--failback-after 1s), moves back and is served there.
    replicas[x].restart_stopped();
    eventually("n1 back on its first choice", Duration::from_secs(20), || {
        (watching(&n1) == Some(n1_first)).then_some(())
    });
    assert!(
        n1.log_text().contains("first-choice controller answers again"),
        "n1 said why it moved"
    );
    eventually("n1 ready again", Duration::from_secs(10), || {
        let nodes = weftctl_json(&replicas[x].target(), &["nodes"]);
        let all = nodes["nodes"].as_array().unwrap().clone();
        all.iter()
            .any(|n| n["name"] == "n1" && n["status"]["ready"] == true)
            .then_some(())
    });
}

/// Sends SIGCONT to a process it stopped, also when the test fails (a
/// stopped process would not act on the SIGTERM that ends it).
struct Stopped(u32);

impl Stopped {
    fn stop(pid: u32) -> Stopped {
        signal("-STOP", pid);
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        signal("-CONT", self.0);
    }
}

fn signal(sig: &str, pid: u32) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

/// A replica that goes silent — its process stopped, so its connections stay
/// open but nothing answers, as when its host loses power or its link drops —
/// is left within 3 s: the HTTP/2 keep-alive finds it dead and the agents
/// move to the next replica at once.
#[test]
fn agents_leave_a_silenced_replica_within_3_seconds() {
    let Some(etcd) = Etcd::start() else { return };
    let dir = tempfile::Builder::new().prefix("weft-silent").tempdir().unwrap();
    let ep = etcd.endpoint();
    let flags = ["--pod-cidr", "10.1.0.0/16", "--etcd-endpoints", ep.as_str()];
    let a = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("a"))
        .flags(&flags)
        .start();
    let pki = dir.path().join("b").join("pki");
    std::fs::create_dir_all(&pki).unwrap();
    for f in ["ca.pem", "ca.key"] {
        std::fs::copy(a.pki(f), pki.join(f)).unwrap();
    }
    let b = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("b"))
        .flags(&flags)
        .start();
    // A gateway whose first choice is the node's, so that both move.
    let gw_name = sharing_first_choice(first_choice("n1", &[&a, &b]), &[&a, &b]);
    let gw = agent("gateway", &gw_name, "192.0.2.10", &[&a, &b], &a, dir.path());
    let n1 = agent("node", "n1", "192.0.2.11", &[&a, &b], &a, dir.path());
    let firsts = [first_choice(&gw_name, &[&a, &b]), first_choice("n1", &[&a, &b])];
    for (p, first) in [&gw, &n1].into_iter().zip(firsts) {
        eventually("the agent watching its first choice", Duration::from_secs(20), || {
            (watching(p) == Some(first)).then_some(())
        });
    }
    // The replica the node watches goes silent; the other serves.
    let (quiet, other) = if firsts[1] == a.listen_port { (&a, &b) } else { (&b, &a) };
    // Let the first heartbeats pass: the connections are established and idle.
    std::thread::sleep(Duration::from_secs(2));

    let silenced = Instant::now();
    let _stopped = Stopped::stop(quiet.pid());
    for p in [&gw, &n1] {
        eventually("the agent watching the other replica", Duration::from_secs(10), || {
            (watching(p) == Some(other.listen_port)).then_some(())
        });
    }
    let moved = silenced.elapsed();
    eprintln!("agents left the silenced replica {moved:?} after it went silent");
    assert!(moved < Duration::from_secs(3), "{moved:?}");
    // And they are served there: the other replica sees the node ready.
    eventually(
        "both agents ready on the other replica",
        Duration::from_secs(10),
        || {
            let nodes = weftctl_json(&other.target(), &["nodes"]);
            (nodes["nodes"][0]["status"]["ready"] == true).then_some(())
        },
    );
}

/// The replica's address an agent's log says it watches last.
fn watching_address(p: &std::path::Path) -> Option<String> {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .rev()
        .find(|l| l.contains("watching"))
        .and_then(|l| l.split("controller=https://").nth(1))
        .and_then(|r| r.split(':').next())
        .map(str::to_string)
}

/// As on real hosts, each in its own network namespace: two replicas of a
/// site on one etcd (on a host of its own), a gateway and a node agent
/// given both replicas. The host of the replica they watch loses its link
/// (its interface down: nothing is sent, refused or reset; its process
/// runs on): both agents are on the other replica within 3 s, and served
/// there.
#[test]
#[ignore = "needs root (network namespaces) and etcd: tests/run.sh runs it as root"]
fn agents_leave_a_replica_whose_host_lost_its_link_within_3_seconds() {
    weft_tests::netns::require_root();
    weft_tests::step("a lan with etcd, two replicas and two agents");
    let dir = tempfile::Builder::new().prefix("weft-rlink").tempdir().unwrap();
    let mut lab = weft_tests::netns::Lab::new("rl");
    lab.lan();
    let mut ns = std::collections::HashMap::new();
    for (h, ip) in [
        ("db", "192.168.78.5/24"),
        ("ctl1", "192.168.78.1/24"),
        ("ctl2", "192.168.78.2/24"),
        ("gw", "192.168.78.10/24"),
        ("n1", "192.168.78.11/24"),
    ] {
        let n = lab.host(h);
        lab.plug(&n, ip);
        ns.insert(h, n);
    }
    lab.spawn_etcd_at(&ns["db"], &dir.path().join("etcd"), "192.168.78.5")
        .expect("etcd");
    let replica = |lab: &mut weft_tests::netns::Lab, host: &str, ip: &str, data: &str| {
        lab.controller(
            &ns[host],
            ControllerSpec::new("site-a")
                .data_dir(&dir.path().join(data))
                .pod("10.1.0.0/16")
                .listen(&format!("{ip}:7443"))
                .etcd("http://192.168.78.5:2379"),
        )
    };
    let t1 = replica(&mut lab, "ctl1", "192.168.78.1", "r1");
    // The second replica shares the site CA: copied, as an operator would.
    let pki = dir.path().join("r2").join("pki");
    std::fs::create_dir_all(&pki).unwrap();
    for f in ["ca.pem", "ca.key"] {
        std::fs::copy(dir.path().join("r1").join("pki").join(f), pki.join(f)).unwrap();
    }
    let t2 = replica(&mut lab, "ctl2", "192.168.78.2", "r2");
    let urls = "https://192.168.78.1:7443,https://192.168.78.2:7443";
    let mut logs = Vec::new();
    for (kind, name, ip) in [("gateway", "gw", "192.168.78.10"), ("node", "n1", "192.168.78.11")] {
        let mut args = weft_tests::enrolling_agent_args(&t1, kind, name, urls, ip, &dir.path().join(name), "30s");
        if kind == "gateway" {
            args.extend(["--endpoint".to_string(), format!("{ip}:51820")]);
        }
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let log = dir.path().join(format!("{name}.log"));
        lab.spawn(&ns[name], &bin(&format!("weft-{kind}-agent")), &refs, &log);
        logs.push(log);
    }
    weft_tests::step("both agents watch their first choice");
    let url_list: Vec<String> = urls.split(',').map(str::to_string).collect();
    let first = |name: &str| ["192.168.78.1", "192.168.78.2"][weft_agent::config::controller_order(name, &url_list)[0]];
    let (other_ip, cut_host) = if first("n1") == "192.168.78.1" {
        ("192.168.78.2", "ctl1")
    } else {
        ("192.168.78.1", "ctl2")
    };
    for (log, name) in logs.iter().zip(["gw", "n1"]) {
        eventually("the agent watching its first choice", Duration::from_secs(20), || {
            (watching_address(log).as_deref() == Some(first(name))).then_some(())
        });
    }
    // Let the first heartbeats pass: the connections are established and idle.
    std::thread::sleep(Duration::from_secs(2));

    weft_tests::step("the node's replica loses its link: the agents move within 3 s");
    let cut = Instant::now();
    weft_tests::netns::must(
        lab.exec(&ns[cut_host], &["ip", "link", "set", "eth0", "down"]),
        "the replica's link down",
    );
    for log in &logs {
        eventually("the agent watching the other replica", Duration::from_secs(10), || {
            (watching_address(log).as_deref() == Some(other_ip)).then_some(())
        });
    }
    let moved = cut.elapsed();
    eprintln!("agents left the replica whose host lost its link {moved:?} after the cut");
    assert!(moved < Duration::from_secs(3), "{moved:?}");
    weft_tests::step("both agents are served on the other replica");
    let served = if other_ip == "192.168.78.1" { &t1 } else { &t2 };
    eventually(
        "both agents ready on the other replica",
        Duration::from_secs(10),
        || {
            let nodes = weftctl_json(served, &["nodes"]);
            let gws = weftctl_json(served, &["gateways"]);
            (nodes["nodes"][0]["status"]["ready"] == true && gws["gateways"][0]["status"]["ready"] == true)
                .then_some(())
        },
    );
}
