//! N sites in network namespaces, peered along any graph, for tests and
//! the quickstart's mesh: per site a controller (embedded store), a gateway
//! on a host of its own (its own network *and* mount namespace, so its
//! peering namespaces live under a private /run/netns, as on a real
//! machine), a node and a workload that runs `weft-echo serve`. Every site
//! may use the same workload CIDR and the same workload address. All hosts
//! share one WAN. Everything goes away on drop.

use std::time::Duration;

use crate::ControllerSpec;
use crate::lab::{AgentSpec, SiteSpec};
use crate::netns::Lab;
use crate::{bin, eventually, weftctl_json};

/// The TCP port each workload's `weft-echo serve` listens on.
pub const ECHO_PORT: u16 = 7000;

/// What [`Mesh::connect_all_then_ask`] saw.
#[derive(Debug, Default)]
pub struct Connected {
    /// From the first `peering create` to every peering `connected`.
    pub connected_after: Duration,
    /// Observations of a peering `connecting`, and every distinct thing
    /// one waited for.
    pub connecting_seen: usize,
    pub waiting_for: Vec<String>,
    /// Each ask ("a->b"), when it ended after all showed connected, and
    /// the answer or what went wrong.
    pub asks: Vec<(String, Duration, Result<String, String>)>,
}

/// One site of a [`Mesh`].
#[derive(Debug)]
pub struct MeshSite {
    /// Its site id: `s1`, `s2`, …
    pub id: String,
    /// weftctl's target (the controller's admin socket).
    pub target: String,
    /// Host namespaces: controller, gateway, node, workload.
    pub ctl: String,
    pub gw: String,
    pub node: String,
    pub wl: String,
    /// The gateway agent's process index in the lab.
    pub gateway: usize,
    /// The workload's own address.
    pub workload: String,
    /// Its IPv6 address (dual stack: [`Mesh::up_dual`]).
    pub workload_v6: Option<String>,
}

pub struct Mesh {
    pub lab: Lab,
    pub dir: tempfile::TempDir,
    pub sites: Vec<MeshSite>,
    pod: String,
    /// Each node's subnet's prefix length: 24, or 23 for a workload with
    /// a second address in the next /24 ([`Mesh::up_wide`]).
    node_len: u8,
    /// Every site's IPv6 pod CIDR too ([`Mesh::up_dual`]).
    pod_v6: Option<String>,
}

impl Mesh {
    /// `n` sites, none peered yet, every one on workload CIDR `pod` (a /16)
    /// with its node on the first /24 and its workload at .10 of it.
    pub fn up(tag: &str, n: usize, pod: &str) -> Mesh {
        Mesh::up_with(tag, n, pod, 24)
    }

    /// [`Mesh::up`] with each node on a /23 and each workload also at .10
    /// of the second /24 (`{prefix}.1.10`): two prefixes behind one node.
    pub fn up_wide(tag: &str, n: usize, pod: &str) -> Mesh {
        Mesh::up_with(tag, n, pod, 23)
    }

    /// [`Mesh::up`], every site dual stack: also on IPv6 pod CIDR `pod_v6`
    /// (a /48), its node on the first /64 of it, its workload at ::10.
    pub fn up_dual(tag: &str, n: usize, pod: &str, pod_v6: &str) -> Mesh {
        Mesh::up_on(tag, n, pod, 24, Some(pod_v6))
    }

    fn up_with(tag: &str, n: usize, pod: &str, node_len: u8) -> Mesh {
        Mesh::up_on(tag, n, pod, node_len, None)
    }

    fn up_on(tag: &str, n: usize, pod: &str, node_len: u8, pod_v6: Option<&str>) -> Mesh {
        let dir = tempfile::Builder::new().prefix("weft-mesh").tempdir().unwrap();
        let mut lab = Lab::new(tag);
        lab.lan();
        let mut mesh = Mesh {
            lab,
            dir,
            sites: Vec::new(),
            pod: pod.to_string(),
            node_len,
            pod_v6: pod_v6.map(str::to_string),
        };
        for _ in 0..n {
            mesh.add_site();
        }
        mesh
    }

    /// Starts one more site (not peered); returns its index.
    pub fn add_site(&mut self) -> usize {
        self.add_site_with(&[])
    }

    /// [`Mesh::add_site`] with more controller flags.
    pub fn add_site_with(&mut self, flags: &[&str]) -> usize {
        let i = self.sites.len();
        assert!(i < 24, "the WAN plan has room for 24 sites");
        let id = format!("s{}", i + 1);
        let ip = |host: u8| format!("192.168.78.{}", 10 * (i + 1) as u8 + host);
        let (ctl_ip, gw_ip, node_ip) = (ip(1), ip(2), ip(3));
        let lab = &mut self.lab;
        let [ctl, gw, node, wl] = ["c", "g", "n", "w"].map(|h| lab.host(&format!("{h}{}", i + 1)));
        for (ns, addr) in [(&ctl, &ctl_ip), (&gw, &gw_ip), (&node, &node_ip)] {
            lab.plug(ns, &format!("{addr}/24"));
        }
        // The workload: a namespace behind the node, in its declared subnet.
        let prefix = self.pod.rsplit_once(".0.0/").expect("a /16 such as 10.1.0.0/16").0;
        let (subnet, workload) = (format!("{prefix}.0.0/{}", self.node_len), format!("{prefix}.0.10"));
        lab.workload(&node, &wl, &format!("{prefix}.0"));
        if self.node_len < 24 {
            for (ns, cmd) in [
                (&node, format!("ip addr add {prefix}.1.1/24 dev wl0")),
                (&wl, format!("ip addr add {prefix}.1.10/24 dev eth0")),
            ] {
                crate::netns::must(lab.exec(ns, &["sh", "-c", &cmd]), &cmd);
            }
        }
        lab.spawn(
            &wl,
            &bin("weft-echo"),
            &["serve", "--port", &ECHO_PORT.to_string(), "--name", &id],
            &self.dir.path().join(format!("{id}-echo.log")),
        );
        let mut gateway = AgentSpec::gateway("gw", &gw, &gw_ip);
        gateway.own_host = true;
        let mut controller = ControllerSpec::new(&id)
            .data_dir(&self.dir.path().join(&id))
            .log(&self.dir.path().join(format!("{id}-controller.log")))
            .pod(&self.pod)
            .flag("--node-prefix-len", &self.node_len.to_string())
            .flags(flags);
        if let Some(v6) = &self.pod_v6 {
            controller = controller.pod(v6);
        }
        let site = lab.site(&SiteSpec {
            controller,
            ctl: ctl.clone(),
            ctl_ip,
            agents: vec![gateway, AgentSpec::node("node", &node, &node_ip, &subnet)],
            dir: self.dir.path().to_path_buf(),
            prefix: id.clone(),
            resync: "1s".to_string(),
            agent_metrics: false,
        });
        let (target, gateway) = (site.target, site.agents[0]);
        // Dual stack: the workload's IPv6 address in its node's /64.
        let workload_v6 = self.pod_v6.is_some().then(|| {
            let net: ipnet::Ipv6Net = eventually("the node's IPv6 subnet", Duration::from_secs(20), || {
                let nodes = weftctl_json(&target, &["nodes"]);
                nodes["nodes"][0]["subnet_v6"].as_str()?.parse().ok()
            });
            let base = u128::from(net.network());
            let (gw6, addr) = (
                std::net::Ipv6Addr::from(base + 1),
                std::net::Ipv6Addr::from(base + 0x10),
            );
            for (ns, cmd) in [
                (
                    &node,
                    format!("ip addr add {gw6}/64 dev wl0 nodad && sysctl -qw net.ipv6.conf.all.forwarding=1"),
                ),
                (
                    &wl,
                    format!("ip addr add {addr}/64 dev eth0 nodad && ip -6 route add default via {gw6}"),
                ),
            ] {
                crate::netns::must(self.lab.exec(ns, &["sh", "-c", &cmd]), &cmd);
            }
            addr.to_string()
        });
        self.sites.push(MeshSite {
            id,
            target,
            ctl,
            gw,
            node,
            wl,
            gateway,
            workload,
            workload_v6,
        });
        i
    }

    /// Peers sites `a` and `b` (a token from `b`, redeemed at `a`) and
    /// waits until both gateways report the tunnel up.
    pub fn peer(&self, a: usize, b: usize) {
        self.peer_with(a, b, &[]);
    }

    /// [`Mesh::peer`] with more `weftctl peering create` flags at `a`.
    pub fn peer_with(&self, a: usize, b: usize, flags: &[&str]) {
        let (sa, sb) = (&self.sites[a], &self.sites[b]);
        let token = weftctl_json(&sb.target, &["peering", "token"])["token"]
            .as_str()
            .unwrap()
            .to_string();
        let mut args = vec!["peering", "create", "--token", &token];
        args.extend_from_slice(flags);
        weftctl_json(&sa.target, &args);
        for (s, peer) in [(sa, sb), (sb, sa)] {
            eventually(
                &format!("{}'s tunnel to {} up", s.id, peer.id),
                Duration::from_secs(30),
                || self.peering(s, &peer.id)?["tunnel"]["up"].as_bool().filter(|up| *up),
            );
        }
    }

    /// Peers every pair of `sites` without waiting for the tunnels, then
    /// watches every peering on every site (every 50 ms) until all show
    /// `connected`, and at once asks, from each site's workload, each
    /// other's, all at the same time (one try each, `ask` giving up after
    /// `first_try`): a user who sees `connected` must find the path
    /// working. What it saw.
    pub fn connect_all_then_ask(&self, sites: &[usize], first_try: Duration, limit: Duration) -> Connected {
        for (k, &a) in sites.iter().enumerate() {
            for &b in &sites[k + 1..] {
                let token = weftctl_json(&self.sites[b].target, &["peering", "token"])["token"]
                    .as_str()
                    .unwrap()
                    .to_string();
                weftctl_json(&self.sites[a].target, &["peering", "create", "--token", &token]);
            }
        }
        let mut out = Connected::default();
        let started = std::time::Instant::now();
        let views = loop {
            assert!(
                started.elapsed() < limit,
                "not every peering connected within {limit:?}; waiting for: {:?}",
                out.waiting_for
            );
            let mut all = true;
            let mut views = std::collections::HashMap::new();
            for &a in sites {
                let ps = weftctl_json(&self.sites[a].target, &["peerings"]);
                for &b in sites.iter().filter(|b| **b != a) {
                    let p = ps["peerings"]
                        .as_array()
                        .and_then(|v| v.iter().find(|p| p["site_id"] == self.sites[b].id.as_str()));
                    let Some(p) = p else {
                        all = false;
                        continue;
                    };
                    let state = p["state"].as_str().unwrap_or_default().to_string();
                    if state != "connected" {
                        all = false;
                    }
                    if state == "connecting" {
                        out.connecting_seen += 1;
                        for w in p["waiting_for"].as_array().into_iter().flatten() {
                            let w = w.as_str().unwrap_or_default().to_string();
                            if !out.waiting_for.contains(&w) {
                                out.waiting_for.push(w);
                            }
                        }
                    }
                    views.insert((a, b), p.clone());
                }
            }
            if all {
                break views;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        out.connected_after = started.elapsed();
        // All at once: each must be answered within `first_try` of every
        // peering showing connected (its timeout counts from its connect,
        // not from its process's start).
        let at = std::time::Instant::now();
        let mut pairs = Vec::new();
        for &a in sites {
            for &b in sites.iter().filter(|b| **b != a) {
                let p = &views[&(a, b)];
                let addr =
                    workload_in_view(p, &self.sites[b].workload).unwrap_or_else(|| panic!("no workload view in {p}"));
                pairs.push((a, b, format!("{addr}:{ECHO_PORT}")));
            }
        }
        let timeout = format!("{}ms", first_try.as_millis());
        out.asks = std::thread::scope(|scope| {
            let asks: Vec<_> = pairs
                .iter()
                .map(|(a, b, target)| {
                    let (timeout, at) = (&timeout, &at);
                    scope.spawn(move || {
                        let o = crate::netns::exec(
                            &self.sites[*a].wl,
                            &[bin("weft-echo").to_str().unwrap(), "ask", target, "--timeout", timeout],
                        );
                        let answer = crate::stdout(&o);
                        let want = format!("SITE {} ", self.sites[*b].id);
                        (
                            format!("{}->{}", self.sites[*a].id, self.sites[*b].id),
                            at.elapsed(),
                            if o.status.success() && answer.contains(&want) {
                                Ok(answer.trim().to_string())
                            } else {
                                Err(format!("{} {}", answer.trim(), crate::stderr(&o).trim()))
                            },
                        )
                    })
                })
                .collect();
            asks.into_iter().map(|h| h.join().unwrap()).collect()
        });
        out
    }

    /// Every pair of `sites` peered.
    pub fn peer_all(&self, sites: &[usize]) {
        for (k, &a) in sites.iter().enumerate() {
            for &b in &sites[k + 1..] {
                self.peer(a, b);
            }
        }
    }

    /// Deletes the peering of `a` with `b` at `a`, and waits until `b` has
    /// removed its side too.
    pub fn unpeer(&self, a: usize, b: usize) {
        let (sa, sb) = (&self.sites[a], &self.sites[b]);
        let o = crate::run(std::process::Command::new(bin("weftctl")).args([
            "--controller",
            &sa.target,
            "peering",
            "delete",
            &sb.id,
        ]));
        assert!(o.status.success(), "{}", crate::stderr(&o));
        eventually(&format!("{} forgets {}", sb.id, sa.id), Duration::from_secs(20), || {
            self.peering(sb, &sa.id).is_none().then_some(())
        });
    }

    /// Site `s`'s peering with `peer` as `weftctl peerings` shows it.
    pub fn peering(&self, s: &MeshSite, peer: &str) -> Option<serde_json::Value> {
        weftctl_json(&s.target, &["peerings"])["peerings"]
            .as_array()?
            .iter()
            .find(|p| p["site_id"] == peer)
            .cloned()
    }

    /// Site `to`'s workload address as site `from` addresses it (its local
    /// view), or None while `from` has no view of `to`.
    pub fn address(&self, from: usize, to: usize) -> Option<String> {
        let p = self.peering(&self.sites[from], &self.sites[to].id)?;
        workload_in_view(&p, &self.sites[to].workload)
    }

    /// Site `to`'s local view of site `from`'s workload CIDR.
    pub fn view_of(&self, to: usize, from: usize) -> Option<ipnet::Ipv4Net> {
        let p = self.peering(&self.sites[to], &self.sites[from].id)?;
        let v = p["views"].as_array()?.iter().find(|v| v["kind"] == "workload")?;
        v["local_cidr"].as_str()?.parse().ok()
    }

    /// Asks, over TCP from site `from`'s workload to `addr`, who answers:
    /// the answering site's id and the address it saw the client at.
    pub fn ask_at(&self, from: usize, addr: &str) -> Result<(String, String), String> {
        self.ask_port(from, addr, ECHO_PORT)
    }

    /// [`Mesh::ask_at`] on another port.
    pub fn ask_port(&self, from: usize, addr: &str, port: u16) -> Result<(String, String), String> {
        let target = format!("{addr}:{port}");
        let o = crate::netns::exec(
            &self.sites[from].wl,
            &[bin("weft-echo").to_str().unwrap(), "ask", &target, "--timeout", "2s"],
        );
        if !o.status.success() {
            return Err(crate::stderr(&o).trim().to_string());
        }
        let line = crate::stdout(&o);
        match line.split_whitespace().collect::<Vec<_>>()[..] {
            ["SITE", site, "FROM", seen] => Ok((site.to_string(), seen.to_string())),
            _ => Err(format!("unexpected answer {line:?}")),
        }
    }

    /// Does site `from`'s workload reach site `to`'s workload through
    /// `from`'s local view, is it really `to` that answers, and does `to`
    /// see the client inside its own view of `from`? Ok with the address
    /// the server saw; Err saying what failed.
    pub fn reaches(&self, from: usize, to: usize) -> Result<String, String> {
        let (f, t) = (&self.sites[from], &self.sites[to]);
        let addr = self
            .address(from, to)
            .ok_or_else(|| format!("{} has no view of {}", f.id, t.id))?;
        let (site, seen) = self.ask_at(from, &addr)?;
        if site != t.id {
            return Err(format!("{} asked {} at {addr} and {site} answered", f.id, t.id));
        }
        let view = self
            .view_of(to, from)
            .ok_or_else(|| format!("{} has no view of {}", t.id, f.id))?;
        match seen.parse::<std::net::Ipv4Addr>() {
            Ok(ip) if view.contains(&ip) => Ok(seen),
            _ => Err(format!(
                "{} saw {}'s client at {seen}, outside its view {view} of {}",
                t.id, f.id, f.id
            )),
        }
    }

    /// The packets of nft counter `name` in site `site`'s namespace for its
    /// peering with `peer` (table `inet weft`); None without that counter.
    pub fn nft_counter(&mut self, site: usize, peer: &str, name: &str) -> Option<u64> {
        let ns = weft_controller::render::peering_namespace(&self.sites[site].id, peer);
        let pid = self.gateway_pid(site);
        let o = crate::netns::exec_beside(pid, &ns, &["nft", "-j", "list", "counters", "table", "inet", "weft"]);
        assert!(o.status.success(), "nft in {ns}: {}", crate::stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["nftables"]
            .as_array()?
            .iter()
            .find(|x| x["counter"]["name"] == name)
            .and_then(|x| x["counter"]["packets"].as_u64())
    }

    /// The gateway agent of site `i`'s process id (to enter its namespaces
    /// with [`crate::netns::exec_beside`]).
    pub fn gateway_pid(&mut self, i: usize) -> u32 {
        let g = self.sites[i].gateway;
        self.lab.proc(g).child.as_ref().expect("the gateway runs").id()
    }
}

/// Address `workload` of a peer as a peering (`weftctl peerings` JSON)
/// addresses it: through its local view of the peer's workload CIDR.
fn workload_in_view(peering: &serde_json::Value, workload: &str) -> Option<String> {
    let v = peering["views"].as_array()?.iter().find(|v| v["kind"] == "workload")?;
    let (real, local): (ipnet::Ipv4Net, ipnet::Ipv4Net) = (
        v["real_cidr"].as_str()?.parse().ok()?,
        v["local_cidr"].as_str()?.parse().ok()?,
    );
    let a = weft_controller::ipam::translate(workload.parse().ok()?, real, local)?;
    Some(a.to_string())
}
