//! Device memory and pinned host memory.

use std::sync::Arc;

use super::backend::Backed;
use super::{Backend, Result};
use crate::driver;
use crate::launch::{Arg, DevicePtr};
use crate::rm::Memory;

/// A device buffer's memory: RM's or libcuda's.
pub(super) type BufferInner = Backed<Memory, driver::DeviceMemory>;

/// Device memory.
#[derive(Clone, Debug)]
pub struct Buffer {
    pub(super) inner: Arc<BufferInner>,
    pub(super) size: u64,
}

impl Buffer {
    /// The backend that allocated this buffer.
    pub fn backend(&self) -> Backend {
        self.inner.backend()
    }

    /// The direct path's RM memory, when that backend allocated the buffer.
    pub fn direct(&self) -> Option<&Memory> {
        self.inner.direct()
    }

    /// libcuda's allocation, when the driver backend allocated the buffer.
    pub fn driver(&self) -> Option<&driver::DeviceMemory> {
        self.inner.driver()
    }

    /// The device address kernels use.
    pub fn device_ptr(&self) -> u64 {
        match &*self.inner {
            Backed::Direct(m) => m.va(),
            Backed::Driver(m) => m.ptr(),
        }
    }

    /// The device address kernels use, typed.
    pub fn ptr(&self) -> DevicePtr {
        DevicePtr(self.device_ptr())
    }

    /// Bytes allocated.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The kernel argument for this buffer's address.
    pub fn arg(&self) -> Arg<'static> {
        Arg::Ptr(self.device_ptr())
    }
}

/// A pinned host buffer's memory: RM's or libcuda's.
pub(super) type HostInner = Backed<Memory, driver::HostMemory>;

/// Pinned host memory, readable and writable by the GPU.
#[derive(Clone, Debug)]
pub struct HostBuffer {
    pub(super) inner: Arc<HostInner>,
    pub(super) size: u64,
}

impl HostBuffer {
    /// The backend that allocated this buffer.
    pub fn backend(&self) -> Backend {
        self.inner.backend()
    }

    /// The direct path's RM memory (system memory mapped for the CPU), when that backend allocated the buffer.
    pub fn direct(&self) -> Option<&Memory> {
        self.inner.direct()
    }

    /// libcuda's pinned allocation, when the driver backend allocated the buffer.
    pub fn driver(&self) -> Option<&driver::HostMemory> {
        self.inner.driver()
    }

    /// The address the GPU uses for it.
    pub fn device_ptr(&self) -> u64 {
        match &*self.inner {
            Backed::Direct(m) => m.va(),
            Backed::Driver(m) => m.ptr(),
        }
    }

    /// Bytes allocated.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Copies `data` into the buffer at `offset` by the CPU (the memory is mapped); range-checked.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        match &*self.inner {
            Backed::Direct(m) => Ok(m.write(offset, data)?),
            Backed::Driver(m) => Ok(m.write(offset, data)?),
        }
    }

    /// Copies from the buffer at `offset` into `out` by the CPU; range-checked.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        match &*self.inner {
            Backed::Direct(m) => Ok(m.read(offset, out)?),
            Backed::Driver(m) => Ok(m.read(offset, out)?),
        }
    }
}
