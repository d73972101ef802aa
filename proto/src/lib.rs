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
    include!(concat!(env!("OUT_DIR"), "/clients/weft.v1.rs"));
    #[cfg(feature = "grpc")]
    include!(concat!(env!("OUT_DIR"), "/servers/weft.v1.rs"));
}

pub mod compat;
pub mod wire;

#[cfg(feature = "grpc")]
pub mod codec {
    //! prost's gRPC codec with small starting buffers. Every agent holds
    //! two streams open for as long as it runs (its Watch and its reports),
    //! and a controller holds them for every agent: tonic's default 8 KiB
    //! per stream and direction would be most of an idle agent's cost. The
    //! buffers still grow to whatever message comes (a snapshot).

    use std::marker::PhantomData;

    use tonic::codec::BufferSettings;

    /// Where a stream's encode and decode buffers start (not 0: tonic
    /// divides by it when compressing).
    const BUFFER: usize = 128;
    /// tonic's default: how much is encoded before the stream yields.
    const YIELD_THRESHOLD: usize = 32 * 1024;

    #[derive(Debug, Clone, Copy)]
    pub struct Codec<T, U>(PhantomData<(T, U)>);

    impl<T, U> Default for Codec<T, U> {
        fn default() -> Self {
            Codec(PhantomData)
        }
    }

    impl<T, U> tonic::codec::Codec for Codec<T, U>
    where
        T: prost::Message + Send + 'static,
        U: prost::Message + Default + Send + 'static,
    {
        type Encode = T;
        type Decode = U;
        type Encoder = <tonic_prost::ProstCodec<T, U> as tonic::codec::Codec>::Encoder;
        type Decoder = <tonic_prost::ProstCodec<T, U> as tonic::codec::Codec>::Decoder;

        fn encoder(&mut self) -> Self::Encoder {
            tonic_prost::ProstCodec::<T, U>::raw_encoder(BufferSettings::new(BUFFER, YIELD_THRESHOLD))
        }

        fn decoder(&mut self) -> Self::Decoder {
            tonic_prost::ProstCodec::<T, U>::raw_decoder(BufferSettings::new(BUFFER, YIELD_THRESHOLD))
        }
    }
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

/// The `WatchRequest.features` entry of a gateway agent that enforces
/// export policies (`TunnelFilter.policed`).
pub const EXPORT_POLICY_FEATURE: &str = "export-policy";

/// The `WatchRequest.features` entry of a gateway agent whose export
/// policies may name IPv6 prefixes (an older one refuses such a filter).
pub const EXPORT_POLICY_V6_FEATURE: &str = "export-policy-v6";

/// The `WatchRequest.features` entry of a gateway agent whose WireGuard
/// tries a hole punch beside a relay (`WireguardPeer.direct`, weft's
/// userspace device) and reports when it moved there
/// (`TunnelStatus.on_direct`). Without it (kernel WireGuard, an older
/// agent) a punch is given time alone before a relay takes the tunnel.
pub const PUNCH_BESIDE_FEATURE: &str = "punch-beside";

/// The largest desired-state message an agent accepts. A gateway's
/// snapshot grows with its site: every node adds its tunnel, address and
/// routes (about 250 bytes), so tonic's default of 4 MiB stops a gateway
/// of a site with some 16,000 nodes from starting; 64 MiB holds a site of
/// a quarter of a million.
pub const MAX_DESIRED_MESSAGE: usize = 64 * 1024 * 1024;

/// Encoded `FileDescriptorSet` of every weft proto, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/weft_descriptor.bin"));

/// The content hash of a desired-state object that agents send on resume
/// (`weft.v1.ObjectVersion.hash`): the first 8 bytes, big-endian, of the
/// SHA-256 of its protobuf encoding.
pub fn object_hash(o: &v1::DesiredObject) -> u64 {
    hash_encoded(&prost::Message::encode_to_vec(o))
}

/// [`object_hash`] of an object already encoded.
pub fn hash_encoded(encoded: &[u8]) -> u64 {
    use sha2::Digest;
    let d = sha2::Sha256::digest(encoded);
    u64::from_be_bytes(d[..8].try_into().expect("a SHA-256 digest has 32 bytes"))
}

/// A protobuf timestamp `ms` milliseconds after the Unix epoch.
pub fn timestamp_ms(ms: u64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: (ms / 1000) as i64,
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

/// Milliseconds after the Unix epoch of a protobuf timestamp (0 before
/// it).
pub fn ms_of_timestamp(t: &prost_types::Timestamp) -> u64 {
    let ms = t
        .seconds
        .saturating_mul(1000)
        .saturating_add(i64::from(t.nanos / 1_000_000));
    u64::try_from(ms).unwrap_or(0)
}
