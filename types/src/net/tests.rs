use super::*;
use proptest::prelude::*;

#[test]
fn cidrs_of_both_families_parse_once_and_canonically() {
    assert_eq!(cidr("10.1.0.0/16").unwrap().to_string(), "10.1.0.0/16");
    assert_eq!(cidr(" 10.1.0.0/16 ").unwrap().family(), Family::V4);
    let v6 = cidr("FD00:0:0:1::/64").unwrap();
    assert_eq!(v6.to_string(), "fd00:0:0:1::/64", "IPv6 is normalised");
    assert_eq!(v6.family(), Family::V6);
    assert!(v6.v4().is_none() && v6.v6().is_some());
    for (text, says) in [
        ("10.1.0.1/16", "has host bits set; the network is 10.1.0.0/16"),
        ("fd00::1/64", "has host bits set; the network is fd00::/64"),
        ("10.010.0.0/16", "not written canonically"),
        (
            "10.1.0.0",
            "has no prefix length; write it as address/length, e.g. 10.1.0.0/24",
        ),
        ("fd00::", "e.g. fd00::/64"),
        (
            "10.1.0.0/33",
            "is not a CIDR: its prefix length \"33\" is not a number from 0 to 32",
        ),
        ("fd00::/129", "prefix length \"129\" is not a number from 0 to 128"),
        ("fd00::/-1", "from 0 to 128"),
        ("fe80::1%eth0/64", "is not a CIDR"),
        ("fd00:::/48", "is not a CIDR"),
        ("", "is not a CIDR"),
    ] {
        let e = cidr(text).unwrap_err();
        assert!(e.contains(says), "{text}: {e}");
        assert!(e.starts_with(&format!("{:?}", text.trim())), "{text}: {e}");
    }
    let e = cidr(&format!("fd00::/{}", "1".repeat(1000))).unwrap_err();
    assert!(e.contains("too long") && e.len() < 200, "{e}");
}

#[test]
fn ipv4_only_fields_say_so() {
    assert_eq!(cidr_v4("10.1.0.0/16").unwrap().to_string(), "10.1.0.0/16");
    let e = cidr_v4("fd00::/48").unwrap_err();
    assert!(e.contains("is IPv6; weft supports IPv4 CIDRs only for now"), "{e}");
    assert!(addr_v4("fd00::1").unwrap_err().contains("is IPv6"));
    assert!(addr_v6("10.0.0.1").unwrap_err().contains("is IPv4"));
    assert!(addr("10.0.0.1/32").unwrap_err().contains("without a prefix length"));
    assert!(addr("fe80::1%2").unwrap_err().contains("scope"));
}

#[test]
fn endpoints_take_a_port_and_ipv6_in_brackets() {
    assert_eq!(endpoint("192.0.2.1:51820").unwrap().port(), 51820);
    assert_eq!(
        endpoint("[2001:db8::1]:51820").unwrap().ip(),
        "2001:db8::1".parse::<IpAddr>().unwrap()
    );
    for (text, says) in [
        ("192.0.2.1:0", "has port 0"),
        ("192.0.2.1", "is not an address and a port"),
        ("192.0.2.1:65536", "is not an address and a port"),
        (
            "2001:db8::1",
            "write an IPv6 endpoint in brackets, e.g. [2001:db8::1]:51820",
        ),
        ("2001:db8::1:51820", "in brackets"),
        ("[fe80::1%2]:51820", "has a scope"),
        ("gw.example:51820", "is not an address and a port"),
    ] {
        let e = endpoint(text).unwrap_err();
        assert!(e.contains(says), "{text}: {e}");
    }
}

#[test]
fn interface_addresses_keep_their_host_bits() {
    assert_eq!(iface("169.254.0.1/30").unwrap().addr().to_string(), "169.254.0.1");
    assert_eq!(iface("fd00::1/64").unwrap().prefix_len(), 64);
    assert!(iface("169.254.0.1").unwrap_err().contains("with a prefix length"));
}

#[test]
fn special_ranges_are_named_in_both_families() {
    let s = |t: &str| special_use(t.parse().unwrap());
    assert_eq!(s("127.0.0.0/16"), Some("loopback (127.0.0.0/8)"));
    assert_eq!(s("169.254.10.0/24"), Some("link-local (169.254.0.0/16)"));
    assert_eq!(s("224.0.0.0/8"), Some("multicast (224.0.0.0/4)"));
    assert_eq!(s("::1/128"), Some("loopback (::1)"));
    assert_eq!(s("fe80::/64"), Some("link-local (fe80::/10)"));
    assert_eq!(s("ff02::/16"), Some("multicast (ff00::/8)"));
    assert_eq!(s("64:ff9b::/96"), Some("the well-known NAT64 prefix (64:ff9b::/96)"));
    assert_eq!(s("64:ff9b:1:2::/64"), Some("local-use NAT64 (64:ff9b:1::/48)"));
    assert_eq!(
        s("fe00::/7"),
        Some("link-local (fe80::/10)"),
        "a network over a range overlaps it"
    );
    assert_eq!(s("10.0.0.0/8"), None);
    assert_eq!(s("fd00::/8"), None);
    assert_eq!(s("2001:db8::/32"), None);
}

fn any_net() -> impl Strategy<Value = IpNet> {
    prop_oneof![
        (any::<u32>(), 0u8..=32).prop_map(|(a, l)| IpNet::V4(Ipv4Net::new(Ipv4Addr::from(a), l).unwrap().trunc())),
        (any::<u128>(), 0u8..=128).prop_map(|(a, l)| IpNet::V6(Ipv6Net::new(Ipv6Addr::from(a), l).unwrap().trunc())),
    ]
}

proptest! {
    #[test]
    fn every_network_round_trips(n in any_net()) {
        let c = cidr(&n.to_string()).unwrap();
        prop_assert_eq!(c.net(), n);
        prop_assert_eq!(Cidr::of(n), c);
        prop_assert_eq!(c.to_string().parse::<Cidr>(), Ok(c));
    }

    #[test]
    fn what_parses_has_no_host_bits(text in "[0-9a-fA-F:./ ]{0,48}") {
        if let Ok(c) = cidr(&text) {
            prop_assert_eq!(c.net(), c.net().trunc());
        }
    }

    #[test]
    fn an_endpoint_round_trips(a in any::<u128>(), b in any::<u32>(), port in 1u16..) {
        for e in [SocketAddr::new(IpAddr::V6(Ipv6Addr::from(a)), port), SocketAddr::new(IpAddr::V4(Ipv4Addr::from(b)), port)] {
            prop_assert_eq!(endpoint(&e.to_string()), Ok(e));
        }
    }
}
