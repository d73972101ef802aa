//! Checks of what people and peers type: CIDRs and names, and how an
//! error message quotes them.

use ipnet::Ipv4Net;

/// Parses an IPv4 CIDR in canonical form, or says what is wrong with it.
pub fn parse_cidr(text: &str) -> Result<Ipv4Net, String> {
    let text = text.trim();
    let q = shown(text);
    match text.parse::<ipnet::IpNet>() {
        Ok(ipnet::IpNet::V4(n)) if n.addr() != n.network() => Err(format!(
            "{q} has host bits set; the network is {} (write that, or fix the prefix length)",
            n.trunc()
        )),
        // Leading zeros ("10.010.0.0/16") are octal to some tools and
        // decimal to others: refuse the ambiguity.
        Ok(ipnet::IpNet::V4(n)) if n.to_string() != text => Err(format!(
            "{q} is not written canonically (leading zeros are read as octal by some tools); write {n}"
        )),
        Ok(ipnet::IpNet::V4(n)) => Ok(n),
        Ok(ipnet::IpNet::V6(_)) => Err(format!("{q} is IPv6; weft supports IPv4 CIDRs only for now")),
        Err(_) if text.parse::<std::net::IpAddr>().is_ok() => Err(format!(
            "{q} has no prefix length; write it as address/length, e.g. {text}/24"
        )),
        Err(_) => Err(format!(
            "{q} is not a CIDR; write it as address/length, e.g. 10.1.0.0/16"
        )),
    }
}

/// `text` quoted for an error message, cut to its first 64 characters: a
/// message echoes what the caller sent, and must not echo a megabyte of it
/// (gRPC carries messages in headers, which peers limit).
pub fn shown(text: &str) -> String {
    const MAX: usize = 64;
    if text.chars().count() <= MAX {
        return format!("{text:?}");
    }
    let head: String = text.chars().take(MAX).collect();
    format!("{head:?}… ({} bytes)", text.len())
}

/// Checks a node, gateway or site name: 1 to 63 characters of lower-case
/// letters, digits, '-' and '.', starting and ending with a letter or digit.
/// Names become store keys and interface labels, so nothing else is allowed.
pub fn validate_name(what: &str, name: &str) -> Result<(), String> {
    let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.';
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    if name.is_empty() {
        return Err(format!("{what} is empty; give a name such as \"node-1\""));
    }
    if name.len() > 63 || !name.chars().all(ok_char) || !edge(name.chars().next()) || !edge(name.chars().last()) {
        return Err(format!(
            "{what} {} is not a valid name: use 1 to 63 lower-case letters, digits, '-' or '.', \
             starting and ending with a letter or digit",
            shown(name)
        ));
    }
    Ok(())
}
