//! The disaster-recovery drill, on the embedded store and on etcd: a
//! running site (agents connected, a peering up, pings crossing it) is
//! backed up, its controller stopped and everything it kept wiped (its data
//! directory with the site CA, and etcd's data), the backup restored and the
//! controller started again. Traffic never stops, the agents take the
//! difference (nothing, here) rather than a snapshot, and weftctl shows the
//! same site as before.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::Value;
use weft_tests::sites::{self, Opts, TwoSites, ping_wa_to_wb, until_wa_reaches_wb};
use weft_tests::{eventually, weftctl_json};

/// Fields that move while a site runs (statuses, revisions, times), left
/// out of the comparison.
const MOVING: &[&str] = &[
    "revision",
    "status",
    "last_seen",
    "latest_revision",
    "applied_revision",
    "waiting_for",
    "tunnel",
    "ready",
    "active_since",
];

fn without_moving(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.retain(|k, _| !MOVING.contains(&k.as_str()));
            m.values_mut().for_each(without_moving);
        }
        Value::Array(a) => a.iter_mut().for_each(without_moving),
        _ => {}
    }
}

/// What site a's controller holds, as weftctl shows it.
fn state(target: &str) -> Vec<Value> {
    ["site", "nodes", "gateways", "allocations", "peerings", "names"]
        .iter()
        .map(|cmd| {
            let mut v = weftctl_json(target, &[cmd]);
            without_moving(&mut v);
            v
        })
        .collect()
}

fn drill(tag: &str, on_etcd: bool) {
    if !weft_tests::netns::require_root() {
        return;
    }
    let site_a = format!("{tag}-a");
    let mut s: TwoSites = sites::up_with(
        tag,
        (&site_a, "10.1.0.0/16"),
        (&format!("{tag}-b"), "10.2.0.0/16"),
        Opts {
            site_a_etcd: on_etcd,
            ..Default::default()
        },
    );
    until_wa_reaches_wb(&s);
    let wa_real = s.workloads.iter().find(|w| w.0 == "wa").unwrap().1.clone();
    weftctl_json(&s.ta, &["name", "add", "web", &wa_real]);
    // Once settled: the peering connected, the gateways' NAT found.
    let before = eventually("site a settled", Duration::from_secs(30), || {
        let v = state(&s.ta);
        let text = v.iter().map(|x| x.to_string()).collect::<String>();
        let settled = text.contains("\"state\":\"connected\"") && !text.contains("\"nat\":\"\"");
        (settled && v == state(&s.ta)).then_some(v)
    });

    weft_tests::step("backup under traffic");
    let (ping, ping_log) = ping_wa_to_wb(&mut s, "backup-ping.log");
    let file = s.dir.path().join("site-a.backup");
    let o = s.lab.ctl(0).run_command(&["backup", "--out", file.to_str().unwrap()]);
    assert!(o.status.success(), "backup: {}", weft_tests::stderr(&o));
    let said = weft_tests::stdout(&o);
    assert!(said.contains("2 nodes, 1 gateways, 1 peerings"), "{said}");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);

    weft_tests::step("wipe the controller's store and its data directory");
    s.lab.ctl(0).stop();
    let data = s.lab.ctl(0).data_dir.clone();
    std::fs::remove_dir_all(&data).unwrap();
    if let Some(e) = s.etcd_a {
        // A new etcd: its revision starts again at 1, far below the one
        // the agents last applied.
        s.lab.proc(e).stop();
        std::fs::remove_dir_all(s.dir.path().join("etcd-a")).unwrap();
        s.lab.respawn(e);
        eventually("site a's new etcd", Duration::from_secs(20), || {
            s.lab
                .exec(&s.ns["ctla"], &["etcdctl", "endpoint", "health"])
                .status
                .success()
                .then_some(())
        });
    }

    weft_tests::step("restore and start again");
    let o = s.lab.ctl(0).run_command(&["restore", file.to_str().unwrap()]);
    assert!(o.status.success(), "restore: {}", weft_tests::stderr(&o));
    let said = weft_tests::stdout(&o);
    assert!(said.contains("site CA:          written to"), "{said}");
    assert!(said.contains("not brought back"), "{said}");
    // A second restore onto what the first wrote is refused.
    let again = s.lab.ctl(0).run_command(&["restore", file.to_str().unwrap()]);
    assert!(!again.status.success());
    assert!(
        weft_tests::stderr(&again).contains("already holds site"),
        "{}",
        weft_tests::stderr(&again)
    );
    let logs: Vec<(std::path::PathBuf, usize)> = s
        .agents
        .iter()
        .filter(|a| ["gwa", "na", "na2"].contains(&a.1))
        .map(|a| {
            let log = std::path::PathBuf::from(format!("{}.log", a.3.display()));
            let len = std::fs::read_to_string(&log).unwrap_or_default().len();
            (log, len)
        })
        .collect();
    s.lab.ctl(0).restart_stopped();

    weft_tests::step("agents resume with the difference, not a snapshot");
    let applied = eventually(
        "every agent of site a applying its first message",
        Duration::from_secs(30),
        || {
            let mut out = HashMap::new();
            for (log, from) in &logs {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                let line = text[*from..]
                    .lines()
                    .find(|l| l.contains("applied") && l.contains("upserts"))?
                    .to_string();
                out.insert(log.clone(), line);
            }
            Some(out)
        },
    );
    for (log, line) in &applied {
        assert!(
            !line.contains("snapshot") && line.contains("delta") && line.contains("deletes=0"),
            "{}: {line}",
            log.display()
        );
    }
    // The same records; the peering's state is shown as "connecting"
    // until the gateway reports its tunnel to the new process.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut after = state(&s.ta);
    while after != before && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        after = state(&s.ta);
    }
    for (was, is) in before.iter().zip(&after) {
        let (was, is) = (format!("{was:#}"), format!("{is:#}"));
        let gone: Vec<&str> = was.lines().filter(|l| !is.lines().any(|m| m == *l)).collect();
        let new: Vec<&str> = is.lines().filter(|l| !was.lines().any(|m| m == *l)).collect();
        assert_eq!(gone, new, "the restored site differs: {gone:?} became {new:?}");
    }
    std::thread::sleep(Duration::from_secs(3));
    s.lab.proc(ping).stop();
    let (answered, lost) = weft_tests::pings_lost(&std::fs::read_to_string(&ping_log).unwrap(), 100);
    eprintln!("{tag}: {answered} pings answered, {lost} lost; agents' first messages: {applied:?}");
    assert_eq!(lost, 0, "pings lost across backup, wipe and restore");
    // The restored controller keeps allocating after what it restored.
    let n = weftctl_json(&s.ta, &["node", "add", "after-restore"]);
    assert!(n["subnet"].as_str().is_some_and(|s| s.starts_with("10.1.")), "{n}");
}

#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn a_site_on_the_embedded_store_is_restored_from_a_backup_without_losing_a_ping() {
    drill("bke", false);
}

#[test]
#[ignore = "needs root (network namespaces) and etcd: tests/run.sh runs it as root"]
fn a_site_on_etcd_is_restored_from_a_backup_onto_a_new_etcd_without_losing_a_ping() {
    drill("bkt", true);
}

/// What a restore refuses, and a restore cut short: the controller does
/// not start on it, and the next restore starts over and finishes.
#[test]
fn a_restore_refuses_what_it_cannot_restore_and_starts_over_after_being_cut_short() {
    let Some(etcd) = weft_tests::Etcd::start() else {
        return;
    };
    let dir = tempfile::Builder::new().prefix("weft-restore").tempdir().unwrap();
    let data = dir.path().join("data");
    let ep = etcd.endpoint();
    let spec = || {
        weft_tests::ControllerSpec::new("site-r").data_dir(&data).flags(&[
            "--pod-cidr",
            "10.1.0.0/16",
            "--etcd-endpoints",
            &ep,
        ])
    };
    let mut c = spec().start();
    for n in ["a", "b", "c"] {
        weftctl_json(&c.target(), &["node", "add", n]);
    }
    let before = state(&c.target());
    let file = dir.path().join("r.backup");
    let file_arg = file.to_str().unwrap();
    let o = c.run_command(&["backup", "--out", file_arg]);
    assert!(o.status.success(), "{}", weft_tests::stderr(&o));
    let refused = |o: std::process::Output, why: &str| {
        assert!(!o.status.success(), "not refused: {}", weft_tests::stdout(&o));
        let e = weft_tests::stderr(&o);
        assert!(e.contains(why), "{e}");
    };
    refused(c.run_command(&["restore", file_arg]), "a controller is serving");
    c.stop();
    refused(
        c.run_command(&["restore", file_arg]),
        "already holds site site-r's state",
    );

    let mut bytes = std::fs::read(&file).unwrap();
    let damaged = dir.path().join("damaged.backup");
    let at = bytes.len() - 10;
    bytes[at] ^= 0xff;
    std::fs::write(&damaged, &bytes).unwrap();
    refused(
        c.run_command(&["restore", damaged.to_str().unwrap()]),
        "digest does not match",
    );
    let other = weft_tests::ControllerSpec::new("site-other")
        .data_dir(&dir.path().join("other"))
        .flags(&["--pod-cidr", "10.1.0.0/16", "--etcd-endpoints", &ep])
        .start();
    refused(
        other.run_command(&["restore", file_arg]),
        "a backup of site \"site-r\", and this controller is configured as site \"site-other\"",
    );
    drop(other);

    weft_tests::step("a restore cut short: its marker and part of the records");
    let ctl = |args: &[&str]| {
        let o = std::process::Command::new("etcdctl")
            .args(["--endpoints", &ep])
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "etcdctl {args:?}: {}", weft_tests::stderr(&o));
    };
    ctl(&["del", "--prefix", "/weft/sites/site-r/"]);
    ctl(&["put", "/weft/sites/site-r/restoring", "1"]);
    ctl(&["put", "/weft/sites/site-r/nodes/stray", "{}"]);
    refused(spec().refused(), "a restore that was cut short");
    let o = c.run_command(&["restore", file_arg]);
    assert!(o.status.success(), "{}", weft_tests::stderr(&o));
    assert!(
        weft_tests::stdout(&o).contains("started over"),
        "{}",
        weft_tests::stdout(&o)
    );
    c.restart_stopped();
    assert_eq!(state(&c.target()), before);
}
