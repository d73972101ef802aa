//! The controller's configuration: a TOML file, every field overridable by
//! a flag or a `WEFT_*` environment variable, validated as a whole before any
//! port is bound. Errors name the field (and its flag) and say how to fix it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};

use crate::domain::{PortRange, Site, validate_name};
use crate::ipam::overlaps;

mod checks;
use checks::*;

pub const DEFAULT_EXTERNAL_CIDR: &str = "10.70.0.0/16";
pub const DEFAULT_INTERNAL_CIDR: &str = "10.80.0.0/16";
pub const DEFAULT_REMAP_POOLS: [&str; 3] = ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"];
pub const DEFAULT_NODE_PREFIX_LEN: u8 = 24;
/// Revisions of history the embedded store keeps for watches.
pub const DEFAULT_STORE_HISTORY: i64 = 10_000;
pub const DEFAULT_DATA_DIR: &str = "/var/lib/weft";
pub const DEFAULT_LISTEN: &str = "0.0.0.0:7443";

pub use weft_common::obs::LogFormat;

/// Flags of `weft-controller`. Each overrides the same field of the file.
#[derive(Args, Debug, Clone, Default)]
pub struct ControllerArgs {
    /// TOML configuration file; flags and WEFT_* variables override its fields.
    #[arg(global = true, long, env = "WEFT_CONFIG")]
    pub config: Option<PathBuf>,
    /// This site's id: 1-63 lower-case letters, digits, '-' or '.'.
    #[arg(global = true, long, env = "WEFT_SITE_ID")]
    pub site_id: Option<String>,
    /// Workload ("pod") CIDR, IPv4 or IPv6 (a /32 to a /64; each node gets
    /// a /64 of it); repeat (or comma-separate) for several. At least one
    /// is IPv4.
    #[arg(global = true, long = "pod-cidr", env = "WEFT_POD_CIDR", value_delimiter = ',')]
    pub pod_cidrs: Vec<String>,
    /// CIDR for host traffic toward peers [default: 10.70.0.0/16].
    #[arg(global = true, long, env = "WEFT_EXTERNAL_CIDR")]
    pub external_cidr: Option<String>,
    /// IPv6 CIDR for host traffic toward peers (a /48 to a /120); only
    /// with an IPv6 pod CIDR.
    #[arg(global = true, long, env = "WEFT_EXTERNAL_CIDR_V6")]
    pub external_cidr_v6: Option<String>,
    /// CIDR for the node-gateway overlay [default: 10.80.0.0/16].
    #[arg(global = true, long, env = "WEFT_INTERNAL_CIDR")]
    pub internal_cidr: Option<String>,
    /// A network the hosts already use (a LAN); never used for a remap. Repeatable.
    #[arg(long = "reserved-cidr", env = "WEFT_RESERVED_CIDR", value_delimiter = ',')]
    pub reserved_cidrs: Vec<String>,
    /// A pool that remapped peer CIDRs are taken from, IPv4 or IPv6.
    /// Repeatable [default: 10.0.0.0/8,172.16.0.0/12,192.168.0.0/16; for
    /// IPv6, a unique local /40 generated on first start and kept].
    #[arg(global = true, long = "remap-pool", env = "WEFT_REMAP_POOL", value_delimiter = ',')]
    pub remap_pools: Vec<String>,
    /// Prefix length of each node's workload subnet [default: 24].
    #[arg(global = true, long, env = "WEFT_NODE_PREFIX_LEN")]
    pub node_prefix_len: Option<u8>,
    /// Directory for the embedded store, the PKI and the admin socket [default: /var/lib/weft].
    #[arg(global = true, long, env = "WEFT_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// etcd endpoints (comma-separated http:// or https:// URLs); selects the etcd store.
    #[arg(global = true, long, env = "WEFT_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// Revisions of history the embedded store keeps for watches to resume
    /// from (100 to 1,000,000; etcd compacts by its own settings) [default: 10000].
    #[arg(global = true, long, env = "WEFT_STORE_HISTORY")]
    pub store_history: Option<i64>,
    /// CA certificate (PEM) that signs etcd's server certificate.
    #[arg(global = true, long, env = "WEFT_ETCD_CA_FILE")]
    pub etcd_ca_file: Option<PathBuf>,
    /// Client certificate (PEM) presented to etcd.
    #[arg(global = true, long, env = "WEFT_ETCD_CERT_FILE")]
    pub etcd_cert_file: Option<PathBuf>,
    /// Client key (PEM) for --etcd-cert-file.
    #[arg(global = true, long, env = "WEFT_ETCD_KEY_FILE")]
    pub etcd_key_file: Option<PathBuf>,
    /// Local admin socket (plaintext gRPC, mode 0600) [default: <data-dir>/admin.sock].
    #[arg(global = true, long, env = "WEFT_ADMIN_SOCKET")]
    pub admin_socket: Option<PathBuf>,
    /// TCP listener (TLS, client certificate required) [default: 0.0.0.0:7443].
    #[arg(global = true, long, env = "WEFT_LISTEN")]
    pub listen: Option<String>,
    /// Extra DNS name or IP address for the controller's server certificate. Repeatable.
    #[arg(global = true, long = "tls-san", env = "WEFT_TLS_SAN", value_delimiter = ',')]
    pub tls_sans: Vec<String>,
    /// Log format.
    #[arg(global = true, long, env = "WEFT_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// Serve Prometheus metrics on http://ADDR/metrics (e.g. 0.0.0.0:9100) [default: off].
    #[arg(global = true, long, env = "WEFT_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,
    /// Lifetime of agent certificates; agents renew at two thirds of it [default: 24h].
    #[arg(global = true, long, env = "WEFT_AGENT_CERT_TTL")]
    pub agent_cert_ttl: Option<String>,
    /// An agent that has not reported for this long is not ready [default: 15s].
    #[arg(global = true, long, env = "WEFT_AGENT_TTL")]
    pub agent_ttl: Option<String>,
    /// A gateway that has not reported for this long is failed over (one
    /// whose connection closes, at once) [default: 800ms].
    #[arg(global = true, long, env = "WEFT_GATEWAY_TTL")]
    pub gateway_ttl: Option<String>,
    /// host:port where other sites reach this controller (in peering tokens);
    /// repeatable [default: --listen when it names an address].
    #[arg(global = true, long = "advertise", env = "WEFT_ADVERTISE", value_delimiter = ',')]
    pub advertise: Vec<String>,
    /// A peer unreachable for this long is removed here [default: 24h].
    #[arg(global = true, long, env = "WEFT_PEER_GRACE")]
    pub peer_grace: Option<String>,
    /// MTU of the VXLAN overlay [default: each agent's underlay MTU − 50].
    #[arg(global = true, long, env = "WEFT_OVERLAY_MTU")]
    pub overlay_mtu: Option<u32>,
    /// MTU of the WireGuard tunnels to peers; the lower of the two sites'
    /// values wins [default: each gateway's underlay MTU − 80].
    #[arg(global = true, long, env = "WEFT_TUNNEL_MTU")]
    pub tunnel_mtu: Option<u32>,
    /// A peer's change of its CIDRs is applied at once when every new CIDR
    /// lies within one of these blocks; otherwise it waits for `weftctl
    /// peering accept` (repeatable) [default: none, hold every change].
    #[arg(
        global = true,
        long = "peer-cidr-auto-accept",
        env = "WEFT_PEER_CIDR_AUTO_ACCEPT",
        value_delimiter = ','
    )]
    pub peer_cidr_auto_accept: Vec<String>,
    /// A public block a peer may announce CIDRs in; such a CIDR is routed
    /// only through a remapped view. Repeatable. Without it, a peer may
    /// announce only private space (10/8, 172.16/12, 192.168/16, 100.64/10).
    #[arg(
        global = true,
        long = "peer-public-cidr",
        env = "WEFT_PEER_PUBLIC_CIDR",
        value_delimiter = ','
    )]
    pub peer_public_cidrs: Vec<String>,
    /// A peer CIDR that covers one of this site's hosts (underlay or
    /// controller address): `refuse` it at negotiation, or `remap` it like
    /// any other overlap [default: refuse].
    #[arg(
        global = true,
        long = "peer-cidr-over-underlay",
        env = "WEFT_PEER_CIDR_OVER_UNDERLAY",
        value_parser = underlay_overlap
    )]
    pub peer_cidr_over_underlay: Option<crate::domain::UnderlayOverlap>,
    /// What a peer may reach of this site when its peering has no export
    /// policy of its own (`weftctl peering policy set`): `all` of the
    /// workload and external CIDRs, or `none` [default: all].
    #[arg(
        global = true,
        long = "default-export",
        env = "WEFT_DEFAULT_EXPORT",
        value_parser = default_export
    )]
    pub default_export: Option<crate::export::DefaultExport>,
    /// UDP ports the gateways listen on, one per peering (FIRST-LAST); open
    /// them on every gateway. A gateway's --endpoint names where FIRST is
    /// reached [default: 51820-51919].
    #[arg(global = true, long, env = "WEFT_WIREGUARD_PORTS")]
    pub wireguard_ports: Option<String>,
    /// Relay tunnels between this site's peers that have no direct path
    /// (both behind NAT), through this site's active gateway, which needs
    /// an --endpoint; on --relay-ports.
    #[arg(global = true, long, env = "WEFT_RELAY")]
    pub relay: bool,
    /// UDP ports relayed tunnels use on the active gateway, two per tunnel
    /// (FIRST-LAST; implies --relay); open them on every gateway
    /// [default: 51920-51999].
    #[arg(global = true, long, env = "WEFT_RELAY_PORTS")]
    pub relay_ports: Option<String>,
    /// TCP port on which the active gateway also carries tunnels over TLS
    /// for peers whose UDP is blocked (implies --relay; 443 passes most
    /// firewalls); open it on every gateway [default: none].
    #[arg(global = true, long, env = "WEFT_RELAY_TLS_PORT")]
    pub relay_tls_port: Option<u16>,
}

/// The configuration file's shape. Unknown fields are errors.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub site_id: Option<String>,
    pub pod_cidrs: Option<Vec<String>>,
    pub external_cidr: Option<String>,
    pub external_cidr_v6: Option<String>,
    pub internal_cidr: Option<String>,
    pub reserved_cidrs: Option<Vec<String>>,
    pub remap_pools: Option<Vec<String>>,
    pub node_prefix_len: Option<u8>,
    pub data_dir: Option<PathBuf>,
    pub etcd_endpoints: Option<Vec<String>>,
    pub store_history: Option<i64>,
    pub etcd_ca_file: Option<PathBuf>,
    pub etcd_cert_file: Option<PathBuf>,
    pub etcd_key_file: Option<PathBuf>,
    pub admin_socket: Option<PathBuf>,
    pub listen: Option<String>,
    pub tls_sans: Option<Vec<String>>,
    pub log_format: Option<LogFormat>,
    pub metrics_listen: Option<String>,
    pub agent_cert_ttl: Option<String>,
    pub agent_ttl: Option<String>,
    pub gateway_ttl: Option<String>,
    pub advertise: Option<Vec<String>>,
    pub peer_grace: Option<String>,
    pub overlay_mtu: Option<u32>,
    pub tunnel_mtu: Option<u32>,
    pub wireguard_ports: Option<String>,
    pub relay: Option<bool>,
    pub relay_ports: Option<String>,
    pub relay_tls_port: Option<u16>,
    pub peer_cidr_auto_accept: Option<Vec<String>>,
    pub peer_public_cidrs: Option<Vec<String>>,
    pub peer_cidr_over_underlay: Option<crate::domain::UnderlayOverlap>,
    pub default_export: Option<crate::export::DefaultExport>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreConfig {
    Embedded {
        path: PathBuf,
        /// Revisions kept for watches.
        history: i64,
    },
    Etcd {
        endpoints: Vec<String>,
        tls: Option<EtcdTlsFiles>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdTlsFiles {
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

/// A complete, valid controller configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControllerConfig {
    pub site: Site,
    pub data_dir: PathBuf,
    pub store: StoreConfig,
    pub admin_socket: PathBuf,
    pub listen: SocketAddr,
    pub tls_sans: Vec<String>,
    pub log_format: LogFormat,
    pub metrics_listen: Option<SocketAddr>,
    pub agent_cert_ttl: std::time::Duration,
    pub agent_ttl: std::time::Duration,
    pub gateway_ttl: std::time::Duration,
    pub advertise: Vec<String>,
    pub peer_grace: std::time::Duration,
}

/// One problem with one field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

/// Everything wrong with a configuration, each naming its field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError(pub Vec<FieldError>);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "invalid configuration ({} problem{}):",
            self.0.len(),
            if self.0.len() == 1 { "" } else { "s" }
        )?;
        for e in &self.0 {
            let base = e.field.split('[').next().unwrap_or(&e.field);
            let hint = FLAGS
                .iter()
                .find(|(k, _, _)| *k == base)
                .map(|(_, flag, env)| format!(" ({flag}, {env})"));
            writeln!(f, "  - {}{}: {}", e.field, hint.unwrap_or_default(), e.message)?;
        }
        Ok(())
    }
}

/// Config file key → flag and environment variable, for error messages.
const FLAGS: &[(&str, &str, &str)] = &[
    ("site_id", "--site-id", "WEFT_SITE_ID"),
    ("pod_cidrs", "--pod-cidr", "WEFT_POD_CIDR"),
    ("external_cidr", "--external-cidr", "WEFT_EXTERNAL_CIDR"),
    ("external_cidr_v6", "--external-cidr-v6", "WEFT_EXTERNAL_CIDR_V6"),
    ("internal_cidr", "--internal-cidr", "WEFT_INTERNAL_CIDR"),
    ("reserved_cidrs", "--reserved-cidr", "WEFT_RESERVED_CIDR"),
    ("remap_pools", "--remap-pool", "WEFT_REMAP_POOL"),
    ("node_prefix_len", "--node-prefix-len", "WEFT_NODE_PREFIX_LEN"),
    ("data_dir", "--data-dir", "WEFT_DATA_DIR"),
    ("etcd_endpoints", "--etcd-endpoints", "WEFT_ETCD_ENDPOINTS"),
    ("store_history", "--store-history", "WEFT_STORE_HISTORY"),
    ("etcd_ca_file", "--etcd-ca-file", "WEFT_ETCD_CA_FILE"),
    ("etcd_cert_file", "--etcd-cert-file", "WEFT_ETCD_CERT_FILE"),
    ("etcd_key_file", "--etcd-key-file", "WEFT_ETCD_KEY_FILE"),
    ("admin_socket", "--admin-socket", "WEFT_ADMIN_SOCKET"),
    ("listen", "--listen", "WEFT_LISTEN"),
    ("tls_sans", "--tls-san", "WEFT_TLS_SAN"),
    ("metrics_listen", "--metrics-listen", "WEFT_METRICS_LISTEN"),
    ("agent_cert_ttl", "--agent-cert-ttl", "WEFT_AGENT_CERT_TTL"),
    ("agent_ttl", "--agent-ttl", "WEFT_AGENT_TTL"),
    ("gateway_ttl", "--gateway-ttl", "WEFT_GATEWAY_TTL"),
    ("advertise", "--advertise", "WEFT_ADVERTISE"),
    ("peer_grace", "--peer-grace", "WEFT_PEER_GRACE"),
    ("overlay_mtu", "--overlay-mtu", "WEFT_OVERLAY_MTU"),
    ("tunnel_mtu", "--tunnel-mtu", "WEFT_TUNNEL_MTU"),
    ("wireguard_ports", "--wireguard-ports", "WEFT_WIREGUARD_PORTS"),
    ("relay", "--relay", "WEFT_RELAY"),
    ("relay_ports", "--relay-ports", "WEFT_RELAY_PORTS"),
    ("relay_tls_port", "--relay-tls-port", "WEFT_RELAY_TLS_PORT"),
    (
        "peer_cidr_auto_accept",
        "--peer-cidr-auto-accept",
        "WEFT_PEER_CIDR_AUTO_ACCEPT",
    ),
    ("peer_public_cidrs", "--peer-public-cidr", "WEFT_PEER_PUBLIC_CIDR"),
    ("config", "--config", "WEFT_CONFIG"),
];

/// `--peer-cidr-over-underlay`'s value.
fn underlay_overlap(text: &str) -> Result<crate::domain::UnderlayOverlap, String> {
    use crate::domain::UnderlayOverlap;
    match text {
        "refuse" => Ok(UnderlayOverlap::Refuse),
        "remap" => Ok(UnderlayOverlap::Remap),
        _ => Err(format!("{text:?}: expected refuse or remap")),
    }
}

/// `--default-export`'s value.
fn default_export(text: &str) -> Result<crate::export::DefaultExport, String> {
    use crate::export::DefaultExport;
    match text {
        "all" => Ok(DefaultExport::All),
        "none" => Ok(DefaultExport::None),
        _ => Err(format!("{text:?}: expected all or none")),
    }
}

pub use crate::domain::parse_cidr;

/// Reads the file (if any) with `read` (the caller does the I/O:
/// `std::fs::read_to_string`), applies the flags over it, fills in defaults
/// and validates the result as a whole.
pub fn load(
    args: &ControllerArgs,
    read: &dyn Fn(&Path) -> std::io::Result<String>,
) -> Result<ControllerConfig, ConfigError> {
    let file = match &args.config {
        Some(path) => read_file(path, read)?,
        None => FileConfig::default(),
    };
    resolve(args, file)
}

fn read_file(path: &Path, read: &dyn Fn(&Path) -> std::io::Result<String>) -> Result<FileConfig, ConfigError> {
    let one = |m: String| {
        ConfigError(vec![FieldError {
            field: "config".into(),
            message: m,
        }])
    };
    let text = read(path).map_err(|e| one(format!("cannot read {}: {e}", path.display())))?;
    toml::from_str(&text).map_err(|e| {
        // toml names unknown fields and type mismatches with their location.
        one(format!(
            "{} is not a valid weft controller configuration: {}",
            path.display(),
            e.message().trim()
        ))
    })
}

fn pick<T: Clone>(flag: Option<T>, file: Option<T>) -> Option<T> {
    flag.or(file)
}

fn pick_list(flag: &[String], file: Option<Vec<String>>) -> Option<Vec<String>> {
    if flag.is_empty() { file } else { Some(flag.to_vec()) }
}

/// Merges flags over the file, then validates. Public for tests.
pub fn resolve(args: &ControllerArgs, file: FileConfig) -> Result<ControllerConfig, ConfigError> {
    let mut errs: Vec<FieldError> = Vec::new();
    let file = &file;
    let Networks {
        site_id,
        pod_cidrs,
        reserved,
        pools,
        peer_cidr_auto_accept,
        peer_public_cidrs,
        external,
        internal,
        node_len,
        ipv6,
    } = networks(args, file, &mut errs);
    let (data_dir, admin_socket, listen) = local(args, file, &mut errs);
    let (endpoints, tls_files, wants_tls) = etcd(args, file, &mut errs);
    let history = store_history(args, file, !endpoints.is_empty(), &mut errs);
    let Serving {
        tls_sans,
        log_format,
        metrics_listen,
        advertise,
    } = serving(args, file, &mut errs);
    let (peer_grace, agent_ttl, agent_cert_ttl) = lifetimes(args, file, &mut errs);
    let (gateway_ttl, overlay_mtu, tunnel_mtu, wireguard_ports) = data_path(args, file, &mut errs);
    let relay_ports = relay_ports(args, file, wireguard_ports, &mut errs);
    let relay_tls_port = pick(args.relay_tls_port, file.relay_tls_port);
    if relay_tls_port == Some(0) {
        errs.push(FieldError {
            field: "relay_tls_port".into(),
            message: "0 is no TCP port; give one from 1 to 65535 (443 passes most firewalls)".into(),
        });
    }
    if !errs.is_empty() {
        return Err(ConfigError(errs));
    }
    // Where the controllers are reached, by family: no local view may
    // cover them.
    let reached: Vec<std::net::IpAddr> = listen
        .iter()
        .map(|l| l.ip())
        .chain(
            advertise
                .iter()
                .filter_map(|a| a.parse::<SocketAddr>().ok())
                .map(|a| a.ip()),
        )
        .filter(|ip| !ip.is_unspecified() && !ip.is_loopback())
        .collect();
    let controller_ips: Vec<std::net::Ipv4Addr> = reached
        .iter()
        .filter_map(|ip| match ip {
            std::net::IpAddr::V4(v4) => Some(*v4),
            std::net::IpAddr::V6(_) => None,
        })
        .collect();
    let mut ipv6 = ipv6;
    if let Some(v6) = ipv6.as_mut() {
        v6.controller_ips = reached
            .iter()
            .filter_map(|ip| match ip {
                std::net::IpAddr::V6(a) => Some(*a),
                std::net::IpAddr::V4(_) => None,
            })
            .collect();
    }
    let store = if endpoints.is_empty() {
        StoreConfig::Embedded {
            path: data_dir.join("store.redb"),
            history,
        }
    } else {
        StoreConfig::Etcd {
            endpoints,
            tls: wants_tls.then_some(tls_files),
        }
    };
    Ok(ControllerConfig {
        site: Site {
            id: site_id.unwrap(),
            pod_cidrs,
            external_cidr: external.unwrap(),
            internal_cidr: internal.unwrap(),
            reserved_cidrs: reserved,
            remap_pools: pools,
            node_prefix_len: node_len,
            overlay_mtu,
            tunnel_mtu,
            wireguard_ports: wireguard_ports.unwrap(),
            peer_cidr_auto_accept,
            peer_public_cidrs,
            controller_ips,
            underlay_overlap: pick(args.peer_cidr_over_underlay, file.peer_cidr_over_underlay).unwrap_or_default(),
            default_export: pick(args.default_export, file.default_export).unwrap_or_default(),
            relay_tls_port: relay_tls_port.filter(|_| relay_ports.is_some()),
            relay_ports,
            ipv6,
        },
        data_dir,
        store,
        admin_socket,
        listen: listen.unwrap(),
        tls_sans,
        log_format,
        metrics_listen,
        agent_cert_ttl: agent_cert_ttl.unwrap(),
        agent_ttl: agent_ttl.unwrap(),
        gateway_ttl: gateway_ttl.unwrap(),
        advertise,
        peer_grace: peer_grace.unwrap(),
    })
}

#[cfg(test)]
mod tests;
