//! The packet arithmetic of the offloads, in both directions:
//! - out of the tun: a virtio-net header and a TCP (TSO) or UDP (USO)
//!   super-packet of up to 64 KiB cut into the segments the kernel would
//!   have sent one by one, each with its own IP and L4 header and
//!   checksums; or one packet whose checksum the kernel left to us;
//! - into the tun: consecutive TCP segments of one flow, as they come out
//!   of the tunnel, joined into one super-packet that the kernel takes as
//!   one (GRO in the device), with the virtio-net header that says how to
//!   cut it again.
//!
//! Everything here works on IPv4 and IPv6 packets without extension
//! headers; anything else passes through alone, as it came. A packet this
//! code cannot read is dropped by the caller, never half-written.

/// The virtio-net header (`struct virtio_net_hdr`) the tun device puts in
/// front of every packet once `IFF_VNET_HDR` is set; little-endian, as the
/// host.
pub const VNET_HDR_LEN: usize = 10;
const NEEDS_CSUM: u8 = 1;
pub const GSO_NONE: u8 = 0;
pub const GSO_TCPV4: u8 = 1;
pub const GSO_TCPV6: u8 = 4;
pub const GSO_UDP_L4: u8 = 5;
const GSO_ECN: u8 = 0x80;

const TCP: u8 = 6;
const UDP: u8 = 17;

/// The largest packet the tun hands over or takes (IPv4's total length).
pub const MAX_PACKET: usize = 65_535;
/// Segments joined into one packet at most (as Linux's GRO).
pub const MAX_SEGMENTS: usize = 64;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VnetHdr {
    pub flags: u8,
    pub gso_type: u8,
    pub hdr_len: u16,
    pub gso_size: u16,
    pub csum_start: u16,
    pub csum_offset: u16,
}

impl VnetHdr {
    pub fn parse(b: &[u8]) -> Option<VnetHdr> {
        let b: &[u8; VNET_HDR_LEN] = b.get(..VNET_HDR_LEN)?.try_into().ok()?;
        let u = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        Some(VnetHdr {
            flags: b[0],
            gso_type: b[1],
            hdr_len: u(2),
            gso_size: u(4),
            csum_start: u(6),
            csum_offset: u(8),
        })
    }

    pub fn write(&self, b: &mut [u8]) {
        b[0] = self.flags;
        b[1] = self.gso_type;
        b[2..4].copy_from_slice(&self.hdr_len.to_le_bytes());
        b[4..6].copy_from_slice(&self.gso_size.to_le_bytes());
        b[6..8].copy_from_slice(&self.csum_start.to_le_bytes());
        b[8..10].copy_from_slice(&self.csum_offset.to_le_bytes());
    }
}

/// The one's-complement sum of `data` added to `acc` (not folded): 32-bit
/// big-endian words into 64 bits, which folds to the same 16-bit sum.
pub fn sum(data: &[u8], mut acc: u64) -> u64 {
    let mut words = data.chunks_exact(4);
    for w in &mut words {
        acc += u64::from(u32::from_be_bytes([w[0], w[1], w[2], w[3]]));
    }
    let rest = words.remainder();
    let mut tail = [0u8; 4];
    tail[..rest.len()].copy_from_slice(rest);
    acc + u64::from(u32::from_be_bytes(tail))
}

pub fn fold(mut acc: u64) -> u16 {
    while acc >> 16 != 0 {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc as u16
}

/// The pseudo-header sum of an L4 segment of `len` bytes of protocol
/// `proto` in IP packet `ip` (v4 or v6).
fn pseudo(ip: &[u8], proto: u8, len: usize) -> u64 {
    let acc = u64::from(proto) + len as u64;
    if ip[0] >> 4 == 4 {
        sum(&ip[12..20], acc)
    } else {
        sum(&ip[8..40], acc)
    }
}

/// The IP header's length, and the L4 protocol, of a packet this code
/// handles: IPv4 (any header length) or IPv6 without extension headers.
pub fn ip_header(p: &[u8]) -> Option<(usize, u8)> {
    match p.first()? >> 4 {
        4 if p.len() >= 20 => {
            let ihl = usize::from(p[0] & 0x0f) * 4;
            (ihl >= 20 && p.len() >= ihl).then_some((ihl, p[9]))
        }
        6 if p.len() >= 40 => Some((40, p[6])),
        _ => None,
    }
}

fn set_ipv4_checksum(ip: &mut [u8], ihl: usize) {
    ip[10] = 0;
    ip[11] = 0;
    let c = !fold(sum(&ip[..ihl], 0));
    ip[10..12].copy_from_slice(&c.to_be_bytes());
}

/// Sets the IP length fields of `ip` (now `total` bytes long), and the
/// IPv4 header checksum.
fn set_ip_length(ip: &mut [u8], ihl: usize, total: usize) {
    if ip[0] >> 4 == 4 {
        ip[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        set_ipv4_checksum(ip, ihl);
    } else {
        ip[4..6].copy_from_slice(&((total - 40) as u16).to_be_bytes());
    }
}

/// Why a packet from the tun could not be cut.
#[derive(Debug, PartialEq, Eq)]
pub enum Bad {
    Header,
    Gso(u8),
}

/// Cuts packet `p` (after its virtio-net header `h`) into the packets the
/// wire carries, each appended to `out` and its range to `segs`. A packet
/// that needs no cutting is appended whole, its checksum finished if the
/// kernel left it to us.
pub fn segment(h: &VnetHdr, p: &[u8], out: &mut Vec<u8>, segs: &mut Vec<(usize, usize)>) -> Result<(), Bad> {
    let gso = h.gso_type & !GSO_ECN;
    if gso == GSO_NONE {
        let at = out.len();
        out.extend_from_slice(p);
        if h.flags & NEEDS_CSUM != 0 {
            let start = usize::from(h.csum_start);
            let field = start + usize::from(h.csum_offset);
            let pkt = &mut out[at..];
            if field + 2 > pkt.len() {
                out.truncate(at);
                return Err(Bad::Header);
            }
            // The field holds the pseudo-header's sum: the checksum covers
            // it with the rest from csum_start. 0 goes out as 0xffff, as
            // Linux's skb_checksum_help (a zero UDP checksum means "none",
            // and IPv6 refuses it).
            let c = match !fold(sum(&pkt[start..], 0)) {
                0 => 0xffff,
                c => c,
            };
            pkt[field..field + 2].copy_from_slice(&c.to_be_bytes());
        }
        segs.push((at, p.len()));
        return Ok(());
    }
    let (ihl, proto) = ip_header(p).ok_or(Bad::Header)?;
    let l4_len = match (gso, proto) {
        (GSO_TCPV4 | GSO_TCPV6, TCP) if p.len() >= ihl + 20 => usize::from(p[ihl + 12] >> 4) * 4,
        (GSO_UDP_L4, UDP) => 8,
        _ => return Err(Bad::Gso(h.gso_type)),
    };
    let hlen = ihl + l4_len;
    let mss = usize::from(h.gso_size);
    let l4_min = if proto == TCP { 20 } else { 8 };
    // (no payload: nothing to cut, and nothing the kernel would send)
    if l4_len < l4_min || p.len() <= hlen || mss == 0 {
        return Err(Bad::Header);
    }
    let payload = &p[hlen..];
    let n = payload.len().div_ceil(mss).max(1);
    let seq0 = if proto == TCP {
        u32::from_be_bytes([p[ihl + 4], p[ihl + 5], p[ihl + 6], p[ihl + 7]])
    } else {
        0
    };
    let id0 = if p[0] >> 4 == 4 {
        u16::from_be_bytes([p[4], p[5]])
    } else {
        0
    };
    for (i, chunk) in payload.chunks(mss).enumerate() {
        let at = out.len();
        out.extend_from_slice(&p[..hlen]);
        out.extend_from_slice(chunk);
        let s = &mut out[at..];
        let total = hlen + chunk.len();
        if s[0] >> 4 == 4 {
            s[4..6].copy_from_slice(&id0.wrapping_add(i as u16).to_be_bytes());
        }
        set_ip_length(s, ihl, total);
        let l4 = ihl;
        if proto == TCP {
            let seq = seq0.wrapping_add((i * mss) as u32);
            s[l4 + 4..l4 + 8].copy_from_slice(&seq.to_be_bytes());
            let flags = &mut s[l4 + 13];
            if i + 1 < n {
                *flags &= !(0x01 | 0x08); // FIN, PSH: the last segment's
            }
            if i > 0 {
                *flags &= !0x80; // CWR: the first's
            }
            s[l4 + 16] = 0;
            s[l4 + 17] = 0;
        } else {
            s[l4 + 4..l4 + 6].copy_from_slice(&((total - ihl) as u16).to_be_bytes());
            s[l4 + 6] = 0;
            s[l4 + 7] = 0;
        }
        let c = !fold(sum(&s[l4..], pseudo(s, proto, total - ihl)));
        let c = if proto == UDP && c == 0 { 0xffff } else { c };
        let off = if proto == TCP { 16 } else { 6 };
        s[l4 + off..l4 + off + 2].copy_from_slice(&c.to_be_bytes());
        segs.push((at, total));
    }
    Ok(())
}

/// What joins TCP segments: IP and TCP headers that a segment shares with
/// the one before it, but for the fields that go up by one segment.
#[derive(Clone, Copy)]
struct Flow {
    ihl: usize,
    hlen: usize,
    /// Payload bytes of each segment (the first's): all but the last join
    /// with exactly this many.
    mss: usize,
    next_seq: u32,
    segments: usize,
    /// The last segment was shorter than `mss`, or had PSH: nothing joins
    /// after it.
    closed: bool,
}

/// Joins the tunnel's decrypted packets for the tun: consecutive TCP
/// segments of one flow become one super-packet (with a virtio-net header
/// for the kernel to cut it again where it must); every other packet goes
/// alone. `take` hands over each finished packet, header first.
pub struct Coalescer {
    buf: Vec<u8>,
    flow: Option<Flow>,
    /// Whether the tun takes super-packets at all (it was opened with the
    /// header and offloads).
    pub gro: bool,
}

impl Coalescer {
    pub fn new(gro: bool) -> Coalescer {
        Coalescer {
            buf: Vec::with_capacity(VNET_HDR_LEN + MAX_PACKET),
            flow: None,
            gro,
        }
    }

    /// Adds packet `p`; finished packets go to `take`.
    pub fn push(&mut self, p: &[u8], take: &mut impl FnMut(&[u8])) {
        if self.gro
            && let Some(f) = self.flow
            && self.joins(&f, p)
        {
            let payload = &p[f.hlen..];
            self.buf.extend_from_slice(payload);
            let f = self.flow.as_mut().unwrap_or_else(|| unreachable!());
            f.next_seq = f.next_seq.wrapping_add(payload.len() as u32);
            f.segments += 1;
            f.closed = payload.len() < f.mss || p[f.ihl + 13] & 0x08 != 0;
            // PSH goes on the joined header (and back on the last segment
            // when it is cut again), as Linux's GRO does.
            let ihl = f.ihl;
            self.buf[VNET_HDR_LEN + ihl + 13] |= p[ihl + 13] & 0x08;
            if f.closed || f.segments >= MAX_SEGMENTS {
                self.flush(take);
            }
            return;
        }
        self.flush(take);
        match self.gro.then(|| candidate(p)).flatten() {
            Some(f) => {
                self.buf.clear();
                self.buf.resize(VNET_HDR_LEN, 0);
                self.buf.extend_from_slice(p);
                self.flow = Some(f);
                if f.closed {
                    self.flush(take);
                }
            }
            None => {
                // Alone: a zero header (no offload; the kernel checks the
                // checksum itself).
                self.buf.clear();
                self.buf.resize(VNET_HDR_LEN, 0);
                self.buf.extend_from_slice(p);
                take(self.wire());
                self.buf.clear();
            }
        }
    }

    /// What the tun gets: with the header when it was opened with one.
    fn wire(&self) -> &[u8] {
        if self.gro { &self.buf } else { &self.buf[VNET_HDR_LEN..] }
    }

    /// Whether segment `p` continues the flow being joined: the same IP
    /// header but for length, id and checksum; the same ports, ack, header
    /// length, window and options; ACK with at most PSH; the sequence
    /// number that follows; no more payload than the first's; a valid
    /// checksum.
    fn joins(&self, f: &Flow, p: &[u8]) -> bool {
        let (ihl, hlen) = (f.ihl, f.hlen);
        if f.closed || p.len() <= hlen || p.len() - hlen > f.mss {
            return false;
        }
        if self.buf.len() - VNET_HDR_LEN + (p.len() - hlen) > MAX_PACKET {
            return false;
        }
        let first = &self.buf[VNET_HDR_LEN..VNET_HDR_LEN + hlen];
        let same_ip = if p[0] >> 4 == 4 {
            // version/ihl/tos, flags/fragment, ttl/protocol, addresses
            p[0..2] == first[0..2] && p[6..10] == first[6..10] && p[12..20] == first[12..20]
        } else {
            p[0..4] == first[0..4] && p[6..40] == first[6..40]
        };
        let (t, t0) = (&p[ihl..hlen], &first[ihl..hlen]);
        same_ip
            && t[0..4] == t0[0..4]
            && t[8..13] == t0[8..13]
            && t[13] & !0x08 == 0x10
            && t[14..16] == t0[14..16]
            && t[20..] == t0[20..]
            && u32::from_be_bytes([t[4], t[5], t[6], t[7]]) == f.next_seq
            && tcp_checksum_ok(p, ihl)
    }

    /// Writes out the packet being joined, if any.
    pub fn flush(&mut self, take: &mut impl FnMut(&[u8])) {
        let Some(f) = self.flow.take() else { return };
        let ip = &mut self.buf[VNET_HDR_LEN..];
        let total = ip.len();
        let mut h = VnetHdr::default();
        if f.segments > 1 {
            set_ip_length(ip, f.ihl, total);
            // CHECKSUM_PARTIAL: the field holds the pseudo-header's sum,
            // the kernel (or whoever cuts the packet) finishes it.
            let c = fold(pseudo(ip, TCP, total - f.ihl));
            ip[f.ihl + 16..f.ihl + 18].copy_from_slice(&c.to_be_bytes());
            h = VnetHdr {
                flags: NEEDS_CSUM,
                gso_type: if ip[0] >> 4 == 4 { GSO_TCPV4 } else { GSO_TCPV6 },
                hdr_len: f.hlen as u16,
                gso_size: f.mss as u16,
                csum_start: f.ihl as u16,
                csum_offset: 16,
            };
        }
        h.write(&mut self.buf[..VNET_HDR_LEN]);
        take(self.wire());
        self.buf.clear();
    }
}

/// A TCP segment with payload that may start a joined packet: IPv4 without
/// options and not a fragment, or IPv6 without extension headers; only
/// ACK (and PSH) set; a valid checksum.
fn candidate(p: &[u8]) -> Option<Flow> {
    let (ihl, proto) = ip_header(p)?;
    if proto != TCP || p.len() < ihl + 20 {
        return None;
    }
    if p[0] >> 4 == 4 {
        let frag = u16::from_be_bytes([p[6], p[7]]);
        if ihl != 20 || frag & 0x3fff != 0 || usize::from(u16::from_be_bytes([p[2], p[3]])) != p.len() {
            return None;
        }
    } else if usize::from(u16::from_be_bytes([p[4], p[5]])) + 40 != p.len() {
        return None;
    }
    let hlen = ihl + usize::from(p[ihl + 12] >> 4) * 4;
    let flags = p[ihl + 13];
    if hlen < ihl + 20 || p.len() <= hlen || flags & !0x08 != 0x10 || !tcp_checksum_ok(p, ihl) {
        return None;
    }
    let seq = u32::from_be_bytes([p[ihl + 4], p[ihl + 5], p[ihl + 6], p[ihl + 7]]);
    let mss = p.len() - hlen;
    Some(Flow {
        ihl,
        hlen,
        mss,
        next_seq: seq.wrapping_add(mss as u32),
        segments: 1,
        closed: flags & 0x08 != 0,
    })
}

fn tcp_checksum_ok(p: &[u8], ihl: usize) -> bool {
    fold(sum(&p[ihl..], pseudo(p, TCP, p.len() - ihl))) == 0xffff
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An IPv4 TCP packet from 10.0.0.1:1000 to 10.0.0.2:2000 with `payload`,
    /// sequence `seq`, flags `flags`, checksums right.
    fn tcp4(seq: u32, flags: u8, payload: &[u8]) -> Vec<u8> {
        let mut p = vec![0u8; 40];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&((40 + payload.len()) as u16).to_be_bytes());
        p[6] = 0x40; // DF
        p[8] = 64;
        p[9] = TCP;
        p[12..16].copy_from_slice(&[10, 0, 0, 1]);
        p[16..20].copy_from_slice(&[10, 0, 0, 2]);
        p[20..22].copy_from_slice(&1000u16.to_be_bytes());
        p[22..24].copy_from_slice(&2000u16.to_be_bytes());
        p[24..28].copy_from_slice(&seq.to_be_bytes());
        p[28..32].copy_from_slice(&7u32.to_be_bytes());
        p[32] = 5 << 4;
        p[33] = flags;
        p[34..36].copy_from_slice(&512u16.to_be_bytes());
        p.extend_from_slice(payload);
        set_ipv4_checksum(&mut p, 20);
        let c = !fold(sum(&p[20..], pseudo(&p, TCP, p.len() - 20)));
        p[36..38].copy_from_slice(&c.to_be_bytes());
        p
    }

    fn valid(p: &[u8]) -> bool {
        fold(sum(&p[..20], 0)) == 0xffff && tcp_checksum_ok(p, 20)
    }

    #[test]
    fn a_tso_packet_is_cut_into_valid_segments_with_the_right_sequence_and_flags() {
        let payload: Vec<u8> = (0..3000u32).map(|i| i as u8).collect();
        let mut big = tcp4(100, 0x18 | 0x01, &payload); // ACK PSH FIN
        // as the kernel hands it over: checksum left partial
        let partial = fold(pseudo(&big, TCP, big.len() - 20));
        big[36..38].copy_from_slice(&partial.to_be_bytes());
        let h = VnetHdr {
            flags: NEEDS_CSUM,
            gso_type: GSO_TCPV4,
            hdr_len: 40,
            gso_size: 1400,
            csum_start: 20,
            csum_offset: 16,
        };
        let (mut out, mut segs) = (Vec::new(), Vec::new());
        segment(&h, &big, &mut out, &mut segs).unwrap();
        assert_eq!(segs.len(), 3);
        let mut joined = Vec::new();
        for (i, &(at, len)) in segs.iter().enumerate() {
            let s = &out[at..at + len];
            assert!(valid(s), "segment {i} has a bad checksum");
            let seq = u32::from_be_bytes(s[24..28].try_into().unwrap());
            assert_eq!(seq, 100 + 1400 * i as u32);
            let last = i == 2;
            assert_eq!(s[33] & 0x09 != 0, last, "PSH/FIN only on the last");
            joined.extend_from_slice(&s[40..]);
        }
        assert_eq!(joined, payload);
    }

    #[test]
    fn segments_are_joined_back_and_cut_again_to_the_same_bytes() {
        let payload: Vec<u8> = (0..1400 * 5 + 100).map(|i| (i * 7) as u8).collect();
        let segments: Vec<Vec<u8>> = payload
            .chunks(1400)
            .enumerate()
            .map(|(i, c)| {
                let mut p = tcp4(5000 + 1400 * i as u32, if i == 5 { 0x18 } else { 0x10 }, c);
                p[4..6].copy_from_slice(&(i as u16).to_be_bytes());
                set_ipv4_checksum(&mut p, 20);
                p
            })
            .collect();
        let mut c = Coalescer::new(true);
        let mut got: Vec<Vec<u8>> = Vec::new();
        for s in &segments {
            c.push(s, &mut |b| got.push(b.to_vec()));
        }
        c.flush(&mut |b| got.push(b.to_vec()));
        assert_eq!(got.len(), 1, "one joined packet");
        let h = VnetHdr::parse(&got[0]).unwrap();
        assert_eq!((h.gso_type, h.gso_size, h.hdr_len), (GSO_TCPV4, 1400, 40));
        let (mut out, mut segs) = (Vec::new(), Vec::new());
        segment(&h, &got[0][VNET_HDR_LEN..], &mut out, &mut segs).unwrap();
        let again: Vec<Vec<u8>> = segs.iter().map(|&(a, l)| out[a..a + l].to_vec()).collect();
        assert_eq!(again, segments);
    }

    #[test]
    fn a_gap_a_bad_checksum_or_another_flow_starts_a_new_packet() {
        let a = tcp4(0, 0x10, &[1; 100]);
        let gap = tcp4(300, 0x10, &[2; 100]);
        let mut bad = tcp4(400, 0x10, &[3; 100]);
        bad[45] ^= 1;
        let mut count = 0;
        let mut c = Coalescer::new(true);
        for p in [&a, &gap, &bad] {
            c.push(p, &mut |_| count += 1);
        }
        c.flush(&mut |_| count += 1);
        assert_eq!(count, 3);
    }

    #[test]
    fn a_packet_with_a_partial_checksum_is_finished() {
        let mut p = tcp4(1, 0x10, &[9; 33]);
        let partial = fold(pseudo(&p, TCP, p.len() - 20));
        p[36..38].copy_from_slice(&partial.to_be_bytes());
        let h = VnetHdr {
            flags: NEEDS_CSUM,
            csum_start: 20,
            csum_offset: 16,
            ..Default::default()
        };
        let (mut out, mut segs) = (Vec::new(), Vec::new());
        segment(&h, &p, &mut out, &mut segs).unwrap();
        assert!(valid(&out));
    }

    #[test]
    fn garbage_from_the_tun_is_refused_not_cut() {
        let h = VnetHdr {
            gso_type: GSO_TCPV4,
            gso_size: 100,
            ..Default::default()
        };
        let (mut out, mut segs) = (Vec::new(), Vec::new());
        assert!(segment(&h, &[0x45, 0, 0], &mut out, &mut segs).is_err());
        assert!(segment(&h, &[0x60; 30], &mut out, &mut segs).is_err());
        // a TCP header shorter than 20 bytes (data offset 2) with a tiny MSS
        let mut short = tcp4(1, 0x10, &[7; 40]);
        short[32] = 2 << 4;
        let h1 = VnetHdr { gso_size: 1, ..h };
        assert!(segment(&h1, &short, &mut out, &mut segs).is_err());
        // no payload
        assert!(segment(&h, &tcp4(1, 0x10, &[]), &mut out, &mut segs).is_err());
        let h0 = VnetHdr {
            flags: NEEDS_CSUM,
            csum_start: 60000,
            ..Default::default()
        };
        assert!(segment(&h0, &[0x45; 40], &mut out, &mut segs).is_err());
        assert!(out.is_empty() && segs.is_empty());
    }
}
