//! Endpoint discovery's datagrams: a gateway sends a probe from a tunnel's
//! UDP port to a controller's reflector (UDP, on the controller's gRPC
//! address and port), which answers with the address and port it saw the
//! probe come from — behind NAT, the NAT's mapping of that tunnel socket.
//!
//! A probe is 64 bytes (magic, type 1, a 16-byte random nonce, zeros); an
//! answer is 32 (magic, type 2, the nonce, the IPv4 address and port) or,
//! to a probe that came over IPv6, 48 (magic, type 3, the nonce, the IPv6
//! address and port, zeros): an answer is smaller than the probe, so a
//! reflector amplifies nothing. The
//! magic's first byte is not a WireGuard message type (1 to 4), so a
//! WireGuard socket that sees an answer drops it. The gateway takes an
//! answer only from the reflector it probed, with the nonce it sent;
//! anything else is counted and ignored.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use serde::{Deserialize, Serialize};

/// The first 8 bytes of every discovery datagram.
pub const MAGIC: [u8; 8] = *b"WEFTDSC1";
pub const PROBE_LEN: usize = 64;
pub const ANSWER_LEN: usize = 32;
pub const ANSWER6_LEN: usize = 48;
const PROBE: u8 = 1;
const ANSWER: u8 = 2;
const ANSWER6: u8 = 3;

pub type Nonce = [u8; 16];

/// A probe carrying `nonce`.
pub fn probe(nonce: &Nonce) -> [u8; PROBE_LEN] {
    let mut p = [0u8; PROBE_LEN];
    p[..8].copy_from_slice(&MAGIC);
    p[8] = PROBE;
    p[9..25].copy_from_slice(nonce);
    p
}

/// The nonce of a well-formed probe; None for anything else.
pub fn parse_probe(d: &[u8]) -> Option<Nonce> {
    (d.len() == PROBE_LEN && d[..8] == MAGIC && d[8] == PROBE).then(|| d[9..25].try_into().unwrap())
}

/// The answer to the probe with `nonce`, seen from `from` (an
/// IPv4-mapped IPv6 address is answered as IPv4): [`ANSWER_LEN`] bytes for
/// IPv4, [`ANSWER6_LEN`] for IPv6.
pub fn answer(nonce: &Nonce, from: SocketAddr) -> Vec<u8> {
    let from = SocketAddr::new(from.ip().to_canonical(), from.port());
    let mut a = vec![0u8; if from.is_ipv4() { ANSWER_LEN } else { ANSWER6_LEN }];
    a[..8].copy_from_slice(&MAGIC);
    a[9..25].copy_from_slice(nonce);
    match from {
        SocketAddr::V4(v4) => {
            a[8] = ANSWER;
            a[25..29].copy_from_slice(&v4.ip().octets());
            a[29..31].copy_from_slice(&v4.port().to_be_bytes());
        }
        SocketAddr::V6(v6) => {
            a[8] = ANSWER6;
            a[25..41].copy_from_slice(&v6.ip().octets());
            a[41..43].copy_from_slice(&v6.port().to_be_bytes());
        }
    }
    a
}

/// The nonce and the address of a well-formed answer; None for anything
/// else.
pub fn parse_answer(d: &[u8]) -> Option<(Nonce, SocketAddr)> {
    if d.len() < 9 || d[..8] != MAGIC {
        return None;
    }
    let nonce: Nonce = d.get(9..25)?.try_into().ok()?;
    match (d[8], d.len()) {
        (ANSWER, ANSWER_LEN) => {
            let ip = Ipv4Addr::new(d[25], d[26], d[27], d[28]);
            let port = u16::from_be_bytes([d[29], d[30]]);
            Some((nonce, SocketAddr::V4(SocketAddrV4::new(ip, port))))
        }
        (ANSWER6, ANSWER6_LEN) => {
            let ip = Ipv6Addr::from(<[u8; 16]>::try_from(&d[25..41]).ok()?);
            let port = u16::from_be_bytes([d[41], d[42]]);
            // An IPv4 address never comes as IPv6.
            (ip.to_ipv4_mapped().is_none()).then(|| (nonce, SocketAddr::V6(SocketAddrV6::new(ip, port, 0, 0))))
        }
        _ => None,
    }
}

/// How a gateway's NAT maps its tunnel socket, as seen from reflectors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Behaviour {
    /// Seen at its own address: no NAT.
    None,
    /// One external port for every destination: hole punching works.
    EndpointIndependent,
    /// A new external port per destination: only a relay, or a forwarded
    /// port, gets through.
    EndpointDependent,
    /// No reflector answered (UDP blocked, or no reflector reachable).
    Unknown,
}

impl Behaviour {
    pub fn as_str(self) -> &'static str {
        match self {
            Behaviour::None => "none",
            Behaviour::EndpointIndependent => "endpoint-independent",
            Behaviour::EndpointDependent => "endpoint-dependent",
            Behaviour::Unknown => "unknown",
        }
    }

    /// None for "" (not probed); an error for anything else unknown.
    pub fn parse(s: &str) -> Result<Option<Behaviour>, String> {
        if s.is_empty() {
            return Ok(None);
        }
        [
            Behaviour::None,
            Behaviour::EndpointIndependent,
            Behaviour::EndpointDependent,
            Behaviour::Unknown,
        ]
        .into_iter()
        .find(|k| k.as_str() == s)
        .map(Some)
        .ok_or_else(|| {
            format!("{s:?} is not a NAT behaviour (none, endpoint-independent, endpoint-dependent, unknown)")
        })
    }

    /// From what reflectors saw (`seen`: per reflector that answered, the
    /// address the probe came from) and the socket's own addresses: no
    /// answer is unknown; only its own address (every reflector reached
    /// without NAT) is none; else, of the reflectors outside the NAT (a
    /// reflector on the same LAN sees the own address), one external
    /// address for all is endpoint-independent, several dependent.
    pub fn observed(seen: &[SocketAddr], own: &[SocketAddr]) -> Behaviour {
        if seen.is_empty() {
            return Behaviour::Unknown;
        }
        let outside: Vec<&SocketAddr> = seen.iter().filter(|s| !own.contains(s)).collect();
        match outside.first() {
            None => Behaviour::None,
            Some(first) if outside.iter().all(|s| s == first) => Behaviour::EndpointIndependent,
            Some(_) => Behaviour::EndpointDependent,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nat_behaviour_follows_what_the_reflectors_saw() {
        let a: SocketAddr = "198.51.100.1:51820".parse().unwrap();
        let b: SocketAddr = "198.51.100.1:40001".parse().unwrap();
        let own: SocketAddr = "192.168.1.2:51820".parse().unwrap();
        assert_eq!(Behaviour::observed(&[], &[own]), Behaviour::Unknown);
        assert_eq!(Behaviour::observed(&[own, own], &[own]), Behaviour::None);
        assert_eq!(Behaviour::observed(&[a, a], &[own]), Behaviour::EndpointIndependent);
        assert_eq!(Behaviour::observed(&[a], &[own]), Behaviour::EndpointIndependent);
        assert_eq!(Behaviour::observed(&[a, b], &[own]), Behaviour::EndpointDependent);
        for s in ["none", "endpoint-independent", "endpoint-dependent", "unknown"] {
            assert_eq!(Behaviour::parse(s).unwrap().unwrap().as_str(), s);
        }
        assert_eq!(Behaviour::parse("").unwrap(), None);
        assert!(
            Behaviour::parse("full-cone")
                .unwrap_err()
                .contains("not a NAT behaviour")
        );
        // A reflector on the LAN sees the own address; the outside ones decide.
        assert_eq!(Behaviour::observed(&[own, a], &[own]), Behaviour::EndpointIndependent);
    }

    #[test]
    fn probes_and_answers_round_trip_and_nothing_else_parses() {
        let n = [7u8; 16];
        let p = probe(&n);
        assert_eq!(parse_probe(&p), Some(n));
        assert_eq!(parse_answer(&p), None);
        let from: SocketAddr = "198.51.100.7:40001".parse().unwrap();
        let a = answer(&n, from);
        assert!(a.len() < p.len(), "an answer never amplifies");
        assert_eq!(parse_answer(&a), Some((n, from)));
        assert_eq!(parse_probe(&a), None);
        // Over IPv6: its own type, still smaller than the probe.
        let from6: SocketAddr = "[2001:db8::7]:40001".parse().unwrap();
        let a6 = answer(&n, from6);
        assert!(a6.len() < p.len(), "an answer never amplifies");
        assert_eq!(parse_answer(&a6), Some((n, from6)));
        assert_eq!(parse_answer(&a6[..40]), None);
        // An IPv4 sender seen on a socket for both families is IPv4.
        let mapped: SocketAddr = "[::ffff:198.51.100.7]:40001".parse().unwrap();
        assert_eq!(answer(&n, mapped), a);
        // A type 3 answer that carries an IPv4-mapped address is refused.
        let mut forged = a6.clone();
        forged[25..41].copy_from_slice(&"::ffff:198.51.100.7".parse::<Ipv6Addr>().unwrap().octets());
        assert_eq!(parse_answer(&forged), None);
        // A type 2 answer of the IPv6 length, or the other way round: no.
        let mut wrong = a6.clone();
        wrong[8] = ANSWER;
        assert_eq!(parse_answer(&wrong), None);
        assert_eq!(parse_probe(&p[..63]), None);
        let mut wg = p;
        wg[0] = 1;
        assert_eq!(parse_probe(&wg), None);
    }
}
