//! Files written whole or not at all.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use anyhow::Context;

/// Writes `data` to `path` with `mode` through a temporary file, fsync and
/// rename: a crash leaves the old file or the new one, never half of one,
/// and a key is never readable by others, not even for a moment.
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
    Ok(())
}

/// Makes the renames in directory `dir` durable (fsync of the directory):
/// between the steps of a sequence of files that must land in order, such
/// as a CA rotation's, so that a power loss cannot reorder them.
pub fn sync_dir(dir: &Path) -> anyhow::Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("cannot sync {}", dir.display()))
}
