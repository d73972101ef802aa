//! An agent's reports: one at a time as calls, or as messages on its
//! report stream; kept bounded and handed to the hub.

use tonic::{Request, Response, Status};
use weft_proto::v1 as pb;

use super::AgentApi;
use crate::auth::Identity;
use crate::domain::AgentRole;

/// The most object errors, host facts or route conflicts a report keeps.
const MAX_REPORTED: usize = 100;
/// The most tunnels a gateway's report keeps (one per peering).
const MAX_REPORTED_TUNNELS: usize = 1024;

/// `text` cut to 512 bytes (on a character boundary), marked when cut.
fn clip(text: &str) -> String {
    const MAX: usize = 512;
    if text.len() <= MAX {
        return text.to_string();
    }
    let mut end = MAX;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &text[..end], text.len())
}

impl AgentApi {
    /// One report of agent `id` (a call, or a message of its report
    /// stream): kept bounded, recorded, answered with the heartbeat period.
    pub(super) async fn take_report(
        &self,
        role: AgentRole,
        id: &Identity,
        mut r: pb::ReportRequest,
    ) -> Result<pb::ReportResponse, Status> {
        // Reports are kept and shown: bounded in count and length, whatever
        // an agent (or a stolen agent certificate) sends.
        let errors: Vec<String> = r
            .errors
            .iter()
            .take(MAX_REPORTED)
            .map(|e| clip(&format!("{}: {}", e.id, e.message)))
            .collect();
        if let Some(h) = r.host.as_mut() {
            h.features.truncate(MAX_REPORTED);
            h.route_conflicts.truncate(MAX_REPORTED);
            for t in h.features.iter_mut().chain(h.route_conflicts.iter_mut()) {
                *t = clip(t);
            }
            if !matches!(h.wireguard.as_str(), "" | "kernel" | "userspace") {
                h.wireguard = "unknown".into();
            }
            h.wireguard_reason = clip(&h.wireguard_reason);
            if !weft_types::version::plausible(&h.version) {
                h.version = "unknown".into();
            }
        }
        if role == AgentRole::Gateway {
            let tunnels: Vec<pb::TunnelStatus> = r
                .tunnels
                .into_iter()
                .take(MAX_REPORTED_TUNNELS)
                .map(|mut t| {
                    t.peer_site = clip(&t.peer_site);
                    t.link = clip(&t.link);
                    t.path.clear();
                    t.offloads.truncate(MAX_REPORTED);
                    t.transit.truncate(MAX_REPORTED);
                    for c in &mut t.transit {
                        c.site = clip(&c.site);
                    }
                    t
                })
                .collect();
            self.record_discovery(&id.name, &tunnels);
            self.hub.report_tunnels(&id.name, tunnels);
        }
        self.hub
            .report((role, id.name.clone()), r.applied_revision, errors, r.host)
            .await?;
        Ok(pb::ReportResponse {
            heartbeat_seconds: (self.hub.ttl(role).as_secs() / 3).max(1) as u32,
            heartbeat_millis: (self.hub.ttl(role).as_millis() / 3).max(50) as u32,
        })
    }

    /// `ReportStream`: reports read one by one until the agent closes the
    /// stream, its certificate expires or is revoked, or the controller
    /// shuts down; answered only when the heartbeat period is new.
    pub(super) async fn open_report_stream(
        &self,
        req: Request<tonic::Streaming<pb::ReportRequest>>,
    ) -> Result<Response<tokio_stream::wrappers::ReceiverStream<Result<pb::ReportResponse, Status>>>, Status> {
        let (role, id) = self.agent(&req).await?;
        let expires = req
            .peer_certs()
            .and_then(|c| c.first().and_then(|c| crate::pki::not_after(c.as_ref())))
            .unwrap_or_else(std::time::SystemTime::now);
        let mut inbound = req.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let api = self.clone();
        tokio::spawn(async move {
            let expiry = tokio::time::sleep(expires.duration_since(std::time::SystemTime::now()).unwrap_or_default());
            tokio::pin!(expiry);
            let mut closing = api.hub.closing.subscribe();
            let mut told = None;
            loop {
                let r = tokio::select! {
                    m = inbound.message() => match m {
                        Ok(Some(r)) => r,
                        // The agent closed it, or went away.
                        Ok(None) | Err(_) => break,
                    },
                    _ = &mut expiry => {
                        let _ = tx
                            .send(Err(Status::unavailable(
                                "the certificate this report stream was opened with has expired; reopen it with \
                                 the current one",
                            )))
                            .await;
                        break;
                    }
                    _ = async { let _ = closing.wait_for(|c| *c).await; } => {
                        let _ = tx
                            .send(Err(Status::unavailable(
                                "the controller is shutting down; connect to another replica or retry",
                            )))
                            .await;
                        break;
                    }
                    _ = tx.closed() => break,
                };
                // Revoked since the stream opened (removed, or a second
                // holder of its identity): refused as a call would be.
                let answer = match api.auth.check_revocation(&id) {
                    // Boxed: this task lives as long as the stream, sized for
                    // its largest await; a report's store write is that.
                    Ok(()) => Box::pin(api.take_report(role, &id, r)).await,
                    Err(s) => Err(s),
                };
                match answer {
                    Ok(a) if told.as_ref() == Some(&a) => {}
                    Ok(a) => {
                        told = Some(a);
                        if tx.send(Ok(a)).await.is_err() {
                            break;
                        }
                    }
                    Err(s) => {
                        let _ = tx.send(Err(s)).await;
                        break;
                    }
                }
            }
        });
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }
}
