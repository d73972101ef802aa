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
    /// The admin client bundle.
    #[command(subcommand)]
    AdminCert(AdminCertCommand),
}

#[derive(Subcommand, Debug)]
pub enum AdminCertCommand {
    /// Issue a new admin bundle (<data-dir>/pki/admin.pem, admin.key) and
    /// revoke the old certificate on every replica, through the running
    /// controller's admin socket.
    Rotate,
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
    let cfg = match config::load(&cli.args, &|p| std::fs::read_to_string(p)) {
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
    weft_common::obs::init_logging(cfg.log_format);
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
    if let Some(Command::AdminCert(AdminCertCommand::Rotate)) = cli.command {
        return rotate_admin_cert(&cfg);
    }
    raise_open_files_limit();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("weft-controller: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Under systemd (Type=notify), the unit is started once the controller
    // accepts connections, so `systemctl start` then `weftctl` just works.
    let ready = |_: &crate::server::Bound| {
        if let Err(e) = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]) {
            tracing::warn!(error = %e, "cannot tell systemd the controller is ready");
        }
    };
    match rt.block_on(crate::server::run(cfg, shutdown_signal(), ready)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weft-controller: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Every agent holds a connection: the soft limit on open files (1024 under
/// systemd and most shells) would refuse agents long before the hard one
/// (524288 under systemd), so the controller takes the hard limit as Go
/// programs do.
fn raise_open_files_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!(soft, hard, error = %e, "cannot raise the open files limit");
            }
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot read the open files limit"),
    }
}

fn rotate_admin_cert(cfg: &config::ControllerConfig) -> ExitCode {
    let target = format!("unix:{}", cfg.admin_socket.display());
    let run = async {
        let ch = weft_common::tls::connect(&target, &weft_common::tls::Trust::CaPem(String::new()), None).await?;
        let r = weft_proto::v1::admin_service_client::AdminServiceClient::new(ch)
            .rotate_admin_cert(weft_proto::v1::RotateAdminCertRequest {})
            .await
            .map_err(|s| anyhow::anyhow!("{}", s.message()))?
            .into_inner();
        anyhow::Ok(r)
    };
    match tokio::runtime::Runtime::new()
        .map_err(anyhow::Error::from)
        .and_then(|rt| rt.block_on(run))
    {
        Ok(r) => {
            println!("new admin bundle: {}", r.cert_path);
            println!("                  {}", r.key_path);
            if !r.revoked_serial.is_empty() {
                println!(
                    "revoked:          the previous certificate (serial {})",
                    r.revoked_serial
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("weft-controller: cannot rotate the admin bundle through {target}: {e:#}");
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
