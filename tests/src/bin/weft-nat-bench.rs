//! Sites behind NAT against a direct path, in one run: for each case, the
//! time from `weftctl peering create` to the first answered ping between
//! the workloads, the path `weftctl peerings` shows 12 s later and when it
//! first showed it, and TCP throughput (iperf3, workload to workload) as a
//! ratio to the direct path's, runs interleaved so a slow spell of the
//! machine hits every case alike.
//!
//! The cases are two-site labs of the data-plane tests (`weft_tests::sites`:
//! a controller, a gateway and two nodes per site, userspace WireGuard,
//! both sites on 10.1.0.0/16 so every path has prefix NAT on both
//! gateways), up side by side:
//! - direct: both gateways on the WAN with `--endpoint`;
//! - one side NATed: site a behind an endpoint-independent NAT router
//!   (nftables `masquerade`), its gateway without an endpoint;
//! - hole-punched: both sites behind such routers, neither gateway with an
//!   endpoint;
//! - relayed: both sites behind endpoint-dependent NAT routers (nftables
//!   `masquerade random`: a new port per destination, so no hole punch),
//!   and a third, public site with `--relay-ports` peered with both; the
//!   tunnel goes through its gateway (connected: from that site's second
//!   peering);
//! - bare NAT: both sites behind NAT routers with no firewall (`masquerade`
//!   alone, a NAT instance as clouds have them), a router between them (as
//!   on the internet), and a relay site peered with both right after the
//!   two sites (connected: from the sites' peering, whatever path carries
//!   it first);
//! - UDP blocked: both sites behind NAT routers that let no UDP out (only
//!   TCP), and a relay site whose gateway also takes tunnels over TLS
//!   (`--relay-tls-port 443`) peered with both: every tunnel of the two
//!   sites goes to the relay over TLS on TCP (connected: from the relay
//!   site's peerings). Its throughput is also given as a ratio to the
//!   relayed case's (the same relay over UDP), run by run. After the runs
//!   the routers let UDP out again, and the bench reports when no tunnel
//!   of either gateway is carried over TLS any more;
//! - IPv6 firewalls: every host of both sites on the WAN by IPv6 only,
//!   each site's gateway and nodes on an IPv6 LAN of global addresses
//!   behind a router with a stateful firewall and no NAT66 (only answers
//!   get in), neither gateway with an endpoint: hole-punched over IPv6
//!   (its tunnel carries 20 bytes more of IPv6 header than the others).
//!
//! Needs root; `sudo weft-nat-bench --seconds 5 --runs 5` (see
//! docs/benchmarks.md).

use std::time::Duration;

use clap::Parser;
use weft_tests::netns::Nat;
use weft_tests::perf::{iperf, median};
use weft_tests::sites::{Opts, TwoSites, up_with};

#[derive(Parser, Debug)]
struct Args {
    /// Length of each iperf3 run.
    #[arg(long, default_value_t = 5)]
    seconds: u32,
    /// Runs per case; medians are reported.
    #[arg(long, default_value_t = 5)]
    runs: usize,
}

struct Case {
    name: &'static str,
    lab: TwoSites,
    connected: Duration,
    /// When the final path was first shown (after `connected`, with the
    /// reports' lag).
    final_at: Duration,
    path: String,
    gbits: Vec<f64>,
}

/// Whether a case has a relay site, and from when its connection is timed.
#[derive(Clone, Copy, PartialEq)]
enum Relay {
    None,
    /// Timed from the relay site's peerings.
    Only,
    /// Timed from the two sites' peering, the relay site peered after.
    Beside,
}

fn case(name: &'static str, tag: &str, a: Option<Nat>, b: Option<Nat>, relay: Relay) -> Case {
    run_case(name, tag, nat_opts(a, b, false), relay, false)
}

/// The lab of sites behind NAT routers `a` and `b` (None: on the WAN),
/// letting no UDP out when `udp_blocked`.
fn nat_opts(a: Option<Nat>, b: Option<Nat>, udp_blocked: bool) -> Opts {
    Opts {
        site_a_nat: a,
        site_b_nat: b,
        // Routers without a firewall, as the internet has them: a router
        // between the two sites (the punch's first handshakes die there).
        site_b_beyond_hop: b == Some(Nat::Bare),
        // The agents' default resync (the labs' 1 s would have every
        // gateway read its whole state each second, the relay site's too).
        resync: Some("30s"),
        udp_blocked,
        ..Default::default()
    }
}

/// One case's lab, up and timed; `tls`: the relay takes TLS.
fn run_case(name: &'static str, tag: &str, opts: Opts, relay: Relay, tls: bool) -> Case {
    let mut lab = up_with(
        tag,
        (&format!("{tag}-a"), "10.1.0.0/16"),
        (&format!("{tag}-b"), "10.1.0.0/16"),
        opts,
    );
    if relay != Relay::None {
        let flags: &[(&str, &str)] = if tls { &[("--relay-tls-port", "443")] } else { &[] };
        weft_tests::sites::relay_site_with(&mut lab, &format!("{tag}-r"), 1, "10.1.0.0/16", (true, true), flags);
    }
    let since = if relay == Relay::Only {
        std::time::Instant::now()
    } else {
        lab.peered_at
    };
    lab.reach_quickly("wa", &lab.wb_from_a, Duration::from_secs(60));
    let connected = since.elapsed();
    // The path as weftctl shows it (from the gateways' tunnel reports),
    // watched for 12 s: the final one, and when it was first shown.
    let mut seen: Vec<(Duration, String)> = Vec::new();
    let watch = std::time::Instant::now();
    while watch.elapsed() < Duration::from_secs(12) {
        let p = path_of(&lab);
        if seen.last().is_none_or(|(_, last)| *last != p) {
            seen.push((since.elapsed(), p));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let (final_at, path) = seen.last().cloned().unwrap_or_default();
    let moves: Vec<String> = seen
        .iter()
        .map(|(t, p)| format!("{p} at {:.1} s", t.as_secs_f64()))
        .collect();
    println!(
        "{name}: connected {:.2} s after the peering (relayed: the relay's peerings) was created; paths shown: {}",
        connected.as_secs_f64(),
        moves.join(", ")
    );
    Case {
        name,
        lab,
        connected,
        final_at,
        path,
        gbits: Vec::new(),
    }
}

/// Site a's tunnel to site b's path, as `weftctl peerings` shows it.
fn path_of(lab: &TwoSites) -> String {
    let peers = weft_tests::weftctl_json(&lab.ta, &["peerings"]);
    let t = peers["peerings"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["site_id"] == lab.site_b.as_str())
        .map(|p| p["tunnel"].clone())
        .unwrap_or_default();
    let path = t["path"].as_str().unwrap_or("?").to_string();
    match t["over_tls"].as_bool() {
        Some(true) => format!("{path} over TLS"),
        _ => path,
    }
}

/// Lets UDP out of both routers of `lab` again; seconds until neither
/// gateway carries a tunnel over TLS.
fn back_on_udp(lab: &TwoSites) -> f64 {
    let opened = std::time::Instant::now();
    for lan in [lab.nat_a.as_ref().unwrap(), lab.nat_b.as_ref().unwrap()] {
        lab.lab.block_udp(lan, false);
    }
    let over_tls =
        |gw: &str| weft_tests::sites::metric(&lab.scrape(gw), "weft_gateway_tunnels_over_tls", &[]).unwrap_or(0.0);
    weft_tests::eventually("no tunnel over TLS", Duration::from_secs(120), || {
        (over_tls("gwa") == 0.0 && over_tls("gwb") == 0.0).then_some(())
    });
    opened.elapsed().as_secs_f64()
}

fn main() {
    let args = Args::parse();
    assert!(weft_tests::netns::require_root(), "weft-nat-bench needs root");
    let dir = tempfile::Builder::new().prefix("weft-natb").tempdir().unwrap();
    let log = dir.path().join("iperf3.log");
    let mut cases = [
        case("direct (no NAT)", "nbd", None, None, Relay::None),
        case(
            "one side NATed",
            "nb1",
            Some(Nat::EndpointIndependent),
            None,
            Relay::None,
        ),
        case(
            "both NATed, hole-punched",
            "nb2",
            Some(Nat::EndpointIndependent),
            Some(Nat::EndpointIndependent),
            Relay::None,
        ),
        case(
            "both NATed, relayed",
            "nb3",
            Some(Nat::EndpointDependent),
            Some(Nat::EndpointDependent),
            Relay::Only,
        ),
        case("both bare NAT", "nb4", Some(Nat::Bare), Some(Nat::Bare), Relay::Beside),
        run_case(
            "UDP blocked, over TLS",
            "nb5",
            nat_opts(Some(Nat::EndpointIndependent), Some(Nat::EndpointIndependent), true),
            Relay::Only,
            true,
        ),
        run_case(
            "IPv6 firewalls, no NAT66",
            "nb6",
            Opts {
                underlay_v6: true,
                firewall_v6: true,
                resync: Some("30s"),
                ..Default::default()
            },
            Relay::None,
            false,
        ),
    ];
    // The TLS case against the same relay over UDP.
    let (udp_relay, tls_relay) = (3, 5);
    let mut over_udp_relay = Vec::new();
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for run in 0..args.runs {
        let mut line = format!("run {}:", run + 1);
        for c in cases.iter_mut() {
            let (wa, wb, to_b) = (c.lab.ns["wa"].clone(), c.lab.ns["wb"].clone(), c.lab.wb_from_a.clone());
            let g = iperf(&mut c.lab.lab, &log, &wb, &wa, &to_b, args.seconds);
            line += &format!(" {} {g:.3} Gbit/s;", c.name);
            c.gbits.push(g);
        }
        let direct = cases[0].gbits[run];
        for (i, c) in cases.iter().enumerate() {
            ratios[i].push(c.gbits[run] / direct);
        }
        over_udp_relay.push(cases[tls_relay].gbits[run] / cases[udp_relay].gbits[run]);
        println!("{line}");
    }
    println!(
        "case                         final path                   connected   final path at   Gbit/s   ratio to direct"
    );
    for (c, r) in cases.iter().zip(ratios) {
        println!(
            "{:<28} {:<28} {:>7.2} s   {:>11.1} s   {:>6.3}   {:.3}",
            c.name,
            c.path,
            c.connected.as_secs_f64(),
            c.final_at.as_secs_f64(),
            median(c.gbits.clone()),
            median(r)
        );
    }
    let back = back_on_udp(&cases[tls_relay].lab);
    println!("UDP blocked, over TLS: UDP allowed again, every tunnel back on UDP after {back:.1} s");
    let lo = over_udp_relay.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = over_udp_relay.iter().copied().fold(0.0, f64::max);
    println!(
        "over TLS / relayed over UDP: median {:.3} (runs {lo:.3} to {hi:.3})",
        median(over_udp_relay.clone())
    );
}
