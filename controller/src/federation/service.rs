//! The answering side: `weft.v1.FederationService`.

use super::*;

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

pub(super) fn peer_chain(
    certs: Option<Arc<Vec<rustls::pki_types::CertificateDer<'static>>>>,
) -> Result<Arc<Vec<rustls::pki_types::CertificateDer<'static>>>, Status> {
    certs
        .filter(|c| !c.is_empty())
        .ok_or_else(|| Status::unauthenticated("federation calls need this site's client certificate from its site CA"))
}

/// Verifies `chain` against `ca_pem`; returns the site it identifies.
pub(super) fn verify_site(
    chain: &[rustls::pki_types::CertificateDer<'static>],
    ca_pem: &str,
) -> Result<String, Status> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let cas = CertificateDer::pem_slice_iter(ca_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| Status::invalid_argument("ca_pem is not PEM certificates"))?;
    let verifier = crate::auth::verifier_of(cas).map_err(|e| Status::invalid_argument(format!("ca_pem: {e}")))?;
    let (leaf, rest) = chain.split_first().expect("chain is not empty");
    verifier
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
            let mut progress = fed.hub.progress.subscribe();
            let mut closing = fed.hub.closing.subscribe();
            let mut last: Option<pb::NetworkParams> = None;
            loop {
                match fed.params_for(&claimed).await.map(|(p, _)| p) {
                    Ok(p) if last.as_ref() != Some(&p) => {
                        tracing::debug!(peer = %claimed, "sending parameters to the peer");
                        if tx.send(Ok(p.clone())).await.is_err() {
                            return;
                        }
                        let active = p.gateways.iter().find(|g| g.active).map(|g| g.name.as_str());
                        fed.hub.told(&claimed, active);
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
                    // An agent applied something: this site's readiness may
                    // have changed (coalesced: thousands of agents apply a
                    // change within moments).
                    r = progress.changed() => {
                        if r.is_err() {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        progress.mark_unchanged();
                    }
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
                        match still {
                            None => {
                                let _ = tx.send(Err(Status::not_found(format!(
                                    "site {:?} has no peering with site {claimed:?} (it was deleted there)", fed.site_id
                                )))).await;
                                return;
                            }
                            // A rotation of the peer's CA (or `peering
                            // set-ca`): subscribe again, verified by the
                            // CAs trusted now.
                            Some(r) if r.ca_fingerprint != fingerprint_now => {
                                let _ = tx.send(Err(Status::unavailable(format!(
                                    "site {:?} now trusts another CA for site {claimed:?}; subscribe again", fed.site_id
                                )))).await;
                                return;
                            }
                            Some(_) => {}
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
pub(super) async fn checked(fed: &Federation, site: &str, r: &pb::JoinRequest) -> Result<TokenProof, Status> {
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
pub(super) async fn joined(
    fed: &Federation,
    site: String,
    r: pb::JoinRequest,
    params: pb::NetworkParams,
    proof: TokenProof,
) -> Result<Response<pb::JoinResponse>, Status> {
    let (own, port) = fed.params_for_negotiation(&site).await?;
    let remote = fed.remote(&r.ca_pem, &params, &own)?;
    let p = fed.state.negotiated(&site, remote, Some(&proof), port, false).await?;
    tracing::info!(peer = %site, views = p.views.len(), "peering negotiated (joined by the peer)");
    Ok(Response::new(pb::JoinResponse {
        ca_pem: fed.ca_pem.clone(),
        params: Some(own),
    }))
}
