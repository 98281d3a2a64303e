//! CPU mappings of RM objects: a range of this process's address space that a transport mapped (memory, the
//! usermode page), unmapped on drop.

use std::ptr::NonNull;

use rustix::mm::munmap;
use tracing::warn;

/// A CPU mapping of an RM object (made by `NV_ESC_RM_MAP_MEMORY` and `mmap`), unmapped on drop.
#[derive(Debug)]
pub struct CpuMapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; APEX's users of it synchronise through the GPU protocol
// (semaphores, GPPut) and never hand out references into it.
unsafe impl Send for CpuMapping {}
// SAFETY: as above.
unsafe impl Sync for CpuMapping {}

impl CpuMapping {
    /// Takes ownership of `len` bytes mapped at `ptr`.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` is a mapping of this process that nothing else unmaps: the returned value unmaps it
    /// on drop.
    pub(crate) unsafe fn from_raw(ptr: NonNull<u8>, len: usize) -> CpuMapping {
        CpuMapping { ptr, len }
    }

    /// The first mapped byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (it never is once made; for symmetry with `len`).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets the mapping without unmapping it (the caller puts a reservation over it instead).
    pub(crate) fn into_raw(self) -> (NonNull<u8>, usize) {
        let me = std::mem::ManuallyDrop::new(self);
        (me.ptr, me.len)
    }
}

impl Drop for CpuMapping {
    fn drop(&mut self) {
        // SAFETY: the mapping is this value's own (`from_raw`'s contract) and is unmapped once.
        if let Err(e) = unsafe { munmap(self.ptr.as_ptr().cast(), self.len) } {
            warn!(error = %e, "munmap failed");
        }
    }
}
