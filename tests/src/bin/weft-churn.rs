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

use anyhow::Context;
use clap::Parser;
use tokio::sync::mpsc;
use weft_proto::v1 as pb;
use weft_proto::v1::admin_service_client::AdminServiceClient;
use weft_tests::sim::{Ctx, Event, simulated_agent, underlay};
use weft_tests::{Controller, Etcd};

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

/// (RSS MiB, open fds) of a process now.
fn sample(pid: u32) -> (f64, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|k| k.parse::<f64>().ok())
        .unwrap_or(0.0)
        / 1024.0;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
    (rss, fds)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::Builder::new().prefix("weft-churn").tempdir()?;
    let etcd = if args.store == "etcd" {
        Some(Etcd::start().context("etcd is not installed")?)
    } else {
        None
    };
    let mut flags: Vec<String> = [
        "--pod-cidr",
        "10.0.0.0/8",
        "--internal-cidr",
        "100.64.0.0/10",
        "--external-cidr",
        "172.16.0.0/16",
        "--agent-ttl",
        "600s",
    ]
    .map(String::from)
    .to_vec();
    if let Some(e) = &etcd {
        flags.extend(["--etcd-endpoints".into(), e.endpoint()]);
    }
    let refs: Vec<&str> = flags.iter().map(String::as_str).collect();
    let c = Controller::start("churn", &dir.path().join("data"), &refs);
    let pid = c.pid();
    let ctx = Arc::new(Ctx {
        port: c.listen_port,
        ca_pem: std::fs::read_to_string(c.pki("ca.pem"))?,
    });
    let admin_id = (
        std::fs::read_to_string(c.pki("admin.pem"))?,
        std::fs::read_to_string(c.pki("admin.key"))?,
    );
    let admin = AdminServiceClient::new(ctx.channel(Some((&admin_id.0, &admin_id.1))).await?);
    let token = |uses: u32| {
        let mut admin = admin.clone();
        async move {
            Ok::<_, anyhow::Error>(
                admin
                    .create_token(pb::CreateTokenRequest {
                        role: pb::AgentRole::Node as i32,
                        name: String::new(),
                        ttl_seconds: 86_400,
                        uses,
                    })
                    .await?
                    .into_inner()
                    .token,
            )
        }
    };

    // N agents, enrolled and connected.
    let n = args.agents;
    let t_setup = Instant::now();
    let tok = Arc::new(token(n as u32).await?);
    let sem = Arc::new(tokio::sync::Semaphore::new(args.parallel));
    let mut handles = Vec::new();
    for i in 0..n {
        let (ctx, tok, sem) = (ctx.clone(), tok.clone(), sem.clone());
        handles.push(tokio::spawn(async move {
            let _p = sem.acquire().await.unwrap();
            ctx.register(&tok, &format!("n{i}"), &underlay(i)).await
        }));
    }
    let mut ids = Vec::with_capacity(n);
    for h in handles {
        ids.push(h.await??);
    }
    let (tx, mut rx) = mpsc::unbounded_channel::<Event>();
    for (i, (cert, key)) in ids.into_iter().enumerate() {
        tokio::spawn(simulated_agent(i, ctx.clone(), cert, key, tx.clone(), sem.clone()));
    }
    let mut connected = 0;
    while connected < n {
        match tokio::time::timeout(Duration::from_secs(300), rx.recv()).await {
            Ok(Some(Event::Connected)) => connected += 1,
            Ok(Some(_)) => {}
            _ => anyhow::bail!("only {connected} of {n} agents connected"),
        }
    }
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
    let steady = sample(pid);
    println!(
        "weft-churn: {n} agents connected in {:.1} s; controller {:.1} MiB RSS, {} fds",
        t_setup.elapsed().as_secs_f64(),
        steady.0,
        steady.1
    );

    // Churn: join at `rate`, and once `pool` newcomers are up, remove the
    // oldest for each join.
    let mut churn_tok = token(10_000).await?;
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
            churn_tok = token(10_000).await?; // a token enrolls at most 10,000
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
            let s = sample(pid);
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
    let end = sample(pid);
    let still = c.pid() == pid;
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
    anyhow::ensure!(still, "the controller restarted");
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
    drop(c);
    drop(etcd);
    Ok(())
}
