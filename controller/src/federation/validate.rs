//! What a peer sends, checked before anything is recorded: the checks
//! are the core's (`weft_core::peer`); here, the peer's CA certificate is
//! parsed and the result recorded.

use super::*;

pub use weft_core::peer::{agreed_mtu, tunnel_role};

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
    /// tunnel listens on `port`, and what its endpoint discovery found for
    /// that port (configured and reflexive candidates: a gateway's own
    /// underlay address means nothing to a peer).
    pub fn for_port(&self, site: &crate::domain::Site, port: u16) -> Vec<pb::GatewayInfo> {
        use weft_core::nat::CandidateKind;
        self.gateways
            .iter()
            .map(|g| {
                let endpoint = g
                    .endpoint
                    .and_then(|e| site.peering_endpoint(e, port))
                    .map(|e| e.to_string())
                    .unwrap_or_default();
                let found = g.discovered.get(&port);
                let mut candidates: Vec<pb::Candidate> = Vec::new();
                // The configured endpoint as a candidate only where a peer
                // takes one (an endpoint on loopback, on a one-host lab, is
                // still sent as the endpoint, as before).
                if let Ok(a) = endpoint.parse::<std::net::SocketAddr>() {
                    let c = pb::Candidate {
                        address: a.to_string(),
                        kind: CandidateKind::Configured.as_str().into(),
                    };
                    if weft_core::nat::candidates("", std::slice::from_ref(&c), &[]).is_ok() {
                        candidates.push(c);
                    }
                }
                for c in found.iter().flat_map(|d| &d.candidates) {
                    if c.kind == CandidateKind::Reflexive
                        && !candidates.iter().any(|x| x.address == c.address.to_string())
                    {
                        candidates.push(c.to_pb());
                    }
                }
                candidates.truncate(weft_core::nat::MAX_CANDIDATES);
                let (candidates, candidates_v6) = weft_core::nat::by_family(&candidates);
                pb::GatewayInfo {
                    name: g.name.clone(),
                    endpoint,
                    public_key: g.public_key.map(|k| k.to_string()).unwrap_or_default(),
                    active: self.active.as_ref() == Some(&g.name),
                    candidates,
                    candidates_v6,
                    nat: found
                        .and_then(|d| d.nat)
                        .map(|b| b.as_str().to_string())
                        .unwrap_or_default(),
                }
            })
            .collect()
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
        weft_core::peer::remote_site(ca_pem, &fingerprint(&der), p, own).map_err(Error::InvalidArgument)
    }
}
