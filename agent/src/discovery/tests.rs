use super::sockets::udp_of;
use super::*;

#[test]
fn the_userspace_device_knows_discoverys_datagrams() {
    // It lets discovery's answers pass to the raw socket uncounted.
    assert_eq!(
        weft_common::discovery::MAGIC.as_slice(),
        weft_dataplane::userspace::DISCOVERY_MAGIC
    );
}

#[test]
fn reflectors_are_unicast_addresses_off_this_host() {
    let list: Vec<String> = [
        "127.0.0.1:7443",
        "198.51.100.2:7443",
        "224.0.0.1:7443",
        "198.51.100.2:7443",
        "0.0.0.0:1",
        "not an address",
        "[::1]:7443",
        "[fe80::1]:7443",
        "[ff02::1]:7443",
        "[2001:db8::2]:7443",
        "[::ffff:198.51.100.3]:7443",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let want: Vec<SocketAddr> = ["198.51.100.2:7443", "[2001:db8::2]:7443", "198.51.100.3:7443"]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
    assert_eq!(reflectors(&list), want);
}

fn round(underlay: &str, sent: &[(&str, Option<&str>)], theirs: &[&str]) -> Round {
    let a = |s: &str| s.parse::<SocketAddr>().unwrap();
    Round {
        target: Target {
            port: 51820,
            reflectors: vec![],
            own: 0,
            underlay: Some(underlay.parse().unwrap()),
        },
        sent: sent.iter().map(|(r, _)| (a(r), [0u8; 16])).collect(),
        theirs: theirs.iter().map(|r| a(r)).collect(),
        answers: sent.iter().map(|(_, s)| s.map(a)).collect(),
        deadline: Instant::now(),
    }
}

fn reflexive(f: &Found) -> Vec<&str> {
    f.candidates
        .iter()
        .filter(|c| c.kind == "reflexive")
        .map(|c| c.address.as_str())
        .collect()
}

#[test]
fn a_gateway_without_nat_is_a_candidate_where_the_peers_reflector_saw_it() {
    // IPv6, no NAT: both reflectors see the own address; the peer's
    // makes it a candidate, and there is no NAT.
    let own = "[2001:db8:10::10]:51820";
    let r = round(
        "2001:db8:10::10",
        &[
            ("[2001:db8:78::1]:7443", Some(own)),
            ("[2001:db8:78::2]:7443", Some(own)),
        ],
        &["[2001:db8:78::2]:7443"],
    );
    let f = found(&r);
    assert_eq!(f.nat, "none");
    assert_eq!(reflexive(&f), vec![own]);
    // Only the site's own reflector answered: no candidate (it may be
    // on the LAN, inside the firewall).
    let r = round(
        "2001:db8:10::10",
        &[("[2001:db8:78::1]:7443", Some(own)), ("[2001:db8:78::2]:7443", None)],
        &["[2001:db8:78::2]:7443"],
    );
    assert!(reflexive(&found(&r)).is_empty());
    // Behind IPv4 NAT, as before: the mapped address, not the own one.
    let r = round(
        "192.168.10.10",
        &[
            ("198.51.100.1:7443", Some("198.51.100.30:40001")),
            ("198.51.100.2:7443", Some("198.51.100.30:40001")),
        ],
        &["198.51.100.2:7443"],
    );
    let f = found(&r);
    assert_eq!(f.nat, "endpoint-independent");
    assert_eq!(reflexive(&f), vec!["198.51.100.30:40001"]);
    // Dual stack: IPv4 behind NAT, IPv6 at its own address. The NAT
    // is IPv4's (the IPv6 address is no second mapping of it), and
    // both are candidates.
    let r = round(
        "192.168.10.10",
        &[
            ("198.51.100.1:7443", Some("198.51.100.30:40001")),
            ("[2001:db8:78::2]:7443", Some("[2001:db8:10::10]:51820")),
        ],
        &["[2001:db8:78::2]:7443"],
    );
    let f = found(&r);
    assert_eq!(f.nat, "endpoint-independent");
    assert_eq!(reflexive(&f), vec!["198.51.100.30:40001", "[2001:db8:10::10]:51820"]);
}

fn result(nat: &str, candidates: &[(&str, &str)]) -> Found {
    Found {
        candidates: candidates
            .iter()
            .map(|(a, k)| pb::Candidate {
                address: a.to_string(),
                kind: k.to_string(),
            })
            .collect(),
        nat: nat.into(),
    }
}

fn kept(found: &Found, complete: bool, answers: usize) -> Kept {
    Kept {
        found: found.clone(),
        complete,
        answers,
    }
}

#[test]
fn an_incomplete_round_does_not_replace_a_complete_result() {
    let local = ("192.168.1.2:51820", "local");
    let good = result("endpoint-independent", &[local, ("198.51.100.30:51820", "reflexive")]);
    let nothing = result("unknown", &[local]);
    let one = result("endpoint-independent", &[local, ("198.51.100.30:51820", "reflexive")]);
    let k = kept(&good, true, 2);
    // No answer, however many rounds in a row: the result stays.
    for _ in 0..10 {
        assert!(!replaces(Some(&k), &nothing, false, 0));
    }
    // Some answers that agree with it: the same.
    assert!(!replaces(Some(&k), &one, false, 1));
    // Endpoint-dependent seen by two, one of them answering now.
    let dependent = result(
        "endpoint-dependent",
        &[
            local,
            ("198.51.100.30:40001", "reflexive"),
            ("198.51.100.30:40002", "reflexive"),
        ],
    );
    let half = result("endpoint-independent", &[local, ("198.51.100.30:40001", "reflexive")]);
    assert!(!replaces(Some(&kept(&dependent, true, 2)), &half, false, 1));
    // A complete round that disagrees replaces it, even with nothing.
    assert!(replaces(Some(&k), &nothing, true, 0));
    assert!(replaces(Some(&kept(&dependent, true, 2)), &half, true, 2));
    // An answer showing a new mapping replaces it, complete or not.
    let moved = result("endpoint-independent", &[local, ("198.51.100.99:51820", "reflexive")]);
    assert!(replaces(Some(&k), &moved, false, 1));
    // The same result never counts as a change.
    assert!(!replaces(Some(&k), &good, true, 2));
}

#[test]
fn the_first_result_is_taken_and_incomplete_ones_give_way_to_more_answers() {
    let local = ("192.168.1.2:51820", "local");
    let nothing = result("unknown", &[local]);
    let one = result("endpoint-independent", &[local, ("198.51.100.30:51820", "reflexive")]);
    // Whatever the first round found, even nothing.
    assert!(replaces(None, &nothing, false, 0));
    assert!(replaces(None, &one, false, 1));
    // Incomplete after incomplete: more answers win, fewer do not.
    assert!(replaces(Some(&kept(&nothing, false, 0)), &one, false, 1));
    assert!(!replaces(Some(&kept(&one, false, 1)), &nothing, false, 0));
    // Unknown after a complete round that found nothing (UDP blocked)
    // stays unknown until a reflector answers.
    assert!(!replaces(Some(&kept(&nothing, true, 0)), &nothing, false, 0));
    assert!(replaces(Some(&kept(&nothing, true, 0)), &one, false, 1));
}

#[test]
fn a_udp_packet_is_read_from_its_ip_header() {
    let mut p = vec![
        0x45, 0, 0, 36, 0, 0, 0, 0, 64, 17, 0, 0, 198, 51, 100, 2, 192, 168, 1, 2,
    ];
    p.extend_from_slice(&[0x1d, 0x13, 0xca, 0x6c, 0, 16, 0, 0]);
    p.extend_from_slice(b"WEFTDSC1");
    let (from, dport, payload) = udp_of(&p).unwrap();
    assert_eq!(from, "198.51.100.2:7443".parse().unwrap());
    assert_eq!(dport, 51820);
    assert_eq!(payload, b"WEFTDSC1");
    assert_eq!(udp_of(&p[..22]), None);
}
