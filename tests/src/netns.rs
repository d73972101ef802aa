//! Test hosts as network namespaces. A [`Lab`] makes namespaces named
//! `weft-<tag>-<n>-<host>`, joins them on a bridged LAN, runs processes in
//! them, and on drop — also when a test panics — kills every process it
//! started and deletes every namespace it made.

use std::path::Path;
use std::process::{Command, Output};

use crate::{Proc, run};

/// Runs `args` in namespace `ns` (`ip netns exec`) and returns its output;
/// [`Lab::exec`] without needing the lab.
pub fn exec(ns: &str, args: &[&str]) -> Output {
    run(Command::new("ip").args(["netns", "exec", ns]).args(args))
}

/// Runs `args` in network namespace `netns` as seen by process `pid`
/// (one started with [`Lab::spawn_own_host`]): in its mount namespace, so
/// the names under its private /run/netns resolve.
pub fn exec_beside(pid: u32, netns: &str, args: &[&str]) -> Output {
    run(Command::new("nsenter")
        .arg(format!("--mount=/proc/{pid}/ns/mnt"))
        .args(["ip", "netns", "exec", netns])
        .args(args))
}

/// Whether this process may create namespaces (root). Outside CI a test
/// without it is skipped with a note; under CI it fails.
pub fn require_root() -> bool {
    let root = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false);
    // Tests that need root are #[ignore]d (a run without root lists them as
    // ignored, never as passed); one run anyway without root fails here.
    assert!(
        root,
        "NOT RUN: this test needs root (CAP_NET_ADMIN) to build network namespaces; run tests/run.sh as root"
    );
    root
}

/// How a lab NAT router maps a host's UDP source port to the outside.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Nat {
    /// `masquerade`: the host's port kept when free, one mapping per
    /// socket whatever the destination (endpoint-independent, as a home
    /// router).
    EndpointIndependent,
    /// `masquerade random`: a new port per destination (endpoint-dependent
    /// or "symmetric", as carrier-grade NAT and many firewalls).
    EndpointDependent,
    /// `masquerade` with no firewall: a NAT instance as clouds have them.
    /// What arrives unasked from the WAN is delivered to the router itself
    /// (nothing listens: ICMP unreachable), and conntrack keeps an entry
    /// for it, which a later mapping of the same ports then collides with.
    Bare,
}

/// A private LAN behind a NAT router ([`Lab::nat_lan`]).
#[derive(Clone, Debug)]
pub struct NatLan {
    /// The router's namespace and the private LAN's bridge namespace.
    pub router: String,
    pub bridge: String,
    /// The LAN's first three octets ("192.168.10"), or its IPv6 /64's
    /// first four groups and "::" ("fd00:10::").
    pub prefix: String,
    /// The router's address on the WAN.
    pub wan: String,
}

impl NatLan {
    /// Host `host`'s address on the LAN.
    pub fn ip(&self, host: u8) -> String {
        if self.prefix.ends_with(':') {
            format!("{}{host}", self.prefix)
        } else {
            format!("{}.{host}", self.prefix)
        }
    }
}

/// How a process was started: namespace, program, arguments, log.
type Started = (String, std::path::PathBuf, Vec<String>, std::path::PathBuf);

pub struct Lab {
    prefix: String,
    namespaces: Vec<String>,
    procs: Vec<Proc>,
    /// Its controllers ([`Lab::controller`]), in order of start.
    pub(crate) controllers: Vec<crate::controller::Controller>,
    /// How each process was started, to start it again.
    commands: Vec<Started>,
    /// Each plugged host namespace: its bridge's namespace and its port there.
    lan_ports: Vec<(String, String, String)>,
}

/// Returns `o`, or panics with its stderr when the command failed.
pub fn must(o: Output, what: &str) -> Output {
    assert!(
        o.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

impl Lab {
    pub fn new(tag: &str) -> Lab {
        // The tests of one binary share a process id: a count per tag keeps
        // two labs of one tag (a test run twice, two tests on one helper)
        // apart.
        static USED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
        let mut used = USED.lock().unwrap_or_else(|e| e.into_inner());
        let n = used.iter().filter(|t| *t == tag).count();
        used.push(tag.to_string());
        let pid = std::process::id() % 100_000;
        let prefix = if n == 0 {
            format!("weft-{tag}-{pid}")
        } else {
            format!("weft-{tag}-{pid}-{n}")
        };
        Lab {
            prefix,
            namespaces: Vec::new(),
            procs: Vec::new(),
            controllers: Vec::new(),
            commands: Vec::new(),
            lan_ports: Vec::new(),
        }
    }

    /// The full name of host `name`.
    pub fn ns(&self, name: &str) -> String {
        format!("{}-{name}", self.prefix)
    }

    /// Creates a host (namespace) with loopback up.
    pub fn host(&mut self, name: &str) -> String {
        let ns = self.ns(name);
        must(run(Command::new("ip").args(["netns", "add", &ns])), "ip netns add");
        self.namespaces.push(ns.clone());
        must(
            run(Command::new("ip").args(["-n", &ns, "link", "set", "lo", "up"])),
            "lo up",
        );
        ns
    }

    /// Two new hosts `x` (10.99.0.1/24) and `y` (10.99.0.2/24) joined by
    /// a veth pair (`v0` in each); their namespaces.
    pub fn veth_pair(&mut self, x: &str, y: &str) -> (String, String) {
        let (nx, ny) = (self.host(x), self.host(y));
        must(
            self.exec(
                &nx,
                &[
                    "ip", "link", "add", "v0", "type", "veth", "peer", "name", "v0", "netns", &ny,
                ],
            ),
            "veth",
        );
        for (ns, ip) in [(&nx, "10.99.0.1/24"), (&ny, "10.99.0.2/24")] {
            must(self.exec(ns, &["ip", "addr", "add", ip, "dev", "v0"]), "addr");
            must(self.exec(ns, &["ip", "link", "set", "v0", "up"]), "up");
        }
        (nx, ny)
    }

    /// Creates the LAN (a bridge in its own namespace): the WAN every
    /// site's public hosts share.
    pub fn lan(&mut self) -> String {
        self.bridge("lan")
    }

    /// A switch: a bridge `br0` in a namespace of its own, `name`.
    pub fn bridge(&mut self, name: &str) -> String {
        let ns = self.host(name);
        must(
            run(Command::new("ip").args(["-n", &ns, "link", "add", "br0", "type", "bridge"])),
            "bridge",
        );
        must(
            run(Command::new("ip").args(["-n", &ns, "link", "set", "br0", "up"])),
            "bridge up",
        );
        // A bridge stands for a switch: where the host has br_netfilter
        // loaded (Docker loads it), the namespace's copy of its sysctls
        // starts at 1 and would run every frame through conntrack and the
        // firewall, a cost no real underlay has.
        for family in ["iptables", "ip6tables", "arptables"] {
            let _ = self.exec(
                &ns,
                &["sysctl", "-qw", &format!("net.bridge.bridge-nf-call-{family}=0")],
            );
        }
        ns
    }

    /// Plugs host `ns` into the LAN with `eth0` = `cidr`.
    pub fn plug(&mut self, ns: &str, cidr: &str) {
        let lan = self.ns("lan");
        self.plug_into(&lan, ns, "eth0", cidr);
    }

    /// Plugs host `ns` into the WAN with `eth0` = `cidr`, but behind the
    /// lab's internet router (host `core`, made on first use): a veth of
    /// its own to `core`, which routes `cidr`'s address there and answers
    /// ARP for it on the WAN (and for the WAN on it), so every address
    /// stays where it was while each datagram between `ns` and the WAN
    /// crosses one real router hop (TTL decremented, ICMP time exceeded
    /// when it runs out).
    pub fn plug_beyond_hop(&mut self, ns: &str, cidr: &str) {
        let core = self.ns("core");
        if !self.namespaces.contains(&core) {
            self.host("core");
            self.plug(&core, "192.168.78.254/24");
            for sysctl in [
                "net.ipv4.ip_forward=1",
                "net.ipv4.conf.all.proxy_arp=1",
                "net.ipv4.conf.eth0.proxy_arp=1",
            ] {
                must(self.exec(&core, &["sysctl", "-qw", sysctl]), "the internet router");
            }
        }
        let dev = format!("h{}", self.lan_ports.len());
        self.lan_ports.push((ns.to_string(), core.clone(), dev.clone()));
        must(
            run(Command::new("ip").args([
                "-n", &core, "link", "add", &dev, "type", "veth", "peer", "name", "eth0", "netns", ns,
            ])),
            "veth to the internet router",
        );
        let addr = cidr.split('/').next().unwrap();
        for args in [
            vec!["-n", &core, "link", "set", &dev, "up"],
            vec!["-n", &core, "route", "add", &format!("{addr}/32"), "dev", &dev],
            vec!["-n", ns, "addr", "add", cidr, "dev", "eth0"],
            vec!["-n", ns, "link", "set", "eth0", "up"],
        ] {
            must(run(Command::new("ip").args(&args)), "a host beyond the internet router");
        }
        must(
            self.exec(&core, &["sysctl", "-qw", &format!("net.ipv4.conf.{dev}.proxy_arp=1")]),
            "proxy ARP",
        );
    }

    /// Plugs host `ns` into the bridge in namespace `bridge` with interface
    /// `dev` = `cidr`.
    pub fn plug_into(&mut self, bridge: &str, ns: &str, dev: &str, cidr: &str) {
        let port = format!("p{}", self.lan_ports.len());
        self.lan_ports.push((ns.to_string(), bridge.to_string(), port.clone()));
        must(
            run(Command::new("ip").args([
                "-n", bridge, "link", "add", &port, "type", "veth", "peer", "name", dev, "netns", ns,
            ])),
            "veth",
        );
        must(
            run(Command::new("ip").args(["-n", bridge, "link", "set", &port, "master", "br0", "up"])),
            "port up",
        );
        // An IPv6 address is usable at once (no duplicate detection).
        let nodad: &[&str] = if cidr.contains(':') { &["nodad"] } else { &[] };
        must(
            run(Command::new("ip")
                .args(["-n", ns, "addr", "add", cidr, "dev", dev])
                .args(nodad)),
            "addr",
        );
        must(
            run(Command::new("ip").args(["-n", ns, "link", "set", dev, "up"])),
            "link up",
        );
    }

    /// A private LAN `{prefix}.0/24` behind a NAT router `name`: the
    /// router's `eth0` is `wan_cidr` on the LAN (the WAN), its `lan0` is
    /// `{prefix}.1` on a bridge of its own, and it masquerades what leaves
    /// by the WAN as `nat` says. Nothing on the WAN has a route to the
    /// private LAN. Plug hosts in with [`Lab::plug_behind`].
    pub fn nat_lan(&mut self, name: &str, wan_cidr: &str, prefix: &str, nat: Nat) -> NatLan {
        self.nat_lan_at(name, wan_cidr, prefix, nat, false)
    }

    /// [`Lab::nat_lan`] with the router one router hop away from the rest
    /// of the WAN ([`Lab::plug_beyond_hop`]), as two sites on the internet
    /// are: a datagram between it and another site's router crosses a
    /// router that decrements its TTL.
    pub fn nat_lan_beyond_hop(&mut self, name: &str, wan_cidr: &str, prefix: &str, nat: Nat) -> NatLan {
        self.nat_lan_at(name, wan_cidr, prefix, nat, true)
    }

    fn nat_lan_at(&mut self, name: &str, wan_cidr: &str, prefix: &str, nat: Nat, hop: bool) -> NatLan {
        let bridge = self.bridge(&format!("{name}-lan"));
        let router = self.host(name);
        if hop {
            self.plug_beyond_hop(&router, wan_cidr);
        } else {
            self.plug(&router, wan_cidr);
        }
        self.plug_into(&bridge, &router, "lan0", &format!("{prefix}.1/24"));
        must(
            self.exec(&router, &["sysctl", "-qw", "net.ipv4.ip_forward=1"]),
            "forwarding",
        );
        let how = match nat {
            Nat::EndpointIndependent | Nat::Bare => "masquerade",
            Nat::EndpointDependent => "masquerade random",
        };
        // A home router's firewall too (all but `Bare`): from the WAN, only
        // answers to what went out get in (to the router itself or through
        // it), so an unasked datagram leaves no conntrack entry behind.
        let firewall = if nat == Nat::Bare {
            String::new()
        } else {
            "  chain input {\n    type filter hook input priority 0;\n    \
             ct state established,related accept\n    iifname \"eth0\" counter drop\n  }\n  \
             chain forward {\n    type filter hook forward priority 0;\n    \
             ct state established,related accept\n    iifname \"eth0\" counter drop\n  }\n"
                .to_string()
        };
        // Over several lines: on one, nft fails to parse `masquerade random; } }`.
        let rules = format!(
            "table ip natlab {{\n  chain post {{\n    type nat hook postrouting priority 100;\n    \
             oifname \"eth0\" ip saddr {prefix}.0/24 counter {how}\n  }}\n{firewall}}}\n"
        );
        self.nft(&router, &rules, "the NAT rules");
        NatLan {
            router,
            bridge,
            prefix: prefix.to_string(),
            wan: wan_cidr.split('/').next().unwrap().to_string(),
        }
    }

    /// An IPv6 LAN `{prefix}/64` behind router `name`, as home routers
    /// have them: no NAT66 (the LAN's addresses are global, routed to the
    /// router's WAN address `wan_cidr` by [`Lab::route_to`]), and a
    /// stateful firewall: from the WAN, only answers to what went out get
    /// in (and ICMPv6, which neighbour discovery needs). Plug hosts in
    /// with [`Lab::plug_behind`].
    pub fn firewall_lan6(&mut self, name: &str, wan_cidr: &str, prefix: &str) -> NatLan {
        let bridge = self.bridge(&format!("{name}-lan"));
        let router = self.host(name);
        self.plug(&router, wan_cidr);
        self.plug_into(&bridge, &router, "lan0", &format!("{prefix}1/64"));
        must(
            self.exec(&router, &["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"]),
            "forwarding",
        );
        let rules = "table ip6 fwlab {\n  \
                     chain input {\n    type filter hook input priority 0;\n    \
                     ct state established,related accept\n    meta l4proto ipv6-icmp accept\n    \
                     iifname \"eth0\" counter drop\n  }\n  \
                     chain forward {\n    type filter hook forward priority 0;\n    \
                     ct state established,related accept\n    iifname \"eth0\" counter drop\n  }\n}\n";
        self.nft(&router, rules, "the IPv6 firewall");
        NatLan {
            router,
            bridge,
            prefix: prefix.to_string(),
            wan: wan_cidr.split('/').next().unwrap().to_string(),
        }
    }

    /// Host `ns` on the WAN routes `lan`'s IPv6 /64 to its router.
    pub fn route_to(&self, ns: &str, lan: &NatLan) {
        must(
            self.exec(
                ns,
                &[
                    "ip",
                    "-6",
                    "route",
                    "add",
                    &format!("{}/64", lan.prefix),
                    "via",
                    &lan.wan,
                ],
            ),
            "a route to a LAN",
        );
    }

    /// Loads nftables `rules` in namespace `ns`.
    fn nft(&self, ns: &str, rules: &str, what: &str) {
        let mut nft = Command::new("ip");
        nft.args(["netns", "exec", ns, "nft", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
        let mut child = nft.spawn().expect("nft");
        {
            use std::io::Write;
            child.stdin.take().unwrap().write_all(rules.as_bytes()).unwrap();
        }
        must(child.wait_with_output().unwrap(), what);
    }

    /// Router `lan` lets no UDP out to the WAN (`blocked`), or lets it
    /// again, as networks that pass only TCP do. Counted (nft table `ip
    /// weftudp`, both families).
    pub fn block_udp(&self, lan: &NatLan, blocked: bool) {
        let _ = self.exec(&lan.router, &["nft", "delete", "table", "inet", "weftudp"]);
        if !blocked {
            return;
        }
        let rules = "table inet weftudp {\n  chain forward {\n    type filter hook forward priority -10;\n    \
                     oifname \"eth0\" meta l4proto udp counter drop\n  }\n}\n";
        self.nft(&lan.router, rules, "blocking UDP");
    }

    /// How many connections (conntrack entries) router `lan` has
    /// translated so far: its NAT rule's packet counter, which sees each
    /// connection's first packet.
    pub fn nat_count(&self, lan: &NatLan) -> u64 {
        let o = must(
            self.exec(&lan.router, &["nft", "list", "chain", "ip", "natlab", "post"]),
            "the NAT rules",
        );
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        text.split("packets ")
            .nth(1)
            .and_then(|t| t.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no counter in the NAT rule: {text}"))
    }

    /// Plugs host `ns` into private LAN `lan` at `{prefix}.{host}`, its
    /// default route through the NAT router; that address.
    pub fn plug_behind(&mut self, lan: &NatLan, ns: &str, host: u8) -> String {
        let ip = lan.ip(host);
        let len = if ip.contains(':') { 64 } else { 24 };
        self.plug_into(&lan.bridge, ns, "eth0", &format!("{ip}/{len}"));
        must(
            self.exec(ns, &["ip", "route", "add", "default", "via", &lan.ip(1)]),
            "default route",
        );
        ip
    }

    /// Sets host `ns`'s port on the LAN (the switch side of its link) up or
    /// down: the host's own interface stays as it was, as when a cable or a
    /// WAN link fails.
    pub fn lan_link(&self, ns: &str, up: bool) {
        let (_, bridge, port) = self.lan_ports.iter().find(|(n, _, _)| n == ns).expect("not plugged");
        must(
            run(Command::new("ip").args(["-n", bridge, "link", "set", port, if up { "up" } else { "down" }])),
            "LAN port",
        );
    }

    /// Runs a command in host `ns` and waits for it.
    pub fn exec(&self, ns: &str, args: &[&str]) -> Output {
        exec(ns, args)
    }

    /// Starts a long-running process in host `ns`, logging to `log`. It
    /// enters only the network namespace (nsenter, unlike `ip netns exec`,
    /// keeps the mount namespace), so namespaces it creates under /run/netns
    /// are visible to the test and cleaned up by it.
    pub fn spawn(&mut self, ns: &str, program: &Path, args: &[&str], log: &Path) -> usize {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{ns}")).arg(program).args(args);
        for v in ["WEFT_CONTROLLER", "WEFT_TOKEN", "WEFT_CONFIG"] {
            cmd.env_remove(v);
        }
        self.procs.push(Proc::spawn(&mut cmd, log));
        self.commands.push((
            ns.to_string(),
            program.to_path_buf(),
            args.iter().map(|a| a.to_string()).collect(),
            log.to_path_buf(),
        ));
        self.procs.len() - 1
    }

    /// Starts `program` in host `ns` as on a machine of its own: besides
    /// the network namespace it gets a mount namespace with a private
    /// /run/netns, so the namespaces it creates (a gateway's peering
    /// namespaces) are its own, invisible to other hosts, and go away when
    /// it ends. Reach them with [`exec_beside`].
    pub fn spawn_own_host(&mut self, ns: &str, program: &Path, args: &[&str], log: &Path) -> usize {
        let mut wrapped: Vec<String> = [
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount -t tmpfs weft /run/netns && exec \"$0\" \"$@\"",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        wrapped.push(program.display().to_string());
        wrapped.extend(args.iter().map(|a| a.to_string()));
        let refs: Vec<&str> = wrapped.iter().map(String::as_str).collect();
        self.spawn(ns, Path::new("/usr/bin/unshare"), &refs, log)
    }

    /// Starts a real etcd in host `ns` on its loopback (client port 2379),
    /// data under `data`, and waits until it is healthy; its process index.
    /// None when etcd is not installed (outside CI; under CI that fails).
    pub fn spawn_etcd(&mut self, ns: &str, data: &Path) -> Option<usize> {
        self.spawn_etcd_at(ns, data, "127.0.0.1")
    }

    /// [`Lab::spawn_etcd`] serving clients on `ip` (an address of host `ns`),
    /// for controllers on other hosts.
    pub fn spawn_etcd_at(&mut self, ns: &str, data: &Path, ip: &str) -> Option<usize> {
        let etcd = crate::require_tool("etcd")?;
        let client = format!("http://{ip}:2379");
        let i = self.spawn(
            ns,
            &etcd,
            &[
                "--name",
                "e",
                "--data-dir",
                data.to_str().unwrap(),
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
                "--listen-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-advertise-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-cluster",
                "e=http://127.0.0.1:2380",
            ],
            &data.with_extension("log"),
        );
        crate::eventually("etcd", std::time::Duration::from_secs(20), || {
            self.exec(ns, &["etcdctl", "--endpoints", &client, "endpoint", "health"])
                .status
                .success()
                .then_some(())
        });
        Some(i)
    }

    /// Starts process `i` again, as it was started (logging to a new file
    /// beside the old one).
    pub fn respawn(&mut self, i: usize) {
        let (ns, program, args, log) = self.commands[i].clone();
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{ns}")).arg(&program).args(&args);
        for v in ["WEFT_CONTROLLER", "WEFT_TOKEN", "WEFT_CONFIG"] {
            cmd.env_remove(v);
        }
        self.procs[i] = Proc::spawn(&mut cmd, &log.with_extension("restarted.log"));
    }

    /// Sets `flag`'s value in process `i`'s arguments (appending the flag
    /// when it has none), for its next [`Lab::respawn`].
    pub fn set_arg(&mut self, i: usize, flag: &str, value: &str) {
        let args = &mut self.commands[i].2;
        match args.iter().position(|a| a == flag) {
            Some(p) if p + 1 < args.len() => args[p + 1] = value.to_string(),
            _ => args.extend([flag.to_string(), value.to_string()]),
        }
    }

    /// Runs `program` instead for process `i`'s next [`Lab::respawn`]: an
    /// upgrade to another release's binary.
    pub fn set_program(&mut self, i: usize, program: &Path) {
        self.commands[i].1 = program.to_path_buf();
    }

    /// Takes responsibility for a namespace something else in the test
    /// creates (e.g. a gateway agent's peering namespace): deleted on drop.
    pub fn adopt(&mut self, ns: &str) {
        self.namespaces.push(ns.to_string());
    }

    pub fn proc(&mut self, i: usize) -> &mut Proc {
        &mut self.procs[i]
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if std::thread::panicking() && std::env::var_os("WEFT_LAB_LOGS").is_some() {
            // WEFT_LAB_LOGS=1: what each process of a failed lab said last.
            for p in self.procs.iter() {
                let text = p.log_text();
                let tail: Vec<&str> = text.lines().rev().take(40).collect();
                eprintln!("==== {} (last {} lines)", p.log.display(), tail.len());
                for l in tail.iter().rev() {
                    eprintln!("{l}");
                }
            }
        }
        self.procs.clear(); // kills them
        self.controllers.clear();
        for ns in self.namespaces.drain(..).rev() {
            let _ = Command::new("ip")
                .args(["netns", "del", &ns])
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}
