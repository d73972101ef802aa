//! Rotating the site CA in the pki directory: `weft-controller ca rotate`
//! (with an overlap, or `--revoke-old`) and `ca finish`. A controller takes
//! the result in at its next start (`SiteCa::load`).

use super::*;

/// Whether `cross_pem` is the CA `signing` (DER) signed by the CA `before`
/// (DER): the same subject and key, and `before`'s signature.
pub(super) fn vouches(cross_pem: &str, before: &[u8], signing: &[u8]) -> bool {
    use rustls_pki_types::pem::PemObject;
    use x509_parser::prelude::{FromDer, X509Certificate};
    let Ok(der) = rustls_pki_types::CertificateDer::from_pem_slice(cross_pem.as_bytes()) else {
        return false;
    };
    let (Ok((_, x)), Ok((_, b)), Ok((_, s))) = (
        X509Certificate::from_der(&der),
        X509Certificate::from_der(before),
        X509Certificate::from_der(signing),
    ) else {
        return false;
    };
    x.subject() == s.subject()
        && x.public_key().raw == s.public_key().raw
        && x.verify_signature(Some(b.public_key())).is_ok()
}

/// What a CA rotation did, for the operator.
#[derive(Debug)]
pub struct Rotated {
    pub old_fingerprint: String,
    pub new_fingerprint: String,
    /// The old CA was retired at once (`--revoke-old`).
    pub revoked_old: bool,
}

/// Starts a rotation of the site CA in `dir`: a new CA signs from the
/// controller's next start, while the old one stays trusted. The new CA is
/// also signed by the old one (`ca-cross.pem`), so that agents and peers
/// that trust only the old CA still verify what the new one signs until
/// they are told of it. The admin bundle is reissued under the new CA.
///
/// With `revoke_old` (the old key leaked) the old CA is retired at once:
/// nothing it signed is trusted from the next start, no cross-certificate
/// vouches for the new one, and agents and peers must be given the new CA
/// by hand.
///
/// Each file is written whole (a temporary file and a rename), in an order
/// that [`SiteCa::load`] completes if a crash cuts it short.
pub fn rotate(dir: &Path, site: &str, revoke_old: bool) -> anyhow::Result<Rotated> {
    let old = SiteCa::load(dir)?;
    if old.rotating() && !revoke_old {
        anyhow::bail!(
            "a rotation of the site CA is under way (pki/ca.pem trusts {} CAs); finish it first with \
             `weft-controller ca finish`, or start over with `--revoke-old`, which retires both",
            old.trusted.len()
        );
    }
    let when = OffsetDateTime::now_utc();
    let (p, key) = new_ca(format!(
        "weft site {site} CA {}",
        when.format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default()
    ))?;
    let cert = p.self_signed(&key)?;
    let mut bundle = cert.pem();
    // Each step durable before the next (`sync_dir`): a power loss must
    // not land a later file without an earlier one.
    write_file(&dir.join(CA_NEXT_KEY), key.serialize_pem(), 0o600)?;
    sync_dir(dir)?;
    if revoke_old {
        // Listed before the CAs are written: a crash in between leaves
        // them trusted, and `load` ignores a listed CA that still is.
        retire(dir, &old.trusted)?;
        let _ = std::fs::remove_file(dir.join(CA_CROSS));
    } else {
        let cross = p.signed_by(&key, &old.issuer)?;
        write_file(&dir.join(CA_CROSS), cross.pem(), 0o644)?;
        bundle.push_str(&pem_of(&old.der));
    }
    sync_dir(dir)?;
    write_file(&dir.join(CA_CERT), &bundle, 0o644)?;
    sync_dir(dir)?;
    std::fs::rename(dir.join(CA_NEXT_KEY), dir.join(CA_KEY))
        .with_context(|| format!("cannot move the new CA key into {}", dir.join(CA_KEY).display()))?;
    sync_dir(dir)?;
    let new = SiteCa::load(dir)?;
    write_admin_bundle(dir, &new, site)?;
    tracing::info!(old = %old.fingerprint, new = %new.fingerprint, revoke_old, "rotated the site CA");
    Ok(Rotated {
        old_fingerprint: old.fingerprint,
        new_fingerprint: new.fingerprint,
        revoked_old: revoke_old,
    })
}

/// Ends a rotation: the old CA is no longer trusted from the controller's
/// next start. Returns the retired CAs' fingerprints.
pub fn finish(dir: &Path) -> anyhow::Result<Vec<String>> {
    let ca = SiteCa::load(dir)?;
    if !ca.rotating() {
        anyhow::bail!("no rotation of the site CA is under way; start one with `weft-controller ca rotate`");
    }
    retire(dir, &ca.trusted[1..])?;
    sync_dir(dir)?;
    write_file(&dir.join(CA_CERT), pem_of(&ca.der), 0o644)?;
    sync_dir(dir)?;
    let _ = std::fs::remove_file(dir.join(CA_CROSS));
    Ok(ca.trusted[1..].iter().map(|d| fingerprint(d)).collect())
}

/// Adds `cas` to the retired list (`ca-retired`).
fn retire(dir: &Path, cas: &[Vec<u8>]) -> anyhow::Result<()> {
    let path = dir.join(CA_RETIRED);
    let mut list = std::fs::read_to_string(&path).unwrap_or_default();
    for d in cas {
        let fp = fingerprint(d);
        if !list.lines().any(|l| l.trim() == fp) {
            list.push_str(&fp);
            list.push('\n');
        }
    }
    write_file(&path, list, 0o644)
}
