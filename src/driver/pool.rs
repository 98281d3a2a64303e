//! Stream-ordered allocation through CUDA's memory pools: `cuMemPoolCreate`, `cuMemAllocFromPoolAsync`,
//! `cuMemFreeAsync`, the pool's attributes and `cuMemPoolTrimTo`; and `cuMemAllocAsync` on the device's default
//! pool.

use std::ffi::c_void;
use std::sync::Arc;

use super::{Context, Error, Result, Stream, check, cu};

/// A CUDA memory pool of device memory (`cuMemPoolCreate`), destroyed on drop (CUDA releases its memory once
/// every allocation from it is freed).
#[derive(Debug)]
pub struct MemPool {
    ctx: Arc<Context>,
    pool: cu::CUmemoryPool,
    /// Whether the pool is the device's default one (not destroyed on drop).
    default: bool,
}

// SAFETY: a memory pool handle may be used from any thread; the driver API is thread-safe.
unsafe impl Send for MemPool {}
// SAFETY: as above.
unsafe impl Sync for MemPool {}

/// Which of a pool's counters [`MemPool::attribute`] reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolAttribute {
    /// `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`: bytes the pool keeps before it releases memory at a synchronization.
    ReleaseThreshold,
    /// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`: bytes of device memory the pool holds.
    ReservedCurrent,
    /// `CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH`: the most it held since the counter was last reset.
    ReservedHigh,
    /// `CU_MEMPOOL_ATTR_USED_MEM_CURRENT`: bytes allocated from the pool and not freed.
    UsedCurrent,
    /// `CU_MEMPOOL_ATTR_USED_MEM_HIGH`: the most in use since the counter was last reset.
    UsedHigh,
}

impl PoolAttribute {
    fn raw(self) -> cu::CUmemPool_attribute {
        use cu::CUmemPool_attribute as A;
        match self {
            PoolAttribute::ReleaseThreshold => A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            PoolAttribute::ReservedCurrent => A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
            PoolAttribute::ReservedHigh => A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            PoolAttribute::UsedCurrent => A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
            PoolAttribute::UsedHigh => A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        }
    }
}

impl MemPool {
    /// A new pool of `ctx`'s device memory (`cuMemPoolCreate`), holding at most `max_bytes` when given (the
    /// pool's `maxSize`; CUDA rounds it to its own granularity). Memory freed on a stream is reused by another
    /// stream only once the free has completed (`CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES` off): an
    /// allocation never makes its stream wait for another.
    pub fn new(ctx: &Arc<Context>, max_bytes: Option<u64>) -> Result<MemPool> {
        ctx.bind()?;
        // SAFETY: an all-zero CUmemPoolProps is valid (no handle types, no security attributes, maxSize 0 = the
        // default); the fields that matter are set below.
        let mut props: cu::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        props.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = ctx.device;
        if let Some(max) = max_bytes {
            props.maxSize = usize::try_from(max).unwrap_or(usize::MAX);
        }
        let mut pool = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; `props` lives across the call.
        check("cuMemPoolCreate", unsafe {
            cu::cuMemPoolCreate(&mut pool, &props)
        })?;
        let pool = MemPool {
            ctx: ctx.clone(),
            pool,
            default: false,
        };
        // Memory freed on one stream goes to another only once the free has completed, as on APEX's direct path:
        // CUDA would otherwise make the allocating stream wait for the freeing one (an internal dependency).
        let mut no = 0i32;
        // SAFETY: the attribute takes a pointer to an int, which `no` is, live across the call.
        check("cuMemPoolSetAttribute", unsafe {
            cu::cuMemPoolSetAttribute(
                pool.pool,
                cu::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
                (&mut no as *mut i32).cast::<c_void>(),
            )
        })?;
        Ok(pool)
    }

    /// The device's default pool (`cuDeviceGetDefaultMemPool`), the one `cuMemAllocAsync` allocates from.
    pub fn device_default(ctx: &Arc<Context>) -> Result<MemPool> {
        ctx.bind()?;
        let mut pool = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the device is the retained context's.
        check("cuDeviceGetDefaultMemPool", unsafe {
            cu::cuDeviceGetDefaultMemPool(&mut pool, ctx.device)
        })?;
        Ok(MemPool {
            ctx: ctx.clone(),
            pool,
            default: true,
        })
    }

    /// The context the pool's memory belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// libcuda's handle, for calls APEX does not wrap.
    pub fn raw(&self) -> cu::CUmemoryPool {
        self.pool
    }

    /// `bytes` of device memory from the pool, in `stream`'s order (`cuMemAllocFromPoolAsync`): usable by work
    /// on `stream` submitted from now on, and by other streams once ordered after it.
    pub fn alloc_async(&self, stream: &Stream, bytes: u64) -> Result<u64> {
        if bytes == 0 {
            return Err(Error::InvalidArgument("an allocation of 0 bytes".into()));
        }
        if !self.serves(stream) {
            return Err(Error::InvalidArgument(
                "a stream of another context than the memory pool's".into(),
            ));
        }
        self.ctx.bind()?;
        let mut ptr = 0;
        // SAFETY: out-pointer to a local; the pool and the stream are live and of the same context.
        check("cuMemAllocFromPoolAsync", unsafe {
            cu::cuMemAllocFromPoolAsync(&mut ptr, bytes as usize, self.pool, stream.raw())
        })?;
        Ok(ptr)
    }

    /// Sets the bytes the pool keeps before releasing memory at synchronizations
    /// (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`).
    pub fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        let mut v = bytes;
        self.ctx.bind()?;
        // SAFETY: the attribute takes a pointer to a cuuint64_t, which `v` is, live across the call.
        check("cuMemPoolSetAttribute", unsafe {
            cu::cuMemPoolSetAttribute(
                self.pool,
                PoolAttribute::ReleaseThreshold.raw(),
                (&mut v as *mut u64).cast::<c_void>(),
            )
        })
    }

    /// One of the pool's 64-bit counters (`cuMemPoolGetAttribute`).
    pub fn attribute(&self, attribute: PoolAttribute) -> Result<u64> {
        let mut v = 0u64;
        self.ctx.bind()?;
        // SAFETY: every attribute PoolAttribute names is a cuuint64_t, written through a pointer to `v`.
        check("cuMemPoolGetAttribute", unsafe {
            cu::cuMemPoolGetAttribute(
                self.pool,
                attribute.raw(),
                (&mut v as *mut u64).cast::<c_void>(),
            )
        })?;
        Ok(v)
    }

    /// Releases memory the pool holds beyond `keep_bytes` that no allocation uses (`cuMemPoolTrimTo`).
    pub fn trim_to(&self, keep_bytes: u64) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: a live pool; a plain value argument.
        check("cuMemPoolTrimTo", unsafe {
            cu::cuMemPoolTrimTo(self.pool, usize::try_from(keep_bytes).unwrap_or(usize::MAX))
        })
    }

    /// Whether `stream` belongs to the pool's context (the pool serves its allocations).
    pub fn serves(&self, stream: &Stream) -> bool {
        Arc::ptr_eq(stream.context(), &self.ctx) || stream.context().ctx == self.ctx.ctx
    }
}

impl Drop for MemPool {
    fn drop(&mut self) {
        if self.default {
            return;
        }
        let _ = self.ctx.bind();
        // SAFETY: destroys our own pool once; CUDA defers the release of memory still allocated from it.
        unsafe { cu::cuMemPoolDestroy(self.pool) };
    }
}

impl Stream {
    /// `bytes` of device memory from the device's current pool in this stream's order (`cuMemAllocAsync`).
    pub fn alloc_async(&self, bytes: u64) -> Result<u64> {
        if bytes == 0 {
            return Err(Error::InvalidArgument("an allocation of 0 bytes".into()));
        }
        self.ctx.bind()?;
        let mut ptr = 0;
        // SAFETY: out-pointer to a local; a live stream.
        check("cuMemAllocAsync", unsafe {
            cu::cuMemAllocAsync(&mut ptr, bytes as usize, self.stream)
        })?;
        Ok(ptr)
    }

    /// Frees `ptr` in this stream's order (`cuMemFreeAsync`): its memory is reused by the pool once the work
    /// submitted to the stream so far is complete (at once by later work on the stream).
    ///
    /// # Safety
    /// `ptr` came from a stream-ordered allocation ([`MemPool::alloc_async`], [`Stream::alloc_async`]) not freed
    /// yet, and work on other streams that uses it is ordered before this stream's later work.
    pub unsafe fn free_async(&self, ptr: u64) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: forwarded to the caller.
        check("cuMemFreeAsync", unsafe {
            cu::cuMemFreeAsync(ptr, self.stream)
        })
    }
}

/// Frees `ptr`, a stream-ordered allocation of `ctx`, on the legacy default stream (`cuMemFreeAsync` on stream 0),
/// for an allocation whose work is known complete and whose stream may be gone.
///
/// # Safety
/// `ptr` came from a stream-ordered allocation in `ctx` not freed yet, and no work that uses it is still running.
pub unsafe fn free_async_unordered(ctx: &Context, ptr: u64) -> Result<()> {
    ctx.bind()?;
    // SAFETY: forwarded to the caller; stream 0 is the context's legacy default stream.
    check("cuMemFreeAsync", unsafe {
        cu::cuMemFreeAsync(ptr, std::ptr::null_mut())
    })
}
