//! Real hosts for the real-hosts lane: Debian userlands booted by systemd
//! in `systemd-nspawn` containers, each on a lab namespace as its network,
//! with weft installed from its Debian packages.
//!
//! One root filesystem, made by `debootstrap` from the machine's Debian
//! mirror and kept under /var/tmp (keyed by what it holds), serves every
//! host: each boots it read-only under a tmpfs overlay of its own
//! (`--volatile=overlay`), so nothing a host writes outlives it. Dropping a
//! [`Host`] halts it (SIGTERM to nspawn) and, if it has not stopped in
//! 20 s, kills it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::netns::must;
use crate::{run, stdout};

/// The Debian release of the hosts (this machine's).
const SUITE: &str = "bookworm";
/// What the hosts have besides debootstrap's minimal base: systemd, what
/// weft's packages depend on, and what the guide's commands use (`sysctl`).
const INCLUDE: &[&str] = &[
    "systemd",
    "systemd-sysv",
    "dbus",
    "iproute2",
    "nftables",
    "conntrack",
    "iputils-ping",
    "iputils-arping",
    "adduser",
    "procps",
];

/// The hosts' root filesystem: made once by debootstrap (about a minute
/// and 260 MB), then reused while [`INCLUDE`] is unchanged. Made under a
/// temporary name and renamed when complete, so an interrupted run leaves
/// nothing that looks usable.
pub fn rootfs() -> PathBuf {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(format!("{SUITE} {INCLUDE:?}").as_bytes());
    let key: String = digest[..6].iter().map(|b| format!("{b:02x}")).collect();
    let dir = PathBuf::from(format!("/var/tmp/weft-hosts-root-{key}"));
    if dir.join("usr/lib/systemd/systemd").exists() {
        return dir;
    }
    let tmp = PathBuf::from(format!("/var/tmp/weft-hosts-root-{key}.part-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let started = Instant::now();
    let o = run(Command::new("debootstrap")
        .args(["--variant=minbase", &format!("--include={}", INCLUDE.join(","))])
        .arg(SUITE)
        .arg(&tmp)
        .arg(mirror()));
    if !o.status.success() {
        let _ = std::fs::remove_dir_all(&tmp);
        panic!(
            "debootstrap failed: {}\n{}",
            String::from_utf8_lossy(&o.stderr),
            stdout(&o).lines().rev().take(20).collect::<Vec<_>>().join("\n")
        );
    }
    // The lab's hosts: apt answers yes (the guide's `apt install` as a
    // person runs it), and no getty waits on a console nobody reads.
    std::fs::write(
        tmp.join("etc/apt/apt.conf.d/90weft-lab"),
        "APT::Get::Assume-Yes \"true\";\n",
    )
    .unwrap();
    let _ = std::fs::remove_file(tmp.join("etc/systemd/system/getty.target.wants/getty@tty1.service"));
    std::fs::rename(&tmp, &dir).unwrap();
    eprintln!(
        "hosts: made the root filesystem {} in {:?}",
        dir.display(),
        started.elapsed()
    );
    dir
}

/// The machine's Debian mirror (the first source of its apt sources whose
/// path is `/debian`), else Debian's own.
fn mirror() -> String {
    let mut texts = Vec::new();
    if let Ok(d) = std::fs::read_dir("/etc/apt/sources.list.d") {
        for e in d.flatten() {
            texts.push(std::fs::read_to_string(e.path()).unwrap_or_default());
        }
    }
    texts.push(std::fs::read_to_string("/etc/apt/sources.list").unwrap_or_default());
    for t in &texts {
        for l in t.lines() {
            let l = l.trim();
            let uri = l.strip_prefix("URIs:").map(str::trim).or_else(|| {
                l.strip_prefix("deb ")
                    .and_then(|r| r.split_whitespace().find(|w| w.contains("://")))
            });
            // Debian's archive itself: not its security archive, not a
            // third party's (nodesource and such).
            if let Some(u) = uri.and_then(|u| u.split_whitespace().next())
                && u.trim_end_matches('/').ends_with("/debian")
            {
                return u.to_string();
            }
        }
    }
    "http://deb.debian.org/debian".into()
}

/// A Debian host booted by systemd in a container whose network is the lab
/// namespace `netns`.
pub struct Host {
    pub name: String,
    pub netns: String,
    nspawn: Option<Child>,
    /// The container's PID 1 (systemd), as this machine sees it.
    leader: u32,
    pub log: PathBuf,
}

impl Host {
    /// Boots `root` as host `name` on lab namespace `netns`, with the host
    /// directory `share` read-only at /srv/weft, and waits until systemd
    /// says the system is up.
    pub fn boot(root: &Path, name: &str, netns: &str, share: &Path, log: &Path) -> Host {
        let f = std::fs::File::create(log).unwrap();
        let child = Command::new("systemd-nspawn")
            // A host's root may change its network's sysctls (the guide
            // turns on forwarding); nspawn mounts /proc/sys read-only
            // unless told.
            .env("SYSTEMD_NSPAWN_API_VFS_WRITABLE", "network")
            .args(["-D"])
            .arg(root)
            .args([
                "--register=no",
                "--keep-unit",
                "--volatile=overlay",
                "--console=passive",
                "--quiet",
                // nspawn keeps CAP_NET_ADMIN from containers on a network it
                // did not make; a host's root has it.
                "--capability=CAP_NET_ADMIN",
                &format!("--machine={name}"),
                &format!("--hostname={name}"),
                &format!("--network-namespace-path=/run/netns/{netns}"),
                &format!("--bind-ro={}:/srv/weft", share.display()),
                // A userspace WireGuard gateway needs TUN.
                "--bind=/dev/net/tun",
                "-b",
            ])
            .stdin(Stdio::null())
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start systemd-nspawn: {e}"));
        let mut host = Host {
            name: name.into(),
            netns: netns.into(),
            leader: 0,
            nspawn: Some(child),
            log: log.into(),
        };
        let pid = host.nspawn.as_ref().unwrap().id();
        let leader = crate::try_eventually(Duration::from_secs(30), || container_init(pid));
        match leader {
            Some(l) => host.leader = l,
            None => {
                // Not a Host yet: its drop must not signal a PID it never had.
                let mut child = host.nspawn.take().unwrap();
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "systemd-nspawn did not start {name}'s systemd within 30 s:\n{}",
                    std::fs::read_to_string(log).unwrap_or_default()
                );
            }
        }
        host
    }

    /// Waits until systemd has started everything ("running", or
    /// "degraded" where a unit that containers cannot run failed).
    pub fn until_up(&self) {
        let up = crate::try_eventually(Duration::from_secs(90), || {
            let s = stdout(&self.sh("systemctl is-system-running || true"));
            matches!(s.trim(), "running" | "degraded").then_some(())
        });
        if up.is_none() {
            panic!(
                "{} did not boot within 90 s ({}); its jobs:\n{}\nits console:\n{}",
                self.name,
                crate::pace::describe(),
                stdout(&self.sh("systemctl list-jobs --no-pager || true")),
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }

    /// Runs `script` with /bin/sh -e on the host, as root in
    /// /srv/weft, with a clean environment.
    pub fn sh(&self, script: &str) -> Output {
        run(Command::new("nsenter")
            .args(["-a", "-t", &self.leader.to_string()])
            .args([
                "env",
                "-i",
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "HOME=/root",
                "LANG=C.UTF-8",
                "TERM=dumb",
                "/bin/sh",
                "-ec",
            ])
            .arg(format!("cd /srv/weft\n{script}")))
    }

    /// [`Host::sh`], panicking with its output when it fails; its stdout.
    pub fn must(&self, script: &str) -> String {
        let o = self.sh(script);
        assert!(
            o.status.success(),
            "on {}: `{}` failed ({}):\n{}\n{}",
            self.name,
            script.trim(),
            o.status,
            stdout(&o),
            String::from_utf8_lossy(&o.stderr)
        );
        stdout(&o)
    }

    /// The journal of `unit` on this host (for failure messages).
    pub fn journal(&self, unit: &str) -> String {
        stdout(&self.sh(&format!("journalctl -q --no-pager -n 60 -u {unit} || true")))
    }
}

/// The container's init among the descendants of nspawn `pid`: the process
/// that is PID 1 in its own PID namespace. (nspawn's first child is a short
/// lived intermediate; taking it would address a process that is gone.)
fn container_init(pid: u32) -> Option<u32> {
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        let status = std::fs::read_to_string(format!("/proc/{p}/status")).ok()?;
        let nspid = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
        let ids: Vec<&str> = nspid.split_whitespace().collect();
        if p != pid && ids.len() > 1 && ids.last() == Some(&"1") {
            return Some(p);
        }
        for task in std::fs::read_dir(format!("/proc/{p}/task")).ok()?.flatten() {
            let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            todo.extend(children.split_whitespace().filter_map(|c| c.parse::<u32>().ok()));
        }
    }
    None
}

impl Drop for Host {
    fn drop(&mut self) {
        let Some(mut child) = self.nspawn.take() else { return };
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let end = Instant::now() + Duration::from_secs(20);
        while Instant::now() < end {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // Killing the container's PID 1 ends every process of its PID
        // namespace (0 would be this process group: never).
        if self.leader > 1 {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.leader as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// The shell blocks of a Markdown guide whose info string is `sh LABEL`, by
/// label, in order.
pub fn guide_blocks(markdown: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut current: Option<(String, String)> = None;
    for line in markdown.lines() {
        let t = line.trim_start();
        match &mut current {
            None => {
                if let Some(label) = t.strip_prefix("```sh ") {
                    current = Some((label.trim().to_string(), String::new()));
                }
            }
            Some((label, body)) => {
                if t.starts_with("```") {
                    out.push((std::mem::take(label), std::mem::take(body)));
                    current = None;
                } else {
                    body.push_str(t);
                    body.push('\n');
                }
            }
        }
    }
    out
}

/// The one block labelled `label`.
pub fn guide_block<'a>(blocks: &'a [(String, String)], label: &str) -> &'a str {
    let found: Vec<&(String, String)> = blocks.iter().filter(|(l, _)| l == label).collect();
    assert_eq!(
        found.len(),
        1,
        "deploy/README.md should have one ```sh {label} block, has {}",
        found.len()
    );
    &found[0].1
}

/// The variable names a `vars` block sets (`NAME=value  # comment`).
pub fn guide_vars(block: &str) -> Vec<String> {
    block
        .lines()
        .filter_map(|l| l.split_once('=').map(|(n, _)| n.trim().to_string()))
        .filter(|n| !n.is_empty() && !n.starts_with('#'))
        .collect()
}

/// `export NAME='value'` lines for `vars`.
pub fn exports(vars: &[(&str, String)]) -> String {
    vars.iter().map(|(n, v)| format!("export {n}='{v}'\n")).collect()
}

/// Checks the packages are where `deploy/package.sh` puts them, and
/// returns their directory.
pub fn packages() -> PathBuf {
    // target/debug/deps/<test> -> target/debian
    let dir = std::env::var_os("WEFT_DEB_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::bin_dir().parent().unwrap().join("debian"));
    for p in ["weft-controller_", "weft-agent_"] {
        let found = std::fs::read_dir(&dir)
            .map(|d| d.flatten().any(|e| e.file_name().to_string_lossy().starts_with(p)))
            .unwrap_or(false);
        assert!(
            found,
            "NOT RUN: no {p}*.deb in {}; build the packages first (deploy/package.sh --profile dev --no-build; tests/run.sh does)",
            dir.display()
        );
    }
    dir
}

/// What a host keeps of weft's after its packages are removed: links,
/// rules, routes, nftables tables and namespaces that are weft's. Empty
/// when it is clean.
pub fn leftovers(host: &Host) -> String {
    let mut found = String::new();
    for (cmd, what) in [
        ("ip -br link", "weft"),
        ("ip rule", "7765"),
        ("ip route show table all", "7765"),
        ("ip route show table all", "weft"),
        ("nft list tables", "weft"),
        ("ip netns list", "weft"),
    ] {
        // The host's own namespaces are under its /run/netns; the rest is
        // seen from outside, in its network namespace.
        let text = if cmd.starts_with("ip netns") {
            host.must(cmd)
        } else {
            stdout(&must(
                run(Command::new("ip").args(["netns", "exec", &host.netns, "sh", "-c", cmd])),
                cmd,
            ))
        };
        if text.contains(what) {
            found.push_str(&format!("`{cmd}` shows {what}:\n{text}\n"));
        }
    }
    found
}
