//! The one way tests start a controller: a [`ControllerSpec`], started on
//! this machine's loopback ([`ControllerSpec::start`]), in a mount
//! namespace of a process ([`ControllerSpec::mount_of`]), or on a lab host
//! (`Lab::controller`, in `lab.rs`); or run where it must refuse to
//! start ([`ControllerSpec::refused`]). Only the tests of the binary's own
//! command line (`config_errors.rs`, `admin-cert`) run it directly.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tonic::Status;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use weft_proto::v1 as pb;
use weft_proto::v1::admin_service_client::AdminServiceClient;
use weft_proto::v1::agent_service_client::AgentServiceClient;

use crate::{bin, free_port, terminate};

/// What a controller starts with: its site, flags, data and where it runs.
#[derive(Clone, Debug)]
pub struct ControllerSpec {
    site: String,
    data_dir: Option<PathBuf>,
    listen: Option<String>,
    log: Option<PathBuf>,
    admin_socket: Option<PathBuf>,
    mount_of: Option<u32>,
    flags: Vec<String>,
    bins: Option<PathBuf>,
}

/// Where a controller runs.
#[derive(Clone, Debug)]
pub(crate) enum Place {
    /// This machine's namespaces.
    Here,
    /// The network namespace of a lab host.
    Host(String),
    /// The mount namespace of process PID (e.g. one that holds a small
    /// tmpfs over the data directory).
    MountOf(u32),
}

impl ControllerSpec {
    /// A controller of site `site`, with the controller's defaults for
    /// everything not set (its data in a fresh temporary directory, on a
    /// free loopback port).
    pub fn new(site: &str) -> ControllerSpec {
        ControllerSpec {
            site: site.to_string(),
            data_dir: None,
            listen: None,
            log: None,
            admin_socket: None,
            mount_of: None,
            flags: Vec::new(),
            bins: None,
        }
    }

    /// Runs the `weft-controller` in `dir` (another release's, see
    /// [`crate::prev_release`]) instead of this workspace's.
    pub fn bins(mut self, dir: &Path) -> Self {
        self.bins = Some(dir.to_path_buf());
        self
    }

    /// Its `--admin-socket` (default: `admin.sock` in its data directory).
    pub fn admin_socket(mut self, path: &Path) -> Self {
        self.admin_socket = Some(path.to_path_buf());
        self
    }

    /// Runs it in the mount namespace of process `pid`: its data directory
    /// is what that namespace sees there.
    pub fn mount_of(mut self, pid: u32) -> Self {
        self.mount_of = Some(pid);
        self
    }

    /// Keeps its data in `dir` (its log goes beside it, `dir.log`).
    pub fn data_dir(mut self, dir: &Path) -> Self {
        self.data_dir = Some(dir.to_path_buf());
        self
    }

    /// Its `--listen` address (default: a free port on 127.0.0.1).
    pub fn listen(mut self, addr: &str) -> Self {
        self.listen = Some(addr.to_string());
        self
    }

    /// Logs to `path` instead of beside its data.
    pub fn log(mut self, path: &Path) -> Self {
        self.log = Some(path.to_path_buf());
        self
    }

    /// Adds command-line flags as given (`["--agent-ttl", "3s"]`).
    pub fn flags(mut self, flags: &[&str]) -> Self {
        self.flags.extend(flags.iter().map(|f| f.to_string()));
        self
    }

    /// Adds one flag and its value.
    pub fn flag(self, name: &str, value: &str) -> Self {
        self.flags(&[name, value])
    }

    /// Its workload CIDR.
    pub fn pod(self, cidr: &str) -> Self {
        self.flag("--pod-cidr", cidr)
    }

    /// Keeps its state in the etcd at `endpoint` instead of the embedded store.
    pub fn etcd(self, endpoint: &str) -> Self {
        self.flag("--etcd-endpoints", endpoint)
    }

    /// Starts it on this machine's loopback and waits until it serves.
    pub fn start(self) -> Controller {
        let place = self.mount_of.map_or(Place::Here, Place::MountOf);
        Controller::launched(self, place)
    }

    /// Runs it where it must refuse to start, and returns its output once
    /// it has exited; panics when it is still running after 20 s (it
    /// started).
    pub fn refused(self) -> std::process::Output {
        let place = self.mount_of.map_or(Place::Here, Place::MountOf);
        let c = Controller::prepared(self, place);
        let child = c
            .command()
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        // Read its output while it runs (a full pipe would stall it).
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(child.wait_with_output()));
        match rx.recv_timeout(crate::pace::scaled(Duration::from_secs(20))) {
            Ok(out) => out.unwrap(),
            Err(_) => {
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
                let o = rx.recv().unwrap().unwrap();
                panic!(
                    "weft-controller was to refuse to start, and ran for 20 s: {}",
                    String::from_utf8_lossy(&o.stderr)
                );
            }
        }
    }
}

/// A running `weft-controller` (on loopback, or on a lab host), started
/// from a [`ControllerSpec`]. Killed on drop.
pub struct Controller {
    child: Option<Child>,
    pub data_dir: PathBuf,
    pub socket: PathBuf,
    /// Its `--listen` port.
    pub listen_port: u16,
    /// Its `--listen` address.
    pub listen: String,
    args: Vec<String>,
    log: PathBuf,
    place: Place,
    /// Where its binary is (None: this workspace's).
    bins: Option<PathBuf>,
    launches: u32,
    _tmp: Option<tempfile::TempDir>,
}

impl Controller {
    pub(crate) fn launched(spec: ControllerSpec, place: Place) -> Controller {
        let mut c = Controller::prepared(spec, place);
        c.launch();
        c
    }

    fn prepared(spec: ControllerSpec, place: Place) -> Controller {
        let (data_dir, tmp) = match spec.data_dir {
            Some(d) => (d, None),
            None => {
                let t = tempfile::Builder::new().prefix("weft-ctl").tempdir().unwrap();
                (t.path().join("data"), Some(t))
            }
        };
        let listen = spec.listen.unwrap_or_else(|| format!("127.0.0.1:{}", free_port()));
        let listen_port = listen
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .expect("--listen IP:PORT");
        let mut args: Vec<String> = vec![
            "--site-id".into(),
            spec.site,
            "--data-dir".into(),
            data_dir.display().to_string(),
            "--listen".into(),
            listen.clone(),
        ];
        if let Some(sock) = &spec.admin_socket {
            args.extend(["--admin-socket".into(), sock.display().to_string()]);
        }
        args.extend(spec.flags);
        Controller {
            child: None,
            socket: spec.admin_socket.unwrap_or_else(|| data_dir.join("admin.sock")),
            log: spec.log.unwrap_or_else(|| data_dir.with_extension("log")),
            data_dir,
            listen_port,
            listen,
            args,
            place,
            bins: spec.bins,
            launches: 0,
            _tmp: tmp,
        }
    }

    /// The command that runs it in its place. nsenter execs the
    /// controller: the child is the controller itself.
    fn command(&self) -> Command {
        let program = self
            .bins
            .as_ref()
            .map_or_else(|| bin("weft-controller"), |d| d.join("weft-controller"));
        let mut cmd = match &self.place {
            Place::Here => Command::new(program),
            Place::Host(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{ns}")).arg(program);
                c
            }
            Place::MountOf(pid) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--mount=/proc/{pid}/ns/mnt")).arg(program);
                c
            }
        };
        for v in ["WEFT_CONFIG", "WEFT_CONTROLLER", "WEFT_TOKEN"] {
            cmd.env_remove(v);
        }
        cmd.args(&self.args);
        cmd
    }

    fn launch(&mut self) {
        // A restart appends to the same log: what it said before stays.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(self.launches > 0)
            .write(true)
            .truncate(self.launches == 0)
            .open(&self.log)
            .unwrap();
        self.launches += 1;
        let mut child = self
            .command()
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let start = Instant::now();
        let limit = crate::pace::scaled(Duration::from_secs(20));
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                panic!("weft-controller exited ({st}) while starting:\n{}", self.log_text());
            }
            // A lab host's address is not reachable from here: its admin
            // socket (on the shared file system) answers once it serves.
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok()
                && (matches!(self.place, Place::Host(_)) || TcpStream::connect(("127.0.0.1", self.listen_port)).is_ok())
            {
                break;
            }
            if start.elapsed() > limit {
                let _ = child.kill();
                let _ = child.wait();
                panic!("weft-controller did not start within {limit:?}:\n{}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child = Some(child);
    }

    /// Runs `weft-controller` with its flags and then `extra` (a
    /// subcommand such as `backup`), in its place, and waits for it.
    pub fn run_command(&self, extra: &[&str]) -> std::process::Output {
        self.command().args(extra).output().unwrap()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The controller's process id (0 when it is not running).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, |c| c.id())
    }

    /// `unix:<socket>`, for weftctl.
    pub fn target(&self) -> String {
        format!("unix:{}", self.socket.display())
    }

    /// Stops it cleanly (SIGTERM) and returns its exit status.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("controller is not running");
        terminate(&mut c)
    }

    /// Kills it (SIGKILL): no shutdown, as a crash or a lost host.
    pub fn kill(&mut self) {
        let mut c = self.child.take().expect("controller is not running");
        c.kill().unwrap();
        c.wait().unwrap();
    }

    /// Stops it with SIGTERM and asserts that it shut down cleanly; the
    /// temporary directory holding its data when the spec gave none (kept
    /// until the guard drops).
    pub fn shut_down(mut self) -> Option<tempfile::TempDir> {
        let st = self.stop();
        assert!(
            st.success(),
            "controller exited with {st} on SIGTERM:\n{}",
            self.log_text()
        );
        self._tmp.take()
    }

    /// Sets flag `flag`'s value for the next start (after [`Controller::stop`]).
    pub fn set_flag(&mut self, flag: &str, value: &str) {
        let i = self
            .args
            .iter()
            .position(|a| a == flag)
            .unwrap_or_else(|| panic!("{flag} was not given"));
        self.args[i + 1] = value.to_string();
    }

    /// Runs the `weft-controller` in `dir` from its next start (None: this
    /// workspace's): an upgrade, after [`Controller::stop`].
    pub fn set_bins(&mut self, dir: Option<&Path>) {
        self.bins = dir.map(Path::to_path_buf);
    }

    /// Starts it again after [`Controller::stop`] or [`Controller::kill`],
    /// with the same flags and data.
    pub fn restart_stopped(&mut self) {
        assert!(self.child.is_none(), "controller is still running");
        self.launch();
    }

    /// Stops and starts it again with the same flags and data.
    pub fn restart(&mut self) {
        let st = self.stop();
        assert!(
            st.success(),
            "controller exited with {st} on SIGTERM:\n{}",
            self.log_text()
        );
        self.launch();
    }

    /// The path of one of its PKI files (`ca.pem`, `admin.key`, …).
    pub fn pki(&self, file: &str) -> PathBuf {
        self.data_dir.join("pki").join(file)
    }

    /// The contents of one of its PKI files.
    pub fn pki_pem(&self, file: &str) -> String {
        std::fs::read_to_string(self.pki(file)).unwrap()
    }

    /// A mutual-TLS gRPC channel to it on loopback, with `client`'s
    /// (certificate, key) PEMs or none.
    pub async fn channel(&self, client: Option<(&str, &str)>) -> Channel {
        self.channel_with(client, None).await
    }

    /// A channel whose HTTP/2 stream window is `window` bytes (to make a
    /// reader that stops reading hold the sender up quickly).
    pub async fn channel_with(&self, client: Option<(&str, &str)>, window: Option<u32>) -> Channel {
        let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(self.pki_pem("ca.pem")));
        if let Some((c, k)) = client {
            tls = tls.identity(Identity::from_pem(c, k));
        }
        Endpoint::from_shared(format!("https://127.0.0.1:{}", self.listen_port))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .initial_stream_window_size(window)
            .connect()
            .await
            .unwrap()
    }

    /// An admin client (the controller's own admin certificate).
    pub async fn admin(&self) -> AdminServiceClient<Channel> {
        AdminServiceClient::new(
            self.channel(Some((&self.pki_pem("admin.pem"), &self.pki_pem("admin.key"))))
                .await,
        )
    }

    /// The store revision the controller reports.
    pub async fn revision(&self) -> i64 {
        self.admin()
            .await
            .get_site(pb::GetSiteRequest {})
            .await
            .unwrap()
            .into_inner()
            .revision
    }

    /// A node enrollment token for `name`, valid `ttl` seconds, `uses` times.
    pub async fn token(&self, name: &str, ttl: u64, uses: u32) -> String {
        self.token_for(pb::AgentRole::Node, name, ttl, uses).await
    }

    /// An enrollment token for role `role`.
    pub async fn token_for(&self, role: pb::AgentRole, name: &str, ttl: u64, uses: u32) -> String {
        self.admin()
            .await
            .create_token(pb::CreateTokenRequest {
                role: role as i32,
                name: name.into(),
                ttl_seconds: ttl,
                uses,
            })
            .await
            .unwrap()
            .into_inner()
            .token
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
}

impl Drop for Controller {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
