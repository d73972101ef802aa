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

/// How long a hole punch is given alone before the tunnel goes through a
/// relay, from a gateway that cannot try it beside one (kernel
/// WireGuard, an older agent): UDP blocked between the two NATs, or NAT
/// behaviour misjudged.
const PUNCH_WINDOW: Duration = Duration::from_secs(15);

/// How long such a tunnel, relayed after a failed punch, stays relayed
/// before the punch is tried alone again (sooner when either side's
/// discovery finds something new). A try breaks the tunnel for up to
/// [`PUNCH_WINDOW`] when the punch still fails.
const RETRY_DIRECT: Duration = Duration::from_secs(600);

/// How long a tunnel must be on the punch tried beside its relay before
/// the relay goes; doubled for each move back to the relay within
/// [`FLAP_WITHIN`] of the last (a punch that answers only now and then),
/// up to [`DIRECT_HOLD_MAX`].
const DIRECT_HOLD: Duration = Duration::from_secs(3);
const DIRECT_HOLD_MAX: Duration = Duration::from_secs(300);
const FLAP_WITHIN: Duration = Duration::from_secs(60);

/// The leader's memory of hole punches not up, by peer site, and when
/// each tunnel last left its relay for its punch (and how many times in a
/// row it came back soon after).
#[derive(Default)]
pub struct Punches(std::sync::Mutex<PunchesSeen>);

#[derive(Default)]
struct PunchesSeen {
    punches: std::collections::HashMap<String, Punch>,
    left_relay: std::collections::HashMap<String, (std::time::Instant, u32)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Punch {
    /// Relayed, the punch tried beside the relay (a gateway that can):
    /// since when the tunnel has been on the punch, and for how long it
    /// must be before the relay goes.
    Beside {
        direct_since: Option<std::time::Instant>,
        hold: Duration,
    },
    /// Punching alone since then, not up yet.
    Trying(std::time::Instant),
    /// Gave up then: relayed. With what discovery had found (a hash): a
    /// change tries again.
    Failed(std::time::Instant, u64),
}

/// What the leader sees of a tunnel for [`Punches::step`].
#[derive(Clone, Copy, Debug)]
struct Look {
    punching: bool,
    beside: bool,
    direct_up: bool,
    on_relay: bool,
    found: u64,
}

impl Punches {
    /// One look at peer `site`'s tunnel (`look`): `punching`: its direct path is a
    /// hole punch; `beside`: this site's gateway tries a punch beside a
    /// relay; `direct_up`: the tunnel is up on the punch (not through a
    /// relay, or moved to the punch tried beside one); `on_relay`: a relay
    /// is in use now; `found`: both sides' discovery results (a hash).
    /// True while the tunnel should go through a relay:
    /// - with `beside`, a punch not up is relayed at once, and the gateways
    ///   try it beside the relay (`WireguardPeer.direct`) and move to it
    ///   once it answers; the relay goes once the tunnel has been on it for
    ///   a hold ([`DIRECT_HOLD`], longer for a punch that keeps failing);
    /// - without, the punch is given [`PUNCH_WINDOW`] alone, then relayed,
    ///   and tried alone again when discovery finds something new or after
    ///   [`RETRY_DIRECT`].
    fn step(&self, now: std::time::Instant, site: &str, look: Look) -> bool {
        let Look {
            punching,
            beside,
            direct_up,
            on_relay,
            found,
        } = look;
        let mut seen = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let PunchesSeen { punches, left_relay } = &mut *seen;
        if !punching {
            punches.remove(site);
            return false;
        }
        let since = |at: std::time::Instant| now.saturating_duration_since(at);
        let next = match (punches.get(site).copied(), beside) {
            (None, _) if direct_up => None,
            (None, true) => {
                // Back soon after it left the relay: hold the punch longer.
                let hold = match left_relay.get(site) {
                    Some((at, n)) if since(*at) < FLAP_WITHIN => DIRECT_HOLD
                        .saturating_mul(2u32.saturating_pow(n + 1))
                        .min(DIRECT_HOLD_MAX),
                    _ => DIRECT_HOLD,
                };
                tracing::info!(peer = %site, ?hold, "the hole punch is not up: the tunnel goes through a relay meanwhile, the punch tried beside it");
                Some(Punch::Beside {
                    direct_since: None,
                    hold,
                })
            }
            (None, false) => Some(Punch::Trying(now)),
            // Up on the punch before any relay took the tunnel: nothing
            // to leave.
            (Some(Punch::Beside { .. }), _) if direct_up && !on_relay => None,
            (Some(Punch::Beside { direct_since, hold }), _) if direct_up => {
                let on = direct_since.unwrap_or(now);
                if since(on) >= hold {
                    tracing::info!(peer = %site, "the tunnel holds on the hole punch tried beside the relay; the relay goes");
                    let n = match left_relay.get(site) {
                        Some((at, n)) if since(*at) < FLAP_WITHIN + hold => n + 1,
                        _ => 0,
                    };
                    left_relay.insert(site.to_string(), (now, n));
                    None
                } else {
                    Some(Punch::Beside {
                        direct_since: Some(on),
                        hold,
                    })
                }
            }
            (Some(Punch::Beside { hold, .. }), _) => Some(Punch::Beside {
                direct_since: None,
                hold,
            }),
            (Some(Punch::Trying(_)), _) if direct_up => None,
            (Some(Punch::Trying(at)), _) if since(at) >= PUNCH_WINDOW => {
                tracing::warn!(peer = %site, window = ?PUNCH_WINDOW, "the hole punch did not come up; the tunnel goes through a relay");
                Some(Punch::Failed(now, found))
            }
            (Some(Punch::Failed(at, was)), _) if was != found || since(at) >= RETRY_DIRECT => {
                tracing::info!(peer = %site, "trying the hole punch again");
                Some(Punch::Trying(now))
            }
            (other, _) => other,
        };
        match next {
            Some(p) => punches.insert(site.to_string(), p),
            None => punches.remove(site),
        };
        matches!(next, Some(Punch::Beside { .. } | Punch::Failed(..)))
    }

    /// Whether peer `site`'s tunnel is relayed because its punch is not up.
    fn relayed(&self, site: &str) -> bool {
        let seen = self.0.lock().unwrap_or_else(|e| e.into_inner());
        matches!(seen.punches.get(site), Some(Punch::Beside { .. } | Punch::Failed(..)))
    }
}

/// What discovery found on both sides of peering `p`, as a hash: a change
/// may open a direct path.
fn found(p: &Peering, local: &[pb::GatewayInfo]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for g in local {
        g.nat.hash(&mut h);
        for c in g.candidates.iter().chain(&g.candidates_v6) {
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
/// direct path, or a hole punch not up yet.
fn wants(fed: &Federation, p: &Peering, local: &[pb::GatewayInfo]) -> bool {
    weft_core::peer::wants_relay(p, local) || fed.punches.relayed(&p.site_id)
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
            // Up through the punch: not through a relay (not known down
            // counts as up: a replica the gateways do not report to never
            // starts relaying a punch), or moved to the punch tried beside
            // it.
            let t = fed.hub.tunnel(peer);
            let direct_up =
                (p.relay_via.is_none() && !known_down(&fed, peer)) || t.as_ref().is_some_and(|t| t.up && t.on_direct);
            // The active gateway tries the punch beside a relay.
            let beside = crate::render::active_gateway(&model).is_some_and(|g| g.punches_beside);
            let look = Look {
                punching,
                beside,
                direct_up,
                on_relay: p.relay_via.is_some(),
                found: found(p, &local),
            };
            let relayed = fed.punches.step(std::time::Instant::now(), peer, look);
            let via = if relayed || weft_core::peer::wants_relay(p, &local) {
                weft_core::relay::choose(p, &model.peerings, |r, _| !known_down(&fed, r))
            } else {
                None
            };
            let path = weft_core::peer::tunnel_path(
                p,
                &local,
                t.as_ref().is_some_and(|t| t.up),
                t.as_ref().is_some_and(|t| t.on_direct),
            );
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

    fn look(punching: bool, beside: bool, direct_up: bool, on_relay: bool, found: u64) -> Look {
        Look {
            punching,
            beside,
            direct_up,
            on_relay,
            found,
        }
    }

    #[test]
    fn a_hole_punch_not_up_is_relayed_at_once_and_the_relay_goes_once_the_punch_holds() {
        let p = Punches::default();
        let t0 = std::time::Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let step = |ms: u64, up: bool| p.step(at(ms), "b", look(true, true, up, true, 1));
        // Up at once: never relayed.
        assert!(!step(0, true));
        // Down: relayed at once, for as long as the punch does not answer.
        assert!(step(1_000, false));
        assert!(p.relayed("b"));
        assert!(step(600_000, false));
        // On the punch: the relay goes once it held for 3 s.
        assert!(step(601_000, true));
        assert!(step(603_000, true));
        assert!(!step(604_000, true));
        assert!(!p.relayed("b"));
        // Down again soon: relayed at once, and the punch must hold longer
        // (6 s) before the relay goes again.
        assert!(step(610_000, false));
        assert!(step(611_000, true));
        assert!(step(616_000, true));
        assert!(!step(617_000, true));
        // A punch that answers only now and then: the relay stays.
        assert!(step(620_000, false));
        assert!(step(621_000, true));
        assert!(step(622_000, false));
        assert!(step(623_000, true));
        assert!(step(630_000, true));
        // No longer a hole punch (an endpoint, or no direct path): forgotten.
        assert!(!p.step(at(700_000), "b", look(false, true, false, false, 1)));
        assert!(!p.relayed("b"));
        // Down before any relay could take it, then up on the punch: no
        // relay, nothing held.
        assert!(p.step(at(800_000), "c", look(true, true, false, false, 1)));
        assert!(!p.step(at(801_000), "c", look(true, true, true, false, 1)));
        assert!(!p.relayed("c"));
    }

    #[test]
    fn a_gateway_that_cannot_punch_beside_a_relay_punches_alone_first() {
        let p = Punches::default();
        let t0 = std::time::Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        // Up at once: never relayed.
        assert!(!p.step(at(0), "b", look(true, false, true, false, 1)));
        // Down: tried alone for the window, then relayed.
        assert!(!p.step(at(1), "b", look(true, false, false, false, 1)));
        assert!(!p.step(at(15), "b", look(true, false, false, false, 1)));
        assert!(p.step(at(16), "b", look(true, false, false, false, 1)));
        assert!(p.relayed("b"));
        assert!(p.step(at(300), "b", look(true, false, false, false, 1)));
        // Discovery found something new: tried again, and it comes up.
        assert!(!p.step(at(301), "b", look(true, false, false, false, 2)));
        assert!(!p.step(at(302), "b", look(true, false, true, false, 2)));
        assert!(!p.relayed("b"));
        // Failed again: tried again after RETRY_DIRECT whatever discovery says.
        assert!(!p.step(at(400), "b", look(true, false, false, false, 2)));
        assert!(p.step(at(416), "b", look(true, false, false, false, 2)));
        assert!(!p.step(
            at(416 + RETRY_DIRECT.as_secs()),
            "b",
            look(true, false, false, false, 2)
        ));
    }
}
