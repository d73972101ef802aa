//! Names: of sites, nodes and gateways ([`id`]), and of weft's own links
//! and namespaces, which are what the agent may make, change or delete on
//! a host (anything else belongs to the host).

/// The prefix of every link and namespace weft makes.
pub const PREFIX: &str = "weft";

/// Checks a node, gateway or site name: 1 to 63 characters of lower-case
/// letters, digits, '-' and '.', starting and ending with a letter or digit.
/// Names become store keys and interface labels, so nothing else is allowed.
pub fn id(what: &str, name: &str) -> Result<(), String> {
    let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.';
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    if name.is_empty() {
        return Err(format!("{what} is empty; give a name such as \"node-1\""));
    }
    if name.len() > 63 || !name.chars().all(ok_char) || !edge(name.chars().next()) || !edge(name.chars().last()) {
        return Err(format!(
            "{what} {} is not a valid name: use 1 to 63 lower-case letters, digits, '-' or '.', \
             starting and ending with a letter or digit",
            crate::shown(name)
        ));
    }
    Ok(())
}

/// Whether `s` is a DNS label as weft writes one: 1 to 63 lower-case
/// letters, digits or '-', not starting or ending with '-' (published
/// names, site ids' parts, the DNS zone's labels).
pub fn dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Checks field `what` names one of weft's links: `weft…`, at most 15
/// bytes (the kernel's limit) of letters, digits, '-', '_' and '.'.
pub fn link(what: &str, name: &str) -> Result<(), String> {
    let ok = name.starts_with(PREFIX)
        && name.len() <= 15
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what} {} is not one of weft's links (weft…, at most 15 letters, digits, '-', '_', '.')",
            crate::shown(name)
        ))
    }
}

/// Checks field `what` is "" (the agent's own namespace) or names one of
/// weft's: `weft-…`, at most 64 lower-case letters, digits and '-' (no
/// path: the agent opens them under /run/netns).
pub fn namespace(what: &str, name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Ok(());
    }
    let ok = name.starts_with("weft-")
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what} {} is not one of weft's namespaces (weft-…, lower-case letters, digits and '-')",
            crate::shown(name)
        ))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_are_dns_like_labels() {
        assert!(super::id("site id", "site-a").is_ok());
        assert!(super::id("site id", "a.b-2").is_ok());
        for bad in ["", "-a", "a-", "A", "a/b", "a b", &"a".repeat(64)] {
            assert!(super::id("site id", bad).is_err(), "{bad:?}");
        }
        assert!(
            super::id("gateways[0].name", "X")
                .unwrap_err()
                .starts_with("gateways[0].name \"X\"")
        );
    }

    #[test]
    fn only_weft_names_pass() {
        assert!(super::link("link", "weft-p-a0").is_ok());
        assert!(super::link("link", "eth0").is_err());
        assert!(super::link("link", "weft-0123456789ab").is_err(), "over 15 bytes");
        assert!(super::link("link", "weft/x").is_err());
        assert!(super::namespace("namespace", "").is_ok());
        assert!(super::namespace("namespace", "weft-p-site-b").is_ok());
        assert!(super::namespace("namespace", "weft-../../etc").is_err());
        assert!(super::namespace("namespace", "other").is_err());
        let e = super::namespace("veth peer namespace", "x").unwrap_err();
        assert!(e.starts_with("veth peer namespace \"x\" is not"), "{e}");
    }
}
