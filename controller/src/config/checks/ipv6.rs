//! The IPv6 side of the site's networks: lists of either family split by
//! family, what an IPv6 CIDR must be, and the site's IPv6 networks put
//! together (None without an IPv6 pod CIDR).

use ipnet::{Ipv4Net, Ipv6Net};

/// A list of CIDRs of either family, split by family; each problem is
/// pushed with its field. `check`: what else each must pass.
pub(super) fn cidr_lists(
    field: &str,
    values: &[String],
    check: fn(weft_types::Cidr) -> Result<(), String>,
    errs: &mut Vec<(String, String)>,
) -> (Vec<Ipv4Net>, Vec<ipnet::Ipv6Net>) {
    let (mut v4, mut v6) = (Vec::new(), Vec::new());
    for (i, v) in values.iter().enumerate() {
        match weft_types::net::cidr(v) {
            Ok(c) if let Err(m) = check(c) => errs.push((format!("{field}[{i}]"), m)),
            Ok(c) => match c.net() {
                ipnet::IpNet::V4(n) => v4.push(n),
                ipnet::IpNet::V6(n) => v6.push(n),
            },
            Err(m) => errs.push((format!("{field}[{i}]"), m)),
        }
    }
    (v4, v6)
}

pub(super) fn anything(_: weft_types::Cidr) -> Result<(), String> {
    Ok(())
}

/// Not special-purpose IPv6 space (loopback, link-local, multicast...),
/// where no workload can live. (IPv4 is left as it was: sites that run
/// today keep starting; a peer refuses such IPv4 space at negotiation.)
pub(super) fn ordinary(c: weft_types::Cidr) -> Result<(), String> {
    if c.v6().is_none() {
        return Ok(());
    }
    match weft_types::net::special_use(c.net()) {
        Some(range) => Err(format!(
            "{c} is in {range} space, which no site network may use; choose a private range"
        )),
        None => Ok(()),
    }
}

/// A workload CIDR: ordinary, and an IPv6 one holds a /64 per node.
pub(super) fn workload(c: weft_types::Cidr) -> Result<(), String> {
    ordinary(c)?;
    match c.v6() {
        Some(p) if !(32..=crate::domain::NODE_PREFIX_LEN_V6).contains(&p.prefix_len()) => Err(format!(
            "{p} is an IPv6 /{}; give a /32 to a /64 (a /56 or /48 is usual): each node gets a /64 of it",
            p.prefix_len()
        )),
        _ => Ok(()),
    }
}

/// The IPv6 entries of the site's CIDR lists.
pub(super) struct Lists {
    pub(super) pods: Vec<Ipv6Net>,
    pub(super) reserved: Vec<Ipv6Net>,
    pub(super) pools: Vec<Ipv6Net>,
    pub(super) auto_accept: Vec<Ipv6Net>,
    pub(super) public: Vec<Ipv6Net>,
}

/// The site's IPv6 networks from `lists` and the IPv6 external CIDR
/// (`external`, as given), each problem named by its field; None without
/// an IPv6 pod CIDR (and then no IPv6 entry is allowed anywhere).
pub(super) fn site_v6(
    external: Option<String>,
    lists: Lists,
    err: &mut impl FnMut(&str, String),
) -> Option<crate::domain::Ipv6Networks> {
    let external_v6 = match external {
        None => None,
        Some(t) => match weft_types::net::cidr(&t) {
            Err(m) => {
                err("external_cidr_v6", m);
                None
            }
            Ok(c) => match c.v6() {
                None => {
                    err(
                        "external_cidr_v6",
                        format!("{c} is IPv4; give the IPv4 external CIDR as external_cidr"),
                    );
                    None
                }
                Some(_) if let Err(m) = ordinary(c) => {
                    err("external_cidr_v6", m);
                    None
                }
                Some(n) if !(48..=120).contains(&n.prefix_len()) => {
                    err(
                        "external_cidr_v6",
                        format!("{n} is an IPv6 /{}; give a /48 to a /120", n.prefix_len()),
                    );
                    None
                }
                Some(n) => Some(n),
            },
        },
    };
    // IPv6 entries on a site without IPv6 would be dropped unread.
    if lists.pods.is_empty() {
        for (field, list) in [
            ("reserved_cidrs", &lists.reserved),
            ("remap_pools", &lists.pools),
            ("peer_cidr_auto_accept", &lists.auto_accept),
            ("peer_public_cidrs", &lists.public),
        ] {
            if let Some(c) = list.first() {
                err(
                    field,
                    format!("lists IPv6 {c}, but the site has no IPv6 pod CIDR; add one to pod_cidrs, or drop it"),
                );
            }
        }
    }
    if external_v6.is_some() && lists.pods.is_empty() {
        err(
            "external_cidr_v6",
            "is set but the site has no IPv6 pod CIDR; add one to pod_cidrs, or drop external_cidr_v6".into(),
        );
    }
    if lists.pods.is_empty() {
        return None;
    }
    let v6 = crate::domain::Ipv6Networks {
        controller_ips: vec![],
        pod_cidrs: lists.pods,
        external_cidr: external_v6,
        reserved_cidrs: lists.reserved,
        remap_pools: lists.pools,
        peer_cidr_auto_accept: lists.auto_accept,
        peer_public_cidrs: lists.public,
    };
    super::disjoint::disjoint_v6(&v6, err);
    Some(v6)
}
