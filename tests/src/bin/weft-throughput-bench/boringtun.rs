//! The bench's baseline: defguard_boringtun's own device (a packet per
//! system call), which weft's gateways ran before weft's userspace device.
//! It lives here, not in weft, so that no production build links
//! boringtun's `device` feature.
//!
//! The device is created in the namespace the bench's end runs in, and its
//! interface then moved into the tunnel's namespace (as weft's devices
//! are). boringtun is driven through a UAPI socket pair (no socket file, no
//! signal handling), one worker thread per device.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::IntoRawFd;
use std::os::unix::net::UnixStream;

use defguard_boringtun::device::{DeviceConfig, DeviceHandle};
use rtnetlink::Handle;

use weft_types::{WgKey, WgSecret};

type R<T> = Result<T, String>;

pub struct Device {
    _handle: DeviceHandle,
    /// Peers as last configured (public key → the UAPI lines): boringtun
    /// cannot modify a peer in place, so a change is a remove and an add.
    peers: HashMap<String, String>,
    uapi: BufReader<UnixStream>,
}

impl Device {
    /// Sends one UAPI request; returns the response lines before `errno`.
    /// boringtun answers EIO while its worker holds the device (seen when
    /// peers change under traffic, e.g. in a failover) and then has read
    /// and dropped the whole request, so it is sent again, a few times,
    /// 10 ms apart.
    pub fn uapi(&mut self, request: &str) -> R<Vec<String>> {
        for _ in 0..20 {
            match self.uapi_once(request)? {
                Ok(lines) => return Ok(lines),
                Err(code) if code == (nix::errno::Errno::EIO as i32) => {
                    std::thread::sleep(std::time::Duration::from_millis(10))
                }
                Err(code) => return Err(format!("UAPI error {code}")),
            }
        }
        Err(format!(
            "UAPI error {} (the device stayed busy)",
            (nix::errno::Errno::EIO as i32)
        ))
    }

    /// One request: the answer's lines, or the errno it was refused with.
    fn uapi_once(&mut self, request: &str) -> R<Result<Vec<String>, i32>> {
        let s = self.uapi.get_mut();
        // One write: boringtun reads each request through a fresh buffered
        // reader and drops what it buffered when it refuses one (EIO), so
        // a request sent in two pieces could leave its tail to be read as
        // a request of its own, and the answers would no longer match.
        s.write_all(format!("{request}\n").as_bytes())
            .map_err(|e| format!("UAPI: {e}"))?;
        let mut lines = Vec::new();
        loop {
            let mut line = String::new();
            if self.uapi.read_line(&mut line).map_err(|e| format!("UAPI: {e}"))? == 0 {
                return Err("UAPI closed".into());
            }
            let line = line.trim_end().to_string();
            if line.is_empty() {
                continue;
            }
            if let Some(code) = line.strip_prefix("errno=") {
                // the blank line that ends the answer
                let mut end = String::new();
                let _ = self.uapi.read_line(&mut end);
                return Ok(match code.parse::<i32>() {
                    Ok(0) => Ok(lines),
                    Ok(c) => Err(c),
                    Err(_) => return Err(format!("UAPI: unreadable answer errno={code}")),
                });
            }
            lines.push(line);
        }
    }
}

/// The WireGuard devices this agent runs, by interface name.
#[derive(Default)]
pub struct Devices {
    pub devices: HashMap<String, Device>,
}

impl Devices {
    /// Creates the device `name` with `private_key` listening on
    /// `listen_port`, moves it into namespace `ns`, and brings it up there.
    pub async fn create(
        &mut self,
        host: &Handle,
        name: &str,
        ns: &str,
        listen_port: u32,
        mtu: u32,
        private_key: &WgSecret,
    ) -> R<()> {
        self.devices.remove(name);
        let (ours, theirs) = UnixStream::pair().map_err(|e| e.to_string())?;
        let config = DeviceConfig {
            n_threads: 1,
            // defguard_boringtun 0.7.1 opens the per-peer connected socket
            // as SOCK_STREAM/IPPROTO_UDP, which Linux refuses
            // (EPROTONOSUPPORT), and retries for every packet that arrives
            // on the listening socket: one failed socket() per received
            // packet. Everything works on the listening socket alone.
            use_connected_socket: false,
            use_multi_queue: false,
            uapi_fd: theirs.into_raw_fd(),
        };
        let handle =
            DeviceHandle::new(name, config).map_err(|e| format!("cannot create the WireGuard device {name}: {e:?}"))?;
        let mut dev = Device {
            _handle: handle,
            peers: HashMap::new(),
            uapi: BufReader::new(ours),
        };
        dev.uapi(&format!(
            "set=1\nprivate_key={}\nlisten_port={listen_port}\n",
            private_key.to_hex()
        ))?;
        if let Err(e) = grow_udp_buffers(listen_port as u16) {
            eprintln!("{name}: socket buffers left at the host default, bursts may drop: {e}");
        }
        // Move the interface into the peering's namespace.
        weft_dataplane::userspace::move_into(host, name, ns, mtu).await?;
        self.devices.insert(name.to_string(), dev);
        Ok(())
    }

    pub fn set_peer(
        &mut self,
        link: &str,
        public_key: &WgKey,
        endpoint: &str,
        allowed: &[String],
        keepalive: u32,
    ) -> R<bool> {
        let dev = self
            .devices
            .get_mut(link)
            .ok_or_else(|| format!("no WireGuard device {link} (yet)"))?;
        let key = public_key.to_hex();
        let mut lines = String::new();
        if !endpoint.is_empty() {
            lines.push_str(&format!("endpoint={endpoint}\n"));
        }
        if keepalive > 0 {
            lines.push_str(&format!("persistent_keepalive_interval={keepalive}\n"));
        }
        for a in allowed {
            lines.push_str(&format!("allowed_ip={a}\n"));
        }
        if dev.peers.get(&key) == Some(&lines) {
            return Ok(false);
        }
        // Always remove first, even a peer this map does not list: boringtun
        // aborts its worker thread (assert) when asked to add a peer it
        // already has, which a failed earlier call could leave behind.
        dev.peers.remove(&key);
        dev.uapi(&format!("set=1\npublic_key={key}\nremove=true\n"))?;
        dev.uapi(&format!("set=1\npublic_key={key}\nreplace_allowed_ips=true\n{lines}"))?;
        dev.peers.insert(key, lines);
        Ok(true)
    }
}

/// Receive and send buffer of the tunnel's UDP sockets: what wireguard-go
/// asks for (7 MiB). The host default (~208 KiB) overflows under a burst
/// while the single worker decrypts and forwards, and every drop there is
/// a TCP retransmission for the workloads (measured: ~15 % of the packets
/// of one iperf3 stream).
const TUNNEL_SOCKET_BUFFER: usize = 7 << 20;

/// The inodes of this namespace's UDP sockets bound to `port`
/// (/proc/net/udp and udp6: "sl local_address rem_address st ... inode").
fn udp_inodes(port: u16) -> Vec<u64> {
    let mut out = Vec::new();
    for table in ["/proc/self/net/udp", "/proc/self/net/udp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let bound = f
                .get(1)
                .and_then(|a| a.rsplit_once(':'))
                .and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
            if bound == Some(port)
                && let Some(inode) = f.get(9).and_then(|i| i.parse().ok())
            {
                out.push(inode);
            }
        }
    }
    out
}

/// Raises the buffers of the UDP sockets this process holds on `port` (the
/// userspace WireGuard device's, which boringtun does not size) with
/// SO_RCVBUFFORCE/SO_SNDBUFFORCE, which need CAP_NET_ADMIN but leave the
/// host's defaults and limits alone.
#[allow(unsafe_code)]
fn grow_udp_buffers(port: u16) -> Result<(), String> {
    use nix::sys::socket::{setsockopt, sockopt};
    use std::os::fd::BorrowedFd;
    let inodes = udp_inodes(port);
    let mut grown = 0;
    for entry in std::fs::read_dir("/proc/self/fd").map_err(|e| format!("/proc/self/fd: {e}"))? {
        let Ok(entry) = entry else { continue };
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        let target = target.to_string_lossy();
        let Some(inode) = target
            .strip_prefix("socket:[")
            .and_then(|t| t.strip_suffix(']'))
            .and_then(|i| i.parse::<u64>().ok())
        else {
            continue;
        };
        if !inodes.contains(&inode) {
            continue;
        }
        let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        // SAFETY: the fd is one of this process's open sockets (just read
        // from /proc/self/fd), owned by the WireGuard device, which stays
        // alive for this call; it is only borrowed for two setsockopts.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        setsockopt(&fd, sockopt::RcvBufForce, &TUNNEL_SOCKET_BUFFER).map_err(|e| format!("SO_RCVBUFFORCE: {e}"))?;
        setsockopt(&fd, sockopt::SndBufForce, &TUNNEL_SOCKET_BUFFER).map_err(|e| format!("SO_SNDBUFFORCE: {e}"))?;
        grown += 1;
    }
    if grown == 0 {
        return Err(format!("no UDP socket of this process is bound to port {port}"));
    }
    Ok(())
}
