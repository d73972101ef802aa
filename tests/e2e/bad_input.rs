//! The bad-input battery: what real deployments and hostile clients send,
//! through the real API of a real controller. Each case gets the right
//! status code and a message that says what to fix, writes nothing, and
//! leaves the controller healthy. (Other classes live beside the feature
//! they attack: tokens raced and reused in identity.rs, CSRs for another
//! identity in identity.rs, foreign certificates in identity.rs, peers
//! claiming another site's id or unownable CIDRs in federation.rs; see
//! docs/reliability.md.)

use std::time::Instant;

use tonic::Code;
use weft_proto::v1 as pb;
use weft_proto::v1::admin_service_client::AdminServiceClient;
use weft_tests::sim::memory_and_fds;
use weft_tests::{Controller, ControllerSpec, require_tool, run, stderr, weftctl_json};

type Admin = AdminServiceClient<tonic::transport::Channel>;

async fn admin(c: &Controller) -> Admin {
    let ch = weft_common::tls::connect(&c.target(), &weft_common::tls::Trust::CaPem(String::new()), None)
        .await
        .unwrap();
    AdminServiceClient::new(ch).max_encoding_message_size(64 * 1024 * 1024)
}

/// Everything the controller holds, to prove a refusal wrote nothing.
fn state(c: &Controller) -> (serde_json::Value, serde_json::Value, serde_json::Value, usize) {
    let tokens = weftctl_json(&c.target(), &["token", "list"]);
    (
        weftctl_json(&c.target(), &["allocations"]),
        weftctl_json(&c.target(), &["nodes"]),
        weftctl_json(&c.target(), &["peerings"]),
        tokens["tokens"].as_array().map_or(0, Vec::len),
    )
}

async fn healthy(c: &Controller) {
    let ch = weft_common::tls::connect(&c.target(), &weft_common::tls::Trust::CaPem(String::new()), None)
        .await
        .unwrap();
    let mut h = tonic_health::pb::health_client::HealthClient::new(ch);
    let r = h
        .check(tonic_health::pb::HealthCheckRequest {
            service: "weft.v1.AdminService".into(),
        })
        .await
        .expect("the controller answers its health check");
    assert_eq!(r.into_inner().status, 1, "SERVING");
}

#[test]
fn each_bad_request_gets_its_code_and_a_fix_and_writes_nothing() {
    if require_tool("grpcurl").is_none() {
        return;
    }
    weft_tests::step("a controller with an empty data dir");
    let dir = tempfile::Builder::new().prefix("weft-bad").tempdir().unwrap();
    let c = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("data"))
        .flags(&["--pod-cidr", "10.1.0.0/16"])
        .start();
    let before = state(&c);
    weft_tests::step("each bad request gets its code and a fix");
    // (method, body, code, a words of the message)
    let long = "a".repeat(100);
    let huge_list: String = (0..300)
        .map(|i| format!("\"172.{}.{}.0/24\",", 16 + i / 256, i % 256))
        .collect();
    let cases: Vec<(&str, String, &str, &str)> = vec![
        // CIDRs: malformed, out of range, non-canonical, wrong family.
        (
            "CreateNode",
            r#"{"name":"n","subnet":"10.1.0.0/33"}"#.into(),
            "InvalidArgument",
            "subnet: \"10.1.0.0/33\" is not a CIDR: its prefix length \"33\" is not a number from 0 to 32",
        ),
        (
            "CreateNode",
            r#"{"name":"n","subnet":"10.1.0.0/40"}"#.into(),
            "InvalidArgument",
            "not a CIDR",
        ),
        (
            "CreateNode",
            r#"{"name":"n","subnet":"300.1.0.0/24"}"#.into(),
            "InvalidArgument",
            "not a CIDR",
        ),
        (
            "CreateNode",
            r#"{"name":"n","subnet":"10.1.0.0/0"}"#.into(),
            "InvalidArgument",
            "host bits",
        ),
        (
            "CreateNode",
            r#"{"name":"n","subnet":"0.0.0.0/0"}"#.into(),
            "InvalidArgument",
            "not inside any",
        ),
        (
            "CreateNode",
            r#"{"name":"n","subnet":"10.1.0.0/32"}"#.into(),
            "InvalidArgument",
            "no room for workloads",
        ),
        (
            "CreateNode",
            r#"{"name":"n","subnet":"10.1.00.0/24"}"#.into(),
            "InvalidArgument",
            "write 10.1.0.0/24",
        ),
        (
            "CreateNode",
            r#"{"name":"n","subnet":"fd00::/64"}"#.into(),
            "InvalidArgument",
            "IPv6",
        ),
        (
            "CreateNode",
            r#"{"name":"n","subnet":"10.1.2.3"}"#.into(),
            "InvalidArgument",
            "no prefix length",
        ),
        (
            "PlanLocalView",
            r#"{"workload_cidrs":["0.0.0.0/0"]}"#.into(),
            "InvalidArgument",
            "larger than a /8",
        ),
        (
            "PlanLocalView",
            r#"{"workload_cidrs":["127.0.0.0/8"]}"#.into(),
            "InvalidArgument",
            "no site can own",
        ),
        (
            "PlanLocalView",
            r#"{"workload_cidrs":["224.1.0.0/16"]}"#.into(),
            "InvalidArgument",
            "no site can own",
        ),
        (
            "PlanLocalView",
            r#"{"workload_cidrs":["fd00::/8"]}"#.into(),
            "InvalidArgument",
            "IPv6",
        ),
        (
            "PlanLocalView",
            r#"{"workload_cidrs":["10.9.0.0/16"],"external_cidr":"::/0"}"#.into(),
            "InvalidArgument",
            "IPv6",
        ),
        (
            "PlanLocalView",
            r#"{"workload_cidrs":["10.9.0.0/16","10.9.1.0/24"]}"#.into(),
            "InvalidArgument",
            "overlaps",
        ),
        (
            "PlanLocalView",
            format!(r#"{{"workload_cidrs":[{}"10.255.0.0/16"]}}"#, huge_list),
            "InvalidArgument",
            "at most",
        ),
        // Names: empty, path characters, too long, not ASCII.
        ("CreateNode", r#"{"name":""}"#.into(), "InvalidArgument", "empty"),
        (
            "CreateNode",
            r#"{"name":"../../etc/passwd"}"#.into(),
            "InvalidArgument",
            "not a valid name",
        ),
        (
            "CreateNode",
            r#"{"name":"a/b"}"#.into(),
            "InvalidArgument",
            "not a valid name",
        ),
        (
            "CreateNode",
            r#"{"name":"a\u0000b"}"#.into(),
            "InvalidArgument",
            "not a valid name",
        ),
        (
            "CreateNode",
            r#"{"name":"nöde"}"#.into(),
            "InvalidArgument",
            "not a valid name",
        ),
        (
            "CreateNode",
            format!(r#"{{"name":"{long}"}}"#),
            "InvalidArgument",
            "1 to 63",
        ),
        (
            "CreateToken",
            r#"{"role":"AGENT_ROLE_NODE","name":"x/y"}"#.into(),
            "InvalidArgument",
            "name",
        ),
        (
            "DeleteNode",
            r#"{"name":"../x"}"#.into(),
            "InvalidArgument",
            "not a valid name",
        ),
        // Unknown and missing enum values, bad durations and counts.
        (
            "CreateToken",
            r#"{"role":99}"#.into(),
            "InvalidArgument",
            "AGENT_ROLE_NODE or AGENT_ROLE_GATEWAY",
        ),
        (
            "CreateToken",
            r#"{}"#.into(),
            "InvalidArgument",
            "AGENT_ROLE_NODE or AGENT_ROLE_GATEWAY",
        ),
        (
            "CreateToken",
            r#"{"role":"AGENT_ROLE_NODE","uses":4000000000}"#.into(),
            "InvalidArgument",
            "uses",
        ),
        (
            "CreatePeeringToken",
            r#"{"ttl_seconds":999999999}"#.into(),
            "InvalidArgument",
            "ttl",
        ),
        // Tokens that are not tokens.
        ("CreatePeering", r#"{"token":""}"#.into(), "InvalidArgument", "weftp1"),
        (
            "CreatePeering",
            r#"{"token":"weftp1.%%%"}"#.into(),
            "InvalidArgument",
            "not base64",
        ),
        (
            "CreatePeering",
            r#"{"token":"weftp1.e30"}"#.into(),
            "InvalidArgument",
            "unreadable",
        ),
        ("DeletePeering", r#"{"site_id":"nobody"}"#.into(), "NotFound", "nobody"),
    ];
    let g = require_tool("grpcurl").unwrap();
    let sock = c.socket.display().to_string();
    for (method, full_body, code, needle) in &cases {
        let body = &full_body.chars().take(120).collect::<String>();
        let o = run(std::process::Command::new(&g)
            .args(["-plaintext", "-unix", "-d", full_body, &sock])
            .arg(format!("weft.v1.AdminService/{method}")));
        assert!(!o.status.success(), "{method} {body}: accepted");
        let err = stderr(&o);
        assert!(
            err.contains(&format!("Code: {code}")),
            "{method} {body}: wrong code: {err}"
        );
        assert!(err.contains(needle), "{method} {body}: expected {needle:?} in {err}");
    }
    weft_tests::step("the refused calls wrote nothing");
    assert_eq!(state(&c), before, "a refused call wrote something");

    weft_tests::step("oversized messages and 10,000 bogus peerings are refused");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut a = admin(&c).await;
        // A message over the 4 MiB limit, and a 1 MiB name under it.
        let e = a
            .create_node(pb::CreateNodeRequest {
                name: "x".repeat(5 * 1024 * 1024),
                subnet: String::new(),
            })
            .await
            .unwrap_err();
        assert!(matches!(e.code(), Code::OutOfRange | Code::ResourceExhausted), "{e:?}");
        assert!(
            e.message().contains("message length") || e.message().contains("too large"),
            "{e:?}"
        );
        let e = a
            .create_node(pb::CreateNodeRequest {
                name: "x".repeat(1024 * 1024),
                subnet: String::new(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(
            e.message().len() < 400,
            "the message echoes the whole name: {} bytes",
            e.message().len()
        );
        let e = a
            .create_node(pb::CreateNodeRequest {
                name: "n".into(),
                subnet: "1".repeat(1024 * 1024),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(
            e.message().contains("bytes)") && e.message().len() < 400,
            "{}",
            e.message()
        );

        // 10,000 peerings requested, 64 at a time, with tokens that are not
        // (9,000 malformed; 1,000 well-formed but for a site that is not
        // there, so the controller dials a closed port each time).
        let pid = c.pid();
        let rss_before = memory_and_fds(pid).0;
        let forged = PeeringTokenFor::closed_port();
        let started = Instant::now();
        let results: Vec<(usize, Code, String)> = futures::stream::iter(0..10_000)
            .map(|i| {
                let mut a = a.clone();
                let token = if i % 10 == 0 {
                    forged.clone()
                } else {
                    format!("weftp1.{i}")
                };
                async move {
                    match a
                        .create_peering(pb::CreatePeeringRequest { token, transit: false })
                        .await
                    {
                        Ok(_) => (i, Code::Ok, String::new()),
                        Err(e) => (i, e.code(), e.message().to_string()),
                    }
                }
            })
            .buffer_unordered(64)
            .collect()
            .await;
        let took = started.elapsed();
        assert!(!results.iter().any(|r| r.1 == Code::Ok), "a bogus peering was created");
        for (i, code, msg) in &results {
            if i % 10 == 0 {
                // The forged site's controller is not there: said so, as
                // something to retry (nothing about the request is wrong).
                assert!(
                    *code == Code::Unavailable && msg.contains("127.0.0.1") && msg.contains("retry"),
                    "{code:?}: {msg}"
                );
            } else {
                assert!(
                    *code == Code::InvalidArgument && msg.contains("weftctl peering token"),
                    "{code:?}: {msg}"
                );
            }
        }
        println!(
            "a forged token's answer: {:?}",
            results.iter().find(|r| r.0 == 0).unwrap()
        );
        let rss_after = memory_and_fds(pid).0;
        println!(
            "10,000 refused CreatePeering calls in {:.1} s; controller RSS {:.1} → {:.1} MiB",
            took.as_secs_f64(),
            rss_before,
            rss_after
        );
        assert!(
            rss_after < rss_before + 64.0,
            "memory grew by {:.1} MiB",
            rss_after - rss_before
        );
        healthy(&c).await;
    });
    weft_tests::step("the flood wrote nothing and normal work is still served");
    assert_eq!(state(&c), before, "the flood wrote something");
    // Still serving normal work.
    weftctl_json(&c.target(), &["node", "add", "n1"]);
}

/// A well-formed peering token for a site on a closed loopback port.
struct PeeringTokenFor;

impl PeeringTokenFor {
    fn closed_port() -> String {
        let port = weft_tests::free_port();
        weft_controller::federation::PeeringToken {
            site: "ghost".into(),
            endpoints: vec![format!("127.0.0.1:{port}")],
            fp: "ab".repeat(32),
            id: "0123456789ab".into(),
            secret: "0".repeat(32),
            exp: u64::MAX / 2,
        }
        .encode()
    }
}

use futures::StreamExt;
