//! The RM client: a root client handle over a [`Transport`] (the kernel driver, or an in-process RM), and
//! RAII handles for RM objects.

use std::ffi::c_void;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use tracing::warn;

use super::Result;
use super::control::RmControl;
use super::error::check;
use super::mapping::CpuMapping;
pub use super::transport::Handle;
use super::transport::{CpuMapRequest, InProcessGpu, Transport};

/// One RM root client and the transport its calls go through. Freed (with every object under it) on drop.
#[derive(Debug)]
pub struct Client {
    handle: Handle,
    transport: Arc<dyn Transport>,
}

impl Client {
    /// A root client allocated through `transport`; every call of the client goes there.
    pub(crate) fn over(transport: Arc<dyn Transport>) -> Result<Client> {
        let handle = transport.alloc_root()?;
        // Counted from here: dropping the client frees it again.
        LIVE_OBJECTS.fetch_add(1, Ordering::Relaxed);
        own_clients().push(handle);
        Ok(Client { handle, transport })
    }

    /// The UVM descriptor RM-level UVM calls go to (none for a transport without UVM).
    pub(crate) fn uvm_fd(&self) -> Option<BorrowedFd<'_>> {
        self.transport.uvm_fd()
    }

    /// The root client's handle: the `hClient`/`hRoot` of every call this client makes.
    pub fn handle(&self) -> Handle {
        self.handle
    }

    /// /dev/nvidiactl; an error for a transport that has none.
    pub(crate) fn ctl(&self) -> Result<&OwnedFd> {
        self.transport.ctl()
    }

    /// The control fd as UVM calls name it (-1 for a transport without one, whose UVM calls do nothing).
    pub(crate) fn ctl_raw_fd(&self) -> i32 {
        self.transport.ctl().map_or(-1, |fd| fd.as_raw_fd())
    }

    /// The GPU itself, when the transport is one: it backs memory and owns the doorbell page.
    pub(crate) fn in_process_gpu(&self) -> Option<&dyn InProcessGpu> {
        self.transport.in_process_gpu()
    }

    /// Whether RM calls are answered in process (by the GPU model CI uses) instead of by the kernel driver.
    pub fn is_in_process(&self) -> bool {
        self.in_process_gpu().is_some()
    }

    /// NV_ESC_RM_ALLOC of `class` under `parent`, with the class's allocation parameters.
    pub fn alloc<P>(
        &self,
        parent: Handle,
        class: u32,
        params: Option<&mut P>,
        what: &'static str,
    ) -> Result<Handle> {
        let ptr = params.map_or(std::ptr::null_mut(), |p| (p as *mut P).cast::<c_void>());
        // SAFETY: `ptr` is null or the caller's exclusively borrowed `P`, which outlives the call; the caller picks
        // `P` to be the class's allocation parameters.
        unsafe {
            self.transport
                .alloc(self.handle, parent, class, ptr, size_of::<P>(), what)
        }
    }

    /// NV_ESC_RM_CONTROL on `object`: the command `P` is bound to ([`RmControl`]), with `params`.
    pub fn ctrl<P: RmControl>(&self, object: Handle, params: &mut P) -> Result<()> {
        // SAFETY: `params` is a live, exclusively borrowed `P` of `size_of::<P>()` bytes, and `P: RmControl` makes
        // it the parameter struct of `P::CMD`.
        unsafe {
            self.transport.control(
                self.handle,
                object,
                P::CMD,
                (params as *mut P).cast(),
                size_of::<P>(),
                P::NAME,
            )
        }
    }

    /// NV_ESC_RM_FREE of `handle` (and everything RM holds under it).
    pub fn free(&self, parent: Handle, handle: Handle) -> Result<()> {
        self.transport.free(self.handle, parent, handle)
    }

    /// A UVM ioctl whose parameter struct ends in an `rmStatus`, read back through `status`.
    pub(crate) fn uvm_call<P>(
        &self,
        cmd: u32,
        params: &mut P,
        what: &'static str,
        status: fn(&P) -> u32,
    ) -> Result<()> {
        // SAFETY: callers pass the UVM_*_PARAMS struct that belongs to `cmd`, exclusively borrowed.
        unsafe { self.transport.uvm(cmd, (params as *mut P).cast(), what)? };
        check("UVM", what, status(params))
    }

    /// Maps an object of this client for the CPU (see [`CpuMapRequest`]).
    pub(crate) fn map_cpu(&self, req: &CpuMapRequest) -> Result<CpuMapping> {
        self.transport.map_cpu(self.handle, req)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        // Freeing the root client frees every object allocated under it; dropping the transport (closing its
        // descriptors) follows.
        match self.free(0, self.handle) {
            Ok(()) => {
                LIVE_OBJECTS.fetch_sub(1, Ordering::Relaxed);
            }
            Err(e) => warn!(error = %e, "freeing the RM root client failed"),
        }
        let mut own = own_clients();
        if let Some(i) = own.iter().position(|&h| h == self.handle) {
            own.swap_remove(i);
        }
    }
}

/// Root clients of this process that APEX allocated and has not freed. A search for CUDA's client skips them:
/// an earlier attachment's client holds duplicates of CUDA's channel group and VA spaces, which would otherwise
/// pass for a CUDA context.
static OWN_CLIENTS: std::sync::Mutex<Vec<Handle>> = std::sync::Mutex::new(Vec::new());

fn own_clients() -> std::sync::MutexGuard<'static, Vec<Handle>> {
    // A panic while holding the list cannot leave it inconsistent (single push or swap_remove).
    OWN_CLIENTS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether `handle` is a root client APEX allocated in this process and still holds.
pub fn is_own_client(handle: Handle) -> bool {
    own_clients().contains(&handle)
}

/// RM objects (root clients included) this process allocated through APEX and has not freed.
static LIVE_OBJECTS: AtomicI64 = AtomicI64::new(0);

/// How many RM objects (root clients included) APEX holds now, for leak checks.
pub fn live_objects() -> i64 {
    LIVE_OBJECTS.load(Ordering::Relaxed)
}

/// An RM object, freed on drop. It holds its parent, so RM objects are always freed children first.
#[derive(Debug)]
pub struct Object {
    client: Arc<Client>,
    parent: Option<Arc<Object>>,
    handle: Handle,
    class: u32,
    what: &'static str,
}

impl Object {
    /// Allocates `class` under `parent` (or under the root client when `parent` is None).
    pub fn alloc<P>(
        client: &Arc<Client>,
        parent: Option<&Arc<Object>>,
        class: u32,
        params: Option<&mut P>,
        what: &'static str,
    ) -> Result<Object> {
        let parent_handle = parent.map_or(client.handle(), |p| p.handle);
        let handle = client.alloc(parent_handle, class, params, what)?;
        LIVE_OBJECTS.fetch_add(1, Ordering::Relaxed);
        Ok(Object {
            client: client.clone(),
            parent: parent.cloned(),
            handle,
            class,
            what,
        })
    }

    /// A handle in `client` (under `parent`) for object `src` of another client of this process
    /// (`NV_ESC_RM_DUP_OBJECT`); freeing it drops this client's reference only.
    pub fn dup(
        client: &Arc<Client>,
        parent: &Arc<Object>,
        src_client: Handle,
        src: Handle,
        class: u32,
        what: &'static str,
    ) -> Result<Object> {
        let handle = client
            .transport
            .dup(client.handle, parent.handle, src_client, src, what)?;
        LIVE_OBJECTS.fetch_add(1, Ordering::Relaxed);
        Ok(Object {
            client: client.clone(),
            parent: Some(parent.clone()),
            handle,
            class,
            what,
        })
    }

    /// The object's handle within its client.
    pub fn handle(&self) -> Handle {
        self.handle
    }

    /// The class the object was allocated as.
    pub fn class(&self) -> u32 {
        self.class
    }

    /// The client the object belongs to (kept alive by the object).
    pub fn client(&self) -> &Arc<Client> {
        &self.client
    }

    /// NV_ESC_RM_CONTROL on this object: the command `P` is bound to ([`RmControl`]), with `params`.
    pub fn ctrl<P: RmControl>(&self, params: &mut P) -> Result<()> {
        self.client.ctrl(self.handle, params)
    }
}

impl Drop for Object {
    fn drop(&mut self) {
        let parent = self
            .parent
            .as_ref()
            .map_or(self.client.handle(), |p| p.handle);
        match self.client.free(parent, self.handle) {
            Ok(()) => {
                LIVE_OBJECTS.fetch_sub(1, Ordering::Relaxed);
            }
            Err(e) => {
                warn!(error = %e, what = self.what, handle = format_args!("{:#x}", self.handle), "RM_FREE failed");
            }
        }
    }
}
