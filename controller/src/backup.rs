//! Backup and restore of a site's state: `weft-controller backup` and
//! `weft-controller restore`.
//!
//! A backup is every record the site keeps under its store root, read at
//! one revision by the running controller (`AdminService.Backup`: online,
//! on either store), and the site CA from the controller's host. Records on
//! leases (liveness, leadership) are left out: the processes that hold them
//! write them again. The file is a first line `weft-backup 1 sha256:<digest>
//! <length>` and a `weft.v1.BackupFile`; a restore refuses a file whose
//! digest or length does not match, before it writes anything.
//!
//! A restore goes onto a stopped, empty store. It writes a `restoring`
//! marker first and removes it last, in separate transactions: a restore
//! cut short leaves the marker, no controller starts on such a store, and
//! running the restore again starts over.

use std::path::{Path, PathBuf};

use std::os::unix::fs::DirBuilderExt;

use anyhow::{Context, bail};
use prost::Message;
use sha2::{Digest, Sha256};
use weft_proto::v1 as pb;

use crate::config::{ControllerConfig, StoreConfig};
use crate::state::State;
use crate::state::layout::Key;
use crate::store::{Compare, Op, Revision, Txn};

/// The file format this release writes and reads.
pub const FORMAT: u32 = 1;
const MAGIC: &str = "weft-backup";
/// Records per `BackupChunk`, kept well under gRPC's 4 MiB message.
const CHUNK_BYTES: usize = 1 << 20;
/// A restore transaction's most operations and bytes: under etcd's
/// defaults (128 operations, 1.5 MiB a request).
const TXN_OPS: usize = 100;
const TXN_BYTES: usize = 512 << 10;

/// Whether a record belongs in a backup: not on a lease, and not one that
/// only a running process or a restore writes.
fn kept(key: &Key, lease: i64) -> bool {
    lease == 0 && !matches!(key, Key::Leader | Key::Alive(..) | Key::Replica(..) | Key::Restoring)
}

/// The site's records at one revision, keys relative to the site's root.
pub async fn records(state: &State) -> Result<(Revision, Vec<pb::BackupRecord>), crate::error::Error> {
    let range = state.store().get_prefix(state.root()).await?;
    let out = range
        .kvs
        .into_iter()
        .filter(|kv| state.parse(&kv.key).is_some_and(|k| kept(&k, kv.lease)))
        .map(|kv| pb::BackupRecord {
            key: kv.key[state.root().len()..].to_string(),
            value: kv.value,
        })
        .collect();
    Ok((range.revision, out))
}

/// `AdminService.Backup`: the site's records at one revision, with their
/// header, in the messages to stream.
pub async fn taken(state: &State) -> Result<Vec<pb::BackupChunk>, crate::error::Error> {
    let (site, _) = state.site().await?;
    let (revision, records) = records(state).await?;
    let header = pb::BackupHeader {
        format: FORMAT,
        site_id: site.id.clone(),
        revision,
        controller_version: env!("CARGO_PKG_VERSION").into(),
        store: state.store().backend().into(),
        taken_at: Some(weft_proto::timestamp_ms(crate::domain::now_ms())),
        records: records.len() as u64,
    };
    tracing::info!(revision, records = records.len(), "backup taken");
    Ok(chunks(header, records))
}

/// The header and records in messages of at most about `CHUNK_BYTES`.
pub fn chunks(header: pb::BackupHeader, records: Vec<pb::BackupRecord>) -> Vec<pb::BackupChunk> {
    let mut out = vec![pb::BackupChunk {
        header: Some(header),
        records: Vec::new(),
    }];
    let mut size = 0;
    for r in records {
        let n = r.key.len() + r.value.len() + 8;
        let last = out.last_mut().expect("the first chunk is there");
        if size + n > CHUNK_BYTES && !last.records.is_empty() {
            out.push(pb::BackupChunk::default());
            size = 0;
        }
        size += n;
        out.last_mut().expect("a chunk").records.push(r);
    }
    out
}

/// The file's bytes: the checked first line, then the message.
pub fn encode(file: &pb::BackupFile) -> Vec<u8> {
    let body = file.encode_to_vec();
    let mut out = format!(
        "{MAGIC} {FORMAT} sha256:{} {}\n",
        hex::encode(Sha256::digest(&body)),
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

/// Reads a backup file's bytes; an error says what is wrong with it.
pub fn decode(bytes: &[u8]) -> Result<pb::BackupFile, String> {
    let nl = bytes
        .iter()
        .take(256)
        .position(|b| *b == b'\n')
        .ok_or("it is not a weft backup (no \"weft-backup\" first line)")?;
    let line = std::str::from_utf8(&bytes[..nl]).map_err(|_| "it is not a weft backup (its first line is not text)")?;
    let body = &bytes[nl + 1..];
    let f: Vec<&str> = line.split(' ').collect();
    let [magic, format, digest, len] = f[..] else {
        return Err(format!("it is not a weft backup (first line {line:?})"));
    };
    if magic != MAGIC {
        return Err(format!("it is not a weft backup (first line {line:?})"));
    }
    match format.parse::<u32>() {
        Ok(FORMAT) => {}
        Ok(n) if n > FORMAT => {
            return Err(format!(
                "it is in backup format {n}, newer than this release reads ({FORMAT}): restore it with the release that took it"
            ));
        }
        _ => return Err(format!("unknown backup format {format:?}")),
    }
    let len: usize = len
        .parse()
        .map_err(|_| format!("bad length {len:?} on its first line"))?;
    if body.len() != len {
        return Err(format!(
            "it is {} bytes after its first line, which says {len}: the file is truncated or was changed",
            body.len()
        ));
    }
    let want = digest
        .strip_prefix("sha256:")
        .ok_or("its first line has no sha256 digest")?;
    if hex::encode(Sha256::digest(body)) != want {
        return Err("its SHA-256 digest does not match its contents: the file is corrupt or was changed".into());
    }
    let file = pb::BackupFile::decode(body).map_err(|e| format!("its contents do not decode: {e}"))?;
    let header = file.header.as_ref().ok_or("it has no header")?;
    if header.records != file.records.len() as u64 {
        return Err(format!(
            "its header counts {} records but it holds {}",
            header.records,
            file.records.len()
        ));
    }
    Ok(file)
}

/// Checks what a backup holds before any of it is written: every key one
/// weft keeps (and none that only a running process writes), each once,
/// the site's record, and a CA that is the one the site's store records.
pub fn validate(file: &pb::BackupFile, site_id: &str) -> Result<(), String> {
    let header = file.header.as_ref().ok_or("it has no header")?;
    if header.site_id != site_id {
        return Err(format!(
            "it is a backup of site {:?}, and this controller is configured as site {site_id:?}: \
             restore it with that site's configuration",
            header.site_id
        ));
    }
    let mut seen = std::collections::HashSet::new();
    let mut ca_record = None;
    for r in &file.records {
        let key = Key::parse(&r.key).ok_or_else(|| format!("it holds a key weft does not keep: {:?}", r.key))?;
        if !kept(&key, 0) {
            return Err(format!("it holds {:?}, which a backup never contains", r.key));
        }
        if !seen.insert(r.key.as_str()) {
            return Err(format!("it holds {:?} twice", r.key));
        }
        if key == Key::CaFingerprint {
            ca_record = Some(String::from_utf8_lossy(&r.value).into_owned());
        }
        if key == Key::CaRetired {
            use rustls_pki_types::pem::PemObject;
            let retired = String::from_utf8_lossy(&r.value).into_owned();
            let trusted = rustls_pki_types::CertificateDer::pem_slice_iter(file.ca_pem.as_bytes()).flatten();
            if let Some(f) = trusted
                .map(|d| crate::pki::fingerprint(&d))
                .find(|f| retired.lines().any(|l| l.trim() == f))
            {
                return Err(format!(
                    "its site CA file trusts the CA {f}, which its records list as retired (it was taken on a \
                     replica whose pki files were not updated after a CA rotation): take one on the replica \
                     that rotated"
                ));
            }
        }
    }
    if !seen.contains(Key::Site.path().as_str()) {
        return Err("it holds no site record".into());
    }
    let ca = ca_fingerprint(&file.ca_pem).map_err(|e| format!("its site CA is unreadable: {e}"))?;
    // Taken between a rotation of the CA and the controller's restart,
    // the records still name the CA it replaced.
    let earlier = |r: &str| {
        use rustls_pki_types::pem::PemObject;
        rustls_pki_types::CertificateDer::pem_slice_iter(file.ca_pem.as_bytes())
            .flatten()
            .any(|d| crate::pki::fingerprint(&d) == r)
            || file.ca_retired.lines().any(|l| l.trim() == r)
    };
    if ca_record.as_deref().is_some_and(|r| r != ca && !earlier(r)) {
        return Err(format!(
            "its site CA (SHA-256 {ca}) is not the one its records were made with ({})",
            ca_record.unwrap_or_default()
        ));
    }
    Ok(())
}

/// Whether `key_pem` is the private key of certificate `cert_pem`.
fn key_matches(cert_pem: &str, key_pem: &str) -> anyhow::Result<()> {
    use rustls_pki_types::pem::PemObject;
    let der = rustls_pki_types::CertificateDer::from_pem_slice(cert_pem.as_bytes()).context("not a PEM certificate")?;
    if !crate::pki::key_matches_cert(key_pem, &der) {
        bail!("its key is not the certificate's");
    }
    Ok(())
}

/// SHA-256 of a PEM certificate's DER.
fn ca_fingerprint(pem: &str) -> anyhow::Result<String> {
    use rustls_pki_types::pem::PemObject;
    let der = rustls_pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).context("not a PEM certificate")?;
    Ok(crate::pki::fingerprint(&der))
}

/// What a backup holds, counted by kind, for people.
pub fn summary(records: &[pb::BackupRecord]) -> String {
    let mut n = [0usize; 6];
    for r in records {
        match Key::parse(&r.key) {
            Some(Key::Node(_)) => n[0] += 1,
            Some(Key::Gateway(_)) => n[1] += 1,
            Some(Key::Peering(_)) => n[2] += 1,
            Some(Key::Token(_) | Key::PeerToken(_)) => n[3] += 1,
            Some(Key::Name(_)) => n[4] += 1,
            Some(Key::Revoked(_)) => n[5] += 1,
            _ => {}
        }
    }
    format!(
        "{} nodes, {} gateways, {} peerings, {} tokens, {} names, {} revoked certificates",
        n[0], n[1], n[2], n[3], n[4], n[5]
    )
}

/// The suffix of the files `backup --out DIR/` writes.
pub const SUFFIX: &str = ".weft-backup";

/// Where `--out PATH` puts a backup: PATH itself, or, for a directory (one
/// that exists, or a path ending in `/`, created 0700), a new file in it
/// named by the site and the UTC time; and that directory. `keep` needs a
/// directory.
pub fn destination(out: &Path, site: &str, keep: Option<u32>) -> anyhow::Result<(PathBuf, Option<PathBuf>)> {
    let is_dir = out.is_dir() || out.as_os_str().to_string_lossy().ends_with('/');
    if !is_dir {
        if keep.is_some() {
            bail!("--keep needs --out to be a directory (end it with /)");
        }
        return Ok((out.to_path_buf(), None));
    }
    if !out.is_dir() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(out)
            .with_context(|| format!("cannot create {}", out.display()))?;
    }
    let t = time::OffsetDateTime::now_utc();
    let name = format!(
        "{site}-{:04}{:02}{:02}T{:02}{:02}{:02}Z{SUFFIX}",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    );
    Ok((out.join(name), Some(out.to_path_buf())))
}

/// Deletes all but the `keep` newest of site `site`'s backups in `dir`
/// (the one just `written`, and the newest others by the time in their
/// names); the deleted files.
pub fn prune(dir: &Path, site: &str, keep: usize, written: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let prefix = format!("{site}-");
    let mut ours: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.as_path() != written)
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.strip_prefix(&prefix)
                    .and_then(|r| r.strip_suffix(SUFFIX))
                    .is_some_and(|stamp| stamp.len() == 16 && stamp.ends_with('Z'))
            })
        })
        .collect();
    // The one just written counts among those kept, whatever its name
    // says (a clock set back).
    ours.sort();
    let old = ours.len().saturating_sub(keep.saturating_sub(1));
    let gone: Vec<PathBuf> = ours.into_iter().take(old).collect();
    for p in &gone {
        std::fs::remove_file(p).with_context(|| format!("cannot delete {}", p.display()))?;
    }
    Ok(gone)
}

/// `weft-controller backup`: asks the controller serving on the admin
/// socket for its records, adds the site CA from `<data-dir>/pki` (its key
/// unless `without_key`) and writes `out` (mode 0600) whole or not at all.
pub async fn take(cfg: &ControllerConfig, out: &Path, without_key: bool) -> anyhow::Result<pb::BackupFile> {
    let target = format!("unix:{}", cfg.admin_socket.display());
    let ch = weft_common::tls::connect(&target, &weft_common::tls::Trust::CaPem(String::new()), None)
        .await
        .with_context(|| format!("cannot reach the controller at {target}; is it running?"))?;
    let mut stream = weft_proto::v1::admin_service_client::AdminServiceClient::new(ch)
        .max_decoding_message_size(2 * CHUNK_BYTES + (1 << 20))
        .backup(pb::BackupRequest {})
        .await
        .map_err(|s| anyhow::anyhow!("the controller refused the backup: {}", s.message()))?
        .into_inner();
    let mut file = pb::BackupFile::default();
    while let Some(chunk) = stream
        .message()
        .await
        .map_err(|s| anyhow::anyhow!("the backup stream broke off: {}", s.message()))?
    {
        if let Some(h) = chunk.header {
            file.header = Some(h);
        }
        file.records.extend(chunk.records);
    }
    let Some(header) = &file.header else {
        bail!("the controller sent no backup header");
    };
    if header.records != file.records.len() as u64 {
        bail!(
            "the controller announced {} records and sent {}",
            header.records,
            file.records.len()
        );
    }
    let pki = cfg.data_dir.join("pki");
    let ca = pki.join(crate::pki::CA_CERT);
    file.ca_pem = std::fs::read_to_string(&ca).with_context(|| {
        format!(
            "cannot read the site CA {}: take backups on a controller host, with its configuration",
            ca.display()
        )
    })?;
    file.ca_cross_pem = std::fs::read_to_string(pki.join(crate::pki::CA_CROSS)).unwrap_or_default();
    file.ca_retired = std::fs::read_to_string(pki.join(crate::pki::CA_RETIRED)).unwrap_or_default();
    if !without_key {
        let key = pki.join(crate::pki::CA_KEY);
        file.ca_key_pem = std::fs::read_to_string(&key).with_context(|| format!("cannot read {}", key.display()))?;
    }
    validate(&file, &cfg.site.id).map_err(|e| anyhow::anyhow!("the backup would not restore: {e}"))?;
    weft_common::fs::write_file(out, encode(&file), 0o600)?;
    Ok(file)
}

/// What `restore` did, for its report.
pub struct Restored {
    pub file: pb::BackupFile,
    /// The site CA was written to this directory (else it was there).
    pub wrote_ca: Option<PathBuf>,
    /// An earlier restore had been cut short and was started over.
    pub restarted: bool,
    pub store: String,
}

/// `weft-controller restore`: checks `path`, puts the site CA in place and
/// writes the records onto the configured store, opened by `open` once
/// the file and the CA are found good; the store must be empty (or hold
/// only a restore that was cut short).
pub async fn restore<F>(cfg: &ControllerConfig, path: &Path, open: F) -> anyhow::Result<Restored>
where
    F: std::future::Future<Output = anyhow::Result<std::sync::Arc<dyn crate::store::Store>>>,
{
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let file = decode(&bytes).map_err(|e| anyhow::anyhow!("{} cannot be restored: {e}", path.display()))?;
    validate(&file, &cfg.site.id).map_err(|e| anyhow::anyhow!("{} cannot be restored: {e}", path.display()))?;
    if std::os::unix::net::UnixStream::connect(&cfg.admin_socket).is_ok() {
        bail!(
            "a controller is serving on {}: stop it, and every other replica of the site, before restoring",
            cfg.admin_socket.display()
        );
    }
    // A data directory lost with its host is made again (the embedded
    // store lives in it).
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&cfg.data_dir)
        .with_context(|| format!("cannot create the data directory {}", cfg.data_dir.display()))?;
    let store = open.await?;
    let where_ = match &cfg.store {
        StoreConfig::Embedded { path, .. } => format!("the embedded store {}", path.display()),
        StoreConfig::Etcd { endpoints, .. } => format!("etcd at {}", endpoints.join(",")),
    };
    let state = State::new(store.clone(), &cfg.site.id);
    let root = state.root().to_string();
    let marker = state.at(Key::Restoring);
    let existing = store.get_prefix(&root).await?;
    let found = existing
        .kvs
        .iter()
        .find(|kv| kv.key == marker)
        .map(|kv| kv.mod_revision);
    let restarted = found.is_some();
    if !existing.kvs.is_empty() && !restarted {
        let how = match &cfg.store {
            StoreConfig::Embedded { path, .. } => format!("delete {}", path.display()),
            StoreConfig::Etcd { .. } => format!("`etcdctl del --prefix {root}`"),
        };
        bail!(
            "{where_} already holds site {}'s state ({} keys at revision {}): a restore goes onto an empty store. \
             Stop every controller of the site and {how} first",
            cfg.site.id,
            existing.kvs.len(),
            existing.revision
        );
    }
    // The CA only once the store is known to take the backup.
    let wrote_ca = put_ca(&cfg.data_dir.join("pki"), &file)?;
    // The marker first, alone, and only on the store as it was just read
    // (empty, or a restore cut short): a controller or another restore
    // that wrote since makes this one stop. Every later write checks that
    // the marker is still the one this restore wrote.
    let site_key = state.at(Key::Site);
    let begin = match found {
        Some(rev) => Txn::new().when(Compare::ModRevision(marker.clone(), rev)),
        None => Txn::new()
            .when(Compare::Version(marker.clone(), 0))
            .when(Compare::Version(site_key, 0)),
    }
    .then(Op::put(marker.clone(), b"1".to_vec()));
    let begun = store.txn(begin).await?;
    if !begun.succeeded {
        bail!(
            "another process wrote to the store as the restore began; stop every controller of the site and restore again"
        );
    }
    let begun = begun.revision;
    // Start over after a restore that was cut short: what it wrote goes,
    // under the marker.
    if restarted {
        for kv in existing.kvs.iter().filter(|kv| kv.key != marker) {
            write(
                &*store,
                Txn::new()
                    .when(Compare::ModRevision(marker.clone(), begun))
                    .then(Op::delete(kv.key.clone())),
            )
            .await?;
        }
    }
    let ours = || Txn::new().when(Compare::ModRevision(marker.clone(), begun));
    let mut batch = ours();
    let mut bytes = 0;
    for r in &file.records {
        if batch.ops.len() >= TXN_OPS || (bytes + r.value.len() > TXN_BYTES && !batch.ops.is_empty()) {
            write(&*store, std::mem::replace(&mut batch, ours())).await?;
            bytes = 0;
        }
        bytes += r.value.len() + r.key.len();
        batch.ops.push(Op::put(format!("{root}{}", r.key), r.value.clone()));
    }
    batch.ops.push(Op::delete(marker.clone()));
    write(&*store, batch).await?;
    Ok(Restored {
        file,
        wrote_ca,
        restarted,
        store: where_,
    })
}

async fn write(store: &dyn crate::store::Store, txn: Txn) -> anyhow::Result<()> {
    if !store.txn(txn).await?.succeeded {
        bail!(
            "another process wrote to the store during the restore; stop every controller of the site and restore again"
        );
    }
    Ok(())
}

/// Puts the backup's site CA into `dir` when there is none; a CA already
/// there must be the backup's. Returns `dir` when it wrote one.
fn put_ca(dir: &Path, file: &pb::BackupFile) -> anyhow::Result<Option<PathBuf>> {
    let want = ca_fingerprint(&file.ca_pem)?;
    let (cert, key) = (dir.join(crate::pki::CA_CERT), dir.join(crate::pki::CA_KEY));
    if cert.exists() || key.exists() {
        let have = crate::pki::SiteCa::load(dir)
            .with_context(|| format!("{} holds part of a site CA", dir.display()))?
            .fingerprint;
        if have != want {
            bail!(
                "{} holds another site CA (SHA-256 {have}) than the backup's ({want}): \
                 move it away to restore the backup's, or restore on the host it came from",
                dir.display()
            );
        }
        return Ok(None);
    }
    if file.ca_key_pem.is_empty() {
        bail!(
            "the backup holds no CA key (it was taken with --without-ca-key) and {} has none: \
             put the site's ca.pem and ca.key there first",
            dir.display()
        );
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    weft_common::fs::write_file(&key, &file.ca_key_pem, 0o600)?;
    for (name, text) in [
        (crate::pki::CA_CROSS, &file.ca_cross_pem),
        (crate::pki::CA_RETIRED, &file.ca_retired),
    ] {
        if !text.is_empty() {
            weft_common::fs::write_file(&dir.join(name), text, 0o644)?;
        }
    }
    weft_common::fs::write_file(&cert, &file.ca_pem, 0o644)?;
    let loaded = crate::pki::SiteCa::load(dir).and_then(|_| key_matches(&file.ca_pem, &file.ca_key_pem));
    if let Err(e) = loaded {
        let _ = (std::fs::remove_file(&cert), std::fs::remove_file(&key));
        return Err(e.context("the backup's site CA does not load"));
    }
    Ok(Some(dir.to_path_buf()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(key: &str, value: &str) -> pb::BackupRecord {
        pb::BackupRecord {
            key: key.into(),
            value: value.as_bytes().to_vec(),
        }
    }

    fn sample() -> pb::BackupFile {
        let dir = tempfile::tempdir().unwrap();
        let pki = crate::pki::ensure(dir.path(), "s1", &["ctl".into()]).unwrap();
        let records = vec![
            record("ca-fingerprint", &pki.ca.fingerprint),
            record("nodes/n1", "{}"),
            record("site", "{}"),
        ];
        pb::BackupFile {
            header: Some(pb::BackupHeader {
                format: FORMAT,
                site_id: "s1".into(),
                revision: 7,
                records: records.len() as u64,
                ..Default::default()
            }),
            records,
            ca_pem: pki.ca.pem.clone(),
            ca_key_pem: std::fs::read_to_string(dir.path().join(crate::pki::CA_KEY)).unwrap(),
            ..Default::default()
        }
    }

    #[test]
    fn a_backup_reads_back_and_any_damage_is_refused() {
        let f = sample();
        let bytes = encode(&f);
        assert_eq!(decode(&bytes).unwrap(), f);
        validate(&f, "s1").unwrap();
        let truncated = &bytes[..bytes.len() - 1];
        assert!(decode(truncated).unwrap_err().contains("truncated"));
        let mut flipped = bytes.clone();
        let last = flipped.len() - 3;
        flipped[last] ^= 1;
        assert!(decode(&flipped).unwrap_err().contains("digest"));
        assert!(decode(b"{\"not\": 1}\n").unwrap_err().contains("not a weft backup"));
        let newer = String::from_utf8_lossy(&bytes).replacen("weft-backup 1 ", "weft-backup 2 ", 1);
        assert!(decode(newer.as_bytes()).unwrap_err().contains("newer"));
        // The CA's key must be the certificate's.
        key_matches(&f.ca_pem, &f.ca_key_pem).unwrap();
        let other = sample();
        assert!(key_matches(&f.ca_pem, &other.ca_key_pem).is_err());
    }

    #[test]
    fn a_backup_of_another_site_or_with_foreign_records_is_refused() {
        let f = sample();
        assert!(validate(&f, "s2").unwrap_err().contains("site \"s1\""));
        for (bad, why) in [
            ("alive/node/n1", "never contains"),
            ("leader", "never contains"),
            ("../etc", "does not keep"),
            ("nodes/n1", "twice"),
        ] {
            let mut g = f.clone();
            g.records.push(record(bad, "{}"));
            assert!(validate(&g, "s1").unwrap_err().contains(why), "{bad}");
        }
        let mut g = f.clone();
        g.records.retain(|r| r.key != "site");
        assert!(validate(&g, "s1").unwrap_err().contains("no site record"));
        let mut g = f.clone();
        g.records[0].value = b"00".to_vec();
        assert!(validate(&g, "s1").unwrap_err().contains("not the one"));
    }

    #[test]
    fn a_directory_gets_timed_files_and_keeps_the_newest() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("backups/");
        let (f, got) = destination(&dir, "s1", Some(2)).unwrap();
        assert_eq!(got.as_deref(), Some(dir.as_path()));
        let name = f.file_name().unwrap().to_str().unwrap().to_string();
        assert!(name.starts_with("s1-20") && name.ends_with("Z.weft-backup"), "{name}");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        for n in [
            "s1-20260101T000000Z",
            "s1-20260102T000000Z",
            "s1-20260103T000000Z",
            "s2-20250101T000000Z",
        ] {
            std::fs::write(dir.join(format!("{n}{SUFFIX}")), b"x").unwrap();
        }
        std::fs::write(dir.join("s1-notes.txt"), b"x").unwrap();
        let written = dir.join(format!("s1-20260103T000000Z{SUFFIX}"));
        let gone = prune(&dir, "s1", 2, &written).unwrap();
        assert_eq!(gone, vec![dir.join(format!("s1-20260101T000000Z{SUFFIX}"))]);
        // Written with a clock set back: still kept, the older others go.
        let back = dir.join(format!("s1-20200101T000000Z{SUFFIX}"));
        std::fs::write(&back, b"x").unwrap();
        assert_eq!(prune(&dir, "s1", 1, &back).unwrap().len(), 2);
        assert!(back.exists());
        assert!(dir.join(format!("s2-20250101T000000Z{SUFFIX}")).exists());
        assert!(dir.join("s1-notes.txt").exists());
        let file = d.path().join("one.backup");
        assert_eq!(destination(&file, "s1", None).unwrap(), (file.clone(), None));
        assert!(
            destination(&file, "s1", Some(3))
                .unwrap_err()
                .to_string()
                .contains("--keep")
        );
    }

    #[test]
    fn chunks_stay_under_the_message_size_and_keep_every_record() {
        let big = "x".repeat(300 << 10);
        let records: Vec<_> = (0..10).map(|i| record(&format!("nodes/n{i}"), &big)).collect();
        let c = chunks(pb::BackupHeader::default(), records.clone());
        assert!(c[0].header.is_some() && c[1..].iter().all(|c| c.header.is_none()));
        assert!(c.iter().all(|c| c.encoded_len() < 2 * CHUNK_BYTES));
        let back: Vec<_> = c.into_iter().flat_map(|c| c.records).collect();
        assert_eq!(back, records);
    }
}
