//! `weftctl ui` and a real browser on a lab host that has only a loopback:
//! Debian's headless Chromium, driven through chromedriver (WebDriver, with
//! fantoccini). Nothing the browser does can leave that host. Used by the
//! UI's end-to-end test and its benchmark (`weft-ui-bench`).

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder};

use crate::netns::Lab;
use crate::{bin, eventually, require_tool};

/// Where `weftctl ui` listens on the browser's host.
pub const UI_PORT: u16 = 8088;
const DRIVER_PORT: u16 = 9515;

/// The sockets process `pid` listens on: TCP in LISTEN, bound UDP and
/// listening unix sockets, as "tcp 0100007F:1F90" and the like.
pub fn listening(pid: u32) -> BTreeSet<String> {
    let inodes: BTreeSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    let mut out = BTreeSet::new();
    for (proto, listen_state) in [("tcp", "0A"), ("tcp6", "0A"), ("udp", "07"), ("udp6", "07")] {
        let table = std::fs::read_to_string(format!("/proc/{pid}/net/{proto}")).unwrap();
        for f in table.lines().skip(1).map(|l| l.split_whitespace().collect::<Vec<_>>()) {
            if f.len() > 9 && f[3] == listen_state && inodes.contains(f[9]) {
                out.insert(format!("{proto} {}", f[1]));
            }
        }
    }
    // Unix: flags __SO_ACCEPTCON (00010000), the socket's path last.
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/unix")).unwrap();
    for f in table.lines().skip(1).map(|l| l.split_whitespace().collect::<Vec<_>>()) {
        if f.len() > 7 && f[3] == "00010000" && inodes.contains(f[6]) {
            out.insert(format!("unix {}", f[7]));
        }
    }
    out
}

/// One plain HTTP/1.1 GET to `weftctl ui` (from the browser's host): the
/// status code and the whole answer.
pub fn get(path: &str, host: &str) -> (u16, String) {
    let mut c = std::net::TcpStream::connect(("127.0.0.1", UI_PORT)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(c, "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").unwrap();
    let mut r = String::new();
    c.read_to_string(&mut r).unwrap();
    let code = r.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (code, r)
}

/// Chromium and chromedriver, as installed (the README's test command
/// installs them); a test calls this first, before it builds a lab.
pub fn tools() -> (PathBuf, PathBuf) {
    let chromium = require_tool("chromium").unwrap();
    (chromium, require_tool("chromedriver").unwrap())
}

/// The browser's host: `weftctl ui` on a controller, and chromedriver.
pub struct Host {
    pub ns: String,
    /// The link `weftctl ui` printed.
    pub url: String,
    profile: PathBuf,
    chromium: PathBuf,
}

impl Host {
    /// A new lab host `name` with only a loopback, `weftctl ui` on the
    /// controller at `target` and chromedriver in it; logs under `dir`.
    pub fn start(lab: &mut Lab, name: &str, target: &str, dir: &Path) -> Host {
        let (chromium, driver) = tools();
        let ns = lab.host(name);
        let log = dir.join(format!("{name}-weftctl-ui.log"));
        let listen = format!("127.0.0.1:{UI_PORT}");
        lab.spawn(
            &ns,
            &bin("weftctl"),
            &["--controller", target, "ui", "--no-open", "--listen", &listen],
            &log,
        );
        let url = eventually("weftctl ui's link", Duration::from_secs(20), || {
            let text = std::fs::read_to_string(&log).ok()?;
            text.lines()
                .find_map(|l| l.trim().strip_prefix("http://").map(|u| format!("http://{u}")))
        });
        // chromedriver and every browser process in a PID namespace of
        // their own: when the lab ends chromedriver, the browser ends too.
        lab.spawn(
            &ns,
            Path::new("/usr/bin/unshare"),
            &[
                "--pid",
                "--fork",
                "--kill-child",
                &driver.display().to_string(),
                &format!("--port={DRIVER_PORT}"),
            ],
            &dir.join(format!("{name}-chromedriver.log")),
        );
        Host {
            ns,
            url,
            profile: dir.join(format!("{name}-chromium-profile")),
            chromium,
        }
    }

    /// Runs `f` on a thread inside the browser's host, with a runtime of
    /// its own, given a new browser session.
    pub fn drive<T, F, Fut>(&self, f: F) -> T
    where
        T: Send + 'static,
        F: FnOnce(Client) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = T>,
    {
        let path = format!("/run/netns/{}", self.ns);
        let (profile, chromium) = (self.profile.clone(), self.chromium.clone());
        std::thread::spawn(move || {
            let fd = std::fs::File::open(&path).unwrap();
            nix::sched::setns(fd, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let b = session(&chromium, &profile).await;
                f(b).await
            })
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    }
}

/// A browser session from chromedriver: headless Chromium with nothing of
/// its own going out (no updates, no sync, no first-run pages).
async fn session(chromium: &Path, profile: &Path) -> Client {
    let caps = serde_json::json!({
        "goog:chromeOptions": {
            "binary": chromium,
            "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-extensions",
                "--window-size=1280,800", format!("--user-data-dir={}", profile.display()),
            ]
        }
    });
    let caps: fantoccini::wd::Capabilities = caps.as_object().unwrap().clone();
    let mut last = String::new();
    // chromedriver takes a moment to listen.
    for _ in 0..150 {
        match ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps.clone())
            .connect(&format!("http://127.0.0.1:{DRIVER_PORT}"))
            .await
        {
            Ok(c) => return c,
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("no browser session from chromedriver: {last}");
}

/// The attribute `attr` of the page's element at CSS `css`; None when
/// either is absent. Read in one step in the page: the live part changes
/// under a found element between two WebDriver calls.
pub async fn attr(b: &Client, css: &str, attr: &str) -> Option<String> {
    let js = "const e = document.querySelector(arguments[0]); return e ? e.getAttribute(arguments[1]) : null;";
    let v = b.execute(js, vec![css.into(), attr.into()]).await.unwrap();
    v.as_str().map(str::to_string)
}

/// The rendered text of the page's element at CSS `css`, read in one
/// step; None when it is absent.
pub async fn text(b: &Client, css: &str) -> Option<String> {
    let js = "const e = document.querySelector(arguments[0]); return e ? e.innerText : null;";
    let v = b.execute(js, vec![css.into()]).await.unwrap();
    v.as_str().map(str::to_string)
}

/// Waits (looking every 100 ms) until `f` holds, up to `limit`; how long
/// it took.
pub async fn within<F, Fut>(what: &str, limit: Duration, mut f: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t = Instant::now();
    loop {
        if f().await {
            return t.elapsed();
        }
        assert!(t.elapsed() < limit, "{what}: not shown within {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Makes the page's viewport `w`×`h` (the window's frame added).
pub async fn viewport(b: &Client, (w, h): (u32, u32)) {
    b.set_window_size(w, h).await.unwrap();
    let inner = b
        .execute("return [window.innerWidth, window.innerHeight]", vec![])
        .await
        .unwrap();
    let size = |i: usize| inner[i].as_u64().unwrap() as u32;
    b.set_window_size(2 * w - size(0), 2 * h - size(1)).await.unwrap();
    let now = b.execute("return window.innerWidth", vec![]).await.unwrap();
    assert_eq!(now.as_u64(), Some(w as u64), "the viewport's width");
}

/// A screenshot of the top of the page with a viewport of `w`×`h`, saved
/// as `dir/name`.
pub async fn screenshot(b: &Client, dir: &Path, name: &str, size: (u32, u32)) -> PathBuf {
    viewport(b, size).await;
    b.execute("window.scrollTo(0, 0)", vec![]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let png = b.screenshot().await.unwrap();
    assert!(png.starts_with(b"\x89PNG"), "a PNG screenshot");
    let p = dir.join(name);
    std::fs::write(&p, png).unwrap();
    p
}
