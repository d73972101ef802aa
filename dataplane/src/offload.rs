//! Tuning of the tunnel's data path: receive offloads for a peering's veth
//! pair, so that packets leaving the userspace WireGuard device cross the
//! rest of the gateway, the overlay and the node as few large GRO packets
//! instead of many small ones.
//!
//! Packets the tunnel decrypts are written to the tun device, joined into
//! super-packets of up to 64 KiB where they are one TCP flow (see
//! `userspace`), and the kernel forwards each on the writing thread:
//! through the peering namespace (conntrack, NAT, MSS clamp), across the
//! veth into the gateway's namespace, into VXLAN, across the underlay to
//! the node and to the workload. Two settings cut that work:
//! - GRO on the gateway's end of the veth (the peering's end keeps TSO, so
//!   the super-packets cross whole: turning it off, as weft did while its
//!   device wrote single segments, had the kernel cut each one again
//!   before the veth and GRO join it after; 3.71 against 3.04 Gbit/s
//!   across sites, docs/benchmarks.md);
//! - threaded NAPI on the gateway's end, so that the GRO poll and all the
//!   forwarding after it run in a kernel thread the scheduler can put on
//!   another core, leaving the WireGuard device's thread to decrypt.
//!
//! Both are tuning only: on failure the data path works as before, so the
//! caller logs and carries on. There is no netlink call for either on this
//! kernel generation (ethtool's netlink family has no features set in a
//! maintained crate; threaded NAPI is a sysfs attribute), so GRO uses the
//! ethtool ioctl and threaded NAPI the device's sysfs file, read
//! through a sysfs mounted for the agent's own network namespace.

use std::ffi::CString;

const SIOCETHTOOL: libc::c_ulong = 0x8946;
const ETHTOOL_SGRO: u32 = 0x2c;

#[repr(C)]
struct EthtoolValue {
    cmd: u32,
    data: u32,
}

#[repr(C)]
struct IfReq {
    name: [libc::c_char; libc::IFNAMSIZ],
    data: *mut EthtoolValue,
    _pad: [u8; 16],
}

/// One ethtool "set" command on device `dev` in the caller's namespace.
/// The crate's only unsafe code: the legacy ethtool ioctl, which nix and
/// the netlink crates do not wrap.
#[allow(unsafe_code)]
fn ethtool_set(dev: &str, cmd: u32, on: bool) -> std::io::Result<()> {
    let name = CString::new(dev).map_err(|_| std::io::Error::other("device name has a NUL"))?;
    let bytes = name.as_bytes_with_nul();
    if bytes.len() > libc::IFNAMSIZ {
        return Err(std::io::Error::other(format!("device name {dev:?} is too long")));
    }
    let mut value = EthtoolValue { cmd, data: on as u32 };
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        data: &mut value,
        _pad: [0; 16],
    };
    for (d, s) in req.name.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: a datagram socket owned here, closed below; the ioctl reads
    // `req` and the `EthtoolValue` it points to, both alive for the call.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let rc = libc::ioctl(fd, SIOCETHTOOL as _, &mut req as *mut IfReq);
        let err = std::io::Error::last_os_error();
        libc::close(fd);
        if rc < 0 {
            return Err(err);
        }
    }
    Ok(())
}

/// Turns GRO and threaded NAPI on for `dev` (index `index`), a device in the
/// caller's network namespace.
pub fn gro_threaded(dev: &str, index: u32) -> Result<(), String> {
    ethtool_set(dev, ETHTOOL_SGRO, true).map_err(|e| format!("cannot turn GRO on on {dev}: {e}"))?;
    let dev = dev.to_string();
    std::thread::spawn(move || threaded_napi(&dev, index))
        .join()
        .map_err(|_| "the sysfs worker panicked".to_string())?
}

/// Writes `/sys/class/net/<dev>/threaded` on a worker thread that has its
/// own mount namespace with a sysfs of the current network namespace (the
/// agent may have been started with only its network namespace switched,
/// in which case the process's /sys shows another namespace's devices).
fn threaded_napi(dev: &str, index: u32) -> Result<(), String> {
    use nix::mount::{MntFlags, MsFlags, mount, umount2};
    use nix::sched::{CloneFlags, unshare};
    unshare(CloneFlags::CLONE_FS | CloneFlags::CLONE_NEWNS).map_err(|e| format!("unshare: {e}"))?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_SLAVE,
        None::<&str>,
    )
    .map_err(|e| format!("cannot make / a slave mount: {e}"))?;
    let _ = umount2("/sys", MntFlags::MNT_DETACH);
    mount(Some("sysfs"), "/sys", Some("sysfs"), MsFlags::empty(), None::<&str>)
        .map_err(|e| format!("cannot mount sysfs: {e}"))?;
    let base = format!("/sys/class/net/{dev}");
    let seen = std::fs::read_to_string(format!("{base}/ifindex")).map_err(|e| format!("{base}: {e}"))?;
    if seen.trim() != index.to_string() {
        return Err(format!("{base} is index {} here, not {index}", seen.trim()));
    }
    std::fs::write(format!("{base}/threaded"), "1").map_err(|e| format!("cannot set {base}/threaded: {e}"))
}

/// Packets the tun device may hold for the worker to read. The tun drops
/// (it cannot push back) when its queue is full, and a TCP sender's burst
/// (a 64 KiB segment is cut into ~45 packets at the tun) overflows the
/// default 500 while the worker is busy decrypting the other direction:
/// measured ~11,000 drops in 4 s of one iperf3 stream, none at 2000.
const TUN_QUEUE: u32 = 2000;

/// Sets the tun device `name`'s queue length (in the handle's namespace).
pub async fn tun_queue(h: &rtnetlink::Handle, name: &str) -> Result<(), String> {
    let idx = crate::nl::need_index_in(h, name).await?;
    h.link()
        .set(rtnetlink::LinkUnspec::new_with_index(idx).txqueuelen(TUN_QUEUE).build())
        .execute()
        .await
        .map_err(|e| format!("cannot set the queue length of {name}: {e}"))
}

/// Gives the veth end `name` (in the handle's namespace) a root qdisc
/// instead of veth's default noqueue: fq_codel, or pfifo (always built in)
/// where the kernel lacks fq_codel. With GRO on its peer the veth stops its
/// queue while the NAPI ring is full; without a qdisc each packet sent then
/// is dropped (measured ~20,000 in 4 s of one iperf3 stream), with one it
/// waits.
pub async fn queue_on_veth(h: &rtnetlink::Handle, name: &str) -> Result<(), String> {
    let idx = crate::nl::need_index_in(h, name).await?;
    // pfifo takes its limit from the queue length (veth: 1000, which a
    // burst still overflowed now and then); the tun's is the same.
    h.link()
        .set(rtnetlink::LinkUnspec::new_with_index(idx).txqueuelen(TUN_QUEUE).build())
        .execute()
        .await
        .map_err(|e| format!("cannot set the queue length of {name}: {e}"))?;
    match root_qdisc(h, idx, "fq_codel").await {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => root_qdisc(h, idx, "pfifo").await,
        r => r,
    }
    .map_err(|e| format!("cannot give {name} a queue: {e}"))
}

async fn root_qdisc(h: &rtnetlink::Handle, idx: u32, kind: &str) -> std::io::Result<()> {
    use futures::StreamExt;
    use rtnetlink::packet_core::{
        NLM_F_ACK, NLM_F_CREATE, NLM_F_REPLACE, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload,
    };
    use rtnetlink::packet_route::RouteNetlinkMessage;
    use rtnetlink::packet_route::tc::{TcAttribute, TcHandle, TcMessage};
    let mut m = TcMessage::with_index(idx as i32);
    m.header.parent = TcHandle::ROOT;
    m.attributes.push(TcAttribute::Kind(kind.into()));
    let mut req = NetlinkMessage::from(RouteNetlinkMessage::NewQueueDiscipline(m));
    req.header.flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE;
    let mut answers = h.clone().request(req).map_err(std::io::Error::other)?;
    while let Some(a) = answers.next().await {
        if let NetlinkPayload::Error(e) = a.payload
            && let Some(code) = e.code
        {
            return Err(std::io::Error::from_raw_os_error(-code.get()));
        }
    }
    Ok(())
}
