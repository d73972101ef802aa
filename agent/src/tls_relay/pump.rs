//! Datagrams between a TLS stream and a loopback UDP socket, both ways,
//! in batches.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Mutex;
use std::sync::atomic::Ordering;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::UdpSocket;

use super::*;

/// A UDP socket on 127.0.0.1, read and written in batches (quinn-udp: GRO
/// in, so a device's segmented send arrives in one read; GSO out, so a
/// run of equal datagrams leaves in one write).
pub(super) struct Loopback {
    socket: UdpSocket,
    state: quinn_udp::UdpSocketState,
}

pub(super) fn loopback_socket() -> Result<Loopback, String> {
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
    pub(super) fn local_addr(&self) -> std::io::Result<SocketAddr> {
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
pub(super) async fn pump<S: AsyncRead + AsyncWrite>(
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
