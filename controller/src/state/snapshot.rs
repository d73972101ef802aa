//! The writer's snapshot: everything under the site's root read at one
//! revision, kept current by the writes that go through it, and the
//! queries a write computes on (ports, addresses and blocks in use).

use super::*;

/// Everything under the site's root, read at one revision.
#[derive(Debug, Default)]
pub(super) struct Snapshot {
    pub(super) revision: Revision,
    pub(super) site: Option<Site>,
    pub(super) nodes: Vec<(Node, Revision)>,
    pub(super) gateways: Vec<(Gateway, Revision)>,
    pub(super) peerings: Vec<(Peering, Revision)>,
    pub(super) tokens: Vec<(Token, Revision)>,
    pub(super) peer_tokens: Vec<(crate::domain::PeerToken, Revision)>,
    pub(super) names: Vec<(crate::names::NameRecord, Revision)>,
    /// mod_revision of `ipam/seq` (0 when never written) and its value.
    pub(super) seq: (Revision, u64),
    /// The nodes holding each gateway link name (see
    /// [`Snapshot::nodes_with_link`]): built at the first look, then kept
    /// with the nodes as commits are folded in, so an enrollment does not
    /// hash every node's name again.
    pub(super) node_links: std::cell::OnceCell<std::collections::HashMap<String, Vec<String>>>,
}

impl Snapshot {
    /// The peering with `peer_site` and its record's revision, or
    /// NOT_FOUND saying how to list them.
    pub(super) fn peering(&self, peer_site: &str) -> Result<&(Peering, Revision), Error> {
        self.peerings
            .iter()
            .find(|(p, _)| p.site_id == peer_site)
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "there is no peering with site {peer_site:?}; list them with `weftctl peerings`"
                ))
            })
    }

    /// Brings the snapshot up to date with a committed transaction's ops.
    /// `None` when an op cannot be folded in (the caller then re-reads).
    pub(super) fn apply_ops(mut self, root: &str, ops: &[Op], revision: Revision) -> Option<Snapshot> {
        /// Puts (or, without a value, removes) the record `same` picks.
        fn fold<T: DeserializeOwned>(
            v: &mut Vec<(T, Revision)>,
            value: Option<&Vec<u8>>,
            rev: Revision,
            same: impl Fn(&T) -> bool,
        ) -> Option<()> {
            let Some(value) = value else {
                v.retain(|(x, _)| !same(x));
                return Some(());
            };
            let item = serde_json::from_slice(value).ok()?;
            match v.iter_mut().find(|(x, _)| same(x)) {
                Some(slot) => *slot = (item, rev),
                None => v.push((item, rev)),
            }
            Some(())
        }
        for op in ops {
            let (key, value) = match op {
                Op::Put { key, value, .. } => (key, Some(value)),
                Op::Delete { key } => (key, None),
                Op::DeletePrefix { .. } => return None,
            };
            let Some(key) = Key::parse(key.strip_prefix(root)?) else {
                continue;
            };
            // A record that does not read: the caller re-reads the store.
            match (key, value) {
                (Key::Site, Some(v)) => self.site = Some(serde_json::from_slice(v).ok()?),
                (Key::IpamSeq, Some(v)) => self.seq = (revision, serde_json::from_slice(v).ok()?),
                (Key::Node(n), v) => {
                    fold(&mut self.nodes, v, revision, |x: &Node| x.name == n)?;
                    if let Some(links) = self.node_links.get_mut() {
                        let link = crate::render::gateway_link_name(n);
                        let holders = links.entry(link.clone()).or_default();
                        holders.retain(|h| h != n);
                        if v.is_some() {
                            holders.push(n.to_string());
                        } else if holders.is_empty() {
                            // Not kept for names gone: under churn the map
                            // grew by one entry per node that ever left.
                            links.remove(&link);
                        }
                    }
                }
                (Key::Gateway(n), v) => fold(&mut self.gateways, v, revision, |x: &Gateway| x.name == n)?,
                (Key::Peering(n), v) => fold(&mut self.peerings, v, revision, |x: &Peering| x.site_id == n)?,
                (Key::PeerToken(n), v) => fold(&mut self.peer_tokens, v, revision, |x: &crate::domain::PeerToken| {
                    x.id == n
                })?,
                (Key::Name(n), v) => fold(&mut self.names, v, revision, |x: &crate::names::NameRecord| x.name == n)?,
                (Key::Token(n), v) => fold(&mut self.tokens, v, revision, |x: &Token| x.id == n)?,
                _ => {}
            }
        }
        self.revision = revision;
        Some(self)
    }

    /// The nodes whose gateway link name is `link`.
    pub(super) fn nodes_with_link(&self, link: &str) -> &[String] {
        let links = self.node_links.get_or_init(|| {
            let mut links: std::collections::HashMap<String, Vec<String>> = Default::default();
            for (n, _) in &self.nodes {
                links
                    .entry(crate::render::gateway_link_name(&n.name))
                    .or_default()
                    .push(n.name.clone());
            }
            links
        });
        links.get(link).map_or(&[], Vec::as_slice)
    }

    pub(super) fn site(&self) -> Result<&Site, Error> {
        self.site.as_ref().ok_or_else(|| {
            Error::FailedPrecondition(
                "the site is not initialised in the store yet; start the controller with its configuration".into(),
            )
        })
    }

    /// The WireGuard port for the peering with `peer`: the one it has, else
    /// `wanted` when it is in the site's range and free, else the lowest
    /// free one; an error when every port of the range is taken.
    pub(super) fn wg_port(&self, peer: &str, wanted: Option<u16>) -> Result<u16, Error> {
        if let Some((p, _)) = self.peerings.iter().find(|(p, _)| p.site_id == peer) {
            return Ok(p.listen_port);
        }
        let range = self.site()?.wireguard_ports;
        let used: Vec<u16> = self.peerings.iter().map(|(p, _)| p.listen_port).collect();
        // Ports whose veth block another peering's port has (a range wider
        // than 16383) or that is the metadata service's are skipped.
        let free = |p: &u16| crate::render::veth_block_free(*p, used.iter().copied());
        wanted
            .filter(|w| range.contains(*w) && free(w))
            .or_else(|| range.iter().find(free))
            .ok_or_else(|| {
                Error::ResourceExhausted(format!(
                    "all {} WireGuard ports of this site ({range}) are taken by peerings; widen \
                     --wireguard-ports on this site's controller (and open the new ports on its gateways), \
                     or delete a peering",
                    range.count()
                ))
            })
    }

    /// This site's own hosts: each node's and gateway's underlay address
    /// and the controllers' addresses, with who has it.
    pub(super) fn host_addresses(&self, site: &Site) -> Vec<(std::net::Ipv4Addr, String)> {
        let hosts = self.underlay_addresses().into_iter().filter_map(|(ip, who)| match ip {
            std::net::IpAddr::V4(a) => Some((a, who)),
            std::net::IpAddr::V6(_) => None,
        });
        let controllers = site.controller_ips.iter().map(|a| (*a, "a controller".to_string()));
        hosts.chain(controllers).collect()
    }

    /// Every address of this site's hosts in both families (nodes',
    /// gateways' and controllers'), each with who holds it: no peer may
    /// point this site's gateways there.
    pub(super) fn endpoint_hosts(&self, site: &Site) -> Vec<(std::net::IpAddr, String)> {
        let mut out = self.underlay_addresses();
        // A gateway's other addresses of its own, as its discovery found
        // them: its local ones, and where it was seen without NAT (an
        // IPv6 address beside an IPv4 underlay). Not a NAT's address: two
        // sites may share one (carrier-grade NAT).
        for (g, _) in &self.gateways {
            let who = format!("gateway {:?}", g.name);
            let own = g.discovered.values().flat_map(|d| {
                d.candidates
                    .iter()
                    .filter(|c| {
                        c.kind == weft_core::nat::CandidateKind::Local || d.nat == Some(weft_core::nat::Behaviour::None)
                    })
                    .map(|c| c.address.ip())
            });
            for ip in own {
                if !out.iter().any(|(a, _)| *a == ip) {
                    out.push((ip, who.clone()));
                }
            }
        }
        let v4 = site.controller_ips.iter().map(|a| std::net::IpAddr::V4(*a));
        let v6 = site
            .ipv6
            .iter()
            .flat_map(|n| &n.controller_ips)
            .map(|a| std::net::IpAddr::V6(*a));
        out.extend(v4.chain(v6).map(|a| (a, "a controller".to_string())));
        out
    }

    /// The underlay addresses of nodes and gateways, each with who holds it.
    pub(super) fn underlay_addresses(&self) -> Vec<(std::net::IpAddr, String)> {
        let nodes = self
            .nodes
            .iter()
            .filter_map(|(n, _)| Some((n.underlay_ip?, format!("node {:?}", n.name))));
        let gateways = self
            .gateways
            .iter()
            .filter_map(|(g, _)| Some((g.underlay_ip?, format!("gateway {:?}", g.name))));
        nodes.chain(gateways).collect()
    }

    /// Overlay addresses held by nodes and gateways, and those whose
    /// "unknown source" address an export took.
    pub(super) fn internal_ips(&self) -> Vec<std::net::Ipv4Addr> {
        let n = self.nodes.iter().filter_map(|(n, _)| n.internal_ip);
        let twins = self.site.as_ref().map_or_else(Vec::new, |site| {
            self.names
                .iter()
                .filter_map(|(r, _)| crate::names::internal_twin(site, r.external?))
                .collect()
        });
        n.chain(self.gateways.iter().filter_map(|(g, _)| g.internal_ip))
            .chain(twins)
            .collect()
    }

    pub(super) fn node_subnets(&self) -> Vec<(String, Ipv4Net)> {
        self.nodes
            .iter()
            .filter_map(|(n, _)| Some((n.name.clone(), n.subnet?)))
            .collect()
    }

    /// The nodes' IPv6 subnets (of nodes that have one).
    pub(super) fn node_subnets_v6(&self) -> Vec<ipnet::Ipv6Net> {
        self.nodes.iter().filter_map(|(n, _)| n.subnet_v6).collect()
    }

    /// Blocks in use here apart from node subnets: a peer's view must avoid them.
    pub(super) fn blocks_in_use(&self, site: &Site, except_peer: Option<&str>) -> Vec<Ipv4Net> {
        self.blocks_in_use_but(site, |_, target| Some(target) != except_peer)
    }

    /// [`Self::blocks_in_use`], with only the views (direct and transit)
    /// whose (peering, site it leads to) `keep` accepts.
    pub(crate) fn blocks_in_use_but(&self, site: &Site, keep: impl Fn(&str, &str) -> bool) -> Vec<Ipv4Net> {
        let mut v = site.own_blocks();
        // The hosts' own underlay addresses: a local view covering one would
        // pull the site's VXLAN and controller traffic into a peering (the
        // peer's CIDR is then remapped away from them).
        v.extend(self.host_addresses(site).into_iter().map(|(a, _)| Ipv4Net::from(a)));
        // Exported hosts: the gateways route them on the site's LAN.
        v.extend(
            self.names
                .iter()
                .filter(|(r, _)| r.external.is_some())
                .filter_map(|(r, _)| r.address.map(Ipv4Net::from)),
        );
        v.extend(self.view_blocks(keep));
        v
    }

    /// The local blocks of every peering's views and transit views whose
    /// (peering, site it leads to) `keep` accepts.
    pub(super) fn view_blocks(&self, keep: impl Fn(&str, &str) -> bool) -> Vec<Ipv4Net> {
        let mut v = Vec::new();
        for (p, _) in &self.peerings {
            if keep(&p.site_id, &p.site_id) {
                v.extend(p.views.iter().map(|v| v.local));
            }
            v.extend(
                p.transit_views
                    .iter()
                    .filter(|t| keep(&p.site_id, &t.site))
                    .map(|t| t.view.local),
            );
        }
        v
    }

    /// Every view this site has of `target`, directly or through transit:
    /// a new view of it keeps their blocks when it can.
    pub(crate) fn views_of(&self, target: &str) -> Vec<View> {
        let mut v = Vec::new();
        for (p, _) in &self.peerings {
            if p.site_id == target {
                v.extend(p.views.iter().cloned());
            }
            v.extend(
                p.transit_views
                    .iter()
                    .filter(|t| t.site == target)
                    .map(|t| t.view.clone()),
            );
        }
        v
    }
}
