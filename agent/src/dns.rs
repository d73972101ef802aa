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
use weft_dataplane::desired::Object;

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
    /// The records among `objects` (the agent's whole desired state, as
    /// decoded: a record there is a DNS label with unicast addresses)
    /// whose address lies in a view of the same peer that this node routes
    /// (`desired::peer_views`), so a name can only ever send a workload
    /// into that peer; an IPv6 address alike (one outside that peer's views
    /// is not served, the name's A is).
    pub fn of<'a>(objects: impl IntoIterator<Item = &'a Object> + Clone) -> Records {
        let mut r = Records {
            views: weft_dataplane::desired::peer_views(objects.clone()),
            ..Default::default()
        };
        for o in objects {
            let Object::DnsRecord(d) = o else { continue };
            let routed = |ip: IpAddr| {
                r.views
                    .get(&d.site)
                    .is_some_and(|v| v.iter().any(|net| net.contains(&ip)))
            };
            let (a, v6) = (d.v4, d.v6);
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
    pub fn set<'a>(&self, objects: impl IntoIterator<Item = &'a Object> + Clone) {
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
mod tests;
