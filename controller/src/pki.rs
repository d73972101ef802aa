//! The site's certificates: a CA, the controller's server certificate and an
//! admin client bundle, as PEM files under `<data-dir>/pki/`.
//!
//! Created on first start; the CA and admin bundle are kept, the server
//! certificate is reissued at every start so that its names follow the
//! configuration. Private keys are written with mode 0600 through a
//! temporary file and a rename, so a crash never leaves half a key, and they
//! are never logged. Identities are URI SANs `weft://<site>/<role>/<name>`.

use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::Context;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType, SerialNumber,
};
use time::{Duration, OffsetDateTime};
use weft_common::fs::{sync_dir, write_file};

pub const CA_CERT: &str = "ca.pem";
pub const CA_KEY: &str = "ca.key";
/// A rotation's new CA key, until it replaces `ca.key` (see [`rotate`]).
pub const CA_NEXT_KEY: &str = "ca.next.key";
/// During a rotation: the new CA signed by the old one (see [`rotate`]).
pub const CA_CROSS: &str = "ca-cross.pem";
/// The fingerprints of CAs this site retired, one per line, oldest first.
pub const CA_RETIRED: &str = "ca-retired";
pub const SERVER_CERT: &str = "server.pem";
pub const SERVER_KEY: &str = "server.key";
pub const ADMIN_CERT: &str = "admin.pem";
pub const ADMIN_KEY: &str = "admin.key";

/// What the controller's TLS listener needs, and the CA that signs agents.
pub struct ServerPki {
    pub dir: PathBuf,
    pub ca: SiteCa,
    pub cert_pem: String,
    pub key_pem: String,
}

/// The site CA: its certificate and the key that signs agent certificates.
/// The key is read from `<data-dir>/pki/ca.key` and never leaves the
/// controller's host.
///
/// During a rotation (see [`rotate`]) `ca.pem` holds two CAs: the new one,
/// which signs, first, and the old one, still trusted, after it; and
/// `ca-cross.pem` the new CA's certificate signed by the old CA, which the
/// controller sends after its own certificates, so that a party that
/// trusts only the old CA still verifies them.
pub struct SiteCa {
    /// Every CA the site trusts, as PEM: the signing CA first.
    pub pem: String,
    /// The signing CA's certificate.
    pub der: Vec<u8>,
    /// SHA-256 of the signing CA certificate's DER, lower-case hex.
    pub fingerprint: String,
    /// Every CA the site trusts (DER): the signing CA first.
    pub trusted: Vec<Vec<u8>>,
    /// During a rotation: the signing CA signed by the previous one (PEM).
    pub cross_pem: Option<String>,
    /// The fingerprints of the CAs the site retired (`ca-retired`).
    pub retired: Vec<String>,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for SiteCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SiteCa")
            .field("fingerprint", &self.fingerprint)
            .finish_non_exhaustive()
    }
}

/// A certificate issued to an agent.
#[derive(Debug, Clone)]
pub struct Issued {
    pub cert_pem: String,
    /// Lower-case hex of the serial number.
    pub serial: String,
    pub not_after_ms: u64,
    /// The fingerprint of the CA that signed it.
    pub ca: String,
}

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("the CSR is not valid: {0}")]
    InvalidCsr(String),
    #[error("cannot issue a certificate: {0}")]
    Issue(String),
}

/// SHA-256 of DER bytes, lower-case hex: a certificate fingerprint.
pub use weft_common::{fingerprint, pem_of};

mod rotation;
use rotation::vouches;
pub use rotation::{Rotated, finish, rotate};

fn random_serial() -> (SerialNumber, String) {
    let mut b = [0u8; 16];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b).expect("the system RNG works");
    b[0] &= 0x7f; // positive
    b[0] |= 0x01; // and without a leading zero byte, so its hex is stable
    (SerialNumber::from_slice(&b), hex::encode(b))
}

impl SiteCa {
    pub fn load(dir: &Path) -> anyhow::Result<SiteCa> {
        use rustls_pki_types::pem::PemObject;
        let (cert, key) = (dir.join(CA_CERT), dir.join(CA_KEY));
        let pem = std::fs::read_to_string(&cert).with_context(|| format!("cannot read {}", cert.display()))?;
        let trusted: Vec<Vec<u8>> = rustls_pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
            .map(|c| c.map(|c| c.to_vec()))
            .collect::<Result<_, _>>()
            .with_context(|| format!("{} is not PEM", cert.display()))?;
        let Some(der) = trusted.first().cloned() else {
            anyhow::bail!("{} holds no certificate", cert.display());
        };
        let mut key_pem = std::fs::read_to_string(&key).with_context(|| format!("cannot read {}", key.display()))?;
        // A rotation writes the new key aside, then the CAs, then moves the
        // key into place: a crash between the last two leaves the old key
        // beside the new CA, and the key set aside goes with it.
        let next = dir.join(CA_NEXT_KEY);
        if !key_matches_cert(&key_pem, &der) {
            match std::fs::read_to_string(&next) {
                Ok(k) if key_matches_cert(&k, &der) => {
                    std::fs::rename(&next, &key)
                        .with_context(|| format!("cannot move {} into place", next.display()))?;
                    tracing::warn!("an interrupted CA rotation left its new key aside; moved it into place");
                    key_pem = k;
                }
                _ => anyhow::bail!(
                    "{} does not belong to the first certificate of {}; restore both from a backup (or another replica)",
                    key.display(),
                    cert.display()
                ),
            }
        } else if next.exists() {
            // A rotation cut short before its CAs were written.
            let _ = std::fs::remove_file(&next);
        }
        let keypair = KeyPair::from_pem(&key_pem).context("the site CA key is unreadable")?;
        let issuer = Issuer::from_ca_cert_der(&rustls_pki_types::CertificateDer::from(der.clone()), keypair)
            .context("the site CA certificate is unreadable")?;
        let cross_pem = match std::fs::read_to_string(dir.join(CA_CROSS)) {
            Ok(p) if trusted.len() > 1 && vouches(&p, &trusted[1], &der) => Some(p),
            Ok(_) if trusted.len() > 1 => {
                tracing::warn!(
                    "{} is not the signing CA signed by the one before it; not sent (agents and peers that \
                     know only the old CA cannot verify this controller until they learn the new one)",
                    dir.join(CA_CROSS).display()
                );
                None
            }
            _ => None,
        };
        let fingerprints: Vec<String> = trusted.iter().map(|d| fingerprint(d)).collect();
        // A CA is retired before the files that stop trusting it are
        // written (a crash in between must not leave it trusted but
        // unlisted); one still trusted here is not retired yet.
        let retired = std::fs::read_to_string(dir.join(CA_RETIRED))
            .unwrap_or_default()
            .lines()
            .map(|l| l.trim().to_string())
            .filter(|l| !l.is_empty() && !fingerprints.contains(l))
            .collect();
        Ok(SiteCa {
            fingerprint: fingerprint(&der),
            pem,
            der,
            trusted,
            cross_pem,
            retired,
            issuer,
        })
    }

    /// Whether this CA (the signing one) signed the DER certificate `der`.
    pub fn signed(&self, der: &[u8]) -> bool {
        signed_by(der, &self.der)
    }

    /// Whether a CA trusted beside the signing one (the one a rotation
    /// replaces) signed the DER certificate `der`.
    pub fn signed_by_older(&self, der: &[u8]) -> bool {
        self.trusted[1..].iter().any(|ca| signed_by(der, ca))
    }

    /// A certificate this CA signed (PEM), with the cross-certificate
    /// after it during a rotation: a replica not yet restarted, which
    /// trusts only the old CA, still verifies it.
    fn with_cross(&self, leaf_pem: String) -> String {
        match &self.cross_pem {
            Some(x) => leaf_pem + x,
            None => leaf_pem,
        }
    }

    /// Whether a rotation is under way: an old CA is still trusted.
    pub fn rotating(&self) -> bool {
        self.trusted.len() > 1
    }

    /// The certificates to send after a leaf this CA signed: the CA itself
    /// and, during a rotation, its cross-certificate (PEM).
    pub fn chain_pem(&self) -> String {
        let mut out = pem_of(&self.der);
        if let Some(x) = &self.cross_pem {
            out.push_str(x);
        }
        out
    }

    /// Signs `csr_pem` for the identity `uri` (`weft://site/role/name`),
    /// valid for `ttl`. The CSR proves possession of its key; any identity
    /// it asks for other than `uri` is refused, and its other fields are
    /// ignored: the controller decides what the certificate says.
    pub fn sign_agent_csr(
        &self,
        csr_pem: &str,
        uri: &str,
        cn: &str,
        ttl: std::time::Duration,
    ) -> Result<Issued, PkiError> {
        let csr = rcgen::CertificateSigningRequestParams::from_pem(csr_pem)
            .map_err(|e| PkiError::InvalidCsr(format!("{e}; send a PEM PKCS#10 request signed by the agent's key")))?;
        for san in &csr.params.subject_alt_names {
            match san {
                SanType::URI(u) if u.as_str() == uri => {}
                SanType::URI(u) => {
                    return Err(PkiError::InvalidCsr(format!(
                        "it asks for the identity {}, but this agent is {uri}",
                        u.as_str()
                    )));
                }
                _ => {}
            }
        }
        let mut p = leaf_params(cn, uri.to_string(), &[], vec![ExtendedKeyUsagePurpose::ClientAuth], 0)
            .map_err(|e| PkiError::Issue(e.to_string()))?;
        let now = OffsetDateTime::now_utc();
        p.not_after = now + Duration::try_from(ttl).unwrap_or(Duration::days(1));
        let (serial, serial_hex) = random_serial();
        p.serial_number = Some(serial);
        let cert = p
            .signed_by(&csr.public_key, &self.issuer)
            .map_err(|e| PkiError::Issue(e.to_string()))?;
        Ok(Issued {
            cert_pem: self.with_cross(cert.pem()),
            serial: serial_hex,
            not_after_ms: (p.not_after.unix_timestamp() as u64) * 1000,
            ca: self.fingerprint.clone(),
        })
    }

    /// Signs a client certificate for `uri` with a fresh key, e.g. for an
    /// admin bundle; returns (cert PEM, key PEM).
    pub fn issue_with_key(&self, uri: &str, cn: &str, days: i64) -> anyhow::Result<(String, String)> {
        let key = KeyPair::generate()?;
        let mut p = leaf_params(
            cn,
            uri.to_string(),
            &[],
            vec![ExtendedKeyUsagePurpose::ClientAuth],
            days,
        )?;
        p.serial_number = Some(random_serial().0);
        Ok((
            self.with_cross(p.signed_by(&key, &self.issuer)?.pem()),
            key.serialize_pem(),
        ))
    }
}

/// `weft://<site>/<role>/<name>`: the identity a certificate carries.
pub fn identity_uri(site: &str, role: &str, name: &str) -> String {
    format!("weft://{site}/{role}/{name}")
}

fn leaf_params(
    cn: &str,
    uri: String,
    names: &[String],
    eku: Vec<ExtendedKeyUsagePurpose>,
    days: i64,
) -> anyhow::Result<CertificateParams> {
    let mut p = CertificateParams::new(names.to_vec()).context("invalid certificate name")?;
    p.subject_alt_names
        .push(SanType::URI(uri.as_str().try_into().context("invalid identity URI")?));
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    p.distinguished_name = dn;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = eku;
    let now = OffsetDateTime::now_utc();
    p.not_before = now - Duration::minutes(5);
    p.not_after = now + Duration::days(days);
    Ok(p)
}

/// Loads the site CA from `dir`, creating it (and the admin bundle) when
/// absent, and issues a fresh server certificate for `names`.
pub fn ensure(dir: &Path, site: &str, names: &[String]) -> anyhow::Result<ServerPki> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // Only tighten when needed: a read-only data directory that is already
    // right should get as far as the store, which says what is wrong.
    let mode = std::fs::metadata(dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .permissions()
        .mode()
        & 0o777;
    if mode != 0o700 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("cannot make {} private (mode 0700)", dir.display()))?;
    }
    let (ca_cert, ca_key) = (dir.join(CA_CERT), dir.join(CA_KEY));
    match (ca_cert.exists(), ca_key.exists()) {
        (true, false) | (false, true) => anyhow::bail!(
            "{} exists but {} does not; restore the missing file from a backup (or another replica). \
             A new CA would cut off every enrolled agent and peered site, so weft will not make one over a \
             half-present CA; delete both to start a new site",
            if ca_cert.exists() {
                ca_cert.display()
            } else {
                ca_key.display()
            },
            if ca_cert.exists() {
                ca_key.display()
            } else {
                ca_cert.display()
            },
        ),
        _ => {}
    }
    if !ca_cert.exists() {
        let (p, key) = new_ca(format!("weft site {site} CA"))?;
        let cert = p.self_signed(&key)?;
        write_file(&ca_key, key.serialize_pem(), 0o600)?;
        write_file(&ca_cert, cert.pem(), 0o644)?;
        // A new CA invalidates any admin bundle left from an older one.
        let _ = std::fs::remove_file(dir.join(ADMIN_CERT));
        tracing::info!(dir = %dir.display(), "created the site CA");
    }
    let ca = SiteCa::load(dir)?;

    if !dir.join(ADMIN_CERT).exists() || !dir.join(ADMIN_KEY).exists() {
        write_admin_bundle(dir, &ca, site)?;
    }

    let mut all = vec!["localhost".to_string(), "127.0.0.1".to_string(), "::1".to_string()];
    for n in names {
        if !all.contains(n) {
            all.push(n.clone());
        }
    }
    // Reused across restarts while it is the CA's, names exactly these and
    // has more than a third of its life left: a restart must not leave a
    // trail of valid server certificates (and keys) behind.
    if let Some((cert_pem, key_pem)) = reusable_server_cert(dir, &ca, &all) {
        return Ok(ServerPki {
            dir: dir.to_path_buf(),
            ca,
            cert_pem,
            key_pem,
        });
    }
    let key = KeyPair::generate()?;
    let mut p = leaf_params(
        &format!("weft controller of {site}"),
        identity_uri(site, "controller", "controller"),
        &all,
        vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth],
        365,
    )?;
    p.serial_number = Some(random_serial().0);
    let cert = p.signed_by(&key, &ca.issuer)?;
    let (cert_pem, key_pem) = (cert.pem(), key.serialize_pem());
    write_file(&dir.join(SERVER_KEY), &key_pem, 0o600)?;
    write_file(&dir.join(SERVER_CERT), &cert_pem, 0o644)?;
    Ok(ServerPki {
        dir: dir.to_path_buf(),
        ca,
        cert_pem,
        key_pem,
    })
}

/// The stored server certificate and key, if they can serve on: signed by
/// `ca`, for exactly `names`, with over a third of their validity left.
fn reusable_server_cert(dir: &Path, ca: &SiteCa, names: &[String]) -> Option<(String, String)> {
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
    let cert_pem = std::fs::read_to_string(dir.join(SERVER_CERT)).ok()?;
    let key_pem = std::fs::read_to_string(dir.join(SERVER_KEY)).ok()?;
    KeyPair::from_pem(&key_pem).ok()?;
    use rustls_pki_types::pem::PemObject;
    let der = rustls_pki_types::CertificateDer::from_pem_slice(cert_pem.as_bytes()).ok()?;
    let (_, cert) = X509Certificate::from_der(&der).ok()?;
    let (_, ca_cert) = X509Certificate::from_der(&ca.der).ok()?;
    cert.verify_signature(Some(ca_cert.public_key())).ok()?;
    let mut has: Vec<String> = cert
        .subject_alternative_name()
        .ok()??
        .value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::DNSName(d) => Some(d.to_string()),
            GeneralName::IPAddress(b) => match b.len() {
                4 => Some(IpAddr::from(<[u8; 4]>::try_from(*b).ok()?).to_string()),
                16 => Some(IpAddr::from(<[u8; 16]>::try_from(*b).ok()?).to_string()),
                _ => None,
            },
            _ => None,
        })
        .collect();
    let mut want = names.to_vec();
    has.sort();
    want.sort();
    if has != want {
        return None;
    }
    let (from, to) = (
        cert.validity().not_before.timestamp(),
        cert.validity().not_after.timestamp(),
    );
    let now = OffsetDateTime::now_utc().unix_timestamp();
    (to - now > (to - from) / 3).then_some((cert_pem, key_pem))
}

/// Issues an admin bundle (365 days) into `dir`; returns the certificate PEM.
fn write_admin_bundle(dir: &Path, ca: &SiteCa, site: &str) -> anyhow::Result<String> {
    let (cert, key) = ca.issue_with_key(
        &identity_uri(site, "admin", "admin"),
        &format!("weft admin of {site}"),
        365,
    )?;
    write_file(&dir.join(ADMIN_KEY), &key, 0o600)?;
    write_file(&dir.join(ADMIN_CERT), &cert, 0o644)?;
    tracing::info!(cert = %dir.join(ADMIN_CERT).display(), "issued the admin client bundle");
    Ok(cert)
}

/// A new CA's parameters (named `cn`, valid ten years) and key.
fn new_ca(cn: String) -> anyhow::Result<(CertificateParams, KeyPair)> {
    let key = KeyPair::generate()?;
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let now = OffsetDateTime::now_utc();
    p.not_before = now - Duration::minutes(5);
    p.not_after = now + Duration::days(3650);
    p.serial_number = Some(random_serial().0);
    Ok((p, key))
}

/// Whether `key_pem` is the key of the DER certificate `der` (false for
/// either unreadable).
pub(crate) fn key_matches_cert(key_pem: &str, der: &[u8]) -> bool {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let (Ok(key), Ok((_, cert))) = (KeyPair::from_pem(key_pem), X509Certificate::from_der(der)) else {
        return false;
    };
    cert.public_key().subject_public_key.data.as_ref() == key.public_key_raw()
}

/// Whether the CA `ca` (DER) signed the certificate `der` (DER).
fn signed_by(der: &[u8], ca: &[u8]) -> bool {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let (Ok((_, cert)), Ok((_, ca))) = (X509Certificate::from_der(der), X509Certificate::from_der(ca)) else {
        return false;
    };
    cert.verify_signature(Some(ca.public_key())).is_ok()
}

/// When a DER certificate stops being valid.
pub fn not_after(der: &[u8]) -> Option<std::time::SystemTime> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let (_, c) = X509Certificate::from_der(der).ok()?;
    let secs = u64::try_from(c.validity().not_after.timestamp()).ok()?;
    Some(std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs))
}

/// The serial (hex) and expiry (ms since the epoch) of a PEM certificate.
fn serial_and_expiry(pem: &str) -> Option<(String, u64)> {
    use rustls_pki_types::pem::PemObject;
    use x509_parser::prelude::{FromDer, X509Certificate};
    let der = rustls_pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).ok()?;
    let (_, c) = X509Certificate::from_der(&der).ok()?;
    Some((
        crate::auth::hex_serial(c.raw_serial()),
        (c.validity().not_after.timestamp().max(0) as u64) * 1000,
    ))
}

/// Replaces the admin bundle in `dir` with a new one; returns the new
/// certificate's serial and the old one's (serial, expiry in ms), which
/// the caller revokes.
pub fn rotate_admin(dir: &Path, site: &str) -> anyhow::Result<(String, Option<(String, u64)>)> {
    let ca = SiteCa::load(dir)?;
    let old = std::fs::read_to_string(dir.join(ADMIN_CERT))
        .ok()
        .and_then(|pem| serial_and_expiry(&pem));
    let cert = write_admin_bundle(dir, &ca, site)?;
    let (serial, _) = serial_and_expiry(&cert).context("the new admin certificate is unreadable")?;
    Ok((serial, old))
}

/// `bytes` random bytes from the system RNG, lower-case hex.
pub(crate) fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b).expect("the system RNG works");
    hex::encode(b)
}

/// The names a server certificate should carry for a listener on `addr`.
/// The server certificate's names: the `tls_sans`, the listen address
/// unless it is 0.0.0.0 or ::, and the host of each `advertise` address
/// (what agents and other sites dial), each once.
pub fn names_for(addr: IpAddr, extra: &[String], advertise: &[String]) -> Vec<String> {
    let mut v = extra.to_vec();
    if !addr.is_unspecified() {
        v.push(addr.to_string());
    }
    for a in advertise {
        let host = a.rsplit_once(':').map_or(a.as_str(), |(h, _)| h);
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if !host.is_empty() {
            v.push(host.to_string());
        }
    }
    let mut seen = std::collections::HashSet::new();
    v.retain(|n| seen.insert(n.clone()));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advertised_hosts_are_names_of_the_server_certificate() {
        let any: IpAddr = "0.0.0.0".parse().unwrap();
        assert_eq!(
            names_for(
                any,
                &["ctl.example".into()],
                &["192.0.2.5:7443".into(), "[2001:db8::5]:7443".into()]
            ),
            ["ctl.example", "192.0.2.5", "2001:db8::5"]
        );
        let one: IpAddr = "192.0.2.5".parse().unwrap();
        assert_eq!(names_for(one, &[], &["192.0.2.5:7443".into()]), ["192.0.2.5"]);
    }

    #[test]
    fn creates_once_and_keeps_keys_private() {
        let d = tempfile::tempdir().unwrap();
        let pki = ensure(d.path(), "s1", &["ctl.example".into()]).unwrap();
        let ca1 = pki.ca.pem.clone();
        for k in [CA_KEY, ADMIN_KEY, SERVER_KEY] {
            let mode = std::fs::metadata(d.path().join(k)).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{k}");
        }
        let again = ensure(d.path(), "s1", &[]).unwrap();
        assert_eq!(again.ca.pem, ca1, "the CA survives restarts");
        assert_ne!(
            again.cert_pem, pki.cert_pem,
            "other names: the server certificate is reissued"
        );
        let third = ensure(d.path(), "s1", &[]).unwrap();
        assert_eq!(
            third.cert_pem, again.cert_pem,
            "the same names: the server certificate is reused"
        );
        assert_eq!(third.key_pem, again.key_pem);
    }

    /// A rotation: the new CA signs and the old one stays trusted, the
    /// cross-certificate makes what the new one signs verifiable by the old
    /// one alone, and finishing retires the old one; a crash between the
    /// rotation's writes is completed at the next load.
    #[test]
    fn a_rotated_ca_signs_while_the_old_one_vouches_for_it_until_finished() {
        use x509_parser::prelude::{FromDer, X509Certificate};
        let d = tempfile::tempdir().unwrap();
        let first = ensure(d.path(), "s1", &[]).unwrap().ca;
        assert!(!first.rotating() && first.cross_pem.is_none());
        let e = finish(d.path()).unwrap_err().to_string();
        assert!(e.contains("no rotation"), "{e}");

        let r = rotate(d.path(), "s1", false).unwrap();
        assert_eq!(r.old_fingerprint, first.fingerprint);
        let ca = SiteCa::load(d.path()).unwrap();
        assert!(ca.rotating());
        assert_eq!(ca.fingerprint, r.new_fingerprint);
        assert_eq!(ca.trusted, vec![ca.der.clone(), first.der.clone()]);
        let e = rotate(d.path(), "s1", false).unwrap_err().to_string();
        assert!(e.contains("under way"), "{e}");

        // An agent's certificate from the new CA carries the
        // cross-certificate, which the old CA signed.
        let key = KeyPair::generate().unwrap();
        let csr = CertificateParams::new(Vec::<String>::new())
            .unwrap()
            .serialize_request(&key)
            .unwrap()
            .pem()
            .unwrap();
        let issued = ca
            .sign_agent_csr(&csr, "weft://s1/node/n1", "n1", std::time::Duration::from_secs(60))
            .unwrap();
        assert_eq!(issued.ca, ca.fingerprint);
        use rustls_pki_types::pem::PemObject;
        let chain: Vec<_> = rustls_pki_types::CertificateDer::pem_slice_iter(issued.cert_pem.as_bytes())
            .map(Result::unwrap)
            .collect();
        assert_eq!(chain.len(), 2);
        assert!(ca.signed(&chain[0]));
        let (_, cross) = X509Certificate::from_der(&chain[1]).unwrap();
        let (_, old) = X509Certificate::from_der(&first.der).unwrap();
        cross.verify_signature(Some(old.public_key())).unwrap();
        let (_, new) = X509Certificate::from_der(&ca.der).unwrap();
        assert_eq!(cross.subject(), new.subject());
        assert_eq!(cross.public_key().raw, new.public_key().raw);
        // The old CA alone verifies the chain.
        crate::auth::verifier_of([rustls_pki_types::CertificateDer::from(first.der.clone())])
            .unwrap()
            .verify_client_cert(&chain[0], &chain[1..], rustls_pki_types::UnixTime::now())
            .unwrap();

        let retired = finish(d.path()).unwrap();
        assert_eq!(retired, vec![first.fingerprint.clone()]);
        let done = SiteCa::load(d.path()).unwrap();
        assert!(!done.rotating() && done.cross_pem.is_none());
        assert_eq!(done.trusted, vec![ca.der.clone()]);
        assert_eq!(done.retired, vec![first.fingerprint.clone()]);

        // --revoke-old: the new CA alone at once, the old one retired;
        // also in the middle of a rotation, retiring both.
        rotate(d.path(), "s1", false).unwrap();
        let mid = SiteCa::load(d.path()).unwrap();
        let r = rotate(d.path(), "s1", true).unwrap();
        assert_eq!(r.old_fingerprint, mid.fingerprint);
        let now = SiteCa::load(d.path()).unwrap();
        assert!(!now.rotating() && now.cross_pem.is_none());
        assert_eq!(
            now.retired,
            vec![
                first.fingerprint.clone(),
                mid.fingerprint.clone(),
                ca.fingerprint.clone()
            ]
        );
        // A CA listed as retired but still trusted (a crash between the
        // list and the CAs) is not retired yet.
        std::fs::write(
            d.path().join(CA_RETIRED),
            format!("{}\n{}\n", first.fingerprint, now.fingerprint),
        )
        .unwrap();
        assert_eq!(SiteCa::load(d.path()).unwrap().retired, vec![first.fingerprint.clone()]);
        // A cross-certificate that does not vouch for the signing CA is
        // not sent.
        rotate(d.path(), "s1", false).unwrap();
        assert!(SiteCa::load(d.path()).unwrap().cross_pem.is_some());
        std::fs::write(d.path().join(CA_CROSS), pem_of(&first.der)).unwrap();
        assert!(SiteCa::load(d.path()).unwrap().cross_pem.is_none());
        let e = rotate(d.path(), "s1", false).unwrap_err().to_string();
        assert!(e.contains("under way"), "{e}");
        finish(d.path()).unwrap();
        let now = SiteCa::load(d.path()).unwrap();

        // A crash after the CAs were written, before the key moved.
        let key = std::fs::read_to_string(d.path().join(CA_KEY)).unwrap();
        std::fs::write(d.path().join(CA_NEXT_KEY), &key).unwrap();
        std::fs::write(d.path().join(CA_KEY), KeyPair::generate().unwrap().serialize_pem()).unwrap();
        let back = SiteCa::load(d.path()).unwrap();
        assert_eq!(back.fingerprint, now.fingerprint);
        assert_eq!(std::fs::read_to_string(d.path().join(CA_KEY)).unwrap(), key);
        assert!(!d.path().join(CA_NEXT_KEY).exists());
    }

    #[test]
    fn a_half_present_ca_is_never_replaced() {
        let d = tempfile::tempdir().unwrap();
        ensure(d.path(), "s1", &[]).unwrap();
        let key = std::fs::read(d.path().join(CA_KEY)).unwrap();
        std::fs::remove_file(d.path().join(CA_CERT)).unwrap();
        let e = ensure(d.path(), "s1", &[]).err().expect("refused").to_string();
        assert!(e.contains("restore the missing file"), "{e}");
        assert_eq!(
            std::fs::read(d.path().join(CA_KEY)).unwrap(),
            key,
            "the CA key was overwritten"
        );
    }
}
