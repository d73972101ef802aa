//! The [`Store`] trait over the synchronous core: reads and transactions
//! run on blocking threads, leases and watches on the runtime.

use super::*;

#[async_trait]
impl Store for EmbeddedStore {
    fn backend(&self) -> &'static str {
        "embedded"
    }

    fn footprint(&self) -> Option<Footprint> {
        // Read under the lock, not through a clone of the handle: a clone
        // held at the wrong moment would make a reopen after an I/O error
        // wait for it.
        let cache_bytes = self.inner.db.read().unwrap().as_ref()?.cache_stats().used_bytes() as u64;
        Some(Footprint {
            file_bytes: std::fs::metadata(&self.inner.path).map_or(0, |m| m.len()),
            cache_bytes,
        })
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        let key = key.to_string();
        self.blocking(move |i| i.get(&key)).await
    }

    async fn get_prefix(&self, prefix: &str) -> Result<Range, StoreError> {
        let prefix = prefix.to_string();
        self.blocking(move |i| i.get_prefix(&prefix)).await
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResponse, StoreError> {
        self.blocking(move |i| i.txn(&txn)).await
    }

    async fn watch_prefix(&self, prefix: &str, start_revision: Revision) -> Result<WatchStream, StoreError> {
        let mut rev_rx = self.inner.revision.subscribe();
        let current = *rev_rx.borrow_and_update();
        let mut next = if start_revision <= 0 {
            current + 1
        } else {
            start_revision
        };
        // Fail fast on a compacted start, as etcd does.
        {
            let prefix = prefix.to_string();
            let from = next;
            self.blocking(move |i| i.read_log(&prefix, from, from - 1).map(|_| ()))
                .await?;
        }
        let (tx, rx) = mpsc::channel(WATCH_QUEUE);
        let store = self.clone();
        let prefix = prefix.to_string();
        tokio::spawn(async move {
            let mut upto = current;
            loop {
                if next <= upto {
                    let (p, from, to) = (prefix.clone(), next, upto);
                    match store.blocking(move |i| i.read_log(&p, from, to)).await {
                        Ok(batches) => {
                            for b in batches {
                                if tx.send(Ok(b)).await.is_err() {
                                    return;
                                }
                            }
                            next = upto + 1;
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e)).await;
                            return;
                        }
                    }
                }
                tokio::select! {
                    changed = rev_rx.changed() => {
                        if changed.is_err() { return; }
                        upto = *rev_rx.borrow_and_update();
                    }
                    _ = tx.closed() => return,
                }
            }
        });
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }

    async fn lease_grant(&self, ttl: Duration) -> Result<LeaseId, StoreError> {
        let ttl = Duration::from_secs(crate::store::ttl_secs(ttl) as u64);
        self.blocking(move |i| {
            let w = i.db()?.begin_write().map_err(backend_err)?;
            let id = {
                let mut meta = w.open_table(META).map_err(backend_err)?;
                let id = i.read_meta(&meta, META_NEXT_LEASE)?.max(1);
                meta.insert(META_NEXT_LEASE, id + 1).map_err(backend_err)?;
                let mut leases = w.open_table(LEASES).map_err(backend_err)?;
                leases.insert(id, ttl.as_millis() as u64).map_err(backend_err)?;
                id
            };
            w.commit().map_err(backend_err)?;
            i.leases.lock().unwrap().insert(
                id,
                LeaseState {
                    ttl,
                    deadline: Instant::now() + ttl,
                },
            );
            Ok(id)
        })
        .await
    }

    async fn lease_keep_alive(&self, lease: LeaseId) -> Result<Duration, StoreError> {
        let live = {
            let mut leases = self.inner.leases.lock().unwrap();
            match leases.get_mut(&lease) {
                Some(l) if l.deadline > Instant::now() => {
                    l.deadline = Instant::now() + l.ttl;
                    Some(l.ttl)
                }
                Some(_) => None,
                None => return Err(StoreError::LeaseNotFound(lease)),
            }
        };
        match live {
            Some(ttl) => Ok(ttl),
            None => {
                // Expired but not yet collected: collect it now.
                self.blocking(move |i| i.revoke(lease)).await?;
                Err(StoreError::LeaseNotFound(lease))
            }
        }
    }

    async fn lease_revoke(&self, lease: LeaseId) -> Result<(), StoreError> {
        if self.blocking(move |i| i.revoke(lease)).await? {
            Ok(())
        } else {
            Err(StoreError::LeaseNotFound(lease))
        }
    }

    async fn compact(&self, revision: Revision) -> Result<(), StoreError> {
        self.blocking(move |i| {
            let w = i.db()?.begin_write().map_err(backend_err)?;
            {
                let mut meta = w.open_table(META).map_err(backend_err)?;
                let current = i.read_meta(&meta, META_REVISION)?;
                let compacted = i.read_meta(&meta, META_COMPACT)?;
                if revision > current {
                    return Err(StoreError::FutureRevision {
                        requested: revision,
                        current,
                    });
                }
                if revision <= compacted {
                    return Err(StoreError::Compacted {
                        requested: revision,
                        compact_revision: compacted,
                    });
                }
                let mut log = w.open_table(LOG).map_err(backend_err)?;
                log.retain_in(..revision, |_, _| false).map_err(backend_err)?;
                meta.insert(META_COMPACT, revision).map_err(backend_err)?;
            }
            w.commit().map_err(backend_err)?;
            Ok(())
        })
        .await
    }

    async fn revision(&self) -> Result<Revision, StoreError> {
        Ok(*self.inner.revision.borrow())
    }
}
