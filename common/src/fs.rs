//! Files written whole or not at all.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use anyhow::Context;

/// Writes `data` to `path` with `mode` through a temporary file, fsync,
/// rename and an fsync of the directory: a crash leaves the old file or the
/// new one, never half of one, and a key is never readable by others, not
/// even for a moment.
pub fn write_file(path: &Path, data: impl AsRef<[u8]>, mode: u32) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    f.write_all(data.as_ref())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    // The rename itself reaches the disk before the next write does: a
    // sequence of files (a CA rotation's) survives a power loss in order.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .with_context(|| format!("cannot sync {}", dir.display()))?;
    }
    Ok(())
}
