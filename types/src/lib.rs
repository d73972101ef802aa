//! weft's typed values, each with its one parser. Text crosses into weft
//! at a few borders (the API's messages, the CLI, the configuration file,
//! the store, files on a host); there it is parsed once, by the function
//! here for its kind, into a value that cannot be malformed, and the
//! controller, the agent's guard and the data plane all use the same
//! parser. Every error names the field it came from and says what to
//! write instead.
//!
//! - [`net`]: CIDRs ([`Cidr`]: both families, canonical, no host bits),
//!   addresses, interface addresses (with host bits), endpoints;
//! - [`key`]: WireGuard keys ([`WgKey`], [`WgSecret`]);
//! - [`name`]: the names of weft's links and namespaces;
//! - [`policy`]: an export rule's protocol and ports.
//!
//! With feature `serde`, [`WgKey`] and [`Cidr`] are written as their
//! string forms, and read through the same parsers.
//!
//! No I/O, no weft crate: a leaf every layer may use.

pub mod key;
pub mod name;
pub mod net;
pub mod policy;
#[cfg(feature = "serde")]
mod serde_impls;
pub mod version;

pub use key::{WgKey, WgSecret};
pub use net::{Cidr, Family};

/// `text` quoted for an error message, cut to its first 64 characters: a
/// message echoes what the caller sent, and must not echo a megabyte of it
/// (gRPC carries messages in headers, which peers limit).
pub fn shown(text: &str) -> String {
    const MAX: usize = 64;
    if text.chars().count() <= MAX {
        return format!("{text:?}");
    }
    let head: String = text.chars().take(MAX).collect();
    format!("{head:?}… ({} bytes)", text.len())
}
