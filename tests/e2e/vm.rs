//! The VM lane: weft on Debian's stock kernel under QEMU (`weft_tests::vm`),
//! for what this machine's kernel cannot show: kernel WireGuard, Geneve,
//! and interoperability between a kernel and a userspace WireGuard end.
//! Each test boots a guest and runs a scenario of `weft-vm-guest` in it,
//! from the host's build. Root-only (the guest's scenarios build network
//! namespaces as root inside the VM; the lane is part of `tests/run.sh`).

use std::time::Duration;

use weft_tests::vm;

/// Runs `script` in a guest; fails the test with the guest's console
/// unless it exits 0.
fn guest(script: &str, limit: Duration) -> vm::Outcome {
    let out = vm::run(script, limit).unwrap_or_else(|e| panic!("the VM lane cannot run: {e}"));
    eprintln!(
        "--- guest console ({:.1} s) ---\n{}",
        out.elapsed.as_secs_f64(),
        out.console
    );
    // WEFT_VM_LOGS_DIR: every log the guest left, whole, in that folder.
    if let Some(dir) = std::env::var_os("WEFT_VM_LOGS_DIR") {
        let dir = std::path::Path::new(&dir);
        std::fs::create_dir_all(dir).unwrap();
        for (name, text) in &out.logs {
            std::fs::write(dir.join(name), text).unwrap();
        }
    }
    for (name, text) in &out.logs {
        let lines: Vec<&str> = text.lines().collect();
        eprintln!("--- {name} (last 80 lines) ---");
        for l in &lines[lines.len().saturating_sub(80)..] {
            eprintln!("{l}");
        }
    }
    out
}

#[test]
#[ignore = "needs root and the VM lane (run by tests/run.sh)"]
fn the_guest_runs_the_stock_kernel_and_reports_the_scripts_status() {
    let out = guest(
        "uname -r; ip link add weftt0 type wireguard && ip link add weftg0 type geneve id 1 remote 192.0.2.1 \
         && ip -br link show type wireguard && ip -br link show type geneve && exit 3",
        Duration::from_secs(120),
    );
    assert_eq!(out.status, Some(3), "the script's own status comes back");
    let k = vm::kernel().unwrap();
    assert!(out.console.contains(&k.version), "not the stock kernel");
    assert!(out.console.contains("weftt0") && out.console.contains("weftg0"));
}

/// Runs scenario `name` of `weft-vm-guest` in a guest and asserts it
/// passed; the guest's console.
fn scenario(name: &str, limit: Duration) -> String {
    let bin = weft_tests::bin("weft-vm-guest");
    // The guest first measures its pace against the host's (see
    // weft_tests::pace): the scenario's waits and the lab's keep-alive
    // allowance stretch by it.
    let out = guest(
        &format!(
            "pace=$({bin} pace) || exit 97\neval \"$pace\"\nWEFT_LOG=info,weft_dataplane=debug{keep}{rounds} exec {bin} {name}",
            bin = bin.display(),
            // WEFT_VM_FAILOVER_ROUNDS: that many failovers in the kernel
            // scenario (one by default).
            rounds = std::env::var("WEFT_VM_FAILOVER_ROUNDS")
                .ok()
                .and_then(|v| v.parse::<u32>().ok())
                .map(|n| format!(" WEFT_VM_FAILOVER_ROUNDS={n}"))
                .unwrap_or_default(),
            keep = if std::env::var_os("WEFT_VM_LOGS_DIR").is_some() {
                ",weft_agent=debug,weft_controller::state=debug,weft_controller::store=debug,weft_controller::federation=debug WEFT_VM_KEEP_LOGS=1"
            } else {
                ""
            }
        ),
        limit,
    );
    let pace = out
        .console
        .lines()
        .find(|l| l.contains("weft-vm-guest: waits stretched"))
        .unwrap_or("the guest did not measure its pace")
        .trim()
        .to_string();
    assert!(
        !out.timed_out,
        "scenario {name} did not finish within {:.0} s ({pace})",
        out.limit.as_secs_f64()
    );
    assert!(out.passed(), "scenario {name} failed (status {:?}; {pace})", out.status);
    out.console
}

/// The stretch the guest measured (see `weft_tests::pace`), from its console.
fn stretch_of(console: &str) -> f64 {
    console
        .lines()
        .find_map(|l| l.split("waits stretched ").nth(1))
        .and_then(|r| r.split('x').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(1.0)
}

#[test]
#[ignore = "needs root and the VM lane (run by tests/run.sh)"]
fn the_kernel_wireguard_driver_makes_reads_and_changes_links_and_peers() {
    let c = scenario("driver", Duration::from_secs(180));
    assert!(c.contains("driver passed"));
}

#[test]
#[ignore = "needs root and the VM lane (run by tests/run.sh)"]
fn kernel_wireguard_gateways_geneve_overlay_failover_and_teardown() {
    let c = scenario("kernel", Duration::from_secs(900));
    assert!(c.contains("kernel passed"));
    let outages: Vec<f64> = c
        .lines()
        .filter_map(|l| l.split("outage_ms=").nth(1))
        .filter_map(|r| r.split_whitespace().next())
        .filter_map(|v| v.parse().ok())
        .collect();
    for l in c.lines().filter(|l| l.contains("failover_timeline")) {
        println!("{}", l.trim());
    }
    println!("outages (ms): {outages:?}");
    assert!(!outages.is_empty(), "the guest printed no outage");
    let ms = outages.iter().copied().fold(0.0, f64::max);
    // The VM is emulated (TCG, some 25 times slower than the host). A
    // silent death is found by the gateway TTL (3 s in the lane, before
    // the stretch); the rest is the election, both sites' agents applying
    // and the peer taking in the new gateway. Measured 4.1–8.1 s over three
    // rounds in each of several runs (docs/reliability.md has the
    // timelines; the target, under 5 s, is not met in every round yet);
    // the bound, 12 s stretched like the lane's timings, catches a
    // regression to the 19 s seen before the timeline found its causes.
    let stretch = stretch_of(&c);
    let bound = 12_000.0 * stretch;
    assert!(
        ms < bound,
        "outage {ms} ms with kernel WireGuard in the VM (bound {bound:.0} ms: 12 s stretched {stretch:.2}x)"
    );
}

#[test]
#[ignore = "needs root and the VM lane (run by tests/run.sh)"]
fn a_kernel_and_a_userspace_gateway_interoperate_and_switch_across_restarts() {
    let c = scenario("mixed", Duration::from_secs(900));
    assert!(c.contains("mixed passed"));
}

#[test]
#[ignore = "needs root and the VM lane (run by tests/run.sh)"]
fn two_sites_behind_nat_hole_punch_a_kernel_wireguard_tunnel() {
    let c = scenario("nat", Duration::from_secs(600));
    assert!(c.contains("nat passed"));
    let punched = c
        .lines()
        .find_map(|l| l.split("punched_ms=").nth(1))
        .unwrap_or("?")
        .trim()
        .to_string();
    println!(
        "VM lane: both sites behind NAT, kernel WireGuard, hole-punched {punched} ms after the peering (stretch {:.2}x)",
        stretch_of(&c)
    );
}

#[test]
#[ignore = "needs root and the VM lane (run by tests/run.sh)"]
fn three_kernel_wireguard_sites_carry_traffic_once_every_peering_shows_connected() {
    let c = scenario("hub", Duration::from_secs(600));
    assert!(c.contains("hub passed"));
    for l in c
        .lines()
        .filter(|l| l.contains("hub_connected_ms") || l.contains("hub ask"))
    {
        println!("{}", l.trim());
    }
}
