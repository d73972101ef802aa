//! What a request carries, checked: its fields as typed values (or
//! INVALID_ARGUMENT naming the field) and when it must be answered.

use std::time::Duration;

use ipnet::Ipv4Net;
use tonic::{Request, Status};
use weft_proto::v1 as pb;

use crate::config::parse_cidr;
use crate::domain::AgentRole;

pub fn agent_role(v: i32, field: &str) -> Result<AgentRole, Status> {
    match pb::AgentRole::try_from(v) {
        Ok(pb::AgentRole::Node) => Ok(AgentRole::Node),
        Ok(pb::AgentRole::Gateway) => Ok(AgentRole::Gateway),
        _ => Err(Status::invalid_argument(format!(
            "{field}: give AGENT_ROLE_NODE or AGENT_ROLE_GATEWAY"
        ))),
    }
}

pub(super) fn address_field(field: &str, text: &str) -> Result<std::net::Ipv4Addr, Status> {
    let t = text.trim();
    if t.is_empty() {
        return Err(Status::invalid_argument(format!(
            "{field} is empty; give an IPv4 address such as 10.1.0.10"
        )));
    }
    t.parse()
        .map_err(|_| Status::invalid_argument(format!("{field}: {t:?} is not an IPv4 address; write it as 10.1.0.10")))
}

/// An address of either family; an IPv6 one may be bracketed (`[fd00::10]`).
pub(super) fn either_family(field: &str, text: &str) -> Result<std::net::IpAddr, Status> {
    let t = text.trim();
    if t.is_empty() {
        return Err(Status::invalid_argument(format!(
            "{field} is empty; give an address such as 10.1.0.10 or fd00:1::10"
        )));
    }
    let bare = t.strip_prefix('[').and_then(|r| r.strip_suffix(']')).unwrap_or(t);
    weft_types::net::addr(bare).map_err(|m| Status::invalid_argument(format!("{field}: {m}")))
}

pub(super) fn cidr_field(field: &str, text: &str) -> Result<Ipv4Net, Status> {
    parse_cidr(text).map_err(|m| Status::invalid_argument(format!("{field}: {m}")))
}

/// When a call must have its answer: `cap` from now, or earlier when the
/// caller's own deadline (its `grpc-timeout`) is nearer, less a margin for
/// the answer to reach it. (A caller that waited longer than its deadline
/// would get a bare DEADLINE_EXCEEDED of its own instead of this one's
/// answer, which says what happened.)
pub fn answer_by<T>(req: &Request<T>, cap: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    let caller = req
        .metadata()
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(grpc_timeout)
        .map(|t| t.saturating_sub((t / 5).clamp(Duration::from_millis(250), Duration::from_secs(2))));
    now + caller.map_or(cap, |t| t.min(cap))
}

/// A `grpc-timeout` header's value: up to 8 digits and a unit (H, M, S,
/// m, u, n), as the gRPC HTTP/2 protocol defines it.
fn grpc_timeout(v: &str) -> Option<Duration> {
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_callers_grpc_timeout_is_read_and_leaves_a_margin() {
        assert_eq!(grpc_timeout("2999m"), Some(Duration::from_millis(2999)));
        assert_eq!(grpc_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        for bad in ["", "S", "123456789S", "5s", "-5S", "5 S"] {
            assert_eq!(grpc_timeout(bad), None, "{bad:?}");
        }
        let mut req = Request::new(());
        req.metadata_mut().insert("grpc-timeout", "3S".parse().unwrap());
        let left = answer_by(&req, Duration::from_secs(15)) - tokio::time::Instant::now();
        assert!(
            left <= Duration::from_millis(2400) && left > Duration::from_millis(2200),
            "{left:?}"
        );
        let left = answer_by(&Request::new(()), Duration::from_secs(15)) - tokio::time::Instant::now();
        assert!(left > Duration::from_secs(14), "no deadline: the cap");
    }
}
