use std::{
    alloc::{Layout, alloc, dealloc},
    os::fd::AsRawFd,
    ptr::{from_mut, from_ref, null_mut},
    slice::from_raw_parts,
};

use libc::{AF_UNIX, IF_NAMESIZE, c_ulong, ioctl};

use super::{IoError, c_int_to_error, create_socket, ioctl::iowr};

// FIXME: `WgReadIo` and `WgWriteIo` have to be declared public.
// From `dev/wg/if_wg.h`.
const SIOCSWG: c_ulong = iowr::<WgWriteIo>(b'i', 210);
const SIOCGWG: c_ulong = iowr::<WgReadIo>(b'i', 211);

/// Represent `struct wg_data_io` defined in
/// https://github.com/freebsd/freebsd-src/blob/main/sys/dev/wg/if_wg.h
#[repr(C)]
pub struct WgReadIo {
    wgd_name: [u8; IF_NAMESIZE],
    wgd_data: *mut u8, // *void
    wgd_size: usize,
}

impl WgReadIo {
    /// Create `WgReadIo` without data buffer.
    #[must_use]
    pub fn new(if_name: &str) -> Self {
        let mut wgd_name = [0u8; IF_NAMESIZE];
        if_name
            .bytes()
            .take(IF_NAMESIZE - 1)
            .enumerate()
            .for_each(|(i, b)| wgd_name[i] = b);
        Self {
            wgd_name,
            wgd_data: null_mut(),
            wgd_size: 0,
        }
    }

    /// Allocate data buffer.
    fn alloc_data(&mut self) -> Result<(), IoError> {
        // Note: `alloc` with a zero-sized layout is undefined behaviour.
        if self.wgd_size != 0
            && self.wgd_data.is_null()
            && let Ok(layout) = Layout::array::<u8>(self.wgd_size)
        {
            unsafe {
                self.wgd_data = alloc(layout);
            }
            Ok(())
        } else {
            Err(IoError::MemAlloc)
        }
    }

    /// Return buffer as slice.
    pub(super) fn as_slice(&self) -> &[u8] {
        unsafe { from_raw_parts(self.wgd_data, self.wgd_size) }
    }

    pub(super) fn read_data(&mut self) -> Result<(), IoError> {
        let socket = create_socket(AF_UNIX)?;

        // First do ioctl with empty `wg_data` to obtain buffer size.
        // IMPORTANT: Pass a raw mutable pointer, so it's not optimized out..
        let result = unsafe { ioctl(socket.as_raw_fd(), SIOCGWG, from_mut::<Self>(self)) };
        c_int_to_error(result)?;

        // Allocate buffer.
        self.alloc_data()?;
        // Second call to ioctl with allocated buffer.
        let result = unsafe { ioctl(socket.as_raw_fd(), SIOCGWG, from_mut::<Self>(self)) };
        c_int_to_error(result)?;

        Ok(())
    }
}

impl Drop for WgReadIo {
    fn drop(&mut self) {
        if self.wgd_size != 0 {
            let layout = Layout::array::<u8>(self.wgd_size).expect("Bad layout");
            unsafe {
                dealloc(self.wgd_data, layout);
            }
        }
    }
}

/// Same data layout as `WgReadIo`, but avoid `Drop`.
#[repr(C)]
pub struct WgWriteIo {
    wgd_name: [u8; IF_NAMESIZE],
    wgd_data: *mut u8, // *void
    wgd_size: usize,
}

impl WgWriteIo {
    /// Create `WgWriteIo` from slice.
    #[must_use]
    pub fn new(if_name: &str, buf: &mut [u8]) -> Self {
        let mut wgd_name = [0u8; IF_NAMESIZE];
        if_name
            .bytes()
            .take(IF_NAMESIZE - 1)
            .enumerate()
            .for_each(|(i, b)| wgd_name[i] = b);
        Self {
            wgd_name,
            wgd_data: buf.as_mut_ptr(),
            wgd_size: buf.len(),
        }
    }

    pub(super) fn write_data(&mut self) -> Result<(), IoError> {
        let socket = create_socket(AF_UNIX)?;
        // `SIOCSWG` only reads the struct, so a shared pointer is correct here.
        let result = unsafe { ioctl(socket.as_raw_fd(), SIOCSWG, from_ref::<Self>(self)) };
        c_int_to_error(result)?;

        Ok(())
    }
}
