//! `weftctl`: the admin CLI, a thin client of `weft.v1.AdminService`.
//! Human tables by default, `--output json` for scripts.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use serde_json::{Value, json};
use tonic::Code;
use weft_proto::v1 as pb;
use weft_proto::v1::admin_service_client::AdminServiceClient;

use crate::client::{ClientTls, connect};

mod client;

mod obs;

#[derive(Parser, Debug)]
#[command(name = "weftctl", version, about = "Administer a weft site controller")]
pub struct Cli {
    /// Controller address: unix:PATH (local admin socket) or https://HOST:PORT.
    #[arg(
        long,
        env = "WEFT_CONTROLLER",
        default_value = "unix:/var/lib/weft/admin.sock",
        global = true
    )]
    pub controller: String,
    /// Output format.
    #[arg(long, short, env = "WEFT_OUTPUT", value_enum, default_value_t = Output::Table, global = true)]
    pub output: Output,
    /// Site CA certificate (PEM), for https:// controllers.
    #[arg(long, env = "WEFT_CA_FILE", global = true)]
    pub ca_file: Option<PathBuf>,
    /// Client certificate (PEM), for https:// controllers.
    #[arg(long, env = "WEFT_CERT", global = true)]
    pub cert: Option<PathBuf>,
    /// Client key (PEM), for https:// controllers.
    #[arg(long, env = "WEFT_KEY", global = true)]
    pub key: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Cmd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Show the site's configuration.
    Site,
    /// List nodes.
    Nodes,
    /// Show, add or remove one node.
    #[command(subcommand)]
    Node(NodeCmd),
    /// List gateways.
    Gateways,
    /// Remove a gateway.
    #[command(subcommand)]
    Gateway(GatewayCmd),
    /// Create, list or delete enrollment tokens.
    #[command(subcommand)]
    Token(TokenCmd),
    /// List peerings with their local views.
    Peerings,
    /// Create or delete a peering with another site.
    #[command(subcommand)]
    Peering(PeeringCmd),
    /// List IPAM allocations and pool usage.
    Allocations,
    /// One screen: the site, gateways (active/standby), nodes, peerings.
    Status,
    /// Check what breaks fabrics (certificates, lagging agents, tunnel MTU,
    /// overlapping routes, kernel features, clock skew); exit 1 on a failure.
    Diagnose {
        /// How long to watch agents behind the latest revision before calling them lagging.
        #[arg(long, default_value = "2s")]
        settle: humantime::Duration,
    },
    /// Test the data path.
    #[command(subcommand)]
    Test(TestCmd),
    /// Draw the federation: sites, gateways, nodes, peerings with state and RTT.
    Topology {
        #[arg(long, value_enum, default_value = "dot")]
        format: TopologyFormat,
    },
    /// Show the local view this site would give a peer's CIDRs now (writes nothing).
    PlanView {
        /// The peer's workload CIDR; repeatable.
        #[arg(long = "workload-cidr", required = true, value_delimiter = ',')]
        workload_cidrs: Vec<String>,
        /// The peer's external CIDR.
        #[arg(long)]
        external_cidr: Option<String>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TopologyFormat {
    Dot,
    Svg,
}

#[derive(Subcommand, Debug)]
pub enum TestCmd {
    /// From this host or its namespaces, reach peers' workloads through this
    /// site's local views (ICMP, and TCP with --tcp-port); prints a matrix,
    /// exits 1 naming each pair that failed. Needs root (raw ICMP, setns).
    Network {
        /// Where to probe from: "host" (where weftctl runs), a network
        /// namespace name, or a path like /proc/PID/ns/net. Repeatable [default: host].
        #[arg(long, value_delimiter = ',')]
        from: Vec<String>,
        /// A peer's workload as SITE=ADDRESS, the address as that site uses
        /// it (weftctl maps it to the local view). Repeatable.
        #[arg(long, value_delimiter = ',')]
        to: Vec<String>,
        /// Also connect over TCP to this port (a refused connection counts
        /// as reached: the workload itself answered).
        #[arg(long)]
        tcp_port: Option<u16>,
        /// How long to wait for each answer.
        #[arg(long, default_value = "2s")]
        timeout: humantime::Duration,
    },
}

#[derive(Subcommand, Debug)]
pub enum NodeCmd {
    /// Show one node.
    Get { name: String },
    /// Add a node; it gets the next free subnet unless --subnet declares one.
    Add {
        name: String,
        /// A subnet the node already has (inside a pod CIDR).
        #[arg(long)]
        subnet: Option<String>,
    },
    /// Remove a node and release its subnet.
    Remove { name: String },
}

#[derive(Subcommand, Debug)]
pub enum PeeringCmd {
    /// Print a one-time token another site uses to peer with this one.
    Token {
        /// Lifetime, e.g. 30m, 1h.
        #[arg(long, default_value = "1h")]
        ttl: String,
        /// Only this site may redeem it (recommended: a leaked token is
        /// then useless to anyone else).
        #[arg(long = "for")]
        for_site: Option<String>,
    },
    /// Peer with the site that made the token.
    Create {
        #[arg(long)]
        token: String,
    },
    /// End the peering with a site, on both sides.
    Delete { site: String },
    /// Route the CIDRs a peer announced after negotiation (shown as
    /// pending in `weftctl peerings`).
    Accept { site: String },
}

#[derive(Subcommand, Debug)]
pub enum GatewayCmd {
    /// Remove a gateway and revoke its certificate.
    Remove { name: String },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RoleArg {
    Node,
    Gateway,
}

#[derive(Subcommand, Debug)]
pub enum TokenCmd {
    /// Create a token an agent enrolls with (shown once).
    Create {
        #[arg(long, value_enum)]
        role: RoleArg,
        /// Fix the agent's name (otherwise the agent's --name or host name).
        #[arg(long)]
        name: Option<String>,
        /// Lifetime, e.g. 30m, 1h, 7d.
        #[arg(long, default_value = "1h")]
        ttl: String,
        /// How many agents may enroll with it.
        #[arg(long, default_value_t = 1)]
        uses: u32,
    },
    /// List tokens (their secrets are never shown again).
    List,
    /// Delete a token.
    Delete { id: String },
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
fn tunnel_cells(t: Option<&pb::TunnelStatus>) -> Vec<String> {
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
fn bytes(n: u64) -> String {
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

fn ts(t: &Option<prost_types::Timestamp>) -> String {
    t.as_ref()
        .and_then(|t| time::OffsetDateTime::from_unix_timestamp(t.seconds).ok())
        .and_then(|d| d.format(&time::format_description::well_known::Rfc3339).ok())
        .unwrap_or_default()
}

fn enum_name(full: &str, prefix: &str) -> String {
    full.strip_prefix(prefix)
        .unwrap_or(full)
        .to_ascii_lowercase()
        .replace('_', "-")
}

fn source(v: i32) -> String {
    enum_name(
        pb::SubnetSource::try_from(v).unwrap_or_default().as_str_name(),
        "SUBNET_SOURCE_",
    )
}
fn alloc_kind(v: i32) -> String {
    enum_name(
        pb::AllocationKind::try_from(v).unwrap_or_default().as_str_name(),
        "ALLOCATION_KIND_",
    )
}
fn cidr_kind(v: i32) -> String {
    enum_name(
        pb::CidrKind::try_from(v).unwrap_or_default().as_str_name(),
        "CIDR_KIND_",
    )
}
fn agent_role(v: i32) -> String {
    enum_name(
        pb::AgentRole::try_from(v).unwrap_or_default().as_str_name(),
        "AGENT_ROLE_",
    )
}
fn token_json(t: &pb::Token) -> Value {
    json!({"id": t.id, "role": agent_role(t.role), "name": t.name, "expires_at": ts(&t.expires_at),
           "uses_left": t.uses_left, "created_at": ts(&t.created_at)})
}
fn peering_state(v: i32) -> String {
    enum_name(
        pb::PeeringState::try_from(v).unwrap_or_default().as_str_name(),
        "PEERING_STATE_",
    )
}

/// What a command prints: JSON, and a table of the same data.
struct Out {
    /// Printed, but the command failed (exit status 1): a check failed.
    failed: bool,
    json: Value,
    header: Vec<&'static str>,
    rows: Vec<Vec<String>>,
    footer: Vec<String>,
}

impl Out {
    fn print(&self, fmt: Output) -> std::io::Result<()> {
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

fn status_json(s: &Option<pb::AgentStatus>) -> Value {
    let s = s.clone().unwrap_or_default();
    json!({"ready": s.ready, "latest_revision": s.latest_revision, "applied_revision": s.applied_revision,
           "last_seen": ts(&s.last_seen), "errors": s.errors})
}
/// READY cell: Ready, NotReady, or "-" for a name no agent enrolled under.
fn ready_cell(s: &Option<pb::AgentStatus>, enrolled: bool) -> &'static str {
    match s {
        _ if !enrolled => "-",
        Some(s) if s.ready => "Ready",
        _ => "NotReady",
    }
}
/// APPLIED/LATEST cell ("-" for a latest revision this replica does not know).
fn revision_cell(s: &Option<pb::AgentStatus>) -> String {
    let s = s.clone().unwrap_or_default();
    let latest = if s.latest_revision > 0 {
        s.latest_revision.to_string()
    } else {
        "-".into()
    };
    format!("{}/{latest}", s.applied_revision)
}
/// READY, REVISION (applied/latest), LAST SEEN, ERRORS columns.
fn status_cols(s: &Option<pb::AgentStatus>, enrolled: bool) -> Vec<String> {
    let errors = s.as_ref().map(|s| s.errors.join("; ")).unwrap_or_default();
    vec![
        ready_cell(s, enrolled).into(),
        revision_cell(s),
        ts(&s.as_ref().and_then(|s| s.last_seen)),
        errors,
    ]
}
fn node_json(n: &pb::Node) -> Value {
    json!({"name": n.name, "subnet": n.subnet, "subnet_source": source(n.subnet_source), "created_at": ts(&n.created_at),
           "cert_expires_at": ts(&n.cert_expires_at), "internal_ip": n.internal_ip, "underlay_ip": n.underlay_ip, "geneve": n.geneve,
           "status": status_json(&n.status)})
}
fn node_row(n: &pb::Node) -> Vec<String> {
    let mut row = vec![n.name.clone(), n.subnet.clone(), n.underlay_ip.clone()];
    row.extend(status_cols(&n.status, n.cert_expires_at.is_some()));
    row
}
const NODE_HEADER: [&str; 7] = [
    "NAME",
    "SUBNET",
    "UNDERLAY",
    "READY",
    "APPLIED/LATEST",
    "LAST SEEN",
    "ERRORS",
];
fn view_json(v: &pb::CidrView) -> Value {
    json!({"kind": cidr_kind(v.kind), "real_cidr": v.real_cidr, "local_cidr": v.local_cidr, "remapped": v.remapped})
}

async fn run_cmd(cli: &Cli) -> Result<Out, String> {
    let tls = ClientTls {
        ca_file: cli.ca_file.clone(),
        cert_file: cli.cert.clone(),
        key_file: cli.key.clone(),
    };
    let channel = connect(&cli.controller, &tls).await.map_err(|e| e.to_string())?;
    let mut c = AdminServiceClient::new(channel);
    let status = |s: tonic::Status| format!("{}: {}", code_name(s.code()), s.message());
    Ok(match &cli.command {
        Cmd::Status => return obs::status_cmd(&mut c).await,
        Cmd::Diagnose { settle } => return obs::diagnose_cmd(&mut c, **settle).await,
        Cmd::Test(TestCmd::Network {
            from,
            to,
            tcp_port,
            timeout,
        }) => return obs::test_network_cmd(&mut c, from, to, *tcp_port, **timeout).await,
        Cmd::Topology { format } => return obs::topology_cmd(&mut c, *format == TopologyFormat::Svg).await,
        Cmd::Site => {
            let s = c.get_site(pb::GetSiteRequest {}).await.map_err(status)?.into_inner();
            let rows = vec![
                vec!["site".into(), s.id.clone()],
                vec!["pod CIDRs".into(), s.pod_cidrs.join(", ")],
                vec!["external CIDR".into(), s.external_cidr.clone()],
                vec!["internal CIDR".into(), s.internal_cidr.clone()],
                vec!["reserved".into(), s.reserved_cidrs.join(", ")],
                vec!["remap pools".into(), s.remap_pools.join(", ")],
                vec!["node prefix".into(), format!("/{}", s.node_prefix_len)],
                vec!["revision".into(), s.revision.to_string()],
                vec!["CA fingerprint".into(), s.ca_fingerprint.clone()],
            ];
            Out {
                failed: false,
                json: json!({
                    "id": s.id, "pod_cidrs": s.pod_cidrs, "external_cidr": s.external_cidr,
                    "internal_cidr": s.internal_cidr, "reserved_cidrs": s.reserved_cidrs,
                    "remap_pools": s.remap_pools, "node_prefix_len": s.node_prefix_len, "revision": s.revision,
                    "ca_fingerprint": s.ca_fingerprint,
                }),
                header: vec![],
                rows,
                footer: vec![],
            }
        }
        Cmd::Nodes => {
            let r = c
                .list_nodes(pb::ListNodesRequest {})
                .await
                .map_err(status)?
                .into_inner();
            Out {
                failed: false,
                json: json!({"nodes": r.nodes.iter().map(node_json).collect::<Vec<_>>(), "revision": r.revision}),
                header: NODE_HEADER.to_vec(),
                rows: r.nodes.iter().map(node_row).collect(),
                footer: vec![],
            }
        }
        Cmd::Node(cmd) => {
            let n = match cmd {
                NodeCmd::Get { name } => c.get_node(pb::GetNodeRequest { name: name.clone() }).await,
                NodeCmd::Add { name, subnet } => {
                    c.create_node(pb::CreateNodeRequest {
                        name: name.clone(),
                        subnet: subnet.clone().unwrap_or_default(),
                    })
                    .await
                }
                NodeCmd::Remove { name } => {
                    let r = c
                        .delete_node(pb::DeleteNodeRequest { name: name.clone() })
                        .await
                        .map_err(status)?;
                    let released = r.into_inner().released_subnet;
                    return Ok(Out {
                        failed: false,
                        json: json!({"removed": name, "released_subnet": released}),
                        header: vec![],
                        rows: vec![vec![format!("removed node {name}, released {released}")]],
                        footer: vec![],
                    });
                }
            }
            .map_err(status)?
            .into_inner();
            Out {
                failed: false,
                json: node_json(&n),
                header: NODE_HEADER.to_vec(),
                rows: vec![node_row(&n)],
                footer: vec![],
            }
        }
        Cmd::Gateways => {
            let r = c
                .list_gateways(pb::ListGatewaysRequest {})
                .await
                .map_err(status)?
                .into_inner();
            Out {
                failed: false,
                json: json!({"gateways": r.gateways.iter().map(|g| json!({
                    "name": g.name, "endpoint": g.endpoint, "public_key": g.public_key, "created_at": ts(&g.created_at),
                    "cert_expires_at": ts(&g.cert_expires_at), "internal_ip": g.internal_ip, "underlay_ip": g.underlay_ip, "geneve": g.geneve, "active": g.active,
                    "status": status_json(&g.status),
                })).collect::<Vec<_>>(), "revision": r.revision}),
                header: vec![
                    "NAME",
                    "UNDERLAY",
                    "ENDPOINT",
                    "INTERNAL",
                    "READY",
                    "APPLIED/LATEST",
                    "LAST SEEN",
                    "ERRORS",
                ],
                rows: r
                    .gateways
                    .iter()
                    .map(|g| {
                        let endpoint = if g.endpoint.is_empty() {
                            "-".into()
                        } else {
                            g.endpoint.clone()
                        };
                        let mut row = vec![g.name.clone(), g.underlay_ip.clone(), endpoint, g.internal_ip.clone()];
                        row.extend(status_cols(&g.status, g.cert_expires_at.is_some()));
                        row
                    })
                    .collect(),
                footer: vec![],
            }
        }
        Cmd::Gateway(GatewayCmd::Remove { name }) => {
            c.delete_gateway(pb::DeleteGatewayRequest { name: name.clone() })
                .await
                .map_err(status)?;
            Out {
                failed: false,
                json: json!({"removed": name}),
                header: vec![],
                rows: vec![vec![format!("removed gateway {name}; its certificate is revoked")]],
                footer: vec![],
            }
        }
        Cmd::Token(TokenCmd::Create { role, name, ttl, uses }) => {
            let ttl =
                humantime::parse_duration(ttl).map_err(|e| format!("--ttl {ttl:?}: {e}; write e.g. 30m, 1h or 7d"))?;
            let role = match role {
                RoleArg::Node => pb::AgentRole::Node,
                RoleArg::Gateway => pb::AgentRole::Gateway,
            };
            let r = c
                .create_token(pb::CreateTokenRequest {
                    role: role as i32,
                    name: name.clone().unwrap_or_default(),
                    ttl_seconds: ttl.as_secs(),
                    uses: *uses,
                })
                .await
                .map_err(status)?
                .into_inner();
            let info = r.info.clone().unwrap_or_default();
            let agent = if role == pb::AgentRole::Node {
                "weft-node-agent"
            } else {
                "weft-gateway-agent"
            };
            let mut json = token_json(&info);
            json["token"] = json!(r.token);
            json["ca_fingerprint"] = json!(r.ca_fingerprint);
            Out {
                failed: false,
                json,
                header: vec![],
                rows: vec![
                    vec!["token".into(), r.token.clone()],
                    vec!["role".into(), agent_role(info.role)],
                    vec![
                        "name".into(),
                        if info.name.is_empty() {
                            "(chosen by the agent)".into()
                        } else {
                            info.name.clone()
                        },
                    ],
                    vec!["expires".into(), ts(&info.expires_at)],
                    vec!["uses".into(), info.uses_left.to_string()],
                    vec!["CA fingerprint".into(), r.ca_fingerprint.clone()],
                ],
                footer: vec![
                    String::new(),
                    "The token is not shown again. Enroll with:".into(),
                    format!(
                        "  {agent} --controller https://<controller>:7443 --token {} --ca-fingerprint {}",
                        r.token, r.ca_fingerprint
                    ),
                ],
            }
        }
        Cmd::Token(TokenCmd::List) => {
            let r = c
                .list_tokens(pb::ListTokensRequest {})
                .await
                .map_err(status)?
                .into_inner();
            Out {
                failed: false,
                json: json!({"tokens": r.tokens.iter().map(token_json).collect::<Vec<_>>()}),
                header: vec!["ID", "ROLE", "NAME", "USES LEFT", "EXPIRES"],
                rows: r
                    .tokens
                    .iter()
                    .map(|t| {
                        vec![
                            t.id.clone(),
                            agent_role(t.role),
                            t.name.clone(),
                            t.uses_left.to_string(),
                            ts(&t.expires_at),
                        ]
                    })
                    .collect(),
                footer: vec![],
            }
        }
        Cmd::Token(TokenCmd::Delete { id }) => {
            c.delete_token(pb::DeleteTokenRequest { id: id.clone() })
                .await
                .map_err(status)?;
            Out {
                failed: false,
                json: json!({"deleted": id}),
                header: vec![],
                rows: vec![vec![format!("deleted token {id}")]],
                footer: vec![],
            }
        }
        Cmd::Peering(PeeringCmd::Token { ttl, for_site }) => {
            let ttl =
                humantime::parse_duration(ttl).map_err(|e| format!("--ttl {ttl:?}: {e}; write e.g. 30m or 1h"))?;
            let r = c
                .create_peering_token(pb::CreatePeeringTokenRequest {
                    ttl_seconds: ttl.as_secs(),
                    for_site: for_site.clone().unwrap_or_default(),
                })
                .await
                .map_err(status)?
                .into_inner();
            Out {
                failed: false,
                json: json!({"token": r.token, "expires_at": ts(&r.expires_at)}),
                header: vec![],
                rows: vec![vec![r.token.clone()]],
                footer: vec![
                    format!("expires {}; shown once. On the other site run:", ts(&r.expires_at)),
                    format!("  weftctl peering create --token {}", r.token),
                ],
            }
        }
        Cmd::Peering(PeeringCmd::Create { token }) => {
            let p = c
                .create_peering(pb::CreatePeeringRequest { token: token.clone() })
                .await
                .map_err(status)?
                .into_inner();
            Out {
                failed: false,
                json: json!({"site_id": p.site_id, "state": peering_state(p.state), "tunnel_role": p.tunnel_role,
                    "views": p.views.iter().map(view_json).collect::<Vec<_>>()}),
                header: vec![],
                rows: vec![vec![format!(
                    "peered with {} ({}), this site is the tunnel {}",
                    p.site_id,
                    peering_state(p.state),
                    p.tunnel_role
                )]],
                footer: vec![],
            }
        }
        Cmd::Peering(PeeringCmd::Delete { site }) => {
            let r = c
                .delete_peering(pb::DeletePeeringRequest { site_id: site.clone() })
                .await
                .map_err(status)?
                .into_inner();
            let how = if r.remote_notified {
                "on both sides"
            } else {
                "here; the other site was not reachable and learns it later"
            };
            Out {
                failed: false,
                json: json!({"deleted": site, "remote_notified": r.remote_notified}),
                header: vec![],
                rows: vec![vec![format!("deleted the peering with {site} {how}")]],
                footer: vec![],
            }
        }
        Cmd::Peering(PeeringCmd::Accept { site }) => {
            let p = c
                .accept_peering_update(pb::AcceptPeeringUpdateRequest { site_id: site.clone() })
                .await
                .map_err(status)?
                .into_inner();
            Out {
                failed: false,
                json: json!({"site_id": p.site_id, "views": p.views.iter().map(view_json).collect::<Vec<_>>()}),
                header: vec![],
                rows: p
                    .views
                    .iter()
                    .map(|v| vec![format!("{site}: routing {} as {}", v.real_cidr, v.local_cidr)])
                    .collect(),
                footer: vec![],
            }
        }
        Cmd::Peerings => {
            let r = c
                .list_peerings(pb::ListPeeringsRequest {})
                .await
                .map_err(status)?
                .into_inner();
            let mut rows = Vec::new();
            for p in &r.peerings {
                // The tunnel's health on the peering's first row only.
                let mut health = tunnel_cells(p.tunnel.as_ref());
                // Where the tunnel is reached: this site's UDP port, and the
                // endpoint this site dials (the peer's active gateway), if any.
                let dials = p
                    .remote_gateways
                    .iter()
                    .find(|g| g.active && !g.endpoint.is_empty())
                    .or_else(|| p.remote_gateways.iter().find(|g| !g.endpoint.is_empty()))
                    .map_or_else(|| "-".to_string(), |g| g.endpoint.clone());
                let mut reach = vec![p.listen_port.to_string(), dials];
                for v in &p.views {
                    let mut row = vec![p.site_id.clone(), peering_state(p.state), p.tunnel_role.clone()];
                    row.append(&mut reach);
                    reach = vec![String::new(); 2];
                    row.append(&mut health);
                    health = vec![String::new(); 5];
                    row.extend([
                        cidr_kind(v.kind),
                        v.real_cidr.clone(),
                        v.local_cidr.clone(),
                        p.last_error.clone(),
                    ]);
                    rows.push(row);
                }
            }
            Out {
                failed: false,
                json: json!({"peerings": r.peerings.iter().map(|p| json!({
                    "site_id": p.site_id, "state": peering_state(p.state),
                    "views": p.views.iter().map(view_json).collect::<Vec<_>>(),
                    "created_at": ts(&p.created_at), "last_error": p.last_error, "tunnel_role": p.tunnel_role,
                    "remote_endpoints": p.remote_endpoints, "remote_ca_fingerprint": p.remote_ca_fingerprint,
                    "listen_port": p.listen_port,
                    "pending": (!p.pending_workload_cidrs.is_empty() || !p.pending_external_cidr.is_empty()).then(|| json!({
                        "workload_cidrs": p.pending_workload_cidrs, "external_cidr": p.pending_external_cidr,
                        "since": ts(&p.pending_since),
                    })),
                    "local_gateways": p.local_gateways.iter().map(gateway_info_json).collect::<Vec<_>>(),
                    "remote_gateways": p.remote_gateways.iter().map(gateway_info_json).collect::<Vec<_>>(),
                    "tunnel": p.tunnel.as_ref().map(|t| json!({
                        "up": t.up, "rtt_ms": t.rtt_micros as f64 / 1000.0,
                        "last_handshake": ts(&t.last_handshake), "rx_bytes": t.rx_bytes, "tx_bytes": t.tx_bytes,
                        "probes_sent": t.probes_sent, "probes_lost": t.probes_lost, "link": t.link,
                        "gateway": t.gateway, "reported_at": ts(&t.reported_at),
                    })),
                })).collect::<Vec<_>>(), "revision": r.revision}),
                header: vec![
                    "PEER",
                    "STATE",
                    "ROLE",
                    "PORT",
                    "DIALS",
                    "TUNNEL",
                    "RTT",
                    "HANDSHAKE",
                    "RX",
                    "TX",
                    "KIND",
                    "REAL CIDR",
                    "LOCAL VIEW",
                    "LAST ERROR",
                ],
                rows,
                footer: r
                    .peerings
                    .iter()
                    .filter(|p| !p.pending_workload_cidrs.is_empty() || !p.pending_external_cidr.is_empty())
                    .map(|p| {
                        let mut cidrs = p.pending_workload_cidrs.clone();
                        cidrs.extend(Some(p.pending_external_cidr.clone()).filter(|c| !c.is_empty()));
                        format!(
                            "{} announced {} instead; not routed until `weftctl peering accept {}`",
                            p.site_id,
                            cidrs.join(" "),
                            p.site_id
                        )
                    })
                    .collect(),
            }
        }
        Cmd::Allocations => {
            let r = c
                .list_allocations(pb::ListAllocationsRequest {})
                .await
                .map_err(status)?
                .into_inner();
            let footer = r
                .pools
                .iter()
                .map(|p| {
                    format!(
                        "pool {} ({}): {} of {} addresses allocated",
                        p.pool,
                        alloc_kind(p.kind),
                        p.allocated_addresses,
                        p.total_addresses
                    )
                })
                .collect();
            Out {
                failed: false,
                json: json!({
                    "allocations": r.allocations.iter().map(|a| json!({
                        "cidr": a.cidr, "kind": alloc_kind(a.kind), "owner": a.owner, "pool": a.pool,
                    })).collect::<Vec<_>>(),
                    "pools": r.pools.iter().map(|p| json!({
                        "pool": p.pool, "kind": alloc_kind(p.kind),
                        "total_addresses": p.total_addresses, "allocated_addresses": p.allocated_addresses,
                    })).collect::<Vec<_>>(),
                    "revision": r.revision,
                }),
                header: vec!["CIDR", "KIND", "OWNER", "POOL"],
                rows: r
                    .allocations
                    .iter()
                    .map(|a| vec![a.cidr.clone(), alloc_kind(a.kind), a.owner.clone(), a.pool.clone()])
                    .collect(),
                footer,
            }
        }
        Cmd::PlanView {
            workload_cidrs,
            external_cidr,
        } => {
            let r = c
                .plan_local_view(pb::PlanLocalViewRequest {
                    workload_cidrs: workload_cidrs.clone(),
                    external_cidr: external_cidr.clone().unwrap_or_default(),
                })
                .await
                .map_err(status)?
                .into_inner();
            Out {
                failed: false,
                json: json!({"views": r.views.iter().map(view_json).collect::<Vec<_>>()}),
                header: vec!["KIND", "REAL CIDR", "LOCAL VIEW", "REMAPPED"],
                rows: r
                    .views
                    .iter()
                    .map(|v| {
                        vec![
                            cidr_kind(v.kind),
                            v.real_cidr.clone(),
                            v.local_cidr.clone(),
                            v.remapped.to_string(),
                        ]
                    })
                    .collect(),
                footer: vec![],
            }
        }
    })
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("weftctl: cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run_cmd(&cli)) {
        Ok(out) => match out.print(cli.output) {
            Ok(()) if out.failed => ExitCode::FAILURE,
            Ok(()) => ExitCode::SUCCESS,
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("weftctl: cannot write output: {e}");
                ExitCode::FAILURE
            }
        },
        Err(msg) => {
            eprintln!("weftctl: {msg}");
            ExitCode::FAILURE
        }
    }
}

/// A gateway as one peering sees it, for `--output json`.
fn gateway_info_json(g: &pb::GatewayInfo) -> serde_json::Value {
    json!({"name": g.name, "endpoint": g.endpoint, "public_key": g.public_key, "active": g.active})
}

#[cfg(test)]
mod tests {
    #[test]
    fn cli_is_well_formed() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
