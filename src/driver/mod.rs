//! The CUDA driver API backend, on cudarc's raw `driver::sys` layer with libcuda loaded at run time.
//!
//! This is the fallback behind the same public API when the direct path cannot run, and the reference the
//! benchmarks measure against. Like `rm/` for the direct path, it is the one place where this backend's FFI
//! `unsafe` lives; everything it hands out is safe to use.

use std::ffi::{CStr, c_void};
use std::sync::Arc;

use cudarc::driver::sys as cu;

/// A failed CUDA driver call.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error(
        "libcuda is not installed or cannot be loaded (the CUDA driver backend needs libcuda.so.1)"
    )]
    NoLibrary,
    #[error("{call} failed: {name} ({code})")]
    Call {
        call: &'static str,
        code: u32,
        name: String,
    },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

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
    Err(Error::Call {
        call,
        code: r as u32,
        name,
    })
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
}

// SAFETY: a CUDA context handle may be used from any thread once made current there (which `bind` does).
unsafe impl Send for Context {}
// SAFETY: as above; the driver API is thread-safe.
unsafe impl Sync for Context {}

impl Context {
    pub fn new(ordinal: usize) -> Result<Arc<Context>> {
        if !is_available() {
            return Err(Error::NoLibrary);
        }
        let ordinal = i32::try_from(ordinal)
            .map_err(|_| Error::InvalidArgument(format!("device {ordinal}")))?;
        let mut device = 0;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: plain driver calls with out-pointers to locals.
        unsafe {
            check("cuInit", cu::cuInit(0))?;
            check("cuDeviceGet", cu::cuDeviceGet(&mut device, ordinal))?;
            check(
                "cuDevicePrimaryCtxRetain",
                cu::cuDevicePrimaryCtxRetain(&mut ctx, device),
            )?;
        }
        let c = Arc::new(Context { ctx, device });
        c.bind()?;
        Ok(c)
    }

    /// Makes the context current on this thread (a no-op when it already is).
    pub fn bind(&self) -> Result<()> {
        thread_local!(static CURRENT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) });
        if CURRENT.with(|c| c.get()) == self.ctx as usize {
            return Ok(());
        }
        // SAFETY: the context is retained for our lifetime.
        check("cuCtxSetCurrent", unsafe { cu::cuCtxSetCurrent(self.ctx) })?;
        CURRENT.with(|c| c.set(self.ctx as usize));
        Ok(())
    }

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

    pub fn attribute(&self, a: cu::CUdevice_attribute) -> Result<i32> {
        let mut v = 0;
        // SAFETY: out-pointer to a local.
        check("cuDeviceGetAttribute", unsafe {
            cu::cuDeviceGetAttribute(&mut v, a, self.device)
        })?;
        Ok(v)
    }

    pub fn total_memory(&self) -> Result<u64> {
        let mut v = 0usize;
        // SAFETY: out-pointer to a local.
        check("cuDeviceTotalMem", unsafe {
            cu::cuDeviceTotalMem_v2(&mut v, self.device)
        })?;
        Ok(v as u64)
    }

    pub fn driver_version(&self) -> Result<i32> {
        let mut v = 0;
        // SAFETY: out-pointer to a local.
        check("cuDriverGetVersion", unsafe {
            cu::cuDriverGetVersion(&mut v)
        })?;
        Ok(v)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: releases the retain taken in `new`.
        unsafe { cu::cuDevicePrimaryCtxRelease_v2(self.device) };
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

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

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

    pub fn ptr(&self) -> u64 {
        self.ptr as u64
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.bounds(offset, data.len() as u64)?;
        // SAFETY: bounds checked; the allocation lives as long as `self`.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset as usize), data.len())
        };
        Ok(())
    }

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
        Ok(Function {
            module: self.clone(),
            func: f,
            params,
        })
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
}

// SAFETY: function handles are usable from any thread with the context current.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

impl Function {
    pub fn params(&self) -> &[(u32, u32)] {
        &self.params
    }

    pub fn raw(&self) -> cu::CUfunction {
        self.func
    }

    pub fn set_max_dynamic_shared(&self, bytes: u32) -> Result<()> {
        // SAFETY: a plain attribute set on a live function.
        check("cuFuncSetAttribute", unsafe {
            cu::cuFuncSetAttribute(
                self.func,
                cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        })
    }

    pub fn module(&self) -> &Arc<Module> {
        &self.module
    }
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
    pub fn with_capacity(n: usize) -> ParamPtrs {
        ParamPtrs(Vec::with_capacity(n))
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }

    pub fn push(&mut self, p: *mut c_void) {
        self.0.push(p);
    }

    pub fn as_mut_slice(&mut self) -> &mut [*mut c_void] {
        &mut self.0
    }
}

impl Stream {
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

    pub fn raw(&self) -> cu::CUstream {
        self.stream
    }

    pub fn handle(&self) -> StreamRef {
        StreamRef(self.stream)
    }

    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
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
        self.ctx.bind()?;
        // SAFETY: the caller guarantees the parameter pointers.
        check("cuLaunchKernel", unsafe {
            cu::cuLaunchKernel(
                f.func,
                grid[0],
                grid[1],
                grid[2],
                block[0],
                block[1],
                block[2],
                shared,
                self.stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

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
