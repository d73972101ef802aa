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

mod follower;
pub mod relay;
mod service;
mod token;
mod validate;

pub use follower::sync_peers;
pub use service::FederationApi;
pub use token::PeeringToken;
pub use validate::{LocalGateways, agreed_mtu, tunnel_role};

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
use crate::domain::{Peering, RemoteSite, now_ms};
use crate::error::Error;
use crate::pki::fingerprint;
use crate::state::{State, federation::TokenProof};

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
    /// Hole punches that did not come up (the leader's).
    pub punches: relay::Punches,
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

/// What `params` for `peer` says of this site's export policy for it.
fn exports(model: &crate::render::Model, peer: &str, params: &mut pb::NetworkParams) {
    if let Some(site) = &model.site {
        let p = model.peerings.get(peer).map(|p| &**p);
        let onward = p.map(|p| crate::transit::onward(model.peerings.values().map(|q| &**q), p));
        crate::export::fill(site, p, &onward.unwrap_or_default(), params);
    }
    // Transit: whether this site agrees on this peering, and while the
    // peer does too, the sites it may reach through this one.
    if let Some(p) = model.peerings.get(peer) {
        params.trusted_ca = p.remote.as_ref().map(|r| r.ca_fingerprint.clone()).unwrap_or_default();
        params.transit = p.transit;
        params.transit_v6 = true;
        params.version = env!("CARGO_PKG_VERSION").into();
        params.transit_routes = crate::transit::offers(&model.peerings, peer);
    }
}

impl Federation {
    /// This site's network parameters as it tells `peer`, and the UDP port
    /// its gateways listen on for that peering: each gateway's endpoint is
    /// the one the peer dials for this peering alone (see
    /// [`crate::domain::Site::peering_endpoint`]).
    ///
    /// From the hub's model, which follows the store: a subscription asks
    /// after every change and every 2 s, so no store read here unless the
    /// peering is not in the model yet.
    pub async fn params_for(&self, peer: &str) -> Result<(pb::NetworkParams, u16), Error> {
        let model = self.hub.model();
        let port = match model.peerings.get(peer) {
            Some(p) => p.listen_port,
            None => self.state.wg_port_for(peer).await?,
        };
        let mut params = self.params_at(&model, port)?;
        relay::fill(self, &model, peer, &mut params);
        exports(&model, peer, &mut params);
        params.readiness = self.hub.readiness_for(peer, &model);
        Ok((params, port))
    }

    /// [`Self::params_for`] for a negotiation, which records the port: the
    /// port as the store has it (the model may lag behind a peering just
    /// deleted and made again).
    pub async fn params_for_negotiation(&self, peer: &str) -> Result<(pb::NetworkParams, u16), Error> {
        let port = self.state.wg_port_for(peer).await?;
        let model = self.hub.model();
        let mut params = self.params_at(&model, port)?;
        exports(&model, peer, &mut params);
        Ok((params, port))
    }

    fn params_at(&self, model: &crate::render::Model, port: u16) -> Result<pb::NetworkParams, Error> {
        let site = model
            .site
            .clone()
            .ok_or_else(|| Error::FailedPrecondition("the site is not initialised in the store yet".into()))?;
        // Which gateway is active: the peer gives only it our CIDRs as
        // allowed IPs, and follows this when we fail over.
        let gateways = LocalGateways::of(model);
        let params = pb::NetworkParams {
            site_id: site.id.clone(),
            ca_pem: self.ca_pem.clone(),
            workload_cidrs: site.pod_cidrs.iter().map(|c| c.to_string()).collect(),
            external_cidr: site.offered_external().map(|c| c.to_string()).unwrap_or_default(),
            workload_cidrs_v6: site
                .ipv6
                .iter()
                .flat_map(|v| &v.pod_cidrs)
                .map(|c| c.to_string())
                .collect(),
            external_cidr_v6: site
                .ipv6
                .as_ref()
                .and_then(|v| v.external_cidr)
                .map(|c| c.to_string())
                .unwrap_or_default(),
            gateways: gateways.for_port(&site, port),
            mtu: site.tunnel_mtu.unwrap_or(0),
            endpoints: self.endpoints.clone(),
            names: model
                .names
                .values()
                // Never more than a peer accepts (the store could hold more
                // only through a write that bypassed the API).
                // (A name without an IPv4 address only from an IPv6-only
                // site: peers refuse it otherwise.)
                .filter(|n| n.address.is_some() || site.pod_cidrs.is_empty())
                .take(crate::names::MAX_NAMES)
                .map(|n| pb::PublishedName {
                    name: n.name.clone(),
                    kind: n.kind.to_pb() as i32,
                    address: n.published().map(|a| a.to_string()).unwrap_or_default(),
                    address_v6: n.address_v6.map(|a| a.to_string()).unwrap_or_default(),
                })
                .collect(),
            ..Default::default()
        };
        Ok(params)
    }

    /// This site's gateways and which of them is active.
    pub fn local_gateways(&self) -> LocalGateways {
        LocalGateways::of(&self.hub.model())
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
    pub async fn create(
        &self,
        token_text: &str,
        transit: bool,
        deadline: tokio::time::Instant,
    ) -> Result<Peering, Error> {
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
        let (own, port) = self.params_for_negotiation(&t.site).await?;
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
            return match self
                .state
                .negotiated(&t.site, remote.clone(), None, port, transit)
                .await
            {
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
