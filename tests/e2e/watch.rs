//! The desired-state protocol: snapshot then deltas, resume from a revision
//! with exactly the difference, snapshot fallback, coalescing for an agent
//! that stopped reading (while others keep getting theirs), and an agent
//! that keeps and re-applies its last state without its controller.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use tonic::Streaming;
use weft_proto::v1 as pb;
use weft_proto::v1::admin_service_client::AdminServiceClient;
use weft_proto::v1::agent_service_client::AgentServiceClient;
use weft_proto::v1::watch_response::Kind;

use weft_tests::{Controller, ControllerSpec, Proc, bin, eventually, weftctl_json};

type Held = BTreeMap<String, pb::DesiredObject>;

/// Enrolls an agent and returns a client with its certificate.
async fn enroll(
    c: &Controller,
    role: pb::AgentRole,
    name: &str,
    underlay: &str,
    window: Option<u32>,
) -> AgentServiceClient<tonic::transport::Channel> {
    let token = c.token_for(role, name, 600, 1).await;
    let (cert, key) = c.register_at(&token, name, underlay).await.unwrap();
    AgentServiceClient::new(c.channel_with(Some((&cert, &key)), window).await)
}

async fn next(s: &mut Streaming<pb::WatchResponse>) -> pb::WatchResponse {
    tokio::time::timeout(Duration::from_secs(5), s.message())
        .await
        .expect("no message within 5 s")
        .unwrap()
        .unwrap()
}

fn apply(held: &mut Held, m: &pb::WatchResponse) {
    match m.kind.as_ref().unwrap() {
        Kind::Snapshot(s) => *held = s.objects.iter().map(|o| (o.id.clone(), o.clone())).collect(),
        Kind::Delta(d) => {
            for id in &d.deletes {
                held.remove(id);
            }
            for o in &d.upserts {
                held.insert(o.id.clone(), o.clone());
            }
        }
    }
}

fn known(held: &Held) -> Vec<pb::ObjectVersion> {
    held.values()
        .map(|o| pb::ObjectVersion {
            id: o.id.clone(),
            hash: weft_proto::object_hash(o),
        })
        .collect()
}

fn remote_of(held: &Held) -> String {
    match &held["self/link"].kind {
        Some(pb::desired_object::Kind::Link(l)) => match &l.kind {
            Some(pb::link::Kind::Vxlan(v)) => v.remote.clone(),
            _ => panic!("not vxlan"),
        },
        _ => panic!("not a link"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_then_deltas_then_resume_with_the_difference() {
    weft_tests::step("a fresh agent gets a snapshot");
    let c = ControllerSpec::new("site-a").pod("10.1.0.0/16").start();
    let mut n1 = enroll(&c, pb::AgentRole::Node, "n1", "192.168.1.1", None).await;
    let mut held = Held::new();
    let mut s = n1
        .watch(pb::WatchRequest {
            last_revision: 0,
            known: vec![],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let first = next(&mut s).await;
    assert!(
        matches!(first.kind, Some(Kind::Snapshot(_))),
        "a fresh agent gets a snapshot"
    );
    apply(&mut held, &first);
    assert!(held.is_empty(), "no gateway yet: nothing to build");

    weft_tests::step("a gateway enrolling sends a delta");
    enroll(&c, pb::AgentRole::Gateway, "gw-b", "192.168.1.100", None).await;
    let d = next(&mut s).await;
    let Some(Kind::Delta(delta)) = &d.kind else {
        panic!("expected a delta, got {d:?}")
    };
    assert!(d.revision > first.revision);
    let ids: Vec<&str> = delta.upserts.iter().map(|o| o.id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "self/addr",
            "self/host-snat",
            "self/link",
            "self/route/internal",
            "self/rule/internal"
        ]
    );
    apply(&mut held, &d);
    assert_eq!(remote_of(&held), "192.168.1.100");
    let r1 = d.revision;
    drop(s);

    weft_tests::step("a resume gets exactly what changed while away");
    // While n1 is away: a gateway that sorts first becomes the active one.
    enroll(&c, pb::AgentRole::Gateway, "gw-a", "192.168.1.99", None).await;
    // and a new node, which does not concern n1
    enroll(&c, pb::AgentRole::Node, "n2", "192.168.1.2", None).await;

    let mut s = n1
        .watch(pb::WatchRequest {
            last_revision: r1,
            known: known(&held),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let r = next(&mut s).await;
    let Some(Kind::Delta(delta)) = &r.kind else {
        panic!("a resume within reach gets a delta, got {r:?}")
    };
    assert_eq!(
        delta.upserts.iter().map(|o| o.id.as_str()).collect::<Vec<_>>(),
        ["self/link"],
        "exactly what changed"
    );
    assert!(delta.deletes.is_empty());
    apply(&mut held, &r);
    assert_eq!(remote_of(&held), "192.168.1.99");

    weft_tests::step("an agent already up to date gets an empty delta");
    // an agent already up to date gets an empty delta, not its whole state
    drop(s);
    let mut s = n1
        .watch(pb::WatchRequest {
            last_revision: r.revision,
            known: known(&held),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let Some(Kind::Delta(empty)) = next(&mut s).await.kind else {
        panic!()
    };
    assert!(empty.upserts.is_empty() && empty.deletes.is_empty());
    c.shut_down();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_fallback_when_a_delta_is_impossible_or_pointless() {
    let c = ControllerSpec::new("site-a").pod("10.1.0.0/16").start();
    let mut n1 = enroll(&c, pb::AgentRole::Node, "n1", "192.168.1.1", None).await;
    enroll(&c, pb::AgentRole::Gateway, "gw", "192.168.1.100", None).await;
    let rev = c.revision().await;
    // a revision this store never reached, holding nothing
    let mut s = n1
        .watch(pb::WatchRequest {
            last_revision: rev + 1000,
            known: vec![],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let Some(Kind::Snapshot(snap)) = next(&mut s).await.kind else {
        panic!("expected a snapshot")
    };
    assert_eq!(
        snap.objects.len(),
        5,
        "overlay link, address, host NAT, and the overlay's route and rule"
    );
    drop(s);
    // a revision this store never reached (it was restored from a backup,
    // or is a new etcd) holding what it would be given: the difference,
    // which is nothing
    let held: Vec<pb::ObjectVersion> = snap
        .objects
        .iter()
        .map(|o| pb::ObjectVersion {
            id: o.id.clone(),
            hash: weft_proto::object_hash(o),
        })
        .collect();
    let mut s = n1
        .watch(pb::WatchRequest {
            last_revision: rev + 1000,
            known: held,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let Some(Kind::Delta(d)) = next(&mut s).await.kind else {
        panic!("expected a delta")
    };
    assert_eq!((d.upserts.len(), d.deletes.len()), (0, 0));
    drop(s);
    // a revision in reach but nothing in common: the snapshot is no larger
    let stale = vec![
        pb::ObjectVersion {
            id: "self/link".into(),
            hash: 1,
        },
        pb::ObjectVersion {
            id: "gone".into(),
            hash: 2,
        },
    ];
    let mut s = n1
        .watch(pb::WatchRequest {
            last_revision: rev,
            known: stale,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(matches!(next(&mut s).await.kind, Some(Kind::Snapshot(_))));
    c.shut_down();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_agent_gets_coalesced_state_and_stalls_no_one() {
    weft_tests::step("a stalled gateway and a node both watching");
    let c = ControllerSpec::new("site-a").pod("10.1.0.0/16").start();
    let mut n1 = enroll(&c, pb::AgentRole::Node, "n1", "192.168.1.1", None).await;
    // The gateway's reader accepts 1 KiB in flight, then stops reading.
    let mut gw = enroll(&c, pb::AgentRole::Gateway, "gw-b", "192.168.1.100", Some(1024)).await;
    let mut gs = gw
        .watch(pb::WatchRequest {
            last_revision: 0,
            known: vec![],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut gheld = Held::new();
    apply(&mut gheld, &next(&mut gs).await);
    let mut ns = n1
        .watch(pb::WatchRequest {
            last_revision: 0,
            known: vec![],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    next(&mut ns).await;

    weft_tests::step("forty nodes enroll");
    const NODES: usize = 40;
    for i in 0..NODES {
        enroll(
            &c,
            pb::AgentRole::Node,
            &format!("m{i}"),
            &format!("192.168.2.{}", i + 1),
            None,
        )
        .await;
    }
    weft_tests::step("the node is not held up by the stalled gateway");
    // n1 is not held up by the stalled gateway: a new active gateway reaches it now
    enroll(&c, pb::AgentRole::Gateway, "gw-a", "192.168.1.99", None).await;
    let start = std::time::Instant::now();
    let mut nheld = Held::new();
    loop {
        let m = next(&mut ns).await;
        apply(&mut nheld, &m);
        if nheld
            .get("self/link")
            .is_some_and(|_| remote_of(&nheld) == "192.168.1.99")
        {
            break;
        }
    }
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "n1 waited {:?}",
        start.elapsed()
    );

    weft_tests::step("the gateway reads again and gets coalesced state");
    // Now the gateway reads again: fewer messages than changes, same result.
    let mut messages = 0;
    while gheld.keys().filter(|k| k.starts_with("node/m")).count() < NODES * 3 {
        apply(&mut gheld, &next(&mut gs).await);
        messages += 1;
    }
    assert!(
        messages < NODES,
        "{messages} messages for {NODES} changes: not coalesced"
    );
    c.shut_down();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_agent_loses_its_stream() {
    let c = ControllerSpec::new("site-a").pod("10.1.0.0/16").start();
    let mut n1 = enroll(&c, pb::AgentRole::Node, "n1", "192.168.1.1", None).await;
    let mut s = n1
        .watch(pb::WatchRequest {
            last_revision: 0,
            known: vec![],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    next(&mut s).await;
    AdminServiceClient::new(
        c.channel(Some((&c.pki_pem("admin.pem"), &c.pki_pem("admin.key"))))
            .await,
    )
    .delete_node(pb::DeleteNodeRequest { name: "n1".into() })
    .await
    .unwrap();
    let end = tokio::time::timeout(Duration::from_secs(5), s.message()).await.unwrap();
    let err = end.expect_err("the stream must end with an error");
    assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err:?}");
    c.shut_down();
}

fn agent(
    c: &Controller,
    dir: &std::path::Path,
    kind: &str,
    name: &str,
    underlay: &str,
    token: &[&str],
    log: &str,
) -> Proc {
    let mut cmd = Command::new(bin(&format!("weft-{kind}-agent")));
    cmd.args([
        "--controller",
        &format!("https://127.0.0.1:{}", c.listen_port),
        "--name",
        name,
        "--underlay-ip",
        underlay,
    ])
    .arg("--state-dir")
    .arg(dir.join(name))
    .args(token)
    .arg("--dry-run")
    .env_remove("WEFT_CONTROLLER");
    Proc::spawn(&mut cmd, &dir.join(log))
}

fn token(c: &Controller, role: &str, name: &str) -> (String, String) {
    let t = weftctl_json(&c.target(), &["token", "create", "--role", role, "--name", name]);
    (
        t["token"].as_str().unwrap().into(),
        t["ca_fingerprint"].as_str().unwrap().into(),
    )
}

fn node_status(c: &Controller, name: &str) -> serde_json::Value {
    let nodes = weftctl_json(&c.target(), &["nodes"]);
    let found = nodes["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == name)
        .cloned();
    found.map(|n| n["status"].clone()).unwrap_or(serde_json::Value::Null)
}

#[test]
fn agents_report_liveness_and_keep_their_state_without_the_controller() {
    weft_tests::step("a gateway and a node agent enroll");
    let dir = tempfile::Builder::new().prefix("weft-watch").tempdir().unwrap();
    let mut c = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("data"))
        .flags(&["--pod-cidr", "10.1.0.0/16", "--agent-ttl", "3s"])
        .start();
    let (t, fp) = token(&c, "gateway", "gw");
    let _gw = agent(
        &c,
        dir.path(),
        "gateway",
        "gw",
        "192.168.1.100",
        &["--token", &t, "--ca-fingerprint", &fp],
        "gw.log",
    );
    let (t, fp) = token(&c, "node", "n1");
    let mut n1 = agent(
        &c,
        dir.path(),
        "node",
        "n1",
        "192.168.1.1",
        &["--token", &t, "--ca-fingerprint", &fp],
        "n1.log",
    );

    weft_tests::step("the node is ready and in sync");
    // ready, with the applied revision equal to the latest
    let st = eventually("n1 ready and in sync", Duration::from_secs(15), || {
        let s = node_status(&c, "n1");
        (s["ready"] == true
            && s["applied_revision"].as_i64() > Some(0)
            && s["applied_revision"] == s["latest_revision"])
            .then_some(s)
    });
    let applied = st["applied_revision"].as_i64().unwrap();
    eventually("n1 got its overlay", Duration::from_secs(10), || {
        n1.log_text().contains("would create link weft-vx0").then_some(())
    });

    weft_tests::step("a killed node is not ready within the ttl");
    // killed: NotReady within the 3 s TTL (plus the expiry tick)
    n1.child.as_mut().unwrap().kill().unwrap();
    n1.wait_exit(Duration::from_secs(5)).unwrap();
    let killed = std::time::Instant::now();
    eventually("n1 NotReady", Duration::from_secs(6), || {
        (node_status(&c, "n1")["ready"] == false).then_some(())
    });
    assert!(killed.elapsed() < Duration::from_secs(5), "took {:?}", killed.elapsed());
    assert_eq!(
        weftctl_json(&c.target(), &["node", "get", "n1"])["subnet"],
        "10.1.0.0/24",
        "allocations are kept"
    );

    weft_tests::step("without the controller the node re-applies its stored state");
    // the controller goes away; n1 restarts and re-applies its stored state
    assert!(c.stop().success());
    let n1b = agent(&c, dir.path(), "node", "n1", "192.168.1.1", &[], "n1-restart.log");
    eventually("n1 re-applied its stored state", Duration::from_secs(10), || {
        let log = n1b.log_text();
        // Applied as a resync: what is stored was applied before, so a
        // dry run has nothing to change (a real host gets what is missing).
        (log.contains("applying the stored desired state") && !log.contains("objects=0")).then_some(())
    });
    assert!(
        n1b.log_text().contains(&format!("revision={applied}")),
        "{}",
        n1b.log_text()
    );
    eventually("n1 keeps trying", Duration::from_secs(10), || {
        n1b.log_text().contains("keeping the last state").then_some(())
    });

    weft_tests::step("the controller is back and the node resumes");
    // the controller is back: n1 resumes (a delta, not a snapshot) and is ready again
    c.restart_stopped();
    eventually("n1 ready again", Duration::from_secs(30), || {
        (node_status(&c, "n1")["ready"] == true).then_some(())
    });
    assert!(n1b.log_text().contains("kind=\"delta\""), "{}", n1b.log_text());
}
