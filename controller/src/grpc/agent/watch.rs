//! An agent's Watch stream after it opened: its first message and the
//! deltas that follow.
//!
//! A node's state is its own part, rendered and encoded per stream, and
//! the part every node shares, rendered and encoded once per model
//! ([`crate::hub::SharedCache`]): a change for all sends every node the
//! same bytes. A gateway's state is re-rendered part by part.

use std::sync::Arc;

use tonic::Status;
use weft_proto::v1 as pb;
use weft_proto::wire::{self, Encoded};

use crate::auth::removed;
use crate::domain::AgentRole;
use crate::hub::{Hub, Shared, Slot};
use crate::render::{self, Model, Objects};

/// What a watch stream's task hands to its response body. Boxed: a
/// channel's first block holds 32 slots whatever its capacity, and a slot
/// of the message itself cost every connected agent about 2 KiB.
pub(super) type Item = Box<Result<wire::WatchResponse, Status>>;
pub(super) type Sender = tokio::sync::mpsc::Sender<Item>;

/// The watch response body: the task's messages, unboxed.
pub(crate) type Stream = tokio_stream::adapters::Map<
    tokio_stream::wrappers::ReceiverStream<Item>,
    fn(Item) -> Result<wire::WatchResponse, Status>,
>;

/// An error that ends a watch stream, as its task sends it.
fn fail(s: Status) -> Item {
    Box::new(Err(s))
}

/// The response body of a watch whose task sends on the returned sender.
pub(super) fn stream() -> (Sender, Stream) {
    let (tx, rx) = tokio::sync::mpsc::channel(super::WATCH_BUFFER);
    let unbox: fn(Item) -> Result<wire::WatchResponse, Status> = |m| *m;
    (
        tx,
        tokio_stream::StreamExt::map(tokio_stream::wrappers::ReceiverStream::new(rx), unbox),
    )
}

/// What a stream has sent its agent.
pub(super) enum Held {
    /// A gateway's objects.
    Gateway(Objects),
    /// A node's own objects, and the version of the shared part it has.
    Node { own: Objects, shared: Arc<Shared> },
}

impl Held {
    /// Everything `name` must have in `model`.
    pub(super) fn render(hub: &Hub, model: &Arc<Model>, role: AgentRole, name: &str) -> Held {
        match role {
            AgentRole::Gateway => Held::Gateway(render::gateway(model, name)),
            AgentRole::Node => match render::node_own(model, name) {
                Some(own) => Held::Node {
                    own,
                    shared: hub.node_shared.of(model),
                },
                None => Held::Node {
                    own: Objects::new(),
                    shared: Arc::default(),
                },
            },
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Held::Gateway(o) => o.len(),
            Held::Node { own, shared } => own.len() + shared.objects.len(),
        }
    }

    fn contains(&self, id: &str) -> bool {
        match self {
            Held::Gateway(o) => o.contains_key(id),
            Held::Node { own, shared } => own.contains_key(id) || shared.objects.contains_key(id),
        }
    }

    /// Every object by id, encoded (the shared ones as they already are).
    fn encoded(&self) -> Vec<(&str, Encoded)> {
        match self {
            Held::Gateway(o) => o.iter().map(|(id, o)| (id.as_str(), Encoded::new(o))).collect(),
            Held::Node { own, shared } => own
                .iter()
                .map(|(id, o)| (id.as_str(), Encoded::new(o)))
                .chain(shared.objects.iter().map(|(id, e)| (id.as_str(), e.clone())))
                .collect(),
        }
    }
}

/// The first message of a stream: the difference from what the agent says
/// it holds, or a snapshot when it holds nothing or the difference would
/// be no smaller.
pub(super) fn first_message(held: &Held, revision: i64, last: i64, known: &[pb::ObjectVersion]) -> wire::WatchResponse {
    let objects = held.encoded();
    // The known hashes say exactly what the agent holds, whatever its
    // revision: one past this store's (a store restored from a backup, a
    // new etcd) still gets the difference, not a snapshot.
    if last > 0 {
        let by_id: std::collections::HashMap<&str, u64> = known.iter().map(|k| (k.id.as_str(), k.hash)).collect();
        let upserts: Vec<Encoded> = objects
            .iter()
            .filter(|(id, o)| by_id.get(id) != Some(&o.hash()))
            .map(|(_, o)| o.clone())
            .collect();
        let deletes: Vec<String> = known
            .iter()
            .filter(|k| !held.contains(&k.id))
            .map(|k| k.id.clone())
            .collect();
        if objects.is_empty() || upserts.len() < objects.len() {
            return wire::WatchResponse::Delta {
                revision,
                upserts,
                deletes,
            };
        }
    }
    wire::WatchResponse::Snapshot {
        revision,
        objects: objects.into_iter().map(|(_, o)| o).collect(),
    }
}

/// Sends a delta whenever the hub marks this stream, coalescing whatever
/// accumulated while the agent was slow.
pub(super) async fn stream_changes(
    hub: Arc<Hub>,
    key: crate::hub::AgentKey,
    slot: Arc<Slot>,
    mut current: Held,
    tx: Sender,
    expires: std::time::SystemTime,
) {
    use std::sync::atomic::Ordering;
    let expiry = tokio::time::sleep(expires.duration_since(std::time::SystemTime::now()).unwrap_or_default());
    tokio::pin!(expiry);
    let mut expired = false;
    loop {
        tokio::select! {
            _ = slot.notify.notified() => {}
            _ = tx.closed() => break,
            _ = &mut expiry => {
                // UNAVAILABLE, not UNAUTHENTICATED: the agent is not refused,
                // it reconnects with its renewed certificate.
                let _ = tx
                    .send(fail(Status::unavailable(
                        "the certificate this stream was opened with has expired; reconnect with the current one",
                    )))
                    .await;
                expired = true;
                break;
            }
        }
        if slot.superseded.load(Ordering::SeqCst) {
            break;
        }
        let pending = slot.take();
        if pending.revoked {
            let _ = tx
                .send(fail(Status::unauthenticated(format!(
                    "every certificate of {} {:?} was revoked: two hosts hold its identity. The admin must enroll \
                     the real host again with a new token",
                    key.0.as_str(),
                    key.1
                ))))
                .await;
            break;
        }
        if pending.removed {
            let _ = tx
                .send(fail(removed(format!(
                    "{} {:?} has been removed; enroll it again with a new token",
                    key.0.as_str(),
                    key.1
                ))))
                .await;
            break;
        }
        let model = hub.model();
        let Some(msg) = next_delta(&hub, &model, &key, &pending, &mut current) else {
            slot.done();
            continue;
        };
        if !Box::pin(send(&hub, &slot, &tx, msg)).await {
            break;
        }
        slot.latest.store(model.revision, Ordering::SeqCst);
        slot.done();
        hub.sent(&key, model.revision);
    }
    hub.unsubscribe(&key, &slot);
    // A gateway whose stream ended for its certificate's age is about to
    // reconnect: it is not gone (if it never comes back, its lease ends).
    if key.0 == AgentRole::Gateway && !expired && !slot.superseded.load(Ordering::SeqCst) && !*hub.closing.borrow() {
        // Boxed: this task lives as long as the stream and is sized for its
        // largest await, which would otherwise be this rare one's.
        Box::pin(hub.gone(&key)).await;
    }
}

/// Hands `msg` to the stream's body; false when the stream is to end (its
/// reader went, the controller shuts down, or a newer stream replaced it).
/// A reader that stopped reading must not hold up a shutdown or its
/// replacement stream. Boxed where it is awaited: the task lives as long as
/// the stream and is sized for its largest await, which this was.
async fn send(hub: &Hub, slot: &Slot, tx: &Sender, msg: wire::WatchResponse) -> bool {
    use std::sync::atomic::Ordering;
    let mut closing = hub.closing.subscribe();
    let mut item = Some(Box::new(Ok(msg)));
    loop {
        let permit = tokio::select! {
            p = tx.reserve() => p,
            _ = async { let _ = closing.wait_for(|c| *c).await; } => return false,
            _ = slot.notify.notified() => {
                if slot.superseded.load(Ordering::SeqCst) {
                    return false;
                }
                // Not for us to act on now: keep the wake-up for later.
                slot.notify.notify_one();
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        return match (permit, item.take()) {
            (Ok(p), Some(m)) => {
                p.send(m);
                true
            }
            _ => false,
        };
    }
}

/// The delta that brings `current` to `model` (None: nothing changed), and
/// `current` moved there.
fn next_delta(
    hub: &Hub,
    model: &Arc<Model>,
    key: &crate::hub::AgentKey,
    pending: &crate::hub::Pending,
    current: &mut Held,
) -> Option<wire::WatchResponse> {
    let revision = model.revision;
    let msg = match current {
        Held::Node { own, shared } => {
            let Held::Node {
                own: new_own,
                shared: new_shared,
            } = Held::render(hub, model, key.0, &key.1)
            else {
                unreachable!("a node's state renders as a node's");
            };
            let (upserts, mut deletes) = render::diff(own, &new_own);
            let mut upserts: Vec<Encoded> = upserts.iter().map(Encoded::new).collect();
            if !shared.same(&new_shared) {
                let step = hub.node_shared.step(shared, &new_shared);
                upserts.extend(step.upserts.iter().cloned());
                deletes.extend(step.deletes.iter().cloned());
            }
            *own = new_own;
            *shared = new_shared;
            if upserts.is_empty() && deletes.is_empty() {
                return None;
            }
            wire::WatchResponse::Delta {
                revision,
                upserts,
                deletes,
            }
        }
        Held::Gateway(current) => {
            let (upserts, deletes) = if pending.full {
                let new = render::gateway(model, &key.1);
                let d = render::diff(current, &new);
                *current = new;
                d
            } else {
                // Re-render only the parts that changed; diff them alone.
                let mut old_parts = Objects::new();
                let mut new_parts = Objects::new();
                for part in &pending.parts {
                    let prefix = part.prefix();
                    let ids: Vec<String> = current
                        .range(prefix.clone()..)
                        .take_while(|(k, _)| k.starts_with(&prefix))
                        .map(|(k, _)| k.clone())
                        .collect();
                    for id in ids {
                        if let Some(o) = current.remove(&id) {
                            old_parts.insert(id, o);
                        }
                    }
                    if let Some(g) = model.gateways.get(&key.1) {
                        new_parts.extend(render::gateway_part(model, g, part));
                    }
                }
                let d = render::diff(&old_parts, &new_parts);
                current.extend(new_parts);
                d
            };
            if upserts.is_empty() && deletes.is_empty() {
                return None;
            }
            wire::WatchResponse::Message(pb::WatchResponse {
                revision,
                kind: Some(pb::watch_response::Kind::Delta(pb::Delta { upserts, deletes })),
            })
        }
    };
    Some(msg)
}
