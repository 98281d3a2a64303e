//! Memory from the driver: device memory (`cuMemAlloc`) and pinned host memory mapped for the device
//! (`cuMemHostAlloc`).

use std::ffi::c_void;
use std::sync::Arc;

use super::{Context, Error, Result, check, cu};

/// Device memory from cuMemAlloc.
#[derive(Debug)]
pub struct DeviceMemory {
    ctx: Arc<Context>,
    ptr: cu::CUdeviceptr,
    size: u64,
}

impl DeviceMemory {
    /// `size` bytes of device memory in `ctx` (`cuMemAlloc`), freed on drop.
    pub fn alloc(ctx: &Arc<Context>, size: u64) -> Result<DeviceMemory> {
        if size == 0 {
            return Err(Error::InvalidArgument("a buffer of 0 bytes".into()));
        }
        ctx.bind()?;
        let mut ptr = 0;
        // SAFETY: out-pointer to a local.
        check("cuMemAlloc", unsafe {
            cu::cuMemAlloc_v2(&mut ptr, size as usize)
        })?;
        Ok(DeviceMemory {
            ctx: ctx.clone(),
            ptr,
            size,
        })
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The context the memory was allocated in.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Bytes allocated.
    pub fn size(&self) -> u64 {
        self.size
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: frees our own allocation once.
        unsafe { cu::cuMemFree_v2(self.ptr) };
    }
}

/// Pinned host memory from cuMemHostAlloc, mapped for the device.
#[derive(Debug)]
pub struct HostMemory {
    ctx: Arc<Context>,
    ptr: *mut u8,
    size: u64,
}

// SAFETY: plain pinned host memory; accesses go through bounds-checked copies.
unsafe impl Send for HostMemory {}
// SAFETY: as above.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// `size` bytes of pinned host memory in `ctx`, mapped for the device (`cuMemHostAlloc`), freed on drop.
    pub fn alloc(ctx: &Arc<Context>, size: u64) -> Result<HostMemory> {
        if size == 0 {
            return Err(Error::InvalidArgument("a buffer of 0 bytes".into()));
        }
        ctx.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; PORTABLE | DEVICEMAP as pinned staging memory.
        check("cuMemHostAlloc", unsafe {
            cu::cuMemHostAlloc(&mut p, size as usize, 0x1 | 0x2)
        })?;
        Ok(HostMemory {
            ctx: ctx.clone(),
            ptr: p.cast(),
            size,
        })
    }

    /// The address the device uses for it.
    pub fn ptr(&self) -> u64 {
        self.ptr as u64
    }

    /// Bytes allocated.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Copies `data` into the memory at `offset` by the CPU; range-checked.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.bounds(offset, data.len() as u64)?;
        // SAFETY: bounds checked; the allocation lives as long as `self`.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset as usize), data.len())
        };
        Ok(())
    }

    /// Copies from the memory at `offset` into `out` by the CPU; range-checked.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.bounds(offset, out.len() as u64)?;
        // SAFETY: as in `write`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.add(offset as usize),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    fn bounds(&self, offset: u64, len: u64) -> Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.size) {
            return Err(Error::InvalidArgument(format!(
                "{offset:#x}+{len:#x} outside {:#x} bytes",
                self.size
            )));
        }
        Ok(())
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: frees our own allocation once.
        unsafe { cu::cuMemFreeHost(self.ptr.cast()) };
    }
}
