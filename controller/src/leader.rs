//! Which replica does the site's singleton work.
//!
//! Any number of controllers may share one etcd: each serves agent streams
//! and admin calls from the shared store. Work that must run once per site
//! — the federation sessions that follow each peer, and choosing the active
//! gateway — runs only on the
//! replica holding the leader key: a key created only if absent, bound to a
//! lease the holder keeps alive. When the holder dies its lease ends after
//! at most [`LEADER_TTL`], the key goes with it and another replica's next
//! campaign (every third of the TTL) takes over. A replica that cannot
//! renew its lease stops leading at once. On the embedded store there is
//! only one controller, which always wins.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::store::{Compare, Op, Store, Txn};

/// How long a dead leader holds on, at most.
pub const LEADER_TTL: Duration = Duration::from_secs(5);

/// Campaigns for `key` as `me` until the process ends; the receiver says
/// whether this replica leads now.
pub fn campaign(store: Arc<dyn Store>, key: String, me: String) -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    weft_common::task::spawn_critical("leader-election", run(store, key, me, tx));
    rx
}

async fn run(store: Arc<dyn Store>, key: String, me: String, tx: watch::Sender<bool>) {
    let every = LEADER_TTL / 3;
    loop {
        if tx.is_closed() {
            return;
        }
        let lease = match store.lease_grant(LEADER_TTL).await {
            Ok(l) => l,
            Err(e) => {
                tracing::debug!(error = %e, "cannot campaign for leadership");
                tokio::time::sleep(every).await;
                continue;
            }
        };
        let take = Op::Put {
            key: key.clone(),
            value: me.clone().into_bytes(),
            lease: Some(lease),
        };
        // Free, or still held by this very replica before it restarted
        // (same host and listen address): no need to wait for the old lease.
        let free = Txn::new().when(Compare::Version(key.clone(), 0)).then(take.clone());
        let ours = Txn::new()
            .when(Compare::Value(key.clone(), me.clone().into_bytes()))
            .then(take);
        let won = match store.txn(free).await {
            Ok(r) if r.succeeded => true,
            Ok(_) => store.txn(ours).await.is_ok_and(|r| r.succeeded),
            Err(_) => false,
        };
        match won {
            true => {
                tracing::info!(replica = %me, "leading the site's singleton work (federation sessions)");
                tx.send_replace(true);
                loop {
                    tokio::select! {
                        _ = tokio::time::sleep(every) => {}
                        // The controller is stopping: hand over now.
                        _ = tx.closed() => {
                            let _ = store.lease_revoke(lease).await;
                            return;
                        }
                    }
                    if let Err(e) = store.lease_keep_alive(lease).await {
                        tracing::warn!(error = %e, "lost the leadership: cannot renew its lease");
                        break;
                    }
                }
                tx.send_replace(false);
            }
            false => {
                let _ = store.lease_revoke(lease).await;
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = tx.closed() => return,
                }
            }
        }
    }
}
