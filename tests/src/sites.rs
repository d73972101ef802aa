//! Two whole sites in network namespaces for tests and benchmarks: per
//! site a controller (site a on the embedded store, site b on etcd, which
//! runs in site b's controller host), a gateway and two nodes on one WAN,
//! a workload on each node, the sites peered from a token. Everything goes
//! away on drop.

use std::collections::HashMap;
use std::time::Duration;

use crate::ControllerSpec;
use crate::lab::{AgentSpec, SiteSpec};
use crate::netns::Lab;
use crate::{bin, eventually, stdout, weftctl_json};

pub struct TwoSites {
    pub lab: Lab,
    pub dir: tempfile::TempDir,
    /// Host name (ctla, ctlb, gwa, gwb, na, na2, nb, nb2, wa, wa2, wb, wb2)
    /// → namespace. Workload wa sits on node na, wa2 on na2, and so on.
    pub ns: HashMap<&'static str, String>,
    /// weftctl targets of the two controllers.
    pub ta: String,
    pub tb: String,
    /// The gateways' process indices in `lab`.
    pub gateways: (usize, usize),
    /// When `weftctl peering create` was run (time to connected counts
    /// from here).
    pub peered_at: std::time::Instant,
    /// Every agent: (process index in `lab`, host, kind, state directory).
    pub agents: Vec<(usize, &'static str, &'static str, std::path::PathBuf)>,
    pub site_a: String,
    pub site_b: String,
    /// Site a's namespace for its peering with site b.
    pub ns_a: String,
    /// wb's address as site a sees it, and wa's as site b sees it.
    pub wb_from_a: String,
    pub wa_from_b: String,
    /// Every workload's own address, and as the other site sees it:
    /// (host, real address, address in the other site's view).
    pub workloads: Vec<(&'static str, String, String)>,
    /// Site a's second gateway's process index, when asked for.
    pub gateway_a2: Option<usize>,
    /// Site b's etcd's process index in `lab`.
    pub etcd_b: Option<usize>,
    /// Site a's etcd's process index (with `Opts::site_a_etcd`).
    pub etcd_a: Option<usize>,
    /// Site a's private LAN and its router, when it is behind NAT.
    pub nat_a: Option<crate::netns::NatLan>,
    /// Site b's, when it is.
    pub nat_b: Option<crate::netns::NatLan>,
    /// The WAN is IPv6 only ([`Opts::underlay_v6`]).
    pub underlay_v6: bool,
}

/// Two sites, each a controller, a gateway and two nodes in namespaces on
/// one WAN, and a workload on each node. Once the controllers peer, the gateways
/// build the peering's namespace, a userspace WireGuard tunnel (UDP on the
/// underlay), the routes into it and the prefix NAT, and the workloads reach
/// each other through their local views.
pub fn up(tag: &str, a: (&str, &str), b: (&str, &str)) -> TwoSites {
    up_with(tag, a, b, Opts::default())
}

/// Options of a two-site lab.
#[derive(Clone, Copy, Debug, Default)]
pub struct Opts {
    /// The MTU of site b's hosts' underlay interfaces (default 1500).
    pub site_b_underlay: Option<u32>,
    /// Site a's `--tunnel-mtu` (default: none, derived).
    pub site_a_tunnel: Option<u32>,
    /// A second gateway in site a (host gwa2, agent "gw2", a standby). It
    /// runs in a mount namespace of its own with a private /run/netns, as
    /// if on its own machine: its peering namespace has the same name as
    /// gwa's, and dies with it.
    pub second_gateway_a: bool,
    /// Agents run with `--resync-interval 0`: nothing repairs drift.
    pub no_drift_repair: bool,
    /// Site a keeps its state in etcd too (on its controller's host), not
    /// in the embedded store.
    pub site_a_etcd: bool,
    /// `--wireguard` of site a's gateways and of site b's (default: the
    /// agents' own, auto).
    pub wireguard_a: Option<&'static str>,
    pub wireguard_b: Option<&'static str>,
    /// Site a's gateway's hidden `--test-device-panic-dir`.
    pub device_panic_dir_a: Option<&'static str>,
    /// Both controllers' `--gateway-ttl` (default: theirs, 800 ms).
    pub gateway_ttl: Option<&'static str>,
    /// Site b keeps its state in the embedded store, not in etcd.
    pub site_b_embedded: bool,
    /// Every agent's `--resync-interval` (default 1 s; `no_drift_repair`
    /// makes it 0).
    pub resync: Option<&'static str>,
    /// Site a's gateway and nodes on a private LAN (192.168.10.0/24)
    /// behind a NAT router (router `ra`, 192.168.78.30 on the WAN), its
    /// gateway with no `--endpoint`; its controller stays on the WAN.
    pub site_a_nat: Option<crate::netns::Nat>,
    /// The same for site b: a private LAN 192.168.11.0/24 behind router
    /// `rb` (192.168.78.31).
    pub site_b_nat: Option<crate::netns::Nat>,
    /// Site b's NAT router is one router hop from the WAN
    /// ([`crate::netns::Lab::nat_lan_beyond_hop`]): what goes between the
    /// two sites' routers crosses a router, as on the internet.
    pub site_b_beyond_hop: bool,
    /// Every gateway's `--punch-ttl` (default: theirs, 2).
    pub punch_ttl: Option<u8>,
    /// The NAT routers let no UDP out (only TCP), from before the agents
    /// start ([`crate::netns::Lab::block_udp`]).
    pub udp_blocked: bool,
    /// Site a's gateways' `--lan-address` (held by the active one).
    pub lan_address_a: Option<&'static str>,
    /// IPv6 pod CIDRs of site a and site b (dual stack; None: that site
    /// is IPv4 only): each node gets a /64 of its site's;
    /// [`TwoSites::workloads_v6`] addresses the workloads in them.
    pub ipv6: (Option<&'static str>, Option<&'static str>),
    /// Every host of both sites, controllers included, is on the WAN by
    /// IPv6 only ([`underlay_v6`]: fd00:78::<the IPv4 address's last
    /// octet>), with no IPv4 address there: controllers listen, federate
    /// and serve their agents over IPv6, agents take it as their underlay
    /// address (and the gateways' endpoints), and tunnels and overlay run
    /// over it. Workloads keep their IPv4 and IPv6 pods.
    pub underlay_v6: bool,
    /// With [`Opts::underlay_v6`]: each site's gateway and nodes are on an
    /// IPv6 LAN of their own behind a router with a stateful firewall and
    /// no NAT66 ([`crate::netns::Lab::firewall_lan6`]), as at home: their
    /// addresses are global, nothing from the WAN gets in unasked, and the
    /// gateways have no `--endpoint`.
    pub firewall_v6: bool,
    /// Site a's agents run the binaries in this directory (another
    /// release's, [`crate::prev_release`]); its controller this workspace's.
    pub bins_a_agents: Option<&'static std::path::Path>,
    /// Site b, controller and agents, runs the binaries in this directory.
    pub bins_b: Option<&'static std::path::Path>,
}

/// A host's IPv6 WAN address with [`Opts::underlay_v6`], from its IPv4 one.
pub fn underlay_v6(wan_ip: &str) -> String {
    format!("fd00:78::{}", behind_nat(wan_ip))
}

pub use crate::lab::{AGENT_METRICS_PORT, CONTROLLER_METRICS_PORT};

/// Site a's and site b's hosts on the WAN, and their agents: (host,
/// address, agent name). The first host is the controller's.
const SITE_A: [(&str, &str, &str); 4] = [
    ("ctla", "192.168.78.1", ""),
    ("gwa", "192.168.78.10", "gw"),
    ("na", "192.168.78.11", "na"),
    ("na2", "192.168.78.12", "na2"),
];
const SITE_B: [(&str, &str, &str); 4] = [
    ("ctlb", "192.168.78.2", ""),
    ("gwb", "192.168.78.20", "gw"),
    ("nb", "192.168.78.21", "nb"),
    ("nb2", "192.168.78.22", "nb2"),
];

/// Site a's and site b's private LANs when they are behind NAT, and
/// their IPv6 LANs behind a firewall ([`Opts::firewall_v6`]).
const NAT_LAN_A: &str = "192.168.10";
const NAT_LAN_B: &str = "192.168.11";
const FIREWALL_LAN_A: &str = "fd00:10::";
const FIREWALL_LAN_B: &str = "fd00:11::";

/// Host `host`'s address on the LAN of `prefix` (IPv4's first three
/// octets, or an IPv6 /64's "fd00:10::").
fn lan_ip(prefix: &str, host: u8) -> String {
    if prefix.ends_with(':') {
        format!("{prefix}{host}")
    } else {
        format!("{prefix}.{host}")
    }
}

/// A site-a host's last octet, also on the private LAN behind NAT.
fn behind_nat(wan_ip: &str) -> u8 {
    wan_ip.rsplit('.').next().unwrap().parse().unwrap()
}

/// The n-th /24 of a /16 such as 10.1.0.0/16, without its last octet
/// ("10.1.{n}").
fn nth(pod: &str, n: u8) -> String {
    format!("{}.{n}", pod.rsplit_once(".0.0/").unwrap().0)
}

/// The workload hosts and the nodes they sit behind: node n of a site
/// declares the n-th /24 of the site's pod CIDR.
fn placement(pod_a: &str, pod_b: &str) -> [(&'static str, &'static str, String); 4] {
    [
        ("na", "wa", nth(pod_a, 0)),
        ("na2", "wa2", nth(pod_a, 1)),
        ("nb", "wb", nth(pod_b, 0)),
        ("nb2", "wb2", nth(pod_b, 1)),
    ]
}

/// Every host of a two-site lab, plugged into the WAN, with the workloads
/// behind their nodes: host name → namespace, and the sites' private LANs
/// when they are behind NAT.
type NatLans = (Option<crate::netns::NatLan>, Option<crate::netns::NatLan>);
fn hosts(
    lab: &mut Lab,
    opts: &Opts,
    placement: &[(&'static str, &'static str, String)],
) -> (HashMap<&'static str, String>, NatLans) {
    lab.lan();
    let mut ns: HashMap<&'static str, String> = placement.iter().map(|p| (p.1, lab.host(p.1))).collect();
    let nat_a = opts
        .site_a_nat
        .map(|n| lab.nat_lan("ra", "192.168.78.30/24", NAT_LAN_A, n));
    let nat_b = opts.site_b_nat.map(|n| {
        if opts.site_b_beyond_hop {
            lab.nat_lan_beyond_hop("rb", "192.168.78.31/24", NAT_LAN_B, n)
        } else {
            lab.nat_lan("rb", "192.168.78.31/24", NAT_LAN_B, n)
        }
    });
    let (nat_a, nat_b) = if opts.firewall_v6 {
        assert!(opts.underlay_v6, "firewall_v6 is for an IPv6 underlay");
        let a = lab.firewall_lan6("ra", &format!("{}/64", underlay_v6("0.0.0.30")), FIREWALL_LAN_A);
        let b = lab.firewall_lan6("rb", &format!("{}/64", underlay_v6("0.0.0.31")), FIREWALL_LAN_B);
        (Some(a), Some(b))
    } else {
        (nat_a, nat_b)
    };
    for (h, ip, _) in SITE_A.iter().chain(&SITE_B) {
        ns.insert(h, lab.host(h));
        match (&nat_a, &nat_b) {
            (Some(lan), _) if SITE_A[1..].iter().any(|a| a.0 == *h) => {
                lab.plug_behind(lan, &ns[h], behind_nat(ip));
            }
            (_, Some(lan)) if SITE_B[1..].iter().any(|b| b.0 == *h) => {
                lab.plug_behind(lan, &ns[h], behind_nat(ip));
            }
            _ if opts.underlay_v6 => lab.plug(&ns[h], &format!("{}/64", underlay_v6(ip))),
            _ => lab.plug(&ns[h], &format!("{ip}/24")),
        }
        if let Some(m) = opts.site_b_underlay.filter(|_| SITE_B.iter().any(|b| b.0 == *h)) {
            crate::netns::must(
                lab.exec(&ns[h], &["ip", "link", "set", "eth0", "mtu", &m.to_string()]),
                "mtu",
            );
        }
    }
    if opts.firewall_v6 {
        // The WAN routes each site's LAN to its router.
        let (a, b) = (nat_a.as_ref().unwrap(), nat_b.as_ref().unwrap());
        for (on, to) in [
            (&ns["ctla"], a),
            (&ns["ctla"], b),
            (&ns["ctlb"], a),
            (&ns["ctlb"], b),
            (&a.router, b),
            (&b.router, a),
        ] {
            lab.route_to(on, to);
        }
    }
    if opts.second_gateway_a {
        ns.insert("gwa2", lab.host("gwa2"));
        lab.plug(&ns["gwa2"], "192.168.78.13/24");
    }
    for (node, wl, sub) in placement {
        lab.workload(&ns[node], &ns[wl], sub);
    }
    if opts.udp_blocked {
        for lan in nat_a.iter().chain(&nat_b) {
            lab.block_udp(lan, true);
        }
    }
    (ns, (nat_a, nat_b))
}

/// What one site of a two-site lab is: its controller (on etcd or not),
/// its gateway (site a's second one when asked), its two nodes.
struct Plan<'a> {
    site: &'a str,
    pod: &'a str,
    /// Its IPv6 pod CIDR (dual stack).
    pod_v6: Option<&'a str>,
    hosts: &'a [(&'static str, &'static str, &'static str)],
    on_etcd: bool,
    wireguard: Option<&'a str>,
    second_gateway: bool,
    tunnel_mtu: Option<u32>,
    /// Its gateway and nodes are on this private LAN, behind NAT.
    behind_nat: Option<&'static str>,
    /// Its gateways' `--lan-address`.
    lan_address: Option<&'static str>,
    /// Its gateways' `--test-device-panic-dir`.
    device_panic_dir: Option<&'static str>,
}

fn site_spec(plan: Plan, opts: &Opts, ns: &HashMap<&'static str, String>, dir: &std::path::Path) -> SiteSpec {
    let mut c = ControllerSpec::new(plan.site)
        .data_dir(&dir.join(plan.site))
        .pod(plan.pod)
        .flag("--metrics-listen", &format!("0.0.0.0:{CONTROLLER_METRICS_PORT}"));
    if plan.on_etcd {
        c = c.etcd("http://127.0.0.1:2379");
    }
    if let Some(v6) = plan.pod_v6 {
        c = c.pod(v6);
    }
    if let Some(t) = opts.gateway_ttl {
        c = c.flag("--gateway-ttl", t);
    }
    if let Some(m) = plan.tunnel_mtu {
        c = c.flag("--tunnel-mtu", &m.to_string());
    }
    let mut agents: Vec<AgentSpec> = plan.hosts[1..]
        .iter()
        .zip([None, Some(0), Some(1)])
        .map(|((h, ip, name), n)| {
            let ip = match plan.behind_nat {
                Some(lan) => lan_ip(lan, behind_nat(ip)),
                None if opts.underlay_v6 => underlay_v6(ip),
                None => ip.to_string(),
            };
            let mut a = match n {
                None => AgentSpec::gateway(name, &ns[h], &ip),
                Some(n) => AgentSpec::node(name, &ns[h], &ip, &format!("{}.0/24", nth(plan.pod, n))),
            };
            a.endpoint = plan.behind_nat.is_none();
            a
        })
        .collect();
    if plan.second_gateway {
        // Its own /run/netns, as on its own host. Started by `up_with`
        // once the first gateway is active, so that one is.
        let mut g = AgentSpec::gateway("gw2", &ns["gwa2"], "192.168.78.13");
        g.own_host = true;
        agents.push(g);
    }
    for a in agents.iter_mut().filter(|a| a.kind == "gateway") {
        if let Some(m) = plan.wireguard {
            a.flags.extend(["--wireguard".to_string(), m.to_string()]);
        }
        if let Some(l) = plan.lan_address {
            a.flags.extend(["--lan-address".to_string(), l.to_string()]);
        }
        if let Some(d) = plan.device_panic_dir {
            a.flags.extend(["--test-device-panic-dir".to_string(), d.to_string()]);
        }
        if let Some(t) = opts.punch_ttl {
            a.flags.extend(["--punch-ttl".to_string(), t.to_string()]);
        }
    }
    SiteSpec {
        controller: c,
        ctl: ns[plan.hosts[0].0].clone(),
        ctl_ip: match opts.underlay_v6 {
            true => underlay_v6(plan.hosts[0].1),
            false => plan.hosts[0].1.to_string(),
        },
        agents,
        dir: dir.to_path_buf(),
        prefix: plan.hosts[0].1.to_string(),
        resync: if opts.no_drift_repair {
            "0s".to_string()
        } else {
            opts.resync.unwrap_or("1s").to_string()
        },
        agent_metrics: true,
    }
}

/// [`up`] with options (MTUs, a second gateway).
pub fn up_with(tag: &str, (site_a, pod_a): (&str, &str), (site_b, pod_b): (&str, &str), opts: Opts) -> TwoSites {
    let dir = tempfile::Builder::new().prefix("weft-dp").tempdir().unwrap();
    let mut lab = Lab::new(tag);
    let placement = placement(pod_a, pod_b);
    let (ns, (nat_a, nat_b)) = hosts(&mut lab, &opts, &placement);
    // The gateways create these; the lab deletes them at the end whatever happens.
    lab.adopt(&weft_controller::render::peering_namespace(site_a, site_b));
    lab.adopt(&weft_controller::render::peering_namespace(site_b, site_a));

    // Site b keeps its state in etcd, on its controller's host; site a
    // too when asked.
    let etcd_b = (!opts.site_b_embedded)
        .then(|| lab.spawn_etcd(&ns["ctlb"], &dir.path().join("etcd")))
        .flatten();
    let etcd_a = opts.site_a_etcd.then(|| {
        lab.spawn_etcd(&ns["ctla"], &dir.path().join("etcd-a"))
            .expect("etcd for site a")
    });
    let plan_a = Plan {
        site: site_a,
        pod: pod_a,
        pod_v6: opts.ipv6.0,
        hosts: &SITE_A,
        on_etcd: opts.site_a_etcd,
        wireguard: opts.wireguard_a,
        second_gateway: opts.second_gateway_a,
        tunnel_mtu: opts.site_a_tunnel,
        behind_nat: match opts.firewall_v6 {
            true => Some(FIREWALL_LAN_A),
            false => opts.site_a_nat.map(|_| NAT_LAN_A),
        },
        lan_address: opts.lan_address_a,
        device_panic_dir: opts.device_panic_dir_a,
    };
    let plan_b = Plan {
        site: site_b,
        pod: pod_b,
        pod_v6: opts.ipv6.1,
        hosts: &SITE_B,
        on_etcd: etcd_b.is_some(),
        wireguard: opts.wireguard_b,
        second_gateway: false,
        tunnel_mtu: None,
        behind_nat: match opts.firewall_v6 {
            true => Some(FIREWALL_LAN_B),
            false => opts.site_b_nat.map(|_| NAT_LAN_B),
        },
        lan_address: None,
        device_panic_dir: None,
    };
    let mut spec_a = site_spec(plan_a, &opts, &ns, dir.path());
    let mut spec_b = site_spec(plan_b, &opts, &ns, dir.path());
    // Another release's binaries: site a's agents, site b whole.
    for a in spec_a.agents.iter_mut() {
        a.bins = opts.bins_a_agents.map(std::path::Path::to_path_buf);
    }
    if let Some(d) = opts.bins_b {
        spec_b.controller = spec_b.controller.clone().bins(d);
        for a in spec_b.agents.iter_mut() {
            a.bins = Some(d.to_path_buf());
        }
    }
    // Site a's second gateway (last in its spec) comes once the first is
    // active: tests fail the first over to it.
    let mut first = spec_a.clone();
    let second = opts.second_gateway_a.then(|| first.agents.pop().expect("gw2"));
    let mut a = lab.site(&first);
    let b = lab.site(&spec_b);
    let gateway_a2 = second.map(|g| {
        eventually("site a's first gateway active", Duration::from_secs(20), || {
            (active(&a.target) == "gw").then_some(())
        });
        let i = lab.agent(&spec_a, &a.target, &g);
        a.agents.push(i);
        i
    });
    for (site, on_etcd) in [(site_a, opts.site_a_etcd), (site_b, etcd_b.is_some())] {
        if on_etcd {
            eventually("the controller serving from etcd", Duration::from_secs(10), || {
                let log = std::fs::read_to_string(dir.path().join(format!("{site}.log"))).unwrap_or_default();
                (log.contains("store=\"etcd\"") || log.contains("store=etcd")).then_some(())
            });
        }
    }
    let (ta, tb) = (a.target, b.target);
    let mut agents = Vec::new();
    for (spec, site) in [(&spec_a, &a.agents), (&spec_b, &b.agents)] {
        for (a, i) in spec.agents.iter().zip(site) {
            if a.name == "gw2" {
                continue;
            }
            let host = *ns.iter().find(|(_, n)| **n == a.host).unwrap().0;
            agents.push((*i, host, a.kind, spec.state(&a.name)));
        }
    }
    agents.sort_by_key(|a| (a.2 != "gateway", a.0));
    let (pa, pb) = (agents[0].0, agents[1].0);

    let peered_at = std::time::Instant::now();
    let ns_a = peer(&lab, &ns, &ta, &tb, site_a, site_b);
    let workloads = views(&placement, (&ta, site_a), (&tb, site_b));
    let (wb_from_a, wa_from_b) = (workloads[2].2.clone(), workloads[0].2.clone());
    TwoSites {
        lab,
        dir,
        ns,
        ta,
        tb,
        gateways: (pa, pb),
        peered_at,
        agents,
        site_a: site_a.to_string(),
        site_b: site_b.to_string(),
        ns_a,
        wb_from_a,
        wa_from_b,
        workloads,
        gateway_a2,
        etcd_a,
        etcd_b,
        nat_a,
        nat_b,
        underlay_v6: opts.underlay_v6,
    }
}

/// Every workload's own address and the one the other site reaches it at,
/// through its local view of it: (host, real address, address seen).
fn views(
    placement: &[(&'static str, &'static str, String)],
    (ta, site_a): (&str, &str),
    (tb, site_b): (&str, &str),
) -> Vec<(&'static str, String, String)> {
    let view_of = |target: &str, peer: &str, addr: &str| -> String {
        let (real, local) = crate::peer_view(target, peer, "workload");
        let real: ipnet::Ipv4Net = real.parse().unwrap();
        let local: ipnet::Ipv4Net = local.parse().unwrap();
        weft_controller::ipam::translate(addr.parse().unwrap(), real, local)
            .unwrap()
            .to_string()
    };
    placement
        .iter()
        .map(|(node, wl, sub)| {
            let addr = format!("{sub}.10");
            let seen = if node.starts_with("na") {
                view_of(tb, site_a, &addr)
            } else {
                view_of(ta, site_b, &addr)
            };
            (*wl, addr, seen)
        })
        .collect()
}

/// Peers site a (at `ta`) with site b (at `tb`) from a token of b's, and
/// waits for a's WireGuard link in its peering namespace; that namespace.
fn peer(lab: &Lab, ns: &HashMap<&str, String>, ta: &str, tb: &str, site_a: &str, site_b: &str) -> String {
    peer_with(tb, ta);

    // The WireGuard interface lives in the peering's namespace; its UDP
    // socket stayed on the gateway's underlay.
    let ns_a = weft_controller::render::peering_namespace(site_a, site_b);
    eventually("site-a's WireGuard interface", Duration::from_secs(20), || {
        let o = stdout(&crate::netns::exec(&ns_a, &["ip", "-br", "link"]));
        o.contains("weft-w").then_some(())
    });
    let socks = stdout(&lab.exec(&ns["gwa"], &["ss", "-uln"]));
    if !socks.contains(":51820") {
        // (WEFT_LAB_LOGS=1 adds what every process said last.)
        let links = stdout(&crate::netns::exec(&ns_a, &["ip", "-d", "link"]));
        panic!("no WireGuard socket on gwa:\n{socks}\nlinks in {ns_a}:\n{links}");
    }
    ns_a
}

impl TwoSites {
    /// Dual stack: gives every workload an IPv6 address in its node's /64
    /// (`::10`, the node's end `::1`, which it forwards), and returns each
    /// workload's (host, real IPv6 address, the address the other site
    /// reaches it at, through its IPv6 view).
    pub fn workloads_v6(&self) -> Vec<(&'static str, String, String)> {
        let subnet = |target: &str, node: &str| -> ipnet::Ipv6Net {
            let nodes = weftctl_json(target, &["nodes"]);
            let n = nodes["nodes"]
                .as_array()
                .and_then(|ns| ns.iter().find(|n| n["name"] == node))
                .unwrap_or_else(|| panic!("no node {node}: {nodes}"));
            n["subnet_v6"]
                .as_str()
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("node {node} has no IPv6 subnet: {n}"))
        };
        let view = |target: &str, peer: &str| -> (ipnet::Ipv6Net, ipnet::Ipv6Net) {
            let (real, local) = crate::peer_view_where(target, peer, "workload", |c| c.contains(':'));
            (real.parse().unwrap(), local.parse().unwrap())
        };
        let mut out = Vec::new();
        for (node, wl, a_side) in [
            ("na", "wa", true),
            ("na2", "wa2", true),
            ("nb", "wb", false),
            ("nb2", "wb2", false),
        ] {
            let (own, other, own_site) = if a_side {
                (&self.ta, &self.tb, &self.site_a)
            } else {
                (&self.tb, &self.ta, &self.site_b)
            };
            let net = subnet(own, node);
            let base = u128::from(net.network());
            let (gw, addr) = (
                std::net::Ipv6Addr::from(base + 1),
                std::net::Ipv6Addr::from(base + 0x10),
            );
            let sh = |ns: &str, cmd: &str| crate::netns::must(self.lab.exec(ns, &["sh", "-c", cmd]), cmd);
            sh(
                &self.ns[node],
                &format!("ip addr add {gw}/64 dev wl0 nodad && sysctl -qw net.ipv6.conf.all.forwarding=1"),
            );
            sh(
                &self.ns[wl],
                &format!("ip addr add {addr}/64 dev eth0 nodad && ip -6 route add default via {gw}"),
            );
            let (real, local) = view(other, own_site);
            let seen = weft_controller::ipam::translate(addr, real, local).expect("in the view");
            out.push((wl, addr.to_string(), seen.to_string()));
        }
        out
    }

    /// The Prometheus text `host`'s controller (ctla, ctlb) or agent serves.
    pub fn scrape(&self, host: &str) -> String {
        let port = if host.starts_with("ctl") {
            CONTROLLER_METRICS_PORT
        } else {
            AGENT_METRICS_PORT
        };
        let url = format!("http://127.0.0.1:{port}/metrics");
        let o = crate::netns::exec(&self.ns[host], &["curl", "-sSf", "--max-time", "5", &url]);
        assert!(o.status.success(), "scraping {host}: {}", crate::stderr(&o));
        stdout(&o)
    }
}

/// The value of the sample `name` whose labels include every `labels`
/// pair, in Prometheus text.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        let (label_part, value) = match rest.strip_prefix('{') {
            Some(r) => {
                let (ls, v) = r.split_once('}')?;
                (ls, v)
            }
            None if rest.starts_with(' ') => ("", rest),
            None => return None,
        };
        labels
            .iter()
            .all(|(k, v)| label_part.contains(&format!("{k}=\"{v}\"")))
            .then(|| value.split_whitespace().next()?.parse().ok())?
    })
}

/// The active gateway of the site at `target`.
pub fn active(target: &str) -> String {
    let g = weftctl_json(target, &["gateways"]);
    g["gateways"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["active"] == true)
        .map(|g| g["name"].as_str().unwrap().to_string())
        .unwrap_or_default()
}

/// Starts pinging wb from wa every 20 ms (`ping -D` into the lab's file
/// `name`) and lets it run a second: the process index and the log.
pub fn ping_wa_to_wb(s: &mut TwoSites, name: &str) -> (usize, std::path::PathBuf) {
    let (wa, to_b) = (s.ns["wa"].clone(), s.wb_from_a.clone());
    let log = s.dir.path().join(name);
    let ping = s.lab.spawn(
        &wa,
        std::path::Path::new("/usr/bin/ping"),
        &["-D", "-i", "0.02", "-W", "1", &to_b],
        &log,
    );
    std::thread::sleep(Duration::from_secs(1));
    (ping, log)
}

/// The longest silence between answered pings in `log` from the last
/// answer before `at` (the fault) on, and those answers' times. Panics when
/// nothing was answered in the second before `at`: the path was not
/// working, so an outage could not be measured (a first answer after the
/// fault would otherwise start the series and hide it).
pub fn longest_gap(log: &std::path::Path, at: f64) -> (f64, Vec<f64>) {
    let all = answered(&std::fs::read_to_string(log).unwrap());
    let start = all.iter().rposition(|t| *t < at).filter(|&i| all[i] >= at - 1.0).unwrap_or_else(|| {
        panic!(
            "no ping was answered in the second before the fault ({} answers in all): nothing to measure an outage from",
            all.len()
        )
    });
    let times = all[start..].to_vec();
    (times.windows(2).map(|w| w[1] - w[0]).fold(0.0, f64::max), times)
}

/// Waits until site a's workload reaches site b's.
pub fn until_wa_reaches_wb(s: &TwoSites) {
    let (wa, to_b) = (&s.ns["wa"], &s.wb_from_a);
    eventually("wa reaching wb", Duration::from_secs(30), || {
        s.lab
            .exec(wa, &["ping", "-c", "1", "-W", "1", to_b])
            .status
            .success()
            .then_some(())
    });
}

impl TwoSites {
    /// Pings `to` from host `from` every 100 ms until one is answered;
    /// panics when `within` passes first.
    pub fn reach_quickly(&self, from: &str, to: &str, within: Duration) {
        let end = std::time::Instant::now() + within;
        loop {
            let o = self.lab.exec(&self.ns[from], &["ping", "-c", "1", "-W", "0.2", to]);
            if o.status.success() {
                return;
            }
            assert!(
                std::time::Instant::now() < end,
                "{from} did not reach {to} within {within:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until workload `from` reaches workload `to` over IPv6 (at
    /// `to`'s address as `from`'s site sees it, [`TwoSites::workloads_v6`]),
    /// for at most 20 s.
    pub fn reach_v6(&self, from: &str, to: &str) {
        let v6 = self.workloads_v6();
        let addr = v6.iter().find(|w| w.0 == to).expect("a workload").2.clone();
        crate::eventually(
            &format!("{from} reaching {to} over IPv6"),
            Duration::from_secs(20),
            || {
                self.lab
                    .exec(&self.ns[from], &["ping", "-6", "-c", "1", "-W", "1", &addr])
                    .status
                    .success()
                    .then_some(())
            },
        );
    }
}

/// Times (s) of the answered pings in a `ping -D` log.
pub fn answered(log: &str) -> Vec<f64> {
    crate::ping_answers(log).into_iter().map(|(t, _)| t).collect()
}

impl TwoSites {
    /// Stops every agent and runs `--teardown` on each host, then asserts
    /// that no host keeps a link, rule, route or nftables table of weft's
    /// and that the peering namespaces are gone.
    pub fn teardown_all(&mut self) {
        let ns_b = weft_controller::render::peering_namespace(&self.site_b, &self.site_a);
        teardown_hosts(&mut self.lab, &self.ns, &self.agents, &[&self.ns_a, &ns_b]);
    }
}

/// Stops `agents` (those still running) and runs `--teardown` on each
/// host, then asserts that no host keeps a link, rule, route or nftables
/// table of weft's and that none of `peering_ns` is left.
pub fn teardown_hosts(
    lab: &mut Lab,
    ns: &HashMap<&'static str, String>,
    agents: &[(usize, &'static str, &'static str, std::path::PathBuf)],
    peering_ns: &[&str],
) {
    for (i, host, kind, state) in agents {
        if lab.proc(*i).child.is_some() {
            lab.proc(*i).stop();
        }
        let o = std::process::Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", ns[host]))
            .arg(bin(&format!("weft-{kind}-agent")))
            .args(["--teardown", "--state-dir", state.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "teardown on {host}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        for (cmd, what) in [
            ("ip -br link", "weft-"),
            ("ip rule", "7765"),
            ("ip route show table all", "7765"),
            ("ip route show table all", "weft-"),
            ("nft list ruleset", "weft"),
        ] {
            let out = stdout(&lab.exec(&ns[host], &["sh", "-c", cmd]));
            assert!(
                !out.contains(what),
                "after teardown `{cmd}` on {host} still shows {what}:\n{out}"
            );
        }
    }
    let netns = stdout(&crate::run(std::process::Command::new("ip").args(["netns", "list"])));
    for p in peering_ns {
        assert!(!netns.contains(p), "peering namespace {p} left: {netns}");
    }
}

/// A third site on the WAN that relays (`--relay`): its controller and
/// one public gateway, peered with both sites of `s`. `n` (1 or 2) picks
/// its hosts (ctlr{n} 192.168.78.4{n}, gwr{n} 192.168.78.5{n}, or their
/// [`underlay_v6`] addresses on an IPv6 WAN); `peers`: which of a and b
/// it peers with.
pub fn relay_site(s: &mut TwoSites, site: &str, n: u8, pod: &str, peers: (bool, bool)) -> crate::lab::Site {
    relay_site_with(s, site, n, pod, peers, &[])
}

/// [`relay_site`] with more flags for its controller.
pub fn relay_site_with(
    s: &mut TwoSites,
    site: &str,
    n: u8,
    pod: &str,
    peers: (bool, bool),
    flags: &[(&str, &str)],
) -> crate::lab::Site {
    let (ctl, gw) = (format!("ctlr{n}"), format!("gwr{n}"));
    let (mut ctl_ip, mut gw_ip) = (format!("192.168.78.4{n}"), format!("192.168.78.5{n}"));
    let mut len = 24;
    if s.underlay_v6 {
        (ctl_ip, gw_ip, len) = (underlay_v6(&ctl_ip), underlay_v6(&gw_ip), 64);
    }
    let ctl_ns = s.lab.host(&ctl);
    s.lab.plug(&ctl_ns, &format!("{ctl_ip}/{len}"));
    let gw_ns = s.lab.host(&gw);
    s.lab.plug(&gw_ns, &format!("{gw_ip}/{len}"));
    // The WAN routes the sites' IPv6 LANs to their routers.
    for lan in s.nat_a.iter().chain(&s.nat_b).filter(|l| l.prefix.ends_with(':')) {
        s.lab.route_to(&ctl_ns, lan);
        s.lab.route_to(&gw_ns, lan);
    }
    for other in [&s.site_a, &s.site_b] {
        s.lab.adopt(&weft_controller::render::peering_namespace(site, other));
        s.lab.adopt(&weft_controller::render::peering_namespace(other, site));
    }
    let mut controller = ControllerSpec::new(site)
        .data_dir(&s.dir.path().join(site))
        .pod(pod)
        .flag("--metrics-listen", &format!("0.0.0.0:{CONTROLLER_METRICS_PORT}"))
        .flag("--relay-ports", "51920-51999");
    for (k, v) in flags {
        controller = controller.flag(k, v);
    }
    let spec = SiteSpec {
        controller,
        ctl: ctl_ns,
        ctl_ip: ctl_ip.clone(),
        agents: vec![AgentSpec::gateway("gw", &gw_ns, &gw_ip)],
        dir: s.dir.path().to_path_buf(),
        prefix: format!("192.168.78.4{n}"),
        // The agent's default: a relay site's gateway that read its whole
        // state each second would take CPU from the path it relays.
        resync: "30s".into(),
        agent_metrics: true,
    };
    let r = s.lab.site(&spec);
    let with: Vec<String> = [(peers.0, &s.ta), (peers.1, &s.tb)]
        .into_iter()
        .filter(|(on, _)| *on)
        .map(|(_, t)| t.clone())
        .collect();
    for t in with {
        peer_with(&r.target, &t);
    }
    let (ctl_key, gw_key) = if n == 1 { ("ctlr1", "gwr1") } else { ("ctlr2", "gwr2") };
    s.ns.insert(ctl_key, spec.ctl.clone());
    s.ns.insert(gw_key, gw_ns);
    r
}

/// Peers site `with` (its weftctl target) with the site at `to`, from a
/// token of `to`'s.
pub fn peer_with(to: &str, with: &str) {
    let token = weftctl_json(to, &["peering", "token"])["token"]
        .as_str()
        .unwrap()
        .to_string();
    // A peer slow to answer (the VM lane's emulated guest) is asked again
    // by weftctl until its --timeout.
    let timeout = format!("{}s", crate::pace::scaled(Duration::from_secs(60)).as_secs());
    let o = crate::run(std::process::Command::new(bin("weftctl")).args([
        "--controller",
        with,
        "peering",
        "create",
        "--timeout",
        &timeout,
        "--token",
        &token,
    ]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
