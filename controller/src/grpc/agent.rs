//! `weft.v1.AgentService`: enrollment, renewal and the agent's own
//! assignment. An agent acts only as itself.

use std::sync::Arc;
use std::time::Duration;

use tonic::{Request, Response, Status};
use weft_proto::v1 as pb;
use weft_proto::v1::agent_service_server::AgentService;

use super::convert;
use crate::auth::{Authenticator, Caller, Identity, Role, caller_of, removed};
use crate::config::parse_cidr;
use crate::domain::AgentRole;
use crate::error::Error;
use crate::hub::Hub;
use crate::pki::{Issued, PkiError, SiteCa, identity_uri};
use crate::render::Model;
use crate::state::State;

mod discovery;
mod report;
mod watch;

/// Largest CSR accepted (a P-256 or Ed25519 CSR is well under 1 KiB).
const MAX_CSR: usize = 16 * 1024;

/// Messages a stream may have queued toward a slow agent before its task
/// waits (and further changes coalesce into the next delta).
const WATCH_BUFFER: usize = 2;
/// Most object versions a resuming agent may send.
const MAX_KNOWN: usize = 1_000_000;

#[derive(Clone)]
pub struct AgentApi {
    state: State,
    ca: Arc<SiteCa>,
    site_id: String,
    cert_ttl: Duration,
    hub: Arc<Hub>,
    /// Asked again for every report read from a long-lived report stream
    /// (its certificate may be revoked meanwhile).
    auth: Arc<Authenticator>,
    /// Gateways whose endpoint discovery is being written (one write at a
    /// time per gateway, off the heartbeat's path).
    recording: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
}

impl AgentApi {
    /// The agent behind a call ([`agent`]), its certificate marked as used
    /// the first time it is (a renewal from an older certificate after
    /// that is a second holder's, not a retry).
    async fn agent<T>(&self, req: &Request<T>) -> Result<(AgentRole, Identity), Status> {
        let (role, id) = agent(req)?;
        let model = self.hub.model();
        let certs = match role {
            AgentRole::Node => model.nodes.get(&id.name).map(|n| &n.certs),
            AgentRole::Gateway => model.gateways.get(&id.name).map(|g| &g.certs),
        };
        // The enrollment's certificate is recorded as used; a renewed one
        // is marked at its first call (the store decides when the hub's
        // model has not caught up with the renewal yet).
        let unmarked = certs.is_some_and(|c| c.iter().all(|c| c.serial != id.serial || !c.used));
        if unmarked && let Err(e) = self.state.mark_cert_used(role, &id.name, &id.serial).await {
            tracing::warn!(agent = %id, error = %e, "cannot mark the certificate as used");
        }
        Ok((role, id))
    }

    pub fn new(
        state: State,
        ca: Arc<SiteCa>,
        site_id: String,
        cert_ttl: Duration,
        hub: Arc<Hub>,
        auth: Arc<Authenticator>,
    ) -> Self {
        Self {
            state,
            ca,
            site_id,
            cert_ttl,
            hub,
            auth,
            recording: Default::default(),
        }
    }

    fn sign(&self, csr: &str, role: AgentRole, name: &str) -> Result<Issued, Error> {
        let uri = identity_uri(&self.site_id, role.as_str(), name);
        self.ca
            .sign_agent_csr(csr, &uri, &format!("weft {} {name}", role.as_str()), self.cert_ttl)
            .map_err(|e| match e {
                PkiError::InvalidCsr(m) => Error::InvalidArgument(format!("csr_pem: {m}")),
                PkiError::Issue(m) => Error::FailedPrecondition(m),
            })
    }
}

fn check_csr(csr: &str) -> Result<(), Status> {
    if csr.trim().is_empty() {
        return Err(Status::invalid_argument(
            "csr_pem is empty; send a PEM certificate signing request",
        ));
    }
    if csr.len() > MAX_CSR {
        return Err(Status::invalid_argument(format!(
            "csr_pem is larger than {MAX_CSR} bytes"
        )));
    }
    Ok(())
}

/// The agent identity behind a call, or the status that refuses it.
fn agent<T>(req: &Request<T>) -> Result<(AgentRole, Identity), Status> {
    match caller_of(req) {
        Some(Caller::Remote(id)) => match id.role {
            Role::Node => Ok((AgentRole::Node, id.clone())),
            Role::Gateway => Ok((AgentRole::Gateway, id.clone())),
            _ => Err(Status::permission_denied(format!(
                "{id} is not an agent; only node and gateway agents call this"
            ))),
        },
        Some(Caller::Local) => Err(Status::permission_denied(
            "agent calls come over mutual TLS with the agent's certificate, not over the admin socket",
        )),
        None => Err(Status::unauthenticated(
            "this call needs the agent's certificate (enroll first with a token)",
        )),
    }
}

#[tonic::async_trait]
impl AgentService for AgentApi {
    async fn register(&self, req: Request<pb::RegisterRequest>) -> Result<Response<pb::RegisterResponse>, Status> {
        let peer_ip = req.remote_addr().map(|a| a.ip());
        let req = req.into_inner();
        let underlay = match req.underlay_ip.trim() {
            "" => peer_ip,
            s => Some(
                s.parse()
                    .map_err(|_| Status::invalid_argument(format!("underlay_ip {s:?} is not an IP address")))?,
            ),
        };
        check_csr(&req.csr_pem)?;
        let subnet = match req.subnet.trim() {
            "" => None,
            s => Some(parse_cidr(s).map_err(|m| Status::invalid_argument(format!("subnet: {m}")))?),
        };
        let e = self
            .state
            .register(&req.token, &req.name, subnet, underlay, |role, name| {
                self.sign(&req.csr_pem, role, name)
            })
            .await?;
        Ok(Response::new(pb::RegisterResponse {
            certificate_pem: e.issued.cert_pem,
            ca_pem: self.ca.pem.clone(),
            site_id: self.site_id.clone(),
            role: convert::agent_role(e.role) as i32,
            name: e.name,
            expires_at: convert::ts(e.issued.not_after_ms),
        }))
    }

    async fn renew(&self, req: Request<pb::RenewRequest>) -> Result<Response<pb::RenewResponse>, Status> {
        let (role, id) = agent(&req)?;
        let csr = req.into_inner().csr_pem;
        check_csr(&csr)?;
        let issued = self
            .state
            .renew(role, &id.name, &id.serial, || self.sign(&csr, role, &id.name))
            .await?;
        Ok(Response::new(pb::RenewResponse {
            certificate_pem: issued.cert_pem,
            expires_at: convert::ts(issued.not_after_ms),
            ca_pem: self.ca.pem.clone(),
        }))
    }

    type WatchStream = watch::Stream;

    async fn watch(&self, req: Request<pb::WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        let (role, id) = self.agent(&req).await?;
        // The stream ends when the certificate it was opened with does; the
        // agent (which renews at two thirds of its life) reconnects with
        // its current one and resumes from its revision.
        let expires = req
            .peer_certs()
            .and_then(|c| c.first().and_then(|c| crate::pki::not_after(c.as_ref())))
            .unwrap_or_else(std::time::SystemTime::now);
        let req = req.into_inner();
        if req.known.len() > MAX_KNOWN {
            return Err(Status::invalid_argument(format!(
                "known lists more than {MAX_KNOWN} objects"
            )));
        }
        if *self.hub.closing.borrow() {
            return Err(Status::unavailable(
                "the controller is shutting down; connect to another replica or retry",
            ));
        }
        // What the host's kernel can do decides its overlay encapsulation;
        // a change re-renders its tunnels (and its peers' ends of them).
        // (Read from the store only when the hub's copy differs: every
        // agent reconnecting after a restart must not cost a store read.)
        // And whether a gateway's agent enforces export policies.
        let geneve = req.features.iter().any(|f| f == "geneve");
        let has = |f: &str| role == AgentRole::Gateway && req.features.iter().any(|x| x == f);
        let export = (
            has(weft_proto::EXPORT_POLICY_FEATURE),
            has(weft_proto::EXPORT_POLICY_V6_FEATURE),
            has(weft_proto::PUNCH_BESIDE_FEATURE),
        );
        let model = self.hub.model();
        let recorded = match role {
            AgentRole::Node => model.nodes.get(&id.name).map(|n| (n.geneve, (false, false, false))),
            AgentRole::Gateway => model
                .gateways
                .get(&id.name)
                .map(|g| (g.geneve, (g.enforces_export, g.enforces_export_v6, g.punches_beside))),
        };
        if recorded != Some((geneve, export)) {
            self.state.set_features(role, &id.name, geneve, export).await?;
        }
        let key = (role, id.name.clone());
        // Subscribe before rendering: a change in between is then pending,
        // not lost.
        let slot = self.hub.subscribe(key.clone());
        let in_model = |m: &Model| match role {
            AgentRole::Node => m.nodes.contains_key(&id.name),
            AgentRole::Gateway => m.gateways.contains_key(&id.name),
        };
        let mut model = self.hub.model();
        if !in_model(&model) {
            // Just enrolled: the hub may not have seen the record yet. Ask the
            // store, and give the hub a moment to catch up.
            let target = match self.state.store().revision().await {
                Ok(r) => r,
                Err(e) => {
                    self.hub.unsubscribe(&key, &slot);
                    return Err(crate::error::Error::from(e).into());
                }
            };
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while !in_model(&model) && model.revision < target && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
                model = self.hub.model();
            }
        }
        if !in_model(&model) {
            self.hub.unsubscribe(&key, &slot);
            // Only the store's word removes an agent: a hub that is behind
            // (or could not read the record) or a store that does not
            // answer is no verdict on it.
            let in_store = match role {
                AgentRole::Node => self.state.get_node(&id.name).await.map(|_| ()),
                AgentRole::Gateway => self.state.get_gateway(&id.name).await.map(|_| ()),
            };
            match in_store {
                Err(Error::NotFound(_)) => {}
                Ok(()) => {
                    return Err(Status::unavailable(
                        "the controller is catching up with its store; retry",
                    ));
                }
                Err(e) => {
                    return Err(Status::unavailable(format!(
                        "the controller cannot read this agent's record ({e}); retry"
                    )));
                }
            }
            return Err(removed(format!(
                "{id} has been removed; enroll it again with a new token"
            )));
        }
        let held = watch::Held::render(&self.hub, &model, role, &id.name);
        let first = watch::first_message(&held, model.revision, req.last_revision, &req.known);
        slot.latest.store(model.revision, std::sync::atomic::Ordering::SeqCst);
        let (tx, body) = watch::stream();
        let _ = tx.send(Box::new(Ok(first))).await;
        self.hub.sent(&key, model.revision);
        tracing::info!(agent = %id, revision = model.revision, objects = held.len(), "watch started");
        tokio::spawn(watch::stream_changes(self.hub.clone(), key, slot, held, tx, expires));
        Ok(Response::new(body))
    }

    async fn report(&self, req: Request<pb::ReportRequest>) -> Result<Response<pb::ReportResponse>, Status> {
        let (role, id) = self.agent(&req).await?;
        Ok(Response::new(self.take_report(role, &id, req.into_inner()).await?))
    }

    type ReportStreamStream = tokio_stream::wrappers::ReceiverStream<Result<pb::ReportResponse, Status>>;

    async fn report_stream(
        &self,
        req: Request<tonic::Streaming<pb::ReportRequest>>,
    ) -> Result<Response<Self::ReportStreamStream>, Status> {
        self.open_report_stream(req).await
    }

    async fn get_trust(&self, req: Request<pb::GetTrustRequest>) -> Result<Response<pb::Trust>, Status> {
        agent(&req)?;
        // Renew when a CA this controller is rotating away from signed it
        // (not when it only does not know the caller's CA: a replica not
        // yet restarted, which knows only the old CA, answers too).
        let renew = req
            .peer_certs()
            .and_then(|c| c.first().map(|leaf| self.ca.signed_by_older(leaf.as_ref())))
            .unwrap_or(false);
        // Spread a site's renewals after a rotation: 10 ms per agent, at
        // least 2 s and at most 5 minutes.
        let model = self.hub.model();
        let agents = (model.nodes.len() + model.gateways.len()) as u64;
        let within = Duration::from_millis((agents * 10).clamp(2_000, 300_000));
        Ok(Response::new(pb::Trust {
            ca_pem: self.ca.pem.clone(),
            renew,
            renew_within: Some(prost_types::Duration {
                seconds: within.as_secs() as i64,
                nanos: within.subsec_nanos() as i32,
            }),
        }))
    }

    async fn update_gateway(
        &self,
        req: Request<pb::UpdateGatewayRequest>,
    ) -> Result<Response<pb::UpdateGatewayResponse>, Status> {
        let (role, id) = self.agent(&req).await?;
        if role != AgentRole::Gateway {
            return Err(Status::permission_denied(format!("{id} is not a gateway")));
        }
        let r = req.into_inner();
        let key = match r.public_key.trim() {
            "" => None,
            k => Some(weft_types::WgKey::parse("public_key", k).map_err(Status::invalid_argument)?),
        };
        let endpoint = match r.endpoint.trim() {
            "" => None,
            e => {
                let a = weft_types::net::endpoint(e).map_err(|m| Status::invalid_argument(format!("endpoint {m}")))?;
                let (site, _) = self.state.site().await?;
                let last = site.wireguard_ports.count() - 1;
                if u32::from(a.port()) + last > 65535 {
                    return Err(Status::invalid_argument(format!(
                        "endpoint {a}: peerings are reached at the {} ports from {} up, which pass 65535; \
                         give a port of at most {}",
                        site.wireguard_ports.count(),
                        a.port(),
                        65535 - last
                    )));
                }
                Some(a)
            }
        };
        self.state.update_gateway(&id.name, key, endpoint).await?;
        Ok(Response::new(pb::UpdateGatewayResponse {}))
    }

    async fn get_assignment(&self, req: Request<pb::GetAssignmentRequest>) -> Result<Response<pb::Assignment>, Status> {
        let (role, id) = self.agent(&req).await?;
        // Empty: the caller's own.
        let name = Some(req.into_inner().name)
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| id.name.clone());
        if name != id.name {
            return Err(Status::permission_denied(format!(
                "{id} may read only its own assignment, not {name:?}'s"
            )));
        }
        let (site, _) = self.state.site().await?;
        let (subnet, subnet_v6) = match role {
            AgentRole::Node => {
                let n = self.state.get_node(&name).await?;
                (
                    n.subnet.map(|s| s.to_string()).unwrap_or_default(),
                    n.subnet_v6.map(|s| s.to_string()).unwrap_or_default(),
                )
            }
            AgentRole::Gateway => Default::default(),
        };
        Ok(Response::new(pb::Assignment {
            site_id: site.id.clone(),
            role: convert::agent_role(role) as i32,
            name,
            subnet,
            pod_cidrs: site.pod_cidrs.iter().map(|c| c.to_string()).collect(),
            internal_cidr: site.internal_cidr.to_string(),
            subnet_v6,
        }))
    }
}
