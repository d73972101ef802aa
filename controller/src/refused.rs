//! Joins this controller refused, for the admin: `weftctl peerings` and
//! `weftctl diagnose` show them. Only refusals given to a caller that
//! proved a valid peering token are kept (anyone can send a bad token, so
//! those would only let a stranger fill the list), in memory, the newest
//! [`KEPT`], the same refusal counted rather than repeated.

use std::sync::Mutex;
use std::time::SystemTime;

use weft_proto::v1 as pb;

/// How many distinct refusals are kept.
pub const KEPT: usize = 32;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub site_id: String,
    pub code: tonic::Code,
    pub message: String,
    pub last_at: SystemTime,
    pub count: u32,
}

#[derive(Debug, Default)]
pub struct RefusedJoins {
    /// Newest first.
    list: Mutex<Vec<Refusal>>,
}

impl RefusedJoins {
    /// Records that `site`'s Join was answered with `status`, unless that
    /// is a transient answer (busy, cut off, slow, a lost race) or this
    /// site's own fault (an internal error): neither is a refusal of the
    /// peer.
    pub fn record(&self, site: &str, status: &tonic::Status) {
        use tonic::Code;
        if matches!(
            status.code(),
            Code::Ok
                | Code::Unavailable
                | Code::DeadlineExceeded
                | Code::Cancelled
                | Code::Aborted
                | Code::Internal
                | Code::Unknown
                | Code::DataLoss
        ) {
            return;
        }
        tracing::warn!(peer = %site, code = ?status.code(), reason = %status.message(), "refused a peer's join");
        let mut list = self.list.lock().unwrap();
        let same = list
            .iter()
            .position(|r| r.site_id == site && r.code == status.code() && r.message == status.message());
        let mut r = match same {
            Some(i) => list.remove(i),
            None => Refusal {
                site_id: site.to_string(),
                code: status.code(),
                message: status.message().to_string(),
                last_at: SystemTime::now(),
                count: 0,
            },
        };
        r.count = r.count.saturating_add(1);
        r.last_at = SystemTime::now();
        list.insert(0, r);
        list.truncate(KEPT);
    }

    /// Newest first.
    pub fn list(&self) -> Vec<Refusal> {
        self.list.lock().unwrap().clone()
    }

    pub fn to_proto(&self) -> Vec<pb::RefusedJoin> {
        self.list()
            .into_iter()
            .map(|r| pb::RefusedJoin {
                site_id: r.site_id,
                code: code_name(r.code).to_string(),
                message: r.message,
                last_at: Some(prost_types::Timestamp::from(r.last_at)),
                count: r.count,
            })
            .collect()
    }
}

/// A status code as gRPC spells it.
pub fn code_name(c: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match c {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_counted_newest_first_bounded_and_transient_answers_are_not_kept() {
        let r = RefusedJoins::default();
        r.record("a", &tonic::Status::invalid_argument("workload_cidrs[0]: public"));
        r.record("b", &tonic::Status::unavailable("busy"));
        r.record("b", &tonic::Status::deadline_exceeded("slow"));
        r.record("c", &tonic::Status::already_exists("another CA"));
        r.record("a", &tonic::Status::invalid_argument("workload_cidrs[0]: public"));
        let l = r.list();
        assert_eq!(
            l.iter().map(|x| (x.site_id.as_str(), x.count)).collect::<Vec<_>>(),
            [("a", 2), ("c", 1)]
        );
        for i in 0..100 {
            r.record(&format!("s{i}"), &tonic::Status::invalid_argument("x"));
        }
        let l = r.list();
        assert_eq!(l.len(), KEPT);
        assert_eq!(l[0].site_id, "s99");
        assert_eq!(r.to_proto()[0].code, "INVALID_ARGUMENT");
    }
}
