//! The agent's main loop, shared by both agents: enroll (or load the stored
//! identity), connect to a controller, learn its assignment, and keep the
//! certificate renewed with backoff until a signal stops it. The desired
//! state stream joins this loop with the agent protocol.

use std::time::{Duration, SystemTime};

use weft_proto::v1 as pb;
use weft_proto::v1::agent_service_client::AgentServiceClient;

use crate::config::AgentConfig;
use crate::identity::{AgentKind, Credentials, IdentityStore, RenewError};
use crate::tls;

/// Retry delays after a failure: exponential from 1 s to 60 s, with jitter
/// so that many agents do not retry in step, and no limit on attempts.
pub fn backoff() -> impl Iterator<Item = Duration> {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_secs(1))
        .with_max_delay(Duration::from_secs(60))
        .with_jitter()
        .without_max_times()
        .build()
}

async fn assignment(target: &str, creds: &Credentials, name: &str) -> anyhow::Result<pb::Assignment> {
    let ch = tls::connect(target, &creds.trust(), Some((&creds.cert_pem, &creds.key_pem))).await?;
    let a = AgentServiceClient::new(ch)
        .get_assignment(pb::GetAssignmentRequest { name: name.to_string() })
        .await
        .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?;
    Ok(a.into_inner())
}

/// Runs the agent until SIGTERM or SIGINT. Errors end the process loudly.
pub async fn run(cfg: AgentConfig, kind: AgentKind, subnet: Option<String>) -> anyhow::Result<()> {
    let ids = IdentityStore::new(&cfg.state_dir);
    let mut creds = match ids.load()? {
        Some(c) if c.not_after > SystemTime::now() => c,
        Some(_) => anyhow::bail!(
            "the certificate in {} has expired; remove the agent with weftctl and enroll it again with a new token",
            cfg.state_dir.display()
        ),
        None => ids.enroll(&cfg, kind, subnet).await?,
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut controller = 0usize;
    for _ in 0..cfg.controllers.len() {
        match assignment(&cfg.controllers[controller], &creds, &cfg.name).await {
            Ok(a) => {
                tracing::info!(name = %a.name, site = %a.site_id, subnet = %a.subnet, "assignment");
                break;
            }
            Err(e) => {
                tracing::warn!(controller = %cfg.controllers[controller], error = %format!("{e:#}"), "cannot read the assignment");
                controller = (controller + 1) % cfg.controllers.len();
            }
        }
    }
    let mut delays = backoff();
    loop {
        let wait = creds.renew_at().duration_since(SystemTime::now()).unwrap_or_default();
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
        }
        let target = &cfg.controllers[controller];
        match ids.renew(target, &cfg.name, &creds).await {
            Ok(c) => {
                tracing::info!(valid_for = ?c.not_after.duration_since(SystemTime::now()).unwrap_or_default(), "certificate renewed");
                creds = c;
                delays = backoff();
            }
            Err(RenewError::Refused(e)) => anyhow::bail!("the controller refused to renew this agent: {e:#}"),
            Err(RenewError::Transient(e)) => {
                if creds.not_after <= SystemTime::now() {
                    anyhow::bail!("the certificate expired before it could be renewed: {e:#}");
                }
                let delay = delays.next().unwrap_or(Duration::from_secs(60));
                controller = (controller + 1) % cfg.controllers.len();
                tracing::warn!(error = %e, retry_in = ?delay, "renewal failed");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = tokio::signal::ctrl_c() => break,
                    _ = term.recv() => break,
                }
                continue;
            }
        }
    }
    tracing::info!("stopping");
    Ok(())
}

/// The common `main` of both agents.
pub fn main_with(
    cfg: Result<AgentConfig, crate::config::AgentConfigError>,
    kind: AgentKind,
    subnet: Option<String>,
) -> std::process::ExitCode {
    use std::process::ExitCode;
    let prog = format!("weft-{}-agent", kind.as_str());
    let cfg = match cfg {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{prog}: {e}");
            return ExitCode::from(2);
        }
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("WEFT_LOG").unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{prog}: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cfg, kind, subnet)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{prog}: {e:#}");
            ExitCode::FAILURE
        }
    }
}
