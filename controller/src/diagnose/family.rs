//! Each family of a peering: IPv4 unless one of the sites is IPv6-only
//! (then why not), IPv6 when either site has it (its views, or why not).

use weft_proto::v1 as pb;

use super::{check, pass};

/// IPv4, said only when it is not negotiated (the tunnel checks cover it
/// otherwise).
pub(super) fn ipv4_check(site: &crate::domain::Site, p: &crate::domain::Peering) -> Option<pb::Check> {
    let why = p.ipv4_status(!site.pod_cidrs.is_empty())?.err()?;
    Some(check(
        "ipv4",
        format!("peering/{}", p.site_id),
        pb::CheckResult::Warn,
        format!("IPv4 is not negotiated, IPv6 only: {why}"),
        "for IPv4 both sites need IPv4 pod CIDRs; CIDRs held for review are taken with `weftctl peering accept`",
    ))
}

/// IPv6 when either site has it, with its views or why it does not.
pub(super) fn ipv6_check(site: &crate::domain::Site, p: &crate::domain::Peering) -> Option<pb::Check> {
    let subject = format!("peering/{}", p.site_id);
    Some(match p.ipv6_status(site.ipv6.as_ref())? {
        Ok(()) => {
            let views: Vec<String> = p
                .views_v6
                .iter()
                .map(|v| format!("{} {} as {}", v.kind, v.real, v.local))
                .collect();
            let negotiated = format!("negotiated: {}", views.join(", "));
            match &p.pending_v6 {
                None => pass("ipv6", subject, negotiated),
                Some(held) => {
                    let mut cidrs: Vec<String> = held.workload_cidrs_v6.iter().map(|c| c.to_string()).collect();
                    cidrs.extend(held.external_cidr_v6.map(|c| c.to_string()));
                    check(
                        "ipv6",
                        subject,
                        pb::CheckResult::Warn,
                        format!(
                            "{negotiated}; {} announced {} instead, held for review",
                            p.site_id,
                            cidrs.join(" ")
                        ),
                        &format!("route them with `weftctl peering accept {}`", p.site_id),
                    )
                }
            }
        }
        Err(why) => check(
            "ipv6",
            subject,
            pb::CheckResult::Warn,
            format!("IPv6 is not negotiated, IPv4 only: {why}"),
            "for IPv6 both sites need IPv6 pod CIDRs; CIDRs held for review are taken with \
             `weftctl peering accept`, a refused one is changed by the peer",
        ),
    })
}
