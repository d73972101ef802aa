//! The admin API end to end: the real `weft-controller` binary, the real
//! grpcurl on its unix socket and TCP listener, and weftctl.

use std::process::Command;

use serde_json::Value;
use weft_tests::{Controller, ControllerSpec, bin, require_tool, run, stderr, stdout, weftctl_json};

fn controller(site: &str, pods: &[&str], extra: &[&str]) -> (tempfile::TempDir, Controller) {
    let dir = tempfile::Builder::new().prefix("weft-admin").tempdir().unwrap();
    let mut args: Vec<&str> = Vec::new();
    for p in pods {
        args.extend(["--pod-cidr", p]);
    }
    args.extend(extra);
    let c = ControllerSpec::new(site)
        .data_dir(&dir.path().join("data"))
        .flags(&args)
        .start();
    (dir, c)
}

/// grpcurl on the admin socket, exactly as a user types it (no -authority).
fn grpcurl_unix(c: &Controller, args: &[&str]) -> std::process::Output {
    let g = require_tool("grpcurl").unwrap();
    let sock = c.socket.display().to_string();
    let (flags, rest) = match args.iter().position(|a| *a == "--") {
        Some(i) => (&args[..i], &args[i + 1..]),
        None => (&[][..], args),
    };
    run(Command::new(g)
        .args(["-plaintext", "-unix"])
        .args(flags)
        .arg(sock)
        .args(rest))
}

fn grpc_error(o: &std::process::Output) -> String {
    assert!(!o.status.success(), "call should have failed: {}", stdout(o));
    stderr(o)
}

#[test]
fn grpcurl_lists_services_and_reads_the_site_over_the_unix_socket() {
    if require_tool("grpcurl").is_none() {
        return;
    }
    let (_d, c) = controller(
        "site-a",
        &["10.1.0.0/16", "10.2.0.0/16"],
        &["--reserved-cidr", "192.168.50.0/24"],
    );
    let o = grpcurl_unix(&c, &["list"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let services = stdout(&o);
    for s in ["weft.v1.AdminService", "grpc.health.v1.Health"] {
        assert!(services.lines().any(|l| l == s), "{s} missing from:\n{services}");
    }
    let o = grpcurl_unix(&c, &["weft.v1.AdminService/GetSite"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let site: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(site["id"], "site-a");
    assert_eq!(site["podCidrs"], serde_json::json!(["10.1.0.0/16", "10.2.0.0/16"]));
    assert_eq!(site["externalCidr"], "10.70.0.0/16");
    assert_eq!(site["reservedCidrs"], serde_json::json!(["192.168.50.0/24"]));
    assert_eq!(site["nodePrefixLen"], 24);

    let o = grpcurl_unix(&c, &["grpc.health.v1.Health/Check"]);
    assert!(stdout(&o).contains("SERVING"), "{}{}", stdout(&o), stderr(&o));
    let o = grpcurl_unix(&c, &["describe", "weft.v1.AdminService.CreateNode"]);
    assert!(stdout(&o).contains("CreateNodeRequest"), "{}", stderr(&o));

    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&c.socket).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "the admin socket is for its owner only");
}

#[test]
fn bad_requests_get_the_right_code_and_write_nothing() {
    if require_tool("grpcurl").is_none() {
        return;
    }
    weft_tests::step("a controller with one node");
    let (_d, c) = controller("site-b", &["10.1.0.0/22"], &[]);
    let call =
        |body: &str, method: &str| grpcurl_unix(&c, &["-d", body, "--", &format!("weft.v1.AdminService/{method}")]);

    assert!(call(r#"{"name":"n1"}"#, "CreateNode").status.success());
    let before = weftctl_json(&c.target(), &["allocations"]);

    weft_tests::step("each bad request gets its code and message and writes nothing");
    let cases: &[(&str, &str, &str, &str)] = &[
        (
            r#"{"name":"n2","subnet":"10.1.0.0/33"}"#,
            "CreateNode",
            "InvalidArgument",
            "not a CIDR",
        ),
        (
            r#"{"name":"n2","subnet":"10.1.2.9/24"}"#,
            "CreateNode",
            "InvalidArgument",
            "host bits",
        ),
        (
            r#"{"name":"n2","subnet":"fd00::/64"}"#,
            "CreateNode",
            "InvalidArgument",
            "IPv6",
        ),
        (
            r#"{"name":"n2","subnet":"10.9.0.0/24"}"#,
            "CreateNode",
            "InvalidArgument",
            "not inside any",
        ),
        (
            r#"{"name":"n2","subnet":"10.1.0.0/25"}"#,
            "CreateNode",
            "AlreadyExists",
            "n1",
        ),
        (
            r#"{"name":"../etc"}"#,
            "CreateNode",
            "InvalidArgument",
            "not a valid name",
        ),
        (r#"{"name":""}"#, "CreateNode", "InvalidArgument", "empty"),
        (r#"{"name":"n1"}"#, "CreateNode", "AlreadyExists", "already exists"),
        (r#"{"name":"ghost"}"#, "GetNode", "NotFound", "does not exist"),
        (r#"{"name":"ghost"}"#, "DeleteNode", "NotFound", "does not exist"),
        (r#"{}"#, "PlanLocalView", "InvalidArgument", "workload_cidrs"),
        (
            r#"{"workload_cidrs":["10.0.0.0/99"]}"#,
            "PlanLocalView",
            "InvalidArgument",
            "workload_cidrs[0]",
        ),
        (r#"{"name":"n2","bogus":1}"#, "CreateNode", "", "bogus"),
    ];
    for (body, method, code, needle) in cases {
        let err = grpc_error(&call(body, method));
        assert!(
            err.contains(&format!("Code: {code}")) || code.is_empty(),
            "{method} {body}: {err}"
        );
        assert!(err.contains(needle), "{method} {body}: expected {needle:?} in {err}");
    }
    assert_eq!(
        weftctl_json(&c.target(), &["allocations"]),
        before,
        "refused calls wrote nothing"
    );

    weft_tests::step("the pod cidr holds four nodes and refuses the fifth");
    // The pod CIDR holds four /24s: three more fit, the fifth is refused.
    for n in ["n2", "n3", "n4"] {
        assert!(call(&format!(r#"{{"name":"{n}"}}"#), "CreateNode").status.success());
    }
    let err = grpc_error(&call(r#"{"name":"n5"}"#, "CreateNode"));
    assert!(
        err.contains("Code: ResourceExhausted") && err.contains("10.1.0.0/22"),
        "{err}"
    );
    assert_eq!(
        weftctl_json(&c.target(), &["nodes"])["nodes"].as_array().unwrap().len(),
        4
    );
}

#[test]
fn tcp_listener_requires_a_client_certificate_from_the_site_ca() {
    let Some(g) = require_tool("grpcurl") else {
        return;
    };
    weft_tests::step("a call with the admin certificate over tcp succeeds");
    let (_d, c) = controller("site-c", &["10.1.0.0/16"], &[]);
    let addr = format!("127.0.0.1:{}", c.listen_port);
    let (ca, cert, key) = (c.pki("ca.pem"), c.pki("admin.pem"), c.pki("admin.key"));
    let o = run(Command::new(&g)
        .arg("-cacert")
        .arg(&ca)
        .arg("-cert")
        .arg(&cert)
        .arg("-key")
        .arg(&key)
        .args([&addr, "list"]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("weft.v1.AdminService"));
    let o = run(Command::new(&g)
        .arg("-cacert")
        .arg(&ca)
        .arg("-cert")
        .arg(&cert)
        .arg("-key")
        .arg(&key)
        .args([&addr, "weft.v1.AdminService/GetSite"]));
    assert!(stdout(&o).contains("site-c"), "{}", stderr(&o));

    weft_tests::step("calls without a client certificate or in plaintext are refused");
    let o = run(Command::new(&g)
        .arg("-cacert")
        .arg(&ca)
        .args(["-max-time", "5", &addr, "list"]));
    assert!(
        !o.status.success(),
        "a call without a client certificate must be refused"
    );
    assert!(
        stderr(&o).contains("Unauthenticated") && stderr(&o).contains("client certificate"),
        "{}",
        stderr(&o)
    );
    let o = run(Command::new(&g).args(["-plaintext", "-max-time", "5", &addr, "list"]));
    assert!(!o.status.success(), "plaintext must be refused on TCP");

    weft_tests::step("weftctl over tcp needs the ca file");
    let ok = weftctl_json(
        &format!("https://{addr}"),
        &[
            "--ca-file",
            ca.to_str().unwrap(),
            "--cert",
            cert.to_str().unwrap(),
            "--key",
            key.to_str().unwrap(),
            "site",
        ],
    );
    assert_eq!(ok["id"], "site-c");
    let o = run(Command::new(bin("weftctl")).args(["--controller", &format!("https://{addr}"), "site"]));
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--ca-file"), "{}", stderr(&o));
}

#[test]
fn weftctl_manages_nodes_and_shows_allocations() {
    weft_tests::step("weftctl adds nodes with allocated and declared subnets");
    let (_d, c) = controller("site-d", &["10.1.0.0/16"], &["--node-prefix-len", "26"]);
    let t = c.target();
    let n1 = weftctl_json(&t, &["node", "add", "n1"]);
    assert_eq!(
        (n1["subnet"].as_str(), n1["subnet_source"].as_str()),
        (Some("10.1.0.0/26"), Some("allocated"))
    );
    let n2 = weftctl_json(&t, &["node", "add", "n2", "--subnet", "10.1.200.0/24"]);
    assert_eq!(n2["subnet_source"], "declared");
    assert_eq!(weftctl_json(&t, &["node", "add", "n3"])["subnet"], "10.1.0.64/26");
    assert_eq!(weftctl_json(&t, &["node", "get", "n2"])["subnet"], "10.1.200.0/24");

    weft_tests::step("allocations count every subnet");
    let a = weftctl_json(&t, &["allocations"]);
    let pod = a["pools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pool"] == "10.1.0.0/16")
        .unwrap()
        .clone();
    assert_eq!(pod["allocated_addresses"], 64 + 256 + 64);
    assert_eq!(a["allocations"].as_array().unwrap().len(), 3);

    weft_tests::step("a removed node's subnet is reused");
    let r = weftctl_json(&t, &["node", "remove", "n1"]);
    assert_eq!(r["released_subnet"], "10.1.0.0/26");
    assert_eq!(
        weftctl_json(&t, &["node", "add", "n4"])["subnet"],
        "10.1.0.0/26",
        "a released subnet is reused"
    );

    weft_tests::step("plan-view remaps a clashing cidr");
    let plan = weftctl_json(
        &t,
        &[
            "plan-view",
            "--workload-cidr",
            "10.1.0.0/16",
            "--external-cidr",
            "10.99.0.0/16",
        ],
    );
    assert_eq!(plan["views"][0]["remapped"], true);
    assert_eq!(plan["views"][1]["local_cidr"], "10.99.0.0/16");

    weft_tests::step("human output is a table");
    // human output is a table
    let o = run(Command::new(bin("weftctl")).args(["--controller", &t, "nodes"]));
    let text = stdout(&o);
    assert!(text.starts_with("NAME") && text.contains("10.1.200.0/24"), "{text}");

    weft_tests::step("errors give a grpc code and exit status 1");
    // errors: a gRPC code and its message, exit status 1
    let o = run(Command::new(bin("weftctl")).args(["--controller", &t, "node", "get", "ghost"]));
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("NOT_FOUND") && stderr(&o).contains("ghost"),
        "{}",
        stderr(&o)
    );
    let o = run(Command::new(bin("weftctl")).args(["--controller", "unix:/nonexistent/weft.sock", "site"]));
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("cannot reach the controller"), "{}", stderr(&o));
}

/// `weft-controller admin-cert rotate`: a new bundle in the pki directory,
/// and the old certificate gets UNAUTHENTICATED, also after a restart; the
/// server certificate is reused across that restart.
#[test]
fn a_rotated_admin_certificate_is_revoked() {
    let Some(g) = require_tool("grpcurl") else {
        return;
    };
    weft_tests::step("the old admin certificate works before the rotation");
    let (d, mut c) = controller("site-r", &["10.1.0.0/16"], &[]);
    let addr = format!("127.0.0.1:{}", c.listen_port);
    let keep = |name: &str| {
        let to = d.path().join(format!("old-{name}"));
        std::fs::copy(c.pki(name), &to).unwrap();
        to
    };
    let (old_cert, old_key) = (keep("admin.pem"), keep("admin.key"));
    let server_before = std::fs::read(c.pki("server.pem")).unwrap();
    let ca = c.pki("ca.pem");
    let call = |cert: &std::path::Path, key: &std::path::Path| {
        run(Command::new(&g)
            .arg("-cacert")
            .arg(&ca)
            .arg("-cert")
            .arg(cert)
            .arg("-key")
            .arg(key)
            .args(["-max-time", "5", &addr, "weft.v1.AdminService/GetSite"]))
    };
    assert!(call(&old_cert, &old_key).status.success());

    weft_tests::step("a rotation revokes the old certificate");
    let o = run(Command::new(bin("weft-controller"))
        .args([
            "admin-cert",
            "rotate",
            "--site-id",
            "site-r",
            "--pod-cidr",
            "10.1.0.0/16",
            "--data-dir",
        ])
        .arg(&c.data_dir));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("revoked"), "{}", stdout(&o));

    let o = call(&old_cert, &old_key);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("Unauthenticated") && stderr(&o).contains("rotated"),
        "{}",
        stderr(&o)
    );
    assert!(call(&c.pki("admin.pem"), &c.pki("admin.key")).status.success());

    weft_tests::step("a rotation over tcp is refused");
    // Over TCP with a certificate, the rotation is refused: it belongs to
    // whoever holds the controller's host.
    let o = run(Command::new(&g)
        .arg("-cacert")
        .arg(c.pki("ca.pem"))
        .arg("-cert")
        .arg(c.pki("admin.pem"))
        .arg("-key")
        .arg(c.pki("admin.key"))
        .args(["-max-time", "5", &addr, "weft.v1.AdminService/RotateAdminCert"]));
    assert!(stderr(&o).contains("PermissionDenied"), "{}", stderr(&o));

    weft_tests::step("after a restart the old certificate stays revoked and the server certificate is reused");
    c.restart();
    let addr2 = format!("127.0.0.1:{}", c.listen_port);
    assert_eq!(addr, addr2);
    let o = call(&old_cert, &old_key);
    assert!(!o.status.success() && stderr(&o).contains("rotated"), "{}", stderr(&o));
    assert_eq!(
        std::fs::read(c.pki("server.pem")).unwrap(),
        server_before,
        "a restart reuses the server certificate"
    );
}

/// A dual-stack site through the real binaries: the IPv6 pod CIDR beside
/// the IPv4 one, a /64 per node, the generated unique local remap pool kept
/// across a restart, and diagnose saying what of IPv6 is not carried yet.
#[test]
fn a_dual_stack_site_gives_each_node_a_64_and_keeps_its_generated_pool() {
    if require_tool("grpcurl").is_none() {
        return;
    }
    weft_tests::step("a controller with IPv4 and IPv6 pod CIDRs");
    let dir = tempfile::Builder::new().prefix("weft-dual").tempdir().unwrap();
    let start = || {
        ControllerSpec::new("site-6")
            .data_dir(&dir.path().join("data"))
            .flags(&[
                "--pod-cidr",
                "10.1.0.0/16,fd00:1:0:100::/56",
                "--external-cidr-v6",
                "fd00:70::/64",
            ])
            .start()
    };
    let c = start();
    let o = grpcurl_unix(&c, &["weft.v1.AdminService/GetSite"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let site: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        site["podCidrs"],
        serde_json::json!(["10.1.0.0/16", "fd00:1:0:100::/56"])
    );
    assert_eq!(site["externalCidrV6"], "fd00:70::/64");
    let pools: Vec<String> = site["remapPools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .collect();
    let generated = pools.last().unwrap().clone();
    assert_eq!(
        pools.len(),
        4,
        "three IPv4 defaults and a generated IPv6 pool: {pools:?}"
    );
    assert!(generated.starts_with("fd") && generated.ends_with("/40"), "{generated}");

    weft_tests::step("each node gets a /64 beside its IPv4 subnet");
    let t = c.target();
    let n1 = weftctl_json(&t, &["node", "add", "n1"]);
    assert_eq!(
        (n1["subnet"].as_str(), n1["subnet_v6"].as_str()),
        (Some("10.1.0.0/24"), Some("fd00:1:0:100::/64"))
    );
    let o = grpcurl_unix(&c, &["-d", r#"{"name":"n2"}"#, "--", "weft.v1.AdminService/CreateNode"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let n2: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(n2["subnetV6"], "fd00:1:0:101::/64");
    let text = stdout(&run(Command::new(bin("weftctl")).args(["--controller", &t, "nodes"])));
    assert!(text.contains("10.1.1.0/24 fd00:1:0:101::/64"), "{text}");
    assert_eq!(weftctl_json(&t, &["site"])["external_cidr_v6"], "fd00:70::/64");

    weft_tests::step("diagnose says what of IPv6 is carried and what not yet");
    let report = weft_tests::weftctl_diagnose(&t, &[]);
    let ipv6 = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == "ipv6")
        .unwrap_or_else(|| panic!("no ipv6 check: {report:#}"))
        .clone();
    assert_eq!(ipv6["result"], "PASS");
    let detail = ipv6["detail"].as_str().unwrap();
    assert!(
        detail.contains("carried through the tunnels") && detail.contains("not yet: IPv6 in transit"),
        "{ipv6}"
    );

    weft_tests::step("a restart keeps the generated pool and the nodes' /64s");
    drop(c);
    let c = start();
    let o = grpcurl_unix(&c, &["weft.v1.AdminService/GetSite"]);
    let site: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(site["remapPools"].as_array().unwrap().last().unwrap(), &generated);
    assert_eq!(
        weftctl_json(&c.target(), &["node", "get", "n1"])["subnet_v6"],
        "fd00:1:0:100::/64"
    );
}
