//! Exported LAN hosts on the data path: an export moved to another host
//! takes a flow that never idles with it. Two sites on one workload CIDR;
//! site B's LAN hosts sit on the shared WAN and route A's view back
//! through B's gateway. Needs root: run under CI=true.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use weft_tests::mesh::Mesh;
use weft_tests::{bin, eventually, netns, weftctl_json};

const POD: &str = "10.1.0.0/16";
/// The UDP (and TCP) port the LAN hosts' `weft-echo serve` listens on.
const PORT: u16 = 7100;

fn now_ms() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis()
}

/// `(unix ms, answering host)` for each answer a `weft-echo flow` logged.
fn answers(log: &str) -> Vec<(u128, String)> {
    log.lines()
        .filter_map(|l| {
            let (ms, who) = l.split_once(' ')?;
            Some((ms.parse().ok()?, who.to_string()))
        })
        .collect()
}

/// A LAN host of site `site` at `addr` (on the WAN, beside its gateway),
/// routing `back` (the site's view of its peer) to `via`, serving as `name`.
fn lan_host(mesh: &mut Mesh, tag: &str, addr: &str, back: &str, via: &str) {
    let ns = mesh.lab.host(tag);
    mesh.lab.plug(&ns, &format!("{addr}/24"));
    netns::must(
        mesh.lab.exec(&ns, &["ip", "route", "add", back, "via", via]),
        "the LAN host's route back",
    );
    let log = mesh.dir.path().join(format!("{tag}.log"));
    mesh.lab.spawn(
        &ns,
        &bin("weft-echo"),
        &["serve", "--port", &PORT.to_string(), "--name", tag],
        &log,
    );
}

#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn a_moved_export_takes_a_running_udp_flow_to_the_new_host_within_a_second() {
    if !netns::require_root() {
        return;
    }
    let (a, b) = (0, 1);
    weft_tests::step("two sites on one CIDR, peered; B exports LAN host x as db");
    let mut mesh = Mesh::up("exp", 2, POD);
    mesh.peer(a, b);
    // B's gateway's address on the LAN (the WAN here), and B's view of A.
    let gw_b = "192.168.78.22";
    let back = mesh.view_of(b, a).unwrap().to_string();
    lan_host(&mut mesh, "lanx", "192.168.78.250", &back, gw_b);
    lan_host(&mut mesh, "lany", "192.168.78.251", &back, gw_b);
    let t = mesh.sites[b].target.clone();
    weftctl_json(&t, &["name", "add", "db", "192.168.78.250", "--export"]);
    let external = weftctl_json(&t, &["names"])["published"][0]["external_address"]
        .as_str()
        .unwrap()
        .to_string();
    let db_at = eventually("A learns db", Duration::from_secs(20), || {
        let n = weftctl_json(&mesh.sites[a].target, &["names"]);
        n["learned"].as_array()?.iter().find(|n| n["name"] == "db")?["local_address"]
            .as_str()
            .map(String::from)
    });
    eprintln!("db: {external} at B, {db_at} at A");

    weft_tests::step("a UDP flow from A's workload runs all along");
    let stop = mesh.dir.path().join("flow.stop");
    let log = mesh.dir.path().join("flow.log");
    let wl = mesh.sites[a].wl.clone();
    let target = format!("{db_at}:{PORT}");
    let flow = mesh.lab.spawn(
        &wl,
        &bin("weft-echo"),
        &["flow", &target, "--until", stop.to_str().unwrap(), "--every", "20ms"],
        &log,
    );
    let read = || std::fs::read_to_string(&log).unwrap_or_default();
    eventually("the flow reaches host x", Duration::from_secs(20), || {
        answers(&read()).iter().any(|(_, w)| w == "lanx").then_some(())
    });

    weft_tests::step("db moves to host y; the flow follows within a second");
    let moved_at = now_ms();
    weftctl_json(&t, &["name", "delete", "db"]);
    weftctl_json(&t, &["name", "add", "db", "192.168.78.251", "--export"]);
    let again = weftctl_json(&t, &["names"])["published"][0]["external_address"].clone();
    assert_eq!(
        again.as_str(),
        Some(external.as_str()),
        "db got another external address"
    );
    let first_y = eventually("the flow reaches host y", Duration::from_secs(10), || {
        answers(&read())
            .into_iter()
            .find(|(ms, w)| *ms >= moved_at && w == "lany")
            .map(|(ms, _)| ms)
    });
    std::thread::sleep(Duration::from_millis(500));
    std::fs::write(&stop, "").unwrap();
    mesh.lab.proc(flow).wait_exit(Duration::from_secs(5));
    let all = answers(&read());
    let late_x: Vec<u128> = all
        .iter()
        .filter(|(ms, w)| *ms > first_y && w == "lanx")
        .map(|(ms, _)| *ms)
        .collect();
    let took = first_y - moved_at;
    eprintln!(
        "the flow reached host y {took} ms after the move ({} answers in all)",
        all.len()
    );
    assert!(late_x.is_empty(), "host x still answered after host y did: {late_x:?}");
    assert!(took < 1000, "the running flow took {took} ms to reach the moved export");
}
