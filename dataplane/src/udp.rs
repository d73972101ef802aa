//! The userspace WireGuard device's UDP socket, for both families: one
//! IPv6 socket that takes IPv4 too (IPV6_V6ONLY off), so a tunnel port
//! serves peers on an IPv4 and an IPv6 underlay alike, as kernel
//! WireGuard's does. The kernel shows an IPv4 peer on it as an
//! IPv4-mapped IPv6 address (`::ffff:a.b.c.d`); weft's endpoints stay
//! plain IPv4 (`canonical` on the way in, `mapped` on the way out). A
//! host without IPv6 gets an IPv4 socket.

use std::net::{IpAddr, Ipv6Addr, SocketAddr, UdpSocket};

use quinn_udp::UdpSocketState;

/// A socket on `port` for batches (see `relay::batch_socket`), for both
/// families where the host has IPv6 (true), else IPv4 only (false).
pub(crate) fn dual_batch_socket(port: u16) -> std::io::Result<(UdpSocket, UdpSocketState, bool)> {
    match dual(port) {
        Ok(s) => {
            let (s, st) = crate::relay::tuned(s)?;
            Ok((s, st, true))
        }
        Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {
            tracing::debug!(port, "no IPv6 on this host: the tunnel's socket takes IPv4 only");
            let (s, st) = crate::relay::batch_socket(port)?;
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
pub(crate) fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

/// A destination as a socket for both families (`dual`) takes it: IPv4
/// as IPv4-mapped IPv6.
pub(crate) fn mapped(a: SocketAddr, dual: bool) -> SocketAddr {
    match a.ip() {
        IpAddr::V4(v4) if dual => SocketAddr::new(IpAddr::V6(v4.to_ipv6_mapped()), a.port()),
        _ => a,
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
