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
    /// Take a consistent copy of the running site's state (through the
    /// admin socket, on either store) and the site CA, into FILE.
    Backup {
        /// Where to write the backup (mode 0600: it holds the CA key). A
        /// directory (one that exists, or a path ending in /) gets
        /// <site>-<UTC time>.weft-backup.
        #[arg(long, value_name = "PATH")]
        out: std::path::PathBuf,
        /// With --out a directory: keep the N newest of the site's backups
        /// there, deleting older ones once this one is written.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        keep: Option<u32>,
        /// Leave the CA key out (restore then needs <data-dir>/pki/ca.key).
        #[arg(long)]
        without_ca_key: bool,
    },
    /// Restore a backup onto this configuration's stopped, empty store
    /// (and its site CA, if <data-dir>/pki has none).
    Restore {
        /// A file `weft-controller backup` wrote.
        #[arg(value_name = "FILE")]
        file: std::path::PathBuf,
    },
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
    match &cli.command {
        Some(Command::AdminCert(AdminCertCommand::Rotate)) => return rotate_admin_cert(&cfg),
        Some(Command::Backup {
            out,
            keep,
            without_ca_key,
        }) => return backup(&cfg, out, *keep, *without_ca_key),
        Some(Command::Restore { file }) => return restore(&cfg, file),
        _ => {}
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

fn block_on<T>(f: impl std::future::Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
    tokio::runtime::Runtime::new()
        .map_err(anyhow::Error::from)
        .and_then(|rt| rt.block_on(f))
}

fn backup(cfg: &config::ControllerConfig, out: &std::path::Path, keep: Option<u32>, without_key: bool) -> ExitCode {
    let run = async {
        let (file, dir) = crate::backup::destination(out, &cfg.site.id, keep)?;
        let f = crate::backup::take(cfg, &file, without_key).await?;
        let pruned = match (dir, keep) {
            (Some(dir), Some(n)) => crate::backup::prune(&dir, &cfg.site.id, n as usize, &file)?,
            _ => Vec::new(),
        };
        anyhow::Ok((f, file, pruned))
    };
    match block_on(run) {
        Ok((f, file, pruned)) => {
            let h = f.header.unwrap_or_default();
            println!("backup of site {}: {}", h.site_id, file.display());
            println!("store revision:   {} ({} store)", h.revision, h.store);
            println!(
                "records:          {} ({})",
                h.records,
                crate::backup::summary(&f.records)
            );
            if f.ca_key_pem.is_empty() {
                println!("site CA:          the certificate only (--without-ca-key): keep pki/ca.key safe apart");
            } else {
                println!("site CA:          certificate and key: keep this file as secret as pki/ca.key");
            }
            for p in pruned {
                println!(
                    "deleted:          {} (older than the {} kept)",
                    p.display(),
                    keep.unwrap_or(0)
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("weft-controller: backup failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn restore(cfg: &config::ControllerConfig, file: &std::path::Path) -> ExitCode {
    let r = match block_on(crate::backup::restore(cfg, file, crate::server::open_store(cfg))) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("weft-controller: restore failed: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let h = r.file.header.clone().unwrap_or_default();
    let taken = h
        .taken_at
        .and_then(|t| time::OffsetDateTime::from_unix_timestamp(t.seconds).ok())
        .and_then(|d| d.format(&time::format_description::well_known::Rfc3339).ok())
        .unwrap_or_else(|| "an unknown time".into());
    if r.restarted {
        println!("an earlier restore had been cut short: started over");
    }
    println!("restored site {} into {}", h.site_id, r.store);
    println!(
        "from a backup taken at {taken} (revision {}, release {}, {} store)",
        h.revision, h.controller_version, h.store
    );
    println!(
        "records:          {} ({})",
        h.records,
        crate::backup::summary(&r.file.records)
    );
    match &r.wrote_ca {
        Some(dir) => println!("site CA:          written to {}", dir.display()),
        None => println!(
            "site CA:          the one already in {}/pki (the backup's)",
            cfg.data_dir.display()
        ),
    }
    println!("not brought back, because it happened after {taken}:");
    println!(
        "  - agents enrolled since: their records are gone, so they are refused; enroll them again with new tokens"
    );
    println!("  - agents, peerings and names removed since are back: remove them again");
    println!("  - peerings made since are gone here but not on the peer: delete them there and peer again");
    println!("  - tokens issued since are unknown: issue them again");
    println!("  - tokens used since can be used again (`weftctl token list`): delete those that must not be redeemed");
    println!("  - certificates revoked since are trusted again: remove those agents again");
    println!("  - changes to the site's configuration, export policies and transit made through the API since");
    println!("start the controller now: agents keep their state and resume where they are.");
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    #[test]
    fn cli_is_well_formed() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
