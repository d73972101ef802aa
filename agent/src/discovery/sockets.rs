//! Discovery's raw UDP sockets, one per family: probes written with the
//! tunnel's port as their source port, answers read through a socket
//! filter that passes discovery's datagrams only.

use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::time::Duration;

use socket2::{Domain, Protocol, SockAddr, SockFilter, Socket, Type};
use weft_common::discovery;

/// The raw UDP sockets discovery sends and reads on: IPv4's, and IPv6's
/// where the host has IPv6.
pub(super) struct Sockets {
    v4: Option<Socket>,
    v6: Option<Socket>,
}

impl Sockets {
    /// Both families' sockets; an error only when neither opens.
    pub(super) fn open() -> Result<Sockets, String> {
        let v4 = raw_socket(Domain::IPV4);
        let v6 = raw_socket(Domain::IPV6);
        match (v4, v6) {
            (Err(e), Err(_)) => Err(e),
            (v4, v6) => {
                if let Err(e) = &v6 {
                    tracing::debug!(error = %e, "endpoint discovery over IPv4 only");
                }
                Ok(Sockets {
                    v4: v4.ok(),
                    v6: v6.ok(),
                })
            }
        }
    }

    /// Sends a UDP datagram `d` (its header first) to `to`.
    pub(super) fn send(&self, d: &[u8], to: IpAddr) -> std::io::Result<usize> {
        let (sock, addr) = match to {
            IpAddr::V4(ip) => (&self.v4, SockAddr::from(SocketAddrV4::new(ip, 0))),
            IpAddr::V6(ip) => (&self.v6, SockAddr::from(SocketAddrV6::new(ip, 0, 0, 0))),
        };
        let Some(sock) = sock else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "no raw socket for this address family",
            ));
        };
        sock.send_to(d, &addr)
    }

    /// One discovery datagram within `wait`: its source, destination port
    /// and payload.
    pub(super) fn receive(&self, wait: Duration) -> Option<(SocketAddr, u16, Vec<u8>)> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        use std::os::fd::AsFd;
        let socks: Vec<&Socket> = self.v4.iter().chain(&self.v6).collect();
        let mut fds: Vec<PollFd> = socks
            .iter()
            .map(|s| PollFd::new(s.as_fd(), PollFlags::POLLIN))
            .collect();
        let ms = u16::try_from(wait.as_millis()).unwrap_or(u16::MAX).max(1);
        if poll(&mut fds, PollTimeout::from(ms)).ok()? == 0 {
            return None;
        }
        let ready = fds
            .iter()
            .position(|f| f.revents().is_some_and(|r| r.contains(PollFlags::POLLIN)))?;
        let mut buf = [0u8; 256];
        let (n, from) = nix::sys::socket::recvfrom::<nix::sys::socket::SockaddrStorage>(
            std::os::fd::AsRawFd::as_raw_fd(socks[ready]),
            &mut buf,
        )
        .ok()?;
        let data = &buf[..n];
        let from = match from? {
            f if f.as_sockaddr_in().is_some() => SocketAddr::V4((*f.as_sockaddr_in()?).into()),
            f => SocketAddr::V6((*f.as_sockaddr_in6()?).into()),
        };
        match from {
            // IPv4's raw socket reads from the IP header on.
            SocketAddr::V4(_) => {
                let (from, port, payload) = udp_of(data)?;
                Some((SocketAddr::V4(from), port, payload.to_vec()))
            }
            // IPv6's from the UDP header on (the source comes apart).
            SocketAddr::V6(a) => {
                let (port, payload) = udp_payload(data)?;
                Some((
                    SocketAddr::V6(SocketAddrV6::new(*a.ip(), port.0, 0, 0)),
                    port.1,
                    payload.to_vec(),
                ))
            }
        }
    }
}

/// The source, destination port and payload of an IPv4/UDP packet (as a
/// raw socket reads it, from the IP header on).
pub(super) fn udp_of(p: &[u8]) -> Option<(SocketAddrV4, u16, &[u8])> {
    let ihl = usize::from(p.first()? & 0x0f) * 4;
    if ihl < 20 || p.len() < ihl + 8 || p[0] >> 4 != 4 || p[9] != 17 {
        return None;
    }
    let src = Ipv4Addr::new(p[12], p[13], p[14], p[15]);
    let ((sport, dport), payload) = udp_payload(&p[ihl..])?;
    Some((SocketAddrV4::new(src, sport), dport, payload))
}

/// The ports (source, destination) and payload of a UDP datagram, from
/// its header on.
fn udp_payload(u: &[u8]) -> Option<((u16, u16), &[u8])> {
    if u.len() < 8 {
        return None;
    }
    let sport = u16::from_be_bytes([u[0], u[1]]);
    let dport = u16::from_be_bytes([u[2], u[3]]);
    Some(((sport, dport), &u[8..]))
}

/// Has the kernel compute the checksum at `offset` of what raw IPv6
/// socket `s` sends, and check it on what it reads (IPV6_CHECKSUM, RFC
/// 3542): IPv6 requires UDP's.
#[allow(unsafe_code)]
fn checksum_at(s: &Socket, offset: libc::c_int) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid socket descriptor, and a pointer to a c_int that
    // lives across the call with its exact size.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_IPV6,
            libc::IPV6_CHECKSUM,
            (&raw const offset).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A raw UDP socket of `family` that sees only discovery datagrams (their
/// payload starts with discovery's magic).
fn raw_socket(family: Domain) -> Result<Socket, String> {
    let v6 = family == Domain::IPV6;
    let sock = Socket::new(family, Type::RAW, Some(Protocol::UDP))
        .map_err(|e| format!("a raw UDP socket (needs CAP_NET_RAW): {e}"))?;
    let magic = u32::from_be_bytes(discovery::MAGIC[..4].try_into().unwrap());
    // Keep datagrams whose payload starts with "WEFT" (the first 4 bytes
    // of discovery's magic). IPv4's read from the IP header: x = its
    // length, the payload at x+8 (a fragment's offset makes x+8 land
    // elsewhere; discovery datagrams are never fragmented). IPv6's from
    // the UDP header: the payload at 8.
    let filter: &[SockFilter] = if v6 {
        &[
            SockFilter::new(0x20, 0, 0, 8),      // ld [8]
            SockFilter::new(0x15, 0, 1, magic),  // jeq magic, else drop
            SockFilter::new(0x06, 0, 0, 0xffff), // accept
            SockFilter::new(0x06, 0, 0, 0),      // drop
        ]
    } else {
        &[
            SockFilter::new(0xb1, 0, 0, 0),      // ldxb 4*([0]&0xf)
            SockFilter::new(0x40, 0, 0, 8),      // ld [x+8]
            SockFilter::new(0x15, 0, 1, magic),  // jeq magic, else drop
            SockFilter::new(0x06, 0, 0, 0xffff), // accept
            SockFilter::new(0x06, 0, 0, 0),      // drop
        ]
    };
    sock.attach_filter(filter)
        .map_err(|e| format!("cannot filter the raw socket: {e}"))?;
    if v6 {
        checksum_at(&sock, 6).map_err(|e| format!("cannot have the kernel checksum IPv6 UDP: {e}"))?;
    }
    // What arrived before the filter was attached.
    sock.set_nonblocking(true).map_err(|e| e.to_string())?;
    let mut buf = [0u8; 2048];
    while (&sock).read(&mut buf).is_ok() {}
    Ok(sock)
}
