//! The agent's door and its copy of the desired state. Every object that
//! comes in (from the controller's Watch stream, from the state file
//! written earlier, or made by the agent itself from its flags) is decoded
//! here, once, into a [`Held`]: the typed object
//! ([`weft_dataplane::desired::Object`]) that the guard checks and the
//! planner, DNS responder, probes and relays read, or why it does not
//! decode. No other part of the agent reads a controller's message.
//!
//! What the agent last received and applied is kept in memory and on disk
//! (`<state-dir>/desired-state.pb`, a `weft.v1.StateFile` with a format
//! number), so that an agent that restarts while its controller is
//! unreachable applies it again and keeps the host as it was.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use prost::Message;
use weft_dataplane::desired::Object;
use weft_proto::v1 as pb;
use weft_proto::v1::desired_object::Kind;

/// The objects an agent holds, by id, each decoded at its door.
pub type Objects = std::collections::BTreeMap<String, Held>;

/// One object the agent holds: decoded once, as it came in, and as it was
/// sent (kept for the state file and for the hash the controller compares
/// when a session resumes).
#[derive(Clone, Debug)]
pub struct Held {
    raw: pb::DesiredObject,
    /// The object, or why it does not decode (reported, never applied).
    pub decoded: Result<Object, String>,
}

/// Two held objects are equal when the controller sent the same thing.
impl PartialEq for Held {
    fn eq(&self, other: &Held) -> bool {
        self.raw == other.raw
    }
}

impl From<pb::DesiredObject> for Held {
    fn from(raw: pb::DesiredObject) -> Held {
        let decoded = weft_dataplane::desired::decode(&raw);
        Held { raw, decoded }
    }
}

impl Held {
    pub fn id(&self) -> &str {
        &self.raw.id
    }

    /// The decoded object (None: it does not decode).
    pub fn object(&self) -> Option<&Object> {
        self.decoded.as_ref().ok()
    }

    /// One line describing the object as the controller sent it, as an
    /// operator reads it (`--dry-run`).
    pub fn describe(&self) -> String {
        describe(&self.raw)
    }
}

pub const STATE_FILE: &str = "desired-state.pb";
/// The file format this agent writes and reads.
pub const FORMAT: u32 = 1;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Desired {
    pub revision: i64,
    pub objects: Objects,
}

impl Desired {
    /// What the agent tells the controller it holds (not its own local
    /// objects, which the controller knows nothing of).
    pub fn known(&self) -> Vec<pb::ObjectVersion> {
        self.objects
            .values()
            .filter(|o| !is_local(o.id()))
            .map(|o| pb::ObjectVersion {
                id: o.id().to_string(),
                hash: weft_proto::object_hash(&o.raw),
            })
            .collect()
    }

    /// What a message from the controller changes in the held state:
    /// (upserts, decoded here, and deletes) as the applier should see them.
    pub fn changes(&self, msg: &pb::WatchResponse) -> (Vec<Held>, Vec<String>) {
        match &msg.kind {
            Some(pb::watch_response::Kind::Snapshot(s)) => {
                let new: std::collections::HashSet<&str> = s.objects.iter().map(|o| o.id.as_str()).collect();
                let deletes = self
                    .objects
                    .keys()
                    .filter(|k| !new.contains(k.as_str()) && !is_local(k))
                    .cloned()
                    .collect();
                (s.objects.iter().cloned().map(Held::from).collect(), deletes)
            }
            Some(pb::watch_response::Kind::Delta(d)) => {
                (d.upserts.iter().cloned().map(Held::from).collect(), d.deletes.clone())
            }
            None => (Vec::new(), Vec::new()),
        }
    }

    pub fn commit(&mut self, revision: i64, upserts: Vec<Held>, deletes: &[String]) {
        for id in deletes {
            self.objects.remove(id);
        }
        for o in upserts {
            self.objects.insert(o.id().to_string(), o);
        }
        self.revision = revision;
    }
}

/// Ids of objects the agent adds itself (from its own flags, e.g. the
/// workload bridge), kept beside the controller's in the stored state so
/// that a teardown removes them too.
pub const LOCAL_PREFIX: &str = "local/";

pub fn is_local(id: &str) -> bool {
    id.starts_with(LOCAL_PREFIX)
}

/// The node's workload bridge: the link, and the first address of each of
/// the node's subnets on it (which also routes the subnet to the bridge):
/// IPv4, IPv6 (its /64), or both; an IPv6-only site's nodes have no IPv4
/// subnet. With IPv6 also [`BRIDGE_LINK_LOCAL`]: weft makes its links
/// without a kernel-made link-local address, and the kernel resolves a
/// workload's address for forwarded traffic only from a link-local source
/// (workloads may also route by it).
pub fn bridge_objects(bridge: &str, subnet: &str, subnet_v6: &str) -> anyhow::Result<Vec<Held>> {
    if subnet.is_empty() && subnet_v6.is_empty() {
        anyhow::bail!("the controller gave the node no subnet of either family");
    }
    let mut addresses = Vec::new();
    for (id, text) in [("bridge/addr", subnet), ("bridge/addr6", subnet_v6)] {
        if !text.is_empty() {
            let (first, len) = first_address(text)?;
            addresses.push((id, format!("{first}/{len}")));
        }
    }
    if !subnet_v6.is_empty() {
        addresses.push(("bridge/addr6-ll", BRIDGE_LINK_LOCAL.to_string()));
    }
    let link = pb::DesiredObject {
        id: format!("{LOCAL_PREFIX}bridge"),
        kind: Some(pb::desired_object::Kind::Link(pb::Link {
            name: bridge.to_string(),
            namespace: String::new(),
            mtu: 0,
            kind: Some(pb::link::Kind::Bridge(pb::Bridge {})),
        })),
    };
    Ok(std::iter::once(link)
        .chain(addresses.into_iter().map(|(id, cidr)| pb::DesiredObject {
            id: format!("{LOCAL_PREFIX}{id}"),
            kind: Some(pb::desired_object::Kind::Address(pb::Address {
                link: bridge.to_string(),
                namespace: String::new(),
                cidr,
                // The workloads are reached by this prefix route.
                no_prefix_route: false,
            })),
        }))
        .map(Held::from)
        .collect())
}

/// The workload bridge's IPv6 link-local address.
pub const BRIDGE_LINK_LOCAL: &str = "fe80::1/64";

/// The first host address of a subnet the controller gave (`::1` of an
/// IPv6 one), and its prefix length.
pub fn first_address(subnet: &str) -> anyhow::Result<(std::net::IpAddr, u8)> {
    let net: ipnet::IpNet = subnet
        .parse()
        .with_context(|| format!("the controller gave no usable subnet ({subnet:?})"))?;
    let first = match net {
        ipnet::IpNet::V4(n) => n.hosts().next().map(std::net::IpAddr::V4),
        ipnet::IpNet::V6(n) => {
            (n.prefix_len() < 128).then(|| std::net::IpAddr::V6(std::net::Ipv6Addr::from(u128::from(n.network()) + 1)))
        }
    };
    let first = first.with_context(|| format!("subnet {net} has no host address for the bridge"))?;
    Ok((first, net.prefix_len()))
}

/// One line describing an object, as an operator reads it.
fn describe(o: &pb::DesiredObject) -> String {
    match &o.kind {
        Some(Kind::Namespace(n)) => format!("netns {}", n.name),
        Some(Kind::Link(l)) => {
            let ns = if l.namespace.is_empty() {
                String::new()
            } else {
                format!(" netns {}", l.namespace)
            };
            let kind = match &l.kind {
                Some(pb::link::Kind::Vxlan(v)) => {
                    format!(
                        "vxlan id {} local {} remote {} dstport {}",
                        v.vni, v.local, v.remote, v.port
                    )
                }
                Some(pb::link::Kind::Geneve(g)) => format!("geneve id {} remote {}", g.vni, g.remote),
                Some(pb::link::Kind::Wireguard(w)) => format!("wireguard listen-port {}", w.listen_port),
                Some(pb::link::Kind::Veth(v)) => format!("veth peer {}", v.peer_name),
                Some(pb::link::Kind::Bridge(_)) => "bridge".into(),
                None => "?".into(),
            };
            format!("link {}{ns} type {kind} mtu {}", l.name, l.mtu)
        }
        Some(Kind::Address(a)) => format!("address {} dev {}", a.cidr, a.link),
        Some(Kind::Route(r)) => {
            let via = if r.gateway.is_empty() {
                String::new()
            } else {
                format!(" via {}", r.gateway)
            };
            format!("route {}{via} dev {} table {}", r.destination, r.device, r.table)
        }
        Some(Kind::Rule(r)) => {
            let from = if r.from.is_empty() {
                String::new()
            } else {
                format!(" from {}", r.from)
            };
            let to = if r.to.is_empty() {
                String::new()
            } else {
                format!(" to {}", r.to)
            };
            format!("rule priority {}{from}{to} lookup {}", r.priority, r.table)
        }
        Some(Kind::NatMap(n)) => format!("prefix NAT in {}: {} <-> {}", n.namespace, n.local_cidr, n.real_cidr),
        Some(Kind::WireguardPeer(p)) => {
            format!("wireguard peer {} on {} endpoint {}", p.public_key, p.link, p.endpoint)
        }
        Some(Kind::HostSnat(h)) => {
            format!(
                "source NAT of host traffic out {} to {} (not from {})",
                h.link,
                h.address,
                h.except.join(", ")
            )
        }
        Some(Kind::DnsRecord(r)) => format!(
            "DNS name {}.{} -> {}",
            r.name,
            r.site,
            [r.address.as_str(), r.address_v6.as_str()]
                .into_iter()
                .filter(|a| !a.is_empty())
                .collect::<Vec<_>>()
                .join(" ")
        ),
        Some(Kind::ExportMap(x)) => format!(
            "export in {}: {} from {} -> {}",
            x.namespace, x.external_address, x.tunnel, x.host_address
        ),
        Some(Kind::TunnelFilter(f)) => {
            let policy = if f.policed {
                let rules: Vec<String> = f
                    .exports
                    .iter()
                    .map(|r| match (r.protocol.as_str(), r.first_port, r.last_port) {
                        ("", ..) => r.cidr.clone(),
                        (p, 0, _) => format!("{} {p}", r.cidr),
                        (p, a, b) if a == b => format!("{} {p}/{a}", r.cidr),
                        (p, a, b) => format!("{} {p}/{a}-{b}", r.cidr),
                    })
                    .collect();
                format!(
                    "; export policy: {}",
                    if rules.is_empty() {
                        "nothing".into()
                    } else {
                        rules.join(", ")
                    }
                )
            } else {
                String::new()
            };
            format!(
                "filter in {}: from {} forward only to {}{policy}",
                f.namespace,
                f.tunnel,
                f.allowed.join(", ")
            )
        }
        Some(Kind::RelaySession(r)) => {
            let side = |s: &Option<pb::RelaySide>| s.as_ref().map(|s| format!("{} (port {})", s.site, s.port));
            format!(
                "relay between {} and {}",
                side(&r.a).unwrap_or_default(),
                side(&r.b).unwrap_or_default()
            )
        }
        Some(Kind::LanAddress(_)) => "the LAN address (--lan-address), as the active gateway".into(),
        Some(Kind::RelayTls(t)) => format!("carry tunnels over TLS on TCP port {}", t.port),
        None => "(empty object)".into(),
    }
}

pub struct StateFile {
    path: PathBuf,
    /// Why the last save failed, while it does (see [`StateFile::keep`]).
    failing: std::sync::Mutex<Option<String>>,
}

/// The id an unsaved state is reported under, among the object errors.
pub const STATE_FILE_ERROR_ID: &str = "state-file";

impl StateFile {
    pub fn new(dir: &Path) -> Self {
        Self {
            path: dir.join(STATE_FILE),
            failing: std::sync::Mutex::new(None),
        }
    }

    /// Saves `d`; a failure (a full disk, say) is held, not fatal: the
    /// state applied to the host and held in memory is what counts, the
    /// file only lets a restarted agent start from it. The failure is
    /// logged once, reported (see [`StateFile::failure`]) and retried by
    /// the next save or [`StateFile::retry`].
    pub fn keep(&self, d: &Desired) {
        let result = self.save(d);
        let mut failing = self.failing.lock().unwrap();
        match result {
            Ok(()) => {
                if failing.take().is_some() {
                    tracing::info!(path = %self.path.display(), revision = d.revision, "the desired state is on disk again");
                }
            }
            Err(e) => {
                let why = format!(
                    "cannot keep the desired state on disk: {e:#}; the host keeps what was applied and the save is \
                     retried (free space in {})",
                    self.path
                        .parent()
                        .map_or_else(|| ".".into(), |p| p.display().to_string())
                );
                if failing.as_deref() != Some(why.as_str()) {
                    tracing::error!(error = %why, "state file not saved");
                }
                *failing = Some(why);
            }
        }
    }

    /// Saves again if the last save failed.
    pub fn retry(&self, d: &Desired) {
        if self.failing.lock().unwrap().is_some() {
            self.keep(d);
        }
    }

    /// The last save's failure, as an object error to report.
    pub fn failure(&self) -> Option<pb::ObjectError> {
        self.failing.lock().unwrap().clone().map(|message| pb::ObjectError {
            id: STATE_FILE_ERROR_ID.into(),
            message,
        })
    }

    pub fn load(&self) -> anyhow::Result<Option<Desired>> {
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", self.path.display())),
        };
        let f = pb::StateFile::decode(bytes.as_slice()).with_context(|| {
            format!(
                "{} is not a weft state file; remove it to start over",
                self.path.display()
            )
        })?;
        if f.format != FORMAT {
            bail!(
                "{} has format {} but this agent reads format {FORMAT}; remove it to start over",
                self.path.display(),
                f.format
            );
        }
        Ok(Some(Desired {
            revision: f.revision,
            objects: f.objects.into_iter().map(|o| (o.id.clone(), Held::from(o))).collect(),
        }))
    }

    /// Writes through a temporary file, fsync and rename: a crash leaves the
    /// old or the new state, never half of one.
    pub fn save(&self, d: &Desired) -> anyhow::Result<()> {
        let f = pb::StateFile {
            format: FORMAT,
            revision: d.revision,
            objects: d.objects.values().map(|o| o.raw.clone()).collect(),
        };
        // 0600: the state names every tunnel, key and peer.
        weft_common::fs::write_file(&self.path, f.encode_to_vec(), 0o600)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(id: &str, ns: &str) -> pb::DesiredObject {
        pb::DesiredObject {
            id: id.into(),
            kind: Some(pb::desired_object::Kind::Namespace(pb::Namespace { name: ns.into() })),
        }
    }

    #[test]
    fn local_objects_survive_snapshots_and_stay_unknown_to_the_controller() {
        let mut d = Desired::default();
        let bridge = bridge_objects("weft-br0", "10.1.4.0/24", "").unwrap();
        assert_eq!(bridge.len(), 2);
        let Some(pb::desired_object::Kind::Address(a)) = &bridge[1].raw.kind else {
            panic!()
        };
        assert_eq!(a.cidr, "10.1.4.1/24");
        // Dual stack, and IPv6 only: the /64's first address beside it, or alone.
        let cidrs = |v4, v6| -> Vec<String> {
            bridge_objects("weft-br0", v4, v6)
                .unwrap()
                .into_iter()
                .filter_map(|o| match o.raw.kind {
                    Some(pb::desired_object::Kind::Address(a)) => Some(a.cidr),
                    _ => None,
                })
                .collect()
        };
        assert_eq!(
            cidrs("10.1.4.0/24", "fd00:1:0:4::/64"),
            ["10.1.4.1/24", "fd00:1:0:4::1/64", "fe80::1/64"]
        );
        assert_eq!(cidrs("", "fd00:1:0:4::/64"), ["fd00:1:0:4::1/64", "fe80::1/64"]);
        assert!(bridge_objects("weft-br0", "", "fd00::/129").is_err());
        d.commit(3, bridge, &[]);
        d.commit(3, vec![Held::from(obj("a", "weft-a"))], &[]);
        let snap = pb::WatchResponse {
            revision: 5,
            kind: Some(pb::watch_response::Kind::Snapshot(pb::Snapshot { objects: vec![] })),
        };
        assert_eq!(d.changes(&snap).1, ["a"], "a snapshot leaves the agent's own objects");
        assert_eq!(d.known().len(), 1);
        assert!(bridge_objects("weft-br0", "", "").is_err());
    }

    #[test]
    fn snapshot_replaces_and_delta_patches_then_round_trips_on_disk() {
        let mut d = Desired::default();
        let snap = pb::WatchResponse {
            revision: 5,
            kind: Some(pb::watch_response::Kind::Snapshot(pb::Snapshot {
                objects: vec![obj("a", "weft-a"), obj("b", "weft-b")],
            })),
        };
        let (up, del) = d.changes(&snap);
        d.commit(5, up, &del);
        let delta = pb::WatchResponse {
            revision: 9,
            kind: Some(pb::watch_response::Kind::Delta(pb::Delta {
                upserts: vec![obj("c", "weft-c")],
                deletes: vec!["a".into()],
            })),
        };
        let (up, del) = d.changes(&delta);
        d.commit(9, up, &del);
        assert_eq!(d.objects.keys().collect::<Vec<_>>(), ["b", "c"]);
        let snap2 = pb::WatchResponse {
            revision: 12,
            kind: Some(pb::watch_response::Kind::Snapshot(pb::Snapshot {
                objects: vec![obj("z", "weft-z")],
            })),
        };
        assert_eq!(d.changes(&snap2).1, ["b", "c"], "a snapshot deletes what it lacks");

        let dir = tempfile::tempdir().unwrap();
        let f = StateFile::new(dir.path());
        assert_eq!(f.load().unwrap(), None);
        f.save(&d).unwrap();
        assert_eq!(f.load().unwrap(), Some(d.clone()));
        std::fs::write(
            dir.path().join(STATE_FILE),
            pb::StateFile {
                format: 99,
                ..Default::default()
            }
            .encode_to_vec(),
        )
        .unwrap();
        assert!(f.load().unwrap_err().to_string().contains("format 99"));
    }
}
