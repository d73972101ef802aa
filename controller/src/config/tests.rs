use super::*;

fn args(site: &str, pods: &[&str]) -> ControllerArgs {
    ControllerArgs {
        site_id: Some(site.into()),
        pod_cidrs: pods.iter().map(|s| s.to_string()).collect(),
        data_dir: Some("/tmp/x".into()),
        ..Default::default()
    }
}

fn fields(e: ConfigError) -> Vec<String> {
    e.0.into_iter().map(|f| f.field).collect()
}

#[test]
fn store_history_is_bounded_and_for_the_embedded_store_only() {
    let mut a = args("site-a", &["10.1.0.0/16"]);
    a.store_history = Some(1000);
    let c = resolve(&a, FileConfig::default()).unwrap();
    assert!(matches!(c.store, StoreConfig::Embedded { history: 1000, .. }));
    a.store_history = Some(10);
    assert_eq!(
        fields(resolve(&a, FileConfig::default()).unwrap_err()),
        ["store_history"]
    );
    a.store_history = Some(1000);
    a.etcd_endpoints = vec!["http://127.0.0.1:2379".into()];
    let e = resolve(&a, FileConfig::default()).unwrap_err();
    assert!(e.to_string().contains("embedded store only"), "{e}");
    assert_eq!(fields(e), ["store_history"]);
}

/// The example the Debian package installs as /etc/weft/controller.toml
/// parses, refuses to start until the site's name and CIDRs are set
/// (a controller started unedited would make a CA for a site that is
/// not this one), and is valid once they are.
#[test]
fn the_shipped_example_configuration_wants_a_site_and_is_valid_with_one() {
    let text = include_str!("../../../deploy/examples/controller.toml");
    let e = resolve(&ControllerArgs::default(), toml::from_str(text).unwrap()).unwrap_err();
    assert!(fields(e).contains(&"site_id".to_string()));
    let c = resolve(&args("site-a", &["10.1.0.0/16"]), toml::from_str(text).unwrap()).unwrap();
    assert_eq!(c.data_dir, PathBuf::from("/tmp/x"), "a flag overrides the file");
    let mut a = args("site-a", &["10.1.0.0/16"]);
    a.data_dir = None;
    let c = resolve(&a, toml::from_str(text).unwrap()).unwrap();
    assert_eq!(c.data_dir, PathBuf::from("/var/lib/weft"));
    assert_eq!(c.admin_socket, PathBuf::from("/var/lib/weft/admin.sock"));
}

#[test]
fn minimal_flags_get_defaults() {
    let c = resolve(&args("site-a", &["10.1.0.0/16"]), FileConfig::default()).unwrap();
    assert_eq!(c.site.external_cidr.to_string(), DEFAULT_EXTERNAL_CIDR);
    assert_eq!(c.site.remap_pools.len(), 3);
    assert_eq!(c.site.node_prefix_len, 24);
    assert_eq!(c.admin_socket, PathBuf::from("/tmp/x/admin.sock"));
    assert_eq!(
        c.store,
        StoreConfig::Embedded {
            path: "/tmp/x/store.redb".into(),
            history: DEFAULT_STORE_HISTORY,
        }
    );
}

#[test]
fn mtus_are_derived_unless_set_and_set_ones_are_checked() {
    let c = resolve(&args("site-a", &["10.1.0.0/16"]), FileConfig::default()).unwrap();
    assert_eq!((c.site.overlay_mtu, c.site.tunnel_mtu), (None, None));
    let file: FileConfig = toml::from_str("tunnel_mtu = 1380\n").unwrap();
    let c = resolve(&args("site-a", &["10.1.0.0/16"]), file).unwrap();
    assert_eq!(c.site.tunnel_mtu, Some(1380));
    let mut a = args("site-a", &["10.1.0.0/16"]);
    a.overlay_mtu = Some(1000);
    a.tunnel_mtu = Some(65000);
    let e = resolve(&a, FileConfig::default()).unwrap_err();
    assert_eq!(fields(e.clone()), ["overlay_mtu", "tunnel_mtu"]);
    assert!(
        e.to_string().contains("--overlay-mtu") && e.to_string().contains("1280 to 9000"),
        "{e}"
    );
}

#[test]
fn the_controllers_addresses_are_kept_out_of_local_views() {
    let mut a = args("site-a", &["10.1.0.0/16"]);
    a.listen = Some("192.0.2.5:7443".into());
    a.advertise = vec!["198.51.100.9:443".into(), "ctl.example:7443".into()];
    let c = resolve(&a, FileConfig::default()).unwrap();
    let ips: Vec<String> = c.site.controller_ips.iter().map(|i| i.to_string()).collect();
    assert_eq!(ips, ["192.0.2.5", "198.51.100.9"]);
    assert!(c.site.own_blocks().contains(&"198.51.100.9/32".parse().unwrap()));
}

#[test]
fn wireguard_ports_default_and_are_checked() {
    let c = resolve(&args("site-a", &["10.1.0.0/16"]), FileConfig::default()).unwrap();
    assert_eq!(c.site.wireguard_ports, PortRange::default());
    let file: FileConfig = toml::from_str("wireguard_ports = \"4000-4009\"\n").unwrap();
    let c = resolve(&args("site-a", &["10.1.0.0/16"]), file).unwrap();
    assert_eq!(c.site.wireguard_ports.count(), 10);
    let mut a = args("site-a", &["10.1.0.0/16"]);
    a.wireguard_ports = Some("51900-51820".into());
    let e = resolve(&a, FileConfig::default()).unwrap_err();
    assert_eq!(fields(e.clone()), ["wireguard_ports"]);
    assert!(e.to_string().contains("--wireguard-ports"), "{e}");
}

#[test]
fn a_site_relays_only_when_asked_on_ports_apart_from_the_tunnels() {
    let c = resolve(&args("site-a", &["10.1.0.0/16"]), FileConfig::default()).unwrap();
    assert_eq!(c.site.relay_ports, None);
    let mut a = args("site-a", &["10.1.0.0/16"]);
    a.relay = true;
    let c = resolve(&a, FileConfig::default()).unwrap();
    assert_eq!(
        c.site.relay_ports,
        Some(PortRange {
            first: 51920,
            last: 51999
        })
    );
    let file: FileConfig = toml::from_str("relay_ports = \"6000-6009\"\n").unwrap();
    let c = resolve(&args("site-a", &["10.1.0.0/16"]), file).unwrap();
    assert_eq!(c.site.relay_ports.map(|r| r.count()), Some(10));
    for bad in ["51900-51950", "6000", "x"] {
        let mut a = args("site-a", &["10.1.0.0/16"]);
        a.relay_ports = Some(bad.into());
        let e = resolve(&a, FileConfig::default()).unwrap_err();
        assert_eq!(fields(e.clone()), ["relay_ports"], "{bad}");
        assert!(e.to_string().contains("--relay-ports"), "{e}");
    }
}

#[test]
fn a_tls_port_for_the_relay_implies_relaying_and_must_be_a_port() {
    let mut a = args("site-a", &["10.1.0.0/16"]);
    a.relay_tls_port = Some(443);
    let c = resolve(&a, FileConfig::default()).unwrap();
    assert_eq!(c.site.relay_tls_port, Some(443));
    assert!(c.site.relay_ports.is_some(), "--relay-tls-port implies --relay");
    let file: FileConfig = toml::from_str("relay_tls_port = 8443\n").unwrap();
    let c = resolve(&args("site-a", &["10.1.0.0/16"]), file).unwrap();
    assert_eq!(
        (c.site.relay_tls_port, c.site.relay_ports.is_some()),
        (Some(8443), true)
    );
    a.relay_tls_port = Some(0);
    let e = resolve(&a, FileConfig::default()).unwrap_err();
    assert_eq!(fields(e.clone()), ["relay_tls_port"]);
    assert!(e.to_string().contains("--relay-tls-port"), "{e}");
}

#[test]
fn flags_override_the_file() {
    let file: FileConfig =
        toml::from_str("site_id = \"from-file\"\npod_cidrs = [\"10.9.0.0/16\"]\nnode_prefix_len = 26\n").unwrap();
    let c = resolve(&args("from-flag", &[]), file).unwrap();
    assert_eq!(c.site.id, "from-flag");
    assert_eq!(c.site.pod_cidrs[0].to_string(), "10.9.0.0/16");
    assert_eq!(c.site.node_prefix_len, 26);
}

#[test]
fn each_problem_names_its_field() {
    let e = resolve(
        &args("Bad/Id", &["10.1.0.0/33", "10.1.2.3/16", "fe80::/64"]),
        FileConfig::default(),
    )
    .unwrap_err();
    assert_eq!(
        fields(e.clone()),
        ["site_id", "pod_cidrs[0]", "pod_cidrs[1]", "pod_cidrs[2]"],
        "{e}"
    );
    let text = e.to_string();
    assert!(text.contains("--pod-cidr"), "{text}");
    assert!(text.contains("10.1.0.0/16"), "host-bit hint: {text}");
    assert!(text.contains("link-local"), "{text}");
}

#[test]
fn ipv6_cidrs_are_taken_beside_ipv4_and_bad_ones_are_named() {
    let mut a = args("s", &["10.1.0.0/16", "FD00:1::/48"]);
    a.external_cidr_v6 = Some("fd00:70::/64".into());
    a.remap_pools = vec!["fd9a::/40".into()];
    let c = resolve(&a, FileConfig::default()).unwrap();
    let v6 = c.site.ipv6.as_ref().unwrap();
    assert_eq!(c.site.pod_cidrs.len(), 1);
    assert_eq!(v6.pod_cidrs[0].to_string(), "fd00:1::/48", "normalised");
    assert_eq!(v6.external_cidr.unwrap().to_string(), "fd00:70::/64");
    assert_eq!(v6.remap_pools[0].to_string(), "fd9a::/40");
    assert_eq!(c.site.remap_pools.len(), 3, "IPv4 pools stay the defaults");
    // No IPv6 pool: one is generated when the site is first stored.
    let c = resolve(&args("s", &["10.1.0.0/16", "fd00:1::/48"]), FileConfig::default()).unwrap();
    assert!(c.site.ipv6.unwrap().remap_pools.is_empty());
    assert!(
        resolve(&args("s", &["10.1.0.0/16"]), FileConfig::default())
            .unwrap()
            .site
            .ipv6
            .is_none()
    );

    // An IPv6-only site: no IPv4 pods, its IPv6 ones.
    let only = resolve(&args("s", &["fd00:1::/48"]), FileConfig::default())
        .unwrap()
        .site;
    assert!(only.pod_cidrs.is_empty());
    assert_eq!(only.ipv6.unwrap().pod_cidrs[0].to_string(), "fd00:1::/48");

    for (pods, field, says) in [
        (&["10.1.0.0/16", "fd00:1::1/48"][..], "pod_cidrs[1]", "host bits set"),
        (&["10.1.0.0/16", "fd00:1:::/48"], "pod_cidrs[1]", "is not a CIDR"),
        (&["10.1.0.0/16", "fd00:1::/129"], "pod_cidrs[1]", "from 0 to 128"),
        (
            &["10.1.0.0/16", &format!("fd00::/{}", "4".repeat(80))],
            "pod_cidrs[1]",
            "too long",
        ),
        (&["10.1.0.0/16", "fd00:1::/72"], "pod_cidrs[1]", "give a /32 to a /64"),
        (&["10.1.0.0/16", "fd00::/16"], "pod_cidrs[1]", "give a /32 to a /64"),
        (&["10.1.0.0/16", "fe80::/64"], "pod_cidrs[1]", "link-local (fe80::/10)"),
        (&["10.1.0.0/16", "ff05::/48"], "pod_cidrs[1]", "multicast (ff00::/8)"),
        (&["10.1.0.0/16", "::1/128"], "pod_cidrs[1]", "loopback (::1)"),
        (
            &["10.1.0.0/16", "fd00:1::/48", "fd00:1:0:100::/56"],
            "pod_cidrs",
            "overlaps",
        ),
    ] {
        let e = resolve(&args("s", pods), FileConfig::default()).unwrap_err();
        let hit =
            e.0.iter()
                .find(|f| f.field == field)
                .unwrap_or_else(|| panic!("{pods:?}: {e}"));
        assert!(hit.message.contains(says), "{pods:?}: {}", hit.message);
    }
    for (external, says) in [
        ("10.71.0.0/16", "is IPv4; give the IPv4 external CIDR as external_cidr"),
        ("fd00:70::/32", "give a /48 to a /120"),
        ("fe80::/64", "link-local"),
        ("fd00:1::/64", "overlaps"),
    ] {
        let mut a = args("s", &["10.1.0.0/16", "fd00:1::/48"]);
        a.external_cidr_v6 = Some(external.into());
        let e = resolve(&a, FileConfig::default()).unwrap_err();
        let hit =
            e.0.iter()
                .find(|f| f.field == "external_cidr_v6")
                .unwrap_or_else(|| panic!("{external}: {e}"));
        assert!(hit.message.contains(says), "{external}: {}", hit.message);
    }
    let mut a = args("s", &["10.1.0.0/16"]);
    a.external_cidr_v6 = Some("fd00:70::/64".into());
    assert!(
        resolve(&a, FileConfig::default())
            .unwrap_err()
            .to_string()
            .contains("no IPv6 pod CIDR")
    );
    a.external_cidr_v6 = None;
    a.external_cidr = Some("fd00:70::/64".into());
    assert!(
        resolve(&a, FileConfig::default())
            .unwrap_err()
            .to_string()
            .contains("external_cidr_v6")
    );
    let mut a = args("s", &["10.1.0.0/16", "fd00:1::/48"]);
    a.remap_pools = vec!["ff00::/8".into()];
    assert!(
        resolve(&a, FileConfig::default())
            .unwrap_err()
            .to_string()
            .contains("remap_pools[0]")
    );
    // IPv6 entries on an IPv4 site are not dropped unread.
    let mut a = args("s", &["10.1.0.0/16"]);
    a.reserved_cidrs = vec!["fd00:9::/48".into()];
    let e = resolve(&a, FileConfig::default()).unwrap_err();
    assert_eq!(fields(e.clone()), ["reserved_cidrs"], "{e}");
    assert!(e.to_string().contains("no IPv6 pod CIDR"), "{e}");
    // IPv4 special space is left as it was: a running site keeps starting.
    assert!(resolve(&args("s", &["10.1.0.0/16", "169.254.0.0/16"]), FileConfig::default()).is_ok());
}

#[test]
fn overlaps_and_prefix_bounds_are_refused() {
    let mut a = args("s", &["10.70.0.0/16"]);
    let e = resolve(&a, FileConfig::default()).unwrap_err();
    assert_eq!(fields(e.clone()), ["external_cidr"]);
    assert!(e.to_string().contains("(the default)"), "{e}");
    a.pod_cidrs = vec!["10.1.0.0/16".into()];
    a.reserved_cidrs = vec!["10.1.4.0/24".into()];
    a.node_prefix_len = Some(31);
    let e = resolve(&a, FileConfig::default()).unwrap_err();
    assert_eq!(fields(e), ["node_prefix_len", "reserved_cidrs[0]"]);
    a.reserved_cidrs.clear();
    a.node_prefix_len = Some(15);
    assert_eq!(
        fields(resolve(&a, FileConfig::default()).unwrap_err()),
        ["node_prefix_len"]
    );
}

#[test]
fn missing_required_and_bad_etcd() {
    let a = ControllerArgs {
        etcd_endpoints: vec!["127.0.0.1:2379".into(), "https://h:1".into()],
        listen: Some("nowhere".into()),
        ..Default::default()
    };
    let e = resolve(&a, FileConfig::default()).unwrap_err();
    assert_eq!(
        fields(e),
        [
            "site_id",
            "pod_cidrs",
            "listen",
            "etcd_endpoints[0]",
            "etcd_endpoints[1]"
        ]
    );
}

#[test]
fn unknown_file_field_is_named() {
    let a = ControllerArgs {
        config: Some("c.toml".into()),
        ..Default::default()
    };
    let e = load(&a, &|_| Ok("site_id = \"a\"\npod_cidr = \"10.0.0.0/8\"\n".into()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("pod_cidr"), "{e}");
}
