//! What every command shares: the client, gRPC errors as text, and output
//! as a table or JSON.

use std::io::Write;

use serde_json::{Value, json};
use tonic::Code;
use weft_proto::v1 as pb;
use weft_proto::v1::admin_service_client::AdminServiceClient;

use crate::cli::Output;

pub type Client = AdminServiceClient<tonic::transport::Channel>;

/// A gRPC error as weftctl prints it: its canonical code, then the message.
pub fn status(s: tonic::Status) -> String {
    format!("{}: {}", code_name(s.code()), s.message())
}

/// gRPC's canonical code names, as grpcurl and other tools print them.
pub fn code_name(c: Code) -> &'static str {
    match c {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// TUNNEL, RTT, HANDSHAKE, RX, TX cells of a peering's tunnel report.
pub fn tunnel_cells(t: Option<&pb::TunnelStatus>) -> Vec<String> {
    let Some(t) = t else {
        return vec!["unknown".into(), "-".into(), "-".into(), "-".into(), "-".into()];
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let handshake = t
        .last_handshake
        .as_ref()
        .map_or("never".into(), |h| format!("{}s ago", (now - h.seconds).max(0)));
    let rtt = if t.up {
        format!("{:.2}ms", t.rtt_micros as f64 / 1000.0)
    } else {
        "-".into()
    };
    vec![
        if t.up { "up" } else { "down" }.into(),
        rtt,
        handshake,
        bytes(t.rx_bytes),
        bytes(t.tx_bytes),
    ]
}

/// A byte count as people read it (binary units).
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n}B")
    } else {
        format!("{v:.1}{}", UNITS[u])
    }
}

pub fn ts(t: &Option<prost_types::Timestamp>) -> String {
    t.as_ref()
        .and_then(|t| time::OffsetDateTime::from_unix_timestamp(t.seconds).ok())
        .and_then(|d| d.format(&time::format_description::well_known::Rfc3339).ok())
        .unwrap_or_default()
}

pub fn enum_name(full: &str, prefix: &str) -> String {
    full.strip_prefix(prefix)
        .unwrap_or(full)
        .to_ascii_lowercase()
        .replace('_', "-")
}

pub fn source(v: i32) -> String {
    enum_name(
        pb::SubnetSource::try_from(v).unwrap_or_default().as_str_name(),
        "SUBNET_SOURCE_",
    )
}
pub fn alloc_kind(v: i32) -> String {
    enum_name(
        pb::AllocationKind::try_from(v).unwrap_or_default().as_str_name(),
        "ALLOCATION_KIND_",
    )
}
pub fn cidr_kind(v: i32) -> String {
    enum_name(
        pb::CidrKind::try_from(v).unwrap_or_default().as_str_name(),
        "CIDR_KIND_",
    )
}
pub fn agent_role(v: i32) -> String {
    enum_name(
        pb::AgentRole::try_from(v).unwrap_or_default().as_str_name(),
        "AGENT_ROLE_",
    )
}
pub fn token_json(t: &pb::Token) -> Value {
    json!({"id": t.id, "role": agent_role(t.role), "name": t.name, "expires_at": ts(&t.expires_at),
           "uses_left": t.uses_left, "created_at": ts(&t.created_at)})
}
pub fn peering_state(v: i32) -> String {
    enum_name(
        pb::PeeringState::try_from(v).unwrap_or_default().as_str_name(),
        "PEERING_STATE_",
    )
}

/// What a command prints: JSON, and a table of the same data.
pub struct Out {
    /// Printed, but the command failed (exit status 1): a check failed.
    pub failed: bool,
    pub json: Value,
    pub header: Vec<&'static str>,
    pub rows: Vec<Vec<String>>,
    pub footer: Vec<String>,
}

impl Out {
    pub fn print(&self, fmt: Output) -> std::io::Result<()> {
        let mut stdout = std::io::stdout().lock();
        if fmt == Output::Json {
            serde_json::to_writer_pretty(&mut stdout, &self.json)?;
            return writeln!(stdout);
        }
        let mut tw = tabwriter::TabWriter::new(&mut stdout).padding(2);
        if !self.header.is_empty() {
            writeln!(tw, "{}", self.header.join("\t"))?;
        }
        for r in &self.rows {
            writeln!(tw, "{}", r.join("\t"))?;
        }
        tw.flush()?;
        drop(tw);
        for f in &self.footer {
            writeln!(stdout, "{f}")?;
        }
        Ok(())
    }
}

pub fn status_json(s: &Option<pb::AgentStatus>) -> Value {
    let s = s.clone().unwrap_or_default();
    json!({"ready": s.ready, "latest_revision": s.latest_revision, "applied_revision": s.applied_revision,
           "last_seen": ts(&s.last_seen), "errors": s.errors})
}
/// READY cell: Ready, NotReady, or "-" for a name no agent enrolled under.
pub fn ready_cell(s: &Option<pb::AgentStatus>, enrolled: bool) -> &'static str {
    match s {
        _ if !enrolled => "-",
        Some(s) if s.ready => "Ready",
        _ => "NotReady",
    }
}
/// APPLIED/LATEST cell ("-" for a latest revision this replica does not know).
pub fn revision_cell(s: &Option<pb::AgentStatus>) -> String {
    let s = s.clone().unwrap_or_default();
    let latest = if s.latest_revision > 0 {
        s.latest_revision.to_string()
    } else {
        "-".into()
    };
    format!("{}/{latest}", s.applied_revision)
}
/// READY, REVISION (applied/latest), LAST SEEN, ERRORS columns.
pub fn status_cols(s: &Option<pb::AgentStatus>, enrolled: bool) -> Vec<String> {
    let errors = s.as_ref().map(|s| s.errors.join("; ")).unwrap_or_default();
    vec![
        ready_cell(s, enrolled).into(),
        revision_cell(s),
        ts(&s.as_ref().and_then(|s| s.last_seen)),
        errors,
    ]
}
pub fn node_json(n: &pb::Node) -> Value {
    json!({"name": n.name, "subnet": n.subnet, "subnet_v6": n.subnet_v6, "subnet_source": source(n.subnet_source), "created_at": ts(&n.created_at),
           "cert_expires_at": ts(&n.cert_expires_at), "internal_ip": n.internal_ip, "underlay_ip": n.underlay_ip, "geneve": n.geneve,
           "identity_conflict": n.identity_conflict, "status": status_json(&n.status)})
}
/// A node's subnets for a table: IPv4 and IPv6, those it has.
pub fn subnets(n: &pb::Node) -> String {
    [n.subnet.as_str(), n.subnet_v6.as_str()]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}
pub fn node_row(n: &pb::Node) -> Vec<String> {
    let mut row = vec![n.name.clone(), subnets(n), n.underlay_ip.clone()];
    row.extend(status_cols(&n.status, n.cert_expires_at.is_some()));
    row
}
pub const NODE_HEADER: [&str; 7] = [
    "NAME",
    "SUBNET",
    "UNDERLAY",
    "READY",
    "APPLIED/LATEST",
    "LAST SEEN",
    "ERRORS",
];
pub fn view_json(v: &pb::CidrView) -> Value {
    json!({"kind": cidr_kind(v.kind), "real_cidr": v.real_cidr, "local_cidr": v.local_cidr, "remapped": v.remapped})
}

/// A gateway as one peering sees it, for `--output json`.
pub fn gateway_info_json(g: &pb::GatewayInfo) -> serde_json::Value {
    json!({"name": g.name, "endpoint": g.endpoint, "public_key": g.public_key, "active": g.active,
        "candidates": g.candidates.iter().chain(&g.candidates_v6).map(|c| json!({"address": c.address, "kind": c.kind})).collect::<Vec<_>>(),
        "nat": g.nat})
}

/// A tunnel's path ("direct", "hole-punched", "waiting"; "over TLS" added
/// where UDP is blocked), or "-".
pub fn path_cell(t: Option<&pb::TunnelStatus>) -> String {
    match t {
        Some(t) if t.path.is_empty() => "-".into(),
        Some(t) if t.over_tls => format!("{} over TLS", t.path),
        Some(t) => t.path.clone(),
        None => "-".into(),
    }
}

/// A table as text, columns aligned.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut tw = tabwriter::TabWriter::new(Vec::new()).padding(2);
    let _ = writeln!(tw, "{}", header.join("\t"));
    for r in rows {
        let _ = writeln!(tw, "{}", r.join("\t"));
    }
    let _ = tw.flush();
    String::from_utf8(tw.into_inner().unwrap_or_default()).unwrap_or_default()
}

pub fn text(lines: String) -> Out {
    Out {
        failed: false,
        json: Value::Null,
        header: vec![],
        rows: vec![],
        footer: vec![lines.trim_end().to_string()],
    }
}
