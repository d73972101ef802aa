//! A host in memory that implements netlink, the firewall and WireGuard
//! with the kernel's semantics where planning depends on them: removing a
//! link takes its addresses and the routes through it, either end of a veth
//! pair takes the other, removing a namespace takes all it holds, and
//! adding to something missing fails. For unit and property tests of the
//! planner; never a replacement for the end-to-end tests on real kernels.

use std::collections::{BTreeMap, BTreeSet};

use crate::host::{Firewall, Netlink, R, WgDevice, WireGuard};
use crate::model::*;
use crate::plan::Op;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FakeNs {
    pub links: BTreeMap<String, Link>,
    pub addresses: BTreeSet<Address>,
    pub routes: BTreeMap<(u32, ipnet::IpNet), RawRoute>,
    pub rules: BTreeSet<Rule>,
    pub forwarding: BTreeSet<Family>,
    /// Tables by name: weft's version, or None (not weft's, or edited).
    pub tables: BTreeMap<String, Option<u64>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeHost {
    /// By namespace; "" is the host's own and always there.
    pub ns: BTreeMap<Ns, FakeNs>,
    /// Each veth end's other end.
    pub pairs: BTreeMap<(Ns, String), (Ns, String)>,
    pub devices: BTreeMap<(Ns, String), WgDevice>,
    /// Operations carried out (a failed one included).
    pub ops: usize,
}

impl Default for FakeHost {
    fn default() -> Self {
        FakeHost {
            ns: [(String::new(), FakeNs::default())].into(),
            pairs: BTreeMap::new(),
            devices: BTreeMap::new(),
            ops: 0,
        }
    }
}

impl FakeHost {
    fn space(&mut self, ns: &Ns) -> R<&mut FakeNs> {
        self.ns
            .get_mut(ns)
            .ok_or_else(|| format!("namespace {ns:?} does not exist"))
    }

    /// Removes link `name` of `ns` and what the kernel removes with it.
    fn drop_link(&mut self, ns: &Ns, name: &str) {
        let key = (ns.clone(), name.to_string());
        self.devices.remove(&key);
        if let Some(s) = self.ns.get_mut(ns) {
            s.links.remove(name);
            s.addresses.retain(|a| a.link != name);
            s.routes.retain(|_, r| r.route.dev.as_deref() != Some(name));
        }
        if let Some(other) = self.pairs.remove(&key) {
            self.pairs.remove(&other);
            self.drop_link(&other.0, &other.1);
        }
    }

    fn add_link(&mut self, l: &Link) -> R<()> {
        let mtu = if l.mtu == 0 { 1500 } else { l.mtu };
        if self.space(&l.ns)?.links.contains_key(&l.name) {
            return Err(format!("link {} exists", l.name));
        }
        let mut made = l.clone();
        made.mtu = mtu;
        made.up = true;
        if let LinkKind::Veth { peer, peer_ns } = &l.kind {
            if self.space(peer_ns)?.links.contains_key(peer) {
                return Err(format!("link {peer} exists in {peer_ns:?}"));
            }
            made.kind = LinkKind::VethEnd;
            let inner = Link {
                ns: peer_ns.clone(),
                name: peer.clone(),
                kind: LinkKind::VethEnd,
                mtu,
                up: true,
            };
            self.space(peer_ns)?.links.insert(peer.clone(), inner);
            let (a, b) = ((l.ns.clone(), l.name.clone()), (peer_ns.clone(), peer.clone()));
            self.pairs.insert(a.clone(), b.clone());
            self.pairs.insert(b, a);
        }
        self.space(&l.ns)?.links.insert(l.name.clone(), made);
        Ok(())
    }

    fn apply_one(&mut self, op: &Op) -> R<()> {
        match op {
            Op::CreateNamespace(n) => {
                if self.ns.contains_key(n) {
                    return Err(format!("namespace {n} exists"));
                }
                self.ns.insert(n.clone(), FakeNs::default());
            }
            Op::DeleteNamespace(n) => {
                let names: Vec<String> = self
                    .ns
                    .get(n)
                    .map(|s| s.links.keys().cloned().collect())
                    .unwrap_or_default();
                for name in names {
                    self.drop_link(n, &name);
                }
                self.ns.remove(n);
            }
            Op::SetForwarding(ns, f) => {
                self.space(ns)?.forwarding.insert(*f);
            }
            Op::DelRule(r) => {
                self.space(&r.ns)?.rules.remove(r);
            }
            Op::DelRoute(r) => {
                self.space(&r.ns)?.routes.remove(&(r.table, r.dst));
            }
            Op::DelAddress(a) => {
                self.space(&a.ns)?.addresses.remove(a);
            }
            Op::DelLink { ns, name } => self.drop_link(ns, name),
            Op::AddLink(l) => self.add_link(l)?,
            Op::SetLink { ns, name, mtu } => {
                let l = self
                    .space(ns)?
                    .links
                    .get_mut(name)
                    .ok_or_else(|| format!("link {name} does not exist"))?;
                l.up = true;
                if *mtu != 0 {
                    l.mtu = *mtu;
                }
            }
            Op::AddAddress(a) => {
                let s = self.space(&a.ns)?;
                if !s.links.contains_key(&a.link) {
                    return Err(format!("link {} does not exist", a.link));
                }
                s.addresses.insert(a.clone());
            }
            Op::SetRoute(r) => {
                let s = self.space(&r.ns)?;
                if let Some(dev) = &r.dev
                    && !s.links.contains_key(dev)
                {
                    return Err(format!("link {dev} does not exist"));
                }
                s.routes.insert(
                    (r.table, r.dst),
                    RawRoute {
                        route: r.clone(),
                        kernel: false,
                        special: false,
                    },
                );
            }
            Op::AddRule(r) => {
                self.space(&r.ns)?.rules.insert(r.clone());
            }
            Op::AddWireguard(l) => {
                let LinkKind::Wireguard { listen_port } = l.kind else {
                    return Err("not a WireGuard link".into());
                };
                self.drop_link(&l.ns, &l.name);
                let mut tun = l.clone();
                tun.kind = LinkKind::Other("tun".into());
                self.add_link(&tun)?;
                self.devices.insert(
                    (l.ns.clone(), l.name.clone()),
                    WgDevice {
                        listen_port,
                        peers: BTreeMap::new(),
                    },
                );
            }
            Op::DelWireguard { ns, name } => self.drop_link(ns, name),
            Op::SetPeer { ns, link, peer } => {
                let d = self
                    .devices
                    .get_mut(&(ns.clone(), link.clone()))
                    .ok_or_else(|| format!("no WireGuard device {link}"))?;
                d.peers.insert(peer.public_key, peer.clone());
            }
            Op::RemovePeer { ns, link, public_key } => {
                if let Some(d) = self.devices.get_mut(&(ns.clone(), link.clone())) {
                    d.peers.remove(public_key);
                }
            }
            Op::SetTable { ns, spec } => {
                // As `nft::batch`: the table of earlier versions goes too.
                let space = self.space(ns)?;
                space.tables.remove(LEGACY_TABLE);
                space.tables.insert(OWN_TABLE.into(), Some(spec.version()));
            }
            Op::DelTable { ns, name } => {
                self.space(ns)?.tables.remove(name);
            }
        }
        Ok(())
    }

    /// Carries out one operation, as the host's implementations would.
    pub fn carry_out(&mut self, op: &Op) -> R<()> {
        self.ops += 1;
        self.apply_one(op)
    }
}

/// A handle on a shared [`FakeHost`]: clones of one handle are its
/// netlink, firewall and WireGuard.
#[derive(Clone, Debug, Default)]
pub struct Fake(pub std::sync::Arc<std::sync::Mutex<FakeHost>>);

impl Fake {
    pub fn new(host: FakeHost) -> Fake {
        Fake(std::sync::Arc::new(std::sync::Mutex::new(host)))
    }

    pub fn host(&self) -> std::sync::MutexGuard<'_, FakeHost> {
        self.0.lock().unwrap()
    }
}

#[async_trait::async_trait]
impl Netlink for Fake {
    async fn namespaces(&mut self) -> R<BTreeSet<Ns>> {
        Ok(self.host().ns.keys().filter(|n| !n.is_empty()).cloned().collect())
    }

    async fn read(&mut self, ns: &Ns) -> R<RawNs> {
        let s = self.host().space(ns)?.clone();
        Ok(RawNs {
            links: s.links.into_values().collect(),
            addresses: s.addresses.into_iter().collect(),
            routes: s.routes.into_values().collect(),
            rules: s.rules.into_iter().collect(),
            forwarding: s.forwarding,
            tables: BTreeMap::new(),
        })
    }

    async fn apply(&mut self, _ns: &Ns, ops: &[Op]) -> Vec<R<()>> {
        let mut h = self.host();
        ops.iter().map(|op| h.carry_out(op)).collect()
    }
}

#[async_trait::async_trait]
impl Firewall for Fake {
    async fn tables(&mut self, ns: &Ns) -> R<BTreeMap<String, Option<u64>>> {
        Ok(self.host().space(ns)?.tables.clone())
    }

    async fn set_table(&mut self, ns: &Ns, spec: &TableSpec) -> R<()> {
        self.host().carry_out(&Op::SetTable {
            ns: ns.clone(),
            spec: spec.clone(),
        })
    }

    async fn delete_table(&mut self, ns: &Ns, name: &str) -> R<()> {
        self.host().carry_out(&Op::DelTable {
            ns: ns.clone(),
            name: name.into(),
        })
    }
}

#[async_trait::async_trait]
impl WireGuard for Fake {
    async fn devices(&mut self, scopes: &BTreeSet<Ns>) -> BTreeMap<(Ns, String), WgDevice> {
        let mut d = self.host().devices.clone();
        d.retain(|(ns, _), _| scopes.contains(ns));
        d
    }

    async fn create(&mut self, link: &Link) -> R<()> {
        self.host().carry_out(&Op::AddWireguard(link.clone()))
    }

    async fn remove(&mut self, ns: &Ns, name: &str) -> R<()> {
        self.host().carry_out(&Op::DelWireguard {
            ns: ns.clone(),
            name: name.into(),
        })
    }

    async fn set_peer(&mut self, ns: &Ns, link: &str, peer: &WgPeer) -> R<()> {
        self.host().carry_out(&Op::SetPeer {
            ns: ns.clone(),
            link: link.into(),
            peer: peer.clone(),
        })
    }

    async fn remove_peer(&mut self, ns: &Ns, link: &str, public_key: &WgKey) -> R<()> {
        self.host().carry_out(&Op::RemovePeer {
            ns: ns.clone(),
            link: link.into(),
            public_key: *public_key,
        })
    }
}
