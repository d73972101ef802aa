//! `weftctl status`, `diagnose`, `test network` and `topology`: the
//! commands an operator runs when the fabric breaks.

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::{Duration, Instant};

use ipnet::Ipv4Net;
use serde_json::{Value, json};
use weft_proto::v1 as pb;
use weft_proto::v1::admin_service_client::AdminServiceClient;

use super::{Out, bytes, cidr_kind, peering_state, ready_cell, revision_cell};

type Client = AdminServiceClient<tonic::transport::Channel>;

fn status(s: tonic::Status) -> String {
    format!("{}: {}", super::code_name(s.code()), s.message())
}

/// A table as text, columns aligned.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut tw = tabwriter::TabWriter::new(Vec::new()).padding(2);
    let _ = writeln!(tw, "{}", header.join("\t"));
    for r in rows {
        let _ = writeln!(tw, "{}", r.join("\t"));
    }
    let _ = tw.flush();
    String::from_utf8(tw.into_inner().unwrap_or_default()).unwrap_or_default()
}

fn text(lines: String) -> Out {
    Out {
        failed: false,
        json: Value::Null,
        header: vec![],
        rows: vec![],
        footer: vec![lines.trim_end().to_string()],
    }
}

fn rtt(t: Option<&pb::TunnelStatus>) -> String {
    match t {
        Some(t) if t.up => format!("{:.2}ms", t.rtt_micros as f64 / 1000.0),
        _ => "-".into(),
    }
}

fn tunnel_state(t: Option<&pb::TunnelStatus>) -> &'static str {
    match t {
        Some(t) if t.up => "up",
        Some(_) => "down",
        None => "unknown",
    }
}

/// Everything `status` and `topology` show.
struct Site {
    site: pb::Site,
    gateways: Vec<pb::Gateway>,
    nodes: Vec<pb::Node>,
    peerings: Vec<pb::Peering>,
}

async fn site(c: &mut Client) -> Result<Site, String> {
    Ok(Site {
        site: c.get_site(pb::GetSiteRequest {}).await.map_err(status)?.into_inner(),
        gateways: c
            .list_gateways(pb::ListGatewaysRequest {})
            .await
            .map_err(status)?
            .into_inner()
            .gateways,
        nodes: c
            .list_nodes(pb::ListNodesRequest {})
            .await
            .map_err(status)?
            .into_inner()
            .nodes,
        peerings: c
            .list_peerings(pb::ListPeeringsRequest {})
            .await
            .map_err(status)?
            .into_inner()
            .peerings,
    })
}

/// `weftctl status`: the site, its gateways, nodes and peerings on one screen.
pub async fn status_cmd(c: &mut Client) -> Result<Out, String> {
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
                revision_cell(&g.status),
            ]
        })
        .collect();
    out += &table(&["GATEWAY", "ROLE", "READY", "ENDPOINT", "REVISION"], &gw_rows);
    out += "\n";
    let node_rows: Vec<Vec<String>> = s
        .nodes
        .iter()
        .map(|n| {
            let errors = n.status.as_ref().map_or(0, |s| s.errors.len());
            vec![
                n.name.clone(),
                ready_cell(&n.status, n.cert_expires_at.is_some()).into(),
                n.subnet.clone(),
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
        &["PEERING", "STATE", "TUNNEL", "RTT", "VIEWS (REAL→LOCAL)", "LAST ERROR"],
        &peer_rows,
    );
    let mut o = text(out);
    o.json = json!({
        "site": s.site.id, "revision": s.site.revision,
        "gateways": s.gateways.iter().map(|g| json!({"name": g.name, "active": g.active,
            "ready": g.status.as_ref().is_some_and(|s| s.ready), "endpoint": g.endpoint, "revision": revision_cell(&g.status)})).collect::<Vec<_>>(),
        "nodes": s.nodes.iter().map(|n| json!({"name": n.name, "subnet": n.subnet,
            "ready": n.status.as_ref().is_some_and(|s| s.ready), "revision": revision_cell(&n.status),
            "errors": n.status.as_ref().map(|s| s.errors.clone()).unwrap_or_default()})).collect::<Vec<_>>(),
        "peerings": s.peerings.iter().map(|p| json!({"site_id": p.site_id, "state": peering_state(p.state),
            "tunnel": tunnel_state(p.tunnel.as_ref()), "rtt_ms": p.tunnel.as_ref().filter(|t| t.up).map(|t| t.rtt_micros as f64 / 1000.0),
            "views": p.views.iter().map(|v| json!({"kind": cidr_kind(v.kind), "real_cidr": v.real_cidr, "local_cidr": v.local_cidr})).collect::<Vec<_>>(),
            "last_error": p.last_error})).collect::<Vec<_>>(),
    });
    Ok(o)
}

fn result_name(v: i32) -> &'static str {
    match pb::CheckResult::try_from(v).unwrap_or_default() {
        pb::CheckResult::Pass => "PASS",
        pb::CheckResult::Warn => "WARN",
        pb::CheckResult::Fail => "FAIL",
        pb::CheckResult::Unspecified => "?",
    }
}

/// `weftctl diagnose`: every check, what failed and what to do; exit 1 on
/// a failure.
pub async fn diagnose_cmd(c: &mut Client, settle: Duration) -> Result<Out, String> {
    let r = c
        .diagnose(pb::DiagnoseRequest {
            settle_millis: settle.as_millis().min(60_000) as u32,
        })
        .await
        .map_err(status)?
        .into_inner();
    let mut rows = Vec::new();
    let count = |k: pb::CheckResult| r.checks.iter().filter(|c| c.result == k as i32).count();
    for ch in &r.checks {
        rows.push(vec![
            result_name(ch.result).into(),
            ch.check.clone(),
            ch.subject.clone(),
            ch.detail.clone(),
        ]);
        if !ch.hint.is_empty() && ch.result != pb::CheckResult::Pass as i32 {
            rows.push(vec![
                String::new(),
                String::new(),
                String::new(),
                format!("→ {}", ch.hint),
            ]);
        }
    }
    let (pass, warn, fail) = (
        count(pb::CheckResult::Pass),
        count(pb::CheckResult::Warn),
        count(pb::CheckResult::Fail),
    );
    Ok(Out {
        failed: fail > 0,
        json: json!({"checks": r.checks.iter().map(|c| json!({"result": result_name(c.result), "check": c.check,
            "subject": c.subject, "detail": c.detail, "hint": c.hint})).collect::<Vec<_>>(),
            "pass": pass, "warn": warn, "fail": fail}),
        header: vec!["RESULT", "CHECK", "SUBJECT", "DETAIL"],
        rows,
        footer: vec![format!(
            "\n{} checks: {pass} pass, {warn} warn, {fail} fail",
            r.checks.len()
        )],
    })
}

/// A target of `test network`: a workload of a peer, by its address in the
/// peer's own addressing, and the address this site reaches it at.
#[derive(Clone, Debug)]
pub struct Target {
    pub site: String,
    pub real: Ipv4Addr,
    pub local: Ipv4Addr,
}

/// The address `ip` of peer `site` has in this site's local view.
fn local_view(peerings: &[pb::Peering], site: &str, ip: Ipv4Addr) -> Result<Ipv4Addr, String> {
    let p = peerings
        .iter()
        .find(|p| p.site_id == site)
        .ok_or_else(|| format!("--to {site}={ip}: this site has no peering with {site:?}"))?;
    for v in &p.views {
        let (Ok(real), Ok(local)) = (v.real_cidr.parse::<Ipv4Net>(), v.local_cidr.parse::<Ipv4Net>()) else {
            continue;
        };
        if real.contains(&ip) {
            let offset = u32::from(ip) - u32::from(real.network());
            return Ok(Ipv4Addr::from(u32::from(local.network()) + offset));
        }
    }
    let cidrs: Vec<&str> = p.views.iter().map(|v| v.real_cidr.as_str()).collect();
    Err(format!(
        "--to {site}={ip}: {ip} is in none of {site}'s CIDRs ({}); give the workload's address as {site} itself uses it",
        cidrs.join(", ")
    ))
}

/// One ICMP echo to `to` (root, or CAP_NET_RAW); the round trip, or why not.
fn icmp_echo(to: Ipv4Addr, id: u16, seq: u16, wait: Duration) -> Result<Duration, String> {
    let s = weft_common::icmp::raw_icmp_socket()
        .map_err(|e| format!("cannot open a raw ICMP socket (run as root): {e}"))?;
    weft_common::icmp::raw_echo(&s, to, id, seq, 64, wait).map_err(|e| format!("cannot send: {e}"))?
}

/// What one source saw of one target.
#[derive(Clone, Debug)]
struct Probe {
    icmp: Result<Duration, String>,
    tcp: Option<Result<Duration, String>>,
}

impl Probe {
    fn ok(&self) -> bool {
        self.icmp.is_ok() && self.tcp.as_ref().is_none_or(|t| t.is_ok())
    }
}

/// TCP to `to:port`: an accepted or refused connection both prove the path
/// works both ways (a refusal is the target's own answer).
fn tcp_probe(to: Ipv4Addr, port: u16, wait: Duration) -> Result<Duration, String> {
    let start = Instant::now();
    match std::net::TcpStream::connect_timeout(&SocketAddrV4::new(to, port).into(), wait) {
        Ok(_) => Ok(start.elapsed()),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Ok(start.elapsed()),
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => Err(format!(
            "port {port}: no answer within {}",
            humantime::format_duration(wait)
        )),
        Err(e) => Err(format!("port {port}: {e}")),
    }
}

/// Probes every target from `source` ("host": where weftctl runs; else a
/// network namespace name under /run/netns, or a path such as
/// /proc/PID/ns/net), on a thread that joined it.
fn probe_from(
    source: &str,
    targets: &[Target],
    tcp_port: Option<u16>,
    wait: Duration,
    id: u16,
) -> Result<Vec<Probe>, String> {
    let path = match source {
        "host" => None,
        s if s.contains('/') => Some(s.to_string()),
        s => Some(format!("/run/netns/{s}")),
    };
    let targets = targets.to_vec();
    std::thread::spawn(move || -> Result<Vec<Probe>, String> {
        if let Some(path) = &path {
            let f = std::fs::File::open(path).map_err(|e| format!("--from: cannot open {path}: {e}"))?;
            nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|e| format!("--from: cannot enter {path} (run as root): {e}"))?;
        }
        Ok(targets
            .iter()
            .enumerate()
            .map(|(i, t)| {
                // Two tries: the first packet toward a peer may wait for a
                // WireGuard handshake.
                let icmp = icmp_echo(t.local, id, 2 * i as u16, wait)
                    .or_else(|_| icmp_echo(t.local, id, 2 * i as u16 + 1, wait));
                let tcp = tcp_port.map(|p| tcp_probe(t.local, p, wait));
                Probe { icmp, tcp }
            })
            .collect())
    })
    .join()
    .map_err(|_| "a probe thread panicked".to_string())?
}

fn cell(p: &Probe) -> String {
    let part = |name: &str, r: &Result<Duration, String>| match r {
        Ok(d) => format!("{name} ok {:.1}ms", d.as_secs_f64() * 1000.0),
        Err(_) => format!("{name} FAIL"),
    };
    let mut s = part("icmp", &p.icmp);
    if let Some(t) = &p.tcp {
        s += &format!(", {}", part("tcp", t));
    }
    s
}

/// `weftctl test network`: reachability from each source to each target
/// through this site's local views, as a matrix; exit 1 naming each pair
/// that failed.
pub async fn test_network_cmd(
    c: &mut Client,
    from: &[String],
    to: &[String],
    tcp_port: Option<u16>,
    wait: Duration,
) -> Result<Out, String> {
    if to.is_empty() {
        return Err(
            "give the workloads to reach: --to SITE=ADDRESS (repeatable), the address as that site itself uses it; weftctl translates it to this site's local view"
                .into(),
        );
    }
    let peerings = c
        .list_peerings(pb::ListPeeringsRequest {})
        .await
        .map_err(status)?
        .into_inner()
        .peerings;
    let mut targets = Vec::new();
    for t in to {
        let (site, ip) = t
            .split_once('=')
            .ok_or_else(|| format!("--to {t:?}: write SITE=ADDRESS, e.g. site-b=10.200.1.10"))?;
        let real: Ipv4Addr = ip
            .parse()
            .map_err(|_| format!("--to {t:?}: {ip:?} is not an IPv4 address"))?;
        targets.push(Target {
            site: site.to_string(),
            real,
            local: local_view(&peerings, site, real)?,
        });
    }
    let sources: Vec<String> = if from.is_empty() {
        vec!["host".into()]
    } else {
        from.to_vec()
    };
    // One thread per source, all at once.
    let base = (std::process::id() as u16).wrapping_mul(31);
    let handles: Vec<_> = sources
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let (s, targets) = (s.clone(), targets.clone());
            tokio::task::spawn_blocking(move || probe_from(&s, &targets, tcp_port, wait, base.wrapping_add(i as u16)))
        })
        .collect();
    let mut results = Vec::new();
    for h in handles {
        results.push(h.await.map_err(|e| format!("a probe task failed: {e}"))??);
    }
    let label = |t: &Target| {
        if t.local == t.real {
            format!("{} {}", t.site, t.real)
        } else {
            format!("{} {} (as {})", t.site, t.real, t.local)
        }
    };
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    let mut pairs = Vec::new();
    for (s, probes) in sources.iter().zip(&results) {
        let mut row = vec![s.clone()];
        for (t, p) in targets.iter().zip(probes) {
            row.push(cell(p));
            if !p.ok() {
                let mut why = Vec::new();
                if let Err(e) = &p.icmp {
                    why.push(format!("ICMP {e}"));
                }
                if let Some(Err(e)) = &p.tcp {
                    why.push(format!("TCP {e}"));
                }
                failures.push(format!("FAIL {s} → {}: {}", label(t), why.join("; ")));
            }
            pairs.push(json!({"from": s, "site": t.site, "address": t.real.to_string(), "local_address": t.local.to_string(),
                "ok": p.ok(), "icmp_ms": p.icmp.as_ref().ok().map(|d| d.as_secs_f64() * 1000.0), "icmp_error": p.icmp.as_ref().err(),
                "tcp_ms": p.tcp.as_ref().and_then(|r| r.as_ref().ok()).map(|d| d.as_secs_f64() * 1000.0),
                "tcp_error": p.tcp.as_ref().and_then(|r| r.as_ref().err())}));
        }
        rows.push(row);
    }
    let total = sources.len() * targets.len();
    let mut footer = vec![String::new()];
    footer.extend(failures.iter().cloned());
    footer.push(format!("{} of {total} pairs reachable", total - failures.len()));
    let header_labels: Vec<String> = targets.iter().map(label).collect();
    let mut out = Out {
        failed: !failures.is_empty(),
        json: json!({"pairs": pairs, "failed": failures.len()}),
        header: vec![],
        rows: vec![],
        footer: vec![],
    };
    // The header names are built at run time; print the matrix as text.
    let mut h: Vec<&str> = vec!["FROM \\ TO"];
    h.extend(header_labels.iter().map(String::as_str));
    out.footer.push(table(&h, &rows).trim_end().to_string());
    out.footer.extend(footer);
    Ok(out)
}

/// DOT string quoting.
fn q(s: &str) -> String {
    let escaped = s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
    format!("\"{escaped}\"")
}

/// The federation as Graphviz DOT: this site's gateways and nodes, each
/// peer site with its views, and each tunnel with its state and RTT.
fn dot(s: &Site) -> String {
    let mut d = String::from(
        "digraph weft {\n  rankdir=LR;\n  fontname=\"Helvetica\";\n  node [fontname=\"Helvetica\", shape=box, style=\"rounded,filled\", fillcolor=white];\n  edge [fontname=\"Helvetica\", fontsize=10];\n",
    );
    d += &format!(
        "  subgraph cluster_site {{\n    label={};\n    style=rounded;\n    color=gray40;\n",
        q(&format!("site {}\npods {}", s.site.id, s.site.pod_cidrs.join(", ")))
    );
    for g in &s.gateways {
        let ready = g.status.as_ref().is_some_and(|x| x.ready);
        let role = if g.active { "active" } else { "standby" };
        let color = match (ready, g.active) {
            (true, true) => "palegreen",
            (true, false) => "lightgray",
            _ => "salmon",
        };
        d += &format!(
            "    {} [label={}, fillcolor={color}];\n",
            q(&format!("gw/{}", g.name)),
            q(&format!(
                "gateway {}\n{role}{}",
                g.name,
                if ready { "" } else { ", not ready" }
            ))
        );
    }
    let active = s.gateways.iter().find(|g| g.active).map(|g| g.name.clone());
    for n in &s.nodes {
        let ready = n.status.as_ref().is_some_and(|x| x.ready);
        d += &format!(
            "    {} [label={}, fillcolor={}];\n",
            q(&format!("node/{}", n.name)),
            q(&format!("node {}\n{}", n.name, n.subnet)),
            if ready { "white" } else { "salmon" }
        );
        if let Some(a) = &active {
            d += &format!(
                "    {} -> {} [dir=none, style=dashed, label=\"overlay\"];\n",
                q(&format!("node/{}", n.name)),
                q(&format!("gw/{a}"))
            );
        }
    }
    d += "  }\n";
    for p in &s.peerings {
        let views: Vec<String> = p
            .views
            .iter()
            .map(|v| {
                if v.remapped {
                    format!("{} as {}", v.real_cidr, v.local_cidr)
                } else {
                    v.real_cidr.clone()
                }
            })
            .collect();
        d += &format!(
            "  {} [shape=ellipse, label={}];\n",
            q(&format!("peer/{}", p.site_id)),
            q(&format!(
                "site {}\n{}\n{}",
                p.site_id,
                peering_state(p.state).to_lowercase(),
                views.join("\n")
            ))
        );
        let t = p.tunnel.as_ref();
        let from = t
            .map(|t| t.gateway.clone())
            .filter(|g| !g.is_empty())
            .or(active.clone())
            .map_or_else(|| "site".to_string(), |g| format!("gw/{g}"));
        let (color, label) = match t {
            Some(t) if t.up => (
                "forestgreen",
                format!(
                    "WireGuard up\nRTT {}\nrx {} tx {}",
                    rtt(Some(t)),
                    bytes(t.rx_bytes),
                    bytes(t.tx_bytes)
                ),
            ),
            Some(_) => ("red", "WireGuard down".to_string()),
            None => ("gray", "no tunnel report".to_string()),
        };
        d += &format!(
            "  {} -> {} [dir=both, color={color}, penwidth=2, label={}];\n",
            q(&from),
            q(&format!("peer/{}", p.site_id)),
            q(&label)
        );
    }
    d += "}\n";
    d
}

/// `weftctl topology`: DOT, or SVG drawn by Graphviz's `dot`.
pub async fn topology_cmd(c: &mut Client, svg: bool) -> Result<Out, String> {
    let s = site(c).await?;
    let d = dot(&s);
    let body = if svg {
        use std::process::{Command, Stdio};
        let mut child = Command::new("dot")
            .arg("-Tsvg")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                format!("cannot run Graphviz's `dot` ({e}); install it (apt-get install graphviz) or use --format dot")
            })?;
        child
            .stdin
            .take()
            .expect("piped")
            .write_all(d.as_bytes())
            .map_err(|e| format!("dot: {e}"))?;
        let out = child.wait_with_output().map_err(|e| format!("dot: {e}"))?;
        if !out.status.success() {
            return Err(format!("dot failed: {}", String::from_utf8_lossy(&out.stderr)));
        }
        String::from_utf8_lossy(&out.stdout).into_owned()
    } else {
        d.clone()
    };
    let mut o = text(body);
    o.json = json!({"dot": d});
    Ok(o)
}
