//! `weftctl topology`: the federation as Graphviz DOT or SVG.

use std::io::Write;

use serde_json::json;
use weft_proto::v1 as pb;

use super::status::{Site, rtt, site};
use crate::out::*;

/// DOT string quoting.
fn q(s: &str) -> String {
    let escaped = s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
    format!("\"{escaped}\"")
}

/// The federation as Graphviz DOT: this site's gateways and nodes, each
/// peer site with its views, and each tunnel with its state, path and RTT.
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
            q(&format!("node {}\n{}", n.name, crate::out::subnets(n))),
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
        // What each side lets the other reach, where limited.
        let mut reach = String::new();
        if let Some(e) = p.export.as_ref().filter(|e| e.effective != pb::ExportMode::All as i32) {
            reach += &format!("\nmay reach here: {}", super::policy::summary(e));
        }
        if p.peer_exports_limited {
            let what = if p.peer_exports.is_empty() {
                "nothing".to_string()
            } else {
                p.peer_exports.join(", ")
            };
            reach += &format!("\nexports here: {what}");
        }
        if !p.transit_onward.is_empty() {
            reach += &format!("\ntransit through here to: {}", p.transit_onward.join(", "));
        }
        d += &format!(
            "  {} [shape=ellipse, label={}];\n",
            q(&format!("peer/{}", p.site_id)),
            q(&format!(
                "site {}\n{}\n{}{reach}",
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
                    "WireGuard up, {}\nRTT {}\nrx {} tx {}",
                    path_cell(Some(t)),
                    rtt(Some(t)),
                    bytes(t.rx_bytes),
                    bytes(t.tx_bytes)
                ),
            ),
            Some(t) => ("red", format!("WireGuard down, {}", path_cell(Some(t)))),
            None => ("gray", "no tunnel report".to_string()),
        };
        d += &format!(
            "  {} -> {} [dir=both, color={color}, penwidth=2, label={}];\n",
            q(&from),
            q(&format!("peer/{}", p.site_id)),
            q(&label)
        );
        // Sites reached through this peer (transit): dashed, through it.
        for t in &p.transit_paths {
            let views: Vec<String> = t.views.iter().map(|v| v.local_cidr.clone()).collect();
            d += &format!(
                "  {} [shape=ellipse, style=dashed, label={}];\n",
                q(&format!("transit/{}", t.site)),
                q(&format!("site {}\n{}", t.site, views.join("\n")))
            );
            let label = if t.active {
                format!("transit via {}", p.site_id)
            } else {
                format!("transit via {} (unused: direct peering preferred)", p.site_id)
            };
            d += &format!(
                "  {} -> {} [dir=both, style=dashed, color={}, label={}];\n",
                q(&format!("peer/{}", p.site_id)),
                q(&format!("transit/{}", t.site)),
                if t.active { "steelblue" } else { "gray" },
                q(&label)
            );
        }
    }
    d += "}\n";
    d
}

/// `weftctl topology`: DOT, or SVG drawn by Graphviz's `dot`.
pub async fn run(c: &mut Client, svg: bool) -> Result<Out, String> {
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
