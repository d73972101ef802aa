//! Checks of what people and peers type: CIDRs and names, and how an
//! error message quotes them (both from weft-types, the one parser of each).

use ipnet::Ipv4Net;

pub use weft_types::shown;

/// Parses an IPv4 CIDR in canonical form, or says what is wrong with it
/// (weft-types' parser, which reads both families, kept to IPv4 until the
/// records carry IPv6).
pub fn parse_cidr(text: &str) -> Result<Ipv4Net, String> {
    weft_types::net::cidr_v4(text)
}

/// Checks a node, gateway or site name (weft-types' check, the one the
/// agents use too).
pub use weft_types::name::id as validate_name;
