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
    type WatchStream = tokio_stream::Iter<std::vec::IntoIter<Result<weft_proto::wire::WatchResponse, tonic::Status>>>;

    async fn register(&self, _: tonic::Request<pb::RegisterRequest>) -> Answer<pb::RegisterResponse> {
        Err(tonic::Status::unimplemented("not in this fake"))
    }
    async fn renew(&self, _: tonic::Request<pb::RenewRequest>) -> Answer<pb::RenewResponse> {
        Err(tonic::Status::unimplemented("not in this fake"))
    }
    async fn get_assignment(&self, _: tonic::Request<pb::GetAssignmentRequest>) -> Answer<pb::Assignment> {
        Err(tonic::Status::unimplemented("not in this fake"))
    }
    async fn get_trust(&self, _: tonic::Request<pb::GetTrustRequest>) -> Answer<pb::Trust> {
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
    async fn update_gateway(&self, r: tonic::Request<pb::UpdateGatewayRequest>) -> Answer<pb::UpdateGatewayResponse> {
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
        failback_after: Duration::from_secs(15),
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
        connected: &tokio::sync::watch::channel(String::new()).0,
        preferred: None,
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
            End::Preferred => "preferred",
        };
        assert_eq!(got, want);
    }
    let gone = format!("unix:{}", dir.path().join("nobody.sock").display());
    let end = one_session(&gone, &cfg, None, &mut desired, &mut seen).await;
    assert!(matches!(end, End::Lost(_)), "{end:?}");
    assert_eq!(desired.revision, 7, "nothing held was dropped");
    assert!(seen.0.is_empty(), "nothing was applied");
}
