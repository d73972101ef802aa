//! The agent's main loop, shared by both agents: enroll (or load the stored
//! identity), apply the stored desired state, then watch the controller —
//! apply each snapshot or delta, persist it, report — and keep the
//! certificate renewed, reconnecting with jittered backoff, until a signal
//! stops it or the controller says the agent was removed.

use std::time::{Duration, SystemTime};

use tokio::sync::watch;

use crate::apply::{Applier, DryRun, Scope};
use crate::config::AgentConfig;
use crate::desired::{Desired, StateFile};
use crate::guard::{Guard, Guarded};
use crate::identity::{AgentKind, Credentials, IdentityStore, RenewError};
use crate::session::{Dns, End, Session, jitter, observe_reconcile, session};

pub use weft_common::backoff;

/// How soon an agent that lost its controllers (no answer, as opposed to
/// an error answer) tries them again.
const RETRY_LOST: Duration = Duration::from_secs(1);

/// Over how long the nodes of a replica that went away move to the next
/// one. Not gateways: a gateway silent for its TTL (800 ms by default) is
/// failed over, so it moves at once.
const MOVE_SPREAD: Duration = Duration::from_secs(2);

/// How often an agent the controller refuses (not removed) asks again.
const REFUSED_RETRY: Duration = Duration::from_secs(30);

/// Removes everything the agent applied and forgets it. Objects that could
/// not be removed stay in the stored state, so a later `--teardown` retries
/// them; returns how many.
async fn teardown(desired: &mut Desired, file: &StateFile, applier: &mut dyn Applier) -> usize {
    let ids: Vec<String> = desired.objects.keys().cloned().collect();
    let errors = applier
        .apply(&desired.objects, &crate::apply::Objects::new(), Scope::Changed)
        .await;
    for e in &errors {
        tracing::warn!(object = %e.id, error = %e.message, "not removed");
    }
    tracing::info!(
        removed = ids.len() - errors.len(),
        "removed weft's objects from the host"
    );
    let failed: std::collections::HashSet<&str> = errors.iter().map(|e| e.id.as_str()).collect();
    desired.objects.retain(|id, _| failed.contains(id.as_str()));
    desired.revision = 0; // a later session starts from a snapshot
    if let Err(e) = file.save(desired) {
        tracing::warn!(error = %format!("{e:#}"), "cannot save the stored state");
    }
    errors.len()
}

/// Asks the controller which CAs the site trusts (at every new session:
/// `connected`), takes them in, and says when to renew because the
/// agent's certificate is from a CA the site is rotating away from.
async fn follow_trust(ids: &IdentityStore, target: &str, tx: &watch::Sender<Credentials>) -> Option<Duration> {
    let creds = tx.borrow().clone();
    let trust = match ids.trust(target, &creds).await {
        Ok(Some(t)) => t,
        Ok(None) => return None,
        Err(e) => {
            tracing::debug!(controller = %target, error = %format!("{e:#}"), "cannot ask which CAs the site trusts");
            return None;
        }
    };
    match ids.set_trust(&creds, &trust.ca_pem) {
        Ok(Some(c)) => {
            tracing::info!(
                cas = c.ca_pem.matches("BEGIN CERTIFICATE").count(),
                "the site's CAs changed; trusting them from now on"
            );
            tx.send_replace(c);
        }
        Ok(None) => {}
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "the controller sent unusable CA certificates; keeping the ones held")
        }
    }
    let within = trust
        .renew_within
        .and_then(|d| Duration::try_from(d).ok())
        .unwrap_or(Duration::from_secs(2))
        .min(Duration::from_secs(3600));
    trust.renew.then(|| jitter(within))
}

/// Renews the certificate at two thirds of its life, forever, and at once
/// (within a spread the controller gives) when the site's CA was rotated.
async fn renew_forever(
    ids: IdentityStore,
    cfg: AgentConfig,
    tx: watch::Sender<Credentials>,
    mut connected: watch::Receiver<String>,
) -> anyhow::Result<()> {
    let mut delays = backoff();
    // Renewals go down the agent's own order of controllers, as sessions
    // do (so the agents of a replica that went away spread out).
    let order = cfg.controller_order();
    let mut at = 0usize;
    // A renewal the controller asked for (a rotation of the site CA): due
    // until one succeeds, each failure waiting its backoff.
    let mut due = false;
    loop {
        let creds = tx.borrow().clone();
        let wait = if due {
            Duration::ZERO
        } else {
            creds.renew_at().duration_since(SystemTime::now()).unwrap_or_default()
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            r = connected.changed() => {
                if r.is_err() {
                    // No session will tell again: renew on time only.
                    tokio::time::sleep(wait).await;
                } else {
                    let target = connected.borrow_and_update().clone();
                    match follow_trust(&ids, &target, &tx).await {
                        Some(after) => {
                            tracing::info!(renew_in = ?after, "this agent's certificate is from a CA the site is retiring; renewing");
                            tokio::time::sleep(after).await;
                            due = true;
                            // From the controller that said so.
                            if let Some(i) = order.iter().position(|&i| cfg.controllers[i] == target) {
                                at = i;
                            }
                        }
                        None => continue,
                    }
                }
            }
        }
        let creds = tx.borrow().clone();
        match ids.renew(&cfg.controllers[order[at]], &cfg.name, &creds).await {
            Ok(c) => {
                tracing::info!(valid_for = ?c.not_after.duration_since(SystemTime::now()).unwrap_or_default(), "certificate renewed");
                tx.send_replace(c);
                delays = backoff();
                due = false;
            }
            // Refused, or expired before it could be renewed: the agent
            // cannot fix that itself, but stopping would stop the host's
            // forwarding (a userspace gateway's tunnels live in this
            // process). It says so and keeps asking, slowly.
            Err(RenewError::Refused(e)) => {
                tracing::error!(
                    error = %format!("{e:#}"),
                    retry_in = ?REFUSED_RETRY,
                    "the controller refused to renew this agent; the host keeps forwarding what it has. \
                     Enroll it again with a new token (or remove it with --teardown)"
                );
                tokio::time::sleep(REFUSED_RETRY).await;
            }
            Err(RenewError::Transient(e)) if creds.not_after <= SystemTime::now() => {
                tracing::error!(
                    error = %e,
                    retry_in = ?REFUSED_RETRY,
                    "the certificate expired before it could be renewed; the host keeps forwarding what it has. \
                     Enroll it again with a new token"
                );
                tokio::time::sleep(REFUSED_RETRY).await;
            }
            Err(RenewError::Transient(e)) => {
                let delay = delays.next().unwrap_or(Duration::from_secs(60));
                at = (at + 1) % order.len();
                tracing::warn!(error = %e, retry_in = ?delay, "renewal failed");
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// `--teardown`: removes what the stored state says was applied. No
/// controller needed.
async fn teardown_only(cfg: &AgentConfig) -> anyhow::Result<()> {
    // No controller needed: what was applied is in the stored state.
    let file = StateFile::new(&cfg.state_dir);
    let mut desired = file.load()?.unwrap_or_default();
    if desired.objects.is_empty() {
        tracing::info!(state_dir = %cfg.state_dir.display(), "nothing stored, nothing to remove");
        return Ok(());
    }
    let guard = Guard::new(cfg.underlay_ip, &cfg.controllers);
    let mut applier: Box<dyn Applier> = if cfg.dry_run {
        Box::new(Guarded::new(DryRun::default(), guard))
    } else {
        Box::new(Guarded::new(crate::linux::Linux::new(None, None)?, guard))
    };
    let left = teardown(&mut desired, &file, applier.as_mut()).await;
    if left > 0 {
        anyhow::bail!(
            "{left} objects could not be removed (see above); they stay in the stored state, run --teardown again"
        );
    }
    Ok(())
}

/// The host's applier (or, with --dry-run, one that only prints), behind
/// the guard.
fn applier_for(cfg: &AgentConfig, wg_key: Option<weft_types::WgSecret>) -> anyhow::Result<Box<dyn Applier>> {
    // Everything the controller sends, and the stored state, passes the
    // guard before it reaches the host.
    let guard = Guard::new(cfg.underlay_ip, &cfg.controllers);
    Ok(if cfg.dry_run {
        tracing::info!("--dry-run: changes are printed, not made");
        Box::new(Guarded::new(DryRun::default(), guard))
    } else {
        Box::new(Guarded::new(
            crate::linux::Linux::new(wg_key, cfg.wireguard.clone())?
                .with_probes(cfg.probe)
                .with_underlay(cfg.underlay_ip)
                .with_lan_address(cfg.lan_address)
                .with_controllers(&cfg.controllers),
            guard,
        ))
    })
}

/// The node's DNS responder, serving what is stored until a controller
/// answers.
fn dns_for(cfg: &AgentConfig, kind: AgentKind, desired: &Desired) -> anyhow::Result<Option<Dns>> {
    Ok(match (&cfg.dns, kind) {
        (Some(c), AgentKind::Node) => Some(Dns::start(c, desired)?),
        _ => None,
    })
}

/// Which controller an agent tries next, and after how long.
struct Retry {
    /// The controllers (indexes) in this agent's order of preference (see
    /// [`AgentConfig::controller_order`]).
    order: Vec<usize>,
    /// Where in `order` the controller to try is.
    at: usize,
    /// Controllers tried since the last good session: the next replica is
    /// tried at once, the back-off applies only after a whole round failed.
    tried: usize,
    delays: Box<dyn Iterator<Item = Duration> + Send>,
    fresh: fn() -> Box<dyn Iterator<Item = Duration> + Send>,
    /// Over how long a move after a session that was up is spread (nodes:
    /// [`MOVE_SPREAD`]; gateways: none, a silent gateway fails over).
    spread: Duration,
}

impl Retry {
    fn new(order: Vec<usize>, fresh: fn() -> Box<dyn Iterator<Item = Duration> + Send>) -> Retry {
        let order = if order.is_empty() { vec![0] } else { order };
        Retry {
            order,
            at: 0,
            tried: 0,
            delays: fresh(),
            fresh,
            spread: Duration::ZERO,
        }
    }

    /// Moves after a session that was up are spread over `spread`.
    fn spread_moves(mut self, spread: Duration) -> Retry {
        self.spread = spread;
        self
    }

    /// The index of the controller to try.
    fn controller(&self) -> usize {
        self.order[self.at]
    }

    /// This agent's first choice, when it is not the one to try now.
    fn preferred_elsewhere(&self) -> Option<usize> {
        (self.at != 0).then(|| self.order[0])
    }

    fn next_controller(&mut self) {
        self.at = (self.at + 1) % self.order.len();
    }

    /// The first choice answers again: back to it at once.
    fn back_to_preferred(&mut self) {
        self.at = 0;
        self.tried = 0;
        self.delays = (self.fresh)();
    }

    /// The controller refused the agent: the next one, after
    /// `REFUSED_RETRY`.
    fn refused(&mut self) {
        self.next_controller();
    }

    /// A session ended without a refusal (`lost`: nobody answered at all;
    /// `was_up`: it had lasted a while). The delay before the next
    /// controller: short within a round, then the back-off, or
    /// `RETRY_LOST` when nobody refused (so the agent is back within about
    /// a second of its controller).
    fn disconnected(&mut self, was_up: bool, lost: bool) -> Duration {
        if was_up {
            // The session was up: start over with short delays.
            self.delays = (self.fresh)();
            self.tried = 0;
        }
        self.tried += 1;
        let delay = if self.tried < self.order.len() && was_up {
            // The next replica at once, but after a session that was up
            // (its replica died, say, with thousands of agents on it)
            // spread over a while, so the others are not all asked in
            // the same instant.
            Duration::from_millis(100) + jitter(self.spread)
        } else if self.tried < self.order.len() {
            Duration::from_millis(100)
        } else if lost {
            self.tried = 0;
            RETRY_LOST
        } else {
            self.tried = 0;
            self.delays.next().unwrap_or(Duration::from_secs(60))
        };
        self.next_controller();
        delay
    }
}

/// Runs the agent until SIGTERM or SIGINT. Errors end the process loudly.
pub async fn run(cfg: AgentConfig, kind: AgentKind, subnet: Option<String>) -> anyhow::Result<()> {
    if cfg.teardown {
        return teardown_only(&cfg).await;
    }
    if let Some(addr) = cfg.metrics_listen {
        weft_common::obs::serve_metrics(addr, crate::metrics::get().registry.clone())
            .await
            .map_err(|e| anyhow::anyhow!("--metrics-listen {addr}: {e}"))?;
    }
    let ids = IdentityStore::new(&cfg.state_dir);
    let stored = ids.load()?;
    // Given a new token, an enrolled agent enrolls again: after its site
    // retired the CA that signed its certificate (`ca rotate
    // --revoke-old`), or its certificate expired. It does so once it has
    // put back what it applied, so the host forwards meanwhile.
    let again = stored.is_some() && ids.new_token(cfg.token.as_deref());
    let held = match stored {
        Some(c) if again || c.not_after > SystemTime::now() => c,
        Some(_) => anyhow::bail!(
            "the certificate in {} has expired; enroll the agent again: start it with --token from \
             `weftctl token create --role {} --name {}`",
            cfg.state_dir.display(),
            kind.as_str(),
            cfg.name
        ),
        None => ids.enroll(&cfg, kind, subnet.clone()).await?,
    };
    let wg_keys = match kind {
        AgentKind::Gateway => Some(crate::wgkey::keys(&cfg.state_dir)?),
        AgentKind::Node => None,
    };
    let gateway_key = wg_keys.as_ref().map(|k| k.1);
    if let Some(c) = &cfg.wireguard {
        tracing::info!(wireguard = c.mode(), reason = %c.reason, "WireGuard chosen");
        crate::metrics::get()
            .wireguard
            .get_or_create(&vec![("mode".to_string(), c.mode().to_string())])
            .set(1);
    }
    let mut applier = applier_for(&cfg, wg_keys.map(|k| k.0))?;
    let file = StateFile::new(&cfg.state_dir);
    let mut desired = file.load()?.unwrap_or_default();
    if !desired.objects.is_empty() {
        tracing::info!(
            revision = desired.revision,
            objects = desired.objects.len(),
            "applying the stored desired state"
        );
        // As a resync: what is stored was applied before, so objects that
        // still exist as stored are kept (a link re-created here would drop
        // the traffic through it), missing ones are made again.
        let started = std::time::Instant::now();
        let errors = applier
            .apply(&desired.objects, &desired.objects, Scope::Everything)
            .await;
        observe_reconcile("startup", started, &errors);
    }

    let mut dns = dns_for(&cfg, kind, &desired)?;
    let creds = if again {
        tracing::info!("given a new enrollment token: enrolling again");
        match ids.enroll(&cfg, kind, subnet).await {
            Ok(c) => c,
            // Refused (say, the name is still held by the certificate
            // held) or not verified (another CA pinned): go on with that one.
            Err(e) if held.not_after > SystemTime::now() => {
                tracing::warn!(error = %format!("{e:#}"), "enrolling again with the new token failed; going on with the certificate held");
                held
            }
            Err(e) => return Err(e),
        }
    } else {
        held
    };
    let (tx, mut rx) = watch::channel(creds);
    let (connected, told) = watch::channel(String::new());
    let mut renewal = tokio::spawn(renew_forever(IdentityStore::new(&cfg.state_dir), cfg.clone(), tx, told));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut retry = Retry::new(cfg.controller_order(), || Box::new(backoff())).spread_moves(match kind {
        AgentKind::Node => MOVE_SPREAD,
        AgentKind::Gateway => Duration::ZERO,
    });
    loop {
        let target = cfg.controllers[retry.controller()].clone();
        // A node away from its first choice moves back when that answers
        // again (so a replica that returns gets its share back). A gateway
        // stays: its stream's end would fail it over.
        let preferred = match kind {
            AgentKind::Node => retry.preferred_elsewhere().map(|i| cfg.controllers[i].clone()),
            AgentKind::Gateway => None,
        };
        let started = std::time::Instant::now();
        let end = tokio::select! {
            end = session(Session {
                target: &target,
                cfg: &cfg,
                gateway_key: gateway_key.as_ref(),
                creds: &mut rx,
                desired: &mut desired,
                file: &file,
                applier: applier.as_mut(),
                dns: dns.as_mut(),
                connected: &connected,
                preferred: preferred.as_deref(),
            }) => end,
            r = &mut renewal => return match r {
                Ok(Err(e)) => Err(e),
                Ok(Ok(())) => Ok(()),
                Err(e) => Err(anyhow::anyhow!("the renewal task failed: {e}")),
            },
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
        };
        let lost = matches!(end, End::Lost(_));
        let was_up = started.elapsed() > Duration::from_secs(10);
        match end {
            End::Preferred => {
                tracing::info!(
                    from = %target,
                    to = %preferred.as_deref().unwrap_or_default(),
                    "this agent's first-choice controller answers again; moving back to it"
                );
                retry.back_to_preferred();
            }
            End::Removed(e) => {
                // Removed by the admin: leave the host as it was before weft.
                teardown(&mut desired, &file, applier.as_mut()).await;
                anyhow::bail!("the admin removed this agent; weft's objects are removed from the host: {e:#}")
            }
            End::Refused(e) => {
                // Not a removal: whoever caused it (a revoked certificate,
                // a thief's renewal), the host keeps forwarding what it
                // has; the agent keeps asking, slowly, for the admin to
                // enroll it again.
                tracing::error!(
                    controller = %target,
                    error = %format!("{e:#}"),
                    retry_in = ?REFUSED_RETRY,
                    "the controller refused this agent; the host keeps forwarding what it has. \
                     Enroll it again with a new token (or remove weft's objects with --teardown)"
                );
                retry.refused();
                tokio::select! {
                    _ = tokio::time::sleep(REFUSED_RETRY) => {}
                    _ = tokio::signal::ctrl_c() => break,
                    _ = term.recv() => break,
                }
            }
            End::Transient(e) | End::Lost(e) => {
                let delay = retry.disconnected(was_up, lost);
                tracing::warn!(controller = %target, error = %format!("{e:#}"), retry_in = ?delay, "disconnected; keeping the last state");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = tokio::signal::ctrl_c() => break,
                    _ = term.recv() => break,
                }
            }
        }
    }
    renewal.abort();
    tracing::info!("stopping; the host keeps the applied state");
    Ok(())
}

/// The common `main` of both agents.
pub fn main_with(
    cfg: Result<AgentConfig, crate::config::AgentConfigError>,
    kind: AgentKind,
    subnet: Option<String>,
) -> std::process::ExitCode {
    use std::process::ExitCode;
    let prog = format!("weft-{}-agent", kind.as_str());
    let cfg = match cfg {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{prog}: {e}");
            return ExitCode::from(2);
        }
    };
    weft_common::obs::init_logging(cfg.log_format);
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{prog}: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Every line carries the agent's name and role.
    let span = tracing::info_span!("agent", agent = %cfg.name, role = kind.as_str());
    match rt.block_on(tracing::Instrument::instrument(run(cfg, kind, subnet), span)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{prog}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counting() -> Box<dyn Iterator<Item = Duration> + Send> {
        Box::new((1..).map(Duration::from_secs))
    }

    #[test]
    fn each_replica_is_tried_at_once_then_the_round_backs_off() {
        let mut r = Retry::new(vec![0, 1, 2], counting);
        let mut seen = vec![];
        for _ in 0..6 {
            let at = r.controller();
            seen.push((at, r.disconnected(false, false)));
        }
        let ms = Duration::from_millis;
        assert_eq!(
            seen,
            [
                (0, ms(100)),
                (1, ms(100)),
                (2, Duration::from_secs(1)),
                (0, ms(100)),
                (1, ms(100)),
                (2, Duration::from_secs(2))
            ]
        );
    }

    #[test]
    fn a_lost_controller_is_retried_within_a_second_and_a_good_session_resets_the_back_off() {
        let mut r = Retry::new(vec![0], counting);
        assert_eq!(r.disconnected(false, false), Duration::from_secs(1));
        assert_eq!(r.disconnected(false, false), Duration::from_secs(2));
        // Nobody answered: no back-off, a second.
        assert_eq!(r.disconnected(false, true), RETRY_LOST);
        // A session that was up starts the back-off over.
        assert_eq!(r.disconnected(true, false), Duration::from_secs(1));
    }

    #[test]
    fn a_refusal_moves_to_the_next_controller() {
        let mut r = Retry::new(vec![0, 1], counting);
        r.refused();
        assert_eq!(r.controller(), 1);
        r.refused();
        assert_eq!(r.controller(), 0);
        // One controller: always it.
        let mut one = Retry::new(vec![0], counting);
        one.refused();
        assert_eq!(one.controller(), 0);
    }

    /// An agent starts at its first choice, moves down its own order, knows
    /// its first choice while away from it, and goes back to it at once.
    #[test]
    fn an_agent_follows_its_own_order_and_moves_back_to_its_first_choice() {
        let mut r = Retry::new(vec![2, 0, 1], counting).spread_moves(MOVE_SPREAD);
        assert_eq!((r.controller(), r.preferred_elsewhere()), (2, None));
        // Its replica went after a good session: the next one soon, at a
        // moment spread over two seconds.
        let d = r.disconnected(true, true);
        assert!(
            d >= Duration::from_millis(100) && d < Duration::from_millis(2100),
            "{d:?}"
        );
        assert_eq!((r.controller(), r.preferred_elsewhere()), (0, Some(2)));
        r.disconnected(false, true);
        assert_eq!(r.controller(), 1);
        r.back_to_preferred();
        assert_eq!((r.controller(), r.preferred_elsewhere()), (2, None));
        // A gateway moves at once: silent for its TTL, it would be failed over.
        let mut g = Retry::new(vec![1, 0], counting);
        assert_eq!(g.disconnected(true, true), Duration::from_millis(100));
    }
}
