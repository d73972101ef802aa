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
//!
//! `--replicas N` (etcd only) runs N controller replicas of one site on
//! one etcd instead, with the agents in worker processes: see [`replicas`].

mod replicas;

use std::time::{Duration, Instant};

use clap::Parser;
use tokio::sync::mpsc;
use weft_proto::v1 as pb;
use weft_proto::v1::agent_service_client::AgentServiceClient;
use weft_tests::sim::{Bench, Event, ms, pct, proc_stats, underlay};

#[derive(Parser, Debug)]
pub(crate) struct Args {
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
    /// Controller replicas of the site on one etcd (with --store etcd);
    /// the agents then run in worker processes.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// With --replicas: simulated agents per worker process (each holds a
    /// descriptor per agent).
    #[arg(long, default_value_t = 16_000)]
    per_worker: usize,
    /// With --replicas: how long a simulated agent away from its first
    /// choice waits before asking it again (the agents' --failback-after).
    #[arg(long, default_value = "15s")]
    failback_after: humantime::Duration,
    /// With --replicas: how long the killed replica stays down.
    #[arg(long, default_value = "20s")]
    dead_for: humantime::Duration,
    /// Internal: run as a worker process of a --replicas run.
    #[arg(long, hide = true)]
    worker: bool,
    /// Internal (worker): the replicas' ports.
    #[arg(long, hide = true, value_delimiter = ',')]
    ports: Vec<u16>,
    /// Internal (worker): the site CA (PEM).
    #[arg(long, hide = true)]
    ca_file: Option<std::path::PathBuf>,
    /// Internal (worker): enrollment tokens, 10,000 agents each.
    #[arg(long, hide = true, value_delimiter = ',')]
    tokens: Vec<String>,
    /// Internal (worker): the index of its first agent.
    #[arg(long, hide = true, default_value_t = 0)]
    first: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _ = rustls::crypto::ring::default_provider().install_default();
    if args.worker {
        return replicas::worker(&args).await;
    }
    if args.replicas > 1 {
        return replicas::run(&args).await;
    }
    // Each agent holds a descriptor here and one in the controller (which
    // inherits the limit).
    let nofile = raise_nofile(args.agents as u64 + 1024)?;
    let mut bench = Bench::start(&args.store, args.parallel).await?;
    let pid = bench.controller.pid();
    let ctx = bench.ctx.clone();
    let n = args.agents;
    let started = proc_stats(pid);
    let cpu0 = started.cpu_secs;
    phase("enroll");

    // Enroll N node agents.
    let t_enroll = Instant::now();
    let ids = bench.enroll(n).await?;
    let enroll_time = t_enroll.elapsed();

    // Connect all N streams.
    phase("connect");
    let enrolled = proc_stats(pid);
    let t_connect = Instant::now();
    let (_tx, mut rx) = bench.connect(ids).await?;
    let connect_time = t_connect.elapsed();
    let connected = proc_stats(pid);
    let beats = || weft_tests::sim::HEARTBEATS.load(std::sync::atomic::Ordering::Relaxed);
    let beats0 = beats();
    let t_beats = Instant::now();
    // Steady state with heartbeats: what it costs the controller.
    phase("hold");
    tokio::time::sleep(*args.hold).await;
    let held = proc_stats(pid);
    let hold_cpu = held.cpu_secs - connected.cpu_secs;
    let hold_beats = beats() - beats0;

    // A change that concerns all N: the first gateway appears.
    let gw_token = bench.token(pb::AgentRole::Gateway, 2).await?;
    phase("change-for-all");
    let t0 = Instant::now();
    let gateway = ctx.register(&gw_token, "gw", "10.255.0.1").await?;
    let all = acked_by_all(&mut rx, n, t0).await?;
    let changed = proc_stats(pid);
    // The controller's CPU per delivered delta (render, encode, send, and
    // the agent's acknowledging Report), heartbeats of the window excluded
    // at the hold's rate.
    let change_window = t0.elapsed().as_secs_f64();
    let beat_cpu = if hold_beats > 0 {
        hold_cpu / hold_beats as f64
    } else {
        0.0
    };
    let change_cpu =
        (changed.cpu_secs - held.cpu_secs) - beat_cpu * (hold_beats as f64 / args.hold.as_secs_f64()) * change_window;
    phase("change-for-one");

    // Changes that concern one agent: new nodes, as seen by the gateway.
    let one_token = bench.token(pb::AgentRole::Node, args.single_changes as u32).await?;
    let mut single = changes_for_one(bench.ctx.clone(), &one_token, gateway, &args).await?;
    single.sort();

    // A change that every node receives alike: a new peering's routes
    // and rules (the shared part of node state, rendered and encoded
    // once). The peer is a second controller on loopback with the same
    // external CIDR, so that view is remapped.
    let peer = Bench::start_site("peer", "192.168.0.0/16", "embedded", 4, &[]).await?;
    let token = peer
        .admin
        .clone()
        .create_peering_token(pb::CreatePeeringTokenRequest {
            ttl_seconds: 600,
            ..Default::default()
        })
        .await?
        .into_inner()
        .token;
    while rx.try_recv().is_ok() {}
    let before_peering = proc_stats(pid);
    phase("peering-for-all");
    let t0 = Instant::now();
    bench
        .admin
        .clone()
        .create_peering(pb::CreatePeeringRequest { token, transit: false })
        .await?;
    let peered = acked_by_all(&mut rx, n, t0).await?;
    let peering_cpu = proc_stats(pid).cpu_secs
        - before_peering.cpu_secs
        - beat_cpu * (hold_beats as f64 / args.hold.as_secs_f64()) * t0.elapsed().as_secs_f64();
    drop(peer);
    let after = proc_stats(pid);
    let beat_rate = (beats() - beats0) as f64 / t_beats.elapsed().as_secs_f64();

    // Resume after a controller restart: stopped for a while, then back.
    phase("resume");
    let (resume_time, snapshots) = resumed(&mut bench, &mut rx, n, *args.restart_pause).await?;
    phase("done");

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
    println!("  change for all, until every ack:       {}", percentiles(&all));
    println!(
        "  a new peering, for all, until every ack: p50 {}  p99 {}  max {}; controller CPU {:.2} s, {:.0} µs per \
         delivered delta",
        ms(pct(&peered, 0.5)),
        ms(pct(&peered, 0.99)),
        ms(*peered.last().unwrap()),
        peering_cpu,
        peering_cpu * 1e6 / n as f64
    );
    println!(
        "  change for one ({} samples):           {}",
        single.len(),
        percentiles(&single)
    );
    println!(
        "  resume after a {} stop:  all {n} back in {:.1} s, {snapshots} snapshots",
        args.restart_pause,
        resume_time.as_secs_f64()
    );
    println!(
        "  heartbeats (default agent TTL):        {beat_rate:.0}/s while connected; over the {} hold \
         the controller used {:.1} % of a core, {:.0} µs of CPU per heartbeat",
        args.hold,
        100.0 * hold_cpu / args.hold.as_secs_f64(),
        beat_cpu * 1e6
    );
    println!(
        "  change for all, controller CPU:        {:.2} s, {:.0} µs per delivered delta",
        change_cpu,
        change_cpu * 1e6 / n as f64
    );
    println!(
        "  controller CPU time:                   {:.1} s",
        after.cpu_secs - cpu0
    );
    println!(
        "  controller RSS: {:.0} MiB at start, {:.0} MiB enrolled, {:.0} MiB with all connected, {:.0} MiB after \
         the hold, {:.0} MiB after the changes, peak {:.0} MiB",
        started.rss, enrolled.rss, connected.rss, held.rss, after.rss, after.peak
    );
    println!(
        "  memory per connected agent (RSS connected - enrolled) / N: {:.1} KiB; per enrolled agent \
         (enrolled - start) / N: {:.1} KiB; descriptor limit {nofile}",
        (connected.rss - enrolled.rss) * 1024.0 / n as f64,
        (enrolled.rss - started.rss) * 1024.0 / n as f64
    );
    Ok(())
}

/// "p50 …  p99 …  max …" of sorted latencies.
pub(crate) fn percentiles(sorted: &[Duration]) -> String {
    format!(
        "p50 {}  p99 {}  max {}",
        ms(pct(sorted, 0.5)),
        ms(pct(sorted, 0.99)),
        ms(sorted.last().copied().unwrap_or_default())
    )
}

/// Marks the start of a phase on stderr with the monotonic clock (perf's
/// `-k mono` clock), so a profile of the controller can be cut by phase.
pub(crate) fn phase(name: &str) {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map_or(0.0, |t| t.tv_sec() as f64 + t.tv_nsec() as f64 / 1e9);
    eprintln!("weft-fanout: phase {name} at {t:.3} (CLOCK_MONOTONIC)");
}

/// Raises this process's descriptor limit to at least `want` (the hard
/// limit too, which needs root when it is lower), else to the hard limit;
/// the limit now.
pub(crate) fn raise_nofile(want: u64) -> anyhow::Result<u64> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if hard >= want || setrlimit(Resource::RLIMIT_NOFILE, want, want).is_err() {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    let (now, _) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if now < want {
        anyhow::bail!(
            "this run needs about {want} descriptors per process and the limit is {now}: raise the hard limit \
             (ulimit -Hn {want} as root) or run as root"
        );
    }
    Ok(now)
}

/// How long after `t0` each of the `n` agents acknowledged a change.
pub(crate) async fn acked_by_all(
    rx: &mut mpsc::UnboundedReceiver<Event>,
    n: usize,
    t0: Instant,
) -> anyhow::Result<Vec<Duration>> {
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
pub(crate) async fn changes_for_one(
    ctx: std::sync::Arc<weft_tests::sim::Ctx>,
    one_token: &str,
    (gcert, gkey): (String, String),
    args: &Args,
) -> anyhow::Result<Vec<Duration>> {
    let n = args.agents;
    let (gtx, mut grx) = mpsc::unbounded_channel::<Event>();
    let gctx = ctx.clone();
    tokio::spawn(async move {
        let ch = gctx.channel(Some((&gcert, &gkey))).await.expect("gateway connect");
        let mut c = AgentServiceClient::new(ch).max_decoding_message_size(weft_proto::MAX_DESIRED_MESSAGE);
        let mut s = c
            .watch(pb::WatchRequest {
                last_revision: 0,
                known: vec![],
                ..Default::default()
            })
            .await
            .expect("watch")
            .into_inner();
        loop {
            let m = match s.message().await {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => {
                    eprintln!("weft-fanout: the gateway's watch ended: {e}");
                    break;
                }
            };
            let ids = match m.kind {
                Some(pb::watch_response::Kind::Delta(d)) => d.upserts.into_iter().map(|o| o.id).collect(),
                _ => vec![],
            };
            let _ = gtx.send(Event::GatewaySaw(ids, Instant::now()));
        }
    });
    let _ = tokio::time::timeout(Duration::from_secs(60), grx.recv()).await; // its snapshot
    tokio::time::sleep(*args.settle).await;
    let mut single = Vec::new();
    for k in 0..args.single_changes {
        let name = format!("x{k}");
        let t = Instant::now();
        ctx.register(one_token, &name, &underlay(n + k)).await?;
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
            Ok(Some(Event::Resumed { snapshot, .. })) => {
                resumed += 1;
                snapshots += usize::from(snapshot);
            }
            Ok(Some(_)) => {}
            _ => anyhow::bail!("only {resumed} of {n} agents resumed within 120 s"),
        }
    }
    Ok((t_back.elapsed(), snapshots))
}
