//! The churn benchmark: N simulated node agents stay connected to one real
//! `weft-controller` while, for a duration, new nodes join (enroll, watch)
//! and the oldest newcomers leave (removed through the admin API, which
//! revokes them and ends their streams) at a steady rate. The controller's
//! RSS and open file descriptors are sampled throughout; at the end, with
//! the churn over and every newcomer gone, both must be back near where
//! they were with only the N connected (no leak per join or leave).
//!
//! `weft-churn --agents 1000 --duration 300s --rate 10` (docs/benchmarks.md);
//! exits 1 when memory or descriptors did not come back.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use weft_proto::v1 as pb;
use weft_tests::sim::{Bench, Event, memory_and_fds, simulated_agent, underlay};

#[derive(Parser, Debug)]
struct Args {
    /// Simulated node agents connected throughout.
    #[arg(long, default_value_t = 1000)]
    agents: usize,
    /// embedded or etcd.
    #[arg(long, default_value = "embedded")]
    store: String,
    /// How long nodes join and leave.
    #[arg(long, default_value = "300s")]
    duration: humantime::Duration,
    /// Joins per second (and as many leaves, once `pool` newcomers are up).
    #[arg(long, default_value_t = 10.0)]
    rate: f64,
    /// Newcomers connected at once before the oldest leaves.
    #[arg(long, default_value_t = 20)]
    pool: usize,
    /// Registrations and connections in flight at once (initial enrollment).
    #[arg(long, default_value_t = 64)]
    parallel: usize,
    /// Allowed growth of RSS at the end over the steady state, MiB.
    #[arg(long, default_value_t = 16.0)]
    rss_slack_mib: f64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let bench = Bench::start(&args.store, args.parallel).await?;
    let (ctx, admin, sem) = (bench.ctx.clone(), &bench.admin, bench.sem.clone());
    let pid = bench.controller.pid();

    // N agents, enrolled and connected.
    let n = args.agents;
    let t_setup = Instant::now();
    let ids = bench.enroll(n).await?;
    let (tx, mut rx) = bench.connect(ids).await?;
    // Drain events in the background from now on.
    let removed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen_removed = removed.clone();
    tokio::spawn(async move {
        while let Some(e) = rx.recv().await {
            if let Event::Removed(_) = e {
                seen_removed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    let steady = memory_and_fds(pid);
    println!(
        "weft-churn: {n} agents connected in {:.1} s; controller {:.1} MiB RSS, {} fds",
        t_setup.elapsed().as_secs_f64(),
        steady.0,
        steady.1
    );

    // Churn: join at `rate`, and once `pool` newcomers are up, remove the
    // oldest for each join.
    let mut churn_tok = bench.token(pb::AgentRole::Node, 10_000).await?;
    let every = Duration::from_secs_f64(1.0 / args.rate.max(0.1));
    let mut tick = tokio::time::interval(every);
    let mut pool: VecDeque<String> = VecDeque::new();
    let (mut joined, mut left, mut k) = (0usize, 0usize, 0usize);
    let t0 = Instant::now();
    let mut next_sample = Duration::ZERO;
    let mut samples = Vec::new();
    while t0.elapsed() < *args.duration {
        tick.tick().await;
        let name = format!("c{k}");
        let i = n + k;
        if k % 10_000 == 0 {
            churn_tok = bench.token(pb::AgentRole::Node, 10_000).await?; // a token enrolls at most 10,000
        }
        let (cert, key) = ctx.register(&churn_tok, &name, &underlay(i)).await?;
        tokio::spawn(simulated_agent(i, ctx.clone(), cert, key, tx.clone(), sem.clone()));
        pool.push_back(name);
        joined += 1;
        k += 1;
        if pool.len() > args.pool {
            let gone = pool.pop_front().unwrap();
            admin.clone().delete_node(pb::DeleteNodeRequest { name: gone }).await?;
            left += 1;
        }
        if t0.elapsed() >= next_sample {
            let s = memory_and_fds(pid);
            samples.push((t0.elapsed().as_secs(), s));
            next_sample += Duration::from_secs(10);
        }
    }
    // The rest of the newcomers leave; the churn is over.
    for gone in pool.drain(..) {
        admin.clone().delete_node(pb::DeleteNodeRequest { name: gone }).await?;
        left += 1;
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let end = memory_and_fds(pid);
    println!(
        "weft-churn: {joined} joined and {left} left in {:.0} s ({:.1}/s each way), {} newcomers stopped on removal",
        t0.elapsed().as_secs_f64(),
        joined as f64 / t0.elapsed().as_secs_f64(),
        removed.load(std::sync::atomic::Ordering::Relaxed)
    );
    for (t, (rss, fds)) in &samples {
        println!("  t={t:>4}s  RSS {rss:>6.1} MiB  fds {fds}");
    }
    println!(
        "  end      RSS {:>6.1} MiB  fds {}  (steady state before: {:.1} MiB, {} fds)",
        end.0, end.1, steady.0, steady.1
    );
    let nodes = admin
        .clone()
        .list_nodes(pb::ListNodesRequest {})
        .await?
        .into_inner()
        .nodes
        .len();
    anyhow::ensure!(nodes == n, "{nodes} nodes recorded at the end, expected {n}");
    anyhow::ensure!(
        end.1 <= steady.1 + 8,
        "file descriptors leaked: {} at the end, {} before the churn",
        end.1,
        steady.1
    );
    anyhow::ensure!(
        end.0 <= steady.0 * 1.25 + args.rss_slack_mib,
        "memory grew: {:.1} MiB at the end, {:.1} MiB before the churn",
        end.0,
        steady.0
    );
    println!("weft-churn: memory and descriptors flat");
    Ok(())
}
