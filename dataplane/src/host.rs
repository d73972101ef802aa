//! The seams below the planner: netlink, the firewall and WireGuard
//! devices, as traits (Linux implements them in `linux`, `nft` and
//! `wireguard`; tests use `fake::FakeHost`), and the two generic steps on
//! top of them: observe a host, execute a plan.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::model::*;
use crate::plan::Op;

pub type R<T> = Result<T, String>;

/// Links, addresses, routes, rules and sysctls, per namespace.
#[async_trait::async_trait]
pub trait Netlink: Send {
    /// The namespaces under /run/netns (weft's or not).
    async fn namespaces(&mut self) -> R<BTreeSet<Ns>>;
    /// Everything IPv4 namespace `ns` holds ("" is the agent's own); the
    /// `tables` are left empty (the firewall's).
    async fn read(&mut self, ns: &Ns) -> R<RawNs>;
    /// Runs `ops`, all of them netlink operations in namespace `ns` (see
    /// [`Op::ns`]), in order; one result each.
    async fn apply(&mut self, ns: &Ns, ops: &[Op]) -> Vec<R<()>>;
}

/// weft's nftables table per namespace.
#[async_trait::async_trait]
pub trait Firewall: Send {
    /// The tables of family ip in `ns` by name, each with weft's version
    /// when it is known to be exactly what weft wrote.
    async fn tables(&mut self, ns: &Ns) -> R<BTreeMap<String, Option<u64>>>;
    /// Replaces weft's table in `ns` with `spec` in one atomic batch.
    async fn set_table(&mut self, ns: &Ns, spec: &TableSpec) -> R<()>;
    async fn delete_table(&mut self, ns: &Ns, name: &str) -> R<()>;
}

/// A WireGuard device as its implementation reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WgDevice {
    pub listen_port: u16,
    pub peers: BTreeMap<WgKey, WgPeer>,
}

/// Counters of one WireGuard device (from boringtun's UAPI or the kernel).
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub last_handshake_unix: Option<u64>,
    /// Where the peer with the newest handshake was last seen.
    pub endpoint: Option<std::net::SocketAddr>,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    /// Datagrams refused on the way in (malformed, unauthenticated,
    /// replayed, from a source the peer may not use): weft's userspace
    /// device only.
    pub rx_rejected: u64,
    /// The offloads in use: weft's userspace device only.
    pub offloads: Option<Offloads>,
    /// weft's userspace device only: how many times it died (a thread
    /// panicked) and was made anew, and why the last time.
    pub device_restarts: u64,
    pub device_failure: String,
    /// weft's userspace device only: handshakes sent with the punch TTL.
    pub primed_handshakes: u64,
}

/// The kernel offloads weft's userspace WireGuard device runs with.
pub use weft_wg_device::Offloads;

/// WireGuard devices and their peers.
#[async_trait::async_trait]
pub trait WireGuard: Send {
    /// The devices whose interface is in one of `scopes`, by (namespace,
    /// name).
    async fn devices(&mut self, scopes: &BTreeSet<Ns>) -> BTreeMap<(Ns, String), WgDevice>;
    /// Makes device `link` (replacing one of its name), its interface in
    /// `link.ns`, up, with `link.mtu`.
    async fn create(&mut self, link: &Link) -> R<()>;
    async fn remove(&mut self, ns: &Ns, name: &str) -> R<()>;
    async fn set_peer(&mut self, ns: &Ns, link: &str, peer: &WgPeer) -> R<()>;
    async fn remove_peer(&mut self, ns: &Ns, link: &str, public_key: &WgKey) -> R<()>;
}

/// What `observe` read: weft's state within `scopes`, and the raw host
/// namespace (for the facts the translation needs).
#[derive(Clone, Debug, Default)]
pub struct Observation {
    pub state: State,
    pub scopes: BTreeSet<Ns>,
    pub host: RawNs,
}

impl Observation {
    /// What [`observe`] would find within `scopes`, from a belief (see
    /// `DataPlane::believed`): weft's namespaces among `claimed`, the
    /// agent's own and those of `scopes` planned.
    pub fn within(mut self, claimed: &BTreeSet<Ns>, scopes: &BTreeSet<Ns>) -> Observation {
        self.state.namespaces.retain(|n| claimed.contains(n));
        self.scopes = std::iter::once(String::new())
            .chain(self.state.namespaces.iter().filter(|n| scopes.contains(*n)).cloned())
            .collect();
        self
    }
}

/// Reads weft's part of the host: the agent's namespace, and those of
/// `claimed` (namespaces weft made; the only ones it may remove) that
/// exist and are in `scopes` (None: all).
pub async fn observe(
    net: &mut dyn Netlink,
    fw: &mut dyn Firewall,
    wg: &mut dyn WireGuard,
    claimed: &BTreeSet<Ns>,
    scopes: Option<&BTreeSet<Ns>>,
) -> R<Observation> {
    let mut out = Observation::default();
    let existing = net.namespaces().await?;
    out.state.namespaces = claimed
        .iter()
        .filter(|n| existing.contains(*n) && n.starts_with(PREFIX))
        .cloned()
        .collect();
    out.scopes.insert(String::new());
    out.scopes.extend(
        out.state
            .namespaces
            .iter()
            .filter(|n| scopes.is_none_or(|s| s.contains(*n)))
            .cloned(),
    );
    let started = std::time::Instant::now();
    let devices = wg.devices(&out.scopes).await;
    let wg_took = started.elapsed();
    let (mut netlink_took, mut firewall_took) = (Duration::ZERO, Duration::ZERO);
    for ns in out.scopes.clone() {
        let at = std::time::Instant::now();
        let mut raw = net.read(&ns).await?;
        netlink_took += at.elapsed();
        let at = std::time::Instant::now();
        raw.tables = fw.tables(&ns).await?;
        firewall_took += at.elapsed();
        // A WireGuard interface is a device of ours when one backs it.
        for l in &mut raw.links {
            if let Some(d) = devices.get(&(ns.clone(), l.name.clone())) {
                l.kind = LinkKind::Wireguard {
                    listen_port: d.listen_port,
                };
            }
        }
        for ((dns, name), d) in &devices {
            if *dns == ns && raw.links.iter().any(|l| l.name == *name) {
                out.state.peers.insert((ns.clone(), name.clone()), d.peers.clone());
            }
        }
        if ns.is_empty() {
            out.host = raw.clone();
        }
        owned(&ns, raw, &mut out.state);
    }
    // Where a read of the host goes (seconds on a slow host).
    tracing::debug!(
        namespaces = out.scopes.len(),
        wireguard_ms = wg_took.as_millis() as u64,
        netlink_ms = netlink_took.as_millis() as u64,
        firewall_ms = firewall_took.as_millis() as u64,
        "read the host"
    );
    Ok(out)
}

/// Whether `op` is carried out by netlink (else by the firewall or
/// WireGuard).
fn is_netlink(op: &Op) -> bool {
    !matches!(
        op,
        Op::AddWireguard(_)
            | Op::DelWireguard { .. }
            | Op::SetPeer { .. }
            | Op::RemovePeer { .. }
            | Op::SetTable { .. }
            | Op::DelTable { .. }
    )
}

/// Runs `ops` in order (consecutive netlink operations of one namespace as
/// one batch); one result per operation. A failed operation does not stop
/// the rest: what depends on it fails with its own message.
pub async fn execute(net: &mut dyn Netlink, fw: &mut dyn Firewall, wg: &mut dyn WireGuard, ops: &[Op]) -> Vec<R<()>> {
    let mut results = Vec::with_capacity(ops.len());
    let mut i = 0;
    while i < ops.len() {
        let op = &ops[i];
        if is_netlink(op) {
            let ns = op.ns().to_string();
            let mut j = i + 1;
            while j < ops.len() && is_netlink(&ops[j]) && ops[j].ns() == ns {
                j += 1;
            }
            results.extend(net.apply(&ns, &ops[i..j]).await);
            i = j;
            continue;
        }
        results.push(match op {
            Op::AddWireguard(l) => wg.create(l).await,
            Op::DelWireguard { ns, name } => wg.remove(ns, name).await,
            Op::SetPeer { ns, link, peer } => wg.set_peer(ns, link, peer).await,
            Op::RemovePeer { ns, link, public_key } => wg.remove_peer(ns, link, public_key).await,
            Op::SetTable { ns, spec } => fw.set_table(ns, spec).await,
            Op::DelTable { ns, name } => fw.delete_table(ns, name).await,
            _ => unreachable!("netlink operations are batched above"),
        });
        i += 1;
    }
    results
}
