//! The node's DNS responder: answers `NAME.SITE.<zone>` with the address
//! of a peer's published name in this site's local view (the controller
//! renders them as `DnsRecord` objects, following view changes and peering
//! removal). Authoritative for the zone only: any other name is REFUSED, so
//! a resolver configured with it beside the host's (or a split-DNS route
//! for the zone) leaves every other name to the host's resolver. The wire
//! format is hickory-proto's; queries are rate-limited per source.
//!
//! [`answer`] is a pure function from a datagram to the reply (or none);
//! the property test feeds it random bytes.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::{Arc, RwLock};

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA, SOA};
use hickory_proto::rr::{DNSClass, Name, RData, Record, RecordType};
use weft_proto::v1 as pb;
use weft_proto::v1::desired_object::Kind;

/// Answers live this long in caches (views change; a removed peering's
/// names must vanish within seconds), and so do negative answers.
pub const TTL: u32 = 1;
/// Queries per second one source may send (and its burst).
pub const PER_SOURCE_QPS: u32 = 200;
/// Queries per second the responder answers in all.
pub const TOTAL_QPS: u32 = 5000;

/// The responder's configuration (node agents).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub listen: Listen,
    pub zone: Name,
}

/// Where the responder listens (`--dns-listen`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Listen {
    Off,
    /// The first address of the node's workload subnet (the address a
    /// workload bridge or the host's workload interface holds), port 53.
    Subnet,
    At(SocketAddr),
}

impl std::str::FromStr for Listen {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "off" => Ok(Listen::Off),
            "subnet" => Ok(Listen::Subnet),
            t => t.parse().map(Listen::At).map_err(|_| {
                format!(
                    "{t:?}: give ADDRESS:PORT (e.g. 10.1.0.1:53), \"subnet\" (its first address, port 53) or \"off\""
                )
            }),
        }
    }
}

/// Checks a `--dns-zone`: a domain name of DNS labels.
pub fn parse_zone(zone: &str) -> Result<Name, String> {
    let z = zone.trim().trim_end_matches('.').to_ascii_lowercase();
    if z.is_empty() || !z.split('.').all(weft_common::is_dns_label) {
        return Err(format!(
            "--dns-zone {zone:?} is not a domain name: give labels of letters, digits and '-' joined by dots, e.g. weft.internal"
        ));
    }
    let mut n = Name::from_ascii(&z).map_err(|e| format!("--dns-zone {zone:?}: {e}"))?;
    n.set_fqdn(true);
    Ok(n)
}

/// Checks a record before it is served (also the guard's check): its
/// address, and its IPv6 address if it has one.
pub fn check_record(r: &pb::DnsRecord) -> Result<(Option<Ipv4Addr>, Option<Ipv6Addr>), String> {
    let label = weft_common::is_dns_label;
    if !label(&r.name) {
        return Err(format!("DNS name {:?} is not a DNS label", r.name));
    }
    if r.site.len() > 63 || !r.site.split('.').all(label) {
        return Err(format!("DNS record site {:?} is not a site id", r.site));
    }
    // Empty: a name of an IPv6-only site, which has an IPv6 address.
    let a = match r.address.as_str() {
        "" if !r.address_v6.is_empty() => None,
        text => {
            let a: Ipv4Addr = weft_types::net::addr_v4(text).map_err(|m| format!("DNS record address {m}"))?;
            if a.is_unspecified() || a.is_loopback() || a.is_multicast() || a.is_broadcast() {
                return Err(format!("DNS record address {a} is not a unicast address"));
            }
            Some(a)
        }
    };
    let v6 = match r.address_v6.as_str() {
        "" => None,
        text => {
            let a = weft_types::net::addr_v6(text).map_err(|m| format!("DNS record IPv6 address {m}"))?;
            if weft_types::net::special_use(ipnet::IpNet::from(IpAddr::V6(a))).is_some() {
                return Err(format!(
                    "DNS record IPv6 address {a} is not a unicast address of a site"
                ));
            }
            Some(a)
        }
    };
    Ok((a, v6))
}

/// What the responder serves: "name.site" → address; the names above
/// them that exist without data ("site", and its parents for a dotted
/// site id); and the peers' views, from which queries are not answered.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Records {
    pub names: HashMap<String, Ipv4Addr>,
    /// The names' IPv6 addresses (AAAA), of those that have one.
    pub names_v6: HashMap<String, Ipv6Addr>,
    pub parents: HashSet<String>,
    pub views: BTreeMap<String, Vec<ipnet::IpNet>>,
}

impl Records {
    /// The records among `objects` (the agent's whole desired state): those
    /// that pass [`check_record`] and whose address lies in a view of the
    /// same peer that this node routes (`desired::peer_views`), so a name
    /// can only ever send a workload into that peer; an IPv6 address alike
    /// (one outside that peer's views is not served, the name's A is).
    pub fn of<'a>(objects: impl IntoIterator<Item = &'a pb::DesiredObject> + Clone) -> Records {
        let mut r = Records {
            views: weft_dataplane::desired::peer_views(objects.clone()),
            ..Default::default()
        };
        for o in objects {
            let Some(Kind::DnsRecord(d)) = &o.kind else { continue };
            let routed = |ip: IpAddr| {
                r.views
                    .get(&d.site)
                    .is_some_and(|v| v.iter().any(|net| net.contains(&ip)))
            };
            let Ok((a, v6)) = check_record(d) else { continue };
            // Its IPv4 address must be routed, or (a name without one, of
            // an IPv6-only site) its IPv6 one.
            let v6 = v6.filter(|v6| routed(IpAddr::V6(*v6)));
            if a.map_or(v6.is_some(), |a| routed(IpAddr::V4(a))) {
                let key = format!("{}.{}", d.name, d.site);
                if let Some(v6) = v6 {
                    r.names_v6.insert(key.clone(), v6);
                }
                if let Some(a) = a {
                    r.names.insert(key, a);
                }
                let mut parent = d.site.as_str();
                loop {
                    r.parents.insert(parent.to_string());
                    match parent.split_once('.') {
                        Some((_, up)) => parent = up,
                        None => break,
                    }
                }
            }
        }
        r
    }

    /// Whether `from` is in a peer's view: a peer's workload or host, which
    /// the responder does not serve (it would tell one peer about another).
    pub fn from_peer(&self, from: IpAddr) -> bool {
        self.views.values().flatten().any(|n| n.contains(&from))
    }
}

/// The records the responder serves now, swapped whole on each change.
#[derive(Clone, Debug, Default)]
pub struct Table(Arc<RwLock<Arc<Records>>>);

impl Table {
    pub fn set<'a>(&self, objects: impl IntoIterator<Item = &'a pb::DesiredObject> + Clone) {
        let new = Records::of(objects);
        let mut cur = self.0.write().unwrap();
        if **cur != new {
            tracing::debug!(names = new.names.len(), "DNS records changed");
            *cur = Arc::new(new);
        }
    }

    pub fn get(&self) -> Arc<Records> {
        self.0.read().unwrap().clone()
    }
}

fn soa(zone: &Name) -> Record {
    let ns = Name::from_ascii("ns")
        .and_then(|n| n.append_name(zone))
        .unwrap_or_else(|_| zone.clone());
    let mbox = Name::from_ascii("hostmaster")
        .and_then(|n| n.append_name(zone))
        .unwrap_or_else(|_| zone.clone());
    Record::from_rdata(zone.clone(), TTL, RData::SOA(SOA::new(ns, mbox, 1, 60, 60, 600, TTL)))
}

/// The reply to one datagram, or None when it gets none (not a DNS query:
/// garbage, or a response, which is never answered so that two responders
/// cannot loop).
pub fn answer(query: &[u8], zone: &Name, records: &Records) -> Option<Vec<u8>> {
    let msg = match Message::from_vec(query) {
        Ok(m) => m,
        // A header we can read: tell the sender its message is malformed.
        Err(_) if query.len() >= 12 && query[2] & 0x80 == 0 => {
            let id = u16::from_be_bytes([query[0], query[1]]);
            return Message::error_msg(id, OpCode::Query, ResponseCode::FormErr)
                .to_vec()
                .ok();
        }
        Err(_) => return None,
    };
    if msg.metadata.message_type != MessageType::Query {
        return None;
    }
    let mut out = Message::response(msg.metadata.id, msg.metadata.op_code);
    out.metadata.recursion_desired = msg.metadata.recursion_desired;
    if msg.metadata.op_code != OpCode::Query {
        out.metadata.response_code = ResponseCode::NotImp;
        return out.to_vec().ok();
    }
    let [q] = msg.queries.as_slice() else {
        out.metadata.response_code = ResponseCode::FormErr;
        return out.to_vec().ok();
    };
    out.add_query(q.clone());
    if let Some(theirs) = &msg.edns {
        let mut e = hickory_proto::op::Edns::new();
        e.set_max_payload(1232);
        out.set_edns(e);
        if theirs.version() > 0 {
            out.metadata.response_code = ResponseCode::BADVERS;
            return out.to_vec().ok();
        }
    }
    let qname = q.name().to_lowercase();
    if !zone.zone_of(&qname) || q.query_class() != DNSClass::IN {
        // Not ours: the host's resolver answers it.
        out.metadata.response_code = ResponseCode::Refused;
        return out.to_vec().ok();
    }
    out.metadata.authoritative = true;
    let labels: Vec<&[u8]> = qname.iter().collect();
    let relative = &labels[..labels.len().saturating_sub(usize::from(zone.num_labels()))];
    // A label with a dot in it (escaped) is no name of ours: None.
    let key = (!relative.iter().any(|l| l.contains(&b'.'))).then(|| {
        relative
            .iter()
            .map(|l| String::from_utf8_lossy(l))
            .collect::<Vec<_>>()
            .join(".")
    });
    let qtype = q.query_type();
    if relative.is_empty() {
        // The zone's apex.
        if matches!(qtype, RecordType::SOA | RecordType::ANY) {
            out.add_answer(soa(zone));
        } else {
            out.add_authority(soa(zone));
        }
        return out.to_vec().ok();
    }
    let key = key.as_deref().unwrap_or_default();
    let (a, v6) = (records.names.get(key), records.names_v6.get(key));
    // A name has an IPv4 address, an IPv6 one (a workload of an IPv6-only
    // site), or both.
    let exists = a.is_some() || v6.is_some();
    match exists.then_some(()) {
        Some(()) if matches!(qtype, RecordType::A | RecordType::AAAA | RecordType::ANY) => {
            let before = out.answers.len();
            if let Some(a) = a.filter(|_| matches!(qtype, RecordType::A | RecordType::ANY)) {
                out.add_answer(Record::from_rdata(q.name().clone(), TTL, RData::A(A(*a))));
            }
            if let Some(v6) = v6.filter(|_| matches!(qtype, RecordType::AAAA | RecordType::ANY)) {
                out.add_answer(Record::from_rdata(q.name().clone(), TTL, RData::AAAA(AAAA(*v6))));
            }
            // The name exists, without data of that type (AAAA of a name
            // without an IPv6 address, A of one without an IPv4 one).
            if out.answers.len() == before {
                out.add_authority(soa(zone));
            }
        }
        // The name exists, without data of that type.
        Some(()) => {
            out.add_authority(soa(zone));
        }
        // SITE.<zone> (and its parents) exist above their names.
        None if !key.is_empty() && records.parents.contains(key) => {
            out.add_authority(soa(zone));
        }
        None => {
            out.metadata.response_code = ResponseCode::NXDomain;
            out.add_authority(soa(zone));
        }
    }
    out.to_vec().ok()
}

/// What the responder did with a datagram (its metric's label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Answered,
    /// Not a query (garbage, a response).
    Dropped,
    /// Over the rate limits (every second one gets a bare REFUSED).
    Limited,
    /// From a peer's view: not served.
    FromPeer,
}

impl Outcome {
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Answered => "answered",
            Outcome::Dropped => "dropped",
            Outcome::Limited => "limited",
            Outcome::FromPeer => "from_peer",
        }
    }
}

/// A bare REFUSED (header and question: never larger than the query) for a
/// query over the limits, so a resolver moves on to its next server at
/// once instead of waiting out its timeout.
fn refused(query: &[u8]) -> Option<Vec<u8>> {
    let msg = Message::from_vec(query).ok()?;
    if msg.metadata.message_type != MessageType::Query {
        return None;
    }
    let mut out = Message::error_msg(msg.metadata.id, msg.metadata.op_code, ResponseCode::Refused);
    out.add_queries(msg.queries);
    out.to_vec().ok().filter(|r| r.len() <= query.len())
}

/// Sources the per-source limiter tracks before it is pruned at once (each
/// is a few dozen bytes).
const MAX_SOURCES: usize = 50_000;

type Limiter = governor::RateLimiter<
    IpAddr,
    governor::state::keyed::DefaultKeyedStateStore<IpAddr>,
    governor::clock::DefaultClock,
>;

/// Per-source and total rate limits: a flood from one source (or many)
/// is dropped, never answered, so the responder cannot be used to reflect.
pub struct Limits {
    per_source: Limiter,
    total: governor::DefaultDirectRateLimiter,
    limited: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Limits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Limits")
    }
}

impl Limits {
    pub fn new(per_source: u32, total: u32) -> Limits {
        let q = |n: u32| governor::Quota::per_second(NonZeroU32::new(n.max(1)).unwrap());
        Limits {
            per_source: governor::RateLimiter::keyed(q(per_source)),
            total: governor::RateLimiter::direct(q(total)),
            limited: Default::default(),
        }
    }

    /// Whether a datagram from `from` is served. The per-source state is
    /// bounded: past [`MAX_SOURCES`] it is pruned, and while it stays that
    /// large (spoofed sources) the total limit is checked first, so no more
    /// than the total rate of new sources gets in.
    pub fn allow(&self, from: IpAddr) -> bool {
        if self.per_source.len() > MAX_SOURCES {
            self.per_source.retain_recent();
            if self.per_source.len() > MAX_SOURCES {
                return self.total.check().is_ok() && self.per_source.check_key(&from).is_ok();
            }
        }
        self.per_source.check_key(&from).is_ok() && self.total.check().is_ok()
    }

    /// Whether this limited datagram gets a bare REFUSED (every second).
    fn slip(&self) -> bool {
        self.limited
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .is_multiple_of(2)
    }

    /// Forgets sources not heard from lately (the keyed state is bounded
    /// by the sources of the last few seconds).
    pub fn prune(&self) {
        self.per_source.retain_recent();
        self.per_source.shrink_to_fit();
    }
}

/// One datagram through the limits and [`answer`].
pub fn handle(
    datagram: &[u8],
    from: IpAddr,
    zone: &Name,
    table: &Table,
    limits: &Limits,
) -> (Outcome, Option<Vec<u8>>) {
    let records = table.get();
    if records.from_peer(from) {
        return (Outcome::FromPeer, None);
    }
    if !limits.allow(from) {
        return (Outcome::Limited, limits.slip().then(|| refused(datagram)).flatten());
    }
    match answer(datagram, zone, &records) {
        Some(r) => (Outcome::Answered, Some(r)),
        None => (Outcome::Dropped, None),
    }
}

/// A UDP socket on `addr` that binds even before the address is on the
/// host (IP_FREEBIND, IPV6_FREEBIND): the workload subnet's address may
/// come later.
pub fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::UdpSocket> {
    let s = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::DGRAM, None)?;
    if addr.is_ipv4() {
        s.set_freebind_v4(true)?;
    } else {
        s.set_freebind_v6(true)?;
    }
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    tokio::net::UdpSocket::from_std(s.into())
}

/// Serves `table` on `sock` (from [`bind`]) until the task is dropped.
pub async fn serve(sock: tokio::net::UdpSocket, zone: Name, table: Table) {
    let limits = Limits::new(PER_SOURCE_QPS, TOTAL_QPS);
    let metrics = crate::metrics::get();
    let mut buf = vec![0u8; 4096];
    let mut pruned = std::time::Instant::now();
    loop {
        let (n, from) = match sock.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(error = %e, "DNS receive failed");
                continue;
            }
        };
        let (outcome, reply) = handle(&buf[..n], from.ip(), &zone, &table, &limits);
        metrics.dns(outcome.label());
        if let Some(r) = reply
            && let Err(e) = sock.send_to(&r, from).await
        {
            tracing::debug!(error = %e, to = %from, "DNS reply not sent");
        }
        if pruned.elapsed() > std::time::Duration::from_secs(10) {
            limits.prune();
            pruned = std::time::Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::Query;

    fn zone() -> Name {
        parse_zone("weft.internal").unwrap()
    }

    fn table() -> Records {
        let o6 = |site: &str, name: &str, a: &str, v6: &str| pb::DesiredObject {
            id: format!("peer/{site}/name/{name}"),
            kind: Some(Kind::DnsRecord(pb::DnsRecord {
                site: site.into(),
                name: name.into(),
                address: a.into(),
                address_v6: v6.into(),
            })),
        };
        let o = |site: &str, name: &str, a: &str| o6(site, name, a, "");
        let route = |site: &str, kind: &str, dst: &str| pb::DesiredObject {
            id: format!("peer/{site}/{kind}/route"),
            kind: Some(Kind::Route(pb::Route {
                namespace: String::new(),
                table: 7765,
                destination: dst.into(),
                gateway: "10.80.0.1".into(),
                device: "weft-vx0".into(),
                peer_site: site.into(),
            })),
        };
        Records::of(&[
            route("site-b", "workload", "10.200.0.0/16"),
            route("site-b", "external", "10.201.0.0/16"),
            route("site-c", "workload", "10.202.0.0/16"),
            route("b.c", "workload", "10.203.0.0/16"),
            route("site-b", "v6/0", "fd9a:0:100::/48"),
            route("site-c", "v6/0", "fd9a:0:200::/48"),
            o6("site-b", "web", "10.200.0.10", "fd9a:0:100::10"),
            // An IPv6 address in another peer's view: its AAAA is not
            // served, its A is.
            o6("site-b", "api", "10.200.0.11", "fd9a:0:200::11"),
            o("site-b", "db", "10.201.255.254"),
            o("site-c", "web", "10.202.0.10"),
            o("site-c", "Bad_Name", "10.202.0.11"),
            o("site-c", "lo", "127.0.0.1"),
            // In site-c's view, not site-b's: never served.
            o("site-b", "stray", "10.202.0.5"),
            o("b.c", "web", "10.203.0.10"),
            // A workload of an IPv6-only site: IPv6 alone, in its view
            // (and one outside it, never served).
            o6("site-b", "v6", "", "fd9a:0:100::20"),
            o6("site-b", "v6stray", "", "fd9a:0:200::20"),
        ])
    }

    fn ask(name: &str, t: RecordType) -> Message {
        let mut m = Message::query();
        m.metadata.recursion_desired = true;
        m.add_query(Query::query(Name::from_ascii(name).unwrap(), t));
        let reply = answer(&m.to_vec().unwrap(), &zone(), &table()).expect("an answer");
        let r = Message::from_vec(&reply).unwrap();
        assert_eq!(r.metadata.id, m.metadata.id);
        assert_eq!(r.metadata.message_type, MessageType::Response);
        r
    }

    fn a_of(r: &Message) -> Vec<Ipv4Addr> {
        r.answers
            .iter()
            .filter_map(|x| match x.data {
                RData::A(a) => Some(a.0),
                _ => None,
            })
            .collect()
    }

    fn aaaa_of(r: &Message) -> Vec<Ipv6Addr> {
        r.answers
            .iter()
            .filter_map(|x| match x.data {
                RData::AAAA(a) => Some(a.0),
                _ => None,
            })
            .collect()
    }

    /// A name with an IPv6 address in the peer's IPv6 view answers AAAA
    /// (and both for ANY); one without answers AAAA with no data; an IPv6
    /// address outside that peer's views is never served.
    #[test]
    fn aaaa_answers_the_ipv6_view_and_only_the_peers_own() {
        let r = ask("web.site-b.weft.internal.", RecordType::AAAA);
        assert_eq!(
            (r.metadata.response_code, aaaa_of(&r), a_of(&r)),
            (ResponseCode::NoError, vec!["fd9a:0:100::10".parse().unwrap()], vec![])
        );
        let r = ask("web.site-b.weft.internal.", RecordType::ANY);
        assert_eq!((a_of(&r).len(), aaaa_of(&r).len()), (1, 1));
        for name in ["web.site-c.weft.internal.", "api.site-b.weft.internal."] {
            let r = ask(name, RecordType::AAAA);
            assert_eq!(
                (r.metadata.response_code, r.answers.len()),
                (ResponseCode::NoError, 0),
                "{name}"
            );
            assert_eq!(r.authorities.len(), 1, "{name}: NODATA carries the SOA");
        }
        let r = ask("api.site-b.weft.internal.", RecordType::A);
        assert_eq!(a_of(&r), vec!["10.200.0.11".parse::<Ipv4Addr>().unwrap()]);
        // A name without an IPv4 address: AAAA, and A with no data.
        let r = ask("v6.site-b.weft.internal.", RecordType::AAAA);
        assert_eq!(aaaa_of(&r), vec!["fd9a:0:100::20".parse::<Ipv6Addr>().unwrap()]);
        let r = ask("v6.site-b.weft.internal.", RecordType::A);
        assert_eq!(
            (r.metadata.response_code, r.answers.len(), r.authorities.len()),
            (ResponseCode::NoError, 0, 1)
        );
        let r = ask("v6stray.site-b.weft.internal.", RecordType::AAAA);
        assert_eq!(r.metadata.response_code, ResponseCode::NXDomain);
    }

    #[test]
    fn names_of_the_zone_resolve_case_blind_to_the_local_view() {
        let r = ask("web.site-b.weft.internal.", RecordType::A);
        assert_eq!(
            (r.metadata.response_code, a_of(&r)),
            (ResponseCode::NoError, vec!["10.200.0.10".parse().unwrap()])
        );
        assert!(r.metadata.authoritative);
        let r = ask("WEB.Site-C.Weft.Internal.", RecordType::A);
        assert_eq!(a_of(&r), vec!["10.202.0.10".parse::<Ipv4Addr>().unwrap()]);
        assert_eq!(r.answers[0].ttl, TTL);
    }

    #[test]
    fn absent_names_are_nxdomain_and_other_types_nodata() {
        let r = ask("nope.site-b.weft.internal.", RecordType::A);
        assert_eq!(r.metadata.response_code, ResponseCode::NXDomain);
        assert!(matches!(r.authorities[0].data, RData::SOA(_)));
        let r = ask("web.site-x.weft.internal.", RecordType::A);
        assert_eq!(r.metadata.response_code, ResponseCode::NXDomain);
        let r = ask("web.site-b.weft.internal.", RecordType::TXT);
        assert_eq!((r.metadata.response_code, r.answers.len()), (ResponseCode::NoError, 0));
        let r = ask("site-b.weft.internal.", RecordType::A);
        assert_eq!((r.metadata.response_code, r.answers.len()), (ResponseCode::NoError, 0));
        let r = ask("weft.internal.", RecordType::SOA);
        assert!(matches!(r.answers[0].data, RData::SOA(_)));
        // Records that fail the check, or point outside their peer's
        // views, are not served.
        for n in ["lo.site-c.weft.internal.", "stray.site-b.weft.internal."] {
            assert_eq!(
                ask(n, RecordType::A).metadata.response_code,
                ResponseCode::NXDomain,
                "{n}"
            );
        }
        // A dotted site id: its parents exist (no data), its names resolve.
        assert_eq!(
            a_of(&ask("web.b.c.weft.internal.", RecordType::A)),
            vec!["10.203.0.10".parse::<Ipv4Addr>().unwrap()]
        );
        let r = ask("c.weft.internal.", RecordType::A);
        assert_eq!((r.metadata.response_code, r.answers.len()), (ResponseCode::NoError, 0));
        // An escaped dot inside a label is no name of ours.
        let r = ask("web\\.site-b.weft.internal.", RecordType::A);
        assert_eq!(r.metadata.response_code, ResponseCode::NXDomain);
    }

    #[test]
    fn an_unknown_edns_version_gets_badvers() {
        let mut m = Message::query();
        m.add_query(Query::query(
            Name::from_ascii("web.site-b.weft.internal.").unwrap(),
            RecordType::A,
        ));
        let mut e = hickory_proto::op::Edns::new();
        e.set_version(1);
        m.set_edns(e);
        let r = Message::from_vec(&answer(&m.to_vec().unwrap(), &zone(), &table()).unwrap()).unwrap();
        // 16 is BADVERS with an OPT record (hickory names it BADSIG).
        assert_eq!(u16::from(r.metadata.response_code), 16);
        assert!(r.edns.is_some());
        assert!(r.answers.is_empty());
    }

    #[test]
    fn peers_are_not_served_and_a_limited_source_gets_a_bare_refused_every_second_query() {
        let records = table();
        assert!(records.from_peer("10.200.3.4".parse().unwrap()));
        assert!(records.from_peer("10.201.0.1".parse().unwrap()));
        assert!(!records.from_peer("10.1.0.10".parse().unwrap()));
        let t = Table::default();
        *t.0.write().unwrap() = Arc::new(records);
        let mut m = Message::query();
        m.add_query(Query::query(
            Name::from_ascii("web.site-b.weft.internal.").unwrap(),
            RecordType::A,
        ));
        let q = m.to_vec().unwrap();
        let limits = Limits::new(1, 1000);
        let peer: IpAddr = "10.200.0.7".parse().unwrap();
        assert_eq!(handle(&q, peer, &zone(), &t, &limits), (Outcome::FromPeer, None));
        let me: IpAddr = "10.1.0.10".parse().unwrap();
        assert_eq!(handle(&q, me, &zone(), &t, &limits).0, Outcome::Answered);
        let limited: Vec<_> = (0..4).map(|_| handle(&q, me, &zone(), &t, &limits)).collect();
        assert!(limited.iter().all(|(o, _)| *o == Outcome::Limited));
        let replies: Vec<&Vec<u8>> = limited.iter().filter_map(|(_, r)| r.as_ref()).collect();
        assert_eq!(replies.len(), 2, "every second limited query gets a reply");
        for r in replies {
            assert!(r.len() <= q.len(), "never larger than the query");
            let r = Message::from_vec(r).unwrap();
            assert_eq!((r.metadata.response_code, r.answers.len()), (ResponseCode::Refused, 0));
        }
    }

    #[test]
    fn other_names_are_left_to_the_hosts_resolver() {
        for n in ["example.com.", "internal.", "weft.internal.example."] {
            assert_eq!(
                ask(n, RecordType::A).metadata.response_code,
                ResponseCode::Refused,
                "{n}"
            );
        }
    }

    #[test]
    fn responses_and_garbage_get_no_reply_and_a_readable_header_gets_formerr() {
        let mut m = Message::response(7, OpCode::Query);
        m.add_query(Query::query(
            Name::from_ascii("web.site-b.weft.internal.").unwrap(),
            RecordType::A,
        ));
        assert!(answer(&m.to_vec().unwrap(), &zone(), &table()).is_none());
        assert!(answer(&[1, 2, 3], &zone(), &table()).is_none());
        let mut bad = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        bad.extend([0xc0, 0xff]); // a pointer past the end
        let r = Message::from_vec(&answer(&bad, &zone(), &table()).unwrap()).unwrap();
        assert_eq!(
            (r.metadata.id, r.metadata.response_code),
            (0x1234, ResponseCode::FormErr)
        );
    }

    #[test]
    fn a_flooding_source_is_limited_and_others_still_answered() {
        let limits = Limits::new(10, 1000);
        let (a, b): (IpAddr, IpAddr) = ("10.1.0.10".parse().unwrap(), "10.1.0.11".parse().unwrap());
        let allowed = (0..100).filter(|_| limits.allow(a)).count();
        assert!((10..=12).contains(&allowed), "{allowed}");
        assert!(limits.allow(b));
    }

    #[test]
    fn listen_and_zone_flags_parse_or_say_what_to_give() {
        assert_eq!("off".parse::<Listen>(), Ok(Listen::Off));
        assert_eq!("subnet".parse::<Listen>(), Ok(Listen::Subnet));
        assert_eq!(
            "10.1.0.1:53".parse::<Listen>(),
            Ok(Listen::At("10.1.0.1:53".parse().unwrap()))
        );
        assert!("10.1.0.1".parse::<Listen>().unwrap_err().contains("ADDRESS:PORT"));
        assert_eq!(parse_zone("Weft.Internal.").unwrap().to_ascii(), "weft.internal.");
        for bad in ["", ".", "a..b", "-a.b", "a_b.c"] {
            assert!(parse_zone(bad).is_err(), "{bad}");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(4000))]
        /// Any datagram: no panic; a reply, if any, is a well-formed
        /// response with the query's id, no larger than a UDP DNS message.
        #[test]
        fn property_random_datagrams_never_break_the_responder(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600)) {
            let reply = answer(&data, &zone(), &table());
            if data.len() >= 3 && data[2] & 0x80 != 0 {
                // A response is never answered (two responders cannot loop).
                proptest::prop_assert!(reply.is_none());
            }
            if let Some(reply) = reply {
                let m = Message::from_vec(&reply).expect("the reply parses");
                proptest::prop_assert_eq!(m.metadata.message_type, MessageType::Response);
                proptest::prop_assert_eq!(m.metadata.id, u16::from_be_bytes([data[0], data[1]]));
            }
        }

        /// Mutated real queries (the parser's deep paths): same promise.
        #[test]
        fn property_mutated_queries_never_break_the_responder(flips in proptest::collection::vec((0usize..64, proptest::prelude::any::<u8>()), 1..6)) {
            let mut m = Message::query();
            m.add_query(Query::query(Name::from_ascii("web.site-b.weft.internal.").unwrap(), RecordType::A));
            let mut data = m.to_vec().unwrap();
            for (i, b) in flips {
                let n = data.len();
                data[i % n] ^= b;
            }
            if let Some(reply) = answer(&data, &zone(), &table()) {
                let r = Message::from_vec(&reply).expect("the reply parses");
                proptest::prop_assert_eq!(r.metadata.message_type, MessageType::Response);
            }
        }
    }
}
