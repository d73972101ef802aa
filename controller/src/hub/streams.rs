//! The connected agents' streams: one slot each, where the hub marks the
//! work a change makes for it and the stream's task takes it. The hub
//! never sends itself and never waits for a stream; a slow agent gets its
//! changes coalesced into one delta. One lock: the map of slots (each
//! slot guards its own pending work).

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use super::AgentKey;
use super::index::Mark;
use crate::domain::AgentRole;
use crate::render::Part;

/// Work waiting for one stream.
#[derive(Debug, Default)]
pub struct Pending {
    pub full: bool,
    pub parts: BTreeSet<Part>,
    /// The agent's record was deleted: end the stream.
    pub removed: bool,
    /// Every certificate of the agent was revoked (two holders of its
    /// identity): end the stream, without telling it it was removed.
    pub revoked: bool,
}

/// One connected stream.
#[derive(Debug, Default)]
pub struct Slot {
    pending: Mutex<Pending>,
    pub notify: Notify,
    /// Revision of the last state sent on this stream.
    pub latest: AtomicI64,
    /// A newer stream of the same agent replaced this one.
    pub superseded: AtomicBool,
    /// Between [`Slot::take`] and [`Slot::done`].
    busy: AtomicBool,
}

impl Pending {
    fn is_empty(&self) -> bool {
        !self.full && self.parts.is_empty() && !self.removed && !self.revoked
    }
}

impl Slot {
    /// The work waiting; the stream is busy with it until [`Slot::done`].
    pub fn take(&self) -> Pending {
        let mut p = self.pending.lock().unwrap();
        self.busy.store(true, Ordering::SeqCst);
        std::mem::take(&mut *p)
    }

    /// What [`Slot::take`] gave was rendered (and sent, `latest` updated)
    /// or found to change nothing.
    pub fn done(&self) {
        self.busy.store(false, Ordering::SeqCst);
    }

    /// Whether an agent that applied `applied` holds everything rendered
    /// for it: nothing waiting, nothing being rendered, its latest state
    /// applied.
    pub(super) fn current(&self, applied: i64) -> bool {
        let p = self.pending.lock().unwrap();
        p.is_empty() && !self.busy.load(Ordering::SeqCst) && applied >= self.latest.load(Ordering::SeqCst)
    }

    fn mark(&self, f: impl FnOnce(&mut Pending)) {
        f(&mut self.pending.lock().unwrap());
        self.notify.notify_one();
    }
}

/// The slots of the streams connected to this replica.
#[derive(Debug, Default)]
pub(super) struct Streams {
    slots: Mutex<HashMap<AgentKey, Arc<Slot>>>,
}

impl Streams {
    /// Registers a stream for `key`, replacing (and ending) an older one.
    pub(super) fn subscribe(&self, key: AgentKey) -> Arc<Slot> {
        let slot = Arc::new(Slot::default());
        if let Some(old) = self.slots.lock().unwrap().insert(key, slot.clone()) {
            old.superseded.store(true, Ordering::SeqCst);
            old.notify.notify_one();
        }
        slot
    }

    pub(super) fn unsubscribe(&self, key: &AgentKey, slot: &Arc<Slot>) {
        let mut slots = self.slots.lock().unwrap();
        if slots.get(key).is_some_and(|s| Arc::ptr_eq(s, slot)) {
            slots.remove(key);
        }
    }

    /// The revision of the last state sent to `key`, if it is connected.
    pub(super) fn latest(&self, key: &AgentKey) -> Option<i64> {
        self.slots
            .lock()
            .unwrap()
            .get(key)
            .map(|s| s.latest.load(Ordering::SeqCst))
    }

    /// Ends every stream.
    pub(super) fn end_all(&self) {
        for s in self.slots.lock().unwrap().values() {
            s.superseded.store(true, Ordering::SeqCst);
            s.notify.notify_one();
        }
    }

    pub(super) fn len(&self) -> usize {
        self.slots.lock().unwrap().len()
    }

    /// The agents connected.
    pub(super) fn keys(&self) -> Vec<AgentKey> {
        self.slots.lock().unwrap().keys().cloned().collect()
    }

    /// The agents connected, with their slots.
    pub(super) fn all(&self) -> Vec<(AgentKey, Arc<Slot>)> {
        self.slots
            .lock()
            .unwrap()
            .iter()
            .map(|(k, s)| (k.clone(), s.clone()))
            .collect()
    }

    /// Per connected stream: its agent and how many updates wait for it (a
    /// pending full render counts as one, plus each pending part).
    pub(super) fn backlog(&self) -> Vec<(AgentKey, usize)> {
        self.slots
            .lock()
            .unwrap()
            .iter()
            .map(|(key, s)| {
                let p = s.pending.lock().unwrap();
                (key.clone(), usize::from(p.full) + p.parts.len())
            })
            .collect()
    }

    /// Marks the streams `mark` concerns.
    pub(super) fn mark(&self, mark: Mark) {
        let slots = self.slots.lock().unwrap();
        let each = |role: AgentRole, f: &dyn Fn(&Slot)| {
            for ((r, _), s) in slots.iter() {
                if *r == role {
                    f(s);
                }
            }
        };
        match mark {
            Mark::Nothing => {}
            Mark::Revoked(key) => {
                if let Some(s) = slots.get(&key) {
                    s.mark(|p| p.revoked = true);
                }
            }
            Mark::Everyone => {
                for s in slots.values() {
                    s.mark(|p| p.full = true);
                }
            }
            Mark::Node { name, removed, sharing } => {
                if let Some(s) = slots.get(&(AgentRole::Node, name.clone())) {
                    s.mark(|p| if removed { p.removed = true } else { p.full = true });
                }
                for other in &sharing {
                    if let Some(s) = slots.get(&(AgentRole::Node, other.clone())) {
                        s.mark(|p| p.full = true);
                    }
                }
                each(AgentRole::Gateway, &|s| {
                    s.mark(|p| {
                        p.parts.insert(Part::Node(name.clone()));
                        p.parts.extend(sharing.iter().cloned().map(Part::Node));
                    })
                });
            }
            Mark::Gateway { name, removed } => {
                if let Some(s) = slots.get(&(AgentRole::Gateway, name)) {
                    s.mark(|p| if removed { p.removed = true } else { p.full = true });
                }
                each(AgentRole::Node, &|s| s.mark(|p| p.full = true));
            }
            Mark::Names => each(AgentRole::Gateway, &|s| s.mark(|p| p.full = true)),
            Mark::Peering(name, sharing) => {
                each(AgentRole::Node, &|s| s.mark(|p| p.full = true));
                each(AgentRole::Gateway, &|s| {
                    s.mark(|p| {
                        p.parts.insert(Part::Peer(name.clone()));
                        p.parts.extend(sharing.iter().cloned().map(Part::Peer));
                    })
                });
            }
        }
    }
}
