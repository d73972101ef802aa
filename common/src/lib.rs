//! What the controller, the agents and weftctl share, written once: TLS
//! trust and the one gRPC connector (feature `net`), certificate
//! fingerprints, files written whole, retry backoff, logging and `/metrics`
//! serving, raw ICMP echo and supervised background tasks.
//!
//! A leaf: it knows the API's messages and nothing else of weft.

pub mod discovery;
pub mod fs;
pub mod icmp;
pub mod obs;
#[cfg(feature = "net")]
pub mod task;
#[cfg(feature = "net")]
pub mod tls;

use std::time::Duration;

use sha2::Digest;

/// Whether `s` is a DNS label as weft writes one (see
/// [`weft_types::name::dns_label`]).
pub use weft_types::name::dns_label as is_dns_label;

/// SHA-256 of `data`, lower-case hex (a certificate's fingerprint when
/// `data` is its DER).
pub fn sha256_hex(data: impl AsRef<[u8]>) -> String {
    hex::encode(sha2::Sha256::digest(data.as_ref()))
}

/// The fingerprint weft pins a certificate by: SHA-256 of its DER, hex.
pub fn fingerprint(der: &[u8]) -> String {
    sha256_hex(der)
}

/// A DER certificate as PEM (LF line endings).
pub fn pem_of(der: &[u8]) -> String {
    let config = pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF);
    pem::encode_config(&pem::Pem::new("CERTIFICATE", der.to_vec()), config)
}

/// Retry delays for reconnecting: 1 s doubling to 60 s, with jitter, never
/// giving up.
pub fn backoff() -> impl Iterator<Item = Duration> {
    backoff_between(Duration::from_secs(1), Duration::from_secs(60))
}

/// Retry delays from `min` doubling to `max`, with jitter, never giving up.
pub fn backoff_between(min: Duration, max: Duration) -> impl Iterator<Item = Duration> {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(min)
        .with_max_delay(max)
        .with_jitter()
        .without_max_times()
        .build()
}
