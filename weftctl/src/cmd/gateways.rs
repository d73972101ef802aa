//! `weftctl gateways` and `weftctl gateway remove`.

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
            "wireguard": g.status.as_ref().and_then(|s| s.host.as_ref()).map(|h| h.wireguard.clone()).unwrap_or_default(),
            "status": status_json(&g.status),
        })).collect::<Vec<_>>(), "revision": r.revision}),
            header: vec![
                "NAME",
                "UNDERLAY",
                "ENDPOINT",
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
                        g.internal_ip.clone(),
                        wireguard,
                    ];
                    row.extend(status_cols(&g.status, g.cert_expires_at.is_some()));
                    row
                })
                .collect(),
            footer: vec![],
        }
    })
}

/// Removes a gateway.
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
    })
}
