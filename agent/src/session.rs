//! One session with a controller: connect, announce the node's subnet and
//! a gateway's key, watch the desired state and apply each message as the
//! whole state, report (with heartbeats between), and end as what the
//! controller answered. The run loop (`run.rs`) decides what follows.

use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use weft_proto::v1 as pb;
use weft_proto::v1::agent_service_client::AgentServiceClient;

use crate::apply::{Applier, Scope};
use crate::config::AgentConfig;
use crate::desired::{Desired, Held, StateFile};
use crate::identity::Credentials;
use crate::tls;

mod dns;
mod failback;
mod report;
mod resync;
pub(crate) use dns::Dns;
pub(crate) use failback::jitter;
use failback::preferred_back;
use report::{AbortOnDrop, LastReport, Reporter, heartbeat_period, keep_reporting, next_answer, stream_end};
use resync::{resync, resync_timer, resync_unless_changed};

/// How a session ended.
#[derive(Debug)]
pub(crate) enum End {
    /// No answer: the controller could not be reached, or the connection
    /// to it broke (found dead by the keep-alive). Worth reconnecting at
    /// once and then every second: nothing is refusing us.
    Lost(anyhow::Error),
    /// The controller answered with an error: worth reconnecting, after a
    /// back-off that grows while it keeps answering so.
    Transient(anyhow::Error),
    /// The admin removed this agent (the controller says so, see
    /// [`weft_proto::REMOVED`]): what it applied goes.
    Removed(anyhow::Error),
    /// The controller refuses this agent otherwise (a revoked, unknown or
    /// expired certificate, which a thief's renewal can cause too): the
    /// host keeps forwarding what it has, and the agent keeps asking.
    Refused(anyhow::Error),
    /// This agent's first-choice controller (it was connected to
    /// another) answers again: it moves back, at once.
    Preferred,
}

fn classify(s: tonic::Status) -> End {
    let e = anyhow::anyhow!("{:?}: {}", s.code(), s.message());
    match s.code() {
        tonic::Code::Unauthenticated if s.metadata().contains_key(weft_proto::REMOVED) => End::Removed(e),
        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => End::Refused(e),
        // A status the transport made up (it carries the connection's
        // error as its source), not one the controller sent.
        _ if std::error::Error::source(&s).is_some() => End::Lost(e),
        _ => End::Transient(e),
    }
}

async fn client(target: &str, creds: &Credentials) -> Result<AgentServiceClient<tonic::transport::Channel>, End> {
    let ch = tls::connect(target, &creds.trust(), Some((&creds.cert_pem, &creds.key_pem)))
        .await
        .map_err(|e| match e {
            tls::ConnectError::Unreachable { .. } => End::Lost(e.into()),
            tls::ConnectError::BadTarget(_) => End::Transient(e.into()),
        })?;
    Ok(AgentServiceClient::new(ch).max_decoding_message_size(weft_proto::MAX_DESIRED_MESSAGE))
}

/// Applies a received message, persists the result and returns the errors.
async fn receive(
    msg: &pb::WatchResponse,
    desired: &mut Desired,
    file: &StateFile,
    applier: &mut dyn Applier,
) -> Vec<pb::ObjectError> {
    let (upserts, deletes) = desired.changes(msg);
    let kind = if matches!(msg.kind, Some(pb::watch_response::Kind::Snapshot(_))) {
        "snapshot"
    } else {
        "delta"
    };
    let started = std::time::Instant::now();
    let (n_up, n_del) = (upserts.len(), deletes.len());
    let mut next = desired.clone();
    next.commit(msg.revision, upserts, &deletes);
    let errors = applier.apply(&desired.objects, &next.objects, Scope::Changed).await;
    observe_reconcile(kind, started, &errors);
    *desired = next;
    file.keep(desired);
    crate::metrics::get().applied_revision.set(msg.revision);
    tracing::info!(
        revision = msg.revision,
        kind,
        upserts = n_up,
        deletes = n_del,
        errors = errors.len(),
        ms = started.elapsed().as_millis() as u64,
        "applied"
    );
    errors
}

/// Records one reconcile's duration and failed objects.
pub(crate) fn observe_reconcile(trigger: &str, started: std::time::Instant, errors: &[pb::ObjectError]) {
    let m = crate::metrics::get();
    m.reconcile
        .get_or_create(&vec![("trigger".to_string(), trigger.to_string())])
        .observe(started.elapsed().as_secs_f64());
    m.reconcile_errors.inc_by(errors.len() as u64);
}

/// How often a gateway looks at which way its tunnels go (UDP or TLS).
const PATHS_EVERY: Duration = Duration::from_secs(1);

/// How often an agent sends the facts about its host.
const HOST_REPORT_EVERY: Duration = Duration::from_secs(30);

/// Makes the agent's own objects (ids under `local/`) what `want` says.
async fn sync_local(want: Vec<Held>, desired: &mut Desired, file: &StateFile, applier: &mut dyn Applier) {
    let gone: Vec<String> = desired
        .objects
        .keys()
        .filter(|id| crate::desired::is_local(id) && !want.iter().any(|w| w.id() == id.as_str()))
        .cloned()
        .collect();
    let changed: Vec<Held> = want
        .into_iter()
        .filter(|w| desired.objects.get(w.id()) != Some(w))
        .collect();
    if gone.is_empty() && changed.is_empty() {
        return;
    }
    let mut next = desired.clone();
    next.commit(desired.revision, changed, &gone);
    for e in applier.apply(&desired.objects, &next.objects, Scope::Changed).await {
        tracing::warn!(object = %e.id, error = %e.message, "not applied");
    }
    *desired = next;
    file.keep(desired);
}

/// What one session with a controller works with.
pub(crate) struct Session<'a> {
    pub(crate) target: &'a str,
    pub(crate) cfg: &'a AgentConfig,
    /// The gateway's WireGuard public key (None on nodes).
    pub(crate) gateway_key: Option<&'a weft_types::WgKey>,
    pub(crate) creds: &'a mut watch::Receiver<Credentials>,
    pub(crate) desired: &'a mut Desired,
    pub(crate) file: &'a StateFile,
    pub(crate) applier: &'a mut dyn Applier,
    pub(crate) dns: Option<&'a mut Dns>,
    /// Told the controller's address once the session is open (the agent
    /// then asks it which CAs the site trusts).
    pub(crate) connected: &'a watch::Sender<String>,
    /// This agent's first-choice controller, when `target` is not it: the
    /// session ends ([`End::Preferred`]) once that one answers again.
    pub(crate) preferred: Option<&'a str>,
}

/// A node's subnets as the controller gives them: IPv4 and IPv6 (each
/// empty when the node has none).
pub(crate) struct Subnets {
    v4: String,
    v6: String,
}

/// The node's subnets, asked for anew each session (so a moved subnet
/// moves what follows it: the workload bridge, the DNS responder), when
/// anything follows them.
async fn node_subnets(
    c: &mut AgentServiceClient<tonic::transport::Channel>,
    wanted: bool,
) -> Result<Option<Subnets>, End> {
    if !wanted {
        return Ok(None);
    }
    // (No name: the controller answers for the certificate's.)
    let a = c
        .get_assignment(pb::GetAssignmentRequest::default())
        .await
        .map_err(classify)?
        .into_inner();
    Ok(Some(Subnets {
        v4: a.subnet,
        v6: a.subnet_v6,
    }))
}

/// The agent's own objects: the workload bridge on the node's subnets, or
/// nothing (which removes a bridge an earlier run made).
fn local_objects(bridge: Option<&str>, subnets: Option<&Subnets>) -> Result<Vec<Held>, End> {
    match (bridge, subnets) {
        (Some(bridge), Some(s)) => crate::desired::bridge_objects(bridge, &s.v4, &s.v6).map_err(End::Refused),
        _ => Ok(Vec::new()),
    }
}

/// Logs each tunnel that went up or down since `up` was last updated.
fn log_tunnel_changes(tunnels: &[pb::TunnelStatus], up: &mut std::collections::HashSet<String>) {
    for t in tunnels {
        if t.up != up.contains(&t.peer_site) {
            if t.up {
                tracing::info!(peer = %t.peer_site, link = %t.link, rtt_us = t.rtt_micros, "tunnel up");
                up.insert(t.peer_site.clone());
            } else {
                tracing::warn!(peer = %t.peer_site, link = %t.link, lost = t.probes_lost, "tunnel down: probes unanswered");
                up.remove(&t.peer_site);
            }
        }
    }
    up.retain(|site| tunnels.iter().any(|t| t.peer_site == *site));
}

/// Opens a session: connects, makes the agent's own objects, starts the
/// Watch stream from what the agent holds and, on a gateway, sends its key
/// and endpoint.
#[allow(clippy::too_many_arguments)]
async fn open(
    target: &str,
    cfg: &AgentConfig,
    gateway_key: Option<&weft_types::WgKey>,
    current: &Credentials,
    desired: &mut Desired,
    file: &StateFile,
    applier: &mut dyn Applier,
    dns: Option<&mut Dns>,
) -> Result<
    (
        AgentServiceClient<tonic::transport::Channel>,
        tonic::Streaming<pb::WatchResponse>,
    ),
    End,
> {
    let mut c = match client(target, current).await {
        Ok(c) => c,
        Err(e) => return Err(e),
    };
    let wants_subnet = cfg.workload_bridge.is_some() || dns.as_deref().is_some_and(Dns::wants_subnet);
    let subnets = match node_subnets(&mut c, wants_subnet).await {
        Ok(s) => s,
        Err(e) => return Err(e),
    };
    if let (Some(d), Some(subnets)) = (dns, subnets.as_ref()) {
        d.follow_subnet(subnets);
    }
    let local = match local_objects(cfg.workload_bridge.as_deref(), subnets.as_ref()) {
        Ok(l) => l,
        Err(e) => return Err(e),
    };
    sync_local(local, desired, file, applier).await;
    let mut features = applier.features();
    if gateway_key.is_some() {
        features.push(weft_proto::EXPORT_POLICY_FEATURE.into());
        features.push(weft_proto::EXPORT_POLICY_V6_FEATURE.into());
    }
    let req = pb::WatchRequest {
        last_revision: desired.revision,
        known: desired.known(),
        features,
    };
    let stream = match c.watch(req).await {
        Ok(s) => s.into_inner(),
        Err(s) => return Err(classify(s)),
    };
    tracing::info!(controller = %target, from_revision = desired.revision, "watching");
    if let Some(public_key) = gateway_key {
        tracing::info!(
            %public_key,
            "this gateway's WireGuard public key (a change of it waits for `weftctl gateway accept-key` with it)"
        );
        let req = pb::UpdateGatewayRequest {
            public_key: public_key.to_string(),
            endpoint: cfg.endpoint.clone().unwrap_or_default(),
        };
        if let Err(s) = c.update_gateway(req).await {
            return Err(classify(s));
        }
    }
    Ok((c, stream))
}

/// The host's facts, sent every `HOST_REPORT_EVERY` (None between).
async fn host_facts(
    reported: &mut Option<std::time::Instant>,
    applier: &mut dyn Applier,
    desired: &Desired,
) -> Option<pb::HostReport> {
    if reported.is_some_and(|at| at.elapsed() < HOST_REPORT_EVERY) {
        return None;
    }
    *reported = Some(std::time::Instant::now());
    let h = applier.host_report(&desired.objects).await;
    for c in &h.route_conflicts {
        tracing::warn!(conflict = %c, "a host route overlaps a peer's CIDR");
    }
    Some(h)
}

/// When the agent applies everything it holds again; a zero interval
/// turns drift repair off (the timer then never fires).
/// How often a session reports until the controller says its period (a
/// third of the TTL, in its first answer). Short: the session's loop may be
/// busy for seconds with its first apply and not read that answer, and
/// meanwhile its keeper reports at this pace; at 5 s, as it was, a gateway
/// that had just (re)started outlived a 3 s TTL unheard and was expired.
const FIRST_HEARTBEAT_EVERY: Duration = Duration::from_millis(250);

/// A turn of the session's loop that takes longer is logged (debug) with
/// its parts: what keeps a change or a heartbeat waiting.
const SLOW_TURN: Duration = Duration::from_millis(250);

pub(crate) async fn session(s: Session<'_>) -> End {
    let Session {
        target,
        cfg,
        gateway_key,
        creds,
        desired,
        file,
        applier,
        mut dns,
        connected,
        preferred,
    } = s;
    let current = creds.borrow_and_update().clone();
    let (mut c, mut stream) = match open(
        target,
        cfg,
        gateway_key,
        &current,
        desired,
        file,
        applier,
        dns.as_deref_mut(),
    )
    .await
    {
        Ok(x) => x,
        Err(e) => return e,
    };
    connected.send_replace(target.to_string());
    let mut errors: Vec<pb::ObjectError> = Vec::new();
    let mut heartbeat = tokio::time::interval(FIRST_HEARTBEAT_EVERY);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut resync_timer = resync_timer(cfg.resync_interval);
    let mut tunnels_up: std::collections::HashSet<String> = std::collections::HashSet::new();
    let changes = applier.tunnel_changes().unwrap_or_default();
    let repairs = applier.repairs();
    let mut paths_tick = tokio::time::interval(PATHS_EVERY);
    paths_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let metrics = crate::metrics::get();
    metrics.connected.set(1);
    metrics.cert_expiry.set(unix_secs(current.not_after));
    let _disconnected = Disconnected;
    let mut host_reported: Option<std::time::Instant> = None;
    let (mut reporter, mut answers) = match Reporter::open(&mut c).await {
        Ok(r) => r,
        Err(e) => return e,
    };
    let last = std::sync::Arc::new(std::sync::Mutex::new(LastReport {
        at: std::time::Instant::now(),
        report: pb::ReportRequest {
            applied_revision: desired.revision,
            ..Default::default()
        },
        every: heartbeat.period(),
        reporter: reporter.clone(),
    }));
    let _keeper = AbortOnDrop(tokio::spawn(keep_reporting(last.clone())));
    // A resync that a change interrupted: the next one comes soon and
    // runs whole.
    let mut yielded = false;
    let back = preferred_back(preferred, &current, cfg.failback_after);
    tokio::pin!(back);
    loop {
        let msg = tokio::select! {
            // Between messages, never within one: nothing is left half-applied.
            _ = &mut back => return End::Preferred,
            _ = resync_timer.tick() => {
                resync_unless_changed(desired, applier, &mut stream, &mut resync_timer, &mut yielded, &mut errors).await
            }
            // A tunnel went up or down: report now, not at the next heartbeat.
            _ = changes.notified() => None,
            // A device died: made anew now (a resync finds it missing),
            // and reported.
            _ = async { repairs.unwrap().notified().await }, if repairs.is_some() => {
                tracing::warn!("a WireGuard device died: repairing now");
                errors = resync(desired, applier).await;
                None
            }
            // A tunnel whose UDP does not answer goes over TLS, and back
            // (see `fallback`): applied at once, and reported.
            _ = paths_tick.tick() => {
                if !applier.step_paths() {
                    continue;
                }
                // Not drift: the endpoints weft itself moved.
                let started = std::time::Instant::now();
                errors = applier.apply(&desired.objects, &desired.objects, Scope::Everything).await;
                observe_reconcile("paths", started, &errors);
                None
            }
            msg = stream.message() => Some(msg),
            a = next_answer(&mut answers) => match a {
                Ok(Some(a)) => {
                    follow_period(&mut heartbeat, &last, &a);
                    continue;
                }
                Ok(None) => return End::Transient(anyhow::anyhow!("the controller ended the report stream")),
                Err(s) => return classify(s),
            },
            _ = heartbeat.tick() => None,
        };
        let woke = std::time::Instant::now();
        match msg {
            Some(Ok(Some(m))) => {
                errors = receive(&m, desired, file, applier).await;
                // The desired state changed: so may the names served.
                if let Some(d) = dns.as_deref() {
                    d.table
                        .set(desired.objects.values().filter_map(crate::desired::Held::object));
                }
            }
            Some(Ok(None)) => return End::Transient(anyhow::anyhow!("the controller ended the stream")),
            Some(Err(s)) => return classify(s),
            None => {}
        }
        // Reports (the heartbeat too) go on a connection with the newest
        // certificate; the watch stream stays on the one it started on.
        match reconnected(target, creds).await {
            Some(Ok(x)) => (reporter, answers) = x,
            Some(Err(e)) => return e,
            None => {}
        }
        let received = woke.elapsed();
        let report = next_report(applier, desired, file, &errors, &mut tunnels_up, &mut host_reported).await;
        last.lock().unwrap().remember(&report, &reporter);
        let reported = reporter.send(report).await;
        log_slow_turn(woke, received);
        match reported {
            Ok(Some(r)) => follow_period(&mut heartbeat, &last, &r),
            Ok(None) => {}
            Err(Some(s)) => return classify(s),
            Err(None) => return stream_end(&mut answers).await,
        }
    }
}

/// Heartbeats at the period the controller's answer `r` says.
fn follow_period(heartbeat: &mut tokio::time::Interval, last: &std::sync::Mutex<LastReport>, r: &pb::ReportResponse) {
    let every = heartbeat_period(r);
    last.lock().unwrap().every = every;
    if every != heartbeat.period() {
        *heartbeat = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    }
}

/// The report after a turn: the tunnels (their changes logged), the host's
/// facts when due, the objects that failed, and a state file that could
/// not be saved (tried again at every report, and reported until saved).
async fn next_report(
    applier: &mut dyn Applier,
    desired: &Desired,
    file: &StateFile,
    errors: &[pb::ObjectError],
    tunnels_up: &mut std::collections::HashSet<String>,
    host_reported: &mut Option<std::time::Instant>,
) -> pb::ReportRequest {
    let tunnels = applier.tunnels();
    log_tunnel_changes(&tunnels, tunnels_up);
    *crate::metrics::get().tunnels.lock().unwrap() = tunnels.clone();
    let host = host_facts(host_reported, applier, desired).await;
    file.retry(desired);
    pb::ReportRequest {
        applied_revision: desired.revision,
        errors: errors.iter().cloned().chain(file.failure()).collect(),
        tunnels,
        host,
    }
}

/// Logs a turn of the session's loop that took longer than [`SLOW_TURN`],
/// with its parts.
fn log_slow_turn(woke: std::time::Instant, received: Duration) {
    if woke.elapsed() > SLOW_TURN {
        tracing::debug!(
            // The message applied (and a reconnect with a renewed
            // certificate); a resync logs its own time.
            message_ms = received.as_millis() as u64,
            // Tunnels read, host facts (every 30 s), the state file, the
            // report sent.
            report_ms = woke.elapsed().saturating_sub(received).as_millis() as u64,
            "a slow turn of the session's loop"
        );
    }
}

/// After the certificate was renewed: a report stream on a connection
/// with the new one (None: not renewed since the last turn).
async fn reconnected(
    target: &str,
    creds: &mut watch::Receiver<Credentials>,
) -> Option<Result<(Reporter, report::Answers), End>> {
    if !creds.has_changed().unwrap_or(false) {
        return None;
    }
    let fresh = creds.borrow_and_update().clone();
    crate::metrics::get().cert_expiry.set(unix_secs(fresh.not_after));
    Some(
        async {
            let mut c = client(target, &fresh).await?;
            Reporter::open(&mut c).await
        }
        .await,
    )
}

fn unix_secs(t: SystemTime) -> f64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// Marks the controller connection closed when a session ends, however.
struct Disconnected;

impl Drop for Disconnected {
    fn drop(&mut self) {
        crate::metrics::get().connected.set(0);
    }
}

#[cfg(test)]
mod tests;
