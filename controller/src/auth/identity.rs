//! Identities in certificates: the URI SAN `weft://<site>/<role>/<name>`
//! and the serial, as weft reads and writes them.

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    Admin,
    Node,
    Gateway,
    /// A peered site's controller (federation).
    Site,
    Controller,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Node => "node",
            Role::Gateway => "gateway",
            Role::Site => "site",
            Role::Controller => "controller",
        }
    }

    fn parse(s: &str) -> Option<Role> {
        Some(match s {
            "admin" => Role::Admin,
            "node" => Role::Node,
            "gateway" => Role::Gateway,
            "site" => Role::Site,
            "controller" => Role::Controller,
            _ => return None,
        })
    }
}

/// A verified certificate's identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub site: String,
    pub role: Role,
    pub name: String,
    /// Serial number, lower-case hex.
    pub serial: String,
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {:?}", self.role.as_str(), self.name)
    }
}

/// A certificate's serial number as weft writes it: lower-case hex without
/// leading zero bytes.
pub(crate) fn hex_serial(raw: &[u8]) -> String {
    let start = raw.iter().position(|b| *b != 0).unwrap_or(raw.len());
    hex::encode(&raw[start..])
}

/// The identity in a certificate's URI SAN.
pub fn identity_of(der: &[u8]) -> Result<Identity, String> {
    identity_until(der).map(|(id, _)| id)
}

/// The identity in a certificate's URI SAN, and the end of its validity.
pub(super) fn identity_until(der: &[u8]) -> Result<(Identity, std::time::SystemTime), String> {
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
    let (_, cert) = X509Certificate::from_der(der).map_err(|e| format!("the client certificate is unreadable: {e}"))?;
    let end = u64::try_from(cert.validity().not_after.timestamp()).map_or(std::time::UNIX_EPOCH, |s| {
        std::time::UNIX_EPOCH + std::time::Duration::from_secs(s)
    });
    let serial = hex_serial(cert.raw_serial());
    let san = cert.subject_alternative_name().ok().flatten();
    let uri = san
        .iter()
        .flat_map(|s| s.value.general_names.iter())
        .find_map(|g| match g {
            GeneralName::URI(u) if u.starts_with("weft://") => Some(u.to_string()),
            _ => None,
        })
        .ok_or("the client certificate carries no weft identity (URI SAN weft://<site>/<role>/<name>)")?;
    let rest = &uri["weft://".len()..];
    let parts: Vec<&str> = rest.split('/').collect();
    let [site, role, name] = parts[..] else {
        return Err(format!(
            "the certificate identity {uri} is not weft://<site>/<role>/<name>"
        ));
    };
    let role = Role::parse(role).ok_or_else(|| format!("the certificate identity {uri} has an unknown role"))?;
    Ok((
        Identity {
            site: site.into(),
            role,
            name: name.into(),
            serial,
        },
        end,
    ))
}
