//! The gateway's WireGuard key: generated on the host, kept in
//! `<state-dir>/wireguard.key` (mode 0600, base64 like `wg genkey`), never
//! sent anywhere. Only the public key leaves, through `UpdateGateway`.

use std::path::Path;

use anyhow::{Context, bail};
use base64::Engine;

pub const KEY_FILE: &str = "wireguard.key";

/// Loads the private key, creating it on first use; returns the public key
/// (base64).
pub fn load_or_create(dir: &Path) -> anyhow::Result<String> {
    Ok(keys(dir)?.1)
}

/// (private, public) keys, base64; the private key is created on first use.
pub fn keys(dir: &Path) -> anyhow::Result<(String, String)> {
    let path = dir.join(KEY_FILE);
    let b64 = base64::engine::general_purpose::STANDARD;
    let secret: [u8; 32] = match std::fs::read_to_string(&path) {
        Ok(text) => {
            let raw = b64
                .decode(text.trim())
                .with_context(|| format!("{} is not a base64 key", path.display()))?;
            match <[u8; 32]>::try_from(raw.as_slice()) {
                Ok(k) => k,
                Err(_) => bail!(
                    "{} does not hold a 32-byte key; remove it to generate a new one",
                    path.display()
                ),
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut k = [0u8; 32];
            ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut k)
                .map_err(|_| anyhow::anyhow!("the system RNG failed"))?;
            std::fs::create_dir_all(dir)?;
            crate::identity::write_file(&path, b64.encode(k), 0o600)?;
            tracing::info!(file = %path.display(), "generated the WireGuard key");
            k
        }
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let public = x25519_dalek::PublicKey::from(&x25519_dalek::StaticSecret::from(secret));
    Ok((b64.encode(secret), b64.encode(public.as_bytes())))
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
