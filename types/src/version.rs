//! Releases and the skew weft supports between them (as Kubernetes does
//! between its control plane and nodes):
//!
//! - an agent may be the release of its controller or up to one minor
//!   release older, never newer (upgrade controllers first);
//! - two peered sites' controllers may be up to one minor release apart.
//!
//! Before 1.0 a minor release is the middle number (0.1 to 0.2); a
//! different major release is outside the policy. An agent or a peer that
//! does not say its release (one before 0.1.0) is outside it too.

/// `major.minor.patch` of a release ("0.1.0", with a `-pre` or `+build`
/// tail allowed); None for anything else.
pub fn parse(v: &str) -> Option<(u64, u64, u64)> {
    let core = v.split(['-', '+']).next()?;
    let mut it = core.split('.');
    let parts = (
        it.next()?.parse().ok()?,
        it.next()?.parse().ok()?,
        it.next()?.parse().ok()?,
    );
    it.next().is_none().then_some(parts)
}

/// Whether `v` may be recorded as a release someone reported: at most 32
/// characters, printable ASCII (not necessarily one [`parse`] takes).
pub fn plausible(v: &str) -> bool {
    v.len() <= 32 && v.chars().all(|c| c.is_ascii_graphic())
}

/// Why agent release `agent` is outside the supported skew from its
/// controller's `controller`; None when within it.
pub fn agent_skew(controller: &str, agent: &str) -> Option<String> {
    let (Some(c), Some(a)) = (parse(controller), parse(agent)) else {
        return Some(format!(
            "release {} does not say which it is; an agent of {controller} or one minor release older is supported",
            shown(agent)
        ));
    };
    if a.0 != c.0 || a.1 > c.1 {
        return Some(format!(
            "release {agent} is not {controller} or one minor release older: upgrade the controllers first, then the agents"
        ));
    }
    (c.1 - a.1 > 1).then(|| {
        format!("release {agent} is more than one minor release older than the controller's {controller}: upgrade it")
    })
}

/// Why peer release `peer` is outside the supported skew from this site's
/// `own`; None when within it.
pub fn peer_skew(own: &str, peer: &str) -> Option<String> {
    let (Some(o), Some(p)) = (parse(own), parse(peer)) else {
        return Some(format!(
            "the peer's release {} does not say which it is; peers one minor release apart at most are supported",
            shown(peer)
        ));
    };
    (o.0 != p.0 || o.1.abs_diff(p.1) > 1).then(|| {
        format!("the peer runs {peer}, this site {own}: more than one minor release apart; upgrade the older site")
    })
}

fn shown(v: &str) -> String {
    if v.is_empty() {
        "(none)".into()
    } else {
        format!("{v:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_parse_and_the_skew_policy_holds() {
        assert_eq!(parse("0.1.0"), Some((0, 1, 0)));
        assert_eq!(parse("1.2.3-rc.1+abc"), Some((1, 2, 3)));
        for bad in ["", "0.1", "0.1.0.0", "x.1.0", "unknown"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
        // Agents: the same release, or one minor older.
        assert_eq!(agent_skew("0.2.0", "0.2.3"), None);
        assert_eq!(agent_skew("0.2.1", "0.1.7"), None);
        assert!(
            agent_skew("0.2.0", "0.3.0")
                .unwrap()
                .contains("upgrade the controllers first")
        );
        assert!(
            agent_skew("0.3.0", "0.1.0")
                .unwrap()
                .contains("more than one minor release older")
        );
        assert!(agent_skew("1.0.0", "0.9.0").is_some(), "another major release");
        assert!(agent_skew("0.1.0", "").unwrap().contains("(none)"));
        // Peers: one minor apart either way.
        assert_eq!(peer_skew("0.2.0", "0.1.0"), None);
        assert_eq!(peer_skew("0.1.0", "0.2.0"), None);
        assert!(peer_skew("0.1.0", "0.3.0").is_some());
        assert!(peer_skew("0.1.0", "").is_some());
        assert!(plausible("0.1.0") && !plausible("0.1.0 evil") && !plausible(&"9".repeat(33)));
    }
}
