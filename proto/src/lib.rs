//! The `weft.v1` gRPC API: generated prost messages and tonic services.
//!
//! This crate holds wire types only. The controller and agents convert them to
//! their own domain types at the edge; nothing here validates or interprets
//! a field.

#![allow(clippy::all, missing_docs)]

pub mod obs;

pub mod v1 {
    tonic::include_proto!("weft.v1");
}

/// The routing table weft owns in a host's own namespace: every route a
/// controller may send for a host's own namespace lives here (in weft's
/// peering namespaces, which weft owns whole, any table).
pub const HOST_TABLE: u32 = 7765;

/// The one policy-rule priority weft owns in a host's own namespace.
pub const HOST_RULE_PRIORITY: u32 = 7765;

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
