//! The peering token: `weftp1.<base64url JSON>`.

use super::*;

/// What a peering token holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeeringToken {
    pub site: String,
    pub endpoints: Vec<String>,
    /// SHA-256 of the site CA certificate, hex.
    pub fp: String,
    pub id: String,
    pub secret: String,
    /// Expiry, milliseconds since the epoch.
    pub exp: u64,
}

impl PeeringToken {
    pub fn encode(&self) -> String {
        let json = serde_json::to_vec(self).expect("a token serializes");
        format!(
            "weftp1.{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json)
        )
    }

    pub fn decode(text: &str) -> Result<PeeringToken, Error> {
        let bad = |why: &str| {
            Error::InvalidArgument(format!(
                "the peering token is malformed ({why}); paste it whole as printed by `weftctl peering token`"
            ))
        };
        let body = text
            .trim()
            .strip_prefix("weftp1.")
            .ok_or_else(|| bad("it does not start with weftp1."))?;
        let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(body)
            .map_err(|_| bad("not base64"))?;
        let t: PeeringToken = serde_json::from_slice(&json).map_err(|_| bad("unreadable contents"))?;
        if t.fp.len() != 64 || !t.fp.bytes().all(|b| b.is_ascii_hexdigit()) || t.endpoints.is_empty() {
            return Err(bad("no fingerprint or no endpoint"));
        }
        Ok(t)
    }
}
