//! The enrollment decisions: which name a token enrolls, and whether an
//! agent may take a node or gateway record, given what the store holds.
//! The controller reads the records, asks here, and writes in one
//! transaction; nothing here reads or writes anything.

use std::net::Ipv4Addr;
use std::time::Duration;

use ipnet::Ipv4Net;

use crate::domain::{AgentRole, CertRecord, Gateway, Node, Peering, Token, live_until, validate_name};

/// Why an enrollment is refused, as the gRPC status it is answered with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// The token does not prove anything (wrong secret, expired).
    Unauthenticated(String),
    /// What the agent asked for cannot be given with this token.
    InvalidArgument(String),
    /// The name is held by an enrolled agent, or the record exists.
    AlreadyExists(String),
    /// The site's state does not allow it now (e.g. an underlay inside a
    /// peer's view).
    FailedPrecondition(String),
}

/// The answer to a token whose secret does not match.
pub fn invalid_token() -> Refused {
    Refused::Unauthenticated("the enrollment token is not valid; check that it was copied whole".into())
}

/// The name `token` enrolls, given the secret's hash and the name the
/// agent asked for: the token's own if it fixes one (the agent may ask for
/// that one or none), else the agent's. Refused: another secret, an
/// expired token, a name other than the token's, no name at all.
pub fn usable_token(token: &Token, secret_hash: &str, now: u64, requested: &str) -> Result<String, Refused> {
    if token.secret_sha256 != secret_hash {
        return Err(invalid_token());
    }
    if token.expires_at_ms <= now {
        return Err(Refused::Unauthenticated(format!(
            "the enrollment token {} expired {} ago; create a new one with `weftctl token create`",
            token.id,
            humantime::format_duration(Duration::from_secs((now - token.expires_at_ms) / 1000))
        )));
    }
    let name = match (&token.name, requested.trim()) {
        (Some(fixed), r) if !r.is_empty() && r != fixed => {
            return Err(Refused::InvalidArgument(format!(
                "this token enrolls the {} {fixed:?}, not {r:?}; start the agent with --name {fixed} or use another token",
                token.role.as_str()
            )));
        }
        (Some(fixed), _) => fixed.clone(),
        (None, "") => {
            return Err(Refused::InvalidArgument(
                "the agent sent no name and the token does not fix one; pass --name".into(),
            ));
        }
        (None, r) => r.to_string(),
    };
    validate_name("the agent name", &name).map_err(Refused::InvalidArgument)?;
    Ok(name)
}

/// A host inside a peer's view would have its overlay (and its controller
/// traffic) routed into that peering: refused, naming the peering.
pub fn underlay_outside_views<'a>(
    peerings: impl IntoIterator<Item = &'a Peering>,
    ip: Ipv4Addr,
    role: AgentRole,
    name: &str,
) -> Result<(), Refused> {
    let Some((p, v)) = peerings.into_iter().find_map(|p| {
        p.views
            .iter()
            .chain(p.transit_views.iter().map(|t| &t.view))
            .find(|v| v.local.contains(&ip))
            .map(|v| (p, v))
    }) else {
        return Ok(());
    };
    Err(Refused::FailedPrecondition(format!(
        "underlay: {ip} is in {}, this site's view of peering {:?}'s {} CIDR {}: the {} {name:?} would have its \
         overlay routed into that peer; give it an address on the site's LAN outside the peers' views, or delete \
         the peering first (`weftctl peering delete {}`)",
        v.local,
        p.site_id,
        v.kind,
        v.real,
        role.as_str(),
        p.site_id
    )))
}

/// An enrolled agent holds `name` while one of its certificates is valid.
pub fn held(certs: &[CertRecord], what: &str, name: &str, now: u64) -> Result<(), Refused> {
    match live_until(certs, now) {
        Some(until) => Err(Refused::AlreadyExists(format!(
            "the {what} name {name:?} is held by an enrolled agent whose certificate is valid for {} more; \
             remove it with `weftctl {what} remove {name}` first, or choose another name",
            humantime::format_duration(Duration::from_secs((until - now) / 1000))
        ))),
        None => Ok(()),
    }
}

/// Whether node `name` may be enrolled with `token`: a token that does not
/// name the node may only make a new one, of at most the size IPAM would
/// give (a /`node_prefix_len`); taking over an existing node, or reserving
/// a larger block, needs a token made for that node. An existing node
/// keeps its subnet, and is taken only once no agent holds it.
pub fn admit_node(
    token: &Token,
    existing: Option<&Node>,
    name: &str,
    subnet: Option<Ipv4Net>,
    node_prefix_len: u8,
    now: u64,
) -> Result<(), Refused> {
    if token.name.is_none() {
        if let Some(n) = existing {
            held(&n.certs, "node", name, now)?;
            return Err(Refused::AlreadyExists(format!(
                "node {name:?} exists; enroll it with a token made for it \
                 (`weftctl token create --role node --name {name}`)"
            )));
        }
        if let Some(s) = subnet.filter(|s| s.prefix_len() < node_prefix_len) {
            return Err(Refused::InvalidArgument(format!(
                "subnet {s} is larger than a node's /{node_prefix_len} and this token does not name the node; \
                 use a token made for it (`weftctl token create --role node --name {name}`)"
            )));
        }
    }
    if let Some(n) = existing {
        held(&n.certs, "node", name, now)?;
        if let Some(s) = subnet
            && Some(s) != n.subnet
        {
            return Err(Refused::InvalidArgument(match n.subnet {
                Some(has) => {
                    format!("node {name:?} already has subnet {has}, not {s}; drop --subnet or remove the node first")
                }
                None => format!("node {name:?} has no IPv4 subnet (its site has no IPv4 pods); drop --subnet"),
            }));
        }
    }
    Ok(())
}

/// Whether gateway `name` may be enrolled with `token`: no workload
/// subnet; an existing gateway only with a token made for it, and only
/// once no agent holds it.
pub fn admit_gateway(
    token: &Token,
    existing: Option<&Gateway>,
    name: &str,
    subnet: Option<Ipv4Net>,
    now: u64,
) -> Result<(), Refused> {
    if subnet.is_some() {
        return Err(Refused::InvalidArgument(
            "a gateway has no workload subnet; drop --subnet".into(),
        ));
    }
    if let Some(g) = existing {
        held(&g.certs, "gateway", name, now)?;
        if token.name.is_none() {
            return Err(Refused::AlreadyExists(format!(
                "gateway {name:?} exists; enroll it with a token made for it \
                 (`weftctl token create --role gateway --name {name}`)"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{PeeringState, SubnetSource};
    use crate::ipam::{CidrKind, View};

    const NOW: u64 = 1_000_000_000;

    fn token(name: Option<&str>, role: AgentRole) -> Token {
        Token {
            id: "0123456789ab".into(),
            secret_sha256: "hash".into(),
            role,
            name: name.map(str::to_string),
            expires_at_ms: NOW + 60_000,
            uses_left: 1,
            created_at_ms: NOW - 1_000,
        }
    }

    fn cert(not_after_ms: u64) -> CertRecord {
        CertRecord {
            serial: "01".into(),
            not_after_ms,
            issued_at_ms: NOW - 10_000,
            used: true,
            ca: String::new(),
        }
    }

    fn node(subnet: &str, certs: Vec<CertRecord>) -> Node {
        Node {
            subnet_v6: None,
            name: "n1".into(),
            subnet: Some(subnet.parse().unwrap()),
            source: SubnetSource::Allocated,
            created_at_ms: NOW - 100_000,
            certs,
            internal_ip: None,
            underlay_ip: None,
            geneve: false,
            identity_conflict: None,
            enrolled_at_ms: 0,
        }
    }

    fn unauthenticated(r: Result<String, Refused>) -> String {
        match r {
            Err(Refused::Unauthenticated(m)) => m,
            other => panic!("expected Unauthenticated, got {other:?}"),
        }
    }

    #[test]
    fn a_token_enrolls_its_own_name_or_the_agents_and_nothing_else() {
        let fixed = token(Some("n1"), AgentRole::Node);
        assert_eq!(usable_token(&fixed, "hash", NOW, ""), Ok("n1".into()));
        assert_eq!(usable_token(&fixed, "hash", NOW, " n1 "), Ok("n1".into()));
        let Err(Refused::InvalidArgument(m)) = usable_token(&fixed, "hash", NOW, "n2") else {
            panic!("another name than the token's");
        };
        assert!(m.contains("--name n1"), "{m}");
        let open = token(None, AgentRole::Gateway);
        assert_eq!(usable_token(&open, "hash", NOW, "gw"), Ok("gw".into()));
        assert!(matches!(
            usable_token(&open, "hash", NOW, ""),
            Err(Refused::InvalidArgument(m)) if m.contains("pass --name")
        ));
        assert!(matches!(
            usable_token(&open, "hash", NOW, "Bad Name"),
            Err(Refused::InvalidArgument(_))
        ));
    }

    #[test]
    fn a_wrong_secret_or_an_expired_token_proves_nothing() {
        let t = token(None, AgentRole::Node);
        assert!(unauthenticated(usable_token(&t, "other", NOW, "n1")).contains("copied whole"));
        let m = unauthenticated(usable_token(&t, "hash", t.expires_at_ms + 90_000, "n1"));
        assert!(
            m.contains("expired 1m 30s ago") && m.contains("weftctl token create"),
            "{m}"
        );
        // Expiry is exclusive: at the instant it is gone.
        assert!(usable_token(&t, "hash", t.expires_at_ms, "n1").is_err());
    }

    #[test]
    fn an_underlay_inside_a_peers_view_is_refused_naming_the_peering() {
        let p = Peering {
            site_id: "site-b".into(),
            state: PeeringState::Connected,
            views: vec![View {
                kind: CidrKind::Workload,
                real: "10.2.0.0/16".parse().unwrap(),
                local: "10.200.0.0/16".parse().unwrap(),
                pool: None,
            }],
            created_at_ms: NOW,
            ..crate::domain::test_peering("")
        };
        let inside = "10.200.3.4".parse().unwrap();
        let Err(Refused::FailedPrecondition(m)) = underlay_outside_views([&p], inside, AgentRole::Node, "n1") else {
            panic!("an underlay in a view");
        };
        assert!(m.contains("site-b") && m.contains("10.200.0.0/16") && m.contains("weftctl peering delete site-b"));
        assert_eq!(
            underlay_outside_views([&p], "192.168.1.4".parse().unwrap(), AgentRole::Node, "n1"),
            Ok(())
        );
    }

    #[test]
    fn a_node_is_taken_over_only_with_a_token_made_for_it_once_nobody_holds_it() {
        let open = token(None, AgentRole::Node);
        let named = token(Some("n1"), AgentRole::Node);
        let free = node("10.1.3.0/24", vec![cert(NOW - 1)]);
        let in_use = node("10.1.3.0/24", vec![cert(NOW + 3_600_000)]);
        // New: any token; a block larger than IPAM's only with a named one.
        assert_eq!(admit_node(&open, None, "n1", None, 24, NOW), Ok(()));
        assert_eq!(
            admit_node(&open, None, "n1", "10.1.4.0/24".parse().ok(), 24, NOW),
            Ok(())
        );
        assert!(matches!(
            admit_node(&open, None, "n1", "10.1.0.0/22".parse().ok(), 24, NOW),
            Err(Refused::InvalidArgument(m)) if m.contains("larger than a node's /24")
        ));
        assert_eq!(
            admit_node(&named, None, "n1", "10.1.0.0/22".parse().ok(), 24, NOW),
            Ok(())
        );
        // Existing: not with an open token; held while a certificate lives.
        assert!(matches!(
            admit_node(&open, Some(&free), "n1", None, 24, NOW),
            Err(Refused::AlreadyExists(m)) if m.contains("token made for it")
        ));
        assert!(matches!(
            admit_node(&named, Some(&in_use), "n1", None, 24, NOW),
            Err(Refused::AlreadyExists(m)) if m.contains("valid for 1h")
        ));
        assert_eq!(admit_node(&named, Some(&free), "n1", None, 24, NOW), Ok(()));
        // It keeps its subnet.
        assert_eq!(
            admit_node(&named, Some(&free), "n1", "10.1.3.0/24".parse().ok(), 24, NOW),
            Ok(())
        );
        assert!(matches!(
            admit_node(&named, Some(&free), "n1", "10.1.9.0/24".parse().ok(), 24, NOW),
            Err(Refused::InvalidArgument(m)) if m.contains("already has subnet 10.1.3.0/24")
        ));
    }

    #[test]
    fn a_gateway_has_no_subnet_and_is_taken_over_only_with_its_own_token() {
        let open = token(None, AgentRole::Gateway);
        let named = token(Some("gw"), AgentRole::Gateway);
        let gw = |certs| Gateway {
            name: "gw".into(),
            endpoint: None,
            public_key: None,
            created_at_ms: NOW - 100_000,
            certs,
            internal_ip: None,
            underlay_ip: None,
            geneve: false,
            identity_conflict: None,
            enrolled_at_ms: 0,
            pending_public_key: None,
            key_from_enrollment: false,
            discovered: Default::default(),
            enforces_export: false,
            enforces_export_v6: false,
            punches_beside: false,
        };
        assert_eq!(admit_gateway(&open, None, "gw", None, NOW), Ok(()));
        assert!(matches!(
            admit_gateway(&named, None, "gw", "10.1.0.0/24".parse().ok(), NOW),
            Err(Refused::InvalidArgument(m)) if m.contains("drop --subnet")
        ));
        assert!(matches!(
            admit_gateway(&open, Some(&gw(vec![])), "gw", None, NOW),
            Err(Refused::AlreadyExists(m)) if m.contains("--role gateway --name gw")
        ));
        assert!(matches!(
            admit_gateway(&named, Some(&gw(vec![cert(NOW + 1_000)])), "gw", None, NOW),
            Err(Refused::AlreadyExists(m)) if m.contains("held by an enrolled agent")
        ));
        assert_eq!(
            admit_gateway(&named, Some(&gw(vec![cert(NOW)])), "gw", None, NOW),
            Ok(())
        );
    }
}
