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
mod tests;
