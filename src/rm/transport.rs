//! The seam between the RM client and what answers it: the kernel driver's ioctls ([`super::hardware`]) or an
//! in-process RM (the simulator, [`super::sim`]). [`Client`](super::Client) holds one [`Transport`] and never
//! knows which.
//!
//! The operations are RM's own (alloc, control, free, dup, CPU mappings) plus UVM's, at the level of their
//! parameter structs: callers build the same structs for both transports, so the code above is the code that
//! runs on hardware. A transport that is itself the GPU ([`InProcessGpu`]) also backs the memory its GPU reaches,
//! which UVM does on hardware.

use std::ffi::c_void;
use std::fmt::Debug;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use super::Result;
use super::mapping::CpuMapping;

/// Handle of an RM object, unique within its client.
pub type Handle = u32;

/// What [`Transport::map_cpu`] maps: an RM memory or usermode object, as `NV_ESC_RM_MAP_MEMORY` names it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CpuMapRequest {
    /// The device the object belongs to.
    pub device: Handle,
    /// The object to map.
    pub object: Handle,
    /// Whether the object is system memory (mapped through /dev/nvidiactl) rather than video memory or a
    /// register page (mapped through the GPU's own node, /dev/nvidiaN).
    pub system: bool,
    /// The minor number N of the GPU's /dev/nvidiaN.
    pub minor: u32,
    /// Bytes to map.
    pub len: usize,
    /// `NVOS33_FLAGS_*` (caching type).
    pub flags: u32,
    /// The CPU address to map at, inside a reservation of ours; anywhere when `None`.
    pub fixed: Option<u64>,
}

/// Where RM and UVM calls go. Implementations answer every call of one root client.
pub(crate) trait Transport: Send + Sync + Debug {
    /// Allocates the root client (`NV01_ROOT_CLIENT`) every object of this transport's client lives under.
    fn alloc_root(&self) -> Result<Handle>;

    /// `NV_ESC_RM_ALLOC` of `class` under `parent`, with the class's allocation parameters.
    ///
    /// # Safety
    /// `params` is null or points to `size` bytes, the allocation parameter struct of `class`, exclusively lent
    /// for the call; every pointer inside it is valid for the access RM makes.
    unsafe fn alloc(
        &self,
        client: Handle,
        parent: Handle,
        class: u32,
        params: *mut c_void,
        size: usize,
        what: &'static str,
    ) -> Result<Handle>;

    /// `NV_ESC_RM_CONTROL` `cmd` on `object`.
    ///
    /// # Safety
    /// `params` points to `size` bytes, the parameter struct of `cmd`, exclusively lent for the call; every
    /// pointer inside it is valid for the access RM makes.
    unsafe fn control(
        &self,
        client: Handle,
        object: Handle,
        cmd: u32,
        params: *mut c_void,
        size: usize,
        what: &'static str,
    ) -> Result<()>;

    /// `NV_ESC_RM_FREE` of `handle` and everything under it.
    fn free(&self, client: Handle, parent: Handle, handle: Handle) -> Result<()>;

    /// `NV_ESC_RM_DUP_OBJECT`: a handle in `client` (under `parent`) for object `src` of client `src_client`.
    fn dup(
        &self,
        client: Handle,
        parent: Handle,
        src_client: Handle,
        src: Handle,
        what: &'static str,
    ) -> Result<Handle>;

    /// UVM ioctl `cmd`. The status UVM returns is left in the parameter struct (`rmStatus`) for the caller to
    /// read; a transport without UVM leaves the struct as it was given.
    ///
    /// # Safety
    /// `params` points to the `UVM_*_PARAMS` struct of `cmd`, exclusively lent for the call.
    unsafe fn uvm(&self, cmd: u32, params: *mut c_void, what: &'static str) -> Result<()>;

    /// Maps an RM object for the CPU (`NV_ESC_RM_MAP_MEMORY`, then `mmap`).
    fn map_cpu(&self, client: Handle, req: &CpuMapRequest) -> Result<CpuMapping>;

    /// /dev/nvidiactl, for calls made on it outside this client (finding CUDA's client); an error where there is
    /// none.
    fn ctl(&self) -> Result<&OwnedFd>;

    /// The UVM descriptor UVM calls go to, for sharing its VA space with another client; `None` where there is
    /// none.
    fn uvm_fd(&self) -> Option<BorrowedFd<'_>>;

    /// The GPU itself, when this transport is one (the simulator): see [`InProcessGpu`].
    fn in_process_gpu(&self) -> Option<&dyn InProcessGpu> {
        None
    }
}

/// A transport that is itself the GPU. On hardware UVM maps memory for the GPU and RM owns the doorbell page;
/// an in-process GPU does both: memory is backed where the GPU will look for it, and it owns its doorbell.
pub(crate) trait InProcessGpu {
    /// Backs `[va, va + size)`, inside one of our `PROT_NONE` reservations, with memory the CPU and this GPU
    /// both reach at `va`, as memory object `memory`.
    fn back(&self, memory: Handle, va: u64, size: u64) -> Result<()>;

    /// Lets this GPU reach `[va, va + size)`, memory another GPU of the process backs (a peer mapping).
    fn reach(&self, va: u64, size: u64);

    /// Forgets the range at `va`: once this returns the GPU can no longer touch it.
    fn forget(&self, va: u64);

    /// The usermode page holding the doorbell, alive as long as the transport.
    fn usermode_page(&self) -> NonNull<u8>;
}
