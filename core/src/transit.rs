//! Transit: a site (the hub) forwards between two of its peers, so that a
//! spoke reaches another spoke without a peering of its own.
//!
//! - **Agreed per hop.** Each end of a peering says whether it agrees to
//!   transit on it (`Peering::transit`, told as `NetworkParams.transit`);
//!   a hop is used only when both do ([`usable`]).
//! - **Offered by the hub, in its own views.** The hub tells each transit
//!   peer the other transit peers it reaches directly, by its local views
//!   of their CIDRs ([`offers`]). Inside a tunnel each end speaks its own
//!   addresses, so the hub's views are what the spoke's traffic carries.
//! - **Planned by the spoke.** The spoke maps each offered CIDR into a
//!   block of its own remap pools (never routing it at the value the hub
//!   offers), in the peering's namespace. Each spoke thus sees
//!   the other in its own view, and the hub's existing NAT does the rest:
//!   the spoke's real addresses become the hub's view of it on the way in,
//!   the hub's view of the other spoke becomes its real CIDR on the way
//!   out.
//! - **One hop, no loops.** The hub offers only sites it peers with
//!   directly, never one it reaches through transit itself; a spoke
//!   refuses an offer of itself or of the hub ([`check_routes`]).
//! - **Direct first.** A spoke with a direct peering to a site renders
//!   that peering, not the transit path ([`rendered`]), and keeps the same
//!   local view for both, so traffic moves between them unchanged.
//! - **Both families.** IPv6 goes the same way, where both hops carry it:
//!   the hub offers its IPv6 views of a peer to peers whose peering with
//!   it carries IPv6 too, and the spoke maps them into its IPv6 remap
//!   pools ([`offers`], [`onward_v6`], [`check_routes_v6`],
//!   [`rendered_v6`]).

use ipnet::{Ipv4Net, Ipv6Net};
use weft_proto::v1 as pb;

use crate::domain::{Peering, TransitRoute, TransitView, parse_cidr, validate_name};
use crate::ipam::{self, CidrKind};
pub use crate::relay::Peerings;

/// Most sites one peer offers to reach through it.
pub const MAX_ROUTES: usize = 64;

/// Most prefixes a tunnel filter forwards to one site, both families
/// together: what every agent takes (`weft_dataplane`'s
/// `MAX_TRANSIT_PREFIXES`; agents before IPv6 transit refuse more, and
/// with it the whole filter).
pub const MAX_FILTER_PREFIXES: usize = 33;

/// Both ends of `p` agree to transit (and it is not being deleted).
pub fn usable(p: &Peering) -> bool {
    p.transit && p.state != crate::domain::PeeringState::Deleting && p.remote.as_ref().is_some_and(|r| r.transit)
}

/// The sites this site lets peer `to` reach through it: every other peer
/// it reaches directly over a hop both ends agree to, by this site's views
/// of its CIDRs. Empty unless the hop to `to` is agreed.
pub fn offers(peerings: &Peerings, to: &str) -> Vec<pb::TransitRoute> {
    let Some(p) = peerings.get(to).filter(|p| usable(p)) else {
        return vec![];
    };
    // Each family where both hops carry it; a route of IPv6 CIDRs only to
    // a peer that says it takes one (earlier sites refuse it).
    let (v4, v6) = (!p.views.is_empty(), carries_v6(p));
    let v6_only_ok = p.remote.as_ref().is_some_and(|r| r.transit_v6);
    peerings
        .values()
        .filter(|q| q.site_id != to && usable(q))
        .map(|q| {
            let views4: &[crate::ipam::View] = if v4 { &q.views } else { &[] };
            let views6: &[crate::ipam::View<Ipv6Net>] = if v6 && carries_v6(q) { &q.views_v6 } else { &[] };
            pb::TransitRoute {
                site: q.site_id.clone(),
                workload_cidrs: of_kind(views4, CidrKind::Workload),
                external_cidr: of_kind(views4, CidrKind::External).pop().unwrap_or_default(),
                workload_cidrs_v6: of_kind(views6, CidrKind::Workload),
                external_cidr_v6: of_kind(views6, CidrKind::External).pop().unwrap_or_default(),
            }
        })
        .filter(|r| !r.workload_cidrs.is_empty() || (v6_only_ok && !r.workload_cidrs_v6.is_empty()))
        .take(MAX_ROUTES)
        .collect()
}

/// The local views of `views` of `kind`, as text.
fn of_kind<N: crate::ipam::Prefix>(views: &[crate::ipam::View<N>], kind: CidrKind) -> Vec<String> {
    views
        .iter()
        .filter(|v| v.kind == kind)
        .map(|v| v.local.to_string())
        .collect()
}

/// Peering `p` carries IPv6: its IPv6 views negotiated and not refused.
pub fn carries_v6(p: &Peering) -> bool {
    p.ipv6_refused.is_none() && !p.views_v6.is_empty()
}

/// On the hub: what peer `p` may reach onward through this site, by site
/// (this site's views of each other transit peer). Empty unless the hop
/// to `p` is agreed.
pub fn onward<'a>(peerings: impl IntoIterator<Item = &'a Peering>, p: &Peering) -> Vec<(String, Vec<Ipv4Net>)> {
    if !usable(p) {
        return vec![];
    }
    peerings
        .into_iter()
        .filter(|q| q.site_id != p.site_id && usable(q) && !q.views.is_empty())
        .take(MAX_ROUTES)
        .map(|q| (q.site_id.clone(), q.views.iter().map(|v| v.local).collect()))
        .collect()
}

/// [`onward`] in IPv6: this site's IPv6 views of each other transit peer
/// that peer `p` may reach, where both hops carry IPv6.
pub fn onward_v6<'a>(peerings: impl IntoIterator<Item = &'a Peering>, p: &Peering) -> Vec<(String, Vec<Ipv6Net>)> {
    if !usable(p) || !carries_v6(p) {
        return vec![];
    }
    peerings
        .into_iter()
        .filter(|q| q.site_id != p.site_id && usable(q) && carries_v6(q))
        .take(MAX_ROUTES)
        .map(|q| (q.site_id.clone(), q.views_v6.iter().map(|v| v.local).collect()))
        .collect()
}

/// The transit routes a peer's parameters offer, checked whole: only with
/// `transit`, at most [`MAX_ROUTES`], each a valid site id that is neither
/// this site (`own_site`) nor the sender (a loop), listed once, with CIDRs
/// a site could own that overlap neither the sender's own CIDRs nor each
/// other. Errors name the field.
pub fn check_routes(
    p: &pb::NetworkParams,
    own_site: &str,
    workload: &[Ipv4Net],
    external: Option<Ipv4Net>,
) -> Result<Vec<TransitRoute>, String> {
    if !p.transit && !p.transit_routes.is_empty() {
        return Err("transit_routes: listed without transit".into());
    }
    if p.transit_routes.len() > MAX_ROUTES {
        return Err(format!(
            "transit_routes: {} listed; a site offers at most {MAX_ROUTES}",
            p.transit_routes.len()
        ));
    }
    let own: Vec<Ipv4Net> = workload.iter().copied().chain(external).collect();
    let mut seen: Vec<(String, Ipv4Net)> = Vec::new();
    let mut out = Vec::with_capacity(p.transit_routes.len());
    for (i, r) in p.transit_routes.iter().enumerate() {
        let field = format!("transit_routes[{i}]");
        validate_name(&format!("{field}.site"), &r.site)?;
        if r.site == own_site || r.site == p.site_id {
            let who = if r.site == own_site {
                "this site"
            } else {
                "the sending site"
            };
            return Err(format!(
                "{field}.site: {:?} is {who}; a route to it through transit would be a transit loop",
                r.site
            ));
        }
        if out.iter().any(|o: &TransitRoute| o.site == r.site) {
            return Err(format!("{field}.site: {:?} is listed twice", r.site));
        }
        let none = r.workload_cidrs.is_empty() && r.workload_cidrs_v6.is_empty();
        if none || r.workload_cidrs.len() > ipam::MAX_PEER_CIDRS {
            return Err(format!(
                "{field}.workload_cidrs: {} listed; a site has 1 to {} workload CIDRs (in either family)",
                r.workload_cidrs.len(),
                ipam::MAX_PEER_CIDRS
            ));
        }
        if r.workload_cidrs.is_empty() && !r.external_cidr.trim().is_empty() {
            return Err(format!("{field}.external_cidr: given without any IPv4 workload CIDR"));
        }
        let mut cidrs = Vec::new();
        for (j, c) in r.workload_cidrs.iter().enumerate() {
            cidrs.push((format!("{field}.workload_cidrs[{j}]"), CidrKind::Workload, c));
        }
        if !r.external_cidr.trim().is_empty() {
            cidrs.push((format!("{field}.external_cidr"), CidrKind::External, &r.external_cidr));
        }
        let mut route = TransitRoute {
            site: r.site.clone(),
            ..Default::default()
        };
        for (f, kind, text) in cidrs {
            let c = parse_cidr(text).map_err(|m| format!("{f}: {m}"))?;
            offered_cidr(&f, kind, c, &own, &mut seen, &r.site)?;
            match kind {
                CidrKind::Workload => route.workload_cidrs.push(c),
                CidrKind::External => route.external_cidr = Some(c),
            }
        }
        out.push(route);
    }
    Ok(out)
}

/// Fills in the IPv6 CIDRs of `routes` (checked by [`check_routes`]) from
/// the peer's parameters `p`, checked as [`check_routes`] checks IPv4's:
/// at most [`ipam::MAX_PEER_CIDRS`] a route, each a CIDR a site could own
/// overlapping neither the sender's own IPv6 CIDRs (`workload`,
/// `external`) nor each other. An error costs the peering its IPv6 only
/// (the caller's to decide), and names the field.
pub fn check_routes_v6(
    p: &pb::NetworkParams,
    routes: &mut [TransitRoute],
    workload: &[Ipv6Net],
    external: Option<Ipv6Net>,
) -> Result<(), String> {
    let own: Vec<Ipv6Net> = workload.iter().copied().chain(external).collect();
    let mut seen: Vec<(String, Ipv6Net)> = Vec::new();
    for (i, (r, route)) in p.transit_routes.iter().zip(routes.iter_mut()).enumerate() {
        let field = format!("transit_routes[{i}]");
        if r.workload_cidrs_v6.len() > ipam::MAX_PEER_CIDRS {
            return Err(format!(
                "{field}.workload_cidrs_v6: {} listed; a site has at most {} workload CIDRs",
                r.workload_cidrs_v6.len(),
                ipam::MAX_PEER_CIDRS
            ));
        }
        if r.workload_cidrs_v6.is_empty() && !r.external_cidr_v6.trim().is_empty() {
            return Err(format!(
                "{field}.external_cidr_v6: given without any IPv6 workload CIDR"
            ));
        }
        let mut cidrs: Vec<(String, CidrKind, &String)> = r
            .workload_cidrs_v6
            .iter()
            .enumerate()
            .map(|(j, c)| (format!("{field}.workload_cidrs_v6[{j}]"), CidrKind::Workload, c))
            .collect();
        if !r.external_cidr_v6.trim().is_empty() {
            cidrs.push((
                format!("{field}.external_cidr_v6"),
                CidrKind::External,
                &r.external_cidr_v6,
            ));
        }
        for (f, kind, text) in cidrs {
            let c = weft_types::net::cidr(text)
                .map_err(|m| format!("{f}: {m}"))?
                .v6()
                .ok_or_else(|| format!("{f}: {text} is IPv4; IPv4 CIDRs go in the IPv4 fields"))?;
            offered_cidr(&f, kind, c, &own, &mut seen, &r.site)?;
            match kind {
                CidrKind::Workload => route.workload_cidrs_v6.push(c),
                CidrKind::External => route.external_cidr_v6 = Some(c),
            }
        }
    }
    Ok(())
}

/// The IPv6 CIDRs of `route`, by kind.
pub fn cidrs_v6(route: &TransitRoute) -> Vec<(CidrKind, Ipv6Net)> {
    let mut v: Vec<(CidrKind, Ipv6Net)> = route
        .workload_cidrs_v6
        .iter()
        .map(|c| (CidrKind::Workload, *c))
        .collect();
    v.extend(route.external_cidr_v6.map(|c| (CidrKind::External, c)));
    v
}

/// Checks CIDR `c` (of `kind`, field `f`) that a peer offers for `site`:
/// one a site could own, over none of the sender's own (`own`) nor of those
/// offered before it (`seen`, which it joins).
fn offered_cidr<N: ipam::Prefix>(
    f: &str,
    kind: CidrKind,
    c: N,
    own: &[N],
    seen: &mut Vec<(String, N)>,
    site: &str,
) -> Result<(), String> {
    ipam::check_claimable(kind, &c).map_err(|e| format!("{f}: {e}"))?;
    if let Some(o) = own.iter().find(|o| ipam::overlaps(*o, &c)) {
        return Err(format!(
            "{f}: {c} overlaps the sending site's own CIDR {o}; its views of other sites never do"
        ));
    }
    if let Some((s, o)) = seen.iter().find(|(_, o)| ipam::overlaps(o, &c)) {
        return Err(format!("{f}: {c} overlaps {o}, offered for site {s:?}"));
    }
    seen.push((site.to_string(), c));
    Ok(())
}

/// The peer CIDRs of `route`, by kind, as [`ipam::plan_views`] takes them.
pub fn cidrs(route: &TransitRoute) -> Vec<(CidrKind, Ipv4Net)> {
    let mut v: Vec<(CidrKind, Ipv4Net)> = route.workload_cidrs.iter().map(|c| (CidrKind::Workload, *c)).collect();
    v.extend(route.external_cidr.map(|c| (CidrKind::External, c)));
    v
}

/// Whether this site reaches `site` over a direct peering that is in use
/// (negotiated, with views): then it is preferred over any transit path,
/// whatever its tunnel's health (a direct tunnel that does not come up is
/// for the admin to fix or delete, not for transit to hide).
pub fn direct(peerings: &Peerings, site: &str) -> bool {
    peerings
        .get(site)
        .is_some_and(|d| d.remote.is_some() && !d.views.is_empty())
}

/// [`rendered`] in IPv6: while the hop is agreed and carries IPv6, the
/// IPv6 transit views of sites this site has no direct IPv6 path to.
pub fn rendered_v6<'a>(
    peerings: &'a Peerings,
    p: &'a Peering,
) -> impl Iterator<Item = (usize, &'a TransitView<Ipv6Net>)> + 'a {
    let on = usable(p) && carries_v6(p);
    p.transit_views_v6.iter().enumerate().filter(move |(_, t)| {
        on && !peerings
            .get(&t.site)
            .is_some_and(|d| d.remote.is_some() && carries_v6(d))
    })
}

/// The transit views of peering `p` this site renders: while the hop is
/// agreed, those of sites it has no direct peering with.
pub fn rendered<'a>(peerings: &'a Peerings, p: &'a Peering) -> impl Iterator<Item = (usize, &'a TransitView)> + 'a {
    let on = usable(p);
    p.transit_views
        .iter()
        .enumerate()
        .filter(move |(_, t)| on && !direct(peerings, &t.site))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::RemoteSite;
    use std::sync::Arc;

    fn n(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    fn route(site: &str, w: &[&str], e: &str) -> pb::TransitRoute {
        pb::TransitRoute {
            site: site.into(),
            workload_cidrs: w.iter().map(|c| c.to_string()).collect(),
            external_cidr: e.into(),
            ..Default::default()
        }
    }

    fn params(routes: Vec<pb::TransitRoute>) -> pb::NetworkParams {
        pb::NetworkParams {
            site_id: "b".into(),
            transit: true,
            transit_routes: routes,
            ..Default::default()
        }
    }

    #[test]
    fn offers_are_checked_whole_and_loops_refused() {
        let own = [n("10.0.0.0/16")];
        let ok = check_routes(
            &params(vec![route("c", &["10.201.0.0/16"], "10.202.0.0/16")]),
            "a",
            &own,
            Some(n("10.99.0.0/16")),
        )
        .unwrap();
        assert_eq!(ok[0].workload_cidrs, vec![n("10.201.0.0/16")]);
        assert_eq!(ok[0].external_cidr, Some(n("10.202.0.0/16")));
        let bad = |routes: Vec<pb::TransitRoute>, field: &str, what: &str| {
            let e = check_routes(&params(routes), "a", &own, None).unwrap_err();
            assert!(e.starts_with(field) && e.contains(what), "{e}");
        };
        bad(
            vec![route("a", &["10.201.0.0/16"], "")],
            "transit_routes[0].site",
            "transit loop",
        );
        bad(
            vec![route("b", &["10.201.0.0/16"], "")],
            "transit_routes[0].site",
            "transit loop",
        );
        bad(
            vec![route("c", &["10.201.0.0/16"], ""), route("c", &["10.202.0.0/16"], "")],
            "transit_routes[1].site",
            "twice",
        );
        bad(
            vec![route("c", &["10.0.1.0/24"], "")],
            "transit_routes[0].workload_cidrs[0]",
            "own CIDR",
        );
        bad(
            vec![route("c", &["10.201.0.0/16"], ""), route("d", &["10.201.128.0/17"], "")],
            "transit_routes[1].workload_cidrs[0]",
            "offered for site \"c\"",
        );
        bad(
            vec![route("c", &["0.0.0.0/0"], "")],
            "transit_routes[0].workload_cidrs[0]",
            "/8",
        );
        bad(vec![route("c", &[], "")], "transit_routes[0].workload_cidrs", "1 to");
        bad(vec![route("C!", &["10.201.0.0/16"], "")], "transit_routes[0].site", "");
        bad(
            (0..=MAX_ROUTES)
                .map(|i| route(&format!("s{i}"), &["10.201.0.0/16"], ""))
                .collect(),
            "transit_routes:",
            "at most",
        );
        let mut off = params(vec![route("c", &["10.201.0.0/16"], "")]);
        off.transit = false;
        assert!(
            check_routes(&off, "a", &own, None)
                .unwrap_err()
                .contains("without transit")
        );
    }

    fn peering(site: &str, transit: bool, peer_transit: bool, local: &str) -> Peering {
        Peering {
            views: vec![ipam::View {
                kind: CidrKind::Workload,
                real: n("10.0.0.0/16"),
                local: n(local),
                pool: Some(n("10.200.0.0/13")),
            }],
            remote: Some(RemoteSite {
                transit: peer_transit,
                ..crate::domain::test_remote("10.0.0.0/16")
            }),
            transit,
            ..crate::domain::test_peering(site)
        }
    }

    fn map(ps: Vec<Peering>) -> Peerings {
        ps.into_iter().map(|p| (p.site_id.clone(), Arc::new(p))).collect()
    }

    #[test]
    fn a_hub_offers_only_hops_both_ends_agreed_and_never_the_asker() {
        let ps = map(vec![
            peering("a", true, true, "10.200.0.0/16"),
            peering("c", true, true, "10.201.0.0/16"),
            peering("d", true, false, "10.202.0.0/16"),
            peering("e", false, true, "10.203.0.0/16"),
        ]);
        let to_a = offers(&ps, "a");
        assert_eq!(to_a, vec![route("c", &["10.201.0.0/16"], "")]);
        assert_eq!(
            onward(ps.values().map(|q| &**q), &ps["c"]),
            vec![("a".to_string(), vec![n("10.200.0.0/16")])]
        );
        // A hop one end did not agree to gets nothing and gives nothing.
        assert!(offers(&ps, "d").is_empty() && offers(&ps, "e").is_empty());
        assert!(onward(ps.values().map(|q| &**q), &ps["e"]).is_empty());
    }

    #[test]
    fn a_direct_peering_is_preferred_over_transit() {
        let mut b = peering("b", true, true, "10.200.0.0/16");
        b.transit_views = vec![TransitView {
            site: "c".into(),
            view: ipam::View {
                kind: CidrKind::Workload,
                real: n("10.201.0.0/16"),
                local: n("10.201.0.0/16"),
                pool: None,
            },
        }];
        let ps = map(vec![b.clone()]);
        assert_eq!(rendered(&ps, &ps["b"]).count(), 1);
        let ps = map(vec![b.clone(), peering("c", false, false, "10.201.0.0/16")]);
        assert_eq!(rendered(&ps, &ps["b"]).count(), 0);
        b.transit = false;
        let ps = map(vec![b]);
        assert_eq!(rendered(&ps, &ps["b"]).count(), 0);
    }

    fn with_v6(mut p: Peering, local: &str) -> Peering {
        p.views_v6 = vec![ipam::View {
            kind: CidrKind::Workload,
            real: "fd00:1::/48".parse().unwrap(),
            local: local.parse().unwrap(),
            pool: None,
        }];
        p
    }

    #[test]
    fn ipv6_is_offered_and_forwarded_only_where_both_hops_carry_it() {
        let ps = map(vec![
            with_v6(peering("a", true, true, "10.200.0.0/16"), "fd10::/48"),
            with_v6(peering("c", true, true, "10.201.0.0/16"), "fd11::/48"),
            peering("d", true, true, "10.202.0.0/16"),
        ]);
        let to_a = offers(&ps, "a");
        let c = to_a.iter().find(|r| r.site == "c").unwrap();
        assert_eq!(
            (c.workload_cidrs_v6.clone(), c.workload_cidrs.clone()),
            (vec!["fd11::/48".to_string()], vec!["10.201.0.0/16".to_string()])
        );
        // d carries no IPv6: IPv4 only, for it and to it.
        let d = to_a.iter().find(|r| r.site == "d").unwrap();
        assert!(d.workload_cidrs_v6.is_empty() && !d.workload_cidrs.is_empty());
        assert!(offers(&ps, "d").iter().all(|r| r.workload_cidrs_v6.is_empty()));
        assert_eq!(
            onward_v6(ps.values().map(|q| &**q), &ps["c"]),
            vec![("a".to_string(), vec!["fd10::/48".parse::<Ipv6Net>().unwrap()])]
        );
        assert!(onward_v6(ps.values().map(|q| &**q), &ps["d"]).is_empty());
        // A site reached by IPv6 only: offered only to a peer that takes
        // such routes (earlier sites refuse them).
        let mut v6only = with_v6(peering("e", true, true, "10.204.0.0/16"), "fd14::/48");
        v6only.views.clear();
        let mut a = with_v6(peering("a", true, true, "10.200.0.0/16"), "fd10::/48");
        let ps = map(vec![a.clone(), v6only.clone()]);
        assert!(offers(&ps, "a").is_empty(), "to an earlier site");
        a.remote.as_mut().unwrap().transit_v6 = true;
        let ps = map(vec![a, v6only]);
        let e = offers(&ps, "a");
        assert_eq!(e.len(), 1);
        assert!(e[0].workload_cidrs.is_empty() && e[0].workload_cidrs_v6 == ["fd14::/48"]);
        // IPv6 refused on a hop: as if it carried none.
        let mut refused = with_v6(peering("a", true, true, "10.200.0.0/16"), "fd10::/48");
        refused.ipv6_refused = Some("held".into());
        let ps = map(vec![
            refused,
            with_v6(peering("c", true, true, "10.201.0.0/16"), "fd11::/48"),
        ]);
        assert!(offers(&ps, "a").iter().all(|r| r.workload_cidrs_v6.is_empty()));
    }

    #[test]
    fn ipv6_offers_are_checked_as_ipv4_ones() {
        let mut r = route("c", &["10.201.0.0/16"], "");
        r.workload_cidrs_v6 = vec!["fd11::/48".into()];
        let own6 = ["fd00:1::/48".parse::<Ipv6Net>().unwrap()];
        let p = params(vec![r.clone()]);
        let mut routes = check_routes(&p, "a", &[n("10.0.0.0/16")], None).unwrap();
        check_routes_v6(&p, &mut routes, &own6, None).unwrap();
        assert_eq!(
            cidrs_v6(&routes[0]),
            vec![(CidrKind::Workload, "fd11::/48".parse().unwrap())]
        );
        let bad = |v6: &[&str], ext: &str, what: &str| {
            let mut r = r.clone();
            r.workload_cidrs_v6 = v6.iter().map(|c| c.to_string()).collect();
            r.external_cidr_v6 = ext.into();
            let p = params(vec![r]);
            let mut routes = check_routes(&p, "a", &[n("10.0.0.0/16")], None).unwrap();
            let e = check_routes_v6(&p, &mut routes, &own6, None).expect_err(what);
            assert!(e.contains(what), "{e}");
        };
        bad(&["fd00:1:0:5::/64"], "", "overlaps the sending site's own CIDR");
        bad(&["10.9.0.0/16"], "", "is IPv4");
        bad(&["::/0"], "", "transit_routes[0].workload_cidrs_v6[0]");
        bad(&["fd11::/48", "fd11:0:0:1::/64"], "", "overlaps fd11::/48");
        bad(&[], "fd12::/48", "without any IPv6 workload CIDR");
        // A route with IPv6 CIDRs only is a route.
        let mut only6 = route("c", &[], "");
        only6.workload_cidrs_v6 = vec!["fd11::/48".into()];
        let p = params(vec![only6]);
        let mut routes = check_routes(&p, "a", &[], None).unwrap();
        check_routes_v6(&p, &mut routes, &own6, None).unwrap();
        assert!(routes[0].workload_cidrs.is_empty() && routes[0].workload_cidrs_v6.len() == 1);
    }

    #[test]
    fn a_direct_ipv6_peering_is_preferred_over_ipv6_transit() {
        let mut b = with_v6(peering("b", true, true, "10.200.0.0/16"), "fd10::/48");
        b.transit_views_v6 = vec![TransitView {
            site: "c".into(),
            view: ipam::View {
                kind: CidrKind::Workload,
                real: "fd11::/48".parse().unwrap(),
                local: "fd21::/48".parse().unwrap(),
                pool: None,
            },
        }];
        let ps = map(vec![b.clone()]);
        assert_eq!(rendered_v6(&ps, &ps["b"]).count(), 1);
        // A direct peering with IPv4 only leaves IPv6 through the hub.
        let ps = map(vec![b.clone(), peering("c", false, false, "10.201.0.0/16")]);
        assert_eq!(rendered_v6(&ps, &ps["b"]).count(), 1);
        let ps = map(vec![
            b.clone(),
            with_v6(peering("c", false, false, "10.201.0.0/16"), "fd31::/48"),
        ]);
        assert_eq!(rendered_v6(&ps, &ps["b"]).count(), 0);
        b.transit = false;
        let ps = map(vec![b]);
        assert_eq!(rendered_v6(&ps, &ps["b"]).count(), 0);
    }
}
