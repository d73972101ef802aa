//! `weftctl peerings`, `weftctl peering token|create|delete|accept` and
//! `weftctl plan-view`.

use serde_json::json;
use weft_proto::v1 as pb;

use crate::cli::PeeringCmd;
use crate::out::*;

/// Lists peerings with their local views.
pub async fn list(c: &mut Client) -> Result<Out, String> {
    let r = c
        .list_peerings(pb::ListPeeringsRequest {})
        .await
        .map_err(status)?
        .into_inner();
    Ok(Out {
        failed: false,
        json: json!({
            "peerings": r.peerings.iter().map(peering_json).collect::<Vec<_>>(),
            "revision": r.revision,
            "refused_joins": r.refused_joins.iter().map(refused_json).collect::<Vec<_>>(),
        }),
        header: PEERINGS_HEADER.to_vec(),
        rows: peering_rows(&r),
        footer: peering_notes(&r),
    })
}

/// The columns of `weftctl peerings`.
const PEERINGS_HEADER: &[&str] = &[
    "PEER",
    "STATE",
    "ROLE",
    "PORT",
    "DIALS",
    "PATH",
    "TUNNEL",
    "RTT",
    "HANDSHAKE",
    "RX",
    "TX",
    "KIND",
    "REAL CIDR",
    "LOCAL VIEW",
    "LAST ERROR",
];

/// A row per view of each peering, then a row per view of each site
/// reached through it.
fn peering_rows(r: &pb::ListPeeringsResponse) -> Vec<Vec<String>> {
    let mut rows = Vec::new();
    for p in &r.peerings {
        // The tunnel's health on the peering's first row only.
        let mut health = tunnel_cells(p.tunnel.as_ref());
        // Where the tunnel is reached: this site's UDP port, and the
        // endpoint this site dials (the peer's active gateway), if any.
        let dials = p
            .remote_gateways
            .iter()
            .find(|g| g.active && !g.endpoint.is_empty())
            .or_else(|| p.remote_gateways.iter().find(|g| !g.endpoint.is_empty()))
            .map_or_else(|| "-".to_string(), |g| g.endpoint.clone());
        let mut reach = vec![p.listen_port.to_string(), dials, path_cell(p.tunnel.as_ref())];
        for v in &p.views {
            let mut row = vec![p.site_id.clone(), peering_state(p.state), p.tunnel_role.clone()];
            row.append(&mut reach);
            reach = vec![String::new(); 3];
            row.append(&mut health);
            health = vec![String::new(); 5];
            row.extend([
                cidr_kind(v.kind),
                v.real_cidr.clone(),
                v.local_cidr.clone(),
                p.last_error.clone(),
            ]);
            rows.push(row);
        }
        // Sites reached through this peer (transit), under it.
        for t in &p.transit_paths {
            let state = if t.active { "transit" } else { "unused" };
            for v in &t.views {
                let mut row = vec![format!("{} via {}", t.site, p.site_id), state.to_string()];
                row.extend(vec![String::new(); 9]);
                // Its CIDR as the transit peer addresses it.
                row.extend([
                    cidr_kind(v.kind),
                    format!("{} ({}'s view)", v.real_cidr, p.site_id),
                    v.local_cidr.clone(),
                    String::new(),
                ]);
                rows.push(row);
            }
        }
    }
    rows
}

/// One peering, whole, as `--json` gives it.
fn peering_json(p: &pb::Peering) -> serde_json::Value {
    json!({
        "site_id": p.site_id, "state": peering_state(p.state), "waiting_for": p.waiting_for,
        "views": p.views.iter().map(view_json).collect::<Vec<_>>(), "ipv4": p.ipv4, "ipv6": p.ipv6,
        "created_at": ts(&p.created_at), "last_error": p.last_error, "tunnel_role": p.tunnel_role,
        "remote_endpoints": p.remote_endpoints, "remote_ca_fingerprint": p.remote_ca_fingerprint,
        "listen_port": p.listen_port, "held_by_peer": p.held_by_peer,
        "export": p.export.as_ref().map(super::policy::policy_json),
        "transit": transit_json(p),
        "peer_exports": p.peer_exports_limited.then_some(&p.peer_exports),
        "pending": (!p.pending_workload_cidrs.is_empty() || !p.pending_external_cidr.is_empty()).then(|| json!({
            "workload_cidrs": p.pending_workload_cidrs, "external_cidr": p.pending_external_cidr,
            "since": ts(&p.pending_since),
        })),
        "pending_v6": (!p.pending_workload_cidrs_v6.is_empty() || !p.pending_external_cidr_v6.is_empty()).then(|| json!({
            "workload_cidrs": p.pending_workload_cidrs_v6, "external_cidr": p.pending_external_cidr_v6,
            "since": ts(&p.pending_since_v6),
        })),
        "local_gateways": p.local_gateways.iter().map(gateway_info_json).collect::<Vec<_>>(),
        "remote_gateways": p.remote_gateways.iter().map(gateway_info_json).collect::<Vec<_>>(),
        "tunnel": p.tunnel.as_ref().map(|t| json!({
            "up": t.up, "rtt_ms": t.rtt_micros as f64 / 1000.0,
            "last_handshake": ts(&t.last_handshake), "rx_bytes": t.rx_bytes, "tx_bytes": t.tx_bytes,
            "probes_sent": t.probes_sent, "probes_lost": t.probes_lost, "link": t.link,
            "gateway": t.gateway, "reported_at": ts(&t.reported_at),
            "dropped_from_tunnel": t.dropped_from_tunnel, "dropped_by_policy": t.dropped_by_policy,
            "path": t.path, "over_tls": t.over_tls, "nat": t.nat,
            "candidates": t.candidates.iter().map(|c| json!({"address": c.address, "kind": c.kind})).collect::<Vec<_>>(),
        })),
    })
}

/// The lines under the table: what waits, what is refused or limited,
/// transit, and refused joins.
fn peering_notes(r: &pb::ListPeeringsResponse) -> Vec<String> {
    r.peerings
        .iter()
        .filter(|p| !p.waiting_for.is_empty())
        .map(|p| format!("{}: connecting, waiting for {}", p.site_id, p.waiting_for.join("; ")))
        .chain(
            r.peerings
                .iter()
                .filter_map(|p| p.tunnel.as_ref().map(|t| (p, t.dropped_from_tunnel)))
                .filter(|(_, n)| *n > 0)
                .map(|(p, n)| {
                    format!(
                        "{}: {n} packets from the tunnel dropped (addressed outside this site's networks)",
                        p.site_id
                    )
                }),
        )
        .chain(
            r.peerings
                .iter()
                .filter_map(|p| p.export.as_ref().and_then(super::policy::unenforced)),
        )
        // IPv4 when one side is IPv6-only; IPv6 when either side has it.
        .chain(
            r.peerings
                .iter()
                .filter(|p| p.ipv4.starts_with("not"))
                .map(|p| format!("{}: IPv4 {}", p.site_id, p.ipv4)),
        )
        .chain(
            r.peerings
                .iter()
                .filter(|p| !p.ipv6.is_empty())
                .map(|p| format!("{}: IPv6 {}", p.site_id, p.ipv6)),
        )
        .chain(r.peerings.iter().filter_map(|p| {
            let e = p
                .export
                .as_ref()
                .filter(|e| e.effective != pb::ExportMode::All as i32)?;
            let refused = p.tunnel.as_ref().map_or(0, |t| t.dropped_by_policy);
            Some(format!(
                "{} may reach only: {} ({refused} packets refused by the policy)",
                p.site_id,
                super::policy::summary(e)
            ))
        }))
        .chain(r.peerings.iter().filter(|p| p.peer_exports_limited).map(|p| {
            let what = if p.peer_exports.is_empty() {
                "nothing".to_string()
            } else {
                p.peer_exports.join(", ")
            };
            format!(
                "{} lets this site reach only: {what} (its CIDRs, before this site's view)",
                p.site_id
            )
        }))
        .chain(r.peerings.iter().flat_map(|p| {
            let held = |workload: &[String], external: &str| {
                let mut cidrs = workload.to_vec();
                cidrs.extend(Some(external.to_string()).filter(|c| !c.is_empty()));
                (!cidrs.is_empty()).then(|| {
                    format!(
                        "{} announced {} instead; not routed until `weftctl peering accept {}`",
                        p.site_id,
                        cidrs.join(" "),
                        p.site_id
                    )
                })
            };
            [
                held(&p.pending_workload_cidrs, &p.pending_external_cidr),
                held(&p.pending_workload_cidrs_v6, &p.pending_external_cidr_v6),
            ]
            .into_iter()
            .flatten()
        }))
        .chain(r.peerings.iter().filter(|p| p.transit || p.peer_transit).map(|p| {
            let onward = if p.transit_onward.is_empty() {
                String::new()
            } else {
                let counts: Vec<String> = p
                    .transit_onward
                    .iter()
                    .map(|s| {
                        let n = p
                            .tunnel
                            .iter()
                            .flat_map(|t| &t.transit)
                            .find(|c| &c.site == s)
                            .map_or(0, |c| c.packets);
                        format!("{s} ({n} packets)")
                    })
                    .collect();
                format!("; it reaches through this site: {}", counts.join(", "))
            };
            format!(
                "{}: transit agreed here: {}, by the peer: {}{onward}",
                p.site_id,
                if p.transit { "yes" } else { "no" },
                if p.peer_transit { "yes" } else { "no" }
            )
        }))
        // Who named each site reached through transit: only the
        // hub's word, unlike a direct peering's site id.
        .chain(r.peerings.iter().flat_map(|p| {
            p.transit_paths.iter().map(move |t| {
                let by = told_by(p, t);
                format!(
                    "{} via {}: told by {by}; nothing from {} vouches for it (a direct peering would)",
                    t.site, p.site_id, t.site
                )
            })
        }))
        .chain(r.refused_joins.iter().map(refused_line))
        .collect()
}

/// The site that told this one about transit path `t` of peering `p`
/// (the transit peer; a controller that does not say is that peer).
fn told_by<'a>(p: &'a pb::Peering, t: &'a pb::TransitPath) -> &'a str {
    if t.told_by.is_empty() { &p.site_id } else { &t.told_by }
}

/// A peering's transit: who agrees, the sites reached through the peer,
/// and those the peer reaches through this site (with the packets
/// forwarded to each).
fn transit_json(p: &pb::Peering) -> serde_json::Value {
    let forwarded: std::collections::BTreeMap<&str, u64> = p
        .tunnel
        .iter()
        .flat_map(|t| &t.transit)
        .map(|c| (c.site.as_str(), c.packets))
        .collect();
    json!({
        "agreed": p.transit, "peer_agreed": p.peer_transit,
        "paths": p.transit_paths.iter().map(|t| json!({
            "site": t.site, "active": t.active, "told_by": told_by(p, t),
            "views": t.views.iter().map(view_json).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "onward": p.transit_onward, "forwarded_packets": forwarded,
    })
}

/// A join this site refused, on one line.
pub(crate) fn refused_line(r: &pb::RefusedJoin) -> String {
    let times = if r.count > 1 {
        format!(" ({} times)", r.count)
    } else {
        String::new()
    };
    format!(
        "refused {}'s join{times}, last at {}: {}: {}",
        r.site_id,
        ts(&r.last_at),
        r.code,
        r.message
    )
}

pub(crate) fn refused_json(r: &pb::RefusedJoin) -> serde_json::Value {
    json!({"site_id": r.site_id, "code": r.code, "message": r.message, "last_at": ts(&r.last_at), "count": r.count})
}

/// Peering tokens, peering and unpeering.
pub async fn run(c: &mut Client, cmd: &PeeringCmd) -> Result<Out, String> {
    Ok(match cmd {
        PeeringCmd::Token { ttl, for_site } => {
            let ttl =
                humantime::parse_duration(ttl).map_err(|e| format!("--ttl {ttl:?}: {e}; write e.g. 30m or 1h"))?;
            let r = c
                .create_peering_token(pb::CreatePeeringTokenRequest {
                    ttl_seconds: ttl.as_secs(),
                    for_site: for_site.clone().unwrap_or_default(),
                })
                .await
                .map_err(status)?
                .into_inner();
            Out {
                failed: false,
                json: json!({"token": r.token, "expires_at": ts(&r.expires_at)}),
                header: vec![],
                rows: vec![vec![r.token.clone()]],
                footer: vec![
                    format!("expires {}; shown once. On the other site run:", ts(&r.expires_at)),
                    format!("  weftctl peering create --token {}", r.token),
                ],
            }
        }
        PeeringCmd::Transit { site, state } => {
            let p = c
                .set_peering_transit(pb::SetPeeringTransitRequest {
                    site_id: site.clone(),
                    enabled: state == "on",
                })
                .await
                .map_err(status)?
                .into_inner();
            let how = match (p.transit, p.peer_transit) {
                (false, _) => "no transit on it",
                (true, true) => "transit in use (both sides agree)",
                (true, false) => "agreed here; used once the peer agrees too",
            };
            Out {
                failed: false,
                json: json!({"site_id": p.site_id, "transit": p.transit, "peer_transit": p.peer_transit}),
                header: vec![],
                rows: vec![vec![format!("peering with {}: {how}", p.site_id)]],
                footer: vec![],
            }
        }
        PeeringCmd::Create {
            token,
            timeout,
            transit,
        } => {
            let p = create_with_retries(c, token, *transit, **timeout).await?;
            Out {
                failed: false,
                json: json!({"site_id": p.site_id, "state": peering_state(p.state), "tunnel_role": p.tunnel_role,
                "views": p.views.iter().map(view_json).collect::<Vec<_>>()}),
                header: vec![],
                rows: vec![vec![format!(
                    "peered with {} ({}), this site is the tunnel {}",
                    p.site_id,
                    peering_state(p.state),
                    p.tunnel_role
                )]],
                footer: vec![],
            }
        }
        PeeringCmd::Delete { site } => {
            let r = c
                .delete_peering(pb::DeletePeeringRequest { site_id: site.clone() })
                .await
                .map_err(status)?
                .into_inner();
            let how = if r.remote_notified {
                "on both sides"
            } else {
                "here; the other site was not reachable and learns it later"
            };
            Out {
                failed: false,
                json: json!({"deleted": site, "remote_notified": r.remote_notified}),
                header: vec![],
                rows: vec![vec![format!("deleted the peering with {site} {how}")]],
                footer: vec![],
            }
        }
        PeeringCmd::Policy(cmd) => return super::policy::run(c, cmd).await,
        PeeringCmd::Accept { site } => {
            let p = c
                .accept_peering_update(pb::AcceptPeeringUpdateRequest { site_id: site.clone() })
                .await
                .map_err(status)?
                .into_inner();
            Out {
                failed: false,
                json: json!({"site_id": p.site_id, "views": p.views.iter().map(view_json).collect::<Vec<_>>(), "ipv4": p.ipv4, "ipv6": p.ipv6}),
                header: vec![],
                rows: p
                    .views
                    .iter()
                    .map(|v| vec![format!("{site}: routing {} as {}", v.real_cidr, v.local_cidr)])
                    .collect(),
                footer: vec![],
            }
        }
        PeeringCmd::SetCa { site, ca_file } => {
            let ca_pem =
                std::fs::read_to_string(ca_file).map_err(|e| format!("cannot read {}: {e}", ca_file.display()))?;
            let p = c
                .set_peering_ca(pb::SetPeeringCaRequest {
                    site_id: site.clone(),
                    ca_pem,
                })
                .await
                .map_err(status)?
                .into_inner();
            Out {
                failed: false,
                json: json!({"site_id": p.site_id, "remote_ca_fingerprint": p.remote_ca_fingerprint}),
                header: vec![],
                rows: vec![vec![format!(
                    "{site}: trusting its CA {} from now on",
                    p.remote_ca_fingerprint
                )]],
                footer: vec![],
            }
        }
    })
}

/// The local view this site would give a peer's CIDRs now.
pub async fn plan_view(
    c: &mut Client,
    workload_cidrs: &[String],
    external_cidr: &Option<String>,
) -> Result<Out, String> {
    Ok({
        let r = c
            .plan_local_view(pb::PlanLocalViewRequest {
                workload_cidrs: workload_cidrs.to_vec(),
                external_cidr: external_cidr.clone().unwrap_or_default(),
            })
            .await
            .map_err(status)?
            .into_inner();
        Out {
            failed: false,
            json: json!({"views": r.views.iter().map(view_json).collect::<Vec<_>>()}),
            header: vec!["KIND", "REAL CIDR", "LOCAL VIEW", "REMAPPED"],
            rows: r
                .views
                .iter()
                .map(|v| {
                    vec![
                        cidr_kind(v.kind),
                        v.real_cidr.clone(),
                        v.local_cidr.clone(),
                        v.remapped.to_string(),
                    ]
                })
                .collect(),
            footer: vec![],
        }
    })
}

/// CreatePeering, asked again with backoff while the answer is "the peer
/// was slow" or "the peer cannot be reached" (DEADLINE_EXCEEDED,
/// UNAVAILABLE, ABORTED), until `timeout`; each wait is said on stderr.
/// Each attempt's deadline is what is left, so the controller answers
/// within it (it caps one attempt's wait for the peer itself).
async fn create_with_retries(
    c: &mut Client,
    token: &str,
    transit: bool,
    timeout: std::time::Duration,
) -> Result<pb::Peering, String> {
    use tonic::Code;
    let until = tokio::time::Instant::now() + timeout;
    let mut delays = weft_common::backoff().map(|d| d.min(std::time::Duration::from_secs(10)));
    let started = tokio::time::Instant::now();
    for attempt in 1.. {
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        let mut req = tonic::Request::new(pb::CreatePeeringRequest {
            token: token.to_string(),
            transit,
        });
        if !left.is_zero() {
            req.set_timeout(left.max(std::time::Duration::from_secs(1)));
        }
        let s = match c.create_peering(req).await {
            Ok(p) => return Ok(p.into_inner()),
            Err(s) => s,
        };
        // Only what the controller said may be asked again (it marks it):
        // not a failure of weftctl's own connection to it.
        let retryable = matches!(s.code(), Code::DeadlineExceeded | Code::Unavailable | Code::Aborted)
            && s.metadata().contains_key("weft-retryable");
        let delay = delays.next().unwrap_or(std::time::Duration::from_secs(10));
        let now = tokio::time::Instant::now();
        if !retryable || now + delay >= until {
            let waited = if attempt > 1 {
                format!(
                    " (gave up after {attempt} attempts in {:.0} s; --timeout {})",
                    started.elapsed().as_secs_f64(),
                    humantime::format_duration(timeout)
                )
            } else {
                String::new()
            };
            return Err(format!("{}{waited}", status(s)));
        }
        eprintln!(
            "weftctl: attempt {attempt}: {}; asking again in {:.1} s ({:.0} s of {} left)",
            status(s),
            delay.as_secs_f64(),
            until.saturating_duration_since(now).as_secs_f64(),
            humantime::format_duration(timeout)
        );
        tokio::time::sleep(delay).await;
    }
    unreachable!("the loop returns")
}
