//! The flags every agent takes, and their validation. Each flag is also a
//! `WEFT_*` environment variable.

use std::path::PathBuf;

use clap::Args;

#[derive(Args, Debug, Clone)]
pub struct AgentArgs {
    /// Controller address(es), https://HOST:PORT; repeat or comma-separate for replicas.
    #[arg(
        long = "controller",
        env = "WEFT_CONTROLLER",
        value_delimiter = ',',
        required_unless_present = "teardown"
    )]
    pub controllers: Vec<String>,
    /// One-time enrollment token from `weftctl token create` (needed until the agent holds a certificate).
    #[arg(long, env = "WEFT_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// SHA-256 fingerprint of the site CA certificate (hex, colons allowed), to trust the controller on first contact.
    #[arg(long, env = "WEFT_CA_FINGERPRINT")]
    pub ca_fingerprint: Option<String>,
    /// The site CA certificate (PEM), instead of --ca-fingerprint.
    #[arg(long, env = "WEFT_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// Where the agent keeps its key, certificate and last desired state.
    #[arg(long, env = "WEFT_STATE_DIR", default_value = "/var/lib/weft-agent")]
    pub state_dir: PathBuf,
    /// This agent's name [default: the host name].
    #[arg(long, env = "WEFT_NAME")]
    pub name: Option<String>,
    /// Print what would change on the host and change nothing.
    #[arg(long, env = "WEFT_DRY_RUN")]
    pub dry_run: bool,
    /// How often the whole state is applied again, repairing drift (e.g. a
    /// route deleted by hand); 0 turns drift repair off. Each resync reads
    /// the whole host: on a slow host a short interval takes CPU that a
    /// failover's change then waits for.
    #[arg(long, env = "WEFT_RESYNC_INTERVAL", default_value = "30s")]
    pub resync_interval: humantime::Duration,
    /// With several controllers: how long a node connected to one other
    /// than its first choice waits (plus up to twice that, at random)
    /// before asking its first choice again, and moving back when it
    /// answers. Spreads a site's agents back over a replica that returns.
    #[arg(long, env = "WEFT_FAILBACK_AFTER", default_value = "15s")]
    pub failback_after: humantime::Duration,
    /// Remove everything this agent applied to the host (from its stored
    /// state) and exit.
    #[arg(long)]
    pub teardown: bool,
    /// This host's underlay address for overlay tunnels [default: the address the controller sees].
    #[arg(long, env = "WEFT_UNDERLAY_IP")]
    pub underlay_ip: Option<std::net::IpAddr>,
    /// Serve Prometheus metrics on http://ADDR/metrics (e.g. 0.0.0.0:9101).
    #[arg(long, env = "WEFT_METRICS_LISTEN")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Log lines as human-readable text or as JSON objects.
    #[arg(long, env = "WEFT_LOG_FORMAT", value_enum, default_value = "human")]
    pub log_format: weft_common::obs::LogFormat,
}

#[derive(Debug, thiserror::Error)]
#[error("invalid agent configuration:\n{}", .0.iter().map(|e| format!("  - {e}")).collect::<Vec<_>>().join("\n"))]
pub struct AgentConfigError(pub Vec<String>);

/// A validated agent configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentConfig {
    pub controllers: Vec<String>,
    pub token: Option<String>,
    /// Lower-case hex, no separators.
    pub ca_fingerprint: Option<String>,
    pub ca_file: Option<PathBuf>,
    pub state_dir: PathBuf,
    pub name: String,
    pub dry_run: bool,
    pub resync_interval: std::time::Duration,
    pub failback_after: std::time::Duration,
    pub teardown: bool,
    pub underlay_ip: Option<std::net::IpAddr>,
    pub metrics_listen: Option<std::net::SocketAddr>,
    pub log_format: weft_common::obs::LogFormat,
    /// Gateways: the host:port remote gateways dial (set by the gateway agent).
    pub endpoint: Option<String>,
    /// Gateways: how tunnels are probed (set by the gateway agent).
    pub probe: crate::probe::ProbeConfig,
    /// Nodes: the bridge for workloads, if the agent manages one.
    pub workload_bridge: Option<String>,
    /// Gateways: the WireGuard chosen at start (see [`choose_wireguard`]).
    pub wireguard: Option<WireguardChoice>,
    /// Gateways: the LAN address held while active (`--lan-address`).
    pub lan_address: Option<ipnet::Ipv4Net>,
    /// Nodes: the DNS responder for peers' names (None: off).
    pub dns: Option<crate::dns::Config>,
}

/// Which WireGuard a gateway runs (`--wireguard`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum WireguardMode {
    /// The kernel module when the kernel can make a WireGuard link, else userspace.
    #[default]
    Auto,
    /// The kernel module; the agent does not start without it.
    Kernel,
    /// weft's userspace device (boringtun's protocol), whatever the kernel has.
    Userspace,
}

/// The userspace WireGuard device's settings (`--wg-no-offload`, …).
pub use weft_dataplane::userspace::Options as UserspaceOptions;

/// The WireGuard a gateway runs, and why (shown by `weftctl gateways` and
/// `diagnose`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WireguardChoice {
    pub kernel: bool,
    pub reason: String,
    /// The userspace device's settings (when not `kernel`).
    pub userspace: UserspaceOptions,
}

impl WireguardChoice {
    pub fn mode(&self) -> &'static str {
        if self.kernel { "kernel" } else { "userspace" }
    }
}

/// Decides a gateway's WireGuard from what was asked and what the kernel
/// probe found (`probe`: Err says what the kernel lacks). Err: the agent
/// must not start (`--wireguard kernel` on a kernel without the module).
pub fn choose_wireguard(
    asked: WireguardMode,
    probe: impl FnOnce() -> Result<(), String>,
) -> Result<WireguardChoice, String> {
    match asked {
        WireguardMode::Userspace => Ok(WireguardChoice {
            kernel: false,
            reason: "--wireguard userspace".into(),
            userspace: Default::default(),
        }),
        WireguardMode::Kernel => match probe() {
            Ok(()) => Ok(WireguardChoice {
                kernel: true,
                reason: "--wireguard kernel".into(),
                userspace: Default::default(),
            }),
            Err(e) if e.contains("module") => Err(format!(
                "--wireguard kernel: {e}. Load it (`modprobe wireguard`; in Linux since 5.6), \
                 or start with --wireguard auto (kernel when it can, else userspace) or --wireguard userspace"
            )),
            Err(e) => Err(format!(
                "--wireguard kernel: cannot tell whether the kernel has WireGuard: {e}; \
                 or start with --wireguard userspace"
            )),
        },
        WireguardMode::Auto => Ok(match probe() {
            Ok(()) => WireguardChoice {
                kernel: true,
                reason: "the kernel has WireGuard (--wireguard auto)".into(),
                userspace: Default::default(),
            },
            Err(e) => WireguardChoice {
                kernel: false,
                reason: e,
                userspace: Default::default(),
            },
        }),
    }
}

fn host_name() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_ascii_lowercase())
}

impl AgentConfig {
    /// The order in which this agent tries its site's controllers (see
    /// [`controller_order`]).
    pub fn controller_order(&self) -> Vec<usize> {
        controller_order(&self.name, &self.controllers)
    }
}

/// The order in which agent `name` tries `controllers`: by the highest
/// random weight (rendezvous hashing) of its name with each address.
/// Agents spread evenly over a site's replicas with nobody assigning them;
/// when a replica goes, only its agents move, spread evenly over the others
/// (each to its second choice); and every agent knows which replica to move
/// back to when its first choice returns.
pub fn controller_order(name: &str, controllers: &[String]) -> Vec<usize> {
    let mut weighed: Vec<(u64, usize)> = controllers
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let d = ring::digest::digest(&ring::digest::SHA256, format!("{name}\n{c}").as_bytes());
            let mut w = [0u8; 8];
            w.copy_from_slice(&d.as_ref()[..8]);
            (u64::from_be_bytes(w), i)
        })
        .collect();
    weighed.sort_by(|a, b| b.cmp(a));
    weighed.into_iter().map(|(_, i)| i).collect()
}

fn valid_name(name: &str) -> bool {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && edge(name.chars().next())
        && edge(name.chars().last())
}

impl AgentArgs {
    pub fn validate(&self) -> Result<AgentConfig, AgentConfigError> {
        let mut errs = Vec::new();
        for c in &self.controllers {
            let ok = c.strip_prefix("https://").is_some_and(|hp| {
                hp.rsplit_once(':')
                    .is_some_and(|(h, p)| !h.is_empty() && p.trim_end_matches('/').parse::<u16>().is_ok())
            });
            if !ok {
                errs.push(format!(
                    "--controller {c:?}: write it as https://HOST:PORT (agents always use mutual TLS)"
                ));
            }
        }
        let fp = self
            .ca_fingerprint
            .as_ref()
            .map(|f| f.replace(':', "").to_ascii_lowercase());
        if let Some(f) = &fp
            && (f.len() != 64 || !f.chars().all(|c| c.is_ascii_hexdigit()))
        {
            errs.push(format!(
                "--ca-fingerprint {:?}: expected the 64 hex digits of a SHA-256 fingerprint (colons allowed)",
                self.ca_fingerprint.as_deref().unwrap_or_default()
            ));
        }
        if self.ca_fingerprint.is_some() && self.ca_file.is_some() {
            errs.push("--ca-fingerprint and --ca-file both set: give one way to trust the controller".into());
        }
        if self.token.is_some() && self.ca_fingerprint.is_none() && self.ca_file.is_none() {
            errs.push(
                "--token needs --ca-fingerprint or --ca-file, so the agent knows it talks to its own controller".into(),
            );
        }
        if let Some(f) = &self.ca_file
            && !f.is_file()
        {
            errs.push(format!("--ca-file {}: no such file", f.display()));
        }
        let name = self.name.clone().or_else(host_name).unwrap_or_default();
        if !valid_name(&name) {
            errs.push(format!(
                "--name {name:?}: use 1 to 63 lower-case letters, digits, '-' or '.', starting and ending with a letter or digit"
            ));
        }
        if !errs.is_empty() {
            return Err(AgentConfigError(errs));
        }
        Ok(AgentConfig {
            controllers: self.controllers.clone(),
            token: self.token.clone(),
            ca_fingerprint: fp,
            ca_file: self.ca_file.clone(),
            state_dir: self.state_dir.clone(),
            name,
            dry_run: self.dry_run,
            resync_interval: *self.resync_interval,
            failback_after: (*self.failback_after).max(std::time::Duration::from_millis(100)),
            teardown: self.teardown,
            underlay_ip: self.underlay_ip,
            metrics_listen: self.metrics_listen,
            log_format: self.log_format,
            endpoint: None,
            probe: Default::default(),
            workload_bridge: None,
            dns: None,
            wireguard: None,
            lan_address: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_controllers(name: &str, controllers: &[String]) -> AgentConfig {
        let mut a = args();
        a.name = Some(name.into());
        a.controllers = controllers.to_vec();
        a.validate().unwrap()
    }

    /// Agents spread evenly over a site's replicas by their own order;
    /// when one replica is gone only its agents move, evenly over the
    /// others, and the rest keep their first choice.
    #[test]
    fn agents_spread_evenly_over_replicas_and_only_a_gone_ones_agents_move() {
        let ctl: Vec<String> = (1..=3).map(|i| format!("https://ctl-{i}:7443")).collect();
        let n = 30_000;
        let mut first = [0usize; 3];
        let mut second_of_gone = [0usize; 3];
        for k in 0..n {
            let order = with_controllers(&format!("node-{k}"), &ctl).controller_order();
            assert_eq!(order.len(), 3);
            first[order[0]] += 1;
            if order[0] == 2 {
                second_of_gone[order[1]] += 1;
            }
            // Without ctl-3 (say, it is not in this agent's list): the
            // same relative order, so whoever did not prefer it keeps its
            // first choice.
            let without = with_controllers(&format!("node-{k}"), &ctl[..2]).controller_order();
            let kept: Vec<usize> = order.iter().copied().filter(|&i| i != 2).collect();
            assert_eq!(without, kept);
        }
        for f in first {
            assert!((9_400..=10_600).contains(&f), "uneven spread {first:?}");
        }
        let moved = second_of_gone[0] + second_of_gone[1];
        assert_eq!(moved, first[2]);
        for s in &second_of_gone[..2] {
            assert!(
                s * 100 / moved >= 46,
                "the gone replica's agents spread unevenly: {second_of_gone:?}"
            );
        }
    }

    fn args() -> AgentArgs {
        AgentArgs {
            controllers: vec!["https://ctl:7443".into()],
            token: Some("t".into()),
            ca_fingerprint: Some("AB:".repeat(31) + "CD"),
            ca_file: None,
            state_dir: "/tmp/s".into(),
            name: Some("node-1".into()),
            dry_run: false,
            resync_interval: std::time::Duration::from_secs(30).into(),
            failback_after: std::time::Duration::from_secs(15).into(),
            teardown: false,
            underlay_ip: None,
            metrics_listen: None,
            log_format: Default::default(),
        }
    }

    #[test]
    fn valid_config_normalises_the_fingerprint() {
        let c = args().validate().unwrap();
        assert_eq!(c.ca_fingerprint.unwrap(), "ab".repeat(31) + "cd");
    }

    #[test]
    fn each_problem_is_reported() {
        let mut a = args();
        a.controllers = vec!["ctl:7443".into()];
        a.ca_fingerprint = Some("xyz".into());
        a.name = Some("Node_1".into());
        let e = a.validate().unwrap_err();
        assert_eq!(e.0.len(), 3, "{e}");
        let mut a = args();
        a.ca_fingerprint = None;
        assert!(a.validate().unwrap_err().to_string().contains("--token needs"));
    }

    fn no_module() -> Result<(), String> {
        Err("the kernel cannot make wireguard links: no wireguard module".into())
    }

    #[test]
    fn auto_takes_the_kernel_when_it_can_and_says_why_when_not() {
        let c = choose_wireguard(WireguardMode::Auto, || Ok(())).unwrap();
        assert!(c.kernel);
        let c = choose_wireguard(WireguardMode::Auto, no_module).unwrap();
        assert!(!c.kernel);
        assert!(c.reason.contains("no wireguard module"), "{}", c.reason);
    }

    #[test]
    fn kernel_without_the_module_is_refused_with_what_to_do() {
        let e = choose_wireguard(WireguardMode::Kernel, no_module).unwrap_err();
        assert!(e.starts_with("--wireguard kernel: "), "{e}");
        assert!(
            e.contains("modprobe wireguard") && e.contains("--wireguard auto"),
            "{e}"
        );
        assert!(choose_wireguard(WireguardMode::Kernel, || Ok(())).unwrap().kernel);
    }

    #[test]
    fn a_probe_that_could_not_run_is_not_called_a_missing_module() {
        let e = choose_wireguard(WireguardMode::Kernel, || {
            Err("cannot make a throwaway network namespace to try a wireguard link: EPERM (run as root)".into())
        })
        .unwrap_err();
        assert!(e.contains("cannot tell") && e.contains("run as root"), "{e}");
        assert!(!e.contains("modprobe"), "{e}");
    }

    #[test]
    fn userspace_does_not_probe() {
        let c = choose_wireguard(WireguardMode::Userspace, || panic!("probed")).unwrap();
        assert_eq!(c.mode(), "userspace");
    }
}
