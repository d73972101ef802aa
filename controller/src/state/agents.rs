//! Enrollment tokens, agent registration and removal (an agent's certificates
//! after enrollment are in `certs`).
//!
//! A token is `weft1.<id>.<secret>`; the store keeps `tokens/<id>` with a
//! SHA-256 of the secret, never the secret. Registration consumes one use of
//! the token and creates (or claims) the agent's record in the same
//! transaction as its IPAM allocation, so two agents racing for one token,
//! one name or one subnet can never both win, and a refused registration
//! writes nothing.

use std::time::Duration;

use ipnet::Ipv4Net;

use super::{Key, State, decode, encode};
use weft_core::enroll;

use crate::domain::{AgentRole, CertRecord, Gateway, Node, Site, SubnetSource, Token, now_ms, validate_name};
use crate::error::Error;
use crate::ipam;
use crate::pki::{Issued, random_hex};
use crate::store::{Compare, Op, Txn};

/// Longest token lifetime accepted.
pub const MAX_TOKEN_TTL: Duration = Duration::from_secs(30 * 24 * 3600);
/// Most agents one token may enroll.
pub const MAX_TOKEN_USES: u32 = 10_000;

/// A token split into its parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedToken {
    pub id: String,
    pub secret: String,
}

impl ParsedToken {
    /// Parses `weft1.<12 hex>.<32 hex>`, saying what is wrong otherwise.
    pub fn parse(text: &str) -> Result<ParsedToken, Error> {
        let bad = || {
            Error::InvalidArgument(
                "the enrollment token is malformed: expected weft1.<id>.<secret> as printed by `weftctl token create`"
                    .into(),
            )
        };
        let mut parts = text.trim().split('.');
        let (Some("weft1"), Some(id), Some(secret), None) = (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad());
        };
        let hex =
            |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase());
        if !hex(id, 12) || !hex(secret, 32) {
            return Err(bad());
        }
        Ok(ParsedToken {
            id: id.into(),
            secret: secret.into(),
        })
    }
}

use weft_common::sha256_hex;

/// What a successful registration produced.
#[derive(Debug, Clone)]
pub struct Enrollment {
    pub role: AgentRole,
    pub name: String,
    pub issued: Issued,
    /// Nodes: the workload subnet.
    pub subnet: Option<Ipv4Net>,
}

fn unauthenticated(m: String) -> Error {
    Error::Unauthenticated(m)
}

fn unknown_token() -> Error {
    unauthenticated(
        "the enrollment token is unknown (deleted, used up, or never issued); create one with `weftctl token create`"
            .into(),
    )
}

fn invalid_token() -> Error {
    enroll::invalid_token().into()
}

/// What an enrolling agent asked for.
struct Asked<'a> {
    name: &'a str,
    subnet: Option<Ipv4Net>,
    underlay: Option<std::net::IpAddr>,
}

/// An enrollment's certificate among the agent's: expired ones pruned, the
/// new one recorded as used from the start (the enrolling agent holds it
/// now, and so no write for its first call).
fn enrolled_cert(certs: &mut Vec<CertRecord>, issued: &Issued, now: u64) {
    certs.retain(|c| c.not_after_ms > now);
    certs.push(CertRecord {
        serial: issued.serial.clone(),
        not_after_ms: issued.not_after_ms,
        issued_at_ms: now,
        used: true,
        ca: issued.ca.clone(),
    });
}

impl State {
    /// Creates a token; returns the full token text (shown once) and its record.
    pub async fn create_token(
        &self,
        role: AgentRole,
        name: Option<&str>,
        ttl: Duration,
        uses: u32,
    ) -> Result<(String, Token), Error> {
        if let Some(n) = name {
            validate_name("the token's agent name", n).map_err(Error::InvalidArgument)?;
        }
        if ttl < Duration::from_secs(1) || ttl > MAX_TOKEN_TTL {
            return Err(Error::InvalidArgument(format!(
                "ttl {} is out of range: give between 1 second and 30 days",
                humantime::format_duration(ttl)
            )));
        }
        if uses == 0 || uses > MAX_TOKEN_USES {
            return Err(Error::InvalidArgument(format!(
                "uses {uses} is out of range: give 1 to {MAX_TOKEN_USES}"
            )));
        }
        let (id, secret) = (random_hex(6), random_hex(16));
        let now = now_ms();
        let token = Token {
            id: id.clone(),
            secret_sha256: sha256_hex(&secret),
            role,
            name: name.map(str::to_string),
            expires_at_ms: now + ttl.as_millis() as u64,
            uses_left: uses,
            created_at_ms: now,
        };
        let key = self.at(Key::Token(&id));
        let txn = Txn::new()
            .when(Compare::Version(key.clone(), 0))
            .then(Op::put(key, encode(&token)));
        if !self.store.txn(txn).await?.succeeded {
            return Err(Error::Aborted("token id collision; retry".into()));
        }
        tracing::info!(token = %id, role = role.as_str(), agent = token.name.as_deref().unwrap_or("(chosen by the agent)"), "enrollment token created");
        Ok((format!("weft1.{id}.{secret}"), token))
    }

    pub async fn list_tokens(&self) -> Result<Vec<Token>, Error> {
        let s = self.snapshot().await?;
        Ok(s.tokens.into_iter().map(|t| t.0).collect())
    }

    pub async fn delete_token(&self, id: &str) -> Result<(), Error> {
        let key = self.at(Key::Token(id));
        let txn = Txn::new().when(Compare::Version(key.clone(), 0));
        // Deleting an absent key would succeed silently; check first.
        if self.store.txn(txn).await?.succeeded {
            return Err(Error::NotFound(format!(
                "there is no token {id:?}; list them with `weftctl token list`"
            )));
        }
        self.store.delete(&key).await?;
        tracing::info!(token = %id, "enrollment token deleted");
        Ok(())
    }

    /// Registers an agent with a token. `issue` signs the certificate for
    /// the identity decided here (role, name).
    pub async fn register(
        &self,
        token_text: &str,
        requested_name: &str,
        requested_subnet: Option<Ipv4Net>,
        underlay: Option<std::net::IpAddr>,
        mut issue: impl FnMut(AgentRole, &str) -> Result<Issued, Error>,
    ) -> Result<Enrollment, Error> {
        let parsed = ParsedToken::parse(token_text)?;
        let secret_hash = sha256_hex(&parsed.secret);
        // Refused cheaply, before the site-wide writer lock and its snapshot:
        // one read of the token's own record. A flood of wrong tokens then
        // costs a read each and never stalls enrollment, removal (and so
        // revocation) or peering. The transaction checks again.
        match self.store.get(&self.at(Key::Token(&parsed.id))).await? {
            None => return Err(unknown_token()),
            Some(kv) if decode::<Token>(&kv)?.secret_sha256 != secret_hash => return Err(invalid_token()),
            Some(_) => {}
        }
        let asked = Asked {
            name: requested_name,
            subnet: requested_subnet,
            underlay,
        };
        let out = self
            .commit(|snap| {
                let now = now_ms();
                let Some((token, token_rev)) = snap.tokens.iter().find(|(t, _)| t.id == parsed.id) else {
                    return Err(unknown_token());
                };
                let name = enroll::usable_token(token, &secret_hash, now, asked.name)?;
                let site = snap.site()?;
                if let Some(std::net::IpAddr::V4(ip)) = underlay {
                    enroll::underlay_outside_views(snap.peerings.iter().map(|p| &p.0), ip, token.role, &name)?;
                }
                // One use of the token, in the same transaction as the record.
                let token_key = self.at(Key::Token(&token.id));
                let mut txn = Txn::new().when(Compare::ModRevision(token_key.clone(), *token_rev));
                txn = if token.uses_left <= 1 {
                    txn.then(Op::delete(token_key))
                } else {
                    let mut t = token.clone();
                    t.uses_left -= 1;
                    txn.then(Op::put(token_key, encode(&t)))
                };
                let txn = self.ipam_guard(snap, txn);
                let (enrollment, record_txn) = match token.role {
                    AgentRole::Node => self.enroll_node(snap, site, token, &name, &asked, now, txn, &mut issue)?,
                    AgentRole::Gateway => {
                        self.enroll_gateway(snap, site, token, &name, &asked, now, txn, &mut issue)?
                    }
                };
                Ok((Some(record_txn), enrollment))
            })
            .await?;
        tracing::info!(token = %parsed.id, role = out.role.as_str(), agent = %out.name, serial = %out.issued.serial, "agent enrolled");
        Ok(out)
    }

    /// A node's record after enrollment (new, or claimed with a token made
    /// for it), and the transaction that writes it.
    #[allow(clippy::too_many_arguments)]
    fn enroll_node(
        &self,
        snap: &super::Snapshot,
        site: &Site,
        token: &Token,
        name: &str,
        asked: &Asked,
        now: u64,
        txn: Txn,
        issue: &mut impl FnMut(AgentRole, &str) -> Result<Issued, Error>,
    ) -> Result<(Enrollment, Txn), Error> {
        let key = self.at(Key::Node(name));
        let existing = snap.nodes.iter().find(|(n, _)| n.name == name);
        enroll::admit_node(
            token,
            existing.map(|(n, _)| n),
            name,
            asked.subnet,
            site.node_prefix_len,
            now,
        )?;
        let (mut node, guard) = match existing {
            Some((n, rev)) => (n.clone(), Compare::ModRevision(key.clone(), *rev)),
            None => (
                new_node(snap, site, name, asked.subnet)?,
                Compare::Version(key.clone(), 0),
            ),
        };
        if node.internal_ip.is_none() {
            node.internal_ip = Some(ipam::allocate_internal_ip(site.internal_cidr, &snap.internal_ips())?);
        }
        node.underlay_ip = asked.underlay.or(node.underlay_ip);
        let issued = issue(AgentRole::Node, name)?;
        enrolled_cert(&mut node.certs, &issued, now);
        // A token is the admin's word: the identity is whole again.
        node.identity_conflict = None;
        node.enrolled_at_ms = now;
        let e = Enrollment {
            role: AgentRole::Node,
            name: name.to_string(),
            issued,
            subnet: node.subnet,
        };
        Ok((e, txn.when(guard).then(Op::put(key, encode(&node)))))
    }

    /// A gateway's record after enrollment, and the transaction that
    /// writes it.
    #[allow(clippy::too_many_arguments)]
    fn enroll_gateway(
        &self,
        snap: &super::Snapshot,
        site: &Site,
        token: &Token,
        name: &str,
        asked: &Asked,
        now: u64,
        txn: Txn,
        issue: &mut impl FnMut(AgentRole, &str) -> Result<Issued, Error>,
    ) -> Result<(Enrollment, Txn), Error> {
        let key = self.at(Key::Gateway(name));
        let existing = snap.gateways.iter().find(|(g, _)| g.name == name);
        enroll::admit_gateway(token, existing.map(|(g, _)| g), name, asked.subnet, now)?;
        let (mut gw, guard) = match existing {
            Some((g, rev)) => (g.clone(), Compare::ModRevision(key.clone(), *rev)),
            None => (
                Gateway {
                    name: name.to_string(),
                    endpoint: None,
                    public_key: None,
                    created_at_ms: now,
                    certs: vec![],
                    internal_ip: None,
                    underlay_ip: None,
                    geneve: false,
                    identity_conflict: None,
                    enrolled_at_ms: 0,
                    pending_public_key: None,
                    key_from_enrollment: true,
                    discovered: Default::default(),
                    enforces_export: false,
                    enforces_export_v6: false,
                    punches_beside: false,
                },
                Compare::Version(key.clone(), 0),
            ),
        };
        if gw.internal_ip.is_none() {
            gw.internal_ip = Some(ipam::allocate_internal_ip(site.internal_cidr, &snap.internal_ips())?);
        }
        gw.underlay_ip = asked.underlay.or(gw.underlay_ip);
        let issued = issue(AgentRole::Gateway, name)?;
        enrolled_cert(&mut gw.certs, &issued, now);
        // A token is the admin's word: the identity is whole again, and the
        // key the agent sends next is taken (a host enrolled anew may have
        // made a new one).
        gw.identity_conflict = None;
        gw.enrolled_at_ms = now;
        gw.pending_public_key = None;
        gw.key_from_enrollment = true;
        let e = Enrollment {
            role: AgentRole::Gateway,
            name: name.to_string(),
            issued,
            subnet: None,
        };
        Ok((e, txn.when(guard).then(Op::put(key, encode(&gw)))))
    }

    /// Removes a gateway and revokes its certificates.
    pub async fn delete_gateway(&self, name: &str) -> Result<Gateway, Error> {
        validate_name("the gateway name", name).map_err(Error::InvalidArgument)?;
        let key = self.at(Key::Gateway(name));
        self.commit(|snap| {
            let Some((gw, rev)) = snap.gateways.iter().find(|(g, _)| g.name == name) else {
                return Err(Error::NotFound(format!(
                    "gateway {name:?} does not exist; list gateways with `weftctl gateways`"
                )));
            };
            let mut txn = Txn::new()
                .when(Compare::ModRevision(key.clone(), *rev))
                .then(Op::delete(key.clone()));
            for op in self.revoke_ops(AgentRole::Gateway, name, &gw.certs, super::certs::Revocation::Removed) {
                txn = txn.then(op);
            }
            Ok((Some(txn), gw.clone()))
        })
        .await
    }

    /// An agent's own record: for a node, (node, site).
    pub async fn node_assignment(&self, name: &str) -> Result<(Node, Site), Error> {
        let node = self.get_node(name).await?;
        Ok((node, self.site().await?.0))
    }
}

/// A /64 for node `name` from the site's IPv6 pod CIDRs, or None when they
/// are full: IPv6 then waits (`diagnose` names the node), IPv4 does not.
pub(super) fn ipv6_subnet(
    v6: &crate::domain::Ipv6Networks,
    name: &str,
    taken: &[ipnet::Ipv6Net],
) -> Option<ipnet::Ipv6Net> {
    match ipam::allocate_node_subnet(&v6.pod_cidrs, crate::domain::NODE_PREFIX_LEN_V6, taken) {
        Ok((s, _)) => Some(s),
        Err(e) => {
            tracing::warn!(node = name, "no IPv6 subnet for the node: {e}");
            None
        }
    }
}

/// A new node record with a declared (checked) or allocated subnet.
pub(super) fn new_node(
    snap: &super::Snapshot,
    site: &Site,
    name: &str,
    declared: Option<Ipv4Net>,
) -> Result<Node, Error> {
    // Node names are chosen by whoever holds a token that does not fix
    // one: a name picked to hash like another node's would take over that
    // node's link on every gateway, and its traffic.
    let link = crate::render::gateway_link_name(name);
    if let Some(other) = snap.nodes_with_link(&link).iter().find(|n| *n != name) {
        return Err(Error::InvalidArgument(format!(
            "name: node {name:?} would use the gateways' link {link}, which node {other:?} uses (the names hash \
             alike); choose another name"
        )));
    }
    let taken = snap.node_subnets();
    let (subnet, source) = match declared {
        Some(_) if site.pod_cidrs.is_empty() => {
            return Err(Error::InvalidArgument(
                "subnet: this site has no IPv4 pod CIDRs, so its nodes have no IPv4 subnet; drop --subnet".into(),
            ));
        }
        Some(d) => {
            ipam::check_declared_subnet(d, &site.pod_cidrs, &taken)?;
            (Some(d), SubnetSource::Declared)
        }
        // A site without IPv4 pods: the node's workloads are IPv6 only.
        None if site.pod_cidrs.is_empty() => (None, SubnetSource::Allocated),
        None => {
            let nets: Vec<Ipv4Net> = taken.iter().map(|t| t.1).collect();
            (
                Some(ipam::allocate_node_subnet(&site.pod_cidrs, site.node_prefix_len, &nets)?.0),
                SubnetSource::Allocated,
            )
        }
    };
    let subnet_v6 = match site.ipv6.as_ref() {
        // Its only subnet: no /64 left is the node's refusal.
        Some(v6) if subnet.is_none() => Some(
            ipam::allocate_node_subnet(
                &v6.pod_cidrs,
                crate::domain::NODE_PREFIX_LEN_V6,
                &snap.node_subnets_v6(),
            )?
            .0,
        ),
        Some(v6) => ipv6_subnet(v6, name, &snap.node_subnets_v6()),
        None => None,
    };
    Ok(Node {
        name: name.to_string(),
        subnet,
        subnet_v6,
        source,
        created_at_ms: now_ms(),
        certs: vec![],
        internal_ip: None,
        underlay_ip: None,
        geneve: false,
        identity_conflict: None,
        enrolled_at_ms: 0,
    })
}

/// What agents report about their hosts, recorded when it changes.
impl State {
    /// Records what gateway `name`'s endpoint discovery found, per
    /// peering port (a write only when it changed, which sends the peers
    /// its new candidates).
    pub async fn set_discovered(
        &self,
        name: &str,
        discovered: std::collections::BTreeMap<u16, weft_core::nat::Discovered>,
    ) -> Result<(), Error> {
        let key = self.at(Key::Gateway(name));
        for _ in 0..super::MAX_ATTEMPTS {
            let Some(kv) = self.store.get(&key).await? else {
                return Err(Error::Unauthenticated(format!(
                    "{name:?} has been removed; enroll it again"
                )));
            };
            let mut g: crate::domain::Gateway = super::decode(&kv)?;
            if g.discovered == discovered {
                return Ok(());
            }
            g.discovered = discovered.clone();
            let txn = Txn::new()
                .when(Compare::ModRevision(key.clone(), kv.mod_revision))
                .then(Op::put(key.clone(), encode(&g)));
            if self.store.txn(txn).await?.succeeded {
                tracing::info!(gateway = name, ?discovered, "endpoint discovery changed");
                return Ok(());
            }
        }
        Err(Error::Aborted("the gateway's record kept changing; retry".into()))
    }

    /// Records whether agent `name`'s kernel can make Geneve links and
    /// (gateways) whether its agent enforces export policies, and with IPv6
    /// prefixes: a write only when one changed (which re-renders its
    /// tunnels).
    pub async fn set_features(
        &self,
        role: crate::domain::AgentRole,
        name: &str,
        geneve: bool,
        (enforces_export, enforces_export_v6, punches_beside): (bool, bool, bool),
    ) -> Result<(), Error> {
        use crate::domain::{AgentRole, Gateway, Node};
        fn set<T: serde::Serialize + serde::de::DeserializeOwned>(
            kv: &crate::store::KeyValue,
            change: impl Fn(&mut T) -> bool,
        ) -> Result<Option<Vec<u8>>, Error> {
            let mut rec: T = super::decode(kv)?;
            Ok(change(&mut rec).then(|| encode(&rec)))
        }
        let key = match role {
            AgentRole::Node => self.at(Key::Node(name)),
            AgentRole::Gateway => self.at(Key::Gateway(name)),
        };
        for _ in 0..super::MAX_ATTEMPTS {
            let Some(kv) = self.store.get(&key).await? else {
                return Err(Error::Unauthenticated(format!(
                    "{name:?} has been removed; enroll it again"
                )));
            };
            let new = match role {
                AgentRole::Node => set::<Node>(&kv, |n| std::mem::replace(&mut n.geneve, geneve) != geneve)?,
                AgentRole::Gateway => set::<Gateway>(&kv, |g| {
                    let now = (geneve, enforces_export, enforces_export_v6, punches_beside);
                    let was = (g.geneve, g.enforces_export, g.enforces_export_v6, g.punches_beside);
                    (g.geneve, g.enforces_export, g.enforces_export_v6, g.punches_beside) = now;
                    was != now
                })?,
            };
            let Some(value) = new else { return Ok(()) };
            let txn = Txn::new()
                .when(Compare::ModRevision(key.clone(), kv.mod_revision))
                .then(Op::put(key.clone(), value));
            if self.store.txn(txn).await?.succeeded {
                tracing::info!(
                    agent = name,
                    geneve,
                    enforces_export,
                    enforces_export_v6,
                    punches_beside,
                    "agent features changed"
                );
                return Ok(());
            }
        }
        Err(Error::Aborted("the agent's record kept changing; retry".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_parsing() {
        let t = format!("weft1.{}.{}", "a1".repeat(6), "0f".repeat(16));
        assert_eq!(ParsedToken::parse(&t).unwrap().id, "a1".repeat(6));
        for bad in [
            "",
            "weft1",
            "weft1.abc.def",
            &t.replace("weft1", "weft2"),
            &format!("{t}.x"),
            &t.to_uppercase(),
        ] {
            assert!(
                matches!(ParsedToken::parse(bad), Err(Error::InvalidArgument(_))),
                "{bad}"
            );
        }
    }
}
