//! A mesh of many sites, every one on the same workload CIDR with its
//! workload at the same address, each gateway on a host of its own: every
//! pair reaches every other through its own local view, a site joins the
//! running mesh and a peering leaves it without disturbing the other
//! tunnels. Needs root: run under CI=true.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use weft_tests::mesh::{ECHO_PORT, Mesh};
use weft_tests::{bin, eventually, netns, ping_answers, unix_now};

const POD: &str = "10.1.0.0/16";

/// Every ordered pair of `sites` reaches the other (is answered by it, seen
/// inside its view), retrying each for a while as tunnels settle.
fn all_reach(mesh: &Mesh, sites: &[usize]) {
    for &a in sites {
        for &b in sites.iter().filter(|b| **b != a) {
            let deadline = Instant::now() + Duration::from_secs(30);
            let seen = loop {
                match mesh.reaches(a, b) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() > deadline => {
                        panic!("{} does not reach {}: {e}", mesh.sites[a].id, mesh.sites[b].id)
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(200)),
                }
            };
            eprintln!(
                "{} -> {}: answered, client seen at {seen}",
                mesh.sites[a].id, mesh.sites[b].id
            );
        }
    }
}

/// Probes lost so far on each tunnel of each site: (site, peer) → count.
fn probes_lost(mesh: &Mesh, sites: &[usize]) -> HashMap<(usize, usize), u64> {
    let mut out = HashMap::new();
    for &a in sites {
        for &b in sites.iter().filter(|b| **b != a) {
            if let Some(p) = mesh.peering(&mesh.sites[a], &mesh.sites[b].id) {
                // A tunnel that reports no probe count would make the check
                // below vacuous: every peering here has a reporting tunnel.
                let lost = p["tunnel"]["probes_lost"].as_u64();
                let sent = p["tunnel"]["probes_sent"].as_u64().unwrap_or(0);
                assert!(lost.is_some() && sent > 0, "{a}->{b} reports no probes: {p}");
                out.insert((a, b), lost.unwrap());
            }
        }
    }
    out
}

#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn four_sites_on_one_cidr_all_reach_each_other_and_the_mesh_changes_without_disturbing_them() {
    if !netns::require_root() {
        return;
    }
    weft_tests::step("four sites up and peered");
    let t0 = Instant::now();
    let mut mesh = Mesh::up("mesh", 4, POD);
    mesh.peer_all(&[0, 1, 2, 3]);
    eprintln!("four sites up and peered in {:.1}s", t0.elapsed().as_secs_f64());

    weft_tests::step("one port per peering on every gateway");
    // Each peering has a port of its own on every gateway, and the peer
    // dials exactly that port.
    for a in 0..4 {
        let mut ports = Vec::new();
        for b in (0..4).filter(|b| *b != a) {
            let p = mesh.peering(&mesh.sites[a], &mesh.sites[b].id).unwrap();
            let port = p["listen_port"].as_u64().unwrap();
            let from_b = mesh.peering(&mesh.sites[b], &mesh.sites[a].id).unwrap();
            let dialed = from_b["remote_gateways"][0]["endpoint"]
                .as_str()
                .unwrap_or("")
                .to_string();
            let told = p["local_gateways"][0]["endpoint"].as_str().unwrap().to_string();
            assert_eq!(dialed, told, "{} dials {} where {} says it listens", b, a, a);
            assert!(told.ends_with(&format!(":{port}")), "{told} vs port {port}");
            ports.push(port);
        }
        ports.sort();
        ports.dedup();
        assert_eq!(ports.len(), 3, "site {a}: one port per peering: {ports:?}");
    }
    weft_tests::step("peering namespaces are named for both sites");
    // The peering namespaces are named for both sites: site a's namespace
    // for its peering with b differs from b's for its peering with a.
    let pid = mesh.gateway_pid(0);
    let listed = weft_tests::stdout(&weft_tests::run(
        std::process::Command::new("nsenter")
            .arg(format!("--mount=/proc/{pid}/ns/mnt"))
            .args(["ip", "netns", "list"]),
    ));
    for b in ["s2", "s3", "s4"] {
        let ns = weft_controller::render::peering_namespace("s1", b);
        assert!(listed.contains(&ns), "{ns} not in {listed}");
        assert_ne!(ns, weft_controller::render::peering_namespace(b, "s1"));
    }

    weft_tests::step("all four sites reach each other");
    all_reach(&mesh, &[0, 1, 2, 3]);

    weft_tests::step("long-lived traffic on the tunnels that stay");
    // Long-lived traffic on every tunnel that stays: a TCP connection and
    // a 10 Hz ping per pair. s1–s2 is the peering that will be deleted.
    let stays: Vec<(usize, usize)> = vec![(0, 2), (0, 3), (1, 2), (1, 3), (2, 3)];
    let stop = mesh.dir.path().join("stop-holding");
    let mut holds = Vec::new();
    let mut pings = Vec::new();
    for &(a, b) in &stays {
        let addr = mesh.address(a, b).unwrap();
        let wl = mesh.sites[a].wl.clone();
        let log = mesh.dir.path().join(format!("hold-{a}-{b}.log"));
        holds.push(mesh.lab.spawn(
            &wl,
            &bin("weft-echo"),
            &[
                "hold",
                &format!("{addr}:{ECHO_PORT}"),
                "--until",
                stop.to_str().unwrap(),
            ],
            &log,
        ));
        let log = mesh.dir.path().join(format!("ping-{a}-{b}.log"));
        pings.push(mesh.lab.spawn(
            &wl,
            std::path::Path::new("/usr/bin/ping"),
            &["-D", "-i", "0.1", &addr],
            &log,
        ));
    }
    std::thread::sleep(Duration::from_secs(2));
    let lost_before = probes_lost(&mesh, &[0, 1, 2, 3]);

    weft_tests::step("a fifth site joins the running mesh");
    // A fifth site joins the running mesh, peered with all four.
    let t = Instant::now();
    let five = mesh.add_site();
    for a in 0..4 {
        mesh.peer(five, a);
    }
    eprintln!("the fifth site joined in {:.1}s", t.elapsed().as_secs_f64());
    all_reach(&mesh, &[0, 1, 2, 3, 4]);

    weft_tests::step("s1 and s2 part");
    // s1 and s2 part: neither reaches the other any more, from either side.
    let (s1_to_s2, s2_to_s1) = (mesh.address(0, 1).unwrap(), mesh.address(1, 0).unwrap());
    mesh.unpeer(0, 1);
    for (from, addr) in [(0, &s1_to_s2), (1, &s2_to_s1)] {
        eventually("the deleted pair stops reaching", Duration::from_secs(10), || {
            mesh.ask_at(from, addr).is_err().then_some(())
        });
    }
    assert!(mesh.reaches(0, 1).is_err() && mesh.reaches(1, 0).is_err());
    std::thread::sleep(Duration::from_secs(2));

    weft_tests::step("nothing else noticed the changes");
    // Nothing else noticed: every held connection is intact, no ping went
    // unanswered, no tunnel probe was lost on the tunnels that stayed.
    let end = unix_now();
    std::fs::write(&stop, "").unwrap();
    for (h, &(a, b)) in holds.iter().zip(&stays) {
        let st = mesh.lab.proc(*h).wait_exit(Duration::from_secs(10));
        let log = mesh.lab.proc(*h).log_text();
        assert!(
            st.is_some_and(|s| s.success()) && log.contains("HELD"),
            "{a}->{b}: {log}"
        );
        eprintln!("{a}->{b}: {}", log.trim());
    }
    for (p, &(a, b)) in pings.iter().zip(&stays) {
        let answers = ping_answers(&mesh.lab.proc(*p).log_text());
        let seqs: Vec<u64> = answers.iter().map(|(_, s)| *s).collect();
        let (first, last) = (seqs[0], *seqs.last().unwrap());
        let missing: Vec<u64> = (first..=last).filter(|s| !seqs.contains(s)).collect();
        assert!(missing.is_empty(), "{a}->{b}: pings {missing:?} unanswered");
        assert!(
            answers.last().unwrap().0 > end - 1.0,
            "{a}->{b}: the pings stopped being answered"
        );
        eprintln!("{a}->{b}: {} pings, none lost", seqs.len());
    }
    let lost_after = probes_lost(&mesh, &[0, 1, 2, 3]);
    for &(a, b) in &stays {
        for pair in [(a, b), (b, a)] {
            assert_eq!(
                lost_before.get(&pair),
                lost_after.get(&pair),
                "tunnel {pair:?} lost probes during the changes"
            );
        }
    }
}

/// `connected` means the path works: three sites peered at once, every
/// peering watched until all show `connected` (each showing `connecting`
/// before, with what it waits for), then each site's workload asks each
/// other's once, with one second for the answer.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn three_sites_show_connected_only_once_traffic_flows() {
    if !netns::require_root() {
        return;
    }
    let mesh = Mesh::up("wcn", 3, POD);
    let c = mesh.connect_all_then_ask(&[0, 1, 2], Duration::from_secs(1), Duration::from_secs(60));
    eprintln!(
        "all connected after {:?}; connecting seen {} times, waiting for: {:#?}",
        c.connected_after, c.connecting_seen, c.waiting_for
    );
    for (pair, after, r) in &c.asks {
        eprintln!("{pair}: {r:?} ({after:?} after all showed connected)");
    }
    for (pair, after, r) in &c.asks {
        assert!(
            r.is_ok(),
            "{pair}: no answer within 1 s although every peering showed connected ({after:?} before): {r:?}"
        );
    }
    assert!(
        c.connecting_seen > 0 && !c.waiting_for.is_empty(),
        "no peering was seen connecting, with what it waits for, on the way"
    );
}
