//! Sustained churn against 500 connected simulated agents: nodes join and
//! leave at a steady rate. After a 75 s warm-up (each connection's bounded
//! state fills: its HPACK table takes a new `date` header every second that
//! it carries a response; the agents heartbeat every second here, TTL 3 s)
//! the controller's RSS may grow by at most 3 % over a minute more of
//! churn (a planted leak of 10 % over the run grows it 5.6 %; none, 1.5 %),
//! and its descriptors are back where they were once the churn is over.
//! The long run (minutes, release build) is `tests/bench-churn.sh`,
//! recorded in docs/benchmarks.md; this is its short run.

use weft_tests::{bin, stdout};

#[test]
fn churn_against_500_agents_leaks_neither_memory_nor_descriptors() {
    // One TLS connection per agent on each side: more descriptors than a
    // default soft limit.
    let o = weft_tests::run(std::process::Command::new("sh").arg("-c").arg(format!(
        "ulimit -n \"$(ulimit -Hn)\" && exec {} --agents 500 --agent-ttl 3s --warmup 75s --duration 60s --rate 10 \
         --store-history 1000",
        bin("weft-churn").display()
    )));
    let out = stdout(&o);
    println!("{out}");
    assert!(o.status.success(), "{out}\n{}", weft_tests::stderr(&o));
    assert!(out.contains("memory and descriptors flat"), "{out}");
    // The embedded store's file and cache, read from the controller's metrics.
    assert!(
        out.contains("the embedded store over the measured churn: file"),
        "{out}"
    );
}
