//! Stream-ordered memory pools: device memory allocated and freed in a queue's order, at launch speed.
//!
//! On the direct path the pool cuts chunks of RM video memory (the memory [`Gpu::alloc`] gets) into size classes
//! and gives requests above a threshold chunks of their own; a block freed on a queue is reused by that queue's
//! later work at once and by other queues once the queue's timeline shows the work before the free complete
//! ([`suballoc`] holds the allocator, testable without hardware). On the CUDA driver backend the pool is a CUDA
//! memory pool (`cuMemPoolCreate`, `cuMemAllocFromPoolAsync`, `cuMemFreeAsync`).

mod suballoc;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::backend::Backed;
use super::{Backend, Error, Gpu, PoolOutOfMemory, Queue, Result};
use crate::driver;
use crate::launch::{Arg, ComputeQueue};
use crate::pushbuf;
use crate::rm::{self, GpuCore, Memory, MemoryDesc};

use suballoc::{Alloc, BlockId, Clock, Config, NO_SLOT, Suballocator};

/// How [`Gpu::pool`] builds a memory pool.
///
/// ```
/// use apex::PoolOptions;
/// // Keep up to 256 MiB cached; never reserve more than 4 GiB.
/// let options = PoolOptions::default()
///     .release_threshold(256 << 20)
///     .reserve_limit(Some(4 << 30));
/// assert_eq!(options.chunk_bytes, 2 << 20);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolOptions {
    /// Bytes of memory the pool keeps reserved before it gives idle memory back to the driver
    /// (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`). The default, `u64::MAX`, keeps everything until
    /// [`MemoryPool::trim`]: an allocation that hits the pool costs no system call. On the direct path idle chunks
    /// above the threshold are released when a free leaves a chunk idle and before the pool grows; on the driver
    /// backend CUDA releases them at synchronizations.
    pub release_threshold: u64,
    /// The most bytes the pool may reserve (`None`, the default: as much as the device has). An allocation that
    /// would go beyond fails with [`Error::PoolOutOfMemory`] once idle memory was given back. On the driver backend
    /// this is the CUDA pool's `maxSize`.
    pub reserve_limit: Option<u64>,
    /// Direct path: bytes of each chunk the size classes are cut from (2 MiB by default; a multiple of 64 KiB).
    pub chunk_bytes: u64,
    /// Direct path: requests above this many bytes get memory of their own, rounded to 64 KiB (2 MiB from 8 MiB
    /// on), cached and reused for requests of up to a quarter less (512 KiB by default; at most half of
    /// `chunk_bytes`).
    pub large_threshold: u64,
}

impl Default for PoolOptions {
    fn default() -> PoolOptions {
        PoolOptions {
            release_threshold: u64::MAX,
            reserve_limit: None,
            chunk_bytes: 2 << 20,
            large_threshold: 512 << 10,
        }
    }
}

impl PoolOptions {
    /// Sets [`release_threshold`](Self::release_threshold).
    pub fn release_threshold(mut self, bytes: u64) -> PoolOptions {
        self.release_threshold = bytes;
        self
    }

    /// Sets [`reserve_limit`](Self::reserve_limit).
    pub fn reserve_limit(mut self, bytes: Option<u64>) -> PoolOptions {
        self.reserve_limit = bytes;
        self
    }

    /// Sets [`chunk_bytes`](Self::chunk_bytes).
    pub fn chunk_bytes(mut self, bytes: u64) -> PoolOptions {
        self.chunk_bytes = bytes;
        self
    }

    /// Sets [`large_threshold`](Self::large_threshold).
    pub fn large_threshold(mut self, bytes: u64) -> PoolOptions {
        self.large_threshold = bytes;
        self
    }

    fn check(&self) -> Result<()> {
        const CHUNK_GRAIN: u64 = 64 << 10;
        if self.chunk_bytes < CHUNK_GRAIN || !self.chunk_bytes.is_multiple_of(CHUNK_GRAIN) {
            return Err(Error::InvalidArgument(format!(
                "PoolOptions::chunk_bytes is {}: it must be a non-zero multiple of 64 KiB",
                self.chunk_bytes
            )));
        }
        if self.large_threshold == 0 || self.large_threshold > self.chunk_bytes / 2 {
            return Err(Error::InvalidArgument(format!(
                "PoolOptions::large_threshold is {}: it must be between 1 and half of chunk_bytes ({})",
                self.large_threshold,
                self.chunk_bytes / 2
            )));
        }
        Ok(())
    }
}

/// What a [`MemoryPool`] holds and how it served its requests ([`MemoryPool::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Bytes of device memory the pool holds (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT` on the driver backend).
    pub reserved_bytes: u64,
    /// Bytes handed out and not freed: whole blocks on the direct path (the size class, or the dedicated memory, a
    /// request got), `CU_MEMPOOL_ATTR_USED_MEM_CURRENT` on the driver backend.
    pub used_bytes: u64,
    /// The most bytes reserved at once.
    pub reserved_high_bytes: u64,
    /// The most bytes in use at once.
    pub used_high_bytes: u64,
    /// Blocks handed out and not freed (direct path; 0 on the driver backend, which does not say).
    pub blocks: u64,
    /// Allocations the pool served.
    pub allocations: u64,
    /// Allocations served from memory the pool already held, without a system call (direct path; 0 on the driver
    /// backend, which does not say).
    pub hits: u64,
    /// Allocations that needed new memory from the driver (direct path; 0 on the driver backend).
    pub misses: u64,
    /// Chunks of device memory the pool holds (direct path; 0 on the driver backend).
    pub chunks: u64,
}

/// A stream-ordered memory pool: device memory that [`Queue::alloc_async`] takes and [`Queue::free_async`] gives
/// back in the queue's order, for programs that allocate per step. A block freed on a queue is reused by later
/// work on that queue at once, and by another queue once the work submitted before the free has completed; a hit
/// costs no system call and no heap allocation (direct path), and memory stays with the pool until
/// [`trim`](Self::trim) or the [release threshold](PoolOptions::release_threshold) gives it back.
///
/// Cloning shares the pool; queues of its GPU may use it from several threads. Dropping the last handle (buffers
/// hold one) waits for the queues' frees to complete, then frees its memory.
///
/// ```no_run
/// use apex::{Arg, Gpu, LaunchConfig, PoolOptions};
/// # fn main() -> apex::Result<()> {
/// let gpu = Gpu::open(0)?;
/// let count = gpu.load_module_file("kernels/apex_test_kernels.sm_90.cubin")?.kernel("count_threads")?;
/// let pool = gpu.pool(PoolOptions::default())?;
/// let mut q = gpu.queue()?;
/// for _ in 0..1000 {
///     let scratch = q.alloc_async(&pool, 4096)?;
///     // SAFETY: count_threads adds one per thread to the u32 its argument points at, which the block holds.
///     unsafe { q.launch(&count, &LaunchConfig::linear(1, 32), &[scratch.arg()])? };
///     q.free_async(scratch)?; // the next iteration's alloc_async gets the same block back at once
/// }
/// q.synchronize()?;
/// let stats = pool.stats()?;
/// assert_eq!(stats.misses, 1);
/// pool.trim(0)?; // give the memory back
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct MemoryPool {
    inner: PoolInner,
}

/// The direct path's suballocator or the driver backend's CUDA pool.
type PoolInner = Backed<Arc<DirectPool>, Arc<DriverPool>>;

/// A queue's timeline, as the pool sees it.
#[derive(Debug)]
struct QueueClock(pushbuf::Fence);

impl Clock for QueueClock {
    #[inline]
    fn reached(&self, value: u64) -> bool {
        self.0.timeline().is_reached(value)
    }
}

type Core = Suballocator<Memory, QueueClock>;

struct DirectPool {
    gpu: Arc<GpuCore>,
    options: PoolOptions,
    core: Mutex<Core>,
}

impl fmt::Debug for DirectPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The counters, not every block's metadata; never waits for the lock.
        let stats = self.core.try_lock().ok().map(|c| c.stats());
        f.debug_struct("DirectPool")
            .field("options", &self.options)
            .field("stats", &stats)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct DriverPool {
    pool: driver::MemPool,
    options: PoolOptions,
    allocations: AtomicU64,
}

impl DirectPool {
    fn lock(&self) -> MutexGuard<'_, Core> {
        // A panic while the lock was held cannot leave the allocator's lists half-linked in a way that matters more
        // than losing the pool: go on with what is there.
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` under the lock; the chunks it released are freed after the lock is let go.
    #[inline]
    fn locked<R>(&self, f: impl FnOnce(&mut Core) -> R) -> R {
        let mut core = self.lock();
        let r = f(&mut core);
        let released = core.take_released();
        drop(core);
        if !released.is_empty() {
            debug!(chunks = released.len(), "memory pool releases idle chunks");
        }
        drop(released);
        r
    }

    fn out_of_memory(&self, requested: u64, limit: Option<u64>, source: Option<Error>) -> Error {
        let (stats, mut held_by) = self.locked(|c| (c.stats(), c.held_by()));
        held_by.sort_by_key(|b| std::cmp::Reverse(b.1));
        Error::PoolOutOfMemory(Box::new(PoolOutOfMemory {
            requested,
            backend: Backend::Direct,
            reserved_bytes: stats.reserved,
            used_bytes: stats.in_use,
            blocks: stats.blocks,
            held_by,
            limit,
            source,
        }))
    }

    fn alloc(self: &Arc<Self>, q: &ComputeQueue, queue: u64, bytes: u64) -> Result<PoolBuffer> {
        let clock = || QueueClock(q.fence_for(0));
        let mut retried = false;
        loop {
            let need = self.locked(|c| {
                let slot = c.slot(queue, clock);
                c.alloc(slot, bytes)
            });
            let need = match need {
                Ok(Alloc::Hit(b)) => return Ok(PoolBuffer::direct(self.clone(), b, bytes)),
                Ok(Alloc::Need(need)) => need,
                Err(over) => return Err(self.out_of_memory(bytes, Some(over.limit), None)),
            };
            if need.bytes > self.gpu.info().memory_bytes {
                return Err(self.out_of_memory(bytes, None, None));
            }
            // The chunk is allocated outside the lock: other queues' hits go on meanwhile.
            match Memory::alloc(&self.gpu, MemoryDesc::video(need.bytes)) {
                Ok(mem) => {
                    let (base, size) = (mem.va(), mem.size());
                    debug!(bytes = size, class = need.class, "memory pool grows");
                    let b = self.locked(|c| {
                        let slot = c.slot(queue, clock);
                        c.add_chunk(slot, need, mem, base, size)
                    });
                    return Ok(PoolBuffer::direct(self.clone(), b, bytes));
                }
                Err(e) if is_rm_oom(&e) && !retried => {
                    // Give back every idle chunk whose frees are complete, then try once more.
                    let freed = self.locked(|c| c.release_over(0));
                    warn!(
                        requested = bytes,
                        released = freed,
                        "device memory ran out; the pool gave idle memory back"
                    );
                    retried = true;
                }
                Err(e) if is_rm_oom(&e) => {
                    return Err(self.out_of_memory(bytes, None, Some(e.into())));
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}

impl Drop for DirectPool {
    fn drop(&mut self) {
        // Blocks freed on queues whose work is still running: their memory goes only once that work is complete.
        let core = self.core.get_mut().unwrap_or_else(|p| p.into_inner());
        let deadline = Instant::now() + Duration::from_secs(5);
        for (clock, value) in core.pending() {
            while !clock.reached(value) {
                if Instant::now() > deadline {
                    warn!(
                        value,
                        "a memory pool is dropped while a queue's work that freed blocks into it has not completed \
                         after 5 s; its memory is freed anyway"
                    );
                    break;
                }
                std::thread::yield_now();
            }
        }
    }
}

/// Whether RM refused an allocation for want of memory.
fn is_rm_oom(e: &rm::Error) -> bool {
    match e {
        rm::Error::Rm { status, .. } => matches!(
            status.name(),
            Some("NV_ERR_NO_MEMORY" | "NV_ERR_INSUFFICIENT_RESOURCES")
        ),
        _ => false,
    }
}

/// Whether libcuda refused an allocation for want of memory (`CUDA_ERROR_OUT_OF_MEMORY`).
fn is_cuda_oom(e: &driver::Error) -> bool {
    matches!(e, driver::Error::Call { code: 2, .. })
}

impl DriverPool {
    fn stats(&self) -> Result<PoolStats> {
        use driver::PoolAttribute as A;
        Ok(PoolStats {
            reserved_bytes: self.pool.attribute(A::ReservedCurrent)?,
            used_bytes: self.pool.attribute(A::UsedCurrent)?,
            reserved_high_bytes: self.pool.attribute(A::ReservedHigh)?,
            used_high_bytes: self.pool.attribute(A::UsedHigh)?,
            allocations: self.allocations.load(Ordering::Relaxed),
            ..PoolStats::default()
        })
    }
}

impl MemoryPool {
    /// The backend whose memory the pool holds.
    pub fn backend(&self) -> Backend {
        self.inner.backend()
    }

    /// The options the pool was built with (the release threshold as last set).
    pub fn options(&self) -> PoolOptions {
        match &self.inner {
            Backed::Direct(p) => {
                let threshold = p.locked(|c| c.config().release_threshold);
                p.options.release_threshold(threshold)
            }
            Backed::Driver(p) => p.options,
        }
    }

    /// The CUDA memory pool behind this one, on the driver backend.
    pub fn driver(&self) -> Option<&driver::MemPool> {
        self.inner.driver().map(|p| &p.pool)
    }

    /// What the pool holds and how it served its requests (on the driver backend, CUDA's pool attributes).
    pub fn stats(&self) -> Result<PoolStats> {
        match &self.inner {
            Backed::Direct(p) => {
                let s = p.locked(|c| c.stats());
                Ok(PoolStats {
                    reserved_bytes: s.reserved,
                    used_bytes: s.in_use,
                    reserved_high_bytes: s.reserved_high,
                    used_high_bytes: s.in_use_high,
                    blocks: s.blocks,
                    allocations: s.hits + s.misses,
                    hits: s.hits,
                    misses: s.misses,
                    chunks: s.chunks,
                })
            }
            Backed::Driver(p) => p.stats(),
        }
    }

    /// Sets the [release threshold](PoolOptions::release_threshold); on the direct path idle memory above it is
    /// given back at once.
    pub fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        match &self.inner {
            Backed::Direct(p) => {
                p.locked(|c| c.set_release_threshold(bytes));
                Ok(())
            }
            Backed::Driver(p) => Ok(p.pool.set_release_threshold(bytes)?),
        }
    }

    /// Gives memory back to the driver until the pool holds at most `keep_bytes` (`cuMemPoolTrimTo` on the driver
    /// backend), keeping memory that blocks in use need. Does not wait: on the direct path a chunk whose blocks
    /// were freed on a queue whose work before the free is still running stays until that work completes
    /// (synchronize the queues first to give back everything). Returns the bytes the pool holds afterwards.
    pub fn trim(&self, keep_bytes: u64) -> Result<u64> {
        match &self.inner {
            Backed::Direct(p) => Ok(p.locked(|c| {
                c.release_over(keep_bytes);
                c.stats().reserved
            })),
            Backed::Driver(p) => {
                p.pool.trim_to(keep_bytes)?;
                Ok(p.pool.attribute(driver::PoolAttribute::ReservedCurrent)?)
            }
        }
    }
}

/// Device memory from a [`MemoryPool`] ([`Queue::alloc_async`]), given back in a queue's order by
/// [`Queue::free_async`].
///
/// Dropping it instead gives the block back at once, for any queue, as dropping a [`Buffer`](crate::Buffer) frees
/// it: only do so once the work that uses it is complete. Its address is aligned to at least 256 bytes.
#[derive(Debug)]
pub struct PoolBuffer {
    inner: Option<BufferHome>,
    ptr: u64,
    size: u64,
}

#[derive(Debug)]
enum BufferHome {
    Direct {
        pool: Arc<DirectPool>,
        block: BlockId,
    },
    Driver {
        pool: Arc<DriverPool>,
    },
}

impl PoolBuffer {
    fn direct(pool: Arc<DirectPool>, b: suballoc::Block, size: u64) -> PoolBuffer {
        PoolBuffer {
            inner: Some(BufferHome::Direct { pool, block: b.id }),
            ptr: b.ptr,
            size,
        }
    }

    /// The backend whose memory this is.
    pub fn backend(&self) -> Backend {
        match self.inner {
            Some(BufferHome::Driver { .. }) => Backend::Driver,
            _ => Backend::Direct,
        }
    }

    /// The device address kernels use.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The device address kernels use, typed.
    pub fn ptr(&self) -> crate::DevicePtr {
        crate::DevicePtr(self.ptr)
    }

    /// Bytes asked for (the block behind may be larger).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The kernel argument for this buffer's address.
    pub fn arg(&self) -> Arg<'static> {
        Arg::Ptr(self.ptr)
    }
}

impl Drop for PoolBuffer {
    fn drop(&mut self) {
        match self.inner.take() {
            Some(BufferHome::Direct { pool, block }) => pool.locked(|c| c.free(block, NO_SLOT, 0)),
            Some(BufferHome::Driver { pool }) => {
                // SAFETY: our own allocation from this pool, freed once; the caller dropped it after its work.
                if let Err(e) =
                    unsafe { driver::free_async_unordered(pool.pool.context(), self.ptr) }
                {
                    warn!(error = %e, "freeing a dropped pool buffer failed");
                }
            }
            None => {}
        }
    }
}

impl Gpu {
    /// A stream-ordered memory pool of this GPU's device memory, built as `options` say; see [`MemoryPool`].
    pub fn pool(&self, options: PoolOptions) -> Result<MemoryPool> {
        options.check()?;
        let inner = match &self.inner {
            Backed::Direct(c) => Backed::Direct(Arc::new(DirectPool {
                gpu: c.clone(),
                options,
                core: Mutex::new(Suballocator::new(Config {
                    chunk_bytes: options.chunk_bytes,
                    large_threshold: options.large_threshold,
                    release_threshold: options.release_threshold,
                    reserve_limit: options.reserve_limit,
                })),
            })),
            Backed::Driver(ctx) => {
                let pool = driver::MemPool::new(ctx, options.reserve_limit)?;
                pool.set_release_threshold(options.release_threshold)?;
                Backed::Driver(Arc::new(DriverPool {
                    pool,
                    options,
                    allocations: AtomicU64::new(0),
                }))
            }
        };
        Ok(MemoryPool { inner })
    }
}

impl Queue {
    /// `bytes` of device memory from `pool`, in this queue's order: work submitted to this queue from now on may
    /// use it at once; another queue's work once ordered after this queue's (a fence it waited for). On the direct
    /// path a hit (memory the pool holds, freed on this queue or freed on another whose work before the free has
    /// completed) makes no system call and no heap allocation; on the driver backend this is
    /// `cuMemAllocFromPoolAsync`.
    ///
    /// Fails with [`Error::PoolOutOfMemory`] when the device or the pool's reserve limit has no room left, after
    /// giving idle memory back; with [`Error::Mismatch`] for a pool of another GPU or backend; with
    /// [`Error::InvalidArgument`] for 0 bytes.
    pub fn alloc_async(&mut self, pool: &MemoryPool, bytes: u64) -> Result<PoolBuffer> {
        if bytes == 0 {
            return Err(Error::InvalidArgument(
                "a pool allocation of 0 bytes".into(),
            ));
        }
        match self.inner.as_mut().with(pool.inner.as_ref())? {
            Backed::Direct((q, p)) => {
                if !Arc::ptr_eq(q.gpu(), &p.gpu) {
                    return Err(Error::Mismatch);
                }
                p.alloc(q, self.id, bytes)
            }
            Backed::Driver((q, p)) => {
                if !p.pool.serves(q.stream()) {
                    return Err(Error::Mismatch);
                }
                let ptr = match p.pool.alloc_async(q.stream(), bytes) {
                    Ok(ptr) => ptr,
                    Err(e) if is_cuda_oom(&e) => {
                        let stats = p.stats().unwrap_or_default();
                        return Err(Error::PoolOutOfMemory(Box::new(PoolOutOfMemory {
                            requested: bytes,
                            backend: Backend::Driver,
                            reserved_bytes: stats.reserved_bytes,
                            used_bytes: stats.used_bytes,
                            blocks: 0,
                            held_by: Vec::new(),
                            limit: p.options.reserve_limit,
                            source: Some(e.into()),
                        })));
                    }
                    Err(e) => return Err(e.into()),
                };
                p.allocations.fetch_add(1, Ordering::Relaxed);
                Ok(PoolBuffer {
                    inner: Some(BufferHome::Driver { pool: p.clone() }),
                    ptr,
                    size: bytes,
                })
            }
        }
    }

    /// Gives `buffer` back to its pool in this queue's order: this queue's later work may get its memory at once
    /// (it runs after the work submitted before the free), other queues once that work has completed. Work on other
    /// queues that uses the buffer must be ordered before this queue's later work (as for `cuMemFreeAsync`). On the
    /// direct path this makes no system call and no heap allocation (an open chain of launches is sent first); on
    /// the driver backend it is `cuMemFreeAsync`.
    ///
    /// A buffer of a pool of another GPU or backend is [`Error::Mismatch`], and the buffer is then dropped (see
    /// [`PoolBuffer`]).
    pub fn free_async(&mut self, mut buffer: PoolBuffer) -> Result<()> {
        match (&mut self.inner, buffer.inner.take()) {
            (Backed::Direct(q), Some(BufferHome::Direct { pool, block }))
                if Arc::ptr_eq(q.gpu(), &pool.gpu) =>
            {
                let value = match q.completion_value() {
                    Ok(v) => v,
                    Err(e) => {
                        buffer.inner = Some(BufferHome::Direct { pool, block });
                        return Err(e.into());
                    }
                };
                let queue = self.id;
                let q = &**q;
                pool.locked(|c| {
                    let slot = c.slot(queue, || QueueClock(q.fence_for(0)));
                    c.free(block, slot, value)
                });
                Ok(())
            }
            (Backed::Driver(q), Some(BufferHome::Driver { pool }))
                if pool.pool.serves(q.stream()) =>
            {
                // SAFETY: an allocation of this pool not freed yet (the buffer is consumed here); the caller orders
                // other streams' use of it before this stream's later work.
                unsafe { q.stream().free_async(buffer.ptr) }?;
                Ok(())
            }
            (_, home) => {
                buffer.inner = home;
                Err(Error::Mismatch)
            }
        }
    }
}

impl fmt::Display for PoolStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bytes reserved in {} chunks, {} in use in {} blocks; {} allocations, {} hits, {} misses",
            self.reserved_bytes,
            self.chunks,
            self.used_bytes,
            self.blocks,
            self.allocations,
            self.hits,
            self.misses
        )
    }
}
