//! Devices and their primary contexts: how many CUDA lists, their UUIDs, and the [`Context`] this backend
//! binds on every thread that uses it.

use std::ffi::CStr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{Error, Result, check, cu};

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

pub(super) fn device_uuid(device: cu::CUdevice) -> Result<[u8; 16]> {
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
    pub(super) ctx: cu::CUcontext,
    pub(super) device: cu::CUdevice,
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
