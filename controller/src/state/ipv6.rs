//! A peering's IPv6 part: this site's local views of the peer's IPv6
//! CIDRs, planned beside the IPv4 ones. What goes wrong here leaves IPv6
//! not negotiated, with the reason (`Peering::ipv6_refused`), and the rest
//! of the peering as it is: an IPv4 site, an older peer or an exhausted
//! IPv6 pool never costs a peering its IPv4.

use ipnet::Ipv6Net;

use super::Snapshot;
use crate::domain::{Peering, PendingV6, RemoteSite, Site, UnderlayOverlap, now_ms};
use crate::ipam::{self, CidrKind, View};

/// The peer's IPv6 CIDRs with their kinds.
fn offered(remote: &RemoteSite) -> Vec<(CidrKind, Ipv6Net)> {
    let mut peer: Vec<(CidrKind, Ipv6Net)> = remote
        .workload_cidrs_v6
        .iter()
        .map(|c| (CidrKind::Workload, *c))
        .collect();
    peer.extend(remote.external_cidr_v6.map(|c| (CidrKind::External, c)));
    peer
}

/// This site's IPv6 addresses of its hosts: a view over one would pull its
/// own control traffic into a peering.
fn host_addresses(snap: &Snapshot, v6: &crate::domain::Ipv6Networks) -> Vec<(std::net::Ipv6Addr, String)> {
    let hosts = snap.underlay_addresses().into_iter().filter_map(|(ip, who)| match ip {
        std::net::IpAddr::V6(a) => Some((a, who)),
        std::net::IpAddr::V4(_) => None,
    });
    let controllers = v6.controller_ips.iter().map(|a| (*a, "a controller".to_string()));
    hosts.chain(controllers).collect()
}

/// What [`plan`] decided for a peering's IPv6.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Planned {
    /// The views (empty: IPv6 not negotiated).
    pub views: Vec<View<Ipv6Net>>,
    /// Why not, when something was refused.
    pub refused: Option<String>,
    /// The peer's IPv6 CIDRs to record: what it sent, or, when it sent a
    /// change this site does not take, what was recorded before (so the
    /// refusal holds on every later update, not just this one).
    pub recorded: (Vec<Ipv6Net>, Option<Ipv6Net>),
    /// The peer's IPv6 CIDRs held for review (`weftctl peering accept`).
    pub held: Option<PendingV6>,
}

/// The views of the peer's IPv6 CIDRs in `remote` for the peering with
/// `peer_site` (`before`: as recorded, when it is), or why there are none.
/// Once the peering exists, the peer's IPv6 CIDRs other than those recorded
/// (a change, or IPv6 added later) are taken only within
/// `peer_cidr_auto_accept`; otherwise they are held for review, as IPv4
/// changes are: the views of what was agreed before stay routed (none when
/// IPv6 comes later: then IPv6 is off, saying so) until an admin accepts
/// them ([`accept`]).
pub(super) fn plan(
    snap: &Snapshot,
    site: &Site,
    peer_site: &str,
    remote: &RemoteSite,
    before: Option<&Peering>,
) -> Planned {
    let old = before.and_then(|p| p.remote.as_ref());
    let old_recorded = old.map_or_else(Default::default, |o| (o.workload_cidrs_v6.clone(), o.external_cidr_v6));
    if let Some(bad) = &remote.ipv6_invalid {
        return Planned {
            views: vec![],
            refused: Some(format!("{peer_site} sent IPv6 parameters this site refuses: {bad}")),
            recorded: old_recorded,
            held: None,
        };
    }
    let peer = offered(remote);
    let v6 = site.ipv6.as_ref();
    if let Some(old) = old {
        let known = offered(old);
        let auto: &[Ipv6Net] = v6.map_or(&[], |v| &v.peer_cidr_auto_accept);
        let new: Vec<String> = peer
            .iter()
            .filter(|x| !known.contains(x))
            .map(|(_, c)| *c)
            .filter(|c| !auto.iter().any(|b| b.contains(c)))
            .map(|c| c.to_string())
            .collect();
        if !new.is_empty() {
            // A site without IPv6 plans nothing either way; it keeps the
            // record as agreed, and says only that it has no IPv6.
            if v6.is_none() {
                return Planned {
                    views: vec![],
                    refused: None,
                    recorded: old_recorded,
                    held: None,
                };
            }
            let offered = (remote.workload_cidrs_v6.clone(), remote.external_cidr_v6);
            let since = before
                .and_then(|p| p.pending_v6.as_ref())
                .filter(|q| (&q.workload_cidrs_v6, q.external_cidr_v6) == (&offered.0, offered.1))
                .map_or_else(now_ms, |q| q.received_at_ms);
            // What was agreed stays routed.
            let kept: Vec<View<Ipv6Net>> = before
                .filter(|p| p.ipv6_refused.is_none())
                .map_or_else(Vec::new, |p| p.views_v6.clone());
            let refused = kept.is_empty().then(|| {
                format!(
                    "{peer_site} announced IPv6 CIDRs {} after the peering was made, outside peer_cidr_auto_accept; \
                     held for review: route them with `weftctl peering accept {peer_site}`",
                    new.join(", ")
                )
            });
            return Planned {
                views: kept,
                refused,
                recorded: old_recorded,
                held: Some(PendingV6 {
                    workload_cidrs_v6: offered.0,
                    external_cidr_v6: offered.1,
                    received_at_ms: since,
                }),
            };
        }
    }
    let recorded = (remote.workload_cidrs_v6.clone(), remote.external_cidr_v6);
    let Some(v6) = v6.filter(|_| !peer.is_empty()) else {
        // Nothing to plan; `Peering::ipv6_status` says why.
        return Planned {
            views: vec![],
            refused: None,
            recorded,
            held: None,
        };
    };
    let kept: &[View<Ipv6Net>] = before.map_or(&[], |p| &p.views_v6);
    let (views, refused) = match check_and_plan(snap, site, v6, peer_site, &peer, kept) {
        Ok(views) => (views, None),
        Err(why) => (vec![], Some(why)),
    };
    Planned {
        views,
        refused,
        recorded,
        held: None,
    }
}

/// Accepting the IPv6 CIDRs held on peering `p` (see [`plan`]): the peer's
/// record with them, and the views of them; why not when they cannot be
/// taken (a CIDR over this site's hosts, an exhausted pool).
pub(super) fn accept(
    snap: &Snapshot,
    site: &Site,
    p: &Peering,
    held: &PendingV6,
) -> Result<(RemoteSite, Vec<View<Ipv6Net>>), String> {
    let Some(v6) = site.ipv6.as_ref() else {
        return Err("this site has no IPv6 CIDRs; add an IPv6 pod CIDR first".into());
    };
    let mut remote = p.remote.clone().ok_or("the peering has no record of the peer")?;
    remote.workload_cidrs_v6 = held.workload_cidrs_v6.clone();
    remote.external_cidr_v6 = held.external_cidr_v6;
    let kept: &[View<Ipv6Net>] = if p.ipv6_refused.is_none() { &p.views_v6 } else { &[] };
    let views = check_and_plan(snap, site, v6, &p.site_id, &offered(&remote), kept)?;
    Ok((remote, views))
}

fn check_and_plan(
    snap: &Snapshot,
    site: &Site,
    v6: &crate::domain::Ipv6Networks,
    peer_site: &str,
    peer: &[(CidrKind, Ipv6Net)],
    kept: &[View<Ipv6Net>],
) -> Result<Vec<View<Ipv6Net>>, String> {
    let field = |kind: CidrKind, c: &Ipv6Net| match kind {
        CidrKind::Workload => {
            let i = peer.iter().position(|(_, x)| x == c).unwrap_or_default();
            format!("workload_cidrs_v6[{i}]")
        }
        CidrKind::External => "external_cidr_v6".to_string(),
    };
    for (kind, c) in peer {
        ipam::check_claimable(*kind, c)
            .and_then(|()| ipam::check_private(*kind, c, &v6.peer_public_cidrs))
            .map_err(|e| format!("{}: {e}", field(*kind, c)))?;
    }
    let hosts = host_addresses(snap, v6);
    if site.underlay_overlap == UnderlayOverlap::Refuse {
        for (kind, c) in peer {
            if let Some((ip, who)) = hosts.iter().find(|(ip, _)| c.contains(ip)) {
                return Err(format!(
                    "{}: {c} covers {ip}, the address of this site's {who}; ask {peer_site} to announce a CIDR \
                     without it, or run this site with --peer-cidr-over-underlay remap",
                    field(*kind, c)
                ));
            }
        }
    }
    let mut in_use = v6.own_blocks();
    in_use.extend(hosts.iter().map(|(a, _)| Ipv6Net::from(*a)));
    for (p, _) in &snap.peerings {
        if p.site_id != peer_site {
            in_use.extend(p.views_v6.iter().map(|v| v.local));
        }
        // Transit paths keep their blocks (IPv6 has no move of them).
        in_use.extend(p.transit_views_v6.iter().map(|t| t.view.local));
    }
    ipam::plan_views_keeping(peer, &in_use, &v6.remap_pools, &v6.peer_public_cidrs, kept, false)
        .map_err(|e| e.to_string())
}

/// This site's IPv6 views of the sites it reaches through peer `p`
/// (transit), planned from the IPv6 CIDRs of `remote`'s transit routes
/// while both ends agree to transit and the peering carries IPv6: each
/// mapped into a block of the site's IPv6 remap pools, never at the
/// value the hub offers, kept while the offer stays the same. A route
/// that cannot be planned (over the hub's own CIDRs, an exhausted pool)
/// is left out and logged, the rest planned.
pub(super) fn plan_transit(
    snap: &Snapshot,
    site: &Site,
    p: &Peering,
    remote: &RemoteSite,
) -> Vec<crate::domain::TransitView<Ipv6Net>> {
    let Some(v6) = site.ipv6.as_ref() else { return vec![] };
    if !(p.transit && remote.transit && weft_core::transit::carries_v6(p)) {
        return vec![];
    }
    let mut used = v6.own_blocks();
    used.extend(host_addresses(snap, v6).iter().map(|(a, _)| Ipv6Net::from(*a)));
    for (q, _) in &snap.peerings {
        used.extend(q.views_v6.iter().map(|v| v.local));
        if q.site_id != p.site_id {
            used.extend(q.transit_views_v6.iter().map(|t| t.view.local));
        }
    }
    used.extend(p.views_v6.iter().map(|v| v.local));
    let from = super::views::TransitFrom {
        peer: &p.site_id,
        own: &p.views_v6,
        pools: &v6.remap_pools,
        public: &v6.peer_public_cidrs,
        family: " over IPv6",
    };
    let mut planned: Vec<crate::domain::TransitView<Ipv6Net>> = Vec::new();
    for route in &remote.transit_routes {
        let offered = weft_core::transit::cidrs_v6(route);
        if offered.is_empty() {
            continue;
        }
        let mut in_use = used.clone();
        in_use.extend(planned.iter().map(|t| t.view.local));
        planned.extend(super::views::plan_route(
            &from,
            &route.site,
            &offered,
            &in_use,
            &p.transit_views_v6,
        ));
    }
    planned
}

/// A new unique local /40 for IPv6 views, off the site's own IPv6 blocks.
pub(super) fn generated_pool(own: &[Ipv6Net]) -> Result<Ipv6Net, crate::error::Error> {
    use ring::rand::SecureRandom;
    let rng = ring::rand::SystemRandom::new();
    for _ in 0..16 {
        let mut random = [0u8; 4];
        rng.fill(&mut random)
            .map_err(|_| crate::error::Error::Unavailable("the system RNG failed; retry".into()))?;
        if let Some(pool) = ipam::ula_pool(random, own) {
            tracing::info!(%pool, "generated the IPv6 remap pool (unique local, RFC 4193); it is kept in the store");
            return Ok(pool);
        }
    }
    Err(crate::error::Error::ResourceExhausted(
        "could not draw an IPv6 remap pool off the site's own networks; give one with --remap-pool".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(s: &str) -> Ipv6Net {
        s.parse().unwrap()
    }

    fn remote(workload: &[&str]) -> RemoteSite {
        serde_json::from_value(serde_json::json!({
            "ca_pem": "", "ca_fingerprint": "", "workload_cidrs": ["10.2.0.0/16"], "external_cidr": null,
            "workload_cidrs_v6": workload, "gateways": [], "mtu": 0, "endpoints": [], "tunnel_role": "server",
        }))
        .unwrap()
    }

    fn site(pods: &[&str]) -> Site {
        let args = crate::config::ControllerArgs {
            site_id: Some("a".into()),
            pod_cidrs: pods.iter().map(|p| p.to_string()).collect(),
            remap_pools: ["10.200.0.0/13", "fd9a:2b3c:4d00::/40"]
                .into_iter()
                .filter(|p| pods.iter().any(|c| c.contains(':')) || !p.contains(':'))
                .map(String::from)
                .collect(),
            ..Default::default()
        };
        crate::config::resolve(&args, Default::default()).unwrap().site
    }

    fn dual_site() -> Site {
        site(&["10.1.0.0/16", "fd00:1::/48"])
    }

    /// The peering as recorded after `p` was planned for `remote`.
    fn recorded(p: &Planned, remote: &RemoteSite) -> Peering {
        let mut before: Peering = serde_json::from_value(serde_json::json!({
            "site_id": "b", "state": "negotiated", "views": [], "created_at_ms": 0,
        }))
        .unwrap();
        let mut remote = remote.clone();
        (remote.workload_cidrs_v6, remote.external_cidr_v6) = p.recorded.clone();
        before.remote = Some(remote);
        before.views_v6 = p.views.clone();
        before.ipv6_refused = p.refused.clone();
        before.pending_v6 = p.held.clone();
        before
    }

    #[test]
    fn the_same_ula_is_remapped_and_a_free_one_kept() {
        let snap = Snapshot::default();
        let p = plan(&snap, &dual_site(), "b", &remote(&["fd00:1::/48"]), None);
        assert_eq!(p.refused, None);
        assert_eq!(p.views[0].local, n("fd9a:2b3c:4d00::/48"));
        let p = plan(&snap, &dual_site(), "b", &remote(&["fd00:2::/48"]), None);
        assert!(!p.views[0].remapped());
    }

    #[test]
    fn a_peer_cidr_over_this_sites_own_is_remapped_or_refused() {
        let snap = Snapshot::default();
        // fd00:1::/32 holds this site's fd00:1::/48: a /32 cannot be
        // remapped into the /40 pool.
        let p = plan(&snap, &dual_site(), "b", &remote(&["fd00:1::/32"]), None);
        assert!(p.views.is_empty(), "{p:?}");
        assert!(p.refused.as_deref().is_some_and(|w| w.contains("no free /32")), "{p:?}");
        // fd00::/32 does not (its second group is 0, not 1): taken as is.
        let p = plan(&snap, &dual_site(), "b", &remote(&["fd00::/32"]), None);
        assert!(!p.views[0].remapped(), "{p:?}");
    }

    #[test]
    fn an_ipv4_site_or_an_ipv4_peer_plans_nothing_and_a_bad_cidr_says_why() {
        let snap = Snapshot::default();
        let v4 = site(&["10.1.0.0/16"]);
        let p = plan(&snap, &v4, "b", &remote(&["fd00:1::/48"]), None);
        assert_eq!((p.views, p.refused), (vec![], None));
        let p = plan(&snap, &dual_site(), "b", &remote(&[]), None);
        assert_eq!((p.views, p.refused), (vec![], None));
        let p = plan(&snap, &dual_site(), "b", &remote(&["fe80::/64"]), None);
        assert!(p.views.is_empty());
        let why = p.refused.unwrap();
        assert!(
            why.starts_with("workload_cidrs_v6[0]:") && why.contains("fe80::/10"),
            "{why}"
        );
        let p = plan(&snap, &dual_site(), "b", &remote(&["2001:db8::/48"]), None);
        assert!(p.refused.unwrap().contains("not private address space"));
        let mut bad = remote(&[]);
        bad.ipv6_invalid = Some("workload_cidrs_v6[0]: \"x\" is not a CIDR".into());
        let p = plan(&snap, &dual_site(), "b", &bad, None);
        let why = p.refused.unwrap();
        assert!(
            why.contains("b sent IPv6 parameters this site refuses: workload_cidrs_v6[0]"),
            "{why}"
        );
    }

    #[test]
    fn a_change_or_a_late_ipv6_outside_auto_accept_is_held_for_review_on_every_update() {
        let snap = Snapshot::default();
        let site = dual_site();
        let first = remote(&["fd00:2::/48"]);
        let p = plan(&snap, &site, "b", &first, None);
        let before = recorded(&p, &first);
        // The same CIDRs again: the same views, nothing held.
        let again = plan(&snap, &site, "b", &first, Some(&before));
        assert_eq!((&again.views, &again.refused, &again.held), (&p.views, &None, &None));
        // Another CIDR: held, and what was agreed stays routed; the record
        // keeps what was agreed, so the next update (the same params
        // again) is held again, since the same time.
        let changed = remote(&["fd00:3::/48"]);
        let p2 = plan(&snap, &site, "b", &changed, Some(&before));
        assert_eq!((&p2.views, &p2.refused), (&p.views, &None));
        let held = p2.held.clone().unwrap();
        assert_eq!(held.workload_cidrs_v6, vec![n("fd00:3::/48")]);
        assert_eq!(p2.recorded.0, vec![n("fd00:2::/48")]);
        let after = recorded(&p2, &changed);
        let p3 = plan(&snap, &site, "b", &changed, Some(&after));
        assert_eq!(p3.held.unwrap().received_at_ms, held.received_at_ms);
        assert_eq!(p3.views, p.views);
        // Accepted: the views of the new CIDRs.
        let (remote_now, views) = accept(&snap, &site, &after, &held).unwrap();
        assert_eq!(remote_now.workload_cidrs_v6, vec![n("fd00:3::/48")]);
        assert_eq!(views[0].real, n("fd00:3::/48"));
        // IPv6 first offered on a peering made without it: held, and off
        // until accepted, saying how to take it.
        let v4_only = remote(&[]);
        let made = recorded(&plan(&snap, &site, "b", &v4_only, None), &v4_only);
        let late = plan(&snap, &site, "b", &first, Some(&made));
        assert!(late.views.is_empty(), "{late:?}");
        let why = late.refused.clone().unwrap();
        assert!(
            why.contains("held for review") && why.contains("weftctl peering accept b"),
            "{why}"
        );
        let (_, views) = accept(&snap, &site, &recorded(&late, &first), late.held.as_ref().unwrap()).unwrap();
        assert_eq!(views[0].real, n("fd00:2::/48"));
        // A site without IPv6 holds nothing: it has nothing to route them to.
        let v4 = self::site(&["10.1.0.0/16"]);
        let none = plan(&snap, &v4, "b", &first, Some(&made));
        assert_eq!((none.held, none.refused), (None, None));
        assert!(accept(&snap, &v4, &made, &held).unwrap_err().contains("no IPv6 CIDRs"));
        // Within peer_cidr_auto_accept: taken at once.
        let mut open = site.clone();
        open.ipv6.as_mut().unwrap().peer_cidr_auto_accept = vec![n("fd00::/16")];
        let ok = plan(&snap, &open, "b", &changed, Some(&before));
        assert_eq!((&ok.refused, &ok.held), (&None, &None));
        assert_eq!(ok.views[0].real, n("fd00:3::/48"));
    }

    #[test]
    fn ipv6_transit_views_come_from_the_pool_are_kept_and_never_at_the_hubs_values() {
        let snap = Snapshot::default();
        let site = dual_site();
        let mut hub = remote(&["fd00:1::/48"]);
        hub.transit = true;
        hub.transit_routes = vec![crate::domain::TransitRoute {
            site: "c".into(),
            workload_cidrs: vec!["10.9.0.0/16".parse().unwrap()],
            workload_cidrs_v6: vec![n("fd77::/48")],
            ..Default::default()
        }];
        let planned = plan(&snap, &site, "b", &hub, None);
        let mut p = recorded(&planned, &hub);
        p.transit = true;
        let views = plan_transit(&snap, &site, &p, &hub);
        assert_eq!(views.len(), 1, "{views:?}");
        let t = &views[0];
        assert_eq!((t.site.as_str(), t.view.real), ("c", n("fd77::/48")));
        let pool = n("fd9a:2b3c:4d00::/40");
        assert!(pool.contains(&t.view.local), "{t:?}: not from the pool");
        assert!(t.view.local != p.views_v6[0].local, "a block of its own");
        // Planned again: the same block.
        p.transit_views_v6 = views.clone();
        assert_eq!(plan_transit(&snap, &site, &p, &hub), views);
        // Not agreed here, or IPv6 refused on the hop: none.
        let mut off = p.clone();
        off.transit = false;
        assert!(plan_transit(&snap, &site, &off, &hub).is_empty());
        let mut refused = p.clone();
        refused.ipv6_refused = Some("held".into());
        assert!(plan_transit(&snap, &site, &refused, &hub).is_empty());
        // An offer over the hub's own IPv6 CIDR is left out.
        let mut over = hub.clone();
        over.transit_routes[0].workload_cidrs_v6 = vec![n("fd00:1::/48")];
        assert!(plan_transit(&snap, &site, &p, &over).is_empty());
        // An IPv4-only site plans none.
        let v4 = site_v4();
        assert!(plan_transit(&snap, &v4, &p, &hub).is_empty());
    }

    fn site_v4() -> Site {
        site(&["10.1.0.0/16"])
    }
}
