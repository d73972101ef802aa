//! The guard in front of an applier: every desired object, as decoded at
//! the agent's door, is checked before the applier sees it; one that did
//! not decode is refused with why.

use weft_proto::v1 as pb;

use super::{Guard, Links, links};
use crate::apply::{Applier, HostNets, Objects, Scope};
use crate::desired::Held;

/// An applier behind the guard: refused objects are reported, not applied.
pub struct Guarded<A> {
    pub inner: A,
    pub guard: Guard,
    /// The ids refused at the last apply: a refusal is logged when it
    /// starts, and reported at every apply.
    refused: std::collections::BTreeSet<String>,
}

impl<A> Guarded<A> {
    pub fn new(inner: A, guard: Guard) -> Self {
        Guarded {
            inner,
            guard,
            refused: Default::default(),
        }
    }
}

/// Whether `o` may reach the applier: it decoded, and the guard lets it.
fn verdict(guard: &Guard, o: &Held, links: &Links) -> Result<(), String> {
    match &o.decoded {
        Ok(object) => guard.check(object, links),
        Err(why) => Err(why.clone()),
    }
}

#[async_trait::async_trait]
impl<A: Applier> Applier for Guarded<A> {
    async fn apply(&mut self, applied: &Objects, desired: &Objects, scope: Scope) -> Vec<pb::ObjectError> {
        let started = std::time::Instant::now();
        // The host as it is now: a network attached since the last apply
        // turns away the routes over it.
        match self.inner.host_nets().await {
            None => {}
            Some(Ok(host)) => self.guard.set_host(host),
            Some(Err(e)) => self.guard.host_unread(e),
        }
        // The links as they will be.
        let links = links(desired.values().filter_map(Held::object));
        // The inner applier sees only what passes: a refused object was
        // never applied, so there is nothing of it to replace or delete.
        // (Copied only when something applied was refused, which is rare.)
        let applied_refused = applied.values().any(|o| verdict(&self.guard, o, &links).is_err());
        let applied_ok: Option<Objects> = applied_refused.then(|| {
            applied
                .iter()
                .filter(|(_, o)| verdict(&self.guard, o, &links).is_ok())
                .map(|(k, o)| (k.clone(), o.clone()))
                .collect()
        });
        let mut refused = Vec::new();
        let mut ok = Objects::new();
        for (id, o) in desired {
            match verdict(&self.guard, o, &links) {
                Ok(()) => {
                    ok.insert(id.clone(), o.clone());
                }
                Err(why) => {
                    // Logged once, when it starts; reported at every apply.
                    // What does not decode is malformed (or of a newer
                    // version's making); what decodes and is refused
                    // reaches past what weft owns on this host.
                    let malformed = o.decoded.is_err();
                    if !self.refused.contains(id) {
                        if malformed {
                            tracing::warn!(id = %id, reason = %why, "refused a desired object: it does not decode");
                        } else {
                            tracing::warn!(id = %id, reason = %why, "refused a desired object: it reaches past what weft owns");
                        }
                    }
                    refused.push(pb::ObjectError {
                        id: id.clone(),
                        message: if malformed {
                            format!("refused by the agent: malformed: {why}")
                        } else {
                            format!("refused by the agent: {why}")
                        },
                    });
                }
            }
        }
        self.refused = refused.iter().map(|e| e.id.clone()).collect();
        let checked = started.elapsed();
        let mut errors = self
            .inner
            .apply(applied_ok.as_ref().unwrap_or(applied), &ok, scope)
            .await;
        tracing::debug!(
            guard_ms = checked.as_millis() as u64,
            total_ms = started.elapsed().as_millis() as u64,
            "the guard read the host and checked the objects"
        );
        errors.extend(refused);
        errors
    }

    fn tunnels(&mut self) -> Vec<pb::TunnelStatus> {
        self.inner.tunnels()
    }

    fn features(&mut self) -> Vec<String> {
        self.inner.features()
    }

    fn tunnel_changes(&self) -> Option<std::sync::Arc<tokio::sync::Notify>> {
        self.inner.tunnel_changes()
    }

    fn repairs(&self) -> Option<&'static tokio::sync::Notify> {
        self.inner.repairs()
    }

    fn step_paths(&mut self) -> bool {
        self.inner.step_paths()
    }

    fn writes(&self) -> u64 {
        self.inner.writes()
    }

    async fn host_report(&mut self, held: &Objects) -> pb::HostReport {
        self.inner.host_report(held).await
    }

    async fn host_nets(&mut self) -> Option<Result<HostNets, String>> {
        self.inner.host_nets().await
    }
}
