//! `weftctl peering policy set|show SITE`: a peering's export policy.

use serde_json::json;
use weft_proto::v1 as pb;

use crate::cli::PolicyCmd;
use crate::out::*;

/// One `--allow CIDR[,PROTOCOL[,PORT[-PORT]]]`, as the API takes it, its
/// parts checked as the controller checks them (which also checks the
/// CIDR against the site).
pub fn parse_rule(text: &str) -> Result<pb::ExportRule, String> {
    let mut parts = text.split(',').map(str::trim);
    let cidr = parts.next().unwrap_or_default().to_string();
    let protocol = parts.next().unwrap_or_default().to_string();
    let (first_port, last_port) = match parts.next() {
        None | Some("") => (0, 0),
        Some(ports) => {
            let port = |p: &str| {
                p.parse::<u32>().ok().filter(|p| *p > 0).ok_or_else(|| {
                    format!(
                        "--allow {text:?}: {p:?} is not a port; write e.g. 10.1.2.0/24,tcp,8080 or 10.1.2.0/24,tcp,8000-8100"
                    )
                })
            };
            match ports.split_once('-') {
                Some((a, b)) => (port(a)?, port(b)?),
                None => (port(ports)?, 0),
            }
        }
    };
    if parts.next().is_some() {
        return Err(format!(
            "--allow {text:?}: more than CIDR,PROTOCOL,PORTS; write e.g. 10.1.2.0/24,tcp,8080"
        ));
    }
    // The checks the controller makes of a rule's own parts (whether the
    // CIDR is the site's is its to say), before anything is sent.
    weft_types::net::cidr(&cidr).map_err(|e| format!("--allow {text:?}: cidr: {e}"))?;
    let checked =
        weft_types::policy::Protocol::parse(&protocol).map_err(|e| format!("--allow {text:?}: protocol: {e}"))?;
    weft_types::policy::ports(checked, first_port, last_port).map_err(|e| format!("--allow {text:?}: {e}"))?;
    Ok(pb::ExportRule {
        cidr,
        protocol,
        first_port,
        last_port,
    })
}

fn rule_text(r: &pb::ExportRule) -> String {
    let mut s = r.cidr.clone();
    if !r.protocol.is_empty() {
        s.push_str(&format!(" {}", r.protocol));
    }
    match (r.first_port, r.last_port) {
        (0, _) => {}
        (a, b) if a == b || b == 0 => s.push_str(&format!(" port {a}")),
        (a, b) => s.push_str(&format!(" ports {a}-{b}")),
    }
    s
}

pub fn mode_text(m: i32) -> &'static str {
    match pb::ExportMode::try_from(m) {
        Ok(pb::ExportMode::All) => "all",
        Ok(pb::ExportMode::Rules) => "rules",
        Ok(pb::ExportMode::SiteDefault) => "site default",
        _ => "-",
    }
}

/// What a policy exports, in a few words.
pub fn summary(p: &pb::ExportPolicy) -> String {
    match pb::ExportMode::try_from(p.effective) {
        Ok(pb::ExportMode::All) => "everything".into(),
        Ok(pb::ExportMode::Rules) if p.rules.is_empty() => "nothing".into(),
        Ok(pb::ExportMode::Rules) => p.rules.iter().map(rule_text).collect::<Vec<_>>().join("; "),
        _ => "-".into(),
    }
}

/// A warning when gateways of this site would not enforce `p`.
pub fn unenforced(p: &pb::ExportPolicy) -> Option<String> {
    (!p.not_enforced_by.is_empty()).then(|| {
        format!(
            "WARNING: gateway {} runs an agent that does not enforce the policy for {} as set (an older version: \
             without export policies it does not hold while that gateway is active; without IPv6 rules it refuses \
             all IPv6 instead); upgrade it",
            p.not_enforced_by.join(", "),
            p.site_id
        )
    })
}

pub fn policy_json(p: &pb::ExportPolicy) -> serde_json::Value {
    json!({
        "site_id": p.site_id,
        "mode": mode_text(p.mode),
        "effective": mode_text(p.effective),
        "rules": p.rules.iter().map(|r| json!({
            "cidr": r.cidr, "protocol": r.protocol, "first_port": r.first_port, "last_port": r.last_port,
        })).collect::<Vec<_>>(),
        "not_enforced_by": p.not_enforced_by,
    })
}

pub async fn run(c: &mut Client, cmd: &PolicyCmd) -> Result<Out, String> {
    let p = match cmd {
        PolicyCmd::Set {
            site,
            allow,
            all,
            none,
            site_default,
        } => {
            let (mode, rules) = if *all {
                (pb::ExportMode::All, vec![])
            } else if *site_default {
                (pb::ExportMode::SiteDefault, vec![])
            } else if *none {
                (pb::ExportMode::Rules, vec![])
            } else {
                (
                    pb::ExportMode::Rules,
                    allow.iter().map(|a| parse_rule(a)).collect::<Result<_, _>>()?,
                )
            };
            c.set_export_policy(pb::SetExportPolicyRequest {
                site_id: site.clone(),
                mode: mode as i32,
                rules,
            })
            .await
            .map_err(status)?
            .into_inner()
        }
        PolicyCmd::Show { site } => c
            .get_export_policy(pb::GetExportPolicyRequest { site_id: site.clone() })
            .await
            .map_err(status)?
            .into_inner(),
    };
    Ok(Out {
        failed: false,
        json: policy_json(&p),
        header: vec!["PEER", "POLICY", "EXPORTS"],
        rows: vec![vec![p.site_id.clone(), mode_text(p.mode).into(), summary(&p)]],
        footer: unenforced(&p).into_iter().collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_rules_parse_into_the_apis_fields() {
        let r = parse_rule("10.1.2.0/24,tcp,8080").unwrap();
        assert_eq!(
            (r.cidr.as_str(), r.protocol.as_str(), r.first_port, r.last_port),
            ("10.1.2.0/24", "tcp", 8080, 0)
        );
        let r = parse_rule("10.1.2.0/24, udp, 5000-5010").unwrap();
        assert_eq!((r.protocol.as_str(), r.first_port, r.last_port), ("udp", 5000, 5010));
        let r = parse_rule("10.1.0.0/16").unwrap();
        assert_eq!((r.protocol.as_str(), r.first_port), ("", 0));
        assert!(parse_rule("10.1.2.0/24,tcp,http").unwrap_err().contains("not a port"));
        assert!(parse_rule("10.1.2.0/24,tcp,80,90").unwrap_err().contains("more than"));
        // The rule's own parts are checked as the controller checks them.
        for (text, says) in [
            (
                "10.1.2.0/24,tcp,9000-8000",
                "last_port: the range 9000-8000 ends before it starts",
            ),
            ("10.1.2.0/24,tcp,70000", "first_port: 70000 is not a port"),
            ("10.1.2.0/24,icmp,80", "first_port: ports need protocol tcp or udp"),
            ("10.1.2.0/24,gre", "protocol: \"gre\" is not a protocol"),
            ("10.1.2.0/33", "cidr: "),
        ] {
            let e = parse_rule(text).unwrap_err();
            assert!(e.contains(says), "{text}: {e}");
        }
        assert_eq!(
            rule_text(&parse_rule("10.1.2.0/24,tcp,8080").unwrap()),
            "10.1.2.0/24 tcp port 8080"
        );
    }
}
