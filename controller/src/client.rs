//! Connecting to a controller: `unix:PATH` (the local admin socket) or
//! `https://HOST:PORT` with a client certificate bundle.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity, Uri};

/// PEM files for `https://` targets.
#[derive(Debug, Clone, Default)]
pub struct ClientTls {
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("{0}")]
    BadTarget(String),
    #[error(
        "cannot reach the controller at {target}: {cause}. Is weft-controller running there? Set --controller or WEFT_CONTROLLER"
    )]
    Unreachable { target: String, cause: String },
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = c.source();
    }
    s
}

fn read(what: &str, p: &Path) -> Result<Vec<u8>, ConnectError> {
    std::fs::read(p).map_err(|e| ConnectError::BadTarget(format!("cannot read the {what} {}: {e}", p.display())))
}

pub async fn connect(target: &str, tls: &ClientTls) -> Result<Channel, ConnectError> {
    let unreachable = |e: &dyn std::error::Error| ConnectError::Unreachable {
        target: target.to_string(),
        cause: chain(e),
    };
    if let Some(path) = target.strip_prefix("unix://").or_else(|| target.strip_prefix("unix:")) {
        let path = PathBuf::from(path);
        if !path.exists() {
            return Err(ConnectError::Unreachable {
                target: target.to_string(),
                cause: format!("{} does not exist", path.display()),
            });
        }
        // The URI is a placeholder: the connector ignores it.
        return Endpoint::from_static("http://[::1]:1")
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
            }))
            .await
            .map_err(|e| unreachable(&e));
    }
    if target.starts_with("https://") {
        let (Some(ca), Some(cert), Some(key)) = (&tls.ca_file, &tls.cert_file, &tls.key_file) else {
            return Err(ConnectError::BadTarget(format!(
                "{target} needs the admin bundle: --ca-file, --cert and --key (ca.pem, admin.pem and admin.key \
                 under the controller's <data-dir>/pki/)"
            )));
        };
        let cfg = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read("CA certificate", ca)?))
            .identity(Identity::from_pem(
                read("client certificate", cert)?,
                read("client key", key)?,
            ));
        let ep = Endpoint::from_shared(target.to_string())
            .map_err(|e| ConnectError::BadTarget(format!("{target:?} is not a valid URL: {e}")))?
            .tls_config(cfg)
            .map_err(|e| ConnectError::BadTarget(format!("bad TLS settings: {}", chain(&e))))?
            .connect_timeout(std::time::Duration::from_secs(5));
        return ep.connect().await.map_err(|e| unreachable(&e));
    }
    Err(ConnectError::BadTarget(format!(
        "{target:?} is not a controller address; use unix:/path/to/admin.sock or https://host:port"
    )))
}
