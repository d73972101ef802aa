use super::*;
use hickory_proto::op::Query;
use weft_proto::v1 as pb;
use weft_proto::v1::desired_object::Kind;

/// The records of `objects` as the agent holds them: decoded at its door
/// (what does not decode, a bad name or a loopback address, never gets
/// this far).
fn records(objects: &[pb::DesiredObject]) -> Records {
    let decoded: Vec<Object> = objects
        .iter()
        .filter_map(|o| weft_dataplane::desired::decode(o).ok())
        .collect();
    Records::of(decoded.iter())
}

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
            // The overlay's next hop, of the route's family (IPv6's is
            // link-local, as weft renders it).
            gateway: if dst.contains(':') { "fe80::1" } else { "10.80.0.1" }.into(),
            device: "weft-vx0".into(),
            peer_site: site.into(),
        })),
    };
    records(&[
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
