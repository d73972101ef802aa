//! What a device's threads and its owner share: the tun and the socket,
//! the keys, the peers, the counters; and the waits of its threads.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use defguard_boringtun::noise::rate_limiter::RateLimiter;
use defguard_boringtun::x25519::{PublicKey, StaticSecret};

use crate::peers::Peers;
use crate::{Bind, Counters, Offloads, OnDeath, TICK_MS, Tun};

pub(crate) struct Shared {
    pub(crate) stop: AtomicBool,
    /// Why a thread of the device ended by panicking (the other is then
    /// stopped too): the device is dead and must be made anew.
    pub(crate) died: Mutex<Option<String>>,
    /// The device's interface name.
    pub(crate) name: String,
    /// See [`Config::panic_dir`].
    pub(crate) panic_dir: Option<std::path::PathBuf>,
    pub(crate) on_death: Option<OnDeath>,
    pub(crate) tun: Box<dyn Tun>,
    /// The tun's packets carry the virtio-net header.
    pub(crate) vnet_hdr: bool,
    pub(crate) bind: Box<dyn Bind>,
    pub(crate) secret: StaticSecret,
    pub(crate) public: PublicKey,
    pub(crate) limiter: Arc<RateLimiter>,
    /// The peers' state machines' own limiter, never under load: the
    /// device's has checked (and counted) each message before it reaches
    /// one. Sharing the device's would count it twice, and a peer's state
    /// machine could then answer a valid handshake with a cookie.
    pub(crate) unlimited: Arc<RateLimiter>,
    pub(crate) peers: RwLock<Peers>,
    pub(crate) counters: Counters,
    pub(crate) offloads: Offloads,
    pub(crate) rekey_after: Option<Duration>,
    /// See [`crate::Config::punch_ttl`].
    pub(crate) punch_ttl: u8,
}

impl Shared {
    pub(crate) fn peers(&self) -> std::sync::RwLockReadGuard<'_, Peers> {
        self.peers.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Datagrams per UDP send now: quinn-udp drops to 1 when the kernel
    /// refuses a segmented send (EIO, EINVAL).
    pub(crate) fn gso_segments(&self) -> usize {
        if self.offloads.udp_gso_segments > 1 {
            self.bind.max_gso_segments().max(1)
        } else {
            1
        }
    }
}

/// The fault-injection hook the end-to-end tests use to kill a device
/// thread: with [`Config::panic_dir`] set, a file there named after a
/// device makes that device's receiving thread panic once (the file is
/// removed first). Unset (always, but in tests), nothing is looked at.
pub(crate) fn injected_panic(s: &Shared) {
    if let Some(dir) = &s.panic_dir {
        let file = dir.join(&s.name);
        if std::fs::remove_file(&file).is_ok() {
            panic!("injected by {} (a test)", file.display());
        }
    }
}

/// Waits until the tun (`tun`) or the socket (`udp`) has something, or
/// [`TICK_MS`] pass.
pub(crate) fn wait(s: &Shared, tun: bool, udp: bool) {
    use std::os::fd::AsFd;
    let mut fds = Vec::with_capacity(2);
    if tun {
        fds.push(nix::poll::PollFd::new(s.tun.as_fd(), nix::poll::PollFlags::POLLIN));
    }
    if udp {
        fds.push(nix::poll::PollFd::new(s.bind.as_fd(), nix::poll::PollFlags::POLLIN));
    }
    let _ = nix::poll::poll(&mut fds, TICK_MS);
}

/// Waits until the tun has room for a packet, or `ms` pass.
pub(crate) fn wait_writable(tun: &dyn Tun, ms: u16) {
    let mut fds = [nix::poll::PollFd::new(tun.as_fd(), nix::poll::PollFlags::POLLOUT)];
    let _ = nix::poll::poll(&mut fds, ms);
}
