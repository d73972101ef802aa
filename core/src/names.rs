//! Cross-site addressing: the names a site publishes for its workloads and
//! exported hosts, what a peer may publish, and translation between a
//! peer's own addresses and this site's local views of them. Pure.
//!
//! A workload's name carries its address in the site's pod CIDRs. An
//! exported host (a database on the site's LAN, not a workload) gets an
//! address of the site's external CIDR, which its gateways map 1:1 to the
//! host; peers see only that external address. Peers resolve either through
//! their own local view of the CIDR it lies in.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::domain::{Peering, PeeringState, Site};
use crate::ipam::{CidrKind, View};

/// The most names one site publishes (and accepts from one peer).
pub const MAX_NAMES: usize = 1000;

pub use crate::domain::{NameKind, NameRecord, RemoteName};

/// Checks a DNS label: 1 to 63 lower-case letters, digits or '-', not
/// starting or ending with '-'.
pub fn check_label(field: &str, name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err(format!("{field} is empty; give a DNS label such as \"db\""));
    }
    if !weft_common::is_dns_label(name) {
        return Err(format!(
            "{field} {name:?} is not a DNS label: use 1 to 63 lower-case letters, digits or '-', \
             not starting or ending with '-' (no dots: peers resolve it as NAME.SITE.<zone>)"
        ));
    }
    Ok(())
}

fn in_any(nets: &[Ipv4Net], a: Ipv4Addr) -> Option<&Ipv4Net> {
    nets.iter().find(|n| n.contains(&a))
}

/// Whether `address` may be published as `kind` by `site`, given its
/// peerings (whose local views it must not be in): the message names what
/// to change.
pub fn check_own_address(site: &Site, peerings: &[&Peering], kind: NameKind, address: Ipv4Addr) -> Result<(), String> {
    let pods = || {
        site.pod_cidrs
            .iter()
            .map(|c| c.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if site.pod_cidrs.is_empty() {
        return Err(format!(
            "address {address} is IPv4, and this site is IPv6-only (no IPv4 pod CIDRs): it offers peers no IPv4 \
             to reach a name at"
        ));
    }
    match kind {
        NameKind::Workload => {
            if in_any(&site.pod_cidrs, address).is_none() {
                return Err(format!(
                    "address {address} is not in the site's pod CIDRs ({}); name a workload by its address there, \
                     or export a host outside them with --export",
                    pods()
                ));
            }
            Ok(())
        }
        NameKind::ExportedHost => {
            if let Some(p) = in_any(&site.pod_cidrs, address) {
                return Err(format!(
                    "address {address} is inside the site's pod CIDR {p}: it is a workload; name it without --export"
                ));
            }
            if address.is_unspecified()
                || address.is_loopback()
                || address.is_multicast()
                || address.is_broadcast()
                || address.is_link_local()
            {
                return Err(format!(
                    "address {address} cannot be exported: give a unicast address of a host on the site's LAN \
                     (169.254.0.0/16 is weft's tunnel and veth links)"
                ));
            }
            for (what, net) in [
                ("internal CIDR (weft's overlay links)", site.internal_cidr),
                ("external CIDR (exports are reached through it)", site.external_cidr),
            ] {
                if net.contains(&address) {
                    return Err(format!(
                        "address {address} is on a weft link: it is in the site's {what} {net}; \
                         give the host's address on the site's LAN"
                    ));
                }
            }
            for p in peerings {
                if let Some(v) = p.views.iter().find(|v| v.local.contains(&address)) {
                    return Err(format!(
                        "address {address} is in {}, this site's view of {}'s {} CIDR {}: it is routed to that peer; \
                         give the host's address on the site's LAN",
                        v.local, p.site_id, v.kind, v.real
                    ));
                }
                if let Some(t) = p.transit_views.iter().find(|t| t.view.local.contains(&address)) {
                    return Err(format!(
                        "address {address} is in {}, this site's view of {}'s {} CIDR, reached through {}: it is \
                         routed to that peer; give the host's address on the site's LAN",
                        t.view.local, t.site, t.view.kind, p.site_id
                    ));
                }
            }
            Ok(())
        }
    }
}

/// Whether a workload's IPv6 address `address` may be published with
/// site `site`'s name for it: in its IPv6 pod CIDRs. The message names
/// what to change.
pub fn check_own_address_v6(site: &Site, address: Ipv6Addr) -> Result<(), String> {
    let pods: &[Ipv6Net] = site.ipv6.as_ref().map_or(&[], |v6| &v6.pod_cidrs);
    if pods.is_empty() {
        return Err(format!(
            "{address}: this site has no IPv6 pod CIDRs; add one (--pod-cidr) to publish IPv6 addresses"
        ));
    }
    if !pods.iter().any(|p| p.contains(&address)) {
        let shown: Vec<String> = pods.iter().map(|c| c.to_string()).collect();
        return Err(format!(
            "{address} is not in the site's IPv6 pod CIDRs ({}); give the workload's IPv6 address there",
            shown.join(", ")
        ));
    }
    Ok(())
}

/// The external address for a new export: the highest free host address of
/// the external CIDR, never one that a node's or gateway's "unknown source"
/// address takes (`taken`) nor another export's.
pub fn allocate_external(site: &Site, taken: &[Ipv4Addr]) -> Result<Ipv4Addr, String> {
    let net = site.external_cidr;
    let (first, last) = (u32::from(net.network()), u32::from(net.broadcast()));
    // A /31 or /32 has no network and broadcast to skip.
    let (lo, hi) = if net.prefix_len() >= 31 {
        (first, last)
    } else {
        (first + 1, last - 1)
    };
    (lo..=hi)
        .rev()
        .map(Ipv4Addr::from)
        .find(|a| !taken.contains(a))
        .ok_or_else(|| {
            format!(
                "the external CIDR {net} has no free address left for an export; delete an exported name \
                 or give the site a larger --external-cidr"
            )
        })
}

/// The overlay address whose "unknown source" address an export takes,
/// which the internal IPAM must then skip.
pub fn internal_twin(site: &Site, external: Ipv4Addr) -> Option<Ipv4Addr> {
    let host = u32::from(external).checked_sub(u32::from(site.external_cidr.network()))?;
    (u128::from(host) < crate::ipam::size(&site.internal_cidr))
        .then(|| Ipv4Addr::from(u32::from(site.internal_cidr.network()) + host))
}

/// A name as a peer sends it: name, kind, address, IPv6 address ("": none).
pub type Published = (String, Option<NameKind>, String, String);

/// Checks what a peer publishes against the CIDRs it announced: at most
/// [`MAX_NAMES`], each a DNS label once, each address its own (a workload's
/// in its workload CIDRs, an export's in its external CIDR; a workload's
/// IPv6 address in its IPv6 workload CIDRs `workload_v6`, else left out:
/// IPv6 that cannot be taken costs only IPv6). The error names the field.
pub fn check_remote(
    names: &[Published],
    workload: &[Ipv4Net],
    external: Option<Ipv4Net>,
    workload_v6: &[Ipv6Net],
) -> Result<Vec<RemoteName>, String> {
    if names.len() > MAX_NAMES {
        return Err(format!(
            "names: {} listed; a site publishes at most {MAX_NAMES}",
            names.len()
        ));
    }
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(names.len());
    for (i, (name, kind, address, address_v6)) in names.iter().enumerate() {
        check_label(&format!("names[{i}].name"), name)?;
        if !seen.insert(name.as_str()) {
            return Err(format!("names[{i}].name: {name:?} is listed twice"));
        }
        let kind =
            kind.ok_or_else(|| format!("names[{i}].kind: give NAME_KIND_WORKLOAD or NAME_KIND_EXPORTED_HOST"))?;
        // A workload of an IPv6-only site (no IPv4 CIDRs) has only its
        // IPv6 address.
        let v6_only = address.is_empty() && workload.is_empty() && kind == NameKind::Workload;
        if v6_only && address_v6.is_empty() {
            return Err(format!("names[{i}]: {name:?} has no address of either family"));
        }
        let address: Option<Ipv4Addr> = match v6_only {
            true => None,
            false => Some(weft_types::net::addr_v4(address).map_err(|m| format!("names[{i}].address: {m}"))?),
        };
        let owned = match (kind, address) {
            (_, None) => true,
            (NameKind::Workload, Some(a)) => in_any(workload, a).is_some(),
            (NameKind::ExportedHost, Some(a)) => external.is_some_and(|e| e.contains(&a)),
        };
        if let (false, Some(address)) = (owned, address) {
            let whose = match kind {
                NameKind::Workload => "workload CIDRs",
                NameKind::ExportedHost => "external CIDR",
            };
            return Err(format!(
                "names[{i}].address: {address} ({name:?}) is not in the site's own {whose}; \
                 a site names only addresses it owns"
            ));
        }
        let address_v6 = match address_v6.as_str() {
            "" => None,
            text => {
                let a = weft_types::net::addr_v6(text).map_err(|m| format!("names[{i}].address_v6: {m}"))?;
                if kind != NameKind::Workload {
                    return Err(format!(
                        "names[{i}].address_v6: {name:?} is an exported host; only workloads have IPv6 addresses"
                    ));
                }
                let owned = workload_v6.iter().any(|c| c.contains(&a));
                if v6_only && !owned {
                    return Err(format!(
                        "names[{i}].address_v6: {a} ({name:?}) is not in the site's own IPv6 workload CIDRs; a site \
                         names only addresses it owns"
                    ));
                }
                owned.then_some(a)
            }
        };
        out.push(RemoteName {
            name: name.clone(),
            kind,
            address,
            address_v6,
        });
    }
    Ok(out)
}

/// Keeps host bits: the address `a` of `from` in `to` (`a` is in `from`).
fn map(a: Ipv4Addr, from: Ipv4Net, to: Ipv4Net) -> Ipv4Addr {
    crate::ipam::translate(a, from, to).unwrap_or(a)
}

/// An address translated between a peer's addressing and this site's view
/// (both of one family).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Translation {
    pub site: String,
    pub real: IpAddr,
    pub local: IpAddr,
    /// The view it went through.
    pub kind: CidrKind,
    pub real_cidr: IpNet,
    pub local_cidr: IpNet,
}

impl Translation {
    pub fn remapped(&self) -> bool {
        self.real_cidr != self.local_cidr
    }
}

/// Why an address does not translate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Untranslatable {
    /// No peering, or no view covers the address.
    NotFound(String),
    /// The peering is not negotiated, or the address's CIDR is held for review.
    Precondition(String),
}

fn negotiated(p: &Peering) -> Result<(), Untranslatable> {
    if matches!(p.state, PeeringState::Pending | PeeringState::Deleting) || p.views.is_empty() && p.views_v6.is_empty()
    {
        return Err(Untranslatable::Precondition(format!(
            "the peering with {} is not negotiated (state {:?}); wait for it, or see `weftctl peerings`",
            p.site_id, p.state
        )));
    }
    Ok(())
}

/// The peering's views of `addr`'s family: its IPv6 ones only while the
/// peering carries IPv6 (else why not).
enum Views<'a> {
    V4(&'a [View<Ipv4Net>]),
    V6(&'a [View<Ipv6Net>]),
}

fn views_for(p: &Peering, addr: IpAddr) -> Result<Views<'_>, Untranslatable> {
    match addr {
        IpAddr::V4(_) => Ok(Views::V4(&p.views)),
        IpAddr::V6(_) if p.ipv6_refused.is_none() && !p.views_v6.is_empty() => Ok(Views::V6(&p.views_v6)),
        IpAddr::V6(_) => {
            let offered = p.remote.as_ref().is_some_and(|r| !r.workload_cidrs_v6.is_empty());
            let why = match &p.ipv6_refused {
                Some(why) => why.clone(),
                None if !offered => format!("{} offered no IPv6 CIDRs", p.site_id),
                None => "IPv6 is not negotiated; `weftctl peerings` says why".to_string(),
            };
            Err(Untranslatable::Precondition(format!(
                "the peering with {} carries no IPv6: {why}",
                p.site_id
            )))
        }
    }
}

/// Through the view of `views` that holds `addr` on its real side
/// (`to_local`) or its local side: the translation, if one holds it.
fn through<N>(site: &str, views: &[View<N>], addr: N::Addr, to_local: bool) -> Option<Translation>
where
    N: crate::ipam::Prefix + Into<IpNet>,
    N::Addr: Into<IpAddr>,
{
    let v = views.iter().find(|v| {
        let from = if to_local { v.real } else { v.local };
        from.holds_addr(addr)
    })?;
    let (from, to) = if to_local { (v.real, v.local) } else { (v.local, v.real) };
    let other = crate::ipam::translate(addr, from, to).unwrap_or(addr);
    let (real, local) = if to_local { (addr, other) } else { (other, addr) };
    Some(Translation {
        site: site.to_string(),
        real: real.into(),
        local: local.into(),
        kind: v.kind,
        real_cidr: v.real.into(),
        local_cidr: v.local.into(),
    })
}

fn translate_in(p: &Peering, addr: IpAddr, to_local: bool) -> Result<Option<Translation>, Untranslatable> {
    Ok(match (views_for(p, addr)?, addr) {
        (Views::V4(v), IpAddr::V4(a)) => through(&p.site_id, v, a, to_local),
        (Views::V6(v), IpAddr::V6(a)) => through(&p.site_id, v, a, to_local),
        _ => None,
    })
}

/// Peer `site`'s address `real` (as that site uses it; either family) →
/// this site's view.
pub fn to_local(peerings: &[&Peering], site: &str, real: IpAddr) -> Result<Translation, Untranslatable> {
    let p = peerings.iter().find(|p| p.site_id == site).ok_or_else(|| {
        Untranslatable::NotFound(format!(
            "this site has no peering with {site:?}; list them with `weftctl peerings`"
        ))
    })?;
    negotiated(p)?;
    if let Some(t) = translate_in(p, real, true)? {
        return Ok(t);
    }
    let held = match real {
        IpAddr::V4(a) => p.pending.as_ref().is_some_and(|q| {
            q.workload_cidrs.iter().any(|c| c.contains(&a)) || q.external_cidr.is_some_and(|c| c.contains(&a))
        }),
        IpAddr::V6(a) => p.pending_v6.as_ref().is_some_and(|q| {
            q.workload_cidrs_v6.iter().any(|c| c.contains(&a)) || q.external_cidr_v6.is_some_and(|c| c.contains(&a))
        }),
    };
    if held {
        return Err(Untranslatable::Precondition(format!(
            "{real} is in CIDRs {site} announced that this site holds for review; \
             accept them with `weftctl peering accept {site}`"
        )));
    }
    let cidrs: Vec<String> = match real {
        IpAddr::V4(_) => p.views.iter().map(|v| format!("{} {}", v.kind, v.real)).collect(),
        IpAddr::V6(_) => p.views_v6.iter().map(|v| format!("{} {}", v.kind, v.real)).collect(),
    };
    let family = if real.is_ipv4() { "IPv4" } else { "IPv6" };
    Err(Untranslatable::NotFound(format!(
        "{real} is in none of {site}'s {family} CIDRs ({}); give the address as {site} itself uses it",
        if cidrs.is_empty() {
            "none".to_string()
        } else {
            cidrs.join(", ")
        }
    )))
}

/// An address of this site's local views (either family) → the peer and
/// its real address.
pub fn to_peer(peerings: &[&Peering], local: IpAddr) -> Result<Translation, Untranslatable> {
    for p in peerings {
        // A peering that carries no IPv6 has no IPv6 view to hold it.
        if let Ok(Some(t)) = translate_in(p, local, false) {
            negotiated(p)?;
            return Ok(t);
        }
    }
    Err(Untranslatable::NotFound(format!(
        "{local} is in no local view of a peer; list the views with `weftctl peerings`, \
         or give the peer's site to translate its address into this site's view"
    )))
}

/// A peer's name as this site resolves it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Learned<'a> {
    pub name: &'a RemoteName,
    /// Its address in this site's local view (none: it has no IPv4
    /// address, or the peering carries no IPv4).
    pub local: Option<Ipv4Addr>,
    /// Its IPv6 address in this site's IPv6 view, when it has one and the
    /// peering carries IPv6.
    pub local_v6: Option<Ipv6Addr>,
}

/// A peer's published names with the address each has in this site's
/// local view (names whose CIDR is not routed here, e.g. held for review,
/// are left out; an IPv6 address outside the negotiated IPv6 views too).
pub fn learned(p: &Peering) -> Vec<Learned<'_>> {
    let Some(r) = &p.remote else { return Vec::new() };
    let views_v6: &[View<Ipv6Net>] = if p.ipv6_refused.is_none() { &p.views_v6 } else { &[] };
    r.names
        .iter()
        .filter_map(|n| {
            let want = match n.kind {
                NameKind::Workload => CidrKind::Workload,
                NameKind::ExportedHost => CidrKind::External,
            };
            let local = n.address.and_then(|a| {
                let v = p.views.iter().find(|v| v.kind == want && v.real.contains(&a))?;
                Some(map(a, v.real, v.local))
            });
            let local_v6 = n.address_v6.and_then(|a| {
                let v = views_v6.iter().find(|v| v.kind == want && v.real.contains(&a))?;
                crate::ipam::translate(a, v.real, v.local)
            });
            // Its IPv4 address not routed here while IPv4 is (held for
            // review): left out. Otherwise by the families routed (only
            // IPv6 on a peering one of whose sites is IPv6-only).
            let held = n.address.is_some() && local.is_none() && !p.views.is_empty();
            if held || local.is_none() && local_v6.is_none() {
                return None;
            }
            Some(Learned {
                name: n,
                local,
                local_v6,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{RemoteSite, TunnelRole};

    fn n(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }
    fn a(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn site() -> Site {
        crate::domain::test_site("site-a", "10.200.0.0/13")
    }

    fn peering(state: PeeringState) -> Peering {
        Peering {
            site_id: "site-b".into(),
            state,
            views: vec![
                View {
                    kind: CidrKind::Workload,
                    real: n("10.1.0.0/16"),
                    local: n("10.200.0.0/16"),
                    pool: Some(n("10.200.0.0/13")),
                },
                View {
                    kind: CidrKind::External,
                    real: n("10.70.0.0/16"),
                    local: n("10.201.0.0/16"),
                    pool: Some(n("10.200.0.0/13")),
                },
            ],
            created_at_ms: 0,
            last_error: None,
            remote: Some(RemoteSite {
                ca_pem: String::new(),
                ca_fingerprint: String::new(),
                workload_cidrs: vec![n("10.1.0.0/16")],
                external_cidr: Some(n("10.70.0.0/16")),
                gateways: vec![],
                mtu: 0,
                endpoints: vec![],
                tunnel_role: TunnelRole::Server,
                relay: false,
                relay_for: vec![],
                relays: vec![],
                exported: None,
                exported_v6: vec![],
                transit: false,
                transit_routes: vec![],
                readiness: None,
                names: vec![
                    RemoteName {
                        name: "web".into(),
                        kind: NameKind::Workload,
                        address: Some(a("10.1.0.10")),
                        address_v6: None,
                    },
                    RemoteName {
                        name: "db".into(),
                        kind: NameKind::ExportedHost,
                        address: Some(a("10.70.255.254")),
                        address_v6: None,
                    },
                ],
                workload_cidrs_v6: vec![],
                external_cidr_v6: None,
                ipv6_invalid: None,
            }),
            ..crate::domain::test_peering("")
        }
    }

    #[test]
    fn labels_are_dns_labels() {
        for good in ["db", "web-1", "a", &"x".repeat(63)] {
            assert!(check_label("name", good).is_ok(), "{good}");
        }
        for bad in ["", "-db", "db-", "Db", "web.site", "a_b", &"x".repeat(64), "dé"] {
            let e = check_label("name", bad).unwrap_err();
            assert!(e.starts_with("name"), "{e}");
        }
    }

    #[test]
    fn translation_goes_both_ways_and_keeps_host_bits() {
        let p = peering(PeeringState::Negotiated);
        let t = to_local(&[&p], "site-b", ip("10.1.0.10")).unwrap();
        assert_eq!(t.local, ip("10.200.0.10"));
        assert_eq!(t.kind, CidrKind::Workload);
        assert!(t.remapped());
        let back = to_peer(&[&p], t.local).unwrap();
        assert_eq!((back.site.as_str(), back.real), ("site-b", ip("10.1.0.10")));
        let ext = to_local(&[&p], "site-b", ip("10.70.255.254")).unwrap();
        assert_eq!((ext.local, ext.kind), (ip("10.201.255.254"), CidrKind::External));
    }

    fn with_ipv6() -> Peering {
        let mut p = peering(PeeringState::Negotiated);
        p.views_v6 = vec![View {
            kind: CidrKind::Workload,
            real: "fd00:1::/48".parse().unwrap(),
            local: "fd37:fec3:9300::/48".parse().unwrap(),
            pool: Some("fd37:fec3:9300::/40".parse().unwrap()),
        }];
        p
    }

    #[test]
    fn ipv6_translates_through_the_ipv6_views_keeping_host_bits() {
        let p = with_ipv6();
        let t = to_local(&[&p], "site-b", ip("fd00:1:0:2::10")).unwrap();
        assert_eq!(t.local, ip("fd37:fec3:9300:2::10"));
        assert_eq!(t.local_cidr, "fd37:fec3:9300::/48".parse::<IpNet>().unwrap());
        let back = to_peer(&[&p], t.local).unwrap();
        assert_eq!((back.site.as_str(), back.real), ("site-b", ip("fd00:1:0:2::10")));
        // An IPv4 address never matches an IPv6 view, nor the reverse.
        assert!(to_peer(&[&p], ip("fd00:1::10")).is_err());
        let e = to_local(&[&p], "site-b", ip("fd00:9::1")).unwrap_err();
        let e4 = to_local(&[&peering(PeeringState::Negotiated)], "site-b", ip("fd00:1::1")).unwrap_err();
        assert!(
            matches!(&e4, Untranslatable::Precondition(m) if m.contains("site-b offered no IPv6 CIDRs")),
            "{e4:?}"
        );
        assert!(
            matches!(&e, Untranslatable::NotFound(m) if m.contains("IPv6 CIDRs (workload fd00:1::/48)")),
            "{e:?}"
        );
        // A peering that carries no IPv6 says why.
        let mut off = with_ipv6();
        off.views_v6.clear();
        off.ipv6_refused = Some("site-b offered no IPv6 CIDRs".into());
        let e = to_local(&[&off], "site-b", ip("fd00:1::10")).unwrap_err();
        assert!(
            matches!(&e, Untranslatable::Precondition(m) if m.contains("carries no IPv6: site-b offered")),
            "{e:?}"
        );
        assert!(to_peer(&[&off], ip("fd37:fec3:9300::10")).is_err());
    }

    #[test]
    fn untranslatable_addresses_say_why() {
        let p = peering(PeeringState::Negotiated);
        assert!(
            matches!(to_local(&[&p], "site-c", ip("10.1.0.10")), Err(Untranslatable::NotFound(m)) if m.contains("no peering"))
        );
        assert!(
            matches!(to_local(&[&p], "site-b", ip("10.9.0.1")), Err(Untranslatable::NotFound(m)) if m.contains("none of"))
        );
        assert!(matches!(
            to_peer(&[&p], ip("10.1.0.10")),
            Err(Untranslatable::NotFound(_))
        ));
        let pending = peering(PeeringState::Pending);
        assert!(matches!(
            to_local(&[&pending], "site-b", ip("10.1.0.10")),
            Err(Untranslatable::Precondition(_))
        ));
        let mut held = peering(PeeringState::Negotiated);
        held.pending = Some(crate::domain::PendingCidrs {
            workload_cidrs: vec![n("10.9.0.0/16")],
            external_cidr: None,
            received_at_ms: 0,
        });
        assert!(matches!(
            to_local(&[&held], "site-b", ip("10.9.0.1")),
            Err(Untranslatable::Precondition(m)) if m.contains("peering accept")
        ));
    }

    #[test]
    fn learned_names_resolve_to_the_local_view() {
        let p = peering(PeeringState::Negotiated);
        let got: Vec<(String, Ipv4Addr)> = learned(&p)
            .into_iter()
            .map(|l| (l.name.name.clone(), l.local.unwrap()))
            .collect();
        assert_eq!(
            got,
            [("web".into(), a("10.200.0.10")), ("db".into(), a("10.201.255.254"))]
        );
    }

    #[test]
    fn exported_addresses_stay_off_weft_links_and_workloads() {
        let s = site();
        let p = peering(PeeringState::Negotiated);
        let ok = |x: &str| check_own_address(&s, &[&p], NameKind::ExportedHost, a(x));
        assert!(ok("192.168.1.10").is_ok());
        for (bad, says) in [
            ("10.1.0.10", "pod CIDR"),
            ("10.80.0.3", "internal CIDR"),
            ("10.70.0.3", "external CIDR"),
            ("169.254.0.2", "169.254"),
            ("127.0.0.1", "unicast"),
            ("10.200.0.7", "view of site-b"),
        ] {
            let e = ok(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        assert!(check_own_address(&s, &[], NameKind::Workload, a("10.1.0.10")).is_ok());
        assert!(
            check_own_address(&s, &[], NameKind::Workload, a("192.168.1.10"))
                .unwrap_err()
                .contains("--export")
        );
    }

    #[test]
    fn exports_take_the_top_of_the_external_cidr_and_the_ipam_skips_their_twins() {
        let s = site();
        let x = allocate_external(&s, &[]).unwrap();
        assert_eq!(x, a("10.70.255.254"));
        assert_eq!(allocate_external(&s, &[x]).unwrap(), a("10.70.255.253"));
        assert_eq!(internal_twin(&s, x), Some(a("10.80.255.254")));
        let mut tiny = site();
        tiny.external_cidr = n("10.70.0.0/30");
        assert!(
            allocate_external(&tiny, &[a("10.70.0.1"), a("10.70.0.2")])
                .unwrap_err()
                .contains("no free address")
        );
    }

    #[test]
    fn a_peer_names_only_its_own_addresses_and_not_too_many() {
        let w = [n("10.1.0.0/16")];
        let e = Some(n("10.70.0.0/16"));
        let w6: [Ipv6Net; 1] = ["fd00:1::/48".parse().unwrap()];
        let one6 = |name: &str, k: Option<NameKind>, addr: &str, v6: &str| {
            vec![(name.to_string(), k, addr.to_string(), v6.to_string())]
        };
        let one = |name: &str, k: Option<NameKind>, addr: &str| one6(name, k, addr, "");
        assert!(check_remote(&one("web", Some(NameKind::Workload), "10.1.0.10"), &w, e, &w6).is_ok());
        // An IPv6 address in its IPv6 workload CIDRs is kept; one outside
        // them is left out, the name and its IPv4 address kept.
        let kept = check_remote(
            &one6("web", Some(NameKind::Workload), "10.1.0.10", "fd00:1::10"),
            &w,
            e,
            &w6,
        )
        .unwrap();
        assert_eq!(kept[0].address_v6, Some("fd00:1::10".parse().unwrap()));
        let out = check_remote(
            &one6("web", Some(NameKind::Workload), "10.1.0.10", "fd00:2::10"),
            &w,
            e,
            &w6,
        )
        .unwrap();
        assert_eq!((out[0].address, out[0].address_v6), (Some(a("10.1.0.10")), None));
        // An IPv6-only site's workload: its IPv6 address alone, which must
        // be its own; without IPv4 CIDRs only.
        let v6_only = check_remote(&one6("api", Some(NameKind::Workload), "", "fd00:1::20"), &[], None, &w6).unwrap();
        assert_eq!(
            (v6_only[0].address, v6_only[0].address_v6),
            (None, Some("fd00:1::20".parse().unwrap()))
        );
        for (names, w, field) in [
            (
                one6("api", Some(NameKind::Workload), "", "fd00:2::20"),
                &[][..],
                "names[0].address_v6",
            ),
            (one6("api", Some(NameKind::Workload), "", ""), &[][..], "names[0]"),
            (
                one6("api", Some(NameKind::ExportedHost), "", "fd00:1::20"),
                &[][..],
                "names[0].address",
            ),
            (
                one6("api", Some(NameKind::Workload), "", "fd00:1::20"),
                &w[..],
                "names[0].address",
            ),
        ] {
            let e = check_remote(&names, w, None, &w6).unwrap_err();
            assert!(e.starts_with(field), "{names:?}: {e}");
        }
        for (names, field) in [
            (one("web", Some(NameKind::Workload), "10.2.0.10"), "names[0].address"),
            (one("db", Some(NameKind::ExportedHost), "10.1.0.10"), "names[0].address"),
            (one("Web", Some(NameKind::Workload), "10.1.0.10"), "names[0].name"),
            (one("web", None, "10.1.0.10"), "names[0].kind"),
            (one("web", Some(NameKind::Workload), "x"), "names[0].address"),
            (
                one6("web", Some(NameKind::Workload), "10.1.0.10", "10.1.0.10"),
                "names[0].address_v6",
            ),
            (
                one6("web", Some(NameKind::Workload), "10.1.0.10", "fd00:1::/64"),
                "names[0].address_v6",
            ),
            (
                one6("db", Some(NameKind::ExportedHost), "10.70.0.9", "fd00:1::9"),
                "names[0].address_v6",
            ),
        ] {
            let m = check_remote(&names, &w, e, &w6).unwrap_err();
            assert!(m.starts_with(field), "{m}");
        }
        let mut twice = one("web", Some(NameKind::Workload), "10.1.0.10");
        twice.extend(one("web", Some(NameKind::Workload), "10.1.0.11"));
        assert!(check_remote(&twice, &w, e, &w6).unwrap_err().contains("twice"));
        let many: Vec<_> = (0..10_000)
            .map(|i| {
                (
                    format!("n{i}"),
                    Some(NameKind::Workload),
                    "10.1.0.1".to_string(),
                    String::new(),
                )
            })
            .collect();
        assert!(
            check_remote(&many, &w, e, &w6)
                .unwrap_err()
                .starts_with("names: 10000 listed")
        );
    }
}
