//! One conformance suite for every store backend: the embedded redb store
//! and the real etcd server (started on a free loopback port). The controller
//! relies on exactly these behaviours; a backend that differs breaks it.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use weft_controller::store::embedded::EmbeddedStore;
use weft_controller::store::etcd::EtcdStore;
use weft_controller::store::{Compare, EventKind, Op, Store, StoreError, Txn, WatchBatch, WatchStream};
use weft_tests::Etcd;

enum Guard {
    Embedded(#[allow(dead_code)] tempfile::TempDir),
    Etcd(#[allow(dead_code)] Etcd),
}

async fn embedded() -> (Arc<dyn Store>, Guard) {
    let dir = tempfile::tempdir().unwrap();
    let s = EmbeddedStore::open(&dir.path().join("store.redb")).unwrap();
    (Arc::new(s), Guard::Embedded(dir))
}

async fn etcd() -> Option<(Arc<dyn Store>, Guard)> {
    let e = Etcd::start()?;
    let s = EtcdStore::connect(&[e.endpoint()], None).await.unwrap();
    Some((Arc::new(s), Guard::Etcd(e)))
}

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod embedded_backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let (s, _g) = super::embedded().await;
                    super::$case(s).await;
                }
            )*
        }
        mod etcd_backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let Some((s, _g)) = super::etcd().await else { return };
                    super::$case(s).await;
                }
            )*
        }
    };
}

conformance!(
    put_get_track_revisions_and_versions,
    prefix_reads_are_scoped_and_sorted,
    txn_is_all_or_nothing,
    compares_cover_absence_revision_and_value,
    concurrent_compare_and_swap_loses_no_update,
    watch_replays_history_then_follows_live,
    watch_is_scoped_and_reports_deletes,
    watch_from_compacted_revision_fails,
    leases_expire_renew_and_revoke,
    a_delete_conditioned_on_a_lease_spares_another_holders_record,
    a_prefix_read_larger_than_a_grpc_message_is_whole,
);

/// 2,600 values of 2 KiB: over the 4 MiB one gRPC answer may carry (a
/// 10,000-node site on etcd hit it), read whole, in order, at one revision.
async fn a_prefix_read_larger_than_a_grpc_message_is_whole(s: Arc<dyn Store>) {
    let value = vec![b'x'; 2048];
    for chunk in 0..26 {
        let mut txn = Txn::new();
        for i in 0..100 {
            txn = txn.then(Op::put(format!("/big/{:05}", chunk * 100 + i), value.clone()));
        }
        s.txn(txn).await.unwrap();
    }
    s.put("/bigger", b"outside".to_vec()).await.unwrap();
    let r = s.get_prefix("/big/").await.unwrap();
    assert_eq!(r.kvs.len(), 2600);
    assert!(r.kvs.windows(2).all(|w| w[0].key < w[1].key), "not in key order");
    assert!(r.kvs.iter().all(|kv| kv.value.len() == 2048));
    assert_eq!(r.revision, s.revision().await.unwrap());
}

async fn next_batch(w: &mut WatchStream) -> WatchBatch {
    tokio::time::timeout(Duration::from_secs(5), w.next())
        .await
        .expect("no watch event within 5 s")
        .expect("watch ended")
        .expect("watch failed")
}

async fn put_get_track_revisions_and_versions(s: Arc<dyn Store>) {
    let r0 = s.revision().await.unwrap();
    let r1 = s.put("/c/a", b"1".to_vec()).await.unwrap();
    assert_eq!(r1, r0 + 1, "every write advances the revision by one");
    let r2 = s.put("/c/a", b"2".to_vec()).await.unwrap();
    let kv = s.get("/c/a").await.unwrap().unwrap();
    assert_eq!(kv.value, b"2");
    assert_eq!((kv.create_revision, kv.mod_revision, kv.version), (r1, r2, 2));
    assert_eq!(s.revision().await.unwrap(), r2);
    let r3 = s.delete("/c/a").await.unwrap();
    assert_eq!(r3, r2 + 1);
    assert_eq!(s.get("/c/a").await.unwrap(), None);
    // deleting what is absent changes nothing
    assert_eq!(s.delete("/c/a").await.unwrap(), r3);
    let r4 = s.put("/c/a", b"3".to_vec()).await.unwrap();
    let kv = s.get("/c/a").await.unwrap().unwrap();
    assert_eq!(
        (kv.create_revision, kv.version),
        (r4, 1),
        "a re-created key starts over"
    );
}

async fn prefix_reads_are_scoped_and_sorted(s: Arc<dyn Store>) {
    for k in ["/p/b", "/p/a", "/p/c/d", "/pz", "/o"] {
        s.put(k, k.as_bytes().to_vec()).await.unwrap();
    }
    let r = s.get_prefix("/p/").await.unwrap();
    let keys: Vec<&str> = r.kvs.iter().map(|kv| kv.key.as_str()).collect();
    assert_eq!(keys, ["/p/a", "/p/b", "/p/c/d"]);
    assert_eq!(r.revision, s.revision().await.unwrap());
    assert!(s.get_prefix("/nothing/").await.unwrap().kvs.is_empty());
    let rev = s
        .txn(Txn::new().then(Op::DeletePrefix { prefix: "/p/".into() }))
        .await
        .unwrap()
        .revision;
    assert!(s.get_prefix("/p/").await.unwrap().kvs.is_empty());
    assert!(s.get("/pz").await.unwrap().is_some());
    let batch_rev = s.get_prefix("/").await.unwrap().revision;
    assert_eq!(rev, batch_rev, "a prefix delete is one revision");
}

async fn txn_is_all_or_nothing(s: Arc<dyn Store>) {
    s.put("/t/x", b"1".to_vec()).await.unwrap();
    let before = s.revision().await.unwrap();
    let failing = Txn::new()
        .when(Compare::Value("/t/x".into(), b"1".to_vec()))
        .when(Compare::Version("/t/y".into(), 5))
        .then(Op::put("/t/x", b"changed".to_vec()))
        .then(Op::put("/t/z", b"new".to_vec()));
    let r = s.txn(failing).await.unwrap();
    assert!(!r.succeeded);
    assert_eq!(r.revision, before);
    assert_eq!(s.get("/t/x").await.unwrap().unwrap().value, b"1");
    assert_eq!(s.get("/t/z").await.unwrap(), None);
    assert_eq!(
        s.revision().await.unwrap(),
        before,
        "a failed transaction writes nothing"
    );

    let ok = Txn::new()
        .when(Compare::Value("/t/x".into(), b"1".to_vec()))
        .when(Compare::Version("/t/y".into(), 0))
        .then(Op::put("/t/x", b"2".to_vec()))
        .then(Op::put("/t/y", b"2".to_vec()))
        .then(Op::delete("/t/z"));
    let r = s.txn(ok).await.unwrap();
    assert!(r.succeeded);
    assert_eq!(r.revision, before + 1, "one transaction, one revision");
    let x = s.get("/t/x").await.unwrap().unwrap();
    let y = s.get("/t/y").await.unwrap().unwrap();
    assert_eq!((x.mod_revision, y.mod_revision), (r.revision, r.revision));
}

async fn compares_cover_absence_revision_and_value(s: Arc<dyn Store>) {
    let create = |v: &str| {
        Txn::new()
            .when(Compare::Version("/k".into(), 0))
            .then(Op::put("/k", v.as_bytes().to_vec()))
    };
    assert!(
        s.txn(create("a")).await.unwrap().succeeded,
        "create-if-absent succeeds once"
    );
    assert!(!s.txn(create("b")).await.unwrap().succeeded, "and only once");
    let kv = s.get("/k").await.unwrap().unwrap();
    let stale = Txn::new()
        .when(Compare::ModRevision("/k".into(), kv.mod_revision - 1))
        .then(Op::put("/k", b"x".to_vec()));
    assert!(!s.txn(stale).await.unwrap().succeeded);
    let fresh = Txn::new()
        .when(Compare::ModRevision("/k".into(), kv.mod_revision))
        .then(Op::put("/k", b"y".to_vec()));
    assert!(s.txn(fresh).await.unwrap().succeeded);
    assert!(
        s.txn(Txn::new().when(Compare::ModRevision("/absent".into(), 0)))
            .await
            .unwrap()
            .succeeded
    );
    assert!(
        !s.txn(Txn::new().when(Compare::Value("/absent".into(), vec![])))
            .await
            .unwrap()
            .succeeded
    );
    assert!(
        s.txn(Txn::new().when(Compare::Value("/k".into(), b"y".to_vec())))
            .await
            .unwrap()
            .succeeded
    );
}

async fn concurrent_compare_and_swap_loses_no_update(s: Arc<dyn Store>) {
    const TASKS: u64 = 8;
    const EACH: u64 = 10;
    let mut handles = Vec::new();
    for _ in 0..TASKS {
        let s = s.clone();
        handles.push(tokio::spawn(async move {
            for _ in 0..EACH {
                loop {
                    let cur = s.get("/counter").await.unwrap();
                    let (n, rev) = cur.map_or((0u64, 0), |kv| {
                        (String::from_utf8(kv.value).unwrap().parse().unwrap(), kv.mod_revision)
                    });
                    let t = Txn::new()
                        .when(Compare::ModRevision("/counter".into(), rev))
                        .then(Op::put("/counter", (n + 1).to_string().into_bytes()));
                    if s.txn(t).await.unwrap().succeeded {
                        break;
                    }
                }
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    let v = s.get("/counter").await.unwrap().unwrap();
    assert_eq!(String::from_utf8(v.value).unwrap(), (TASKS * EACH).to_string());
    assert_eq!(v.version as u64, TASKS * EACH);
}

async fn watch_replays_history_then_follows_live(s: Arc<dyn Store>) {
    let r1 = s.put("/w/a", b"1".to_vec()).await.unwrap();
    let r2 = s
        .txn(
            Txn::new()
                .then(Op::put("/w/b", b"2".to_vec()))
                .then(Op::put("/w/c", b"3".to_vec())),
        )
        .await
        .unwrap()
        .revision;
    let mut w = s.watch_prefix("/w/", r1).await.unwrap();
    let b = next_batch(&mut w).await;
    assert_eq!((b.revision, b.events.len()), (r1, 1));
    let b = next_batch(&mut w).await;
    assert_eq!(b.revision, r2);
    let keys: Vec<&str> = b.events.iter().map(|e| e.kv.key.as_str()).collect();
    assert_eq!(keys, ["/w/b", "/w/c"], "one transaction arrives as one batch, in order");
    let r3 = s.put("/w/a", b"live".to_vec()).await.unwrap();
    let b = next_batch(&mut w).await;
    assert_eq!(b.revision, r3);
    assert_eq!(b.events[0].kv.value, b"live");
    assert_eq!(b.events[0].kv.version, 2);

    // "from now on" sees only later changes
    let mut later = s.watch_prefix("/w/", 0).await.unwrap();
    let r4 = s.put("/w/d", b"4".to_vec()).await.unwrap();
    assert_eq!(next_batch(&mut later).await.revision, r4);
}

async fn watch_is_scoped_and_reports_deletes(s: Arc<dyn Store>) {
    let start = s.revision().await.unwrap() + 1;
    let mut w = s.watch_prefix("/in/", start).await.unwrap();
    s.put("/out/x", b"no".to_vec()).await.unwrap();
    s.put("/in/x", b"yes".to_vec()).await.unwrap();
    let rd = s.delete("/in/x").await.unwrap();
    let b = next_batch(&mut w).await;
    assert_eq!(b.events[0].kv.key, "/in/x");
    assert_eq!(b.events[0].kind, EventKind::Put);
    let b = next_batch(&mut w).await;
    assert_eq!(b.events[0].kind, EventKind::Delete);
    assert_eq!((b.revision, b.events[0].kv.mod_revision), (rd, rd));
}

async fn watch_from_compacted_revision_fails(s: Arc<dyn Store>) {
    let r1 = s.put("/h/a", b"1".to_vec()).await.unwrap();
    s.put("/h/a", b"2".to_vec()).await.unwrap();
    let r3 = s.put("/h/a", b"3".to_vec()).await.unwrap();
    s.compact(r3).await.unwrap();
    match s.watch_prefix("/h/", r1).await {
        Err(StoreError::Compacted { compact_revision, .. }) => assert!(compact_revision >= r3),
        Ok(mut w) => match w.next().await {
            Some(Err(StoreError::Compacted { .. })) => {}
            other => panic!("expected a compaction error, got {other:?}"),
        },
        Err(e) => panic!("expected a compaction error, got {e}"),
    }
    // the compaction point itself is still watchable
    let mut w = s.watch_prefix("/h/", r3).await.unwrap();
    assert_eq!(next_batch(&mut w).await.revision, r3);
    assert!(matches!(
        s.compact(r3 + 100).await,
        Err(StoreError::FutureRevision { .. })
    ));
}

/// Liveness records of many agents share a replica's lease; a replica ends
/// one by deleting it only while it is still on its own lease, so a record
/// another replica wrote meanwhile (on its lease) stays.
async fn a_delete_conditioned_on_a_lease_spares_another_holders_record(s: Arc<dyn Store>) {
    let mine = s.lease_grant(Duration::from_secs(30)).await.unwrap();
    let theirs = s.lease_grant(Duration::from_secs(30)).await.unwrap();
    let put = |key: &str, lease| {
        Txn::new().then(Op::Put {
            key: key.into(),
            value: b"x".to_vec(),
            lease: Some(lease),
        })
    };
    let delete_if_mine = |key: &str| {
        Txn::new()
            .when(Compare::Lease(key.into(), mine))
            .then(Op::Delete { key: key.into() })
    };
    s.txn(put("/a/one", mine)).await.unwrap();
    s.txn(put("/a/two", mine)).await.unwrap();
    // two moved to the other replica: rewritten on its lease
    s.txn(put("/a/two", theirs)).await.unwrap();
    assert!(s.txn(delete_if_mine("/a/one")).await.unwrap().succeeded);
    assert!(!s.txn(delete_if_mine("/a/two")).await.unwrap().succeeded);
    assert!(!s.txn(delete_if_mine("/a/absent")).await.unwrap().succeeded);
    assert_eq!(s.get("/a/one").await.unwrap(), None);
    assert_eq!(s.get("/a/two").await.unwrap().unwrap().lease, theirs);
    // a key written without a lease is on none
    s.txn(Txn::new().then(Op::put("/a/plain", b"x".to_vec())))
        .await
        .unwrap();
    assert!(!s.txn(delete_if_mine("/a/plain")).await.unwrap().succeeded);
}

async fn leases_expire_renew_and_revoke(s: Arc<dyn Store>) {
    // expiry: keys vanish after the TTL without keep-alives
    let short = s.lease_grant(Duration::from_secs(1)).await.unwrap();
    s.txn(Txn::new().then(Op::Put {
        key: "/l/short".into(),
        value: b"x".to_vec(),
        lease: Some(short),
    }))
    .await
    .unwrap();
    assert_eq!(s.get("/l/short").await.unwrap().unwrap().lease, short);
    let mut w = s.watch_prefix("/l/short", 0).await.unwrap();
    let b = next_batch(&mut w).await;
    assert_eq!(b.events[0].kind, EventKind::Delete, "expiry is a delete event");
    assert_eq!(s.get("/l/short").await.unwrap(), None);
    let ka = s.lease_keep_alive(short).await;
    assert!(matches!(ka, Err(StoreError::LeaseNotFound(_))), "{ka:?}");

    // renewal keeps keys past the TTL
    let kept = s.lease_grant(Duration::from_secs(1)).await.unwrap();
    s.txn(Txn::new().then(Op::Put {
        key: "/l/kept".into(),
        value: b"x".to_vec(),
        lease: Some(kept),
    }))
    .await
    .unwrap();
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(s.lease_keep_alive(kept).await.unwrap(), Duration::from_secs(1));
    }
    assert!(
        s.get("/l/kept").await.unwrap().is_some(),
        "renewed for 2.4 s with a 1 s TTL"
    );

    // revoke deletes at once
    s.lease_revoke(kept).await.unwrap();
    assert_eq!(s.get("/l/kept").await.unwrap(), None);
    let again = s.lease_revoke(kept).await;
    assert!(matches!(again, Err(StoreError::LeaseNotFound(_))), "{again:?}");

    // a put on a lease that is gone fails and writes nothing
    let r = s
        .txn(Txn::new().then(Op::Put {
            key: "/l/orphan".into(),
            value: vec![],
            lease: Some(kept),
        }))
        .await;
    assert!(r.is_err(), "put with an ended lease must fail");
    assert_eq!(s.get("/l/orphan").await.unwrap(), None);
}

/// Data written before a restart is there after it, with its revisions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_store_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.redb");
    let (rev, lease) = {
        let s = EmbeddedStore::open(&path).unwrap();
        s.put("/r/a", b"1".to_vec()).await.unwrap();
        let lease = s.lease_grant(Duration::from_secs(60)).await.unwrap();
        s.txn(Txn::new().then(Op::Put {
            key: "/r/l".into(),
            value: vec![],
            lease: Some(lease),
        }))
        .await
        .unwrap();
        (s.revision().await.unwrap(), lease)
    };
    let s = EmbeddedStore::open(&path).unwrap();
    assert_eq!(s.revision().await.unwrap(), rev);
    assert_eq!(s.get("/r/a").await.unwrap().unwrap().value, b"1");
    assert!(
        s.lease_keep_alive(lease).await.is_ok(),
        "leases survive a restart with a fresh TTL"
    );
    let mut w = s.watch_prefix("/r/", 1).await.unwrap();
    assert_eq!(
        next_batch(&mut w).await.events[0].kv.key,
        "/r/a",
        "history survives too"
    );
    drop(w);
    // a second opener of the same file is refused with a clear error
    let e = EmbeddedStore::open(&path).err().expect("second open must fail");
    assert!(e.to_string().contains("already open"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_store_survives_etcd_restart() {
    let Some(mut e) = Etcd::start() else { return };
    let s = EtcdStore::connect(&[e.endpoint()], None).await.unwrap();
    let rev = s.put("/r/a", b"1".to_vec()).await.unwrap();
    e.restart();
    let s = EtcdStore::connect(&[e.endpoint()], None).await.unwrap();
    assert_eq!(s.revision().await.unwrap(), rev);
    assert_eq!(s.get("/r/a").await.unwrap().unwrap().value, b"1");
}

#[tokio::test]
async fn etcd_unreachable_is_unavailable() {
    let port = weft_tests::free_port();
    let e = EtcdStore::connect(&[format!("http://127.0.0.1:{port}")], None)
        .await
        .err()
        .expect("nothing listens");
    assert!(matches!(e, StoreError::Unavailable(_)), "{e}");
}

/// Automatic compaction keeps the newest revisions of history only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_history_is_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let s = EmbeddedStore::open_with_history(&dir.path().join("s.redb"), 10).unwrap();
    for i in 0..30 {
        s.put("/b/k", vec![i]).await.unwrap();
    }
    assert!(matches!(
        s.watch_prefix("/b/", 2).await,
        Err(StoreError::Compacted { .. })
    ));
    let cur = s.revision().await.unwrap();
    let mut w = s.watch_prefix("/b/", cur - 5).await.unwrap();
    assert_eq!(next_batch(&mut w).await.revision, cur - 5);
}

/// etcd over mutual TLS: the store connects with a CA and a client
/// certificate, and a controller started with the TLS flags works on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_over_mutual_tls() {
    use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair};
    weft_tests::step("a ca, a server and a client certificate for etcd");
    let dir = tempfile::Builder::new().prefix("weft-etcd-tls").tempdir().unwrap();
    let write = |name: &str, pem: String| {
        let p = dir.path().join(name);
        std::fs::write(&p, pem).unwrap();
        p
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::from_params(&ca, &ca_key);
    let leaf = |names: Vec<String>, eku: ExtendedKeyUsagePurpose| {
        let k = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(names).unwrap();
        p.extended_key_usages = vec![eku];
        (p.signed_by(&k, &issuer).unwrap().pem(), k.serialize_pem())
    };
    let (srv, srv_key) = leaf(
        vec!["127.0.0.1".into(), "localhost".into()],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let (cli, cli_key) = leaf(vec!["weft".into()], ExtendedKeyUsagePurpose::ClientAuth);
    let ca_file = write("ca.pem", ca_cert.pem());
    let tls = weft_tests::EtcdServerTls {
        cert_file: write("server.pem", srv),
        key_file: write("server.key", srv_key),
        client_ca_file: ca_file.clone(),
    };
    let (cert_file, key_file) = (write("client.pem", cli), write("client.key", cli_key));
    let Some(etcd) = Etcd::start_tls(tls) else {
        return;
    };

    weft_tests::step("the store connects with a ca and a client certificate");
    let files = weft_controller::store::etcd::EtcdTls {
        ca_file: Some(ca_file.clone()),
        cert_file: Some(cert_file.clone()),
        key_file: Some(key_file.clone()),
    };
    let s = EtcdStore::connect(&[etcd.endpoint()], Some(&files)).await.unwrap();
    let rev = s.put("/tls/a", b"1".to_vec()).await.unwrap();
    assert_eq!(s.get("/tls/a").await.unwrap().unwrap().mod_revision, rev);

    weft_tests::step("without a client certificate etcd refuses the store");
    // without a client certificate etcd refuses us
    let no_cert = weft_controller::store::etcd::EtcdTls {
        ca_file: Some(ca_file.clone()),
        ..Default::default()
    };
    assert!(EtcdStore::connect(&[etcd.endpoint()], Some(&no_cert)).await.is_err());

    weft_tests::step("a controller started with the tls flags works on etcd");
    let (ca, cert, key) = (
        ca_file.display().to_string(),
        cert_file.display().to_string(),
        key_file.display().to_string(),
    );
    let ep = etcd.endpoint();
    let c = weft_tests::ControllerSpec::new("site-tls")
        .data_dir(&dir.path().join("data"))
        .flags(&[
            "--pod-cidr",
            "10.1.0.0/16",
            "--etcd-endpoints",
            &ep,
            "--etcd-ca-file",
            &ca,
            "--etcd-cert-file",
            &cert,
            "--etcd-key-file",
            &key,
        ])
        .start();
    assert_eq!(weft_tests::weftctl_json(&c.target(), &["site"])["id"], "site-tls");
    assert!(
        s.get("/weft/sites/site-tls/site").await.unwrap().is_some(),
        "the site lives in etcd"
    );
}
