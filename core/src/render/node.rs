//! A node's desired state: its own part (its overlay link to the active
//! gateway, its address, rules and host SNAT) and the part every node
//! shares (routes and rules to the peers' views, the names they published).

use super::*;

/// Everything node `name` must have: its own part and the part every
/// node shares.
pub fn node(m: &Model, name: &str) -> Objects {
    match node_own(m, name) {
        Some(mut own) => {
            own.extend(node_shared(m));
            own
        }
        None => Objects::new(),
    }
}

/// What only node `name` gets (ids `self/…`): its overlay link to the
/// active gateway, its address, its rules. None when the node gets
/// nothing yet (not the shared part either): the site, the node's
/// addresses or a usable gateway are missing, or the node's record is in
/// conflict.
pub fn node_own(m: &Model, name: &str) -> Option<Objects> {
    let mut out = Objects::new();
    let (Some(site), Some(n), Some(g)) = (&m.site, m.nodes.get(name), active_gateway(m)) else {
        return None;
    };
    if !m.renders_node(name) {
        return None;
    }
    let (Some(ip), Some(underlay)) = (n.internal_ip, n.underlay_ip) else {
        return None;
    };
    let gw_underlay = g.underlay_ip.unwrap();
    out.extend([
        obj(
            "self/link".into(),
            overlay(
                m,
                NODE_LINK.into(),
                vni(ip),
                underlay,
                gw_underlay,
                n.geneve && g.geneve,
            ),
        ),
        obj(
            "self/addr".into(),
            Kind::Address(pb::Address {
                link: NODE_LINK.into(),
                namespace: String::new(),
                cidr: format!("{ip}/{}", site.internal_cidr.prefix_len()),
                no_prefix_route: true,
            }),
        ),
        // The overlay's network, in weft's table rather than the host's
        // main one (the address above comes without its prefix route).
        obj(
            "self/route/internal".into(),
            Kind::Route(pb::Route {
                namespace: String::new(),
                table: TABLE,
                destination: site.internal_cidr.to_string(),
                gateway: String::new(),
                device: NODE_LINK.into(),
                peer_site: String::new(),
            }),
        ),
        obj("self/rule/internal".into(), host_rule(site.internal_cidr)),
    ]);
    if let Some(ext) = external_address(site, ip) {
        out.extend([obj(
            "self/host-snat".into(),
            Kind::HostSnat(pb::HostSnat {
                link: NODE_LINK.into(),
                address: ext.to_string(),
                except: site.pod_cidrs.iter().map(|c| c.to_string()).collect(),
            }),
        )]);
    }
    out.extend(ipv6::node_own(site, ip));
    Some(out)
}

/// On a node: `local` (a view of site `peer_site`) routed to the active
/// gateway `gw_ip`, and the rule that sends traffic for it to weft's table
/// (ids `{base}/route`, `{base}/rule`).
fn to_gateway(base: &str, peer_site: &str, local: ipnet::Ipv4Net, gw_ip: Ipv4Addr) -> [(String, pb::DesiredObject); 2] {
    [
        obj(
            format!("{base}/route"),
            Kind::Route(pb::Route {
                namespace: String::new(),
                table: TABLE,
                destination: local.to_string(),
                gateway: gw_ip.to_string(),
                device: NODE_LINK.into(),
                peer_site: peer_site.to_string(),
            }),
        ),
        obj(format!("{base}/rule"), host_rule(local)),
    ]
}

/// What every node of the site gets alike (ids `peer/…`): routes and
/// rules to the peers' views through the active gateway, and the names
/// peers published. A controller renders and encodes it once per model
/// for all its nodes' streams. Empty without a usable gateway.
pub fn node_shared(m: &Model) -> Objects {
    let mut out = Objects::new();
    let Some(gw_ip) = active_gateway(m).and_then(|g| g.internal_ip) else {
        return out;
    };
    // The whole of each view, also when the peer exports only part of it
    // to this site: replies to its own connections, from any of its
    // addresses, must come back (its gateway refuses the rest).
    for p in m.peerings.values().filter(|p| m.renders_peering(&p.site_id)) {
        for (v, id) in p.views.iter().zip(view_ids(&p.views)) {
            out.extend(to_gateway(
                &format!("peer/{}/{id}", p.site_id),
                &p.site_id,
                v.local,
                gw_ip,
            ));
        }
        // The sites reached through this peer (transit), alike.
        for (i, t) in crate::transit::rendered(&m.peerings, p) {
            let base = format!("peer/{}/transit/{}/{i}", p.site_id, t.site);
            out.extend(to_gateway(&base, &t.site, t.view.local, gw_ip));
        }
        out.extend(ipv6::node_shared(m, p, gw_ip));
    }
    // Names peers published, in this site's view: the node's DNS
    // responder answers them.
    for p in m.peerings.values().filter(|p| m.renders_peering(&p.site_id)) {
        for l in crate::names::learned(p) {
            out.extend([obj(
                format!("peer/{}/name/{}", p.site_id, l.name.name),
                Kind::DnsRecord(pb::DnsRecord {
                    site: p.site_id.clone(),
                    name: l.name.name.clone(),
                    address: l.local.map(|a| a.to_string()).unwrap_or_default(),
                    address_v6: l.local_v6.map(|a| a.to_string()).unwrap_or_default(),
                }),
            )]);
        }
    }
    out
}
