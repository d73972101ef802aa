//! A bad configuration stops the controller before it listens, and says
//! which field is wrong and how to fix it.

use std::process::Command;

use weft_tests::{bin, free_port, run, stderr, stdout};

fn start_with_file(toml: &str, extra: &[&str]) -> (tempfile::TempDir, std::process::Output, u16) {
    let dir = tempfile::Builder::new().prefix("weft-config").tempdir().unwrap();
    let cfg = dir.path().join("controller.toml");
    std::fs::write(&cfg, toml).unwrap();
    let port = free_port();
    let o = run(Command::new(bin("weft-controller"))
        .arg("--config")
        .arg(&cfg)
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(extra)
        .env_remove("WEFT_SITE_ID"));
    (dir, o, port)
}

fn assert_refused_before_listening(dir: &tempfile::TempDir, o: &std::process::Output, port: u16) {
    assert_eq!(o.status.code(), Some(2), "{}", stderr(o));
    assert!(
        !dir.path().join("data").join("admin.sock").exists(),
        "no socket may be bound"
    );
    assert!(!dir.path().join("data").exists(), "nothing may be written");
    assert!(
        std::net::TcpListener::bind(("127.0.0.1", port)).is_ok(),
        "the port must be free"
    );
}

#[test]
fn each_bad_field_is_named_with_its_fix() {
    let (dir, o, port) = start_with_file(
        r#"
site_id = "site-a"
pod_cidrs = ["10.1.0.0/16", "10.1.128.0/17"]
external_cidr = "10.70.0.0/33"
reserved_cidrs = ["10.1.5.0/24"]
node_prefix_len = 31
"#,
        &[],
    );
    assert_refused_before_listening(&dir, &o, port);
    let err = stderr(&o);
    for needle in [
        "pod_cidrs[1] (--pod-cidr, WEFT_POD_CIDR): 10.1.128.0/17 overlaps pod_cidrs[0]",
        "external_cidr (--external-cidr, WEFT_EXTERNAL_CIDR): \"10.70.0.0/33\" is not a CIDR: its prefix length \"33\" is not a number from 0 to 32",
        "reserved_cidrs[0]",
        "node_prefix_len",
        "at most 30",
    ] {
        assert!(err.contains(needle), "expected {needle:?} in:\n{err}");
    }
}

#[test]
fn unknown_fields_and_bad_toml_are_named() {
    let (dir, o, port) = start_with_file("site_id = \"a\"\npod_cidr = \"10.0.0.0/16\"\n", &[]);
    assert_refused_before_listening(&dir, &o, port);
    assert!(stderr(&o).contains("unknown field `pod_cidr`"), "{}", stderr(&o));

    let (dir, o, port) = start_with_file("site_id = [\n", &[]);
    assert_refused_before_listening(&dir, &o, port);
    assert!(stderr(&o).contains("controller.toml"), "{}", stderr(&o));
}

#[test]
fn flags_override_the_file_and_check_config_validates() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(&cfg, "site_id = \"from-file\"\npod_cidrs = [\"10.70.0.0/16\"]\n").unwrap();
    // the file's pod CIDR collides with the default external CIDR ...
    let o = run(Command::new(bin("weft-controller"))
        .arg("--config")
        .arg(&cfg)
        .arg("check-config"));
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("external_cidr") && stderr(&o).contains("(the default)"),
        "{}",
        stderr(&o)
    );
    // ... which a flag (or WEFT_* variable) fixes without editing the file
    let o = run(Command::new(bin("weft-controller"))
        .arg("--config")
        .arg(&cfg)
        .arg("check-config")
        .env("WEFT_EXTERNAL_CIDR", "10.71.0.0/16")
        .args(["--site-id", "from-flag"]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("from-flag") && stdout(&o).contains("10.71.0.0/16"),
        "{}",
        stdout(&o)
    );
}

/// `--wireguard kernel` where the kernel has no WireGuard (this machine's
/// kernel; the VM lane runs one that has it): the gateway agent exits 2
/// before it does anything, saying what the kernel lacks and what to do.
#[test]
#[ignore = "needs root (the kernel probe makes a throwaway network namespace): tests/run.sh runs it as root"]
fn a_gateway_asked_for_kernel_wireguard_without_the_module_exits_2() {
    assert!(weft_tests::netns::require_root());
    if std::env::var_os("WEFT_IN_VM").is_some() || weft_agent::linux::kernel_wireguard_probe().is_ok() {
        panic!("this kernel has WireGuard: the test needs one without it (this machine's)");
    }
    let dir = tempfile::Builder::new().prefix("weft-wgmode").tempdir().unwrap();
    let o = run(Command::new(bin("weft-gateway-agent"))
        .args([
            "--controller",
            "https://127.0.0.1:1",
            "--name",
            "gw",
            "--wireguard",
            "kernel",
        ])
        .arg("--state-dir")
        .arg(dir.path().join("state")));
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    for needle in [
        "--wireguard kernel: the kernel cannot make wireguard links: no wireguard module",
        "modprobe wireguard",
        "--wireguard auto",
    ] {
        assert!(err.contains(needle), "expected {needle:?} in:\n{err}");
    }
    assert!(!dir.path().join("state").exists(), "nothing may be written");
}
