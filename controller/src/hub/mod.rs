//! The desired-state hub: keeps the site model in memory, follows the store,
//! and tells each connected agent's stream when something that concerns it
//! changed.
//!
//! The hub never sends itself and never waits for a stream: it
//! only marks a stream's pending work (a full re-render, or the parts of a
//! gateway's state that changed) and wakes it. Each stream task renders and
//! sends at its own pace, so a slow agent receives the changes coalesced into
//! one delta and never holds up the others.
//!
//! Concerns: a node record → that node and every gateway (one part each);
//! a gateway record → every node (the overlay's far end) and that gateway;
//! a peering → every agent; the site → every agent.
//!
//! By job: `index` (a store record into the model, and whom it concerns),
//! this module (the streams' slots and the store follower), `liveness`
//! (reports, leases, silent agents), `election` (the active gateway) and
//! `shared` (the part of node state every node shares, rendered and
//! encoded once per model for the streams that ask).

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::Notify;

use weft_proto::v1 as pb;

use crate::domain::{AgentRole, now_ms};
use crate::error::Error;
use crate::render::{Model, Part};
use crate::state::{AliveRecord, Key, State};
use crate::store::{EventKind, LeaseId};

mod election;
mod index;
mod liveness;
mod readiness;
mod shared;
mod timeline;

pub use election::choose_active_gateway;
use index::{Mark, update};
use liveness::{Live, expire_silent, flush_status, keep_leases};
use readiness::RouteRevs;
pub use shared::{Shared, SharedCache, Step};
pub use timeline::failover_steps;

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
    /// Between [`Slot::take`] and [`Slot::done`].
    busy: AtomicBool,
}

impl Pending {
    fn is_empty(&self) -> bool {
        !self.full && self.parts.is_empty() && !self.removed && !self.revoked
    }
}

impl Slot {
    /// The work waiting; the stream is busy with it until [`Slot::done`].
    pub fn take(&self) -> Pending {
        let mut p = self.pending.lock().unwrap();
        self.busy.store(true, Ordering::SeqCst);
        std::mem::take(&mut *p)
    }

    /// What [`Slot::take`] gave was rendered (and sent, `latest` updated)
    /// or found to change nothing.
    pub fn done(&self) {
        self.busy.store(false, Ordering::SeqCst);
    }

    /// Whether an agent that applied `applied` holds everything rendered
    /// for it: nothing waiting, nothing being rendered, its latest state
    /// applied.
    fn current(&self, applied: i64) -> bool {
        let p = self.pending.lock().unwrap();
        p.is_empty() && !self.busy.load(Ordering::SeqCst) && applied >= self.latest.load(Ordering::SeqCst)
    }

    fn mark(&self, f: impl FnOnce(&mut Pending)) {
        f(&mut self.pending.lock().unwrap());
        self.notify.notify_one();
    }
}

/// How long a list call waits for the model to catch up with the store
/// before it reads the store itself.
pub const FRESH_WAIT: Duration = Duration::from_secs(1);

/// How long admin reads go straight to the store after the model did not
/// catch up within [`FRESH_WAIT`].
pub const STORE_READS_AFTER_MISS: Duration = Duration::from_secs(30);

pub struct Hub {
    /// This replica's id, random per start, written into the liveness
    /// records of the agents that report here.
    replica: String,
    state: State,
    model: RwLock<Arc<Model>>,
    slots: Mutex<HashMap<AgentKey, Arc<Slot>>>,
    live: Mutex<HashMap<AgentKey, Live>>,
    /// The earliest moment an agent in `live` can fall silent (None:
    /// look at every sweep). Reports only move that moment later, so the
    /// sweep looks at all agents only once per about two thirds of a TTL,
    /// not 40 times a second.
    next_silence: Mutex<Option<std::time::Instant>>,
    /// After a stall: sweeps still to run on time before anyone is judged
    /// silent (see `liveness::expire_silent_once`).
    catch_up: Mutex<u32>,
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
    /// The store revision the model holds every write up to (under the
    /// site's root), advanced after each batch the follower applied.
    seen: tokio::sync::watch::Sender<i64>,
    /// When [`Hub::fresh`] last gave up waiting for the model.
    missed: Mutex<Option<std::time::Instant>>,
    /// Woken when a gateway's liveness record comes or goes, so the
    /// active gateway is chosen again at once.
    live_changed: Notify,
    /// Gateways whose liveness this replica ended and whose record the
    /// model still holds (its deletion on its way through the store): not
    /// live to the election, which so need not wait for the store.
    ended: Mutex<std::collections::HashSet<String>>,
    /// Passes of the election loop (see `election`), counted when it runs:
    /// the deletion of an ended gateway's record waits for the pass after
    /// the ending, so the election's write goes first (one store write
    /// fewer before a failover: on a starved host, half a second).
    election_passes: tokio::sync::watch::Sender<Option<u64>>,
    /// Status records waiting for the next batched write.
    dirty: Mutex<HashMap<AgentKey, (LeaseId, AliveRecord)>>,
    /// The lease this replica writes the liveness records of each role on
    /// (see `liveness`): one per role, renewed by one task.
    leases: tokio::sync::Mutex<HashMap<AgentRole, LeaseId>>,
    /// Woken when a write found a role's lease gone.
    lease_lost: Notify,
    pub agent_ttl: Duration,
    pub gateway_ttl: Duration,
    /// Each gateway's latest tunnel report (when, what). Kept in memory:
    /// it changes with every report and is worth nothing once stale.
    tunnels: Mutex<HashMap<String, (u64, Vec<pb::TunnelStatus>)>>,
    /// The part of node state every node shares, encoded once per model.
    pub node_shared: SharedCache,
    /// The latest failover's timeline as this replica saw it.
    timeline: Mutex<timeline::Timeline>,
    /// The revision of the latest change to what each peering renders
    /// (see [`Hub::behind_on`]).
    route_revs: Mutex<RouteRevs>,
    /// Bumped when an agent reports a new applied revision: what this
    /// site tells peers of its readiness may have changed.
    pub progress: tokio::sync::watch::Sender<u64>,
    /// Dropped with the hub, which ends the store follower.
    _alive: tokio::sync::oneshot::Sender<()>,
}

impl Hub {
    /// Loads the model and starts following the store.
    pub async fn start(state: State, agent_ttl: Duration, gateway_ttl: Duration) -> Result<Arc<Hub>, Error> {
        let model = state.model().await?;
        let loaded_at = model.revision;
        let (alive_tx, alive_rx) = tokio::sync::oneshot::channel();
        let hub = Arc::new(Hub {
            replica: crate::pki::random_hex(6),
            state,
            model: RwLock::new(Arc::new(model)),
            slots: Mutex::new(HashMap::new()),
            live: Mutex::new(HashMap::new()),
            next_silence: Mutex::new(None),
            catch_up: Mutex::new(0),
            last_seen: Mutex::new(HashMap::new()),
            facts: Mutex::new(HashMap::new()),
            dirty: Mutex::new(HashMap::new()),
            leases: tokio::sync::Mutex::new(HashMap::new()),
            lease_lost: Notify::new(),
            params_rev: tokio::sync::watch::Sender::new(0),
            closing: tokio::sync::watch::Sender::new(false),
            seen: tokio::sync::watch::Sender::new(loaded_at),
            missed: Mutex::new(None),
            live_changed: Notify::new(),
            ended: Mutex::new(std::collections::HashSet::new()),
            election_passes: tokio::sync::watch::Sender::new(None),
            agent_ttl,
            gateway_ttl,
            tunnels: Mutex::new(HashMap::new()),
            node_shared: SharedCache::default(),
            timeline: Mutex::new(timeline::Timeline::default()),
            route_revs: Mutex::new(RouteRevs::default()),
            progress: tokio::sync::watch::Sender::new(0),
            _alive: alive_tx,
        });
        supervise_with(&hub, "status-flush", flush_status);
        supervise_with(&hub, "liveness-leases", keep_leases);
        supervise_with(&hub, "liveness", expire_silent);
        weft_common::task::spawn_critical("model-follow", follow(Arc::downgrade(&hub), alive_rx));
        Ok(hub)
    }

    pub fn model(&self) -> Arc<Model> {
        self.model.read().unwrap().clone()
    }

    /// The model once it holds every write the store had made when this
    /// was called, and that revision: a list right after a change shows
    /// it, whichever replica made it. None when the store's newest write
    /// did not reach the model within [`FRESH_WAIT`] (a write outside the
    /// site's root, as on an etcd that other sites share, never does): the
    /// caller then reads the store. A record the follower could not decode
    /// shows as the model holds it (logged when it came: an agent's or the
    /// site's last readable version, no peering), which is what agents are
    /// rendered from; a store read would answer INTERNAL.
    ///
    /// After a miss, calls read the store at once for [`STORE_READS_AFTER_MISS`]:
    /// where others write to the same etcd, the model lags the store's
    /// revision until the site's own next write, and each call would wait
    /// the full second.
    pub async fn fresh(&self) -> Result<Option<(Arc<Model>, i64)>, Error> {
        if self
            .missed
            .lock()
            .unwrap()
            .is_some_and(|at| at.elapsed() < STORE_READS_AFTER_MISS)
        {
            return Ok(None);
        }
        let want = self.state.store().revision().await?;
        let mut seen = self.seen.subscribe();
        match tokio::time::timeout(FRESH_WAIT, seen.wait_for(|r| *r >= want)).await {
            Ok(Ok(_)) => Ok(Some((self.model(), want))),
            _ => {
                tracing::debug!(
                    store_revision = want,
                    model_revision = *self.seen.borrow(),
                    "the model did not catch up with the store; reading the store"
                );
                *self.missed.lock().unwrap() = Some(std::time::Instant::now());
                Ok(None)
            }
        }
    }

    /// Marks the model as holding every write up to `revision`.
    fn seen_up_to(&self, revision: i64) {
        self.seen.send_if_modified(|r| {
            let newer = revision > *r;
            *r = (*r).max(revision);
            newer
        });
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
        let Some(key) = self.state.parse(key) else { return };
        let mut model = (*self.model()).clone();
        model.revision = revision;
        let was_active = model.active_gateway.clone();
        let Some(mark) = update(&mut model, key, (kind == EventKind::Put).then_some(value)) else {
            return;
        };
        let model = Arc::new(model);
        *self.model.write().unwrap() = model.clone();
        if let Key::Alive(AgentRole::Gateway, name) = key {
            if kind == EventKind::Delete {
                self.timeline.lock().unwrap().expired(name, now_ms());
            }
            // The store has it now, either way.
            self.ended.lock().unwrap().remove(name);
            self.live_changed.notify_one();
        }
        if let (Some(from), Some(to)) = (&was_active, &model.active_gateway)
            && from != to
        {
            self.failover_began(from, to, &model);
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
        self.route_revs.lock().unwrap().note(&mark, key, revision, &model);
        // A peering's record holds what peers are told of relays (requests,
        // grants), so its change is theirs too.
        if matches!(
            mark,
            Mark::Everyone | Mark::Gateway { .. } | Mark::Names | Mark::Peering(..)
        ) {
            tracing::debug!(revision, "parameters peers see changed");
            self.params_rev.send_replace(revision);
        }
        self.mark(mark);
    }

    /// Marks the streams `mark` concerns.
    fn mark(&self, mark: Mark) {
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
        self.seen_up_to(rev);
        for s in self.slots.lock().unwrap().values() {
            s.mark(|p| p.full = true);
        }
        Ok(rev)
    }

    /// Keeps gateway `name`'s tunnel report.
    pub fn report_tunnels(&self, name: &str, tunnels: Vec<pb::TunnelStatus>) {
        let now = now_ms();
        self.timeline.lock().unwrap().tunnels(name, &tunnels, now);
        self.tunnels.lock().unwrap().insert(name.to_string(), (now, tunnels));
    }

    /// This replica ended gateway `name`'s liveness: the election sees it
    /// not live at once (see [`Hub::electing`]).
    fn ended(&self, name: &str) {
        self.ended.lock().unwrap().insert(name.to_string());
        self.live_changed.notify_one();
    }

    /// The model as the election sees it: without the gateways this
    /// replica ended whose records are still on their way out.
    pub fn electing(&self) -> Arc<Model> {
        let m = self.model();
        let ended = self.ended.lock().unwrap();
        if ended.iter().all(|g| !m.live_gateways.contains(g)) {
            return m;
        }
        let mut m = (*m).clone();
        for g in ended.iter() {
            m.live_gateways.remove(g);
        }
        Arc::new(m)
    }

    /// The model recorded `to` active after `from`: the failover's
    /// timeline starts (see `timeline`).
    fn failover_began(&self, from: &str, to: &str, model: &Model) {
        let agents: Vec<AgentKey> = self.slots.lock().unwrap().keys().cloned().collect();
        let peers: Vec<String> = model
            .peerings
            .values()
            .filter(|p| p.remote.is_some() && p.state != crate::domain::PeeringState::Deleting)
            .map(|p| p.site_id.clone())
            .collect();
        let peers_telling: Vec<String> = peers
            .iter()
            .filter(|s| {
                model.peerings[s.as_str()]
                    .remote
                    .as_ref()
                    .is_some_and(|r| r.readiness.is_some())
            })
            .cloned()
            .collect();
        let tunnels = self
            .tunnels
            .lock()
            .unwrap()
            .get(to)
            .map(|(_, t)| t.clone())
            .unwrap_or_default();
        self.timeline.lock().unwrap().elected(timeline::Election {
            from,
            to,
            revision: model.revision,
            at_ms: now_ms(),
            agents,
            peers,
            peers_telling,
            tunnels,
        });
    }

    /// Agent `key`'s stream sent the state of `revision`.
    pub fn sent(&self, key: &AgentKey, revision: i64) {
        self.timeline.lock().unwrap().sent(key, revision, now_ms());
    }

    /// Peer `site` told its readiness: its gateways use `active`.
    pub fn peer_moved(&self, site: &str, active: &str) {
        self.timeline.lock().unwrap().moved(site, active, now_ms());
    }

    /// Peer `site` was sent parameters that name `active` active.
    pub fn told(&self, site: &str, active: Option<&str>) {
        self.timeline.lock().unwrap().told(site, active, now_ms());
    }

    /// The latest failover as this replica saw it.
    pub fn last_failover(&self) -> Option<pb::FailoverTimeline> {
        self.timeline.lock().unwrap().last(&self.replica)
    }

    /// Ends the current failover's timeline when due, into the histogram.
    fn finish_failover(&self) {
        let steps = self.timeline.lock().unwrap().finish_if_due(now_ms());
        for (step, secs) in steps {
            timeline::observe(step, secs);
        }
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
}

/// Runs `job` on a weak handle to the hub, restarted if it fails; it ends
/// when the hub is dropped.
fn supervise_with<F, Fut>(hub: &Arc<Hub>, name: &'static str, job: F)
where
    F: Fn(std::sync::Weak<Hub>) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let weak = Arc::downgrade(hub);
    weft_common::task::supervise(name, weft_common::task::OnFailure::Restart, move || {
        let job = job(weak.clone());
        async move {
            job.await;
            Ok(())
        }
    });
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
                        h.seen_up_to(b.revision);
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
