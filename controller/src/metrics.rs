//! The controller's Prometheus metrics (served on `--metrics-listen`).
//!
//! Live instruments: store operation latency (a [`TimedStore`] around the
//! backend). Read at scrape time: agents connected here and their stream
//! backlog, agents live in the store, each peering's state and tunnel (as
//! its gateways report it), IPAM usage per pool, and leadership.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use weft_common::obs::{Families, Snapshot};

use crate::domain::{AgentRole, now_ms};
use crate::hub::Hub;
use crate::store::{LeaseId, Range, Revision, Store, StoreError, Txn, TxnResponse, WatchStream};

type OpLabels = Vec<(String, String)>;
type Latency = Family<OpLabels, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    Histogram::new(weft_common::obs::duration_buckets())
}

/// A store that times every call into `weft_controller_store_operation_duration_seconds`.
pub struct TimedStore {
    inner: Arc<dyn Store>,
    latency: Latency,
}

impl TimedStore {
    async fn timed<T>(&self, op: &str, f: impl std::future::Future<Output = T>) -> T {
        let start = Instant::now();
        let out = f.await;
        self.latency
            .get_or_create(&vec![("op".to_string(), op.to_string())])
            .observe(start.elapsed().as_secs_f64());
        out
    }
}

#[async_trait]
impl Store for TimedStore {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn footprint(&self) -> Option<crate::store::Footprint> {
        self.inner.footprint()
    }
    async fn get(&self, key: &str) -> Result<Option<crate::store::KeyValue>, StoreError> {
        self.timed("get", self.inner.get(key)).await
    }
    async fn get_prefix(&self, prefix: &str) -> Result<Range, StoreError> {
        self.timed("get_prefix", self.inner.get_prefix(prefix)).await
    }
    async fn txn(&self, txn: Txn) -> Result<TxnResponse, StoreError> {
        self.timed("txn", self.inner.txn(txn)).await
    }
    async fn watch_prefix(&self, prefix: &str, start_revision: Revision) -> Result<WatchStream, StoreError> {
        self.timed("watch", self.inner.watch_prefix(prefix, start_revision))
            .await
    }
    async fn lease_grant(&self, ttl: Duration) -> Result<LeaseId, StoreError> {
        self.timed("lease_grant", self.inner.lease_grant(ttl)).await
    }
    async fn lease_keep_alive(&self, lease: LeaseId) -> Result<Duration, StoreError> {
        self.timed("lease_keep_alive", self.inner.lease_keep_alive(lease)).await
    }
    async fn lease_revoke(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.timed("lease_revoke", self.inner.lease_revoke(lease)).await
    }
    async fn compact(&self, revision: Revision) -> Result<(), StoreError> {
        self.timed("compact", self.inner.compact(revision)).await
    }
    async fn revision(&self) -> Result<Revision, StoreError> {
        self.timed("revision", self.inner.revision()).await
    }
}

/// The controller's registry and what its collectors read.
pub struct ControllerMetrics {
    pub registry: Arc<Mutex<Registry>>,
    latency: Latency,
}

impl ControllerMetrics {
    pub fn new() -> Self {
        let latency: Latency = Family::new_with_constructor(latency_histogram);
        let mut r = Registry::default();
        r.register(
            "weft_controller_store_operation_duration_seconds",
            "Time of store calls, by operation",
            latency.clone(),
        );
        r.register(
            "weft_failover_step_seconds",
            "Each step of a failover, from the step it follows: expired (from the old gateway's fault), elected, \
             pushed and applied (the last agent connected to this replica), peer_told (from elected), first_packet \
             (from the later of applied and peer_told)",
            crate::hub::failover_steps().clone(),
        );
        ControllerMetrics {
            registry: Arc::new(Mutex::new(r)),
            latency,
        }
    }

    /// Wraps `store` so its calls are timed, and adds its footprint (an
    /// in-process store's file and cache) to the series.
    pub fn timed(&self, store: Arc<dyn Store>) -> Arc<dyn Store> {
        let weak = Arc::downgrade(&store);
        self.registry
            .lock()
            .unwrap()
            .register_collector(Box::new(Snapshot(move |f: &mut Families| {
                let Some(fp) = weak.upgrade().and_then(|s| s.footprint()) else {
                    return;
                };
                f.gauge(
                    "weft_controller_store_file_bytes",
                    "Size of the embedded store's file",
                    &[],
                    fp.file_bytes as f64,
                );
                f.gauge(
                    "weft_controller_store_cache_bytes",
                    "Bytes of the embedded store's file cached in the controller's memory (bounded at 8 MiB)",
                    &[],
                    fp.cache_bytes as f64,
                );
            })));
        Arc::new(TimedStore {
            inner: store,
            latency: self.latency.clone(),
        })
    }

    /// Adds the series read from the running controller's model.
    pub fn watch(&self, hub: Arc<Hub>, leader: tokio::sync::watch::Receiver<bool>) {
        let weak = Arc::downgrade(&hub);
        self.registry
            .lock()
            .unwrap()
            .register_collector(Box::new(Snapshot(move |f: &mut Families| {
                let Some(hub) = weak.upgrade() else { return };
                collect(f, &hub, *leader.borrow());
            })));
    }
}

impl Default for ControllerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

fn collect(f: &mut Families, hub: &Hub, leading: bool) {
    f.gauge(
        "weft_controller_leader",
        "1 while this replica does the site's singleton work",
        &[],
        f64::from(u8::from(leading)),
    );
    let backlog = hub.stream_backlog();
    for role in [AgentRole::Node, AgentRole::Gateway] {
        let of_role = backlog.iter().filter(|((r, _), _)| *r == role);
        let l = [("role", role.as_str())];
        f.gauge(
            "weft_controller_connected_agents",
            "Agents with a watch stream open to this replica",
            &l,
            of_role.clone().count() as f64,
        );
        f.gauge(
            "weft_controller_stream_queue_depth",
            "Updates waiting to be rendered and sent on this replica's streams",
            &l,
            of_role.map(|(_, n)| *n).sum::<usize>() as f64,
        );
    }
    let model = hub.model();
    f.gauge(
        "weft_controller_live_gateways",
        "Gateways whose liveness record exists",
        &[],
        model.live_gateways.len() as f64,
    );
    f.gauge("weft_controller_nodes", "Nodes recorded", &[], model.nodes.len() as f64);
    f.gauge(
        "weft_controller_identity_conflicts",
        "Agents whose identity two hosts held (every certificate of it revoked; see weftctl diagnose)",
        &[],
        (model.nodes.values().filter(|n| n.identity_conflict.is_some()).count()
            + model
                .gateways
                .values()
                .filter(|g| g.identity_conflict.is_some())
                .count()) as f64,
    );
    f.gauge(
        "weft_controller_gateway_keys_held",
        "Gateways whose new WireGuard key waits for `weftctl gateway accept-key`",
        &[],
        model
            .gateways
            .values()
            .filter(|g| g.pending_public_key.is_some())
            .count() as f64,
    );
    f.gauge(
        "weft_controller_gateways",
        "Gateways recorded",
        &[],
        model.gateways.len() as f64,
    );
    for p in model.peerings.values() {
        let state = format!("{:?}", hub.peering_state(p)).to_lowercase();
        for s in ["pending", "connecting", "connected", "deleting"] {
            f.gauge(
                "weft_controller_peering_state",
                "1 for the peering's current federation state",
                &[("peer_site", p.site_id.as_str()), ("state", s)],
                f64::from(u8::from(state == s)),
            );
        }
    }
    nat_series(f, hub, &model);
    let fresh_after = now_ms().saturating_sub(hub.agent_ttl.as_millis() as u64);
    for (gateway, at, tunnels) in hub.tunnel_reports() {
        if at < fresh_after {
            continue;
        }
        for t in &tunnels {
            weft_common::obs::tunnel_series(f, t, &[("gateway", gateway.as_str())]);
        }
    }
    let pools = model.site.as_ref().map(|site| {
        crate::state::allocations_of(
            site,
            model.nodes.values().map(|n| &**n),
            model.peerings.values().map(|p| &**p),
        )
        .1
    });
    for p in pools.unwrap_or_default() {
        let pool = p.pool.to_string();
        let kind = format!("{:?}", p.kind).to_lowercase();
        let family = if p.pool.addr().is_ipv6() { "ipv6" } else { "ipv4" };
        let l = [("pool", pool.as_str()), ("kind", kind.as_str()), ("family", family)];
        f.gauge(
            "weft_ipam_pool_size_addresses",
            "Addresses in the pool",
            &l,
            p.total as f64,
        );
        f.gauge(
            "weft_ipam_pool_allocated_addresses",
            "Addresses allocated from the pool",
            &l,
            p.allocated as f64,
        );
    }
}

/// NAT traversal: the reflector's and the relay's counters, each peering's
/// path, each gateway's NAT as observed.
fn nat_series(f: &mut Families, hub: &Hub, model: &crate::render::Model) {
    crate::reflector::series(f);
    crate::federation::relay::series(f);
    if let Some(site) = &model.site {
        let gateways = crate::federation::LocalGateways::of(model);
        for p in model.peerings.values() {
            let path = weft_core::peer::tunnel_path(
                p,
                &gateways.for_port(site, p.listen_port),
                hub.tunnel(&p.site_id).is_some_and(|t| t.up),
                hub.tunnel(&p.site_id).is_some_and(|t| t.on_direct),
            );
            let relay = path.strip_prefix("relayed via ").unwrap_or("");
            for s in ["direct", "hole-punched", "relayed", "waiting"] {
                let on = path == s || (s == "relayed" && !relay.is_empty());
                f.gauge(
                    "weft_controller_peering_path",
                    "1 for the path the peering's tunnel takes: direct (a reachable endpoint), hole-punched (both behind NAT), relayed (through the relay site in label relay), waiting (no way found yet)",
                    &[("peer_site", p.site_id.as_str()), ("path", s), ("relay", if s == "relayed" { relay } else { "" })],
                    f64::from(u8::from(on)),
                );
            }
        }
    }
    for g in model.gateways.values() {
        if let Some(nat) = weft_core::peer::gateway_behaviour(g) {
            f.gauge(
                "weft_controller_gateway_nat",
                "1 for the NAT behaviour the gateway's endpoint discovery observed",
                &[("gateway", g.name.as_str()), ("behaviour", nat.as_str())],
                1.0,
            );
        }
    }
}
