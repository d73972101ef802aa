//! The TCP listener's accept path: TLS handshakes, and which connections
//! are known (a chain to the site CA or a recorded peer's) and so escape
//! the anonymous caps.

use super::*;

/// A TLS handshake that takes longer is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepted TLS connections waiting for the server to pick them up; bounds
/// memory under a connection burst (the accept loop waits when full).
const ACCEPT_QUEUE: usize = 128;

pub(super) fn tls_config(pki: &ServerPki, auth: &Authenticator) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let leaf = CertificateDer::from_pem_slice(pki.cert_pem.as_bytes()).context("server certificate")?;
    let key = PrivateKeyDer::from_pem_slice(pki.key_pem.as_bytes()).context("server key")?;
    // The chain includes the CA so an agent that pins the CA's fingerprint
    // (and has no CA file yet) can verify us; during a rotation, also the
    // new CA signed by the old one, for those that trust only the old.
    let mut chain = vec![leaf];
    for c in CertificateDer::pem_slice_iter(pki.ca.chain_pem().as_bytes()) {
        chain.push(c.context("the site CA chain")?);
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(auth.handshake_verifier())
        .with_single_cert(chain, key)?;
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(cfg))
}

/// Whether a handshake's client chain makes a known connection (see
/// [`Authenticator::is_known`]).
pub(super) type Known = Arc<dyn Fn(&[rustls::pki_types::CertificateDer<'static>]) -> bool + Send + Sync>;

/// The mTLS listener's connections, by kind: each kind has its own HTTP/2
/// server (and so its own connection lifetime).
pub(super) struct Incoming {
    /// Known: a certificate of the site's CA or a recorded peer's
    /// (checked again per call).
    pub(super) certified: ReceiverStream<Result<Conn, std::io::Error>>,
    /// Without one (or with one no trusted CA signed), within the caps:
    /// served for a lifetime, then a GOAWAY.
    pub(super) anonymous: ReceiverStream<Result<Conn, std::io::Error>>,
    /// Without one, over the caps: every call refused, a GOAWAY at once.
    pub(super) shed: ReceiverStream<Result<Conn, std::io::Error>>,
}

/// Accepts TCP connections and runs each TLS handshake in its own task, so
/// a slow or silent client never holds up the others. Unauthenticated
/// connections are capped and short-lived (see [`crate::admission`]).
pub(super) fn tls_incoming(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    admission: Arc<Admission>,
    known: Known,
) -> Incoming {
    let (tx, certified) = tokio::sync::mpsc::channel(ACCEPT_QUEUE);
    let (tx_anon, anonymous) = tokio::sync::mpsc::channel(ACCEPT_QUEUE);
    let (tx_shed, shed) = tokio::sync::mpsc::channel(ACCEPT_QUEUE);
    weft_common::task::spawn_critical("tls-accept", async move {
        loop {
            let (tcp, peer) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
                _ = tx.closed() => return,
            };
            let Some(handshake) = admission.handshake(peer.ip()) else {
                tracing::debug!(%peer, "too many handshakes from this address; closed");
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let (acceptor, admission, known) = (acceptor.clone(), admission.clone(), known.clone());
            let (tx, tx_anon, tx_shed) = (tx.clone(), tx_anon.clone(), tx_shed.clone());
            tokio::spawn(async move {
                let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(e)) => return tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                    Err(_) => return tracing::debug!(%peer, "TLS handshake timed out"),
                };
                drop(handshake);
                // A certificate no trusted CA signed counts as none.
                let certified = stream.get_ref().1.peer_certificates().is_some_and(|c| known(c));
                let limits = admission.limits();
                let _ = if certified {
                    tx.send(Ok(Conn::new(stream, None, None))).await
                } else if let Some(t) = admission.anonymous(peer.ip()) {
                    let hard_stop = limits.anonymous_lifetime + limits.anonymous_grace;
                    tx_anon.send(Ok(Conn::new(stream, Some(t), Some(hard_stop)))).await
                } else if let Some(t) = admission.shed(peer.ip()) {
                    tracing::debug!(%peer, "too many connections without a certificate; shedding this one");
                    tx_shed
                        .send(Ok(Conn::new(
                            stream,
                            Some(t),
                            Some(limits.shed_lifetime + limits.shed_grace),
                        )))
                        .await
                } else {
                    return tracing::debug!(%peer, "too many connections without a certificate; closed");
                };
            });
        }
    });
    Incoming {
        certified: ReceiverStream::new(certified),
        anonymous: ReceiverStream::new(anonymous),
        shed: ReceiverStream::new(shed),
    }
}

/// Whether a client's chain verifies against the site CA or a recorded
/// peer's: only those connections escape the anonymous caps.
pub(super) fn known_by(auth: &Arc<Authenticator>, hub: &Arc<Hub>) -> Known {
    let (auth, hub) = (auth.clone(), hub.clone());
    Arc::new(move |chain| {
        auth.is_known(chain, |site| {
            let model = hub.model();
            let remote = model.peerings.get(site)?.remote.as_ref()?;
            Some(remote.ca_pem.clone())
        })
    })
}
