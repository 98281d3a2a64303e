//! What the engine asks of the CUDA driver, behind one seam ([`CudaSide`]): the current context (and, on the set-up
//! worker, making one current), stream flags,
//! function names and owners, module variables, the attach itself, the GPU-side hops between a queue and a CUDA
//! stream, recording a program's event after a queue's work, and replaying device asserts. [`Libcuda`] asks
//! libcuda's own functions (never a wrapper); tests plug in a double that runs APEX on the simulated GPU.

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

use apex::{AssertAction, AssertFailure, CudaRelease, Gpu, Queue, VariableHome};

use crate::order::StreamKey;
use crate::registry::Owner;

/// A queue's release that a CUDA stream can wait for later ([`CudaSide::release_for_cuda`]); `None` only from test
/// doubles, which release nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReleaseMark(pub(crate) Option<CudaRelease>);

/// `CUDA_SUCCESS`.
pub const CUDA_SUCCESS: c_int = 0;
/// `CUDA_ERROR_NOT_READY`: what `cuStreamQuery` and `cuEventQuery` return for work still running.
pub const CUDA_ERROR_NOT_READY: c_int = 600;
/// `CUDA_ERROR_ASSERT`: a device-side assert failed; the context is unusable from then on.
pub const CUDA_ERROR_ASSERT: c_int = 710;

/// What a pointer given to a copy is, as libcuda's `cuPointerGetAttributes` tells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pointer {
    /// Device memory of the current context, not managed, with `bytes` of its allocation from the pointer on.
    Device { bytes: u64 },
    /// Pinned host memory the GPU reaches at `device` (from the pointer on: `bytes`).
    Pinned { device: u64, bytes: u64 },
    /// Host memory CUDA does not know (pageable).
    Pageable,
    /// Anything else (managed memory, another context's, a virtual-memory mapping): left to libcuda.
    Other,
}

/// The CUDA driver as the engine sees it. Shared by the program's threads and the set-up worker
/// ([`crate::setup`]), which asks it for the attach and for module variables while launches go on.
pub(crate) trait CudaSide: Send + Sync {
    /// The calling thread's current context (`cuCtxGetCurrent`), if any.
    fn current_context(&self) -> Option<usize>;
    /// Makes `ctx` the calling thread's current context (`cuCtxSetCurrent`; `None`: no context), as the set-up
    /// worker does before it attaches, builds a queue or loads a module for a context of the program's.
    fn set_current(&self, ctx: Option<usize>) -> Result<(), String>;
    /// APEX attached to the current context, with device asserts set to end their thread (`true`) or left to trap
    /// (`false`: then kernels that call `__assertfail` stay on libcuda).
    fn attach(&self) -> Result<(Gpu, bool), String>;
    /// Whether a stream synchronizes with the legacy default stream (not `CU_STREAM_NON_BLOCKING`). Unknown:
    /// `true`, which relates it to more streams (more hops, never fewer).
    fn stream_blocking(&self, stream: usize) -> bool;
    /// A stream's priority (`cuStreamGetPriority`: 0 is the default and the lowest, lower numbers are higher
    /// priorities); 0 when libcuda cannot say.
    fn stream_priority(&self, stream: usize) -> i32;
    /// The context a stream belongs to (`cuStreamGetCtx`); `None` when libcuda cannot say.
    fn stream_context(&self, stream: usize) -> Option<usize>;
    /// A function's or kernel's name, asked of the driver.
    fn function_name(&self, f: usize) -> Option<String>;
    /// The most dynamic shared memory a launch of function or kernel `f` may ask for in the current context
    /// (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` as the program last set it); `None` when libcuda cannot say.
    fn max_dynamic_shared(&self, f: usize) -> Option<u32>;
    /// A function's module, if `known` says the preload saw it loaded; else a kernel's library.
    fn function_owner(&self, f: usize, known: &dyn Fn(usize) -> bool) -> Option<usize>;
    /// Where CUDA's instance of module or library `owner` keeps its variable `name`, in the current context.
    fn global(&self, owner: Owner, library: bool, name: &str) -> Option<VariableHome>;
    /// Makes CUDA `stream` wait on the GPU for everything submitted to `queue` so far.
    fn cuda_waits_for_apex(&self, queue: &mut Queue, stream: StreamKey) -> Result<(), String>;
    /// Releases, after everything submitted to `queue` so far, a mark a CUDA stream can wait for later
    /// ([`cuda_waits_for_release`](Self::cuda_waits_for_release)); no libcuda call.
    fn release_for_cuda(&self, queue: &mut Queue) -> Result<ReleaseMark, String>;
    /// Makes CUDA `stream` wait on the GPU for `release` of `queue` (and not for the queue's later work).
    fn cuda_waits_for_release(
        &self,
        queue: &mut Queue,
        stream: StreamKey,
        release: ReleaseMark,
    ) -> Result<(), String>;
    /// Whether CUDA `stream` holds no unfinished work (`cuStreamQuery` answers `CUDA_SUCCESS`).
    fn stream_idle(&self, stream: usize) -> bool;
    /// Makes `queue` wait on the GPU for everything submitted to CUDA `stream` so far.
    fn apex_waits_for_cuda(&self, queue: &mut Queue, stream: StreamKey) -> Result<(), String>;
    /// Records the program's `event` so that it completes once everything submitted to `queue` so far has, on a
    /// stream of the preload's own in context `ctx` (`side`, made on first use), so no stream of the program is
    /// touched.
    fn record_event_after(
        &self,
        ctx: usize,
        queue: &mut Queue,
        event: usize,
        side: &mut usize,
    ) -> Result<(), String>;
    /// Records the program's `event` on the preload's own stream of context `ctx`, with nothing before it (the work
    /// it stands for is complete).
    fn record_event_now(&self, ctx: usize, event: usize, side: &mut usize) -> Result<(), String>;
    /// Reports failed device asserts through libcuda, as libcuda reports its own: their messages on stderr, and
    /// context `ctx` left with `CUDA_ERROR_ASSERT`.
    fn replay_asserts(&self, ctx: usize, failures: &[AssertFailure]) -> Result<(), String>;
    /// What `ptr` points at, for a copy in context `ctx`.
    fn pointer(&self, ptr: u64, ctx: usize) -> Pointer;
    /// Whether a thread that waits for the GPU in context `ctx` sleeps rather than spins: the program made the
    /// context with `CU_CTX_SCHED_BLOCKING_SYNC` (`cudaDeviceScheduleBlockingSync`), as `cuCtxGetFlags` says while
    /// `ctx` is current on the calling thread (`false` while another one is).
    fn sleeps_while_waiting(&self, ctx: usize) -> bool;
    /// A new event of the preload's own in context `ctx` whose synchronize sleeps (`CU_EVENT_BLOCKING_SYNC`, no
    /// timing).
    fn sleeping_event(&self, ctx: usize) -> Result<usize, String>;
    /// Sleeps in libcuda until `event` (one of [`sleeping_event`](Self::sleeping_event)'s) completes.
    fn sleep_on_event(&self, event: usize) -> Result<(), String>;
}

// ---- libcuda's own functions (looked up with the real dlsym, never a wrapper) ----

/// A function slot's mark for "libcuda is loaded and has no such function" (an older driver): not looked up again,
/// since a lookup takes the loader's lock and the engine calls some of these under its own.
const ABSENT: usize = usize::MAX;

/// libcuda's function `name`: its address; `ABSENT` where libcuda is loaded without it; 0 where libcuda is not loaded
/// yet (asked again next time).
fn look_up(name: &CStr) -> usize {
    match apex_interpose::libcuda_symbol(name) {
        Some(p) => p,
        None if apex_interpose::libcuda_symbol(c"cuInit").is_some() => ABSENT,
        None => 0,
    }
}

macro_rules! driver_fn {
    ($getter:ident, $name:literal, $ty:ty) => {
        fn $getter() -> Option<$ty> {
            static SLOT: AtomicUsize = AtomicUsize::new(0);
            let mut p = SLOT.load(Ordering::Relaxed);
            if p == 0 {
                p = look_up($name);
                SLOT.store(p, Ordering::Relaxed);
            }
            // SAFETY: libcuda exports this function with this signature.
            (p != 0 && p != ABSENT).then(|| unsafe { std::mem::transmute::<usize, $ty>(p) })
        }
    };
}

driver_fn!(
    cu_ctx_get_current,
    c"cuCtxGetCurrent",
    unsafe extern "C" fn(*mut usize) -> c_int
);
/// Looks every libcuda function the engine calls up once, outside the engine's lock: a first lookup takes the
/// loader's lock (`dlopen` of libcuda with `RTLD_NOLOAD`), which a thread inside `dlopen` holds while its
/// constructors make CUDA calls whose hooks take the engine's. Whether libcuda was found (until it is, each
/// function is looked up at its first use, as before).
pub(crate) fn resolve_driver_functions() -> bool {
    let found = [
        cu_ctx_get_current().is_some(),
        cu_ctx_get_flags().is_some(),
        cu_ctx_set_current().is_some(),
        cu_stream_query().is_some(),
        cu_stream_get_priority().is_some(),
        cu_stream_get_flags().is_some(),
        cu_func_get_name().is_some(),
        cu_kernel_get_name().is_some(),
        cu_func_get_module().is_some(),
        cu_kernel_get_library().is_some(),
        cu_func_get_attribute().is_some(),
        cu_kernel_get_attribute().is_some(),
        cu_module_get_global().is_some(),
        cu_library_get_global().is_some(),
        cu_stream_create().is_some(),
        cu_event_record().is_some(),
        cu_module_load_data().is_some(),
        cu_module_get_function().is_some(),
        cu_mem_alloc().is_some(),
        cu_memcpy_htod().is_some(),
        cu_launch_kernel().is_some(),
        cu_pointer_get_attributes().is_some(),
        cu_ctx_push_current().is_some(),
        cu_ctx_pop_current().is_some(),
        cu_ctx_synchronize().is_some(),
        cu_event_create().is_some(),
        cu_event_query().is_some(),
        cu_event_synchronize().is_some(),
        cu_event_destroy().is_some(),
        cu_stream_get_ctx().is_some(),
        cu_ctx_get_device().is_some(),
        cu_device_get_mem_pool().is_some(),
        cu_device_get_default_mem_pool().is_some(),
        cu_mem_pool_get_attribute().is_some(),
        cu_mem_pool_trim_to().is_some(),
    ];
    found[0]
}

/// The context current on this thread, asked of libcuda directly (`None`: none, or no libcuda).
pub(crate) fn current_context() -> Option<usize> {
    let get = cu_ctx_get_current()?;
    let mut ctx = 0usize;
    // SAFETY: a live out-parameter.
    (unsafe { get(&mut ctx) } == 0 && ctx != 0).then_some(ctx)
}

driver_fn!(
    cu_ctx_get_flags,
    c"cuCtxGetFlags",
    unsafe extern "C" fn(*mut c_uint) -> c_int
);
/// `CU_CTX_SCHED_MASK` and `CU_CTX_SCHED_BLOCKING_SYNC`: how a context's threads wait for the GPU.
const CU_CTX_SCHED_MASK: c_uint = 0x07;
const CU_CTX_SCHED_BLOCKING_SYNC: c_uint = 0x04;
/// `CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING`.
const SLEEPING_EVENT_FLAGS: c_uint = 0x01 | 0x02;

driver_fn!(
    cu_ctx_set_current,
    c"cuCtxSetCurrent",
    unsafe extern "C" fn(usize) -> c_int
);

driver_fn!(
    cu_stream_query,
    c"cuStreamQuery",
    unsafe extern "C" fn(usize) -> c_int
);

driver_fn!(
    cu_stream_get_priority,
    c"cuStreamGetPriority",
    unsafe extern "C" fn(usize, *mut c_int) -> c_int
);
driver_fn!(
    cu_stream_get_flags,
    c"cuStreamGetFlags",
    unsafe extern "C" fn(usize, *mut c_uint) -> c_int
);
driver_fn!(
    cu_func_get_name,
    c"cuFuncGetName",
    unsafe extern "C" fn(*mut *const c_char, usize) -> c_int
);
driver_fn!(
    cu_kernel_get_name,
    c"cuKernelGetName",
    unsafe extern "C" fn(*mut *const c_char, usize) -> c_int
);
driver_fn!(
    cu_func_get_module,
    c"cuFuncGetModule",
    unsafe extern "C" fn(*mut usize, usize) -> c_int
);
driver_fn!(
    cu_kernel_get_library,
    c"cuKernelGetLibrary",
    unsafe extern "C" fn(*mut usize, usize) -> c_int
);
driver_fn!(
    cu_func_get_attribute,
    c"cuFuncGetAttribute",
    unsafe extern "C" fn(*mut c_int, c_int, usize) -> c_int
);
driver_fn!(
    cu_kernel_get_attribute,
    c"cuKernelGetAttribute",
    unsafe extern "C" fn(*mut c_int, c_int, usize, c_int) -> c_int
);
driver_fn!(
    cu_module_get_global,
    c"cuModuleGetGlobal_v2",
    unsafe extern "C" fn(*mut u64, *mut usize, usize, *const c_char) -> c_int
);
driver_fn!(
    cu_library_get_global,
    c"cuLibraryGetGlobal",
    unsafe extern "C" fn(*mut u64, *mut usize, usize, *const c_char) -> c_int
);
driver_fn!(
    cu_stream_create,
    c"cuStreamCreate",
    unsafe extern "C" fn(*mut usize, c_uint) -> c_int
);
driver_fn!(
    cu_event_record,
    c"cuEventRecord",
    unsafe extern "C" fn(usize, usize) -> c_int
);
driver_fn!(
    cu_module_load_data,
    c"cuModuleLoadData",
    unsafe extern "C" fn(*mut usize, *const c_void) -> c_int
);
driver_fn!(
    cu_module_get_function,
    c"cuModuleGetFunction",
    unsafe extern "C" fn(*mut usize, usize, *const c_char) -> c_int
);
driver_fn!(
    cu_mem_alloc,
    c"cuMemAlloc_v2",
    unsafe extern "C" fn(*mut u64, usize) -> c_int
);
driver_fn!(
    cu_memcpy_htod,
    c"cuMemcpyHtoD_v2",
    unsafe extern "C" fn(u64, *const c_void, usize) -> c_int
);
driver_fn!(
    cu_launch_kernel,
    c"cuLaunchKernel",
    apex_interpose::LaunchKernelFn
);
driver_fn!(
    cu_pointer_get_attributes,
    c"cuPointerGetAttributes",
    unsafe extern "C" fn(c_uint, *const c_uint, *mut *mut c_void, u64) -> c_int
);
driver_fn!(
    cu_ctx_push_current,
    c"cuCtxPushCurrent_v2",
    unsafe extern "C" fn(usize) -> c_int
);
driver_fn!(
    cu_ctx_pop_current,
    c"cuCtxPopCurrent_v2",
    unsafe extern "C" fn(*mut usize) -> c_int
);
driver_fn!(
    cu_ctx_synchronize,
    c"cuCtxSynchronize",
    unsafe extern "C" fn() -> c_int
);

driver_fn!(
    cu_event_create,
    c"cuEventCreate",
    unsafe extern "C" fn(*mut usize, c_uint) -> c_int
);
driver_fn!(
    cu_event_query,
    c"cuEventQuery",
    unsafe extern "C" fn(usize) -> c_int
);
driver_fn!(
    cu_event_synchronize,
    c"cuEventSynchronize",
    unsafe extern "C" fn(usize) -> c_int
);
driver_fn!(
    cu_event_destroy,
    c"cuEventDestroy_v2",
    unsafe extern "C" fn(usize) -> c_int
);
driver_fn!(
    cu_stream_get_ctx,
    c"cuStreamGetCtx",
    unsafe extern "C" fn(usize, *mut usize) -> c_int
);
driver_fn!(
    cu_ctx_get_device,
    c"cuCtxGetDevice",
    unsafe extern "C" fn(*mut c_int) -> c_int
);
driver_fn!(
    cu_device_get_mem_pool,
    c"cuDeviceGetMemPool",
    unsafe extern "C" fn(*mut usize, c_int) -> c_int
);
driver_fn!(
    cu_device_get_default_mem_pool,
    c"cuDeviceGetDefaultMemPool",
    unsafe extern "C" fn(*mut usize, c_int) -> c_int
);
driver_fn!(
    cu_mem_pool_get_attribute,
    c"cuMemPoolGetAttribute",
    unsafe extern "C" fn(usize, c_int, *mut c_void) -> c_int
);
driver_fn!(
    cu_mem_pool_trim_to,
    c"cuMemPoolTrimTo",
    unsafe extern "C" fn(usize, usize) -> c_int
);

/// `CUresult` of a missing libcuda function (`CUDA_ERROR_NOT_FOUND`).
const CUDA_ERROR_NOT_FOUND: c_int = 500;
/// `CU_EVENT_DISABLE_TIMING`.
const CU_EVENT_DISABLE_TIMING: c_uint = 2;
/// `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`.
const CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: c_int = 4;

/// A new event of the preload's in the current context, without timing (the cheapest to record and query).
pub(crate) fn event_create() -> Option<usize> {
    let create = cu_event_create()?;
    let mut e = 0usize;
    // SAFETY: a live out-parameter.
    (unsafe { create(&mut e, CU_EVENT_DISABLE_TIMING) } == CUDA_SUCCESS && e != 0).then_some(e)
}

/// libcuda's `cuEventRecord(event, stream)` (`stream` as the non-per-thread entry points take it).
pub(crate) fn event_record(event: usize, stream: usize) -> c_int {
    // SAFETY: libcuda validates both handles.
    cu_event_record().map_or(CUDA_ERROR_NOT_FOUND, |f| unsafe { f(event, stream) })
}

/// libcuda's `cuEventQuery`.
pub(crate) fn event_query(event: usize) -> c_int {
    // SAFETY: libcuda validates the handle.
    cu_event_query().map_or(CUDA_ERROR_NOT_FOUND, |f| unsafe { f(event) })
}

/// libcuda's `cuEventSynchronize`.
pub(crate) fn event_synchronize(event: usize) -> c_int {
    // SAFETY: libcuda validates the handle.
    cu_event_synchronize().map_or(CUDA_ERROR_NOT_FOUND, |f| unsafe { f(event) })
}

/// libcuda's `cuEventDestroy`.
pub(crate) fn event_destroy(event: usize) {
    if let Some(f) = cu_event_destroy() {
        // SAFETY: an event of the preload's, no longer used.
        let _ = unsafe { f(event) };
    }
}

/// Whether stream `handle` was made with `CU_STREAM_NON_BLOCKING` (`false` when libcuda cannot say).
pub(crate) fn stream_nonblocking(handle: usize) -> bool {
    let mut flags: c_uint = 0;
    // SAFETY: a live out-parameter; the driver validates the handle.
    cu_stream_get_flags()
        .is_some_and(|get| unsafe { get(handle, &mut flags) } == CUDA_SUCCESS && flags & 1 != 0)
}

/// The context of stream `handle` (a stream the program created).
pub(crate) fn stream_context(handle: usize) -> Option<usize> {
    let get = cu_stream_get_ctx()?;
    let mut ctx = 0usize;
    // SAFETY: a live out-parameter; libcuda validates the handle.
    (unsafe { get(handle, &mut ctx) } == CUDA_SUCCESS && ctx != 0).then_some(ctx)
}

/// The current context's device's (current memory pool, default memory pool).
pub(crate) fn memory_pools() -> Option<(usize, usize)> {
    let (device, current, default) = (
        cu_ctx_get_device()?,
        cu_device_get_mem_pool()?,
        cu_device_get_default_mem_pool()?,
    );
    let (mut dev, mut cur, mut def): (c_int, usize, usize) = (0, 0, 0);
    // SAFETY: live out-parameters; the device is the current context's.
    unsafe {
        (device(&mut dev) == CUDA_SUCCESS
            && current(&mut cur, dev) == CUDA_SUCCESS
            && default(&mut def, dev) == CUDA_SUCCESS)
            .then_some((cur, def))
    }
}

/// Trims `pool` to its release threshold, as the pool does itself at a synchronization.
pub(crate) fn trim_to_threshold(pool: usize) {
    let (Some(get), Some(trim)) = (cu_mem_pool_get_attribute(), cu_mem_pool_trim_to()) else {
        return;
    };
    let mut threshold = 0u64;
    // SAFETY: the attribute's value is a cuuint64_t.
    let r = unsafe {
        get(
            pool,
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    };
    if r == CUDA_SUCCESS {
        // SAFETY: a pool libcuda named the default one.
        let _ = unsafe { trim(pool, usize::try_from(threshold).unwrap_or(usize::MAX)) };
    }
}

/// `CU_STREAM_NON_BLOCKING`.
const CU_STREAM_NON_BLOCKING: c_uint = 1;

/// The replay kernel (preload/kernels/assert_replay.cu, built to PTX by preload/kernels/build.sh).
const REPLAY_PTX: &str = include_str!("../kernels/assert_replay.ptx");

fn call(what: &str, r: c_int) -> Result<(), String> {
    if r == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} returned CUresult {r}"))
    }
}

fn missing(name: &str) -> String {
    format!("libcuda has no {name}")
}

/// A function's name through `get` (cuFuncGetName or cuKernelGetName).
fn driver_name(
    get: Option<unsafe extern "C" fn(*mut *const c_char, usize) -> c_int>,
    f: usize,
) -> Option<String> {
    let get = get?;
    let mut name: *const c_char = std::ptr::null();
    // SAFETY: a live out-parameter; the driver validates the handle.
    if unsafe { get(&mut name, f) } != 0 || name.is_null() {
        return None;
    }
    // SAFETY: the driver returns a NUL-terminated name it owns.
    Some(
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned(),
    )
}

fn driver_owner(
    get: Option<unsafe extern "C" fn(*mut usize, usize) -> c_int>,
    f: usize,
) -> Option<usize> {
    let get = get?;
    let mut h = 0usize;
    // SAFETY: a live out-parameter; the driver validates the handle.
    (unsafe { get(&mut h, f) } == 0 && h != 0).then_some(h)
}

/// The CUDA driver of the process: libcuda's own functions.
pub(crate) struct Libcuda;

impl Libcuda {
    /// Runs `f` with context `ctx` current on this thread (pushed and popped when another one is).
    fn in_context<R>(
        &self,
        ctx: usize,
        f: impl FnOnce() -> Result<R, String>,
    ) -> Result<R, String> {
        if self.current_context() == Some(ctx) {
            return f();
        }
        let push = cu_ctx_push_current().ok_or_else(|| missing("cuCtxPushCurrent_v2"))?;
        let pop = cu_ctx_pop_current().ok_or_else(|| missing("cuCtxPopCurrent_v2"))?;
        // SAFETY: a context handle the engine attached to, live.
        call("cuCtxPushCurrent", unsafe { push(ctx) })?;
        let r = f();
        let mut popped = 0usize;
        // SAFETY: pops what was pushed above.
        let _ = unsafe { pop(&mut popped) };
        r
    }

    fn side_stream(side: &mut usize) -> Result<usize, String> {
        if *side == 0 {
            let create = cu_stream_create().ok_or_else(|| missing("cuStreamCreate"))?;
            let mut s = 0usize;
            // SAFETY: a live out-parameter.
            call("cuStreamCreate", unsafe {
                create(&mut s, CU_STREAM_NON_BLOCKING)
            })?;
            *side = s;
        }
        Ok(*side)
    }
}

/// `CUpointer_attribute`s asked of a copy's pointers.
const POINTER_ATTRIBUTES: [c_uint; 6] = [
    1,  // CONTEXT
    2,  // MEMORY_TYPE
    3,  // DEVICE_POINTER
    8,  // IS_MANAGED
    11, // RANGE_START_ADDR
    12, // RANGE_SIZE
];
/// `CUmemorytype`.
const MEMORYTYPE_HOST: u64 = 1;
const MEMORYTYPE_DEVICE: u64 = 2;

impl CudaSide for Libcuda {
    fn current_context(&self) -> Option<usize> {
        current_context()
    }

    fn set_current(&self, ctx: Option<usize>) -> Result<(), String> {
        let set = cu_ctx_set_current().ok_or_else(|| missing("cuCtxSetCurrent"))?;
        // SAFETY: null (no context current), or a context of the program's that the engine saw current on a
        // launching thread, made current as a set-up job starts: a job starts only while its context lives, since the
        // context's teardown (cuCtxDestroy, cuDevicePrimaryCtxReset, the exit) stops the worker first and drops every
        // job not yet started. (A job still running past the teardown's bound is abandoned inside its context: a
        // limit of the opt-in background mode, in docs/attach-cuda.md.)
        call("cuCtxSetCurrent", unsafe { set(ctx.unwrap_or(0)) })
    }

    fn attach(&self) -> Result<(Gpu, bool), String> {
        let gpu = Gpu::attach_cuda().map_err(|e| e.to_string())?;
        // With several contexts on the GPU, APEX's channel would join the oldest one's group, which need not be this
        // context's: its work would run under another context's time slices and faults, and a second context's
        // queue in the first one's group was seen to stall (a driver-API program with two contexts, H200,
        // 580.159.04). Such a context is left to libcuda; contexts attached while they were alone keep APEX.
        if let Some(n) = gpu.cuda_contexts_at_attach().filter(|&n| n > 1) {
            return Err(format!(
                "{n} CUDA contexts of this process use this GPU, and RM does not say which channel group is the \
                 current one's: this context's work stays on libcuda"
            ));
        }
        // A failed assert must end its thread, not fault the channel group: the group is the program's context,
        // and CUDA's report of the assert comes from the replay (`replay_asserts`).
        let ends_thread = gpu.set_assert_action(AssertAction::EndThread).is_ok();
        Ok((gpu, ends_thread))
    }

    fn stream_blocking(&self, stream: usize) -> bool {
        let mut flags: c_uint = 0;
        // SAFETY: a live out-parameter; the driver validates the handle.
        cu_stream_get_flags()
            .is_none_or(|get| unsafe { get(stream, &mut flags) } != 0 || flags & 1 == 0)
    }

    fn stream_priority(&self, stream: usize) -> i32 {
        let mut priority: c_int = 0;
        // SAFETY: a live out-parameter; the driver validates the handle.
        match cu_stream_get_priority().map(|get| unsafe { get(stream, &mut priority) }) {
            Some(CUDA_SUCCESS) => priority,
            _ => 0,
        }
    }

    fn stream_context(&self, stream: usize) -> Option<usize> {
        stream_context(stream)
    }

    fn function_name(&self, f: usize) -> Option<String> {
        driver_name(cu_func_get_name(), f).or_else(|| driver_name(cu_kernel_get_name(), f))
    }

    fn max_dynamic_shared(&self, f: usize) -> Option<u32> {
        const MAX_DYNAMIC_SHARED_SIZE_BYTES: c_int = 8;
        let mut value: c_int = 0;
        // SAFETY: a live out-parameter; the driver validates the handle (a CUkernel is refused, then asked below).
        let read = cu_func_get_attribute()
            .is_some_and(|get| unsafe { get(&mut value, MAX_DYNAMIC_SHARED_SIZE_BYTES, f) } == 0)
            || {
                let mut device: c_int = 0;
                // SAFETY: live out-parameters; the driver validates the handle and the device.
                cu_ctx_get_device().is_some_and(|get| unsafe { get(&mut device) } == 0)
                    && cu_kernel_get_attribute().is_some_and(|get| unsafe {
                        get(&mut value, MAX_DYNAMIC_SHARED_SIZE_BYTES, f, device)
                    } == 0)
            };
        read.then(|| u32::try_from(value).ok()).flatten()
    }

    fn function_owner(&self, f: usize, known: &dyn Fn(usize) -> bool) -> Option<usize> {
        driver_owner(cu_func_get_module(), f)
            .filter(|&m| known(m))
            .or_else(|| driver_owner(cu_kernel_get_library(), f))
    }

    fn global(&self, owner: Owner, library: bool, name: &str) -> Option<VariableHome> {
        let get = if library {
            cu_library_get_global()
        } else {
            cu_module_get_global()
        }?;
        let name = CString::new(name).ok()?;
        let (mut address, mut size) = (0u64, 0usize);
        // SAFETY: live out-parameters and a NUL-terminated name; the driver validates the handle.
        let r = unsafe { get(&mut address, &mut size, owner, name.as_ptr()) };
        (r == 0 && address != 0).then_some(VariableHome {
            address,
            size: size as u64,
        })
    }

    fn cuda_waits_for_apex(&self, queue: &mut Queue, stream: StreamKey) -> Result<(), String> {
        // SAFETY: the stream is the program's, live (destroyed streams are handed over and forgotten first).
        unsafe { queue.make_cuda_stream_wait(stream.raw() as _) }.map_err(|e| e.to_string())
    }

    fn release_for_cuda(&self, queue: &mut Queue) -> Result<ReleaseMark, String> {
        queue
            .release_for_cuda()
            .map(|r| ReleaseMark(Some(r)))
            .map_err(|e| e.to_string())
    }

    fn cuda_waits_for_release(
        &self,
        queue: &mut Queue,
        stream: StreamKey,
        release: ReleaseMark,
    ) -> Result<(), String> {
        let r = release.0.ok_or("no release was made")?;
        // SAFETY: as above.
        unsafe { queue.make_cuda_stream_wait_for(stream.raw() as _, r) }.map_err(|e| e.to_string())
    }

    fn stream_idle(&self, stream: usize) -> bool {
        // SAFETY: libcuda validates the handle; an error (a destroyed stream, a failed context) reads as busy.
        cu_stream_query().is_some_and(|q| unsafe { q(stream) } == CUDA_SUCCESS)
    }

    fn apex_waits_for_cuda(&self, queue: &mut Queue, stream: StreamKey) -> Result<(), String> {
        // SAFETY: as above.
        unsafe { queue.wait_for_cuda_stream(stream.raw() as _) }.map_err(|e| e.to_string())
    }

    fn record_event_after(
        &self,
        ctx: usize,
        queue: &mut Queue,
        event: usize,
        side: &mut usize,
    ) -> Result<(), String> {
        self.in_context(ctx, || {
            let s = Self::side_stream(side)?;
            // SAFETY: the preload's own stream, live.
            unsafe { queue.make_cuda_stream_wait(s as _) }.map_err(|e| e.to_string())
        })?;
        self.record_event_now(ctx, event, side)
    }

    fn record_event_now(&self, ctx: usize, event: usize, side: &mut usize) -> Result<(), String> {
        self.in_context(ctx, || {
            let s = Self::side_stream(side)?;
            let record = cu_event_record().ok_or_else(|| missing("cuEventRecord"))?;
            // SAFETY: the program's event (the driver validates it) on the preload's stream.
            call("cuEventRecord", unsafe { record(event, s) })
        })
    }

    fn sleeps_while_waiting(&self, ctx: usize) -> bool {
        if self.current_context() != Some(ctx) {
            return false;
        }
        let Some(get) = cu_ctx_get_flags() else {
            return false;
        };
        let mut flags: c_uint = 0;
        // SAFETY: a live out-parameter; the current context's flags.
        (unsafe { get(&mut flags) } == CUDA_SUCCESS)
            && flags & CU_CTX_SCHED_MASK == CU_CTX_SCHED_BLOCKING_SYNC
    }

    fn sleeping_event(&self, ctx: usize) -> Result<usize, String> {
        self.in_context(ctx, || {
            let create = cu_event_create().ok_or_else(|| missing("cuEventCreate"))?;
            let mut event = 0usize;
            // SAFETY: a live out-parameter, in the context made current above.
            call("cuEventCreate", unsafe {
                create(&mut event, SLEEPING_EVENT_FLAGS)
            })?;
            Ok(event)
        })
    }

    fn sleep_on_event(&self, event: usize) -> Result<(), String> {
        let sync = cu_event_synchronize().ok_or_else(|| missing("cuEventSynchronize"))?;
        // SAFETY: the preload's own event, live.
        call("cuEventSynchronize", unsafe { sync(event) })
    }

    fn pointer(&self, ptr: u64, ctx: usize) -> Pointer {
        let Some(get) = cu_pointer_get_attributes() else {
            return Pointer::Other;
        };
        // Each value gets 8 zeroed bytes (the driver writes 4 or 8); unknown memory reads as zeros (no error).
        let mut values = [0u64; POINTER_ATTRIBUTES.len()];
        let mut slots: [*mut c_void; POINTER_ATTRIBUTES.len()] =
            std::array::from_fn(|i| (&mut values[i] as *mut u64).cast());
        // SAFETY: as many attributes as value slots, each slot 8 bytes.
        let r = unsafe {
            get(
                POINTER_ATTRIBUTES.len() as c_uint,
                POINTER_ATTRIBUTES.as_ptr(),
                slots.as_mut_ptr(),
                ptr,
            )
        };
        if r != CUDA_SUCCESS {
            return Pointer::Other;
        }
        let [context, kind, device, managed, start, size] = values;
        let kind = kind & 0xffff_ffff;
        let in_range = |base: u64| {
            (start != 0 && size != 0 && ptr >= start && ptr - start < size)
                .then(|| size - (ptr - start))
                .filter(|_| base != 0)
        };
        match kind {
            0 => Pointer::Pageable,
            _ if managed & 0xff != 0 => Pointer::Other,
            MEMORYTYPE_DEVICE if context as usize == ctx => match in_range(ptr) {
                Some(bytes) => Pointer::Device { bytes },
                None => Pointer::Other,
            },
            MEMORYTYPE_HOST if device != 0 => match in_range(device) {
                Some(bytes) => Pointer::Pinned { device, bytes },
                None => Pointer::Other,
            },
            _ => Pointer::Other,
        }
    }

    fn replay_asserts(&self, ctx: usize, failures: &[AssertFailure]) -> Result<(), String> {
        self.in_context(ctx, || replay_in_current(failures))
    }
}

/// Launches the replay of `failures` in the current context and waits for the `CUDA_ERROR_ASSERT` it leaves.
fn replay_in_current(failures: &[AssertFailure]) -> Result<(), String> {
    {
        let plan = crate::asserts::ReplayPlan::new(failures)
            .ok_or_else(|| "no assert to replay".to_string())?;
        let load = cu_module_load_data().ok_or_else(|| missing("cuModuleLoadData"))?;
        let get = cu_module_get_function().ok_or_else(|| missing("cuModuleGetFunction"))?;
        let alloc = cu_mem_alloc().ok_or_else(|| missing("cuMemAlloc_v2"))?;
        let copy = cu_memcpy_htod().ok_or_else(|| missing("cuMemcpyHtoD_v2"))?;
        let launch = cu_launch_kernel().ok_or_else(|| missing("cuLaunchKernel"))?;
        let sync = cu_ctx_synchronize().ok_or_else(|| missing("cuCtxSynchronize"))?;
        let ptx = CString::new(REPLAY_PTX).map_err(|e| e.to_string())?;
        let (mut module, mut function, mut device) = (0usize, 0usize, 0u64);
        // SAFETY: NUL-terminated PTX and live out-parameters.
        call("cuModuleLoadData", unsafe {
            load(&mut module, ptx.as_ptr().cast())
        })?;
        // SAFETY: the module just loaded, a NUL-terminated name.
        call("cuModuleGetFunction", unsafe {
            get(&mut function, module, c"apex_assert_replay".as_ptr())
        })?;
        let bytes = plan.blob_len();
        // SAFETY: a live out-parameter.
        call("cuMemAlloc", unsafe { alloc(&mut device, bytes) })?;
        let blob = plan.blob(device);
        // SAFETY: `blob` is `bytes` long and `device` holds that many.
        call("cuMemcpyHtoD", unsafe {
            copy(device, blob.as_ptr().cast(), blob.len())
        })?;
        let mut records = device;
        let mut n = plan.records() as c_uint;
        let mut args: [*mut c_void; 2] = [
            (&mut records as *mut u64).cast(),
            (&mut n as *mut c_uint).cast(),
        ];
        let (g, b) = (plan.grid(), plan.block());
        // SAFETY: the replay kernel with its two parameters, on the legacy stream of the current context.
        call("cuLaunchKernel", unsafe {
            launch(
                function as *mut c_void,
                g[0],
                g[1],
                g[2],
                b[0],
                b[1],
                b[2],
                0,
                std::ptr::null_mut(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })?;
        // SAFETY: no arguments. CUDA_ERROR_ASSERT is what the replay is for.
        match unsafe { sync() } {
            CUDA_ERROR_ASSERT => Ok(()),
            r => Err(format!(
                "the assert replay ended with CUresult {r}, not CUDA_ERROR_ASSERT"
            )),
        }
    }
}
