//! The store follower: follows the store under the site's root and feeds
//! each event to the hub ([`Hub::apply`]); on any break (compaction, a
//! store outage) it reloads the model and resumes.

use std::time::Duration;

use futures::StreamExt;

use super::Hub;

/// Follows the store under the site's root and feeds the hub; on any break
/// (compaction, store outage) reloads and resumes.
pub(super) async fn follow(hub: std::sync::Weak<Hub>, mut gone: tokio::sync::oneshot::Receiver<()>) {
    let mut from = match hub.upgrade() {
        Some(h) => h.model().revision + 1,
        None => return,
    };
    loop {
        let Some(h) = hub.upgrade() else { return };
        let root = h.state.root().to_string();
        let store = h.state.store().clone();
        drop(h);
        match store.watch_prefix(&root, from).await {
            Ok(mut w) => loop {
                let batch = tokio::select! {
                    b = w.next() => match b {
                        Some(b) => b,
                        None => break,
                    },
                    _ = &mut gone => return,
                };
                let Some(h) = hub.upgrade() else { return };
                match batch {
                    Ok(b) => {
                        for ev in &b.events {
                            h.apply(&ev.kv.key, ev.kind, &ev.kv.value, b.revision);
                        }
                        h.seen_up_to(b.revision);
                        from = b.revision + 1;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "desired-state watch broke; reloading");
                        break;
                    }
                }
            },
            Err(e) => tracing::warn!(error = %e, "cannot watch the store; retrying"),
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = &mut gone => return,
        }
        let Some(h) = hub.upgrade() else { return };
        match h.reload().await {
            Ok(rev) => from = rev + 1,
            Err(e) => tracing::warn!(error = %e, "cannot reload the site model"),
        }
    }
}
