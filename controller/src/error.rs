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

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        use tonic::Status;
        match e {
            Error::InvalidArgument(m) => Status::invalid_argument(m),
            Error::NotFound(m) => Status::not_found(m),
            Error::AlreadyExists(m) => Status::already_exists(m),
            Error::ResourceExhausted(m) => Status::resource_exhausted(m),
            Error::FailedPrecondition(m) => Status::failed_precondition(m),
            Error::Unauthenticated(m) => Status::unauthenticated(m),
            Error::PermissionDenied(m) => Status::permission_denied(m),
            Error::Aborted(m) => Status::aborted(m),
            Error::Store(StoreError::Unavailable(m)) => Status::unavailable(format!(
                "the controller's store is unavailable ({m}); retry when it is back"
            )),
            Error::Store(e) => Status::internal(e.to_string()),
        }
    }
}
