//! The VM lane: runs a shell script inside Debian's stock kernel under QEMU,
//! where this machine's kernel lacks a feature (kernel WireGuard, Geneve).
//!
//! One place does it all: finds the installed distribution kernel
//! (`linux-image-amd64`, installed by `deploy/setup.sh`), builds a small
//! initramfs (static busybox and only the modules weft needs, with their
//! dependencies; built once per kernel and cached beside the binaries),
//! boots it with TCG, and runs the script in a chroot of the host's whole
//! tree, shared read-only over 9p — the binaries the host built included.
//! The guest caches that tree (`cache=loose`: it is read-only and does not
//! change during a run); without it every page of the large debug binaries
//! each `weftctl` or agent start touches crossed 9p again, and a scenario
//! took four times as long (the `kernel` one 424 s against 105 s).
//! A second, writable 9p share carries the script in and the exit status
//! out; the guest's console is the output. A time limit ends a guest that
//! hangs.
//!
//! Inside the guest the chroot looks like a booted distribution: proc,
//! sysfs, devtmpfs, devpts, tmpfs on /tmp, /run and /dev/shm, /dev/std*
//! links, a host name. See ../shared/recipes.md ("A stock distribution
//! kernel in a VM") for why each piece is there.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Modules loaded at boot; the rest of netfilter's are in the initramfs
/// and load on demand (the kernel calls the initramfs's modprobe).
const PRELOAD: &[&str] = &[
    "virtio_pci",
    "9pnet_virtio",
    "9p",
    "wireguard",
    "geneve",
    "vxlan",
    "veth",
    "bridge",
    "tun",
    "nf_tables",
    "nft_chain_nat",
    "nft_nat",
    "nft_masq",
    "nft_ct",
    "nf_conntrack",
    "nf_nat",
    "nfnetlink",
];

/// Folders of the module tree copied whole (with dependencies).
const WHOLE_DIRS: &[&str] = &["kernel/net/netfilter", "kernel/net/ipv4/netfilter"];

/// A distribution kernel installed on this machine.
#[derive(Clone, Debug)]
pub struct Kernel {
    pub version: String,
    pub vmlinuz: PathBuf,
}

/// The newest installed kernel that has the WireGuard and Geneve modules,
/// or why there is none.
pub fn kernel() -> Result<Kernel, String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/lib/modules").map_err(|e| format!("/lib/modules: {e}"))? {
        let version = e.map_err(|e| e.to_string())?.file_name().to_string_lossy().to_string();
        let m = Path::new("/lib/modules").join(&version);
        let vmlinuz = PathBuf::from(format!("/boot/vmlinuz-{version}"));
        let has = |p: &str| m.join(p).exists();
        if vmlinuz.is_file() && has("kernel/drivers/net/wireguard/wireguard.ko") && has("kernel/drivers/net/geneve.ko")
        {
            found.push(Kernel { version, vmlinuz });
        }
    }
    found.sort_by(|a, b| a.version.cmp(&b.version));
    found.pop().ok_or_else(|| {
        "no distribution kernel with WireGuard and Geneve modules under /boot and /lib/modules: \
         run deploy/setup.sh (installs linux-image-amd64)"
            .to_string()
    })
}

/// What the lane needs besides the kernel, or what is missing.
pub fn tools() -> Result<(), String> {
    for t in ["qemu-system-x86_64", "busybox", "cpio", "gzip", "modprobe"] {
        if crate::require_tool(t).is_none() && !Path::new(&format!("/bin/{t}")).exists() {
            return Err(format!(
                "{t} is missing: run deploy/setup.sh (qemu-system-x86, busybox-static)"
            ));
        }
    }
    Ok(())
}

/// The module files (relative to the kernel's module folder) to put in
/// the initramfs: the preloaded ones, the whole folders, and every
/// dependency of each.
fn module_files(k: &Kernel) -> Result<Vec<String>, String> {
    let root = PathBuf::from(format!("/lib/modules/{}", k.version));
    let mut names: Vec<String> = PRELOAD.iter().map(|s| s.to_string()).collect();
    for d in WHOLE_DIRS {
        for e in std::fs::read_dir(root.join(d)).map_err(|e| format!("{d}: {e}"))? {
            let n = e.map_err(|e| e.to_string())?.file_name().to_string_lossy().to_string();
            if let Some(m) = n.strip_suffix(".ko") {
                names.push(m.to_string());
            }
        }
    }
    let mut files = std::collections::BTreeSet::new();
    for n in &names {
        let o = Command::new("modprobe")
            .args(["-S", &k.version, "--show-depends", n])
            .output()
            .map_err(|e| format!("modprobe: {e}"))?;
        if !o.status.success() {
            return Err(format!(
                "modprobe --show-depends {n}: {}",
                String::from_utf8_lossy(&o.stderr)
            ));
        }
        for line in String::from_utf8_lossy(&o.stdout).lines() {
            if let Some(path) = line.strip_prefix("insmod ") {
                let path = path.split_whitespace().next().unwrap_or_default();
                if let Ok(rel) = Path::new(path).strip_prefix(&root) {
                    files.insert(rel.to_string_lossy().to_string());
                }
            }
        }
    }
    Ok(files.into_iter().collect())
}

/// The guest's /init. The workspace's binaries (`bin`) come over a share
/// of their own, mounted at their own path: the host's tree is shared too,
/// but the guest puts tmpfs over /tmp and /run, where a checkout (and its
/// target dir) may well live.
fn init_script(bin: &Path) -> String {
    format!(
        r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
echo /bin/modprobe > /proc/sys/kernel/modprobe
for m in {preload}; do modprobe $m || echo "weft-vm: cannot load $m"; done
mkdir -p /host
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose hostroot /host || echo "weft-vm: no host tree"
mount -t proc proc /host/proc
mount -t sysfs sysfs /host/sys
mount -t devtmpfs devtmpfs /host/dev
mkdir -p /host/dev/pts /host/dev/shm
mount -t devpts devpts /host/dev/pts
mount -t tmpfs tmpfs /host/dev/shm
mount -t tmpfs tmpfs /host/tmp
mount -t tmpfs tmpfs /host/run
mkdir -p '/host{bin}'
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose weftbin '/host{bin}' || echo "weft-vm: no binaries"
ln -sf /proc/self/fd /host/dev/fd
ln -sf /proc/self/fd/0 /host/dev/stdin
ln -sf /proc/self/fd/1 /host/dev/stdout
ln -sf /proc/self/fd/2 /host/dev/stderr
mkdir -p /host/run/netns /host/tmp/weftio
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 weftio /host/tmp/weftio || echo "weft-vm: no io share"
hostname weft-vm
echo "weft-vm: running"
chroot /host /bin/sh /tmp/weftio/run.sh
echo $? > /host/tmp/weftio/status
sync
poweroff -f
"#,
        preload = PRELOAD.join(" "),
        bin = bin.display()
    )
}

/// The initramfs for kernel `k`, built once and kept beside the binaries
/// (rebuilt when what goes in it changes).
pub fn initramfs(k: &Kernel) -> Result<PathBuf, String> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _held = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let files = module_files(k)?;
    let init = init_script(&crate::bin_dir());
    let tag = {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(init.as_bytes());
        h.update(files.join("\n").as_bytes());
        h.update(k.version.as_bytes());
        format!("{:x}", h.finalize())[..12].to_string()
    };
    let dir = crate::bin_dir().join("weft-vm");
    let out = dir.join(format!("initrd-{}-{tag}.gz", k.version));
    if out.is_file() {
        return Ok(out);
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let stage = tempfile::Builder::new()
        .prefix("weft-initrd")
        .tempdir()
        .map_err(|e| e.to_string())?;
    let s = stage.path();
    let src = PathBuf::from(format!("/lib/modules/{}", k.version));
    let dst = s.join(format!("lib/modules/{}", k.version));
    for d in ["bin", "proc", "sys", "dev", "host"] {
        std::fs::create_dir_all(s.join(d)).map_err(|e| e.to_string())?;
    }
    let busybox = crate::require_tool("busybox").unwrap_or_else(|| PathBuf::from("/bin/busybox"));
    std::fs::copy(&busybox, s.join("bin/busybox")).map_err(|e| format!("busybox: {e}"))?;
    for f in files.iter().map(String::as_str).chain([
        "modules.dep",
        "modules.alias",
        "modules.builtin",
        "modules.order",
        "modules.symbols",
    ]) {
        let to = dst.join(f);
        std::fs::create_dir_all(to.parent().unwrap()).map_err(|e| e.to_string())?;
        if src.join(f).exists() {
            std::fs::copy(src.join(f), &to).map_err(|e| format!("{f}: {e}"))?;
        }
    }
    std::fs::write(s.join("init"), init).map_err(|e| e.to_string())?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(s.join("init"), std::fs::Permissions::from_mode(0o755)).map_err(|e| e.to_string())?;
    let partial = dir.join(format!(".initrd-{tag}.{}", std::process::id()));
    let o = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "find . | cpio -o -H newc --quiet | gzip -1 > '{}'",
            partial.display()
        ))
        .current_dir(s)
        .output()
        .map_err(|e| e.to_string())?;
    if !o.status.success() {
        let _ = std::fs::remove_file(&partial);
        return Err(format!("cpio: {}", String::from_utf8_lossy(&o.stderr)));
    }
    std::fs::rename(&partial, &out).map_err(|e| e.to_string())?;
    Ok(out)
}

/// How a guest run ended.
#[derive(Debug)]
pub struct Outcome {
    /// The guest's console: the kernel's few lines and the script's output.
    pub console: String,
    /// The script's exit status; None when the guest never reported one
    /// (it hung past the limit, or crashed).
    pub status: Option<i32>,
    pub timed_out: bool,
    pub elapsed: Duration,
    /// The time limit the guest had: the one asked for, stretched by the
    /// pace the guest measured.
    pub limit: Duration,
    /// Files the script left in `/tmp/weftio/logs` (name, content), such
    /// as a failed scenario's lab logs.
    pub logs: Vec<(String, String)>,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        self.status == Some(0)
    }
}

/// Boots the distribution kernel and runs `script` (sh) as root inside the
/// chroot of the host's tree; waits at most `limit`. Guests run one at a
/// time (the machine has two cores; TCG uses both). The script finds the
/// host's time for the pace's calibration in `WEFT_HOST_CALIBRATION_US`
/// (see [`crate::pace`]).
pub fn run(script: &str, limit: Duration) -> Result<Outcome, String> {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    tools()?;
    let k = kernel()?;
    let initrd = initramfs(&k)?;
    let _held = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // The host's time for the pace's calibration, taken now (under what
    // else loads the host now) for the guest to compare its own with.
    let host = crate::pace::calibrate();
    let io = tempfile::Builder::new()
        .prefix("weft-vm-io")
        .tempdir()
        .map_err(|e| e.to_string())?;
    std::fs::write(
        io.path().join("run.sh"),
        format!(
            "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/tmp TMPDIR=/tmp RUST_BACKTRACE=1 WEFT_IN_VM=1 \
             WEFT_HOST_CALIBRATION_US={}\n\
             cd /tmp\n{script}\n",
            host.as_micros()
        ),
    )
    .map_err(|e| e.to_string())?;
    let console_path = io.path().join("console.log");
    let console = std::fs::File::create(&console_path).map_err(|e| e.to_string())?;
    let started = Instant::now();
    let mut child = Command::new("qemu-system-x86_64")
        .args(["-accel", "tcg,thread=multi", "-cpu", "max", "-m", "2048", "-smp", "2"])
        .arg("-kernel")
        .arg(&k.vmlinuz)
        .arg("-initrd")
        .arg(&initrd)
        .args(["-append", "console=ttyS0 quiet panic=-1"])
        .args(["-nographic", "-no-reboot", "-nic", "none"])
        .arg("-virtfs")
        .arg("local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap")
        .arg("-virtfs")
        .arg(format!(
            "local,path={},mount_tag=weftio,security_model=none",
            io.path().display()
        ))
        .arg("-virtfs")
        .arg(format!(
            "local,path={},mount_tag=weftbin,security_model=none,readonly=on",
            crate::bin_dir().display()
        ))
        .stdin(Stdio::null())
        .stdout(console.try_clone().map_err(|e| e.to_string())?)
        .stderr(console)
        .spawn()
        .map_err(|e| format!("qemu-system-x86_64: {e}"))?;
    let mut timed_out = false;
    // A guest that measured itself slow (it leaves its stretch in the io
    // share, see weft_tests::pace) gets that much longer.
    let mut limit = limit;
    let mut stretched = false;
    loop {
        if !stretched
            && let Some(f) = std::fs::read_to_string(io.path().join("pace"))
                .ok()
                .and_then(|t| t.trim().parse::<f64>().ok())
                .filter(|f| f.is_finite() && *f >= 1.0)
        {
            limit = limit.mul_f64(f);
            stretched = true;
        }
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if started.elapsed() > limit => {
                timed_out = true;
                let _ = child.kill();
                let _ = child.wait();
                break;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(200)),
            Err(e) => return Err(e.to_string()),
        }
    }
    let console = std::fs::read_to_string(&console_path).unwrap_or_default();
    let status = std::fs::read_to_string(io.path().join("status"))
        .ok()
        .and_then(|s| s.trim().parse().ok());
    let mut logs = Vec::new();
    for e in std::fs::read_dir(io.path().join("logs"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        logs.push((e.file_name().to_string_lossy().to_string(), text));
    }
    logs.sort();
    Ok(Outcome {
        console,
        status,
        timed_out,
        elapsed: started.elapsed(),
        limit,
        logs,
    })
}
