//! weft's userspace WireGuard devices (the `weft-wg-device` crate) as an
//! agent runs them, by interface name, behind the [`WireGuard`] seam:
//! each started in the agent's namespace (so its UDP socket is on the
//! host's underlay, as kernel WireGuard's is when its interface is moved)
//! with its interface then moved into the peering's namespace; a device
//! that dies is made anew.

use std::collections::HashMap;
use std::os::fd::AsRawFd;

use futures::TryStreamExt;
use rtnetlink::{Handle, LinkUnspec};

use weft_types::{WgKey, WgSecret};
use weft_wg_device::{Config, Device, OnDeath};

use crate::host::{R, Stats, WgDevice, WireGuard};
use crate::model::{Link, LinkKind, Ns, WgPeer};

pub use weft_wg_device::DISCOVERY_MAGIC;

/// Signalled when a device dies (a thread panicked): the agent repairs at
/// once instead of at its next resync.
pub fn deaths() -> &'static tokio::sync::Notify {
    static DEATHS: std::sync::OnceLock<tokio::sync::Notify> = std::sync::OnceLock::new();
    DEATHS.get_or_init(tokio::sync::Notify::new)
}

pub struct Running {
    pub device: Device,
    pub namespace: String,
    pub listen_port: u16,
}

/// Settings every device of the agent gets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// Ask for no offloads (a packet per system call).
    pub no_offload: bool,
    /// See `weft_wg_device::Config::rekey_after`.
    pub rekey_after: Option<std::time::Duration>,
    /// See `weft_wg_device::Config::single_thread`.
    pub single_thread: bool,
    /// See `weft_wg_device::Config::punch_ttl` (0: none).
    pub punch_ttl: u8,
    /// For tests only (the gateway agent's hidden
    /// `--test-device-panic-dir`): a directory where a file named after a
    /// device makes that device's receiving thread panic once.
    pub panic_dir: Option<std::path::PathBuf>,
}

#[derive(Default)]
pub struct Devices {
    pub devices: HashMap<String, Running>,
    pub options: Options,
    /// Devices that died and were made anew, by interface name: how many
    /// times, and why the last time.
    pub restarts: HashMap<String, (u64, String)>,
}

impl Devices {
    /// Starts device `name` with `private_key` on `listen_port`,
    /// moves its interface into namespace `ns` and brings it up there with
    /// `mtu` (0: the kernel's default).
    pub async fn create(
        &mut self,
        host: &Handle,
        name: &str,
        ns: &str,
        listen_port: u16,
        mtu: u32,
        private_key: &WgSecret,
    ) -> R<()> {
        self.devices.remove(name);
        let config = Config {
            name: name.to_string(),
            listen_port,
            private_key: *private_key.as_bytes(),
            offload: !self.options.no_offload,
            rekey_after: self.options.rekey_after,
            single_thread: self.options.single_thread,
            panic_dir: self.options.panic_dir.clone(),
            punch_ttl: self.options.punch_ttl,
            on_death: Some(OnDeath(std::sync::Arc::new(|| deaths().notify_one()))),
        };
        let device = Device::start(&config).map_err(|e| format!("cannot start the WireGuard device {name}: {e}"))?;
        let o = device.offloads();
        tracing::info!(device = name, offloads = ?o.names(), gso = o.udp_gso_segments, "userspace WireGuard device started");
        move_into(host, name, ns, mtu).await?;
        self.devices.insert(
            name.to_string(),
            Running {
                device,
                namespace: ns.to_string(),
                listen_port,
            },
        );
        Ok(())
    }

    /// Drops the devices that died (a thread panicked), so the next
    /// reconcile finds them missing and makes them anew, and counts them;
    /// their names.
    pub fn reap(&mut self) -> Vec<String> {
        let dead: Vec<(String, String)> = self
            .devices
            .iter()
            .filter_map(|(n, d)| d.device.died().map(|why| (n.clone(), why)))
            .collect();
        for (name, why) in &dead {
            self.devices.remove(name);
            let r = self.restarts.entry(name.clone()).or_insert((0, String::new()));
            r.0 += 1;
            r.1 = why.clone();
            tracing::warn!(device = %name, restarts = r.0, "a dead WireGuard device is made anew: {why}");
        }
        dead.into_iter().map(|(n, _)| n).collect()
    }

    /// Adds or changes a peer: its endpoint hole-punched (`punch`,
    /// `weft_wg_device::Device::set_peer_punched`), or a relay with a
    /// direct address tried beside it (`direct`,
    /// `weft_wg_device::Device::set_peer_beside`).
    pub fn set_peer(&mut self, link: &str, peer: &WgPeer) -> R<()> {
        let dev = self
            .devices
            .get(link)
            .ok_or_else(|| format!("no WireGuard device {link} (yet)"))?;
        let (key, allowed, keepalive) = (*peer.public_key.as_bytes(), peer.allowed_ips.clone(), peer.keepalive);
        match (peer.endpoint, peer.direct) {
            (Some(relay), Some(direct)) => dev.device.set_peer_beside(key, relay, direct, allowed, keepalive),
            (endpoint, _) if peer.punch => dev.device.set_peer_punched(key, endpoint, allowed, keepalive),
            (endpoint, _) => dev.device.set_peer(key, endpoint, allowed, keepalive),
        }
        Ok(())
    }

    pub fn remove_peer(&mut self, link: &str, public_key: &WgKey) -> R<()> {
        if let Some(dev) = self.devices.get(link) {
            dev.device.remove_peer(public_key.as_bytes());
        }
        Ok(())
    }

    /// The newest handshake with any peer (and where that peer is), the
    /// bytes over all peers, what was refused, the offloads.
    pub fn stats(&self, link: &str) -> Stats {
        let (device_restarts, device_failure) = self.restarts.get(link).cloned().unwrap_or_default();
        let Some(dev) = self.devices.get(link) else {
            return Stats {
                device_restarts,
                device_failure,
                ..Default::default()
            };
        };
        let mut st = Stats {
            rx_rejected: dev.device.counters().rx_rejected(),
            primed_handshakes: dev
                .device
                .counters()
                .tx_primed
                .load(std::sync::atomic::Ordering::Relaxed),
            offloads: Some(dev.device.offloads()),
            device_restarts,
            device_failure,
            ..Default::default()
        };
        let mut newest = None;
        for p in dev.device.peers() {
            st.rx_bytes += p.rx_bytes;
            st.tx_bytes += p.tx_bytes;
            if let Some(t) = p.last_handshake
                && newest.is_none_or(|n| t > n)
            {
                newest = Some(t);
                st.endpoint = p.endpoint.or(st.endpoint);
            }
        }
        st.last_handshake_unix = newest
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_secs());
        st
    }
}

/// Moves the tun `name` from the agent's namespace (`host`) into namespace
/// `ns` and brings it up there with `mtu` and the tunnel's queue length.
pub async fn move_into(host: &Handle, name: &str, ns: &str, mtu: u32) -> R<()> {
    let mut links = host.link().get().match_name(name.to_string()).execute();
    let idx = links
        .try_next()
        .await
        .map_err(|e| e.to_string())?
        .ok_or("the device vanished")?
        .header
        .index;
    let file = std::fs::File::open(format!("/run/netns/{ns}")).map_err(|e| format!("namespace {ns}: {e}"))?;
    host.link()
        .set(LinkUnspec::new_with_index(idx).setns_by_fd(file.as_raw_fd()).build())
        .execute()
        .await
        .map_err(|e| format!("cannot move {name} into {ns}: {e}"))?;
    let n = name.to_string();
    crate::nl::in_namespace(ns, move |h| {
        Box::pin(async move {
            crate::nl::set_up_named(&h, &n, mtu).await?;
            crate::offload::tun_queue(&h, &n).await
        })
    })
    .await?;
    Ok(())
}

/// The agent's userspace devices behind the [`WireGuard`] seam.
pub struct Userspace {
    host: Handle,
    /// The gateway's private key; None on nodes.
    key: Option<WgSecret>,
    pub devices: Devices,
    /// Peers as configured, by device.
    peers: std::collections::BTreeMap<String, std::collections::BTreeMap<WgKey, WgPeer>>,
}

impl std::fmt::Debug for Userspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Userspace")
            .field("devices", &self.devices.devices.len())
            .finish()
    }
}

impl Userspace {
    pub fn new(host: Handle, key: Option<WgSecret>, options: Options) -> Userspace {
        Userspace {
            host,
            key,
            devices: Devices {
                options,
                ..Default::default()
            },
            peers: Default::default(),
        }
    }

    /// Counters of device `link` (zero when there is none).
    pub fn stats(&mut self, link: &str) -> Stats {
        self.devices.stats(link)
    }
}

#[async_trait::async_trait]
impl WireGuard for Userspace {
    async fn devices(
        &mut self,
        scopes: &std::collections::BTreeSet<Ns>,
    ) -> std::collections::BTreeMap<(Ns, String), WgDevice> {
        // A dead device is missing: the plan makes it anew.
        for name in self.devices.reap() {
            self.peers.remove(&name);
        }
        self.devices
            .devices
            .iter()
            .filter(|(_, d)| scopes.contains(&d.namespace))
            .map(|(name, d)| {
                (
                    (d.namespace.clone(), name.clone()),
                    WgDevice {
                        listen_port: d.listen_port,
                        peers: self.peers.get(name).cloned().unwrap_or_default(),
                    },
                )
            })
            .collect()
    }

    async fn create(&mut self, link: &Link) -> R<()> {
        let LinkKind::Wireguard { listen_port } = link.kind else {
            return Err(format!("{} is not a WireGuard link", link.name));
        };
        let key = self
            .key
            .clone()
            .ok_or("this agent has no WireGuard key (only gateways do)")?;
        self.peers.remove(&link.name);
        // A stale interface of that name (e.g. the device ended) is in the way.
        if let Ok(Some(idx)) = crate::nl::index_in(&self.host, &link.name).await {
            let _ = self.host.link().del(idx).execute().await;
        }
        self.devices
            .create(&self.host, &link.name, &link.ns, listen_port, link.mtu, &key)
            .await
    }

    async fn remove(&mut self, _ns: &Ns, name: &str) -> R<()> {
        // Dropping the device ends it and removes its interface.
        self.peers.remove(name);
        self.devices.devices.remove(name);
        Ok(())
    }

    async fn set_peer(&mut self, _ns: &Ns, link: &str, peer: &WgPeer) -> R<()> {
        self.devices.set_peer(link, peer)?;
        self.peers
            .entry(link.to_string())
            .or_default()
            .insert(peer.public_key, peer.clone());
        Ok(())
    }

    async fn remove_peer(&mut self, _ns: &Ns, link: &str, public_key: &WgKey) -> R<()> {
        self.devices.remove_peer(link, public_key)?;
        if let Some(p) = self.peers.get_mut(link) {
            p.remove(public_key);
        }
        Ok(())
    }
}
