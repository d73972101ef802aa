//! The agent's identity on disk: its private key (generated here, mode
//! 0600, never sent anywhere), its certificate and the site CA, under the
//! state directory. Enrollment with a token creates them; renewal replaces
//! key and certificate well before expiry.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail};
use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair};
use weft_proto::v1 as pb;
use weft_proto::v1::agent_service_client::AgentServiceClient;

use crate::config::AgentConfig;
use crate::tls::{self, Trust, checked_cas};

pub const KEY_FILE: &str = "agent.key";
pub const CERT_FILE: &str = "agent.pem";
pub const CA_FILE: &str = "ca.pem";
/// The key before the last renewal, kept only while a renewal is written.
pub const PREV_KEY_FILE: &str = "agent.key.prev";
/// SHA-256 of the token the agent last enrolled with: another token given
/// later enrolls it again (see [`IdentityStore::new_token`]).
pub const TOKEN_FILE: &str = "enrolled-token.sha256";

/// Whether the private key belongs to the certificate.
fn key_matches(key_pem: &str, cert_pem: &str) -> bool {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    use x509_parser::prelude::{FromDer, X509Certificate};
    let (Ok(key), Ok(der)) = (
        KeyPair::from_pem(key_pem),
        CertificateDer::from_pem_slice(cert_pem.as_bytes()),
    ) else {
        return false;
    };
    let Ok((_, cert)) = X509Certificate::from_der(&der) else {
        return false;
    };
    cert.public_key().subject_public_key.data.as_ref() == key.public_key_raw()
}

/// Whether the CAs in `cas_pem` include the newest (first) of `held_pem`.
fn keeps_newest(held_pem: &str, cas_pem: &str) -> bool {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let Ok(newest) = CertificateDer::from_pem_slice(held_pem.as_bytes()) else {
        return true;
    };
    CertificateDer::pem_slice_iter(cas_pem.as_bytes())
        .flatten()
        .any(|c| c == newest)
}

/// Whether one of the CAs in `cas_pem` signed the first certificate of
/// `cert_pem`.
fn issued_by_one_of(cert_pem: &str, cas_pem: &str) -> bool {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    use x509_parser::prelude::{FromDer, X509Certificate};
    let Ok(leaf) = CertificateDer::from_pem_slice(cert_pem.as_bytes()) else {
        return false;
    };
    let Ok((_, leaf)) = X509Certificate::from_der(&leaf) else {
        return false;
    };
    CertificateDer::pem_slice_iter(cas_pem.as_bytes()).flatten().any(|ca| {
        X509Certificate::from_der(&ca).is_ok_and(|(_, ca)| leaf.verify_signature(Some(ca.public_key())).is_ok())
    })
}

/// Which agent this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgentKind {
    Node,
    Gateway,
}

impl AgentKind {
    pub fn as_str(self) -> &'static str {
        match self {
            AgentKind::Node => "node",
            AgentKind::Gateway => "gateway",
        }
    }
}

/// Key, certificate and CA, as PEM.
#[derive(Clone)]
pub struct Credentials {
    pub key_pem: String,
    pub cert_pem: String,
    pub ca_pem: String,
    /// When this certificate was received (the file's mtime once stored).
    pub received: SystemTime,
    pub not_after: SystemTime,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

impl Credentials {
    /// When to renew: two thirds of the way from receipt to expiry. (The
    /// controller back-dates `notBefore` a little for clock skew, so the
    /// certificate's own start would renew too early.)
    pub fn renew_at(&self) -> SystemTime {
        let life = self.not_after.duration_since(self.received).unwrap_or_default();
        self.received + life * 2 / 3
    }

    pub fn trust(&self) -> Trust {
        Trust::CaPem(self.ca_pem.clone())
    }
}

/// The certificate's `notAfter`.
fn not_after(cert_pem: &str) -> anyhow::Result<SystemTime> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    use x509_parser::prelude::{FromDer, X509Certificate};
    let der = CertificateDer::from_pem_slice(cert_pem.as_bytes()).context("the certificate is not PEM")?;
    let (_, cert) = X509Certificate::from_der(&der).context("the certificate is unreadable")?;
    Ok(SystemTime::UNIX_EPOCH + Duration::from_secs(cert.validity().not_after.timestamp().max(0) as u64))
}

pub use weft_common::fs::write_file;

/// A fresh key and a CSR for it (the controller decides the identity).
pub fn key_and_csr(name: &str) -> anyhow::Result<(KeyPair, String)> {
    let key = KeyPair::generate()?;
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    p.distinguished_name = dn;
    let csr = p.serialize_request(&key)?.pem()?;
    Ok((key, csr))
}

pub struct IdentityStore {
    dir: PathBuf,
}

impl IdentityStore {
    pub fn new(dir: &Path) -> Self {
        Self { dir: dir.to_path_buf() }
    }

    /// The stored credentials, if the agent has enrolled.
    pub fn load(&self) -> anyhow::Result<Option<Credentials>> {
        let (k, c, a) = (
            self.dir.join(KEY_FILE),
            self.dir.join(CERT_FILE),
            self.dir.join(CA_FILE),
        );
        if !k.exists() || !c.exists() || !a.exists() {
            return Ok(None);
        }
        let read = |p: &Path| std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()));
        let cert_pem = read(&c)?;
        let received = std::fs::metadata(&c)?.modified()?;
        let mut key_pem = read(&k)?;
        if !key_matches(&key_pem, &cert_pem) {
            // Interrupted renewal: the certificate still goes with the old key.
            let prev = self.dir.join(PREV_KEY_FILE);
            match std::fs::read_to_string(&prev) {
                Ok(old) if key_matches(&old, &cert_pem) => {
                    tracing::warn!(
                        "an interrupted renewal left a new key; using the previous one with its certificate"
                    );
                    write_file(&k, &old, 0o600)?;
                    key_pem = old;
                }
                _ => bail!(
                    "{} does not match {}; remove the agent with weftctl and enroll it again",
                    k.display(),
                    c.display()
                ),
            }
        }
        Ok(Some(Credentials {
            key_pem,
            not_after: not_after(&cert_pem)?,
            cert_pem,
            ca_pem: read(&a)?,
            received,
        }))
    }

    fn save(&self, key_pem: &str, cert_pem: &str, ca_pem: &str) -> anyhow::Result<Credentials> {
        std::fs::create_dir_all(&self.dir).with_context(|| format!("cannot create {}", self.dir.display()))?;
        let expires = not_after(cert_pem)?;
        write_file(&self.dir.join(CA_FILE), ca_pem, 0o644)?;
        // The old key is kept until the new certificate is in place: a crash
        // between the two writes leaves a new key with the old certificate,
        // and `load` then pairs the old certificate with the kept key.
        let key_path = self.dir.join(KEY_FILE);
        if key_path.exists() {
            std::fs::copy(&key_path, self.dir.join(PREV_KEY_FILE))?;
        }
        write_file(&key_path, key_pem, 0o600)?;
        write_file(&self.dir.join(CERT_FILE), cert_pem, 0o644)?;
        let _ = std::fs::remove_file(self.dir.join(PREV_KEY_FILE));
        Ok(Credentials {
            key_pem: key_pem.into(),
            cert_pem: cert_pem.into(),
            ca_pem: ca_pem.into(),
            received: SystemTime::now(),
            not_after: expires,
        })
    }

    /// Whether `token` is another one than the agent last enrolled with:
    /// the admin gave it a new token, to enroll again (after the site's CA
    /// was retired with `--revoke-old`, or its certificate expired). An
    /// agent enrolled by an earlier release takes the token it is given as
    /// the one it enrolled with.
    pub fn new_token(&self, token: Option<&str>) -> bool {
        let given = token.map(|t| weft_common::sha256_hex(t.trim().as_bytes()));
        let path = self.dir.join(TOKEN_FILE);
        match (std::fs::read_to_string(&path), given) {
            (Ok(h), Some(g)) => h.trim() != g,
            (Ok(_), None) => false,
            // Enrolled by an earlier release: the token given now (or none,
            // which any later token differs from) is taken as the one it
            // enrolled with.
            (Err(_), given) => {
                let recorded = given.unwrap_or_else(|| "none".into());
                if let Err(e) = write_file(&path, &recorded, 0o600) {
                    tracing::warn!(error = %format!("{e:#}"), "cannot record the enrollment token's hash");
                }
                false
            }
        }
    }

    /// Enrolls with the token in `cfg` against the first controller that
    /// answers; while none can (unreachable, unavailable, shedding load),
    /// asks again with backoff (at most 30 s apart). A refusal ends it.
    pub async fn enroll(
        &self,
        cfg: &AgentConfig,
        kind: AgentKind,
        subnet: Option<String>,
    ) -> anyhow::Result<Credentials> {
        let Some(token) = &cfg.token else {
            bail!(
                "this agent has not enrolled yet ({} holds no certificate): start it with --token from `weftctl token create`",
                self.dir.display()
            );
        };
        let trust = match (&cfg.ca_fingerprint, &cfg.ca_file) {
            (Some(fp), _) => Trust::Fingerprint(fp.clone()),
            (None, Some(f)) => {
                Trust::CaPem(std::fs::read_to_string(f).with_context(|| format!("cannot read {}", f.display()))?)
            }
            (None, None) => bail!("enrollment needs --ca-fingerprint or --ca-file"),
        };
        if cfg.controllers.is_empty() {
            bail!("no controller address given");
        }
        let (key, csr) = key_and_csr(&cfg.name)?;
        // No controller able to answer yet (down, unreachable, or shedding
        // load): ask them all again, with backoff, until one answers. A
        // refusal (a bad token, say) ends it at once.
        let mut delays = weft_common::backoff().map(|d| d.min(std::time::Duration::from_secs(30)));
        loop {
            let mut last = None;
            for target in cfg.controller_order().into_iter().map(|i| &cfg.controllers[i]) {
                let channel = match tls::connect(target, &trust, None).await {
                    Ok(c) => c,
                    // A controller that is not the one pinned or trusted
                    // (its certificate refused): no retry helps.
                    Err(e)
                        if ["pinned fingerprint", "invalid peer certificate"]
                            .iter()
                            .any(|m| e.to_string().contains(m)) =>
                    {
                        bail!("{e}")
                    }
                    Err(e) => {
                        tracing::warn!(controller = %target, error = %format!("{e:#}"), "controller unreachable");
                        last = Some(anyhow::Error::new(e));
                        continue;
                    }
                };
                let answer = AgentServiceClient::new(channel)
                    .register(pb::RegisterRequest {
                        token: token.clone(),
                        csr_pem: csr.clone(),
                        name: cfg.name.clone(),
                        subnet: subnet.clone().unwrap_or_default(),
                        underlay_ip: cfg.underlay_ip.map(|i| i.to_string()).unwrap_or_default(),
                    })
                    .await;
                let resp = match answer {
                    Ok(r) => r.into_inner(),
                    // This controller cannot answer now: try the next one.
                    Err(s)
                        if matches!(
                            s.code(),
                            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::ResourceExhausted
                        ) =>
                    {
                        tracing::warn!(controller = %target, error = %s.message(), "controller unavailable");
                        last = Some(anyhow::anyhow!("{target}: {}", s.message()));
                        continue;
                    }
                    Err(s) => anyhow::bail!("enrollment refused ({:?}): {}", s.code(), s.message()),
                };
                if let Trust::Fingerprint(fp) = &trust {
                    use rustls::pki_types::CertificateDer;
                    use rustls::pki_types::pem::PemObject;
                    let der =
                        CertificateDer::from_pem_slice(resp.ca_pem.as_bytes()).context("the controller sent no CA")?;
                    if tls::fingerprint(&der) != *fp {
                        bail!("the CA the controller sent does not match --ca-fingerprint");
                    }
                }
                if resp.name != cfg.name {
                    tracing::info!(name = %resp.name, "the token fixed this agent's name");
                }
                let creds = self.save(&key.serialize_pem(), &resp.certificate_pem, &resp.ca_pem)?;
                write_file(
                    &self.dir.join(TOKEN_FILE),
                    weft_common::sha256_hex(token.trim().as_bytes()),
                    0o600,
                )?;
                tracing::info!(
                    role = kind.as_str(),
                    name = %resp.name,
                    site = %resp.site_id,
                    controller = %target,
                    "enrolled"
                );
                return Ok(creds);
            }
            let why = last.unwrap_or_else(|| anyhow::anyhow!("no controller answered"));
            let delay = delays.next().unwrap_or(std::time::Duration::from_secs(30));
            tracing::warn!(error = %format!("{why:#}"), retry_in = ?delay, "no controller could enroll this agent yet; asking again");
            tokio::time::sleep(delay).await;
        }
    }

    /// Replaces key and certificate through `Renew`, authenticated by the
    /// current ones.
    pub async fn renew(&self, target: &str, name: &str, current: &Credentials) -> Result<Credentials, RenewError> {
        let channel = tls::connect(target, &current.trust(), Some((&current.cert_pem, &current.key_pem)))
            .await
            .map_err(|e| RenewError::Transient(e.into()))?;
        let (key, csr) = key_and_csr(name).map_err(RenewError::Transient)?;
        let resp = AgentServiceClient::new(channel)
            .renew(pb::RenewRequest { csr_pem: csr })
            .await
            .map_err(|s| {
                let e = anyhow::anyhow!("renewal refused ({:?}): {}", s.code(), s.message());
                match s.code() {
                    tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => RenewError::Refused(e),
                    _ => RenewError::Transient(e),
                }
            })?;
        let resp = resp.into_inner();
        // The site's CAs as they stand now (two during a rotation of the
        // site CA); a controller of an earlier release sends none.
        let ca_pem = match checked_cas(&resp.ca_pem) {
            Ok(Some(cas)) if issued_by_one_of(&resp.certificate_pem, &cas) && keeps_newest(&current.ca_pem, &cas) => {
                cas
            }
            Ok(Some(_)) => {
                tracing::warn!(
                    "the controller's CAs lack the newest one held or the renewed certificate's; keeping the ones held"
                );
                current.ca_pem.clone()
            }
            Ok(None) => current.ca_pem.clone(),
            Err(e) => {
                tracing::warn!(error = %e, "the controller sent unusable CA certificates; keeping the ones held");
                current.ca_pem.clone()
            }
        };
        self.save(&key.serialize_pem(), &resp.certificate_pem, &ca_pem)
            .map_err(RenewError::Transient)
    }

    /// Asks `target` which CAs the site trusts now and whether this
    /// agent's certificate is from one it is rotating away from
    /// (`GetTrust`); `None` from a controller of an earlier release.
    pub async fn trust(&self, target: &str, current: &Credentials) -> anyhow::Result<Option<pb::Trust>> {
        let channel = tls::connect(target, &current.trust(), Some((&current.cert_pem, &current.key_pem))).await?;
        match AgentServiceClient::new(channel).get_trust(pb::GetTrustRequest {}).await {
            Ok(t) => Ok(Some(t.into_inner())),
            Err(s) if s.code() == tonic::Code::Unimplemented => Ok(None),
            Err(s) => anyhow::bail!("{:?}: {}", s.code(), s.message()),
        }
    }

    /// Trusts the CAs in `ca_pem` (checked: see [`checked_cas`]) from now
    /// on; `None` when they are the ones held.
    pub fn set_trust(&self, current: &Credentials, ca_pem: &str) -> anyhow::Result<Option<Credentials>> {
        let Some(cas) = checked_cas(ca_pem)? else {
            return Ok(None);
        };
        if cas == current.ca_pem {
            return Ok(None);
        }
        // A replica not yet restarted after a rotation knows only the old
        // CA: its word must drop neither the newest CA held nor the one
        // this certificate is from.
        if !keeps_newest(&current.ca_pem, &cas) {
            bail!("the CAs sent do not include the newest one this agent trusts");
        }
        if !issued_by_one_of(&current.cert_pem, &cas) {
            bail!("the CAs sent do not include the one that signed this agent's certificate");
        }
        write_file(&self.dir.join(CA_FILE), &cas, 0o644)?;
        Ok(Some(Credentials {
            ca_pem: cas,
            ..current.clone()
        }))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RenewError {
    /// The controller will not renew: removed or revoked.
    #[error("{0:#}")]
    Refused(anyhow::Error),
    /// Worth retrying.
    #[error("{0:#}")]
    Transient(anyhow::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn issue() -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["x".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        (key.serialize_pem(), cert.pem())
    }

    #[test]
    fn another_token_than_the_one_enrolled_with_enrolls_again() {
        let d = tempfile::tempdir().unwrap();
        let ids = IdentityStore::new(d.path());
        // Enrolled by an earlier release, started without a token: any
        // token given later is new.
        assert!(!ids.new_token(None));
        assert!(ids.new_token(Some("t2")));
        // Enrolled with t1 (recorded at enrollment).
        write_file(&d.path().join(TOKEN_FILE), weft_common::sha256_hex("t1"), 0o600).unwrap();
        assert!(!ids.new_token(Some("t1")) && !ids.new_token(Some(" t1\n")) && !ids.new_token(None));
        assert!(ids.new_token(Some("t2")));
    }

    #[test]
    fn only_cas_that_signed_the_agents_certificate_replace_the_ones_held() {
        let ca = |cn: &str| {
            let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
            p.distinguished_name.push(DnType::CommonName, cn);
            p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            let k = KeyPair::generate().unwrap();
            let cert = p.self_signed(&k).unwrap().pem();
            (rcgen::Issuer::new(p, k), cert)
        };
        let ((old, old_pem), (_, new_pem)) = (ca("old"), ca("new"));
        let key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["n1".to_string()])
            .unwrap()
            .signed_by(&key, &old)
            .unwrap()
            .pem();
        let d = tempfile::tempdir().unwrap();
        let ids = IdentityStore::new(d.path());
        let held = ids.save(&key.serialize_pem(), &leaf, &old_pem).unwrap();
        // Both (a rotation's overlap): taken.
        let both = ids
            .set_trust(&held, &(new_pem.clone() + &old_pem))
            .unwrap()
            .expect("changed");
        assert_eq!(both.ca_pem.matches("BEGIN CERTIFICATE").count(), 2);
        assert_eq!(std::fs::read_to_string(d.path().join(CA_FILE)).unwrap(), both.ca_pem);
        assert!(ids.set_trust(&both, &both.ca_pem).unwrap().is_none(), "unchanged");
        // The new one alone, while this certificate is the old one's: kept.
        let e = ids.set_trust(&both, &new_pem).unwrap_err().to_string();
        assert!(e.contains("do not include the one that signed"), "{e}");
        // The old one alone (a replica not yet restarted): kept.
        let e = ids.set_trust(&both, &old_pem).unwrap_err().to_string();
        assert!(e.contains("do not include the newest"), "{e}");
    }

    #[test]
    fn an_interrupted_renewal_falls_back_to_the_previous_key() {
        let d = tempfile::tempdir().unwrap();
        let ids = IdentityStore::new(d.path());
        let (k1, c1) = issue();
        ids.save(&k1, &c1, &c1).unwrap();
        assert_eq!(ids.load().unwrap().unwrap().key_pem, k1);
        // the crash: new key written (old one kept), certificate not yet
        let (k2, _) = issue();
        std::fs::copy(d.path().join(KEY_FILE), d.path().join(PREV_KEY_FILE)).unwrap();
        std::fs::write(d.path().join(KEY_FILE), &k2).unwrap();
        assert_eq!(ids.load().unwrap().unwrap().key_pem, k1, "the old pair is restored");
        // a mismatch with nothing to fall back on is an error, not a silent retry loop
        std::fs::write(d.path().join(KEY_FILE), &k2).unwrap();
        std::fs::remove_file(d.path().join(PREV_KEY_FILE)).unwrap();
        assert!(ids.load().is_err());
    }
}
