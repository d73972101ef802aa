//! A gateway's end of a tunnel carried over TLS.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::pump::{Loopback, loopback_socket, pump};
use super::*;

/// One tunnel carried over TLS from this gateway: WireGuard sends to
/// [`Carrier::local`]; the connection is made again, with backoff, while
/// the carrier lives.
pub struct Carrier {
    /// Where the WireGuard device sends the peer's datagrams.
    pub local: SocketAddr,
    /// The front (the endpoint's address, the TLS port), and the UDP port
    /// the connection stands for there.
    pub front: SocketAddr,
    pub port: u16,
    /// Connected now.
    pub up: Arc<AtomicBool>,
    pub counters: Arc<Counters>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Carrier {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Carrier {
    /// Carries to UDP port `port` at `front`'s address through its TLS
    /// port, for the WireGuard socket at `wg` (127.0.0.1 and the tunnel's
    /// port: nothing else on the host may take the tunnel's datagrams; None
    /// takes the first loopback sender).
    pub fn start(front: SocketAddr, port: u16, wg: Option<SocketAddr>) -> Result<Carrier, String> {
        let udp = loopback_socket()?;
        let local = udp.local_addr().map_err(|e| e.to_string())?;
        let up = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        let (u, c) = (up.clone(), counters.clone());
        let task = tokio::spawn(carry(front, port, udp, wg, u, c));
        Ok(Carrier {
            local,
            front,
            port,
            up,
            counters,
            task,
        })
    }
}

/// Accepts any certificate (see the module: TLS only carries; WireGuard
/// inside authenticates), but checks the handshake's signatures.
#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

fn connector() -> Result<tokio_rustls::TlsConnector, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
        .with_no_client_auth();
    config.alpn_protocols = vec![ALPN.to_vec()];
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// A carrier's life: connect, say which port, wait for the answer, pump;
/// again after a pause when the connection fails, is refused or ends.
async fn carry(
    front: SocketAddr,
    port: u16,
    udp: Loopback,
    wg: Option<SocketAddr>,
    up: Arc<AtomicBool>,
    c: Arc<Counters>,
) {
    let fresh = || weft_common::backoff_between(Duration::from_millis(200), Duration::from_secs(5));
    let mut delays = fresh();
    let to = Mutex::new(wg);
    let Ok(connector) = connector() else { return };
    // Said once at warn, then at debug.
    let mut told = false;
    loop {
        let connected = async {
            let stream = TcpStream::connect(front).await.map_err(|e| format!("connect: {e}"))?;
            tune(&stream);
            let name = rustls::pki_types::ServerName::try_from(SERVER_NAME).map_err(|e| e.to_string())?;
            let mut tls = connector.connect(name, stream).await.map_err(|e| format!("TLS: {e}"))?;
            let mut hello = [0u8; 10];
            hello[..8].copy_from_slice(HELLO);
            hello[8..].copy_from_slice(&port.to_be_bytes());
            tls.write_all(&hello).await.map_err(|e| format!("hello: {e}"))?;
            tls.flush().await.map_err(|e| format!("hello: {e}"))?;
            let mut answer = [0u8; 1];
            tls.read_exact(&mut answer).await.map_err(|e| format!("answer: {e}"))?;
            match answer[0] {
                ADMITTED => Ok::<_, String>(tls),
                _ => Err(format!(
                    "the relay refused UDP port {port} (not a tunnel it carries for this address)"
                )),
            }
        };
        let started = std::time::Instant::now();
        let result = tokio::time::timeout(HANDSHAKE, connected)
            .await
            .unwrap_or_else(|_| Err("no answer in time".into()));
        match result {
            Ok(tls) => {
                told = false;
                c.connections.fetch_add(1, Ordering::Relaxed);
                up.store(true, Ordering::Relaxed);
                tracing::info!(%front, port, "a tunnel carried over TLS: connected");
                let r = pump(tls, &udp, &to, wg.is_none(), &c).await;
                up.store(false, Ordering::Relaxed);
                tracing::info!(%front, port, ended = ?r.err(), "a tunnel carried over TLS: connection ended");
                if started.elapsed() > Duration::from_secs(10) {
                    delays = fresh();
                }
            }
            Err(e) => {
                c.refused.fetch_add(1, Ordering::Relaxed);
                if told {
                    tracing::debug!(%front, port, error = %e, "a tunnel carried over TLS: no connection");
                } else {
                    tracing::warn!(%front, port, error = %e, "a tunnel carried over TLS: no connection; trying again");
                    told = true;
                }
            }
        }
        tokio::time::sleep(delays.next().unwrap_or(Duration::from_secs(5))).await;
    }
}
