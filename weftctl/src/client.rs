//! Connecting to a controller: `unix:PATH` (the local admin socket) or
//! `https://HOST:PORT` with the admin bundle, through weft's one connector.

use std::path::{Path, PathBuf};

use tonic::transport::Channel;
use weft_common::tls::{ConnectError as Failed, Trust};

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

fn read(what: &str, p: &Path) -> Result<String, ConnectError> {
    std::fs::read_to_string(p)
        .map_err(|e| ConnectError::BadTarget(format!("cannot read the {what} {}: {e}", p.display())))
}

pub async fn connect(target: &str, tls: &ClientTls) -> Result<Channel, ConnectError> {
    let (trust, client) = if target.starts_with("https://") {
        let (Some(ca), Some(cert), Some(key)) = (&tls.ca_file, &tls.cert_file, &tls.key_file) else {
            return Err(ConnectError::BadTarget(format!(
                "{target} needs the admin bundle: --ca-file, --cert and --key (ca.pem, admin.pem and admin.key \
                 under the controller's <data-dir>/pki/)"
            )));
        };
        let pem = (read("client certificate", cert)?, read("client key", key)?);
        (Trust::CaPem(read("CA certificate", ca)?), Some(pem))
    } else {
        (Trust::CaPem(String::new()), None)
    };
    let client = client.as_ref().map(|(c, k)| (c.as_str(), k.as_str()));
    weft_common::tls::connect(target, &trust, client)
        .await
        .map_err(|e| match e {
            Failed::BadTarget(m) => ConnectError::BadTarget(m),
            Failed::Unreachable { target, cause } => ConnectError::Unreachable { target, cause },
        })
}
