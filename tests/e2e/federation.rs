//! Federation between real controller processes on loopback: pairwise
//! peering from tokens (one site on etcd, two embedded), remapped views for
//! equal CIDRs, deletion on both sides, and every refusal writing nothing.

use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use weft_controller::federation::PeeringToken;
use weft_tests::{Controller, ControllerSpec, Etcd, bin, run, stderr, weftctl_json};

fn site(dir: &std::path::Path, id: &str, extra: &[&str]) -> Controller {
    let mut args = vec!["--pod-cidr", "10.1.0.0/16"];
    args.extend(extra);
    ControllerSpec::new(id).data_dir(&dir.join(id)).flags(&args).start()
}

fn token(c: &Controller, ttl: &str) -> String {
    weftctl_json(&c.target(), &["peering", "token", "--ttl", ttl])["token"]
        .as_str()
        .unwrap()
        .to_string()
}

/// `weftctl peering create` on `c`; Ok(json) or Err(stderr).
fn create(c: &Controller, token: &str) -> Result<Value, String> {
    let o = run(Command::new(bin("weftctl")).args([
        "--controller",
        &c.target(),
        "-o",
        "json",
        "peering",
        "create",
        "--token",
        token,
    ]));
    if o.status.success() {
        Ok(serde_json::from_slice(&o.stdout).unwrap())
    } else {
        Err(stderr(&o))
    }
}

fn peers(c: &Controller) -> Vec<Value> {
    weftctl_json(&c.target(), &["peerings"])["peerings"]
        .as_array()
        .unwrap()
        .clone()
}

fn peer_names(c: &Controller) -> Vec<String> {
    let mut v: Vec<String> = peers(c)
        .iter()
        .map(|p| p["site_id"].as_str().unwrap().to_string())
        .collect();
    v.sort();
    v
}

fn revision(c: &Controller) -> i64 {
    weftctl_json(&c.target(), &["site"])["revision"].as_i64().unwrap()
}

/// Waits until `c`'s store stops moving: the same revision over one second
/// (a peering just made still writes for a moment: the peer's readiness,
/// its held token given up).
fn settled(c: &Controller) {
    let mut last = revision(c);
    weft_tests::eventually("the store settling", Duration::from_secs(30), || {
        std::thread::sleep(weft_tests::pace::scaled(Duration::from_secs(1)));
        let now = revision(c);
        (std::mem::replace(&mut last, now) == now).then_some(())
    });
}

fn workload_view(c: &Controller, peer: &str) -> String {
    let (real, local) = weft_tests::peer_view(&c.target(), peer, "workload");
    assert_eq!(real, "10.1.0.0/16");
    local
}

#[test]
fn three_sites_peer_pairwise_with_distinct_views_and_delete_on_both_sides() {
    let Some(etcd) = Etcd::start() else { return };
    let dir = tempfile::Builder::new().prefix("weft-fed").tempdir().unwrap();
    let ep = etcd.endpoint();
    let a = site(dir.path(), "site-a", &["--etcd-endpoints", &ep]);
    let b = site(dir.path(), "site-b", &[]);
    let c = site(dir.path(), "site-c", &[]);

    let ab = create(&a, &token(&b, "10m")).unwrap();
    assert_eq!(
        (ab["site_id"].as_str(), ab["state"].as_str()),
        (Some("site-b"), Some("connecting"))
    );
    create(&a, &token(&c, "10m")).unwrap();
    create(&b, &token(&c, "10m")).unwrap();

    assert_eq!(peer_names(&a), ["site-b", "site-c"]);
    assert_eq!(peer_names(&b), ["site-a", "site-c"]);
    assert_eq!(peer_names(&c), ["site-a", "site-b"]);
    // Negotiated, but no site here has a gateway: connecting, saying so.
    for p in peers(&b) {
        assert_eq!(p["state"], "connecting");
        assert!(
            p["waiting_for"].to_string().contains("a live gateway of this site"),
            "{p}"
        );
    }
    weft_tests::step("three sites on one CIDR, distinct views");
    // All three use 10.1.0.0/16: each site remaps both peers, to distinct views.
    for (s, x, y) in [
        (&a, "site-b", "site-c"),
        (&b, "site-a", "site-c"),
        (&c, "site-a", "site-b"),
    ] {
        let (vx, vy) = (workload_view(s, x), workload_view(s, y));
        assert_ne!(vx, "10.1.0.0/16");
        assert_ne!(vy, "10.1.0.0/16");
        assert_ne!(vx, vy, "two peers with the same CIDR share a view");
    }
    weft_tests::step("tunnel roles agree");
    // Tunnel roles agree: exactly one server per pair.
    let role =
        |s: &Controller, p: &str| peers(s).into_iter().find(|x| x["site_id"] == p).unwrap()["tunnel_role"].clone();
    assert_ne!(role(&a, "site-b"), role(&b, "site-a"));

    weft_tests::step("a deletion on one side ends both");
    // Deleting on one side removes the peering on both and releases the views.
    let d = weftctl_json(&b.target(), &["peering", "delete", "site-a"]);
    assert_eq!(d["remote_notified"], true);
    assert_eq!(peer_names(&a), ["site-c"]);
    assert_eq!(peer_names(&b), ["site-c"]);
    let allocs = weftctl_json(&a.target(), &["allocations"]);
    assert!(
        allocs["allocations"]
            .as_array()
            .unwrap()
            .iter()
            .all(|x| !x["owner"].as_str().unwrap().starts_with("site-b")),
        "site-b's views were released on site-a"
    );
}

#[test]
fn refused_peerings_write_nothing() {
    weft_tests::step("three sites up");
    let dir = tempfile::Builder::new().prefix("weft-fed").tempdir().unwrap();
    let a = site(dir.path(), "site-a", &[]);
    let b = site(dir.path(), "site-b", &[]);
    let c = site(dir.path(), "site-c", &[]);
    let unchanged = |sites: &[&Controller], f: &dyn Fn() -> String, code: &str, needle: &str| {
        let before: Vec<i64> = sites.iter().map(|s| revision(s)).collect();
        let err = f();
        assert!(
            err.contains(code) && err.contains(needle),
            "expected {code} / {needle:?} in: {err}"
        );
        let after: Vec<i64> = sites.iter().map(|s| revision(s)).collect();
        assert_eq!(before, after, "a refused peering wrote something: {err}");
    };

    weft_tests::step("an expired token is refused");
    // expired
    let t = token(&b, "1s");
    std::thread::sleep(Duration::from_millis(1500));
    unchanged(
        &[&a, &b],
        &|| create(&a, &t).unwrap_err(),
        "FAILED_PRECONDITION",
        "expired",
    );

    weft_tests::step("a malformed token and one's own are refused");
    // malformed, and one's own token
    unchanged(
        &[&a],
        &|| create(&a, "weftp1.!!!").unwrap_err(),
        "INVALID_ARGUMENT",
        "malformed",
    );
    let own = token(&a, "10m");
    unchanged(
        &[&a],
        &|| create(&a, &own).unwrap_err(),
        "INVALID_ARGUMENT",
        "this site",
    );

    weft_tests::step("a tampered fingerprint is refused");
    // tampered fingerprint
    let mut t = PeeringToken::decode(&token(&b, "10m")).unwrap();
    t.fp = "ab".repeat(32);
    let tampered = t.encode();
    unchanged(
        &[&a, &b],
        &|| create(&a, &tampered).unwrap_err(),
        "FAILED_PRECONDITION",
        "fingerprint",
    );

    weft_tests::step("a token for the wrong site is refused");
    // a token for the wrong site: c's endpoint and CA, but it says site-b
    let mut t = PeeringToken::decode(&token(&c, "10m")).unwrap();
    t.site = "site-b".into();
    let wrong = t.encode();
    unchanged(
        &[&a, &c],
        &|| create(&a, &wrong).unwrap_err(),
        "FAILED_PRECONDITION",
        "site-c",
    );

    weft_tests::step("a reused token is refused");
    // reused: a uses b's token, then c tries the same one
    let t = token(&b, "10m");
    create(&a, &t).unwrap();
    assert_eq!(
        create(&a, &t).unwrap()["site_id"],
        "site-b",
        "a repeated create is idempotent"
    );
    // b marks the token spent once it sees a holding the peering (its own
    // write, which may land a moment later): wait for it before counting.
    weft_tests::eventually("b sees a holding the peering", Duration::from_secs(20), || {
        peers(&b)
            .iter()
            .any(|p| p["site_id"] == "site-a" && p["held_by_peer"] == true)
            .then_some(())
    });
    settled(&b);
    unchanged(
        &[&b, &c],
        &|| create(&c, &t).unwrap_err(),
        "FAILED_PRECONDITION",
        "used",
    );

    weft_tests::step("a different site claiming a peered id is refused");
    // a different site claiming an id that is already peered (site-b, other CA)
    std::fs::create_dir_all(dir.path().join("x")).unwrap();
    let impostor = site(&dir.path().join("x"), "site-b", &[]);
    let t = token(&a, "10m");
    settled(&a);
    unchanged(
        &[&a, &impostor],
        &|| create(&impostor, &t).unwrap_err(),
        "ALREADY_EXISTS",
        "another CA",
    );

    weft_tests::step("only the one peering remains");
    assert_eq!(peer_names(&a), ["site-b"]);
    assert_eq!(peer_names(&b), ["site-a"]);
    assert!(peer_names(&c).is_empty());
}

/// A site whose workloads live in public space peers only with sites that
/// allow that block, and they route it only through a remapped view; one
/// that does not allow it refuses, naming the field.
#[test]
fn a_peer_in_public_space_is_refused_unless_allowed_and_then_only_remapped() {
    weft_tests::step("a strict site refuses a peer in public space");
    let dir = tempfile::Builder::new().prefix("weft-fed").tempdir().unwrap();
    let public = ControllerSpec::new("site-p")
        .data_dir(&dir.path().join("site-p"))
        .flags(&["--pod-cidr", "1.1.1.0/24"])
        .start();
    let strict = site(dir.path(), "site-a", &[]);
    let before = revision(&strict);
    let err = create(&strict, &token(&public, "10m")).unwrap_err();
    assert!(
        err.contains("INVALID_ARGUMENT")
            && err.contains("workload_cidrs[0]")
            && err.contains("1.1.1.0/24")
            && err.contains("--peer-public-cidr"),
        "{err}"
    );
    assert_eq!(revision(&strict), before, "a refused peering wrote something");
    assert!(peer_names(&strict).is_empty());
    weft_tests::eventually("p forgot its side", Duration::from_secs(10), || {
        peer_names(&public).is_empty().then_some(())
    });
    weft_tests::step("the strict site refuses the join and shows why");
    // The other way round, the strict site refuses the Join itself: its
    // admin sees what was refused and why, in peerings and diagnose.
    let err = create(&public, &token(&strict, "10m")).unwrap_err();
    assert!(err.contains("INVALID_ARGUMENT") && err.contains("1.1.1.0/24"), "{err}");
    assert!(peer_names(&strict).is_empty());
    let listed = weftctl_json(&strict.target(), &["peerings"]);
    let refused = &listed["refused_joins"][0];
    assert_eq!(refused["site_id"], "site-p", "{listed}");
    assert_eq!(refused["code"], "INVALID_ARGUMENT", "{listed}");
    assert!(
        refused["message"].as_str().unwrap().contains("workload_cidrs[0]")
            && refused["message"].as_str().unwrap().contains("1.1.1.0/24"),
        "{listed}"
    );
    let table = weft_tests::stdout(&run(Command::new(bin("weftctl")).args([
        "--controller",
        &strict.target(),
        "peerings",
    ])));
    assert!(table.contains("refused site-p's join"), "{table}");
    let status = weft_tests::stdout(&run(Command::new(bin("weftctl")).args([
        "--controller",
        &strict.target(),
        "status",
    ])));
    assert!(
        status.contains("refused site-p's join") && status.contains("1.1.1.0/24"),
        "{status}"
    );
    let o = run(Command::new(bin("weftctl")).args(["--controller", &strict.target(), "-o", "json", "diagnose"]));
    let d: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        d.to_string().contains("refused site \\\"site-p\\\"'s join"),
        "diagnose does not show the refusal: {d}"
    );
    assert_eq!(o.status.code(), Some(0), "a warning, not a failure: {d}");

    weft_tests::step("an allowing site routes the public block only through a remapped view");
    let open = site(dir.path(), "site-b", &["--peer-public-cidr", "1.1.0.0/16"]);
    create(&open, &token(&public, "10m")).unwrap();
    let (real, local) = weft_tests::peer_view(&open.target(), "site-p", "workload");
    assert_eq!(real, "1.1.1.0/24");
    assert_ne!(
        local, real,
        "an allowed public block is routed only through a remapped view"
    );
    let local: ipnet::Ipv4Net = local.parse().unwrap();
    assert!(
        ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"]
            .iter()
            .any(|p| p.parse::<ipnet::Ipv4Net>().unwrap().contains(&local)),
        "{local} is not from a remap pool"
    );
}

/// Two peers whose site ids hash alike would share the links of their
/// peerings on this site's gateways: the second is refused, naming the
/// field, and nothing is written. (These two ids were found by a birthday
/// search over the 36-bit link tag.)
#[test]
fn a_peer_whose_id_hashes_like_a_peers_is_refused() {
    let dir = tempfile::Builder::new().prefix("weft-fed").tempdir().unwrap();
    let a = site(dir.path(), "site-a", &[]);
    let first = ControllerSpec::new("site-34359")
        .data_dir(&dir.path().join("p1"))
        .flags(&["--pod-cidr", "10.2.0.0/16"])
        .start();
    let second = ControllerSpec::new("site-74386")
        .data_dir(&dir.path().join("p2"))
        .flags(&["--pod-cidr", "10.3.0.0/16"])
        .start();
    create(&a, &token(&first, "10m")).unwrap();
    // The new peering still writes for a moment (the peer's readiness).
    settled(&a);
    let before = revision(&a);
    let err = create(&a, &token(&second, "10m")).unwrap_err();
    assert!(
        err.contains("INVALID_ARGUMENT") && err.contains("site_id") && err.contains("site-34359"),
        "{err}"
    );
    assert_eq!(revision(&a), before, "a refused peering wrote something");
    assert_eq!(peer_names(&a), ["site-34359"]);
}

/// A host enrolled after a peering whose underlay address lies in that
/// peer's view would have its overlay routed into the peer: the real agent
/// is refused at once, naming the peering, and nothing is recorded. Outside
/// the views, the same site enrolls hosts as before.
#[test]
fn a_host_enrolled_inside_a_peers_view_is_refused_naming_the_peering() {
    let dir = tempfile::Builder::new().prefix("weft-fed").tempdir().unwrap();
    let a = site(dir.path(), "site-a", &[]);
    let b = ControllerSpec::new("site-b")
        .data_dir(&dir.path().join("site-b"))
        .flags(&["--pod-cidr", "10.2.0.0/16"])
        .start();
    create(&a, &token(&b, "10m")).unwrap();
    let (_, local) = weft_tests::peer_view(&a.target(), "site-b", "workload");
    assert_eq!(local, "10.2.0.0/16");
    for (kind, name) in [("node", "late"), ("gateway", "late-gw")] {
        let mut agent = weft_tests::dry_run_agent(kind, name, "10.2.0.9", &[&a], &a, dir.path());
        let status = agent
            .wait_exit(Duration::from_secs(30))
            .unwrap_or_else(|| panic!("the {kind} was not refused:\n{}", agent.log_text()));
        assert!(!status.success());
        let log = agent.log_text();
        assert!(
            log.contains("underlay")
                && log.contains("10.2.0.9")
                && log.contains("\"site-b\"")
                && log.contains("weftctl peering delete site-b"),
            "{log}"
        );
        let list = weftctl_json(&a.target(), &[&format!("{kind}s")]);
        assert!(
            !list.to_string().contains(name),
            "a refused {kind} was recorded: {list}"
        );
    }
    let mut ok = weft_tests::dry_run_agent("node", "lan", "127.0.0.1", &[&a], &a, dir.path());
    weft_tests::eventually("a node outside the views enrolls", Duration::from_secs(20), || {
        ok.log_text().contains("watching").then_some(())
    });
    assert!(ok.wait_exit(Duration::from_millis(100)).is_none());
}

/// When the dialing side cannot record its side (here: no room in its remap
/// pools for the peer's CIDR), it undoes the other side: no half peering.
#[test]
fn a_failure_after_the_peer_recorded_leaves_no_half_peering() {
    let dir = tempfile::Builder::new().prefix("weft-fed").tempdir().unwrap();
    let a = site(dir.path(), "site-a", &["--remap-pool", "192.168.255.252/30"]);
    let b = site(dir.path(), "site-b", &[]);
    let t = token(&b, "10m");
    let err = create(&a, &t).unwrap_err();
    assert!(
        err.contains("RESOURCE_EXHAUSTED") && err.contains("192.168.255.252/30"),
        "{err}"
    );
    assert!(peer_names(&a).is_empty());
    assert!(peer_names(&b).is_empty(), "site-b kept a half peering");
}

#[test]
fn a_peer_claiming_space_no_site_can_own_is_refused_on_both_sides() {
    let dir = tempfile::Builder::new().prefix("weft-fed").tempdir().unwrap();
    let a = site(dir.path(), "site-a", &[]);
    // Site b's workloads in link-local space, where weft's own tunnel ends
    // live: whatever b's admin meant, a must not route it.
    let b = ControllerSpec::new("site-b")
        .data_dir(&dir.path().join("site-b"))
        .flags(&["--pod-cidr", "169.254.0.0/16"])
        .start();
    let err = create(&a, &token(&b, "10m")).unwrap_err();
    assert!(
        err.contains("INVALID_ARGUMENT") && err.contains("169.254.0.0/16") && err.contains("no site can own"),
        "{err}"
    );
    assert!(peer_names(&a).is_empty(), "a recorded a half peering");
    weft_tests::eventually("b forgot its side", Duration::from_secs(10), || {
        peer_names(&b).is_empty().then_some(())
    });
}

#[test]
fn a_site_with_ipv6_workloads_in_special_space_does_not_start() {
    // Link-local, loopback or multicast IPv6 workloads: refused at start,
    // naming the field.
    let dir = tempfile::Builder::new().prefix("weft-fed").tempdir().unwrap();
    for cidr in ["fe80::/64", "::1/128", "ff05::/48"] {
        let o = run(Command::new(bin("weft-controller")).args([
            "--site-id",
            "site-b",
            "--pod-cidr",
            &format!("10.1.0.0/16,{cidr}"),
            "--data-dir",
            &dir.path().join("b").display().to_string(),
            "check-config",
        ]));
        assert_eq!(o.status.code(), Some(2), "{cidr}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("pod_cidrs[1]") && stderr(&o).contains(cidr),
            "{cidr}: {}",
            stderr(&o)
        );
    }
}

/// A hostile peer: a site with a CA of its own (taken from a real
/// controller's data directory) that joins with a peering token but
/// announces gateway endpoints, keys or an MTU no gateway could use. Each
/// is refused at negotiation, naming the field, and nothing is recorded:
/// the token still works afterwards.
#[test]
fn a_peer_announcing_an_unusable_gateway_is_refused_and_nothing_is_recorded() {
    use weft_agent::tls::{Trust, connect};
    use weft_controller::pki::{SiteCa, identity_uri};
    use weft_proto::v1 as pb;
    use weft_proto::v1::federation_service_client::FederationServiceClient;

    let dir = tempfile::Builder::new().prefix("weft-fed").tempdir().unwrap();
    // A short agent TTL: b's node, once stopped, is let go soon (below).
    let b = site(dir.path(), "site-b", &["--agent-ttl", "5s"]);
    let x = site(dir.path(), "site-x", &[]);
    let ca = SiteCa::load(&x.pki("")).unwrap();
    let ca_pem = std::fs::read_to_string(x.pki("ca.pem")).unwrap();
    let (cert, key) = ca
        .issue_with_key(&identity_uri("site-x", "site", "site-x"), "site-x", 1)
        .unwrap();
    let t = PeeringToken::decode(&token(&b, "10m")).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let join_gw = |gw: pb::GatewayInfo, mtu: u32, cidr: &str, names: Vec<pb::PublishedName>| {
        rt.block_on(async {
            let ch = connect(
                &format!("https://{}", t.endpoints[0]),
                &Trust::FingerprintForSite(t.fp.clone(), t.site.clone()),
                Some((&cert, &key)),
            )
            .await
            .unwrap();
            FederationServiceClient::new(ch)
                .join(pb::JoinRequest {
                    token_id: t.id.clone(),
                    secret: t.secret.clone(),
                    ca_pem: ca_pem.clone(),
                    params: Some(pb::NetworkParams {
                        site_id: "site-x".into(),
                        workload_cidrs: vec![cidr.into()],
                        external_cidr: "10.71.0.0/16".into(),
                        gateways: vec![gw],
                        mtu,
                        endpoints: vec!["127.0.0.1:1".into()],
                        names,
                        ..Default::default()
                    }),
                })
                .await
        })
    };
    let gateway = |endpoint: &str, public_key: &str| pb::GatewayInfo {
        name: "gw".into(),
        endpoint: endpoint.into(),
        public_key: public_key.into(),
        active: true,
        ..Default::default()
    };
    let join_named = |endpoint: &str, public_key: &str, mtu: u32, cidr: &str, names: Vec<pb::PublishedName>| {
        join_gw(gateway(endpoint, public_key), mtu, cidr, names)
    };
    let join_with =
        |endpoint: &str, public_key: &str, mtu: u32, cidr: &str| join_named(endpoint, public_key, mtu, cidr, vec![]);
    let join = |endpoint: &str, public_key: &str, mtu: u32| join_with(endpoint, public_key, mtu, "10.8.0.0/16");
    let good_key = "hT7XTB7qgr4m+5V8gqhnNtjvNrqSqPFiCjPsXl1Oc0Q=";
    for (endpoint, public_key, mtu, field) in [
        ("192.0.2.1:70000", good_key, 0, "gateways[0].endpoint"),
        ("192.0.2.1:0", good_key, 0, "gateways[0].endpoint"),
        ("192.0.2.1", good_key, 0, "gateways[0].endpoint"),
        ("gw.example:51820", good_key, 0, "gateways[0].endpoint"),
        ("192.0.2.1:51820\nlisten_port=1", good_key, 0, "gateways[0].endpoint"),
        ("192.0.2.1:51820", "AAAA", 0, "gateways[0].public_key"),
        // 40 bytes
        (
            "192.0.2.1:51820",
            "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA==",
            0,
            "gateways[0].public_key",
        ),
        ("192.0.2.1:51820", good_key, 70000, "mtu"),
        // Addresses no peer's gateway can be at, where b's gateways would
        // send handshakes every 5 s: b's own loopback services, cloud
        // metadata, multicast.
        (
            "127.0.0.1:9100",
            good_key,
            0,
            "gateways[0].endpoint 127.0.0.1:9100 is a loopback address",
        ),
        (
            "169.254.169.254:80",
            good_key,
            0,
            "gateways[0].endpoint 169.254.169.254:80 is a link-local address",
        ),
        (
            "[::1]:9100",
            good_key,
            0,
            "gateways[0].endpoint [::1]:9100 is a loopback address",
        ),
        ("[::ffff:127.0.0.1]:9100", good_key, 0, "is a loopback address"),
        ("[fe80::1]:51820", good_key, 0, "is a link-local address"),
        ("239.1.2.3:51820", good_key, 0, "is a multicast address"),
    ] {
        let before = revision(&b);
        let err = join(endpoint, public_key, mtu).expect_err(endpoint);
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{endpoint:?}: {err:?}");
        assert!(err.message().contains(field), "{endpoint:?}: {}", err.message());
        assert_eq!(revision(&b), before, "{endpoint:?} wrote something");
        assert!(peer_names(&b).is_empty());
    }
    weft_tests::step("public space, and space no site can own, refused");
    // Public space: a peer announcing 8.0.0.0/8 or 1.1.1.0/24 would take
    // those destinations of b's hosts (and answer b's DNS for them);
    // link-local space holds weft's own tunnel ends.
    for (cidr, says) in [
        ("8.0.0.0/8", "not private"),
        ("1.1.1.0/24", "not private"),
        ("100.128.0.0/16", "not private"),
        ("169.254.0.0/16", "no site can own"),
        ("127.0.0.0/16", "no site can own"),
        ("224.1.0.0/16", "no site can own"),
    ] {
        let before = revision(&b);
        let err = join_with("192.0.2.1:51820", good_key, 0, cidr).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{cidr}: {err:?}");
        assert!(
            err.message().contains("workload_cidrs[0]") && err.message().contains(says),
            "{cidr}: {}",
            err.message()
        );
        assert_eq!(revision(&b), before, "{cidr}: wrote something");
        assert!(peer_names(&b).is_empty());
    }
    weft_tests::step("a CIDR over the site's hosts refused");
    // A workload CIDR over one of b's hosts (10.9.0.0/16 covers its node's
    // underlay address 10.9.0.7) is refused too, naming the field and the
    // host: a peer has no business announcing b's own hosts.
    let mut node = weft_tests::dry_run_agent("node", "n1", "10.9.0.7", &[&b], &b, dir.path());
    weft_tests::eventually("b's node enrolled", Duration::from_secs(20), || {
        node.log_text().contains("watching").then_some(())
    });
    // Its liveness record is written (with the next batch of records)
    // before it is stopped, so that "not ready" below means it is gone.
    weft_tests::eventually("b saw its node", Duration::from_secs(20), || {
        (weftctl_json(&b.target(), &["node", "get", "n1"])["status"]["ready"] == true).then_some(())
    });
    node.stop();
    // Its liveness record goes when its lease ends: a write of b's own,
    // which must not land inside the check below.
    weft_tests::eventually("b saw its node go", Duration::from_secs(60), || {
        (weftctl_json(&b.target(), &["node", "get", "n1"])["status"]["ready"] != true).then_some(())
    });
    let before = revision(&b);
    let err = join_with("192.0.2.1:51820", good_key, 0, "10.9.0.0/16").unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("workload_cidrs[0]") && err.message().contains("10.9.0.7"),
        "{}",
        err.message()
    );
    assert_eq!(revision(&b), before, "a CIDR over b's host wrote something");
    assert!(peer_names(&b).is_empty());
    // A gateway endpoint on one of b's hosts: b's gateways would send
    // there.
    let err = join("10.9.0.7:51820", good_key, 0).unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(
        err.message()
            .contains("gateways[0].endpoint 10.9.0.7:51820 is the address of node \"n1\""),
        "{}",
        err.message()
    );
    assert_eq!(revision(&b), before, "an endpoint on b's host wrote something");

    weft_tests::step("hostile candidate lists refused");
    // Endpoint discovery's candidates: a peer must not point b's gateways
    // at loopback, multicast, b's own hosts, or flood the list.
    let cand = |a: &str| pb::Candidate {
        address: a.into(),
        kind: "reflexive".into(),
    };
    for (list, field, what) in [
        (vec![cand("127.0.0.1:51820")], "gateways[0].candidates[0]", "loopback"),
        (
            vec![cand("198.51.100.7:51820"), cand("239.1.2.3:51820")],
            "gateways[0].candidates[1]",
            "multicast",
        ),
        (vec![cand("10.9.0.7:51820")], "gateways[0].candidates[0]", "node \"n1\""),
        (
            vec![cand("198.51.100.7:51820"); 1000],
            "gateways[0].candidates",
            "at most 8",
        ),
        (
            vec![pb::Candidate {
                address: "198.51.100.7:51820".into(),
                kind: "relay; rm -rf".into(),
            }],
            "gateways[0].candidates[0].kind",
            "not a candidate kind",
        ),
    ] {
        let before = revision(&b);
        let mut gw = gateway("", good_key);
        gw.candidates = list;
        gw.nat = "endpoint-independent".into();
        let err = join_gw(gw, 0, "10.8.0.0/16", vec![]).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{field}: {err:?}");
        assert!(
            err.message().contains(field) && err.message().contains(what),
            "{field}, {what}: {}",
            err.message()
        );
        assert_eq!(revision(&b), before, "{field}: wrote something");
        assert!(peer_names(&b).is_empty());
    }

    weft_tests::step("names checked");
    // Names: a peer may name only its own addresses, as DNS labels, and
    // at most 1000 of them; each refusal names the field and writes nothing.
    let name = |n: &str, kind: pb::NameKind, a: &str| pb::PublishedName {
        name: n.into(),
        kind: kind as i32,
        address: a.into(),
        address_v6: String::new(),
    };
    let with_v6 = |n: &str, kind: pb::NameKind, a: &str, v6: &str| pb::PublishedName {
        address_v6: v6.into(),
        ..name(n, kind, a)
    };
    let flood: Vec<pb::PublishedName> = (0..10_000)
        .map(|i| name(&format!("n{i}"), pb::NameKind::Workload, "10.8.0.10"))
        .collect();
    for (names, field) in [
        (flood, "names: 10000 listed"),
        (
            vec![name("web", pb::NameKind::Workload, "10.1.0.10")],
            "names[0].address",
        ),
        (
            vec![name("db", pb::NameKind::ExportedHost, "10.8.0.10")],
            "names[0].address",
        ),
        (
            vec![name("web.x", pb::NameKind::Workload, "10.8.0.10")],
            "names[0].name",
        ),
        (
            vec![with_v6("web", pb::NameKind::Workload, "10.8.0.10", "fd00::1/64")],
            "names[0].address_v6",
        ),
        (
            vec![with_v6("web", pb::NameKind::Workload, "10.8.0.10", "10.8.0.11")],
            "names[0].address_v6",
        ),
    ] {
        let before = revision(&b);
        let err = join_named("192.0.2.1:51820", good_key, 0, "10.8.0.0/16", names).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{field}: {err:?}");
        assert!(err.message().contains(field), "{field}: {}", err.message());
        assert_eq!(revision(&b), before, "{field}: wrote something");
        assert!(peer_names(&b).is_empty());
    }

    weft_tests::step("the token still works for a good Join");
    // The token was not consumed: the same peer with a usable gateway and
    // CIDR joins, and b learns its names in b's view.
    join_named(
        "192.0.2.1:51820",
        good_key,
        0,
        "10.8.0.0/16",
        vec![name("web", pb::NameKind::Workload, "10.8.0.10")],
    )
    .unwrap();
    assert_eq!(peer_names(&b), ["site-x"]);
    let names = weft_tests::weftctl_json(&b.target(), &["names"]);
    let learned = &names["learned"][0];
    assert_eq!(
        (learned["site"].as_str(), learned["name"].as_str()),
        (Some("site-x"), Some("web"))
    );
    let (_, view) = weft_tests::peer_view(&b.target(), "site-x", "workload");
    let want = weft_controller::ipam::translate::<ipnet::Ipv4Net>(
        "10.8.0.10".parse().unwrap(),
        "10.8.0.0/16".parse().unwrap(),
        view.parse().unwrap(),
    )
    .unwrap();
    assert_eq!(learned["local_address"], want.to_string());
    let p = &peers(&b)[0];
    assert_eq!(p["remote_gateways"][0]["endpoint"], "192.0.2.1:51820");
    assert_eq!(p["listen_port"], 51820);

    weft_tests::step("an impostor learns nothing");
    // An impostor of site-x (another CA) without a valid token learns
    // nothing: the answer a bad token gets, not "already peered".
    std::fs::create_dir_all(dir.path().join("x2")).unwrap();
    let x2 = site(&dir.path().join("x2"), "site-x", &[]);
    let ca2 = SiteCa::load(&x2.pki("")).unwrap();
    let ca2_pem = std::fs::read_to_string(x2.pki("ca.pem")).unwrap();
    let (cert2, key2) = ca2
        .issue_with_key(&identity_uri("site-x", "site", "site-x"), "site-x", 1)
        .unwrap();
    let err = rt
        .block_on(async {
            let ch = connect(
                &format!("https://{}", t.endpoints[0]),
                &Trust::FingerprintForSite(t.fp.clone(), t.site.clone()),
                Some((&cert2, &key2)),
            )
            .await
            .unwrap();
            FederationServiceClient::new(ch)
                .join(pb::JoinRequest {
                    token_id: "0123456789ab".into(),
                    secret: "00".repeat(16),
                    ca_pem: ca2_pem,
                    params: Some(pb::NetworkParams {
                        site_id: "site-x".into(),
                        workload_cidrs: vec!["10.9.0.0/16".into()],
                        ..Default::default()
                    }),
                })
                .await
        })
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err:?}");
}

/// A token made for one site is useless to any other that gets hold of it.
#[test]
fn a_token_for_one_site_cannot_be_redeemed_by_another() {
    let dir = tempfile::Builder::new().prefix("weft-fed").tempdir().unwrap();
    let a = site(dir.path(), "site-a", &[]);
    let b = site(dir.path(), "site-b", &[]);
    let c = site(dir.path(), "site-c", &[]);
    let t = weftctl_json(&b.target(), &["peering", "token", "--for", "site-c"])["token"]
        .as_str()
        .unwrap()
        .to_string();
    let before = (revision(&a), revision(&b));
    let err = create(&a, &t).unwrap_err();
    assert!(err.contains("PERMISSION_DENIED") && err.contains("site-c"), "{err}");
    assert_eq!(
        (revision(&a), revision(&b)),
        before,
        "a refused redemption wrote something"
    );
    create(&c, &t).unwrap();
    assert_eq!(peer_names(&b), ["site-c"]);
}

fn signal(pid: u32, sig: &str) {
    assert!(pid != 0, "no process to signal");
    let st = Command::new("kill").args([sig, &pid.to_string()]).status().unwrap();
    assert!(st.success(), "kill {sig} {pid}");
}

/// The IPAM blocks the controller at `c` holds for views of `peer`.
fn views_held(c: &Controller, peer: &str) -> usize {
    weftctl_json(&c.target(), &["allocations"])["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| x["owner"].as_str().unwrap_or_default().starts_with(peer))
        .count()
}

/// Both sides hold exactly one peering with each other, with one set of
/// views each (the workload and the external CIDR).
fn peered_once(a: &Controller, b: &Controller) {
    assert_eq!(peer_names(a), ["site-b"]);
    assert_eq!(peer_names(b), ["site-a"]);
    assert_eq!(
        views_held(a, "site-b"),
        2,
        "{:#}",
        weftctl_json(&a.target(), &["allocations"])
    );
    assert_eq!(
        views_held(b, "site-a"),
        2,
        "{:#}",
        weftctl_json(&b.target(), &["allocations"])
    );
}

/// a's CreatePeering with token `t` (grpcurl, a 1.5 s deadline) while b's
/// etcd does not answer: the caller gets a retryable DEADLINE_EXCEEDED from
/// a's controller, and b records the peering once etcd answers again.
fn late_join(a: &Controller, b: &Controller, etcd: &Etcd, grpcurl: &std::path::Path, t: &str) {
    // etcd stops answering b; a's caller allows 1.5 s; etcd comes back
    // after 2.5 s: within etcd-client's 3 s keep-alive timeout, so b's
    // calls to it wait instead of failing.
    signal(etcd.pid(), "-STOP");
    let began = std::time::Instant::now();
    let o = run(Command::new(grpcurl)
        .args(["-plaintext", "-unix", "-max-time", "1.5", "-d"])
        .arg(serde_json::json!({ "token": t }).to_string())
        .arg(a.socket.display().to_string())
        .arg("weft.v1.AdminService/CreatePeering"));
    let waited = began.elapsed();
    std::thread::sleep(Duration::from_millis(2500).saturating_sub(waited));
    signal(etcd.pid(), "-CONT");
    let err = stderr(&o);
    println!(
        "a Join that b answers late, after {:.1} s: {}",
        waited.as_secs_f64(),
        err.trim()
    );
    assert!(
        !o.status.success(),
        "the call should have failed: {}",
        weft_tests::stdout(&o)
    );
    assert!(
        err.contains("DeadlineExceeded") && err.contains("retry") && err.contains("site-b"),
        "not a retryable deadline from the controller: {err}"
    );
    assert!(peer_names(a).is_empty(), "a recorded a peering b never answered");
    // b finishes the Join it got once its store answers again: the
    // peering is on its side only.
    weft_tests::eventually("b recording the late join", Duration::from_secs(30), || {
        (peer_names(b) == ["site-a"]).then_some(())
    });
}

/// A peer busy past the caller's deadline: site b's store (etcd) stalls
/// while a's CreatePeering (grpcurl, with a deadline) waits on b's Join.
/// The caller gets DEADLINE_EXCEEDED saying to retry, not
/// FAILED_PRECONDITION; b still records the peering when its store is back
/// (after the caller gave up). The same token again converges: once while b
/// holds the one-sided peering, and once after b dropped such a peering
/// (a never held it) and gave the token back.
#[test]
fn a_join_answered_after_the_callers_deadline_is_retryable_and_a_retry_converges_once() {
    let Some(etcd) = Etcd::start() else { return };
    let Some(grpcurl) = weft_tests::require_tool("grpcurl") else {
        return;
    };
    let dir = tempfile::Builder::new().prefix("weft-fed").tempdir().unwrap();
    let a = site(dir.path(), "site-a", &[]);
    let mut b = site(dir.path(), "site-b", &["--etcd-endpoints", &etcd.endpoint()]);
    // 1. Retried at once: b still holds it, and answers the same Join.
    let t = token(&b, "10m");
    late_join(&a, &b, &etcd, &grpcurl, &t);
    create(&a, &t).unwrap_or_else(|e| panic!("the retry failed: {e}"));
    peered_once(&a, &b);
    // b learns that a holds it: the token is spent for good.
    weft_tests::eventually("b seeing a hold the peering", Duration::from_secs(30), || {
        b.log_text().contains("its token is spent").then_some(())
    });
    std::thread::sleep(Duration::from_secs(6));
    peered_once(&a, &b);
    // So a peering a held, dropped by b later (a deleted it while b was
    // away), gives nothing back: another site cannot redeem the token.
    b.stop();
    let d = weftctl_json(&a.target(), &["peering", "delete", "site-b"]);
    assert_eq!(d["remote_notified"], false);
    b.restart_stopped();
    weft_tests::eventually("b dropping the peering a deleted", Duration::from_secs(60), || {
        peer_names(&b).is_empty().then_some(())
    });
    let c = site(dir.path(), "site-c", &[]);
    let err = create(&c, &t).unwrap_err();
    assert!(err.contains("used"), "a spent token came back: {err}");

    // 2. Retried only after b gave up on a: b dropped the one-sided peering
    // (a said it holds none) and gave the token back; the retry redeems it.
    let t = token(&b, "10m");
    late_join(&a, &b, &etcd, &grpcurl, &t);
    weft_tests::eventually(
        "b dropping the peering a never recorded",
        Duration::from_secs(60),
        || peer_names(&b).is_empty().then_some(()),
    );
    assert!(
        b.log_text().contains("gave its token back"),
        "b did not say it gave the token back:\n{}",
        b.log_text()
    );
    create(&a, &t).unwrap_or_else(|e| panic!("the retry after b gave the token back failed: {e}"));
    peered_once(&a, &b);
    std::thread::sleep(Duration::from_secs(7));
    peered_once(&a, &b);
    // Held by both, the token is spent: another site cannot redeem it.
    let err = create(&c, &t).unwrap_err();
    assert!(err.contains("used"), "{err}");
}

/// A peer that is not up yet: `weftctl peering create` says what it waits
/// for (UNAVAILABLE, retry) and asks again with backoff until the peer
/// answers; then both sides hold the peering once.
#[test]
fn peering_create_waits_for_a_peer_that_is_not_up_yet() {
    let dir = tempfile::Builder::new().prefix("weft-fed").tempdir().unwrap();
    let a = site(dir.path(), "site-a", &[]);
    let mut b = site(dir.path(), "site-b", &[]);
    let t = token(&b, "10m");
    b.stop();
    let began = std::time::Instant::now();
    let call = Command::new(bin("weftctl"))
        .args([
            "--controller",
            &a.target(),
            "-o",
            "json",
            "peering",
            "create",
            "--timeout",
            "2m",
            "--token",
            &t,
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(4));
    b.restart_stopped();
    let o = call.wait_with_output().unwrap();
    let err = stderr(&o);
    println!("weftctl waited {:.1} s; it said:\n{err}", began.elapsed().as_secs_f64());
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("UNAVAILABLE") && err.contains("cannot reach site \"site-b\"") && err.contains("asking again"),
        "weftctl did not say what it waits for: {err}"
    );
    peered_once(&a, &b);

    // With --timeout 0s it tries once and says to retry.
    let c = site(dir.path(), "site-c", &[]);
    let t = token(&c, "10m");
    let mut c = c;
    c.stop();
    let o = run(Command::new(bin("weftctl")).args([
        "--controller",
        &a.target(),
        "peering",
        "create",
        "--timeout",
        "0s",
        "--token",
        &t,
    ]));
    let err = stderr(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("UNAVAILABLE") && err.contains("retry") && !err.contains("asking again"),
        "{err}"
    );
}
