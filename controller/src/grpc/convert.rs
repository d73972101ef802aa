//! Domain types → weft.v1 wire types. The only place that knows both.

use prost_types::Timestamp;
use weft_proto::v1 as pb;

use crate::domain::{
    AgentRole, Allocation, AllocationKind, Gateway, Node, Peering, PeeringState, PoolUsage, Site, SubnetSource, Token,
    live_until,
};
use crate::ipam::{CidrKind, View};
use crate::store::Revision;

pub fn ts(ms: u64) -> Option<Timestamp> {
    Some(weft_proto::timestamp_ms(ms))
}

fn strs<T: ToString>(v: &[T]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

/// IPv4 blocks, then IPv6 ones.
fn both(v4: &[ipnet::Ipv4Net], v6: Option<&[ipnet::Ipv6Net]>) -> Vec<String> {
    let mut out = strs(v4);
    out.extend(strs(v6.unwrap_or_default()));
    out
}

pub fn site(s: &Site, revision: Revision) -> pb::Site {
    let v6 = s.ipv6.as_ref();
    pb::Site {
        id: s.id.clone(),
        pod_cidrs: both(&s.pod_cidrs, v6.map(|v| &v.pod_cidrs[..])),
        external_cidr: s.external_cidr.to_string(),
        internal_cidr: s.internal_cidr.to_string(),
        reserved_cidrs: both(&s.reserved_cidrs, v6.map(|v| &v.reserved_cidrs[..])),
        remap_pools: both(&s.remap_pools, v6.map(|v| &v.remap_pools[..])),
        external_cidr_v6: v6
            .and_then(|v| v.external_cidr)
            .map(|c| c.to_string())
            .unwrap_or_default(),
        node_prefix_len: u32::from(s.node_prefix_len),
        revision,
        ca_fingerprint: String::new(),
        controller_version: env!("CARGO_PKG_VERSION").into(),
    }
}

pub fn node(n: &Node) -> pb::Node {
    pb::Node {
        name: n.name.clone(),
        subnet: n.subnet.map(|s| s.to_string()).unwrap_or_default(),
        subnet_v6: n.subnet_v6.map(|s| s.to_string()).unwrap_or_default(),
        subnet_source: match n.source {
            SubnetSource::Allocated => pb::SubnetSource::Allocated,
            SubnetSource::Declared => pb::SubnetSource::Declared,
        } as i32,
        created_at: ts(n.created_at_ms),
        cert_expires_at: live_until(&n.certs, 0).and_then(ts),
        status: None,
        internal_ip: n.internal_ip.map(|i| i.to_string()).unwrap_or_default(),
        underlay_ip: n.underlay_ip.map(|i| i.to_string()).unwrap_or_default(),
        geneve: n.geneve,
        identity_conflict: n.identity_conflict.as_ref().map(|c| c.to_string()).unwrap_or_default(),
    }
}

pub fn gateway(g: &Gateway) -> pb::Gateway {
    pb::Gateway {
        name: g.name.clone(),
        endpoint: g.endpoint.map(|e| e.to_string()).unwrap_or_default(),
        public_key: g.public_key.map(|k| k.to_string()).unwrap_or_default(),
        created_at: ts(g.created_at_ms),
        cert_expires_at: live_until(&g.certs, 0).and_then(ts),
        status: None,
        internal_ip: g.internal_ip.map(|i| i.to_string()).unwrap_or_default(),
        underlay_ip: g.underlay_ip.map(|i| i.to_string()).unwrap_or_default(),
        geneve: g.geneve,
        active: false,
        pending_public_key: g.pending_public_key.map(|k| k.to_string()).unwrap_or_default(),
        identity_conflict: g.identity_conflict.as_ref().map(|c| c.to_string()).unwrap_or_default(),
        nat: weft_core::peer::gateway_behaviour(g)
            .map(|b| b.as_str().to_string())
            .unwrap_or_default(),
    }
}

/// A peer gateway as this site records it, for the admin.
pub fn remote_gateway(g: &crate::domain::RemoteGateway) -> pb::GatewayInfo {
    pb::GatewayInfo {
        name: g.name.clone(),
        endpoint: g.endpoint.map(|e| e.to_string()).unwrap_or_default(),
        public_key: g.public_key.map(|k| k.to_string()).unwrap_or_default(),
        active: g.active,
        candidates: g
            .candidates
            .iter()
            .filter(|c| c.address.is_ipv4())
            .map(|c| c.to_pb())
            .collect(),
        candidates_v6: g
            .candidates
            .iter()
            .filter(|c| c.address.is_ipv6())
            .map(|c| c.to_pb())
            .collect(),
        nat: g.nat.map(|b| b.as_str().to_string()).unwrap_or_default(),
    }
}

pub fn cidr_kind(k: CidrKind) -> pb::CidrKind {
    match k {
        CidrKind::Workload => pb::CidrKind::Workload,
        CidrKind::External => pb::CidrKind::External,
    }
}

pub fn view<N: crate::ipam::Prefix>(v: &View<N>) -> pb::CidrView {
    pb::CidrView {
        kind: cidr_kind(v.kind) as i32,
        real_cidr: v.real.to_string(),
        local_cidr: v.local.to_string(),
        remapped: v.remapped(),
    }
}

/// `p`'s export policy as set, and as it applies under `site`'s default,
/// with the `gateways` that would not enforce it.
pub fn export_policy<'a>(
    site: &crate::domain::Site,
    p: &Peering,
    gateways: impl IntoIterator<Item = &'a crate::domain::Gateway>,
) -> pb::ExportPolicy {
    use crate::export::ExportPolicy;
    let (mode, rules) = match &p.export {
        Some(ExportPolicy::All) => (pb::ExportMode::All, vec![]),
        Some(ExportPolicy::Rules(r)) => (pb::ExportMode::Rules, r.iter().map(crate::export::rule_pb).collect()),
        None => (pb::ExportMode::SiteDefault, vec![]),
    };
    let in_force = crate::export::effective(site, p);
    let (effective, rules) = match in_force {
        None => (pb::ExportMode::All, rules),
        Some(r) => (pb::ExportMode::Rules, r.iter().map(crate::export::rule_pb).collect()),
    };
    let not_enforced_by = match in_force {
        Some(r) => {
            // (A gateway whose agent takes no IPv6 rules refuses all IPv6
            // instead.)
            let v6_rules = r.iter().any(|r| r.cidr.addr().is_ipv6());
            gateways
                .into_iter()
                .filter(|g| !g.enforces_export || (v6_rules && !g.enforces_export_v6))
                .map(|g| g.name.clone())
                .collect()
        }
        None => vec![],
    };
    pb::ExportPolicy {
        site_id: p.site_id.clone(),
        mode: mode as i32,
        rules,
        effective: effective as i32,
        not_enforced_by,
    }
}

/// The sites this site reaches through `p`, each with its views and
/// whether it is used (no direct peering in `all` preferred over it).
fn transit_paths(p: &Peering, all: &crate::transit::Peerings) -> Vec<pb::TransitPath> {
    let mut out: Vec<pb::TransitPath> = Vec::new();
    let v6_on: Vec<&String> = crate::transit::rendered_v6(all, p).map(|(_, t)| &t.site).collect();
    let v4 = p.transit_views.iter().map(|t| {
        let active = crate::transit::usable(p) && !crate::transit::direct(all, &t.site);
        (&t.site, view(&t.view), active)
    });
    let v6 = p
        .transit_views_v6
        .iter()
        .map(|t| (&t.site, view(&t.view), v6_on.contains(&&t.site)));
    for (site, v, active) in v4.chain(v6) {
        match out.iter_mut().find(|o| o.site == *site) {
            Some(o) => {
                o.views.push(v);
                o.active |= active;
            }
            None => out.push(pb::TransitPath {
                site: site.clone(),
                views: vec![v],
                active,
                told_by: p.site_id.clone(),
            }),
        }
    }
    out
}

/// [`peering`] among this site's peerings `all`: which transit paths are
/// in use, and which sites the peer reaches through this one.
pub fn peering_among(p: &Peering, all: &crate::transit::Peerings) -> pb::Peering {
    let mut out = peering(p);
    out.transit_paths = transit_paths(p, all);
    out.transit_onward = crate::transit::onward(all.values().map(|q| &**q), p)
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    out
}

pub fn peering(p: &Peering) -> pb::Peering {
    pb::Peering {
        peer_version: p.remote.as_ref().map(|r| r.version.clone()).unwrap_or_default(),
        site_id: p.site_id.clone(),
        state: match p.state {
            PeeringState::Pending => pb::PeeringState::Pending,
            PeeringState::Negotiated => pb::PeeringState::Negotiated,
            PeeringState::Connecting => pb::PeeringState::Connecting,
            PeeringState::Connected => pb::PeeringState::Connected,
            PeeringState::Deleting => pb::PeeringState::Deleting,
        } as i32,
        views: p.views.iter().map(view).chain(p.views_v6.iter().map(view)).collect(),
        created_at: ts(p.created_at_ms),
        last_error: p.last_error.clone().unwrap_or_default(),
        tunnel_role: match p.remote.as_ref().map(|r| r.tunnel_role) {
            Some(crate::domain::TunnelRole::Server) => "server".into(),
            Some(crate::domain::TunnelRole::Client) => "client".into(),
            None => String::new(),
        },
        remote_endpoints: p.remote.as_ref().map(|r| r.endpoints.clone()).unwrap_or_default(),
        remote_ca_fingerprint: p.remote.as_ref().map(|r| r.ca_fingerprint.clone()).unwrap_or_default(),
        tunnel: None,
        export: None,
        transit: p.transit,
        peer_transit: p.remote.as_ref().is_some_and(|r| r.transit),
        transit_paths: transit_paths(p, &Default::default()),
        transit_onward: vec![],
        waiting_for: vec![],
        peer_exports_limited: p.remote.as_ref().is_some_and(|r| r.exported.is_some()),
        peer_exports: p
            .remote
            .iter()
            .flat_map(|r| {
                let v4 = r.exported.iter().flatten().map(|c| c.to_string());
                v4.chain(r.exported_v6.iter().map(|c| c.to_string()))
            })
            .collect(),
        listen_port: u32::from(p.listen_port),
        held_by_peer: p.joined_with.is_none(),
        pending_workload_cidrs: p
            .pending
            .iter()
            .flat_map(|q| &q.workload_cidrs)
            .map(|c| c.to_string())
            .collect(),
        pending_external_cidr: p
            .pending
            .as_ref()
            .and_then(|q| q.external_cidr)
            .map(|c| c.to_string())
            .unwrap_or_default(),
        pending_since: p.pending.as_ref().and_then(|q| ts(q.received_at_ms)),
        pending_workload_cidrs_v6: p
            .pending_v6
            .iter()
            .flat_map(|q| &q.workload_cidrs_v6)
            .map(|c| c.to_string())
            .collect(),
        pending_external_cidr_v6: p
            .pending_v6
            .as_ref()
            .and_then(|q| q.external_cidr_v6)
            .map(|c| c.to_string())
            .unwrap_or_default(),
        pending_since_v6: p.pending_v6.as_ref().and_then(|q| ts(q.received_at_ms)),
        local_gateways: vec![],
        remote_gateways: p.remote.iter().flat_map(|r| &r.gateways).map(remote_gateway).collect(),
        ipv4: String::new(),
        ipv6: String::new(),
    }
}

fn alloc_kind(k: AllocationKind) -> i32 {
    match k {
        AllocationKind::NodeSubnet => pb::AllocationKind::NodeSubnet as i32,
        AllocationKind::PeerView => pb::AllocationKind::PeerView as i32,
    }
}

pub fn allocation(a: &Allocation) -> pb::Allocation {
    pb::Allocation {
        cidr: a.cidr.to_string(),
        kind: alloc_kind(a.kind),
        owner: a.owner.clone(),
        pool: a.pool.map(|p| p.to_string()).unwrap_or_default(),
    }
}

pub fn pool_usage(p: &PoolUsage) -> pb::PoolUsage {
    pb::PoolUsage {
        pool: p.pool.to_string(),
        kind: alloc_kind(p.kind),
        total_addresses: u64::try_from(p.total).unwrap_or(u64::MAX),
        allocated_addresses: u64::try_from(p.allocated).unwrap_or(u64::MAX),
        total: p.total.to_string(),
        allocated: p.allocated.to_string(),
    }
}

pub fn agent_role(r: AgentRole) -> pb::AgentRole {
    match r {
        AgentRole::Node => pb::AgentRole::Node,
        AgentRole::Gateway => pb::AgentRole::Gateway,
    }
}

pub fn token(t: &Token) -> pb::Token {
    pb::Token {
        id: t.id.clone(),
        role: agent_role(t.role) as i32,
        name: t.name.clone().unwrap_or_default(),
        expires_at: ts(t.expires_at_ms),
        uses_left: t.uses_left,
        created_at: ts(t.created_at_ms),
    }
}

pub fn name(n: &crate::names::NameRecord) -> pb::Name {
    pb::Name {
        name: n.name.clone(),
        kind: n.kind.to_pb() as i32,
        address: n.address.map(|a| a.to_string()).unwrap_or_default(),
        external_address: n.external.map(|e| e.to_string()).unwrap_or_default(),
        created_at: ts(n.created_at_ms),
        address_v6: n.address_v6.map(|a| a.to_string()).unwrap_or_default(),
    }
}

pub fn translation(t: &crate::names::Translation) -> pb::Translation {
    pb::Translation {
        site: t.site.clone(),
        real_address: t.real.to_string(),
        local_address: t.local.to_string(),
        kind: cidr_kind(t.kind) as i32,
        real_cidr: t.real_cidr.to_string(),
        local_cidr: t.local_cidr.to_string(),
        remapped: t.remapped(),
    }
}
