//! `weft.v1.AgentService`: enrollment, renewal and the agent's own
//! assignment. An agent acts only as itself.

use std::sync::Arc;
use std::time::Duration;

use tonic::{Request, Response, Status};
use weft_proto::v1 as pb;
use weft_proto::v1::agent_service_server::AgentService;

use super::convert;
use crate::auth::{Caller, Identity, Role, caller_of};
use crate::config::parse_cidr;
use crate::domain::AgentRole;
use crate::error::Error;
use crate::pki::{Issued, PkiError, SiteCa, identity_uri};
use crate::state::State;

/// Largest CSR accepted (a P-256 or Ed25519 CSR is well under 1 KiB).
const MAX_CSR: usize = 16 * 1024;

#[derive(Clone)]
pub struct AgentApi {
    state: State,
    ca: Arc<SiteCa>,
    site_id: String,
    cert_ttl: Duration,
}

impl AgentApi {
    pub fn new(state: State, ca: Arc<SiteCa>, site_id: String, cert_ttl: Duration) -> Self {
        Self {
            state,
            ca,
            site_id,
            cert_ttl,
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
        let req = req.into_inner();
        check_csr(&req.csr_pem)?;
        let subnet = match req.subnet.trim() {
            "" => None,
            s => Some(parse_cidr(s).map_err(|m| Status::invalid_argument(format!("subnet: {m}")))?),
        };
        let e = self
            .state
            .register(&req.token, &req.name, subnet, |role, name| {
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
            .renew(role, &id.name, || self.sign(&csr, role, &id.name))
            .await?;
        Ok(Response::new(pb::RenewResponse {
            certificate_pem: issued.cert_pem,
            expires_at: convert::ts(issued.not_after_ms),
        }))
    }

    async fn get_assignment(&self, req: Request<pb::GetAssignmentRequest>) -> Result<Response<pb::Assignment>, Status> {
        let (role, id) = agent(&req)?;
        let name = req.into_inner().name;
        if name != id.name {
            return Err(Status::permission_denied(format!(
                "{id} may read only its own assignment, not {name:?}'s"
            )));
        }
        let (site, _) = self.state.site().await?;
        let subnet = match role {
            AgentRole::Node => self.state.get_node(&name).await?.subnet.to_string(),
            AgentRole::Gateway => String::new(),
        };
        Ok(Response::new(pb::Assignment {
            site_id: site.id.clone(),
            role: convert::agent_role(role) as i32,
            name,
            subnet,
            pod_cidrs: site.pod_cidrs.iter().map(|c| c.to_string()).collect(),
            internal_cidr: site.internal_cidr.to_string(),
        }))
    }
}
