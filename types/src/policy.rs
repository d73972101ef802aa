//! The parts of an export rule that are not a CIDR: its protocol and its
//! destination ports. Checked here once, for `weftctl`'s early errors, the
//! controller's policy and the agent's door alike.

use std::fmt;

/// A protocol an export rule names. `Icmp` is ICMPv6 for an IPv6 prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    Tcp,
    Udp,
    Icmp,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Icmp => "icmp",
        }
    }

    /// A rule's protocol: "" or "any" is any (None); tcp, udp, icmp (or
    /// icmpv6), in any case.
    pub fn parse(text: &str) -> Result<Option<Protocol>, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "" | "any" => Ok(None),
            "tcp" => Ok(Some(Protocol::Tcp)),
            "udp" => Ok(Some(Protocol::Udp)),
            "icmp" | "icmpv6" => Ok(Some(Protocol::Icmp)),
            _ => Err(format!(
                "{} is not a protocol a policy knows; give tcp, udp, icmp (ICMPv6 for an IPv6 prefix), or leave it \
                 empty for any",
                crate::shown(text)
            )),
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Destination ports, inclusive: `(first, last)`, 1 to 65535, first ≤ last.
pub type Ports = (u16, u16);

/// What is wrong with a rule's ports, and in which field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortsError {
    /// `first_port` or `last_port`.
    pub field: &'static str,
    pub message: String,
}

impl fmt::Display for PortsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// A rule's ports as the API carries them: `(0, 0)` none, `(p, 0)` port
/// `p` alone, else the range from `first` to `last`; ports only with tcp or
/// udp (`protocol`, as [`Protocol::parse`] read it).
pub fn ports(protocol: Option<Protocol>, first: u32, last: u32) -> Result<Option<Ports>, PortsError> {
    let err = |field, message: String| PortsError { field, message };
    let (a, b) = match (first, last) {
        (0, 0) => return Ok(None),
        (0, _) => {
            return Err(err(
                "first_port",
                "a port range needs its first port (1 to 65535)".into(),
            ));
        }
        (a, 0) => (a, a),
        (a, b) => (a, b),
    };
    if !matches!(protocol, Some(Protocol::Tcp | Protocol::Udp)) {
        return Err(err("first_port", "ports need protocol tcp or udp".into()));
    }
    let port = |field, p: u32| u16::try_from(p).map_err(|_| err(field, format!("{p} is not a port (1 to 65535)")));
    let (a, b) = (port("first_port", a)?, port("last_port", b)?);
    if b < a {
        return Err(err(
            "last_port",
            format!("the range {a}-{b} ends before it starts; give the lower port first"),
        ));
    }
    Ok(Some((a, b)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocols_and_ports_are_checked_once_with_the_field_named() {
        assert_eq!(Protocol::parse(" TCP "), Ok(Some(Protocol::Tcp)));
        assert_eq!(Protocol::parse("icmpv6"), Ok(Some(Protocol::Icmp)));
        assert_eq!(Protocol::parse("any"), Ok(None));
        assert!(
            Protocol::parse("sctp")
                .unwrap_err()
                .contains("\"sctp\" is not a protocol")
        );
        let tcp = Some(Protocol::Tcp);
        assert_eq!(ports(tcp, 0, 0), Ok(None));
        assert_eq!(ports(None, 0, 0), Ok(None));
        assert_eq!(ports(tcp, 8080, 0), Ok(Some((8080, 8080))));
        assert_eq!(ports(tcp, 8000, 8100), Ok(Some((8000, 8100))));
        for (protocol, a, b, field, why) in [
            (tcp, 0, 80, "first_port", "needs its first port"),
            (None, 80, 0, "first_port", "need protocol tcp or udp"),
            (Some(Protocol::Icmp), 80, 0, "first_port", "need protocol tcp or udp"),
            (tcp, 70_000, 0, "first_port", "70000 is not a port"),
            (tcp, 80, 70_000, "last_port", "70000 is not a port"),
            (tcp, 90, 80, "last_port", "ends before it starts"),
        ] {
            let e = ports(protocol, a, b).unwrap_err();
            assert_eq!(e.field, field, "{e}");
            assert!(e.message.contains(why), "{e}");
        }
    }
}
