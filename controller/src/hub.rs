//! The desired-state hub: keeps the site model in memory, follows the store,
//! and tells each connected agent's stream when something that concerns it
//! changed.
//!
//! The hub never renders or sends itself and never waits for a stream: it
//! only marks a stream's pending work (a full re-render, or the parts of a
//! gateway's state that changed) and wakes it. Each stream task renders and
//! sends at its own pace, so a slow agent receives the changes coalesced into
//! one delta and never holds up the others.
//!
//! Concerns: a node record → that node and every gateway (one part each);
//! a gateway record → every node (the overlay's far end) and that gateway;
//! a peering → every agent; the site → every agent.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::Notify;

use weft_proto::v1 as pb;

use crate::domain::{AgentRole, Gateway, Node, Peering, Site, now_ms};
use crate::error::Error;
use crate::render::{Model, Part};
use crate::state::{AliveRecord, State};
use crate::store::{EventKind, LeaseId, Op, StoreError, Txn};

pub type AgentKey = (AgentRole, String);

/// Work waiting for one stream.
#[derive(Debug, Default)]
pub struct Pending {
    pub full: bool,
    pub parts: BTreeSet<Part>,
    /// The agent's record was deleted: end the stream.
    pub removed: bool,
    /// Every certificate of the agent was revoked (two holders of its
    /// identity): end the stream, without telling it it was removed.
    pub revoked: bool,
}

/// One connected stream.
#[derive(Debug, Default)]
pub struct Slot {
    pending: Mutex<Pending>,
    pub notify: Notify,
    /// Revision of the last state sent on this stream.
    pub latest: AtomicI64,
    /// A newer stream of the same agent replaced this one.
    pub superseded: AtomicBool,
}

impl Slot {
    pub fn take(&self) -> Pending {
        std::mem::take(&mut *self.pending.lock().unwrap())
    }

    fn mark(&self, f: impl FnOnce(&mut Pending)) {
        f(&mut self.pending.lock().unwrap());
        self.notify.notify_one();
    }
}

struct Live {
    lease: LeaseId,
    last: AliveRecord,
    /// When this replica last heard the agent (monotonic: a wall-clock
    /// step must not end anyone's liveness).
    heard: std::time::Instant,
    last_keepalive_ms: u64,
}

pub struct Hub {
    /// This replica's id, random per start, written into the liveness
    /// records of the agents that report here.
    replica: String,
    state: State,
    model: RwLock<Arc<Model>>,
    slots: Mutex<HashMap<AgentKey, Arc<Slot>>>,
    live: Mutex<HashMap<AgentKey, Live>>,
    last_seen: Mutex<HashMap<AgentKey, u64>>,
    /// Each agent's latest host facts (they come every 30 s, heartbeats
    /// between carry none): kept across a lapse of its liveness, so a
    /// record made anew after one still has them.
    facts: Mutex<HashMap<AgentKey, pb::HostReport>>,
    /// Bumped (to the store revision) when something peers see changed:
    /// the site or a gateway.
    pub params_rev: tokio::sync::watch::Sender<i64>,
    /// Set at shutdown; long-lived streams end when they see it.
    pub closing: tokio::sync::watch::Sender<bool>,
    /// Woken when a gateway's liveness record comes or goes, so the
    /// active gateway is chosen again at once.
    live_changed: Notify,
    /// Status records waiting for the next batched write.
    dirty: Mutex<HashMap<AgentKey, (LeaseId, AliveRecord)>>,
    pub agent_ttl: Duration,
    pub gateway_ttl: Duration,
    /// Each gateway's latest tunnel report (when, what). Kept in memory:
    /// it changes with every report and is worth nothing once stale.
    tunnels: Mutex<HashMap<String, (u64, Vec<pb::TunnelStatus>)>>,
    /// Dropped with the hub, which ends the store follower.
    _alive: tokio::sync::oneshot::Sender<()>,
}

/// An agent record as the hub compares it.
trait AgentRecord: serde::de::DeserializeOwned + Clone + PartialEq {
    /// The record without its certificates (which render nothing).
    fn without_certs(&self) -> Self;
    fn in_conflict(&self) -> bool;
}

impl AgentRecord for Node {
    fn without_certs(&self) -> Self {
        Node {
            certs: vec![],
            ..self.clone()
        }
    }
    fn in_conflict(&self) -> bool {
        self.identity_conflict.is_some()
    }
}

impl AgentRecord for Gateway {
    fn without_certs(&self) -> Self {
        Gateway {
            certs: vec![],
            ..self.clone()
        }
    }
    fn in_conflict(&self) -> bool {
        self.identity_conflict.is_some()
    }
}

/// What a store event did to an agent's record in the model.
enum AgentChange {
    /// Only its certificates changed, or it could not be read (kept).
    Nothing,
    /// Every certificate of it was revoked (two holders).
    Revoked,
    Changed {
        removed: bool,
    },
}

/// Applies a put (`value`) or a delete (None) of agent record `name` to
/// `records`. An unreadable record is not a removed one: the last one
/// read stays.
fn apply_agent<T: AgentRecord>(
    records: &mut imbl::OrdMap<String, Arc<T>>,
    name: &str,
    value: Option<&[u8]>,
) -> AgentChange {
    let new = match value.map(serde_json::from_slice::<T>) {
        None => None,
        Some(Ok(r)) => Some(Arc::new(r)),
        Some(Err(e)) => {
            tracing::error!(agent = name, error = %e, "cannot read an agent's record; keeping the last one");
            return AgentChange::Nothing;
        }
    };
    let old = match &new {
        Some(r) => records.insert(name.to_string(), r.clone()),
        None => records.remove(name),
    };
    match (&old, &new) {
        (Some(a), Some(b)) if !a.in_conflict() && b.in_conflict() => AgentChange::Revoked,
        (Some(a), Some(b)) if a.without_certs() == b.without_certs() => AgentChange::Nothing,
        _ => AgentChange::Changed { removed: new.is_none() },
    }
}

impl Hub {
    /// Loads the model and starts following the store.
    pub async fn start(state: State, agent_ttl: Duration, gateway_ttl: Duration) -> Result<Arc<Hub>, Error> {
        let model = state.model().await?;
        let (alive_tx, alive_rx) = tokio::sync::oneshot::channel();
        let hub = Arc::new(Hub {
            replica: {
                let mut b = [0u8; 6];
                ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b).expect("the system RNG works");
                b.iter().map(|x| format!("{x:02x}")).collect()
            },
            state,
            model: RwLock::new(Arc::new(model)),
            slots: Mutex::new(HashMap::new()),
            live: Mutex::new(HashMap::new()),
            last_seen: Mutex::new(HashMap::new()),
            facts: Mutex::new(HashMap::new()),
            dirty: Mutex::new(HashMap::new()),
            params_rev: tokio::sync::watch::Sender::new(0),
            closing: tokio::sync::watch::Sender::new(false),
            live_changed: Notify::new(),
            agent_ttl,
            gateway_ttl,
            tunnels: Mutex::new(HashMap::new()),
            _alive: alive_tx,
        });
        let weak = Arc::downgrade(&hub);
        weft_common::task::supervise("status-flush", weft_common::task::OnFailure::Restart, move || {
            let weak = weak.clone();
            async move {
                flush_status(weak).await;
                Ok(())
            }
        });
        let weak = Arc::downgrade(&hub);
        weft_common::task::supervise("liveness", weft_common::task::OnFailure::Restart, move || {
            let weak = weak.clone();
            async move {
                expire_silent(weak).await;
                Ok(())
            }
        });
        weft_common::task::spawn_critical("model-follow", follow(Arc::downgrade(&hub), alive_rx));
        Ok(hub)
    }

    pub fn model(&self) -> Arc<Model> {
        self.model.read().unwrap().clone()
    }

    /// Registers a stream for `key`, replacing (and ending) an older one.
    pub fn subscribe(&self, key: AgentKey) -> Arc<Slot> {
        let slot = Arc::new(Slot::default());
        if let Some(old) = self.slots.lock().unwrap().insert(key, slot.clone()) {
            old.superseded.store(true, Ordering::SeqCst);
            old.notify.notify_one();
        }
        slot
    }

    pub fn unsubscribe(&self, key: &AgentKey, slot: &Arc<Slot>) {
        let mut slots = self.slots.lock().unwrap();
        if slots.get(key).is_some_and(|s| Arc::ptr_eq(s, slot)) {
            slots.remove(key);
        }
    }

    /// The revision of the last state sent to `key`, if it is connected here.
    pub fn latest(&self, key: &AgentKey) -> Option<i64> {
        self.slots
            .lock()
            .unwrap()
            .get(key)
            .map(|s| s.latest.load(Ordering::SeqCst))
    }

    /// Ends every stream (at shutdown), so agents reconnect elsewhere at once
    /// instead of holding the server's drain open.
    pub fn close_all(&self) {
        self.closing.send_replace(true);
        for s in self.slots.lock().unwrap().values() {
            s.superseded.store(true, Ordering::SeqCst);
            s.notify.notify_one();
        }
    }

    pub fn connected(&self) -> usize {
        self.slots.lock().unwrap().len()
    }

    /// Per connected stream: its agent and how many updates wait for it (a
    /// pending full render counts as one, plus each pending part).
    pub fn stream_backlog(&self) -> Vec<(AgentKey, usize)> {
        self.slots
            .lock()
            .unwrap()
            .iter()
            .map(|(key, s)| {
                let p = s.pending.lock().unwrap();
                (key.clone(), usize::from(p.full) + p.parts.len())
            })
            .collect()
    }

    /// Every gateway's latest tunnel report, with when it came.
    pub fn tunnel_reports(&self) -> Vec<(String, u64, Vec<pb::TunnelStatus>)> {
        self.tunnels
            .lock()
            .unwrap()
            .iter()
            .map(|(gw, (at, ts))| (gw.clone(), *at, ts.clone()))
            .collect()
    }

    /// Applies one store event: updates the model first, then marks the
    /// streams it concerns, so a woken stream always renders the new model.
    fn apply(&self, key: &str, kind: EventKind, value: &[u8], revision: i64) {
        let root = self.state.root();
        let Some(rest) = key.strip_prefix(root) else { return };
        let mut model = (*self.model()).clone();
        model.revision = revision;
        let put = kind == EventKind::Put;
        // Who to tell, decided while updating the model.
        enum Mark {
            Everyone,
            Nothing,
            Node {
                name: String,
                removed: bool,
                /// Nodes whose names hash alike: whether they are rendered
                /// may have changed with this one.
                sharing: Vec<String>,
            },
            Gateway {
                name: String,
                removed: bool,
            },
            /// A peering, and the peerings whose ids hash alike.
            Peering(String, Vec<String>),
            /// Every certificate of this agent was revoked.
            Revoked((AgentRole, String)),
            /// A published name: gateways (exports) and peers' parameters.
            Names,
        }
        let mark = if rest == "gateway-active" {
            model.active_gateway = put.then(|| String::from_utf8_lossy(value).into_owned());
            Mark::Everyone
        } else if let Some(name) = rest.strip_prefix("alive/gateway/") {
            if put {
                model.live_gateways.insert(name.to_string());
            } else {
                model.live_gateways.remove(name);
            }
            Mark::Nothing
        } else if rest == "site" {
            if put && let Ok(s) = serde_json::from_slice::<Site>(value) {
                model.site = Some(Arc::new(s));
            }
            Mark::Everyone
        } else if let Some(name) = rest.strip_prefix("nodes/") {
            let change = apply_agent(&mut model.nodes, name, put.then_some(value));
            let sharing = model.index_node(name);
            match change {
                AgentChange::Nothing => Mark::Nothing,
                AgentChange::Revoked => Mark::Revoked((AgentRole::Node, name.to_string())),
                AgentChange::Changed { removed } => Mark::Node {
                    name: name.to_string(),
                    removed,
                    sharing,
                },
            }
        } else if let Some(name) = rest.strip_prefix("gateways/") {
            match apply_agent(&mut model.gateways, name, put.then_some(value)) {
                AgentChange::Nothing => Mark::Nothing,
                AgentChange::Revoked => Mark::Revoked((AgentRole::Gateway, name.to_string())),
                AgentChange::Changed { removed } => Mark::Gateway {
                    name: name.to_string(),
                    removed,
                },
            }
        } else if let Some(name) = rest.strip_prefix("names/") {
            match put
                .then(|| serde_json::from_slice::<crate::names::NameRecord>(value).ok())
                .flatten()
            {
                Some(n) => model.names.insert(name.to_string(), Arc::new(n)),
                None => model.names.remove(name),
            };
            Mark::Names
        } else if let Some(name) = rest.strip_prefix("peerings/") {
            match put.then(|| serde_json::from_slice::<Peering>(value).ok()).flatten() {
                Some(p) => model.peerings.insert(name.to_string(), Arc::new(p)),
                None => model.peerings.remove(name),
            };
            let sharing = model.index_peering(name);
            Mark::Peering(name.to_string(), sharing)
        } else {
            return;
        };
        *self.model.write().unwrap() = Arc::new(model);
        if rest.starts_with("alive/gateway/") {
            self.live_changed.notify_one();
        }
        // A removed agent's bookkeeping goes with it (a site where nodes
        // come and go would otherwise grow by each one).
        match &mark {
            Mark::Node {
                name, removed: true, ..
            } => self.forget((AgentRole::Node, name.clone())),
            Mark::Gateway { name, removed: true } => self.forget((AgentRole::Gateway, name.clone())),
            _ => {}
        }
        if matches!(mark, Mark::Everyone | Mark::Gateway { .. } | Mark::Names) {
            tracing::debug!(revision, "parameters peers see changed");
            self.params_rev.send_replace(revision);
        }

        let slots = self.slots.lock().unwrap();
        let each = |role: AgentRole, f: &dyn Fn(&Slot)| {
            for ((r, _), s) in slots.iter() {
                if *r == role {
                    f(s);
                }
            }
        };
        match mark {
            Mark::Nothing => {}
            Mark::Revoked(key) => {
                if let Some(s) = slots.get(&key) {
                    s.mark(|p| p.revoked = true);
                }
            }
            Mark::Everyone => {
                for s in slots.values() {
                    s.mark(|p| p.full = true);
                }
            }
            Mark::Node { name, removed, sharing } => {
                if let Some(s) = slots.get(&(AgentRole::Node, name.clone())) {
                    s.mark(|p| if removed { p.removed = true } else { p.full = true });
                }
                for other in &sharing {
                    if let Some(s) = slots.get(&(AgentRole::Node, other.clone())) {
                        s.mark(|p| p.full = true);
                    }
                }
                each(AgentRole::Gateway, &|s| {
                    s.mark(|p| {
                        p.parts.insert(Part::Node(name.clone()));
                        p.parts.extend(sharing.iter().cloned().map(Part::Node));
                    })
                });
            }
            Mark::Gateway { name, removed } => {
                if let Some(s) = slots.get(&(AgentRole::Gateway, name)) {
                    s.mark(|p| if removed { p.removed = true } else { p.full = true });
                }
                each(AgentRole::Node, &|s| s.mark(|p| p.full = true));
            }
            Mark::Names => each(AgentRole::Gateway, &|s| s.mark(|p| p.full = true)),
            Mark::Peering(name, sharing) => {
                each(AgentRole::Node, &|s| s.mark(|p| p.full = true));
                each(AgentRole::Gateway, &|s| {
                    s.mark(|p| {
                        p.parts.insert(Part::Peer(name.clone()));
                        p.parts.extend(sharing.iter().cloned().map(Part::Peer));
                    })
                });
            }
        }
    }

    /// Reloads everything (after a broken watch) and re-renders every stream.
    async fn reload(&self) -> Result<i64, Error> {
        let model = self.state.model().await?;
        let rev = model.revision;
        *self.model.write().unwrap() = Arc::new(model);
        for s in self.slots.lock().unwrap().values() {
            s.mark(|p| p.full = true);
        }
        Ok(rev)
    }

    /// Keeps gateway `name`'s tunnel report.
    pub fn report_tunnels(&self, name: &str, tunnels: Vec<pb::TunnelStatus>) {
        self.tunnels
            .lock()
            .unwrap()
            .insert(name.to_string(), (now_ms(), tunnels));
    }

    /// The tunnel to peer `site` as the gateways reported it within the
    /// agent TTL: an up one if any gateway has it up, else the newest.
    pub fn tunnel(&self, site: &str) -> Option<pb::TunnelStatus> {
        let fresh_after = now_ms().saturating_sub(self.agent_ttl.as_millis() as u64);
        let all = self.tunnels.lock().unwrap();
        let mut seen: Vec<(u64, pb::TunnelStatus)> = all
            .iter()
            .filter(|(_, (at, _))| *at >= fresh_after)
            .flat_map(|(gw, (at, ts))| {
                ts.iter().filter(|t| t.peer_site == site).map(move |t| {
                    let mut t = t.clone();
                    t.gateway = gw.clone();
                    t.reported_at = Some(weft_proto::timestamp_ms(*at));
                    (*at, t)
                })
            })
            .collect();
        seen.sort_by_key(|(at, t)| (t.up, *at));
        seen.pop().map(|(_, t)| t)
    }

    /// A peering's state as users see it: Negotiated becomes Connected
    /// while a probe through its tunnel is answered.
    pub fn peering_state(&self, p: &Peering) -> crate::domain::PeeringState {
        use crate::domain::PeeringState;
        if p.state == PeeringState::Negotiated && self.tunnel(&p.site_id).is_some_and(|t| t.up) {
            PeeringState::Connected
        } else {
            p.state
        }
    }

    /// How long an agent of `role` stays live without a report: gateways
    /// have their own, short TTL (their liveness decides failover).
    pub fn ttl(&self, role: AgentRole) -> Duration {
        match role {
            AgentRole::Gateway => self.gateway_ttl,
            AgentRole::Node => self.agent_ttl,
        }
    }

    /// A gateway's stream to this replica ended without a shutdown or a
    /// replacement: its agent (or host) is gone. Its liveness record goes at
    /// once, so that the leading replica fails over now, not at the end of
    /// its lease.
    pub async fn gone(&self, key: &AgentKey) {
        let lease = self.live.lock().unwrap().remove(key).map(|l| l.lease);
        if let Some(lease) = lease {
            tracing::info!(agent = %key.1, "gateway disconnected; no longer live");
            self.end_liveness(key, lease).await;
        }
    }

    /// Ends `key`'s liveness record now (revoking its lease deletes it).
    async fn end_liveness(&self, key: &AgentKey, lease: LeaseId) {
        self.dirty.lock().unwrap().remove(key);
        if let Err(e) = self.state.store().lease_revoke(lease).await {
            tracing::warn!(agent = %key.1, error = %e, "cannot end its liveness record; it ends with its lease");
        }
    }

    /// The agents this replica heard from last more than their TTL ago:
    /// their records end now, whatever the store's lease granularity
    /// (etcd's leases are whole seconds, at least about two). `stalled`:
    /// this replica itself did not run for a while, so the silence may be
    /// its own; everyone gets a TTL from now instead.
    fn expire_silent_once(self: &Arc<Self>, stalled: bool) {
        let now = std::time::Instant::now();
        let silent: Vec<(AgentKey, LeaseId, Duration)> = {
            let mut live = self.live.lock().unwrap();
            if stalled {
                for l in live.values_mut() {
                    l.heard = now;
                }
                return;
            }
            let keys: Vec<AgentKey> = live
                .iter()
                .filter(|(k, l)| now.duration_since(l.heard) > self.ttl(k.0))
                .map(|(k, _)| k.clone())
                .collect();
            keys.into_iter()
                .filter_map(|k| {
                    let l = live.remove(&k)?;
                    Some((k, l.lease, now.duration_since(l.heard)))
                })
                .collect()
        };
        for (key, lease, quiet) in silent {
            tracing::warn!(
                agent = %key.1,
                role = ?key.0,
                silent_ms = quiet.as_millis() as u64,
                ttl_ms = self.ttl(key.0).as_millis() as u64,
                "no report within the TTL; no longer live"
            );
            // Not awaited: a slow store must not hold up the sweep (nor
            // make it look like this replica stalled).
            let hub = self.clone();
            tokio::spawn(async move { hub.end_liveness(&key, lease).await });
        }
    }

    /// An agent's report: its heartbeat, applied revision and errors. The
    /// record under `alive/` lives on a lease with the agent's TTL; it is
    /// rewritten only when what it says changes.
    pub async fn report(
        &self,
        key: AgentKey,
        applied: i64,
        errors: Vec<String>,
        host: Option<pb::HostReport>,
    ) -> Result<(), Error> {
        let now = now_ms();
        self.last_seen.lock().unwrap().insert(key.clone(), now);
        let mut record = AliveRecord {
            applied_revision: applied,
            errors,
            since_ms: now,
            features: Vec::new(),
            route_conflicts: Vec::new(),
            wireguard: String::new(),
            wireguard_reason: String::new(),
            replica: self.replica.clone(),
        };
        // Host facts come now and then; the last ones hold meanwhile.
        let h = match host {
            Some(mut h) => {
                h.features.truncate(32);
                h.route_conflicts.truncate(100);
                self.facts.lock().unwrap().insert(key.clone(), h.clone());
                Some(h)
            }
            None => self.facts.lock().unwrap().get(&key).cloned(),
        };
        if let Some(h) = h {
            record.features = h.features;
            record.route_conflicts = h.route_conflicts;
            record.wireguard = h.wireguard;
            record.wireguard_reason = h.wireguard_reason;
        }
        // Decide under the lock, talk to the store outside it: reports of
        // different agents never wait for each other's store round trips.
        let keepalive_every = (self.ttl(key.0).as_millis() as u64 / 4).max(1);
        let lease = {
            let mut live = self.live.lock().unwrap();
            match live.get_mut(&key) {
                Some(l) => {
                    l.heard = std::time::Instant::now();
                    if (AliveRecord {
                        since_ms: 0,
                        ..l.last.clone()
                    }) != (AliveRecord {
                        since_ms: 0,
                        ..record.clone()
                    }) {
                        // Written with the others in the next batch: after a
                        // change for all agents that is one transaction per
                        // 128 agents, not one write per agent.
                        self.dirty
                            .lock()
                            .unwrap()
                            .insert(key.clone(), (l.lease, record.clone()));
                        l.last = record.clone();
                    }
                    // The lease needs renewing only a few times per TTL.
                    if now.saturating_sub(l.last_keepalive_ms) < keepalive_every {
                        return Ok(());
                    }
                    l.last_keepalive_ms = now;
                    Some(l.lease)
                }
                None => None,
            }
        };
        let store = self.state.store();
        if let Some(lease) = lease {
            match store.lease_keep_alive(lease).await {
                Ok(_) => return Ok(()),
                Err(StoreError::LeaseNotFound(_)) => {
                    self.live.lock().unwrap().remove(&key);
                }
                Err(e) => return Err(e.into()),
            }
        }
        let lease = store.lease_grant(self.ttl(key.0)).await?;
        let put = Op::Put {
            key: self.state.alive_key(key.0, &key.1),
            value: serde_json::to_vec(&record).unwrap(),
            lease: Some(lease),
        };
        store.txn(Txn::new().then(put)).await?;
        self.live.lock().unwrap().insert(
            key,
            Live {
                lease,
                last: record,
                heard: std::time::Instant::now(),
                last_keepalive_ms: now,
            },
        );
        Ok(())
    }

    /// Drops what this replica keeps about a removed agent; its liveness
    /// record (on a lease) ends now instead of at the lease's end.
    fn forget(&self, key: AgentKey) {
        self.last_seen.lock().unwrap().remove(&key);
        self.facts.lock().unwrap().remove(&key);
        self.dirty.lock().unwrap().remove(&key);
        if key.0 == AgentRole::Gateway {
            self.tunnels.lock().unwrap().remove(&key.1);
        }
        let lease = self.live.lock().unwrap().remove(&key).map(|l| l.lease);
        if let (Some(lease), Ok(rt)) = (lease, tokio::runtime::Handle::try_current()) {
            let store = self.state.store().clone();
            rt.spawn(async move {
                let _ = store.lease_revoke(lease).await;
            });
        }
    }

    /// This replica's id (see [`AliveRecord::replica`]).
    pub fn replica(&self) -> &str {
        &self.replica
    }

    /// When this replica last heard from `key`.
    pub fn last_seen(&self, key: &AgentKey) -> Option<u64> {
        self.last_seen.lock().unwrap().get(key).copied()
    }
}

/// How often each replica looks for agents that fell silent: the TTL
/// holds to within this.
const SWEEP: Duration = Duration::from_millis(25);

/// Ends the liveness of agents not heard within their TTL (see
/// [`Hub::expire_silent_once`]).
async fn expire_silent(hub: std::sync::Weak<Hub>) {
    let mut tick = tokio::time::interval(SWEEP);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let due = tick.tick().await;
        let Some(h) = hub.upgrade() else { return };
        // A tick that came far too late: this process was stopped or
        // starved, and the agents' reports may be waiting unread.
        let stalled = due.elapsed() > h.gateway_ttl.min(h.agent_ttl) / 4;
        h.expire_silent_once(stalled);
    }
}

/// How often batched status records are written, and how many go in one
/// transaction (etcd allows 128 operations per transaction by default).
const STATUS_FLUSH: Duration = Duration::from_millis(200);
const STATUS_BATCH: usize = 128;

/// Writes the status records that changed since the last flush.
async fn flush_status(hub: std::sync::Weak<Hub>) {
    let mut tick = tokio::time::interval(STATUS_FLUSH);
    loop {
        tick.tick().await;
        let Some(h) = hub.upgrade() else { return };
        let batch: Vec<(AgentKey, (LeaseId, AliveRecord))> = h.dirty.lock().unwrap().drain().collect();
        let put = |(role, name): &AgentKey, lease: LeaseId, rec: &AliveRecord| Op::Put {
            key: h.state.alive_key(*role, name),
            value: serde_json::to_vec(rec).unwrap(),
            lease: Some(lease),
        };
        for chunk in batch.chunks(STATUS_BATCH) {
            let mut txn = Txn::new();
            for (key, (lease, rec)) in chunk {
                txn = txn.then(put(key, *lease, rec));
            }
            if let Err(e) = h.state.store().txn(txn).await {
                // One lease that expired meanwhile fails the batch: go one by one.
                tracing::debug!(error = %e, "status batch failed; writing records singly");
                for (key, (lease, rec)) in chunk {
                    if let Err(e) = h.state.store().txn(Txn::new().then(put(key, *lease, rec))).await {
                        tracing::debug!(agent = %key.1, error = %e, "status not written; kept for the next flush");
                        if !matches!(e, StoreError::LeaseNotFound(_)) {
                            h.dirty
                                .lock()
                                .unwrap()
                                .entry(key.clone())
                                .or_insert((*lease, rec.clone()));
                        }
                    }
                }
            }
        }
    }
}

/// Follows the store under the site's root and feeds the hub; on any break
/// (compaction, store outage) reloads and resumes.
async fn follow(hub: std::sync::Weak<Hub>, mut gone: tokio::sync::oneshot::Receiver<()>) {
    let mut from = match hub.upgrade() {
        Some(h) => h.model().revision + 1,
        None => return,
    };
    loop {
        let Some(h) = hub.upgrade() else { return };
        let root = h.state.root().to_string();
        let store = h.state.store().clone();
        drop(h);
        match store.watch_prefix(&root, from).await {
            Ok(mut w) => loop {
                let batch = tokio::select! {
                    b = w.next() => match b {
                        Some(b) => b,
                        None => break,
                    },
                    _ = &mut gone => return,
                };
                let Some(h) = hub.upgrade() else { return };
                match batch {
                    Ok(b) => {
                        for ev in &b.events {
                            h.apply(&ev.kv.key, ev.kind, &ev.kv.value, b.revision);
                        }
                        from = b.revision + 1;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "desired-state watch broke; reloading");
                        break;
                    }
                }
            },
            Err(e) => tracing::warn!(error = %e, "cannot watch the store; retrying"),
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = &mut gone => return,
        }
        let Some(h) = hub.upgrade() else { return };
        match h.reload().await {
            Ok(rev) => from = rev + 1,
            Err(e) => tracing::warn!(error = %e, "cannot reload the site model"),
        }
    }
}

/// On the leading replica: records which gateway is active whenever the
/// recorded one is not live (or none is recorded) and another is. Nodes
/// and peers follow the record; a gateway that comes back stays standby.
pub async fn choose_active_gateway(hub: Arc<Hub>, leader: tokio::sync::watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // A liveness change wakes it at once; the tick catches the rest
        // (a gateway record changed, leadership gained).
        tokio::select! {
            _ = tick.tick() => {}
            _ = hub.live_changed.notified() => {}
        }
        if !*leader.borrow() || *hub.closing.borrow() {
            continue;
        }
        let m = hub.model();
        let Some(next) = crate::render::next_active_gateway(&m) else {
            continue;
        };
        let key = hub.state.active_gateway_key();
        let guard = match &m.active_gateway {
            Some(old) => crate::store::Compare::Value(key.clone(), old.clone().into_bytes()),
            None => crate::store::Compare::Version(key.clone(), 0),
        };
        let txn = Txn::new().when(guard).then(Op::put(key, next.clone().into_bytes()));
        match hub.state.store().txn(txn).await {
            Ok(r) if r.succeeded => {
                tracing::info!(gateway = %next, previous = ?m.active_gateway, "gateway active now");
                // Wait for the hub to see it before deciding again.
                let seen = tokio::time::Instant::now() + Duration::from_secs(2);
                while hub.model().active_gateway.as_ref() != Some(&next) && tokio::time::Instant::now() < seen {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "cannot record the active gateway"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn hub(gateway_ttl: Duration) -> (Arc<Hub>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::store::embedded::EmbeddedStore::open(&dir.path().join("db")).unwrap();
        let state = State::new(Arc::new(store), "s");
        (
            Hub::start(state, Duration::from_secs(30), gateway_ttl).await.unwrap(),
            dir,
        )
    }

    async fn live(h: &Hub, name: &str) -> bool {
        h.state
            .alive()
            .await
            .unwrap()
            .contains_key(&(AgentRole::Gateway, name.to_string()))
    }

    /// A sub-second TTL holds although the store's leases last whole
    /// seconds: a gateway heard within its TTL stays live, one not heard
    /// for longer loses its record within the TTL and a sweep, and its next
    /// report makes it live again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_gateway_not_heard_for_its_ttl_is_no_longer_live() {
        let ttl = Duration::from_millis(300);
        let (h, _dir) = hub(ttl).await;
        let key = (AgentRole::Gateway, "gw".to_string());
        // How late this machine's timers run now (a loaded machine wakes
        // the sweep late too): the bound below allows for it.
        let mut lag = Duration::ZERO;
        for _ in 0..10 {
            h.report(key.clone(), 1, vec![], None).await.unwrap();
            let slept = std::time::Instant::now();
            tokio::time::sleep(ttl / 3).await;
            lag = lag.max(slept.elapsed().saturating_sub(ttl / 3));
            assert!(live(&h, "gw").await, "a gateway reporting every TTL/3 stays live");
        }
        h.report(key.clone(), 1, vec![], None).await.unwrap();
        let quiet = std::time::Instant::now();
        while live(&h, "gw").await {
            assert!(
                quiet.elapsed() < Duration::from_secs(1),
                "still live 1 s after its last report"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let after = quiet.elapsed();
        assert!(
            after >= ttl - Duration::from_millis(20) && after < ttl + Duration::from_millis(150) + 4 * lag,
            "liveness ended {after:?} after the last report (TTL {ttl:?}, timers late by up to {lag:?})"
        );
        h.report(key.clone(), 1, vec![], None).await.unwrap();
        assert!(live(&h, "gw").await, "a report makes it live again");
    }

    /// Host facts come every 30 s; a gateway whose liveness lapsed between
    /// two of them keeps its facts (its WireGuard mode among them) in the
    /// record its next heartbeat makes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn host_facts_survive_a_lapse_of_liveness() {
        let ttl = Duration::from_millis(300);
        let (h, _dir) = hub(ttl).await;
        let key = (AgentRole::Gateway, "gw".to_string());
        let facts = pb::HostReport {
            features: vec!["wireguard".into()],
            wireguard: "kernel".into(),
            wireguard_reason: "--wireguard kernel".into(),
            ..Default::default()
        };
        h.report(key.clone(), 1, vec![], Some(facts)).await.unwrap();
        let quiet = std::time::Instant::now();
        while live(&h, "gw").await {
            assert!(quiet.elapsed() < Duration::from_secs(2), "never lapsed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        h.report(key.clone(), 2, vec![], None).await.unwrap();
        let rec = h.state.alive().await.unwrap()[&key].clone();
        assert_eq!((rec.wireguard.as_str(), rec.features.len()), ("kernel", 1), "{rec:?}");
    }

    /// A replica that did not run for a while (stopped, starved) has not
    /// read the reports meanwhile: it gives everyone a TTL from when it runs
    /// again instead of ending them all.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_replica_does_not_end_everyone() {
        let (h, _dir) = hub(Duration::from_millis(300)).await;
        let key = (AgentRole::Gateway, "gw".to_string());
        h.report(key.clone(), 1, vec![], None).await.unwrap();
        for l in h.live.lock().unwrap().values_mut() {
            l.heard -= Duration::from_secs(5);
        }
        h.expire_silent_once(true);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(live(&h, "gw").await, "ended although the silence was the replica's own");
        h.expire_silent_once(false);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(live(&h, "gw").await, "a stall restarts the TTL from now");
    }
}
