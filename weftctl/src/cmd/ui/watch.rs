//! What the page shows, kept current: the controller's latest answer
//! (read every `--interval`, whoever looks), its latest `diagnose` (every
//! [`DIAGNOSE_EVERY`]) and the events seen between answers. Each answer
//! is rendered once and handed to every open page.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use weft_proto::v1 as pb;

use crate::cmd::status::{self, Site};
use crate::out::{Client, path_cell, peering_state, status as grpc_error};

/// How often `diagnose` runs: it watches agents for a second each time.
const DIAGNOSE_EVERY: Duration = Duration::from_secs(10);
/// How many events the page keeps.
const EVENTS: usize = 100;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Failover,
    Path,
    Peering,
    Agent,
    Join,
    Controller,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Failover => "failover",
            Kind::Path => "path",
            Kind::Peering => "peering",
            Kind::Agent => "agent",
            Kind::Join => "refused join",
            Kind::Controller => "controller",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Event {
    pub at: SystemTime,
    pub kind: Kind,
    pub text: String,
}

pub enum Diagnosis {
    Waiting,
    Done { at: SystemTime, checks: Vec<pb::Check> },
    Failed { at: SystemTime, error: String },
}

/// Everything the page shows.
pub struct Snapshot {
    pub site: Site,
    /// When `site` was read.
    pub read_at: SystemTime,
    /// The controller stopped answering: since when, and why.
    pub unreachable: Option<(SystemTime, String)>,
    pub diagnose: Diagnosis,
    /// Newest first.
    pub events: VecDeque<Event>,
    /// Refused joins already told as events: (site, code, last time).
    joins_told: HashSet<(String, String, i64)>,
    /// The last failover already told: (from, to, complete).
    failover_told: Option<(String, String, bool)>,
}

/// One rendering of the snapshot, as every open page gets it.
pub struct Frame {
    /// The live part of the page (HTML).
    pub live: String,
    /// "updated 12:00:01 UTC", or why not.
    pub clock: String,
    pub site_id: String,
}

/// Renders a reading (the page's part; given, so that this module knows
/// nothing of HTML).
pub type Render = fn(&Snapshot) -> Frame;

#[derive(Clone)]
pub struct State {
    snapshot: Arc<Mutex<Snapshot>>,
    render: Render,
    frames: tokio::sync::watch::Sender<Arc<Frame>>,
}

impl State {
    /// Reads the controller once (an error if it cannot be read), then
    /// keeps reading it in the background.
    pub async fn start(mut c: Client, interval: Duration, render: Render) -> Result<State, String> {
        let site = status::site(&mut c).await?;
        let now = SystemTime::now();
        let mut snap = Snapshot {
            site,
            read_at: now,
            unreachable: None,
            diagnose: Diagnosis::Waiting,
            events: VecDeque::new(),
            joins_told: HashSet::new(),
            failover_told: None,
        };
        snap.tell_controller_news();
        let id = snap.site.site.id.clone();
        snap.push(now, Kind::Controller, format!("weftctl ui started watching site {id}"));
        let frame = render(&snap);
        let state = State {
            snapshot: Arc::new(Mutex::new(snap)),
            render,
            frames: tokio::sync::watch::channel(Arc::new(frame)).0,
        };
        tokio::spawn(state.clone().read_every(c.clone(), interval));
        tokio::spawn(state.clone().diagnose_every(c));
        Ok(state)
    }

    pub fn site_id(&self) -> String {
        self.frames.borrow().site_id.clone()
    }

    pub fn frames(&self) -> tokio::sync::watch::Receiver<Arc<Frame>> {
        self.frames.subscribe()
    }

    async fn read_every(self, mut c: Client, interval: Duration) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // A controller that hangs is unreachable too, not a frozen page.
        let limit = interval.max(Duration::from_secs(3));
        loop {
            tick.tick().await;
            let read = match tokio::time::timeout(limit, status::site(&mut c)).await {
                Ok(r) => r,
                Err(_) => Err(format!("no answer within {}", humantime::format_duration(limit))),
            };
            let frame = {
                let mut snap = self.snapshot.lock().unwrap();
                snap.take(read, SystemTime::now());
                (self.render)(&snap)
            };
            self.frames.send_replace(Arc::new(frame));
        }
    }

    async fn diagnose_every(self, mut c: Client) {
        let mut tick = tokio::time::interval(DIAGNOSE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let asked = c.diagnose(pb::DiagnoseRequest { settle_millis: 1000 });
            let d = match tokio::time::timeout(Duration::from_secs(20), asked).await {
                Ok(Ok(r)) => Diagnosis::Done {
                    at: SystemTime::now(),
                    checks: r.into_inner().checks,
                },
                Ok(Err(e)) => Diagnosis::Failed {
                    at: SystemTime::now(),
                    error: grpc_error(e),
                },
                Err(_) => Diagnosis::Failed {
                    at: SystemTime::now(),
                    error: "no answer within 20s".into(),
                },
            };
            self.snapshot.lock().unwrap().diagnose = d;
        }
    }
}

/// `12:00:01 UTC`.
pub fn clock(t: SystemTime) -> String {
    let secs = t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let day = secs % 86_400;
    format!("{:02}:{:02}:{:02} UTC", day / 3600, day / 60 % 60, day % 60)
}

impl Snapshot {
    #[cfg(test)]
    pub fn for_test(site: Site) -> Snapshot {
        Snapshot {
            site,
            read_at: SystemTime::now(),
            unreachable: None,
            diagnose: Diagnosis::Waiting,
            events: VecDeque::new(),
            joins_told: HashSet::new(),
            failover_told: None,
        }
    }

    fn push(&mut self, at: SystemTime, kind: Kind, text: String) {
        self.events.push_front(Event { at, kind, text });
        self.events.truncate(EVENTS);
    }

    /// Takes one reading: the new state and what changed since the last.
    fn take(&mut self, read: Result<Site, String>, now: SystemTime) {
        match read {
            Ok(site) => {
                if let Some((since, _)) = self.unreachable.take() {
                    let down = now.duration_since(since).unwrap_or_default().as_secs();
                    self.push(
                        now,
                        Kind::Controller,
                        format!("the controller answers again (after {down}s)"),
                    );
                }
                for (kind, text) in changes(&self.site, &site) {
                    self.push(now, kind, text);
                }
                self.site = site;
                self.read_at = now;
                self.tell_controller_news();
            }
            Err(e) => {
                if self.unreachable.is_none() {
                    self.push(now, Kind::Controller, format!("the controller does not answer: {e}"));
                    self.unreachable = Some((now, e));
                } else if let Some((_, why)) = &mut self.unreachable {
                    *why = e;
                }
            }
        }
    }

    /// What the controller itself remembers: refused joins (at their own
    /// times) and the latest failover's timeline, each told once.
    fn tell_controller_news(&mut self) {
        let mut joins = self.site.refused_joins.clone();
        joins.sort_by_key(|j| j.last_at.as_ref().map_or(0, |t| t.seconds));
        for j in joins {
            let last = j.last_at.as_ref().map_or(0, |t| t.seconds);
            if self.joins_told.insert((j.site_id.clone(), j.code.clone(), last)) {
                let at = SystemTime::UNIX_EPOCH + Duration::from_secs(last.max(0) as u64);
                let times = if j.count > 1 {
                    format!(" ({} times)", j.count)
                } else {
                    String::new()
                };
                self.push(
                    at,
                    Kind::Join,
                    format!(
                        "refused a join from site {}: {} {}{times}",
                        j.site_id, j.code, j.message
                    ),
                );
            }
        }
        if let Some(f) = self.site.last_failover.clone() {
            let key = (f.from.clone(), f.to.clone(), f.complete);
            if self.failover_told.as_ref() != Some(&key) {
                self.failover_told = Some(key);
                let took = f.steps.iter().map(|s| s.offset_ms).max().unwrap_or(0);
                let text = if f.complete {
                    format!(
                        "failover from {} to {}: every agent followed within {took} ms",
                        f.from, f.to
                    )
                } else {
                    format!(
                        "failover from {} to {} in progress, waiting for {}",
                        f.from,
                        f.to,
                        f.waiting.join(", ")
                    )
                };
                self.push(SystemTime::now(), Kind::Failover, text);
            }
        }
    }
}

/// What changed between two readings, as people say it.
pub fn changes(old: &Site, new: &Site) -> Vec<(Kind, String)> {
    let mut out = Vec::new();
    let active = |s: &Site| s.gateways.iter().find(|g| g.active).map(|g| g.name.clone());
    let (was, now) = (active(old), active(new));
    if was != now {
        let text = match (&was, &now) {
            (Some(a), Some(b)) => format!("gateway {b} is active now (was {a})"),
            (None, Some(b)) => format!("gateway {b} is active now"),
            (Some(a), None) => format!("no gateway is active (was {a})"),
            (None, None) => unreachable!(),
        };
        out.push((Kind::Failover, text));
    }
    agents(&mut out, "gateway", &names(&old.gateways), &names(&new.gateways));
    let node_states = |s: &Site| -> BTreeMap<String, bool> {
        s.nodes
            .iter()
            .map(|n| (n.name.clone(), n.status.as_ref().is_some_and(|s| s.ready)))
            .collect()
    };
    agents(&mut out, "node", &node_states(old), &node_states(new));
    let peers = |s: &Site| -> BTreeMap<String, pb::Peering> {
        s.peerings.iter().map(|p| (p.site_id.clone(), p.clone())).collect()
    };
    let (before, after) = (peers(old), peers(new));
    for (id, p) in &after {
        let Some(o) = before.get(id) else {
            out.push((
                Kind::Peering,
                format!("peering with {id} appeared ({})", peering_state(p.state)),
            ));
            continue;
        };
        if o.state != p.state {
            out.push((
                Kind::Peering,
                format!(
                    "peering with {id}: {} → {}",
                    peering_state(o.state),
                    peering_state(p.state)
                ),
            ));
        }
        let (op, np) = (path_cell(o.tunnel.as_ref()), path_cell(p.tunnel.as_ref()));
        if op != np && np != "-" {
            out.push((Kind::Path, format!("path to {id}: {op} → {np}")));
        }
        let up = |p: &pb::Peering| p.tunnel.as_ref().map(|t| t.up);
        if let (Some(a), Some(b)) = (up(o), up(p))
            && a != b
        {
            let state = if b { "up" } else { "down" };
            out.push((Kind::Path, format!("tunnel to {id} is {state}")));
        }
    }
    for id in before.keys().filter(|id| !after.contains_key(*id)) {
        out.push((Kind::Peering, format!("peering with {id} is gone")));
    }
    out
}

fn names(gws: &[pb::Gateway]) -> BTreeMap<String, bool> {
    gws.iter()
        .map(|g| (g.name.clone(), g.status.as_ref().is_some_and(|s| s.ready)))
        .collect()
}

/// Agents that came, went, or changed readiness.
fn agents(out: &mut Vec<(Kind, String)>, what: &str, old: &BTreeMap<String, bool>, new: &BTreeMap<String, bool>) {
    for (name, ready) in new {
        match old.get(name) {
            None => out.push((Kind::Agent, format!("{what} {name} joined"))),
            Some(was) if was != ready => {
                let state = if *ready { "ready" } else { "not ready" };
                out.push((Kind::Agent, format!("{what} {name} is {state}")));
            }
            Some(_) => {}
        }
    }
    for name in old.keys().filter(|n| !new.contains_key(*n)) {
        out.push((Kind::Agent, format!("{what} {name} was removed")));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn site(gateways: &[(&str, bool)], peerings: &[(&str, pb::PeeringState, &str)]) -> Site {
        Site {
            site: pb::Site {
                id: "a".into(),
                ..Default::default()
            },
            gateways: gateways
                .iter()
                .map(|(n, active)| pb::Gateway {
                    name: n.to_string(),
                    active: *active,
                    status: Some(pb::AgentStatus {
                        ready: true,
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .collect(),
            nodes: vec![],
            peerings: peerings
                .iter()
                .map(|(id, st, path)| pb::Peering {
                    site_id: id.to_string(),
                    state: *st as i32,
                    tunnel: Some(pb::TunnelStatus {
                        up: true,
                        path: path.to_string(),
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .collect(),
            refused_joins: vec![],
            last_failover: None,
        }
    }

    #[test]
    fn failovers_path_moves_and_peerings_become_events() {
        use pb::PeeringState::*;
        let old = site(
            &[("gw", true), ("gw2", false)],
            &[("b", Connected, "direct"), ("c", Connected, "relayed via r")],
        );
        let new = site(
            &[("gw", false), ("gw2", true)],
            &[("c", Connected, "hole-punched"), ("d", Negotiated, "")],
        );
        let got: Vec<String> = changes(&old, &new).into_iter().map(|(_, t)| t).collect();
        assert_eq!(
            got,
            [
                "gateway gw2 is active now (was gw)",
                "path to c: relayed via r → hole-punched",
                "peering with d appeared (negotiated)",
                "peering with b is gone",
            ]
        );
        assert!(changes(&new, &new).is_empty(), "no change, no event");
    }

    #[test]
    fn an_unreachable_controller_is_told_once_and_its_return_too() {
        let s = site(&[("gw", true)], &[]);
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let mut snap = Snapshot::for_test(s.clone());
        snap.take(Err("UNAVAILABLE: gone".into()), t0);
        snap.take(Err("UNAVAILABLE: still gone".into()), t0 + Duration::from_secs(1));
        assert_eq!(snap.events.len(), 1);
        assert_eq!(snap.unreachable.as_ref().unwrap().1, "UNAVAILABLE: still gone");
        snap.take(Ok(s), t0 + Duration::from_secs(5));
        assert!(snap.unreachable.is_none());
        assert_eq!(snap.events[0].text, "the controller answers again (after 5s)");
        assert_eq!(clock(t0 + Duration::from_secs(3600 * 25 + 61)), "01:17:41 UTC");
    }
}
