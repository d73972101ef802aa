//! The topology as an inline SVG, laid out left to right like
//! `weftctl topology`: this site (its gateways, active first) on the left,
//! each peer to its right with its state, path and RTT, and the sites
//! reached through a peer (transit) further right. Each peer is a link to
//! its details, so it works by keyboard too. Colours come from the style
//! sheet; every state is also written out.

use maud::{Markup, html};
use weft_proto::v1 as pb;

use super::{path, tone};
use crate::cmd::status::{Site, rtt};
use crate::out::peering_state;

const ROW: u32 = 58;
const BOX_H: u32 = 46;
const SITE_W: u32 = 230;
const PEER_X: u32 = 330;
const PEER_W: u32 = 300;
const TRANSIT_X: u32 = 700;
const TRANSIT_W: u32 = 200;

pub fn svg(site: &Site, peerings: &[&pb::Peering]) -> Markup {
    let mut gws: Vec<&pb::Gateway> = site.gateways.iter().collect();
    gws.sort_by_key(|g| (!g.active, g.name.clone()));
    let transit = peerings.iter().any(|p| !p.transit_paths.is_empty());
    // Rows: one per peer, or per transit site behind it.
    let rows: Vec<u32> = peerings.iter().map(|p| p.transit_paths.len().max(1) as u32).collect();
    let peer_rows: u32 = rows.iter().sum();
    let site_h = 64 + 20 * gws.len() as u32;
    let height = (peer_rows * ROW + 20).max(site_h + 40);
    let width = if transit {
        TRANSIT_X + TRANSIT_W + 10
    } else {
        PEER_X + PEER_W + 10
    };
    let site_y = (height - site_h) / 2;
    let site_mid = site_y + site_h / 2;
    let id = &site.site.id;
    let tops: Vec<u32> = rows
        .iter()
        .scan(0, |at, n| {
            let top = 10 + *at * ROW;
            *at += n;
            Some(top)
        })
        .collect();
    html! {
        svg.topology viewBox=(format!("0 0 {width} {height}")) role="group"
            aria-label=(format!("Topology of site {id}: {} peerings", peerings.len())) {
            g.site {
                rect x="10" y=(site_y) width=(SITE_W) height=(site_h) rx="10" {}
                text.title x="24" y=(site_y + 26) { "site " (id) }
                text x="24" y=(site_y + 46) { (site.site.pod_cidrs.join(", ")) }
                @for (i, g) in gws.iter().enumerate() {
                    text x="24" y=(site_y + 68 + 20 * i as u32) class=(if g.active { "gw active" } else { "gw" }) {
                        (if g.active { "● " } else { "○ " }) "gateway " (g.name) " " (if g.active { "active" } else { "standby" })
                    }
                }
            }
            @for ((p, n), top) in peerings.iter().zip(&rows).zip(tops) {
                @let y = top + (n - 1) * ROW / 2;
                @let t = tone(p);
                @let relayed = path(p).starts_with("relayed");
                @let edge = if relayed && t == "ok" { "relay" } else { t };
                path class={"edge " (edge)} d=(format!(
                    "M{} {site_mid} C{} {site_mid}, {} {}, {PEER_X} {}",
                    SITE_W + 10, SITE_W + 60, PEER_X - 50, y + BOX_H / 2, y + BOX_H / 2)) {}
                a.peer href=(format!("#peering-{}", p.site_id)) id=(format!("graph-{}", p.site_id)) data-peer=(p.site_id)
                    aria-label=(format!("site {}: {}, {}", p.site_id, peering_state(p.state), path(p))) {
                    title { "site " (p.site_id) ": " (peering_state(p.state)) ", " (path(p)) }
                    rect class={"node " (edge)} x=(PEER_X) y=(y) width=(PEER_W) height=(BOX_H) rx="23" {}
                    text.title x=(PEER_X + 18) y=(y + 19) { "site " (p.site_id) }
                    text x=(PEER_X + 18) y=(y + 37) {
                        (peering_state(p.state)) " · " (path(p))
                        @if p.tunnel.as_ref().is_some_and(|t| t.up) { " · " (rtt(p.tunnel.as_ref())) }
                    }
                }
                @for (i, tp) in p.transit_paths.iter().enumerate() {
                    @let ty = top + i as u32 * ROW;
                    path class={"edge transit " (if tp.active { "" } else { "unused" })} d=(format!(
                        "M{} {} L{TRANSIT_X} {}", PEER_X + PEER_W, y + BOX_H / 2, ty + BOX_H / 2)) {}
                    g.transit {
                        title { "site " (tp.site) " through " (p.site_id) (if tp.active { "" } else { " (unused: a direct peering is preferred)" }) }
                        rect class={"node transit " (if tp.active { "" } else { "unused" })} x=(TRANSIT_X) y=(ty) width=(TRANSIT_W) height=(BOX_H) rx="23" {}
                        text.title x=(TRANSIT_X + 16) y=(ty + 19) { "site " (tp.site) }
                        text x=(TRANSIT_X + 16) y=(ty + 37) { "transit via " (p.site_id) }
                    }
                }
            }
        }
    }
}
