//! Transit: three sites on one workload CIDR, A–B and B–C peered with
//! transit agreed at both ends of each, no A–C peering. A reaches C
//! through B (each seeing the other in its own view); an A–C peering
//! added later takes the traffic (B's transit counter stops), and its
//! deletion sends it back through B, at addresses of the transit path's
//! own: a direct peering's addresses never pass to what a hub calls the
//! same site. Needs root: run under CI=true.

use std::time::Duration;

use weft_tests::mesh::Mesh;
use weft_tests::{bin, eventually, netns, stderr, weftctl_json};

const POD: &str = "10.1.0.0/16";

/// `weftctl peering transit PEER on|off` at site `site`: Ok(json) or
/// Err(stderr).
fn transit(mesh: &Mesh, site: usize, peer: &str, state: &str) -> Result<serde_json::Value, String> {
    let o = weft_tests::run(std::process::Command::new(bin("weftctl")).args([
        "--controller",
        &mesh.sites[site].target,
        "--output",
        "json",
        "peering",
        "transit",
        peer,
        state,
    ]));
    if o.status.success() {
        Ok(serde_json::from_slice(&o.stdout).unwrap())
    } else {
        Err(stderr(&o))
    }
}

/// Site `to`'s workload address as site `from` reaches it through the
/// transit peer `via` (its transit path's workload view), once in use.
fn through(mesh: &Mesh, from: usize, via: usize, to: usize) -> Option<String> {
    let p = mesh.peering(&mesh.sites[from], &mesh.sites[via].id)?;
    let path = p["transit"]["paths"]
        .as_array()?
        .iter()
        .find(|t| t["site"] == mesh.sites[to].id.as_str() && t["active"] == true)?;
    let local: ipnet::Ipv4Net = path["views"].as_array()?.iter().find(|v| v["kind"] == "workload")?["local_cidr"]
        .as_str()?
        .parse()
        .ok()?;
    let real: ipnet::Ipv4Net = POD.parse().unwrap();
    weft_controller::ipam::translate(mesh.sites[to].workload.parse().ok()?, real, local).map(|a| a.to_string())
}

/// Packets hub `hub`'s gateway forwarded from peer `from` onward to site
/// `to` (nft counter `transit-<to>` in that peering's namespace).
fn forwarded(mesh: &mut Mesh, hub: usize, from: usize, to: usize) -> u64 {
    let (peer, name) = (mesh.sites[from].id.clone(), format!("transit-{}", mesh.sites[to].id));
    mesh.nft_counter(hub, &peer, &name).unwrap_or(0)
}

/// `from` asks `addr` five times; each answer must come from site `to`,
/// seeing the client inside `to`'s view `seen_in`. Err on the first miss.
fn asks(mesh: &Mesh, from: usize, to: usize, addr: &str, seen_in: &ipnet::Ipv4Net) -> Result<(), String> {
    for _ in 0..5 {
        let (site, seen) = mesh.ask_at(from, addr)?;
        if site != mesh.sites[to].id {
            return Err(format!("{addr} answered by {site}, not {}", mesh.sites[to].id));
        }
        let ip: std::net::Ipv4Addr = seen.parse().map_err(|e| format!("{seen}: {e}"))?;
        if !seen_in.contains(&ip) {
            return Err(format!(
                "{} saw the client at {seen}, outside its view {seen_in}",
                mesh.sites[to].id
            ));
        }
    }
    Ok(())
}

/// Site `at`'s local view of site `of`'s workload, direct or through transit.
fn view_at(mesh: &Mesh, at: usize, via: usize, of: usize) -> ipnet::Ipv4Net {
    let a = through(mesh, at, via, of)
        .or_else(|| mesh.address(at, of))
        .expect("a view");
    ipnet::Ipv4Net::new(a.parse().unwrap(), 16).unwrap().trunc()
}

#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn a_spoke_reaches_another_through_a_hub_then_a_direct_peering_and_back() {
    if !netns::require_root() {
        return;
    }
    let (a, b, c) = (0, 1, 2);
    weft_tests::step("three sites on one CIDR: A–B (created with --transit) and B–C, no A–C");
    let mut mesh = Mesh::up("trn", 3, POD);
    mesh.peer_with(a, b, &["--transit"]);
    mesh.peer(b, c);
    assert!(through(&mesh, a, b, c).is_none(), "transit before the hub agreed");
    let one_side = transit(&mesh, b, "s1", "on").unwrap();
    assert_eq!(one_side["transit"], true, "{one_side}");
    // B–C: agreed at B only, so not in use yet; A is offered nothing.
    transit(&mesh, b, "s3", "on").unwrap();
    std::thread::sleep(Duration::from_secs(3));
    assert!(through(&mesh, a, b, c).is_none(), "transit with C before C agreed");
    transit(&mesh, c, "s2", "on").unwrap();

    weft_tests::step("A reaches C through B, and C reaches A; each sees the other in its own view");
    let a_to_c = eventually("A's view of C through B", Duration::from_secs(20), || {
        through(&mesh, a, b, c)
    });
    let c_to_a = eventually("C's view of A through B", Duration::from_secs(20), || {
        through(&mesh, c, b, a)
    });
    eprintln!("A reaches C at {a_to_c}, C reaches A at {c_to_a} (through B)");
    let (c_sees_a, a_sees_c) = (view_at(&mesh, c, b, a), view_at(&mesh, a, b, c));
    eventually("A reaches C through B", Duration::from_secs(30), || {
        asks(&mesh, a, c, &a_to_c, &c_sees_a).ok()
    });
    eventually("C reaches A through B", Duration::from_secs(30), || {
        asks(&mesh, c, a, &c_to_a, &a_sees_c).ok()
    });
    // What A's admin reads: C under B, with A's own view of it.
    let table = weft_tests::stdout(&weft_tests::run(std::process::Command::new(bin("weftctl")).args([
        "--controller",
        &mesh.sites[a].target,
        "peerings",
    ])));
    eprintln!("{table}");
    assert!(
        table.contains("s3 via s2") && table.contains("transit agreed here: yes, by the peer: yes"),
        "{table}"
    );
    // B's own peerings still work.
    mesh.reaches(a, b).unwrap();
    mesh.reaches(c, b).unwrap();
    let hub = weftctl_json(&mesh.sites[b].target, &["peerings"]);
    let to_a = hub["peerings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["site_id"] == "s1")
        .unwrap();
    assert_eq!(to_a["transit"]["onward"], serde_json::json!(["s3"]), "{to_a}");
    let before = forwarded(&mut mesh, b, a, c);
    asks(&mesh, a, c, &a_to_c, &c_sees_a).unwrap();
    let after = forwarded(&mut mesh, b, a, c);
    assert!(
        after >= before + 5,
        "B's transit counter moved {before} -> {after} for 5 connections"
    );
    eprintln!("B forwarded {after} packets from A to C");

    weft_tests::step("an A–C peering takes the traffic, under the same addresses");
    mesh.peer(a, c);
    assert_eq!(
        mesh.address(a, c).as_deref(),
        Some(a_to_c.as_str()),
        "the direct peering gave A another view of C"
    );
    assert_eq!(
        mesh.address(c, a).as_deref(),
        Some(c_to_a.as_str()),
        "the direct peering gave C another view of A"
    );
    eventually(
        "A reaches C directly (B forwards nothing more)",
        Duration::from_secs(30),
        || {
            let before = (forwarded(&mut mesh, b, a, c), forwarded(&mut mesh, b, c, a));
            asks(&mesh, a, c, &a_to_c, &c_sees_a).ok()?;
            asks(&mesh, c, a, &c_to_a, &a_sees_c).ok()?;
            (before == (forwarded(&mut mesh, b, a, c), forwarded(&mut mesh, b, c, a))).then_some(())
        },
    );
    let p = mesh.peering(&mesh.sites[a], "s2").unwrap();
    assert_eq!(p["transit"]["paths"][0]["active"], false, "{p}");

    weft_tests::step("deleting the A–C peering moves the traffic back through B, at other addresses");
    // The direct peering's addresses (once the transit path's) meant the
    // site A peered with; they are released with it, and the paths
    // through B keep blocks of their own.
    let (direct_a_to_c, direct_c_to_a) = (a_to_c, c_to_a);
    mesh.unpeer(a, c);
    let a_to_c = eventually("A's view of C through B again", Duration::from_secs(20), || {
        through(&mesh, a, b, c)
    });
    let c_to_a = eventually("C's view of A through B again", Duration::from_secs(20), || {
        through(&mesh, c, b, a)
    });
    assert_ne!(a_to_c, direct_a_to_c, "B's path took A's deleted direct view of C");
    assert_ne!(c_to_a, direct_c_to_a, "B's path took C's deleted direct view of A");
    let (c_sees_a, a_sees_c) = (view_at(&mesh, c, b, a), view_at(&mesh, a, b, c));
    eventually("A reaches C through B again", Duration::from_secs(30), || {
        let before = forwarded(&mut mesh, b, a, c);
        asks(&mesh, a, c, &a_to_c, &c_sees_a).ok()?;
        (forwarded(&mut mesh, b, a, c) >= before + 5).then_some(())
    });
    eventually("C reaches A through B again", Duration::from_secs(30), || {
        asks(&mesh, c, a, &c_to_a, &a_sees_c).ok()
    });

    weft_tests::step("the hub's export policy applies to transit traffic");
    let view_of_c = mesh.view_of(b, c).unwrap().to_string();
    let set = |args: &[&str]| {
        let o = weft_tests::run(
            std::process::Command::new(bin("weftctl"))
                .args(["--controller", &mesh.sites[b].target, "peering", "policy", "set", "s1"])
                .args(args),
        );
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    };
    // Only B's own CIDR: transit to C refused.
    set(&["--allow", POD]);
    eventually("B refuses A's transit to C", Duration::from_secs(10), || {
        mesh.ask_at(a, &a_to_c).is_err().then_some(())
    });
    mesh.reaches(a, b).unwrap();
    // B's view of C named: allowed again.
    set(&["--allow", POD, "--allow", &view_of_c]);
    eventually("B lets A through to C", Duration::from_secs(10), || {
        asks(&mesh, a, c, &a_to_c, &c_sees_a).ok()
    });
    set(&["--site-default"]);

    weft_tests::step("bad input is refused, naming the field, and changes nothing");
    let e = transit(&mesh, b, "s2", "on").unwrap_err();
    assert!(
        e.contains("INVALID_ARGUMENT") && e.contains("site_id") && e.contains("transit loop"),
        "{e}"
    );
    let e = transit(&mesh, b, "nobody", "on").unwrap_err();
    assert!(e.contains("NOT_FOUND"), "{e}");

    weft_tests::step("transit off at the hub: A no longer reaches C");
    transit(&mesh, b, "s3", "off").unwrap();
    eventually("A's transit path to C goes", Duration::from_secs(20), || {
        through(&mesh, a, b, c).is_none().then_some(())
    });
    eventually("A no longer reaches C", Duration::from_secs(20), || {
        mesh.ask_at(a, &a_to_c).is_err().then_some(())
    });
    mesh.reaches(a, b).unwrap();
    mesh.reaches(c, b).unwrap();
}

/// A–C peered directly, then A–B and B–C with transit: B offers A a path
/// to "s3", a site id nothing from C vouches for. Deleting A–C releases
/// A's view of C; B's path keeps a block of its own, so addresses that
/// meant the site A peered with never start meaning whatever B calls s3.
/// A shows who told it about each transit path.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn a_deleted_direct_peerings_addresses_never_pass_to_a_hubs_transit_path() {
    if !netns::require_root() {
        return;
    }
    let (a, b, c) = (0, 1, 2);
    weft_tests::step("A–C peered directly, then A–B and B–C with transit agreed at each end");
    let mesh = Mesh::up("trd", 3, POD);
    mesh.peer(a, c);
    let direct = mesh.address(a, c).expect("A's direct view of C");
    mesh.reaches(a, c).unwrap();
    mesh.peer_with(a, b, &["--transit"]);
    mesh.peer_with(c, b, &["--transit"]);
    transit(&mesh, b, "s1", "on").unwrap();
    transit(&mesh, b, "s3", "on").unwrap();
    eventually("A is offered s3 through B", Duration::from_secs(20), || {
        let p = mesh.peering(&mesh.sites[a], "s2")?;
        p["transit"]["paths"]
            .as_array()?
            .iter()
            .any(|t| t["site"] == "s3")
            .then_some(())
    });

    weft_tests::step("deleting A–C: A reaches C through B at other addresses; the old ones lead nowhere");
    mesh.unpeer(a, c);
    let via_b = eventually("A's view of C through B", Duration::from_secs(20), || {
        through(&mesh, a, b, c)
    });
    eprintln!("A reached C directly at {direct}, now through B at {via_b}");
    assert_ne!(
        via_b, direct,
        "B's path to \"s3\" took the addresses of A's deleted direct peering with C"
    );
    let c_sees_a = eventually("C's view of A through B", Duration::from_secs(20), || {
        through(&mesh, c, b, a).map(|_| view_at(&mesh, c, b, a))
    });
    eventually("A reaches C through B", Duration::from_secs(30), || {
        asks(&mesh, a, c, &via_b, &c_sees_a).ok()
    });
    assert!(
        mesh.ask_at(a, &direct).is_err(),
        "{direct}, A's released view of C, still answers"
    );

    weft_tests::step("A shows who told it about s3: B");
    let p = mesh.peering(&mesh.sites[a], "s2").unwrap();
    let path = p["transit"]["paths"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["site"] == "s3")
        .unwrap();
    assert_eq!(path["told_by"], "s2", "{path}");
    assert_eq!(path["active"], true, "{path}");
    let table = weft_tests::stdout(&weft_tests::run(std::process::Command::new(bin("weftctl")).args([
        "--controller",
        &mesh.sites[a].target,
        "peerings",
    ])));
    eprintln!("{table}");
    assert!(
        table.contains("s3 via s2: told by s2; nothing from s3 vouches for it"),
        "{table}"
    );
}

/// Site `to`'s IPv6 workload address as site `from` reaches it through
/// the transit peer `via` (its transit path's IPv6 workload view), once
/// in use.
fn through_v6(mesh: &Mesh, from: usize, via: usize, to: usize) -> Option<String> {
    let p = mesh.peering(&mesh.sites[from], &mesh.sites[via].id)?;
    let path = p["transit"]["paths"]
        .as_array()?
        .iter()
        .find(|t| t["site"] == mesh.sites[to].id.as_str() && t["active"] == true)?;
    let local: ipnet::Ipv6Net = path["views"]
        .as_array()?
        .iter()
        .filter(|v| v["kind"] == "workload")
        .find_map(|v| v["local_cidr"].as_str()?.parse().ok())?;
    let real: ipnet::Ipv6Net = POD_V6.parse().unwrap();
    let addr: std::net::Ipv6Addr = mesh.sites[to].workload_v6.as_ref()?.parse().ok()?;
    weft_controller::ipam::translate(addr, real, local).map(|a| a.to_string())
}

const POD_V6: &str = "fd00:1::/48";

/// Three dual-stack sites on the same IPv4 CIDR and the same IPv6 ULA
/// prefix, A–B and B–C peered with transit agreed, no A–C: A's IPv6
/// workload reaches C's through B, at an address of A's own IPv6 remap
/// pool, and back; B counts what it forwarded.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn an_ipv6_workload_reaches_another_spoke_through_a_hub() {
    if !netns::require_root() {
        return;
    }
    let (a, b, c) = (0, 1, 2);
    weft_tests::step("three dual-stack sites on one IPv4 CIDR and one ULA prefix: A–B and B–C with transit");
    let mut mesh = Mesh::up_dual("trn6", 3, POD, POD_V6);
    mesh.peer_with(a, b, &["--transit"]);
    mesh.peer_with(c, b, &["--transit"]);
    for peer in ["s1", "s3"] {
        transit(&mesh, b, peer, "on").unwrap();
    }
    weft_tests::step("A reaches C over IPv6 through B, and C reaches A");
    let a_to_c = eventually("A's IPv6 view of C through B", Duration::from_secs(30), || {
        through_v6(&mesh, a, b, c)
    });
    let c_to_a = eventually("C's IPv6 view of A through B", Duration::from_secs(30), || {
        through_v6(&mesh, c, b, a)
    });
    eprintln!("over IPv6, A reaches C at {a_to_c}, C reaches A at {c_to_a} (through B)");
    let own: ipnet::Ipv6Net = POD_V6.parse().unwrap();
    for addr in [&a_to_c, &c_to_a] {
        let ip: std::net::Ipv6Addr = addr.parse().unwrap();
        assert!(
            !own.contains(&ip),
            "{addr}: a view in the site's own remap pool, not its own prefix"
        );
    }
    let before = forwarded(&mut mesh, b, a, c);
    for (from, to) in [(a, &a_to_c), (c, &c_to_a)] {
        let wl = mesh.sites[from].wl.clone();
        eventually(
            &format!("{} pings {to}", mesh.sites[from].id),
            Duration::from_secs(30),
            || {
                mesh.lab
                    .exec(&wl, &["ping", "-6", "-c", "1", "-W", "1", to])
                    .status
                    .success()
                    .then_some(())
            },
        );
    }
    let after = forwarded(&mut mesh, b, a, c);
    assert!(
        after > before,
        "B's transit counter for A to C did not move ({before} then {after})"
    );
    // IPv4 goes through B too, alike.
    let v4 = eventually("A's IPv4 view of C through B", Duration::from_secs(20), || {
        through(&mesh, a, b, c)
    });
    mesh.ask_at(a, &v4).unwrap();
}

#[test]
fn the_controller_renders_no_more_transit_prefixes_than_an_agent_takes() {
    assert_eq!(
        weft_controller::transit::MAX_FILTER_PREFIXES,
        weft_dataplane::desired::decode::MAX_TRANSIT_PREFIXES
    );
}
