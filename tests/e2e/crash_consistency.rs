//! A controller SIGKILLed in the middle of work that allocates: a burst of
//! node registrations (admin and agent enrollment), and a peering
//! negotiation. Afterwards nothing is half-written: every node has exactly
//! one subnet and one overlay address, no block is leaked or given twice,
//! what was acknowledged survived, and a peering exists on both sides or on
//! neither.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use futures::StreamExt;
use ipnet::Ipv4Net;
use weft_proto::v1 as pb;
use weft_proto::v1::admin_service_client::AdminServiceClient;
use weft_proto::v1::agent_service_client::AgentServiceClient;
use weft_tests::{Controller, ControllerSpec, Etcd, eventually, weftctl_json};

/// Every node, its subnet and its allocations, checked for consistency.
fn check_allocations(c: &Controller) -> BTreeSet<String> {
    let nodes = weftctl_json(&c.target(), &["nodes"]);
    let nodes = nodes["nodes"].as_array().unwrap();
    let allocs = weftctl_json(&c.target(), &["allocations"]);
    let allocs: Vec<&serde_json::Value> = allocs["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["kind"] == "node-subnet")
        .collect();
    let mut by_owner: BTreeMap<String, Vec<Ipv4Net>> = BTreeMap::new();
    for a in &allocs {
        by_owner
            .entry(a["owner"].as_str().unwrap().to_string())
            .or_default()
            .push(a["cidr"].as_str().unwrap().parse().unwrap());
    }
    let names: BTreeSet<String> = nodes.iter().map(|n| n["name"].as_str().unwrap().to_string()).collect();
    assert_eq!(
        by_owner.keys().cloned().collect::<BTreeSet<_>>(),
        names,
        "an allocation without a node, or a node without one"
    );
    let mut subnets: Vec<Ipv4Net> = Vec::new();
    for (owner, blocks) in &by_owner {
        assert_eq!(blocks.len(), 1, "{owner} holds {blocks:?}");
        subnets.push(blocks[0]);
    }
    for (i, a) in subnets.iter().enumerate() {
        for b in &subnets[i + 1..] {
            assert!(
                !a.contains(&b.network()) && !b.contains(&a.network()),
                "{a} and {b} overlap"
            );
        }
    }
    let ips: Vec<&str> = nodes
        .iter()
        .filter_map(|n| n["internal_ip"].as_str())
        .filter(|s| !s.is_empty())
        .collect();
    let unique: BTreeSet<&str> = ips.iter().copied().collect();
    assert_eq!(unique.len(), ips.len(), "an overlay address given twice: {ips:?}");
    names
}

fn registrations(c: &mut Controller) {
    // Three rounds: kill mid-burst, restart, check; the next round goes on
    // from whatever the last one left.
    let mut total_before = 0;
    for round in 0..3 {
        let tag = format!("r{round}n");
        let acked = acked_burst(c, &tag);
        c.restart_stopped();
        let names = check_allocations(c);
        for n in &acked {
            assert!(names.contains(n), "{n} was acknowledged before the crash and is gone");
        }
        println!(
            "FAULT controller SIGKILL mid-burst (round {round}): {} acknowledged, {} recorded, all consistent",
            acked.len(),
            names.len() - total_before
        );
        total_before = names.len();
    }
    // The site still allocates normally afterwards.
    weftctl_json(&c.target(), &["node", "add", "after-crash"]);
    check_allocations(c);
}

/// A burst of 120 registrations (half admin CreateNode, half agent
/// Register), the controller SIGKILLed while they run; returns the names
/// whose call was acknowledged before the kill.
fn acked_burst(c: &mut Controller, tag: &str) -> Vec<String> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let t = weftctl_json(&c.target(), &["token", "create", "--role", "node", "--uses", "200"]);
    let (token, fp) = (
        t["token"].as_str().unwrap().to_string(),
        t["ca_fingerprint"].as_str().unwrap().to_string(),
    );
    let target = format!("https://127.0.0.1:{}", c.listen_port);
    let admin_target = c.target();
    let pid = c.pid();
    let acked = rt.block_on(async move {
        let ch = weft_common::tls::connect(&admin_target, &weft_common::tls::Trust::CaPem(String::new()), None)
            .await
            .unwrap();
        let admin = AdminServiceClient::new(ch);
        let agent_ch = weft_agent::tls::connect(&target, &weft_agent::tls::Trust::Fingerprint(fp), None)
            .await
            .unwrap();
        let agent = AgentServiceClient::new(agent_ch);
        let acked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = acked.clone();
        // Calls sent and not yet answered.
        let in_flight = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let flying = in_flight.clone();
        let tag = tag.to_string();
        let burst = tokio::spawn(async move {
            futures::stream::iter(0..120)
                .for_each_concurrent(24, |i| {
                    let (mut admin, mut agent, token, sink, flying) = (
                        admin.clone(),
                        agent.clone(),
                        token.clone(),
                        sink.clone(),
                        flying.clone(),
                    );
                    let name = format!("{tag}{i}");
                    async move {
                        flying.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        let ok = if i % 2 == 0 {
                            admin
                                .create_node(pb::CreateNodeRequest {
                                    name: name.clone(),
                                    subnet: String::new(),
                                })
                                .await
                                .is_ok()
                        } else {
                            let (_, csr) = weft_agent::identity::key_and_csr(&name).unwrap();
                            agent
                                .register(pb::RegisterRequest {
                                    token,
                                    csr_pem: csr,
                                    name: name.clone(),
                                    subnet: String::new(),
                                    underlay_ip: format!("192.168.9.{}", i + 1),
                                })
                                .await
                                .is_ok()
                        };
                        if ok {
                            sink.lock().unwrap().push(name);
                        }
                        flying.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    }
                })
                .await
        });
        // Kill once a few have gone through: mid-burst.
        let start = Instant::now();
        while acked.lock().unwrap().len() < 10 && start.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
        let at_kill = (
            in_flight.load(std::sync::atomic::Ordering::SeqCst),
            acked.lock().unwrap().len(),
        );
        let _ = tokio::time::timeout(Duration::from_secs(10), burst).await;
        (acked.lock().unwrap().clone(), at_kill)
    });
    // Reap it (it is dead already).
    c.kill();
    let (acked, (in_flight, acked_at_kill)) = acked;
    // The kill hit the window: calls were in flight (sent, their
    // transactions possibly half done) and the burst was cut short.
    println!("FAULT {tag}: killed with {in_flight} calls in flight, {acked_at_kill} acknowledged");
    assert!(
        in_flight > 0 && acked.len() < 120,
        "the kill missed the burst: {in_flight} calls in flight, {} of 120 acknowledged",
        acked.len()
    );
    acked
}

#[test]
fn a_crash_mid_burst_on_the_embedded_store_leaks_and_duplicates_nothing() {
    let dir = tempfile::Builder::new().prefix("weft-crash").tempdir().unwrap();
    let mut c = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("data"))
        .flags(&["--pod-cidr", "10.1.0.0/16"])
        .start();
    registrations(&mut c);
}

#[test]
fn a_crash_mid_burst_on_etcd_leaks_and_duplicates_nothing() {
    let Some(etcd) = Etcd::start() else { return };
    let dir = tempfile::Builder::new().prefix("weft-crash").tempdir().unwrap();
    let mut c = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("data"))
        .flags(&["--pod-cidr", "10.1.0.0/16", "--etcd-endpoints", &etcd.endpoint()])
        .start();
    registrations(&mut c);
}

#[test]
fn a_crash_mid_negotiation_leaves_a_peering_on_both_sides_or_on_neither() {
    weft_tests::step("two sites up");
    let dir = tempfile::Builder::new().prefix("weft-crash").tempdir().unwrap();
    let mut a = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("a"))
        .flags(&["--pod-cidr", "10.1.0.0/16"])
        .start();
    let b = ControllerSpec::new("site-b")
        .data_dir(&dir.path().join("b"))
        .flags(&["--pod-cidr", "10.1.0.0/16"])
        .start();
    let peers = |c: &Controller| -> Vec<String> {
        weftctl_json(&c.target(), &["peerings"])["peerings"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["site_id"].as_str().unwrap().to_string())
            .collect()
    };
    let mut outcomes = Vec::new();
    // Freeze a (SIGSTOP) at different moments of its CreatePeering call,
    // give b time to finish a Join it got, look at both sides, then kill a
    // and start it again. The window that matters: b recorded the peering
    // and a had not yet — one-sided, which b must repair. The coarse
    // moments first; then, until that window was hit, 1 ms steps.
    let coarse = [0u64, 5, 10, 20, 40, 80];
    let fine = 1u64..=60;
    let mut one_sided_seen = 0;
    for delay_ms in coarse.into_iter().chain(fine) {
        if delay_ms > 80 || (outcomes.len() >= coarse.len() && one_sided_seen > 0) {
            break;
        }
        weft_tests::step(&format!("a frozen and killed {delay_ms} ms into its CreatePeering"));
        let token = weftctl_json(&b.target(), &["peering", "token", "--ttl", "10m"])["token"]
            .as_str()
            .unwrap()
            .to_string();
        let mut call = std::process::Command::new(weft_tests::bin("weftctl"))
            .args(["--controller", &a.target(), "peering", "create", "--token", &token])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay_ms));
        let _ = std::process::Command::new("kill")
            .args(["-STOP", &a.pid().to_string()])
            .status();
        std::thread::sleep(Duration::from_millis(500));
        let b_has = peers(&b) == vec!["site-a".to_string()];
        a.kill();
        let _ = call.wait();
        a.restart_stopped();
        let a_has = peers(&a) == vec!["site-b".to_string()];
        assert!(
            b_has || !a_has,
            "a recorded a peering b never did (delay {delay_ms} ms)"
        );
        let one_sided = b_has && !a_has;
        weft_tests::step(&format!("both sides agree after a crash at {delay_ms} ms"));
        // Converged: both sides agree (b learns from a that a has none, or
        // a finishes what it recorded).
        let agreed = eventually("both sides agree", Duration::from_secs(30), || {
            let (pa, pb) = (peers(&a), peers(&b));
            let both = pa == vec!["site-b".to_string()] && pb == vec!["site-a".to_string()];
            let neither = pa.is_empty() && pb.is_empty();
            (both || neither).then_some(if both { "both" } else { "neither" })
        });
        if one_sided {
            one_sided_seen += 1;
            assert_eq!(
                agreed, "neither",
                "a one-sided peering (only b had it) must be removed from b"
            );
        }
        outcomes.push((delay_ms, if one_sided { "one-sided, repaired" } else { agreed }));
        if agreed == "both" {
            // Start over for the next moment.
            let o = weft_tests::run(std::process::Command::new(weft_tests::bin("weftctl")).args([
                "--controller",
                &a.target(),
                "peering",
                "delete",
                "site-b",
            ]));
            assert!(o.status.success(), "{}", weft_tests::stderr(&o));
            eventually("deleted on both", Duration::from_secs(30), || {
                (peers(&a).is_empty() && peers(&b).is_empty()).then_some(())
            });
        }
    }
    weft_tests::step("the one-sided window was hit");
    assert!(
        one_sided_seen > 0,
        "no moment hit the window where only b had the peering: {outcomes:?}"
    );
    println!("FAULT controller frozen then SIGKILLed mid-negotiation, by delay (ms): {outcomes:?}");
    weft_tests::step("a peering still works afterwards");
    // And a peering still works afterwards.
    let token = weftctl_json(&b.target(), &["peering", "token"])["token"]
        .as_str()
        .unwrap()
        .to_string();
    weftctl_json(&a.target(), &["peering", "create", "--token", &token]);
    eventually("peered", Duration::from_secs(10), || {
        (peers(&a) == vec!["site-b".to_string()] && peers(&b) == vec!["site-a".to_string()]).then_some(())
    });
}
