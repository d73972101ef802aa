//! `weftctl nodes` and `weftctl node get|add|remove`.

use serde_json::json;
use weft_proto::v1 as pb;

use crate::cli::NodeCmd;
use crate::out::*;

/// Lists nodes.
pub async fn list(c: &mut Client) -> Result<Out, String> {
    Ok({
        let r = c
            .list_nodes(pb::ListNodesRequest {})
            .await
            .map_err(status)?
            .into_inner();
        Out {
            failed: false,
            json: json!({"nodes": r.nodes.iter().map(node_json).collect::<Vec<_>>(), "revision": r.revision}),
            header: NODE_HEADER.to_vec(),
            rows: r.nodes.iter().map(node_row).collect(),
            footer: r
                .nodes
                .iter()
                .filter(|n| !n.identity_conflict.is_empty())
                .map(|n| format!("{}: {}", n.name, n.identity_conflict))
                .collect(),
        }
    })
}

/// One node: show, add or remove.
pub async fn run(c: &mut Client, cmd: &NodeCmd) -> Result<Out, String> {
    Ok({
        let n = match cmd {
            NodeCmd::Get { name } => c.get_node(pb::GetNodeRequest { name: name.clone() }).await,
            NodeCmd::Add { name, subnet } => {
                c.create_node(pb::CreateNodeRequest {
                    name: name.clone(),
                    subnet: subnet.clone().unwrap_or_default(),
                })
                .await
            }
            NodeCmd::Remove { name } => {
                let r = c
                    .delete_node(pb::DeleteNodeRequest { name: name.clone() })
                    .await
                    .map_err(status)?;
                let released = r.into_inner().released_subnet;
                return Ok(Out {
                    failed: false,
                    json: json!({"removed": name, "released_subnet": released}),
                    header: vec![],
                    rows: vec![vec![format!("removed node {name}, released {released}")]],
                    footer: vec![],
                });
            }
        }
        .map_err(status)?
        .into_inner();
        Out {
            failed: false,
            json: node_json(&n),
            header: NODE_HEADER.to_vec(),
            rows: vec![node_row(&n)],
            footer: vec![],
        }
    })
}
