//! The `weft.v1` gRPC API: generated prost messages and tonic services.
//!
//! This crate holds wire types only (the services behind feature `grpc`,
//! on by default). The controller and agents convert them to
//! their own domain types at the edge; nothing here validates or interprets
//! a field.

#![allow(clippy::all, missing_docs)]

pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/msgs/weft.v1.rs"));
    #[cfg(feature = "grpc")]
    include!(concat!(env!("OUT_DIR"), "/svc/weft.v1.rs"));
}

/// The routing table weft owns in a host's own namespace: every route a
/// controller may send for a host's own namespace lives here (in weft's
/// peering namespaces, which weft owns whole, any table).
pub const HOST_TABLE: u32 = 7765;

/// The one policy-rule priority weft owns in a host's own namespace.
pub const HOST_RULE_PRIORITY: u32 = 7765;

/// Metadata on the status a controller ends an agent's Watch with when the
/// admin removed that agent (its record is gone): the agent then removes
/// what it applied and stops. Any other refusal (a revoked or unknown
/// certificate) leaves the host's data plane as it is.
pub const REMOVED: &str = "weft-removed";

/// Encoded `FileDescriptorSet` of every weft proto, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/weft_descriptor.bin"));

/// The content hash of a desired-state object that agents send on resume
/// (`weft.v1.ObjectVersion.hash`): the first 8 bytes, big-endian, of the
/// SHA-256 of its protobuf encoding.
pub fn object_hash(o: &v1::DesiredObject) -> u64 {
    use sha2::Digest;
    let d = sha2::Sha256::digest(prost::Message::encode_to_vec(o));
    u64::from_be_bytes(d[..8].try_into().expect("a SHA-256 digest has 32 bytes"))
}

/// A protobuf timestamp `ms` milliseconds after the Unix epoch.
pub fn timestamp_ms(ms: u64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: (ms / 1000) as i64,
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}
