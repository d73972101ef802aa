//! A peering's export policy ([`crate::export`]) and transit flag
//! ([`crate::transit`]): set by this site's admin on the peering's record,
//! which the gateways render from.

use super::{Key, State, encode};
use crate::domain::{Peering, validate_name};
use crate::error::Error;
use crate::export::ExportPolicy;
use crate::store::{Compare, Op, Txn};

impl State {
    /// Sets the export policy of the peering with `peer_site` (None: the
    /// site's default). Its rules are checked against the site by
    /// [`crate::export::parse_rules`] under the same snapshot.
    pub async fn set_export_policy(
        &self,
        peer_site: &str,
        wanted: Option<ExportPolicy<&[weft_proto::v1::ExportRule]>>,
    ) -> Result<Peering, Error> {
        validate_name("site_id", peer_site).map_err(Error::InvalidArgument)?;
        let key = self.at(Key::Peering(peer_site));
        self.commit(|snap| {
            let site = snap.site()?;
            let (p, rev) = snap.peering(peer_site)?;
            let export = match wanted {
                Some(ExportPolicy::All) => Some(ExportPolicy::All),
                Some(ExportPolicy::Rules(rules)) => Some(ExportPolicy::Rules(
                    crate::export::parse_rules(
                        site,
                        &crate::transit::onward(snap.peerings.iter().map(|(q, _)| q), p),
                        rules,
                    )
                    .map_err(Error::InvalidArgument)?,
                )),
                None => None,
            };
            let mut next = p.clone();
            next.export = export;
            // A policy only holds where the gateway's agent enforces it (an
            // older one ignores it): refused while a gateway has not said
            // it does, checked against the gateways' records as written.
            let mut txn = Txn::new();
            if let Some(rules) = crate::export::effective(site, &next) {
                let old = |enforces: fn(&crate::domain::Gateway) -> bool| -> Vec<&str> {
                    snap.gateways
                        .iter()
                        .filter(|(g, _)| !enforces(g))
                        .map(|(g, _)| g.name.as_str())
                        .collect()
                };
                let old_v4 = old(|g| g.enforces_export);
                if !old_v4.is_empty() {
                    return Err(Error::FailedPrecondition(format!(
                        "gateway {} runs an agent that does not enforce export policies (an older version, or it \
                         has not connected since its upgrade); upgrade it and let it connect, or remove it, then \
                         set the policy again",
                        old_v4.join(", ")
                    )));
                }
                // An older agent refuses a filter with an IPv6 rule whole.
                let old_v6 = old(|g| g.enforces_export_v6);
                if rules.iter().any(|r| r.cidr.addr().is_ipv6()) && !old_v6.is_empty() {
                    return Err(Error::FailedPrecondition(format!(
                        "gateway {} runs an agent that takes no IPv6 prefixes in export policies (an older \
                         version, or it has not connected since its upgrade); upgrade it and let it connect, or \
                         allow IPv4 prefixes only for now",
                        old_v6.join(", ")
                    )));
                }
                for (g, grev) in &snap.gateways {
                    txn = txn.when(Compare::ModRevision(self.at(Key::Gateway(&g.name)), *grev));
                }
            }
            if next.export == p.export {
                return Ok((None, p.clone()));
            }
            // Under the IPAM guard: the rules were checked against the
            // site's CIDRs, which a replica's restart may change meanwhile.
            let txn = self
                .ipam_guard(snap, txn)
                .when(Compare::ModRevision(key.clone(), *rev))
                .then(Op::put(key.clone(), encode(&next)));
            Ok((Some(txn), next))
        })
        .await
        .inspect(|p| tracing::info!(peer = %peer_site, policy = ?p.export, "export policy"))
    }

    /// Sets whether this site agrees to transit on the peering with
    /// `peer_site`, and plans (or drops) the views of the sites the peer
    /// offers, in one transaction under the IPAM guard.
    pub async fn set_transit(&self, peer_site: &str, enabled: bool) -> Result<Peering, Error> {
        validate_name("site_id", peer_site).map_err(Error::InvalidArgument)?;
        let key = self.at(Key::Peering(peer_site));
        self.commit(|snap| {
            let site = snap.site()?;
            if site.id == peer_site {
                return Err(Error::InvalidArgument(format!(
                    "site_id: {peer_site:?} is this site; transit to itself would be a transit loop"
                )));
            }
            let (p, rev) = snap.peering(peer_site)?;
            let mut next = p.clone();
            next.transit = enabled;
            next.transit_views = match &p.remote {
                Some(r) => Self::plan_transit(snap, site, &next, r, &[]),
                None => vec![],
            };
            next.transit_views_v6 = match &p.remote {
                Some(r) => super::ipv6::plan_transit(snap, site, &next, r),
                None => vec![],
            };
            if next == *p {
                return Ok((None, next));
            }
            let txn = self
                .ipam_guard(snap, Txn::new())
                .when(Compare::ModRevision(key.clone(), *rev))
                .then(Op::put(key.clone(), encode(&next)));
            Ok((Some(txn), next))
        })
        .await
        .inspect(|p| tracing::info!(peer = %peer_site, transit = p.transit, "transit"))
    }
}
