//! weft's nftables table, `inet weft`, one per namespace (both families;
//! `ip weft` of earlier versions goes in the batch that writes it): prefix NAT and the
//! MSS clamp in a peering's namespace; source NAT of host traffic into the
//! overlay and per-peer counters in a node's own namespace. The table is
//! rendered whole from a [`TableSpec`] (pure, below) and replaced in one
//! atomic `nft -f` batch.
//!
//! The batch is nft's JSON, built here by hand: the `nftables` crate's
//! typed schema (0.6.3, the newest) has no `netmap` NAT flag and no prefix
//! type flag, so it cannot say `dnat ip prefix to … netmap`, the 1:1
//! prefix translation weft is built on. nft itself parses every batch
//! before applying any of it, and the end-to-end tests apply each kind.
//!
//! Observation: after writing, the firewall lists the table back and keeps
//! a hash of the listing (handles and counter values left out). A table
//! whose listing still has that hash is reported with its version; one
//! edited by hand, or one this process did not write, without, so the plan
//! rewrites it. A listing is taken again only when the namespace's ruleset
//! generation moved since the last (see `nftgen`).

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::host::{Firewall, R};
use crate::model::*;

mod counters;
pub use counters::{PeerTraffic, TableCounters, counters_blocking, dropped_blocking, parse_counters};

/// The counter of packets a peering's namespace dropped from its tunnel.
pub const DROPPED_COUNTER: &str = "dropped";
/// The counter of packets from the tunnel that the export policy refused
/// (not "policy": a keyword of nft's, so `nft list counter inet weft policy`
/// would not parse).
pub const POLICY_COUNTER: &str = "refused";
/// The counters of packets from the tunnel forwarded onward to another
/// peer (transit): this prefix and the site they lead to.
pub const TRANSIT_COUNTER_PREFIX: &str = "transit-";

fn prefix(n: &ipnet::IpNet) -> Value {
    json!({"prefix": {"addr": n.network().to_string(), "len": n.prefix_len()}})
}

/// nft's name of a family's header ("ip", "ip6").
fn proto(f: Family) -> &'static str {
    match f {
        Family::V4 => "ip",
        Family::V6 => "ip6",
    }
}

fn family_of(n: &ipnet::IpNet) -> Family {
    Family::of(n.addr())
}

/// `nets` of family `f`.
fn of_family<'a>(nets: impl IntoIterator<Item = &'a ipnet::IpNet>, f: Family) -> Vec<&'a ipnet::IpNet> {
    nets.into_iter().filter(|n| family_of(n) == f).collect()
}

const FAMILIES: [Family; 2] = [Family::V4, Family::V6];

fn add(x: Value) -> Value {
    json!({ "add": x })
}

fn chain(name: &str, kind: &str, hook: &str, prio: i32) -> Value {
    add(
        json!({"chain": {"family": "inet", "table": NFT_TABLE, "name": name, "type": kind, "hook": hook, "prio": prio, "policy": "accept"}}),
    )
}

fn rule(chain: &str, expr: Value) -> Value {
    add(json!({"rule": {"family": "inet", "table": NFT_TABLE, "chain": chain, "expr": expr}}))
}

fn field(f: Family, field: &str, op: &str, right: Value) -> Value {
    json!({"match": {"op": op, "left": {"payload": {"protocol": proto(f), "field": field}}, "right": right}})
}

fn counter(name: &str) -> Value {
    add(json!({"counter": {"family": "inet", "table": NFT_TABLE, "name": name}}))
}

/// nft's name of a family in `meta nfproto`.
fn nfproto(f: Family) -> &'static str {
    match f {
        Family::V4 => "ipv4",
        Family::V6 => "ipv6",
    }
}

fn meta(key: &str, op: &str, right: &str) -> Value {
    json!({"match": {"op": op, "left": {"meta": {"key": key}}, "right": right}})
}

/// The nft JSON batch that replaces weft's table with `spec` (an empty spec
/// removes it): add (so that the delete cannot fail), delete, then the new
/// table, all in one transaction; the table of earlier versions (`ip
/// weft`) goes in it too.
pub fn batch(spec: &TableSpec) -> Value {
    let legacy = json!({"table": {"family": "ip", "name": NFT_TABLE}});
    let table = json!({"table": {"family": "inet", "name": NFT_TABLE}});
    let mut cmds = vec![
        add(legacy.clone()),
        json!({ "delete": legacy }),
        add(table.clone()),
        json!({ "delete": table.clone() }),
    ];
    if spec.is_empty() {
        return json!({ "nftables": cmds });
    }
    cmds.push(add(table));
    if spec.mss_clamp {
        // tcp flags syn / syn,rst tcp option maxseg size set rt mtu: TCP
        // across the tunnel never depends on PMTU discovery (ICMP that NAT
        // or a firewall on the way may eat).
        cmds.push(chain("mss", "filter", "forward", -150));
        let syn = json!({"match": {"op": "==", "left": {"&": [{"payload": {"protocol": "tcp", "field": "flags"}}, ["syn", "rst"]]}, "right": "syn"}});
        let clamp = json!({"mangle": {"key": {"tcp option": {"name": "maxseg", "field": "size"}}, "value": {"rt": {"key": "mtu"}}}});
        cmds.push(rule("mss", json!([syn, clamp])));
    }
    if !spec.nat.is_empty() {
        cmds.push(chain("pre", "nat", "prerouting", -100));
        cmds.push(chain("post", "nat", "postrouting", 100));
        for m in &spec.nat {
            let f = family_of(&m.local);
            // Toward the tunnel: the local view becomes the real CIDR.
            let dnat = json!({"dnat": {"family": proto(f), "addr": prefix(&m.real), "flags": "netmap", "type_flags": "prefix"}});
            let pre = json!([
                meta("iifname", "!=", &m.tunnel),
                field(f, "daddr", "==", prefix(&m.local)),
                dnat
            ]);
            cmds.push(rule("pre", pre));
            // From the tunnel: the real CIDR becomes the local view.
            let snat = json!({"snat": {"family": proto(f), "addr": prefix(&m.local), "flags": "netmap", "type_flags": "prefix"}});
            let post = json!([
                meta("iifname", "==", &m.tunnel),
                field(f, "saddr", "==", prefix(&m.real)),
                snat
            ]);
            cmds.push(rule("post", post));
        }
    }
    if !spec.exports.is_empty() {
        // Exported hosts: from the tunnel, an export's external address
        // becomes the host's (the peer's real CIDRs were mapped above).
        cmds.push(chain("export", "nat", "prerouting", -100));
        for x in &spec.exports {
            cmds.push(rule(
                "export",
                json!([
                    meta("iifname", "==", &x.tunnel),
                    field(Family::V4, "daddr", "==", json!(x.external.to_string())),
                    {"dnat": {"family": "ip", "addr": x.host.to_string()}}
                ]),
            ));
        }
    }
    if !spec.snat.is_empty() {
        cmds.push(chain("snat", "nat", "postrouting", 100));
    }
    for h in &spec.snat {
        let f = Family::of(h.address);
        let mut expr = vec![meta("oifname", "==", &h.link)];
        let except: Vec<Value> = of_family(&h.except, f).into_iter().map(prefix).collect();
        if except.is_empty() {
            expr.push(json!({"match": {"op": "==", "left": {"meta": {"key": "nfproto"}}, "right": nfproto(f)}}));
        } else {
            expr.push(field(f, "saddr", "!=", json!({ "set": except })));
        }
        expr.push(json!({"snat": {"family": proto(f), "addr": h.address.to_string()}}));
        cmds.push(rule("snat", Value::Array(expr)));
    }
    if let Some(f) = &spec.filter {
        // From the tunnel, forward only to what the peering allows; the
        // rest (the gateway host's addresses, the overlay) is counted and
        // dropped. After the exports' DNAT (prerouting), so an export's
        // host is what is checked.
        cmds.push(chain("from_tunnel", "filter", "forward", 0));
        cmds.push(counter(DROPPED_COUNTER));
        // Transit: what goes onward to another peer, counted per site
        // (before the policy: what the peer sent that way).
        for (site, nets) in &f.transit {
            let name = format!("{TRANSIT_COUNTER_PREFIX}{site}");
            cmds.push(counter(&name));
            for family in FAMILIES {
                let set: Vec<Value> = of_family(nets, family).into_iter().map(prefix).collect();
                if set.is_empty() {
                    continue;
                }
                cmds.push(rule(
                    "from_tunnel",
                    json!([
                        meta("iifname", "==", &f.tunnel),
                        field(family, "daddr", "==", json!({ "set": set })),
                        {"counter": name}
                    ]),
                ));
            }
        }
        // Per family: what is not allowed is dropped; a family with
        // nothing allowed, whole (and anything neither IPv4 nor IPv6).
        for family in FAMILIES {
            let allowed: Vec<Value> = of_family(f.allowed.iter().chain(f.transit.iter().flat_map(|(_, n)| n)), family)
                .into_iter()
                .map(prefix)
                .collect();
            let which = if allowed.is_empty() {
                json!({"match": {"op": "==", "left": {"meta": {"key": "nfproto"}}, "right": nfproto(family)}})
            } else {
                field(family, "daddr", "!=", json!({ "set": allowed }))
            };
            cmds.push(rule(
                "from_tunnel",
                json!([meta("iifname", "==", &f.tunnel), which, {"counter": DROPPED_COUNTER}, {"drop": null}]),
            ));
        }
        if let Some(rules) = &f.policy {
            policy(&mut cmds, &f.tunnel, rules);
        }
    }
    if !spec.accounting.is_empty() {
        for (hook, name) in [("forward", "acct_fwd"), ("output", "acct_out"), ("input", "acct_in")] {
            cmds.push(chain(name, "filter", hook, -200));
        }
        // A pair of counters per peer and family it has views of.
        for (site, nets) in &spec.accounting {
            let families: std::collections::BTreeSet<Family> = nets.iter().map(family_of).collect();
            for f in families {
                for dir in ["tx", "rx"] {
                    cmds.push(counter(&counters::peer_counter(dir, f, site)));
                }
            }
            for n in nets {
                let family = family_of(n);
                for (f, dir, chains) in [
                    ("daddr", "tx", ["acct_fwd", "acct_out"]),
                    ("saddr", "rx", ["acct_fwd", "acct_in"]),
                ] {
                    for c in chains {
                        cmds.push(rule(
                            c,
                            json!([field(family, f, "==", prefix(n)), {"counter": counters::peer_counter(dir, family, site)}]),
                        ));
                    }
                }
            }
        }
    }
    json!({ "nftables": cmds })
}

/// The export policy, after the tunnel filter in `from_tunnel`: replies
/// to connections this side opened pass; a packet the peer sent passes
/// when a rule allows its connection's destination as the peer addressed
/// it (conntrack's original destination: an export's external address,
/// before its DNAT), protocol and port; the rest is counted and dropped. Every packet is
/// checked, not only a connection's first, so a narrower policy also ends
/// open connections it no longer allows, and a table replaced in one
/// transaction keeps those it still allows.
fn policy(cmds: &mut Vec<Value>, tunnel: &str, rules: &[PolicyRule]) {
    cmds.push(counter(POLICY_COUNTER));
    let from_tunnel = meta("iifname", "==", tunnel);
    cmds.push(rule(
        "from_tunnel",
        json!([
            from_tunnel.clone(),
            {"match": {"op": "==", "left": {"ct": {"key": "direction"}}, "right": "reply"}},
            {"accept": null}
        ]),
    ));
    for r in rules {
        // (The family said first: in a table of both families nft can
        // type the connection's address and port only once it knows it.)
        let family = family_of(&r.cidr);
        let daddr = format!("{} daddr", proto(family));
        let mut expr = vec![
            from_tunnel.clone(),
            json!({"match": {"op": "==", "left": {"meta": {"key": "nfproto"}}, "right": nfproto(family)}}),
            json!({"match": {"op": "==", "left": {"ct": {"key": daddr, "dir": "original"}}, "right": prefix(&r.cidr)}}),
        ];
        // The connection's protocol and destination port, as conntrack
        // has them: an ICMP error about an allowed connection (say, "need
        // to fragment" for a UDP service) inherits its verdict.
        if let Some(p) = r.protocol {
            // (ICMPv6 by number: its name differs between /etc/protocols
            // files.)
            let right = match (p, family) {
                (Protocol::Icmp, Family::V6) => json!(58),
                _ => json!(p.as_str()),
            };
            expr.push(json!({"match": {"op": "==", "left": {"ct": {"key": "protocol"}}, "right": right}}));
        }
        if let (Some(Protocol::Tcp | Protocol::Udp), Some((a, b))) = (r.protocol, r.ports) {
            let right = if a == b { json!(a) } else { json!({"range": [a, b]}) };
            expr.push(
                json!({"match": {"op": "==", "left": {"ct": {"key": "proto-dst", "dir": "original"}}, "right": right}}),
            );
        }
        expr.push(json!({"accept": null}));
        cmds.push(rule("from_tunnel", Value::Array(expr)));
    }
    cmds.push(rule(
        "from_tunnel",
        json!([from_tunnel, {"counter": POLICY_COUNTER}, {"drop": null}]),
    ));
}

/// A listing with what changes by itself (handles, counter values, the
/// tool's own metadata) left out, hashed.
fn listing_hash(listing: &Value) -> u64 {
    fn strip(v: &mut Value) {
        match v {
            Value::Object(m) => {
                for k in ["handle", "packets", "bytes"] {
                    m.remove(k);
                }
                m.values_mut().for_each(strip);
            }
            Value::Array(a) => {
                a.retain(|x| x.get("metainfo").is_none());
                a.iter_mut().for_each(strip);
            }
            _ => {}
        }
    }
    let mut v = listing.clone();
    strip(&mut v);
    use sha2::Digest;
    let d = sha2::Sha256::digest(v.to_string().as_bytes());
    u64::from_be_bytes(d[..8].try_into().expect("32 bytes"))
}

/// `nft` in namespace `ns` ("" the agent's own), with `input` on stdin.
async fn nft(ns: &Ns, args: &[&str], input: Option<String>) -> R<Vec<u8>> {
    use tokio::io::AsyncWriteExt;
    let mut cmd = if ns.is_empty() {
        tokio::process::Command::new("nft")
    } else {
        let mut c = tokio::process::Command::new("ip");
        c.args(["netns", "exec", ns, "nft"]);
        c
    };
    cmd.args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn().map_err(|e| format!("cannot run nft: {e}"))?;
    let mut stdin = child.stdin.take().expect("piped");
    if let Some(text) = input {
        stdin
            .write_all(text.as_bytes())
            .await
            .map_err(|e| format!("cannot write to nft: {e}"))?;
    }
    drop(stdin);
    let out = child.wait_with_output().await.map_err(|e| format!("nft failed: {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
    }
    Ok(out.stdout)
}

/// Conntrack entries to end after a table change, by their original
/// direction: to a destination in a prefix, or from a source in one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stale {
    To(ipnet::IpNet),
    From(ipnet::IpNet),
}

/// The translations that changed between `old` and `new` (the table a
/// namespace had and the one replacing it): an export whose host changed,
/// came or went (its external address), a remapped view that changed, came
/// or went (its local view as a destination, the peer's real CIDR as a
/// source). Conntrack keeps a flow's translation for the flow's life, so a
/// UDP flow that never idles would keep going to the old place (or stay
/// untranslated) unless these entries end; the next packet then takes the
/// new rules. Flows whose translation did not change are left alone.
pub fn stale(old: &TableSpec, new: &TableSpec) -> Vec<Stale> {
    use std::collections::BTreeSet;
    let exports = |t: &TableSpec| -> BTreeSet<(std::net::Ipv4Addr, std::net::Ipv4Addr)> {
        t.exports.iter().map(|x| (x.external, x.host)).collect()
    };
    let nat =
        |t: &TableSpec| -> BTreeSet<(ipnet::IpNet, ipnet::IpNet)> { t.nat.iter().map(|n| (n.local, n.real)).collect() };
    let mut out = BTreeSet::new();
    for (external, _) in exports(old).symmetric_difference(&exports(new)) {
        out.insert(Stale::To(ipnet::IpNet::from(std::net::IpAddr::V4(*external))));
    }
    for (local, real) in nat(old).symmetric_difference(&nat(new)) {
        out.insert(Stale::To(*local));
        out.insert(Stale::From(*real));
    }
    out.into_iter().collect()
}

/// Ends the conntrack entries `what` names in namespace `ns` (`conntrack
/// -D`); none to end is fine.
async fn forget(ns: &Ns, what: Stale) -> R<()> {
    let (flag, mask, net) = match what {
        Stale::To(n) => ("--orig-dst", "--mask-dst", n),
        Stale::From(n) => ("--orig-src", "--mask-src", n),
    };
    let (addr, netmask) = (net.network().to_string(), net.netmask().to_string());
    let family = match net {
        ipnet::IpNet::V4(_) => "ipv4",
        ipnet::IpNet::V6(_) => "ipv6",
    };
    let mut cmd = if ns.is_empty() {
        tokio::process::Command::new("conntrack")
    } else {
        let mut c = tokio::process::Command::new("ip");
        c.args(["netns", "exec", ns, "conntrack"]);
        c
    };
    cmd.args(["-D", "-f", family, flag, &addr, mask, &netmask])
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let out = cmd.output().await.map_err(|e| format!("cannot run conntrack: {e}"))?;
    let said = String::from_utf8_lossy(&out.stderr);
    // It exits 1 when it deleted nothing.
    if out.status.success() || said.contains("0 flow entries") {
        Ok(())
    } else {
        Err(said.trim().to_string())
    }
}

/// nftables through the `nft` tool (its JSON interface), off the async
/// runtime's threads (a child process, awaited).
#[derive(Debug, Default)]
pub struct Nft {
    /// Per namespace: the version written and the hash of its listing.
    written: BTreeMap<Ns, (u64, u64)>,
    /// Per namespace: the table this process last wrote there, to end the
    /// conntrack entries of translations the next one changes.
    last: BTreeMap<Ns, TableSpec>,
    /// Per namespace: the ruleset's generation when [`Firewall::tables`]
    /// last listed there, and what it found: true while the generation is
    /// the same (see `nftgen`), so a resync that finds nothing changed
    /// runs no `nft`.
    listed: BTreeMap<Ns, (crate::nftgen::Generation, BTreeMap<String, Option<u64>>)>,
}

impl Nft {
    async fn listing(ns: &Ns) -> R<u64> {
        let out = nft(ns, &["-j", "list", "table", "inet", NFT_TABLE], None).await?;
        let v: Value = serde_json::from_slice(&out).map_err(|e| format!("nft's listing is not JSON: {e}"))?;
        Ok(listing_hash(&v))
    }
}

#[async_trait::async_trait]
impl Firewall for Nft {
    async fn tables(&mut self, ns: &Ns) -> R<BTreeMap<String, Option<u64>>> {
        // Read before listing: a change made meanwhile gives the next read
        // another generation, so it lists again.
        let generation = match crate::nftgen::generation(ns).await {
            Ok(g) => Some(g),
            Err(e) => {
                tracing::debug!(ns = %ns, error = %e, "no nftables generation: listing");
                None
            }
        };
        if let (Some(g), Some((at, tables))) = (generation, self.listed.get(ns))
            && g == *at
        {
            return Ok(tables.clone());
        }
        let out = nft(ns, &["-j", "list", "tables"], None).await?;
        let v: Value = serde_json::from_slice(&out).map_err(|e| format!("nft's listing is not JSON: {e}"))?;
        // weft's, as "family name": `inet weft`, and family ip's of weft's
        // name (earlier versions'). Another `inet weft…` table is not
        // weft's: it never made one.
        let mut tables: BTreeMap<String, Option<u64>> = v["nftables"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|x| {
                let (family, name) = (x["table"]["family"].as_str()?, x["table"]["name"].as_str()?);
                let ours = match family {
                    "inet" => name == NFT_TABLE,
                    "ip" => name.starts_with(PREFIX),
                    _ => false,
                };
                ours.then(|| (format!("{family} {name}"), None))
            })
            .collect();
        let ours = OWN_TABLE.to_string();
        if tables.contains_key(&ours)
            && let Some((version, hash)) = self.written.get(ns).copied()
            && Nft::listing(ns).await? == hash
        {
            tables.insert(ours, Some(version));
        }
        match generation {
            Some(g) => self.listed.insert(ns.clone(), (g, tables.clone())),
            None => self.listed.remove(ns),
        };
        Ok(tables)
    }

    async fn set_table(&mut self, ns: &Ns, spec: &TableSpec) -> R<()> {
        self.written.remove(ns);
        self.listed.remove(ns);
        nft(ns, &["-j", "-f", "-"], Some(batch(spec).to_string()))
            .await
            .map_err(|e| format!("cannot write the nftables table in {}: {e}", shown(ns)))?;
        let hash = Nft::listing(ns).await?;
        self.written.insert(ns.clone(), (spec.version(), hash));
        // (After an agent restart nothing is known of the old table: the
        // entries are left to idle out.)
        if let Some(old) = self.last.insert(ns.clone(), spec.clone()) {
            for what in stale(&old, spec) {
                match forget(ns, what).await {
                    Ok(()) => tracing::debug!(ns = %ns, ?what, "ended the conntrack entries of a changed translation"),
                    // The table is right; old flows keep their translation
                    // until they idle out.
                    Err(e) => tracing::warn!(ns = %ns, ?what, error = %e, "cannot end stale conntrack entries"),
                }
            }
        }
        Ok(())
    }

    async fn delete_table(&mut self, ns: &Ns, name: &str) -> R<()> {
        self.listed.remove(ns);
        if name == OWN_TABLE {
            self.written.remove(ns);
            self.last.remove(ns);
        }
        let (family, table) = name
            .split_once(' ')
            .filter(|(f, t)| (*f == "ip" && t.starts_with(PREFIX)) || (*f == "inet" && *t == NFT_TABLE))
            .ok_or_else(|| format!("{name:?} is not a table of weft's"))?;
        match nft(ns, &["delete", "table", family, table], None).await {
            Ok(_) => Ok(()),
            Err(e) if e.contains("No such file") => Ok(()),
            Err(e) => Err(format!("cannot delete table {name} in {}: {e}", shown(ns))),
        }
    }
}

fn shown(ns: &Ns) -> String {
    if ns.is_empty() {
        "the host's namespace".into()
    } else {
        format!("namespace {ns}")
    }
}

#[cfg(test)]
mod tests;
