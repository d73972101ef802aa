//! `weft-gateway-agent`: terminates the WireGuard tunnels to peered sites.
//! It enrolls with the controller, keeps its identity renewed, applies its
//! desired state (per-peering namespaces, WireGuard, prefix NAT, overlay to
//! the nodes) and probes every tunnel, reporting its health.

use std::net::SocketAddr;

use clap::Parser;
use weft_agent::config::{AgentArgs, AgentConfigError, WireguardMode, choose_wireguard};
use weft_agent::identity::AgentKind;

#[derive(Parser, Debug)]
#[command(
    name = "weft-gateway-agent",
    version,
    about = "weft gateway agent: WireGuard tunnels to peered sites"
)]
struct Cli {
    #[command(flatten)]
    agent: AgentArgs,
    /// Address:port remote gateways dial (omit for a gateway that can only dial out).
    #[arg(long, env = "WEFT_ENDPOINT")]
    endpoint: Option<SocketAddr>,
    /// How often each tunnel is probed (an ICMP echo through it).
    #[arg(long, env = "WEFT_PROBE_INTERVAL", default_value = "1s")]
    probe_interval: humantime::Duration,
    /// Unanswered probes in a row after which a tunnel is reported down.
    #[arg(long, env = "WEFT_PROBE_MISSES", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    probe_misses: u32,
    /// Which WireGuard carries the tunnels: the kernel module, weft's userspace device (boringtun's protocol), or auto (the kernel when it has WireGuard).
    #[arg(long, env = "WEFT_WIREGUARD", value_enum, default_value = "auto")]
    wireguard: WireguardMode,
    /// Userspace WireGuard: ask the kernel for no offloads (TSO on the tun,
    /// UDP GSO/GRO), moving a packet per system call. For a kernel whose
    /// offloads misbehave; the device detects and drops those the kernel
    /// refuses by itself.
    #[arg(long, env = "WEFT_WG_NO_OFFLOAD")]
    wg_no_offload: bool,
    /// Userspace WireGuard: the TTL of a hole-punched tunnel's first
    /// handshakes (for 2 s, or until the peer is heard), which opens this
    /// gateway's NAT without reaching the peer's. A NAT without a firewall
    /// (a cloud's NAT instance) otherwise takes the peer's first datagram
    /// for itself and maps this gateway's port elsewhere. The number of
    /// routers up to and including the NAT, plus one: 2 when the NAT is
    /// this gateway's router. 0: none (every handshake at the full TTL).
    #[arg(long, env = "WEFT_PUNCH_TTL", default_value_t = 2, value_parser = clap::value_parser!(u8).range(0..=64))]
    punch_ttl: u8,
    /// An address on the site's LAN (ADDRESS/PREFIX, e.g. 192.168.1.250/24)
    /// that this gateway holds while it is the active one, announced with
    /// gratuitous ARP: give every gateway of the site the same, and have
    /// exported LAN hosts route the peers' views to it. Needs `arping`.
    #[arg(long, env = "WEFT_LAN_ADDRESS")]
    lan_address: Option<ipnet::Ipv4Net>,
    /// (for tests) Userspace WireGuard: rekey sessions this old, besides
    /// the protocol's 2 minutes.
    #[arg(long, env = "WEFT_WG_REKEY_AFTER", hide = true)]
    wg_rekey_after: Option<humantime::Duration>,
    /// (for tests) Userspace WireGuard: a directory where a file named
    /// after a device makes that device's receiving thread panic once, to
    /// test that a dead device is made anew and reported.
    #[arg(long, env = "WEFT_TEST_DEVICE_PANIC_DIR", hide = true)]
    test_device_panic_dir: Option<std::path::PathBuf>,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let interval = *cli.probe_interval;
    let cfg = cli.agent.validate().and_then(|mut c| {
        if interval < std::time::Duration::from_millis(50) || interval > std::time::Duration::from_secs(3600) {
            return Err(AgentConfigError(vec![format!(
                "--probe-interval {}: use 50ms to 1h",
                cli.probe_interval
            )]));
        }
        c.endpoint = cli.endpoint.map(|e| e.to_string());
        if let Some(lan) = cli.lan_address {
            let a = lan.addr();
            if a.is_loopback()
                || a.is_multicast()
                || a.is_broadcast()
                || a.is_unspecified()
                || a.is_link_local()
                || lan.prefix_len() > 30
                || a == lan.network()
                || a == lan.broadcast()
            {
                return Err(AgentConfigError(vec![format!(
                    "--lan-address {lan}: give a host address of the site's LAN with its prefix, e.g. 192.168.1.250/24"
                )]));
            }
            c.lan_address = Some(lan);
        }
        c.probe = weft_agent::probe::ProbeConfig {
            interval,
            misses: cli.probe_misses,
        };
        if !c.teardown {
            let choice = choose_wireguard(cli.wireguard, weft_agent::linux::kernel_wireguard_probe)
                .map_err(|e| AgentConfigError(vec![e]))?;
            c.wireguard = Some(weft_agent::config::WireguardChoice {
                userspace: weft_agent::config::UserspaceOptions {
                    no_offload: cli.wg_no_offload,
                    rekey_after: cli.wg_rekey_after.map(|d| *d),
                    single_thread: false,
                    punch_ttl: cli.punch_ttl,
                    panic_dir: cli.test_device_panic_dir.clone(),
                },
                ..choice
            });
        }
        Ok(c)
    });
    weft_agent::run::main_with(cfg, AgentKind::Gateway, None)
}

#[cfg(test)]
mod tests {
    #[test]
    fn cli_is_well_formed() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
