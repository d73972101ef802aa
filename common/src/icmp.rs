//! Raw ICMP echo: a request on a raw socket and its answer (or the
//! unreachable message about it), for path-MTU checks and `weftctl test
//! network`.

use std::io::Read;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

/// The Internet checksum of `data`.
fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = data
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An echo request of type `kind` (8: ICMP, 128: ICMPv6), `len` bytes (at
/// least 16), its checksum left zero.
fn echo_request(kind: u8, id: u16, seq: u16, len: u32) -> Vec<u8> {
    let mut req = vec![0u8; len.max(16) as usize];
    req[0] = kind;
    req[4..6].copy_from_slice(&id.to_be_bytes());
    req[6..8].copy_from_slice(&seq.to_be_bytes());
    req[8..12].copy_from_slice(b"weft");
    req
}

/// A raw ICMP socket (root or CAP_NET_RAW): unlike a ping socket it needs
/// no sysctl, so it works in any namespace, the host's included.
pub fn raw_icmp_socket() -> std::io::Result<Socket> {
    Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::ICMPV4))
}

/// Sends one ICMP echo of `size` bytes (IP header included) to `to` on raw
/// socket `s` and waits for its answer. `Err`: the send failed (EMSGSIZE
/// with DF set: larger than the path MTU). `Ok(Err)`: no answer, or an
/// unreachable message about it.
pub fn raw_echo(
    s: &Socket,
    to: Ipv4Addr,
    id: u16,
    seq: u16,
    size: u32,
    wait: Duration,
) -> std::io::Result<Result<Duration, String>> {
    let mut req = echo_request(8, id, seq, size.saturating_sub(20));
    let sum = checksum(&req);
    req[2..4].copy_from_slice(&sum.to_be_bytes());
    let sent = Instant::now();
    s.send_to(&req, &SockAddr::from(SocketAddrV4::new(to, 0)))?;
    let mut pkt = vec![0u8; 65536];
    loop {
        let left = wait.saturating_sub(sent.elapsed());
        if left.is_zero() {
            return Ok(Err(format!("no answer within {wait:?}")));
        }
        s.set_read_timeout(Some(left))?;
        // A raw socket hands back whole IP packets: the sender is in the
        // header.
        let n = match (&*s).read(&mut pkt) {
            Ok(n) => n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
            Err(e) => return Err(e),
        };
        if n < 28 {
            continue;
        }
        let from = Ipv4Addr::new(pkt[12], pkt[13], pkt[14], pkt[15]);
        let icmp = &pkt[usize::from(pkt[0] & 0x0f) * 4..n];
        if icmp.len() < 8 {
            continue;
        }
        if from == to && icmp[0] == 0 && icmp[4..6] == id.to_be_bytes() && icmp[6..8] == seq.to_be_bytes() {
            return Ok(Ok(sent.elapsed()));
        }
        // Destination unreachable (or fragmentation needed) about this echo.
        if icmp[0] == 3 && icmp.len() >= 36 {
            let inner = &icmp[8..];
            let at = usize::from(inner[0] & 0x0f) * 4;
            if inner.get(at + 4..at + 8) == Some(&[id.to_be_bytes(), seq.to_be_bytes()].concat()[..]) {
                return Ok(Err(format!("unreachable (ICMP code {}) from {from}", icmp[1])));
            }
        }
    }
}

/// A raw ICMPv6 socket (root or CAP_NET_RAW).
pub fn raw_icmp6_socket() -> std::io::Result<Socket> {
    Socket::new(Domain::IPV6, Type::RAW, Some(Protocol::ICMPV6))
}

/// [`raw_echo`] for IPv6, on a [`raw_icmp6_socket`]: one echo request of
/// `size` bytes (its IPv6 header included; at least 56) to `to`, and its
/// answer or the unreachable (or packet too big) message about it. The
/// kernel fills in ICMPv6's checksum, which covers the addresses (RFC
/// 3542).
pub fn raw_echo6(
    s: &Socket,
    to: Ipv6Addr,
    id: u16,
    seq: u16,
    size: u32,
    wait: Duration,
) -> std::io::Result<Result<Duration, String>> {
    let req = echo_request(128, id, seq, size.saturating_sub(40));
    let sent = Instant::now();
    s.send_to(&req, &SockAddr::from(SocketAddrV6::new(to, 0, 0, 0)))?;
    let mut buf = vec![0u8; 65536];
    let ours = [id.to_be_bytes(), seq.to_be_bytes()].concat();
    loop {
        let left = wait.saturating_sub(sent.elapsed());
        if left.is_zero() {
            return Ok(Err(format!("no answer within {wait:?}")));
        }
        s.set_read_timeout(Some(left))?;
        // Unlike IPv4's, a raw ICMPv6 socket hands back the message alone;
        // the sender comes with it.
        let (n, from) = match nix::sys::socket::recvfrom::<nix::sys::socket::SockaddrIn6>(s.as_raw_fd(), &mut buf) {
            Ok(r) => r,
            Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        };
        let Some(from) = from.map(|a| a.ip()) else { continue };
        let icmp = &buf[..n];
        if icmp.len() < 8 {
            continue;
        }
        if from == to && icmp[0] == 129 && icmp[4..8] == ours {
            return Ok(Ok(sent.elapsed()));
        }
        // Destination unreachable (1) or packet too big (2) about this
        // echo: its IPv6 header (40 bytes) then our request.
        if matches!(icmp[0], 1 | 2) && icmp.len() >= 8 + 40 + 8 {
            let inner = &icmp[8 + 40..];
            if inner[0] == 128 && inner[4..8] == ours {
                return Ok(Err(format!(
                    "unreachable (ICMPv6 type {} code {}) from {from}",
                    icmp[0], icmp[1]
                )));
            }
        }
    }
}
