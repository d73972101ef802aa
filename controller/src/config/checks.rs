//! Each part of the controller's configuration checked on its own, every
//! problem collected with its field (see `resolve`, which puts them
//! together).

use super::*;

mod disjoint;
mod ipv6;
use disjoint::disjoint;
use ipv6::{anything, cidr_lists, ordinary, workload};

/// The site's networks, each checked, and checked against each other.
pub(super) struct Networks {
    pub(super) site_id: Option<String>,
    pub(super) pod_cidrs: Vec<Ipv4Net>,
    pub(super) reserved: Vec<Ipv4Net>,
    pub(super) pools: Vec<Ipv4Net>,
    pub(super) peer_cidr_auto_accept: Vec<Ipv4Net>,
    pub(super) peer_public_cidrs: Vec<Ipv4Net>,
    pub(super) external: Option<Ipv4Net>,
    pub(super) internal: Option<Ipv4Net>,
    pub(super) node_len: u8,
    pub(super) ipv6: Option<crate::domain::Ipv6Networks>,
}

pub(super) fn networks(args: &ControllerArgs, file: &FileConfig, errs: &mut Vec<FieldError>) -> Networks {
    let mut err = |field: &str, message: String| {
        errs.push(FieldError {
            field: field.into(),
            message,
        })
    };

    let site_id = pick(args.site_id.clone(), file.site_id.clone());
    if let Err(m) = site_id
        .as_deref()
        .ok_or_else(|| "is required; set it to this site's name, e.g. \"site-a\"".to_string())
        .and_then(|id| validate_name("the site id", id))
    {
        err("site_id", m);
    }

    let mut list_errs: Vec<(String, String)> = Vec::new();
    let pod_texts = pick_list(&args.pod_cidrs, file.pod_cidrs.clone()).unwrap_or_default();
    let pod_missing = pod_texts.is_empty();
    let (pod_cidrs, pod_v6) = cidr_lists("pod_cidrs", &pod_texts, workload, &mut list_errs);
    let (reserved, reserved_v6) = cidr_lists(
        "reserved_cidrs",
        &pick_list(&args.reserved_cidrs, file.reserved_cidrs.clone()).unwrap_or_default(),
        anything,
        &mut list_errs,
    );
    let pool_texts = pick_list(&args.remap_pools, file.remap_pools.clone());
    let (mut pools, pools_v6) = cidr_lists(
        "remap_pools",
        pool_texts.as_deref().unwrap_or_default(),
        ordinary,
        &mut list_errs,
    );
    // Only IPv6 pools given: IPv4 views still come from the defaults.
    if pools.is_empty() {
        pools = DEFAULT_REMAP_POOLS
            .iter()
            .map(|s| s.parse().expect("a default pool"))
            .collect();
    }
    let (peer_cidr_auto_accept, auto_accept_v6) = cidr_lists(
        "peer_cidr_auto_accept",
        &pick_list(&args.peer_cidr_auto_accept, file.peer_cidr_auto_accept.clone()).unwrap_or_default(),
        anything,
        &mut list_errs,
    );
    let (peer_public_cidrs, public_v6) = cidr_lists(
        "peer_public_cidrs",
        &pick_list(&args.peer_public_cidrs, file.peer_public_cidrs.clone()).unwrap_or_default(),
        anything,
        &mut list_errs,
    );
    for (f, m) in list_errs {
        err(&f, m);
    }
    if pod_missing {
        err(
            "pod_cidrs",
            "is required; give the workload CIDR(s) of this site, e.g. 10.1.0.0/16".into(),
        );
    }
    // Only IPv6 CIDRs: an IPv6-only site (its nodes get a /64 each, no
    // IPv4 subnet; it offers peers no IPv4).

    let ipv6 = ipv6::site_v6(
        pick(args.external_cidr_v6.clone(), file.external_cidr_v6.clone()),
        ipv6::Lists {
            pods: pod_v6,
            reserved: reserved_v6,
            pools: pools_v6,
            auto_accept: auto_accept_v6,
            public: public_v6,
        },
        &mut err,
    );

    let mut single = |field: &str, v: Option<String>, default: &str| -> Option<Ipv4Net> {
        let v = v.unwrap_or_else(|| default.to_string());
        let parsed = weft_types::net::cidr(&v).and_then(|c| {
            c.v4().ok_or_else(|| match field {
                "external_cidr" => format!("{c} is IPv6; give the IPv6 external CIDR as external_cidr_v6"),
                _ => format!("{c} is IPv6; the {field} is IPv4"),
            })
        });
        match parsed {
            Ok(n) if n.prefix_len() > 30 => {
                err(field, format!("{n} is too small; use a /30 or larger block"));
                None
            }
            Ok(n) => Some(n),
            Err(m) => {
                err(field, m);
                None
            }
        }
    };
    let external = single(
        "external_cidr",
        pick(args.external_cidr.clone(), file.external_cidr.clone()),
        DEFAULT_EXTERNAL_CIDR,
    );
    let internal = single(
        "internal_cidr",
        pick(args.internal_cidr.clone(), file.internal_cidr.clone()),
        DEFAULT_INTERNAL_CIDR,
    );

    let node_len = pick(args.node_prefix_len, file.node_prefix_len).unwrap_or(DEFAULT_NODE_PREFIX_LEN);
    node_len_fits(node_len, &pod_cidrs, &mut err);
    disjoint(&pod_cidrs, external, internal, &reserved, &pools, &mut err);

    Networks {
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
    }
}

/// A node's subnet leaves room for workloads and fits in every pod CIDR.
pub(super) fn node_len_fits(node_len: u8, pod_cidrs: &[Ipv4Net], err: &mut impl FnMut(&str, String)) {
    if node_len > 30 {
        err(
            "node_prefix_len",
            format!("/{node_len} leaves no room for workloads; use at most 30"),
        );
    }
    for (i, p) in pod_cidrs.iter().enumerate() {
        if node_len < p.prefix_len() {
            err(
                "node_prefix_len",
                format!(
                    "/{node_len} is larger than pod_cidrs[{i}] {p}; a node subnet must fit in a pod CIDR \
                     (use {} or more, or a larger pod CIDR)",
                    p.prefix_len()
                ),
            );
        }
    }
}

/// Where the controller keeps its data and listens: (data_dir,
/// admin_socket, listen).
pub(super) fn local(
    args: &ControllerArgs,
    file: &FileConfig,
    errs: &mut Vec<FieldError>,
) -> (PathBuf, PathBuf, Option<SocketAddr>) {
    let mut err = |field: &str, message: String| {
        errs.push(FieldError {
            field: field.into(),
            message,
        })
    };

    let data_dir =
        pick(args.data_dir.clone(), file.data_dir.clone()).unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
    if data_dir.as_os_str().is_empty() {
        err("data_dir", "is empty; give a directory the controller may write".into());
    }
    let admin_socket =
        pick(args.admin_socket.clone(), file.admin_socket.clone()).unwrap_or_else(|| data_dir.join("admin.sock"));
    // sun_path holds 108 bytes including the NUL.
    if admin_socket.as_os_str().len() > 107 {
        err(
            "admin_socket",
            format!(
                "{} is longer than the 107 bytes a unix socket path may have; choose a shorter path",
                admin_socket.display()
            ),
        );
    }

    let listen_text = pick(args.listen.clone(), file.listen.clone()).unwrap_or_else(|| DEFAULT_LISTEN.to_string());
    let listen = match listen_text.parse::<SocketAddr>() {
        Ok(a) => Some(a),
        Err(_) => {
            err(
                "listen",
                format!("{listen_text:?} is not an address:port; write e.g. 0.0.0.0:7443 or [::1]:7443"),
            );
            None
        }
    };

    (data_dir, admin_socket, listen)
}

/// The etcd store, if one is configured: (endpoints, TLS files, whether
/// TLS is on).
pub(super) fn etcd(
    args: &ControllerArgs,
    file: &FileConfig,
    errs: &mut Vec<FieldError>,
) -> (Vec<String>, EtcdTlsFiles, bool) {
    let mut err = |field: &str, message: String| {
        errs.push(FieldError {
            field: field.into(),
            message,
        })
    };

    let endpoints = pick_list(&args.etcd_endpoints, file.etcd_endpoints.clone()).unwrap_or_default();
    let endpoints: Vec<String> = endpoints
        .into_iter()
        .map(|e| e.trim().to_string())
        .filter(|e| !e.is_empty())
        .collect();
    let tls_files = EtcdTlsFiles {
        ca_file: pick(args.etcd_ca_file.clone(), file.etcd_ca_file.clone()),
        cert_file: pick(args.etcd_cert_file.clone(), file.etcd_cert_file.clone()),
        key_file: pick(args.etcd_key_file.clone(), file.etcd_key_file.clone()),
    };
    let wants_tls = tls_files.ca_file.is_some() || tls_files.cert_file.is_some() || tls_files.key_file.is_some();
    for (i, e) in endpoints.iter().enumerate() {
        let ok = e
            .strip_prefix("http://")
            .or_else(|| e.strip_prefix("https://"))
            .is_some_and(|hp| {
                hp.rsplit_once(':')
                    .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
            });
        if !ok {
            err(
                &format!("etcd_endpoints[{i}]"),
                format!("{e:?} is not an etcd URL; write e.g. http://127.0.0.1:2379"),
            );
        } else if wants_tls != e.starts_with("https://") {
            err(
                &format!("etcd_endpoints[{i}]"),
                if wants_tls {
                    format!("{e:?} is plain http but etcd TLS files are set; use https://")
                } else {
                    format!(
                        "{e:?} is https but no etcd TLS files are set; set etcd_ca_file (and a client cert if etcd asks for one)"
                    )
                },
            );
        }
    }
    if tls_files.cert_file.is_some() != tls_files.key_file.is_some() {
        err("etcd_cert_file", "an etcd client certificate needs its key and the other way round: set both etcd_cert_file and etcd_key_file".into());
    }
    for (f, p) in [
        ("etcd_ca_file", &tls_files.ca_file),
        ("etcd_cert_file", &tls_files.cert_file),
        ("etcd_key_file", &tls_files.key_file),
    ] {
        if let Some(p) = p
            && !p.is_file()
        {
            err(f, format!("{} does not exist or is not a file", p.display()));
        }
    }
    if wants_tls && endpoints.is_empty() {
        err(
            "etcd_endpoints",
            "etcd TLS files are set but no etcd endpoints; set etcd_endpoints or drop the TLS files".into(),
        );
    }

    (endpoints, tls_files, wants_tls)
}

/// Revisions of history the embedded store keeps (refused with etcd,
/// which compacts by its own settings).
pub(super) fn store_history(
    args: &ControllerArgs,
    file: &FileConfig,
    on_etcd: bool,
    errs: &mut Vec<FieldError>,
) -> i64 {
    let history = pick(args.store_history, file.store_history);
    let mut err = |message: String| {
        errs.push(FieldError {
            field: "store_history".into(),
            message,
        })
    };
    match history {
        Some(_) if on_etcd => {
            err("applies to the embedded store only; etcd keeps history by its own --auto-compaction settings".into())
        }
        Some(h) if !(100..=1_000_000).contains(&h) => err(format!(
            "{h} revisions: give 100 to 1000000 (default {DEFAULT_STORE_HISTORY})"
        )),
        _ => {}
    }
    history.unwrap_or(DEFAULT_STORE_HISTORY)
}

/// How the controller is reached and observed.
pub(super) struct Serving {
    pub(super) tls_sans: Vec<String>,
    pub(super) log_format: LogFormat,
    pub(super) metrics_listen: Option<SocketAddr>,
    pub(super) advertise: Vec<String>,
}

pub(super) fn serving(args: &ControllerArgs, file: &FileConfig, errs: &mut Vec<FieldError>) -> Serving {
    let mut err = |field: &str, message: String| {
        errs.push(FieldError {
            field: field.into(),
            message,
        })
    };

    let tls_sans = pick_list(&args.tls_sans, file.tls_sans.clone()).unwrap_or_default();
    for (i, s) in tls_sans.iter().enumerate() {
        if s.trim().is_empty() || s.contains(char::is_whitespace) {
            err(
                &format!("tls_sans[{i}]"),
                format!("{s:?} is not a DNS name or IP address"),
            );
        }
    }
    let log_format = pick(args.log_format, file.log_format).unwrap_or_default();
    let metrics_listen = match pick(args.metrics_listen.clone(), file.metrics_listen.clone()) {
        None => None,
        Some(t) => match t.parse::<SocketAddr>() {
            Ok(a) => Some(a),
            Err(_) => {
                err(
                    "metrics_listen",
                    format!("{t:?} is not an address:port; write e.g. 0.0.0.0:9100"),
                );
                None
            }
        },
    };
    let advertise = pick_list(&args.advertise, file.advertise.clone()).unwrap_or_default();
    for (i, a) in advertise.iter().enumerate() {
        let ok = a
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
        if !ok {
            err(
                &format!("advertise[{i}]"),
                format!("{a:?} is not host:port; write e.g. ctl.site-a.example:7443"),
            );
        }
    }
    Serving {
        tls_sans,
        log_format,
        metrics_listen,
        advertise,
    }
}

/// Lifetimes: (peer_grace, agent_ttl, agent_cert_ttl).
#[allow(clippy::type_complexity)]
pub(super) fn lifetimes(
    args: &ControllerArgs,
    file: &FileConfig,
    errs: &mut Vec<FieldError>,
) -> (Option<Duration>, Option<Duration>, Option<Duration>) {
    let mut err = |field: &str, message: String| {
        errs.push(FieldError {
            field: field.into(),
            message,
        })
    };

    let ttl_text = pick(args.agent_cert_ttl.clone(), file.agent_cert_ttl.clone()).unwrap_or_else(|| "24h".into());
    let grace_text = pick(args.peer_grace.clone(), file.peer_grace.clone()).unwrap_or_else(|| "24h".into());
    let peer_grace = match humantime::parse_duration(&grace_text) {
        Ok(d) if d >= Duration::from_secs(1) => Some(d),
        _ => {
            err(
                "peer_grace",
                format!("{grace_text:?} is not a duration of at least 1s; write e.g. 24h"),
            );
            None
        }
    };
    let live_text = pick(args.agent_ttl.clone(), file.agent_ttl.clone()).unwrap_or_else(|| "15s".into());
    let agent_ttl = match humantime::parse_duration(&live_text) {
        Ok(d) if d >= Duration::from_secs(1) && d <= Duration::from_secs(3600) => Some(d),
        Ok(_) => {
            err(
                "agent_ttl",
                format!("{live_text:?} is out of range; give between 1s and 1h"),
            );
            None
        }
        Err(_) => {
            err("agent_ttl", format!("{live_text:?} is not a duration; write e.g. 15s"));
            None
        }
    };
    let agent_cert_ttl = match humantime::parse_duration(&ttl_text) {
        Ok(d) if d >= Duration::from_secs(10) && d <= Duration::from_secs(365 * 86400) => Some(d),
        Ok(_) => {
            err(
                "agent_cert_ttl",
                format!("{ttl_text:?} is out of range; give between 10s and 365d"),
            );
            None
        }
        Err(_) => {
            err(
                "agent_cert_ttl",
                format!("{ttl_text:?} is not a duration; write e.g. 24h, 90m or 7d"),
            );
            None
        }
    };

    (peer_grace, agent_ttl, agent_cert_ttl)
}

/// The data path's settings: (gateway_ttl, overlay_mtu, tunnel_mtu,
/// wireguard_ports).
#[allow(clippy::type_complexity)]
pub(super) fn data_path(
    args: &ControllerArgs,
    file: &FileConfig,
    errs: &mut Vec<FieldError>,
) -> (Option<Duration>, Option<u32>, Option<u32>, Option<PortRange>) {
    let gw_text = pick(args.gateway_ttl.clone(), file.gateway_ttl.clone()).unwrap_or_else(|| "800ms".into());
    let gateway_ttl = match humantime::parse_duration(&gw_text) {
        Ok(d) if d >= Duration::from_millis(300) && d <= Duration::from_secs(3600) => Some(d),
        _ => {
            errs.push(FieldError {
                field: "gateway_ttl".into(),
                message: format!("{gw_text:?}: give a duration from 300ms to 1h, e.g. 800ms"),
            });
            None
        }
    };
    // 1280: the least IPv6 (and so WireGuard's peers) must carry.
    let mtu = |name: &str, v: Option<u32>, errs: &mut Vec<FieldError>| match v {
        Some(m) if !(1280..=9000).contains(&m) => {
            errs.push(FieldError {
                field: name.into(),
                message: format!(
                    "{m} is out of range; give 1280 to 9000, or leave it unset to derive it from the underlay"
                ),
            });
            None
        }
        v => v,
    };
    let overlay_mtu = mtu("overlay_mtu", pick(args.overlay_mtu, file.overlay_mtu), errs);
    let tunnel_mtu = mtu("tunnel_mtu", pick(args.tunnel_mtu, file.tunnel_mtu), errs);
    let wireguard_ports = match pick(args.wireguard_ports.clone(), file.wireguard_ports.clone()) {
        None => Some(PortRange::default()),
        Some(text) => match PortRange::parse(&text) {
            Ok(r) => Some(r),
            Err(message) => {
                errs.push(FieldError {
                    field: "wireguard_ports".into(),
                    message,
                });
                None
            }
        },
    };
    (gateway_ttl, overlay_mtu, tunnel_mtu, wireguard_ports)
}

/// The relay's ports: None when this site does not relay.
pub(super) fn relay_ports(
    args: &ControllerArgs,
    file: &FileConfig,
    wg: Option<PortRange>,
    errs: &mut Vec<FieldError>,
) -> Option<PortRange> {
    let text = pick(args.relay_ports.clone(), file.relay_ports.clone());
    let on = args.relay
        || file.relay == Some(true)
        || text.is_some()
        || pick(args.relay_tls_port, file.relay_tls_port).is_some();
    if !on {
        return None;
    }
    let range = match text {
        None => PortRange {
            first: 51920,
            last: 51999,
        },
        Some(t) => match PortRange::parse(&t) {
            Ok(r) if r.count() >= 2 => r,
            Ok(_) => {
                errs.push(FieldError {
                    field: "relay_ports".into(),
                    message: format!("{t:?} is one port; a relayed tunnel takes two"),
                });
                return None;
            }
            Err(message) => {
                errs.push(FieldError {
                    field: "relay_ports".into(),
                    message,
                });
                return None;
            }
        },
    };
    if let Some(w) = wg
        && range.first <= w.last
        && w.first <= range.last
    {
        errs.push(FieldError {
            field: "relay_ports".into(),
            message: format!("{range} overlaps the WireGuard ports {w}; give ports outside them"),
        });
        return None;
    }
    Some(range)
}
