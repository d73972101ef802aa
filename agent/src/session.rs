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
use crate::desired::{Desired, StateFile};
use crate::identity::Credentials;
use crate::tls;

mod dns;
mod report;
pub(crate) use dns::Dns;
use report::{AbortOnDrop, LastReport, Reporter, heartbeat_period, keep_reporting, next_answer, stream_end};

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

/// Applies everything held again (level-triggered: a no-op unless something
/// drifted); counts and logs what had to be put back.
async fn resync(desired: &Desired, applier: &mut dyn Applier) -> Vec<pb::ObjectError> {
    let before = applier.writes();
    let started = std::time::Instant::now();
    let errors = applier
        .apply(&desired.objects, &desired.objects, Scope::Everything)
        .await;
    observe_reconcile("resync", started, &errors);
    let repaired = applier.writes().saturating_sub(before);
    tracing::debug!(
        revision = desired.revision,
        ms = started.elapsed().as_millis() as u64,
        repaired,
        "resync done"
    );
    if repaired > 0 {
        crate::metrics::get().drift_repairs.inc_by(repaired);
        tracing::warn!(
            repaired,
            revision = desired.revision,
            "host objects were missing and are back (drift repaired)"
        );
    }
    errors
}

/// How often an agent sends the facts about its host.
const HOST_REPORT_EVERY: Duration = Duration::from_secs(30);

/// Makes the agent's own objects (ids under `local/`) what `want` says.
async fn sync_local(want: Vec<pb::DesiredObject>, desired: &mut Desired, file: &StateFile, applier: &mut dyn Applier) {
    let gone: Vec<String> = desired
        .objects
        .keys()
        .filter(|id| crate::desired::is_local(id) && !want.iter().any(|w| w.id == **id))
        .cloned()
        .collect();
    let changed: Vec<pb::DesiredObject> = want
        .into_iter()
        .filter(|w| desired.objects.get(&w.id) != Some(w))
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
fn local_objects(bridge: Option<&str>, subnets: Option<&Subnets>) -> Result<Vec<pb::DesiredObject>, End> {
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

/// How soon a resync that yielded to a change runs again (whole).
const RESYNC_AFTER_YIELD: Duration = Duration::from_secs(1);

fn resync_timer(every: Duration) -> tokio::time::Interval {
    let period = if every.is_zero() {
        Duration::from_secs(100 * 365 * 86_400)
    } else {
        every
    };
    let mut t = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    t
}

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
    let mut errors: Vec<pb::ObjectError> = Vec::new();
    let mut heartbeat = tokio::time::interval(FIRST_HEARTBEAT_EVERY);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut resync_timer = resync_timer(cfg.resync_interval);
    let mut tunnels_up: std::collections::HashSet<String> = std::collections::HashSet::new();
    let changes = applier.tunnel_changes().unwrap_or_default();
    let repairs = applier.repairs();
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
    loop {
        let msg = tokio::select! {
            _ = resync_timer.tick() => {
                if yielded {
                    yielded = false;
                    errors = resync(desired, applier).await;
                    None
                } else {
                    // A change must not wait for a resync (seconds on a
                    // slow host, and a failover's change is one): it stops
                    // the resync, which is level-triggered and comes again.
                    let whole = resync(desired, applier);
                    tokio::pin!(whole);
                    tokio::select! {
                        e = &mut whole => {
                            errors = e;
                            None
                        }
                        msg = stream.message() => {
                            tracing::debug!("a change came during a resync: the resync stopped, the change goes first");
                            yielded = true;
                            resync_timer.reset_after(RESYNC_AFTER_YIELD);
                            Some(msg)
                        }
                    }
                }
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
            msg = stream.message() => Some(msg),
            a = next_answer(&mut answers) => match a {
                Ok(Some(a)) => {
                    let every = heartbeat_period(&a);
                    last.lock().unwrap().every = every;
                    if every != heartbeat.period() {
                        heartbeat = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
                    }
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
                    d.table.set(desired.objects.values());
                }
            }
            Some(Ok(None)) => return End::Transient(anyhow::anyhow!("the controller ended the stream")),
            Some(Err(s)) => return classify(s),
            None => {}
        }
        // Reports (the heartbeat too) go on a connection with the newest
        // certificate; the watch stream stays on the one it started on.
        if creds.has_changed().unwrap_or(false) {
            let fresh = creds.borrow_and_update().clone();
            metrics.cert_expiry.set(unix_secs(fresh.not_after));
            match client(target, &fresh).await {
                Ok(n) => c = n,
                Err(e) => return e,
            }
            (reporter, answers) = match Reporter::open(&mut c).await {
                Ok(r) => r,
                Err(e) => return e,
            };
        }
        let received = woke.elapsed();
        let tunnels = applier.tunnels();
        log_tunnel_changes(&tunnels, &mut tunnels_up);
        *metrics.tunnels.lock().unwrap() = tunnels.clone();
        let host = host_facts(&mut host_reported, applier, desired).await;
        // A state file that could not be saved: tried again at every
        // report, and reported until it is saved.
        file.retry(desired);
        let report = pb::ReportRequest {
            applied_revision: desired.revision,
            errors: errors.iter().cloned().chain(file.failure()).collect(),
            tunnels,
            host,
        };
        {
            let mut l = last.lock().unwrap();
            l.at = std::time::Instant::now();
            l.report = pb::ReportRequest {
                host: None,
                ..report.clone()
            };
            l.reporter = reporter.clone();
        }
        let reported = reporter.send(report).await;
        if woke.elapsed() > SLOW_TURN {
            tracing::debug!(
                // The message applied (and a reconnect with a renewed
                // certificate); a resync logs its own time.
                message_ms = received.as_millis() as u64,
                // Tunnels read, host facts (every 30 s), the state file,
                // the report sent.
                report_ms = woke.elapsed().saturating_sub(received).as_millis() as u64,
                "a slow turn of the session's loop"
            );
        }
        match reported {
            Ok(Some(r)) => {
                let every = heartbeat_period(&r);
                last.lock().unwrap().every = every;
                if every != heartbeat.period() {
                    heartbeat = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
                }
            }
            Ok(None) => {}
            Err(Some(s)) => return classify(s),
            Err(None) => return stream_end(&mut answers).await,
        }
    }
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
mod tests {
    use super::*;

    /// What reached an applier: (what it had applied, what is desired,
    /// where to look), by id.
    #[derive(Default)]
    struct Seen(Vec<(Vec<String>, Vec<String>, Scope)>);

    #[async_trait::async_trait]
    impl Applier for Seen {
        async fn apply(
            &mut self,
            applied: &crate::apply::Objects,
            desired: &crate::apply::Objects,
            scope: Scope,
        ) -> Vec<pb::ObjectError> {
            self.0.push((
                applied.keys().cloned().collect(),
                desired.keys().cloned().collect(),
                scope,
            ));
            vec![]
        }
    }

    fn object(id: &str) -> pb::DesiredObject {
        pb::DesiredObject {
            id: id.into(),
            kind: None,
        }
    }

    /// The applier is given the whole desired state each time (never a
    /// delta), with what it had applied; a resync says so, and the state
    /// is kept on disk at the revision received.
    #[tokio::test]
    async fn each_message_reaches_the_applier_as_the_whole_state_and_is_kept() {
        use pb::watch_response::Kind;
        let dir = tempfile::tempdir().unwrap();
        let file = StateFile::new(dir.path());
        let mut desired = Desired::default();
        let mut seen = Seen::default();
        let snapshot = pb::WatchResponse {
            revision: 3,
            kind: Some(Kind::Snapshot(pb::Snapshot {
                objects: vec![object("a"), object("b")],
            })),
        };
        receive(&snapshot, &mut desired, &file, &mut seen).await;
        let delta = pb::WatchResponse {
            revision: 4,
            kind: Some(Kind::Delta(pb::Delta {
                upserts: vec![object("c")],
                deletes: vec!["a".into()],
            })),
        };
        receive(&delta, &mut desired, &file, &mut seen).await;
        resync(&desired, &mut seen).await;
        let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            seen.0,
            [
                (ids(&[]), ids(&["a", "b"]), Scope::Changed),
                (ids(&["a", "b"]), ids(&["b", "c"]), Scope::Changed),
                (ids(&["b", "c"]), ids(&["b", "c"]), Scope::Everything),
            ]
        );
        assert_eq!(desired.revision, 4);
        assert_eq!(file.load().unwrap(), Some(desired));
    }

    /// A controller for one session at a time on a Unix socket (the agent's
    /// client dials `unix:` targets without TLS): it answers Watch with
    /// `script` (each a message or the status that ends the stream), or
    /// refuses Watch with `refuse`; it records every Watch request, report
    /// and gateway update it gets.
    #[derive(Default)]
    struct FakeController {
        script: std::sync::Mutex<Vec<Result<pb::WatchResponse, tonic::Status>>>,
        refuse: std::sync::Mutex<Option<tonic::Status>>,
        watches: std::sync::Mutex<Vec<pb::WatchRequest>>,
        reports: std::sync::Mutex<Vec<pb::ReportRequest>>,
        updates: std::sync::Mutex<Vec<pb::UpdateGatewayRequest>>,
    }

    type Answer<T> = Result<tonic::Response<T>, tonic::Status>;

    #[tonic::async_trait]
    impl weft_proto::v1::agent_service_server::AgentService for FakeController {
        type WatchStream =
            tokio_stream::Iter<std::vec::IntoIter<Result<weft_proto::wire::WatchResponse, tonic::Status>>>;

        async fn register(&self, _: tonic::Request<pb::RegisterRequest>) -> Answer<pb::RegisterResponse> {
            Err(tonic::Status::unimplemented("not in this fake"))
        }
        async fn renew(&self, _: tonic::Request<pb::RenewRequest>) -> Answer<pb::RenewResponse> {
            Err(tonic::Status::unimplemented("not in this fake"))
        }
        async fn get_assignment(&self, _: tonic::Request<pb::GetAssignmentRequest>) -> Answer<pb::Assignment> {
            Err(tonic::Status::unimplemented("not in this fake"))
        }
        async fn watch(&self, r: tonic::Request<pb::WatchRequest>) -> Answer<Self::WatchStream> {
            self.watches.lock().unwrap().push(r.into_inner());
            if let Some(s) = self.refuse.lock().unwrap().take() {
                return Err(s);
            }
            let script = std::mem::take(&mut *self.script.lock().unwrap());
            let script: Vec<_> = script.into_iter().map(|m| m.map(Into::into)).collect();
            Ok(tonic::Response::new(tokio_stream::iter(script)))
        }
        async fn report(&self, r: tonic::Request<pb::ReportRequest>) -> Answer<pb::ReportResponse> {
            self.reports.lock().unwrap().push(r.into_inner());
            Ok(tonic::Response::new(pb::ReportResponse::default()))
        }
        type ReportStreamStream = tokio_stream::Empty<Result<pb::ReportResponse, tonic::Status>>;
        // As an older controller: the agent falls back to Report calls.
        async fn report_stream(
            &self,
            _: tonic::Request<tonic::Streaming<pb::ReportRequest>>,
        ) -> Answer<Self::ReportStreamStream> {
            Err(tonic::Status::unimplemented("not in this fake"))
        }
        async fn update_gateway(
            &self,
            r: tonic::Request<pb::UpdateGatewayRequest>,
        ) -> Answer<pb::UpdateGatewayResponse> {
            self.updates.lock().unwrap().push(r.into_inner());
            Ok(tonic::Response::new(pb::UpdateGatewayResponse::default()))
        }
    }

    /// Serves `fake` on a socket in `dir`; its `unix:` target.
    fn serve(fake: &std::sync::Arc<FakeController>, dir: &std::path::Path) -> String {
        let sock = dir.join("controller.sock");
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(tokio::net::UnixListener::bind(&sock).unwrap());
        let svc = weft_proto::v1::agent_service_server::AgentServiceServer::from_arc(fake.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(incoming),
        );
        format!("unix:{}", sock.display())
    }

    fn config(dir: &std::path::Path, endpoint: Option<&str>) -> AgentConfig {
        AgentConfig {
            controllers: vec![],
            token: None,
            ca_fingerprint: None,
            ca_file: None,
            state_dir: dir.to_path_buf(),
            name: "n1".into(),
            dry_run: true,
            resync_interval: Duration::ZERO,
            teardown: false,
            underlay_ip: None,
            metrics_listen: None,
            log_format: Default::default(),
            endpoint: endpoint.map(str::to_string),
            probe: Default::default(),
            workload_bridge: None,
            wireguard: None,
            lan_address: None,
            dns: None,
        }
    }

    /// One session of an agent holding `desired` with `fake` at `target`.
    async fn one_session(
        target: &str,
        cfg: &AgentConfig,
        gateway_key: Option<&weft_types::WgKey>,
        desired: &mut Desired,
        applier: &mut dyn Applier,
    ) -> End {
        let creds = Credentials {
            key_pem: String::new(),
            cert_pem: String::new(),
            ca_pem: String::new(),
            received: SystemTime::now(),
            not_after: SystemTime::now() + Duration::from_secs(3600),
        };
        let (_tx, mut rx) = watch::channel(creds);
        let file = StateFile::new(&cfg.state_dir);
        let s = Session {
            target,
            cfg,
            gateway_key,
            creds: &mut rx,
            desired,
            file: &file,
            applier,
            dns: None,
        };
        tokio::time::timeout(Duration::from_secs(10), session(s))
            .await
            .expect("the session ends by itself")
    }

    fn message(revision: i64, kind: pb::watch_response::Kind) -> Result<pb::WatchResponse, tonic::Status> {
        Ok(pb::WatchResponse {
            revision,
            kind: Some(kind),
        })
    }

    /// A session applies what the controller streams, reports what it
    /// applied, and ends (transient: retried) when the controller ends the
    /// stream; the next session resumes from the revision and objects held,
    /// and a gateway announces its key and endpoint at each session.
    #[tokio::test]
    async fn a_session_applies_the_stream_reports_it_and_the_next_one_resumes() {
        use pb::watch_response::Kind;
        let dir = tempfile::tempdir().unwrap();
        let fake = std::sync::Arc::new(FakeController::default());
        let target = serve(&fake, dir.path());
        *fake.script.lock().unwrap() = vec![
            message(
                3,
                Kind::Snapshot(pb::Snapshot {
                    objects: vec![object("a"), object("b")],
                }),
            ),
            message(
                4,
                Kind::Delta(pb::Delta {
                    upserts: vec![object("c")],
                    deletes: vec!["a".into()],
                }),
            ),
        ];
        let cfg = config(dir.path(), Some("192.0.2.10:51820"));
        let (mut desired, mut seen) = (Desired::default(), Seen::default());
        let key = weft_types::WgKey::from_bytes([1; 32]);
        let end = one_session(&target, &cfg, Some(&key), &mut desired, &mut seen).await;
        assert!(
            matches!(&end, End::Transient(e) if e.to_string().contains("ended the stream")),
            "{end:?}"
        );
        assert_eq!(desired.revision, 4);
        assert_eq!(seen.0.last().unwrap().1, ["b", "c"]);
        assert_eq!(
            fake.reports.lock().unwrap().last().map(|r| r.applied_revision),
            Some(4),
            "the last report says what was applied"
        );
        assert_eq!(StateFile::new(dir.path()).load().unwrap(), Some(desired.clone()));
        let u = fake.updates.lock().unwrap().clone();
        assert_eq!(
            (u[0].public_key.as_str(), u[0].endpoint.as_str()),
            ("AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=", "192.0.2.10:51820")
        );

        // Reconnected: it asks for what follows revision 4 and names what
        // it holds, so the controller sends only the difference.
        let end = one_session(&target, &cfg, Some(&key), &mut desired, &mut seen).await;
        assert!(matches!(end, End::Transient(_)), "{end:?}");
        let w = fake.watches.lock().unwrap().clone();
        assert_eq!((w[0].last_revision, w[0].known.len()), (0, 0));
        assert_eq!(w[1].last_revision, 4);
        assert_eq!(w[1].known.len(), 2);
        assert_eq!(
            fake.updates.lock().unwrap().len(),
            2,
            "the key is announced each session"
        );
    }

    /// A session ends as what the controller answered: a removal, a
    /// refusal, a controller that cannot be reached, or any other error
    /// (the run loop tears down, keeps forwarding and asks slowly, moves to
    /// the next replica, or backs off on each). The session itself drops
    /// and applies nothing.
    #[tokio::test]
    async fn a_removal_a_refusal_an_unreachable_controller_and_an_error_end_a_session_apart() {
        let dir = tempfile::tempdir().unwrap();
        let fake = std::sync::Arc::new(FakeController::default());
        let target = serve(&fake, dir.path());
        let cfg = config(dir.path(), None);
        let mut desired = Desired {
            revision: 7,
            ..Default::default()
        };
        let mut seen = Seen::default();
        let mut removed = tonic::Status::unauthenticated("removed by the admin");
        removed
            .metadata_mut()
            .insert(weft_proto::REMOVED, tonic::metadata::MetadataValue::from_static("1"));
        let cases = [
            (removed, "removed"),
            (tonic::Status::unauthenticated("certificate revoked"), "refused"),
            (tonic::Status::permission_denied("not a node"), "refused"),
            (tonic::Status::unavailable("the store is down"), "transient"),
        ];
        for (status, want) in cases {
            *fake.refuse.lock().unwrap() = Some(status);
            let end = one_session(&target, &cfg, None, &mut desired, &mut seen).await;
            let got = match end {
                End::Removed(_) => "removed",
                End::Refused(_) => "refused",
                End::Transient(_) => "transient",
                End::Lost(_) => "lost",
            };
            assert_eq!(got, want);
        }
        let gone = format!("unix:{}", dir.path().join("nobody.sock").display());
        let end = one_session(&gone, &cfg, None, &mut desired, &mut seen).await;
        assert!(matches!(end, End::Lost(_)), "{end:?}");
        assert_eq!(desired.revision, 7, "nothing held was dropped");
        assert!(seen.0.is_empty(), "nothing was applied");
    }
}
