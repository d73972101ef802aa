//! The agent's guard: what a controller may ask of this host, checked
//! before anything touches the kernel. The agent runs as root, so a
//! compromised controller (or store, or a tampered state file) must not
//! reach past weft's own objects:
//!
//! - links are weft's (`weft…`, at most 15 bytes), and so is every link an
//!   address, route, rule, SNAT or WireGuard peer names;
//! - namespaces are weft's: `weft-…` names of letters, digits and '-'
//!   (no path: the agent opens them under /run/netns);
//! - in the host's own namespace, routes live only in weft's table
//!   ([`weft_proto::HOST_TABLE`]) and rules only at weft's priority
//!   ([`weft_proto::HOST_RULE_PRIORITY`]) pointing at that table, for a
//!   destination of /8 or narrower; no rule or route there covers this
//!   host's underlay address or its controllers' (that would pull the
//!   agent's own control traffic into the fabric); weft's peering
//!   namespaces are weft's whole;
//! - addresses, CIDRs, endpoints and keys parse as what they are, so no
//!   field can smuggle text into a configuration channel (WireGuard's UAPI
//!   is line-based).
//!
//! A refused object is reported as an object error and never applied; the
//! rest still applies. Deleting an object that was refused touches nothing.

use std::net::{IpAddr, SocketAddr};

use base64::Engine;
use ipnet::IpNet;
use weft_proto::v1 as pb;
use weft_proto::v1::desired_object::Kind;

use crate::apply::{Applier, Objects};

/// What this host must keep reaching outside the fabric.
#[derive(Clone, Debug, Default)]
pub struct Guard {
    protected: Vec<IpAddr>,
}

type R = Result<(), String>;

fn link_name(what: &str, name: &str) -> R {
    let ok = name.starts_with("weft")
        && name.len() <= 15
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what} {name:?} is not one of weft's links (weft…, at most 15 letters, digits, '-', '_', '.')"
        ))
    }
}

/// "" (the agent's own namespace) or one of weft's.
fn namespace(what: &str, name: &str) -> R {
    if name.is_empty() {
        return Ok(());
    }
    let ok = name.starts_with("weft-")
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what} {name:?} is not one of weft's namespaces (weft-…, lower-case letters, digits and '-')"
        ))
    }
}

fn parse<T: std::str::FromStr>(what: &str, text: &str, kind: &str) -> Result<T, String> {
    text.parse().map_err(|_| format!("{what} {text:?} is not {kind}"))
}

fn opt_link(what: &str, name: &str) -> R {
    if name.is_empty() { Ok(()) } else { link_name(what, name) }
}

impl Guard {
    /// A guard for a host whose underlay address is `underlay` and whose
    /// controllers are `controllers` (URLs; those naming an address are
    /// protected).
    pub fn new(underlay: Option<IpAddr>, controllers: &[String]) -> Guard {
        let mut protected: Vec<IpAddr> = underlay.into_iter().collect();
        for c in controllers {
            let rest = c.split_once("://").map_or(c.as_str(), |(_, r)| r);
            let host = rest.split('/').next().unwrap_or_default();
            if let Ok(a) = host.parse::<SocketAddr>() {
                protected.push(a.ip());
            } else if let Ok(a) = host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
                protected.push(a);
            } else if let Some((h, _)) = host.rsplit_once(':')
                && let Ok(a) = h.parse::<IpAddr>()
            {
                protected.push(a);
            }
        }
        Guard { protected }
    }

    /// Ok when `o` stays within what weft owns; else why not.
    pub fn check(&self, o: &pb::DesiredObject) -> R {
        match &o.kind {
            None => Err("the object has no kind".into()),
            Some(Kind::Namespace(n)) if n.name.is_empty() => Err("a namespace without a name".into()),
            Some(Kind::Namespace(n)) => namespace("namespace", &n.name),
            Some(Kind::Link(l)) => self.link(l),
            Some(Kind::Address(a)) => {
                link_name("address on link", &a.link)?;
                namespace("namespace", &a.namespace)?;
                parse::<IpNet>("address", &a.cidr, "an address with a prefix length").map(|_| ())
            }
            Some(Kind::Route(r)) => {
                namespace("namespace", &r.namespace)?;
                if r.namespace.is_empty() && r.table != weft_proto::HOST_TABLE {
                    return Err(format!(
                        "a route in table {} of the host's namespace; weft routes only in its table {}",
                        r.table,
                        weft_proto::HOST_TABLE
                    ));
                }
                let dst = parse::<IpNet>("route destination", &r.destination, "a CIDR")?;
                if r.namespace.is_empty()
                    && let Some(ip) = self.protected.iter().find(|ip| dst.contains(*ip))
                {
                    return Err(format!(
                        "a route for {dst} covers {ip}, which this host reaches outside the fabric (its underlay or a controller)"
                    ));
                }
                if !r.gateway.is_empty() {
                    parse::<IpAddr>("route gateway", &r.gateway, "an address")?;
                }
                opt_link("route device", &r.device)
            }
            Some(Kind::Rule(r)) => self.rule(r),
            Some(Kind::NatMap(n)) => {
                if n.namespace.is_empty() {
                    return Err("prefix NAT in the host's namespace; weft maps only in its peering namespaces".into());
                }
                namespace("namespace", &n.namespace)?;
                parse::<IpNet>("real CIDR", &n.real_cidr, "a CIDR")?;
                parse::<IpNet>("local CIDR", &n.local_cidr, "a CIDR")?;
                link_name("tunnel", &n.tunnel)
            }
            Some(Kind::WireguardPeer(p)) => {
                link_name("WireGuard link", &p.link)?;
                namespace("namespace", &p.namespace)?;
                let key = base64::engine::general_purpose::STANDARD
                    .decode(&p.public_key)
                    .map_err(|_| format!("public key {:?} is not base64", p.public_key))?;
                if key.len() != 32 {
                    return Err(format!("public key {:?} is not a 32-byte WireGuard key", p.public_key));
                }
                if !p.endpoint.is_empty() {
                    let a: SocketAddr = parse("endpoint", &p.endpoint, "an address and a port")?;
                    if a.port() == 0 {
                        return Err(format!("endpoint {:?} has port 0", p.endpoint));
                    }
                }
                for a in &p.allowed_ips {
                    parse::<IpNet>("allowed IP", a, "a CIDR")?;
                }
                if p.persistent_keepalive > 65535 {
                    return Err(format!("keepalive {} is over 65535 s", p.persistent_keepalive));
                }
                Ok(())
            }
            Some(Kind::DnsRecord(r)) => crate::dns::check_record(r).map(|_| ()),
            Some(Kind::TunnelFilter(f)) => {
                if f.namespace.is_empty() {
                    return Err(
                        "a tunnel filter in the host's namespace; weft filters only in its peering namespaces".into(),
                    );
                }
                namespace("namespace", &f.namespace)?;
                link_name("tunnel", &f.tunnel)?;
                for a in &f.allowed {
                    parse::<ipnet::Ipv4Net>("allowed destination", a, "an IPv4 CIDR")?;
                }
                Ok(())
            }
            Some(Kind::ExportMap(x)) => {
                if x.namespace.is_empty() {
                    return Err(
                        "an export in the host's namespace; weft maps exports only in its peering namespaces".into(),
                    );
                }
                namespace("namespace", &x.namespace)?;
                link_name("tunnel", &x.tunnel)?;
                parse::<std::net::Ipv4Addr>("export's external address", &x.external_address, "an IPv4 address")?;
                let host: std::net::Ipv4Addr = parse("exported host", &x.host_address, "an IPv4 address")?;
                if host.is_unspecified()
                    || host.is_loopback()
                    || host.is_multicast()
                    || host.is_broadcast()
                    || host.is_link_local()
                {
                    return Err(format!(
                        "exported host {host} is not a unicast address on the site's LAN"
                    ));
                }
                if self.protected.contains(&IpAddr::V4(host)) {
                    return Err(format!(
                        "exported host {host} is this host's underlay or a controller: peers would reach it through the tunnel"
                    ));
                }
                Ok(())
            }
            Some(Kind::HostSnat(s)) => {
                link_name("SNAT on link", &s.link)?;
                parse::<IpAddr>("SNAT address", &s.address, "an address")?;
                for c in &s.except {
                    parse::<IpNet>("SNAT exception", c, "a CIDR")?;
                }
                Ok(())
            }
        }
    }

    fn link(&self, l: &pb::Link) -> R {
        link_name("link", &l.name)?;
        namespace("namespace", &l.namespace)?;
        if l.mtu != 0 && !(576..=9000).contains(&l.mtu) {
            return Err(format!("MTU {} is out of range (576 to 9000)", l.mtu));
        }
        match &l.kind {
            None => Err(format!("link {} has no kind", l.name)),
            Some(pb::link::Kind::Vxlan(v)) => {
                parse::<IpAddr>("VXLAN local", &v.local, "an address")?;
                parse::<IpAddr>("VXLAN remote", &v.remote, "an address").map(|_| ())
            }
            Some(pb::link::Kind::Geneve(g)) => parse::<IpAddr>("Geneve remote", &g.remote, "an address").map(|_| ()),
            Some(pb::link::Kind::Wireguard(w)) => {
                if !(1..=65535).contains(&w.listen_port) {
                    return Err(format!("listen port {} is not 1 to 65535", w.listen_port));
                }
                parse::<IpNet>("tunnel address", &w.address, "an address with a prefix length")?;
                parse::<IpAddr>("tunnel peer address", &w.peer_address, "an address").map(|_| ())
            }
            Some(pb::link::Kind::Veth(v)) => {
                link_name("veth peer", &v.peer_name)?;
                namespace("veth peer namespace", &v.peer_namespace)
            }
            Some(pb::link::Kind::Bridge(_)) => Ok(()),
        }
    }

    fn rule(&self, r: &pb::Rule) -> R {
        namespace("namespace", &r.namespace)?;
        if !r.from.is_empty() {
            parse::<IpNet>("rule source", &r.from, "a CIDR")?;
        }
        let to = match r.to.as_str() {
            "" => None,
            t => Some(parse::<IpNet>("rule destination", t, "a CIDR")?),
        };
        opt_link("rule input interface", &r.iif)?;
        if !r.namespace.is_empty() {
            return Ok(()); // weft's own namespace
        }
        if r.priority != weft_proto::HOST_RULE_PRIORITY || r.table != weft_proto::HOST_TABLE {
            return Err(format!(
                "a rule at priority {} to table {} in the host's namespace; weft's rules are at priority {} to table {}",
                r.priority,
                r.table,
                weft_proto::HOST_RULE_PRIORITY,
                weft_proto::HOST_TABLE
            ));
        }
        let Some(to) = to else {
            return Err("a rule for every destination in the host's namespace; weft's rules name one CIDR".into());
        };
        if to.prefix_len() < 8 {
            return Err(format!(
                "a rule for {to} in the host's namespace; weft's rules are /8 or narrower"
            ));
        }
        if let Some(ip) = self.protected.iter().find(|ip| to.contains(*ip)) {
            return Err(format!(
                "a rule for {to} covers {ip}, which this host reaches outside the fabric (its underlay or a controller)"
            ));
        }
        Ok(())
    }
}

/// An applier behind the guard: refused objects are reported, not applied.
pub struct Guarded<A> {
    pub inner: A,
    pub guard: Guard,
}

#[async_trait::async_trait]
impl<A: Applier> Applier for Guarded<A> {
    async fn apply(
        &mut self,
        held: &Objects,
        upserts: &[pb::DesiredObject],
        deletes: &[String],
    ) -> Vec<pb::ObjectError> {
        // The inner applier sees only what passed: a refused object was
        // never applied, so there is nothing of it to replace or delete.
        // (Copied only when something held was refused, which is rare.)
        let refused_held: Vec<&String> = held
            .iter()
            .filter(|(_, o)| self.guard.check(o).is_err())
            .map(|(k, _)| k)
            .collect();
        let filtered: Option<Objects> = (!refused_held.is_empty()).then(|| {
            held.iter()
                .filter(|(k, _)| !refused_held.contains(k))
                .map(|(k, o)| (k.clone(), o.clone()))
                .collect()
        });
        let held_ok = filtered.as_ref().unwrap_or(held);
        let mut refused = Vec::new();
        let mut ok = Vec::with_capacity(upserts.len());
        for o in upserts {
            match self.guard.check(o) {
                Ok(()) => ok.push(o.clone()),
                Err(why) => {
                    tracing::warn!(id = %o.id, reason = %why, "refused a desired object: it reaches past what weft owns");
                    refused.push(pb::ObjectError {
                        id: o.id.clone(),
                        message: format!("refused by the agent: {why}"),
                    });
                }
            }
        }
        let deletes: Vec<String> = deletes
            .iter()
            .filter(|id| !refused_held.contains(id))
            .cloned()
            .collect();
        let mut errors = self.inner.apply(held_ok, &ok, &deletes).await;
        errors.extend(refused);
        errors
    }

    fn tunnels(&mut self) -> Vec<pb::TunnelStatus> {
        self.inner.tunnels()
    }

    fn features(&mut self) -> Vec<String> {
        self.inner.features()
    }

    fn tunnel_changes(&self) -> Option<std::sync::Arc<tokio::sync::Notify>> {
        self.inner.tunnel_changes()
    }

    fn writes(&self) -> u64 {
        self.inner.writes()
    }

    async fn host_report(&mut self, held: &Objects) -> pb::HostReport {
        self.inner.host_report(held).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(kind: Kind) -> pb::DesiredObject {
        pb::DesiredObject {
            id: "x".into(),
            kind: Some(kind),
        }
    }

    fn guard() -> Guard {
        Guard::new(
            Some("192.168.78.11".parse().unwrap()),
            &["https://192.168.78.1:7443".into()],
        )
    }

    fn rule(priority: u32, table: u32, to: &str) -> Kind {
        Kind::Rule(pb::Rule {
            namespace: String::new(),
            priority,
            from: String::new(),
            to: to.into(),
            table,
            iif: String::new(),
        })
    }

    fn route(ns: &str, table: u32, dst: &str, dev: &str) -> Kind {
        Kind::Route(pb::Route {
            namespace: ns.into(),
            table,
            destination: dst.into(),
            gateway: String::new(),
            device: dev.into(),
        })
    }

    #[test]
    fn what_weft_renders_passes() {
        let g = guard();
        for k in [
            rule(7765, 7765, "10.1.0.0/16"),
            route("", 7765, "10.0.0.0/16", "weft-vx0"),
            route("weft-p-0123456789ab", 0, "10.1.0.0/16", "weft-iabc"),
            route("weft-p-0123456789ab", 1, "0.0.0.0/0", "weft-wabc"),
            Kind::Namespace(pb::Namespace {
                name: "weft-p-0123456789ab".into(),
            }),
            Kind::HostSnat(pb::HostSnat {
                link: "weft-vx0".into(),
                address: "10.70.0.3".into(),
                except: vec!["10.1.0.0/16".into()],
            }),
            Kind::WireguardPeer(pb::WireguardPeer {
                link: "weft-wabc".into(),
                namespace: "weft-p-0123456789ab".into(),
                public_key: "hT7XTB7qgr4m+5V8gqhnNtjvNrqSqPFiCjPsXl1Oc0Q=".into(),
                endpoint: "192.0.2.1:51821".into(),
                allowed_ips: vec!["10.1.0.0/16".into()],
                persistent_keepalive: 25,
            }),
        ] {
            assert_eq!(g.check(&obj(k.clone())), Ok(()), "{k:?}");
        }
    }

    #[test]
    fn what_reaches_past_weft_is_refused() {
        let g = guard();
        let refused = [
            (route("", 254, "10.9.0.0/16", "weft-vx0"), "table 254"),
            (route("", 255, "10.9.0.0/16", "weft-vx0"), "table 255"),
            (route("", 7765, "10.9.0.0/16", "eth0"), "\"eth0\""),
            (rule(0, 7765, "10.9.0.0/16"), "priority 0"),
            (rule(7765, 254, "10.9.0.0/16"), "table 254"),
            (rule(7765, 7765, ""), "every destination"),
            (rule(7765, 7765, "0.0.0.0/1"), "/8 or narrower"),
            (rule(7765, 7765, "192.168.78.0/24"), "192.168.78.11"),
            (rule(7765, 7765, "192.168.78.1/32"), "192.168.78.1"),
            (route("", 7765, "192.168.78.0/24", "weft-vx0"), "192.168.78.11"),
            (
                Kind::Address(pb::Address {
                    link: "eth0".into(),
                    namespace: String::new(),
                    cidr: "192.168.78.11/24".into(),
                }),
                "\"eth0\"",
            ),
            (
                Kind::Namespace(pb::Namespace {
                    name: "../../proc/1/ns/net".into(),
                }),
                "namespaces",
            ),
            (Kind::Namespace(pb::Namespace { name: "other".into() }), "namespaces"),
            (
                Kind::HostSnat(pb::HostSnat {
                    link: "eth0".into(),
                    address: "10.70.0.3".into(),
                    except: vec![],
                }),
                "\"eth0\"",
            ),
            (
                Kind::WireguardPeer(pb::WireguardPeer {
                    link: "weft-wabc".into(),
                    namespace: String::new(),
                    public_key: "hT7XTB7qgr4m+5V8gqhnNtjvNrqSqPFiCjPsXl1Oc0Q=".into(),
                    endpoint: "192.0.2.1:51820\nlisten_port=1".into(),
                    allowed_ips: vec![],
                    persistent_keepalive: 0,
                }),
                "endpoint",
            ),
            (
                Kind::WireguardPeer(pb::WireguardPeer {
                    link: "weft-wabc".into(),
                    namespace: String::new(),
                    public_key: "AAAA\npublic_key=00".into(),
                    endpoint: String::new(),
                    allowed_ips: vec![],
                    persistent_keepalive: 0,
                }),
                "public key",
            ),
            (
                Kind::Link(pb::Link {
                    name: "eth0".into(),
                    namespace: String::new(),
                    mtu: 1500,
                    kind: Some(pb::link::Kind::Bridge(pb::Bridge {})),
                }),
                "\"eth0\"",
            ),
            (
                Kind::NatMap(pb::NatMap {
                    namespace: String::new(),
                    real_cidr: "10.1.0.0/16".into(),
                    local_cidr: "10.9.0.0/16".into(),
                    tunnel: "weft-wabc".into(),
                }),
                "host's namespace",
            ),
        ];
        for (k, needle) in refused {
            let e = g.check(&obj(k.clone())).expect_err(&format!("{k:?}"));
            assert!(e.contains(needle), "{k:?}: {e}");
        }
    }

    /// An applier that records what reached it.
    #[derive(Default)]
    struct Recorder {
        upserts: Vec<String>,
        deletes: Vec<String>,
        held: Vec<String>,
    }

    #[async_trait::async_trait]
    impl Applier for Recorder {
        async fn apply(
            &mut self,
            held: &Objects,
            upserts: &[pb::DesiredObject],
            deletes: &[String],
        ) -> Vec<pb::ObjectError> {
            self.held = held.keys().cloned().collect();
            self.upserts.extend(upserts.iter().map(|o| o.id.clone()));
            self.deletes.extend(deletes.iter().cloned());
            vec![]
        }
    }

    #[tokio::test]
    async fn refused_objects_are_reported_and_never_reach_the_host() {
        let mut a = Guarded {
            inner: Recorder::default(),
            guard: guard(),
        };
        let good = pb::DesiredObject {
            id: "good".into(),
            kind: Some(rule(7765, 7765, "10.1.0.0/16")),
        };
        let bad = pb::DesiredObject {
            id: "bad".into(),
            kind: Some(rule(0, 254, "0.0.0.0/0")),
        };
        let errors = a.apply(&Objects::new(), &[good.clone(), bad.clone()], &[]).await;
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].id, "bad");
        assert!(
            errors[0].message.starts_with("refused by the agent"),
            "{}",
            errors[0].message
        );
        assert_eq!(a.inner.upserts, ["good"]);
        // Deleting the refused object (held since) touches nothing; the
        // inner applier never sees it as held either.
        let held: Objects = [("good".to_string(), good), ("bad".to_string(), bad)].into();
        a.apply(&held, &[], &["bad".into(), "good".into()]).await;
        assert_eq!(a.inner.deletes, ["good"]);
        assert_eq!(a.inner.held, ["good"]);
    }
}
