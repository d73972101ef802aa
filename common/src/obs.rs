//! Observability shared by every weft binary: logging set-up (human or JSON
//! lines) and a Prometheus `/metrics` endpoint.
//!
//! Metrics come from a `prometheus_client` registry: live instruments
//! (counters, histograms the binary updates as it works) plus [`Snapshot`]
//! collectors, which read state the binary already keeps (tunnel health,
//! connected agents) at scrape time, so those series are never stale.

#[cfg(feature = "net")]
use std::net::SocketAddr;
#[cfg(feature = "net")]
use std::sync::Arc;
use std::sync::Mutex;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

/// Sets up `tracing` on stderr, filtered by `WEFT_LOG` (default `info`):
/// human lines, or one JSON object per line with every field (ids included)
/// as its own key.
pub fn init_logging(format: LogFormat) {
    let json = format == LogFormat::Json;
    // defguard_wireguard_rs logs every netlink reply at trace level, the
    // private key of a device read included: never below info, whatever
    // WEFT_LOG asks (its directives for that crate, or any of its modules,
    // are dropped; the global level does not reach past the one added).
    let asked = std::env::var("WEFT_LOG").unwrap_or_else(|_| "info".into());
    let kept: Vec<&str> = asked
        .split(',')
        .filter(|d| !d.trim().starts_with("defguard_wireguard_rs"))
        .collect();
    let filter = tracing_subscriber::EnvFilter::try_new(kept.join(","))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let filter = match "defguard_wireguard_rs=info".parse() {
        Ok(d) => filter.add_directive(d),
        Err(_) => filter,
    };
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(!json && std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if json {
        b.json().with_current_span(true).init();
    } else {
        b.init();
    }
}

/// Log line format, as the `--log-format` flag (and the controller's
/// `log_format` field) of every binary takes it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Human,
    Json,
}

/// Series gathered at scrape time.
#[derive(Debug, Default)]
pub struct Families {
    families: Vec<Family>,
}

#[derive(Debug)]
struct Family {
    name: String,
    help: String,
    kind: MetricType,
    samples: Vec<(Vec<(String, String)>, f64)>,
}

impl Families {
    fn add(&mut self, kind: MetricType, name: &str, help: &str, labels: &[(&str, &str)], v: f64) {
        let labels = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        match self.families.iter_mut().find(|f| f.name == name) {
            Some(f) => f.samples.push((labels, v)),
            None => self.families.push(Family {
                name: name.to_string(),
                help: help.to_string(),
                kind,
                samples: vec![(labels, v)],
            }),
        }
    }

    /// A gauge sample.
    pub fn gauge(&mut self, name: &str, help: &str, labels: &[(&str, &str)], v: f64) {
        self.add(MetricType::Gauge, name, help, labels, v);
    }

    /// A counter sample; `name` without `_total`, which the encoder adds.
    pub fn counter(&mut self, name: &str, help: &str, labels: &[(&str, &str)], v: u64) {
        self.add(MetricType::Counter, name, help, labels, v as f64);
    }
}

/// A collector that asks a closure for its series on each scrape.
pub struct Snapshot<F>(pub F);

impl<F> std::fmt::Debug for Snapshot<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Snapshot")
    }
}

impl<F: Fn(&mut Families) + Send + Sync + 'static> Collector for Snapshot<F> {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut all = Families::default();
        (self.0)(&mut all);
        for f in &all.families {
            let mut m = encoder.encode_descriptor(&f.name, &f.help, None, f.kind)?;
            for (labels, v) in &f.samples {
                let fam = m.encode_family(labels)?;
                match f.kind {
                    MetricType::Counter => ConstCounter::new(*v as u64).encode(fam)?,
                    _ => ConstGauge::new(*v).encode(fam)?,
                }
            }
        }
        Ok(())
    }
}

/// The text exposition of a registry.
pub fn render(registry: &Mutex<Registry>) -> String {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry.lock().unwrap())
        .expect("writing to a String cannot fail");
    out
}

#[cfg(feature = "net")]
/// Binds `addr` now (so a taken port is an error at start) and serves
/// `GET /metrics` from `registry` until the process ends. Other paths
/// answer 404; `/healthz` answers 200 while the process runs.
pub async fn serve_metrics(addr: SocketAddr, registry: Arc<Mutex<Registry>>) -> std::io::Result<SocketAddr> {
    use http_body_util::Full;
    use hyper::body::Bytes;
    use hyper::{Response, StatusCode};

    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    crate::task::spawn_critical("metrics-listener", async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors and the like: wait instead of spinning.
                    tracing::warn!(error = %e, "metrics listener cannot accept");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            let registry = registry.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let registry = registry.clone();
                    async move {
                        let (status, ctype, body) = match req.uri().path() {
                            "/metrics" => (
                                StatusCode::OK,
                                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                                render(&registry),
                            ),
                            "/healthz" => (StatusCode::OK, "text/plain", "ok\n".to_string()),
                            _ => (StatusCode::NOT_FOUND, "text/plain", "try /metrics\n".to_string()),
                        };
                        Response::builder()
                            .status(status)
                            .header("content-type", ctype)
                            .body(Full::new(Bytes::from(body)))
                    }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, svc)
                    .await;
            });
        }
    });
    tracing::info!(address = %bound, "serving metrics on /metrics");
    Ok(bound)
}

/// Buckets for durations from 100 µs to ~100 s.
pub fn duration_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.0001, 4.0, 11)
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// The series of one tunnel, labelled by peer site (and `extra`, e.g. the
/// reporting gateway on the controller).
pub fn tunnel_series(f: &mut Families, t: &weft_proto::v1::TunnelStatus, extra: &[(&str, &str)]) {
    let mut l: Vec<(&str, &str)> = vec![("peer_site", t.peer_site.as_str())];
    l.extend_from_slice(extra);
    f.gauge(
        "weft_peering_up",
        "1 while the tunnel's probes are answered",
        &l,
        f64::from(u8::from(t.up)),
    );
    f.counter(
        "weft_peering_receive_bytes",
        "Bytes received through the tunnel",
        &l,
        t.rx_bytes,
    );
    f.counter(
        "weft_peering_transmit_bytes",
        "Bytes sent through the tunnel",
        &l,
        t.tx_bytes,
    );
    f.counter(
        "weft_peering_rejected_datagrams",
        "Datagrams weft's userspace WireGuard device refused from the network: malformed, failing authentication, replayed, or from a source the peer may not use",
        &l,
        t.rx_rejected,
    );
    f.gauge(
        "weft_peering_over_tls",
        "1 while the gateway carries the tunnel over TLS on TCP to a relay site's gateway (no handshake answered over UDP)",
        &l,
        f64::from(u8::from(t.over_tls)),
    );
    f.counter(
        "weft_peering_primed_handshakes",
        "Handshakes weft's userspace WireGuard device sent with the punch TTL: a hole-punched tunnel's first ones, which open this gateway's NAT and die before the peer's",
        &l,
        t.primed_handshakes,
    );
    f.counter(
        "weft_peering_device_restarts",
        "Times weft's userspace WireGuard device for the tunnel died (a thread of it panicked) and was made anew since the agent started",
        &l,
        t.device_restarts,
    );
    for o in &t.offloads {
        let mut lo = l.clone();
        lo.push(("offload", o.as_str()));
        f.gauge(
            "weft_peering_offload",
            "1 for each kernel offload weft's userspace WireGuard device runs with (tso, uso: the tun's; gso, gro: UDP's)",
            &lo,
            1.0,
        );
    }
    f.counter(
        "weft_peering_dropped_packets",
        "Packets from the peer dropped at the peering's namespace: addressed to anything but this site's networks",
        &l,
        t.dropped_from_tunnel,
    );
    f.counter(
        "weft_peering_policy_dropped_packets",
        "Packets from the peer that this site's export policy for the peering refused",
        &l,
        t.dropped_by_policy,
    );
    for c in &t.transit {
        let mut lt = l.clone();
        lt.push(("to_site", c.site.as_str()));
        f.counter(
            "weft_peering_transit_packets",
            "Packets from the peer that this site forwarded onward to another peer (transit), by the site they went to",
            &lt,
            c.packets,
        );
    }
    f.counter(
        "weft_peering_receive_packets",
        "Packets received through the tunnel",
        &l,
        t.rx_packets,
    );
    f.counter(
        "weft_peering_transmit_packets",
        "Packets sent through the tunnel",
        &l,
        t.tx_packets,
    );
    f.counter("weft_peering_probes", "Tunnel probes sent", &l, t.probes_sent);
    f.counter(
        "weft_peering_probes_lost",
        "Tunnel probes unanswered",
        &l,
        t.probes_lost,
    );
    f.gauge(
        "weft_peering_last_rtt_seconds",
        "Round-trip time of the latest answered probe",
        &l,
        t.rtt_micros as f64 / 1e6,
    );
    if let Some(h) = &t.last_handshake {
        f.gauge(
            "weft_peering_handshake_age_seconds",
            "Seconds since the latest WireGuard handshake",
            &l,
            (unix_now() - h.seconds as f64).max(0.0),
        );
    }
    if t.mtu > 0 {
        f.gauge(
            "weft_peering_mtu_bytes",
            "MTU of the tunnel interface",
            &l,
            f64::from(t.mtu),
        );
    }
    if let Some(p) = &t.path_mtu {
        let ok = match p.result.as_str() {
            "ok" => 1.0,
            "too_big" | "unanswered" => 0.0,
            _ => -1.0,
        };
        f.gauge(
            "weft_peering_path_mtu_ok",
            "1: a full tunnel packet crosses the underlay unfragmented; 0: it does not; -1: not checked",
            &l,
            ok,
        );
    }
}
