//! Every replica's revocation set, kept equal to the store's through a
//! watch, and the store's revocations of expired certificates pruned.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;

use crate::auth::Authenticator;
use crate::state::State;
use crate::store::EventKind;

/// How often the revocations whose certificate has expired (refused as
/// expired anyway) leave the store, and so every replica's memory, so a
/// site where agents come and go keeps at most a certificate lifetime's
/// worth of them.
pub(super) const PRUNED_EVERY: Duration = Duration::from_secs(600);

/// Keeps the authenticator's revocation set equal to the store's, so a
/// revocation made through any replica takes effect on this one; every
/// `prune_every`, deletes the revocations of certificates that expired
/// (past the clock-skew margin) from the store.
pub(super) async fn follow(state: State, auth: Arc<Authenticator>, prune_every: Duration) {
    loop {
        let res: Result<(), crate::error::Error> = async {
            let (list, rev) = state.revoked().await?;
            auth.set_revoked(&list);
            drop(list);
            let prefix = state.revoked_prefix();
            let mut watch = state.store().watch_prefix(&prefix, rev + 1).await?;
            let mut prune = tokio::time::interval_at(tokio::time::Instant::now() + prune_every, prune_every);
            loop {
                let batch = tokio::select! {
                    b = watch.next() => b,
                    // The expired leave the store (found in memory, not by
                    // reading the whole set: a second copy of it, under
                    // churn, raised the controller's memory by megabytes at
                    // each pass); their deletions come through the watch,
                    // to every replica.
                    _ = prune.tick() => {
                        let lapsed = auth.lapsed_revocations(crate::state::revocations_lapsed_before());
                        if let Err(e) = state.delete_revocations(&lapsed).await {
                            tracing::warn!(error = %e, "cannot prune the revocations of expired certificates");
                        }
                        continue;
                    }
                };
                let Some(batch) = batch else { break };
                for ev in batch?.events {
                    let Some(crate::state::Key::Revoked(serial)) = state.parse(&ev.kv.key) else {
                        continue;
                    };
                    match ev.kind {
                        EventKind::Put => match serde_json::from_slice::<crate::domain::Revoked>(&ev.kv.value) {
                            Ok(r) if r.serial == serial => auth.revoked_record(&r),
                            // Unreadable: refused all the same, and kept
                            // until the record goes.
                            _ => auth.revoke(serial.to_string(), crate::auth::RevokedAs::Other),
                        },
                        EventKind::Delete => auth.forget_revoked(serial),
                    }
                }
            }
            Ok(())
        }
        .await;
        if let Err(e) = res {
            tracing::warn!(error = %e, "revocation watch interrupted; resuming");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::now_ms;

    async fn until(what: &str, mut cond: impl FnMut() -> bool) {
        let t0 = std::time::Instant::now();
        while !cond() {
            assert!(t0.elapsed() < Duration::from_secs(10), "{what}: not within 10 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A replica learns revocations made through another (store writes),
    /// forgets those whose record another replica deleted, and prunes from
    /// the store, by what it holds in memory, the revocations of
    /// certificates expired past the margin; the others stay, in the store
    /// and in memory.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replica_follows_the_stores_revocations_and_prunes_the_lapsed() {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::store::embedded::EmbeddedStore::open(&dir.path().join("db")).unwrap();
        let state = State::new(Arc::new(store), "s");
        let pki = crate::pki::ensure(&dir.path().join("pki"), "s", &[]).unwrap();
        let auth = Authenticator::new("s", &pki.ca.trusted).unwrap();
        let (now, hour) = (now_ms(), 3_600_000);
        state.revoke_admin("valid-before", now + hour).await.unwrap();
        let follower = tokio::spawn(follow(state.clone(), auth.clone(), Duration::from_millis(300)));
        until("the revocation stored before it started", || {
            auth.is_revoked("valid-before")
        })
        .await;

        // Made through another replica: a store write.
        state.revoke_admin("valid", now + hour).await.unwrap();
        state.revoke_admin("expired", now - hour).await.unwrap();
        state.revoke_admin("recent", now - 60_000).await.unwrap();
        until("revocations written by another replica", || {
            ["valid", "expired", "recent"].iter().all(|s| auth.is_revoked(s))
        })
        .await;

        // The pruning pass deletes the expired one (past the margin) from
        // the store; its deletion comes back through the watch.
        until("the expired revocation forgotten", || !auth.is_revoked("expired")).await;
        let stored = state.store().get_prefix(&state.revoked_prefix()).await.unwrap();
        let mut keys: Vec<String> = stored
            .kvs
            .iter()
            .map(|kv| kv.key.rsplit('/').next().unwrap().to_string())
            .collect();
        keys.sort();
        assert_eq!(keys, ["recent", "valid", "valid-before"], "what the store keeps");

        // Another replica deleted a record: forgotten here too.
        let key = stored
            .kvs
            .iter()
            .find(|kv| kv.key.ends_with("/recent"))
            .unwrap()
            .key
            .clone();
        state
            .store()
            .txn(crate::store::Txn::new().then(crate::store::Op::delete(key)))
            .await
            .unwrap();
        until("a revocation deleted by another replica forgotten", || {
            !auth.is_revoked("recent")
        })
        .await;
        assert!(auth.is_revoked("valid") && auth.is_revoked("valid-before"));
        follower.abort();
    }
}
