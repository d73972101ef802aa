//! On the leading replica: a session per peer, following its parameters.

use super::*;

/// Keeps one subscription per peering: takes in the peer's parameter
/// changes, removes the peering when the peer says it has none, or when the
/// peer stays unreachable past the grace period. Only while this replica
/// leads (see leader.rs): one set of sessions per site.
pub async fn sync_peers(fed: Arc<Federation>, leader: tokio::sync::watch::Receiver<bool>) {
    let mut tasks: std::collections::HashMap<String, tokio::task::JoinHandle<()>> = std::collections::HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tick.tick().await;
        let leading = *leader.borrow();
        let model = fed.hub.model();
        tasks.retain(|site, t| {
            let keep = leading && model.peerings.get(site).is_some_and(|p| p.remote.is_some()) && !t.is_finished();
            if !keep {
                t.abort();
            }
            keep
        });
        for (site, p) in model.peerings.iter() {
            if leading && p.remote.is_some() && !tasks.contains_key(site) {
                tasks.insert(site.clone(), tokio::spawn(follow_peer(fed.clone(), site.clone())));
            }
        }
    }
}

/// Takes in a peer's parameters from its Subscribe stream until it ends:
/// each one checked whole, unchanged ones dropped, and past a burst at most
/// one per `PEER_UPDATE_EVERY`, the newest.
async fn take_in(
    fed: &Federation,
    site: &str,
    ca_pem: &str,
    own: &pb::NetworkParams,
    mut stream: tonic::Streaming<pb::NetworkParams>,
) {
    use futures::StreamExt;
    // Each update costs a store write and a render for every
    // agent: one identical to the last taken in is dropped
    // before any of that, and past a burst only one per
    // PEER_UPDATE_EVERY is taken in, the newest of those that
    // came meanwhile.
    let limiter = governor::RateLimiter::direct(
        governor::Quota::with_period(PEER_UPDATE_EVERY)
            .expect("a nonzero period")
            .allow_burst(PEER_UPDATE_BURST),
    );
    let mut last: Option<pb::NetworkParams> = None;
    let mut ended = false;
    while !ended {
        let Some(Ok(mut params)) = stream.next().await else {
            break;
        };
        let got = std::time::Instant::now();
        if last.as_ref() == Some(&params) {
            continue;
        }
        if limiter.check().is_err() {
            let mut folded = 0u64;
            let ready = limiter.until_ready();
            tokio::pin!(ready);
            loop {
                tokio::select! {
                    _ = &mut ready => break,
                    next = stream.next() => match next {
                        Some(Ok(newer)) => {
                            params = newer;
                            folded += 1;
                        }
                        _ => {
                            ended = true;
                            break;
                        }
                    },
                }
            }
            tracing::debug!(peer = %site, folded, "the peer sends updates faster than this site takes them in; took in the newest");
            if last.as_ref() == Some(&params) {
                continue;
            }
        }
        if params.site_id != site {
            tracing::warn!(peer = %site, "the peer sent parameters for another site; ignored");
            last = Some(params);
            continue;
        }
        // The CAs the peer now trusts for itself (a rotation of its CA):
        // sent over this stream, which the CAs taken so far verified.
        let trusted = match weft_common::tls::checked_cas(&params.ca_pem) {
            Ok(Some(cas)) => cas,
            Ok(None) => ca_pem.to_string(),
            Err(e) => {
                tracing::warn!(peer = %site, error = %e, "the peer sent invalid CA certificates; ignored");
                ca_pem.to_string()
            }
        };
        match fed.remote(&trusted, &params, own) {
            Ok(r) => {
                if let Some(ready) = r.readiness.as_ref().filter(|r| r.routes_applied) {
                    fed.hub.peer_moved(site, &ready.active_gateway);
                }
                match fed.state.update_remote(site, r).await {
                    Ok(changed) => {
                        if changed {
                            tracing::info!(
                                peer = %site,
                                ms = got.elapsed().as_millis() as u64,
                                "the peer's parameters changed"
                            );
                        }
                        last = Some(params);
                    }
                    // Not recorded (the store): taken in again if sent again.
                    Err(e) => {
                        tracing::warn!(peer = %site, error = %e, "cannot take in the peer's parameters")
                    }
                }
            }
            Err(e) => {
                tracing::warn!(peer = %site, error = %e, "the peer sent invalid parameters");
                last = Some(params);
            }
        }
    }
}

pub(super) async fn follow_peer(fed: Arc<Federation>, site: String) {
    let mut down_since: Option<std::time::Instant> = None;
    let mut delays = weft_common::backoff();
    loop {
        let Ok(Some(p)) = fed.state.peering(&site).await else {
            return;
        };
        let Some(remote) = p.remote.clone() else { return };
        let mut reached = false;
        let mut young_not_found = false;
        for ep in &remote.endpoints {
            let Ok(mut c) = fed.client(ep, Trust::CaPem(remote.ca_pem.clone())).await else {
                continue;
            };
            match c.subscribe(pb::SubscribeRequest {}).await {
                Ok(stream) => {
                    reached = true;
                    down_since = None;
                    delays = weft_common::backoff();
                    // The peer holds its side: the token is spent for good.
                    if p.joined_with.is_some() {
                        match fed.state.peering_confirmed(&site).await {
                            Ok(()) => {
                                tracing::info!(peer = %site, "the peer holds its side of the peering; its token is spent")
                            }
                            Err(e) => {
                                tracing::warn!(peer = %site, error = %e, "cannot record that the peer holds the peering")
                            }
                        }
                    }
                    let stream = stream.into_inner();
                    let own = match fed.params_for(&site).await {
                        Ok((o, _)) => o,
                        Err(_) => break,
                    };
                    take_in(&fed, &site, &remote.ca_pem, &own, stream).await;
                    break;
                }
                // Right after negotiation (or a Join again) the peer may not
                // have recorded its side yet: only a NotFound on an older
                // peering counts (checked again as the peering is removed:
                // a Join may have come meanwhile). One the peer never held
                // gives its token back: the peer gave up on its Join and
                // may retry.
                Err(s)
                    if s.code() == tonic::Code::NotFound
                        && now_ms().saturating_sub(p.created_at_ms.max(p.joined_at_ms))
                            > crate::state::federation::RECORD_WINDOW_MS =>
                {
                    match fed.state.drop_unheld_peering(&site).await {
                        Ok(Some(gone)) if gone.joined_with.is_some() => {
                            tracing::info!(peer = %site, "the peer never recorded the peering; removed it here and \
                                gave its token back for a retry");
                            return;
                        }
                        Ok(Some(_)) => {
                            tracing::info!(peer = %site, "the peer deleted the peering; removed it here");
                            return;
                        }
                        Ok(None) => young_not_found = true,
                        Err(e) => {
                            tracing::warn!(peer = %site, error = %e, "cannot remove the peering the peer does not hold")
                        }
                    }
                }
                // Too young to trust: ask again soon rather than backing off,
                // so a deletion made while this site was away lands promptly.
                Err(s) if s.code() == tonic::Code::NotFound => young_not_found = true,
                Err(s) => tracing::debug!(peer = %site, error = %s, "subscription refused"),
            }
        }
        if !reached {
            let since = *down_since.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() >= fed.grace
                && let Ok(Some(_)) = fed.state.drop_unheld_peering(&site).await
            {
                tracing::warn!(peer = %site, grace = ?fed.grace, "the peer stayed unreachable past the grace period; removed the peering here");
                return;
            }
        }
        let delay = if young_not_found {
            Duration::from_secs(1)
        } else {
            delays
                .next()
                .unwrap_or(Duration::from_secs(30))
                .min(Duration::from_secs(30))
        };
        tokio::time::sleep(delay).await;
    }
}
