//! The part of node state that every node shares, rendered and encoded once
//! per model ([`crate::render::node_shared`]: routes, rules and names of
//! the peers' views), and the step from one version of it to the next.
//!
//! A change for all (a new peering, a peer's names, a gateway failover)
//! wakes every node's stream at once. The first stream to ask renders and
//! encodes the shared part for the model it sees; every other stream gets
//! the same [`Shared`], and the same [`Step`] from the version it sent
//! before, and sends the same bytes ([`weft_proto::wire`]). What is the
//! node's own is still rendered per stream.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};

use weft_proto::wire::Encoded;

use crate::render::{self, Model};

/// One version of the shared part: its objects by id, encoded.
#[derive(Debug, Default)]
pub struct Shared {
    /// Distinct per content: two models that render the same shared part
    /// give the same `Shared` (and no step between them).
    version: u64,
    pub objects: BTreeMap<String, Encoded>,
}

/// What turns one version of the shared part into another.
#[derive(Debug, Default)]
pub struct Step {
    pub upserts: Vec<Encoded>,
    pub deletes: Vec<String>,
}

/// Steps kept: streams that fell behind by more than this many versions
/// compute theirs (the same result, not shared).
const STEPS_KEPT: usize = 8;

#[derive(Default)]
pub struct SharedCache {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// The model `latest` was rendered from (held weakly: its allocation,
    /// and so its address, stays while this points at it).
    model: Weak<Model>,
    latest: Arc<Shared>,
    versions: u64,
    steps: VecDeque<(u64, u64, Arc<Step>)>,
}

impl SharedCache {
    /// The shared part of `model`'s node state.
    pub fn of(&self, model: &Arc<Model>) -> Arc<Shared> {
        self.rendered_by(model, render::node_shared)
    }

    fn rendered_by(&self, model: &Arc<Model>, render: impl FnOnce(&Model) -> render::Objects) -> Arc<Shared> {
        let mut inner = self.inner.lock().unwrap();
        if std::ptr::eq(inner.model.as_ptr(), Arc::as_ptr(model)) {
            return inner.latest.clone();
        }
        inner.model = Arc::downgrade(model);
        let objects: BTreeMap<String, Encoded> = render(model)
            .into_iter()
            .map(|(id, o)| (id, Encoded::new(&o)))
            .collect();
        if objects != inner.latest.objects {
            inner.versions += 1;
            inner.latest = Arc::new(Shared {
                version: inner.versions,
                objects,
            });
        }
        inner.latest.clone()
    }

    /// What turns `old` into `new`.
    pub fn step(&self, old: &Shared, new: &Shared) -> Arc<Step> {
        let key = (old.version, new.version);
        let mut inner = self.inner.lock().unwrap();
        if let Some((.., s)) = inner.steps.iter().find(|(o, n, _)| (*o, *n) == key) {
            return s.clone();
        }
        let step = Arc::new(Step {
            upserts: new
                .objects
                .iter()
                .filter(|(id, o)| old.objects.get(*id) != Some(o))
                .map(|(_, o)| o.clone())
                .collect(),
            deletes: old
                .objects
                .keys()
                .filter(|id| !new.objects.contains_key(*id))
                .cloned()
                .collect(),
        });
        if inner.steps.len() == STEPS_KEPT {
            inner.steps.pop_front();
        }
        inner.steps.push_back((key.0, key.1, step.clone()));
        step
    }
}

impl Shared {
    /// The same content as `other` (so no step between them).
    pub fn same(&self, other: &Shared) -> bool {
        self.version == other.version
    }
}

#[cfg(test)]
mod tests {
    use weft_proto::v1 as pb;

    use super::*;

    fn objects(routes: &[(&str, &str)]) -> render::Objects {
        routes
            .iter()
            .map(|(id, dst)| {
                let o = pb::DesiredObject {
                    id: id.to_string(),
                    kind: Some(pb::desired_object::Kind::Route(pb::Route {
                        destination: dst.to_string(),
                        ..Default::default()
                    })),
                };
                (id.to_string(), o)
            })
            .collect()
    }

    #[test]
    fn one_render_per_model_one_version_per_content_one_step_per_pair() {
        let cache = SharedCache::default();
        let empty = Arc::new(Shared::default());
        let (m1, m2, m3) = (
            Arc::new(Model::default()),
            Arc::new(Model::default()),
            Arc::new(Model::default()),
        );
        let a = objects(&[
            ("peer/b/workload/route", "10.0.0.0/16"),
            ("peer/b/external/route", "10.9.0.0/24"),
        ]);
        let s1 = cache.rendered_by(&m1, |_| a.clone());
        // The same model is not rendered again.
        let again = cache.rendered_by(&m1, |_| panic!("rendered twice for one model"));
        assert!(Arc::ptr_eq(&s1, &again));
        // Another model with the same shared part: the same version.
        let s2 = cache.rendered_by(&m2, |_| a.clone());
        assert!(Arc::ptr_eq(&s1, &s2) && s1.same(&s2));
        // A change: one route moved, one gone, one new.
        let b = objects(&[
            ("peer/b/workload/route", "10.1.0.0/16"),
            ("peer/c/workload/route", "10.2.0.0/16"),
        ]);
        let s3 = cache.rendered_by(&m3, |_| b.clone());
        assert!(!s3.same(&s1));
        let step = cache.step(&s1, &s3);
        let ids: Vec<_> = step.upserts.iter().map(|e| e.bytes().to_vec()).collect();
        let want: Vec<_> = [&b["peer/b/workload/route"], &b["peer/c/workload/route"]]
            .iter()
            .map(|o| Encoded::new(o).bytes().to_vec())
            .collect();
        assert_eq!(ids, want);
        assert_eq!(step.deletes, ["peer/b/external/route"]);
        // Every stream that makes the same step gets the same one.
        assert!(Arc::ptr_eq(&step, &cache.step(&s1, &s3)));
        // From nothing (a node that had nothing yet): everything.
        let from_empty = cache.step(&empty, &s3);
        assert_eq!((from_empty.upserts.len(), from_empty.deletes.len()), (2, 0));
    }
}
