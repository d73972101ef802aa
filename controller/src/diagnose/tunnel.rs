//! Per peering: the tunnel's health and MTU as its gateway reports them,
//! and the path it takes (direct, hole-punched, or why not).

use weft_proto::v1 as pb;

use super::{check, pass};

/// The tunnel to a peer as its gateway reports it: up or down, and its MTU.
pub(super) fn tunnel_checks(
    site: &crate::domain::Site,
    p: &crate::domain::Peering,
    t: Option<pb::TunnelStatus>,
    out: &mut Vec<pb::Check>,
) {
    let subject = format!("peering/{}", p.site_id);
    let Some(t) = t else {
        out.push(check(
            "tunnel",
            subject,
            pb::CheckResult::Warn,
            "no gateway reported a tunnel for this peering".into(),
            "is the active gateway connected (`weftctl status`)? The peering may still be negotiating",
        ));
        return;
    };
    if t.up {
        out.push(pass(
            "tunnel",
            subject.clone(),
            format!("up through {}, RTT {:.1} ms", t.gateway, t.rtt_micros as f64 / 1000.0),
        ));
    } else {
        out.push(check(
            "tunnel",
            subject.clone(),
            pb::CheckResult::Fail,
            format!("down: {} of {} probes unanswered", t.probes_lost, t.probes_sent),
            "check that the peer's gateway runs and that UDP to its endpoint passes (firewall, NAT, the WAN link)",
        ));
    }
    if !t.offloads.is_empty() || t.rx_rejected > 0 {
        let offloads = if t.offloads.is_empty() || t.offloads == ["none"] {
            "none (a packet per system call)".to_string()
        } else {
            t.offloads.join(", ")
        };
        let detail = format!(
            "userspace device, offloads: {offloads}; {} datagrams refused from the network",
            t.rx_rejected
        );
        if t.device_restarts > 0 {
            out.push(check(
                "wireguard",
                subject.clone(),
                pb::CheckResult::Warn,
                format!(
                    "{detail}; the device died {} time(s) and was made anew, last: {}",
                    t.device_restarts, t.device_failure
                ),
                "a device thread panicked, a bug in weft: report it with the gateway agent's log around the time",
            ));
        } else {
            out.push(pass("wireguard", subject.clone(), detail));
        }
    }
    let configured = match site.tunnel_mtu {
        Some(m) => format!("this site's --tunnel-mtu {m}"),
        None => "the peer's --tunnel-mtu, or the underlay".into(),
    };
    match t.path_mtu {
        Some(c) if c.result == "ok" => out.push(pass(
            "mtu",
            subject,
            format!(
                "tunnel MTU {}: {}-byte packets with DF cross to {}",
                t.mtu, c.probe_size, c.target
            ),
        )),
        Some(c) if c.result == "too_big" || c.result == "unanswered" => {
            let limit = if c.path_mtu > 0 {
                format!("the path toward {} carries at most {} bytes", c.target, c.path_mtu)
            } else {
                format!(
                    "{}-byte packets with DF toward {} are lost while small ones arrive",
                    c.probe_size, c.target
                )
            };
            // WireGuard's overhead: 60 bytes over IPv4, 80 over IPv6.
            let overhead = match c.target.parse::<std::net::IpAddr>() {
                Ok(std::net::IpAddr::V6(_)) => 80,
                _ => 60,
            };
            let fix = if c.path_mtu > 0 {
                format!(
                    "set --tunnel-mtu to {} or less (the underlay's MTU minus {overhead}), or unset it to derive it",
                    c.path_mtu.saturating_sub(overhead)
                )
            } else {
                "lower --tunnel-mtu (or unset it to derive it from the underlay)".to_string()
            };
            out.push(check(
                "mtu",
                subject,
                pb::CheckResult::Fail,
                format!(
                    "tunnel MTU {} (from {configured}) is too high: full packets need {} bytes on the underlay but {limit}; they are fragmented or dropped",
                    t.mtu, c.probe_size
                ),
                &fix,
            ));
        }
        other => out.push(check(
            "mtu",
            subject,
            pb::CheckResult::Warn,
            match other {
                Some(c) => format!(
                    "not checked: the peer's endpoint {} does not answer ICMP echo",
                    c.target
                ),
                None => "not checked yet (the gateway checks once the tunnel is up)".into(),
            },
            "allow ICMP echo between the gateways to have the path MTU checked",
        )),
    }
}

/// How the peering's tunnel gets through: directly, hole-punched, or not
/// yet, and then why and what would fix it; `over_tls`: the gateway
/// carries it over TLS (its UDP gets no handshake answered).
pub(super) fn path_check(
    site: &crate::domain::Site,
    p: &crate::domain::Peering,
    local: &[pb::GatewayInfo],
    up: bool,
    over_tls: bool,
    on_direct: bool,
) -> pb::Check {
    let subject = format!("peering/{}", p.site_id);
    let path = weft_core::peer::tunnel_path(p, local, up, on_direct);
    if over_tls {
        return check(
            "path",
            subject,
            pb::CheckResult::Warn,
            format!(
                "{path} over TLS: this site's gateway got no handshake answered over UDP (its network lets no UDP \
                 out, or not to that gateway), so it carries the tunnel over TLS on TCP, at a cost in throughput"
            ),
            "let UDP out from this site's gateway to the peers' and the relay's WireGuard and relay ports; the \
             tunnel goes back to UDP by itself once it does",
        );
    }
    let own = local.iter().find(|g| g.active).or(local.first());
    let peer = p
        .remote
        .as_ref()
        .and_then(|r| r.gateways.iter().find(|g| g.active).or(r.gateways.first()));
    let nat_of = |n: Option<&str>| match n {
        Some("") | None => "not probed yet".to_string(),
        Some(n) => n.to_string(),
    };
    let own_nat = nat_of(own.map(|g| g.nat.as_str()));
    let peer_nat = nat_of(peer.and_then(|g| g.nat.map(|b| b.as_str())));
    let gw = own.map(|g| g.name.as_str()).unwrap_or("the active gateway");
    let forward = format!(
        "forward UDP {} on this site's router to gateway {gw} and give it --endpoint ROUTER_ADDRESS:{} (or have \
         the peer do the same)",
        site.wireguard_ports, site.wireguard_ports.first
    );
    match path.as_str() {
        "direct" => pass("path", subject, "direct: a gateway has a reachable endpoint".into()),
        relayed if relayed.starts_with("relayed via ") && weft_core::peer::direct_path(p, local) == "hole-punched" => {
            check(
                "path",
                subject,
                pb::CheckResult::Warn,
                format!(
                    "{relayed}: the hole punch (this side's NAT: {own_nat}; the peer's: {peer_nat}) is not up, so the \
                     relay carries the tunnel meanwhile; the punch is tried beside it, and the tunnel moves to it once \
                     it answers"
                ),
                &format!(
                    "if it stays relayed, UDP between the two sites may be blocked; for a direct path anyway, {forward}"
                ),
            )
        }
        relayed if relayed.starts_with("relayed via ") => check(
            "path",
            subject,
            pb::CheckResult::Warn,
            format!(
                "{relayed}: no direct path (this side's NAT: {own_nat}; the peer's: {peer_nat}); the relay carries \
                 the tunnel, still encrypted, at some cost in latency and throughput"
            ),
            &format!("for a direct path, {forward}"),
        ),
        "hole-punched" => pass(
            "path",
            subject,
            format!(
                "hole-punched: both gateways behind NAT (this side: {own_nat}; the peer: {peer_nat}), both send at once"
            ),
        ),
        _ => check(
            "path",
            subject,
            pb::CheckResult::Warn,
            format!(
                "no direct path yet: neither side has a gateway endpoint, and hole punching needs NAT that keeps one \
                 outside port for every destination (this side's NAT: {own_nat}; the peer's: {peer_nat}); an \
                 endpoint-dependent NAT gives a new port per destination; and no relay site that both sides are \
                 peered with carries it (a peer's controller with --relay)"
            ),
            &forward,
        ),
    }
}
