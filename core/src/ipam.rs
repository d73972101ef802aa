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
mod tests;
