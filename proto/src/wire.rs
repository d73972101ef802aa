//! Messages as a controller sends them: the same bytes as the `weft.v1`
//! messages, assembled from parts encoded once.
//!
//! A change that every node of a site receives (a new peering's routes, a
//! peer's names) is the same objects for every node. The controller
//! renders and encodes those objects once ([`Encoded`]) and every node's
//! stream sends the same bytes, held by reference count; only what is the
//! agent's own (its link, its address) is encoded per agent. The servers
//! are generated with [`WatchResponse`] in place of
//! `weft.v1.WatchResponse`; clients decode the plain message, which these
//! bytes are exactly.

use bytes::{Buf, BufMut, Bytes};
use prost::encoding::{DecodeContext, WireType, encode_key, encode_varint, encoded_len_varint, key_len};

use crate::v1;

/// One `weft.v1.DesiredObject`, encoded, with its content hash
/// ([`crate::object_hash`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    bytes: Bytes,
    hash: u64,
}

impl Encoded {
    pub fn new(o: &v1::DesiredObject) -> Encoded {
        let bytes = Bytes::from(prost::Message::encode_to_vec(o));
        let hash = crate::hash_encoded(&bytes);
        Encoded { bytes, hash }
    }

    /// The content hash agents send back on resume.
    pub fn hash(&self) -> u64 {
        self.hash
    }

    /// The encoded object.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Its length as a field of tag `tag`, key and length included.
    fn field_len(&self, tag: u32) -> usize {
        key_len(tag) + encoded_len_varint(self.bytes.len() as u64) + self.bytes.len()
    }

    fn encode_field(&self, tag: u32, buf: &mut impl BufMut) {
        encode_key(tag, WireType::LengthDelimited, buf);
        encode_varint(self.bytes.len() as u64, buf);
        buf.put_slice(&self.bytes);
    }
}

/// `weft.v1.WatchResponse` on the sending side: a message, or a snapshot
/// or delta assembled from encoded objects. Encodes to exactly what the
/// equivalent [`v1::WatchResponse`] encodes to.
#[derive(Debug, Clone, PartialEq)]
pub enum WatchResponse {
    Message(v1::WatchResponse),
    Snapshot {
        revision: i64,
        objects: Vec<Encoded>,
    },
    Delta {
        revision: i64,
        upserts: Vec<Encoded>,
        deletes: Vec<String>,
    },
}

impl Default for WatchResponse {
    fn default() -> Self {
        WatchResponse::Message(v1::WatchResponse::default())
    }
}

impl From<v1::WatchResponse> for WatchResponse {
    fn from(m: v1::WatchResponse) -> Self {
        WatchResponse::Message(m)
    }
}

/// `weft.v1.WatchResponse`'s field numbers.
const REVISION: u32 = 1;
const SNAPSHOT: u32 = 2;
const DELTA: u32 = 3;
/// `Snapshot.objects`, `Delta.upserts` and `Delta.deletes`.
const OBJECTS: u32 = 1;
const UPSERTS: u32 = 1;
const DELETES: u32 = 2;

impl WatchResponse {
    /// The length of the embedded Snapshot or Delta message (without its
    /// key and length).
    fn body_len(&self) -> usize {
        match self {
            WatchResponse::Message(_) => 0,
            WatchResponse::Snapshot { objects, .. } => objects.iter().map(|o| o.field_len(OBJECTS)).sum(),
            WatchResponse::Delta { upserts, deletes, .. } => {
                upserts.iter().map(|o| o.field_len(UPSERTS)).sum::<usize>()
                    + prost::encoding::string::encoded_len_repeated(DELETES, deletes)
            }
        }
    }

    fn revision_len(revision: i64) -> usize {
        if revision == 0 {
            0
        } else {
            prost::encoding::int64::encoded_len(REVISION, &revision)
        }
    }
}

impl prost::Message for WatchResponse {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        let (revision, tag) = match self {
            WatchResponse::Message(m) => return m.encode_raw(buf),
            WatchResponse::Snapshot { revision, .. } => (*revision, SNAPSHOT),
            WatchResponse::Delta { revision, .. } => (*revision, DELTA),
        };
        if revision != 0 {
            prost::encoding::int64::encode(REVISION, &revision, buf);
        }
        encode_key(tag, WireType::LengthDelimited, buf);
        encode_varint(self.body_len() as u64, buf);
        match self {
            WatchResponse::Message(_) => {}
            WatchResponse::Snapshot { objects, .. } => objects.iter().for_each(|o| o.encode_field(OBJECTS, buf)),
            WatchResponse::Delta { upserts, deletes, .. } => {
                upserts.iter().for_each(|o| o.encode_field(UPSERTS, buf));
                prost::encoding::string::encode_repeated(DELETES, deletes, buf);
            }
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        // Decoding (never done by a server) goes through the plain message.
        if !matches!(self, WatchResponse::Message(_)) {
            let bytes = prost::Message::encode_to_vec(self);
            *self = WatchResponse::Message(prost::Message::decode(bytes.as_slice())?);
        }
        match self {
            WatchResponse::Message(m) => m.merge_field(tag, wire_type, buf, ctx),
            _ => unreachable!("made a plain message above"),
        }
    }

    fn encoded_len(&self) -> usize {
        let (revision, tag) = match self {
            WatchResponse::Message(m) => return m.encoded_len(),
            WatchResponse::Snapshot { revision, .. } => (*revision, SNAPSHOT),
            WatchResponse::Delta { revision, .. } => (*revision, DELTA),
        };
        let body = self.body_len();
        Self::revision_len(revision) + key_len(tag) + encoded_len_varint(body as u64) + body
    }

    fn clear(&mut self) {
        *self = WatchResponse::default();
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::v1::watch_response::Kind;

    fn object(id: &str, destination: &str) -> v1::DesiredObject {
        v1::DesiredObject {
            id: id.into(),
            kind: Some(v1::desired_object::Kind::Route(v1::Route {
                namespace: String::new(),
                table: 7765,
                destination: destination.into(),
                gateway: "10.80.0.1".into(),
                device: "weft0".into(),
                peer_site: String::new(),
            })),
        }
    }

    /// Every shape encodes to the plain message's bytes, decodes as it,
    /// and says its length right.
    #[test]
    fn assembled_messages_are_the_plain_messages_bytes() {
        // Long enough that lengths take two varint bytes.
        let objects: Vec<_> = (0..40)
            .map(|i| object(&format!("peer/b/{i}/route"), "10.0.0.0/16"))
            .collect();
        let deletes = vec!["peer/c/workload/route".to_string(), String::new()];
        for revision in [0, 1, 300, i64::MAX, -5] {
            for n in [0, 1, 40] {
                let plain = v1::WatchResponse {
                    revision,
                    kind: Some(Kind::Snapshot(v1::Snapshot {
                        objects: objects[..n].to_vec(),
                    })),
                };
                let wire = WatchResponse::Snapshot {
                    revision,
                    objects: objects[..n].iter().map(Encoded::new).collect(),
                };
                assert_eq!(
                    wire.encode_to_vec(),
                    plain.encode_to_vec(),
                    "snapshot of {n} at {revision}"
                );
                assert_eq!(wire.encoded_len(), plain.encoded_len());
                for d in [0, 2] {
                    let plain = v1::WatchResponse {
                        revision,
                        kind: Some(Kind::Delta(v1::Delta {
                            upserts: objects[..n].to_vec(),
                            deletes: deletes[..d].to_vec(),
                        })),
                    };
                    let wire = WatchResponse::Delta {
                        revision,
                        upserts: objects[..n].iter().map(Encoded::new).collect(),
                        deletes: deletes[..d].to_vec(),
                    };
                    let bytes = wire.encode_to_vec();
                    assert_eq!(bytes, plain.encode_to_vec(), "delta of {n}, {d} at {revision}");
                    assert_eq!(wire.encoded_len(), bytes.len());
                    assert_eq!(v1::WatchResponse::decode(bytes.as_slice()).unwrap(), plain);
                    // And one decoded into the sending type is the plain message.
                    assert_eq!(
                        WatchResponse::decode(bytes.as_slice()).unwrap(),
                        WatchResponse::Message(plain)
                    );
                }
            }
        }
        let plain = v1::WatchResponse::default();
        assert_eq!(
            WatchResponse::from(plain.clone()).encode_to_vec(),
            plain.encode_to_vec()
        );
    }

    #[test]
    fn an_encoded_objects_hash_is_the_object_hash() {
        let o = object("self/route/internal", "10.80.0.0/16");
        let e = Encoded::new(&o);
        assert_eq!(e.hash(), crate::object_hash(&o));
        assert_eq!(e.bytes(), o.encode_to_vec().as_slice());
    }
}
