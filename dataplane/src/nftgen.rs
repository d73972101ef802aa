//! The nftables ruleset's generation of a namespace, read over netlink in
//! this process. The kernel bumps it with every committed nftables change
//! in that namespace (any table, any family), so an unchanged generation
//! says a listing taken under it is still true. Reading it costs a few
//! system calls; listing with `nft` costs a process (`ip netns exec` and
//! `nft`: 0.2–1 s on a slow host, the most of a resync there).

use netlink_sys::{Socket, protocols::NETLINK_NETFILTER};

use crate::host::R;
use crate::model::Ns;

/// Which namespace (its cookie, which the kernel never gives another
/// namespace; before Linux 5.14 its nsfs inode) and its ruleset's
/// generation: a namespace made anew under the same name reads as another.
pub type Generation = (u64, u32);

/// `SO_NETNS_COOKIE` (asm-generic; libc does not name it yet).
const SO_NETNS_COOKIE: libc::c_int = 71;

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_NEWGEN: u16 = 15;
const NFT_MSG_GETGEN: u16 = 16;
const NFTA_GEN_ID: u16 = 1;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const HEADER: usize = 16;
const NFGENMSG: usize = 4;

/// The generation of namespace `ns` ("" the agent's own), on a thread of
/// its own (it joins the namespace).
pub async fn generation(ns: &Ns) -> R<Generation> {
    let path = if ns.is_empty() {
        "/proc/self/ns/net".to_string()
    } else {
        format!("/run/netns/{ns}")
    };
    crate::nl::on_thread_in(path.clone(), move |file| {
        let inode =
            std::os::unix::fs::MetadataExt::ino(&file.metadata().map_err(|e| format!("cannot stat {path}: {e}"))?);
        let (cookie, generation) = ask()?;
        Ok((cookie.unwrap_or(inode), generation))
    })
    .await
}

/// Asks the kernel (in the calling thread's namespace): the namespace's
/// cookie (None before Linux 5.14) and its generation.
fn ask() -> R<(Option<u64>, u32)> {
    let mut s = Socket::new(NETLINK_NETFILTER).map_err(|e| format!("cannot open a netfilter socket: {e}"))?;
    let cookie = cookie(&s);
    s.bind_auto()
        .map_err(|e| format!("cannot bind a netfilter socket: {e}"))?;
    s.connect(&netlink_sys::SocketAddr::new(0, 0))
        .map_err(|e| format!("cannot address the kernel: {e}"))?;
    s.send(&request(), 0)
        .map_err(|e| format!("cannot ask for the nftables generation: {e}"))?;
    let mut buf = vec![0u8; 4096];
    let n = s
        .recv(&mut &mut buf[..], 0)
        .map_err(|e| format!("no nftables generation: {e}"))?;
    Ok((cookie, parse(&buf[..n])?))
}

/// The cookie of the namespace socket `s` lives in.
#[allow(unsafe_code)]
fn cookie(s: &Socket) -> Option<u64> {
    use std::os::fd::AsRawFd;
    let mut value: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: an open socket of ours, and a pointer to a u64 that lives
    // for the call, with its size.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&mut value as *mut u64).cast(),
            &mut len,
        )
    };
    (rc == 0 && len as usize == std::mem::size_of::<u64>()).then_some(value)
}

fn request() -> Vec<u8> {
    let len = (HEADER + NFGENMSG) as u32;
    let mut m = Vec::with_capacity(len as usize);
    m.extend_from_slice(&len.to_ne_bytes());
    m.extend_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN).to_ne_bytes());
    m.extend_from_slice(&NLM_F_REQUEST.to_ne_bytes());
    m.extend_from_slice(&1u32.to_ne_bytes()); // sequence
    m.extend_from_slice(&0u32.to_ne_bytes()); // port: the kernel fills it in
    // nfgenmsg: AF_UNSPEC, NFNETLINK_V0, resource id 0.
    m.extend_from_slice(&[0, 0, 0, 0]);
    m
}

/// The generation in the kernel's answer (NFT_MSG_NEWGEN), or its error.
fn parse(b: &[u8]) -> R<u32> {
    let short = || "a short answer to the nftables generation request".to_string();
    let u16_at = |at: usize| b.get(at..at + 2).map(|s| u16::from_ne_bytes([s[0], s[1]]));
    let len = b
        .get(0..4)
        .map(|s| u32::from_ne_bytes([s[0], s[1], s[2], s[3]]) as usize)
        .ok_or_else(short)?;
    let kind = u16_at(4).ok_or_else(short)?;
    let body = b.get(HEADER..len.min(b.len())).ok_or_else(short)?;
    if kind == NLMSG_ERROR {
        let code = body
            .get(0..4)
            .map(|s| i32::from_ne_bytes([s[0], s[1], s[2], s[3]]))
            .ok_or_else(short)?;
        return Err(format!(
            "the kernel refused the nftables generation request: {}",
            std::io::Error::from_raw_os_error(-code)
        ));
    }
    if kind != (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN {
        return Err(format!(
            "an unexpected answer (type {kind:#x}) to the nftables generation request"
        ));
    }
    // Attributes after the nfgenmsg: length, type, value (4-byte aligned).
    let mut at = NFGENMSG;
    while at + 4 <= body.len() {
        let alen = u16::from_ne_bytes([body[at], body[at + 1]]) as usize;
        let atype = u16::from_ne_bytes([body[at + 2], body[at + 3]]) & 0x3fff;
        if alen < 4 || at + alen > body.len() {
            break;
        }
        if atype == NFTA_GEN_ID && alen == 8 {
            let v = &body[at + 4..at + 8];
            return Ok(u32::from_be_bytes([v[0], v[1], v[2], v[3]]));
        }
        at += (alen + 3) & !3;
    }
    Err("the kernel's answer has no nftables generation".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(kind: u16, attrs: &[u8]) -> Vec<u8> {
        let len = (HEADER + NFGENMSG + attrs.len()) as u32;
        let mut m = Vec::new();
        m.extend_from_slice(&len.to_ne_bytes());
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend_from_slice(&[0; 4]);
        m.extend_from_slice(attrs);
        m
    }

    #[test]
    fn the_generation_is_read_from_the_kernels_answer_and_anything_else_is_refused() {
        let newgen = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN;
        let mut attrs = Vec::new();
        // NFTA_GEN_PROC_PID first, then NFTA_GEN_ID (big endian).
        attrs.extend_from_slice(&8u16.to_ne_bytes());
        attrs.extend_from_slice(&2u16.to_ne_bytes());
        attrs.extend_from_slice(&77u32.to_be_bytes());
        attrs.extend_from_slice(&8u16.to_ne_bytes());
        attrs.extend_from_slice(&NFTA_GEN_ID.to_ne_bytes());
        attrs.extend_from_slice(&4242u32.to_be_bytes());
        assert_eq!(parse(&answer(newgen, &attrs)), Ok(4242));
        // No id, a truncated one, another message, an error, nothing.
        assert!(parse(&answer(newgen, &attrs[..8])).is_err());
        assert!(parse(&answer(newgen, &attrs[..14])).is_err());
        assert!(parse(&answer(0x0a01, &attrs)).is_err());
        let mut err = answer(NLMSG_ERROR, &[]);
        err.truncate(HEADER);
        err.extend_from_slice(&(-libc::EPERM).to_ne_bytes());
        let len = err.len() as u32;
        err[0..4].copy_from_slice(&len.to_ne_bytes());
        assert!(parse(&err).unwrap_err().contains("refused"));
        assert!(parse(&[]).is_err());
        assert!(parse(&[1, 2, 3]).is_err());
    }

    #[test]
    fn the_request_is_a_getgen_of_its_own_length() {
        let r = request();
        assert_eq!(r.len(), HEADER + NFGENMSG);
        assert_eq!(u32::from_ne_bytes(r[0..4].try_into().unwrap()) as usize, r.len());
        assert_eq!(u16::from_ne_bytes(r[4..6].try_into().unwrap()), 0x0a10);
    }
}
