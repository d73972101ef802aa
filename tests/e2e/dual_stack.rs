//! Dual stack between real controller processes on loopback: two sites on
//! the same IPv4 CIDR and the same IPv6 ULA prefix each remap the other in
//! both families; an IPv4-only site peered with a dual-stack one keeps its
//! IPv4 views, and both sides say why IPv6 is not negotiated.

use std::process::Command;

use serde_json::Value;
use weft_tests::{Controller, ControllerSpec, bin, run, stdout, weftctl_json};

fn site(dir: &std::path::Path, id: &str, pods: &str) -> Controller {
    ControllerSpec::new(id)
        .data_dir(&dir.join(id))
        .flags(&["--pod-cidr", pods])
        .start()
}

fn peer(a: &Controller, b: &Controller) {
    let token = weftctl_json(&b.target(), &["peering", "token", "--ttl", "10m"])["token"]
        .as_str()
        .unwrap()
        .to_string();
    weftctl_json(&a.target(), &["peering", "create", "--token", &token]);
}

/// Site `c`'s peering with `peer`, as `weftctl peerings` shows it.
fn peering(c: &Controller, peer: &str) -> Value {
    weftctl_json(&c.target(), &["peerings"])["peerings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["site_id"] == peer)
        .unwrap_or_else(|| panic!("no peering with {peer}"))
        .clone()
}

/// The (real, local) CIDRs of `p`'s workload views.
fn workload_views(p: &Value) -> Vec<(String, String)> {
    p["views"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["kind"] == "workload")
        .map(|v| {
            (
                v["real_cidr"].as_str().unwrap().to_string(),
                v["local_cidr"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The remap pools of site `c`, IPv6 ones only.
fn ipv6_pools(c: &Controller) -> Vec<ipnet::Ipv6Net> {
    weftctl_json(&c.target(), &["site"])["remap_pools"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p.as_str().unwrap().parse().ok())
        .collect()
}

#[test]
fn same_cidrs_in_both_families_are_remapped_and_an_ipv4_site_says_why_not() {
    let dir = tempfile::Builder::new().prefix("weft-dual").tempdir().unwrap();
    let a = site(dir.path(), "site-a", "10.1.0.0/16,fd00:1::/48");
    let b = site(dir.path(), "site-b", "10.1.0.0/16,fd00:1::/48");
    let c = site(dir.path(), "site-c", "10.1.0.0/16");

    weft_tests::step("two dual-stack sites on the same CIDRs remap each other in both families");
    peer(&a, &b);
    for (x, y) in [(&a, "site-b"), (&b, "site-a")] {
        let p = peering(x, y);
        assert_eq!(p["ipv6"], "negotiated", "{p:#}");
        let views = workload_views(&p);
        assert_eq!(views.len(), 2, "{views:?}");
        let (real4, local4) = &views[0];
        assert_eq!(real4, "10.1.0.0/16");
        assert_ne!(local4, "10.1.0.0/16", "the IPv4 view is remapped");
        let (real6, local6) = &views[1];
        assert_eq!(real6, "fd00:1::/48");
        let local6: ipnet::Ipv6Net = local6.parse().unwrap();
        assert_eq!(local6.prefix_len(), 48, "the length is kept");
        let pools = ipv6_pools(x);
        assert!(
            pools.iter().any(|p| p.contains(&local6)),
            "{local6} is not in {pools:?}"
        );
    }
    let text = stdout(&run(Command::new(bin("weftctl")).args([
        "--controller",
        &a.target(),
        "peerings",
    ])));
    assert!(
        text.contains("fd00:1::/48") && text.contains("site-b: IPv6 negotiated"),
        "{text}"
    );

    weft_tests::step("an IPv4-only site keeps its IPv4 views; both sides say why IPv6 is not negotiated");
    peer(&a, &c);
    let ac = peering(&a, "site-c");
    assert_eq!(workload_views(&ac).len(), 1, "{ac:#}");
    assert_eq!(workload_views(&ac)[0].0, "10.1.0.0/16");
    let why = ac["ipv6"].as_str().unwrap();
    assert!(why.starts_with("not negotiated: site-c offered no IPv6 CIDRs"), "{why}");
    let ca = peering(&c, "site-a");
    assert_eq!(workload_views(&ca).len(), 1, "{ca:#}");
    let why = ca["ipv6"].as_str().unwrap();
    assert!(
        why.contains("site-a offers IPv6 CIDRs, but this site has none"),
        "{why}"
    );
    // The peering itself is whole: negotiated, its IPv4 view in place.
    assert_ne!(ac["state"], "pending", "{ac:#}");
}
