//! Applying desired state to the host, behind one small trait so the
//! protocol and lifecycle can be tested without a kernel: `linux::Linux`
//! (the data plane, see `weft-dataplane`) on real hosts, [`DryRun`] (changes
//! nothing, prints what it would do) with `--dry-run`.

use std::collections::BTreeMap;
use std::net::IpAddr;

use weft_proto::v1 as pb;
use weft_proto::v1::desired_object::Kind;

/// The objects an agent holds, by id.
pub type Objects = BTreeMap<String, pb::DesiredObject>;

/// Where an apply looks on the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Where the desired state changed (the namespaces of what changed, and
    /// the agent's own): a change from the controller.
    Changed,
    /// Everywhere either state has something: a resync, or the stored
    /// state applied at start, which repair drift anywhere.
    Everything,
}

/// What differs between `applied` and `desired`: the objects new or
/// changed, and the ids no longer desired.
pub fn diff(applied: &Objects, desired: &Objects) -> (Vec<pb::DesiredObject>, Vec<String>) {
    let changed = desired
        .values()
        .filter(|o| applied.get(&o.id) != Some(*o))
        .cloned()
        .collect();
    let gone = applied
        .keys()
        .filter(|id| !desired.contains_key(*id))
        .cloned()
        .collect();
    (changed, gone)
}

#[async_trait::async_trait]
pub trait Applier: Send {
    /// Makes the host hold `desired`, the whole desired state, where this
    /// agent had applied `applied` (which says what it claimed: another
    /// agent's namespaces on the same host are not its own). Returns the
    /// objects that failed.
    async fn apply(&mut self, applied: &Objects, desired: &Objects, scope: Scope) -> Vec<pb::ObjectError>;

    /// Each tunnel's health, as its probe and WireGuard see it.
    fn tunnels(&mut self) -> Vec<pb::TunnelStatus> {
        Vec::new()
    }

    /// Kernel features that change what the controller renders ("geneve").
    fn features(&mut self) -> Vec<String> {
        Vec::new()
    }

    /// Signalled when a tunnel goes up or down, so the agent reports at once.
    fn tunnel_changes(&self) -> Option<std::sync::Arc<tokio::sync::Notify>> {
        None
    }

    /// Signalled when something this applier runs died (a userspace
    /// WireGuard device whose thread panicked): the agent resyncs at once,
    /// which makes it anew, instead of at its next resync.
    fn repairs(&self) -> Option<&'static tokio::sync::Notify> {
        None
    }

    /// How many host objects this applier created because they were
    /// missing; a resync that raises it repaired drift.
    fn writes(&self) -> u64 {
        0
    }

    /// Facts about the host for diagnosis: kernel features, host routes
    /// overlapping the peer CIDRs in `held`.
    async fn host_report(&mut self, _held: &Objects) -> pb::HostReport {
        pb::HostReport::default()
    }

    /// The host's own networking, for the guard (None: this applier has
    /// no host, as with --dry-run, which changes nothing; Some(Err): it
    /// could not be read, and why).
    async fn host_nets(&mut self) -> Option<Result<HostNets, String>> {
        None
    }
}

/// The host's own networking, as read from the agent's namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostNets {
    /// Addresses (with their prefix) on links that are not weft's, and the
    /// link: the host is attached to each one's network.
    pub connected: Vec<(ipnet::IpNet, String)>,
    /// Addresses the host reaches outside the fabric, each with what it is:
    /// the gateways of its main table, its resolvers.
    pub reached: Vec<(IpAddr, String)>,
}

impl HostNets {
    /// Reads the resolvers of a resolv.conf text.
    pub fn resolvers(resolv_conf: &str) -> Vec<(IpAddr, String)> {
        resolv_conf
            .lines()
            .filter_map(|l| {
                let mut w = l.split_whitespace();
                (w.next() == Some("nameserver")).then(|| w.next()).flatten()
            })
            .filter_map(|a| a.parse::<IpAddr>().ok())
            .map(|a| (a, "a resolver of the host (/etc/resolv.conf)".to_string()))
            .collect()
    }
}

/// One line describing an object, as an operator reads it.
pub fn describe(o: &pb::DesiredObject) -> String {
    match &o.kind {
        Some(Kind::Namespace(n)) => format!("netns {}", n.name),
        Some(Kind::Link(l)) => {
            let ns = if l.namespace.is_empty() {
                String::new()
            } else {
                format!(" netns {}", l.namespace)
            };
            let kind = match &l.kind {
                Some(pb::link::Kind::Vxlan(v)) => {
                    format!(
                        "vxlan id {} local {} remote {} dstport {}",
                        v.vni, v.local, v.remote, v.port
                    )
                }
                Some(pb::link::Kind::Geneve(g)) => format!("geneve id {} remote {}", g.vni, g.remote),
                Some(pb::link::Kind::Wireguard(w)) => format!("wireguard listen-port {}", w.listen_port),
                Some(pb::link::Kind::Veth(v)) => format!("veth peer {}", v.peer_name),
                Some(pb::link::Kind::Bridge(_)) => "bridge".into(),
                None => "?".into(),
            };
            format!("link {}{ns} type {kind} mtu {}", l.name, l.mtu)
        }
        Some(Kind::Address(a)) => format!("address {} dev {}", a.cidr, a.link),
        Some(Kind::Route(r)) => {
            let via = if r.gateway.is_empty() {
                String::new()
            } else {
                format!(" via {}", r.gateway)
            };
            format!("route {}{via} dev {} table {}", r.destination, r.device, r.table)
        }
        Some(Kind::Rule(r)) => {
            let from = if r.from.is_empty() {
                String::new()
            } else {
                format!(" from {}", r.from)
            };
            let to = if r.to.is_empty() {
                String::new()
            } else {
                format!(" to {}", r.to)
            };
            format!("rule priority {}{from}{to} lookup {}", r.priority, r.table)
        }
        Some(Kind::NatMap(n)) => format!("prefix NAT in {}: {} <-> {}", n.namespace, n.local_cidr, n.real_cidr),
        Some(Kind::WireguardPeer(p)) => {
            format!("wireguard peer {} on {} endpoint {}", p.public_key, p.link, p.endpoint)
        }
        Some(Kind::HostSnat(h)) => {
            format!(
                "source NAT of host traffic out {} to {} (not from {})",
                h.link,
                h.address,
                h.except.join(", ")
            )
        }
        Some(Kind::DnsRecord(r)) => format!(
            "DNS name {}.{} -> {}",
            r.name,
            r.site,
            [r.address.as_str(), r.address_v6.as_str()]
                .into_iter()
                .filter(|a| !a.is_empty())
                .collect::<Vec<_>>()
                .join(" ")
        ),
        Some(Kind::ExportMap(x)) => format!(
            "export in {}: {} from {} -> {}",
            x.namespace, x.external_address, x.tunnel, x.host_address
        ),
        Some(Kind::TunnelFilter(f)) => {
            let policy = if f.policed {
                let rules: Vec<String> = f
                    .exports
                    .iter()
                    .map(|r| match (r.protocol.as_str(), r.first_port, r.last_port) {
                        ("", ..) => r.cidr.clone(),
                        (p, 0, _) => format!("{} {p}", r.cidr),
                        (p, a, b) if a == b => format!("{} {p}/{a}", r.cidr),
                        (p, a, b) => format!("{} {p}/{a}-{b}", r.cidr),
                    })
                    .collect();
                format!(
                    "; export policy: {}",
                    if rules.is_empty() {
                        "nothing".into()
                    } else {
                        rules.join(", ")
                    }
                )
            } else {
                String::new()
            };
            format!(
                "filter in {}: from {} forward only to {}{policy}",
                f.namespace,
                f.tunnel,
                f.allowed.join(", ")
            )
        }
        Some(Kind::RelaySession(r)) => {
            let side = |s: &Option<pb::RelaySide>| s.as_ref().map(|s| format!("{} (port {})", s.site, s.port));
            format!(
                "relay between {} and {}",
                side(&r.a).unwrap_or_default(),
                side(&r.b).unwrap_or_default()
            )
        }
        Some(Kind::LanAddress(_)) => "the LAN address (--lan-address), as the active gateway".into(),
        None => "(empty object)".into(),
    }
}

/// Changes nothing; prints and records what it would do.
#[derive(Debug, Default)]
pub struct DryRun {
    /// Every line printed, for tests.
    pub log: Vec<String>,
}

#[async_trait::async_trait]
impl Applier for DryRun {
    async fn apply(&mut self, applied: &Objects, desired: &Objects, _: Scope) -> Vec<pb::ObjectError> {
        let (changed, gone) = diff(applied, desired);
        for o in &changed {
            let verb = if applied.contains_key(&o.id) {
                "update"
            } else {
                "create"
            };
            self.log.push(format!("would {verb} {} [{}]", describe(o), o.id));
        }
        for id in &gone {
            if let Some(o) = applied.get(id) {
                self.log.push(format!("would delete {} [{id}]", describe(o)));
            }
        }
        for line in &self.log {
            println!("{line}");
        }
        self.log.clear();
        Vec::new()
    }
}
