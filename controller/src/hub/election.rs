//! On the leading replica: which gateway is active.

use std::sync::Arc;
use std::time::Duration;

use super::Hub;
use crate::store::{Op, Txn};

/// On the leading replica: records which gateway is active whenever the
/// recorded one is not live (or none is recorded) and another is. Nodes
/// and peers follow the record; a gateway that comes back stays standby.
pub async fn choose_active_gateway(hub: Arc<Hub>, leader: tokio::sync::watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    hub.election_passes.send_replace(Some(0));
    loop {
        // A liveness change wakes it at once; the tick catches the rest
        // (a gateway record changed, leadership gained).
        tokio::select! {
            _ = tick.tick() => {}
            _ = hub.live_changed.notified() => {}
        }
        let elected = elect_once(&hub, &leader).await;
        hub.election_passes.send_modify(|n| *n = Some(n.unwrap_or(0) + 1));
        if let Some(next) = elected {
            // Wait for the hub to see it before deciding again.
            let seen = tokio::time::Instant::now() + Duration::from_secs(2);
            while hub.model().active_gateway.as_ref() != Some(&next) && tokio::time::Instant::now() < seen {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
}

/// One pass: records the next active gateway when the recorded one is not
/// live (on the leader); the gateway recorded.
async fn elect_once(hub: &Hub, leader: &tokio::sync::watch::Receiver<bool>) -> Option<String> {
    if !*leader.borrow() || *hub.closing.borrow() {
        return None;
    }
    // Without the gateways this replica just ended: their records'
    // deletion need not come back through the store first.
    let m = hub.electing();
    let next = crate::render::next_active_gateway(&m)?;
    let key = hub.state.active_gateway_key();
    let guard = match &m.active_gateway {
        Some(old) => crate::store::Compare::Value(key.clone(), old.clone().into_bytes()),
        None => crate::store::Compare::Version(key.clone(), 0),
    };
    let txn = Txn::new().when(guard).then(Op::put(key, next.clone().into_bytes()));
    match hub.state.store().txn(txn).await {
        Ok(r) if r.succeeded => {
            tracing::info!(gateway = %next, previous = ?m.active_gateway, "gateway active now");
            Some(next)
        }
        Ok(_) => None,
        Err(e) => {
            tracing::warn!(error = %e, "cannot record the active gateway");
            None
        }
    }
}
