//! APEX inside a CUDA context: [`Gpu::attach_cuda`] builds the direct path's queues in the context's own channel
//! group and address space (docs/attach-cuda.md), so CUDA's device pointers are valid in APEX's kernels and work
//! alternates between CUDA streams and APEX queues without a channel-group switch; the queues order themselves
//! with CUDA streams on the GPU.

use std::sync::Arc;

use cudarc::driver::sys::{CUcontext, CUstream};
use tracing::{info, warn};

use super::backend::Backed;
use super::{Backend, BackendRequest, Error, FallbackReason, Gpu, Queue, Result, Selection};
use crate::driver;
use crate::rm::GpuCore;

impl Gpu {
    /// Attaches APEX to the CUDA context current on this thread (from the CUDA runtime, the driver API, PyTorch or
    /// cudarc): queues of the returned GPU are channels of APEX's own inside that context's channel group and
    /// address space, so kernels launched through them take `CUdeviceptr`s (`cuMemAlloc`, PyTorch tensors,
    /// cuBLAS workspaces) as [`Arg::Ptr`](crate::Arg::Ptr), and [`Queue::wait_for_cuda_stream`] /
    /// [`Queue::make_cuda_stream_wait`] order them with CUDA streams on the GPU.
    ///
    /// Where the direct path cannot join the context (another driver branch, an unsupported GPU, RM or UVM
    /// refusing), and the context is the device's primary context, the returned GPU runs on the CUDA driver
    /// backend in that same context instead, with the reason in [`Gpu::selection`]; otherwise the error says why.
    ///
    /// The context must outlive the returned GPU and everything made from it; a primary context is kept alive
    /// by a retain. APEX's own buffers ([`Gpu::alloc`]) live in the shared address space too.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// // A CUDA context is current here (cudarc, the runtime, PyTorch...).
    /// let gpu = apex::Gpu::attach_cuda()?;
    /// println!("{}", gpu.selection());
    /// # Ok(()) }
    /// ```
    pub fn attach_cuda() -> Result<Gpu> {
        Gpu::attach_to(driver::CudaContext::current()?)
    }

    /// Attaches APEX to the primary context of CUDA device `ordinal` (CUDA's numbering, after
    /// `CUDA_VISIBLE_DEVICES`): the context the CUDA runtime and PyTorch use for `cuda:<ordinal>`, retained (made,
    /// if the process has not made it yet) for as long as the returned GPU lives. Works on any GPU of a process
    /// that holds contexts on several; as [`Gpu::attach_cuda`] otherwise, whatever context is current.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// // A process that works on two GPUs: one attached GPU per CUDA device.
    /// let first = apex::Gpu::attach_cuda_device(0)?;
    /// let second = apex::Gpu::attach_cuda_device(1)?;
    /// assert_ne!(first.uuid()?, second.uuid()?);
    /// # Ok(()) }
    /// ```
    pub fn attach_cuda_device(ordinal: usize) -> Result<Gpu> {
        Gpu::attach_to(driver::CudaContext::primary(ordinal)?)
    }

    /// Attaches APEX to the CUDA context `ctx`, current on this thread or not: as [`Gpu::attach_cuda`] for that
    /// context (a context made with `cuCtxCreate`, or one a library hands out).
    ///
    /// # Safety
    /// `ctx` must be a live CUDA context of this process that outlives the returned GPU and everything made from
    /// it (a primary context is kept alive by a retain).
    pub unsafe fn attach_cuda_context(ctx: CUcontext) -> Result<Gpu> {
        // SAFETY: the caller's promise.
        Gpu::attach_to(unsafe { driver::CudaContext::from_raw(ctx) }?)
    }

    fn attach_to(ctx: Arc<driver::CudaContext>) -> Result<Gpu> {
        type Proved = (Arc<GpuCore>, crate::launch::ComputeQueue);
        let direct = (|| -> std::result::Result<Proved, crate::launch::Error> {
            let started = std::time::Instant::now();
            let core = GpuCore::attach_cuda(ctx.uuid())?;
            tracing::debug!(
                attach_us = started.elapsed().as_micros(),
                "found and joined CUDA's channel group"
            );
            // A queue proves the attached channel runs (as `Gpu::open` proves the direct path); the GPU keeps it
            // for its first queue.
            let proof = crate::launch::ComputeQueue::new(
                &core,
                crate::launch::ComputeQueueConfig::default(),
            )?;
            Ok((core, proof))
        })();
        let mut proof = None;
        let (inner, selection) = match direct {
            Ok((core, queue)) => (
                {
                    proof = Some(queue);
                    Backed::Direct(core)
                },
                Selection {
                    backend: Backend::Direct,
                    requested: BackendRequest::Auto,
                    fallback: None,
                },
            ),
            Err(e) => {
                let reason = FallbackReason::from_direct_error(&e);
                warn!(reason = %reason, "cannot attach the direct path to the CUDA context");
                let Some(ordinal) = ctx.primary_ordinal() else {
                    return Err(Error::DirectUnavailable(reason));
                };
                (
                    Backed::Driver(driver::Context::new(ordinal)?),
                    Selection {
                        backend: Backend::Driver,
                        requested: BackendRequest::Auto,
                        fallback: Some(reason),
                    },
                )
            }
        };
        info!(backend = ?selection.backend, reason = %selection, "APEX attached to the CUDA context");
        Gpu::assemble(inner, selection, Some(ctx), proof)
    }

    /// Whether this GPU was attached to a CUDA context ([`Gpu::attach_cuda`]).
    pub fn is_attached(&self) -> bool {
        self.cuda.is_some()
    }

    /// For a GPU attached on the direct path: how many CUDA contexts of this process had work on the device when
    /// APEX attached. Above 1, APEX joined the oldest context's channel group, which need not be the one attached
    /// to (RM does not say which group is whose): the memory of every context is reachable, but APEX's work shares
    /// that group's time slices and fault fate. `None` for a GPU not attached, or attached through the driver
    /// backend.
    pub fn cuda_contexts_at_attach(&self) -> Option<usize> {
        match &self.inner {
            Backed::Direct(c) if self.cuda.is_some() => c.attachment().map(|a| a.cuda_contexts),
            _ => None,
        }
    }
}

impl Queue {
    fn cuda_order(&mut self) -> Result<&mut driver::CudaOrder> {
        self.cuda.as_mut().ok_or_else(|| {
            Error::InvalidArgument(
                "this queue's GPU is not attached to a CUDA context (use Gpu::attach_cuda)".into(),
            )
        })
    }

    /// Makes this queue's later launches and copies wait, on the GPU, for everything submitted to the CUDA
    /// `stream` so far; the CPU does not wait. `stream` must belong to the attached context (null: its legacy
    /// default stream).
    ///
    /// # Safety
    /// `stream` must be a valid CUDA stream of the attached context, or null.
    pub unsafe fn wait_for_cuda_stream(&mut self, stream: CUstream) -> Result<()> {
        if let Backed::Driver(q) = &mut self.inner {
            // SAFETY: the caller's promise for `stream`.
            return Ok(unsafe { q.wait_for_cuda_stream(stream) }?);
        }
        // SAFETY: the caller's promise for `stream`.
        let (va, value) = unsafe { self.cuda_order()?.signal_queue(stream) }?;
        if let Backed::Direct(q) = &mut self.inner {
            q.wait_value(va, value)?;
        }
        Ok(())
    }

    /// Makes the CUDA `stream` wait, on the GPU, for everything submitted to this queue so far (its memory
    /// writes visible) before the stream's later work; the CPU does not wait.
    ///
    /// # Safety
    /// `stream` must be a valid CUDA stream of the attached context, or null.
    pub unsafe fn make_cuda_stream_wait(&mut self, stream: CUstream) -> Result<()> {
        if let Backed::Driver(q) = &mut self.inner {
            // SAFETY: the caller's promise for `stream`.
            return Ok(unsafe { q.make_cuda_stream_wait(stream) }?);
        }
        let (va, value) = self.cuda_order()?.next_for_cuda()?;
        if let Backed::Direct(q) = &mut self.inner {
            q.release_value(va, value)?;
        }
        // SAFETY: the caller's promise for `stream`.
        unsafe { self.cuda_order()?.cuda_waits(stream, value) }?;
        Ok(())
    }

    /// Releases, on the GPU once everything submitted to this queue so far is done, a mark that CUDA streams can
    /// wait for later ([`make_cuda_stream_wait_for`](Self::make_cuda_stream_wait_for)); no CUDA call is made and
    /// the CPU does not wait. [`make_cuda_stream_wait`](Self::make_cuda_stream_wait) in two halves: the queue's
    /// half now, the stream's only if and when a stream must wait, however much the queue ran meanwhile. Queues of
    /// the direct path only (a driver-backed queue is a CUDA stream: use `make_cuda_stream_wait`).
    pub fn release_for_cuda(&mut self) -> Result<CudaRelease> {
        if let Backed::Driver(_) = &self.inner {
            return Err(Error::InvalidArgument(
                "a queue on the CUDA driver backend is a CUDA stream itself and makes no releases for CUDA; use \
                 Queue::make_cuda_stream_wait"
                    .into(),
            ));
        }
        let (va, value) = self.cuda_order()?.next_for_cuda()?;
        if let Backed::Direct(q) = &mut self.inner {
            q.release_value(va, value)?;
        }
        Ok(CudaRelease(value))
    }

    /// Makes the CUDA `stream` wait, on the GPU, for `release` ([`release_for_cuda`](Self::release_for_cuda) of
    /// this queue): for the queue's work up to that release, not for what it ran after.
    ///
    /// # Safety
    /// `stream` must be a valid CUDA stream of the attached context, or null.
    pub unsafe fn make_cuda_stream_wait_for(
        &mut self,
        stream: CUstream,
        release: CudaRelease,
    ) -> Result<()> {
        let order = self.cuda_order()?;
        if release.0 == 0 || release.0 > order.released_for_cuda() {
            return Err(Error::InvalidArgument(format!(
                "release {} was not made by this queue (Queue::release_for_cuda)",
                release.0
            )));
        }
        // SAFETY: the caller's promise for `stream`.
        unsafe { order.cuda_waits(stream, release.0) }?;
        Ok(())
    }
}

/// A point in a queue's work that CUDA streams can wait for ([`Queue::release_for_cuda`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CudaRelease(u64);

#[cfg(test)]
mod tests {
    use super::*;

    /// Without libcuda, or without a current context, attaching is a typed error that says what is missing.
    #[test]
    fn attaching_without_a_cuda_context_is_a_typed_error() {
        let e = Gpu::attach_cuda().expect_err("no CUDA context is current on a test thread");
        assert!(
            matches!(
                e,
                Error::Driver(driver::Error::NoLibrary | driver::Error::NoCurrentContext)
            ),
            "{e}"
        );
        assert!(
            e.to_string().contains("CUDA") || e.to_string().contains("libcuda"),
            "{e}"
        );
    }

    /// A queue of a GPU not attached to CUDA makes no releases for CUDA, and no stream waits for a release the
    /// queue never made: typed errors that say why.
    #[test]
    fn releases_for_cuda_need_an_attached_queue_that_made_them() {
        let (gpu, _sim) =
            Gpu::open_simulated(crate::rm::sim::SimConfig::default()).expect("simulated GPU");
        let mut q = gpu.queue().expect("queue");
        let e = q.release_for_cuda().expect_err("not attached");
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("attach_cuda")),
            "{e}"
        );
        // SAFETY: refused before the stream is used.
        let e = unsafe { q.make_cuda_stream_wait_for(std::ptr::null_mut(), CudaRelease(1)) }
            .expect_err("not attached");
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }

    /// Naming a device or a context is checked before anything is attached: without libcuda that is the error;
    /// with it, a device past the last one and a null context are refused by name.
    #[test]
    fn attaching_a_named_device_or_context_checks_the_name() {
        let e = Gpu::attach_cuda_device(usize::MAX).expect_err("no such device");
        assert!(
            matches!(
                e,
                Error::Driver(driver::Error::NoLibrary | driver::Error::InvalidArgument(_))
            ),
            "{e}"
        );
        // SAFETY: a null context is refused before it is used.
        let e =
            unsafe { Gpu::attach_cuda_context(std::ptr::null_mut()) }.expect_err("null context");
        assert!(
            matches!(
                e,
                Error::Driver(driver::Error::NoLibrary | driver::Error::InvalidArgument(_))
            ),
            "{e}"
        );
    }
}
