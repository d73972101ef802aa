//! Networks and addresses. Each parser returns a message that starts with
//! the text it was given, quoted (and cut, see [`crate::shown`]); callers
//! put the field's name in front.
//!
//! - [`Cidr`]: a network of either family, its host bits clear. IPv4 is
//!   refused unless written canonically (leading zeros are octal to some
//!   tools and decimal to others); IPv6 is normalised (RFC 5952), since
//!   its forms are not ambiguous.
//! - [`iface`]: an address with a prefix length (host bits kept), as on a
//!   link.
//! - [`endpoint`]: an address and a port from 1 to 65535, IPv6 in
//!   brackets.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::shown;

/// An address family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(ip: IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        })
    }
}

/// A network of either family with its host bits clear: what a CIDR field
/// holds once parsed.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cidr(IpNet);

impl Cidr {
    /// The network `net` lies in (its host bits cleared).
    pub fn of(net: impl Into<IpNet>) -> Cidr {
        Cidr(net.into().trunc())
    }

    pub fn net(self) -> IpNet {
        self.0
    }

    pub fn family(self) -> Family {
        Family::of(self.0.addr())
    }

    pub fn prefix_len(self) -> u8 {
        self.0.prefix_len()
    }

    pub fn v4(self) -> Option<Ipv4Net> {
        match self.0 {
            IpNet::V4(n) => Some(n),
            IpNet::V6(_) => None,
        }
    }

    pub fn v6(self) -> Option<Ipv6Net> {
        match self.0 {
            IpNet::V6(n) => Some(n),
            IpNet::V4(_) => None,
        }
    }
}

impl From<Ipv4Net> for Cidr {
    fn from(n: Ipv4Net) -> Cidr {
        Cidr::of(n)
    }
}

impl From<Ipv6Net> for Cidr {
    fn from(n: Ipv6Net) -> Cidr {
        Cidr::of(n)
    }
}

impl From<Cidr> for IpNet {
    fn from(c: Cidr) -> IpNet {
        c.0
    }
}

impl FromStr for Cidr {
    type Err = String;
    fn from_str(text: &str) -> Result<Cidr, String> {
        cidr(text)
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Debug for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Longer than any address with a prefix length, scope or port: refused
/// before parsing, so a megabyte of text costs nothing.
const MAX_TEXT: usize = 64;

fn too_long(text: &str) -> Option<String> {
    (text.len() > MAX_TEXT).then(|| format!("{} is too long for an address", shown(text)))
}

/// Parses a CIDR of either family (surrounding spaces trimmed).
pub fn cidr(text: &str) -> Result<Cidr, String> {
    let text = text.trim();
    if let Some(e) = too_long(text) {
        return Err(e);
    }
    let q = shown(text);
    match text.parse::<IpNet>() {
        Ok(n) if n.addr() != n.network() => Err(format!(
            "{q} has host bits set; the network is {} (write that, or fix the prefix length)",
            n.trunc()
        )),
        Ok(IpNet::V4(n)) if n.to_string() != text => Err(format!(
            "{q} is not written canonically (leading zeros are read as octal by some tools); write {n}"
        )),
        Ok(n) => Ok(Cidr(n)),
        Err(_) => match text.split_once('/') {
            None if text.parse::<IpAddr>().is_ok() => Err(format!(
                "{q} has no prefix length; write it as address/length, e.g. {text}/{}",
                if text.contains(':') { 64 } else { 24 }
            )),
            Some((a, len)) if a.parse::<IpAddr>().is_ok() => {
                let max = if a.contains(':') { 128 } else { 32 };
                Err(format!(
                    "{q} is not a CIDR: its prefix length {len:?} is not a number from 0 to {max}"
                ))
            }
            _ => Err(format!(
                "{q} is not a CIDR; write it as address/length, e.g. 10.1.0.0/16 or fd00:1::/48"
            )),
        },
    }
}

/// Parses an IPv4 CIDR: what fields that carry only IPv4 take.
pub fn cidr_v4(text: &str) -> Result<Ipv4Net, String> {
    let c = cidr(text)?;
    c.v4()
        .ok_or_else(|| format!("{} is IPv6; weft supports IPv4 CIDRs only for now", shown(text.trim())))
}

/// Parses an address of either family (no prefix length, no scope).
pub fn addr(text: &str) -> Result<IpAddr, String> {
    if let Some(e) = too_long(text) {
        return Err(e);
    }
    text.parse::<IpAddr>().map_err(|_| {
        let hint = if text.contains('/') {
            " (without a prefix length)"
        } else if text.contains('%') {
            " (a scope such as %eth0 is not taken)"
        } else {
            ""
        };
        format!("{} is not an address{hint}", shown(text))
    })
}

/// Parses an IPv4 address.
pub fn addr_v4(text: &str) -> Result<Ipv4Addr, String> {
    match addr(text)? {
        IpAddr::V4(a) => Ok(a),
        IpAddr::V6(_) => Err(format!("{} is IPv6; this field takes an IPv4 address", shown(text))),
    }
}

/// Parses an IPv6 address.
pub fn addr_v6(text: &str) -> Result<Ipv6Addr, String> {
    match addr(text)? {
        IpAddr::V6(a) => Ok(a),
        IpAddr::V4(_) => Err(format!("{} is IPv4; this field takes an IPv6 address", shown(text))),
    }
}

/// Parses an address with its prefix length, as a link holds it (host
/// bits kept: `10.1.0.1/24`).
pub fn iface(text: &str) -> Result<IpNet, String> {
    if let Some(e) = too_long(text) {
        return Err(e);
    }
    text.parse::<IpNet>().map_err(|_| {
        format!(
            "{} is not an address with a prefix length (e.g. 10.1.0.1/24)",
            shown(text)
        )
    })
}

/// Parses an endpoint: an address and a port from 1 to 65535, IPv6 in
/// brackets (`192.0.2.1:51820`, `[2001:db8::1]:51820`). A scoped IPv6
/// address is refused: an endpoint crosses hosts, and a scope does not.
pub fn endpoint(text: &str) -> Result<SocketAddr, String> {
    if let Some(e) = too_long(text) {
        return Err(e);
    }
    let what = "an address and a port from 1 to 65535 (e.g. 192.0.2.1:51820 or [2001:db8::1]:51820)";
    match text.parse::<SocketAddr>() {
        Ok(SocketAddr::V6(a)) if a.scope_id() != 0 || a.flowinfo() != 0 => {
            Err(format!("{} has a scope; an endpoint is {what}", shown(text)))
        }
        Ok(a) if a.port() != 0 => Ok(a),
        Ok(_) => Err(format!("{} has port 0; an endpoint is {what}", shown(text))),
        Err(_) if text.parse::<Ipv6Addr>().is_ok() => Err(format!(
            "{} has no port; write an IPv6 endpoint in brackets, e.g. [{text}]:51820",
            shown(text)
        )),
        Err(_) if text.matches(':').count() > 1 && !text.starts_with('[') => Err(format!(
            "{} is not {what}; write an IPv6 endpoint in brackets",
            shown(text)
        )),
        Err(_) => Err(format!("{} is not {what}", shown(text))),
    }
}

/// The special-purpose range (RFC 6890) that `net` overlaps and that no
/// workload, external or remapped network may: it names the range. None
/// for a network of ordinary unicast addresses.
pub fn special_use(net: IpNet) -> Option<&'static str> {
    const V4: [(&str, &str); 6] = [
        ("0.0.0.0/8", "\"this network\" (0.0.0.0/8)"),
        ("127.0.0.0/8", "loopback (127.0.0.0/8)"),
        ("169.254.0.0/16", "link-local (169.254.0.0/16)"),
        ("224.0.0.0/4", "multicast (224.0.0.0/4)"),
        ("240.0.0.0/4", "reserved (240.0.0.0/4)"),
        ("255.255.255.255/32", "broadcast (255.255.255.255)"),
    ];
    const V6: [(&str, &str); 8] = [
        ("::/128", "the unspecified address (::)"),
        ("64:ff9b::/96", "the well-known NAT64 prefix (64:ff9b::/96)"),
        ("64:ff9b:1::/48", "local-use NAT64 (64:ff9b:1::/48)"),
        ("::1/128", "loopback (::1)"),
        ("::ffff:0:0/96", "IPv4-mapped (::ffff:0:0/96)"),
        ("fe80::/10", "link-local (fe80::/10)"),
        ("fec0::/10", "site-local, deprecated (fec0::/10)"),
        ("ff00::/8", "multicast (ff00::/8)"),
    ];
    let table: &[(&str, &str)] = match net {
        IpNet::V4(_) => &V4,
        IpNet::V6(_) => &V6,
    };
    table.iter().find_map(|(range, name)| {
        let range: IpNet = range.parse().expect("a range of the table");
        (range.contains(&net) || net.contains(&range)).then_some(*name)
    })
}

#[cfg(test)]
mod tests;
