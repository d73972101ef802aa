//! Simulated agents for the load benchmarks and tests (`weft-fanout`,
//! `weft-churn`): each its own key, certificate, TLS connection and Watch
//! stream, acknowledging every message with a Report, resuming after a
//! broken stream, and stopping when the controller refuses it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::sync::mpsc;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use weft_proto::v1 as pb;
use weft_proto::v1::agent_service_client::AgentServiceClient;

pub struct Ctx {
    pub port: u16,
    pub ca_pem: String,
}

impl Ctx {
    pub async fn channel(&self, id: Option<(&str, &str)>) -> anyhow::Result<Channel> {
        let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&self.ca_pem));
        if let Some((c, k)) = id {
            tls = tls.identity(Identity::from_pem(c, k));
        }
        Ok(Endpoint::from_shared(format!("https://127.0.0.1:{}", self.port))?
            .tls_config(tls)?
            .connect_timeout(Duration::from_secs(30))
            .connect()
            .await?)
    }

    pub async fn register(&self, token: &str, name: &str, underlay: &str) -> anyhow::Result<(String, String)> {
        let (key, csr) = weft_agent::identity::key_and_csr(name)?;
        let r = AgentServiceClient::new(self.channel(None).await?)
            .register(pb::RegisterRequest {
                token: token.into(),
                csr_pem: csr,
                name: name.into(),
                subnet: String::new(),
                underlay_ip: underlay.into(),
            })
            .await
            .with_context(|| format!("registering {name}"))?
            .into_inner();
        Ok((r.certificate_pem, key.serialize_pem()))
    }
}

pub enum Event {
    Connected,
    /// A reconnect's first message: was it a snapshot?
    Resumed {
        snapshot: bool,
    },
    /// Agent index, when it acknowledged.
    Acked(usize, Instant),
    /// A gateway message naming these node ids.
    GatewaySaw(Vec<String>, Instant),
    /// The agent was refused (removed) and stopped.
    Removed(usize),
}

/// Heartbeat reports the simulated agents sent (and the controller answered).
pub static HEARTBEATS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// One simulated node agent: watch, send heartbeats, acknowledge every message, keep the
/// object hashes it holds, and on a broken stream reconnect and resume with
/// its revision and hashes (as the real agent does).
pub async fn simulated_agent(
    i: usize,
    ctx: Arc<Ctx>,
    cert: String,
    key: String,
    tx: mpsc::UnboundedSender<Event>,
    sem: Arc<tokio::sync::Semaphore>,
) {
    let permit = sem.acquire().await.unwrap();
    let ch = ctx.channel(Some((&cert, &key))).await.expect("connect");
    drop(permit);
    let mut c = AgentServiceClient::new(ch).max_decoding_message_size(weft_proto::MAX_DESIRED_MESSAGE);
    let mut held: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    let mut revision = 0i64;
    let mut resumed = false;
    loop {
        let known = held
            .iter()
            .map(|(id, hash)| pb::ObjectVersion {
                id: id.clone(),
                hash: *hash,
            })
            .collect();
        let mut s = match c
            .watch(pb::WatchRequest {
                last_revision: revision,
                known,
                ..Default::default()
            })
            .await
        {
            Ok(s) => s.into_inner(),
            // Removed (its certificate revoked): a real agent stops here.
            Err(e) if matches!(e.code(), tonic::Code::Unauthenticated | tonic::Code::PermissionDenied) => {
                let _ = tx.send(Event::Removed(i));
                return;
            }
            Err(_) => {
                // The controller is away: retry soon, spread over agents.
                tokio::time::sleep(Duration::from_millis(300 + (i % 400) as u64)).await;
                continue;
            }
        };
        // Reports go on one stream, as a real agent sends them.
        let (reports, outbound) = mpsc::channel::<pb::ReportRequest>(4);
        let mut answers = match c
            .report_stream(tokio_stream::wrappers::ReceiverStream::new(outbound))
            .await
        {
            Ok(a) => a.into_inner(),
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(300 + (i % 400) as u64)).await;
                continue;
            }
        };
        let mut first = true;
        // Heartbeats as a real agent sends them: a report every period the
        // controller names (a third of the agent TTL).
        let mut every = Duration::from_secs(5);
        let mut beat = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            let m = tokio::select! {
                m = s.message() => match m {
                    Ok(Some(m)) => m,
                    _ => break,
                },
                a = answers.message() => match a {
                    Ok(Some(a)) => {
                        let p = Duration::from_millis(u64::from(a.heartbeat_millis.max(50)));
                        if p != every {
                            every = p;
                            beat = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
                        }
                        continue;
                    }
                    Err(e) if matches!(e.code(), tonic::Code::Unauthenticated | tonic::Code::PermissionDenied) => {
                        let _ = tx.send(Event::Removed(i));
                        return;
                    }
                    _ => break,
                },
                _ = beat.tick() => {
                    let beat = pb::ReportRequest {
                        applied_revision: revision,
                        ..Default::default()
                    };
                    if reports.send(beat).await.is_ok() {
                        HEARTBEATS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    continue;
                }
            };
            let is_snapshot = matches!(m.kind, Some(pb::watch_response::Kind::Snapshot(_)));
            match m.kind {
                Some(pb::watch_response::Kind::Snapshot(snap)) => {
                    held = snap
                        .objects
                        .iter()
                        .map(|o| (o.id.clone(), weft_proto::object_hash(o)))
                        .collect();
                }
                Some(pb::watch_response::Kind::Delta(d)) => {
                    for id in &d.deletes {
                        held.remove(id);
                    }
                    for o in &d.upserts {
                        held.insert(o.id.clone(), weft_proto::object_hash(o));
                    }
                }
                None => {}
            }
            revision = m.revision;
            let _ = reports
                .send(pb::ReportRequest {
                    applied_revision: m.revision,
                    errors: vec![],
                    ..Default::default()
                })
                .await;
            let event = match (first, resumed) {
                (true, false) => Event::Connected,
                (true, true) => Event::Resumed { snapshot: is_snapshot },
                (false, _) => Event::Acked(i, Instant::now()),
            };
            first = false;
            let _ = tx.send(event);
        }
        resumed = true;
    }
}

pub fn underlay(i: usize) -> String {
    format!("10.{}.{}.{}", 100 + (i >> 16), (i >> 8) & 255, i & 255)
}

/// A process's CPU seconds and memory, from /proc/<pid>.
pub struct ProcStats {
    pub cpu_secs: f64,
    /// Resident now (`VmRSS`), MiB.
    pub rss: f64,
    /// The most it was ever resident (`VmHWM`), MiB.
    pub peak: f64,
}

/// /proc/<pid>: CPU seconds, current and peak RSS.
pub fn proc_stats(pid: u32) -> ProcStats {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks = 100.0; // USER_HZ on Linux
    let cpu = fields.get(11).and_then(|u| u.parse::<f64>().ok()).unwrap_or(0.0)
        + fields.get(12).and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |field: &str| {
        status
            .lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|k| k.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    ProcStats {
        cpu_secs: cpu / ticks,
        rss: kib("VmRSS:") / 1024.0,
        peak: kib("VmHWM:") / 1024.0,
    }
}

pub fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

pub fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

/// One real controller for a load run (embedded store, or a real etcd),
/// with the simulated agents' connection context and an admin client.
pub struct Bench {
    pub controller: crate::Controller,
    pub ctx: Arc<Ctx>,
    pub admin: weft_proto::v1::admin_service_client::AdminServiceClient<Channel>,
    /// Registrations and connections in flight at once.
    pub sem: Arc<tokio::sync::Semaphore>,
    // Dropped after the controller (fields drop in order).
    _etcd: Option<crate::Etcd>,
    _dir: tempfile::TempDir,
}

impl Bench {
    /// Starts the controller on `store` ("embedded" or "etcd") with room for
    /// many nodes and the default agent TTL (15 s; the simulated agents
    /// send heartbeats as real ones do).
    pub async fn start(store: &str, parallel: usize) -> anyhow::Result<Bench> {
        Self::start_with(store, parallel, &[]).await
    }

    /// [`Bench::start`] with more controller flags.
    pub async fn start_with(store: &str, parallel: usize, extra: &[String]) -> anyhow::Result<Bench> {
        Self::start_site("bench", "10.0.0.0/8", store, parallel, extra).await
    }

    /// [`Bench::start_with`] for site `site` with workload CIDR `pods` (a
    /// second site to peer with).
    pub async fn start_site(
        site: &str,
        pods: &str,
        store: &str,
        parallel: usize,
        extra: &[String],
    ) -> anyhow::Result<Bench> {
        let dir = tempfile::Builder::new().prefix("weft-bench").tempdir()?;
        let etcd = match store {
            "etcd" => Some(crate::Etcd::start().context("etcd is not installed")?),
            "embedded" => None,
            other => anyhow::bail!("--store {other:?}: give embedded or etcd"),
        };
        let mut flags: Vec<String> = [
            "--pod-cidr",
            pods,
            "--internal-cidr",
            "100.64.0.0/10",
            "--external-cidr",
            "172.16.0.0/16",
        ]
        .map(String::from)
        .to_vec();
        if let Some(e) = &etcd {
            flags.extend(["--etcd-endpoints".into(), e.endpoint()]);
        }
        flags.extend(extra.iter().cloned());
        let refs: Vec<&str> = flags.iter().map(String::as_str).collect();
        let controller = crate::ControllerSpec::new(site)
            .data_dir(&dir.path().join("data"))
            .flags(&refs)
            .start();
        let ctx = Arc::new(Ctx {
            port: controller.listen_port,
            ca_pem: std::fs::read_to_string(controller.pki("ca.pem"))?,
        });
        let (cert, key) = (
            std::fs::read_to_string(controller.pki("admin.pem"))?,
            std::fs::read_to_string(controller.pki("admin.key"))?,
        );
        let admin =
            weft_proto::v1::admin_service_client::AdminServiceClient::new(ctx.channel(Some((&cert, &key))).await?);
        Ok(Bench {
            controller,
            ctx,
            admin,
            sem: Arc::new(tokio::sync::Semaphore::new(parallel)),
            _etcd: etcd,
            _dir: dir,
        })
    }

    /// An enrollment token for `uses` agents of `role`, valid a day.
    pub async fn token(&self, role: pb::AgentRole, uses: u32) -> anyhow::Result<String> {
        Ok(self
            .admin
            .clone()
            .create_token(pb::CreateTokenRequest {
                role: role as i32,
                name: String::new(),
                ttl_seconds: 86_400,
                uses,
            })
            .await?
            .into_inner()
            .token)
    }

    /// Enrolls node agents n0..n{count}; their (certificate, key) PEMs.
    pub async fn enroll(&self, count: usize) -> anyhow::Result<Vec<(String, String)>> {
        // A token enrolls at most 10,000 agents: one per 10,000.
        const PER_TOKEN: usize = 10_000;
        let mut tokens = Vec::new();
        for first in (0..count).step_by(PER_TOKEN) {
            let uses = (count - first).min(PER_TOKEN) as u32;
            tokens.push(Arc::new(self.token(pb::AgentRole::Node, uses).await?));
        }
        let mut handles = Vec::new();
        for i in 0..count {
            let (ctx, tok, sem) = (self.ctx.clone(), tokens[i / PER_TOKEN].clone(), self.sem.clone());
            handles.push(tokio::spawn(async move {
                let _p = sem.acquire().await.unwrap();
                ctx.register(&tok, &format!("n{i}"), &underlay(i)).await
            }));
        }
        let mut ids = Vec::with_capacity(count);
        for h in handles {
            ids.push(h.await??);
        }
        Ok(ids)
    }

    /// Starts a simulated agent for each identity and waits until all are
    /// connected; their events come on the returned channel.
    pub async fn connect(
        &self,
        ids: Vec<(String, String)>,
    ) -> anyhow::Result<(mpsc::UnboundedSender<Event>, mpsc::UnboundedReceiver<Event>)> {
        let n = ids.len();
        let (tx, mut rx) = mpsc::unbounded_channel::<Event>();
        for (i, (cert, key)) in ids.into_iter().enumerate() {
            tokio::spawn(simulated_agent(
                i,
                self.ctx.clone(),
                cert,
                key,
                tx.clone(),
                self.sem.clone(),
            ));
        }
        let mut connected = 0;
        while connected < n {
            match tokio::time::timeout(Duration::from_secs(300), rx.recv()).await {
                Ok(Some(Event::Connected)) => connected += 1,
                Ok(Some(_)) => {}
                _ => anyhow::bail!("only {connected} of {n} agents connected within 300 s"),
            }
        }
        Ok((tx, rx))
    }
}

/// (RSS in MiB, open file descriptors) of a process now.
pub fn memory_and_fds(pid: u32) -> (f64, usize) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
    (proc_stats(pid).rss, fds)
}
