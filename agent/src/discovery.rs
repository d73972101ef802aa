//! Endpoint discovery for one peering's tunnel: where the outside sees the
//! tunnel's UDP socket, and how the gateway's NAT maps it.
//!
//! The probe must leave from the tunnel's own address and port, since the
//! NAT's mapping belongs to that socket, but the WireGuard device owns the
//! socket (the kernel module's or boringtun's), and weft cannot send
//! through it. So the probe is written on a raw UDP socket with the
//! tunnel's port as its source port: to the host's routing, to the NAT and
//! to the reflector it is a datagram of the tunnel's socket. The answer
//! comes back to that port; the WireGuard device drops it (not a WireGuard
//! message), and the raw socket gets a copy, which a socket filter in the
//! kernel narrows to discovery datagrams for this port (nothing of the
//! tunnel's traffic reaches the agent).
//!
//! Every [`EVERY`] a round probes each reflector (the peer's controllers,
//! given in the desired state, and this agent's own), takes only answers
//! from the reflector probed carrying the nonce sent (anything else is
//! counted as ignored), and keeps the candidates (the underlay address and
//! each address seen from outside) and the NAT behaviour they show.

use std::io::Read;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, SockAddr, SockFilter, Socket, Type};
use weft_common::discovery::{self, Behaviour, Nonce};
use weft_proto::v1 as pb;

/// Between two rounds once one was answered.
pub const EVERY: Duration = Duration::from_secs(5);
/// Between two rounds while none was (a new tunnel: its peer waits for the
/// candidates).
const RETRY: Duration = Duration::from_secs(1);
/// How long a round waits for its answers.
const WAIT: Duration = Duration::from_millis(800);
/// The most reflectors a round probes.
const MAX_REFLECTORS: usize = 8;

/// What to discover: the tunnel's port, where to ask, the host's underlay
/// address (a candidate of its own).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub port: u16,
    pub reflectors: Vec<String>,
    pub underlay: Option<Ipv4Addr>,
}

/// What the latest round found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Found {
    pub candidates: Vec<pb::Candidate>,
    pub nat: String,
}

/// A running discovery; its thread ends when dropped.
pub struct Discoverer {
    stop: Arc<AtomicBool>,
    pub found: Arc<Mutex<Option<Found>>>,
}

impl Drop for Discoverer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Starts discovering for `t`; `changed` is called when what was found
/// changes (so the agent reports it at once).
pub fn start(t: Target, changed: impl Fn() + Send + 'static) -> Result<Discoverer, String> {
    let stop = Arc::new(AtomicBool::new(false));
    let found = Arc::new(Mutex::new(None));
    let (s, f) = (stop.clone(), found.clone());
    let sock = raw_socket(t.port)?;
    std::thread::Builder::new()
        .name(format!("weft-discover-{}", t.port))
        .spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let new = round(&t, &sock, &s);
                let answered = new.nat != Behaviour::Unknown.as_str();
                // The lock only to compare and swap: the agent's report
                // reads it.
                let differs = {
                    let mut cur = f.lock().unwrap();
                    let differs = cur.as_ref() != Some(&new);
                    if differs {
                        tracing::info!(port = t.port, nat = %new.nat, candidates = ?new.candidates, "endpoint discovery");
                        *cur = Some(new);
                    }
                    differs
                };
                if differs {
                    changed();
                }
                // Until the next round, anything that arrives is no answer
                // to a probe: counted and ignored.
                let next = Instant::now() + if answered { EVERY } else { RETRY };
                while !s.load(Ordering::Relaxed) && Instant::now() < next {
                    let wait = next
                        .saturating_duration_since(Instant::now())
                        .min(Duration::from_millis(200));
                    if let Some((from, _)) = receive(&sock, t.port, wait) {
                        tracing::debug!(%from, "endpoint discovery: an answer not probed for, ignored");
                        crate::metrics::get().discovery("ignored");
                    }
                }
            }
        })
        .map_err(|e| format!("cannot start endpoint discovery: {e}"))?;
    Ok(Discoverer { stop, found })
}

/// The reflectors of `list` (host:port, names resolved) that a probe may
/// go to: IPv4 unicast, not on this host, at most [`MAX_REFLECTORS`].
pub fn reflectors(list: &[String]) -> Vec<SocketAddrV4> {
    let mut out: Vec<SocketAddrV4> = Vec::new();
    for r in list {
        let Ok(addrs) = r.to_socket_addrs() else {
            tracing::debug!(reflector = %r, "endpoint discovery: cannot resolve");
            continue;
        };
        for a in addrs {
            let SocketAddr::V4(a) = a else { continue };
            let ip = a.ip();
            let usable =
                !(ip.is_loopback() || ip.is_unspecified() || ip.is_multicast() || ip.is_broadcast()) && a.port() != 0;
            if usable && !out.contains(&a) && out.len() < MAX_REFLECTORS {
                out.push(a);
            }
        }
    }
    out
}

/// One round: probe every reflector, wait for their answers.
fn round(t: &Target, sock: &Socket, stop: &AtomicBool) -> Found {
    let targets = reflectors(&t.reflectors);
    let mut sent: Vec<(SocketAddrV4, Nonce)> = Vec::new();
    for r in &targets {
        let mut nonce = [0u8; 16];
        if ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut nonce).is_err() {
            continue;
        }
        let mut d = Vec::with_capacity(8 + discovery::PROBE_LEN);
        d.extend_from_slice(&t.port.to_be_bytes());
        d.extend_from_slice(&r.port().to_be_bytes());
        d.extend_from_slice(&((8 + discovery::PROBE_LEN) as u16).to_be_bytes());
        // No checksum: optional for UDP over IPv4 (and NATs keep it 0).
        d.extend_from_slice(&[0, 0]);
        d.extend_from_slice(&discovery::probe(&nonce));
        let to = SockAddr::from(SocketAddrV4::new(*r.ip(), 0));
        match sock.send_to(&d, &to) {
            Ok(_) => sent.push((*r, nonce)),
            Err(e) => tracing::debug!(reflector = %r, error = %e, "endpoint discovery: probe not sent"),
        }
    }
    let seen = collect(sock, t.port, &sent, stop);
    // The socket's own addresses: the underlay, and the source address the
    // host picks toward each reflector (a connected UDP socket sends
    // nothing; it only asks the routing).
    let mut own: Vec<SocketAddrV4> = t.underlay.map(|ip| SocketAddrV4::new(ip, t.port)).into_iter().collect();
    for r in &targets {
        let src = std::net::UdpSocket::bind("0.0.0.0:0").and_then(|u| u.connect(r).and_then(|()| u.local_addr()));
        if let Ok(SocketAddr::V4(a)) = src {
            let a = SocketAddrV4::new(*a.ip(), t.port);
            if !own.contains(&a) {
                own.push(a);
            }
        }
    }
    let nat = Behaviour::observed(&seen, &own);
    let mut candidates: Vec<pb::Candidate> = own
        .iter()
        .map(|a| pb::Candidate {
            address: a.to_string(),
            kind: "local".into(),
        })
        .collect();
    for s in seen.iter().filter(|s| !own.contains(s)) {
        let c = pb::Candidate {
            address: s.to_string(),
            kind: "reflexive".into(),
        };
        if !candidates.contains(&c) {
            candidates.push(c);
        }
    }
    candidates.truncate(MAX_REFLECTORS);
    Found {
        candidates,
        nat: nat.as_str().to_string(),
    }
}

/// Reads answers until each probe in `sent` has one or the wait is over;
/// per reflector, the address it saw (in the order probed).
fn collect(sock: &Socket, port: u16, sent: &[(SocketAddrV4, Nonce)], stop: &AtomicBool) -> Vec<SocketAddrV4> {
    let m = crate::metrics::get();
    let mut answers: Vec<Option<SocketAddrV4>> = vec![None; sent.len()];
    let deadline = Instant::now() + WAIT;
    while answers.iter().any(Option::is_none) && !stop.load(Ordering::Relaxed) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let Some((from, payload)) = receive(sock, port, left) else {
            continue;
        };
        let taken = discovery::parse_answer(&payload).and_then(|(nonce, seen)| {
            let i = sent.iter().position(|(r, n)| *r == from && *n == nonce)?;
            answers[i].is_none().then_some((i, seen))
        });
        match taken {
            Some((i, seen)) => {
                answers[i] = Some(seen);
                m.discovery("answered");
            }
            None => {
                tracing::debug!(%from, "endpoint discovery: an answer not probed for, ignored");
                m.discovery("ignored");
            }
        }
    }
    for _ in answers.iter().filter(|a| a.is_none()) {
        m.discovery("unanswered");
    }
    answers.into_iter().flatten().collect()
}

/// One discovery datagram to `port` within `wait`: its source and payload.
fn receive(sock: &Socket, port: u16, wait: Duration) -> Option<(SocketAddrV4, Vec<u8>)> {
    if wait.is_zero() || sock.set_read_timeout(Some(wait)).is_err() {
        return None;
    }
    let mut buf = [0u8; 256];
    let n = (&*sock).read(&mut buf).ok()?;
    let (from, dst_port, payload) = udp_of(&buf[..n])?;
    (dst_port == port).then(|| (from, payload.to_vec()))
}

/// The source, destination port and payload of an IPv4/UDP packet (as a
/// raw socket reads it, from the IP header on).
fn udp_of(p: &[u8]) -> Option<(SocketAddrV4, u16, &[u8])> {
    let ihl = usize::from(p.first()? & 0x0f) * 4;
    if p.len() < ihl + 8 || p[0] >> 4 != 4 || p[9] != 17 {
        return None;
    }
    let src = Ipv4Addr::new(p[12], p[13], p[14], p[15]);
    let u = &p[ihl..];
    let sport = u16::from_be_bytes([u[0], u[1]]);
    let dport = u16::from_be_bytes([u[2], u[3]]);
    Some((SocketAddrV4::new(src, sport), dport, &u[8..]))
}

/// A raw UDP socket that sees only discovery datagrams to `port`.
fn raw_socket(port: u16) -> Result<Socket, String> {
    let sock = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::UDP))
        .map_err(|e| format!("a raw UDP socket (needs CAP_NET_RAW): {e}"))?;
    // From the IP header: x = its length; the UDP destination port is at
    // x+2, the payload at x+8; keep datagrams to `port` whose payload
    // starts with discovery's magic ("WEFT").
    let magic = u32::from_be_bytes(discovery::MAGIC[..4].try_into().unwrap());
    let filter = [
        SockFilter::new(0xb1, 0, 0, 0),               // ldxb 4*([0]&0xf)
        SockFilter::new(0x48, 0, 0, 2),               // ldh [x+2]
        SockFilter::new(0x15, 0, 3, u32::from(port)), // jeq port, else drop
        SockFilter::new(0x40, 0, 0, 8),               // ld [x+8]
        SockFilter::new(0x15, 0, 1, magic),           // jeq magic, else drop
        SockFilter::new(0x06, 0, 0, 0xffff),          // accept
        SockFilter::new(0x06, 0, 0, 0),               // drop
    ];
    sock.attach_filter(&filter)
        .map_err(|e| format!("cannot filter the raw socket: {e}"))?;
    // What arrived before the filter was attached.
    sock.set_nonblocking(true).map_err(|e| e.to_string())?;
    let mut buf = [0u8; 2048];
    while (&sock).read(&mut buf).is_ok() {}
    sock.set_nonblocking(false).map_err(|e| e.to_string())?;
    Ok(sock)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reflectors_are_unicast_addresses_off_this_host() {
        let list: Vec<String> = [
            "127.0.0.1:7443",
            "198.51.100.2:7443",
            "224.0.0.1:7443",
            "198.51.100.2:7443",
            "0.0.0.0:1",
            "not an address",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(
            reflectors(&list),
            vec!["198.51.100.2:7443".parse::<SocketAddrV4>().unwrap()]
        );
    }

    #[test]
    fn a_udp_packet_is_read_from_its_ip_header() {
        let mut p = vec![
            0x45, 0, 0, 36, 0, 0, 0, 0, 64, 17, 0, 0, 198, 51, 100, 2, 192, 168, 1, 2,
        ];
        p.extend_from_slice(&[0x1d, 0x13, 0xca, 0x6c, 0, 16, 0, 0]);
        p.extend_from_slice(b"WEFTDSC1");
        let (from, dport, payload) = udp_of(&p).unwrap();
        assert_eq!(from, "198.51.100.2:7443".parse().unwrap());
        assert_eq!(dport, 51820);
        assert_eq!(payload, b"WEFTDSC1");
        assert_eq!(udp_of(&p[..22]), None);
    }
}
