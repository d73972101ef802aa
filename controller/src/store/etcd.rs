//! The etcd backend: for HA (several controller replicas share one etcd
//! cluster) and scale. A thin mapping of [`Store`] onto etcd's v3 API.

use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Certificate, Client, CompareOp, ConnectOptions, DeleteOptions, EventType, GetOptions, Identity, PutOptions,
    TlsOptions, TxnOp, WatchOptions,
};
use futures::StreamExt;

use super::{
    Compare, EventKind, KeyValue, LeaseId, Op, Range, Revision, Store, StoreError, Txn, TxnResponse, WatchEvent,
    WatchStream, batch_by_revision, ttl_secs,
};

/// TLS material for talking to etcd (PEM files).
#[derive(Clone, Debug, Default)]
pub struct EtcdTls {
    pub ca_file: Option<std::path::PathBuf>,
    pub cert_file: Option<std::path::PathBuf>,
    pub key_file: Option<std::path::PathBuf>,
}

impl From<&crate::config::EtcdTlsFiles> for EtcdTls {
    fn from(f: &crate::config::EtcdTlsFiles) -> Self {
        EtcdTls {
            ca_file: f.ca_file.clone(),
            cert_file: f.cert_file.clone(),
            key_file: f.key_file.clone(),
        }
    }
}

#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
}

fn map_err(e: etcd_client::Error) -> StoreError {
    use etcd_client::Error as E;
    match e {
        E::GRpcStatus(s) => match s.code() {
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => {
                StoreError::Unavailable(format!("etcd: {}", s.message()))
            }
            _ => StoreError::Backend(format!("etcd: {}", s.message())),
        },
        E::TransportError(t) => StoreError::Unavailable(format!("etcd: {t}")),
        E::IoError(io) => StoreError::Unavailable(format!("etcd: {io}")),
        other => StoreError::Backend(format!("etcd: {other}")),
    }
}

/// Keys per page of a prefix read (a node record is ~500 bytes).
const GET_PAGE: i64 = 1000;

/// The end of the key range holding every key that starts with `prefix`
/// (etcd's convention: the prefix with its last byte below 0xff raised).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0] // every key
}

fn kv_from(kv: &etcd_client::KeyValue) -> Result<KeyValue, StoreError> {
    Ok(KeyValue {
        key: kv
            .key_str()
            .map_err(|_| StoreError::Corrupt("etcd key is not UTF-8".into()))?
            .to_string(),
        value: kv.value().to_vec(),
        create_revision: kv.create_revision(),
        mod_revision: kv.mod_revision(),
        version: kv.version(),
        lease: kv.lease(),
    })
}

impl EtcdStore {
    /// Connects to etcd. Endpoints are `http://host:port`, or `https://…`
    /// with `tls` set.
    pub async fn connect(endpoints: &[String], tls: Option<&EtcdTls>) -> Result<Self, StoreError> {
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(3))
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3));
        if let Some(tls) = tls {
            let read = |p: &std::path::Path| {
                std::fs::read(p).map_err(|e| StoreError::Unavailable(format!("cannot read {}: {e}", p.display())))
            };
            let mut t = TlsOptions::new();
            if let Some(ca) = &tls.ca_file {
                t = t.ca_certificate(Certificate::from_pem(read(ca)?));
            }
            match (&tls.cert_file, &tls.key_file) {
                (Some(c), Some(k)) => t = t.identity(Identity::from_pem(read(c)?, read(k)?)),
                (None, None) => {}
                _ => {
                    return Err(StoreError::Unavailable(
                        "etcd client TLS needs both a certificate and a key file".into(),
                    ));
                }
            }
            opts = opts.with_tls(t);
        }
        let client = Client::connect(endpoints, Some(opts)).await.map_err(map_err)?;
        let store = Self { client };
        // Fail now, not at the first request, when etcd is not there.
        store.revision().await?;
        Ok(store)
    }
}

#[async_trait]
impl Store for EtcdStore {
    fn backend(&self) -> &'static str {
        "etcd"
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        let resp = self.client.kv_client().get(key, None).await.map_err(map_err)?;
        resp.kvs().first().map(kv_from).transpose()
    }

    async fn get_prefix(&self, prefix: &str) -> Result<Range, StoreError> {
        // In pages, all at the first page's revision: one answer for a
        // 10,000-node site is over the 4 MiB a gRPC message may carry.
        let end = prefix_end(prefix.as_bytes());
        let mut from = prefix.as_bytes().to_vec();
        let mut revision = 0;
        let mut kvs = Vec::new();
        loop {
            let mut opts = GetOptions::new().with_range(end.clone()).with_limit(GET_PAGE);
            if revision > 0 {
                opts = opts.with_revision(revision);
            }
            let resp = self
                .client
                .kv_client()
                .get(from.clone(), Some(opts))
                .await
                .map_err(map_err)?;
            if revision == 0 {
                revision = resp.header().map_or(0, |h| h.revision());
            }
            for kv in resp.kvs() {
                kvs.push(kv_from(kv)?);
            }
            match resp.kvs().last() {
                Some(last) if resp.more() => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => break,
            }
        }
        Ok(Range { kvs, revision })
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResponse, StoreError> {
        let compares: Vec<etcd_client::Compare> = txn
            .compares
            .into_iter()
            .map(|c| match c {
                Compare::Version(k, v) => etcd_client::Compare::version(k, CompareOp::Equal, v),
                Compare::ModRevision(k, r) => etcd_client::Compare::mod_revision(k, CompareOp::Equal, r),
                Compare::Value(k, v) => etcd_client::Compare::value(k, CompareOp::Equal, v),
                // etcd compares an absent key's lease as 0: never a granted one.
                Compare::Lease(k, l) => etcd_client::Compare::lease(k, CompareOp::Equal, l),
            })
            .collect();
        let lease_ids: Vec<LeaseId> = txn
            .ops
            .iter()
            .filter_map(|op| match op {
                Op::Put { lease: Some(l), .. } => Some(*l),
                _ => None,
            })
            .collect();
        let ops: Vec<TxnOp> = txn
            .ops
            .into_iter()
            .map(|op| match op {
                Op::Put { key, value, lease } => TxnOp::put(key, value, lease.map(|l| PutOptions::new().with_lease(l))),
                Op::Delete { key } => TxnOp::delete(key, None),
                Op::DeletePrefix { prefix } => TxnOp::delete(prefix, Some(DeleteOptions::new().with_prefix())),
            })
            .collect();
        let resp = self
            .client
            .kv_client()
            .txn(etcd_client::Txn::new().when(compares).and_then(ops))
            .await
            .map_err(|e| match e {
                etcd_client::Error::GRpcStatus(s) if s.message().contains("lease not found") => {
                    StoreError::LeaseNotFound(lease_ids.first().copied().unwrap_or(0))
                }
                e => map_err(e),
            })?;
        Ok(TxnResponse {
            succeeded: resp.succeeded(),
            revision: resp.header().map_or(0, |h| h.revision()),
        })
    }

    async fn watch_prefix(&self, prefix: &str, start_revision: Revision) -> Result<WatchStream, StoreError> {
        let mut opts = WatchOptions::new().with_prefix().with_prev_key();
        if start_revision > 0 {
            opts = opts.with_start_revision(start_revision);
        }
        let mut stream = self
            .client
            .watch_client()
            .watch(prefix, Some(opts))
            .await
            .map_err(map_err)?;
        // The first message acknowledges creation, or says the start was compacted.
        let first = stream
            .message()
            .await
            .map_err(map_err)?
            .ok_or_else(|| StoreError::Unavailable("etcd closed the watch".into()))?;
        if first.compact_revision() > 0 {
            return Err(StoreError::Compacted {
                requested: start_revision,
                compact_revision: first.compact_revision(),
            });
        }
        let pending = if first.created() {
            Vec::new()
        } else {
            convert_events(first.events())?
        };
        let head = futures::stream::iter(batch_by_revision(pending).into_iter().map(Ok));
        let rest = futures::stream::unfold(Some(stream), move |state| async move {
            let mut stream = state?;
            loop {
                match stream.message().await {
                    Ok(Some(resp)) => {
                        if resp.compact_revision() > 0 {
                            let e = StoreError::Compacted {
                                requested: start_revision,
                                compact_revision: resp.compact_revision(),
                            };
                            return Some((vec![Err(e)], None));
                        }
                        if resp.canceled() {
                            let e =
                                StoreError::Unavailable(format!("etcd cancelled the watch: {}", resp.cancel_reason()));
                            return Some((vec![Err(e)], None));
                        }
                        match convert_events(resp.events()) {
                            Ok(evs) if evs.is_empty() => continue,
                            Ok(evs) => {
                                return Some((batch_by_revision(evs).into_iter().map(Ok).collect(), Some(stream)));
                            }
                            Err(e) => return Some((vec![Err(e)], None)),
                        }
                    }
                    Ok(None) => {
                        return Some((vec![Err(StoreError::Unavailable("etcd closed the watch".into()))], None));
                    }
                    Err(e) => return Some((vec![Err(map_err(e))], None)),
                }
            }
        })
        .flat_map(futures::stream::iter);
        Ok(Box::pin(head.chain(rest)))
    }

    async fn lease_grant(&self, ttl: Duration) -> Result<LeaseId, StoreError> {
        let resp = self
            .client
            .lease_client()
            .grant(ttl_secs(ttl), None)
            .await
            .map_err(map_err)?;
        Ok(resp.id())
    }

    async fn lease_keep_alive(&self, lease: LeaseId) -> Result<Duration, StoreError> {
        let not_found = |e: etcd_client::Error| {
            if e.to_string().contains("lease not found") {
                StoreError::LeaseNotFound(lease)
            } else {
                map_err(e)
            }
        };
        let (mut keeper, mut stream) = self.client.lease_client().keep_alive(lease).await.map_err(not_found)?;
        keeper.keep_alive().await.map_err(not_found)?;
        match stream.message().await.map_err(not_found)? {
            Some(resp) if resp.ttl() > 0 => Ok(Duration::from_secs(resp.ttl() as u64)),
            _ => Err(StoreError::LeaseNotFound(lease)),
        }
    }

    async fn lease_revoke(&self, lease: LeaseId) -> Result<(), StoreError> {
        match self.client.lease_client().revoke(lease).await {
            Ok(_) => Ok(()),
            Err(etcd_client::Error::GRpcStatus(s))
                if s.code() == tonic::Code::NotFound || s.message().contains("lease not found") =>
            {
                Err(StoreError::LeaseNotFound(lease))
            }
            Err(e) => Err(map_err(e)),
        }
    }

    async fn compact(&self, revision: Revision) -> Result<(), StoreError> {
        match self.client.kv_client().compact(revision, None).await {
            Ok(_) => Ok(()),
            Err(etcd_client::Error::GRpcStatus(s)) if s.message().contains("compacted") => Err(StoreError::Compacted {
                requested: revision,
                compact_revision: revision,
            }),
            Err(etcd_client::Error::GRpcStatus(s)) if s.message().contains("future revision") => {
                Err(StoreError::FutureRevision {
                    requested: revision,
                    current: self.revision().await?,
                })
            }
            Err(e) => Err(map_err(e)),
        }
    }

    async fn revision(&self) -> Result<Revision, StoreError> {
        let resp = self
            .client
            .kv_client()
            .get("\0", Some(GetOptions::new().with_count_only()))
            .await
            .map_err(map_err)?;
        Ok(resp.header().map_or(0, |h| h.revision()))
    }
}

fn convert_events(events: &[etcd_client::Event]) -> Result<Vec<WatchEvent>, StoreError> {
    events
        .iter()
        .filter_map(|e| e.kv().map(|kv| (e.event_type(), kv)))
        .map(|(t, kv)| {
            let mut kv = kv_from(kv)?;
            let kind = match t {
                EventType::Put => EventKind::Put,
                EventType::Delete => {
                    kv.value.clear();
                    kv.create_revision = 0;
                    kv.version = 0;
                    kv.lease = 0;
                    EventKind::Delete
                }
            };
            Ok(WatchEvent { kind, kv })
        })
        .collect()
}
