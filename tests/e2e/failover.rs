//! Gateway failover in namespaces (real binaries, real kernel): site a has
//! two gateways; a continuous ping runs from a workload in site a to one in
//! site b; the active gateway is SIGKILLed five times in turn (each killed
//! one restarted afterwards, and it must stay standby). The outage — the
//! longest gap between two answered pings around the kill — is measured
//! each time, and a TCP stream open across one failover must survive.

use std::time::Duration;

use weft_tests::netns::require_root;
use weft_tests::sites::{self, TwoSites, active, answered, longest_gap, ping_wa_to_wb, until_wa_reaches_wb};
use weft_tests::{eventually, weftctl_json};

/// One failover lab at a time: each measures outages that a second lab on
/// the same two cores would distort (and the labs share /run/netns).
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

/// SIGKILLs site a's active gateway (of `procs`: name, lab index) and
/// measures the outage: (victim, survivor, victim's index, outage, when).
fn kill_active(
    s: &mut TwoSites,
    procs: &[(&'static str, usize)],
    what: &str,
) -> (String, &'static str, usize, f64, f64) {
    let victim = active(&s.ta);
    let survivor = if victim == "gw" { "gw2" } else { "gw" };
    let (_, vi) = procs.iter().find(|(n, _)| *n == victim).copied().unwrap();
    let (gap, at) = outage(s, what, &victim, survivor, |s| {
        s.lab.proc(vi).child.as_mut().unwrap().kill().unwrap();
        s.lab
            .proc(vi)
            .wait_exit(Duration::from_secs(5))
            .expect("the gateway died");
    });
    (victim, survivor, vi, gap, at)
}

/// Freezes site a's active gateway (SIGSTOP: its connections stay open and
/// nothing answers, as a host that lost power) and measures the outage:
/// it is failed over once the controller has not heard it for the gateway
/// TTL (800 ms by default). Woken, it stays standby.
fn freeze_active(s: &mut TwoSites, procs: &[(&'static str, usize)], what: &str) -> f64 {
    let victim = active(&s.ta);
    let survivor = if victim == "gw" { "gw2" } else { "gw" };
    let (_, vi) = procs.iter().find(|(n, _)| *n == victim).copied().unwrap();
    let pid = s.lab.proc(vi).child.as_ref().unwrap().id().to_string();
    let signal = |sig: &str| {
        weft_tests::netns::must(
            weft_tests::run(std::process::Command::new("kill").args([sig, &pid])),
            sig,
        )
    };
    let (silent, at) = outage(s, what, &victim, survivor, |_| {
        signal("-STOP");
    });
    if std::env::var_os("WEFT_TRACE").is_some() {
        trace(s, at);
    }
    signal("-CONT");
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(active(&s.ta), survivor, "the woken {victim} took over again");
    silent
}

/// Whether the controller at `target` counts gateway `name` live (ready).
fn ready(target: &str, name: &str) -> bool {
    weftctl_json(target, &["gateways"])["gateways"]
        .as_array()
        .unwrap()
        .iter()
        .any(|g| g["name"] == name && g["status"]["ready"] == true)
}

/// Site a's two gateways: (agent name, process index in the lab).
type Gateways = [(&'static str, usize); 2];

/// A lab with two gateways in site a (on etcd when `site_a_etcd`), its
/// workloads reaching each other and a gateway active; held one at a time.
fn two_gateway_lab(
    tag: &str,
    sites_ab: ((&str, &str), (&str, &str)),
    site_a_etcd: bool,
) -> (std::sync::MutexGuard<'static, ()>, TwoSites, Gateways) {
    two_gateway_lab_with(
        tag,
        sites_ab,
        sites::Opts {
            site_a_etcd,
            ..Default::default()
        },
    )
}

/// [`two_gateway_lab`] with more options.
fn two_gateway_lab_with(
    tag: &str,
    sites_ab: ((&str, &str), (&str, &str)),
    opts: sites::Opts,
) -> (std::sync::MutexGuard<'static, ()>, TwoSites, Gateways) {
    let opts = sites::Opts {
        second_gateway_a: true,
        ..opts
    };
    let turn = one_at_a_time();
    let s = sites::up_with(tag, sites_ab.0, sites_ab.1, opts);
    let procs = [("gw", s.gateways.0), ("gw2", s.gateway_a2.unwrap())];
    until_wa_reaches_wb(&s);
    eventually("an active gateway", Duration::from_secs(20), || {
        (!active(&s.ta).is_empty()).then_some(())
    });
    (turn, s, procs)
}

use weft_tests::unix_now as now;

/// The last lines of the lab's log file `f`.
fn tail(s: &TwoSites, f: &str) -> String {
    let t = std::fs::read_to_string(s.dir.path().join(f)).unwrap_or_default();
    let lines: Vec<&str> = t.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Pings from wa to wb every 20 ms around `disrupt` (which makes `victim`
/// fail), waits for `survivor` to be active and the pings to be answered
/// again, and returns the outage — the longest silence between two
/// answered pings from just before the disruption on — and when the
/// disruption happened (Unix seconds).
fn outage(
    s: &mut TwoSites,
    what: &str,
    victim: &str,
    survivor: &str,
    disrupt: impl FnOnce(&mut TwoSites),
) -> (f64, f64) {
    let (ping, log) = ping_wa_to_wb(s, &format!("ha-ping-{what}.log"));
    let at = now();
    disrupt(s);
    eventually("the survivor active", Duration::from_secs(10), || {
        (active(&s.ta) == survivor).then_some(())
    });
    let back = (0..200).any(|_| {
        answered(&std::fs::read_to_string(&log).unwrap_or_default())
            .iter()
            .any(|t| *t > at + 0.1)
            || {
                std::thread::sleep(Duration::from_millis(50));
                false
            }
    });
    if !back {
        let mut diag = String::new();
        for f in [
            "site-a.log",
            "site-b.log",
            "192.168.78.2-gw.log",
            "192.168.78.1-gw.log",
            "192.168.78.1-gw2.log",
            "192.168.78.1-na.log",
        ] {
            diag.push_str(&format!("--- {f}\n{}\n", tail(s, f)));
        }
        panic!("{what}: no answer within 10 s after {victim} failed\n{diag}");
    }
    s.lab.proc(ping).stop();
    let (gap, _) = longest_gap(&log, at);
    eprintln!(
        "{what}: {victim} failed, {survivor} took over, outage {:.0} ms",
        gap * 1000.0
    );
    (gap, at)
}

/// (WEFT_TRACE=1) Every agent's and controller's log, for the timeline of
/// a failover at `at`.
fn trace(s: &TwoSites, at: f64) {
    eprintln!("TRACE failure at {at:.3}");
    for f in [
        &format!("{}.log", s.site_a),
        &format!("{}.log", s.site_b),
        "192.168.78.2-gw.log",
        "192.168.78.1-na.log",
        "192.168.78.1-gw2.log",
    ] {
        for l in std::fs::read_to_string(s.dir.path().join(f))
            .unwrap_or_default()
            .lines()
        {
            eprintln!("TRACE {f}: {}", &l[..l.len().min(170)]);
        }
    }
}

/// (WEFT_TCPDUMP=1) Starts tcpdump on the hosts along the path.
fn start_dumps(s: &mut TwoSites) -> Vec<String> {
    if std::env::var_os("WEFT_TCPDUMP").is_none() {
        return vec![];
    }
    ["wa", "na", "gwa2", "gwb", "nb", "wb"]
        .iter()
        .map(|h| {
            let log = s.dir.path().join(format!("dump-{h}.log"));
            s.lab.spawn(
                &s.ns[h],
                std::path::Path::new("/usr/bin/tcpdump"),
                &["-tt", "-n", "-l", "-i", "any", "icmp or (udp and not port 51820)"],
                &log,
            );
            h.to_string()
        })
        .collect()
}

/// Prints what the captures saw from just before `at` to 1.2 s after.
fn print_dumps(s: &TwoSites, hosts: &[String], at: f64) {
    std::thread::sleep(Duration::from_millis(300));
    for h in hosts {
        let t = std::fs::read_to_string(s.dir.path().join(format!("dump-{h}.log"))).unwrap_or_default();
        for l in t.lines() {
            let ts: f64 = l.split_whitespace().next().and_then(|x| x.parse().ok()).unwrap_or(0.0);
            if ts > at - 0.03 && ts < at + 1.2 {
                eprintln!(
                    "DUMP {h} {:+.3} {}",
                    ts - at,
                    &l[l.find(' ').unwrap_or(0)..l.len().min(150)]
                );
            }
        }
    }
}

#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn the_standby_gateway_takes_over_within_a_second() {
    require_root();
    weft_tests::step("the first gateway becomes active");
    let (_turn, mut s, procs) = two_gateway_lab("ha", (("site-a", "10.1.0.0/16"), ("site-b", "10.2.0.0/16")), false);
    let (wa, wb, to_b) = (s.ns["wa"].clone(), s.ns["wb"].clone(), s.wb_from_a.clone());
    let ok = (0..100).any(|_| {
        active(&s.ta) == "gw" || {
            std::thread::sleep(Duration::from_millis(200));
            false
        }
    });
    assert!(
        ok,
        "gw not active: {}\n{}",
        weftctl_json(&s.ta, &["gateways"]),
        std::fs::read_to_string(s.dir.path().join("site-a.log")).unwrap_or_default()
    );

    weft_tests::step("a tcp stream across the first failover");
    // A TCP stream across the first failover.
    let server = "import socket\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\ns.bind(('0.0.0.0',5400))\ns.listen(1)\nc,_=s.accept()\nn=0\nwhile True:\n    d=c.recv(4096)\n    if not d: break\n    n+=len(d)\nprint('received',n,flush=True)";
    let srv = s.lab.spawn(
        &wb,
        std::path::Path::new("/usr/bin/env"),
        &["python3", "-c", server],
        &s.dir.path().join("ha-tcp-server.log"),
    );
    std::thread::sleep(Duration::from_millis(500));
    let client = format!(
        "import socket,time\ns=socket.create_connection(('{to_b}',5400),timeout=10)\nfor i in range(60):\n    s.sendall(b'x'*1000)\n    time.sleep(0.1)\ns.close()\nprint('sent',flush=True)"
    );
    let cli = s.lab.spawn(
        &wa,
        std::path::Path::new("/usr/bin/env"),
        &["python3", "-c", &client],
        &s.dir.path().join("ha-tcp-client.log"),
    );

    let dumps = start_dumps(&mut s);
    let mut outages = Vec::new();
    for run in 0..5 {
        weft_tests::step(&format!("failover run {}", run + 1));
        let (victim, survivor, vi, gap, killed_at) = kill_active(&mut s, &procs, &format!("run {}", run + 1));
        if run == 0 && !dumps.is_empty() {
            print_dumps(&s, &dumps, killed_at);
        }
        if std::env::var_os("WEFT_TRACE").is_some() {
            trace(&s, killed_at);
        }
        outages.push(gap);
        // The killed gateway comes back, and stays standby.
        s.lab.respawn(vi);
        std::thread::sleep(Duration::from_secs(2));
        assert_eq!(active(&s.ta), survivor, "the restarted {victim} took over again");
        if run == 0 {
            let st = s
                .lab
                .proc(cli)
                .wait_exit(Duration::from_secs(20))
                .expect("the TCP client finished");
            if !st.success() {
                let mut diag = String::new();
                for (h, cmd) in [
                    (&wa, "ss -tnio"),
                    (&wb, "ss -tnio"),
                    (&wa, "nstat -az TcpRetransSegs TcpExtTCPTimeouts"),
                    (
                        &wb,
                        "nstat -az TcpInErrs TcpExtTCPOFOQueue TcpExtTCPACKSkippedSeq TcpExtTCPChallengeACK",
                    ),
                ] {
                    diag.push_str(&format!(
                        "--- {h}: {cmd}\n{}\n",
                        weft_tests::stdout(&s.lab.exec(h, &["sh", "-c", cmd]))
                    ));
                }
                panic!(
                    "the TCP stream broke in the failover: {}\n{diag}",
                    s.lab.proc(cli).log_text()
                );
            }
            eventually("all bytes across", Duration::from_secs(10), || {
                s.lab.proc(srv).log_text().contains("received 60000").then_some(())
            });
        }
    }

    weft_tests::step("a silent gateway fails over in under a second");
    let silent = freeze_active(&mut s, &procs, "silent");
    // Issue 18: with --gateway-ttl 800ms (the default) on the embedded
    // store, under 1 s.
    assert!(
        silent < 1.0,
        "a silent gateway's outage {silent:.3} s (must be under 1 s: the 800 ms TTL and the switch)"
    );
    // Its timeline, as `weftctl status` shows it: every step, in order,
    // the expiry within the TTL (and a sweep) of the last report.
    let f = eventually(
        "the silent failover's timeline complete",
        Duration::from_secs(70),
        || {
            let f = weftctl_json(&s.ta, &["status"])["last_failover"].clone();
            (f["complete"] == true).then_some(f)
        },
    );
    let steps: Vec<(String, i64)> = f["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["step"].as_str().unwrap().to_string(),
                x["offset_ms"].as_i64().unwrap(),
            )
        })
        .collect();
    eprintln!("the silent failover's timeline: {steps:?}");
    let names: Vec<&str> = steps.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "fault",
            "expired",
            "elected",
            "pushed",
            "applied",
            "peer_told",
            "peer_moved",
            "first_packet"
        ],
        "{f:#}"
    );
    let at = |n: &str| steps.iter().find(|(x, _)| x == n).unwrap().1;
    assert!(
        (700..=1100).contains(&at("expired")),
        "expired {} ms after the last report (TTL 800 ms)",
        at("expired")
    );
    assert!(
        at("elected") >= at("expired") && at("applied") >= at("pushed"),
        "{steps:?}"
    );
    let table = weft_tests::stdout(&weft_tests::run(
        std::process::Command::new(weft_tests::bin("weftctl")).args(["--controller", &s.ta, "status"]),
    ));
    eprintln!("weftctl status:\n{table}");
    assert!(
        table.contains("Last failover:") && table.contains("first_packet"),
        "{table}"
    );

    weft_tests::step("the median outage is under a second");
    outages.sort_by(f64::total_cmp);
    let median = outages[outages.len() / 2];
    eprintln!("outages (s): {outages:?}; median {:.0} ms", median * 1000.0);
    // Issue 7: target under 1 s (must be under 3 s); measured ~0.1 s.
    assert!(median < 1.0, "median outage {median:.3} s (target: under 1 s)");
}

/// The active gateway SIGKILLed 3 s after its site's controller was
/// SIGKILLed and started again, ten times: the agents are back on the
/// controller by then (a lost controller is tried again every second), so
/// the standby takes over as fast as without the restart.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn a_failover_3_seconds_after_a_controller_restart_is_under_a_second() {
    require_root();
    let (_turn, mut s, procs) = two_gateway_lab("hr", (("hr-a", "10.1.0.0/16"), ("hr-b", "10.2.0.0/16")), false);
    let mut outages = Vec::new();
    for run in 0..10 {
        s.lab.ctl(0).kill();
        // 3 s after the start (restart_stopped waits until it serves).
        let started = std::time::Instant::now();
        s.lab.ctl(0).restart_stopped();
        std::thread::sleep(Duration::from_secs(3).saturating_sub(started.elapsed()));
        let (_, _, vi, gap, _) = kill_active(&mut s, &procs, &format!("restart {}", run + 1));
        outages.push(gap);
        s.lab.respawn(vi);
        std::thread::sleep(Duration::from_secs(2));
    }
    eprintln!("outages 3 s after a controller restart (s): {outages:?}");
    for (i, gap) in outages.iter().enumerate() {
        assert!(*gap < 1.0, "run {}: outage {gap:.3} s (must be under 1 s)", i + 1);
    }
}

/// Liveness on etcd, whose leases last whole seconds and at least about
/// 2 s: the replica that hears a gateway ends its liveness once it has not
/// heard it for the gateway TTL (800 ms), so both sites here keep their
/// state in etcd and still
/// - a gateway cut off from its controller (its TCP to the controller
///   dropped both ways) while its tunnel stays up keeps carrying traffic,
///   is marked not live within the TTL, and live again once the link
///   returns;
/// - a silent active gateway is failed over in under a second.
#[test]
#[ignore = "needs root (network namespaces) and etcd: tests/run.sh runs it as root"]
fn on_etcd_a_silent_gateway_is_marked_within_its_ttl() {
    require_root();
    weft_tests::step("site b's gateway is live to begin with");
    let (_turn, mut s, procs) = two_gateway_lab("he", (("he-a", "10.1.0.0/16"), ("he-b", "10.2.0.0/16")), true);
    assert!(ready(&s.tb, "gw"), "site b's gateway is not live to begin with");

    weft_tests::step("a gateway cut off from its controller is marked within its ttl");
    // Site b's only gateway loses its controller; its tunnel stays.
    let gwb = s.ns["gwb"].clone();
    let (ping, log) = ping_wa_to_wb(&mut s, "cut-ping.log");
    let cut = "add table inet weftlabcut
        add chain inet weftlabcut out { type filter hook output priority 0; ip daddr 192.168.78.2 tcp dport 7443 drop; }
        add chain inet weftlabcut in { type filter hook input priority 0; ip saddr 192.168.78.2 tcp sport 7443 drop; }";
    let cut_at = now();
    weft_tests::netns::must(s.lab.exec(&gwb, &["nft", cut]), "cut the gateway's controller link");
    let mut marked = None;
    while now() - cut_at < 10.0 {
        if !ready(&s.tb, "gw") {
            marked = Some(now() - cut_at);
            break;
        }
    }
    let marked = marked.expect("site b's controller still counts its cut-off gateway live after 10 s");
    std::thread::sleep(Duration::from_secs_f64((4.0 - (now() - cut_at)).max(0.0)));
    weft_tests::step("the gateway is live again once the link returns");
    let healed_at = now();
    weft_tests::netns::must(
        s.lab.exec(&gwb, &["nft", "delete table inet weftlabcut"]),
        "restore the link",
    );
    eventually("the gateway live again", Duration::from_secs(10), || {
        ready(&s.tb, "gw").then_some(())
    });
    let back = now() - healed_at;
    std::thread::sleep(Duration::from_millis(500));
    s.lab.proc(ping).stop();
    weft_tests::step("traffic was not disturbed while the controller link was cut");
    let (gap, times) = longest_gap(&log, cut_at);
    eprintln!(
        "controller link cut: marked not live after {:.0} ms, live again {:.0} ms after the link returned; \
         longest ping gap {:.0} ms over {} answers",
        marked * 1000.0,
        back * 1000.0,
        gap * 1000.0,
        times.len()
    );
    assert!(
        times.last().is_some_and(|t| *t > healed_at),
        "no answers after the link returned"
    );
    assert!(
        gap < 0.25,
        "traffic was disturbed while only the controller link was cut: a {gap:.3} s gap"
    );
    // The TTL (0.8 s) counts from the last report, which came at most a
    // heartbeat before the cut; 0.2 s for the sweep and the polling.
    assert!(
        marked < 1.0,
        "marked not live {marked:.3} s after the cut (the TTL is 0.8 s)"
    );

    weft_tests::step("a silent active gateway on etcd fails over in under a second");
    // A silent active gateway in site a, whose store is etcd too.
    let silent = freeze_active(&mut s, &procs, "silent on etcd");
    eprintln!("silent gateway on etcd: outage {:.0} ms", silent * 1000.0);
    assert!(
        silent < 1.0,
        "a silent gateway's outage on etcd {silent:.3} s (must be under 1 s)"
    );
}

/// The end of the longest silence in a `weft-echo flow` log (`<unix ms>
/// <who>` per answer) from the last answer before `at` (unix seconds) on,
/// in unix ms; None when nothing was answered after `at`.
fn flow_back(log: &std::path::Path, at: f64) -> Option<u128> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let times: Vec<u128> = text.lines().filter_map(|l| l.split_once(' ')?.0.parse().ok()).collect();
    let at_ms = (at * 1000.0) as u128;
    let from = times.iter().rposition(|t| *t < at_ms)?;
    let after = &times[from..];
    after.len().checked_sub(2)?;
    after.windows(2).max_by_key(|w| w[1] - w[0]).map(|w| w[1])
}

/// An exported LAN host of site a routes site b's view back to the LAN
/// address (`--lan-address`) that only site a's active gateway holds; when
/// that gateway is killed, the survivor takes the address (with
/// gratuitous ARP) and site b's running flow to the host comes back within
/// a second of its flow to site a's workload.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn an_exported_lan_host_is_reached_again_within_a_second_of_a_gateway_failover() {
    if !require_root() {
        return;
    }
    const LAN: &str = "192.168.78.29";
    const PORT: u16 = 7100;
    let (_turn, mut s, procs) = two_gateway_lab_with(
        "hl",
        (("hl-a", "10.1.0.0/16"), ("hl-b", "10.1.0.0/16")),
        sites::Opts {
            lan_address_a: Some("192.168.78.29/24"),
            ..Default::default()
        },
    );
    let holder = |s: &TwoSites| -> Vec<&'static str> {
        ["gwa", "gwa2"]
            .into_iter()
            .filter(|h| {
                let o = weft_tests::netns::exec(&s.ns[*h], &["ip", "-4", "-o", "addr", "show"]);
                weft_tests::stdout(&o).contains(&format!("{LAN}/24"))
            })
            .collect()
    };
    eventually(
        "the active gateway holds the LAN address",
        Duration::from_secs(10),
        || (holder(&s) == ["gwa"]).then_some(()),
    );
    weft_tests::step("site a exports a LAN host that routes site b's view to the LAN address");
    let lan = s.lab.host("lana");
    s.lab.plug(&lan, "192.168.78.50/24");
    let (_, b_view) = weft_tests::peer_view(&s.ta, "hl-b", "workload");
    weft_tests::netns::must(
        s.lab.exec(&lan, &["ip", "route", "add", &b_view, "via", LAN]),
        "the LAN host's route back",
    );
    let serve_log = s.dir.path().join("lan-serve.log");
    s.lab.spawn(
        &lan,
        &weft_tests::bin("weft-echo"),
        &["serve", "--port", &PORT.to_string(), "--name", "lan"],
        &serve_log,
    );
    let wa = s.ns["wa"].clone();
    let wa_log = s.dir.path().join("wa-serve.log");
    s.lab.spawn(
        &wa,
        &weft_tests::bin("weft-echo"),
        &["serve", "--port", &PORT.to_string(), "--name", "wa"],
        &wa_log,
    );
    weftctl_json(&s.ta, &["name", "add", "db", "192.168.78.50", "--export"]);
    let db = eventually("site b learns db", Duration::from_secs(20), || {
        let n = weftctl_json(&s.tb, &["names"]);
        n["learned"].as_array()?.iter().find(|n| n["name"] == "db")?["local_address"]
            .as_str()
            .map(String::from)
    });
    let stop = s.dir.path().join("flows.stop");
    let wb = s.ns["wb"].clone();
    let flow = |s: &mut TwoSites, to: &str, name: &str| {
        let log = s.dir.path().join(format!("flow-{name}.log"));
        s.lab.spawn(
            &wb,
            &weft_tests::bin("weft-echo"),
            &[
                "flow",
                &format!("{to}:{PORT}"),
                "--until",
                stop.to_str().unwrap(),
                "--every",
                "20ms",
            ],
            &log,
        );
        log
    };
    let to_host = flow(&mut s, &db, "lan");
    let wa_addr = s.wa_from_b.clone();
    let to_wa = flow(&mut s, &wa_addr, "wa");
    for (log, who) in [(&to_host, "lan"), (&to_wa, "wa")] {
        eventually(&format!("site b's flow reaches {who}"), Duration::from_secs(20), || {
            std::fs::read_to_string(log)
                .unwrap_or_default()
                .contains(&format!(" {who}"))
                .then_some(())
        });
    }

    weft_tests::step("the active gateway is killed");
    let (victim, survivor, _, gap, at) = kill_active(&mut s, &procs, "lan-address");
    eventually("the survivor holds the LAN address", Duration::from_secs(10), || {
        holder(&s).contains(&"gwa2").then_some(())
    });
    std::thread::sleep(Duration::from_secs(3));
    std::fs::write(&stop, "").unwrap();
    let host_back = flow_back(&to_host, at).expect("site b's flow never reached the LAN host again");
    let wa_back = flow_back(&to_wa, at).expect("site b's flow never reached wa again");
    let late = host_back as i128 - wa_back as i128;
    eprintln!(
        "{victim} killed, {survivor} took over (ping outage {:.0} ms): the workload answered again at +{} ms, \
         the exported host at +{} ms ({late} ms later)",
        gap * 1000.0,
        wa_back as i128 - (at * 1000.0) as i128,
        host_back as i128 - (at * 1000.0) as i128,
    );
    assert!(
        late < 1000,
        "the exported host came back {late} ms after the tunnel's failover"
    );
}

/// A controller starved of CPU (SIGSTOP/SIGCONT: stopped 600 ms of every
/// 1.2 s, each stop longer than a quarter of the 2 s gateway TTL, so each
/// is a stall of its liveness sweep) keeps its live gateways live, and
/// still fails a silent gateway over within two TTLs: a late sweep reads
/// what waited, then judges, instead of giving everyone a new TTL.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn a_starved_controller_fails_a_silent_gateway_over_within_two_ttls() {
    if !require_root() {
        return;
    }
    const TTL: Duration = Duration::from_secs(2);
    let (_turn, mut s, procs) = two_gateway_lab_with(
        "hs",
        (("hs-a", "10.1.0.0/16"), ("hs-b", "10.2.0.0/16")),
        sites::Opts {
            gateway_ttl: Some("2s"),
            ..Default::default()
        },
    );
    let signal = |sig: &str, pid: u32| {
        weft_tests::netns::must(
            weft_tests::run(std::process::Command::new("kill").args([sig, &pid.to_string()])),
            sig,
        )
    };
    weft_tests::step("site a's controller starved: stopped 600 ms of every 1.2 s");
    let ctl = s.lab.ctl(0).pid();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let starver = {
        let done = done.clone();
        std::thread::spawn(move || {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = std::process::Command::new("kill")
                    .args(["-STOP", &ctl.to_string()])
                    .status();
                std::thread::sleep(Duration::from_millis(600));
                let _ = std::process::Command::new("kill")
                    .args(["-CONT", &ctl.to_string()])
                    .status();
                std::thread::sleep(Duration::from_millis(600));
            }
            let _ = std::process::Command::new("kill")
                .args(["-CONT", &ctl.to_string()])
                .status();
        })
    };
    let stop_starving = |starver: std::thread::JoinHandle<()>| {
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        starver.join().unwrap();
    };
    let before = active(&s.ta);
    std::thread::sleep(3 * TTL);
    let still = active(&s.ta);
    if still != before {
        stop_starving(starver);
        panic!("the starved controller failed its live gateway {before} over to {still}");
    }
    weft_tests::step("the active gateway falls silent (SIGSTOP)");
    let survivor = if before == "gw" { "gw2" } else { "gw" };
    let (_, vi) = procs.iter().find(|(n, _)| *n == before).copied().unwrap();
    let gw_pid = s.lab.proc(vi).child.as_ref().unwrap().id();
    signal("-STOP", gw_pid);
    let frozen = std::time::Instant::now();
    let mut took = None;
    while frozen.elapsed() < Duration::from_secs(20) {
        if active(&s.ta) == survivor {
            took = Some(frozen.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    stop_starving(starver);
    signal("-CONT", gw_pid);
    let took = took.expect("a silent gateway stayed active for 20 s under a starved controller");
    eprintln!(
        "starved controller: the silent gateway {before} was failed over to {survivor} {} ms after it froze (TTL {} ms)",
        took.as_millis(),
        TTL.as_millis()
    );
    assert!(took < 2 * TTL, "failover took {took:?}, more than two TTLs");
}
