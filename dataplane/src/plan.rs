//! `plan(desired, observed) -> operations`: pure, like a controller's
//! reconcile. What differs is repaired, what is weft's but not desired is
//! removed, and nothing outside weft's ownership (see `model`) is ever named
//! in an operation.
//!
//! Order: namespaces first; then removals, innermost first (rules, routes,
//! addresses, WireGuard peers, links, namespaces, tables); then additions,
//! outermost first (links, link settings, addresses, routes, rules, peers,
//! tables). A link that must be replaced (a VXLAN toward another remote,
//! say) is removed and made anew, and because the kernel took its addresses
//! and routes with it, those are planned again even where they did not
//! change.

use std::collections::{BTreeMap, BTreeSet};

use crate::model::*;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    CreateNamespace(Ns),
    SetForwarding(Ns, Family),
    DelRule(Rule),
    DelRoute(Route),
    DelAddress(Address),
    RemovePeer {
        ns: Ns,
        link: String,
        public_key: WgKey,
    },
    /// Removes a link (either end of a veth pair removes both).
    DelLink {
        ns: Ns,
        name: String,
    },
    /// Removes a WireGuard device and its interface.
    DelWireguard {
        ns: Ns,
        name: String,
    },
    DeleteNamespace(Ns),
    /// Removes a table of weft's, by "family name" (`inet weft`).
    DelTable {
        ns: Ns,
        name: String,
    },
    /// Makes a link (a veth pair: both ends, the peer moved into its
    /// namespace), up, with its MTU.
    AddLink(Link),
    /// Makes a WireGuard device (in the agent's namespace, so that its UDP
    /// socket stays on the underlay) and moves its interface into `ns`.
    AddWireguard(Link),
    /// Sets an existing link up, with `mtu` unless 0.
    SetLink {
        ns: Ns,
        name: String,
        mtu: u32,
    },
    AddAddress(Address),
    /// Adds or replaces the route with its key.
    SetRoute(Route),
    AddRule(Rule),
    SetPeer {
        ns: Ns,
        link: String,
        peer: WgPeer,
    },
    /// Replaces weft's table in `ns` with `spec`, atomically.
    SetTable {
        ns: Ns,
        spec: TableSpec,
    },
}

impl Op {
    /// The namespace the operation runs in.
    pub fn ns(&self) -> &str {
        match self {
            Op::CreateNamespace(_) | Op::DeleteNamespace(_) => "",
            Op::SetForwarding(ns, _) => ns,
            Op::DelRule(r) | Op::AddRule(r) => &r.ns,
            Op::DelRoute(r) | Op::SetRoute(r) => &r.ns,
            Op::DelAddress(a) | Op::AddAddress(a) => &a.ns,
            Op::AddLink(l) => &l.ns,
            Op::AddWireguard(_) => "",
            Op::RemovePeer { ns, .. }
            | Op::DelLink { ns, .. }
            | Op::DelWireguard { ns, .. }
            | Op::DelTable { ns, .. }
            | Op::SetLink { ns, .. }
            | Op::SetPeer { ns, .. }
            | Op::SetTable { ns, .. } => ns,
        }
    }

    /// The controller object the operation serves, if it serves one (a
    /// removal of something undesired serves none).
    pub fn origin<'a>(&self, o: &'a Origins) -> Option<&'a str> {
        let s = match self {
            Op::CreateNamespace(ns) | Op::SetForwarding(ns, _) => o.namespaces.get(ns),
            Op::AddLink(l) | Op::AddWireguard(l) => o.links.get(&(l.ns.clone(), l.name.clone())),
            Op::SetLink { ns, name, .. } => o.links.get(&(ns.clone(), name.clone())),
            Op::AddAddress(a) => o.addresses.get(a),
            Op::SetRoute(r) => o.routes.get(&r.key()),
            Op::AddRule(r) => o.rules.get(r),
            Op::SetPeer { ns, link, peer } => o.peers.get(&(ns.clone(), link.clone(), peer.public_key)),
            Op::SetTable { ns, .. } => o.tables.get(ns).and_then(|v| v.first()),
            _ => None,
        };
        s.map(String::as_str)
    }
}

/// Whether observed link `o` is what desired link `d` asks for (its kind
/// and settings; MTU and state are set in place, see `SetLink`).
fn same_kind(d: &LinkKind, o: &LinkKind) -> bool {
    match (d, o) {
        (LinkKind::Veth { .. } | LinkKind::VethEnd, LinkKind::VethEnd) => true,
        _ => d == o,
    }
}

/// The operations that turn `observed` into `desired` within `scopes`
/// (the namespaces observed; "" is the agent's own). Objects in other
/// namespaces are left alone; namespaces to create are planned whole.
pub fn plan(desired: &Desired, observed: &State, scopes: &BTreeSet<Ns>) -> Vec<Op> {
    let d = &desired.state;
    let o = observed;
    let creating: BTreeSet<Ns> = d.namespaces.difference(&o.namespaces).cloned().collect();
    let deleting: BTreeSet<Ns> = o.namespaces.difference(&d.namespaces).cloned().collect();
    let mut p = Planner {
        desired,
        d,
        o,
        scopes,
        creating,
        deleting,
        gone: BTreeSet::new(),
        readdressed: BTreeSet::new(),
        ops: Vec::new(),
    };
    p.namespaces();
    let link_dels = p.links_to_remove();
    p.removals(link_dels);
    p.additions();
    p.ops
}

/// One planning: what both states hold, and what is planned so far.
struct Planner<'a> {
    desired: &'a Desired,
    d: &'a State,
    o: &'a State,
    scopes: &'a BTreeSet<Ns>,
    creating: BTreeSet<Ns>,
    deleting: BTreeSet<Ns>,
    /// Links that will be gone after the removals: undesired, to be
    /// replaced, or the other end of such a veth pair.
    gone: BTreeSet<(Ns, String)>,
    /// Links that stay but lose an address (one replaced by its other
    /// form, say): the kernel drops the routes through a link that loses
    /// its last address, so those are set again.
    readdressed: BTreeSet<(Ns, String)>,
    ops: Vec<Op>,
}

impl Planner<'_> {
    /// Whether namespace `ns` is planned in: observed or made now, and not
    /// to be removed.
    fn live(&self, ns: &Ns) -> bool {
        (ns.is_empty() || self.scopes.contains(ns) || self.creating.contains(ns)) && !self.deleting.contains(ns)
    }

    /// Whether weft's table in `ns` is to be written.
    fn rewrites_table(&self, ns: &Ns) -> bool {
        let Some(version) = self.d.tables.get(ns) else {
            return false;
        };
        self.creating.contains(ns) || self.o.tables.get(ns) != Some(version)
    }

    fn link_stays(&self, ns: &Ns, name: &str) -> bool {
        !self.gone.contains(&(ns.clone(), name.to_string()))
    }

    /// Whether link `link` of `ns` will be new (so all on it is to add).
    fn fresh(&self, ns: &Ns, link: &str) -> bool {
        self.creating.contains(ns)
            || !self.link_stays(ns, link)
            || !self.o.links.contains_key(&(ns.clone(), link.to_string()))
    }

    fn namespaces(&mut self) {
        let mut ops: Vec<Op> = self.creating.iter().map(|ns| Op::CreateNamespace(ns.clone())).collect();
        for (ns, family) in self.d.forwarding.iter().filter(|(ns, _)| self.live(ns)) {
            if self.creating.contains(ns) || !self.o.forwarding.contains(&(ns.clone(), *family)) {
                ops.push(Op::SetForwarding(ns.clone(), *family));
            }
        }
        self.ops.extend(ops);
    }

    /// Fills `gone` and returns the link removals.
    fn links_to_remove(&mut self) -> Vec<Op> {
        let (d, o) = (self.d, self.o);
        let mut dels = Vec::new();
        let mut gone = BTreeSet::new();
        for (k, ol) in o.links.iter().filter(|(k, _)| self.live(&k.0)) {
            let replace = match d.links.get(k) {
                None => true,
                Some(dl) => !same_kind(&dl.kind, &ol.kind) || !pair_intact(dl, o, d, &|ns| self.live(ns)),
            };
            if replace {
                gone.insert(k.clone());
                let (ns, name) = (k.0.clone(), k.1.clone());
                dels.push(match ol.kind {
                    LinkKind::Wireguard { .. } => Op::DelWireguard { ns, name },
                    _ => Op::DelLink { ns, name },
                });
            }
        }
        self.gone = gone;
        // A namespace that goes takes its links with it, unless something
        // still holds it (a process inside, a bind mount elsewhere): then
        // its WireGuard link would live on with its UDP port. Removed
        // first, explicitly (which also stops a userspace device's socket,
        // itself a holder).
        for (k, ol) in o.links.iter().filter(|(k, _)| self.deleting.contains(&k.0)) {
            if let LinkKind::Wireguard { .. } = ol.kind {
                dels.push(Op::DelWireguard {
                    ns: k.0.clone(),
                    name: k.1.clone(),
                });
            }
        }
        // The other end of a removed veth pair goes with it.
        for dl in d.links.values() {
            if let LinkKind::Veth { peer, peer_ns } = &dl.kind {
                let outer = (dl.ns.clone(), dl.name.clone());
                let inner = (peer_ns.clone(), peer.clone());
                if self.gone.contains(&outer) || self.gone.contains(&inner) || !o.links.contains_key(&outer) {
                    self.gone.insert(outer);
                    self.gone.insert(inner);
                }
            }
        }
        dels
    }

    /// Removals, innermost first: rules, routes, addresses, peers, links,
    /// namespaces, tables. What goes with a link or a namespace anyway is
    /// not removed on its own.
    fn removals(&mut self, link_dels: Vec<Op>) {
        let (d, o) = (self.d, self.o);
        let mut ops = Vec::new();
        for r in o.rules.iter().filter(|r| self.live(&r.ns)) {
            if !d.rules.contains(r) {
                ops.push(Op::DelRule(r.clone()));
            }
        }
        for (k, r) in o.routes.iter().filter(|(k, _)| self.live(&k.0)) {
            let on_gone = r.dev.as_ref().is_some_and(|dev| !self.link_stays(&r.ns, dev));
            if !d.routes.contains_key(k) && !on_gone {
                ops.push(Op::DelRoute(r.clone()));
            }
        }
        let mut readdressed = BTreeSet::new();
        for a in o.addresses.iter().filter(|a| self.live(&a.ns)) {
            if !d.addresses.contains(a) && self.link_stays(&a.ns, &a.link) {
                ops.push(Op::DelAddress(a.clone()));
                readdressed.insert((a.ns.clone(), a.link.clone()));
            }
        }
        self.readdressed = readdressed;
        for ((ns, link), peers) in o.peers.iter().filter(|((ns, _), _)| self.live(ns)) {
            if !self.link_stays(ns, link) {
                continue;
            }
            let want = d.peers.get(&(ns.clone(), link.clone()));
            for key in peers.keys().filter(|k| !want.is_some_and(|w| w.contains_key(*k))) {
                ops.push(Op::RemovePeer {
                    ns: ns.clone(),
                    link: link.clone(),
                    public_key: *key,
                });
            }
        }
        ops.extend(link_dels);
        ops.extend(self.deleting.iter().map(|ns| Op::DeleteNamespace(ns.clone())));
        for (ns, name) in o.stray_tables.iter().filter(|(ns, _)| self.live(ns)) {
            // The table of earlier versions goes in the same transaction
            // that writes its successor (see `nft::batch`): never a moment
            // without weft's filter and NAT.
            if *name == LEGACY_TABLE && self.rewrites_table(ns) {
                continue;
            }
            ops.push(Op::DelTable {
                ns: ns.clone(),
                name: name.clone(),
            });
        }
        for ns in o
            .tables
            .keys()
            .filter(|ns| self.live(ns) && !d.tables.contains_key(*ns))
        {
            ops.push(Op::DelTable {
                ns: ns.clone(),
                name: OWN_TABLE.into(),
            });
        }
        self.ops.extend(ops);
    }

    /// Additions, outermost first: links (and settings of existing ones),
    /// addresses, routes, rules, peers, tables.
    fn additions(&mut self) {
        let (d, o) = (self.d, self.o);
        let mut ops = Vec::new();
        for (k, dl) in d.links.iter().filter(|(k, _)| self.live(&k.0)) {
            let exists = o.links.contains_key(k) && !self.gone.contains(k) && !self.creating.contains(&k.0);
            if exists {
                let ol = &o.links[k];
                if !ol.up || (dl.mtu != 0 && dl.mtu != ol.mtu) {
                    ops.push(Op::SetLink {
                        ns: k.0.clone(),
                        name: k.1.clone(),
                        mtu: dl.mtu,
                    });
                }
                continue;
            }
            match dl.kind {
                LinkKind::Wireguard { .. } => ops.push(Op::AddWireguard(dl.clone())),
                // Made with its outer end.
                LinkKind::VethEnd => {}
                _ => ops.push(Op::AddLink(dl.clone())),
            }
        }
        for a in d.addresses.iter().filter(|a| self.live(&a.ns)) {
            if self.fresh(&a.ns, &a.link) || !o.addresses.contains(a) {
                ops.push(Op::AddAddress(a.clone()));
            }
        }
        // Routes to a link first: a route through a gateway is refused
        // until the kernel can reach that gateway, which may be by one of
        // them (an address added without its prefix route).
        let (on_link, via): (Vec<_>, Vec<_>) = d.routes.iter().partition(|(_, r)| r.gateway.is_none());
        for (k, r) in on_link.into_iter().chain(via).filter(|(k, _)| self.live(&k.0)) {
            let on_fresh = r
                .dev
                .as_ref()
                .is_some_and(|dev| self.fresh(&r.ns, dev) || self.readdressed.contains(&(r.ns.clone(), dev.clone())));
            if on_fresh || self.creating.contains(&r.ns) || o.routes.get(k) != Some(r) {
                ops.push(Op::SetRoute(r.clone()));
            }
        }
        for r in d.rules.iter().filter(|r| self.live(&r.ns)) {
            if self.creating.contains(&r.ns) || !o.rules.contains(r) {
                ops.push(Op::AddRule(r.clone()));
            }
        }
        let none = BTreeMap::new();
        for ((ns, link), peers) in d.peers.iter().filter(|((ns, _), _)| self.live(ns)) {
            let have = if self.fresh(ns, link) {
                &none
            } else {
                o.peers.get(&(ns.clone(), link.clone())).unwrap_or(&none)
            };
            for (_, p) in peers.iter().filter(|(key, p)| have.get(*key) != Some(*p)) {
                ops.push(Op::SetPeer {
                    ns: ns.clone(),
                    link: link.clone(),
                    peer: p.clone(),
                });
            }
        }
        for ns in d.tables.keys().filter(|ns| self.live(ns)) {
            if self.rewrites_table(ns) {
                ops.push(Op::SetTable {
                    ns: ns.clone(),
                    spec: self.desired.specs.get(ns).cloned().unwrap_or_default(),
                });
            }
        }
        self.ops.extend(ops);
    }
}

/// For the outer end of a desired veth pair: whether its inner end is there
/// too (assumed when its namespace was not observed).
fn pair_intact(dl: &Link, o: &State, d: &State, live: &dyn Fn(&Ns) -> bool) -> bool {
    match &dl.kind {
        LinkKind::Veth { peer, peer_ns } => !live(peer_ns) || o.links.contains_key(&(peer_ns.clone(), peer.clone())),
        // An inner end without its outer end: made anew with the pair.
        LinkKind::VethEnd => d.links.values().any(|x| match &x.kind {
            LinkKind::Veth { peer, peer_ns } if *peer == dl.name && *peer_ns == dl.ns => {
                o.links.contains_key(&(x.ns.clone(), x.name.clone()))
            }
            _ => false,
        }),
        _ => true,
    }
}
