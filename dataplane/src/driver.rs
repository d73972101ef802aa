//! The gateway's choice of WireGuard driver: kernel or userspace, behind
//! one [`WireGuard`] implementation so the data plane does not care.

use crate::host::{R, Stats, WgDevice, WireGuard};
use crate::kernel::Kernel;
use crate::model::{Link, Ns, WgKey, WgPeer};
use crate::userspace::Userspace;

/// The WireGuard implementation a gateway runs, chosen at its start
/// (`--wireguard auto|kernel|userspace`): the data plane does not care
/// which.
#[derive(Debug)]
pub enum Driver {
    Kernel(Kernel),
    Userspace(Userspace),
}

impl Driver {
    /// "kernel" or "userspace".
    pub fn mode(&self) -> &'static str {
        match self {
            Driver::Kernel(_) => "kernel",
            Driver::Userspace(_) => "userspace",
        }
    }

    /// Whether this agent runs device `link`.
    pub fn has(&self, link: &str) -> bool {
        match self {
            Driver::Kernel(k) => k.has(link),
            Driver::Userspace(u) => u.devices.devices.contains_key(link),
        }
    }

    /// Counters of device `link` (zero when there is none). Blocking.
    pub fn stats(&mut self, link: &str) -> Stats {
        match self {
            Driver::Kernel(k) => crate::blocking(|| k.stats(link)),
            Driver::Userspace(u) => u.stats(link),
        }
    }
}

#[async_trait::async_trait]
impl WireGuard for Driver {
    async fn devices(
        &mut self,
        scopes: &std::collections::BTreeSet<Ns>,
    ) -> std::collections::BTreeMap<(Ns, String), WgDevice> {
        match self {
            Driver::Kernel(k) => k.devices(scopes).await,
            Driver::Userspace(u) => u.devices(scopes).await,
        }
    }

    async fn create(&mut self, link: &Link) -> R<()> {
        match self {
            Driver::Kernel(k) => k.create(link).await,
            Driver::Userspace(u) => u.create(link).await,
        }
    }

    async fn remove(&mut self, ns: &Ns, name: &str) -> R<()> {
        match self {
            Driver::Kernel(k) => k.remove(ns, name).await,
            Driver::Userspace(u) => u.remove(ns, name).await,
        }
    }

    async fn set_peer(&mut self, ns: &Ns, link: &str, peer: &WgPeer) -> R<()> {
        match self {
            Driver::Kernel(k) => k.set_peer(ns, link, peer).await,
            Driver::Userspace(u) => u.set_peer(ns, link, peer).await,
        }
    }

    async fn remove_peer(&mut self, ns: &Ns, link: &str, public_key: &WgKey) -> R<()> {
        match self {
            Driver::Kernel(k) => k.remove_peer(ns, link, public_key).await,
            Driver::Userspace(u) => u.remove_peer(ns, link, public_key).await,
        }
    }
}
