//! Endpoint discovery's datagrams: a gateway sends a probe from a tunnel's
//! UDP port to a controller's reflector (UDP, on the controller's gRPC
//! address and port), which answers with the address and port it saw the
//! probe come from — behind NAT, the NAT's mapping of that tunnel socket.
//!
//! A probe is 64 bytes (magic, type 1, a 16-byte random nonce, zeros) and
//! an answer 32 (magic, type 2, the nonce, the IPv4 address and port): the
//! answer is smaller than the probe, so a reflector amplifies nothing. The
//! magic's first byte is not a WireGuard message type (1 to 4), so a
//! WireGuard socket that sees an answer drops it. The gateway takes an
//! answer only from the reflector it probed, with the nonce it sent;
//! anything else is counted and ignored.

use std::net::{Ipv4Addr, SocketAddrV4};

use serde::{Deserialize, Serialize};

/// The first 8 bytes of every discovery datagram.
pub const MAGIC: [u8; 8] = *b"WEFTDSC1";
pub const PROBE_LEN: usize = 64;
pub const ANSWER_LEN: usize = 32;
const PROBE: u8 = 1;
const ANSWER: u8 = 2;

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

/// The answer to the probe with `nonce`, seen from `from`.
pub fn answer(nonce: &Nonce, from: SocketAddrV4) -> [u8; ANSWER_LEN] {
    let mut a = [0u8; ANSWER_LEN];
    a[..8].copy_from_slice(&MAGIC);
    a[8] = ANSWER;
    a[9..25].copy_from_slice(nonce);
    a[25..29].copy_from_slice(&from.ip().octets());
    a[29..31].copy_from_slice(&from.port().to_be_bytes());
    a
}

/// The nonce and the address of a well-formed answer; None for anything
/// else.
pub fn parse_answer(d: &[u8]) -> Option<(Nonce, SocketAddrV4)> {
    if d.len() != ANSWER_LEN || d[..8] != MAGIC || d[8] != ANSWER {
        return None;
    }
    let ip = Ipv4Addr::new(d[25], d[26], d[27], d[28]);
    let port = u16::from_be_bytes([d[29], d[30]]);
    Some((d[9..25].try_into().unwrap(), SocketAddrV4::new(ip, port)))
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
    pub fn observed(seen: &[SocketAddrV4], own: &[SocketAddrV4]) -> Behaviour {
        if seen.is_empty() {
            return Behaviour::Unknown;
        }
        let outside: Vec<&SocketAddrV4> = seen.iter().filter(|s| !own.contains(s)).collect();
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
        let a: SocketAddrV4 = "198.51.100.1:51820".parse().unwrap();
        let b: SocketAddrV4 = "198.51.100.1:40001".parse().unwrap();
        let own: SocketAddrV4 = "192.168.1.2:51820".parse().unwrap();
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
        let from: SocketAddrV4 = "198.51.100.7:40001".parse().unwrap();
        let a = answer(&n, from);
        assert!(a.len() < p.len(), "an answer never amplifies");
        assert_eq!(parse_answer(&a), Some((n, from)));
        assert_eq!(parse_probe(&a), None);
        assert_eq!(parse_probe(&p[..63]), None);
        let mut wg = p;
        wg[0] = 1;
        assert_eq!(parse_probe(&wg), None);
    }
}
