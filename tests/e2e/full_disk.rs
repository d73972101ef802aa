//! The embedded store's disk fills up or turns read-only under a running
//! controller: writes are refused with a message that says so, reads keep
//! working, nothing is corrupted, and writes work again once space (or
//! write access) returns — without a restart, and across one.
//!
//! The data directory is a 4 MiB tmpfs in a mount namespace of the test's
//! own (held open by a sleeping process), so nothing on the machine fills.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use weft_tests::netns::require_root;
use weft_tests::{Controller, ControllerSpec, Proc, bin, eventually, free_port, run, stderr, weftctl_json};

fn start_controller(holder: u32, data: &Path, sock: &Path, port: u16, log: &Path) -> Controller {
    controller(holder, data, sock, port).log(log).start()
}

/// A controller of site-a in `holder`'s mount namespace, its data in
/// `data`, its admin socket at `sock`, listening on loopback `port`.
fn controller(holder: u32, data: &Path, sock: &Path, port: u16) -> ControllerSpec {
    ControllerSpec::new("site-a")
        .data_dir(data)
        .pod("10.1.0.0/16")
        .admin_socket(sock)
        .listen(&format!("127.0.0.1:{port}"))
        .mount_of(holder)
}

/// The holder: a process in a mount namespace of its own with a tmpfs of
/// `size` on `at`, and its PID (see the files through /proc/PID/root).
fn tmpfs_holder(at: &Path, size: &str, log: &Path) -> (Proc, u32) {
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(format!(
            "mount -t tmpfs -o size={size} weft-disk-test {} && exec sleep 3600",
            at.display()
        ));
    let holder = Proc::spawn(&mut cmd, log);
    let hpid = holder.child.as_ref().unwrap().id();
    eventually("the tmpfs", Duration::from_secs(5), || {
        let m = std::fs::read_to_string(format!("/proc/{hpid}/mounts")).unwrap_or_default();
        m.contains("weft-disk-test").then_some(())
    });
    (holder, hpid)
}

fn in_mount_ns(holder: u32, args: &[&str]) -> std::process::Output {
    run(Command::new("nsenter")
        .arg(format!("--mount=/proc/{holder}/ns/mnt"))
        .args(args))
}

#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn a_full_or_read_only_data_dir_refuses_writes_clearly_and_recovers() {
    if !require_root() {
        return;
    }
    weft_tests::step("a controller on a 4 MiB data dir");
    let dir = tempfile::Builder::new().prefix("weft-disk").tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let sock = dir.path().join("admin.sock");
    let target = format!("unix:{}", sock.display());
    let (holder, hpid) = tmpfs_holder(&data, "4m", &dir.path().join("holder.log"));
    let port = free_port();
    let mut c = start_controller(hpid, &data, &sock, port, &dir.path().join("c1.log"));
    let add = |name: &str| run(Command::new(bin("weftctl")).args(["--controller", &target, "node", "add", name]));
    for i in 0..5 {
        assert!(add(&format!("n{i}")).status.success());
    }

    weft_tests::step("a full disk refuses writes clearly");
    // Fill the disk (through the holder's view of it).
    let filler = format!("/proc/{hpid}/root{}/filler", data.display());
    let chunk = vec![0u8; 64 * 1024];
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&filler).unwrap();
        while f.write_all(&chunk).is_ok() {}
        let _ = f.sync_all();
    }
    let t = Instant::now();
    let mut refused = None;
    for i in 0..50 {
        let o = add(&format!("full{i}"));
        if !o.status.success() {
            refused = Some(stderr(&o));
            break;
        }
    }
    let err = refused.expect("writes kept succeeding on a full disk");
    println!("FAULT data dir full: {err}");
    // The documented code (docs/reliability.md): retry once space is back.
    assert!(err.contains("UNAVAILABLE"), "a full disk is UNAVAILABLE: {err}");
    assert!(
        err.to_lowercase().contains("no space"),
        "the message says the disk is full: {err}"
    );
    weft_tests::step("reads still work on a full disk");
    // Reads still work.
    let nodes = weftctl_json(&target, &["nodes"]);
    assert!(nodes["nodes"].as_array().unwrap().len() >= 5);
    weft_tests::step("writes work again once space returns");
    // Space returns: writes work again, without a restart.
    std::fs::remove_file(&filler).unwrap();
    eventually("writes again after space returned", Duration::from_secs(20), || {
        add("after-full").status.success().then_some(())
    });
    println!(
        "FAULT data dir full: writes refused, then accepted {:.1} s after space returned",
        t.elapsed().as_secs_f64()
    );

    weft_tests::step("a read-only data dir refuses the start");
    // Read-only: a data directory that turned read-only (as the kernel
    // does to a file system after errors) at the next start. (A running
    // controller's open file stays writable through a remount, so the
    // start is where this bites.)
    let before = weftctl_json(&target, &["nodes"]);
    c.stop();
    drop(c);
    let o = in_mount_ns(hpid, &["mount", "-o", "remount,ro", data.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = controller(hpid, &data, &sock, port).refused();
    let err = stderr(&o);
    println!(
        "FAULT data dir read-only at start: exit {:?}: {}",
        o.status.code(),
        err.trim()
    );
    assert!(!o.status.success(), "started on a read-only data dir");
    assert!(
        err.to_lowercase().contains("read-only"),
        "the message says the disk is read-only: {err}"
    );
    let o = in_mount_ns(hpid, &["mount", "-o", "remount,rw", data.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));

    weft_tests::step("a restart reads back everything acknowledged");
    // Nothing corrupted: a restart reads back everything acknowledged.
    let _c = start_controller(hpid, &data, &sock, port, &dir.path().join("c2.log"));
    let after = weftctl_json(&target, &["nodes"]);
    let names = |v: &serde_json::Value| -> Vec<String> {
        v["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(names(&before), names(&after));
    for want in ["n0", "n4", "after-full"] {
        assert!(
            names(&after).iter().any(|n| n == want),
            "{want} lost: {:?}",
            names(&after)
        );
    }
    drop(holder);
}

/// A node agent whose state directory's disk fills up keeps the data plane
/// it applied and takes in new desired state (a gateway arriving changes
/// it): it reports that it cannot save, never tears down or exits, and
/// saves once space returns.
#[test]
#[ignore = "needs root (mount namespaces): tests/run.sh runs it as root"]
fn a_full_disk_under_a_node_agent_never_tears_it_down() {
    if !require_root() {
        return;
    }
    weft_tests::step("a node agent saves and applies its state on a small tmpfs");
    let dir = tempfile::Builder::new().prefix("weft-disk").tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    let (holder, hpid) = tmpfs_holder(&state, "1m", &dir.path().join("holder.log"));
    let c = weft_tests::ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("ctl"))
        .flags(&["--pod-cidr", "10.1.0.0/16"])
        .start();
    let args = weft_tests::enrolling_agent_args(
        &c.target(),
        "node",
        "n1",
        &format!("https://127.0.0.1:{}", c.listen_port),
        "127.0.0.1",
        &state,
        "30s",
    );
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--mount=/proc/{hpid}/ns/mnt"))
        .arg(bin("weft-node-agent"))
        .args(&args)
        .arg("--dry-run")
        .env_remove("WEFT_CONTROLLER")
        .env_remove("WEFT_TOKEN");
    let mut n1 = Proc::spawn(&mut cmd, &dir.path().join("n1.log"));
    eventually("n1 watching", Duration::from_secs(20), || {
        n1.log_text().contains("watching").then_some(())
    });
    // The holder's view of the tmpfs.
    let inside = |f: &str| format!("/proc/{hpid}/root{}/{f}", state.display());
    let saved = || std::fs::read(inside("desired-state.pb")).unwrap();
    let applied = |p: &Proc| p.log_text().matches("applied revision=").count();
    // "watching" comes before the first desired state is saved and applied:
    // wait for both rather than assume them.
    let before = eventually(
        "n1 saved and applied its desired state",
        Duration::from_secs(20),
        || {
            let b = std::fs::read(inside("desired-state.pb"))
                .ok()
                .filter(|b| !b.is_empty())?;
            (applied(&n1) > 0).then_some(b)
        },
    );
    weft_tests::step("the disk under the state directory fills up");
    let applied_before = applied(&n1);
    {
        use std::io::Write;
        let mut f = std::fs::File::create(inside("filler")).unwrap();
        let chunk = vec![0u8; 16 * 1024];
        while f.write_all(&chunk).is_ok() {}
        let _ = f.sync_all();
    }

    weft_tests::step("a new desired state is applied and the full disk reported");
    // A gateway arrives: n1's desired state changes while the disk is full.
    let _gw = weft_tests::dry_run_agent("gateway", "gw", "127.0.0.2", &[&c], &c, dir.path());
    let errors = || weftctl_json(&c.target(), &["node", "get", "n1"])["status"]["errors"].clone();
    let reported = eventually("n1 reports the full disk", Duration::from_secs(30), || {
        let e = errors();
        e.as_array()?
            .iter()
            .filter_map(|x| x.as_str())
            .find(|s| s.contains("cannot keep the desired state on disk"))
            .map(str::to_string)
    });
    println!("FAULT node state dir full: reported {reported:?}");
    assert!(reported.to_lowercase().contains("no space"), "{reported}");
    assert!(
        applied(&n1) > applied_before,
        "n1 did not take in the new state:\n{}",
        n1.log_text()
    );
    assert!(
        n1.wait_exit(Duration::from_secs(2)).is_none(),
        "n1 stopped:\n{}",
        n1.log_text()
    );
    assert!(!n1.log_text().contains("removed weft's objects"), "{}", n1.log_text());
    assert_eq!(saved(), before, "the state file is intact: the old state, whole");

    weft_tests::step("space returns: the state is saved and the error goes");
    // Space returns: the next report saves, and the error goes.
    std::fs::remove_file(inside("filler")).unwrap();
    let t = Instant::now();
    eventually("n1 saved its state again", Duration::from_secs(30), || {
        (saved() != before && errors().as_array().is_some_and(|e| e.is_empty())).then_some(())
    });
    println!(
        "FAULT node state dir full: saved {:.1} s after space returned",
        t.elapsed().as_secs_f64()
    );
    drop(n1);
    drop(holder);
}
