//! The CUDA driver API backend, on cudarc's raw `driver::sys` layer with libcuda loaded at run time.
//!
//! This is the fallback behind the same public API when the direct path cannot run, and the reference the
//! benchmarks measure against. Like `rm/` for the direct path, it is the one place where this backend's FFI
//! `unsafe` lives; everything it hands out is safe to use.
//!
//! Beside the driver's objects (contexts, memory, modules, functions, streams, graphs, pools) it holds this
//! backend's side of every public type, as `launch`, `module` and `rm` hold the direct path's: [`Queue`] (every
//! launch kind, copies, fills, waits, graph replays), [`Prepared`], [`StreamFence`], [`QueueGraph`],
//! [`LoadedModule`] and [`Kernel`]. They check launches with the launch layer's own checks and report failures as
//! [`BackendError`].

use std::ffi::{CStr, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use cudarc::driver::sys as cu;

mod graph;
mod loaded;
mod pool;
mod queue;
pub use graph::{GraphExec, GraphNode};
pub use loaded::{Kernel, LoadedModule};
pub use pool::{MemPool, PoolAttribute, free_async_unordered};
pub use queue::{
    BackendError, BackendResult, CudaOrder, LaunchMode, MAX_PARAM_BYTES, Prepared, Queue,
    QueueGraph, StreamFence,
};

/// A failed CUDA driver call.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// libcuda could not be loaded.
    #[error(
        "libcuda.so.1 (the CUDA driver library) could not be loaded, so the CUDA driver backend cannot run; install \
         the NVIDIA driver's user-space libraries (e.g. `libnvidia-compute-580`) or add their directory to \
         LD_LIBRARY_PATH"
    )]
    NoLibrary,
    /// A CUDA driver call returned an error.
    #[error("{call} failed with {name} ({code}){}", call_hint(*code))]
    Call {
        /// The driver function.
        call: &'static str,
        /// The CUresult.
        code: u32,
        /// Its name.
        name: String,
    },
    /// An argument the caller passed is not valid; the text says which and why.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Attaching needs a CUDA context current on the calling thread.
    #[error(
        "no CUDA context is current on this thread: create or make one current (cuCtxSetCurrent, or any CUDA \
         runtime call) before attaching APEX to it"
    )]
    NoCurrentContext,
    /// A sticky error: a kernel faulted, trapped or timed out, and the CUDA context is dead. Every later call on
    /// it fails the same way; the objects made from it must be dropped and the GPU opened again.
    #[error(
        "{call} failed: {name} ({code}); the CUDA context is unusable after this error (a kernel faulted, trapped \
         or ran too long): drop this Gpu and everything made from it (queues, buffers, modules, fences), then open \
         the GPU again (on the direct path, or in a new process if libcuda refuses this one a new context)"
    )]
    ContextLost {
        /// The call that reported it.
        call: &'static str,
        /// The CUresult.
        code: u32,
        /// Its name.
        name: String,
    },
    /// libcuda refuses this process any new context after a sticky error: measured on driver 580.159.04 after
    /// CUDA_ERROR_LAUNCH_FAILED, where `cuDevicePrimaryCtxReset` succeeds but the next retain and `cuCtxCreate`
    /// fail with the same error (the CUDA documentation: "the process must be terminated and relaunched").
    #[error(
        "{call} failed: {name} ({code}): libcuda refuses this process a new CUDA context after an earlier kernel \
         fault, even after resetting the device's primary context; the CUDA driver backend can be used again only \
         in a new process (the direct path, APEX_BACKEND=direct, does not depend on libcuda and still works)"
    )]
    ProcessLost {
        /// The call that reported it.
        call: &'static str,
        /// The CUresult.
        code: u32,
        /// Its name.
        name: String,
    },
}

/// What to do about the CUresults a user meets first on a machine that is not set up.
fn call_hint(code: u32) -> &'static str {
    match code {
        100 => "; no CUDA-capable GPU is visible: check `nvidia-smi` and CUDA_VISIBLE_DEVICES",
        101 => "; the GPU index is out of range: `nvidia-smi -L` lists the GPUs",
        2 => "; the GPU is out of memory: free memory or use a smaller allocation",
        35 | 803 | 804 => {
            "; the CUDA driver library does not match the loaded kernel module: reinstall the NVIDIA driver \
             (user-space and kernel parts of one version)"
        }
        999 => "; the CUDA driver failed to initialise: check `dmesg` and `nvidia-smi`",
        _ => "",
    }
}

impl Error {
    /// Whether the CUDA context is dead ([`Error::ContextLost`]): the GPU must be opened again.
    pub fn is_context_lost(&self) -> bool {
        matches!(self, Error::ContextLost { .. })
    }

    /// Whether libcuda refuses this process any new context ([`Error::ProcessLost`]).
    pub fn is_process_lost(&self) -> bool {
        matches!(self, Error::ProcessLost { .. })
    }
}

/// The driver backend's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors after which the context is unusable (the CUDA documentation: "the process is left in an inconsistent
/// state and any further CUDA work will return the same error").
fn is_sticky(r: cu::CUresult) -> bool {
    use cu::CUresult as R;
    matches!(
        r,
        R::CUDA_ERROR_ECC_UNCORRECTABLE
            | R::CUDA_ERROR_ILLEGAL_ADDRESS
            | R::CUDA_ERROR_LAUNCH_TIMEOUT
            | R::CUDA_ERROR_ASSERT
            | R::CUDA_ERROR_HARDWARE_STACK_ERROR
            | R::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | R::CUDA_ERROR_MISALIGNED_ADDRESS
            | R::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | R::CUDA_ERROR_INVALID_PC
            | R::CUDA_ERROR_LAUNCH_FAILED
    )
}

fn check(call: &'static str, r: cu::CUresult) -> Result<()> {
    if r == cu::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string (or leaves it null for unknown codes).
    let name = unsafe {
        cu::cuGetErrorName(r, &mut p);
        if p.is_null() {
            format!("{r:?}")
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    if is_sticky(r) {
        tracing::warn!(call, error = %name, "CUDA context lost");
        return Err(Error::ContextLost {
            call,
            code: r as u32,
            name,
        });
    }
    Err(Error::Call {
        call,
        code: r as u32,
        name,
    })
}

/// Live [`Context`]s per device ordinal: a dead primary context is reset only when APEX holds none of it.
static LIVE: std::sync::Mutex<Vec<(cu::CUdevice, usize)>> = std::sync::Mutex::new(Vec::new());

fn live_count(device: cu::CUdevice, delta: isize) -> usize {
    let mut live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
    let i = match live.iter().position(|(d, _)| *d == device) {
        Some(i) => i,
        None => {
            live.push((device, 0));
            live.len() - 1
        }
    };
    live[i].1 = live[i].1.saturating_add_signed(delta);
    live[i].1
}

/// How many devices CUDA lists (after `CUDA_VISIBLE_DEVICES`).
pub fn device_count() -> Result<usize> {
    if !is_available() {
        return Err(Error::NoLibrary);
    }
    let mut n = 0;
    // SAFETY: plain driver calls with an out-pointer to a local.
    unsafe {
        check("cuInit", cu::cuInit(0))?;
        check("cuDeviceGetCount", cu::cuDeviceGetCount(&mut n))?;
    }
    Ok(usize::try_from(n).unwrap_or(0))
}

/// The UUID of every device CUDA lists, in ordinal order.
pub fn device_uuids() -> Result<Vec<[u8; 16]>> {
    (0..device_count()?)
        .map(|i| {
            let mut device = 0;
            // SAFETY: out-pointer to a local; `i` is below the device count.
            check("cuDeviceGet", unsafe {
                cu::cuDeviceGet(&mut device, i as i32)
            })?;
            device_uuid(device)
        })
        .collect()
}

fn device_uuid(device: cu::CUdevice) -> Result<[u8; 16]> {
    let mut uuid = cu::CUuuid { bytes: [0; 16] };
    // SAFETY: out-pointer to a local.
    check("cuDeviceGetUuid", unsafe {
        cu::cuDeviceGetUuid_v2(&mut uuid, device)
    })?;
    Ok(uuid.bytes.map(|b| b as u8))
}

/// Whether libcuda can be loaded, without panicking when it cannot.
pub fn is_available() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { cu::is_culib_present() }
}

/// A device's primary context, current on whichever thread uses this backend.
#[derive(Debug)]
pub struct Context {
    ctx: cu::CUcontext,
    device: cu::CUdevice,
    /// Which retain this is (see [`Context::bind`]).
    generation: usize,
}

// SAFETY: a CUDA context handle may be used from any thread once made current there (which `bind` does).
unsafe impl Send for Context {}
// SAFETY: as above; the driver API is thread-safe.
unsafe impl Sync for Context {}

impl Context {
    /// Retains the primary context of device `ordinal` (CUDA's order, after `CUDA_VISIBLE_DEVICES`), as the
    /// runtime does. A primary context a kernel fault killed is reset first when nothing of APEX still uses it;
    /// if CUDA still refuses it, the error is [`Error::ProcessLost`].
    pub fn new(ordinal: usize) -> Result<Arc<Context>> {
        if !is_available() {
            return Err(Error::NoLibrary);
        }
        let ordinal = i32::try_from(ordinal)
            .map_err(|_| Error::InvalidArgument(format!("device {ordinal}")))?;
        let mut device = 0;
        // SAFETY: plain driver calls with out-pointers to locals.
        unsafe {
            check("cuInit", cu::cuInit(0))?;
            check("cuDeviceGet", cu::cuDeviceGet(&mut device, ordinal))?;
        }
        // A primary context that died under an earlier Gpu (a kernel fault) stays dead: CUDA refuses to retain it
        // (or hands it back dead) until it is reset.
        match Context::retain(device) {
            Ok(c) => match c.probe() {
                Ok(()) => return Ok(c),
                // Other APEX objects still use it: resetting would free memory under them.
                Err(e) if e.is_context_lost() && live_count(device, 0) > 1 => return Err(e),
                Err(e) if e.is_context_lost() => drop(c),
                Err(e) => return Err(e),
            },
            Err(e) if e.is_context_lost() && live_count(device, 0) > 0 => return Err(e),
            Err(e) if e.is_context_lost() => {}
            Err(e) => return Err(e),
        }
        tracing::warn!(device, "resetting the dead primary context");
        // SAFETY: no APEX object uses the context any more; the reset destroys its (dead) resources.
        check("cuDevicePrimaryCtxReset", unsafe {
            cu::cuDevicePrimaryCtxReset_v2(device)
        })?;
        let lost = |e: Error| match e {
            Error::ContextLost { call, code, name } => Error::ProcessLost { call, code, name },
            e => e,
        };
        let c = Context::retain(device).map_err(lost)?;
        c.probe().map_err(lost)?;
        Ok(c)
    }

    /// Retains the device's primary context and makes it current on this thread.
    fn retain(device: cu::CUdevice) -> Result<Arc<Context>> {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        check("cuDevicePrimaryCtxRetain", unsafe {
            cu::cuDevicePrimaryCtxRetain(&mut ctx, device)
        })?;
        live_count(device, 1);
        static GENERATION: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
        let generation = GENERATION.fetch_add(1, Ordering::Relaxed);
        let c = Arc::new(Context {
            ctx,
            device,
            generation,
        });
        c.bind()?;
        Ok(c)
    }

    /// [`Error::ContextLost`] if the context is dead; does not wait for work in flight (a busy context is alive).
    fn probe(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: queries the NULL stream of the current context.
        let r = unsafe { cu::cuStreamQuery(std::ptr::null_mut()) };
        if r == cu::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(());
        }
        check("cuStreamQuery", r)
    }

    /// Makes the context current on this thread (a no-op when it already is).
    pub fn bind(&self) -> Result<()> {
        // (context, generation) made current on this thread. A primary context keeps its handle when it is
        // destroyed and created again, so the generation (bumped by every retain) tells a new one apart.
        thread_local!(static CURRENT: std::cell::Cell<(usize, usize)> = const { std::cell::Cell::new((0, 0)) });
        let key = (self.ctx as usize, self.generation);
        if CURRENT.with(|c| c.get()) == key {
            return Ok(());
        }
        // SAFETY: the context is retained for our lifetime.
        check("cuCtxSetCurrent", unsafe { cu::cuCtxSetCurrent(self.ctx) })?;
        CURRENT.with(|c| c.set(key));
        Ok(())
    }

    /// The device's UUID.
    pub fn uuid(&self) -> Result<[u8; 16]> {
        device_uuid(self.device)
    }

    /// Whether this context's device can map `other`'s memory (`cuDeviceCanAccessPeer`).
    pub fn can_access_peer(&self, other: &Context) -> Result<bool> {
        if self.device == other.device {
            return Ok(true);
        }
        let mut v = 0;
        // SAFETY: out-pointer to a local; both devices are valid ordinals of retained contexts.
        check("cuDeviceCanAccessPeer", unsafe {
            cu::cuDeviceCanAccessPeer(&mut v, self.device, other.device)
        })?;
        Ok(v != 0)
    }

    /// Lets this context's kernels and copies address `other`'s memory (`cuCtxEnablePeerAccess`); enabling twice
    /// is not an error.
    pub fn enable_peer_access(&self, other: &Context) -> Result<()> {
        if self.device == other.device {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both contexts are retained for our lifetimes; flags must be 0.
        let r = unsafe { cu::cuCtxEnablePeerAccess(other.ctx, 0) };
        if r == cu::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(());
        }
        check("cuCtxEnablePeerAccess", r)
    }

    /// The device's name (`cuDeviceGetName`: `NVIDIA H200`).
    pub fn name(&self) -> Result<String> {
        let mut buf = [0 as std::ffi::c_char; 256];
        // SAFETY: the buffer is 256 bytes and the driver NUL-terminates within the length given.
        unsafe {
            check(
                "cuDeviceGetName",
                cu::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, self.device),
            )?;
            Ok(CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned())
        }
    }

    /// One device attribute (`cuDeviceGetAttribute`).
    pub fn attribute(&self, a: cu::CUdevice_attribute) -> Result<i32> {
        let mut v = 0;
        // SAFETY: out-pointer to a local.
        check("cuDeviceGetAttribute", unsafe {
            cu::cuDeviceGetAttribute(&mut v, a, self.device)
        })?;
        Ok(v)
    }

    /// The device's memory, bytes (`cuDeviceTotalMem`).
    pub fn total_memory(&self) -> Result<u64> {
        let mut v = 0usize;
        // SAFETY: out-pointer to a local.
        check("cuDeviceTotalMem", unsafe {
            cu::cuDeviceTotalMem_v2(&mut v, self.device)
        })?;
        Ok(v as u64)
    }

    /// libcuda's version as CUDA numbers it (`cuDriverGetVersion`: 13000 for 13.0).
    pub fn driver_version(&self) -> Result<i32> {
        let mut v = 0;
        // SAFETY: out-pointer to a local.
        check("cuDriverGetVersion", unsafe {
            cu::cuDriverGetVersion(&mut v)
        })?;
        Ok(v)
    }

    /// Sets the device printf FIFO's size (`cuCtxSetLimit(CU_LIMIT_PRINTF_FIFO_SIZE)`), which CUDA allows only
    /// before a module that uses printf is loaded.
    pub fn set_printf_fifo_size(&self, bytes: u64) -> Result<()> {
        self.bind()?;
        // SAFETY: the context is current on this thread (bind); plain value argument.
        check("cuCtxSetLimit", unsafe {
            cu::cuCtxSetLimit(cu::CUlimit::CU_LIMIT_PRINTF_FIFO_SIZE, bytes as usize)
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: releases the retain taken in `retain`. The last release destroys the primary context, a dead one
        // included; `Context::new` resets one that something else kept alive.
        unsafe { cu::cuDevicePrimaryCtxRelease_v2(self.device) };
        live_count(self.device, -1);
    }
}

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

/// A module loaded by the driver (cubin, fatbin or PTX).
#[derive(Debug)]
pub struct Module {
    ctx: Arc<Context>,
    module: cu::CUmodule,
}

// SAFETY: module handles are usable from any thread with the context current.
unsafe impl Send for Module {}
// SAFETY: as above.
unsafe impl Sync for Module {}

impl Module {
    /// Loads a cubin, fatbin or PTX image into `ctx` (`cuModuleLoadData`); PTX is compiled by libcuda.
    pub fn load(ctx: &Arc<Context>, image: &[u8]) -> Result<Arc<Module>> {
        ctx.bind()?;
        // PTX must be NUL-terminated text; cubins and fatbins are binary and are passed as they are.
        let owned;
        let data =
            if image.first().is_some_and(|&b| b != 0x7f && b != 0x50) && !image.ends_with(&[0]) {
                owned = [image, &[0]].concat();
                owned.as_ptr()
            } else {
                image.as_ptr()
            };
        let mut module = std::ptr::null_mut();
        // SAFETY: `data` points to the image for the duration of the call.
        check("cuModuleLoadData", unsafe {
            cu::cuModuleLoadData(&mut module, data.cast())
        })?;
        Ok(Arc::new(Module {
            ctx: ctx.clone(),
            module,
        }))
    }

    /// The kernel `name` (its symbol, mangled), with its parameter layout (`cuFuncGetParamInfo`).
    pub fn function(self: &Arc<Self>, name: &str) -> Result<Function> {
        self.ctx.bind()?;
        let cname = std::ffi::CString::new(name)
            .map_err(|_| Error::InvalidArgument(format!("kernel name {name:?}")))?;
        let mut f = std::ptr::null_mut();
        // SAFETY: the name is NUL-terminated; the module is loaded.
        check("cuModuleGetFunction", unsafe {
            cu::cuModuleGetFunction(&mut f, self.module, cname.as_ptr())
        })?;
        // Parameter sizes, so launches can be checked like on the direct path.
        let mut params = Vec::new();
        loop {
            let (mut off, mut size) = (0usize, 0usize);
            // SAFETY: out-pointers to locals; the driver answers CUDA_ERROR_INVALID_VALUE past the last one.
            let r = unsafe { cu::cuFuncGetParamInfo(f, params.len(), &mut off, &mut size) };
            if r != cu::CUresult::CUDA_SUCCESS {
                break;
            }
            params.push((off as u32, size as u32));
        }
        let mut max_dynamic = 0;
        // SAFETY: out-pointer to a local; a live function.
        check("cuFuncGetAttribute", unsafe {
            cu::cuFuncGetAttribute(
                &mut max_dynamic,
                cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                f,
            )
        })?;
        Ok(Function {
            module: self.clone(),
            func: f,
            params,
            name: name.into(),
            max_dynamic: Arc::new(AtomicU32::new(max_dynamic.max(0) as u32)),
        })
    }

    /// The device address and size of the module variable `name` (`cuModuleGetGlobal`); `None` when the module
    /// has none of that name.
    pub fn global(&self, name: &str) -> Result<Option<(u64, u64)>> {
        self.ctx.bind()?;
        let cname = std::ffi::CString::new(name)
            .map_err(|_| Error::InvalidArgument(format!("variable name {name:?}")))?;
        let (mut ptr, mut size) = (0, 0usize);
        // SAFETY: the name is NUL-terminated; out-pointers to locals; the module is loaded.
        let r =
            unsafe { cu::cuModuleGetGlobal_v2(&mut ptr, &mut size, self.module, cname.as_ptr()) };
        if r == cu::CUresult::CUDA_ERROR_NOT_FOUND {
            return Ok(None);
        }
        check("cuModuleGetGlobal", r)?;
        Ok(Some((ptr, size as u64)))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: unloads our own module once; its functions hold an Arc to it.
        unsafe { cu::cuModuleUnload(self.module) };
    }
}

/// A kernel of a driver module, with its parameter (offset, size) table.
#[derive(Clone, Debug)]
pub struct Function {
    module: Arc<Module>,
    func: cu::CUfunction,
    params: Vec<(u32, u32)>,
    /// The name it was looked up by.
    name: Arc<str>,
    /// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` as last set or read (shared by clones), so a launch sets
    /// it only when it asks for more.
    max_dynamic: Arc<AtomicU32>,
}

// SAFETY: function handles are usable from any thread with the context current.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

impl Function {
    /// Each parameter's offset and size in bytes, in order, as the driver reports them.
    pub fn params(&self) -> &[(u32, u32)] {
        &self.params
    }

    /// libcuda's handle, for calls APEX does not wrap.
    pub fn raw(&self) -> cu::CUfunction {
        self.func
    }

    /// The kernel's name (as it was looked up).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Sets how much dynamic shared memory launches may ask for (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`;
    /// 48 KiB until set).
    pub fn set_max_dynamic_shared(&self, bytes: u32) -> Result<()> {
        let value = i32::try_from(bytes).map_err(|_| {
            Error::InvalidArgument(format!("{bytes} bytes of dynamic shared memory"))
        })?;
        self.module.ctx.bind()?;
        // SAFETY: a plain attribute set on a live function.
        check("cuFuncSetAttribute", unsafe {
            cu::cuFuncSetAttribute(
                self.func,
                cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                value,
            )
        })?;
        self.max_dynamic.store(bytes, Ordering::Relaxed);
        Ok(())
    }

    /// Raises the dynamic shared memory limit to `bytes` if it is lower (once per new maximum, not per launch): the
    /// driver refuses launches above 48 KiB with CUDA_ERROR_INVALID_VALUE otherwise.
    fn ensure_dynamic_shared(&self, bytes: u32) -> Result<()> {
        if bytes > self.max_dynamic.load(Ordering::Relaxed) {
            self.set_max_dynamic_shared(bytes)?;
        }
        Ok(())
    }

    /// The module the kernel belongs to (kept loaded by the function).
    pub fn module(&self) -> &Arc<Module> {
        &self.module
    }
}

/// Which driver call launches a kernel on a [`Stream`] ([`Stream::launch_as`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchKind {
    /// `cuLaunchKernel`. A kernel's compile-time `__cluster_dims__` needs nothing more.
    Plain,
    /// `cuLaunchCooperativeKernel`: every block resident at once, for the grid barrier (`grid.sync()`).
    Cooperative,
    /// `cuLaunchKernelEx` with this run-time thread block cluster shape (`CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION`),
    /// in blocks; the grid is in blocks too.
    Cluster([u32; 3]),
    /// `cuLaunchKernelEx` with `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION` set (programmatic dependent
    /// launch after the stream's previous kernel), and a run-time cluster shape if one is given.
    Programmatic(Option<[u32; 3]>),
    /// `cuLaunchKernelEx` with every attribute APEX's launch configuration can ask for.
    Attributed(LaunchAttributes),
}

/// What a [`LaunchKind::Attributed`] launch asks `cuLaunchKernelEx` for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaunchAttributes {
    /// A run-time cluster shape, in blocks.
    pub cluster: Option<[u32; 3]>,
    /// Programmatic stream serialization.
    pub programmatic: bool,
    /// Every block resident at once (`CU_LAUNCH_ATTRIBUTE_COOPERATIVE`).
    pub cooperative: bool,
    /// The memory sync domain the kernel runs in (0 to 3): sent as the default domain mapped to it.
    pub sync_domain: u8,
    /// `CUclusterSchedulingPolicy` (0: default, 1: spread, 2: load balancing).
    pub cluster_policy: u32,
}

/// `cuLaunchKernelEx` with the attributes `a` asks for.
///
/// # Safety
/// `func` is a live function of the current context, `stream` a live stream of it, and `args` the kernel's
/// parameter pointers, valid for the call.
unsafe fn launch_ex(
    func: cu::CUfunction,
    [gx, gy, gz]: [u32; 3],
    [bx, by, bz]: [u32; 3],
    shared: u32,
    stream: cu::CUstream,
    args: *mut *mut c_void,
    a: LaunchAttributes,
) -> Result<()> {
    use cu::CUlaunchAttributeID as Id;
    let none = cu::CUlaunchAttribute {
        id: Id::CU_LAUNCH_ATTRIBUTE_IGNORE,
        pad: [0; 4],
        value: cu::CUlaunchAttributeValue { pad: [0; 64] },
    };
    let mut attrs = [none; 6];
    let mut n = 0;
    let mut push = |id: Id, value: cu::CUlaunchAttributeValue| {
        attrs[n] = cu::CUlaunchAttribute {
            id,
            pad: [0; 4],
            value,
        };
        n += 1;
    };
    if let Some([x, y, z]) = a.cluster {
        let mut value = cu::CUlaunchAttributeValue { pad: [0; 64] };
        value.clusterDim = cu::CUlaunchAttributeValue_union__bindgen_ty_1 { x, y, z };
        push(Id::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, value);
    }
    if a.programmatic {
        let mut value = cu::CUlaunchAttributeValue { pad: [0; 64] };
        value.programmaticStreamSerializationAllowed = 1;
        push(
            Id::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            value,
        );
    }
    if a.cooperative {
        let mut value = cu::CUlaunchAttributeValue { pad: [0; 64] };
        value.cooperative = 1;
        push(Id::CU_LAUNCH_ATTRIBUTE_COOPERATIVE, value);
    }
    if a.sync_domain != 0 {
        // The launch's own map sends the default domain to the physical one asked for.
        let mut value = cu::CUlaunchAttributeValue { pad: [0; 64] };
        value.memSyncDomainMap = cu::CUlaunchMemSyncDomainMap {
            default_: a.sync_domain,
            remote: a.sync_domain,
        };
        push(Id::CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN_MAP, value);
    }
    if a.cluster_policy != 0 {
        use cu::CUclusterSchedulingPolicy as P;
        let mut value = cu::CUlaunchAttributeValue { pad: [0; 64] };
        value.clusterSchedulingPolicyPreference = match a.cluster_policy {
            1 => P::CU_CLUSTER_SCHEDULING_POLICY_SPREAD,
            2 => P::CU_CLUSTER_SCHEDULING_POLICY_LOAD_BALANCING,
            _ => P::CU_CLUSTER_SCHEDULING_POLICY_DEFAULT,
        };
        push(
            Id::CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE,
            value,
        );
    }
    let config = cu::CUlaunchConfig {
        gridDimX: gx,
        gridDimY: gy,
        gridDimZ: gz,
        blockDimX: bx,
        blockDimY: by,
        blockDimZ: bz,
        sharedMemBytes: shared,
        hStream: stream,
        attrs: attrs.as_mut_ptr(),
        numAttrs: n as u32,
    };
    // SAFETY: `config` and the attributes it points to live for the call; the caller guarantees the rest.
    check("cuLaunchKernelEx", unsafe {
        cu::cuLaunchKernelEx(&config, func, args, std::ptr::null_mut())
    })
}

/// A non-blocking stream.
#[derive(Debug)]
pub struct Stream {
    ctx: Arc<Context>,
    stream: cu::CUstream,
}

// SAFETY: streams are usable from any thread with the context current; `&mut self` serialises our use.
unsafe impl Send for Stream {}

/// Most parameters a launch passes through the driver (cuLaunchKernel takes an array of pointers).
pub const MAX_PARAMS: usize = 512;

/// The reusable array of parameter pointers a launch hands to cuLaunchKernel (allocated once per queue).
#[derive(Debug, Default)]
pub struct ParamPtrs(Vec<*mut c_void>);

// SAFETY: the pointers are only meaningful during one launch call on the thread making it; between calls the
// array holds stale addresses that are never dereferenced.
unsafe impl Send for ParamPtrs {}

impl ParamPtrs {
    /// An empty array with room for `n` pointers.
    pub fn with_capacity(n: usize) -> ParamPtrs {
        ParamPtrs(Vec::with_capacity(n))
    }

    /// Empties the array (keeping its allocation).
    pub fn clear(&mut self) {
        self.0.clear();
    }

    /// Appends the pointer to the next parameter's value.
    pub fn push(&mut self, p: *mut c_void) {
        self.0.push(p);
    }

    /// The pointers, as the launch call takes them.
    pub fn as_mut_slice(&mut self) -> &mut [*mut c_void] {
        &mut self.0
    }
}

impl Stream {
    /// A non-blocking stream in `ctx` (`cuStreamCreate` with `CU_STREAM_NON_BLOCKING`).
    pub fn new(ctx: &Arc<Context>) -> Result<Stream> {
        ctx.bind()?;
        let mut s = std::ptr::null_mut();
        // SAFETY: out-pointer to a local. CU_STREAM_NON_BLOCKING = 1.
        check("cuStreamCreate", unsafe { cu::cuStreamCreate(&mut s, 1) })?;
        Ok(Stream {
            ctx: ctx.clone(),
            stream: s,
        })
    }

    /// libcuda's handle, for calls APEX does not wrap.
    pub fn raw(&self) -> cu::CUstream {
        self.stream
    }

    /// A copyable reference to the stream, for waiting on it without borrowing it.
    pub fn handle(&self) -> StreamRef {
        StreamRef(self.stream)
    }

    /// The context the stream belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// A kernel of another context (another device's) cannot run on this stream: refused before the driver sees it.
    fn check_context(&self, f: &Function) -> Result<()> {
        if f.module.ctx.ctx == self.ctx.ctx {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "kernel `{}` belongs to a module loaded in another context (another GPU) than the queue's stream; load \
             the module on the queue's GPU",
            f.name
        )))
    }

    /// cuLaunchKernel with one pointer per parameter.
    ///
    /// # Safety
    /// `params[i]` must point to a value of the size the kernel's parameter `i` has, alive for the call; the
    /// kernel may access any memory its arguments lead it to.
    pub unsafe fn launch(
        &mut self,
        f: &Function,
        grid: [u32; 3],
        block: [u32; 3],
        shared: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: forwarded to the caller.
        unsafe { self.launch_as(LaunchKind::Plain, f, grid, block, shared, params) }
    }

    /// Launches `f` on this stream with the driver call `kind` names: the one place the checks every launch
    /// needs (the kernel's context, the current context, the dynamic shared memory limit) are made.
    ///
    /// # Safety
    /// As for [`Stream::launch`].
    pub unsafe fn launch_as(
        &mut self,
        kind: LaunchKind,
        f: &Function,
        grid: [u32; 3],
        block: [u32; 3],
        shared: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        self.check_context(f)?;
        self.ctx.bind()?;
        f.ensure_dynamic_shared(shared)?;
        let [gx, gy, gz] = grid;
        let [bx, by, bz] = block;
        let (stream, args) = (self.stream, params.as_mut_ptr());
        match kind {
            // SAFETY: the caller guarantees the parameter pointers.
            LaunchKind::Plain => check("cuLaunchKernel", unsafe {
                cu::cuLaunchKernel(
                    f.func,
                    gx,
                    gy,
                    gz,
                    bx,
                    by,
                    bz,
                    shared,
                    stream,
                    args,
                    std::ptr::null_mut(),
                )
            }),
            // SAFETY: as above.
            LaunchKind::Cooperative => check("cuLaunchCooperativeKernel", unsafe {
                cu::cuLaunchCooperativeKernel(f.func, gx, gy, gz, bx, by, bz, shared, stream, args)
            }),
            LaunchKind::Cluster(cluster) => {
                let a = LaunchAttributes {
                    cluster: Some(cluster),
                    ..LaunchAttributes::default()
                };
                // SAFETY: forwarded.
                unsafe { launch_ex(f.func, grid, block, shared, stream, args, a) }
            }
            LaunchKind::Programmatic(cluster) => {
                let a = LaunchAttributes {
                    cluster,
                    programmatic: true,
                    ..LaunchAttributes::default()
                };
                // SAFETY: forwarded.
                unsafe { launch_ex(f.func, grid, block, shared, stream, args, a) }
            }
            // SAFETY: forwarded.
            LaunchKind::Attributed(a) => unsafe {
                launch_ex(f.func, grid, block, shared, stream, args, a)
            },
        }
    }

    /// Waits until everything submitted to the stream is complete (`cuStreamSynchronize`).
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: a live stream.
        check("cuStreamSynchronize", unsafe {
            cu::cuStreamSynchronize(self.stream)
        })
    }

    /// Whether everything submitted so far is complete.
    pub fn is_idle(&self) -> Result<bool> {
        self.ctx.bind()?;
        // SAFETY: a live stream.
        let r = unsafe { cu::cuStreamQuery(self.stream) };
        if r == cu::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuStreamQuery", r).map(|_| true)
    }

    /// Asynchronous copy between device addresses (or host memory mapped for the device).
    ///
    /// # Safety
    /// Both ranges must stay valid until the stream has executed the copy.
    pub unsafe fn copy(&mut self, dst: u64, src: u64, bytes: u64) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: forwarded to the caller; cuMemcpyAsync works out the direction from unified addresses.
        check("cuMemcpyAsync", unsafe {
            cu::cuMemcpyAsync(dst, src, bytes as usize, self.stream)
        })
    }

    /// Asynchronous memset of `count` elements of `width` bytes (1, 2 or 4) at `dst` to `value`'s low bytes
    /// (`cuMemsetD8Async`, `cuMemsetD16Async`, `cuMemsetD32Async`).
    ///
    /// # Safety
    /// The range must stay valid until the stream has executed the memset.
    pub unsafe fn fill(&mut self, dst: u64, value: u32, width: u32, count: u64) -> Result<()> {
        self.ctx.bind()?;
        let n = count as usize;
        // SAFETY: forwarded to the caller.
        unsafe {
            match width {
                1 => check(
                    "cuMemsetD8Async",
                    cu::cuMemsetD8Async(dst, value as u8, n, self.stream),
                ),
                2 => check(
                    "cuMemsetD16Async",
                    cu::cuMemsetD16Async(dst, value as u16, n, self.stream),
                ),
                4 => check(
                    "cuMemsetD32Async",
                    cu::cuMemsetD32Async(dst, value, n, self.stream),
                ),
                _ => Err(Error::Call {
                    call: "cuMemsetD*Async",
                    code: 1,
                    name: format!("an element width of {width} bytes (1, 2 or 4)"),
                }),
            }
        }
    }

    /// Asynchronous copy from `src` in `src_ctx`'s device memory to `dst` in `dst_ctx`'s (`cuMemcpyPeerAsync`):
    /// over the peer link where there is one, staged by the driver where not.
    ///
    /// # Safety
    /// Both ranges must stay valid until the stream has executed the copy.
    pub unsafe fn copy_peer(
        &mut self,
        dst: u64,
        dst_ctx: &Context,
        src: u64,
        src_ctx: &Context,
        bytes: u64,
    ) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: forwarded to the caller; both contexts are retained.
        check("cuMemcpyPeerAsync", unsafe {
            cu::cuMemcpyPeerAsync(
                dst,
                dst_ctx.ctx,
                src,
                src_ctx.ctx,
                bytes as usize,
                self.stream,
            )
        })
    }

    /// Synchronous copy of pageable host memory to the device.
    pub fn upload(&mut self, dst: u64, data: &[u8]) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: `data` is alive for the call; the copy completes before returning (stream-ordered, then synced).
        unsafe {
            check(
                "cuMemcpyHtoDAsync",
                cu::cuMemcpyHtoDAsync_v2(dst, data.as_ptr().cast(), data.len(), self.stream),
            )?;
        }
        self.synchronize()
    }

    /// Synchronous copy of device memory to pageable host memory.
    pub fn download(&mut self, src: u64, out: &mut [u8]) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: as in `upload`.
        unsafe {
            check(
                "cuMemcpyDtoHAsync",
                cu::cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), src, out.len(), self.stream),
            )?;
        }
        self.synchronize()
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: destroys our own stream once (pending work completes first, as the driver specifies).
        unsafe { cu::cuStreamDestroy_v2(self.stream) };
    }
}

/// A stream's handle, for fences that outlive a borrow of the stream's queue.
#[derive(Clone, Copy, Debug)]
pub struct StreamRef(cu::CUstream);

// SAFETY: a stream handle may be queried from any thread with its context current.
unsafe impl Send for StreamRef {}
// SAFETY: as above.
unsafe impl Sync for StreamRef {}

impl StreamRef {
    /// The raw stream handle.
    pub fn raw(self) -> cu::CUstream {
        self.0
    }

    /// Whether everything submitted to the stream so far is complete.
    pub fn is_idle(self, ctx: &Context) -> Result<bool> {
        ctx.bind()?;
        // SAFETY: the handle came from a live `Stream`; a stream destroyed since makes the driver return an
        // error code (handles are validated), not undefined behaviour.
        let r = unsafe { cu::cuStreamQuery(self.0) };
        if r == cu::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuStreamQuery", r).map(|_| true)
    }
}

/// A CUDA graph captured from a stream and instantiated, for replay with cuGraphLaunch.
#[derive(Debug)]
pub struct Graph {
    ctx: Arc<Context>,
    graph: cu::CUgraph,
    exec: cu::CUgraphExec,
}

// SAFETY: graph handles are usable from any thread with the context current.
unsafe impl Send for Graph {}

impl Graph {
    /// Records what `record` submits to `stream` into a graph.
    pub fn capture(
        stream: &mut Stream,
        record: impl FnOnce(&mut Stream) -> Result<()>,
    ) -> Result<Graph> {
        stream.ctx.bind()?;
        // SAFETY: begins capture on a live stream; CU_STREAM_CAPTURE_MODE_THREAD_LOCAL.
        check("cuStreamBeginCapture", unsafe {
            cu::cuStreamBeginCapture_v2(
                stream.stream,
                cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        })?;
        let recorded = record(stream);
        let mut graph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above (always, so the stream is usable again).
        let ended = check("cuStreamEndCapture", unsafe {
            cu::cuStreamEndCapture(stream.stream, &mut graph)
        });
        recorded?;
        ended?;
        let mut exec = std::ptr::null_mut();
        // SAFETY: instantiates the graph just captured.
        check("cuGraphInstantiate", unsafe {
            cu::cuGraphInstantiateWithFlags(&mut exec, graph, 0)
        })?;
        Ok(Graph {
            ctx: stream.ctx.clone(),
            graph,
            exec,
        })
    }

    /// Replays the graph on `stream` (`cuGraphLaunch`).
    pub fn launch(&self, stream: &mut Stream) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: launches our instantiated graph on a live stream.
        check("cuGraphLaunch", unsafe {
            cu::cuGraphLaunch(self.exec, stream.stream)
        })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: destroys our own objects once.
        unsafe {
            cu::cuGraphExecDestroy(self.exec);
            cu::cuGraphDestroy(self.graph);
        }
    }
}

/// Makes `waiter` wait, on the GPU, for everything submitted to `signaler` so far (an event recorded on one and
/// waited for by the other), both streams of `ctx`.
///
/// # Safety
/// Both must be valid streams of `ctx` (null: its legacy default stream).
pub unsafe fn order_streams(
    ctx: &Context,
    waiter: cu::CUstream,
    signaler: cu::CUstream,
) -> Result<()> {
    ctx.bind()?;
    let mut ev = std::ptr::null_mut();
    // SAFETY: the context is current; the event is destroyed below (CUDA keeps it until its record completes).
    unsafe {
        check(
            "cuEventCreate",
            cu::cuEventCreate(&mut ev, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32),
        )?;
        let r = check("cuEventRecord", cu::cuEventRecord(ev, signaler))
            .and_then(|()| check("cuStreamWaitEvent", cu::cuStreamWaitEvent(waiter, ev, 0)));
        cu::cuEventDestroy_v2(ev);
        r
    }
}

/// Makes `waiter` (a stream of `waiter_ctx`) wait, on the GPU, for everything submitted so far to `signaler` (a
/// stream of `signaler_ctx`, possibly another device's): an event recorded on one and waited for by the other.
///
/// # Safety
/// Both must be valid streams of their contexts (null: the context's legacy default stream).
pub unsafe fn order_streams_across(
    waiter_ctx: &Context,
    waiter: cu::CUstream,
    signaler_ctx: &Context,
    signaler: cu::CUstream,
) -> Result<()> {
    signaler_ctx.bind()?;
    let mut ev = std::ptr::null_mut();
    // SAFETY: the signaler's context is current for the event's creation and record; the waiter's for the wait
    // (CUDA allows waiting on another device's event); CUDA keeps the event until its record completes.
    unsafe {
        check(
            "cuEventCreate",
            cu::cuEventCreate(&mut ev, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32),
        )?;
        let r = check("cuEventRecord", cu::cuEventRecord(ev, signaler))
            .and_then(|()| waiter_ctx.bind())
            .and_then(|()| check("cuStreamWaitEvent", cu::cuStreamWaitEvent(waiter, ev, 0)));
        cu::cuEventDestroy_v2(ev);
        r
    }
}

/// A CUDA context of this process that APEX attaches to (see `apex::Gpu::attach_cuda`): its handle, device and
/// GPU UUID. When it is the device's primary context, APEX holds a retain on it so it lives as long as this does;
/// a context the program created itself must outlive everything APEX builds on it.
#[derive(Debug)]
pub struct CudaContext {
    ctx: cu::CUcontext,
    device: cu::CUdevice,
    primary_retained: bool,
    uuid: [u8; 16],
}

// SAFETY: a CUDA context handle may be used from any thread; every use pushes it current first.
unsafe impl Send for CudaContext {}
// SAFETY: as above; the driver API is thread-safe.
unsafe impl Sync for CudaContext {}

/// Pops the context [`CudaContext::push`] made current.
struct Pushed;

impl Drop for Pushed {
    fn drop(&mut self) {
        let mut old = std::ptr::null_mut();
        // SAFETY: pops the context pushed by `push` on this thread.
        unsafe { cu::cuCtxPopCurrent_v2(&mut old) };
    }
}

impl CudaContext {
    /// The context current on the calling thread.
    pub fn current() -> Result<Arc<CudaContext>> {
        if !is_available() {
            return Err(Error::NoLibrary);
        }
        let mut ctx = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        let r = unsafe { cu::cuCtxGetCurrent(&mut ctx) };
        // Before cuInit there is no context at all.
        if r == cu::CUresult::CUDA_ERROR_NOT_INITIALIZED {
            return Err(Error::NoCurrentContext);
        }
        check("cuCtxGetCurrent", r)?;
        if ctx.is_null() {
            return Err(Error::NoCurrentContext);
        }
        let mut device = 0;
        let mut uuid = cu::CUuuid_st { bytes: [0; 16] };
        // SAFETY: the context is current on this thread; out-pointers to locals.
        unsafe {
            check("cuCtxGetDevice", cu::cuCtxGetDevice(&mut device))?;
            check("cuDeviceGetUuid", cu::cuDeviceGetUuid_v2(&mut uuid, device))?;
        }
        let mut primary = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; released in Drop (or right here when it is another context).
        check("cuDevicePrimaryCtxRetain", unsafe {
            cu::cuDevicePrimaryCtxRetain(&mut primary, device)
        })?;
        let primary_retained = primary == ctx;
        if !primary_retained {
            // SAFETY: releases the retain just taken.
            unsafe { cu::cuDevicePrimaryCtxRelease_v2(device) };
        }
        Ok(Arc::new(CudaContext {
            ctx,
            device,
            primary_retained,
            uuid: uuid.bytes.map(|b| b as u8),
        }))
    }

    /// The primary context of device `ordinal` (CUDA's order, after `CUDA_VISIBLE_DEVICES`), retained (and so
    /// created, if nothing in the process made it yet) for as long as the returned value lives: the context the
    /// CUDA runtime and PyTorch use on that device.
    pub fn primary(ordinal: usize) -> Result<Arc<CudaContext>> {
        if !is_available() {
            return Err(Error::NoLibrary);
        }
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::InvalidArgument(format!(
                "CUDA device {ordinal} (this process sees {count})"
            )));
        }
        let mut device = 0;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: out-pointers to locals; `ordinal` is below the device count. The retain is released in Drop.
        unsafe {
            check("cuDeviceGet", cu::cuDeviceGet(&mut device, ordinal as i32))?;
            check(
                "cuDevicePrimaryCtxRetain",
                cu::cuDevicePrimaryCtxRetain(&mut ctx, device),
            )?;
        }
        let made = CudaContext {
            ctx,
            device,
            primary_retained: true,
            uuid: device_uuid(device)?,
        };
        Ok(Arc::new(made))
    }

    /// The context `ctx` of this process (made by `cuCtxCreate`, the runtime, PyTorch...): its device is asked of
    /// CUDA with the context pushed on this thread for the call. A primary context is retained, as in
    /// [`CudaContext::current`].
    ///
    /// # Safety
    /// `ctx` must be a live CUDA context of this process, and must outlive the returned value unless it is a
    /// primary context.
    pub unsafe fn from_raw(ctx: cu::CUcontext) -> Result<Arc<CudaContext>> {
        if !is_available() {
            return Err(Error::NoLibrary);
        }
        if ctx.is_null() {
            return Err(Error::InvalidArgument("a null CUDA context".into()));
        }
        // SAFETY: the caller's promise that `ctx` is live; popped by `Pushed` before this returns.
        check("cuCtxPushCurrent", unsafe { cu::cuCtxPushCurrent_v2(ctx) })?;
        let pushed = Pushed;
        let current = CudaContext::current();
        drop(pushed);
        current
    }

    /// The raw handle.
    pub fn raw(&self) -> cu::CUcontext {
        self.ctx
    }

    /// The device ordinal, when the context is the device's primary context (which the driver backend uses).
    pub fn primary_ordinal(&self) -> Option<usize> {
        self.primary_retained
            .then(|| usize::try_from(self.device).ok())
            .flatten()
    }

    /// The UUID of the context's GPU.
    pub fn uuid(&self) -> [u8; 16] {
        self.uuid
    }

    fn push(&self) -> Result<Pushed> {
        // SAFETY: the context is alive (retained, or guaranteed by the caller of `attach_cuda`).
        check("cuCtxPushCurrent", unsafe {
            cu::cuCtxPushCurrent_v2(self.ctx)
        })?;
        Ok(Pushed)
    }

    /// `bytes` of device memory from `cuMemAlloc`, zeroed: words that CUDA streams and APEX queues both write
    /// and wait on.
    pub fn sync_words(self: &Arc<Self>, bytes: u64) -> Result<SyncWords> {
        let _current = self.push()?;
        let mut ptr = 0;
        // SAFETY: the context is current; out-pointer to a local.
        check("cuMemAlloc", unsafe {
            cu::cuMemAlloc_v2(&mut ptr, bytes as usize)
        })?;
        let words = SyncWords {
            ctx: self.clone(),
            ptr,
            bytes,
        };
        // SAFETY: `ptr` holds `bytes` bytes, `bytes / 4` 32-bit words.
        check("cuMemsetD32", unsafe {
            cu::cuMemsetD32_v2(ptr, 0, (bytes / 4) as usize)
        })?;
        Ok(words)
    }
}

impl Drop for CudaContext {
    fn drop(&mut self) {
        if self.primary_retained {
            // SAFETY: releases the retain taken in `current`.
            unsafe { cu::cuDevicePrimaryCtxRelease_v2(self.device) };
        }
    }
}

/// Device memory in an attached CUDA context that holds 64-bit counters for ordering CUDA streams with APEX
/// queues without the CPU: a stream writes a counter (`cuStreamWriteValue64`) that a queue's semaphore acquire
/// waits for, and waits (`cuStreamWaitValue64`) for a counter a queue's semaphore release writes.
#[derive(Debug)]
pub struct SyncWords {
    ctx: Arc<CudaContext>,
    ptr: cu::CUdeviceptr,
    bytes: u64,
}

impl SyncWords {
    /// Device address of the first word.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    fn at(&self, offset: u64) -> Result<u64> {
        if !offset.is_multiple_of(8) || offset + 8 > self.bytes {
            return Err(Error::InvalidArgument(format!(
                "sync word at offset {offset} of a {}-byte block",
                self.bytes
            )));
        }
        Ok(self.ptr + offset)
    }

    /// Makes `stream` write `value` at `offset` once all its earlier work is done (and visible).
    ///
    /// # Safety
    /// `stream` must be a valid stream of the context these words belong to (null: its legacy default stream).
    pub unsafe fn write_after(&self, stream: cu::CUstream, offset: u64, value: u64) -> Result<()> {
        let addr = self.at(offset)?;
        let _current = self.ctx.push()?;
        // SAFETY: `addr` is 8 bytes inside this allocation; `stream` is a stream of the attached context (the
        // caller's promise, as for any stream handle).
        check("cuStreamWriteValue64", unsafe {
            cu::cuStreamWriteValue64_v2(
                stream,
                addr,
                value,
                cu::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        })
    }

    /// Makes `stream` wait, before its later work, until the word at `offset` is at least `value`.
    ///
    /// # Safety
    /// As for [`SyncWords::write_after`].
    pub unsafe fn wait_on(&self, stream: cu::CUstream, offset: u64, value: u64) -> Result<()> {
        let addr = self.at(offset)?;
        let _current = self.ctx.push()?;
        // SAFETY: as in `write_after`.
        check("cuStreamWaitValue64", unsafe {
            cu::cuStreamWaitValue64_v2(
                stream,
                addr,
                value,
                cu::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        })
    }
}

impl Drop for SyncWords {
    fn drop(&mut self) {
        if let Ok(_current) = self.ctx.push() {
            // SAFETY: frees the allocation made in `sync_words`, with its context current.
            unsafe { cu::cuMemFree_v2(self.ptr) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sticky_errors_are_the_ones_that_kill_the_context() {
        use cu::CUresult as R;
        for r in [
            R::CUDA_ERROR_ILLEGAL_ADDRESS,
            R::CUDA_ERROR_LAUNCH_FAILED,
            R::CUDA_ERROR_ILLEGAL_INSTRUCTION,
            R::CUDA_ERROR_ASSERT,
            R::CUDA_ERROR_LAUNCH_TIMEOUT,
        ] {
            assert!(is_sticky(r), "{r:?}");
        }
        for r in [
            R::CUDA_ERROR_INVALID_VALUE,
            R::CUDA_ERROR_OUT_OF_MEMORY,
            R::CUDA_ERROR_NOT_FOUND,
            R::CUDA_ERROR_NOT_READY,
        ] {
            assert!(!is_sticky(r), "{r:?}");
        }
        let e = Error::ContextLost {
            call: "cuStreamQuery",
            code: 719,
            name: "CUDA_ERROR_LAUNCH_FAILED".into(),
        };
        assert!(e.is_context_lost());
        assert!(e.to_string().contains("open the GPU again"), "{e}");
    }
}
