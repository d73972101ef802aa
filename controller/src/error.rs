//! The errors callers act on, and their one mapping to gRPC status codes.

use crate::ipam::IpamError;
use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    Unauthenticated(String),
    #[error("{0}")]
    PermissionDenied(String),
    /// Optimistic concurrency kept losing to other writers.
    #[error("{0}")]
    Aborted(String),
    /// Something this call waits on (a peer) did not answer in time; the
    /// same call may be retried.
    #[error("{0}")]
    DeadlineExceeded(String),
    /// Something this call needs (a peer) cannot be reached or is busy;
    /// retry later.
    #[error("{0}")]
    Unavailable(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<IpamError> for Error {
    fn from(e: IpamError) -> Self {
        match e {
            IpamError::Exhausted(m) => Error::ResourceExhausted(m),
            IpamError::Conflict(m) => Error::AlreadyExists(m),
            IpamError::Invalid(m) => Error::InvalidArgument(m),
        }
    }
}

/// Metadata on a status whose call may simply be made again later (the
/// peer was slow or unreachable, the store was away, writers kept
/// colliding), as opposed to a transport error of the caller's own
/// connection: `weftctl peering create` retries on it.
pub const RETRYABLE: &str = "weft-retryable";

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        use tonic::Status;
        let retryable = matches!(
            e,
            Error::Aborted(_)
                | Error::DeadlineExceeded(_)
                | Error::Unavailable(_)
                | Error::Store(StoreError::Unavailable(_))
        );
        let mut s = match e {
            Error::InvalidArgument(m) => Status::invalid_argument(m),
            Error::NotFound(m) => Status::not_found(m),
            Error::AlreadyExists(m) => Status::already_exists(m),
            Error::ResourceExhausted(m) => Status::resource_exhausted(m),
            Error::FailedPrecondition(m) => Status::failed_precondition(m),
            Error::Unauthenticated(m) => Status::unauthenticated(m),
            Error::PermissionDenied(m) => Status::permission_denied(m),
            Error::Aborted(m) => Status::aborted(m),
            Error::DeadlineExceeded(m) => Status::deadline_exceeded(m),
            Error::Unavailable(m) => Status::unavailable(m),
            Error::Store(StoreError::Unavailable(m)) => Status::unavailable(format!(
                "the controller's store is unavailable ({m}); retry when it is back"
            )),
            Error::Store(e) => Status::internal(e.to_string()),
        };
        if retryable {
            s.metadata_mut()
                .insert(RETRYABLE, tonic::metadata::MetadataValue::from_static("1"));
        }
        s
    }
}

impl From<weft_core::enroll::Refused> for Error {
    fn from(r: weft_core::enroll::Refused) -> Error {
        use weft_core::enroll::Refused;
        match r {
            Refused::Unauthenticated(m) => Error::Unauthenticated(m),
            Refused::InvalidArgument(m) => Error::InvalidArgument(m),
            Refused::AlreadyExists(m) => Error::AlreadyExists(m),
            Refused::FailedPrecondition(m) => Error::FailedPrecondition(m),
        }
    }
}
