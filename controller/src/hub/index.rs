//! A store record into the hub's model, and whom the change concerns.

use std::sync::Arc;

use crate::domain::{AgentRole, Gateway, Node, Peering, Site};
use crate::render::Model;
use crate::state::Key;

/// An agent record as the hub compares it.
trait AgentRecord: serde::de::DeserializeOwned + Clone + PartialEq {
    /// The record without its certificates (which render nothing).
    fn without_certs(&self) -> Self;
    fn in_conflict(&self) -> bool;
}

impl AgentRecord for Node {
    fn without_certs(&self) -> Self {
        Node {
            certs: vec![],
            ..self.clone()
        }
    }
    fn in_conflict(&self) -> bool {
        self.identity_conflict.is_some()
    }
}

impl AgentRecord for Gateway {
    fn without_certs(&self) -> Self {
        Gateway {
            certs: vec![],
            ..self.clone()
        }
    }
    fn in_conflict(&self) -> bool {
        self.identity_conflict.is_some()
    }
}

/// What a store event did to an agent's record in the model.
enum AgentChange {
    /// Only its certificates changed, or it could not be read (kept).
    Nothing,
    /// Every certificate of it was revoked (two holders).
    Revoked,
    Changed {
        removed: bool,
    },
}

/// Applies a put (`value`) or a delete (None) of agent record `name` to
/// `records`. An unreadable record is not a removed one: the last one
/// read stays.
fn apply_agent<T: AgentRecord>(
    records: &mut imbl::OrdMap<String, Arc<T>>,
    name: &str,
    value: Option<&[u8]>,
) -> AgentChange {
    let new = match value.map(serde_json::from_slice::<T>) {
        None => None,
        Some(Ok(r)) => Some(Arc::new(r)),
        Some(Err(e)) => {
            tracing::error!(agent = name, error = %e, "cannot read an agent's record; keeping the last one");
            return AgentChange::Nothing;
        }
    };
    let old = match &new {
        Some(r) => records.insert(name.to_string(), r.clone()),
        None => records.remove(name),
    };
    match (&old, &new) {
        (Some(a), Some(b)) if !a.in_conflict() && b.in_conflict() => AgentChange::Revoked,
        (Some(a), Some(b)) if a.without_certs() == b.without_certs() => AgentChange::Nothing,
        _ => AgentChange::Changed { removed: new.is_none() },
    }
}

/// Who to tell about a change, decided while updating the model.
pub(super) enum Mark {
    Everyone,
    Nothing,
    Node {
        name: String,
        removed: bool,
        /// Nodes whose names hash alike: whether they are rendered may
        /// have changed with this one.
        sharing: Vec<String>,
    },
    Gateway {
        name: String,
        removed: bool,
    },
    /// A peering, and the peerings whose ids hash alike.
    Peering(String, Vec<String>),
    /// Every certificate of this agent was revoked.
    Revoked((AgentRole, String)),
    /// A published name: gateways (exports) and peers' parameters.
    Names,
}

/// Brings `model` up to date with record `key` (`value` None: deleted).
/// `None` for a record the model does not hold.
pub(super) fn update(model: &mut Model, key: Key, value: Option<&[u8]>) -> Option<Mark> {
    Some(match key {
        Key::GatewayActive => {
            model.active_gateway = value.map(|v| String::from_utf8_lossy(v).into_owned());
            Mark::Everyone
        }
        Key::Alive(AgentRole::Gateway, name) => {
            if value.is_some() {
                model.live_gateways.insert(name.to_string());
            } else {
                model.live_gateways.remove(name);
            }
            Mark::Nothing
        }
        Key::Site => {
            if let Some(s) = value.and_then(|v| serde_json::from_slice::<Site>(v).ok()) {
                let new_id = model.site.as_ref().is_none_or(|old| old.id != s.id);
                model.site = Some(Arc::new(s));
                // A peering's namespace name depends on the site's id.
                if new_id {
                    let peerings: Vec<String> = model.peerings.keys().cloned().collect();
                    for p in peerings {
                        model.index_peering(&p);
                    }
                }
            }
            Mark::Everyone
        }
        Key::Node(name) => {
            let change = apply_agent(&mut model.nodes, name, value);
            let sharing = model.index_node(name);
            match change {
                AgentChange::Nothing => Mark::Nothing,
                AgentChange::Revoked => Mark::Revoked((AgentRole::Node, name.to_string())),
                AgentChange::Changed { removed } => Mark::Node {
                    name: name.to_string(),
                    removed,
                    sharing,
                },
            }
        }
        Key::Gateway(name) => match apply_agent(&mut model.gateways, name, value) {
            AgentChange::Nothing => Mark::Nothing,
            AgentChange::Revoked => Mark::Revoked((AgentRole::Gateway, name.to_string())),
            AgentChange::Changed { removed } => Mark::Gateway {
                name: name.to_string(),
                removed,
            },
        },
        Key::Name(name) => {
            match value.and_then(|v| serde_json::from_slice::<crate::names::NameRecord>(v).ok()) {
                Some(n) => model.names.insert(name.to_string(), Arc::new(n)),
                None => model.names.remove(name),
            };
            Mark::Names
        }
        Key::Peering(name) => {
            // A relayed tunnel's session is rendered under one of its two
            // peerings: a change to either re-renders both. Transit: a
            // peering's views, flag or presence change what other transit
            // peerings render (their onward routes, their transit paths,
            // which a direct peering takes over).
            let partners = |m: &Model| -> Vec<String> {
                let mut v: Vec<String> = m
                    .peerings
                    .get(name)
                    .map(|p| p.relay_ports.keys().cloned().collect())
                    .unwrap_or_default();
                v.extend(
                    m.peerings
                        .values()
                        .filter(|q| q.transit || !q.transit_views.is_empty() || !q.transit_views_v6.is_empty())
                        .map(|q| q.site_id.clone()),
                );
                v
            };
            let mut relayed = partners(model);
            let new = value.and_then(|v| serde_json::from_slice::<Peering>(v).ok());
            // What the peer says of its readiness renders nothing and is
            // not told on: no stream, no peer is woken for it (else two
            // sites' readiness would bounce between them).
            if let (Some(old), Some(new)) = (model.peerings.get(name), &new)
                && old.same_but_readiness(new)
            {
                model.peerings.insert(name.to_string(), Arc::new(new.clone()));
                return Some(Mark::Nothing);
            }
            match new {
                Some(p) => model.peerings.insert(name.to_string(), Arc::new(p)),
                None => model.peerings.remove(name),
            };
            relayed.extend(partners(model));
            let mut sharing = model.index_peering(name);
            for r in relayed {
                if !sharing.contains(&r) && r != name {
                    sharing.push(r);
                }
            }
            Mark::Peering(name.to_string(), sharing)
        }
        _ => return None,
    })
}
