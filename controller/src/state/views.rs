//! This site's views of a peer's CIDRs: planned at negotiation, on the
//! peer's updates and on review (IPv4; IPv6's are `ipv6`), and of the
//! sites reached through it (transit), with the checks that keep a peer
//! off this site's own hosts.

use ipnet::Ipv4Net;

use super::State;
use crate::domain::{Peering, RemoteSite};
use crate::error::Error;
use crate::ipam::{self, CidrKind};
use crate::store::{Compare, Op, Txn};

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
        check_candidates(&snap.endpoint_hosts(site), remote)?;
        let hosts = snap.host_addresses(site);
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
    /// agree to transit. Each site's views keep the blocks of its old
    /// transit views through `p`, but never a block of a direct peering's
    /// views (nor one in `avoid`): the hub only says which site it offers,
    /// so addresses that meant a directly peered site never come to mean
    /// whatever a hub calls by that site's id. An offer that cannot be
    /// planned (an exhausted pool, a public CIDR this site does not take)
    /// is left out and logged, the rest planned.
    pub(super) fn plan_transit(
        snap: &super::Snapshot,
        site: &crate::domain::Site,
        p: &Peering,
        remote: &RemoteSite,
        avoid: &[Ipv4Net],
    ) -> Vec<crate::domain::TransitView> {
        // (Transit is IPv4: an IPv6-only site takes none.)
        if !(p.transit && remote.transit) || site.pod_cidrs.is_empty() {
            return vec![];
        }
        let from = TransitFrom {
            peer: &p.site_id,
            own: &p.views,
            pools: &site.remap_pools,
            public: &site.peer_public_cidrs,
            family: "",
        };
        let mut planned: Vec<crate::domain::TransitView> = Vec::new();
        for route in &remote.transit_routes {
            // In use for this plan: everything but this peering's own
            // views (re-planned here, its direct ones added as they will
            // be). A direct peering's views of the same site stay in use
            // (never kept: the block of the site this site peers with is
            // not the hub's to name), and so does another hub's view of
            // it: two paths never share a block.
            let mut used = snap.blocks_in_use_but(site, |holder, _| holder != p.site_id);
            used.extend(p.views.iter().map(|v| v.local));
            used.extend(planned.iter().map(|t| t.view.local));
            used.extend(avoid.iter().copied());
            let offered = crate::transit::cidrs(route);
            planned.extend(plan_route(&from, &route.site, &offered, &used, &p.transit_views));
        }
        planned
    }
}

/// What one family's transit views through peer `peer` are planned
/// from: the peer's own views of that family (an offer over one of their
/// real CIDRs is refused), the site's remap pools and the public CIDRs it
/// takes; `family` names it in the log (" over IPv6", or "").
pub(super) struct TransitFrom<'a, N: ipam::Prefix> {
    pub peer: &'a str,
    pub own: &'a [ipam::View<N>],
    pub pools: &'a [N],
    pub public: &'a [N],
    pub family: &'static str,
}

/// The views of transit route `site`'s `offered` CIDRs through
/// `from.peer`, in blocks free of `used`, keeping those of `kept` (the
/// peering's transit views) of that site: none (logged) when an offered
/// CIDR is over one of the peer's own, or the plan fails (an exhausted
/// pool, a public CIDR this site does not take).
pub(super) fn plan_route<N: ipam::Prefix>(
    from: &TransitFrom<'_, N>,
    site: &str,
    offered: &[(CidrKind, N)],
    used: &[N],
    kept: &[crate::domain::TransitView<N>],
) -> Vec<crate::domain::TransitView<N>> {
    let TransitFrom {
        peer,
        own,
        pools,
        public,
        family,
    } = from;
    // Not over what this site routes to the hub itself (its recorded
    // CIDRs, also while a change of them is held).
    if let Some(v) = own
        .iter()
        .find(|v| offered.iter().any(|(_, c)| ipam::overlaps(c, &v.real)))
    {
        tracing::warn!(
            %peer,
            %site,
            "not reaching site {site:?} through {peer:?}{family}: it offers a CIDR over its own {}",
            v.real
        );
        return vec![];
    }
    let keep: Vec<ipam::View<N>> = kept.iter().filter(|t| t.site == site).map(|t| t.view.clone()).collect();
    match ipam::plan_views_keeping(offered, used, pools, public, &keep, true) {
        Ok(views) => views
            .into_iter()
            .map(|view| crate::domain::TransitView {
                site: site.to_string(),
                view,
            })
            .collect(),
        Err(e) => {
            tracing::warn!(%peer, %site, "not reaching site {site:?} through {peer:?}{family}: {e}");
            vec![]
        }
    }
}

impl State {
    /// The other peerings whose transit views of `target` hold a block of
    /// this site's direct views of it, `old` (replaced, or deleted) or
    /// `new` (about to be written), each re-planned off those blocks (the
    /// direct peering took the transit view's block, or the transit view
    /// was planned before this rule), with the revision it was read at.
    /// `taken`: other blocks the same transaction writes (the new
    /// peering's own transit views). A direct peering's block is thus
    /// released with it, never handed to a transit path that a hub names
    /// after the same site.
    pub(super) fn transit_off_direct(
        snap: &super::Snapshot,
        site: &crate::domain::Site,
        target: &str,
        old: &[crate::ipam::View],
        new: &[crate::ipam::View],
        taken: &[Ipv4Net],
    ) -> Vec<(Peering, crate::store::Revision)> {
        let direct: Vec<Ipv4Net> = old.iter().chain(new).map(|v| v.local).collect();
        let mut avoid: Vec<Ipv4Net> = direct.iter().chain(taken).copied().collect();
        let mut out = Vec::new();
        for (q, rev) in &snap.peerings {
            let holds = |t: &crate::domain::TransitView| {
                t.site == target && direct.iter().any(|d| ipam::overlaps(d, &t.view.local))
            };
            if q.site_id == target || !q.transit_views.iter().any(holds) {
                continue;
            }
            let mut next = q.clone();
            next.transit_views = match &q.remote {
                Some(r) => Self::plan_transit(snap, site, q, r, &avoid),
                None => vec![],
            };
            if next == *q {
                continue;
            }
            // Two re-planned paths never take the same block.
            avoid.extend(next.transit_views.iter().map(|t| t.view.local));
            tracing::info!(
                peer = %q.site_id,
                site = %target,
                "the view of site {target:?} through {:?} moves off the direct peering's block",
                q.site_id
            );
            out.push((next, *rev));
        }
        out
    }

    /// `txn` with each of `replanned` (read at its revision) written.
    pub(super) fn put_peerings(&self, mut txn: Txn, replanned: Vec<(Peering, crate::store::Revision)>) -> Txn {
        for (q, rev) in replanned {
            let key = self.at(super::Key::Peering(&q.site_id));
            txn = txn
                .when(Compare::ModRevision(key.clone(), rev))
                .then(Op::put(key, super::encode(&q)));
        }
        txn
    }
}

/// A peer must not point this site's gateways at this site's own hosts:
/// each of its gateways' endpoint and candidates checked against `hosts`,
/// naming the field (loopback and the rest were refused on receipt).
pub(super) fn check_candidates(hosts: &[(std::net::IpAddr, String)], remote: &RemoteSite) -> Result<(), Error> {
    for (i, g) in remote.gateways.iter().enumerate() {
        // Its endpoint too: this site's gateways send handshakes there.
        if let Some(e) = g.endpoint {
            weft_core::nat::endpoint(&format!("gateways[{i}].endpoint"), e, hosts, false)
                .map_err(Error::InvalidArgument)?;
        }
        let listed: Vec<weft_proto::v1::Candidate> = g.candidates.iter().map(|c| c.to_pb()).collect();
        let (v4, v6) = weft_core::nat::by_family(&listed);
        weft_core::nat::both_families(&format!("gateways[{i}].candidates"), &v4, &v6, hosts)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Site, TransitRoute, TransitView};
    use crate::ipam::View;
    use crate::state::Snapshot;

    fn n(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    /// Site "a" on 10.1.0.0/16, remapping into 10.200.0.0/13.
    fn site() -> Site {
        let args = crate::config::ControllerArgs {
            site_id: Some("a".into()),
            pod_cidrs: vec!["10.1.0.0/16".into()],
            remap_pools: vec!["10.200.0.0/13".into()],
            ..Default::default()
        };
        crate::config::resolve(&args, Default::default()).unwrap().site
    }

    fn remote(workload: &str, transit_routes: Vec<TransitRoute>) -> RemoteSite {
        let mut r: RemoteSite = serde_json::from_value(serde_json::json!({
            "ca_pem": "", "ca_fingerprint": "", "workload_cidrs": [workload], "external_cidr": null,
            "gateways": [], "mtu": 0, "endpoints": [], "tunnel_role": "server",
        }))
        .unwrap();
        r.transit = true;
        r.transit_routes = transit_routes;
        r
    }

    fn view(real: &str, local: &str) -> View {
        View {
            kind: CidrKind::Workload,
            real: n(real),
            local: n(local),
            pool: Some(n("10.200.0.0/13")),
        }
    }

    /// A peering with `site_id` (its workload 10.1.0.0/16, seen at
    /// `local`), transit agreed at both ends.
    fn peering(site_id: &str, local: &str, routes: Vec<TransitRoute>) -> Peering {
        let mut p: Peering = serde_json::from_value(serde_json::json!({
            "site_id": site_id, "state": "connected", "views": [], "created_at_ms": 0,
        }))
        .unwrap();
        p.views = vec![view("10.1.0.0/16", local)];
        p.remote = Some(remote("10.1.0.0/16", routes));
        p.transit = true;
        p
    }

    /// Hub "h" offers "c" (its view of c: 10.9.0.0/16).
    fn offer_c() -> Vec<TransitRoute> {
        vec![TransitRoute {
            site: "c".into(),
            workload_cidrs: vec![n("10.9.0.0/16")],
            ..Default::default()
        }]
    }

    fn transit_c(local: &str) -> Vec<TransitView> {
        vec![TransitView {
            site: "c".into(),
            view: view("10.9.0.0/16", local),
        }]
    }

    fn snap(peerings: Vec<Peering>) -> Snapshot {
        Snapshot {
            site: Some(site()),
            peerings: peerings.into_iter().zip(1..).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_transit_view_never_takes_a_direct_peerings_block() {
        let direct = peering("c", "10.200.0.0/16", vec![]);
        let hub = peering("h", "10.201.0.0/16", offer_c());
        let s = snap(vec![direct, hub.clone()]);
        let planned = State::plan_transit(&s, &site(), &hub, hub.remote.as_ref().unwrap(), &[]);
        assert_eq!(planned.len(), 1, "{planned:?}");
        assert_eq!(planned[0].site, "c");
        assert_ne!(
            planned[0].view.local,
            n("10.200.0.0/16"),
            "took the direct peering's block"
        );
        assert_ne!(planned[0].view.local, n("10.201.0.0/16"));
        // Its own old block it keeps, when no direct view holds it.
        let mut held = hub.clone();
        held.transit_views = transit_c("10.205.0.0/16");
        let s = snap(vec![peering("c", "10.200.0.0/16", vec![]), held.clone()]);
        let planned = State::plan_transit(&s, &site(), &held, held.remote.as_ref().unwrap(), &[]);
        assert_eq!(planned, transit_c("10.205.0.0/16"));
    }

    #[test]
    fn a_deleted_direct_peerings_block_is_released_not_handed_to_transit() {
        // The direct peering with c took the transit view's block (or the
        // transit view was planned with it before): both hold 10.200/16.
        let direct = peering("c", "10.200.0.0/16", vec![]);
        let mut hub = peering("h", "10.201.0.0/16", offer_c());
        hub.transit_views = transit_c("10.200.0.0/16");
        let s = snap(vec![direct.clone(), hub.clone()]);
        // c's peering deleted: h's view of "c" moves to a block of its own.
        let moved = State::transit_off_direct(&s, &site(), "c", &direct.views, &[], &[]);
        assert_eq!(moved.len(), 1, "{moved:?}");
        let (next, rev) = &moved[0];
        assert_eq!((next.site_id.as_str(), *rev), ("h", 2));
        assert_eq!(next.transit_views.len(), 1);
        let local = next.transit_views[0].view.local;
        assert!(
            ![n("10.200.0.0/16"), n("10.201.0.0/16")].contains(&local),
            "the transit view of c is at {local}"
        );
        assert_eq!(next.views, hub.views, "only the transit view moves");
        // Nothing else moves: a transit view of c on its own block, or a
        // transit view of another site.
        let mut own = hub.clone();
        own.transit_views = transit_c("10.205.0.0/16");
        let s = snap(vec![direct.clone(), own]);
        assert!(State::transit_off_direct(&s, &site(), "c", &direct.views, &[], &[]).is_empty());
        let s = snap(vec![direct.clone(), hub.clone()]);
        assert!(
            State::transit_off_direct(&s, &site(), "d", &[view("10.1.0.0/16", "10.200.0.0/16")], &[], &[]).is_empty()
        );
    }

    #[test]
    fn a_new_direct_peering_takes_the_transit_block_and_the_transit_view_moves() {
        let mut hub = peering("h", "10.201.0.0/16", offer_c());
        hub.transit_views = transit_c("10.200.0.0/16");
        let s = snap(vec![hub]);
        // c peers directly: its view keeps the transit view's block (the
        // traffic moves under the same addresses)...
        let views = s
            .site()
            .map(|site| {
                ipam::plan_views_keeping(
                    &[(CidrKind::Workload, n("10.1.0.0/16"))],
                    &s.blocks_in_use(site, Some("c")),
                    &site.remap_pools,
                    &[],
                    &s.views_of("c"),
                    false,
                )
                .unwrap()
            })
            .unwrap();
        assert_eq!(views[0].local, n("10.200.0.0/16"));
        // ... and the transit view leaves it in the same transaction, so
        // deleting the direct peering later hands the hub nothing.
        let moved = State::transit_off_direct(&s, &site(), "c", &[], &views, &[]);
        assert_eq!(moved.len(), 1, "{moved:?}");
        let first = moved[0].0.transit_views[0].view.local;
        assert_ne!(first, n("10.200.0.0/16"));
        // Not onto a block the same transaction writes (the new peering's
        // own transit views) either.
        let moved = State::transit_off_direct(&s, &site(), "c", &[], &views, &[first]);
        let local = moved[0].0.transit_views[0].view.local;
        assert!(![first, n("10.200.0.0/16")].contains(&local), "{local}");
    }

    #[test]
    fn two_paths_moved_at_once_take_two_blocks() {
        // c's direct views: 10.200/16 and 10.204/16, each shared with a
        // transit view of "c" (through h, through g).
        let mut direct = peering("c", "10.200.0.0/16", vec![]);
        direct.views.push(view("10.70.0.0/16", "10.204.0.0/16"));
        let mut h = peering("h", "10.201.0.0/16", offer_c());
        h.transit_views = transit_c("10.200.0.0/16");
        let mut g = peering("g", "10.202.0.0/16", offer_c());
        g.transit_views = transit_c("10.204.0.0/16");
        let s = snap(vec![direct.clone(), h, g]);
        let moved = State::transit_off_direct(&s, &site(), "c", &direct.views, &[], &[]);
        assert_eq!(moved.len(), 2, "{moved:?}");
        let blocks: Vec<Ipv4Net> = moved.iter().map(|(q, _)| q.transit_views[0].view.local).collect();
        assert_ne!(blocks[0], blocks[1]);
        for b in &blocks {
            assert!(
                !direct.views.iter().any(|v| ipam::overlaps(&v.local, b)),
                "{b} is a direct view's block"
            );
        }
    }
}
