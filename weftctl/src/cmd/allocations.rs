//! `weftctl allocations`: IPAM allocations and pool usage.

use serde_json::json;
use weft_proto::v1 as pb;

use crate::out::*;

/// Lists allocations and pool usage.
pub async fn run(c: &mut Client) -> Result<Out, String> {
    Ok({
        let r = c
            .list_allocations(pb::ListAllocationsRequest {})
            .await
            .map_err(status)?
            .into_inner();
        let footer = r
            .pools
            .iter()
            .map(|p| {
                // An IPv6 pool is counted in /64s (each holds 2^64
                // addresses); an IPv4 one in addresses.
                let exact = |text: &str, saturated: u64| text.parse::<u128>().unwrap_or(u128::from(saturated));
                let (allocated, total) = (
                    exact(&p.allocated, p.allocated_addresses),
                    exact(&p.total, p.total_addresses),
                );
                // (A part of a /64 counts as one: an external CIDR's view
                // may be smaller.)
                let (allocated, total, unit) = if p.pool.contains(':') && total >> 64 > 0 {
                    (allocated.div_ceil(1 << 64), total >> 64, "/64s")
                } else {
                    (allocated, total, "addresses")
                };
                format!(
                    "pool {} ({}): {allocated} of {total} {unit} allocated",
                    p.pool,
                    alloc_kind(p.kind)
                )
            })
            .collect();
        Out {
            failed: false,
            json: json!({
                "allocations": r.allocations.iter().map(|a| json!({
                    "cidr": a.cidr, "kind": alloc_kind(a.kind), "owner": a.owner, "pool": a.pool,
                })).collect::<Vec<_>>(),
                "pools": r.pools.iter().map(|p| json!({
                    "pool": p.pool, "kind": alloc_kind(p.kind),
                    "total_addresses": p.total_addresses, "allocated_addresses": p.allocated_addresses,
                    "total": p.total, "allocated": p.allocated,
                })).collect::<Vec<_>>(),
                "revision": r.revision,
            }),
            header: vec!["CIDR", "KIND", "OWNER", "POOL"],
            rows: r
                .allocations
                .iter()
                .map(|a| vec![a.cidr.clone(), alloc_kind(a.kind), a.owner.clone(), a.pool.clone()])
                .collect(),
            footer,
        }
    })
}
