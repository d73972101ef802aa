//! Who is calling, and may they.
//!
//! TCP listeners run TLS with [`DeferredClientVerifier`]: the handshake asks
//! for a client certificate and checks that the client holds its key, but
//! accepts any certificate (or none). Each call is then authenticated here:
//! the chain must lead to the site CA, be current, name this site and not be
//! revoked. Doing it per call rather than in the handshake gives callers a
//! gRPC status with a message (`UNAUTHENTICATED` for no, foreign, expired or
//! revoked certificates; `PERMISSION_DENIED` for a role that may not make
//! the call) instead of a bare TLS alert, lets `AgentService/Register` be
//! reached with no certificate at all, and lets a revocation take effect on
//! the next call of an open connection.
//!
//! The handshake's certificate still decides how the connection is held
//! ([`Authenticator::is_known`]): only a chain that verifies against the
//! site CA (and is not revoked) or against the CA of a recorded peering
//! makes it a *known* connection, exempt from the caps for connections
//! without a certificate (`admission.rs`). Any other certificate (self-
//! signed, a foreign CA, expired, revoked) counts as none at all.
//!
//! Identities are URI SANs `weft://<site>/<role>/<name>`. Calls on the local
//! admin socket (mode 0600) are the local administrator.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use tonic::transport::server::UdsConnectInfo;
use tonic::{Request, Status};

mod identity;
pub(crate) use identity::hex_serial;
use identity::identity_until;
pub use identity::{Identity, Role, identity_of};

/// Who made a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    /// Over the local admin socket.
    Local,
    Remote(Identity),
}

/// Accepts any client certificate in the handshake (still checking the
/// handshake signature, i.e. key possession); see the module docs.
#[derive(Debug)]
pub struct DeferredClientVerifier {
    inner: Arc<dyn ClientCertVerifier>,
}

impl DeferredClientVerifier {
    pub fn new(inner: Arc<dyn ClientCertVerifier>) -> Self {
        Self { inner }
    }
}

impl ClientCertVerifier for DeferredClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }
    fn client_auth_mandatory(&self) -> bool {
        false
    }
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }
    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        Ok(ClientCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Why a certificate was revoked, as far as a caller holding it is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RevokedAs {
    /// The admin removed its agent: the agent removes what it applied.
    Removed,
    /// A renewal replaced it: a call from it is a second holder's.
    Superseded { issued_at_ms: u64 },
    /// Anything else (an identity conflict, a rotated admin bundle).
    Other,
}

impl RevokedAs {
    pub fn of(r: &crate::domain::Revoked) -> RevokedAs {
        if r.removed {
            RevokedAs::Removed
        } else if r.superseded {
            RevokedAs::Superseded {
                issued_at_ms: r.issued_at_ms,
            }
        } else {
            RevokedAs::Other
        }
    }
}

/// A revoked serial: why, and when its certificate ends (ms since the
/// epoch; `u64::MAX` while only this replica's own revocation told it,
/// until the store's record does).
#[derive(Clone, Copy, Debug)]
struct RevokedEntry {
    why: RevokedAs,
    not_after_ms: u64,
}

impl RevokedEntry {
    fn of(r: &crate::domain::Revoked) -> RevokedEntry {
        RevokedEntry {
            why: RevokedAs::of(r),
            not_after_ms: r.not_after_ms,
        }
    }
}

/// Verifies callers against the site CA and the revocation list.
pub struct Authenticator {
    site: String,
    verifier: Arc<dyn ClientCertVerifier>,
    /// Revoked serials, each with why and until when.
    revoked: RwLock<HashMap<String, RevokedEntry>>,
    /// Where calls from superseded certificates are told (see
    /// [`Authenticator::on_superseded`]).
    superseded: Mutex<Option<tokio::sync::mpsc::Sender<(Identity, u64)>>>,
    /// Verifiers for recorded peers' CAs, by CA fingerprint (built once
    /// each; see [`Authenticator::is_known`]).
    peer_verifiers: Mutex<HashMap<String, Arc<dyn ClientCertVerifier>>>,
    /// Leaf certificates that verified against the site CA, by the
    /// SHA-256 of their DER: the identity in each and until when that
    /// verdict is reused. Every call is authenticated, and an agent's
    /// heartbeat must not cost a signature check each time.
    /// Pruned by [`prune_lapsed`] every [`VERIFIED_FOR`] / 2, with when
    /// it last was (ms since the epoch).
    verified: Mutex<(HashMap<[u8; 32], Verified>, u64)>,
}

/// A leaf certificate's verdict, reused until `until`.
struct Verified {
    id: Identity,
    /// The earlier of the certificate's end and [`VERIFIED_FOR`] after
    /// it was checked.
    until: std::time::SystemTime,
}

/// How long a verified certificate is taken as verified before its
/// signature and chain are checked again.
const VERIFIED_FOR: std::time::Duration = std::time::Duration::from_secs(300);

/// How many verified certificates are kept (two per agent during a
/// renewal, for 50,000 agents and more); when full, the lapsed ones go,
/// and if none did, all.
const VERIFIED_KEPT: usize = 262_144;

/// Drops `map`'s lapsed entries once the last pruning (at `pruned_ms`)
/// is `every_ms` old, or the clock went back; empties it when `kept`
/// entries remain. A cache so holds what lapses within about `every_ms`
/// more than its live entries, and its table stays at the size that
/// needs, under any churn (a size-triggered pruning let it double in
/// steps as newcomers came: half a MiB at a time under churn).
fn prune_lapsed<K: Eq + std::hash::Hash, V>(
    map: &mut HashMap<K, V>,
    (now_ms, pruned_ms, every_ms): (u64, &mut u64, u64),
    lapsed: impl Fn(&V) -> bool,
    kept: usize,
) {
    if map.len() < kept && now_ms >= *pruned_ms && now_ms - *pruned_ms < every_ms {
        return;
    }
    *pruned_ms = now_ms;
    map.retain(|_, v| !lapsed(v));
    if map.len() >= kept {
        map.clear();
    }
}

/// How many peer CA verifiers are kept before the cache is emptied (peers'
/// CAs change rarely; a site has far fewer peerings).
const PEER_VERIFIERS_KEPT: usize = 1024;

/// A client verifier trusting `cas` (none is an error).
pub fn verifier_of<'a>(
    cas: impl IntoIterator<Item = CertificateDer<'a>>,
) -> anyhow::Result<Arc<dyn ClientCertVerifier>> {
    let mut roots = rustls::RootCertStore::empty();
    for c in cas {
        roots.add(c.into_owned())?;
    }
    if roots.is_empty() {
        anyhow::bail!("no CA certificate");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider).build()?)
}

fn describe(e: &rustls::Error) -> String {
    use rustls::CertificateError as C;
    match e {
        rustls::Error::InvalidCertificate(C::Expired | C::ExpiredContext { .. }) => {
            "the client certificate has expired; an agent renews it before expiry, so enroll this one again".into()
        }
        rustls::Error::InvalidCertificate(C::NotValidYet | C::NotValidYetContext { .. }) => {
            "the client certificate is not valid yet; check the clocks".into()
        }
        rustls::Error::InvalidCertificate(C::UnknownIssuer) => {
            "the client certificate was not issued by a CA this site trusts: a foreign CA, or one the site \
             retired after a CA rotation (an agent then enrolls again with a new token; an admin takes the \
             current admin.pem and admin.key from a controller's pki directory)"
                .into()
        }
        rustls::Error::InvalidCertificate(C::BadSignature) => "the client certificate's signature is invalid".into(),
        other => format!("the client certificate is not acceptable: {other}"),
    }
}

impl Authenticator {
    /// Trusts the site CAs `cas` (DER; during a rotation the new CA and
    /// the old one).
    pub fn new(site: &str, cas: &[Vec<u8>]) -> anyhow::Result<Arc<Self>> {
        let verifier = verifier_of(cas.iter().map(|d| CertificateDer::from(d.clone())))?;
        Ok(Arc::new(Self {
            site: site.to_string(),
            verifier,
            revoked: RwLock::new(HashMap::new()),
            superseded: Mutex::new(None),
            peer_verifiers: Mutex::new(HashMap::new()),
            verified: Mutex::new((HashMap::new(), 0)),
        }))
    }

    /// The site-CA verifier itself.
    pub fn verifier(&self) -> &Arc<dyn ClientCertVerifier> {
        &self.verifier
    }

    /// The verifier for the TLS handshake.
    pub fn handshake_verifier(&self) -> Arc<dyn ClientCertVerifier> {
        Arc::new(DeferredClientVerifier::new(self.verifier.clone()))
    }

    /// Replaces the revoked set with the store's records.
    pub fn set_revoked<'a>(&self, records: impl IntoIterator<Item = &'a crate::domain::Revoked>) {
        *self.revoked.write().unwrap() = records
            .into_iter()
            .map(|r| (r.serial.clone(), RevokedEntry::of(r)))
            .collect();
    }

    /// Revokes `serial`, saying why, at once (this replica revoked it;
    /// the store's record, through [`Authenticator::revoked_record`], says
    /// until when).
    pub fn revoke(&self, serial: String, why: RevokedAs) {
        self.revoked
            .write()
            .unwrap()
            .entry(serial)
            .and_modify(|e| e.why = why)
            .or_insert(RevokedEntry {
                why,
                not_after_ms: u64::MAX,
            });
    }

    /// Takes in a revocation record of the store.
    pub fn revoked_record(&self, r: &crate::domain::Revoked) {
        self.revoked
            .write()
            .unwrap()
            .insert(r.serial.clone(), RevokedEntry::of(r));
    }

    /// The revoked serials whose certificate ended at or before
    /// `cutoff_ms`: the ones whose records may leave the store (read from
    /// memory, not from the store: a read of every revocation, under
    /// churn, raised the controller's memory by megabytes at each pass).
    pub fn lapsed_revocations(&self, cutoff_ms: u64) -> Vec<String> {
        self.revoked
            .read()
            .unwrap()
            .iter()
            .filter(|(_, e)| e.not_after_ms <= cutoff_ms)
            .map(|(s, _)| s.clone())
            .collect()
    }

    /// Forgets `serial`'s revocation: its record left the store (its
    /// certificate expired, refused as expired from then on).
    pub fn forget_revoked(&self, serial: &str) {
        self.revoked.write().unwrap().remove(serial);
    }

    pub fn is_revoked(&self, serial: &str) -> bool {
        self.revoked.read().unwrap().contains_key(serial)
    }

    /// Calls made with a certificate that a renewal replaced go to `tx`:
    /// its holder moved on to the newer one, so such a call is a second
    /// holder's (the controller then revokes the whole identity).
    /// (The identity, and when its certificate was issued.)
    pub fn on_superseded(&self, tx: tokio::sync::mpsc::Sender<(Identity, u64)>) {
        *self.superseded.lock().unwrap() = Some(tx);
    }

    /// Whether a connection that presented `chain` in its handshake is
    /// known: the chain verifies against the site CA and is not revoked,
    /// or it names another site and verifies against the CA of this
    /// site's recorded peering with it (`peer_ca(site)`: the PEM of the
    /// CAs trusted for that site). Anything else, including no chain, is
    /// not.
    pub fn is_known(&self, chain: &[CertificateDer<'static>], peer_ca: impl Fn(&str) -> Option<String>) -> bool {
        use rustls::pki_types::pem::PemObject;
        let Some((leaf, rest)) = chain.split_first() else {
            return false;
        };
        let Ok(id) = identity_of(leaf) else { return false };
        if id.site == self.site {
            return self.verifier.verify_client_cert(leaf, rest, UnixTime::now()).is_ok()
                && !self.is_revoked(&id.serial);
        }
        if id.role != Role::Site || id.name != id.site {
            return false;
        }
        let Some(pem) = peer_ca(&id.site) else {
            return false;
        };
        // Cached by the whole PEM: a peer rotating its CA is trusted by
        // two under one signing fingerprint, then by one.
        let key = weft_common::fingerprint(pem.as_bytes());
        let cached = self.peer_verifiers.lock().unwrap().get(&key).cloned();
        let verifier = match cached {
            Some(v) => v,
            None => {
                let Ok(cas) = CertificateDer::pem_slice_iter(pem.as_bytes()).collect::<Result<Vec<_>, _>>() else {
                    return false;
                };
                let Ok(v) = verifier_of(cas) else {
                    return false;
                };
                let mut cache = self.peer_verifiers.lock().unwrap();
                if cache.len() >= PEER_VERIFIERS_KEPT {
                    cache.clear();
                }
                cache.insert(key, v.clone());
                v
            }
        };
        verifier.verify_client_cert(leaf, rest, UnixTime::now()).is_ok()
    }

    /// Verifies a presented chain and extracts its identity.
    pub fn verify(&self, certs: &[CertificateDer<'static>]) -> Result<Identity, Status> {
        let Some((ee, rest)) = certs.split_first() else {
            return Err(Status::unauthenticated("no client certificate was presented"));
        };
        let id = self.verified_identity(ee, rest)?;
        if id.site != self.site {
            return Err(Status::unauthenticated(format!(
                "the client certificate is for site {:?}, this is {:?}",
                id.site, self.site
            )));
        }
        self.check_revocation(&id)?;
        Ok(id)
    }

    /// Refuses an identity whose certificate was revoked, saying why (a
    /// long-lived stream asks again for each message it reads).
    pub fn check_revocation(&self, id: &Identity) -> Result<(), Status> {
        let why = self.revoked.read().unwrap().get(&id.serial).map(|e| e.why);
        match why {
            None => Ok(()),
            // An agent that was away when the admin removed it learns it
            // here, on its first call back.
            Some(RevokedAs::Removed) => Err(removed(format!(
                "{id} has been removed by the admin and its certificate revoked; enroll it again with a new token"
            ))),
            Some(RevokedAs::Superseded { issued_at_ms }) => {
                if let Some(tx) = self.superseded.lock().unwrap().as_ref() {
                    // Full: the controller is already revoking this (or
                    // another) identity; the next call tells it again.
                    let _ = tx.try_send((id.clone(), issued_at_ms));
                }
                Err(Status::unauthenticated(format!(
                    "the certificate of {id} was replaced by a renewal that its holder did not make: another host \
                     holds this identity (a copied key and certificate). Every certificate of the name is revoked; \
                     the admin must enroll the real host again with a new token"
                )))
            }
            Some(RevokedAs::Other) => Err(Status::unauthenticated(match id.role {
                Role::Admin => format!(
                    "the certificate of {id} was revoked (the admin bundle was rotated); use the current \
                     admin.pem and admin.key from the controller's pki directory"
                ),
                _ => format!(
                    "the certificate of {id} was revoked (the {} was removed, or its identity was renewed from \
                     a superseded certificate); enroll it again with a new token",
                    id.role.as_str()
                ),
            })),
        }
    }

    /// The identity in leaf `ee` once it verifies against the site CA
    /// (with intermediates `rest`): checked in full the first time, then
    /// taken from [`Authenticator::verified`] while the verdict holds.
    /// The result depends only on the leaf's bytes, the fixed site CA and
    /// the time, which `until` bounds; revocation is checked by the caller
    /// on every call.
    fn verified_identity(&self, ee: &CertificateDer<'_>, rest: &[CertificateDer<'_>]) -> Result<Identity, Status> {
        let digest: [u8; 32] = ring::digest::digest(&ring::digest::SHA256, ee.as_ref())
            .as_ref()
            .try_into()
            .expect("SHA-256 is 32 bytes");
        let now = std::time::SystemTime::now();
        if let Some(v) = self.verified.lock().unwrap().0.get(&digest)
            && now < v.until
        {
            return Ok(v.id.clone());
        }
        self.verifier
            .verify_client_cert(ee, rest, UnixTime::now())
            .map_err(|e| Status::unauthenticated(describe(&e)))?;
        let (id, end) = identity_until(ee).map_err(Status::unauthenticated)?;
        let until = end.min(now + VERIFIED_FOR);
        let (verified, pruned) = &mut *self.verified.lock().unwrap();
        let schedule = (crate::domain::now_ms(), pruned, VERIFIED_FOR.as_millis() as u64 / 2);
        prune_lapsed(verified, schedule, |v| now >= v.until, VERIFIED_KEPT);
        verified.insert(digest, Verified { id: id.clone(), until });
        Ok(id)
    }

    /// Who made `req`: the local socket, a verified certificate, or nobody
    /// (`None`: TLS without a client certificate).
    pub fn caller<T>(&self, req: &Request<T>) -> Result<Option<Caller>, Status> {
        if req.extensions().get::<UdsConnectInfo>().is_some() {
            return Ok(Some(Caller::Local));
        }
        match req.peer_certs() {
            Some(certs) if !certs.is_empty() => Ok(Some(Caller::Remote(self.verify(&certs)?))),
            _ => Ok(None),
        }
    }

    /// An interceptor admitting the local socket and certificates whose role
    /// is in `roles`; it stores the [`Caller`] in the request's extensions.
    pub fn require(
        self: &Arc<Self>,
        roles: &'static [Role],
        what: &'static str,
    ) -> impl tonic::service::Interceptor + Clone + use<> {
        let auth = self.clone();
        move |mut req: Request<()>| {
            let caller = match auth.caller(&req)? {
                None => {
                    return Err(Status::unauthenticated(format!(
                        "{what} needs a client certificate from this site's CA \
                         (weftctl and grpcurl: the admin bundle ca.pem, admin.pem, admin.key in <data-dir>/pki)"
                    )));
                }
                Some(Caller::Remote(id)) if !roles.contains(&id.role) => {
                    return Err(Status::permission_denied(format!("{id} may not use {what}")));
                }
                Some(c) => c,
            };
            req.extensions_mut().insert(caller);
            Ok(req)
        }
    }

    /// An interceptor that authenticates a certificate when one is
    /// presented (refusing a bad one) and lets the handler decide otherwise.
    pub fn optional(self: &Arc<Self>) -> impl tonic::service::Interceptor + Clone + use<> {
        let auth = self.clone();
        move |mut req: Request<()>| {
            if let Some(c) = auth.caller(&req)? {
                req.extensions_mut().insert(c);
            }
            Ok(req)
        }
    }
}

/// The caller an interceptor stored; `None` when the call came without one.
pub fn caller_of<T>(req: &Request<T>) -> Option<&Caller> {
    req.extensions().get::<Caller>()
}

/// The status that tells an agent the admin removed it (see
/// [`weft_proto::REMOVED`]): it then removes what it applied.
pub fn removed(message: String) -> Status {
    let mut s = Status::unauthenticated(message);
    s.metadata_mut()
        .insert(weft_proto::REMOVED, tonic::metadata::MetadataValue::from_static("1"));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The verified-certificate cache's pruning: under churn (entries
    /// that lapse as fast as new ones come) it holds its live entries and
    /// what lapsed since the last pruning, and its table stops growing;
    /// the cap empties it; a clock that went back prunes at once.
    #[test]
    fn a_cache_under_churn_holds_its_live_entries_and_stops_growing() {
        // One entry a ms, each lapsing `LIFE` ms after it came; pruned
        // every `EVERY` ms.
        const LIFE: u64 = 1000;
        const EVERY: u64 = 500;
        let mut map: HashMap<u64, u64> = HashMap::new();
        let mut pruned = 0;
        // The most held, and the table's largest capacity in each half of
        // the run after a warm-up.
        let (mut most, mut capacity) = (0, [0, 0]);
        for t in 0..100 * LIFE {
            prune_lapsed(&mut map, (t, &mut pruned, EVERY), |&born| born + LIFE <= t, usize::MAX);
            map.insert(t, t);
            most = most.max(map.len());
            if t > 10 * LIFE {
                let half = usize::from(t > 55 * LIFE);
                capacity[half] = capacity[half].max(map.capacity());
            }
        }
        assert!(most <= (LIFE + EVERY) as usize, "held {most}");
        assert!(
            capacity[1] <= capacity[0] && capacity[0] < 4 * (LIFE + EVERY) as usize,
            "the table grew under steady churn: {capacity:?}"
        );

        // The cap: emptied at a pruning that leaves that many.
        let mut map: HashMap<u64, ()> = HashMap::new();
        let mut pruned = 0;
        for k in 0..100 {
            prune_lapsed(&mut map, (0, &mut pruned, EVERY), |_| false, 50);
            map.insert(k, ());
            assert!(map.len() <= 50, "{} held", map.len());
        }

        // The clock went back: pruned now.
        let mut map: HashMap<u64, ()> = HashMap::from([(1, ())]);
        let mut pruned = 10_000;
        prune_lapsed(&mut map, (5_000, &mut pruned, EVERY), |_| true, usize::MAX);
        assert!(map.is_empty() && pruned == 5_000);
    }
}
