//! `weft-gateway-agent`: terminates the WireGuard tunnels to peered sites.
//! It enrolls with the controller and keeps its identity renewed; with the
//! agent protocol and the data plane it will apply its desired state
//! (per-peering namespaces, WireGuard, prefix NAT, overlay to nodes).

use std::net::SocketAddr;

use clap::Parser;
use weft_agent::config::AgentArgs;
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
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let cfg = cli.agent.validate().map(|mut c| {
        c.endpoint = cli.endpoint.map(|e| e.to_string());
        c
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
