//! Reading weft's counters back from its table: per peer site in a node's
//! own namespace, and a peering namespace's drops, policy refusals and
//! transit (for the agent's metrics; blocking, for threads of their own).

use std::collections::BTreeMap;

use serde_json::Value;

use super::{DROPPED_COUNTER, POLICY_COUNTER, TRANSIT_COUNTER_PREFIX};
use crate::model::NFT_TABLE;

/// Traffic counted for one peer site in one family.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerTraffic {
    pub peer_site: String,
    pub family: weft_types::net::Family,
    pub tx_bytes: u64,
    pub tx_packets: u64,
    pub rx_bytes: u64,
    pub rx_packets: u64,
}

/// The name of a node's counter of traffic to (`tx`) or from (`rx`) peer
/// `site`'s views of family `f`: `tx-b` for IPv4 (as before IPv6),
/// `tx6-b` for IPv6.
pub(super) fn peer_counter(dir: &str, f: weft_types::net::Family, site: &str) -> String {
    match f {
        weft_types::net::Family::V4 => format!("{dir}-{site}"),
        weft_types::net::Family::V6 => format!("{dir}6-{site}"),
    }
}

/// The per-peer counters of the table in `listing` (`nft -j list counters
/// table inet weft`), by peer site and family.
pub fn parse_counters(listing: &Value) -> Vec<PeerTraffic> {
    use weft_types::net::Family;
    let mut by_site: BTreeMap<(String, Family), PeerTraffic> = BTreeMap::new();
    for item in listing["nftables"].as_array().into_iter().flatten() {
        let c = &item["counter"];
        let (Some(name), Some(bytes), Some(packets)) = (c["name"].as_str(), c["bytes"].as_u64(), c["packets"].as_u64())
        else {
            continue;
        };
        let Some((dir, site)) = name.split_once('-') else {
            continue;
        };
        let (tx, family) = match dir {
            "tx" => (true, Family::V4),
            "rx" => (false, Family::V4),
            "tx6" => (true, Family::V6),
            "rx6" => (false, Family::V6),
            _ => continue,
        };
        let e = by_site
            .entry((site.to_string(), family))
            .or_insert_with(|| PeerTraffic {
                peer_site: site.to_string(),
                family,
                tx_bytes: 0,
                tx_packets: 0,
                rx_bytes: 0,
                rx_packets: 0,
            });
        if tx {
            (e.tx_bytes, e.tx_packets) = (bytes, packets);
        } else {
            (e.rx_bytes, e.rx_packets) = (bytes, packets);
        }
    }
    by_site.into_values().collect()
}

/// The per-peer counters of the agent's own namespace (None: no table).
/// Blocking: for a thread of its own, not the async runtime.
pub fn counters_blocking() -> Option<Vec<PeerTraffic>> {
    let out = std::process::Command::new("nft")
        .args(["-j", "list", "counters", "table", "inet", NFT_TABLE])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    Some(parse_counters(&serde_json::from_slice(&out.stdout).ok()?))
}

/// Packets counted by [`DROPPED_COUNTER`] and by [`POLICY_COUNTER`] (0
/// without a policy) in the calling thread's network namespace (a
/// peering's), and the handle of the table holding them: the kernel gives
/// each new table a new one, so a changed handle says the counters started
/// over. None when there is no table.
pub fn dropped_blocking() -> Option<TableCounters> {
    let out = std::process::Command::new("nft")
        .args(["-j", "list", "table", "inet", NFT_TABLE])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let v: Value = serde_json::from_slice(&out.stdout).ok()?;
    let items = v["nftables"].as_array()?;
    let packets = |name: &str| {
        items.iter().find_map(|x| {
            (x["counter"]["name"] == name)
                .then(|| x["counter"]["packets"].as_u64())
                .flatten()
        })
    };
    Some(TableCounters {
        table: items.iter().find_map(|x| x["table"]["handle"].as_u64())?,
        dropped: packets(DROPPED_COUNTER)?,
        refused: packets(POLICY_COUNTER).unwrap_or(0),
        transit: items
            .iter()
            .filter_map(|x| {
                let site = x["counter"]["name"].as_str()?.strip_prefix(TRANSIT_COUNTER_PREFIX)?;
                Some((site.to_string(), x["counter"]["packets"].as_u64()?))
            })
            .collect(),
    })
}

/// What [`dropped_blocking`] read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableCounters {
    pub table: u64,
    pub dropped: u64,
    pub refused: u64,
    /// Packets forwarded onward, by the site they went to (transit).
    pub transit: BTreeMap<String, u64>,
}
