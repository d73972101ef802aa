//! Tunnels over TLS on TCP, for gateways whose UDP is blocked (networks
//! that let only TCP out, such as many corporate ones).
//!
//! A relay site's active gateway runs a [`Front`] on one TCP port (443
//! passes most firewalls). A gateway whose UDP to that host does not work
//! runs a [`Carrier`] per tunnel instead: a UDP socket on 127.0.0.1 that
//! its WireGuard device takes as the peer's endpoint, and one TLS
//! connection to the front. The connection starts with [`HELLO`] and the
//! UDP port it stands for on the relay host (a relayed tunnel's side, or
//! one of the relay gateway's own tunnels, as peers reach it); the front
//! checks it against what it admits ([`Admit`]), answers one byte, and
//! from then on hands every datagram to that port from a socket on
//! 127.0.0.1 (the same one for the same port and address across
//! reconnections: the relay learned it), and what comes back the other
//! way. Both directions of the connection are byte streams of frames: a
//! datagram's length (2 bytes, big-endian), then the datagram. A
//! connection that carries nothing for a minute, or whose peer stops
//! acknowledging for 30 s, ends; the carrier connects again with backoff.
//!
//! What rides inside stays WireGuard end to end: the relay sees only
//! ciphertext, and the WireGuard sessions authenticate both ends. TLS only
//! carries the datagrams through firewalls, so it authenticates nothing:
//! the front's certificate is made at start, and the carrier takes any
//! (a man in the middle sees what a UDP path would show him: ciphertext).
//!
//! Against TCP-over-TCP collapse: one connection per tunnel, never one
//! per inner flow; and nothing is queued beyond the sockets' buffers (1
//! MiB on the loopback sockets) and one write. A datagram that finds the
//! connection's send buffer full waits in its UDP socket's buffer, and
//! past that is dropped, as a congested UDP path would drop it, so the
//! inner TCP backs off instead of its lost packets being retransmitted
//! twice.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

/// What a connection sends first: this, then the UDP port (2 bytes). The
/// front answers one byte: [`ADMITTED`], or [`REFUSED`] and it closes.
pub const HELLO: &[u8; 8] = b"WEFTTLS1";
pub const ADMITTED: u8 = 0;
pub const REFUSED: u8 = 1;
/// The TLS application protocol both ends name.
const ALPN: &[u8] = b"weft-tunnel/1";
/// The name a carrier asks for (the front's certificate carries it).
const SERVER_NAME: &str = "weft-relay";
/// How long a connection may take to say what it is.
const HANDSHAKE: Duration = Duration::from_secs(5);
/// Connections a front serves at once (each a tunnel's side), and from
/// one address (a NAT's many gateways, or one gateway's tunnels).
const MAX_CONNECTIONS: usize = 512;
const MAX_PER_SOURCE: usize = 32;
/// A connection that carries nothing for this long is dead (WireGuard's
/// keepalives cross every 25 s); TCP gives up on unacknowledged data after
/// [`TCP_TIMEOUT`].
const IDLE: Duration = Duration::from_secs(60);
const TCP_TIMEOUT: Duration = Duration::from_secs(30);
/// A pump's read buffer and the most it writes at once.
const CHUNK: usize = 256 * 1024;
/// The loopback sockets' buffers: room for bursts, small enough that a
/// congested connection drops rather than queues for long.
const UDP_BUFFER: usize = 1 << 20;
/// Datagrams (or GRO batches) one receive takes.
const RECV_BATCH: usize = 8;
/// The most loopback sockets a front keeps for (port, address) pairs.
const MAX_SOCKETS: usize = 1024;

/// A UDP port a connection may stand for: where its datagrams go (the
/// same port, or, for the gateway's own tunnels behind a port forward,
/// the tunnel's UDP port), and the addresses it may come from (empty:
/// any).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub to: u16,
    pub from: Vec<Ipv4Addr>,
}

/// The UDP ports on the relay host a connection may name, as its hello
/// names them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Admit {
    pub ports: HashMap<u16, Target>,
}

impl Admit {
    /// Where a connection from `from` naming `port` is handed on to, if it
    /// may.
    pub fn admits(&self, port: u16, from: IpAddr) -> Option<u16> {
        let from = match from {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(v6)),
            v4 => v4,
        };
        self.ports
            .get(&port)
            .filter(|t| t.from.is_empty() || matches!(from, IpAddr::V4(a) if t.from.contains(&a)))
            .map(|t| t.to)
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
    /// Connections refused (a front: over the limits, no TLS, no hello in
    /// time, a port not admitted) or that failed or were refused (a
    /// carrier).
    pub refused: AtomicU64,
    /// Datagrams from the connection not handed on (no destination yet, or
    /// the loopback send failed).
    pub dropped: AtomicU64,
}

/// A relay gateway's TLS port; its connections end when it is dropped.
pub struct Front {
    /// The port asked for, and the one bound (the same unless 0 was
    /// asked).
    pub port: u16,
    pub bound: u16,
    shared: Arc<Shared>,
    pub counters: Arc<Counters>,
    task: tokio::task::JoinHandle<()>,
}

/// What a front's connections share.
#[derive(Default)]
struct Shared {
    admit: RwLock<Admit>,
    sockets: Mutex<HashMap<(u16, IpAddr), Slot>>,
    per_source: Mutex<HashMap<IpAddr, usize>>,
}

/// The loopback socket of one (named port, connection address): kept
/// across that pair's reconnections, since the relay learned its address
/// (a new one would wait for the tunnel's next handshake), with the
/// connection using it now (told to end when another takes it).
struct Slot {
    udp: Arc<Loopback>,
    owner: Arc<tokio::sync::Notify>,
}

impl Drop for Front {
    fn drop(&mut self) {
        self.task.abort();
        // Its connections see their ports gone within a second, and end.
        *self.shared.admit.write().unwrap() = Admit::default();
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
        let shared = Arc::new(Shared::default());
        let counters = Arc::new(Counters::default());
        let task = tokio::spawn(accept(listener, acceptor, shared.clone(), counters.clone()));
        tracing::info!(port, "carrying tunnels over TLS for gateways whose UDP is blocked");
        Ok(Front {
            port,
            bound,
            shared,
            counters,
            task,
        })
    }

    /// Sets what connections may stand for (connections admitted for a
    /// port no longer listed end within a second).
    pub fn admit(&self, admit: Admit) {
        self.shared
            .sockets
            .lock()
            .unwrap()
            .retain(|(port, from), _| admit.admits(*port, *from).is_some());
        *self.shared.admit.write().unwrap() = admit;
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

/// A TCP connection's settings at both ends: no Nagle (frames are batched
/// already), and dead peers found: keepalives, and a bound on
/// unacknowledged data.
fn tune(stream: &TcpStream) {
    let _ = stream.set_nodelay(true);
    let s = socket2::SockRef::from(stream);
    let ka = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(10))
        .with_interval(Duration::from_secs(5))
        .with_retries(3);
    let _ = s.set_tcp_keepalive(&ka);
    let _ = s.set_tcp_user_timeout(Some(TCP_TIMEOUT));
}

/// Counts a connection against its address's share while it lives.
struct SourceShare {
    shared: Arc<Shared>,
    from: IpAddr,
}

impl Drop for SourceShare {
    fn drop(&mut self) {
        let mut m = self.shared.per_source.lock().unwrap();
        if let Some(n) = m.get_mut(&self.from) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.from);
            }
        }
    }
}

async fn accept(listener: TcpListener, acceptor: tokio_rustls::TlsAcceptor, shared: Arc<Shared>, c: Arc<Counters>) {
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
        let from_ip = from.ip().to_canonical();
        let share = {
            let mut m = shared.per_source.lock().unwrap();
            let n = m.entry(from_ip).or_default();
            if *n >= MAX_PER_SOURCE {
                None
            } else {
                *n += 1;
                Some(SourceShare {
                    shared: shared.clone(),
                    from: from_ip,
                })
            }
        };
        let (Some(share), Ok(permit)) = (share, open.clone().try_acquire_owned()) else {
            c.refused.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let (acceptor, shared, c) = (acceptor.clone(), shared.clone(), c.clone());
        tokio::spawn(async move {
            let _held = (permit, share);
            if let Err(e) = serve(stream, from, acceptor, &shared, &c).await {
                tracing::debug!(%from, error = %e, "TLS relay: connection ended");
            }
        });
    }
}

/// One connection: the TLS handshake and the hello within [`HANDSHAKE`],
/// the answer, then datagrams both ways until either end stops, nothing
/// crosses for [`IDLE`], the port is no longer admitted, or a newer
/// connection from the same address takes the port.
async fn serve(
    stream: TcpStream,
    from: SocketAddr,
    acceptor: tokio_rustls::TlsAcceptor,
    shared: &Shared,
    c: &Counters,
) -> Result<(), String> {
    tune(&stream);
    let from_ip = from.ip().to_canonical();
    let hello = async {
        let mut tls = acceptor.accept(stream).await.map_err(|e| format!("TLS: {e}"))?;
        let mut hello = [0u8; 10];
        tls.read_exact(&mut hello).await.map_err(|e| format!("hello: {e}"))?;
        Ok::<_, String>((tls, hello))
    };
    let (mut tls, hello) = match tokio::time::timeout(HANDSHAKE, hello).await {
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
    let admitted = (hello[..8] == HELLO[..])
        .then(|| shared.admit.read().unwrap().admits(port, from_ip))
        .flatten();
    // The socket for (port, address): the one its last connection used.
    let slot = admitted.and_then(|to| {
        let mut sockets = shared.sockets.lock().unwrap();
        let owner = Arc::new(tokio::sync::Notify::new());
        if let Some(s) = sockets.get_mut(&(port, from_ip)) {
            s.owner.notify_one();
            s.owner = owner.clone();
            return Some((to, s.udp.clone(), owner));
        }
        if sockets.len() >= MAX_SOCKETS {
            return None;
        }
        let udp = Arc::new(loopback_socket().ok()?);
        sockets.insert(
            (port, from_ip),
            Slot {
                udp: udp.clone(),
                owner: owner.clone(),
            },
        );
        Some((to, udp, owner))
    });
    let Some((to, udp, owner)) = slot else {
        c.refused.fetch_add(1, Ordering::Relaxed);
        let _ = tls.write_all(&[REFUSED]).await;
        let _ = tls.shutdown().await;
        return Err(format!(
            "refused: UDP port {port} is not one this connection may stand for"
        ));
    };
    tls.write_all(&[ADMITTED]).await.map_err(|e| format!("answer: {e}"))?;
    tls.flush().await.map_err(|e| format!("answer: {e}"))?;
    c.connections.fetch_add(1, Ordering::Relaxed);
    tracing::info!(%from, port, to, "TLS relay: a tunnel carried over TLS");
    let to = Mutex::new(Some(SocketAddr::from((Ipv4Addr::LOCALHOST, to))));
    let still = async {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if shared.admit.read().unwrap().admits(port, from_ip).is_none() {
                return Err::<(), String>(format!("UDP port {port} no longer admitted"));
            }
        }
    };
    tokio::select! {
        r = pump(tls, &udp, &to, false, c) => r,
        r = still => r,
        () = owner.notified() => Err("a newer connection from the same address took the port".into()),
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
    // Smaller than the relay's: a queue here is latency for the tunnel's
    // TCP flows, which a drop would tell to slow down.
    let s = socket2::SockRef::from(&std);
    let _ = s.set_recv_buffer_size(UDP_BUFFER);
    let _ = s.set_send_buffer_size(UDP_BUFFER);
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
        if self.buf.is_empty() {
            return;
        }
        let n = self.buf.len().div_ceil(self.stride) as u64;
        match to {
            Some(to) if udp.send(to, &self.buf, self.stride).await => {
                c.received[0].fetch_add(n, Ordering::Relaxed);
                c.received[1].fetch_add(self.buf.len() as u64, Ordering::Relaxed);
            }
            _ => {
                c.dropped.fetch_add(n, Ordering::Relaxed);
            }
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
            let n = match tokio::time::timeout(IDLE, rd.read(&mut buf[have..])).await {
                Ok(r) => r.map_err(|e| format!("read: {e}"))?,
                Err(_) => return Err(format!("nothing came for {IDLE:?}")),
            };
            if n == 0 {
                return Ok(());
            }
            have += n;
            // (quinn-udp turns segmentation off after the kernel refuses it.)
            run.max = udp.state.max_gso_segments().max(1);
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
        let batch = RECV_BATCH.min(quinn_udp::BATCH_SIZE);
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
                    for d in data
                        .chunks(m.stride.max(1))
                        .filter(|d| d.len() <= usize::from(u16::MAX))
                    {
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

#[cfg(test)]
mod tests;
