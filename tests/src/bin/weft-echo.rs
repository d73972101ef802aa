//! A tiny TCP service for end-to-end tests, run inside workload
//! namespaces: it says which site answered and where it saw the client
//! come from, and keeps long-lived connections to show a change elsewhere
//! in the fabric broke none of them.
//!
//! - `weft-echo serve --port P --name SITE`: answers each connection with
//!   `SITE <name> FROM <client address>` and then echoes every line back.
//! - `weft-echo ask ADDR:PORT`: connects, prints the greeting, exits 0
//!   (1 with the reason when it cannot, within `--timeout`).
//! - `weft-echo hold ADDR:PORT --until FILE`: one connection, a numbered
//!   line every `--every` and its echo awaited, until FILE exists; then
//!   prints `HELD <name> lines=<n> max_gap_ms=<ms>` and exits 0. Any
//!   error, a wrong echo or an echo later than `--timeout` prints `BROKEN
//!   ...` and exits 1.
//! - `serve` also answers UDP on its port: each datagram gets `SITE <name>
//!   FROM <client address>`.
//! - `weft-echo flow ADDR:PORT --until FILE`: a UDP flow from one socket,
//!   a datagram every `--every` until FILE exists, printing `<unix ms>
//!   <site>` for each answer (a flow that never idles: its conntrack
//!   entries never expire on their own).

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    Serve {
        #[arg(long, default_value_t = 7000)]
        port: u16,
        #[arg(long)]
        name: String,
    },
    Ask {
        addr: SocketAddr,
        #[arg(long, value_parser = humantime::parse_duration, default_value = "3s")]
        timeout: Duration,
    },
    Hold {
        addr: SocketAddr,
        #[arg(long)]
        until: PathBuf,
        #[arg(long, value_parser = humantime::parse_duration, default_value = "100ms")]
        every: Duration,
        #[arg(long, value_parser = humantime::parse_duration, default_value = "3s")]
        timeout: Duration,
    },
    Flow {
        addr: SocketAddr,
        #[arg(long)]
        until: PathBuf,
        #[arg(long, value_parser = humantime::parse_duration, default_value = "50ms")]
        every: Duration,
    },
}

fn main() {
    match Cli::parse().cmd {
        Cmd::Serve { port, name } => {
            let udp_name = name.clone();
            std::thread::spawn(move || serve_udp(port, &udp_name));
            serve(port, &name)
        }
        Cmd::Flow { addr, until, every } => {
            if let Err(e) = flow(addr, &until, every) {
                eprintln!("{addr}: {e}");
                std::process::exit(1);
            }
        }
        Cmd::Ask { addr, timeout } => match greeting(addr, timeout) {
            Ok((_, line)) => println!("{line}"),
            Err(e) => {
                eprintln!("{addr}: {e}");
                std::process::exit(1);
            }
        },
        Cmd::Hold {
            addr,
            until,
            every,
            timeout,
        } => {
            if let Err(e) = hold(addr, &until, every, timeout) {
                println!("BROKEN {addr}: {e}");
                std::process::exit(1);
            }
        }
    }
}

fn serve(port: u16, name: &str) {
    let listener = TcpListener::bind(("0.0.0.0", port)).unwrap_or_else(|e| panic!("bind {port}: {e}"));
    for conn in listener.incoming().flatten() {
        let name = name.to_string();
        std::thread::spawn(move || {
            let peer = conn.peer_addr().map(|a| a.ip().to_string()).unwrap_or_default();
            let mut w = conn.try_clone().expect("clone");
            if writeln!(w, "SITE {name} FROM {peer}").is_err() {
                return;
            }
            for line in BufReader::new(conn).lines() {
                let Ok(line) = line else { return };
                if writeln!(w, "{line}").is_err() {
                    return;
                }
            }
        });
    }
}

fn serve_udp(port: u16, name: &str) {
    let sock = std::net::UdpSocket::bind(("0.0.0.0", port)).unwrap_or_else(|e| panic!("bind udp {port}: {e}"));
    let mut buf = [0u8; 1500];
    while let Ok((_, from)) = sock.recv_from(&mut buf) {
        let _ = sock.send_to(format!("SITE {name} FROM {}", from.ip()).as_bytes(), from);
    }
}

fn flow(addr: SocketAddr, until: &std::path::Path, every: Duration) -> std::io::Result<()> {
    let sock = std::net::UdpSocket::bind("0.0.0.0:0")?;
    sock.connect(addr)?;
    sock.set_read_timeout(Some(every))?;
    let mut buf = [0u8; 1500];
    let mut n = 0u64;
    while !until.exists() {
        n += 1;
        // Unreachable for a moment (an ICMP error) is part of what is
        // watched: keep sending.
        let _ = sock.send(n.to_string().as_bytes());
        let sent = Instant::now();
        while sent.elapsed() < every {
            let Ok(len) = sock.recv(&mut buf) else { break };
            let text = String::from_utf8_lossy(&buf[..len]);
            let site = text.split_whitespace().nth(1).unwrap_or("?");
            let ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis();
            println!("{ms} {site}");
        }
    }
    Ok(())
}

/// Connects and reads the greeting line.
fn greeting(addr: SocketAddr, timeout: Duration) -> std::io::Result<(BufReader<TcpStream>, String)> {
    let conn = TcpStream::connect_timeout(&addr, timeout)?;
    conn.set_read_timeout(Some(timeout))?;
    let mut r = BufReader::new(conn);
    let mut line = String::new();
    r.read_line(&mut line)?;
    if line.is_empty() {
        return Err(std::io::Error::other("closed before the greeting"));
    }
    Ok((r, line.trim_end().to_string()))
}

fn hold(addr: SocketAddr, until: &std::path::Path, every: Duration, timeout: Duration) -> Result<(), String> {
    let (mut r, hello) = greeting(addr, timeout).map_err(|e| format!("connect: {e}"))?;
    let mut w = r.get_ref().try_clone().map_err(|e| e.to_string())?;
    let (mut n, mut max_gap, mut last) = (0u64, Duration::ZERO, Instant::now());
    while !until.exists() {
        n += 1;
        writeln!(w, "{n}").map_err(|e| format!("line {n}: write: {e}"))?;
        let mut echo = String::new();
        r.read_line(&mut echo).map_err(|e| format!("line {n}: read: {e}"))?;
        if echo.trim_end() != n.to_string() {
            return Err(format!("line {n}: echo {echo:?}"));
        }
        max_gap = max_gap.max(last.elapsed());
        last = Instant::now();
        std::thread::sleep(every);
    }
    println!(
        "HELD {} lines={n} max_gap_ms={}",
        hello.split_whitespace().nth(1).unwrap_or("?"),
        max_gap.as_millis()
    );
    Ok(())
}
