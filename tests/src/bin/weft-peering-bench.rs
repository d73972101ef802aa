//! Time from `CreatePeering` on site A to the peering being Negotiated on
//! both sides (B records before it answers, so the call's return is the
//! moment), over loopback between two real controllers on the embedded
//! store. `weft-peering-bench --rounds 50` (see docs/benchmarks.md).

use std::time::{Duration, Instant};

use clap::Parser;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
use weft_proto::v1 as pb;
use weft_proto::v1::admin_service_client::AdminServiceClient;
use weft_tests::{Controller, ControllerSpec};

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value_t = 50)]
    rounds: usize,
}

async fn admin(c: &Controller) -> anyhow::Result<AdminServiceClient<tonic::transport::Channel>> {
    let read = |f: &str| std::fs::read_to_string(c.pki(f));
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read("ca.pem")?))
        .identity(Identity::from_pem(read("admin.pem")?, read("admin.key")?));
    let ch = Endpoint::from_shared(format!("https://127.0.0.1:{}", c.listen_port))?
        .tls_config(tls)?
        .connect()
        .await?;
    Ok(AdminServiceClient::new(ch))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::Builder::new().prefix("weft-peering-bench").tempdir()?;
    let a = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("a"))
        .flags(&["--pod-cidr", "10.1.0.0/16"])
        .start();
    let b = ControllerSpec::new("site-b")
        .data_dir(&dir.path().join("b"))
        .flags(&["--pod-cidr", "10.1.0.0/16"])
        .start();
    let (mut ca, mut cb) = (admin(&a).await?, admin(&b).await?);
    let mut times = Vec::new();
    for _ in 0..args.rounds {
        let token = cb
            .create_peering_token(pb::CreatePeeringTokenRequest {
                ttl_seconds: 600,
                for_site: String::new(),
            })
            .await?
            .into_inner()
            .token;
        let t = Instant::now();
        let p = ca
            .create_peering(pb::CreatePeeringRequest { token, transit: false })
            .await?
            .into_inner();
        times.push(t.elapsed());
        anyhow::ensure!(p.state == pb::PeeringState::Negotiated as i32, "A is not Negotiated");
        let on_b = cb.list_peerings(pb::ListPeeringsRequest {}).await?.into_inner();
        anyhow::ensure!(
            on_b.peerings
                .iter()
                .any(|p| p.site_id == "site-a" && p.state == pb::PeeringState::Negotiated as i32),
            "B is not Negotiated"
        );
        ca.delete_peering(pb::DeletePeeringRequest {
            site_id: "site-b".into(),
        })
        .await?;
    }
    times.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "weft-peering-bench: {} rounds, create to Negotiated on both sides: median {:.1} ms, p90 {:.1} ms, max {:.1} ms",
        times.len(),
        ms(times[times.len() / 2]),
        ms(times[times.len() * 9 / 10]),
        ms(*times.last().unwrap())
    );
    Ok(())
}
