//! The device's UDP socket ([`UdpBind`]) and the batched sends and
//! receives it shares with weft's relay (quinn-udp: recvmmsg and GRO in,
//! GSO out; large buffers; fragments allowed).
//!
//! The device's socket serves both families: one
//! IPv6 socket that takes IPv4 too (IPV6_V6ONLY off), so a tunnel port
//! serves peers on an IPv4 and an IPv6 underlay alike, as kernel
//! WireGuard's does. The kernel shows an IPv4 peer on it as an
//! IPv4-mapped IPv6 address (`::ffff:a.b.c.d`); weft's endpoints stay
//! plain IPv4 (`canonical` on the way in, `mapped` on the way out). A
//! host without IPv6 gets an IPv4 socket.

use std::io::IoSliceMut;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::{AsFd, BorrowedFd};

use quinn_udp::{RecvMeta, Transmit, UdpSocketState};

/// Socket buffers: 7 MiB, room for a burst at several Gbit/s.
const SOCKET_BUFFER: usize = 7 << 20;
/// How long a send waits for room in a full socket buffer (ms), twice,
/// before the datagrams are dropped.
const ROOM_MS: u16 = 20;

/// The device's UDP socket on the host: one socket for both families
/// where the host has IPv6, batched through quinn-udp.
pub struct UdpBind {
    socket: UdpSocket,
    state: UdpSocketState,
    /// The socket takes both families (IPv4 peers as IPv4-mapped IPv6).
    dual: bool,
}

impl UdpBind {
    /// Binds `port` (0: any) on every address, for both families where the
    /// host has IPv6.
    pub fn bind(port: u16) -> std::io::Result<UdpBind> {
        let (socket, state, dual) = dual_batch_socket(port)?;
        Ok(UdpBind { socket, state, dual })
    }
}

impl AsFd for UdpBind {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }
}

impl crate::Bind for UdpBind {
    fn recv(&self, bufs: &mut [IoSliceMut<'_>], meta: &mut [RecvMeta]) -> std::io::Result<usize> {
        let n = self.state.recv((&self.socket).into(), bufs, meta)?;
        for m in &mut meta[..n] {
            m.addr = canonical(m.addr);
        }
        Ok(n)
    }

    fn send(&self, to: SocketAddr, data: &[u8], stride: usize) -> bool {
        send_datagrams(&self.socket, &self.state, mapped(to, self.dual), None, data, stride)
    }

    fn max_gso_segments(&self) -> usize {
        self.state.max_gso_segments()
    }

    fn gro_segments(&self) -> usize {
        self.state.gro_segments()
    }

    fn send_ttl(&self, to: SocketAddr, data: &[u8], ttl: u8) -> bool {
        use nix::sys::socket::{ControlMessage, MsgFlags, SockaddrStorage, sendmsg};
        use std::os::fd::AsRawFd;
        let to = mapped(to, self.dual);
        let ttl = libc::c_int::from(ttl);
        // An IPv4 peer on the socket for both families is still IPv4's
        // TTL (the kernel sends it as IPv4).
        let cmsg = match to {
            SocketAddr::V6(a) if a.ip().to_ipv4_mapped().is_none() => ControlMessage::Ipv6HopLimit(&ttl),
            _ => ControlMessage::Ipv4Ttl(&ttl),
        };
        let addr = SockaddrStorage::from(to);
        sendmsg(
            self.socket.as_raw_fd(),
            &[std::io::IoSlice::new(data)],
            &[cmsg],
            MsgFlags::empty(),
            Some(&addr),
        )
        .is_ok()
    }
}

/// A socket on `port` for batches (see [`batch_socket`]), for both
/// families where the host has IPv6 (true: IPv4 peers come and go as
/// IPv4-mapped IPv6, see [`canonical`] and [`mapped`]), else IPv4 only
/// (false).
pub fn dual_batch_socket(port: u16) -> std::io::Result<(UdpSocket, UdpSocketState, bool)> {
    match dual(port) {
        Ok(s) => {
            let (s, st) = tuned(s)?;
            Ok((s, st, true))
        }
        Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {
            tracing::debug!(port, "no IPv6 on this host: the tunnel's socket takes IPv4 only");
            let (s, st) = batch_socket(port)?;
            Ok((s, st, false))
        }
        Err(e) => Err(e),
    }
}

fn dual(port: u16) -> std::io::Result<UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::IPV6, Type::DGRAM, Some(Protocol::UDP))?;
    s.set_only_v6(false)?;
    s.bind(&SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)).into())?;
    Ok(s.into())
}

/// A sender as weft names it: an IPv4-mapped address as the IPv4 one.
pub fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

/// A destination as a socket for both families (`dual`) takes it: IPv4
/// as IPv4-mapped IPv6.
pub fn mapped(a: SocketAddr, dual: bool) -> SocketAddr {
    match a.ip() {
        IpAddr::V4(v4) if dual => SocketAddr::new(IpAddr::V6(v4.to_ipv6_mapped()), a.port()),
        _ => a,
    }
}

/// Waits until `socket` is ready for `events` or `ms` pass.
pub fn wait(socket: &UdpSocket, events: nix::poll::PollFlags, ms: u16) {
    use std::os::fd::AsFd;
    let mut fds = [nix::poll::PollFd::new(socket.as_fd(), events)];
    let _ = nix::poll::poll(&mut fds, ms);
}

/// A UDP socket on `port` (all IPv4 addresses) for datagrams in batches:
/// non-blocking (waited on with poll: quinn-udp's recvmmsg on a blocking
/// socket would wait for a whole batch), 7 MiB buffers, quinn-udp's state
/// (GSO, GRO), fragments allowed.
pub fn batch_socket(port: u16) -> std::io::Result<(UdpSocket, UdpSocketState)> {
    tuned(UdpSocket::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)))?)
}

/// `socket` set up for batches, as [`batch_socket`] says.
pub fn tuned(socket: UdpSocket) -> std::io::Result<(UdpSocket, UdpSocketState)> {
    use nix::sys::socket::{setsockopt, sockopt};
    socket.set_nonblocking(true)?;
    // FORCE: past the host's rmem_max (the agent has CAP_NET_ADMIN); the
    // plain option as the fallback.
    if setsockopt(&socket, sockopt::RcvBufForce, &SOCKET_BUFFER).is_err() {
        let _ = setsockopt(&socket, sockopt::RcvBuf, &SOCKET_BUFFER);
    }
    if setsockopt(&socket, sockopt::SndBufForce, &SOCKET_BUFFER).is_err() {
        let _ = setsockopt(&socket, sockopt::SndBuf, &SOCKET_BUFFER);
    }
    let state = UdpSocketState::new((&socket).into())?;
    // quinn-udp forbids fragmentation (QUIC sizes its own packets); these
    // datagrams were not sized for the path (a relayed gateway's, or
    // WireGuard's over an underlay of smaller MTU): one larger than the
    // path leaves in fragments, as kernel WireGuard's do.
    allow_fragments(&socket)?;
    Ok((socket, state))
}

/// `IP_MTU_DISCOVER` = `IP_PMTUDISC_DONT` on `socket` (and IPv6's
/// counterparts on an IPv6 socket), which neither nix nor socket2 wraps.
fn allow_fragments(socket: &UdpSocket) -> std::io::Result<()> {
    set_int(socket, libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_DONT)?;
    // An IPv6 socket (for both families): IPv6's too (the sender
    // fragments there).
    if socket.local_addr()?.is_ipv6() {
        set_int(
            socket,
            libc::IPPROTO_IPV6,
            libc::IPV6_MTU_DISCOVER,
            libc::IPV6_PMTUDISC_DONT,
        )?;
        set_int(socket, libc::IPPROTO_IPV6, libc::IPV6_DONTFRAG, 0)?;
    }
    Ok(())
}

#[allow(unsafe_code)]
fn set_int(socket: &UdpSocket, level: libc::c_int, name: libc::c_int, value: libc::c_int) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid open socket of ours, and a pointer to an int that
    // lives for the call, with its size.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Sends `chunk` (datagrams of `stride` bytes, the last maybe shorter, no
/// more than `state` may segment) to `to` from `socket` (from address
/// `local` when known), in one call when it can segment them, waiting a
/// little for room when its buffer is full; a segmented send the kernel
/// refuses (a datagram over the path's MTU) goes again one datagram at a
/// time.
pub fn send_datagrams(
    socket: &UdpSocket,
    state: &UdpSocketState,
    to: SocketAddr,
    local: Option<IpAddr>,
    chunk: &[u8],
    stride: usize,
) -> bool {
    let one = |contents: &[u8], segment: Option<usize>| {
        let t = Transmit {
            destination: to,
            ecn: None,
            contents,
            segment_size: segment,
            src_ip: local,
        };
        for _ in 0..3 {
            match state.try_send(socket.into(), &t) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    wait(socket, nix::poll::PollFlags::POLLOUT, ROOM_MS);
                }
                Err(e) => return Err(e),
            }
        }
        Err(std::io::ErrorKind::WouldBlock.into())
    };
    if chunk.len() <= stride {
        return one(chunk, None).is_ok();
    }
    match one(chunk, Some(stride)) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
        Err(e) => {
            tracing::debug!(error = %e, "relay: a segmented send refused, sending one by one");
            chunk.chunks(stride).all(|d| one(d, None).is_ok())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_peers_keep_their_ipv4_names_on_a_socket_for_both_families() {
        let v4: SocketAddr = "192.0.2.7:51820".parse().unwrap();
        let seen: SocketAddr = "[::ffff:192.0.2.7]:51820".parse().unwrap();
        assert_eq!(canonical(seen), v4);
        assert_eq!(mapped(v4, true), seen);
        assert_eq!(mapped(v4, false), v4);
        let v6: SocketAddr = "[2001:db8::7]:51820".parse().unwrap();
        assert_eq!((canonical(v6), mapped(v6, true)), (v6, v6));
    }

    /// One socket, both families: an IPv4 and an IPv6 sender reach it,
    /// each seen under its own name, and each gets its answer (loopback).
    #[test]
    fn one_socket_talks_to_both_families() {
        let (s, _, dual) = dual_batch_socket(0).unwrap();
        if !dual {
            return; // no IPv6 here: nothing to show
        }
        s.set_nonblocking(false).unwrap();
        let port = s.local_addr().unwrap().port();
        for (client, at) in [("127.0.0.1:0", "127.0.0.1"), ("[::1]:0", "::1")] {
            let c = UdpSocket::bind(client).unwrap();
            let to = SocketAddr::new(at.parse().unwrap(), port);
            c.send_to(b"hi", to).unwrap();
            let mut buf = [0u8; 8];
            let (n, from) = s.recv_from(&mut buf).unwrap();
            assert_eq!((&buf[..n], canonical(from)), (&b"hi"[..], c.local_addr().unwrap()));
            s.send_to(b"ok", mapped(canonical(from), dual)).unwrap();
            let (n, _) = c.recv_from(&mut buf).unwrap();
            assert_eq!(&buf[..n], b"ok");
        }
    }
}
