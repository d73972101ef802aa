//! A controller that restarts loses nothing: site, nodes and allocations are
//! the same afterwards, on the embedded store and on etcd.

use serde_json::Value;
use weft_tests::{Controller, ControllerSpec, Etcd, weftctl_json};

/// What the controller holds, without the store revision (a restart
/// writes its leadership record, which moves the revision on).
fn state(c: &Controller) -> Vec<Value> {
    ["site", "nodes", "allocations", "peerings"]
        .iter()
        .map(|cmd| {
            let mut v = weftctl_json(&c.target(), &[cmd]);
            v.as_object_mut().unwrap().remove("revision");
            v
        })
        .collect()
}

fn populate(c: &Controller) {
    let t = c.target();
    for n in ["a", "b", "c"] {
        weftctl_json(&t, &["node", "add", n]);
    }
    weftctl_json(&t, &["node", "add", "declared", "--subnet", "10.1.128.0/25"]);
    weftctl_json(&t, &["node", "remove", "b"]);
}

fn check_restart(c: &mut Controller) {
    populate(c);
    let before = state(c);
    c.restart();
    assert_eq!(state(c), before, "state changed across a restart");
    // allocation carries on from the stored state: b's freed subnet is next
    assert_eq!(
        weftctl_json(&c.target(), &["node", "add", "e"])["subnet"],
        "10.1.1.0/24"
    );
}

#[test]
fn embedded_store_controller_restart_keeps_state() {
    let dir = tempfile::Builder::new().prefix("weft-restart").tempdir().unwrap();
    let mut c = ControllerSpec::new("site-r")
        .data_dir(&dir.path().join("data"))
        .flags(&["--pod-cidr", "10.1.0.0/16"])
        .start();
    check_restart(&mut c);
}

#[test]
fn etcd_store_controller_restart_keeps_state() {
    let Some(mut etcd) = Etcd::start() else {
        return;
    };
    let dir = tempfile::Builder::new().prefix("weft-restart").tempdir().unwrap();
    let ep = etcd.endpoint();
    let mut c = ControllerSpec::new("site-r")
        .data_dir(&dir.path().join("data"))
        .flags(&["--pod-cidr", "10.1.0.0/16", "--etcd-endpoints", &ep])
        .start();
    check_restart(&mut c);
    // and across a restart of etcd itself
    let before = state(&c);
    c.stop();
    etcd.restart();
    c.restart_stopped();
    assert_eq!(state(&c), before);
}

#[test]
fn a_config_change_that_strands_a_node_is_refused() {
    let dir = tempfile::Builder::new().prefix("weft-restart").tempdir().unwrap();
    let data = dir.path().join("data");
    let mut c = ControllerSpec::new("site-s")
        .data_dir(&data)
        .flags(&["--pod-cidr", "10.1.0.0/16"])
        .start();
    weftctl_json(&c.target(), &["node", "add", "n1"]);
    c.stop();
    let o = ControllerSpec::new("site-s")
        .data_dir(&data)
        .pod("10.2.0.0/16")
        .refused();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("n1") && err.contains("10.1.0.0/24") && err.contains("outside"),
        "{err}"
    );
    // the stored state is untouched: the old configuration still starts
    c.restart_stopped();
    assert_eq!(
        weftctl_json(&c.target(), &["node", "get", "n1"])["subnet"],
        "10.1.0.0/24"
    );
}
