//! The one lab builder. Every test and benchmark starts its controllers
//! with a [`ControllerSpec`] (see [`crate::controller`]), on this
//! machine's loopback or on a host of a namespace [`Lab`]
//! ([`Lab::controller`]), and builds whole sites with a [`SiteSpec`]
//! ([`Lab::site`]): the controller on its host, its store, its gateways
//! (each optionally on a machine of its own with a private `/run/netns`)
//! and its nodes with their workloads. The same builder runs on the host
//! and inside the VM lane's guest.

use std::path::PathBuf;
use std::time::Duration;

use crate::controller::{Controller, ControllerSpec, Place};
use crate::netns::Lab;
use crate::{bin, eventually, weftctl_json};

/// Where every lab controller (9100) and agent (9101) serves Prometheus
/// metrics when asked to, on all addresses of its own namespace.
pub const CONTROLLER_METRICS_PORT: u16 = 9100;
pub const AGENT_METRICS_PORT: u16 = 9101;

/// One agent of a [`SiteSpec`].
#[derive(Clone, Debug)]
pub struct AgentSpec {
    /// "gateway" or "node".
    pub kind: &'static str,
    /// Its agent name (`--name`).
    pub name: String,
    /// The lab host it runs on, and its underlay address there.
    pub host: String,
    pub ip: String,
    /// A node's declared subnet (`--subnet`).
    pub subnet: Option<String>,
    /// On a machine of its own: a private /run/netns (see
    /// [`Lab::spawn_own_host`]).
    pub own_host: bool,
    /// More flags (e.g. `--wireguard userspace`).
    pub flags: Vec<String>,
    /// A gateway's `--endpoint` (`ip:51820`, `[ip]:51820` for IPv6);
    /// false: none, it only dials out (behind NAT).
    pub endpoint: bool,
    /// Where its binary is: another release's (see [`crate::prev_release`]);
    /// None: this workspace's.
    pub bins: Option<PathBuf>,
}

impl AgentSpec {
    /// A gateway on `host` at `ip`, its endpoint `ip:51820`.
    pub fn gateway(name: &str, host: &str, ip: &str) -> AgentSpec {
        AgentSpec {
            kind: "gateway",
            name: name.to_string(),
            host: host.to_string(),
            ip: ip.to_string(),
            subnet: None,
            own_host: false,
            flags: Vec::new(),
            endpoint: true,
            bins: None,
        }
    }

    /// A node on `host` at `ip` declaring `subnet`.
    pub fn node(name: &str, host: &str, ip: &str, subnet: &str) -> AgentSpec {
        AgentSpec {
            kind: "node",
            subnet: Some(subnet.to_string()),
            ..AgentSpec::gateway(name, host, ip)
        }
    }
}

/// A whole site on lab hosts that exist and are plugged into the WAN: its
/// controller on host `ctl` (listening on `ctl_ip` port 7443, an IPv4 or
/// an IPv6 address), then its agents,
/// enrolled with tokens made for them, in order.
#[derive(Clone, Debug)]
pub struct SiteSpec {
    pub controller: ControllerSpec,
    pub ctl: String,
    pub ctl_ip: String,
    pub agents: Vec<AgentSpec>,
    /// Where the agents keep their state and logs: `{dir}/{prefix}-{name}`
    /// (`{dir}/{name}` with no prefix).
    pub dir: PathBuf,
    pub prefix: String,
    /// Every agent's `--resync-interval`.
    pub resync: String,
    /// Every agent serves metrics on [`AGENT_METRICS_PORT`].
    pub agent_metrics: bool,
}

/// A site built by [`Lab::site`].
#[derive(Debug)]
pub struct Site {
    /// weftctl's target for its controller.
    pub target: String,
    /// Its controller's index ([`Lab::ctl`]).
    pub controller: usize,
    /// Each agent's process index in the lab, in the spec's order.
    pub agents: Vec<usize>,
}

impl SiteSpec {
    /// Where its controller listens (`[v6]:7443` for an IPv6 `ctl_ip`).
    pub fn listen(&self) -> std::net::SocketAddr {
        let ip: std::net::IpAddr = self.ctl_ip.parse().expect("ctl_ip is an IP address");
        std::net::SocketAddr::new(ip, 7443)
    }

    /// Where agent `name` keeps its state.
    pub fn state(&self, name: &str) -> PathBuf {
        if self.prefix.is_empty() {
            return self.dir.join(name);
        }
        self.dir.join(format!("{}-{name}", self.prefix))
    }
}

impl Lab {
    /// Starts a controller on lab host `host` and waits until it serves;
    /// weftctl's target for it. [`Lab::ctl`] reaches it by its order of
    /// start.
    pub fn controller(&mut self, host: &str, spec: ControllerSpec) -> String {
        let c = Controller::launched(spec, Place::Host(host.to_string()));
        let target = c.target();
        self.controllers.push(c);
        target
    }

    /// The `n`-th controller started in this lab.
    pub fn ctl(&mut self, n: usize) -> &mut Controller {
        &mut self.controllers[n]
    }

    /// Builds site `spec`: its controller, then each agent enrolled with a
    /// token of its own; waits until the site's first gateway reported its
    /// key.
    pub fn site(&mut self, spec: &SiteSpec) -> Site {
        let listen = spec.listen().to_string();
        let target = self.controller(&spec.ctl, spec.controller.clone().listen(&listen));
        let controller = self.controllers.len() - 1;
        let agents = spec.agents.iter().map(|a| self.agent(spec, &target, a)).collect();
        if spec.agents.iter().any(|a| a.kind == "gateway") {
            eventually("the gateway's key", Duration::from_secs(20), || {
                let g = weftctl_json(&target, &["gateways"]);
                g["gateways"][0]["public_key"]
                    .as_str()
                    .is_some_and(|k| !k.is_empty())
                    .then_some(())
            });
        }
        Site {
            target,
            controller,
            agents,
        }
    }

    /// Starts agent `a` of site `spec` (whose controller is at weftctl
    /// target `target`), enrolled with a token made for it; its process
    /// index.
    pub fn agent(&mut self, spec: &SiteSpec, target: &str, a: &AgentSpec) -> usize {
        let url = format!("https://{}", spec.listen());
        let state = spec.state(&a.name);
        let mut args = crate::enrolling_agent_args(target, a.kind, &a.name, &url, &a.ip, &state, &spec.resync);
        if spec.agent_metrics {
            args.extend(["--metrics-listen".to_string(), format!("0.0.0.0:{AGENT_METRICS_PORT}")]);
        }
        if a.kind == "gateway" && a.endpoint {
            let ip: std::net::IpAddr = a.ip.parse().expect("an agent's underlay address");
            args.extend([
                "--endpoint".to_string(),
                std::net::SocketAddr::new(ip, 51820).to_string(),
            ]);
        }
        if let Some(s) = &a.subnet {
            args.extend(["--subnet".to_string(), s.clone()]);
        }
        args.extend(a.flags.iter().cloned());
        let name = format!("weft-{}-agent", a.kind);
        let program = a.bins.as_ref().map_or_else(|| bin(&name), |d| d.join(&name));
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        // Not with_extension: a prefix such as an address has dots.
        let log = PathBuf::from(format!("{}.log", state.display()));
        if a.own_host {
            self.spawn_own_host(&a.host, &program, &refs, &log)
        } else {
            self.spawn(&a.host, &program, &refs, &log)
        }
    }

    /// A workload host `wl` behind node host `node`: a veth pair, the
    /// node's end `{prefix}.1/24` (it forwards), the workload's
    /// `{prefix}.10/24` with its default route through the node.
    pub fn workload(&self, node: &str, wl: &str, prefix: &str) {
        crate::netns::must(
            self.exec(
                node,
                &[
                    "ip", "link", "add", "wl0", "type", "veth", "peer", "name", "eth0", "netns", wl,
                ],
            ),
            "workload veth",
        );
        let sh = |ns: &str, cmd: &str| crate::netns::must(self.exec(ns, &["sh", "-c", cmd]), cmd);
        sh(
            node,
            &format!("ip addr add {prefix}.1/24 dev wl0 && ip link set wl0 up && sysctl -qw net.ipv4.ip_forward=1"),
        );
        sh(
            wl,
            &format!(
                "ip addr add {prefix}.10/24 dev eth0 && ip link set eth0 up && ip route add default via {prefix}.1"
            ),
        );
    }
}
