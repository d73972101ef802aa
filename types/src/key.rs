//! WireGuard keys: 32 bytes, written in base64 as `wg genkey` writes them.
//! [`WgKey`] is a public key, shown freely; [`WgSecret`] a private one,
//! never shown by `Debug`.

use std::fmt;
use std::str::FromStr;

use base64::Engine;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// Why a text is not a WireGuard key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyError {
    NotBase64,
    /// It decodes, to this many bytes instead of 32.
    Length(usize),
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::NotBase64 => write!(f, "is not a 32-byte WireGuard key in base64 (it is not base64)"),
            KeyError::Length(n) => write!(f, "is not a 32-byte WireGuard key in base64 (it decodes to {n} bytes)"),
        }
    }
}

fn decode(text: &str) -> Result<[u8; 32], KeyError> {
    // A key is 44 characters; anything much longer is not one, and is not
    // decoded.
    if text.len() > 64 {
        return Err(KeyError::Length(text.len() * 3 / 4));
    }
    let raw = B64.decode(text).map_err(|_| KeyError::NotBase64)?;
    <[u8; 32]>::try_from(raw.as_slice()).map_err(|_| KeyError::Length(raw.len()))
}

fn hex(bytes: &[u8; 32]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(64);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 15)] as char);
    }
    s
}

/// A WireGuard public key.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WgKey([u8; 32]);

impl WgKey {
    pub const fn from_bytes(bytes: [u8; 32]) -> WgKey {
        WgKey(bytes)
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// In lower-case hex, as WireGuard's UAPI (boringtun's) takes it.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// Parses field `what`: a 32-byte key in base64, exactly (no spaces
    /// around it), or an error naming the field and quoting what it held.
    pub fn parse(what: &str, text: &str) -> Result<WgKey, String> {
        text.parse()
            .map_err(|e: KeyError| format!("{what} {} {e}", crate::shown(text)))
    }
}

impl FromStr for WgKey {
    type Err = KeyError;
    fn from_str(text: &str) -> Result<WgKey, KeyError> {
        decode(text).map(WgKey)
    }
}

impl fmt::Display for WgKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&B64.encode(self.0))
    }
}

impl fmt::Debug for WgKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WgKey({self})")
    }
}

/// A WireGuard private key. `Debug` does not show it; [`WgSecret::to_base64`]
/// and [`WgSecret::to_hex`] do, for the file that keeps it and the device
/// that uses it.
#[derive(Clone, PartialEq, Eq)]
pub struct WgSecret([u8; 32]);

impl WgSecret {
    pub const fn from_bytes(bytes: [u8; 32]) -> WgSecret {
        WgSecret(bytes)
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    pub fn to_base64(&self) -> String {
        B64.encode(self.0)
    }

    /// In lower-case hex, as WireGuard's UAPI takes it.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// Parses field `what`; the error does not quote the text (it may be
    /// a secret with a typo).
    pub fn parse(what: &str, text: &str) -> Result<WgSecret, String> {
        decode(text).map(WgSecret).map_err(|e| format!("{what} {e}"))
    }
}

impl fmt::Debug for WgSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WgSecret(…)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_key_is_32_bytes_of_base64_exactly() {
        let k = WgKey::from_bytes([7; 32]);
        let text = k.to_string();
        assert_eq!(text.len(), 44);
        assert_eq!(text.parse::<WgKey>(), Ok(k));
        assert_eq!(format!(" {text}").parse::<WgKey>(), Err(KeyError::NotBase64));
        assert_eq!("AAAA".parse::<WgKey>(), Err(KeyError::Length(3)));
        assert_eq!("not a key!".parse::<WgKey>(), Err(KeyError::NotBase64));
        let long = "A".repeat(100_000);
        assert!(long.parse::<WgKey>().is_err());
        let e = WgKey::parse("gateways[0].public_key", "AAAA").unwrap_err();
        assert_eq!(
            e,
            "gateways[0].public_key \"AAAA\" is not a 32-byte WireGuard key in base64 (it decodes to 3 bytes)"
        );
        assert!(
            WgKey::parse("k", &long).unwrap_err().len() < 200,
            "a long text is cut in the message"
        );
    }

    #[test]
    fn hex_is_what_the_uapi_takes() {
        let mut b = [0u8; 32];
        b[0] = 0xab;
        b[31] = 0x01;
        let h = WgKey::from_bytes(b).to_hex();
        assert_eq!(h.len(), 64);
        assert!(h.starts_with("ab00") && h.ends_with("0001"));
        assert_eq!(WgSecret::from_bytes(b).to_hex(), h);
    }

    #[test]
    fn a_secret_is_not_shown() {
        let s = WgSecret::parse("private key", &WgKey::from_bytes([9; 32]).to_string()).unwrap();
        assert_eq!(format!("{s:?}"), "WgSecret(…)");
        let e = WgSecret::parse("private key", "c2VjcmV0").unwrap_err();
        assert!(!e.contains("c2VjcmV0"), "{e}");
    }

    proptest! {
        #[test]
        fn every_key_round_trips(bytes in proptest::array::uniform32(any::<u8>())) {
            let k = WgKey::from_bytes(bytes);
            prop_assert_eq!(k.to_string().parse::<WgKey>(), Ok(k));
            let s = WgSecret::from_bytes(bytes);
            prop_assert_eq!(WgSecret::parse("k", &s.to_base64()), Ok(s));
        }

        #[test]
        fn no_text_panics_the_parser(text in ".{0,80}") {
            let _ = text.parse::<WgKey>();
        }
    }
}
