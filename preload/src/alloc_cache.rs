//! The preload's allocation cache (issue 30): `cuMemAlloc`/`cuMemFree` and `cuMemAllocAsync`/`cuMemFreeAsync`
//! (`APEX_PRELOAD_ALLOC_ASYNC=off` leaves the second pair to libcuda) (the runtime's `cudaMalloc`/`cudaFree` and `cudaMallocAsync`/`cudaFreeAsync`) served from a per-context cache of CUDA's
//! own allocations: a freed block is kept and handed back to the next allocation of the same size in the same context,
//! so a program that allocates and frees in a loop pays a lookup instead of RM and UVM work (and, on a stream APEX took
//! over, instead of the two hops a call left to libcuda costs).
//!
//! The blocks are libcuda's own allocations, so every CUDA answer about them stays as it was: the address is valid in
//! CUDA's address space, `cuPointerGetAttribute` and `cuMemGetAddressRange` describe a block of the size asked for
//! (sizes are matched exactly), copies and IPC work. A block of the stream-ordered path was allocated by libcuda's
//! `cuMemAllocAsync` from the device's default pool, so it is that pool's memory (`CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE`,
//! the pool's access settings), and the two paths never trade blocks. Only the buffer id
//! (`CU_POINTER_ATTRIBUTE_BUFFER_ID`) tells a reused block from a new one; asking about a block after freeing it is
//! undefined in CUDA and answers as for a live block here.
//!
//! What each free promises is kept:
//!
//! - `cuMemFree` waits, as libcuda's free does, for the context's work before the block can be handed out again.
//! - `cuMemFreeAsync(block, S)` returns at once; the block is handed to a later `cuMemAllocAsync` on `S` at once (stream
//!   order puts every later use after every earlier one) and to one on another stream only once `S`'s work up to the
//!   free is known complete. The free itself asks nothing of libcuda or the engine (a lookup): the block is held
//!   unmarked ([`Marker::Stream`]) and completes with a synchronization that began after the free and returned
//!   success: of the context, or of `S` itself where `S` is non-blocking (`cuStreamSynchronize`, an idle
//!   `cuStreamQuery`) — a free on the legacy stream or a blocking one also follows the other's earlier work, which a
//!   synchronization of `S` alone does not wait for. An allocation on another stream that finds only such blocks
//!   marks one: the fence of `S`'s APEX queue (taken over, its last launch standing for all of `S`'s work) or an event
//!   of the preload's recorded on `S` after the ordering a forwarded call gets (later work on `S` completes after the
//!   free), and from then on frees of that size are marked at once, as blocks of it cross between streams (the
//!   per-thread default stream's frees are always marked at once). A block not yet safe is simply not used: the
//!   allocation goes to libcuda. A stream destroyed with unmarked blocks freed on it gets them marked on it first (or,
//!   past 64 or where libcuda refuses the record, freed through libcuda on it). The stream-ordered path serves only while the device's
//!   current pool is its default pool (`cuDeviceSetMemPool` never made another one current), never during a graph
//!   capture (an allocation there is a graph node), and never `cuMemAllocFromPoolAsync`.
//! - A block freed through the other path's entry point (`cuMemFree` of a stream-ordered block, `cuMemFreeAsync` of a
//!   `cuMemAlloc` one) is libcuda's again: the call goes to libcuda, which answers as without the preload (for pool
//!   memory `cuMemFree` does not synchronize; the preload still waits for its own queues, as before any free).
//!
//! A block freed twice is refused as libcuda refuses it (`CUDA_ERROR_INVALID_VALUE`) instead of being handed to libcuda,
//! which still holds it for the cache. `cuMemGetInfo` counts the cached bytes as free; an allocation libcuda refuses for
//! want of memory is retried once after the context's cached blocks are really freed; `cuMemPoolTrimTo` on the default
//! pool first gives back what the cache holds and a trim may release (the `cuMemAlloc` blocks, and the stream-ordered
//! blocks whose free is complete: CUDA's trim keeps memory whose free it has not seen complete), so a program that
//! trims gets its device memory back; `cuMemPoolGetAttribute` of the pool's used or reserved bytes first gives back
//! every stream-ordered block, each counted free by libcuda before the query is forwarded (a pending free waited for,
//! then the block freed at once), so the figures describe the program's own allocations (the pool's high watermarks may
//! still count blocks the cache held). The flows of the stream-ordered path are in [`stream_ordered`].
//!
//! Which blocks to keep is predicted from the history of sizes: a block is kept only once its size has been asked for
//! more than once in its context (a loop's allocation), so a one-off allocation is freed at once and never held. The
//! bytes held are bounded (`APEX_PRELOAD_ALLOC_CACHE`, MiB, default 1024, both paths together; `off` or `0` turns the
//! cache off), and so are the stream-ordered blocks held (each may own an event).

pub mod stream_ordered;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::order::StreamKey;

/// Default bound on the bytes held, in MiB.
const DEFAULT_CAP_MIB: usize = 1024;
/// Sizes whose history is remembered; past it the history starts again (a program of ever-new sizes has no loop
/// to predict, and the map must not grow without bound).
const HISTORY: usize = 4096;
/// The most stream-ordered blocks held at once, over all contexts: each may own one of the preload's CUDA events, and
/// an allocation looks through its size's list.
pub const MAX_HELD_ASYNC: usize = 4096;
/// Blocks of one size an allocation looks at for one freed on its own stream, newest first (a loop frees and
/// allocates on one stream: its block is at the end).
const SAME_STREAM_LOOKS: usize = 8;
/// Blocks of one size an allocation looks at for one whose free is complete, oldest first (the likeliest complete):
/// each look may ask libcuda about an event.
const COMPLETE_LOOKS: usize = 4;

/// What the hook does with a block the program frees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Freed {
    /// Kept for the next allocation of its size: libcuda is not called.
    Kept,
    /// Not kept (a one-off size, the cache full, freed from another context): libcuda frees it.
    Released,
    /// Not an allocation the cache saw made: libcuda answers for it.
    Unknown,
}

/// What the cache knows of a pointer the program frees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Block {
    /// Not a block the cache saw made (allocated before the preload watched, by another entry point, or unknown to
    /// CUDA too): libcuda answers for it.
    Unknown,
    /// Handed out by `cuMemAlloc` (from the cache or libcuda) and not freed since.
    Live,
    /// Handed out by `cuMemAllocAsync` (from the cache or libcuda) and not freed since.
    LiveAsync,
    /// Freed by the program and held by the cache: a second free, which libcuda must not see (it still holds the
    /// block for the cache).
    Held,
}

/// Where a stream's work up to a stream-ordered free stands: once complete, the block may go to any stream.
#[derive(Debug)]
pub enum Marker {
    /// Complete.
    Done,
    /// Complete once this fence of the stream's APEX queue is: the queue's last launch stood for all of the stream's
    /// work at the free.
    Fence(apex::Fence),
    /// Complete once this CUDA event (the preload's own, recorded on the stream at or after the free) is.
    Event(usize),
    /// Nothing asked at the free (it cost a lookup, not a driver call): complete once the block's stream (its
    /// [`HeldBlock::lane`], never `None` with this marker) has done its work up to the free. A synchronization of that
    /// stream that returned makes it [`Marker::Done`]; a fence or event taken on the stream later stands for it (later
    /// work on a stream completes after earlier work), which an allocation on another stream asks for when it finds
    /// no block ready ([`AllocCache::to_mark`]).
    Stream,
}

impl Marker {
    /// The preload's event this marker holds, if any (to be used again once the marker is no longer needed).
    pub fn event(&self) -> Option<usize> {
        match self {
            Marker::Event(e) => Some(*e),
            _ => None,
        }
    }
}

/// The stream an allocation or free names, as far as handing a block out again at once goes: `None` for the
/// per-thread default stream, which names a different stream in each thread (and one that may outlive its thread's id).
pub fn lane(key: StreamKey) -> Option<StreamKey> {
    (!key.is_per_thread()).then_some(key)
}

/// A stream-ordered block the program freed, held by the cache.
#[derive(Debug)]
pub struct HeldBlock {
    /// Its address.
    pub ptr: u64,
    /// Its size.
    pub bytes: usize,
    /// The stream it was freed on: an allocation there may take it at once. `None`: the per-thread default stream, or
    /// a stream destroyed since.
    pub lane: Option<StreamKey>,
    /// Where the stream's work up to the free stands.
    pub marker: Marker,
    /// The free's place among every stream-ordered free the cache kept ([`frees_so_far`]): a synchronization
    /// completes only frees made before it began.
    pub freed: u64,
}

/// Stream-ordered frees the cache has kept so far, in this process (each [`HeldBlock::freed`] is its place).
static FREES: AtomicU64 = AtomicU64::new(0);

/// How many stream-ordered frees the cache had kept when this was asked: a hook reads it before it forwards a
/// synchronization, and hands the count to [`AllocCache::synchronized`], so that a free another thread made while the
/// synchronization ran (after work the synchronization may not have waited for) is not taken as complete.
pub fn frees_so_far() -> u64 {
    FREES.load(Ordering::SeqCst)
}

/// What the cache knows of a context's device's memory pools, for one value of [`pool_generation`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pools {
    /// The device's default pool (0: unknown).
    pub default: usize,
    /// Whether it is the device's current pool: only then does `cuMemAllocAsync` allocate from it, and only then is
    /// the stream-ordered path served.
    pub current_is_default: bool,
    /// The [`pool_generation`] it was asked at.
    pub generation: u64,
}

/// The cache's counters, for the preload's summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// `cuMemAlloc` calls answered from the cache.
    pub hits: u64,
    /// `cuMemAlloc` calls that went to libcuda.
    pub misses: u64,
    /// `cuMemFree` calls whose block was kept.
    pub kept: u64,
    /// The most bytes held at once (both paths).
    pub peak_bytes: u64,
    /// Bytes held now (both paths).
    pub held_bytes: u64,
    /// `cuMemAllocAsync` calls answered from the cache.
    pub async_hits: u64,
    /// `cuMemAllocAsync` calls the cache served that went to libcuda.
    pub async_misses: u64,
    /// Of those, the ones for which blocks of the size were held, none freed on the allocation's stream nor known
    /// complete.
    pub async_unready: u64,
    /// `cuMemFreeAsync` calls whose block was kept.
    pub async_kept: u64,
}

/// One block the cache saw made.
#[derive(Clone, Copy, Debug)]
struct Entry {
    ctx: usize,
    bytes: usize,
    /// Made by `cuMemAllocAsync`.
    stream_ordered: bool,
    /// Freed by the program and kept.
    held: bool,
}

/// The cache's state: every block it saw made, the free ones of each path by (context, size), how often each size was
/// asked for, and what the stream-ordered path needs to know of pools, streams and its own events.
#[derive(Debug)]
pub struct AllocCache {
    cap: usize,
    blocks: HashMap<u64, Entry>,
    free: HashMap<(usize, usize), Vec<u64>>,
    free_async: HashMap<(usize, usize), VecDeque<HeldBlock>>,
    /// (context, size, stream-ordered) → how often asked.
    asked: HashMap<(usize, usize, bool), u32>,
    held: usize,
    held_async: usize,
    /// Stream-ordered blocks held without a marker ([`Marker::Stream`]).
    unmarked: usize,
    /// (context, size) of stream-ordered allocations that found blocks of their size freed on another stream and
    /// not marked: frees of that size are marked at once from then on (a program that hands blocks between streams).
    crossing: HashSet<(usize, usize)>,
    pools: HashMap<usize, Pools>,
    /// Stream handle → its context, as libcuda said.
    streams: HashMap<usize, usize>,
    /// (context, event): the preload's events no marker holds.
    spare_events: Vec<(usize, usize)>,
    stats: CacheStats,
}

/// Stream-ordered blocks held without a marker ([`Marker::Stream`]), so that a synchronization with none held costs
/// one load.
static UNMARKED: AtomicUsize = AtomicUsize::new(0);

/// Whether any stream-ordered block is held without a marker (a synchronization may then complete it).
pub fn unmarked_held() -> bool {
    UNMARKED.load(Ordering::Relaxed) > 0
}

/// Bumped whenever the program changes a device's current pool: what the cache knows of pools is asked again.
static POOL_GENERATION: AtomicU64 = AtomicU64::new(1);

/// The current pool generation (see [`pools_changed`]).
pub fn pool_generation() -> u64 {
    POOL_GENERATION.load(Ordering::Relaxed)
}

/// The program made a pool current (`cuDeviceSetMemPool`): every context's pools are asked again.
pub fn pools_changed() {
    POOL_GENERATION.fetch_add(1, Ordering::Relaxed);
}

impl AllocCache {
    /// A cache holding at most `cap` bytes (0: nothing is ever kept).
    pub fn new(cap: usize) -> AllocCache {
        AllocCache {
            cap,
            blocks: HashMap::new(),
            free: HashMap::new(),
            free_async: HashMap::new(),
            asked: HashMap::new(),
            held: 0,
            held_async: 0,
            unmarked: 0,
            crossing: HashSet::new(),
            pools: HashMap::new(),
            streams: HashMap::new(),
            spare_events: Vec::new(),
            stats: CacheStats::default(),
        }
    }

    /// The cache `APEX_PRELOAD` and `APEX_PRELOAD_ALLOC_CACHE` ask for (`None`: off).
    pub fn from_env() -> Option<AllocCache> {
        if matches!(
            std::env::var("APEX_PRELOAD").as_deref(),
            Ok("off" | "0" | "false")
        ) {
            return None;
        }
        let mib = match std::env::var("APEX_PRELOAD_ALLOC_CACHE").as_deref() {
            Ok("off" | "false") => 0,
            Ok(v) => v.parse().unwrap_or(DEFAULT_CAP_MIB),
            Err(_) => DEFAULT_CAP_MIB,
        };
        (mib > 0).then(|| AllocCache::new(mib.saturating_mul(1 << 20)))
    }

    /// Counts a request of `bytes` in `ctx` on one path; whether the size was asked for before.
    fn remember(&mut self, ctx: usize, bytes: usize, stream_ordered: bool) {
        let key = (ctx, bytes, stream_ordered);
        if self.asked.len() >= HISTORY && !self.asked.contains_key(&key) {
            self.asked.clear();
        }
        let n = self.asked.entry(key).or_insert(0);
        *n = n.saturating_add(1);
    }

    /// Whether `bytes` was asked for more than once in `ctx` on one path (a loop's size).
    fn repeated(&self, ctx: usize, bytes: usize, stream_ordered: bool) -> bool {
        self.asked
            .get(&(ctx, bytes, stream_ordered))
            .is_some_and(|&n| n > 1)
    }

    fn note_held(&mut self) {
        self.stats.peak_bytes = self.stats.peak_bytes.max(self.held as u64);
    }

    // ---- cuMemAlloc / cuMemFree ----

    /// An allocation of `bytes` in context `ctx`: a kept block of that size, or `None` (then libcuda allocates and
    /// [`AllocCache::allocated`] records its answer).
    pub fn take(&mut self, ctx: usize, bytes: usize) -> Option<u64> {
        self.remember(ctx, bytes, false);
        let Some(ptr) = self.free.get_mut(&(ctx, bytes)).and_then(Vec::pop) else {
            self.stats.misses += 1;
            return None;
        };
        self.held -= bytes;
        if let Some(e) = self.blocks.get_mut(&ptr) {
            e.held = false;
        }
        self.stats.hits += 1;
        Some(ptr)
    }

    /// libcuda allocated `ptr` of `bytes` in `ctx` (`cuMemAlloc`).
    pub fn allocated(&mut self, ctx: usize, bytes: usize, ptr: u64) {
        self.record(ctx, bytes, ptr, false);
    }

    /// A block libcuda handed out: a block the cache held at this address was freed behind its back (it cannot be,
    /// unless a graph freed it): forgotten.
    fn record(&mut self, ctx: usize, bytes: usize, ptr: u64, stream_ordered: bool) {
        let entry = Entry {
            ctx,
            bytes,
            stream_ordered,
            held: false,
        };
        if let Some(old) = self.blocks.insert(ptr, entry)
            && old.held
        {
            self.unhold(ptr, old);
        }
    }

    /// Removes a held block from its free list (libcuda reused its address: it is no longer the cache's).
    fn unhold(&mut self, ptr: u64, old: Entry) {
        let key = (old.ctx, old.bytes);
        let found = if old.stream_ordered {
            let removed = self
                .free_async
                .get_mut(&key)
                .and_then(|l| l.remove(l.iter().position(|b| b.ptr == ptr)?));
            if let Some(b) = &removed {
                self.held_async -= 1;
                if matches!(b.marker, Marker::Stream) {
                    self.set_unmarked(self.unmarked.saturating_sub(1));
                }
                if let Some(e) = b.marker.event() {
                    self.spare_events.push((old.ctx, e));
                }
            }
            removed.is_some()
        } else {
            self.free
                .get_mut(&key)
                .and_then(|l| Some(l.swap_remove(l.iter().position(|&p| p == ptr)?)))
                .is_some()
        };
        if found {
            self.held -= old.bytes;
        }
    }

    /// Whether `ptr` is a `cuMemAlloc` block the cache handed out or saw made, not freed since (so a free of it may be
    /// kept).
    pub fn knows(&self, ptr: u64) -> bool {
        self.block(ptr) == Block::Live
    }

    /// What the cache knows of `ptr`.
    pub fn block(&self, ptr: u64) -> Block {
        match self.blocks.get(&ptr) {
            None => Block::Unknown,
            Some(e) if e.held => Block::Held,
            Some(e) if e.stream_ordered => Block::LiveAsync,
            Some(_) => Block::Live,
        }
    }

    /// The program frees `ptr` (`cuMemFree`) with context `ctx` current, after the context's work was waited for.
    pub fn freed(&mut self, ctx: usize, ptr: u64) -> Freed {
        let Some(&e) = self
            .blocks
            .get(&ptr)
            .filter(|e| !e.held && !e.stream_ordered)
        else {
            return Freed::Unknown;
        };
        if e.ctx != ctx || !self.repeated(e.ctx, e.bytes, false) || self.held + e.bytes > self.cap {
            self.blocks.remove(&ptr);
            return Freed::Released;
        }
        self.free.entry((e.ctx, e.bytes)).or_default().push(ptr);
        if let Some(e) = self.blocks.get_mut(&ptr) {
            e.held = true;
        }
        self.held += e.bytes;
        self.stats.kept += 1;
        self.note_held();
        Freed::Kept
    }

    /// `ptr`, handed out and not freed, goes back to libcuda without being kept (freed while a graph capture runs,
    /// freed through the other path's entry point, or not kept by the stream-ordered path). A held block stays held.
    pub fn release(&mut self, ptr: u64) {
        if self.blocks.get(&ptr).is_some_and(|e| !e.held) {
            self.blocks.remove(&ptr);
        }
    }

    /// Takes every kept `cuMemAlloc` block of `ctx` out of the cache, for libcuda to free (it ran out of memory).
    pub fn drain(&mut self, ctx: usize) -> Vec<u64> {
        let keys: Vec<(usize, usize)> = self.free.keys().filter(|k| k.0 == ctx).copied().collect();
        let mut out = Vec::new();
        for k in keys {
            if let Some(v) = self.free.remove(&k) {
                self.held -= k.1 * v.len();
                for p in &v {
                    self.blocks.remove(p);
                }
                out.extend(v);
            }
        }
        out
    }

    /// Bytes kept for context `ctx` by both paths (free to the program, though libcuda counts them used).
    pub fn held_in(&self, ctx: usize) -> usize {
        let sync: usize = self
            .free
            .iter()
            .filter(|(k, _)| k.0 == ctx)
            .map(|(k, v)| k.1 * v.len())
            .sum();
        let stream_ordered: usize = self
            .free_async
            .iter()
            .filter(|(k, _)| k.0 == ctx)
            .map(|(k, v)| k.1 * v.len())
            .sum();
        sync + stream_ordered
    }

    // ---- cuMemAllocAsync / cuMemFreeAsync ----

    /// Whether the stream-ordered path serves context `ctx` at pool generation `generation`: `None` when the cache
    /// does not know (ask libcuda and tell [`AllocCache::set_pools`]).
    pub fn serves_async(&self, ctx: usize, generation: u64) -> Option<bool> {
        self.pools
            .get(&ctx)
            .filter(|p| p.generation == generation)
            .map(|p| p.current_is_default)
    }

    /// What libcuda said of `ctx`'s device's pools.
    pub fn set_pools(&mut self, ctx: usize, pools: Pools) {
        self.pools.insert(ctx, pools);
    }

    /// The default pool of `ctx`'s device, as last asked (0: not known).
    pub fn default_pool(&self, ctx: usize) -> usize {
        self.pools.get(&ctx).map_or(0, |p| p.default)
    }

    /// Whether the stream-ordered path serves `ctx` as last asked (whatever the generation).
    fn served(&self, ctx: usize) -> bool {
        self.pools.get(&ctx).is_some_and(|p| p.current_is_default)
    }

    /// The context of stream `handle`, as libcuda said (`None`: not asked yet).
    pub fn stream_context(&self, handle: usize) -> Option<usize> {
        self.streams.get(&handle).copied()
    }

    /// What libcuda said of stream `handle`'s context.
    pub fn set_stream_context(&mut self, handle: usize, ctx: usize) {
        self.streams.insert(handle, ctx);
    }

    /// The blocks freed on stream `handle` and not marked: (address, context, the free's place), for the caller to
    /// mark on the stream before it is destroyed ([`AllocCache::mark`]).
    pub fn unmarked_on(&self, handle: usize) -> Vec<(u64, usize, u64)> {
        let on = Some(StreamKey::Handle(handle));
        self.free_async
            .iter()
            .flat_map(|(k, l)| l.iter().map(move |b| (k.0, b)))
            .filter(|(_, b)| b.lane == on && matches!(b.marker, Marker::Stream))
            .map(|(ctx, b)| (b.ptr, ctx, b.freed))
            .collect()
    }

    /// The program destroyed stream `handle`: blocks freed on it are handed out only once their free is complete (a
    /// new stream may get the same handle), and its context is asked again if the handle comes back.
    ///
    /// Returns the blocks freed on it that are still not marked ([`Marker::Stream`]: marking them on the stream failed,
    /// see [`AllocCache::unmarked_on`]): out of the cache now, for libcuda to free on the stream before it goes (stream
    /// order keeps that free after the program's).
    pub fn stream_destroyed(&mut self, handle: usize) -> Vec<u64> {
        self.streams.remove(&handle);
        let gone = Some(StreamKey::Handle(handle));
        let mut unmarked = Vec::new();
        for list in self.free_async.values_mut() {
            list.retain_mut(|b| {
                if b.lane != gone {
                    return true;
                }
                if matches!(b.marker, Marker::Stream) {
                    unmarked.push(b.ptr);
                    return false;
                }
                b.lane = None;
                true
            });
        }
        self.forget_held(&unmarked);
        unmarked
    }

    /// Blocks taken out of the stream-ordered lists for libcuda: no longer the cache's.
    fn forget_held(&mut self, ptrs: &[u64]) {
        for p in ptrs {
            if let Some(e) = self.blocks.remove(p) {
                self.held -= e.bytes;
                self.held_async -= 1;
            }
        }
        self.free_async.retain(|_, l| !l.is_empty());
        self.count_unmarked();
    }

    /// Recounts the blocks held without a marker ([`unmarked_held`]).
    fn count_unmarked(&mut self) {
        let n = self
            .free_async
            .values()
            .flat_map(|l| l.iter())
            .filter(|b| matches!(b.marker, Marker::Stream))
            .count();
        self.set_unmarked(n);
    }

    /// Sets the count of blocks held without a marker, and its copy for [`unmarked_held`].
    fn set_unmarked(&mut self, n: usize) {
        self.unmarked = n;
        UNMARKED.store(n, Ordering::Relaxed);
    }

    /// A synchronization returned: of stream `lane` (a handle names one stream in any context; the legacy stream
    /// is `ctx`'s), or with `lane` `None` of context `ctx` as a whole. The frees made there before it began (the
    /// first `before` of them: [`frees_so_far`] read before the synchronization was forwarded) are complete.
    pub fn synchronized(&mut self, ctx: Option<usize>, lane: Option<StreamKey>, before: u64) {
        let any_context = matches!(lane, Some(StreamKey::Handle(_)));
        for (k, list) in self
            .free_async
            .iter_mut()
            .filter(|(k, _)| any_context || Some(k.0) == ctx)
        {
            for b in list.iter_mut() {
                if b.freed < before && (lane.is_none() || b.lane == lane) {
                    // Whatever marked it, the free is complete: a marker's event goes back to the spares.
                    let m = std::mem::replace(&mut b.marker, Marker::Done);
                    if let Some(e) = m.event() {
                        self.spare_events.push((k.0, e));
                    }
                }
            }
        }
        self.count_unmarked();
    }

    /// After an allocation of `bytes` on `lane` in `ctx` found no block ready: the oldest block of that size freed
    /// on another stream and not marked yet, with its stream, for the caller to mark ([`AllocCache::mark`]) so that
    /// a later allocation can tell when it is free. Such a find also predicts that blocks of this size cross between
    /// streams: their frees are marked at once from then on ([`AllocCache::marks_at_free`]). Returns the block's
    /// address, its stream and its free's place ([`HeldBlock::freed`], for [`AllocCache::mark`]).
    pub fn to_mark(
        &mut self,
        ctx: usize,
        bytes: usize,
        lane: Option<StreamKey>,
    ) -> Option<(u64, StreamKey, u64)> {
        let found =
            self.free_async
                .get(&(ctx, bytes))?
                .iter()
                .find_map(|b| match (b.lane, &b.marker) {
                    (Some(l), Marker::Stream) if Some(l) != lane => Some((b.ptr, l, b.freed)),
                    _ => None,
                });
        if found.is_some() {
            if self.crossing.len() >= HISTORY {
                self.crossing.clear();
            }
            self.crossing.insert((ctx, bytes));
        }
        found
    }

    /// Whether the free of stream-ordered block `ptr` in `ctx` is marked at once rather than left unmarked: its size
    /// was seen crossing between streams ([`AllocCache::to_mark`]).
    pub fn marks_at_free(&self, ctx: usize, ptr: u64) -> bool {
        self.blocks
            .get(&ptr)
            .is_some_and(|e| self.crossing.contains(&(ctx, e.bytes)))
    }

    /// Gives held block `ptr`, not marked yet, `marker` (taken on its stream after its free, the one at place
    /// `freed`). `Err` (with the marker, for its event) when the block is gone, was marked meanwhile, or was handed out
    /// and freed again since (the marker may then stand for less than its last use).
    pub fn mark(&mut self, ctx: usize, ptr: u64, freed: u64, marker: Marker) -> Result<(), Marker> {
        let Some(bytes) = self.blocks.get(&ptr).filter(|e| e.held).map(|e| e.bytes) else {
            return Err(marker);
        };
        let Some(b) = self
            .free_async
            .get_mut(&(ctx, bytes))
            .and_then(|l| l.iter_mut().find(|b| b.ptr == ptr))
        else {
            return Err(marker);
        };
        if !matches!(b.marker, Marker::Stream) || b.freed != freed {
            return Err(marker);
        }
        b.marker = marker;
        self.set_unmarked(self.unmarked.saturating_sub(1));
        Ok(())
    }

    /// A stream-ordered allocation of `bytes` in `ctx` on stream `lane` (see [`lane`]): a held block freed on the same
    /// stream (the newest), else one whose free `done` says is complete (the oldest), else `None` (then libcuda
    /// allocates and [`AllocCache::allocated_async`] records its answer). `done` may ask libcuda about an event; a
    /// block's event goes back to the spare events once the block is taken.
    pub fn take_async(
        &mut self,
        ctx: usize,
        bytes: usize,
        lane: Option<StreamKey>,
        done: &mut dyn FnMut(&Marker) -> bool,
    ) -> Option<u64> {
        self.remember(ctx, bytes, true);
        let list = match self.free_async.get_mut(&(ctx, bytes)) {
            Some(l)
                if !l.is_empty() && self.pools.get(&ctx).is_some_and(|p| p.current_is_default) =>
            {
                l
            }
            _ => {
                self.stats.async_misses += 1;
                return None;
            }
        };
        let n = list.len();
        let same = lane.and_then(|l| {
            list.iter()
                .rev()
                .take(SAME_STREAM_LOOKS)
                .position(|b| b.lane == Some(l))
                .map(|i| n - 1 - i)
        });
        let pick = same.or_else(|| {
            list.iter()
                .take(COMPLETE_LOOKS)
                .position(|b| matches!(b.marker, Marker::Done) || done(&b.marker))
        });
        let Some(b) = pick.and_then(|i| list.remove(i)) else {
            self.stats.async_misses += 1;
            self.stats.async_unready += 1;
            return None;
        };
        self.held -= b.bytes;
        self.held_async -= 1;
        if matches!(b.marker, Marker::Stream) {
            self.set_unmarked(self.unmarked.saturating_sub(1));
        }
        if let Some(e) = b.marker.event() {
            self.spare_events.push((ctx, e));
        }
        if let Some(e) = self.blocks.get_mut(&b.ptr) {
            e.held = false;
        }
        self.stats.async_hits += 1;
        Some(b.ptr)
    }

    /// libcuda allocated `ptr` of `bytes` in `ctx` (`cuMemAllocAsync` from the default pool).
    pub fn allocated_async(&mut self, ctx: usize, bytes: usize, ptr: u64) {
        self.record(ctx, bytes, ptr, true);
    }

    /// Whether a `cuMemFreeAsync` of `ptr` with `ctx` current would be kept: a stream-ordered block of `ctx` handed
    /// out and not freed, of a size asked for more than once, with room under both bounds, while the default pool is
    /// current.
    pub fn keeps_async(&self, ctx: usize, ptr: u64) -> bool {
        self.blocks.get(&ptr).is_some_and(|e| {
            e.stream_ordered
                && !e.held
                && e.ctx == ctx
                && self.repeated(ctx, e.bytes, true)
                && self.held + e.bytes <= self.cap
                && self.held_async < MAX_HELD_ASYNC
                && self.served(ctx)
        })
    }

    /// Holds `ptr`, freed by the program on stream `lane` with `ctx` current, its stream's work up to the free as
    /// `marker` says. `Err` (with the marker, for its event) when it cannot be kept after all (see
    /// [`AllocCache::keeps_async`]; another thread may have filled the cache meanwhile): the block is no longer the
    /// cache's, and libcuda frees it.
    pub fn hold_async(
        &mut self,
        ctx: usize,
        ptr: u64,
        lane: Option<StreamKey>,
        marker: Marker,
    ) -> Result<(), Marker> {
        if !self.keeps_async(ctx, ptr) {
            self.release(ptr);
            return Err(marker);
        }
        let Some(e) = self.blocks.get_mut(&ptr) else {
            return Err(marker);
        };
        e.held = true;
        let bytes = e.bytes;
        if matches!(marker, Marker::Stream) {
            self.set_unmarked(self.unmarked + 1);
        }
        self.free_async
            .entry((ctx, bytes))
            .or_default()
            .push_back(HeldBlock {
                ptr,
                bytes,
                lane,
                marker,
                freed: FREES.fetch_add(1, Ordering::SeqCst),
            });
        self.held += bytes;
        self.held_async += 1;
        self.stats.async_kept += 1;
        self.note_held();
        Ok(())
    }

    /// Takes stream-ordered blocks of `ctx` out of the cache, for libcuda to free: those whose free `done` says is
    /// complete (their events back to the spares), those never marked ([`Marker::Stream`]: libcuda frees them on their
    /// streams), and with `all` every other one too. Returns (the complete ones'
    /// addresses, the others).
    pub fn drain_async(
        &mut self,
        ctx: usize,
        all: bool,
        done: &mut dyn FnMut(&Marker) -> bool,
    ) -> (Vec<u64>, Vec<HeldBlock>) {
        let (mut ready, mut pending) = (Vec::new(), Vec::new());
        let mut keys: Vec<(usize, usize)> = self
            .free_async
            .keys()
            .filter(|k| k.0 == ctx)
            .copied()
            .collect();
        // Smallest size first: the order libcuda sees does not depend on the map's.
        keys.sort_unstable();
        for k in keys {
            let Some(list) = self.free_async.get_mut(&k) else {
                continue;
            };
            let mut kept = VecDeque::new();
            for b in list.drain(..) {
                if matches!(b.marker, Marker::Done) || done(&b.marker) {
                    if let Some(e) = b.marker.event() {
                        self.spare_events.push((ctx, e));
                    }
                    ready.push(b.ptr);
                } else if all || matches!(b.marker, Marker::Stream) {
                    // Not marked: nothing tells whether its free is complete, and libcuda can tell once it has the
                    // block, freed on its own stream after the program's free.
                    pending.push(b);
                } else {
                    kept.push_back(b);
                }
            }
            *list = kept;
        }
        for p in ready.iter().chain(pending.iter().map(|b| &b.ptr)) {
            if let Some(e) = self.blocks.remove(p) {
                self.held -= e.bytes;
                self.held_async -= 1;
            }
        }
        self.free_async.retain(|_, l| !l.is_empty());
        self.count_unmarked();
        (ready, pending)
    }

    /// Whether stream-ordered blocks of `ctx` are held.
    pub fn holds_async(&self, ctx: usize) -> bool {
        self.free_async.keys().any(|k| k.0 == ctx)
    }

    /// One of the preload's events of `ctx` no marker holds, if any.
    pub fn spare_event(&mut self, ctx: usize) -> Option<usize> {
        let i = self.spare_events.iter().rposition(|&(c, _)| c == ctx)?;
        Some(self.spare_events.swap_remove(i).1)
    }

    /// `marker` of `ctx` is no longer needed: its event, if any, is kept for another free.
    pub fn recycle(&mut self, ctx: usize, marker: Marker) {
        if let Some(e) = marker.event() {
            self.spare_events.push((ctx, e));
        }
    }

    /// Takes every spare event of `ctx` out of the cache, for libcuda to destroy.
    pub fn take_spare_events(&mut self, ctx: usize) -> Vec<usize> {
        let mut out = Vec::new();
        self.spare_events.retain(|&(c, e)| {
            if c == ctx {
                out.push(e);
            }
            c != ctx
        });
        out
    }

    // ---- both ----

    /// A context went away: libcuda freed its blocks and events with it, so the cache forgets them (every context's,
    /// when `ctx` is `None`: a primary context reset names a device, not a context).
    pub fn forget(&mut self, ctx: Option<usize>) {
        let gone = |c: usize| ctx.is_none_or(|x| x == c);
        self.free.retain(|k, _| !gone(k.0));
        self.free_async.retain(|k, _| !gone(k.0));
        self.blocks.retain(|_, e| !gone(e.ctx));
        self.asked.retain(|k, _| !gone(k.0));
        self.pools.retain(|&c, _| !gone(c));
        self.streams.retain(|_, &mut c| !gone(c));
        self.spare_events.retain(|&(c, _)| !gone(c));
        self.held = self.free.iter().map(|(k, v)| k.1 * v.len()).sum::<usize>()
            + self
                .free_async
                .iter()
                .map(|(k, v)| k.1 * v.len())
                .sum::<usize>();
        self.held_async = self.free_async.values().map(VecDeque::len).sum();
        self.count_unmarked();
    }

    /// The counters so far.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            held_bytes: self.held as u64,
            ..self.stats
        }
    }
}

/// The process's cache, made from the environment on first use (`None`: off).
pub fn global() -> Option<&'static Mutex<AllocCache>> {
    static CACHE: OnceLock<Option<Mutex<AllocCache>>> = OnceLock::new();
    CACHE
        .get_or_init(|| AllocCache::from_env().map(Mutex::new))
        .as_ref()
}

/// Locks `m` (a panic while it was held cannot leave the cache inconsistent for a lookup: every change is a few
/// inserts or removes, none of which can fail halfway).
pub fn locked(m: &Mutex<AllocCache>) -> MutexGuard<'_, AllocCache> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The process's cache, locked.
pub fn lock() -> Option<MutexGuard<'static, AllocCache>> {
    global().map(locked)
}

#[cfg(test)]
mod tests;
