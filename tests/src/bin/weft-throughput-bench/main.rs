//! TCP throughput through a weft peering, against baselines measured in the
//! same run, each path's runs interleaved with the others':
//! - weft cross-site: workload → node → VXLAN → gateway → prefix NAT and
//!   weft's userspace WireGuard device in the peering namespace → the other
//!   site's gateway, prefix NAT → VXLAN → node → workload; two WireGuard
//!   ends, two overlay hops and NAT on both gateways (both sites use the
//!   same workload CIDR, 10.1.0.0/16, so each reaches the other through a
//!   remapped view);
//! - a bare veth pair between two namespaces;
//! - point-to-point tunnels over a veth pair: the old boringtun device
//!   (defguard_boringtun's own, one worker, a packet per system call: what
//!   weft's gateways ran before), weft's device, and wireguard-go (if
//!   installed);
//! - the old device over a switch, directly and through weft's relay.
//!
//! For each path: Gbit/s and the machine's CPU seconds per GB moved.
//! Needs root; everything lives in `weft-tp-*` namespaces that go away at
//! the end. `sudo weft-throughput-bench --seconds 5 --runs 7` (see
//! docs/benchmarks.md).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

mod boringtun;

use clap::Parser;
use weft_tests::netns::{Lab, must};
use weft_tests::perf::median;
use weft_tests::{Proc, eventually, sites};

#[derive(Parser, Debug)]
struct Args {
    #[command(subcommand)]
    end: Option<Sub>,
    /// Length of each iperf3 run.
    #[arg(long, default_value_t = 5)]
    seconds: u32,
    /// Runs per path; the median is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Sets the workloads' MTU (default 1500, leaving the path to PMTU
    /// discovery) to see what MTU costs.
    #[arg(long)]
    workload_mtu: Option<u32>,
    /// Measure instead what an export policy costs: the cross-site path
    /// without a policy and with one of this many rules at the receiving
    /// site (the last allows iperf3's port; the others allow other /24s),
    /// runs interleaved.
    #[arg(long)]
    policy_rules: Option<usize>,
    /// Also measure weft's device point-to-point as built at another
    /// commit: the path of that build's `weft-throughput-bench`, whose
    /// hidden `device-end` runs its device. Its runs interleave with this
    /// build's, and each run's ratio (this build / that one) is reported:
    /// a change to the device is measured against the code before it, in
    /// one run.
    #[arg(long)]
    compare_with: Option<std::path::PathBuf>,
    /// (for experiments) Keep the two-site lab up this many seconds before
    /// measuring, printing its namespaces, so it can be inspected or tuned.
    #[arg(long, hide = true)]
    hold: Option<u64>,
}

#[derive(clap::Subcommand, Debug)]
#[allow(clippy::enum_variant_names)] // the subcommands are boringtun-end, device-end, relay-end
enum Sub {
    /// (internal) One end of the plain boringtun tunnel.
    #[command(hide = true)]
    BoringtunEnd(End),
    /// (internal) One end of a point-to-point tunnel of weft's userspace
    /// device.
    #[command(hide = true)]
    DeviceEnd(End),
    /// (internal) weft's relay between two ports.
    #[command(hide = true)]
    RelayEnd(RelayEnd),
}

#[derive(clap::Args, Debug)]
struct RelayEnd {
    #[arg(long)]
    port_a: u16,
    #[arg(long)]
    port_b: u16,
    /// Side a's handshakes go to this key (side b's gateway), base64.
    #[arg(long)]
    key_b: String,
    #[arg(long)]
    key_a: String,
}

#[derive(clap::Args, Debug)]
struct End {
    #[arg(long)]
    dev: String,
    #[arg(long)]
    namespace: String,
    #[arg(long)]
    key_file: std::path::PathBuf,
    #[arg(long)]
    peer: String,
    #[arg(long)]
    endpoint: String,
    #[arg(long)]
    allowed: String,
    /// (device-end) Ask for no offloads.
    #[arg(long)]
    no_offload: bool,
    /// (device-end) Both directions on one thread.
    #[arg(long)]
    single_thread: bool,
}

/// `weftctl peering policy ARGS` at `target`, or the bench stops.
fn set_policy(target: &str, args: &[String]) {
    let o = weft_tests::run(
        Command::new(weft_tests::bin("weftctl"))
            .args(["--controller", target, "peering", "policy", "set"])
            .args(args),
    );
    assert!(
        o.status.success(),
        "weftctl peering policy set: {}",
        weft_tests::stderr(&o)
    );
}

/// The cross-site path without and with an export policy of `n` rules at
/// site b for site a (the last one allowing iperf3's TCP port to wb's
/// /24), interleaved run by run; the policy is set before and removed
/// after each of its runs, and each run waits for the gateway to have it.
#[allow(clippy::too_many_arguments)]
fn policy_cost(
    s: &mut sites::TwoSites,
    log: &Path,
    wa: &str,
    wb: &str,
    to_b: &str,
    wb_real: &str,
    n: usize,
    args: &Args,
) {
    assert!((1..=256).contains(&n), "--policy-rules: 1 to 256");
    let wb_net = format!("{}.0/24", wb_real.rsplit_once('.').unwrap().0);
    let mut rules: Vec<String> = Vec::with_capacity(2 * n);
    // Other /24s of site b's 10.1.0.0/16 first (never matched), then the
    // one that allows the stream.
    for i in 0..n - 1 {
        rules.extend([
            "--allow".into(),
            format!("10.1.{}.0/24,tcp,{}", 100 + i % 150, 1000 + i),
        ]);
    }
    rules.extend(["--allow".into(), format!("{wb_net},tcp,5201")]);
    let (site_a, tb) = (s.site_a.clone(), s.tb.clone());
    let ns_b = weft_controller::render::peering_namespace(&s.site_b, &site_a);
    let gwb = s.gateways.1;
    let pid = s.lab.proc(gwb).child.as_ref().map(|c| c.id());
    let has_policy = |lab: &Lab| {
        let o = match pid {
            Some(pid) => {
                weft_tests::netns::exec_beside(pid, &ns_b, &["nft", "list", "counters", "table", "inet", "weft"])
            }
            None => lab.exec(&ns_b, &["nft", "list", "counters", "table", "inet", "weft"]),
        };
        weft_tests::stdout(&o).contains("refused")
    };
    println!(
        "path under test: wa -> wb {wb_real} at {to_b}; policy at {}: {n} rules",
        s.site_b
    );
    let (mut plain, mut policed, mut ratios) = (vec![], vec![], vec![]);
    for run in 0..args.runs {
        let g0 = iperf(&mut s.lab, log, wb, wa, to_b, args);
        let mut with = vec![site_a.clone()];
        with.extend(rules.iter().cloned());
        set_policy(&tb, &with);
        eventually("the policy at b's gateway", Duration::from_secs(30), || {
            has_policy(&s.lab).then_some(())
        });
        let g1 = iperf(&mut s.lab, log, wb, wa, to_b, args);
        set_policy(&tb, &[site_a.clone(), "--all".into()]);
        eventually("no policy at b's gateway", Duration::from_secs(30), || {
            (!has_policy(&s.lab)).then_some(())
        });
        println!(
            "run {}: no policy {g0:.3} Gbit/s, {n} rules {g1:.3} Gbit/s, ratio {:.3}",
            run + 1,
            g1 / g0
        );
        plain.push(g0);
        policed.push(g1);
        ratios.push(g1 / g0);
    }
    println!(
        "weft cross-site: no policy {:.2} Gbit/s, a policy of {n} rules {:.2} Gbit/s, with / without (median of per-run ratios) {:.3}",
        median(plain),
        median(policed),
        median(ratios)
    );
}

/// One iperf3 run of `args.seconds` (see `weft_tests::perf::iperf`).
fn iperf(lab: &mut Lab, log: &Path, server: &str, client: &str, server_ip: &str, args: &Args) -> f64 {
    weft_tests::perf::iperf(lab, log, server, client, server_ip, args.seconds)
}

/// CPU time the whole machine has spent busy (all but idle and iowait),
/// in seconds, from /proc/stat.
fn busy_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<f64> = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal, in USER_HZ (100 on
    // Linux, whatever the kernel's own tick)
    let busy: f64 = f
        .iter()
        .take(8)
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .map(|(_, v)| v)
        .sum();
    busy / 100.0
}

#[derive(Clone, Copy, PartialEq)]
enum Impl {
    /// boringtun through weft's own device code (the implementation weft's
    /// gateways run), one worker thread as in the gateway.
    Boringtun,
    /// weft's userspace device (the one its gateways run now): boringtun's
    /// protocol, weft's batched I/O with offloads.
    Device,
    /// The same, both directions on one thread.
    DeviceOneThread,
    /// The same, asking the kernel for no offloads (a packet per system
    /// call, as the old device, but weft's threads and batching).
    DeviceNoOffload,
    /// weft's device as built at another commit (`--compare-with`).
    DeviceCompared,
    WireguardGo,
}

/// The other build's bench (`--compare-with`).
static COMPARED: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

/// How a point-to-point tunnel's two ends reach each other.
#[derive(Clone, Copy, PartialEq)]
enum Wire {
    /// A veth pair between them.
    Veth,
    /// A bridge (a switch) they and a third host are plugged into: `true`
    /// sends through weft's relay on that host, `false` directly.
    Bridge { relayed: bool },
}

/// A point-to-point tunnel between two fresh namespaces (`wire`: how they
/// are joined): inner addresses 10.98.0.1 and .2. Returns the client and
/// server sides' namespaces and the processes running the two ends (and
/// the relay).
fn tunnel(lab: &mut Lab, dir: &Path, which: Impl, wire: Wire) -> Option<(String, String, Vec<Proc>)> {
    let (tag, program) = match (which, wire) {
        (Impl::Boringtun, Wire::Veth) => ("bt", std::env::current_exe().unwrap()),
        (Impl::Boringtun, Wire::Bridge { relayed: false }) => ("bd", std::env::current_exe().unwrap()),
        (Impl::Boringtun, Wire::Bridge { relayed: true }) => ("br", std::env::current_exe().unwrap()),
        (Impl::Device, _) => ("dv", std::env::current_exe().unwrap()),
        (Impl::DeviceOneThread, _) => ("d1", std::env::current_exe().unwrap()),
        (Impl::DeviceNoOffload, _) => ("dn", std::env::current_exe().unwrap()),
        (Impl::DeviceCompared, _) => ("dc", COMPARED.get()?.clone()),
        (Impl::WireguardGo, _) => ("wg", weft_tests::require_tool("wireguard-go")?),
    };
    let (nx, ny, ips) = match wire {
        Wire::Veth => {
            let (x, y) = lab.veth_pair(&format!("{tag}x"), &format!("{tag}y"));
            (x, y, ["10.99.0.2:51820", "10.99.0.1:51820"])
        }
        Wire::Bridge { relayed } => {
            let br = lab.bridge(&format!("{tag}s"));
            let (x, y) = (lab.host(&format!("{tag}x")), lab.host(&format!("{tag}y")));
            lab.plug_into(&br, &x, "eth0", "10.99.0.1/24");
            lab.plug_into(&br, &y, "eth0", "10.99.0.2/24");
            if relayed {
                let r = lab.host(&format!("{tag}r"));
                lab.plug_into(&br, &r, "eth0", "10.99.0.3/24");
            }
            let ends = if relayed {
                ["10.99.0.3:40001", "10.99.0.3:40002"]
            } else {
                ["10.99.0.2:51820", "10.99.0.1:51820"]
            };
            (x, y, ends)
        }
    };
    let (kx, ky) = (weft_tests::wg_keypair(), weft_tests::wg_keypair());
    let mut procs = Vec::new();
    if wire == (Wire::Bridge { relayed: true }) {
        // x sends to port 40001 (its handshakes go to y's key), y to 40002.
        let r = lab.ns(&format!("{tag}r"));
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{r}")).arg(&program).args([
            "relay-end",
            "--port-a",
            "40001",
            "--port-b",
            "40002",
            "--key-b",
            &ky.1,
            "--key-a",
            &kx.1,
        ]);
        let p = Proc::spawn(&mut cmd, &dir.join(format!("{tag}-relay.log")));
        eventually("the relay", Duration::from_secs(10), || {
            p.log_text().contains("ready").then_some(())
        });
        procs.push(p);
    }
    // Distinct names: wireguard-go's UAPI sockets share /var/run/wireguard.
    for (ns, end, me, peer, inner, peer_inner, endpoint) in [
        (&nx, "x", &kx, &ky, "10.98.0.1/24", "10.98.0.2/32", ips[0]),
        (&ny, "y", &ky, &kx, "10.98.0.2/24", "10.98.0.1/32", ips[1]),
    ] {
        let dev = format!("weft{tag}{end}0");
        let keyfile = dir.join(format!("{dev}.key"));
        std::fs::write(&keyfile, &me.0).unwrap();
        let endpoint = endpoint.to_string();
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{ns}")).arg(&program);
        match which {
            Impl::WireguardGo => {
                cmd.arg(&dev).env("WG_PROCESS_FOREGROUND", "1");
            }
            _ => {
                let sub = if which == Impl::Boringtun {
                    "boringtun-end"
                } else {
                    "device-end"
                };
                cmd.args([sub, "--dev", &dev, "--namespace", ns, "--key-file"])
                    .arg(&keyfile)
                    .args(["--peer", &peer.1, "--endpoint", &endpoint, "--allowed", peer_inner]);
                match which {
                    Impl::DeviceOneThread => {
                        cmd.arg("--single-thread");
                    }
                    Impl::DeviceNoOffload => {
                        cmd.arg("--no-offload");
                    }
                    _ => {}
                }
            }
        }
        let mut p = Proc::spawn(&mut cmd, &dir.join(format!("{dev}.log")));
        eventually("the tunnel device", Duration::from_secs(10), || {
            if let Some(st) = p.wait_exit(Duration::ZERO) {
                panic!("{} exited ({st}): {}", program.display(), p.log_text());
            }
            let up = lab.exec(ns, &["ip", "link", "show", &dev]).status.success();
            (up && (which == Impl::WireguardGo || p.log_text().contains("ready"))).then_some(())
        });
        procs.push(p);
        if which == Impl::WireguardGo {
            must(
                lab.exec(
                    ns,
                    &[
                        "wg",
                        "set",
                        &dev,
                        "listen-port",
                        "51820",
                        "private-key",
                        keyfile.to_str().unwrap(),
                        "peer",
                        &peer.1,
                        "allowed-ips",
                        peer_inner,
                        "endpoint",
                        &endpoint,
                    ],
                ),
                "wg set",
            );
        }
        must(lab.exec(ns, &["ip", "addr", "add", inner, "dev", &dev]), "addr");
        must(lab.exec(ns, &["ip", "link", "set", &dev, "up"]), "up");
    }
    // Through a relay both ends must send first (as weft's probes do from
    // both gateways): the relay learns a side only from its handshake.
    eventually("the tunnel", Duration::from_secs(10), || {
        let _ = lab.exec(&ny, &["ping", "-c", "1", "-W", "0.2", "10.98.0.1"]);
        lab.exec(&nx, &["ping", "-c", "1", "-W", "1", "10.98.0.2"])
            .status
            .success()
            .then_some(())
    });
    Some((nx, ny, procs))
}

/// The private key `wg genkey` wrote to `path`.
fn secret_in(path: &std::path::Path) -> anyhow::Result<weft_types::WgSecret> {
    let text = std::fs::read_to_string(path)?;
    weft_types::WgSecret::parse(&path.display().to_string(), text.trim()).map_err(anyhow::Error::msg)
}

fn public(b64: &str) -> anyhow::Result<weft_types::WgKey> {
    weft_types::WgKey::parse("the peer's key", b64).map_err(anyhow::Error::msg)
}

/// One end of a plain boringtun tunnel, run by the bench inside a
/// namespace: weft's own device code, no overlay, no NAT.
fn boringtun_end(e: End) -> anyhow::Result<()> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        let (conn, handle, _) = rtnetlink::new_connection()?;
        tokio::spawn(conn);
        let key = secret_in(&e.key_file)?;
        let mut devs = boringtun::Devices::default();
        devs.create(&handle, &e.dev, &e.namespace, 51820, 0, &key)
            .await
            .map_err(anyhow::Error::msg)?;
        devs.set_peer(
            &e.dev,
            &public(&e.peer)?,
            &e.endpoint,
            std::slice::from_ref(&e.allowed),
            0,
        )
        .map_err(anyhow::Error::msg)?;
        println!("ready");
        tokio::signal::ctrl_c().await?;
        Ok(())
    })
}

/// One end of a point-to-point tunnel of weft's userspace device (the one
/// its gateways run), run by the bench inside a namespace.
fn device_end(e: End) -> anyhow::Result<()> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        let (conn, handle, _) = rtnetlink::new_connection()?;
        tokio::spawn(conn);
        let key = secret_in(&e.key_file)?;
        let mut devs = weft_dataplane::userspace::Devices {
            options: weft_dataplane::userspace::Options {
                no_offload: e.no_offload,
                rekey_after: None,
                single_thread: e.single_thread,
                punch_ttl: 0,
                panic_dir: None,
            },
            ..Default::default()
        };
        devs.create(&handle, &e.dev, &e.namespace, 51820, 1420, &key)
            .await
            .map_err(anyhow::Error::msg)?;
        let allowed: ipnet::IpNet = e.allowed.parse()?;
        let peer = weft_dataplane::model::WgPeer {
            public_key: public(&e.peer)?,
            endpoint: Some(e.endpoint.parse()?),
            allowed_ips: vec![allowed],
            keepalive: 0,
            punch: false,
            direct: None,
        };
        devs.set_peer(&e.dev, &peer).map_err(anyhow::Error::msg)?;
        println!("ready {:?}", devs.stats(&e.dev).offloads.map(|o| o.names()));
        tokio::signal::ctrl_c().await?;
        println!("{:?}", devs.devices[&e.dev].device.counters());
        Ok(())
    })
}

/// weft's relay between two ports, run by the bench in the relay's
/// namespace until it is ended.
fn relay_end(r: RelayEnd) -> anyhow::Result<()> {
    let key = |b64: &str| public(b64).map(|k| *k.as_bytes());
    let spec = weft_dataplane::relay::Spec {
        a: weft_dataplane::relay::Side {
            port: r.port_a,
            to_keys: vec![key(&r.key_b)?],
            from_ips: vec![],
        },
        b: weft_dataplane::relay::Side {
            port: r.port_b,
            to_keys: vec![key(&r.key_a)?],
            from_ips: vec![],
        },
        bytes_per_second: 10_000_000_000 / 8,
    };
    let relay = weft_dataplane::relay::start(&spec)?;
    println!("ready");
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(tokio::signal::ctrl_c())?;
    println!("{:?}", relay.counters);
    Ok(())
}

fn main() {
    let mut args = Args::parse();
    match args.end.take() {
        Some(Sub::BoringtunEnd(e)) => {
            if let Err(e) = boringtun_end(e) {
                eprintln!("boringtun-end: {e:#}");
                std::process::exit(1);
            }
            return;
        }
        Some(Sub::DeviceEnd(e)) => {
            if let Err(e) = device_end(e) {
                eprintln!("device-end: {e:#}");
                std::process::exit(1);
            }
            return;
        }
        Some(Sub::RelayEnd(r)) => {
            if let Err(e) = relay_end(r) {
                eprintln!("relay-end: {e:#}");
                std::process::exit(1);
            }
            return;
        }
        None => {}
    }
    assert!(weft_tests::netns::require_root(), "weft-throughput-bench needs root");
    let dir = tempfile::Builder::new().prefix("weft-tp").tempdir().unwrap();
    let log = dir.path().join("iperf3.log");

    // Both sites on one CIDR: the measured path has prefix NAT in it.
    let mut s = sites::up("tp", ("site-a", "10.1.0.0/16"), ("site-b", "10.1.0.0/16"));
    let (wa, wb, to_b) = (s.ns["wa"].clone(), s.ns["wb"].clone(), s.wb_from_a.clone());
    let wb_real = &s.workloads[2].1;
    assert_ne!(
        &to_b, wb_real,
        "the sites overlap, so site-a must reach wb through a remapped view"
    );
    println!(
        "path under test: wa (10.1.0.10) -> wb {wb_real}, seen from site-a at {to_b} (prefix NAT on both gateways)"
    );
    eventually("wa reaching wb through the peering", Duration::from_secs(30), || {
        s.lab
            .exec(&wa, &["ping", "-c", "1", "-W", "1", &to_b])
            .status
            .success()
            .then_some(())
    });
    if let Some(m) = args.workload_mtu {
        for w in [&wa, &wb] {
            must(
                s.lab.exec(w, &["ip", "link", "set", "eth0", "mtu", &m.to_string()]),
                "mtu",
            );
        }
    }
    if let Some(secs) = args.hold {
        println!("lab up: {:?}; wb from wa = {to_b}", s.ns);
        std::thread::sleep(Duration::from_secs(secs));
    }
    if let Some(n) = args.policy_rules {
        let wb_real = wb_real.clone();
        policy_cost(&mut s, &log, &wa, &wb, &to_b, &wb_real, n, &args);
        return;
    }
    // Every path is built first and the runs interleave (weft, veth,
    // boringtun, wireguard-go, weft, ...), so a slow spell of this shared
    // machine hits all paths alike; each run's weft/boringtun ratio is kept.
    let (nx, ny) = s.lab.veth_pair("vx", "vy");
    let (bt_client, bt_server, mut bt_procs) = tunnel(&mut s.lab, dir.path(), Impl::Boringtun, Wire::Veth).unwrap();
    let wg_tunnel = tunnel(&mut s.lab, dir.path(), Impl::WireguardGo, Wire::Veth);
    let dev_tunnel = tunnel(&mut s.lab, dir.path(), Impl::Device, Wire::Veth).unwrap();
    let one_thread = tunnel(&mut s.lab, dir.path(), Impl::DeviceOneThread, Wire::Veth).unwrap();
    let no_offload = tunnel(&mut s.lab, dir.path(), Impl::DeviceNoOffload, Wire::Veth).unwrap();
    if let Some(p) = &args.compare_with {
        assert!(p.is_file(), "--compare-with {}: no such file", p.display());
        COMPARED.set(p.clone()).unwrap();
    }
    let compared = tunnel(&mut s.lab, dir.path(), Impl::DeviceCompared, Wire::Veth);
    let bridged = tunnel(&mut s.lab, dir.path(), Impl::Boringtun, Wire::Bridge { relayed: false }).unwrap();
    let relayed = tunnel(&mut s.lab, dir.path(), Impl::Boringtun, Wire::Bridge { relayed: true }).unwrap();
    // (name, server namespace, client namespace, server address)
    let mut paths: Vec<(&str, String, String, String)> = vec![
        (
            "weft cross-site (2 VXLAN hops, prefix NAT, weft's device)",
            wb.clone(),
            wa.clone(),
            to_b.clone(),
        ),
        ("bare veth", ny.clone(), nx.clone(), "10.99.0.2".into()),
        (
            "old boringtun device point-to-point",
            bt_server.clone(),
            bt_client.clone(),
            "10.98.0.2".into(),
        ),
        (
            "weft's device point-to-point",
            dev_tunnel.1.clone(),
            dev_tunnel.0.clone(),
            "10.98.0.2".into(),
        ),
    ];
    // (right after this build's device: a slow spell hits both alike)
    let compared_at = compared.as_ref().map(|(client, server, _)| {
        paths.push((
            "weft's device point-to-point, the build compared with",
            server.clone(),
            client.clone(),
            "10.98.0.2".into(),
        ));
        paths.len() - 1
    });
    let wg_at = wg_tunnel.as_ref().map(|(client, server, _)| {
        paths.push((
            "wireguard-go point-to-point",
            server.clone(),
            client.clone(),
            "10.98.0.2".into(),
        ));
        paths.len() - 1
    });
    paths.push((
        "weft's device point-to-point, one thread",
        one_thread.1.clone(),
        one_thread.0.clone(),
        "10.98.0.2".into(),
    ));
    paths.push((
        "weft's device point-to-point, no offloads",
        no_offload.1.clone(),
        no_offload.0.clone(),
        "10.98.0.2".into(),
    ));
    // (the relay's two rows stay last: their ratio is taken from there)
    paths.push((
        "old boringtun over a switch, direct",
        bridged.1.clone(),
        bridged.0.clone(),
        "10.98.0.2".into(),
    ));
    paths.push((
        "old boringtun over a switch, through weft's relay",
        relayed.1.clone(),
        relayed.0.clone(),
        "10.98.0.2".into(),
    ));
    let mut gbits: Vec<Vec<f64>> = vec![Vec::new(); paths.len()];
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); paths.len()];
    let (mut to_bt, mut to_wg, mut relay_ratios, mut to_compared) = (vec![], vec![], vec![], vec![]);
    for run in 0..args.runs {
        let mut this = Vec::new();
        for (i, (name, server, client, ip)) in paths.iter().enumerate() {
            let busy = busy_seconds();
            let g = iperf(&mut s.lab, &log, server, client, ip, &args);
            let used = busy_seconds() - busy;
            // CPU seconds of the whole machine (both ends, both tunnel
            // ends, the kernel's forwarding) per GB the stream moved.
            let gb = g * f64::from(args.seconds) / 8.0;
            let per_gb = used / gb.max(1e-9);
            println!("run {}: {name}: {g:.3} Gbit/s, {per_gb:.2} CPU s/GB", run + 1);
            gbits[i].push(g);
            cpu[i].push(per_gb);
            this.push(g);
        }
        to_bt.push(this[0] / this[2]);
        if let Some(w) = wg_at {
            to_wg.push(this[0] / this[w]);
        }
        let n = this.len();
        relay_ratios.push(this[n - 1] / this[n - 2]);
        if let Some(c) = compared_at {
            to_compared.push(this[3] / this[c]);
            println!(
                "run {}: weft's device, this build / the build compared with {:.3}",
                run + 1,
                this[3] / this[c]
            );
        }
        println!(
            "run {}: weft / old boringtun {:.3}, weft / wireguard-go {}",
            run + 1,
            this[0] / this[2],
            if let Some(w) = wg_at {
                format!("{:.3}", this[0] / this[w])
            } else {
                "-".into()
            }
        );
    }
    let rest: Vec<Proc> = wg_tunnel
        .into_iter()
        .flat_map(|t| t.2)
        .chain(bridged.2)
        .chain(dev_tunnel.2)
        .chain(one_thread.2)
        .chain(no_offload.2)
        .chain(relayed.2)
        .chain(compared.into_iter().flat_map(|t| t.2))
        .collect();
    for mut p in bt_procs.drain(..).chain(rest) {
        p.stop();
    }
    let veth = median(gbits[1].clone());
    println!(
        "path                                                      Gbit/s  of veth  CPU s/GB   (medians of {} runs)",
        args.runs
    );
    for (i, (name, ..)) in paths.iter().enumerate() {
        let g = median(gbits[i].clone());
        println!("{name:<57} {g:6.2}  {:6.3}  {:7.2}", g / veth, median(cpu[i].clone()));
    }
    println!(
        "weft cross-site / old boringtun point-to-point (median of per-run ratios) {:.3}",
        median(to_bt)
    );
    if !to_wg.is_empty() {
        println!(
            "weft cross-site / wireguard-go point-to-point (median of per-run ratios) {:.3}",
            median(to_wg)
        );
    }
    println!(
        "through weft's relay / direct (median of per-run ratios) {:.3}",
        median(relay_ratios)
    );
    if !to_compared.is_empty() {
        println!(
            "weft's device point-to-point, this build / the build compared with (median of per-run ratios) {:.3}",
            median(to_compared)
        );
    }
}
