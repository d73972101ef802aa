//! Wiring: open the store, initialise the site and its PKI, and serve the
//! gRPC services on the local admin socket (plaintext, mode 0600) and the TCP
//! listener (TLS; every call but enrollment authenticated by certificate, see
//! [`crate::auth`]). Both listeners carry server reflection (v1 and v1alpha)
//! and `grpc.health.v1`.

use std::future::Future;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::net::{TcpListener, UnixListener};
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Server;
use weft_proto::v1::admin_service_server::AdminServiceServer;
use weft_proto::v1::agent_service_server::AgentServiceServer;
use weft_proto::v1::federation_service_server::FederationServiceServer;

use crate::admission::{Admission, Conn, Limits};
use crate::auth::{Authenticator, Role};
use crate::config::{ControllerConfig, StoreConfig};
use crate::federation::{Federation, FederationApi};
use crate::grpc::AdminApi;
use crate::grpc::agent::AgentApi;
use crate::hub::Hub;
use crate::pki::{self, ServerPki};
use crate::state::State;
use crate::store::Store;
use crate::store::embedded::EmbeddedStore;
use crate::store::etcd::{EtcdStore, EtcdTls};
use weft_common::task::{OnFailure, supervise};

/// Largest request the controller decodes (the gRPC default is 4 MiB).
const MAX_MESSAGE: usize = 4 * 1024 * 1024;
/// How long open calls may take to finish after a shutdown signal.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2 streams one TCP connection may have open at once.
const MAX_STREAMS_PER_CONNECTION: u32 = 64;
/// How often the controller pings a client connection that has been quiet,
/// and how long it waits for the answer: only to free what a dead client's
/// connection holds. Liveness is not decided here: an agent is live while
/// its reports come within its TTL (`hub::expire_silent`), and clients find
/// a dead controller with their own 1 s + 1 s pings. Pinging 10,000 agents
/// every second from here too cost CPU and, under load, dropped slow but
/// live agents.
const CLIENT_PING: Duration = Duration::from_secs(10);
/// How long a call may take to answer (for streams: to start).
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
const ALL_ROLES: &[Role] = &[Role::Admin, Role::Node, Role::Gateway, Role::Site, Role::Controller];

mod incoming;
mod memory;
mod revocations;

use incoming::{known_by, tls_config, tls_incoming};

pub async fn open_store(cfg: &ControllerConfig) -> anyhow::Result<Arc<dyn Store>> {
    Ok(match &cfg.store {
        StoreConfig::Embedded { path, history } => Arc::new(
            EmbeddedStore::open_with_history(path, *history)
                .with_context(|| format!("cannot open the embedded store {}", path.display()))?,
        ),
        StoreConfig::Etcd { endpoints, tls } => {
            let tls: Option<EtcdTls> = tls.as_ref().map(Into::into);
            Arc::new(
                EtcdStore::connect(endpoints, tls.as_ref())
                    .await
                    .with_context(|| format!("cannot reach etcd at {}", endpoints.join(",")))?,
            )
        }
    })
}

/// Creates (or loads) the site PKI for `cfg`.
pub fn ensure_pki(cfg: &ControllerConfig) -> anyhow::Result<ServerPki> {
    std::fs::create_dir_all(&cfg.data_dir)
        .with_context(|| format!("cannot create the data directory {}", cfg.data_dir.display()))?;
    pki::ensure(
        &cfg.data_dir.join("pki"),
        &cfg.site.id,
        &pki::names_for(cfg.listen.ip(), &cfg.tls_sans, &cfg.advertise),
    )
}

/// Binds the admin socket without a window in which it is reachable with
/// looser permissions: bind under a temporary name, chmod, rename.
async fn bind_admin_socket(path: &Path) -> anyhow::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            bail!(
                "{} exists and is not a socket; remove it or choose another --admin-socket",
                path.display()
            );
        }
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            bail!(
                "another process is serving on {}; is a controller already running?",
                path.display()
            );
        }
        std::fs::remove_file(path)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp).with_context(|| format!("cannot bind {}", tmp.display()))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot bind {}", path.display()))?;
    Ok(listener)
}

/// Revokes the whole identity of each agent a call came from with a
/// certificate a renewal replaced (told by the authenticator): two hosts
/// hold it.
async fn record_conflicts(state: State, auth: Arc<Authenticator>) {
    let (tx, mut rx) = tokio::sync::mpsc::channel(64);
    auth.on_superseded(tx);
    while let Some((id, issued_at_ms)) = rx.recv().await {
        let role = match id.role {
            crate::auth::Role::Node => crate::domain::AgentRole::Node,
            crate::auth::Role::Gateway => crate::domain::AgentRole::Gateway,
            _ => continue,
        };
        if let Err(e) = state.record_conflict(role, &id.name, &id.serial, issued_at_ms).await {
            tracing::error!(agent = %id, error = %e, "cannot record an identity conflict; the next call from the copy tries again");
        }
    }
}

/// A running controller's addresses, for callers that bind port 0.
#[derive(Debug, Clone)]
pub struct Bound {
    pub admin_socket: PathBuf,
    pub listen: std::net::SocketAddr,
}

/// When a certificate (DER) expires, in ms since the Unix epoch.
fn not_after_ms(der: &[u8]) -> Option<u64> {
    use x509_parser::prelude::FromDer;
    x509_parser::certificate::X509Certificate::from_der(der)
        .ok()
        .map(|(_, c)| c.validity().not_after.timestamp().max(0) as u64 * 1000)
}

/// The controller's background work, each task supervised (restarted
/// after a failure, with the reason logged).
struct Background {
    revocations: tokio::task::JoinHandle<()>,
    conflicts: tokio::task::JoinHandle<()>,
    chooser: tokio::task::JoinHandle<()>,
    peer_sync: tokio::task::JoinHandle<()>,
    relays: tokio::task::JoinHandle<()>,
    trim: tokio::task::JoinHandle<()>,
    /// The endpoint discovery reflector (UDP on the gRPC address).
    reflector: Option<crate::reflector::Reflector>,
}

impl Background {
    fn start(
        state: &State,
        auth: &Arc<Authenticator>,
        hub: &Arc<Hub>,
        fed: &Arc<Federation>,
        leader: tokio::sync::watch::Receiver<bool>,
    ) -> Background {
        let conflicts = tokio::spawn(record_conflicts(state.clone(), auth.clone()));
        let (state, auth) = (state.clone(), auth.clone());
        let revocations = supervise("revocations", OnFailure::Restart, move || {
            let (state, auth) = (state.clone(), auth.clone());
            async move {
                revocations::follow(state, auth, revocations::PRUNED_EVERY).await;
                Ok(())
            }
        });
        let (hub, lead) = (hub.clone(), leader.clone());
        let chooser = supervise("active-gateway", OnFailure::Restart, move || {
            let (hub, leader) = (hub.clone(), lead.clone());
            async move {
                crate::hub::choose_active_gateway(hub, leader).await;
                Ok(())
            }
        });
        let (fed2, lead2) = (fed.clone(), leader.clone());
        let relays = supervise("relays", OnFailure::Restart, move || {
            let (fed, leader) = (fed2.clone(), lead2.clone());
            async move {
                crate::federation::relay::keep_relays(fed, leader).await;
                Ok(())
            }
        });
        let fed = fed.clone();
        let peer_sync = supervise("peer-sync", OnFailure::Restart, move || {
            let (fed, leader) = (fed.clone(), leader.clone());
            async move {
                crate::federation::sync_peers(fed, leader).await;
                Ok(())
            }
        });
        Background {
            revocations,
            conflicts,
            chooser,
            peer_sync,
            relays,
            trim: tokio::spawn(memory::give_back(memory::TRIMMED_EVERY)),
            reflector: None,
        }
    }

    fn stop(self) {
        self.revocations.abort();
        self.conflicts.abort();
        self.peer_sync.abort();
        self.relays.abort();
        self.trim.abort();
        drop(self.reflector);
        // Ends the campaign too (it stops once nobody listens), which gives
        // up the leadership at once instead of at the end of its lease.
        self.chooser.abort();
    }
}

/// Runs the controller until `shutdown` resolves. `on_bound` is told the
/// actual addresses once both listeners accept connections.
/// The site's state on `store`, checked against this controller's CA and
/// configuration, and the authenticator with the revocation list loaded.
async fn open_site(
    cfg: &ControllerConfig,
    pki: &ServerPki,
    store: Arc<dyn Store>,
) -> anyhow::Result<(State, Arc<Authenticator>)> {
    let state = State::new(store, &cfg.site.id);
    let marker = state.at(crate::state::layout::Key::Restoring);
    if state.store().get(&marker).await?.is_some() {
        bail!(
            "cannot start this controller: the store holds a restore that was cut short ({marker}); \
             run `weft-controller restore FILE` again with the same backup"
        );
    }
    // Replicas on one etcd must hold the same site CA.
    state
        .check_ca(&trusted_cas(&pki.ca), &pki.ca.retired)
        .await
        .context("cannot start this controller")?;
    state
        .init_site(&cfg.site)
        .await
        .context("cannot initialise the site in the store")?;
    // Certificates of a retired CA no longer hold their agents' names:
    // those agents enroll again (see `ca rotate --revoke-old`).
    let forgot = state
        .forget_retired_certs(&pki.ca.retired)
        .await
        .context("cannot forget the certificates of retired CAs")?;
    if !forgot.is_empty() {
        tracing::warn!(
            agents = ?forgot,
            "these agents held only certificates of a retired CA: enroll each again with a token made for it \
             (weftctl token create --role ROLE --name NAME, then the agent with --token and the new \
             --ca-fingerprint); each keeps its record and what it applied"
        );
    }
    let auth = Authenticator::new(&cfg.site.id, &pki.ca.trusted)?;
    let (revoked, _) = state.revoked().await.context("cannot read the revocation list")?;
    auth.set_revoked(&revoked);
    Ok((state, auth))
}

/// The fingerprints of the CAs `ca` trusts, the signing one first.
fn trusted_cas(ca: &pki::SiteCa) -> Vec<String> {
    ca.trusted.iter().map(|d| pki::fingerprint(d)).collect()
}

/// A TCP listener's server: a connection holds few streams (an agent: its
/// Watch and a Report; a peer: one Subscribe); a unary call that takes
/// longer than a minute is stuck (a peering dials each peer endpoint for at
/// most its deadline).
fn tcp_server() -> Server {
    Server::builder()
        .http2_keepalive_interval(Some(CLIENT_PING))
        .http2_keepalive_timeout(Some(CLIENT_PING))
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .timeout(CALL_TIMEOUT)
}

/// Resolves once `rx` says stop.
async fn stopped(mut rx: tokio::sync::watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// Serves until `shutdown`; then closes the agents' streams, stops the
/// listeners and gives open calls `DRAIN_TIMEOUT` to finish.
async fn serve_until(
    serve: impl Future<Output = Result<(), tonic::transport::Error>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    hub: Arc<Hub>,
    stop_tx: tokio::sync::watch::Sender<bool>,
) -> Result<(), tonic::transport::Error> {
    let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        shutdown.await;
        hub.close_all();
        let _ = stop_tx.send(true);
        let _ = stopping_tx.send(());
    });
    tokio::pin!(serve);
    tokio::select! {
        r = &mut serve => r,
        _ = async {
            let _ = stopping_rx.await;
            tokio::time::sleep(DRAIN_TIMEOUT).await;
        } => {
            tracing::warn!("open calls did not finish within {DRAIN_TIMEOUT:?}; closing them");
            Ok(())
        }
    }
}

/// What a controller serves from: its site's state and PKI, the hub,
/// federation, the bound listeners and the background tasks.
struct Prepared {
    state: State,
    auth: Arc<Authenticator>,
    hub: Arc<Hub>,
    fed: Arc<Federation>,
    ca: Arc<pki::SiteCa>,
    fingerprint: String,
    acceptor: TlsAcceptor,
    unix: UnixListener,
    tcp: TcpListener,
    bound: Bound,
    ca_not_after_ms: Option<u64>,
    background: Background,
    pki_dir: PathBuf,
    store_backend: &'static str,
}

async fn prepare(cfg: &ControllerConfig) -> anyhow::Result<Prepared> {
    let pki = ensure_pki(cfg)?;
    let metrics = crate::metrics::ControllerMetrics::new();
    let store = metrics.timed(open_store(cfg).await?);
    let (state, auth) = open_site(cfg, &pki, store.clone()).await?;
    let acceptor = TlsAcceptor::from(tls_config(&pki, &auth)?);
    let fingerprint = pki.ca.fingerprint.clone();
    // (With the cross-certificate during a rotation: a peer that trusts
    // only the old CA verifies it.)
    let site_cert = pki.ca.issue_with_key(
        &pki::identity_uri(&cfg.site.id, "site", &cfg.site.id),
        &format!("weft site {}", cfg.site.id),
        365,
    )?;
    let ca_pem = pki.ca.pem.clone();
    let ca = Arc::new(pki.ca);
    let hub = Hub::start(state.clone(), cfg.agent_ttl, cfg.gateway_ttl)
        .await
        .context("cannot load the site model")?;

    let unix = bind_admin_socket(&cfg.admin_socket).await?;
    let tcp = TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    let bound = Bound {
        admin_socket: cfg.admin_socket.clone(),
        listen: tcp.local_addr()?,
    };
    let mut endpoints = cfg.advertise.clone();
    if endpoints.is_empty() && !bound.listen.ip().is_unspecified() {
        endpoints.push(bound.listen.to_string());
    }
    let fed = Arc::new(Federation {
        state: state.clone(),
        site_id: cfg.site.id.clone(),
        ca_pem,
        ca_fingerprint: fingerprint.clone(),
        site_cert,
        endpoints,
        hub: hub.clone(),
        grace: cfg.peer_grace,
        refused: Default::default(),
        punches: Default::default(),
    });
    let me = format!(
        "{}@{}",
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .unwrap_or_default()
            .trim(),
        cfg.listen
    );
    let leader = crate::leader::campaign(store.clone(), state.leader_key(), me);
    metrics.watch(hub.clone(), leader.clone());
    if let Some(addr) = cfg.metrics_listen {
        weft_common::obs::serve_metrics(addr, metrics.registry.clone())
            .await
            .with_context(|| format!("cannot serve metrics on {addr} (--metrics-listen)"))?;
    }
    let ca_not_after_ms = not_after_ms(&ca.der);
    let mut background = Background::start(&state, &auth, &hub, &fed, leader);
    // The reflector budgets apart the gateways the site's state knows;
    // it asks about once a second, and the set is made again only when
    // the model changed.
    let (model_of, mut last) = (Arc::downgrade(&hub), None::<Arc<crate::render::Model>>);
    background.reflector = crate::reflector::start(
        bound.listen,
        Box::new(move || {
            let model = model_of.upgrade()?.model();
            if last.as_ref().is_some_and(|l| Arc::ptr_eq(l, &model)) {
                return None;
            }
            let known = Arc::new(crate::reflector::known(&model));
            last = Some(model);
            Some(known)
        }),
    );
    Ok(Prepared {
        state,
        auth,
        hub,
        fed,
        ca,
        fingerprint,
        acceptor,
        unix,
        tcp,
        bound,
        ca_not_after_ms,
        background,
        pki_dir: pki.dir.clone(),
        store_backend: store.backend(),
    })
}

pub async fn run(
    cfg: ControllerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
    on_bound: impl FnOnce(&Bound),
) -> anyhow::Result<()> {
    let Prepared {
        state,
        auth,
        hub,
        fed,
        ca,
        fingerprint,
        acceptor,
        unix,
        tcp,
        bound,
        ca_not_after_ms,
        background,
        pki_dir,
        store_backend,
    } = prepare(&cfg).await?;

    let admin = InterceptedService::new(
        AdminServiceServer::new(
            AdminApi::new(
                state.clone(),
                fingerprint.clone(),
                auth.clone(),
                hub.clone(),
                fed.clone(),
            )
            .with_ca_expiry(ca_not_after_ms)
            .with_cas(crate::ca::Cas::of(&ca))
            .with_pki(pki_dir, cfg.site.id.clone()),
        )
        .max_decoding_message_size(MAX_MESSAGE),
        auth.require(&[Role::Admin], "the admin API"),
    );
    let agent = InterceptedService::new(
        AgentServiceServer::new(AgentApi::new(
            state.clone(),
            ca,
            cfg.site.id.clone(),
            cfg.agent_cert_ttl,
            hub.clone(),
            auth.clone(),
        ))
        .max_decoding_message_size(MAX_MESSAGE),
        auth.optional(),
    );
    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_serving::<AdminServiceServer<AdminApi>>().await;
    health.set_serving::<AgentServiceServer<AgentApi>>().await;
    let health_svc = InterceptedService::new(health_svc, auth.require(ALL_ROLES, "the health service"));
    let reflection = || -> anyhow::Result<_> {
        let b = || {
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(weft_proto::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        };
        let guard = auth.require(ALL_ROLES, "server reflection");
        Ok((
            InterceptedService::new(b().build_v1()?, guard.clone()),
            InterceptedService::new(b().build_v1alpha()?, guard),
        ))
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let federation = FederationServiceServer::new(FederationApi::new(fed)).max_decoding_message_size(MAX_MESSAGE);
    // Every listener serves the same services; each call is authorized by
    // its interceptor.
    let routes = |mut server: Server| -> anyhow::Result<_> {
        let (refl_v1, refl_v1a) = reflection()?;
        Ok(server
            .add_service(federation.clone())
            .add_service(admin.clone())
            .add_service(agent.clone())
            .add_service(health_svc.clone())
            .add_service(refl_v1)
            .add_service(refl_v1a))
    };
    let unix_server = routes(Server::builder())?
        .serve_with_incoming_shutdown(UnixListenerStream::new(unix), stopped(stop_rx.clone()));
    let limits = Limits::default();
    let admission = Admission::new(limits);
    let shed_layer = crate::admission::Shed::layer(&admission);
    let incoming = tls_incoming(tcp, acceptor, admission, known_by(&auth, &hub));
    let certified_server =
        routes(tcp_server())?.serve_with_incoming_shutdown(incoming.certified, stopped(stop_rx.clone()));
    // Without a certificate: a GOAWAY when the lifetime is over (calls in
    // flight finish; the connection itself reads end-of-stream after the
    // grace, see `Conn`). (tonic's own max_connection_age_grace is not
    // used: with it, tonic waits out age and grace and then closes, with
    // no GOAWAY at all.)
    let anonymous_server = routes(tcp_server().max_connection_age(limits.anonymous_lifetime))?
        .serve_with_incoming_shutdown(incoming.anonymous, stopped(stop_rx.clone()));
    let shed_server = Server::builder()
        .max_connection_age(limits.shed_lifetime)
        .layer(shed_layer)
        .add_service(health_svc)
        .serve_with_incoming_shutdown(incoming.shed, stopped(stop_rx));
    tracing::info!(
        site = %cfg.site.id,
        store = store_backend,
        admin_socket = %bound.admin_socket.display(),
        listen = %bound.listen,
        ca_fingerprint = %fingerprint,
        "controller serving"
    );
    on_bound(&bound);
    let serve = async {
        tokio::try_join!(unix_server, certified_server, anonymous_server, shed_server)?;
        Ok::<_, tonic::transport::Error>(())
    };
    let result = serve_until(serve, shutdown, hub, stop_tx).await;
    background.stop();
    let _ = std::fs::remove_file(&cfg.admin_socket);
    result.context("a gRPC listener failed")?;
    tracing::info!("controller stopped");
    Ok(())
}
