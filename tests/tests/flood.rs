//! Floods that cost an attacker nothing must not stall the site: wrong
//! enrollment tokens are refused before the site-wide writer lock, so an
//! admin's change completes on time while they pour in. Bounds measured
//! here are recorded in docs/security.md.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tonic::Code;
use weft_proto::v1 as pb;
use weft_proto::v1::agent_service_client::AgentServiceClient;
use weft_tests::inproc::InProc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_bad_tokens_in_ten_seconds_do_not_stall_an_admin_change() {
    let c = Arc::new(InProc::start().await);
    let (_, csr) = weft_agent::identity::key_and_csr("x").unwrap();
    const TOTAL: u64 = 10_000;
    const SENDERS: u64 = 32;
    let sent = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut flood = Vec::new();
    for s in 0..SENDERS {
        let (c, csr, sent) = (c.clone(), csr.clone(), sent.clone());
        flood.push(tokio::spawn(async move {
            let mut a = AgentServiceClient::new(c.channel(None).await);
            let mut i = 0u64;
            loop {
                // Paced to 1,000 a second in all: 10,000 take 10 s.
                let n = sent.fetch_add(1, Ordering::Relaxed);
                if n >= TOTAL {
                    return;
                }
                let due = start + Duration::from_millis(n);
                tokio::time::sleep_until(due.into()).await;
                // Well-formed, so each costs the controller a lookup.
                let token = format!("weft1.{:012x}.{:032x}", s * 1_000_000 + i, i);
                i += 1;
                let r = a
                    .register(pb::RegisterRequest {
                        token,
                        csr_pem: csr.clone(),
                        name: format!("f{s}"),
                        subnet: String::new(),
                        underlay_ip: String::new(),
                    })
                    .await;
                assert_eq!(r.unwrap_err().code(), Code::Unauthenticated);
            }
        }));
    }
    // While they pour in, an admin adds nodes, one after another.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut admin = c.admin().await;
    let mut worst = Duration::ZERO;
    let mut changes = 0;
    while sent.load(Ordering::Relaxed) < TOTAL * 9 / 10 {
        let t = Instant::now();
        admin
            .create_node(pb::CreateNodeRequest {
                name: format!("n{changes}"),
                subnet: String::new(),
            })
            .await
            .unwrap();
        worst = worst.max(t.elapsed());
        changes += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    for f in flood {
        f.await.unwrap();
    }
    let took = start.elapsed();
    eprintln!(
        "{TOTAL} bad-token registers in {:.1}s; {changes} admin changes meanwhile, the slowest {:.0} ms",
        took.as_secs_f64(),
        worst.as_secs_f64() * 1000.0
    );
    assert!(took < Duration::from_secs(20), "the flood itself was slow: {took:?}");
    assert!(changes >= 10, "only {changes} changes overlapped the flood");
    assert!(
        worst < Duration::from_secs(2),
        "an admin change took {worst:?} during the flood"
    );
    if let Ok(c) = Arc::try_unwrap(c) {
        c.stop().await;
    }
}

/// 5,000 TLS connections without a certificate that then say nothing: the
/// controller keeps only a few (per address, for seconds), its descriptors
/// stay bounded, and an enrolled agent still connects and watches.
#[test]
fn five_thousand_idle_tls_connections_do_not_keep_an_agent_out() {
    use rustls::pki_types::{CertificateDer, ServerName, pem::PemObject};
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::Builder::new().prefix("weft-idle").tempdir().unwrap();
    let c = weft_tests::Controller::start("site-a", &dir.path().join("ctl"), &["--pod-cidr", "10.1.0.0/16"]);
    // An agent enrolled before the flood, then stopped.
    let mut agent = weft_tests::dry_run_agent("node", "n1", "127.0.0.1", &[&c], &c, dir.path());
    weft_tests::eventually("the agent watching", Duration::from_secs(20), || {
        agent.log_text().contains("watching").then_some(())
    });
    agent.stop();

    let ca = std::fs::read(c.pki("ca.pem")).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(&ca).unwrap()).unwrap();
    let mut cfg = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let port = c.listen_port;
    let (held, handshaken) = rt.block_on(async {
        let mut held = Vec::new();
        let mut handshaken = 0;
        // 32 at a time, under the per-address handshake cap.
        for _ in 0..5_000 / 32 + 1 {
            let batch: Vec<_> = (0..32)
                .map(|_| {
                    let connector = connector.clone();
                    tokio::spawn(async move {
                        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
                        let name = ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
                        connector.connect(name, tcp).await.ok()
                    })
                })
                .collect();
            for t in batch {
                if let Some(s) = t.await.unwrap() {
                    handshaken += 1;
                    held.push(s);
                }
            }
            if handshaken >= 5_000 {
                break;
            }
        }
        (held, handshaken)
    });
    let (_, fds) = weft_tests::sim::memory_and_fds(c.pid());
    eprintln!("{handshaken} idle TLS connections made; the controller holds {fds} descriptors");
    assert!(handshaken >= 5_000, "only {handshaken} handshakes completed");
    assert!(fds < 500, "the controller keeps {fds} descriptors for idle connections");

    // With all of them still open on this side, the agent comes back.
    agent = weft_tests::dry_run_agent_again("node", "n1", "127.0.0.1", &[&c], dir.path());
    weft_tests::eventually("the agent watching during the flood", Duration::from_secs(20), || {
        agent.log_text().contains("watching").then_some(())
    });
    drop(held);
}
