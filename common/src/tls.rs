//! The one gRPC connector of weft's clients (agents, controllers dialing
//! peers, weftctl): `unix:PATH` (a controller's local admin socket), or
//! `https://HOST:PORT` trusting the server by a pinned CA fingerprint (first
//! contact, before the client has the CA file) or by a CA file, presenting
//! the client's certificate when it has one.

use std::sync::Arc;

use hyper_util::rt::TokioIo;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tonic::transport::{Channel, Endpoint, Uri};

pub use crate::fingerprint;

/// Accepts the server when its chain contains a CA certificate with the
/// pinned fingerprint and the leaf verifies against that CA (names included).
#[derive(Debug)]
struct PinnedCa {
    fingerprint: String,
    /// When set, the server's certificate must carry identity weft://<site>/…
    site: Option<String>,
    provider: Arc<CryptoProvider>,
}

/// The site in a certificate's weft identity (URI SAN weft://<site>/…).
pub fn site_of(der: &[u8]) -> Option<String> {
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
    let (_, cert) = X509Certificate::from_der(der).ok()?;
    let san = cert.subject_alternative_name().ok().flatten()?;
    san.value.general_names.iter().find_map(|g| match g {
        GeneralName::URI(u) => u
            .strip_prefix("weft://")
            .and_then(|r| r.split('/').next())
            .map(str::to_string),
        _ => None,
    })
}

impl ServerCertVerifier for PinnedCa {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(ca) = intermediates.iter().find(|c| fingerprint(c) == self.fingerprint) else {
            return Err(rustls::Error::General(format!(
                "the controller's CA does not match the pinned fingerprint {} (--ca-fingerprint, or the peering \
                 token); check the fingerprint (`weftctl site`) and the address",
                self.fingerprint
            )));
        };
        if let Some(want) = &self.site {
            let got = site_of(end_entity).unwrap_or_default();
            if &got != want {
                return Err(rustls::Error::General(format!(
                    "the controller there is site {got:?}, not {want:?} as the token says"
                )));
            }
        }
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(ca.clone().into_owned())
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        let inner = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), self.provider.clone())
            .build()
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        let rest: Vec<CertificateDer<'_>> = intermediates.iter().filter(|c| *c != ca).cloned().collect();
        inner.verify_server_cert(end_entity, &rest, server_name, ocsp, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

/// How the agent trusts the controller.
#[derive(Clone, Debug)]
pub enum Trust {
    Fingerprint(String),
    /// A pinned CA fingerprint and the site the server must be.
    FingerprintForSite(String, String),
    CaPem(String),
}

/// How long a TCP and TLS handshake may take.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// How often each side of a connection pings the other (HTTP/2 PING, also
/// while no call is open), and how long it waits for the answer before it
/// closes the connection: a peer that stops answering (its host lost power,
/// its process stopped, a link in between dropped) is found within the sum
/// of the two, [`LIVENESS`] (2 s) by default, and every stream and call on
/// the connection fails at once, so the caller reconnects (an agent to the
/// next controller replica). A TCP connection only finds out after minutes
/// of retransmissions.
/// `WEFT_LIVENESS=DURATION` (e.g. `4s`, at least 200ms) sets the bound for a
/// slower network; both halves are half of it.
pub fn keepalive() -> (std::time::Duration, std::time::Duration) {
    static K: std::sync::OnceLock<std::time::Duration> = std::sync::OnceLock::new();
    let total = *K.get_or_init(|| {
        std::env::var("WEFT_LIVENESS")
            .ok()
            .and_then(|v| humantime::parse_duration(v.trim()).ok())
            .filter(|d| *d >= std::time::Duration::from_millis(200))
            .unwrap_or(LIVENESS)
    });
    (total / 2, total / 2)
}

/// The default bound within which a silent peer is found dead.
pub const LIVENESS: std::time::Duration = std::time::Duration::from_secs(2);

/// Why a connection could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The address or the TLS material is wrong: retrying will not help.
    #[error("{0}")]
    BadTarget(String),
    /// Nothing answered, or the TLS handshake failed.
    #[error("cannot connect to {target}: {cause}")]
    Unreachable { target: String, cause: String },
}

/// `e` and its sources, joined by ": " (each new text once).
pub fn error_chain(e: &dyn std::error::Error) -> String {
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

/// Connects to `target`: `unix:PATH` (`trust` and `client` unused: the
/// socket's file mode is the access control), or `https://host:port` with
/// `trust`, presenting `client` (cert PEM, key PEM) when given.
pub async fn connect(target: &str, trust: &Trust, client: Option<(&str, &str)>) -> Result<Channel, ConnectError> {
    let unreachable = |cause: String| ConnectError::Unreachable {
        target: target.to_string(),
        cause,
    };
    if let Some(path) = target.strip_prefix("unix://").or_else(|| target.strip_prefix("unix:")) {
        let path = std::path::PathBuf::from(path);
        if !path.exists() {
            return Err(unreachable(format!("{} does not exist", path.display())));
        }
        // The URI is a placeholder: the connector ignores it.
        return Endpoint::from_static("http://[::1]:1")
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
            }))
            .await
            .map_err(|e| unreachable(error_chain(&e)));
    }
    if !target.starts_with("https://") {
        return Err(ConnectError::BadTarget(format!(
            "{target:?} is not a controller address; use unix:/path/to/admin.sock or https://host:port"
        )));
    }
    let bad = |e: &dyn std::fmt::Display| ConnectError::BadTarget(e.to_string());
    let connector = tls_connector(trust, client).map_err(|e| bad(&format!("{e:#}")))?;
    let uri: Uri = target.parse().map_err(|_| bad(&format!("{target:?} is not a URL")))?;
    let host = uri
        .host()
        .ok_or_else(|| bad(&format!("{target:?} has no host")))?
        .trim_matches(['[', ']'])
        .to_string();
    let port = uri.port_u16().unwrap_or(443);
    let server_name = ServerName::try_from(host.clone()).map_err(|_| bad(&format!("invalid host name {host:?}")))?;
    // tonic must not do TLS itself: give it an http URI and a TLS connector.
    let uri_host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.clone()
    };
    let ep = Endpoint::from_shared(format!("http://{uri_host}:{port}"))
        .map_err(|e| bad(&e))?
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(keepalive().0)
        .keep_alive_timeout(keepalive().1)
        .keep_alive_while_idle(true);
    ep.connect_with_connector(tower::service_fn(move |_: Uri| {
        let (connector, host, server_name) = (connector.clone(), host.clone(), server_name.clone());
        async move {
            let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            let tls = connector.connect(server_name, tcp).await?;
            Ok::<_, std::io::Error>(TokioIo::new(tls))
        }
    }))
    .await
    .map_err(|e| unreachable(error_chain(&e)))
}

/// The rustls client side for `trust` and `client`.
fn tls_connector(trust: &Trust, client: Option<(&str, &str)>) -> anyhow::Result<tokio_rustls::TlsConnector> {
    use anyhow::Context;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder =
        rustls::ClientConfig::builder_with_provider(provider.clone()).with_safe_default_protocol_versions()?;
    let builder = match trust {
        Trust::Fingerprint(fp) => builder.dangerous().with_custom_certificate_verifier(Arc::new(PinnedCa {
            fingerprint: fp.clone(),
            site: None,
            provider,
        })),
        Trust::FingerprintForSite(fp, site) => {
            builder.dangerous().with_custom_certificate_verifier(Arc::new(PinnedCa {
                fingerprint: fp.clone(),
                site: Some(site.clone()),
                provider,
            }))
        }
        Trust::CaPem(pem) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                roots.add(c.context("the CA file is not PEM")?)?;
            }
            builder.with_root_certificates(roots)
        }
    };
    let mut cfg = match client {
        Some((cert, key)) => {
            let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert.as_bytes())
                .collect::<Result<_, _>>()
                .context("the client certificate is not PEM")?;
            let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).context("the client key is not PEM")?;
            builder.with_client_auth_cert(chain, key)?
        }
        None => builder.with_no_client_auth(),
    };
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(tokio_rustls::TlsConnector::from(Arc::new(cfg)))
}

/// How many CAs a site may tell its agents or peers to trust for it (two
/// during a rotation of its CA).
pub const MAX_CAS: usize = 4;

/// The CA certificates in `pem`, as PEM again once each is checked to be
/// a CA certificate (1 to [`MAX_CAS`]; nothing else of `pem` is kept);
/// `None` for an empty `pem`.
pub fn checked_cas(pem: &str) -> anyhow::Result<Option<String>> {
    use anyhow::Context;
    use x509_parser::prelude::{FromDer, X509Certificate};
    if pem.trim().is_empty() {
        return Ok(None);
    }
    let cas = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .context("the CAs are not PEM certificates")?;
    if cas.is_empty() || cas.len() > MAX_CAS {
        anyhow::bail!("{} CA certificates were sent; 1 to {MAX_CAS} are taken", cas.len());
    }
    let mut out = String::new();
    for (i, der) in cas.iter().enumerate() {
        let (_, c) = X509Certificate::from_der(der).with_context(|| format!("CA certificate {i} does not parse"))?;
        if !c.is_ca() {
            anyhow::bail!("certificate {i} is not a CA certificate");
        }
        out.push_str(&crate::pem_of(der));
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::checked_cas;

    #[test]
    fn only_ca_certificates_are_taken_as_cas() {
        let ca = |cn: &str| {
            let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            p.distinguished_name.push(rcgen::DnType::CommonName, cn);
            p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            p.self_signed(&rcgen::KeyPair::generate().unwrap()).unwrap().pem()
        };
        let leaf = rcgen::generate_simple_self_signed(vec!["x".into()]).unwrap().cert.pem();
        assert_eq!(checked_cas("  ").unwrap(), None);
        let two = ca("a") + &ca("b");
        let got = checked_cas(&format!("junk before\n{two}")).unwrap().unwrap();
        assert_eq!(got.matches("BEGIN CERTIFICATE").count(), 2);
        assert!(!got.contains("junk"));
        let e = checked_cas(&(ca("a") + &leaf)).unwrap_err().to_string();
        assert!(e.contains("certificate 1 is not a CA"), "{e}");
        let e = checked_cas(&(0..5).map(|i| ca(&i.to_string())).collect::<String>())
            .unwrap_err()
            .to_string();
        assert!(e.contains("5 CA certificates"), "{e}");
        assert!(checked_cas("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n").is_err());
    }

    #[test]
    fn the_liveness_bound_is_split_between_ping_and_wait() {
        let (ping, wait) = super::keepalive();
        assert_eq!(ping + wait, super::LIVENESS);
        assert_eq!(ping, wait);
    }
}
