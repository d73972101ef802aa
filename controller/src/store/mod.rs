//! The controller's state store: a small, etcd-shaped key-value abstraction.
//!
//! What the controller needs from etcd and nothing more: revisioned keys,
//! compare-and-swap transactions over several keys, prefix reads, watches of
//! a prefix from a revision, and leases with a TTL. Two backends implement it:
//! [`etcd::EtcdStore`] (several controller replicas may share one etcd) and
//! [`embedded::EmbeddedStore`] (a redb file, for a single host). Both obey the
//! same conformance suite (`tests/e2e/store_conformance.rs`).
//!
//! Semantics follow etcd's so that code written against one backend behaves
//! the same on the other: every successful write transaction advances the
//! store revision by exactly one and stamps all of its keys with it; a failed
//! compare writes nothing; a watch started at revision R delivers every change
//! with revision >= R, grouped by revision, or fails with
//! [`StoreError::Compacted`] when R was compacted away.

pub mod embedded;
pub mod etcd;

use std::time::Duration;

use async_trait::async_trait;
use futures::stream::BoxStream;

/// A store revision. Starts at 1 on an empty store, like etcd.
pub type Revision = i64;
/// A lease id. Never 0; 0 means "no lease".
pub type LeaseId = i64;

/// One key with its value and bookkeeping, as etcd reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    pub key: String,
    pub value: Vec<u8>,
    /// Revision of the write that created the key (since it last was absent).
    pub create_revision: Revision,
    /// Revision of the last write to the key.
    pub mod_revision: Revision,
    /// Number of writes since creation; 1 after the first put.
    pub version: i64,
    /// The lease the key is attached to, or 0.
    pub lease: LeaseId,
}

/// A condition a transaction checks before it writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Compare {
    /// The key's version equals this; 0 means the key is absent.
    Version(String, i64),
    /// The key's last write happened at this revision; 0 means absent.
    ModRevision(String, Revision),
    /// The key exists and holds exactly this value.
    Value(String, Vec<u8>),
    /// The key exists and is attached to this lease.
    Lease(String, LeaseId),
}

/// A write inside a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Put {
        key: String,
        value: Vec<u8>,
        /// Attach to a lease: the key is deleted when the lease ends.
        lease: Option<LeaseId>,
    },
    Delete {
        key: String,
    },
    DeletePrefix {
        prefix: String,
    },
}

impl Op {
    pub fn put(key: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        Op::Put {
            key: key.into(),
            value: value.into(),
            lease: None,
        }
    }
    pub fn delete(key: impl Into<String>) -> Self {
        Op::Delete { key: key.into() }
    }
}

/// All compares hold → all ops apply atomically at one new revision;
/// otherwise nothing is written.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Txn {
    pub compares: Vec<Compare>,
    pub ops: Vec<Op>,
}

impl Txn {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn when(mut self, c: Compare) -> Self {
        self.compares.push(c);
        self
    }
    pub fn then(mut self, op: Op) -> Self {
        self.ops.push(op);
        self
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TxnResponse {
    pub succeeded: bool,
    /// The store revision after the transaction (unchanged when it failed or
    /// wrote nothing).
    pub revision: Revision,
}

/// Keys under a prefix, read at one revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Range {
    /// Sorted by key.
    pub kvs: Vec<KeyValue>,
    pub revision: Revision,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    Put,
    Delete,
}

/// One change. For a delete, `kv` carries the key, an empty value and the
/// revision of the delete as `mod_revision`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchEvent {
    pub kind: EventKind,
    pub kv: KeyValue,
}

/// Every change under the watched prefix made by one revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchBatch {
    pub revision: Revision,
    pub events: Vec<WatchEvent>,
}

pub type WatchStream = BoxStream<'static, Result<WatchBatch, StoreError>>;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the store is unavailable: {0}")]
    Unavailable(String),
    #[error(
        "revision {requested} has been compacted (oldest kept is {compact_revision}); \
         read the current state and watch from its revision"
    )]
    Compacted {
        requested: Revision,
        compact_revision: Revision,
    },
    #[error("revision {requested} is in the future (current is {current})")]
    FutureRevision { requested: Revision, current: Revision },
    #[error("lease {0:x} does not exist or has expired")]
    LeaseNotFound(LeaseId),
    #[error("the store's data is corrupt: {0}")]
    Corrupt(String),
    #[error("the store failed: {0}")]
    Backend(String),
}

/// An in-process store's size: its file, and the part of it cached in
/// memory (bounded; it fills as the file is read and written).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Footprint {
    pub file_bytes: u64,
    pub cache_bytes: u64,
}

/// The store abstraction the controller is written against.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// A short name for logs and errors ("etcd", "embedded").
    fn backend(&self) -> &'static str;

    /// What the store keeps on this host and in this process (None: it
    /// lives elsewhere, as etcd's data does).
    fn footprint(&self) -> Option<Footprint> {
        None
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError>;

    /// Every key starting with `prefix`, sorted, and the revision read at.
    async fn get_prefix(&self, prefix: &str) -> Result<Range, StoreError>;

    async fn txn(&self, txn: Txn) -> Result<TxnResponse, StoreError>;

    /// Changes under `prefix` with revision >= `start_revision`, then live
    /// changes. `start_revision` 0 means "from now on".
    async fn watch_prefix(&self, prefix: &str, start_revision: Revision) -> Result<WatchStream, StoreError>;

    /// A new lease that ends `ttl` after its last keep-alive. etcd counts in
    /// whole seconds, so a TTL is rounded up to one.
    async fn lease_grant(&self, ttl: Duration) -> Result<LeaseId, StoreError>;

    /// Renews a lease; returns its TTL. [`StoreError::LeaseNotFound`] once it
    /// has ended.
    async fn lease_keep_alive(&self, lease: LeaseId) -> Result<Duration, StoreError>;

    /// Ends a lease now and deletes the keys attached to it.
    async fn lease_revoke(&self, lease: LeaseId) -> Result<(), StoreError>;

    /// Forgets history before `revision`; watches may no longer start there.
    async fn compact(&self, revision: Revision) -> Result<(), StoreError>;

    /// The current store revision.
    async fn revision(&self) -> Result<Revision, StoreError>;

    /// Unconditional put; returns the new revision.
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<Revision, StoreError> {
        Ok(self.txn(Txn::new().then(Op::put(key, value))).await?.revision)
    }

    /// Unconditional delete; returns the new revision.
    async fn delete(&self, key: &str) -> Result<Revision, StoreError> {
        Ok(self.txn(Txn::new().then(Op::delete(key))).await?.revision)
    }
}

/// Groups events by revision, keeping their order. Backends that receive
/// events in bulk (etcd) use it to produce [`WatchBatch`]es.
pub(crate) fn batch_by_revision(events: Vec<WatchEvent>) -> Vec<WatchBatch> {
    let mut out: Vec<WatchBatch> = Vec::new();
    for ev in events {
        let rev = ev.kv.mod_revision;
        match out.last_mut() {
            Some(b) if b.revision == rev => b.events.push(ev),
            _ => out.push(WatchBatch {
                revision: rev,
                events: vec![ev],
            }),
        }
    }
    out
}

/// A TTL in whole seconds, at least one (etcd's granularity).
pub(crate) fn ttl_secs(ttl: Duration) -> i64 {
    let s = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    s.max(1) as i64
}
