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
use std::net::{Ipv4Addr, SocketAddrV4};
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
    pub up: bool,
    /// Round-trip time of the latest answered probe.
    pub rtt: Option<Duration>,
    pub sent: u64,
    pub lost: u64,
    /// Unanswered probes since the last answer.
    pub misses_in_row: u32,
}

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

/// Starts probing `peer` from `local` inside namespace `ns`; `changed` is
/// called (on the prober's thread) whenever the tunnel goes up or down.
pub fn start(
    ns: &str,
    local: Ipv4Addr,
    peer: Ipv4Addr,
    config: ProbeConfig,
    changed: impl Fn() + Send + 'static,
) -> Result<Prober, String> {
    let socket = open(ns, local)?;
    let stop = Arc::new(AtomicBool::new(false));
    let health = Arc::new(Mutex::new(Health::default()));
    let kick = Arc::new(Kick::default());
    let (s, h, k) = (stop.clone(), health.clone(), kick.clone());
    std::thread::Builder::new()
        .name(format!("probe-{peer}"))
        .spawn(move || run(socket, peer, config, &s, &h, &k, changed))
        .map_err(|e| format!("cannot start the prober: {e}"))?;
    Ok(Prober {
        stop,
        kick,
        health,
        local,
        peer,
        config,
    })
}

fn run(
    socket: Socket,
    peer: Ipv4Addr,
    config: ProbeConfig,
    stop: &AtomicBool,
    health: &Mutex<Health>,
    kick: &Kick,
    changed: impl Fn(),
) {
    let to = SockAddr::from(SocketAddrV4::new(peer, 0));
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
        let flipped = health.lock().unwrap().record(rtt, config.misses);
        if flipped {
            changed();
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
