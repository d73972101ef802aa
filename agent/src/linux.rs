//! The Linux applier: the data plane (`weft-dataplane`: observe, plan,
//! execute) plus what an agent adds around it: a health probe per tunnel,
//! per-peer traffic counters for the metrics, and the facts about the host
//! it reports to its controller.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use weft_dataplane::DataPlane;
use weft_dataplane::desired::decode::WireguardLink;
use weft_dataplane::desired::{LinkSpec, Object};
use weft_dataplane::driver::Driver;
use weft_dataplane::kernel::Kernel;
use weft_dataplane::linux::LinuxNetlink;
use weft_dataplane::nft::Nft;
use weft_dataplane::userspace::Userspace;
use weft_proto::v1 as pb;

use crate::apply::{Applier, Objects, Scope};
use crate::desired::Held;

pub use weft_dataplane::kernel::probe as kernel_wireguard_probe;
pub use weft_dataplane::linux::{kernel_has_geneve, kernel_link_kinds};

use crate::config::WireguardChoice;

mod tls;

type Plane = DataPlane<LinuxNetlink, Nft, Driver>;

pub struct Linux {
    plane: Plane,
    /// A health probe per WireGuard link, by link name.
    probes: HashMap<String, (crate::probe::Target, crate::probe::Prober)>,
    /// Endpoint discovery for the WireGuard links.
    discovery: Option<crate::discovery::Discovery>,
    /// This agent's controllers (host:port), a reflector for every tunnel.
    own_reflectors: Vec<String>,
    /// Discovery could not start (said once).
    discovery_off: bool,
    probe_config: crate::probe::ProbeConfig,
    /// Signalled when a tunnel goes up or down.
    tunnel_changed: Arc<tokio::sync::Notify>,
    /// Link kinds the kernel can make, once found out.
    kinds: Option<Vec<String>>,
    /// Operations carried out by this process; a resync that raises it
    /// repaired drift.
    writes: u64,
    /// Whether the per-peer counters are being read (nodes, once they count).
    counting: bool,
    /// Gateways: the WireGuard chosen at start, and why.
    wireguard: Option<WireguardChoice>,
    /// Gateways of a relay site: the relayed tunnels.
    relays: crate::relay::Relays,
    /// Gateways: the LAN address held while active (`--lan-address`).
    lan: Option<ipnet::Ipv4Net>,
    /// Gateways: which way the tunnels that may fall back to TLS go.
    paths: crate::fallback::Paths,
    /// A relay site's active gateway: its TLS port.
    front: Option<crate::tls_relay::Front>,
    /// Gateways: the direct address tried beside a relay, by link
    /// (`WireguardPeer.direct`), to tell when the tunnel went there.
    beside: HashMap<String, std::net::SocketAddr>,
}

impl std::fmt::Debug for Linux {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Linux")
    }
}

impl Linux {
    /// Opens a netlink connection in the current namespace. Must run inside
    /// a tokio runtime. `wg_private_key`: the gateway's (None on nodes);
    /// `wireguard`: the gateway's choice (None: userspace, which on nodes
    /// and in a teardown runs no device).
    pub fn new(
        wg_private_key: Option<weft_types::WgSecret>,
        wireguard: Option<WireguardChoice>,
    ) -> std::io::Result<Linux> {
        let net = LinuxNetlink::new()?;
        let node = wg_private_key.is_none();
        let wg =
            if wireguard.as_ref().is_some_and(|c| c.kernel) {
                Driver::Kernel(Kernel::new(net.handle().clone(), wg_private_key.as_ref()).map_err(|e| {
                    std::io::Error::new(std::io::ErrorKind::InvalidData, format!("the WireGuard key: {e}"))
                })?)
            } else {
                let options = wireguard.as_ref().map(|c| c.userspace.clone()).unwrap_or_default();
                Driver::Userspace(Userspace::new(net.handle().clone(), wg_private_key, options))
            };
        Ok(Linux {
            plane: DataPlane {
                net,
                fw: Nft::default(),
                wg,
                node,
                underlay: None,
                believed: None,
            },
            probes: Default::default(),
            discovery: None,
            own_reflectors: Vec::new(),
            discovery_off: false,
            probe_config: Default::default(),
            tunnel_changed: Default::default(),
            kinds: None,
            writes: 0,
            counting: false,
            wireguard,
            relays: Default::default(),
            lan: None,
            paths: Default::default(),
            front: None,
            beside: HashMap::new(),
        })
    }

    /// Sets the LAN address this gateway holds while it is the active one.
    pub fn with_lan_address(mut self, lan: Option<ipnet::Ipv4Net>) -> Linux {
        self.lan = lan;
        self
    }

    /// Sets the underlay address that links without a rendered MTU are
    /// sized from.
    pub fn with_underlay(mut self, ip: Option<IpAddr>) -> Linux {
        self.plane.underlay = ip;
        self
    }

    /// Sets this agent's controllers (https://host:port), which every
    /// tunnel's endpoint discovery also asks.
    pub fn with_controllers(mut self, controllers: &[String]) -> Linux {
        self.own_reflectors = controllers
            .iter()
            .map(|c| c.trim_start_matches("https://").trim_end_matches('/').to_string())
            .collect();
        self
    }

    /// Keeps endpoint discovery running for WireGuard link `l` (started
    /// with the first tunnel; without a raw socket, said once, and tunnels
    /// work as before: a peer with an endpoint serves them).
    fn ensure_discovery(&mut self, name: &str, w: &WireguardLink) {
        let port = w.listen_port;
        if self.discovery.is_none() && !self.discovery_off {
            let notify = self.tunnel_changed.clone();
            match crate::discovery::Discovery::start(move || notify.notify_one()) {
                Ok(d) => self.discovery = Some(d),
                Err(e) => {
                    self.discovery_off = true;
                    tracing::warn!(error = %e, "no endpoint discovery: peers behind NAT cannot hole-punch to this gateway");
                }
            }
        }
        // This site's own controllers first: a peer's list must not crowd
        // them out.
        let mut reflectors = self.own_reflectors.clone();
        let own = reflectors.len();
        reflectors.extend(w.reflectors.iter().cloned());
        if let Some(d) = &self.discovery {
            d.set(
                name,
                crate::discovery::Target {
                    port,
                    reflectors,
                    own,
                    underlay: self.plane.underlay,
                },
            );
        }
    }

    /// On a gateway: the relayed tunnels (a relay site's), and the LAN
    /// address while this gateway is the active one.
    async fn relays_and_lan(&mut self, fin: &Objects) -> Vec<pb::ObjectError> {
        let mut errors = Vec::new();
        let sessions: Vec<_> = fin
            .iter()
            .filter_map(|(id, o)| match o.object()? {
                Object::RelaySession(r) => Some((id.clone(), r.clone())),
                _ => None,
            })
            .collect();
        for (id, message) in self.relays.set(&sessions) {
            tracing::warn!(object = %id, error = %message, "not applied");
            errors.push(pb::ObjectError { id, message });
        }
        errors.extend(self.tls_front(fin));
        // The LAN address, held while this gateway is the active one
        // (checked on every apply and resync: one taken away by hand
        // comes back, and is announced again).
        if let Some(lan) = self.lan {
            let active = fin.values().find(|o| matches!(o.object(), Some(Object::LanAddress)));
            match weft_dataplane::lan::hold(self.plane.net.handle(), lan, active.is_some()).await {
                Ok(Some(link)) => weft_dataplane::lan::announce(link, lan.addr()),
                Ok(None) => {}
                Err(message) => {
                    tracing::warn!(error = %message, "the LAN address");
                    if let Some(o) = active {
                        errors.push(pb::ObjectError {
                            id: o.id().to_string(),
                            message,
                        });
                    }
                }
            }
        }
        errors
    }

    /// Probes and endpoint discovery follow the WireGuard links held.
    fn follow_tunnels(&mut self, fin: &Objects, out: &weft_dataplane::Outcome) -> Vec<pb::ObjectError> {
        let mut errors = Vec::new();
        // (id, namespace, rendered MTU, the link) by name.
        let links: BTreeMap<&str, (&str, &str, u32, &WireguardLink)> = fin
            .iter()
            .filter_map(|(id, o)| match o.object()? {
                Object::Link(l) => match &l.kind {
                    LinkSpec::Wireguard(w) => Some((l.name.as_str(), (id.as_str(), l.ns.as_str(), l.mtu, w))),
                    _ => None,
                },
                _ => None,
            })
            .collect();
        self.probes.retain(|name, _| links.contains_key(name.as_str()));
        if let Some(d) = &self.discovery {
            d.retain(|name| links.contains_key(name));
        }
        for (name, (id, ns, rendered_mtu, w)) in &links {
            let present = self.plane.wg.has(name);
            if !present {
                continue;
            }
            let mtu = out.mtus.get(*name).copied().unwrap_or(*rendered_mtu);
            self.ensure_discovery(name, w);
            if let Err(e) = self.ensure_probe(ns, name, w, mtu, out.fresh_wireguard.contains(*name)) {
                errors.push(pb::ObjectError {
                    id: id.to_string(),
                    message: e,
                });
            }
        }
        errors
    }

    /// Sets the health probes' interval and miss threshold (for tunnels
    /// created from now on).
    pub fn with_probes(mut self, c: crate::probe::ProbeConfig) -> Linux {
        self.probe_config = c;
        self
    }

    /// Keeps a prober running toward the far end of WireGuard link `l` (a
    /// new one when the device was made anew, since the old socket's
    /// address went with it).
    fn ensure_probe(&mut self, ns: &str, name: &str, w: &WireguardLink, mtu: u32, fresh: bool) -> Result<(), String> {
        // The probe runs over IPv4 link-local addresses.
        let (IpNet::V4(local), peer) = w.probe else {
            self.probes.remove(name);
            return Ok(());
        };
        let target = crate::probe::Target {
            ns: ns.to_string(),
            link: name.to_string(),
            site: w.peer_site.clone(),
            local: local.addr(),
            peer,
            mtu,
        };
        let same = self
            .probes
            .get(name)
            .is_some_and(|(t, p)| *t == target && p.config == self.probe_config);
        if same && !fresh {
            return Ok(());
        }
        self.probes.remove(name);
        let notify = self.tunnel_changed.clone();
        let prober = crate::probe::start(target.clone(), self.probe_config, move || notify.notify_one())?;
        self.probes.insert(name.to_string(), (target, prober));
        Ok(())
    }
}

/// Reads the node's per-peer counters on a thread of its own, every second
/// (the metrics serve the latest; never `nft` per scrape).
fn start_counting() {
    let spawned = std::thread::Builder::new().name("weft-counters".into()).spawn(|| {
        loop {
            let traffic = weft_dataplane::nft::counters_blocking().unwrap_or_default();
            *crate::metrics::get().traffic.lock().unwrap() = traffic;
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
    });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "per-peer traffic is not counted");
    }
}

#[async_trait::async_trait]
impl Applier for Linux {
    async fn apply(&mut self, applied: &Objects, desired: &Objects, scope: Scope) -> Vec<pb::ObjectError> {
        let fin = desired;
        let (changed, gone) = crate::apply::diff(applied, desired);
        // A change looks at the namespaces it touches, and always at the
        // agent's own; a resync at every namespace either state has.
        let scopes = (scope == Scope::Changed).then(|| {
            let gone = gone.iter().filter_map(|id| applied.get(id));
            weft_dataplane::namespaces_of(changed.iter().copied().chain(gone).filter_map(Held::object))
        });
        let claimed = weft_dataplane::namespaces_of(applied.values().filter_map(Held::object));
        let started = std::time::Instant::now();
        // Tunnels carried over TLS: their endpoint is the carrier's.
        let mut objects = self
            .paths
            .rewrite(fin.iter().filter_map(|(id, o)| Some((id.as_str(), o.object()?))));
        self.beside = objects
            .iter()
            .filter_map(|(_, o)| match o.as_ref() {
                Object::WireguardPeer { link, peer, .. } => Some((link.clone(), peer.direct?)),
                _ => None,
            })
            .collect();
        // Kernel WireGuard cannot try a direct path beside a relay (its
        // gateway does not say it can, so none should come): the relay
        // only.
        if self.wireguard.as_ref().is_some_and(|c| c.kernel) {
            for (_, o) in objects.iter_mut() {
                if let Object::WireguardPeer {
                    ns,
                    link,
                    peer,
                    tls_port,
                } = o.as_ref()
                    && peer.direct.is_some()
                {
                    *o = std::borrow::Cow::Owned(Object::WireguardPeer {
                        ns: ns.clone(),
                        link: link.clone(),
                        peer: peer.without_beside(),
                        tls_port: *tls_port,
                    });
                }
            }
        }
        let objects = objects.iter().map(|(id, o)| (*id, o.as_ref()));
        let mut out = self.plane.reconcile(objects, &claimed, scopes.as_ref()).await;
        let reconciled = started.elapsed();
        self.writes += out.done;
        if let Some(e) = out.failed.take() {
            tracing::warn!(error = %e, "nothing applied");
            // Everything this apply was to change failed (a resync: all).
            let ids = match scope {
                Scope::Changed => changed
                    .iter()
                    .map(|o| o.id().to_string())
                    .chain(gone)
                    .collect::<Vec<_>>(),
                Scope::Everything => desired.keys().cloned().collect(),
            };
            return ids
                .into_iter()
                .map(|id| pb::ObjectError { id, message: e.clone() })
                .collect();
        }
        let mut errors: Vec<pb::ObjectError> = std::mem::take(&mut out.errors)
            .into_iter()
            .map(|(id, message)| {
                tracing::warn!(object = %id, error = %message, "not applied");
                pb::ObjectError { id, message }
            })
            .collect();
        if !self.plane.node {
            errors.extend(self.relays_and_lan(fin).await);
        }
        errors.extend(self.follow_tunnels(fin, &out));
        // Probe at once through every tunnel whose peers changed, now that
        // all of them are set: the probe makes boringtun handshake with a
        // re-added peer.
        for link in &out.peers_changed {
            if let Some((_, prober)) = self.probes.get(link) {
                prober.kick();
            }
        }
        tracing::debug!(
            reconcile_ms = reconciled.as_millis() as u64,
            after_ms = started.elapsed().saturating_sub(reconciled).as_millis() as u64,
            "applied: the data plane, then relays, LAN address and probes"
        );
        if self.plane.node && !self.counting {
            self.counting = true;
            crate::metrics::get()
                .node_accounting
                .store(true, std::sync::atomic::Ordering::Relaxed);
            start_counting();
        }
        errors
    }

    fn tunnels(&mut self) -> Vec<pb::TunnelStatus> {
        let mut out = Vec::new();
        for (link, (target, prober)) in &self.probes {
            let h = prober.health.lock().unwrap().clone();
            let stats = self.plane.wg.stats(link);
            // (An IPv4 peer on a dual-stack socket is ::ffff:a.b.c.d.) Over
            // TLS the endpoint is the carrier's, on loopback: TCP carries
            // the datagrams, no path MTU to check.
            if let Some(ep) = stats.endpoint.filter(|e| !e.ip().to_canonical().is_loopback()) {
                *prober.mtu_target.lock().unwrap() = Some(ep.ip().to_canonical());
            }
            let found = self.discovery.as_ref().and_then(|d| d.found(link)).unwrap_or_default();
            out.push(pb::TunnelStatus {
                candidates: found.candidates,
                nat: found.nat,
                path: String::new(),
                rx_packets: h.packets.0,
                dropped_from_tunnel: h.dropped.get(),
                dropped_by_policy: h.refused.get(),
                transit: h
                    .transit
                    .iter()
                    .map(|(site, t)| pb::TransitCount {
                        site: site.clone(),
                        packets: t.get(),
                    })
                    .collect(),
                tx_packets: h.packets.1,
                mtu: target.mtu,
                path_mtu: h.path_mtu.clone(),
                peer_site: target.site.clone(),
                link: link.clone(),
                up: h.up,
                rtt_micros: h.rtt.map_or(0, |r| r.as_micros() as u64),
                probes_sent: h.sent,
                probes_lost: h.lost,
                last_handshake: stats.last_handshake_unix.map(|s| prost_types::Timestamp {
                    seconds: s as i64,
                    nanos: 0,
                }),
                rx_bytes: stats.rx_bytes,
                tx_bytes: stats.tx_bytes,
                rx_rejected: stats.rx_rejected,
                primed_handshakes: stats.primed_handshakes,
                over_tls: self.paths.over_tls(link),
                on_direct: self.beside.get(link).is_some_and(|d| stats.endpoint == Some(*d)),
                device_restarts: stats.device_restarts,
                device_failure: stats.device_failure.clone(),
                // "none": the userspace device without offloads (kernel
                // WireGuard reports no list).
                offloads: stats
                    .offloads
                    .map(|o| match o.names() {
                        n if n.is_empty() => vec!["none".to_string()],
                        n => n.into_iter().map(String::from).collect(),
                    })
                    .unwrap_or_default(),
                gateway: String::new(),
                reported_at: None,
            });
        }
        out.sort_by(|a, b| a.peer_site.cmp(&b.peer_site));
        out
    }

    fn tunnel_changes(&self) -> Option<Arc<tokio::sync::Notify>> {
        Some(self.tunnel_changed.clone())
    }

    fn repairs(&self) -> Option<&'static tokio::sync::Notify> {
        Some(weft_dataplane::userspace::deaths())
    }

    fn step_paths(&mut self) -> bool {
        self.step_tls_paths()
    }

    fn features(&mut self) -> Vec<String> {
        // Found out once, on a thread of its own (see kernel_link_kinds); the
        // worker hands its other tasks on while it waits.
        let kinds = self
            .kinds
            .get_or_insert_with(|| weft_dataplane::blocking(kernel_link_kinds));
        let mut out: Vec<String> = kinds.iter().filter(|k| *k == "geneve").cloned().collect();
        // A gateway on weft's userspace device tries a punch beside a relay.
        if !self.plane.node && !self.wireguard.as_ref().is_some_and(|c| c.kernel) {
            out.push(weft_proto::PUNCH_BESIDE_FEATURE.into());
        }
        out
    }

    fn writes(&self) -> u64 {
        self.writes
    }

    async fn host_nets(&mut self) -> Option<Result<crate::apply::HostNets, String>> {
        use weft_dataplane::Netlink;
        let raw = match self.plane.net.read(&String::new()).await {
            Ok(raw) => raw,
            Err(e) => return Some(Err(format!("{e:#}"))),
        };
        let theirs = |link: &str| !weft_dataplane::model::owns_link(link);
        let mut host = crate::apply::HostNets {
            connected: raw
                .addresses
                .iter()
                .filter(|a| theirs(&a.link))
                .map(|a| (a.cidr, a.link.clone()))
                .collect(),
            reached: Vec::new(),
        };
        // IPv6 networks on the host's links that no address of it names
        // (a /128 from DHCPv6 beside a prefix routed on-link by router
        // advertisements): the host reaches their hosts directly too.
        // (IPv4's on-link routes without an address, such as a zeroconf
        // 169.254.0.0/16, are left out: weft's veths take /30s there.)
        for r in raw.routes.iter().filter(|r| !r.special).map(|r| &r.route) {
            if r.gateway.is_none()
                && r.dst.addr().is_ipv6()
                && r.dst.prefix_len() > 0
                && r.table != weft_proto::HOST_TABLE
                && r.dev.as_deref().is_some_and(theirs)
                && weft_types::net::special_use(r.dst).is_none()
            {
                host.connected.push((r.dst, r.dev.clone().unwrap_or_default()));
            }
        }
        // Gateways of every table but weft's own (policy routing sends
        // traffic through tables other than main too).
        for r in raw.routes.iter().filter(|r| !r.special).map(|r| &r.route) {
            if let Some(g) = r.gateway
                && r.table != weft_proto::HOST_TABLE
                && r.dev.as_deref().is_none_or(theirs)
            {
                let table = if r.table == 254 {
                    "main".to_string()
                } else {
                    r.table.to_string()
                };
                host.reached
                    .push((g, format!("a gateway of the host's table {table} ({} via {g})", r.dst)));
            }
        }
        // With systemd-resolved, /etc/resolv.conf names its stub and the
        // upstream resolvers are in the second file.
        for f in ["/etc/resolv.conf", "/run/systemd/resolve/resolv.conf"] {
            if let Ok(text) = std::fs::read_to_string(f) {
                host.reached.extend(crate::apply::HostNets::resolvers(&text));
            }
        }
        Some(Ok(host))
    }

    async fn host_report(&mut self, held: &Objects) -> pb::HostReport {
        use weft_dataplane::Netlink;
        if self.kinds.is_none() {
            self.kinds = Some(tokio::task::spawn_blocking(kernel_link_kinds).await.unwrap_or_default());
        }
        let features = self.kinds.clone().unwrap_or_default();
        let views = weft_dataplane::desired::peer_views(held.values().filter_map(Held::object));
        let mut conflicts = Vec::new();
        let raw = self.plane.net.read(&String::new()).await.unwrap_or_default();
        for r in raw.routes.iter().map(|r| &r.route) {
            // The default route overlaps everything by design; weft's own
            // links are weft's business.
            let dev = r.dev.clone().unwrap_or_default();
            if r.table != 254 || r.dst.prefix_len() == 0 || dev.starts_with("weft") {
                continue;
            }
            for (site, nets) in &views {
                for v in nets
                    .iter()
                    .filter(|v| v.contains(&r.dst.network()) || r.dst.contains(&v.network()))
                {
                    conflicts.push(format!("{} dev {dev} overlaps {site}'s {v}", r.dst));
                }
            }
        }
        let (wireguard, wireguard_reason) = match &self.wireguard {
            Some(c) => (c.mode().to_string(), c.reason.clone()),
            None => Default::default(),
        };
        pb::HostReport {
            features,
            route_conflicts: conflicts,
            wireguard,
            wireguard_reason,
            version: env!("CARGO_PKG_VERSION").into(),
        }
    }
}
