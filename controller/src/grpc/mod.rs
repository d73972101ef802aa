//! The weft.v1 gRPC services. Requests are validated and converted here;
//! the work is done by [`crate::state`].

pub mod convert;

use ipnet::Ipv4Net;
use tonic::{Request, Response, Status};
use weft_proto::v1 as pb;
use weft_proto::v1::admin_service_server::AdminService;

use crate::config::parse_cidr;
use crate::ipam::CidrKind;
use crate::state::State;

/// `weft.v1.AdminService`.
#[derive(Clone)]
pub struct AdminApi {
    state: State,
}

impl AdminApi {
    pub fn new(state: State) -> Self {
        Self { state }
    }
}

fn cidr_field(field: &str, text: &str) -> Result<Ipv4Net, Status> {
    parse_cidr(text).map_err(|m| Status::invalid_argument(format!("{field}: {m}")))
}

#[tonic::async_trait]
impl AdminService for AdminApi {
    async fn get_site(&self, _: Request<pb::GetSiteRequest>) -> Result<Response<pb::Site>, Status> {
        let (site, rev) = self.state.site().await?;
        Ok(Response::new(convert::site(&site, rev)))
    }

    async fn list_nodes(
        &self,
        _: Request<pb::ListNodesRequest>,
    ) -> Result<Response<pb::ListNodesResponse>, Status> {
        let (nodes, revision) = self.state.list_nodes().await?;
        Ok(Response::new(pb::ListNodesResponse {
            nodes: nodes.iter().map(convert::node).collect(),
            revision,
        }))
    }

    async fn get_node(
        &self,
        req: Request<pb::GetNodeRequest>,
    ) -> Result<Response<pb::Node>, Status> {
        let node = self.state.get_node(&req.into_inner().name).await?;
        Ok(Response::new(convert::node(&node)))
    }

    async fn create_node(
        &self,
        req: Request<pb::CreateNodeRequest>,
    ) -> Result<Response<pb::Node>, Status> {
        let req = req.into_inner();
        let declared = match req.subnet.trim() {
            "" => None,
            s => Some(cidr_field("subnet", s)?),
        };
        let node = self.state.create_node(&req.name, declared).await?;
        tracing::info!(node = %node.name, subnet = %node.subnet, source = ?node.source, "node created");
        Ok(Response::new(convert::node(&node)))
    }

    async fn delete_node(
        &self,
        req: Request<pb::DeleteNodeRequest>,
    ) -> Result<Response<pb::DeleteNodeResponse>, Status> {
        let node = self.state.delete_node(&req.into_inner().name).await?;
        tracing::info!(node = %node.name, subnet = %node.subnet, "node deleted, subnet released");
        Ok(Response::new(pb::DeleteNodeResponse {
            released_subnet: node.subnet.to_string(),
        }))
    }

    async fn list_gateways(
        &self,
        _: Request<pb::ListGatewaysRequest>,
    ) -> Result<Response<pb::ListGatewaysResponse>, Status> {
        let (gws, revision) = self.state.list_gateways().await?;
        Ok(Response::new(pb::ListGatewaysResponse {
            gateways: gws.iter().map(convert::gateway).collect(),
            revision,
        }))
    }

    async fn list_peerings(
        &self,
        _: Request<pb::ListPeeringsRequest>,
    ) -> Result<Response<pb::ListPeeringsResponse>, Status> {
        let (ps, revision) = self.state.list_peerings().await?;
        Ok(Response::new(pb::ListPeeringsResponse {
            peerings: ps.iter().map(convert::peering).collect(),
            revision,
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
            peer.push((
                CidrKind::Workload,
                cidr_field(&format!("workload_cidrs[{i}]"), c)?,
            ));
        }
        if !req.external_cidr.trim().is_empty() {
            peer.push((
                CidrKind::External,
                cidr_field("external_cidr", &req.external_cidr)?,
            ));
        }
        let views = self.state.plan_views(&peer).await?;
        Ok(Response::new(pb::PlanLocalViewResponse {
            views: views.iter().map(convert::view).collect(),
        }))
    }
}
