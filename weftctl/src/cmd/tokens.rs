//! `weftctl token create|list|delete`: enrollment tokens.

use serde_json::json;
use weft_proto::v1 as pb;

use crate::cli::{RoleArg, TokenCmd};
use crate::out::*;

/// Creates, lists or deletes enrollment tokens.
pub async fn run(c: &mut Client, cmd: &TokenCmd) -> Result<Out, String> {
    Ok(match cmd {
        TokenCmd::Create { role, name, ttl, uses } => {
            let ttl =
                humantime::parse_duration(ttl).map_err(|e| format!("--ttl {ttl:?}: {e}; write e.g. 30m, 1h or 7d"))?;
            let role = match role {
                RoleArg::Node => pb::AgentRole::Node,
                RoleArg::Gateway => pb::AgentRole::Gateway,
            };
            let r = c
                .create_token(pb::CreateTokenRequest {
                    role: role as i32,
                    name: name.clone().unwrap_or_default(),
                    ttl_seconds: ttl.as_secs(),
                    uses: *uses,
                })
                .await
                .map_err(status)?
                .into_inner();
            let info = r.info.clone().unwrap_or_default();
            let agent = if role == pb::AgentRole::Node {
                "weft-node-agent"
            } else {
                "weft-gateway-agent"
            };
            let mut json = token_json(&info);
            json["token"] = json!(r.token);
            json["ca_fingerprint"] = json!(r.ca_fingerprint);
            Out {
                failed: false,
                json,
                header: vec![],
                rows: vec![
                    vec!["token".into(), r.token.clone()],
                    vec!["role".into(), agent_role(info.role)],
                    vec![
                        "name".into(),
                        if info.name.is_empty() {
                            "(chosen by the agent)".into()
                        } else {
                            info.name.clone()
                        },
                    ],
                    vec!["expires".into(), ts(&info.expires_at)],
                    vec!["uses".into(), info.uses_left.to_string()],
                    vec!["CA fingerprint".into(), r.ca_fingerprint.clone()],
                ],
                footer: vec![
                    String::new(),
                    "The token is not shown again. Enroll with:".into(),
                    format!(
                        "  {agent} --controller https://<controller>:7443 --token {} --ca-fingerprint {}",
                        r.token, r.ca_fingerprint
                    ),
                ],
            }
        }
        TokenCmd::List => {
            let r = c
                .list_tokens(pb::ListTokensRequest {})
                .await
                .map_err(status)?
                .into_inner();
            Out {
                failed: false,
                json: json!({"tokens": r.tokens.iter().map(token_json).collect::<Vec<_>>()}),
                header: vec!["ID", "ROLE", "NAME", "USES LEFT", "EXPIRES"],
                rows: r
                    .tokens
                    .iter()
                    .map(|t| {
                        vec![
                            t.id.clone(),
                            agent_role(t.role),
                            t.name.clone(),
                            t.uses_left.to_string(),
                            ts(&t.expires_at),
                        ]
                    })
                    .collect(),
                footer: vec![],
            }
        }
        TokenCmd::Delete { id } => {
            c.delete_token(pb::DeleteTokenRequest { id: id.clone() })
                .await
                .map_err(status)?;
            Out {
                failed: false,
                json: json!({"deleted": id}),
                header: vec![],
                rows: vec![vec![format!("deleted token {id}")]],
                footer: vec![],
            }
        }
    })
}
