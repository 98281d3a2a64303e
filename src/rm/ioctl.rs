//! The unsafe core of the RM layer: ioctls on the NVIDIA device nodes. Each one is logged at trace level
//! with its duration (setup paths only: launches make no ioctl).

use std::ffi::c_void;
use std::os::fd::AsFd;
use std::time::Instant;

use rustix::ioctl::{Ioctl, IoctlOutput, Opcode, opcode};
use tracing::trace;

use super::sys;
use super::{Error, Result};

/// One read-write ioctl whose argument is a parameter struct lent by the caller.
struct ReadWrite {
    opcode: Opcode,
    arg: *mut c_void,
}

// SAFETY: `arg` points to a live, exclusively lent parameter struct whose size is encoded in the opcode (RM
// escapes) or expected by the driver for that command number (UVM), as the constructors' callers guarantee;
// the kernel writes back at most that many bytes.
unsafe impl Ioctl for ReadWrite {
    type Output = ();
    const IS_MUTATING: bool = true;

    fn opcode(&self) -> Opcode {
        self.opcode
    }

    fn as_ptr(&mut self) -> *mut c_void {
        self.arg
    }

    unsafe fn output_from_ptr(_: IoctlOutput, _: *mut c_void) -> rustix::io::Result<()> {
        Ok(())
    }
}

/// An RM escape on /dev/nvidiactl or /dev/nvidiaN: `_IOWR('F', nr, T)`. The driver checks the
/// size encoded in the opcode against the escape's structure, so `T` must be that structure.
///
/// # Safety
/// `T` must be the parameter structure (or array) the driver expects for escape `nr`, and every pointer
/// inside it must be valid for the access the escape makes.
pub(crate) unsafe fn nv_escape<T>(
    fd: impl AsFd,
    nr: u32,
    arg: &mut T,
    what: &'static str,
) -> Result<()> {
    let code = opcode::read_write::<T>(sys::NV_IOCTL_MAGIC, nr as u8);
    let start = Instant::now();
    // SAFETY: forwarded to the caller's contract above.
    let r = unsafe {
        rustix::ioctl::ioctl(
            fd,
            ReadWrite {
                opcode: code,
                arg: (arg as *mut T).cast(),
            },
        )
    };
    trace!(
        call = escape_name(nr),
        what,
        us = start.elapsed().as_micros() as u64,
        "ioctl"
    );
    r.map_err(|e| Error::Ioctl {
        call: escape_name(nr),
        what,
        source: e.into(),
    })
}

/// A UVM ioctl on /dev/nvidia-uvm: the raw command number, no size encoding.
///
/// # Safety
/// As for [`nv_escape`], with `T` the `UVM_*_PARAMS` structure of command `cmd`.
pub(crate) unsafe fn uvm_ioctl<T>(
    fd: impl AsFd,
    cmd: u32,
    arg: &mut T,
    what: &'static str,
) -> Result<()> {
    // SAFETY: forwarded to the caller's contract above.
    unsafe { uvm_ioctl_raw(fd, cmd, (arg as *mut T).cast(), what) }
}

/// [`uvm_ioctl`] with the parameter struct as a raw pointer, for callers that get it through a transport.
///
/// # Safety
/// `arg` points to the `UVM_*_PARAMS` structure of command `cmd`, exclusively lent for the call, and every
/// pointer inside it is valid for the access UVM makes.
pub(crate) unsafe fn uvm_ioctl_raw(
    fd: impl AsFd,
    cmd: u32,
    arg: *mut c_void,
    what: &'static str,
) -> Result<()> {
    let start = Instant::now();
    // SAFETY: forwarded to the caller's contract above.
    let r = unsafe {
        rustix::ioctl::ioctl(
            fd,
            ReadWrite {
                opcode: cmd as Opcode,
                arg,
            },
        )
    };
    trace!(
        call = "UVM",
        what,
        us = start.elapsed().as_micros() as u64,
        "ioctl"
    );
    r.map_err(|e| Error::Ioctl {
        call: "UVM",
        what,
        source: e.into(),
    })
}

fn escape_name(nr: u32) -> &'static str {
    match nr {
        sys::NV_ESC_RM_ALLOC => "NV_ESC_RM_ALLOC",
        sys::NV_ESC_RM_CONTROL => "NV_ESC_RM_CONTROL",
        sys::NV_ESC_RM_FREE => "NV_ESC_RM_FREE",
        sys::NV_ESC_RM_MAP_MEMORY => "NV_ESC_RM_MAP_MEMORY",
        sys::NV_ESC_RM_UNMAP_MEMORY => "NV_ESC_RM_UNMAP_MEMORY",
        sys::NV_ESC_RM_ALLOC_MEMORY => "NV_ESC_RM_ALLOC_MEMORY",
        sys::NV_ESC_CARD_INFO => "NV_ESC_CARD_INFO",
        sys::NV_ESC_REGISTER_FD => "NV_ESC_REGISTER_FD",
        sys::NV_ESC_CHECK_VERSION_STR => "NV_ESC_CHECK_VERSION_STR",
        _ => "NV_ESC",
    }
}
