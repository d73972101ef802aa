//! `weftctl test network`: reach peers' workloads through this site's
//! local views, from this host or its namespaces.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use serde_json::json;
use weft_proto::v1 as pb;

use crate::out::*;

/// A target of `test network`: a workload of a peer, by its address in the
/// peer's own addressing, and the address this site reaches it at.
#[derive(Clone, Debug)]
pub struct Target {
    pub site: String,
    pub real: IpAddr,
    pub local: IpAddr,
}

/// One ICMP (or ICMPv6) echo to `to` (root, or CAP_NET_RAW); the round
/// trip, or why not.
fn icmp_echo(to: IpAddr, id: u16, seq: u16, wait: Duration) -> Result<Duration, String> {
    use weft_common::icmp;
    let opened = match to {
        IpAddr::V4(_) => icmp::raw_icmp_socket(),
        IpAddr::V6(_) => icmp::raw_icmp6_socket(),
    };
    let s = opened.map_err(|e| format!("cannot open a raw ICMP socket (run as root): {e}"))?;
    let sent = match to {
        IpAddr::V4(a) => icmp::raw_echo(&s, a, id, seq, 64, wait),
        IpAddr::V6(a) => icmp::raw_echo6(&s, a, id, seq, 64, wait),
    };
    sent.map_err(|e| format!("cannot send: {e}"))?
}

/// What one source saw of one target.
#[derive(Clone, Debug)]
struct Probe {
    icmp: Result<Duration, String>,
    tcp: Option<Result<Duration, String>>,
}

impl Probe {
    fn ok(&self) -> bool {
        self.icmp.is_ok() && self.tcp.as_ref().is_none_or(|t| t.is_ok())
    }
}

/// TCP to `to:port`: an accepted or refused connection both prove the path
/// works both ways (a refusal is the target's own answer).
fn tcp_probe(to: IpAddr, port: u16, wait: Duration) -> Result<Duration, String> {
    let start = Instant::now();
    match std::net::TcpStream::connect_timeout(&SocketAddr::new(to, port), wait) {
        Ok(_) => Ok(start.elapsed()),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Ok(start.elapsed()),
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => Err(format!(
            "port {port}: no answer within {}",
            humantime::format_duration(wait)
        )),
        Err(e) => Err(format!("port {port}: {e}")),
    }
}

/// Probes every target from `source` ("host": where weftctl runs; else a
/// network namespace name under /run/netns, or a path such as
/// /proc/PID/ns/net), on a thread that joined it.
fn probe_from(
    source: &str,
    targets: &[Target],
    tcp_port: Option<u16>,
    wait: Duration,
    id: u16,
) -> Result<Vec<Probe>, String> {
    let path = match source {
        "host" => None,
        s if s.contains('/') => Some(s.to_string()),
        s => Some(format!("/run/netns/{s}")),
    };
    let targets = targets.to_vec();
    std::thread::spawn(move || -> Result<Vec<Probe>, String> {
        if let Some(path) = &path {
            let f = std::fs::File::open(path).map_err(|e| format!("--from: cannot open {path}: {e}"))?;
            nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|e| format!("--from: cannot enter {path} (run as root): {e}"))?;
        }
        Ok(targets
            .iter()
            .enumerate()
            .map(|(i, t)| {
                // Two tries: the first packet toward a peer may wait for a
                // WireGuard handshake.
                let icmp = icmp_echo(t.local, id, 2 * i as u16, wait)
                    .or_else(|_| icmp_echo(t.local, id, 2 * i as u16 + 1, wait));
                let tcp = tcp_port.map(|p| tcp_probe(t.local, p, wait));
                Probe { icmp, tcp }
            })
            .collect())
    })
    .join()
    .map_err(|_| "a probe thread panicked".to_string())?
}

fn cell(p: &Probe) -> String {
    let part = |name: &str, r: &Result<Duration, String>| match r {
        Ok(d) => format!("{name} ok {:.1}ms", d.as_secs_f64() * 1000.0),
        Err(_) => format!("{name} FAIL"),
    };
    let mut s = part("icmp", &p.icmp);
    if let Some(t) = &p.tcp {
        s += &format!(", {}", part("tcp", t));
    }
    s
}

/// `weftctl test network`: reachability from each source to each target
/// through this site's local views, as a matrix; exit 1 naming each pair
/// that failed.
pub async fn run(
    c: &mut Client,
    from: &[String],
    to: &[String],
    tcp_port: Option<u16>,
    wait: Duration,
) -> Result<Out, String> {
    if to.is_empty() {
        return Err(
            "give the workloads to reach: --to SITE=ADDRESS (repeatable; IPv4, or IPv6 as [fd00::10]), the address as that site itself uses it; weftctl translates it to this site's local view"
                .into(),
        );
    }
    let mut targets = Vec::new();
    for t in to {
        let (site, ip) = t
            .split_once('=')
            .ok_or_else(|| format!("--to {t:?}: write SITE=ADDRESS, e.g. site-b=10.200.1.10 or site-b=[fd00::10]"))?;
        let bare = ip.strip_prefix('[').and_then(|r| r.strip_suffix(']')).unwrap_or(ip);
        let real = weft_types::net::addr(bare).map_err(|m| format!("--to {t:?}: {m}"))?;
        // The controller translates (`weftctl translate`).
        let tr = c
            .translate(pb::TranslateRequest {
                site: site.to_string(),
                address: real.to_string(),
            })
            .await
            .map_err(|s| format!("--to {t}: {}", status(s)))?
            .into_inner();
        let local = weft_types::net::addr(&tr.local_address)
            .ok()
            .filter(|l| l.is_ipv4() == real.is_ipv4())
            .ok_or_else(|| {
                format!(
                    "--to {t}: the controller answered {:?}, not an address of its family",
                    tr.local_address
                )
            })?;
        targets.push(Target {
            site: site.to_string(),
            real,
            local,
        });
    }
    let sources: Vec<String> = if from.is_empty() {
        vec!["host".into()]
    } else {
        from.to_vec()
    };
    // One thread per source, all at once.
    let base = (std::process::id() as u16).wrapping_mul(31);
    let handles: Vec<_> = sources
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let (s, targets) = (s.clone(), targets.clone());
            tokio::task::spawn_blocking(move || probe_from(&s, &targets, tcp_port, wait, base.wrapping_add(i as u16)))
        })
        .collect();
    let mut results = Vec::new();
    for h in handles {
        results.push(h.await.map_err(|e| format!("a probe task failed: {e}"))??);
    }
    let label = |t: &Target| {
        if t.local == t.real {
            format!("{} {}", t.site, t.real)
        } else {
            format!("{} {} (as {})", t.site, t.real, t.local)
        }
    };
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    let mut pairs = Vec::new();
    for (s, probes) in sources.iter().zip(&results) {
        let mut row = vec![s.clone()];
        for (t, p) in targets.iter().zip(probes) {
            row.push(cell(p));
            if !p.ok() {
                let mut why = Vec::new();
                if let Err(e) = &p.icmp {
                    why.push(format!("ICMP {e}"));
                }
                if let Some(Err(e)) = &p.tcp {
                    why.push(format!("TCP {e}"));
                }
                failures.push(format!("FAIL {s} → {}: {}", label(t), why.join("; ")));
            }
            pairs.push(json!({"from": s, "site": t.site, "address": t.real.to_string(), "local_address": t.local.to_string(),
                "ok": p.ok(), "icmp_ms": p.icmp.as_ref().ok().map(|d| d.as_secs_f64() * 1000.0), "icmp_error": p.icmp.as_ref().err(),
                "tcp_ms": p.tcp.as_ref().and_then(|r| r.as_ref().ok()).map(|d| d.as_secs_f64() * 1000.0),
                "tcp_error": p.tcp.as_ref().and_then(|r| r.as_ref().err())}));
        }
        rows.push(row);
    }
    let total = sources.len() * targets.len();
    let mut footer = vec![String::new()];
    footer.extend(failures.iter().cloned());
    footer.push(format!("{} of {total} pairs reachable", total - failures.len()));
    let header_labels: Vec<String> = targets.iter().map(label).collect();
    let mut out = Out {
        failed: !failures.is_empty(),
        json: json!({"pairs": pairs, "failed": failures.len()}),
        header: vec![],
        rows: vec![],
        footer: vec![],
    };
    // The header names are built at run time; print the matrix as text.
    let mut h: Vec<&str> = vec!["FROM \\ TO"];
    h.extend(header_labels.iter().map(String::as_str));
    out.footer.push(table(&h, &rows).trim_end().to_string());
    out.footer.extend(footer);
    Ok(out)
}
