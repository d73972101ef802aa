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
        self.channel_to(self.port, id).await
    }

    /// A channel to the replica on `port` (this context's CA).
    pub async fn channel_to(&self, port: u16, id: Option<(&str, &str)>) -> anyhow::Result<Channel> {
        self.channel_from(None, port, id).await
    }

    /// [`Ctx::channel_to`] from loopback address `source` (None: the
    /// system's choice, 127.0.0.1).
    pub async fn channel_from(
        &self,
        source: Option<std::net::IpAddr>,
        port: u16,
        id: Option<(&str, &str)>,
    ) -> anyhow::Result<Channel> {
        let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&self.ca_pem));
        if let Some((c, k)) = id {
            tls = tls.identity(Identity::from_pem(c, k));
        }
        Ok(Endpoint::from_shared(format!("https://127.0.0.1:{port}"))?
            .tls_config(tls)?
            .local_address(source)
            .connect_timeout(Duration::from_secs(30))
            .connect()
            .await?)
    }

    pub async fn register(&self, token: &str, name: &str, underlay: &str) -> anyhow::Result<(String, String)> {
        self.register_at(self.port, token, name, underlay).await
    }

    /// Enrolls agent `name` at the replica on `port`: its (certificate, key).
    pub async fn register_at(
        &self,
        port: u16,
        token: &str,
        name: &str,
        underlay: &str,
    ) -> anyhow::Result<(String, String)> {
        let (key, csr) = weft_agent::identity::key_and_csr(name)?;
        let r = AgentServiceClient::new(self.channel_to(port, None).await?)
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

/// Where a simulated agent connects: the replicas' ports in its own order
/// of preference (as a real agent orders its controllers), and how long
/// it waits before asking its first choice again when on another.
#[derive(Clone, Debug)]
pub struct Placement {
    pub order: Vec<u16>,
    pub failback_after: Duration,
    /// The loopback address it connects from (None: 127.0.0.1, shared).
    pub source: Option<std::net::IpAddr>,
}

impl Placement {
    /// One controller: nowhere else to go.
    pub fn single(port: u16) -> Placement {
        Placement {
            order: vec![port],
            failback_after: Duration::from_secs(15),
            source: None,
        }
    }

    /// Connecting from a loopback address of its own, as a real agent
    /// connects from its own host: a controller's per-address limits
    /// (handshakes in progress) then apply per agent, not to all at once.
    pub fn from_own_address(mut self, i: usize) -> Placement {
        let b = |x: usize| (x % 250 + 1) as u8;
        self.source = Some(std::net::IpAddr::V4(std::net::Ipv4Addr::new(
            127,
            b(i / 62_500 + 9),
            b(i / 250),
            b(i),
        )));
        self
    }

    /// Agent `name`'s order over the replicas on `ports` (loopback), as a
    /// real agent given those addresses orders them.
    pub fn of(name: &str, ports: &[u16], failback_after: Duration) -> Placement {
        let urls: Vec<String> = ports.iter().map(|p| format!("https://127.0.0.1:{p}")).collect();
        Placement {
            order: weft_agent::config::controller_order(name, &urls)
                .into_iter()
                .map(|i| ports[i])
                .collect(),
            failback_after,
            source: None,
        }
    }
}

/// A random duration below `within` (no crypto needed: spreading retries).
pub fn spread(within: Duration) -> Duration {
    use std::hash::BuildHasher;
    let r = std::collections::hash_map::RandomState::new().hash_one(Instant::now());
    within.mul_f64((r >> 11) as f64 / (1u64 << 53) as f64)
}

pub enum Event {
    Connected,
    /// A reconnect's first message (agent index): was it a snapshot?
    Resumed {
        agent: usize,
        snapshot: bool,
    },
    /// Agent index: a session started (its first message came) with the
    /// replica on this port.
    On(usize, u16),
    /// Agent index, when it acknowledged.
    Acked(usize, Instant),
    /// A gateway message naming these node ids.
    GatewaySaw(Vec<String>, Instant),
    /// The agent was refused (removed) and stopped.
    Removed(usize),
}

/// Heartbeat reports the simulated agents sent (and the controller answered).
pub static HEARTBEATS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// One simulated node agent with one controller (see [`roaming_agent`]).
pub async fn simulated_agent(
    i: usize,
    ctx: Arc<Ctx>,
    cert: String,
    key: String,
    tx: mpsc::UnboundedSender<Event>,
    sem: Arc<tokio::sync::Semaphore>,
) {
    let place = Placement::single(ctx.port);
    roaming_agent(i, ctx, place, cert, key, tx, sem).await
}

/// How a session of a simulated agent ended.
enum Ended {
    /// Refused (removed or revoked): a real agent stops here.
    Refused,
    /// No session: the replica did not answer or refused the call.
    NotOpened,
    /// A session that was up ended (its replica went away, say).
    Broke,
    /// Its first choice answers again: back to it at once.
    Preferred,
}

/// One simulated node agent: watch, send heartbeats, acknowledge every
/// message, keep the object hashes it holds, and on a broken stream
/// reconnect and resume with its revision and hashes, as the real agent
/// does: at the next replica in its order (spread over 2 s after a
/// session that was up), and back to its first choice when that answers
/// again.
pub async fn roaming_agent(
    i: usize,
    ctx: Arc<Ctx>,
    place: Placement,
    cert: String,
    key: String,
    tx: mpsc::UnboundedSender<Event>,
    sem: Arc<tokio::sync::Semaphore>,
) {
    let mut state = Held::default();
    let (mut at, mut tried) = (0usize, 0usize);
    let mut permit = Some(sem.acquire_owned().await.unwrap());
    loop {
        let started = Instant::now();
        let ended = session(i, &ctx, &place, at, &cert, &key, &tx, &mut state, &mut permit).await;
        permit = None;
        // As the real agent's retry: the next replica in its order at once
        // (spread over 2 s after a session that was up), and after a whole
        // round that failed, the same again a second later (0.3-0.7 s with
        // one controller, spread over agents).
        let was_up = started.elapsed() > Duration::from_secs(10);
        let delay = match ended {
            Ended::Refused => {
                let _ = tx.send(Event::Removed(i));
                return;
            }
            Ended::Preferred => {
                (at, tried) = (0, 0);
                continue;
            }
            Ended::Broke | Ended::NotOpened => {
                if was_up {
                    tried = 0;
                }
                tried += 1;
                at = (at + 1) % place.order.len();
                if place.order.len() == 1 {
                    Duration::from_millis(300 + (i % 400) as u64)
                } else if tried < place.order.len() && was_up {
                    Duration::from_millis(100) + spread(Duration::from_secs(2))
                } else if tried < place.order.len() {
                    Duration::from_millis(100)
                } else {
                    tried = 0;
                    Duration::from_secs(1)
                }
            }
        };
        tokio::time::sleep(delay).await;
    }
}

/// What a simulated agent holds across sessions.
#[derive(Default)]
struct Held {
    objects: std::collections::HashMap<String, u64>,
    revision: i64,
    /// A session was up before: the next first message is a resume.
    resumed: bool,
}

/// Resolves once the agent's first choice answers it again (asked every
/// `failback_after` plus up to twice that); never when it is on its first
/// choice (`at` 0).
async fn first_choice_back(ctx: &Ctx, place: &Placement, at: usize, cert: &str, key: &str) {
    if at == 0 {
        return std::future::pending().await;
    }
    let (port, after) = (place.order[0], place.failback_after);
    loop {
        tokio::time::sleep(after + spread(after * 2)).await;
        let asked = tokio::time::timeout(Duration::from_secs(5), async {
            let ch = ctx.channel_from(place.source, port, Some((cert, key))).await.ok()?;
            AgentServiceClient::new(ch).get_trust(pb::GetTrustRequest {}).await.ok()
        })
        .await;
        if matches!(asked, Ok(Some(_))) {
            return;
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn session(
    i: usize,
    ctx: &Ctx,
    place: &Placement,
    at: usize,
    cert: &str,
    key: &str,
    tx: &mpsc::UnboundedSender<Event>,
    held: &mut Held,
    permit: &mut Option<tokio::sync::OwnedSemaphorePermit>,
) -> Ended {
    let port = place.order[at];
    let Ok(ch) = ctx.channel_from(place.source, port, Some((cert, key))).await else {
        return Ended::NotOpened;
    };
    *permit = None;
    let mut c = AgentServiceClient::new(ch).max_decoding_message_size(weft_proto::MAX_DESIRED_MESSAGE);
    let known = held
        .objects
        .iter()
        .map(|(id, hash)| pb::ObjectVersion {
            id: id.clone(),
            hash: *hash,
        })
        .collect();
    let mut s = match c
        .watch(pb::WatchRequest {
            last_revision: held.revision,
            known,
            ..Default::default()
        })
        .await
    {
        Ok(s) => s.into_inner(),
        // Removed (its certificate revoked): a real agent stops here.
        Err(e) if matches!(e.code(), tonic::Code::Unauthenticated | tonic::Code::PermissionDenied) => {
            return Ended::Refused;
        }
        Err(_) => return Ended::NotOpened,
    };
    // Reports go on one stream, as a real agent sends them.
    let (reports, outbound) = mpsc::channel::<pb::ReportRequest>(4);
    let mut answers = match c
        .report_stream(tokio_stream::wrappers::ReceiverStream::new(outbound))
        .await
    {
        Ok(a) => a.into_inner(),
        Err(_) => return Ended::NotOpened,
    };
    let back = first_choice_back(ctx, place, at, cert, key);
    tokio::pin!(back);
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
                    return Ended::Refused;
                }
                _ => break,
            },
            _ = &mut back => return Ended::Preferred,
            _ = beat.tick() => {
                let beat = pb::ReportRequest {
                    applied_revision: held.revision,
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
                held.objects = snap
                    .objects
                    .iter()
                    .map(|o| (o.id.clone(), weft_proto::object_hash(o)))
                    .collect();
            }
            Some(pb::watch_response::Kind::Delta(d)) => {
                for id in &d.deletes {
                    held.objects.remove(id);
                }
                for o in &d.upserts {
                    held.objects.insert(o.id.clone(), weft_proto::object_hash(o));
                }
            }
            None => {}
        }
        held.revision = m.revision;
        let _ = reports
            .send(pb::ReportRequest {
                applied_revision: m.revision,
                errors: vec![],
                ..Default::default()
            })
            .await;
        if first {
            let _ = tx.send(Event::On(i, port));
        }
        let event = match (first, held.resumed) {
            (true, false) => Event::Connected,
            (true, true) => Event::Resumed {
                agent: i,
                snapshot: is_snapshot,
            },
            (false, _) => Event::Acked(i, Instant::now()),
        };
        // Every later session's first message is a resume.
        held.resumed = true;
        first = false;
        let _ = tx.send(event);
    }
    if first {
        return Ended::NotOpened;
    }
    Ended::Broke
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
