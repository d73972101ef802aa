//! How a rotation of the site CA stands (`AdminService.GetCaStatus`): what
//! still holds on to a CA the site is rotating away from. `weft-controller
//! ca finish` retires the old CA only once nothing does.
//!
//! The rotation itself is in `pki.rs` (`rotate`, `finish`): the CA key
//! never leaves the controller's host, so it acts on the pki directory,
//! and a controller takes a rotated CA in at its next start.

use weft_proto::v1 as pb;

use crate::domain::CertRecord;
use crate::render::Model;

/// The CAs as this controller holds them: the signing CA's fingerprint
/// first, then any other it trusts; and the retired ones.
#[derive(Clone, Debug, Default)]
pub struct Cas {
    pub trusted: Vec<String>,
    pub retired: Vec<String>,
}

impl Cas {
    pub fn of(ca: &crate::pki::SiteCa) -> Cas {
        Cas {
            trusted: ca.trusted.iter().map(|d| crate::pki::fingerprint(d)).collect(),
            retired: ca.retired.clone(),
        }
    }

    fn signing(&self) -> &str {
        self.trusted.first().map_or("", String::as_str)
    }
}

/// Whether an agent whose certificates are `certs` still holds on to an
/// older CA: its newest live certificate was not signed by `signing`. One
/// recorded without its CA was signed before weft kept it: by the signing
/// CA on a site that never rotated (`rotated` false), else by an older one.
fn on_old_ca(certs: &[CertRecord], signing: &str, rotated: bool, now_ms: u64) -> bool {
    certs
        .iter()
        .filter(|c| c.not_after_ms > now_ms)
        .max_by_key(|c| c.issued_at_ms)
        .is_some_and(|c| if c.ca.is_empty() { rotated } else { c.ca != signing })
}

/// Whether an agent of release `version` takes in a new CA (`GetTrust`,
/// 0.2 and later); one that has not said its release counts as able.
fn learns_cas(version: &str) -> bool {
    weft_types::version::parse(version).is_none_or(|(major, minor, _)| (major, minor) >= (0, 2))
}

/// The site CA's status in `model` at `now_ms`; `versions` gives the
/// release each connected agent reported ("node/NAME" → release).
pub fn status(
    cas: &Cas,
    model: &Model,
    versions: &std::collections::HashMap<String, String>,
    now_ms: u64,
) -> pb::CaStatus {
    let signing = cas.signing();
    let rotating = cas.trusted.len() > 1;
    let rotated = rotating || !cas.retired.is_empty();
    let agent = |who: String, certs: &[CertRecord]| {
        let release = versions.get(&who).map_or("", String::as_str);
        if on_old_ca(certs, signing, rotated, now_ms) {
            Some(who)
        } else if rotating && !learns_cas(release) {
            // It renews under the new CA but keeps trusting only the old
            // one: it would not verify this controller once finished.
            Some(format!(
                "{who} (runs {release}, which does not learn a new CA: upgrade it)"
            ))
        } else {
            None
        }
    };
    let mut agents: Vec<String> = model
        .nodes
        .values()
        .filter_map(|n| agent(format!("node/{}", n.name), &n.certs))
        .collect();
    agents.extend(
        model
            .gateways
            .values()
            .filter_map(|g| agent(format!("gateway/{}", g.name), &g.certs)),
    );
    let peers = model
        .peerings
        .values()
        .filter_map(|p| {
            let r = p.remote.as_ref()?;
            match r.trusts_ca.as_str() {
                f if f == signing => None,
                "" => Some(format!(
                    "{}: does not say (a release before 0.2, which does not learn a new CA: upgrade that site first)",
                    p.site_id
                )),
                f => Some(format!("{}: trusts {}…", p.site_id, &f[..f.len().min(12)])),
            }
        })
        .collect();
    pb::CaStatus {
        signing_fingerprint: signing.to_string(),
        trusted_fingerprints: cas.trusted.clone(),
        retired_fingerprints: cas.retired.clone(),
        agents_on_old_ca: agents,
        peers_on_old_ca: peers,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(ca: &str, issued_at_ms: u64, not_after_ms: u64) -> CertRecord {
        CertRecord {
            serial: format!("{issued_at_ms:x}"),
            not_after_ms,
            issued_at_ms,
            used: true,
            ca: ca.into(),
        }
    }

    #[test]
    fn an_agent_holds_on_to_an_old_ca_until_its_newest_live_certificate_is_the_new_ones() {
        let now = 10_000;
        assert!(on_old_ca(&[cert("old", 1, 20_000)], "new", true, now));
        assert!(
            on_old_ca(&[cert("", 1, 20_000)], "new", true, now),
            "recorded before weft kept the CA"
        );
        assert!(
            !on_old_ca(&[cert("", 1, 20_000)], "new", false, now),
            "on a site that never rotated"
        );
        assert!(!on_old_ca(
            &[cert("old", 1, 20_000), cert("new", 2, 20_000)],
            "new",
            true,
            now
        ));
        // A renewal by a replica not yet restarted (still signing with
        // the old CA) after one with the new CA: the newest counts.
        assert!(on_old_ca(
            &[cert("new", 2, 20_000), cert("old", 3, 20_000)],
            "new",
            true,
            now
        ));
        // Nothing live: the agent cannot call at all, and enrolls again.
        assert!(!on_old_ca(&[cert("old", 1, 5_000)], "new", true, now));
    }

    #[test]
    fn agents_of_a_release_that_does_not_learn_cas_hold_a_rotation_open() {
        assert!(!learns_cas("0.1.0") && !learns_cas("0.0.9"));
        assert!(learns_cas("0.2.0-dev.1") && learns_cas("0.2.0") && learns_cas("1.0.0") && learns_cas(""));
    }
}
