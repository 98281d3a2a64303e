//! What a queue keeps alive while its copies run: the buffers and modules on either side of a copy.

use super::{Buffer, Global, HostBuffer, Module};

/// An object a copy in flight reads or writes, held until the copy's fence completes.
#[derive(Debug)]
#[allow(dead_code)]
pub(super) enum KeepAlive {
    Device(Buffer),
    Host(HostBuffer),
    Module(Module),
}

/// One side of a copy: device address, buffer size, offset, and the buffer, kept alive while the copy runs.
pub(super) type Endpoint = (u64, u64, u64, KeepAlive);

impl Buffer {
    pub(super) fn endpoint(&self, offset: u64) -> Endpoint {
        (
            self.device_ptr(),
            self.size,
            offset,
            KeepAlive::Device(self.clone()),
        )
    }
}

impl HostBuffer {
    pub(super) fn endpoint(&self, offset: u64) -> Endpoint {
        (
            self.device_ptr(),
            self.size,
            offset,
            KeepAlive::Host(self.clone()),
        )
    }
}

impl Global {
    pub(super) fn endpoint(&self, offset: u64) -> Endpoint {
        (
            self.device_ptr,
            self.size,
            offset,
            KeepAlive::Module(self.module.clone()),
        )
    }
}
