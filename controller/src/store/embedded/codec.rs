//! How the embedded store lays out its records: a key's value with its
//! revisions, version and lease in front, and a revision's change log entry.

use super::super::{EventKind, KeyValue, StoreError, WatchEvent};

pub(super) const HEADER: usize = 32;

pub(super) fn encode_kv(kv: &KeyValue) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + kv.value.len());
    for n in [kv.create_revision, kv.mod_revision, kv.version, kv.lease] {
        out.extend_from_slice(&n.to_le_bytes());
    }
    out.extend_from_slice(&kv.value);
    out
}

pub(super) fn read_i64(b: &[u8], at: usize) -> Result<i64, StoreError> {
    b.get(at..at + 8)
        .map(|s| i64::from_le_bytes(s.try_into().unwrap()))
        .ok_or_else(|| StoreError::Corrupt("truncated record".into()))
}

pub(super) fn decode_kv(key: &str, b: &[u8]) -> Result<KeyValue, StoreError> {
    Ok(KeyValue {
        key: key.to_string(),
        create_revision: read_i64(b, 0)?,
        mod_revision: read_i64(b, 8)?,
        version: read_i64(b, 16)?,
        lease: read_i64(b, 24)?,
        value: b
            .get(HEADER..)
            .ok_or_else(|| StoreError::Corrupt("truncated record".into()))?
            .to_vec(),
    })
}

pub(super) fn encode_events(events: &[WatchEvent]) -> Vec<u8> {
    let mut out = Vec::new();
    for ev in events {
        out.push(match ev.kind {
            EventKind::Put => 0u8,
            EventKind::Delete => 1u8,
        });
        let rec = encode_kv(&ev.kv);
        out.extend_from_slice(&(ev.kv.key.len() as u32).to_le_bytes());
        out.extend_from_slice(ev.kv.key.as_bytes());
        out.extend_from_slice(&(rec.len() as u32).to_le_bytes());
        out.extend_from_slice(&rec);
    }
    out
}

pub(super) fn decode_events(mut b: &[u8]) -> Result<Vec<WatchEvent>, StoreError> {
    let corrupt = || StoreError::Corrupt("truncated change log entry".into());
    let mut out = Vec::new();
    while !b.is_empty() {
        let kind = match b[0] {
            0 => EventKind::Put,
            1 => EventKind::Delete,
            k => return Err(StoreError::Corrupt(format!("unknown event kind {k}"))),
        };
        b = &b[1..];
        let take = |b: &mut &[u8]| -> Result<Vec<u8>, StoreError> {
            let n = u32::from_le_bytes(b.get(..4).ok_or_else(corrupt)?.try_into().unwrap()) as usize;
            let v = b.get(4..4 + n).ok_or_else(corrupt)?.to_vec();
            *b = &b[4 + n..];
            Ok(v)
        };
        let key = String::from_utf8(take(&mut b)?).map_err(|_| corrupt())?;
        let rec = take(&mut b)?;
        out.push(WatchEvent {
            kind,
            kv: decode_kv(&key, &rec)?,
        });
    }
    Ok(out)
}
