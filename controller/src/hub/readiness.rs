//! What users and peers are told of a peering's readiness: whether the
//! agents connected to this replica applied its routes
//! ([`Hub::behind_on`]), the state shown ([`Hub::peering_status`]) and
//! what this site tells the peer ([`Hub::readiness_for`]).

use std::collections::HashMap;
use std::sync::Arc;

use weft_proto::v1 as pb;

use super::index::Mark;
use super::{AgentKey, Hub, Slot};
use crate::domain::Peering;
use crate::render::Model;
use crate::state::Key;

/// The revision of the latest change to what each peering renders: a
/// change to it (Mark::Peering) or to everything (Mark::Everyone).
#[derive(Debug, Default)]
pub(super) struct RouteRevs {
    everyone: i64,
    peerings: HashMap<String, i64>,
}

impl RouteRevs {
    /// Store event `key` at `revision` made `mark` (the model now `model`).
    pub(super) fn note(&mut self, mark: &Mark, key: Key, revision: i64, model: &Model) {
        match mark {
            Mark::Everyone => self.everyone = revision,
            Mark::Peering(name, sharing) => {
                for p in std::iter::once(name).chain(sharing) {
                    self.peerings.insert(p.clone(), revision);
                }
            }
            _ => {}
        }
        if let Key::Peering(name) = key
            && !model.peerings.contains_key(name)
        {
            self.peerings.remove(name);
        }
    }
}

impl Hub {
    /// The agents connected to this replica (and live) that have not yet
    /// applied the latest change to what peering `site` renders.
    pub fn behind_on(&self, site: &str) -> Vec<AgentKey> {
        let since = {
            let revs = self.route_revs.lock().unwrap();
            revs.peerings.get(site).copied().unwrap_or(0).max(revs.everyone)
        };
        let slots: Vec<(AgentKey, Arc<Slot>)> = self.streams.all();
        let book = self.liveness.book.lock().unwrap();
        let live = &book.live;
        let mut behind: Vec<AgentKey> = slots
            .into_iter()
            .filter(|(k, s)| {
                live.get(k)
                    .map(|l| l.last.applied_revision)
                    .is_some_and(|applied| applied < since && !s.current(applied))
            })
            .map(|(k, _)| k)
            .collect();
        behind.sort_by(|a, b| a.1.cmp(&b.1));
        behind
    }

    /// A peering's state as users see it, and what it waits for: a
    /// negotiated peering is Connected once its tunnel's probe is
    /// answered, every agent connected here applied its routes, and the
    /// peer says its agents did too and use this site's active gateway;
    /// Connecting until then.
    pub fn peering_status(&self, p: &Peering) -> (crate::domain::PeeringState, Vec<String>) {
        use crate::domain::PeeringState;
        if p.state != PeeringState::Negotiated {
            return (p.state, Vec::new());
        }
        let model = self.model();
        let active = crate::render::active_gateway(&model).map(|g| g.name.clone());
        let mut waiting = Vec::new();
        if active.is_none() {
            waiting.push("a live gateway of this site".to_string());
        }
        match self.tunnel(&p.site_id) {
            Some(t) if t.up => {}
            Some(t) if t.last_handshake.is_some() => {
                waiting.push("an answer to the probe through the tunnel (it has a handshake)".into())
            }
            Some(_) => waiting.push("the tunnel's first handshake".into()),
            None => waiting.push("a report of the tunnel from this site's gateways".into()),
        }
        let behind = self.behind_on(&p.site_id);
        if !behind.is_empty() {
            let mut names: Vec<String> = behind
                .iter()
                .take(5)
                .map(|(r, n)| format!("{} {n}", r.as_str()))
                .collect();
            if behind.len() > 5 {
                names.push(format!("{} more", behind.len() - 5));
            }
            waiting.push(format!("this site's agents to apply its routes: {}", names.join(", ")));
        }
        if let Some(r) = p.remote.as_ref().and_then(|r| r.readiness.as_ref()) {
            if !r.routes_applied {
                waiting.push(format!("site {:?}'s agents to apply its routes", p.site_id));
            }
            if let Some(a) = &active
                && r.active_gateway != *a
            {
                waiting.push(format!(
                    "site {:?}'s gateways to send the tunnel to gateway {a} (they use {})",
                    p.site_id,
                    if r.active_gateway.is_empty() {
                        "none"
                    } else {
                        &r.active_gateway
                    }
                ));
            }
        }
        if waiting.is_empty() {
            (PeeringState::Connected, waiting)
        } else {
            (PeeringState::Connecting, waiting)
        }
    }

    /// [`Hub::peering_status`]'s state alone.
    pub fn peering_state(&self, p: &Peering) -> crate::domain::PeeringState {
        self.peering_status(p).0
    }

    /// What this site tells peer `site` of its side of their peering.
    pub fn readiness_for(&self, site: &str, model: &Model) -> Option<pb::PeerReadiness> {
        let p = model.peerings.get(site)?;
        let their_active = p
            .remote
            .as_ref()
            .and_then(|r| r.gateways.iter().find(|g| g.active))
            .map(|g| g.name.clone())
            .unwrap_or_default();
        Some(pb::PeerReadiness {
            routes_applied: crate::render::active_gateway(model).is_some() && self.behind_on(site).is_empty(),
            active_gateway: their_active,
        })
    }
}
