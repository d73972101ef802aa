//! What the agent runs beside the host's network: the DNS records its
//! responder serves and the tunnels a relay site's gateway relays, decoded.

use std::net::IpAddr;

use ipnet::IpNet;
use weft_proto::v1 as pb;
use weft_types::name;

use super::{DnsRecord, R, RelaySession, ip, v4};
use crate::model::WgKey;
use crate::relay::{Side, Spec};

/// A record the responder may serve: a DNS label under a site id, with a
/// unicast IPv4 address, a site's IPv6 address, or both.
pub(super) fn dns_record(r: &pb::DnsRecord) -> R<DnsRecord> {
    let label = name::dns_label;
    if !label(&r.name) {
        return Err(format!("DNS name {:?} is not a DNS label", r.name));
    }
    if r.site.len() > 63 || !r.site.split('.').all(label) {
        return Err(format!("DNS record site {:?} is not a site id", r.site));
    }
    // Empty: a name of an IPv6-only site, which has an IPv6 address.
    let v4 = match r.address.as_str() {
        "" if !r.address_v6.is_empty() => None,
        text => {
            let a = v4(text, "DNS record address")?;
            if a.is_unspecified() || a.is_loopback() || a.is_multicast() || a.is_broadcast() {
                return Err(format!("DNS record address {a} is not a unicast address"));
            }
            Some(a)
        }
    };
    let v6 = match r.address_v6.as_str() {
        "" => None,
        text => {
            let a = weft_types::net::addr_v6(text).map_err(|m| format!("DNS record IPv6 address {m}"))?;
            if weft_types::net::special_use(IpNet::from(IpAddr::V6(a))).is_some() {
                return Err(format!(
                    "DNS record IPv6 address {a} is not a unicast address of a site"
                ));
            }
            Some(a)
        }
    };
    Ok(DnsRecord {
        name: r.name.clone(),
        site: r.site.clone(),
        v4,
        v6,
    })
}

/// An address a relayed side may send from: IPv4 or IPv6 (IPv4-mapped
/// taken as IPv4), not loopback, unspecified or multicast.
fn unicast(text: &str, what: &str) -> R<IpAddr> {
    let a = ip(text, what)?.to_canonical();
    if a.is_loopback() || a.is_unspecified() || a.is_multicast() {
        return Err(format!("{what} {a} is not a unicast address"));
    }
    Ok(a)
}

/// A relayed tunnel, checked before anything binds: ports from 1024 up and
/// distinct, each side's keys 32-byte WireGuard keys (1 to 16), its
/// addresses unicast, IPv4 or IPv6 (at most 64), a nonzero limit.
pub(super) fn relay_session(r: &pb::RelaySession) -> R<RelaySession> {
    let side = |label: &str, s: Option<&pb::RelaySide>| -> R<(Side, String)> {
        let s = s.ok_or_else(|| format!("relay side {label} is missing"))?;
        name::id(&format!("relay side {label}'s site"), &s.site)?;
        let port = u16::try_from(s.port)
            .ok()
            .filter(|p| *p >= 1024)
            .ok_or_else(|| format!("relay side {label}'s port {} is not from 1024 to 65535", s.port))?;
        if s.to_keys.is_empty() || s.to_keys.len() > 16 {
            return Err(format!(
                "relay side {label} lists {} keys; give 1 to 16 (the far side's gateways)",
                s.to_keys.len()
            ));
        }
        let to_keys = s
            .to_keys
            .iter()
            .map(|k| WgKey::parse(&format!("relay side {label}'s key"), k).map(|k| *k.as_bytes()))
            .collect::<R<Vec<_>>>()?;
        if s.from_ips.len() > 64 {
            return Err(format!(
                "relay side {label} lists {} addresses; at most 64",
                s.from_ips.len()
            ));
        }
        let from_ips = s
            .from_ips
            .iter()
            .map(|a| unicast(a, &format!("relay side {label}'s address")))
            .collect::<R<Vec<_>>>()?;
        Ok((
            Side {
                port,
                to_keys,
                from_ips,
            },
            s.site.clone(),
        ))
    };
    let (a, site_a) = side("a", r.a.as_ref())?;
    let (b, site_b) = side("b", r.b.as_ref())?;
    if a.port == b.port {
        return Err(format!("relay sides a and b share port {}", a.port));
    }
    if r.bytes_per_second == 0 {
        return Err("a relay limit of 0 bytes a second".into());
    }
    Ok(RelaySession {
        spec: Spec {
            a,
            b,
            bytes_per_second: r.bytes_per_second,
        },
        sites: (site_a, site_b),
    })
}
