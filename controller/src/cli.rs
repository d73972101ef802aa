//! `weft-controller`'s command line: `run` (the default) and `check-config`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::{self, ControllerArgs};

#[derive(Parser, Debug)]
#[command(
    name = "weft-controller",
    version,
    about = "The weft site controller",
    args_conflicts_with_subcommands = false
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub args: ControllerArgs,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Serve (the default when no command is given).
    Run,
    /// Validate the configuration, print it resolved, and exit.
    CheckConfig,
    /// Create the site PKI (CA, server certificate, admin bundle) under
    /// <data-dir>/pki if absent, print the CA fingerprint, and exit.
    Init,
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down");
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let cfg = match config::load(&cli.args) {
        Ok(c) => c,
        Err(e) => {
            eprint!("weft-controller: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(Command::CheckConfig) = cli.command {
        println!("configuration is valid:\n{cfg:#?}");
        return ExitCode::SUCCESS;
    }
    weft_proto::obs::init_logging(cfg.log_format);
    let _ = rustls::crypto::ring::default_provider().install_default();
    if let Some(Command::Init) = cli.command {
        return match crate::server::ensure_pki(&cfg) {
            Ok(pki) => {
                println!("site CA:          {}", pki.dir.join(crate::pki::CA_CERT).display());
                println!("CA fingerprint:   {}", pki.ca.fingerprint);
                println!("admin bundle:     {}", pki.dir.join(crate::pki::ADMIN_CERT).display());
                println!("                  {}", pki.dir.join(crate::pki::ADMIN_KEY).display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("weft-controller: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("weft-controller: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(crate::server::run(cfg, shutdown_signal(), |_| {})) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weft-controller: {e:#}");
            ExitCode::FAILURE
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
