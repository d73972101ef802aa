//! This site's views of a peer's CIDRs: planned at negotiation, on the
//! peer's updates and on review (IPv4; IPv6's are `ipv6`), and of the
//! sites reached through it (transit), with the checks that keep a peer
//! off this site's own hosts.

use ipnet::Ipv4Net;

use super::State;
use crate::domain::{Peering, RemoteSite};
use crate::error::Error;
use crate::ipam::{self, CidrKind};

impl State {
    /// This site's local views of `remote`'s CIDRs. A CIDR over one of this
    /// site's hosts is refused, naming the field and the host, unless the
    /// site routes such CIDRs through remapped views (`underlay_overlap`).
    pub(super) fn plan_peer_views(
        &self,
        snap: &super::Snapshot,
        site: &crate::domain::Site,
        peer_site: &str,
        remote: &RemoteSite,
    ) -> Result<Vec<crate::ipam::View>, Error> {
        // No IPv4 pods, nothing of IPv4 to reach from: no IPv4 views
        // (`Peering::ipv4_status` says why).
        if site.pod_cidrs.is_empty() {
            return Ok(vec![]);
        }
        let mut peer: Vec<(CidrKind, Ipv4Net)> =
            remote.workload_cidrs.iter().map(|c| (CidrKind::Workload, *c)).collect();
        if let Some(e) = remote.external_cidr {
            peer.push((CidrKind::External, e));
        }
        // Space no site can own, and public space the site does not allow:
        // refused naming the field (ipam::plan_views refuses them too, and
        // remaps an allowed public CIDR).
        for (i, c) in remote.workload_cidrs.iter().enumerate() {
            ipam::check_claimable(CidrKind::Workload, c)
                .and_then(|()| ipam::check_private(CidrKind::Workload, c, &site.peer_public_cidrs))
                .map_err(|e| Error::InvalidArgument(format!("workload_cidrs[{i}]: {e}")))?;
        }
        if let Some(c) = remote.external_cidr {
            ipam::check_claimable(CidrKind::External, &c)
                .and_then(|()| ipam::check_private(CidrKind::External, &c, &site.peer_public_cidrs))
                .map_err(|e| Error::InvalidArgument(format!("external_cidr: {e}")))?;
        }
        let hosts = snap.host_addresses(site);
        check_candidates(&hosts, remote)?;
        if site.underlay_overlap == crate::domain::UnderlayOverlap::Refuse {
            for (i, c) in remote.workload_cidrs.iter().enumerate() {
                if let Some((ip, who)) = hosts.iter().find(|(ip, _)| c.contains(ip)) {
                    return Err(over_host(&format!("workload_cidrs[{i}]"), c, ip, who, &site.id));
                }
            }
            if let Some(c) = remote.external_cidr
                && let Some((ip, who)) = hosts.iter().find(|(ip, _)| c.contains(ip))
            {
                return Err(over_host("external_cidr", &c, ip, who, &site.id));
            }
        }
        Ok(ipam::plan_views_keeping(
            &peer,
            &snap.blocks_in_use(site, Some(peer_site)),
            &site.remap_pools,
            &site.peer_public_cidrs,
            &snap.views_of(peer_site),
            false,
        )?)
    }

    /// This site's views of the sites peering `p` (as it will be written,
    /// with `remote`) offers to reach through it; none unless both ends
    /// agree to transit. Each site's views keep the blocks this site
    /// already uses for it (its old transit views, a direct peering's);
    /// an offer that cannot be planned (an exhausted pool, a public CIDR
    /// this site does not take) is left out and logged, the rest planned.
    pub(super) fn plan_transit(
        snap: &super::Snapshot,
        site: &crate::domain::Site,
        p: &Peering,
        remote: &RemoteSite,
    ) -> Vec<crate::domain::TransitView> {
        // (Transit is IPv4: an IPv6-only site takes none.)
        if !(p.transit && remote.transit) || site.pod_cidrs.is_empty() {
            return vec![];
        }
        let mut planned: Vec<crate::domain::TransitView> = Vec::new();
        for route in &remote.transit_routes {
            let offered = crate::transit::cidrs(route);
            // Not over what this site routes to the hub itself (its
            // recorded CIDRs, also while a change of them is held).
            if let Some(v) = p
                .views
                .iter()
                .find(|v| offered.iter().any(|(_, c)| ipam::overlaps(c, &v.real)))
            {
                tracing::warn!(
                    peer = %p.site_id,
                    site = %route.site,
                    "not reaching site {:?} through {:?}: it offers a CIDR over its own {}",
                    route.site,
                    p.site_id,
                    v.real
                );
                continue;
            }
            // In use for this plan: everything but this peering's own
            // views (re-planned here, its direct ones added as they will
            // be) and a direct peering's views of the same site (kept).
            // Another hub's view of the site stays in use: two paths never
            // share a block.
            let direct = |holder: &str, target: &str| holder == route.site && target == route.site;
            let mut used =
                snap.blocks_in_use_but(site, |holder, target| holder != p.site_id && !direct(holder, target));
            used.extend(p.views.iter().map(|v| v.local));
            used.extend(planned.iter().map(|t| t.view.local));
            let keep: Vec<crate::ipam::View> = p
                .transit_views
                .iter()
                .filter(|t| t.site == route.site)
                .map(|t| t.view.clone())
                .chain(
                    snap.peering(&route.site)
                        .ok()
                        .into_iter()
                        .flat_map(|(d, _)| d.views.clone()),
                )
                .collect();
            match ipam::plan_views_keeping(&offered, &used, &site.remap_pools, &site.peer_public_cidrs, &keep, true) {
                Ok(views) => planned.extend(views.into_iter().map(|view| crate::domain::TransitView {
                    site: route.site.clone(),
                    view,
                })),
                Err(e) => tracing::warn!(
                    peer = %p.site_id,
                    site = %route.site,
                    "not reaching site {:?} through {:?}: {e}",
                    route.site,
                    p.site_id
                ),
            }
        }
        planned
    }
}

/// A peer must not point this site's gateways at this site's own hosts:
/// each of its gateways' endpoint and candidates checked against `hosts`,
/// naming the field (loopback and the rest were refused on receipt).
pub(super) fn check_candidates(hosts: &[(std::net::Ipv4Addr, String)], remote: &RemoteSite) -> Result<(), Error> {
    for (i, g) in remote.gateways.iter().enumerate() {
        // Its endpoint too: this site's gateways send handshakes there.
        if let Some(e) = g.endpoint {
            weft_core::nat::endpoint(&format!("gateways[{i}].endpoint"), e, hosts, false)
                .map_err(Error::InvalidArgument)?;
        }
        let listed: Vec<weft_proto::v1::Candidate> = g.candidates.iter().map(|c| c.to_pb()).collect();
        weft_core::nat::candidates(&format!("gateways[{i}].candidates"), &listed, hosts)
            .map_err(Error::InvalidArgument)?;
    }
    // A relay's endpoint neither (it is sent this site's tunnel traffic).
    let grants: Vec<weft_proto::v1::RelayGrant> = remote
        .relays
        .iter()
        .map(|g| weft_proto::v1::RelayGrant {
            peer_site: g.peer_site.clone(),
            endpoint: g.endpoint.map(|e| e.to_string()).unwrap_or_default(),
            refused: String::new(),
        })
        .collect();
    weft_core::relay::grants(&grants, hosts).map_err(Error::InvalidArgument)?;
    Ok(())
}

fn over_host(field: &str, c: &Ipv4Net, ip: &std::net::Ipv4Addr, who: &str, site: &str) -> Error {
    Error::InvalidArgument(format!(
        "{field} {c} covers {ip}, the address of {who} of site {site:?}; a peer may not announce that site's own \
         hosts (if the CIDRs really overlap, that site can route them through a remapped view: \
         --peer-cidr-over-underlay remap)"
    ))
}

/// Two sites with no address family in common would peer for nothing: the
/// peer's offer refused, saying which family each has (or why its IPv6 was
/// refused).
pub(super) fn check_shared_family(
    site: &crate::domain::Site,
    peer_site: &str,
    remote: &RemoteSite,
) -> Result<(), Error> {
    let v4 = !site.pod_cidrs.is_empty() && !remote.workload_cidrs.is_empty();
    let v6 = site.ipv6.is_some() && !remote.workload_cidrs_v6.is_empty();
    if v4 || v6 {
        return Ok(());
    }
    if let Some(why) = &remote.ipv6_invalid {
        let other = match site.pod_cidrs.is_empty() {
            true => "this site has no IPv4 pods",
            false => "it offers no IPv4",
        };
        return Err(Error::InvalidArgument(format!(
            "site {peer_site:?} sent IPv6 parameters this site refuses, and {other}: {why}"
        )));
    }
    let (theirs, ours) = match site.pod_cidrs.is_empty() {
        true => ("IPv4", "IPv6"),
        false => ("IPv6", "IPv4"),
    };
    Err(Error::InvalidArgument(format!(
        "site {peer_site:?} offers only {theirs} workload CIDRs and this site has only {ours} ones: \
         the sites share no address family; add pod CIDRs of the other family to one of them"
    )))
}
