//! Relayed tunnels on the controller (see `weft_core::relay`): what this
//! site tells each peer of relays, and, on the leading replica, the relay
//! ports it holds for peers and the relay each of its own tunnels takes.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};

use super::*;

/// Requests refused: the far end is not a peer of this site, or no relay
/// port was free.
static REFUSED_NOT_PEERED: AtomicU64 = AtomicU64::new(0);
static REFUSED_NO_PORT: AtomicU64 = AtomicU64::new(0);
static REFUSED_NOT_RELAYING: AtomicU64 = AtomicU64::new(0);

/// How often the leader looks again (a relay going down is seen through its
/// tunnel's probes, which take 3 s; this adds at most this much).
const EVERY: Duration = Duration::from_millis(250);

/// How long a hole punch may take before the tunnel goes through a relay
/// (UDP blocked between the two NATs, or NAT behaviour misjudged).
const PUNCH_WINDOW: Duration = Duration::from_secs(15);

/// How long a tunnel relayed after a failed hole punch stays relayed before
/// the punch is tried again (sooner when either side's discovery finds
/// something new). A try breaks the tunnel for up to [`PUNCH_WINDOW`]
/// when the punch still fails.
const RETRY_DIRECT: Duration = Duration::from_secs(600);

/// Each tunnel's path as the leader last saw it, and the moves it saw, by
/// peer site and the path moved to (`weft_controller_peering_path_changes`).
#[derive(Default)]
struct Moves(std::sync::Mutex<MovesSeen>);

/// This process's (the leader's, while it leads).
static MOVES: std::sync::LazyLock<Moves> = std::sync::LazyLock::new(Moves::default);

#[derive(Default)]
struct MovesSeen {
    last: std::collections::HashMap<String, String>,
    counts: std::collections::BTreeMap<(String, &'static str), u64>,
}

/// A path as the metric labels it: direct, hole-punched, relayed, waiting.
fn path_kind(path: &str) -> &'static str {
    match path {
        "direct" => "direct",
        "hole-punched" => "hole-punched",
        p if p.starts_with("relayed via ") => "relayed",
        _ => "waiting",
    }
}

impl Moves {
    /// Peer `site`'s tunnel takes `path` now: the path it moved from, if
    /// it moved (its first sighting is no move).
    fn see(&self, site: &str, path: String) -> Option<String> {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let kind = path_kind(&path);
        let from = m.last.insert(site.to_string(), path.clone())?;
        if from == path {
            return None;
        }
        *m.counts.entry((site.to_string(), kind)).or_default() += 1;
        Some(from)
    }

    /// Forgets every path seen and every move counted: a replica that no
    /// longer leads neither counts nor reports them (the leader does).
    fn clear(&self) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.last.clear();
        m.counts.clear();
    }

    /// Forgets peers that are gone.
    fn keep(&self, peers: &std::collections::HashSet<&String>) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.last.retain(|s, _| peers.contains(s));
        m.counts.retain(|(s, _), _| peers.contains(s));
    }

    fn series(&self, f: &mut weft_common::obs::Families) {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        for ((site, path), n) in &m.counts {
            f.counter(
                "weft_controller_peering_path_changes",
                "Times the peering's tunnel moved to this path (direct, hole-punched, relayed, waiting), as the leading replica saw it",
                &[("peer_site", site.as_str()), ("path", path)],
                *n,
            );
        }
    }
}

/// The leader's memory of hole punches that did not come up, by peer site.
#[derive(Default)]
pub struct Punches(std::sync::Mutex<std::collections::HashMap<String, Punch>>);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Punch {
    /// Punching since then, not up yet.
    Trying(std::time::Instant),
    /// Gave up then: relayed. With what discovery had found (a hash): a
    /// change tries again.
    Failed(std::time::Instant, u64),
}

impl Punches {
    /// One look at peer `site`'s tunnel: `punching`: its direct path is a
    /// hole punch; `up`: the tunnel is up through it; `found`: both sides'
    /// discovery results (a hash); `now`: the time. True while the tunnel
    /// should go through a relay.
    fn step(&self, now: std::time::Instant, site: &str, punching: bool, up: bool, found: u64) -> bool {
        let mut all = self.0.lock().unwrap();
        if !punching {
            all.remove(site);
            return false;
        }
        match all.get(site).copied() {
            None if up => false,
            None => {
                all.insert(site.to_string(), Punch::Trying(now));
                false
            }
            Some(Punch::Trying(_)) if up => {
                all.remove(site);
                false
            }
            Some(Punch::Trying(since)) if now - since >= PUNCH_WINDOW => {
                tracing::warn!(peer = %site, window = ?PUNCH_WINDOW, "the hole punch did not come up; the tunnel goes through a relay");
                all.insert(site.to_string(), Punch::Failed(now, found));
                true
            }
            Some(Punch::Trying(_)) => false,
            Some(Punch::Failed(at, seen)) if seen != found || now - at >= RETRY_DIRECT => {
                tracing::info!(peer = %site, "trying the hole punch again");
                all.insert(site.to_string(), Punch::Trying(now));
                false
            }
            Some(Punch::Failed(..)) => true,
        }
    }

    /// Whether peer `site`'s tunnel is relayed because its hole punch failed.
    fn failed(&self, site: &str) -> bool {
        matches!(self.0.lock().unwrap().get(site), Some(Punch::Failed(..)))
    }
}

/// What discovery found on both sides of peering `p`, as a hash: a change
/// may open a direct path.
fn found(p: &Peering, local: &[pb::GatewayInfo]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for g in local {
        g.nat.hash(&mut h);
        for c in &g.candidates {
            c.address.hash(&mut h);
        }
    }
    for g in p.remote.iter().flat_map(|r| r.gateways.iter()) {
        g.nat.map(|n| n.as_str()).hash(&mut h);
        for c in &g.candidates {
            c.address.to_string().hash(&mut h);
        }
    }
    h.finish()
}

/// Whether this site's tunnel to peering `p` should go through a relay: no
/// direct path, or a hole punch that did not come up.
fn wants(fed: &Federation, p: &Peering, local: &[pb::GatewayInfo]) -> bool {
    weft_core::peer::wants_relay(p, local) || fed.punches.failed(&p.site_id)
}

/// Whether this replica knows peer `site`'s tunnel to be down (a fresh
/// report from a gateway says it is not up, a new one included).
/// Gateways report to the replica they are connected to: another replica
/// knows nothing, and then relies on the relay site itself (it withdraws
/// its grants when it cannot relay).
fn known_down(fed: &Federation, site: &str) -> bool {
    fed.hub.tunnel(site).is_some_and(|t| !t.up)
}

/// The active gateway's endpoint address: where relayed tunnels reach this
/// site.
pub(super) fn relay_ip(model: &crate::render::Model) -> Option<std::net::IpAddr> {
    crate::render::active_gateway(model)
        .and_then(|g| g.endpoint)
        .map(|a| a.ip())
}

/// Fills in what `params` (for `peer`) says of relays: whether this site
/// relays, the tunnels it asks `peer` to relay (when `peer` relays), and
/// its answers to what `peer` asked of it.
pub(super) fn fill(fed: &Federation, model: &crate::render::Model, peer: &str, params: &mut pb::NetworkParams) {
    let Some(site) = model.site.as_ref() else { return };
    let ip = relay_ip(model);
    params.relay = site.relay_ports.is_some() && ip.is_some();
    params.relay_tls_port = site.relay_tls_port.filter(|_| params.relay).map_or(0, u32::from);
    let Some(p) = model.peerings.get(peer) else { return };
    // Asked only of a relay this site can reach (its tunnel not known to be
    // down): a relay one end cannot use is given up by both, since the
    // other end's grant goes with this request.
    if p.remote.as_ref().is_some_and(|r| r.relay) && !known_down(fed, peer) {
        let gateways = LocalGateways::of(model);
        params.relay_for = model
            .peerings
            .iter()
            .filter(|(s, q)| s.as_str() != peer && wants(fed, q, &gateways.for_port(site, q.listen_port)))
            .map(|(s, _)| s.clone())
            .take(weft_core::relay::MAX_RELAY_REQUESTS)
            .collect();
    }
    params.relays = weft_core::relay::answer(p, &model.peerings, site.relay_ports.is_some(), ip);
}

/// On the leading replica, until the process ends: keeps the relay ports
/// this site holds for its peers' relayed tunnels, and the relay each of
/// this site's tunnels without a direct path takes.
pub async fn keep_relays(fed: Arc<Federation>, leader: tokio::sync::watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Refusals already counted, so each is counted once while it lasts.
    let mut refused: HashSet<(String, String)> = HashSet::new();
    let mut ports_written_at: Option<i64> = None;
    loop {
        tick.tick().await;
        if !*leader.borrow() {
            MOVES.clear();
            continue;
        }
        let model = fed.hub.model();
        let Some(site) = model.site.clone() else { continue };
        let relays = site.relay_ports.is_some();
        let has_endpoint = relay_ip(&model).is_some();
        // What peers asked of this site.
        let mut now_refused = HashSet::new();
        for (asking, p) in model.peerings.iter() {
            for far in p.remote.iter().flat_map(|r| r.relay_for.iter()) {
                if let Some(why) = weft_core::relay::refusal(p, far, &model.peerings, relays, has_endpoint) {
                    let pair = (asking.clone(), far.clone());
                    if !refused.contains(&pair) {
                        tracing::warn!(peer = %asking, far = %far, reason = %why.message, "a relay request refused");
                        let counter = match why.reason {
                            "not_peered" => &REFUSED_NOT_PEERED,
                            _ => &REFUSED_NOT_RELAYING,
                        };
                        counter.fetch_add(1, Ordering::Relaxed);
                    }
                    now_refused.insert(pair);
                }
            }
        }
        // Ports are allocated from the model: not again before it shows the
        // last allocation (a lagging model would give a port twice;
        // `allocate` also mends that, at the cost of a session restart).
        let caught_up = ports_written_at.is_none_or(|r| model.revision > r);
        if !caught_up {
            // Refusals of this tick are not all known: none counted twice.
            now_refused.extend(refused.iter().cloned());
        }
        if let (Some(range), true) = (site.relay_ports, caught_up) {
            let (changes, exhausted) = weft_core::relay::allocate(&model.peerings, relays, has_endpoint, range);
            if !changes.is_empty() {
                ports_written_at = Some(model.revision);
            }
            for pair in exhausted {
                if !refused.contains(&pair) {
                    tracing::warn!(peer = %pair.0, far = %pair.1, %range, "a relay request refused: no relay port is free");
                    REFUSED_NO_PORT.fetch_add(1, Ordering::Relaxed);
                }
                now_refused.insert(pair);
            }
            for (peer, ports) in changes {
                match fed.state.set_relay(&peer, Some(ports.clone()), None).await {
                    Ok(_) => tracing::info!(peer = %peer, ?ports, "relay ports for the peer's tunnels"),
                    Err(e) => tracing::warn!(peer = %peer, error = %e, "cannot record relay ports"),
                }
            }
        } else if site.relay_ports.is_none() {
            for (peer, _) in model.peerings.iter().filter(|(_, p)| !p.relay_ports.is_empty()) {
                if let Err(e) = fed.state.set_relay(peer, Some(Default::default()), None).await {
                    tracing::warn!(peer = %peer, error = %e, "cannot drop relay ports");
                }
            }
        }
        refused = now_refused;
        // This site's own tunnels.
        MOVES.keep(&model.peerings.keys().collect());
        let gateways = LocalGateways::of(&model);
        for (peer, p) in model.peerings.iter() {
            let local = gateways.for_port(&site, p.listen_port);
            let punching = p.remote.is_some() && weft_core::peer::direct_path(p, &local) == "hole-punched";
            // Up through the punch, not through a relay still in use (not
            // known down counts as up: a replica the gateways do not report
            // to never gives up on a punch).
            let up = p.relay_via.is_none() && !known_down(&fed, peer);
            let failed = fed
                .punches
                .step(std::time::Instant::now(), peer, punching, up, found(p, &local));
            let via = if failed || weft_core::peer::wants_relay(p, &local) {
                weft_core::relay::choose(p, &model.peerings, |r, _| !known_down(&fed, r))
            } else {
                None
            };
            let path = weft_core::peer::tunnel_path(p, &local, fed.hub.tunnel(peer).is_some_and(|t| t.up));
            if let Some(from) = MOVES.see(peer, path.clone()) {
                tracing::info!(peer = %peer, %from, to = %path, "the tunnel's path moved");
            }
            if via != p.relay_via {
                match fed.state.set_relay(peer, None, Some(via.clone())).await {
                    Ok(_) => match &via {
                        Some(v) => {
                            tracing::info!(peer = %peer, relay = %v.site, endpoint = %v.endpoint, "the tunnel goes through a relay")
                        }
                        None => tracing::info!(peer = %peer, "the tunnel no longer goes through a relay"),
                    },
                    Err(e) => tracing::warn!(peer = %peer, error = %e, "cannot record the tunnel's relay"),
                }
            }
        }
    }
}

/// The relay's counters, and the tunnels' path moves, into the
/// controller's metrics.
pub fn series(f: &mut weft_common::obs::Families) {
    MOVES.series(f);
    for (why, n) in [
        ("not_peered", &REFUSED_NOT_PEERED),
        ("no_port", &REFUSED_NO_PORT),
        ("not_relaying", &REFUSED_NOT_RELAYING),
    ] {
        f.counter(
            "weft_controller_relay_requests_refused",
            "Peers' requests to relay a tunnel that this site refused: the far end is not a peer of this site, no relay port was free, or this site does not relay",
            &[("reason", why)],
            n.load(Ordering::Relaxed),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_move_of_a_tunnels_path_is_counted_by_where_it_went() {
        let m = Moves::default();
        assert_eq!(m.see("b", "waiting".into()), None, "a first sighting is no move");
        assert_eq!(m.see("b", "waiting".into()), None);
        assert_eq!(m.see("b", "relayed via r".into()), Some("waiting".into()));
        assert_eq!(m.see("b", "hole-punched".into()), Some("relayed via r".into()));
        assert_eq!(m.see("b", "relayed via r2".into()), Some("hole-punched".into()));
        assert_eq!(m.see("b", "relayed via r".into()), Some("relayed via r2".into()));
        let counts = |m: &Moves| m.0.lock().unwrap().counts.clone();
        let want: std::collections::BTreeMap<(String, &str), u64> = [
            (("b".to_string(), "hole-punched"), 1),
            (("b".to_string(), "relayed"), 3),
        ]
        .into();
        assert_eq!(counts(&m), want);
        m.keep(&Default::default());
        assert!(counts(&m).is_empty(), "a gone peer's moves go");
    }

    #[test]
    fn a_hole_punch_that_does_not_come_up_is_relayed_then_tried_again() {
        let p = Punches::default();
        let t0 = std::time::Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        // Up at once: never relayed.
        assert!(!p.step(at(0), "b", true, true, 1));
        // Down: tried for the window, then relayed.
        assert!(!p.step(at(1), "b", true, false, 1));
        assert!(!p.step(at(15), "b", true, false, 1));
        assert!(p.step(at(16), "b", true, false, 1));
        assert!(p.failed("b"));
        assert!(p.step(at(300), "b", true, false, 1));
        // Discovery found something new: tried again, and it comes up.
        assert!(!p.step(at(301), "b", true, false, 2));
        assert!(!p.step(at(302), "b", true, true, 2));
        assert!(!p.failed("b"));
        // Failed again: tried again after RETRY_DIRECT whatever discovery says.
        assert!(!p.step(at(400), "b", true, false, 2));
        assert!(p.step(at(416), "b", true, false, 2));
        assert!(!p.step(at(416 + RETRY_DIRECT.as_secs()), "b", true, false, 2));
        // No longer a hole punch (an endpoint, or no direct path): forgotten.
        assert!(!p.step(at(2000), "b", false, false, 2));
        assert!(!p.failed("b"));
    }
}
