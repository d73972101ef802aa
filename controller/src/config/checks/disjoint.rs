//! The site's own networks must not overlap, in either family, and each
//! remap pool is listed once: every overlap is named by its field.

use ipnet::Ipv4Net;

use super::super::{DEFAULT_EXTERNAL_CIDR, DEFAULT_INTERNAL_CIDR};
use super::overlaps;

/// The site's own networks must be disjoint, and each remap pool listed
/// once: an overlap is named by its field.
pub(in crate::config) fn disjoint(
    pod_cidrs: &[Ipv4Net],
    external: Option<Ipv4Net>,
    internal: Option<Ipv4Net>,
    reserved: &[Ipv4Net],
    pools: &[Ipv4Net],
    err: &mut impl FnMut(&str, String),
) {
    // The site's own networks must be disjoint.
    let mut named: Vec<(String, Ipv4Net)> = Vec::new();
    named.extend(
        pod_cidrs
            .iter()
            .enumerate()
            .map(|(i, n)| (format!("pod_cidrs[{i}]"), *n)),
    );
    if let Some(n) = external {
        named.push(("external_cidr".into(), n));
    }
    if let Some(n) = internal {
        named.push(("internal_cidr".into(), n));
    }
    named.extend(
        reserved
            .iter()
            .enumerate()
            .map(|(i, n)| (format!("reserved_cidrs[{i}]"), *n)),
    );
    for i in 0..named.len() {
        for j in 0..i {
            let ((fa, a), (fb, b)) = (&named[i], &named[j]);
            if overlaps(a, b) {
                let default_note = match fa.as_str() {
                    "external_cidr" if a.to_string() == DEFAULT_EXTERNAL_CIDR => " (the default)",
                    "internal_cidr" if a.to_string() == DEFAULT_INTERNAL_CIDR => " (the default)",
                    _ => "",
                };
                err(
                    fa,
                    format!(
                        "{a}{default_note} overlaps {fb} {b}; the site's networks must be disjoint, choose a free range"
                    ),
                );
            }
        }
    }
    for i in 0..pools.len() {
        for j in 0..i {
            if overlaps(&pools[i], &pools[j]) {
                err(
                    &format!("remap_pools[{i}]"),
                    format!(
                        "{} overlaps remap_pools[{j}] {}; list each pool once",
                        pools[i], pools[j]
                    ),
                );
            }
        }
    }
}

/// [`disjoint`] for the IPv6 networks.
pub(super) fn disjoint_v6(v6: &crate::domain::Ipv6Networks, err: &mut impl FnMut(&str, String)) {
    let mut named: Vec<(String, ipnet::Ipv6Net)> = Vec::new();
    named.extend(v6.pod_cidrs.iter().map(|n| (format!("pod_cidrs ({n})"), *n)));
    named.extend(v6.external_cidr.map(|n| ("external_cidr_v6".to_string(), n)));
    named.extend(v6.reserved_cidrs.iter().map(|n| (format!("reserved_cidrs ({n})"), *n)));
    for i in 0..named.len() {
        for j in 0..i {
            let ((fa, a), (fb, b)) = (&named[i], &named[j]);
            if overlaps(a, b) {
                err(
                    fa.split(' ').next().unwrap_or(fa),
                    format!("{a} overlaps {fb} {b}; the site's networks must be disjoint, choose a free range"),
                );
            }
        }
    }
    let pools = &v6.remap_pools;
    for i in 0..pools.len() {
        for j in 0..i {
            if overlaps(&pools[i], &pools[j]) {
                err(
                    "remap_pools",
                    format!("{} overlaps {}; list each pool once", pools[i], pools[j]),
                );
            }
        }
    }
}
