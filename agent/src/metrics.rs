//! The agent's Prometheus metrics (served on `--metrics-listen`).
//!
//! Per agent: applied revision, reconcile duration and failed objects,
//! drift repairs, controller connection, certificate expiry. Per peering on
//! a gateway: its WireGuard mode; up, RTT histogram, bytes and packets each way, handshake age,
//! probe counts, MTU and the path-MTU check. Per peering on a node: bytes
//! and packets to and from the peer's CIDRs (nftables counters).

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, OnceLock};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use weft_common::obs::{Families, Snapshot};
use weft_proto::v1 as pb;

type Labels = Vec<(String, String)>;

/// Traffic between this node and one peer's CIDRs, from nftables counters.
pub use weft_dataplane::nft::PeerTraffic;

pub struct AgentMetrics {
    pub registry: Arc<Mutex<Registry>>,
    pub reconcile: Family<Labels, Histogram, fn() -> Histogram>,
    pub reconcile_errors: Counter,
    pub drift_repairs: Counter,
    pub applied_revision: Gauge,
    pub connected: Gauge,
    pub cert_expiry: Gauge<f64, AtomicU64>,
    pub rtt: Family<Labels, Histogram, fn() -> Histogram>,
    /// Gateways: 1, labelled with the WireGuard mode ("kernel", "userspace").
    pub wireguard: Family<Labels, Gauge>,
    /// The gateway's tunnels as last reported.
    pub tunnels: Mutex<Vec<pb::TunnelStatus>>,
    /// Set on nodes: per-peer traffic is counted (in weft's nftables table,
    /// read once a second on a thread of its own, see `linux`).
    pub node_accounting: std::sync::atomic::AtomicBool,
    /// The node's per-peer counters, as last read (see `linux`).
    pub traffic: Mutex<Vec<PeerTraffic>>,
    /// Nodes: DNS queries by outcome (answered, dropped: not a query,
    /// limited: over the rate limits).
    pub dns_queries: Family<Labels, Counter>,
    /// Gateways: endpoint discovery datagrams by outcome (answered: an
    /// answer taken; ignored: from an address not probed, or with a nonce
    /// not sent; unanswered: a probe without an answer in time).
    pub discovery: Family<Labels, Counter>,
    /// Gateways of a relay site: the relayed tunnels' counters.
    pub relays: Mutex<Relayed>,
    /// Gateways: tunnels carried over TLS now (their UDP blocked), and
    /// moves onto TLS.
    pub over_tls: Gauge,
    pub tls_moves: Counter,
    /// A relay site's active gateway: its TLS port's counters.
    pub tls_front: Mutex<Option<Arc<crate::tls_relay::Counters>>>,
}

impl AgentMetrics {
    /// One datagram to the DNS responder: "answered", "dropped" or "limited".
    pub fn dns(&self, outcome: &str) {
        self.dns_queries
            .get_or_create(&vec![("outcome".to_string(), outcome.to_string())])
            .inc();
    }

    /// One endpoint discovery outcome: "answered", "ignored", "unanswered".
    pub fn discovery(&self, outcome: &str) {
        self.discovery
            .get_or_create(&vec![("outcome".to_string(), outcome.to_string())])
            .inc();
    }
}

fn duration_histogram() -> Histogram {
    Histogram::new(weft_common::obs::duration_buckets())
}

fn rtt_histogram() -> Histogram {
    // 50 µs to ~1.6 s.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.00005, 2.0, 16,
    ))
}

/// The process's metrics.
pub fn get() -> &'static AgentMetrics {
    static M: OnceLock<AgentMetrics> = OnceLock::new();
    M.get_or_init(|| {
        let mut r = Registry::default();
        let m = AgentMetrics {
            registry: Arc::new(Mutex::new(Registry::default())),
            reconcile: Family::new_with_constructor(duration_histogram),
            reconcile_errors: Counter::default(),
            drift_repairs: Counter::default(),
            applied_revision: Gauge::default(),
            connected: Gauge::default(),
            cert_expiry: Gauge::default(),
            rtt: Family::new_with_constructor(rtt_histogram),
            wireguard: Family::default(),
            tunnels: Mutex::new(Vec::new()),
            node_accounting: Default::default(),
            traffic: Mutex::new(Vec::new()),
            dns_queries: Family::default(),
            discovery: Family::default(),
            relays: Mutex::new(Vec::new()),
            over_tls: Gauge::default(),
            tls_moves: Counter::default(),
            tls_front: Mutex::new(None),
        };
        r.register(
            "weft_agent_reconcile_duration_seconds",
            "Time to apply a change of desired state (trigger: snapshot, delta, resync, startup; paths: a tunnel moved between UDP and TLS)",
            m.reconcile.clone(),
        );
        r.register(
            "weft_agent_reconcile_errors",
            "Objects that failed to apply",
            m.reconcile_errors.clone(),
        );
        r.register(
            "weft_agent_drift_repairs",
            "Host objects found missing at a resync and put back",
            m.drift_repairs.clone(),
        );
        r.register(
            "weft_agent_applied_revision",
            "Revision of the desired state applied",
            m.applied_revision.clone(),
        );
        r.register(
            "weft_agent_controller_connected",
            "1 while a watch stream to a controller is open",
            m.connected.clone(),
        );
        r.register(
            "weft_agent_certificate_expiry_timestamp_seconds",
            "When the agent's certificate expires (Unix time)",
            m.cert_expiry.clone(),
        );
        r.register(
            "weft_peering_rtt_seconds",
            "Round-trip time of answered tunnel probes",
            m.rtt.clone(),
        );
        r.register(
            "weft_gateway_wireguard_info",
            "The WireGuard carrying this gateway's tunnels (label mode: kernel or userspace); always 1",
            m.wireguard.clone(),
        );
        r.register(
            "weft_node_dns_queries",
            "Datagrams to the node's DNS responder by outcome (answered, dropped: not a query, limited: over the rate limits)",
            m.dns_queries.clone(),
        );
        r.register(
            "weft_gateway_discovery_datagrams",
            "Endpoint discovery by outcome (answered; ignored: a forged or stray answer; unanswered: a probe without answer)",
            m.discovery.clone(),
        );
        r.register(
            "weft_gateway_tunnels_over_tls",
            "Tunnels this gateway carries over TLS now, because no handshake came over UDP",
            m.over_tls.clone(),
        );
        r.register(
            "weft_gateway_tunnel_tls_fallbacks",
            "Times a tunnel of this gateway went over TLS because no handshake came over UDP",
            m.tls_moves.clone(),
        );
        r.register_collector(Box::new(Snapshot(|f: &mut Families| {
            let m = get();
            if let Some(c) = m.tls_front.lock().unwrap().as_ref() {
                tls_front_series(f, c);
            }
            for t in m.tunnels.lock().unwrap().iter() {
                weft_common::obs::tunnel_series(f, t, &[]);
            }
            relay_series(f, &m.relays.lock().unwrap());
            let traffic = if m.node_accounting.load(std::sync::atomic::Ordering::Relaxed) {
                m.traffic.lock().unwrap().clone()
            } else {
                Vec::new()
            };
            for p in &traffic {
                let family = match p.family {
                    weft_types::net::Family::V4 => "ipv4",
                    weft_types::net::Family::V6 => "ipv6",
                };
                let l = |dir| [("peer_site", p.peer_site.as_str()), ("direction", dir), ("family", family)];
                let help = "Bytes between this node and the peer's CIDRs, per family";
                f.counter("weft_node_peer_bytes", help, &l("tx"), p.tx_bytes);
                f.counter("weft_node_peer_bytes", help, &l("rx"), p.rx_bytes);
                let help = "Packets between this node and the peer's CIDRs, per family";
                f.counter("weft_node_peer_packets", help, &l("tx"), p.tx_packets);
                f.counter("weft_node_peer_packets", help, &l("rx"), p.rx_packets);
            }
        })));
        *m.registry.lock().unwrap() = r;
        m
    })
}

/// A relay gateway's TLS port's counters into the agent's metrics.
fn tls_front_series(f: &mut weft_common::obs::Families, c: &crate::tls_relay::Counters) {
    use std::sync::atomic::Ordering::Relaxed;
    f.counter(
        "weft_gateway_tls_relay_connections",
        "Connections this relay gateway's TLS port admitted (a tunnel's side whose UDP is blocked)",
        &[],
        c.connections.load(Relaxed),
    );
    f.counter(
        "weft_gateway_tls_relay_refused",
        "Connections this relay gateway's TLS port refused: no hello in time, or a UDP port it may not stand for",
        &[],
        c.refused.load(Relaxed),
    );
    for (dir, n) in [("in", &c.received[1]), ("out", &c.sent[1])] {
        f.counter(
            "weft_gateway_tls_relay_bytes",
            "Bytes of tunnels this relay gateway carried over TLS (in: from the connections)",
            &[("direction", dir)],
            n.load(Relaxed),
        );
    }
}

/// The running relays' counters (see `relay`): (site a, site b, counters).
pub type Relayed = Vec<(String, String, Arc<weft_dataplane::relay::Counters>)>;

/// The relays' counters into the agent's metrics.
fn relay_series(f: &mut weft_common::obs::Families, seen: &Relayed) {
    use std::sync::atomic::Ordering::Relaxed;
    for (a, b, c) in seen {
        for (i, (from, to)) in [(a, b), (b, a)].into_iter().enumerate() {
            let l = [("from_site", from.as_str()), ("to_site", to.as_str())];
            f.counter(
                "weft_gateway_relay_bytes",
                "Bytes this gateway relayed between two peer sites' gateways, still encrypted",
                &l,
                c.bytes[i].load(Relaxed),
            );
            f.counter(
                "weft_gateway_relay_packets",
                "Datagrams this gateway relayed between two peer sites' gateways",
                &l,
                c.packets[i].load(Relaxed),
            );
        }
        let l = |why| [("site_a", a.as_str()), ("site_b", b.as_str()), ("reason", why)];
        for (why, n) in [
            ("unknown_source", &c.unknown_source),
            ("no_peer", &c.no_peer),
            ("rate_limited", &c.rate_limited),
            ("send_failed", &c.send_failed),
            ("handshakes_limited", &c.handshakes_limited),
            ("replayed", &c.replayed),
        ] {
            f.counter(
                "weft_gateway_relay_dropped",
                "Datagrams a relayed tunnel dropped: from an address not learned (or a handshake not addressed to the other side), for a side not learned yet, over the rate limit, refused by the kernel, handshakes from addresses not learned over a side's budget, or replayed initiations",
                &l(why),
                n.load(Relaxed),
            );
        }
        f.counter(
            "weft_gateway_relay_ambiguous_answers",
            "Handshake responses a relayed tunnel could not tie to one sender: two addresses had sent initiations with that index (one guessed it); neither was learned",
            &[("site_a", a.as_str()), ("site_b", b.as_str())],
            c.ambiguous.load(Relaxed),
        );
    }
}
