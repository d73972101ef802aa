//! Names the site publishes: workloads' and exported hosts'. An export's
//! external address is an IPAM decision (it must not take a node's
//! "unknown source" address, nor they its), so it commits under the IPAM
//! guard like node subnets.

use std::net::{Ipv4Addr, Ipv6Addr};

use super::{Key, State, encode};
use crate::domain::now_ms;
use crate::error::Error;
use crate::names::{self, MAX_NAMES, NameKind, NameRecord};
use crate::store::{Compare, Op, Txn};

impl State {
    pub async fn create_name(
        &self,
        name: &str,
        address: Option<Ipv4Addr>,
        address_v6: Option<Ipv6Addr>,
        export: bool,
    ) -> Result<NameRecord, Error> {
        names::check_label("name", name).map_err(Error::InvalidArgument)?;
        if address.is_none() && (export || address_v6.is_none()) {
            return Err(Error::InvalidArgument(
                "address: give the workload's address (or the exported host's, with --export)".into(),
            ));
        }
        if export && address_v6.is_some() {
            return Err(Error::InvalidArgument(
                "address_v6: an exported host is reached over IPv4 only; publish it without an IPv6 address".into(),
            ));
        }
        let kind = if export {
            NameKind::ExportedHost
        } else {
            NameKind::Workload
        };
        let key = self.at(Key::Name(name));
        self.commit(|snap| {
            let site = snap.site()?;
            if let Some((n, _)) = snap.names.iter().find(|(n, _)| n.name == name) {
                let at = n.address.map(std::net::IpAddr::from).or(n.address_v6.map(Into::into));
                return Err(Error::AlreadyExists(format!(
                    "name {name:?} is already published for {}; delete it first (`weftctl name delete {name}`)",
                    at.map_or_else(|| "no address".to_string(), |a| a.to_string())
                )));
            }
            if snap.names.len() >= MAX_NAMES {
                return Err(Error::ResourceExhausted(format!(
                    "the site already publishes {MAX_NAMES} names, the most it may; delete some first"
                )));
            }
            let peerings: Vec<_> = snap.peerings.iter().map(|(p, _)| p).collect();
            match address {
                Some(a) => names::check_own_address(site, &peerings, kind, a)
                    .map_err(|m| Error::InvalidArgument(format!("address: {m}")))?,
                // Only an IPv6-only site names a workload by IPv6 alone: a
                // peer of an earlier version would refuse a name without
                // an IPv4 address, and with it every parameter it was sent.
                None if !site.pod_cidrs.is_empty() => {
                    return Err(Error::InvalidArgument(
                        "address: this site has IPv4 pods; give the workload's IPv4 address too (its IPv6 one \
                         with --address-v6)"
                            .into(),
                    ));
                }
                None => {}
            }
            if let Some(a) = address_v6 {
                names::check_own_address_v6(site, a).map_err(|m| Error::InvalidArgument(format!("address_v6: {m}")))?;
            }
            let mut rec = NameRecord {
                name: name.to_string(),
                kind,
                address,
                external: None,
                address_v6,
                created_at_ms: now_ms(),
            };
            // Every create is guarded like an IPAM change, so that two
            // replicas cannot both add the last allowed name.
            let txn = self.ipam_guard(snap, Txn::new());
            if let (true, Some(address)) = (export, address) {
                // weft's own hosts are not for peers to reach through a
                // tunnel: a node's address would hand them its overlay port.
                if let Some((_, who)) = snap.host_addresses(site).into_iter().find(|(a, _)| *a == address) {
                    return Err(Error::InvalidArgument(format!(
                        "address: {address} is the address of {who}; export a host on the site's LAN, not weft's own"
                    )));
                }
                if let Some((n, _)) = snap
                    .names
                    .iter()
                    .find(|(n, _)| n.external.is_some() && n.address == Some(address))
                {
                    return Err(Error::AlreadyExists(format!(
                        "address: {address} is already exported as {:?}; use that name",
                        n.name
                    )));
                }
                let mut taken: Vec<Ipv4Addr> = snap.names.iter().filter_map(|(n, _)| n.external).collect();
                taken.extend(
                    snap.internal_ips()
                        .into_iter()
                        .filter_map(|ip| crate::render::external_address(site, ip)),
                );
                rec.external = Some(names::allocate_external(site, &taken).map_err(Error::ResourceExhausted)?);
            }
            let txn = txn
                .when(Compare::Version(key.clone(), 0))
                .then(Op::put(key.clone(), encode(&rec)));
            Ok((Some(txn), rec))
        })
        .await
    }

    pub async fn delete_name(&self, name: &str) -> Result<NameRecord, Error> {
        names::check_label("name", name).map_err(Error::InvalidArgument)?;
        let key = self.at(Key::Name(name));
        self.commit(|snap| {
            let Some((rec, rev)) = snap.names.iter().find(|(n, _)| n.name == name) else {
                return Err(Error::NotFound(format!(
                    "name {name:?} is not published; list them with `weftctl names`"
                )));
            };
            let mut txn = Txn::new();
            if rec.external.is_some() {
                txn = self.ipam_guard(snap, txn);
            }
            let txn = txn
                .when(Compare::ModRevision(key.clone(), *rev))
                .then(Op::delete(key.clone()));
            Ok((Some(txn), rec.clone()))
        })
        .await
    }

    /// The names this site publishes, by name.
    pub async fn list_names(&self) -> Result<Vec<NameRecord>, Error> {
        let mut v: Vec<NameRecord> = self.snapshot().await?.names.into_iter().map(|n| n.0).collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(v)
    }
}
