//! An agent's certificates after enrollment: renewal, the marks that
//! tell a retry from a second holder of the identity (used, superseded),
//! the conflict that revokes the whole identity, and revocation records.

use super::{Key, Prefix, State, decode, encode};
use crate::domain::{AgentRole, CertRecord, Gateway, IdentityConflict, Node, Revoked, now_ms};
use crate::error::Error;
use crate::pki::Issued;
use crate::store::{Compare, Op, Txn};

/// Edits the certificates and the conflict mark of the agent record in
/// `kv` (a node's or a gateway's), giving the new record's bytes.
fn edit_agent(
    role: AgentRole,
    kv: &crate::store::KeyValue,
    f: impl FnOnce(&mut Vec<CertRecord>, &mut Option<IdentityConflict>),
) -> Result<Vec<u8>, Error> {
    Ok(match role {
        AgentRole::Node => {
            let mut n: Node = decode(kv)?;
            f(&mut n.certs, &mut n.identity_conflict);
            encode(&n)
        }
        AgentRole::Gateway => {
            let mut g: Gateway = decode(kv)?;
            f(&mut g.certs, &mut g.identity_conflict);
            encode(&g)
        }
    })
}

/// An agent record's certificates, whether it is marked in conflict, and
/// when it was last enrolled.
fn read_agent(role: AgentRole, kv: &crate::store::KeyValue) -> Result<(Vec<CertRecord>, bool, u64), Error> {
    Ok(match role {
        AgentRole::Node => {
            let n: Node = decode(kv)?;
            (n.certs, n.identity_conflict.is_some(), n.enrolled_at_ms)
        }
        AgentRole::Gateway => {
            let g: Gateway = decode(kv)?;
            (g.certs, g.identity_conflict.is_some(), g.enrolled_at_ms)
        }
    })
}

/// How long a revocation outlives its certificate's expiry (clock skew
/// between replicas).
pub const REVOKED_KEPT_AFTER_EXPIRY_MS: u64 = 15 * 60 * 1000;

/// How many revocation records one pruning transaction deletes.
const REVOCATIONS_DELETED_PER_TXN: usize = 128;

/// The revocations of certificates that ended at or before this (ms since
/// the epoch) may leave the store: [`REVOKED_KEPT_AFTER_EXPIRY_MS`] ago.
pub fn revocations_lapsed_before() -> u64 {
    now_ms().saturating_sub(REVOKED_KEPT_AFTER_EXPIRY_MS)
}

/// Whether a retired CA (one of `retired`) signed `c`. One recorded
/// without its CA was issued before weft kept it: by the CA the site had
/// before its first rotation, retired once any CA is.
pub fn by_retired_ca(c: &CertRecord, retired: &[String]) -> bool {
    if c.ca.is_empty() {
        !retired.is_empty()
    } else {
        retired.contains(&c.ca)
    }
}

impl State {
    /// A new certificate for an enrolled, unrevoked agent.
    ///
    /// A renewal from a certificate older than the newest is either the
    /// agent's retry of a renewal whose answer it never got (the newest
    /// was then never used: the agent never had it), or a second holder
    /// of the identity (a copied key and certificate) after the other one
    /// renewed and used the newer certificate. The second kind revokes
    /// every certificate of the name and records the conflict: evicting
    /// either holder quietly would hand the identity to whichever of them
    /// renews first. (A call from a certificate a renewal replaced is the
    /// same sign; see [`State::record_conflict`].)
    pub async fn renew(
        &self,
        role: AgentRole,
        name: &str,
        caller_serial: &str,
        mut issue: impl FnMut() -> Result<Issued, Error>,
    ) -> Result<Issued, Error> {
        let key = self.at(Key::agent(role, name));
        for _ in 0..super::MAX_ATTEMPTS {
            let Some(kv) = self.store.get(&key).await? else {
                return Err(Error::Unauthenticated(format!(
                    "{} {name:?} has been removed; enroll again with a new token",
                    role.as_str()
                )));
            };
            let now = now_ms();
            let (known, _, _) = read_agent(role, &kv)?;
            if !known.iter().any(|c| c.serial == caller_serial) {
                return Err(Error::Unauthenticated(format!(
                    "this certificate does not belong to the current {} {name:?}; enroll again with a new token",
                    role.as_str()
                )));
            }
            let live: Vec<CertRecord> = known.into_iter().filter(|c| c.not_after_ms > now).collect();
            let newest = newest(&live).filter(|n| n.serial != caller_serial).cloned();
            if let Some(newest) = newest.as_ref().filter(|n| n.used) {
                let conflict = IdentityConflict {
                    at_ms: now,
                    caller_serial: caller_serial.to_string(),
                    newest_serial: newest.serial.clone(),
                };
                if !self.conflict_txn(role, name, &key, &kv, &live, conflict).await? {
                    continue;
                }
                return Err(Error::Unauthenticated(format!(
                    "this certificate of the {} {name:?} is not its newest: another host holds this identity (a \
                     copied key and certificate). Every certificate of the name is revoked; the admin must enroll \
                     the real host again with a new token",
                    role.as_str()
                )));
            }
            let issued = issue()?;
            let rec = CertRecord {
                serial: issued.serial.clone(),
                not_after_ms: issued.not_after_ms,
                issued_at_ms: now,
                used: false,
                ca: issued.ca.clone(),
            };
            // The new certificate replaces every older one but the caller's
            // (which the agent uses until it has the new one: a renewal whose
            // answer was lost is retried with it) and, on such a retry, the
            // newest (never used: the agent never received it). The replaced
            // ones are revoked as superseded in the same transaction, so an
            // agent holds at most two live certificates however often it
            // renews (three around a retry), removing it revokes them all,
            // and a later call from a replaced one is a second holder's.
            let (kept, replaced): (Vec<CertRecord>, Vec<CertRecord>) = live
                .into_iter()
                .partition(|c| c.serial == caller_serial || newest.as_ref().is_some_and(|n| n.serial == c.serial));
            let bytes = edit_agent(role, &kv, |certs, _| {
                *certs = kept
                    .into_iter()
                    .map(|mut c| {
                        c.used |= c.serial == caller_serial;
                        c
                    })
                    .chain([rec])
                    .collect();
            })?;
            let mut txn = Txn::new()
                .when(Compare::ModRevision(key.clone(), kv.mod_revision))
                .then(Op::put(key.clone(), bytes));
            for op in self.revoke_ops(role, name, &replaced, Revocation::Superseded) {
                txn = txn.then(op);
            }
            if self.store.txn(txn).await?.succeeded {
                return Ok(issued);
            }
        }
        Err(Error::Aborted("the agent's record kept changing; retry".into()))
    }

    /// Clears every certificate of agent `name` (its record `kv` at
    /// `key`), revokes the live ones and records `conflict`, in one
    /// transaction; false when the record changed meanwhile.
    async fn conflict_txn(
        &self,
        role: AgentRole,
        name: &str,
        key: &str,
        kv: &crate::store::KeyValue,
        live: &[CertRecord],
        conflict: IdentityConflict,
    ) -> Result<bool, Error> {
        let (caller, newest) = (conflict.caller_serial.clone(), conflict.newest_serial.clone());
        let bytes = edit_agent(role, kv, |certs, mark| {
            certs.clear();
            *mark = Some(conflict);
        })?;
        let mut txn = Txn::new()
            .when(Compare::ModRevision(key.to_string(), kv.mod_revision))
            .then(Op::put(key.to_string(), bytes));
        for op in self.revoke_ops(role, name, live, Revocation::Conflict) {
            txn = txn.then(op);
        }
        if !self.store.txn(txn).await?.succeeded {
            return Ok(false);
        }
        tracing::error!(
            role = role.as_str(),
            agent = name,
            caller = %caller,
            newest = %newest,
            "two holders of one agent identity: every certificate of the name is revoked"
        );
        Ok(true)
    }

    /// A call came from `serial` (issued at `issued_at_ms`), a certificate
    /// of agent `name` that a renewal replaced: its holder did not renew,
    /// someone else did from a copy. Revokes every certificate of the name
    /// and records the conflict (once: a name already in conflict is left
    /// as it is). A certificate from before the agent's latest enrollment
    /// is another generation's: refused, but no verdict on the new one
    /// (else whoever kept an old copy could revoke the re-enrolled agent
    /// at will).
    pub async fn record_conflict(
        &self,
        role: AgentRole,
        name: &str,
        serial: &str,
        issued_at_ms: u64,
    ) -> Result<(), Error> {
        let key = self.at(Key::agent(role, name));
        for _ in 0..super::MAX_ATTEMPTS {
            let Some(kv) = self.store.get(&key).await? else {
                return Ok(()); // removed meanwhile
            };
            let (certs, marked, enrolled_at) = read_agent(role, &kv)?;
            if (marked && certs.is_empty()) || issued_at_ms < enrolled_at {
                return Ok(());
            }
            let now = now_ms();
            let live: Vec<CertRecord> = certs.into_iter().filter(|c| c.not_after_ms > now).collect();
            let conflict = IdentityConflict {
                at_ms: now,
                caller_serial: serial.to_string(),
                newest_serial: newest(&live).map(|c| c.serial.clone()).unwrap_or_default(),
            };
            if self.conflict_txn(role, name, &key, &kv, &live, conflict).await? {
                return Ok(());
            }
        }
        Err(Error::Aborted("the agent's record kept changing; retry".into()))
    }

    /// Marks certificate `serial` of agent `name` as used (a call came
    /// with it), once: a renewal from an older certificate after this one
    /// was used is a second holder's, not a retry.
    pub async fn mark_cert_used(&self, role: AgentRole, name: &str, serial: &str) -> Result<(), Error> {
        let key = self.at(Key::agent(role, name));
        for _ in 0..super::MAX_ATTEMPTS {
            let Some(kv) = self.store.get(&key).await? else {
                return Ok(());
            };
            let mut changed = false;
            let bytes = edit_agent(role, &kv, |certs, _| {
                for c in certs.iter_mut().filter(|c| c.serial == serial && !c.used) {
                    c.used = true;
                    changed = true;
                }
            })?;
            if !changed {
                return Ok(());
            }
            let txn = Txn::new()
                .when(Compare::ModRevision(key.clone(), kv.mod_revision))
                .then(Op::put(key.clone(), bytes));
            if self.store.txn(txn).await?.succeeded {
                return Ok(());
            }
        }
        Err(Error::Aborted("the agent's record kept changing; retry".into()))
    }

    /// Forgets the agents' certificates that a retired CA signed (see
    /// [`by_retired_ca`]). No call comes with them any more, so they no
    /// longer hold the agent's name: the agent enrolls again with a token
    /// made for it and keeps its record (a node its subnet). Returns the
    /// agents left with no live certificate by it ("node/NAME").
    pub async fn forget_retired_certs(&self, retired: &[String]) -> Result<Vec<String>, Error> {
        if retired.is_empty() {
            return Ok(Vec::new());
        }
        let snap = self.snapshot().await?;
        let now = now_ms();
        let held = |certs: &[CertRecord]| certs.iter().any(|c| by_retired_ca(c, retired));
        let stranded = |certs: &[CertRecord]| {
            let live = || certs.iter().filter(|c| c.not_after_ms > now);
            live().next().is_some() && live().all(|c| by_retired_ca(c, retired))
        };
        let left: Vec<String> = snap
            .nodes
            .iter()
            .filter(|(n, _)| stranded(&n.certs))
            .map(|(n, _)| format!("node/{}", n.name))
            .chain(
                snap.gateways
                    .iter()
                    .filter(|(g, _)| stranded(&g.certs))
                    .map(|(g, _)| format!("gateway/{}", g.name)),
            )
            .collect();
        let agents: Vec<(AgentRole, String)> = snap
            .nodes
            .iter()
            .filter(|(n, _)| held(&n.certs))
            .map(|(n, _)| (AgentRole::Node, n.name.clone()))
            .chain(
                snap.gateways
                    .iter()
                    .filter(|(g, _)| held(&g.certs))
                    .map(|(g, _)| (AgentRole::Gateway, g.name.clone())),
            )
            .collect();
        for (role, name) in &agents {
            let key = self.at(Key::agent(*role, name));
            let mut done = false;
            for _ in 0..super::MAX_ATTEMPTS {
                let Some(kv) = self.store.get(&key).await? else {
                    done = true;
                    break;
                };
                let bytes = edit_agent(*role, &kv, |certs, _| certs.retain(|c| !by_retired_ca(c, retired)))?;
                let txn = Txn::new()
                    .when(Compare::ModRevision(key.clone(), kv.mod_revision))
                    .then(Op::put(key.clone(), bytes));
                if self.store.txn(txn).await?.succeeded {
                    done = true;
                    break;
                }
            }
            if !done {
                return Err(Error::Aborted(format!(
                    "{} {name}'s record kept changing; retry",
                    role.as_str()
                )));
            }
        }
        Ok(left)
    }

    /// Revokes `certs` of agent `name`, saying why.
    pub(super) fn revoke_ops(&self, role: AgentRole, name: &str, certs: &[CertRecord], why: Revocation) -> Vec<Op> {
        let now = now_ms();
        certs
            .iter()
            .filter(|c| c.not_after_ms > now)
            .map(|c| {
                let r = Revoked {
                    serial: c.serial.clone(),
                    role: role.as_str().to_string(),
                    name: name.to_string(),
                    not_after_ms: c.not_after_ms,
                    removed: why == Revocation::Removed,
                    superseded: why == Revocation::Superseded,
                    issued_at_ms: c.issued_at_ms,
                };
                Op::put(self.at(Key::Revoked(&c.serial)), encode(&r))
            })
            .collect()
    }

    /// Revokes an admin certificate (after the bundle was rotated).
    pub async fn revoke_admin(&self, serial: &str, not_after_ms: u64) -> Result<(), Error> {
        let r = Revoked {
            serial: serial.to_string(),
            role: "admin".into(),
            name: "admin".into(),
            not_after_ms,
            removed: false,
            superseded: false,
            issued_at_ms: 0,
        };
        let txn = Txn::new().then(Op::put(self.at(Key::Revoked(serial)), encode(&r)));
        self.store.txn(txn).await?;
        Ok(())
    }

    /// The store prefix of revocations, for watching.
    pub fn revoked_prefix(&self) -> String {
        self.under(Prefix::Revoked)
    }

    /// Revoked serials not yet expired; removes entries whose certificate
    /// expired more than [`REVOKED_KEPT_AFTER_EXPIRY_MS`] ago (a replica
    /// whose clock is behind must still refuse it until then).
    pub async fn revoked(&self) -> Result<(Vec<Revoked>, crate::store::Revision), Error> {
        let mut live = Vec::new();
        let rev = self.prune_revoked(|r| live.push(r)).await?;
        Ok((live, rev))
    }

    /// Deletes the revocation records of `serials` (see
    /// [`revocations_lapsed_before`]), [`REVOCATIONS_DELETED_PER_TXN`] to
    /// a transaction; a record already gone is no error.
    pub async fn delete_revocations(&self, serials: &[String]) -> Result<(), Error> {
        for chunk in serials.chunks(REVOCATIONS_DELETED_PER_TXN) {
            let mut t = Txn::new();
            for serial in chunk {
                t = t.then(Op::delete(self.at(Key::Revoked(serial))));
            }
            self.store.txn(t).await?;
        }
        Ok(())
    }

    /// Removes the revocations whose certificate expired more than
    /// [`REVOKED_KEPT_AFTER_EXPIRY_MS`] ago; hands each one kept to `keep`.
    /// Every replica's watch sees the deletions (see
    /// `Authenticator::forget_revoked`), so none reads the set anew.
    pub async fn prune_revoked(&self, mut keep: impl FnMut(Revoked)) -> Result<crate::store::Revision, Error> {
        let range = self.store.get_prefix(&self.revoked_prefix()).await?;
        let now = now_ms();
        for kv in &range.kvs {
            let r: Revoked = decode(kv)?;
            if r.not_after_ms.saturating_add(REVOKED_KEPT_AFTER_EXPIRY_MS) <= now {
                let t = Txn::new()
                    .when(Compare::ModRevision(kv.key.clone(), kv.mod_revision))
                    .then(Op::delete(kv.key.clone()));
                self.store.txn(t).await?;
            } else {
                keep(r);
            }
        }
        Ok(range.revision)
    }
}

/// Why agent certificates are revoked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Revocation {
    /// The admin removed the agent.
    Removed,
    /// A renewal replaced them.
    Superseded,
    /// Two holders of the identity showed up.
    Conflict,
}

/// The newest of `certs`, by issue time.
fn newest(certs: &[CertRecord]) -> Option<&CertRecord> {
    certs.iter().max_by_key(|c| (c.issued_at_ms, c.not_after_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A revocation goes once its certificate expired past the clock-skew
    /// margin (refused as expired by then); until then it is kept, and one
    /// of a certificate still valid always.
    #[tokio::test]
    async fn revocations_of_expired_certificates_are_pruned_after_a_margin() {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::store::embedded::EmbeddedStore::open(&dir.path().join("db")).unwrap();
        let state = State::new(std::sync::Arc::new(store), "s");
        let now = now_ms();
        let hour = 3_600_000;
        state.revoke_admin("old", now - hour).await.unwrap();
        state.revoke_admin("recent", now - 60_000).await.unwrap();
        state.revoke_admin("valid", now + hour).await.unwrap();
        let (live, _) = state.revoked().await.unwrap();
        let mut serials: Vec<&str> = live.iter().map(|r| r.serial.as_str()).collect();
        serials.sort();
        assert_eq!(serials, ["recent", "valid"]);
        let left = state.store.get_prefix(&state.revoked_prefix()).await.unwrap();
        assert_eq!(left.kvs.len(), 2, "the old revocation is still stored");
    }
}
