//! What this replica knows of the site's gateways beyond the model: each
//! one's latest tunnel report, the ones whose liveness it ended (their
//! records still on their way out of the store), and the latest failover's
//! timeline. Three locks, one per part; none is held while another is
//! taken.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use weft_proto::v1 as pb;

use super::AgentKey;
use super::timeline::{Election, Timeline};
use crate::render::Model;

#[derive(Default)]
pub(super) struct Gateways {
    /// Each gateway's latest tunnel report (when, what). Kept in memory:
    /// it changes with every report and is worth nothing once stale.
    tunnels: Mutex<HashMap<String, (u64, Vec<pb::TunnelStatus>)>>,
    /// Gateways whose liveness this replica ended and whose record the
    /// model still holds (its deletion on its way through the store): not
    /// live to the election, which so need not wait for the store.
    ended: Mutex<HashSet<String>>,
    /// The latest failover's timeline as this replica saw it.
    timeline: Mutex<Timeline>,
}

impl Gateways {
    /// Keeps gateway `name`'s tunnel report, made at `now_ms`.
    pub(super) fn report(&self, name: &str, tunnels: Vec<pb::TunnelStatus>, now_ms: u64) {
        self.timeline(|t| t.tunnels(name, &tunnels, now_ms));
        self.tunnels.lock().unwrap().insert(name.to_string(), (now_ms, tunnels));
    }

    /// Every gateway's latest tunnel report, with when it came.
    pub(super) fn reports(&self) -> Vec<(String, u64, Vec<pb::TunnelStatus>)> {
        self.tunnels
            .lock()
            .unwrap()
            .iter()
            .map(|(gw, (at, ts))| (gw.clone(), *at, ts.clone()))
            .collect()
    }

    /// Gateway `name` is gone: its report goes with it.
    pub(super) fn forget(&self, name: &str) {
        self.tunnels.lock().unwrap().remove(name);
    }

    /// The tunnel to peer `site` as the gateways reported it since
    /// `fresh_after`: an up one if any gateway has it up, else the newest.
    pub(super) fn tunnel(&self, site: &str, fresh_after: u64) -> Option<pb::TunnelStatus> {
        let all = self.tunnels.lock().unwrap();
        let mut seen: Vec<(u64, pb::TunnelStatus)> = all
            .iter()
            .filter(|(_, (at, _))| *at >= fresh_after)
            .flat_map(|(gw, (at, ts))| {
                ts.iter().filter(|t| t.peer_site == site).map(move |t| {
                    let mut t = t.clone();
                    t.gateway = gw.clone();
                    t.reported_at = Some(weft_proto::timestamp_ms(*at));
                    (*at, t)
                })
            })
            .collect();
        seen.sort_by_key(|(at, t)| (t.up, *at));
        seen.pop().map(|(_, t)| t)
    }

    /// This replica ended gateway `name`'s liveness.
    pub(super) fn ended(&self, name: &str) {
        self.ended.lock().unwrap().insert(name.to_string());
    }

    /// The store has gateway `name`'s liveness record as it is now.
    pub(super) fn recorded(&self, name: &str) {
        self.ended.lock().unwrap().remove(name);
    }

    /// `m` as the election sees it: without the gateways this replica
    /// ended whose records are still on their way out.
    pub(super) fn electing(&self, m: Arc<Model>) -> Arc<Model> {
        let ended = self.ended.lock().unwrap();
        if ended.iter().all(|g| !m.live_gateways.contains(g)) {
            return m;
        }
        let mut m = (*m).clone();
        for g in ended.iter() {
            m.live_gateways.remove(g);
        }
        Arc::new(m)
    }

    /// The model recorded `to` active after `from`: the failover's
    /// timeline starts, with the agents connected here (`agents`), the
    /// peers to tell and the new gateway's tunnels as last reported.
    pub(super) fn failover_began(&self, from: &str, to: &str, model: &Model, agents: Vec<AgentKey>, now_ms: u64) {
        let peers: Vec<String> = model
            .peerings
            .values()
            .filter(|p| p.remote.is_some() && p.state != crate::domain::PeeringState::Deleting)
            .map(|p| p.site_id.clone())
            .collect();
        let peers_telling: Vec<String> = peers
            .iter()
            .filter(|s| {
                model.peerings[s.as_str()]
                    .remote
                    .as_ref()
                    .is_some_and(|r| r.readiness.is_some())
            })
            .cloned()
            .collect();
        let tunnels = self
            .tunnels
            .lock()
            .unwrap()
            .get(to)
            .map(|(_, t)| t.clone())
            .unwrap_or_default();
        self.timeline(|t| {
            t.elected(Election {
                from,
                to,
                revision: model.revision,
                at_ms: now_ms,
                agents,
                peers,
                peers_telling,
                tunnels,
            })
        });
    }

    /// Runs `f` on the failover timeline.
    pub(super) fn timeline<T>(&self, f: impl FnOnce(&mut Timeline) -> T) -> T {
        f(&mut self.timeline.lock().unwrap())
    }
}
