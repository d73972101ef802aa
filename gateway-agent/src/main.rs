//! `weft-gateway-agent`: terminates the WireGuard tunnels to peered sites.
//! It will enroll, watch its desired state (per-peering namespaces,
//! WireGuard, prefix NAT, overlay to nodes) and apply it; for now it parses
//! and validates its configuration.

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::Parser;
use weft_agent::config::AgentArgs;

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
    /// First UDP port for WireGuard; each peering takes the next one.
    #[arg(long, env = "WEFT_WIREGUARD_PORT", default_value_t = 51820)]
    wireguard_port: u16,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.agent.validate() {
        Ok(cfg) => {
            println!(
                "weft-gateway-agent: configuration is valid: {cfg:?}, endpoint {:?}, WireGuard from port {}",
                cli.endpoint, cli.wireguard_port
            );
            println!(
                "weft-gateway-agent: enrollment and the desired-state stream are not implemented yet (agent protocol issue)"
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("weft-gateway-agent: {e}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn cli_is_well_formed() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
