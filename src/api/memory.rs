//! Device memory and pinned host memory.

use std::sync::Arc;

use super::{Backend, Result};
use crate::driver;
use crate::launch::Arg;
use crate::rm::Memory;

#[derive(Debug)]
pub(super) enum BufferInner {
    Direct(Memory),
    Driver(driver::DeviceMemory),
}

/// Device memory.
#[derive(Clone, Debug)]
pub struct Buffer {
    pub(super) inner: Arc<BufferInner>,
    pub(super) size: u64,
}

impl Buffer {
    /// The backend that allocated this buffer.
    pub fn backend(&self) -> Backend {
        match &*self.inner {
            BufferInner::Direct(_) => Backend::Direct,
            BufferInner::Driver(_) => Backend::Driver,
        }
    }

    /// The direct path's RM memory, when that backend allocated the buffer.
    pub fn direct(&self) -> Option<&Memory> {
        match &*self.inner {
            BufferInner::Direct(m) => Some(m),
            BufferInner::Driver(_) => None,
        }
    }

    /// libcuda's allocation, when the driver backend allocated the buffer.
    pub fn driver(&self) -> Option<&driver::DeviceMemory> {
        match &*self.inner {
            BufferInner::Driver(m) => Some(m),
            BufferInner::Direct(_) => None,
        }
    }

    /// The device address kernels use.
    pub fn device_ptr(&self) -> u64 {
        match &*self.inner {
            BufferInner::Direct(m) => m.va(),
            BufferInner::Driver(m) => m.ptr(),
        }
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

#[derive(Debug)]
pub(super) enum HostInner {
    Direct(Memory),
    Driver(driver::HostMemory),
}

/// Pinned host memory, readable and writable by the GPU.
#[derive(Clone, Debug)]
pub struct HostBuffer {
    pub(super) inner: Arc<HostInner>,
    pub(super) size: u64,
}

impl HostBuffer {
    /// The backend that allocated this buffer.
    pub fn backend(&self) -> Backend {
        match &*self.inner {
            HostInner::Direct(_) => Backend::Direct,
            HostInner::Driver(_) => Backend::Driver,
        }
    }

    /// The direct path's RM memory (system memory mapped for the CPU), when that backend allocated the buffer.
    pub fn direct(&self) -> Option<&Memory> {
        match &*self.inner {
            HostInner::Direct(m) => Some(m),
            HostInner::Driver(_) => None,
        }
    }

    /// libcuda's pinned allocation, when the driver backend allocated the buffer.
    pub fn driver(&self) -> Option<&driver::HostMemory> {
        match &*self.inner {
            HostInner::Driver(m) => Some(m),
            HostInner::Direct(_) => None,
        }
    }

    /// The address the GPU uses for it.
    pub fn device_ptr(&self) -> u64 {
        match &*self.inner {
            HostInner::Direct(m) => m.va(),
            HostInner::Driver(m) => m.ptr(),
        }
    }

    /// Bytes allocated.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Copies `data` into the buffer at `offset` by the CPU (the memory is mapped); range-checked.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        match &*self.inner {
            HostInner::Direct(m) => Ok(m.write(offset, data)?),
            HostInner::Driver(m) => Ok(m.write(offset, data)?),
        }
    }

    /// Copies from the buffer at `offset` into `out` by the CPU; range-checked.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        match &*self.inner {
            HostInner::Direct(m) => Ok(m.read(offset, out)?),
            HostInner::Driver(m) => Ok(m.read(offset, out)?),
        }
    }
}
