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
//! `streams` (the connected streams' slots), this module (the model, the
//! store follower, and the wiring of the parts), `liveness`
//! (reports, leases, silent agents), `election` (the active gateway) and
//! `shared` (the part of node state every node shares, rendered and
//! encoded once per model for the streams that ask).

use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::sync::Notify;

use weft_proto::v1 as pb;

use crate::domain::{AgentRole, now_ms};
use crate::error::Error;
use crate::render::Model;
use crate::state::{Key, State};
use crate::store::EventKind;

mod election;
mod follow;
mod gateways;
mod index;
mod liveness;
mod readiness;
mod shared;
mod streams;
mod timeline;

pub use election::choose_active_gateway;
use gateways::Gateways;
use index::{Mark, update};
use liveness::{Liveness, expire_silent, flush_status, keep_leases};
use readiness::RouteRevs;
pub use shared::{Shared, SharedCache, Step};
use streams::Streams;
pub use streams::{Pending, Slot};
pub use timeline::failover_steps;

pub type AgentKey = (AgentRole, String);

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
    /// The connected streams and their pending work.
    streams: Streams,
    /// The gateways' tunnel reports, those this replica ended, and the
    /// latest failover's timeline.
    gateways: Gateways,
    /// The agents reporting here: their liveness, records and leases.
    liveness: Liveness,
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
    /// Passes of the election loop (see `election`), counted when it runs:
    /// the deletion of an ended gateway's record waits for the pass after
    /// the ending, so the election's write goes first (one store write
    /// fewer before a failover: on a starved host, half a second).
    election_passes: tokio::sync::watch::Sender<Option<u64>>,
    /// Woken when a write found a role's lease gone.
    lease_lost: Notify,
    pub agent_ttl: Duration,
    pub gateway_ttl: Duration,
    /// The part of node state every node shares, encoded once per model.
    pub node_shared: SharedCache,
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
            streams: Streams::default(),
            liveness: Liveness::default(),
            gateways: Gateways::default(),
            lease_lost: Notify::new(),
            params_rev: tokio::sync::watch::Sender::new(0),
            closing: tokio::sync::watch::Sender::new(false),
            seen: tokio::sync::watch::Sender::new(loaded_at),
            missed: Mutex::new(None),
            live_changed: Notify::new(),
            election_passes: tokio::sync::watch::Sender::new(None),
            agent_ttl,
            gateway_ttl,
            node_shared: SharedCache::default(),
            route_revs: Mutex::new(RouteRevs::default()),
            progress: tokio::sync::watch::Sender::new(0),
            _alive: alive_tx,
        });
        // Other replicas judge the nodes that come from this one by it
        // (retried by the lease keeper when the store does not answer).
        if let Err(e) = hub.announce().await {
            tracing::warn!(error = %e, "cannot write this replica's presence record yet");
        }
        supervise_with(&hub, "status-flush", flush_status);
        supervise_with(&hub, "liveness-leases", keep_leases);
        supervise_with(&hub, "liveness", expire_silent);
        supervise_with(&hub, "liveness-adopt", liveness::move_adopted);
        weft_common::task::spawn_critical("model-follow", follow::follow(Arc::downgrade(&hub), alive_rx));
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
        self.node_connected(&key);
        self.streams.subscribe(key)
    }

    pub fn unsubscribe(&self, key: &AgentKey, slot: &Arc<Slot>) {
        self.streams.unsubscribe(key, slot)
    }

    /// The revision of the last state sent to `key`, if it is connected here.
    pub fn latest(&self, key: &AgentKey) -> Option<i64> {
        self.streams.latest(key)
    }

    /// Ends every stream (at shutdown), so agents reconnect elsewhere at once
    /// instead of holding the server's drain open.
    pub fn close_all(&self) {
        self.closing.send_replace(true);
        self.streams.end_all();
    }

    pub fn connected(&self) -> usize {
        self.streams.len()
    }

    /// Per connected stream: its agent and how many updates wait for it.
    pub fn stream_backlog(&self) -> Vec<(AgentKey, usize)> {
        self.streams.backlog()
    }

    /// Applies one store event: updates the model first, then marks the
    /// streams it concerns, so a woken stream always renders the new model.
    fn apply(&self, key: &str, kind: EventKind, value: &[u8], revision: i64) {
        let Some(key) = self.state.parse(key) else { return };
        if let (Key::Alive(AgentRole::Node, name), EventKind::Delete) = (key, kind) {
            self.node_record_deleted(name);
        }
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
                self.gateways.timeline(|t| t.expired(name, now_ms()));
            }
            // The store has it now, either way.
            self.gateways.recorded(name);
            self.live_changed.notify_one();
        }
        if let (Some(from), Some(to)) = (&was_active, &model.active_gateway)
            && from != to
        {
            self.gateways
                .failover_began(from, to, &model, self.streams.keys(), now_ms());
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
        self.streams.mark(mark);
    }

    /// Reloads everything (after a broken watch) and re-renders every stream.
    async fn reload(&self) -> Result<i64, Error> {
        let model = self.state.model().await?;
        let rev = model.revision;
        *self.model.write().unwrap() = Arc::new(model);
        self.seen_up_to(rev);
        self.streams.mark(Mark::Everyone);
        Ok(rev)
    }

    /// Every gateway's latest tunnel report, with when it came.
    pub fn tunnel_reports(&self) -> Vec<(String, u64, Vec<pb::TunnelStatus>)> {
        self.gateways.reports()
    }

    /// Keeps gateway `name`'s tunnel report.
    pub fn report_tunnels(&self, name: &str, tunnels: Vec<pb::TunnelStatus>) {
        self.gateways.report(name, tunnels, now_ms());
    }

    /// This replica ended gateway `name`'s liveness: the election sees it
    /// not live at once (see [`Hub::electing`]).
    fn ended(&self, name: &str) {
        self.gateways.ended(name);
        self.live_changed.notify_one();
    }

    /// The model as the election sees it: without the gateways this
    /// replica ended whose records are still on their way out.
    pub fn electing(&self) -> Arc<Model> {
        self.gateways.electing(self.model())
    }

    /// Agent `key`'s stream sent the state of `revision`.
    pub fn sent(&self, key: &AgentKey, revision: i64) {
        self.gateways.timeline(|t| t.sent(key, revision, now_ms()));
    }

    /// Peer `site` told its readiness: its gateways use `active`.
    pub fn peer_moved(&self, site: &str, active: &str) {
        self.gateways.timeline(|t| t.moved(site, active, now_ms()));
    }

    /// Peer `site` was sent parameters that name `active` active.
    pub fn told(&self, site: &str, active: Option<&str>) {
        self.gateways.timeline(|t| t.told(site, active, now_ms()));
    }

    /// The latest failover as this replica saw it.
    pub fn last_failover(&self) -> Option<pb::FailoverTimeline> {
        self.gateways.timeline(|t| t.last(&self.replica))
    }

    /// Ends the current failover's timeline when due, into the histogram.
    fn finish_failover(&self) {
        let steps = self.gateways.timeline(|t| t.finish_if_due(now_ms()));
        for (step, secs) in steps {
            timeline::observe(step, secs);
        }
    }

    /// The tunnel to peer `site` as the gateways reported it within the
    /// agent TTL: an up one if any gateway has it up, else the newest.
    pub fn tunnel(&self, site: &str) -> Option<pb::TunnelStatus> {
        let fresh_after = now_ms().saturating_sub(self.agent_ttl.as_millis() as u64);
        self.gateways.tunnel(site, fresh_after)
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
