//! weft's Linux data plane. It plans from observation, like a
//! controller's reconcile:
//!
//! 1. `observe` reads weft's part of the host (`model` decides what is
//!    weft's: names, table, priority) through three seams, [`Netlink`],
//!    [`Firewall`] and [`WireGuard`];
//! 2. `desired::translate` turns the controller's objects, decoded at the
//!    agent's door (`desired::decode`), into the same model;
//! 3. `plan::plan(desired, observed)` is a pure function from the two to
//!    the operations that make them equal;
//! 4. `execute` carries the operations out through the seams.
//!
//! Linux implements the seams in `linux` (rtnetlink), `nft` (nftables)
//! and, for WireGuard, `kernel` (the kernel module, over netlink) or
//! `userspace` (weft's own device, the `weft-wg-device` crate), chosen per gateway
//! ([`driver::Driver`]); `fake` implements all three in memory for
//! tests of the planner. [`DataPlane::reconcile`] runs the four steps.

pub mod desired;
pub mod driver;
pub mod fake;
pub mod host;
pub mod kernel;
pub mod lan;
pub mod linux;
pub mod model;
pub mod nft;
pub mod nftgen;
mod nl;
pub mod offload;
pub mod plan;
pub mod relay;
pub mod userspace;

use std::collections::BTreeSet;

use crate::desired::{LinkSpec, Object};
use crate::model::Ns;
use crate::plan::Op;
pub use host::{Firewall, Netlink, WireGuard};

/// Runs blocking `f` (a UAPI request, a probe of the kernel) without
/// holding up other tasks: on a multi-threaded runtime the worker hands its
/// tasks to the others first.
pub fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// What one reconcile did.
#[derive(Debug, Default)]
pub struct Outcome {
    /// (object id, why) for each object not (wholly) applied.
    pub errors: Vec<(String, String)>,
    /// The whole reconcile failed before planning (the host could not be
    /// read): every object of the batch is in doubt.
    pub failed: Option<String>,
    /// Operations carried out: each one repaired or changed the host.
    pub done: u64,
    /// WireGuard links made (anew) in this reconcile.
    pub fresh_wireguard: BTreeSet<String>,
    /// WireGuard links whose peers changed.
    pub peers_changed: BTreeSet<String>,
    /// The MTU each desired link got (rendered, or from the underlay).
    pub mtus: std::collections::BTreeMap<String, u32>,
}

/// A host's data plane behind its three seams.
#[derive(Debug)]
pub struct DataPlane<N, F, W> {
    pub net: N,
    pub fw: F,
    pub wg: W,
    /// Whether this host is a node (it counts its traffic per peer).
    pub node: bool,
    /// This host's underlay address (sizes links rendered without an MTU).
    pub underlay: Option<std::net::IpAddr>,
    /// What the last reconcile left, when it left exactly what it wanted
    /// (every operation done, nothing refused): a change plans from it
    /// instead of reading the host (on a slow host that read took seconds,
    /// a failover's change among them); a resync reads the host, repairs
    /// drift and sets it anew; any error forgets it.
    pub believed: Option<host::Observation>,
}

/// The namespaces objects name: those they create and those they live in.
pub fn namespaces_of<'a>(objects: impl IntoIterator<Item = &'a Object>) -> BTreeSet<Ns> {
    let mut out = BTreeSet::new();
    for o in objects {
        let ns = match o {
            Object::Namespace(n) => n.clone(),
            Object::Link(l) => {
                if let LinkSpec::Veth { peer_ns, .. } = &l.kind {
                    out.insert(peer_ns.clone());
                }
                l.ns.clone()
            }
            Object::Address(a) => a.ns.clone(),
            Object::Route(r) => r.route.ns.clone(),
            Object::Rule(r) => r.ns.clone(),
            Object::NatMap { ns, .. }
            | Object::WireguardPeer { ns, .. }
            | Object::ExportMap { ns, .. }
            | Object::TunnelFilter { ns, .. } => ns.clone(),
            Object::HostSnat(_)
            | Object::DnsRecord(_)
            | Object::RelaySession(_)
            | Object::LanAddress
            | Object::RelayTls { .. } => String::new(),
        };
        out.insert(ns);
    }
    out.remove("");
    out
}

impl<N: Netlink, F: Firewall, W: WireGuard> DataPlane<N, F, W> {
    /// Makes the host hold `objects` (the whole desired state, decoded, by
    /// id): observes
    /// the agent's namespace and those of `claimed` (namespaces weft made:
    /// the only ones it may remove; those `objects` name are added) within
    /// `scopes` (None: all of them), plans, and carries the plan out.
    pub async fn reconcile<'a>(
        &mut self,
        objects: impl IntoIterator<Item = (&'a str, &'a Object)>,
        claimed: &BTreeSet<Ns>,
        scopes: Option<&BTreeSet<Ns>>,
    ) -> Outcome {
        let objects: Vec<(&str, &Object)> = objects.into_iter().collect();
        let mut claimed = claimed.clone();
        claimed.extend(namespaces_of(objects.iter().map(|(_, o)| *o)));
        let mut out = Outcome::default();
        let started = std::time::Instant::now();
        // Kept while only reading: a resync that a change stops while it
        // reads the host (seconds on a slow host) leaves the belief to that
        // change. Taken once the host is about to change: kept again only
        // if this reconcile leaves what it wants.
        let from_belief = scopes.is_some() && self.believed.is_some();
        let seen = match (scopes, &self.believed) {
            (Some(scopes), Some(b)) => b.clone().within(&claimed, scopes),
            _ => match host::observe(&mut self.net, &mut self.fw, &mut self.wg, &claimed, scopes).await {
                Ok(s) => s,
                Err(e) => {
                    self.believed = None;
                    out.failed = Some(format!("cannot read the host's network: {e}"));
                    return out;
                }
            },
        };
        let facts = desired::Facts::from_raw(&seen.host, self.underlay);
        let (want, bad) = desired::translate(objects, &facts, self.node);
        out.errors = bad;
        out.mtus = want.state.links.values().map(|l| (l.name.clone(), l.mtu)).collect();
        let ops = plan::plan(&want, &seen.state, &seen.scopes);
        let observed = started.elapsed();
        if !ops.is_empty() {
            tracing::debug!(operations = ops.len(), plan = ?ops, "applying the plan");
        }
        let prior = self.believed.take();
        let results = host::execute(&mut self.net, &mut self.fw, &mut self.wg, &ops).await;
        let mut clean = true;
        tracing::debug!(
            namespaces = seen.scopes.len(),
            from_belief,
            observe_ms = observed.as_millis() as u64,
            execute_ms = (started.elapsed() - observed).as_millis() as u64,
            operations = ops.len(),
            "reconciled"
        );
        for (op, r) in ops.iter().zip(results) {
            match r {
                Ok(()) => {
                    out.done += 1;
                    match op {
                        Op::AddWireguard(l) => {
                            out.fresh_wireguard.insert(l.name.clone());
                        }
                        Op::SetPeer { link, .. } | Op::RemovePeer { link, .. } => {
                            out.peers_changed.insert(link.clone());
                        }
                        _ => {}
                    }
                }
                Err(e) => {
                    clean = false;
                    match op.origin(&want.origins) {
                        Some(id) => out.errors.push((id.to_string(), e)),
                        None => {
                            tracing::warn!(operation = ?op, error = %e, "could not remove what weft no longer wants")
                        }
                    }
                }
            }
        }
        // The host now holds what was wanted within the namespaces planned
        // (and those this reconcile made): the next change may plan from
        // it. Only a whole read (a resync, the start) starts a belief; a
        // change read from the host saw only its namespaces.
        if clean && out.errors.is_empty() {
            let base = match scopes {
                None => Some(host::Observation::default()),
                Some(_) if from_belief => prior,
                Some(_) => None,
            };
            if let Some(mut b) = base {
                let mut touched = seen.scopes.clone();
                touched.extend(want.state.namespaces.iter().cloned());
                b.state.replace_within(&want.state, &touched);
                b.host = seen.host;
                self.believed = Some(b);
            }
        }
        out
    }
}
