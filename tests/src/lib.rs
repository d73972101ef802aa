//! The test kit for weft's end-to-end and conformance tests: it finds the
//! built binaries, starts real etcd servers and controllers on free loopback
//! ports, runs the real grpcurl and weftctl, and cleans up every process and
//! directory it made, also when a test fails (guards kill on drop).
//!
//! A test that needs a tool this machine lacks (etcd, grpcurl) is skipped
//! with a message outside CI, and fails under `CI=true`: a green CI must
//! mean the test ran.

pub mod browser;
pub mod controller;
pub mod hosts;
pub mod lab;
pub mod mesh;
pub mod netns;
pub mod pace;
pub mod perf;
pub mod sim;
pub mod sites;
pub mod vm;

pub use controller::{Controller, ControllerSpec};

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Finds an executable on PATH. Outside CI a missing tool skips the test
/// (`None`, with a note on stderr); under CI it fails the test.
pub fn require_tool(name: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    });
    // Missing, the test fails (it is not reported as passed): the README's
    // test command installs every tool the suite needs.
    assert!(
        found.is_some(),
        "NOT RUN: `{name}` is not installed; run the README's test command (tests/run.sh), which installs it"
    );
    found
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
///
/// Ports come from below the kernel's ephemeral range (32768–60999 by
/// default), so an outgoing connection made between this call and the
/// server's bind cannot take the port, and a per-process counter keeps
/// parallel tests of one binary from being handed the same one.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let base = std::process::id().wrapping_mul(7919) % SPAN;
    for _ in 0..SPAN {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (LOW + (base + n) % SPAN) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port between {LOW} and {}", LOW + SPAN)
}

/// The directory holding the workspace's built binaries (target/debug).
pub fn bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("WEFT_BIN_DIR") {
        return PathBuf::from(d);
    }
    // Test executables live in target/<profile>/deps/, binaries such as
    // weft-fanout beside the others in target/<profile>/.
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap();
    if dir.ends_with("deps") {
        dir.parent().unwrap().to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

/// The previous release's binaries, for the upgrade lane: its version and
/// the directory holding them (`WEFT_PREV_BIN_DIR`, which tests/run.sh
/// sets after tests/prev-release.sh built them from the release's tag; the
/// version is in the directory's `VERSION`). None when they were not
/// built: a test then says it did not run, and under CI=true fails.
pub fn prev_release() -> Option<(&'static str, &'static Path)> {
    static PREV: std::sync::OnceLock<Option<(String, PathBuf)>> = std::sync::OnceLock::new();
    let found = PREV.get_or_init(|| {
        let dir = PathBuf::from(std::env::var_os("WEFT_PREV_BIN_DIR")?);
        let version = std::fs::read_to_string(dir.join("VERSION")).ok()?.trim().to_string();
        Some((version, dir))
    });
    match found {
        Some((v, d)) => Some((v.as_str(), d.as_path())),
        None => {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "the previous release's binaries are not built (WEFT_PREV_BIN_DIR): tests/run.sh builds them with tests/prev-release.sh"
            );
            eprintln!(
                "NOT RUN: the previous release's binaries are not built; run tests/prev-release.sh and set WEFT_PREV_BIN_DIR"
            );
            None
        }
    }
}

/// Path of a workspace binary; panics with what to do when it is not built.
pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.is_file(),
        "{} is not built; run `cargo build --workspace` first",
        p.display()
    );
    p
}

/// Sends SIGTERM (a clean stop) to a child.
pub fn terminate(child: &mut Child) -> std::process::ExitStatus {
    let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
    let start = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if start.elapsed() > Duration::from_secs(15) {
            let _ = child.kill();
            panic!("process {} ignored SIGTERM for 15 s", child.id());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A real etcd server on free loopback ports, with its own data directory.
pub struct Etcd {
    child: Option<Child>,
    dir: tempfile::TempDir,
    /// Server certificate, key and client CA (PEM paths) when serving TLS.
    tls: Option<EtcdServerTls>,
    client_port: u16,
    peer_port: u16,
    metrics_port: u16,
}

/// PEM files for an etcd that serves TLS and requires client certificates.
#[derive(Clone, Debug)]
pub struct EtcdServerTls {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub client_ca_file: PathBuf,
}

impl Etcd {
    /// Starts etcd, or returns `None` outside CI when it is not installed.
    pub fn start() -> Option<Etcd> {
        Self::start_inner(None)
    }

    /// Starts etcd serving TLS with client-certificate authentication.
    pub fn start_tls(tls: EtcdServerTls) -> Option<Etcd> {
        Self::start_inner(Some(tls))
    }

    fn start_inner(tls: Option<EtcdServerTls>) -> Option<Etcd> {
        require_tool("etcd")?;
        let mut e = Etcd {
            child: None,
            tls,
            dir: tempfile::Builder::new().prefix("weft-etcd").tempdir().unwrap(),
            client_port: free_port(),
            peer_port: free_port(),
            metrics_port: free_port(),
        };
        e.launch();
        Some(e)
    }

    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    fn launch(&mut self) {
        let c = self.endpoint();
        let p = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::File::create(self.dir.path().join("etcd.log")).unwrap();
        let mut cmd = Command::new("etcd");
        if let Some(t) = &self.tls {
            cmd.arg("--cert-file").arg(&t.cert_file);
            cmd.arg("--key-file").arg(&t.key_file);
            cmd.arg("--trusted-ca-file").arg(&t.client_ca_file);
            cmd.arg("--client-cert-auth");
        }
        let child = cmd
            .args(["--name", "t", "--data-dir"])
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &c, "--advertise-client-urls", &c])
            .args(["--listen-peer-urls", &p, "--initial-advertise-peer-urls", &p])
            .args(["--initial-cluster", &format!("t={p}")])
            .args([
                "--listen-metrics-urls",
                &format!("http://127.0.0.1:{}", self.metrics_port),
            ])
            .args([
                "--logger=zap",
                "--log-outputs=stderr",
                "--heartbeat-interval=20",
                "--election-timeout=200",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("cannot start etcd");
        self.child = Some(child);
        // The metrics listener is plain HTTP in both modes and reports the
        // same health.
        let metrics = self.metrics_port;
        let start = Instant::now();
        while !http_get_ok(metrics, "/health") {
            let exited = self.child.as_mut().unwrap().try_wait().unwrap();
            if exited.is_some() || start.elapsed() > Duration::from_secs(30) {
                let log = std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                panic!(
                    "etcd was not ready within 30 s (exit: {exited:?}); its log ends:\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Its Prometheus metrics (text), from its plain-HTTP metrics listener.
    pub fn metrics(&self) -> Option<String> {
        http_get(self.metrics_port, "/metrics")
    }

    /// The etcd server's process id (0 when stopped).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, |c| c.id())
    }

    /// Stops etcd (SIGTERM) keeping its data.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            terminate(&mut c);
        }
    }

    /// Starts it again on the same ports and data.
    pub fn restart(&mut self) {
        self.stop();
        self.launch();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A minimal HTTP GET on loopback, true on a 200 answer.
fn http_get_ok(port: u16, path: &str) -> bool {
    http_get(port, path).is_some()
}

/// A minimal HTTP GET on loopback: the body of a 200 answer.
pub fn http_get(port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .ok()?;
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    if !(buf.starts_with("HTTP/1.0 200") || buf.starts_with("HTTP/1.1 200")) {
        return None;
    }
    buf.split_once("\r\n\r\n").map(|(_, body)| body.to_string())
}

/// Runs a command and returns its output (never panics on a non-zero exit).
pub fn run(cmd: &mut Command) -> Output {
    cmd.stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// weftctl against a controller, with `--output json`; returns the parsed
/// answer or panics with weftctl's stderr.
pub fn weftctl_json(target: &str, args: &[&str]) -> serde_json::Value {
    let o = run(Command::new(bin("weftctl"))
        .args(["--controller", target, "--output", "json"])
        .args(args));
    assert!(
        o.status.success(),
        "weftctl {args:?} failed ({}): stderr: {} stdout: {}",
        o.status,
        stderr(&o),
        stdout(&o)
    );
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("weftctl printed no JSON ({e}): {}", stdout(&o)))
}

/// `weftctl diagnose --output json` (with `extra` flags): its report
/// whatever the checks say (it exits 1 when one FAILs; a test asserts on
/// the checks it is about). The failed checks, if any, go to the test's
/// stderr with their details, so a later failure shows what diagnose saw.
/// Panics when there is no report (exit 2: the controller was not asked).
pub fn weftctl_diagnose(target: &str, extra: &[&str]) -> serde_json::Value {
    let o = run(Command::new(bin("weftctl"))
        .args(["--controller", target, "--output", "json", "diagnose"])
        .args(extra));
    let report: serde_json::Value = match o.status.code() {
        Some(0 | 1) => serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|e| panic!("weftctl diagnose printed no JSON ({e}): {}{}", stdout(&o), stderr(&o))),
        _ => panic!("weftctl diagnose gave no report ({}): {}", o.status, stderr(&o)),
    };
    let failed: Vec<&serde_json::Value> = report["checks"]
        .as_array()
        .map(|c| c.iter().filter(|c| c["result"] == "FAIL").collect())
        .unwrap_or_default();
    assert_eq!(
        o.status.code() == Some(1),
        !failed.is_empty(),
        "diagnose exits 1 exactly when a check fails: {report:#}"
    );
    for c in failed {
        eprintln!(
            "diagnose: FAIL {} {}: {} ({})",
            c["check"].as_str().unwrap_or_default(),
            c["subject"].as_str().unwrap_or_default(),
            c["detail"].as_str().unwrap_or_default(),
            c["hint"].as_str().unwrap_or_default()
        );
    }
    report
}

/// Site `peer`'s view of `kind` ("workload", "external") in the peerings
/// of the controller at `target`: the `real_cidr` and `local_cidr` pair.
pub fn peer_view(target: &str, peer: &str, kind: &str) -> (String, String) {
    peer_view_where(target, peer, kind, |_| true)
}

/// [`peer_view`], the first view of `kind` whose real CIDR `pick` takes
/// (say, the IPv6 one).
pub fn peer_view_where(target: &str, peer: &str, kind: &str, pick: impl Fn(&str) -> bool) -> (String, String) {
    let all = weftctl_json(target, &["peerings"]);
    let p = all["peerings"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["site_id"] == peer))
        .unwrap_or_else(|| panic!("no peering with {peer}: {all}"));
    let v = p["views"]
        .as_array()
        .and_then(|vs| {
            vs.iter()
                .find(|v| v["kind"] == kind && v["real_cidr"].as_str().is_some_and(&pick))
        })
        .unwrap_or_else(|| panic!("no such {kind} view of {peer}: {p}"));
    let cidr = |f: &str| v[f].as_str().unwrap().to_string();
    (cidr("real_cidr"), cidr("local_cidr"))
}

/// An agent in `--dry-run` (it changes nothing on the host, so needs no
/// root) enrolled through `via` with a fresh token, watching `controllers`.
pub fn dry_run_agent(
    kind: &str,
    name: &str,
    ip: &str,
    controllers: &[&Controller],
    via: &Controller,
    dir: &std::path::Path,
) -> Proc {
    let t = weftctl_json(&via.target(), &["token", "create", "--role", kind, "--name", name]);
    let mut cmd = dry_run_command(kind, name, ip, controllers, dir);
    cmd.args(["--token", t["token"].as_str().unwrap()])
        .args(["--ca-fingerprint", t["ca_fingerprint"].as_str().unwrap()]);
    Proc::spawn(&mut cmd, &dir.join(format!("{name}.log")))
}

/// A [`dry_run_agent`] started again with what it stored when it enrolled
/// (no token), logging to a new file.
pub fn dry_run_agent_again(
    kind: &str,
    name: &str,
    ip: &str,
    controllers: &[&Controller],
    dir: &std::path::Path,
) -> Proc {
    let mut cmd = dry_run_command(kind, name, ip, controllers, dir);
    Proc::spawn(&mut cmd, &dir.join(format!("{name}.again.log")))
}

fn dry_run_command(kind: &str, name: &str, ip: &str, controllers: &[&Controller], dir: &std::path::Path) -> Command {
    let list: Vec<String> = controllers
        .iter()
        .map(|c| format!("https://127.0.0.1:{}", c.listen_port))
        .collect();
    let mut cmd = Command::new(bin(&format!("weft-{kind}-agent")));
    cmd.args(["--controller", &list.join(","), "--name", name, "--underlay-ip", ip])
        .arg("--state-dir")
        .arg(dir.join(name))
        .arg("--dry-run")
        // With several replicas, a node away from its first choice asks it
        // again after 1-3 s (15-45 s by default).
        .args(["--failback-after", "1s"])
        .env_remove("WEFT_CONTROLLER")
        .env_remove("WEFT_TOKEN");
    if kind == "gateway" {
        cmd.args(["--endpoint", &format!("{ip}:51820")]);
    }
    cmd
}

/// The arguments a lab agent starts with: agent `name` of role `kind`
/// ("node", "gateway"), enrolling with a fresh token made for it by the
/// controller at `target` (weftctl), dialling `controller_url`, with its
/// underlay address, its state in `state`, and drift repair every `resync`.
pub fn enrolling_agent_args(
    target: &str,
    kind: &str,
    name: &str,
    controller_url: &str,
    underlay: &str,
    state: &Path,
    resync: &str,
) -> Vec<String> {
    let t = weftctl_json(target, &["token", "create", "--role", kind, "--name", name]);
    [
        "--controller",
        controller_url,
        "--name",
        name,
        "--underlay-ip",
        underlay,
        "--token",
        t["token"].as_str().unwrap(),
        "--ca-fingerprint",
        t["ca_fingerprint"].as_str().unwrap(),
        "--state-dir",
        state.to_str().unwrap(),
        "--resync-interval",
        resync,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Times (Unix s) and sequence numbers of the answered pings in a
/// `ping -D` log.
pub fn ping_answers(log: &str) -> Vec<(f64, u64)> {
    log.lines()
        .filter(|l| l.contains("bytes from"))
        .filter_map(|l| {
            let t = l.strip_prefix('[')?.split(']').next()?.parse().ok()?;
            let seq = l.split("icmp_seq=").nth(1)?.split_whitespace().next()?.parse().ok()?;
            Some((t, seq))
        })
        .collect()
}

/// In a `ping -D` log: how many pings were answered (each sequence number
/// once) and how many lost between the first answer and the last. Panics
/// when fewer than `at_least` were answered: too few to judge.
pub fn pings_lost(log: &str, at_least: usize) -> (usize, usize) {
    let mut seqs: Vec<u64> = ping_answers(log).into_iter().map(|(_, seq)| seq).collect();
    seqs.sort_unstable();
    seqs.dedup();
    assert!(
        seqs.len() >= at_least,
        "too few pings answered to judge: {}",
        seqs.len()
    );
    let (first, last) = (seqs[0], *seqs.last().unwrap());
    (seqs.len(), (last - first + 1) as usize - seqs.len())
}

/// Seconds since the Unix epoch, as `ping -D` prints them.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Any process a test started: killed on drop.
pub struct Proc {
    pub child: Option<Child>,
    pub log: PathBuf,
}

impl Proc {
    /// Starts `cmd` with stdout and stderr going to `log`.
    pub fn spawn(cmd: &mut Command, log: &Path) -> Proc {
        let f = std::fs::File::create(log).unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .spawn()
            .unwrap();
        Proc {
            child: Some(child),
            log: log.to_path_buf(),
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits up to `timeout` for the process to exit by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        let child = self.child.as_mut()?;
        while start.elapsed() < timeout {
            if let Some(st) = child.try_wait().unwrap() {
                self.child = None;
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Sends SIGTERM and waits for the exit.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("process is not running");
        terminate(&mut c)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

thread_local! {
    static STEP: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// Names the step a test is at: a failure from here on says "failed in
/// step: NAME" before its panic message (libtest runs each test on its own
/// thread, so the step is the thread's). Also printed, so `--nocapture`
/// shows a test's progress.
pub fn step(name: &str) {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            // try_with: a panic while the thread's locals are torn down
            // must not panic again here.
            let _ = STEP.try_with(|s| {
                if let Ok(s) = s.try_borrow()
                    && !s.is_empty()
                {
                    eprintln!("failed in step: {s}");
                }
            });
            previous(info)
        }));
    });
    eprintln!("step: {name}");
    STEP.with(|s| *s.borrow_mut() = name.to_string());
}

/// Polls `f` every 50 ms until it returns `Some`, or panics after `timeout`
/// stretched by this process's [`pace`] (1 on the host; the VM lane's
/// guest measures its own), saying the pace.
pub fn eventually<T>(what: &str, timeout: Duration, f: impl FnMut() -> Option<T>) -> T {
    if let Some(v) = try_eventually(timeout, f) {
        return v;
    }
    let (limit, pace) = (pace::scaled(timeout), pace::describe());
    if pace.is_empty() {
        panic!("{what} did not happen within {limit:?}");
    }
    panic!("{what} did not happen within {limit:?} ({timeout:?} at the host's speed; {pace})");
}

/// [`eventually`], returning None at the timeout (for a test that says
/// more than that before it fails).
pub fn try_eventually<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let start = Instant::now();
    let limit = pace::scaled(timeout);
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if start.elapsed() >= limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A WireGuard key pair (private, public), base64, from `wg genkey` and
/// `wg pubkey`.
pub fn wg_keypair() -> (String, String) {
    let k = netns::must(Command::new("wg").arg("genkey").output().unwrap(), "wg genkey").stdout;
    let mut c = Command::new("wg")
        .arg("pubkey")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    c.stdin.take().unwrap().write_all(&k).unwrap();
    let p = c.wait_with_output().unwrap().stdout;
    (
        String::from_utf8(k).unwrap().trim().to_string(),
        String::from_utf8(p).unwrap().trim().to_string(),
    )
}
