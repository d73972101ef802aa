//! `weftctl ui`: a live, read-only page of one site's fabric, served on
//! loopback by weftctl itself. The controller gains no listener and no
//! credential: weftctl reads it as every other command does (the admin
//! socket or the admin bundle), and the browser proves itself with a
//! one-time token in the printed link, traded for a session cookie.
//!
//! - `watch`: reads the controller every `--interval`, keeps the latest
//!   answer, the latest `diagnose` and the events seen between answers;
//! - `page` and `graph`: render that state to HTML and an SVG topology
//!   (maud; every value escaped);
//! - `web`: the HTTP server (axum): the token, the session, the page and
//!   its updates as server-sent events.

use std::net::SocketAddr;
use std::time::Duration;

use weft_proto::v1 as pb;

use crate::out::{Client, Out, path_cell, text};

mod graph;
mod page;
mod watch;
mod web;

/// Serves the page until Ctrl-C or SIGTERM.
pub async fn run(c: Client, listen: SocketAddr, open: bool, interval: Duration) -> Result<Out, String> {
    if !listen.ip().is_loopback() {
        return Err(format!(
            "--listen {listen}: weftctl ui serves plain HTTP and listens on loopback only (127.0.0.1 or ::1); \
             to look from another machine, forward a port over SSH (ssh -L 8080:127.0.0.1:8080 HOST, then \
             weftctl ui --no-open --listen 127.0.0.1:8080 there)"
        ));
    }
    if interval < Duration::from_millis(200) || interval > Duration::from_secs(60) {
        return Err(format!(
            "--interval {}: give between 200ms and 60s",
            humantime::format_duration(interval)
        ));
    }
    // The first answer comes before the link: a controller that cannot be
    // read is an error here, not an empty page.
    let state = watch::State::start(c, interval, page::frame).await?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}; pick another with --listen"))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    let auth = web::Auth::new(addr)?;
    let url = format!("http://{}/?token={}", host_port(addr), auth.token());
    println!("weftctl ui: site {}'s fabric, live at", state.site_id());
    println!("  {url}");
    println!("The link works once, in one browser (run weftctl ui again for another). Stop with Ctrl-C.");
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let opened = if open { open_browser(&url, addr.port()) } else { None };
    let server = web::serve(listener, auth, state);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| format!("cannot watch for SIGTERM: {e}"))?;
    tokio::select! {
        r = server => r.map_err(|e| format!("the page's server stopped: {e}"))?,
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    if let Some(f) = opened {
        let _ = std::fs::remove_file(f);
    }
    Ok(text(String::new()))
}

/// `127.0.0.1:8080` or `[::1]:8080`, as a URL and a Host header write it.
fn host_port(a: SocketAddr) -> String {
    match a {
        SocketAddr::V4(a) => a.to_string(),
        SocketAddr::V6(a) => format!("[{}]:{}", a.ip(), a.port()),
    }
}

/// Opens the link in the desktop's browser, where there is a desktop and
/// weftctl is not run through sudo (root's browser is not the user's);
/// whatever fails, the printed link stands. The browser is handed a file
/// only this user can read that leads to the link, not the link itself:
/// a command line is visible to every user of the host. The file, to
/// remove when done.
fn open_browser(url: &str, port: u16) -> Option<std::path::PathBuf> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let desktop = ["DISPLAY", "WAYLAND_DISPLAY"]
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|v| !v.is_empty()));
    if !desktop || std::env::var_os("SUDO_USER").is_some() {
        return None;
    }
    let dir = std::env::var_os("XDG_RUNTIME_DIR").map_or_else(std::env::temp_dir, std::path::PathBuf::from);
    let file = dir.join(format!("weft-ui-{port}.html"));
    let _ = std::fs::remove_file(&file);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&file)
        .ok()?;
    let html = format!(
        "<!DOCTYPE html><meta charset=\"utf-8\"><meta http-equiv=\"refresh\" content=\"0; url={url}\">\
         <title>weft</title><a href=\"{url}\">Open weft's page</a>\n"
    );
    f.write_all(html.as_bytes()).ok()?;
    let child = std::process::Command::new("xdg-open")
        .arg(&file)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn();
    if let Ok(mut child) = child {
        std::thread::spawn(move || child.wait());
    }
    Some(file)
}

/// A peering's look: ok (green), warn (amber), bad (red), muted (gray).
pub(crate) fn tone(p: &pb::Peering) -> &'static str {
    match (
        pb::PeeringState::try_from(p.state).unwrap_or_default(),
        p.tunnel.as_ref(),
    ) {
        (pb::PeeringState::Connected, Some(t)) if t.up => "ok",
        (pb::PeeringState::Connected, _) => "bad",
        (pb::PeeringState::Deleting, _) => "muted",
        _ if !p.last_error.is_empty() => "bad",
        _ => "warn",
    }
}

/// A peering's path as the page says it: the tunnel's, or why there is none yet.
pub(crate) fn path(p: &pb::Peering) -> String {
    match path_cell(p.tunnel.as_ref()) {
        s if s == "-" => "no tunnel yet".into(),
        s => s,
    }
}
