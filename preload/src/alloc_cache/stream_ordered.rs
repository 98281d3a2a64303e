//! The stream-ordered path of the allocation cache: what `cuMemAllocAsync`, `cuMemFreeAsync`, `cuMemPoolTrimTo`,
//! `cuMemPoolGetAttribute`, `cuDeviceSetMemPool` and an out-of-memory answer do with the cache, written against one
//! seam ([`Driver`]: libcuda's functions and the engine's ordering) so that the rules are tested without a GPU.
//!
//! Locks: the engine's lock is taken before the cache's, never inside it (the engine's summary reads the cache), so
//! every [`Driver`] call that reaches the engine ([`Driver::capturing`], [`Driver::free_point`], [`Driver::after`],
//! and the ordered forwards) is made with the cache unlocked. Calls that only reach libcuda (an event query, a pool
//! query) may be made under the cache's lock.

use std::ffi::c_int;
use std::sync::Mutex;

use super::{AllocCache, Block, HeldBlock, Marker, Pools, lane, locked};
use crate::order::StreamKey;

/// `CUDA_SUCCESS`.
pub const CUDA_SUCCESS: c_int = 0;
/// `CUDA_ERROR_INVALID_VALUE`: what libcuda answers a free of memory that is not (or no longer) allocated.
pub const CUDA_ERROR_INVALID_VALUE: c_int = 1;
/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const CUDA_ERROR_OUT_OF_MEMORY: c_int = 2;
/// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`.
pub const ATTR_RESERVED_MEM_CURRENT: c_int = 5;
/// `CU_MEMPOOL_ATTR_USED_MEM_CURRENT`.
pub const ATTR_USED_MEM_CURRENT: c_int = 7;

/// Where a stream's work up to a free stands, as the engine sees the stream.
#[derive(Debug)]
pub enum FreePoint<O> {
    /// The stream is taken over in context `ctx`, and its queue's last launch stands for all of its work.
    Fence {
        /// The context the stream is APEX's in.
        ctx: usize,
        /// The queue's last launch.
        fence: apex::Fence,
    },
    /// Only CUDA can mark the point (an event recorded on the stream); every related queue's work was handed to the
    /// stream first. The token is for [`Driver::after`].
    Cuda(O),
}

/// What the stream-ordered path asks of libcuda and of the engine. Streams are named as the program named them: a
/// handle and whether the entry point was a per-thread (`_ptsz`) one.
pub trait Driver {
    /// The engine's answer about an operation's ordering, for [`Driver::after`].
    type Ordered;
    /// The pool generation ([`super::pool_generation`] in the preload).
    fn pool_generation(&self) -> u64;
    /// The calling thread's current context.
    fn current_context(&self) -> Option<usize>;
    /// Whether a stream of the program is capturing a graph (an allocation or free there is a graph node).
    fn capturing(&self) -> bool;
    /// The current context's device's (current pool, default pool).
    fn pools(&self) -> Option<(usize, usize)>;
    /// The context of stream `handle`.
    fn stream_context(&self, handle: usize) -> Option<usize>;
    /// Whether stream `handle` was made non-blocking (`CU_STREAM_NON_BLOCKING`): its work is not ordered with the
    /// legacy default stream's. `false` when libcuda cannot say.
    fn stream_nonblocking(&self, handle: usize) -> bool;
    /// The program's `cuMemAllocAsync`, forwarded to libcuda in order with APEX's queues.
    ///
    /// # Safety
    /// `dptr` is the program's out-parameter.
    unsafe fn alloc_async(&self, dptr: *mut u64, bytes: usize, stream: usize, pt: bool) -> c_int;
    /// The program's `cuMemFreeAsync`, forwarded to libcuda in order with APEX's queues.
    fn free_async(&self, ptr: u64, stream: usize, pt: bool) -> c_int;
    /// libcuda's `cuMemFree` (no implicit synchronization for pool memory: the caller knows its work is complete).
    fn free(&self, ptr: u64) -> c_int;
    /// Where `stream`'s work stands at a free; a [`FreePoint::Cuda`] answer has ordered the stream after related
    /// queues already, and wants [`Driver::after`] once the point is marked.
    fn free_point(&self, stream: usize, pt: bool) -> FreePoint<Self::Ordered>;
    /// After CUDA work on `stream` that [`Driver::free_point`] ordered.
    fn after(&self, stream: usize, pt: bool, o: Self::Ordered);
    /// A new event of the preload's in the current context (no timing).
    fn event_create(&self) -> Option<usize>;
    /// Records `event` on `stream` (a handle as the non-per-thread entry points take it).
    fn event_record(&self, event: usize, stream: usize) -> c_int;
    /// `cuEventQuery`.
    fn event_query(&self, event: usize) -> c_int;
    /// `cuEventSynchronize`.
    fn event_synchronize(&self, event: usize) -> c_int;
    /// `cuEventDestroy`.
    fn event_destroy(&self, event: usize);
    /// Whether the work before `fence` is complete.
    fn fence_done(&self, fence: &apex::Fence) -> bool;
    /// Waits on the CPU until the work before `fence` is complete (or its queue failed).
    fn wait_fence(&self, fence: &apex::Fence) -> Result<(), String>;
    /// Trims `pool` to its release threshold, as the pool does at a synchronization.
    fn trim_to_threshold(&self, pool: usize);
}

/// Whether the work `m` marks is complete, without waiting.
fn done<D: Driver>(d: &D, m: &Marker) -> bool {
    match m {
        Marker::Done => true,
        Marker::Fence(f) => d.fence_done(f),
        Marker::Event(e) => d.event_query(*e) == CUDA_SUCCESS,
        // Not known until the stream is synchronized or the block marked.
        Marker::Stream => false,
    }
}

/// A marker for the work stream `key` of `ctx` has been given so far (so for any free made on it before): the fence
/// of its APEX queue's last launch, else an event of the preload's recorded on it. `None` when neither can be had
/// (its queue is another context's, or libcuda refused the record).
fn marker_on<D: Driver>(
    cache: &Mutex<AllocCache>,
    d: &D,
    ctx: usize,
    key: StreamKey,
) -> Option<Marker> {
    // Another thread's default stream cannot be named from here (its handle would name this thread's).
    if key.is_other_threads() {
        return None;
    }
    let (stream, pt) = (key.raw(), key.is_per_thread());
    match d.free_point(stream, pt) {
        FreePoint::Fence { ctx: owner, fence } if owner == ctx => Some(Marker::Fence(fence)),
        FreePoint::Fence { .. } => None,
        FreePoint::Cuda(o) => {
            let spare = locked(cache).spare_event(ctx);
            let event = spare.or_else(|| d.event_create());
            let recorded = event.map(|e| (e, d.event_record(e, stream)));
            d.after(stream, pt, o);
            match recorded {
                Some((e, CUDA_SUCCESS)) => Some(Marker::Event(e)),
                failed => {
                    if let Some((e, _)) = failed {
                        locked(cache).recycle(ctx, Marker::Event(e));
                    }
                    None
                }
            }
        }
    }
}

/// Whether the stream-ordered path serves context `ctx` (the device's current pool is its default pool), asking
/// libcuda once per pool generation.
fn serves<D: Driver>(c: &mut AllocCache, d: &D, ctx: usize) -> bool {
    let generation = d.pool_generation();
    if let Some(s) = c.serves_async(ctx, generation) {
        return s;
    }
    let pools = match d.pools() {
        Some((current, default)) => Pools {
            default,
            current_is_default: current != 0 && current == default,
            generation,
        },
        // Unknown: nothing is served (libcuda answers every call).
        None => Pools {
            default: 0,
            current_is_default: false,
            generation,
        },
    };
    c.set_pools(ctx, pools);
    pools.current_is_default
}

/// Whether `key` names a stream of context `ctx` (the default streams always do: they are the current context's).
fn in_context<D: Driver>(c: &mut AllocCache, d: &D, key: StreamKey, ctx: usize) -> bool {
    let StreamKey::Handle(h) = key else {
        return true;
    };
    if let Some(owner) = c.stream_context(h) {
        return owner == ctx;
    }
    match d.stream_context(h) {
        Some(owner) => {
            c.set_stream_context(h, owner);
            owner == ctx
        }
        None => false,
    }
}

/// `cuMemAllocAsync(dptr, bytes, stream)` (`pt`: the `_ptsz` entry point) with the cache on.
///
/// # Safety
/// `dptr` is null or the program's out-parameter, writable.
pub unsafe fn alloc<D: Driver>(
    cache: &Mutex<AllocCache>,
    d: &D,
    dptr: *mut u64,
    bytes: usize,
    stream: usize,
    pt: bool,
) -> c_int {
    // SAFETY: the program's out-parameter, forwarded.
    let forward = || unsafe { d.alloc_async(dptr, bytes, stream, pt) };
    // During a capture the allocation is a graph node, owned by the graph: libcuda's.
    if dptr.is_null() || bytes == 0 || d.capturing() {
        return forward();
    }
    let Some(ctx) = d.current_context() else {
        return forward();
    };
    let key = StreamKey::of(stream, pt);
    let unmarked = {
        let mut c = locked(cache);
        if !serves(&mut c, d, ctx) || !in_context(&mut c, d, key, ctx) {
            drop(c);
            return forward();
        }
        if let Some(p) = c.take_async(ctx, bytes, lane(key), &mut |m| done(d, m)) {
            // SAFETY: the program's out-parameter, checked non-null.
            unsafe { *dptr = p };
            return CUDA_SUCCESS;
        }
        c.to_mark(ctx, bytes, lane(key))
    };
    // A block freed on another stream and never marked cannot be handed out here: marked now (a driver call, which a
    // free on that stream did not cost), a later allocation of this size can tell when it is.
    if let Some((p, on, freed)) = unmarked
        && let Some(m) = marker_on(cache, d, ctx, on)
    {
        // The guard must be gone before `recycle` locks again.
        let marked = locked(cache).mark(ctx, p, freed, m);
        if let Err(m) = marked {
            locked(cache).recycle(ctx, m);
        }
    }
    let mut r = forward();
    if r == CUDA_ERROR_OUT_OF_MEMORY && give_back(cache, d, ctx, true, true) {
        r = forward();
    }
    if r == CUDA_SUCCESS {
        // SAFETY: libcuda filled the out-parameter.
        let p = unsafe { *dptr };
        locked(cache).allocated_async(ctx, bytes, p);
    }
    r
}

/// `cuMemFreeAsync(ptr, stream)` (`pt`: the `_ptsz` entry point) with the cache on.
pub fn free<D: Driver>(
    cache: &Mutex<AllocCache>,
    d: &D,
    ptr: u64,
    stream: usize,
    pt: bool,
) -> c_int {
    let forward = || d.free_async(ptr, stream, pt);
    // Asked before the cache is locked (the engine's lock comes first).
    let capturing = d.capturing();
    let ctx = d.current_context();
    let key = StreamKey::of(stream, pt);
    let (keep, eager) = {
        let mut c = locked(cache);
        let keep = match c.block(ptr) {
            // A second free: libcuda must not free a block the cache holds; this is its answer to one it freed.
            Block::Held => return CUDA_ERROR_INVALID_VALUE,
            Block::Unknown => false,
            Block::Live => {
                // A cuMemAlloc block freed in stream order: libcuda's to free.
                c.release(ptr);
                false
            }
            Block::LiveAsync => {
                // A free captured into a graph is a graph node that frees the block when the graph runs: libcuda's.
                let keep = match ctx {
                    Some(ctx) if !capturing => {
                        serves(&mut c, d, ctx)
                            && in_context(&mut c, d, key, ctx)
                            && c.keeps_async(ctx, ptr)
                    }
                    _ => false,
                };
                if !keep {
                    c.release(ptr);
                }
                keep
            }
        };
        (
            keep,
            keep && ctx.is_some_and(|ctx| c.marks_at_free(ctx, ptr)),
        )
    };
    let (true, Some(ctx)) = (keep, ctx) else {
        return forward();
    };
    // A named stream: the block is held unmarked. An allocation on the same stream may take it at once (stream
    // order), any other once the stream is synchronized or the block marked (`alloc`): the free costs no driver call.
    // Marked now: a block of a size seen crossing between streams (the next allocation is likely another stream's),
    // and one freed on the per-thread default stream, which names another stream in each thread.
    let marker = if lane(key).is_some() && !eager {
        Marker::Stream
    } else {
        let Some(m) = marker_on(cache, d, ctx, key) else {
            // The stream's queue is another context's, or libcuda refused the record: the free is libcuda's.
            locked(cache).release(ptr);
            return forward();
        };
        m
    };
    let held = locked(cache).hold_async(ctx, ptr, lane(key), marker);
    match held {
        Ok(()) => CUDA_SUCCESS,
        Err(m) => {
            locked(cache).recycle(ctx, m);
            forward()
        }
    }
}

/// A synchronization returned success: of stream `key`, or with `key` `None` of the current context. The frees made
/// there before it began (`before`: [`super::frees_so_far`] read before it was forwarded) are complete, so their
/// blocks may go to any stream. (The hooks call it only while [`super::unmarked_held`].)
pub fn synchronized<D: Driver>(
    cache: &Mutex<AllocCache>,
    d: &D,
    key: Option<StreamKey>,
    before: u64,
) {
    let lane = match key {
        // A non-blocking stream: its frees followed its own work only.
        Some(StreamKey::Handle(h)) if d.stream_nonblocking(h) => Some(StreamKey::Handle(h)),
        // A free on the legacy stream or a blocking one also follows the other's earlier work (implicit
        // synchronization), which a synchronization of the stream alone does not wait for when the free itself never
        // reached libcuda: such frees complete with their context's synchronization, or when marked. Another thread's
        // default stream holds nothing unmarked.
        Some(_) => return,
        None => None,
    };
    let ctx = d.current_context();
    locked(cache).synchronized(ctx, lane, before);
}

/// Before stream `handle` is destroyed: the blocks freed on it and never marked are marked on it (at most
/// [`MARKS_AT_DESTROY`]; a marker outlives the stream), then handed out once their free is complete; any left unmarked
/// go back to libcuda, freed on the stream (after the program's free, in its order).
pub fn stream_destroyed<D: Driver>(cache: &Mutex<AllocCache>, d: &D, handle: usize) {
    let unmarked = locked(cache).unmarked_on(handle);
    for (p, ctx, freed) in unmarked.into_iter().take(MARKS_AT_DESTROY) {
        if let Some(m) = marker_on(cache, d, ctx, StreamKey::Handle(handle)) {
            let marked = locked(cache).mark(ctx, p, freed, m);
            if let Err(m) = marked {
                locked(cache).recycle(ctx, m);
            }
        }
    }
    let left = locked(cache).stream_destroyed(handle);
    for p in left {
        let r = d.free_async(p, handle, false);
        if r != CUDA_SUCCESS {
            tracing::warn!(
                ptr = format_args!("{p:#x}"),
                result = r,
                "libcuda refused to free a cached block on a stream being destroyed; the block stays allocated"
            );
        }
    }
}

/// The most blocks marked one by one when their stream is destroyed (a record each); more go back to libcuda.
const MARKS_AT_DESTROY: usize = 64;

/// Gives back to libcuda what the cache holds for the current context `ctx`: with `sync`, its `cuMemAlloc` blocks;
/// its stream-ordered blocks whose free is complete; and with `all` every other stream-ordered block, freed in its
/// stream's order where the stream is known (after the point the program freed it at: ordered after APEX's queues as
/// the program's own free would have been), else once its marker is waited for. Whether anything was given back.
pub fn give_back<D: Driver>(
    cache: &Mutex<AllocCache>,
    d: &D,
    ctx: usize,
    all: bool,
    sync: bool,
) -> bool {
    let (blocks, ready, pending) = {
        let mut c = locked(cache);
        let blocks = if sync { c.drain(ctx) } else { Vec::new() };
        let (ready, pending) = c.drain_async(ctx, all, &mut |m| done(d, m));
        (blocks, ready, pending)
    };
    let any = !(blocks.is_empty() && ready.is_empty() && pending.is_empty());
    for p in blocks {
        let _ = d.free(p);
    }
    // Pool blocks go back with cuMemFreeAsync (see `give_back_now`: libcuda keeps counting a pool block freed with
    // cuMemFree as used); their frees are complete, so the legacy stream's order costs nothing.
    for p in ready {
        let _ = d.free_async(p, LEGACY_STREAM, false);
    }
    for b in pending {
        let HeldBlock {
            ptr, lane, marker, ..
        } = b;
        match lane {
            Some(key) => {
                let _ = d.free_async(ptr, key.raw(), false);
            }
            None => {
                // Its stream is gone, or another thread's default stream: the CPU waits for the free's point. A queue
                // that failed will never get there; libcuda has the block then (its context failed with it).
                let _ = wait_marker(d, &marker);
                let _ = d.free_async(ptr, LEGACY_STREAM, false);
            }
        }
        locked(cache).recycle(ctx, marker);
    }
    any
}

/// The legacy default stream (a null `CUstream`), where blocks whose own stream cannot be used go back.
const LEGACY_STREAM: usize = 0;

/// Waits on the CPU until the work `m` marks is complete (or its queue failed, or libcuda refused the wait).
fn wait_marker<D: Driver>(d: &D, m: &Marker) -> Result<(), String> {
    match m {
        Marker::Done => Ok(()),
        Marker::Fence(f) => d.wait_fence(f),
        Marker::Event(e) => match d.event_synchronize(*e) {
            CUDA_SUCCESS => Ok(()),
            r => Err(format!("cuEventSynchronize returned CUresult {r}")),
        },
        // Never held without its stream (`AllocCache::stream_destroyed` hands such blocks back on it).
        Marker::Stream => Err("the free was not marked and its stream is unknown".into()),
    }
}

/// Gives back every stream-ordered block the cache holds for the current context `ctx` before the default pool's used
/// or reserved bytes are asked: each goes back with `cuMemFreeAsync`, on its own stream while the free's point is
/// pending (stream order makes that safe), else on the legacy stream. Not `cuMemFree`: on an H100 (driver
/// 580.159.04) libcuda still counted a pool block freed with `cuMemFree` as used (`alloc_async_loop.cu`: 35725312
/// bytes where libcuda alone answers 0, every `cuMemFree` returning success), and counted none after
/// `cuMemFreeAsync`. A block whose stream is gone waits on the CPU for its free's point first. Whether anything was
/// given back.
pub fn give_back_now<D: Driver>(cache: &Mutex<AllocCache>, d: &D, ctx: usize) -> bool {
    tracing::debug!(
        ctx = format_args!("{ctx:#x}"),
        "the pool's used bytes are asked: held stream-ordered blocks go back first"
    );
    give_back(cache, d, ctx, true, false)
}

/// After libcuda refused a `cuMemAlloc`, `cuMemAllocPitch` or `cuMemCreate` for want of memory: every block the cache
/// holds for `ctx` goes back, and if stream-ordered blocks did, the default pool is trimmed to its release threshold
/// (the program freed them; at its last synchronization the pool would have released them). Whether anything was
/// given back (then the call is tried again).
pub fn give_back_for_memory<D: Driver>(cache: &Mutex<AllocCache>, d: &D, ctx: usize) -> bool {
    let held_async = locked(cache).holds_async(ctx);
    let any = give_back(cache, d, ctx, true, true);
    if held_async {
        let pool = locked(cache).default_pool(ctx);
        if pool != 0 {
            d.trim_to_threshold(pool);
        }
    }
    any
}

/// Whether `pool` is the default pool of the current context's device (asked of libcuda if the cache does not know).
fn is_default<D: Driver>(cache: &Mutex<AllocCache>, d: &D, pool: usize) -> Option<usize> {
    let ctx = d.current_context()?;
    let mut c = locked(cache);
    serves(&mut c, d, ctx);
    (pool != 0 && c.default_pool(ctx) == pool).then_some(ctx)
}

/// Before `cuMemPoolTrimTo(pool, ..)`: on the default pool, the current context's held blocks whose free is complete
/// go back (the ones a trim may release: CUDA's own trim keeps memory whose free it has not seen complete), the
/// `cuMemAlloc` blocks too (memory the program freed, which it asks to give back), and the preload's spare events.
pub fn before_trim<D: Driver>(cache: &Mutex<AllocCache>, d: &D, pool: usize) {
    let Some(ctx) = is_default(cache, d, pool) else {
        return;
    };
    give_back(cache, d, ctx, false, true);
    let spares = locked(cache).take_spare_events(ctx);
    for e in spares {
        d.event_destroy(e);
    }
}

/// Before `cuMemPoolGetAttribute(pool, attr, ..)`: the pool's used or reserved bytes of the default pool are asked,
/// so every stream-ordered block the current context holds goes back first (the program freed them), each one
/// counted free by libcuda before the query is forwarded ([`give_back_now`]): a block the program freed is never
/// reported as used, whether or not its stream has reached the free yet.
pub fn before_pool_query<D: Driver>(cache: &Mutex<AllocCache>, d: &D, pool: usize, attr: c_int) {
    if attr != ATTR_USED_MEM_CURRENT && attr != ATTR_RESERVED_MEM_CURRENT {
        return;
    }
    let ctx = is_default(cache, d, pool);
    tracing::debug!(
        pool = format_args!("{pool:#x}"),
        attr,
        default_pool_of = ?ctx,
        "cuMemPoolGetAttribute"
    );
    if let Some(ctx) = ctx {
        give_back_now(cache, d, ctx);
    }
}

/// After a `cuDeviceSetMemPool` that succeeded (and [`super::pools_changed`], so that pools are asked again): the
/// current context's stream-ordered blocks (the default pool's) go back, since another pool may be current now.
pub fn after_pool_set<D: Driver>(cache: &Mutex<AllocCache>, d: &D) {
    if let Some(ctx) = d.current_context() {
        give_back(cache, d, ctx, true, false);
    }
}

#[cfg(test)]
mod tests;
