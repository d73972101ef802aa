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

/// One simulated node agent: watch, acknowledge every message, keep the
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
    let mut c = AgentServiceClient::new(ch);
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
        let mut first = true;
        while let Ok(Some(m)) = s.message().await {
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
            let _ = c
                .report(pb::ReportRequest {
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

/// /proc/<pid>: (cpu seconds, peak RSS in MiB).
pub fn proc_stats(pid: u32) -> (f64, f64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks = 100.0; // USER_HZ on Linux
    let cpu = fields.get(11).and_then(|u| u.parse::<f64>().ok()).unwrap_or(0.0)
        + fields.get(12).and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let hwm = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|k| k.parse::<f64>().ok())
        .unwrap_or(0.0);
    (cpu / ticks, hwm / 1024.0)
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
