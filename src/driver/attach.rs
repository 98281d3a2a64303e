//! Attaching to a CUDA context of this process ([`CudaContext`]) and the device words ([`SyncWords`]) that order
//! its streams with APEX queues without the CPU.

use std::sync::Arc;

use super::context::device_uuid;
use super::{Error, Result, check, cu, device_count, is_available};

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
