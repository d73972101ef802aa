//! Adoption: the nodes of a replica that died are taken over by the
//! replicas they move to, without their liveness records being written
//! again all at once.
//!
//! A node's record is on the lease of the replica it reports to. When a
//! replica dies, its nodes are on the others within seconds, while their
//! records last until its lease ends, a node TTL later. Writing them all
//! again on the survivors' leases as the nodes come would cost the store a
//! burst the size of the dead replica's share. Instead, a replica that a
//! node comes to with a record that says what the node says:
//! - keeps the record where it is, on the other replica's lease, and
//!   renews that lease meanwhile;
//! - after [`Hub::adopt_defer`] (longer than a dead replica's presence
//!   record lasts; see below) asks whether the replica that wrote it is
//!   alive:
//!   - alive: the node left a running replica, whose sweep ends the record
//!     once the node is silent there, so it is written on this replica's
//!     lease now;
//!   - dead: adopted, and written on this replica's lease [`MOVE_BATCH`]
//!     at a time, once per [`MOVE_EVERY`]: a death costs the store a
//!     trickle, not a burst.
//!
//! Once none of its arrivals or adoptions is left on a lease, it stops
//! renewing that lease, which then ends with the records of the nodes that
//! never came back. An adopted node that falls silent here before its
//! record moved keeps that record until then: another replica may have
//! adopted it meanwhile, and only the lease's end says it is nobody's.
//!
//! A replica's presence is `replicas/<id>`, on its gateways' lease: that
//! one is renewed several times per gateway TTL (a second or two on etcd),
//! so it ends within seconds of a death. Gateways are never adopted: their
//! records decide failover and are written at once.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use super::{AgentKey, Book, Hub, Live, same_but_progress};
use crate::domain::{AgentRole, now_ms};
use crate::error::Error;
use crate::state::AliveRecord;
use crate::store::{LeaseId, Op, StoreError, Txn};

/// How many adopted records are written per [`MOVE_EVERY`]: one store
/// transaction (etcd allows 128 operations in one).
pub(super) const MOVE_BATCH: usize = 128;
pub(super) const MOVE_EVERY: Duration = Duration::from_secs(1);

impl Hub {
    /// How long a node's arrival waits before its record's writer is
    /// judged alive or dead: longer than a dead replica's presence record
    /// lasts (its gateways' lease in whole seconds, at least etcd's floor
    /// of 2, and etcd's half second to notice the lease ended), plus a
    /// margin.
    pub(super) fn adopt_defer(&self) -> Duration {
        let lease = crate::store::ttl_secs(self.gateway_ttl).max(2) as u64;
        Duration::from_secs(lease + 2)
    }

    /// Writes this replica's presence record on its gateways' lease.
    pub(in crate::hub) async fn announce(&self) -> Result<(), Error> {
        let lease = self.role_lease(AgentRole::Gateway).await?;
        let value = serde_json::json!({"since_ms": now_ms(), "version": env!("CARGO_PKG_VERSION")});
        let put = Op::Put {
            key: self.state.replica_key(&self.replica),
            value: value.to_string().into_bytes(),
            lease: Some(lease),
        };
        match self.state.store().txn(Txn::new().then(put)).await {
            Ok(_) => {
                self.liveness.presence.store(true, std::sync::atomic::Ordering::Relaxed);
                Ok(())
            }
            Err(StoreError::LeaseNotFound(_)) => {
                self.lease_lost.notify_one();
                Err(StoreError::LeaseNotFound(lease).into())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The lease of `key`'s record, and what to keep in memory, when
    /// another replica wrote it on its own lease and it says what this
    /// report says (`record`; its host facts only when the report or this
    /// replica has them, `host_known`): it can stay where it is for now.
    /// It may be behind on the revision the node applied (see
    /// `same_but_progress`). None on any doubt (no record, one on no lease
    /// or on this replica's, one that says something else, a store that
    /// does not answer, a node TTL too short to judge its writer within
    /// half of it): the record is written here as for any new agent.
    pub(super) async fn found(
        &self,
        key: &AgentKey,
        record: &AliveRecord,
        host_known: bool,
    ) -> Option<(LeaseId, AliveRecord)> {
        if self.ttl(key.0) < 2 * self.adopt_defer() {
            return None;
        }
        let kv = self
            .state
            .store()
            .get(&self.state.alive_key(key.0, &key.1))
            .await
            .ok()??;
        let stored: AliveRecord = serde_json::from_slice(&kv.value).ok()?;
        // Nodes only (see `report`): this replica's nodes' lease, 0 when none.
        let own = self.liveness.own_node.load(std::sync::atomic::Ordering::Relaxed);
        let writer = stored.replica.clone();
        if kv.lease == 0 || kv.lease == own || writer.is_empty() || writer == self.replica {
            return None;
        }
        // A report without host facts (they come every 30 s) says nothing
        // of them: the stored ones stand.
        let mut kept = record.clone();
        if !host_known {
            kept.features = stored.features.clone();
            kept.route_conflicts = stored.route_conflicts.clone();
            kept.wireguard = stored.wireguard.clone();
            kept.wireguard_reason = stored.wireguard_reason.clone();
            kept.version = stored.version.clone();
        }
        if !same_but_progress(&stored, &kept) {
            return None;
        }
        kept.since_ms = stored.since_ms;
        kept.replica = writer;
        Some((kv.lease, kept))
    }

    /// `key` is live here with its record on the lease of the replica
    /// that wrote it (`kept.replica`).
    pub(super) fn arrived(&self, key: AgentKey, lease: LeaseId, kept: AliveRecord) {
        let mut book = self.liveness.book.lock().unwrap();
        let heard = Instant::now();
        book.arriving.push_back((key.clone(), heard));
        let foreign = Some(kept.replica.clone());
        book.live.insert(
            key.clone(),
            Live {
                lease,
                last: kept,
                heard,
                foreign,
                reread: false,
            },
        );
        let silent_at = heard + self.ttl(key.0);
        if book.next_silence.is_some_and(|at| silent_at < at) {
            book.next_silence = Some(silent_at);
        }
    }

    /// A node opened a stream here: what this replica remembers of its
    /// record may be stale (it reported to another replica meanwhile,
    /// whose lease its record is on now, and that replica may be gone), so
    /// its next report looks at the store (see [`Hub::found`]). The entry
    /// stays until then: a node that falls silent first is still ended.
    pub fn node_connected(&self, key: &AgentKey) {
        if key.0 == AgentRole::Node
            && let Some(l) = self.liveness.book.lock().unwrap().live.get_mut(key)
        {
            l.reread = true;
        }
    }

    /// One pass of [`move_adopted`]: renews the leases the arrivals and
    /// adoptions are on, judges the arrivals due, and writes what is to
    /// move now.
    async fn move_once(&self, renewed: &mut HashMap<LeaseId, (Instant, Duration)>) -> Result<(), Error> {
        let cutoff = Instant::now().checked_sub(self.adopt_defer());
        let (leases, writers, queued) = {
            let book = self.liveness.book.lock().unwrap();
            if book.arriving.is_empty() && book.adopted.is_empty() {
                renewed.clear();
                return Ok(());
            }
            let lease = |k: &AgentKey| book.live.get(k).filter(|l| l.foreign.is_some()).map(|l| l.lease);
            let leases: HashSet<LeaseId> = (book.arriving.iter().map(|(k, _)| k))
                .chain(book.adopted.iter())
                .filter_map(lease)
                .collect();
            let writers: HashSet<String> = book
                .arriving
                .iter()
                .take_while(|(_, at)| cutoff.is_some_and(|c| *at <= c))
                .filter_map(|(k, _)| book.live.get(k)?.foreign.clone())
                .collect();
            let queued: Vec<AgentKey> = (book.arriving.iter().map(|(k, _)| k))
                .chain(book.adopted.iter())
                .cloned()
                .collect();
            (leases, writers, queued)
        };
        // The records must outlive their move: their leases are renewed a
        // few times per their TTL. One that ended took its records along.
        renewed.retain(|l, _| leases.contains(l));
        let mut lost = HashSet::new();
        for lease in leases {
            if renewed.get(&lease).is_some_and(|(at, ttl)| at.elapsed() < *ttl / 4) {
                continue;
            }
            match self.state.store().lease_keep_alive(lease).await {
                Ok(ttl) => drop(renewed.insert(lease, (Instant::now(), ttl))),
                Err(StoreError::LeaseNotFound(_)) => drop(lost.insert(lease)),
                Err(e) => {
                    tracing::warn!(lease, error = %e, "cannot renew another replica's lease for the nodes that came from it; retrying")
                }
            }
        }
        let mut alive = HashSet::new();
        for w in writers {
            if self.state.store().get(&self.state.replica_key(&w)).await?.is_some() {
                alive.insert(w);
            }
        }
        let own = self.role_lease(AgentRole::Node).await?;
        // A node that left meanwhile is not moved here: the replica it
        // went to decides (this one's sweep leaves a record on another
        // lease alone).
        let left: HashSet<AgentKey> = queued.into_iter().filter(|k| self.latest(k).is_none()).collect();
        let moves = {
            let mut book = self.liveness.book.lock().unwrap();
            pick(&mut book, cutoff, &alive, &lost, &left, own, &self.replica)
        };
        if moves.adopted > 0 {
            tracing::info!(
                nodes = moves.adopted,
                waiting = moves.waiting,
                per_second = MOVE_BATCH,
                "adopted the liveness records of nodes whose replica is gone; moving them to this replica's lease"
            );
        }
        self.write_status(moves.write).await;
        Ok(())
    }
}

/// What one pass of [`move_adopted`] does.
#[derive(Debug, Default)]
pub(super) struct Moves {
    /// Records to write on this replica's lease now.
    pub write: Vec<(AgentKey, (LeaseId, AliveRecord))>,
    /// Arrivals judged to come from a dead replica in this pass.
    pub adopted: usize,
    /// Adopted records still to move after this pass.
    pub waiting: usize,
}

/// Judges the arrivals that came before `cutoff` (None: none yet) by
/// whether their record's writer is among `alive`, and picks what moves
/// to this replica's lease `own` now: records whose lease ended (`lost`),
/// those of live writers, and up to [`MOVE_BATCH`] adopted ones; never
/// those of nodes that `left` this replica. What moves is live here on
/// `own` from now on, with this `replica` as its writer.
pub(super) fn pick(
    book: &mut Book,
    cutoff: Option<Instant>,
    alive: &HashSet<String>,
    lost: &HashSet<LeaseId>,
    left: &HashSet<AgentKey>,
    own: LeaseId,
    replica: &str,
) -> Moves {
    let Book {
        live,
        arriving,
        adopted,
        ..
    } = book;
    let mut moves = Moves::default();
    let take = |live: &mut HashMap<AgentKey, Live>, k: &AgentKey, moves: &mut Moves| {
        let Some(l) = live.get_mut(k).filter(|l| l.foreign.is_some() && !left.contains(k)) else {
            return false;
        };
        l.foreign = None;
        l.lease = own;
        l.last.replica = replica.to_string();
        moves.write.push((k.clone(), (own, l.last.clone())));
        true
    };
    if !lost.is_empty() {
        let gone: Vec<AgentKey> = (arriving.iter().map(|(k, _)| k))
            .chain(adopted.iter())
            .filter(|k| {
                live.get(*k)
                    .is_some_and(|l| l.foreign.is_some() && lost.contains(&l.lease))
            })
            .cloned()
            .collect();
        for k in gone {
            take(live, &k, &mut moves);
        }
    }
    // The queues drop agents no longer live here (silent, removed) and
    // records that moved already (a lease replaced, a lease that ended).
    while let Some((_, at)) = arriving.front() {
        if cutoff.is_none_or(|c| *at > c) {
            break;
        }
        let (k, _) = arriving.pop_front().unwrap();
        let Some(writer) = live.get(&k).and_then(|l| l.foreign.clone()) else {
            continue;
        };
        if alive.contains(&writer) {
            take(live, &k, &mut moves);
        } else {
            adopted.push_back(k);
            moves.adopted += 1;
        }
    }
    let mut moved = 0;
    while moved < MOVE_BATCH {
        let Some(k) = adopted.pop_front() else { break };
        if take(live, &k, &mut moves) {
            moved += 1;
        }
    }
    moves.waiting = adopted.len();
    moves
}

/// Moves arrivals and adoptions to this replica's lease (see the module).
pub(in crate::hub) async fn move_adopted(hub: std::sync::Weak<Hub>) {
    let mut tick = tokio::time::interval(MOVE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut renewed: HashMap<LeaseId, (Instant, Duration)> = HashMap::new();
    loop {
        tick.tick().await;
        let Some(h) = hub.upgrade() else { return };
        if let Err(e) = h.move_once(&mut renewed).await {
            tracing::warn!(error = %e, "cannot move the records of nodes that came from another replica; retrying");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::state::State;

    fn rec(replica: &str, applied: i64) -> AliveRecord {
        AliveRecord {
            applied_revision: applied,
            errors: vec![],
            since_ms: 1,
            features: vec![],
            route_conflicts: vec![],
            wireguard: String::new(),
            wireguard_reason: String::new(),
            replica: replica.into(),
            version: String::new(),
        }
    }

    fn node(i: usize) -> AgentKey {
        (AgentRole::Node, format!("n{i}"))
    }

    /// A book with `n` arrivals from `writer` on lease 7, all `ago` old.
    fn arrivals(n: usize, writer: &str, ago: Duration) -> Book {
        let mut book = Book::default();
        let at = Instant::now() - ago;
        for i in 0..n {
            book.live.insert(
                node(i),
                Live {
                    lease: 7,
                    last: rec(writer, 3),
                    heard: at,
                    foreign: Some(writer.into()),
                    reread: false,
                },
            );
            book.arriving.push_back((node(i), at));
        }
        book
    }

    /// Arrivals from a live replica move at once, all of them; those of a
    /// dead one are adopted and move a batch per pass, in the order they
    /// came, each written with this replica as its writer on its lease.
    #[test]
    fn a_dead_replicas_nodes_move_a_batch_at_a_time_a_live_ones_at_once() {
        let cutoff = Some(Instant::now());
        let mut book = arrivals(300, "dead", Duration::from_secs(10));
        let (none, no_lease, no_left): (HashSet<String>, HashSet<LeaseId>, HashSet<AgentKey>) =
            (HashSet::new(), HashSet::new(), HashSet::new());
        let first = pick(&mut book, cutoff, &none, &no_lease, &no_left, 9, "me");
        assert_eq!(
            (first.adopted, first.write.len(), first.waiting),
            (300, MOVE_BATCH, 300 - MOVE_BATCH)
        );
        assert_eq!(first.write[0].0, node(0), "the first to come moves first");
        assert!(
            first
                .write
                .iter()
                .all(|(_, (l, r))| *l == 9 && r.replica == "me" && r.applied_revision == 3)
        );
        assert!(book.live[&node(0)].foreign.is_none() && book.live[&node(0)].lease == 9);
        assert_eq!(book.live[&node(299)].lease, 7, "not moved yet: still on its lease");
        let second = pick(&mut book, cutoff, &none, &no_lease, &no_left, 9, "me");
        let third = pick(&mut book, cutoff, &none, &no_lease, &no_left, 9, "me");
        assert_eq!(
            (second.write.len(), third.write.len(), third.waiting),
            (MOVE_BATCH, 300 - 2 * MOVE_BATCH, 0)
        );

        let mut book = arrivals(3, "dead", Duration::from_secs(10));
        let left = HashSet::from([node(0)]);
        let moves = pick(&mut book, cutoff, &none, &no_lease, &left, 9, "me");
        assert_eq!(moves.write.len(), 2, "a node that left is not moved here");
        assert!(book.live[&node(0)].foreign.is_some() && book.adopted.is_empty());

        let mut book = arrivals(300, "alive", Duration::from_secs(10));
        let alive = HashSet::from(["alive".to_string()]);
        let moves = pick(&mut book, cutoff, &alive, &no_lease, &no_left, 9, "me");
        assert_eq!(
            (moves.adopted, moves.write.len()),
            (0, 300),
            "a live writer's sweep would end them"
        );
    }

    /// Arrivals are judged only after the defer; a record whose lease
    /// ended moves at once, judged or not; an agent gone meanwhile (swept,
    /// removed) is dropped from the queues.
    #[test]
    fn arrivals_wait_for_their_judgement_unless_their_lease_ended() {
        let (none, no_lease, no_left): (HashSet<String>, HashSet<LeaseId>, HashSet<AgentKey>) =
            (HashSet::new(), HashSet::new(), HashSet::new());
        let mut book = arrivals(3, "dead", Duration::ZERO);
        let early = pick(
            &mut book,
            Instant::now().checked_sub(Duration::from_secs(4)),
            &none,
            &no_lease,
            &no_left,
            9,
            "me",
        );
        assert_eq!((early.adopted, early.write.len(), book.arriving.len()), (0, 0, 3));
        book.live.remove(&node(0));
        book.live.get_mut(&node(1)).unwrap().lease = 8;
        let lost = HashSet::from([7]);
        let moves = pick(
            &mut book,
            Instant::now().checked_sub(Duration::from_secs(4)),
            &none,
            &lost,
            &no_left,
            9,
            "me",
        );
        let moved: Vec<&AgentKey> = moves.write.iter().map(|(k, _)| k).collect();
        assert_eq!(moved, [&node(2)], "only the record on the lease that ended");
        let later = pick(&mut book, Some(Instant::now()), &none, &no_lease, &no_left, 9, "me");
        assert_eq!(
            (later.adopted, later.write.len()),
            (1, 1),
            "n1 on lease 8 is judged; n0 is gone"
        );
    }

    async fn replica(store: Arc<dyn crate::store::Store>) -> Arc<Hub> {
        replica_ttl(store, Duration::from_secs(30)).await
    }

    async fn replica_ttl(store: Arc<dyn crate::store::Store>, agent_ttl: Duration) -> Arc<Hub> {
        let state = State::new(store, "s");
        Hub::start(state, agent_ttl, Duration::from_millis(300)).await.unwrap()
    }

    /// The nodes' records on a replica's lease, and on others'.
    async fn records_on(h: &Hub, lease: LeaseId) -> (usize, usize) {
        let r = h
            .state
            .store()
            .get_prefix(&h.state.alive_key(AgentRole::Node, ""))
            .await
            .unwrap();
        let mine = r.kvs.iter().filter(|kv| kv.lease == lease).count();
        (mine, r.kvs.len() - mine)
    }

    /// A dead replica's 1,500 nodes all come to the survivor: their
    /// records move a batch a second, so the last ones move well after
    /// the dead replica's lease (a 9 s node TTL) would have ended; the
    /// survivor renews it meanwhile, and not one record goes missing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn adopted_records_outlive_the_dead_replicas_lease_until_they_moved() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn crate::store::Store> =
            Arc::new(crate::store::embedded::EmbeddedStore::open(&dir.path().join("db")).unwrap());
        let ttl = Duration::from_secs(9);
        let (a, b) = (
            replica_ttl(store.clone(), ttl).await,
            replica_ttl(store.clone(), ttl).await,
        );
        let n = 1500;
        for i in 0..n {
            a.report(node(i), 5, vec![], None).await.unwrap();
        }
        until("a writes the records", Duration::from_secs(10), || async {
            records_on(&b, 0).await.1 == n
        })
        .await;
        drop(a);
        let died = Instant::now();
        let mut slots = Vec::new();
        for i in 0..n {
            slots.push(b.subscribe(node(i)));
            b.report(node(i), 6, vec![], None).await.unwrap();
        }
        // Their heartbeats, every third of the TTL.
        let beats = {
            let b = b.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(ttl / 3).await;
                    for i in 0..n {
                        b.report(node(i), 6, vec![], None).await.unwrap();
                    }
                }
            })
        };
        let own = b.role_lease(AgentRole::Node).await.unwrap();
        let mut paced = false;
        loop {
            let (mine, others) = records_on(&b, own).await;
            assert_eq!(
                mine + others,
                n,
                "a record went missing {:?} after the death",
                died.elapsed()
            );
            // 1,500 records at 128 a second take 12 s: never all at once.
            paced |= mine > 0 && mine < n;
            if mine == n {
                break;
            }
            assert!(
                died.elapsed() < Duration::from_secs(40),
                "{mine} of {n} moved after 40 s"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        beats.abort();
        assert!(paced, "the records moved in one go");
        assert!(
            died.elapsed() > ttl,
            "all moved before the dead lease would have ended: nothing tested"
        );
    }

    async fn stored(h: &Hub, key: &AgentKey) -> Option<(LeaseId, AliveRecord)> {
        let kv = h.state.store().get(&h.state.alive_key(key.0, &key.1)).await.unwrap()?;
        Some((kv.lease, serde_json::from_slice(&kv.value).unwrap()))
    }

    async fn until<F: std::future::Future<Output = bool>>(what: &str, within: Duration, mut f: impl FnMut() -> F) {
        let start = Instant::now();
        while !f().await {
            assert!(start.elapsed() < within, "{what}: not within {within:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Two replicas on one store. A node that moves from a live replica
    /// keeps its record until its arrival is judged, then has it written
    /// on the new replica's lease. A replica dies: its node, coming to the
    /// survivor, is written nothing at first (the store's revision does
    /// not move), and its record is on the survivor's lease once adopted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_node_from_a_dead_replica_keeps_its_record_and_moves_later() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn crate::store::Store> =
            Arc::new(crate::store::embedded::EmbeddedStore::open(&dir.path().join("db")).unwrap());
        let (a, b) = (replica(store.clone()).await, replica(store.clone()).await);
        let key = node(1);
        let _at_a = a.subscribe(key.clone());
        a.report(key.clone(), 5, vec![], None).await.unwrap();
        until("a writes the record", Duration::from_secs(2), || async {
            stored(&b, &key).await.is_some()
        })
        .await;
        let (a_lease, _) = stored(&b, &key).await.unwrap();

        let _at_b = b.subscribe(key.clone());
        b.report(key.clone(), 5, vec![], None).await.unwrap();
        assert_eq!(stored(&b, &key).await.unwrap().0, a_lease, "kept where it is at first");
        let within = b.adopt_defer() + Duration::from_secs(3);
        until("moved from the live replica", within, || async {
            stored(&b, &key)
                .await
                .is_some_and(|(l, r)| l != a_lease && r.replica == b.replica)
        })
        .await;

        // The node goes back to a (a new stream there); then a dies (its
        // tasks end with it, its leases are no longer renewed).
        let _at_a = a.subscribe(key.clone());
        a.report(key.clone(), 5, vec![], None).await.unwrap();
        until(
            "back on a (b is alive: written after the judgement)",
            within,
            || async { stored(&b, &key).await.is_some_and(|(_, r)| r.replica == a.replica) },
        )
        .await;
        let (a_lease, _) = stored(&b, &key).await.unwrap();
        let a_id = a.replica.clone();
        drop(a);
        until("a's presence ended", Duration::from_secs(4), || async {
            b.state
                .store()
                .get(&b.state.replica_key(&a_id))
                .await
                .unwrap()
                .is_none()
        })
        .await;
        let _at_b = b.subscribe(key.clone());
        let before = b.state.store().revision().await.unwrap();
        // Its applied revision moved on (it does with every write under
        // the site's root): progress only, known here and written with
        // the move.
        b.report(key.clone(), 6, vec![], None).await.unwrap();
        b.report(key.clone(), 7, vec![], None).await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let after = b.state.store().revision().await.unwrap();
        assert_eq!(after, before, "the arrival wrote to the store");
        assert_eq!(b.applied_here(&key), Some(7));
        until("adopted and moved", within, || async {
            stored(&b, &key)
                .await
                .is_some_and(|(l, r)| l != a_lease && r.replica == b.replica && r.applied_revision == 7)
        })
        .await;
        // An error is news: written at once.
        b.report(key.clone(), 7, vec!["route: no such device".into()], None)
            .await
            .unwrap();
        until("the error written", Duration::from_secs(2), || async {
            stored(&b, &key).await.is_some_and(|(_, r)| r.errors.len() == 1)
        })
        .await;
        // Deleted behind its back (an older replica's sweep, a deletion
        // that crossed its return): the replica it reports to writes it
        // again.
        b.state.store().delete(&b.state.alive_key(key.0, &key.1)).await.unwrap();
        until("written again after a deletion", Duration::from_secs(3), || async {
            stored(&b, &key)
                .await
                .is_some_and(|(_, r)| r.replica == b.replica && r.errors.len() == 1)
        })
        .await;
    }
}
