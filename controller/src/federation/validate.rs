//! What a peer sends, checked before anything is recorded.

use super::*;

/// The tunnel MTU two sites agree on: the lower of the values each
/// configured (0 = "derive it from the gateway's underlay"), never below
/// 1280; 0 when neither configured one.
pub fn agreed_mtu(theirs: u32, ours: u32) -> u32 {
    match (theirs, ours) {
        (0, 0) => 0,
        (0, m) | (m, 0) => m.max(1280),
        (a, b) => a.min(b).max(1280),
    }
}

/// A site's gateways, as each peering's parameters describe them.
pub struct LocalGateways {
    gateways: Vec<std::sync::Arc<crate::domain::Gateway>>,
    active: Option<String>,
}

impl LocalGateways {
    /// The gateways of `model`, in name order, and the active one.
    pub fn of(model: &crate::render::Model) -> LocalGateways {
        LocalGateways {
            gateways: model.gateways.values().cloned().collect(),
            active: crate::render::active_gateway(model).map(|g| g.name.clone()),
        }
    }

    /// Each gateway with the endpoint a peer dials for the peering whose
    /// tunnel listens on `port`.
    pub fn for_port(&self, site: &crate::domain::Site, port: u16) -> Vec<pb::GatewayInfo> {
        self.gateways
            .iter()
            .map(|g| pb::GatewayInfo {
                name: g.name.clone(),
                endpoint: g
                    .endpoint
                    .as_deref()
                    .and_then(|e| site.peering_endpoint(e, port))
                    .map(|e| e.to_string())
                    .unwrap_or_default(),
                public_key: g.public_key.clone().unwrap_or_default(),
                active: self.active.as_ref() == Some(&g.name),
            })
            .collect()
    }
}

/// The most gateways a peer may list (an active/standby pair needs two).
pub(super) const MAX_PEER_GATEWAYS: usize = 16;

/// A peer's gateway as it described it, checked field by field: a valid
/// name, an endpoint that is an address and a port from 1 to 65535 (or
/// none: the peer dials out), a 32-byte base64 WireGuard key (or none yet).
pub(super) fn remote_gateway(i: usize, g: &pb::GatewayInfo) -> Result<RemoteGateway, String> {
    crate::domain::validate_name(&format!("gateways[{i}].name"), &g.name)?;
    let endpoint = match g.endpoint.as_str() {
        "" => None,
        e => match e.parse::<std::net::SocketAddr>() {
            Ok(a) if a.port() != 0 => Some(a.to_string()),
            _ => {
                return Err(format!(
                    "gateways[{i}].endpoint {} is not an address and a port from 1 to 65535 (e.g. 192.0.2.1:51820)",
                    crate::domain::shown(e)
                ));
            }
        },
    };
    let public_key = match g.public_key.as_str() {
        "" => None,
        k if base64::engine::general_purpose::STANDARD
            .decode(k)
            .is_ok_and(|raw| raw.len() == 32) =>
        {
            Some(k.to_string())
        }
        k => {
            return Err(format!(
                "gateways[{i}].public_key {} is not a 32-byte WireGuard key in base64",
                crate::domain::shown(k)
            ));
        }
    };
    Ok(RemoteGateway {
        name: g.name.clone(),
        endpoint,
        public_key,
        active: g.active,
    })
}

/// The most controller endpoints a peer may list.
pub(super) const MAX_PEER_ENDPOINTS: usize = 16;

/// Checks a peer's controller endpoint before this controller ever dials
/// it: `host:port` (a DNS name or an address, port 1–65535), and not an
/// address on this host or no host at all (loopback, unspecified, link-local,
/// multicast), so a peer cannot point this controller at its own local
/// services; loopback is allowed where this site is itself served on
/// loopback (`lab`: every site on one host).
pub(super) fn controller_endpoint(e: &str, lab: bool) -> Result<(), String> {
    let shown = crate::domain::shown(e);
    if let Ok(a) = e.parse::<std::net::SocketAddr>() {
        let ip = a.ip();
        let local = (ip.is_loopback() && !lab)
            || ip.is_unspecified()
            || ip.is_multicast()
            || matches!(ip, std::net::IpAddr::V4(v4) if v4.is_link_local() || v4.is_broadcast())
            || matches!(ip, std::net::IpAddr::V6(v6) if v6.is_unicast_link_local());
        if a.port() == 0 || local {
            return Err(format!(
                "{shown} is not an address another site's controller can serve on"
            ));
        }
        return Ok(());
    }
    let ok = e.rsplit_once(':').is_some_and(|(host, port)| {
        port.parse::<u16>().is_ok_and(|p| p != 0)
            && !host.is_empty()
            && host.len() <= 253
            && host != "localhost"
            && host
                .split('.')
                .all(|l| !l.is_empty() && l.len() <= 63 && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'))
    });
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{shown} is not host:port (a DNS name or an address, and a port from 1 to 65535)"
        ))
    }
}

/// Which side of the tunnel this site takes: the side with a reachable
/// gateway endpoint serves; when both have one, the smaller site id serves.
/// Both sides compute the same answer.
pub fn tunnel_role(own_id: &str, own_has_endpoint: bool, peer_id: &str, peer_has_endpoint: bool) -> TunnelRole {
    match (own_has_endpoint, peer_has_endpoint) {
        (true, false) => TunnelRole::Server,
        (false, true) => TunnelRole::Client,
        _ if own_id < peer_id => TunnelRole::Server,
        _ => TunnelRole::Client,
    }
}

impl Federation {
    /// A remote site's record from what it sent, validated as a whole
    /// before anything is recorded; an error names the field.
    pub(super) fn remote(
        &self,
        ca_pem: &str,
        p: &pb::NetworkParams,
        own: &pb::NetworkParams,
    ) -> Result<RemoteSite, Error> {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;
        let der = CertificateDer::from_pem_slice(ca_pem.as_bytes())
            .map_err(|_| Error::InvalidArgument("ca_pem is not a PEM certificate".into()))?;
        let mut workload = Vec::new();
        for (i, c) in p.workload_cidrs.iter().enumerate() {
            workload.push(parse_cidr(c).map_err(|m| Error::InvalidArgument(format!("workload_cidrs[{i}]: {m}")))?);
        }
        let external = match p.external_cidr.trim() {
            "" => None,
            c => Some(parse_cidr(c).map_err(|m| Error::InvalidArgument(format!("external_cidr: {m}")))?),
        };
        let gateways = p
            .gateways
            .iter()
            .enumerate()
            .map(|(i, g)| remote_gateway(i, g))
            .collect::<Result<Vec<_>, _>>()
            .map_err(Error::InvalidArgument)?;
        if gateways.len() > MAX_PEER_GATEWAYS {
            return Err(Error::InvalidArgument(format!(
                "gateways: {} listed; a site has at most {MAX_PEER_GATEWAYS}",
                gateways.len()
            )));
        }
        if p.mtu != 0 && !(1280..=9000).contains(&p.mtu) {
            return Err(Error::InvalidArgument(format!(
                "mtu: {} is out of range; a tunnel MTU is 1280 to 9000 (or 0: derived by each gateway)",
                p.mtu
            )));
        }
        if p.endpoints.len() > MAX_PEER_ENDPOINTS {
            return Err(Error::InvalidArgument(format!(
                "endpoints: {} listed; a site lists at most {MAX_PEER_ENDPOINTS} controller endpoints",
                p.endpoints.len()
            )));
        }
        // Loopback only between sites that are both on one host (a lab).
        let lab = !own.endpoints.is_empty()
            && own
                .endpoints
                .iter()
                .all(|e| e.parse::<std::net::SocketAddr>().is_ok_and(|a| a.ip().is_loopback()));
        for (i, e) in p.endpoints.iter().enumerate() {
            controller_endpoint(e, lab).map_err(|m| Error::InvalidArgument(format!("endpoints[{i}]: {m}")))?;
        }
        let names: Vec<_> = p
            .names
            .iter()
            .map(|n| {
                (
                    n.name.clone(),
                    crate::names::NameKind::from_pb(n.kind),
                    n.address.clone(),
                )
            })
            .collect();
        let names = crate::names::check_remote(&names, &workload, external).map_err(Error::InvalidArgument)?;
        let has_endpoint = |ps: &pb::NetworkParams| ps.gateways.iter().any(|g| !g.endpoint.is_empty());
        Ok(RemoteSite {
            ca_pem: ca_pem.to_string(),
            ca_fingerprint: fingerprint(&der),
            workload_cidrs: workload,
            external_cidr: external,
            gateways,
            mtu: agreed_mtu(p.mtu, own.mtu),
            endpoints: p.endpoints.clone(),
            tunnel_role: tunnel_role(&own.site_id, has_endpoint(own), &p.site_id, has_endpoint(p)),
            names,
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_peers_controller_endpoints_are_checked_before_they_are_dialled() {
        use super::controller_endpoint;
        for good in ["192.0.2.7:7443", "ctl.site-b.example:7443", "[2001:db8::1]:7443"] {
            assert_eq!(controller_endpoint(good, false), Ok(()), "{good}");
        }
        for bad in [
            "127.0.0.1:2379",
            "[::1]:7443",
            "0.0.0.0:7443",
            "169.254.169.254:80",
            "224.0.0.1:7443",
            "localhost:7443",
            "192.0.2.7",
            "192.0.2.7:0",
            "a b:7443",
            "ctl:7443\nx",
        ] {
            assert!(controller_endpoint(bad, false).is_err(), "{bad}");
        }
        assert_eq!(controller_endpoint("127.0.0.1:7443", true), Ok(()), "a lab on one host");
        assert!(controller_endpoint("169.254.169.254:80", true).is_err());
    }

    #[test]
    fn the_lower_configured_tunnel_mtu_wins_and_none_means_derive() {
        use super::agreed_mtu;
        assert_eq!(agreed_mtu(0, 0), 0);
        assert_eq!(agreed_mtu(1380, 0), 1380);
        assert_eq!(agreed_mtu(0, 1400), 1400);
        assert_eq!(agreed_mtu(1400, 1300), 1300);
        assert_eq!(agreed_mtu(500, 0), 1280, "never below IPv6's minimum");
    }
}
