//! `weft-node-agent`: runs on every host with workloads. It enrolls with the
//! controller, keeps its identity renewed and applies its desired state
//! (overlay to the gateway, routes, rules, SNAT of host traffic), and on
//! request a bridge for the workloads to attach to.

use clap::Parser;
use ipnet::Ipv4Net;
use weft_agent::config::AgentArgs;
use weft_agent::identity::AgentKind;

#[derive(Parser, Debug)]
#[command(
    name = "weft-node-agent",
    version,
    about = "weft node agent: connects this host's workloads to the site's gateway"
)]
struct Cli {
    #[command(flatten)]
    agent: AgentArgs,
    /// A workload subnet this node already has (otherwise the controller allocates one).
    #[arg(long, env = "WEFT_SUBNET")]
    subnet: Option<Ipv4Net>,
    /// Manage a bridge of this name (it must start with "weft") owning the
    /// first address of the node's workload subnet, for containers or
    /// namespaces to attach to; removed with the agent's other objects.
    #[arg(long, env = "WEFT_WORKLOAD_BRIDGE")]
    workload_bridge: Option<String>,
    /// Where the DNS responder for peers' published names listens (UDP):
    /// "subnet" (the first address of the node's workload subnet, port 53,
    /// the address its workloads route through), ADDRESS:PORT, or "off".
    #[arg(long, env = "WEFT_DNS_LISTEN", default_value = "subnet")]
    dns_listen: String,
    /// The zone it answers: NAME.SITE.<zone>; every other name is refused
    /// (left to the host's resolver).
    #[arg(long, env = "WEFT_DNS_ZONE", default_value = "weft.internal")]
    dns_zone: String,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let bridge = cli.workload_bridge.clone();
    let cfg = cli.agent.validate().and_then(|mut c| {
        if let Some(b) = &bridge
            && (!b.starts_with("weft") || b.len() > 15 || !b.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'))
        {
            return Err(weft_agent::config::AgentConfigError(vec![format!(
                "--workload-bridge {b:?}: use an interface name that starts with \"weft\", at most 15 letters, digits or '-'"
            )]));
        }
        c.workload_bridge = bridge;
        let listen = cli
            .dns_listen
            .parse::<weft_agent::dns::Listen>()
            .map_err(|m| format!("--dns-listen {m}"));
        let zone = weft_agent::dns::parse_zone(&cli.dns_zone);
        match (listen, zone) {
            (Ok(weft_agent::dns::Listen::Off), Ok(_)) => c.dns = None,
            (Ok(listen), Ok(zone)) => c.dns = Some(weft_agent::dns::Config { listen, zone }),
            (l, z) => {
                return Err(weft_agent::config::AgentConfigError(
                    [l.err(), z.err()].into_iter().flatten().collect(),
                ));
            }
        }
        Ok(c)
    });
    weft_agent::run::main_with(cfg, AgentKind::Node, cli.subnet.map(|s| s.to_string()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn cli_is_well_formed() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
