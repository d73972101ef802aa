//! Tunnels over TLS on TCP, for gateways whose UDP is blocked (networks
//! that let only TCP out, such as many corporate ones).
//!
//! A relay site's active gateway runs a [`Front`] on one TCP port (443
//! passes most firewalls). A gateway whose UDP to that host does not work
//! runs a [`Carrier`] per tunnel instead: a UDP socket on 127.0.0.1 that
//! its WireGuard device takes as the peer's endpoint, and one TLS
//! connection to the front. The connection starts with [`HELLO`] and the
//! UDP port it stands for on the relay host (a relayed tunnel's side, or
//! one of the relay gateway's own tunnels); the front checks it against
//! what it admits ([`Admit`]) and from then on hands every datagram to
//! that port from a socket of its own on 127.0.0.1, and what comes back
//! the other way. Both directions of the connection are byte streams of
//! frames: a datagram's length (2 bytes, big-endian), then the datagram.
//!
//! What rides inside stays WireGuard end to end: the relay sees only
//! ciphertext, and the WireGuard sessions authenticate both ends. TLS only
//! carries the datagrams through firewalls, so it authenticates nothing:
//! the front's certificate is made at start, and the carrier takes any
//! (a man in the middle sees what a UDP path would show him: ciphertext).
//!
//! Against TCP-over-TCP collapse: one connection per tunnel, never one
//! per inner flow; and nothing is queued beyond the sockets' buffers. A
//! datagram that finds the connection's send buffer full waits in its UDP
//! socket's buffer, and past that is dropped, as a congested UDP path
//! would drop it, so the inner TCP backs off instead of its lost packets
//! being retransmitted twice.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

/// What a connection sends first: this, then the UDP port (2 bytes).
pub const HELLO: &[u8; 8] = b"WEFTTLS1";
/// The TLS application protocol both ends name.
const ALPN: &[u8] = b"weft-tunnel/1";
/// The name a carrier asks for (the front's certificate carries it).
const SERVER_NAME: &str = "weft-relay";
/// How long a connection may take to say what it is.
const HANDSHAKE: Duration = Duration::from_secs(5);
/// Connections a front serves at once (each a tunnel's side).
const MAX_CONNECTIONS: usize = 512;
/// A pump's read buffer and the most it writes at once.
const CHUNK: usize = 256 * 1024;

/// The UDP ports on the relay host a connection may stand for, each with
/// the addresses it may come from (empty: any).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Admit {
    pub ports: HashMap<u16, Vec<Ipv4Addr>>,
}

impl Admit {
    /// Whether a connection from `from` may stand for `port`.
    pub fn admits(&self, port: u16, from: IpAddr) -> bool {
        let from = match from {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(v6)),
            v4 => v4,
        };
        self.ports
            .get(&port)
            .is_some_and(|ips| ips.is_empty() || matches!(from, IpAddr::V4(a) if ips.contains(&a)))
    }
}

/// What a front or a carrier did.
#[derive(Debug, Default)]
pub struct Counters {
    /// Datagrams and bytes into the connection, and out of it.
    pub sent: [AtomicU64; 2],
    pub received: [AtomicU64; 2],
    /// Connections made (a carrier) or admitted (a front).
    pub connections: AtomicU64,
    /// Connections refused (a front: a port not admitted, a bad hello) or
    /// failed (a carrier).
    pub refused: AtomicU64,
}

/// A relay gateway's TLS port; its connections end when it is dropped.
pub struct Front {
    /// The port asked for, and the one bound (the same unless 0 was
    /// asked).
    pub port: u16,
    pub bound: u16,
    admit: Arc<RwLock<Admit>>,
    pub counters: Arc<Counters>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Front {
    fn drop(&mut self) {
        self.task.abort();
        // Its connections see their ports gone within a second, and end.
        *self.admit.write().unwrap() = Admit::default();
    }
}

impl Front {
    /// Listens on TCP `port` of every address of the host (IPv4 and IPv6);
    /// a certificate for it is made now.
    pub fn start(port: u16) -> Result<Front, String> {
        let cert = rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_string()])
            .map_err(|e| format!("cannot make the TLS relay's certificate: {e}"))?;
        let key = rustls::pki_types::PrivateKeyDer::Pkcs8(cert.signing_key.serialize_der().into());
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_single_cert(vec![cert.cert.der().clone()], key)
            .map_err(|e| format!("the TLS relay's certificate: {e}"))?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = listen(port).map_err(|e| format!("cannot listen on TCP port {port} for the TLS relay: {e}"))?;
        let bound = listener.local_addr().map_err(|e| e.to_string())?.port();
        let admit = Arc::new(RwLock::new(Admit::default()));
        let counters = Arc::new(Counters::default());
        let (a, c) = (admit.clone(), counters.clone());
        let task = tokio::spawn(accept(listener, acceptor, a, c));
        tracing::info!(port, "carrying tunnels over TLS for gateways whose UDP is blocked");
        Ok(Front {
            port,
            bound,
            admit,
            counters,
            task,
        })
    }

    /// Sets what connections may stand for (connections already admitted
    /// for a port no longer listed end).
    pub fn admit(&self, admit: Admit) {
        *self.admit.write().unwrap() = admit;
    }
}

/// A TCP listener on `port` of every address, IPv4 and IPv6.
fn listen(port: u16) -> std::io::Result<TcpListener> {
    let s = socket2::Socket::new(socket2::Domain::IPV6, socket2::Type::STREAM, None)
        .and_then(|s| s.set_only_v6(false).map(|()| s));
    let (s, addr): (socket2::Socket, SocketAddr) = match s {
        Ok(s) => (s, (std::net::Ipv6Addr::UNSPECIFIED, port).into()),
        // A host without IPv6.
        Err(_) => (
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?,
            (Ipv4Addr::UNSPECIFIED, port).into(),
        ),
    };
    s.set_reuse_address(true)?;
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    s.listen(128)?;
    TcpListener::from_std(s.into())
}

async fn accept(
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    admit: Arc<RwLock<Admit>>,
    c: Arc<Counters>,
) {
    let open = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(error = %e, "TLS relay: accept");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            c.refused.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let (acceptor, admit, c) = (acceptor.clone(), admit.clone(), c.clone());
        tokio::spawn(async move {
            let _permit = permit;
            if let Err(e) = serve(stream, from, acceptor, &admit, &c).await {
                tracing::debug!(%from, error = %e, "TLS relay: connection ended");
            }
        });
    }
}

/// One connection: the TLS handshake and the hello within [`HANDSHAKE`],
/// then datagrams both ways until either end stops or the port is no
/// longer admitted.
async fn serve(
    stream: TcpStream,
    from: SocketAddr,
    acceptor: tokio_rustls::TlsAcceptor,
    admit: &RwLock<Admit>,
    c: &Counters,
) -> Result<(), String> {
    let _ = stream.set_nodelay(true);
    let hello = async {
        let mut tls = acceptor.accept(stream).await.map_err(|e| format!("TLS: {e}"))?;
        let mut hello = [0u8; 10];
        tls.read_exact(&mut hello).await.map_err(|e| format!("hello: {e}"))?;
        Ok::<_, String>((tls, hello))
    };
    let (tls, hello) = match tokio::time::timeout(HANDSHAKE, hello).await {
        Ok(Ok(x)) => x,
        Ok(Err(e)) => {
            c.refused.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
        Err(_) => {
            c.refused.fetch_add(1, Ordering::Relaxed);
            return Err("no hello in time".into());
        }
    };
    let port = u16::from_be_bytes([hello[8], hello[9]]);
    if hello[..8] != HELLO[..] || !admit.read().unwrap().admits(port, from.ip()) {
        c.refused.fetch_add(1, Ordering::Relaxed);
        return Err(format!(
            "refused: UDP port {port} is not one this connection may stand for"
        ));
    }
    c.connections.fetch_add(1, Ordering::Relaxed);
    tracing::info!(%from, port, "TLS relay: a tunnel carried over TLS");
    let udp = loopback_socket()?;
    let to = Mutex::new(Some(SocketAddr::from((Ipv4Addr::LOCALHOST, port))));
    let still = async {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if !admit.read().unwrap().admits(port, from.ip()) {
                return Err::<(), String>(format!("UDP port {port} no longer admitted"));
            }
        }
    };
    tokio::select! {
        r = pump(tls, &udp, &to, false, c) => r,
        r = still => r,
    }
}

/// A UDP socket on 127.0.0.1, read and written in batches (quinn-udp: GRO
/// in, so a device's segmented send arrives in one read; GSO out, so a
/// run of equal datagrams leaves in one write).
struct Loopback {
    socket: UdpSocket,
    state: quinn_udp::UdpSocketState,
}

fn loopback_socket() -> Result<Loopback, String> {
    let std =
        std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|e| format!("cannot bind on 127.0.0.1: {e}"))?;
    let (std, state) = weft_wg_device::conn::tuned(std).map_err(|e| e.to_string())?;
    let socket = UdpSocket::from_std(std).map_err(|e| e.to_string())?;
    Ok(Loopback { socket, state })
}

impl Loopback {
    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.socket.local_addr()
    }

    /// Sends `data` (datagrams of `stride` bytes, the last maybe shorter)
    /// to `to`, segmented where it can. Loopback: a full receiver drops,
    /// it does not block; a full send buffer is waited for.
    async fn send(&self, to: SocketAddr, data: &[u8], stride: usize) -> bool {
        let t = quinn_udp::Transmit {
            destination: to,
            ecn: None,
            contents: data,
            segment_size: (data.len() > stride).then_some(stride),
            src_ip: None,
        };
        loop {
            match self.socket.try_io(tokio::io::Interest::WRITABLE, || {
                self.state.try_send((&self.socket).into(), &t)
            }) {
                Ok(()) => return true,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if self.socket.writable().await.is_err() {
                        return false;
                    }
                }
                Err(_) => return false,
            }
        }
    }
}

/// A run of equal datagrams for one segmented send.
struct Run {
    buf: Vec<u8>,
    stride: usize,
    max: usize,
}

impl Run {
    /// Whether a datagram of `n` bytes joins the run (the last of a run may
    /// be shorter, and ends it).
    fn fits(&self, n: usize) -> bool {
        self.buf.is_empty()
            || (n <= self.stride
                && self.buf.len().is_multiple_of(self.stride)
                && self.buf.len() + n <= 65_000
                && self.buf.len() / self.stride < self.max)
    }

    fn push(&mut self, d: &[u8]) {
        if self.buf.is_empty() {
            self.stride = d.len();
        }
        self.buf.extend_from_slice(d);
    }

    async fn flush(&mut self, udp: &Loopback, to: Option<SocketAddr>, c: &Counters) {
        if let (Some(to), false) = (to, self.buf.is_empty())
            && udp.send(to, &self.buf, self.stride).await
        {
            c.received[0].fetch_add(self.buf.len().div_ceil(self.stride) as u64, Ordering::Relaxed);
            c.received[1].fetch_add(self.buf.len() as u64, Ordering::Relaxed);
        }
        self.buf.clear();
    }
}

/// Carries datagrams between `tls` and `udp` until either fails or ends:
/// frames from the connection go to `to`; datagrams from `to` (with
/// `learn`, from any loopback address, which becomes `to`) go into the
/// connection, as many as are waiting per write.
async fn pump<S: AsyncRead + AsyncWrite>(
    tls: S,
    udp: &Loopback,
    to: &Mutex<Option<SocketAddr>>,
    learn: bool,
    c: &Counters,
) -> Result<(), String> {
    let (mut rd, mut wr) = tokio::io::split(tls);
    let inbound = async {
        let mut buf = vec![0u8; CHUNK];
        let mut have = 0;
        let mut run = Run {
            buf: Vec::with_capacity(65_536),
            stride: 0,
            max: udp.state.max_gso_segments().max(1),
        };
        loop {
            let n = rd.read(&mut buf[have..]).await.map_err(|e| format!("read: {e}"))?;
            if n == 0 {
                return Ok(());
            }
            have += n;
            let dest = *to.lock().unwrap();
            let mut at = 0;
            while have - at >= 2 {
                let len = usize::from(u16::from_be_bytes([buf[at], buf[at + 1]]));
                if have - at < 2 + len {
                    break;
                }
                let d = &buf[at + 2..at + 2 + len];
                at += 2 + len;
                if d.is_empty() {
                    continue;
                }
                if !run.fits(d.len()) {
                    run.flush(udp, dest, c).await;
                }
                run.push(d);
            }
            run.flush(udp, dest, c).await;
            buf.copy_within(at..have, 0);
            have -= at;
        }
    };
    let outbound = async {
        let batch = quinn_udp::BATCH_SIZE;
        let mut storage = vec![0u8; batch * 65_536];
        let mut meta = vec![quinn_udp::RecvMeta::default(); batch];
        let mut out: Vec<u8> = Vec::with_capacity(CHUNK + 65_536 * 2);
        loop {
            // What is waiting now, up to a chunk: one write.
            while out.len() < CHUNK {
                let mut bufs: Vec<std::io::IoSliceMut> =
                    storage.chunks_mut(65_536).map(std::io::IoSliceMut::new).collect();
                let got = udp.socket.try_io(tokio::io::Interest::READABLE, || {
                    udp.state.recv((&udp.socket).into(), &mut bufs, &mut meta)
                });
                let n = match got {
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if !out.is_empty() {
                            break;
                        }
                        udp.socket.readable().await.map_err(|e| format!("receive: {e}"))?;
                        continue;
                    }
                    Err(e) => return Err(format!("receive: {e}")),
                };
                for (m, b) in meta.iter().zip(bufs.iter()).take(n) {
                    let from = m.addr;
                    let ok = {
                        let mut at = to.lock().unwrap();
                        match *at {
                            _ if learn && from.ip().is_loopback() => {
                                *at = Some(from);
                                true
                            }
                            Some(t) => t == from,
                            None => false,
                        }
                    };
                    if !ok {
                        continue;
                    }
                    let data = &b[..m.len.min(65_536)];
                    for d in data.chunks(m.stride.max(1)) {
                        out.extend_from_slice(&(d.len() as u16).to_be_bytes());
                        out.extend_from_slice(d);
                        c.sent[0].fetch_add(1, Ordering::Relaxed);
                        c.sent[1].fetch_add(d.len() as u64, Ordering::Relaxed);
                    }
                }
            }
            wr.write_all(&out).await.map_err(|e| format!("write: {e}"))?;
            wr.flush().await.map_err(|e| format!("write: {e}"))?;
            out.clear();
        }
    };
    tokio::select! {
        r = inbound => r,
        r = outbound => r,
    }
}

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
    /// port.
    pub fn start(front: SocketAddr, port: u16) -> Result<Carrier, String> {
        let udp = loopback_socket()?;
        let local = udp.local_addr().map_err(|e| e.to_string())?;
        let up = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        let (u, c) = (up.clone(), counters.clone());
        let task = tokio::spawn(carry(front, port, udp, u, c));
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

/// A carrier's life: connect, say which port, pump; again after a pause
/// when the connection fails or ends.
async fn carry(front: SocketAddr, port: u16, udp: Loopback, up: Arc<AtomicBool>, c: Arc<Counters>) {
    use backon::BackoffBuilder;
    let fresh = || {
        backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(200))
            .with_max_delay(Duration::from_secs(5))
            .with_jitter()
            .without_max_times()
            .build()
    };
    let mut delays = fresh();
    let to = Mutex::new(None);
    let Ok(connector) = connector() else { return };
    loop {
        let connected = async {
            let stream = TcpStream::connect(front).await.map_err(|e| format!("connect: {e}"))?;
            let _ = stream.set_nodelay(true);
            let name = rustls::pki_types::ServerName::try_from(SERVER_NAME).map_err(|e| e.to_string())?;
            let mut tls = connector.connect(name, stream).await.map_err(|e| format!("TLS: {e}"))?;
            let mut hello = [0u8; 10];
            hello[..8].copy_from_slice(HELLO);
            hello[8..].copy_from_slice(&port.to_be_bytes());
            tls.write_all(&hello).await.map_err(|e| format!("hello: {e}"))?;
            tls.flush().await.map_err(|e| format!("hello: {e}"))?;
            Ok::<_, String>(tls)
        };
        let started = std::time::Instant::now();
        match tokio::time::timeout(HANDSHAKE, connected).await {
            Ok(Ok(tls)) => {
                c.connections.fetch_add(1, Ordering::Relaxed);
                up.store(true, Ordering::Relaxed);
                tracing::info!(%front, port, "a tunnel carried over TLS: connected");
                let r = pump(tls, &udp, &to, true, &c).await;
                up.store(false, Ordering::Relaxed);
                tracing::info!(%front, port, ended = ?r.err(), "a tunnel carried over TLS: connection ended");
                if started.elapsed() > Duration::from_secs(10) {
                    delays = fresh();
                }
            }
            Ok(Err(e)) => {
                c.refused.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%front, port, error = %e, "a tunnel carried over TLS: cannot connect");
            }
            Err(_) => {
                c.refused.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%front, port, "a tunnel carried over TLS: no connection in time");
            }
        }
        tokio::time::sleep(delays.next().unwrap_or(Duration::from_secs(5))).await;
    }
}

#[cfg(test)]
mod tests;
