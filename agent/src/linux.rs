//! The Linux applier: makes the host's network match the desired objects
//! with rtnetlink, in the namespace the agent runs in.
//!
//! Covered so far: VXLAN links, addresses, routes (any table) and policy
//! rules — the overlay between nodes and gateways and the routing into it.
//! Namespaces, WireGuard and NAT maps are reported back as per-object errors
//! ("not supported yet") until the rest of the data plane lands, so the
//! controller shows exactly what is not applied.
//!
//! Every operation is idempotent (replace semantics, or "already there" is
//! success), so the same state can be applied again on a periodic resync to
//! repair drift, and after a restart.

use std::net::{IpAddr, Ipv4Addr};

use futures::TryStreamExt;
use ipnet::Ipv4Net;
use rtnetlink::{Handle, LinkUnspec, LinkVxlan, RouteMessageBuilder};
use weft_proto::v1 as pb;
use weft_proto::v1::desired_object::Kind;

use crate::apply::{Applier, Objects, describe};

pub struct Linux {
    handle: Handle,
    wg: crate::wireguard::Devices,
    /// The gateway's WireGuard private key (base64); None on nodes.
    wg_private_key: Option<String>,
    /// Whether this process has written the host NAT table (a resync
    /// rewrites it otherwise, e.g. after a restart; and whenever it is gone).
    host_snat_applied: bool,
    /// A health probe per WireGuard link, by link name.
    probes: std::collections::HashMap<String, (crate::probe::Target, crate::probe::Prober)>,
    probe_config: crate::probe::ProbeConfig,
    /// Signalled when a tunnel goes up or down.
    tunnel_changed: std::sync::Arc<tokio::sync::Notify>,
    /// WireGuard links whose peers changed in the batch being applied.
    to_kick: std::collections::BTreeSet<String>,
    /// Host links (re)created in the batch being applied: their addresses
    /// and routes went with the old link, also those that did not change.
    recreated: std::collections::BTreeSet<String>,
    /// This host's underlay address, whose interface's MTU sizes the
    /// links rendered without one.
    underlay_ip: Option<IpAddr>,
    /// Link kinds the kernel can make, once found out.
    kinds: Option<Vec<String>>,
    /// Host objects created (found missing) by this process; a resync that
    /// raises it repaired drift.
    writes: u64,
    /// The peer CIDRs the accounting table counts (nodes only); None: the
    /// table must be (re)written.
    acct: Option<std::collections::BTreeMap<String, Vec<Ipv4Net>>>,
}

impl std::fmt::Debug for Linux {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Linux")
    }
}

type R<T> = Result<T, String>;

fn v4(s: &str, what: &str) -> R<Ipv4Addr> {
    match s.parse::<IpAddr>() {
        Ok(IpAddr::V4(a)) => Ok(a),
        _ => Err(format!("{what} {s:?} is not an IPv4 address")),
    }
}

fn net(s: &str, what: &str) -> R<Ipv4Net> {
    s.parse::<Ipv4Net>()
        .map_err(|_| format!("{what} {s:?} is not an IPv4 CIDR"))
}

fn is_exists(e: &rtnetlink::Error) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m) if m.raw_code() == -libc_eexist())
}
fn is_missing(e: &rtnetlink::Error) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m) if [-2, -3, -19].contains(&m.raw_code()))
}
const fn libc_eexist() -> i32 {
    17
}

async fn index_in(h: &Handle, name: &str) -> R<Option<u32>> {
    let mut links = h.link().get().match_name(name.to_string()).execute();
    match links.try_next().await {
        Ok(Some(l)) => Ok(Some(l.header.index)),
        Ok(None) => Ok(None),
        Err(e) if is_missing(&e) => Ok(None),
        Err(e) => Err(format!("cannot look up link {name}: {e}")),
    }
}

async fn route_in(h: &Handle, r: &pb::Route) -> R<rtnetlink::packet_route::route::RouteMessage> {
    let dst = net(&r.destination, "destination")?;
    let mut b = RouteMessageBuilder::<Ipv4Addr>::new().destination_prefix(dst.network(), dst.prefix_len());
    if r.table != 0 {
        b = b.table_id(r.table);
    }
    if !r.gateway.is_empty() {
        b = b.gateway(v4(&r.gateway, "gateway")?).onlink();
    }
    if !r.device.is_empty() {
        b = b.output_interface(need_index_in(h, &r.device).await?);
    }
    Ok(b.build())
}

pub(crate) async fn need_index_in(h: &Handle, name: &str) -> R<u32> {
    index_in(h, name)
        .await?
        .ok_or_else(|| format!("link {name} does not exist"))
}

/// Sets link `idx` up, with `mtu` when it is not 0.
async fn set_up_in(h: &Handle, idx: u32, mtu: u32) -> R<()> {
    let mut b = LinkUnspec::new_with_index(idx).up();
    if mtu > 0 {
        b = b.mtu(mtu);
    }
    h.link()
        .set(b.build())
        .execute()
        .await
        .map_err(|e| format!("cannot set the link up: {e}"))
}

/// Sets the link named `name` up, with `mtu` when it is not 0.
pub(crate) async fn set_up_named(h: &Handle, name: &str, mtu: u32) -> R<()> {
    let idx = need_index_in(h, name).await?;
    set_up_in(h, idx, mtu).await.map_err(|e| format!("{name}: {e}"))
}

/// Adds an address; true when it was missing.
async fn add_address(h: &Handle, a: &pb::Address) -> R<bool> {
    let idx = need_index_in(h, &a.link).await?;
    let n = net(&a.cidr, "address")?;
    match h
        .address()
        .add(idx, IpAddr::V4(n.addr()), n.prefix_len())
        .execute()
        .await
    {
        Ok(()) => Ok(true),
        Err(e) if is_exists(&e) => Ok(false),
        Err(e) => Err(format!("cannot add {}: {e}", a.cidr)),
    }
}

/// Adds (or corrects) a route; true when it was missing.
async fn add_route(h: &Handle, r: &pb::Route) -> R<bool> {
    let msg = route_in(h, r).await?;
    match h.route().add(msg.clone()).execute().await {
        Ok(()) => Ok(true),
        Err(e) if is_exists(&e) => h
            .route()
            .add(msg)
            .replace()
            .execute()
            .await
            .map(|()| false)
            .map_err(|e| format!("cannot add the route: {e}")),
        Err(e) => Err(format!("cannot add the route: {e}")),
    }
}

/// Adds a rule; true when it was missing.
async fn add_rule(h: &Handle, r: &pb::Rule) -> R<bool> {
    let mut req = h
        .rule()
        .add()
        .action(rtnetlink::packet_route::rule::RuleAction::ToTable)
        .v4()
        .table_id(r.table)
        .priority(r.priority);
    if !r.to.is_empty() {
        let n = net(&r.to, "to")?;
        req = req.destination_prefix(n.network(), n.prefix_len());
    }
    if !r.from.is_empty() {
        let n = net(&r.from, "from")?;
        req = req.source_prefix(n.network(), n.prefix_len());
    }
    if !r.iif.is_empty() {
        req = req.input_interface(r.iif.clone());
    }
    match req.execute().await {
        Ok(()) => Ok(true),
        Err(e) if is_exists(&e) => Ok(false),
        Err(e) => Err(format!("cannot add the rule: {e}")),
    }
}

/// Replaces namespace `ns`'s nftables table `weft` with 1:1 prefix NAT for
/// `maps`, in one atomic batch: toward the tunnel the local view becomes
/// the real CIDR (destination), from the tunnel the real CIDR becomes the
/// local view (source); conntrack undoes both for replies. The same table
/// clamps the MSS of forwarded TCP SYNs to the route's MTU, so TCP across
/// the tunnel never depends on PMTU discovery (ICMP that NAT or a firewall
/// on the way may eat).
fn nat_table(ns: &str, maps: &[pb::NatMap]) -> R<()> {
    use serde_json::json;
    let prefix = |c: &str| -> R<serde_json::Value> {
        let n = net(c, "NAT CIDR")?;
        Ok(json!({"prefix": {"addr": n.network().to_string(), "len": n.prefix_len()}}))
    };
    let mut cmds = vec![
        json!({"add": {"table": {"family": "ip", "name": "weft"}}}),
        json!({"delete": {"table": {"family": "ip", "name": "weft"}}}),
    ];
    if !maps.is_empty() {
        cmds.push(json!({"add": {"table": {"family": "ip", "name": "weft"}}}));
        cmds.push(json!({"add": {"chain": {"family": "ip", "table": "weft", "name": "pre", "type": "nat", "hook": "prerouting", "prio": -100, "policy": "accept"}}}));
        cmds.push(json!({"add": {"chain": {"family": "ip", "table": "weft", "name": "post", "type": "nat", "hook": "postrouting", "prio": 100, "policy": "accept"}}}));
        // tcp flags syn / syn,rst tcp option maxseg size set rt mtu
        cmds.push(json!({"add": {"chain": {"family": "ip", "table": "weft", "name": "mss", "type": "filter", "hook": "forward", "prio": -150, "policy": "accept"}}}));
        let syn = json!({"match": {"op": "==", "left": {"&": [{"payload": {"protocol": "tcp", "field": "flags"}}, ["syn", "rst"]]}, "right": "syn"}});
        let clamp = json!({"mangle": {"key": {"tcp option": {"name": "maxseg", "field": "size"}}, "value": {"rt": {"key": "mtu"}}}});
        cmds.push(json!({"add": {"rule": {"family": "ip", "table": "weft", "chain": "mss", "expr": [syn, clamp]}}}));
        for m in maps {
            let (local, real) = (prefix(&m.local_cidr)?, prefix(&m.real_cidr)?);
            let tunnel =
                |op: &str| json!({"match": {"op": op, "left": {"meta": {"key": "iifname"}}, "right": m.tunnel}});
            let addr = |field: &str, right: &serde_json::Value| json!({"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": field}}, "right": right}});
            // Toward the tunnel: the local view becomes the real CIDR.
            let dnat = json!({"dnat": {"addr": real.clone(), "flags": "netmap", "type_flags": "prefix"}});
            let pre = json!([tunnel("!="), addr("daddr", &local), dnat]);
            cmds.push(json!({"add": {"rule": {"family": "ip", "table": "weft", "chain": "pre", "expr": pre}}}));
            // From the tunnel: the real CIDR becomes the local view.
            let snat = json!({"snat": {"addr": local, "flags": "netmap", "type_flags": "prefix"}});
            let post = json!([tunnel("=="), addr("saddr", &real), snat]);
            cmds.push(json!({"add": {"rule": {"family": "ip", "table": "weft", "chain": "post", "expr": post}}}));
        }
    }
    let payload = json!({"nftables": cmds}).to_string();
    nftables::helper::apply_ruleset_raw(&payload, Some("ip"), ["netns", "exec", ns, "nft"])
        .map(|_| ())
        .map_err(|e| format!("cannot apply the NAT table in {ns}: {e}"))
}

/// The host's own nftables table `weft`: source NAT of host-originated
/// traffic into the overlay (or no table at all), as one atomic batch.
fn host_snat_table(h: Option<&pb::HostSnat>) -> R<()> {
    use serde_json::json;
    let mut cmds = vec![
        json!({"add": {"table": {"family": "ip", "name": "weft"}}}),
        json!({"delete": {"table": {"family": "ip", "name": "weft"}}}),
    ];
    if let Some(h) = h {
        let addr = v4(&h.address, "address")?;
        let except: Vec<serde_json::Value> = h
            .except
            .iter()
            .map(|c| {
                net(c, "except").map(|n| json!({"prefix": {"addr": n.network().to_string(), "len": n.prefix_len()}}))
            })
            .collect::<R<_>>()?;
        cmds.push(json!({"add": {"table": {"family": "ip", "name": "weft"}}}));
        cmds.push(json!({"add": {"chain": {"family": "ip", "table": "weft", "name": "post", "type": "nat", "hook": "postrouting", "prio": 100, "policy": "accept"}}}));
        let oif = json!({"match": {"op": "==", "left": {"meta": {"key": "oifname"}}, "right": h.link}});
        let not_pod = json!({"match": {"op": "!=", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": {"set": except}}});
        let snat = json!({"snat": {"addr": addr.to_string()}});
        cmds.push(
            json!({"add": {"rule": {"family": "ip", "table": "weft", "chain": "post", "expr": [oif, not_pod, snat]}}}),
        );
    }
    let payload = json!({"nftables": cmds}).to_string();
    nftables::helper::apply_ruleset_raw(&payload, nftables::helper::DEFAULT_NFT, nftables::helper::DEFAULT_ARGS)
        .map(|_| ())
        .map_err(|e| format!("cannot apply the host NAT table: {e}"))
}

/// Adds an address or a route inside namespace `ns` (a worker thread that
/// joined it, with its own netlink connection).
fn in_ns(ns: &str, o: &pb::DesiredObject) -> R<bool> {
    let o = o.clone();
    crate::wireguard::in_namespace(ns, move |h| {
        Box::pin(async move {
            match &o.kind {
                Some(Kind::Address(a)) => add_address(&h, a).await,
                Some(Kind::Route(r)) => add_route(&h, r).await,
                Some(Kind::Rule(r)) => add_rule(&h, r).await,
                _ => Err(format!("{} is not supported inside a namespace yet", describe(&o))),
            }
        })
    })
}

/// Turns on IPv4 forwarding in namespace `ns` ("" for the agent's own).
fn enable_forwarding(ns: &str) -> R<()> {
    if ns.is_empty() {
        return std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
            .map_err(|e| format!("cannot enable forwarding: {e}"));
    }
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || -> R<()> {
        let f = std::fs::File::open(&path).map_err(|e| format!("cannot open {path}: {e}"))?;
        nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| format!("cannot enter {path}: {e}"))?;
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").map_err(|e| format!("cannot enable forwarding: {e}"))
    })
    .join()
    .map_err(|_| "the namespace worker panicked".to_string())?
}

/// Which of the link kinds weft uses this kernel can make ("geneve",
/// "vxlan", "wireguard"): each tried in a network namespace of a throwaway
/// thread's own (nothing on the host is touched; the namespace goes with
/// the thread).
pub fn kernel_link_kinds() -> Vec<String> {
    std::thread::spawn(|| -> R<Vec<String>> {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| format!("unshare: {e}"))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        rt.block_on(async {
            let (conn, h, _) = rtnetlink::new_connection().map_err(|e| e.to_string())?;
            tokio::spawn(conn);
            let far = Ipv4Addr::new(192, 0, 2, 1);
            let mut kinds = Vec::new();
            let tries = [
                (
                    "geneve",
                    rtnetlink::LinkGeneve::new("weftprobe0", 1).remote(far).build(),
                ),
                ("vxlan", LinkVxlan::new("weftprobe1", 1).remote(far).build()),
                ("wireguard", rtnetlink::LinkWireguard::new("weftprobe2").build()),
            ];
            for (kind, msg) in tries {
                if h.link().add(msg).execute().await.is_ok() {
                    kinds.push(kind.to_string());
                }
            }
            Ok(kinds)
        })
    })
    .join()
    .ok()
    .and_then(|r| r.ok())
    .unwrap_or_default()
}

/// Whether this kernel can make Geneve links.
pub fn kernel_has_geneve() -> bool {
    kernel_link_kinds().iter().any(|k| k == "geneve")
}

/// The CIDRs of peers as this site sees them, by peer site: the
/// destinations of the host's routes rendered for peers (ids
/// `peer/<site>/...`).
fn peer_views(objects: &Objects) -> std::collections::BTreeMap<String, Vec<Ipv4Net>> {
    let mut out: std::collections::BTreeMap<String, Vec<Ipv4Net>> = Default::default();
    for o in objects.values() {
        let (Some(Kind::Route(r)), Some(rest)) = (&o.kind, o.id.strip_prefix("peer/")) else {
            continue;
        };
        if !r.namespace.is_empty() {
            continue; // inside a peering's namespace: real CIDRs, not views
        }
        let (Some(site), Ok(dst)) = (rest.split('/').next(), r.destination.parse::<Ipv4Net>()) else {
            continue;
        };
        let v = out.entry(site.to_string()).or_default();
        if !v.contains(&dst) {
            v.push(dst);
        }
    }
    out
}

/// The node's nftables table `weft_acct`: a named counter per peer and
/// direction over traffic to and from the peer's CIDRs (forwarded, sent and
/// received by the host), or no table when there are no peers.
fn acct_table(views: &std::collections::BTreeMap<String, Vec<Ipv4Net>>) -> R<()> {
    use serde_json::json;
    let t = |x: serde_json::Value| json!({"add": x});
    let mut cmds = vec![
        t(json!({"table": {"family": "ip", "name": "weft_acct"}})),
        json!({"delete": {"table": {"family": "ip", "name": "weft_acct"}}}),
    ];
    if !views.is_empty() {
        cmds.push(t(json!({"table": {"family": "ip", "name": "weft_acct"}})));
        for (hook, name) in [("forward", "fwd"), ("output", "out"), ("input", "in")] {
            cmds.push(t(json!({"chain": {"family": "ip", "table": "weft_acct", "name": name, "type": "filter", "hook": hook, "prio": -200, "policy": "accept"}})));
        }
        for (site, nets) in views {
            for dir in ["tx", "rx"] {
                cmds.push(t(
                    json!({"counter": {"family": "ip", "table": "weft_acct", "name": format!("{dir}-{site}")}}),
                ));
            }
            for n in nets {
                let p = json!({"prefix": {"addr": n.network().to_string(), "len": n.prefix_len()}});
                for (field, dir, chains) in [("daddr", "tx", ["fwd", "out"]), ("saddr", "rx", ["fwd", "in"])] {
                    for chain in chains {
                        let m = json!({"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": field}}, "right": p}});
                        let c = json!({"counter": format!("{dir}-{site}")});
                        cmds.push(t(
                            json!({"rule": {"family": "ip", "table": "weft_acct", "chain": chain, "expr": [m, c]}}),
                        ));
                    }
                }
            }
        }
    }
    let payload = json!({"nftables": cmds}).to_string();
    nftables::helper::apply_ruleset_raw(&payload, nftables::helper::DEFAULT_NFT, nftables::helper::DEFAULT_ARGS)
        .map(|_| ())
        .map_err(|e| format!("cannot apply the accounting table: {e}"))
}

/// The counters of `weft_acct`, by peer; None when the table is missing.
pub fn acct_counters() -> Option<Vec<crate::metrics::PeerTraffic>> {
    let out = std::process::Command::new("nft")
        .args(["-j", "list", "counters", "table", "ip", "weft_acct"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    let mut by_site: std::collections::BTreeMap<String, crate::metrics::PeerTraffic> = Default::default();
    for item in v["nftables"].as_array()? {
        let c = &item["counter"];
        let (Some(name), Some(bytes), Some(packets)) = (c["name"].as_str(), c["bytes"].as_u64(), c["packets"].as_u64())
        else {
            continue;
        };
        let Some((dir, site)) = name.split_once('-') else {
            continue;
        };
        let e = by_site
            .entry(site.to_string())
            .or_insert_with(|| crate::metrics::PeerTraffic {
                peer_site: site.to_string(),
                ..Default::default()
            });
        match dir {
            "tx" => (e.tx_bytes, e.tx_packets) = (bytes, packets),
            _ => (e.rx_bytes, e.rx_packets) = (bytes, packets),
        }
    }
    Some(by_site.into_values().collect())
}

impl Linux {
    /// Opens a netlink connection in the current namespace. Must run inside
    /// a tokio runtime.
    pub fn new(wg_private_key: Option<String>) -> std::io::Result<Linux> {
        let (conn, handle, _) = rtnetlink::new_connection()?;
        tokio::spawn(conn);
        Ok(Linux {
            handle,
            wg: Default::default(),
            wg_private_key,
            host_snat_applied: false,
            probes: Default::default(),
            probe_config: Default::default(),
            tunnel_changed: Default::default(),
            to_kick: Default::default(),
            recreated: Default::default(),
            underlay_ip: None,
            kinds: None,
            writes: 0,
            acct: None,
        })
    }

    /// Sets the underlay address that links without a rendered MTU are
    /// sized from.
    pub fn with_underlay(mut self, ip: Option<IpAddr>) -> Linux {
        self.underlay_ip = ip;
        self
    }

    /// The MTU of the interface holding `ip`, if one does.
    async fn mtu_of_address(&self, ip: IpAddr) -> Option<u32> {
        use rtnetlink::packet_route::address::AddressAttribute;
        let mut addrs = self.handle.address().get().execute();
        while let Ok(Some(a)) = addrs.try_next().await {
            if a.attributes
                .iter()
                .any(|x| matches!(x, AddressAttribute::Address(y) if *y == ip))
            {
                return self.mtu_of_index(a.header.index).await;
            }
        }
        None
    }

    async fn mtu_of_index(&self, idx: u32) -> Option<u32> {
        use rtnetlink::packet_route::link::LinkAttribute;
        let mut links = self.handle.link().get().match_index(idx).execute();
        let l = links.try_next().await.ok()??;
        l.attributes.iter().find_map(|x| match x {
            LinkAttribute::Mtu(m) => Some(*m),
            _ => None,
        })
    }

    /// The MTU of the interface of the IPv4 default route, if there is one.
    async fn mtu_of_default_route(&self) -> Option<u32> {
        use rtnetlink::packet_route::route::RouteAttribute;
        let mut routes = self
            .handle
            .route()
            .get(RouteMessageBuilder::<Ipv4Addr>::new().build())
            .execute();
        while let Ok(Some(r)) = routes.try_next().await {
            if r.header.destination_prefix_length != 0 {
                continue;
            }
            if let Some(idx) = r.attributes.iter().find_map(|x| match x {
                RouteAttribute::Oif(i) => Some(*i),
                _ => None,
            }) {
                return self.mtu_of_index(idx).await;
            }
        }
        None
    }

    /// The underlay's MTU: of the interface holding `hint` or this host's
    /// underlay address, else of the default route's interface, else 1500.
    async fn underlay_mtu(&self, hint: Option<IpAddr>) -> u32 {
        for ip in [hint, self.underlay_ip].into_iter().flatten() {
            if let Some(m) = self.mtu_of_address(ip).await {
                return m;
            }
        }
        self.mtu_of_default_route().await.unwrap_or(1500)
    }

    /// The MTU link `l` gets: as rendered, or (rendered 0) derived from the
    /// underlay: VXLAN carries 50 bytes of headers (outer IPv4, UDP, VXLAN,
    /// inner Ethernet); WireGuard up to 80 (outer IPv6, UDP, its own), and
    /// the peering's veth matches the WireGuard interface behind it.
    async fn link_mtu(&self, l: &pb::Link) -> u32 {
        if l.mtu > 0 {
            return l.mtu;
        }
        let (hint, overhead) = match &l.kind {
            Some(pb::link::Kind::Vxlan(v)) => (v.local.parse().ok(), 50),
            Some(pb::link::Kind::Geneve(_)) => (None, 50),
            _ => (None, 80),
        };
        self.underlay_mtu(hint).await.saturating_sub(overhead).max(576)
    }

    /// Sets the health probes' interval and miss threshold (for tunnels
    /// created from now on).
    pub fn with_probes(mut self, c: crate::probe::ProbeConfig) -> Linux {
        self.probe_config = c;
        self
    }

    /// Gives the WireGuard link its probe address and keeps a prober
    /// running toward the far end (a new one when the device was made anew,
    /// since the old socket's address went with it).
    fn ensure_probe(&mut self, l: &pb::Link, w: &pb::Wireguard, mtu: u32, fresh: bool) -> R<()> {
        if w.address.is_empty() || w.peer_address.is_empty() {
            self.probes.remove(&l.name);
            return Ok(());
        }
        let addr = pb::DesiredObject {
            id: format!("{}/probe-address", l.name),
            kind: Some(Kind::Address(pb::Address {
                link: l.name.clone(),
                namespace: l.namespace.clone(),
                cidr: w.address.clone(),
            })),
        };
        in_ns(&l.namespace, &addr)?;
        let local: Ipv4Net = net(&w.address, "probe address")?;
        let peer = v4(&w.peer_address, "probe peer address")?;
        let target = crate::probe::Target {
            ns: l.namespace.clone(),
            link: l.name.clone(),
            site: w.peer_site.clone(),
            local: local.addr(),
            peer,
            mtu,
        };
        let same = self
            .probes
            .get(&l.name)
            .is_some_and(|(t, p)| *t == target && p.config == self.probe_config);
        if same && !fresh {
            return Ok(());
        }
        self.probes.remove(&l.name);
        let notify = self.tunnel_changed.clone();
        let prober = crate::probe::start(target.clone(), self.probe_config, move || notify.notify_one())?;
        self.probes.insert(l.name.clone(), (target, prober));
        Ok(())
    }

    async fn upsert_wireguard(
        &mut self,
        old: Option<&pb::DesiredObject>,
        o: &pb::DesiredObject,
        l: &pb::Link,
        w: &pb::Wireguard,
    ) -> R<()> {
        if l.namespace.is_empty() {
            return Err("a WireGuard link needs its peering namespace".into());
        }
        let mtu = self.link_mtu(l).await;
        if old.is_some_and(|x| x == o) && self.wg.devices.contains_key(&l.name) {
            return self.ensure_probe(l, w, mtu, false);
        }
        let key = self
            .wg_private_key
            .clone()
            .ok_or("this agent has no WireGuard key (only gateways do)")?;
        self.wg
            .create(&self.handle, &l.name, &l.namespace, w.listen_port, mtu, &key)
            .await?;
        self.ensure_probe(l, w, mtu, true)
    }

    /// Counts a write that created something.
    fn count(&mut self, wrote: R<bool>) -> R<()> {
        self.writes += u64::from(wrote?);
        Ok(())
    }

    async fn index(&self, name: &str) -> R<Option<u32>> {
        index_in(&self.handle, name).await
    }

    async fn need_index(&self, name: &str) -> R<u32> {
        need_index_in(&self.handle, name).await
    }

    async fn upsert(&mut self, old: Option<&pb::DesiredObject>, o: &pb::DesiredObject) -> R<()> {
        match &o.kind {
            Some(Kind::Namespace(n)) => {
                if !n.name.starts_with("weft") {
                    return Err(format!(
                        "refusing to manage namespace {:?}: weft's names start with weft",
                        n.name
                    ));
                }
                if !std::path::Path::new(&format!("/run/netns/{}", n.name)).exists() {
                    rtnetlink::NetworkNamespace::add(n.name.clone())
                        .await
                        .map_err(|e| format!("cannot create namespace {}: {e}", n.name))?;
                }
                // A peering's namespace and the gateway itself route between
                // the overlay and the tunnel.
                enable_forwarding(&n.name)?;
                enable_forwarding("")
            }
            Some(Kind::Address(a)) if !a.namespace.is_empty() => self.count(in_ns(&a.namespace, o)),
            Some(Kind::Route(r)) if !r.namespace.is_empty() => self.count(in_ns(&r.namespace, o)),
            Some(Kind::Rule(r)) if !r.namespace.is_empty() => self.count(in_ns(&r.namespace, o)),
            Some(Kind::Link(l)) if matches!(l.kind, Some(pb::link::Kind::Veth(_))) => {
                let Some(pb::link::Kind::Veth(v)) = &l.kind else {
                    unreachable!()
                };
                if self.index(&l.name).await?.is_some() && old.is_some_and(|x| x == o) {
                    return Ok(());
                }
                if let Some(idx) = self.index(&l.name).await? {
                    let _ = self.handle.link().del(idx).execute().await;
                }
                let mtu = self.link_mtu(l).await;
                let b = rtnetlink::LinkVeth::new(&l.name, &v.peer_name).up().mtu(mtu);
                self.handle
                    .link()
                    .add(b.build())
                    .execute()
                    .await
                    .map_err(|e| format!("cannot create {}: {e}", l.name))?;
                let peer = self.need_index(&v.peer_name).await?;
                if v.peer_namespace.is_empty() {
                    return self.set_up(peer, mtu).await;
                }
                // Receive offloads for the traffic leaving the tunnel (see
                // offload.rs); tuning only, so a failure is logged.
                let ours = self.need_index(&l.name).await?;
                if let Err(e) =
                    crate::offload::no_tso(&v.peer_name).and_then(|()| crate::offload::gro_threaded(&l.name, ours))
                {
                    tracing::warn!(link = %l.name, "receive offloads not enabled, forwarding per packet: {e}");
                }
                let file = std::fs::File::open(format!("/run/netns/{}", v.peer_namespace))
                    .map_err(|e| format!("namespace {}: {e}", v.peer_namespace))?;
                self.handle
                    .link()
                    .set(
                        LinkUnspec::new_with_index(peer)
                            .setns_by_fd(std::os::fd::AsRawFd::as_raw_fd(&file))
                            .build(),
                    )
                    .execute()
                    .await
                    .map_err(|e| format!("cannot move {} into {}: {e}", v.peer_name, v.peer_namespace))?;
                let name = v.peer_name.clone();
                crate::wireguard::in_namespace(&v.peer_namespace, move |h| {
                    Box::pin(async move {
                        set_up_named(&h, &name, mtu).await?;
                        if let Err(e) = crate::offload::queue_on_veth(&h, &name).await {
                            tracing::warn!(link = %name, "no queue on the veth, bursts may drop: {e}");
                        }
                        Ok(())
                    })
                })
            }
            Some(Kind::Link(l)) => {
                if let Some(pb::link::Kind::Wireguard(w)) = &l.kind {
                    return self.upsert_wireguard(old, o, l, w).await;
                }
                if !l.namespace.is_empty() {
                    return Err("links in other namespaces are not supported yet".into());
                }
                if let Some(pb::link::Kind::Bridge(_)) = &l.kind {
                    // Workloads attach their own ports; its MTU is theirs.
                    return match self.index(&l.name).await? {
                        Some(idx) => self.set_up(idx, l.mtu).await,
                        None => self
                            .handle
                            .link()
                            .add(rtnetlink::LinkBridge::new(&l.name).up().build())
                            .execute()
                            .await
                            .map_err(|e| format!("cannot create {}: {e}", l.name)),
                    };
                }
                let mtu = self.link_mtu(l).await;
                let msg = match &l.kind {
                    Some(pb::link::Kind::Vxlan(v)) => LinkVxlan::new(&l.name, v.vni)
                        .local(v4(&v.local, "local")?)
                        .remote(v4(&v.remote, "remote")?)
                        .port(v.port as u16)
                        .mtu(mtu)
                        .up()
                        .build(),
                    Some(pb::link::Kind::Geneve(g)) => rtnetlink::LinkGeneve::new(&l.name, g.vni)
                        .remote(v4(&g.remote, "remote")?)
                        .port(g.port as u16)
                        .mtu(mtu)
                        .up()
                        .build(),
                    _ => return Err(format!("{} is not supported yet", describe(o))),
                };
                // A changed tunnel cannot be modified in place: replace it.
                if let Some(idx) = self.index(&l.name).await? {
                    if old.is_some_and(|x| x == o) {
                        return self.set_up(idx, mtu).await;
                    }
                    self.handle
                        .link()
                        .del(idx)
                        .execute()
                        .await
                        .map_err(|e| format!("cannot replace {}: {e}", l.name))?;
                }
                self.handle
                    .link()
                    .add(msg)
                    .execute()
                    .await
                    .map_err(|e| format!("cannot create {}: {e}", l.name))?;
                self.recreated.insert(l.name.clone());
                self.writes += 1;
                Ok(())
            }
            Some(Kind::Address(a)) => {
                let w = add_address(&self.handle, a).await;
                self.count(w)
            }
            Some(Kind::Route(r)) => {
                let w = add_route(&self.handle, r).await;
                self.count(w)
            }
            Some(Kind::Rule(r)) => {
                if let Some(old) = old
                    && old != o
                {
                    self.delete(old).await?;
                }
                let w = add_rule(&self.handle, r).await;
                self.count(w)
            }
            // Applied per namespace as a whole table, in `apply`.
            Some(Kind::NatMap(_)) => Ok(()),
            Some(Kind::HostSnat(h)) => {
                // Unchanged and still there: nothing to do. (Checked, not
                // assumed: someone may have deleted the table.)
                let present = || {
                    std::process::Command::new("nft")
                        .args(["list", "table", "ip", "weft"])
                        .stdout(std::process::Stdio::null())
                        .stderr(std::process::Stdio::null())
                        .status()
                        .is_ok_and(|s| s.success())
                };
                if old.is_some_and(|x| x == o) && self.host_snat_applied {
                    if present() {
                        return Ok(());
                    }
                    self.writes += 1;
                }
                host_snat_table(Some(h))?;
                self.host_snat_applied = true;
                Ok(())
            }
            Some(Kind::WireguardPeer(p)) => {
                if let Some(Kind::WireguardPeer(prev)) = old.and_then(|x| x.kind.as_ref())
                    && prev.public_key != p.public_key
                {
                    self.wg.remove_peer(&prev.link, &prev.public_key)?;
                }
                let changed = self.wg.set_peer(
                    &p.link,
                    &p.public_key,
                    &p.endpoint,
                    &p.allowed_ips,
                    p.persistent_keepalive,
                )?;
                if changed {
                    // Probed once the whole batch is in (see `apply`).
                    self.to_kick.insert(p.link.clone());
                }
                Ok(())
            }
            _ => Err(format!("{} is not supported by this agent yet", describe(o))),
        }
    }

    async fn set_up(&self, idx: u32, mtu: u32) -> R<()> {
        set_up_in(&self.handle, idx, mtu).await
    }

    async fn delete(&mut self, o: &pb::DesiredObject) -> R<()> {
        let ok_if_missing = |r: Result<(), rtnetlink::Error>| match r {
            Ok(()) => Ok(()),
            Err(e) if is_missing(&e) => Ok(()),
            Err(e) => Err(e.to_string()),
        };
        match &o.kind {
            Some(Kind::Namespace(n)) => {
                if !n.name.starts_with("weft") || !std::path::Path::new(&format!("/run/netns/{}", n.name)).exists() {
                    return Ok(());
                }
                rtnetlink::NetworkNamespace::del(n.name.clone())
                    .await
                    .map_err(|e| format!("cannot delete namespace {}: {e}", n.name))
            }
            Some(Kind::Link(l)) if matches!(l.kind, Some(pb::link::Kind::Wireguard(_))) => {
                // Dropping the device ends it and removes its interface.
                self.probes.remove(&l.name);
                self.wg.devices.remove(&l.name);
                Ok(())
            }
            Some(Kind::WireguardPeer(p)) => self.wg.remove_peer(&p.link, &p.public_key),
            Some(Kind::NatMap(_)) => Ok(()),
            Some(Kind::HostSnat(_)) => {
                self.host_snat_applied = false;
                host_snat_table(None)
            }
            Some(Kind::Rule(r)) if !r.namespace.is_empty() => Ok(()),
            // Inside a peering namespace: removed with it (or with their link).
            Some(Kind::Address(a)) if !a.namespace.is_empty() => Ok(()),
            Some(Kind::Route(r)) if !r.namespace.is_empty() => Ok(()),
            Some(Kind::Link(l)) => match self.index(&l.name).await? {
                Some(idx) => ok_if_missing(self.handle.link().del(idx).execute().await),
                None => Ok(()),
            },
            Some(Kind::Address(a)) => {
                let Some(idx) = self.index(&a.link).await? else {
                    return Ok(());
                };
                let n = net(&a.cidr, "address")?;
                let mut addrs = self.handle.address().get().set_link_index_filter(idx).execute();
                while let Some(m) = addrs.try_next().await.map_err(|e| e.to_string())? {
                    let has = m.attributes.iter().any(|a| {
                        matches!(a, rtnetlink::packet_route::address::AddressAttribute::Address(IpAddr::V4(x)) if *x == n.addr())
                    });
                    if has && m.header.prefix_len == n.prefix_len() {
                        return ok_if_missing(self.handle.address().del(m).execute().await);
                    }
                }
                Ok(())
            }
            Some(Kind::Route(r)) => match route_in(&self.handle, r).await {
                Ok(msg) => ok_if_missing(self.handle.route().del(msg).execute().await),
                // its device is gone, and the route with it
                Err(_) => Ok(()),
            },
            Some(Kind::Rule(r)) => {
                let mut rules = self.handle.rule().get(rtnetlink::IpVersion::V4).execute();
                while let Some(m) = rules.try_next().await.map_err(|e| e.to_string())? {
                    let prio = m.attributes.iter().find_map(|a| match a {
                        rtnetlink::packet_route::rule::RuleAttribute::Priority(p) => Some(*p),
                        _ => None,
                    });
                    let table = m.attributes.iter().find_map(|a| match a {
                        rtnetlink::packet_route::rule::RuleAttribute::Table(t) => Some(*t),
                        _ => None,
                    });
                    let dst = m.attributes.iter().find_map(|a| match a {
                        rtnetlink::packet_route::rule::RuleAttribute::Destination(IpAddr::V4(d)) => Some(*d),
                        _ => None,
                    });
                    let want_dst = (!r.to.is_empty()).then(|| net(&r.to, "to")).transpose()?;
                    if prio == Some(r.priority)
                        && table == Some(r.table)
                        && dst == want_dst.map(|n| n.network())
                        && m.header.dst_len == want_dst.map_or(0, |n| n.prefix_len())
                    {
                        return ok_if_missing(self.handle.rule().del(m).execute().await);
                    }
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

/// Links first, then addresses, then routes and rules: what later objects
/// need exists before them. Deletes run in the opposite order.
fn rank(o: &pb::DesiredObject) -> u8 {
    match &o.kind {
        Some(Kind::Namespace(_)) => 0,
        Some(Kind::Link(_)) => 1,
        Some(Kind::Address(_)) => 2,
        Some(Kind::Route(_)) => 3,
        Some(Kind::Rule(_)) => 4,
        Some(Kind::WireguardPeer(_)) => 5,
        _ => 6,
    }
}

#[async_trait::async_trait]
impl Applier for Linux {
    async fn apply(
        &mut self,
        held: &Objects,
        upserts: &[pb::DesiredObject],
        deletes: &[String],
    ) -> Vec<pb::ObjectError> {
        let mut errors = Vec::new();
        let mut gone: Vec<&pb::DesiredObject> = deletes.iter().filter_map(|id| held.get(id)).collect();
        gone.sort_by_key(|o| std::cmp::Reverse(rank(o)));
        for o in gone {
            if let Err(e) = self.delete(o).await {
                errors.push(pb::ObjectError {
                    id: o.id.clone(),
                    message: e,
                });
            }
        }
        let mut todo: Vec<&pb::DesiredObject> = upserts.iter().collect();
        todo.sort_by_key(|o| rank(o));
        for o in todo {
            if let Err(e) = self.upsert(held.get(&o.id), o).await {
                tracing::warn!(object = %o.id, error = %e, "not applied");
                errors.push(pb::ObjectError {
                    id: o.id.clone(),
                    message: e,
                });
            }
        }
        // A replaced link (a VXLAN toward a new gateway, say) lost the
        // addresses and routes on it; those that did not change are not in
        // this batch, so put them back now rather than at the next resync —
        // which was what a gateway failover waited for.
        let recreated = std::mem::take(&mut self.recreated);
        if !recreated.is_empty() {
            let on_recreated = |o: &pb::DesiredObject| match &o.kind {
                Some(Kind::Address(a)) => a.namespace.is_empty() && recreated.contains(&a.link),
                Some(Kind::Route(r)) => r.namespace.is_empty() && recreated.contains(&r.device),
                _ => false,
            };
            let fresh: std::collections::BTreeSet<&str> = upserts.iter().map(|o| o.id.as_str()).collect();
            let mut again: Vec<pb::DesiredObject> = held
                .values()
                .filter(|o| !fresh.contains(o.id.as_str()) && !deletes.contains(&o.id) && on_recreated(o))
                .cloned()
                .collect();
            again.sort_by_key(rank);
            for o in again {
                if let Err(e) = self.upsert(Some(&o), &o).await {
                    tracing::warn!(object = %o.id, error = %e, "not applied");
                    errors.push(pb::ObjectError {
                        id: o.id.clone(),
                        message: e,
                    });
                }
            }
        }
        // Probe at once through every tunnel whose peers changed, now that
        // all of them are set: the probe makes boringtun handshake with a
        // re-added peer. (Probing after the first of several changes could
        // go out while no peer has the address yet, and the prober would
        // then wait out its interval for an answer.)
        for link in std::mem::take(&mut self.to_kick) {
            if let Some((_, prober)) = self.probes.get(&link) {
                prober.kick();
            }
        }
        // NAT: each touched namespace's table is rebuilt from the final state.
        let nat_ns = |o: &pb::DesiredObject| match &o.kind {
            Some(Kind::NatMap(m)) => Some(m.namespace.clone()),
            _ => None,
        };
        let mut touched: Vec<String> = upserts.iter().filter_map(nat_ns).collect();
        touched.extend(deletes.iter().filter_map(|id| held.get(id)).filter_map(nat_ns));
        touched.sort();
        touched.dedup();
        // What the host holds after this batch, for the tables rebuilt from
        // it as a whole (NAT per namespace; a node's accounting).
        let node = self.wg_private_key.is_none();
        let fin: Objects = if touched.is_empty() && !node {
            Objects::new()
        } else {
            let mut fin = held.clone();
            for id in deletes {
                fin.remove(id);
            }
            for o in upserts {
                fin.insert(o.id.clone(), o.clone());
            }
            fin
        };
        for ns in touched {
            let maps: Vec<pb::NatMap> = fin
                .values()
                .filter_map(|o| match &o.kind {
                    Some(Kind::NatMap(m)) if m.namespace == ns => Some(m.clone()),
                    _ => None,
                })
                .collect();
            let ids: Vec<String> = fin
                .values()
                .filter(|o| nat_ns(o).as_deref() == Some(ns.as_str()))
                .map(|o| o.id.clone())
                .collect();
            if !std::path::Path::new(&format!("/run/netns/{ns}")).exists() {
                continue; // removed with its namespace
            }
            if let Err(e) = nat_table(&ns, &maps) {
                tracing::warn!(namespace = %ns, error = %e, "NAT not applied");
                errors.extend(ids.into_iter().map(|id| pb::ObjectError { id, message: e.clone() }));
            }
        }
        if node {
            let views = peer_views(&fin);
            crate::metrics::get()
                .node_accounting
                .store(true, std::sync::atomic::Ordering::Relaxed);
            // Rewritten when the peers changed, or when it is gone (deleted
            // by hand: a resync puts it back; looked for only when nothing
            // else asks for a rewrite).
            let changed = self.acct.as_ref() != Some(&views);
            let missing = !changed && !views.is_empty() && acct_counters().is_none();
            if changed || missing {
                if missing {
                    self.writes += 1;
                }
                match acct_table(&views) {
                    Ok(()) => self.acct = Some(views),
                    // Counting only: the data path does not depend on it.
                    Err(e) => tracing::warn!(error = %e, "per-peer traffic is not counted"),
                }
            }
        }
        errors
    }

    fn tunnels(&mut self) -> Vec<pb::TunnelStatus> {
        let mut out = Vec::new();
        for (link, (target, prober)) in &self.probes {
            let h = prober.health.lock().unwrap().clone();
            let stats = self.wg.devices.get_mut(link).map(|d| d.stats()).unwrap_or_default();
            if let Some(std::net::SocketAddr::V4(ep)) = stats.endpoint {
                *prober.mtu_target.lock().unwrap() = Some(*ep.ip());
            }
            out.push(pb::TunnelStatus {
                rx_packets: h.packets.0,
                tx_packets: h.packets.1,
                mtu: target.mtu,
                path_mtu: h.path_mtu.clone(),
                peer_site: target.site.clone(),
                link: link.clone(),
                up: h.up,
                rtt_micros: h.rtt.map_or(0, |r| r.as_micros() as u64),
                probes_sent: h.sent,
                probes_lost: h.lost,
                last_handshake: stats.last_handshake_unix.map(|s| prost_types::Timestamp {
                    seconds: s as i64,
                    nanos: 0,
                }),
                rx_bytes: stats.rx_bytes,
                tx_bytes: stats.tx_bytes,
                gateway: String::new(),
                reported_at: None,
            });
        }
        out.sort_by(|a, b| a.peer_site.cmp(&b.peer_site));
        out
    }

    fn tunnel_changes(&self) -> Option<std::sync::Arc<tokio::sync::Notify>> {
        Some(self.tunnel_changed.clone())
    }

    fn features(&mut self) -> Vec<String> {
        let kinds = self.kinds.get_or_insert_with(kernel_link_kinds);
        kinds.iter().filter(|k| *k == "geneve").cloned().collect()
    }

    fn writes(&self) -> u64 {
        self.writes
    }

    async fn host_report(&mut self, held: &Objects) -> pb::HostReport {
        use rtnetlink::packet_route::link::LinkAttribute;
        use rtnetlink::packet_route::route::{RouteAddress, RouteAttribute};
        let features = self.kinds.get_or_insert_with(kernel_link_kinds).clone();
        // Host links by index, to tell weft's own routes from others.
        let mut names = std::collections::HashMap::new();
        let mut links = self.handle.link().get().execute();
        while let Ok(Some(l)) = links.try_next().await {
            if let Some(n) = l.attributes.iter().find_map(|a| match a {
                LinkAttribute::IfName(n) => Some(n.clone()),
                _ => None,
            }) {
                names.insert(l.header.index, n);
            }
        }
        let views = peer_views(held);
        let mut conflicts = Vec::new();
        let mut routes = self
            .handle
            .route()
            .get(RouteMessageBuilder::<Ipv4Addr>::new().table_id(254).build())
            .execute();
        while let Ok(Some(r)) = routes.try_next().await {
            let len = r.header.destination_prefix_length;
            if len == 0 || r.header.table != 254 {
                continue; // the default route overlaps everything by design
            }
            let dst = r.attributes.iter().find_map(|a| match a {
                RouteAttribute::Destination(RouteAddress::Inet(ip)) => Some(*ip),
                _ => None,
            });
            let dev = r.attributes.iter().find_map(|a| match a {
                RouteAttribute::Oif(i) => names.get(i).cloned(),
                _ => None,
            });
            let (Some(dst), dev) = (dst, dev.unwrap_or_default()) else {
                continue;
            };
            if dev.starts_with("weft") {
                continue;
            }
            let Ok(route) = Ipv4Net::new(dst, len) else { continue };
            for (site, nets) in &views {
                for v in nets
                    .iter()
                    .filter(|v| v.contains(&route.network()) || route.contains(&v.network()))
                {
                    conflicts.push(format!("{route} dev {dev} overlaps {site}'s {v}"));
                }
            }
        }
        pb::HostReport {
            features,
            route_conflicts: conflicts,
        }
    }
}
