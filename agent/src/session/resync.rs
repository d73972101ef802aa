//! Drift repair: the whole held state applied again at the resync timer,
//! giving way to a change that comes meanwhile.

use std::time::Duration;

use weft_proto::v1 as pb;

use super::observe_reconcile;
use crate::apply::{Applier, Scope};
use crate::desired::Desired;

/// How soon a resync that yielded to a change runs again (whole).
const RESYNC_AFTER_YIELD: Duration = Duration::from_secs(1);

/// Applies everything held again (level-triggered: a no-op unless something
/// drifted); counts and logs what had to be put back.
pub(super) async fn resync(desired: &Desired, applier: &mut dyn Applier) -> Vec<pb::ObjectError> {
    let before = applier.writes();
    let started = std::time::Instant::now();
    let errors = applier
        .apply(&desired.objects, &desired.objects, Scope::Everything)
        .await;
    observe_reconcile("resync", started, &errors);
    let repaired = applier.writes().saturating_sub(before);
    tracing::debug!(
        revision = desired.revision,
        ms = started.elapsed().as_millis() as u64,
        repaired,
        "resync done"
    );
    if repaired > 0 {
        crate::metrics::get().drift_repairs.inc_by(repaired);
        tracing::warn!(
            repaired,
            revision = desired.revision,
            "host objects were missing and are back (drift repaired)"
        );
    }
    errors
}

pub(super) fn resync_timer(every: Duration) -> tokio::time::Interval {
    let period = if every.is_zero() {
        Duration::from_secs(100 * 365 * 86_400)
    } else {
        every
    };
    let mut t = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    t
}

/// A resync at its timer. A change that comes meanwhile stops it and goes
/// first (a failover's change must not wait seconds for a resync, which is
/// level-triggered and comes again): that change is returned, and the
/// next resync, a second later, runs whole.
pub(super) async fn resync_unless_changed(
    desired: &Desired,
    applier: &mut dyn Applier,
    stream: &mut tonic::Streaming<pb::WatchResponse>,
    timer: &mut tokio::time::Interval,
    yielded: &mut bool,
    errors: &mut Vec<pb::ObjectError>,
) -> Option<Result<Option<pb::WatchResponse>, tonic::Status>> {
    if *yielded {
        *yielded = false;
        *errors = resync(desired, applier).await;
        return None;
    }
    let whole = resync(desired, applier);
    tokio::pin!(whole);
    tokio::select! {
        e = &mut whole => {
            *errors = e;
            None
        }
        msg = stream.message() => {
            tracing::debug!("a change came during a resync: the resync stopped, the change goes first");
            *yielded = true;
            timer.reset_after(RESYNC_AFTER_YIELD);
            Some(msg)
        }
    }
}
