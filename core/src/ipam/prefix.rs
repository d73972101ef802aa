//! What IPAM needs of a block, in either family: a block is an aligned,
//! inclusive range of integers (an IPv4 address widened to 128 bits), so
//! one implementation of the arithmetic serves both.

use std::fmt::{Debug, Display};
use std::hash::Hash;
use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::{Ipv4Net, Ipv6Net};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// A network of one family, as IPAM computes with it.
pub trait Prefix:
    Copy + Eq + Ord + Hash + Debug + Display + Serialize + DeserializeOwned + Send + Sync + 'static
{
    type Addr: Copy + Eq + Debug + Display;
    /// The family's longest prefix: 32 or 128.
    const MAX_LEN: u8;
    /// The shortest prefix a peer may claim: a site routes its own
    /// networks, not a continent's.
    const MIN_CLAIM: u8;
    /// Space no site can own (this-network, loopback, link-local,
    /// multicast and the like): a peer claiming it would take destinations
    /// every host has.
    const UNCLAIMABLE: &'static [&'static str];
    /// Private space a peer may announce by default.
    const PRIVATE: &'static [&'static str];

    /// The block of prefix length `len` whose first address is `start`
    /// (which is aligned).
    fn at(start: u128, len: u8) -> Self;
    fn first(&self) -> u128;
    fn last(&self) -> u128;
    fn plen(&self) -> u8;
    fn bits(a: Self::Addr) -> u128;
    fn address(bits: u128) -> Self::Addr;
    /// Parses a constant of this family (the tables above).
    fn constant(text: &str) -> Self;
    /// The network, its host bits cleared.
    fn network_only(&self) -> Self;

    fn holds(&self, other: &Self) -> bool {
        self.first() <= other.first() && other.last() <= self.last()
    }

    fn holds_addr(&self, a: Self::Addr) -> bool {
        (self.first()..=self.last()).contains(&Self::bits(a))
    }
}

impl Prefix for Ipv4Net {
    type Addr = Ipv4Addr;
    const MAX_LEN: u8 = 32;
    const MIN_CLAIM: u8 = 8;
    const UNCLAIMABLE: &'static [&'static str] = &["0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/3"];
    const PRIVATE: &'static [&'static str] = &["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10"];

    fn at(start: u128, len: u8) -> Ipv4Net {
        Ipv4Net::new(Self::address(start), len).expect("a prefix length of the family")
    }
    fn first(&self) -> u128 {
        u128::from(u32::from(self.network()))
    }
    fn last(&self) -> u128 {
        u128::from(u32::from(self.broadcast()))
    }
    fn plen(&self) -> u8 {
        self.prefix_len()
    }
    fn bits(a: Ipv4Addr) -> u128 {
        u128::from(u32::from(a))
    }
    fn address(bits: u128) -> Ipv4Addr {
        Ipv4Addr::from(bits as u32)
    }
    fn constant(text: &str) -> Ipv4Net {
        text.parse().expect("a constant CIDR")
    }
    fn network_only(&self) -> Ipv4Net {
        self.trunc()
    }
}

impl Prefix for Ipv6Net {
    type Addr = Ipv6Addr;
    const MAX_LEN: u8 = 128;
    const MIN_CLAIM: u8 = 32;
    /// `::/8` holds the unspecified and loopback addresses and IPv4-mapped
    /// space; then link-local, the deprecated site-local, and multicast.
    const UNCLAIMABLE: &'static [&'static str] = &["::/8", "fe80::/10", "fec0::/10", "ff00::/8"];
    /// Unique local addresses (RFC 4193).
    const PRIVATE: &'static [&'static str] = &["fc00::/7"];

    fn at(start: u128, len: u8) -> Ipv6Net {
        Ipv6Net::new(Self::address(start), len).expect("a prefix length of the family")
    }
    fn first(&self) -> u128 {
        u128::from(self.network())
    }
    fn last(&self) -> u128 {
        u128::from(self.broadcast())
    }
    fn plen(&self) -> u8 {
        self.prefix_len()
    }
    fn bits(a: Ipv6Addr) -> u128 {
        u128::from(a)
    }
    fn address(bits: u128) -> Ipv6Addr {
        Ipv6Addr::from(bits)
    }
    fn constant(text: &str) -> Ipv6Net {
        text.parse().expect("a constant CIDR")
    }
    fn network_only(&self) -> Ipv6Net {
        self.trunc()
    }
}

/// The number of addresses after the first in a block of length `len`:
/// its size less one, which fits even for a whole family.
pub fn span<N: Prefix>(len: u8) -> u128 {
    match N::MAX_LEN - len {
        128 => u128::MAX,
        bits => (1u128 << bits) - 1,
    }
}

/// The first block start at or after `x` for blocks of `span` + 1
/// addresses; None past the end of the family.
pub fn align_up(x: u128, span: u128) -> Option<u128> {
    if span == u128::MAX {
        return (x == 0).then_some(0);
    }
    let size = span + 1;
    x.div_ceil(size).checked_mul(size)
}
