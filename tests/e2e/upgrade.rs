//! The upgrade lane: the previous release (built from its tag by
//! tests/prev-release.sh) beside this one, as the skew policy allows: site
//! a's controller is this release with agents of the previous one, peered
//! with site b, wholly the previous release. Then each part is upgraded in
//! turn, under 50 Hz pings across the peering: site b's controller, then
//! every agent, gateways first. Each step's outage is measured.

use std::time::Duration;

use weft_tests::sites::{self, Opts, TwoSites, ping_wa_to_wb, until_wa_reaches_wb};
use weft_tests::{eventually, unix_now, weftctl_json};

const THIS: &str = env!("CARGO_PKG_VERSION");

/// Waits until `target`'s `weftctl version` shows agent `name` connected
/// and running `release`.
fn agent_runs(target: &str, name: &str, release: &str) {
    eventually(
        &format!("{name} connected and reporting {release}"),
        Duration::from_secs(30),
        || {
            let v = weftctl_json(target, &["version"]);
            v["agents"]
                .as_array()?
                .iter()
                .any(|a| a["name"] == name && a["version"] == release && a["connected"] == true)
                .then_some(())
        },
    );
}

/// Per step (each starting at its Unix time in `starts`): the pings lost
/// and the longest silence between answers, counting each silence in the
/// step during which it began.
fn per_step(answers: &[(f64, u64)], starts: &[f64]) -> Vec<(u64, f64)> {
    let first = |at: f64| answers.iter().rposition(|a| a.0 < at).unwrap_or(0);
    let mut bounds: Vec<usize> = starts.iter().map(|t| first(*t)).collect();
    bounds.push(answers.len() - 1);
    bounds
        .windows(2)
        .map(|w| {
            answers[w[0]..=w[1]].windows(2).fold((0, 0.0_f64), |(lost, gap), p| {
                // (a duplicate or late answer counts nothing)
                (lost + p[1].1.saturating_sub(p[0].1 + 1), gap.max(p[1].0 - p[0].0))
            })
        })
        .collect()
}

#[test]
#[ignore = "needs root (network namespaces) and the previous release's binaries: tests/run.sh builds them and runs it as root"]
fn the_previous_release_runs_beside_this_one_and_each_part_upgrades_under_traffic() {
    weft_tests::netns::require_root();
    let Some((prev, dir)) = weft_tests::prev_release() else {
        return;
    };
    weft_tests::step("this controller with the previous release's agents, peered with a previous site");
    let mut s: TwoSites = sites::up_with(
        "upg",
        ("upg-a", "10.1.0.0/16"),
        ("upg-b", "10.2.0.0/16"),
        Opts {
            bins_a_agents: Some(dir),
            bins_b: Some(dir),
            ..Default::default()
        },
    );
    until_wa_reaches_wb(&s);
    for name in ["gw", "na", "na2"] {
        agent_runs(&s.ta, name, prev);
    }
    // The peer's release comes with its parameters, which may follow the
    // first traffic by a moment.
    let v = eventually("site a sees site b's release", Duration::from_secs(30), || {
        let v = weftctl_json(&s.ta, &["version"]);
        (v["peers"][0]["version"] == prev).then_some(v)
    });
    assert_eq!(v["controller"], THIS, "{v}");
    assert!(
        !v.to_string().contains("outside_policy\":\""),
        "outside the policy: {v}"
    );
    s.reach_quickly("wb", &s.wa_from_b.clone(), Duration::from_secs(10));

    let (ping, log) = ping_wa_to_wb(&mut s, "upgrade-ping.log");
    let mut steps: Vec<(String, f64)> = Vec::new();

    weft_tests::step("upgrade site b's controller");
    let t0 = unix_now();
    s.lab.ctl(1).stop();
    s.lab.ctl(1).set_bins(None);
    s.lab.ctl(1).restart_stopped();
    eventually("site a sees site b's new release", Duration::from_secs(30), || {
        (weftctl_json(&s.ta, &["version"])["peers"][0]["version"] == THIS).then_some(())
    });
    steps.push(("site b's controller".into(), t0));
    std::thread::sleep(Duration::from_secs(1));

    // Gateways first, then nodes; site a, then site b.
    for host in ["gwa", "gwb", "na", "na2", "nb", "nb2"] {
        let &(i, _, kind, _) = s.agents.iter().find(|a| a.1 == host).expect("an agent on each host");
        let (target, name) = match host {
            "gwa" => (&s.ta, "gw"),
            "gwb" => (&s.tb, "gw"),
            h if h.starts_with("na") => (&s.ta, h),
            h => (&s.tb, h),
        };
        let target = target.clone();
        weft_tests::step(&format!("upgrade {kind} {name} on {host}"));
        let t0 = unix_now();
        s.lab.set_program(i, &weft_tests::bin(&format!("weft-{kind}-agent")));
        s.lab.proc(i).stop();
        s.lab.respawn(i);
        agent_runs(&target, name, THIS);
        steps.push((format!("{kind} {name} on {host}"), t0));
        std::thread::sleep(Duration::from_secs(1));
    }
    s.lab.proc(ping).stop();
    let answers = weft_tests::ping_answers(&std::fs::read_to_string(&log).unwrap());
    assert!(
        answers.len() > 100,
        "too few pings answered to judge: {}",
        answers.len()
    );
    let starts: Vec<f64> = steps.iter().map(|s| s.1).collect();
    let measured: Vec<(&str, u64, f64)> = steps
        .iter()
        .zip(per_step(&answers, &starts))
        .map(|(s, (lost, gap))| (s.0.as_str(), lost, gap))
        .collect();
    eprintln!("upgrade from {prev} to {THIS}, per step (pings lost at 50 Hz, longest silence in s): {measured:?}");
    for (what, lost, gap) in &measured {
        if what.starts_with("gateway") {
            // A gateway agent's userspace WireGuard device goes down with
            // it: its tunnel is back once the new agent's device is up
            // (0.2 s measured).
            assert!(*gap < 2.0, "{what}: pings stopped for {gap:.2} s (bound 2 s)");
        } else {
            // Everything else the agent made stays in the kernel.
            assert_eq!(*lost, 0, "{what}: {lost} pings lost");
        }
    }
    let v = weftctl_json(&s.ta, &["version"]);
    assert!(
        v["agents"].as_array().unwrap().iter().all(|a| a["version"] == THIS),
        "{v}"
    );
    assert_eq!(v["peers"][0]["version"], THIS, "{v}");
    s.reach_quickly("wb", &s.wa_from_b.clone(), Duration::from_secs(10));
}
