//! What the page shows, kept current: the controller's latest answer
//! (read every `--interval`, whoever looks), its latest `diagnose` (every
//! [`DIAGNOSE_EVERY`]) and the events seen between answers. Each answer
//! is rendered once and handed to every open page.

use std::collections::{BTreeMap, HashMap, VecDeque};
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
    /// Events of one key replace each other (a refused join counted again).
    key: Option<String>,
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
    /// How often the controller is read.
    pub interval: Duration,
    /// Refused joins already told: (site, code) → how many times.
    joins_told: HashMap<(String, String), u32>,
    /// The last failover already told: (from, to, when its fault was).
    failover_told: Option<(String, String, i64)>,
}

/// One rendering of the snapshot, as every open page gets it.
pub struct Frame {
    /// The live part of the page (HTML).
    pub live: String,
    /// "updated 12:00:01 UTC", or why not.
    pub clock: String,
    pub site_id: String,
    /// After how long without a word the page says it is not updated.
    pub stale_ms: u64,
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
        let mut snap = Snapshot::new(site, now, interval);
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

/// `12:00:01 UTC`, with the date before it when that is not today.
pub fn clock(t: SystemTime) -> String {
    clock_at(t, SystemTime::now())
}

fn clock_at(t: SystemTime, now: SystemTime) -> String {
    let secs = |t: SystemTime| t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let s = secs(t);
    let day = s % 86_400;
    let hms = format!("{:02}:{:02}:{:02} UTC", day / 3600, day / 60 % 60, day % 60);
    if s / 86_400 == secs(now) / 86_400 {
        return hms;
    }
    let date =
        time::OffsetDateTime::from_unix_timestamp(s as i64).map_or_else(|_| "?".into(), |d| d.date().to_string());
    format!("{date} {hms}")
}

/// A protobuf timestamp as a time.
fn at(t: &prost_types::Timestamp) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::new(t.seconds.max(0) as u64, t.nanos.clamp(0, 999_999_999) as u32)
}

impl Snapshot {
    fn new(site: Site, now: SystemTime, interval: Duration) -> Snapshot {
        Snapshot {
            site,
            read_at: now,
            unreachable: None,
            diagnose: Diagnosis::Waiting,
            events: VecDeque::new(),
            interval,
            joins_told: HashMap::new(),
            failover_told: None,
        }
    }

    #[cfg(test)]
    pub fn for_test(site: Site) -> Snapshot {
        Snapshot::new(site, SystemTime::now(), Duration::from_secs(1))
    }

    fn push(&mut self, at: SystemTime, kind: Kind, text: String) {
        self.push_keyed(at, kind, text, None);
    }

    /// An event, newest first; one with a key replaces the last of that key.
    fn push_keyed(&mut self, at: SystemTime, kind: Kind, text: String, key: Option<String>) {
        if key.is_some() {
            self.events.retain(|e| e.key != key);
        }
        self.events.push_front(Event { at, kind, text, key });
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
    /// times, one event per site and reason, counted again as they come)
    /// and the latest failover once it is complete (at its fault's time).
    fn tell_controller_news(&mut self) {
        let joins = self.site.refused_joins.clone();
        self.joins_told
            .retain(|(site, code), _| joins.iter().any(|j| &j.site_id == site && &j.code == code));
        for j in joins {
            let told = self.joins_told.insert((j.site_id.clone(), j.code.clone()), j.count);
            if told == Some(j.count) {
                continue;
            }
            let times = if j.count > 1 {
                format!(" ({} times)", j.count)
            } else {
                String::new()
            };
            let text = format!(
                "refused a join from site {}: {} {}{times}",
                j.site_id, j.code, j.message
            );
            let key = format!("join {} {}", j.site_id, j.code);
            self.push_keyed(j.last_at.as_ref().map_or(self.read_at, at), Kind::Join, text, Some(key));
        }
        let Some(f) = self.site.last_failover.clone().filter(|f| f.complete) else {
            return;
        };
        let fault = f.steps.first().and_then(|s| s.first.as_ref());
        let key = (f.from.clone(), f.to.clone(), fault.map_or(0, |t| t.seconds));
        if self.failover_told.as_ref() == Some(&key) {
            return;
        }
        self.failover_told = Some(key);
        let took = f.steps.iter().map(|s| s.offset_ms).max().unwrap_or(0);
        let text = if f.waiting.is_empty() {
            format!(
                "failover from {} to {}: every step done within {took} ms (replica {})",
                f.from, f.to, f.replica
            )
        } else {
            format!(
                "failover from {} to {}: after a minute still not followed by {}",
                f.from,
                f.to,
                f.waiting.join(", ")
            )
        };
        self.push(fault.map_or(self.read_at, at), Kind::Failover, text);
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
            let text = match op.as_str() {
                "-" => format!("path to {id}: {np}"),
                _ => format!("path to {id}: {op} → {np}"),
            };
            out.push((Kind::Path, text));
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
        let t = t0 + Duration::from_secs(3600 * 25 + 61);
        assert_eq!(clock_at(t, t), "01:17:41 UTC");
        assert_eq!(clock_at(t, t + Duration::from_secs(86_400)), "1970-01-02 01:17:41 UTC");
    }

    #[test]
    fn a_join_refused_again_is_one_event_counted_again_and_a_failover_is_told_once_complete() {
        let mut snap = Snapshot::for_test(site(&[("gw", true)], &[]));
        let join = |count: u32| pb::RefusedJoin {
            site_id: "x".into(),
            code: "PERMISSION_DENIED".into(),
            message: "bad token".into(),
            last_at: Some(prost_types::Timestamp {
                seconds: 1_000 + count as i64,
                nanos: 0,
            }),
            count,
        };
        for n in [1, 1, 2, 3] {
            snap.site.refused_joins = vec![join(n)];
            snap.tell_controller_news();
        }
        assert_eq!(snap.events.len(), 1, "{:?}", snap.events);
        assert!(snap.events[0].text.ends_with("bad token (3 times)"));
        let step = |offset_ms: i64| pb::FailoverStep {
            first: Some(prost_types::Timestamp {
                seconds: 2_000,
                nanos: 0,
            }),
            offset_ms,
            ..Default::default()
        };
        let mut f = pb::FailoverTimeline {
            from: "gw".into(),
            to: "gw2".into(),
            steps: vec![step(0), step(935)],
            ..Default::default()
        };
        snap.site.last_failover = Some(f.clone());
        snap.tell_controller_news();
        assert_eq!(snap.events.len(), 1, "told once complete");
        f.complete = true;
        snap.site.last_failover = Some(f);
        snap.tell_controller_news();
        snap.tell_controller_news();
        assert_eq!(snap.events.len(), 2);
        assert!(snap.events[0].text.contains("within 935 ms"), "{}", snap.events[0].text);
        assert_eq!(snap.events[0].at, SystemTime::UNIX_EPOCH + Duration::from_secs(2_000));
    }
}
