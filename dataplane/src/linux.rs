//! [`Netlink`] on Linux with rtnetlink: reads and writes links, addresses,
//! routes and rules in the agent's namespace on its own connection, and in
//! another namespace on a thread that joined it (with a connection of its
//! own), awaited so that no runtime thread blocks.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};

use futures::TryStreamExt;
use ipnet::IpNet;
use rtnetlink::packet_route::address::AddressAttribute;
use rtnetlink::packet_route::route::RouteMessage;
use rtnetlink::{Handle, LinkUnspec, LinkVxlan, RouteMessageBuilder};

use crate::host::{Netlink, R};
use crate::model::*;
use crate::nl::{in_namespace, index_in, is_exists, need_index_in, ok_if_missing, set_up_named};
use crate::plan::Op;

mod read;
use read::{forwarding_path, read_ns, rule_of};

async fn route_message(h: &Handle, r: &Route) -> R<RouteMessage> {
    let bad = |e| format!("the route to {}: {e}", r.dst);
    let mut b = RouteMessageBuilder::<IpAddr>::new()
        .destination_prefix(r.dst.network(), r.dst.prefix_len())
        .map_err(bad)?
        .table_id(r.table);
    if let Some(g) = r.gateway {
        b = b.gateway(g).map_err(bad)?.onlink();
    }
    if let Some(dev) = &r.dev {
        b = b.output_interface(need_index_in(h, dev).await?);
    }
    Ok(b.build())
}

async fn add_link(h: &Handle, l: &Link) -> R<()> {
    let created = |r: Result<(), rtnetlink::Error>| r.map_err(|e| format!("cannot create {}: {e}", l.name));
    match &l.kind {
        LinkKind::Vxlan {
            vni,
            local,
            remote,
            port,
        } => {
            let b = LinkVxlan::new(&l.name, *vni).port(*port).mtu(l.mtu);
            let b = match (local, remote) {
                (IpAddr::V4(local), IpAddr::V4(remote)) => b.local(*local).remote(*remote),
                (IpAddr::V6(local), IpAddr::V6(remote)) => b.local6(*local).remote6(*remote),
                _ => {
                    return Err(format!(
                        "{}: VXLAN between {local} and {remote}, of two families",
                        l.name
                    ));
                }
            };
            created(h.link().add(b.build()).execute().await)?;
            set_up_named(h, &l.name, 0).await
        }
        LinkKind::Geneve { vni, remote, port } => {
            let b = rtnetlink::LinkGeneve::new(&l.name, *vni).port(*port).mtu(l.mtu);
            let b = match remote {
                IpAddr::V4(r) => b.remote(*r),
                IpAddr::V6(r) => b.remote6(*r),
            };
            created(h.link().add(b.build()).execute().await)?;
            set_up_named(h, &l.name, 0).await
        }
        LinkKind::Bridge => {
            created(
                h.link()
                    .add(rtnetlink::LinkBridge::new(&l.name).build())
                    .execute()
                    .await,
            )?;
            set_up_named(h, &l.name, l.mtu).await
        }
        LinkKind::Veth { peer, peer_ns } => add_veth(h, l, peer, peer_ns).await,
        k => Err(format!("cannot make a link of kind {k:?} with netlink")),
    }
}

/// A veth pair: both ends here, the peer's moved into `peer_ns` and set up
/// there, with receive offloads for the traffic leaving the tunnel.
async fn add_veth(h: &Handle, l: &Link, peer: &str, peer_ns: &Ns) -> R<()> {
    h.link()
        .add(rtnetlink::LinkVeth::new(&l.name, peer).mtu(l.mtu).build())
        .execute()
        .await
        .map_err(|e| format!("cannot create {}: {e}", l.name))?;
    set_up_named(h, &l.name, 0).await?;
    if peer_ns.is_empty() {
        return set_up_named(h, peer, l.mtu).await;
    }
    // Tuning only, so a failure is logged (see offload.rs).
    let ours = need_index_in(h, &l.name).await?;
    if let Err(e) = crate::offload::gro_threaded(&l.name, ours) {
        tracing::warn!(link = %l.name, "receive offloads not enabled, forwarding per packet: {e}");
    }
    let idx = need_index_in(h, peer).await?;
    let file = std::fs::File::open(format!("/run/netns/{peer_ns}")).map_err(|e| format!("namespace {peer_ns}: {e}"))?;
    h.link()
        .set(
            LinkUnspec::new_with_index(idx)
                .setns_by_fd(std::os::fd::AsRawFd::as_raw_fd(&file))
                .build(),
        )
        .execute()
        .await
        .map_err(|e| format!("cannot move {peer} into {peer_ns}: {e}"))?;
    let (name, mtu) = (peer.to_string(), l.mtu);
    in_namespace(peer_ns, move |h| {
        Box::pin(async move {
            set_up_named(&h, &name, mtu).await?;
            if let Err(e) = crate::offload::queue_on_veth(&h, &name).await {
                tracing::warn!(link = %name, "no queue on the veth, bursts may drop: {e}");
            }
            Ok(())
        })
    })
    .await
}

/// Before IPv6 forwarding goes on in the host's namespace: each of the
/// host's own interfaces that takes router advertisements only while not
/// forwarding (`accept_ra` 1, the default) takes them whatever (2), so a
/// host that gets its IPv6 default route from them keeps it. Never weft's
/// links, nor the default for new ones: with forwarding on they take no
/// advertisement, so none sent through the overlay or a tunnel can route
/// the host. A peering's namespace has no interface of the host's.
fn keep_router_advertisements() {
    let Ok(dir) = std::fs::read_dir("/proc/sys/net/ipv6/conf") else {
        return;
    };
    for e in dir.flatten() {
        let path = e.path().join("accept_ra");
        let name = e.file_name();
        let name = name.to_string_lossy();
        if !matches!(&*name, "all" | "default")
            && !owns_link(&name)
            && std::fs::read_to_string(&path).is_ok_and(|v| v.trim() == "1")
            && let Err(err) = std::fs::write(&path, "2")
        {
            tracing::warn!(path = %path.display(), error = %err, "cannot keep router advertisements with IPv6 forwarding on");
        }
    }
}

/// One netlink operation in the namespace of `h`.
async fn apply_op(h: &Handle, op: &Op) -> R<()> {
    match op {
        Op::CreateNamespace(n) => {
            if std::path::Path::new(&format!("/run/netns/{n}")).exists() {
                return Ok(());
            }
            rtnetlink::NetworkNamespace::add(n.clone())
                .await
                .map_err(|e| format!("cannot create namespace {n}: {e}"))
        }
        Op::DeleteNamespace(n) => {
            if !n.starts_with(PREFIX) || !std::path::Path::new(&format!("/run/netns/{n}")).exists() {
                return Ok(());
            }
            rtnetlink::NetworkNamespace::del(n.clone())
                .await
                .map_err(|e| format!("cannot delete namespace {n}: {e}"))
        }
        Op::SetForwarding(ns, f) => {
            if *f == Family::V6 && ns.is_empty() {
                keep_router_advertisements();
            }
            std::fs::write(forwarding_path(*f), "1").map_err(|e| match f {
                Family::V6 if e.kind() == std::io::ErrorKind::NotFound => {
                    "cannot enable IPv6 forwarding: IPv6 is disabled on this host".to_string()
                }
                _ => format!("cannot enable {f} forwarding: {e}"),
            })
        }
        Op::DelRule(r) => {
            let version = match r.family {
                Family::V4 => rtnetlink::IpVersion::V4,
                Family::V6 => rtnetlink::IpVersion::V6,
            };
            let mut rules = h.rule().get(version).execute();
            while let Some(m) = rules.try_next().await.map_err(|e| e.to_string())? {
                if rule_of(&r.ns, &m).as_ref() == Some(r) {
                    return ok_if_missing(h.rule().del(m).execute().await);
                }
            }
            Ok(())
        }
        Op::DelRoute(r) => match route_message(h, r).await {
            Ok(m) => ok_if_missing(h.route().del(m).execute().await),
            Err(_) => Ok(()), // its device is gone, and the route with it
        },
        Op::DelAddress(a) => {
            let Some(idx) = index_in(h, &a.link).await? else {
                return Ok(());
            };
            let mut addrs = h.address().get().set_link_index_filter(idx).execute();
            while let Some(m) = addrs.try_next().await.map_err(|e| e.to_string())? {
                let has = m
                    .attributes
                    .iter()
                    .any(|x| matches!(x, AddressAttribute::Address(ip) if *ip == a.cidr.addr()));
                if has && m.header.prefix_len == a.cidr.prefix_len() {
                    return ok_if_missing(h.address().del(m).execute().await);
                }
            }
            Ok(())
        }
        Op::DelLink { name, .. } => match index_in(h, name).await? {
            Some(idx) => ok_if_missing(h.link().del(idx).execute().await),
            None => Ok(()),
        },
        Op::AddLink(l) => add_link(h, l).await,
        Op::SetLink { name, mtu, .. } => set_up_named(h, name, *mtu).await,
        Op::AddAddress(a) => {
            let idx = need_index_in(h, &a.link).await?;
            let mut req = h.address().add(idx, a.cidr.addr(), a.cidr.prefix_len());
            use rtnetlink::packet_route::address::AddressFlags;
            let mut flags = AddressFlags::empty();
            if a.no_prefix_route {
                flags |= AddressFlags::Noprefixroute;
            }
            // Usable at once: no duplicate detection on weft's own links
            // (the controller hands each address out once).
            if a.cidr.addr().is_ipv6() {
                flags |= AddressFlags::Nodad;
            }
            if !flags.is_empty() {
                req.message_mut().attributes.push(AddressAttribute::Flags(flags));
            }
            match req.execute().await {
                Err(e) if !is_exists(&e) => Err(format!("cannot add {}: {e}", a.cidr)),
                _ => Ok(()),
            }
        }
        Op::SetRoute(r) => {
            let m = route_message(h, r).await?;
            h.route()
                .add(m)
                .replace()
                .execute()
                .await
                .map_err(|e| format!("cannot add the route to {}: {e}", r.dst))
        }
        Op::AddRule(r) => {
            let req = h
                .rule()
                .add()
                .action(rtnetlink::packet_route::rule::RuleAction::ToTable)
                .table_id(r.table)
                .priority(r.priority);
            let req = match r.iif.as_ref() {
                Some(i) => req.input_interface(i.clone()),
                None => req,
            };
            let done = match r.family {
                Family::V4 => {
                    let mut req = req.v4();
                    if let Some(IpNet::V4(n)) = r.to {
                        req = req.destination_prefix(n.network(), n.prefix_len());
                    }
                    if let Some(IpNet::V4(n)) = r.from {
                        req = req.source_prefix(n.network(), n.prefix_len());
                    }
                    req.execute().await
                }
                Family::V6 => {
                    let mut req = req.v6();
                    if let Some(IpNet::V6(n)) = r.to {
                        req = req.destination_prefix(n.network(), n.prefix_len());
                    }
                    if let Some(IpNet::V6(n)) = r.from {
                        req = req.source_prefix(n.network(), n.prefix_len());
                    }
                    req.execute().await
                }
            };
            match done {
                Err(e) if !is_exists(&e) => Err(format!("cannot add the rule: {e}")),
                _ => Ok(()),
            }
        }
        other => Err(format!("{other:?} is not a netlink operation")),
    }
}

/// Netlink on this host: the agent's namespace on `handle`, others on
/// threads of their own.
#[derive(Debug)]
pub struct LinuxNetlink {
    handle: Handle,
}

impl LinuxNetlink {
    /// Opens a netlink connection in the current namespace. Must run inside
    /// a tokio runtime.
    pub fn new() -> std::io::Result<LinuxNetlink> {
        let (conn, handle, _) = rtnetlink::new_connection()?;
        tokio::spawn(conn);
        Ok(LinuxNetlink { handle })
    }

    pub fn handle(&self) -> &Handle {
        &self.handle
    }
}

#[async_trait::async_trait]
impl Netlink for LinuxNetlink {
    async fn namespaces(&mut self) -> R<BTreeSet<Ns>> {
        let mut out = BTreeSet::new();
        let mut dir = match tokio::fs::read_dir("/run/netns").await {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(format!("cannot list /run/netns: {e}")),
        };
        while let Ok(Some(e)) = dir.next_entry().await {
            out.extend(e.file_name().to_str().map(str::to_string));
        }
        Ok(out)
    }

    async fn read(&mut self, ns: &Ns) -> R<RawNs> {
        if ns.is_empty() {
            return read_ns(&self.handle, ns).await;
        }
        let n = ns.clone();
        in_namespace(ns, move |h| Box::pin(async move { read_ns(&h, &n).await })).await
    }

    async fn apply(&mut self, ns: &Ns, ops: &[Op]) -> Vec<R<()>> {
        if ns.is_empty() {
            let mut out = Vec::with_capacity(ops.len());
            for op in ops {
                out.push(apply_op(&self.handle, op).await);
            }
            return out;
        }
        let batch = ops.to_vec();
        let n = ops.len();
        let r = in_namespace(ns, move |h| {
            Box::pin(async move {
                let mut out = Vec::with_capacity(batch.len());
                for op in &batch {
                    out.push(apply_op(&h, op).await);
                }
                Ok(out)
            })
        })
        .await;
        r.unwrap_or_else(|e| vec![Err(e); n])
    }
}

/// Whether this kernel can make links of `kind` ("geneve", "vxlan",
/// "wireguard"): one is made in a network namespace of a throwaway thread's
/// own (nothing on the host is touched; the namespace goes with the
/// thread). Err says why not, in words an operator can act on. Blocking.
pub fn probe_link_kind(kind: &str) -> R<()> {
    let kind = kind.to_string();
    std::thread::spawn(move || -> R<()> {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| {
            format!("cannot make a throwaway network namespace to try a {kind} link: {e} (run as root)")
        })?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        rt.block_on(async {
            let (conn, h, _) = rtnetlink::new_connection().map_err(|e| e.to_string())?;
            tokio::spawn(conn);
            let far = Ipv4Addr::new(192, 0, 2, 1);
            let msg = match kind.as_str() {
                "geneve" => rtnetlink::LinkGeneve::new("weftprobe", 1).remote(far).build(),
                "vxlan" => LinkVxlan::new("weftprobe", 1).remote(far).build(),
                "wireguard" => rtnetlink::LinkWireguard::new("weftprobe").build(),
                _ => return Err(format!("no probe for link kind {kind}")),
            };
            match h.link().add(msg).execute().await {
                Ok(()) => Ok(()),
                Err(rtnetlink::Error::NetlinkError(m)) if m.raw_code() == -libc::EOPNOTSUPP => Err(format!(
                    "the kernel cannot make {kind} links: no {kind} module (not built for this kernel, or not loadable)"
                )),
                Err(rtnetlink::Error::NetlinkError(m)) if m.raw_code() == -libc::EPERM => Err(format!(
                    "not permitted to make a {kind} link (run as root, or with CAP_NET_ADMIN)"
                )),
                Err(e) => Err(format!("the kernel refused a {kind} link: {e}")),
            }
        })
    })
    .join()
    .map_err(|_| "the kernel probe panicked".to_string())?
}

/// Which of the link kinds weft uses this kernel can make ("geneve",
/// "vxlan", "wireguard"); see [`probe_link_kind`]. Blocking.
pub fn kernel_link_kinds() -> Vec<String> {
    ["geneve", "vxlan", "wireguard"]
        .into_iter()
        .filter(|k| probe_link_kind(k).is_ok())
        .map(String::from)
        .collect()
}

/// Whether this kernel can make Geneve links.
pub fn kernel_has_geneve() -> bool {
    probe_link_kind("geneve").is_ok()
}
