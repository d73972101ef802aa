//! `weft-node-agent`: runs on every host with workloads. It enrolls with the
//! controller and keeps its identity renewed; with the agent protocol and
//! the data plane it will apply its desired state (overlay to the gateway,
//! routes, rules, SNAT of host traffic).

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
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    weft_agent::run::main_with(cli.agent.validate(), AgentKind::Node, cli.subnet.map(|s| s.to_string()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn cli_is_well_formed() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
