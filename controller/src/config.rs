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
mod tests {
    use super::*;

    fn args(site: &str, pods: &[&str]) -> ControllerArgs {
        ControllerArgs {
            site_id: Some(site.into()),
            pod_cidrs: pods.iter().map(|s| s.to_string()).collect(),
            data_dir: Some("/tmp/x".into()),
            ..Default::default()
        }
    }

    fn fields(e: ConfigError) -> Vec<String> {
        e.0.into_iter().map(|f| f.field).collect()
    }

    #[test]
    fn store_history_is_bounded_and_for_the_embedded_store_only() {
        let mut a = args("site-a", &["10.1.0.0/16"]);
        a.store_history = Some(1000);
        let c = resolve(&a, FileConfig::default()).unwrap();
        assert!(matches!(c.store, StoreConfig::Embedded { history: 1000, .. }));
        a.store_history = Some(10);
        assert_eq!(
            fields(resolve(&a, FileConfig::default()).unwrap_err()),
            ["store_history"]
        );
        a.store_history = Some(1000);
        a.etcd_endpoints = vec!["http://127.0.0.1:2379".into()];
        let e = resolve(&a, FileConfig::default()).unwrap_err();
        assert!(e.to_string().contains("embedded store only"), "{e}");
        assert_eq!(fields(e), ["store_history"]);
    }

    /// The example the Debian package installs as /etc/weft/controller.toml
    /// parses, refuses to start until the site's name and CIDRs are set
    /// (a controller started unedited would make a CA for a site that is
    /// not this one), and is valid once they are.
    #[test]
    fn the_shipped_example_configuration_wants_a_site_and_is_valid_with_one() {
        let text = include_str!("../../deploy/examples/controller.toml");
        let e = resolve(&ControllerArgs::default(), toml::from_str(text).unwrap()).unwrap_err();
        assert!(fields(e).contains(&"site_id".to_string()));
        let c = resolve(&args("site-a", &["10.1.0.0/16"]), toml::from_str(text).unwrap()).unwrap();
        assert_eq!(c.data_dir, PathBuf::from("/tmp/x"), "a flag overrides the file");
        let mut a = args("site-a", &["10.1.0.0/16"]);
        a.data_dir = None;
        let c = resolve(&a, toml::from_str(text).unwrap()).unwrap();
        assert_eq!(c.data_dir, PathBuf::from("/var/lib/weft"));
        assert_eq!(c.admin_socket, PathBuf::from("/var/lib/weft/admin.sock"));
    }

    #[test]
    fn minimal_flags_get_defaults() {
        let c = resolve(&args("site-a", &["10.1.0.0/16"]), FileConfig::default()).unwrap();
        assert_eq!(c.site.external_cidr.to_string(), DEFAULT_EXTERNAL_CIDR);
        assert_eq!(c.site.remap_pools.len(), 3);
        assert_eq!(c.site.node_prefix_len, 24);
        assert_eq!(c.admin_socket, PathBuf::from("/tmp/x/admin.sock"));
        assert_eq!(
            c.store,
            StoreConfig::Embedded {
                path: "/tmp/x/store.redb".into(),
                history: DEFAULT_STORE_HISTORY,
            }
        );
    }

    #[test]
    fn mtus_are_derived_unless_set_and_set_ones_are_checked() {
        let c = resolve(&args("site-a", &["10.1.0.0/16"]), FileConfig::default()).unwrap();
        assert_eq!((c.site.overlay_mtu, c.site.tunnel_mtu), (None, None));
        let file: FileConfig = toml::from_str("tunnel_mtu = 1380\n").unwrap();
        let c = resolve(&args("site-a", &["10.1.0.0/16"]), file).unwrap();
        assert_eq!(c.site.tunnel_mtu, Some(1380));
        let mut a = args("site-a", &["10.1.0.0/16"]);
        a.overlay_mtu = Some(1000);
        a.tunnel_mtu = Some(65000);
        let e = resolve(&a, FileConfig::default()).unwrap_err();
        assert_eq!(fields(e.clone()), ["overlay_mtu", "tunnel_mtu"]);
        assert!(
            e.to_string().contains("--overlay-mtu") && e.to_string().contains("1280 to 9000"),
            "{e}"
        );
    }

    #[test]
    fn the_controllers_addresses_are_kept_out_of_local_views() {
        let mut a = args("site-a", &["10.1.0.0/16"]);
        a.listen = Some("192.0.2.5:7443".into());
        a.advertise = vec!["198.51.100.9:443".into(), "ctl.example:7443".into()];
        let c = resolve(&a, FileConfig::default()).unwrap();
        let ips: Vec<String> = c.site.controller_ips.iter().map(|i| i.to_string()).collect();
        assert_eq!(ips, ["192.0.2.5", "198.51.100.9"]);
        assert!(c.site.own_blocks().contains(&"198.51.100.9/32".parse().unwrap()));
    }

    #[test]
    fn wireguard_ports_default_and_are_checked() {
        let c = resolve(&args("site-a", &["10.1.0.0/16"]), FileConfig::default()).unwrap();
        assert_eq!(c.site.wireguard_ports, PortRange::default());
        let file: FileConfig = toml::from_str("wireguard_ports = \"4000-4009\"\n").unwrap();
        let c = resolve(&args("site-a", &["10.1.0.0/16"]), file).unwrap();
        assert_eq!(c.site.wireguard_ports.count(), 10);
        let mut a = args("site-a", &["10.1.0.0/16"]);
        a.wireguard_ports = Some("51900-51820".into());
        let e = resolve(&a, FileConfig::default()).unwrap_err();
        assert_eq!(fields(e.clone()), ["wireguard_ports"]);
        assert!(e.to_string().contains("--wireguard-ports"), "{e}");
    }

    #[test]
    fn a_site_relays_only_when_asked_on_ports_apart_from_the_tunnels() {
        let c = resolve(&args("site-a", &["10.1.0.0/16"]), FileConfig::default()).unwrap();
        assert_eq!(c.site.relay_ports, None);
        let mut a = args("site-a", &["10.1.0.0/16"]);
        a.relay = true;
        let c = resolve(&a, FileConfig::default()).unwrap();
        assert_eq!(
            c.site.relay_ports,
            Some(PortRange {
                first: 51920,
                last: 51999
            })
        );
        let file: FileConfig = toml::from_str("relay_ports = \"6000-6009\"\n").unwrap();
        let c = resolve(&args("site-a", &["10.1.0.0/16"]), file).unwrap();
        assert_eq!(c.site.relay_ports.map(|r| r.count()), Some(10));
        for bad in ["51900-51950", "6000", "x"] {
            let mut a = args("site-a", &["10.1.0.0/16"]);
            a.relay_ports = Some(bad.into());
            let e = resolve(&a, FileConfig::default()).unwrap_err();
            assert_eq!(fields(e.clone()), ["relay_ports"], "{bad}");
            assert!(e.to_string().contains("--relay-ports"), "{e}");
        }
    }

    #[test]
    fn flags_override_the_file() {
        let file: FileConfig =
            toml::from_str("site_id = \"from-file\"\npod_cidrs = [\"10.9.0.0/16\"]\nnode_prefix_len = 26\n").unwrap();
        let c = resolve(&args("from-flag", &[]), file).unwrap();
        assert_eq!(c.site.id, "from-flag");
        assert_eq!(c.site.pod_cidrs[0].to_string(), "10.9.0.0/16");
        assert_eq!(c.site.node_prefix_len, 26);
    }

    #[test]
    fn each_problem_names_its_field() {
        let e = resolve(
            &args("Bad/Id", &["10.1.0.0/33", "10.1.2.3/16", "fe80::/64"]),
            FileConfig::default(),
        )
        .unwrap_err();
        assert_eq!(
            fields(e.clone()),
            ["site_id", "pod_cidrs[0]", "pod_cidrs[1]", "pod_cidrs[2]"],
            "{e}"
        );
        let text = e.to_string();
        assert!(text.contains("--pod-cidr"), "{text}");
        assert!(text.contains("10.1.0.0/16"), "host-bit hint: {text}");
        assert!(text.contains("link-local"), "{text}");
    }

    #[test]
    fn ipv6_cidrs_are_taken_beside_ipv4_and_bad_ones_are_named() {
        let mut a = args("s", &["10.1.0.0/16", "FD00:1::/48"]);
        a.external_cidr_v6 = Some("fd00:70::/64".into());
        a.remap_pools = vec!["fd9a::/40".into()];
        let c = resolve(&a, FileConfig::default()).unwrap();
        let v6 = c.site.ipv6.as_ref().unwrap();
        assert_eq!(c.site.pod_cidrs.len(), 1);
        assert_eq!(v6.pod_cidrs[0].to_string(), "fd00:1::/48", "normalised");
        assert_eq!(v6.external_cidr.unwrap().to_string(), "fd00:70::/64");
        assert_eq!(v6.remap_pools[0].to_string(), "fd9a::/40");
        assert_eq!(c.site.remap_pools.len(), 3, "IPv4 pools stay the defaults");
        // No IPv6 pool: one is generated when the site is first stored.
        let c = resolve(&args("s", &["10.1.0.0/16", "fd00:1::/48"]), FileConfig::default()).unwrap();
        assert!(c.site.ipv6.unwrap().remap_pools.is_empty());
        assert!(
            resolve(&args("s", &["10.1.0.0/16"]), FileConfig::default())
                .unwrap()
                .site
                .ipv6
                .is_none()
        );

        // An IPv6-only site: no IPv4 pods, its IPv6 ones.
        let only = resolve(&args("s", &["fd00:1::/48"]), FileConfig::default())
            .unwrap()
            .site;
        assert!(only.pod_cidrs.is_empty());
        assert_eq!(only.ipv6.unwrap().pod_cidrs[0].to_string(), "fd00:1::/48");

        for (pods, field, says) in [
            (&["10.1.0.0/16", "fd00:1::1/48"][..], "pod_cidrs[1]", "host bits set"),
            (&["10.1.0.0/16", "fd00:1:::/48"], "pod_cidrs[1]", "is not a CIDR"),
            (&["10.1.0.0/16", "fd00:1::/129"], "pod_cidrs[1]", "from 0 to 128"),
            (
                &["10.1.0.0/16", &format!("fd00::/{}", "4".repeat(80))],
                "pod_cidrs[1]",
                "too long",
            ),
            (&["10.1.0.0/16", "fd00:1::/72"], "pod_cidrs[1]", "give a /32 to a /64"),
            (&["10.1.0.0/16", "fd00::/16"], "pod_cidrs[1]", "give a /32 to a /64"),
            (&["10.1.0.0/16", "fe80::/64"], "pod_cidrs[1]", "link-local (fe80::/10)"),
            (&["10.1.0.0/16", "ff05::/48"], "pod_cidrs[1]", "multicast (ff00::/8)"),
            (&["10.1.0.0/16", "::1/128"], "pod_cidrs[1]", "loopback (::1)"),
            (
                &["10.1.0.0/16", "fd00:1::/48", "fd00:1:0:100::/56"],
                "pod_cidrs",
                "overlaps",
            ),
        ] {
            let e = resolve(&args("s", pods), FileConfig::default()).unwrap_err();
            let hit =
                e.0.iter()
                    .find(|f| f.field == field)
                    .unwrap_or_else(|| panic!("{pods:?}: {e}"));
            assert!(hit.message.contains(says), "{pods:?}: {}", hit.message);
        }
        for (external, says) in [
            ("10.71.0.0/16", "is IPv4; give the IPv4 external CIDR as external_cidr"),
            ("fd00:70::/32", "give a /48 to a /120"),
            ("fe80::/64", "link-local"),
            ("fd00:1::/64", "overlaps"),
        ] {
            let mut a = args("s", &["10.1.0.0/16", "fd00:1::/48"]);
            a.external_cidr_v6 = Some(external.into());
            let e = resolve(&a, FileConfig::default()).unwrap_err();
            let hit =
                e.0.iter()
                    .find(|f| f.field == "external_cidr_v6")
                    .unwrap_or_else(|| panic!("{external}: {e}"));
            assert!(hit.message.contains(says), "{external}: {}", hit.message);
        }
        let mut a = args("s", &["10.1.0.0/16"]);
        a.external_cidr_v6 = Some("fd00:70::/64".into());
        assert!(
            resolve(&a, FileConfig::default())
                .unwrap_err()
                .to_string()
                .contains("no IPv6 pod CIDR")
        );
        a.external_cidr_v6 = None;
        a.external_cidr = Some("fd00:70::/64".into());
        assert!(
            resolve(&a, FileConfig::default())
                .unwrap_err()
                .to_string()
                .contains("external_cidr_v6")
        );
        let mut a = args("s", &["10.1.0.0/16", "fd00:1::/48"]);
        a.remap_pools = vec!["ff00::/8".into()];
        assert!(
            resolve(&a, FileConfig::default())
                .unwrap_err()
                .to_string()
                .contains("remap_pools[0]")
        );
        // IPv6 entries on an IPv4 site are not dropped unread.
        let mut a = args("s", &["10.1.0.0/16"]);
        a.reserved_cidrs = vec!["fd00:9::/48".into()];
        let e = resolve(&a, FileConfig::default()).unwrap_err();
        assert_eq!(fields(e.clone()), ["reserved_cidrs"], "{e}");
        assert!(e.to_string().contains("no IPv6 pod CIDR"), "{e}");
        // IPv4 special space is left as it was: a running site keeps starting.
        assert!(resolve(&args("s", &["10.1.0.0/16", "169.254.0.0/16"]), FileConfig::default()).is_ok());
    }

    #[test]
    fn overlaps_and_prefix_bounds_are_refused() {
        let mut a = args("s", &["10.70.0.0/16"]);
        let e = resolve(&a, FileConfig::default()).unwrap_err();
        assert_eq!(fields(e.clone()), ["external_cidr"]);
        assert!(e.to_string().contains("(the default)"), "{e}");
        a.pod_cidrs = vec!["10.1.0.0/16".into()];
        a.reserved_cidrs = vec!["10.1.4.0/24".into()];
        a.node_prefix_len = Some(31);
        let e = resolve(&a, FileConfig::default()).unwrap_err();
        assert_eq!(fields(e), ["node_prefix_len", "reserved_cidrs[0]"]);
        a.reserved_cidrs.clear();
        a.node_prefix_len = Some(15);
        assert_eq!(
            fields(resolve(&a, FileConfig::default()).unwrap_err()),
            ["node_prefix_len"]
        );
    }

    #[test]
    fn missing_required_and_bad_etcd() {
        let a = ControllerArgs {
            etcd_endpoints: vec!["127.0.0.1:2379".into(), "https://h:1".into()],
            listen: Some("nowhere".into()),
            ..Default::default()
        };
        let e = resolve(&a, FileConfig::default()).unwrap_err();
        assert_eq!(
            fields(e),
            [
                "site_id",
                "pod_cidrs",
                "listen",
                "etcd_endpoints[0]",
                "etcd_endpoints[1]"
            ]
        );
    }

    #[test]
    fn unknown_file_field_is_named() {
        let a = ControllerArgs {
            config: Some("c.toml".into()),
            ..Default::default()
        };
        let e = load(&a, &|_| Ok("site_id = \"a\"\npod_cidr = \"10.0.0.0/8\"\n".into()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("pod_cidr"), "{e}");
    }
}
