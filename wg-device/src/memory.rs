//! In-memory doubles of a device's tun and network, as wireguard-go's
//! `tuntest` and `bindtest`: the device runs on them unchanged, with no
//! namespace, no tun and no privilege.
//!
//! Each end is a Unix datagram socket pair: packets keep their
//! boundaries, nothing leaves the process, and the device polls it as it
//! polls a tun or a UDP socket. A full end drops what more comes, as a
//! full socket buffer does.
//!
//! The [`Network`] is a switch between the binds made on it, with what a
//! test needs of the world between two gateways: a NAT that rewrites a
//! bind's address (and can move it, as a NAT's mapping changes), a tap that
//! records every datagram, and datagrams injected from anywhere.

use std::collections::HashMap;
use std::io::IoSliceMut;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixDatagram;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use quinn_udp::RecvMeta;

use crate::{Bind, Tun, TunOffloads};

/// A sender's address in front of each datagram on a bind's socket pair.
const ADDR_LEN: usize = 18;

/// A tun in memory: the device's side ([`MemoryTun`]) and the host's side
/// ([`TunPeer`], where a test writes the packets the device is to carry
/// and reads what it delivers). `vnet_hdr`: every packet carries the
/// virtio-net header, and the tun takes TCP super-packets (TSO).
pub fn tun(vnet_hdr: bool) -> std::io::Result<(MemoryTun, TunPeer)> {
    let (device, host) = UnixDatagram::pair()?;
    device.set_nonblocking(true)?;
    Ok((
        MemoryTun {
            sock: device,
            offloads: TunOffloads {
                vnet_hdr,
                tso: vnet_hdr,
                uso: false,
            },
        },
        TunPeer { sock: host },
    ))
}

/// The device's side of an in-memory tun.
pub struct MemoryTun {
    sock: UnixDatagram,
    offloads: TunOffloads,
}

impl AsFd for MemoryTun {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

impl Tun for MemoryTun {
    fn offloads(&self) -> TunOffloads {
        self.offloads
    }

    fn read(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.sock.recv(buf)
    }

    fn write(&self, buf: &[u8]) -> std::io::Result<usize> {
        self.sock.send(buf)
    }
}

/// The host's side of an in-memory tun.
pub struct TunPeer {
    sock: UnixDatagram,
}

impl TunPeer {
    /// Hands the device `packet`, as the host's stack would.
    pub fn send(&self, packet: &[u8]) -> std::io::Result<()> {
        self.sock.send(packet).map(|_| ())
    }

    /// The next packet the device delivered, waiting at most `wait`.
    pub fn recv(&self, wait: Duration) -> Option<Vec<u8>> {
        self.sock
            .set_read_timeout(Some(wait.max(Duration::from_millis(1))))
            .ok()?;
        let mut buf = vec![0u8; 1 << 17];
        let n = self.sock.recv(&mut buf).ok()?;
        buf.truncate(n);
        Some(buf)
    }

    /// Every packet delivered until none comes for `quiet`.
    pub fn drain(&self, quiet: Duration) -> Vec<Vec<u8>> {
        std::iter::from_fn(|| self.recv(quiet)).collect()
    }
}

/// One datagram as the network carried it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Datagram {
    pub from: SocketAddr,
    pub to: SocketAddr,
    pub data: Vec<u8>,
}

#[derive(Default)]
struct Switch {
    /// The network's side of each bind, by the bind's address.
    ends: HashMap<SocketAddr, UnixDatagram>,
    /// A bind's address as others see it (inside → outside).
    nat: HashMap<SocketAddr, SocketAddr>,
    /// What was carried, while recording.
    tap: Option<Vec<Datagram>>,
    /// Router hops between any two binds: a datagram sent with a TTL of
    /// at most this dies on the way ([`Network::hops`]).
    hops: u8,
    /// Datagrams that died so, while recording.
    died: Vec<Datagram>,
}

/// A network of binds in memory.
#[derive(Default)]
pub struct Network {
    switch: Mutex<Switch>,
}

impl Network {
    pub fn new() -> Arc<Network> {
        Arc::default()
    }

    fn switch(&self) -> std::sync::MutexGuard<'_, Switch> {
        self.switch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A bind at `addr` that sends up to `gso` datagrams per call.
    pub fn bind(self: &Arc<Self>, addr: SocketAddr, gso: usize) -> std::io::Result<MemoryBind> {
        let (device, network) = UnixDatagram::pair()?;
        device.set_nonblocking(true)?;
        network.set_nonblocking(true)?;
        let mut sw = self.switch();
        if sw.ends.contains_key(&addr) {
            return Err(std::io::ErrorKind::AddrInUse.into());
        }
        sw.ends.insert(addr, network);
        Ok(MemoryBind {
            net: self.clone(),
            addr,
            sock: device,
            gso: gso.max(1),
        })
    }

    /// Puts the bind at `inside` behind a NAT: what it sends comes from
    /// `outside`, and what is sent to `outside` reaches it. A second call
    /// moves the mapping (the old outside address reaches nothing).
    pub fn nat(&self, inside: SocketAddr, outside: SocketAddr) {
        self.switch().nat.insert(inside, outside);
    }

    /// Starts recording every datagram carried, and every one that died
    /// for its TTL (and forgets earlier ones).
    pub fn record(&self) {
        let mut sw = self.switch();
        sw.tap = Some(Vec::new());
        sw.died.clear();
    }

    /// Puts `n` router hops between every two binds (0 at first).
    pub fn hops(&self, n: u8) {
        self.switch().hops = n;
    }

    /// What died on the way since [`Network::record`] (TTL too low).
    pub fn died(&self) -> Vec<Datagram> {
        self.switch().died.clone()
    }

    /// What was carried since [`Network::record`].
    pub fn recorded(&self) -> Vec<Datagram> {
        self.switch().tap.clone().unwrap_or_default()
    }

    /// Carries `data` from `from` to `to` (through the NAT): true when a
    /// bind took it. Tests use it to inject what an attacker would send.
    pub fn deliver(&self, from: SocketAddr, to: SocketAddr, data: &[u8]) -> bool {
        let mut sw = self.switch();
        let inside = sw.nat.iter().find(|(_, o)| **o == to).map(|(i, _)| *i);
        let at = match inside {
            Some(i) => i,
            // an address behind the NAT is not reachable by its own name
            None if sw.nat.contains_key(&to) => return false,
            None => to,
        };
        if let Some(tap) = &mut sw.tap {
            tap.push(Datagram {
                from,
                to,
                data: data.to_vec(),
            });
        }
        let Some(end) = sw.ends.get(&at) else {
            return false;
        };
        let mut framed = Vec::with_capacity(ADDR_LEN + data.len());
        let v6 = match from.ip() {
            IpAddr::V4(a) => a.to_ipv6_mapped(),
            IpAddr::V6(a) => a,
        };
        framed.extend_from_slice(&v6.octets());
        framed.extend_from_slice(&from.port().to_be_bytes());
        framed.extend_from_slice(data);
        end.send(&framed).is_ok()
    }

    /// `addr` as others see it.
    fn outside(&self, addr: SocketAddr) -> SocketAddr {
        self.switch().nat.get(&addr).copied().unwrap_or(addr)
    }
}

/// A device's socket on a [`Network`].
pub struct MemoryBind {
    net: Arc<Network>,
    addr: SocketAddr,
    sock: UnixDatagram,
    gso: usize,
}

impl Drop for MemoryBind {
    fn drop(&mut self) {
        self.net.switch().ends.remove(&self.addr);
    }
}

impl AsFd for MemoryBind {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

impl Bind for MemoryBind {
    fn recv(&self, bufs: &mut [IoSliceMut<'_>], meta: &mut [RecvMeta]) -> std::io::Result<usize> {
        let mut n = 0;
        for (buf, m) in bufs.iter_mut().zip(meta.iter_mut()) {
            let len = match self.sock.recv(buf) {
                Ok(len) => len,
                Err(e) if n == 0 => return Err(e),
                Err(_) => break,
            };
            // (every datagram is framed by `Network::deliver`)
            let Some(ip) = buf.get(..16).and_then(|b| <[u8; 16]>::try_from(b).ok()) else {
                break;
            };
            let port = u16::from_be_bytes([buf[16], buf[17]]);
            buf.copy_within(ADDR_LEN..len, 0);
            *m = RecvMeta::default();
            m.addr = SocketAddr::new(Ipv6Addr::from(ip).to_canonical(), port);
            m.len = len - ADDR_LEN;
            m.stride = m.len;
            n += 1;
        }
        Ok(n)
    }

    fn send(&self, to: SocketAddr, data: &[u8], stride: usize) -> bool {
        let from = self.net.outside(self.addr);
        for d in data.chunks(stride.max(1)) {
            // (to no one: lost, as UDP's)
            self.net.deliver(from, to, d);
        }
        true
    }

    fn max_gso_segments(&self) -> usize {
        self.gso
    }

    fn gro_segments(&self) -> usize {
        1
    }

    fn send_ttl(&self, to: SocketAddr, data: &[u8], ttl: u8) -> bool {
        let from = self.net.outside(self.addr);
        let mut sw = self.net.switch();
        if ttl <= sw.hops {
            if sw.tap.is_some() {
                sw.died.push(Datagram {
                    from,
                    to,
                    data: data.to_vec(),
                });
            }
            return true;
        }
        drop(sw);
        self.net.deliver(from, to, data);
        true
    }
}

/// Waits until `f` gives something, checking every 5 ms, at most `wait`.
pub fn eventually<T>(wait: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let end = Instant::now() + wait;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
