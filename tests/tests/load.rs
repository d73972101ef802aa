//! Sustained churn against 1,000 connected simulated agents: nodes join and
//! leave at a steady rate, and the controller's memory and open file
//! descriptors are back where they were once the churn is over. The long
//! run (minutes, release build) is `tests/bench-churn.sh`, recorded in
//! docs/benchmarks.md; this is its short run.

use weft_tests::{bin, stdout};

#[test]
fn a_minute_of_churn_against_1000_agents_leaks_neither_memory_nor_descriptors() {
    // One TLS connection per agent on each side: more descriptors than a
    // default soft limit.
    let o = weft_tests::run(std::process::Command::new("sh").arg("-c").arg(format!(
        "ulimit -n \"$(ulimit -Hn)\" && exec {} --agents 1000 --duration 60s --rate 10",
        bin("weft-churn").display()
    )));
    let out = stdout(&o);
    println!("{out}");
    assert!(o.status.success(), "{out}\n{}", weft_tests::stderr(&o));
    assert!(out.contains("memory and descriptors flat"), "{out}");
}
