//! Peering tokens and negotiated peerings.
//!
//! A peering is recorded in one transaction with its IPAM views and, on the
//! side that issued the token, the token's consumption: a refused or failed
//! negotiation writes nothing, and a repeated one (same peer CA) returns the
//! existing peering instead of a second.

use std::time::Duration;

use ipnet::Ipv4Net;

use super::views::check_candidates;
use super::{Key, State, encode};
use crate::domain::{PeerToken, Peering, PeeringState, PendingCidrs, RemoteSite, now_ms, validate_name};
use crate::error::Error;
use crate::pki::random_hex;
use crate::store::{Compare, Op, Txn};

use weft_common::sha256_hex;

/// How long after a peering is made (or joined again) the peer's "no such
/// peering" is not believed: it records its side just after it has the
/// answer to its Join.
pub const RECORD_WINDOW_MS: u64 = 5_000;

/// The secret half of a peering token the other side proves.
#[derive(Debug, Clone)]
pub struct TokenProof {
    pub id: String,
    pub secret: String,
}

impl State {
    /// A new one-time peering token: (id, secret, record).
    pub async fn create_peer_token(
        &self,
        ttl: Duration,
        for_site: Option<&str>,
    ) -> Result<(String, String, PeerToken), Error> {
        if let Some(s) = for_site {
            validate_name("for_site", s).map_err(Error::InvalidArgument)?;
        }
        if ttl < Duration::from_secs(1) || ttl > Duration::from_secs(30 * 86400) {
            return Err(Error::InvalidArgument(
                "ttl is out of range: give between 1 second and 30 days".into(),
            ));
        }
        let (id, secret) = (random_hex(6), random_hex(16));
        let now = now_ms();
        let t = PeerToken {
            id: id.clone(),
            secret_sha256: sha256_hex(&secret),
            expires_at_ms: now + ttl.as_millis() as u64,
            created_at_ms: now,
            for_site: for_site.map(str::to_string),
        };
        let key = self.at(Key::PeerToken(&id));
        if !self
            .store
            .txn(
                Txn::new()
                    .when(Compare::Version(key.clone(), 0))
                    .then(Op::put(key, encode(&t))),
            )
            .await?
            .succeeded
        {
            return Err(Error::Aborted("token id collision; retry".into()));
        }
        tracing::info!(token = %id, "peering token created");
        Ok((id, secret, t))
    }

    /// Records a negotiated peering with `peer_site`, planning this site's
    /// local views of its CIDRs. With `proof`, the peering token is checked
    /// and consumed in the same transaction. Its tunnel listens on `port`,
    /// the port this site told the peer, unless another peering took that
    /// port meanwhile (then the lowest free one, which the peer learns over
    /// its subscription).
    pub async fn negotiated(
        &self,
        peer_site: &str,
        remote: RemoteSite,
        proof: Option<&TokenProof>,
        port: u16,
        transit: bool,
    ) -> Result<Peering, Error> {
        validate_name("the peer site id", peer_site).map_err(Error::InvalidArgument)?;
        let key = self.at(Key::Peering(peer_site));
        // An IPv6-only peer sends only IPv6 ones.
        if remote.workload_cidrs.is_empty() && remote.workload_cidrs_v6.is_empty() {
            return Err(Error::InvalidArgument(match &remote.ipv6_invalid {
                Some(why) => {
                    format!("site {peer_site:?} sent no usable workload CIDR: its IPv6 ones are refused: {why}")
                }
                None => format!("site {peer_site:?} sent no workload CIDR"),
            }));
        }
        self.commit(|snap| {
            let site = snap.site()?;
            if site.id == peer_site {
                return Err(Error::InvalidArgument(format!(
                    "{peer_site:?} is this site's own id; a site cannot peer with itself"
                )));
            }
            if let Some((p, rev)) = snap.peerings.iter().find(|(p, _)| p.site_id == peer_site) {
                return match &p.remote {
                    // The same peer joining again before it confirmed the
                    // peering: it did not get (or wait for) the first
                    // answer. It records its side once it has this one:
                    // give it the few seconds again.
                    Some(r)
                        if r.ca_fingerprint == remote.ca_fingerprint && proof.is_some() && p.joined_with.is_some() =>
                    {
                        let mut again = p.clone();
                        again.joined_at_ms = now_ms();
                        let txn = Txn::new()
                            .when(Compare::ModRevision(key.clone(), *rev))
                            .then(Op::put(key.clone(), encode(&again)));
                        Ok((Some(txn), again))
                    }
                    Some(r) if r.ca_fingerprint == remote.ca_fingerprint => Ok((None, p.clone())),
                    _ => Err(Error::AlreadyExists(format!(
                        "a site {peer_site:?} with another CA is already peered; delete that peering first \
                         (`weftctl peering delete {peer_site}`)"
                    ))),
                };
            }
            // A site id picked to hash like a peer's would share that
            // peering's links (or namespace) on the gateways.
            let tag = crate::render::peer_link_tag(peer_site);
            let ns = crate::render::peering_namespace(&site.id, peer_site);
            if let Some((other, _)) = snap.peerings.iter().find(|(p, _)| {
                crate::render::peer_link_tag(&p.site_id) == tag
                    || crate::render::peering_namespace(&site.id, &p.site_id) == ns
            }) {
                return Err(Error::InvalidArgument(format!(
                    "site_id: {peer_site:?} would share the gateways' links or namespace with the peering with \
                     {:?} (the ids hash alike); this site cannot peer with both",
                    other.site_id
                )));
            }
            let mut txn = Txn::new();
            let mut joined_with = None;
            if let Some(proof) = proof {
                let now = now_ms();
                let Some((t, rev)) = snap.peer_tokens.iter().find(|(t, _)| t.id == proof.id) else {
                    return Err(Error::Unauthenticated(
                        "the peering token is unknown or already used; ask the other site for a new one".into(),
                    ));
                };
                if t.secret_sha256 != sha256_hex(&proof.secret) {
                    return Err(Error::Unauthenticated("the peering token's secret is wrong".into()));
                }
                if t.expires_at_ms <= now {
                    return Err(Error::Unauthenticated(
                        "the peering token has expired; ask the other site for a new one".into(),
                    ));
                }
                if let Some(only) = t.for_site.as_deref().filter(|only| *only != peer_site) {
                    return Err(Error::PermissionDenied(format!(
                        "this peering token is for site {only:?}, not {peer_site:?}; ask for a token made for your site"
                    )));
                }
                let tkey = self.at(Key::PeerToken(&t.id));
                txn = txn
                    .when(Compare::ModRevision(tkey.clone(), *rev))
                    .then(Op::delete(tkey));
                joined_with = Some(t.clone());
            }
            super::views::check_shared_family(site, peer_site, &remote)?;
            let views = self.plan_peer_views(snap, site, peer_site, &remote)?;
            let ipv6 = super::ipv6::plan(snap, site, peer_site, &remote, None);
            let (views_v6, ipv6_refused) = (ipv6.views, ipv6.refused);
            // Its only family refused as planned: nothing would be routed.
            if views.is_empty() && views_v6.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "nothing of site {peer_site:?} can be routed: {}",
                    ipv6_refused
                        .as_deref()
                        .unwrap_or("no view of its CIDRs could be planned")
                )));
            }
            let mut peering = Peering {
                site_id: peer_site.to_string(),
                state: PeeringState::Negotiated,
                views,
                created_at_ms: now_ms(),
                last_error: None,
                remote: Some(remote.clone()),
                listen_port: snap.wg_port(peer_site, Some(port))?,
                pending: None,
                joined_at_ms: if joined_with.is_some() { now_ms() } else { 0 },
                relay_ports: Default::default(),
                relay_via: None,
                export: None,
                transit,
                transit_views: vec![],
                transit_views_v6: vec![],
                joined_with,
                views_v6,
                ipv6_refused,
                pending_v6: None,
            };
            peering.transit_views = Self::plan_transit(snap, site, &peering, &remote, &[]);
            peering.transit_views_v6 = super::ipv6::plan_transit(snap, site, &peering, &remote);
            // A transit view whose block this peering took moves off it.
            let own: Vec<Ipv4Net> = peering.transit_views.iter().map(|t| t.view.local).collect();
            let moved = Self::transit_off_direct(snap, site, peer_site, &[], &peering.views, &own);
            let txn = self
                .put_peerings(self.ipam_guard(snap, txn), moved)
                .when(Compare::Version(key.clone(), 0))
                .then(Op::put(key.clone(), encode(&peering)));
            Ok((Some(txn), peering))
        })
        .await
    }

    /// Checks a peering token without consuming it (the transaction that
    /// records the peering checks it again and consumes it).
    pub async fn check_peer_token(&self, proof: &TokenProof, peer_site: &str) -> Result<(), Error> {
        let bad = || Error::Unauthenticated("the peering token is unknown, used or expired; ask for a new one".into());
        if proof.id.len() > 64 || !proof.id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        let Some(kv) = self.store.get(&self.at(Key::PeerToken(&proof.id))).await? else {
            return Err(bad());
        };
        let t: PeerToken = super::decode(&kv)?;
        if t.secret_sha256 != sha256_hex(&proof.secret) || t.expires_at_ms <= now_ms() {
            return Err(bad());
        }
        if let Some(only) = t.for_site.as_deref().filter(|only| *only != peer_site) {
            return Err(Error::PermissionDenied(format!(
                "this peering token is for site {only:?}, not {peer_site:?}; ask for a token made for your site"
            )));
        }
        Ok(())
    }

    /// The peer showed it holds its side of the peering (its subscription
    /// answered): the token it joined with is spent for good.
    pub async fn peering_confirmed(&self, peer_site: &str) -> Result<(), Error> {
        let key = self.at(Key::Peering(peer_site));
        self.commit(|snap| {
            let Some((p, rev)) = snap.peerings.iter().find(|(p, _)| p.site_id == peer_site) else {
                return Ok((None, ()));
            };
            if p.joined_with.is_none() {
                return Ok((None, ()));
            }
            let mut next = p.clone();
            next.joined_with = None;
            let txn = Txn::new()
                .when(Compare::ModRevision(key.clone(), *rev))
                .then(Op::put(key.clone(), encode(&next)));
            Ok((Some(txn), ()))
        })
        .await
    }

    /// The peering with `site`, if any.
    pub async fn peering(&self, site: &str) -> Result<Option<Peering>, Error> {
        validate_name("the peer site id", site).map_err(Error::InvalidArgument)?;
        match self.store.get(&self.at(Key::Peering(site))).await? {
            Some(kv) => Ok(Some(super::decode(&kv)?)),
            None => Ok(None),
        }
    }
}

impl State {
    /// Takes in a peer's new parameters: keeps the peering, updates what the
    /// peer said, and re-plans the local views only if its CIDRs changed.
    /// Returns whether anything changed.
    pub async fn update_remote(&self, peer_site: &str, remote: RemoteSite) -> Result<bool, Error> {
        let key = self.at(Key::Peering(peer_site));
        self.commit(|snap| {
            let site = snap.site()?;
            let (p, rev) = snap.peering(peer_site)?;
            let Some(old) = &p.remote else { return Ok((None, false)) };
            // A peer rotating its CA sends the new one first with the
            // one pinned here still among them; then, finishing, the new
            // one alone.
            if !may_move_ca(old, &remote) {
                return Err(Error::PermissionDenied(format!(
                    "site {peer_site:?} sent parameters under another CA than a rotation of the ones trusted \
                     here; if it retired its CA, set the new one with `weftctl peering set-ca {peer_site} FILE`"
                )));
            }
            if old.ca_fingerprint != remote.ca_fingerprint {
                tracing::info!(peer = %peer_site, old = %old.ca_fingerprint, new = %remote.ca_fingerprint, "the peer rotates its CA; trusting its new one");
            }
            // Every update, whatever else changed: no candidate on this
            // site's hosts.
            check_candidates(&snap.endpoint_hosts(site), &remote)?;
            let mut next = p.clone();
            let mut remote = remote.clone();
            // A site without IPv4 pods routes none of the peer's IPv4: it
            // keeps the record as agreed and holds nothing (as a site
            // without IPv6 does with IPv6). Once it adds IPv4 pods it plans
            // its views of what was agreed; a change since is then held.
            let no_v4 = site.pod_cidrs.is_empty();
            if no_v4 {
                (remote.workload_cidrs, remote.external_cidr) = (old.workload_cidrs.clone(), old.external_cidr);
            }
            let changed = old.workload_cidrs != remote.workload_cidrs || old.external_cidr != remote.external_cidr;
            let unplanned = !changed && !no_v4 && p.views.is_empty() && !remote.workload_cidrs.is_empty();
            // Bounds apply to what is new; CIDRs already routed stay fine.
            let known: Vec<Ipv4Net> = old.workload_cidrs.iter().copied().chain(old.external_cidr).collect();
            let acceptable =
                |c: &Ipv4Net| known.contains(c) || site.peer_cidr_auto_accept.iter().any(|b| b.contains(c));
            let auto = unplanned
                || changed && remote.workload_cidrs.iter().all(acceptable) && remote.external_cidr.iter().all(acceptable);
            // Within bounds, but refused as planned (over this site's hosts):
            // held for the admin like any other change.
            let planned = if auto {
                match self.plan_peer_views(snap, site, peer_site, &remote) {
                    Ok(v) => Some(v),
                    // The rest of the update still stands.
                    Err(e) if unplanned => {
                        tracing::warn!(peer = %peer_site, error = %e, "no IPv4 views of the peer after adding IPv4 pods");
                        None
                    }
                    Err(Error::InvalidArgument(_)) => None,
                    Err(e) => return Err(e),
                }
            } else {
                None
            };
            if changed && planned.is_none() {
                // What this site routes changes only when an admin says so:
                // keep routing the recorded CIDRs, take in the rest (keys,
                // endpoints, gateways), and hold the change for review.
                let held = PendingCidrs {
                    workload_cidrs: remote.workload_cidrs.clone(),
                    external_cidr: remote.external_cidr,
                    received_at_ms: p.pending.as_ref().map_or_else(now_ms, |q| q.received_at_ms),
                };
                if p.pending
                    .as_ref()
                    .is_none_or(|q| (&q.workload_cidrs, q.external_cidr) != (&held.workload_cidrs, held.external_cidr))
                {
                    tracing::warn!(
                        peer = %peer_site,
                        cidrs = ?held.workload_cidrs,
                        external = ?held.external_cidr,
                        "the peer announced other CIDRs; held until an admin runs `weftctl peering accept {peer_site}`"
                    );
                }
                next.pending = Some(held);
                remote.workload_cidrs = old.workload_cidrs.clone();
                remote.external_cidr = old.external_cidr;
            } else {
                next.pending = None;
                if let Some(views) = planned {
                    next.views = views;
                }
            }
            let ipv6 = super::ipv6::plan(snap, site, peer_site, &remote, Some(p));
            if ipv6.held.is_some() && ipv6.held != p.pending_v6 {
                tracing::warn!(
                    peer = %peer_site,
                    cidrs = ?remote.workload_cidrs_v6,
                    external = ?remote.external_cidr_v6,
                    "the peer announced other IPv6 CIDRs; held until an admin runs `weftctl peering accept {peer_site}`"
                );
            }
            (next.views_v6, next.ipv6_refused, next.pending_v6) = (ipv6.views, ipv6.refused, ipv6.held);
            (remote.workload_cidrs_v6, remote.external_cidr_v6) = ipv6.recorded;
            next.transit_views = Self::plan_transit(snap, site, &next, &remote, &[]);
            next.transit_views_v6 = super::ipv6::plan_transit(snap, site, &next, &remote);
            next.remote = Some(remote);
            let own: Vec<Ipv4Net> = next.transit_views.iter().map(|t| t.view.local).collect();
            let moved = Self::transit_off_direct(snap, site, peer_site, &p.views, &next.views, &own);
            if next == *p && moved.is_empty() {
                return Ok((None, false));
            }
            let txn = self
                .put_peerings(self.ipam_guard(snap, Txn::new()), moved)
                .when(Compare::ModRevision(key.clone(), *rev))
                .then(Op::put(key.clone(), encode(&next)));
            // What the peer says of its readiness is written, but is not a
            // change of its parameters.
            Ok((Some(txn), !next.same_but_readiness(p)))
        })
        .await
    }

    /// Records peering `peer_site`'s relay fields (see [`Peering::relay_ports`]
    /// and [`Peering::relay_via`]): `ports` when given, `via` when given.
    /// A write only when something changed; NOT_FOUND without the peering.
    pub async fn set_relay(
        &self,
        peer_site: &str,
        ports: Option<std::collections::BTreeMap<String, u16>>,
        via: Option<Option<crate::domain::RelayVia>>,
    ) -> Result<bool, Error> {
        let key = self.at(Key::Peering(peer_site));
        self.commit(|snap| {
            let (p, rev) = snap.peering(peer_site)?;
            let mut next = p.clone();
            if let Some(ports) = &ports {
                next.relay_ports = ports.clone();
            }
            if let Some(via) = &via {
                next.relay_via = via.clone();
            }
            if next == *p {
                return Ok((None, false));
            }
            let txn = Txn::new()
                .when(Compare::ModRevision(key.clone(), *rev))
                .then(Op::put(key.clone(), encode(&next)));
            Ok((Some(txn), true))
        })
        .await
    }

    /// Routes the CIDRs a peer announced and this site held: plans the
    /// local views of them and clears the hold. NOT_FOUND without such a
    /// peering, FAILED_PRECONDITION when nothing is held.
    pub async fn accept_peer_update(&self, peer_site: &str) -> Result<Peering, Error> {
        validate_name("the peer site id", peer_site).map_err(Error::InvalidArgument)?;
        let key = self.at(Key::Peering(peer_site));
        self.commit(|snap| {
            let site = snap.site()?;
            let (p, rev) = snap.peering(peer_site)?;
            if p.remote.is_none() || (p.pending.is_none() && p.pending_v6.is_none()) {
                return Err(Error::FailedPrecondition(format!(
                    "site {peer_site:?} has announced no change to accept"
                )));
            }
            let mut next = p.clone();
            // IPv6 first: its checks see this site as it is. What fails
            // there stays held (and is said) without costing the IPv4
            // change its acceptance.
            if let Some(held) = &p.pending_v6 {
                match super::ipv6::accept(snap, site, p, held) {
                    Ok((remote, views)) => {
                        (next.remote, next.views_v6) = (Some(remote), views);
                        (next.ipv6_refused, next.pending_v6) = (None, None);
                    }
                    Err(why) => {
                        let e = format!("the IPv6 CIDRs {peer_site} announced cannot be routed: {why}");
                        if p.pending.is_none() {
                            return Err(Error::FailedPrecondition(e));
                        }
                        tracing::warn!(peer = %peer_site, "{e}; its IPv4 change is accepted, its IPv6 one stays held");
                    }
                }
            }
            if let (Some(held), Some(old)) = (&p.pending, &next.remote) {
                let mut remote = old.clone();
                remote.workload_cidrs = held.workload_cidrs.clone();
                remote.external_cidr = held.external_cidr;
                next.views = self.plan_peer_views(snap, site, peer_site, &remote)?;
                next.remote = Some(remote);
                next.pending = None;
            }
            let moved = Self::transit_off_direct(snap, site, peer_site, &p.views, &next.views, &[]);
            let txn = self
                .put_peerings(self.ipam_guard(snap, Txn::new()), moved)
                .when(Compare::ModRevision(key.clone(), *rev))
                .then(Op::put(key.clone(), encode(&next)));
            tracing::info!(peer = %peer_site, "the peer's announced CIDRs were accepted");
            Ok((Some(txn), next))
        })
        .await
    }

    /// Trusts the CAs in `ca_pem` for peer `peer_site` from now on, in
    /// place of those held: after it retired its CA at once, which it
    /// cannot tell this site over the peering (the admin checks the new
    /// CA's fingerprint with the peer's admin).
    pub async fn set_peer_ca(&self, peer_site: &str, ca_pem: &str) -> Result<Peering, Error> {
        validate_name("the peer site id", peer_site).map_err(Error::InvalidArgument)?;
        let cas = weft_common::tls::checked_cas(ca_pem)
            .map_err(|e| Error::InvalidArgument(format!("ca_pem: {e:#}")))?
            .ok_or_else(|| Error::InvalidArgument("ca_pem is empty; give the peer site's pki/ca.pem".into()))?;
        let fingerprint = {
            use rustls_pki_types::pem::PemObject;
            let first = rustls_pki_types::CertificateDer::from_pem_slice(cas.as_bytes())
                .map_err(|e| Error::InvalidArgument(format!("ca_pem: {e}")))?;
            weft_common::fingerprint(&first)
        };
        let key = self.at(Key::Peering(peer_site));
        self.commit(|snap| {
            let (p, rev) = snap.peering(peer_site)?;
            let Some(old) = &p.remote else {
                return Err(Error::FailedPrecondition(format!(
                    "the peering with {peer_site:?} is not negotiated yet: it has no CA to replace"
                )));
            };
            let mut next = p.clone();
            let remote = next.remote.as_mut().expect("checked above");
            remote.ca_pem = cas.clone();
            remote.ca_fingerprint = fingerprint.clone();
            tracing::warn!(peer = %peer_site, old = %old.ca_fingerprint, new = %fingerprint, "the admin set the peer's CA");
            let txn = Txn::new()
                .when(Compare::ModRevision(key.clone(), *rev))
                .then(Op::put(key.clone(), encode(&next)));
            Ok((Some(txn), next))
        })
        .await
    }
}

/// Whether a peer trusted here by the CAs of `held` may now be trusted by
/// those of `remote` (which came over a stream `held` verified): the same
/// CAs; the newest of them alone (a rotation finished); or, from a single
/// CA P, a rotation's start: a new CA first and P after it. Anything else
/// is refused, and the peer's admin sets it by hand: back to the older of
/// two (a replica there not yet restarted, or whoever holds that older
/// key), or a new CA while two are held.
fn may_move_ca(held: &RemoteSite, remote: &RemoteSite) -> bool {
    let (had, has) = (ca_fingerprints(&held.ca_pem), ca_fingerprints(&remote.ca_pem));
    match (had.as_slice(), has.as_slice()) {
        (_, []) | ([], _) => false,
        _ if has == had => true,
        ([newest, ..], [only]) => only == newest,
        ([pinned], [_, after]) => after == pinned,
        _ => false,
    }
}

/// The fingerprints of the certificates in `pem`, in order.
fn ca_fingerprints(pem: &str) -> Vec<String> {
    use rustls_pki_types::pem::PemObject;
    rustls_pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
        .flatten()
        .map(|d| weft_common::fingerprint(&d))
        .collect()
}

#[cfg(test)]
mod ca_tests {
    use super::*;

    #[test]
    fn a_peer_moves_to_a_new_ca_only_by_a_rotation_from_a_single_one() {
        let d = tempfile::tempdir().unwrap();
        let first = crate::pki::ensure(d.path(), "p", &[]).unwrap().ca;
        crate::pki::rotate(d.path(), "p", false).unwrap();
        let both = crate::pki::SiteCa::load(d.path()).unwrap();
        let remote = |ca: &crate::pki::SiteCa| -> RemoteSite {
            serde_json::from_value(serde_json::json!({
                "ca_pem": ca.pem, "ca_fingerprint": ca.fingerprint, "workload_cidrs": ["10.9.0.0/16"],
                "external_cidr": null, "gateways": [], "mtu": 0, "endpoints": [], "tunnel_role": "server",
            }))
            .unwrap()
        };
        assert!(may_move_ca(&remote(&first), &remote(&first)));
        assert!(may_move_ca(&remote(&first), &remote(&both)), "the rotation's start");
        assert!(may_move_ca(&remote(&both), &remote(&both)));
        crate::pki::finish(d.path()).unwrap();
        let done = crate::pki::SiteCa::load(d.path()).unwrap();
        assert!(
            may_move_ca(&remote(&both), &remote(&done)),
            "finished: the newest alone"
        );
        assert!(!may_move_ca(&remote(&both), &remote(&first)), "back to the older one");
        assert!(
            !may_move_ca(&remote(&first), &remote(&done)),
            "a new CA alone, never seen with the held one"
        );
        let other = crate::pki::ensure(&d.path().join("other"), "q", &[]).unwrap().ca;
        assert!(!may_move_ca(&remote(&first), &remote(&other)));
        // While two are held, whoever holds the older one cannot bring in
        // a third, even beside the newer one.
        let mut forged = remote(&other);
        forged.ca_pem = format!("{}{}", other.pem, crate::pki::pem_of(&both.der));
        assert!(!may_move_ca(&remote(&both), &forged));
        forged.ca_pem = format!("{}{}", other.pem, crate::pki::pem_of(&first.der));
        assert!(!may_move_ca(&remote(&both), &forged));
    }
}
