//! Applying desired state to the host, behind one small trait so the
//! protocol and lifecycle can be tested without a kernel: `linux::Linux`
//! (the data plane, see `weft-dataplane`) on real hosts, [`DryRun`] (changes
//! nothing, prints what it would do) with `--dry-run`.

use std::net::IpAddr;

use weft_proto::v1 as pb;

use crate::desired::Held;
pub use crate::desired::Objects;

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
pub fn diff<'a>(applied: &Objects, desired: &'a Objects) -> (Vec<&'a Held>, Vec<String>) {
    let changed = desired.values().filter(|o| applied.get(o.id()) != Some(*o)).collect();
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

    /// Looks at the tunnels that may go over TLS where UDP does not work;
    /// true when one changed its way (the agent then resyncs).
    fn step_paths(&mut self) -> bool {
        false
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
            let verb = if applied.contains_key(o.id()) {
                "update"
            } else {
                "create"
            };
            self.log.push(format!("would {verb} {} [{}]", o.describe(), o.id()));
        }
        for id in &gone {
            if let Some(o) = applied.get(id) {
                self.log.push(format!("would delete {} [{id}]", o.describe()));
            }
        }
        for line in &self.log {
            println!("{line}");
        }
        self.log.clear();
        Vec::new()
    }
}
