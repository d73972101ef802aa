//! Kernel WireGuard (the `wireguard` module, Linux 5.6+) behind the
//! [`WireGuard`] seam, through `defguard_wireguard_rs`'s netlink API.
//!
//! The link is made in the agent's namespace, so that the kernel opens its
//! UDP socket there (on the host's underlay: WireGuard keeps the socket in
//! the namespace the link was created in), then moved into the peering's
//! namespace and set up there with its MTU. Every call of the crate opens a
//! netlink socket in the calling thread's namespace, so each runs on a
//! thread that joined the link's namespace.
//!
//! Only the crate's `create_interface`, `configure_interface` (once, on a
//! fresh link: it flushes the link's addresses and replaces all peers),
//! `configure_peer`, `remove_peer` and `read_interface_data` are used: never
//! its routing, address or DNS helpers, which would touch the host outside
//! weft's links. Deleting, moving and sizing links is weft's own rtnetlink.
//!
//! The decisions (which operations for which change, what an observed
//! device means) are pure functions, unit-tested without root; [`Kernel`]
//! carries them out.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;
use std::time::UNIX_EPOCH;

use defguard_wireguard_rs::{InterfaceConfiguration, Kernel as KernelApi, WGApi, WireguardInterfaceApi};
use futures::TryStreamExt;
use ipnet::IpNet;
use rtnetlink::packet_route::link::{InfoKind, LinkAttribute, LinkInfo};
use rtnetlink::{Handle, LinkUnspec};

use crate::host::{R, Stats, WgDevice, WireGuard};
use crate::model::{Link, LinkKind, Ns, PREFIX, WgKey, WgPeer};
use weft_types::WgSecret;

/// One step of the kernel driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelOp {
    /// Deletes link `name` of namespace `ns` (rtnetlink).
    DeleteLink {
        ns: Ns,
        name: String,
    },
    /// Makes a WireGuard link in the agent's namespace (netlink, via the
    /// crate).
    CreateLink {
        name: String,
    },
    /// Gives the fresh link (in the agent's namespace, no peers) the
    /// gateway's private key and the listen port.
    Configure {
        name: String,
        listen_port: u16,
    },
    /// Moves the link from the agent's namespace into `ns` (rtnetlink).
    MoveLink {
        name: String,
        ns: Ns,
    },
    /// Sets the link up, with `mtu` unless 0 (rtnetlink, in `ns`).
    SetUp {
        ns: Ns,
        name: String,
        mtu: u32,
    },
    /// Adds or updates a peer: its allowed IPs are replaced, its keepalive
    /// set (0 turns it off), its endpoint set when it has one.
    SetPeer {
        ns: Ns,
        name: String,
        peer: WgPeer,
    },
    RemovePeer {
        ns: Ns,
        name: String,
        public_key: WgKey,
    },
}

/// The operations that make WireGuard link `link` anew. `stale_here`: a
/// link of that name is in the agent's namespace (left by an interrupted
/// creation) and is in the way.
pub fn create_ops(link: &Link, stale_here: bool) -> R<Vec<KernelOp>> {
    let LinkKind::Wireguard { listen_port } = link.kind else {
        return Err(format!("{} is not a WireGuard link", link.name));
    };
    let name = link.name.clone();
    let mut ops = Vec::new();
    if stale_here {
        ops.push(KernelOp::DeleteLink {
            ns: String::new(),
            name: name.clone(),
        });
    }
    ops.push(KernelOp::CreateLink { name: name.clone() });
    ops.push(KernelOp::Configure {
        name: name.clone(),
        listen_port,
    });
    if !link.ns.is_empty() {
        ops.push(KernelOp::MoveLink {
            name: name.clone(),
            ns: link.ns.clone(),
        });
    }
    ops.push(KernelOp::SetUp {
        ns: link.ns.clone(),
        name,
        mtu: link.mtu,
    });
    Ok(ops)
}

/// The operations that make peer `want` of link `name` what weft wants:
/// one set, whatever the kernel has. A peer without an endpoint (a far
/// gateway that only dials out) keeps the one the kernel learned from its
/// packets: removing the peer to clear it would drop its session at every
/// change. A peer whose set endpoint moves from one address to another
/// (`before`: as weft last set it) is removed first: its next packet then
/// opens a new session with a handshake, which a relay must see to learn
/// where each side is (a session carried over to a new relay would be
/// dropped there until the kernel's rekey, 15 s or more).
pub fn peer_ops(ns: &Ns, name: &str, want: &WgPeer, before: Option<&WgPeer>) -> Vec<KernelOp> {
    let mut ops = Vec::new();
    if let (Some(old), Some(new)) = (before.and_then(|b| b.endpoint), want.endpoint)
        && old != new
    {
        ops.push(KernelOp::RemovePeer {
            ns: ns.clone(),
            name: name.to_string(),
            public_key: want.public_key,
        });
    }
    ops.push(KernelOp::SetPeer {
        ns: ns.clone(),
        name: name.to_string(),
        peer: want.clone(),
    });
    ops
}

/// A kernel WireGuard device as read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReadDevice {
    pub listen_port: u16,
    /// Whether its private key is this gateway's.
    pub ours: bool,
    pub peers: Vec<ReadPeer>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadPeer {
    pub public_key: WgKey,
    pub endpoint: Option<SocketAddr>,
    pub allowed_ips: Vec<IpAddr>,
    /// Prefix lengths, one per allowed IP.
    pub prefixes: Vec<u8>,
    pub keepalive: u16,
    /// Seconds since the epoch; None: never.
    pub last_handshake: Option<u64>,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
}

/// What a device read from the kernel is to the planner: None when it is
/// not this gateway's (another key: replaced, never adopted).
///
/// The kernel moves a peer's endpoint to wherever its authenticated
/// packets come from (roaming, NAT), and learns one for a peer weft set
/// without. An endpoint that differs from what weft set in this process is
/// that, not drift: the peer is reported with what weft set (an endpoint
/// or none). Without such a record (after a restart) a differing endpoint
/// is set once more.
///
/// Allowed IPs are kept as the kernel has them (host bits cleared).
pub fn observe_device(read: &ReadDevice, configured: Option<&BTreeMap<WgKey, WgPeer>>) -> Option<WgDevice> {
    if !read.ours {
        return None;
    }
    let mut peers = BTreeMap::new();
    for p in &read.peers {
        let mut allowed: Vec<IpNet> = p
            .allowed_ips
            .iter()
            .zip(&p.prefixes)
            .filter_map(|(ip, len)| IpNet::new(*ip, *len).ok().map(|n| n.trunc()))
            .collect();
        allowed.sort();
        allowed.dedup();
        let set = configured.and_then(|c| c.get(&p.public_key));
        let endpoint = match set {
            Some(s) => s.endpoint,
            None => p.endpoint,
        };
        peers.insert(
            p.public_key,
            WgPeer {
                public_key: p.public_key,
                endpoint,
                allowed_ips: allowed,
                keepalive: p.keepalive,
                // (kernel WireGuard sends at the full TTL: see model)
                punch: false,
                direct: None,
            },
        );
    }
    Some(WgDevice {
        listen_port: read.listen_port,
        peers,
    })
}

/// A device's counters: the newest handshake (and where that peer was
/// seen), the bytes over all peers.
pub fn stats_of(read: &ReadDevice) -> Stats {
    let mut st = Stats::default();
    for p in &read.peers {
        if let Some(t) = p.last_handshake
            && Some(t) > st.last_handshake_unix
        {
            st.last_handshake_unix = Some(t);
            st.endpoint = p.endpoint;
        }
        st.rx_bytes += p.rx_bytes;
        st.tx_bytes += p.tx_bytes;
    }
    st
}

fn key_of(key: &WgKey) -> defguard_wireguard_rs::key::Key {
    defguard_wireguard_rs::key::Key::new(*key.as_bytes())
}

fn wg_err(what: &str, name: &str, e: impl std::fmt::Display) -> String {
    format!("kernel WireGuard: cannot {what} {name}: {e}")
}

/// Reads device `name` in the calling thread's namespace; `public`: the
/// gateway's public key, to tell its devices. Blocking.
///
/// Keys are compared by their public halves: the kernel keeps (and reads
/// back) a private key clamped, as X25519 uses it, while a key file may
/// hold it unclamped; both have the same public key.
fn read_here(name: &str, public: Option<&[u8; 32]>) -> R<ReadDevice> {
    let api = WGApi::<KernelApi>::new(name).map_err(|e| wg_err("read", name, e))?;
    let host = api.read_interface_data().map_err(|e| wg_err("read", name, e))?;
    let ours = match (&host.private_key, public) {
        (Some(k), Some(p)) => k.public_key().as_array() == *p,
        _ => false,
    };
    let peers = host
        .peers
        .values()
        .map(|p| ReadPeer {
            public_key: WgKey::from_bytes(p.public_key.as_array()),
            endpoint: p.endpoint,
            allowed_ips: p.allowed_ips.iter().map(|a| a.address).collect(),
            prefixes: p.allowed_ips.iter().map(|a| a.cidr).collect(),
            keepalive: p.persistent_keepalive_interval.unwrap_or(0),
            last_handshake: p
                .last_handshake
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map(|d| d.as_secs())
                .filter(|s| *s > 0),
            rx_bytes: p.rx_bytes,
            tx_bytes: p.tx_bytes,
        })
        .collect();
    Ok(ReadDevice {
        listen_port: host.listen_port,
        ours,
        peers,
    })
}

fn peer_of(p: &WgPeer) -> R<defguard_wireguard_rs::peer::Peer> {
    let mut peer = defguard_wireguard_rs::peer::Peer::new(key_of(&p.public_key));
    peer.endpoint = p.endpoint;
    // Always explicit: None would keep the kernel's old value.
    peer.persistent_keepalive_interval = Some(p.keepalive);
    peer.allowed_ips = p
        .allowed_ips
        .iter()
        .map(|n| defguard_wireguard_rs::net::IpAddrMask::new(n.addr(), n.prefix_len()))
        .collect();
    Ok(peer)
}

/// Runs blocking `f` on a thread of its own inside namespace `ns` (""
/// stays in the agent's), and waits for it. Blocking.
fn run_in<T: Send + 'static>(ns: &str, f: impl FnOnce() -> R<T> + Send + 'static) -> R<T> {
    let path = (!ns.is_empty()).then(|| format!("/run/netns/{ns}"));
    std::thread::Builder::new()
        .name("weft-kernel-wg".into())
        .spawn(move || {
            if let Some(path) = path {
                let file = std::fs::File::open(&path).map_err(|e| format!("cannot open {path}: {e}"))?;
                nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(|e| format!("cannot enter {path}: {e}"))?;
            }
            f()
        })
        .map_err(|e| format!("cannot start a thread: {e}"))?
        .join()
        .map_err(|_| "the kernel WireGuard worker panicked".to_string())?
}

/// Kernel WireGuard links of weft (named weft*) in namespace `ns`.
async fn wireguard_links(h: &Handle) -> R<Vec<String>> {
    let mut names = Vec::new();
    let mut links = h.link().get().execute();
    while let Some(m) = links.try_next().await.map_err(|e| format!("cannot list links: {e}"))? {
        let mut name = None;
        let mut wg = false;
        for a in &m.attributes {
            match a {
                LinkAttribute::IfName(n) => name = Some(n.clone()),
                LinkAttribute::LinkInfo(infos) => {
                    wg = infos.iter().any(|i| matches!(i, LinkInfo::Kind(InfoKind::Wireguard)));
                }
                _ => {}
            }
        }
        if let Some(n) = name.filter(|n| wg && n.starts_with(PREFIX)) {
            names.push(n);
        }
    }
    Ok(names)
}

/// Kernel WireGuard devices behind the [`WireGuard`] seam.
pub struct Kernel {
    host: Handle,
    /// The gateway's private key; None on nodes and in a teardown (no
    /// device is then this agent's, and all of weft's are removed).
    key: Option<WgSecret>,
    /// Its public key.
    public: Option<[u8; 32]>,
    /// The namespace of each device, as last made or seen.
    at: BTreeMap<String, Ns>,
    /// Peers as weft set them in this process, by device.
    configured: BTreeMap<String, BTreeMap<WgKey, WgPeer>>,
    /// Each device as last read: what a failed read reports instead (a
    /// netlink hiccup must not make a working link look foreign, which
    /// would replace it).
    last: BTreeMap<String, (Ns, WgDevice)>,
}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernel").field("devices", &self.at.len()).finish()
    }
}

impl Kernel {
    /// `private_key`: the gateway's (None on nodes).
    pub fn new(host: Handle, private_key: Option<&WgSecret>) -> R<Kernel> {
        let public = private_key.map(|k| {
            defguard_wireguard_rs::key::Key::new(*k.as_bytes())
                .public_key()
                .as_array()
        });
        Ok(Kernel {
            host,
            public,
            key: private_key.cloned(),
            at: BTreeMap::new(),
            configured: BTreeMap::new(),
            last: BTreeMap::new(),
        })
    }

    pub fn has(&self, link: &str) -> bool {
        self.at.contains_key(link)
    }

    /// Counters of device `link` (zero when there is none). Blocking.
    pub fn stats(&mut self, link: &str) -> Stats {
        let Some(ns) = self.at.get(link).cloned() else {
            return Stats::default();
        };
        let (name, public) = (link.to_string(), self.public);
        run_in(&ns, move || read_here(&name, public.as_ref()))
            .map(|d| stats_of(&d))
            .unwrap_or_default()
    }

    async fn run(&mut self, ops: &[KernelOp]) -> R<()> {
        for op in ops {
            self.run_one(op).await?;
        }
        Ok(())
    }

    async fn run_one(&mut self, op: &KernelOp) -> R<()> {
        match op.clone() {
            KernelOp::DeleteLink { ns, name } => {
                crate::nl::in_namespace_or_here(&self.host, &ns, move |h| {
                    Box::pin(async move {
                        if let Some(idx) = crate::nl::index_in(&h, &name).await? {
                            crate::nl::ok_if_missing(h.link().del(idx).execute().await)?;
                        }
                        Ok(())
                    })
                })
                .await
            }
            KernelOp::CreateLink { name } => crate::blocking(|| {
                let mut api = WGApi::<KernelApi>::new(name.clone()).map_err(|e| wg_err("create", &name, e))?;
                api.create_interface().map_err(|e| wg_err("create", &name, e))
            }),
            KernelOp::Configure { name, listen_port } => {
                let key = self
                    .key
                    .clone()
                    .ok_or("this agent has no WireGuard key (only gateways do)")?;
                crate::blocking(|| {
                    let api = WGApi::<KernelApi>::new(name.clone()).map_err(|e| wg_err("configure", &name, e))?;
                    let config = InterfaceConfiguration {
                        name: name.clone(),
                        prvkey: key.to_base64(),
                        addresses: Vec::new(),
                        port: listen_port,
                        peers: Vec::new(),
                        mtu: None,
                        fwmark: None,
                    };
                    api.configure_interface(&config)
                        .map_err(|e| wg_err("configure", &name, e))
                })
            }
            KernelOp::MoveLink { name, ns } => {
                let idx = crate::nl::need_index_in(&self.host, &name).await?;
                let file =
                    std::fs::File::open(format!("/run/netns/{ns}")).map_err(|e| format!("namespace {ns}: {e}"))?;
                self.host
                    .link()
                    .set(LinkUnspec::new_with_index(idx).setns_by_fd(file.as_raw_fd()).build())
                    .execute()
                    .await
                    .map_err(|e| format!("cannot move {name} into {ns}: {e}"))
            }
            KernelOp::SetUp { ns, name, mtu } => {
                crate::nl::in_namespace_or_here(&self.host, &ns, move |h| {
                    Box::pin(async move { crate::nl::set_up_named(&h, &name, mtu).await })
                })
                .await
            }
            KernelOp::SetPeer { ns, name, peer } => {
                let p = peer_of(&peer)?;
                let n = name.clone();
                run_async(&ns, move || {
                    let api = WGApi::<KernelApi>::new(n.clone()).map_err(|e| wg_err("set a peer of", &n, e))?;
                    api.configure_peer(&p).map_err(|e| wg_err("set a peer of", &n, e))
                })
                .await?;
                self.configured.entry(name).or_default().insert(peer.public_key, peer);
                Ok(())
            }
            KernelOp::RemovePeer { ns, name, public_key } => {
                let k = key_of(&public_key);
                let n = name.clone();
                run_async(&ns, move || {
                    let api = WGApi::<KernelApi>::new(n.clone()).map_err(|e| wg_err("remove a peer of", &n, e))?;
                    api.remove_peer(&k).map_err(|e| wg_err("remove a peer of", &n, e))
                })
                .await?;
                if let Some(p) = self.configured.get_mut(&name) {
                    p.remove(&public_key);
                }
                Ok(())
            }
        }
    }
}

/// [`run_in`] without holding up the runtime.
async fn run_async<T: Send + 'static>(ns: &str, f: impl FnOnce() -> R<T> + Send + 'static) -> R<T> {
    let ns = ns.to_string();
    tokio::task::spawn_blocking(move || run_in(&ns, f))
        .await
        .map_err(|_| "the kernel WireGuard worker panicked".to_string())?
}

#[async_trait::async_trait]
impl WireGuard for Kernel {
    async fn devices(&mut self, scopes: &BTreeSet<Ns>) -> BTreeMap<(Ns, String), WgDevice> {
        let mut out = BTreeMap::new();
        for ns in scopes {
            let public = self.public;
            let read = crate::nl::in_namespace_or_here(&self.host, ns, move |h| {
                Box::pin(async move { wireguard_links(&h).await })
            })
            .await;
            let names = match read {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(namespace = %ns, error = %e, "cannot list WireGuard links; reporting them as last read");
                    for (name, (lns, d)) in &self.last {
                        if lns == ns {
                            out.insert((ns.clone(), name.clone()), d.clone());
                        }
                    }
                    continue;
                }
            };
            for name in names {
                let n = name.clone();
                let dev = match run_async(ns, move || read_here(&n, public.as_ref())).await {
                    Ok(d) => d,
                    Err(e) => {
                        tracing::warn!(namespace = %ns, link = %name, error = %e, "cannot read a WireGuard link; reporting it as last read");
                        if let Some((lns, d)) = self.last.get(&name)
                            && lns == ns
                        {
                            out.insert((ns.clone(), name.clone()), d.clone());
                        }
                        continue;
                    }
                };
                match observe_device(&dev, self.configured.get(&name)) {
                    Some(d) => {
                        self.at.insert(name.clone(), ns.clone());
                        self.last.insert(name.clone(), (ns.clone(), d.clone()));
                        out.insert((ns.clone(), name), d);
                    }
                    None => {
                        if self.at.get(&name) == Some(ns) {
                            self.at.remove(&name);
                            self.last.remove(&name);
                        }
                    }
                }
            }
        }
        out
    }

    async fn create(&mut self, link: &Link) -> R<()> {
        let stale = crate::nl::index_in(&self.host, &link.name).await?.is_some();
        let ops = create_ops(link, stale)?;
        self.configured.remove(&link.name);
        self.last.remove(&link.name);
        if let Err(e) = self.run(&ops).await {
            // Nothing half-made stays: the link goes, wherever it got to.
            for ns in [String::new(), link.ns.clone()] {
                let _ = self
                    .run_one(&KernelOp::DeleteLink {
                        ns,
                        name: link.name.clone(),
                    })
                    .await;
            }
            return Err(e);
        }
        self.at.insert(link.name.clone(), link.ns.clone());
        Ok(())
    }

    async fn remove(&mut self, ns: &Ns, name: &str) -> R<()> {
        self.run_one(&KernelOp::DeleteLink {
            ns: ns.clone(),
            name: name.to_string(),
        })
        .await?;
        self.at.remove(name);
        self.configured.remove(name);
        self.last.remove(name);
        Ok(())
    }

    async fn set_peer(&mut self, ns: &Ns, link: &str, peer: &WgPeer) -> R<()> {
        let before = self.configured.get(link).and_then(|c| c.get(&peer.public_key)).cloned();
        self.run(&peer_ops(ns, link, peer, before.as_ref())).await
    }

    async fn remove_peer(&mut self, ns: &Ns, link: &str, public_key: &WgKey) -> R<()> {
        self.run_one(&KernelOp::RemovePeer {
            ns: ns.clone(),
            name: link.to_string(),
            public_key: *public_key,
        })
        .await
    }
}

/// Whether this kernel can make WireGuard links: tried in a network
/// namespace of a throwaway thread's own (nothing on the host is touched).
/// Err says why not, in words an operator can act on. Blocking.
pub fn probe() -> R<()> {
    crate::linux::probe_link_kind("wireguard")
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: WgKey = WgKey::from_bytes([0xa; 32]);
    const B: WgKey = WgKey::from_bytes([0xb; 32]);

    fn wg_link(ns: &str, mtu: u32) -> Link {
        Link {
            ns: ns.into(),
            name: "weftwg-b".into(),
            kind: LinkKind::Wireguard { listen_port: 51820 },
            mtu,
            up: true,
        }
    }

    fn peer(key: WgKey, endpoint: Option<&str>, allowed: &[&str], keepalive: u16) -> WgPeer {
        WgPeer {
            public_key: key,
            endpoint: endpoint.map(|e| e.parse().unwrap()),
            allowed_ips: allowed.iter().map(|a| a.parse().unwrap()).collect(),
            keepalive,
            punch: false,
            direct: None,
        }
    }

    #[test]
    fn a_link_is_made_in_the_agents_namespace_configured_moved_then_set_up() {
        let ops = create_ops(&wg_link("weftp-b", 1420), false).unwrap();
        assert_eq!(
            ops,
            vec![
                KernelOp::CreateLink {
                    name: "weftwg-b".into()
                },
                KernelOp::Configure {
                    name: "weftwg-b".into(),
                    listen_port: 51820
                },
                KernelOp::MoveLink {
                    name: "weftwg-b".into(),
                    ns: "weftp-b".into()
                },
                KernelOp::SetUp {
                    ns: "weftp-b".into(),
                    name: "weftwg-b".into(),
                    mtu: 1420
                },
            ]
        );
    }

    #[test]
    fn a_stale_link_in_the_agents_namespace_is_deleted_first() {
        let ops = create_ops(&wg_link("weftp-b", 1420), true).unwrap();
        assert_eq!(
            ops[0],
            KernelOp::DeleteLink {
                ns: String::new(),
                name: "weftwg-b".into()
            }
        );
        assert_eq!(ops.len(), 5);
    }

    #[test]
    fn a_link_for_the_agents_own_namespace_is_not_moved() {
        let ops = create_ops(&wg_link("", 0), false).unwrap();
        assert!(!ops.iter().any(|o| matches!(o, KernelOp::MoveLink { .. })));
        assert!(matches!(ops.last(), Some(KernelOp::SetUp { mtu: 0, .. })));
    }

    #[test]
    fn only_wireguard_links_are_made() {
        let mut l = wg_link("weftp-b", 0);
        l.kind = LinkKind::Bridge;
        assert!(create_ops(&l, false).is_err());
    }

    #[test]
    fn a_new_or_changed_peer_is_one_set_that_replaces_allowed_ips() {
        let want = peer(A, Some("192.0.2.1:51820"), &["10.1.0.0/16"], 25);
        assert_eq!(
            peer_ops(&"weftp-b".into(), "weftwg-b", &want, None),
            vec![KernelOp::SetPeer {
                ns: "weftp-b".into(),
                name: "weftwg-b".into(),
                peer: want.clone()
            }]
        );
        // A standby peer loses its allowed IPs: still one set.
        let standby = peer(A, Some("192.0.2.1:51820"), &[], 25);
        assert_eq!(peer_ops(&"n".into(), "l", &standby, Some(&want)).len(), 1);
        // The keepalive turned off is sent as 0, not left out.
        let off = peer(A, Some("192.0.2.1:51820"), &["10.1.0.0/16"], 0);
        let ops = peer_ops(&"n".into(), "l", &off, None);
        assert!(matches!(&ops[..], [KernelOp::SetPeer { peer, .. }] if peer.keepalive == 0));
        let sent = peer_of(&peer(WgKey::from_bytes([7; 32]), None, &[], 0)).unwrap();
        assert_eq!(sent.persistent_keepalive_interval, Some(0));
    }

    #[test]
    fn a_peer_whose_endpoint_moves_is_removed_first_for_a_fresh_handshake() {
        let before = peer(A, Some("192.0.2.51:51920"), &["10.1.0.0/16"], 25);
        let want = peer(A, Some("192.0.2.52:51920"), &["10.1.0.0/16"], 25);
        let ops = peer_ops(&"n".into(), "l", &want, Some(&before));
        assert!(
            matches!(&ops[..], [KernelOp::RemovePeer { public_key, .. }, KernelOp::SetPeer { .. }] if *public_key == A)
        );
        assert_eq!(peer_ops(&"n".into(), "l", &want, Some(&want)).len(), 1);
    }

    #[test]
    fn a_peer_without_an_endpoint_keeps_the_learned_one_and_its_session() {
        // Set without an endpoint: one set, no removal (which would drop
        // the session), and the message carries no endpoint.
        let want = peer(WgKey::from_bytes([9; 32]), None, &["10.1.0.0/16"], 0);
        let ops = peer_ops(
            &"n".into(),
            "l",
            &want,
            Some(&peer(WgKey::from_bytes([9; 32]), Some("192.0.2.1:1"), &[], 0)),
        );
        assert!(matches!(&ops[..], [KernelOp::SetPeer { .. }]));
        assert_eq!(peer_of(&want).unwrap().endpoint, None);
        // The kernel learned one from the far gateway's packets: not drift.
        let set: BTreeMap<WgKey, WgPeer> = [(A, peer(A, None, &["10.1.0.0/16"], 25))].into();
        let learned = read(true, "198.51.100.7:40000", &[("10.1.0.0", 16)]);
        assert_eq!(observe_device(&learned, Some(&set)).unwrap().peers[&A], set[&A]);
    }

    fn read(ours: bool, endpoint: &str, allowed: &[(&str, u8)]) -> ReadDevice {
        ReadDevice {
            listen_port: 51820,
            ours,
            peers: vec![ReadPeer {
                public_key: A,
                endpoint: Some(endpoint.parse().unwrap()),
                allowed_ips: allowed.iter().map(|(a, _)| a.parse().unwrap()).collect(),
                prefixes: allowed.iter().map(|(_, l)| *l).collect(),
                keepalive: 25,
                last_handshake: Some(1_700_000_000),
                rx_bytes: 10,
                tx_bytes: 20,
            }],
        }
    }

    #[test]
    fn a_device_with_another_key_is_not_adopted() {
        assert_eq!(observe_device(&read(false, "192.0.2.1:1", &[]), None), None);
    }

    #[test]
    fn a_roamed_endpoint_is_not_drift_but_an_unrecorded_one_is_set_again() {
        let set: BTreeMap<WgKey, WgPeer> = [(A, peer(A, Some("192.0.2.1:51820"), &["10.1.0.0/16"], 25))].into();
        // The far gateway now sends from behind a NAT.
        let roamed = read(true, "198.51.100.7:40000", &[("10.1.0.0", 16)]);
        let seen = observe_device(&roamed, Some(&set)).unwrap();
        assert_eq!(seen.peers[&A], set[&A], "what weft set, so no operation");
        // After a restart weft has no record: the kernel's value is shown,
        // it differs from the desired one and is set once.
        let seen = observe_device(&roamed, None).unwrap();
        let ep: SocketAddr = "198.51.100.7:40000".parse().unwrap();
        assert_eq!(seen.peers[&A].endpoint, Some(ep));
    }

    #[test]
    fn allowed_ips_compare_as_sets_and_ipv6_ones_are_drift() {
        let d = observe_device(&read(true, "192.0.2.1:1", &[("10.2.0.0", 16), ("10.1.0.0", 16)]), None).unwrap();
        assert_eq!(
            d.peers[&A].allowed_ips,
            vec!["10.1.0.0/16".parse::<IpNet>().unwrap(), "10.2.0.0/16".parse().unwrap()]
        );
        let d = observe_device(&read(true, "192.0.2.1:1", &[("10.1.0.0", 16), ("fd00::", 64)]), None).unwrap();
        let want = peer(A, Some("192.0.2.1:1"), &["10.1.0.0/16"], 25);
        assert_ne!(d.peers[&A], want);
        assert_eq!(d.listen_port, 51820);
    }

    #[test]
    fn stats_take_the_newest_handshake_and_sum_the_bytes() {
        let mut r = read(true, "192.0.2.1:1", &[]);
        let mut second = r.peers[0].clone();
        second.public_key = B;
        second.endpoint = Some("192.0.2.2:1".parse().unwrap());
        second.last_handshake = Some(1_700_000_100);
        r.peers.push(second);
        let st = stats_of(&r);
        assert_eq!(st.last_handshake_unix, Some(1_700_000_100));
        assert_eq!(st.endpoint, Some("192.0.2.2:1".parse().unwrap()));
        assert_eq!((st.rx_bytes, st.tx_bytes), (20, 40));
        let never = ReadDevice::default();
        assert_eq!(stats_of(&never).last_handshake_unix, None);
    }
}
