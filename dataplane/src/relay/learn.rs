//! How a relay learns where each side's gateway is: candidates from
//! handshake initiations, confirmed only by the other side's handshake
//! response (see the module above).

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::End;

/// An initiation a side sent (its sender index, from where), which the
/// other side's handshake response may answer.
pub(super) struct Candidate {
    addr: SocketAddr,
    index: u32,
    /// Its ephemeral public key: the same from another address is a
    /// replay.
    ephemeral: [u8; 32],
    since: Instant,
    /// The initiation itself while the other side was not learned yet:
    /// delivered there once it is (so the side is learned in this
    /// handshake, not after the protocol's 5 s retry).
    pending: Option<Box<[u8; INITIATION]>>,
}

pub(super) struct Learning {
    /// Initiations from addresses other than the learned one, newest
    /// last, one per address, at most [`CANDIDATES`].
    candidates: Vec<Candidate>,
    /// The latest initiation from the learned address (its index and
    /// ephemeral key): its replay from elsewhere is dropped, and an
    /// answer to its index is no move.
    learned_index: Option<(u32, [u8; 32], Instant)>,
    /// Handshakes taken from addresses not learned in the current second.
    window: Instant,
    taken: u32,
}

impl Learning {
    pub(super) fn new() -> Learning {
        Learning {
            candidates: Vec::new(),
            learned_index: None,
            window: Instant::now(),
            taken: 0,
        }
    }
}

/// What a handshake response from the other side did to a side.
#[derive(Debug, PartialEq)]
pub(super) enum Answer {
    /// It answered an initiation from this address, and no other: learned.
    Learned(SocketAddr),
    /// It answered an initiation that came from two addresses (a replay):
    /// nothing learned, those candidates dropped.
    Ambiguous,
    /// It answered none of the side's candidates.
    Nothing,
}

/// Candidates kept per side, and for how long: room for more than a
/// second and a half of handshakes at the budget below, so a flood of
/// forged ones does not push out a gateway's before the other side could
/// answer it.
pub(super) const CANDIDATES: usize = 32;
/// A handshake for a side not learned yet goes to this many of its newest
/// candidates.
pub(super) const FANOUT: usize = 8;
pub(super) const CANDIDATE_LIFE: Duration = Duration::from_secs(20);
/// Handshakes a side may send per second from addresses not learned (a
/// gateway sends one every 5 s; a moved or new one a few): over it they
/// are dropped, so a flood of forged ones costs the other side's gateway
/// and this relay at most this many, and fans out at most
/// `CANDIDATES` times as many.
pub(super) const UNLEARNED_PER_SECOND: u32 = 20;
/// A WireGuard handshake initiation's size.
pub(super) const INITIATION: usize = 148;
/// A WireGuard message's type and its two indexes (sender, receiver; 0
/// where it has none), from the wire format (type in the first byte,
/// little-endian indexes); None for anything not WireGuard-shaped.
pub(super) fn message(d: &[u8]) -> Option<(u8, u32, u32)> {
    let idx = |at: usize| d.get(at..at + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap()));
    match (d.first()?, d.len()) {
        (1, 148) => Some((1, idx(4)?, 0)),
        (2, 92) => Some((2, idx(4)?, idx(8)?)),
        (3, 64) => Some((3, 0, idx(4)?)),
        (4, n) if n >= 32 => Some((4, 0, idx(4)?)),
        _ => None,
    }
}

impl End {
    /// Whether handshake `first` from `from` (not the learned address) is
    /// taken: from an allowed address, its mac1 verifying for one of the
    /// keys, and within the side's budget for such handshakes.
    /// Whether the side may send from `ip`: one of its addresses (any when
    /// none is known), or loopback: a side carried over TLS, handed on by
    /// the gateway's TLS port, which checked the connection's address
    /// itself.
    pub(super) fn may_send_from(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.from_ips.is_empty() || self.from_ips.contains(&ip) || ip.is_loopback()
    }

    pub(super) fn admits(&self, from: SocketAddr, first: &[u8]) -> Result<(), Refused> {
        let mut scratch = [0u8; 256];
        if !self.may_send_from(from.ip())
            || !self
                .checkers
                .iter()
                .any(|c| c.verify_packet(None, first, &mut scratch).is_ok())
        {
            return Err(Refused::Unknown);
        }
        let mut l = self.learning.lock().unwrap();
        if l.window.elapsed() >= Duration::from_secs(1) {
            l.window = Instant::now();
            l.taken = 0;
        }
        if l.taken >= UNLEARNED_PER_SECOND {
            return Err(Refused::OverBudget);
        }
        l.taken += 1;
        Ok(())
    }

    /// Records initiation `init` (sender index `index`) from `from`;
    /// `learned`: from the side's learned address. `keep`: the other side
    /// is not learned, so the initiation waits to be delivered there.
    /// False for a replay: an initiation another address sent first (the
    /// same ephemeral key), which goes no further.
    pub(super) fn initiated(&self, from: SocketAddr, index: u32, init: &[u8], learned: bool, keep: bool) -> bool {
        let Some(ephemeral) = init.get(8..40).and_then(|e| <[u8; 32]>::try_from(e).ok()) else {
            return false;
        };
        let mut l = self.learning.lock().unwrap();
        let fresh = |since: Instant| since.elapsed() < CANDIDATE_LIFE;
        let replayed = l
            .candidates
            .iter()
            .any(|c| c.ephemeral == ephemeral && c.addr != from && fresh(c.since))
            || (!learned
                && l.learned_index
                    .is_some_and(|(_, e, since)| e == ephemeral && fresh(since)));
        if replayed {
            return false;
        }
        if learned {
            l.learned_index = Some((index, ephemeral, Instant::now()));
            return true;
        }
        l.candidates.retain(|c| c.addr != from && fresh(c.since));
        if l.candidates.len() >= CANDIDATES {
            l.candidates.remove(0);
        }
        let pending = (keep && init.len() == INITIATION).then(|| {
            let mut b = Box::new([0u8; INITIATION]);
            b.copy_from_slice(init);
            b
        });
        l.candidates.push(Candidate {
            addr: from,
            index,
            ephemeral,
            since: Instant::now(),
            pending,
        });
        self.waiting.store(l.candidates.len(), Ordering::Relaxed);
        true
    }

    /// The other side's handshake response to sender index `index`: it
    /// answers an initiation it could decrypt and that was no replay, so
    /// the one address that sent an initiation with that index is this
    /// side's gateway. Two addresses with that index (one guessed it and
    /// sent an initiation of its own first) are ambiguous: the gateway
    /// answered one of them, which one the relay cannot tell, so none is
    /// learned and the learned address stays.
    pub(super) fn answered(&self, index: u32) -> Answer {
        let mut l = self.learning.lock().unwrap();
        let fresh = |since: Instant| since.elapsed() < CANDIDATE_LIFE;
        let from: Vec<(SocketAddr, [u8; 32])> = l
            .candidates
            .iter()
            .filter(|c| c.index == index && fresh(c.since))
            .map(|c| (c.addr, c.ephemeral))
            .collect();
        if from.is_empty() {
            return Answer::Nothing;
        }
        let learned_too = l.learned_index.is_some_and(|(i, _, since)| i == index && fresh(since));
        l.candidates.retain(|c| c.index != index);
        self.waiting.store(l.candidates.len(), Ordering::Relaxed);
        match from[..] {
            [(addr, ephemeral)] if !learned_too => {
                *self.at.lock().unwrap() = Some(addr);
                l.learned_index = Some((index, ephemeral, Instant::now()));
                Answer::Learned(addr)
            }
            _ => Answer::Ambiguous,
        }
    }

    /// The initiations waiting for the other side to be learned, taken.
    pub(super) fn take_pending(&self) -> Vec<[u8; INITIATION]> {
        let mut l = self.learning.lock().unwrap();
        l.candidates
            .iter_mut()
            .filter(|c| c.since.elapsed() < CANDIDATE_LIFE)
            .filter_map(|c| c.pending.take().map(|b| *b))
            .collect()
    }

    /// Where a handshake for this side goes: its learned address, or while
    /// it has none, its candidates.
    pub(super) fn handshake_targets(&self) -> Vec<SocketAddr> {
        match *self.at.lock().unwrap() {
            Some(a) => vec![a],
            None => self
                .learning
                .lock()
                .unwrap()
                .candidates
                .iter()
                .rev()
                .filter(|c| c.since.elapsed() < CANDIDATE_LIFE)
                .take(FANOUT)
                .map(|c| c.addr)
                .collect(),
        }
    }
}

/// Why a handshake from an address not learned was dropped.
pub(super) enum Refused {
    /// Not from an allowed address, or not addressed to the other side.
    Unknown,
    /// Over the side's budget of such handshakes.
    OverBudget,
}
