//! Copies and memsets the program asks for on a taken-over stream, run on its APEX queue in stream order.

use super::*;
use apex::DevicePtr;

/// Which way a program's copy goes, as its entry point says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CopyDir {
    /// `cuMemcpyDtoH*`.
    DeviceToHost,
    /// `cuMemcpyHtoD*`.
    HostToDevice,
    /// `cuMemcpyDtoD*`.
    DeviceToDevice,
    /// `cuMemcpy` / `cuMemcpyAsync`: told by the pointers.
    Any,
}

/// A copy the program asked for (`cuMemcpy*`), which the engine may run on the stream's queue.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CopyOp {
    pub dst: u64,
    pub src: u64,
    pub bytes: usize,
    pub site: Site,
    pub dir: CopyDir,
    /// The synchronous entry point (`cuMemcpyDtoH`, not `...Async`): it returns once the copy is done, except from
    /// pageable host memory to the device, which returns once the data is staged (as CUDA does).
    pub blocking: bool,
}

/// A memset the program asked for (`cuMemsetD8/16/32*`), which the engine may run on the stream's queue.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SetOp {
    pub dst: u64,
    pub value: u32,
    /// Bytes per element: 1, 2 or 4.
    pub width: u32,
    pub count: usize,
    pub site: Site,
}

/// How the engine runs a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum CopyPlan {
    /// Between two GPU addresses (device memory, pinned host memory's device pointer).
    Direct { src: u64, dst: u64 },
    /// Device memory to pageable host memory, through the staging ring (waited for, then read by the CPU).
    StageOut { src: u64 },
    /// Pageable host memory to device memory, through the staging ring (written by the CPU first).
    StageIn { dst: u64 },
}

impl CopyPlan {
    pub(super) fn new(dir: CopyDir, src: Pointer, dst: Pointer, op: &CopyOp) -> Option<CopyPlan> {
        let n = op.bytes as u64;
        let host = matches!(src, Pointer::Pinned { .. } | Pointer::Pageable)
            || matches!(dst, Pointer::Pinned { .. } | Pointer::Pageable);
        if host && op.bytes > COPY_MAX {
            return None;
        }
        let fits = |p: Pointer| match p {
            Pointer::Device { bytes } | Pointer::Pinned { bytes, .. } => bytes >= n,
            Pointer::Pageable => true,
            Pointer::Other => false,
        };
        if !fits(src) || !fits(dst) {
            return None;
        }
        let to_host = matches!(dir, CopyDir::DeviceToHost | CopyDir::Any);
        let to_device = matches!(dir, CopyDir::HostToDevice | CopyDir::Any);
        let between = matches!(dir, CopyDir::DeviceToDevice | CopyDir::Any);
        match (src, dst) {
            // Between device buffers at any size: the SMs copy at the HBM's bandwidth.
            (Pointer::Device { .. }, Pointer::Device { .. }) if between => Some(CopyPlan::Direct {
                src: op.src,
                dst: op.dst,
            }),
            (Pointer::Device { .. }, Pointer::Pinned { device, .. }) if to_host => {
                Some(CopyPlan::Direct {
                    src: op.src,
                    dst: device,
                })
            }
            (Pointer::Device { .. }, Pointer::Pageable) if to_host => {
                Some(CopyPlan::StageOut { src: op.src })
            }
            (Pointer::Pinned { device, .. }, Pointer::Device { .. }) if to_device => {
                Some(CopyPlan::Direct {
                    src: device,
                    dst: op.dst,
                })
            }
            (Pointer::Pageable, Pointer::Device { .. }) if to_device => {
                Some(CopyPlan::StageIn { dst: op.dst })
            }
            _ => None,
        }
    }
}

/// A context's pinned staging memory for copies from and to pageable host memory: a ring used in laps; each lap
/// starts once every copy of the last one is complete.
pub(super) struct Staging {
    pub(super) buffer: apex::HostBuffer,
    pub(super) head: u64,
    /// Copies in flight that read or write the ring.
    pub(super) inflight: Vec<Fence>,
}

impl Staging {
    /// `bytes` of the ring for the next copy (at most [`STAGING_BYTES`]).
    pub(super) fn take(&mut self, bytes: u64) -> Result<u64, String> {
        let bytes = bytes.next_multiple_of(64);
        if self.head + bytes > self.buffer.size() {
            // Every copy of the lap is waited for, also after one fails (they may still read the ring).
            let mut failed = None;
            for f in self.inflight.drain(..) {
                if let Err(e) = wait_fence(&f) {
                    failed.get_or_insert(e);
                }
            }
            if let Some(e) = failed {
                return Err(e);
            }
            self.head = 0;
        }
        let at = self.head;
        self.head += bytes;
        self.inflight.retain(|f| !f.is_done());
        Ok(at)
    }
}

/// Submits copy `op` on `queue` as `plan` says (through the staging ring for pageable memory),
/// waiting (through `wait`, for the queue's newest work) where CUDA's copy would return only once done; returns
/// what later work waits for.
pub(super) fn run_copy(
    queue: &mut Queue,
    staging: &mut Option<Staging>,
    plan: CopyPlan,
    op: &CopyOp,
    wait: &mut dyn FnMut(&mut Queue, &Fence) -> Result<(), String>,
) -> Result<Last, String> {
    let n = op.bytes as u64;
    if let CopyPlan::Direct { src, dst } = plan {
        let copy = apex::Launch::copy(DevicePtr(src), DevicePtr(dst), n);
        // SAFETY: libcuda says both are memory of this context the GPU reaches, for `n` bytes; the program keeps
        // them until the copy is done, as it must for CUDA's.
        let ticket = unsafe { submit_then_ring(queue, &copy)? };
        // A synchronous entry point returns once the copy is done (from pinned memory too).
        if op.blocking {
            let fence = queue.fence(ticket).map_err(|e| e.to_string())?;
            wait(queue, &fence)?;
        }
        return Ok(Last::Ticket(ticket));
    }
    let staging = staging.as_mut().ok_or("no staging memory")?;
    let at = staging.take(n)?;
    let base = staging.buffer.device_ptr();
    match plan {
        CopyPlan::StageOut { src } => {
            // SAFETY: as above for `src`; the staging ring is ours.
            let f =
                unsafe { queue.copy_addresses(src, base + at, n) }.map_err(|e| e.to_string())?;
            // To pageable memory CUDA returns once the data is there: so does this.
            wait(queue, &f)?;
            // SAFETY: the program passed `dst` as host memory of `n` writable bytes.
            let out = unsafe { std::slice::from_raw_parts_mut(op.dst as *mut u8, op.bytes) };
            staging.buffer.read(at, out).map_err(|e| e.to_string())?;
            Ok(Last::Fence(f))
        }
        CopyPlan::StageIn { dst } => {
            // SAFETY: the program passed `src` as host memory of `n` readable bytes.
            let data = unsafe { std::slice::from_raw_parts(op.src as *const u8, op.bytes) };
            staging.buffer.write(at, data).map_err(|e| e.to_string())?;
            // SAFETY: as above for `dst`; the staging ring's bytes stay until the copy is done.
            let f =
                unsafe { queue.copy_addresses(base + at, dst, n) }.map_err(|e| e.to_string())?;
            // From pageable memory CUDA returns once the data is staged, also for the synchronous entry point.
            staging.inflight.push(f.clone());
            Ok(Last::Fence(f))
        }
        CopyPlan::Direct { .. } => Err("a direct copy is not staged".into()),
    }
}

/// Submits a fill or copy between GPU addresses deferred and rings the doorbell once its ticket is back: the
/// doorbell's store fences and uncached store then wait for nothing the call made after them (as for a launch, see
/// `Ctx::launch`), and the ticket holds no reference count to take now or drop later.
///
/// # Safety
/// The addresses `work` names must be memory of this queue's context the GPU reaches, for its size, until it is
/// done (what libcuda's own memset or copy asks of the program).
unsafe fn submit_then_ring(
    queue: &mut Queue,
    work: &apex::Launch<'_>,
) -> Result<apex::Ticket, String> {
    // SAFETY: forwarded to the caller.
    let ticket = unsafe { queue.submit(&work.deferred()) }.map_err(|e| e.to_string())?;
    // Recorded: the work is APEX's from here (handed to libcuda as well, it could run twice), so a doorbell that
    // fails is logged, as for a launch; only an open chain can fail to send, and a queue of the preload has none.
    if let Err(e) = queue.flush() {
        warn!(error = %e, "ringing a queue's doorbell failed");
    }
    Ok(ticket)
}

impl Engine {
    // ---- copies ----

    /// The context and slot of a stream the preload took over, if work at `site` can run on its queue now (the
    /// takeover on, no capture, the context not failed).
    pub(super) fn taken_over(&mut self, site: Site) -> Option<(usize, usize)> {
        if self.off.is_some() || !self.capturing.is_empty() || crate::cupti::recording() {
            return None;
        }
        let Site::Stream(raw, pt) = site else {
            return None;
        };
        let ci = self.site_context(site)?;
        let ctx = &self.contexts[ci];
        if ctx.failed.is_some() {
            return None;
        }
        Some((ci, ctx.order.find(StreamKey::of(raw, pt))?))
    }

    /// Runs a program's copy between the host and the device on the stream's APEX queue, in its order, when the
    /// stream is taken over and the pointers are memory the queue reaches (`Some(CUresult)`); `None` leaves it to
    /// libcuda (ordered with the queues like any CUDA work).
    pub(crate) fn copy(&mut self, op: &CopyOp) -> Option<c_int> {
        if op.bytes == 0 {
            return None;
        }
        let (ci, slot) = self.taken_over(op.site)?;
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        let plan = CopyPlan::new(
            op.dir,
            cuda.pointer(op.src, ctx.handle),
            cuda.pointer(op.dst, ctx.handle),
            op,
        )?;
        let waits = matches!(plan, CopyPlan::StageOut { .. }) || op.blocking;
        if !matches!(plan, CopyPlan::Direct { .. }) && ctx.staging.is_none() {
            match ctx.gpu.alloc_host(STAGING_BYTES) {
                Ok(buffer) => {
                    ctx.staging = Some(Staging {
                        buffer,
                        head: 0,
                        inflight: Vec::new(),
                    })
                }
                Err(e) => {
                    debug!(error = %e, "no staging memory: copies from and to pageable memory go to libcuda");
                    return None;
                }
            }
        }
        // A copy that returns once done sleeps while it waits where the program asked CUDA to sleep (as a
        // synchronize does: `wait_or_sleep`), on an event of the preload's own recorded on its own stream after the
        // copy, which is the queue's newest work. Asked only once the copy has run past the spin; the engine's lock
        // stays held, as while a copy spins.
        let handle = ctx.handle;
        let mut pool = std::mem::take(&mut ctx.sleepers);
        let mut slept = false;
        let mut wait = |queue: &mut Queue, fence: &Fence| -> Result<(), String> {
            let Some(d) = fence.direct() else {
                return wait_fence(fence);
            };
            match d.wait(SPIN_BEFORE_SLEEP) {
                Ok(()) => return Ok(()),
                Err(apex::pushbuf::Error::Channel(apex::gpfifo::Error::Timeout { .. })) => {}
                Err(e) => return Err(e.to_string()),
            }
            if cuda.sleeps_while_waiting(handle)
                && let Some(mut sleeper) = Sleeper::take(&mut pool, cuda, handle)
            {
                match cuda.record_event_after(handle, queue, sleeper.event, &mut sleeper.stream) {
                    Ok(()) => {
                        slept = true;
                        if let Err(e) = cuda.sleep_on_event(sleeper.event) {
                            debug!(error = %e, "a sleeping wait returned early; the copy is waited for");
                        }
                    }
                    Err(e) => {
                        debug!(error = %e, "cannot sleep while a copy runs; it is waited for");
                        // Its stream may wait for the copy already: the next sleep uses a new one.
                        sleeper.stream = 0;
                    }
                }
                pool.push(sleeper);
            }
            wait_fence(fence)
        };
        let ran = ctx.run_on_queue(cuda, slot, |queue, staging| {
            run_copy(queue, staging, plan, op, &mut wait)
        });
        ctx.sleepers = pool;
        if slept {
            self.summary.syncs_asleep += 1;
        }
        match ran {
            Ok(()) => {
                self.summary.copies_on_apex += 1;
                // A copy that returned once done reports a failed assert of an earlier kernel, as libcuda's would.
                if waits && let Some(code) = self.assert_answer(ci) {
                    return Some(code);
                }
                Some(CUDA_SUCCESS)
            }
            Err(e) => {
                debug!(error = %e, "a copy goes to libcuda");
                None
            }
        }
    }

    /// Runs a program's memset of device memory on the stream's APEX queue, in its order, when the stream is taken
    /// over (`Some(CUresult)`); `None` leaves it to libcuda.
    pub(crate) fn fill(&mut self, op: &SetOp) -> Option<c_int> {
        if op.count == 0 || !op.dst.is_multiple_of(u64::from(op.width)) {
            return None;
        }
        let (ci, slot) = self.taken_over(op.site)?;
        let cuda = self.cuda.as_ref();
        let ctx = &mut self.contexts[ci];
        let bytes = (op.count as u64).checked_mul(u64::from(op.width))?;
        match cuda.pointer(op.dst, ctx.handle) {
            Pointer::Device { bytes: room } if room >= bytes => {}
            _ => return None,
        }
        let fill = apex::Launch::fill(DevicePtr(op.dst), op.value, op.width, op.count as u64);
        match ctx.run_on_queue(cuda, slot, |queue, _| {
            // SAFETY: libcuda says `dst` is device memory of this context for `bytes` bytes, aligned to the width.
            unsafe { submit_then_ring(queue, &fill) }.map(Last::Ticket)
        }) {
            Ok(()) => {
                self.summary.sets_on_apex += 1;
                Some(CUDA_SUCCESS)
            }
            Err(e) => {
                debug!(error = %e, "a memset goes to libcuda");
                None
            }
        }
    }
}
