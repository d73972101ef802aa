//! `weftctl version`: which releases run where: this client, the
//! controller, each agent (as it last reported) and each peer's controller
//! (as it said), and whether each is within the supported skew
//! (`weft_types::version`: agents the controller's release or one minor
//! older, peers one minor apart).

use serde_json::json;
use weft_proto::v1 as pb;

use crate::out::*;

/// What the agent reported, or "-" (not reported yet, or a release before
/// 0.1.0, which does not say).
fn reported(s: Option<&pb::AgentStatus>) -> String {
    s.and_then(|s| s.host.as_ref())
        .map(|h| h.version.clone())
        .filter(|v| !v.is_empty())
        .unwrap_or_default()
}

fn cell(v: &str) -> String {
    if v.is_empty() { "-".into() } else { v.to_string() }
}

/// Shows the releases.
pub async fn run(c: &mut Client) -> Result<Out, String> {
    let client = env!("CARGO_PKG_VERSION");
    let site = c.get_site(pb::GetSiteRequest {}).await.map_err(status)?.into_inner();
    let controller = site.controller_version.clone();
    let nodes = c
        .list_nodes(pb::ListNodesRequest {})
        .await
        .map_err(status)?
        .into_inner()
        .nodes;
    let gateways = c
        .list_gateways(pb::ListGatewaysRequest {})
        .await
        .map_err(status)?
        .into_inner()
        .gateways;
    let peerings = c
        .list_peerings(pb::ListPeeringsRequest {})
        .await
        .map_err(status)?
        .into_inner()
        .peerings;
    let mut rows = vec![
        vec!["client".into(), "weftctl".into(), client.into(), String::new()],
        vec!["controller".into(), site.id.clone(), cell(&controller), String::new()],
    ];
    let mut agents = Vec::new();
    let mut outside = 0;
    let agent_rows = gateways
        .iter()
        .map(|g| {
            (
                "gateway",
                g.name.as_str(),
                reported(g.status.as_ref()),
                g.status.as_ref().is_some_and(|s| s.ready),
            )
        })
        .chain(nodes.iter().map(|n| {
            (
                "node",
                n.name.as_str(),
                reported(n.status.as_ref()),
                n.status.as_ref().is_some_and(|s| s.ready),
            )
        }));
    for (role, name, v, ready) in agent_rows {
        // An agent not connected says nothing now: not judged.
        let skew = ready
            .then(|| weft_types::version::agent_skew(&controller, &v))
            .flatten();
        outside += usize::from(skew.is_some());
        rows.push(vec![
            role.into(),
            name.into(),
            cell(&v),
            skew.clone().unwrap_or_default(),
        ]);
        agents.push(json!({"role": role, "name": name, "version": v, "connected": ready, "outside_policy": skew}));
    }
    let mut peers = Vec::new();
    for p in &peerings {
        let skew = weft_types::version::peer_skew(&controller, &p.peer_version);
        outside += usize::from(skew.is_some());
        rows.push(vec![
            "peer".into(),
            p.site_id.clone(),
            cell(&p.peer_version),
            skew.clone().unwrap_or_default(),
        ]);
        peers.push(json!({"site": p.site_id, "version": p.peer_version, "outside_policy": skew}));
    }
    let footer = if outside > 0 {
        vec![format!(
            "{outside} outside the supported skew: agents run their controller's release or one minor older, \
             peered sites at most one minor apart; upgrade controllers first"
        )]
    } else {
        vec![]
    };
    Ok(Out {
        failed: false,
        json: json!({"client": client, "controller": controller, "site": site.id, "agents": agents, "peers": peers}),
        header: vec!["WHAT", "NAME", "VERSION", "OUTSIDE THE POLICY"],
        rows,
        footer,
    })
}
