//! The timeline of the latest failover as this replica saw it: when the
//! old active gateway was last heard, when its liveness ended, when the
//! new one was recorded, when each agent connected here was sent and
//! applied the new state, when each peer was told, and when traffic from
//! each peer first crossed the new gateway. Logged step by step, summed
//! up in one line, observed in `weft_failover_step_seconds{step}` (the
//! time from the step before) and shown by `weftctl status`.
//!
//! Each replica records what it sees: the leading one records the
//! election, the one the old gateway reported to its silence, the ones
//! agents and peers are connected to their steps. With one replica (or
//! everything on one) that is the whole timeline.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use weft_proto::v1 as pb;

use super::AgentKey;

pub type Steps = Family<Vec<(String, String)>, Histogram, fn() -> Histogram>;

fn step_histogram() -> Histogram {
    // 5 ms to ~41 s.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.005, 2.0, 14,
    ))
}

/// `weft_failover_step_seconds`: each failover step's time from the step
/// it follows, shared by every registry of this process (the metrics
/// module registers it).
pub fn failover_steps() -> &'static Steps {
    static STEPS: std::sync::OnceLock<Steps> = std::sync::OnceLock::new();
    STEPS.get_or_init(|| {
        let f: Steps = Family::new_with_constructor(step_histogram);
        // Every step shown from the start, at zero.
        for step in Step::TIMED {
            let _ = f.get_or_create(&vec![("step".to_string(), step.as_str().to_string())]);
        }
        f
    })
}

pub(super) fn observe(step: Step, secs: f64) {
    failover_steps()
        .get_or_create(&vec![("step".to_string(), step.as_str().to_string())])
        .observe(secs);
}

/// The steps, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Step {
    Fault,
    Expired,
    Elected,
    Pushed,
    Applied,
    PeerTold,
    PeerMoved,
    FirstPacket,
}

impl Step {
    /// The steps timed from another (all but the fault).
    pub const TIMED: [Step; 7] = [
        Step::Expired,
        Step::Elected,
        Step::Pushed,
        Step::Applied,
        Step::PeerTold,
        Step::PeerMoved,
        Step::FirstPacket,
    ];

    /// The steps this one follows: its time is counted from the later of
    /// them (the peer steps follow the election, not the local agents;
    /// traffic needs both this site's agents and the peer).
    pub fn waits_for(self) -> &'static [Step] {
        match self {
            Step::Fault => &[],
            Step::Expired => &[Step::Fault],
            Step::Elected => &[Step::Expired],
            Step::Pushed => &[Step::Elected],
            Step::Applied => &[Step::Pushed],
            Step::PeerTold => &[Step::Elected],
            Step::PeerMoved => &[Step::PeerTold],
            Step::FirstPacket => &[Step::Applied, Step::PeerMoved, Step::PeerTold],
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Step::Fault => "fault",
            Step::Expired => "expired",
            Step::Elected => "elected",
            Step::Pushed => "pushed",
            Step::Applied => "applied",
            Step::PeerTold => "peer_told",
            Step::PeerMoved => "peer_moved",
            Step::FirstPacket => "first_packet",
        }
    }
}

/// A failover this old is ended whatever still waits: an agent that
/// never applies, a peer that never sends traffic.
const GIVE_UP_MS: u64 = 60_000;

/// A fault or expiry older than this at the election is another story
/// (a gateway that died long ago, then a change of the active one by
/// hand or after a restart).
const RELATED_MS: u64 = 5 * 60_000;

#[derive(Clone, Debug, Default, PartialEq)]
struct Reached {
    first: u64,
    last: u64,
    count: u32,
    last_subject: String,
}

#[derive(Clone, Debug)]
pub struct Failover {
    from: String,
    to: String,
    /// The model revision that recorded `to`: an agent has the new state
    /// once it was sent, and applied, this revision or a later one.
    revision: i64,
    elected_ms: u64,
    steps: BTreeMap<Step, Reached>,
    sent: HashSet<AgentKey>,
    applied: HashSet<AgentKey>,
    told: BTreeSet<String>,
    moved: BTreeSet<String>,
    packet: BTreeSet<String>,
    /// Bytes `to` had received from each peer when it was elected.
    rx_at_election: HashMap<String, u64>,
    complete: bool,
}

/// What the hub knows of a failover when it records the new active
/// gateway.
pub struct Election<'a> {
    pub from: &'a str,
    pub to: &'a str,
    pub revision: i64,
    pub at_ms: u64,
    /// The agents connected to this replica.
    pub agents: Vec<AgentKey>,
    /// The peer sites with a tunnel (negotiated peerings).
    pub peers: Vec<String>,
    /// Those of them that say which gateway of this site they use (see
    /// `PeerReadiness`; a peer of an earlier version does not).
    pub peers_telling: Vec<String>,
    /// `to`'s latest tunnel report.
    pub tunnels: Vec<pb::TunnelStatus>,
}

#[derive(Debug, Default)]
pub struct Timeline {
    /// Gateways whose liveness this replica ended: when each was last
    /// heard, and how it ended.
    silent: HashMap<String, (u64, &'static str)>,
    /// When the model saw each gateway's liveness record go.
    expired: HashMap<String, u64>,
    current: Option<Failover>,
}

impl Timeline {
    /// This replica ended gateway `name`'s liveness at `at_ms`: last
    /// heard at `heard_ms` (`cause`: "silent" or "disconnected").
    pub fn silent(&mut self, name: &str, heard_ms: u64, at_ms: u64, cause: &'static str) {
        self.silent.insert(name.to_string(), (heard_ms, cause));
        self.expired.insert(name.to_string(), at_ms);
    }

    /// The model saw gateway `name`'s liveness record go: its expiry,
    /// unless this replica ended it itself lately (then that moment).
    pub fn expired(&mut self, name: &str, at_ms: u64) {
        let known = self.expired.get(name).is_some_and(|t| *t + 60_000 >= at_ms);
        if !known {
            self.expired.insert(name.to_string(), at_ms);
        }
    }

    /// The model recorded `e.to` active after `e.from`: a failover starts.
    pub fn elected(&mut self, e: Election<'_>) {
        let mut f = Failover {
            from: e.from.to_string(),
            to: e.to.to_string(),
            revision: e.revision,
            elected_ms: e.at_ms,
            steps: BTreeMap::new(),
            sent: e.agents.iter().filter(|k| k.1 != e.from).cloned().collect(),
            applied: HashSet::new(),
            told: e.peers.iter().cloned().collect(),
            moved: e.peers_telling.iter().cloned().collect(),
            packet: e.peers.iter().cloned().collect(),
            rx_at_election: e.tunnels.iter().map(|t| (t.peer_site.clone(), t.rx_bytes)).collect(),
            complete: false,
        };
        f.applied = f.sent.clone();
        let recent = |at: u64| at + RELATED_MS >= e.at_ms && at <= e.at_ms;
        if let Some((heard, cause)) = self.silent.remove(e.from).filter(|(at, _)| recent(*at)) {
            f.reach(Step::Fault, heard, cause);
        }
        if let Some(at) = self.expired.remove(e.from).filter(|at| recent(*at)) {
            f.reach(Step::Expired, at, e.from);
        }
        f.reach(Step::Elected, e.at_ms, e.to);
        self.silent.retain(|_, (at, _)| recent(*at));
        self.expired.retain(|_, at| recent(*at));
        tracing::info!(
            from = %f.from,
            to = %f.to,
            revision = f.revision,
            agents = f.sent.len(),
            peers = f.told.len(),
            since_fault_ms = f.offset(e.at_ms),
            "failover: new active gateway recorded"
        );
        if let Some(old) = self.current.replace(f)
            && !old.complete
        {
            tracing::info!(from = %old.from, to = %old.to, "failover: superseded by a newer one before it completed");
        }
    }

    /// Agent `key`'s stream sent the state of `revision`.
    pub fn sent(&mut self, key: &AgentKey, revision: i64, at_ms: u64) {
        if let Some(f) = self.open(revision)
            && f.sent.remove(key)
        {
            f.reach(Step::Pushed, at_ms, &key.1);
        }
    }

    /// Agent `key` reported it applied `revision`.
    pub fn applied(&mut self, key: &AgentKey, revision: i64, at_ms: u64) {
        if let Some(f) = self.open(revision)
            && f.applied.remove(key)
        {
            f.reach(Step::Applied, at_ms, &key.1);
            tracing::info!(
                agent = %key.1,
                role = ?key.0,
                since_fault_ms = f.offset(at_ms),
                "failover: agent applied the new state"
            );
        }
    }

    /// Peer `site` was sent parameters naming `active` as this site's
    /// active gateway.
    pub fn told(&mut self, site: &str, active: Option<&str>, at_ms: u64) {
        if let Some(f) = self.current.as_mut().filter(|f| !f.complete)
            && active == Some(f.to.as_str())
            && f.told.remove(site)
        {
            f.reach(Step::PeerTold, at_ms, site);
            tracing::info!(peer = %site, since_fault_ms = f.offset(at_ms), "failover: peer told");
        }
    }

    /// Peer `site` says its gateways send the tunnel to `active`.
    pub fn moved(&mut self, site: &str, active: &str, at_ms: u64) {
        if let Some(f) = self.current.as_mut().filter(|f| !f.complete)
            && active == f.to
            && f.moved.remove(site)
        {
            f.reach(Step::PeerMoved, at_ms, site);
            tracing::info!(peer = %site, since_fault_ms = f.offset(at_ms), "failover: the peer's gateways moved");
        }
    }

    /// Gateway `gateway` reported its tunnels at `at_ms`: traffic from a
    /// peer through the new active gateway (bytes received since the
    /// election, or a handshake after it) is that peer's first packet.
    pub fn tunnels(&mut self, gateway: &str, tunnels: &[pb::TunnelStatus], at_ms: u64) {
        let Some(f) = self.current.as_mut().filter(|f| !f.complete && f.to == gateway) else {
            return;
        };
        for t in tunnels {
            if !f.packet.contains(&t.peer_site) {
                continue;
            }
            let before = f.rx_at_election.get(&t.peer_site).copied().unwrap_or(0);
            let handshake = t
                .last_handshake
                .as_ref()
                .map(weft_proto::ms_of_timestamp)
                .filter(|h| *h >= f.elected_ms && *h <= at_ms);
            if t.rx_bytes > before || handshake.is_some() {
                let at = handshake.unwrap_or(at_ms);
                f.packet.remove(&t.peer_site);
                f.reach(Step::FirstPacket, at, &t.peer_site);
                tracing::info!(
                    peer = %t.peer_site,
                    since_fault_ms = f.offset(at),
                    "failover: traffic from the peer through the new gateway"
                );
            }
        }
    }

    /// Ends the current failover once nothing awaited is left, or after
    /// [`GIVE_UP_MS`]: logs its summary and returns each step's time
    /// from the step before (for the histogram), once.
    pub fn finish_if_due(&mut self, now_ms: u64) -> Vec<(Step, f64)> {
        let Some(f) = self.current.as_mut().filter(|f| !f.complete) else {
            return Vec::new();
        };
        let done =
            f.sent.is_empty() && f.applied.is_empty() && f.told.is_empty() && f.moved.is_empty() && f.packet.is_empty();
        if !done && now_ms < f.elected_ms + GIVE_UP_MS {
            return Vec::new();
        }
        f.complete = true;
        let summary: Vec<String> = f
            .steps
            .iter()
            .map(|(s, r)| format!("{} +{} ms", s.as_str(), f.offset(r.last)))
            .collect();
        let waiting = f.waiting();
        tracing::info!(
            from = %f.from,
            to = %f.to,
            steps = %summary.join(", "),
            waiting = %waiting.join(" "),
            "failover timeline (from the fault, or the first step seen)"
        );
        let mut out = Vec::new();
        for (s, r) in &f.steps {
            let since = s
                .waits_for()
                .iter()
                .filter_map(|w| f.steps.get(w))
                .map(|w| w.last)
                .max();
            if let Some(since) = since {
                out.push((*s, r.last.saturating_sub(since) as f64 / 1000.0));
            }
        }
        out
    }

    /// The latest failover, for `ListGateways`.
    pub fn last(&self, replica: &str) -> Option<pb::FailoverTimeline> {
        let f = self.current.as_ref()?;
        Some(pb::FailoverTimeline {
            from: f.from.clone(),
            to: f.to.clone(),
            replica: replica.to_string(),
            steps: f
                .steps
                .iter()
                .map(|(s, r)| pb::FailoverStep {
                    step: s.as_str().to_string(),
                    first: Some(weft_proto::timestamp_ms(r.first)),
                    last: Some(weft_proto::timestamp_ms(r.last)),
                    count: r.count,
                    offset_ms: f.offset(r.last),
                    last_subject: r.last_subject.clone(),
                })
                .collect(),
            complete: f.complete,
            waiting: f.waiting(),
        })
    }

    /// The current failover while it is open and `revision` is at or
    /// after the one that made it.
    fn open(&mut self, revision: i64) -> Option<&mut Failover> {
        self.current.as_mut().filter(|f| !f.complete && revision >= f.revision)
    }
}

impl Failover {
    fn reach(&mut self, step: Step, at_ms: u64, subject: &str) {
        let r = self.steps.entry(step).or_insert_with(|| Reached {
            first: at_ms,
            last: at_ms,
            ..Reached::default()
        });
        r.first = r.first.min(at_ms);
        if at_ms >= r.last {
            r.last = at_ms;
            r.last_subject = subject.to_string();
        }
        r.count += 1;
    }

    /// Milliseconds from the fault (or the first step seen) to `at_ms`.
    fn offset(&self, at_ms: u64) -> i64 {
        let base = self.steps.values().map(|r| r.first).min().unwrap_or(at_ms);
        let base = self.steps.get(&Step::Fault).map_or(base, |r| r.first);
        at_ms as i64 - base as i64
    }

    fn waiting(&self) -> Vec<String> {
        let mut w: Vec<String> = Vec::new();
        let names = |set: &HashSet<AgentKey>| set.iter().map(|k| k.1.clone()).collect::<BTreeSet<String>>();
        w.extend(names(&self.sent).iter().map(|n| format!("pushed:{n}")));
        w.extend(names(&self.applied).iter().map(|n| format!("applied:{n}")));
        w.extend(self.told.iter().map(|s| format!("peer_told:{s}")));
        w.extend(self.moved.iter().map(|s| format!("peer_moved:{s}")));
        w.extend(self.packet.iter().map(|s| format!("first_packet:{s}")));
        w.truncate(32);
        w
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::AgentRole;

    fn key(role: AgentRole, n: &str) -> AgentKey {
        (role, n.to_string())
    }

    fn tunnel(peer: &str, rx: u64) -> pb::TunnelStatus {
        pb::TunnelStatus {
            peer_site: peer.into(),
            rx_bytes: rx,
            ..Default::default()
        }
    }

    fn elect(t: &mut Timeline, at: u64) {
        t.elected(Election {
            from: "gw1",
            to: "gw2",
            revision: 10,
            at_ms: at,
            agents: vec![
                key(AgentRole::Gateway, "gw1"),
                key(AgentRole::Gateway, "gw2"),
                key(AgentRole::Node, "n1"),
            ],
            peers: vec!["b".into()],
            peers_telling: vec!["b".into()],
            tunnels: vec![tunnel("b", 500)],
        });
    }

    #[test]
    fn steps_are_timed_from_the_fault_and_the_failover_completes_when_nothing_waits() {
        let mut t = Timeline::default();
        t.silent("gw1", 1_000, 1_800, "silent");
        // The record's end seen later keeps the moment it was decided.
        t.expired("gw1", 1_900);
        elect(&mut t, 1_820);
        // An older revision is not the new state; the dead gateway is not awaited.
        t.sent(&key(AgentRole::Node, "n1"), 9, 1_830);
        t.sent(&key(AgentRole::Gateway, "gw1"), 10, 1_830);
        t.sent(&key(AgentRole::Node, "n1"), 10, 1_840);
        t.sent(&key(AgentRole::Gateway, "gw2"), 11, 1_850);
        t.applied(&key(AgentRole::Gateway, "gw2"), 11, 1_900);
        t.told("b", Some("gw1"), 1_850);
        t.told("b", Some("gw2"), 1_860);
        t.moved("b", "gw1", 1_870);
        t.moved("b", "gw2", 1_880);
        assert!(t.finish_if_due(1_950).is_empty(), "n1 has not applied, no packet yet");
        t.applied(&key(AgentRole::Node, "n1"), 10, 2_000);
        // A report of another gateway, then one without new bytes.
        t.tunnels("gw1", &[tunnel("b", 900)], 2_050);
        t.tunnels("gw2", &[tunnel("b", 500)], 2_060);
        assert!(t.finish_if_due(2_070).is_empty());
        t.tunnels("gw2", &[tunnel("b", 700)], 2_100);
        let steps = t.finish_if_due(2_110);
        let get = |s: Step| steps.iter().find(|(x, _)| *x == s).map(|(_, v)| *v);
        assert_eq!(get(Step::Expired), Some(0.8));
        assert_eq!(get(Step::Elected), Some(0.02));
        assert_eq!(get(Step::Pushed), Some(0.03));
        assert_eq!(get(Step::Applied), Some(0.15));
        assert_eq!(get(Step::PeerTold), Some(0.04), "from the election");
        assert_eq!(get(Step::PeerMoved), Some(0.02), "from peer_told");
        assert_eq!(
            get(Step::FirstPacket),
            Some(0.1),
            "from the latest of applied and the peer's steps"
        );
        assert!(t.finish_if_due(3_000).is_empty(), "observed once");
        let pb = t.last("r1").unwrap();
        assert!(pb.complete);
        assert!(pb.waiting.is_empty());
        let offsets: Vec<(String, i64)> = pb.steps.iter().map(|s| (s.step.clone(), s.offset_ms)).collect();
        assert_eq!(
            offsets,
            [
                ("fault", 0),
                ("expired", 800),
                ("elected", 820),
                ("pushed", 850),
                ("applied", 1_000),
                ("peer_told", 860),
                ("peer_moved", 880),
                ("first_packet", 1_100)
            ]
            .map(|(s, o)| (s.to_string(), o))
        );
        assert_eq!(pb.steps[3].count, 2);
        assert_eq!(pb.steps[4].last_subject, "n1");
    }

    #[test]
    fn a_failover_that_never_completes_ends_after_a_minute_naming_what_it_waited_for() {
        let mut t = Timeline::default();
        // A fault long before the election is another story.
        t.silent("gw1", 1_000, 1_000, "silent");
        elect(&mut t, 1_000 + RELATED_MS + 1);
        let at = 1_000 + RELATED_MS + 1;
        assert!(t.finish_if_due(at + GIVE_UP_MS - 1).is_empty());
        let steps = t.finish_if_due(at + GIVE_UP_MS);
        assert!(steps.is_empty(), "only the election: nothing before it to time from");
        assert!(t.finish_if_due(at + GIVE_UP_MS + 1).is_empty());
        let pb = t.last("r1").unwrap();
        assert!(pb.complete);
        assert_eq!(pb.steps.len(), 1);
        assert_eq!(pb.steps[0].offset_ms, 0);
        assert!(pb.waiting.contains(&"applied:n1".to_string()), "{:?}", pb.waiting);
        assert!(pb.waiting.contains(&"first_packet:b".to_string()));
        assert!(pb.waiting.contains(&"peer_moved:b".to_string()));
        // A handshake after the election counts as traffic, at its own time.
        let mut t = Timeline::default();
        elect(&mut t, 5_000);
        let mut hs = tunnel("b", 500);
        hs.last_handshake = Some(weft_proto::timestamp_ms(5_200));
        t.tunnels("gw2", &[hs], 5_900);
        assert_eq!(t.last("r").unwrap().steps[1].offset_ms, 200);
    }
}
