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
    /// The site CA: rotate it, see how a rotation stands, finish it.
    #[command(subcommand)]
    Ca(CaCommand),
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
pub enum CaCommand {
    /// Make a new site CA in <data-dir>/pki that signs from the
    /// controller's next start, while the old one stays trusted (and
    /// vouches for the new one to agents and peers until they learn it).
    /// Restart the controller after it (and every other replica, once
    /// pki/ca.pem, ca.key and ca-cross.pem are copied to it).
    Rotate {
        /// The old CA's key leaked: retire the old CA at once. Agents must
        /// enroll again and peers be given the new CA by hand (see the
        /// deploy guide).
        #[arg(long)]
        revoke_old: bool,
    },
    /// How a rotation stands, through the running controller's admin
    /// socket: the CAs, and the agents and peers still on the old one.
    Status,
    /// Retire the old CA once no live agent and no peer holds on to it
    /// (asked through the running controller); restart the controller (and
    /// every replica, with the new pki/ca.pem) after it.
    Finish {
        /// Retire it even though agents or peers still hold on to it: the
        /// agents must then enroll again, the peers be given the new CA.
        #[arg(long)]
        force: bool,
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
        Some(Command::Ca(c)) => return ca(&cfg, c),
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

/// The running controller's word on the site CA, over its admin socket.
async fn ca_status(cfg: &config::ControllerConfig) -> anyhow::Result<weft_proto::v1::CaStatus> {
    let target = format!("unix:{}", cfg.admin_socket.display());
    let ch = weft_common::tls::connect(&target, &weft_common::tls::Trust::CaPem(String::new()), None)
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach the running controller at {target}: {e:#}"))?;
    Ok(weft_proto::v1::admin_service_client::AdminServiceClient::new(ch)
        .get_ca_status(weft_proto::v1::GetCaStatusRequest {})
        .await
        .map_err(|s| anyhow::anyhow!("{}", s.message()))?
        .into_inner())
}

fn print_ca_status(s: &weft_proto::v1::CaStatus) {
    println!("signing CA:       {}", s.signing_fingerprint);
    for f in s.trusted_fingerprints.iter().skip(1) {
        println!("also trusted:     {f} (being rotated away from)");
    }
    for f in &s.retired_fingerprints {
        println!("retired:          {f}");
    }
    for a in &s.agents_on_old_ca {
        println!("on the old CA:    {a} (renews when it next connects)");
    }
    for p in &s.peers_on_old_ca {
        println!("peer not told:    {p}");
    }
}

fn ca(cfg: &config::ControllerConfig, c: &CaCommand) -> ExitCode {
    let dir = cfg.data_dir.join("pki");
    let restart = "restart the controller to take it in: systemctl restart weft-controller (on every replica, \
                   after copying pki/ca.pem, ca.key, ca-cross.pem (where present) and ca-retired from this host to it)";
    let restart_finished = "restart the controller to take it in: systemctl restart weft-controller (on every \
                            replica, after copying pki/ca.pem and ca-retired from this host to it and removing \
                            its pki/ca-cross.pem); from then on an admin bundle of the old CA is refused";
    let result = match c {
        CaCommand::Rotate { revoke_old } => crate::pki::rotate(&dir, &cfg.site.id, *revoke_old).map(|r| {
            println!("old CA:           {}", r.old_fingerprint);
            println!("new CA:           {}", r.new_fingerprint);
            println!(
                "admin bundle:     reissued under the new CA ({}): copy it to wherever weftctl runs with one \
                 before `ca finish`",
                dir.join(crate::pki::ADMIN_CERT).display()
            );
            println!("next:             {restart}");
            if r.revoked_old {
                println!(
                    "then:             the old CA is retired: enroll every agent again (weftctl token create, then \
                     the agent with --token and --ca-fingerprint {}), and on every peer site run \
                     `weftctl peering set-ca {} FILE` with a copy of this site's new pki/ca.pem",
                    r.new_fingerprint, cfg.site.id
                );
            } else {
                println!(
                    "then:             agents renew under the new CA as they reconnect, and peers learn it; \
                     `weft-controller ca status` shows who is left, `weft-controller ca finish` retires the old CA"
                );
            }
        }),
        CaCommand::Status => block_on(ca_status(cfg)).map(|s| print_ca_status(&s)),
        CaCommand::Finish { force } => (|| {
            let s = block_on(ca_status(cfg))?;
            let here = crate::pki::SiteCa::load(&dir)?.fingerprint;
            if s.signing_fingerprint != here {
                anyhow::bail!(
                    "the running controller signs with CA {} and {} holds CA {here}: restart the controller \
                     to take in the rotation (and let agents and peers follow) before finishing it",
                    s.signing_fingerprint,
                    dir.display()
                );
            }
            if s.trusted_fingerprints.len() > 1 && !*force {
                let left = s.agents_on_old_ca.len() + s.peers_on_old_ca.len();
                if left > 0 {
                    print_ca_status(&s);
                    anyhow::bail!(
                        "{left} agents and peers still hold on to the old CA (above); wait for them (an agent renews \
                         when it next connects, within 10 ms per agent of the site; a peer of 0.2 or later takes the \
                         new CA within seconds while it is reachable; upgrade those of earlier releases), or give \
                         --force: those agents must then enroll again, those peers be given the new CA by hand"
                    );
                }
            }
            let retired = crate::pki::finish(&dir)?;
            for f in retired {
                println!("retired:          {f}");
            }
            println!("next:             {restart_finished}");
            Ok(())
        })(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weft-controller: {e:#}");
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
