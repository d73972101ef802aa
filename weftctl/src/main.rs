//! `weftctl`: the admin CLI, a thin client of `weft.v1.AdminService`.
//! Human tables by default, `--output json` for scripts. One module per
//! command under `cmd/`.

// The `peerings` JSON object is one `json!` literal deep enough to need it.
#![recursion_limit = "256"]

use std::process::ExitCode;

use clap::Parser;
use weft_proto::v1::admin_service_client::AdminServiceClient;

use crate::cli::{Cli, Cmd, TestCmd, TopologyFormat};
use crate::client::{ClientTls, connect};
use crate::out::Out;

mod cli;
mod client;
mod cmd;
mod out;

async fn run_cmd(cli: &Cli) -> Result<Out, String> {
    let tls = ClientTls {
        ca_file: cli.ca_file.clone(),
        cert_file: cli.cert.clone(),
        key_file: cli.key.clone(),
    };
    let channel = connect(&cli.controller, &tls).await.map_err(|e| e.to_string())?;
    let c = &mut AdminServiceClient::new(channel);
    match &cli.command {
        Cmd::Site => cmd::site::run(c).await,
        Cmd::Nodes => cmd::nodes::list(c).await,
        Cmd::Node(n) => cmd::nodes::run(c, n).await,
        Cmd::Gateways => cmd::gateways::list(c).await,
        Cmd::Gateway(g) => cmd::gateways::run(c, g).await,
        Cmd::Token(t) => cmd::tokens::run(c, t).await,
        Cmd::Peerings => cmd::peerings::list(c).await,
        Cmd::Peering(p) => cmd::peerings::run(c, p).await,
        Cmd::PlanView {
            workload_cidrs,
            external_cidr,
        } => cmd::peerings::plan_view(c, workload_cidrs, external_cidr).await,
        Cmd::Allocations => cmd::allocations::run(c).await,
        Cmd::Translate { args } => cmd::names::translate(c, args).await,
        Cmd::Names => cmd::names::list(c).await,
        Cmd::Name(n) => cmd::names::run(c, n).await,
        Cmd::Status => cmd::status::run(c).await,
        Cmd::Diagnose { settle } => cmd::diagnose::run(c, **settle).await,
        Cmd::Test(TestCmd::Network {
            from,
            to,
            tcp_port,
            timeout,
        }) => cmd::test_network::run(c, from, to, *tcp_port, **timeout).await,
        Cmd::Topology { format } => cmd::topology::run(c, *format == TopologyFormat::Svg).await,
        Cmd::Version => cmd::version::run(c).await,
        Cmd::Ui {
            listen,
            no_open,
            interval,
        } => cmd::ui::run(c.clone(), *listen, !*no_open, **interval).await,
    }
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let _ = rustls::crypto::ring::default_provider().install_default();
    // An error that leaves no answer: 1, except for diagnose, whose 1 means
    // "a check failed" (its report printed) and 2 "there is no report".
    let no_answer = if matches!(cli.command, Cmd::Diagnose { .. }) {
        ExitCode::from(2)
    } else {
        ExitCode::FAILURE
    };
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("weftctl: cannot start: {e}");
            return no_answer;
        }
    };
    match rt.block_on(run_cmd(&cli)) {
        Ok(out) => match out.print(cli.output) {
            Ok(()) if out.failed => ExitCode::FAILURE,
            Ok(()) => ExitCode::SUCCESS,
            // Whoever read the output stopped early; the answer stands.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe && out.failed => ExitCode::FAILURE,
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("weftctl: cannot write output: {e}");
                no_answer
            }
        },
        Err(msg) => {
            eprintln!("weftctl: {msg}");
            no_answer
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn cli_is_well_formed() {
        use clap::CommandFactory;
        crate::cli::Cli::command().debug_assert();
    }
}
