//! Two whole sites in network namespaces for tests and benchmarks: per
//! site a controller, a gateway and a node on one WAN, a workload on each
//! node, the sites peered from a token. Everything goes away on drop.

use std::collections::HashMap;
use std::time::Duration;

use crate::netns::Lab;
use crate::{bin, eventually, stdout, weftctl_json};

pub struct TwoSites {
    pub lab: Lab,
    pub dir: tempfile::TempDir,
    /// Host name (ctla, ctlb, gwa, gwb, na, nb, wa, wb) → namespace.
    pub ns: HashMap<&'static str, String>,
    /// weftctl targets of the two controllers.
    pub ta: String,
    pub tb: String,
    /// The gateways' process indices in `lab`.
    pub gateways: (usize, usize),
    /// Every agent: (process index in `lab`, host, kind, state directory).
    pub agents: Vec<(usize, &'static str, &'static str, std::path::PathBuf)>,
    pub site_a: String,
    pub site_b: String,
    /// Site a's namespace for its peering with site b.
    pub ns_a: String,
    /// wb's address as site a sees it, and wa's as site b sees it.
    pub wb_from_a: String,
    pub wa_from_b: String,
}

/// Two sites, each a controller, a gateway and a node in namespaces on one
/// WAN, and a workload on each node. Once the controllers peer, the gateways
/// build the peering's namespace, a userspace WireGuard tunnel (UDP on the
/// underlay), the routes into it and the prefix NAT, and the workloads reach
/// each other through their local views.
pub fn up(tag: &str, (site_a, pod_a): (&str, &str), (site_b, pod_b): (&str, &str)) -> TwoSites {
    let dir = tempfile::Builder::new().prefix("weft-dp").tempdir().unwrap();
    let mut lab = Lab::new(tag);
    lab.lan();
    let names = ["ctla", "ctlb", "gwa", "gwb", "na", "nb", "wa", "wb"];
    let ns: std::collections::HashMap<&str, String> = names.iter().map(|n| (*n, lab.host(n))).collect();
    let wan = [
        ("ctla", "192.168.78.1/24"),
        ("ctlb", "192.168.78.2/24"),
        ("gwa", "192.168.78.10/24"),
        ("gwb", "192.168.78.20/24"),
        ("na", "192.168.78.11/24"),
        ("nb", "192.168.78.21/24"),
    ];
    for (h, ip) in wan {
        lab.plug(&ns[h], ip);
    }
    // The gateways create these; the lab deletes them at the end whatever happens.
    lab.adopt(&weft_controller::render::peering_namespace(site_b));
    lab.adopt(&weft_controller::render::peering_namespace(site_a));
    let sh = |host: &str, cmd: &str| {
        let o = std::process::Command::new("ip")
            .args(["netns", "exec", host, "sh", "-c", cmd])
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{cmd} in {host}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    // Workloads: a namespace on each node, in the node's subnet (the first
    // /24 of the site's pod CIDR), the node routing for it.
    let first = |pod: &str| pod.rsplit_once(".0.0/").unwrap().0.to_string() + ".0";
    let (sub_a, sub_b) = (first(pod_a), first(pod_b));
    for (node, wl, sub) in [("na", "wa", sub_a.as_str()), ("nb", "wb", sub_b.as_str())] {
        let o = std::process::Command::new("ip")
            .args([
                "-n", &ns[node], "link", "add", "wl0", "type", "veth", "peer", "name", "eth0", "netns", &ns[wl],
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        sh(
            &ns[node],
            &format!("ip addr add {sub}.1/24 dev wl0 && ip link set wl0 up && sysctl -qw net.ipv4.ip_forward=1"),
        );
        sh(
            &ns[wl],
            &format!("ip addr add {sub}.10/24 dev eth0 && ip link set eth0 up && ip route add default via {sub}.1"),
        );
    }

    let controller = |lab: &mut Lab, host: &str, site: &str, pod: &str, ip: &str| {
        let data = dir.path().join(site);
        let listen = format!("{ip}:7443");
        let args = [
            "--site-id",
            site,
            "--pod-cidr",
            pod,
            "--data-dir",
            data.to_str().unwrap(),
            "--listen",
            &listen,
        ];
        lab.spawn(
            host,
            &bin("weft-controller"),
            &args,
            &dir.path().join(format!("{site}.log")),
        );
        let sock = data.join("admin.sock");
        eventually("a controller", Duration::from_secs(20), || {
            std::os::unix::net::UnixStream::connect(&sock).ok()
        });
        format!("unix:{}", sock.display())
    };
    let ta = controller(&mut lab, &ns["ctla"], site_a, pod_a, "192.168.78.1");
    let tb = controller(&mut lab, &ns["ctlb"], site_b, pod_b, "192.168.78.2");

    let agent = |lab: &mut Lab, kind: &str, target: &str, ctl_ip: &str, host: &str, ip: &str, name: &str| {
        let t = weftctl_json(target, &["token", "create", "--role", kind, "--name", name]);
        let state = dir.path().join(format!("{ctl_ip}-{name}"));
        let mut args: Vec<String> = vec![
            "--controller".into(),
            format!("https://{ctl_ip}:7443"),
            "--name".into(),
            name.into(),
            "--underlay-ip".into(),
            ip.into(),
            "--token".into(),
            t["token"].as_str().unwrap().into(),
            "--ca-fingerprint".into(),
            t["ca_fingerprint"].as_str().unwrap().into(),
            "--state-dir".into(),
            state.to_str().unwrap().into(),
            "--resync-interval".into(),
            "1s".into(),
        ];
        if kind == "gateway" {
            args.extend(["--endpoint".to_string(), format!("{ip}:51820")]);
        }
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let log = dir.path().join(format!("{ctl_ip}-{name}.log"));
        lab.spawn(host, &bin(&format!("weft-{kind}-agent")), &refs, &log)
    };
    let pa = agent(
        &mut lab,
        "gateway",
        &ta,
        "192.168.78.1",
        &ns["gwa"],
        "192.168.78.10",
        "gw",
    );
    let pb = agent(
        &mut lab,
        "gateway",
        &tb,
        "192.168.78.2",
        &ns["gwb"],
        "192.168.78.20",
        "gw",
    );
    let na = agent(&mut lab, "node", &ta, "192.168.78.1", &ns["na"], "192.168.78.11", "na");
    let nb = agent(&mut lab, "node", &tb, "192.168.78.2", &ns["nb"], "192.168.78.21", "nb");
    let state = |ctl_ip: &str, name: &str| dir.path().join(format!("{ctl_ip}-{name}"));
    let agents = vec![
        (pa, "gwa", "gateway", state("192.168.78.1", "gw")),
        (pb, "gwb", "gateway", state("192.168.78.2", "gw")),
        (na, "na", "node", state("192.168.78.1", "na")),
        (nb, "nb", "node", state("192.168.78.2", "nb")),
    ];
    for t in [&ta, &tb] {
        eventually("the gateway's key", Duration::from_secs(20), || {
            let g = weftctl_json(t, &["gateways"]);
            g["gateways"][0]["public_key"]
                .as_str()
                .is_some_and(|k| !k.is_empty())
                .then_some(())
        });
    }
    let token = weftctl_json(&tb, &["peering", "token"])["token"]
        .as_str()
        .unwrap()
        .to_string();
    let o = crate::run(std::process::Command::new(bin("weftctl")).args([
        "--controller",
        &ta,
        "peering",
        "create",
        "--token",
        &token,
    ]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // The WireGuard interface lives in the peering's namespace; its UDP
    // socket stayed on the gateway's underlay.
    let ns_a = weft_controller::render::peering_namespace(site_b);
    eventually("site-a's WireGuard interface", Duration::from_secs(20), || {
        let o = stdout(
            &std::process::Command::new("ip")
                .args(["-n", &ns_a, "-br", "link"])
                .output()
                .unwrap(),
        );
        o.contains("weft-w").then_some(())
    });
    let socks = stdout(&lab.exec(&ns["gwa"], &["ss", "-uln"]));
    assert!(socks.contains(":51820"), "{socks}");

    // Each site addresses the other's workload through its local view of it.
    let view_of = |target: &str, peer: &str, addr: &str| -> String {
        let (real, local) = crate::peer_view(target, peer, "workload");
        let real: ipnet::Ipv4Net = real.parse().unwrap();
        let local: ipnet::Ipv4Net = local.parse().unwrap();
        weft_controller::ipam::translate(addr.parse().unwrap(), real, local)
            .unwrap()
            .to_string()
    };
    let (wa_ip, wb_ip) = (format!("{sub_a}.10"), format!("{sub_b}.10"));
    let wb_from_a = view_of(&ta, site_b, &wb_ip);
    let wa_from_b = view_of(&tb, site_a, &wa_ip);

    TwoSites {
        lab,
        dir,
        ns,
        ta,
        tb,
        gateways: (pa, pb),
        agents,
        site_a: site_a.to_string(),
        site_b: site_b.to_string(),
        ns_a,
        wb_from_a,
        wa_from_b,
    }
}
