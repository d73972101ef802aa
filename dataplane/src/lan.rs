//! A gateway's LAN address (`weft-gateway-agent --lan-address`): one
//! address on the site's LAN that only the active gateway holds. Exported
//! LAN hosts route the peers' views to it, so their replies follow the
//! active gateway across a failover, as a VRRP address would.
//!
//! It goes on the interface whose own address's network holds it (the
//! gateway's leg on that LAN), without a prefix route of its own (that
//! interface has the LAN's already), and is announced with two gratuitous
//! ARPs (`arping -U`) so that the LAN's hosts and switches move to this
//! gateway at once. Not weft's link: this module touches that one address
//! only, never the interface.

use std::net::{IpAddr, Ipv4Addr};

use futures::TryStreamExt;
use ipnet::Ipv4Net;
use rtnetlink::Handle;
use rtnetlink::packet_route::address::{AddressAttribute, AddressFlags};
use rtnetlink::packet_route::link::LinkAttribute;

use crate::host::R;
use crate::nl::{is_exists, ok_if_missing};

/// Every IPv4 address of the agent's namespace: (interface index, address,
/// prefix length).
async fn addresses(h: &Handle) -> R<Vec<(u32, Ipv4Addr, u8)>> {
    let mut out = Vec::new();
    let mut addrs = h.address().get().execute();
    while let Some(m) = addrs
        .try_next()
        .await
        .map_err(|e| format!("cannot list addresses: {e}"))?
    {
        for a in &m.attributes {
            if let AddressAttribute::Address(IpAddr::V4(ip)) = a {
                out.push((m.header.index, *ip, m.header.prefix_len));
            }
        }
    }
    Ok(out)
}

async fn link_name(h: &Handle, index: u32) -> R<String> {
    let mut links = h.link().get().match_index(index).execute();
    while let Some(m) = links
        .try_next()
        .await
        .map_err(|e| format!("cannot read link {index}: {e}"))?
    {
        if let Some(n) = m.attributes.iter().find_map(|a| match a {
            LinkAttribute::IfName(n) => Some(n.clone()),
            _ => None,
        }) {
            return Ok(n);
        }
    }
    Err(format!("no link with index {index}"))
}

/// Holds `lan` (true) or not (false) in the agent's namespace. Returns the
/// interface it was just added to (to be announced), or None when nothing
/// was added.
pub async fn hold(h: &Handle, lan: Ipv4Net, on: bool) -> R<Option<String>> {
    let all = addresses(h).await?;
    let held: Vec<u32> = all
        .iter()
        .filter(|(_, ip, len)| *ip == lan.addr() && *len == lan.prefix_len())
        .map(|(i, ..)| *i)
        .collect();
    if !on {
        for index in held {
            let mut addrs = h.address().get().set_link_index_filter(index).execute();
            while let Some(m) = addrs.try_next().await.map_err(|e| e.to_string())? {
                let is = m
                    .attributes
                    .iter()
                    .any(|x| matches!(x, AddressAttribute::Address(IpAddr::V4(ip)) if *ip == lan.addr()));
                if is && m.header.prefix_len == lan.prefix_len() {
                    ok_if_missing(h.address().del(m).execute().await)?;
                    tracing::info!(address = %lan, "released the LAN address (not the active gateway)");
                }
            }
        }
        return Ok(None);
    }
    if !held.is_empty() {
        return Ok(None);
    }
    // The interface on that LAN: one whose own address's network holds it.
    let Some((index, ..)) = all
        .iter()
        .find(|(_, ip, len)| *ip != lan.addr() && Ipv4Net::new(*ip, *len).is_ok_and(|n| n.contains(&lan.addr())))
    else {
        return Err(format!(
            "--lan-address {lan}: no interface of this gateway has an address on that network; give an address of \
             the LAN the gateway is on"
        ));
    };
    let mut req = h.address().add(*index, IpAddr::V4(lan.addr()), lan.prefix_len());
    req.message_mut()
        .attributes
        .push(AddressAttribute::Flags(AddressFlags::Noprefixroute));
    match req.execute().await {
        Err(e) if !is_exists(&e) => return Err(format!("cannot add the LAN address {lan}: {e}")),
        _ => {}
    }
    let name = link_name(h, *index).await?;
    tracing::info!(address = %lan, link = %name, "holding the LAN address (the active gateway)");
    Ok(Some(name))
}

/// Announces `addr` on `link` with gratuitous ARP (`arping -U`, two
/// packets a second apart), in the background; a failure is logged (the
/// LAN then learns the move when its ARP entries expire).
pub fn announce(link: String, addr: Ipv4Addr) {
    tokio::spawn(async move {
        let out = tokio::process::Command::new("arping")
            .args(["-U", "-c", "2", "-I", &link, &addr.to_string()])
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output()
            .await;
        match out {
            Ok(o) if o.status.success() => tracing::debug!(%addr, %link, "announced the LAN address"),
            Ok(o) => tracing::warn!(
                %addr, %link, error = %String::from_utf8_lossy(&o.stderr).trim(),
                "cannot announce the LAN address (gratuitous ARP): the LAN learns the move when its ARP entries expire"
            ),
            Err(e) => tracing::warn!(
                %addr, %link, error = %e,
                "cannot run arping (install iputils-arping): the LAN learns the move when its ARP entries expire"
            ),
        }
    });
}
