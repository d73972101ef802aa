//! Address management: pure functions over sets of blocks of one family
//! (IPv4 or IPv6, through [`Prefix`]).
//!
//! Nothing here touches the store or the network. The state layer reads what
//! is in use, calls these functions, and persists the answer in one store
//! transaction, so every result is reproducible from its inputs:
//! - node workload subnets, carved from the pod CIDRs or declared;
//! - the local view of a peer's CIDRs: the real CIDR when it collides with
//!   nothing in use here, else the first free block of the same length from
//!   the remap pools;
//! - translation of an address between a real CIDR and its view, keeping the
//!   host bits (what the gateway's prefix NAT does to packets).

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};

mod prefix;
#[cfg(test)]
mod tests6;
pub use prefix::Prefix;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IpamError {
    #[error("{0}")]
    Exhausted(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Invalid(String),
}

/// Which of a peer's networks a view is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CidrKind {
    Workload,
    External,
}

impl std::fmt::Display for CidrKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CidrKind::Workload => "workload",
            CidrKind::External => "external",
        })
    }
}

/// How this site addresses one of a peer's networks (of one family:
/// `N` is `Ipv4Net` or `Ipv6Net`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(bound = "N: Prefix")]
pub struct View<N = Ipv4Net> {
    pub kind: CidrKind,
    pub real: N,
    pub local: N,
    /// The remap pool `local` came from; `None` when `local == real`.
    pub pool: Option<N>,
}

impl<N: Prefix> View<N> {
    pub fn remapped(&self) -> bool {
        self.real != self.local
    }
}

pub fn overlaps<N: Prefix>(a: &N, b: &N) -> bool {
    a.first() <= b.last() && b.first() <= a.last()
}

/// Number of addresses in a block (a whole IPv6 space counts one short).
pub fn size<N: Prefix>(n: &N) -> u128 {
    prefix::span::<N>(n.plen()).saturating_add(1)
}

/// `blocks` as sorted, merged, inclusive address ranges.
fn merged<N: Prefix>(blocks: &[N]) -> Vec<(u128, u128)> {
    let mut r: Vec<(u128, u128)> = blocks.iter().map(|b| (b.first(), b.last())).collect();
    r.sort_unstable();
    let mut out: Vec<(u128, u128)> = Vec::with_capacity(r.len());
    for (s, e) in r {
        match out.last_mut() {
            Some(l) if l.1.checked_add(1).is_none_or(|next| s <= next) => l.1 = l.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// The lowest block of prefix length `len` inside `pool` that overlaps none
/// of `used`. Runs in time linear in `used`, however large the pool.
pub fn first_free<N: Prefix>(pool: N, len: u8, used: &[N]) -> Option<N> {
    if len < pool.plen() || len > N::MAX_LEN {
        return None;
    }
    let span = prefix::span::<N>(len);
    let end = pool.last();
    let mut cand = pool.first();
    for (s, e) in merged(used) {
        if e < cand {
            continue;
        }
        if cand + span < s {
            break;
        }
        // Overlaps [s, e]: jump to the first aligned block after it.
        cand = prefix::align_up(e.checked_add(1)?, span)?;
        if cand.checked_add(span)? > end {
            return None;
        }
    }
    (cand + span <= end).then(|| N::at(cand, len))
}

/// Total addresses of `blocks` (merged) that fall inside `pool`.
pub fn used_in<N: Prefix>(pool: &N, blocks: &[N]) -> u128 {
    merged(blocks)
        .into_iter()
        .map(|(s, e)| {
            let (s, e) = (s.max(pool.first()), e.min(pool.last()));
            if s <= e { (e - s).saturating_add(1) } else { 0 }
        })
        .fold(0u128, u128::saturating_add)
}

fn list<N: Prefix>(nets: &[N]) -> String {
    nets.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(", ")
}

/// A new node's workload subnet: the lowest free `/node_len` in the pod CIDRs
/// (taken in order). Returns the subnet and the pod CIDR it came from.
pub fn allocate_node_subnet<N: Prefix>(pod_cidrs: &[N], node_len: u8, taken: &[N]) -> Result<(N, N), IpamError> {
    for pod in pod_cidrs {
        if let Some(s) = first_free(*pod, node_len, taken) {
            return Ok((s, *pod));
        }
    }
    Err(IpamError::Exhausted(format!(
        "no free /{node_len} node subnet left in the pod CIDRs {} ({} node subnets in use); \
         add a pod CIDR or remove unused nodes",
        list(pod_cidrs),
        taken.len()
    )))
}

/// An overlay address for a new tunnel end: the lowest free host address of
/// the internal CIDR (never its network or broadcast address).
pub fn allocate_internal_ip(internal: Ipv4Net, taken: &[Ipv4Addr]) -> Result<Ipv4Addr, IpamError> {
    let mut used: Vec<Ipv4Net> = taken.iter().map(|a| Ipv4Net::new(*a, 32).unwrap()).collect();
    used.push(Ipv4Net::new(internal.network(), 32).unwrap());
    used.push(Ipv4Net::new(internal.broadcast(), 32).unwrap());
    first_free(internal, 32, &used).map(|n| n.addr()).ok_or_else(|| {
        IpamError::Exhausted(format!(
            "the internal CIDR {internal} has no free address for another node or gateway ({} in use); \
             use a larger internal_cidr",
            taken.len()
        ))
    })
}

/// Checks a subnet a node declares: inside one pod CIDR, overlapping no
/// other node's. `taken` pairs each node name with its subnet. Returns the
/// pod CIDR that holds it.
pub fn check_declared_subnet<N: Prefix>(subnet: N, pod_cidrs: &[N], taken: &[(String, N)]) -> Result<N, IpamError> {
    if subnet.plen() > N::MAX_LEN - 2 {
        return Err(IpamError::Invalid(format!(
            "subnet {subnet} leaves no room for workloads; declare a /{} or larger (the first address goes to the node)",
            N::MAX_LEN - 2
        )));
    }
    let Some(pod) = pod_cidrs.iter().find(|p| p.holds(&subnet)) else {
        return Err(IpamError::Invalid(format!(
            "subnet {subnet} is not inside any of the site's pod CIDRs ({}); \
             declare a subnet within one of them",
            list(pod_cidrs)
        )));
    };
    if let Some((name, s)) = taken.iter().find(|(_, s)| overlaps(s, &subnet)) {
        return Err(IpamError::Conflict(format!(
            "subnet {subnet} overlaps {s}, held by node {name:?}; declare a free subnet or omit it to get one allocated"
        )));
    }
    Ok(*pod)
}

/// The most CIDRs (workload and external) one peer may list.
pub const MAX_PEER_CIDRS: usize = 32;

/// Picks the local view of each of a peer's CIDRs.
///
/// `in_use` is everything this site already addresses: its own pod,
/// external and internal CIDRs, its reserved networks, and every other
/// peer's local views. A CIDR that collides with none of them keeps its real
/// value. The rest get, in order, the lowest free block of the same length
/// from `pools`, never colliding with `in_use` or with each other. The same
/// inputs always give the same answer.
///
/// A peer CIDR outside private space ([`Prefix::PRIVATE`]) is refused unless it
/// lies in one of `public_ok` (the site's `--peer-public-cidr` blocks), and
/// then it is always remapped: a peer never captures a public destination
/// of this site's hosts under its real address.
pub fn plan_views<N: Prefix>(
    peer: &[(CidrKind, N)],
    in_use: &[N],
    pools: &[N],
    public_ok: &[N],
) -> Result<Vec<View<N>>, IpamError> {
    plan_views_keeping(peer, in_use, pools, public_ok, &[], false)
}

/// [`plan_views`], where a CIDR to remap first takes the local block of a
/// view in `keep` of its kind and length, when that block is free: the
/// same site reached another way (directly, or through transit) keeps the
/// address this site's workloads already use for it. With `remap_all`,
/// no CIDR keeps its real value (what a transit peer offers is mapped into
/// this site's pools, never routed as it says).
pub fn plan_views_keeping<N: Prefix>(
    peer: &[(CidrKind, N)],
    in_use: &[N],
    pools: &[N],
    public_ok: &[N],
    keep_views: &[View<N>],
    remap_all: bool,
) -> Result<Vec<View<N>>, IpamError> {
    if peer.len() > MAX_PEER_CIDRS {
        return Err(IpamError::Invalid(format!(
            "the peer lists {} CIDRs; a site may have at most {MAX_PEER_CIDRS} (aggregate them)",
            peer.len()
        )));
    }
    for (i, (ka, a)) in peer.iter().enumerate() {
        if a.network_only() != *a {
            return Err(IpamError::Invalid(format!(
                "peer {ka} CIDR {a} has host bits set; the network is {}",
                a.network_only()
            )));
        }
        check_claimable(*ka, a)?;
        check_private(*ka, a, public_ok)?;
        for (kb, b) in &peer[i + 1..] {
            if overlaps(a, b) {
                return Err(IpamError::Invalid(format!(
                    "the peer's {ka} CIDR {a} overlaps its own {kb} CIDR {b}; a site's networks must be disjoint"
                )));
            }
        }
    }
    // First a block this site already uses for the same site (a kept
    // view) when free, then the CIDR's real value when private and free,
    // then the lowest free block of the pools.
    let mut used: Vec<N> = in_use.to_vec();
    let mut chosen: Vec<Option<(N, Option<N>)>> = vec![None; peer.len()];
    for ((kind, real), c) in peer.iter().zip(chosen.iter_mut()) {
        let kept = keep_views
            .iter()
            .filter(|v| v.kind == *kind && v.local.plen() == real.plen())
            .find(|v| !used.iter().any(|u| overlaps(u, &v.local)));
        if let Some(v) = kept {
            let pool = (v.local != *real)
                .then(|| v.pool.or_else(|| pools.iter().find(|p| p.holds(&v.local)).copied()))
                .flatten();
            *c = Some((v.local, pool));
            used.push(v.local);
        }
    }
    for ((_, real), c) in peer.iter().zip(chosen.iter_mut()) {
        if !remap_all && c.is_none() && is_private(real) && !used.iter().any(|u| overlaps(u, real)) {
            *c = Some((*real, None));
            used.push(*real);
        }
    }
    let mut views = Vec::with_capacity(peer.len());
    for ((kind, real), c) in peer.iter().zip(chosen) {
        let (local, pool) = match c {
            Some(c) => c,
            None => {
                let found = pools
                    .iter()
                    .find_map(|p| first_free(*p, real.plen(), &used).map(|b| (b, *p)));
                let Some((local, pool)) = found else {
                    return Err(IpamError::Exhausted(format!(
                        "the peer's {kind} CIDR {real} collides with a network in use here, and the remap pools \
                         ({}) have no free /{} left; add a remap pool or free one",
                        list(pools),
                        real.plen()
                    )));
                };
                used.push(local);
                (local, Some(pool))
            }
        };
        views.push(View {
            kind: *kind,
            real: *real,
            local,
            pool,
        });
    }
    Ok(views)
}

/// Refuses a peer CIDR that no site could own: larger than its family's
/// [`Prefix::MIN_CLAIM`] (a /8, a /32), or in special-purpose space. A peer
/// claiming 0.0.0.0/0 would otherwise take every destination of this
/// site's hosts.
pub fn check_claimable<N: Prefix>(kind: CidrKind, c: &N) -> Result<(), IpamError> {
    if c.plen() < N::MIN_CLAIM {
        return Err(IpamError::Invalid(format!(
            "the peer's {kind} CIDR {c} is larger than a /{}; a site claims only networks it routes",
            N::MIN_CLAIM
        )));
    }
    if let Some(u) = N::UNCLAIMABLE.iter().map(|u| N::constant(u)).find(|u| overlaps(u, c)) {
        return Err(IpamError::Invalid(format!(
            "the peer's {kind} CIDR {c} overlaps {u}, which no site can own (this-network, loopback, link-local or multicast space)"
        )));
    }
    Ok(())
}

/// Whether `c` lies wholly in one block of its family's private space.
pub fn is_private<N: Prefix>(c: &N) -> bool {
    N::PRIVATE.iter().map(|p| N::constant(p)).any(|p| p.holds(c))
}

/// Refuses a peer CIDR outside private space unless it lies wholly in one
/// of `public_ok` (where it is taken only through a remapped view).
pub fn check_private<N: Prefix>(kind: CidrKind, c: &N, public_ok: &[N]) -> Result<(), IpamError> {
    if is_private(c) || public_ok.iter().any(|b| b.holds(c)) {
        return Ok(());
    }
    Err(IpamError::Invalid(format!(
        "the peer's {kind} CIDR {c} is not private address space; a peer may announce only {} unless this site \
         allows the block with --peer-public-cidr (and then it is routed only through a remapped view)",
        N::PRIVATE.join(", ")
    )))
}

/// The unique local /40 a site remaps IPv6 views into when it names no
/// IPv6 pool: fd00::/8 and 32 random bits (RFC 4193 draws a 40-bit global
/// id for a site's /48; the first 32 of them name a /40, which holds 256
/// remapped /48s). `random`: from a CSPRNG. None when it would overlap one
/// of `avoid` (draw again).
pub fn ula_pool(random: [u8; 4], avoid: &[ipnet::Ipv6Net]) -> Option<ipnet::Ipv6Net> {
    let bits = (0xfdu128 << 120) | (u128::from(u32::from_be_bytes(random)) << 88);
    let pool = ipnet::Ipv6Net::new(std::net::Ipv6Addr::from(bits), 40).expect("a /40");
    (!avoid.iter().any(|a| overlaps(a, &pool))).then_some(pool)
}

/// Moves `addr` from block `from` to the same host bits in block `to`.
/// `None` when the blocks differ in length or `addr` is outside `from`.
pub fn translate<N: Prefix>(addr: N::Addr, from: N, to: N) -> Option<N::Addr> {
    if from.plen() != to.plen() || !from.holds_addr(addr) {
        return None;
    }
    let host = N::bits(addr) - from.first();
    Some(N::address(to.first() | host))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn n(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    #[test]
    fn first_free_skips_used_and_aligns() {
        let pool = n("10.0.0.0/16");
        assert_eq!(first_free(pool, 24, &[]), Some(n("10.0.0.0/24")));
        assert_eq!(first_free(pool, 24, &[n("10.0.0.0/24")]), Some(n("10.0.1.0/24")));
        // a small block in the way pushes to the next aligned /24
        assert_eq!(first_free(pool, 24, &[n("10.0.0.128/25")]), Some(n("10.0.1.0/24")));
        // gaps are reused
        assert_eq!(
            first_free(pool, 24, &[n("10.0.0.0/24"), n("10.0.2.0/24")]),
            Some(n("10.0.1.0/24"))
        );
        assert_eq!(first_free(pool, 16, &[n("10.0.255.255/32")]), None);
        assert_eq!(first_free(pool, 8, &[]), None, "larger than the pool");
        assert_eq!(
            first_free(n("10.0.0.0/8"), 30, &[n("10.0.0.0/9")]),
            Some(n("10.128.0.0/30"))
        );
    }

    #[test]
    fn node_subnets_fill_pods_in_order_then_exhaust() {
        let pods = [n("10.1.0.0/23"), n("10.9.0.0/24")];
        let mut taken = vec![];
        for want in ["10.1.0.0/24", "10.1.1.0/24", "10.9.0.0/24"] {
            let (s, _) = allocate_node_subnet(&pods, 24, &taken).unwrap();
            assert_eq!(s, n(want));
            taken.push(s);
        }
        let err = allocate_node_subnet(&pods, 24, &taken).unwrap_err();
        assert!(
            matches!(err, IpamError::Exhausted(ref m) if m.contains("10.1.0.0/23") && m.contains("/24")),
            "{err}"
        );
    }

    #[test]
    fn declared_subnet_must_fit_a_pod_and_not_overlap() {
        let pods = [n("10.1.0.0/16")];
        let taken = vec![("a".to_string(), n("10.1.0.0/24"))];
        assert_eq!(check_declared_subnet(n("10.1.5.0/26"), &pods, &taken).unwrap(), pods[0]);
        assert!(matches!(
            check_declared_subnet(n("10.2.0.0/24"), &pods, &taken),
            Err(IpamError::Invalid(_))
        ));
        let e = check_declared_subnet(n("10.1.0.0/23"), &pods, &taken).unwrap_err();
        assert!(matches!(e, IpamError::Conflict(ref m) if m.contains("\"a\"")), "{e}");
    }

    #[test]
    fn views_keep_real_when_free_and_remap_on_conflict() {
        let in_use = [
            n("10.1.0.0/16"),
            n("10.70.0.0/16"),
            n("10.80.0.0/16"),
            n("192.168.1.0/24"),
        ];
        let pools = [n("10.0.0.0/8"), n("172.16.0.0/12")];
        let v = plan_views(&[(CidrKind::Workload, n("10.2.0.0/16"))], &in_use, &pools, &[]).unwrap();
        assert_eq!(v[0].local, n("10.2.0.0/16"));
        assert!(!v[0].remapped());
        let v = plan_views(
            &[
                (CidrKind::Workload, n("10.1.0.0/16")),
                (CidrKind::External, n("10.70.0.0/16")),
            ],
            &in_use,
            &pools,
            &[],
        )
        .unwrap();
        assert_eq!(v[0].local, n("10.0.0.0/16"));
        assert_eq!(v[1].local, n("10.2.0.0/16"));
        assert_eq!(v[0].pool, Some(pools[0]));
        // a peer CIDR kept as real is never handed out as another's remap
        let v = plan_views(
            &[
                (CidrKind::Workload, n("10.1.0.0/16")),
                (CidrKind::Workload, n("10.0.0.0/16")),
            ],
            &in_use,
            &pools,
            &[],
        )
        .unwrap();
        assert_eq!(v[1].local, n("10.0.0.0/16"));
        assert_eq!(v[0].local, n("10.2.0.0/16"));
    }

    #[test]
    fn views_reject_self_overlap_and_report_exhaustion() {
        let e = plan_views(
            &[
                (CidrKind::Workload, n("10.1.0.0/16")),
                (CidrKind::External, n("10.1.5.0/24")),
            ],
            &[],
            &[],
            &[],
        )
        .unwrap_err();
        assert!(matches!(e, IpamError::Invalid(_)));
        let e = plan_views(
            &[(CidrKind::Workload, n("10.0.0.0/8"))],
            &[n("10.0.0.0/8")],
            &[n("172.16.0.0/12")],
            &[],
        )
        .unwrap_err();
        assert!(matches!(e, IpamError::Exhausted(ref m) if m.contains("/8")), "{e}");
    }

    #[test]
    fn public_peer_cidrs_are_refused_or_only_remapped() {
        let pools = [n("10.0.0.0/8")];
        for public in [
            "8.0.0.0/8",
            "1.1.1.0/24",
            "100.128.0.0/16",
            "172.32.0.0/16",
            "192.0.2.0/24",
        ] {
            let e = plan_views(&[(CidrKind::Workload, n(public))], &[], &pools, &[]).unwrap_err();
            assert!(
                matches!(e, IpamError::Invalid(ref m) if m.contains("not private") && m.contains(public)),
                "{e}"
            );
        }
        // RFC 1918 and RFC 6598 keep their real address when free.
        for private in ["10.7.0.0/16", "172.20.0.0/16", "192.168.4.0/24", "100.64.0.0/16"] {
            let v = plan_views(&[(CidrKind::Workload, n(private))], &[], &pools, &[]).unwrap();
            assert!(!v[0].remapped(), "{private}");
        }
        // Allowed: taken, but only through a remapped view.
        let v = plan_views(
            &[(CidrKind::External, n("1.1.1.0/24"))],
            &[],
            &pools,
            &[n("1.1.0.0/16")],
        )
        .unwrap();
        assert!(v[0].remapped());
        assert_eq!(v[0].local, n("10.0.0.0/24"));
        // A block only partly allowed is refused.
        assert!(plan_views(&[(CidrKind::External, n("1.0.0.0/8"))], &[], &pools, &[n("1.1.0.0/16")]).is_err());
    }

    #[test]
    fn internal_ips_skip_network_broadcast_and_taken() {
        let net = n("10.80.0.0/30");
        let a = allocate_internal_ip(net, &[]).unwrap();
        assert_eq!(a, Ipv4Addr::new(10, 80, 0, 1));
        let b = allocate_internal_ip(net, &[a]).unwrap();
        assert_eq!(b, Ipv4Addr::new(10, 80, 0, 2));
        assert!(matches!(
            allocate_internal_ip(net, &[a, b]),
            Err(IpamError::Exhausted(_))
        ));
    }

    #[test]
    fn translate_keeps_host_bits() {
        let a = Ipv4Addr::new(10, 1, 7, 9);
        assert_eq!(
            translate(a, n("10.1.0.0/16"), n("10.200.0.0/16")),
            Some(Ipv4Addr::new(10, 200, 7, 9))
        );
        assert_eq!(translate(a, n("10.1.0.0/16"), n("10.200.0.0/24")), None);
        assert_eq!(translate(a, n("10.2.0.0/16"), n("10.200.0.0/16")), None);
    }

    fn arb_net(min_len: u8) -> impl Strategy<Value = Ipv4Net> {
        (any::<u32>(), min_len..=30u8).prop_map(|(a, l)| Ipv4Net::new(Ipv4Addr::from(a), l).unwrap().trunc())
    }

    proptest! {
        #[test]
        fn property_node_allocations_never_overlap_and_stay_in_pods(
            pods in proptest::collection::vec(arb_net(14), 1..3),
            declared in proptest::collection::vec(arb_net(16), 0..6),
            len in 20u8..=28,
            count in 1usize..40,
        ) {
            let pods = ipnet::Ipv4Net::aggregate(&pods);
            let pods: Vec<Ipv4Net> = pods.into_iter().filter(|p| p.prefix_len() <= len).collect();
            prop_assume!(!pods.is_empty());
            let mut taken: Vec<(String, Ipv4Net)> = vec![];
            for (i, d) in declared.into_iter().enumerate() {
                if check_declared_subnet(d, &pods, &taken).is_ok() {
                    taken.push((format!("d{i}"), d));
                }
            }
            for i in 0..count {
                let nets: Vec<Ipv4Net> = taken.iter().map(|t| t.1).collect();
                match allocate_node_subnet(&pods, len, &nets) {
                    Ok((s, pod)) => {
                        prop_assert!(pod.contains(&s));
                        prop_assert_eq!(s.prefix_len(), len);
                        taken.push((format!("n{i}"), s));
                    }
                    Err(IpamError::Exhausted(_)) => {
                        let total: u128 = pods.iter().map(size).sum();
                        // exhaustion only when no aligned block is free anywhere
                        for p in &pods { prop_assert!(first_free(*p, len, &nets).is_none()); }
                        prop_assert!(used_in(&pods[0], &nets) <= total);
                        break;
                    }
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                }
            }
            for (i, (_, a)) in taken.iter().enumerate() {
                for (_, b) in &taken[i + 1..] {
                    prop_assert!(!overlaps(a, b), "{a} overlaps {b}");
                }
            }
        }

        #[test]
        fn property_views_never_collide_and_are_deterministic(
            in_use in proptest::collection::vec(arb_net(8), 0..8),
            peer in proptest::collection::vec(arb_net(12), 1..4),
            pools in proptest::collection::vec(arb_net(6), 0..3),
        ) {
            let kinds: Vec<(CidrKind, Ipv4Net)> = peer.iter().map(|p| (CidrKind::Workload, *p)).collect();
            // Every public block allowed: public CIDRs are then remapped.
            let anywhere = [n("0.0.0.0/0")];
            let first_try = plan_views(&kinds, &in_use, &pools, &anywhere);
            prop_assert_eq!(&first_try, &plan_views(&kinds, &in_use, &pools, &anywhere));
            if let Ok(views) = first_try {
                for (i, v) in views.iter().enumerate() {
                    prop_assert_eq!(v.local.prefix_len(), v.real.prefix_len());
                    if v.remapped() {
                        prop_assert!(!in_use.iter().any(|u| overlaps(u, &v.local)), "{} collides", v.local);
                        prop_assert!(v.pool.unwrap().contains(&v.local));
                    } else {
                        prop_assert!(!in_use.iter().any(|u| overlaps(u, &v.real)));
                        prop_assert!(is_private(&v.real), "{} kept its public address", v.real);
                    }
                    for w in &views[i + 1..] {
                        prop_assert!(!overlaps(&v.local, &w.local), "{} and {}", v.local, w.local);
                    }
                }
            }
        }

        #[test]
        fn property_translation_round_trips(net in arb_net(8), to in arb_net(8), host in any::<u32>()) {
            let to = Ipv4Net::new(to.network(), net.prefix_len()).unwrap().trunc();
            let addr = Ipv4Addr::from(u32::from(net.network()) | (host & u32::from(net.hostmask())));
            let there = translate(addr, net, to).unwrap();
            prop_assert!(to.contains(&there));
            prop_assert_eq!(translate(there, to, net), Some(addr));
        }

        #[test]
        fn property_first_free_is_lowest(pool in arb_net(16), used in proptest::collection::vec(arb_net(18), 0..6), len in 18u8..=26) {
            if let Some(b) = first_free(pool, len, &used) {
                prop_assert!(pool.contains(&b));
                prop_assert!(!used.iter().any(|u| overlaps(u, &b)));
                // no lower free aligned block exists
                let step = 1u32 << (32 - len);
                let mut a = u32::from(pool.network());
                while a < u32::from(b.network()) {
                    let c = Ipv4Net::new(Ipv4Addr::from(a), len).unwrap();
                    prop_assert!(used.iter().any(|u| overlaps(u, &c)), "{c} was free");
                    a += step;
                }
            }
        }
    }

    #[test]
    fn a_remapped_view_keeps_a_block_the_site_already_uses_for_it_when_free() {
        let pools = [n("10.200.0.0/13")];
        let peer = [(CidrKind::Workload, n("10.1.0.0/16"))];
        let in_use = [n("10.1.0.0/16"), n("10.200.0.0/16")];
        let kept = View {
            kind: CidrKind::Workload,
            real: n("10.203.0.0/16"),
            local: n("10.203.0.0/16"),
            pool: None,
        };
        let v = plan_views_keeping(&peer, &in_use, &pools, &[], std::slice::from_ref(&kept), false).unwrap();
        assert_eq!((v[0].local, v[0].pool), (n("10.203.0.0/16"), Some(pools[0])));
        // Taken meanwhile, or of another length or kind: the pool's next.
        let taken = [n("10.1.0.0/16"), n("10.200.0.0/16"), n("10.203.0.0/16")];
        let v = plan_views_keeping(&peer, &taken, &pools, &[], std::slice::from_ref(&kept), false).unwrap();
        assert_eq!(v[0].local, n("10.201.0.0/16"));
        let other = View {
            kind: CidrKind::External,
            ..kept
        };
        let v = plan_views_keeping(&peer, &in_use, &pools, &[], &[other], false).unwrap();
        assert_eq!(v[0].local, n("10.201.0.0/16"));
        // A CIDR free here still takes the block in use for its site: the
        // site's workloads keep addressing it as they did.
        let free = [(CidrKind::Workload, n("10.5.0.0/16"))];
        let v = plan_views_keeping(&free, &in_use, &pools, &[], std::slice::from_ref(&kept), false).unwrap();
        assert_eq!((v[0].local, v[0].pool), (n("10.203.0.0/16"), Some(pools[0])));
        assert_eq!(
            plan_views_keeping(&free, &in_use, &pools, &[], &[], false).unwrap()[0].local,
            n("10.5.0.0/16")
        );
        // What a transit peer offers is never routed at its real value.
        let v = plan_views_keeping(&free, &in_use, &pools, &[], &[], true).unwrap();
        assert_eq!((v[0].local, v[0].pool), (n("10.201.0.0/16"), Some(pools[0])));
    }
}
