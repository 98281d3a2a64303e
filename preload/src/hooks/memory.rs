//! The memory hooks. `cuMemAlloc`/`cuMemFree` and `cuMemAllocAsync`/`cuMemFreeAsync` (with their `_ptsz` forms) are
//! served from the allocation cache ([`crate::alloc_cache`]); `cuMemGetInfo` counts what it holds as free; an
//! allocation libcuda refuses for want of memory (`cuMemAlloc`, `cuMemAllocAsync`, `cuMemAllocPitch`, `cuMemCreate`)
//! is retried once after the cache gave back what it holds; `cuMemPoolTrimTo`, `cuMemPoolGetAttribute` and
//! `cuDeviceSetMemPool` let the cache give back first. The stream-ordered flows
//! ([`crate::alloc_cache::stream_ordered`]) run here against libcuda and the engine ([`Preload`]).

use std::ffi::{c_int, c_uint};
use std::sync::atomic::AtomicUsize;

use apex_interpose::{CUDA_ERROR_STUB_LIBRARY, enter, next};

use super::{Dptr, Hook, P, after_waiting};
use crate::alloc_cache::stream_ordered::{
    self as so, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, Driver, FreePoint,
};
use crate::alloc_cache::{self, Block};
use crate::engine::{self, Answer, Ordered, Site};
use crate::order::StreamKey;

real_fn!(REAL_MEM_ALLOC, c"cuMemAlloc_v2");
real_fn!(REAL_MEM_FREE, c"cuMemFree_v2");
real_fn!(REAL_MEM_GET_INFO, c"cuMemGetInfo_v2");
real_fn!(REAL_MEM_CREATE, c"cuMemCreate");
real_fn!(REAL_MEM_ALLOC_PITCH, c"cuMemAllocPitch_v2");
real_fn!(REAL_CTX_SYNCHRONIZE, c"cuCtxSynchronize");
real_fn!(REAL_MEM_ALLOC_ASYNC, c"cuMemAllocAsync");
real_fn!(REAL_MEM_ALLOC_ASYNC_PT, c"cuMemAllocAsync_ptsz");
real_fn!(REAL_MEM_FREE_ASYNC, c"cuMemFreeAsync");
real_fn!(REAL_MEM_FREE_ASYNC_PT, c"cuMemFreeAsync_ptsz");
real_fn!(REAL_DEVICE_SET_MEM_POOL, c"cuDeviceSetMemPool");
real_fn!(REAL_MEM_POOL_TRIM_TO, c"cuMemPoolTrimTo");
real_fn!(REAL_MEM_POOL_GET_ATTRIBUTE, c"cuMemPoolGetAttribute");

type MemAllocFn = unsafe extern "C" fn(*mut Dptr, usize) -> c_int;
type MemFreeFn = unsafe extern "C" fn(Dptr) -> c_int;
type MemAllocAsyncFn = unsafe extern "C" fn(*mut Dptr, usize, P) -> c_int;
type MemFreeAsyncFn = unsafe extern "C" fn(Dptr, P) -> c_int;

/// # Safety
/// `cuMemAlloc_v2`: served from the preload's cache of CUDA's own allocations where a block of this size was kept
/// ([`crate::alloc_cache`]).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut Dptr, bytes: usize) -> c_int {
    let Some(_g) = enter().filter(|_| !engine::disabled()) else {
        return forward!(REAL_MEM_ALLOC, c"cuMemAlloc_v2", MemAllocFn, (dptr, bytes));
    };
    // The cache first: with it off, the call costs libcuda's alone.
    let cached = (!dptr.is_null() && bytes > 0)
        .then(crate::alloc_cache::lock)
        .flatten()
        .and_then(|cache| Some((crate::cuda::current_context()?, cache)));
    let Some((ctx, mut cache)) = cached else {
        return forward!(REAL_MEM_ALLOC, c"cuMemAlloc_v2", MemAllocFn, (dptr, bytes));
    };
    if let Some(p) = cache.take(ctx, bytes) {
        // SAFETY: the program's out-parameter, checked non-null.
        unsafe { *dptr = p };
        return 0;
    }
    drop(cache);
    let mut r = forward!(REAL_MEM_ALLOC, c"cuMemAlloc_v2", MemAllocFn, (dptr, bytes));
    if r == CUDA_ERROR_OUT_OF_MEMORY && give_back_cached(ctx) {
        r = forward!(REAL_MEM_ALLOC, c"cuMemAlloc_v2", MemAllocFn, (dptr, bytes));
    }
    if r == 0
        && let Some(mut c) = alloc_cache::lock()
    {
        // SAFETY: libcuda filled the out-parameter.
        c.allocated(ctx, bytes, unsafe { *dptr });
    }
    r
}

/// Gives back, through libcuda, every block the allocation cache keeps for context `ctx` (libcuda ran out of memory
/// the program had freed; the default pool trimmed to its release threshold if stream-ordered blocks went back to
/// it); whether there was any.
fn give_back_cached(ctx: usize) -> bool {
    alloc_cache::global().is_some_and(|cache| so::give_back_for_memory(cache, &Preload, ctx))
}

/// # Safety
/// `cuMemCreate`: as libcuda's; an out-of-memory answer is retried once the allocation cache gave back what it
/// keeps for the current context, so memory the program freed never makes an allocation fail that would succeed
/// without the preload.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(handle: P, bytes: usize, prop: P, flags: u64) -> c_int {
    type F = unsafe extern "C" fn(P, usize, P, u64) -> c_int;
    let r = forward!(
        REAL_MEM_CREATE,
        c"cuMemCreate",
        F,
        (handle, bytes, prop, flags)
    );
    if r != CUDA_ERROR_OUT_OF_MEMORY {
        return r;
    }
    let Some(_g) = enter() else { return r };
    match crate::cuda::current_context() {
        Some(ctx) if give_back_cached(ctx) => {
            forward!(
                REAL_MEM_CREATE,
                c"cuMemCreate",
                F,
                (handle, bytes, prop, flags)
            )
        }
        _ => r,
    }
}

/// # Safety
/// `cuMemAllocPitch_v2`: as libcuda's, retried after the allocation cache gave memory back (see `cuMemCreate`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut Dptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element: c_uint,
) -> c_int {
    type F = unsafe extern "C" fn(*mut Dptr, *mut usize, usize, usize, c_uint) -> c_int;
    let r = forward!(
        REAL_MEM_ALLOC_PITCH,
        c"cuMemAllocPitch_v2",
        F,
        (dptr, pitch, width, height, element)
    );
    if r != CUDA_ERROR_OUT_OF_MEMORY {
        return r;
    }
    let Some(_g) = enter() else { return r };
    match crate::cuda::current_context() {
        Some(ctx) if give_back_cached(ctx) => forward!(
            REAL_MEM_ALLOC_PITCH,
            c"cuMemAllocPitch_v2",
            F,
            (dptr, pitch, width, height, element)
        ),
        _ => r,
    }
}

/// # Safety
/// `cuMemFree_v2`: every APEX queue's work is waited for first, as for any free. A block the cache may keep is kept
/// after the whole context's work is complete (what libcuda's free waits for), so no later allocation of it can
/// overlap its last use. A block the cache holds already (a second free) is refused as libcuda refuses memory that is
/// not allocated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(d: Dptr) -> c_int {
    let Some(_g) = enter().filter(|_| !engine::disabled()) else {
        return forward!(REAL_MEM_FREE, c"cuMemFree_v2", MemFreeFn, (d));
    };
    if let Some(e) = engine::sticky() {
        return e;
    }
    let block = alloc_cache::lock().map_or(Block::Unknown, |c| c.block(d));
    match block {
        // A second free of a block the cache holds: libcuda must not free it (the cache would hand it out again).
        Block::Held => return CUDA_ERROR_INVALID_VALUE,
        // Pool memory: libcuda's free does not synchronize for it (the program made sure its work is complete), and
        // the block is libcuda's again.
        Block::LiveAsync => {
            if let Some(mut c) = alloc_cache::lock() {
                c.release(d);
            }
        }
        Block::Live | Block::Unknown => {}
    }
    let known = block == Block::Live;
    let ctx = if known {
        crate::cuda::current_context()
    } else {
        None
    };
    if known && engine::capturing() {
        // The context synchronize a kept block needs is not allowed during a capture: libcuda frees it.
        if let Some(mut c) = alloc_cache::lock() {
            c.release(d);
        }
    } else if let (true, Some(ctx)) = (known, ctx) {
        let waited = match engine::context_sync() {
            (Answer::Done(code), _) => code,
            (Answer::Forward, epoch) => {
                type F = unsafe extern "C" fn() -> c_int;
                let r = forward!(REAL_CTX_SYNCHRONIZE, c"cuCtxSynchronize", F, ());
                engine::context_synced(r, epoch);
                after_waiting(r)
            }
        };
        // An error of earlier work: libcuda's free reports it (and decides what becomes of the block).
        let kept = waited == 0
            && alloc_cache::lock().is_some_and(|mut c| c.freed(ctx, d) == alloc_cache::Freed::Kept);
        if kept {
            return 0;
        }
        if waited != 0
            && let Some(mut c) = alloc_cache::lock()
        {
            let _ = c.freed(ctx, d);
        }
        return forward!(REAL_MEM_FREE, c"cuMemFree_v2", MemFreeFn, (d));
    }
    match engine::device_quiet() {
        Answer::Done(code) => code,
        Answer::Forward => after_waiting(forward!(REAL_MEM_FREE, c"cuMemFree_v2", MemFreeFn, (d))),
    }
}

/// # Safety
/// `cuMemGetInfo_v2`: bytes the preload's cache keeps for the current context (both paths) count as free, as they are
/// to the program.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> c_int {
    type F = unsafe extern "C" fn(*mut usize, *mut usize) -> c_int;
    let r = forward!(REAL_MEM_GET_INFO, c"cuMemGetInfo_v2", F, (free, total));
    if r != 0 || free.is_null() || engine::disabled() {
        return r;
    }
    let Some(_g) = enter() else { return r };
    let held = crate::cuda::current_context()
        .and_then(|ctx| Some(alloc_cache::lock()?.held_in(ctx)))
        .unwrap_or(0);
    // SAFETY: libcuda filled both out-parameters (total may be null: then it is not read).
    unsafe {
        let limit = if total.is_null() { usize::MAX } else { *total };
        *free = (*free).saturating_add(held).min(limit);
    }
    r
}

// ---- the stream-ordered path ----

/// The driver function names the summary counts CUDA work by (one literal each: counted by address).
const ALLOC_ASYNC: &str = "cuMemAllocAsync";
const ALLOC_ASYNC_PT: &str = "cuMemAllocAsync_ptsz";
const FREE_ASYNC: &str = "cuMemFreeAsync";
const FREE_ASYNC_PT: &str = "cuMemFreeAsync_ptsz";

/// libcuda and the engine, for the stream-ordered flows (called under the hook's guard: APEX's own calls into
/// libcuda pass straight through).
struct Preload;

/// libcuda's `cuMemAllocAsync` or `cuMemAllocAsync_ptsz` (as the program looked it up), unordered.
///
/// # Safety
/// As `cuMemAllocAsync`.
unsafe fn real_alloc_async(dptr: *mut Dptr, bytes: usize, stream: P, pt: bool) -> c_int {
    if pt {
        forward!(
            REAL_MEM_ALLOC_ASYNC_PT,
            c"cuMemAllocAsync_ptsz",
            MemAllocAsyncFn,
            (dptr, bytes, stream)
        )
    } else {
        forward!(
            REAL_MEM_ALLOC_ASYNC,
            c"cuMemAllocAsync",
            MemAllocAsyncFn,
            (dptr, bytes, stream)
        )
    }
}

/// libcuda's `cuMemFreeAsync` or `cuMemFreeAsync_ptsz` (as the program looked it up), unordered.
fn real_free_async(ptr: Dptr, stream: P, pt: bool) -> c_int {
    if pt {
        forward!(
            REAL_MEM_FREE_ASYNC_PT,
            c"cuMemFreeAsync_ptsz",
            MemFreeAsyncFn,
            (ptr, stream)
        )
    } else {
        forward!(
            REAL_MEM_FREE_ASYNC,
            c"cuMemFreeAsync",
            MemFreeAsyncFn,
            (ptr, stream)
        )
    }
}

impl Driver for Preload {
    type Ordered = Ordered;

    fn pool_generation(&self) -> u64 {
        alloc_cache::pool_generation()
    }

    fn current_context(&self) -> Option<usize> {
        crate::cuda::current_context()
    }

    fn capturing(&self) -> bool {
        engine::capturing()
    }

    fn pools(&self) -> Option<(usize, usize)> {
        crate::cuda::memory_pools()
    }

    fn stream_context(&self, handle: usize) -> Option<usize> {
        crate::cuda::stream_context(handle)
    }

    fn stream_nonblocking(&self, handle: usize) -> bool {
        crate::cuda::stream_nonblocking(handle)
    }

    unsafe fn alloc_async(&self, dptr: *mut u64, bytes: usize, stream: usize, pt: bool) -> c_int {
        // The allocation may reuse memory CUDA freed on another stream behind a dependency it adds to this one: the
        // stream's queue waits for the stream before its next launch, as for any CUDA work.
        let site = Site::Stream(stream, pt);
        let o = engine::before_work(site, if pt { ALLOC_ASYNC_PT } else { ALLOC_ASYNC });
        // SAFETY: forwarded unchanged.
        let r = unsafe { real_alloc_async(dptr, bytes, stream as P, pt) };
        engine::after(site, o, false);
        r
    }

    fn free_async(&self, ptr: u64, stream: usize, pt: bool) -> c_int {
        let site = Site::Stream(stream, pt);
        let o = engine::before_work(site, if pt { FREE_ASYNC_PT } else { FREE_ASYNC });
        let r = real_free_async(ptr, stream as P, pt);
        engine::after(site, o, false);
        r
    }

    fn free(&self, ptr: u64) -> c_int {
        forward!(REAL_MEM_FREE, c"cuMemFree_v2", MemFreeFn, (ptr))
    }

    fn free_point(&self, stream: usize, pt: bool) -> FreePoint<Ordered> {
        let name = if pt { FREE_ASYNC_PT } else { FREE_ASYNC };
        match engine::free_point(Site::Stream(stream, pt), name) {
            Ok((ctx, fence)) => FreePoint::Fence { ctx, fence },
            Err(o) => FreePoint::Cuda(o),
        }
    }

    fn after(&self, stream: usize, pt: bool, o: Ordered) {
        engine::after(Site::Stream(stream, pt), o, false);
    }

    fn event_create(&self) -> Option<usize> {
        crate::cuda::event_create()
    }

    fn event_record(&self, event: usize, stream: usize) -> c_int {
        crate::cuda::event_record(event, stream)
    }

    fn event_query(&self, event: usize) -> c_int {
        crate::cuda::event_query(event)
    }

    fn event_synchronize(&self, event: usize) -> c_int {
        crate::cuda::event_synchronize(event)
    }

    fn event_destroy(&self, event: usize) {
        crate::cuda::event_destroy(event);
    }

    fn fence_done(&self, fence: &apex::Fence) -> bool {
        fence.is_done()
    }

    fn wait_fence(&self, fence: &apex::Fence) -> Result<(), String> {
        engine::wait_fence(fence)
    }

    fn trim_to_threshold(&self, pool: usize) {
        crate::cuda::trim_to_threshold(pool);
    }
}

/// `cuMemAllocAsync` / `cuMemAllocAsync_ptsz`.
///
/// # Safety
/// As `cuMemAllocAsync`.
/// Whether `cuMemAllocAsync`/`cuMemFreeAsync` are served from the cache (on unless `APEX_PRELOAD_ALLOC_ASYNC` is
/// `off`, `0` or `false`; the cache itself must be on). Off, both calls are forwarded, ordered with APEX's queues.
fn stream_ordered_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| stream_ordered_by(std::env::var("APEX_PRELOAD_ALLOC_ASYNC").ok().as_deref()))
}

/// Whether a value of `APEX_PRELOAD_ALLOC_ASYNC` leaves the stream-ordered path on. It was opt-in while a served free
/// cost more than libcuda's (an event recorded at each free); a free now costs a lookup (H100, 580.159.04:
/// `cudaFreeAsync` 1.31-1.45× faster than libcuda's, an iteration of `alloc_async_loop.cu` 1.68× (release threshold
/// raised) to 4.51× (CUDA's default pool) faster, 5 pairs each).
fn stream_ordered_by(value: Option<&str>) -> bool {
    !matches!(value, Some("0" | "off" | "false"))
}

unsafe fn alloc_async(dptr: *mut Dptr, bytes: usize, stream: P, pt: bool) -> c_int {
    // With the takeover off no queue exists: nothing to order, nothing cached.
    if engine::disabled() {
        // SAFETY: forwarded unchanged.
        return unsafe { real_alloc_async(dptr, bytes, stream, pt) };
    }
    let Some(_g) = enter() else {
        // SAFETY: forwarded unchanged.
        return unsafe { real_alloc_async(dptr, bytes, stream, pt) };
    };
    if let Some(e) = engine::sticky() {
        return e;
    }
    // SAFETY: the program's out-parameter, as cuMemAllocAsync takes it.
    unsafe {
        match alloc_cache::global().filter(|_| stream_ordered_on()) {
            Some(cache) => so::alloc(cache, &Preload, dptr, bytes, stream as usize, pt),
            None => Preload.alloc_async(dptr, bytes, stream as usize, pt),
        }
    }
}

/// `cuMemFreeAsync` / `cuMemFreeAsync_ptsz`.
fn free_async(ptr: Dptr, stream: P, pt: bool) -> c_int {
    if engine::disabled() {
        return real_free_async(ptr, stream, pt);
    }
    let Some(_g) = enter() else {
        return real_free_async(ptr, stream, pt);
    };
    if let Some(e) = engine::sticky() {
        return e;
    }
    match alloc_cache::global() {
        Some(cache) if stream_ordered_on() => so::free(cache, &Preload, ptr, stream as usize, pt),
        cache => {
            // A `cuMemAlloc` block the program frees in stream order is libcuda's to free: the cache forgets it, so
            // that an address libcuda hands out again is never taken for the old block.
            if let Some(mut c) = cache.and_then(|_| alloc_cache::lock()) {
                c.release(ptr);
            }
            Preload.free_async(ptr, stream as usize, pt)
        }
    }
}

/// # Safety
/// `cuMemAllocAsync`: served from the allocation cache's stream-ordered path while the device's default pool is
/// current ([`crate::alloc_cache`]); otherwise forwarded, ordered with APEX's queues.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync(dptr: *mut Dptr, bytes: usize, stream: P) -> c_int {
    // SAFETY: as the caller's.
    unsafe { alloc_async(dptr, bytes, stream, false) }
}

/// # Safety
/// `cuMemAllocAsync_ptsz`: as [`cuMemAllocAsync`], on the per-thread default stream for a null stream.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(dptr: *mut Dptr, bytes: usize, stream: P) -> c_int {
    // SAFETY: as the caller's.
    unsafe { alloc_async(dptr, bytes, stream, true) }
}

/// # Safety
/// `cuMemFreeAsync`: a block the cache handed out (or saw libcuda hand out) is kept, its stream's point marked;
/// anything else is forwarded, ordered with APEX's queues.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync(ptr: Dptr, stream: P) -> c_int {
    free_async(ptr, stream, false)
}

/// # Safety
/// `cuMemFreeAsync_ptsz`: as [`cuMemFreeAsync`], on the per-thread default stream for a null stream.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync_ptsz(ptr: Dptr, stream: P) -> c_int {
    free_async(ptr, stream, true)
}

/// # Safety
/// `cuDeviceSetMemPool`: forwarded; once it succeeded the cache asks again which pool is current, and gives back the
/// default pool's blocks it holds for the current context.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceSetMemPool(dev: c_int, pool: P) -> c_int {
    type F = unsafe extern "C" fn(c_int, P) -> c_int;
    let r = forward!(
        REAL_DEVICE_SET_MEM_POOL,
        c"cuDeviceSetMemPool",
        F,
        (dev, pool)
    );
    if r == 0 {
        alloc_cache::pools_changed();
        if !engine::disabled()
            && let Some(_g) = enter()
            && let Some(cache) = alloc_cache::global()
        {
            so::after_pool_set(cache, &Preload);
        }
    }
    r
}

/// # Safety
/// `cuMemPoolTrimTo`: on the default pool, the cache first gives back what the current context holds and a trim may
/// release (see [`so::before_trim`]).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolTrimTo(pool: P, keep: usize) -> c_int {
    type F = unsafe extern "C" fn(P, usize) -> c_int;
    if !engine::disabled()
        && let Some(_g) = enter()
        && let Some(cache) = alloc_cache::global()
    {
        so::before_trim(cache, &Preload, pool as usize);
    }
    forward!(REAL_MEM_POOL_TRIM_TO, c"cuMemPoolTrimTo", F, (pool, keep))
}

/// # Safety
/// `cuMemPoolGetAttribute`: the default pool's used or reserved bytes are asked after the cache gave back the
/// stream-ordered blocks the current context holds (see [`so::before_pool_query`]).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolGetAttribute(pool: P, attr: c_int, value: P) -> c_int {
    type F = unsafe extern "C" fn(P, c_int, P) -> c_int;
    if !engine::disabled()
        && let Some(_g) = enter()
        && let Some(cache) = alloc_cache::global()
    {
        so::before_pool_query(cache, &Preload, pool as usize, attr);
    }
    forward!(
        REAL_MEM_POOL_GET_ATTRIBUTE,
        c"cuMemPoolGetAttribute",
        F,
        (pool, attr, value)
    )
}

/// Before `cuStreamDestroy(stream)` is forwarded: blocks freed on the stream are handed out only once their free is
/// complete (a stream made afterwards may get its handle).
pub(super) fn stream_destroyed(stream: usize) {
    if let Some(cache) = alloc_cache::global() {
        so::stream_destroyed(cache, &Preload, stream);
    }
}

/// After a synchronization that returned success (`cuStreamSynchronize`, a `cuStreamQuery` that found the stream
/// idle, `cuCtxSynchronize`, `cuCtxSynchronize_v2` of `context`; `site`: its stream, or the device for a context):
/// the stream-ordered blocks freed there and held unmarked may go to any stream. One load when none is held.
pub(super) fn synchronized(site: Site, context: usize, before: u64) {
    // Off, or a forked child (whose copy of the cache is the parent's): nothing to complete.
    if !alloc_cache::unmarked_held() || engine::disabled() {
        return;
    }
    // Another context than the current one: its blocks are not told apart here, so none is completed.
    if context != 0 && crate::cuda::current_context() != Some(context) {
        return;
    }
    if let Some(cache) = alloc_cache::global() {
        let key = match site {
            Site::Stream(raw, pt) => Some(StreamKey::of(raw, pt)),
            Site::Device => None,
        };
        so::synchronized(cache, &Preload, key, before);
    }
}

/// Adds the memory hooks to the table `cuGetProcAddress` and `dlsym` answer from (none is handed out with the
/// takeover off).
pub(super) fn register(v: &mut Vec<Hook>) {
    let mut add = |symbol: &'static std::ffi::CStr,
                   base: &'static [u8],
                   per_thread: bool,
                   versioned: bool,
                   slot: &'static AtomicUsize,
                   ours: usize| {
        v.push(Hook {
            symbol,
            base,
            per_thread,
            versioned,
            slot,
            ours,
            when_off: false,
        });
    };
    add(
        c"cuMemFree_v2",
        b"cuMemFree",
        false,
        false,
        &REAL_MEM_FREE,
        cuMemFree_v2 as *const () as usize,
    );
    add(
        c"cuMemCreate",
        b"cuMemCreate",
        false,
        false,
        &REAL_MEM_CREATE,
        cuMemCreate as *const () as usize,
    );
    // cuMemAlloc, cuMemAllocPitch and cuMemGetInfo had 32-bit forms under the same names: taken only for the _v2
    // symbols.
    add(
        c"cuMemAllocPitch_v2",
        b"cuMemAllocPitch",
        false,
        true,
        &REAL_MEM_ALLOC_PITCH,
        cuMemAllocPitch_v2 as *const () as usize,
    );
    add(
        c"cuMemAlloc_v2",
        b"cuMemAlloc",
        false,
        true,
        &REAL_MEM_ALLOC,
        cuMemAlloc_v2 as *const () as usize,
    );
    add(
        c"cuMemGetInfo_v2",
        b"cuMemGetInfo",
        false,
        true,
        &REAL_MEM_GET_INFO,
        cuMemGetInfo_v2 as *const () as usize,
    );
    add(
        c"cuMemAllocAsync",
        b"cuMemAllocAsync",
        false,
        false,
        &REAL_MEM_ALLOC_ASYNC,
        cuMemAllocAsync as *const () as usize,
    );
    add(
        c"cuMemAllocAsync_ptsz",
        b"cuMemAllocAsync",
        true,
        false,
        &REAL_MEM_ALLOC_ASYNC_PT,
        cuMemAllocAsync_ptsz as *const () as usize,
    );
    add(
        c"cuMemFreeAsync",
        b"cuMemFreeAsync",
        false,
        false,
        &REAL_MEM_FREE_ASYNC,
        cuMemFreeAsync as *const () as usize,
    );
    add(
        c"cuMemFreeAsync_ptsz",
        b"cuMemFreeAsync",
        true,
        false,
        &REAL_MEM_FREE_ASYNC_PT,
        cuMemFreeAsync_ptsz as *const () as usize,
    );
    add(
        c"cuDeviceSetMemPool",
        b"cuDeviceSetMemPool",
        false,
        false,
        &REAL_DEVICE_SET_MEM_POOL,
        cuDeviceSetMemPool as *const () as usize,
    );
    add(
        c"cuMemPoolTrimTo",
        b"cuMemPoolTrimTo",
        false,
        false,
        &REAL_MEM_POOL_TRIM_TO,
        cuMemPoolTrimTo as *const () as usize,
    );
    add(
        c"cuMemPoolGetAttribute",
        b"cuMemPoolGetAttribute",
        false,
        false,
        &REAL_MEM_POOL_GET_ATTRIBUTE,
        cuMemPoolGetAttribute as *const () as usize,
    );
}

#[cfg(test)]
mod tests {
    use super::stream_ordered_by;

    #[test]
    fn the_stream_ordered_path_is_on_unless_turned_off() {
        for v in [
            None,
            Some(""),
            Some("on"),
            Some("1"),
            Some("true"),
            Some("yes"),
        ] {
            assert!(stream_ordered_by(v), "{v:?}");
        }
        for v in ["off", "0", "false"] {
            assert!(!stream_ordered_by(Some(v)), "{v}");
        }
    }
}
