//! `Diagnose`: checks of what actually breaks a fabric, each with a result
//! and what to do. Everything comes from what the controller already holds
//! — records, the agents' liveness and host reports, the gateways' tunnel
//! reports — plus one clock call to each peer's controller.

use std::time::Duration;

use weft_proto::v1 as pb;

use crate::domain::{AgentRole, CertRecord, live_until, now_ms};
use crate::error::Error;
use crate::federation::Federation;
use crate::hub::Hub;
use crate::state::AliveRecord;
use crate::state::State;

mod family;
mod tunnel;
use tunnel::{path_check, tunnel_checks};

/// Skew above which certificates and tokens may be judged wrongly.
const SKEW_FAIL: f64 = 1.0;
const SKEW_WARN: f64 = 0.25;

fn check(check: &str, subject: String, result: pb::CheckResult, detail: String, hint: &str) -> pb::Check {
    pb::Check {
        check: check.into(),
        subject,
        result: result as i32,
        detail,
        hint: hint.into(),
    }
}

fn pass(c: &str, subject: String, detail: String) -> pb::Check {
    check(c, subject, pb::CheckResult::Pass, detail, "")
}

fn when(ms: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

fn ago(ms: u64, now: u64) -> String {
    humantime::format_duration(Duration::from_secs(now.saturating_sub(ms) / 1000)).to_string()
}

/// One enrolled agent as the checks see it.
struct Agent {
    role: AgentRole,
    name: String,
    certs: Vec<CertRecord>,
    conflict: Option<crate::domain::IdentityConflict>,
}

impl Agent {
    fn subject(&self) -> String {
        format!("{}/{}", self.role.as_str(), self.name)
    }

    fn delete_cmd(&self) -> String {
        format!("weftctl {} remove {}", self.role.as_str(), self.name)
    }
}

fn certificate(a: &Agent, live: bool, now: u64) -> pb::Check {
    if let Some(c) = &a.conflict {
        return check(
            "certificate",
            a.subject(),
            pb::CheckResult::Fail,
            c.to_string(),
            &format!(
                "a second host has this agent's key and certificate: find it; then run `{}` and enroll the real \
                 host again with a new token (its data plane keeps forwarding meanwhile)",
                a.delete_cmd()
            ),
        );
    }
    let latest = a.certs.iter().map(|c| c.not_after_ms).max();
    match latest {
        None => check(
            "certificate",
            a.subject(),
            pb::CheckResult::Warn,
            "no agent has enrolled under this name yet".into(),
            "enroll the agent with a token from `weftctl token create`",
        ),
        Some(t) if t <= now => check(
            "certificate",
            a.subject(),
            pb::CheckResult::Fail,
            format!("its certificate expired at {} ({} ago)", when(t), ago(t, now)),
            &format!(
                "the agent can no longer connect or renew: run `{}`, then enroll it again with a new token",
                a.delete_cmd()
            ),
        ),
        Some(t) if !live && live_until(&a.certs, now).is_some_and(|u| u - now < 86_400_000) => check(
            "certificate",
            a.subject(),
            pb::CheckResult::Warn,
            format!(
                "its certificate expires at {} and the agent is not connected to renew it",
                when(t)
            ),
            "start the agent before then, or it must be enrolled again",
        ),
        Some(t) => pass("certificate", a.subject(), format!("valid until {}", when(t))),
    }
}

/// What one agent's stream on this replica looks like now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Progress {
    applied: i64,
    sent: i64,
    waiting: usize,
}

impl Progress {
    fn behind(&self) -> bool {
        self.applied < self.sent || self.waiting > 0
    }
}

fn progress(
    hub: &Hub,
    alive: &std::collections::HashMap<(AgentRole, String), AliveRecord>,
) -> Vec<((AgentRole, String), Progress)> {
    let backlog: std::collections::HashMap<_, _> = hub.stream_backlog().into_iter().collect();
    alive
        .iter()
        .filter_map(|(key, rec)| {
            let sent = hub.latest(key)?;
            Some((
                key.clone(),
                Progress {
                    // This replica hears it: what it reported last (its
                    // record may wait to move here, see `hub::liveness`).
                    applied: hub.applied(key, rec.applied_revision),
                    sent,
                    waiting: backlog.get(key).copied().unwrap_or(0),
                },
            ))
        })
        .collect()
}

fn agent_checks(
    a: &Agent,
    rec: Option<&AliveRecord>,
    before: Option<&Progress>,
    after: Option<&Progress>,
    hub: &Hub,
    now: u64,
    out: &mut Vec<pb::Check>,
) {
    let key = (a.role, a.name.clone());
    let Some(rec) = rec else {
        let seen = hub
            .last_seen(&key)
            .map_or("never reported to this controller".to_string(), |t| {
                format!("last report {} ago", ago(t, now))
            });
        out.push(check(
            "agent",
            a.subject(),
            pb::CheckResult::Fail,
            format!("not ready: {seen}"),
            &format!(
                "is weft-{}-agent running on the host, and can it reach the controller? See its log",
                a.role.as_str()
            ),
        ));
        return;
    };
    match (before, after) {
        // Behind at both looks, and not even at what it had been sent at
        // the first: stuck, not busy.
        (Some(b), Some(x)) if b.behind() && x.behind() && x.applied < b.sent => {
            out.push(check(
                "agent",
                a.subject(),
                pb::CheckResult::Fail,
                format!(
                    "lagging: applied revision {}, the controller sent {} and has {} more update(s) waiting; no progress while watched",
                    x.applied, x.sent, x.waiting
                ),
                "the agent is stuck or overloaded: check its log and host (a frozen process, a full disk); restarting it resumes from its stored state",
            ));
        }
        // It reports to this replica but has no stream here: its connection
        // was found dead (it stopped answering) and it has not come back.
        (_, None) if rec.replica == hub.replica() => out.push(check(
            "agent",
            a.subject(),
            pb::CheckResult::Fail,
            format!(
                "lagging: it stopped answering this controller (its connection was found dead) and has not come \
                 back; revision {} applied",
                rec.applied_revision
            ),
            "the agent's process or host is frozen or cut off: check it; restarting it resumes from its stored state",
        )),
        _ => out.push(pass(
            "agent",
            a.subject(),
            match after {
                Some(x) => format!("ready, revision {} applied", x.applied),
                None => format!(
                    "ready (streaming from another replica), revision {} applied",
                    rec.applied_revision
                ),
            },
        )),
    }
    if !rec.errors.is_empty() {
        out.push(check(
            "objects",
            a.subject(),
            pb::CheckResult::Fail,
            format!("{} object(s) failed to apply; first: {}", rec.errors.len(), rec.errors[0]),
            "read the agent's log for the failing object; fix the host (a name or address already taken, a missing kernel module)",
        ));
    }
    kernel_checks(a, rec, out);
    // Its release against the controller's (`weft_types::version`); an
    // agent that has not reported its host yet says nothing.
    if !rec.features.is_empty() {
        let own = env!("CARGO_PKG_VERSION");
        match weft_types::version::agent_skew(own, &rec.version) {
            Some(why) => out.push(check(
                "version",
                a.subject(),
                pb::CheckResult::Warn,
                why,
                "run agents of the controller's release or one minor release older (`weftctl version` lists them)",
            )),
            None => out.push(pass("version", a.subject(), format!("release {}", rec.version))),
        }
    }
    for c in &rec.route_conflicts {
        out.push(check(
            "route",
            a.subject(),
            pb::CheckResult::Warn,
            format!("host route {c}: weft's policy rule (priority {}) sends that traffic to the peer instead", crate::render::RULE_PRIORITY),
            "if the host needs the route, reserve its CIDR (--reserved-cidr) so peers' views are remapped away from it, and re-peer",
        ));
    }
}

/// What the agent's kernel can run: the overlay, and on a gateway which
/// WireGuard.
fn kernel_checks(a: &Agent, rec: &AliveRecord, out: &mut Vec<pb::Check>) {
    if rec.features.is_empty() {
        return;
    }
    let has = |f: &str| rec.features.iter().any(|x| x == f);
    if !has("vxlan") {
        out.push(check(
            "kernel",
            a.subject(),
            pb::CheckResult::Fail,
            "the kernel cannot make VXLAN links: no overlay to the gateway".into(),
            "load the vxlan module (`modprobe vxlan`) or use a kernel built with it",
        ));
    } else {
        let overlay = if has("geneve") {
            "Geneve or VXLAN"
        } else {
            "VXLAN (no Geneve)"
        };
        // What the gateway runs (agents before it was reported: what
        // its kernel could run).
        let wg = match (rec.wireguard.as_str(), has("wireguard")) {
            ("", true) => "kernel",
            ("", false) => "userspace",
            (m, _) => m,
        };
        let reason = if rec.wireguard_reason.is_empty() {
            String::new()
        } else {
            format!(" ({})", rec.wireguard_reason)
        };
        if a.role != AgentRole::Gateway || wg == "kernel" {
            let wg = if a.role == AgentRole::Gateway {
                format!("; WireGuard: kernel{reason}")
            } else {
                String::new()
            };
            out.push(pass("kernel", a.subject(), format!("overlay: {overlay}{wg}")));
        } else if has("wireguard") {
            out.push(check(
                "kernel",
                a.subject(),
                pb::CheckResult::Warn,
                format!(
                    "overlay: {overlay}; WireGuard: userspace (weft's device){reason}, though the kernel has WireGuard, which saves the copies to and from userspace"
                ),
                "restart the gateway agent with --wireguard auto (or kernel)",
            ));
        } else {
            out.push(check(
                "kernel",
                a.subject(),
                pb::CheckResult::Warn,
                format!(
                    "overlay: {overlay}; WireGuard: userspace (weft's device){reason}; kernel WireGuard would save the copies to and from userspace"
                ),
                "run the gateway on a kernel with WireGuard (Linux 5.6 or later, CONFIG_WIREGUARD) and restart its agent: \
                 with --wireguard auto it takes the kernel's",
            ));
        }
    }
}

/// Runs every check.
pub async fn run(
    state: &State,
    hub: &Hub,
    fed: &Federation,
    ca_not_after_ms: Option<u64>,
    settle: Duration,
) -> Result<Vec<pb::Check>, Error> {
    let mut out = Vec::new();
    let now = now_ms();
    out.extend(ca_not_after_ms.map(|t| ca_check(t, now)));
    let (site, _) = state.site().await?;
    let (nodes, _) = state.list_nodes().await?;
    let (gateways, _) = state.list_gateways().await?;
    let (peerings, _) = state.list_peerings().await?;
    let agents: Vec<Agent> = nodes
        .iter()
        .map(|n| Agent {
            role: AgentRole::Node,
            name: n.name.clone(),
            certs: n.certs.clone(),
            conflict: n.identity_conflict.clone(),
        })
        .chain(gateways.iter().map(|g| Agent {
            role: AgentRole::Gateway,
            name: g.name.clone(),
            certs: g.certs.clone(),
            conflict: g.identity_conflict.clone(),
        }))
        .collect();
    out.extend(gateways.iter().filter_map(gateway_key_check));
    out.extend(ipv6_check(&site, &nodes));
    out.extend(collision_checks(&hub.model()));
    // Lag: two looks at each agent's progress, `settle` apart.
    let first = progress(hub, &state.alive().await?);
    tokio::time::sleep(settle).await;
    let alive = state.alive().await?;
    let second = progress(hub, &alive);
    let find = |v: &[((AgentRole, String), Progress)], a: &Agent| {
        v.iter().find(|(k, _)| k.0 == a.role && k.1 == a.name).map(|(_, p)| *p)
    };
    for a in &agents {
        let rec = alive.get(&(a.role, a.name.clone()));
        out.push(certificate(a, rec.is_some(), now));
        agent_checks(
            a,
            rec,
            find(&first, a).as_ref(),
            find(&second, a).as_ref(),
            hub,
            now,
            &mut out,
        );
    }
    let local = crate::federation::LocalGateways::of(&hub.model());
    for p in &peerings {
        tunnel_checks(&site, p, hub.tunnel(&p.site_id), &mut out);
        let t = hub.tunnel(&p.site_id);
        let seen = |f: fn(&pb::TunnelStatus) -> bool| t.as_ref().is_some_and(f);
        out.push(path_check(
            &site,
            p,
            &local.for_port(&site, p.listen_port),
            seen(|t| t.up),
            seen(|t| t.over_tls),
            seen(|t| t.on_direct),
        ));
        if let Some(remote) = &p.remote {
            let subject = format!("peering/{}", p.site_id);
            let own = env!("CARGO_PKG_VERSION");
            out.push(match weft_types::version::peer_skew(own, &remote.version) {
                Some(why) => check(
                    "version",
                    subject,
                    pb::CheckResult::Warn,
                    why,
                    "peered sites may be one minor release apart at most (`weftctl version` lists them)",
                ),
                None => pass("version", subject, format!("the peer runs {}", remote.version)),
            });
        }
        out.extend(family::ipv4_check(&site, p));
        out.extend(family::ipv6_check(&site, p));
        let subject = format!("peering/{}", p.site_id);
        let Some(remote) = &p.remote else { continue };
        out.push(clock_check(subject, fed.clock_skew(remote).await));
    }
    // Joins refused here lately: the peer's admin was told why; this
    // site's admin learns it here.
    out.extend(fed.refused.list().iter().filter_map(refusal_check));
    Ok(out)
}

/// Records that are not rendered because a name derived from theirs (a
/// gateway link, a peering's links or namespace) is an older record's.
fn collision_checks(m: &crate::render::Model) -> Vec<pb::Check> {
    let what = |record: &str| match record.split_once('/') {
        Some(("node", n)) => format!("node {n:?}"),
        Some(("peer", p)) => format!("the peering with {p:?}"),
        _ => record.to_string(),
    };
    let mut out = Vec::new();
    for c in m.collisions() {
        let first = &c.holders[0].record;
        for h in &c.holders[1..] {
            let hint = match h.record.split_once('/') {
                Some(("node", n)) => format!(
                    "remove it (`weftctl node remove {n}`) and enroll its host under another name; the names \
                     hash alike, which enrollment refuses, so it was written past that check (two replicas at \
                     once, a restored backup)"
                ),
                Some(("peer", p)) => format!(
                    "delete it (`weftctl peering delete {p}`): this site cannot peer with both; the ids hash \
                     alike, which Join refuses, so it was written past that check"
                ),
                _ => String::new(),
            };
            out.push(check(
                "name-collision",
                h.record.replacen("peer/", "peering/", 1),
                pb::CheckResult::Fail,
                format!(
                    "{} is not rendered: {} would be its name on the gateways, and {} holds it",
                    what(&h.record),
                    c.name,
                    what(first)
                ),
                &hint,
            ));
        }
    }
    out
}

/// The peer's controller clock against this one's.
fn clock_check(subject: String, measured: Result<(f64, Duration), String>) -> pb::Check {
    match measured {
        Ok((skew, rtt)) => {
            let detail = format!(
                "the peer's controller clock is {:+.3} s from this one's (measured over a {:.1} ms round trip)",
                skew,
                rtt.as_secs_f64() * 1000.0
            );
            let hint = "run NTP (chrony, systemd-timesyncd) on both controllers' hosts";
            if skew.abs() > SKEW_FAIL {
                check("clock", subject, pb::CheckResult::Fail, detail, hint)
            } else if skew.abs() > SKEW_WARN {
                check("clock", subject, pb::CheckResult::Warn, detail, hint)
            } else {
                pass("clock", subject, detail)
            }
        }
        Err(e) => check(
            "clock",
            subject,
            pb::CheckResult::Warn,
            format!("the peer's controller did not answer: {e}"),
            "check that this controller reaches the peer's advertised endpoints (--advertise) over TCP",
        ),
    }
}

/// The site CA's expiry.
fn ca_check(t: u64, now: u64) -> pb::Check {
    let days_left = t.saturating_sub(now) / 86_400_000;
    if t <= now {
        check(
            "certificate",
            "site-ca".into(),
            pb::CheckResult::Fail,
            format!("the site CA expired at {}", when(t)),
            "replace it: `weft-controller ca rotate --revoke-old`, restart, then enroll every agent again and \
             set the new CA on every peer (`weftctl peering set-ca`); see docs/operating.md, Rotating the site CA",
        )
    } else if days_left < 90 {
        check(
            "certificate",
            "site-ca".into(),
            pb::CheckResult::Warn,
            format!("the site CA expires at {} ({days_left} days)", when(t)),
            "rotate it before then, with no traffic lost: `weft-controller ca rotate`, restart, and once \
             `weft-controller ca status` shows nothing left on the old CA, `ca finish` and restart",
        )
    } else {
        pass("certificate", "site-ca".into(), format!("valid until {}", when(t)))
    }
}

/// A site with IPv6 CIDRs: what of IPv6 works yet.
fn ipv6_check(site: &crate::domain::Site, nodes: &[crate::domain::Node]) -> Vec<pb::Check> {
    let Some(v6) = site.ipv6.as_ref() else { return vec![] };
    let mut out: Vec<pb::Check> = nodes
        .iter()
        .filter(|n| n.subnet_v6.is_none())
        .map(|n| {
            check(
                "ipv6-subnet",
                format!("node/{}", n.name),
                pb::CheckResult::Warn,
                format!("node {:?} has no IPv6 /64: the site's IPv6 pod CIDRs are full", n.name),
                "add an IPv6 pod CIDR (a /56 holds 256 nodes) and restart the controller, or remove unused nodes",
            )
        })
        .collect();
    let pods: Vec<String> = v6.pod_cidrs.iter().map(|c| c.to_string()).collect();
    out.push(check(
        "ipv6",
        format!("site/{}", site.id),
        pb::CheckResult::Pass,
        format!(
            "IPv6 pod CIDRs {} are allocated (a /64 per node, remap pools {}) and carried through the tunnels of \
             every peering that negotiated IPv6 (`weftctl peerings`), export policies included; not yet: IPv6 \
             in transit",
            pods.join(", "),
            v6.remap_pools
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        "",
    ));
    out
}

/// A gateway asking to change its WireGuard key.
fn gateway_key_check(g: &crate::domain::Gateway) -> Option<pb::Check> {
    let key = g.pending_public_key?;
    Some(check(
        "gateway-key",
        format!("gateway/{}", g.name),
        pb::CheckResult::Warn,
        format!(
            "gateway {:?} asks to change its WireGuard key; peers keep the current one",
            g.name
        ),
        &format!(
            "if its host really made a new key (its wireguard.key was lost) and logged {}, run `weftctl gateway \
             accept-key {} {}`; otherwise its certificate may be stolen: remove it and enroll it again",
            key, g.name, key
        ),
    ))
}

/// A Join refused here within the last day.
fn refusal_check(r: &crate::refused::Refusal) -> Option<pb::Check> {
    let age = std::time::SystemTime::now()
        .duration_since(r.last_at)
        .unwrap_or_default();
    if age > REFUSAL_SHOWN {
        return None;
    }
    let times = if r.count > 1 {
        format!(" {} times,", r.count)
    } else {
        String::new()
    };
    Some(check(
        "join",
        format!("peer/{}", r.site_id),
        pb::CheckResult::Warn,
        format!(
            "refused site {:?}'s join{times} last {} ago: {}: {}",
            r.site_id,
            humantime::format_duration(Duration::from_secs(age.as_secs())),
            crate::refused::code_name(r.code),
            r.message
        ),
        "nothing to do if the refusal is right; otherwise change what it names on this site \
         (--peer-public-cidr, --remap-pool, ...) and have the peer run `weftctl peering create` again",
    ))
}

/// How long `diagnose` shows a refused join.
const REFUSAL_SHOWN: Duration = Duration::from_secs(24 * 3600);
