//! The store layout: every key a site keeps under `/weft/sites/<site>/`,
//! written and read here only. Everything else names a record by [`Key`]
//! and gets its path from [`Key::path`], or learns what a path holds from
//! [`Key::parse`].

use crate::domain::AgentRole;

/// A record of the site, by what it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Key<'a> {
    /// The site's configuration (`Site`).
    Site,
    /// The IPAM sequence every allocation compares and bumps.
    IpamSeq,
    /// The site CA's fingerprint, recorded on first start.
    CaFingerprint,
    /// The fingerprints of the CAs the site retired, one per line.
    CaRetired,
    /// What the replicas campaign on for singleton work.
    Leader,
    /// The name of the active gateway.
    GatewayActive,
    Node(&'a str),
    Gateway(&'a str),
    Peering(&'a str),
    /// A peering token this site issued, by id.
    PeerToken(&'a str),
    /// An enrollment token, by id.
    Token(&'a str),
    /// A published name.
    Name(&'a str),
    /// An agent's liveness record (on a lease).
    Alive(AgentRole, &'a str),
    /// A revoked certificate, by serial.
    Revoked(&'a str),
    /// A running replica's presence, by its id (on its gateways' lease,
    /// which ends within a gateway TTL of its death).
    Replica(&'a str),
    /// Written first and removed last by `weft-controller restore`: while
    /// it is there the store holds part of a backup, and no controller
    /// starts on it.
    Restoring,
}

/// A family of keys, for reading or watching all of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prefix {
    Alive,
    Revoked,
}

impl Prefix {
    pub fn path(self) -> &'static str {
        match self {
            Prefix::Alive => "alive/",
            Prefix::Revoked => "revoked/",
        }
    }
}

impl<'a> Key<'a> {
    /// An agent's record.
    pub fn agent(role: AgentRole, name: &'a str) -> Key<'a> {
        match role {
            AgentRole::Node => Key::Node(name),
            AgentRole::Gateway => Key::Gateway(name),
        }
    }

    /// The key's path under the site's root.
    pub fn path(&self) -> String {
        match self {
            Key::Site => "site".into(),
            Key::IpamSeq => "ipam/seq".into(),
            Key::CaFingerprint => "ca-fingerprint".into(),
            Key::CaRetired => "ca-retired".into(),
            Key::Leader => "leader".into(),
            Key::GatewayActive => "gateway-active".into(),
            Key::Restoring => "restoring".into(),
            Key::Node(n) => format!("nodes/{n}"),
            Key::Gateway(n) => format!("gateways/{n}"),
            Key::Peering(n) => format!("peerings/{n}"),
            Key::PeerToken(n) => format!("peer-tokens/{n}"),
            Key::Token(n) => format!("tokens/{n}"),
            Key::Name(n) => format!("names/{n}"),
            Key::Alive(role, n) => format!("{}{}/{n}", Prefix::Alive.path(), role.as_str()),
            Key::Revoked(n) => format!("{}{n}", Prefix::Revoked.path()),
            Key::Replica(n) => format!("replicas/{n}"),
        }
    }

    /// What the path `rest` (under the site's root) holds; `None` for a
    /// path weft does not keep.
    pub fn parse(rest: &'a str) -> Option<Key<'a>> {
        let fixed = match rest {
            "site" => Some(Key::Site),
            "ipam/seq" => Some(Key::IpamSeq),
            "ca-fingerprint" => Some(Key::CaFingerprint),
            "ca-retired" => Some(Key::CaRetired),
            "leader" => Some(Key::Leader),
            "gateway-active" => Some(Key::GatewayActive),
            "restoring" => Some(Key::Restoring),
            _ => None,
        };
        if fixed.is_some() {
            return fixed;
        }
        let (family, name) = rest.split_once('/')?;
        if name.is_empty() {
            return None;
        }
        Some(match family {
            "nodes" => Key::Node(name),
            "gateways" => Key::Gateway(name),
            "peerings" => Key::Peering(name),
            "peer-tokens" => Key::PeerToken(name),
            "tokens" => Key::Token(name),
            "names" => Key::Name(name),
            "revoked" => Key::Revoked(name),
            "replicas" => Key::Replica(name),
            "alive" => {
                let (role, name) = name.split_once('/')?;
                let role = match role {
                    "node" => AgentRole::Node,
                    "gateway" => AgentRole::Gateway,
                    _ => return None,
                };
                Key::Alive(role, name)
            }
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_parses_back_from_its_path() {
        let keys = [
            Key::Site,
            Key::IpamSeq,
            Key::CaFingerprint,
            Key::CaRetired,
            Key::Leader,
            Key::GatewayActive,
            Key::Node("n1"),
            Key::Gateway("gw"),
            Key::Peering("site-b"),
            Key::PeerToken("t1"),
            Key::Token("t2"),
            Key::Name("web"),
            Key::Alive(AgentRole::Node, "n1"),
            Key::Alive(AgentRole::Gateway, "gw"),
            Key::Replica("0a1b2c"),
            Key::Revoked("0a1b"),
            Key::Restoring,
        ];
        for k in keys {
            let p = k.path();
            assert_eq!(Key::parse(&p), Some(k), "{p}");
        }
        for other in ["", "nodes/", "alive/robot/x", "alive/node", "unknown/x", "sites"] {
            assert_eq!(Key::parse(other), None, "{other}");
        }
        assert!(
            Key::Alive(AgentRole::Node, "n1")
                .path()
                .starts_with(Prefix::Alive.path())
        );
        assert!(Key::Revoked("1").path().starts_with(Prefix::Revoked.path()));
    }
}
