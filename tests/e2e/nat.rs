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
            Nat::EndpointIndependent => assert_eq!(
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
    let s = weft_tests::sites::up_with("nt", ("site-a", "10.1.0.0/16"), ("site-b", "10.1.0.0/16"), opts);
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
    let peers = weft_tests::weftctl_json(&s.tb, &["peerings"]);
    assert_eq!(peers["peerings"][0]["tunnel"]["up"], true, "{peers}");
}
