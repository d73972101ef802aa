//! An in-process controller for tests: `server::run` in the test's own
//! runtime, with real mutual-TLS gRPC clients.

use tonic::Status;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use weft_controller::config::{self, ControllerArgs, FileConfig};
use weft_proto::v1 as pb;
use weft_proto::v1::admin_service_client::AdminServiceClient;
use weft_proto::v1::agent_service_client::AgentServiceClient;

pub struct InProc {
    pub dir: tempfile::TempDir,
    pub port: u16,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl InProc {
    pub async fn start() -> InProc {
        Self::start_with(&[]).await
    }

    /// Starts with extra flags, e.g. `("agent_ttl", "3s")`,
    /// `("etcd_endpoints", "http://127.0.0.1:PORT")`, or `("listen",
    /// "127.0.0.1:PORT")` (also advertised: peers can be given tokens).
    pub async fn start_with(extra: &[(&str, &str)]) -> InProc {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = tempfile::Builder::new().prefix("weft-identity").tempdir().unwrap();
        let args = ControllerArgs {
            data_dir: Some(dir.path().join("data")),
            listen: Some(
                extra
                    .iter()
                    .find(|e| e.0 == "listen")
                    .map_or("127.0.0.1:0", |e| e.1)
                    .to_string(),
            ),
            advertise: extra
                .iter()
                .filter(|e| e.0 == "listen")
                .map(|e| e.1.to_string())
                .collect(),
            agent_ttl: extra.iter().find(|e| e.0 == "agent_ttl").map(|e| e.1.to_string()),
            agent_cert_ttl: extra.iter().find(|e| e.0 == "agent_cert_ttl").map(|e| e.1.to_string()),
            site_id: Some(
                extra
                    .iter()
                    .find(|e| e.0 == "site_id")
                    .map_or("site-a", |e| e.1)
                    .to_string(),
            ),
            pod_cidrs: vec![
                extra
                    .iter()
                    .find(|e| e.0 == "pod_cidr")
                    .map_or("10.1.0.0/16", |e| e.1)
                    .to_string(),
            ],
            etcd_endpoints: extra
                .iter()
                .filter(|e| e.0 == "etcd_endpoints")
                .map(|e| e.1.to_string())
                .collect(),
            ..Default::default()
        };
        let cfg = config::resolve(&args, FileConfig::default()).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (btx, brx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(weft_controller::server::run(
            cfg,
            async {
                let _ = stopped.await;
            },
            move |b| {
                let _ = btx.send(b.listen.port());
            },
        ));
        let port = brx.await.expect("controller failed to start");
        InProc {
            dir,
            port,
            stop: Some(stop),
            task: Some(task),
        }
    }

    pub fn pki(&self, f: &str) -> String {
        std::fs::read_to_string(self.dir.path().join("data/pki").join(f)).unwrap()
    }

    pub async fn channel(&self, client: Option<(&str, &str)>) -> Channel {
        self.channel_with(client, None).await
    }

    /// A channel whose HTTP/2 stream window is `window` bytes (to make a
    /// reader that stops reading hold the sender up quickly).
    pub async fn channel_with(&self, client: Option<(&str, &str)>, window: Option<u32>) -> Channel {
        let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(self.pki("ca.pem")));
        if let Some((c, k)) = client {
            tls = tls.identity(Identity::from_pem(c, k));
        }
        Endpoint::from_shared(format!("https://127.0.0.1:{}", self.port))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .initial_stream_window_size(window)
            .connect()
            .await
            .unwrap()
    }

    pub async fn admin(&self) -> AdminServiceClient<Channel> {
        AdminServiceClient::new(
            self.channel(Some((&self.pki("admin.pem"), &self.pki("admin.key"))))
                .await,
        )
    }

    pub async fn revision(&self) -> i64 {
        self.admin()
            .await
            .get_site(pb::GetSiteRequest {})
            .await
            .unwrap()
            .into_inner()
            .revision
    }

    pub async fn token(&self, name: &str, ttl: u64, uses: u32) -> String {
        self.token_for(pb::AgentRole::Node, name, ttl, uses).await
    }

    pub async fn token_for(&self, role: pb::AgentRole, name: &str, ttl: u64, uses: u32) -> String {
        let r = self
            .admin()
            .await
            .create_token(pb::CreateTokenRequest {
                role: role as i32,
                name: name.into(),
                ttl_seconds: ttl,
                uses,
            })
            .await
            .unwrap()
            .into_inner();
        r.token
    }

    /// Enrolls `name` with `token`; returns (cert, key) or the status.
    pub async fn register(&self, token: &str, name: &str) -> Result<(String, String), Status> {
        self.register_at(token, name, "").await
    }

    /// Enrolls with an explicit underlay address.
    pub async fn register_at(&self, token: &str, name: &str, underlay: &str) -> Result<(String, String), Status> {
        let (key, csr) = weft_agent::identity::key_and_csr(name).unwrap();
        let r = AgentServiceClient::new(self.channel(None).await)
            .register(pb::RegisterRequest {
                token: token.into(),
                csr_pem: csr,
                name: name.into(),
                subnet: String::new(),
                underlay_ip: underlay.into(),
            })
            .await?
            .into_inner();
        Ok((r.certificate_pem, key.serialize_pem()))
    }

    pub async fn stop(mut self) -> tempfile::TempDir {
        let _ = self.stop.take().unwrap().send(());
        self.task.take().unwrap().await.unwrap().unwrap();
        self.dir
    }
}
