//! Serde as the string forms, read back through the one parser of each:
//! a record in a store holds `"hT7X…="`, never a byte array.

use serde::de::Error;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::policy::Protocol;
use crate::{Cidr, WgKey};

impl Serialize for WgKey {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for WgKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<WgKey, D::Error> {
        let text = String::deserialize(d)?;
        WgKey::parse("a WireGuard key", &text).map_err(D::Error::custom)
    }
}

impl Serialize for Cidr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Cidr, D::Error> {
        let text = String::deserialize(d)?;
        crate::net::cidr(&text).map_err(D::Error::custom)
    }
}

impl Serialize for Protocol {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Protocol {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Protocol, D::Error> {
        let text = String::deserialize(d)?;
        Protocol::parse(&text)
            .map_err(D::Error::custom)?
            .ok_or_else(|| D::Error::custom("a protocol: give tcp, udp or icmp"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_cidrs_are_their_strings() {
        let k = WgKey::from_bytes([7; 32]);
        let json = serde_json::to_string(&k).unwrap();
        assert_eq!(json, format!("\"{k}\""));
        assert_eq!(serde_json::from_str::<WgKey>(&json).unwrap(), k);
        assert!(serde_json::from_str::<WgKey>("\"AAAA\"").is_err());
        let c = crate::net::cidr("fd00:1::/48").unwrap();
        assert_eq!(serde_json::to_string(&c).unwrap(), "\"fd00:1::/48\"");
        assert_eq!(
            serde_json::from_str::<Cidr>("\"10.1.0.0/16\"").unwrap().to_string(),
            "10.1.0.0/16"
        );
        assert!(serde_json::from_str::<Cidr>("\"10.1.0.1/16\"").is_err());
    }
}
