//! The names and addresses one peering takes on a gateway: its namespace,
//! links and veth block, and the rule that sends what the gateway hands the
//! namespace into the tunnel. Both families' renderers (`peering`, `ipv6`)
//! use them; neither imports the other's internals for it.

use super::*;

/// The names and addresses one peering uses on a gateway.
pub(super) struct PeeringIds {
    pub(super) ns: String,
    /// The WireGuard link, inside `ns`.
    pub(super) link: String,
    /// The veth pair's ends: in the gateway's namespace and in `ns`.
    pub(super) outer: String,
    pub(super) inner: String,
    pub(super) outer_ip: Ipv4Addr,
    pub(super) inner_ip: Ipv4Addr,
}

pub(super) fn peering_ids(site_id: &str, ns: String, listen_port: u16) -> PeeringIds {
    // The path between the gateway and the peering's namespace: a veth with
    // a /30 from 169.254.0.0/16 chosen by the peering's WireGuard port, so
    // it is unique per peering on the gateway (the controller gives no two
    // peerings ports with the same block; see `veth_block_free`).
    let base_ip = u32::from(Ipv4Addr::new(169, 254, 0, 0)) + 4 * veth_block(listen_port);
    PeeringIds {
        ns,
        link: format!("weft-w{}", peer_link_tag(site_id)),
        outer: format!("weft-v{}", peer_link_tag(site_id)),
        inner: format!("weft-i{}", peer_link_tag(site_id)),
        outer_ip: Ipv4Addr::from(base_ip + 1),
        inner_ip: Ipv4Addr::from(base_ip + 2),
    }
}

/// The /30 of 169.254.0.0/16 that the veth of the peering listening on
/// `listen_port` takes, by index: one of the 16383 blocks before the last
/// /30 (the tunnel's own pair).
fn veth_block(listen_port: u16) -> u32 {
    u32::from(listen_port) % 16383
}

/// The block of 169.254.169.252/30, which holds the clouds' metadata
/// address 169.254.169.254: no veth takes it.
const METADATA_BLOCK: u32 = (169 * 256 + 252) / 4;

/// Whether a peering may listen on `port` given the ports the site's
/// other peerings listen on: its veth's /30 must be its own on the
/// gateway, and not the metadata service's.
pub fn veth_block_free(port: u16, used: impl IntoIterator<Item = u16>) -> bool {
    let b = veth_block(port);
    b != METADATA_BLOCK && used.into_iter().all(|u| veth_block(u) != b)
}

/// In the peering's namespace, for one family: what arrives from the
/// gateway (the veth's inner end) looks up the routes into the tunnel.
pub(super) fn tunnel_rule(ids: &PeeringIds, ipv6: bool) -> Kind {
    Kind::Rule(pb::Rule {
        namespace: ids.ns.clone(),
        priority: RULE_PRIORITY,
        from: String::new(),
        to: String::new(),
        table: NS_TUNNEL_TABLE,
        iif: ids.inner.clone(),
        ipv6,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_veth_takes_the_metadata_block_or_another_peerings_block() {
        // 60028 % 16383 is the block of 169.254.169.252/30.
        assert!(!veth_block_free(60028, []));
        let ids = peering_ids("b", "weft-p-x".into(), 60027);
        assert_eq!(ids.outer_ip, Ipv4Addr::new(169, 254, 169, 249));
        assert!(veth_block_free(51820, [51821, 51822]));
        // Ports 16383 apart share a block.
        assert!(!veth_block_free(51820 - 16383, [51820]));
    }
}
