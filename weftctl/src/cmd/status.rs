//! `weftctl status`: one screen of the site, its gateways (active and
//! standby), nodes and peerings.

use serde_json::json;
use weft_proto::v1 as pb;

use crate::out::*;

pub(crate) fn rtt(t: Option<&pb::TunnelStatus>) -> String {
    match t {
        Some(t) if t.up => format!("{:.2}ms", t.rtt_micros as f64 / 1000.0),
        _ => "-".into(),
    }
}

pub(crate) fn tunnel_state(t: Option<&pb::TunnelStatus>) -> &'static str {
    match t {
        Some(t) if t.up => "up",
        Some(_) => "down",
        None => "unknown",
    }
}

/// Everything `status` and `topology` show.
#[derive(Clone)]
pub(crate) struct Site {
    pub(crate) site: pb::Site,
    pub(crate) gateways: Vec<pb::Gateway>,
    pub(crate) nodes: Vec<pb::Node>,
    pub(crate) peerings: Vec<pb::Peering>,
    /// Joins this controller refused lately, newest first.
    pub(crate) refused_joins: Vec<pb::RefusedJoin>,
    /// The latest failover as the answering replica saw it.
    pub(crate) last_failover: Option<pb::FailoverTimeline>,
}

pub(crate) async fn site(c: &mut Client) -> Result<Site, String> {
    let peerings = c
        .list_peerings(pb::ListPeeringsRequest {})
        .await
        .map_err(status)?
        .into_inner();
    let gateways = c
        .list_gateways(pb::ListGatewaysRequest {})
        .await
        .map_err(status)?
        .into_inner();
    Ok(Site {
        site: c.get_site(pb::GetSiteRequest {}).await.map_err(status)?.into_inner(),
        gateways: gateways.gateways,
        last_failover: gateways.last_failover,
        nodes: c
            .list_nodes(pb::ListNodesRequest {})
            .await
            .map_err(status)?
            .into_inner()
            .nodes,
        peerings: peerings.peerings,
        refused_joins: peerings.refused_joins,
    })
}

/// `weftctl status`: the site, its gateways, nodes and peerings on one screen.
pub async fn run(c: &mut Client) -> Result<Out, String> {
    let s = site(c).await?;
    let mut out = format!(
        "Site {}  pods {}  revision {}\n\n",
        s.site.id,
        s.site.pod_cidrs.join(","),
        s.site.revision
    );
    let gw_rows: Vec<Vec<String>> = s
        .gateways
        .iter()
        .map(|g| {
            vec![
                g.name.clone(),
                if g.active { "active" } else { "standby" }.into(),
                ready_cell(&g.status, g.cert_expires_at.is_some()).into(),
                if g.endpoint.is_empty() {
                    "-".into()
                } else {
                    g.endpoint.clone()
                },
                if g.nat.is_empty() { "-".into() } else { g.nat.clone() },
                revision_cell(&g.status),
            ]
        })
        .collect();
    out += &table(&["GATEWAY", "ROLE", "READY", "ENDPOINT", "NAT", "REVISION"], &gw_rows);
    out += "\n";
    let node_rows: Vec<Vec<String>> = s
        .nodes
        .iter()
        .map(|n| {
            let errors = n.status.as_ref().map_or(0, |s| s.errors.len());
            vec![
                n.name.clone(),
                ready_cell(&n.status, n.cert_expires_at.is_some()).into(),
                subnets(n),
                revision_cell(&n.status),
                if errors == 0 {
                    "-".into()
                } else {
                    format!("{errors} failed")
                },
            ]
        })
        .collect();
    out += &table(&["NODE", "READY", "SUBNET", "REVISION", "ERRORS"], &node_rows);
    out += "\n";
    let peer_rows: Vec<Vec<String>> = s
        .peerings
        .iter()
        .map(|p| {
            let views: Vec<String> = p
                .views
                .iter()
                .map(|v| {
                    if v.remapped {
                        format!("{}→{}", v.real_cidr, v.local_cidr)
                    } else {
                        v.real_cidr.clone()
                    }
                })
                .collect();
            vec![
                p.site_id.clone(),
                peering_state(p.state),
                tunnel_state(p.tunnel.as_ref()).into(),
                path_cell(p.tunnel.as_ref()),
                rtt(p.tunnel.as_ref()),
                views.join(" "),
                if p.last_error.is_empty() {
                    "-".into()
                } else {
                    p.last_error.clone()
                },
            ]
        })
        .collect();
    out += &table(
        &[
            "PEERING",
            "STATE",
            "TUNNEL",
            "PATH",
            "RTT",
            "VIEWS (REAL→LOCAL)",
            "LAST ERROR",
        ],
        &peer_rows,
    );
    for p in s.peerings.iter().filter(|p| !p.waiting_for.is_empty()) {
        out += &format!("{}: connecting, waiting for {}\n", p.site_id, p.waiting_for.join("; "));
    }
    for r in &s.refused_joins {
        out += &super::peerings::refused_line(r);
        out += "\n";
    }
    if let Some(f) = &s.last_failover {
        out += &failover_text(f);
    }
    let mut o = text(out);
    o.json = json!({
        "refused_joins": s.refused_joins.iter().map(super::peerings::refused_json).collect::<Vec<_>>(),
        "site": s.site.id, "revision": s.site.revision,
        "gateways": s.gateways.iter().map(|g| json!({"name": g.name, "active": g.active,
            "ready": g.status.as_ref().is_some_and(|s| s.ready), "endpoint": g.endpoint, "nat": g.nat, "revision": revision_cell(&g.status)})).collect::<Vec<_>>(),
        "nodes": s.nodes.iter().map(|n| json!({"name": n.name, "subnet": n.subnet, "subnet_v6": n.subnet_v6,
            "ready": n.status.as_ref().is_some_and(|s| s.ready), "revision": revision_cell(&n.status),
            "errors": n.status.as_ref().map(|s| s.errors.clone()).unwrap_or_default()})).collect::<Vec<_>>(),
        "peerings": s.peerings.iter().map(|p| json!({"site_id": p.site_id, "state": peering_state(p.state), "waiting_for": p.waiting_for,
            "tunnel": tunnel_state(p.tunnel.as_ref()), "path": p.tunnel.as_ref().map(|t| t.path.clone()), "rtt_ms": p.tunnel.as_ref().filter(|t| t.up).map(|t| t.rtt_micros as f64 / 1000.0),
            "views": p.views.iter().map(|v| json!({"kind": cidr_kind(v.kind), "real_cidr": v.real_cidr, "local_cidr": v.local_cidr})).collect::<Vec<_>>(),
            "last_error": p.last_error})).collect::<Vec<_>>(),
        "last_failover": s.last_failover.as_ref().map(failover_json),
    });
    Ok(o)
}

/// The latest failover's timeline: one row per step, from the fault.
fn failover_text(f: &pb::FailoverTimeline) -> String {
    let at = f
        .steps
        .first()
        .and_then(|s| s.first.as_ref())
        .map_or("-".to_string(), timestamp);
    let mut out = format!(
        "\nLast failover: {} → {} at {at} (seen by replica {}{})\n",
        f.from,
        f.to,
        f.replica,
        if f.complete { "" } else { "; in progress" }
    );
    let rows: Vec<Vec<String>> = f
        .steps
        .iter()
        .map(|s| {
            vec![
                s.step.clone(),
                format!("+{} ms", s.offset_ms),
                s.count.to_string(),
                if s.last_subject.is_empty() {
                    "-".into()
                } else {
                    s.last_subject.clone()
                },
            ]
        })
        .collect();
    out += &table(&["STEP", "AT (FROM THE FAULT)", "COUNT", "LAST"], &rows);
    if !f.waiting.is_empty() {
        out += &format!(
            "{}: {}\n",
            if f.complete { "never came" } else { "waiting for" },
            f.waiting.join(" ")
        );
    }
    out
}

fn failover_json(f: &pb::FailoverTimeline) -> serde_json::Value {
    json!({"from": f.from, "to": f.to, "replica": f.replica, "complete": f.complete, "waiting": f.waiting,
        "steps": f.steps.iter().map(|s| json!({"step": s.step, "offset_ms": s.offset_ms, "count": s.count,
            "last_subject": s.last_subject, "first": s.first.as_ref().map(timestamp),
            "last": s.last.as_ref().map(timestamp)})).collect::<Vec<_>>()})
}

/// RFC 3339 with milliseconds (UTC).
fn timestamp(t: &prost_types::Timestamp) -> String {
    let whole = ts(&Some(*t));
    format!("{}.{:03}Z", whole.trim_end_matches('Z'), t.nanos / 1_000_000)
}
