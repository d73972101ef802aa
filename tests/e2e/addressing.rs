//! Cross-site addressing end to end, as root in namespaces with the real
//! binaries: two sites on the same CIDR, a third that forces a new remap;
//! `weftctl translate`, names resolved by each node's DNS responder (`dig`
//! and `getent hosts`), their removal with the peering and their move with
//! a view change, and a LAN host exported through the external CIDR.

use std::time::{Duration, Instant};

use weft_tests::netns::{self, Lab};
use weft_tests::sites::{self, TwoSites};
use weft_tests::{bin, eventually, run, stdout, weftctl_json};

const ZONE: &str = "weft.internal";

/// `dig` from host `ns` against the responder at `server`: (status, answers).
fn dig(lab: &Lab, ns: &str, server: &str, name: &str) -> (String, Vec<String>) {
    let o = lab.exec(
        ns,
        &[
            "dig",
            &format!("@{server}"),
            name,
            "A",
            "+time=1",
            "+tries=1",
            "+noall",
            "+comments",
            "+answer",
        ],
    );
    let out = stdout(&o);
    let status = out
        .lines()
        .find_map(|l| l.split("status: ").nth(1))
        .map(|s| s.split(',').next().unwrap_or_default().to_string())
        .unwrap_or_else(|| format!("no answer: {out}{}", String::from_utf8_lossy(&o.stderr)));
    let answers = out
        .lines()
        .filter(|l| !l.starts_with(';') && l.contains("\tA\t"))
        .filter_map(|l| l.split_whitespace().last().map(str::to_string))
        .collect();
    (status, answers)
}

fn weftctl(target: &str, args: &[&str]) -> std::process::Output {
    run(std::process::Command::new(bin("weftctl"))
        .arg("--controller")
        .arg(target)
        .args(args))
}

/// A TCP connection from host `from` to `to`:5300; what the far end said.
fn connect(lab: &Lab, from: &str, to: &str) -> Result<String, String> {
    let client =
        format!("import socket\ns=socket.create_connection(('{to}',5300),timeout=3)\nprint(s.recv(200).decode())");
    let o = lab.exec(from, &["python3", "-c", &client]);
    if o.status.success() {
        Ok(stdout(&o).trim().to_string())
    } else {
        Err(String::from_utf8_lossy(&o.stderr).into_owned())
    }
}

/// A server on host `ns`, port 5300, that tells each caller `who` and the
/// caller's address as it sees it.
fn serve(s: &mut TwoSites, ns: &str, who: &str) {
    let py = format!(
        "import socket\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\ns.bind(('0.0.0.0',5300))\ns.listen(16)\nwhile True:\n    c,a=s.accept()\n    c.sendall(('{who} sees '+a[0]).encode())\n    c.close()"
    );
    let log = s.dir.path().join(format!("serve-{who}.log"));
    s.lab
        .spawn(ns, std::path::Path::new("/usr/bin/env"), &["python3", "-c", &py], &log);
}

/// Points `ip netns exec NS` processes' resolver at the node's responder
/// first, then at `fallback` (the host's resolver), as an operator would
/// for workloads; removed on drop.
struct Resolv(std::path::PathBuf, bool);

impl Resolv {
    fn new(ns: &str, server: &str, fallback: &str) -> Resolv {
        let made_parent = !std::path::Path::new("/etc/netns").exists();
        let dir = std::path::PathBuf::from(format!("/etc/netns/{ns}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("resolv.conf"),
            format!("nameserver {server}\nnameserver {fallback}\noptions timeout:1 attempts:1\n"),
        )
        .unwrap();
        Resolv(dir, made_parent)
    }
}

impl Drop for Resolv {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
        if self.1 {
            let _ = std::fs::remove_dir("/etc/netns");
        }
    }
}

fn translate(target: &str, args: &[&str]) -> serde_json::Value {
    let mut a = vec!["translate"];
    a.extend(args);
    weftctl_json(target, &a)
}

fn tunnel_up(s: &TwoSites) {
    for (t, peer) in [(&s.ta, &s.site_b), (&s.tb, &s.site_a)] {
        eventually(&format!("the tunnel to {peer} up"), Duration::from_secs(60), || {
            weftctl_json(t, &["peerings"])["peerings"]
                .as_array()?
                .iter()
                .find(|p| p["site_id"] == peer.as_str())?["tunnel"]["up"]
                .as_bool()
                .filter(|u| *u)
        });
    }
}

#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn names_resolve_to_local_views_follow_changes_and_reach_exported_lan_hosts() {
    if !netns::require_root() {
        return;
    }
    let pod = "10.1.0.0/16";
    let mut s = sites::up("nm", ("site-a", pod), ("site-b", pod));
    let (ta, tb) = (s.ta.clone(), s.tb.clone());
    let (wa, wb) = (s.ns["wa"].clone(), s.ns["wb"].clone());
    // wa (10.1.0.10) sits on node na, whose subnet 10.1.0.0/24 starts at
    // 10.1.0.1: its responder (default --dns-listen subnet).
    let responder = "10.1.0.1";
    let wb_real = s.workloads.iter().find(|w| w.0 == "wb").unwrap().1.clone();
    tunnel_up(&s);
    serve(&mut s, &wb, "site-b");
    let (_, old_b_view) = weft_tests::peer_view(&ta, "site-b", "workload");

    weft_tests::step("translation both ways");
    // Translation, both ways.
    let t = translate(&ta, &["site-b", &wb_real]);
    assert_eq!(t["local_address"], s.wb_from_a.as_str(), "{t}");
    assert_eq!(t["kind"], "workload");
    let back = translate(&ta, &[&s.wb_from_a]);
    assert_eq!(
        (back["site"].as_str(), back["real_address"].as_str()),
        (Some("site-b"), Some(wb_real.as_str()))
    );
    weft_tests::step("clear errors outside the views");
    // Outside every view, and for a site that is not a peer: clear errors.
    let o = weftctl(&ta, &["translate", "site-b", "10.9.0.1"]);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("none of site-b's IPv4 CIDRs"),
        "{o:?}"
    );
    let o = weftctl(&ta, &["translate", "site-z", "10.1.0.10"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("NOT_FOUND"), "{o:?}");

    weft_tests::step("a published name resolves on the peer");
    // Site b publishes wb as "web"; wa resolves it against its node and
    // connects to the answer; site b answers.
    let o = weftctl(&tb, &["name", "add", "web", &wb_real]);
    assert!(o.status.success(), "{o:?}");
    let web = format!("web.site-b.{ZONE}");
    let lab = &s.lab;
    let got = eventually("web resolving on site a's node", Duration::from_secs(20), || {
        let (st, a) = dig(lab, &wa, responder, &web);
        (st == "NOERROR" && !a.is_empty()).then_some(a)
    });
    assert_eq!(got, [s.wb_from_a.clone()], "dig answered the local view");
    let said = connect(lab, &wa, &got[0]).expect("wa connects to the answer");
    assert!(said.starts_with("site-b sees"), "{said}");
    // getent (the host's resolver library) resolves it too; a name outside
    // the zone is refused by the responder and answered by the next
    // nameserver, standing in for the host's resolver (on wa's loopback:
    // it answers every A query with 192.0.2.7).
    let host_resolver = r#"
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(('127.0.0.1', 53))
while True:
    d, a = s.recvfrom(512)
    i = 12
    while d[i]:
        i += d[i] + 1
    q = d[12:i + 5]
    if d[i + 1:i + 3] == b'\0\1':
        r = d[:2] + bytes.fromhex('81800001000100000000') + q + bytes.fromhex('c00c00010001000000050004c0000207')
    else:
        r = d[:2] + bytes.fromhex('81800001000000000000') + q
    s.sendto(r, a)
"#;
    let log = s.dir.path().join("host-resolver.log");
    s.lab.spawn(
        &wa,
        std::path::Path::new("/usr/bin/env"),
        &["python3", "-c", host_resolver],
        &log,
    );
    let lab = &s.lab;
    let resolv = Resolv::new(&wa, responder, "127.0.0.1");
    let o = lab.exec(&wa, &["getent", "hosts", &web]);
    assert!(o.status.success(), "getent: {o:?}");
    assert!(stdout(&o).starts_with(&s.wb_from_a), "{}", stdout(&o));
    let other = eventually(
        "getent falling through to the host's resolver",
        Duration::from_secs(10),
        || {
            let o = lab.exec(&wa, &["getent", "hosts", "other.example"]);
            o.status.success().then(|| stdout(&o))
        },
    );
    assert!(other.starts_with("192.0.2.7"), "{other}");
    weft_tests::step("names outside the zone");
    // Names outside the zone are refused (left to the host's resolver),
    // absent ones are NXDOMAIN.
    assert_eq!(dig(lab, &wa, responder, "example.com").0, "REFUSED");
    assert_eq!(dig(lab, &wa, responder, &format!("nope.site-b.{ZONE}")).0, "NXDOMAIN");
    weft_tests::step("hostile datagrams");
    // Hostile datagrams: random bytes, truncated and mangled queries, a
    // response; then a flood from one workload. The responder answers
    // every well-formed query after them and counts the flood as limited.
    let junk = format!(
        r#"
import random, socket
r = random.Random(7)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
q = bytes.fromhex('123401000001000000000000') + b''.join(bytes([len(l)]) + l.encode() for l in '{web}'.split('.')) + b'\0\0\1\0\1'
for i in range(3000):
    k = i % 4
    if k == 0: d = bytes(r.randrange(256) for _ in range(r.randrange(300)))
    elif k == 1: d = q[:r.randrange(len(q))]
    elif k == 2: d = bytes(b ^ (r.randrange(256) if r.random() < 0.1 else 0) for b in q)
    else: d = q[:2] + bytes([0x81, 0x80]) + q[4:]
    s.sendto(d, ('{responder}', 53))
for i in range(5000):
    s.sendto(q, ('{responder}', 53))
"#
    );
    netns::must(
        lab.exec(&wa, &["python3", "-c", &junk]),
        "sending junk and a flood to the responder",
    );
    std::thread::sleep(Duration::from_millis(1100));
    let (st, a) = dig(lab, &wa, responder, &web);
    assert_eq!(
        (st.as_str(), a),
        ("NOERROR", vec![s.wb_from_a.clone()]),
        "after junk and a flood"
    );
    let metrics = s.scrape("na");
    let count = |o: &str| weft_tests::sites::metric(&metrics, "weft_node_dns_queries_total", &[("outcome", o)]);
    let limited = count("limited").unwrap_or(0.0);
    assert!(limited > 0.0, "the flood was not limited:\n{metrics}");
    assert!(count("dropped").unwrap_or(0.0) > 0.0, "no junk was dropped:\n{metrics}");
    println!(
        "the responder answered {:?}, dropped {:?} (not queries), limited {limited} of the flood",
        count("answered"),
        count("dropped")
    );
    weft_tests::step("a peer's workload gets no answers");
    // A peer's workload gets nothing from the responder (it would learn
    // site a's other peers): wb asks na's responder through b's view.
    let na_from_b = translate(&tb, &["site-a", responder])["local_address"]
        .as_str()
        .unwrap()
        .to_string();
    let (st, _) = dig(lab, &wb, &na_from_b, &web);
    assert!(st.starts_with("no answer"), "a peer was answered: {st}");
    let metrics = s.scrape("na");
    let from_peer = weft_tests::sites::metric(&metrics, "weft_node_dns_queries_total", &[("outcome", "from_peer")]);
    assert!(from_peer.unwrap_or(0.0) >= 1.0, "{metrics}");
    // weftctl shows what b publishes and what a learned.
    let learned = weftctl_json(&ta, &["names"])["learned"].clone();
    assert_eq!(learned[0]["local_address"], s.wb_from_a.as_str(), "{learned}");
    assert_eq!(weftctl_json(&tb, &["names"])["published"][0]["name"], "web");

    weft_tests::step("an exported LAN host");
    // A LAN host of site b (a namespace on b's underlay, not a workload),
    // exported as "db": reached from wa by name, and it sees the client at
    // an address inside b's view of a.
    let lanb = s.lab.host("lanb");
    s.lab.plug(&lanb, "192.168.78.30/24");
    let (_, b_view_of_a) = weft_tests::peer_view(&tb, "site-a", "workload");
    // Its replies to peers go back through b's gateway (its router for them).
    netns::must(
        s.lab
            .exec(&lanb, &["ip", "route", "add", &b_view_of_a, "via", "192.168.78.20"]),
        "the LAN host's route back",
    );
    serve(&mut s, &lanb, "lan-host");
    // Not the gateway's own address (nor a controller's).
    let o = weftctl(&tb, &["name", "add", "gw", "192.168.78.20", "--export"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && e.contains("address: 192.168.78.20 is the address of gateway"),
        "{e}"
    );
    let o = weftctl(&tb, &["name", "add", "db", "192.168.78.30", "--export"]);
    assert!(o.status.success(), "{o:?}");
    let db = format!("db.site-b.{ZONE}");
    let lab = &s.lab;
    let db_at = eventually("db resolving on site a's node", Duration::from_secs(20), || {
        let (st, a) = dig(lab, &wa, responder, &db);
        (st == "NOERROR" && !a.is_empty()).then(|| a[0].clone())
    });
    let (_, a_view_of_b_ext) = weft_tests::peer_view(&ta, "site-b", "external");
    let inside = |addr: &str, cidr: &str| {
        let n: ipnet::Ipv4Net = cidr.parse().unwrap();
        n.contains(&addr.parse::<std::net::Ipv4Addr>().unwrap())
    };
    assert!(
        inside(&db_at, &a_view_of_b_ext),
        "{db_at} not in a's view of b's external CIDR {a_view_of_b_ext}"
    );
    let said = eventually("wa reaching the exported LAN host", Duration::from_secs(20), || {
        connect(lab, &wa, &db_at).ok()
    });
    let seen = said.strip_prefix("lan-host sees ").unwrap_or_else(|| panic!("{said}"));
    println!(
        "db.site-b resolves to {db_at} on site a; the LAN host sees the client as {seen} (b's view of a: {b_view_of_a})"
    );
    assert!(
        inside(seen, &b_view_of_a),
        "the LAN host saw {seen}, not inside b's view of a ({b_view_of_a})"
    );

    weft_tests::step("names gone after the peering is deleted");
    // The peering deleted: the names stop resolving within 2 s.
    let o = weftctl(&ta, &["peering", "delete", "site-b"]);
    assert!(o.status.success(), "{o:?}");
    let deleted = Instant::now();
    eventually("web gone after the peering", Duration::from_secs(10), || {
        (dig(lab, &wa, responder, &web).0 == "NXDOMAIN").then_some(())
    });
    let gone_after = deleted.elapsed();
    println!("NXDOMAIN {gone_after:?} after the peering was deleted");
    assert!(gone_after < Duration::from_secs(2), "{gone_after:?}");

    weft_tests::step("a view change moves the name");
    // A view change: site c (same CIDR) peers first and takes the remap
    // block b had; b peered again gets a new view, and web follows it.
    let ctlc = s.lab.host("ctlc");
    s.lab.plug(&ctlc, "192.168.78.3/24");
    s.lab
        .adopt(&weft_controller::render::peering_namespace("site-a", "site-c"));
    let tc = s.lab.controller(
        &ctlc,
        weft_tests::ControllerSpec::new("site-c")
            .data_dir(&s.dir.path().join("site-c"))
            .pod(pod)
            .listen("192.168.78.3:7443"),
    );
    let peer = |a: &str, b: &str| {
        let token = weftctl_json(b, &["peering", "token"])["token"]
            .as_str()
            .unwrap()
            .to_string();
        let o = weftctl(a, &["peering", "create", "--token", &token]);
        assert!(o.status.success(), "{o:?}");
    };
    peer(&ta, &tc);
    let (_, c_view) = weft_tests::peer_view(&ta, "site-c", "workload");
    peer(&ta, &tb);
    let (_, new_b_view) = weft_tests::peer_view(&ta, "site-b", "workload");
    assert_eq!(c_view, old_b_view, "site c took the block b had");
    assert_ne!(new_b_view, old_b_view, "b got a new view");
    let new_at = translate(&ta, &["site-b", &wb_real])["local_address"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(inside(&new_at, &new_b_view));
    tunnel_up(&s);
    let lab = &s.lab;
    let got = eventually("web resolving to the new view", Duration::from_secs(30), || {
        let (st, a) = dig(lab, &wa, responder, &web);
        (st == "NOERROR" && a == [new_at.clone()]).then_some(a)
    });
    assert_eq!(got, std::slice::from_ref(&new_at));
    println!(
        "web.site-b: {} in view {old_b_view}, then {new_at} in view {new_b_view} (site c took {c_view})",
        s.wb_from_a
    );
    let said = eventually("wa reaching wb at the new view", Duration::from_secs(30), || {
        connect(lab, &wa, &new_at).ok()
    });
    assert!(said.starts_with("site-b sees"), "{said}");
    drop(resolv);
}
