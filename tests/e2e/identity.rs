//! Identity and trust: a controller on loopback, and every client a real
//! mutual-TLS gRPC client with a different certificate. Each refusal must carry the right code and
//! message and write nothing.

use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
use tonic::transport::Channel;
use tonic::{Code, Status};
use weft_controller::pki::SiteCa;
use weft_proto::v1 as pb;
use weft_proto::v1::admin_service_client::AdminServiceClient;
use weft_proto::v1::agent_service_client::AgentServiceClient;
use weft_tests::{Controller, ControllerSpec};

fn refused<T: std::fmt::Debug>(r: Result<T, Status>, code: Code, needle: &str) {
    let s = r.expect_err("the call must be refused");
    assert_eq!(s.code(), code, "{s:?}");
    assert!(s.message().contains(needle), "expected {needle:?} in {:?}", s.message());
}

/// A CA that is not the site's, and an admin-looking certificate from it.
fn foreign_admin() -> (String, String) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let issuer = Issuer::from_params(&ca, &ca_key);
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.subject_alt_names
        .push(SanType::URI("weft://site-a/admin/admin".try_into().unwrap()));
    (p.signed_by(&key, &issuer).unwrap().pem(), key.serialize_pem())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_matrix() {
    weft_tests::step("a controller with a valid admin certificate");
    let c = ControllerSpec::new("site-a").pod("10.1.0.0/16").start();
    let list = |ch: Channel| async move { AdminServiceClient::new(ch).list_nodes(pb::ListNodesRequest {}).await };

    // valid admin certificate
    assert!(
        list(
            c.channel(Some((&c.pki_pem("admin.pem"), &c.pki_pem("admin.key"))))
                .await
        )
        .await
        .is_ok()
    );

    weft_tests::step("two enrolled nodes get their assignments");
    // two enrolled nodes
    let (n1_cert, n1_key) = c.register(&c.token("n1", 600, 1).await, "n1").await.unwrap();
    let (n2_cert, n2_key) = c.register(&c.token("n2", 600, 1).await, "n2").await.unwrap();
    let mut n1 = AgentServiceClient::new(c.channel(Some((&n1_cert, &n1_key))).await);
    let a = n1
        .get_assignment(pb::GetAssignmentRequest { name: "n1".into() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((a.name.as_str(), a.subnet.as_str()), ("n1", "10.1.0.0/24"));
    let mut n2 = AgentServiceClient::new(c.channel(Some((&n2_cert, &n2_key))).await);
    assert!(
        n2.get_assignment(pb::GetAssignmentRequest { name: "n2".into() })
            .await
            .is_ok()
    );

    weft_tests::step("a revoked node; missing, foreign, expired and other-site certificates refused");
    // revoke n2 through the admin API
    c.admin()
        .await
        .delete_node(pb::DeleteNodeRequest { name: "n2".into() })
        .await
        .unwrap();
    let before = c.revision().await;

    refused(
        list(c.channel(None).await).await,
        Code::Unauthenticated,
        "needs a client certificate",
    );
    let (fc, fk) = foreign_admin();
    refused(
        list(c.channel(Some((&fc, &fk))).await).await,
        Code::Unauthenticated,
        "not issued by a CA this site trusts",
    );
    let ca = SiteCa::load(&c.data_dir.join("pki")).unwrap();
    let (ec, ek) = ca
        .issue_with_key("weft://site-a/admin/old", "expired admin", -1)
        .unwrap();
    refused(
        list(c.channel(Some((&ec, &ek))).await).await,
        Code::Unauthenticated,
        "expired",
    );
    let (oc, ok) = ca.issue_with_key("weft://site-b/admin/admin", "other site", 1).unwrap();
    refused(
        list(c.channel(Some((&oc, &ok))).await).await,
        Code::Unauthenticated,
        "site-b",
    );

    weft_tests::step("the revoked node is refused on its open connection");
    // the revoked node, on the connection it already had open
    refused(
        n2.get_assignment(pb::GetAssignmentRequest { name: "n2".into() }).await,
        Code::Unauthenticated,
        "revoked",
    );
    refused(
        n2.renew(pb::RenewRequest { csr_pem: "x".into() }).await,
        Code::Unauthenticated,
        "revoked",
    );

    weft_tests::step("nodes, admins and CSRs stay within their identity");
    // a node calling the admin API, or reading another node's state
    let mut n1_admin = AdminServiceClient::new(c.channel(Some((&n1_cert, &n1_key))).await);
    refused(
        n1_admin.list_nodes(pb::ListNodesRequest {}).await,
        Code::PermissionDenied,
        "node \"n1\" may not use the admin API",
    );
    refused(
        n1_admin
            .create_node(pb::CreateNodeRequest {
                name: "evil".into(),
                subnet: String::new(),
            })
            .await,
        Code::PermissionDenied,
        "admin API",
    );
    refused(
        n1.get_assignment(pb::GetAssignmentRequest { name: "n2".into() }).await,
        Code::PermissionDenied,
        "own",
    );
    // an admin is not an agent
    let mut admin_as_agent = AgentServiceClient::new(
        c.channel(Some((&c.pki_pem("admin.pem"), &c.pki_pem("admin.key"))))
            .await,
    );
    refused(
        admin_as_agent
            .get_assignment(pb::GetAssignmentRequest { name: "n1".into() })
            .await,
        Code::PermissionDenied,
        "not an agent",
    );
    // a CSR asking for another identity
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.subject_alt_names
        .push(SanType::URI("weft://site-a/admin/admin".try_into().unwrap()));
    let csr = p.serialize_request(&key).unwrap().pem().unwrap();
    refused(
        n1.renew(pb::RenewRequest { csr_pem: csr }).await,
        Code::InvalidArgument,
        "weft://site-a/admin/admin",
    );

    weft_tests::step("the refused calls wrote nothing");
    assert_eq!(c.revision().await, before, "refused calls wrote nothing");

    weft_tests::step("renewal works for the live node");
    // renewal works for the live node, and the old certificate stays usable until it expires
    let (key, csr) = weft_agent::identity::key_and_csr("n1").unwrap();
    let renewed = n1.renew(pb::RenewRequest { csr_pem: csr }).await.unwrap().into_inner();
    let mut n1b = AgentServiceClient::new(c.channel(Some((&renewed.certificate_pem, &key.serialize_pem()))).await);
    assert!(
        n1b.get_assignment(pb::GetAssignmentRequest { name: "n1".into() })
            .await
            .is_ok()
    );
    assert!(
        n1.get_assignment(pb::GetAssignmentRequest { name: "n1".into() })
            .await
            .is_ok()
    );
    c.shut_down();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_single_use_expire_and_are_never_stored_in_clear() {
    weft_tests::step("a controller up");
    let c = ControllerSpec::new("site-a").pod("10.1.0.0/16").start();
    let mut secrets = Vec::new();

    weft_tests::step("a single-use token enrolls once");
    let one = c.token("", 600, 1).await;
    secrets.push(one.clone());
    c.register(&one, "a1").await.unwrap();
    refused(c.register(&one, "a2").await, Code::Unauthenticated, "unknown");

    weft_tests::step("expired and deleted tokens are refused");
    let short = c.token("", 1, 1).await;
    secrets.push(short.clone());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    refused(c.register(&short, "a3").await, Code::Unauthenticated, "expired");

    let deleted = c.token("", 600, 1).await;
    secrets.push(deleted.clone());
    let id = deleted.split('.').nth(1).unwrap().to_string();
    c.admin()
        .await
        .delete_token(pb::DeleteTokenRequest { id: id.clone() })
        .await
        .unwrap();
    refused(c.register(&deleted, "a4").await, Code::Unauthenticated, "unknown");
    refused(
        c.admin().await.delete_token(pb::DeleteTokenRequest { id }).await,
        Code::NotFound,
        "no token",
    );

    weft_tests::step("malformed and forged tokens are refused");
    refused(
        c.register("weft1.nothex.nothex", "a5").await,
        Code::InvalidArgument,
        "malformed",
    );
    let good = c.token("", 600, 1).await;
    secrets.push(good.clone());
    let forged = format!("{}{}", &good[..good.len() - 4], "0000");
    refused(c.register(&forged, "a6").await, Code::Unauthenticated, "not valid");

    weft_tests::step("two agents racing for one token: exactly one enrolls");
    // two agents racing for one single-use token: exactly one enrolls
    let race = c.token("", 600, 1).await;
    secrets.push(race.clone());
    let (x, y) = tokio::join!(c.register(&race, "r1"), c.register(&race, "r2"));
    assert!(x.is_ok() != y.is_ok(), "exactly one registration wins: {x:?} {y:?}");

    weft_tests::step("a name held by a live agent is refused until removed");
    // a name held by a live agent is refused until the admin removes it
    let again = c.token("", 600, 2).await;
    secrets.push(again.clone());
    refused(
        c.register(&again, "a1").await,
        Code::AlreadyExists,
        "weftctl node remove a1",
    );
    c.admin()
        .await
        .delete_node(pb::DeleteNodeRequest { name: "a1".into() })
        .await
        .unwrap();
    c.register(&again, "a1").await.unwrap();

    weft_tests::step("a multi-use token counts down");
    // a multi-use token counts down
    let multi = c.token("", 600, 3).await;
    secrets.push(multi.clone());
    c.register(&multi, "m1").await.unwrap();
    let listed = c
        .admin()
        .await
        .list_tokens(pb::ListTokensRequest {})
        .await
        .unwrap()
        .into_inner();
    let m = listed.tokens.iter().find(|t| multi.contains(&t.id)).unwrap();
    assert_eq!(m.uses_left, 2);

    weft_tests::step("nothing in the store holds a token secret");
    // nothing in the store holds a token secret
    let path = c.data_dir.join("store.redb");
    let _data = c.shut_down();
    // The store is free once the controller has ended.
    let mut tries = 0;
    let store = loop {
        match weft_controller::store::embedded::EmbeddedStore::open(&path) {
            Ok(s) => break s,
            Err(e) if tries < 100 => {
                tries += 1;
                let _ = e;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{e}"),
        }
    };
    let all = weft_controller::store::Store::get_prefix(&store, "").await.unwrap();
    assert!(
        all.kvs.iter().any(|kv| kv.key.contains("/tokens/")),
        "tokens are stored"
    );
    for t in &secrets {
        let secret = t.rsplit('.').next().unwrap();
        for kv in &all.kvs {
            assert!(
                !kv.key.contains(secret) && !String::from_utf8_lossy(&kv.value).contains(secret),
                "{} leaks a secret",
                kv.key
            );
        }
    }
}

/// A stolen certificate renewed over and over cannot make its agent
/// unremovable: each renewal replaces (and revokes) the one before, so the
/// record never holds more than two, and removal revokes them all, on
/// both stores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_renewals_then_removal_revokes_on_both_stores() {
    let etcd = weft_tests::Etcd::start();
    let mut stores = vec![vec![]];
    if let Some(e) = &etcd {
        stores.push(vec![("etcd_endpoints", e.endpoint())]);
    }
    for extra in stores {
        let mut spec = ControllerSpec::new("site-a").pod("10.1.0.0/16");
        if let Some((_, endpoint)) = extra.first() {
            spec = spec.etcd(endpoint);
        }
        let c = spec.start();
        let t = c.token("n1", 600, 1).await;
        let (cert, key) = c.register(&t, "n1").await.unwrap();
        let mut stolen = AgentServiceClient::new(c.channel(Some((&cert, &key))).await);
        let mut issued = Vec::new();
        for _ in 0..200 {
            let (k, csr) = weft_agent::identity::key_and_csr("n1").unwrap();
            let r = stolen
                .renew(pb::RenewRequest { csr_pem: csr })
                .await
                .unwrap()
                .into_inner();
            issued.push((r.certificate_pem, k.serialize_pem()));
        }
        let use_of = |(cert, key): (String, String)| {
            let c = &c;
            async move {
                let mut a = AgentServiceClient::new(c.channel(Some((&cert, &key))).await);
                a.get_assignment(pb::GetAssignmentRequest { name: "n1".into() }).await
            }
        };
        // The newest one works. (The first renewal's certificate was
        // replaced, so revoked: a call from it now would be a second
        // holder's, which revokes the whole identity; it is tried after
        // the removal.)
        let first = issued[0].clone();
        let newest = issued[199].clone();
        assert!(use_of(newest.clone()).await.is_ok());
        c.admin()
            .await
            .delete_node(pb::DeleteNodeRequest { name: "n1".into() })
            .await
            .expect("removal succeeds after 200 renewals");
        for creds in [(cert.clone(), key.clone()), newest, first] {
            for _ in 0..100 {
                if use_of(creds.clone()).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            refused(use_of(creds).await, Code::Unauthenticated, "revoked");
        }
        c.shut_down();
    }
}

/// A token that does not name its node can only make a new node of a
/// node's size: it cannot take over an existing node (one whose agent's
/// certificates expired, say) or reserve a large block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unnamed_token_cannot_take_over_a_node_or_reserve_a_large_block() {
    let c = ControllerSpec::new("site-a").pod("10.1.0.0/16").start();
    c.admin()
        .await
        .create_node(pb::CreateNodeRequest {
            name: "n9".into(),
            subnet: String::new(),
        })
        .await
        .unwrap();
    let unnamed = c.token("", 600, 5).await;
    let before = c.revision().await;
    refused(
        c.register(&unnamed, "n9").await,
        Code::AlreadyExists,
        "token made for it",
    );
    let (_, csr) = weft_agent::identity::key_and_csr("big").unwrap();
    refused(
        AgentServiceClient::new(c.channel(None).await)
            .register(pb::RegisterRequest {
                token: unnamed.clone(),
                csr_pem: csr,
                name: "big".into(),
                subnet: "10.1.0.0/17".into(),
                underlay_ip: String::new(),
            })
            .await,
        Code::InvalidArgument,
        "larger than a node's /24",
    );
    assert_eq!(c.revision().await, before, "refused enrollments wrote nothing");
    // A token made for n9 enrolls it; an unnamed one makes a new node.
    let named = c.token("n9", 600, 1).await;
    c.register(&named, "n9").await.unwrap();
    c.register(&unnamed, "n10").await.unwrap();
    c.shut_down();
}

/// Two node names that hash alike would share one link on every gateway:
/// whoever holds a token that does not fix the name could pick one to take
/// another node's link and its traffic. The second is refused, naming the
/// field, both through the admin API and at enrollment. (The names were
/// found by a birthday search over the 36-bit link tag.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_name_that_hashes_like_another_nodes_is_refused() {
    let c = ControllerSpec::new("site-a").pod("10.1.0.0/16").start();
    c.admin()
        .await
        .create_node(pb::CreateNodeRequest {
            name: "n143693".into(),
            subnet: String::new(),
        })
        .await
        .unwrap();
    let before = c.revision().await;
    refused(
        c.admin()
            .await
            .create_node(pb::CreateNodeRequest {
                name: "n492983".into(),
                subnet: String::new(),
            })
            .await,
        Code::InvalidArgument,
        "name: node \"n492983\" would use the gateways' link",
    );
    let unnamed = c.token("", 600, 1).await;
    let before_register = c.revision().await;
    refused(
        c.register(&unnamed, "n492983").await,
        Code::InvalidArgument,
        "which node \"n143693\" uses",
    );
    assert_eq!(
        c.revision().await,
        before_register,
        "a refused enrollment wrote something"
    );
    assert!(before_register > before, "the token was made");
    // The token was not spent: another name enrolls with it.
    c.register(&unnamed, "n3").await.unwrap();
    c.shut_down();
}

/// A record whose name hashes like an older one's, written past the checks
/// of enrollment and Join (two replicas at once, a restored backup), is not
/// rendered: the gateway keeps the older node's link and the older
/// peering's namespace, the newer node gets nothing, and `diagnose` names
/// each with the command that ends it. Once the older node is gone, the
/// newer one takes the link. (Both pairs are the birthday pairs of the
/// tests above; the records go straight into etcd, as a racing replica's
/// would.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_whose_name_hashes_like_an_older_ones_is_not_rendered_and_diagnose_names_it() {
    use weft_proto::v1::watch_response::Kind;
    weft_tests::step("a controller on etcd with a gateway and a node");
    let Some(etcd) = weft_tests::Etcd::start() else { return };
    let endpoint = etcd.endpoint();
    let c = ControllerSpec::new("site-a").pod("10.1.0.0/16").etcd(&endpoint).start();
    let etcdctl = |args: &[&str]| {
        let out = std::process::Command::new("etcdctl")
            .args(["--endpoints", &endpoint])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "etcdctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let t = c.token_for(pb::AgentRole::Gateway, "gw", 600, 1).await;
    let (gc, gk) = c.register_at(&t, "gw", "192.168.1.100").await.unwrap();
    let t = c.token_for(pb::AgentRole::Node, "n143693", 600, 1).await;
    let (nc, nk) = c.register_at(&t, "n143693", "192.168.1.1").await.unwrap();
    weft_tests::step("a node and a peering written by hand whose names hash like older ones");
    let older: serde_json::Value = serde_json::from_str(&etcdctl(&[
        "get",
        "--print-value-only",
        "/weft/sites/site-a/nodes/n143693",
    ]))
    .unwrap();
    let mut newer = older.clone();
    let ip: std::net::Ipv4Addr = older["internal_ip"].as_str().unwrap().parse().unwrap();
    newer["name"] = "n492983".into();
    newer["subnet"] = "10.1.77.0/24".into();
    newer["internal_ip"] = std::net::Ipv4Addr::from(u32::from(ip) + 50).to_string().into();
    newer["underlay_ip"] = "192.168.1.2".into();
    newer["created_at_ms"] = (older["created_at_ms"].as_u64().unwrap() + 1).into();
    newer["certs"] = serde_json::json!([]);
    etcdctl(&["put", "/weft/sites/site-a/nodes/n492983", &newer.to_string()]);
    // Two peerings, the newer one written first.
    for (id, at, cidr, port) in [
        ("site-74386", 2_000, "10.51.0.0/16", 51830),
        ("site-34359", 1_000, "10.50.0.0/16", 51831),
    ] {
        let record = serde_json::json!({
            "site_id": id,
            "state": "negotiated",
            "views": [{"kind": "workload", "real": cidr, "local": cidr, "pool": null}],
            "created_at_ms": at,
            "listen_port": port,
        });
        etcdctl(&["put", &format!("/weft/sites/site-a/peerings/{id}"), &record.to_string()]);
    }

    weft_tests::step("the older records are rendered, the newer not");
    // What each agent is sent: a fresh Watch's snapshot.
    let desired = |creds: (String, String)| {
        let c = &c;
        async move {
            let mut a = AgentServiceClient::new(c.channel(Some((&creds.0, &creds.1))).await);
            let mut s = a.watch(pb::WatchRequest::default()).await.unwrap().into_inner();
            let m = tokio::time::timeout(Duration::from_secs(5), s.message())
                .await
                .expect("no snapshot within 5 s")
                .unwrap()
                .unwrap();
            let Some(Kind::Snapshot(snap)) = m.kind else {
                panic!("{m:?}")
            };
            snap.objects.into_iter().map(|o| o.id).collect::<Vec<String>>()
        }
    };
    let has = |ids: &[String], prefix: &str| ids.iter().any(|i| i.starts_with(prefix));
    let mut gw = Vec::new();
    for _ in 0..50 {
        gw = desired((gc.clone(), gk.clone())).await;
        if has(&gw, "peer/site-34359/") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(has(&gw, "node/n143693/") && has(&gw, "peer/site-34359/"), "{gw:?}");
    assert!(
        !has(&gw, "node/n492983/"),
        "the newer node took the older one's link: {gw:?}"
    );
    assert!(!has(&gw, "peer/site-74386/"), "the newer peering was rendered: {gw:?}");
    let node = desired((nc.clone(), nk.clone())).await;
    assert!(
        has(&node, "peer/site-34359/") && !has(&node, "peer/site-74386/"),
        "{node:?}"
    );

    weft_tests::step("diagnose names the collisions");
    let checks = c
        .admin()
        .await
        .diagnose(pb::DiagnoseRequest { settle_millis: 1 })
        .await
        .unwrap()
        .into_inner()
        .checks;
    let found = |subject: &str, needles: &[&str]| {
        let check = checks
            .iter()
            .find(|k| k.check == "name-collision" && k.subject == subject)
            .unwrap_or_else(|| panic!("no name-collision check on {subject}: {checks:?}"));
        assert_eq!(check.result, pb::CheckResult::Fail as i32);
        let text = format!("{} {}", check.detail, check.hint);
        for n in needles {
            assert!(text.contains(n), "{n:?} not in {text:?}");
        }
    };
    let link = weft_controller::render::gateway_link_name("n143693");
    found(
        "node/n492983",
        &[
            "node \"n492983\" is not rendered",
            &link,
            "node \"n143693\"",
            "weftctl node remove n492983",
        ],
    );
    found(
        "peering/site-74386",
        &[
            "the peering with \"site-74386\"",
            "\"site-34359\"",
            "weftctl peering delete site-74386",
        ],
    );
    assert!(
        !checks
            .iter()
            .any(|k| k.check == "name-collision" && (k.subject == "node/n143693" || k.subject == "peering/site-34359")),
        "{checks:?}"
    );

    weft_tests::step("the older node goes: the newer takes the link");
    // The older node goes: the newer takes the link.
    c.admin()
        .await
        .delete_node(pb::DeleteNodeRequest { name: "n143693".into() })
        .await
        .unwrap();
    let mut gw = Vec::new();
    for _ in 0..50 {
        gw = desired((gc.clone(), gk.clone())).await;
        if has(&gw, "node/n492983/") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(has(&gw, "node/n492983/") && !has(&gw, "node/n143693/"), "{gw:?}");
    c.shut_down();
}

/// Renews with `creds`; the new certificate and its key.
async fn renew(c: &Controller, creds: &(String, String), name: &str) -> Result<(String, String), Status> {
    let (k, csr) = weft_agent::identity::key_and_csr(name).unwrap();
    let mut a = AgentServiceClient::new(c.channel(Some((&creds.0, &creds.1))).await);
    a.renew(pb::RenewRequest { csr_pem: csr })
        .await
        .map(|r| (r.into_inner().certificate_pem, k.serialize_pem()))
}

/// A gateway's key and certificate copied to a second host: neither holder
/// quietly evicts the other. A renewal retried from the old certificate
/// (its answer was lost) still works, however late, since the certificate
/// it missed was never used; but a renewal from an older certificate after
/// a newer one was used means two holders: every certificate of the name
/// is revoked, the conflict is recorded, and the admin sees it in
/// `gateways` and `diagnose`. A new token clears it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copied_identity_is_revoked_whole_once_both_holders_renew_and_the_admin_is_told() {
    weft_tests::step("a gateway enrolls and retries a lost renewal late");
    let c = ControllerSpec::new("site-a")
        .pod("10.1.0.0/16")
        .flag("--agent-cert-ttl", "10s")
        .start();
    let t = c.token_for(pb::AgentRole::Gateway, "gw", 600, 1).await;
    let first = c.register(&t, "gw").await.unwrap();
    // The answer to a renewal is lost; the agent retries with the same
    // certificate, late, and goes on with the second answer.
    let _lost = renew(&c, &first, "gw").await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let real = renew(&c, &first, "gw").await.expect("a retry is a retry");
    let use_of = |creds: (String, String)| {
        let c = &c;
        async move {
            let mut a = AgentServiceClient::new(c.channel(Some((&creds.0, &creds.1))).await);
            a.update_gateway(pb::UpdateGatewayRequest {
                public_key: String::new(),
                endpoint: "192.0.2.1:51820".into(),
            })
            .await
        }
    };
    use_of(real.clone()).await.unwrap();
    weft_tests::step("a thief renews from a copy and uses its certificate");
    // A thief has copied the current key and certificate, renews, and
    // uses its new certificate.
    let thief = renew(&c, &real, "gw").await.unwrap();
    use_of(thief.clone()).await.unwrap();
    weft_tests::step("the real host's renewal revokes every certificate of the name");
    // The real host renews from what it holds, now older than one in use.
    refused(
        renew(&c, &real, "gw").await,
        Code::Unauthenticated,
        "another host holds this identity",
    );
    for creds in [thief, real] {
        for _ in 0..100 {
            if use_of(creds.clone()).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        refused(use_of(creds).await, Code::Unauthenticated, "revoked");
    }
    weft_tests::step("the admin sees the conflict in gateways and diagnose");
    let gateways = || async {
        c.admin()
            .await
            .list_gateways(pb::ListGatewaysRequest {})
            .await
            .unwrap()
            .into_inner()
            .gateways
    };
    let g = gateways().await;
    assert!(g[0].identity_conflict.contains("two hosts hold this identity"), "{g:?}");
    let d = c
        .admin()
        .await
        .diagnose(pb::DiagnoseRequest { settle_millis: 0 })
        .await
        .unwrap()
        .into_inner();
    assert!(
        d.checks.iter().any(|k| k.subject == "gateway/gw"
            && k.result == pb::CheckResult::Fail as i32
            && k.detail.contains("two hosts")),
        "{d:?}"
    );
    weft_tests::step("enrolling the real host again makes the identity whole");
    // The admin enrolls the real host again: the identity is whole.
    let t = c.token_for(pb::AgentRole::Gateway, "gw", 600, 1).await;
    let again = c.register(&t, "gw").await.unwrap();
    assert!(gateways().await[0].identity_conflict.is_empty());
    assert!(use_of(again).await.is_ok());
}

/// A thief who copied the current certificate renews twice, quietly, so
/// that the second renewal replaces (and revokes) the real agent's: the
/// real agent's next call, from a certificate a renewal replaced without
/// it, revokes the whole identity and tells the admin, and ends the
/// thief's open Watch stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thief_renewing_twice_from_a_copy_is_found_at_the_real_agents_next_call() {
    weft_tests::step("a node enrolls and reports");
    let c = ControllerSpec::new("site-a")
        .pod("10.1.0.0/16")
        .flag("--agent-cert-ttl", "60s")
        .start();
    let t = c.token_for(pb::AgentRole::Node, "n1", 600, 1).await;
    let real = c.register(&t, "n1").await.unwrap();
    let client = |creds: &(String, String)| {
        let c = &c;
        let creds = creds.clone();
        async move { AgentServiceClient::new(c.channel(Some((&creds.0, &creds.1))).await) }
    };
    let report = |creds: (String, String)| {
        let client = &client;
        async move { client(&creds).await.report(pb::ReportRequest::default()).await }
    };
    report(real.clone()).await.unwrap();
    weft_tests::step("a thief renews twice from a copy and watches");
    let once = renew(&c, &real, "n1").await.unwrap();
    let twice = renew(&c, &once, "n1").await.unwrap();
    let mut stream = client(&twice)
        .await
        .watch(pb::WatchRequest::default())
        .await
        .unwrap()
        .into_inner();
    stream.message().await.unwrap().expect("the thief's first state");
    weft_tests::step("the real agent's next heartbeat revokes the identity");
    // The real agent's next heartbeat.
    refused(
        report(real.clone()).await,
        Code::Unauthenticated,
        "another host holds this identity",
    );
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => return None,
                Err(s) => return Some(s),
            }
        }
    })
    .await
    .expect("the thief's stream ended");
    let s = ended.expect("ended with a status");
    assert_eq!(s.code(), Code::Unauthenticated, "{s:?}");
    assert!(!s.metadata().contains_key(weft_proto::REMOVED), "{s:?}");
    weft_tests::step("the thief's certificate is revoked and the admin is told");
    // (Each replica's revocation list follows the store.)
    for _ in 0..100 {
        if report(twice.clone()).await.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    refused(report(twice).await, Code::Unauthenticated, "revoked");
    let nodes = c
        .admin()
        .await
        .list_nodes(pb::ListNodesRequest {})
        .await
        .unwrap()
        .into_inner()
        .nodes;
    assert!(
        nodes[0].identity_conflict.contains("two hosts hold this identity"),
        "{nodes:?}"
    );
    weft_tests::step("a re-enrolled agent is untouched by an old copy");
    // The admin enrolls the real host again. A copy of a certificate from
    // before that enrollment is refused, and is no verdict on the new one
    // (else an old copy could revoke the re-enrolled agent at will).
    let t = c.token_for(pb::AgentRole::Node, "n1", 600, 1).await;
    let again = c.register(&t, "n1").await.unwrap();
    refused(report(real).await, Code::Unauthenticated, "revoked");
    tokio::time::sleep(Duration::from_millis(500)).await;
    report(again).await.expect("the re-enrolled agent is untouched");
}
