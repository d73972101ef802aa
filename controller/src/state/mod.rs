//! The controller's records in the store, changed only through
//! transactions.
//!
//! Layout under `/weft/sites/<site-id>/`:
//! - `site`: the site's network configuration ([`Site`]);
//! - `nodes/<name>`, `gateways/<name>`, `peerings/<site-id>`: one JSON record each;
//! - `ipam/seq`: a counter every IPAM change bumps in the same transaction;
//! - `tokens/<id>`: enrollment tokens (only a hash of the secret);
//! - `names/<name>`: names the site publishes ([`crate::names::NameRecord`]);
//! - `revoked/<serial>`: revoked agent certificates until they expire.
//!
//! IPAM has no separate allocation table: what is allocated is exactly the
//! node subnets and peering views in the records, so the two can never
//! disagree. A change reads everything at one revision, computes with the
//! pure functions in [`crate::ipam`], and commits only if `ipam/seq` has not
//! moved since (optimistic concurrency). Several controller replicas on one
//! etcd therefore never hand out overlapping blocks; a loser retries on the
//! fresh state.

use std::sync::Arc;
use std::time::Duration;

use ipnet::Ipv4Net;
use serde::Serialize;
use serde::de::DeserializeOwned;

mod agents;
mod blocks;
mod ca;
mod certs;
mod export;
pub mod federation;
mod gateways;
mod ipv6;
pub mod layout;
mod names;
mod snapshot;
mod views;
use snapshot::Snapshot;

pub use layout::{Key, Prefix};

pub use agents::{Enrollment, ParsedToken};
pub use blocks::allocations_of;
use blocks::check_site_change;
pub use certs::revocations_lapsed_before;

use crate::domain::{Allocation, Gateway, Node, Peering, PeeringState, PoolUsage, Site, Token, now_ms, validate_name};
use crate::error::Error;
use crate::ipam::{self, CidrKind, View};
use crate::store::{Compare, KeyValue, Op, Revision, Store, StoreError, Txn};

/// Attempts before a write that keeps losing to concurrent writers gives up.
const MAX_ATTEMPTS: u32 = 32;
/// A state write this slow is logged (debug) with where its time went.
const SLOW_WRITE: Duration = Duration::from_millis(100);

#[derive(Clone)]
pub struct State {
    store: Arc<dyn Store>,
    root: String,
    /// Serializes this replica's writes and caches the snapshot they work
    /// on (see [`State::commit`]).
    writer: Arc<tokio::sync::Mutex<Option<Snapshot>>>,
}

fn decode<T: DeserializeOwned>(kv: &KeyValue) -> Result<T, Error> {
    serde_json::from_slice(&kv.value)
        .map_err(|e| Error::Store(StoreError::Corrupt(format!("record {} is unreadable: {e}", kv.key))))
}

fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("records always serialize")
}

impl State {
    pub fn new(store: Arc<dyn Store>, site_id: &str) -> Self {
        Self {
            store,
            root: format!("/weft/sites/{site_id}/"),
            writer: Arc::new(tokio::sync::Mutex::new(None)),
        }
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The store prefix of everything this site keeps.
    pub fn root(&self) -> &str {
        &self.root
    }

    /// The site as the renderer sees it, read at one revision.
    pub async fn model(&self) -> Result<crate::render::Model, Error> {
        let s = self.snapshot().await?;
        let mut m = crate::render::Model {
            revision: s.revision,
            site: s.site.map(Arc::new),
            ..Default::default()
        };
        for (n, _) in s.nodes {
            m.nodes.insert(n.name.clone(), Arc::new(n));
        }
        for (g, _) in s.gateways {
            m.gateways.insert(g.name.clone(), Arc::new(g));
        }
        for (p, _) in s.peerings {
            m.peerings.insert(p.site_id.clone(), Arc::new(p));
        }
        for (n, _) in s.names {
            m.names.insert(n.name.clone(), Arc::new(n));
        }
        let (nodes, peerings): (Vec<String>, Vec<String>) =
            (m.nodes.keys().cloned().collect(), m.peerings.keys().cloned().collect());
        for n in nodes {
            m.index_node(&n);
        }
        for p in peerings {
            m.index_peering(&p);
        }
        m.active_gateway = self
            .store
            .get(&self.active_gateway_key())
            .await?
            .map(|kv| String::from_utf8_lossy(&kv.value).into_owned());
        m.live_gateways = self
            .alive()
            .await?
            .into_keys()
            .filter(|(role, _)| *role == crate::domain::AgentRole::Gateway)
            .map(|(_, name)| name)
            .collect();
        Ok(m)
    }

    /// Where the name of the active gateway is recorded.
    pub fn active_gateway_key(&self) -> String {
        self.at(Key::GatewayActive)
    }

    /// Where an agent's liveness record lives.
    pub fn alive_key(&self, role: crate::domain::AgentRole, name: &str) -> String {
        self.at(Key::Alive(role, name))
    }

    /// Where a running replica's presence record lives.
    pub fn replica_key(&self, id: &str) -> String {
        self.at(Key::Replica(id))
    }

    /// Every live agent's record (agents whose lease has not expired).
    pub async fn alive(
        &self,
    ) -> Result<std::collections::HashMap<(crate::domain::AgentRole, String), AliveRecord>, Error> {
        let r = self.store.get_prefix(&self.under(Prefix::Alive)).await?;
        let mut out = std::collections::HashMap::new();
        for kv in &r.kvs {
            if let Some(Key::Alive(role, name)) = self.parse(&kv.key) {
                out.insert((role, name.to_string()), decode(kv)?);
            }
        }
        Ok(out)
    }

    /// The store key of `key`.
    pub fn at(&self, key: Key) -> String {
        format!("{}{}", self.root, key.path())
    }

    /// The store prefix of a family of keys.
    pub fn under(&self, prefix: Prefix) -> String {
        format!("{}{}", self.root, prefix.path())
    }

    /// What store key `key` holds; `None` outside this site or for a key
    /// weft does not keep.
    pub fn parse<'k>(&self, key: &'k str) -> Option<Key<'k>> {
        Key::parse(key.strip_prefix(self.root.as_str())?)
    }

    /// The key the replicas campaign on for singleton work.
    pub fn leader_key(&self) -> String {
        self.at(Key::Leader)
    }

    async fn snapshot(&self) -> Result<Snapshot, Error> {
        let range = self.store.get_prefix(&self.root).await?;
        let mut s = Snapshot {
            revision: range.revision,
            ..Default::default()
        };
        for kv in &range.kvs {
            let rev = kv.mod_revision;
            match self.parse(&kv.key) {
                Some(Key::Site) => s.site = Some(decode(kv)?),
                Some(Key::IpamSeq) => s.seq = (rev, decode(kv)?),
                Some(Key::Node(_)) => s.nodes.push((decode(kv)?, rev)),
                Some(Key::Gateway(_)) => s.gateways.push((decode(kv)?, rev)),
                Some(Key::PeerToken(_)) => s.peer_tokens.push((decode(kv)?, rev)),
                Some(Key::Token(_)) => s.tokens.push((decode(kv)?, rev)),
                Some(Key::Peering(_)) => s.peerings.push((decode(kv)?, rev)),
                Some(Key::Name(_)) => s.names.push((decode(kv)?, rev)),
                _ => {}
            }
        }
        Ok(s)
    }

    /// The compare and the put that make a transaction an IPAM change.
    fn ipam_guard(&self, snap: &Snapshot, txn: Txn) -> Txn {
        txn.when(Compare::ModRevision(self.at(Key::IpamSeq), snap.seq.0))
            .then(Op::put(self.at(Key::IpamSeq), encode(&(snap.seq.1 + 1))))
    }

    /// Runs `attempt` until its transaction commits.
    ///
    /// Writes of this replica go one at a time (a local mutex), on a cached
    /// snapshot that each committed transaction is folded into, so a busy
    /// replica neither re-reads the whole site per write nor fights itself.
    /// Other writers (replicas, token creation, renewals) make the cache
    /// stale; that is safe because every decision is guarded by a compare in
    /// the transaction: a stale attempt fails, and the next one re-reads. An
    /// attempt that refuses on a cached snapshot is repeated on a fresh one
    /// before the refusal is believed. `attempt` returns the transaction
    /// (`None`: nothing to write) and the value to hand back.
    async fn commit<T>(
        &self,
        mut attempt: impl FnMut(&Snapshot) -> Result<(Option<Txn>, T), Error>,
    ) -> Result<T, Error> {
        let started = std::time::Instant::now();
        let mut cache = self.writer.lock().await;
        let waited = started.elapsed();
        let mut reads = 0u32;
        for n in 0..MAX_ATTEMPTS {
            let (snap, cached) = match cache.take() {
                Some(s) => (s, true),
                None => {
                    reads += 1;
                    (self.snapshot().await?, false)
                }
            };
            let (txn, out) = match attempt(&snap) {
                Ok(x) => x,
                Err(_) if cached => continue,
                Err(e) => {
                    *cache = Some(snap);
                    return Err(e);
                }
            };
            let Some(txn) = txn else {
                if cached {
                    // "Nothing to write" may be the cache's staleness talking.
                    continue;
                }
                *cache = Some(snap);
                return Ok(out);
            };
            let ops = txn.ops.clone();
            let resp = self.store.txn(txn).await?;
            if resp.succeeded {
                *cache = snap.apply_ops(&self.root, &ops, resp.revision);
                let took = started.elapsed();
                if took >= SLOW_WRITE {
                    // Where a slow write's time went: waiting for the
                    // other writers, reading the site anew, or retrying.
                    tracing::debug!(
                        ms = took.as_millis() as u64,
                        waited_ms = waited.as_millis() as u64,
                        attempts = n + 1,
                        snapshots = reads,
                        "slow state write"
                    );
                }
                return Ok(out);
            }
            if !cached {
                tokio::time::sleep(Duration::from_millis(u64::from(n) * 3)).await;
            }
        }
        Err(Error::Aborted(format!(
            "gave up after {MAX_ATTEMPTS} attempts because other writers kept changing the site; retry"
        )))
    }

    /// Stores the configured site on first start. On later starts, accepts a
    /// changed configuration only if every node subnet and peer view stays
    /// valid under it.
    ///
    /// A site with IPv6 and no IPv6 remap pool configured keeps the pool
    /// recorded before, or gets a generated one ([`ipam::ula_pool`]); nodes
    /// without an IPv6 subnet get one (a site adding IPv6 keeps its nodes
    /// and peerings), and so do nodes without an IPv4 subnet when an
    /// IPv6-only site adds IPv4.
    pub async fn init_site(&self, configured: &Site) -> Result<Site, Error> {
        self.commit(|snap| {
            let mut site = configured.clone();
            if let Some(v6) = site.ipv6.as_mut().filter(|v| v.remap_pools.is_empty()) {
                let stored = snap.site.as_ref().and_then(|s| s.ipv6.as_ref());
                v6.remap_pools = match stored.filter(|s| !s.remap_pools.is_empty()) {
                    Some(s) => s.remap_pools.clone(),
                    None => vec![ipv6::generated_pool(&v6.own_blocks())?],
                };
            }
            let numbered = blocks::number_nodes(&site, snap)?;
            match &snap.site {
                Some(stored) if *stored == site && numbered.is_empty() => return Ok((None, site)),
                Some(_) => check_site_change(&site, snap)?,
                None => {}
            }
            let mut txn = self
                .ipam_guard(snap, Txn::new())
                .then(Op::put(self.at(Key::Site), encode(&site)));
            // Each only as read: a renewal written meanwhile is not undone.
            for (n, rev) in numbered {
                let key = self.at(Key::Node(&n.name));
                txn = txn
                    .when(Compare::ModRevision(key.clone(), rev))
                    .then(Op::put(key, encode(&n)));
            }
            Ok((Some(txn), site))
        })
        .await
    }

    /// The WireGuard port the peering with `peer` has, or would get if it
    /// were recorded now (it is recorded with [`State::negotiated`]).
    pub async fn wg_port_for(&self, peer: &str) -> Result<u16, Error> {
        self.snapshot().await?.wg_port(peer, None)
    }

    pub async fn site(&self) -> Result<(Site, Revision), Error> {
        let kv = self.store.get(&self.at(Key::Site)).await?;
        let kv = kv.ok_or_else(|| Error::FailedPrecondition("the site is not initialised in the store yet".into()))?;
        Ok((decode(&kv)?, self.store.revision().await?))
    }

    pub async fn list_nodes(&self) -> Result<(Vec<Node>, Revision), Error> {
        let s = self.snapshot().await?;
        Ok((s.nodes.into_iter().map(|n| n.0).collect(), s.revision))
    }

    pub async fn get_node(&self, name: &str) -> Result<Node, Error> {
        validate_name("the node name", name).map_err(Error::InvalidArgument)?;
        match self.store.get(&self.at(Key::Node(name))).await? {
            Some(kv) => decode(&kv),
            None => Err(Error::NotFound(format!(
                "node {name:?} does not exist; list nodes with `weftctl nodes`"
            ))),
        }
    }

    pub async fn get_gateway(&self, name: &str) -> Result<crate::domain::Gateway, Error> {
        validate_name("the gateway name", name).map_err(Error::InvalidArgument)?;
        match self.store.get(&self.at(Key::Gateway(name))).await? {
            Some(kv) => decode(&kv),
            None => Err(Error::NotFound(format!(
                "gateway {name:?} does not exist; list gateways with `weftctl gateways`"
            ))),
        }
    }

    /// Adds a node with an allocated subnet, or with `declared` after
    /// checking it.
    pub async fn create_node(&self, name: &str, declared: Option<Ipv4Net>) -> Result<Node, Error> {
        validate_name("the node name", name).map_err(Error::InvalidArgument)?;
        let key = self.at(Key::Node(name));
        self.commit(|snap| {
            let site = snap.site()?;
            if snap.nodes.iter().any(|(n, _)| n.name == name) {
                return Err(Error::AlreadyExists(format!(
                    "node {name:?} already exists; remove it first or choose another name"
                )));
            }
            let mut node = agents::new_node(snap, site, name, declared)?;
            node.internal_ip = Some(ipam::allocate_internal_ip(site.internal_cidr, &snap.internal_ips())?);
            let txn = self
                .ipam_guard(snap, Txn::new())
                .when(Compare::Version(key.clone(), 0))
                .then(Op::put(key.clone(), encode(&node)));
            Ok((Some(txn), node))
        })
        .await
    }

    /// Removes a node and releases its subnet.
    pub async fn delete_node(&self, name: &str) -> Result<Node, Error> {
        validate_name("the node name", name).map_err(Error::InvalidArgument)?;
        let key = self.at(Key::Node(name));
        self.commit(|snap| {
            let Some((node, rev)) = snap.nodes.iter().find(|(n, _)| n.name == name) else {
                return Err(Error::NotFound(format!(
                    "node {name:?} does not exist; list nodes with `weftctl nodes`"
                )));
            };
            let mut txn = self
                .ipam_guard(snap, Txn::new())
                .when(Compare::ModRevision(key.clone(), *rev))
                .then(Op::delete(key.clone()));
            for op in self.revoke_ops(
                crate::domain::AgentRole::Node,
                name,
                &node.certs,
                certs::Revocation::Removed,
            ) {
                txn = txn.then(op);
            }
            Ok((Some(txn), node.clone()))
        })
        .await
    }

    pub async fn list_gateways(&self) -> Result<(Vec<Gateway>, Revision), Error> {
        let s = self.snapshot().await?;
        Ok((s.gateways.into_iter().map(|g| g.0).collect(), s.revision))
    }

    pub async fn list_peerings(&self) -> Result<(Vec<Peering>, Revision), Error> {
        let s = self.snapshot().await?;
        Ok((s.peerings.into_iter().map(|p| p.0).collect(), s.revision))
    }

    /// The local views a peer with these CIDRs would get now. Writes nothing.
    pub async fn plan_views(&self, peer: &[(CidrKind, Ipv4Net)]) -> Result<Vec<View>, Error> {
        let snap = self.snapshot().await?;
        let site = snap.site()?;
        Ok(ipam::plan_views(
            peer,
            &snap.blocks_in_use(site, None),
            &site.remap_pools,
            &site.peer_public_cidrs,
        )?)
    }

    /// Records a peering with `peer_site` and allocates the local views of
    /// its CIDRs. A peering that exists already is re-planned keeping what
    /// still fits (its own old views do not count as in use).
    pub async fn upsert_peering(&self, peer_site: &str, peer: &[(CidrKind, Ipv4Net)]) -> Result<Peering, Error> {
        validate_name("the peer site id", peer_site).map_err(Error::InvalidArgument)?;
        let key = self.at(Key::Peering(peer_site));
        self.commit(|snap| {
            let site = snap.site()?;
            if site.id == peer_site {
                return Err(Error::InvalidArgument(format!(
                    "{peer_site:?} is this site's own id; a site cannot peer with itself"
                )));
            }
            let existing = snap.peerings.iter().find(|(p, _)| p.site_id == peer_site);
            let views = ipam::plan_views_keeping(
                peer,
                &snap.blocks_in_use(site, Some(peer_site)),
                &site.remap_pools,
                &site.peer_public_cidrs,
                &snap.views_of(peer_site),
                false,
            )?;
            let peering = Peering {
                site_id: peer_site.to_string(),
                state: existing.map_or(PeeringState::Pending, |(p, _)| p.state),
                views,
                created_at_ms: existing.map_or_else(now_ms, |(p, _)| p.created_at_ms),
                last_error: None,
                remote: existing.and_then(|(p, _)| p.remote.clone()),
                listen_port: snap.wg_port(peer_site, None)?,
                pending: existing.and_then(|(p, _)| p.pending.clone()),
                joined_with: existing.and_then(|(p, _)| p.joined_with.clone()),
                joined_at_ms: existing.map_or(0, |(p, _)| p.joined_at_ms),
                relay_ports: existing.map(|(p, _)| p.relay_ports.clone()).unwrap_or_default(),
                relay_via: existing.and_then(|(p, _)| p.relay_via.clone()),
                export: existing.and_then(|(p, _)| p.export.clone()),
                transit: existing.is_some_and(|(p, _)| p.transit),
                transit_views: existing.map(|(p, _)| p.transit_views.clone()).unwrap_or_default(),
                transit_views_v6: existing.map(|(p, _)| p.transit_views_v6.clone()).unwrap_or_default(),
                views_v6: vec![],
                ipv6_refused: None,
                pending_v6: None,
            };
            let guard = Compare::ModRevision(key.clone(), existing.map_or(0, |(_, r)| *r));
            let old = existing.map(|(p, _)| p.views.as_slice()).unwrap_or_default();
            let moved = Self::transit_off_direct(snap, site, peer_site, old, &peering.views, &[]);
            let txn = self
                .put_peerings(self.ipam_guard(snap, Txn::new()), moved)
                .when(guard)
                .then(Op::put(key.clone(), encode(&peering)));
            Ok((Some(txn), peering))
        })
        .await
    }

    /// Removes a peering and releases its views (a transit view of the
    /// same site through another peer that shared their block moves off
    /// it: the block is released, not handed on).
    pub async fn delete_peering(&self, peer_site: &str) -> Result<Peering, Error> {
        let removed = self.remove_peering(peer_site, false).await?;
        Ok(removed.expect("a deletion that is not of an unheld peering always removes"))
    }

    /// Removes the peering with `peer_site` because the peer does not hold
    /// it (or stayed away too long), unless it was made or joined again in
    /// the last [`federation::RECORD_WINDOW_MS`] (the peer may be recording
    /// its side right now; then Ok(None)). One the peer never confirmed
    /// gives back, in the same transaction, the token it was joined with
    /// (unless that has expired): the peer gave up before it recorded its
    /// side, and may retry with the same token.
    pub async fn drop_unheld_peering(&self, peer_site: &str) -> Result<Option<Peering>, Error> {
        self.remove_peering(peer_site, true).await
    }

    async fn remove_peering(&self, peer_site: &str, unheld: bool) -> Result<Option<Peering>, Error> {
        validate_name("the peer site id", peer_site).map_err(Error::InvalidArgument)?;
        let key = self.at(Key::Peering(peer_site));
        self.commit(|snap| {
            let (p, rev) = snap.peering(peer_site)?;
            if unheld && now_ms().saturating_sub(p.created_at_ms.max(p.joined_at_ms)) <= federation::RECORD_WINDOW_MS {
                return Ok((None, None));
            }
            let site = snap.site()?;
            let moved = Self::transit_off_direct(snap, site, peer_site, &p.views, &[], &[]);
            let mut txn = self
                .put_peerings(self.ipam_guard(snap, Txn::new()), moved)
                .when(Compare::ModRevision(key.clone(), *rev))
                .then(Op::delete(key.clone()));
            if let Some(t) = p.joined_with.as_ref().filter(|t| unheld && t.expires_at_ms > now_ms()) {
                let tkey = self.at(Key::PeerToken(&t.id));
                txn = txn
                    .when(Compare::Version(tkey.clone(), 0))
                    .then(Op::put(tkey, encode(t)));
            }
            Ok((Some(txn), Some(p.clone())))
        })
        .await
    }

    /// Every block IPAM holds, and each pool's usage.
    pub async fn allocations(&self) -> Result<(Vec<Allocation>, Vec<PoolUsage>, Revision), Error> {
        let snap = self.snapshot().await?;
        let site = snap.site()?;
        let (allocs, pools) = allocations_of(
            site,
            snap.nodes.iter().map(|(n, _)| n),
            snap.peerings.iter().map(|(p, _)| p),
        );
        Ok((allocs, pools, snap.revision))
    }
}

/// Liveness and status as stored under `alive/<role>/<name>`, on a lease.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AliveRecord {
    pub applied_revision: i64,
    pub errors: Vec<String>,
    pub since_ms: u64,
    /// The host facts of its latest host report.
    #[serde(default)]
    pub features: Vec<String>,
    #[serde(default)]
    pub route_conflicts: Vec<String>,
    /// Gateways: "kernel" or "userspace" WireGuard, and why.
    #[serde(default)]
    pub wireguard: String,
    #[serde(default)]
    pub wireguard_reason: String,
    /// The controller replica the agent reports to (its hub's id; empty in
    /// records of earlier versions).
    #[serde(default)]
    pub replica: String,
    /// The agent's release, as it reported (empty: one before 0.1.0).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub version: String,
}
