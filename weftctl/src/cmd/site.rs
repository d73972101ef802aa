//! `weftctl site`: the site's configuration.

use serde_json::json;
use weft_proto::v1 as pb;

use crate::out::*;

fn none_if_empty(s: &str) -> String {
    if s.is_empty() { "none".into() } else { s.to_string() }
}

/// Shows the site.
pub async fn run(c: &mut Client) -> Result<Out, String> {
    Ok({
        let s = c.get_site(pb::GetSiteRequest {}).await.map_err(status)?.into_inner();
        let rows = vec![
            vec!["site".into(), s.id.clone()],
            vec!["pod CIDRs".into(), s.pod_cidrs.join(", ")],
            vec!["external CIDR".into(), s.external_cidr.clone()],
            vec!["external CIDR (IPv6)".into(), none_if_empty(&s.external_cidr_v6)],
            vec!["internal CIDR".into(), s.internal_cidr.clone()],
            vec!["reserved".into(), s.reserved_cidrs.join(", ")],
            vec!["remap pools".into(), s.remap_pools.join(", ")],
            vec!["node prefix".into(), format!("/{}", s.node_prefix_len)],
            vec!["revision".into(), s.revision.to_string()],
            vec!["CA fingerprint".into(), s.ca_fingerprint.clone()],
        ];
        Out {
            failed: false,
            json: json!({
                "id": s.id, "pod_cidrs": s.pod_cidrs, "external_cidr": s.external_cidr,
                "external_cidr_v6": s.external_cidr_v6,
                "internal_cidr": s.internal_cidr, "reserved_cidrs": s.reserved_cidrs,
                "remap_pools": s.remap_pools, "node_prefix_len": s.node_prefix_len, "revision": s.revision,
                "ca_fingerprint": s.ca_fingerprint,
            }),
            header: vec![],
            rows,
            footer: vec![],
        }
    })
}
