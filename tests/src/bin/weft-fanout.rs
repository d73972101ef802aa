//! The fan-out benchmark: N simulated agents (each its own key,
//! certificate, TLS connection and Watch stream, acknowledging every message
//! with a Report) against one real `weft-controller` process on the
//! embedded store or a real etcd. Measures the time to connect all N, the
//! time until every agent acknowledged a change that concerns all of them,
//! the time for a change that concerns one agent to reach it while all N are
//! connected, and the controller's CPU time and its RSS (current and
//! peak). The agents send heartbeats at the default agent TTL.
//!
//! `weft-fanout --agents 1000 --store embedded` (see docs/benchmarks.md).
//! Build with `--release` for figures worth recording.

use std::time::{Duration, Instant};

use clap::Parser;
use tokio::sync::mpsc;
use weft_proto::v1 as pb;
use weft_proto::v1::agent_service_client::AgentServiceClient;
use weft_tests::sim::{Bench, Event, ms, pct, proc_stats, underlay};

#[derive(Parser, Debug)]
struct Args {
    /// Simulated node agents.
    #[arg(long, default_value_t = 1000)]
    agents: usize,
    /// embedded or etcd.
    #[arg(long, default_value = "embedded")]
    store: String,
    /// Single-agent changes to time (new nodes, each seen by one gateway).
    #[arg(long, default_value_t = 200)]
    single_changes: usize,
    /// Pause after the change for all before timing single changes, so they
    /// measure steady state rather than the tail of the previous burst.
    #[arg(long, default_value = "2s")]
    settle: humantime::Duration,
    /// How long all N stay connected, sending heartbeats, before the
    /// changes (a full default agent TTL: each agent heartbeats 3 times).
    #[arg(long, default_value = "15s")]
    hold: humantime::Duration,
    /// How long the controller stays down in the restart phase.
    #[arg(long, default_value = "10s")]
    restart_pause: humantime::Duration,
    /// Registrations and connections in flight at once.
    #[arg(long, default_value_t = 64)]
    parallel: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut bench = Bench::start(&args.store, args.parallel).await?;
    let pid = bench.controller.pid();
    let ctx = bench.ctx.clone();
    let n = args.agents;
    let cpu0 = proc_stats(pid).cpu_secs;

    // Enroll N node agents.
    let t_enroll = Instant::now();
    let ids = bench.enroll(n).await?;
    let enroll_time = t_enroll.elapsed();

    // Connect all N streams.
    let t_connect = Instant::now();
    let (_tx, mut rx) = bench.connect(ids).await?;
    let connect_time = t_connect.elapsed();
    let connected = proc_stats(pid);
    let beats0 = weft_tests::sim::HEARTBEATS.load(std::sync::atomic::Ordering::Relaxed);
    let t_beats = Instant::now();
    // Steady state with heartbeats: what it costs the controller.
    tokio::time::sleep(*args.hold).await;
    let held = proc_stats(pid);
    let hold_cpu = held.cpu_secs - connected.cpu_secs;

    // A change that concerns all N: the first gateway appears.
    let gw_token = bench.token(pb::AgentRole::Gateway, 2).await?;
    let t0 = Instant::now();
    let gateway = ctx.register(&gw_token, "gw", "10.255.0.1").await?;
    let all = acked_by_all(&mut rx, n, t0).await?;

    // Changes that concern one agent: new nodes, as seen by the gateway.
    let mut single = changes_for_one(&bench, gateway, &args).await?;
    single.sort();
    let after = proc_stats(pid);
    let beats = weft_tests::sim::HEARTBEATS.load(std::sync::atomic::Ordering::Relaxed) - beats0;
    let beat_rate = beats as f64 / t_beats.elapsed().as_secs_f64();

    // Resume after a controller restart: stopped for a while, then back.
    let (resume_time, snapshots) = resumed(&mut bench, &mut rx, n, *args.restart_pause).await?;

    println!("weft-fanout: {} agents, {} store", n, args.store);
    println!(
        "  enroll all (register, {} in flight):   {:.1} s",
        args.parallel,
        enroll_time.as_secs_f64()
    );
    println!(
        "  connect all (TLS + Watch + first ack): {:.1} s",
        connect_time.as_secs_f64()
    );
    println!(
        "  change for all, until every ack:       p50 {}  p99 {}  max {}",
        ms(pct(&all, 0.5)),
        ms(pct(&all, 0.99)),
        ms(*all.last().unwrap())
    );
    println!(
        "  change for one ({} samples):           p50 {}  p99 {}  max {}",
        single.len(),
        ms(pct(&single, 0.5)),
        ms(pct(&single, 0.99)),
        ms(*single.last().unwrap_or(&Duration::ZERO))
    );
    println!(
        "  resume after a {} stop:  all {n} back in {:.1} s, {snapshots} snapshots",
        args.restart_pause,
        resume_time.as_secs_f64()
    );
    println!(
        "  heartbeats (default agent TTL):        {beat_rate:.0}/s while connected; over the {} hold \
         the controller used {:.0} % of a core",
        args.hold,
        100.0 * hold_cpu / args.hold.as_secs_f64()
    );
    println!(
        "  controller CPU time:                   {:.1} s",
        after.cpu_secs - cpu0
    );
    println!(
        "  controller RSS: {:.0} MiB with all connected, {:.0} MiB after the hold, {:.0} MiB after the changes, peak {:.0} MiB",
        connected.rss, held.rss, after.rss, after.peak
    );
    Ok(())
}

/// How long after `t0` each of the `n` agents acknowledged a change.
async fn acked_by_all(rx: &mut mpsc::UnboundedReceiver<Event>, n: usize, t0: Instant) -> anyhow::Result<Vec<Duration>> {
    let mut acked = vec![None::<Duration>; n];
    let mut got = 0;
    while got < n {
        match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await {
            Ok(Some(Event::Acked(i, at))) if acked[i].is_none() => {
                acked[i] = Some(at.duration_since(t0));
                got += 1;
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => anyhow::bail!("only {got} of {n} agents acknowledged within 120 s"),
        }
    }
    let mut all: Vec<Duration> = acked.into_iter().map(Option::unwrap).collect();
    all.sort();
    Ok(all)
}

/// Enrolls `args.single_changes` nodes one by one; how long each took to
/// reach the gateway (enrolled as `gateway`: its certificate and key),
/// which watches as an agent would.
async fn changes_for_one(bench: &Bench, (gcert, gkey): (String, String), args: &Args) -> anyhow::Result<Vec<Duration>> {
    let ctx = bench.ctx.clone();
    let n = args.agents;
    let (gtx, mut grx) = mpsc::unbounded_channel::<Event>();
    let gctx = ctx.clone();
    tokio::spawn(async move {
        let ch = gctx.channel(Some((&gcert, &gkey))).await.expect("gateway connect");
        let mut c = AgentServiceClient::new(ch);
        let mut s = c
            .watch(pb::WatchRequest {
                last_revision: 0,
                known: vec![],
                ..Default::default()
            })
            .await
            .expect("watch")
            .into_inner();
        while let Ok(Some(m)) = s.message().await {
            let ids = match m.kind {
                Some(pb::watch_response::Kind::Delta(d)) => d.upserts.into_iter().map(|o| o.id).collect(),
                _ => vec![],
            };
            let _ = gtx.send(Event::GatewaySaw(ids, Instant::now()));
        }
    });
    let _ = tokio::time::timeout(Duration::from_secs(60), grx.recv()).await; // its snapshot
    tokio::time::sleep(*args.settle).await;
    let one_token = bench.token(pb::AgentRole::Node, args.single_changes as u32).await?;
    let mut single = Vec::new();
    for k in 0..args.single_changes {
        let name = format!("x{k}");
        let t = Instant::now();
        ctx.register(&one_token, &name, &underlay(n + k)).await?;
        let want = format!("node/{name}/link");
        loop {
            match tokio::time::timeout(Duration::from_secs(30), grx.recv()).await {
                Ok(Some(Event::GatewaySaw(ids, at))) if ids.contains(&want) => {
                    single.push(at.duration_since(t));
                    break;
                }
                Ok(Some(_)) => {}
                _ => anyhow::bail!("the gateway never saw {name}"),
            }
        }
    }
    Ok(single)
}

/// Stops the controller for `pause`, starts it again; how long until all
/// `n` agents resumed, and how many of them needed a snapshot.
async fn resumed(
    bench: &mut Bench,
    rx: &mut mpsc::UnboundedReceiver<Event>,
    n: usize,
    pause: Duration,
) -> anyhow::Result<(Duration, usize)> {
    let c = &mut bench.controller;
    assert!(c.stop().success(), "the controller did not stop cleanly");
    tokio::time::sleep(pause).await;
    let t_back = Instant::now();
    c.restart_stopped();
    let (mut resumed, mut snapshots) = (0usize, 0usize);
    while resumed < n {
        match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await {
            Ok(Some(Event::Resumed { snapshot })) => {
                resumed += 1;
                snapshots += usize::from(snapshot);
            }
            Ok(Some(_)) => {}
            _ => anyhow::bail!("only {resumed} of {n} agents resumed within 120 s"),
        }
    }
    Ok((t_back.elapsed(), snapshots))
}
