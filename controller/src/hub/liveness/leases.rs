//! The liveness records' leases and writes: each role's lease of this
//! replica (granted, replaced when it ended, renewed by one task, with
//! this replica's presence record on the gateways'), and the status
//! records written in batches.

use std::time::Duration;

use super::{AgentKey, Hub};
use crate::domain::AgentRole;
use crate::error::Error;
use crate::state::AliveRecord;
use crate::store::{LeaseId, Op, StoreError, Txn};

impl Hub {
    /// The lease `role`'s records are written on, granted when there is
    /// none yet.
    pub(super) async fn role_lease(&self, role: AgentRole) -> Result<LeaseId, Error> {
        let mut leases = self.liveness.leases.lock().await;
        if let Some(l) = leases.get(&role) {
            return Ok(*l);
        }
        let l = self.state.store().lease_grant(self.ttl(role)).await?;
        leases.insert(role, l);
        if role == AgentRole::Node {
            self.liveness.own_node.store(l, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(l)
    }

    /// `role`'s lease `lost` ended while this replica held it (it stalled
    /// for longer than the TTL, or the store lost it), and every record on
    /// it with it: a new lease, and every record of that role this replica
    /// holds written again on it.
    pub(super) async fn replace_lease(&self, role: AgentRole, lost: LeaseId) -> Result<(), Error> {
        let mut leases = self.liveness.leases.lock().await;
        if leases.get(&role) != Some(&lost) {
            return Ok(()); // replaced already
        }
        leases.remove(&role);
        let new = self.state.store().lease_grant(self.ttl(role)).await?;
        leases.insert(role, new);
        drop(leases);
        if role == AgentRole::Node {
            self.liveness.own_node.store(new, std::sync::atomic::Ordering::Relaxed);
        }
        if role == AgentRole::Gateway {
            // The presence record went with the lease.
            self.liveness
                .presence
                .store(false, std::sync::atomic::Ordering::Relaxed);
        }
        let records: Vec<(AgentKey, (LeaseId, AliveRecord))> = self
            .liveness
            .book
            .lock()
            .unwrap()
            .live
            .iter_mut()
            .filter(|(k, _)| k.0 == role)
            .map(|(k, l)| {
                l.lease = new;
                if l.foreign.take().is_some() {
                    l.last.replica = self.replica.clone();
                }
                (k.clone(), (new, l.last.clone()))
            })
            .collect();
        tracing::warn!(
            role = ?role,
            records = records.len(),
            "the liveness lease ended (this replica stalled for longer than the TTL, or the store lost it); \
             writing the records again"
        );
        self.write_status(records).await;
        Ok(())
    }

    /// Writes status records, [`STATUS_BATCH`] per transaction. A record
    /// whose lease ended meanwhile is dropped (the lease's replacement
    /// writes it again); any other failure keeps it for the next flush.
    pub(super) async fn write_status(&self, batch: Vec<(AgentKey, (LeaseId, AliveRecord))>) {
        let put = |(role, name): &AgentKey, lease: LeaseId, rec: &AliveRecord| Op::Put {
            key: self.state.alive_key(*role, name),
            value: serde_json::to_vec(rec).unwrap(),
            lease: Some(lease),
        };
        for chunk in batch.chunks(STATUS_BATCH) {
            let mut txn = Txn::new();
            for (key, (lease, rec)) in chunk {
                txn = txn.then(put(key, *lease, rec));
            }
            if let Err(e) = self.state.store().txn(txn).await {
                // A lease that ended fails the batch: go one by one.
                tracing::debug!(error = %e, "status batch failed; writing records singly");
                for (key, (lease, rec)) in chunk {
                    match self.state.store().txn(Txn::new().then(put(key, *lease, rec))).await {
                        Ok(_) => {}
                        Err(StoreError::LeaseNotFound(_)) => self.lease_lost.notify_one(),
                        Err(e) => {
                            tracing::debug!(agent = %key.1, error = %e, "status not written; kept for the next flush");
                            self.liveness
                                .dirty
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

/// How often batched status records are written, and how many go in one
/// transaction (etcd allows 128 operations per transaction by default).
const STATUS_FLUSH: Duration = Duration::from_millis(200);
const STATUS_BATCH: usize = 128;

/// Writes the status records that changed since the last flush.
pub(in crate::hub) async fn flush_status(hub: std::sync::Weak<Hub>) {
    let mut tick = tokio::time::interval(STATUS_FLUSH);
    loop {
        tick.tick().await;
        let Some(h) = hub.upgrade() else { return };
        let batch: Vec<(AgentKey, (LeaseId, AliveRecord))> = h.liveness.dirty.lock().unwrap().drain().collect();
        h.write_status(batch).await;
    }
}

/// Renews each role's liveness lease four times per TTL, and replaces one
/// that ended (see [`Hub::replace_lease`]) at once.
pub(in crate::hub) async fn keep_leases(hub: std::sync::Weak<Hub>) {
    let every = match hub.upgrade() {
        Some(h) => (h.gateway_ttl.min(h.agent_ttl) / 4).max(Duration::from_millis(20)),
        None => return,
    };
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut renewed: std::collections::HashMap<AgentRole, std::time::Instant> = Default::default();
    let mut said = None;
    loop {
        let Some(h) = hub.upgrade() else { return };
        tokio::select! {
            _ = tick.tick() => {}
            _ = h.lease_lost.notified() => {}
        }
        // Its presence record, again after its lease was replaced; a
        // failure said once a minute at most.
        if !h.liveness.presence.load(std::sync::atomic::Ordering::Relaxed)
            && let Err(e) = h.announce().await
            && said.is_none_or(|at: std::time::Instant| at.elapsed() > Duration::from_secs(60))
        {
            said = Some(std::time::Instant::now());
            tracing::warn!(error = %e, "cannot write this replica's presence record; retrying");
        }
        let leases: Vec<(AgentRole, LeaseId)> = h.liveness.leases.lock().await.iter().map(|(r, l)| (*r, *l)).collect();
        for (role, lease) in leases {
            // Each role's lease a few times per its own TTL (the nodes'
            // is longer than the gateways').
            if renewed.get(&role).is_some_and(|at| at.elapsed() < h.ttl(role) / 4) {
                continue;
            }
            match h.state.store().lease_keep_alive(lease).await {
                Ok(_) => drop(renewed.insert(role, std::time::Instant::now())),
                Err(StoreError::LeaseNotFound(_)) => {
                    if let Err(e) = h.replace_lease(role, lease).await {
                        tracing::warn!(role = ?role, error = %e, "cannot replace the liveness lease; retrying");
                    }
                    renewed.remove(&role);
                }
                Err(e) => tracing::warn!(role = ?role, error = %e, "cannot renew the liveness lease; retrying"),
            }
        }
    }
}
