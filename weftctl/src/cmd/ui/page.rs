//! The page, rendered on the server (maud escapes every value): the
//! document around it, and its live part, which the browser patches in as
//! each reading arrives. Stable `id`s and `data-` attributes name what a
//! reader (a person with a keyboard, or a test) looks for.

use std::time::SystemTime;

use maud::{DOCTYPE, Markup, PreEscaped, html};
use weft_proto::v1 as pb;

use super::watch::{Diagnosis, Frame, Snapshot, clock};
use super::{path, tone};
use crate::cmd::diagnose::result_name;
use crate::cmd::policy;
use crate::cmd::status::rtt;
use crate::out::{bytes, peering_state, revision_cell, subnets};

/// One rendering of a reading, for every open page.
pub fn frame(s: &Snapshot) -> Frame {
    Frame {
        live: live(s).into_string(),
        clock: match &s.unreachable {
            None => format!("updated {}", clock(s.read_at)),
            Some((since, _)) => format!("controller unreachable since {}", clock(*since)),
        },
        site_id: s.site.site.id.clone(),
        stale_ms: (3 * s.interval.as_millis() as u64).max(5000),
    }
}

/// A document: its head (the style sheet, and `head`) and `body`.
fn doc(title: &str, head: Markup, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) }
                link rel="stylesheet" href="/ui.css";
                (head)
            }
            body { (body) }
        }
    }
}

/// The whole page, with the latest reading in it.
pub fn document(f: &Frame) -> Markup {
    let body = html! {
        a.skip href="#peerings" { "Skip to peerings" }
        header.bar {
            h1 { "weft" span.site { " · site " (f.site_id) } }
            // Not a live region: it changes every second.
            p #clock data-state="live" { (f.clock) }
        }
        main #live data-stale-ms=(f.stale_ms) { (PreEscaped(&f.live)) }
        footer { "Read-only. Served by weftctl ui from the controller's admin API; nothing here changes the fabric." }
    };
    let head = html! {
        script src="/ui.js" defer {}
        // Without JavaScript, the page reloads itself instead.
        noscript { meta http-equiv="refresh" content="2"; }
    };
    doc(&format!("weft · site {}", f.site_id), head, body)
}

/// The answer to the link's token: the session is set, and the page
/// moves on to itself (without the token in the address bar).
pub fn entering() -> Markup {
    let body = html! {
        main.refused {
            h1 { "Opening…" }
            p { a #enter href="/" { "Continue to the page" } }
        }
    };
    doc("weft", html! { meta http-equiv="refresh" content="0; url=/"; }, body)
}

/// What a browser without the session sees (HTTP 403).
pub fn refused(why: &str) -> Markup {
    let body = html! {
        main.refused #refused {
            h1 { "Refused" }
            p { (why) }
            p { "Open the link weftctl ui printed, in one browser: it works once. Run " code { "weftctl ui" } " again for a new one." }
        }
    };
    doc("weft · refused", html! {}, body)
}

/// Seconds from `t` to `now` (0 for a time ahead).
fn age(t: &prost_types::Timestamp, now: SystemTime) -> i64 {
    let now = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    (now - t.seconds).max(0)
}

/// A handshake older than WireGuard's 180 s (its keys' lifetime): the
/// peer has gone silent.
fn stale_handshake(t: Option<&pb::TunnelStatus>, now: SystemTime) -> bool {
    t.and_then(|t| t.last_handshake.as_ref())
        .is_some_and(|h| age(h, now) > 180)
}

fn ago(t: Option<&prost_types::Timestamp>, now: SystemTime) -> String {
    let Some(t) = t else { return "never".into() };
    match age(t, now) {
        s @ 0..=119 => format!("{s}s ago"),
        s @ 120..=7199 => format!("{}m ago", s / 60),
        s => format!("{}h ago", s / 3600),
    }
}

fn badge(tone: &str, text: &str) -> Markup {
    html! { span class={"badge " (tone)} { (text) } }
}

/// The live part of the page.
pub fn live(s: &Snapshot) -> Markup {
    let site = &s.site;
    let now = SystemTime::now();
    let mut peerings: Vec<&pb::Peering> = site.peerings.iter().collect();
    peerings.sort_by(|a, b| a.site_id.cmp(&b.site_id));
    html! {
        @if let Some((since, why)) = &s.unreachable {
            div.banner.bad role="alert" {
                "The controller does not answer since " (clock(*since)) ": " (why)
                ". Shown below: its last answer, read at " (clock(s.read_at)) "."
            }
        }
        (summary(s, &peerings))
        section #topology aria-labelledby="h-topology" {
            h2 #h-topology { "Topology" }
            div.scroll { (super::graph::svg(site, &peerings)) }
            p.legend {
                span.key.ok { "connected" } " " span.key.relay { "relayed" } " "
                span.key.warn { "not connected yet" } " " span.key.bad { "down or failing" } " "
                span.key.transit { "transit" }
            }
        }
        section #peerings aria-labelledby="h-peerings" {
            h2 #h-peerings { "Peerings" }
            @if peerings.is_empty() {
                p.empty { "No peerings yet: " code { "weftctl peering token" } " on one site, " code { "weftctl peering create --token …" } " on the other." }
            } @else {
                div.scroll {
                    table.peerings.cards {
                        thead { tr {
                            th scope="col" { "Site" } th scope="col" { "State" } th scope="col" { "Path" }
                            th scope="col" { "RTT" } th scope="col" { "Handshake" } th scope="col" { "Received / sent" }
                            th scope="col" { "Refused by policy" } th scope="col" { "NAT" }
                        } }
                        tbody {
                            @for p in &peerings {
                                @let t = p.tunnel.as_ref();
                                tr data-peer=(p.site_id) data-state=(peering_state(p.state)) data-path=(path(p)) {
                                    th scope="row" { a #(format!("row-{}", p.site_id)) href=(format!("#peering-{}", p.site_id)) { (p.site_id) } }
                                    td data-label="State" { (badge(tone(p), &peering_state(p.state))) }
                                    td.path data-label="Path" { (path(p)) }
                                    td.num data-label="RTT" { (rtt(t)) }
                                    td data-label="Handshake" class=(if stale_handshake(t, now) { "bad" } else { "" }) {
                                        (ago(t.and_then(|t| t.last_handshake.as_ref()), now))
                                    }
                                    td.num data-label="Received / sent" { (t.map_or("-".into(), |t| format!("{} / {}", bytes(t.rx_bytes), bytes(t.tx_bytes)))) }
                                    td.num data-label="Refused by policy" { (t.map_or("-".into(), |t| format!("{} packets", t.dropped_by_policy))) }
                                    td data-label="NAT" { (nat(p)) }
                                }
                            }
                        }
                    }
                }
                p.hint { "Choose a site for its views, its export policy and what it exports." }
                @for p in &peerings { (detail(p, now)) }
            }
        }
        (gateways(s))
        (nodes(s, now))
        (diagnose(&s.diagnose))
        (events(s))
    }
}

fn summary(s: &Snapshot, peerings: &[&pb::Peering]) -> Markup {
    let connected = peerings.iter().filter(|p| tone(p) == "ok").count();
    let relayed = peerings.iter().filter(|p| path(p).starts_with("relayed")).count();
    let active = s.site.gateways.iter().find(|g| g.active).map(|g| g.name.clone());
    let ready = |st: &Option<pb::AgentStatus>| st.as_ref().is_some_and(|s| s.ready);
    let nodes_ready = s.site.nodes.iter().filter(|n| ready(&n.status)).count();
    let count = |checks: &[pb::Check], r: pb::CheckResult| checks.iter().filter(|c| c.result == r as i32).count();
    let (diag_tone, diag) = match &s.diagnose {
        Diagnosis::Waiting => ("muted", "running…".to_string()),
        Diagnosis::Failed { .. } => ("bad", "could not run".to_string()),
        Diagnosis::Done { checks, .. } => {
            let (fail, warn) = (
                count(checks, pb::CheckResult::Fail),
                count(checks, pb::CheckResult::Warn),
            );
            let tone = if fail > 0 {
                "bad"
            } else if warn > 0 {
                "warn"
            } else {
                "ok"
            };
            (tone, format!("{fail} failing · {warn} warnings"))
        }
    };
    let site = &s.site.site;
    html! {
        section.summary aria-label="Summary" {
            div.card {
                p.label { "Site " (site.id) }
                p { "pods " (site.pod_cidrs.join(", ")) }
                p { "revision " (site.revision) " · controller " (site.controller_version) }
            }
            div class={"card " (if connected == peerings.len() { "ok" } else { "warn" })} {
                p.label { "Peerings" }
                p.big { (connected) " of " (peerings.len()) " connected" }
                p { (relayed) " relayed" }
            }
            div class={"card " (if active.is_some() { "ok" } else { "bad" })} #card-gateway {
                p.label { "Active gateway" }
                p.big { (active.as_deref().unwrap_or("none")) }
                p { (s.site.gateways.len()) " gateways" }
            }
            div class={"card " (if nodes_ready == s.site.nodes.len() { "ok" } else { "warn" })} {
                p.label { "Nodes" }
                p.big { (nodes_ready) " of " (s.site.nodes.len()) " ready" }
            }
            div class={"card " (diag_tone)} {
                p.label { "Diagnose" }
                p.big { (diag) }
                p { a #card-checks href="#diagnose" { "the checks" } }
            }
        }
    }
}

/// The NAT in front of the gateways, as the tunnel or the peer's gateways report it.
fn nat(p: &pb::Peering) -> String {
    let here = p.tunnel.as_ref().map(|t| t.nat.as_str()).unwrap_or("");
    let there = p
        .remote_gateways
        .iter()
        .find(|g| g.active)
        .map(|g| g.nat.as_str())
        .unwrap_or("");
    match (here, there) {
        ("", "") => "-".into(),
        (h, "") => format!("here {h}"),
        ("", t) => format!("there {t}"),
        (h, t) => format!("here {h}, there {t}"),
    }
}

fn detail(p: &pb::Peering, now: SystemTime) -> Markup {
    let id = &p.site_id;
    let t = p.tunnel.as_ref();
    html! {
        details.peering #(format!("peering-{id}")) data-peer=(id) {
            summary #(format!("sum-{id}")) { "Peering with " strong { (id) } " — " (peering_state(p.state)) ", " (path(p)) }
            div.grid {
                div {
                    h3 { "Views (as " (id) " numbers them → as this site reaches them)" }
                    @if p.views.is_empty() { p.empty { "none yet" } } @else {
                        ul.views { @for v in &p.views {
                            li { code { (v.real_cidr) } " → " code { (v.local_cidr) } @if v.remapped { " " (badge("warn", "remapped")) } }
                        } }
                    }
                    h3 { "What " (id) " may reach here" }
                    @if let Some(e) = &p.export {
                        p { (policy::summary(e)) " " span.muted { "(policy " (policy::mode_text(e.mode)) ")" } }
                        @if let Some(w) = policy::unenforced(e) { p.bad { (w) } }
                    } @else { p { "everything (no policy set)" } }
                    h3 { "What " (id) " exports here" }
                    p { @if !p.peer_exports_limited { "everything" } @else if p.peer_exports.is_empty() { "nothing" } @else { (p.peer_exports.join(", ")) } }
                    @if p.transit || p.peer_transit || !p.transit_paths.is_empty() || !p.transit_onward.is_empty() {
                        h3 { "Transit" }
                        ul {
                            @if p.transit { li { "this site lets " (id) " reach its other peers through it" } }
                            @if p.peer_transit { li { (id) " lets this site reach its peers through it" } }
                            @if !p.transit_onward.is_empty() { li { "through here onward to: " (p.transit_onward.join(", ")) } }
                            @for tp in &p.transit_paths {
                                li { "site " (tp.site) " via " (id) ": "
                                    (tp.views.iter().map(|v| v.local_cidr.clone()).collect::<Vec<_>>().join(", "))
                                    @if tp.active { " (in use)" } @else { " (unused: a direct peering is preferred)" } }
                            }
                        }
                    }
                }
                div {
                    h3 { "Tunnel" }
                    @if let Some(t) = t {
                        dl {
                            dt { "state" } dd { (if t.up { "up" } else { "down" }) }
                            dt { "path" } dd { (path(p)) }
                            dt { "gateway" } dd { (if t.gateway.is_empty() { "-" } else { &t.gateway }) }
                            dt { "RTT" } dd { (rtt(Some(t))) " (" (t.probes_lost) " of " (t.probes_sent) " probes lost)" }
                            dt { "last handshake" } dd { (ago(t.last_handshake.as_ref(), now)) }
                            dt { "packets in / out" } dd { (t.rx_packets) " / " (t.tx_packets) }
                            dt { "refused by policy" } dd { (t.dropped_by_policy) " packets" }
                            dt { "MTU" } dd { (t.mtu) @if let Some(m) = &t.path_mtu { " (path check: " (m.result) ")" } }
                            dt { "reported" } dd { (ago(t.reported_at.as_ref(), now)) " by the gateway" }
                            @if !t.device_failure.is_empty() || t.device_restarts > 0 {
                                dt { "WireGuard device" } dd.bad { (t.device_restarts) " restarts" @if !t.device_failure.is_empty() { "; last failure: " (t.device_failure) } }
                            }
                        }
                    } @else { p.empty { "no report from a gateway yet" } }
                    @if !p.last_error.is_empty() { h3 { "Last error" } p.bad { (p.last_error) } }
                    h3 { "Peer" }
                    dl {
                        dt { "release" } dd { (if p.peer_version.is_empty() { "before 0.1.0 (does not say)" } else { &p.peer_version }) }
                        dt { "holds its side" } dd { (if p.held_by_peer { "yes" } else { "not seen yet" }) }
                        @if !p.pending_workload_cidrs.is_empty() || !p.pending_external_cidr.is_empty() {
                            dt { "renumbered, to accept" } dd.warn-text {
                                (p.pending_workload_cidrs.iter().chain(std::iter::once(&p.pending_external_cidr)).filter(|c| !c.is_empty()).cloned().collect::<Vec<_>>().join(", "))
                                " (" code { "weftctl peering accept " (id) } ")"
                            }
                        }
                    }
                    @if !p.waiting_for.is_empty() { h3 { "Waiting for" } p { (p.waiting_for.join("; ")) } }
                    h3 { "Gateways" }
                    ul {
                        @for g in &p.local_gateways { li { "here: " (g.name) @if g.active { " (active)" } } }
                        @for g in &p.remote_gateways {
                            li { "at " (id) ": " (g.name) " " (if g.endpoint.is_empty() { "no public endpoint" } else { &g.endpoint })
                                @if !g.nat.is_empty() { ", NAT " (g.nat) } @if g.active { " (active)" } }
                        }
                    }
                }
            }
        }
    }
}

fn gateways(s: &Snapshot) -> Markup {
    html! {
        section #gateways aria-labelledby="h-gateways" {
            h2 #h-gateways { "Gateways" }
            div.scroll { table.cards {
                thead { tr {
                    th scope="col" { "Name" } th scope="col" { "Role" } th scope="col" { "Ready" } th scope="col" { "WireGuard" }
                    th scope="col" { "Endpoint" } th scope="col" { "NAT" } th scope="col" { "Applied / latest" } th scope="col" { "Version" }
                } }
                tbody { @for g in &s.site.gateways {
                    @let host = g.status.as_ref().and_then(|s| s.host.as_ref());
                    @let role = if g.active { "active" } else { "standby" };
                    tr data-gateway=(g.name) data-role=(role) {
                        th scope="row" { (g.name) }
                        td data-label="Role" { (badge(if g.active { "ok" } else { "muted" }, role)) }
                        td data-label="Ready" { (ready(&g.status)) }
                        td data-label="WireGuard" { span { (host.map_or("-", |h| if h.wireguard.is_empty() { "-" } else { &h.wireguard }))
                             @if let Some(r) = host.map(|h| &h.wireguard_reason).filter(|r| !r.is_empty()) { br; span.muted { (r) } } } }
                        td data-label="Endpoint" { (if g.endpoint.is_empty() { "-" } else { &g.endpoint }) }
                        td data-label="NAT" { (if g.nat.is_empty() { "-" } else { &g.nat }) }
                        td.num data-label="Applied / latest" { (revision_cell(&g.status)) }
                        td data-label="Version" { (host.map_or("-", |h| &h.version)) }
                    }
                } }
            } }
        }
    }
}

fn ready(st: &Option<pb::AgentStatus>) -> Markup {
    match st {
        Some(s) if s.ready => badge("ok", "ready"),
        Some(_) => badge("bad", "not ready"),
        None => badge("muted", "never seen"),
    }
}

fn nodes(s: &Snapshot, now: SystemTime) -> Markup {
    html! {
        section #nodes aria-labelledby="h-nodes" {
            h2 #h-nodes { "Nodes" }
            @if s.site.nodes.is_empty() { p.empty { "No nodes yet." } } @else {
                div.scroll { table.cards {
                    thead { tr {
                        th scope="col" { "Name" } th scope="col" { "Ready" } th scope="col" { "Subnet" }
                        th scope="col" { "Applied / latest" } th scope="col" { "Last seen" } th scope="col" { "Errors" }
                    } }
                    tbody { @for n in &s.site.nodes {
                        tr data-node=(n.name) {
                            th scope="row" { (n.name) }
                            td data-label="Ready" { (ready(&n.status)) }
                            td data-label="Subnet" { (subnets(n)) }
                            td.num data-label="Applied / latest" { (revision_cell(&n.status)) }
                            td data-label="Last seen" { (ago(n.status.as_ref().and_then(|s| s.last_seen.as_ref()), now)) }
                            td data-label="Errors" { (n.status.as_ref().map(|s| s.errors.join("; ")).filter(|e| !e.is_empty()).unwrap_or_else(|| "-".into())) }
                        }
                    } }
                } }
            }
        }
    }
}

fn diagnose(d: &Diagnosis) -> Markup {
    html! {
        section #diagnose aria-labelledby="h-diagnose" {
            h2 #h-diagnose { "Diagnose" }
            @match d {
                Diagnosis::Waiting => p.empty { "Running the checks…" },
                Diagnosis::Failed { at, error } => p.bad { "diagnose could not run at " (clock(*at)) ": " (error) },
                Diagnosis::Done { at, checks } => {
                    @let (pass, rest): (Vec<&pb::Check>, Vec<&pb::Check>) =
                        checks.iter().partition(|c| c.result == pb::CheckResult::Pass as i32);
                    p.muted { "checked at " (clock(*at)) }
                    @if rest.is_empty() { p { (badge("ok", "PASS")) " every check passes" } }
                    ul.checks { @for c in &rest {
                        @let tone = if c.result == pb::CheckResult::Fail as i32 { "bad" } else { "warn" };
                        li data-check=(c.check) {
                            (badge(tone, result_name(c.result))) " " strong { (c.check) } " " (c.subject) ": " (c.detail)
                            @if !c.hint.is_empty() { br; span.fix { "Fix: " (c.hint) } }
                        }
                    } }
                    @if !pass.is_empty() {
                        details #checks-pass { summary #checks-pass-summary { (pass.len()) " checks pass" }
                            ul.checks { @for c in &pass { li { strong { (c.check) } " " (c.subject) ": " (c.detail) } } }
                        }
                    }
                }
            }
        }
    }
}

fn events(s: &Snapshot) -> Markup {
    html! {
        section #events aria-labelledby="h-events" {
            h2 #h-events { "Recent events" }
            p.muted { "Failovers, path moves, peerings and agents as this page saw them, and joins the controller refused." }
            ol.events { @for e in s.events.iter().take(30) {
                li data-kind=(e.kind.name()) { time { (clock(e.at)) } " " span.kind { (e.kind.name()) } " " (e.text) }
            } }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::status::Site;
    use crate::cmd::ui::watch::Snapshot;

    /// A site with `n` peerings, a few relayed, down or reached in transit.
    fn site(n: usize) -> Site {
        let peering = |i: usize| pb::Peering {
            site_id: format!("site-{i:02}"),
            state: if i % 7 == 3 {
                pb::PeeringState::Connecting
            } else {
                pb::PeeringState::Connected
            } as i32,
            views: vec![pb::CidrView {
                real_cidr: "10.0.0.0/16".into(),
                local_cidr: format!("10.{}.0.0/16", 100 + i),
                remapped: true,
                ..Default::default()
            }],
            tunnel: Some(pb::TunnelStatus {
                up: i % 7 != 3,
                path: if i % 5 == 1 {
                    "relayed via r".into()
                } else {
                    "direct".into()
                },
                rtt_micros: 1200,
                ..Default::default()
            }),
            transit_paths: if i == 2 {
                vec![pb::TransitPath {
                    site: "far".into(),
                    active: true,
                    ..Default::default()
                }]
            } else {
                vec![]
            },
            ..Default::default()
        };
        Site {
            site: pb::Site {
                id: "a".into(),
                pod_cidrs: vec!["10.0.0.0/16".into()],
                ..Default::default()
            },
            gateways: vec![pb::Gateway {
                name: "gw".into(),
                active: true,
                ..Default::default()
            }],
            nodes: vec![],
            peerings: (0..n).map(peering).collect(),
            refused_joins: vec![],
            last_failover: None,
        }
    }

    #[test]
    fn every_peering_is_drawn_listed_and_detailed_with_its_values_escaped() {
        let mut s = site(50);
        s.peerings[0].last_error = "<script>alert(1)</script>".into();
        let html = live(&Snapshot::for_test(s)).into_string();
        for i in 0..50 {
            let id = format!("site-{i:02}");
            assert!(html.contains(&format!("data-peer=\"{id}\" data-state=")), "{id} listed");
            assert!(html.contains(&format!("id=\"graph-{id}\"")), "{id} drawn");
            assert!(html.contains(&format!("id=\"peering-{id}\"")), "{id} detailed");
        }
        assert!(html.contains("data-path=\"relayed via r\""));
        assert!(html.contains("transit via site-02"));
        assert!(!html.contains("<script>"), "values are escaped");
        assert!(html.contains("&lt;script&gt;"));
        // In HTML, SVG elements are not void: an unclosed <rect> would swallow the text after it.
        assert_eq!(html.matches("<rect").count(), html.matches("</rect>").count());
    }
}
