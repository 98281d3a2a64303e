//! Queues: launches and copies in order on one GPU, like a CUDA stream.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::backend::Backed;
use super::keep::{Endpoint, KeepAlive};
use super::launch_spec::{Launch, PreparedLaunch, What, cooperative_prepared};
use super::peer::{PeerEngines, peer_engines, peer_error};
use super::{Backend, Buffer, Error, Fence, Global, Gpu, HostBuffer, Kernel, QueueOptions, Result};
use crate::driver::{self, LaunchMode as How};
use crate::launch::{Arg, ComputeQueue, ComputeQueueConfig, LaunchConfig};

/// A queue's backend: the direct path's compute queue or the driver backend's stream queue.
pub(super) type QueueInner = Backed<Box<ComputeQueue>, Box<driver::Queue>>;

/// Launches and copies in order on one GPU, like a CUDA stream; each returns a [`Fence`] or waits.
///
/// `Send` but not `Sync`: one thread at a time submits (one queue per thread).
///
/// ```no_run
/// use apex::{Gpu, LaunchConfig};
/// # fn main() -> apex::Result<()> {
/// let gpu = Gpu::open(0)?;
/// let empty = gpu.load_module_file("kernels/apex_test_kernels.sm_90.cubin")?.kernel("empty")?;
/// let mut q = gpu.queue()?;
/// for _ in 0..1000 {
///     // SAFETY: the empty kernel touches no memory.
///     unsafe { q.launch(&empty, &LaunchConfig::linear(1, 32), &[])? };
/// }
/// q.synchronize()?; // every launch above has completed
/// # Ok(())
/// # }
/// ```
pub struct Queue {
    pub(super) inner: QueueInner,
    /// This queue's number, which its [`Ticket`]s carry.
    pub(super) id: u64,
    /// Buffers used by copies in flight, released when their fences complete.
    pub(super) keep: Vec<(Fence, KeepAlive)>,
    pub(super) staging: Option<HostBuffer>,
    /// Ordering with the attached CUDA context's streams.
    pub(super) cuda: Option<driver::CudaOrder>,
    /// The direct path's copy engines for copies between GPUs, one set per (source, destination) pair, built on
    /// first use. Last: dropped after the compute queue, which waits for their copies first.
    pub(super) peer_engines: Vec<PeerEngines>,
}

const STAGING_BYTES: u64 = 32 << 20;

impl fmt::Debug for Queue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Queue")
            .field("backend", &self.backend())
            .finish()
    }
}

impl Queue {
    /// This queue's number, unique in the process (what [`PoolOutOfMemory::held_by`](crate::PoolOutOfMemory)
    /// names queues by).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The backend this queue submits to.
    pub fn backend(&self) -> Backend {
        self.inner.backend()
    }

    /// The direct path's compute queue, when that is the backend.
    pub fn direct(&mut self) -> Option<&mut ComputeQueue> {
        self.inner.direct_mut().map(|q| &mut **q)
    }

    /// The CUDA driver backend's stream, when that is the backend (to order it with other CUDA streams).
    pub fn driver(&self) -> Option<&driver::Stream> {
        self.inner.driver().map(|q| q.stream())
    }

    /// Launches `kernel` over `cfg` with `args`, checked against the kernel's parameter table and the device limits
    /// before anything is submitted, in stream order: the short name of `submit(&Launch::new(kernel, cfg, args))`,
    /// returning the launch's [`Fence`].
    ///
    /// # Safety
    /// The kernel may read and write any memory its arguments lead it to; the caller guarantees those buffers
    /// are not in use elsewhere until the fence completes.
    #[inline]
    pub unsafe fn launch(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<Fence> {
        // SAFETY: forwarded to the caller.
        unsafe { self.submit_fenced(&Launch::new(kernel, cfg, args)) }
    }

    /// Submits `launch` ([`Launch`]: a kernel or a [`PreparedLaunch`], its arguments, its order) in order with
    /// everything else on the queue, and returns its [`Ticket`]: the cheapest launch call, free of reference
    /// counts (a [`Fence`] holds one). [`fence`](Self::fence) turns the ticket into a fence when one is wanted;
    /// [`submit_fenced`](Self::submit_fenced) returns the fence directly. A [`Launch::prepared`] launch allocates
    /// nothing on either backend.
    ///
    /// The ticket completes when the launch does; a chained link's when its chain's part does (on the direct path
    /// the value the open chain is sent with; send it with [`end_chain`](Self::end_chain) or
    /// [`flush`](Self::flush) before waiting on it). On the driver backend a ticket's fence is the stream's: it
    /// completes once everything submitted to the queue before it was made has.
    ///
    /// Refused with [`Error::InvalidArgument`] before anything is submitted: a cooperative launch that is also
    /// programmatic or chained, a cooperative prepared launch; with the launch layer's error: arguments that do not
    /// match the kernel's parameters, a shape outside the device limits, a prepared launch of another queue.
    ///
    /// ```no_run
    /// use apex::{Arg, Gpu, Launch, LaunchConfig};
    /// use std::time::Duration;
    /// # fn main() -> apex::Result<()> {
    /// let gpu = Gpu::open(0)?;
    /// let tests = gpu.load_module_file("kernels/apex_test_kernels.sm_90.cubin")?;
    /// let (empty, count) = (tests.kernel("empty")?, tests.kernel("count_threads")?);
    /// let step = gpu.load_module_file("kernels/apex_pdl.sm_90.cubin")?.kernel("pdl_step")?;
    /// let counter = gpu.alloc(4)?;
    /// let n = 1u32 << 20;
    /// let buf = gpu.alloc(u64::from(n) * 4)?;
    /// let mut q = gpu.queue()?;
    /// let one = LaunchConfig::linear(1, 32);
    /// // SAFETY: empty touches no memory; count_threads adds one per thread to the u32 its argument points at;
    /// // pdl_step runs griddepcontrol.wait before it reads or writes `buf`. Only this queue uses both buffers.
    /// unsafe {
    ///     // A plain launch.
    ///     q.submit(&Launch::new(&empty, &one, &[]))?;
    ///
    ///     // A prepared launch, again and again: the cheapest call. Its ticket becomes a fence when one is wanted.
    ///     let prepared = q.prepare(&count, &one)?;
    ///     let args = [Arg::Ptr(counter.device_ptr())];
    ///     let mut last = None;
    ///     for _ in 0..1000 {
    ///         last = Some(q.submit(&Launch::prepared(&prepared, &args))?);
    ///     }
    ///     if let Some(t) = last {
    ///         q.fence(t)?.wait(Duration::from_secs(10))?;
    ///     }
    ///
    ///     // Programmatic launches: each may start while the one before it finishes.
    ///     let cfg = LaunchConfig::linear(n / 256, 256);
    ///     for v in 0..100u32 {
    ///         q.submit(&Launch::new(&step, &cfg, &[buf.arg(), Arg::U32(n), Arg::U32(v)]).programmatic())?;
    ///     }
    ///
    ///     // A chain: the GPU schedules each link when the one before it has completed.
    ///     for _ in 0..100 {
    ///         q.submit(&Launch::new(&empty, &one, &[]).chained())?;
    ///     }
    ///     q.end_chain()?.wait(Duration::from_secs(10))?;
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Safety
    /// For every launch: the kernel may read and write any memory its arguments lead it to; the caller guarantees
    /// those buffers are not in use elsewhere until the launch completes (its ticket's fence, or a later one: for a
    /// chained link, its chain's).
    ///
    /// For a [`programmatic`](Launch::programmatic) launch, chained or not, also: the kernel must run
    /// `griddepcontrol.wait` before it touches memory the launch before it writes, and must not, before that wait,
    /// write memory the launch before it reads or writes (that launch may still be running).
    ///
    /// A [`cooperative`](Launch::cooperative) or [`chained`](Launch::chained) (not programmatic) launch asks
    /// nothing more than a plain one.
    ///
    /// For a [`Launch::fill`]: its range must be memory the queue's GPU reaches, aligned to the element width, valid
    /// until the fill completes. For a [`Launch::copy`]: both ranges must be memory the queue's GPU reaches, must not
    /// overlap, and must stay valid until the copy completes; nothing else may write the destination meanwhile.
    #[inline]
    pub unsafe fn submit(&mut self, launch: &Launch<'_>) -> Result<Ticket> {
        let how = launch.mode()?;
        // SAFETY: forwarded to the caller.
        let value = unsafe {
            match launch.what {
                What::Prepared(p) => {
                    self.submit_prepared(p, launch.args, how, launch.is_deferred())?
                }
                What::Kernel(k, cfg) => {
                    self.submit_kernel(how, k, cfg, launch.args, launch.is_deferred())?
                }
                What::Fill {
                    dst,
                    value,
                    width,
                    count,
                } => self.submit_fill(dst, value, width, count, launch.is_deferred())?,
                What::Copy { src, dst, bytes } => {
                    self.submit_copy(src, dst, bytes, launch.is_deferred())?
                }
            }
        };
        Ok(Ticket {
            queue: self.id,
            value,
        })
    }

    /// As [`submit`](Self::submit), returning the launch's [`Fence`] instead of its [`Ticket`] (what
    /// `fence(submit(launch)?)` returns), for a caller that keeps or waits on the fence of a prepared, programmatic,
    /// cooperative or chained launch. A fence holds a reference count: where none is wanted, `submit` is cheaper.
    ///
    /// # Safety
    /// As for [`submit`](Self::submit).
    #[inline]
    pub unsafe fn submit_fenced(&mut self, launch: &Launch<'_>) -> Result<Fence> {
        // SAFETY: forwarded to the caller.
        let ticket = unsafe { self.submit(launch)? };
        Ok(self.fence_of(ticket.value))
    }

    /// Checks a launch of `kernel` over `cfg` once, for [`Launch::prepared`] to repeat with new arguments at the
    /// lowest CPU cost: on the direct path the QMD, constant-bank words and limits checks are done here, and each
    /// launch writes only its parameters and completion value. Cooperative launches are not prepared.
    ///
    /// ```no_run
    /// use apex::{Arg, Gpu, Launch, LaunchConfig};
    /// # fn main() -> apex::Result<()> {
    /// let gpu = Gpu::open(0)?;
    /// let module = gpu.load_module_file("kernels/apex_test_kernels.sm_90.cubin")?;
    /// let count = module.kernel("count_threads")?;
    /// let counter = gpu.alloc(4)?;
    /// let mut q = gpu.queue()?;
    /// let step = q.prepare(&count, &LaunchConfig::linear(1, 32))?;
    /// let args = [Arg::Ptr(counter.device_ptr())];
    /// for _ in 0..1000 {
    ///     // SAFETY: count_threads adds one per thread to the u32 its argument points at, used by this queue alone.
    ///     unsafe { q.submit(&Launch::prepared(&step, &args))? };
    /// }
    /// q.synchronize()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn prepare(&mut self, kernel: &Kernel, cfg: &LaunchConfig) -> Result<PreparedLaunch> {
        Ok(PreparedLaunch(
            match self.inner.as_mut().with(kernel.inner().as_ref())? {
                Backed::Direct((q, k)) => Backed::Direct(q.prepare_launch(k, cfg)?),
                Backed::Driver((q, k)) => Backed::Driver(q.prepare(k, cfg)?),
            },
        ))
    }

    /// A fence that completes once the launch `ticket` stands for has (on the driver backend, once the queue's
    /// stream has done everything submitted so far). An error for a ticket of another queue.
    pub fn fence(&self, ticket: Ticket) -> Result<Fence> {
        if ticket.queue != self.id {
            return Err(Error::InvalidArgument(format!(
                "a ticket of queue {} given to queue {}: ask the queue that launched it for its fence",
                ticket.queue, self.id
            )));
        }
        Ok(self.fence_of(ticket.value))
    }

    /// The fence of timeline value `value` (direct path), or of the stream (driver backend).
    #[inline]
    fn fence_of(&self, value: u64) -> Fence {
        match &self.inner {
            Backed::Direct(q) => Fence::from_direct(q.fence_for(value), q),
            Backed::Driver(q) => Fence::from_driver(q.fence()),
        }
    }

    /// A prepared launch, ordered as `how` says (never cooperative: [`Launch::mode`] refuses it); its value on the
    /// queue's timeline (0 on the driver backend). Allocates nothing.
    ///
    /// # Safety
    /// As for [`submit`](Self::submit).
    #[inline]
    unsafe fn submit_prepared(
        &mut self,
        prepared: &PreparedLaunch,
        args: &[Arg<'_>],
        how: How,
        deferred: bool,
    ) -> Result<u64> {
        match self.inner.as_mut().with(prepared.0.as_ref())? {
            // SAFETY: forwarded to the caller.
            Backed::Direct((q, p)) => Ok(unsafe {
                match how {
                    How::Plain if deferred => q.record_prepared_value(p, args, false)?,
                    How::Programmatic if deferred => q.record_prepared_value(p, args, true)?,
                    How::Plain => q.launch_prepared_value(p, args)?,
                    How::Programmatic => q.launch_prepared_programmatic_value(p, args)?,
                    How::Chained => q.record_prepared_chained_value(p, args, false)?,
                    How::ChainedProgrammatic => q.record_prepared_chained_value(p, args, true)?,
                    How::Cooperative => return Err(cooperative_prepared()),
                }
            }),
            Backed::Driver((q, p)) => {
                if how == How::Cooperative {
                    return Err(cooperative_prepared());
                }
                // SAFETY: forwarded to the caller.
                unsafe { q.launch_prepared(p, how, args)? };
                Ok(0)
            }
        }
    }

    /// The one place a launch of a kernel picks its backend: matches the queue's backend with the kernel's and
    /// forwards to the direct path's compute queue or the driver's stream; the launch's value on the queue's
    /// timeline (for a chained link, its chain's part's; 0 on the driver backend).
    ///
    /// # Safety
    /// As for [`submit`](Self::submit).
    #[inline]
    unsafe fn submit_kernel(
        &mut self,
        how: How,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
        deferred: bool,
    ) -> Result<u64> {
        if !how.is_chained() {
            // Any launch but a chained link ends the driver backend's chain, whatever the kernel.
            self.other_work();
        }
        match self.inner.as_mut().with(kernel.inner().as_ref())? {
            // SAFETY: forwarded to the caller.
            Backed::Direct((q, k)) => Ok(unsafe {
                match how {
                    How::Plain if deferred => q.record_launch_value(k, cfg, args, false)?,
                    How::Programmatic if deferred => q.record_launch_value(k, cfg, args, true)?,
                    How::Plain => q.launch_value(k, cfg, args)?,
                    How::Cooperative => q.launch_cooperative_value(k, cfg, args)?,
                    How::Programmatic => q.launch_programmatic_value(k, cfg, args)?,
                    How::Chained => q.record_chained_value(k, cfg, args, false)?,
                    How::ChainedProgrammatic => q.record_chained_value(k, cfg, args, true)?,
                }
            }),
            Backed::Driver((q, k)) => {
                // SAFETY: forwarded to the caller.
                unsafe { q.launch(how, k, cfg, args)? };
                Ok(0)
            }
        }
    }

    /// A [`Launch::fill`]: its value on the queue's timeline (0 on the driver backend).
    ///
    /// # Safety
    /// As for [`fill_addresses`](Self::fill_addresses).
    unsafe fn submit_fill(
        &mut self,
        dst: u64,
        value: u32,
        width: u32,
        count: u64,
        deferred: bool,
    ) -> Result<u64> {
        if count == 0 {
            // Refused on both backends alike (cuMemsetD*Async would accept it).
            return Err(Error::InvalidArgument("a fill of 0 elements".into()));
        }
        self.other_work();
        match &mut self.inner {
            Backed::Direct(q) => {
                // SAFETY: forwarded to the caller.
                let v = unsafe { q.record_fill_value(dst, value, width, count)? };
                if !deferred {
                    q.flush();
                }
                Ok(v)
            }
            Backed::Driver(q) => {
                // SAFETY: forwarded to the caller.
                unsafe { q.fill(dst, value, width, count)? };
                Ok(0)
            }
        }
    }

    /// A [`Launch::copy`]: its value on the queue's timeline (0 on the driver backend).
    ///
    /// # Safety
    /// As for [`copy_addresses`](Self::copy_addresses).
    unsafe fn submit_copy(
        &mut self,
        src: u64,
        dst: u64,
        bytes: u64,
        deferred: bool,
    ) -> Result<u64> {
        if bytes == 0 {
            return Err(Error::InvalidArgument("a copy of 0 bytes".into()));
        }
        self.other_work();
        match &mut self.inner {
            Backed::Direct(q) => {
                // SAFETY: forwarded to the caller.
                let v = unsafe { q.record_copy_device_value(src, dst, bytes)? };
                if !deferred {
                    q.flush();
                }
                Ok(v)
            }
            Backed::Driver(_) => {
                self.copy_raw(src, dst, bytes)?;
                Ok(0)
            }
        }
    }

    /// Ends the chain recorded by [`chained`](Launch::chained) launches and submits it; the fence completes when
    /// its last launch has. An error if no chained launch was recorded since the chain last ended.
    pub fn end_chain(&mut self) -> Result<Fence> {
        match &mut self.inner {
            Backed::Direct(q) => {
                let f = q.end_chain()?;
                Ok(Fence::from_direct(f, q))
            }
            Backed::Driver(q) => Ok(Fence::from_driver(q.end_chain()?)),
        }
    }

    /// Sends everything the queue holds: [`deferred`](Launch::deferred) launches (one doorbell for all of them), the
    /// links a chained queue ([`QueueOptions::chained`]) holds back while the GPU is busy, and an open chain of
    /// [`chained`](Launch::chained) launches (ended as [`end_chain`](Self::end_chain) ends it). Needed only before
    /// waiting on a fence of such a launch while making no other call on the queue; every other call sends them
    /// first anyway.
    pub fn flush(&mut self) -> Result<()> {
        match &mut self.inner {
            Backed::Direct(q) => Ok(q.flush_held()?),
            Backed::Driver(q) => {
                q.end_chain_silently();
                Ok(())
            }
        }
    }

    /// Waits until everything submitted so far is complete.
    pub fn synchronize(&mut self) -> Result<()> {
        match &mut self.inner {
            Backed::Direct(q) => q.synchronize()?,
            Backed::Driver(q) => q.synchronize()?,
        }
        self.keep.clear();
        Ok(())
    }

    /// Work other than a chained launch ends the driver backend's chain, even work refused before it reaches the
    /// backend (a mismatched fence, a range outside a buffer); the direct path's queue ends its own.
    pub(super) fn other_work(&mut self) {
        if let Backed::Driver(q) = &mut self.inner {
            q.end_chain_silently();
        }
    }

    pub(super) fn prune(&mut self) {
        self.keep.retain(|(f, _)| !f.is_done());
    }

    /// Copies pinned host memory to the device (asynchronous; both buffers are kept alive until done).
    pub fn copy_host_to_device(
        &mut self,
        src: &HostBuffer,
        src_offset: u64,
        dst: &Buffer,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<Fence> {
        self.copy_kept(
            src.endpoint(src_offset),
            dst.endpoint(dst_offset),
            bytes,
            false,
        )
    }

    /// Copies device memory to pinned host memory (asynchronous).
    pub fn copy_device_to_host(
        &mut self,
        src: &Buffer,
        src_offset: u64,
        dst: &HostBuffer,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<Fence> {
        self.copy_kept(
            src.endpoint(src_offset),
            dst.endpoint(dst_offset),
            bytes,
            false,
        )
    }

    /// Copies between device buffers (asynchronous). On the direct path the SMs copy (a built-in kernel): the
    /// copy engine moves device memory at a twentieth of the HBM's bandwidth. Buffers of two GPUs opened with
    /// [`Gpu::open_peers`] are copied by the source GPU's copy engines (the ones RM names optimal for writing the
    /// destination, built on first use and kept by the queue), into the destination's memory mapped on the
    /// source, in this queue's order; [`Error::NotPeers`](super::Error::NotPeers) when the GPUs cannot reach each
    /// other. On the driver backend, `cuMemcpyPeerAsync`.
    pub fn copy_device_to_device(
        &mut self,
        src: &Buffer,
        src_offset: u64,
        dst: &Buffer,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<Fence> {
        if let Some(f) = self.copy_between_gpus(src, src_offset, dst, dst_offset, bytes)? {
            return Ok(f);
        }
        self.copy_kept(
            src.endpoint(src_offset),
            dst.endpoint(dst_offset),
            bytes,
            true,
        )
    }

    /// A copy where a buffer belongs to another GPU than the queue's: on the driver backend, `cuMemcpyPeerAsync`;
    /// on the direct path, the source GPU's copy engines writing into the destination's memory mapped on the
    /// source, after the queue's earlier work (the engines wait for the queue's timeline, the queue for theirs).
    /// [`Error::NotPeers`] when the GPUs cannot reach each other. `None` when both buffers are the queue's own.
    fn copy_between_gpus(
        &mut self,
        src: &Buffer,
        src_offset: u64,
        dst: &Buffer,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<Option<Fence>> {
        let local = match (&self.inner, &*src.inner, &*dst.inner) {
            (Backed::Direct(q), Backed::Direct(s), Backed::Direct(d)) => {
                Arc::ptr_eq(s.gpu(), q.gpu()) && Arc::ptr_eq(d.gpu(), q.gpu())
            }
            (Backed::Driver(q), Backed::Driver(s), Backed::Driver(d)) => q.owns(s) && q.owns(d),
            _ => return Err(Error::Mismatch),
        };
        if local {
            return Ok(None);
        }
        check_range(src.size, src_offset, bytes)?;
        check_range(dst.size, dst_offset, bytes)?;
        if bytes == 0 {
            return Err(Error::InvalidArgument("a copy of 0 bytes".into()));
        }
        let f = match (&mut self.inner, &*src.inner, &*dst.inner) {
            (Backed::Direct(q), Backed::Direct(s), Backed::Direct(d)) => {
                let (from, to) = (s.gpu().clone(), d.gpu().clone());
                // The source GPU's engines write the destination's memory through its mapping there (what RM's
                // optimal write CEs are for); a no-op after the first copy.
                d.map_on(&from).map_err(peer_error)?;
                let engines = peer_engines(&mut self.peer_engines, &from, &to)?;
                let f = q
                    .copy_on(engines, s.va() + src_offset, d.va() + dst_offset, bytes)
                    .map_err(peer_error)?;
                Fence::from_direct(f, q)
            }
            // SAFETY: both ranges were checked; the queue keeps both buffers alive until the copy completes.
            (Backed::Driver(q), Backed::Driver(s), Backed::Driver(d)) => {
                Fence::from_driver(unsafe { q.copy_peer(s, src_offset, d, dst_offset, bytes)? })
            }
            _ => return Err(Error::Mismatch),
        };
        self.prune();
        self.keep.push((f.clone(), KeepAlive::Device(src.clone())));
        self.keep.push((f.clone(), KeepAlive::Device(dst.clone())));
        Ok(Some(f))
    }

    /// Checks both ranges, copies, and keeps both buffers alive until the copy's fence completes.
    fn copy_kept(
        &mut self,
        (src, src_size, src_offset, src_keep): Endpoint,
        (dst, dst_size, dst_offset, dst_keep): Endpoint,
        bytes: u64,
        device_to_device: bool,
    ) -> Result<Fence> {
        // Other work ends a chain, on both backends.
        self.other_work();
        check_range(src_size, src_offset, bytes)?;
        check_range(dst_size, dst_offset, bytes)?;
        let (s, d) = (src + src_offset, dst + dst_offset);
        let f = match &mut self.inner {
            Backed::Direct(q) if device_to_device && bytes > 0 => {
                // SAFETY: both ranges were checked against their device buffers, which stay alive until done.
                let f = unsafe { q.copy_device(s, d, bytes)? };
                let f = Fence::from_direct(f, q);
                self.prune();
                f
            }
            _ => self.copy_raw(s, d, bytes)?,
        };
        self.keep.push((f.clone(), src_keep));
        self.keep.push((f.clone(), dst_keep));
        Ok(f)
    }

    /// Copies `bytes` from GPU address `src` to GPU address `dst` in this queue's order (asynchronous: the fence
    /// completes with the copy), for memory APEX did not allocate: on a GPU attached to a CUDA context
    /// ([`Gpu::attach_cuda`](super::Gpu::attach_cuda)), a `CUdeviceptr` or pinned host memory's device pointer. On
    /// the direct path the SMs copy (the built-in copy kernel, launched like any kernel: a small copy completes in
    /// a launch's time, a large one at the HBM's bandwidth); on the driver backend, `cuMemcpyAsync`. An error for 0
    /// bytes.
    ///
    /// # Safety
    /// Both ranges must be memory the queue's GPU reaches at these addresses (device memory, or host memory mapped
    /// for it) for `bytes` bytes, and stay so until the fence completes; nothing else may write `dst` meanwhile.
    pub unsafe fn copy_addresses(
        &mut self,
        src: impl Into<crate::DevicePtr>,
        dst: impl Into<crate::DevicePtr>,
        bytes: u64,
    ) -> Result<Fence> {
        let (src, dst) = (src.into().0, dst.into().0);
        self.other_work();
        match &mut self.inner {
            Backed::Direct(q) if bytes > 0 => {
                // SAFETY: forwarded to the caller.
                let value = unsafe { q.record_copy_device_value(src, dst, bytes)? };
                let f = fence_then_ring(q, value);
                self.prune();
                Ok(f)
            }
            _ => self.copy_raw(src, dst, bytes),
        }
    }

    /// Sets `count` elements of `width` bytes (1, 2 or 4) at GPU address `dst` to the low bytes of `value`, in this
    /// queue's order (asynchronous), as `cuMemsetD8Async`/`D16`/`D32` do: on the direct path with the built-in fill
    /// kernel, on the driver backend with those functions. For memory APEX did not allocate, as
    /// [`copy_addresses`](Self::copy_addresses).
    ///
    /// # Safety
    /// `dst` must be memory the queue's GPU reaches for `count * width` bytes, aligned to `width`, and stay so until
    /// the fence completes.
    pub unsafe fn fill_addresses(
        &mut self,
        dst: u64,
        value: u32,
        width: u32,
        count: u64,
    ) -> Result<Fence> {
        self.other_work();
        match &mut self.inner {
            Backed::Direct(q) => {
                // SAFETY: forwarded to the caller.
                let v = unsafe { q.record_fill_value(dst, value, width, count)? };
                Ok(fence_then_ring(q, v))
            }
            // SAFETY: forwarded to the caller.
            Backed::Driver(q) => Ok(Fence::from_driver(unsafe {
                q.fill(dst, value, width, count)?
            })),
        }
    }

    fn copy_raw(&mut self, src: u64, dst: u64, bytes: u64) -> Result<Fence> {
        if bytes == 0 {
            return Err(Error::InvalidArgument("a copy of 0 bytes".into()));
        }
        self.prune();
        match &mut self.inner {
            Backed::Direct(q) => {
                let f = q.copy(src, dst, bytes)?;
                Ok(Fence::from_direct(f, q))
            }
            // SAFETY: the queue keeps both buffers alive until the copy's fence completes.
            Backed::Driver(q) => Ok(Fence::from_driver(unsafe { q.copy(src, dst, bytes)? })),
        }
    }

    /// Writes `data` into the module variable `dst` at byte `offset` (cudaMemcpyToSymbol), after the work
    /// submitted to this queue so far; returns when the copy is complete, so every later launch, on this queue or
    /// another, sees it. A `__constant__` variable included: every launch invalidates the SMs' constant caches.
    pub fn copy_to_global(
        &mut self,
        gpu: &Gpu,
        dst: &Global,
        offset: u64,
        data: &[u8],
    ) -> Result<()> {
        self.same_backend(dst)?;
        let at = dst.range(offset, data.len() as u64)?;
        self.upload_to(gpu, at, data)
    }

    /// Reads `out.len()` bytes of the module variable `src` from byte `offset` (cudaMemcpyFromSymbol), after the
    /// work submitted to this queue so far; returns when the copy is complete.
    pub fn copy_from_global(
        &mut self,
        gpu: &Gpu,
        src: &Global,
        offset: u64,
        out: &mut [u8],
    ) -> Result<()> {
        self.same_backend(src)?;
        let at = src.range(offset, out.len() as u64)?;
        self.download_from(gpu, at, out)
    }

    /// Copies pinned host memory into a module variable (asynchronous, in stream order; cudaMemcpyToSymbolAsync).
    /// Launches on other queues see it once the fence has completed.
    pub fn copy_host_to_global(
        &mut self,
        src: &HostBuffer,
        src_offset: u64,
        dst: &Global,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<Fence> {
        self.same_backend(dst)?;
        dst.range(dst_offset, bytes)?;
        self.copy_kept(
            src.endpoint(src_offset),
            dst.endpoint(dst_offset),
            bytes,
            false,
        )
    }

    /// Copies a module variable into pinned host memory (asynchronous, in stream order;
    /// cudaMemcpyFromSymbolAsync).
    pub fn copy_global_to_host(
        &mut self,
        src: &Global,
        src_offset: u64,
        dst: &HostBuffer,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<Fence> {
        self.same_backend(src)?;
        src.range(src_offset, bytes)?;
        self.copy_kept(
            src.endpoint(src_offset),
            dst.endpoint(dst_offset),
            bytes,
            false,
        )
    }

    fn same_backend(&self, g: &Global) -> Result<()> {
        if g.backend() == self.backend() {
            Ok(())
        } else {
            Err(Error::Mismatch)
        }
    }

    /// Copies pageable host memory to the device; returns when the copy is complete.
    pub fn upload(&mut self, gpu: &Gpu, dst: &Buffer, dst_offset: u64, data: &[u8]) -> Result<()> {
        check_range(dst.size, dst_offset, data.len() as u64)?;
        self.upload_to(gpu, dst.device_ptr() + dst_offset, data)
    }

    /// Copies `data` to the device address `dst` (checked by the caller) in stream order; returns when complete.
    fn upload_to(&mut self, gpu: &Gpu, dst: u64, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        if let Backed::Driver(q) = &mut self.inner {
            return Ok(q.upload(dst, data)?);
        }
        let staging = self.staging(gpu)?;
        let half = STAGING_BYTES / 2;
        let mut fences: [Option<Fence>; 2] = [None, None];
        for (i, chunk) in data.chunks(half as usize).enumerate() {
            let slot = i % 2;
            if let Some(f) = fences[slot].take() {
                f.wait(Duration::from_secs(30))?;
            }
            staging.write(slot as u64 * half, chunk)?;
            let off = (i as u64) * half;
            fences[slot] = Some(self.copy_raw(
                staging.device_ptr() + slot as u64 * half,
                dst + off,
                chunk.len() as u64,
            )?);
        }
        for f in fences.into_iter().flatten() {
            f.wait(Duration::from_secs(30))?;
        }
        Ok(())
    }

    /// Copies device memory to pageable host memory; returns when the copy is complete.
    pub fn download(
        &mut self,
        gpu: &Gpu,
        src: &Buffer,
        src_offset: u64,
        out: &mut [u8],
    ) -> Result<()> {
        check_range(src.size, src_offset, out.len() as u64)?;
        self.download_from(gpu, src.device_ptr() + src_offset, out)
    }

    /// Copies from the device address `src` (checked by the caller) into `out` in stream order; returns when
    /// complete.
    fn download_from(&mut self, gpu: &Gpu, src: u64, out: &mut [u8]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        if let Backed::Driver(q) = &mut self.inner {
            return Ok(q.download(src, out)?);
        }
        let staging = self.staging(gpu)?;
        let half = STAGING_BYTES / 2;
        let n = out.len().div_ceil(half as usize);
        let mut pending: Option<(usize, Fence)> = None;
        for i in 0..=n {
            // Start chunk i while the CPU drains chunk i-1.
            let next = if i < n {
                let slot = (i % 2) as u64;
                let off = i as u64 * half;
                let len = (out.len() as u64 - off).min(half);
                Some((
                    i,
                    self.copy_raw(src + off, staging.device_ptr() + slot * half, len)?,
                ))
            } else {
                None
            };
            if let Some((j, f)) = pending.take() {
                f.wait(Duration::from_secs(30))?;
                let off = j as u64 * half;
                let len = (out.len() as u64 - off).min(half) as usize;
                staging.read(
                    (j % 2) as u64 * half,
                    &mut out[off as usize..off as usize + len],
                )?;
            }
            pending = next;
        }
        Ok(())
    }

    fn staging(&mut self, gpu: &Gpu) -> Result<HostBuffer> {
        if self.staging.is_none() {
            self.staging = Some(gpu.alloc_host(STAGING_BYTES)?);
        }
        self.staging
            .clone()
            .ok_or(Error::InvalidArgument("staging buffer".into()))
    }
}

/// Where a launch stands in its queue's order, without holding on to the queue: `Copy`, and free to make and to
/// drop. [`Queue::fence`] turns it into a [`Fence`] when one is wanted.
///
/// A [`Fence`] holds a reference count. Taking it and dropping it are locked instructions, and a locked instruction
/// makes the CPU wait until every store before it has left the core: the launch's own stores and its doorbell
/// (0.1 to 0.3 µs per launch on an H100 machine, BENCHMARKS.md). [`Queue::submit`] returns a ticket
/// instead, for callers that wait on the queue or on a later launch.
///
/// ```no_run
/// use apex::{Arg, Gpu, Launch, LaunchConfig};
/// # fn main() -> apex::Result<()> {
/// let gpu = Gpu::open(0)?;
/// let module = gpu.load_module_file("kernels/apex_test_kernels.sm_90.cubin")?;
/// let count = module.kernel("count_threads")?;
/// let counter = gpu.alloc(4)?;
/// let mut q = gpu.queue()?;
/// let step = q.prepare(&count, &LaunchConfig::linear(1, 32))?;
/// let args = [Arg::Ptr(counter.device_ptr())];
/// let mut last = None;
/// for _ in 0..1000 {
///     // SAFETY: count_threads adds one per thread to the u32 its argument points at, used by this queue alone.
///     last = Some(unsafe { q.submit(&Launch::prepared(&step, &args))? });
/// }
/// if let Some(t) = last {
///     q.fence(t)?.wait(std::time::Duration::from_secs(10))?;
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ticket {
    queue: u64,
    /// The launch's value on the queue's timeline (direct path); 0 on the driver backend, whose fences wait for
    /// the stream.
    value: u64,
}

/// Numbers queues for their [`Ticket`]s.
fn next_queue_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The fence of recorded work at `value`, made before the doorbell that sends the work is rung: its reference counts
/// (locked instructions) would otherwise wait for the doorbell's stores to leave the CPU.
fn fence_then_ring(q: &mut ComputeQueue, value: u64) -> Fence {
    let fence = Fence::from_direct(q.fence_for(value), q);
    q.flush();
    fence
}

pub(super) fn check_range(size: u64, offset: u64, len: u64) -> Result<()> {
    if offset.checked_add(len).is_none_or(|e| e > size) {
        return Err(Error::InvalidArgument(format!(
            "range {offset:#x}+{len:#x} outside a {size:#x}-byte buffer"
        )));
    }
    Ok(())
}

impl Gpu {
    /// A queue: launches and copies on it run in order, like a CUDA stream.
    pub fn queue(&self) -> Result<Queue> {
        self.queue_with(QueueOptions::default())
    }

    /// A queue built as `options` say (the driver backend has nothing to choose and ignores them).
    ///
    /// ```no_run
    /// use apex::{Gpu, LaunchMemory, QueueOptions};
    /// # fn main() -> apex::Result<()> {
    /// let gpu = Gpu::open(0)?;
    /// // The lowest CPU cost per launch, for a launch-bound program that does not wait on each launch.
    /// let q = gpu.queue_with(QueueOptions::default().launch_memory(LaunchMemory::Host))?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn queue_with(&self, options: QueueOptions) -> Result<Queue> {
        let inner: QueueInner = match &self.inner {
            Backed::Direct(c) => {
                let config = Self::queue_config(&options);
                // The queue that proved the direct path was built with the default configuration; chaining is
                // a setting of a built queue.
                let spare = (config == ComputeQueueConfig::default())
                    .then(|| self.spare.take())
                    .flatten();
                let mut queue = match spare {
                    Some(q) => q,
                    None => Box::new(ComputeQueue::new(c, config)?),
                };
                queue.set_chained_stream(options.chained)?;
                Backed::Direct(queue)
            }
            Backed::Driver(ctx) => Backed::Driver(Box::new(driver::Queue::new(ctx, self.limits)?)),
        };
        Ok(Queue {
            inner,
            id: next_queue_id(),
            keep: Vec::new(),
            staging: None,
            cuda: self.cuda.clone().map(driver::CudaOrder::new),
            peer_engines: Vec::new(),
        })
    }

    /// Whether [`queue_with`](Gpu::queue_with)`(options)` would hand out a queue built already: the one that proved
    /// the direct path when the GPU was opened or attached, kept for the first queue of the default configuration.
    /// Such a queue costs nothing to take, where a new one costs milliseconds (RM's channel creation).
    ///
    /// ```no_run
    /// # use apex::{Gpu, QueueOptions};
    /// # fn main() -> apex::Result<()> {
    /// let gpu = Gpu::open(0)?;
    /// assert!(gpu.queue_is_built(QueueOptions::default()));
    /// let _q = gpu.queue()?;
    /// assert!(!gpu.queue_is_built(QueueOptions::default()));
    /// # Ok(())
    /// # }
    /// ```
    pub fn queue_is_built(&self, options: QueueOptions) -> bool {
        match &self.inner {
            Backed::Direct(_) => {
                Self::queue_config(&options) == ComputeQueueConfig::default()
                    && self.spare.is_kept()
            }
            Backed::Driver(_) => false,
        }
    }

    /// The compute queue configuration `options` asks for.
    fn queue_config(options: &QueueOptions) -> ComputeQueueConfig {
        ComputeQueueConfig::default()
            .with_memory(options.launch_memory)
            .with_polling(options.polled)
    }
}
