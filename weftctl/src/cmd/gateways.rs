//! `weftctl gateways`, `weftctl gateway remove` and `weftctl gateway accept-key`.

use serde_json::json;
use weft_proto::v1 as pb;

use crate::cli::GatewayCmd;
use crate::out::*;

/// Lists gateways.
pub async fn list(c: &mut Client) -> Result<Out, String> {
    Ok({
        let r = c
            .list_gateways(pb::ListGatewaysRequest {})
            .await
            .map_err(status)?
            .into_inner();
        Out {
            failed: false,
            json: json!({"gateways": r.gateways.iter().map(|g| json!({
            "name": g.name, "endpoint": g.endpoint, "public_key": g.public_key, "created_at": ts(&g.created_at),
            "cert_expires_at": ts(&g.cert_expires_at), "internal_ip": g.internal_ip, "underlay_ip": g.underlay_ip, "geneve": g.geneve, "active": g.active,
            "pending_public_key": g.pending_public_key, "identity_conflict": g.identity_conflict, "nat": g.nat,
            "wireguard": g.status.as_ref().and_then(|s| s.host.as_ref()).map(|h| h.wireguard.clone()).unwrap_or_default(),
            "status": status_json(&g.status),
        })).collect::<Vec<_>>(), "revision": r.revision}),
            header: vec![
                "NAME",
                "UNDERLAY",
                "ENDPOINT",
                "NAT",
                "INTERNAL",
                "WIREGUARD",
                "READY",
                "APPLIED/LATEST",
                "LAST SEEN",
                "ERRORS",
            ],
            rows: r
                .gateways
                .iter()
                .map(|g| {
                    let endpoint = if g.endpoint.is_empty() {
                        "-".into()
                    } else {
                        g.endpoint.clone()
                    };
                    let wireguard = match g.status.as_ref().and_then(|s| s.host.as_ref()) {
                        Some(h) if !h.wireguard.is_empty() => h.wireguard.clone(),
                        _ => "-".into(),
                    };
                    let mut row = vec![
                        g.name.clone(),
                        g.underlay_ip.clone(),
                        endpoint,
                        if g.nat.is_empty() { "-".into() } else { g.nat.clone() },
                        g.internal_ip.clone(),
                        wireguard,
                    ];
                    row.extend(status_cols(&g.status, g.cert_expires_at.is_some()));
                    row
                })
                .collect(),
            footer: r
                .gateways
                .iter()
                .filter(|g| !g.pending_public_key.is_empty())
                .map(|g| {
                    format!(
                        "{} asks to change its WireGuard key to {}; peers keep the current one until \
                         `weftctl gateway accept-key {} {}` (if its host logged that key)",
                        g.name, g.pending_public_key, g.name, g.pending_public_key
                    )
                })
                .chain(
                    r.gateways
                        .iter()
                        .filter(|g| !g.identity_conflict.is_empty())
                        .map(|g| format!("{}: {}", g.name, g.identity_conflict)),
                )
                .collect(),
        }
    })
}

/// Removes a gateway, or accepts the new key it asked for.
pub async fn run(c: &mut Client, cmd: &GatewayCmd) -> Result<Out, String> {
    Ok(match cmd {
        GatewayCmd::Remove { name } => {
            c.delete_gateway(pb::DeleteGatewayRequest { name: name.clone() })
                .await
                .map_err(status)?;
            Out {
                failed: false,
                json: json!({"removed": name}),
                header: vec![],
                rows: vec![vec![format!("removed gateway {name}; its certificate is revoked")]],
                footer: vec![],
            }
        }
        GatewayCmd::AcceptKey { name, key } => {
            let g = c
                .accept_gateway_key(pb::AcceptGatewayKeyRequest {
                    name: name.clone(),
                    public_key: key.clone(),
                })
                .await
                .map_err(status)?
                .into_inner();
            Out {
                failed: false,
                json: json!({"name": g.name, "public_key": g.public_key}),
                header: vec![],
                rows: vec![vec![format!(
                    "gateway {name} now uses WireGuard key {}; peers get it at once",
                    g.public_key
                )]],
                footer: vec![],
            }
        }
    })
}
