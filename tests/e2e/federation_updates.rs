//! After negotiation the controllers keep each other current: a gateway
//! key that changes on one site reaches the other site's gateways as
//! desired state; a peering deleted while the peer was away is removed on
//! the peer when it comes back; a peer gone past the grace period is removed.

use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine;
use weft_proto::v1 as pb;
use weft_proto::v1::agent_service_client::AgentServiceClient;

use weft_tests::{Controller, ControllerSpec, bin, eventually, run, weftctl_json};

async fn gateway(c: &Controller, underlay: &str) -> AgentServiceClient<tonic::transport::Channel> {
    let token = c.token_for(pb::AgentRole::Gateway, "gw", 600, 1).await;
    let (cert, key) = c.register_at(&token, "gw", underlay).await.unwrap();
    AgentServiceClient::new(c.channel(Some((&cert, &key))).await)
}

fn key(byte: u8) -> String {
    base64::engine::general_purpose::STANDARD.encode([byte; 32])
}

/// What a gateway holds of its stream: its objects as the controller sent
/// them, by id.
type Held = std::collections::BTreeMap<String, pb::DesiredObject>;

/// Takes in one message of the stream, as an agent does.
fn take_in(held: &mut Held, m: &pb::WatchResponse) {
    match &m.kind {
        Some(pb::watch_response::Kind::Snapshot(s)) => {
            *held = s.objects.iter().map(|o| (o.id.clone(), o.clone())).collect()
        }
        Some(pb::watch_response::Kind::Delta(d)) => {
            for id in &d.deletes {
                held.remove(id);
            }
            for o in &d.upserts {
                held.insert(o.id.clone(), o.clone());
            }
        }
        None => {}
    }
}

/// The WireGuard peer keys in a gateway's held state.
fn peer_keys(held: &Held) -> Vec<String> {
    held.values()
        .filter_map(|o| match &o.kind {
            Some(pb::desired_object::Kind::WireguardPeer(p)) => Some(p.public_key.clone()),
            _ => None,
        })
        .collect()
}

/// Takes in the gateway's stream, as its agent does, until its only
/// WireGuard peer key is `want`; fails after `within`.
async fn until_peer_key(
    s: &mut tonic::Streaming<pb::WatchResponse>,
    held: &mut Held,
    want: &str,
    within: Duration,
    what: &str,
) {
    let deadline = Instant::now() + within;
    while peer_keys(held) != [want] {
        let m = tokio::time::timeout_at(deadline.into(), s.message())
            .await
            .unwrap_or_else(|_| panic!("{what} never arrived"))
            .unwrap()
            .unwrap();
        take_in(held, &m);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_key_change_reaches_the_peer_sites_gateway_within_a_second() {
    weft_tests::step("two sites with a gateway each");
    let a = ControllerSpec::new("site-a").pod("10.1.0.0/16").start();
    let b = ControllerSpec::new("site-b").pod("10.2.0.0/16").start();
    let mut gwa = gateway(&a, "192.168.1.1").await;
    let mut gwb = gateway(&b, "192.168.2.1").await;
    gwb.update_gateway(pb::UpdateGatewayRequest {
        public_key: key(1),
        endpoint: "192.168.2.1:51820".into(),
    })
    .await
    .unwrap();

    weft_tests::step("site-a peers with site-b");
    let token = b
        .admin()
        .await
        .create_peering_token(pb::CreatePeeringTokenRequest {
            ttl_seconds: 60,
            for_site: String::new(),
        })
        .await
        .unwrap();
    a.admin()
        .await
        .create_peering(pb::CreatePeeringRequest {
            token: token.into_inner().token,
            transit: false,
        })
        .await
        .unwrap();

    weft_tests::step("site-a's gateway gets site-b's key and CIDRs");
    let mut s = gwa
        .watch(pb::WatchRequest {
            last_revision: 0,
            known: vec![],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut held = Held::new();
    until_peer_key(&mut s, &mut held, &key(1), Duration::from_secs(10), "site-b's key").await;
    let wg = held.get("peer/site-b/wgpeer/gw").unwrap();
    let Some(pb::desired_object::Kind::WireguardPeer(p)) = &wg.kind else {
        panic!()
    };
    assert_eq!(p.endpoint, "192.168.2.1:51820");
    // Real CIDRs inside the tunnel, and the far end's probe address.
    assert_eq!(
        p.allowed_ips[..2],
        ["10.2.0.0/16", "10.70.0.0/16"],
        "real CIDRs inside the tunnel"
    );
    assert!(
        p.allowed_ips.len() == 3 && ["169.254.255.253/32", "169.254.255.254/32"].contains(&p.allowed_ips[2].as_str()),
        "{:?}",
        p.allowed_ips
    );

    weft_tests::step("a new gateway key is held for site-b's admin");
    // A gateway that has a key asks for another: held for site-b's admin
    // (a stolen gateway certificate must not redirect the tunnels), the
    // peers keep the current one; the admin's accept takes it.
    let b_gateway = |what: &'static str| {
        let b = &b;
        async move {
            let gws = b
                .admin()
                .await
                .list_gateways(pb::ListGatewaysRequest {})
                .await
                .unwrap()
                .into_inner()
                .gateways;
            let g = gws.into_iter().find(|g| g.name == "gw").expect(what);
            (g.public_key, g.pending_public_key)
        }
    };
    let accept = |k: String| {
        let b = &b;
        async move {
            b.admin()
                .await
                .accept_gateway_key(pb::AcceptGatewayKeyRequest {
                    name: "gw".into(),
                    public_key: k,
                })
                .await
        }
    };
    gwb.update_gateway(pb::UpdateGatewayRequest {
        public_key: key(2),
        endpoint: "192.168.2.1:51820".into(),
    })
    .await
    .unwrap();
    assert_eq!(b_gateway("gw").await, (key(1), key(2)), "the new key is held");
    // Sending the current key again takes nothing back.
    gwb.update_gateway(pb::UpdateGatewayRequest {
        public_key: key(1),
        endpoint: "192.168.2.1:51820".into(),
    })
    .await
    .unwrap();
    assert_eq!(b_gateway("gw").await, (key(1), key(2)), "still held");
    tokio::time::sleep(Duration::from_millis(500)).await;
    while let Ok(m) = tokio::time::timeout(Duration::from_millis(200), s.message()).await {
        let m = m.unwrap().unwrap();
        take_in(&mut held, &m);
    }
    assert_eq!(peer_keys(&held), [key(1)], "a held key reached the peer");
    weft_tests::step("wrong accepts take nothing, the right one rotates");
    // The subscriptions between the controllers start within a moment of
    // the peering; a first accepted rotation shows site-a is following
    // site-b.
    // Accepting a key other than the one held (the admin checked another
    // host's) takes nothing; nor does accepting without a key.
    let e = accept(key(9)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("Nothing changed"), "{e:?}");
    let e = accept(String::new()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().starts_with("public_key"), "{e:?}");
    assert_eq!(
        b_gateway("gw").await,
        (key(1), key(2)),
        "still held after wrong accepts"
    );
    accept(key(2)).await.unwrap();
    until_peer_key(&mut s, &mut held, &key(2), Duration::from_secs(5), "the rotation").await;
    let e = accept(key(2)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    weft_tests::step("a rotation reaches the peer within a second");
    // Rotate again and time it from the admin's accept: site-a's gateway
    // has it within a second.
    gwb.update_gateway(pb::UpdateGatewayRequest {
        public_key: key(3),
        endpoint: "192.168.2.1:51820".into(),
    })
    .await
    .unwrap();
    let t = Instant::now();
    accept(key(3)).await.unwrap();
    until_peer_key(&mut s, &mut held, &key(3), Duration::from_secs(5), "the rotation").await;
    let took = t.elapsed();
    assert!(took < Duration::from_secs(1), "the key change took {took:?}");
    println!("gateway key change reached the peer site's gateway in {took:?} after the admin accepted it");
    drop(s);
    a.shut_down();
    b.shut_down();
}

fn peer_names(c: &Controller) -> Vec<String> {
    let v = weftctl_json(&c.target(), &["peerings"]);
    v["peerings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["site_id"].as_str().unwrap().to_string())
        .collect()
}

fn peer(a: &Controller, b: &Controller) {
    let t = weftctl_json(&b.target(), &["peering", "token"])["token"]
        .as_str()
        .unwrap()
        .to_string();
    let o = run(Command::new(bin("weftctl")).args(["--controller", &a.target(), "peering", "create", "--token", &t]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn a_deletion_made_while_the_peer_was_away_reaches_it_when_it_is_back() {
    let dir = tempfile::Builder::new().prefix("weft-fedupd").tempdir().unwrap();
    let a = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("a"))
        .flags(&["--pod-cidr", "10.1.0.0/16"])
        .start();
    let mut b = ControllerSpec::new("site-b")
        .data_dir(&dir.path().join("b"))
        .flags(&["--pod-cidr", "10.2.0.0/16"])
        .start();
    peer(&a, &b);
    assert!(b.stop().success());
    let d = weftctl_json(&a.target(), &["peering", "delete", "site-b"]);
    assert_eq!(d["remote_notified"], false, "site-b was down");
    assert!(peer_names(&a).is_empty());
    b.restart_stopped();
    eventually("site-b learns of the deletion", Duration::from_secs(10), || {
        peer_names(&b).is_empty().then_some(())
    });
}

#[test]
fn a_peer_unreachable_past_the_grace_period_is_removed() {
    let dir = tempfile::Builder::new().prefix("weft-fedupd").tempdir().unwrap();
    let mut a = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("a"))
        .flags(&["--pod-cidr", "10.1.0.0/16"])
        .start();
    let b = ControllerSpec::new("site-b")
        .data_dir(&dir.path().join("b"))
        .flags(&["--pod-cidr", "10.2.0.0/16", "--peer-grace", "2s"])
        .start();
    peer(&a, &b);
    assert_eq!(peer_names(&b), ["site-a"]);
    assert!(a.stop().success());
    let gone = Instant::now();
    eventually("site-b gives up on site-a", Duration::from_secs(15), || {
        peer_names(&b).is_empty().then_some(())
    });
    assert!(
        gone.elapsed() >= Duration::from_secs(2),
        "removed before the grace period"
    );
}

/// The workload CIDR a peer routes to, as this site records it.
fn routed(c: &Controller, peer: &str) -> (String, serde_json::Value) {
    let v = weftctl_json(&c.target(), &["peerings"]);
    let p = v["peerings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["site_id"] == peer)
        .unwrap()
        .clone();
    let real = p["views"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["kind"] == "workload")
        .unwrap()["real_cidr"]
        .as_str()
        .unwrap()
        .to_string();
    (real, p["pending"].clone())
}

/// A peer that announces other CIDRs after negotiation changes nothing that
/// this site routes until an admin accepts it, unless the new CIDRs lie
/// within bounds the admin set (`--peer-cidr-auto-accept`).
#[test]
fn a_peers_new_cidrs_are_held_for_review_or_applied_within_bounds() {
    let dir = tempfile::Builder::new().prefix("weft-fedupd").tempdir().unwrap();
    let a = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("a"))
        .flags(&["--pod-cidr", "10.1.0.0/16"])
        .start();
    let c = ControllerSpec::new("site-c")
        .data_dir(&dir.path().join("c"))
        .flags(&["--pod-cidr", "10.5.0.0/16", "--peer-cidr-auto-accept", "10.128.0.0/9"])
        .start();
    let mut b = ControllerSpec::new("site-b")
        .data_dir(&dir.path().join("b"))
        .flags(&["--pod-cidr", "10.2.0.0/16"])
        .start();
    peer(&a, &b);
    peer(&c, &b);
    assert!(b.stop().success());
    b.set_flag("--pod-cidr", "10.200.0.0/16");
    b.restart_stopped();

    // a holds it: still routes 10.2.0.0/16, shows 10.200.0.0/16 as pending.
    let pending = eventually("site-a holds the change", Duration::from_secs(20), || {
        let (real, pending) = routed(&a, "site-b");
        (!pending.is_null()).then_some((real, pending))
    });
    assert_eq!(pending.0, "10.2.0.0/16");
    assert_eq!(pending.1["workload_cidrs"][0], "10.200.0.0/16");
    let o = run(Command::new(bin("weftctl")).args(["--controller", &a.target(), "peerings"]));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("not routed until `weftctl peering accept site-b`"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    // c applied it: 10.200.0.0/16 lies within its bound 10.128.0.0/9.
    eventually("site-c applies the change", Duration::from_secs(20), || {
        let (real, pending) = routed(&c, "site-b");
        (real == "10.200.0.0/16" && pending.is_null()).then_some(())
    });
    // The admin of a accepts.
    weftctl_json(&a.target(), &["peering", "accept", "site-b"]);
    let (real, pending) = routed(&a, "site-b");
    assert_eq!((real.as_str(), pending), ("10.200.0.0/16", serde_json::Value::Null));
    // Nothing left to accept.
    let o = run(Command::new(bin("weftctl")).args(["--controller", &a.target(), "peering", "accept", "site-b"]));
    assert!(String::from_utf8_lossy(&o.stderr).contains("FAILED_PRECONDITION"));
}
