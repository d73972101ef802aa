//! A peering's export policy ([`crate::export`]): set by this site's admin
//! on the peering's record, which the gateways render from.

use super::{Key, State, encode};
use crate::domain::{Peering, validate_name};
use crate::error::Error;
use crate::export::ExportPolicy;
use crate::store::{Compare, Op, Txn};

impl State {
    /// Sets the export policy of the peering with `peer_site` (None: the
    /// site's default). `rules` are checked against the site by
    /// [`crate::export::parse_rules`] under the same snapshot.
    pub async fn set_export_policy(
        &self,
        peer_site: &str,
        mode: Option<Mode>,
        rules: &[weft_proto::v1::ExportRule],
    ) -> Result<Peering, Error> {
        validate_name("site_id", peer_site).map_err(Error::InvalidArgument)?;
        let key = self.at(Key::Peering(peer_site));
        self.commit(|snap| {
            let site = snap.site()?;
            let Some((p, rev)) = snap.peerings.iter().find(|(p, _)| p.site_id == peer_site) else {
                return Err(Error::NotFound(format!(
                    "there is no peering with site {peer_site:?}; list them with `weftctl peerings`"
                )));
            };
            let export = match mode {
                Some(Mode::All) => Some(ExportPolicy::All),
                Some(Mode::Rules) => Some(ExportPolicy::Rules(
                    crate::export::parse_rules(site, rules).map_err(Error::InvalidArgument)?,
                )),
                None => None,
            };
            if export == p.export {
                return Ok((None, p.clone()));
            }
            let mut next = p.clone();
            next.export = export;
            // Under the IPAM guard: the rules were checked against the
            // site's CIDRs, which a replica's restart may change meanwhile.
            let txn = self
                .ipam_guard(snap, Txn::new())
                .when(Compare::ModRevision(key.clone(), *rev))
                .then(Op::put(key.clone(), encode(&next)));
            Ok((Some(txn), next))
        })
        .await
        .inspect(|p| tracing::info!(peer = %peer_site, policy = ?p.export, "export policy"))
    }
}

/// What an admin sets: everything, or only the rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    All,
    Rules,
}
