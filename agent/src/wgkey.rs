//! The gateway's WireGuard key: generated on the host, kept in
//! `<state-dir>/wireguard.key` (mode 0600, base64 like `wg genkey`), never
//! sent anywhere. Only the public key leaves, through `UpdateGateway`.

use std::path::Path;

use anyhow::Context;
use weft_types::{WgKey, WgSecret};

pub const KEY_FILE: &str = "wireguard.key";

/// Loads the private key, creating it on first use; returns the public key.
pub fn load_or_create(dir: &Path) -> anyhow::Result<WgKey> {
    Ok(keys(dir)?.1)
}

/// The (private, public) keys; the private key is created on first use.
pub fn keys(dir: &Path) -> anyhow::Result<(WgSecret, WgKey)> {
    let path = dir.join(KEY_FILE);
    let secret = match std::fs::read_to_string(&path) {
        Ok(text) => WgSecret::parse(&path.display().to_string(), text.trim())
            .map_err(|e| anyhow::anyhow!("{e}; remove it to generate a new one"))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut k = [0u8; 32];
            ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut k)
                .map_err(|_| anyhow::anyhow!("the system RNG failed"))?;
            std::fs::create_dir_all(dir)?;
            let secret = WgSecret::from_bytes(k);
            crate::identity::write_file(&path, secret.to_base64(), 0o600)?;
            tracing::info!(file = %path.display(), "generated the WireGuard key");
            secret
        }
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let public = x25519_dalek::PublicKey::from(&x25519_dalek::StaticSecret::from(*secret.as_bytes()));
    Ok((secret, WgKey::from_bytes(*public.as_bytes())))
}

#[cfg(test)]
mod tests {
    #[test]
    fn key_is_created_once_private_and_stable() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let a = super::load_or_create(d.path()).unwrap();
        let b = super::load_or_create(d.path()).unwrap();
        assert_eq!(a, b);
        let mode = std::fs::metadata(d.path().join(super::KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::remove_file(d.path().join(super::KEY_FILE)).unwrap();
        assert_ne!(super::load_or_create(d.path()).unwrap(), a, "a new key after removal");
    }
}
