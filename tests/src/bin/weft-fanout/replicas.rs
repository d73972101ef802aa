//! `weft-fanout --replicas N --store etcd`: N controller replicas of one
//! site on one real etcd, and the simulated agents in worker processes
//! (each under this machine's per-process descriptor limit), each agent
//! ordering the replicas as a real agent given the site's controller
//! addresses does. Measures what the one-controller run does (enroll,
//! connect, heartbeats, a change for all, a change for one), per replica
//! and for etcd; then kills one replica (SIGKILL) and measures how its
//! agents move to the others and what that costs etcd; then starts it
//! again and measures how its share comes back.
//!
//! Each simulated agent connects from a loopback address of its own, as
//! real agents connect from their own hosts, so that a replica's limits
//! per address apply per agent.
//!
//! A worker speaks lines on stdout (`enrolled S`, `connected S`,
//! `on I PORT`, `acked I NS`, `resumed I SNAPSHOT`, `stats BEATS`) and
//! takes `connect` (once every worker enrolled) and `stats` on stdin;
//! times are Unix nanoseconds, so the parent and its workers share one
//! clock.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use tokio::sync::mpsc;
use weft_proto::v1 as pb;
use weft_tests::sim::{Ctx, Event, Placement, ProcStats, proc_stats, roaming_agent, underlay};
use weft_tests::{Controller, ControllerSpec, Etcd};

use super::{Args, changes_for_one, percentiles, phase, raise_nofile};

/// A token enrolls at most 10,000 agents.
const PER_TOKEN: usize = 10_000;

fn unix_ns(at: Instant) -> u128 {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    (now - at.elapsed()).as_nanos()
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos()
}

/// A worker process: enrolls its agents (at the first replica), connects
/// them (each to its first choice), then reports their events until stdin
/// closes.
pub(crate) async fn worker(args: &Args) -> anyhow::Result<()> {
    let n = args.agents;
    raise_nofile(n as u64 + 1024)?;
    let ca_pem = std::fs::read_to_string(args.ca_file.as_ref().context("--ca-file")?)?;
    let ctx = Arc::new(Ctx {
        port: args.ports[0],
        ca_pem,
    });
    let sem = Arc::new(tokio::sync::Semaphore::new(args.parallel));
    let t = Instant::now();
    let mut handles = Vec::with_capacity(n);
    for k in 0..n {
        let i = args.first + k;
        let name = format!("n{i}");
        let place = Placement::of(&name, &args.ports, *args.failback_after).from_own_address(i);
        let token = args.tokens[k / PER_TOKEN].clone();
        let (ctx, sem) = (ctx.clone(), sem.clone());
        handles.push(tokio::spawn(async move {
            let _p = sem.acquire().await.unwrap();
            // All at one replica: enrollments at several at once conflict
            // on the site's address-pool guard and retry, which at this
            // scale is most of their time (see docs/benchmarks.md).
            let id = ctx.register_at(ctx.port, &token, &name, &underlay(i)).await?;
            anyhow::Ok((id, place))
        }));
    }
    let mut ids = Vec::with_capacity(n);
    for h in handles {
        ids.push(h.await??);
    }
    println!("enrolled {:.3}", t.elapsed().as_secs_f64());
    let (cmd_tx, mut cmds) = mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if cmd_tx.send(line).is_err() {
                break;
            }
        }
    });
    // All workers connect at once, when the parent says.
    while cmds.recv().await.as_deref().is_some_and(|c| c != "connect") {}
    let t = Instant::now();
    let (tx, mut rx) = mpsc::unbounded_channel::<Event>();
    for (k, ((cert, key), place)) in ids.into_iter().enumerate() {
        tokio::spawn(roaming_agent(
            args.first + k,
            ctx.clone(),
            place,
            cert,
            key,
            tx.clone(),
            sem.clone(),
        ));
    }
    let out = std::io::stdout();
    let mut connected = 0;
    while connected < n {
        match tokio::time::timeout(Duration::from_secs(300), rx.recv()).await {
            Ok(Some(Event::Connected)) => connected += 1,
            Ok(Some(Event::On(i, port))) => writeln!(out.lock(), "on {i} {port}")?,
            Ok(Some(_)) => {}
            _ => anyhow::bail!("only {connected} of {n} agents connected within 300 s"),
        }
    }
    println!("connected {:.3}", t.elapsed().as_secs_f64());
    loop {
        tokio::select! {
            ev = rx.recv() => {
                let mut o = out.lock();
                match ev {
                    Some(Event::On(i, port)) => writeln!(o, "on {i} {port}")?,
                    Some(Event::Acked(i, at)) => writeln!(o, "acked {i} {}", unix_ns(at))?,
                    Some(Event::Resumed { agent, snapshot }) => writeln!(o, "resumed {agent} {}", u8::from(snapshot))?,
                    Some(_) => {}
                    None => break,
                }
            }
            c = cmds.recv() => match c.as_deref() {
                Some("stats") => println!(
                    "stats {}",
                    weft_tests::sim::HEARTBEATS.load(std::sync::atomic::Ordering::Relaxed)
                ),
                Some(_) => {}
                None => break,
            },
        }
    }
    Ok(())
}

/// A line from a worker, parsed.
enum Line {
    Enrolled(f64),
    Connected,
    On(usize, u16),
    Acked(usize, u128),
    /// Agent index, whether its resume was a snapshot.
    Resumed(usize, bool),
    Stats(u64),
}

fn parse(line: &str) -> Option<Line> {
    let mut f = line.split_whitespace();
    let (kind, a, b) = (f.next()?, f.next()?, f.next());
    Some(match kind {
        "enrolled" => Line::Enrolled(a.parse().ok()?),
        "connected" => Line::Connected,
        "on" => Line::On(a.parse().ok()?, b?.parse().ok()?),
        "acked" => Line::Acked(a.parse().ok()?, b?.parse().ok()?),
        "resumed" => Line::Resumed(a.parse().ok()?, b? == "1"),
        "stats" => Line::Stats(a.parse().ok()?),
        _ => return None,
    })
}

struct Workers {
    children: Vec<Child>,
    stdins: Vec<std::process::ChildStdin>,
    lines: mpsc::UnboundedReceiver<Line>,
}

impl Workers {
    /// Asks every worker for its heartbeat count; their sum.
    async fn beats(&mut self, pending: &mut Vec<Line>) -> anyhow::Result<u64> {
        for s in &mut self.stdins {
            writeln!(s, "stats")?;
        }
        let (mut got, mut sum) = (0, 0);
        while got < self.stdins.len() {
            match tokio::time::timeout(Duration::from_secs(30), self.lines.recv()).await {
                Ok(Some(Line::Stats(b))) => {
                    got += 1;
                    sum += b;
                }
                Ok(Some(other)) => pending.push(other),
                _ => anyhow::bail!("a worker did not answer"),
            }
        }
        Ok(sum)
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.stdins.clear();
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// etcd's counters at a moment.
#[derive(Clone, Copy, Default)]
struct EtcdLoad {
    at: Option<Instant>,
    /// Raft proposals committed: every write (a transaction, a lease
    /// grant or revocation) is one.
    proposals: f64,
    puts: f64,
    deletes: f64,
    /// Events sent to watchers.
    events: f64,
    db_bytes: f64,
    rss_bytes: f64,
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn etcd_load(etcd: &Etcd) -> EtcdLoad {
    let t = etcd.metrics().unwrap_or_default();
    EtcdLoad {
        at: Some(Instant::now()),
        proposals: metric(&t, "etcd_server_proposals_committed_total"),
        puts: metric(&t, "etcd_mvcc_put_total"),
        deletes: metric(&t, "etcd_mvcc_delete_total"),
        events: metric(&t, "etcd_debugging_mvcc_events_total"),
        db_bytes: metric(&t, "etcd_mvcc_db_total_size_in_bytes"),
        rss_bytes: metric(&t, "process_resident_memory_bytes"),
    }
}

/// Rates per second between two samples: proposals, keys written (puts and
/// deletes), watch events.
fn rates(a: &EtcdLoad, b: &EtcdLoad) -> (f64, f64, f64) {
    let secs = b.at.unwrap().duration_since(a.at.unwrap()).as_secs_f64().max(1e-3);
    (
        (b.proposals - a.proposals) / secs,
        (b.puts + b.deletes - a.puts - a.deletes) / secs,
        (b.events - a.events) / secs,
    )
}

fn replica_line(i: usize, c: &Controller, agents: usize, s: &ProcStats) -> String {
    let fds = std::fs::read_dir(format!("/proc/{}/fd", c.pid())).map_or(0, |d| d.count());
    format!(
        "    replica {i}: {agents} agents, {fds} descriptors, RSS {:.0} MiB, CPU {:.1} s",
        s.rss, s.cpu_secs
    )
}

/// Agents per replica port, from the `on` lines seen.
fn per_replica(on: &HashMap<usize, u16>, ports: &[u16]) -> Vec<usize> {
    ports.iter().map(|p| on.values().filter(|q| *q == p).count()).collect()
}

pub(crate) async fn run(args: &Args) -> anyhow::Result<()> {
    anyhow::ensure!(args.store == "etcd", "--replicas runs on etcd: add --store etcd");
    let n = args.agents;
    let etcd = Etcd::start().context("etcd is not installed")?;
    let dir = tempfile::Builder::new().prefix("weft-bench").tempdir()?;
    let ep = etcd.endpoint();
    let flags = [
        "--pod-cidr",
        "10.0.0.0/8",
        "--internal-cidr",
        "100.64.0.0/10",
        "--external-cidr",
        "172.16.0.0/16",
        "--etcd-endpoints",
        ep.as_str(),
    ];
    // Each replica holds a descriptor per agent on it: allow for an uneven
    // share (the limit is inherited).
    // (at most the hard limit: what does not fit is part of the figures).
    let (_, hard) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)?;
    raise_nofile((((n / args.replicas) * 3 / 2 + 2048).min(n + 1024) as u64).min(hard))?;
    let mut replicas: Vec<Controller> = Vec::new();
    for r in 0..args.replicas {
        let data = dir.path().join(format!("r{r}"));
        if r > 0 {
            // The replicas share the site CA: copied, as an operator would.
            std::fs::create_dir_all(data.join("pki"))?;
            for f in ["ca.pem", "ca.key"] {
                std::fs::copy(replicas[0].pki(f), data.join("pki").join(f))?;
            }
        }
        replicas.push(ControllerSpec::new("bench").data_dir(&data).flags(&flags).start());
    }
    let ports: Vec<u16> = replicas.iter().map(|c| c.listen_port).collect();
    let ca_file = replicas[0].pki("ca.pem");
    let ctx = Arc::new(Ctx {
        port: ports[0],
        ca_pem: std::fs::read_to_string(&ca_file)?,
    });
    let admin_id = (replicas[0].pki_pem("admin.pem"), replicas[0].pki_pem("admin.key"));
    let mut admin =
        pb::admin_service_client::AdminServiceClient::new(ctx.channel(Some((&admin_id.0, &admin_id.1))).await?);
    let mut token = async |role: pb::AgentRole, uses: usize| -> anyhow::Result<String> {
        Ok(admin
            .create_token(pb::CreateTokenRequest {
                role: role as i32,
                name: String::new(),
                ttl_seconds: 86_400,
                uses: uses as u32,
            })
            .await?
            .into_inner()
            .token)
    };
    let started: Vec<ProcStats> = replicas.iter().map(|c| proc_stats(c.pid())).collect();

    // Workers, each with its share of the agents.
    phase("enroll");
    let per = args.per_worker.max(1);
    let (line_tx, lines) = mpsc::unbounded_channel::<Line>();
    let mut workers = Workers {
        children: Vec::new(),
        stdins: Vec::new(),
        lines,
    };
    let ports_arg = ports.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
    for first in (0..n).step_by(per) {
        let count = (n - first).min(per);
        let mut tokens = Vec::new();
        for k in (0..count).step_by(PER_TOKEN) {
            tokens.push(token(pb::AgentRole::Node, (count - k).min(PER_TOKEN)).await?);
        }
        let mut child = Command::new(std::env::current_exe()?)
            .args([
                "--worker",
                "--agents",
                &count.to_string(),
                "--first",
                &first.to_string(),
            ])
            .args(["--ports", &ports_arg, "--tokens", &tokens.join(",")])
            .arg("--ca-file")
            .arg(&ca_file)
            .args(["--parallel", &(args.parallel / n.div_ceil(per)).max(8).to_string()])
            .args(["--failback-after", &args.failback_after.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        workers.stdins.push(child.stdin.take().unwrap());
        let out = child.stdout.take().unwrap();
        let tx = line_tx.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if let Some(l) = parse(&line) {
                    let _ = tx.send(l);
                }
            }
        });
        workers.children.push(child);
    }
    let w = workers.children.len();
    let mut on: HashMap<usize, u16> = HashMap::new();
    let (mut enrolled, mut connected, mut enroll_time, mut connect_time) = (0, 0, 0.0f64, 0.0f64);
    let t_start = Instant::now();
    let mut t_connect = Instant::now();
    let mut pending = Vec::new();
    while connected < w {
        match tokio::time::timeout(Duration::from_secs(1800), workers.lines.recv()).await {
            Ok(Some(Line::Enrolled(s))) => {
                enrolled += 1;
                enroll_time = enroll_time.max(s);
                if enrolled == w {
                    phase("connect");
                    t_connect = Instant::now();
                    for s in &mut workers.stdins {
                        writeln!(s, "connect")?;
                    }
                }
            }
            Ok(Some(Line::Connected)) => {
                connected += 1;
                connect_time = t_connect.elapsed().as_secs_f64();
            }
            Ok(Some(Line::On(i, p))) => drop(on.insert(i, p)),
            Ok(Some(_)) => {}
            _ => anyhow::bail!(
                "the workers did not connect their agents: nothing heard for 1800 s ({:.0} s in)",
                t_start.elapsed().as_secs_f64()
            ),
        }
    }
    let connected_stats: Vec<ProcStats> = replicas.iter().map(|c| proc_stats(c.pid())).collect();
    let spread_connected = per_replica(&on, &ports);
    let connected_lines: Vec<String> = replicas
        .iter()
        .enumerate()
        .map(|(i, c)| replica_line(i, c, spread_connected[i], &connected_stats[i]))
        .collect();

    // Steady state: heartbeats at the default TTL.
    phase("hold");
    let beats0 = workers.beats(&mut pending).await?;
    let load0 = etcd_load(&etcd);
    let cpu0: Vec<f64> = replicas.iter().map(|c| proc_stats(c.pid()).cpu_secs).collect();
    tokio::time::sleep(*args.hold).await;
    let cpu1: Vec<f64> = replicas.iter().map(|c| proc_stats(c.pid()).cpu_secs).collect();
    let load1 = etcd_load(&etcd);
    let beats = workers.beats(&mut pending).await? - beats0;
    let held: Vec<ProcStats> = replicas.iter().map(|c| proc_stats(c.pid())).collect();
    let hold_cpu: f64 = cpu1.iter().zip(&cpu0).map(|(a, b)| a - b).sum();
    let steady = rates(&load0, &load1);
    for l in pending.drain(..) {
        if let Line::On(i, p) = l {
            on.insert(i, p);
        }
    }

    // A change for all: the first gateway enrolls.
    phase("change-for-all");
    let gw_token = token(pb::AgentRole::Gateway, 2).await?;
    let t0 = now_ns();
    let gateway = ctx.register(&gw_token, "gw", "10.255.0.1").await?;
    let all = acked_by_all_lines(&mut workers, &mut on, n, t0).await?;

    // Changes for one: new nodes, as the gateway (on replica 0) sees them.
    phase("change-for-one");
    let one_token = token(pb::AgentRole::Node, args.single_changes).await?;
    let mut single = changes_for_one(ctx.clone(), &one_token, gateway, args).await?;
    single.sort();

    // A replica dies with its agents: the one of 1..N holding the most.
    let before = per_replica(&on, &ports);
    let x = (1..ports.len()).max_by_key(|&r| before[r]).unwrap();
    let dead = ports[x];
    let moving: Vec<usize> = on.iter().filter(|(_, p)| **p == dead).map(|(i, _)| *i).collect();
    phase("kill");
    let load_k = etcd_load(&etcd);
    let t_kill = Instant::now();
    replicas[x].kill();
    // Moved: its first message came from another replica (`on`), and its
    // resume said whether that was a snapshot.
    let (mut moved, mut resumed, mut snapshots) = (0usize, 0usize, 0usize);
    let mut waiting: std::collections::HashSet<usize> = moving.iter().copied().collect();
    let moving_set = waiting.clone();
    // When each of them had its first message from another replica.
    let mut move_times: Vec<Duration> = Vec::with_capacity(moving.len());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while !waiting.is_empty() || resumed < moving.len() {
        match tokio::time::timeout_at(deadline, workers.lines.recv()).await {
            Ok(Some(Line::On(i, p))) => {
                on.insert(i, p);
                if p != dead && waiting.remove(&i) {
                    moved += 1;
                    move_times.push(t_kill.elapsed());
                }
            }
            Ok(Some(Line::Resumed(i, snap))) if moving_set.contains(&i) => {
                resumed += 1;
                snapshots += usize::from(snap);
            }
            Ok(Some(_)) => {}
            // Some could not move (the survivors' descriptor limits, say):
            // said below.
            _ => break,
        }
    }
    move_times.sort();
    let load_m = etcd_load(&etcd);
    // Until the dead replica's leases have ended (a TTL) and after: at
    // least 20 s after the kill, longer when the move took longer.
    tokio::time::sleep(Duration::from_secs(20).saturating_sub(t_kill.elapsed())).await;
    let load_w = etcd_load(&etcd);
    let window = t_kill.elapsed();
    let during_move = rates(&load_k, &load_m);
    let over_window = rates(&load_k, &load_w);
    // Agents that never moved are not on any replica: not counted.
    on.retain(|_, p| *p != dead);
    let after_kill = per_replica(&on, &ports);
    tokio::time::sleep(args.dead_for.saturating_sub(t_kill.elapsed())).await;
    // Over its whole absence: the survivors move what they adopted to
    // their own leases meanwhile, a batch a second each.
    let while_dead = rates(&load_k, &etcd_load(&etcd));

    // It returns: its share comes back as agents ask their first choice.
    phase("return");
    let dead_for = t_kill.elapsed();
    let t_back = Instant::now();
    replicas[x].restart_stopped();
    let load_r = etcd_load(&etcd);
    let target = before[x] * 9 / 10;
    let mut back_time = None;
    while t_back.elapsed() < Duration::from_secs(180) {
        match tokio::time::timeout(Duration::from_secs(1), workers.lines.recv()).await {
            Ok(Some(Line::On(i, p))) => drop(on.insert(i, p)),
            Ok(Some(_)) | Err(_) => {}
            Ok(None) => break,
        }
        if per_replica(&on, &ports)[x] >= target {
            back_time = Some(t_back.elapsed());
            break;
        }
    }
    let load_b = etcd_load(&etcd);
    let returning = rates(&load_r, &load_b);
    let after_return = per_replica(&on, &ports);
    let end: Vec<ProcStats> = replicas.iter().map(|c| proc_stats(c.pid())).collect();
    phase("done");

    let pr = |name: &str, v: &[usize]| format!("{name} {v:?}");
    println!(
        "weft-fanout: {n} agents, {} replicas on one etcd, {w} worker processes",
        replicas.len()
    );
    println!("  enroll all (register, all at replica 0):            {enroll_time:.1} s");
    println!("  connect all (TLS + Watch + first ack):               {connect_time:.1} s");
    println!("  {}", pr("agents per replica, connected:", &spread_connected));
    println!("  with all connected:");
    for l in &connected_lines {
        println!("{l}");
    }
    let rss: f64 = connected_stats.iter().map(|s| s.rss).sum();
    let base: f64 = started.iter().map(|s| s.rss).sum();
    println!(
        "    together: RSS {rss:.0} MiB; per connected agent (RSS now - at start) / N: {:.1} KiB",
        (rss - base) * 1024.0 / n as f64
    );
    let held_rss: f64 = held.iter().map(|s| s.rss).sum();
    println!(
        "  heartbeats: {:.0}/s over the {} hold; the replicas used {:.1} % of a core together, {:.0} µs of CPU per \
         heartbeat; RSS after the hold {held_rss:.0} MiB",
        beats as f64 / args.hold.as_secs_f64(),
        args.hold,
        100.0 * hold_cpu / args.hold.as_secs_f64(),
        hold_cpu * 1e6 / beats.max(1) as f64
    );
    println!(
        "  etcd, steady: {:.1} proposals/s, {:.1} keys written/s, {:.1} watch events/s; RSS {:.0} MiB, database \
         {:.1} MiB",
        steady.0,
        steady.1,
        steady.2,
        load1.rss_bytes / 1048576.0,
        load1.db_bytes / 1048576.0
    );
    println!("  change for all, until every ack:       {}", percentiles(&all));
    println!(
        "  change for one ({} samples):           {}",
        single.len(),
        percentiles(&single)
    );
    let all_or_some = if moved == moving.len() {
        "all".to_string()
    } else {
        format!("only {moved} within 120 s")
    };
    println!(
        "  replica {x} killed (SIGKILL) with {} agents: {all_or_some} on the others, {snapshots} snapshots \
         ({resumed} resumes); each on another replica after: {}; {}",
        moving.len(),
        percentiles(&move_times),
        pr("agents per replica after", &after_kill)
    );
    println!(
        "  etcd during the move: {:.1} proposals/s, {:.1} keys written/s, {:.1} watch events/s; over the {:.1} s \
         after the kill (its leases ending included): {:.1} proposals/s, {:.1} keys written/s, {:.1} watch \
         events/s",
        during_move.0,
        during_move.1,
        during_move.2,
        window.as_secs_f64(),
        over_window.0,
        over_window.1,
        over_window.2
    );
    println!(
        "  etcd over the {:.1} s it was dead: {:.1} proposals/s, {:.1} keys written/s, {:.1} watch events/s",
        dead_for.as_secs_f64(),
        while_dead.0,
        while_dead.1,
        while_dead.2
    );
    match back_time {
        Some(t) => println!(
            "  replica {x} back {:.1} s after the kill: 90 % of its share back in {:.1} s; {}",
            dead_for.as_secs_f64(),
            t.as_secs_f64(),
            pr("agents per replica", &after_return)
        ),
        None => println!(
            "  replica {x} back {:.1} s after the kill: its share did NOT come back within 180 s; {}",
            dead_for.as_secs_f64(),
            pr("agents per replica", &after_return)
        ),
    }
    println!(
        "  etcd while it came back: {:.1} proposals/s, {:.1} keys written/s, {:.1} watch events/s",
        returning.0, returning.1, returning.2
    );
    // What the survivors said of the nodes that came from the dead
    // replica: adopted (moved to their leases a batch a second) or not.
    let adopted: u64 = replicas
        .iter()
        .flat_map(|c| {
            c.log_text()
                .lines()
                .filter(|l| l.contains("adopted the liveness records"))
                .filter_map(|l| l.split("nodes=").nth(1)?.split_whitespace().next()?.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum();
    println!(
        "  node records the replicas adopted from a dead replica (the rest of its {} written at once): {adopted}",
        moving.len()
    );
    let peak: f64 = end.iter().map(|s| s.peak).sum();
    println!(
        "  replicas' peak RSS together (VmHWM): {peak:.0} MiB; etcd RSS {:.0} MiB",
        load_b.rss_bytes / 1048576.0
    );
    drop(workers);
    Ok(())
}

/// How long after `t0` (Unix ns) each of the `n` agents acknowledged.
async fn acked_by_all_lines(
    workers: &mut Workers,
    on: &mut HashMap<usize, u16>,
    n: usize,
    t0: u128,
) -> anyhow::Result<Vec<Duration>> {
    let mut acked: HashMap<usize, Duration> = HashMap::with_capacity(n);
    while acked.len() < n {
        match tokio::time::timeout(Duration::from_secs(120), workers.lines.recv()).await {
            Ok(Some(Line::Acked(i, at))) => {
                acked
                    .entry(i)
                    .or_insert(Duration::from_nanos(at.saturating_sub(t0) as u64));
            }
            Ok(Some(Line::On(i, p))) => drop(on.insert(i, p)),
            Ok(Some(_)) => {}
            _ => anyhow::bail!("only {} of {n} agents acknowledged within 120 s", acked.len()),
        }
    }
    let mut all: Vec<Duration> = acked.into_values().collect();
    all.sort();
    Ok(all)
}
