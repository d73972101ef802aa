//! What the site's blocks are (IPAM's allocations and pools' usage), and
//! the check that a new site configuration strands none of them.

use ipnet::IpNet;

use super::Snapshot;
use crate::domain::*;
use crate::error::Error;
use crate::ipam;
use crate::store::Revision;

/// The nodes missing a subnet of a family `site` has, each given one (a
/// site that adds IPv6, or IPv4, keeps its nodes): a /64 while the IPv6
/// pods have one left (IPv6 then waits, as for a new node), an IPv4
/// subnet or the change is refused. Each with the revision it was read at.
pub(super) fn number_nodes(site: &Site, snap: &Snapshot) -> Result<Vec<(Node, Revision)>, Error> {
    let mut taken_v6 = snap.node_subnets_v6();
    let mut taken: Vec<ipnet::Ipv4Net> = snap.node_subnets().into_iter().map(|t| t.1).collect();
    let mut v6_full = false;
    let mut out = Vec::new();
    for (n, rev) in &snap.nodes {
        let mut m = n.clone();
        if let (Some(v6), None, false) = (&site.ipv6, m.subnet_v6, v6_full) {
            m.subnet_v6 = super::agents::ipv6_subnet(v6, &n.name, &taken_v6);
            taken_v6.extend(m.subnet_v6);
            v6_full = m.subnet_v6.is_none();
        }
        if m.subnet.is_none() && !site.pod_cidrs.is_empty() {
            let (s, _) = ipam::allocate_node_subnet(&site.pod_cidrs, site.node_prefix_len, &taken).map_err(|e| {
                Error::FailedPrecondition(format!(
                    "pod_cidrs: node {:?} has no IPv4 subnet and none is left for it: {e}",
                    n.name
                ))
            })?;
            taken.push(s);
            m.subnet = Some(s);
        }
        if m != *n {
            out.push((m, *rev));
        }
    }
    Ok(out)
}

/// The blocks `nodes` and `peerings` hold (both families), sorted, and
/// each pool's usage.
pub fn allocations_of<'a>(
    site: &Site,
    nodes: impl Iterator<Item = &'a Node>,
    peerings: impl Iterator<Item = &'a Peering>,
) -> (Vec<Allocation>, Vec<PoolUsage>) {
    let v6 = site.ipv6.as_ref();
    let pods_v6 = v6.map(|v| v.pod_cidrs.as_slice()).unwrap_or_default();
    let mut allocs = Vec::new();
    for n in nodes {
        if let Some(s) = n.subnet {
            allocs.push(Allocation {
                cidr: s.into(),
                kind: AllocationKind::NodeSubnet,
                owner: n.name.clone(),
                pool: site.pod_cidrs.iter().find(|p| p.contains(&s)).map(|p| (*p).into()),
            });
        }
        if let Some(s) = n.subnet_v6 {
            allocs.push(Allocation {
                cidr: s.into(),
                kind: AllocationKind::NodeSubnet,
                owner: n.name.clone(),
                pool: pods_v6.iter().find(|p| p.contains(&s)).map(|p| (*p).into()),
            });
        }
    }
    let view = |owner: String, local: IpNet, pool: Option<IpNet>| Allocation {
        cidr: local,
        kind: AllocationKind::PeerView,
        owner,
        pool,
    };
    let peerings: Vec<&Peering> = peerings.collect();
    for p in &peerings {
        for v in &p.views {
            allocs.push(view(
                format!("{}/{}", p.site_id, v.kind),
                v.local.into(),
                v.pool.map(Into::into),
            ));
        }
        for v in &p.views_v6 {
            allocs.push(view(
                format!("{}/{}", p.site_id, v.kind),
                v.local.into(),
                v.pool.map(Into::into),
            ));
        }
    }
    // Views of sites reached through transit, once each (a direct
    // peering with the same site shares its block).
    for p in &peerings {
        for t in &p.transit_views {
            let local = IpNet::from(t.view.local);
            if allocs
                .iter()
                .any(|a| a.kind == AllocationKind::PeerView && a.cidr == local)
            {
                continue;
            }
            allocs.push(view(
                format!("{}/{} (through {})", t.site, t.view.kind, p.site_id),
                local,
                t.view.pool.map(Into::into),
            ));
        }
    }
    allocs.sort_by_key(|a| (a.cidr.addr().is_ipv6(), a.cidr.network(), a.cidr.prefix_len()));
    let usage = |pool: IpNet, kind| {
        // Blocks taken from the pool, not a real CIDR inside it.
        let taken = allocs
            .iter()
            .filter(|a| a.kind == kind && a.pool == Some(pool))
            .map(|a| a.cidr);
        let (total, allocated) = match pool {
            IpNet::V4(p) => used(p, taken, |c| if let IpNet::V4(c) = c { Some(c) } else { None }),
            IpNet::V6(p) => used(p, taken, |c| if let IpNet::V6(c) = c { Some(c) } else { None }),
        };
        PoolUsage {
            pool,
            kind,
            total,
            allocated,
        }
    };
    let mut pools: Vec<PoolUsage> = site
        .pod_cidrs
        .iter()
        .map(|p| usage((*p).into(), AllocationKind::NodeSubnet))
        .collect();
    pools.extend(
        site.remap_pools
            .iter()
            .map(|p| usage((*p).into(), AllocationKind::PeerView)),
    );
    pools.extend(pods_v6.iter().map(|p| usage((*p).into(), AllocationKind::NodeSubnet)));
    pools.extend(
        v6.iter()
            .flat_map(|v| &v.remap_pools)
            .map(|p| usage((*p).into(), AllocationKind::PeerView)),
    );
    (allocs, pools)
}

/// A pool's size and how much of it `blocks` (those of its family, picked
/// by `of`) take, in addresses.
fn used<N: ipam::Prefix>(pool: N, blocks: impl Iterator<Item = IpNet>, of: fn(IpNet) -> Option<N>) -> (u128, u128) {
    let blocks: Vec<N> = blocks.filter_map(of).collect();
    (ipam::size(&pool), ipam::used_in(&pool, &blocks))
}

/// Refuses a new site configuration that would strand an existing node
/// subnet or peer view.
pub(super) fn check_site_change(new: &Site, snap: &Snapshot) -> Result<(), Error> {
    let mut problems = Vec::new();
    for (n, _) in &snap.nodes {
        if let Some(s) = n.subnet.filter(|s| !new.pod_cidrs.iter().any(|p| p.contains(s))) {
            problems.push(format!("node {:?} has subnet {s}, outside the new pod CIDRs", n.name));
        }

        let v6_pods = new.ipv6.as_ref().map(|v| v.pod_cidrs.as_slice()).unwrap_or_default();
        if let Some(s) = n.subnet_v6.filter(|s| !v6_pods.iter().any(|p| p.contains(s))) {
            problems.push(format!(
                "node {:?} has IPv6 subnet {s}, outside the new pod CIDRs (a site cannot drop IPv6 its nodes use)",
                n.name
            ));
        }
    }
    let own = new.own_blocks();
    let own_v6 = new.ipv6.as_ref().map(|v| v.own_blocks()).unwrap_or_default();
    for (p, _) in &snap.peerings {
        for v in &p.views_v6 {
            if let Some(b) = own_v6.iter().find(|b| ipam::overlaps(*b, &v.local)) {
                problems.push(format!(
                    "the local IPv6 view {} of peer {:?} overlaps {b} in the new configuration",
                    v.local, p.site_id
                ));
            }
        }
        if new.pod_cidrs.is_empty() && !(p.views.is_empty() && p.transit_views.is_empty()) {
            problems.push(format!(
                "the peering with {:?} has IPv4 views, and the new configuration has no IPv4 pods (an IPv6-only \
                 site routes no IPv4); delete the peering first, or keep an IPv4 pod CIDR",
                p.site_id
            ));
        }
        if !new.wireguard_ports.contains(p.listen_port) {
            problems.push(format!(
                "the peering with {:?} listens on UDP {}, outside the new WireGuard ports {}",
                p.site_id, p.listen_port, new.wireguard_ports
            ));
        }
        for v in p.views.iter().chain(p.transit_views.iter().map(|t| &t.view)) {
            if let Some(b) = own.iter().find(|b| ipam::overlaps(*b, &v.local)) {
                problems.push(format!(
                    "the local view {} of peer {:?} overlaps {b} in the new configuration",
                    v.local, p.site_id
                ));
            }
        }
        // An export policy names the site's own CIDRs (rules naming a site
        // reached through this one, in transit, follow that site's view,
        // not the configuration).
        if let Some(crate::export::ExportPolicy::Rules(rules)) = &p.export {
            let own = crate::export::own(new);
            for r in rules
                .iter()
                .filter(|r| r.via.is_none() && !own.iter().any(|c| c.contains(&r.cidr)))
            {
                problems.push(format!(
                    "the export policy for {:?} allows {}, outside the new workload and external CIDRs \
                     (change it first: `weftctl peering policy set {}`)",
                    p.site_id, r.cidr, p.site_id
                ));
            }
        }
    }
    // Published names: a workload's address stays in the pod CIDRs, an
    // export's host stays off them and weft's links, and its address in
    // the external CIDR.
    let peerings: Vec<&Peering> = snap.peerings.iter().map(|(p, _)| p).collect();
    for (n, _) in &snap.names {
        let checked = match n.address {
            Some(a) => crate::names::check_own_address(new, &peerings, n.kind, a),
            // Peers take a name without an IPv4 address only from a site
            // without IPv4 pods.
            None if !new.pod_cidrs.is_empty() => Err(
                "it has no IPv4 address, and the new configuration has IPv4 pods; delete it and add it again \
                 with the workload's IPv4 address (--address-v6 for its IPv6 one)"
                    .to_string(),
            ),
            // An IPv6-only workload: its IPv6 address stays in the pods.
            None => n
                .address_v6
                .map_or(Ok(()), |a| crate::names::check_own_address_v6(new, a)),
        };
        if let Err(m) = checked {
            problems.push(format!("name {:?}: {m}", n.name));
        }
        if let Some(x) = n.external.filter(|x| !new.external_cidr.contains(x)) {
            problems.push(format!(
                "name {:?} is exported at {x}, outside the new external CIDR {}",
                n.name, new.external_cidr
            ));
        }
    }
    if problems.len() > 10 {
        let more = problems.len() - 10;
        problems.truncate(10);
        problems.push(format!("and {more} more"));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Error::FailedPrecondition(format!(
            "the configuration changed in a way the stored state does not allow: {}; \
             restore the old values, or remove those nodes, peerings or names first",
            problems.join("; ")
        )))
    }
}
