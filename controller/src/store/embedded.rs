//! The embedded backend: one redb file, for a site whose controller runs on a
//! single host and should need no extra server.
//!
//! It keeps etcd's model: a global revision, per-key create/mod revisions and
//! versions, a change log per revision (so watches can resume from a past
//! revision until it is compacted), and leases whose keys vanish when they
//! expire. The log is compacted automatically, keeping the newest
//! `history` revisions. Lease deadlines live in memory; on open every stored
//! lease gets a full TTL again, as etcd does after a restart.
//!
//! redb allows one process per file: a second controller on the same data
//! directory fails to open it with a clear error.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use redb::{
    Database, MultimapTableDefinition, ReadableDatabase, ReadableMultimapTable, ReadableTable, TableDefinition,
};
use tokio::sync::{mpsc, watch};

mod api;
mod codec;
use codec::{decode_events, decode_kv, encode_events, encode_kv};

use super::{
    Compare, EventKind, Footprint, KeyValue, LeaseId, Op, Range, Revision, Store, StoreError, Txn, TxnResponse,
    WatchBatch, WatchEvent, WatchStream,
};

const KV: TableDefinition<&str, &[u8]> = TableDefinition::new("kv");
const LOG: TableDefinition<i64, &[u8]> = TableDefinition::new("log");
const META: TableDefinition<&str, i64> = TableDefinition::new("meta");
const LEASES: TableDefinition<i64, u64> = TableDefinition::new("leases");
const LEASE_KEYS: MultimapTableDefinition<i64, &str> = MultimapTableDefinition::new("lease_keys");

const META_REVISION: &str = "revision";
const META_COMPACT: &str = "compact_revision";
const META_NEXT_LEASE: &str = "next_lease";

/// Revisions of history kept for watches by default.
pub const DEFAULT_HISTORY: i64 = crate::config::DEFAULT_STORE_HISTORY;
/// The most redb caches of the file in memory. redb's default (1 GiB)
/// made the controller's RSS follow the file as it grew, which looked like
/// a leak. The kernel's page cache holds the file too, so a miss here is a
/// copy, not a disk read: 8 MiB holds the hot pages (heaptrack under churn:
/// the cache was what kept growing, page by page, up to the file's size).
const CACHE_BYTES: usize = 8 << 20;

/// Opens (or creates) the database file with the bounded cache.
fn open_db(path: &Path) -> Result<Database, redb::DatabaseError> {
    redb::Builder::new().set_cache_size(CACHE_BYTES).create(path)
}

/// A commit this slow is logged (debug).
const SLOW_COMMIT: Duration = Duration::from_millis(50);
/// How often expired leases are looked for.
const LEASE_TICK: Duration = Duration::from_millis(100);
/// Batches a watcher may have queued before the reader waits for it. Small:
/// the reader re-reads the log, so waiting loses nothing.
const WATCH_QUEUE: usize = 16;

#[derive(Clone)]
pub struct EmbeddedStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// The open database; None while it could not be opened again after
    /// an I/O error.
    db: std::sync::RwLock<Option<Arc<Database>>>,
    path: std::path::PathBuf,
    /// An I/O error (disk full, read-only) happened: redb refuses every
    /// later operation of that handle, so the next call opens the file
    /// anew (committed data is intact: redb commits are atomic).
    failed_io: std::sync::atomic::AtomicBool,
    /// The current revision, for watchers to wait on.
    revision: watch::Sender<Revision>,
    leases: Mutex<HashMap<LeaseId, LeaseState>>,
    history: i64,
}

#[derive(Clone, Copy)]
struct LeaseState {
    ttl: Duration,
    deadline: Instant,
}

fn backend_err(e: impl std::fmt::Display) -> StoreError {
    let m = e.to_string();
    // The disk, not the data: worth retrying once it has room again.
    const IO: [&str; 5] = [
        "No space left",
        "Read-only file system",
        "Disk quota",
        "Previous I/O error",
        "Input/output error",
    ];
    if IO.iter().any(|x| m.contains(x)) {
        StoreError::Unavailable(format!(
            "the embedded store cannot write its file: {m}; free space on the data directory's disk \
             (or make it writable again) and retry"
        ))
    } else {
        StoreError::Backend(m)
    }
}

impl EmbeddedStore {
    /// Opens (or creates) the store file at `path`. Must be called inside a
    /// tokio runtime: it starts the lease-expiry task.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        Self::open_with_history(path, DEFAULT_HISTORY)
    }

    pub fn open_with_history(path: &Path, history: i64) -> Result<Self, StoreError> {
        let db = open_db(path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => StoreError::Unavailable(format!(
                "{} is already open in another process (is another controller using this data directory?)",
                path.display()
            )),
            e => StoreError::Backend(format!("cannot open {}: {e}", path.display())),
        })?;
        let (rev, leases) = {
            let w = db.begin_write().map_err(backend_err)?;
            let rev;
            let mut leases = HashMap::new();
            {
                w.open_table(KV).map_err(backend_err)?;
                w.open_table(LOG).map_err(backend_err)?;
                w.open_multimap_table(LEASE_KEYS).map_err(backend_err)?;
                let mut meta = w.open_table(META).map_err(backend_err)?;
                let cur = meta.get(META_REVISION).map_err(backend_err)?.map(|v| v.value());
                rev = match cur {
                    Some(r) => r,
                    None => {
                        meta.insert(META_REVISION, 1).map_err(backend_err)?;
                        meta.insert(META_COMPACT, 0).map_err(backend_err)?;
                        meta.insert(META_NEXT_LEASE, 1).map_err(backend_err)?;
                        1
                    }
                };
                let lt = w.open_table(LEASES).map_err(backend_err)?;
                let now = Instant::now();
                for item in lt.iter().map_err(backend_err)? {
                    let (id, ttl_ms) = item.map_err(backend_err)?;
                    let ttl = Duration::from_millis(ttl_ms.value());
                    leases.insert(
                        id.value(),
                        LeaseState {
                            ttl,
                            deadline: now + ttl,
                        },
                    );
                }
            }
            w.commit().map_err(backend_err)?;
            (rev, leases)
        };
        let (tx, _) = watch::channel(rev);
        let inner = Arc::new(Inner {
            db: std::sync::RwLock::new(Some(Arc::new(db))),
            path: path.to_path_buf(),
            failed_io: Default::default(),
            revision: tx,
            leases: Mutex::new(leases),
            history: history.max(1),
        });
        let weak = Arc::downgrade(&inner);
        weft_common::task::supervise("lease-expiry", weft_common::task::OnFailure::Restart, move || {
            let weak = weak.clone();
            async move {
                expire_leases(weak).await;
                Ok(())
            }
        });
        Ok(Self { inner })
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || {
            let r = f(&inner);
            // Inside a call, only an I/O failure is Unavailable (see
            // `backend_err`): the next call opens the file anew.
            if matches!(&r, Err(StoreError::Unavailable(_))) {
                inner.failed_io.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            r
        })
        .await
        .map_err(|e| StoreError::Backend(format!("store worker failed: {e}")))?
    }
}

async fn expire_leases(inner: Weak<Inner>) {
    let mut tick = tokio::time::interval(LEASE_TICK);
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        let now = Instant::now();
        let expired: Vec<LeaseId> = {
            let leases = inner.leases.lock().unwrap();
            leases
                .iter()
                .filter(|(_, l)| l.deadline <= now)
                .map(|(id, _)| *id)
                .collect()
        };
        if expired.is_empty() {
            continue;
        }
        let res = tokio::task::spawn_blocking(move || {
            for id in expired {
                if let Err(e) = inner.revoke(id) {
                    tracing::warn!(lease = id, error = %e, "could not expire lease");
                }
            }
        })
        .await;
        if let Err(e) = res {
            tracing::error!(error = %e, "lease expiry worker failed");
        }
    }
}

// --- the synchronous core -------------------------------------------------

impl Inner {
    /// The database, opened anew first when an I/O error poisoned the
    /// handle (see `failed_io`).
    fn db(&self) -> Result<Arc<Database>, StoreError> {
        use std::sync::atomic::Ordering;
        if self.failed_io.load(Ordering::SeqCst) {
            let mut g = self.db.write().unwrap();
            if self.failed_io.load(Ordering::SeqCst) {
                // The old handle must be gone before the file is opened
                // again; an operation still holding it makes us wait for
                // the next call.
                if let Some(old) = g.take() {
                    match Arc::try_unwrap(old) {
                        Ok(db) => drop(db),
                        Err(busy) => {
                            *g = Some(busy);
                            return Err(StoreError::Unavailable(
                                "the embedded store is reopening after an I/O error; retry".into(),
                            ));
                        }
                    }
                }
                match open_db(&self.path) {
                    Ok(db) => {
                        *g = Some(Arc::new(db));
                        self.failed_io.store(false, Ordering::SeqCst);
                        tracing::info!(path = %self.path.display(), "the embedded store is writable again");
                    }
                    Err(e) => return Err(backend_err(format!("cannot reopen {}: {e}", self.path.display()))),
                }
            }
        }
        self.db
            .read()
            .unwrap()
            .clone()
            .ok_or_else(|| StoreError::Unavailable("the embedded store is closed after an I/O error; retry".into()))
    }

    fn read_meta(&self, t: &impl ReadableTable<&'static str, i64>, k: &str) -> Result<i64, StoreError> {
        Ok(t.get(k).map_err(backend_err)?.map(|v| v.value()).unwrap_or(0))
    }

    fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        let r = self.db()?.begin_read().map_err(backend_err)?;
        let kv = r.open_table(KV).map_err(backend_err)?;
        match kv.get(key).map_err(backend_err)? {
            Some(v) => Ok(Some(decode_kv(key, v.value())?)),
            None => Ok(None),
        }
    }

    fn get_prefix(&self, prefix: &str) -> Result<Range, StoreError> {
        let r = self.db()?.begin_read().map_err(backend_err)?;
        let kv = r.open_table(KV).map_err(backend_err)?;
        let meta = r.open_table(META).map_err(backend_err)?;
        let revision = self.read_meta(&meta, META_REVISION)?;
        let mut kvs = Vec::new();
        for item in kv.range(prefix..).map_err(backend_err)? {
            let (k, v) = item.map_err(backend_err)?;
            if !k.value().starts_with(prefix) {
                break;
            }
            kvs.push(decode_kv(k.value(), v.value())?);
        }
        Ok(Range { kvs, revision })
    }

    fn txn(&self, txn: &Txn) -> Result<TxnResponse, StoreError> {
        let started = Instant::now();
        let w = self.db()?.begin_write().map_err(backend_err)?;
        let began = started.elapsed();
        let (resp, changed) = self.apply(&w, txn)?;
        let applied = started.elapsed();
        w.commit().map_err(backend_err)?;
        let took = started.elapsed();
        if took >= SLOW_COMMIT {
            // The file's writer is one at a time: `waited_ms` is the
            // queue, the rest the commit itself (its fsyncs).
            tracing::debug!(
                ms = took.as_millis() as u64,
                waited_ms = began.as_millis() as u64,
                commit_ms = (took - applied).as_millis() as u64,
                ops = txn.ops.len(),
                "slow store commit"
            );
        }
        if changed {
            self.publish(resp.revision);
        }
        Ok(resp)
    }

    fn publish(&self, revision: Revision) {
        self.revision.send_if_modified(|r| {
            let newer = revision > *r;
            if newer {
                *r = revision;
            }
            newer
        });
    }

    /// Checks and applies `txn` inside the write transaction `w`; returns the
    /// response and whether the revision moved.
    fn apply(&self, w: &redb::WriteTransaction, txn: &Txn) -> Result<(TxnResponse, bool), StoreError> {
        let (resp, changed) = {
            let mut kv = w.open_table(KV).map_err(backend_err)?;
            let mut meta = w.open_table(META).map_err(backend_err)?;
            let mut log = w.open_table(LOG).map_err(backend_err)?;
            let mut lease_keys = w.open_multimap_table(LEASE_KEYS).map_err(backend_err)?;
            let leases = w.open_table(LEASES).map_err(backend_err)?;
            let current = self.read_meta(&meta, META_REVISION)?;

            let existing = |kv: &redb::Table<&str, &[u8]>, key: &str| -> Result<Option<KeyValue>, StoreError> {
                match kv.get(key).map_err(backend_err)? {
                    Some(v) => Ok(Some(decode_kv(key, v.value())?)),
                    None => Ok(None),
                }
            };
            for c in &txn.compares {
                let holds = match c {
                    Compare::Version(k, v) => existing(&kv, k)?.map_or(0, |e| e.version) == *v,
                    Compare::ModRevision(k, r) => existing(&kv, k)?.map_or(0, |e| e.mod_revision) == *r,
                    Compare::Value(k, val) => existing(&kv, k)?.is_some_and(|e| &e.value == val),
                    Compare::Lease(k, l) => existing(&kv, k)?.is_some_and(|e| e.lease == *l),
                };
                if !holds {
                    return Ok((
                        TxnResponse {
                            succeeded: false,
                            revision: current,
                        },
                        false,
                    ));
                }
            }
            let new_rev = current + 1;
            let mut events = Vec::new();
            for op in &txn.ops {
                match op {
                    Op::Put { key, value, lease } => {
                        let lease = lease.unwrap_or(0);
                        if lease != 0 && leases.get(lease).map_err(backend_err)?.is_none() {
                            return Err(StoreError::LeaseNotFound(lease));
                        }
                        let prev = existing(&kv, key)?;
                        if let Some(p) = &prev
                            && p.lease != 0
                            && p.lease != lease
                        {
                            lease_keys.remove(p.lease, key.as_str()).map_err(backend_err)?;
                        }
                        if lease != 0 {
                            lease_keys.insert(lease, key.as_str()).map_err(backend_err)?;
                        }
                        let rec = KeyValue {
                            key: key.clone(),
                            value: value.clone(),
                            create_revision: prev.as_ref().map_or(new_rev, |p| p.create_revision),
                            mod_revision: new_rev,
                            version: prev.as_ref().map_or(1, |p| p.version + 1),
                            lease,
                        };
                        kv.insert(key.as_str(), encode_kv(&rec).as_slice())
                            .map_err(backend_err)?;
                        events.push(WatchEvent {
                            kind: EventKind::Put,
                            kv: rec,
                        });
                    }
                    Op::Delete { key } => {
                        if let Some(p) = existing(&kv, key)? {
                            delete_key(&mut kv, &mut lease_keys, &p, new_rev, &mut events)?;
                        }
                    }
                    Op::DeletePrefix { prefix } => {
                        let mut doomed = Vec::new();
                        for item in kv.range(prefix.as_str()..).map_err(backend_err)? {
                            let (k, v) = item.map_err(backend_err)?;
                            if !k.value().starts_with(prefix.as_str()) {
                                break;
                            }
                            doomed.push(decode_kv(k.value(), v.value())?);
                        }
                        for p in doomed {
                            delete_key(&mut kv, &mut lease_keys, &p, new_rev, &mut events)?;
                        }
                    }
                }
            }
            if events.is_empty() {
                (
                    TxnResponse {
                        succeeded: true,
                        revision: current,
                    },
                    false,
                )
            } else {
                log.insert(new_rev, encode_events(&events).as_slice())
                    .map_err(backend_err)?;
                meta.insert(META_REVISION, new_rev).map_err(backend_err)?;
                let compacted = self.read_meta(&meta, META_COMPACT)?;
                let keep_from = new_rev - self.history + 1;
                if keep_from > compacted {
                    log.retain_in(..keep_from, |_, _| false).map_err(backend_err)?;
                    meta.insert(META_COMPACT, keep_from).map_err(backend_err)?;
                }
                (
                    TxnResponse {
                        succeeded: true,
                        revision: new_rev,
                    },
                    true,
                )
            }
        };
        Ok((resp, changed))
    }

    /// Ends lease `id` and deletes its keys, in one write. Returns whether
    /// the lease existed.
    fn revoke(&self, id: LeaseId) -> Result<bool, StoreError> {
        let w = self.db()?.begin_write().map_err(backend_err)?;
        let (existed, resp) = {
            let keys: Vec<String> = {
                let lk = w.open_multimap_table(LEASE_KEYS).map_err(backend_err)?;
                let mut keys = Vec::new();
                for k in lk.get(id).map_err(backend_err)? {
                    keys.push(k.map_err(backend_err)?.value().to_string());
                }
                keys
            };
            let txn = Txn {
                compares: vec![],
                ops: keys.into_iter().map(Op::delete).collect(),
            };
            let (resp, changed) = self.apply(&w, &txn)?;
            let mut leases = w.open_table(LEASES).map_err(backend_err)?;
            let mut lk = w.open_multimap_table(LEASE_KEYS).map_err(backend_err)?;
            lk.remove_all(id).map_err(backend_err)?;
            (
                leases.remove(id).map_err(backend_err)?.is_some(),
                changed.then_some(resp.revision),
            )
        };
        w.commit().map_err(backend_err)?;
        if let Some(rev) = resp {
            self.publish(rev);
        }
        self.leases.lock().unwrap().remove(&id);
        Ok(existed)
    }

    /// Log entries in `from..=to` whose keys start with `prefix`.
    fn read_log(&self, prefix: &str, from: Revision, to: Revision) -> Result<Vec<WatchBatch>, StoreError> {
        let r = self.db()?.begin_read().map_err(backend_err)?;
        let meta = r.open_table(META).map_err(backend_err)?;
        let compacted = self.read_meta(&meta, META_COMPACT)?;
        if from < compacted {
            return Err(StoreError::Compacted {
                requested: from,
                compact_revision: compacted,
            });
        }
        let log = r.open_table(LOG).map_err(backend_err)?;
        let mut out = Vec::new();
        for item in log.range(from..=to).map_err(backend_err)? {
            let (rev, data) = item.map_err(backend_err)?;
            let events: Vec<WatchEvent> = decode_events(data.value())?
                .into_iter()
                .filter(|e| e.kv.key.starts_with(prefix))
                .collect();
            if !events.is_empty() {
                out.push(WatchBatch {
                    revision: rev.value(),
                    events,
                });
            }
        }
        Ok(out)
    }
}

fn delete_key(
    kv: &mut redb::Table<&str, &[u8]>,
    lease_keys: &mut redb::MultimapTable<i64, &str>,
    prev: &KeyValue,
    rev: Revision,
    events: &mut Vec<WatchEvent>,
) -> Result<(), StoreError> {
    kv.remove(prev.key.as_str()).map_err(backend_err)?;
    if prev.lease != 0 {
        lease_keys.remove(prev.lease, prev.key.as_str()).map_err(backend_err)?;
    }
    events.push(WatchEvent {
        kind: EventKind::Delete,
        kv: KeyValue {
            key: prev.key.clone(),
            value: Vec::new(),
            create_revision: 0,
            mod_revision: rev,
            version: 0,
            lease: 0,
        },
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_encoding_round_trips() {
        let evs = vec![
            WatchEvent {
                kind: EventKind::Put,
                kv: KeyValue {
                    key: "/a/b".into(),
                    value: b"hello".to_vec(),
                    create_revision: 3,
                    mod_revision: 9,
                    version: 4,
                    lease: 7,
                },
            },
            WatchEvent {
                kind: EventKind::Delete,
                kv: KeyValue {
                    key: "/a/c".into(),
                    value: vec![],
                    create_revision: 0,
                    mod_revision: 9,
                    version: 0,
                    lease: 0,
                },
            },
        ];
        assert_eq!(decode_events(&encode_events(&evs)).unwrap(), evs);
        assert!(decode_events(&encode_events(&evs)[..10]).is_err());
    }
}
