//! The site CA as the store records it: the signing CA's fingerprint and
//! the CAs the site retired, checked by every replica at start.

use super::{Key, MAX_ATTEMPTS, State};
use crate::error::Error;
use crate::store::{Compare, Op, Txn};

impl State {
    /// Records the site CA's fingerprint on first start; on later starts
    /// (and on every replica) refuses a controller holding another CA,
    /// whose certificates the agents and peers would not trust. A store
    /// that names one of the CAs this controller's rotation replaced
    /// (`trusted` after the signing one, or `retired`) takes the new one.
    /// The retired CAs are kept in the store too: a replica that still
    /// trusts one (its pki files not copied after `ca finish`) is refused.
    pub async fn check_ca(&self, trusted: &[String], retired: &[String]) -> Result<(), Error> {
        let fingerprint = trusted.first().map_or("", String::as_str);
        let key = self.at(Key::CaRetired);
        let listed = |kv: Option<crate::store::KeyValue>| {
            kv.map(|kv| {
                let list: Vec<String> = String::from_utf8_lossy(&kv.value)
                    .lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty())
                    .map(String::from)
                    .collect();
                (list, kv.mod_revision)
            })
            .unwrap_or_default()
        };
        // Before anything is written: a replica that still trusts a CA the
        // site retired changes nothing.
        let refuse_retired = |known: &[String]| match trusted.iter().find(|f| known.contains(f)) {
            Some(f) => Err(Error::FailedPrecondition(format!(
                "this controller still trusts the CA {f}, which the site retired (`ca finish` or `ca rotate \
                 --revoke-old` on another replica): copy pki/ca.pem and ca-retired from that replica, and \
                 remove pki/ca-cross.pem here, before starting this one"
            ))),
            None => Ok(()),
        };
        refuse_retired(&listed(self.store.get(&key).await?).0)?;
        let earlier: Vec<String> = trusted.iter().skip(1).chain(retired).cloned().collect();
        self.check_signing_ca(fingerprint, &earlier).await?;
        for _ in 0..MAX_ATTEMPTS {
            let (mut known, seen) = listed(self.store.get(&key).await?);
            refuse_retired(&known)?;
            let before = known.len();
            for f in retired {
                if !known.contains(f) {
                    known.push(f.clone());
                }
            }
            if known.len() == before {
                return Ok(());
            }
            let txn = Txn::new()
                .when(Compare::ModRevision(key.clone(), seen))
                .then(Op::put(key.clone(), (known.join("\n") + "\n").into_bytes()));
            if self.store.txn(txn).await?.succeeded {
                return Ok(());
            }
        }
        Err(Error::Unavailable(
            "the site's list of retired CAs kept changing; start this controller again".into(),
        ))
    }

    /// The signing CA against the store's record (see [`State::check_ca`]).
    async fn check_signing_ca(&self, fingerprint: &str, earlier: &[String]) -> Result<(), Error> {
        let key = self.at(Key::CaFingerprint);
        let marker = self.at(Key::Restoring);
        // Not on a store a restore is writing (it brings its own record).
        let txn = Txn::new()
            .when(Compare::Version(key.clone(), 0))
            .when(Compare::Version(marker.clone(), 0))
            .then(Op::put(key.clone(), fingerprint.as_bytes().to_vec()));
        if self.store.txn(txn).await?.succeeded {
            return Ok(());
        }
        if self.store.get(&marker).await?.is_some() {
            return Err(Error::FailedPrecondition(format!(
                "the store holds a restore that is under way or was cut short ({marker}); \
                 let it finish, or run `weft-controller restore FILE` again"
            )));
        }
        let (stored, seen) = self
            .store
            .get(&key)
            .await?
            .map(|kv| (String::from_utf8_lossy(&kv.value).into_owned(), kv.mod_revision))
            .unwrap_or_default();
        if stored == fingerprint {
            return Ok(());
        }
        if earlier.contains(&stored) {
            let txn = Txn::new()
                .when(Compare::ModRevision(key.clone(), seen))
                .then(Op::put(key.clone(), fingerprint.as_bytes().to_vec()));
            if self.store.txn(txn).await?.succeeded {
                tracing::info!(old = %stored, new = %fingerprint, "the site's store now names the rotated CA");
                return Ok(());
            }
            // Another replica of the same rotation wrote it first.
            if self
                .store
                .get(&key)
                .await?
                .is_some_and(|kv| kv.value == fingerprint.as_bytes())
            {
                return Ok(());
            }
            return Err(Error::Unavailable(
                "another replica recorded the site CA at the same time; start this one again".into(),
            ));
        }
        Err(Error::FailedPrecondition(format!(
            "this controller's site CA (SHA-256 {fingerprint}) is not the one the site's store names ({stored}); \
             a replica needs the site's CA: copy pki/ca.pem and pki/ca.key (and ca-cross.pem and ca-retired where \
             present) from another replica's data dir before starting it (after a CA rotation, from the replica \
             that rotated)"
        )))
    }
}
