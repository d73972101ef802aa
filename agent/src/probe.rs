//! Health probes through each peering's tunnel.
//!
//! Both ends of a tunnel own one address of a fixed link-local pair on their
//! WireGuard interface (the controller renders which end has which, by the
//! peering's tunnel role; every peering has its own namespace, so the pair
//! repeats without clashing). The gateway sends an ICMP echo request to the
//! far end's address every interval from inside the peering's namespace; the
//! far end's kernel answers, so a probe tests exactly the encrypted path:
//! both WireGuard ends, the keys, the endpoints and the underlay between
//! them, and not the far agent's process. A tunnel is up after one answer
//! and down after `misses` probes in a row went unanswered.
//!
//! The probe uses an ICMP datagram ("ping") socket, enabled for the agent's
//! group in the peering's namespace only, so no raw socket and no header
//! parsing are needed: the kernel fills in the identifier and checksum and
//! hands back only this socket's replies.

use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

/// Probe interval and the misses in a row after which a tunnel is down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeConfig {
    pub interval: Duration,
    pub misses: u32,
}

impl Default for ProbeConfig {
    fn default() -> Self {
        ProbeConfig {
            interval: Duration::from_secs(1),
            misses: 3,
        }
    }
}

/// What the probes of one tunnel have seen.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Health {
    /// Packets through the tunnel interface (received, sent).
    pub packets: (u64, u64),
    /// The latest path-MTU check, if one ran.
    pub path_mtu: Option<weft_proto::v1::PathMtuCheck>,
    pub up: bool,
    /// Round-trip time of the latest answered probe.
    pub rtt: Option<Duration>,
    pub sent: u64,
    pub lost: u64,
    /// Unanswered probes since the last answer.
    pub misses_in_row: u32,
    /// Packets from the tunnel the peering's namespace dropped (its nft
    /// counter, read every [`DROPS_EVERY`] probes), since the prober
    /// started.
    pub dropped: Total,
    /// Packets from the tunnel the export policy refused (its nft counter,
    /// read with the other), since the prober started.
    pub refused: Total,
    /// Packets from the tunnel forwarded onward to another peer (transit;
    /// its nft counters, read with the others), by site.
    pub transit: std::collections::BTreeMap<String, Total>,
}

/// A running total of an nft counter that starts over whenever its table
/// is written anew (a policy change rewrites it; the table's handle then
/// changes): what was counted before a rewrite is kept (less what came
/// between the last reading and the rewrite).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Total {
    before: u64,
    last: u64,
    table: Option<u64>,
}

impl Total {
    /// Takes in a reading `now` of the counter in the table of handle
    /// `table`.
    pub fn read(&mut self, now: u64, table: u64) {
        if self.table.is_some_and(|t| t != table) || now < self.last {
            self.before += self.last;
        }
        self.table = Some(table);
        self.last = now;
    }

    pub fn get(&self) -> u64 {
        self.before + self.last
    }
}

/// How many probes go between two readings of the drop counter (each runs
/// `nft` in the peering's namespace: not cheap on a slow host, and the
/// count is for the admin, not for failover).
const DROPS_EVERY: u64 = 30;

impl Health {
    /// Records one probe's outcome; returns whether up/down changed.
    pub fn record(&mut self, rtt: Option<Duration>, misses_allowed: u32) -> bool {
        let was = self.up;
        self.sent += 1;
        match rtt {
            Some(r) => {
                self.rtt = Some(r);
                self.misses_in_row = 0;
                self.up = true;
            }
            None => {
                self.lost += 1;
                self.misses_in_row += 1;
                if self.misses_in_row >= misses_allowed.max(1) {
                    self.up = false;
                }
            }
        }
        was != self.up
    }
}

/// Wakes a prober to probe at once.
#[derive(Default)]
struct Kick {
    now: Mutex<bool>,
    cv: std::sync::Condvar,
}

/// A running prober; stops (and its thread ends) when dropped.
pub struct Prober {
    stop: Arc<AtomicBool>,
    /// The peer's endpoint address (as WireGuard last saw it), which the
    /// path-MTU check sends to.
    pub mtu_target: Arc<Mutex<Option<IpAddr>>>,
    kick: Arc<Kick>,
    pub health: Arc<Mutex<Health>>,
    pub local: Ipv4Addr,
    pub peer: Ipv4Addr,
    pub config: ProbeConfig,
}

impl Prober {
    /// Probes now instead of at the next interval. Sending through the
    /// tunnel also makes WireGuard start a handshake at once when the peer
    /// was just (re)configured — after a failover the new peer has no
    /// session, and without traffic from this side neither end would start
    /// one for up to 15 s.
    pub fn kick(&self) {
        *self.kick.now.lock().unwrap() = true;
        self.kick.cv.notify_one();
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.kick();
    }
}

/// Opens a ping socket bound to `local` inside namespace `ns`.
fn open(ns: &str, local: Ipv4Addr) -> Result<Socket, String> {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || -> Result<Socket, String> {
        let f = std::fs::File::open(&path).map_err(|e| format!("cannot open {path}: {e}"))?;
        nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| format!("cannot enter {path}: {e}"))?;
        // Ping sockets for this agent's group, in this namespace only.
        let gid = nix::unistd::getegid();
        std::fs::write("/proc/sys/net/ipv4/ping_group_range", format!("{gid} {gid}"))
            .map_err(|e| format!("cannot allow ping sockets in {path}: {e}"))?;
        let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::ICMPV4))
            .map_err(|e| format!("cannot open a ping socket in {path}: {e}"))?;
        s.bind(&SockAddr::from(SocketAddrV4::new(local, 0)))
            .map_err(|e| format!("cannot bind the probe to {local} in {path}: {e}"))?;
        Ok(s)
    })
    .join()
    .map_err(|_| "the probe socket worker panicked".to_string())?
}

/// What one prober watches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub ns: String,
    /// The WireGuard link (for its packet counters).
    pub link: String,
    /// The peer site (the label of the RTT histogram).
    pub site: String,
    pub local: Ipv4Addr,
    pub peer: Ipv4Addr,
    /// The tunnel's MTU (the size of the path-MTU check).
    pub mtu: u32,
}

/// Starts probing `t.peer` from `t.local` inside namespace `t.ns`;
/// `changed` is called (on the prober's thread) whenever the tunnel goes up
/// or down.
pub fn start(t: Target, config: ProbeConfig, changed: impl Fn() + Send + 'static) -> Result<Prober, String> {
    let socket = open(&t.ns, t.local)?;
    // The path-MTU check goes where WireGuard's UDP goes: from the agent's
    // own namespace, so its socket is made here, before the prober's thread
    // moves into the peering's. (Without one, the check is skipped.)
    let mtu_socket = MtuSockets {
        v4: raw_icmp_socket()
            .and_then(|s| set_dont_fragment(&s).map(|()| s))
            .map_err(|e| tracing::warn!(peer = %t.site, "no path-MTU check over IPv4: {e}"))
            .ok(),
        // (None on a host without IPv6: its endpoints are IPv4's.)
        v6: weft_common::icmp::raw_icmp6_socket()
            .and_then(|s| set_dont_fragment6(&s).map(|()| s))
            .ok(),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let health = Arc::new(Mutex::new(Health::default()));
    let kick = Arc::new(Kick::default());
    let mtu_target = Arc::new(Mutex::new(None));
    let (s, h, k, m) = (stop.clone(), health.clone(), kick.clone(), mtu_target.clone());
    let (local, peer) = (t.local, t.peer);
    std::thread::Builder::new()
        .name(format!("probe-{}", t.peer))
        .spawn(move || {
            // Live in the peering's namespace: its interface counters and
            // the path-MTU check's socket are there.
            let path = format!("/run/netns/{}", t.ns);
            match std::fs::File::open(&path) {
                Ok(f) => {
                    if let Err(e) = nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET) {
                        tracing::warn!(namespace = %t.ns, "prober cannot enter the namespace: {e}");
                    }
                }
                Err(e) => tracing::warn!(namespace = %t.ns, "prober cannot open the namespace: {e}"),
            }
            run(socket, mtu_socket, &t, config, &s, &h, &k, &m, changed)
        })
        .map_err(|e| format!("cannot start the prober: {e}"))?;
    Ok(Prober {
        stop,
        mtu_target,
        kick,
        health,
        local,
        peer,
        config,
    })
}

/// Packets received and sent by `link`, from this thread's namespace's
/// `/proc/thread-self/net/dev`.
fn link_packets(link: &str) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/thread-self/net/dev").ok()?;
    text.lines().find_map(|l| {
        let (name, rest) = l.split_once(':')?;
        if name.trim() != link {
            return None;
        }
        let f: Vec<u64> = rest.split_whitespace().filter_map(|x| x.parse().ok()).collect();
        // rx: bytes packets errs drop fifo frame compressed multicast; tx: bytes packets ...
        Some((*f.get(1)?, *f.get(9)?))
    })
}

/// WireGuard's overhead on IPv4: outer IP (20) + UDP (8) + data header and
/// authentication tag (32).
pub const WG_OVERHEAD_V4: u32 = 60;

/// And on IPv6: its header is 40 bytes.
pub const WG_OVERHEAD_V6: u32 = 80;

/// The path-MTU check's raw sockets, one per family (in the namespace of
/// WireGuard's UDP socket, with DF set).
pub struct MtuSockets {
    pub v4: Option<Socket>,
    pub v6: Option<Socket>,
}

/// How many probes go between two path-MTU checks.
const MTU_CHECK_EVERY: u64 = 30;

/// Sets IP_MTU_DISCOVER to IP_PMTUDISC_DO: DF on every packet, and sends
/// larger than the known path MTU fail with EMSGSIZE instead of fragmenting.
#[allow(unsafe_code)]
fn set_dont_fragment(s: &Socket) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let v: libc::c_int = libc::IP_PMTUDISC_DO;
    // SAFETY: a valid socket descriptor, and a pointer to a c_int that
    // lives across the call with its exact size.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// IPv6's [`set_dont_fragment`]: IPV6_MTU_DISCOVER to IPV6_PMTUDISC_DO
/// and IPV6_DONTFRAG, so a send larger than the known path MTU fails with
/// EMSGSIZE instead of being fragmented by this host.
#[allow(unsafe_code)]
fn set_dont_fragment6(s: &Socket) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    for (opt, v) in [
        (libc::IPV6_MTU_DISCOVER, libc::IPV6_PMTUDISC_DO),
        (libc::IPV6_DONTFRAG, 1),
    ] {
        // SAFETY: as in set_dont_fragment.
        let r = unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::IPPROTO_IPV6,
                opt,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The kernel's path MTU toward the peer a connected IPv6 socket names
/// (IPV6_MTU); 0 when unknown.
#[allow(unsafe_code)]
fn path_mtu6(s: &Socket) -> u32 {
    use std::os::fd::AsRawFd;
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: a valid descriptor, and a c_int with its size for the
    // kernel to write.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_IPV6,
            libc::IPV6_MTU,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r == 0 { v.max(0) as u32 } else { 0 }
}

pub use weft_common::icmp::{raw_echo, raw_icmp_socket};

/// Whether a full tunnel packet (MTU + WireGuard overhead of `target`'s
/// family) crosses the underlay to `target` unfragmented, sent on `s` (a
/// raw ICMP or ICMPv6 socket of that family in the namespace of
/// WireGuard's UDP socket, with DF set).
pub fn check_path_mtu(s: &Socket, target: IpAddr, tunnel_mtu: u32, id: u16) -> weft_proto::v1::PathMtuCheck {
    let size = tunnel_mtu
        + match target {
            IpAddr::V4(_) => WG_OVERHEAD_V4,
            IpAddr::V6(_) => WG_OVERHEAD_V6,
        };
    let mut out = weft_proto::v1::PathMtuCheck {
        result: "unchecked".into(),
        probe_size: size,
        path_mtu: 0,
        target: target.to_string(),
        checked_at: Some(prost_types::Timestamp::from(std::time::SystemTime::now())),
    };
    // Connected, so the kernel's path MTU toward the target can be read.
    if s.connect(&SockAddr::from(SocketAddr::new(target, 0))).is_err() {
        return out;
    }
    let known = || match target {
        IpAddr::V4(_) => nix::sys::socket::getsockopt(s, nix::sys::socket::sockopt::IpMtu).unwrap_or(0) as u32,
        IpAddr::V6(_) => path_mtu6(s),
    };
    let echo = |seq: u16, size: u32, wait: Duration| match target {
        IpAddr::V4(a) => raw_echo(s, a, id, seq, size, wait),
        IpAddr::V6(a) => weft_common::icmp::raw_echo6(s, a, id, seq, size, wait),
    };
    let wait = Duration::from_secs(1);
    match echo(1, size, wait) {
        Ok(Ok(_)) => out.result = "ok".into(),
        Err(e) if e.raw_os_error() == Some(libc::EMSGSIZE) => {
            out.result = "too_big".into();
            out.path_mtu = known();
        }
        Err(_) => {}
        Ok(Err(_)) => {
            // A small echo tells a lost big one from a silent peer. A
            // router's "fragmentation needed" may have taught the kernel
            // the path MTU meanwhile.
            if matches!(echo(2, 100, wait), Ok(Ok(_))) {
                out.result = "unanswered".into();
                let pmtu = known();
                if pmtu > 0 && pmtu < size {
                    out.result = "too_big".into();
                    out.path_mtu = pmtu;
                }
            }
        }
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn run(
    socket: Socket,
    mtu_socket: MtuSockets,
    t: &Target,
    config: ProbeConfig,
    stop: &AtomicBool,
    health: &Mutex<Health>,
    kick: &Kick,
    mtu_target: &Mutex<Option<IpAddr>>,
    changed: impl Fn(),
) {
    let to = SockAddr::from(SocketAddrV4::new(t.peer, 0));
    let rtt_series = crate::metrics::get()
        .rtt
        .get_or_create(&vec![("peer_site".to_string(), t.site.clone())])
        .clone();
    let mut since_mtu_check = MTU_CHECK_EVERY;
    let mut seq: u16 = 0;
    let mut buf = [0u8; 64];
    while !stop.load(Ordering::Relaxed) {
        seq = seq.wrapping_add(1);
        let sent = Instant::now();
        let deadline = sent + config.interval;
        // Echo request: type 8, code 0; the kernel sets checksum and id.
        let [hi, lo] = seq.to_be_bytes();
        let request = [8u8, 0, 0, 0, 0, 0, hi, lo, b'w', b'e', b'f', b't'];
        let mut rtt = None;
        let mut kicked = false;
        if socket.send_to(&request, &to).is_ok() {
            // Wait for the answer in short slices, so that a kick (the
            // tunnel's peers just changed) sends the next probe at once
            // instead of after the rest of the interval.
            while rtt.is_none() && !kicked {
                let left = deadline.saturating_duration_since(Instant::now());
                let slice = left.min(Duration::from_millis(20));
                if slice.is_zero() || socket.set_read_timeout(Some(slice)).is_err() {
                    break;
                }
                match (&socket).read(&mut buf) {
                    // Echo reply (type 0) to this probe's sequence number;
                    // older replies that arrive late are skipped.
                    Ok(n) if n >= 8 && buf[0] == 0 && u16::from_be_bytes([buf[6], buf[7]]) == seq => {
                        rtt = Some(sent.elapsed());
                    }
                    Ok(_) => {}
                    Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                        kicked = *kick.now.lock().unwrap();
                    }
                    Err(_) => break, // the socket failed: a miss
                }
            }
        }
        if kicked && rtt.is_none() {
            *kick.now.lock().unwrap() = false;
            continue; // not a miss: probe again now
        }
        if let Some(r) = rtt {
            rtt_series.observe(r.as_secs_f64());
        }
        let packets = link_packets(&t.link);
        // (This thread lives in the peering's namespace: so does nft here.)
        let dropped = (u64::from(seq) % DROPS_EVERY == 0)
            .then(weft_dataplane::nft::dropped_blocking)
            .flatten();
        let flipped = {
            let mut h = health.lock().unwrap();
            if let Some(p) = packets {
                h.packets = p;
            }
            if let Some(c) = dropped {
                h.dropped.read(c.dropped, c.table);
                h.refused.read(c.refused, c.table);
                for (site, n) in &c.transit {
                    h.transit.entry(site.clone()).or_default().read(*n, c.table);
                }
            }
            h.record(rtt, config.misses)
        };
        if flipped {
            changed();
            since_mtu_check = MTU_CHECK_EVERY;
        }
        // The path-MTU check: soon after the tunnel is up, then now and then.
        since_mtu_check += 1;
        let target = *mtu_target.lock().unwrap();
        let ms = target.and_then(|t| match t {
            IpAddr::V4(_) => mtu_socket.v4.as_ref(),
            IpAddr::V6(_) => mtu_socket.v6.as_ref(),
        });
        if let (Some(target), Some(ms)) = (target, ms)
            && rtt.is_some()
            && t.mtu > 0
            && since_mtu_check >= MTU_CHECK_EVERY
        {
            since_mtu_check = 0;
            let c = check_path_mtu(ms, target, t.mtu, seq);
            if c.result != "ok" {
                tracing::warn!(peer = %t.site, link = %t.link, result = %c.result, size = c.probe_size, path_mtu = c.path_mtu, target = %target, "full-size tunnel packets do not cross the underlay unfragmented");
            }
            health.lock().unwrap().path_mtu = Some(c);
        }
        // Until the next interval, or a kick.
        let mut now_please = kick.now.lock().unwrap();
        while !*now_please && Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            now_please = kick.cv.wait_timeout(now_please, left).unwrap().0;
        }
        *now_please = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_total_keeps_counting_across_a_rewritten_table() {
        let mut t = Total::default();
        // (reading, table handle, total): a new table is a new count,
        // even when it has already counted past the old one's.
        for (reading, table, total) in [
            (0, 7, 0),
            (5, 7, 5),
            (9, 7, 9),
            (2, 8, 11),
            (2, 8, 11),
            (20, 9, 31),
            (25, 9, 36),
        ] {
            t.read(reading, table);
            assert_eq!(t.get(), total, "after reading {reading} of table {table}");
        }
    }

    #[test]
    fn up_after_one_answer_down_after_the_allowed_misses_in_a_row() {
        let mut h = Health::default();
        let ms = |n| Some(Duration::from_millis(n));
        assert!(!h.record(None, 3), "never answered: stays down");
        assert!(h.record(ms(2), 3), "first answer: up");
        assert!(!h.record(None, 3) && !h.record(None, 3), "two misses: still up");
        assert!(h.up);
        assert!(!h.record(ms(4), 3), "an answer resets the count");
        assert_eq!(h.misses_in_row, 0);
        assert!(!h.record(None, 3) && !h.record(None, 3));
        assert!(h.record(None, 3), "the third miss in a row: down");
        assert!(!h.up);
        assert_eq!((h.sent, h.lost), (8, 6));
        assert_eq!(h.rtt, ms(4), "the last answered RTT is kept");
    }
}
