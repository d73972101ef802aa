//! Wiring: open the store, initialise the site, and serve the gRPC services
//! on the local admin socket (plaintext, mode 0600) and the TCP listener
//! (TLS with a client certificate from the site CA). Both listeners carry
//! server reflection (v1 and v1alpha) and `grpc.health.v1`.

use std::future::Future;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use tokio::net::{TcpListener, UnixListener};
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
use weft_proto::v1::admin_service_server::AdminServiceServer;

use crate::config::{ControllerConfig, StoreConfig};
use crate::grpc::AdminApi;
use crate::pki;
use crate::state::State;
use crate::store::Store;
use crate::store::embedded::EmbeddedStore;
use crate::store::etcd::{EtcdStore, EtcdTls};

/// Largest request the controller decodes (the gRPC default is 4 MiB).
const MAX_MESSAGE: usize = 4 * 1024 * 1024;
/// How long open calls may take to finish after a shutdown signal.
const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

pub async fn open_store(cfg: &ControllerConfig) -> anyhow::Result<Arc<dyn Store>> {
    Ok(match &cfg.store {
        StoreConfig::Embedded { path } => Arc::new(
            EmbeddedStore::open(path)
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
    let listener =
        UnixListener::bind(&tmp).with_context(|| format!("cannot bind {}", tmp.display()))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot bind {}", path.display()))?;
    Ok(listener)
}

/// A running controller's addresses, for callers that bind port 0.
#[derive(Debug, Clone)]
pub struct Bound {
    pub admin_socket: PathBuf,
    pub listen: std::net::SocketAddr,
}

/// Runs the controller until `shutdown` resolves. `on_bound` is told the
/// actual addresses once both listeners accept connections.
pub async fn run(
    cfg: ControllerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
    on_bound: impl FnOnce(&Bound),
) -> anyhow::Result<()> {
    std::fs::create_dir_all(&cfg.data_dir).with_context(|| {
        format!(
            "cannot create the data directory {}",
            cfg.data_dir.display()
        )
    })?;
    let store = open_store(&cfg).await?;
    let state = State::new(store.clone(), &cfg.site.id);
    state
        .init_site(&cfg.site)
        .await
        .context("cannot initialise the site in the store")?;

    let pki = pki::ensure(
        &cfg.data_dir.join("pki"),
        &cfg.site.id,
        &pki::names_for(cfg.listen.ip(), &cfg.tls_sans),
    )?;
    let tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(&pki.cert_pem, &pki.key_pem))
        .client_ca_root(Certificate::from_pem(&pki.ca_pem));

    let admin = AdminServiceServer::new(AdminApi::new(state.clone()))
        .max_decoding_message_size(MAX_MESSAGE);
    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_serving::<AdminServiceServer<AdminApi>>().await;
    let reflection = || -> anyhow::Result<_> {
        let b = || {
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(weft_proto::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        };
        Ok((b().build_v1()?, b().build_v1alpha()?))
    };
    let (refl_v1, refl_v1a) = reflection()?;
    let (refl_v1_tcp, refl_v1a_tcp) = reflection()?;

    let unix = bind_admin_socket(&cfg.admin_socket).await?;
    let tcp = TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    let bound = Bound {
        admin_socket: cfg.admin_socket.clone(),
        listen: tcp.local_addr()?,
    };

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let unix_server = Server::builder()
        .add_service(admin.clone())
        .add_service(health_svc.clone())
        .add_service(refl_v1)
        .add_service(refl_v1a)
        .serve_with_incoming_shutdown(UnixListenerStream::new(unix), stopped(stop_rx.clone()));
    let tcp_server = Server::builder()
        .tls_config(tls)?
        .add_service(admin)
        .add_service(health_svc)
        .add_service(refl_v1_tcp)
        .add_service(refl_v1a_tcp)
        .serve_with_incoming_shutdown(TcpListenerStream::new(tcp), stopped(stop_rx));

    tracing::info!(
        site = %cfg.site.id,
        store = store.backend(),
        admin_socket = %bound.admin_socket.display(),
        listen = %bound.listen,
        pki = %pki.dir.display(),
        "controller serving"
    );
    on_bound(&bound);
    let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
        let _ = stopping_tx.send(());
    });
    let serve = async { tokio::try_join!(unix_server, tcp_server) };
    tokio::pin!(serve);
    let result = tokio::select! {
        r = &mut serve => r,
        _ = async {
            let _ = stopping_rx.await;
            tokio::time::sleep(DRAIN_TIMEOUT).await;
        } => {
            tracing::warn!("open calls did not finish within {DRAIN_TIMEOUT:?}; closing them");
            Ok(((), ()))
        }
    };
    let _ = std::fs::remove_file(&cfg.admin_socket);
    result.context("a gRPC listener failed")?;
    tracing::info!("controller stopped");
    Ok(())
}
