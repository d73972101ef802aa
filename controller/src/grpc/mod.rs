//! The weft.v1 gRPC services. Requests are validated and converted here;
//! the work is done by [`crate::state`].

pub mod agent;
pub mod convert;
mod request;
mod trust;

use request::{address_field, cidr_field, either_family};
pub use request::{agent_role, answer_by};

use std::sync::Arc;
use std::time::Duration;

use tonic::{Request, Response, Status};
use weft_proto::v1 as pb;
use weft_proto::v1::admin_service_server::AdminService;

use crate::auth::Authenticator;
use crate::domain::{AgentRole, Peering};
use crate::federation::{Federation, PeeringToken};
use crate::hub::Hub;
use crate::ipam::CidrKind;
use crate::state::State;

/// `weft.v1.AdminService`.
#[derive(Clone)]
pub struct AdminApi {
    state: State,
    ca_fingerprint: String,
    auth: Arc<Authenticator>,
    hub: Arc<Hub>,
    fed: Arc<Federation>,
    /// When the site CA expires (for Diagnose).
    ca_not_after_ms: Option<u64>,
    /// The pki directory and site id (for rotating the admin bundle).
    pki: Option<(std::path::PathBuf, String)>,
    /// The site CAs this controller trusts and those retired.
    cas: crate::ca::Cas,
}

impl AdminApi {
    pub fn with_ca_expiry(mut self, ms: Option<u64>) -> Self {
        self.ca_not_after_ms = ms;
        self
    }

    pub fn with_cas(mut self, cas: crate::ca::Cas) -> Self {
        self.cas = cas;
        self
    }

    pub fn new(
        state: State,
        ca_fingerprint: String,
        auth: Arc<Authenticator>,
        hub: Arc<Hub>,
        fed: Arc<Federation>,
    ) -> Self {
        Self {
            state,
            ca_fingerprint,
            auth,
            hub,
            fed,
            ca_not_after_ms: None,
            pki: None,
            cas: Default::default(),
        }
    }

    pub fn with_pki(mut self, dir: std::path::PathBuf, site: String) -> Self {
        self.pki = Some((dir, site));
        self
    }

    /// The status of each agent, from the liveness records and this replica's streams.
    async fn statuses(&self) -> Result<impl Fn(AgentRole, &str) -> pb::AgentStatus + '_, Status> {
        let alive = self.state.alive().await?;
        Ok(move |role: AgentRole, name: &str| {
            let key = (role, name.to_string());
            let rec = alive.get(&key);
            pb::AgentStatus {
                ready: rec.is_some(),
                latest_revision: self.hub.latest(&key).unwrap_or(0),
                applied_revision: self.hub.applied(&key, rec.map_or(0, |r| r.applied_revision)),
                last_seen: self
                    .hub
                    .last_seen(&key)
                    .or(rec.map(|r| r.since_ms))
                    .and_then(convert::ts),
                errors: rec.map(|r| r.errors.clone()).unwrap_or_default(),
                host: rec.map(|r| pb::HostReport {
                    features: r.features.clone(),
                    route_conflicts: r.route_conflicts.clone(),
                    wireguard: r.wireguard.clone(),
                    wireguard_reason: r.wireguard_reason.clone(),
                    version: r.version.clone(),
                }),
            }
        })
    }
}

/// Peering `p` as users see it: its state and what it waits for (see
/// [`crate::hub::Hub::peering_status`]), converted by `convert`.
fn shown(hub: &crate::hub::Hub, p: &Peering, convert: impl FnOnce(&Peering) -> pb::Peering) -> pb::Peering {
    let (state, waiting_for) = hub.peering_status(p);
    let mut out = convert(&Peering { state, ..p.clone() });
    out.waiting_for = waiting_for;
    let model = hub.model();
    let has_v4 = model.site.as_ref().is_some_and(|s| !s.pod_cidrs.is_empty());
    out.ipv4 = family_status(p.ipv4_status(has_v4));
    out.ipv6 = family_status(p.ipv6_status(model.site.as_ref().and_then(|s| s.ipv6.as_ref())));
    out
}

/// A family's status on a peering, as `Peering.ipv4` and `ipv6` show it.
fn family_status(s: Option<Result<(), String>>) -> String {
    match s {
        None => String::new(),
        Some(Ok(())) => "negotiated".into(),
        Some(Err(why)) => format!("not negotiated: {why}"),
    }
}

#[tonic::async_trait]
impl AdminService for AdminApi {
    async fn rotate_admin_cert(
        &self,
        req: Request<pb::RotateAdminCertRequest>,
    ) -> Result<Response<pb::RotateAdminCertResponse>, Status> {
        self.admin_cert_rotated(req).await
    }

    async fn get_ca_status(&self, _: Request<pb::GetCaStatusRequest>) -> Result<Response<pb::CaStatus>, Status> {
        self.ca_status().await
    }

    type BackupStream = tokio_stream::Iter<std::vec::IntoIter<Result<pb::BackupChunk, Status>>>;

    async fn backup(&self, _: Request<pb::BackupRequest>) -> Result<Response<Self::BackupStream>, Status> {
        let chunks = crate::backup::taken(&self.state).await?;
        Ok(Response::new(tokio_stream::iter(
            chunks.into_iter().map(Ok).collect::<Vec<_>>(),
        )))
    }

    async fn diagnose(&self, req: Request<pb::DiagnoseRequest>) -> Result<Response<pb::DiagnoseResponse>, Status> {
        let ms = req.into_inner().settle_millis;
        if ms > 60_000 {
            return Err(Status::invalid_argument(format!(
                "settle_millis {ms}: give at most 60000 (one minute), or 0 for the default 2000"
            )));
        }
        let settle = std::time::Duration::from_millis(if ms == 0 { 2000 } else { u64::from(ms) });
        let checks = crate::diagnose::run(&self.state, &self.hub, &self.fed, self.ca_not_after_ms, settle).await?;
        Ok(Response::new(pb::DiagnoseResponse { checks }))
    }

    async fn get_site(&self, _: Request<pb::GetSiteRequest>) -> Result<Response<pb::Site>, Status> {
        let (site, rev) = match self.hub.fresh().await? {
            Some((m, rev)) => (site_of(&m)?, rev),
            None => self.state.site().await?,
        };
        let mut out = convert::site(&site, rev);
        out.ca_fingerprint = self.ca_fingerprint.clone();
        Ok(Response::new(out))
    }

    async fn list_nodes(&self, _: Request<pb::ListNodesRequest>) -> Result<Response<pb::ListNodesResponse>, Status> {
        let (nodes, revision) = match self.hub.fresh().await? {
            Some((m, rev)) => (m.nodes.values().map(|n| (**n).clone()).collect(), rev),
            None => self.state.list_nodes().await?,
        };
        let status = self.statuses().await?;
        let nodes = nodes
            .iter()
            .map(|n| pb::Node {
                status: Some(status(AgentRole::Node, &n.name)),
                ..convert::node(n)
            })
            .collect();
        Ok(Response::new(pb::ListNodesResponse { nodes, revision }))
    }

    async fn get_node(&self, req: Request<pb::GetNodeRequest>) -> Result<Response<pb::Node>, Status> {
        let name = req.into_inner().name;
        crate::domain::validate_name("the node name", &name).map_err(Status::invalid_argument)?;
        let node = match self.hub.fresh().await? {
            Some((m, _)) => m.nodes.get(&name).map(|n| (**n).clone()).ok_or_else(|| {
                Status::not_found(format!("node {name:?} does not exist; list nodes with `weftctl nodes`"))
            })?,
            None => self.state.get_node(&name).await?,
        };
        let status = self.statuses().await?;
        Ok(Response::new(pb::Node {
            status: Some(status(AgentRole::Node, &node.name)),
            ..convert::node(&node)
        }))
    }

    async fn create_node(&self, req: Request<pb::CreateNodeRequest>) -> Result<Response<pb::Node>, Status> {
        let req = req.into_inner();
        let declared = match req.subnet.trim() {
            "" => None,
            s => Some(cidr_field("subnet", s)?),
        };
        let node = self.state.create_node(&req.name, declared).await?;
        tracing::info!(node = %node.name, subnet = ?node.subnet, subnet_v6 = ?node.subnet_v6, source = ?node.source, "node created");
        Ok(Response::new(convert::node(&node)))
    }

    async fn delete_node(
        &self,
        req: Request<pb::DeleteNodeRequest>,
    ) -> Result<Response<pb::DeleteNodeResponse>, Status> {
        let node = self.state.delete_node(&req.into_inner().name).await?;
        // Take effect on this replica at once; the store watch tells the others.
        for c in &node.certs {
            self.auth.revoke(c.serial.clone(), crate::auth::RevokedAs::Removed);
        }
        tracing::info!(node = %node.name, subnet = ?node.subnet, subnet_v6 = ?node.subnet_v6, revoked = node.certs.len(), "node deleted, subnet released");
        Ok(Response::new(pb::DeleteNodeResponse {
            released_subnet: node.subnet.map(|s| s.to_string()).unwrap_or_default(),
        }))
    }

    async fn list_gateways(
        &self,
        _: Request<pb::ListGatewaysRequest>,
    ) -> Result<Response<pb::ListGatewaysResponse>, Status> {
        let (gws, revision, model) = match self.hub.fresh().await? {
            Some((m, rev)) => (m.gateways.values().map(|g| (**g).clone()).collect(), rev, m),
            None => {
                let (gws, rev) = self.state.list_gateways().await?;
                (gws, rev, self.hub.model())
            }
        };
        let status = self.statuses().await?;
        let active = crate::render::active_gateway(&model).map(|g| g.name.clone());
        let gateways = gws
            .iter()
            .map(|g| pb::Gateway {
                status: Some(status(AgentRole::Gateway, &g.name)),
                active: Some(&g.name) == active.as_ref(),
                ..convert::gateway(g)
            })
            .collect();
        Ok(Response::new(pb::ListGatewaysResponse {
            gateways,
            revision,
            last_failover: self.hub.last_failover(),
        }))
    }

    async fn delete_gateway(
        &self,
        req: Request<pb::DeleteGatewayRequest>,
    ) -> Result<Response<pb::DeleteGatewayResponse>, Status> {
        let gw = self.state.delete_gateway(&req.into_inner().name).await?;
        for c in &gw.certs {
            self.auth.revoke(c.serial.clone(), crate::auth::RevokedAs::Removed);
        }
        tracing::info!(gateway = %gw.name, revoked = gw.certs.len(), "gateway deleted");
        Ok(Response::new(pb::DeleteGatewayResponse {}))
    }

    async fn accept_gateway_key(
        &self,
        req: Request<pb::AcceptGatewayKeyRequest>,
    ) -> Result<Response<pb::Gateway>, Status> {
        let req = req.into_inner();
        crate::domain::validate_name("name", &req.name).map_err(Status::invalid_argument)?;
        if req.public_key.is_empty() {
            return Err(Status::invalid_argument(
                "public_key: give the key the gateway's host logged (\"this gateway's WireGuard public key\"), so \
                 that the key taken is the one you checked there",
            ));
        }
        let expected = weft_types::WgKey::parse("public_key", &req.public_key).map_err(Status::invalid_argument)?;
        let g = self.state.accept_gateway_key(&req.name, &expected).await?;
        Ok(Response::new(convert::gateway(&g)))
    }

    async fn create_token(
        &self,
        req: Request<pb::CreateTokenRequest>,
    ) -> Result<Response<pb::CreateTokenResponse>, Status> {
        let req = req.into_inner();
        let role = agent_role(req.role, "role")?;
        let name = Some(req.name.trim()).filter(|n| !n.is_empty());
        let ttl = if req.ttl_seconds == 0 {
            Duration::from_secs(3600)
        } else {
            Duration::from_secs(req.ttl_seconds)
        };
        let uses = if req.uses == 0 { 1 } else { req.uses };
        let (token, info) = self.state.create_token(role, name, ttl, uses).await?;
        Ok(Response::new(pb::CreateTokenResponse {
            token,
            info: Some(convert::token(&info)),
            ca_fingerprint: self.ca_fingerprint.clone(),
        }))
    }

    async fn list_tokens(&self, _: Request<pb::ListTokensRequest>) -> Result<Response<pb::ListTokensResponse>, Status> {
        let tokens = self.state.list_tokens().await?;
        Ok(Response::new(pb::ListTokensResponse {
            tokens: tokens.iter().map(convert::token).collect(),
        }))
    }

    async fn delete_token(
        &self,
        req: Request<pb::DeleteTokenRequest>,
    ) -> Result<Response<pb::DeleteTokenResponse>, Status> {
        let id = req.into_inner().id;
        if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(Status::invalid_argument(format!(
                "{id:?} is not a token id; list them with `weftctl token list`"
            )));
        }
        self.state.delete_token(&id).await?;
        Ok(Response::new(pb::DeleteTokenResponse {}))
    }

    async fn list_peerings(
        &self,
        _: Request<pb::ListPeeringsRequest>,
    ) -> Result<Response<pb::ListPeeringsResponse>, Status> {
        let (ps, revision, site, gateways_now) = match self.hub.fresh().await? {
            Some((m, rev)) => (
                m.peerings.values().map(|p| (**p).clone()).collect(),
                rev,
                site_of(&m)?,
                m.gateways.values().map(|g| (**g).clone()).collect::<Vec<_>>(),
            ),
            None => {
                let (ps, rev) = self.state.list_peerings().await?;
                (ps, rev, self.state.site().await?.0, self.state.list_gateways().await?.0)
            }
        };
        let gateways = self.fed.local_gateways();
        let all: crate::transit::Peerings = ps.iter().map(|p| (p.site_id.clone(), Arc::new(p.clone()))).collect();
        Ok(Response::new(pb::ListPeeringsResponse {
            peerings: ps
                .iter()
                .map(|p| {
                    let mut out = shown(&self.hub, p, |p| convert::peering_among(p, &all));
                    out.tunnel = self.hub.tunnel(&p.site_id);
                    out.export = Some(convert::export_policy(&site, p, &gateways_now));
                    out.local_gateways = gateways.for_port(&site, p.listen_port);
                    if let Some(t) = out.tunnel.as_mut() {
                        t.path = weft_core::peer::tunnel_path(p, &out.local_gateways, t.up, t.on_direct);
                    }
                    out
                })
                .collect(),
            revision,
            refused_joins: self.fed.refused.to_proto(),
        }))
    }

    async fn create_peering_token(
        &self,
        req: Request<pb::CreatePeeringTokenRequest>,
    ) -> Result<Response<pb::CreatePeeringTokenResponse>, Status> {
        let r = req.into_inner();
        let ttl = match r.ttl_seconds {
            0 => Duration::from_secs(3600),
            s => Duration::from_secs(s),
        };
        let for_site = Some(r.for_site.trim()).filter(|s| !s.is_empty());
        if self.fed.endpoints.is_empty() {
            return Err(Status::failed_precondition(
                "this controller does not know the address peers reach it at: set --advertise (host:port)",
            ));
        }
        let (id, secret, t) = self.state.create_peer_token(ttl, for_site).await?;
        let token = PeeringToken {
            site: self.fed.site_id.clone(),
            endpoints: self.fed.endpoints.clone(),
            fp: self.fed.ca_fingerprint.clone(),
            id,
            secret,
            exp: t.expires_at_ms,
        };
        Ok(Response::new(pb::CreatePeeringTokenResponse {
            token: token.encode(),
            expires_at: convert::ts(t.expires_at_ms),
        }))
    }

    async fn accept_peering_update(
        &self,
        req: Request<pb::AcceptPeeringUpdateRequest>,
    ) -> Result<Response<pb::Peering>, Status> {
        let p = self.state.accept_peer_update(&req.into_inner().site_id).await?;
        Ok(Response::new(shown(&self.hub, &p, convert::peering)))
    }

    async fn set_peering_ca(&self, req: Request<pb::SetPeeringCaRequest>) -> Result<Response<pb::Peering>, Status> {
        let r = req.into_inner();
        let p = self.state.set_peer_ca(&r.site_id, &r.ca_pem).await?;
        Ok(Response::new(shown(&self.hub, &p, convert::peering)))
    }

    async fn set_export_policy(
        &self,
        req: Request<pb::SetExportPolicyRequest>,
    ) -> Result<Response<pb::ExportPolicy>, Status> {
        use crate::export::ExportPolicy;
        let r = req.into_inner();
        let wanted = match pb::ExportMode::try_from(r.mode) {
            Ok(pb::ExportMode::All) => Some(ExportPolicy::All),
            Ok(pb::ExportMode::Rules) => Some(ExportPolicy::Rules(&r.rules[..])),
            Ok(pb::ExportMode::SiteDefault) => None,
            _ => {
                return Err(Status::invalid_argument(
                    "mode: give EXPORT_MODE_ALL, EXPORT_MODE_RULES (with rules) or EXPORT_MODE_SITE_DEFAULT",
                ));
            }
        };
        if !matches!(wanted, Some(ExportPolicy::Rules(_))) && !r.rules.is_empty() {
            return Err(Status::invalid_argument(
                "rules: only a policy of mode EXPORT_MODE_RULES has rules; set that mode, or send no rules",
            ));
        }
        let p = self.state.set_export_policy(&r.site_id, wanted).await?;
        let (site, _) = self.state.site().await?;
        let (gateways, _) = self.state.list_gateways().await?;
        Ok(Response::new(convert::export_policy(&site, &p, &gateways)))
    }

    async fn set_peering_transit(
        &self,
        req: Request<pb::SetPeeringTransitRequest>,
    ) -> Result<Response<pb::Peering>, Status> {
        let r = req.into_inner();
        let p = self.state.set_transit(&r.site_id, r.enabled).await?;
        let (ps, _) = self.state.list_peerings().await?;
        let all: crate::transit::Peerings = ps.into_iter().map(|q| (q.site_id.clone(), Arc::new(q))).collect();
        Ok(Response::new(shown(&self.hub, &p, |p| convert::peering_among(p, &all))))
    }

    async fn get_export_policy(
        &self,
        req: Request<pb::GetExportPolicyRequest>,
    ) -> Result<Response<pb::ExportPolicy>, Status> {
        let site_id = req.into_inner().site_id;
        crate::domain::validate_name("site_id", &site_id).map_err(Status::invalid_argument)?;
        let Some(p) = self.state.peering(&site_id).await? else {
            return Err(Status::not_found(format!(
                "there is no peering with site {site_id:?}; list them with `weftctl peerings`"
            )));
        };
        let (site, _) = self.state.site().await?;
        let (gateways, _) = self.state.list_gateways().await?;
        Ok(Response::new(convert::export_policy(&site, &p, &gateways)))
    }

    async fn create_peering(&self, req: Request<pb::CreatePeeringRequest>) -> Result<Response<pb::Peering>, Status> {
        let deadline = answer_by(&req, crate::federation::JOIN_BUDGET);
        let r = req.into_inner();
        let p = self.fed.create(&r.token, r.transit, deadline).await?;
        Ok(Response::new(shown(&self.hub, &p, convert::peering)))
    }

    async fn delete_peering(
        &self,
        req: Request<pb::DeletePeeringRequest>,
    ) -> Result<Response<pb::DeletePeeringResponse>, Status> {
        let notified = self.fed.delete(&req.into_inner().site_id).await?;
        Ok(Response::new(pb::DeletePeeringResponse {
            remote_notified: notified,
        }))
    }

    async fn list_allocations(
        &self,
        _: Request<pb::ListAllocationsRequest>,
    ) -> Result<Response<pb::ListAllocationsResponse>, Status> {
        let (allocs, pools, revision) = self.state.allocations().await?;
        Ok(Response::new(pb::ListAllocationsResponse {
            allocations: allocs.iter().map(convert::allocation).collect(),
            pools: pools.iter().map(convert::pool_usage).collect(),
            revision,
        }))
    }

    async fn translate(&self, req: Request<pb::TranslateRequest>) -> Result<Response<pb::Translation>, Status> {
        use crate::names::Untranslatable;
        let req = req.into_inner();
        let address = either_family("address", &req.address)?;
        let site = req.site.trim();
        if !site.is_empty() {
            crate::domain::validate_name("site", site).map_err(Status::invalid_argument)?;
        }
        let model = self.hub.model();
        let peerings: Vec<&Peering> = model.peerings.values().map(|p| p.as_ref()).collect();
        let t = if site.is_empty() {
            crate::names::to_peer(&peerings, address)
        } else {
            crate::names::to_local(&peerings, site, address)
        };
        match t {
            Ok(t) => Ok(Response::new(convert::translation(&t))),
            Err(Untranslatable::NotFound(m)) => Err(Status::not_found(m)),
            Err(Untranslatable::Precondition(m)) => Err(Status::failed_precondition(m)),
        }
    }

    async fn create_name(&self, req: Request<pb::CreateNameRequest>) -> Result<Response<pb::Name>, Status> {
        let req = req.into_inner();
        crate::names::check_label("name", &req.name).map_err(Status::invalid_argument)?;
        // Empty: a workload of an IPv6-only site, named by address_v6.
        let address = match req.address.trim() {
            "" => None,
            a => Some(address_field("address", a)?),
        };
        let address_v6 = match req.address_v6.as_str() {
            "" => None,
            text => {
                Some(weft_types::net::addr_v6(text).map_err(|m| Status::invalid_argument(format!("address_v6: {m}")))?)
            }
        };
        let n = self
            .state
            .create_name(&req.name, address, address_v6, req.export)
            .await?;
        tracing::info!(name = %n.name, address = ?n.address, address_v6 = ?n.address_v6, external = ?n.external, "name published");
        Ok(Response::new(convert::name(&n)))
    }

    async fn delete_name(
        &self,
        req: Request<pb::DeleteNameRequest>,
    ) -> Result<Response<pb::DeleteNameResponse>, Status> {
        let n = self.state.delete_name(&req.into_inner().name).await?;
        tracing::info!(name = %n.name, "name unpublished");
        Ok(Response::new(pb::DeleteNameResponse {}))
    }

    async fn list_names(&self, _: Request<pb::ListNamesRequest>) -> Result<Response<pb::ListNamesResponse>, Status> {
        let published = self.state.list_names().await?.iter().map(convert::name).collect();
        let (peerings, _) = self.state.list_peerings().await?;
        let mut learned = Vec::new();
        for p in &peerings {
            for l in crate::names::learned(p) {
                learned.push(pb::LearnedName {
                    site: p.site_id.clone(),
                    name: l.name.name.clone(),
                    kind: l.name.kind.to_pb() as i32,
                    address: l.name.address.map(|a| a.to_string()).unwrap_or_default(),
                    local_address: l.local.map(|a| a.to_string()).unwrap_or_default(),
                    address_v6: l.name.address_v6.map(|a| a.to_string()).unwrap_or_default(),
                    local_address_v6: l.local_v6.map(|a| a.to_string()).unwrap_or_default(),
                });
            }
        }
        Ok(Response::new(pb::ListNamesResponse { published, learned }))
    }

    async fn plan_local_view(
        &self,
        req: Request<pb::PlanLocalViewRequest>,
    ) -> Result<Response<pb::PlanLocalViewResponse>, Status> {
        let req = req.into_inner();
        if req.workload_cidrs.is_empty() {
            return Err(Status::invalid_argument(
                "workload_cidrs is empty; give the peer's workload CIDR(s)",
            ));
        }
        let mut peer = Vec::new();
        for (i, c) in req.workload_cidrs.iter().enumerate() {
            peer.push((CidrKind::Workload, cidr_field(&format!("workload_cidrs[{i}]"), c)?));
        }
        if !req.external_cidr.trim().is_empty() {
            peer.push((CidrKind::External, cidr_field("external_cidr", &req.external_cidr)?));
        }
        let views = self.state.plan_views(&peer).await?;
        Ok(Response::new(pb::PlanLocalViewResponse {
            views: views.iter().map(convert::view).collect(),
        }))
    }
}

/// The site's record in the model, as the store read says when it has none.
fn site_of(m: &crate::render::Model) -> Result<crate::domain::Site, Status> {
    m.site
        .as_deref()
        .cloned()
        .ok_or_else(|| Status::failed_precondition("the site is not initialised in the store yet"))
}
