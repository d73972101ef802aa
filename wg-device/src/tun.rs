//! The tun device of a userspace WireGuard device, opened with the
//! virtio-net header and the offloads the kernel offers: TSO (the kernel
//! hands over TCP super-packets of up to 64 KiB instead of MTU-sized
//! segments), checksum offload, and USO (the same for UDP, Linux 6.2+).
//! Each is asked for and kept only if the kernel takes it; without any,
//! the device still works, a packet at a time.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

use crate::TunOffloads;

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;

/// A tun device of the kernel's (`/dev/net/tun`).
pub struct KernelTun {
    fd: OwnedFd,
    offloads: TunOffloads,
}

#[repr(C)]
struct IfReqFlags {
    name: [libc::c_char; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

impl AsFd for KernelTun {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl KernelTun {
    /// Creates tun device `name` in the caller's network namespace,
    /// non-blocking, with as many offloads as the kernel takes (none when
    /// `offload` is false).
    #[allow(unsafe_code)]
    pub fn create(name: &str, offload: bool) -> std::io::Result<KernelTun> {
        let cname = CString::new(name).map_err(|_| std::io::Error::other("a device name with a NUL"))?;
        let bytes = cname.as_bytes_with_nul();
        if bytes.len() > libc::IFNAMSIZ {
            return Err(std::io::Error::other(format!("device name {name:?} is too long")));
        }
        let path = c"/dev/net/tun";
        // SAFETY: a NUL-terminated path; the returned descriptor is owned
        // below.
        let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: just opened, owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let mut req = IfReqFlags {
            name: [0; libc::IFNAMSIZ],
            flags: (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short,
            _pad: [0; 22],
        };
        if offload {
            req.flags |= libc::IFF_VNET_HDR as libc::c_short;
        }
        for (d, s) in req.name.iter_mut().zip(bytes) {
            *d = *s as libc::c_char;
        }
        // SAFETY: our descriptor and a request that lives for the call.
        if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF as _, &mut req as *mut IfReqFlags) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut offloads = TunOffloads {
            vnet_hdr: offload,
            ..Default::default()
        };
        if offload {
            let tso = libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6;
            let uso = libc::TUN_F_USO4 | libc::TUN_F_USO6;
            // SAFETY: our descriptor; the argument is a plain integer.
            let set = |flags: libc::c_uint| unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETOFFLOAD as _, flags as libc::c_ulong) } == 0;
            if set(tso | uso) {
                offloads.tso = true;
                offloads.uso = true;
            } else if set(tso) {
                offloads.tso = true;
            }
        }
        Ok(KernelTun { fd, offloads })
    }
}

impl crate::Tun for KernelTun {
    fn offloads(&self) -> TunOffloads {
        self.offloads
    }

    fn read(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        nix::unistd::read(self.fd.as_fd(), buf).map_err(std::io::Error::from)
    }

    fn write(&self, buf: &[u8]) -> std::io::Result<usize> {
        nix::unistd::write(self.fd.as_fd(), buf).map_err(std::io::Error::from)
    }
}
