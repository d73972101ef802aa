//! A peering's IPv6 part: this site's local views of the peer's IPv6
//! CIDRs, planned beside the IPv4 ones. What goes wrong here leaves IPv6
//! not negotiated, with the reason (`Peering::ipv6_refused`), and the rest
//! of the peering as it is: an IPv4 site, an older peer or an exhausted
//! IPv6 pool never costs a peering its IPv4.

use ipnet::Ipv6Net;

use super::Snapshot;
use crate::domain::{Peering, RemoteSite, Site, UnderlayOverlap};
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
fn host_addresses(snap: &Snapshot) -> Vec<(std::net::Ipv6Addr, String)> {
    snap.underlay_addresses()
        .into_iter()
        .filter_map(|(ip, who)| match ip {
            std::net::IpAddr::V6(a) => Some((a, who)),
            std::net::IpAddr::V4(_) => None,
        })
        .collect()
}

/// The views of the peer's IPv6 CIDRs in `remote` for the peering with
/// `peer_site` (`before`: as recorded, when it is), or why there are none.
/// A change of the peer's IPv6 CIDRs after they were taken is applied only
/// when each new one was known or lies in `peer_cidr_auto_accept`;
/// otherwise IPv6 goes off on the peering, saying so (holding it for
/// review, as IPv4 changes are, is not built yet).
pub(super) fn plan(
    snap: &Snapshot,
    site: &Site,
    peer_site: &str,
    remote: &RemoteSite,
    before: Option<&Peering>,
) -> (Vec<View<Ipv6Net>>, Option<String>) {
    let peer = offered(remote);
    let Some(v6) = site.ipv6.as_ref().filter(|_| !peer.is_empty()) else {
        // Nothing to plan; `Peering::ipv6_status` says why.
        return (vec![], None);
    };
    let kept: &[View<Ipv6Net>] = before.map_or(&[], |p| &p.views_v6);
    if let Some(old) = before.and_then(|p| p.remote.as_ref()).filter(|_| !kept.is_empty()) {
        let known = offered(old);
        let new: Vec<Ipv6Net> = peer
            .iter()
            .filter(|(k, c)| !known.contains(&(*k, *c)))
            .map(|(_, c)| *c)
            .filter(|c| !v6.peer_cidr_auto_accept.iter().any(|b| b.contains(c)))
            .collect();
        if !new.is_empty() {
            let list: Vec<String> = new.iter().map(|c| c.to_string()).collect();
            return (
                vec![],
                Some(format!(
                    "{peer_site} changed its IPv6 CIDRs to include {}, outside peer_cidr_auto_accept; IPv6 is off on \
                     this peering until it is created again (reviewing IPv6 changes is not supported yet)",
                    list.join(", ")
                )),
            );
        }
    }
    match check_and_plan(snap, site, v6, peer_site, &peer, kept) {
        Ok(views) => (views, None),
        Err(why) => (vec![], Some(why)),
    }
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
    let hosts = host_addresses(snap);
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
    }
    ipam::plan_views_keeping(peer, &in_use, &v6.remap_pools, &v6.peer_public_cidrs, kept, false)
        .map_err(|e| e.to_string())
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
            remap_pools: vec!["10.200.0.0/13".into(), "fd9a:2b3c:4d00::/40".into()],
            ..Default::default()
        };
        crate::config::resolve(&args, Default::default()).unwrap().site
    }

    fn dual_site() -> Site {
        site(&["10.1.0.0/16", "fd00:1::/48"])
    }

    #[test]
    fn the_same_ula_is_remapped_and_a_free_one_kept() {
        let snap = Snapshot::default();
        let (views, why) = plan(&snap, &dual_site(), "b", &remote(&["fd00:1::/48"]), None);
        assert_eq!(why, None);
        assert_eq!(views[0].local, n("fd9a:2b3c:4d00::/48"));
        let (views, _) = plan(&snap, &dual_site(), "b", &remote(&["fd00:2::/48"]), None);
        assert!(!views[0].remapped());
    }

    #[test]
    fn an_ipv4_site_or_an_ipv4_peer_plans_nothing_and_a_bad_cidr_says_why() {
        let snap = Snapshot::default();
        let v4 = site(&["10.1.0.0/16"]);
        assert_eq!(plan(&snap, &v4, "b", &remote(&["fd00:1::/48"]), None), (vec![], None));
        assert_eq!(plan(&snap, &dual_site(), "b", &remote(&[]), None), (vec![], None));
        let (views, why) = plan(&snap, &dual_site(), "b", &remote(&["fe80::/64"]), None);
        assert!(views.is_empty());
        let why = why.unwrap();
        assert!(
            why.starts_with("workload_cidrs_v6[0]:") && why.contains("fe80::/10"),
            "{why}"
        );
        let (_, why) = plan(&snap, &dual_site(), "b", &remote(&["2001:db8::/48"]), None);
        assert!(why.unwrap().contains("not private address space"));
    }

    #[test]
    fn a_changed_ipv6_cidr_outside_auto_accept_turns_ipv6_off() {
        let snap = Snapshot::default();
        let site = dual_site();
        let first = remote(&["fd00:2::/48"]);
        let (views, _) = plan(&snap, &site, "b", &first, None);
        let mut before: Peering = serde_json::from_value(serde_json::json!({
            "site_id": "b", "state": "negotiated", "views": [], "created_at_ms": 0,
        }))
        .unwrap();
        before.views_v6 = views.clone();
        before.remote = Some(first.clone());
        // The same CIDRs again: the same views.
        assert_eq!(plan(&snap, &site, "b", &first, Some(&before)), (views, None));
        let (views, why) = plan(&snap, &site, "b", &remote(&["fd00:3::/48"]), Some(&before));
        assert!(views.is_empty());
        assert!(why.unwrap().contains("fd00:3::/48, outside peer_cidr_auto_accept"));
    }
}
