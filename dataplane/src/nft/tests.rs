use super::*;

#[test]
fn an_empty_spec_only_removes_and_a_full_one_has_every_part() {
    let v = batch(&TableSpec::default());
    assert_eq!(
        v["nftables"].as_array().unwrap().len(),
        4,
        "both tables only removed: {v}"
    );
    let spec = TableSpec {
        mss_clamp: true,
        nat: vec![NatRule {
            local: "10.90.0.0/16".parse().unwrap(),
            real: "10.1.0.0/16".parse().unwrap(),
            tunnel: "weft-wabc".into(),
        }],
        snat: vec![
            HostSnat {
                link: "weft-vx0".into(),
                address: "10.1.4.1".parse().unwrap(),
                except: vec!["10.1.0.0/16".parse().unwrap()],
            },
            HostSnat {
                link: "weft-vx0".into(),
                address: "fd00:70::3".parse().unwrap(),
                except: vec!["fd00:1::/48".parse().unwrap()],
            },
        ],
        accounting: [("b".to_string(), vec!["10.90.0.0/16".parse().unwrap()])].into(),
        exports: vec![Export {
            external: "10.70.255.254".parse().unwrap(),
            host: "192.168.7.5".parse().unwrap(),
            tunnel: "weft-wabc".into(),
        }],
        filter: Some(TunnelFilter {
            tunnel: "weft-wabc".into(),
            allowed: vec!["10.1.0.0/16".parse().unwrap(), "192.168.7.5/32".parse().unwrap()],
            policy: None,
            transit: vec![("c".into(), vec!["10.201.0.0/16".parse().unwrap()])],
        }),
    };
    let text = batch(&spec).to_string();
    assert!(
        !text.contains("\"name\":\"refused\""),
        "no policy, no policy counter: {text}"
    );
    for part in [
        "\"from_tunnel\"",
        "\"dropped\"",
        "\"export\"",
        "192.168.7.5",
        "\"pre\"",
        "\"post\"",
        "\"mss\"",
        "\"snat\"",
        "\"acct_fwd\"",
        "tx-b",
        "rx-b",
        "netmap",
        "\"transit-c\"",
    ] {
        assert!(text.contains(part), "{part} missing from {text}");
    }
    // The export: only what comes out of the tunnel, for the external
    // address, goes to the host.
    let v = batch(&spec);
    let export = v["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|c| c["add"]["rule"].as_object().filter(|r| r["chain"] == "export"))
        .expect("an export rule");
    assert_eq!(
        export["expr"],
        json!([
            {"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": "weft-wabc"}},
            {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}}, "right": "10.70.255.254"}},
            {"dnat": {"family": "ip", "addr": "192.168.7.5"}}
        ])
    );
}

/// Each family's rules match its own header: an IPv6 view is mapped
/// with `ip6` prefix NAT, host traffic gets one SNAT per family, and
/// the filter allows each family only its own networks.
#[test]
fn both_families_are_translated_and_filtered_each_in_its_own_terms() {
    let spec = TableSpec {
        nat: vec![
            NatRule {
                local: "10.90.0.0/16".parse().unwrap(),
                real: "10.1.0.0/16".parse().unwrap(),
                tunnel: "weft-wabc".into(),
            },
            NatRule {
                local: "fdaa:bb00:100::/48".parse().unwrap(),
                real: "fd00:1::/48".parse().unwrap(),
                tunnel: "weft-wabc".into(),
            },
        ],
        snat: vec![HostSnat {
            link: "weft-vx0".into(),
            address: "fd00:70::3".parse().unwrap(),
            except: vec!["fd00:1::/48".parse().unwrap()],
        }],
        filter: Some(TunnelFilter {
            tunnel: "weft-wabc".into(),
            allowed: vec!["10.1.0.0/16".parse().unwrap(), "fd00:1::/48".parse().unwrap()],
            policy: None,
            transit: vec![],
        }),
        ..Default::default()
    };
    let v = batch(&spec);
    let rules = |chain: &str| -> Vec<Value> {
        v["nftables"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|c| c["add"]["rule"].as_object().filter(|r| r["chain"] == chain))
            .map(|r| r["expr"].clone())
            .collect()
    };
    let pre = rules("pre");
    assert_eq!(pre[1][1]["match"]["left"]["payload"]["protocol"], "ip6", "{pre:#?}");
    assert_eq!(
        pre[1][2],
        json!({"dnat": {"family": "ip6", "addr": {"prefix": {"addr": "fd00:1::", "len": 48}}, "flags": "netmap", "type_flags": "prefix"}})
    );
    assert_eq!(rules("post")[1][2]["snat"]["family"], "ip6");
    assert_eq!(pre[0][2]["dnat"]["family"], "ip");
    let snat = rules("snat");
    assert_eq!(snat.len(), 1);
    assert_eq!(snat[0][1]["match"]["left"]["payload"]["protocol"], "ip6");
    assert_eq!(snat[0][2], json!({"snat": {"family": "ip6", "addr": "fd00:70::3"}}));
    let filter = rules("from_tunnel");
    assert_eq!(filter.len(), 2, "{filter:#?}");
    for (r, proto, net) in [(&filter[0], "ip", "10.1.0.0"), (&filter[1], "ip6", "fd00:1::")] {
        assert_eq!(r[1]["match"]["op"], "!=");
        assert_eq!(r[1]["match"]["left"]["payload"]["protocol"], proto);
        assert_eq!(r[1]["match"]["right"]["set"][0]["prefix"]["addr"], net);
        assert_eq!(r[3], json!({"drop": null}));
    }
}

fn policy_rule(cidr: &str, protocol: Option<Protocol>, ports: Option<(u16, u16)>) -> PolicyRule {
    PolicyRule {
        cidr: cidr.parse().unwrap(),
        protocol,
        ports,
    }
}

/// The expressions of the rules in `from_tunnel` of a tunnel filter
/// allowing `allowed` with `policy`.
fn from_tunnel(allowed: &[&str], policy: Vec<PolicyRule>) -> Vec<Value> {
    let spec = TableSpec {
        filter: Some(TunnelFilter {
            tunnel: "weft-wabc".into(),
            allowed: allowed.iter().map(|c| c.parse().unwrap()).collect(),
            policy: Some(policy),
            transit: vec![],
        }),
        ..Default::default()
    };
    batch(&spec)["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["add"]["rule"].as_object().filter(|r| r["chain"] == "from_tunnel"))
        .map(|r| r["expr"].clone())
        .collect()
}

/// An IPv6 rule matches IPv6 connections by their IPv6 destination, and
/// its icmp is ICMPv6.
#[test]
fn an_ipv6_export_rule_is_matched_in_its_own_family() {
    let all = from_tunnel(
        &["10.1.0.0/16", "fd00:1::/48"],
        vec![
            policy_rule("fd00:1:0:2::/64", Some(Protocol::Tcp), Some((5300, 5300))),
            policy_rule("fd00:1:0:3::/64", Some(Protocol::Icmp), None),
        ],
    );
    let rules: Vec<&Value> = all
        .iter()
        .filter(|e| e[2]["match"]["left"]["ct"]["dir"] == "original")
        .collect();
    assert_eq!(rules.len(), 2, "{rules:#?}");
    for r in &rules {
        assert_eq!(r[1]["match"]["right"], "ipv6", "{r:#}");
        assert_eq!(r[2]["match"]["left"]["ct"]["key"], "ip6 daddr", "{r:#}");
    }
    assert_eq!(
        rules[0][2]["match"]["right"],
        json!({"prefix": {"addr": "fd00:1:0:2::", "len": 64}})
    );
    assert_eq!(rules[0][3]["match"]["right"], "tcp");
    assert_eq!(rules[0][4]["match"]["right"], 5300);
    assert_eq!(rules[1][3]["match"]["right"], 58, "ICMPv6, by number");
}

/// Replies pass, then each rule, then the count and the drop, all
/// for packets from the tunnel only; the destination is matched as
/// the peer addressed it.
#[test]
fn an_export_policy_accepts_replies_then_its_rules_and_drops_the_rest() {
    let all = from_tunnel(
        &["10.1.0.0/16"],
        vec![
            policy_rule("10.1.2.0/24", Some(Protocol::Tcp), Some((8080, 8080))),
            policy_rule("10.1.3.0/24", Some(Protocol::Udp), Some((5000, 5010))),
            policy_rule("10.1.4.0/24", Some(Protocol::Icmp), None),
            policy_rule("10.1.5.0/24", None, None),
        ],
    );
    let rules: Vec<&Value> = all.iter().collect();
    // The tunnel filter's two (IPv4's set, IPv6 dropped whole: this
    // peering carries none), then the policy's.
    assert_eq!(rules.len(), 8, "{rules:#?}");
    let iif = json!({"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": "weft-wabc"}});
    assert!(
        rules.iter().all(|r| r[0] == iif),
        "every rule is for the tunnel: {rules:#?}"
    );
    assert_eq!(rules[1][1]["match"]["left"]["meta"]["key"], "nfproto");
    assert_eq!(rules[1][1]["match"]["right"], "ipv6");
    let rules = &rules[1..];
    assert_eq!(rules[1][1]["match"]["left"]["ct"]["key"], "direction");
    assert_eq!(rules[1][2], json!({"accept": null}));
    let dst = |r: &Value| r[2]["match"]["left"]["ct"]["dir"].clone();
    assert!(rules[2..6].iter().all(|r| dst(r) == "original"));
    assert!(
        rules[2..6].iter().all(|r| r[1]["match"]["right"] == "ipv4"),
        "{rules:#?}"
    );
    assert_eq!(
        rules[2][3]["match"],
        json!({"op": "==", "left": {"ct": {"key": "protocol"}}, "right": "tcp"})
    );
    assert_eq!(
        rules[2][4]["match"],
        json!({"op": "==", "left": {"ct": {"key": "proto-dst", "dir": "original"}}, "right": 8080})
    );
    assert_eq!(rules[3][4]["match"]["right"], json!({"range": [5000, 5010]}));
    assert_eq!(rules[4][3]["match"]["right"], "icmp");
    assert_eq!(rules[4][4], json!({"accept": null}), "icmp has no ports");
    assert_eq!(rules[5][3], json!({"accept": null}), "any protocol: the prefix alone");
    assert_eq!(rules[6][1], json!({"counter": POLICY_COUNTER}));
    assert_eq!(rules[6][2], json!({"drop": null}));
    // No rules: only replies pass, and the rest is counted and dropped.
    let none = from_tunnel(&["10.1.0.0/16"], vec![]);
    let text = Value::Array(none[1..].to_vec()).to_string();
    assert!(
        text.contains("\"reply\"") && text.contains(&format!("{{\"counter\":\"{POLICY_COUNTER}\"}}")),
        "{text}"
    );
    assert_eq!(none.len(), 4, "the filter's two, the replies', the drop: {none:#?}");
}

#[test]
fn a_peering_without_remapping_still_clamps_the_mss() {
    let text = batch(&TableSpec {
        mss_clamp: true,
        ..Default::default()
    })
    .to_string();
    assert!(text.contains("\"mss\"") && text.contains("maxseg"), "{text}");
    assert!(!text.contains("\"pre\""), "{text}");
}

#[test]
fn the_listing_hash_ignores_handles_and_counter_values_only() {
    let a: Value = serde_json::from_str(
        r#"{"nftables":[{"metainfo":{"version":"1"}},{"counter":{"name":"tx-b","handle":3,"packets":1,"bytes":9}}]}"#,
    )
    .unwrap();
    let b: Value = serde_json::from_str(
        r#"{"nftables":[{"metainfo":{"version":"2"}},{"counter":{"name":"tx-b","handle":7,"packets":5,"bytes":99}}]}"#,
    )
    .unwrap();
    let c: Value =
        serde_json::from_str(r#"{"nftables":[{"counter":{"name":"tx-c","handle":7,"packets":5,"bytes":99}}]}"#)
            .unwrap();
    assert_eq!(listing_hash(&a), listing_hash(&b));
    assert_ne!(listing_hash(&a), listing_hash(&c));
    let t = parse_counters(&b);
    assert_eq!((t[0].peer_site.as_str(), t[0].tx_bytes, t[0].tx_packets), ("b", 99, 5));
    assert_eq!(t[0].family, Family::V4);
    // IPv6's are counted apart, for a site whose id has dashes too.
    let d: Value = serde_json::from_str(
            r#"{"nftables":[{"counter":{"name":"tx-site-b","packets":1,"bytes":10}},{"counter":{"name":"rx6-site-b","packets":2,"bytes":20}},{"counter":{"name":"dropped","packets":3,"bytes":30}}]}"#,
        )
        .unwrap();
    let t: Vec<(String, Family, u64, u64)> = parse_counters(&d)
        .into_iter()
        .map(|t| (t.peer_site, t.family, t.tx_bytes, t.rx_bytes))
        .collect();
    let site = || "site-b".to_string();
    assert_eq!(t, [(site(), Family::V4, 10, 0), (site(), Family::V6, 0, 20)]);
}

#[test]
fn only_translations_that_changed_have_their_flows_ended() {
    let export = |external: &str, host: &str| Export {
        external: external.parse().unwrap(),
        host: host.parse().unwrap(),
        tunnel: "weft-wabc".into(),
    };
    let nat = |local: &str, real: &str| NatRule {
        local: local.parse().unwrap(),
        real: real.parse().unwrap(),
        tunnel: "weft-wabc".into(),
    };
    let old = TableSpec {
        exports: vec![
            export("10.70.255.254", "192.168.7.5"),
            export("10.70.255.253", "192.168.7.6"),
        ],
        nat: vec![nat("10.200.0.0/16", "10.1.0.0/16"), nat("10.201.0.0/16", "10.2.0.0/16")],
        ..Default::default()
    };
    assert!(stale(&old, &old).is_empty(), "nothing changed, nothing ends");
    // One export moved to another host, one view remapped elsewhere.
    let new = TableSpec {
        exports: vec![
            export("10.70.255.254", "192.168.7.9"),
            export("10.70.255.253", "192.168.7.6"),
        ],
        nat: vec![nat("10.202.0.0/16", "10.1.0.0/16"), nat("10.201.0.0/16", "10.2.0.0/16")],
        ..Default::default()
    };
    let n = |s: &str| s.parse::<ipnet::IpNet>().unwrap();
    assert_eq!(
        stale(&old, &new),
        vec![
            Stale::To(n("10.70.255.254/32")),
            Stale::To(n("10.200.0.0/16")),
            Stale::To(n("10.202.0.0/16")),
            Stale::From(n("10.1.0.0/16")),
        ]
    );
    // An export that comes: flows that ran untranslated to it end too.
    let fewer = TableSpec {
        exports: vec![export("10.70.255.253", "192.168.7.6")],
        ..old.clone()
    };
    assert_eq!(stale(&fewer, &old), vec![Stale::To(n("10.70.255.254/32"))]);
}
