//! A gateway's WireGuard key and endpoint as its agent reports them, and
//! the admin's acceptance of a key change.

use super::{Key, State, encode};
use crate::error::Error;
use crate::store::{Compare, Op, Txn};

impl State {
    /// Records a gateway's WireGuard public key and endpoint.
    pub async fn update_gateway(
        &self,
        name: &str,
        public_key: Option<crate::domain::WgKey>,
        endpoint: Option<std::net::SocketAddr>,
    ) -> Result<(), Error> {
        let key = self.at(Key::Gateway(name));
        for _ in 0..super::MAX_ATTEMPTS {
            let Some(kv) = self.store.get(&key).await? else {
                return Err(Error::Unauthenticated(format!(
                    "gateway {name:?} has been removed; enroll it again"
                )));
            };
            let mut g: crate::domain::Gateway = super::decode(&kv)?;
            let before = g.clone();
            g.endpoint = endpoint;
            // The first key after an enrollment is taken; a change of a key
            // the gateway already has is held for the admin: a stolen
            // certificate must not point every peer's tunnel at a key of
            // the thief's. Sending the current key again drops nothing
            // held: only the admin decides.
            let held = match (&g.public_key, &public_key) {
                (_, None) => false,
                // The first key after an enrollment is taken even when it
                // is the one already recorded: from then on a change waits.
                (Some(cur), Some(new)) if cur == new => {
                    g.key_from_enrollment = false;
                    false
                }
                (Some(_), Some(new)) if !g.key_from_enrollment => {
                    g.pending_public_key = Some(*new);
                    true
                }
                (_, Some(new)) => {
                    g.public_key = Some(*new);
                    g.pending_public_key = None;
                    g.key_from_enrollment = false;
                    false
                }
            };
            if g == before {
                return Ok(());
            }
            let txn = Txn::new()
                .when(Compare::ModRevision(key.clone(), kv.mod_revision))
                .then(Op::put(key.clone(), encode(&g)));
            if self.store.txn(txn).await?.succeeded {
                if held {
                    tracing::warn!(
                        gateway = name,
                        "the gateway asks to change its WireGuard key; held until the admin runs `weftctl gateway \
                         accept-key {name} KEY` with the key its host logged (peers keep the current key)"
                    );
                } else {
                    tracing::info!(gateway = name, "gateway key or endpoint changed");
                }
                return Ok(());
            }
        }
        Err(Error::Aborted("the gateway's record kept changing; retry".into()))
    }

    /// Takes the WireGuard key gateway `name` asked for (held by
    /// [`State::update_gateway`]) if it is `expected`: peers get it at
    /// once.
    pub async fn accept_gateway_key(
        &self,
        name: &str,
        expected: &crate::domain::WgKey,
    ) -> Result<crate::domain::Gateway, Error> {
        let key = self.at(Key::Gateway(name));
        for _ in 0..super::MAX_ATTEMPTS {
            let Some(kv) = self.store.get(&key).await? else {
                return Err(Error::NotFound(format!(
                    "there is no gateway {name:?}; list them with `weftctl gateways`"
                )));
            };
            let mut g: crate::domain::Gateway = super::decode(&kv)?;
            let Some(new) = g.pending_public_key.take() else {
                return Err(Error::FailedPrecondition(format!(
                    "gateway {name:?} has asked for no new key; its key is {}",
                    g.public_key.map_or("not set yet".to_string(), |k| k.to_string())
                )));
            };
            if new != *expected {
                return Err(Error::FailedPrecondition(format!(
                    "gateway {name:?} asked for key {new}, not {expected}: whoever asked is not the host you \
                     checked. Nothing changed; if its certificate may be stolen, remove the gateway and enroll \
                     it again"
                )));
            }
            g.public_key = Some(new);
            let txn = Txn::new()
                .when(Compare::ModRevision(key.clone(), kv.mod_revision))
                .then(Op::put(key.clone(), encode(&g)));
            if self.store.txn(txn).await?.succeeded {
                tracing::info!(gateway = name, "the admin accepted the gateway's new WireGuard key");
                return Ok(g);
            }
        }
        Err(Error::Aborted("the gateway's record kept changing; retry".into()))
    }
}
