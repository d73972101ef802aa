//! What the benchmarks measure with, written once: TCP throughput with
//! iperf3 between two lab hosts, and medians.

use std::path::Path;
use std::time::Duration;

use crate::netns::{Lab, must};

/// Receiver-side throughput in Gbit/s of one iperf3 run of `seconds` from
/// namespace `client` to `server_ip` (a server started in `server`).
pub fn iperf(lab: &mut Lab, log: &Path, server: &str, client: &str, server_ip: &str, seconds: u32) -> f64 {
    let i = lab.spawn(server, Path::new("/usr/bin/iperf3"), &["-s", "-1"], log);
    std::thread::sleep(Duration::from_millis(300));
    let o = must(
        lab.exec(client, &["iperf3", "-c", server_ip, "-t", &seconds.to_string(), "-J"]),
        "iperf3 client",
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("iperf3 -J output");
    lab.proc(i).wait_exit(Duration::from_secs(5));
    v["end"]["sum_received"]["bits_per_second"].as_f64().unwrap() / 1e9
}

/// The median of `v` (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
