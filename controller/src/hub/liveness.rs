//! Liveness: each agent's reports, its record, and the end of that record
//! when the agent falls silent, disconnects or is removed.
//!
//! An agent's record (`alive/<role>/<name>`) is on a lease this replica
//! holds for every agent of that role reporting to it, with the role's TTL,
//! renewed by one task a few times per TTL: a heartbeat touches only
//! memory, never the store. Each record still ends with its own agent: the
//! sweep deletes it once the agent was silent for its TTL, and a gateway's
//! disconnect deletes it at once. The lease ends them all only when this
//! replica stops renewing it (it died, or stalled for longer than a TTL).
//! A record is deleted only while it is on this replica's lease: an agent
//! that moved to another replica keeps the record that one wrote. The
//! sweep reads before it deletes, so the nodes that moved away cost the
//! store a read each, not a write.
//!
//! A node that comes from a replica that died keeps its record where it
//! is for a while (see [`adopt`]): a death does not rewrite the dead
//! replica's share of records at once.

mod adopt;
mod leases;
pub(super) use adopt::move_adopted;
pub(super) use leases::{flush_status, keep_leases};

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use weft_proto::v1 as pb;

use super::{AgentKey, Hub};
use crate::domain::{AgentRole, now_ms};
use crate::error::Error;
use crate::state::AliveRecord;
use crate::store::{Compare, LeaseId, Op, StoreError, Txn};

pub(super) struct Live {
    /// The lease its record was last written on.
    lease: LeaseId,
    pub(super) last: AliveRecord,
    /// When this replica last heard the agent (monotonic: a wall-clock
    /// step must not end anyone's liveness).
    heard: std::time::Instant,
    /// The replica that wrote its record, while the record is still on
    /// that replica's lease (see [`adopt`]).
    foreign: Option<String>,
    /// It opened a new stream here: its next report looks at the store
    /// (its record may have moved meanwhile). Until then the entry stands,
    /// so that its record still ends if it falls silent.
    reread: bool,
}

/// What this replica knows of the agents reporting to it: one lock for
/// what a report reads and writes, one for the records waiting for the
/// next batched write, one for the role leases (held across the store's
/// answer, so a tokio lock).
#[derive(Default)]
pub(super) struct Liveness {
    pub(super) book: std::sync::Mutex<Book>,
    /// Status records waiting for the next batched write.
    dirty: std::sync::Mutex<HashMap<AgentKey, (LeaseId, AliveRecord)>>,
    /// The lease this replica writes the liveness records of each role on:
    /// one per role, renewed by one task.
    leases: tokio::sync::Mutex<HashMap<AgentRole, LeaseId>>,
    /// Whether this replica's presence record is written (see [`adopt`]).
    presence: std::sync::atomic::AtomicBool,
    /// The nodes' lease of this replica (0: none yet), for what must be
    /// written on it without waiting for the lease lock.
    own_node: std::sync::atomic::AtomicI64,
}

/// The agents heard here, under one lock.
#[derive(Default)]
pub(super) struct Book {
    pub(super) live: HashMap<AgentKey, Live>,
    /// The earliest moment an agent in `live` can fall silent (None: look
    /// at every sweep). Reports only move that moment later, so the sweep
    /// looks at all agents only once per about two thirds of a TTL, not 40
    /// times a second.
    next_silence: Option<std::time::Instant>,
    /// After a stall: sweeps still to run on time before anyone is judged
    /// silent (see [`Hub::expire_silent_once`]).
    catch_up: u32,
    last_seen: HashMap<AgentKey, u64>,
    /// Each agent's latest host facts (they come every 30 s, heartbeats
    /// between carry none): kept across a lapse of its liveness, so a
    /// record made anew after one still has them.
    facts: HashMap<AgentKey, pb::HostReport>,
    /// Nodes that came with a record on another replica's lease, and
    /// when: is that replica alive? (see [`adopt`]).
    arriving: std::collections::VecDeque<(AgentKey, std::time::Instant)>,
    /// Nodes whose records this replica adopted from a dead one, to be
    /// written on its own lease a batch at a time.
    adopted: std::collections::VecDeque<AgentKey>,
}

/// Whether two records say the same (when they were made aside).
fn same_status(a: &AliveRecord, b: &AliveRecord) -> bool {
    a.applied_revision == b.applied_revision
        && a.errors == b.errors
        && a.features == b.features
        && a.route_conflicts == b.route_conflicts
        && a.wireguard == b.wireguard
        && a.wireguard_reason == b.wireguard_reason
        && a.version == b.version
        && a.replica == b.replica
}

/// Whether two records say the same of their agent but for the revision
/// it applied, whoever wrote them. The revision a node applied moves with
/// every write under the site's root (its own liveness record's among
/// them), so a node that moved to another replica reports a newer one
/// although nothing it holds changed.
fn same_but_progress(a: &AliveRecord, b: &AliveRecord) -> bool {
    same_status(
        a,
        &AliveRecord {
            replica: a.replica.clone(),
            applied_revision: a.applied_revision,
            ..b.clone()
        },
    )
}

impl Hub {
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
    /// its TTL.
    pub async fn gone(&self, key: &AgentKey) {
        let lease = self.liveness.book.lock().unwrap().live.remove(key).map(|l| l.lease);
        if let Some(lease) = lease {
            tracing::info!(agent = %key.1, "gateway disconnected; no longer live");
            let now = now_ms();
            self.gateways.timeline(|t| t.silent(&key.1, now, now, "disconnected"));
            self.ended(&key.1);
            self.end_liveness(key, lease).await;
        }
    }

    /// Ends `key`'s liveness record now, if it is still the one this
    /// replica wrote on `lease`.
    async fn end_liveness(&self, key: &AgentKey, lease: LeaseId) {
        self.liveness.dirty.lock().unwrap().remove(key);
        if key.0 == AgentRole::Gateway {
            self.after_the_election().await;
        }
        // Back meanwhile (it reconnected, or reported again after its
        // silence): the record its report wrote is on the same role lease
        // and must stand.
        if self.liveness.book.lock().unwrap().live.contains_key(key) {
            return;
        }
        let k = self.state.alive_key(key.0, &key.1);
        // A node that moved to another replica has its record there (a
        // replica coming back takes a third of the nodes back): a read
        // says so, where the guarded deletion would be a write each.
        // Gateways go straight to the deletion (failover waits on it).
        if key.0 == AgentRole::Node
            && let Ok(kv) = self.state.store().get(&k).await
            && kv.is_none_or(|kv| kv.lease != lease)
        {
            return;
        }
        let txn = Txn::new()
            .when(Compare::Lease(k.clone(), lease))
            .then(Op::Delete { key: k });
        if let Err(e) = self.state.store().txn(txn).await {
            tracing::warn!(
                agent = %key.1,
                error = %e,
                "cannot end its liveness record; it ends when another replica's sweep or this replica's lease does"
            );
        }
        // Back while the deletion ran: its record is written again (a
        // report after this point finds it live and writes only changes).
        let back = self
            .liveness
            .book
            .lock()
            .unwrap()
            .live
            .get(key)
            .map(|l| (key.clone(), (l.lease, l.last.clone())));
        if let Some(back) = back {
            self.write_status(vec![back]).await;
        }
    }

    /// Waits for the election loop to have run a whole pass since the
    /// ending (which woke it: see [`Hub::ended`]; the pass it may be in
    /// now started before), so that its write goes before the deletion's
    /// instead of queueing behind it; at most a TTL, and not at all where
    /// no election loop runs.
    async fn after_the_election(&self) {
        let mut passes = self.election_passes.subscribe();
        let Some(now) = *passes.borrow_and_update() else { return };
        let _ = tokio::time::timeout(self.gateway_ttl, passes.wait_for(|n| n.is_some_and(|n| n >= now + 2))).await;
    }

    /// The agents this replica heard from last more than their TTL ago:
    /// their records end now, whatever the store's lease granularity
    /// (etcd's leases are whole seconds, at least about two). `stalled`:
    /// this replica itself did not run for a while, so the silence may be
    /// its own; everyone gets a TTL from now instead.
    fn expire_silent_once(self: &Arc<Self>, stalled: bool) {
        let now = std::time::Instant::now();
        let silent: Vec<(AgentKey, LeaseId, Duration, bool)> = {
            let mut book = self.liveness.book.lock().unwrap();
            let Book {
                live,
                next_silence: next,
                catch_up,
                ..
            } = &mut *book;
            // After a stall (this process stopped or starved) the reports
            // that waited meanwhile are read first: nobody is judged until
            // the sweep has run on time a while. A stall during that
            // countdown does not restart it, so a replica that stalls
            // again and again still judges, and a silent gateway is failed
            // over, not kept active by a starved controller.
            {
                if stalled {
                    if *catch_up == 0 {
                        *catch_up = self.catch_up_sweeps();
                        tracing::info!(
                            sweeps = *catch_up,
                            "the liveness sweep ran late (this process was stopped or starved): reading the reports \
                             that waited before judging anyone"
                        );
                    }
                    *next = None;
                    return;
                }
                if *catch_up > 0 {
                    *catch_up -= 1;
                    if *catch_up > 0 {
                        return;
                    }
                }
            }
            if next.is_some_and(|at| now <= at) {
                return;
            }
            let mut keys: Vec<AgentKey> = Vec::new();
            let mut earliest: Option<std::time::Instant> = None;
            for (k, l) in live.iter() {
                let silent_at = l.heard + self.ttl(k.0);
                if now > silent_at {
                    keys.push(k.clone());
                } else {
                    earliest = Some(earliest.map_or(silent_at, |e| e.min(silent_at)));
                }
            }
            *next = earliest;
            keys.into_iter()
                .filter_map(|k| {
                    let l = live.remove(&k)?;
                    Some((k, l.lease, now.duration_since(l.heard), l.foreign.is_some()))
                })
                .collect()
        };
        for (key, lease, quiet, foreign) in silent {
            if key.0 == AgentRole::Gateway {
                let now = now_ms();
                let heard = now.saturating_sub(quiet.as_millis() as u64);
                self.gateways.timeline(|t| t.silent(&key.1, heard, now, "silent"));
                self.ended(&key.1);
            }
            tracing::warn!(
                agent = %key.1,
                role = ?key.0,
                silent_ms = quiet.as_millis() as u64,
                ttl_ms = self.ttl(key.0).as_millis() as u64,
                "no report within the TTL; no longer live"
            );
            if foreign {
                // Its record is on the lease of the replica it came from,
                // which ends once this replica stops renewing it (see
                // `adopt`): another replica may hold it by now.
                self.liveness.dirty.lock().unwrap().remove(&key);
                continue;
            }
            // Not awaited: a slow store must not hold up the sweep (nor
            // make it look like this replica stalled).
            let hub = self.clone();
            tokio::spawn(async move { hub.end_liveness(&key, lease).await });
        }
    }

    /// Sweeps to run on time after a stall before judging: an eighth of
    /// the shorter TTL of running (the reports that waited are read in
    /// the first milliseconds), and at least four.
    fn catch_up_sweeps(&self) -> u32 {
        let eighth = self.gateway_ttl.min(self.agent_ttl) / 8;
        (eighth.as_millis() / SWEEP.as_millis()).max(4) as u32
    }

    /// An agent's report: its heartbeat, applied revision and errors. The
    /// record under `alive/` is written when what it says changes, on this
    /// replica's lease for the agent's role (see the module).
    pub async fn report(
        &self,
        key: AgentKey,
        applied: i64,
        errors: Vec<String>,
        host: Option<pb::HostReport>,
    ) -> Result<(), Error> {
        let now = now_ms();
        // One look at the book: when it was heard, the gap since (a live
        // gateway heard after more than half its TTL was close to being
        // failed over), and whether this is a heartbeat of a live agent
        // (nothing new to say: only when it was heard changes, nothing is
        // built or written) or a new applied revision.
        let (gap, new_revision) = {
            let mut book = self.liveness.book.lock().unwrap();
            match book.last_seen.get_mut(&key) {
                Some(at) => *at = now,
                None => drop(book.last_seen.insert(key.clone(), now)),
            }
            let live = book.live.get_mut(&key);
            let gap = live
                .as_ref()
                .filter(|_| key.0 == AgentRole::Gateway)
                .map(|l| l.heard.elapsed());
            match live {
                Some(l)
                    if !l.reread && host.is_none() && l.last.applied_revision == applied && l.last.errors == errors =>
                {
                    l.heard = std::time::Instant::now();
                    drop(book);
                    log_late(&key, gap, self.gateway_ttl);
                    return Ok(());
                }
                l => (gap, l.is_none_or(|l| l.reread || l.last.applied_revision != applied)),
            }
        };
        log_late(&key, gap, self.gateway_ttl);
        // A new applied revision: a failover's step, and what this site
        // tells peers of its readiness may change.
        if new_revision {
            self.gateways.timeline(|t| t.applied(&key, applied, now));
            self.progress.send_modify(|n| *n += 1);
        }
        let mut record = AliveRecord {
            applied_revision: applied,
            errors,
            since_ms: now,
            features: Vec::new(),
            route_conflicts: Vec::new(),
            wireguard: String::new(),
            wireguard_reason: String::new(),
            replica: self.replica.clone(),
            version: String::new(),
        };
        // Host facts come now and then; the last ones hold meanwhile.
        let h = match host {
            Some(mut h) => {
                h.features.truncate(32);
                h.route_conflicts.truncate(100);
                self.liveness.book.lock().unwrap().facts.insert(key.clone(), h.clone());
                Some(h)
            }
            None => self.liveness.book.lock().unwrap().facts.get(&key).cloned(),
        };
        let host_known = h.is_some();
        if let Some(h) = h {
            record.features = h.features;
            record.route_conflicts = h.route_conflicts;
            record.wireguard = h.wireguard;
            record.wireguard_reason = h.wireguard_reason;
            record.version = h.version;
        }
        if let Some(l) = self
            .liveness
            .book
            .lock()
            .unwrap()
            .live
            .get_mut(&key)
            .filter(|l| !l.reread)
        {
            l.heard = std::time::Instant::now();
            // A record still on another replica's lease (see `adopt`) is
            // written again when it moves here, with what this replica
            // knows then; meanwhile only a change in what it says of the
            // agent (errors, host facts) is written at once, where it is
            // (this replica renews that lease). Its progress is known
            // here, in memory (diagnose and readiness read it from here).
            if l.foreign.is_some() && same_but_progress(&l.last, &record) {
                l.last.applied_revision = record.applied_revision;
                return Ok(());
            }
            if !same_status(&l.last, &record) {
                // Written with the others in the next batch: after a
                // change for all agents that is one transaction per 128
                // agents, not one write per agent.
                self.liveness
                    .dirty
                    .lock()
                    .unwrap()
                    .insert(key.clone(), (l.lease, record.clone()));
                l.last = record;
            }
            return Ok(());
        }
        // New here (or back on a new stream), with a record another
        // replica wrote that says what this report says: kept where it
        // is for now (see `adopt`).
        if key.0 == AgentRole::Node
            && let Some((lease, kept)) = self.found(&key, &record, host_known).await
        {
            self.arrived(key, lease, kept);
            return Ok(());
        }
        // New here: live first (so that a lease replaced meanwhile
        // rewrites this record too), then written: a gateway's at once (it
        // makes the gateway electable), a node's with the next batch (a
        // controller that thousands of nodes reconnect to writes their
        // records 128 to a transaction).
        let lease = self.role_lease(key.0).await?;
        let value = (key.0 == AgentRole::Gateway).then(|| serde_json::to_vec(&record).unwrap());
        {
            let mut book = self.liveness.book.lock().unwrap();
            let heard = std::time::Instant::now();
            if key.0 == AgentRole::Node {
                self.liveness
                    .dirty
                    .lock()
                    .unwrap()
                    .insert(key.clone(), (lease, record.clone()));
            }
            book.live.insert(
                key.clone(),
                Live {
                    lease,
                    last: record,
                    heard,
                    foreign: None,
                    reread: false,
                },
            );
            let silent_at = heard + self.ttl(key.0);
            if book.next_silence.is_some_and(|at| silent_at < at) {
                book.next_silence = Some(silent_at);
            }
        }
        let Some(value) = value else { return Ok(()) };
        let put = Op::Put {
            key: self.state.alive_key(key.0, &key.1),
            value,
            lease: Some(lease),
        };
        match self.state.store().txn(Txn::new().then(put)).await {
            Ok(_) => Ok(()),
            Err(StoreError::LeaseNotFound(_)) => self.replace_lease(key.0, lease).await,
            Err(e) => {
                self.liveness.book.lock().unwrap().live.remove(&key);
                Err(e.into())
            }
        }
    }

    /// Drops what this replica keeps about a removed agent; its liveness
    /// record (on a lease) ends now instead of at the lease's end.
    pub(super) fn forget(&self, key: AgentKey) {
        let lease = {
            let mut book = self.liveness.book.lock().unwrap();
            book.last_seen.remove(&key);
            book.facts.remove(&key);
            book.live.remove(&key).map(|l| l.lease)
        };
        self.liveness.dirty.lock().unwrap().remove(&key);
        if key.0 == AgentRole::Gateway {
            self.gateways.forget(&key.1);
        }
        if let (Some(lease), Ok(rt)) = (lease, tokio::runtime::Handle::try_current()) {
            let store = self.state.store().clone();
            let k = self.state.alive_key(key.0, &key.1);
            rt.spawn(async move {
                let txn = Txn::new()
                    .when(Compare::Lease(k.clone(), lease))
                    .then(Op::Delete { key: k });
                let _ = store.txn(txn).await;
            });
        }
    }

    /// The revision `key` applied, as it last reported to this replica
    /// (None: it does not report here). Newer than its record's while the
    /// record waits to move here (see `adopt`).
    pub fn applied_here(&self, key: &AgentKey) -> Option<i64> {
        let book = self.liveness.book.lock().unwrap();
        book.live.get(key).map(|l| l.last.applied_revision)
    }

    /// The revision `key` applied as this replica knows it: its record's
    /// (`recorded`), or what it reported here since, if newer.
    pub fn applied(&self, key: &AgentKey, recorded: i64) -> i64 {
        self.applied_here(key).unwrap_or(0).max(recorded)
    }

    /// The store deleted `name`'s record (seen by the follower). A node
    /// live here whose record went (its former replica ended it after
    /// this one kept it in place, or a deletion crossed its return) has
    /// it written again, on this replica's lease, with the next flush.
    pub(super) fn node_record_deleted(&self, name: &str) {
        let own = self.liveness.own_node.load(std::sync::atomic::Ordering::Relaxed);
        let key = (AgentRole::Node, name.to_string());
        let mut book = self.liveness.book.lock().unwrap();
        let Some(l) = book.live.get_mut(&key).filter(|_| own != 0) else {
            return;
        };
        l.lease = own;
        l.foreign = None;
        l.last.replica = self.replica.clone();
        let rec = l.last.clone();
        drop(book);
        self.liveness.dirty.lock().unwrap().insert(key, (own, rec));
    }

    /// This replica's id (see [`AliveRecord::replica`]).
    pub fn replica(&self) -> &str {
        &self.replica
    }

    /// When this replica last heard from `key`.
    pub fn last_seen(&self, key: &AgentKey) -> Option<u64> {
        self.liveness.book.lock().unwrap().last_seen.get(key).copied()
    }
}

/// Says when a live gateway's report came after more than half its TTL
/// (`gap` since the one before): it was close to being failed over (its
/// agent was busy, or its reports waited somewhere on the way).
fn log_late(key: &AgentKey, gap: Option<Duration>, ttl: Duration) {
    if let Some(gap) = gap.filter(|g| *g > ttl / 2) {
        tracing::info!(
            agent = %key.1,
            gap_ms = gap.as_millis() as u64,
            ttl_ms = ttl.as_millis() as u64,
            "a gateway's report came late"
        );
    }
}

/// How often each replica looks for agents that fell silent: the TTL
/// holds to within this.
const SWEEP: Duration = Duration::from_millis(25);

/// Ends the liveness of agents not heard within their TTL (see
/// [`Hub::expire_silent_once`]).
pub(super) async fn expire_silent(hub: std::sync::Weak<Hub>) {
    let mut tick = tokio::time::interval(SWEEP);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let due = tick.tick().await;
        let Some(h) = hub.upgrade() else { return };
        // A tick that came far too late: this process was stopped or
        // starved, and the agents' reports may be waiting unread.
        let stalled = due.elapsed() > h.gateway_ttl.min(h.agent_ttl) / 4;
        h.expire_silent_once(stalled);
        h.finish_failover();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::State;

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

    /// A gateway whose stream ended and that reconnects while the ending
    /// of its record waits for the election keeps the record its new
    /// report wrote (same role lease): it was deleted, and the gateway,
    /// live in memory, stayed unlisted and unelectable, its heartbeats
    /// writing nothing. Once back, whenever it comes back, it is listed
    /// with its facts.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_gateway_back_while_its_ending_waits_keeps_its_record() {
        let ttl = Duration::from_millis(400);
        let (h, _dir) = hub(ttl).await;
        // An election loop that does not get to run a pass: the ending
        // waits its whole TTL.
        h.election_passes.send_replace(Some(0));
        let key = (AgentRole::Gateway, "gw".to_string());
        let facts = pb::HostReport {
            wireguard: "kernel".into(),
            ..Default::default()
        };
        for back_after in [Duration::ZERO, ttl / 2, ttl + Duration::from_millis(50)] {
            h.report(key.clone(), 1, vec![], Some(facts.clone())).await.unwrap();
            assert!(live(&h, "gw").await);
            let ending = {
                let (h, key) = (h.clone(), key.clone());
                tokio::spawn(async move { h.gone(&key).await })
            };
            tokio::time::sleep(back_after).await;
            h.report(key.clone(), 1, vec![], None).await.unwrap();
            ending.await.unwrap();
            // The heartbeats that follow write nothing: the record must
            // be there already.
            h.report(key.clone(), 1, vec![], None).await.unwrap();
            let rec = h.state.alive().await.unwrap().get(&key).cloned();
            assert_eq!(
                rec.map(|r| r.wireguard),
                Some("kernel".to_string()),
                "back {back_after:?} after its stream ended: not listed"
            );
        }
    }

    /// A replica that did not run for a while (stopped, starved) has not
    /// read the reports meanwhile: it judges nobody until its sweep ran on
    /// time a while (the reports that waited are read then), and then ends
    /// those still silent, however often it stalls again meanwhile.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_replica_reads_what_waited_then_ends_the_silent() {
        let (h, _dir) = hub(Duration::from_millis(300)).await;
        let (gw, dead) = (
            (AgentRole::Gateway, "gw".to_string()),
            (AgentRole::Gateway, "dead".to_string()),
        );
        h.report(gw.clone(), 1, vec![], None).await.unwrap();
        h.report(dead.clone(), 1, vec![], None).await.unwrap();
        assert_eq!(h.catch_up_sweeps(), 4, "an eighth of 300 ms is one sweep: at least 4");
        // Both last heard 5 s ago: this replica was stopped meanwhile.
        for l in h.liveness.book.lock().unwrap().live.values_mut() {
            l.heard -= Duration::from_secs(5);
        }
        h.expire_silent_once(true);
        assert!(live(&h, "dead").await, "judged before catching up");
        // It stalls again and again (here every 10 ms; its own sweep runs
        // on time every 25 ms between), and gw's reports that waited are
        // read: gw stays, the silent one ends once the countdown ran out.
        let start = std::time::Instant::now();
        while start.elapsed() < Duration::from_millis(600) {
            h.expire_silent_once(true);
            h.report(gw.clone(), 1, vec![], None).await.unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(live(&h, "gw").await, "ended although its reports were read");
        assert!(
            !live(&h, "dead").await,
            "a silent gateway outlived the catch-up of a replica that kept stalling"
        );
    }

    /// A heartbeat that says nothing new writes nothing; a lease that ended
    /// under a live replica (as after a stall longer than the TTL) is
    /// replaced and the records on it written again, without any report.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn heartbeats_write_nothing_and_a_lost_lease_is_replaced() {
        let (h, _dir) = hub(Duration::from_millis(400)).await;
        let key = (AgentRole::Gateway, "gw".to_string());
        h.report(key.clone(), 1, vec![], None).await.unwrap();
        assert!(live(&h, "gw").await);
        let before = h.state.store().revision().await.unwrap();
        for _ in 0..10 {
            h.report(key.clone(), 1, vec![], None).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            h.state.store().revision().await.unwrap(),
            before,
            "heartbeats wrote to the store"
        );
        let lease = h.liveness.leases.lock().await[&AgentRole::Gateway];
        h.state.store().lease_revoke(lease).await.unwrap();
        assert!(!live(&h, "gw").await, "revoking the lease ends its records");
        let lost = std::time::Instant::now();
        while !live(&h, "gw").await {
            assert!(lost.elapsed() < Duration::from_secs(2), "the record never came back");
            h.report(key.clone(), 1, vec![], None).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_ne!(
            h.liveness.leases.lock().await[&AgentRole::Gateway],
            lease,
            "a new lease"
        );
    }
}
