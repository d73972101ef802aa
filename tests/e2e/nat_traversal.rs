//! The lab's NAT routers, as the NAT-traversal work needs them: a private
//! LAN behind a router of namespaces and nftables maps a host's UDP socket
//! the way a home router does (one outside port, kept, whatever the
//! destination) or the way carrier-grade NAT does (a new port per
//! destination), and answers come back through it.

use weft_tests::netns::{Lab, Nat, must, require_root};
use weft_tests::stdout;

/// A UDP server that answers each datagram with the address it came from.
const REFLECT: &str = "import socket\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n\
s.bind(('0.0.0.0',7000))\nprint('ready',flush=True)\nwhile True:\n    d,a=s.recvfrom(100)\n    \
s.sendto(('%s:%d'%a).encode(),a)";

/// From one socket bound to port 40000, asks both reflectors how they see
/// it; prints their answers, one a line.
const ASK: &str = "import socket,sys\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n\
s.bind(('0.0.0.0',40000))\ns.settimeout(3)\nfor h in sys.argv[1:]:\n    s.sendto(b'x',(h,7000))\n    \
print(s.recvfrom(100)[0].decode(),flush=True)";

/// Sites TAG-a and TAG-b, both on 10.1.0.0/16, each behind a NAT router
/// of kind `nat`, their gateways without an endpoint, peered.
fn both_behind(nat: Nat, tag: &str) -> weft_tests::sites::TwoSites {
    let opts = weft_tests::sites::Opts {
        site_a_nat: Some(nat),
        site_b_nat: Some(nat),
        ..Default::default()
    };
    let (a, b) = (format!("{tag}-a"), format!("{tag}-b"));
    weft_tests::sites::up_with(tag, (a.as_str(), "10.1.0.0/16"), (b.as_str(), "10.1.0.0/16"), opts)
}

#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn the_labs_nat_routers_map_ports_as_home_routers_and_carrier_grade_nat_do() {
    require_root();
    weft_tests::step("two reflectors on the WAN");
    let dir = tempfile::Builder::new().prefix("weft-nat").tempdir().unwrap();
    let mut lab = Lab::new("nat");
    lab.lan();
    let reflectors = ["192.168.78.101", "192.168.78.102"];
    for (i, ip) in reflectors.iter().enumerate() {
        let h = lab.host(&format!("s{i}"));
        lab.plug(&h, &format!("{ip}/24"));
        let log = dir.path().join(format!("s{i}.log"));
        let p = lab.spawn(
            &h,
            std::path::Path::new("/usr/bin/env"),
            &["python3", "-c", REFLECT],
            &log,
        );
        weft_tests::eventually("the reflector", std::time::Duration::from_secs(10), || {
            lab.proc(p).log_text().contains("ready").then_some(())
        });
    }
    for (nat, name, wan, private) in [
        (Nat::EndpointIndependent, "ei", "192.168.78.201", "10.91.0"),
        (Nat::EndpointDependent, "ed", "192.168.78.202", "10.92.0"),
        (Nat::Bare, "bn", "192.168.78.203", "10.93.0"),
    ] {
        weft_tests::step(&format!("a host behind the {name} router asks both reflectors"));
        let lan = lab.nat_lan(&format!("r{name}"), &format!("{wan}/24"), private, nat);
        let host = lab.host(&format!("h{name}"));
        let inside = lab.plug_behind(&lan, &host, 10);
        let o = must(
            lab.exec(&host, &["python3", "-c", ASK, reflectors[0], reflectors[1]]),
            "asking the reflectors",
        );
        let seen: Vec<String> = stdout(&o).lines().map(str::to_string).collect();
        assert_eq!(seen.len(), 2, "both answered through the router: {seen:?}");
        for s in &seen {
            assert!(
                s.starts_with(&format!("{wan}:")),
                "seen as the router, not {inside}: {seen:?}"
            );
        }
        match nat {
            Nat::EndpointIndependent | Nat::Bare => assert_eq!(
                seen,
                [format!("{wan}:40000"), format!("{wan}:40000")],
                "one mapping, the port kept"
            ),
            Nat::EndpointDependent => assert_ne!(seen[0], seen[1], "a new port per destination"),
        }
        // Nothing on the WAN reaches the private LAN unasked.
        let o = lab.exec(&lab.ns("s0"), &["ping", "-c", "1", "-W", "1", &inside]);
        assert!(!o.status.success(), "{inside} was reachable from the WAN");
    }
}

/// A site whose gateway and nodes sit behind an endpoint-independent NAT
/// router and whose gateway has no `--endpoint` peers with a public site
/// directly: its gateway dials out through the NAT, the public one serves,
/// and the workloads reach each other both ways, each through its own view.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn a_site_behind_nat_without_an_endpoint_peers_directly_with_a_public_one() {
    require_root();
    weft_tests::step("site a behind NAT, site b public, peered");
    let started = std::time::Instant::now();
    let opts = weft_tests::sites::Opts {
        site_a_nat: Some(Nat::EndpointIndependent),
        ..Default::default()
    };
    let s = weft_tests::sites::up_with("nt", ("nt-a", "10.1.0.0/16"), ("nt-b", "10.1.0.0/16"), opts);
    weft_tests::step("a's gateway has no endpoint and dials out");
    let gws = weft_tests::weftctl_json(&s.ta, &["gateways"]);
    assert_eq!(gws["gateways"][0]["endpoint"], "", "{gws}");
    assert_eq!(gws["gateways"][0]["underlay_ip"], "192.168.10.10", "{gws}");
    weft_tests::step("the workloads reach each other both ways");
    weft_tests::sites::until_wa_reaches_wb(&s);
    let (wb, to_a) = (&s.ns["wb"], &s.wa_from_b);
    weft_tests::eventually("wb reaching wa", std::time::Duration::from_secs(30), || {
        s.lab
            .exec(wb, &["ping", "-c", "1", "-W", "1", to_a])
            .status
            .success()
            .then_some(())
    });
    println!(
        "NAT: one side behind NAT, connected in {:.1} s from the lab's start",
        started.elapsed().as_secs_f64()
    );
    weft_tests::step("a's traffic left through the router, and b cannot reach a's LAN");
    let nat = s.nat_a.as_ref().expect("site a is behind NAT");
    assert!(s.lab.nat_count(nat) > 0, "nothing was translated");
    let o = s
        .lab
        .exec(&s.ns["gwb"], &["ping", "-c", "1", "-W", "1", "192.168.10.10"]);
    assert!(!o.status.success(), "site a's gateway was reachable from the WAN");
    // b's gateway reports the tunnel up with its next probe (the workloads
    // may have been through before).
    let peers = weft_tests::eventually("b's tunnel reported up", std::time::Duration::from_secs(10), || {
        let peers = weft_tests::weftctl_json(&s.tb, &["peerings"]);
        (peers["peerings"][0]["tunnel"]["up"] == true).then_some(peers)
    });
    assert_eq!(peers["peerings"][0]["tunnel"]["path"], "direct", "{peers}");
    weft_tests::step("a's gateway found its NAT: one outside port for both reflectors");
    weft_tests::eventually("a's NAT observed", std::time::Duration::from_secs(20), || {
        let gws = weft_tests::weftctl_json(&s.ta, &["gateways"]);
        (gws["gateways"][0]["nat"] == "endpoint-independent").then_some(())
    });
}

/// Both sites behind endpoint-independent NAT (a home router's), neither
/// gateway with an endpoint: each gateway learns its NAT's mapping from
/// the controllers' reflectors, the controllers exchange it, and both
/// gateways send to each other at once, so each NAT lets the other in.
/// Also: a forged discovery answer changes nothing and is counted, and the
/// tunnel comes back after both routers forget their mappings.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn two_sites_behind_endpoint_independent_nat_connect_directly_by_hole_punching() {
    require_root();
    weft_tests::step("sites a and b each behind a home router, peered");
    let s = both_behind(Nat::EndpointIndependent, "nh");
    weft_tests::step("connected, directly, within 8 s of the peering");
    s.reach_quickly("wa", &s.wb_from_a, std::time::Duration::from_secs(30));
    let took = s.peered_at.elapsed();
    println!(
        "NAT: both sides behind endpoint-independent NAT, connected {:.2} s after the peering was created",
        took.as_secs_f64()
    );
    // (2 s of it the punch TTL's first handshakes, which cannot arrive)
    let bound = weft_tests::pace::scaled(std::time::Duration::from_secs(8));
    assert!(
        took <= bound,
        "connected after {took:?}, over {bound:?} {}",
        weft_tests::pace::describe()
    );
    for (t, router) in [(&s.ta, "192.168.78.30"), (&s.tb, "192.168.78.31")] {
        // Claimed once the gateway reports the tunnel up (its probe runs
        // every second; the workloads may have been through before).
        let peers = weft_tests::eventually(
            "the path shown hole-punched",
            std::time::Duration::from_secs(10),
            || {
                let peers = weft_tests::weftctl_json(t, &["peerings"]);
                (peers["peerings"][0]["tunnel"]["path"] == "hole-punched").then_some(peers)
            },
        );
        let p = &peers["peerings"][0];
        assert_eq!(p["tunnel"]["nat"], "endpoint-independent", "{peers}");
        let own = p["local_gateways"][0]["candidates"].to_string();
        assert!(
            own.contains(&format!("{router}:51820")),
            "its NAT's mapping, the port kept: {own}"
        );
        assert!(
            !own.contains("192.168.1"),
            "private addresses are not sent to peers: {own}"
        );
    }
    let m = s.scrape("ctla");
    assert_eq!(
        weft_tests::sites::metric(&m, "weft_controller_peering_path", &[("path", "hole-punched")]),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        weft_tests::sites::metric(
            &m,
            "weft_controller_gateway_nat",
            &[("behaviour", "endpoint-independent")]
        ),
        Some(1.0)
    );
    let nat_a = s.nat_a.as_ref().unwrap();

    weft_tests::step("forged discovery answers are ignored and counted");
    // From a's LAN, as if from a's reflector (its address and port) but
    // with nonces a's gateway never sent, claiming another address; and
    // from a host that is no reflector at all. A discovery round (every
    // 5 s) is running within the 7 s they are sent for.
    let ignored = |s: &weft_tests::sites::TwoSites| {
        weft_tests::sites::metric(
            &s.scrape("gwa"),
            "weft_gateway_discovery_datagrams_total",
            &[("outcome", "ignored")],
        )
        .unwrap_or(0.0)
    };
    let before = ignored(&s);
    let o = s.lab.exec(
        &s.ns["na"],
        &[
            "python3",
            "-c",
            FORGE,
            "192.168.78.1",
            "7443",
            "192.168.10.10",
            "51820",
            "7",
        ],
    );
    assert!(o.status.success(), "{}", weft_tests::stderr(&o));
    assert!(ignored(&s) > before, "the forged answers were not counted");
    let peers = weft_tests::weftctl_json(&s.ta, &["peerings"]);
    let own = peers["peerings"][0]["local_gateways"][0]["candidates"].to_string();
    assert!(!own.contains("203.0.113.66"), "a forged answer was taken: {own}");
    assert!(own.contains("192.168.78.30:51820"), "{own}");

    weft_tests::step("both routers forget their mappings: back within 5 s");
    let translated = s.lab.nat_count(nat_a);
    for r in ["ra", "rb"] {
        let o = s.lab.exec(&s.lab.ns(r), &["conntrack", "-F"]);
        assert!(o.status.success(), "conntrack -F on {r}: {}", weft_tests::stderr(&o));
    }
    let flushed = std::time::Instant::now();
    s.reach_quickly("wa", &s.wb_from_a, std::time::Duration::from_secs(30));
    s.reach_quickly("wb", &s.wa_from_b, std::time::Duration::from_secs(30));
    let back = flushed.elapsed();
    println!(
        "NAT: both mappings flushed, the tunnel back in {:.2} s",
        back.as_secs_f64()
    );
    assert!(back <= bound, "back after {back:?}, over {bound:?}");
    assert!(s.lab.nat_count(nat_a) > translated, "no new mapping was made");
}

/// Both sites behind endpoint-independent NAT, hole-punched; then 16 hosts
/// on the WAN flood both controllers' reflectors for 20 s with well-formed
/// probes from 64 forged addresses, far over the reflectors' budgets. The
/// gateways' probes are still answered (the controllers know their
/// addresses) and a round left unanswered changes nothing: throughout, each
/// gateway keeps its NAT behaviour and its NAT's mapping as a candidate,
/// and the peering stays hole-punched.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn a_flood_of_forged_probes_does_not_take_the_gateways_endpoint_discovery() {
    require_root();
    use std::time::{Duration, Instant};
    weft_tests::step("sites a and b each behind a home router: hole-punched");
    let mut s = both_behind(Nat::EndpointIndependent, "nf");
    weft_tests::sites::until_wa_reaches_wb(&s);
    let sides = [
        (s.ta.clone(), "nf-b", "192.168.78.30"),
        (s.tb.clone(), "nf-a", "192.168.78.31"),
    ];
    // What must hold on both sides, before and throughout the flood; what
    // does not, when something does not.
    let wrong = |(t, peer, router): &(String, &str, &str)| -> Option<String> {
        let gws = weft_tests::weftctl_json(t, &["gateways"]);
        if gws["gateways"][0]["nat"] != "endpoint-independent" {
            return Some(format!("the NAT behaviour at {t}: {gws}"));
        }
        let peers = weft_tests::weftctl_json(t, &["peerings"]);
        let p = peers["peerings"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["site_id"] == *peer)
            .cloned()
            .unwrap_or_default();
        if p["tunnel"]["path"] != "hole-punched" {
            return Some(format!("the path at {t}: {peers}"));
        }
        let own = p["local_gateways"][0]["candidates"].to_string();
        (!own.contains(&format!("{router}:51820"))).then(|| format!("the reflexive candidate at {t}: {own}"))
    };
    weft_tests::eventually(
        "hole-punched, the NAT observed, on both sides",
        Duration::from_secs(30),
        || sides.iter().all(|side| wrong(side).is_none()).then_some(()),
    );
    let limited = |s: &weft_tests::sites::TwoSites, ctl: &str| {
        weft_tests::sites::metric(
            &s.scrape(ctl),
            "weft_controller_discovery_datagrams_total",
            &[("result", "rate_limited")],
        )
        .unwrap_or(0.0)
    };
    let before = [limited(&s, "ctla"), limited(&s, "ctlb")];

    weft_tests::step("16 hosts flood both reflectors from 64 forged addresses for 20 s");
    const SECS: u64 = 20;
    let reflectors = "192.168.78.1:7443,192.168.78.2:7443";
    let mut flooders = Vec::new();
    for i in 0..16u8 {
        let host = s.lab.host(&format!("fl{i}"));
        s.lab.plug(&host, &format!("192.168.78.{}/24", 140 + i));
        // Forged: 4 addresses of the WAN per flooder that no host holds
        // (their answers wait for address resolution, and are dropped).
        let forged: Vec<String> = (0..4u8).map(|k| format!("192.168.78.{}", 160 + 4 * i + k)).collect();
        let log = s.dir.path().join(format!("flood{i}.log"));
        let (secs, pps, forged) = (SECS.to_string(), FLOOD_PPS.to_string(), forged.join(","));
        let args = ["python3", "-c", FLOOD, &secs, &pps, &forged, reflectors];
        flooders.push(s.lab.spawn(&host, std::path::Path::new("/usr/bin/env"), &args, &log));
    }
    let end = Instant::now() + Duration::from_secs(SECS);
    let mut looks = 0;
    while Instant::now() < end {
        for side in &sides {
            if let Some(w) = wrong(side) {
                panic!("during the flood ({looks} looks in), {w}");
            }
        }
        looks += 1;
        std::thread::sleep(Duration::from_millis(200));
    }
    weft_tests::step("the flood was over the reflectors' budgets, and ended");
    for i in flooders {
        let p = s.lab.proc(i);
        weft_tests::eventually("the flooder's end", Duration::from_secs(10), || {
            p.log_text().contains("sent").then_some(())
        });
    }
    for (ctl, was) in [("ctla", before[0]), ("ctlb", before[1])] {
        let now = limited(&s, ctl);
        // Each reflector got 20 s of 16 × FLOOD_PPS / 2 probes a second.
        let m = s.scrape(ctl);
        let seen: Vec<&str> = m.lines().filter(|l| l.contains("discovery")).collect();
        assert!(
            now - was >= 20_000.0,
            "{ctl}'s reflector limited only {} probes: the flood did not reach it: {seen:?}",
            now - was
        );
    }
    for side in &sides {
        assert_eq!(wrong(side), None, "after the flood");
    }
    println!("NAT: 20 s of forged probes at both reflectors, discovery and the hole punch held ({looks} looks)");
}

/// Probes a second each flooder sends, over both reflectors.
const FLOOD_PPS: u32 = 1600;

/// Sends well-formed discovery probes (as a gateway's) for SECS at PPS a
/// second, at most SECS × PPS of them, in turn from each of FORGED (comma
/// separated, spoofed on a raw socket) to each of REFLECTORS (host:port,
/// comma separated); prints how many it sent.
const FLOOD: &str = r#"
import os, socket, struct, sys, time
secs, pps = float(sys.argv[1]), int(sys.argv[2])
forged, reflectors = sys.argv[3].split(","), [r.split(":") for r in sys.argv[4].split(",")]
raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
# The answers' ports, held (no ICMP back), never read.
held = []
for k in range(8):
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.bind(("0.0.0.0", 40000 + k))
    held.append(u)
packets = []
for k in range(8):
    for src in forged:
        for host, port in reflectors:
            probe = b"WEFTDSC1" + bytes([1]) + os.urandom(16) + bytes(39)
            udp = struct.pack("!HHHH", 40000 + k, int(port), 8 + len(probe), 0) + probe
            ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0, socket.inet_aton(src), socket.inet_aton(host))
            packets.append((ip + udp, (host, 0)))
start, cap, sent = time.time(), int(secs * pps), 0
while sent < cap and time.time() < start + secs:
    due = min(cap, int((time.time() - start) * pps))
    while sent < due:
        p, to = packets[sent % len(packets)]
        try:
            raw.sendto(p, to)
        except OSError:
            pass
        sent += 1
    time.sleep(0.005)
print("sent", sent, flush=True)
"#;

/// Both sites behind endpoint-dependent NAT (carrier-grade NAT: a new port
/// per destination): no reflexive address works for the other side, so
/// weft does not pretend. The gateways report the NAT, the peering's path
/// is "waiting", and `diagnose` says why and what would fix it.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn two_sites_behind_endpoint_dependent_nat_are_told_why_direct_cannot_work() {
    require_root();
    weft_tests::step("sites a and b each behind carrier-grade NAT, peered");
    let s = both_behind(Nat::EndpointDependent, "nd");
    weft_tests::step("the NAT is observed and the path is waiting");
    weft_tests::eventually("a's NAT observed", std::time::Duration::from_secs(20), || {
        let gws = weft_tests::weftctl_json(&s.ta, &["gateways"]);
        (gws["gateways"][0]["nat"] == "endpoint-dependent").then_some(())
    });
    weft_tests::eventually("the path", std::time::Duration::from_secs(20), || {
        let peers = weft_tests::weftctl_json(&s.ta, &["peerings"]);
        (peers["peerings"][0]["tunnel"]["path"] == "waiting").then_some(())
    });
    weft_tests::step("diagnose says why and what fixes it");
    let o = weft_tests::run(std::process::Command::new(weft_tests::bin("weftctl")).args([
        "--controller",
        &s.ta,
        "diagnose",
    ]));
    let text = weft_tests::stdout(&o);
    assert!(
        text.contains("endpoint-dependent") && text.contains("forward UDP 51820-51919"),
        "{text}"
    );
}

/// Sends forged discovery answers to DST:DPORT for SECONDS: half from
/// SRC:SPORT (a reflector's address, spoofed on a raw socket) with random
/// nonces, half from this host's own port 7443; each claims the gateway
/// is at 203.0.113.66:666.
const FORGE: &str = r#"
import os, socket, struct, sys, time
src, sport, dst, dport, secs = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
def answer():
    return b"WEFTDSC1" + bytes([2]) + os.urandom(16) + socket.inet_aton("203.0.113.66") + struct.pack("!H", 666) + b"\0"
raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
plain = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
plain.bind(("0.0.0.0", 7443))
end = time.time() + secs
while time.time() < end:
    a = answer()
    udp = struct.pack("!HHHH", sport, dport, 8 + len(a), 0) + a
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0, socket.inet_aton(src), socket.inet_aton(dst))
    raw.sendto(ip + udp, (dst, 0))
    plain.sendto(answer(), (dst, dport))
    time.sleep(0.05)
"#;

/// The path site a's controller shows for its peering with `site`.
fn path_to(target: &str, site: &str) -> String {
    let peers = weft_tests::weftctl_json(target, &["peerings"]);
    peers["peerings"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["site_id"] == site)
        .map(|p| p["tunnel"]["path"].as_str().unwrap_or("").to_string())
        .unwrap_or_default()
}

/// Two sites each behind carrier-grade NAT (a new port per destination on
/// both sides: no direct path, no hole punch) connect through a third,
/// public site that relays and is peered with both: the tunnel, still
/// encrypted, goes through that site's gateway, within 10 s of the relay
/// being peered with both. A relay site peered with only one of them
/// refuses to relay to the other and counts it. When the relay site dies,
/// the tunnel moves to another relay site within 5 s.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn two_sites_behind_endpoint_dependent_nat_connect_through_a_relay_site_and_move_when_it_dies() {
    require_root();
    use std::time::{Duration, Instant};
    weft_tests::step("sites a and b each behind carrier-grade NAT, peered: no direct path");
    let mut s = both_behind(Nat::EndpointDependent, "nr");
    weft_tests::eventually("a's NAT observed", Duration::from_secs(20), || {
        let gws = weft_tests::weftctl_json(&s.ta, &["gateways"]);
        (gws["gateways"][0]["nat"] == "endpoint-dependent").then_some(())
    });
    assert_eq!(path_to(&s.ta, "nr-b"), "waiting");

    weft_tests::step("a relay site peered with a only refuses to relay to b, and counts it");
    let r2 = weft_tests::sites::relay_site(&mut s, "nr-r2", 2, "10.1.0.0/16", (true, false));
    weft_tests::eventually("the refusal counted", Duration::from_secs(20), || {
        let m = s.scrape("ctlr2");
        let n = weft_tests::sites::metric(
            &m,
            "weft_controller_relay_requests_refused_total",
            &[("reason", "not_peered")],
        );
        (n.unwrap_or(0.0) >= 1.0).then_some(())
    });
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(path_to(&s.ta, "nr-b"), "waiting", "a refused relay is not used");

    weft_tests::step("a relay site peered with both: the tunnel goes through it");
    let r1 = weft_tests::sites::relay_site(&mut s, "nr-r1", 1, "10.1.0.0/16", (true, true));
    let since = Instant::now();
    let wb = s.wb_from_a.clone();
    // A relay learns each side from a handshake, and a side's first one
    // often goes before the relay runs the session: weft's device sends
    // the next a second later (WireGuard's own retry would be 5 s later).
    s.reach_quickly("wa", &wb, weft_tests::pace::scaled(Duration::from_secs(20)));
    let took = since.elapsed();
    let bound = weft_tests::pace::scaled(Duration::from_secs(6));
    assert!(
        took <= bound,
        "relayed after {took:?}, over {bound:?} {}",
        weft_tests::pace::describe()
    );
    println!(
        "NAT: both sides behind endpoint-dependent NAT, connected through the relay site in {:.1} s after it peered with both",
        took.as_secs_f64()
    );
    weft_tests::eventually("both paths relayed", Duration::from_secs(10), || {
        (path_to(&s.ta, "nr-b") == "relayed via nr-r1" && path_to(&s.tb, "nr-a") == "relayed via nr-r1").then_some(())
    });
    let wa = s.wa_from_b.clone();
    s.reach_quickly("wb", &wa, Duration::from_secs(5));
    let m = s.scrape("gwr1");
    let relayed = weft_tests::sites::metric(
        &m,
        "weft_gateway_relay_packets_total",
        &[("from_site", "nr-a"), ("to_site", "nr-b")],
    );
    assert!(relayed.unwrap_or(0.0) > 0.0, "the relay's gateway carried nothing: {m}");

    weft_tests::step("the second relay site peers with b too: a standby relay");
    weft_tests::sites::peer_with(&r2.target, &s.tb);
    weft_tests::eventually("nr-r2 relays too", Duration::from_secs(30), || {
        let m = s.scrape("gwr2");
        m.contains("weft_gateway_relay_dropped").then_some(())
    });
    assert_eq!(
        path_to(&s.ta, "nr-b"),
        "relayed via nr-r1",
        "the smallest site id is kept"
    );

    weft_tests::step("nr-r1 dies (its gateway and controller): the tunnel moves to nr-r2");
    let (ping, log) = weft_tests::sites::ping_wa_to_wb(&mut s, "relay-failover.log");
    let at = weft_tests::unix_now();
    for i in r1.agents.iter().copied() {
        s.lab.proc(i).child.as_mut().unwrap().kill().unwrap();
    }
    s.lab.ctl(r1.controller).kill();
    weft_tests::eventually("the path moved", Duration::from_secs(20), || {
        (path_to(&s.ta, "nr-b") == "relayed via nr-r2").then_some(())
    });
    std::thread::sleep(Duration::from_secs(3));
    s.lab.proc(ping).child.as_mut().unwrap().kill().unwrap();
    let (gap, times) = weft_tests::sites::longest_gap(&log, at);
    println!("NAT: relay site died, tunnel moved to the next relay, longest silence {gap:.2} s");
    // Answered again after the fault, through the next relay, for the
    // seconds before the ping stopped.
    let after = times.iter().filter(|t| **t > at + gap).count();
    assert!(after >= 50, "only {after} pings answered after the relay died");
    assert!(gap <= 5.0, "the tunnel came back after {gap:.2} s");
    // Both moves counted: onto the first relay, then onto the next.
    let m = s.scrape("ctla");
    let moved = weft_tests::sites::metric(
        &m,
        "weft_controller_peering_path_changes_total",
        &[("peer_site", "nr-b"), ("path", "relayed")],
    );
    assert!(moved.is_some_and(|n| n >= 2.0), "moves to a relay: {moved:?}");
}

/// Two sites behind NAT routers with no firewall (cloud NAT instances),
/// a router between them as on the internet. Such a router delivers the
/// other side's first datagram to itself when it has no mapping yet, and
/// keeps a conntrack entry that makes it map its own gateway's port
/// elsewhere: the punch never opened. The gateways' first handshakes go
/// with the punch TTL (2): through their own NAT, opening its mapping,
/// dying at the router between; then at the full TTL, each NAT now
/// expecting the other.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn two_sites_behind_bare_nat_routers_hole_punch_with_ttl_limited_first_handshakes() {
    require_root();
    let bare = |tag: &str, punch_ttl: Option<u8>| {
        let opts = weft_tests::sites::Opts {
            site_a_nat: Some(Nat::Bare),
            site_b_nat: Some(Nat::Bare),
            site_b_beyond_hop: true,
            punch_ttl,
            ..Default::default()
        };
        let (a, b) = (format!("{tag}-a"), format!("{tag}-b"));
        weft_tests::sites::up_with(tag, (a.as_str(), "10.1.0.0/16"), (b.as_str(), "10.1.0.0/16"), opts)
    };
    weft_tests::step("sites a and b each behind a NAT router with no firewall, a router between, peered");
    let s = bare("nn", None);
    let (rb, ra) = (s.lab.ns("rb"), s.lab.ns("ra"));
    weft_tests::step("the router between decrements the TTL: a's router is two hops from b's LAN");
    let trace = s
        .lab
        .exec(&ra, &["ping", "-c", "1", "-W", "2", "-t", "1", "192.168.78.31"]);
    assert!(
        stdout(&trace).contains("Time to live exceeded") || stdout(&trace).contains("exceeded"),
        "a TTL of 1 from a's router does not reach b's: {}",
        stdout(&trace)
    );
    weft_tests::step("connected, hole-punched, within 10 s of the peering");
    s.reach_quickly("wa", &s.wb_from_a, std::time::Duration::from_secs(30));
    let took = s.peered_at.elapsed();
    println!(
        "NAT: both sides behind bare NAT (no firewall), connected {:.2} s after the peering was created",
        took.as_secs_f64()
    );
    let bound = weft_tests::pace::scaled(std::time::Duration::from_secs(10));
    assert!(
        took <= bound,
        "connected after {took:?}, over {bound:?} {}",
        weft_tests::pace::describe()
    );
    for t in [&s.ta, &s.tb] {
        weft_tests::eventually(
            "the path shown hole-punched",
            std::time::Duration::from_secs(10),
            || {
                let peers = weft_tests::weftctl_json(t, &["peerings"]);
                (peers["peerings"][0]["tunnel"]["path"] == "hole-punched").then_some(())
            },
        );
    }
    let wa = s.wa_from_b.clone();
    s.reach_quickly("wb", &wa, std::time::Duration::from_secs(5));
    weft_tests::eventually(
        "the move to hole-punched counted",
        std::time::Duration::from_secs(10),
        || {
            let m = s.scrape("ctla");
            weft_tests::sites::metric(
                &m,
                "weft_controller_peering_path_changes_total",
                &[("path", "hole-punched")],
            )
            .is_some_and(|n| n >= 1.0)
            .then_some(())
        },
    );
    for gw in ["gwa", "gwb"] {
        weft_tests::eventually(
            "the primed handshakes counted",
            std::time::Duration::from_secs(10),
            || {
                let m = s.scrape(gw);
                weft_tests::sites::metric(&m, "weft_peering_primed_handshakes_total", &[])
                    .is_some_and(|n| n >= 1.0)
                    .then_some(())
            },
        );
    }
    // Each router translated its gateway's port as it was (51820), toward
    // the other router: no collision remapped it.
    for (router, other) in [(&ra, "192.168.78.31"), (&rb, "192.168.78.30")] {
        let ct = s.lab.exec(
            router,
            &["conntrack", "-L", "-p", "udp", "--dport", "51820", "-d", other],
        );
        let text = stdout(&ct);
        // "udp ... src=GW dst=OTHER sport=51820 dport=51820 src=OTHER
        // dst=ROUTER sport=51820 dport=MAPPED ...": MAPPED is the port the
        // router gave, and replies came ([UNREPLIED] otherwise).
        let kept = text.lines().any(|l| {
            let reply = l.splitn(3, "src=").nth(2).unwrap_or("");
            !l.contains("UNREPLIED") && reply.contains("dport=51820 ")
        });
        assert!(
            kept,
            "{router}: the tunnel's port mapped as it was toward {other}: {text}"
        );
    }
}

/// Two sites behind endpoint-independent NAT, hole-punched, then UDP
/// between their NAT routers is blocked (a firewall between them; the
/// controllers and a relay site stay reachable): the punched tunnel goes
/// down, and at once through a relay site peered with both (the punch
/// tried beside it).
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn a_hole_punch_that_stops_working_falls_back_to_a_relay_site() {
    require_root();
    use std::time::{Duration, Instant};
    weft_tests::step("sites a and b behind endpoint-independent NAT: hole-punched");
    let mut s = both_behind(Nat::EndpointIndependent, "nu");
    weft_tests::sites::until_wa_reaches_wb(&s);
    weft_tests::eventually("hole-punched", Duration::from_secs(20), || {
        (path_to(&s.ta, "nu-b") == "hole-punched").then_some(())
    });
    weft_tests::step("a relay site peered with both: not used while the punch works");
    weft_tests::sites::relay_site(&mut s, "nu-r", 1, "10.1.0.0/16", (true, true));
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(path_to(&s.ta, "nu-b"), "hole-punched");

    weft_tests::step("UDP between the two NAT routers blocked: the tunnel goes through the relay");
    udp_between_routers(&s, false);
    let blocked = Instant::now();
    weft_tests::eventually("relayed", Duration::from_secs(60), || {
        (path_to(&s.ta, "nu-b") == "relayed via nu-r").then_some(())
    });
    let wb = s.wb_from_a.clone();
    s.reach_quickly("wa", &wb, Duration::from_secs(15));
    println!(
        "NAT: a hole punch blocked, relayed and through {:.1} s after the block",
        blocked.elapsed().as_secs_f64()
    );
}

/// A host on a relayed site's LAN that sees its gateway's frames (the LAN
/// floods them): it replays each handshake initiation the gateway sends
/// toward the relay, at once, from a port of its own; and while FILE
/// exists it floods that relay port with initiations of its own whose
/// mac1 is valid for the far gateway's public key (RATE a second). At the
/// end it prints what came back to it, by WireGuard message type.
/// Arguments: far key (base64), relay address, seconds, RATE, FILE.
const INTRUDER: &str = r#"
import base64, hashlib, os, signal, socket, struct, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
key, relay, secs, rate, go = base64.b64decode(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
mac1 = hashlib.blake2s(b"mac1----" + key).digest()
sniff = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.ntohs(0x0800))
sniff.bind(("eth0", 0))
sniff.setblocking(False)
out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
out.bind(("0.0.0.0", 0))
out.setblocking(False)
mine = sys.argv[6]
got, replayed, forged, port = {}, 0, 0, None
end, tick = time.time() + secs, time.time()
print("ready", flush=True)
def report():
    print("replayed %d forged %d got %s" % (replayed, forged, " ".join("type%d=%d" % kv for kv in sorted(got.items()))), flush=True)
try:
  while time.time() < end:
      try:
          while True:
              f = sniff.recv(2048)
              ihl = (f[0] & 15) * 4
              if f[9] != 17 or socket.inet_ntoa(f[16:20]) != relay or socket.inet_ntoa(f[12:16]) == mine:
                  continue
              dport = struct.unpack("!H", f[ihl + 2:ihl + 4])[0]
              p = f[ihl + 8:]
              if len(p) == 148 and p[0] == 1:
                  out.sendto(p, (relay, dport))
                  replayed += 1
                  port = dport
      except BlockingIOError:
          pass
      try:
          while True:
              d = out.recv(2048)
              got[d[0]] = got.get(d[0], 0) + 1
      except BlockingIOError:
          pass
      if port and time.time() >= tick:
          tick = time.time() + 0.01
          if os.path.exists(go):
              for _ in range(max(1, rate // 100)):
                  m = bytes([1, 0, 0, 0]) + os.urandom(112)
                  out.sendto(m + hashlib.blake2s(m, key=mac1, digest_size=16).digest() + bytes(16), (relay, port))
                  forged += 1
      time.sleep(0.001)
finally:
    report()
"#;

/// A relayed tunnel keeps its sides against a host on one side's LAN (the
/// same NAT address) that replays that side's handshake initiations from
/// other ports as they leave, and floods the relay with initiations whose
/// mac1 is valid for the far gateway's key (public): the far gateway,
/// loaded, answers them with cookie replies, which a relay once took as
/// the far side vouching for the sender. The relay never learns the
/// intruder: it gets none of the far side's data, and pings between the
/// two sites go on through the flood.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn a_relayed_tunnel_keeps_its_sides_against_replayed_and_forged_handshakes() {
    require_root();
    use std::time::Duration;
    weft_tests::step("sites a and b behind carrier-grade NAT; an intruder x on a's LAN that sees a's frames");
    let mut s = both_behind(Nat::EndpointDependent, "nx");
    let lan = s.nat_a.clone().expect("a behind NAT");
    // The switch forgets every address at once: it floods each frame to
    // every port, as a hub (or a Wi-Fi without isolation) does.
    must(
        s.lab.exec(
            &lan.bridge,
            &["ip", "link", "set", "br0", "type", "bridge", "ageing_time", "0"],
        ),
        "a flooding switch",
    );
    let x = s.lab.host("xa");
    let x_ip = s.lab.plug_behind(&lan, &x, 66);
    must(
        s.lab.exec(&x, &["ip", "link", "set", "eth0", "promisc", "on"]),
        "promisc",
    );
    let gws = weft_tests::weftctl_json(&s.tb, &["gateways"]);
    let b_key = gws["gateways"][0]["public_key"]
        .as_str()
        .expect("b's gateway key")
        .to_string();
    let go = s.dir.path().join("flood");
    let log = s.dir.path().join("intruder.log");
    let intruder = s.lab.spawn(
        &x,
        std::path::Path::new("/usr/bin/python3"),
        &[
            "-c",
            INTRUDER,
            &b_key,
            "192.168.78.51",
            "90",
            "300",
            go.to_str().unwrap(),
            &x_ip,
        ],
        &log,
    );
    weft_tests::eventually("the intruder ready", Duration::from_secs(10), || {
        std::fs::read_to_string(&log)
            .ok()
            .filter(|l| l.contains("ready"))
            .map(|_| ())
    });

    weft_tests::step("a relay site peered with both, while x replays a's initiations: a and b connect");
    let _r1 = weft_tests::sites::relay_site(&mut s, "nx-r1", 1, "10.1.0.0/16", (true, true));
    let wb = s.wb_from_a.clone();
    s.reach_quickly("wa", &wb, weft_tests::pace::scaled(Duration::from_secs(30)));
    weft_tests::eventually("both paths relayed", Duration::from_secs(20), || {
        (path_to(&s.ta, "nx-b") == "relayed via nx-r1" && path_to(&s.tb, "nx-a") == "relayed via nx-r1").then_some(())
    });

    weft_tests::step("x floods forged initiations (300/s, mac1 valid for b's key) for 15 s: pings go on");
    let (ping, ping_log) = weft_tests::sites::ping_wa_to_wb(&mut s, "under-flood.log");
    let at = weft_tests::unix_now();
    std::fs::write(&go, "").unwrap();
    std::thread::sleep(Duration::from_secs(15));
    std::fs::remove_file(&go).unwrap();
    std::thread::sleep(Duration::from_secs(1));
    s.lab.proc(ping).child.as_mut().unwrap().kill().unwrap();
    let (gap, times) = weft_tests::sites::longest_gap(&ping_log, at);
    let m = s.scrape("gwr1");
    let dropped = |why| {
        weft_tests::sites::metric(
            &m,
            "weft_gateway_relay_dropped_total",
            &[("site_a", "nx-a"), ("site_b", "nx-b"), ("reason", why)],
        )
        .or_else(|| {
            weft_tests::sites::metric(
                &m,
                "weft_gateway_relay_dropped_total",
                &[("site_a", "nx-b"), ("site_b", "nx-a"), ("reason", why)],
            )
        })
        .unwrap_or(0.0)
    };
    println!(
        "relay under a forged-handshake flood: longest ping silence {gap:.2} s, {} answers; the relay dropped {} over the handshake budget, {} replays",
        times.len(),
        dropped("handshakes_limited"),
        dropped("replayed")
    );
    let _ = weft_tests::terminate(s.lab.proc(intruder).child.as_mut().unwrap());
    let said = std::fs::read_to_string(&log).unwrap();
    let report = said
        .lines()
        .find(|l| l.starts_with("replayed"))
        .unwrap_or_else(|| panic!("the intruder said nothing: {said}"));
    println!("intruder: {report}");
    assert!(!report.contains("forged 0 "), "the intruder sent nothing: {report}");
    assert!(!report.contains("type4="), "b's data reached the intruder: {report}");
    assert!(dropped("handshakes_limited") > 0.0, "the flood was not limited: {m}");
    assert!(gap <= 1.0, "pings stopped for {gap:.2} s during the flood");
}

/// The over-TLS gauge of gateway `gw`'s agent.
fn over_tls(s: &weft_tests::sites::TwoSites, gw: &str) -> f64 {
    weft_tests::sites::metric(&s.scrape(gw), "weft_gateway_tunnels_over_tls", &[]).unwrap_or(0.0)
}

/// Two sites whose NAT routers let no UDP out at all, only TCP (as many
/// corporate networks): no reflector answers, no handshake goes out. A
/// relay site whose gateway also takes tunnels over TLS (`--relay-tls-port
/// 443`) peers with both: each gateway's handshakes over UDP get no
/// answer, so it carries its tunnels to the relay's gateway over TLS, and
/// the tunnel between the two sites goes through the relay that way,
/// within 10 s of the relay peering with both. When the routers let UDP
/// out again, every tunnel is back on UDP within 30 s (the two sites'
/// hole-punched), and the pings across lose little on the way. Both sites
/// are dual stack: their IPv6 workloads reach each other through the
/// relay too.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn two_sites_whose_udp_is_blocked_connect_over_tls_through_a_relay_site_and_return_to_udp() {
    require_root();
    use std::time::{Duration, Instant};
    weft_tests::step("sites a and b behind NAT routers that let no UDP out, peered: no path");
    let opts = weft_tests::sites::Opts {
        site_a_nat: Some(Nat::EndpointIndependent),
        site_b_nat: Some(Nat::EndpointIndependent),
        udp_blocked: true,
        // Dual stack: IPv6 workloads go through the relay too.
        ipv6: (Some("fd00:1::/48"), Some("fd00:1::/48")),
        ..Default::default()
    };
    let mut s = weft_tests::sites::up_with("nt", ("nt-a", "10.1.0.0/16"), ("nt-b", "10.1.0.0/16"), opts);
    weft_tests::eventually("a's NAT not seen (nothing answers)", Duration::from_secs(20), || {
        let gws = weft_tests::weftctl_json(&s.ta, &["gateways"]);
        (gws["gateways"][0]["nat"] == "unknown").then_some(())
    });
    assert_eq!(path_to(&s.ta, "nt-b"), "waiting");

    weft_tests::step("a relay site taking TLS on TCP 443 peers with both: the tunnel goes through it over TLS");
    weft_tests::sites::relay_site_with(
        &mut s,
        "nt-r",
        1,
        "10.1.0.0/16",
        (true, true),
        &[("--relay-tls-port", "443")],
    );
    let since = Instant::now();
    let wb = s.wb_from_a.clone();
    s.reach_quickly("wa", &wb, weft_tests::pace::scaled(Duration::from_secs(30)));
    let took = since.elapsed();
    println!(
        "NAT: UDP blocked at both sites, connected over TLS through the relay site in {:.1} s after it peered with both",
        took.as_secs_f64()
    );
    let bound = weft_tests::pace::scaled(Duration::from_secs(10));
    assert!(
        took <= bound,
        "connected after {took:?}, over {bound:?} {}",
        weft_tests::pace::describe()
    );
    assert_eq!(path_to(&s.ta, "nt-b"), "relayed via nt-r");
    weft_tests::eventually("weftctl shows the tunnel over TLS", Duration::from_secs(10), || {
        let peers = weft_tests::weftctl_json(&s.ta, &["peerings"]);
        let p = peers["peerings"]
            .as_array()?
            .iter()
            .find(|p| p["site_id"] == "nt-b")?
            .clone();
        (p["tunnel"]["over_tls"] == true).then_some(())
    });
    let wa = s.wa_from_b.clone();
    s.reach_quickly("wb", &wa, Duration::from_secs(5));
    weft_tests::step("an IPv6 workload reaches the other site through the relay, over TLS");
    s.reach_v6("wa", "wb");
    for gw in ["gwa", "gwb"] {
        // Its tunnel to the relay site, and the relayed one.
        assert_eq!(over_tls(&s, gw), 2.0, "{gw}: tunnels over TLS");
    }
    weft_tests::eventually(
        "diagnose says the tunnel is over TLS, and why",
        Duration::from_secs(10),
        || {
            let o = weft_tests::run(std::process::Command::new(weft_tests::bin("weftctl")).args([
                "--controller",
                &s.ta,
                "diagnose",
            ]));
            let text = weft_tests::stdout(&o);
            (text.contains("relayed via nt-r over TLS") && text.contains("let UDP out")).then_some(())
        },
    );
    let m = s.scrape("gwr1");
    let admitted = weft_tests::sites::metric(&m, "weft_gateway_tls_relay_connections_total", &[]).unwrap_or(0.0);
    assert!(
        admitted >= 4.0,
        "the relay's TLS port admitted {admitted} connections: {m}"
    );
    let relayed = weft_tests::sites::metric(
        &m,
        "weft_gateway_relay_packets_total",
        &[("from_site", "nt-a"), ("to_site", "nt-b")],
    );
    assert!(relayed.unwrap_or(0.0) > 0.0, "the relay carried nothing");

    weft_tests::step("the routers let UDP out again: every tunnel back on UDP within 30 s");
    let (ping, log) = weft_tests::sites::ping_wa_to_wb(&mut s, "tls-to-udp.log");
    let at = weft_tests::unix_now();
    let opened = Instant::now();
    for lan in [s.nat_a.as_ref().unwrap(), s.nat_b.as_ref().unwrap()] {
        s.lab.block_udp(lan, false);
    }
    let within = weft_tests::pace::scaled(Duration::from_secs(30));
    weft_tests::eventually("no tunnel over TLS", within, || {
        (over_tls(&s, "gwa") == 0.0 && over_tls(&s, "gwb") == 0.0).then_some(())
    });
    let back = opened.elapsed();
    weft_tests::eventually("hole-punched", Duration::from_secs(10), || {
        (path_to(&s.ta, "nt-b") == "hole-punched").then_some(())
    });
    std::thread::sleep(Duration::from_secs(2));
    s.lab.proc(ping).child.as_mut().unwrap().kill().unwrap();
    let (gap, times) = weft_tests::sites::longest_gap(&log, at);
    println!(
        "NAT: UDP allowed again, every tunnel back on UDP after {:.1} s; longest silence of a 20 ms ping {gap:.2} s",
        back.as_secs_f64()
    );
    assert!(times.len() > 50, "only {} pings answered", times.len());
    s.reach_quickly("wa", &wb, Duration::from_secs(5));
}

/// Two sites whose hosts have only IPv6 on the WAN, each site's gateway
/// and nodes on a LAN of global addresses behind a home router's stateful
/// firewall (no NAT66: only answers to what went out get in), the gateways
/// without an `--endpoint`. Each gateway's discovery asks the controllers
/// over IPv6; the peer's sees it at its own address, which becomes the
/// candidate the peer dials. Both send at once, each firewall takes the
/// other's handshakes for answers, and the tunnel is hole-punched, with
/// IPv4 and IPv6 workloads across it.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn two_sites_behind_stateful_ipv6_firewalls_connect_by_hole_punching() {
    require_root();
    use std::time::Duration;
    weft_tests::step("sites a and b on IPv6 only, each behind a stateful firewall, peered");
    let opts = weft_tests::sites::Opts {
        underlay_v6: true,
        firewall_v6: true,
        ipv6: (Some("fd00:1::/48"), Some("fd00:1::/48")),
        ..Default::default()
    };
    let s = weft_tests::sites::up_with("n6", ("n6-a", "10.1.0.0/16"), ("n6-b", "10.1.0.0/16"), opts);
    let (a, b) = (s.nat_a.as_ref().unwrap(), s.nat_b.as_ref().unwrap());
    weft_tests::step("the firewalls let nothing in unasked");
    let o = s
        .lab
        .exec(&s.ns["ctla"], &["ping", "-6", "-c", "1", "-W", "1", &b.ip(20)]);
    assert!(!o.status.success(), "{} answered from the WAN", b.ip(20));

    weft_tests::step("connected, hole-punched, within 8 s of the peering");
    s.reach_quickly("wa", &s.wb_from_a, Duration::from_secs(30));
    let took = s.peered_at.elapsed();
    println!(
        "NAT: both sides behind stateful IPv6 firewalls, connected {:.2} s after the peering was created",
        took.as_secs_f64()
    );
    let bound = weft_tests::pace::scaled(Duration::from_secs(8));
    assert!(
        took <= bound,
        "connected after {took:?}, over {bound:?} {}",
        weft_tests::pace::describe()
    );
    s.reach_quickly("wb", &s.wa_from_b, Duration::from_secs(5));
    for (t, gw) in [(&s.ta, a.ip(10)), (&s.tb, b.ip(20))] {
        let peers = weft_tests::eventually("the path shown hole-punched", Duration::from_secs(10), || {
            let peers = weft_tests::weftctl_json(t, &["peerings"]);
            (peers["peerings"][0]["tunnel"]["path"] == "hole-punched").then_some(peers)
        });
        let p = &peers["peerings"][0];
        assert_eq!(p["tunnel"]["nat"], "none", "{peers}");
        let own = p["local_gateways"][0]["candidates"].to_string();
        assert!(
            own.contains(&format!("[{gw}]:51820")),
            "its own global address, as the peer's reflector saw it: {own}"
        );
    }
    weft_tests::step("an IPv6 workload reaches the other site through the punched tunnel");
    s.reach_v6("wa", "wb");
    weft_tests::step("both firewalls forget their state: back within 8 s");
    for r in [&a.router, &b.router] {
        let o = s.lab.exec(r, &["conntrack", "-F"]);
        assert!(o.status.success(), "conntrack -F: {}", weft_tests::stderr(&o));
    }
    let flushed = std::time::Instant::now();
    s.reach_quickly("wa", &s.wb_from_a, Duration::from_secs(30));
    s.reach_quickly("wb", &s.wa_from_b, Duration::from_secs(30));
    let back = flushed.elapsed();
    println!(
        "NAT: both IPv6 firewalls flushed, the tunnel back in {:.2} s",
        back.as_secs_f64()
    );
    assert!(back <= bound, "back after {back:?}, over {bound:?}");
}

/// The sites of the test above, but their firewalls drop UDP between the
/// two sites (no direct path), and a relay site on the IPv6 WAN peers with
/// both: the tunnel goes through the relay's gateway over IPv6, and IPv4
/// and IPv6 workloads reach each other through it.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn two_ipv6_sites_without_a_direct_path_connect_through_a_relay_over_ipv6() {
    require_root();
    use std::time::Duration;
    weft_tests::step("sites a and b on IPv6 only, behind firewalls that drop UDP between them, peered");
    let opts = weft_tests::sites::Opts {
        underlay_v6: true,
        firewall_v6: true,
        ipv6: (Some("fd00:1::/48"), Some("fd00:1::/48")),
        ..Default::default()
    };
    let mut s = weft_tests::sites::up_with("r6", ("r6-a", "10.1.0.0/16"), ("r6-b", "10.1.0.0/16"), opts);
    let (a, b) = (s.nat_a.clone().unwrap(), s.nat_b.clone().unwrap());
    for (at, to) in [(&a, &b), (&b, &a)] {
        let to = format!("{}/64", to.prefix);
        must(
            s.lab.exec(
                &at.router,
                &[
                    "nft", "insert", "rule", "ip6", "fwlab", "forward", "ip6", "daddr", &to, "meta", "l4proto", "udp",
                    "counter", "drop",
                ],
            ),
            "dropping UDP to the other site",
        );
    }
    weft_tests::step("a relay site on the IPv6 WAN peers with both: the tunnel goes through it");
    weft_tests::sites::relay_site(&mut s, "r6-r", 1, "10.1.0.0/16", (true, true));
    let since = std::time::Instant::now();
    let wb = s.wb_from_a.clone();
    s.reach_quickly("wa", &wb, weft_tests::pace::scaled(Duration::from_secs(60)));
    println!(
        "NAT: IPv6 sites with no direct path, connected through the relay over IPv6 in {:.1} s after it peered with both",
        since.elapsed().as_secs_f64()
    );
    assert_eq!(path_to(&s.ta, "r6-b"), "relayed via r6-r");
    let wa = s.wa_from_b.clone();
    s.reach_quickly("wb", &wa, Duration::from_secs(5));
    weft_tests::step("an IPv6 workload reaches the other site through the relay");
    s.reach_v6("wa", "wb");
    let m = s.scrape("gwr1");
    let relayed = weft_tests::sites::metric(
        &m,
        "weft_gateway_relay_packets_total",
        &[("from_site", "r6-a"), ("to_site", "r6-b")],
    );
    assert!(relayed.unwrap_or(0.0) > 0.0, "the relay carried nothing: {m}");
    // Over IPv6: the relay's gateway has no IPv4 address to be reached at.
    let o = s
        .lab
        .exec(&s.ns["gwr1"], &["ip", "-4", "-o", "addr", "show", "dev", "eth0"]);
    assert!(weft_tests::stdout(&o).trim().is_empty(), "{}", weft_tests::stdout(&o));
}

/// Lets UDP between the two NAT routers of `s` (on the WAN's bridge)
/// through (`allowed`) or drops it, as a network between two sites that
/// passes no UDP would.
fn udp_between_routers(s: &weft_tests::sites::TwoSites, allowed: bool) {
    let lan = s.lab.ns("lan");
    let _ = s.lab.exec(&lan, &["nft", "delete", "table", "bridge", "weftblock"]);
    if allowed {
        return;
    }
    let mut rules = vec![
        vec!["add", "table", "bridge", "weftblock"],
        vec![
            "add",
            "chain",
            "bridge",
            "weftblock",
            "cut",
            "{ type filter hook forward priority 0 ; }",
        ],
    ];
    for (from, to) in [("192.168.78.30", "192.168.78.31"), ("192.168.78.31", "192.168.78.30")] {
        rules.push(vec![
            "add",
            "rule",
            "bridge",
            "weftblock",
            "cut",
            "ip",
            "saddr",
            from,
            "ip",
            "daddr",
            to,
            "meta",
            "l4proto",
            "udp",
            "drop",
        ]);
    }
    for args in rules {
        let mut cmd = vec!["nft"];
        cmd.extend(args);
        must(s.lab.exec(&lan, &cmd), "blocking UDP between the routers");
    }
}

/// What the relay site's gateway carried from nm-a to nm-b, or None when
/// it holds no session for the pair (its series go with the session).
fn relayed(s: &weft_tests::sites::TwoSites) -> Option<f64> {
    weft_tests::sites::metric(
        &s.scrape("gwr1"),
        "weft_gateway_relay_packets_total",
        &[("from_site", "nm-a"), ("to_site", "nm-b")],
    )
}

/// Two sites behind home routers whose network drops UDP between them at
/// first, and a relay site peered with both: the tunnel goes through the
/// relay at once, the hole punch tried beside it. Once UDP passes between
/// the routers, the punch answers and the tunnel moves to it: a 20 ms
/// ping across loses nothing in the move, and the relay is let go.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn a_tunnel_goes_through_a_relay_at_once_and_moves_to_the_punch_without_a_gap() {
    require_root();
    use std::time::{Duration, Instant};
    weft_tests::step("sites a and b behind home routers, UDP between the routers dropped, peered");
    let mut s = both_behind(Nat::EndpointIndependent, "nm");
    udp_between_routers(&s, false);
    weft_tests::step("a relay site peers with both: through it at once");
    weft_tests::sites::relay_site(&mut s, "nm-r", 1, "10.1.0.0/16", (true, true));
    let since = Instant::now();
    let wb = s.wb_from_a.clone();
    s.reach_quickly("wa", &wb, weft_tests::pace::scaled(Duration::from_secs(30)));
    let took = since.elapsed();
    println!(
        "NAT: punch blocked, connected through the relay {:.1} s after it peered with both",
        took.as_secs_f64()
    );
    assert_eq!(path_to(&s.ta, "nm-b"), "relayed via nm-r");
    let bound = weft_tests::pace::scaled(Duration::from_secs(5));
    assert!(took <= bound, "connected after {took:?}, over {bound:?}");

    weft_tests::step("UDP passes between the routers: the tunnel moves to the punch, no ping lost");
    let (ping, log) = weft_tests::sites::ping_wa_to_wb(&mut s, "relay-to-punch.log");
    assert!(relayed(&s).unwrap_or(0.0) > 0.0, "the relay does not carry the tunnel");
    let at = weft_tests::unix_now();
    let opened = Instant::now();
    udp_between_routers(&s, true);
    weft_tests::eventually(
        "hole-punched",
        weft_tests::pace::scaled(Duration::from_secs(20)),
        || (path_to(&s.ta, "nm-b") == "hole-punched" && path_to(&s.tb, "nm-a") == "hole-punched").then_some(()),
    );
    let moved = opened.elapsed();
    // The relay carries nothing more, the ping going on. Its session for
    // the pair may be let go before either read or between them: a count
    // that vanishes is fine, one that grows (or a session that comes
    // back) is not.
    std::thread::sleep(Duration::from_secs(1));
    let before = relayed(&s);
    std::thread::sleep(Duration::from_secs(2));
    let after = relayed(&s);
    assert!(
        after.is_none() || after == before,
        "still through the relay: {before:?} datagrams relayed, then {after:?}"
    );
    s.lab.proc(ping).child.as_mut().unwrap().kill().unwrap();
    let (gap, times) = weft_tests::sites::longest_gap(&log, at);
    // Pings lost from the move on: the sequence numbers not answered.
    let text = std::fs::read_to_string(&log).unwrap();
    let seqs: Vec<u64> = text
        .lines()
        .filter(|l| {
            l.trim_start_matches('[')
                .split(']')
                .next()
                .and_then(|t| t.parse::<f64>().ok())
                >= Some(at)
        })
        .filter_map(|l| l.split("icmp_seq=").nth(1)?.split_whitespace().next()?.parse().ok())
        .collect();
    let lost = match (seqs.first(), seqs.last()) {
        (Some(a), Some(b)) => (b - a + 1).saturating_sub(seqs.len() as u64),
        _ => 0,
    };
    println!(
        "NAT: UDP let through, on the hole punch after {:.1} s; of {} pings from then, {lost} lost; longest silence {gap:.2} s",
        moved.as_secs_f64(),
        seqs.len()
    );
    assert!(times.len() > 50, "only {} pings answered", times.len());
    assert!(lost <= 1, "{lost} pings lost in the move (longest silence {gap:.2} s)");

    weft_tests::step("UDP dropped between the routers again: back through the relay at once");
    let dropped = Instant::now();
    udp_between_routers(&s, false);
    s.reach_quickly("wa", &wb, weft_tests::pace::scaled(Duration::from_secs(30)));
    weft_tests::eventually("relayed again", Duration::from_secs(10), || {
        (path_to(&s.ta, "nm-b") == "relayed via nm-r").then_some(())
    });
    println!(
        "NAT: the punch blocked again, through the relay again {:.1} s after",
        dropped.elapsed().as_secs_f64()
    );
}
