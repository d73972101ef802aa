//! The real-hosts lane: weft installed as a user installs it. Two sites,
//! each a controller host, a gateway host and a node host: Debian booted by
//! systemd (`systemd-nspawn`, one lab namespace per host, all on one LAN),
//! weft from its Debian packages (`deploy/package.sh`), configured by the
//! shell blocks of deploy/README.md taken from the file as written, and
//! run by its systemd units.

use std::path::Path;
use std::time::Duration;

use weft_tests::hosts::{self, Host};
use weft_tests::netns::{Lab, must, require_root};
use weft_tests::sites::longest_gap;
use weft_tests::{eventually, step, unix_now};

/// One site's hosts and the guide's variables for it.
struct Site {
    name: &'static str,
    ctl: Host,
    gw: Host,
    node: Host,
    vars: Vec<(&'static str, String)>,
}

/// The word after `after` in `text` (a token in weftctl's output).
fn word_after<'a>(text: &'a str, after: &str) -> Option<&'a str> {
    text.split(after).nth(1)?.split_whitespace().next()
}

/// An agent token and the CA fingerprint from `weftctl token create`'s
/// table, as a person reads them off it.
fn token_and_fingerprint(out: &str) -> (String, String) {
    let token = out
        .split_whitespace()
        .find(|w| w.starts_with("weft1."))
        .unwrap_or_else(|| panic!("no token in `weftctl token create`'s output:\n{out}"));
    let fp = out
        .split_whitespace()
        .find(|w| w.len() == 64 && w.chars().all(|c| c.is_ascii_hexdigit()))
        .unwrap_or_else(|| panic!("no CA fingerprint in `weftctl token create`'s output:\n{out}"));
    (token.to_string(), fp.to_string())
}

fn json(host: &Host, cmd: &str) -> serde_json::Value {
    let out = host.must(&format!("weftctl -o json {cmd}"));
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("weftctl {cmd}: {e}: {out}"))
}

/// The longest time without an answered ping in `log` from `at` to now:
/// between answers, and from the last answer to now (an outage that has
/// not ended counts).
fn outage_since(log: &Path, at: f64) -> f64 {
    let (gap, times) = longest_gap(log, at);
    let last = times.last().copied().unwrap_or(at);
    gap.max(unix_now() - last)
}

/// The longest outage `unit` may cost the data path when it restarts. A
/// gateway's userspace tunnels live in its process: a restart remakes them
/// (at most 1 s). A node's routes and the controller's state are not in the
/// data path at all.
fn allowed_outage(unit: &str) -> f64 {
    if unit == "weft-gateway-agent" { 1.0 } else { 0.3 }
}

/// Runs `action` on `host` while the lane's ping runs (`log`), checks that
/// it gave `unit` a new process, and after 5 s that the ping's longest
/// outage since stays within [`allowed_outage`]; `what` names it in the
/// report and in a failure.
fn disturb(host: &Host, unit: &str, action: &str, what: &str, log: &Path, report: &mut Vec<String>) {
    let before = main_pid(host, unit);
    let at = unix_now();
    host.must(action);
    assert_ne!(
        main_pid(host, unit),
        before,
        "{what} on {} did not restart {unit}",
        host.name
    );
    std::thread::sleep(Duration::from_secs(5));
    let gap = outage_since(log, at);
    report.push(format!("{what} on {}: longest gap {gap:.2} s", host.name));
    eprintln!("{}", report.last().unwrap());
    let bound = allowed_outage(unit);
    assert!(
        gap <= bound,
        "{what} on {} stopped traffic for {gap:.2} s (at most {bound} s):\n{}\n{}",
        host.name,
        report.join("\n"),
        host.journal(unit)
    );
}

/// The unit's main process id, to tell that a restart made a new one.
fn main_pid(host: &Host, unit: &str) -> String {
    host.must(&format!("systemctl show -p MainPID --value {unit}"))
        .trim()
        .to_string()
}

#[test]
#[ignore = "needs root, systemd-nspawn, debootstrap and the packages (tests/run.sh)"]
fn weft_installed_from_its_packages_as_the_guide_says_runs_under_systemd_and_leaves_nothing_when_removed() {
    if !require_root() {
        return;
    }
    let debs = hosts::packages();
    let guide_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/README.md");
    let guide = std::fs::read_to_string(&guide_path).unwrap();
    let blocks = hosts::guide_blocks(&guide);
    let block = |label: &str| hosts::guide_block(&blocks, label).to_string();

    step("the hosts' root filesystem (debootstrap, once)");
    let root = hosts::rootfs();

    step("six hosts boot: two sites of a controller, a gateway and a node");
    let mut lab = Lab::new("rh");
    lab.lan();
    let dir = tempfile::tempdir().unwrap();
    // (site, controller, gateway, node) on the LAN 192.168.1.0/24.
    let plan = [("site-a", 5, 10, 11), ("site-b", 6, 20, 21)];
    let mut booting = Vec::new();
    for (site, c, g, n) in plan {
        let letter = &site[5..];
        let mut boot = |role: &str, ip: u8| {
            let name = format!("{role}{letter}");
            let ns = lab.host(&name);
            lab.plug(&ns, &format!("192.168.1.{ip}/24"));
            Host::boot(
                &root,
                &format!("weft-rh-{name}"),
                &ns,
                &debs,
                &dir.path().join(format!("{name}.log")),
            )
        };
        let (ctl, gw, node) = (boot("ctl", c), boot("gw", g), boot("node", n));
        let vars = vec![
            ("SITE", site.to_string()),
            ("POD_CIDR", "10.1.0.0/16".to_string()),
            ("LAN_CIDR", "192.168.1.0/24".to_string()),
            ("CONTROLLER", format!("192.168.1.{c}")),
            ("GATEWAY", format!("192.168.1.{g}")),
            ("NODE", format!("192.168.1.{n}")),
        ];
        booting.push(Site {
            name: site,
            ctl,
            gw,
            node,
            vars,
        });
    }
    let sites = booting;
    for s in &sites {
        for h in [&s.ctl, &s.gw, &s.node] {
            h.until_up();
        }
    }
    // The guide's variables are the ones this lane sets: a variable added
    // to the guide must be added here.
    let mut wanted = hosts::guide_vars(&block("vars"));
    wanted.sort();
    let mut known: Vec<String> = sites[0].vars.iter().map(|(n, _)| n.to_string()).collect();
    known.sort();
    assert_eq!(wanted, known, "deploy/README.md's vars block and this lane disagree");

    step("installing the packages starts nothing");
    for s in &sites {
        s.ctl.must("apt install ./weft-controller_*.deb");
        assert!(
            s.ctl.must("getent passwd weft").starts_with("weft:"),
            "no system user weft"
        );
        for h in [&s.gw, &s.node] {
            h.must("apt install ./weft-agent_*.deb");
        }
        for (h, unit) in [
            (&s.ctl, "weft-controller"),
            (&s.gw, "weft-gateway-agent"),
            (&s.node, "weft-node-agent"),
        ] {
            let active = h.must("systemctl list-units --no-legend --state=active 'weft*'");
            assert!(active.trim().is_empty(), "installing started {active} on {}", h.name);
            let enabled = h.sh(&format!("systemctl is-enabled {unit}"));
            assert_eq!(
                weft_tests::stdout(&enabled).trim(),
                "disabled",
                "installing enabled {unit} on {}",
                h.name
            );
        }
    }

    step("each site set up by the guide's commands, as written");
    for s in &sites {
        let env = hosts::exports(&s.vars);
        s.ctl.must(&format!("{env}{}", block("controller")));
        let (token, fp) = token_and_fingerprint(&s.ctl.must(&format!("{env}{}", block("token-gateway"))));
        let agent_env = |t: &str, f: &str| {
            let mut v = s.vars.clone();
            v.push(("TOKEN", t.to_string()));
            v.push(("CA_FINGERPRINT", f.to_string()));
            hosts::exports(&v)
        };
        s.gw.must(&format!("{}{}", agent_env(&token, &fp), block("gateway")));
        let (token, fp) = token_and_fingerprint(&s.ctl.must(&format!("{env}{}", block("token-node"))));
        s.node.must(&format!("{}{}", agent_env(&token, &fp), block("node")));
    }
    for s in &sites {
        eventually(&format!("{}'s agents ready", s.name), Duration::from_secs(60), || {
            let st = json(&s.ctl, "status");
            let ready = |k: &str| {
                st[k]
                    .as_array()
                    .is_some_and(|a| !a.is_empty() && a.iter().all(|x| x["ready"] == true))
            };
            (ready("gateways") && ready("nodes")).then_some(())
        });
        s.ctl.must(&format!("{}{}", hosts::exports(&s.vars), block("check")));
    }

    step("a workload on each node's bridge");
    let mut workload = Vec::new();
    for s in &sites {
        let nodes = json(&s.ctl, "nodes");
        let subnet: ipnet::Ipv4Net = nodes["nodes"][0]["subnet"].as_str().unwrap().parse().unwrap();
        let (first, wl) = (subnet.hosts().next().unwrap(), subnet.hosts().nth(9).unwrap());
        eventually("the node's bridge weft-wl", Duration::from_secs(30), || {
            lab.exec(&s.node.netns, &["ip", "link", "show", "weft-wl"])
                .status
                .success()
                .then_some(())
        });
        let w = lab.host(&format!("w{}", &s.name[5..]));
        must(
            lab.exec(
                &s.node.netns,
                &[
                    "ip", "link", "add", "wl0", "type", "veth", "peer", "name", "eth0", "netns", &w,
                ],
            ),
            "workload veth",
        );
        must(
            lab.exec(&s.node.netns, &["ip", "link", "set", "wl0", "master", "weft-wl", "up"]),
            "wl0",
        );
        must(
            lab.exec(
                &w,
                &[
                    "ip",
                    "addr",
                    "add",
                    &format!("{wl}/{}", subnet.prefix_len()),
                    "dev",
                    "eth0",
                ],
            ),
            "addr",
        );
        must(lab.exec(&w, &["ip", "link", "set", "eth0", "up"]), "up");
        must(
            lab.exec(&w, &["ip", "route", "add", "default", "via", &first.to_string()]),
            "route",
        );
        workload.push((w, wl.to_string()));
    }

    step("site-a peers with site-b by the guide: a peering token there, redeemed here");
    let (a, b) = (&sites[0], &sites[1]);
    let out = b
        .ctl
        .must(&format!("{}{}", hosts::exports(&b.vars), block("peering-token")));
    let peering_token = word_after(&out, "--token ")
        .unwrap_or_else(|| panic!("no peering token in:\n{out}"))
        .to_string();
    let mut v = a.vars.clone();
    v.push(("PEERING_TOKEN", peering_token));
    a.ctl
        .must(&format!("{}{}", hosts::exports(&v), block("peering-create")));
    for s in &sites {
        eventually(
            &format!("{}'s peering connected", s.name),
            Duration::from_secs(60),
            || {
                json(&s.ctl, "peerings")["peerings"]
                    .as_array()
                    .is_some_and(|p| p.len() == 1 && p[0]["state"] == "connected")
                    .then_some(())
            },
        );
    }
    let view = json(&a.ctl, &format!("translate site-b {}", workload[1].1))["local_address"]
        .as_str()
        .unwrap()
        .to_string();
    let wa = workload[0].0.clone();
    eventually("site-a's workload reaching site-b's", Duration::from_secs(30), || {
        lab.exec(&wa, &["ping", "-c", "1", "-W", "1", &view])
            .status
            .success()
            .then_some(())
    });

    step("restarting each unit in turn keeps traffic flowing");
    let log = dir.path().join("ping.log");
    let ping = lab.spawn(
        &wa,
        Path::new("/usr/bin/ping"),
        &["-D", "-i", "0.02", "-W", "1", &view],
        &log,
    );
    std::thread::sleep(Duration::from_secs(2));
    let mut report = Vec::new();
    for (host, unit) in [
        (&a.node, "weft-node-agent"),
        (&a.ctl, "weft-controller"),
        (&a.gw, "weft-gateway-agent"),
        (&b.gw, "weft-gateway-agent"),
        (&b.node, "weft-node-agent"),
        (&b.ctl, "weft-controller"),
    ] {
        disturb(
            host,
            unit,
            &format!("systemctl restart {unit}"),
            &format!("restarting {unit}"),
            &log,
            &mut report,
        );
    }

    step("stopping a controller loses nothing");
    let at = unix_now();
    a.ctl.must("systemctl stop weft-controller");
    std::thread::sleep(Duration::from_secs(5));
    let gap = outage_since(&log, at);
    let bound = allowed_outage("weft-controller");
    assert!(
        gap <= bound,
        "with site-a's controller stopped, traffic stopped for {gap:.2} s (at most {bound} s)"
    );
    a.ctl.must("systemctl start weft-controller");

    step("a backup by the packaged timer's service, restored by the guide's commands");
    let env = hosts::exports(&a.vars);
    let listed = a.ctl.must(&format!("{env}{}", block("backup")));
    let file = listed
        .lines()
        .rfind(|l| l.ends_with(".weft-backup"))
        .unwrap_or_else(|| panic!("the backup service wrote no backup: {listed}"))
        .to_string();
    assert!(
        a.ctl.must("systemctl is-enabled weft-controller-backup.timer").trim() == "enabled",
        "the backup timer is not enabled"
    );
    let shown = |host: &Host| -> Vec<serde_json::Value> {
        ["nodes", "allocations"]
            .iter()
            .map(|c| {
                let mut v = json(host, c);
                v.as_object_mut().unwrap().remove("revision");
                for n in v["nodes"].as_array_mut().into_iter().flatten() {
                    n.as_object_mut().unwrap().remove("status");
                }
                v
            })
            .collect()
    };
    let before = shown(&a.ctl);
    let at = unix_now();
    let said = a.ctl.must(&format!(
        "{env}export BACKUP=/var/lib/weft/backups/{file}\n{}",
        block("restore")
    ));
    std::thread::sleep(Duration::from_secs(5));
    let gap = outage_since(&log, at);
    let bound = allowed_outage("weft-controller");
    assert!(
        gap <= bound,
        "restoring site-a's controller from a backup stopped traffic for {gap:.2} s (at most {bound} s): {said}"
    );
    assert_eq!(shown(&a.ctl), before, "the restored controller shows another site");
    report.push(format!("restore from {file}: longest silence {gap:.2} s"));

    step("the site CA rotated by the guide's commands, under traffic");
    let at = unix_now();
    let said = a.ctl.must(&block("ca-rotate"));
    assert!(said.contains("new CA:"), "{said}");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let finished = loop {
        let o = a.ctl.sh(&block("ca-finish"));
        if o.status.success() {
            break String::from_utf8_lossy(&o.stdout).into_owned();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "ca finish still refused after 60 s: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        std::thread::sleep(Duration::from_secs(1));
    };
    assert!(finished.contains("retired:"), "{finished}");
    std::thread::sleep(Duration::from_secs(3));
    let gap = outage_since(&log, at);
    let bound = allowed_outage("weft-controller");
    assert!(
        gap <= bound,
        "rotating site-a's CA stopped traffic for {gap:.2} s (at most {bound} s)"
    );
    // The restarted controller serves under the CA the rotation made.
    let signing = finished
        .lines()
        .find_map(|l| l.strip_prefix("signing CA:"))
        .map(str::trim)
        .unwrap_or_else(|| panic!("ca status printed no signing CA: {finished}"))
        .to_string();
    assert_eq!(json(&a.ctl, "site")["ca_fingerprint"], signing.as_str());
    report.push(format!(
        "CA rotation (rotate, restart, finish, restart): longest silence {gap:.2} s"
    ));

    step("an upgrade in place (the same packages again) restarts what runs and tears nothing down");
    for (host, deb, unit) in [
        (&a.ctl, "weft-controller", "weft-controller"),
        (&a.gw, "weft-agent", "weft-gateway-agent"),
        (&a.node, "weft-agent", "weft-node-agent"),
    ] {
        disturb(
            host,
            unit,
            &format!("apt install --reinstall ./{deb}_*.deb"),
            &format!("upgrading {deb}"),
            &log,
            &mut report,
        );
    }
    lab.proc(ping).stop();

    step("removing the packages leaves nothing of weft's on any host");
    // What the check looks for is there while weft runs.
    for s in &sites {
        for h in [&s.gw, &s.node] {
            assert!(
                !hosts::leftovers(h).is_empty(),
                "{}: weft's objects are not where the check looks",
                h.name
            );
        }
    }
    for s in &sites {
        for h in [&s.gw, &s.node] {
            h.must(&block("remove-agent"));
        }
        s.ctl.must(&block("remove-controller"));
    }
    for s in &sites {
        for h in [&s.ctl, &s.gw, &s.node] {
            let left = hosts::leftovers(h);
            assert!(
                left.is_empty(),
                "{} keeps weft's objects after removal:\n{left}",
                h.name
            );
            let running = h.sh("pgrep -l weft || true");
            assert!(
                weft_tests::stdout(&running).trim().is_empty(),
                "weft still runs on {}: {}",
                h.name,
                weft_tests::stdout(&running)
            );
        }
    }
    eprintln!("restarts:\n  {}", report.join("\n  "));
}
