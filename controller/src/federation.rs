//! Federation: this controller as the dialing side (create and delete a
//! peering from a token) and as the answering side (`weft.v1.FederationService`).
//!
//! A peering token (`weftp1.<base64url JSON>`) carries the issuing site's id,
//! its controller endpoints, the SHA-256 fingerprint of its CA, a token id
//! and secret, and the expiry. The dialing side pins the CA by fingerprint
//! and checks that the server's identity is the site the token names, then
//! presents its own site certificate (`weft://<site>/site/<site>`) and its CA
//! in `Join`, proving the secret. The answering side checks the token, that
//! the client certificate chains to the CA it was sent, and records the
//! peering (consuming the token) before answering with its own CA. From then
//! on each side authenticates the other by the CA it recorded.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use serde::{Deserialize, Serialize};
use tonic::{Request, Response, Status};
use weft_common::tls::{self, Trust};
use weft_proto::v1 as pb;
use weft_proto::v1::federation_service_client::FederationServiceClient;
use weft_proto::v1::federation_service_server::FederationService;

use crate::auth::{Role, identity_of};
use crate::config::parse_cidr;
use crate::domain::{Peering, RemoteGateway, RemoteSite, TunnelRole, now_ms};
use crate::error::Error;
use crate::pki::fingerprint;
use crate::state::{State, federation::TokenProof};

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
    gateways: Vec<crate::domain::Gateway>,
    active: Option<String>,
}

impl LocalGateways {
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
const MAX_PEER_GATEWAYS: usize = 16;

/// A peer's gateway as it described it, checked field by field: a valid
/// name, an endpoint that is an address and a port from 1 to 65535 (or
/// none: the peer dials out), a 32-byte base64 WireGuard key (or none yet).
fn remote_gateway(i: usize, g: &pb::GatewayInfo) -> Result<RemoteGateway, String> {
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
const MAX_PEER_ENDPOINTS: usize = 16;

/// Checks a peer's controller endpoint before this controller ever dials
/// it: `host:port` (a DNS name or an address, port 1–65535), and not an
/// address on this host or no host at all (loopback, unspecified, link-local,
/// multicast), so a peer cannot point this controller at its own local
/// services; loopback is allowed where this site is itself served on
/// loopback (`lab`: every site on one host).
fn controller_endpoint(e: &str, lab: bool) -> Result<(), String> {
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

/// How long a call to a peer controller may take (and a connection to it).
const PEER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a peering's negotiation may take when its caller set no
/// deadline: the connection and the peer's Join (a store write there, over
/// a link that may be slow). A caller's shorter deadline wins.
pub const JOIN_BUDGET: Duration = Duration::from_secs(15);
/// Joins a site checks at once (a token or an existing peer's CA: a store
/// read or two each), and Joins it negotiates at once once checked (the
/// planning and the write); more are told to retry. A Join is finished
/// even when its caller gives up (see `join`), so these bound what callers
/// that give up can leave running, and the first bound keeps callers with
/// bad tokens from holding the negotiations' places.
const JOINS_CHECKED_AT_ONCE: usize = 64;
/// A peer's parameter updates are taken in at once up to a burst, then at
/// most one per period (those that come meanwhile are folded into the
/// newest): a peer cannot make this site write and render without end.
const PEER_UPDATE_EVERY: Duration = Duration::from_millis(500);
const PEER_UPDATE_BURST: std::num::NonZeroU32 = std::num::NonZeroU32::new(5).unwrap();
const JOINS_AT_ONCE: usize = 16;

/// What a peering token holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeeringToken {
    pub site: String,
    pub endpoints: Vec<String>,
    /// SHA-256 of the site CA certificate, hex.
    pub fp: String,
    pub id: String,
    pub secret: String,
    /// Expiry, milliseconds since the epoch.
    pub exp: u64,
}

impl PeeringToken {
    pub fn encode(&self) -> String {
        let json = serde_json::to_vec(self).expect("a token serializes");
        format!(
            "weftp1.{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json)
        )
    }

    pub fn decode(text: &str) -> Result<PeeringToken, Error> {
        let bad = |why: &str| {
            Error::InvalidArgument(format!(
                "the peering token is malformed ({why}); paste it whole as printed by `weftctl peering token`"
            ))
        };
        let body = text
            .trim()
            .strip_prefix("weftp1.")
            .ok_or_else(|| bad("it does not start with weftp1."))?;
        let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(body)
            .map_err(|_| bad("not base64"))?;
        let t: PeeringToken = serde_json::from_slice(&json).map_err(|_| bad("unreadable contents"))?;
        if t.fp.len() != 64 || !t.fp.bytes().all(|b| b.is_ascii_hexdigit()) || t.endpoints.is_empty() {
            return Err(bad("no fingerprint or no endpoint"));
        }
        Ok(t)
    }
}

/// This site's side of federation.
pub struct Federation {
    pub state: State,
    pub site_id: String,
    pub ca_pem: String,
    pub ca_fingerprint: String,
    /// This site's client certificate and key for calls to peers.
    pub site_cert: (String, String),
    /// Where peers reach this controller.
    pub endpoints: Vec<String>,
    pub hub: Arc<crate::hub::Hub>,
    /// How long a peer may stay unreachable before its peering is removed here.
    pub grace: Duration,
    /// Joins refused here, for the admin.
    pub refused: crate::refused::RefusedJoins,
}

/// What the admin gets for a status a peer answered a Join with: refusals
/// keep their meaning; a peer that is busy, cut off or slow is worth a
/// retry, and says so.
fn status_of(site: &str, s: Status) -> Error {
    use tonic::Code;
    let m = format!("site {site:?} refused: {}", s.message());
    let retry = || {
        format!(
            "site {site:?} could not answer ({:?}: {}); retry (`weftctl peering create` with the same token is \
             safe to repeat)",
            s.code(),
            s.message()
        )
    };
    match s.code() {
        // The admin's own credentials are fine; the peer refused the token.
        Code::Unauthenticated => Error::FailedPrecondition(m),
        Code::AlreadyExists => Error::AlreadyExists(m),
        Code::InvalidArgument => Error::InvalidArgument(m),
        Code::ResourceExhausted => Error::ResourceExhausted(m),
        Code::PermissionDenied => Error::PermissionDenied(m),
        Code::NotFound => Error::NotFound(m),
        Code::DeadlineExceeded | Code::Cancelled => Error::DeadlineExceeded(retry()),
        Code::Unavailable | Code::Unknown | Code::Aborted => Error::Unavailable(retry()),
        _ => Error::FailedPrecondition(m),
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
    /// This site's network parameters as it tells `peer`, and the UDP port
    /// its gateways listen on for that peering: each gateway's endpoint is
    /// the one the peer dials for this peering alone (see
    /// [`crate::domain::Site::peering_endpoint`]).
    pub async fn params_for(&self, peer: &str) -> Result<(pb::NetworkParams, u16), Error> {
        let (site, _) = self.state.site().await?;
        let port = self.state.wg_port_for(peer).await?;
        // Which gateway is active: the peer gives only it our CIDRs as
        // allowed IPs, and follows this when we fail over.
        let gateways = self.local_gateways().await?;
        let params = pb::NetworkParams {
            site_id: site.id.clone(),
            workload_cidrs: site.pod_cidrs.iter().map(|c| c.to_string()).collect(),
            external_cidr: site.external_cidr.to_string(),
            gateways: gateways.for_port(&site, port),
            mtu: site.tunnel_mtu.unwrap_or(0),
            endpoints: self.endpoints.clone(),
            // From the hub's model (it follows the store): computed again
            // at every change a subscription sends, so no store read here.
            names: self
                .hub
                .model()
                .names
                .values()
                // Never more than a peer accepts (the store could hold more
                // only through a write that bypassed the API).
                .take(crate::names::MAX_NAMES)
                .map(|n| pb::PublishedName {
                    name: n.name.clone(),
                    kind: n.kind.to_pb() as i32,
                    address: n.published().to_string(),
                })
                .collect(),
        };
        Ok((params, port))
    }

    /// This site's gateways and which of them is active.
    pub async fn local_gateways(&self) -> Result<LocalGateways, Error> {
        let (gateways, _) = self.state.list_gateways().await?;
        let active = crate::render::active_gateway(&self.hub.model()).map(|g| g.name.clone());
        Ok(LocalGateways { gateways, active })
    }

    /// A remote site's record from what it sent, validated as a whole
    /// before anything is recorded; an error names the field.
    fn remote(&self, ca_pem: &str, p: &pb::NetworkParams, own: &pb::NetworkParams) -> Result<RemoteSite, Error> {
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

    async fn client(
        &self,
        endpoint: &str,
        trust: Trust,
    ) -> Result<FederationServiceClient<tonic::transport::Channel>, String> {
        self.client_within(endpoint, trust, PEER_TIMEOUT).await
    }

    async fn client_within(
        &self,
        endpoint: &str,
        trust: Trust,
        limit: Duration,
    ) -> Result<FederationServiceClient<tonic::transport::Channel>, String> {
        let target = format!("https://{endpoint}");
        let ch = tokio::time::timeout(
            limit,
            tls::connect(&target, &trust, Some((&self.site_cert.0, &self.site_cert.1))),
        )
        .await
        .map_err(|_| format!("{endpoint}: no connection within {:.1} s", limit.as_secs_f64()))?
        .map_err(|e| format!("{e:#}"))?;
        Ok(FederationServiceClient::new(ch))
    }

    /// Dials the site in `token` and negotiates; records the peering here
    /// once the other side has. Repeating it for a peering that exists
    /// returns that peering; so does repeating it after a Join the peer
    /// answered too late (the peer kept its side, or gave the token back
    /// when this side never recorded one). Gives up at `deadline`:
    /// DEADLINE_EXCEEDED when the peer did not answer in time, UNAVAILABLE
    /// when it could not be reached, both saying to retry.
    pub async fn create(&self, token_text: &str, deadline: tokio::time::Instant) -> Result<Peering, Error> {
        let t = PeeringToken::decode(token_text)?;
        if t.site == self.site_id {
            return Err(Error::InvalidArgument(format!(
                "this token was made by this site ({:?}); run `weftctl peering create` on the other site",
                t.site
            )));
        }
        if let Some(p) = self.state.peering(&t.site).await?
            && p.remote.as_ref().is_some_and(|r| r.ca_fingerprint == t.fp)
        {
            return Ok(p);
        }
        if t.exp <= now_ms() {
            return Err(Error::FailedPrecondition(format!(
                "the peering token expired {} ago; ask site {:?} for a new one",
                humantime::format_duration(Duration::from_secs((now_ms() - t.exp) / 1000)),
                t.site
            )));
        }
        let (own, port) = self.params_for(&t.site).await?;
        let req = pb::JoinRequest {
            token_id: t.id.clone(),
            secret: t.secret.clone(),
            ca_pem: self.ca_pem.clone(),
            params: Some(own.clone()),
        };
        let mut failures = Vec::new();
        let started = tokio::time::Instant::now();
        for ep in &t.endpoints {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                failures.push(format!("{ep}: not tried, the time was up"));
                continue;
            }
            let mut c = match self
                .client_within(
                    ep,
                    Trust::FingerprintForSite(t.fp.clone(), t.site.clone()),
                    left.min(PEER_TIMEOUT),
                )
                .await
            {
                Ok(c) => c,
                Err(e) if e.contains("pinned fingerprint") || e.contains("as the token says") => {
                    return Err(Error::FailedPrecondition(format!(
                        "refusing to peer: {e} (a tampered token, or a token for another site)"
                    )));
                }
                Err(e) => {
                    failures.push(e);
                    continue;
                }
            };
            let resp = tokio::time::timeout_at(deadline, c.join(req.clone()))
                .await
                .map_err(|_| {
                    Error::DeadlineExceeded(format!(
                        "site {:?} did not answer the join within {:.1} s (it may be slow or busy, and may still \
                         record the peering); retry: `weftctl peering create` with the same token is safe to \
                         repeat, and waits for the peer up to its --timeout",
                        t.site,
                        started.elapsed().as_secs_f64()
                    ))
                })?
                .map_err(|s| status_of(&t.site, s))?
                .into_inner();
            let params = resp.params.unwrap_or_default();
            if params.site_id != t.site {
                return Err(Error::FailedPrecondition(format!(
                    "the controller at {ep} says it is site {:?}, not {:?}",
                    params.site_id, t.site
                )));
            }
            // The peer has recorded its side by now: whatever is refused
            // here is undone there too, so no half peering stays behind.
            let remote = match self.remote(&resp.ca_pem, &params, &own) {
                Ok(r) if r.ca_fingerprint == t.fp => r,
                Ok(_) => {
                    self.leave(&t.site, &t.endpoints, &resp.ca_pem).await;
                    return Err(Error::FailedPrecondition(
                        "the CA the peer sent does not match the token".into(),
                    ));
                }
                Err(e) => {
                    self.leave(&t.site, &t.endpoints, &resp.ca_pem).await;
                    return Err(Error::FailedPrecondition(format!(
                        "site {:?} sent parameters this site refuses: {}",
                        t.site, e
                    )));
                }
            };
            return match self.state.negotiated(&t.site, remote.clone(), None, port).await {
                Ok(p) => {
                    tracing::info!(peer = %t.site, role = ?remote.tunnel_role, port = p.listen_port, "peering negotiated");
                    Ok(p)
                }
                Err(e) => {
                    self.leave(&t.site, &remote.endpoints, &remote.ca_pem).await;
                    Err(e)
                }
            };
        }
        Err(Error::Unavailable(format!(
            "cannot reach site {:?} at {}: {}; retry when it is reachable (`weftctl peering create` with the same \
             token waits for it up to its --timeout)",
            t.site,
            t.endpoints.join(", "),
            failures.join("; ")
        )))
    }

    /// Asks the peer (at its controller `endpoints`, trusted by `ca_pem`)
    /// to remove its side; whether one answered yes.
    async fn leave(&self, site: &str, endpoints: &[String], ca_pem: &str) -> bool {
        for ep in endpoints {
            if let Ok(mut c) = self.client(ep, Trust::CaPem(ca_pem.to_string())).await
                && tokio::time::timeout(PEER_TIMEOUT, c.leave(pb::LeaveRequest {}))
                    .await
                    .is_ok_and(|r| r.is_ok())
            {
                tracing::info!(peer = %site, "the peer removed its side");
                return true;
            }
        }
        false
    }

    /// How far the peer controller's clock is ahead of this one's
    /// (negative: behind), measured against the middle of the call's round
    /// trip, and that round trip; from the first endpoint that answers.
    pub async fn clock_skew(&self, remote: &RemoteSite) -> Result<(f64, Duration), String> {
        let mut last = "the peer lists no controller endpoint".to_string();
        for ep in &remote.endpoints {
            let mut c = match self.client(ep, Trust::CaPem(remote.ca_pem.clone())).await {
                Ok(c) => c,
                Err(e) => {
                    last = e;
                    continue;
                }
            };
            let sent = std::time::SystemTime::now();
            let t0 = std::time::Instant::now();
            match tokio::time::timeout(PEER_TIMEOUT, c.clock(pb::ClockRequest {})).await {
                Ok(Ok(r)) => {
                    let rtt = t0.elapsed();
                    let theirs = r.into_inner().now.unwrap_or_default();
                    let theirs = theirs.seconds as f64 + f64::from(theirs.nanos) / 1e9;
                    let ours = sent.duration_since(std::time::UNIX_EPOCH).unwrap_or_default() + rtt / 2;
                    return Ok((theirs - ours.as_secs_f64(), rtt));
                }
                Ok(Err(s)) => last = format!("{ep}: {}", s.message()),
                Err(_) => last = format!("{ep}: timed out"),
            }
        }
        Err(last)
    }

    /// Ends the peering with `site` here, telling the peer when it answers.
    pub async fn delete(&self, site: &str) -> Result<bool, Error> {
        let Some(p) = self.state.peering(site).await? else {
            return Err(Error::NotFound(format!(
                "there is no peering with site {site:?}; list them with `weftctl peerings`"
            )));
        };
        let notified = match &p.remote {
            Some(r) => self.leave(site, &r.endpoints, &r.ca_pem).await,
            None => false,
        };
        self.state.delete_peering(site).await?;
        tracing::info!(peer = %site, remote_notified = notified, "peering deleted");
        Ok(notified)
    }
}

/// `weft.v1.FederationService`.
pub struct FederationApi {
    pub fed: Arc<Federation>,
    /// Open Subscribe streams per peer site.
    subscriptions: Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>,
    /// Joins being checked, and being negotiated (see [`JOINS_AT_ONCE`]).
    checking: Arc<tokio::sync::Semaphore>,
    joins: Arc<tokio::sync::Semaphore>,
}

/// Subscribe streams one peer may hold open at once (its leading replica
/// needs one; a leadership change briefly two).
const MAX_SUBSCRIPTIONS_PER_PEER: usize = 4;

impl FederationApi {
    pub fn new(fed: Arc<Federation>) -> Self {
        FederationApi {
            fed,
            subscriptions: Default::default(),
            checking: Arc::new(tokio::sync::Semaphore::new(JOINS_CHECKED_AT_ONCE)),
            joins: Arc::new(tokio::sync::Semaphore::new(JOINS_AT_ONCE)),
        }
    }
}

/// One open Subscribe stream, counted while it lives.
struct Subscription {
    counts: Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>,
    site: String,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut c = self.counts.lock().unwrap();
        if let Some(n) = c.get_mut(&self.site) {
            *n -= 1;
            if *n == 0 {
                c.remove(&self.site);
            }
        }
    }
}

fn peer_chain(
    certs: Option<Arc<Vec<rustls::pki_types::CertificateDer<'static>>>>,
) -> Result<Arc<Vec<rustls::pki_types::CertificateDer<'static>>>, Status> {
    certs
        .filter(|c| !c.is_empty())
        .ok_or_else(|| Status::unauthenticated("federation calls need this site's client certificate from its site CA"))
}

/// Verifies `chain` against `ca_pem`; returns the site it identifies.
fn verify_site(chain: &[rustls::pki_types::CertificateDer<'static>], ca_pem: &str) -> Result<String, Status> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let ca = CertificateDer::from_pem_slice(ca_pem.as_bytes())
        .map_err(|_| Status::invalid_argument("ca_pem is not a PEM certificate"))?;
    let auth =
        crate::auth::Authenticator::new("", &ca).map_err(|e| Status::invalid_argument(format!("ca_pem: {e}")))?;
    let (leaf, rest) = chain.split_first().expect("chain is not empty");
    auth.verifier()
        .verify_client_cert(leaf, rest, rustls::pki_types::UnixTime::now())
        .map_err(|e| {
            Status::unauthenticated(format!(
                "the client certificate does not chain to the CA presented: {e}"
            ))
        })?;
    let id = identity_of(leaf).map_err(Status::unauthenticated)?;
    if id.role != Role::Site || id.name != id.site {
        return Err(Status::unauthenticated(format!(
            "{id} is not a site identity (weft://<site>/site/<site>)"
        )));
    }
    Ok(id.site)
}

#[tonic::async_trait]
impl FederationService for FederationApi {
    type SubscribeStream = tokio_stream::wrappers::ReceiverStream<Result<pb::NetworkParams, Status>>;

    async fn subscribe(&self, req: Request<pb::SubscribeRequest>) -> Result<Response<Self::SubscribeStream>, Status> {
        let chain = peer_chain(req.peer_certs())?;
        let claimed = identity_of(&chain[0]).map_err(Status::unauthenticated)?.site;
        let Some(p) = self.fed.state.peering(&claimed).await? else {
            return Err(Status::not_found(format!(
                "site {:?} has no peering with site {claimed:?} (it was deleted there)",
                self.fed.site_id
            )));
        };
        verify_site(&chain, &p.remote.as_ref().map(|r| r.ca_pem.clone()).unwrap_or_default())?;
        let fingerprint_now = p.remote.as_ref().map(|r| r.ca_fingerprint.clone()).unwrap_or_default();
        let held = {
            let mut c = self.subscriptions.lock().unwrap();
            let n = c.entry(claimed.clone()).or_default();
            if *n >= MAX_SUBSCRIPTIONS_PER_PEER {
                return Err(Status::resource_exhausted(format!(
                    "site {claimed:?} already holds {MAX_SUBSCRIPTIONS_PER_PEER} subscriptions; close one first"
                )));
            }
            *n += 1;
            Subscription {
                counts: self.subscriptions.clone(),
                site: claimed.clone(),
            }
        };
        // The stream ends when the certificate it was opened with does: the
        // peer then subscribes again with its current one.
        let expires = crate::pki::not_after(chain[0].as_ref()).unwrap_or(std::time::SystemTime::now());
        let fed = self.fed.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(2);
        tokio::spawn(async move {
            let _held = held;
            let until_expiry = expires.duration_since(std::time::SystemTime::now()).unwrap_or_default();
            let expiry = tokio::time::sleep(until_expiry);
            tokio::pin!(expiry);
            let mut changes = fed.hub.params_rev.subscribe();
            let mut closing = fed.hub.closing.subscribe();
            let mut last: Option<pb::NetworkParams> = None;
            loop {
                match fed.params_for(&claimed).await.map(|(p, _)| p) {
                    Ok(p) if last.as_ref() != Some(&p) => {
                        tracing::debug!(peer = %claimed, "sending parameters to the peer");
                        if tx.send(Ok(p.clone())).await.is_err() {
                            return;
                        }
                        last = Some(p);
                    }
                    Ok(_) => {}
                    Err(e) => {
                        let _ = tx.send(Err(e.into())).await;
                        return;
                    }
                }
                tokio::select! {
                    r = changes.changed() => if r.is_err() { return },
                    _ = async { let _ = closing.wait_for(|c| *c).await; } => return,
                    _ = tx.closed() => return,
                    _ = &mut expiry => {
                        let _ = tx.send(Err(Status::unauthenticated(
                            "the certificate this subscription was opened with has expired; subscribe again",
                        ))).await;
                        return;
                    }
                    _ = tokio::time::sleep(Duration::from_secs(2)) => {
                        // The peering may have been deleted here meanwhile.
                        let still = fed.state.peering(&claimed).await.ok().flatten().and_then(|p| p.remote);
                        if still.is_none_or(|r| r.ca_fingerprint != fingerprint_now) {
                            let _ = tx.send(Err(Status::not_found(format!(
                                "site {:?} has no peering with site {claimed:?} (it was deleted there)", fed.site_id
                            )))).await;
                            return;
                        }
                    }
                }
            }
        });
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }

    async fn join(&self, req: Request<pb::JoinRequest>) -> Result<Response<pb::JoinResponse>, Status> {
        let chain = peer_chain(req.peer_certs())?;
        let r = req.into_inner();
        let params = r
            .params
            .clone()
            .ok_or_else(|| Status::invalid_argument("params is missing"))?;
        let site = verify_site(&chain, &r.ca_pem)?;
        if site != params.site_id {
            return Err(Status::unauthenticated(format!(
                "the certificate is for site {site:?} but the parameters claim {:?}",
                params.site_id
            )));
        }
        let me = self.fed.site_id.clone();
        let busy = move |what: &str, n: usize| {
            Status::unavailable(format!(
                "site {me:?} is {what} {n} peerings already; retry in a few seconds"
            ))
        };
        let Ok(checking) = self.checking.clone().try_acquire_owned() else {
            return Err(busy("checking", JOINS_CHECKED_AT_ONCE));
        };
        // Finished even if the caller gives up waiting (a slow or busy
        // site): what is recorded is then whole, and the caller's retry
        // finds it (or the token back, see `follow_peer`).
        let (fed, joins) = (self.fed.clone(), self.joins.clone());
        tokio::spawn(async move {
            let proof = checked(&fed, &site, &r).await?;
            drop(checking);
            let Ok(_negotiating) = joins.try_acquire_owned() else {
                return Err(busy("negotiating", JOINS_AT_ONCE));
            };
            // The caller proved a valid token: a refusal from here on is
            // the admin's business.
            let refused = site.clone();
            joined(&fed, site, r, params, proof)
                .await
                .inspect_err(|s| fed.refused.record(&refused, s))
        })
        .await
        .map_err(|e| Status::internal(format!("the join failed: {e}")))?
    }

    async fn leave(&self, req: Request<pb::LeaveRequest>) -> Result<Response<pb::LeaveResponse>, Status> {
        let chain = peer_chain(req.peer_certs())?;
        let claimed = identity_of(&chain[0]).map_err(Status::unauthenticated)?.site;
        let Some(p) = self.fed.state.peering(&claimed).await? else {
            return Err(Status::not_found(format!("there is no peering with site {claimed:?}")));
        };
        let ca = p.remote.as_ref().map(|r| r.ca_pem.clone()).unwrap_or_default();
        verify_site(&chain, &ca)?;
        self.fed.state.delete_peering(&claimed).await?;
        tracing::info!(peer = %claimed, "peering deleted by the peer");
        Ok(Response::new(pb::LeaveResponse {}))
    }

    async fn clock(&self, req: Request<pb::ClockRequest>) -> Result<Response<pb::ClockResponse>, Status> {
        let chain = peer_chain(req.peer_certs())?;
        let claimed = identity_of(&chain[0]).map_err(Status::unauthenticated)?.site;
        let Some(p) = self.fed.state.peering(&claimed).await? else {
            return Err(Status::not_found(format!("there is no peering with site {claimed:?}")));
        };
        verify_site(&chain, &p.remote.as_ref().map(|r| r.ca_pem.clone()).unwrap_or_default())?;
        Ok(Response::new(pb::ClockResponse {
            now: Some(prost_types::Timestamp::from(std::time::SystemTime::now())),
        }))
    }
}

/// The cheap checks of a Join by the peer `site` (authenticated by the CA
/// it sent), before any planning under the writer lock: an unknown caller
/// with a bad token costs one read, and so does one that claims an
/// existing peer's id under another CA. The token's proof, to consume.
async fn checked(fed: &Federation, site: &str, r: &pb::JoinRequest) -> Result<TokenProof, Status> {
    let proof = TokenProof {
        id: r.token_id.clone(),
        secret: r.secret.clone(),
    };
    match fed.state.peering(site).await? {
        None => fed.state.check_peer_token(&proof, site).await?,
        Some(p) => {
            use rustls::pki_types::pem::PemObject;
            let presented = rustls::pki_types::CertificateDer::from_pem_slice(r.ca_pem.as_bytes())
                .map(|der| fingerprint(der.as_ref()))
                .unwrap_or_default();
            if p.remote.is_some_and(|rem| rem.ca_fingerprint != presented) {
                // Only a holder of a valid token learns that the id is
                // taken; anyone else gets what a bad token gets.
                fed.state.check_peer_token(&proof, site).await?;
                let refusal = Status::already_exists(format!(
                    "a site {site:?} with another CA is already peered; it must delete that peering first"
                ));
                fed.refused.record(site, &refusal);
                return Err(refusal);
            }
        }
    }
    Ok(proof)
}

/// The checked peer `site` joins with `r`: validates its parameters and
/// records the peering (consuming the token), or finds the one it recorded
/// before.
async fn joined(
    fed: &Federation,
    site: String,
    r: pb::JoinRequest,
    params: pb::NetworkParams,
    proof: TokenProof,
) -> Result<Response<pb::JoinResponse>, Status> {
    let (own, port) = fed.params_for(&site).await?;
    let remote = fed.remote(&r.ca_pem, &params, &own)?;
    let p = fed.state.negotiated(&site, remote, Some(&proof), port).await?;
    tracing::info!(peer = %site, views = p.views.len(), "peering negotiated (joined by the peer)");
    Ok(Response::new(pb::JoinResponse {
        ca_pem: fed.ca_pem.clone(),
        params: Some(own),
    }))
}

/// Keeps one subscription per peering: takes in the peer's parameter
/// changes, removes the peering when the peer says it has none, or when the
/// peer stays unreachable past the grace period. Only while this replica
/// leads (see leader.rs): one set of sessions per site.
pub async fn sync_peers(fed: Arc<Federation>, leader: tokio::sync::watch::Receiver<bool>) {
    let mut tasks: std::collections::HashMap<String, tokio::task::JoinHandle<()>> = std::collections::HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tick.tick().await;
        let leading = *leader.borrow();
        let model = fed.hub.model();
        tasks.retain(|site, t| {
            let keep = leading && model.peerings.get(site).is_some_and(|p| p.remote.is_some()) && !t.is_finished();
            if !keep {
                t.abort();
            }
            keep
        });
        for (site, p) in model.peerings.iter() {
            if leading && p.remote.is_some() && !tasks.contains_key(site) {
                tasks.insert(site.clone(), tokio::spawn(follow_peer(fed.clone(), site.clone())));
            }
        }
    }
}

async fn follow_peer(fed: Arc<Federation>, site: String) {
    use futures::StreamExt;
    let mut down_since: Option<std::time::Instant> = None;
    let mut delays = weft_common::backoff();
    loop {
        let Ok(Some(p)) = fed.state.peering(&site).await else {
            return;
        };
        let Some(remote) = p.remote.clone() else { return };
        let mut reached = false;
        let mut young_not_found = false;
        for ep in &remote.endpoints {
            let Ok(mut c) = fed.client(ep, Trust::CaPem(remote.ca_pem.clone())).await else {
                continue;
            };
            match c.subscribe(pb::SubscribeRequest {}).await {
                Ok(stream) => {
                    reached = true;
                    down_since = None;
                    delays = weft_common::backoff();
                    // The peer holds its side: the token is spent for good.
                    if p.joined_with.is_some() {
                        match fed.state.peering_confirmed(&site).await {
                            Ok(()) => {
                                tracing::info!(peer = %site, "the peer holds its side of the peering; its token is spent")
                            }
                            Err(e) => {
                                tracing::warn!(peer = %site, error = %e, "cannot record that the peer holds the peering")
                            }
                        }
                    }
                    let mut stream = stream.into_inner();
                    let own = match fed.params_for(&site).await {
                        Ok((o, _)) => o,
                        Err(_) => break,
                    };
                    // Each update costs a store write and a render for every
                    // agent: one identical to the last taken in is dropped
                    // before any of that, and past a burst only one per
                    // PEER_UPDATE_EVERY is taken in, the newest of those that
                    // came meanwhile.
                    let limiter = governor::RateLimiter::direct(
                        governor::Quota::with_period(PEER_UPDATE_EVERY)
                            .expect("a nonzero period")
                            .allow_burst(PEER_UPDATE_BURST),
                    );
                    let mut last: Option<pb::NetworkParams> = None;
                    let mut ended = false;
                    while !ended {
                        let Some(Ok(mut params)) = stream.next().await else {
                            break;
                        };
                        if last.as_ref() == Some(&params) {
                            continue;
                        }
                        if limiter.check().is_err() {
                            let mut folded = 0u64;
                            let ready = limiter.until_ready();
                            tokio::pin!(ready);
                            loop {
                                tokio::select! {
                                    _ = &mut ready => break,
                                    next = stream.next() => match next {
                                        Some(Ok(newer)) => {
                                            params = newer;
                                            folded += 1;
                                        }
                                        _ => {
                                            ended = true;
                                            break;
                                        }
                                    },
                                }
                            }
                            tracing::debug!(peer = %site, folded, "the peer sends updates faster than this site takes them in; took in the newest");
                            if last.as_ref() == Some(&params) {
                                continue;
                            }
                        }
                        if params.site_id != site {
                            tracing::warn!(peer = %site, "the peer sent parameters for another site; ignored");
                            last = Some(params);
                            continue;
                        }
                        match fed.remote(&remote.ca_pem, &params, &own) {
                            Ok(r) => match fed.state.update_remote(&site, r).await {
                                Ok(changed) => {
                                    if changed {
                                        tracing::info!(peer = %site, "the peer's parameters changed");
                                    }
                                    last = Some(params);
                                }
                                // Not recorded (the store): taken in again if sent again.
                                Err(e) => {
                                    tracing::warn!(peer = %site, error = %e, "cannot take in the peer's parameters")
                                }
                            },
                            Err(e) => {
                                tracing::warn!(peer = %site, error = %e, "the peer sent invalid parameters");
                                last = Some(params);
                            }
                        }
                    }
                    break;
                }
                // Right after negotiation (or a Join again) the peer may not
                // have recorded its side yet: only a NotFound on an older
                // peering counts (checked again as the peering is removed:
                // a Join may have come meanwhile). One the peer never held
                // gives its token back: the peer gave up on its Join and
                // may retry.
                Err(s)
                    if s.code() == tonic::Code::NotFound
                        && now_ms().saturating_sub(p.created_at_ms.max(p.joined_at_ms))
                            > crate::state::federation::RECORD_WINDOW_MS =>
                {
                    match fed.state.drop_unheld_peering(&site).await {
                        Ok(Some(gone)) if gone.joined_with.is_some() => {
                            tracing::info!(peer = %site, "the peer never recorded the peering; removed it here and \
                                gave its token back for a retry");
                            return;
                        }
                        Ok(Some(_)) => {
                            tracing::info!(peer = %site, "the peer deleted the peering; removed it here");
                            return;
                        }
                        Ok(None) => young_not_found = true,
                        Err(e) => {
                            tracing::warn!(peer = %site, error = %e, "cannot remove the peering the peer does not hold")
                        }
                    }
                }
                // Too young to trust: ask again soon rather than backing off,
                // so a deletion made while this site was away lands promptly.
                Err(s) if s.code() == tonic::Code::NotFound => young_not_found = true,
                Err(s) => tracing::debug!(peer = %site, error = %s, "subscription refused"),
            }
        }
        if !reached {
            let since = *down_since.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() >= fed.grace
                && let Ok(Some(_)) = fed.state.drop_unheld_peering(&site).await
            {
                tracing::warn!(peer = %site, grace = ?fed.grace, "the peer stayed unreachable past the grace period; removed the peering here");
                return;
            }
        }
        let delay = if young_not_found {
            Duration::from_secs(1)
        } else {
            delays
                .next()
                .unwrap_or(Duration::from_secs(30))
                .min(Duration::from_secs(30))
        };
        tokio::time::sleep(delay).await;
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
