//! A relay gateway's TLS port: which connections it admits, and the
//! loopback socket each is handed on through.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::pump::{Loopback, loopback_socket, pump};
use super::*;

/// A UDP port a connection may stand for: where its datagrams go (the
/// same port, or, for the gateway's own tunnels behind a port forward,
/// the tunnel's UDP port), and the addresses it may come from (empty:
/// any).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub to: u16,
    pub from: Vec<IpAddr>,
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
        let from = from.to_canonical();
        self.ports
            .get(&port)
            .filter(|t| t.from.is_empty() || t.from.contains(&from))
            .map(|t| t.to)
    }
}

/// What a relay gateway's TLS port admits: the sides of the relayed
/// tunnels running (`sessions`), each from its own addresses, and the
/// UDP ports of its own tunnels (`tunnels`, whose devices exist), named
/// by the port peers reach them at (the port plus `shift`: a port forward
/// that moves them), from anywhere.
pub fn admitted<'a>(
    sessions: impl Iterator<Item = &'a weft_dataplane::desired::decode::RelaySession>,
    tunnels: impl Iterator<Item = u16>,
    shift: i32,
) -> Admit {
    let mut admit = Admit::default();
    for s in sessions {
        for side in [&s.spec.a, &s.spec.b] {
            let to = Target {
                to: side.port,
                from: side.from_ips.clone(),
            };
            admit.ports.insert(side.port, to);
        }
    }
    for port in tunnels {
        if let Ok(named) = u16::try_from(i32::from(port) + shift) {
            let to = Target {
                to: port,
                from: Vec::new(),
            };
            admit.ports.entry(named).or_insert(to);
        }
    }
    admit
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
