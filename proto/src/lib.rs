//! The `weft.v1` gRPC API: generated prost messages and tonic services.
//!
//! This crate holds wire types only. The controller and agents convert them to
//! their own domain types at the edge; nothing here validates or interprets
//! a field.

#![allow(clippy::all, missing_docs)]

pub mod v1 {
    tonic::include_proto!("weft.v1");
}

/// Encoded `FileDescriptorSet` of every weft proto, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/weft_descriptor.bin"));
