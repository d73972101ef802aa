//! How much slower than usual this test runs. The VM lane's guest is
//! emulated (TCG): some 25 times slower than the host, and slower still
//! when something else loads the host. Its scenarios' waits, and the lab's
//! timings there (gateway TTL, resync, keep-alive allowance), are set for
//! a guest of a known speed and stretched by how much slower the guest is
//! at the start of each run: bounds come from what the guest can do that
//! day, not from the fastest run seen.
//!
//! The speed is measured by a calibration, a fixed piece of work like the
//! lab's own (hashing, and starting short-lived processes such as `ip` and
//! `weftctl`, on both CPUs at once). The guest times it at boot
//! (`weft-vm-guest pace`); the stretch is its time over
//! [`GUEST_REFERENCE`], at least 1. The host times it too, just before it
//! boots the guest (`vm::run`), for the record. Scenarios print both, and
//! every [`crate::eventually`] that gives up says them.

use std::time::{Duration, Instant};

/// The guest's calibration time the VM lane's waits and timings are set
/// for: measured on this project's machine kind, a 2-core host with
/// nothing else running (0.79–0.85 s, 2026-11-24).
pub const GUEST_REFERENCE: Duration = Duration::from_millis(850);

/// The stretch of this process's waits: `WEFT_PACE` (set in the guest from
/// its calibration), else 1.
pub fn factor() -> f64 {
    std::env::var("WEFT_PACE")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|f| f.is_finite() && *f >= 1.0)
        .map_or(1.0, |f| f.min(MAX_STRETCH))
}

/// `d` stretched by [`factor`].
pub fn scaled(d: Duration) -> Duration {
    d.mul_f64(factor())
}

/// The stretch and where it came from (`WEFT_PACE_NOTE`), for failure
/// messages; empty where no calibration was made (the host).
pub fn describe() -> String {
    match std::env::var("WEFT_PACE_NOTE") {
        Ok(note) if !note.is_empty() => format!("waits stretched {:.2}x: {note}", factor()),
        _ if factor() > 1.0 => format!("waits stretched {:.2}x", factor()),
        _ => String::new(),
    }
}

/// The calibration: on each of two threads at once (the guest has two
/// CPUs, and the lab keeps both busy), hashing 1 MiB and starting
/// `/bin/true` 10 times; the best of 3 runs (the least disturbed).
pub fn calibrate() -> Duration {
    use sha2::Digest;
    let work = || {
        let data = vec![0x5au8; 1 << 20];
        std::hint::black_box(sha2::Sha256::digest(&data));
        for _ in 0..10 {
            let _ = std::process::Command::new("/bin/true").status();
        }
    };
    (0..3)
        .map(|_| {
            let t = Instant::now();
            std::thread::scope(|s| {
                let other = s.spawn(work);
                work();
                other.join().unwrap();
            });
            t.elapsed()
        })
        .min()
        .unwrap()
}

/// The most the waits stretch: a guest slower than that is not a slow
/// guest but a broken run (or a disturbed calibration), and a stretch
/// without bound would let a real regression (a failover that takes
/// minutes) pass.
pub const MAX_STRETCH: f64 = 4.0;

/// The stretch for a guest whose calibration took `guest`: from 1 to
/// [`MAX_STRETCH`].
pub fn stretch(guest: Duration) -> f64 {
    (guest.as_secs_f64() / GUEST_REFERENCE.as_secs_f64()).clamp(1.0, MAX_STRETCH)
}
