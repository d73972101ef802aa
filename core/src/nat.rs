//! NAT traversal's vocabulary and checks: the candidates at which a
//! gateway's tunnel socket may be reached, the NAT behaviour its endpoint
//! discovery observed, and the path a tunnel takes because of both.
//!
//! A gateway reports its candidates per peering (each peering has its own
//! UDP port, so its own NAT mapping); its controller records them and sends
//! the configured and reflexive ones to the peer in `GatewayInfo`. Whatever
//! arrives, from an agent or a peer, is checked here before it is recorded.

use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};
use weft_proto::v1 as pb;

/// The most candidates a gateway lists per peering.
pub const MAX_CANDIDATES: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CandidateKind {
    /// The gateway's `--endpoint` (with the peering's port).
    Configured,
    /// Where a reflector saw the tunnel socket from outside.
    Reflexive,
    /// The gateway's own underlay address (only shown, never sent to peers).
    Local,
}

impl CandidateKind {
    pub fn as_str(self) -> &'static str {
        match self {
            CandidateKind::Configured => "configured",
            CandidateKind::Reflexive => "reflexive",
            CandidateKind::Local => "local",
        }
    }

    pub fn parse(s: &str) -> Option<CandidateKind> {
        [
            CandidateKind::Configured,
            CandidateKind::Reflexive,
            CandidateKind::Local,
        ]
        .into_iter()
        .find(|k| k.as_str() == s)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Candidate {
    /// IPv4, or IPv6 (a gateway with a global IPv6 address).
    pub address: SocketAddr,
    pub kind: CandidateKind,
}

impl Candidate {
    pub fn to_pb(self) -> pb::Candidate {
        pb::Candidate {
            address: self.address.to_string(),
            kind: self.kind.as_str().into(),
        }
    }
}

/// `list` as a peer is told it: IPv4 candidates in `GatewayInfo.candidates`
/// (earlier sites take no other), IPv6 ones in `candidates_v6`.
pub fn by_family(list: &[pb::Candidate]) -> (Vec<pb::Candidate>, Vec<pb::Candidate>) {
    list.iter().cloned().partition(|c| !c.address.starts_with('['))
}

/// A peer's candidates, told apart by family (see [`by_family`]): each
/// list checked by [`candidates`], the IPv4 one holding IPv4 addresses
/// only and the IPv6 one IPv6 addresses only, at most [`MAX_CANDIDATES`]
/// in all.
pub fn both_families(
    field: &str,
    v4: &[pb::Candidate],
    v6: &[pb::Candidate],
    own_hosts: &[(IpAddr, String)],
) -> Result<Vec<Candidate>, String> {
    if v4.len() + v6.len() > MAX_CANDIDATES {
        return Err(format!(
            "{field}: {} listed; a gateway lists at most {MAX_CANDIDATES} candidates per peering",
            v4.len() + v6.len()
        ));
    }
    let mut out = candidates(field, v4, own_hosts)?;
    if let Some((i, c)) = out.iter().enumerate().find(|(_, c)| c.address.is_ipv6()) {
        return Err(format!(
            "{field}[{i}].address {} is IPv6; IPv6 candidates go in candidates_v6",
            c.address
        ));
    }
    let field6 = format!("{field}_v6");
    let six = candidates(&field6, v6, own_hosts)?;
    if let Some((i, c)) = six.iter().enumerate().find(|(_, c)| c.address.is_ipv4()) {
        return Err(format!(
            "{field6}[{i}].address {} is IPv4; IPv4 candidates go in candidates",
            c.address
        ));
    }
    out.extend(six);
    Ok(out)
}

pub use weft_common::discovery::Behaviour;

/// `text` quoted for an error message, cut at 64 characters.
fn shown(text: &str) -> String {
    let head: String = text.chars().take(64).collect();
    if head.len() < text.len() {
        format!("{head:?}… ({} bytes)", text.len())
    } else {
        format!("{text:?}")
    }
}

/// What a gateway found out about one peering's tunnel socket.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Discovered {
    pub candidates: Vec<Candidate>,
    pub nat: Option<Behaviour>,
}

/// Checks an address a peer asks this site's gateways to send to (a
/// gateway's endpoint, a candidate, a relay): not loopback (unless
/// `loopback_ok`), unspecified,
/// multicast, broadcast or link-local (169.254.169.254, where clouds
/// serve instance metadata, among them), in either family or as an
/// IPv4-mapped IPv6 address, not port 0, and not one of this site's own
/// hosts (`own_hosts`); an error names `field` and what the address is.
pub fn endpoint(
    field: &str,
    address: SocketAddr,
    own_hosts: &[(IpAddr, String)],
    loopback_ok: bool,
) -> Result<(), String> {
    let ip = match address.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    };
    // NAT64's well-known prefix (64:ff9b::/96) reaches the IPv4 address
    // it embeds: checked as that.
    let ip = match ip {
        IpAddr::V6(v6) if v6.segments()[..6] == [0x64, 0xff9b, 0, 0, 0, 0] => {
            let o = v6.octets();
            IpAddr::V4(std::net::Ipv4Addr::new(o[12], o[13], o[14], o[15]))
        }
        ip => ip,
    };
    // A cloud's instance metadata and DNS over IPv6 (AWS: fd00:ec2::254,
    // fd00:ec2::253), as 169.254.169.254 over IPv4.
    let metadata = ["fd00:ec2::254", "fd00:ec2::253"];
    if let IpAddr::V6(v6) = ip
        && metadata
            .iter()
            .any(|m| m.parse::<std::net::Ipv6Addr>().is_ok_and(|m| m == v6))
    {
        return Err(format!(
            "{field} {address} is a cloud's instance metadata or DNS address: no gateway can be reached there"
        ));
    }
    let what = if ip.is_loopback() && !loopback_ok {
        Some("a loopback address")
    } else if ip.is_unspecified() {
        Some("the unspecified address")
    } else if ip.is_multicast() {
        Some("a multicast address")
    } else if matches!(ip, IpAddr::V4(v4) if v4.is_broadcast()) {
        Some("the broadcast address")
    } else if matches!(ip, IpAddr::V4(v4) if v4.is_link_local())
        || matches!(ip, IpAddr::V6(v6) if v6.is_unicast_link_local())
    {
        Some("a link-local address")
    } else if address.port() == 0 {
        Some("port 0")
    } else {
        None
    };
    if let Some(what) = what {
        return Err(format!("{field} {address} is {what}: no gateway can be reached there"));
    }
    if let Some((_, who)) = own_hosts.iter().find(|(h, _)| h.to_canonical() == ip) {
        return Err(format!(
            "{field} {address} is the address of {who} of this site: a peer's gateway cannot be there"
        ));
    }
    Ok(())
}

/// Checks a candidate list (`field` names it in errors): at most
/// [`MAX_CANDIDATES`], each an address (IPv4, or IPv6 written `[ip]:port`)
/// and a port that another host could send to (see [`endpoint`]), of a
/// known kind, and not one of `own_hosts`. An IPv4-mapped IPv6 address is
/// taken as the IPv4 address it maps.
pub fn candidates(
    field: &str,
    list: &[pb::Candidate],
    own_hosts: &[(IpAddr, String)],
) -> Result<Vec<Candidate>, String> {
    if list.len() > MAX_CANDIDATES {
        return Err(format!(
            "{field}: {} listed; a gateway lists at most {MAX_CANDIDATES} candidates per peering",
            list.len()
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, c) in list.iter().enumerate() {
        let at = format!("{field}[{i}]");
        let kind = CandidateKind::parse(&c.kind).ok_or_else(|| {
            format!(
                "{at}.kind {} is not a candidate kind (configured, reflexive, local)",
                shown(&c.kind)
            )
        })?;
        let address = weft_types::net::endpoint(&c.address).map_err(|m| format!("{at}.address {m}"))?;
        let address = SocketAddr::new(address.ip().to_canonical(), address.port());
        endpoint(&format!("{at}.address"), address, own_hosts, false)?;
        out.push(Candidate { address, kind });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(address: &str, kind: &str) -> pb::Candidate {
        pb::Candidate {
            address: address.into(),
            kind: kind.into(),
        }
    }

    #[test]
    fn hostile_candidates_are_refused_naming_the_field() {
        let own = vec![
            ("10.9.0.5".parse().unwrap(), "gateway gw".to_string()),
            ("2001:db8:9::5".parse().unwrap(), "gateway gw".to_string()),
        ];
        let cases: Vec<(Vec<pb::Candidate>, &str)> = vec![
            (
                vec![c("127.0.0.1:51820", "reflexive")],
                "f[0].address 127.0.0.1:51820 is a loopback",
            ),
            (
                vec![c("198.51.100.1:51820", "reflexive"), c("224.0.0.9:51820", "reflexive")],
                "f[1].address 224.0.0.9:51820 is a multicast",
            ),
            (
                vec![c("10.9.0.5:51820", "reflexive")],
                "f[0].address 10.9.0.5:51820 is the address of gateway gw",
            ),
            (vec![c("255.255.255.255:1", "reflexive")], "broadcast"),
            (vec![c("169.254.1.1:1", "reflexive")], "link-local"),
            (vec![c("0.0.0.0:1", "reflexive")], "unspecified"),
            (vec![c("198.51.100.1:0", "reflexive")], "port 0"),
            (
                vec![c("198.51.100.1", "reflexive")],
                "f[0].address \"198.51.100.1\" is not an address and a port",
            ),
            (
                vec![c("[2001:db8:9::5]:51820", "reflexive")],
                "f[0].address [2001:db8:9::5]:51820 is the address of gateway gw",
            ),
            (vec![c("[fe80::1]:51820", "reflexive")], "link-local"),
            (vec![c("[::1]:51820", "reflexive")], "loopback"),
            (vec![c("[::ffff:127.0.0.1]:51820", "reflexive")], "loopback"),
            (vec![c("[ff02::1]:51820", "reflexive")], "multicast"),
            (vec![c("[fd00:ec2::254]:80", "reflexive")], "instance metadata"),
            (vec![c("[64:ff9b::7f00:1]:51820", "reflexive")], "loopback"),
            (vec![c("[64:ff9b::a9fe:a9fe]:80", "reflexive")], "link-local"),
            (
                vec![c("198.51.100.1:5", "relay")],
                "f[0].kind \"relay\" is not a candidate kind",
            ),
            (
                vec![c("198.51.100.1:5", "reflexive"); 1000],
                "f: 1000 listed; a gateway lists at most 8",
            ),
        ];
        for (list, want) in cases {
            let e = candidates("f", &list, &own).unwrap_err();
            assert!(e.contains(want), "{e:?} does not say {want:?}");
        }
        let ok = candidates(
            "f",
            &[
                c("198.51.100.1:51820", "reflexive"),
                c("192.168.1.2:51820", "local"),
                c("[2001:db8:7::20]:51820", "reflexive"),
                c("[::ffff:198.51.100.2]:51820", "reflexive"),
            ],
            &own,
        )
        .unwrap();
        assert_eq!(ok.len(), 4);
        assert_eq!(ok[1].kind, CandidateKind::Local);
        assert_eq!(ok[2].address, "[2001:db8:7::20]:51820".parse().unwrap());
        // An IPv4-mapped address is kept as the IPv4 address.
        assert_eq!(ok[3].address, "198.51.100.2:51820".parse().unwrap());
    }
}
