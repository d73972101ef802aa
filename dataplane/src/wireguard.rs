//! Userspace WireGuard (boringtun) for a peering, in the peering's
//! namespace.
//!
//! The device is created in the namespace the agent runs in — so its UDP
//! socket stays on the host's underlay, as kernel WireGuard does when its
//! interface is moved — and the interface is then moved into the peering's
//! namespace, where the tunneled traffic is routed and translated. boringtun
//! is driven through a UAPI socket pair (no socket file, no signal
//! handling), one worker thread per device.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::IntoRawFd;
use std::os::unix::net::UnixStream;

use defguard_boringtun::device::{DeviceConfig, DeviceHandle};
use rtnetlink::Handle;

pub use crate::host::Stats;
use crate::host::{R, WgDevice, WireGuard};
use crate::model::{Link, LinkKind, Ns, WgKey, WgPeer};
use weft_types::WgSecret;

pub struct Device {
    _handle: DeviceHandle,
    /// Peers as last configured (public key → the UAPI lines): boringtun
    /// cannot modify a peer in place, so a change is a remove and an add.
    peers: HashMap<String, String>,
    uapi: BufReader<UnixStream>,
    pub namespace: String,
    pub listen_port: u32,
}

impl Device {
    /// Sends one UAPI request; returns the response lines before `errno`.
    /// boringtun answers EIO while its worker holds the device (seen when
    /// peers change under traffic, e.g. in a failover) and then has read
    /// and dropped the whole request, so it is sent again, a few times,
    /// 10 ms apart.
    pub fn uapi(&mut self, request: &str) -> R<Vec<String>> {
        for _ in 0..20 {
            match self.uapi_once(request)? {
                Ok(lines) => return Ok(lines),
                Err(code) if code == libc::EIO => std::thread::sleep(std::time::Duration::from_millis(10)),
                Err(code) => return Err(format!("UAPI error {code}")),
            }
        }
        Err(format!("UAPI error {} (the device stayed busy)", libc::EIO))
    }

    /// One request: the answer's lines, or the errno it was refused with.
    fn uapi_once(&mut self, request: &str) -> R<Result<Vec<String>, i32>> {
        let s = self.uapi.get_mut();
        // One write: boringtun reads each request through a fresh buffered
        // reader and drops what it buffered when it refuses one (EIO), so
        // a request sent in two pieces could leave its tail to be read as
        // a request of its own, and the answers would no longer match.
        s.write_all(format!("{request}\n").as_bytes())
            .map_err(|e| format!("UAPI: {e}"))?;
        let mut lines = Vec::new();
        loop {
            let mut line = String::new();
            if self.uapi.read_line(&mut line).map_err(|e| format!("UAPI: {e}"))? == 0 {
                return Err("UAPI closed".into());
            }
            let line = line.trim_end().to_string();
            if line.is_empty() {
                continue;
            }
            if let Some(code) = line.strip_prefix("errno=") {
                // the blank line that ends the answer
                let mut end = String::new();
                let _ = self.uapi.read_line(&mut end);
                return Ok(match code.parse::<i32>() {
                    Ok(0) => Ok(lines),
                    Ok(c) => Err(c),
                    Err(_) => return Err(format!("UAPI: unreadable answer errno={code}")),
                });
            }
            lines.push(line);
        }
    }

    /// The newest handshake with any peer and the bytes over all peers.
    pub fn stats(&mut self) -> Stats {
        let mut st = Stats::default();
        // The endpoint of the peer with the newest handshake (the active
        // gateway of the far site): peers are listed one after another,
        // each with its endpoint before its handshake time.
        let mut endpoint = None;
        for l in self.uapi("get=1\n").unwrap_or_default() {
            let Some((k, v)) = l.split_once('=') else { continue };
            match k {
                "public_key" => endpoint = None,
                "endpoint" => endpoint = v.parse().ok(),
                _ => {}
            }
            let Ok(n) = v.parse::<u64>() else { continue };
            match k {
                "last_handshake_time_sec" if n > 0 => {
                    if Some(n) > st.last_handshake_unix || st.endpoint.is_none() {
                        st.endpoint = endpoint.or(st.endpoint);
                    }
                    st.last_handshake_unix = st.last_handshake_unix.max(Some(n));
                }
                "rx_bytes" => st.rx_bytes += n,
                "tx_bytes" => st.tx_bytes += n,
                _ => {}
            }
        }
        st
    }
}

/// The WireGuard devices this agent runs, by interface name.
#[derive(Default)]
pub struct Devices {
    pub devices: HashMap<String, Device>,
}

impl Devices {
    /// Creates the device `name` with `private_key` listening on
    /// `listen_port`, moves it into namespace `ns`, and brings it up there.
    pub async fn create(
        &mut self,
        host: &Handle,
        name: &str,
        ns: &str,
        listen_port: u32,
        mtu: u32,
        private_key: &WgSecret,
    ) -> R<()> {
        self.devices.remove(name);
        let (ours, theirs) = UnixStream::pair().map_err(|e| e.to_string())?;
        let config = DeviceConfig {
            n_threads: 1,
            // defguard_boringtun 0.7.1 opens the per-peer connected socket
            // as SOCK_STREAM/IPPROTO_UDP, which Linux refuses
            // (EPROTONOSUPPORT), and retries for every packet that arrives
            // on the listening socket: one failed socket() per received
            // packet. Everything works on the listening socket alone.
            use_connected_socket: false,
            use_multi_queue: false,
            uapi_fd: theirs.into_raw_fd(),
        };
        let handle =
            DeviceHandle::new(name, config).map_err(|e| format!("cannot create the WireGuard device {name}: {e:?}"))?;
        let mut dev = Device {
            _handle: handle,
            peers: HashMap::new(),
            uapi: BufReader::new(ours),
            namespace: ns.to_string(),
            listen_port,
        };
        dev.uapi(&format!(
            "set=1\nprivate_key={}\nlisten_port={listen_port}\n",
            private_key.to_hex()
        ))?;
        if let Err(e) = crate::offload::grow_udp_buffers(listen_port as u16) {
            tracing::warn!(
                device = name,
                "socket buffers left at the host default, bursts may drop: {e}"
            );
        }
        // Move the interface into the peering's namespace.
        crate::userspace::move_into(host, name, ns, mtu).await?;
        self.devices.insert(name.to_string(), dev);
        Ok(())
    }

    pub fn set_peer(
        &mut self,
        link: &str,
        public_key: &WgKey,
        endpoint: &str,
        allowed: &[String],
        keepalive: u32,
    ) -> R<bool> {
        let dev = self
            .devices
            .get_mut(link)
            .ok_or_else(|| format!("no WireGuard device {link} (yet)"))?;
        let key = public_key.to_hex();
        let mut lines = String::new();
        if !endpoint.is_empty() {
            lines.push_str(&format!("endpoint={endpoint}\n"));
        }
        if keepalive > 0 {
            lines.push_str(&format!("persistent_keepalive_interval={keepalive}\n"));
        }
        for a in allowed {
            lines.push_str(&format!("allowed_ip={a}\n"));
        }
        if dev.peers.get(&key) == Some(&lines) {
            return Ok(false);
        }
        // Always remove first, even a peer this map does not list: boringtun
        // aborts its worker thread (assert) when asked to add a peer it
        // already has, which a failed earlier call could leave behind.
        dev.peers.remove(&key);
        dev.uapi(&format!("set=1\npublic_key={key}\nremove=true\n"))?;
        dev.uapi(&format!("set=1\npublic_key={key}\nreplace_allowed_ips=true\n{lines}"))?;
        dev.peers.insert(key, lines);
        Ok(true)
    }

    pub fn remove_peer(&mut self, link: &str, public_key: &WgKey) -> R<()> {
        let key = public_key.to_hex();
        let Some(dev) = self.devices.get_mut(link) else {
            return Ok(());
        };
        dev.peers.remove(&key);
        dev.uapi(&format!("set=1\npublic_key={key}\nremove=true\n")).map(|_| ())
    }
}

/// weft's userspace WireGuard devices (`crate::userspace`) behind the
/// [`WireGuard`] seam.
pub struct Userspace {
    host: Handle,
    /// The gateway's private key; None on nodes.
    key: Option<WgSecret>,
    pub devices: crate::userspace::Devices,
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
    pub fn new(host: Handle, key: Option<WgSecret>, options: crate::userspace::Options) -> Userspace {
        Userspace {
            host,
            key,
            devices: crate::userspace::Devices {
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
        let allowed: Vec<ipnet::IpNet> = peer.allowed_ips.clone();
        self.devices
            .set_peer(link, &peer.public_key, peer.endpoint, &allowed, peer.keepalive)?;
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
